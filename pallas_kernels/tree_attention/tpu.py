"""Prefix + tree attention as a Pallas TPU (Mosaic) kernel.

Shared-prefix attention for speculative verification (the idea of FlashForge, Hydragen, DeFT and
FlashInfer's cascade attention): all T new tokens x all G query heads of one KV head are packed into one
query tile of T * G rows, so every prefix KV tile is fetched from HBM once per KV head rather than once per
query token. The tree part (the T new tokens under the tree mask) and the prefix tiles feed one online
softmax, which is the log-sum-exp merge of the two partial attentions done in VMEM.

Grid: (batch, kv-head blocks, query-row blocks, prefix KV tiles + new-token chunks), the last axis
sequential. Per-row tile plans come in by scalar prefetch: tiles beyond cache_len (or wholly outside the
sliding window) are skipped, their compute by `pl.when` and their DMA by clamping the KV index_map to the
last needed tile (the pipeline does not re-fetch a block whose index did not change). Tiles wholly inside
the valid range run unmasked. The new tokens come in chunks of at most block_kv keys (a verification tree is
one chunk; an 8k-token prefill is 16), and each query tile visits only the chunks its mask reaches, so a
causal prefill skips the chunks above its diagonal.

Cache layout stays [B, S, K, H], viewed as [B, S, K * H]. That view is free in a row-major layout but not
in the TPU's tiled HBM layout, where (K, H) are the tiled dims: XLA copies the cache into the new layout
around each call (measured by compiling for v5e, tests/aot); a [B, K, S, H] cache would avoid it.
A block's last dim must be a multiple of 128 lanes, so when head_dim is below 128 a block holds
`kv_heads_per_block` heads side by side and each query head is zero-padded to the block's width: its dot
product with the block only sees its own head's lanes, and the wrapper keeps the matching lanes of the
output. No unaligned lane slicing happens in-kernel.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.tree_attention import reference as ref_lib

_LANES = 128
_TRANS_B = (((1,), (1,)), ((), ()))  # contract the last dims: [M, W] x [N, W] -> [M, N]


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of the TPU kernel.

    Attributes:
      block_q: packed query rows (T * G) per tile, a multiple of 8. Verification trees (T <= 64, G <= 8)
        fit one tile, so the prefix is read once per KV head; prefill splits into several tiles. The
        kernel halves it while its estimated VMEM would overflow the scoped limit (several fp32 heads per
        block, e.g. 3 x 64-dim heads in 192 lanes, need 256).
      block_kv: cache slots per prefix KV tile and new keys per tree chunk, a multiple of 128. A cache of
        at most block_kv slots is one tile.
      kv_heads_per_block: KV heads per block; None picks the fewest whose lanes fill a multiple of 128.
      vmem_limit_bytes: Mosaic scoped-VMEM limit; None keeps the compiler default.
    """

    block_q: int = 512
    block_kv: int = 512
    kv_heads_per_block: int | None = None
    vmem_limit_bytes: int | None = None

    def __post_init__(self):
        if self.block_q <= 0 or self.block_q % 8:
            raise ValueError(f"block_q={self.block_q} must be a positive multiple of 8 (TPU sublanes)")
        if self.block_kv <= 0 or self.block_kv % _LANES:
            raise ValueError(f"block_kv={self.block_kv} must be a positive multiple of 128 (TPU lanes)")


_DEFAULT_SCOPED_VMEM = 16 * 2**20  # Mosaic's default scoped-VMEM limit on v5e (the smallest we target)


def _fit_block_q(
    block_q: int, hpb: int, width: int, block_kv: int, tree_chunk: int, itemsize: int, limit: int
) -> int:
    """block_q, halved until the kernel's estimated VMEM fits `limit` (at most down to 8 rows).

    The estimate: KV tiles and new-token chunks (double-buffered), and per query row the q / output
    blocks (double-buffered), the f32 accumulator, the running max and sum, the mask chunk and the f32
    score temporaries of every head in the block. Checked against Mosaic's compile on v5e (fp32, three
    64-dim heads per block: 512 rows need 18.4 MiB, 256 fit).
    """
    keys = max(block_kv, tree_chunk)  # keys scored per step
    fixed = 4 * 2 * keys * width * itemsize
    row = hpb * (width * (4 * itemsize + 4) + 2 * _LANES * 4 + 2 * keys * 4) + 2 * tree_chunk * 4
    while block_q > 8 and fixed + block_q * row > 0.97 * limit:
        block_q //= 2
    return max(8, block_q)


def _kv_heads_per_block(num_kv_heads: int, head_dim: int, requested: int | None) -> int:
    """Fewest KV heads per block such that the block's lane width is a multiple of 128 (or all heads)."""
    if requested is not None:
        width = requested * head_dim
        if num_kv_heads % requested or not (width % _LANES == 0 or requested == num_kv_heads):
            raise ValueError(
                f"kv_heads_per_block={requested} must divide num_kv_heads={num_kv_heads} and give a lane "
                f"width (heads * head_dim = {width}) that is a multiple of 128 or covers all kv heads"
            )
        return requested
    for heads in range(1, num_kv_heads + 1):
        if num_kv_heads % heads == 0 and (heads * head_dim) % _LANES == 0:
            return heads
    return num_kv_heads


def _lane_broadcast(x: jax.Array, width: int) -> jax.Array:
    """[rows, 128] lane-replicated statistics -> [rows, width]."""
    if width == _LANES:
        return x
    if width % _LANES == 0:
        return jnp.concatenate([x] * (width // _LANES), axis=1)
    if width < _LANES:
        return x[:, :width]
    return jnp.broadcast_to(x[:, :1], (x.shape[0], width))


def _tree_attention_kernel(
    bounds_ref,  # [B * 8] int32 (SMEM): per row cache_len, start, u0, u1, end, 0, 0, 0
    chunks_ref,  # [B * QB * 2] int32 (SMEM): per (row, query tile) first and end tree chunk it sees
    q_ref,  # [hpb, block_q, width]: packed queries, head hh zero outside its own lanes
    k_ref,  # [block_kv, width]: prefix K tile (index clamped to the row's needed tiles)
    v_ref,  # [block_kv, width]: prefix V tile
    k_new_ref,  # [tree_chunk, width]: keys of one chunk of new tokens (index clamped likewise)
    v_new_ref,  # [tree_chunk, width]: values of that chunk
    mask_ref,  # [block_q, tree_chunk] int32: 1 where packed row r may see new token u of the chunk
    *refs,  # qpos_ref [block_q, 1] int32 (sliding window only); o_ref [hpb, block_q, width];
    # scratch m_ref, l_ref [hpb, block_q, 128] f32 (lane-replicated), acc_ref [hpb, block_q, width] f32
    sm_scale: float,
    logit_soft_cap: float | None,
    sliding_window: int | None,
    num_kv_tiles: int,
    num_q_tiles: int,
):
    if sliding_window is None:
        qpos_ref = None
        o_ref, m_ref, l_ref, acc_ref = refs
    else:
        qpos_ref, o_ref, m_ref, l_ref, acc_ref = refs
    hpb, block_q, width = q_ref.shape
    block_kv = k_ref.shape[0]
    b, qb, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    cache_len = bounds_ref[b * 8 + 0]
    start, u0, u1, end = (bounds_ref[b * 8 + i] for i in (1, 2, 3, 4))
    tile = (b * num_q_tiles + qb) * 2
    chunk = j - num_kv_tiles  # steps j >= num_kv_tiles are chunks of the new tokens
    precision = jax.lax.Precision.HIGHEST if q_ref.dtype == jnp.float32 else None

    def scores(q, k):  # [block_q, width] x [t, width] -> [block_q, t] f32 logits
        s = jax.lax.dot_general(q, k, _TRANS_B, precision=precision, preferred_element_type=jnp.float32)
        s = s * sm_scale
        if logit_soft_cap is not None:
            s = logit_soft_cap * jnp.tanh(s / logit_soft_cap)
        return s

    def update(hh, s, valid, v):  # one online-softmax step of head hh over t keys
        if valid is not None:
            s = jnp.where(valid, s, ref_lib.MASK_VALUE)
        m_cur = jnp.max(s, axis=1, keepdims=True)  # [block_q, 1]
        p = jnp.exp(s - m_cur)
        if valid is not None:
            p = jnp.where(valid, p, 0.0)  # rows that see nothing keep l == 0
        m_prev, l_prev = m_ref[hh], l_ref[hh]  # [block_q, 128]
        m_cur = jnp.broadcast_to(m_cur, m_prev.shape)
        m_next = jnp.maximum(m_prev, m_cur)
        alpha = jnp.exp(m_prev - m_next)
        beta = jnp.exp(m_cur - m_next)
        l_ref[hh] = alpha * l_prev + beta * jnp.broadcast_to(jnp.sum(p, axis=1, keepdims=True), l_prev.shape)
        m_ref[hh] = m_next
        pv = jnp.dot(p.astype(v.dtype), v, precision=precision, preferred_element_type=jnp.float32)
        acc_ref[hh] = _lane_broadcast(alpha, width) * acc_ref[hh] + _lane_broadcast(beta, width) * pv

    @pl.when(j == 0)
    def _init():
        m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
        l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
        acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

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
        for hh in range(hpb):
            update(hh, scores(q_ref[hh], k), valid, v)

    needed = (j >= start) & (j < end)
    unmasked = (j >= u0) & (j < u1)
    pl.when(needed & unmasked)(functools.partial(prefix_tile, False))
    pl.when(needed & jnp.logical_not(unmasked))(functools.partial(prefix_tile, True))

    @pl.when((chunk >= chunks_ref[tile]) & (chunk < chunks_ref[tile + 1]))
    def _tree_chunk():
        k, v = k_new_ref[...], v_new_ref[...]
        valid = mask_ref[...] != 0
        for hh in range(hpb):
            update(hh, scores(q_ref[hh], k), valid, v)

    @pl.when(j == pl.num_programs(3) - 1)
    def _finalize():
        for hh in range(hpb):
            denom = l_ref[hh]
            inv = jnp.where(
                denom > 0.0, 1.0 / jnp.where(denom > 0.0, denom, 1.0), 0.0
            )  # all-masked rows -> 0
            o_ref[hh] = (acc_ref[hh] * _lane_broadcast(inv, width)).astype(o_ref.dtype)


def _tree_chunk_bounds(mask: jax.Array, block_q: int, tree_chunk: int) -> jax.Array:
    """[B, R, U] int32 packed row mask -> [B * QB * 2] int32: per (row, query tile) the first tree chunk
    with a visible key and one past the last (0, 0 when it sees none). A causal prefill tile sees only
    the chunks up to its diagonal, so the chunks above it are neither fetched nor computed."""
    b, r, u = mask.shape
    seen = mask.reshape(b, r // block_q, block_q, u // tree_chunk, tree_chunk).max(axis=(2, 4)) > 0
    chunk_ids = jnp.arange(u // tree_chunk, dtype=jnp.int32)  # [C]
    first = jnp.min(jnp.where(seen, chunk_ids, u // tree_chunk), axis=-1)
    end = jnp.max(jnp.where(seen, chunk_ids + 1, 0), axis=-1)
    return jnp.stack([jnp.minimum(first, end), end], axis=-1).reshape(-1)  # [B * QB * 2]


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "sliding_window", "logit_soft_cap", "block_sizes", "interpret"),
)
def tree_attention_tpu(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    cache_len: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    tree_mask: jax.Array,
    *,
    sm_scale: float | None = None,
    sliding_window: int | None = None,
    logit_soft_cap: float | None = None,
    q_positions: jax.Array | None = None,
    block_sizes: BlockSizes | None = None,
    interpret=False,
) -> jax.Array:
    """Prefix + tree attention on TPU; same contract as `tree_attention_reference`.

    Args:
      q: [B, T, N, H] queries.
      k_cache, v_cache: [B, S, K, H] cache; slots >= cache_len are never read.
      cache_len: [B] int valid prefix length per row.
      k_new, v_new: [B, T, K, H] keys/values of the new tokens.
      tree_mask: [B, T, T] bool, query i may see new token j.
      sm_scale: logit scale; default H ** -0.5.
      sliding_window: keys with q_pos - k_pos >= sliding_window are hidden.
      logit_soft_cap: c in c * tanh(logits / c).
      q_positions: [B, T] int positions of the new tokens; default cache_len[:, None] + arange(T).
      block_sizes: tile sizes; default `BlockSizes()`.
      interpret: False (compile with Mosaic), True (TPU interpreter, pltpu.InterpretParams()) or an
        explicit `pltpu.InterpretParams`.

    Returns:
      [B, T, N, H] attention output in q's dtype.
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
    kv = k_cache.shape[2]
    g = n // kv
    hpb = _kv_heads_per_block(kv, h, bs.kv_heads_per_block)
    width = hpb * h
    itemsize = jnp.dtype(q.dtype).itemsize
    sublanes = 8 * max(1, 4 // itemsize)  # native (sublane, lane) tile: f32 8, bf16 16
    cache_len = jnp.clip(cache_len.astype(jnp.int32), 0, k_cache.shape[1])
    if k_cache.shape[1] < sublanes:
        # A one-slot KV tile makes Mosaic lower q @ k.T as a matrix-vector product, whose bf16 path fails
        # verification (vector.broadcast bf16 -> f32); tiny caches (prefill pads the empty one to a
        # single slot) are padded to a native tile instead. The padding is beyond cache_len: never read.
        pad_s = ((0, 0), (0, sublanes - k_cache.shape[1]), (0, 0), (0, 0))
        k_cache, v_cache = jnp.pad(k_cache, pad_s), jnp.pad(v_cache, pad_s)
    s = k_cache.shape[1]
    block_kv = s if s <= bs.block_kv else bs.block_kv
    num_kv_tiles = pl.cdiv(s, block_kv)
    # New tokens go in chunks of at most block_kv keys (one chunk for a verification tree).
    tree_chunk = ref_lib.round_up(t, 8) if t <= bs.block_kv else bs.block_kv
    limit = bs.vmem_limit_bytes or _DEFAULT_SCOPED_VMEM
    block_q = _fit_block_q(bs.block_q, hpb, width, block_kv, tree_chunk, itemsize, limit)
    block_q = min(block_q, ref_lib.round_up(t * g, sublanes))
    rows_pad = ref_lib.round_up(t * g, block_q)
    u_pad = ref_lib.round_up(t, tree_chunk)
    num_chunks = u_pad // tree_chunk
    num_q_tiles = rows_pad // block_q
    scale = ref_lib.default_scale(h, sm_scale)

    positions = ref_lib.query_positions(cache_len, t, q_positions)
    new_vis = ref_lib.new_token_visibility(tree_mask, positions, sliding_window)
    mask = ref_lib.row_visibility(new_vis, g, rows_pad, u_pad)  # [B, rows_pad, u_pad]
    bounds = ref_lib.prefix_tile_bounds(cache_len, positions, sliding_window, block_kv).reshape(-1)
    chunks = _tree_chunk_bounds(mask, block_q, tree_chunk)

    q_wide = _widen_queries(ref_lib.pack_queries(q, kv, rows_pad), hpb)  # [B, K/hpb, hpb, rows_pad, width]
    k2 = k_cache.reshape(b, s, kv * h)  # a block of `width` lanes is hpb heads of one slot
    v2 = v_cache.reshape(b, s, kv * h)
    pad_u = ((0, 0), (0, u_pad - t), (0, 0), (0, 0))
    kn2 = jnp.pad(k_new, pad_u).reshape(b, u_pad, kv * h)
    vn2 = jnp.pad(v_new, pad_u).reshape(b, u_pad, kv * h)

    # Index maps clamp to the needed tiles: the pipeline skips the DMA of a block whose index is unchanged.
    def kv_index(bi, hb, qb, j, bounds_ref, chunks_ref):
        first, last = bounds_ref[bi * 8 + 1], bounds_ref[bi * 8 + 4] - 1
        tile = jnp.minimum(jnp.maximum(j, first), jnp.maximum(last, first))
        return bi, jnp.minimum(tile, num_kv_tiles - 1), hb

    def chunk_of(bi, qb, j, chunks_ref):
        at = (bi * num_q_tiles + qb) * 2
        first, last = chunks_ref[at], chunks_ref[at + 1] - 1
        return jnp.minimum(jnp.maximum(j - num_kv_tiles, first), jnp.maximum(last, first))

    def new_index(bi, hb, qb, j, bounds_ref, chunks_ref):
        return bi, chunk_of(bi, qb, j, chunks_ref), hb

    def mask_index(bi, hb, qb, j, bounds_ref, chunks_ref):
        return bi, qb, chunk_of(bi, qb, j, chunks_ref)

    q_spec = pl.BlockSpec((None, None, hpb, block_q, width), lambda bi, hb, qb, j, *_: (bi, hb, 0, qb, 0))
    in_specs = [
        q_spec,
        pl.BlockSpec((None, block_kv, width), kv_index),
        pl.BlockSpec((None, block_kv, width), kv_index),
        pl.BlockSpec((None, tree_chunk, width), new_index),
        pl.BlockSpec((None, tree_chunk, width), new_index),
        pl.BlockSpec((None, block_q, tree_chunk), mask_index),
    ]
    operands = [q_wide, k2, v2, kn2, vn2, mask]
    if sliding_window is not None:
        in_specs.append(pl.BlockSpec((None, block_q, 1), lambda bi, hb, qb, j, *_: (bi, qb, 0)))
        operands.append(ref_lib.row_positions(positions, g, rows_pad)[:, :, None])

    kernel = functools.partial(
        _tree_attention_kernel,
        sm_scale=scale,
        logit_soft_cap=logit_soft_cap,
        sliding_window=sliding_window,
        num_kv_tiles=num_kv_tiles,
        num_q_tiles=num_q_tiles,
    )
    cost = pl.CostEstimate(
        flops=4 * b * n * t * (s + t) * h,
        transcendentals=b * n * t * (s + t),
        bytes_accessed=(2 * b * s * kv * h + 2 * q.size + 2 * k_new.size) * itemsize,
    )
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(b, kv // hpb, num_q_tiles, num_kv_tiles + num_chunks),
            in_specs=in_specs,
            out_specs=q_spec,
            scratch_shapes=[
                pltpu.VMEM((hpb, block_q, _LANES), jnp.float32),
                pltpu.VMEM((hpb, block_q, _LANES), jnp.float32),
                pltpu.VMEM((hpb, block_q, width), jnp.float32),
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(q_wide.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=bs.vmem_limit_bytes,
        ),
        cost_estimate=cost,
        interpret=pltpu.InterpretParams() if interpret is True else interpret,
        name="tree_attention_tpu",
    )(bounds, chunks, *operands)
    return ref_lib.unpack_queries(_narrow_outputs(out, h), t, n)


def _widen_queries(packed: jax.Array, hpb: int) -> jax.Array:
    """[B, K, R, H] -> [B, K/hpb, hpb, R, hpb*H]: query head hh of a block placed in lanes hh*H:(hh+1)*H."""
    b, kv, r, h = packed.shape
    grouped = packed.reshape(b, kv // hpb, hpb, r, h)
    if hpb == 1:
        return grouped
    eye = jnp.eye(hpb, dtype=packed.dtype)
    wide = grouped[:, :, :, :, None, :] * eye[None, None, :, None, :, None]
    return wide.reshape(b, kv // hpb, hpb, r, hpb * h)


def _narrow_outputs(wide: jax.Array, h: int) -> jax.Array:
    """Inverse of `_widen_queries` on the output: keep each head's own lanes -> [B, K, R, H]."""
    b, kb, hpb, r, width = wide.shape
    if hpb == 1:
        return wide.reshape(b, kb, r, h)
    blocks = wide.reshape(b, kb, hpb, r, hpb, h)
    own = jnp.moveaxis(jnp.diagonal(blocks, axis1=2, axis2=4), -1, 2)  # [B, KB, hpb, R, H]
    return own.reshape(b, kb * hpb, r, h)
