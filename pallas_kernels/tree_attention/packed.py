"""Causal attention over packed prompts (variable-length rows back to back): the CPU prefill path.

Prefilling a right-padded [B, P] batch scores B x P^2 / 2 query-key pairs, most of them padding when the
prompts are ragged (64 MT-Bench prompts: 7,045 tokens in a [64, 512] bucket). Here the prompts arrive
packed, [L] tokens with a segment (row) id each, and every block of `block` queries loops only over the key
blocks from its first query's row start (or sliding-window start) to its own end: the work is about
sum(len^2) / 2 plus one block per query block, and the softmax runs online over those key blocks.

Glossary of einsum letters: Q queries of a block, C keys of a block, K kv heads, G query heads per kv
head, M = Q x G query rows of one kv head, H head_dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.tree_attention.chunked import online_update
from pallas_kernels.tree_attention.reference import MASK_VALUE, default_scale

_HI = jax.lax.Precision.HIGHEST


def block_size(length: int, largest: int = 64) -> int:
    """Queries (and keys) per block: the largest power of two <= `largest` that divides the pack."""
    return min(largest, length & -length)


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "block"))
def packed_causal_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array,
    positions: jax.Array,
    *,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    block: int | None = None,
    initial_state: tuple[jax.Array, jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """Causal self-attention inside each segment of a pack.

    Token i sees token j when both are in the same segment, j <= i, and (with a window w)
    positions[i] - positions[j] < w. Segments are contiguous and in order; tokens with segment id -1 (the
    unused tail of a pack) see nothing and return zeros (unless their initial state says otherwise).

    Args:
      q: [L, N, H] queries.
      k: [L, K, H] keys (N % K == 0).
      v: [L, K, H] values.
      segment_ids: [L] int32 row of each token, non-decreasing over the real tokens; -1 for unused ones.
      positions: [L] int32 position of each token in its row.
      sm_scale: logit scale; default H ** -0.5.
      sliding_window: python int w or None.
      block: queries and keys per block (must divide L); default `block_size(L)`.
      initial_state: the softmax state of every query over keys in front of the pack (a shared prefix,
        see pallas_kernels.shared_prefix.packed), continued here by the pack's own keys: (running max
        [L, K, G], denominator [L, K, G], numerator [L, K, G, H]) fp32 over logits already multiplied by
        the scale, with G = N // K query heads per kv head. None = no keys in front (a fresh state).

    Returns:
      [L, N, H] in q's dtype (fp32 accumulation).
    """
    length, n, h = q.shape
    kv = k.shape[1]
    g = n // kv
    block = block or block_size(length)
    if length % block:
        raise ValueError(f"block={block} must divide the pack length {length}")
    # Head-major: each kv head's Q x G queries of a block are the rows of both products, so the products
    # are matmuls batched over a leading kv-head axis (with the query axis first XLA's CPU backend moved
    # every block's scores and queries before each product).
    qf = q.astype(jnp.float32).reshape(length, kv, g, h) * default_scale(h, sm_scale)
    qf = jnp.moveaxis(qf, 1, 0).reshape(kv, length * g, h)  # [K, L x G, H]: a block's rows are contiguous
    kf = jnp.moveaxis(k.astype(jnp.float32), 1, 0)  # [K, L, H]
    vf = jnp.where((segment_ids >= 0)[:, None, None], v.astype(jnp.float32), 0.0)  # tail: anything
    vf = jnp.moveaxis(vf, 1, 0)  # [K, L, H]
    segment_ids = segment_ids.astype(jnp.int32)
    positions = positions.astype(jnp.int32)
    index = jnp.arange(length, dtype=jnp.int32)
    # First packed index each token may see: its segment's start, or its window's start (positions run
    # with the index inside a segment); an unused token sees nothing, so its own index.
    sorted_ids = jnp.where(segment_ids < 0, jnp.iinfo(jnp.int32).max, segment_ids)
    first_visible = jnp.searchsorted(sorted_ids, sorted_ids, side="left").astype(jnp.int32)
    first_visible = jnp.where(segment_ids < 0, index, first_visible)
    if sliding_window is not None:
        first_visible = jnp.maximum(first_visible, index - sliding_window + 1)
    if initial_state is not None:  # [K, L x G, ...], the loop's layout
        initial_state = tuple(
            jnp.moveaxis(x, 0, 1).reshape(kv, length * g, *x.shape[3:]) for x in initial_state
        )

    def query_block(j, out):
        lo_q = j * block
        qb = jax.lax.dynamic_slice_in_dim(qf, lo_q * g, block * g, axis=1)  # [K, M, H]
        seg_q = jax.lax.dynamic_slice_in_dim(segment_ids, lo_q, block)  # [Q]
        pos_q = jax.lax.dynamic_slice_in_dim(positions, lo_q, block)
        idx_q = lo_q + jnp.arange(block, dtype=jnp.int32)

        def key_block(i, state):
            lo_k = i * block
            kb = jax.lax.dynamic_slice_in_dim(kf, lo_k, block, axis=1)  # [K, C, H]
            vb = jax.lax.dynamic_slice_in_dim(vf, lo_k, block, axis=1)
            seg_k = jax.lax.dynamic_slice_in_dim(segment_ids, lo_k, block)
            pos_k = jax.lax.dynamic_slice_in_dim(positions, lo_k, block)
            idx_k = lo_k + jnp.arange(block, dtype=jnp.int32)
            vis = (seg_q[:, None] == seg_k[None, :]) & (idx_k[None, :] <= idx_q[:, None])  # [Q, C]
            vis = vis & (seg_q[:, None] >= 0)  # the unused tail sees nothing
            if sliding_window is not None:
                vis = vis & (pos_q[:, None] - pos_k[None, :] < sliding_window)
            vis = jnp.broadcast_to(vis[:, None, :], (block, g, block)).reshape(1, block * g, block)
            scores = jnp.einsum("KMH,KCH->KMC", qb, kb, precision=_HI)
            return online_update(state, scores, vis, vb, "KMC,KCH->KMH")

        first_key = jax.lax.dynamic_index_in_dim(first_visible, lo_q, keepdims=False)
        if initial_state is None:
            state = (
                jnp.full((kv, block * g), MASK_VALUE, jnp.float32),
                jnp.zeros((kv, block * g), jnp.float32),
                jnp.zeros((kv, block * g, h), jnp.float32),
            )
        else:
            state = tuple(jax.lax.dynamic_slice_in_dim(x, lo_q * g, block * g, axis=1) for x in initial_state)
        _, denom, acc = jax.lax.fori_loop(first_key // block, j + 1, key_block, state)
        res = acc * jnp.where(denom > 0, 1.0 / jnp.where(denom > 0, denom, 1.0), 0.0)[..., None]
        return jax.lax.dynamic_update_slice_in_dim(out, res, lo_q * g, axis=1)

    out = jax.lax.fori_loop(0, length // block, query_block, jnp.zeros((kv, length * g, h), jnp.float32))
    return jnp.moveaxis(out.reshape(kv, length, g, h), 0, 1).reshape(length, n, h).astype(q.dtype)
