"""The whole generate path gives identical tokens with the Pallas kernel (interpret mode) and the jnp
reference: prefill, decode and DFlash verify/draft all go through the one attention entry point."""

from __future__ import annotations

import pytest

import dflax
from dflax.drafters import load_drafter
from dflax.generation import generate_ids
from dflax.spec.sampling import SamplingParams

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [20, 21, 22]]


def tokens(target, drafter=None):
    results = generate_ids(
        target,
        PROMPTS,
        max_new_tokens=10,
        sampling=SamplingParams.make(),
        row_seeds=[0, 1],
        batch_size=2,
        drafter=drafter,
    )
    return [r.tokens for r in results]


@pytest.mark.parametrize("arch", ["gemma3", "qwen3"])  # sliding window + GQA 4:1; q/k-norm + GQA 2:1
def test_pallas_interpret_matches_reference(tiny_checkpoint, arch):
    path = str(tiny_checkpoint(arch)[0])
    reference = dflax.load_target(path, attention_backend="reference")
    pallas = dflax.load_target(path, attention_backend="pallas_interpret")
    assert tokens(pallas) == tokens(reference)
    drafter = load_drafter("untrained", reference, block_size=4)
    pallas_drafter = load_drafter("untrained", pallas, block_size=4)
    assert tokens(pallas, pallas_drafter) == tokens(reference, drafter)


def test_pallas_backend_needs_an_accelerator(tiny_checkpoint):
    target = dflax.load_target(str(tiny_checkpoint("llama")[0]), attention_backend="pallas")
    with pytest.raises(ValueError, match="needs a TPU or GPU"):
        tokens(target)
