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

The scores are laid out as the matmuls produce them, kv-head major ([N, K, blocks * rows, S]): a layout
that needs a transpose per score tensor ([N, C, K, G, T, S]) spends twice the time moving scores on a CPU.

Glossary of einsum letters: N sequences, K kv heads, C blocks of one chunk, Q query rows of one block (its
T tokens times the G query heads of a kv head), R = C * Q, U the block's keys, S context slots, H head_dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.tree_attention.reference import MASK_VALUE

_HI = jax.lax.Precision.HIGHEST
_dot = functools.partial(jnp.einsum, precision=_HI, preferred_element_type=jnp.float32)


def _chunk_attention(q, k_ctx, v_ctx, context_len, k_blk, v_blk, scale: float) -> jax.Array:
    """One chunk of blocks: q [N, K, C, Q, H], k/v_ctx [N, K, S, H], context_len [N, C], k/v_blk
    [N, K, C, U, H] -> [N, K, C, Q, H] float32."""
    n, kv, c, rows, h = q.shape
    s_ctx = _dot("NKRH,NKSH->NKRS", q.reshape(n, kv, c * rows, h), k_ctx).reshape(n, kv, c, rows, -1)
    s_ctx = s_ctx * scale  # [N, K, C, Q, S]
    s_blk = _dot("NKCQH,NKCUH->NKCQU", q, k_blk) * scale
    slots = jnp.arange(k_ctx.shape[2], dtype=jnp.int32)
    visible = (slots < context_len[..., None])[:, None, :, None, :]  # [N, 1, C, 1, S]
    s_ctx = jnp.where(visible, s_ctx, MASK_VALUE)
    # Every block sees its own keys, so the max is a real score and the masked slots' exp underflows to 0.
    m = jnp.maximum(s_ctx.max(axis=-1), s_blk.max(axis=-1))[..., None]  # [N, K, C, Q, 1]
    p_ctx = jnp.exp(s_ctx - m)
    p_blk = jnp.exp(s_blk - m)
    denom = p_ctx.sum(axis=-1) + p_blk.sum(axis=-1)  # [N, K, C, Q]
    p_ctx = p_ctx.reshape(n, kv, c * rows, -1).astype(v_ctx.dtype)
    out = _dot("NKRS,NKSH->NKRH", p_ctx, v_ctx).reshape(n, kv, c, rows, h)
    out = out + _dot("NKCQU,NKCUH->NKCQH", p_blk.astype(v_blk.dtype), v_blk)
    return out / denom[..., None]


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

    Products run at the inputs' precision with float32 accumulation (a bf16 forward's products on the
    bf16 units), the softmax in float32.

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
    g = heads // kv
    chunk = min(chunk, m)
    chunks = -(-m // chunk)
    pad = chunks * chunk - m

    def split(x, axis):  # pad M to chunks * chunk and move the chunk index in front
        x = jnp.pad(x, [(0, pad) if a == axis else (0, 0) for a in range(x.ndim)])
        x = x.reshape(*x.shape[:axis], chunks, chunk, *x.shape[axis + 1 :])
        return jnp.moveaxis(x, axis, 0)

    # [N, M, T, K, G, H] -> [N, K, M, T * G, H]: a block's query rows, kv-head major
    q_rows = q.reshape(n, m, t, kv, g, h).transpose(0, 3, 1, 2, 4, 5).reshape(n, kv, m, t * g, h)
    k_ctx_h, v_ctx_h = (x.transpose(0, 2, 1, 3) for x in (k_ctx, v_ctx))  # [N, K, S, H]
    k_blk_h, v_blk_h = (x.transpose(0, 3, 1, 2, 4) for x in (k_blk, v_blk))  # [N, K, M, T, H]

    @jax.checkpoint
    def one_chunk(args):
        q_c, len_c, k_c, v_c = args
        return _chunk_attention(q_c, k_ctx_h, v_ctx_h, len_c, k_c, v_c, sm_scale)

    out = jax.lax.map(
        one_chunk, (split(q_rows, 2), split(context_len, 1), split(k_blk_h, 2), split(v_blk_h, 2))
    )
    out = jnp.moveaxis(out, 0, 2).reshape(n, kv, chunks * chunk, t, g, h)[:, :, :m]  # [N, K, M, T, G, H]
    return out.transpose(0, 2, 3, 1, 4, 5).reshape(n, m, t, heads, h).astype(q.dtype)
