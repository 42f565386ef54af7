"""Putting a generation on a mesh: parameters, KV caches and batch rows placed by the rules (the programs
that run on them: dflax.sharding.programs)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from dflax.models.cache import KVCache
from dflax.models.config import ModelConfig
from dflax.sharding.mesh import mesh_shape
from dflax.sharding.rules import ShardingRules


def put(tree: Any, shardings: Any) -> Any:
    """`jax.device_put(tree, shardings)`, also for shardings over other processes' devices (a multi-host
    mesh): those arrays go from host memory, which holds the same values in every process, each process
    sending only its own devices' shards. PRNG key arrays travel as their key data."""

    def put_leaf(x, sharding: NamedSharding):
        if sharding.is_fully_addressable:
            return jax.device_put(x, sharding)
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            data = jax.device_put(np.asarray(jax.random.key_data(x)), sharding)  # [..., key words]
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
        return jax.device_put(np.asarray(x), sharding)

    return jax.tree.map(put_leaf, tree, shardings)


def shard_params(params: dict, rules: ShardingRules) -> dict:
    """Places a {"params": ...} tree on the mesh by the rules (large matrices split over `model`)."""
    return put(params, rules.param_shardings(params))


def sharded_cache(
    config: ModelConfig, batch: int, slots: int, dtype: jnp.dtype, rules: ShardingRules
) -> KVCache:
    """An empty KV cache created directly in its shards (never whole on one device)."""
    shape = jax.eval_shape(lambda: KVCache.init(config, batch, slots, dtype))
    shardings = rules.state_shardings(shape)
    return jax.jit(lambda: KVCache.init(config, batch, slots, dtype), out_shardings=shardings)()


def padded_batch(rows: int, rules: ShardingRules) -> int:
    """Rows rounded up to a multiple of the `data` axis (the extra rows are padding)."""
    data = mesh_shape(rules.mesh).data
    return -(-rows // data) * data


def place_rows(rules: ShardingRules, *arrays: Any) -> tuple:
    """Batch arrays ([B, ...]) split by row."""
    return tuple(put(a, rules.rows()) for a in arrays)


def place_replicated(rules: ShardingRules, tree: Any) -> Any:
    """A pytree whole on every device (EOS ids, sampling settings)."""
    return put(tree, jax.tree.map(lambda _: rules.replicated(), tree))
