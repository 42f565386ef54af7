"""Invariants of the static-shape decode loop on a tiny target."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from sampling_definition import target_probs
from scipy import stats
from tiny_checkpoints import full_sequence_logits

import dflax
from dflax.decoding.decode import decode_loop, decode_step, prefill
from dflax.decoding.sampling import SamplingParams
from dflax.models.cache import KVCache
from dflax.runtime.static_batches import generate_ids

PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16, 17]]


@pytest.fixture(scope="module")
def target(tiny_checkpoint):
    return dflax.load_target(str(tiny_checkpoint("qwen3")[0]))


def run(target, prompts, max_new=12, sampling=None, seeds=None, batch_size=4):
    results = generate_ids(
        target,
        prompts,
        max_new_tokens=max_new,
        sampling=sampling or SamplingParams.make(),
        row_seeds=seeds or list(range(len(prompts))),
        batch_size=batch_size,
    )
    return [r.tokens for r in results], results


def test_while_loop_equals_step_by_step(target):
    b, p, max_new = 3, 8, 10
    tokens = np.zeros((b, p), np.int32)
    for r, ids in enumerate(PROMPTS):
        tokens[r, : len(ids)] = ids
    lens = jnp.asarray([len(x) for x in PROMPTS], jnp.int32)
    sampling = SamplingParams.make(temperature=0.8, top_p=0.9)

    def initial():
        cache = KVCache.init(target.config, b, 64, jnp.float32)
        keys = jax.vmap(jax.random.key)(jnp.arange(b, dtype=jnp.uint32))
        return prefill(
            target.module,
            target.params,
            jnp.asarray(tokens),
            lens,
            cache,
            jnp.full((b,), max_new),
            keys,
            jnp.asarray([2], jnp.int32),
            sampling,
            max_tokens=max_new,
        )

    looped = decode_loop(target.module, target.params, initial(), sampling)
    state = initial()
    step = jax.jit(lambda s: decode_step(target.module, target.params, s, sampling))
    n_steps = 0
    while not bool(jnp.all(state.done)):
        state = step(state)
        n_steps += 1
    assert n_steps == max_new - 1
    np.testing.assert_array_equal(state.num_generated, looped.num_generated)
    for r in range(b):
        n = int(looped.num_generated[r])
        np.testing.assert_array_equal(state.tokens[r, :n], looped.tokens[r, :n])
    np.testing.assert_array_equal(state.cache.lengths, looped.cache.lengths)
    np.testing.assert_array_equal(looped.cache.lengths, np.asarray(lens) + max_new - 1)


def test_sampling_is_deterministic_under_a_seed(target):
    sampling = SamplingParams.make(temperature=1.0)
    first, _ = run(target, PROMPTS, sampling=sampling, seeds=[1, 2, 3])
    again, _ = run(target, PROMPTS, sampling=sampling, seeds=[1, 2, 3])
    other, _ = run(target, PROMPTS, sampling=sampling, seeds=[4, 5, 6])
    assert first == again
    assert first != other
    # A row's output depends on its own seed only, not on its batch neighbours.
    alone, _ = run(target, PROMPTS[1:2], sampling=sampling, seeds=[2], batch_size=1)
    assert alone[0] == first[1]


def test_top_k_one_is_greedy(target):
    greedy, _ = run(target, PROMPTS)
    top1, _ = run(target, PROMPTS, sampling=SamplingParams.make(temperature=1.5, top_k=1))
    assert top1 == greedy


def test_eos_and_budget_end_rows(target):
    greedy, _ = run(target, PROMPTS, max_new=12)
    eos = greedy[0][4]  # the 5th token row 0 emits greedily
    with_eos = dataclasses.replace(target, config=dataclasses.replace(target.config, eos_token_ids=(eos,)))
    tokens, results = run(with_eos, PROMPTS, max_new=12)
    first = greedy[0].index(eos)
    assert tokens[0] == greedy[0][: first + 1]
    assert results[0].stats["finish_reason"] == "eos"
    for got, full in zip(tokens, greedy):  # every row stops at its own first EOS or its budget
        assert got == full[: full.index(eos) + 1] if eos in full else got == full
    budgets, _ = run(target, PROMPTS, max_new=3)
    assert budgets == [g[:3] for g in greedy]


def test_first_token_follows_the_target_distribution(target):
    """Chi-square of 4096 sampled first tokens against the target's top-k=6, T=0.7 distribution."""
    prompt = PROMPTS[2]
    sampling = SamplingParams.make(temperature=0.7, top_k=6)
    n_rows, rounds = 64, 64
    counts = np.zeros(target.config.vocab_size)
    for r in range(rounds):
        tokens, _ = run(
            target,
            [prompt] * n_rows,
            max_new=1,
            sampling=sampling,
            seeds=list(range(r * n_rows, (r + 1) * n_rows)),
            batch_size=n_rows,
        )
        np.add.at(counts, [t[0] for t in tokens], 1)
    probs = target_probs(full_sequence_logits(target, prompt)[-1], temperature=0.7, top_k=6)
    support = probs > 0
    assert support.sum() == 6 and counts[~support].sum() == 0
    expected = probs[support] / probs[support].sum() * counts.sum()
    pvalue = stats.chisquare(counts[support], expected).pvalue
    assert pvalue > 1e-3, (counts[support], probs[support])


def test_bf16_cache_under_fp32_target(tiny_checkpoint):
    """cache_dtype='bfloat16' keeps the KV cache in bf16 under an fp32 target and still decodes greedily
    like the fp32 cache on a tiny model (no near-ties at this size and seed)."""
    path = str(tiny_checkpoint("qwen3")[0])
    fp32, bf16 = dflax.load_target(path), dflax.load_target(path, cache_dtype="bfloat16")
    assert bf16.cache_dtype == jnp.bfloat16 and bf16.dtype == jnp.float32
    want, _ = run(fp32, PROMPTS, max_new=6)
    got, _ = run(bf16, PROMPTS, max_new=6)
    assert got == want
    with pytest.raises(ValueError, match="cache_dtype"):
        dflax.load_target(path, cache_dtype="int8")
