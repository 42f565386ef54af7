"""Speculative sampling through the whole decode loop matches the target's own distribution.

A tiny target with top-k 3 has at most 27 possible 3-token continuations, so their exact probabilities are
computable (float64, from the definition in sampling_definition). 4096 generations with an untrained
(deliberately poor) DFlash drafter, verified by the delta rule (greedy drafts) and by block verification
(drafts sampled from q at drafter temperature 0.7), must match them (chi-square). Drafts are rarely accepted
here; test_dflash_proposal checks the q that sampled drafts are sent with, and
tests/decoding/test_decode_sampling the loop with drafts that are often accepted.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from sampling_definition import target_probs
from scipy import stats
from tiny_checkpoints import full_sequence_logits

import dflax
from dflax.decoding.sampling import SamplingParams
from dflax.drafters import DraftSampling, load_drafter
from dflax.drafters.dflash import DRAFT_TEMPERATURE_SCALE
from dflax.runtime.static_batches import generate_ids

PROMPT = [7, 8, 9, 10]
N_ROWS, ROUNDS = 256, 16
DRAFT_TEMPERATURE = 0.7  # sampled drafts are drawn at a temperature other than the target's


@pytest.fixture(scope="module")
def target(tiny_checkpoint):
    return dflax.load_target(str(tiny_checkpoint("llama")[0]))


def exact_distribution(target, settings: dict) -> dict[tuple[int, ...], float]:
    """P(t1, t2, t3) by enumerating the kept tokens at each step (float64 definition of the settings)."""

    def step(prefix):
        probs = target_probs(full_sequence_logits(target, prefix)[-1], **settings)
        return {int(t): float(probs[t]) for t in np.flatnonzero(probs > 0)}

    out = {}
    for t1, p1 in step(PROMPT).items():
        for t2, p2 in step(PROMPT + [t1]).items():
            for t3, p3 in step(PROMPT + [t1, t2]).items():
                out[t1, t2, t3] = p1 * p2 * p3
    return out


def sampled_counts(target, sampling, drafter) -> dict[tuple[int, ...], int]:
    counts: dict[tuple[int, ...], int] = {}
    for r in range(ROUNDS):
        results = generate_ids(
            target,
            [PROMPT] * N_ROWS,
            max_new_tokens=3,
            sampling=sampling,
            row_seeds=list(range(r * N_ROWS, (r + 1) * N_ROWS)),
            batch_size=N_ROWS,
            drafter=drafter,
        )
        for res in results:
            counts[tuple(res.tokens)] = counts.get(tuple(res.tokens), 0) + 1
    return counts


@pytest.mark.parametrize("mode", ["greedy", "sample"])
@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_speculative_sampling_matches_target(target, mode, temperature, top_p):
    sampling = DraftSampling(mode, DRAFT_TEMPERATURE)
    drafter = load_drafter("untrained", target, block_size=4, draft_sampling=sampling)
    assert_matches_target(target, dict(temperature=temperature, top_k=3, top_p=top_p), drafter)


def test_sampled_drafts_from_a_draft_vocabulary_match_target(target):
    """q is zero outside the draft vocabulary (half the tokens here); block verification must stay exact."""
    sampling = DraftSampling("sample", DRAFT_TEMPERATURE)
    drafter = load_drafter("untrained", target, block_size=4, draft_sampling=sampling)
    vocab = np.arange(0, target.config.vocab_size, 2, dtype=np.int32)
    drafter = dataclasses.replace(drafter, proposer=dataclasses.replace(drafter.proposer, draft_vocab=vocab))
    assert_matches_target(target, dict(temperature=1.0, top_k=3), drafter)


def test_draft_sampling_for_a_target_temperature():
    """auto drafts greedily where sampling cannot help (T=0) or is not allowed (trees), else samples q."""
    greedy = DraftSampling("greedy")
    assert DraftSampling.for_target("auto", 0.0) == greedy
    assert DraftSampling.for_target("auto", 1.0, tree=True) == greedy
    assert DraftSampling.for_target("greedy", 1.0) == greedy
    sampled = DraftSampling("sample", DRAFT_TEMPERATURE_SCALE * 0.8)
    assert DraftSampling.for_target("auto", 0.8) == sampled == DraftSampling.for_target("sample", 0.8)
    assert DraftSampling.for_target("sample", 0.0) == DraftSampling("sample", 1.0)
    with pytest.raises(ValueError, match="'ratio' unknown"):
        DraftSampling.for_target("ratio", 1.0)


def assert_matches_target(target, settings: dict, drafter):
    """Chi-square test of the sampled 3-token continuations against their exact probabilities."""
    exact = exact_distribution(target, settings)
    counts = sampled_counts(target, SamplingParams.make(**settings), drafter)
    assert set(counts) <= set(exact), "generated a sequence the target cannot produce"
    keys = list(exact)
    observed = np.array([counts.get(k, 0) for k in keys], np.float64)
    expected = np.array([exact[k] for k in keys]) / sum(exact.values()) * observed.sum()
    big = expected >= 5  # pool tiny bins so the chi-square approximation holds
    if (~big).any():
        observed = np.append(observed[big], observed[~big].sum())
        expected = np.append(expected[big], expected[~big].sum())
    pvalue = stats.chisquare(observed, expected).pvalue
    assert pvalue > 1e-3, f"p={pvalue:.3g}"


def test_exact_distribution_has_the_expected_support(target):
    assert len(exact_distribution(target, dict(temperature=1.0, top_k=3))) == 27
