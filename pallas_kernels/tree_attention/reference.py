"""Prefix + tree attention in pure dense jnp: the specification and the test oracle (the CPU path is chunked).

Glossary of einsum letters: B batch, T query (new) tokens, U new key tokens (= T), S cache slots,
N query heads, K kv heads, G query heads per kv head (N = K * G), H head_dim.

Each of the T new tokens (a verification tree, a draft chain, a decode step or a whole prompt) attends to
the committed prefix, cache slots [0, cache_len), with no mask there besides the sliding window, and to the
new tokens its row of `tree_mask` allows. The two parts share one softmax; this module computes it with one
row maximum over both score blocks, which is the log-sum-exp merge of the two partial attentions written out
(see docs of `tree_attention_reference`). The helpers at the bottom (validation, query packing, tile bounds)
are shared with the Pallas wrappers so every backend sees the same rules.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

# Large finite negative for masked logits: unlike -inf it keeps exp(s - max) finite for rows that see nothing.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)

_FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "logit_soft_cap", "return_lse"))
def tree_attention_reference(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    cache_len: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    tree_mask: jax.Array | None,
    *,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    logit_soft_cap: float | None = None,
    q_positions: jax.Array | None = None,
    return_lse: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Attention of new tokens to a cached prefix and to each other (tree mask), accumulated in fp32.

    Per row b, query token t and head n (kv head k = n // G):
        logits over cache slot s < cache_len[b]  and over new token u with tree_mask[b, t, u],
        each scaled by sm_scale, then soft-capped c * tanh(x / c) if `logit_soft_cap` is set,
        and hidden when q_positions[b, t] - key_position >= sliding_window;
        out = softmax(logits) @ [v_cache[b, :cache_len, k]; v_new[b, :, k]].
    This equals the log-sum-exp merge of attention over the prefix (lse_a) and over the tree (lse_b)
    used by the kernels. A row that sees no key returns zeros. Cache slots >= cache_len are never used,
    whatever they hold (NaN included).

    Args:
      q: [B, T, N, H] queries.
      k_cache: [B, K, S, H] cached keys (head-major); slot j has absolute position j.
      v_cache: [B, K, S, H] cached values.
      cache_len: [B] int valid prefix length per row (clipped to [0, S]).
      k_new: [B, T, K, H] keys of the new tokens.
      v_new: [B, T, K, H] values of the new tokens.
      tree_mask: [B, T, T] bool; tree_mask[b, i, j] = query i may see new token j; None = causal by
        index (j <= i).
      sm_scale: logit scale; default H ** -0.5.
      sliding_window: a key at position kp is visible to a query at qp only if qp - kp < sliding_window.
      logit_soft_cap: c in c * tanh(logits / c), applied after scaling.
      q_positions: [B, T] int absolute positions of the new tokens (queries and new keys alike);
        default cache_len[:, None] + arange(T).
      return_lse: also return each query's log-sum-exp of its visible logits.

    Returns:
      [B, T, N, H] attention output in q's dtype; with return_lse also [B, T, N] fp32 log-sum-exp (-inf
      for a query that sees no key), to merge with attention over other keys.
    """
    check_inputs(
        q,
        k_cache,
        v_cache,
        cache_len,
        k_new,
        v_new,
        tree_mask,
        q_positions=q_positions,
        sm_scale=sm_scale,
        sliding_window=sliding_window,
        logit_soft_cap=logit_soft_cap,
    )
    b, t, n, h = q.shape
    kv, s = k_cache.shape[1], k_cache.shape[2]
    g = n // kv
    scale = default_scale(h, sm_scale)
    cache_len = jnp.clip(cache_len.astype(jnp.int32), 0, s)
    positions = query_positions(cache_len, t, q_positions)
    hi = jax.lax.Precision.HIGHEST
    qf = q.astype(jnp.float32).reshape(b, t, kv, g, h)
    s_cache = jnp.einsum("BTKGH,BKSH->BKGTS", qf, k_cache.astype(jnp.float32), precision=hi) * scale
    s_new = jnp.einsum("BTKGH,BUKH->BKGTU", qf, k_new.astype(jnp.float32), precision=hi) * scale
    if logit_soft_cap is not None:
        s_cache = logit_soft_cap * jnp.tanh(s_cache / logit_soft_cap)
        s_new = logit_soft_cap * jnp.tanh(s_new / logit_soft_cap)

    slots = jnp.arange(s, dtype=jnp.int32)
    in_cache = slots[None, :] < cache_len[:, None]  # [B, S]
    cache_vis = in_cache[:, None, :]  # [B, 1 or T, S]
    if sliding_window is not None:
        cache_vis = cache_vis & (positions[:, :, None] - slots[None, None, :] < sliding_window)
    new_vis = new_token_visibility(tree_mask, positions, sliding_window)  # [B, T, U]

    # Where (not add) so that NaN/garbage logits of stale slots cannot leak into the max or the sum.
    s_cache = jnp.where(cache_vis[:, None, None], s_cache, MASK_VALUE)
    s_new = jnp.where(new_vis[:, None, None], s_new, MASK_VALUE)
    # `initial` keeps an empty cache (S = 0, prefill) well defined.
    m = jnp.maximum(s_cache.max(axis=-1, initial=MASK_VALUE), s_new.max(axis=-1))[
        ..., None
    ]  # [B, K, G, T, 1]
    p_cache = jnp.where(cache_vis[:, None, None], jnp.exp(s_cache - m), 0.0)
    p_new = jnp.where(new_vis[:, None, None], jnp.exp(s_new - m), 0.0)
    denom = p_cache.sum(axis=-1) + p_new.sum(axis=-1)  # [B, K, G, T]

    # Stale slots may hold anything; 0 * NaN would poison the sum, so zero them.
    v_cache_f = jnp.where(in_cache[:, None, :, None], v_cache.astype(jnp.float32), 0.0)
    out = jnp.einsum("BKGTS,BKSH->BTKGH", p_cache, v_cache_f, precision=hi)
    out = out + jnp.einsum("BKGTU,BUKH->BTKGH", p_new, v_new.astype(jnp.float32), precision=hi)
    denom = jnp.moveaxis(denom, 3, 1)[..., None]  # [B, T, K, G, 1]
    out = out * jnp.where(denom > 0, 1.0 / jnp.where(denom > 0, denom, 1.0), 0.0)
    out = out.reshape(b, t, n, h).astype(q.dtype)
    if not return_lse:
        return out
    lse = log_sum_exp(jnp.moveaxis(m[..., 0], 3, 1), denom[..., 0])  # [B, T, K, G]
    return out, lse.reshape(b, t, n)


# ----------------------------------------------------------------------------------------------------------
# Helpers shared with the kernel wrappers.
# ----------------------------------------------------------------------------------------------------------


def default_scale(head_dim: int, sm_scale: float | None) -> float:
    """The logit scale: `sm_scale`, or head_dim ** -0.5 when None."""
    return float(head_dim) ** -0.5 if sm_scale is None else float(sm_scale)


def query_positions(cache_len: jax.Array, t: int, q_positions: jax.Array | None) -> jax.Array:
    """[B, T] int32 absolute positions of the new tokens; default cache_len[:, None] + arange(T)."""
    if q_positions is None:
        return cache_len.astype(jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    return q_positions.astype(jnp.int32)


def new_token_visibility(
    tree_mask: jax.Array | None, positions: jax.Array, sliding_window: int | None
) -> jax.Array:
    """[B, T, U] bool: query t sees new token u (the tree mask, causal by index when None, and the window
    on their positions)."""
    if tree_mask is None:
        b, t = positions.shape
        tree_mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), jnp.bool_)), (b, t, t))
    vis = tree_mask.astype(jnp.bool_)
    if sliding_window is not None:
        vis = vis & (positions[:, :, None] - positions[:, None, :] < sliding_window)
    return vis


def check_inputs(
    q,
    k_cache,
    v_cache,
    cache_len,
    k_new,
    v_new,
    tree_mask,
    *,
    q_positions=None,
    sm_scale=None,
    sliding_window=None,
    logit_soft_cap=None,
) -> None:
    """Raises ValueError, naming the argument and the expected shape, for inconsistent inputs."""
    if q.ndim != 4:
        raise ValueError(f"q must be [batch, n, num_heads, head_dim], got shape {q.shape}")
    b, t, n, h = q.shape
    if k_cache.ndim != 4 or k_cache.shape[0] != b or k_cache.shape[3] != h:
        raise ValueError(
            f"k_cache must be [batch={b}, num_kv_heads, max_len, head_dim={h}], got shape {k_cache.shape}"
        )
    kv = k_cache.shape[1]
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {v_cache.shape} must equal k_cache shape {k_cache.shape}")
    if kv == 0 or n % kv:
        raise ValueError(f"num_heads={n} must be a multiple of num_kv_heads={kv} (grouped-query attention)")
    new_shape = (b, t, kv, h)
    for name, x in (("k_new", k_new), ("v_new", v_new)):
        if x.shape != new_shape:
            raise ValueError(f"{name} must be [batch, n, num_kv_heads, head_dim]={new_shape}, got {x.shape}")
    if cache_len.shape != (b,) or not jnp.issubdtype(cache_len.dtype, jnp.integer):
        raise ValueError(
            f"cache_len must be an int array of shape ({b},), got {cache_len.dtype}{cache_len.shape}"
        )
    if tree_mask is not None and (tree_mask.shape != (b, t, t) or tree_mask.dtype != jnp.bool_):
        raise ValueError(
            f"tree_mask must be bool [batch, n, n]={(b, t, t)} or None (causal), "
            f"got {tree_mask.dtype}{tree_mask.shape}"
        )
    if q_positions is not None and (
        q_positions.shape != (b, t) or not jnp.issubdtype(q_positions.dtype, jnp.integer)
    ):
        raise ValueError(
            f"q_positions must be an int array [batch, n]={(b, t)}, "
            f"got {q_positions.dtype}{q_positions.shape}"
        )
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k_new", k_new), ("v_new", v_new)):
        if x.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")
    if len({k_cache.dtype, v_cache.dtype, k_new.dtype, v_new.dtype}) != 1:
        raise ValueError(
            "k_cache, v_cache, k_new and v_new must share one dtype, got "
            f"{k_cache.dtype}, {v_cache.dtype}, {k_new.dtype}, {v_new.dtype}"
        )
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window <= 0):
        raise ValueError(f"sliding_window must be a positive python int or None, got {sliding_window!r}")
    if logit_soft_cap is not None and not (isinstance(logit_soft_cap, (int, float)) and logit_soft_cap > 0):
        raise ValueError(f"logit_soft_cap must be a positive float or None, got {logit_soft_cap!r}")
    if sm_scale is not None and not (isinstance(sm_scale, (int, float)) and math.isfinite(sm_scale)):
        raise ValueError(f"sm_scale must be a finite python float or None, got {sm_scale!r}")


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def pack_queries(q: jax.Array, num_kv_heads: int, rows_pad: int) -> jax.Array:
    """[B, T, N, H] -> [B, K, rows_pad, H] with row r = t * G + g (query t, head k * G + g), zero padded.

    All queries of one kv head form one tile, so each prefix KV tile is read once per kv head.
    """
    b, t, n, h = q.shape
    g = n // num_kv_heads
    packed = q.reshape(b, t, num_kv_heads, g, h).transpose(0, 2, 1, 3, 4).reshape(b, num_kv_heads, t * g, h)
    return jnp.pad(packed, ((0, 0), (0, 0), (0, rows_pad - t * g), (0, 0)))


def unpack_queries(packed: jax.Array, t: int, num_heads: int) -> jax.Array:
    """Inverse of `pack_queries`: [B, K, rows_pad, H] -> [B, T, N, H]."""
    b, kv, _, h = packed.shape
    g = num_heads // kv
    out = packed[:, :, : t * g].reshape(b, kv, t, g, h).transpose(0, 2, 1, 3, 4)
    return out.reshape(b, t, num_heads, h)


def unpack_row_stats(packed: jax.Array, t: int, num_heads: int) -> jax.Array:
    """`unpack_queries` for one number per packed row: [B, K, rows_pad] -> [B, T, N]."""
    b, kv, _ = packed.shape
    g = num_heads // kv
    return packed[:, :, : t * g].reshape(b, kv, t, g).transpose(0, 2, 1, 3).reshape(b, t, num_heads)


def log_sum_exp(m: jax.Array, denom: jax.Array) -> jax.Array:
    """The log-sum-exp m + log(denom) of an online softmax's running max and denominator (-inf where the
    denominator is 0: no key seen)."""
    return jnp.where(denom > 0, m + jnp.log(jnp.where(denom > 0, denom, 1.0)), -jnp.inf)


def row_positions(positions: jax.Array, group: int, rows_pad: int) -> jax.Array:
    """[B, T] -> [B, rows_pad] int32 positions in packed row order (pad rows repeat the last position)."""
    rows = jnp.repeat(positions.astype(jnp.int32), group, axis=1)
    return jnp.pad(rows, ((0, 0), (0, rows_pad - rows.shape[1])), mode="edge")


def prefix_tile_bounds(
    cache_len: jax.Array, positions: jax.Array, sliding_window: int | None, block_kv: int
) -> jax.Array:
    """[B, 8] int32 per-row tile plan for the prefix: (cache_len, start, u0, u1, end, 0, 0, 0).

    KV tiles [start, end) are the only ones read; tiles before `start` are entirely outside the sliding
    window for every query and tiles from `end` on are beyond cache_len. Tiles [u0, u1) are entirely
    visible to every query and need no mask; tiles [start, u0) and [u1, end) are masked.
    """
    cache_len = cache_len.astype(jnp.int32)
    end = (cache_len + block_kv - 1) // block_kv
    if sliding_window is None:
        first_any = jnp.zeros_like(cache_len)  # first slot visible to some query
        first_all = jnp.zeros_like(cache_len)  # first slot visible to every query
    else:
        first_any = jnp.maximum(positions.min(axis=1) - sliding_window + 1, 0)
        first_all = jnp.maximum(positions.max(axis=1) - sliding_window + 1, 0)
    start = jnp.minimum(first_any // block_kv, end)
    u0 = jnp.clip((first_all + block_kv - 1) // block_kv, start, end)
    u1 = jnp.clip(cache_len // block_kv, u0, end)
    zero = jnp.zeros_like(cache_len)
    return jnp.stack([cache_len, start, u0, u1, end, zero, zero, zero], axis=1)
