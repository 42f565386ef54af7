"""Continuous batching: rows that finish are refilled from the queue, so a batch stays full.

A static batch runs until its longest row ends, so with ragged outputs most rows idle. Here the batch
decodes in chunks of at most `refill_every` steps (one jitted `lax.while_loop` each). After a chunk the
finished rows are handed out and refilled: the waiting prompts are prefilled into a small fresh state (a
power of two rows, at least `MIN_REFILL_ROWS`), whose rows are written over the finished rows of the
running state in place (every per-row buffer, the KV cache and the drafter's state included), so a
refill costs what its own rows cost, not a whole batch's cache.

A row's output depends only on its prompt and seed: every per-row computation of the decode loop reads
only that row (its cache up to its own length, its own key folded with its own token count), whatever
the other rows hold or when the row joined. The shapes are fixed for the whole run (batch, cache slots);
prefill compiles once per refill size, prompt bucket and power-of-two pack size, and the decode chunk once.
"""

from __future__ import annotations

import collections
import functools
import time
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from dflax.decoding.decode import DecodeState, Proposer, decode_step
from dflax.decoding.sampling import SamplingParams
from dflax.host_memory import configure_malloc, release_free_memory
from dflax.models.cache import KVCache
from dflax.models.transformer import Transformer
from dflax.runtime.programs import compiled_programs
from dflax.runtime.results import GenerationResult, result_of_row
from dflax.runtime.shapes import cache_slots, next_pow2, prompt_bucket
from dflax.target import Target

if TYPE_CHECKING:
    from dflax.drafters import Drafter


def decode_chunk(
    model: Transformer,
    params: dict,
    state: DecodeState,
    sampling: SamplingParams,
    drafter_params,
    max_steps: jax.Array,
    proposer: Proposer | None = None,
) -> tuple[DecodeState, jax.Array]:
    """At most `max_steps` decode steps: fewer when every row is done first.

    Args:
      model, params, state, sampling, drafter_params, proposer: as for `decode_loop`.
      max_steps: [] int32, traced (changing it does not recompile).

    Returns:
      The state after the chunk and the number of steps it ran ([] int32).
    """

    def cond(carry):
        s, i = carry
        return jnp.any(~s.done) & (i < max_steps)

    def body(carry):
        s, i = carry
        return decode_step(model, params, s, sampling, drafter_params, proposer), i + 1

    return jax.lax.while_loop(cond, body, (state, jnp.zeros((), jnp.int32)))


# Refills prefill a power of two rows, at least this many (fewer sizes, fewer prefill compiles).
MIN_REFILL_ROWS = 4


def refill_rows(joining: int, rows: int) -> int:
    """Rows of the fresh state a refill of `joining` prompts prefills: the next power of two, at least
    MIN_REFILL_ROWS, at most the batch."""
    return min(rows, max(MIN_REFILL_ROWS, next_pow2(joining)))


def write_rows(running: DecodeState, fresh: DecodeState, rows: jax.Array) -> DecodeState:
    """The running state with row rows[j] replaced by the fresh state's row j, for each j; a row index
    past the running batch drops that fresh row (a padding row).

    Every leaf but `eos_ids` has the batch first: the KV caches [B, K, S, H], the other drafter-state
    buffers [B, S, ...], the per-row counters, tokens and keys. With the running state donated the rows
    are written in place: the cost follows the fresh state's rows, not the running batch.
    """

    def put(new, old):
        if old.shape[1:] != new.shape[1:] or new.shape[:1] != rows.shape:
            raise ValueError(
                f"continuous batching needs every decode-state buffer batch-first; a buffer of shape "
                f"{old.shape} cannot take rows of shape {new.shape}: give the proposer's state a leading "
                "batch axis"
            )
        if jax.dtypes.issubdtype(old.dtype, jax.dtypes.prng_key):
            data = jax.random.key_data(old).at[rows].set(jax.random.key_data(new), mode="drop")
            return jax.random.wrap_key_data(data, impl=jax.random.key_impl(old))
        return old.at[rows].set(new, mode="drop")

    merged = jax.tree.map(put, fresh.replace(eos_ids=None), running.replace(eos_ids=None))
    return merged.replace(eos_ids=running.eos_ids)


def refill_pack_size(tokens: int, rows: int, length: int) -> int | None:
    """The static pack size of a refill's prefill: the next power of two (at least 16), or None when
    packing would not save work. Refills prefill a varying few rows at a time, so their token counts
    spread widely; one size per octave keeps the number of prefill compiles small."""
    size = max(16, next_pow2(tokens))
    return size if size < rows * length else None


_PROGRAMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _programs(target: Target, proposer: Proposer | None) -> tuple[Callable, Callable]:
    """The jitted decode chunk and row write of a target and drafter (the running state donated)."""
    per_target = _PROGRAMS.setdefault(target, {})
    if proposer not in per_target:
        chunk = jax.jit(
            functools.partial(decode_chunk, target.module, proposer=proposer), donate_argnames=("state",)
        )
        write = jax.jit(write_rows, donate_argnames=("running",))
        per_target[proposer] = (chunk, write)
    return per_target[proposer]


def generate_continuous(
    target: Target,
    prompt_ids: Sequence[list[int]],
    *,
    max_new_tokens: int,
    sampling: SamplingParams,
    row_seeds: Sequence[int],
    batch_size: int,
    refill_every: int,
    drafter: Drafter | None = None,
    on_result: Callable[[int, GenerationResult], None] | None = None,
    timing: dict | None = None,
) -> list[GenerationResult]:
    """Generates for already-encoded prompts with continuous batching (see the module docstring).

    Args:
      target: the loaded target.
      prompt_ids: token ids of each prompt, each fitting the context with max_new_tokens.
      max_new_tokens: budget per prompt.
      sampling: target sampling settings.
      row_seeds: one PRNG seed per prompt.
      batch_size: rows decoded together (static).
      refill_every: decode steps between refills (> 0).
      drafter: a speculative drafter (None = plain decoding).
      on_result: called with (prompt index, result) as each prompt finishes, in finishing order.
      timing: if given, filled with the run's totals: "prefill_s" (all refills' prefills and merges),
        "decode_s" (all decode chunks), "loop_steps" (decode-loop iterations) and "refills".

    Returns:
      One result per prompt, in prompt order. Each result's `prefill_s` is its refill's prefill time and
      `decode_s` the wall time from then to its end (other rows' refills included).
    """
    configure_malloc()  # a chunk reuses its temporaries; refills give the heap's free pages back
    n = len(prompt_ids)
    rows = min(batch_size, next_pow2(n))  # as static batches: a power of two
    proposer = drafter.proposer if drafter else None
    drafter_params = drafter.params if drafter else None
    slots = cache_slots(prompt_bucket(max(len(ids) for ids in prompt_ids)), max_new_tokens, proposer)
    prefill_fn, _ = compiled_programs(target, proposer)
    chunk_fn, write_fn = _programs(target, proposer)
    eos = jnp.asarray(target.eos_ids, jnp.int32)
    steps_per_chunk = jnp.asarray(refill_every, jnp.int32)

    def prefill_rows(prompts: list[int], size: int) -> DecodeState:
        """A fresh state of `size` rows whose first rows hold `prompts` (prompt indices), prefilled; the
        other rows are one-token stand-ins with no budget (done at once, never written)."""
        bucket_p = prompt_bucket(max(len(prompt_ids[i]) for i in prompts))
        tokens = np.zeros((size, bucket_p), np.int32)
        lens = np.ones((size,), np.int32)
        budgets = np.zeros((size,), np.int32)
        seeds = np.zeros((size,), np.uint32)
        for r, i in enumerate(prompts):
            tokens[r, : len(prompt_ids[i])] = prompt_ids[i]
            lens[r], budgets[r], seeds[r] = len(prompt_ids[i]), max_new_tokens, row_seeds[i]
        return prefill_fn(
            target.params,
            jnp.asarray(tokens),
            jnp.asarray(lens),
            KVCache.init(target.config, size, slots, target.cache_dtype),
            jnp.asarray(budgets),
            jax.vmap(jax.random.key)(jnp.asarray(seeds)),
            eos,
            sampling,
            drafter_params,
            max_tokens=max_new_tokens,
            packed_tokens=refill_pack_size(int(lens.sum()), size, bucket_p),
        )

    queue = collections.deque(range(n))
    owner: list[int | None] = [None] * rows  # the prompt each row decodes
    started: dict[int, tuple[float, float]] = {}  # prompt -> (prefill_s, decode start)
    results: list[GenerationResult | None] = [None] * n
    state = None
    totals = {"prefill_s": 0.0, "decode_s": 0.0, "loop_steps": 0, "refills": 0}
    while queue or any(o is not None for o in owner):
        free = [r for r in range(rows) if owner[r] is None]
        if free and queue:
            joining = {r: queue.popleft() for r in free[: len(queue)]}
            t0 = time.perf_counter()
            if state is None:  # the first fill: the whole batch
                state = prefill_rows(list(joining.values()), rows)
            else:
                size = refill_rows(len(joining), rows)
                fresh = prefill_rows(list(joining.values()), size)
                targets = np.full((size,), rows, np.int32)  # padding rows point past the batch: dropped
                targets[: len(joining)] = list(joining)
                state = write_fn(state, fresh, jnp.asarray(targets))
            jax.block_until_ready(state)
            release_free_memory()  # refills run many program shapes: their freed temporaries go back
            t1 = time.perf_counter()
            totals["prefill_s"] += t1 - t0
            totals["refills"] += 1
            for r, i in joining.items():
                owner[r] = i
                started[i] = (t1 - t0, t1)
        t0 = time.perf_counter()
        state, ran = chunk_fn(target.params, state, sampling, drafter_params, steps_per_chunk)
        done, num, steps, hist, ran = jax.device_get(
            (state.done, state.num_generated, state.steps, state.accept_hist, ran)
        )
        totals["decode_s"] += time.perf_counter() - t0
        totals["loop_steps"] += int(ran)
        finished = [r for r in range(rows) if owner[r] is not None and done[r]]
        if not finished:
            continue
        tokens = np.asarray(state.tokens)
        now = time.perf_counter()
        for r in finished:
            i, owner[r] = owner[r], None
            prefill_s, start = started.pop(i)
            results[i] = result_of_row(
                target,
                tokens[r, : num[r]].tolist(),
                len(prompt_ids[i]),
                int(steps[r]),
                hist[r],
                prefill_s,
                now - start,
                rows,
            )
            if on_result is not None:
                on_result(i, results[i])
    if timing is not None:
        timing.update(totals)
    return results
