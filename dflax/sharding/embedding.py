"""Embedding lookups in a table whose rows (the vocabulary) are split over `model`.

Left to jit's propagation, a gather from a row-split table can gather the whole table onto every device
first (the CUDA compile of Qwen3-8B did: 1.2 GB of temporaries per device). Here each device looks the ids
up in its own rows, zeroes the ids it does not hold, and one psum over `model` adds the rows together,
the vocabulary-parallel embedding of Megatron-LM. Exactly one device contributes each row and the others
add zeros, so the result is bit-identical to a plain lookup.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from dflax.sharding.attention import active_mesh
from dflax.sharding.mesh import MODEL
from pallas_kernels import bits_slicing


def take_rows(table: jax.Array, ids: jax.Array) -> jax.Array:
    """table[ids]: [V, D] and int ids [...] -> [..., D], without gathering a vocabulary-split table.

    With no mesh active, or a vocabulary that `model` does not divide (the table is then whole on every
    device, see dflax.sharding.rules), this is `jnp.take(table, ids, axis=0)`. A 16-bit table is looked up
    in its bits, so that XLA's CPU backend does not widen the whole table (`pallas_kernels.bits_slicing`).
    """
    mesh = active_mesh()
    if mesh is None or mesh.shape[MODEL] == 1 or table.shape[0] % mesh.shape[MODEL]:
        return bits_slicing.take(table, ids, axis=0)

    def per_device(rows, ids):
        held = rows.shape[0]
        local = ids - jax.lax.axis_index(MODEL) * held
        inside = (local >= 0) & (local < held)
        found = bits_slicing.take(rows, jnp.clip(local, 0, held - 1), axis=0)  # [..., D]
        return jax.lax.psum(jnp.where(inside[..., None], found, jnp.zeros_like(found)), MODEL)

    return jax.shard_map(
        per_device,
        mesh=mesh,
        in_specs=(PartitionSpec(MODEL, None), PartitionSpec()),
        out_specs=PartitionSpec(),
        check_vma=False,
    )(table, ids)
