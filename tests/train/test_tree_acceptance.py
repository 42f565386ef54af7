"""`tree_accepted_drafts`: the drafts greedy verification accepts from each block's best-first tree."""

import jax.numpy as jnp
import numpy as np
import pytest

from dflax.drafters.best_first import best_first_tree
from dflax.train.tree_acceptance import tree_accepted_drafts

# Two positions, two candidates each: paths best first (0) .6, (0, 0) .54, (1) .4, (1, 0) .36, (0, 1) .06,
# (1, 1) .04.
_LOG_PROBS = jnp.log(jnp.asarray([[[0.6, 0.4], [0.9, 0.1]]], jnp.float32))


@pytest.mark.parametrize(
    "ranks, accepted",
    [
        ((0, 0), [0, 1, 2, 2, 2, 2, 2]),
        ((1, 0), [0, 0, 0, 1, 2, 2, 2]),
        ((0, 1), [0, 1, 1, 1, 1, 2, 2]),
        ((1, 1), [0, 0, 0, 1, 1, 1, 2]),
        ((2, 0), [0] * 7),  # the target's first token is not a candidate
    ],
)
def test_each_budget_accepts_the_target_paths_nodes_among_its_first_choices(ranks, accepted):
    got = tree_accepted_drafts(_LOG_PROBS, jnp.asarray([ranks], jnp.int32), max_nodes=6)
    np.testing.assert_array_equal(np.asarray(got)[0], accepted)


def test_it_walks_the_tree_decoding_builds():
    """Random blocks: the accepted drafts equal a greedy walk of `best_first_tree` over token ids."""
    rng = np.random.default_rng(0)
    rows, n, k, nodes = 40, 5, 4, 12
    log_probs = np.sort(np.log(rng.dirichlet(np.ones(8), (rows, n))[..., :k]), axis=-1)[..., ::-1]
    tokens = np.stack([np.stack([rng.permutation(50)[:k] for _ in range(n)]) for _ in range(rows)])
    target = np.where(
        rng.random((rows, n)) < 0.8,
        tokens[..., 0],
        tokens[np.arange(rows)[:, None], np.arange(n), rng.integers(0, k, (rows, n))],
    )
    target = np.where(rng.random((rows, n)) < 0.1, 99, target)  # sometimes no candidate
    tree = best_first_tree(jnp.asarray(log_probs.copy()), jnp.asarray(tokens, jnp.int32), nodes)
    ranks = np.where(tokens == target[..., None], np.arange(k), k).min(axis=-1)  # [rows, n]
    got = np.asarray(
        tree_accepted_drafts(jnp.asarray(log_probs.copy()), jnp.asarray(ranks, jnp.int32), nodes)
    )
    for r in range(rows):
        node, depth = 0, 0
        while depth < n:
            children = [
                i
                for i in range(nodes)
                if tree.parents[r, i] == node and tree.tokens[r, i] == target[r, depth]
            ]
            if not children:
                break
            node, depth = children[0] + 1, depth + 1
        assert got[r, nodes] == depth
