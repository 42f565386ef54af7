"""Generation on a (data, model) mesh of 8 fake CPU devices equals generation on one device, token for
token: plain and DFlash decoding, at T=0 and at T=1 with the same seeds. The compiled decode loop receives
every large matrix split over `model` (read from the executable's input shardings).

jax fixes its device count when it starts, so each case runs `sharded_run.py` in a process started with
XLA_FLAGS=--xla_force_host_platform_device_count=8; the rest of the suite keeps one device.
"""

from __future__ import annotations

import pytest
from eight_devices import run_on_8_devices, split_dims

PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30]]  # 3 rows: padded to D


def run_sharded(spec: dict) -> dict:
    """Runs `sharded_run.py` on 8 fake devices and returns its report."""
    return run_on_8_devices("sharded_run.py", spec, timeout=1500)


def assert_same_tokens(report: dict) -> None:
    expected = report["unsharded"]
    for mesh, got in report["meshes"].items():
        for run, tokens in got["tokens"].items():
            assert tokens == expected[run], f"{mesh} {run}: {tokens} != unsharded {expected[run]}"
            assert all(len(t) > 0 for t in tokens)


def test_tiny_qwen3_with_8_kv_heads_on_data_model_and_both(tiny_checkpoint):
    spec = dict(
        target=str(tiny_checkpoint("qwen3-8kv")[0]), drafter="untrained", block_size=4,
        meshes=["data=8", "model=8", "data=2,model=4"], prompts=PROMPTS, max_new_tokens=10,
    )  # fmt: skip
    report = run_sharded(spec)
    assert_same_tokens(report)
    for mesh, model in (("model=8", 8), ("data=2,model=4", 4)):
        shards = report["meshes"][mesh]["shards"]
        layer = "target:layers_1/"
        assert split_dims(shards, layer + "self_attn/q_proj/weight") == [model, 1]
        assert split_dims(shards, layer + "self_attn/k_proj/weight") == [model, 1]  # 8 KV heads split
        assert split_dims(shards, layer + "self_attn/v_proj/weight") == [model, 1]
        assert split_dims(shards, layer + "self_attn/o_proj/weight") == [1, model]
        assert split_dims(shards, layer + "mlp/gate_proj/weight") == [model, 1]
        assert split_dims(shards, layer + "mlp/up_proj/weight") == [model, 1]
        assert split_dims(shards, layer + "mlp/down_proj/weight") == [1, model]
        assert split_dims(shards, "target:embed_tokens/weight") == [model, 1]
        assert split_dims(shards, "target:lm_head/weight") == [model, 1]
        assert split_dims(shards, "target:norm/weight") == [1]  # small vectors stay whole
        assert split_dims(shards, "drafter:layers_0/mlp/down_proj/weight") == [1, model]
        assert split_dims(shards, "drafter:fc/weight") == [1, model]
        data = 8 // model
        assert split_dims(shards, "cache:k0") == [data, model, 1, 1]  # rows over data, KV heads over model
    shards = report["meshes"]["data=8"]["shards"]
    assert split_dims(shards, "target:layers_1/self_attn/q_proj/weight") == [1, 1]  # data parallel only
    assert split_dims(shards, "cache:k0") == [8, 1, 1, 1]


def test_tiny_qwen3_with_kv_heads_replicated(tiny_checkpoint):
    """4 query heads over 2 KV heads on model=4: KV heads are replicated, each device reads its own one.
    DFlash trees run here too (one mesh keeps the test short)."""
    spec = dict(
        target=str(tiny_checkpoint("qwen3")[0]), drafter="untrained", block_size=4, tree_budget=6,
        meshes=["data=2,model=4"], prompts=PROMPTS, max_new_tokens=10,
    )  # fmt: skip
    report = run_sharded(spec)
    assert_same_tokens(report)
    shards = report["meshes"]["data=2,model=4"]["shards"]
    assert split_dims(shards, "target:layers_0/self_attn/q_proj/weight") == [4, 1]
    assert split_dims(shards, "target:layers_0/self_attn/k_proj/weight") == [1, 1]
    assert split_dims(shards, "cache:k0") == [2, 1, 1, 1]


@pytest.mark.slow
def test_smollm2_on_data_2_model_3():
    """The real SmolLM2-135M (9 heads, 3 KV heads) with its shipped drafter on 6 of the 8 devices."""
    spec = dict(
        target="smollm2-135m", drafter="shipped", block_size=4,
        meshes=["data=2,model=3"], prompts=[[504, 3458, 282, 4649, 314], [19556, 28, 957]], max_new_tokens=6,
    )  # fmt: skip
    report = run_sharded(spec)
    assert_same_tokens(report)
    shards = report["meshes"]["data=2,model=3"]["shards"]
    assert split_dims(shards, "target:layers_0/self_attn/k_proj/weight") == [3, 1]
    assert split_dims(shards, "target:embed_tokens/weight") == [3, 1]
