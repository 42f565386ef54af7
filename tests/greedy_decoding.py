"""Greedy decoding of token-id prompts, the tests' common way to compare speculative and plain output."""

from __future__ import annotations

from dflax.decoding.sampling import SamplingParams
from dflax.runtime.static_batches import generate_ids


def greedy(target, prompts, max_new, drafter=None, batch_size=4):
    """(tokens per prompt, the GenerationResults) of greedy decoding, plain or with `drafter`."""
    results = generate_ids(
        target,
        prompts,
        max_new_tokens=max_new,
        sampling=SamplingParams.make(),
        row_seeds=list(range(len(prompts))),
        batch_size=batch_size,
        drafter=drafter,
    )
    return [r.tokens for r in results], results
