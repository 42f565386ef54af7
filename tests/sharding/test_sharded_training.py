"""Drafter training on a mesh of 8 fake CPU devices equals training on one device (fp32 tolerance): two steps
on data=8, checkpointed, then resumed on data=2,model=4 for two more, against the same four steps unsharded.
The compiled train step receives the drafter's parameters and Adam moments split over `data` (FSDP) and, on
the second mesh, over `model` too (read from the executable's input shardings).

jax fixes its device count when it starts, so the run happens in `sharded_training_run.py`, a process
started with XLA_FLAGS=--xla_force_host_platform_device_count=8.
"""

from __future__ import annotations

import numpy as np
from eight_devices import run_on_8_devices, split_dims

FIRST, SECOND = "data=8", "data=2,model=4"


def run_worker(spec: dict) -> dict:
    """Runs `sharded_training_run.py` on 8 fake devices and returns its report."""
    return run_on_8_devices("sharded_training_run.py", spec, timeout=900)


def assert_close_params(got: dict, expected: dict, label: str) -> None:
    assert got.keys() == expected.keys()
    for name in expected:
        np.testing.assert_allclose(got[name], expected[name], rtol=2e-4, atol=2e-6, err_msg=f"{label} {name}")


def test_training_on_data_8_resumed_on_data_2_model_4_equals_one_device(tiny_checkpoint, tmp_path):
    spec = dict(target=str(tiny_checkpoint("qwen3-8kv")[0]), out=str(tmp_path), first_mesh=FIRST,
                second_mesh=SECOND)  # fmt: skip
    report = run_worker(spec)
    single, sharded = report["unsharded"], report["sharded"]

    assert list(sharded["losses"]) == ["1", "2", "3", "4"]
    np.testing.assert_allclose(list(sharded["losses"].values()), list(single["losses"].values()), rtol=1e-5)
    assert_close_params(sharded["params_2"], single["params_2"], f"step 2 on {FIRST}")
    assert_close_params(sharded["params_4"], single["params_4"], f"step 4 resumed on {SECOND}")
    moved = [n for n in single["params_4"] if not np.allclose(single["params_4"][n], single["params_2"][n])]
    assert len(moved) > len(single["params_4"]) // 2  # the steps really changed the drafter

    fsdp = report["shards"][FIRST]
    for kind in ("params", "mu"):  # [out, in] weights: the larger dimension over data
        assert split_dims(fsdp, f"{kind}:layers_0/mlp/gate_proj/weight") == [8, 1]  # [128, 64]
        assert split_dims(fsdp, f"{kind}:layers_0/mlp/down_proj/weight") == [1, 8]  # [64, 128]
        assert split_dims(fsdp, f"{kind}:layers_1/self_attn/q_proj/weight") == [8, 1]  # [128, 64]
        assert split_dims(fsdp, f"{kind}:fc/weight") in ([1, 8], [8, 1])
        assert split_dims(fsdp, f"{kind}:norm/weight") == [1]  # vectors stay whole
    both = report["shards"][SECOND]
    for kind in ("params", "mu"):  # model takes its tensor-parallel dimension, data the other one
        assert split_dims(both, f"{kind}:layers_0/mlp/gate_proj/weight") == [4, 2]
        assert split_dims(both, f"{kind}:layers_0/mlp/down_proj/weight") == [2, 4]
        assert split_dims(both, f"{kind}:layers_1/self_attn/o_proj/weight") == [2, 4]
        assert split_dims(both, f"{kind}:fc/weight") == [2, 4]
