"""The tree-budget cost model: tau(N) of the best N paths, checked against the decoding tree builder on
simulated targets, the chain as its special case, and the choice between chains, trees and plain decoding."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from dflax.drafters.best_first import best_first_tree
from dflax.planning.block_size import choose_block_size, expected_square, expected_tau
from dflax.planning.tree_budget import tree_commit_moments

# a[j, r]: a drafter that is often right at rank 0 and sometimes at ranks 1-2, weaker deeper.
RANK_ACCEPT = np.asarray(
    [[0.5, 0.2, 0.1, 0.05], [0.4, 0.2, 0.1, 0.05], [0.3, 0.15, 0.1, 0.05], [0.3, 0.1, 0.05, 0.05]]
)
PLAIN_S = 1.0


def tree_tau_curve(rank_accept, max_nodes):
    return tree_commit_moments(rank_accept, max_nodes)[:, 0]


def test_a_chain_is_the_tree_of_first_candidates():
    chain_only = np.zeros_like(RANK_ACCEPT)
    chain_only[:, 0] = RANK_ACCEPT[:, 0]
    moments = tree_commit_moments(chain_only, 8)
    taus = moments[:, 0]
    for n in range(1, 5):
        assert taus[n] == pytest.approx(expected_tau(chain_only[:, 0], n + 1))
        assert moments[n, 1] == pytest.approx(expected_square(chain_only[:, 0], n + 1))
    assert taus[0] == 1.0 and taus[8] == pytest.approx(taus[4])  # no more paths with any probability
    assert np.all(np.diff(tree_tau_curve(RANK_ACCEPT, 40)) >= 0)


def test_tau_of_a_budget_matches_the_best_first_tree_walked_by_simulated_targets():
    """The decoding tree builder, given the drafter's calibrated log-probabilities, holds the N paths the
    model sums; targets drawing each position's rank from a[j] accept on average tau(N) - 1 nodes, and
    commit c tokens with E[c^2] as the model says."""
    n, k = RANK_ACCEPT.shape
    rng = np.random.default_rng(0)
    trials = 40_000
    out = 1.0 - RANK_ACCEPT.sum(axis=1, keepdims=True)  # the target's token is none of the candidates
    probs = np.concatenate([RANK_ACCEPT, out], axis=1)  # [n, k + 1]
    ranks = np.stack([rng.choice(k + 1, size=trials, p=p) for p in probs], axis=1)  # [trials, n]
    log_probs = jnp.log(jnp.asarray(RANK_ACCEPT, jnp.float32))[None]  # [1, n, k]
    token_ids = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (1, n, k))  # token = its rank
    moments = tree_commit_moments(RANK_ACCEPT, 24)
    for budget in (1, 3, 8, 24):
        tree = best_first_tree(log_probs, token_ids, budget)
        tokens, parents = np.asarray(tree.tokens[0]), np.asarray(tree.parents[0])
        children = {}
        for node, (token, parent) in enumerate(zip(tokens, parents), start=1):
            children.setdefault((int(parent), int(token)), node)
        accepted = np.zeros(trials)
        for t in range(trials):
            node = 0
            for depth in range(n):
                node = children.get((node, int(ranks[t, depth])))
                if node is None:
                    break
                accepted[t] += 1
        sigma = accepted.std() / np.sqrt(trials)
        assert abs(1 + accepted.mean() - moments[budget, 0]) < 4 * sigma + 1e-3, budget
        squares = (1 + accepted) ** 2
        assert abs(squares.mean() - moments[budget, 1]) < 4 * squares.std() / np.sqrt(trials) + 1e-3, budget


def test_choice_takes_a_tree_when_it_beats_every_chain():
    accept = RANK_ACCEPT[:, 0]  # independent positions: a chain's conditional acceptance is a[j, 0]
    chain_s = {2: 1.1, 3: 1.15, 4: 1.2, 5: 1.3}
    tree_s = {4: 1.32, 8: 1.82, 16: 2.65}
    chains_only = choose_block_size(accept, PLAIN_S, chain_s)
    choice = choose_block_size(accept, PLAIN_S, chain_s, rank_accept=RANK_ACCEPT, tree_s=tree_s)
    taus = tree_tau_curve(RANK_ACCEPT, 16)
    for budget, (tau, speedup) in choice.predicted_trees.items():  # the formula, written out
        assert tau == taus[budget]
        assert speedup == pytest.approx(tau * PLAIN_S / tree_s[budget])
    best_chain = max(s for _, s in chains_only.predicted.values())
    best_tree = max(choice.predicted_trees, key=lambda b: choice.predicted_trees[b][1])
    assert choice.predicted_trees[best_tree][1] > best_chain
    assert (choice.block_size, choice.tree_budget) == (5, best_tree)
    assert f"a tree of {best_tree} nodes" in choice.describe()


def test_plain_decoding_when_neither_chains_nor_trees_pay():
    weak = RANK_ACCEPT * 0.2
    accept = weak[:, 0]
    choice = choose_block_size(accept, PLAIN_S, {5: 1.3}, rank_accept=weak, tree_s={8: 1.7})
    assert choice.block_size is None and choice.tree_budget == 0
    assert "plain decoding" in choice.describe()


def test_bad_rank_acceptance_is_one_clear_error():
    with pytest.raises(ValueError, match="rank acceptance"):
        tree_commit_moments([[0.7, 0.6]], 4)  # a row summing past 1
