"""Prefix + tree attention as a Pallas GPU kernel (Triton lowering, the portable GPU path).

Shared-prefix attention for speculative verification (FlashForge, Hydragen, DeFT, FlashInfer cascade): all
T new tokens x all G query heads of one KV head are packed into one query tile of T * G rows, so each prefix
KV tile is loaded once per KV head instead of once per query token. One program per (row, kv head, query
tile, KV split) runs an online softmax over the tree part (the T new tokens under their mask; split 0 only)
and over its share of the prefix KV tiles; continuing one softmax across both parts is the log-sum-exp merge
of the two partial attentions, done in registers.

Split-KV (FlashDecoding): batch-1 verification of an 8-KV-head model is 8 programs, far from filling a
132-SM H100. When (batch x KV heads x query tiles) is below the SM count and the cache has enough tiles,
each row's needed prefix tiles are divided among `splits` programs; each writes an unnormalized partial
(accumulator, running max, denominator) in fp32 and an XLA epilogue merges them by log-sum-exp. The split
count comes from a static cost estimate: enough programs to fill the SMs, at least `min_tiles_per_split`
KV tiles each.

The loops run only over needed tiles, [start, end) from a small per-row plan array (Triton has no scalar
prefetch): tiles past cache_len or wholly outside the sliding window are never loaded. Interior tiles run
unmasked; the boundary tiles use masked loads (other=0), which also keeps stale or out-of-range cache
slots, NaN included, out of the sums. The new-token mask is computed in the kernel (masks.py): from iotas
when causal by index (`tree_mask=None`), else from bit words, one bit per (row, key); chunks of new keys that
a tile sees whole run unmasked, chunks it cannot see are skipped.

Triton wants power-of-two tensor sizes: head_dim must be a power of two; the packed rows and the new tokens
are padded to powers of two (at least 16, the minimum dot size) and the padding is masked.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.tree_attention import masks
from pallas_kernels.tree_attention import reference as ref_lib

_MIN_DOT = 16  # Triton's minimum dot dimension


def _is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes and launch settings of the GPU kernel; None picks a default from head_dim and dtype.

    The defaults (a query tile of at most 32 KiB, KV tiles of at most 16 KiB, 3 pipeline stages: 96 KiB of
    K/V buffers for bf16 head_dim 128) keep a program within shared memory on A100 (164 KiB) and H100
    (227 KiB); checked by compiling for sm_80 and sm_90 (tests/aot), not by running. fp32 inputs use IEEE
    fp32 dots, which Triton runs without tensor cores: correct but slow (a test dtype on GPU).

    Attributes:
      block_q: packed query rows (T * G) per program, a power of two >= 16; None = 32 KiB / (head_dim *
        itemsize), capped at 128. T * G <= block_q puts the whole tree of one KV head in one tile.
      block_kv: cache slots per prefix tile and new keys per tree chunk, a power of two >= 16; None =
        16 KiB / (head_dim * itemsize), capped at 64.
      num_warps: warps per program; None = 4 for query tiles up to 16 KiB and score tiles up to 4096
        elements, else 8.
      num_stages: software-pipelining stages of the KV loop.
      kv_splits: programs per (row, KV head, query tile) over the prefix; None = the cost estimate
        (`kv_splits_for`).
      num_sms: streaming multiprocessors to fill (H100 SXM: 132; A100: 108).
      min_tiles_per_split: the fewest prefix tiles a split is given by the estimate.
    """

    block_q: int | None = None
    block_kv: int | None = None
    num_warps: int | None = None
    num_stages: int = 3
    kv_splits: int | None = None
    num_sms: int = 132
    min_tiles_per_split: int = 4

    def __post_init__(self):
        for name in ("block_q", "block_kv"):
            value = getattr(self, name)
            if value is not None and (not _is_pow2(value) or value < _MIN_DOT):
                raise ValueError(f"{name}={value} must be a power of two >= {_MIN_DOT} (Triton tile rule)")
        if (self.num_warps is not None and self.num_warps <= 0) or self.num_stages <= 0:
            raise ValueError(f"num_warps={self.num_warps} and num_stages={self.num_stages} must be positive")
        if (self.kv_splits is not None and self.kv_splits <= 0) or self.num_sms <= 0:
            raise ValueError(f"kv_splits={self.kv_splits} and num_sms={self.num_sms} must be positive")
        if self.min_tiles_per_split <= 0:
            raise ValueError(f"min_tiles_per_split={self.min_tiles_per_split} must be positive")

    def resolve(self, rows: int, max_len: int, head_dim: int, itemsize: int) -> tuple[int, int, int]:
        """(block_q, block_kv, num_warps) for `rows` packed query rows and a cache of `max_len` slots."""
        row_bytes = head_dim * itemsize
        block_q = self.block_q or min(128, max(_MIN_DOT, 32768 // row_bytes))
        block_q = min(block_q, max(_MIN_DOT, _next_pow2(rows)))
        block_kv = self.block_kv or min(64, max(_MIN_DOT, 16384 // row_bytes))
        block_kv = min(block_kv, max(_MIN_DOT, _next_pow2(max_len)))
        small = block_q * row_bytes <= 16384 and block_q * block_kv <= 4096  # q tile and fp32 scores
        num_warps = self.num_warps or (4 if small else 8)
        return block_q, block_kv, num_warps

    def kv_splits_for(self, programs: int, kv_tiles: int) -> int:
        """Splits of each program's prefix: 1 when `programs` already fill the SMs, else enough to fill
        them, each split keeping at least `min_tiles_per_split` of the `kv_tiles` tiles."""
        if self.kv_splits is not None:
            return max(1, min(self.kv_splits, kv_tiles))
        if programs >= self.num_sms:
            return 1
        return max(1, min(-(-self.num_sms // programs), kv_tiles // self.min_tiles_per_split))


def _tree_attention_kernel(
    bounds_ref,  # [8] int32: cache_len, start, u0, u1, end, 0, 0, 0 of this batch row
    plan_ref,  # [4] int32: first, end, full_lo, full_hi chunk of new keys of this query tile
    q_ref,  # [block_q, H]: packed queries (row r = token r // G, head r % G of this kv head)
    k_ref,  # [S_pad, H]: this row's cache keys of one kv head (S rounded up to block_kv; never loaded whole)
    v_ref,  # [S_pad, H]: cache values
    k_new_ref,  # [u_pad, H]: keys of the new tokens (zero padded)
    v_new_ref,  # [u_pad, H]: values of the new tokens
    *refs,  # words [block_q / word_rows, u_pad] int32 (a given mask); qpos [block_q], kpos [u_pad] int32
    # (sliding window; kpos for the causal form only); outputs: o [block_q, H] (and with_lse the
    # log-sum-exp [block_q] f32), or with splits the partial acc [block_q, H], m and l [block_q] f32
    sm_scale: float,
    logit_soft_cap: float | None,
    sliding_window: int | None,
    block_kv: int,
    group: int,
    word_rows: int,
    splits: int,
    with_lse: bool,
):
    refs = list(refs)
    words_ref = refs.pop(0) if word_rows else None
    qpos_ref = refs.pop(0) if sliding_window is not None else None
    kpos_ref = refs.pop(0) if sliding_window is not None and not word_rows else None
    block_q, head_dim = q_ref.shape
    u_pad = k_new_ref.shape[0]
    qi, split = pl.program_id(2), pl.program_id(3)
    cache_len, start, u0, u1, end = (bounds_ref[i] for i in range(5))
    q = q_ref[...]
    # fp32 inputs get IEEE fp32 dots (Triton's default for them is TF32), like the reference.
    precision = jax.lax.Precision.HIGHEST if q_ref.dtype == jnp.float32 else None
    rows = jnp.arange(block_q, dtype=jnp.int32)

    def scores(k):  # [block_q, H] x [t, H] -> [block_q, t] f32 logits
        s = plgpu.dot(q, k, trans_b=True, precision=precision) * sm_scale
        if logit_soft_cap is not None:
            s = logit_soft_cap * jnp.tanh(s / logit_soft_cap)
        return s

    def update(carry, s, valid, v):  # one online-softmax step over t keys
        acc, m_prev, l_prev = carry
        if valid is not None:
            s = jnp.where(valid, s, ref_lib.MASK_VALUE)
        m_next = jnp.maximum(m_prev, s.max(axis=1))
        alpha = jnp.exp(m_prev - m_next)
        p = jnp.exp(s - m_next[:, None])
        if valid is not None:
            p = jnp.where(valid, p, 0.0)  # rows that see nothing keep l == 0
        l_next = alpha * l_prev + p.sum(axis=1)
        acc = alpha[:, None] * acc + plgpu.dot(p.astype(v.dtype), v, precision=precision)
        return acc, m_next, l_next

    tree_chunk = min(block_kv, u_pad)

    def tree_step(c, carry, masked: bool):
        cols = pl.ds(c * tree_chunk, tree_chunk)
        valid = None
        if masked and word_rows:
            words = words_ref[rows // word_rows, cols]  # [block_q, chunk]: each row's word
            valid = (jax.lax.shift_right_logical(words, (rows % word_rows)[:, None]) & 1) != 0
        elif masked:  # causal by index: key u seen by packed row r iff u * G <= r
            keys = c * tree_chunk + jnp.arange(tree_chunk, dtype=jnp.int32)
            valid = keys[None, :] * group <= (qi * block_q + rows)[:, None]
            if sliding_window is not None:
                valid = valid & (qpos_ref[...][:, None] - kpos_ref[cols][None, :] < sliding_window)
        return update(carry, scores(k_new_ref[cols, :]), valid, v_new_ref[cols, :])

    def prefix_step(j, carry, masked: bool):
        slots_at = pl.ds(j * block_kv, block_kv)
        if not masked:
            return update(carry, scores(k_ref[slots_at, :]), None, v_ref[slots_at, :])
        slots = j * block_kv + jnp.arange(block_kv, dtype=jnp.int32)
        in_len = slots < cache_len
        # Masked loads: no read past cache_len (nor past S), and stale slots come in as 0, not NaN.
        k = plgpu.load(k_ref.at[slots_at, :], mask=in_len[:, None], other=0.0)
        v = plgpu.load(v_ref.at[slots_at, :], mask=in_len[:, None], other=0.0)
        valid = in_len[None, :]
        if sliding_window is not None:
            valid = valid & (qpos_ref[...][:, None] - slots[None, :] < sliding_window)
        return update(carry, scores(k), valid, v)

    carry = (
        jnp.zeros((block_q, head_dim), jnp.float32),
        jnp.full((block_q,), -jnp.inf, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
    )
    # The tree part (split 0 only): masked chunks around the run [full_lo, full_hi) seen whole.
    first, last, full_lo, full_hi = (plan_ref[i] for i in range(masks.PLAN_FIELDS))
    last = jnp.where(split == 0, last, first)
    full_lo, full_hi = jnp.minimum(full_lo, last), jnp.minimum(full_hi, last)
    masked_tree = functools.partial(tree_step, masked=True)
    carry = jax.lax.fori_loop(first, full_lo, masked_tree, carry)
    carry = jax.lax.fori_loop(full_lo, full_hi, functools.partial(tree_step, masked=False), carry)
    carry = jax.lax.fori_loop(full_hi, last, masked_tree, carry)
    # This split's share of the prefix tiles [start, end): masked, unmasked [u0, u1), masked.
    per = (end - start + splits - 1) // splits
    lo = jnp.minimum(start + split * per, end)
    hi = jnp.minimum(lo + per, end)
    masked = functools.partial(prefix_step, masked=True)
    carry = jax.lax.fori_loop(lo, jnp.minimum(hi, u0), masked, carry)
    unmasked = functools.partial(prefix_step, masked=False)
    carry = jax.lax.fori_loop(jnp.maximum(lo, u0), jnp.minimum(hi, u1), unmasked, carry)
    carry = jax.lax.fori_loop(jnp.maximum(lo, u1), hi, masked, carry)
    acc, m, denom = carry
    if splits == 1:
        o_ref = refs[0]
        inv = jnp.where(denom > 0.0, 1.0 / jnp.where(denom > 0.0, denom, 1.0), 0.0)  # all-masked rows -> 0
        o_ref[...] = (acc * inv[:, None]).astype(o_ref.dtype)
        if with_lse:
            refs[1][...] = ref_lib.log_sum_exp(m, denom)
    else:
        acc_ref, m_ref, l_ref = refs
        acc_ref[...] = acc
        m_ref[...] = m
        l_ref[...] = denom


def merge_splits(acc: jax.Array, m: jax.Array, denom: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """Log-sum-exp merge of split partials: acc [..., P, R, H], m and denom [..., P, R] (P splits; m is
    -inf for a split that saw nothing) -> ([..., R, H] in `dtype`, rows that see nothing zero; the rows'
    log-sum-exp [..., R] fp32)."""
    m_max = jnp.max(m, axis=-2, keepdims=True)
    top = jnp.where(jnp.isfinite(m_max), m_max, 0.0)
    weight = jnp.exp(m - top)  # [..., P, R]
    total = jnp.sum(weight * denom, axis=-2)  # [..., R]
    out = jnp.sum(weight[..., None] * acc, axis=-3)  # [..., R, H]
    inv = jnp.where(total > 0.0, 1.0 / jnp.where(total > 0.0, total, 1.0), 0.0)
    return (out * inv[..., None]).astype(dtype), ref_lib.log_sum_exp(top[..., 0, :], total)


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "sliding_window",
        "logit_soft_cap",
        "block_sizes",
        "interpret",
        "return_lse",
    ),
)
def tree_attention_gpu(
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
    block_sizes: BlockSizes | None = None,
    interpret: bool = False,
    return_lse: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Prefix + tree attention on GPU (Triton); same contract as `tree_attention_reference`.

    Args:
      q: [B, T, N, H] queries; H a power of two.
      k_cache, v_cache: [B, K, S, H] cache (S >= 1); slots >= cache_len are never read.
      cache_len: [B] int valid prefix length per row.
      k_new, v_new: [B, T, K, H] keys/values of the new tokens.
      tree_mask: [B, T, T] bool, query i may see new token j; None = causal by index (j <= i).
      sm_scale: logit scale; default H ** -0.5.
      sliding_window: keys with q_pos - k_pos >= sliding_window are hidden.
      logit_soft_cap: c in c * tanh(logits / c).
      q_positions: [B, T] int positions of the new tokens; default cache_len[:, None] + arange(T).
      block_sizes: tile sizes and launch settings; default `BlockSizes()`.
      interpret: run the kernel in Pallas interpret mode (CPU).
      return_lse: also return the [B, T, N] fp32 log-sum-exp (see `tree_attention_reference`).

    Returns:
      [B, T, N, H] attention output in q's dtype (and the log-sum-exp with return_lse).
    """
    ref_lib.check_inputs(
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
    bs = BlockSizes() if block_sizes is None else block_sizes
    if not isinstance(bs, BlockSizes):
        raise ValueError(f"block_sizes for the gpu backend must be gpu.BlockSizes, got {type(bs).__name__}")
    b, t, n, h = q.shape
    kv, s = k_cache.shape[1], k_cache.shape[2]
    g = n // kv
    if not _is_pow2(h) or h < _MIN_DOT:
        raise ValueError(f"the gpu backend needs head_dim to be a power of two >= 16, got {h}")
    block_q, block_kv, num_warps = bs.resolve(t * g, s, h, jnp.dtype(q.dtype).itemsize)
    rows_pad = ref_lib.round_up(t * g, block_q)
    num_q_tiles = rows_pad // block_q
    # The cache block spans whole tiles: the last tile may run past S, where the masked loads (slot <
    # cache_len <= S) read nothing; interpret mode pads the block the same way.
    s_pad = ref_lib.round_up(s, block_kv)
    u_pad = max(_MIN_DOT, _next_pow2(t))
    tree_chunk = min(block_kv, u_pad)
    splits = bs.kv_splits_for(b * kv * num_q_tiles, s_pad // block_kv)
    scale = ref_lib.default_scale(h, sm_scale)

    cache_len = jnp.clip(cache_len.astype(jnp.int32), 0, s)
    positions = ref_lib.query_positions(cache_len, t, q_positions)
    causal = tree_mask is None
    windowed = sliding_window is not None
    word_rows = 0 if causal else int(min(32, block_q))
    if causal:
        plan = masks.causal_plan(b, t, g, rows_pad, block_q, tree_chunk, whole_ok=not windowed)
    else:
        new_vis = ref_lib.new_token_visibility(tree_mask, positions, sliding_window)  # [B, T, U]
        words = masks.mask_words(new_vis, g, rows_pad, u_pad, word_rows)  # [B, rows_pad / word_rows, u_pad]
        real = masks.real_row_words(t, g, rows_pad, word_rows)
        plan = masks.words_plan(words, real, block_q, word_rows, tree_chunk)
    bounds = ref_lib.prefix_tile_bounds(cache_len, positions, sliding_window, block_kv)  # [B, 8]
    q_packed = ref_lib.pack_queries(q, kv, rows_pad)  # [B, K, rows_pad, H]
    pad_u = ((0, 0), (0, u_pad - t), (0, 0), (0, 0))
    kn, vn = jnp.pad(k_new, pad_u), jnp.pad(v_new, pad_u)

    q_spec = pl.BlockSpec((None, None, block_q, h), lambda bi, hi, qi, si: (bi, hi, qi, 0))
    cache_spec = pl.BlockSpec((None, None, s_pad, h), lambda bi, hi, qi, si: (bi, hi, 0, 0))
    new_spec = pl.BlockSpec((None, u_pad, None, h), lambda bi, hi, qi, si: (bi, 0, hi, 0))
    in_specs = [
        pl.BlockSpec((None, 8), lambda bi, hi, qi, si: (bi, 0)),
        pl.BlockSpec((None, None, masks.PLAN_FIELDS), lambda bi, hi, qi, si: (bi, qi, 0)),
        q_spec,
        cache_spec,
        cache_spec,
        new_spec,
        new_spec,
    ]
    operands = [bounds, plan.reshape(b, num_q_tiles, masks.PLAN_FIELDS), q_packed, k_cache, v_cache, kn, vn]
    if word_rows:
        in_specs.append(pl.BlockSpec((None, block_q // word_rows, u_pad), lambda bi, hi, qi, si: (bi, qi, 0)))
        operands.append(words)
    if windowed:
        in_specs.append(pl.BlockSpec((None, block_q), lambda bi, hi, qi, si: (bi, qi)))
        operands.append(ref_lib.row_positions(positions, g, rows_pad))
        if causal:
            in_specs.append(pl.BlockSpec((None, u_pad), lambda bi, hi, qi, si: (bi, 0)))
            operands.append(jnp.pad(positions, ((0, 0), (0, u_pad - t)), mode="edge"))

    if splits == 1:
        out_specs = q_spec
        out_shape = jax.ShapeDtypeStruct(q_packed.shape, q.dtype)
        if return_lse:
            out_specs = [q_spec, pl.BlockSpec((None, None, block_q), lambda bi, hi, qi, si: (bi, hi, qi))]
            out_shape = [out_shape, jax.ShapeDtypeStruct((b, kv, rows_pad), jnp.float32)]
    else:
        parts = (b, kv, splits, rows_pad)
        out_specs = [
            pl.BlockSpec((None, None, None, block_q, h), lambda bi, hi, qi, si: (bi, hi, si, qi, 0)),
            pl.BlockSpec((None, None, None, block_q), lambda bi, hi, qi, si: (bi, hi, si, qi)),
            pl.BlockSpec((None, None, None, block_q), lambda bi, hi, qi, si: (bi, hi, si, qi)),
        ]
        out_shape = [
            jax.ShapeDtypeStruct((*parts, h), jnp.float32),
            jax.ShapeDtypeStruct(parts, jnp.float32),
            jax.ShapeDtypeStruct(parts, jnp.float32),
        ]
    kernel = functools.partial(
        _tree_attention_kernel,
        sm_scale=scale,
        logit_soft_cap=logit_soft_cap,
        sliding_window=sliding_window,
        block_kv=block_kv,
        group=g,
        word_rows=word_rows,
        splits=splits,
        with_lse=return_lse,
    )
    out = pl.pallas_call(
        kernel,
        grid=(b, kv, num_q_tiles, splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=bs.num_stages),
        interpret=interpret,
        name="tree_attention_gpu",
    )(*operands)
    lse = None
    if splits > 1:
        out, lse = merge_splits(*out, q.dtype)  # [B, K, rows_pad, H], [B, K, rows_pad]
    elif return_lse:
        out, lse = out
    if not return_lse:
        return ref_lib.unpack_queries(out, t, n)
    return ref_lib.unpack_queries(out, t, n), ref_lib.unpack_row_stats(lse, t, n)
