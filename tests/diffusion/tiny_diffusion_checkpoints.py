"""Tiny random Dream and LLaDA checkpoints written in their Hugging Face layouts (config.json +
safetensors, optionally sharded with an index), as the hub stores the real ones."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

DREAM_CONFIG = {
    "architectures": ["DreamModel"],
    "model_type": "Dream",
    "vocab_size": 48,
    "hidden_size": 64,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "mask_token_id": 47,
    "pad_token_id": 46,
    "torch_dtype": "float32",
}

LLADA_CONFIG = {
    "architectures": ["LLaDAModelLM"],
    "model_type": "llada",
    "d_model": 64,
    "n_heads": 4,
    "n_kv_heads": 2,
    "n_layers": 2,
    "mlp_hidden_size": 48,
    "mlp_ratio": 4,
    "block_type": "llama",
    "block_group_size": 1,
    "layer_norm_type": "rms",
    "activation_type": "silu",
    "rope": True,
    "alibi": False,
    "attention_layer_norm": False,
    "include_bias": False,
    "include_qkv_bias": False,
    "bias_for_layer_norm": False,
    "input_emb_norm": False,
    "scale_logits": False,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "vocab_size": 40,
    "embedding_size": 48,
    "weight_tying": False,
    "mask_token_id": 45,
    "eos_token_id": 44,
    "max_sequence_length": 4096,
}


def _random(rng: np.random.Generator, shape: tuple[int, ...], scale: float = 0.3) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def dream_tensors(config: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Random tensors under Dream's (Qwen2's) names."""
    rng = np.random.default_rng(seed)
    d, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    hd = d // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * hd
    out = {"model.embed_tokens.weight": _random(rng, (v, d), 1.0), "lm_head.weight": _random(rng, (v, d))}
    out["model.norm.weight"] = 1 + _random(rng, (d,), 0.1)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for name, rows in (("q", d), ("k", kv), ("v", kv)):
            out[p + f"self_attn.{name}_proj.weight"] = _random(rng, (rows, d))
            out[p + f"self_attn.{name}_proj.bias"] = _random(rng, (rows,))
        out[p + "self_attn.o_proj.weight"] = _random(rng, (d, d))
        out[p + "mlp.gate_proj.weight"] = _random(rng, (f, d))
        out[p + "mlp.up_proj.weight"] = _random(rng, (f, d))
        out[p + "mlp.down_proj.weight"] = _random(rng, (d, f))
        out[p + "input_layernorm.weight"] = 1 + _random(rng, (d,), 0.1)
        out[p + "post_attention_layernorm.weight"] = 1 + _random(rng, (d,), 0.1)
    return out


def llada_tensors(config: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Random tensors under LLaDA's (OLMo's) names."""
    rng = np.random.default_rng(seed)
    d, f = config["d_model"], config["mlp_hidden_size"]
    v = config["embedding_size"] or config["vocab_size"]
    kv = config["n_kv_heads"] * (d // config["n_heads"])
    top = "model.transformer."
    out = {top + "wte.weight": _random(rng, (v, d), 1.0), top + "ln_f.weight": 1 + _random(rng, (d,), 0.1)}
    if not config["weight_tying"]:
        out[top + "ff_out.weight"] = _random(rng, (v, d))
    for i in range(config["n_layers"]):
        p = f"{top}blocks.{i}."
        out[p + "q_proj.weight"] = _random(rng, (d, d))
        out[p + "k_proj.weight"] = _random(rng, (kv, d))
        out[p + "v_proj.weight"] = _random(rng, (kv, d))
        out[p + "attn_out.weight"] = _random(rng, (d, d))
        out[p + "ff_proj.weight"] = _random(rng, (f, d))
        out[p + "up_proj.weight"] = _random(rng, (f, d))
        out[p + "ff_out.weight"] = _random(rng, (d, f))
        out[p + "attn_norm.weight"] = 1 + _random(rng, (d,), 0.1)
        out[p + "ff_norm.weight"] = 1 + _random(rng, (d,), 0.1)
    return out


def write_checkpoint(path: Path, config: dict, tensors: dict[str, np.ndarray], shards: int = 1) -> Path:
    """Writes config.json and the tensors as `shards` safetensors files (with the hub's index when > 1)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    names = sorted(tensors)
    if shards == 1:
        save_file({n: tensors[n] for n in names}, str(path / "model.safetensors"))
        return path
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = names[s::shards]
        save_file({n: tensors[n] for n in part}, str(path / file))
        weight_map.update({n: file for n in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path
