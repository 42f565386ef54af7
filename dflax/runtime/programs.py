"""The compiled prefill and decode loop of a target and drafter, kept per target (jit keeps one executable
per shape), on one device or a mesh."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax

from dflax.decoding.decode import Proposer, decode_loop, prefill
from dflax.decoding.shared_prefix import prefill_shared
from dflax.sharding import ShardingRules
from dflax.sharding.programs import sharded_generation
from dflax.target import Target

if TYPE_CHECKING:
    pass


_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def compiled_programs(target: Target, proposer: Proposer | None) -> tuple[Callable, Callable]:
    """Jitted prefill and decode loop of a target and drafter (jit keeps one executable per shape)."""
    per_target = _COMPILED.setdefault(target, {})
    if proposer not in per_target and target.mesh is not None:
        per_target[proposer] = sharded_generation(target.module, mesh_rules(target), proposer)
    if proposer not in per_target:
        prefill_fn = jax.jit(
            functools.partial(prefill, target.module, proposer=proposer),
            static_argnames=("max_tokens", "packed_tokens"),
            donate_argnames=("cache",),
        )
        decode_fn = jax.jit(
            functools.partial(decode_loop, target.module, proposer=proposer), donate_argnames=("state",)
        )
        per_target[proposer] = (prefill_fn, decode_fn)
    return per_target[proposer]


_COMPILED_SHARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def compiled_shared_prefill(target: Target, proposer: Proposer | None) -> Callable:
    """Jitted `prefill_shared` of a target and drafter (its decode loop is `compiled_programs`')."""
    per_target = _COMPILED_SHARED.setdefault(target, {})
    if proposer not in per_target:
        per_target[proposer] = jax.jit(
            functools.partial(prefill_shared, target.module, proposer=proposer),
            static_argnames=("max_tokens", "packed_prefix", "packed_own"),
            donate_argnames=("cache",),
        )
    return per_target[proposer]


def can_share_prefix(target: Target) -> bool:
    """Shared prefixes need a single device and global attention in every layer."""
    return target.mesh is None and target.config.sliding_window is None


def mesh_rules(target: Target) -> ShardingRules:
    """The sharding rules of a target loaded on a mesh."""
    return ShardingRules.for_model(target.config, target.mesh)
