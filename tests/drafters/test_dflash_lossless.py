"""DFlash speculative decoding is lossless: greedy output equals plain greedy output token for token.

Cases: an untrained drafter (tau near 1), an oracle drafter that proposes the target's own greedy future
(tau == B while tokens remain), mixed-length batches vs each prompt alone, and the real SmolLM2.
A difference is accepted only at a recorded near-tie of the target's top-2 logits.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from greedy_decoding import greedy

import dflax
from dflax.decoding.sampling import SamplingParams
from dflax.divergence import first_differences
from dflax.drafters import load_drafter
from dflax.models.cache import KVCache

# Top-2 logit gap below which a greedy divergence is a numerical tie, by the target's dtype. bf16: a few
# ulps (2^-7 relative) of logits of magnitude 1 to 4, where a block and a single token round differently.
NEAR_TIE = {"float32": 1e-4, "bfloat16": 3e-2}
PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30], [40]]


@pytest.fixture(scope="module")
def target(tiny_checkpoint):
    return dflax.load_target(str(tiny_checkpoint("qwen3")[0]))


def assert_same_or_near_tie(target, prompt, expected, got):
    """Token-identical, or the first difference sits at a recorded near-tie of the target's logits."""
    differences = first_differences(target, [prompt], [expected], [got])
    if not differences:
        return
    i, gap = differences[0]["position"], differences[0]["top2_gap"]
    tie = NEAR_TIE[jnp.dtype(target.dtype).name]
    assert gap < tie, f"outputs differ at token {i} where the target's top-2 gap is {gap:.3g} (tie < {tie})"
    print(f"recorded near-tie: token {i}, top-2 gap {gap:.3g}")


@dataclasses.dataclass(frozen=True, eq=False)
class OracleProposer:
    """Proposes the target's own greedy continuation, read from a table passed as its parameters."""

    num_draft: int
    tap_layers: tuple[int, ...] = ()

    def init_state(self, batch, slots, dtype):
        return None

    def observe(self, params, drafter_state, tokens, taps, positions, count):
        return None

    def propose(self, params, target_params, state, keys):
        index = state.num_generated[:, None] + jnp.arange(self.num_draft)  # next tokens to come
        return jnp.take_along_axis(params, index, axis=1), None


@dataclasses.dataclass(frozen=True, eq=False)
class OracleDrafter:
    params: jax.Array
    proposer: OracleProposer


@pytest.mark.parametrize("block_size", [8, 16])
def test_untrained_drafter_is_lossless(target, block_size):
    drafter = load_drafter("untrained", target, block_size=block_size)
    expected, _ = greedy(target, PROMPTS, 40)
    got, results = greedy(target, PROMPTS, 40, drafter)
    for prompt, e, g in zip(PROMPTS, expected, got):
        assert_same_or_near_tie(target, prompt, e, g)
    for r in results:
        assert 1.0 <= r.stats["tau"] < 1.5  # a random drafter is almost never right
        assert len(r.stats["accept_hist"]) == block_size + 1


@pytest.mark.parametrize("block_size", [8, 16])
def test_oracle_drafter_commits_whole_blocks(target, block_size):
    max_new = 4 * block_size + 1  # first token from prefill + exactly 4 full blocks
    oracle, expected = oracle_for(target, PROMPTS, max_new, block_size)
    got, results = greedy(target, PROMPTS, max_new, oracle)
    assert got == expected
    for r in results:
        assert r.stats["steps"] == 4
        assert r.stats["tau"] == block_size
        assert r.stats["accept_hist"][block_size] == 4


def oracle_for(target, prompts, max_new, block_size):
    """An oracle drafter for the prompts' plain greedy outputs (also returned)."""
    expected, _ = greedy(target, prompts, max_new)
    table = np.zeros((len(prompts), max_new + block_size), np.int32)
    for r, e in enumerate(expected):
        table[r, : len(e)] = e
    return OracleDrafter(jnp.asarray(table), OracleProposer(block_size - 1)), expected


def test_eos_and_budget_inside_an_accepted_block(target):
    """A whole block is accepted, but the row ends at an EOS or at its budget in its middle: nothing after
    it is emitted, and finish_reason says which."""
    block_size, max_new = 8, 17  # the prefill token, then two blocks of 8
    oracle, expected = oracle_for(target, PROMPTS, max_new, block_size)
    # The EOS: a token some row first emits at index 3..7, inside the first block (indices 1..8).
    row, index = next((r, i) for r, e in enumerate(expected) for i in range(3, 8) if e[i] not in e[:i])
    eos = expected[row][index]
    with_eos = dataclasses.replace(target, config=dataclasses.replace(target.config, eos_token_ids=(eos,)))
    got, results = greedy(with_eos, PROMPTS, max_new, oracle)
    assert got[row] == expected[row][: index + 1]
    assert results[row].stats["steps"] == 1 and results[row].stats["accept_hist"][block_size] == 1
    for e, g, r in zip(expected, got, results):
        stop = e.index(eos) + 1 if eos in e else len(e)
        assert g == e[:stop]
        assert r.stats["finish_reason"] == ("eos" if eos in e else "length")
    budget = 5  # ends inside the first accepted block
    got, results = greedy(target, PROMPTS, budget, oracle)
    assert got == [e[:budget] for e in expected]
    for r in results:
        assert r.stats["finish_reason"] == "length" and r.stats["new_tokens"] == budget
        assert r.stats["steps"] == 1 and r.stats["accept_hist"][block_size] == 1


@pytest.mark.parametrize("drafter_kind", ["untrained", "oracle"])
def test_gemma3_sliding_window_under_dflash(tiny_checkpoint, drafter_kind):
    """Gemma 3 with a window of 8, far shorter than prompt + 40 new tokens: verify blocks and whole
    accepted blocks cross the window edge, and the output is still plain greedy decoding's."""
    gemma = dflax.load_target(str(tiny_checkpoint("gemma3")[0]))
    assert gemma.config.sliding_window == 8
    max_new, block_size = 40, 8
    if drafter_kind == "oracle":
        drafter, expected = oracle_for(gemma, PROMPTS, max_new, block_size)
    else:
        drafter = load_drafter("untrained", gemma, block_size=block_size)
        expected, _ = greedy(gemma, PROMPTS, max_new)
    got, results = greedy(gemma, PROMPTS, max_new, drafter)
    for prompt, e, g in zip(PROMPTS, expected, got):
        assert_same_or_near_tie(gemma, prompt, e, g)
    if drafter_kind == "oracle":
        assert all(r.stats["tau"] > 4 for r in results)


@pytest.mark.parametrize("arch, drafter_kind", [("qwen3", "untrained"), ("gemma3", "oracle")])
def test_bf16_target_is_lossless(tiny_checkpoint, arch, drafter_kind):
    """bfloat16, the default on TPU and GPU: speculative greedy output is plain greedy output, except at
    recorded near-ties (blocks and single tokens round differently in bf16)."""
    bf16 = dflax.load_target(str(tiny_checkpoint(arch)[0]), dtype="bfloat16")
    max_new, block_size = 32, 8
    if drafter_kind == "oracle":
        drafter, expected = oracle_for(bf16, PROMPTS, max_new, block_size)
    else:
        drafter = load_drafter("untrained", bf16, block_size=block_size)
        expected, _ = greedy(bf16, PROMPTS, max_new)
    got, _ = greedy(bf16, PROMPTS, max_new, drafter)
    for prompt, e, g in zip(PROMPTS, expected, got):
        assert_same_or_near_tie(bf16, prompt, e, g)


def test_plain_decoding_has_tau_one(target):
    _, results = greedy(target, PROMPTS, 12)
    for r in results:
        assert r.stats["tau"] == 1.0 and r.stats["steps"] == 11


def test_mixed_batch_equals_each_prompt_alone(target):
    drafter = load_drafter("untrained", target, block_size=8)
    batched, _ = greedy(target, PROMPTS, 30, drafter, batch_size=4)
    for prompt, got in zip(PROMPTS, batched):
        alone, _ = greedy(target, [prompt], 30, drafter, batch_size=1)
        assert_same_or_near_tie(target, prompt, alone[0], got)


def test_drafter_context_cache_tracks_committed_tokens(target):
    """After generation the drafter's context length equals the target's committed length."""
    from dflax.decoding.decode import decode_loop, prefill

    drafter = load_drafter("untrained", target, block_size=8)
    proposer = drafter.proposer
    tokens = np.zeros((2, 16), np.int32)
    tokens[0, :5], tokens[1, :2] = PROMPTS[0], PROMPTS[1]
    lens = jnp.asarray([5, 2], jnp.int32)
    cache = KVCache.init(target.config, 2, 64, jnp.float32)
    keys = jax.vmap(jax.random.key)(jnp.arange(2, dtype=jnp.uint32))
    sampling = SamplingParams.make()
    state = prefill(
        target.module,
        target.params,
        jnp.asarray(tokens),
        lens,
        cache,
        jnp.asarray([20, 13]),
        keys,
        jnp.asarray([-1], jnp.int32),
        sampling,
        drafter.params,
        max_tokens=20,
        proposer=proposer,
    )
    np.testing.assert_array_equal(state.drafter_state.lengths, lens)
    state = decode_loop(target.module, target.params, state, sampling, drafter.params, proposer)
    np.testing.assert_array_equal(state.drafter_state.lengths, state.cache.lengths)
    np.testing.assert_array_equal(state.num_generated, [20, 13])


@pytest.mark.slow
def test_smollm2_untrained_drafter_is_lossless(smollm2):
    tok = smollm2.tokenizer
    prompts = [
        tok.encode("def add(a, b):\n    return"),
        tok.encode_chat([{"role": "user", "content": "Say hello in French."}]),
    ]
    drafter = load_drafter("untrained", smollm2, block_size=8)
    expected, _ = greedy(smollm2, prompts, 24, batch_size=2)
    got, _ = greedy(smollm2, prompts, 24, drafter, batch_size=2)
    for prompt, e, g in zip(prompts, expected, got):
        assert_same_or_near_tie(smollm2, prompt, e, g)
