"""LLaDA (GSAI-ML/LLaDA-8B-Base, -Instruct): a Llama-shaped masked diffusion LM in OLMo's code and names.

Its config.json has OLMo's keys (`d_model`, `n_layers`, `n_heads`, `n_kv_heads`, `mlp_hidden_size`,
`rope_theta`, `block_type`, `layer_norm_type`, ...) with `model_type: "llada"`, and its tensors OLMo's names:

    model.transformer.wte                     token embedding      -> model.embed_tokens
    model.transformer.blocks.N.attn_norm      RMSNorm before attn  -> model.layers.N.input_layernorm
    model.transformer.blocks.N.{q,k,v}_proj   separate (not fused) -> model.layers.N.self_attn.{q,k,v}_proj
    model.transformer.blocks.N.attn_out       attention output     -> model.layers.N.self_attn.o_proj
    model.transformer.blocks.N.ff_norm        RMSNorm before MLP   -> model.layers.N.post_attention_layernorm
    model.transformer.blocks.N.ff_proj        silu-gated branch    -> model.layers.N.mlp.gate_proj
    model.transformer.blocks.N.up_proj        linear branch        -> model.layers.N.mlp.up_proj
    model.transformer.blocks.N.ff_out         MLP output           -> model.layers.N.mlp.down_proj
    model.transformer.ln_f                    final RMSNorm        -> model.norm
    model.transformer.ff_out                  read-out (untied)    -> lm_head

With `block_type: "llama"`, `layer_norm_type: "rms"` and `activation_type: "silu"` (what the released
checkpoints use) the block computes exactly a Llama layer: x + attn(rms(x)), then x + ff_out(silu(ff_proj(
rms(x))) * up_proj(rms(x))), RoPE with rotate-half pairs, softmax scale 1/sqrt(head_dim), no causal mask and
no logit shift. Other OLMo variants (fused `att_proj`, LayerNorm, ALiBi, q/k LayerNorm, biases outside q/k/v,
scaled embeddings or logits, block groups) are refused by name. Keys a config leaves out take the defaults of
LLaDA's own config class (`_OLMO_DEFAULTS`), as its loader would.
"""

from __future__ import annotations

import re
from typing import Any

from dflax.models.config import ModelConfig, UnsupportedArchitectureError

MODEL_TYPE = "llada"
DEFAULT_MASK_TOKEN_ID = 126336  # the released checkpoints' mask token, used when config.json names none
# Defaults of LLaDA's ModelConfig for the keys read here (a config.json usually lists every key).
_OLMO_DEFAULTS = {
    "n_kv_heads": None,
    "multi_query_attention": None,
    "mlp_ratio": 4,
    "mlp_hidden_size": None,
    "activation_type": "swiglu",
    "block_type": "sequential",
    "block_group_size": 1,
    "alibi": False,
    "rope": False,
    "attention_layer_norm": False,
    "input_emb_norm": False,
    "layer_norm_type": "default",
    "layer_norm_with_affine": True,
    "rms_norm_eps": 1e-5,
    "max_sequence_length": 1024,
    "rope_theta": 10000.0,
    "include_qkv_bias": False,
    "include_bias": False,
    "bias_for_layer_norm": None,
    "scale_logits": False,
    "vocab_size": 50257,
    "embedding_size": 50304,
    "weight_tying": True,
}
# Each setting LLaDA's released checkpoints use, which this port requires.
_REQUIRED = {
    "block_type": "llama",
    "layer_norm_type": "rms",
    "activation_type": "silu",
    "rope": True,
    "alibi": False,
    "attention_layer_norm": False,
    "layer_norm_with_affine": True,
    "include_bias": False,
    "input_emb_norm": False,
    "scale_logits": False,
    "block_group_size": 1,
}
# OLMo block tensor names -> dflax layer tensor names.
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "q_proj": "self_attn.q_proj",
    "k_proj": "self_attn.k_proj",
    "v_proj": "self_attn.v_proj",
    "attn_out": "self_attn.o_proj",
    "ff_norm": "post_attention_layernorm",
    "ff_proj": "mlp.gate_proj",
    "up_proj": "mlp.up_proj",
    "ff_out": "mlp.down_proj",
}
_TOP_NAMES = {"wte": "model.embed_tokens", "ln_f": "model.norm", "ff_out": "lm_head"}
_BLOCK = re.compile(r"^model\.transformer\.blocks\.(\d+)\.(\w+)\.(weight|bias)$")
_TOP = re.compile(r"^model\.transformer\.(\w+)\.(weight|bias)$")


def is_llada_config(hf: dict[str, Any]) -> bool:
    """Whether an HF config.json dictionary describes a LLaDA checkpoint."""
    return str(hf.get("model_type", "")).lower() == MODEL_TYPE


def _kv_heads(cfg: dict[str, Any]) -> int:
    """OLMo's effective number of key/value heads."""
    if cfg["n_kv_heads"] is None:
        return 1 if cfg["multi_query_attention"] else cfg["n_heads"]
    return cfg["n_kv_heads"]


def llada_model_config(hf: dict[str, Any]) -> tuple[ModelConfig, int]:
    """(the dflax config of LLaDA's network, its mask token id) from LLaDA's config.json dictionary.

    q/k/v biases without an output bias (`include_qkv_bias`) are dflax's qwen2 layer recipe; without them the
    llama one.

    Raises:
      UnsupportedArchitectureError: for an OLMo variant other than the released checkpoints' (named).
    """
    cfg = {**_OLMO_DEFAULTS, **hf}
    wrong = {key: cfg[key] for key, want in _REQUIRED.items() if cfg[key] != want}
    if cfg["bias_for_layer_norm"]:
        wrong["bias_for_layer_norm"] = cfg["bias_for_layer_norm"]
    if wrong:
        raise UnsupportedArchitectureError(
            f"LLaDA variant not supported: {wrong}; dflax runs LLaDA's released layout "
            f"({', '.join(f'{k}={v!r}' for k, v in _REQUIRED.items())})"
        )
    d_model, n_heads = cfg["d_model"], cfg["n_heads"]
    if d_model % n_heads:
        raise UnsupportedArchitectureError(f"d_model ({d_model}) is not a multiple of n_heads ({n_heads})")
    eos = cfg.get("eos_token_id")
    config = ModelConfig(
        arch="qwen2" if cfg["include_qkv_bias"] else "llama",
        vocab_size=cfg["embedding_size"] or cfg["vocab_size"],
        hidden_size=d_model,
        intermediate_size=cfg["mlp_hidden_size"] or cfg["mlp_ratio"] * d_model,
        num_layers=cfg["n_layers"],
        num_heads=n_heads,
        num_kv_heads=_kv_heads(cfg),
        head_dim=d_model // n_heads,
        rms_norm_eps=float(cfg["rms_norm_eps"]),
        rope_theta=float(cfg["rope_theta"]),
        tie_word_embeddings=bool(cfg["weight_tying"]),
        max_position_embeddings=cfg["max_sequence_length"],
        eos_token_ids=() if eos is None else (int(eos),),
    )
    mask = hf.get("mask_token_id")
    return config, DEFAULT_MASK_TOKEN_ID if mask is None else int(mask)


def llada_tensor_names(tensors: dict) -> dict:
    """LLaDA's tensors renamed to the dflax layer names (see the module docstring); names it does not know
    are kept, so the loader reports them as unexpected."""
    renamed = {}
    for name, value in tensors.items():
        block, top = _BLOCK.match(name), _TOP.match(name)
        if block and block.group(2) in _BLOCK_NAMES:
            name = f"model.layers.{block.group(1)}.{_BLOCK_NAMES[block.group(2)]}.{block.group(3)}"
        elif top and top.group(1) in _TOP_NAMES:
            name = f"{_TOP_NAMES[top.group(1)]}.{top.group(2)}"
        renamed[name] = value
    return renamed
