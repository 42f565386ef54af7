"""What a decode step costs on this machine.

`measure_cost_curve` is bench's `--cost-curve` report: target forwards over n new tokens and drafter
forwards. `auto_block_size` times whole decode steps (draft, verify, acceptance, commit and the drafter's
update) of plain decoding and of every candidate block size and tree at the run's batch size, context and
cache slots, in interleaved rounds, caches them on disk per machine, and hands them to the cost model of
`dflax.planning.block_size`, so `--block-size auto` picks the block size (or plain decoding) that is
predicted fastest for this target, drafter and machine. The drafter's acceptance comes from its held-out
answers; a run first decodes `probe_size` prompts with that choice, then `scaled_to_probe` scales the
acceptance to what those prompts accepted and the rest is decoded with the choice made again
(`dflax.planning.probe`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dflax.decoding.decode import DecodeState, Proposer, decode_step
from dflax.decoding.sampling import SamplingParams
from dflax.models.cache import KVCache
from dflax.models.transformer import Transformer
from dflax.paths import cache_dir
from dflax.planning.block_size import (
    BlockSizeChoice,
    choose_block_size,
)
from dflax.planning.roofline import machine_facts, median_time
from dflax.planning.tree_budget import tree_commit_moments
from dflax.target import Target

COST_CURVE_SIZES = (1, 2, 4, 8, 16, 32)
AUTO_BLOCK_SIZES = (2, 3, 4, 6, 8, 12, 16)
AUTO_TREE_BUDGETS = (4, 6, 8, 12, 16, 32, 64)  # on a 2-core CPU the best trees have 6-8 nodes
_SLOT_MARGIN = 64
# The steps auto times (`auto_block_size`): first plain decoding and two chains (one row: B = 4 and 8, where
# a step's cost hardly grows until the block outgrows the weight pass; more rows: B = 2 and 4, where
# speculation still has a chance); then B = 8 and 16 when a chain longer than any timed one, priced along
# the timed chains' last segment, is predicted best, and one tree of 8 nodes when a tree, priced as the
# chain verifying as many tokens, is. Every other candidate's step is interpolated between timed ones,
# linearly in the tokens it verifies. Each timed step compiles a program of its own (2 s to trace and
# lower, 3.5 s to compile for SmolLM2 on the 2-core CPU): timing all 15 candidates took 200 s at batch 1
# before a run could start.
FIRST_TIMED_BLOCK_SIZES = {True: (4, 8), False: (2, 4)}  # by whether the run decodes one row
LATER_TIMED_BLOCK_SIZES = (8, 16)
TIMED_TREE_BUDGETS = (8,)
# A run of fewer plain steps than this (its prompts per row times its new tokens) is not timed: timing
# costs 20-30 s, what 700-1,000 plain steps of SmolLM2 take at one row on the 2-core CPU, and a short run
# cannot win that back. It reads cached timings, or else decides from the prior below.
AUTO_MIN_STEPS = 1024
# A decode step's seconds over a plain step's, per block size, at one row: SmolLM2 fp32 with its shipped
# drafter on the 2-core Xeon (plain 29.4 ms; B=2 35.2, 4 36.8, 8 45.0, 16 60.1 ms). At 8 and 32 rows the
# same timings predict 1.13x at best and nothing that pays: the prior decodes plainly there.
PRIOR_CHAIN_COSTS = {2: 1.20, 4: 1.25, 8: 1.53, 16: 2.04}
# Decode steps per timed call; a step is priced as a proposer's fastest call over the rounds divided by this
# count. A shared 2-core host slows calls by 10-20% for seconds at a time: the difference of two calls'
# medians (16 less 8 steps, up to version 5) put a bf16 SmolLM2 8-node tree's step at 1.85-2.29 plain
# steps in four repeats (the real loop: 1.85) and a 6-token chain's at 1.73-2.03, which once ranked that
# chain above the tree that then ran 13% faster. The fastest call put them at 1.84-1.85 and 1.63-1.72.
_STEPS_PER_CALL = 6  # at one row; fewer for more rows (`_steps_per_call`), whose steps take longer
AUTO_REPS = 3
# Draft tokens every timing state holds, whatever its proposers draft: one state shape for every stage of
# auto's timing, so a program compiled in one stage (plain decoding's) serves the next.
_STATE_DRAFTS = max(AUTO_TREE_BUDGETS)
# Part of the cost cache's key: raised when what a decode step runs, or how it is timed, changes without a
# kernel's source changing (2: a 16-bit target's steps attend through the CPU kernel over their float32
# cache; 3: a step is the difference of calls of 8 and 4 steps, without a call's loop-invariant work; 4:
# greedy picks and DFlash's and DART's greedy drafts by `first_argmax`; 5: RMSNorm's pairwise row sum and
# RoPE's separate angles, which make a verify block's rows compute as decode steps do; 6: the fastest call
# of 24 steps, in place of the difference of two calls' medians; 7: the fastest of 4 calls of 8 steps, in
# stages of a few candidates).
_STEP_PROGRAM_VERSION = 7


def _cache_at(target: Target, rows: int, slots: int, context: int) -> KVCache:
    cache = KVCache.init(target.config, rows, slots, target.cache_dtype)
    return cache.replace(lengths=jnp.full((rows,), context, jnp.int32))


def _at_length(tree: Any, context: int) -> Any:
    """`tree` with every KV cache in it holding `context` tokens."""
    return jax.tree.map(
        lambda x: x.replace(lengths=jnp.full_like(x.lengths, context)) if isinstance(x, KVCache) else x,
        tree,
        is_leaf=lambda x: isinstance(x, KVCache),
    )


def verify_times(
    target: Target, sizes: Sequence[int], rows: int, context: int, slots: int, reps: int
) -> dict[int, float]:
    """Median seconds of one target forward (logits included) over n new tokens per row after `context`
    cached ones, for each n in `sizes`, written into a donated cache as the decode loop does."""
    module = target.module

    @functools.partial(jax.jit, donate_argnums=(1,))
    def verify(params, cache, tokens):  # [rows, n] tokens; the donated cache is written in place
        n = tokens.shape[1]
        positions = cache.lengths[:, None] + jnp.arange(n, dtype=jnp.int32)
        hidden, cache, _ = module.apply(params, tokens, positions, cache, None)  # None: causal
        return module.apply(params, hidden, method=Transformer.logits), cache

    def one(n: int) -> float:
        tokens, cache = jnp.full((rows, n), 5, jnp.int32), _cache_at(target, rows, slots, context)
        times = []
        for _ in range(reps + 1):  # the first call compiles
            t0 = time.perf_counter()
            logits, cache = verify(target.params, cache, tokens)  # lengths stay: the same context
            jax.block_until_ready(logits)
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])

    return {n: one(n) for n in sizes}


def draft_time(target: Target, drafter, rows: int, context: int, slots: int, reps: int) -> float:
    """Median seconds of one drafter proposal (its block size and tree budget) for `rows` rows after
    `context` tokens (a DFlash or DART drafter)."""
    proposer = drafter.proposer
    dstate = _at_length(proposer.init_state(rows, slots, target.cache_dtype), context)
    state = DecodeState(
        cache=_cache_at(target, rows, slots, context),
        last_token=jnp.full((rows,), 5, jnp.int32),
        tokens=None,
        num_generated=None,
        max_new=None,
        done=None,
        row_keys=None,
        eos_ids=jnp.full((1,), -1, jnp.int32),  # no token ends a row (DART's beam reads them)
        steps=None,
        accept_hist=None,
        drafter_state=dstate,
    )
    keys = jax.vmap(jax.random.key)(jnp.zeros((rows,), jnp.uint32))
    draft = jax.jit(lambda p, tp, s, k: proposer.propose(p, tp, s, k)[0])
    return median_time(draft, drafter.params, target.params, state, keys, reps=reps)


def _steps_per_call(rows: int) -> int:
    """Decode steps per timed call: `_STEPS_PER_CALL` at one row, fewer (at least 2) for more rows."""
    return max(2, _STEPS_PER_CALL // rows)


@functools.lru_cache(maxsize=32)
def _step_loop(module: Transformer, proposer: Proposer | None, rows: int, context: int) -> Callable:
    """The jitted call of `_steps_per_call(rows)` decode steps that each start from `context` tokens, kept per
    (target module, proposer, rows, context): auto's later stages reuse what its first one compiled."""

    def several_steps(params, dparams, state, sampling):
        def body(_, s):  # every step starts from `context` tokens, as the first one does
            s = _at_length(s, context).replace(num_generated=jnp.ones((rows,), jnp.int32))
            return decode_step(module, params, s, sampling, dparams, proposer)

        return jax.lax.fori_loop(0, _steps_per_call(rows), body, state)

    # Inside one program, as in the decode loop: no dispatch per step, the cache updated in place.
    return jax.jit(several_steps, donate_argnums=(2,))


def step_times(
    target: Target,
    drafter_params: Any,
    proposers: dict[Any, Proposer | None],
    rows: int,
    context: int,
    slots: int,
    reps: int,
    sampling: SamplingParams | None = None,
) -> dict[Any, float]:
    """Seconds of one whole decode step (`dflax.decoding.decode.decode_step` under the target's
    `sampling`, None = greedy) per proposer (None: plain decoding), for `rows` rows after `context` tokens
    in caches of `slots` slots.

    At a temperature above 0 a step draws from the target's distribution (plain decoding one draw per
    row, block verification a residual draw) and may filter it (top-k, top-p), which greedy steps skip: a
    few ms a step on a CPU.

    The proposers share one drafter's parameters and state layout (chains and trees of one DFlash or DART
    drafter). The steps are timed in `reps` rounds that each run every proposer once, so a load that comes
    and goes on the machine slows them alike. A proposer's time is its fastest call of `_steps_per_call`
    steps, divided by that count: a load that slows some calls then moves no price. The call's
    loop-invariant work (XLA hoists it out of the loop, e.g. a bf16 embedding table's uint16 view) is
    counted once per call, as a decode loop counts it once per batch: it adds the same amount to every
    price (bf16 SmolLM2 at batch 1, over calls of 24 steps: about 0.7 ms a step, 5% of a plain step).
    Before each step the lengths go back to `context`. The jitted calls are kept per proposer
    (`_step_loop`), so timing a proposer again compiles nothing.
    """
    drafting = [p for p in proposers.values() if p is not None]
    most = max([_STATE_DRAFTS, *(p.num_draft for p in drafting)])
    dstate = drafting[0].init_state(rows, slots, target.cache_dtype) if drafting else None
    state = DecodeState(
        cache=_cache_at(target, rows, slots, context),
        last_token=jnp.full((rows,), 5, jnp.int32),
        tokens=jnp.zeros((rows, most + 2), jnp.int32),
        num_generated=jnp.ones((rows,), jnp.int32),
        max_new=jnp.full((rows,), 1 << 20, jnp.int32),
        done=jnp.zeros((rows,), jnp.bool_),
        row_keys=jax.vmap(jax.random.key)(jnp.arange(rows, dtype=jnp.uint32)),
        eos_ids=jnp.full((1,), -1, jnp.int32),  # no token ends a row
        steps=jnp.zeros((rows,), jnp.int32),
        accept_hist=jnp.zeros((rows, most + 2), jnp.int32),
    )
    sampling = SamplingParams.make() if sampling is None else sampling
    loops = {key: _step_loop(target.module, p, rows, context) for key, p in proposers.items()}

    def call(key) -> float:
        nonlocal state, dstate
        start = state.replace(drafter_state=None if proposers[key] is None else dstate)
        t0 = time.perf_counter()
        state = jax.block_until_ready(loops[key](target.params, drafter_params, start, sampling))
        elapsed = time.perf_counter() - t0
        if state.drafter_state is not None:
            dstate = state.drafter_state
        return elapsed

    for key in proposers:  # compiles
        call(key)
    times = {key: [] for key in proposers}
    for _ in range(reps):
        for key in proposers:
            times[key].append(call(key))
    return {key: min(t) / _steps_per_call(rows) for key, t in times.items()}


def measure_cost_curve(
    target: Target,
    drafter=None,
    context: int = 256,
    reps: int = 15,
    sizes: Sequence[int] = COST_CURVE_SIZES,
) -> dict[str, Any]:
    """Median time of one target forward over n new tokens after `context` cached ones, for n in `sizes`
    (batch 1).

    This curve bounds every speedup here: speedup <= tau * t(1) / (t(verify of the block) + t(draft)).
    With a drafter, also the median time of one draft forward (its block size).

    Raises:
      ValueError: when `sizes` lacks 1 (every time is also reported relative to a 1-token forward).
    """
    if 1 not in sizes or min(sizes) < 1:
        raise ValueError(f"cost curve sizes must be positive and include 1, got {tuple(sizes)}")
    slots = context + max(sizes) + _SLOT_MARGIN
    verify_s = verify_times(target, sizes, 1, context, slots, reps)
    out = {
        "context": context,
        "verify_s": verify_s,
        "verify_relative": {n: t / verify_s[1] for n, t in verify_s.items()},
        # The same 1-token step with 4x the (empty) slots: its cost should follow the context, not S.
        "slots_s": {
            slots: verify_s[1],
            4 * slots: verify_times(target, (1,), 1, context, 4 * slots, reps)[1],
        },
    }
    if drafter is not None:
        out["draft_s"] = draft_time(target, drafter, 1, context, slots, reps)
        out["draft_block_size"] = drafter.proposer.block_size
        out["draft_relative"] = out["draft_s"] / verify_s[1]
    return out


def step_costs(
    target: Target,
    drafter,
    rows: int,
    context: int,
    slots: int,
    candidates: Sequence[int],
    reps: int = AUTO_REPS,
    tree_budgets: Sequence[int] = (),
    sampling: SamplingParams | None = None,
    cached_only: bool = False,
) -> dict[str, Any] | None:
    """{"plain_s": s, "chain_s": {B: s}, "tree_s": {N: s}}: seconds of one decode step of plain decoding,
    of chains of the block sizes `candidates` and of trees of `tree_budgets` nodes over the largest
    candidate block (without candidates, over the drafter's own block; `step_times`), at `rows` rows,
    about `context` tokens, `slots` cache slots and the target's `sampling` (None = greedy); measured once
    per machine, target, drafter architecture, draft sampling, target sampling and shape, then read from
    dflax's cache directory. With `cached_only`, None when the cache does not hold them (nothing is timed)."""
    sampling = SamplingParams.make() if sampling is None else sampling
    context = _pow2_context(context)
    slots = max(slots, context + max([*candidates, *(n + 1 for n in tree_budgets)]) + 1)
    key = {
        "machine": machine_facts(),
        "target": [target.name, str(target.dtype), str(jnp.dtype(target.cache_dtype)), repr(target.config)],
        "backend": target.module.attention_backend,
        "drafter": repr(drafter.config),
        # Sampled drafts (block verification) and a target that samples cost more a step than greedy ones.
        "drafts_greedily": drafter.drafts_greedily,
        "sampling": [float(sampling.temperature), int(sampling.top_k), float(sampling.top_p)],
        "measure": f"fastest call of {_steps_per_call(rows)} decode_steps, v{_STEP_PROGRAM_VERSION}",
        "rows": rows,
        "context": context,
        "slots": slots,
        "candidates": sorted(candidates),
        "tree_budgets": sorted(tree_budgets),
        "reps": reps,
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    path = cache_dir() / "cost_curves" / f"{digest}.json"
    if path.is_file():
        stored = json.loads(path.read_text(encoding="utf-8"))["costs"]
        return {
            "plain_s": stored["plain_s"],
            **{name: {int(k): v for k, v in stored[name].items()} for name in ("chain_s", "tree_s")},
        }
    if cached_only:
        return None
    block = drafter.with_block_size(max(candidates)) if candidates else drafter
    proposers = {("plain", 0): None}
    proposers.update({("chain", b): drafter.with_block_size(b).proposer for b in candidates})
    proposers.update({("tree", n): block.with_tree_budget(n).proposer for n in tree_budgets})
    times = step_times(target, drafter.params, proposers, rows, context, slots, reps, sampling)
    costs = {
        "plain_s": times["plain", 0],
        "chain_s": {b: times["chain", b] for b in candidates},
        "tree_s": {n: times["tree", n] for n in tree_budgets},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"key": key, "costs": costs}, indent=1), encoding="utf-8")
    os.replace(tmp, path)
    return costs


def auto_block_size(
    target: Target,
    drafter,
    rows: int,
    context: int,
    trees: bool = True,
    *,
    slots: int = 0,
    static_tokens: int | None = None,
    sampling: SamplingParams | None = None,
    measure: bool = True,
) -> tuple[Any, BlockSizeChoice]:
    """The drafter at the block size (or tree budget) the cost model predicts fastest, or None for plain
    decoding.

    Args:
      target: the loaded target.
      drafter: a loaded DFlash `dflax.drafters.Drafter` or DART `DartDrafterBound` whose per-position
        acceptance was measured (`drafter.accept`, from its TRAINING.json). A DART beam tree of N nodes
        is predicted as a best-first tree of N nodes over the same rank acceptance.
      rows: the batch size the run decodes at.
      context: a typical prompt length plus half the new tokens.
      trees: weigh draft trees too (when the drafter's rank acceptance was measured and it drafts
        greedily); False keeps to chains.
      slots: the run's cache slots (a bf16 cache costs in proportion to its slots on a CPU); at least the
        context plus the largest candidate step.
      static_tokens: the new tokens per row when the run decodes static batches of `rows` > 1 rows (each
        batch waits for its slowest row: `dflax.planning.block_size`); None for continuous batching.
      sampling: the run's target sampling (None = greedy); steps are timed under it, with the drafter's
        own draft sampling (sampled drafts and block verification at T > 0 cost more than greedy steps).
      measure: time steps the cost cache lacks; False reads only the cache, and without the first stage
        there decides from `PRIOR_CHAIN_COSTS` (chains at one row on a CPU; plain decoding otherwise).

    Returns:
      (the drafter at the chosen block size and tree budget, or None; the choice with its predictions).

    Raises:
      ValueError: when the drafter has no measured acceptance.
    """
    if not drafter.accept:
        raise ValueError(
            f"drafter {drafter.name!r} has no measured per-position acceptance (TRAINING.json), so "
            "--block-size auto cannot predict its speed; give --block-size B"
        )
    drafter = drafter.with_tree_budget(0)  # chains first: every block size below is then valid
    trained = drafter.trained_block_size
    candidates = [b for b in AUTO_BLOCK_SIZES if b <= min(trained, len(drafter.accept) + 1)]
    tree_stats = drafter.rank_accept or drafter.tree_commits
    budgets = AUTO_TREE_BUDGETS if trees and drafter.drafts_greedily and tree_stats else ()
    # One cache shape for every stage (step_costs widens `slots` to the largest step it times).
    slots = max(slots, _pow2_context(context) + max([*candidates, *(n + 1 for n in budgets)]) + 1)
    timed = _TimedSteps(target, drafter, rows, context, slots, sampling, measure)
    timed.time([b for b in FIRST_TIMED_BLOCK_SIZES[rows == 1] if b in candidates] or candidates[:1], ())
    if timed.plain_s is None:  # not timed and not cached
        return _prior_choice(drafter, candidates, rows, static_tokens)

    def choice_now() -> BlockSizeChoice:
        chains = _interpolated(timed.chain_s, candidates, timed.plain_s)
        if timed.tree_s:
            tree_s = _interpolated_trees(timed, budgets, candidates)
        else:  # an untimed tree of N nodes priced as the chain verifying N + 1 tokens
            tokens = _interpolated(timed.chain_s, [n + 1 for n in budgets], timed.plain_s)
            tree_s = {n: tokens[n + 1] for n in budgets}
        return choose_block_size(
            drafter.accept,
            timed.plain_s,
            chains,
            rank_accept=drafter.rank_accept,
            tree_s=tree_s,
            rows=rows,
            new_tokens=static_tokens,
            tree_commits=drafter.tree_commits,
        )

    # Larger chains are timed when their extrapolated step makes one of them the best; a tree when the
    # chain verifying as many tokens, as its price, makes a tree the best.
    later = [b for b in LATER_TIMED_BLOCK_SIZES if b in candidates and b > max(timed.chain_s)]
    best = choice_now()
    if later and not best.tree_budget and (best.block_size or 0) > max(timed.chain_s):
        timed.time(later, ())
        best = choice_now()
    if budgets and best.tree_budget:
        timed.time([], [n for n in TIMED_TREE_BUDGETS if n in budgets], tree_block=max(candidates))
    choice = choice_now()  # an untimed tree was never predicted best
    if choice.block_size is None:
        return None, choice
    return drafter.with_block_size(choice.block_size).with_tree_budget(choice.tree_budget), choice


def _pow2_context(context: int) -> int:
    """The context a step is timed at: a power of two (one measurement per octave), at least 32."""
    return 1 << max(5, (context - 1).bit_length())


class _TimedSteps:
    """The steps auto has timed so far for one run shape: plain decoding's, and chains' and trees' in the
    terms of the first stage's plain step (a later stage's times are scaled by the ratio of its own plain
    step to the first one's, so load that changed between stages moves no price)."""

    def __init__(self, target, drafter, rows, context, slots, sampling, measure):
        self.args = (target, drafter, rows, context, slots)
        self.sampling = sampling
        self.measure = measure
        self.plain_s: float | None = None
        self.chain_s: dict[int, float] = {}
        self.tree_s: dict[int, float] = {}

    def time(self, block_sizes: Sequence[int], tree_budgets: Sequence[int], tree_block: int = 0) -> None:
        """Times plain decoding, the chains of `block_sizes` and the trees of `tree_budgets` (over blocks of
        `tree_block`, else of the largest of `block_sizes`), through the cost cache; without `measure`, only
        what it holds."""
        cached_only = {} if self.measure else {"cached_only": True}
        target, drafter, *shape = self.args
        costs = step_costs(
            target,
            drafter.with_block_size(tree_block) if tree_block else drafter,
            *shape,
            list(block_sizes),
            tree_budgets=tuple(tree_budgets),
            sampling=self.sampling,
            **cached_only,
        )
        if costs is None:
            return
        scale = 1.0 if self.plain_s is None else self.plain_s / costs["plain_s"]
        self.plain_s = self.plain_s or costs["plain_s"]
        self.chain_s.update({b: t * scale for b, t in costs["chain_s"].items() if b not in self.chain_s})
        self.tree_s.update({n: t * scale for n, t in costs["tree_s"].items()})


def _interpolated(timed: Mapping[int, float], sizes: Sequence[int], plain_s: float) -> dict[int, float]:
    """Step seconds at every size of `sizes`: timed ones as timed, the others linear in the tokens verified
    between the timed neighbours (plain decoding at one token), past the largest along the last segment."""
    points = sorted({1: plain_s, **timed}.items())
    xs, ys = [x for x, _ in points], [y for _, y in points]
    out = {}
    for size in sizes:
        if size in timed:
            out[size] = timed[size]
        elif size <= xs[-1]:
            out[size] = float(np.interp(size, xs, ys))
        else:  # past the largest timed size: the last segment's slope, never below its end
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]) if len(xs) > 1 else 0.0
            out[size] = ys[-1] + max(slope, 0.0) * (size - xs[-1])
    return out


def _interpolated_trees(
    timed: _TimedSteps, budgets: Sequence[int], candidates: Sequence[int]
) -> dict[int, float]:
    """Step seconds of trees of every budget: a timed tree as timed, the others from the nearest timed tree
    plus the chains' cost per verified token (a tree of N nodes verifies N + 1 tokens over the largest
    block's draft); without a timed tree, none (their best case could not pay)."""
    if not budgets or not timed.tree_s:
        return {}
    chains = _interpolated(timed.chain_s, candidates, timed.plain_s)
    largest = max(candidates)
    per_token = max((chains[largest] - timed.plain_s) / max(largest - 1, 1), 0.0)
    out = {}
    for n in budgets:
        nearest = min(timed.tree_s, key=lambda m: abs(m - n))
        out[n] = timed.tree_s.get(n, timed.tree_s[nearest] + per_token * (n - nearest))
    return out


def _tree_moments(drafter, candidates: Sequence[int], budgets: Sequence[int]) -> np.ndarray:
    """[N + 1, 2] E[c] and E[c^2] of best-first trees (the drafter's simulated ones when recorded)."""
    if drafter.tree_commits is not None:
        return np.asarray(drafter.tree_commits, np.float64)
    return tree_commit_moments(np.asarray(drafter.rank_accept)[: max(candidates) - 1], max(budgets))


def _prior_choice(drafter, candidates: Sequence[int], rows: int, static_tokens: int | None):
    """auto's choice for a run too short to time its steps and without cached timings: at one row on a
    CPU, the chain `PRIOR_CHAIN_COSTS` predicts fastest; otherwise plain decoding."""
    reason = "a short run, not timed"
    if rows > 1 or jax.default_backend() != "cpu":
        return None, BlockSizeChoice(None, {}, untimed=reason)
    chains = _interpolated(PRIOR_CHAIN_COSTS, candidates, 1.0)
    choice = choose_block_size(drafter.accept, 1.0, chains, rows=rows, new_tokens=static_tokens)
    choice = dataclasses.replace(choice, untimed=reason)
    if choice.block_size is None:
        return None, choice
    return drafter.with_block_size(choice.block_size), choice
