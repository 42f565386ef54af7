"""Packed prompt rests on top of shared prefixes: the CPU prefill path of `dflax.decoding.shared_prefix`.

After a group's common prefix is prefilled once, each row prefills its own rest of the prompt. The rests are
ragged (MT-Bench under one system message: 28 to 114 tokens, padded to 128), so they arrive packed like
plain prompts (`pallas_kernels.tree_attention.packed`): [L] tokens back to back with a segment (row) id
each. Every token attends to its group's prefix, then causally to its own row's earlier tokens, in one
softmax: level 1 here scores each block of packed queries against the prefixes of the groups its tokens
belong to (a block of consecutive rows usually lies in one group, so each prefix is scored once per query
block, not once per row), and level 2 continues that softmax state over the pack
(`packed_causal_attention(..., initial_state=...)`).

Glossary of einsum letters: Q queries of a block, C prefix slots of a chunk, K kv heads, G query heads per
kv head, H head_dim.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.tree_attention.chunked import online_update
from pallas_kernels.tree_attention.packed import block_size, packed_causal_attention
from pallas_kernels.tree_attention.reference import MASK_VALUE, default_scale

_HI = jax.lax.Precision.HIGHEST


@functools.partial(jax.jit, static_argnames=("sm_scale", "block", "prefix_chunk"))
def packed_shared_prefix_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    segment_ids: jax.Array,
    token_group: jax.Array,
    prefix_k: jax.Array,
    prefix_v: jax.Array,
    prefix_len: jax.Array,
    *,
    sm_scale: float | None = None,
    block: int | None = None,
    prefix_chunk: int | None = None,
) -> jax.Array:
    """Each packed token attends to its group's shared prefix and causally inside its own segment.

    Token i sees prefix slots [0, prefix_len[token_group[i]]) of its group and the tokens j <= i of its
    segment. Segments are contiguous and in order; tokens with segment id -1 (the unused tail) see nothing
    and return zeros.

    Args:
      q: [L, N, H] queries (RoPE applied at their absolute positions, after the prefix).
      k, v: [L, K, H] keys and values of the packed tokens (N % K == 0).
      segment_ids: [L] int32 row of each token, non-decreasing over the real tokens; -1 for unused ones.
      token_group: [L] int32 group of each token's row (the row's prefix); -1 for unused tokens.
      prefix_k, prefix_v: [P, K, S, H] each group's prefix keys/values, head-major.
      prefix_len: [P] int32 valid prefix slots per group; slots from there on are never read.
      sm_scale: logit scale; default H ** -0.5.
      block: queries per block (must divide L); default `block_size(L)`.
      prefix_chunk: prefix slots scored at once (must divide S); default `block_size(S, 256)`.

    Returns:
      [L, N, H] in q's dtype (fp32 accumulation).
    """
    length, n, h = q.shape
    kv = k.shape[1]
    block = block or block_size(length)
    prefix_chunk = prefix_chunk or block_size(prefix_k.shape[2], 256)
    if length % block or prefix_k.shape[2] % prefix_chunk:
        raise ValueError(
            f"block={block} must divide the pack length {length} and prefix_chunk={prefix_chunk} the "
            f"prefix slots {prefix_k.shape[2]}"
        )
    qf = q.astype(jnp.float32).reshape(length, kv, n // kv, h) * default_scale(h, sm_scale)  # [L, K, G, H]
    state = packed_prefix_state(qf, token_group, prefix_k, prefix_v, prefix_len, block, prefix_chunk)
    return packed_causal_attention(
        q, k, v, segment_ids, jnp.zeros((length,), jnp.int32), sm_scale=sm_scale, block=block,
        initial_state=state,
    )  # fmt: skip


def packed_prefix_state(
    qf: jax.Array,
    token_group: jax.Array,
    prefix_k: jax.Array,
    prefix_v: jax.Array,
    prefix_len: jax.Array,
    block: int,
    prefix_chunk: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Level 1: the softmax state of every packed query over its group's prefix.

    A block of `block` queries loops over the groups its tokens belong to (from the smallest group id in
    it to the largest) and, per group, over the prefix chunks up to that group's length; a query takes part
    only where the group is its own.

    Args:
      qf: [L, K, G, H] fp32 queries, already multiplied by the logit scale.
      token_group, prefix_k, prefix_v, prefix_len: as in `packed_shared_prefix_attention`.
      block: queries per block (divides L).
      prefix_chunk: prefix slots per chunk (divides S).

    Returns:
      (running max [L, K, G], denominator [L, K, G], numerator [L, K, G, H]) fp32; a query whose group has
      an empty prefix (or that has no group) keeps the empty state.
    """
    length, kv, g, h = qf.shape
    token_group = token_group.astype(jnp.int32)
    prefix_len = jnp.clip(prefix_len.astype(jnp.int32), 0, prefix_k.shape[2])
    slot = jnp.arange(prefix_chunk, dtype=jnp.int32)  # [C]

    def query_block(j, out):
        lo_q = j * block
        qb = jax.lax.dynamic_slice_in_dim(qf, lo_q, block)  # [Q, K, G, H]
        group_q = jax.lax.dynamic_slice_in_dim(token_group, lo_q, block)  # [Q]

        def group_step(group, state):
            mine = group_q == group  # [Q]

            def chunk_step(c, state):
                lo = c * prefix_chunk
                take = lambda x: jax.lax.dynamic_slice(  # noqa: E731  [P, K, S, H] -> [K, C, H]
                    x, (group, 0, lo, 0), (1, kv, prefix_chunk, h)
                )[0].astype(jnp.float32)
                kc, vc = take(prefix_k), take(prefix_v)
                valid = lo + slot < prefix_len[group]  # [C]
                vc = jnp.where(valid[None, :, None], vc, 0.0)  # unread slots may hold anything
                scores = jnp.einsum("QKGH,KCH->QKGC", qb, kc, precision=_HI)
                visible = (mine[:, None] & valid[None, :])[:, None, None, :]  # [Q, 1, 1, C]
                return online_update(state, scores, visible, vc, "QKGC,KCH->QKGH")

            chunks = -(-prefix_len[group] // prefix_chunk)
            return jax.lax.fori_loop(0, chunks, chunk_step, state)

        real = group_q >= 0
        first = jnp.min(jnp.where(real, group_q, jnp.iinfo(jnp.int32).max))
        last = jnp.max(jnp.where(real, group_q, -1))  # a block of unused tokens loops over no group
        state = (
            jnp.full((block, kv, g), MASK_VALUE, jnp.float32),
            jnp.zeros((block, kv, g), jnp.float32),
            jnp.zeros((block, kv, g, h), jnp.float32),
        )
        state = jax.lax.fori_loop(first, last + 1, group_step, state)
        return tuple(jax.lax.dynamic_update_slice_in_dim(o, s, lo_q, axis=0) for o, s in zip(out, state))

    empty = (
        jnp.full((length, kv, g), MASK_VALUE, jnp.float32),
        jnp.zeros((length, kv, g), jnp.float32),
        jnp.zeros((length, kv, g, h), jnp.float32),
    )
    return jax.lax.fori_loop(0, length // block, query_block, empty)
