"""Putting a generation on a mesh: parameters, KV caches and batch rows placed by the rules, and the jitted
prefill and decode loop of `dflax.decoding` run under the mesh with their state kept sharded.

The programs are the single-device ones. Inputs arrive as NamedSharding arrays, jit's propagation (GSPMD)
partitions the computation, attention runs per device inside shard_map (dflax.sharding.attention), and
one sharding constraint on the decode state keeps the loop's carry split by row (and KV head) rather than
wherever propagation would leave it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from dflax.decoding.decode import decode_loop, prefill
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


def _constrained(rules: ShardingRules, fn: Callable) -> Callable:
    """fn(...) -> state, with the state constrained to its row / KV-head sharding."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        state = fn(*args, **kwargs)
        return jax.lax.with_sharding_constraint(state, rules.state_shardings(state))

    return wrapped


class MeshJit:
    """A jitted function that is called, traced and lowered with its mesh active (attention finds the mesh
    there, see dflax.sharding.attention)."""

    def __init__(self, mesh: jax.sharding.Mesh, jitted: Callable):
        self.mesh, self.jitted = mesh, jitted

    def __call__(self, *args, **kwargs):
        """Runs the jitted function on the mesh."""
        with jax.set_mesh(self.mesh):
            return self.jitted(*args, **kwargs)

    def lower(self, *args, **kwargs) -> jax.stages.Lowered:
        """Lowers it for these arguments (`.compile().input_shardings` shows where each input lives)."""
        with jax.set_mesh(self.mesh):
            return self.jitted.lower(*args, **kwargs)


def sharded_prefill(model, rules: ShardingRules, proposer=None, **fixed) -> MeshJit:
    """`dflax.decoding.prefill` jitted for arguments placed on `rules.mesh` (the cache donated); `fixed`
    binds keyword arguments (max_tokens, packed_tokens), the others stay static."""
    return MeshJit(
        rules.mesh,
        jax.jit(
            _constrained(rules, functools.partial(prefill, model, proposer=proposer, **fixed)),
            static_argnames=tuple({"max_tokens", "packed_tokens"} - set(fixed)),
            donate_argnames=("cache",),
        ),
    )


def sharded_state_step(step: Callable, model, rules: ShardingRules, proposer=None) -> MeshJit:
    """step(model, params, state, sampling, drafter_params, proposer) -> state (`decode_step` or
    `decode_loop`) jitted on `rules.mesh`, its state donated and kept split by row in and out."""

    def run(params, state, sampling, drafter_params=None):
        state = jax.lax.with_sharding_constraint(state, rules.state_shardings(state))
        return step(model, params, state, sampling, drafter_params, proposer)

    return MeshJit(rules.mesh, jax.jit(_constrained(rules, run), donate_argnames=("state",)))


def sharded_generation(model, rules: ShardingRules, proposer=None) -> tuple[MeshJit, MeshJit]:
    """The jitted prefill and decode loop of `dflax.generation`, for arguments placed on `rules.mesh`.

    Same signatures as the single-device pair: prefill_fn(params, tokens, lens, cache, budgets, row_keys,
    eos, sampling, drafter_params, *, max_tokens, packed_tokens) and decode_fn(params, state, sampling,
    drafter_params); the cache and state are donated.
    """
    return sharded_prefill(model, rules, proposer), sharded_state_step(decode_loop, model, rules, proposer)
