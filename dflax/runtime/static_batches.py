"""Static batches: prompts bucketed to one shape, prefilled together (with shared prefixes stored once per
group) and decoded until the batch's longest row ends."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from dflax.decoding.sampling import SamplingParams
from dflax.decoding.shared_prefix import PrefixGroup, share_groups
from dflax.models.cache import KVCache
from dflax.runtime.programs import can_share_prefix, compiled_programs, compiled_shared_prefill, mesh_rules
from dflax.runtime.results import GenerationResult, result_of_row
from dflax.runtime.shapes import cache_slots, next_pow2, packed_bucket, prompt_bucket
from dflax.sharding.multihost import to_host
from dflax.sharding.placement import padded_batch, place_replicated, place_rows, sharded_cache
from dflax.target import Target
from pallas_kernels.shared_prefix import GroupLayout

if TYPE_CHECKING:
    from dflax.drafters import DartDrafterBound, Drafter, LookupDrafter


SHARED_PREFIX_MODES = ("auto", "none")


def generate_ids(
    target: Target,
    prompt_ids: Sequence[list[int]],
    *,
    max_new_tokens: int,
    sampling: SamplingParams,
    row_seeds: Sequence[int],
    batch_size: int,
    drafter: Drafter | DartDrafterBound | LookupDrafter | None = None,
    warmup: bool = False,
    shared_prefix: str = "none",
) -> list[GenerationResult]:
    """Generates for one batch of already-encoded prompts (at most batch_size of them).

    Args:
      target: the loaded target.
      prompt_ids: token ids of each prompt, each fitting the context with max_new_tokens.
      max_new_tokens: budget per prompt.
      sampling: target sampling settings.
      row_seeds: one PRNG seed per prompt (the prompt's output depends only on its seed).
      batch_size: static batch size of the compiled step (rows beyond the prompts are padding).
      drafter: a speculative drafter, DFlash or prompt lookup (None = plain autoregressive decoding).
      warmup: only compile this batch's shapes (every row stops after its first token).
      shared_prefix: "auto" prefills and stores a common token prefix of consecutive prompts once per
        group of rows (`dflax.decoding.shared_prefix`; where no two prompts share enough, or the target
        cannot, nothing changes); "none" gives every row its whole prompt.

    Returns:
      One result per prompt, in order; stats add shared_prefix_tokens (the row's prompt tokens read from
      a shared prefix) and kv_cache_bytes (the batch's allocated target KV cache, shared prefixes included).
    """
    n = len(prompt_ids)
    bucket_b = min(batch_size, next_pow2(n))
    if target.mesh is not None:  # rows split evenly over the mesh's `data` axis
        bucket_b = padded_batch(bucket_b, mesh_rules(target))
    if shared_prefix not in SHARED_PREFIX_MODES:
        raise ValueError(f"shared_prefix must be one of {SHARED_PREFIX_MODES}, got {shared_prefix!r}")
    groups = share_groups(prompt_ids) if shared_prefix == "auto" and can_share_prefix(target) else []
    offsets = np.zeros((bucket_b,), np.int32)  # each row's shared prefix length
    for group in groups:
        offsets[group.rows] = group.length
    own_ids = [ids[offsets[r] :] for r, ids in enumerate(prompt_ids)]
    bucket_p = prompt_bucket(max(len(ids) for ids in own_ids))
    proposer = drafter.proposer if drafter else None
    drafter_params = drafter.params if drafter else None
    slots = cache_slots(bucket_p, max_new_tokens, proposer)

    tokens = np.zeros((bucket_b, bucket_p), np.int32)
    lens = np.ones((bucket_b,), np.int32)
    budgets = np.zeros((bucket_b,), np.int32)
    seeds = np.zeros((bucket_b,), np.uint32)
    for r, ids in enumerate(own_ids):
        tokens[r, : len(ids)] = ids
        lens[r], budgets[r], seeds[r] = len(ids), 1 if warmup else max_new_tokens, row_seeds[r]
    packed = packed_bucket(int(lens.sum()), bucket_b, bucket_p)
    row_keys = jax.vmap(jax.random.key)(jnp.asarray(seeds))
    eos = jnp.asarray(target.eos_ids, jnp.int32)
    inputs = (jnp.asarray(tokens), jnp.asarray(lens), jnp.asarray(budgets), row_keys)
    if target.mesh is None:
        cache = KVCache.init(target.config, bucket_b, slots, target.cache_dtype)
    else:  # rows split over `data`; packed prompts would mix rows of different devices
        rules, packed = mesh_rules(target), None
        cache = sharded_cache(target.config, bucket_b, slots, target.cache_dtype, rules)
        inputs, (eos, sampling) = place_rows(rules, *inputs), place_replicated(rules, (eos, sampling))
    prompt_tokens, prompt_lens, budgets_in, row_keys = inputs

    prefill_fn, decode_fn = compiled_programs(target, proposer)
    t0 = time.perf_counter()
    if groups:
        shared_inputs = _shared_prefix_inputs(prompt_ids, groups, bucket_b, offsets)
        state = compiled_shared_prefill(target, proposer)(
            target.params,
            *shared_inputs,
            prompt_tokens,
            prompt_lens,
            cache,
            budgets_in,
            row_keys,
            eos,
            sampling,
            drafter_params,
            max_tokens=max_new_tokens,
            packed_prefix=packed_bucket(sum(group.length for group in groups), *shared_inputs[0].shape),
            packed_own=packed,
        )
    else:
        state = prefill_fn(
            target.params,
            prompt_tokens,
            prompt_lens,
            cache,
            budgets_in,
            row_keys,
            eos,
            sampling,
            drafter_params,
            max_tokens=max_new_tokens,
            packed_tokens=packed,
        )
    jax.block_until_ready(state)
    t1 = time.perf_counter()
    state = decode_fn(target.params, state, sampling, drafter_params)
    jax.block_until_ready(state)
    t2 = time.perf_counter()

    # On a mesh spanning several processes each holds some rows' shards; every process gets all rows.
    rows = (state.tokens, state.num_generated, state.steps, state.accept_hist)
    out_tokens, num, steps, hist = map(to_host, rows)
    kv_bytes = sum(x.nbytes for x in jax.tree.leaves((state.cache.k, state.cache.v)))
    if state.cache.shared is not None:
        kv_bytes += sum(x.nbytes for x in jax.tree.leaves((state.cache.shared.k, state.cache.shared.v)))
    results = []
    for r in range(n):
        result = result_of_row(
            target,
            out_tokens[r, : num[r]].tolist(),
            len(prompt_ids[r]),
            int(steps[r]),
            hist[r],
            t1 - t0,
            t2 - t1,
            n,
        )
        result.stats.update(shared_prefix_tokens=int(offsets[r]), kv_cache_bytes=kv_bytes)
        results.append(result)
    return results


def _shared_prefix_inputs(
    prompt_ids: Sequence[list[int]], groups: list[PrefixGroup], batch: int, offsets: np.ndarray
) -> tuple:
    """The static-shape prefix arrays of `prefill_shared`: (prefix tokens [G, L], prefix lengths [G],
    layout, row offsets [B]), G, L and the rows per group rounded up to powers of two (few compiles)."""
    num_groups = next_pow2(len(groups))
    length = prompt_bucket(max(1, max(group.length for group in groups)))
    prefix_tokens = np.zeros((num_groups, length), np.int32)
    prefix_lens = np.zeros((num_groups,), np.int32)
    for g, group in enumerate(groups):
        prefix_tokens[g, : group.length] = prompt_ids[group.rows[0]][: group.length]
        prefix_lens[g] = group.length
    rows = min(batch, next_pow2(max(len(group.rows) for group in groups)))
    layout = GroupLayout.of_groups([group.rows for group in groups], batch, num_groups, rows)
    return jnp.asarray(prefix_tokens), jnp.asarray(prefix_lens), layout, jnp.asarray(offsets)
