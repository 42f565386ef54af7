"""DFlash checkpoints: the official z-lab/dflash layout round-trips, and a drafter that does not fit its
target fails at load time with one clear message."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import dflax
from dflax.checkpoints.params import CheckpointError
from dflax.decoding.sampling import SamplingParams
from dflax.drafters import DFlashConfig, load_drafter
from dflax.drafters.checkpoint import config_from_json, config_to_json, save_drafter
from dflax.drafters.dflash import DFlashDrafter, init_drafter_params
from dflax.runtime.static_batches import generate_ids

PROMPTS = [[5, 6, 7, 8, 9], [11, 12]]


@pytest.fixture(scope="module")
def target(tiny_checkpoint):
    return dflax.load_target(str(tiny_checkpoint("llama")[0]))


def tokens_with(target, drafter):
    results = generate_ids(
        target,
        PROMPTS,
        max_new_tokens=12,
        sampling=SamplingParams.make(),
        row_seeds=[0, 1],
        batch_size=2,
        drafter=drafter,
    )
    return [r.tokens for r in results], [r.stats["accept_hist"] for r in results]


def official_names(num_layers: int) -> set[str]:
    per_layer = [
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
    ]
    names = {f"layers.{i}.{n}" for i in range(num_layers) for n in per_layer}
    return names | {"fc.weight", "hidden_norm.weight", "norm.weight"}


def test_save_load_round_trip_in_official_layout(tmp_path, target):
    drafter = load_drafter("untrained", target, block_size=4, seed=3)
    drafter.save(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["block_size"] == 16 and config["model_type"] == "qwen3"
    assert config["dflash_config"] == {
        "target_layer_ids": list(drafter.config.target_layer_ids),
        "mask_token_id": None,
    }
    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert names == official_names(drafter.config.layers.num_layers) | {"mask_embedding"}

    loaded = load_drafter(tmp_path, target, block_size=4)
    assert loaded.config == drafter.config
    jax.tree.map(np.testing.assert_array_equal, loaded.params, drafter.params)
    assert tokens_with(target, loaded) == tokens_with(target, drafter)


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("layer_arch", ["qwen3", "llama"])
def test_config_round_trips_tied_embeddings_and_layer_kind(tmp_path, target, tie, layer_arch):
    config = DFlashConfig.for_target(target.config, 2, 8, layer_arch=layer_arch)
    config = dataclasses.replace(config, layers=dataclasses.replace(config.layers, tie_word_embeddings=tie))
    data = config_to_json(config, target.config.num_layers)
    assert data["tie_word_embeddings"] is tie and data["model_type"] == layer_arch
    assert config_from_json(json.loads(json.dumps(data))) == config

    module = DFlashDrafter(config)
    params = init_drafter_params(module, seed=2)
    save_drafter(tmp_path, config, params, target.config.num_layers)
    loaded = load_drafter(tmp_path, target)
    assert loaded.config == config
    jax.tree.map(np.testing.assert_array_equal, loaded.params, params)
    has_qk_norm = any("q_norm" in name for name in load_file(str(tmp_path / "model.safetensors")))
    assert has_qk_norm == (layer_arch == "qwen3")  # Llama-kind layers have no q/k norms


def test_unknown_drafter_layer_kind_is_refused(tmp_path, target):
    data = config_to_json(DFlashConfig.for_target(target.config, 2, 8), target.config.num_layers)
    with pytest.raises(CheckpointError, match="model_type 'gemma3'"):
        config_from_json({**data, "model_type": "gemma3"})
    with pytest.raises(ValueError, match="kind 'gemma3'"):
        DFlashConfig.for_target(target.config, 2, 8, layer_arch="gemma3")


def test_bfloat16_weights_load(tmp_path, target):
    drafter = load_drafter("untrained", target, block_size=4)
    drafter.save(tmp_path, dtype="bfloat16")
    loaded = load_drafter(tmp_path, target, block_size=4)
    expected = jax.tree.map(lambda x: np.asarray(x.astype("bfloat16").astype("float32")), drafter.params)
    jax.tree.map(np.testing.assert_array_equal, loaded.params, expected)


def test_mask_token_id_checkpoint_uses_the_target_row(tmp_path, target):
    """Official Qwen3 drafters name a mask token id instead of storing a mask embedding."""
    drafter = load_drafter("untrained", target, block_size=4)
    drafter.save(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["dflash_config"]["mask_token_id"] = 2
    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["mask_embedding"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    loaded = load_drafter(tmp_path, target, block_size=4)
    assert loaded.config.mask_token_id == 2 and "mask_embedding" not in loaded.params["params"]
    expected, _ = tokens_with(target, None)
    got, _ = tokens_with(target, loaded)
    assert got == expected


def test_feature_norm_round_trips_and_normalizes_each_tap(tmp_path, target):
    """dflax's feature_norm option is saved in dflash_config and makes fc see unit-RMS taps."""
    plain = load_drafter("untrained", target, block_size=4)
    config = dataclasses.replace(plain.config, feature_norm=True)
    save_drafter(tmp_path, config, plain.params, target.config.num_layers)
    assert json.loads((tmp_path / "config.json").read_text())["dflash_config"]["feature_norm"] is True
    normed = load_drafter(tmp_path, target, block_size=4)
    assert normed.config.feature_norm and normed.config == config

    taps, width = len(config.target_layer_ids), config.layers.hidden_size
    rng = np.random.default_rng(0)
    features = rng.standard_normal((1, 3, taps, width)).astype(np.float32)
    scales = rng.uniform(0.1, 10.0, (1, 3, taps, 1)).astype(np.float32)
    scales[:, :, 0] = 1000.0  # one tap with huge activations
    scaled = features * scales  # each tap of each position rescaled
    positions = np.arange(3)[None]

    def context_keys(drafter, feats):
        module = DFlashDrafter(drafter.config)
        keys, _ = module.apply(drafter.params, feats.reshape(1, 3, -1), positions, method=module.context_kv)
        return np.asarray(keys[0])

    np.testing.assert_allclose(context_keys(normed, features), context_keys(normed, scaled), atol=2e-4)
    assert not np.allclose(context_keys(plain, features), context_keys(plain, scaled), atol=1e-2)
    assert tokens_with(target, normed)[0] == tokens_with(target, None)[0]  # lossless all the same


@pytest.mark.parametrize(
    "change, message",
    [
        ({"hidden_size": 32, "intermediate_size": 48}, "hidden size 32 != target's 64"),
        ({"vocab_size": 300}, "vocabulary 300 != target's 256"),
        (
            {"dflash_config": {"target_layer_ids": [0, 7], "mask_token_id": None}},
            r"target_layer_ids \[7\] outside",
        ),
        ({"dflash_config": {"target_layer_ids": [0], "mask_token_id": 999}}, "mask_token_id 999 outside"),
    ],
)
def test_drafter_that_does_not_fit_the_target(tmp_path, target, change, message):
    config = DFlashConfig.for_target(target.config, num_layers=1)
    data = {**config_to_json(config, target.config.num_layers), **change}
    wrong = config_from_json(data)
    save_drafter(tmp_path, wrong, init_drafter_params(DFlashDrafter(wrong)), target.config.num_layers)
    with pytest.raises(ValueError, match=message):
        load_drafter(tmp_path, target)


def test_missing_drafter_and_bad_block_size(target, tmp_path):
    with pytest.raises(FileNotFoundError, match="drafter 'nope' not found"):
        load_drafter("nope", target)
    with pytest.raises(ValueError, match="block size must be >= 2"):
        load_drafter("untrained", target, block_size=1)
