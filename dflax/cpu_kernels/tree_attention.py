"""Prefix + tree attention of a few new tokens on the CPU (tree_attention.cc), the decode and verify steps'
attention; elsewhere (a TPU or GPU program lowered on this host) the chunked jnp path, and as its gradient the
dense reference's (pallas_kernels.tree_attention)."""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from dflax.cpu_kernels.build import library_path, load_kernel
from pallas_kernels.tree_attention import tree_attention_chunked, tree_attention_reference
from pallas_kernels.tree_attention.reference import new_token_visibility, query_positions

MAX_TOKENS = 64
"""Up to this many new tokens per row (decode steps, verify chains and trees) the kernel takes the
attention; prompts keep the chunked path, whose batched products suit a long prompt's T^2 work (the kernel
was not timed on prompts)."""

_SOURCE = Path(__file__).with_suffix(".cc")
_SYMBOL = "dflax_tree_attention_f32"
_HEAD_DIMS = (32, 64, 128, 256)


def cpu_attention() -> str:
    """What attends a decode or verify step on this CPU: the kernel's build (named by its source), or
    "xla" when it is off or did not build. Part of the key of measured decode-step costs."""
    return library_path(_SOURCE).stem if load_kernel(_SOURCE, (_SYMBOL,)) else "xla"


def cpu_tree_attention_applies(
    q: jax.Array,
    k_cache: jax.Array,
    k_new: jax.Array,
    sliding_window: int | None,
    logit_soft_cap: float | None,
) -> bool:
    """Whether `cpu_tree_attention` takes this attention (decided at trace time; builds the kernel on first
    use): at most MAX_TOKENS new tokens, float32 queries, cache and new keys, a head_dim of 32, 64, 128 or
    256, no sliding window or logit soft cap, no mesh of several devices being traced for, and a kernel
    that built on this CPU."""
    mesh = jax.sharding.get_abstract_mesh()
    return (
        (mesh.empty or mesh.size == 1)
        and q.shape[1] <= MAX_TOKENS
        and q.shape[3] in _HEAD_DIMS
        and q.dtype == k_cache.dtype == k_new.dtype == jnp.float32
        and sliding_window is None
        and logit_soft_cap is None
        and load_kernel(_SOURCE, (_SYMBOL,))
    )


def _kernel(q, k_cache, v_cache, cache_len, k_new, v_new, mask, scale):
    load_kernel(_SOURCE, (_SYMBOL,))  # registers the handler (built once; a no-op after the first call)
    call = jax.ffi.ffi_call(_SYMBOL, jax.ShapeDtypeStruct(q.shape, jnp.float32), vmap_method="sequential")
    return call(q, k_cache, v_cache, cache_len.astype(jnp.int32), k_new, v_new, mask, scale=np.float32(scale))


def _chunked(q, k_cache, v_cache, cache_len, k_new, v_new, mask, scale):
    return tree_attention_chunked(q, k_cache, v_cache, cache_len, k_new, v_new, mask, sm_scale=scale)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _attention(q, k_cache, v_cache, cache_len, k_new, v_new, mask, scale):
    args = (q, k_cache, v_cache, cache_len, k_new, v_new, mask)
    return jax.lax.platform_dependent(
        *args, cpu=lambda *a: _kernel(*a, scale), default=lambda *a: _chunked(*a, scale)
    )


def _attention_fwd(q, k_cache, v_cache, cache_len, k_new, v_new, mask, scale):
    out = _attention(q, k_cache, v_cache, cache_len, k_new, v_new, mask, scale)
    return out, (q, k_cache, v_cache, cache_len, k_new, v_new, mask)


def _attention_bwd(scale, residuals, grad):
    """The gradient of the dense reference, which computes the same function (the chunked path's loop over
    a filled cache has no reverse-mode derivative)."""
    q, k_cache, v_cache, cache_len, k_new, v_new, mask = residuals

    def differentiable(q, k_cache, v_cache, k_new, v_new):
        return tree_attention_reference(q, k_cache, v_cache, cache_len, k_new, v_new, mask, sm_scale=scale)

    _, vjp = jax.vjp(differentiable, q, k_cache, v_cache, k_new, v_new)
    dq, dk_cache, dv_cache, dk_new, dv_new = vjp(grad)
    return dq, dk_cache, dv_cache, None, dk_new, dv_new, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def cpu_tree_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    cache_len: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    tree_mask: jax.Array | None,
    sm_scale: float,
) -> jax.Array:
    """`pallas_kernels.tree_attention.tree_attention` for a few float32 new tokens, on the CPU.

    Args:
      q: [B, T, N, H] queries; k_cache, v_cache: [B, K, S, H]; cache_len: [B]; k_new, v_new: [B, T, K, H];
        tree_mask: [B, T, T] bool or None (causal): as in `tree_attention`.
      sm_scale: the logit scale.

    Returns:
      [B, T, N, H] float32; rows that see no key are zero. Each query row is computed the same way whatever
      the other rows and tokens (bitwise). Only for attention `cpu_tree_attention_applies` accepts.
    """
    positions = query_positions(cache_len, q.shape[1], None)  # [B, T]; no window: only the shape counts
    mask = new_token_visibility(tree_mask, positions, None)  # [B, T, T], causal when tree_mask is None
    return _attention(q, k_cache, v_cache, cache_len, k_new, v_new, mask, float(sm_scale))
