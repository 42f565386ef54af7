"""Sampling through the whole decode loop, with drafts the target often accepts, matches the target alone.

The toy target of `toy_target` (a random 2-layer Llama over 6 tokens) has 6 ** 4 continuations of 4 tokens,
whose exact probabilities come from its logits and the float64 definition in `sampling_definition`, not
from dflax's sampling code. Two drafters read the target itself, so drafts are often accepted and every
acceptance length occurs:
- "sampled": drafts drawn from the target at drafter temperature 0.6, sent with that q (block verification);
- "argmax": the target's greedy continuation, sent without q (delta rule).
The same check rejects a drafter that reports q at another temperature than it drew its drafts at, and
tells the sampled distribution apart from the one that filtering before the temperature would define.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sampling_definition import kept_set, target_probs
from toy_target import TV_BOUND, compare, exact_joint, make_toy, sample_outcomes

from dflax.models.transformer import Transformer

NUM_DRAFT = 2
DRAFT_TEMPERATURE = 0.6
SETTINGS = {
    "t1": dict(temperature=1.0),
    "t0.7-top_p0.9": dict(temperature=0.7, top_p=0.9),
}


@pytest.fixture(scope="module")
def toy():
    return make_toy()


@dataclasses.dataclass(frozen=True, eq=False)
class TargetDrafter:
    """Drafts NUM_DRAFT tokens by running the target itself, one forward per draft (a decode `Proposer`).

    Attributes:
      module: the target module (its parameters arrive as `target_params`).
      temperature: 0 drafts the target's argmax chain (no q: delta rule); > 0 samples each draft from
        softmax(logits / temperature) and returns log q (block verification).
      q_temperature: the temperature of the q it reports; None = `temperature`, the true q.
    """

    module: Transformer
    temperature: float
    q_temperature: float | None = None
    num_draft: int = NUM_DRAFT
    tap_layers: tuple[int, ...] = ()

    def init_state(self, batch, slots, dtype):
        """No state of its own."""

    def observe(self, params, drafter_state, tokens, taps, positions, count):
        """Reads nothing: the target's cache is all it needs."""

    def propose(self, params, target_params, state, keys):
        """Drafts [B, n] and log q [B, n, V] (None for argmax drafts), continuing the committed prefix."""
        b = state.last_token.shape[0]
        block = state.last_token[:, None]  # [B, 1 + drafts so far]
        log_q = []
        for i in range(self.num_draft):
            t = i + 1
            positions = state.cache.lengths[:, None] + jnp.arange(t, dtype=jnp.int32)
            mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
            hidden, _, _ = self.module.apply(target_params, block, positions, state.cache, mask)
            logits = self.module.apply(target_params, hidden[:, -1], method=Transformer.logits)  # [B, V]
            if self.temperature == 0:
                draft = jnp.argmax(logits, axis=-1)
            else:
                draw_keys = jax.vmap(jax.random.fold_in, (0, None))(keys, i)
                draft = jax.vmap(jax.random.categorical)(draw_keys, logits / self.temperature)
                log_q.append(jax.nn.log_softmax(logits / (self.q_temperature or self.temperature), axis=-1))
            block = jnp.concatenate([block, draft[:, None].astype(jnp.int32)], axis=1)
        return block[:, 1:], (jnp.stack(log_q, axis=1) if log_q else None)


@pytest.fixture(scope="module")
def samples(toy):
    """samples(drafter temperature, settings name) -> `sample_outcomes`, drawn once per module."""
    drawn = {}

    def get(temperature: float, name: str):
        if (temperature, name) not in drawn:
            drawn[temperature, name] = sample_outcomes(
                toy, TargetDrafter(toy.module, temperature), SETTINGS[name]
            )
        return drawn[temperature, name]

    return get


DRAFTERS = {"sampled": DRAFT_TEMPERATURE, "argmax": 0.0}


@pytest.mark.parametrize("name", SETTINGS)
@pytest.mark.parametrize("drafter", DRAFTERS.values(), ids=DRAFTERS.keys())
def test_loop_with_often_accepted_drafts_is_lossless(toy, samples, drafter, name):
    observed, hist = samples(drafter, name)
    exact = exact_joint(toy, lambda logits: target_probs(logits, **SETTINGS[name]))
    p_value, total_variation = compare(observed, exact)
    steps = hist.sum()
    assert p_value > 1e-3 and total_variation < TV_BOUND, f"p={p_value:.3g} TV={total_variation:.4f}"
    # Drafts are often accepted, all of them in many steps, yet every commit length occurs: the accept,
    # correction and bonus paths all carry the test.
    assert hist[NUM_DRAFT + 1] > 0.15 * steps and hist[1:].min() > 0.02 * steps, f"accept histogram {hist}"


def test_q_at_another_temperature_than_the_drafts_is_caught(toy):
    """WRONG: drafts drawn at DRAFT_TEMPERATURE, q reported at 1.0 (what a proposer that forgot to apply
    its temperature to q would send). Block verification is then not lossless, and the check says so."""
    settings = SETTINGS["t1"]
    proposer = TargetDrafter(toy.module, DRAFT_TEMPERATURE, q_temperature=1.0)
    observed, _ = sample_outcomes(toy, proposer, settings)
    p_value, total_variation = compare(observed, exact_joint(toy, lambda lg: target_probs(lg, **settings)))
    assert p_value < 1e-9, f"wrong q passed: p={p_value:.3g} TV={total_variation:.4f}"


def _filter_before_temperature(logits: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    """WRONG order: the nucleus of softmax(logits) (temperature 1), then the temperature inside it."""
    kept = np.apply_along_axis(kept_set, -1, logits, 0, top_p)
    probs = np.where(kept, np.exp((logits - logits.max(axis=-1, keepdims=True)) / temperature), 0.0)
    return probs / probs.sum(axis=-1, keepdims=True)


def test_samples_tell_apart_filtering_before_the_temperature(toy, samples):
    """The samples that match temperature-then-nucleus reject nucleus-then-temperature, so code that
    filtered first (a nucleus computed at T = 1) fails `test_loop_with_often_accepted_drafts_is_lossless`."""
    observed, _ = samples(DRAFTERS["argmax"], "t0.7-top_p0.9")
    wrong = exact_joint(toy, lambda logits: _filter_before_temperature(logits, 0.7, 0.9))
    p_value, total_variation = compare(observed, wrong)
    assert p_value < 1e-9, f"wrong order passed: p={p_value:.3g} TV={total_variation:.4f}"
