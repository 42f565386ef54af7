"""Prompt lookup: its matching equals a plain Python reference, and decoding with it is lossless.

- `latest_match` / `lookup_drafts` against a Python loop over random histories of a 3-token vocabulary
  (so every n-gram size matches somewhere, and sometimes none does).
- Greedy decoding with lookup equals plain greedy decoding token for token (tiny target; the real
  SmolLM2 on short prompts), and a mixed-length batch equals each prompt alone.
- Sampling: on the toy target of `toy_target` the output distribution is the target's at T=1 and at
  T=0.7 / top-p 0.9 (chi-square; the same check catches wrong rules in tests/decoding/test_tree.py and
  test_decode_sampling.py).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from sampling_definition import target_probs
from toy_target import TV_BOUND, compare, exact_joint, make_toy, sample_outcomes

import dflax
from dflax.decoding.sampling import SamplingParams
from dflax.drafters.lookup import PromptLookupProposer, latest_match, lookup_drafts
from dflax.generation import generate_ids

# Prompts with repeats, so lookup finds matches in the prompt as well as in the output.
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [11, 12], [20, 21, 22, 20, 21, 22, 23, 20, 21], [40]]


def reference_match(sequence: list[int]) -> int:
    """The token index after the most recent earlier occurrence of the last 3, 2 or 1 tokens, or -1."""
    n = len(sequence)
    for g in (3, 2, 1):
        if n < g + 1:
            continue
        tail = sequence[n - g :]
        for j in range(n - g - 1, -1, -1):
            if sequence[j : j + g] == tail:
                return j + g
    return -1


def reference_drafts(sequence: list[int], k: int) -> list[int]:
    start = reference_match(sequence)
    if start < 0:
        return [sequence[-1]] * k
    known = sequence[start:]
    return [known[i % len(known)] for i in range(k)]


def test_matching_equals_a_python_reference():
    rng = np.random.default_rng(0)
    rows, slots, k = 256, 24, 5
    sequence = rng.integers(0, 3, (rows, slots)).astype(np.int32)
    lengths = rng.integers(1, slots + 1, rows).astype(np.int32)
    starts = np.asarray(latest_match(jnp.asarray(sequence), jnp.asarray(lengths)))
    drafts = np.asarray(lookup_drafts(jnp.asarray(sequence), jnp.asarray(lengths), k))
    for r in range(rows):
        row = sequence[r, : lengths[r]].tolist()
        assert starts[r] == reference_match(row), (row, starts[r])
        assert drafts[r].tolist() == reference_drafts(row, k), (row, drafts[r])
    assert (starts == -1).any() and (starts >= 0).mean() > 0.5  # both cases are exercised


@pytest.fixture(scope="module")
def target(tiny_checkpoint):
    return dflax.load_target(str(tiny_checkpoint("qwen3")[0]))


def greedy(target, prompts, max_new, drafter=None, batch_size=4):
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


@pytest.mark.parametrize("block_size", [4, 8])
def test_lookup_greedy_equals_plain_greedy(target, block_size):
    expected, _ = greedy(target, PROMPTS, 40)
    got, results = greedy(target, PROMPTS, 40, dflax.prompt_lookup(block_size))
    assert got == expected
    # A random tiny model repeats itself, so copied drafts are accepted: the test covers accepted drafts.
    assert max(r.stats["tau"] for r in results) > 1.5
    for r in results:
        assert len(r.stats["accept_hist"]) == block_size + 1


def test_lookup_mixed_batch_equals_each_prompt_alone(target):
    lookup = dflax.prompt_lookup(6)
    batched, _ = greedy(target, PROMPTS, 30, lookup, batch_size=4)
    for prompt, got in zip(PROMPTS, batched):
        assert greedy(target, [prompt], 30, lookup, batch_size=1)[0] == [got]


def test_prompt_lookup_refuses_a_block_without_drafts():
    with pytest.raises(ValueError, match="block size must be >= 2"):
        dflax.prompt_lookup(1)


@pytest.mark.slow
def test_smollm2_lookup_is_lossless(smollm2):
    tok = smollm2.tokenizer
    prompts = [
        tok.encode("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return"),
        tok.encode_chat([{"role": "user", "content": "Count from 1 to 10."}]),
    ]
    expected, _ = greedy(smollm2, prompts, 32, batch_size=2)
    got, results = greedy(smollm2, prompts, 32, dflax.prompt_lookup(6), batch_size=2)
    assert got == expected
    assert max(r.stats["tau"] for r in results) > 1.2


SETTINGS = {"t1": dict(temperature=1.0), "t0.7-top_p0.9": dict(temperature=0.7, top_p=0.9)}


@pytest.mark.parametrize("name", SETTINGS)
def test_lookup_sampling_is_lossless(name):
    toy = make_toy()
    observed, hist = sample_outcomes(toy, PromptLookupProposer(2), SETTINGS[name])
    exact = exact_joint(toy, lambda logits: target_probs(logits, **SETTINGS[name]))
    p_value, total_variation = compare(observed, exact)
    assert p_value > 1e-3 and total_variation < TV_BOUND, f"p={p_value:.3g} TV={total_variation:.4f}"
    # Copied drafts are accepted often enough that every commit length carries the test.
    steps = hist.sum()
    assert hist[2:].sum() > 0.1 * steps and hist[1:].min() > 0.02 * steps, f"accept histogram {hist}"
