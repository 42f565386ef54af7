"""Prefix + tree attention in jnp whose cost follows the filled cache, not its slots: the CPU path.

The dense reference scores every cache slot and then masks the stale ones, so a cache of 1,024 slots with
100 filled costs ten times the useful work. This implementation reads the head-major cache in chunks of
`chunk` slots inside a `lax.fori_loop` that runs only up to the batch's longest row (and starts at the
sliding window's first visible chunk), keeping a running max, denominator and accumulator per query (online
softmax, as the kernels do). Only the chunk in flight is copied. The new tokens (a decode step, a verify
chain or tree, a draft block, or a whole prompt) are scored in query blocks of `query_block` rows; under
`causal=True` a block skips the keys after its last row, so a prefill does about half of the T^2 work and
never holds a [T, T] score matrix for long prompts.

Masking is by `where`, never by arithmetic on stale slots: a stale slot may hold anything (NaN included)
and its value is replaced by zero before it meets a probability.

Glossary of einsum letters: B batch, T new (query) tokens, U new key tokens, C slots of one chunk,
K kv heads, G query heads per kv head, M = T x G queries per kv head, H head_dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import bits_slicing
from pallas_kernels.tree_attention.reference import (
    MASK_VALUE,
    check_inputs,
    default_scale,
    log_sum_exp,
    new_token_visibility,
    query_positions,
)

_HI = jax.lax.Precision.HIGHEST


def chunk_size(slots: int) -> int:
    """Cache slots per chunk: small chunks waste little past the filled length, large ones loop less.

    128 for every query count, never more than the cache has. On a 2-core CPU, 128 was the fastest of
    16-128 for verify blocks and prompts (batch 64), and with the head-major loop of 32-256 for verify
    blocks and, at batch 8, for a decode step too (a plain bf16 SmolLM2 step: 67 against 78 ms with
    32-slot chunks; the same at batch 1).
    """
    return min(slots, 128)


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "sliding_window", "logit_soft_cap", "causal", "query_block", "return_lse"),
)
def tree_attention_chunked(
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
    causal: bool = False,
    query_block: int = 256,
    return_lse: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """`tree_attention_reference` with work proportional to the filled prefix (see the module doc).

    Args:
      q, k_cache, v_cache, cache_len, k_new, v_new, tree_mask, sm_scale, sliding_window, logit_soft_cap,
        q_positions, return_lse: as in `tree_attention_reference`.
      causal: static promise that tree_mask[b, i, j] is False for j > i (prefill and chains; trees in
        topological order too). Query blocks then skip the new keys after their last row.
      query_block: new tokens per query block.

    Returns:
      [B, T, N, H] attention output in q's dtype (fp32 accumulation); rows that see no key are zero. With
      return_lse also the [B, T, N] fp32 log-sum-exp.
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
    cache_len = jnp.clip(cache_len.astype(jnp.int32), 0, s)
    positions = query_positions(cache_len, t, q_positions)  # [B, T]
    qf = q.astype(jnp.float32).reshape(b, t, kv, g, h) * default_scale(h, sm_scale)  # [B, T, K, G, H]

    def cap(scores):
        return scores if logit_soft_cap is None else logit_soft_cap * jnp.tanh(scores / logit_soft_cap)

    state = (
        jnp.full((b, t, kv, g), MASK_VALUE, jnp.float32),  # running max
        jnp.zeros((b, t, kv, g), jnp.float32),  # running denominator
        jnp.zeros((b, t, kv, g, h), jnp.float32),  # running numerator
    )
    if s:
        state = _prefix(qf, k_cache, v_cache, cache_len, positions, sliding_window, cap, state)
    m, denom, acc = state

    new_vis = new_token_visibility(tree_mask, positions, sliding_window)  # [B, T, U]
    kn, vn = k_new.astype(jnp.float32), v_new.astype(jnp.float32)
    outs, lses = [], []
    for lo in range(0, t, query_block):
        hi = min(t, lo + query_block)
        keys = hi if causal or tree_mask is None else t  # new keys this block can see
        state = (m[:, lo:hi], denom[:, lo:hi], acc[:, lo:hi])
        scores = cap(jnp.einsum("BTKGH,BUKH->BTKGU", qf[:, lo:hi], kn[:, :keys], precision=_HI))
        vis = new_vis[:, lo:hi, None, None, :keys]  # [B, Tq, 1, 1, U]
        mb, lb, accb = online_update(state, scores, vis, vn[:, :keys], "BTKGU,BUKH->BTKGH")
        outs.append(accb * jnp.where(lb > 0, 1.0 / jnp.where(lb > 0, lb, 1.0), 0.0)[..., None])
        lses.append(log_sum_exp(mb, lb))
    out = jnp.concatenate(outs, axis=1).reshape(b, t, n, h).astype(q.dtype)  # from [B, T, K, G, H]
    return (out, jnp.concatenate(lses, axis=1).reshape(b, t, n)) if return_lse else out


def _chunk_loop(k_cache, v_cache, cache_len, positions, sliding_window, c, chunk_body, state):
    """Runs chunk_body(state, kc, vc, vis) over the chunks from the window's first visible one to the one
    holding the longest row's last filled slot; kc, vc [B, K, C, H] fp32 (stale slots of vc zeroed),
    vis [B, T, C] the slots each query sees.

    A chunk that would run past the end of the cache is moved back to end there (dynamic_slice clamps);
    its slots already covered by the previous chunk are masked, so every slot counts once.
    """
    s = k_cache.shape[2]
    first = 0
    if sliding_window is not None:  # slots before this are outside every query's window
        first = jnp.maximum(jnp.min(positions) - sliding_window + 1, 0) // c
    last = (jnp.max(cache_len) + c - 1) // c  # chunks [first, last) hold every filled slot

    def body(i, state):
        start = jnp.minimum(i * c, s - c)
        kc = bits_slicing.dynamic_slice_in_dim(k_cache, start, c, axis=2).astype(jnp.float32)  # [B, K, C, H]
        vc = bits_slicing.dynamic_slice_in_dim(v_cache, start, c, axis=2).astype(jnp.float32)
        slots = start + jnp.arange(c, dtype=jnp.int32)  # [C]
        filled = (slots[None, :] >= i * c) & (slots[None, :] < cache_len[:, None])  # [B, C]
        vis = filled[:, None, :]  # [B, 1 or T, C]
        if sliding_window is not None:
            vis = vis & (positions[:, :, None] - slots[None, None, :] < sliding_window)
        vc = jnp.where(filled[:, None, :, None], vc, 0.0)  # stale slots may hold NaN
        return chunk_body(state, kc, vc, vis)

    return jax.lax.fori_loop(first, last, body, state)


def _prefix(qf, k_cache, v_cache, cache_len, positions, sliding_window, cap, state):
    """Online softmax of queries qf [B, T, K, G, H] over the filled cache, chunk by chunk.

    The loop works head-major: each kv head's T * G queries form one row block M, so both products are
    batched matmuls over (row, kv head) with the batch axes leading, the form XLA's CPU backend hands to
    its matmul library (a [B, T, K, G, C] layout made it emit a slow generic dot for the value mix).
    """
    b, t, kv, g, h = qf.shape

    def to_rows(x):  # [B, T, K, G, ...] -> [B, K, M, ...]
        return jnp.moveaxis(x, 1, 2).reshape(b, kv, t * g, *x.shape[4:])

    def from_rows(x):  # [B, K, M, ...] -> [B, T, K, G, ...]
        return jnp.moveaxis(x.reshape(b, kv, t, g, *x.shape[3:]), 2, 1)

    qm = to_rows(qf)  # [B, K, M, H]
    c = chunk_size(k_cache.shape[2])

    def chunk_body(state, kc, vc, vis):
        scores = cap(jnp.einsum("BKMH,BKCH->BKMC", qm, kc, precision=_HI))
        vis = jnp.broadcast_to(vis[:, None, :, None, :], (b, 1, t, g, c)).reshape(b, 1, t * g, c)
        return online_update(state, scores, vis, vc, "BKMC,BKCH->BKMH")

    state = _chunk_loop(
        k_cache, v_cache, cache_len, positions, sliding_window, c, chunk_body, tuple(map(to_rows, state))
    )
    return tuple(map(from_rows, state))


def online_update(state, scores, visible, values, mix):
    """One online-softmax step: folds scores (visible where `visible`) into the state.

    Args:
      state: (running max, running denominator, running numerator): the max and denominator have the
        scores' shape without its last axis, the numerator one more trailing dimension.
      scores: the logits of one block of keys, the keys along the last axis.
      visible: bool, broadcastable to scores.
      values: the block's values, mixed with the probabilities by the einsum `mix`.
      mix: einsum from (probabilities, values) to the numerator's shape.

    Returns:
      The updated state.
    """
    m, denom, acc = state
    scores = jnp.where(visible, scores, MASK_VALUE)
    m_new = jnp.maximum(m, scores.max(axis=-1))
    p = jnp.where(visible, jnp.exp(scores - m_new[..., None]), 0.0)
    rescale = jnp.exp(m - m_new)
    acc = acc * rescale[..., None] + jnp.einsum(mix, p, values, precision=_HI)
    return m_new, denom * rescale + p.sum(axis=-1), acc
