"""The jitted prefill and decode loop of `dflax.decoding` run under a mesh with their state kept sharded.

The programs are the single-device ones. Inputs arrive as NamedSharding arrays placed by
dflax.sharding.placement, jit's propagation (GSPMD) partitions the computation, attention runs per device
inside shard_map (dflax.sharding.attention), and one sharding constraint on the decode state keeps the
loop's carry split by row (and KV head) rather than wherever propagation would leave it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax

from dflax.decoding.decode import decode_loop, prefill
from dflax.sharding.rules import ShardingRules


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
