"""Prefix + tree attention as a Pallas GPU kernel (Triton lowering, the portable GPU path).

Shared-prefix attention for speculative verification (FlashForge, Hydragen, DeFT, FlashInfer cascade): all
T new tokens x all G query heads of one KV head are packed into one query tile of T * G rows, so each prefix
KV tile is loaded once per KV head instead of once per query token. One program per (row, kv head, query
tile) runs an online softmax first over the tree part (the T new tokens under the tree mask), then over the
prefix KV tiles; continuing one softmax across both parts is the log-sum-exp merge of the two partial
attentions, done in registers.

The loop over prefix tiles runs only over each row's needed tiles, [start, end) from a small per-row plan
array (Triton has no scalar prefetch): tiles past cache_len or wholly outside the sliding window are never
loaded. Interior tiles run unmasked; the boundary tiles use masked loads (other=0), which also keeps stale
or out-of-range cache slots, NaN included, out of the sums.

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

from pallas_kernels.tree_attention import reference as ref_lib

_MIN_DOT = 16  # Triton's minimum dot dimension


def _is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes and launch settings of the GPU kernel; None picks a default from head_dim and dtype.

    The defaults (a query tile of at most 32 KiB, KV tiles of at most 16 KiB) keep a program within shared
    memory on A100 and H100 and, for bf16, without register spills on H100; checked by compiling the
    kernel's Triton IR with Triton 3.9 for sm_80 and sm_90, not by running it. fp32 inputs use IEEE fp32
    dots, which Triton runs without tensor cores: correct but slow (a test dtype on GPU).

    Attributes:
      block_q: packed query rows (T * G) per program, a power of two >= 16; None = 32 KiB / (head_dim *
        itemsize), capped at 128. T * G <= block_q puts the whole tree of one KV head in one tile (the
        prefix is then read once per KV head); larger trees split into several tiles, each reading the
        prefix (mostly from L2).
      block_kv: cache slots per prefix tile and new keys per tree chunk, a power of two >= 16; None =
        16 KiB / (head_dim * itemsize), capped at 64.
      num_warps: warps per program; None = 4 for query tiles up to 16 KiB and score tiles up to 4096
        elements, else 8.
      num_stages: software-pipelining stages of the KV loop.
    """

    block_q: int | None = None
    block_kv: int | None = None
    num_warps: int | None = None
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_q", "block_kv"):
            value = getattr(self, name)
            if value is not None and (not _is_pow2(value) or value < _MIN_DOT):
                raise ValueError(f"{name}={value} must be a power of two >= {_MIN_DOT} (Triton tile rule)")
        if (self.num_warps is not None and self.num_warps <= 0) or self.num_stages <= 0:
            raise ValueError(f"num_warps={self.num_warps} and num_stages={self.num_stages} must be positive")

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


def _tree_attention_kernel(
    plan_ref,  # [8] int32: cache_len, start, u0, u1, end, 0, 0, 0 of this batch row
    q_ref,  # [block_q, H]: packed queries (row r = token r // G, head r % G of this kv head)
    k_ref,  # [S_pad, H]: this row's cache keys of one kv head (S rounded up to block_kv; never loaded whole)
    v_ref,  # [S_pad, H]: cache values
    k_new_ref,  # [u_pad, H]: keys of the new tokens (zero padded)
    v_new_ref,  # [u_pad, H]: values of the new tokens
    mask_ref,  # [block_q, u_pad] int32: 1 where packed row r may see new token u
    *refs,  # qpos_ref [block_q] int32 (sliding window only); o_ref [block_q, H]
    sm_scale: float,
    logit_soft_cap: float | None,
    sliding_window: int | None,
    block_kv: int,
):
    if sliding_window is None:
        qpos_ref = None
        (o_ref,) = refs
    else:
        qpos_ref, o_ref = refs
    block_q, head_dim = q_ref.shape
    u_pad = k_new_ref.shape[0]
    cache_len, start, u0, u1, end = (plan_ref[i] for i in range(5))
    q = q_ref[...]
    # fp32 inputs get IEEE fp32 dots (Triton's default for them is TF32), like the reference.
    precision = jax.lax.Precision.HIGHEST if q_ref.dtype == jnp.float32 else None

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

    def tree_step(c, carry):
        cols = pl.ds(c * tree_chunk, tree_chunk)
        valid = mask_ref[:, cols] != 0
        return update(carry, scores(k_new_ref[cols, :]), valid, v_new_ref[cols, :])

    def prefix_step(j, carry, masked: bool):
        rows = pl.ds(j * block_kv, block_kv)
        if not masked:
            return update(carry, scores(k_ref[rows, :]), None, v_ref[rows, :])
        slots = j * block_kv + jnp.arange(block_kv, dtype=jnp.int32)
        in_len = slots < cache_len
        # Masked loads: no read past cache_len (nor past S), and stale slots come in as 0, not NaN.
        k = plgpu.load(k_ref.at[rows, :], mask=in_len[:, None], other=0.0)
        v = plgpu.load(v_ref.at[rows, :], mask=in_len[:, None], other=0.0)
        valid = in_len[None, :]
        if sliding_window is not None:
            qpos = qpos_ref[...]
            valid = valid & (qpos[:, None] - slots[None, :] < sliding_window)
        return update(carry, scores(k), valid, v)

    carry = (
        jnp.zeros((block_q, head_dim), jnp.float32),
        jnp.full((block_q,), -jnp.inf, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
    )
    carry = jax.lax.fori_loop(0, u_pad // tree_chunk, tree_step, carry)
    masked = functools.partial(prefix_step, masked=True)
    carry = jax.lax.fori_loop(start, u0, masked, carry)
    carry = jax.lax.fori_loop(u0, u1, functools.partial(prefix_step, masked=False), carry)
    carry = jax.lax.fori_loop(u1, end, masked, carry)
    acc, _, denom = carry
    inv = jnp.where(denom > 0.0, 1.0 / jnp.where(denom > 0.0, denom, 1.0), 0.0)  # all-masked rows -> 0
    o_ref[...] = (acc * inv[:, None]).astype(o_ref.dtype)


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "sliding_window", "logit_soft_cap", "block_sizes", "interpret"),
)
def tree_attention_gpu(
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
    interpret: bool = False,
) -> jax.Array:
    """Prefix + tree attention on GPU (Triton); same contract as `tree_attention_reference`.

    Args:
      q: [B, T, N, H] queries; H a power of two.
      k_cache, v_cache: [B, S, K, H] cache; slots >= cache_len are never read.
      cache_len: [B] int valid prefix length per row.
      k_new, v_new: [B, T, K, H] keys/values of the new tokens.
      tree_mask: [B, T, T] bool, query i may see new token j.
      sm_scale: logit scale; default H ** -0.5.
      sliding_window: keys with q_pos - k_pos >= sliding_window are hidden.
      logit_soft_cap: c in c * tanh(logits / c).
      q_positions: [B, T] int positions of the new tokens; default cache_len[:, None] + arange(T).
      block_sizes: tile sizes; default `BlockSizes()`.
      interpret: run the kernel in Pallas interpret mode (CPU).

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
        raise ValueError(f"block_sizes for the gpu backend must be gpu.BlockSizes, got {type(bs).__name__}")
    b, t, n, h = q.shape
    s, kv = k_cache.shape[1], k_cache.shape[2]
    g = n // kv
    if not _is_pow2(h) or h < _MIN_DOT:
        raise ValueError(f"the gpu backend needs head_dim to be a power of two >= 16, got {h}")
    block_q, block_kv, num_warps = bs.resolve(t * g, s, h, jnp.dtype(q.dtype).itemsize)
    rows_pad = ref_lib.round_up(t * g, block_q)
    # The cache block spans whole tiles: the last tile may run past S, where the masked loads (slot <
    # cache_len <= S) read nothing; interpret mode pads the block the same way.
    s_pad = ref_lib.round_up(s, block_kv)
    u_pad = max(_MIN_DOT, _next_pow2(t))
    scale = ref_lib.default_scale(h, sm_scale)

    cache_len = jnp.clip(cache_len.astype(jnp.int32), 0, s)
    positions = ref_lib.query_positions(cache_len, t, q_positions)
    new_vis = ref_lib.new_token_visibility(tree_mask, positions, sliding_window)
    mask = ref_lib.row_visibility(new_vis, g, rows_pad, u_pad)  # [B, rows_pad, u_pad]
    plan = ref_lib.prefix_tile_bounds(cache_len, positions, sliding_window, block_kv)  # [B, 8]
    q_packed = ref_lib.pack_queries(q, kv, rows_pad)  # [B, K, rows_pad, H]
    pad_u = ((0, 0), (0, u_pad - t), (0, 0), (0, 0))
    kn, vn = jnp.pad(k_new, pad_u), jnp.pad(v_new, pad_u)

    q_spec = pl.BlockSpec((None, None, block_q, h), lambda bi, hi, qi: (bi, hi, qi, 0))
    cache_spec = pl.BlockSpec((None, s_pad, None, h), lambda bi, hi, qi: (bi, 0, hi, 0))
    new_spec = pl.BlockSpec((None, u_pad, None, h), lambda bi, hi, qi: (bi, 0, hi, 0))
    in_specs = [
        pl.BlockSpec((None, 8), lambda bi, hi, qi: (bi, 0)),
        q_spec,
        cache_spec,
        cache_spec,
        new_spec,
        new_spec,
        pl.BlockSpec((None, block_q, u_pad), lambda bi, hi, qi: (bi, qi, 0)),
    ]
    operands = [plan, q_packed, k_cache, v_cache, kn, vn, mask]
    if sliding_window is not None:
        in_specs.append(pl.BlockSpec((None, block_q), lambda bi, hi, qi: (bi, qi)))
        operands.append(ref_lib.row_positions(positions, g, rows_pad))

    kernel = functools.partial(
        _tree_attention_kernel,
        sm_scale=scale,
        logit_soft_cap=logit_soft_cap,
        sliding_window=sliding_window,
        block_kv=block_kv,
    )
    out = pl.pallas_call(
        kernel,
        grid=(b, kv, rows_pad // block_q),
        in_specs=in_specs,
        out_specs=q_spec,
        out_shape=jax.ShapeDtypeStruct(q_packed.shape, q.dtype),
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=bs.num_stages),
        interpret=interpret,
        name="tree_attention_gpu",
    )(*operands)
    return ref_lib.unpack_queries(out, t, n)
