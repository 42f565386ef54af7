"""Attention under a mesh: every device attends its own rows and heads, inside `shard_map`.

Attention is independent per batch row and per KV head, so it needs no communication: each device runs the
configured backend (the CPU path or a Pallas kernel, which XLA cannot partition by itself) on its block of
rows and of heads. Where KV heads are replicated over `model` (see `HeadLayout`), each device slices the KV
heads its query heads read.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.sharding import PartitionSpec

from dflax.sharding.mesh import DATA, MESH_AXES, MODEL
from dflax.sharding.rules import HeadLayout


def active_mesh() -> jax.sharding.AbstractMesh | None:
    """The (data, model) mesh of the computation being traced (`jax.set_mesh`), or None."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or tuple(mesh.axis_names) != MESH_AXES:
        return None
    return mesh


def shard_attention(attention: Callable, num_heads: int, num_kv_heads: int) -> Callable:
    """Wraps attention(q, k_cache, v_cache, cache_len, k_new, v_new, new_mask, q_positions) -> out so that
    it runs per device on the active mesh (the call itself when no mesh is active).

    Shapes: q [B, T, N, H], caches [B, K, S, H], cache_len [B], k_new / v_new [B, T, K, H],
    new_mask [B, T, T] or None (causal by index), q_positions [B, T] -> out [B, T, N, H].
    """
    mesh = active_mesh()
    if mesh is None:
        return attention
    layout = HeadLayout.of(num_heads, num_kv_heads, mesh.shape[MODEL])
    heads = PartitionSpec(DATA, None, MODEL if layout.heads_split else None, None)
    kv_heads = MODEL if layout.kv_split else None
    cache = PartitionSpec(DATA, kv_heads, None, None)  # [B, K, S, H]
    kv = PartitionSpec(DATA, None, kv_heads, None)  # [B, T, K, H]
    rows = PartitionSpec(DATA)
    slice_kv = layout.heads_split and not layout.kv_split

    def per_device(q, k_cache, v_cache, cache_len, k_new, v_new, new_mask, q_positions):
        if slice_kv:  # replicated KV heads: keep the ones this device's query heads read
            start = layout.kv_start(jax.lax.axis_index(MODEL), num_heads, num_kv_heads)
            k_cache, v_cache = (
                jax.lax.dynamic_slice_in_dim(x, start, layout.kv_local, axis=1) for x in (k_cache, v_cache)
            )
            k_new, v_new = (
                jax.lax.dynamic_slice_in_dim(x, start, layout.kv_local, axis=2) for x in (k_new, v_new)
            )
        return attention(q, k_cache, v_cache, cache_len, k_new, v_new, new_mask, q_positions)

    # The Pallas kernels' outputs declare no varying mesh axes, hence check_vma=False.
    sharded = jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(heads, cache, cache, rows, kv, kv, rows, rows),
        out_specs=heads,
        check_vma=False,
    )
    causal = jax.shard_map(  # no mask to split: causal by index
        lambda q, k_cache, v_cache, cache_len, k_new, v_new, q_positions: per_device(
            q, k_cache, v_cache, cache_len, k_new, v_new, None, q_positions
        ),
        mesh=mesh,
        in_specs=(heads, cache, cache, rows, kv, kv, rows),
        out_specs=heads,
        check_vma=False,
    )

    def run(q, k_cache, v_cache, cache_len, k_new, v_new, new_mask, q_positions):
        if new_mask is None:
            return causal(q, k_cache, v_cache, cache_len, k_new, v_new, q_positions)
        return sharded(q, k_cache, v_cache, cache_len, k_new, v_new, new_mask, q_positions)

    return run
