"""DiffuSpec through the decode loop: lossless, and exactly as fast as its drafts allow.

- Greedy DiffuSpec equals plain greedy decoding token for token on a mixed-length batch (tiny Qwen3
  target): with a random diffusion LM (CPS and ADL on, two refinement steps) and with a soft oracle whose
  lattice holds the true token and a decoy (CPS off, wrong at slot 2, so acceptance stops there).
- An oracle that always drafts the target's greedy continuation gives tau = k + 1 exactly: K + 1 with a
  fixed window, and k + 1 < K + 1 when ADL's bounds keep k below the verified window (drafts past k are
  never accepted). A wrong slot stops every step at it.
- Sampling on the toy target (`toy_target`): T=1 and T=0.7 / top-p 0.9 match the exact distribution by
  chi-square; a rule that accepts a draft with probability p(draft) and otherwise resamples from p (not
  the delta rule) is caught by the same check.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from diffusion_lms import OracleDiffusionLM, TableDiffusionLM, reference_texts
from greedy_decoding import greedy
from sampling_definition import target_probs
from toy_target import TV_BOUND, VOCAB, compare, exact_joint, make_toy, sample_outcomes

import dflax
from dflax.decoding import decode
from dflax.decoding.acceptance import commit_tokens
from dflax.decoding.sampling import SamplingParams, sample, split_keys, target_log_probs, uniform
from dflax.diffusion.adl import AdlSettings
from dflax.drafters.diffuspec_proposer import DiffuSpecDrafter, DiffuSpecParams, DiffuSpecProposer, diffuspec
from dflax.runtime.static_batches import generate_ids

# Mixed lengths, with repeats so the row's own trigram counts matter to CPS.
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [11, 12], [20, 21, 22, 20, 21, 22, 23, 20, 21], [40, 41, 42]]
MAX_NEW = 25


@pytest.fixture(scope="module")
def target(tiny_checkpoint):
    return dflax.load_target(str(tiny_checkpoint("qwen3")[0]))


@pytest.fixture(scope="module")
def plain(target):
    expected, _ = greedy(target, PROMPTS, MAX_NEW)
    return expected


def oracle_params(prompts, outputs):
    """Each row's prompt and plain greedy output by position, with room past the budget."""
    return reference_texts(prompts, outputs, 64)


def test_greedy_diffuspec_with_a_random_diffusion_lm_equals_plain_greedy(target, plain):
    vocab = target.config.vocab_size
    model = TableDiffusionLM(vocab, window=6)
    drafter = diffuspec(model, model.make_params(0, 3.0), window=6, refine_steps=2, adl_min=3)
    got, results = greedy(target, PROMPTS, MAX_NEW, drafter)
    assert got == plain
    for r in results:
        assert len(r.stats["accept_hist"]) == 6 + 2


def test_greedy_diffuspec_with_a_soft_oracle_equals_plain_greedy(target, plain):
    model = OracleDiffusionLM(target.config.vocab_size, true_logit=6.3, decoy_logit=6.0, wrong_slot=2)
    drafter = diffuspec(model, oracle_params(PROMPTS, plain), window=5, cps=False, adl=False)
    got, results = greedy(target, PROMPTS, MAX_NEW, drafter)
    assert got == plain
    # Every step accepts the two slots before the wrong one (the bonus makes 3), the last maybe fewer.
    for r in results:
        hist = r.stats["accept_hist"]
        assert hist[3] >= r.stats["steps"] - 1 and sum(hist[4:]) == 0, hist


@pytest.mark.parametrize(
    "window, adl, tokens_per_step",
    [(5, None, 6), (6, AdlSettings(3, 3), 4)],
    ids=["fixed-window", "adl-below-window"],
)
def test_an_oracle_drafter_gives_the_predicted_tau(target, plain, window, adl, tokens_per_step):
    assert all(len(o) == MAX_NEW for o in plain), "a row ended early: the prediction needs full rows"
    steps, rest = divmod(MAX_NEW - 1, tokens_per_step)  # the prefill token, then whole steps
    assert rest == 0
    proposer = DiffuSpecProposer(OracleDiffusionLM(target.config.vocab_size), window, adl=adl)
    drafter = DiffuSpecDrafter("oracle", DiffuSpecParams(oracle_params(PROMPTS, plain)), proposer)
    got, results = greedy(target, PROMPTS, MAX_NEW, drafter)
    assert got == plain
    for r in results:
        assert r.stats["steps"] == steps
        assert r.stats["tau"] == tokens_per_step
        assert r.stats["accept_hist"][tokens_per_step] == steps


def test_diffuspec_refuses_bad_settings():
    model = TableDiffusionLM(8, window=4)
    with pytest.raises(ValueError, match="refine steps must be in"):
        diffuspec(model, None, window=4, refine_steps=5)
    with pytest.raises(ValueError, match="exceeds the window"):
        DiffuSpecProposer(model, 4, adl=AdlSettings(2, 6))
    with pytest.raises(ValueError, match="verifies a chain"):
        diffuspec(model, None, window=4).with_tree_budget(8)


SETTINGS = {"t1": dict(temperature=1.0), "t0.7-top_p0.9": dict(temperature=0.7, top_p=0.9)}


@pytest.fixture(scope="module")
def toy():
    return make_toy()


def make_toy_drafter():
    """A random table diffusion LM over the toy vocabulary; CPS, ADL in [2, 3] over a window of 3 (a new
    proposer each call: a new trace of the sampling loop)."""
    model = TableDiffusionLM(VOCAB, window=3)
    return diffuspec(model, model.make_params(7, 2.0), window=3, adl_min=2)


@pytest.fixture(scope="module")
def toy_drafter():
    return make_toy_drafter()


@pytest.mark.parametrize("name", SETTINGS)
def test_diffuspec_sampling_is_lossless(toy, toy_drafter, name):
    observed, hist = sample_outcomes(toy, toy_drafter.proposer, SETTINGS[name], toy_drafter.params)
    exact = exact_joint(toy, lambda logits: target_probs(logits, **SETTINGS[name]))
    p_value, total_variation = compare(observed, exact)
    assert p_value > 1e-3 and total_variation < TV_BOUND, f"p={p_value:.3g} TV={total_variation:.4f}"
    steps = hist.sum()
    assert hist[2:].sum() > 0.1 * steps and hist[2] > 0.02 * steps, f"accept histogram {hist}"


def _accept_with_probability_then_resample(key, draft_tokens, target_logits, params):
    """WRONG: accepts each draft with probability p(draft) and at the first rejection emits a fresh sample
    of p (which can be the rejected draft again: the draft's token comes out too often)."""
    key_accept, key_next = split_keys(key)
    p = jnp.exp(target_log_probs(target_logits, params))  # [B, T + 1, V]
    safe = jnp.maximum(draft_tokens, 0)
    p_draft = jnp.take_along_axis(p[:, :-1], safe[..., None], axis=-1)[..., 0]
    p_draft = jnp.where(draft_tokens >= 0, p_draft, 0.0)  # markers are never accepted
    accept = uniform(key_accept, draft_tokens.shape) < p_draft
    num_accepted = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)
    return commit_tokens(draft_tokens, num_accepted, sample(key_next, target_logits, params))


def test_a_wrong_acceptance_rule_is_caught(toy, monkeypatch):
    settings = SETTINGS["t1"]
    monkeypatch.setattr(decode, "accept_delta", _accept_with_probability_then_resample)
    drafter = make_toy_drafter()
    observed, _ = sample_outcomes(toy, drafter.proposer, settings, drafter.params)
    p_value, total_variation = compare(observed, exact_joint(toy, lambda lg: target_probs(lg, **settings)))
    assert p_value < 1e-9, f"wrong rule passed: p={p_value:.3g} TV={total_variation:.4f}"


def test_diffuspec_after_a_shared_prefix_decodes_as_without_one(target):
    """Tokens and accepted lengths with a shared-prefix prefill equal those without sharing."""
    model = TableDiffusionLM(target.config.vocab_size, window=6)
    drafter = diffuspec(model, model.make_params(0, 3.0), window=6, adl_min=2)
    prefix = [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 30, 31, 32, 33, 34, 35, 36]
    prompts = [prefix + [5, 6], prefix + [11, 12, 13], prefix + [20]]
    runs = {}
    for mode in ("none", "auto"):
        results = generate_ids(
            target, prompts, max_new_tokens=20, sampling=SamplingParams.make(), row_seeds=[0, 1, 2],
            batch_size=3, drafter=drafter, shared_prefix=mode,
        )  # fmt: skip
        runs[mode] = [(r.tokens, r.stats["accept_hist"]) for r in results]
    assert runs["auto"] == runs["none"]


def test_prompt_observes_leave_adl_untouched_until_decoding_starts(target):
    """The two observes of a shared-prefix prefill (prefix, then the own part) are not verified
    chains: ADL's averages stay at k_max until `start_decoding`; the next observe then counts."""
    model = TableDiffusionLM(target.config.vocab_size, window=6)
    drafter = diffuspec(model, model.make_params(0, 3.0), window=6, adl_min=2)
    proposer, params = drafter.proposer, drafter.params
    state = proposer.init_state(1, 32, jnp.float32)
    observe = lambda state, tokens, start, count: proposer.observe(  # noqa: E731
        params, state, jnp.asarray([tokens]), (), start + jnp.arange(len(tokens))[None], jnp.asarray([count])
    )
    state = observe(observe(state, [7, 8], 0, 2), [9, 0], 2, 1)  # the own part: 1 token, 1 padding
    state = proposer.start_decoding(state)
    np.testing.assert_array_equal(state.adl.avg_gen, [6.0])
    np.testing.assert_array_equal(state.adl.avg_acc, [6.0])
    # A verified chain: the last token + 6 drafts, 1 accepted (count 2).
    state = observe(state, [9, 1, 2, 3, 4, 5, 6], 3, 2)
    np.testing.assert_array_equal(state.adl.avg_acc, [0.5 * 6.0 + 0.5 * 1.0])
