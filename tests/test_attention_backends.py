"""The whole generate path gives identical tokens and accept histograms with the Pallas kernel (interpret
mode) and the jnp reference: prefill, decode and DFlash verify/draft all go through the one attention entry
point; the drafter's own forward is compared directly, since lossless tokens do not depend on it."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflax
from dflax.decoding.decode import prefill
from dflax.decoding.sampling import SamplingParams
from dflax.drafters import load_drafter
from dflax.models.cache import KVCache
from dflax.runtime.static_batches import generate_ids

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [20, 21, 22]]


def outputs(target, drafter=None):
    """Each prompt's greedy tokens and accept histogram (which drafts were accepted, step by step)."""
    results = generate_ids(
        target,
        PROMPTS,
        max_new_tokens=10,
        sampling=SamplingParams.make(),
        row_seeds=[0, 1],
        batch_size=2,
        drafter=drafter,
    )
    return [(r.tokens, r.stats["accept_hist"]) for r in results]


def draft_hidden(target, drafter):
    """The drafter's final hidden states [B, n + 1, D] for the prompts' first block after prefill."""
    proposer = drafter.proposer
    tokens = np.zeros((len(PROMPTS), 16), np.int32)
    for r, ids in enumerate(PROMPTS):
        tokens[r, : len(ids)] = ids
    lens = jnp.asarray([len(ids) for ids in PROMPTS], jnp.int32)
    run = jax.jit(functools.partial(prefill, target.module, max_tokens=8, proposer=proposer))
    state = run(
        target.params,
        jnp.asarray(tokens),
        lens,
        KVCache.init(target.config, len(PROMPTS), 64, jnp.float32),
        jnp.full((len(PROMPTS),), 8, jnp.int32),
        jax.vmap(jax.random.key)(jnp.arange(len(PROMPTS), dtype=jnp.uint32)),
        jnp.asarray([-1], jnp.int32),
        SamplingParams.make(),
        drafter.params,
    )
    hidden = jax.jit(proposer.draft_hidden)(
        drafter.params, target.params, state.last_token, state.cache.lengths, state.drafter_state
    )
    return np.asarray(hidden)


@pytest.mark.parametrize("arch", ["gemma3", "qwen3"])  # sliding window + GQA 4:1; q/k-norm + GQA 2:1
def test_pallas_interpret_matches_reference(tiny_checkpoint, arch):
    path = str(tiny_checkpoint(arch)[0])
    reference = dflax.load_target(path, attention_backend="reference")
    pallas = dflax.load_target(path, attention_backend="pallas_interpret")
    assert outputs(pallas) == outputs(reference)
    drafter = load_drafter("untrained", reference, block_size=4)
    pallas_drafter = load_drafter("untrained", pallas, block_size=4)
    assert outputs(pallas, pallas_drafter) == outputs(reference, drafter)


def test_drafter_forward_matches_reference(tiny_checkpoint):
    """Tokens are lossless whatever the drafts, and an untrained drafter's are rarely accepted, so the
    drafter's own forward (its all-visible block attention over its context cache) is compared directly."""
    path = str(tiny_checkpoint("qwen3")[0])
    reference = dflax.load_target(path, attention_backend="reference")
    pallas = dflax.load_target(path, attention_backend="pallas_interpret")
    drafter = load_drafter("untrained", reference, block_size=4)
    pallas_drafter = load_drafter("untrained", pallas, block_size=4)
    np.testing.assert_allclose(
        draft_hidden(pallas, pallas_drafter), draft_hidden(reference, drafter), atol=2e-5, rtol=2e-5
    )


def test_pallas_backend_needs_an_accelerator(tiny_checkpoint):
    target = dflax.load_target(str(tiny_checkpoint("llama")[0]), attention_backend="pallas")
    with pytest.raises(ValueError, match="needs a TPU or GPU"):
        outputs(target)
