"""Dream and LLaDA forwards in float64 numpy, written from their published equations over the checkpoints'
own tensor names (HF Qwen2 names for Dream, OLMo names for LLaDA): the oracle for dflax.diffusion.

One unpadded sequence at a time, positions 0..T-1, every token attending to every token (no causal mask).
transformers ships neither model, so this is the independent reference the issue asks for.
"""

from __future__ import annotations

import numpy as np


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * weight over the last axis."""
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * weight


def rope(x: np.ndarray, theta: float) -> np.ndarray:
    """Rotary embedding of x [T, heads, d] at positions 0..T-1, rotate-half pairs (i, i + d/2)."""
    t, _, d = x.shape
    inv_freq = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)  # [d/2]
    angle = np.arange(t, dtype=np.float64)[:, None] * inv_freq[None, :]  # [T, d/2]
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def full_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """softmax(q k^T / sqrt(d)) v with no mask; q [T, N, d], k/v [T, Kv, d], query head h reads kv head
    h // (N / Kv). Returns [T, N * d]."""
    t, n, d = q.shape
    group = n // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # [T, N, d]
    scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d)
    scores = np.exp(scores - scores.max(-1, keepdims=True))
    probs = scores / scores.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", probs, v).reshape(t, n * d)


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x)."""
    return x / (1.0 + np.exp(-x))


def dream_logits(
    config: dict, tensors: dict[str, np.ndarray], tokens: np.ndarray, shifted: bool = True
) -> np.ndarray:
    """Dream's logits [T, V] as its generation reads them: position p from the hidden state at p - 1
    (position 0 from its own, which generation never reads); `shifted=False` gives each position's own."""
    w = {name: np.asarray(value, np.float64) for name, value in tensors.items()}
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    d = config["hidden_size"] // heads
    eps, theta = config["rms_norm_eps"], config["rope_theta"]
    x = w["model.embed_tokens.weight"][tokens]  # [T, D]
    t = len(tokens)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms_norm(x, w[p + "input_layernorm.weight"], eps)
        q, k, v = (
            h @ w[p + f"self_attn.{name}_proj.weight"].T + w[p + f"self_attn.{name}_proj.bias"]
            for name in "qkv"
        )
        q = rope(q.reshape(t, heads, d), theta)
        k = rope(k.reshape(t, kv, d), theta)
        x = x + full_attention(q, k, v.reshape(t, kv, d)) @ w[p + "self_attn.o_proj.weight"].T
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"], eps)
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    raw = rms_norm(x, w["model.norm.weight"], eps) @ w["lm_head.weight"].T  # [T, V]
    return np.concatenate([raw[:1], raw[:-1]], axis=0) if shifted else raw


def llada_logits(config: dict, tensors: dict[str, np.ndarray], tokens: np.ndarray) -> np.ndarray:
    """LLaDA's logits [T, V] (no shift), OLMo's llama block with RMSNorm, SwiGLU and RoPE."""
    w = {name: np.asarray(value, np.float64) for name, value in tensors.items()}
    heads, kv = config["n_heads"], config["n_kv_heads"]
    d = config["d_model"] // heads
    eps, theta = config["rms_norm_eps"], config["rope_theta"]
    x = w["model.transformer.wte.weight"][tokens]
    t = len(tokens)
    for i in range(config["n_layers"]):
        p = f"model.transformer.blocks.{i}."
        h = rms_norm(x, w[p + "attn_norm.weight"], eps)
        q, k, v = (h @ w[p + f"{name}_proj.weight"].T for name in "qkv")
        q = rope(q.reshape(t, heads, d), theta)
        k = rope(k.reshape(t, kv, d), theta)
        x = x + full_attention(q, k, v.reshape(t, kv, d)) @ w[p + "attn_out.weight"].T
        h = rms_norm(x, w[p + "ff_norm.weight"], eps)
        gated = silu(h @ w[p + "ff_proj.weight"].T) * (h @ w[p + "up_proj.weight"].T)
        x = x + gated @ w[p + "ff_out.weight"].T
    head = "model.transformer.wte.weight" if config["weight_tying"] else "model.transformer.ff_out.weight"
    return rms_norm(x, w["model.transformer.ln_f.weight"], eps) @ w[head].T
