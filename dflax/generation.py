"""Batched generation: prompts in, text + token ids + stats out.

Prompts are encoded and checked against the context here; the batches run in `dflax.runtime` (static
batches bucketed to static shapes, or continuous batching).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from dflax.decoding.sampling import SamplingParams
from dflax.planning.auto import AutoSettings, PlanListener, run_auto, uses_auto
from dflax.runtime.continuous import generate_continuous
from dflax.runtime.results import GenerationResult
from dflax.runtime.static_batches import SHARED_PREFIX_MODES, generate_ids
from dflax.target import Target

if TYPE_CHECKING:
    from dflax.drafters import DartDrafterBound, Drafter, LookupDrafter

Prompt = str | list[dict[str, str]]


class PromptTooLongError(ValueError):
    """A prompt plus its new-token budget does not fit the model's context."""


def encode_prompt(target: Target, prompt: Prompt) -> list[int]:
    """Token ids of a raw-completion string or a chat message list (via the model's chat template)."""
    if isinstance(prompt, str):
        return target.tokenizer.encode(prompt)
    if isinstance(prompt, list) and all(
        isinstance(m, dict) and "role" in m and "content" in m for m in prompt
    ):
        return target.tokenizer.encode_chat(prompt)
    raise TypeError(
        "a prompt must be a string (raw completion) or a list of {'role': ..., 'content': ...} messages, "
        f"got {type(prompt).__name__}"
    )


def fit_to_context(
    ids: list[int], max_new_tokens: int, context: int, truncate: bool, label: str
) -> list[int]:
    """Checks that a prompt plus its budget fits the context; keeps the last tokens when truncating.

    Raises:
      PromptTooLongError: when it does not fit and truncate is False, or when it is empty.
    """
    if not ids:
        raise PromptTooLongError(f"prompt {label} is empty after tokenization; give it some text")
    room = context - max_new_tokens
    if room < 1:
        raise PromptTooLongError(
            f"max_new_tokens={max_new_tokens} leaves no room for a prompt in the {context}-token context; "
            "lower max_new_tokens"
        )
    if len(ids) <= room:
        return ids
    if truncate:
        return ids[-room:]
    raise PromptTooLongError(
        f"prompt {label} has {len(ids)} tokens; with max_new_tokens={max_new_tokens} the context of "
        f"{context} tokens allows {room}. Shorten the prompt, lower max_new_tokens, or pass truncate=True "
        f"(CLI: --truncate) to keep the last {room} prompt tokens"
    )


def generate(
    target: Target,
    prompts: Sequence[Prompt],
    *,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    batch_size: int = 8,
    truncate: bool = False,
    row_seeds: Sequence[int] | None = None,
    on_result: Callable[[int, GenerationResult], None] | None = None,
    drafter: Drafter | DartDrafterBound | LookupDrafter | None = None,
    tree_budget: int | None = None,
    block_size: int | str | None = None,
    refill_every: int | None = None,
    shared_prefix: str = "none",
    on_plan: PlanListener | None = None,
) -> list[GenerationResult]:
    """Generates a completion for every prompt, plainly or speculatively (lossless either way).

    Args:
      target: from `dflax.load_target`.
      prompts: strings (raw completion) or chat message lists ([{"role": "user", "content": ...}]).
      max_new_tokens: new-token budget per prompt (> 0).
      temperature: 0 = greedy; > 0 samples.
      top_k: keep the k most likely tokens (0 = all).
      top_p: nucleus mass (1 = all).
      seed: base seed; prompt i uses seed + i unless row_seeds is given.
      batch_size: prompts decoded together.
      truncate: keep the last tokens of a prompt that does not fit the context instead of failing.
      row_seeds: explicit per-prompt seeds (a prompt's output depends only on its seed).
      on_result: called with (prompt index, result) as soon as each prompt is done.
      drafter: from `dflax.load_drafter` (DFlash or DART), `dflax.load_dart` or `dflax.prompt_lookup`;
        None decodes one token per target forward.
      tree_budget: N > 0 verifies a tree of N nodes each step (DFlash: best first over its block; DART:
        its n-gram-pruned beam; prompt lookup: the continuations of several occurrences) and 0 a chain;
        None keeps the drafter's own setting (a chain unless set).
      block_size: B (the anchor + B - 1 drafts), or "auto": the DFlash or DART chain or tree the cost model
        predicts fastest on this machine for this run (`dflax.planning.auto`), or plain decoding when none
        pays, chosen again after the first prompts from the acceptance they showed. None: "auto" for a
        drafter that recorded its acceptance (the shipped ones, and any `dflax train` exported) unless a
        tree budget N > 0 is given, else the drafter's own B. With tree_budget=0 auto weighs chains only.
      refill_every: None runs static batches (each until its longest row ends); k > 0 batches
        continuously: every k decode steps finished rows are refilled with waiting prompts
        (`dflax.runtime.continuous`; on_result is then called in finishing order). Outputs are the same.
      shared_prefix: "auto" finds the longest common token prefix of consecutive prompts in a batch
        (a system message, a prompt repeated for several samples) and prefills and stores it once per
        group of rows; "none" stores every prompt per row. Outputs are the same either way. Static
        batches on one device only (refill_every=None, no mesh); "auto" on a sliding-window model
        shares nothing.
      on_plan: with auto, told ("timing", None) before it times decode steps and ("chosen", choice) after
        each choice (`dflax.planning.block_size.BlockSizeChoice.describe()` says what it chose and why).

    Returns:
      One GenerationResult per prompt, in order.

    Raises:
      ValueError: for a non-positive max_new_tokens or batch_size, bad sampling settings, a tree budget
        without a drafter (or with sampled DFlash drafts), or a prompt that does not fit
        (PromptTooLongError). All prompts are checked before any is generated.
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size}")
    if refill_every is not None and refill_every < 1:
        raise ValueError(f"refill_every must be a positive number of steps (or None), got {refill_every}")
    if refill_every is not None and target.mesh is not None:
        raise ValueError(
            "continuous batching (refill_every) does not run on a mesh yet; use refill_every=None"
        )
    if shared_prefix not in SHARED_PREFIX_MODES:
        raise ValueError(f"shared_prefix must be one of {SHARED_PREFIX_MODES}, got {shared_prefix!r}")
    if shared_prefix == "auto" and (refill_every is not None or target.mesh is not None):
        raise ValueError(
            "shared_prefix='auto' runs static batches on one device; use refill_every=None and no mesh, "
            "or shared_prefix='none'"
        )
    sampling = SamplingParams.make(temperature, top_k, top_p)
    if (tree_budget is not None or block_size is not None) and drafter is None:
        raise ValueError(
            "tree_budget and block_size need a drafter: drafter=dflax.load_drafter(...) (DFlash) or "
            "dflax.prompt_lookup(); plain decoding verifies one token per step"
        )
    auto = uses_auto(drafter, block_size, tree_budget)
    if isinstance(block_size, int):
        if block_size < 2:
            raise ValueError(f"block_size must be 'auto' or an integer >= 2 (anchor + drafts): {block_size}")
        drafter = drafter.with_block_size(block_size)
    if tree_budget is not None:
        drafter = drafter.with_tree_budget(tree_budget)
    seeds = list(row_seeds) if row_seeds is not None else [seed + i for i in range(len(prompts))]
    if len(seeds) != len(prompts):
        raise ValueError(f"row_seeds has {len(seeds)} entries for {len(prompts)} prompts")
    context = target.config.max_position_embeddings
    encoded = [
        fit_to_context(encode_prompt(target, p), max_new_tokens, context, truncate, f"#{i}")
        for i, p in enumerate(prompts)
    ]
    results: list[GenerationResult | None] = [None] * len(encoded)

    def run(start: int, end: int, chosen) -> list[int]:
        """Decodes prompts [start, end) with `chosen`; returns their steps by tokens committed, summed."""

        def done(i: int, result: GenerationResult) -> None:
            results[start + i] = result
            if on_result is not None:
                on_result(start + i, result)

        _decode(
            target, encoded[start:end], seeds[start:end], chosen, done, max_new_tokens=max_new_tokens,
            sampling=sampling, batch_size=batch_size, refill_every=refill_every, shared_prefix=shared_prefix,
        )  # fmt: skip
        hists = [results[i].stats["accept_hist"] for i in range(start, end)]
        width = max(map(len, hists), default=0)
        return np.sum([h + [0] * (width - len(h)) for h in hists], axis=0).tolist() if hists else []

    if auto and encoded:
        settings = AutoSettings.for_run(
            [len(ids) for ids in encoded], batch_size, max_new_tokens,
            trees=tree_budget is None, static=refill_every is None, sampling=sampling,
        )  # fmt: skip
        run_auto(target, drafter.with_tree_budget(0), settings, len(encoded), run, on_plan)
    else:
        run(0, len(encoded), drafter)
    return results


def _decode(
    target: Target,
    prompt_ids: Sequence[list[int]],
    seeds: Sequence[int],
    drafter: Drafter | DartDrafterBound | LookupDrafter | None,
    on_result: Callable[[int, GenerationResult], None],
    *,
    max_new_tokens: int,
    sampling: SamplingParams,
    batch_size: int,
    refill_every: int | None,
    shared_prefix: str,
) -> None:
    """Decodes `prompt_ids` in static batches (refill_every None) or continuously; on_result(i, result) as
    each prompt finishes."""
    if refill_every is not None:
        generate_continuous(
            target, prompt_ids, max_new_tokens=max_new_tokens, sampling=sampling, row_seeds=seeds,
            batch_size=batch_size, refill_every=refill_every, drafter=drafter, on_result=on_result,
        )  # fmt: skip
        return
    for start in range(0, len(prompt_ids), batch_size):
        chunk = range(start, min(start + batch_size, len(prompt_ids)))
        batch = generate_ids(
            target,
            [prompt_ids[i] for i in chunk],
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            row_seeds=[seeds[i] for i in chunk],
            batch_size=batch_size,
            drafter=drafter,
            shared_prefix=shared_prefix,
        )
        for i, result in zip(chunk, batch):
            on_result(i, result)
