"""Two-level attention in jnp: the shared prefix read once per group and KV head, then each row's own part.

Level 1 gathers the queries of a group's R rows (all T new tokens and all G query heads of a KV head) into
one [R * T * G, H] matrix per (group, KV head) and scores it against that group's prefix [L, H] in one
matmul: the prefix K/V are read once per step for the whole group instead of once per row, and no row holds
a copy of them. The result is a partial softmax state (running max, denominator, numerator) per query.
Level 2 continues that state over the row's own cache, chunk by chunk up to the longest row (the chunk
loop of the CPU tree attention), and over the new tokens under their mask (causal chains and prompts, or
a draft tree's ancestor mask), which is the log-sum-exp merge of the two partial attentions.

On TPU and GPU both levels are Pallas kernels: level 1 the prefix tile kernel (`pallas.py`), level 2 the
tree-attention kernel over the row's own cache and new tokens, which returns its log-sum-exp; the two
partial states are merged by log-sum-exp in jnp (`combine_tiles`, as the prefix kernel's tiles are).

Glossary of einsum letters: G groups, R rows per group, B rows, T new tokens, K kv heads, Q query heads per
kv head, X = R * T * Q queries of one (group, kv head), L prefix slots, U new keys, H head_dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.shared_prefix.layout import GroupLayout
from pallas_kernels.shared_prefix.pallas import combine_tiles, prefix_tiles
from pallas_kernels.shared_prefix.split import split_prefix_state
from pallas_kernels.tree_attention.chunked import _prefix, online_update
from pallas_kernels.tree_attention.ops import tree_attention
from pallas_kernels.tree_attention.reference import MASK_VALUE

_HI = jax.lax.Precision.HIGHEST
KERNEL_BLOCK_KV = {"tpu": 512, "gpu": 128}  # prefix slots per kernel tile


def shared_prefix_attention(
    q: jax.Array,
    prefix_k: jax.Array,
    prefix_v: jax.Array,
    prefix_len: jax.Array,
    layout: GroupLayout,
    k_cache: jax.Array,
    v_cache: jax.Array,
    cache_len: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    new_mask: jax.Array,
    *,
    sm_scale: float,
    causal: bool = False,
    query_block: int = 256,
    prefix_kernel: str | None = None,
    interpret: bool = False,
    prefix_splits: int = 1,
) -> jax.Array:
    """Attention of each row's new tokens to its group's shared prefix, its own cache and each other.

    Args:
      q: [B, T, N, H] queries (RoPE applied at their absolute positions).
      prefix_k, prefix_v: [G, K, L, H] each group's prefix keys/values (absolute positions 0 .. L - 1).
      prefix_len: [G] int32 valid prefix length per group; slots from there on are never read.
      layout: which rows belong to which group.
      k_cache, v_cache: [B, K, S, H] each row's own cache (slot j holds position prefix_len + j).
      cache_len: [B] int32 filled slots per row.
      k_new, v_new: [B, T, K, H] the new tokens' keys/values.
      new_mask: [B, T, T] bool, query i sees new token j; None = causal by index (j <= i).
      sm_scale: logit scale.
      causal: static promise that new_mask is lower-triangular (query blocks skip later keys).
      query_block: new tokens per query block.
      prefix_kernel: "tpu" or "gpu": run both levels as that platform's Pallas kernels (Mosaic on TPU,
        Triton on GPU): level 1 by `pallas_kernels.shared_prefix.pallas`, level 2 by the tree-attention
        kernel, which returns its log-sum-exp for the merge. None runs both in jnp.
      interpret: with prefix_kernel, run the kernels in Pallas interpret mode (CPU tests).
      prefix_splits: the jnp level 1 splits every prefix into this many parts over its length, merged by
        log-sum-exp (`pallas_kernels.shared_prefix.split`; 1 = no split, the default: no gain measured on
        CPU). It must divide the prefix slots. Ignored with prefix_kernel.

    Returns:
      [B, T, N, H] in q's dtype (fp32 accumulation), equal to per-row attention over the concatenation.
    """
    b, t, n, h = q.shape
    kv = k_cache.shape[1]
    if n % kv or prefix_k.shape[:2] != (layout.num_groups, kv) or prefix_k.shape[3] != h:
        raise ValueError(
            f"prefix_k must be [groups={layout.num_groups}, num_kv_heads={kv}, slots, head_dim={h}] with "
            f"num_heads={n} a multiple of num_kv_heads, got {prefix_k.shape}"
        )
    qf = q.astype(jnp.float32).reshape(b, t, kv, n // kv, h) * sm_scale  # [B, T, K, Q, H]
    state = _prefix_state(qf, prefix_k, prefix_v, prefix_len, layout, prefix_kernel, interpret, prefix_splits)
    if prefix_kernel is not None:
        return _merge_own_by_kernel(q, state, k_cache, v_cache, cache_len, k_new, v_new, new_mask, sm_scale,
                                    prefix_kernel, interpret)  # fmt: skip
    if new_mask is None:
        new_mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), jnp.bool_)), (b, t, t))
    if k_cache.shape[2]:
        cache_len = jnp.clip(cache_len.astype(jnp.int32), 0, k_cache.shape[2])
        positions = jnp.zeros((b, t), jnp.int32)  # positions only matter to sliding windows (none here)
        state = _prefix(qf, k_cache, v_cache, cache_len, positions, None, lambda s: s, state)
    m, denom, acc = state
    kn, vn = k_new.astype(jnp.float32), v_new.astype(jnp.float32)
    outs = []
    for lo in range(0, t, query_block):
        hi = min(t, lo + query_block)
        keys = hi if causal else t  # new keys this block can see
        scores = jnp.einsum("BTKQH,BUKH->BTKQU", qf[:, lo:hi], kn[:, :keys], precision=_HI)
        vis = new_mask[:, lo:hi, None, None, :keys]  # [B, Tq, 1, 1, U]
        block_state = (m[:, lo:hi], denom[:, lo:hi], acc[:, lo:hi])
        _, lb, accb = online_update(block_state, scores, vis, vn[:, :keys], "BTKQU,BUKH->BTKQH")
        outs.append(accb * jnp.where(lb > 0, 1.0 / jnp.where(lb > 0, lb, 1.0), 0.0)[..., None])
    out = outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)  # [B, T, K, Q, H]
    return out.reshape(b, t, n, h).astype(q.dtype)


def _merge_own_by_kernel(q, state, k_cache, v_cache, cache_len, k_new, v_new, new_mask, sm_scale, platform,
                         interpret):  # fmt: skip
    """Level 2 on a Pallas platform: the tree-attention kernel over each row's own cache and new tokens.
    Its output and log-sum-exp are a softmax state of their own (max = log-sum-exp, denominator 1,
    numerator = output), merged with the prefix state (max, denominator, numerator [B, T, K, Q, ...]) by
    `combine_tiles`, the merge of the prefix kernel's tiles."""
    b, t, n, h = q.shape
    m, denom, acc = state
    own, own_lse = tree_attention(
        q, k_cache, v_cache, cache_len, k_new, v_new, new_mask, sm_scale=sm_scale, backend=platform,
        interpret=interpret, return_lse=True,
    )  # fmt: skip
    own_state = (own_lse.reshape(m.shape), jnp.ones_like(denom), own.astype(jnp.float32).reshape(acc.shape))
    m, denom, acc = combine_tiles(*(jnp.stack(pair, axis=2) for pair in zip(state, own_state)))
    out = acc * jnp.where(denom > 0, 1.0 / jnp.where(denom > 0, denom, 1.0), 0.0)[..., None]
    return out.reshape(b, t, n, h).astype(q.dtype)  # from [B, T, K, Q, H]


def _prefix_state(qf, prefix_k, prefix_v, prefix_len, layout: GroupLayout, kernel, interpret: bool, splits):
    """Softmax state of every row's queries qf [B, T, K, Q, H] over its group's prefix.

    Returns:
      (max [B, T, K, Q], denominator [B, T, K, Q], numerator [B, T, K, Q, H]), fp32.
    """
    b, t, kv, nq, h = qf.shape
    g, r = layout.members.shape
    # The group's rows side by side; free places (index B) read the zero row appended here.
    padded = jnp.concatenate([qf, jnp.zeros((1, t, kv, nq, h), qf.dtype)])
    grouped = padded[layout.members].transpose(0, 3, 1, 2, 4, 5).reshape(g, kv, r * t * nq, h)  # [G, K, X, H]
    if kernel is not None:
        m, denom, acc = _prefix_by_kernel(grouped, prefix_k, prefix_v, prefix_len, kernel, interpret)
    else:
        slots = prefix_k.shape[2]
        if slots % splits:
            raise ValueError(f"prefix_splits={splits} must divide the prefix slots {slots}")
        if splits > 1:
            m, denom, acc = split_prefix_state(_prefix_dense, grouped, prefix_k, prefix_v, prefix_len, splits)
        else:
            m, denom, acc = _prefix_dense(grouped, prefix_k, prefix_v, prefix_len)

    def to_rows(x):  # [G, K, X, ...] -> [B, T, K, Q, ...]
        tail = x.shape[3:]
        x = x.reshape(g, kv, r, t, nq, *tail)
        x = jnp.moveaxis(x, 1, 3).reshape(g * r, t, kv, nq, *tail)  # [G * R, T, K, Q, ...]
        return x[layout.row_slot]

    return to_rows(m), to_rows(denom), to_rows(acc)


def _prefix_dense(grouped, prefix_k, prefix_v, prefix_len):
    """Level 1 in jnp: [G, K, X, H] queries over [G, K, L, H] prefixes -> max, denominator [G, K, X] and
    numerator [G, K, X, H], one matmul per (group, kv head)."""
    slots = prefix_k.shape[2]
    scores = jnp.einsum("GKXH,GKLH->GKXL", grouped, prefix_k.astype(jnp.float32), precision=_HI)
    visible = (jnp.arange(slots)[None, :] < prefix_len[:, None])[:, None, None, :]  # [G, 1, 1, L]
    scores = jnp.where(visible, scores, MASK_VALUE)
    m = scores.max(axis=-1)  # [G, K, X]
    p = jnp.where(visible, jnp.exp(scores - m[..., None]), 0.0)
    values = jnp.where(visible[:, :, 0, :, None], prefix_v.astype(jnp.float32), 0.0)  # unread slots: 0
    return m, p.sum(axis=-1), jnp.einsum("GKXL,GKLH->GKXH", p, values, precision=_HI)


def _prefix_by_kernel(grouped, prefix_k, prefix_v, prefix_len, platform, interpret):
    """Level 1 by the Pallas tile kernel: queries padded to a multiple of 8, the prefix to whole tiles."""
    x, slots = grouped.shape[2], prefix_k.shape[2]
    block_kv = min(KERNEL_BLOCK_KV[platform], max(8, 1 << (slots - 1).bit_length()))
    pad_x, pad_l = -x % 8, -slots % block_kv
    queries = jnp.pad(grouped, ((0, 0), (0, 0), (0, pad_x), (0, 0)))
    pad_kv = lambda a: jnp.pad(a, ((0, 0), (0, 0), (0, pad_l), (0, 0)))  # noqa: E731
    tiles = prefix_tiles(
        queries, pad_kv(prefix_k), pad_kv(prefix_v), prefix_len, block_kv=block_kv, platform=platform,
        interpret=interpret,
    )  # fmt: skip
    m, denom, acc = combine_tiles(*tiles)
    return m[:, :, :x], denom[:, :, :x], acc[:, :, :x]
