"""Drafters for `generate`: loaded from the options with one clear error, and the auto block-size chooser."""

from __future__ import annotations

from dflax.cli.common import console, fail


def load_drafter_or_fail(
    method: str,
    drafter: str | None,
    loaded,
    block_size: int | None,
    draft_sampling: str,
    temperature: float,
    tree_budget: int | None = None,
    min_match: int | None = None,
):
    """The drafter for --method dflash, dart or lookup (None for ar), with one clear error for bad input;
    `draft_sampling` ("auto", "greedy" or "sample") is resolved for the target's `temperature`."""
    from dflax.drafters.dflash import DRAFT_SAMPLING_MODES

    if draft_sampling not in DRAFT_SAMPLING_MODES:
        fail(f"--draft-sampling {draft_sampling!r}: use auto, greedy or sample")
    if tree_budget is not None and method == "ar":
        fail(
            "--tree-budget needs --method dflash, dart or lookup (plain decoding verifies one token per step)"
        )
    if method == "ar":
        return None
    from dflax.drafters import SHIPPED, DraftSampling, load_drafter, prompt_lookup
    from dflax.drafters.dart_loader import DART_TREE_BUDGET, load_dart
    from dflax.drafters.lookup import DEFAULT_MIN_MATCH, LOOKUP_BLOCK_SIZE

    try:
        if method == "lookup":
            match = DEFAULT_MIN_MATCH if min_match is None else min_match
            return prompt_lookup(block_size or LOOKUP_BLOCK_SIZE, tree_budget or 0, match)
        if method == "dart":
            if drafter is None:
                fail(
                    "--method dart needs --drafter: a DART drafter directory (`dflax train --config "
                    "configs/train/dart-smollm2.json` exports one) or 'untrained'"
                )
            if draft_sampling == "sample":
                fail(
                    "--method dart drafts greedily (its trees are verified by the delta rule): drop "
                    "--draft-sampling"
                )
            dart = load_dart(drafter, loaded, DART_TREE_BUDGET if tree_budget is None else tree_budget)
            return dart.with_block_size(block_size) if block_size else dart
        sampling = DraftSampling.for_target(draft_sampling, temperature, tree=bool(tree_budget))
        loaded_drafter = load_drafter(
            drafter or SHIPPED, loaded, block_size=block_size, draft_sampling=sampling
        )
        return loaded_drafter.with_tree_budget(tree_budget) if tree_budget else loaded_drafter
    except (ValueError, FileNotFoundError) as e:
        fail(str(e))


def load_diffuspec_or_fail(
    drafter: str | None,
    loaded,
    window: str | None,
    refine_steps: int,
    cps: bool,
    block_size: str | None,
    tree_budget: int | None,
    draft_sampling: str,
):
    """The DiffuSpec drafter of --method diffuspec, with one clear error for bad input."""
    from dflax.drafters.diffuspec_loader import WindowSetting, load_diffuspec

    if block_size or tree_budget or draft_sampling == "sample":
        fail(
            "--method diffuspec drafts one chain of --window slots greedily: drop --block-size, "
            "--tree-budget and --draft-sampling"
        )
    try:
        return load_diffuspec(drafter, loaded, WindowSetting.parse(window or "auto"), refine_steps, cps)
    except (ValueError, FileNotFoundError) as e:
        fail(str(e))


def auto_chooser(loaded, records, batch_size: int, max_new_tokens: int, trees: bool, static: bool, sampling):
    """choose(drafter) -> (the drafter at the cost model's block size (or tree budget, with `trees`) for
    this run (static batches or continuous batching, under the target's `sampling`), or None (plain
    decoding); the choice); it says which."""
    from dflax.generation import encode_prompt
    from dflax.planning.cost_curve import auto_block_size
    from dflax.runtime.shapes import cache_slots, prompt_bucket

    lengths = sorted(len(encode_prompt(loaded, r.prompt)) for r in records) or [1]
    median = lengths[len(lengths) // 2]

    def choose(drafter):
        try:
            with console.status("block size auto: timing decode steps (once per machine and shape) ..."):
                chosen, choice = auto_block_size(
                    loaded,
                    drafter,
                    min(batch_size, max(len(records), 1)),
                    median + max_new_tokens // 2,  # the median prompt, half-way through
                    trees,
                    slots=cache_slots(prompt_bucket(median), max_new_tokens, None),
                    static_tokens=max_new_tokens if static else None,
                    sampling=sampling,
                )
        except ValueError as e:
            fail(str(e))
        console.print(choice.describe())
        return chosen, choice

    return choose
