"""Best-first trees over DFlash's block: the builder picks the N best paths, and decoding is lossless.

- `best_first_tree` equals a brute force over every path (sum of log-probabilities, best N), with parents
  before children and ties avoided by random scores.
- Greedy decoding with an untrained DFlash drafter's trees equals plain greedy decoding token for token, in a
  mixed-length batch and prompt by prompt, through `dflax.generate(..., tree_budget=)` too.
- Trees with sampled drafts are refused with the fix named.
(Tree verification itself: tests/decoding/test_tree.py; tree sampling by chi-square is shown there.)
"""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np
import pytest
from greedy_decoding import greedy

import dflax
from dflax.decoding.tree import ancestor_mask, depths, with_root
from dflax.drafters import DraftSampling, load_drafter
from dflax.drafters.best_first import best_first_tree

PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30], [40]]


@pytest.mark.parametrize("positions, candidates, budget", [(3, 3, 10), (4, 2, 15), (2, 4, 20), (5, 1, 5)])
def test_best_first_tree_holds_the_best_paths(positions, candidates, budget):
    rng = np.random.default_rng(positions * 10 + candidates)
    rows = 3
    raw = rng.normal(size=(rows, positions, candidates))
    log_probs = -np.sort(-(raw - np.log(np.exp(raw).sum(-1, keepdims=True) + 1.0)), axis=-1)
    token_ids = rng.permutation(100)[: positions * candidates].reshape(positions, candidates)
    token_ids = np.broadcast_to(token_ids, (rows, positions, candidates)).astype(np.int32)
    tree = best_first_tree(jnp.asarray(log_probs, jnp.float32), jnp.asarray(token_ids), budget)
    tokens, parents = with_root(tree, jnp.zeros((rows,), jnp.int32))
    node_depths = np.asarray(depths(ancestor_mask(parents)))
    parents, tokens = np.asarray(parents), np.asarray(tokens)
    for r in range(rows):
        # Every path (r_1..r_d) of rank choices, scored; the best `budget` of them.
        paths = [p for d in range(1, positions + 1) for p in itertools.product(range(candidates), repeat=d)]
        score = {p: sum(log_probs[r, j, c] for j, c in enumerate(p)) for p in paths}
        best = sorted(paths, key=lambda p: -score[p])[:budget]
        # The tree's nodes as rank paths: follow parents to the root (tokens are unique per position).
        built = []
        for node in range(1, budget + 1):
            path, at = [], node
            while at:
                d = node_depths[r, at]
                path.append(int(np.flatnonzero(token_ids[r, d - 1] == tokens[r, at])[0]))
                assert parents[r, at] < at
                at = parents[r, at]
            built.append(tuple(reversed(path)))
        assert sorted(built) == sorted(best)


@pytest.fixture(scope="module")
def target(tiny_checkpoint):
    return dflax.load_target(str(tiny_checkpoint("qwen3")[0]))


@pytest.mark.parametrize("block_size, budget", [(8, 8), (8, 24)])
def test_untrained_tree_is_lossless(target, block_size, budget):
    drafter = load_drafter("untrained", target, block_size=block_size).with_tree_budget(budget)
    expected, _ = greedy(target, PROMPTS, 40)
    got, results = greedy(target, PROMPTS, 40, drafter)
    assert got == expected
    for r in results:
        assert r.stats["tau"] >= 1.0 and len(r.stats["accept_hist"]) == budget + 2


def test_tree_mixed_batch_equals_each_prompt_alone(target):
    drafter = load_drafter("untrained", target, block_size=8).with_tree_budget(12)
    batched, _ = greedy(target, PROMPTS, 30, drafter, batch_size=4)
    for prompt, got in zip(PROMPTS, batched):
        assert greedy(target, [prompt], 30, drafter, batch_size=1)[0] == [got]


def test_generate_takes_a_tree_budget(target):
    drafter = load_drafter("untrained", target, block_size=4)
    prompts = ["w5 w6 w7", "w9"]
    plain = dflax.generate(target, prompts, max_new_tokens=12)
    trees = dflax.generate(target, prompts, max_new_tokens=12, drafter=drafter, tree_budget=6)
    assert [r.tokens for r in trees] == [r.tokens for r in plain]
    assert all(len(r.stats["accept_hist"]) == 6 + 2 for r in trees)
    with pytest.raises(ValueError, match="tree_budget and block_size need a drafter"):
        dflax.generate(target, prompts, max_new_tokens=4, tree_budget=6)


def test_trees_with_sampled_drafts_are_refused(target):
    drafter = load_drafter("untrained", target, block_size=4, draft_sampling=DraftSampling("sample", 0.7))
    with pytest.raises(ValueError, match="use draft sampling 'greedy' with a tree budget"):
        drafter.with_tree_budget(8)
    with pytest.raises(ValueError, match="tree budget must be >= 0"):
        load_drafter("untrained", target, block_size=4).with_tree_budget(-1)
