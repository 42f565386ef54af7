"""Published DFlash / DFlash 2 drafter configs against dflax's reader (docs/official-configs.md).

The fixtures in official_configs/ hold the field values of public drafter checkpoints, one per config kind.
DFlash (v1) kinds dflax runs load with the right layers, block size, taps and mask id, and a copy shrunk to
tiny widths (every key kept) initializes, saves and reloads; kinds dflax cannot run yet (DFlash 2,
sliding-window or otherwise extended drafters) are refused by name at config time, never half-loaded.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflax.checkpoints.params import CheckpointError, param_shapes
from dflax.drafters.checkpoint import (
    DFLASH2_KEYS,
    config_from_json,
    hf_tensor_name,
    load_drafter_checkpoint,
    save_drafter,
)
from dflax.drafters.dflash import DFlashDrafter, init_drafter_params

FIXTURES = Path(__file__).parent / "official_configs"

# Loadable DFlash (v1) kinds: fixture -> (layer kind, layers, block size, taps, mask id).
LOADABLE = {
    "dflash-qwen3-8b-b16": ("qwen3", 5, 16, (1, 9, 17, 25, 33), 151669),
}
# Kinds dflax refuses: fixture -> words the error must contain.
REFUSED = {
    "dflash2-qwen3.8-27b": ("DFlash 2", "DFlash drafters only"),
    "dflash2-muse-glimmer-30b": ("DFlash 2", "DFlash drafters only"),
    "dflash-swa-qwen3.6-27b": ("layer_types", "sliding_attention", "sliding_window=2048"),
    "dflash-mimo-v2.5-pro": (
        "use_swa",
        "attention_sink_bias",
        "attention_value_scale",
        "partial_rotary_factor",
    ),
}
# Sizes shrunk in the tiny variants (all other keys are kept as published).
TINY = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
}


def official(name: str) -> dict:
    """The published config.json dictionary of one fixture."""
    return json.loads((FIXTURES / f"{name}.json").read_text())["config"]


def tiny(config: dict) -> dict:
    """The config with its widths shrunk to TINY and every other key unchanged."""
    small = copy.deepcopy(config)
    small.update({k: v for k, v in TINY.items() if k in small})
    return small


def test_every_fixture_is_covered():
    names = {p.stem for p in FIXTURES.glob("*.json")}
    assert names == set(LOADABLE) | set(REFUSED)
    for name in names:
        data = json.loads((FIXTURES / f"{name}.json").read_text())
        assert {"kind", "checkpoint", "revision", "dflax", "provenance", "config"} <= set(data)


@pytest.mark.parametrize("name", sorted(LOADABLE))
def test_official_dflash_config_loads(name):
    arch, num_layers, block_size, taps, mask_id = LOADABLE[name]
    data = official(name)
    config = config_from_json(data)
    assert config.layers.arch == arch
    assert config.layers.num_layers == num_layers
    assert config.block_size == block_size
    assert config.target_layer_ids == taps
    assert config.mask_token_id == mask_id
    assert not config.feature_norm
    for key, field in [
        ("hidden_size", "hidden_size"),
        ("intermediate_size", "intermediate_size"),
        ("num_attention_heads", "num_heads"),
        ("num_key_value_heads", "num_kv_heads"),
        ("head_dim", "head_dim"),
        ("vocab_size", "vocab_size"),
        ("rms_norm_eps", "rms_norm_eps"),
        ("rope_theta", "rope_theta"),
        ("max_position_embeddings", "max_position_embeddings"),
    ]:
        assert getattr(config.layers, field) == data[key], key
    assert config.layers.rope_scaling is None and not config.layers.attention_bias
    assert max(taps) < data["num_target_layers"]


def test_dflax_qwen3_8b_drafter_config_matches_the_official_one():
    """configs/drafters/dflash-qwen3-8b/config.json reads to the same drafter as the published config."""
    path = Path(__file__).parents[2] / "configs" / "drafters" / "dflash-qwen3-8b" / "config.json"
    ours = json.loads(path.read_text())
    published = official("dflash-qwen3-8b-b16")
    # tie_word_embeddings is not in the fixture (unconfirmed); it does not change a drafter, whose LM head is
    # the target's.
    published = {**published, "tie_word_embeddings": ours["tie_word_embeddings"]}
    assert config_from_json(ours) == config_from_json(published)
    for key in ("num_target_layers", "block_size", "dflash_config", "architectures", "model_type"):
        assert ours[key] == published[key], key


def reference_tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """The tensor names and shapes a DFlash (v1) checkpoint of this config.json holds (torch [out, in])."""
    d, ffn, hd = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    taps = len(config["dflash_config"]["target_layer_ids"])
    per_layer = {
        "self_attn.q_proj.weight": (q, d),
        "self_attn.k_proj.weight": (kv, d),
        "self_attn.v_proj.weight": (kv, d),
        "self_attn.o_proj.weight": (d, q),
        "self_attn.q_norm.weight": (hd,),
        "self_attn.k_norm.weight": (hd,),
        "mlp.gate_proj.weight": (ffn, d),
        "mlp.up_proj.weight": (ffn, d),
        "mlp.down_proj.weight": (d, ffn),
        "input_layernorm.weight": (d,),
        "post_attention_layernorm.weight": (d,),
    }
    shapes = {f"layers.{i}.{n}": s for i in range(config["num_hidden_layers"]) for n, s in per_layer.items()}
    return shapes | {"fc.weight": (d, taps * d), "hidden_norm.weight": (d,), "norm.weight": (d,)}


@pytest.mark.parametrize("name", sorted(LOADABLE))
def test_tiny_variant_initializes_saves_and_reloads(name, tmp_path):
    data = tiny(official(name))
    config = config_from_json(data)
    params = init_drafter_params(DFlashDrafter(config), seed=0)
    shapes = {hf_tensor_name(path): shape for path, shape in param_shapes(params).items()}
    assert shapes == reference_tensor_shapes(data)  # no mask_embedding: the mask is a target token id

    # The tensors under their official names plus the published config (tiny) read back as they were.
    save_drafter(tmp_path, config, params, data["num_target_layers"])
    (tmp_path / "config.json").write_text(json.dumps(data))
    loaded_config, loaded, draft_vocab = load_drafter_checkpoint(tmp_path, jnp.float32)
    assert loaded_config == config and draft_vocab is None
    jax.tree.map(np.testing.assert_array_equal, loaded, params)


@pytest.mark.parametrize("name", sorted(REFUSED))
@pytest.mark.parametrize("size", ["published", "tiny"])
def test_unsupported_kinds_are_refused_by_name(name, size):
    data = official(name) if size == "published" else tiny(official(name))
    with pytest.raises(CheckpointError) as error:
        config_from_json(data)
    for words in REFUSED[name]:
        assert words in str(error.value)


@pytest.mark.parametrize("key", DFLASH2_KEYS)
def test_dflash2_keys_alone_mark_a_dflash2_drafter(key):
    """A DFlash 2 config relabelled DFlashDraftModel (as some serving recipes do) is still refused."""
    data = official("dflash2-qwen3.8-27b")
    data["architectures"] = ["DFlashDraftModel"]
    data["dflash_config"] = {
        k: v for k, v in data["dflash_config"].items() if k == key or k not in DFLASH2_KEYS
    }
    with pytest.raises(CheckpointError, match=f"DFlash 2.*{key}"):
        config_from_json(data)


@pytest.mark.parametrize(
    ("key", "value", "neutral"),
    [
        ("input_embedding_scale", 2.0, 1.0),
        ("output_multiplier", 0.5, 1.0),
        ("final_logit_softcapping", 20.0, None),
        ("final_logit_softcapping", 20.0, 0.0),
    ],
)
@pytest.mark.parametrize("where", ["dflash_config", "top level"])
def test_math_changing_keys_are_refused_unless_neutral(key, value, neutral, where):
    def with_value(v):
        data = official("dflash-qwen3-8b-b16")
        (data["dflash_config"] if where == "dflash_config" else data)[key] = v
        return data

    with pytest.raises(CheckpointError, match=f"{key}={value!r}"):
        config_from_json(with_value(value))
    loaded = config_from_json(with_value(neutral))
    assert loaded.target_layer_ids == (1, 9, 17, 25, 33) and loaded.block_size == 16


def test_causal_drafter_layers_are_refused():
    data = official("dflash-qwen3-8b-b16")
    assert config_from_json({**data, "is_causal": False}) == config_from_json(data)
    with pytest.raises(CheckpointError, match="is_causal=True"):
        config_from_json({**data, "is_causal": True})


def test_block_size_is_read_from_dflash_config_first():
    """Newer v1 drafters (e.g. z-lab/Qwen3.6-35B-A3B-DFlash) keep block_size only in dflash_config; where
    both are present the reference reads dflash_config first."""
    data = official("dflash-qwen3-8b-b16")
    del data["block_size"]
    data["dflash_config"]["block_size"] = 8
    assert config_from_json(data).block_size == 8
    data["block_size"] = 12
    assert config_from_json(data).block_size == 8
    del data["dflash_config"]["block_size"]
    assert config_from_json(data).block_size == 12
