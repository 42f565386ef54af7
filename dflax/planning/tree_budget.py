"""Choosing a draft tree's node budget from a cost model, as `block_size` chooses a chain's length.

A best-first tree over a block drafter's per-position candidates (dflax.drafters.best_first) holds the
paths (r_1, ..., r_d) that take the r_j-th best candidate at draft position j. With the drafter's measured
rank acceptance a[j, r] = P(the target's token at position j is the drafter's r-th candidate | its tokens
at positions 1..j-1 are among the candidates counted), a path is the target's own continuation with
probability about prod_j a[j, r_j] (positions taken as independent given that condition). A tree commits
the bonus token plus its deepest node on the target's path, so a step commits on average

    tau(N) = 1 + sum over the tree's N nodes of prod_j a[j, r_j],

largest when the tree holds the N paths of highest probability. Every prefix of a path is at least as
probable as the path, so those N paths form a tree, and they are enumerated best first (a frontier of
first children and next siblings, as the decoding tree builder does). A chain is the tree of paths
(0, ..., 0), and its tau is `block_size.expected_tau` of a[:, 0] when the stats condition alike.

The predicted speedup of N nodes over plain decoding is tau(N) * t_step(plain) / t_step(N), the same form
as a chain's; `dflax.planning.block_size.choose_block_size` weighs both.

Glossary: n draft positions, K candidates counted per position (RANKS), N nodes (the root not counted).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np


def tree_commit_moments(rank_accept: Sequence[Sequence[float]], max_nodes: int) -> np.ndarray:
    """[max_nodes + 1, 2] float64: tau(N) = E[c] and E[c^2] of the tokens c one step with the best N-node
    tree commits, for N = 0 .. max_nodes (N = 0: the bonus token alone, c = 1).

    c = 1 + the depth of the deepest accepted node, and the nodes of one depth exclude each other, so
    P(c > d) is the sum over depth-d nodes of their path probability and E[c^2] = 1 + sum over nodes of
    (2 depth + 1) times it.

    Args:
      rank_accept: [n, K] a[j, r] per draft position j and candidate rank r (rows may sum to < 1: the
        target's token ranks past the K counted candidates, or the drafter cannot draft it).
      max_nodes: the largest budget wanted; a tree never holds more than the sum over depths of K^depth
        paths, and the curve stays flat past what the stats allow.

    Raises:
      ValueError: for probabilities outside [0, 1] or a row summing past 1.
    """
    a = np.asarray(rank_accept, np.float64)
    if a.ndim != 2 or ((a < 0) | (a > 1)).any() or (a.sum(axis=1) > 1 + 1e-6).any():
        raise ValueError(f"rank acceptance must be [positions, ranks] of probabilities, got {a!r}")
    n, k = a.shape
    moments = np.ones((max_nodes + 1, 2))
    # Frontier entries: (-probability, depth index j, rank r, probability of the parent path).
    frontier = [(-a[0, 0], 0, 0, 1.0)] if n else []
    total, square = 1.0, 1.0
    for size in range(1, max_nodes + 1):
        if frontier:
            neg, j, r, parent = heapq.heappop(frontier)
            total -= neg
            square -= (2 * (j + 1) + 1) * neg
            if r + 1 < k:  # the next sibling: the same parent, the next candidate at position j
                heapq.heappush(frontier, (-parent * a[j, r + 1], j, r + 1, parent))
            if j + 1 < n:  # the first child: the best candidate one position deeper
                heapq.heappush(frontier, (neg * a[j + 1, 0], j + 1, 0, -neg))
        moments[size] = total, square
    return moments
