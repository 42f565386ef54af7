"""Prompt lookup: its matching equals a plain Python reference, and decoding with it is lossless.

- `match_starts` / `lookup_drafts` / `lookup_tree` against a Python loop over random histories of a
  3-token vocabulary (so every n-gram size matches somewhere, and sometimes none does).
- Greedy decoding with lookup equals plain greedy decoding token for token (tiny target; the real
  SmolLM2 on short prompts), and a mixed-length batch equals each prompt alone.
- Sampling: on the toy target of `toy_target` the output distribution is the target's at T=1 and at
  T=0.7 / top-p 0.9 (chi-square; the same check catches wrong rules in tests/decoding/test_tree.py and
  test_decode_sampling.py).
"""

from __future__ import annotations

from types import SimpleNamespace

import jax.numpy as jnp
import numpy as np
import pytest
from greedy_decoding import greedy
from sampling_definition import target_probs
from toy_target import TV_BOUND, compare, exact_joint, make_toy, sample_outcomes

import dflax
from dflax.decoding.tree import ancestor_mask, depths, with_root
from dflax.drafters.lookup import (
    History,
    PromptLookupProposer,
    lookup_drafts,
    lookup_tree,
    match_lengths,
    match_starts,
)

# Prompts with repeats, so lookup finds matches in the prompt as well as in the output.
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [11, 12], [20, 21, 22, 20, 21, 22, 23, 20, 21], [40]]


def reference_starts(sequence: list[int], num: int) -> list[int]:
    """Continuation starts of the earlier occurrences of the last 3, 2 or 1 tokens: each start once with its
    longest n, longest first, then most recent; -1 pads to `num`."""
    n, found = len(sequence), {}
    for g in (1, 2, 3):
        tail = sequence[n - g :] if n >= g else None
        for c in range(g, n):  # the occurrence sequence[c - g:c] ends before the last token
            if tail is not None and sequence[c - g : c] == tail:
                found[c] = g
    ranked = sorted(found, key=lambda c: (found[c], c), reverse=True)[:num]
    return ranked + [-1] * (num - len(ranked))


def reference_chain(sequence: list[int], start: int, k: int) -> list[int]:
    if start < 0:
        return [sequence[-1]] * k
    known = sequence[start:]
    return [known[i % len(known)] for i in range(k)]


def random_histories(rows=256, slots=24, vocab=3, seed=0):
    rng = np.random.default_rng(seed)
    sequence = rng.integers(0, vocab, (rows, slots)).astype(np.int32)
    lengths = rng.integers(1, slots + 1, rows).astype(np.int32)
    return sequence, lengths


def test_matching_equals_a_python_reference():
    sequence, lengths = random_histories()
    k, m = 5, 4
    starts = np.asarray(match_starts(jnp.asarray(sequence), jnp.asarray(lengths), m))
    drafts = np.asarray(lookup_drafts(jnp.asarray(sequence), jnp.asarray(lengths), k))
    for r in range(len(sequence)):
        row = sequence[r, : lengths[r]].tolist()
        assert starts[r].tolist() == reference_starts(row, m), row
        assert drafts[r].tolist() == reference_chain(row, reference_starts(row, 1)[0], k), row
    assert (starts[:, 0] == -1).any() and (starts[:, -1] >= 0).mean() > 0.3  # both cases are exercised


@pytest.mark.parametrize("depth, nodes", [(4, 16), (3, 10)])
def test_lookup_tree_holds_every_occurrence_continuation(depth, nodes):
    """Walking down the tree by a branch's tokens (first matching child, as verification does) reaches
    the branch's last node for every branch inside the budget."""
    sequence, lengths = random_histories(rows=64, seed=1)
    tree = lookup_tree(jnp.asarray(sequence), jnp.asarray(lengths), depth, nodes)
    tokens, parents = (np.asarray(x) for x in with_root(tree, jnp.zeros(len(sequence), jnp.int32)))
    node_depths = np.asarray(depths(ancestor_mask(jnp.asarray(parents))))
    for r in range(len(sequence)):
        row = sequence[r, : lengths[r]].tolist()
        starts = reference_starts(row, -(-nodes // depth))
        starts = [s if s >= 0 else starts[0] for s in starts]
        assert all(parents[r, i] < i for i in range(1, nodes + 1))
        assert all(node_depths[r, i] == (i - 1) % depth + 1 for i in range(1, nodes + 1))
        for b, start in enumerate(starts):
            chain = reference_chain(row, start, depth)[: min(depth, nodes - b * depth)]
            node = 0
            for token in chain:
                children = [c for c in range(1, nodes + 1) if parents[r, c] == node and tokens[r, c] == token]
                assert children, (row, b, chain)
                node = children[0]
            assert node_depths[r, node] == len(chain)


@pytest.fixture(scope="module")
def target(tiny_checkpoint):
    return dflax.load_target(str(tiny_checkpoint("qwen3")[0]))


@pytest.mark.parametrize("block_size, tree_budget, min_match", [(4, 0, 0), (8, 0, 2), (4, 9, 2), (8, 0, 3)])
def test_lookup_greedy_equals_plain_greedy(target, block_size, tree_budget, min_match):
    expected, _ = greedy(target, PROMPTS, 40)
    got, results = greedy(target, PROMPTS, 40, dflax.prompt_lookup(block_size, tree_budget, min_match))
    assert got == expected
    # A random tiny model repeats itself, so copied drafts are accepted: the test covers accepted drafts.
    assert max(r.stats["tau"] for r in results) > 1.5
    for r in results:
        assert len(r.stats["accept_hist"]) == (tree_budget or block_size - 1) + 2


def test_lookup_mixed_batch_equals_each_prompt_alone(target):
    lookup = dflax.prompt_lookup(6)
    batched, _ = greedy(target, PROMPTS, 30, lookup, batch_size=4)
    for prompt, got in zip(PROMPTS, batched):
        assert greedy(target, [prompt], 30, lookup, batch_size=1)[0] == [got]


def test_a_step_verifies_drafts_only_after_a_match_of_min_match_tokens():
    history = jnp.asarray([[5, 6, 7, 9, 5, 6, 0, 0], [1, 2, 3, 4, 3, 0, 0, 0]], jnp.int32)
    last = jnp.asarray([7, 8], jnp.int32)  # row 0 ends "5 6 7" (seen at 0..2), row 1 ends "3 8" (8 unseen)
    cache = SimpleNamespace(positions=jnp.asarray([6, 5], jnp.int32))  # what the proposer reads
    state = SimpleNamespace(cache=cache, last_token=last, drafter_state=History(history))
    worth = lambda m: np.asarray(PromptLookupProposer(4, min_match=m).worth_verifying(None, state))
    np.testing.assert_array_equal(worth(0), [True, True])
    np.testing.assert_array_equal(worth(1), [True, False])
    np.testing.assert_array_equal(worth(3), [True, False])
    np.testing.assert_array_equal(
        match_lengths(jnp.asarray([[5, 6, 7, 9, 5, 6, 7, 0]]), jnp.asarray([7]))[0], [0, 0, 0, 3, 0, 0, 0, 0]
    )


def test_prompt_lookup_refuses_bad_settings():
    with pytest.raises(ValueError, match="block size must be >= 2"):
        dflax.prompt_lookup(1)
    with pytest.raises(ValueError, match="tree budget must be >= 0"):
        dflax.prompt_lookup(4, -1)
    with pytest.raises(ValueError, match="min_match must be 0"):
        dflax.prompt_lookup(4, 0, 4)


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


@pytest.mark.parametrize("tree_budget", [0, 4], ids=["chain", "tree"])
@pytest.mark.parametrize("name", SETTINGS)
def test_lookup_sampling_is_lossless(name, tree_budget):
    toy = make_toy()
    observed, hist = sample_outcomes(toy, PromptLookupProposer(3, tree_budget), SETTINGS[name])
    exact = exact_joint(toy, lambda logits: target_probs(logits, **SETTINGS[name]))
    p_value, total_variation = compare(observed, exact)
    assert p_value > 1e-3 and total_variation < TV_BOUND, f"p={p_value:.3g} TV={total_variation:.4f}"
    # Copied drafts are accepted often enough that every commit length carries the test.
    steps = hist.sum()
    reachable = hist[1 : 3 + 1]  # 1 .. depth + 1 tokens per step; a tree's hist is longer (N + 2)
    assert hist[2:].sum() > 0.1 * steps and reachable.min() > 0.02 * steps, f"accept histogram {hist}"
