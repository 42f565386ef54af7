"""DFlash 2 drafters in the decode loop (dflax.drafters.dflash2_proposer) are lossless.

Greedy: a random DFlash 2 drafter written in the official layout and loaded by `load_drafter` decodes
exactly what the target decodes alone (one row, and a ragged batch of three rows at different positions).
Sampling: on the toy target (tests/toy_target.py, 6 tokens, so q covers much of the target's mass and
drafts are often accepted) drafts drawn through the candidate selector and verified by block verification
with the selector's q rows give the target's own distribution of 4-token continuations (chi-square), while
two wrong q's are caught by the same test: q from the unary logits alone (the selector's pairwise term
ignored) and q at another temperature than the drafts were drawn at.
"""

from __future__ import annotations

import dataclasses

import jax
import pytest
from sampling_definition import target_probs
from toy_target import TV_BOUND, compare, exact_joint, make_toy, sample_outcomes

import dflax
from dflax.decoding.sampling import SamplingParams
from dflax.drafters import DraftSampling, load_drafter
from dflax.drafters.dflash import DFlashConfig
from dflax.drafters.dflash2 import DFlash2Config, DFlash2Drafter, init_dflash2_params, scale_logits
from dflax.drafters.dflash2_checkpoint import save_dflash2_drafter
from dflax.drafters.dflash2_proposer import DFlash2Proposer, scatter_log_q
from dflax.runtime.static_batches import generate_ids

SLIDE, FULL = "sliding_attention", "full_attention"
TARGET_T = 1.0


def random_drafter(
    target_config, block_size: int, top_k: int, seed: int = 0, multiplier: float = 0.8, codebook: float = 1.0
) -> tuple[DFlash2Config, dict]:
    """A DFlash 2 drafter for the target with every weight random (codebooks perturbed by `codebook`
    standard deviations, large enough that the selector's pairwise term reorders the candidates; the draft
    logits scaled by `multiplier`)."""
    base = DFlashConfig.for_target(
        target_config, num_layers=2, block_size=block_size, mask_token_id=target_config.vocab_size - 1
    )
    config = DFlash2Config(
        base=base,
        conv_kernel_size=2,
        conv_group_size=16,
        selector_rank=8,
        selector_top_k=top_k,
        layer_types=(SLIDE, FULL),
        sliding_window=3,
        output_multiplier=multiplier,
        final_logit_softcapping=4.0,
    )
    params = init_dflash2_params(DFlash2Drafter(config), seed)
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    keys = jax.random.split(jax.random.key(seed + 1), len(flat))
    leaves = []
    for (path, x), key in zip(flat, keys):
        scale = codebook if "codebook" in jax.tree_util.keystr(path) else 0.2
        leaves.append(x + scale * jax.random.normal(key, x.shape, x.dtype))
    return config, jax.tree.unflatten(jax.tree.structure(params), leaves)


# --- greedy: speculative output == the target's own ---------------------------------------------------


@pytest.fixture(scope="module")
def target(tiny_checkpoint):
    return dflax.load_target(str(tiny_checkpoint("qwen3")[0]))


@pytest.fixture(scope="module")
def drafter_dir(target, tmp_path_factory):
    path = tmp_path_factory.mktemp("dflash2")
    config, params = random_drafter(target.config, block_size=5, top_k=8)
    save_dflash2_drafter(path, config, params, target.config.num_layers)
    return path


@pytest.mark.parametrize(
    "prompts", [[[5, 9, 13, 2]], [[5, 9, 13, 2], [7, 3], [11, 12, 13, 14, 15, 16, 17]]], ids=["one", "ragged"]
)
def test_greedy_speculative_output_is_the_targets(target, drafter_dir, prompts):
    drafter = load_drafter(drafter_dir, target)
    assert isinstance(drafter.proposer, DFlash2Proposer) and drafter.proposer.block_size == 5
    greedy = SamplingParams.make(0.0)
    kwargs = dict(max_new_tokens=12, sampling=greedy, row_seeds=list(range(len(prompts))), batch_size=3)
    alone = generate_ids(target, prompts, **kwargs)
    drafted = generate_ids(target, prompts, drafter=drafter, **kwargs)
    assert [r.tokens for r in drafted] == [r.tokens for r in alone]


def test_trees_and_other_targets_are_refused(target, drafter_dir, tiny_checkpoint):
    drafter = load_drafter(drafter_dir, target)
    with pytest.raises(ValueError, match="chains only"):
        drafter.with_tree_budget(4)
    other = dflax.load_target(str(tiny_checkpoint("smollm2-like")[0]))  # another width
    with pytest.raises(ValueError, match="DFlash 2 drafter was not built for this target"):
        load_drafter(drafter_dir, other)


# --- sampling: the output distribution is the target's, and wrong q's are caught -----------------------


@dataclasses.dataclass(frozen=True, eq=False)
class WrongQ(DFlash2Proposer):
    """The same drafts, sent with a WRONG q: "unary" = softmax of the top-M logits alone (no pairwise
    term), "temperature" = the selector's scores at half the temperature the drafts were drawn at."""

    wrong: str = "unary"

    def propose(self, params, target_params, state, keys):
        drafts, log_q = super().propose(params, target_params, state, keys)
        if self.wrong == "temperature":
            return drafts, jax.nn.log_softmax(2.0 * log_q, axis=-1)
        hidden = self.draft_hidden(
            params, target_params, state.last_token, state.cache.positions, state.drafter_state
        )[:, 1:]
        logits = scale_logits(self.module.config, self.raw_logits(target_params, hidden))
        unary, candidates = jax.lax.top_k(logits, self.module.config.selector_top_k)
        q = jax.nn.softmax(unary / self.draft_sampling.temperature, axis=-1)
        return drafts, scatter_log_q(candidates, q, logits.shape[-1])


@pytest.fixture(scope="module")
def toy_run():
    """run(wrong) -> (p-value, total variation, accept histogram) of sampled continuations on the toy."""
    toy = make_toy()
    # flat unary logits and a moderate pairwise term: q spreads over the candidates, so drafts are often
    # kept, yet the pairwise term moves q far enough for the unary-only q to be caught
    config, params = random_drafter(toy.config, block_size=4, top_k=6, seed=3, multiplier=0.1, codebook=0.4)
    settings = dict(temperature=TARGET_T)
    exact = exact_joint(toy, lambda logits: target_probs(logits, **settings))
    sampling = DraftSampling("sample", TARGET_T)

    def run(wrong: str | None):
        module = DFlash2Drafter(config)
        proposer = (
            DFlash2Proposer(module, toy.module, 4, sampling)
            if wrong is None
            else WrongQ(module, toy.module, 4, sampling, wrong=wrong)
        )
        observed, hist = sample_outcomes(toy, proposer, settings, params)
        return (*compare(observed, exact), hist)

    return run


def test_sampled_drafts_are_lossless(toy_run):
    p_value, total_variation, hist = toy_run(None)
    assert p_value > 1e-3 and total_variation < TV_BOUND, f"p={p_value:.3g} TV={total_variation:.4f}"
    steps = hist.sum()
    # drafts are often kept (at least one in about 46% of steps, all three in about 14%), and every commit
    # length occurs: the accept, residual and bonus paths all carry the test
    assert hist[2:].sum() > 0.35 * steps and hist[-1] > 0.08 * steps, f"accept histogram {hist}"
    assert hist[1:].min() > 0.02 * steps, f"accept histogram {hist}"


@pytest.mark.parametrize("wrong", ["unary", "temperature"])
def test_wrong_q_is_caught(toy_run, wrong):
    p_value, total_variation, _ = toy_run(wrong)
    assert p_value < 1e-9, f"wrong q ({wrong}) passed: p={p_value:.3g} TV={total_variation:.4f}"
