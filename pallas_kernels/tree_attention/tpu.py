"""Prefix + tree attention as a Pallas TPU (Mosaic) kernel.

Shared-prefix attention for speculative verification (the idea of FlashForge, Hydragen, DeFT and
FlashInfer's cascade attention): all T new tokens x all G query heads of one KV head are packed into one
query tile of T * G rows, so every prefix KV tile is fetched from HBM once per KV head rather than once per
query token. The tree part (the T new tokens under their mask) and the prefix tiles feed one online
softmax, which is the log-sum-exp merge of the two partial attentions done in VMEM.

Grid: (batch, kv heads, query-row tiles, prefix KV tiles + new-token chunks), the last axis sequential.
Per-row tile plans come in by scalar prefetch: prefix tiles beyond cache_len (or wholly outside the
sliding window) are skipped, their compute by `pl.when` and their DMA by clamping the KV index_map to the
last needed tile (the pipeline does not re-fetch a block whose index did not change). Tiles wholly inside
the valid range run unmasked. The new tokens come in chunks of at most block_kv keys (a verification tree is
one chunk; a 4k-token prefill is 8); each query tile visits only the chunks its mask reaches, so a causal
prefill skips the chunks above its diagonal, and scores the chunks below it without a mask.

The new-token mask is never a dense array (see masks.py): causal by index (`tree_mask=None`) it is an iota
comparison; any other mask arrives as bit words, one bit per (packed row, key), expanded in the kernel.

Layout: the cache is stored head-major, [B, K, S, H], and a block is one KV head's [block_kv, H] tile (for
head_dim 64 a 64-lane block is the array's whole last dim, so no head is padded to a wider block and no work
is multiplied). The kernel reads the cache where it lies: no transposing copy around the call (tests/aot
checks the compiled verify's bytes accessed).

VMEM: the wrapper estimates the kernel's VMEM need from its blocks, halves the query tile while it exceeds
the budget, and passes the estimate (with headroom) as Mosaic's `vmem_limit_bytes`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.tree_attention import masks
from pallas_kernels.tree_attention import reference as ref_lib

_LANES = 128
_TRANS_B = (((1,), (1,)), ((), ()))  # contract the last dims: [M, W] x [N, W] -> [M, N]
_MIB = 2**20
# The budget the query tile is fitted to: half of v5e / v6e's 128 MiB VMEM, above v5e's 16 MiB default
# scoped limit (which a 4k-token prefill with dense masks exceeded).
DEFAULT_VMEM_BUDGET = 64 * _MIB


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of the TPU kernel.

    Attributes:
      block_q: packed query rows (T * G) per tile, a multiple of 8 (rounded down to the dtype's sublane
        packing: 16 rows for bf16). Verification trees (T * G <= 512) fit one tile, so the prefix is read
        once per KV head; prefill splits into several tiles. Halved while the VMEM estimate exceeds the
        budget.
      block_kv: cache slots per prefix KV tile and new keys per chunk, a multiple of 128. A cache of at
        most block_kv slots is one tile.
      vmem_limit_bytes: the VMEM budget; None = `DEFAULT_VMEM_BUDGET`. Mosaic's limit is set to the
        kernel's estimated need plus headroom, never above this.
    """

    block_q: int = 512
    block_kv: int = 512
    vmem_limit_bytes: int | None = None

    def __post_init__(self):
        if self.block_q <= 0 or self.block_q % 8:
            raise ValueError(f"block_q={self.block_q} must be a positive multiple of 8 (TPU sublanes)")
        if self.block_kv <= 0 or self.block_kv % _LANES:
            raise ValueError(f"block_kv={self.block_kv} must be a positive multiple of 128 (TPU lanes)")
        if self.vmem_limit_bytes is not None and self.vmem_limit_bytes < 4 * _MIB:
            raise ValueError(f"vmem_limit_bytes={self.vmem_limit_bytes} is below 4 MiB; no tile fits")


def vmem_bytes(block_q, block_kv, chunk, head_dim, itemsize, *, has_prefix, word_rows, windowed) -> int:
    """Estimated VMEM of one kernel instance: double-buffered blocks, scratch and f32 temporaries.

    Blocks pad to (8, 128) tiles: a [rows, 64] block takes 128 lanes, a [rows, 1] one takes 128.
    Temporaries: the scores, probabilities and mask of one step ([block_q, keys] f32 each).
    """
    lanes = max(head_dim, _LANES)
    keys = max(block_kv if has_prefix else 0, chunk)
    blocks = 2 * block_q * lanes * itemsize  # q and out
    blocks += 2 * chunk * lanes * itemsize  # k_new, v_new
    if has_prefix:
        blocks += 2 * block_kv * lanes * itemsize  # k, v
    if word_rows:
        blocks += ref_lib.round_up(block_q // word_rows, 8) * ref_lib.round_up(chunk, _LANES) * 4
    if windowed:
        blocks += block_q * _LANES * 4 + 8 * ref_lib.round_up(chunk, _LANES) * 4
    scratch = block_q * (2 * _LANES + lanes) * 4  # m, l (lane-replicated) and the accumulator
    temporaries = 3 * block_q * ref_lib.round_up(keys, _LANES) * 4
    return 2 * blocks + scratch + temporaries


@dataclasses.dataclass(frozen=True)
class TilePlan:
    """The tiles one call runs with (see `plan_tiles`)."""

    block_q: int  # packed query rows per tile
    block_kv: int  # cache slots per prefix tile (the whole cache when shorter; 1 for an empty one)
    chunk: int  # new keys per chunk
    word_rows: int  # packed rows per mask bit word; 0 for the causal-by-index form
    vmem_bytes: int  # the estimated VMEM need
    vmem_limit_bytes: int  # Mosaic's scoped-VMEM limit passed to the compiler


def plan_tiles(t, group, slots, head_dim, dtype, bs: BlockSizes, *, causal, windowed) -> TilePlan:
    """Tile sizes for T new tokens x G query heads per KV head over `slots` cache slots.

    Query tiles and new-key chunks are rounded to the dtype's sublane packing (8 rows for fp32, 16 for
    bf16); the query tile is halved while the VMEM estimate exceeds the budget, and Mosaic's limit is the
    estimate plus half again and 4 MiB (at least 16 MiB, at most the budget).
    """
    itemsize = jnp.dtype(dtype).itemsize
    sublanes = 8 * max(1, 4 // itemsize)  # native (sublane, lane) tile: f32 8, bf16 16
    block_kv = max(1, slots if slots <= bs.block_kv else bs.block_kv)
    chunk = ref_lib.round_up(t, sublanes) if t <= bs.block_kv else bs.block_kv
    budget = bs.vmem_limit_bytes or DEFAULT_VMEM_BUDGET

    def word_rows(block_q):
        return 0 if causal else masks.word_rows(block_q, ref_lib.round_up(t * group, block_q))

    def need(block_q):
        return vmem_bytes(block_q, block_kv, chunk, head_dim, itemsize, has_prefix=bool(slots),
                          word_rows=word_rows(block_q), windowed=windowed)  # fmt: skip

    block_q = max(sublanes, bs.block_q // sublanes * sublanes)
    block_q = min(block_q, ref_lib.round_up(t * group, sublanes))
    while block_q > sublanes and need(block_q) > budget:
        block_q = max(sublanes, block_q // 2 // sublanes * sublanes)
    limit = min(budget, max(16 * _MIB, int(1.5 * need(block_q)) + 4 * _MIB))
    return TilePlan(block_q, block_kv, chunk, word_rows(block_q), need(block_q), limit)


def _tree_attention_kernel(
    bounds_ref,  # [B * 8] int32 (SMEM): per row cache_len, start, u0, u1, end, 0, 0, 0
    plan_ref,  # [B * QT * 4] int32 (SMEM): per (row, query tile) first, end, full_lo, full_hi chunk
    *refs,
    sm_scale: float,
    logit_soft_cap: float | None,
    sliding_window: int | None,
    num_kv_tiles: int,
    num_q_tiles: int,
    group: int,
    word_rows: int,
    with_lse: bool,
):
    # Inputs, in order: q [block_q, H]; with a prefix k, v [block_kv, H]; k_new, v_new [chunk, H]; with a
    # dense mask its words [block_q / word_rows, chunk]; with a window qpos [block_q, 1] and, for the causal
    # form, kpos [1, chunk]. Then o [block_q, H], with_lse the log-sum-exp [block_q, 128] (lane-replicated),
    # and scratch m, l [block_q, 128], acc [block_q, H] f32.
    refs = list(refs)
    q_ref = refs.pop(0)
    k_ref, v_ref = (refs.pop(0), refs.pop(0)) if num_kv_tiles else (None, None)
    k_new_ref, v_new_ref = refs.pop(0), refs.pop(0)
    words_ref = refs.pop(0) if word_rows else None
    qpos_ref = refs.pop(0) if sliding_window is not None else None
    kpos_ref = refs.pop(0) if sliding_window is not None and not word_rows else None
    o_ref, lse_ref = refs.pop(0), refs.pop(0) if with_lse else None
    m_ref, l_ref, acc_ref = refs
    block_q, head_dim = q_ref.shape
    chunk_keys = k_new_ref.shape[0]
    b, qb, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    precision = jax.lax.Precision.HIGHEST if q_ref.dtype == jnp.float32 else None

    def scores(k):  # [block_q, H] x [t, H] -> [block_q, t] f32 logits
        s = jax.lax.dot_general(
            q_ref[...], k, _TRANS_B, precision=precision, preferred_element_type=jnp.float32
        )
        s = s * sm_scale
        if logit_soft_cap is not None:
            s = logit_soft_cap * jnp.tanh(s / logit_soft_cap)
        return s

    def lanes(x):  # [block_q, 128] lane-replicated statistics -> [block_q, H]
        if head_dim == _LANES:
            return x
        if head_dim < _LANES:
            return x[:, :head_dim]
        return jnp.concatenate([x] * (head_dim // _LANES), axis=1)

    def update(s, valid, v):  # one online-softmax step over t keys
        if valid is not None:
            s = jnp.where(valid, s, ref_lib.MASK_VALUE)
        m_cur = jnp.max(s, axis=1, keepdims=True)  # [block_q, 1]
        p = jnp.exp(s - m_cur)
        if valid is not None:
            p = jnp.where(valid, p, 0.0)  # rows that see nothing keep l == 0
        m_prev, l_prev = m_ref[...], l_ref[...]  # [block_q, 128]
        m_cur = jnp.broadcast_to(m_cur, m_prev.shape)
        m_next = jnp.maximum(m_prev, m_cur)
        alpha = jnp.exp(m_prev - m_next)
        beta = jnp.exp(m_cur - m_next)
        l_ref[...] = alpha * l_prev + beta * jnp.broadcast_to(jnp.sum(p, axis=1, keepdims=True), l_prev.shape)
        m_ref[...] = m_next
        pv = jnp.dot(p.astype(v.dtype), v, precision=precision, preferred_element_type=jnp.float32)
        acc_ref[...] = lanes(alpha) * acc_ref[...] + lanes(beta) * pv

    @pl.when(j == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    if num_kv_tiles:
        cache_len, start, u0, u1, end = (bounds_ref[b * 8 + i] for i in range(5))
        block_kv = k_ref.shape[0]

        def prefix_tile(masked: bool):
            k, v = k_ref[...], v_ref[...]
            valid = None
            if masked:
                # Stale slots may hold NaN: zero V there, since 0 * NaN would survive p == 0.
                slot_rows = j * block_kv + jax.lax.broadcasted_iota(jnp.int32, v.shape, 0)
                v = jnp.where(slot_rows < cache_len, v.astype(jnp.float32), 0.0).astype(v.dtype)
                slots = j * block_kv + jax.lax.broadcasted_iota(jnp.int32, (block_q, block_kv), 1)
                valid = slots < cache_len
                if sliding_window is not None:
                    valid = valid & (qpos_ref[...] - slots < sliding_window)
            update(scores(k), valid, v)

        needed = (j >= start) & (j < end)
        unmasked = (j >= u0) & (j < u1)
        pl.when(needed & unmasked)(functools.partial(prefix_tile, False))
        pl.when(needed & jnp.logical_not(unmasked))(functools.partial(prefix_tile, True))

    chunk = j - num_kv_tiles  # steps j >= num_kv_tiles are chunks of the new tokens
    at = (b * num_q_tiles + qb) * masks.PLAN_FIELDS
    first, end_chunk, full_lo, full_hi = (plan_ref[at + i] for i in range(masks.PLAN_FIELDS))
    visited = (chunk >= first) & (chunk < end_chunk)
    whole = (chunk >= full_lo) & (chunk < full_hi)

    def new_chunk(masked: bool):
        valid = None
        if masked:
            shape = (block_q, chunk_keys)
            if word_rows:
                valid = masks.expand_words(words_ref[...], word_rows)
            else:  # causal by index: key u seen by packed row r iff u * G <= r
                rows = qb * block_q + jax.lax.broadcasted_iota(jnp.int32, shape, 0)
                keys = chunk * chunk_keys + jax.lax.broadcasted_iota(jnp.int32, shape, 1)
                valid = keys * group <= rows
                if sliding_window is not None:
                    valid = valid & (qpos_ref[...] - kpos_ref[...] < sliding_window)
        update(scores(k_new_ref[...]), valid, v_new_ref[...])

    pl.when(visited & whole)(functools.partial(new_chunk, False))
    pl.when(visited & jnp.logical_not(whole))(functools.partial(new_chunk, True))

    @pl.when(j == pl.num_programs(3) - 1)
    def _finalize():
        denom = l_ref[...]
        inv = jnp.where(denom > 0.0, 1.0 / jnp.where(denom > 0.0, denom, 1.0), 0.0)  # all-masked rows -> 0
        o_ref[...] = (acc_ref[...] * lanes(inv)).astype(o_ref.dtype)
        if with_lse:
            lse_ref[...] = ref_lib.log_sum_exp(m_ref[...], denom)


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
def tree_attention_tpu(
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
    interpret=False,
    return_lse: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Prefix + tree attention on TPU; same contract as `tree_attention_reference`.

    Args:
      q: [B, T, N, H] queries.
      k_cache, v_cache: [B, K, S, H] cache (S may be 0); slots >= cache_len are never read.
      cache_len: [B] int valid prefix length per row.
      k_new, v_new: [B, T, K, H] keys/values of the new tokens.
      tree_mask: [B, T, T] bool, query i may see new token j; None = causal by index (j <= i).
      sm_scale: logit scale; default H ** -0.5.
      sliding_window: keys with q_pos - k_pos >= sliding_window are hidden.
      logit_soft_cap: c in c * tanh(logits / c).
      q_positions: [B, T] int positions of the new tokens; default cache_len[:, None] + arange(T).
      block_sizes: tile sizes; default `BlockSizes()`.
      interpret: False (compile with Mosaic), True (TPU interpreter, pltpu.InterpretParams()) or an
        explicit `pltpu.InterpretParams`.
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
        raise ValueError(f"block_sizes for the tpu backend must be tpu.BlockSizes, got {type(bs).__name__}")
    b, t, n, h = q.shape
    kv = k_cache.shape[1]
    g = n // kv
    itemsize = jnp.dtype(q.dtype).itemsize
    sublanes = 8 * max(1, 4 // itemsize)  # native (sublane, lane) tile: f32 8, bf16 16
    cache_len = jnp.clip(cache_len.astype(jnp.int32), 0, k_cache.shape[2])
    positions = ref_lib.query_positions(cache_len, t, q_positions)
    if 0 < k_cache.shape[2] < sublanes:
        # A one-slot KV tile makes Mosaic lower q @ k.T as a matrix-vector product, whose bf16 path fails
        # verification (vector.broadcast bf16 -> f32); tiny caches are padded to a native tile instead.
        # The padding is beyond cache_len: never read.
        pad_s = ((0, 0), (0, 0), (0, sublanes - k_cache.shape[2]), (0, 0))
        k_cache, v_cache = jnp.pad(k_cache, pad_s), jnp.pad(v_cache, pad_s)
    s = k_cache.shape[2]
    causal = tree_mask is None
    windowed = sliding_window is not None
    tiles = plan_tiles(t, g, s, h, q.dtype, bs, causal=causal, windowed=windowed)
    block_q, block_kv, chunk, word_rows = tiles.block_q, tiles.block_kv, tiles.chunk, tiles.word_rows
    num_kv_tiles = pl.cdiv(s, block_kv) if s else 0
    u_pad = ref_lib.round_up(t, chunk)
    rows_pad = ref_lib.round_up(t * g, block_q)
    num_q_tiles = rows_pad // block_q
    num_chunks = u_pad // chunk
    scale = ref_lib.default_scale(h, sm_scale)

    if causal:
        plan = masks.causal_plan(b, t, g, rows_pad, block_q, chunk, whole_ok=not windowed)
    else:
        new_vis = ref_lib.new_token_visibility(tree_mask, positions, sliding_window)  # [B, T, T]
        words = masks.mask_words(new_vis, g, rows_pad, u_pad, word_rows)  # [B, rows_pad / word_rows, u_pad]
        real = masks.real_row_words(t, g, rows_pad, word_rows)
        plan = masks.words_plan(words, real, block_q, word_rows, chunk)
    bounds = ref_lib.prefix_tile_bounds(cache_len, positions, sliding_window, block_kv).reshape(-1)

    def chunk_of(bi, qb, j, plan_ref):  # the chunk a step fetches: clamped to the tile's visited ones
        at = (bi * num_q_tiles + qb) * masks.PLAN_FIELDS
        first, last = plan_ref[at], plan_ref[at + 1] - 1
        return jnp.minimum(jnp.maximum(j - num_kv_tiles, first), jnp.maximum(last, first))

    def kv_index(bi, hi, qb, j, bounds_ref, plan_ref):
        first, last = bounds_ref[bi * 8 + 1], bounds_ref[bi * 8 + 4] - 1
        tile = jnp.minimum(jnp.maximum(j, first), jnp.maximum(last, first))
        return bi, hi, jnp.minimum(tile, num_kv_tiles - 1), 0

    def new_index(bi, hi, qb, j, bounds_ref, plan_ref):
        return bi, hi, chunk_of(bi, qb, j, plan_ref), 0

    def words_index(bi, hi, qb, j, bounds_ref, plan_ref):
        return bi, qb, chunk_of(bi, qb, j, plan_ref)

    def kpos_index(bi, hi, qb, j, bounds_ref, plan_ref):
        return bi, 0, chunk_of(bi, qb, j, plan_ref)

    q_packed = ref_lib.pack_queries(q, kv, rows_pad)  # [B, K, rows_pad, H]
    q_spec = pl.BlockSpec((None, None, block_q, h), lambda bi, hi, qb, j, *_: (bi, hi, qb, 0))
    in_specs, operands = [q_spec], [q_packed]
    if num_kv_tiles:
        kv_spec = pl.BlockSpec((None, None, block_kv, h), kv_index)
        in_specs += [kv_spec, kv_spec]
        operands += [k_cache, v_cache]  # [B, K, S, H]
    pad_u = ((0, 0), (0, u_pad - t), (0, 0), (0, 0))
    new_spec = pl.BlockSpec((None, None, chunk, h), new_index)
    in_specs += [new_spec, new_spec]
    operands += [jnp.swapaxes(jnp.pad(x, pad_u), 1, 2) for x in (k_new, v_new)]  # [B, K, u_pad, H]
    if word_rows:
        in_specs.append(pl.BlockSpec((None, block_q // word_rows, chunk), words_index))
        operands.append(words)
    if windowed:
        in_specs.append(pl.BlockSpec((None, block_q, 1), lambda bi, hi, qb, j, *_: (bi, qb, 0)))
        operands.append(ref_lib.row_positions(positions, g, rows_pad)[:, :, None])
        if causal:
            in_specs.append(pl.BlockSpec((None, 1, chunk), kpos_index))
            operands.append(jnp.pad(positions, ((0, 0), (0, u_pad - t)), mode="edge")[:, None, :])

    kernel = functools.partial(
        _tree_attention_kernel,
        sm_scale=scale,
        logit_soft_cap=logit_soft_cap,
        sliding_window=sliding_window,
        num_kv_tiles=num_kv_tiles,
        num_q_tiles=num_q_tiles,
        group=g,
        word_rows=word_rows,
        with_lse=return_lse,
    )
    new_pairs = t * (t + 1) // 2 if causal else t * t  # (query, new key) pairs scored, at most
    cost = pl.CostEstimate(
        flops=4 * b * n * (t * s + new_pairs) * h,
        transcendentals=b * n * (t * s + new_pairs),
        bytes_accessed=(2 * b * s * kv * h + 2 * q.size + 2 * k_new.size) * itemsize,
    )
    out_specs, out_shape = q_spec, jax.ShapeDtypeStruct(q_packed.shape, q.dtype)
    if return_lse:
        lse_spec = pl.BlockSpec((None, None, block_q, _LANES), lambda bi, hi, qb, j, *_: (bi, hi, qb, 0))
        out_specs, out_shape = (
            [q_spec, lse_spec],
            [out_shape, jax.ShapeDtypeStruct((b, kv, rows_pad, _LANES), jnp.float32)],
        )
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(b, kv, num_q_tiles, num_kv_tiles + num_chunks),
            in_specs=in_specs,
            out_specs=out_specs,
            scratch_shapes=[
                pltpu.VMEM((block_q, _LANES), jnp.float32),
                pltpu.VMEM((block_q, _LANES), jnp.float32),
                pltpu.VMEM((block_q, h), jnp.float32),
            ],
        ),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=tiles.vmem_limit_bytes,
        ),
        cost_estimate=cost,
        interpret=pltpu.InterpretParams() if interpret is True else interpret,
        name="tree_attention_tpu",
    )(bounds, plan, *operands)
    if not return_lse:
        return ref_lib.unpack_queries(out, t, n)
    out, lse = out
    return ref_lib.unpack_queries(out, t, n), ref_lib.unpack_row_stats(lse[..., 0], t, n)
