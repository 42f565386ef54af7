"""Drafters for `generate`: loaded from the options with one clear error."""

from __future__ import annotations

from dflax.cli.common import fail


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
