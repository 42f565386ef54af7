"""`DFlashProposer.propose` sends verification the q its drafts were really drawn from.

Block verification is lossless only if each draft is a sample of the q sent with it. For one decode state,
20000 draws of an untrained drafter at drafter temperature 0.6 (with and without a pruned draft vocabulary)
must follow exp(log q) at every draft position (chi-square), and q must be the tempered softmax of the
drafter's logits by the float64 definition. Proposers that send a wrong q (the q at temperature 1 while
drawing at 0.6; the draft-vocabulary q scattered one id off) fail the same check.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sampling_definition import target_probs
from scipy import stats

import dflax
from dflax.decoding.decode import prefill
from dflax.decoding.sampling import SamplingParams
from dflax.drafters import DraftSampling, load_drafter
from dflax.models.cache import KVCache

DRAFT_TEMPERATURE = 0.6
NUM_DRAWS = 20000
PROMPT = [7, 8, 9, 10]


@pytest.fixture(scope="module")
def target(tiny_checkpoint):
    return dflax.load_target(str(tiny_checkpoint("llama")[0]))


def make_proposer(target, draft_vocab: bool):
    """An untrained drafter drawing 2 drafts at DRAFT_TEMPERATURE; its parameters and proposer."""
    drafter = load_drafter(
        "untrained", target, block_size=3, draft_sampling=DraftSampling("sample", DRAFT_TEMPERATURE)
    )
    proposer = drafter.proposer
    if draft_vocab:  # every other token id: q must be zero on the odd ids
        vocab = np.arange(0, target.config.vocab_size, 2, dtype=np.int32)
        proposer = dataclasses.replace(proposer, draft_vocab=vocab)
    return drafter.params, proposer


def decode_state(target, params, proposer):
    """The loop state right after prefilling PROMPT (batch 1)."""
    tokens = jnp.zeros((1, 16), jnp.int32).at[0, : len(PROMPT)].set(jnp.asarray(PROMPT))
    run = jax.jit(functools.partial(prefill, target.module, max_tokens=8, proposer=proposer))
    return run(
        target.params,
        tokens,
        jnp.asarray([len(PROMPT)], jnp.int32),
        KVCache.init(target.config, 1, 64, jnp.float32),
        jnp.asarray([8], jnp.int32),
        jax.vmap(jax.random.key)(jnp.zeros((1,), jnp.uint32)),
        jnp.asarray([-1], jnp.int32),
        SamplingParams.make(1.0),
        params,
    )


def draws(target, params, propose, state) -> tuple[np.ndarray, np.ndarray]:
    """NUM_DRAWS calls of `propose` with independent keys: drafts [N, n] and the log q of the first call."""
    keys = jax.random.split(jax.random.key(0), NUM_DRAWS)
    drafts, log_q = jax.jit(jax.vmap(lambda k: propose(params, target.params, state, k[None])))(keys)
    log_q = np.asarray(log_q[:, 0])  # [N, n, V]
    np.testing.assert_array_equal(log_q, np.broadcast_to(log_q[0], log_q.shape))  # q does not depend on key
    return np.asarray(drafts[:, 0]), log_q[0]


def follows_q_p_value(drafts: np.ndarray, log_q: np.ndarray) -> float:
    """Smallest chi-square p-value over draft positions of drafts [N, n] against q [n, V]; 0 when a
    draft has q == 0."""
    q = np.exp(log_q.astype(np.float64))
    p_values = []
    for i in range(drafts.shape[1]):
        observed = np.bincount(drafts[:, i], minlength=q.shape[1]).astype(np.float64)
        if observed[q[i] == 0].sum() > 0:
            return 0.0
        expected = q[i] / q[i].sum() * len(drafts)
        common = expected >= 5  # pool the rare tokens
        observed = np.append(observed[common], observed[~common].sum())
        expected = np.append(expected[common], expected[~common].sum())
        observed, expected = observed[expected > 0], expected[expected > 0]
        expected *= observed.sum() / expected.sum()
        p_values.append(stats.chisquare(observed, expected).pvalue)
    return float(min(p_values))


@pytest.mark.parametrize("draft_vocab", [False, True], ids=["full-vocab", "draft-vocab"])
def test_sampled_drafts_follow_the_q_sent_with_them(target, draft_vocab):
    params, proposer = make_proposer(target, draft_vocab)
    state = decode_state(target, params, proposer)
    drafts, log_q = draws(target, params, proposer.propose, state)
    p_value = follows_q_p_value(drafts, log_q)
    assert p_value > 1e-3, f"p={p_value:.3g}"
    # q is the drafter's softmax at its own temperature (by the definition), zero outside its vocabulary.
    hidden = proposer.draft_hidden(
        params, target.params, state.last_token, state.cache.lengths, state.drafter_state
    )
    logits = np.asarray(proposer.draft_logits(target.params, hidden[:, 1:]))[0]  # [n, V']
    want = np.zeros_like(log_q, np.float64)
    ids = proposer.draft_vocab if draft_vocab else np.arange(target.config.vocab_size)
    want[:, ids] = target_probs(logits, DRAFT_TEMPERATURE)
    np.testing.assert_allclose(np.exp(log_q.astype(np.float64)), want, atol=1e-6, rtol=1e-4)
    assert draft_vocab == bool(np.all(drafts % 2 == 0))


def _q_at_temperature_one(log_q: jax.Array) -> jax.Array:
    """WRONG: the q of the same logits at temperature 1 (what forgetting the drafter temperature sends)."""
    return jax.nn.log_softmax(log_q * DRAFT_TEMPERATURE, axis=-1)


def _q_one_id_off(log_q: jax.Array) -> jax.Array:
    """WRONG: q scattered to the ids one above the draft vocabulary's (a misaligned scatter)."""
    return jnp.roll(log_q, 1, axis=-1)


WRONG_Q = {"temperature-one": (_q_at_temperature_one, False), "scatter-one-off": (_q_one_id_off, True)}


@pytest.mark.parametrize("wrong, draft_vocab", WRONG_Q.values(), ids=WRONG_Q.keys())
def test_a_wrong_q_is_caught(target, wrong, draft_vocab):
    params, proposer = make_proposer(target, draft_vocab)
    state = decode_state(target, params, proposer)

    def propose(*args):
        drafts, log_q = proposer.propose(*args)
        return drafts, wrong(log_q)

    p_value = follows_q_p_value(*draws(target, params, propose, state))
    assert p_value < 1e-9, f"wrong q passed: p={p_value:.3g}"
