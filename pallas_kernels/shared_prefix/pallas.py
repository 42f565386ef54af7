"""Level 1 of the two-level attention as a Pallas kernel (TPU and GPU): each group's shared prefix, split
over its length into KV tiles, FlashDecoding-style.

Grid: (groups, KV heads, prefix tiles), every program independent. A program holds all X = R * T * Q queries
of its (group, KV head) in one block and one [block_kv, H] tile of the group's prefix K and V, and writes the
tile's partial softmax state (running max, denominator, numerator); `combine_tiles` merges the tiles by
log-sum-exp. So each prefix KV tile is fetched from HBM exactly once per group and KV head, whatever the
number of rows and new tokens, and a long prefix spreads over G * K * tiles programs, which fills a chip
even for one group. Tiles wholly past a group's prefix length compute nothing (their state is empty).

The max and denominator are written broadcast over 128 lanes (the TPU's lane width; a power of two for
Triton), as the JAX Pallas flash-attention kernels store them.

Level 2 (each row's own cache and new tokens) continues from the combined state in jnp
(`shared_prefix_attention(..., prefix_kernel=...)`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.tree_attention.reference import MASK_VALUE

_LANES = 128
_TRANS_B = (((1,), (1,)), ((), ()))  # [M, W] x [N, W] -> [M, N]


def _tile_kernel(len_ref, q_ref, k_ref, v_ref, m_ref, l_ref, acc_ref, *, block_kv: int):
    """One (group, KV head, tile): the partial softmax state of the group's queries over the tile."""
    tile = pl.program_id(2)
    length = len_ref[0, 0]
    m_ref[...] = jnp.full(m_ref.shape, MASK_VALUE, jnp.float32)
    l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
    acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

    @pl.when(tile * block_kv < length)
    def _():
        q = q_ref[...].astype(jnp.float32)  # [X, H], scaled
        k = k_ref[...].astype(jnp.float32)  # [C, H]
        scores = jax.lax.dot_general(q, k, _TRANS_B, preferred_element_type=jnp.float32)  # [X, C]
        slots = tile * block_kv + jax.lax.broadcasted_iota(jnp.int32, scores.shape, 1)
        visible = slots < length
        scores = jnp.where(visible, scores, MASK_VALUE)
        m = jnp.max(scores, axis=1, keepdims=True)  # [X, 1]
        p = jnp.where(visible, jnp.exp(scores - m), 0.0)
        rows = jax.lax.broadcasted_iota(jnp.int32, k.shape, 0) + tile * block_kv
        v = jnp.where(rows < length, v_ref[...].astype(jnp.float32), 0.0)  # [C, H]; unread slots -> 0
        m_ref[...] = jnp.broadcast_to(m, m_ref.shape)
        l_ref[...] = jnp.broadcast_to(jnp.sum(p, axis=1, keepdims=True), l_ref.shape)
        acc_ref[...] = jnp.dot(p, v, preferred_element_type=jnp.float32)


@functools.partial(jax.jit, static_argnames=("block_kv", "platform", "interpret", "index_probe"))
def prefix_tiles(
    queries: jax.Array,
    prefix_k: jax.Array,
    prefix_v: jax.Array,
    prefix_len: jax.Array,
    *,
    block_kv: int = 512,
    platform: str = "tpu",
    interpret: bool = False,
    index_probe=None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-tile partial attention of each group's queries over its prefix.

    Args:
      queries: [G, K, X, H] the queries of each (group, KV head), scaled; X a multiple of 8.
      prefix_k, prefix_v: [G, K, L, H] the prefixes, L a multiple of block_kv.
      prefix_len: [G] int32 valid prefix length per group.
      block_kv: prefix slots per tile (a multiple of 8; a power of two for GPU).
      platform: "tpu" (Mosaic) or "gpu" (Triton: 4 warps, 2 stages).
      interpret: run in Pallas interpret mode (CPU).
      index_probe: test hook: called as index_probe(g, k, tile) from the prefix K index map, by
        `jax.debug.callback`, to count the tiles fetched (interpret mode).

    Returns:
      (max [G, K, n, X], denominator [G, K, n, X], numerator [G, K, n, X, H]) fp32, n = L // block_kv.
    """
    if platform not in ("tpu", "gpu"):
        raise ValueError(f"platform must be 'tpu' or 'gpu', got {platform!r}")
    g, kv, x, h = queries.shape
    slots = prefix_k.shape[2]
    if slots % block_kv or x % 8:
        raise ValueError(
            f"prefix slots ({slots}) must be a multiple of block_kv ({block_kv}) and queries ({x}) of 8"
        )
    tiles = slots // block_kv
    lengths = jnp.broadcast_to(prefix_len.astype(jnp.int32)[:, None, None], (g, 8, _LANES))

    def kv_index(gi, ki, ti):
        if index_probe is not None:
            jax.debug.callback(index_probe, gi, ki, ti)
        return gi, ki, ti, 0

    state_spec = pl.BlockSpec((None, None, None, x, _LANES), lambda gi, ki, ti: (gi, ki, ti, 0, 0))
    m, denom, acc = pl.pallas_call(
        functools.partial(_tile_kernel, block_kv=block_kv),
        grid=(g, kv, tiles),
        in_specs=[
            pl.BlockSpec((None, 8, _LANES), lambda gi, ki, ti: (gi, 0, 0)),
            pl.BlockSpec((None, None, x, h), lambda gi, ki, ti: (gi, ki, 0, 0)),
            pl.BlockSpec((None, None, block_kv, h), kv_index),
            pl.BlockSpec((None, None, block_kv, h), lambda gi, ki, ti: (gi, ki, ti, 0)),
        ],
        out_specs=[
            state_spec,
            state_spec,
            pl.BlockSpec((None, None, None, x, h), lambda gi, ki, ti: (gi, ki, ti, 0, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((g, kv, tiles, x, _LANES), jnp.float32),
            jax.ShapeDtypeStruct((g, kv, tiles, x, _LANES), jnp.float32),
            jax.ShapeDtypeStruct((g, kv, tiles, x, h), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2) if platform == "gpu" else None,
        interpret=interpret,
        name="shared_prefix_tiles",
    )(lengths, queries, prefix_k, prefix_v)
    return m[..., 0], denom[..., 0], acc


def combine_tiles(m: jax.Array, denom: jax.Array, acc: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Merges per-tile states [G, K, n, X(, H)] over the tile axis by log-sum-exp: [G, K, X(, H)] (any two
    leading axes: the shared-prefix attention also merges [B, T, 2, K, Q(, H)] prefix and own states)."""
    m_all = m.max(axis=2)  # [G, K, X]
    weight = jnp.exp(m - m_all[:, :, None])  # [G, K, n, X]
    return m_all, (denom * weight).sum(axis=2), (acc * weight[..., None]).sum(axis=2)
