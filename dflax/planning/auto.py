"""The auto policy: which block size (or tree budget) a run decodes at, or plain decoding, decided once from
the drafter's held-out acceptance and this machine's timed steps, and again after the run's first prompts
with the acceptance they showed.

One policy serves `dflax.generate(block_size="auto")`, `dflax generate` and `dflax bench`: each front end
hands `run_auto` a callback that decodes a slice of its prompts with the drafter it is given.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dflax.decoding.sampling import SamplingParams
from dflax.planning import cost_curve
from dflax.planning.block_size import BlockSizeChoice
from dflax.planning.cost_curve import auto_block_size
from dflax.planning.probe import probe_size, scaled_to_probe
from dflax.runtime.shapes import cache_slots, prompt_bucket
from dflax.target import Target

AUTO = "auto"

# (event, choice): "timing" before steps may be timed (choice None), "chosen" with each choice made.
PlanListener = Callable[[str, BlockSizeChoice | None], None]


def uses_auto(drafter: Any, block_size: int | str | None, tree_budget: int | None) -> bool:
    """Whether a run decides its block size by the cost model: `block_size` "auto", or left unset for a
    DFlash or DART drafter that recorded its acceptance (TRAINING.json), in both cases without a tree
    budget of N > 0 (0 asks for chains).

    Raises:
      ValueError: a string other than "auto"; "auto" with a tree budget of N > 0, or without a DFlash or
        DART drafter.
    """
    choosable = drafter is not None and hasattr(drafter, "accept") and hasattr(drafter, "trained_block_size")
    if isinstance(block_size, str) and block_size != AUTO:
        raise ValueError(f"block size {block_size!r}: give 'auto' or an integer >= 2 (anchor + drafts)")
    if block_size == AUTO:
        if not choosable:
            raise ValueError(
                "block size auto chooses a DFlash or DART chain or tree itself; with prompt lookup, "
                "DiffuSpec or plain decoding give a block size B"
            )
        if tree_budget:
            raise ValueError("block size auto chooses the tree budget too; leave out the tree budget N > 0")
        return True
    return block_size is None and not tree_budget and choosable and bool(drafter.accept)


@dataclasses.dataclass(frozen=True)
class AutoSettings:
    """What the cost model prices a run's steps at.

    Attributes:
      rows: the rows decoded together (the batch size, at most the number of prompts).
      context: the median prompt plus half the new tokens (where a typical step runs).
      slots: the run's cache slots for the median prompt.
      static_tokens: the new tokens per row for static batches (each waits for its slowest row), None for
        continuous batching.
      trees: weigh draft trees too (else chains only).
      sampling: the target's sampling, under which steps are timed.
      plain_steps: the plain decode steps the run would take (its prompts per row times the new tokens):
        under `cost_curve.AUTO_MIN_STEPS` its steps are not timed (`auto_block_size(measure=False)`).
    """

    rows: int
    context: int
    slots: int
    static_tokens: int | None
    trees: bool
    sampling: SamplingParams
    plain_steps: int

    @classmethod
    def for_run(
        cls,
        prompt_lengths: Sequence[int],
        batch_size: int,
        max_new_tokens: int,
        *,
        trees: bool,
        static: bool,
        sampling: SamplingParams,
    ) -> AutoSettings:
        """The settings of a run over prompts of `prompt_lengths` tokens."""
        lengths = sorted(prompt_lengths) or [1]
        median = lengths[len(lengths) // 2]
        return cls(
            rows=min(batch_size, max(len(prompt_lengths), 1)),
            context=median + max_new_tokens // 2,  # the median prompt, half-way through
            slots=cache_slots(prompt_bucket(median), max_new_tokens, None),
            static_tokens=max_new_tokens if static else None,
            trees=trees,
            sampling=sampling,
            plain_steps=-(-len(prompt_lengths) // max(batch_size, 1)) * max_new_tokens,
        )


def choose(target: Target, drafter: Any, settings: AutoSettings) -> tuple[Any, BlockSizeChoice]:
    """(the drafter at the cost model's block size and tree budget, or None for plain decoding; the
    choice)."""
    return auto_block_size(
        target,
        drafter,
        settings.rows,
        settings.context,
        settings.trees,
        slots=settings.slots,
        static_tokens=settings.static_tokens,
        sampling=settings.sampling,
        measure=settings.plain_steps >= cost_curve.AUTO_MIN_STEPS,
    )


@dataclasses.dataclass(frozen=True)
class AutoRun:
    """What auto decided for a run.

    Attributes:
      first: the choice made before decoding.
      final: the choice the run's remaining prompts decoded at (`first` when there was no probe).
      probe: prompts decoded at the first choice before choosing again (0: one choice for the whole run).
      acceptance_scale: what the probe's acceptance was relative to the held-out one (None without a probe).
    """

    first: BlockSizeChoice
    final: BlockSizeChoice
    probe: int
    acceptance_scale: float | None


def run_auto(
    target: Target,
    drafter: Any,
    settings: AutoSettings,
    num_prompts: int,
    run: Callable[[int, int, Any], Sequence[int] | None],
    on_plan: PlanListener | None = None,
) -> AutoRun:
    """Decodes a run's prompts at the block size auto chooses: first from the drafter's held-out acceptance;
    after the first prompts (`probe_size`, whole batches) again, with that acceptance scaled to what those
    prompts accepted (`scaled_to_probe`). Plain decoding measures no acceptance and is kept.

    Args:
      target, drafter: the loaded target and a DFlash or DART drafter with measured acceptance.
      settings: `AutoSettings.for_run` of the run.
      num_prompts: the run's prompts.
      run: run(start, end, chosen) decodes prompts [start, end) with `chosen` (None: plain decoding) and
        returns their steps by tokens committed, summed over the prompts (`accept_hist`).
      on_plan: told ("timing", None) before each choice that may time steps (a run long enough) and
        ("chosen", choice) after each choice.

    Raises:
      ValueError: when the drafter has no measured acceptance.
    """

    def decide(candidate):
        if on_plan and settings.plain_steps >= cost_curve.AUTO_MIN_STEPS:
            on_plan("timing", None)
        chosen, choice = choose(target, candidate, settings)
        if on_plan:
            on_plan("chosen", choice)
        return chosen, choice

    chosen, first = decide(drafter)
    probe = probe_size(settings.rows, num_prompts) if chosen is not None else 0
    if not probe:
        run(0, num_prompts, chosen)
        return AutoRun(first, first, 0, None)
    hist = run(0, probe, chosen)
    measured, scale = scaled_to_probe(drafter, np.asarray(hist), first.block_size, first.tree_budget)
    chosen, final = decide(measured)
    run(probe, num_prompts, chosen)
    return AutoRun(first, final, probe, scale)
