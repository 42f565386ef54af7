"""Grouped-query self-attention over a static KV cache: the one attention entry point of dflax.

Every forward (prefill, decode, verify, drafting) is the same operation: n new tokens attend to a cached
prefix [0, cache_len) and to those new tokens that their mask allows (causal for prefill and chains, an
ancestor mask for trees, all-visible for a diffusion block). The math lives in `pallas_kernels.tree_attention`
(a jnp reference for CPU, Pallas kernels for TPU and GPU) and the backend is a setting, not a code path.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from dflax.models.config import RopeScaling
from dflax.models.layers import Linear, RMSNorm, apply_rope, rope_inv_freq
from pallas_kernels.tree_attention import tree_attention

ATTENTION_BACKENDS = ("reference", "pallas", "pallas_tpu", "pallas_gpu", "pallas_interpret", "auto")


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """What one attention layer needs to know.

    Attributes:
      hidden_size: model width D (input and output of the layer).
      num_heads: query heads N.
      num_kv_heads: key/value heads K (N % K == 0).
      head_dim: H.
      scale: softmax scale of the logits.
      rope_theta: RoPE base of this layer.
      rope_scaling: optional RoPE frequency scaling.
      qkv_bias: q/k/v projections carry biases.
      o_bias: the output projection carries a bias.
      qk_norm: RMS-normalize q and k per head before RoPE (Qwen3, Gemma 3).
      norm_eps: epsilon of the q/k norms.
      gemma_norm: q/k norms use Gemma's (1 + w) scale.
      sliding_window: keys older than this many positions are invisible (None = global).
      backend: "reference" (jnp), "pallas" (the Pallas kernel of the TPU/GPU this process runs on),
        "pallas_tpu" / "pallas_gpu" (that platform's kernel whatever this process runs on: compiling ahead
        of time for a TPU or GPU topology from a CPU host), "pallas_interpret" (Pallas in interpret mode:
        CPU tests), "auto" (Pallas on TPU/GPU, reference on CPU).
    """

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    rope_theta: float
    rope_scaling: RopeScaling | None = None
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    norm_eps: float = 1e-6
    gemma_norm: bool = False
    sliding_window: int | None = None
    backend: str = "auto"

    def __post_init__(self):
        if self.backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention backend {self.backend!r} unknown; choose one of {ATTENTION_BACKENDS}"
            )


def _kernel_backend(setting: str) -> tuple[str, bool]:
    """Maps an `attention_backend` setting to the kernel's (backend, interpret) arguments."""
    if setting == "pallas_interpret":
        return "gpu", True
    if setting in ("pallas_tpu", "pallas_gpu"):
        return setting.removeprefix("pallas_"), False
    if setting == "pallas" and jax.default_backend() not in ("tpu", "gpu"):
        raise ValueError(
            "attention_backend='pallas' needs a TPU or GPU; on CPU use 'reference' (fast) or "
            "'pallas_interpret' (runs the kernel in interpret mode, for tests), or 'pallas_tpu' / "
            "'pallas_gpu' to compile ahead of time for that platform (see dflax.aot)"
        )
    return ("reference" if setting == "reference" else "auto"), False


def attend(
    cfg: AttentionConfig,
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    cache_len: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    new_mask: jax.Array,
    q_positions: jax.Array,
) -> jax.Array:
    """Prefix + new-token attention through the configured backend.

    Args:
      cfg: attention settings.
      q: [B, T, N, H] queries (RoPE applied).
      k_cache, v_cache: [B, S, K, H] cached keys/values; slots >= cache_len are never read.
      cache_len: [B] int32 valid cache length per row.
      k_new, v_new: [B, T, K, H] keys/values of the new tokens.
      new_mask: [B, T, T] bool, query i may see new token j.
      q_positions: [B, T] int32 absolute positions of the new tokens.

    Returns:
      [B, T, N, H] attention output in q's dtype.
    """
    backend, interpret = _kernel_backend(cfg.backend)
    return tree_attention(
        q,
        k_cache,
        v_cache,
        cache_len,
        k_new,
        v_new,
        new_mask,
        sm_scale=cfg.scale,
        sliding_window=cfg.sliding_window,
        q_positions=q_positions,
        backend=backend,
        interpret=interpret,
    )


class Attention(nn.Module):
    """Grouped-query attention with RoPE, optional q/k-norm and biases, reading a static KV cache.

    The layer never mutates the cache: it returns the new tokens' keys and values and the caller writes
    them at each row's cache length (see `dflax.spec.cache`).
    """

    cfg: AttentionConfig
    dtype: jnp.dtype = jnp.float32

    def setup(self):
        cfg = self.cfg
        self.q_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.qkv_bias, self.dtype)
        self.k_proj = Linear(cfg.num_kv_heads * cfg.head_dim, cfg.qkv_bias, self.dtype)
        self.v_proj = Linear(cfg.num_kv_heads * cfg.head_dim, cfg.qkv_bias, self.dtype)
        self.o_proj = Linear(cfg.hidden_size, cfg.o_bias, self.dtype)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.norm_eps, cfg.gemma_norm, self.dtype)
            self.k_norm = RMSNorm(cfg.norm_eps, cfg.gemma_norm, self.dtype)

    def _inv_freq(self):
        return rope_inv_freq(self.cfg.head_dim, self.cfg.rope_theta, self.cfg.rope_scaling)

    def project_kv(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Keys (normalized, rotated) and values of x: [B, T, D] -> ([B, T, K, H], [B, T, K, H])."""
        cfg = self.cfg
        b, t, _ = x.shape
        k = self.k_proj(x).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        v = self.v_proj(x).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            k = self.k_norm(k)
        return apply_rope(k, positions, self._inv_freq()), v

    def __call__(
        self,
        x: jax.Array,
        positions: jax.Array,
        k_cache: jax.Array,
        v_cache: jax.Array,
        cache_len: jax.Array,
        new_mask: jax.Array,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Attends x's tokens to the cache and to each other.

        Args:
          x: [B, T, D] normalized hidden states.
          positions: [B, T] int32 absolute positions.
          k_cache, v_cache: [B, S, K, H].
          cache_len: [B] int32.
          new_mask: [B, T, T] bool.

        Returns:
          (out [B, T, D], k_new [B, T, K, H], v_new [B, T, K, H]).
        """
        cfg = self.cfg
        b, t, _ = x.shape
        q = self.q_proj(x).reshape(b, t, cfg.num_heads, cfg.head_dim)  # [B, T, N, H]
        if cfg.qk_norm:
            q = self.q_norm(q)
        q = apply_rope(q, positions, self._inv_freq())
        k, v = self.project_kv(x, positions)  # [B, T, K, H]
        out = attend(cfg, q, k_cache, v_cache, cache_len, k, v, new_mask, positions)  # [B, T, N, H]
        return self.o_proj(out.reshape(b, t, -1)), k, v
