"""Attention of many blocks sharing one context, each seeing only a prefix of it: DFlash training layout.

Training places M blocks in one sequence (one per anchor). Block m's queries see the context keys
[0, context_len[m]) (the target features strictly before its anchor) and the keys of its own block
(bidirectionally), never another block's. Laid out as one [context | all blocks] attention this is a
block-sparse mask of (M * T) x (S + M * T) entries, quadratic in M; here each block is scored against the
shared context and against its own T keys only, so the work is M * T * (S + T) scores per head: linear in
the anchors and in the context length. The context keys/values are read in place for every block (never
copied per block), and blocks are processed `chunk` at a time under `jax.checkpoint`, so the scores held at
once (forward and backward) are those of one chunk: N * chunk * heads * T * (S + T) floats.

It is the dense reference's math (`pallas_kernels.tree_attention.reference`) with a per-block instead of a
per-row cache length: one softmax over both key sets, accumulated in float32.

Glossary of einsum letters: N sequences, M blocks (C of one chunk), T tokens per block, U the block's keys,
S context slots, K kv heads, G query heads per kv head, H head_dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.tree_attention.reference import MASK_VALUE

_HI = jax.lax.Precision.HIGHEST


def _chunk_attention(q, k_ctx, v_ctx, context_len, k_blk, v_blk, scale: float) -> jax.Array:
    """One chunk of blocks: q [N, C, T, K, G, H], k/v_blk [N, C, U, K, H], context_len [N, C]."""
    q = q.astype(jnp.float32)
    s_ctx = jnp.einsum("NCTKGH,NSKH->NCKGTS", q, k_ctx.astype(jnp.float32), precision=_HI) * scale
    s_blk = jnp.einsum("NCTKGH,NCUKH->NCKGTU", q, k_blk.astype(jnp.float32), precision=_HI) * scale
    slots = jnp.arange(k_ctx.shape[1], dtype=jnp.int32)
    visible = (slots < context_len[..., None])[:, :, None, None, None, :]  # [N, C, 1, 1, 1, S]
    s_ctx = jnp.where(visible, s_ctx, MASK_VALUE)
    m = jnp.maximum(s_ctx.max(axis=-1), s_blk.max(axis=-1))[..., None]  # [N, C, K, G, T, 1]
    p_ctx = jnp.where(visible, jnp.exp(s_ctx - m), 0.0)
    p_blk = jnp.exp(s_blk - m)
    denom = p_ctx.sum(axis=-1) + p_blk.sum(axis=-1)  # [N, C, K, G, T]
    out = jnp.einsum("NCKGTS,NSKH->NCTKGH", p_ctx, v_ctx.astype(jnp.float32), precision=_HI)
    out = out + jnp.einsum("NCKGTU,NCUKH->NCTKGH", p_blk, v_blk.astype(jnp.float32), precision=_HI)
    return out / jnp.moveaxis(denom, -1, 2)[..., None]  # [N, C, T, K, G, H]


def anchored_block_attention(
    q: jax.Array,
    k_ctx: jax.Array,
    v_ctx: jax.Array,
    context_len: jax.Array,
    k_blk: jax.Array,
    v_blk: jax.Array,
    *,
    sm_scale: float,
    chunk: int,
) -> jax.Array:
    """Each block attends to its context prefix and to its own tokens, in one softmax.

    Args:
      q: [N, M, T, heads, H] queries (RoPE applied) of M blocks of T tokens per sequence.
      k_ctx, v_ctx: [N, S, K, H] each sequence's context keys/values, shared by its M blocks.
      context_len: [N, M] int32; block m sees context slots [0, context_len[:, m]).
      k_blk, v_blk: [N, M, T, K, H] each block's own keys/values (all visible inside the block).
      sm_scale: logit scale.
      chunk: blocks scored at once (memory), a static int >= 1.

    Returns:
      [N, M, T, heads, H] attention output in q's dtype.
    """
    n, m, t, heads, h = q.shape
    kv = k_ctx.shape[2]
    chunk = min(chunk, m)
    chunks = -(-m // chunk)
    pad = chunks * chunk - m

    def split(x):  # [N, M, ...] -> [chunks, N, chunk, ...] (padding blocks see their own keys only)
        x = jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(n, chunks, chunk, *x.shape[2:]), 1, 0)

    grouped = q.reshape(n, m, t, kv, heads // kv, h)  # [N, M, T, K, G, H]

    @jax.checkpoint
    def one_chunk(args):
        q_c, len_c, k_c, v_c = args
        return _chunk_attention(q_c, k_ctx, v_ctx, len_c, k_c, v_c, sm_scale)

    out = jax.lax.map(one_chunk, (split(grouped), split(context_len), split(k_blk), split(v_blk)))
    out = jnp.moveaxis(out, 0, 1).reshape(n, chunks * chunk, t, heads, h)[:, :m]
    return out.astype(q.dtype)
