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

The predicted speedup of N nodes over plain decoding is tau(N) * t_verify(1) / (t_draft(N) +
t_verify(N + 1)), the same form as a chain's; `dflax.decoding.block_size.choose_block_size` weighs both.

Glossary: n draft positions, K candidates counted per position (RANKS), N nodes (the root not counted).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np


def tree_tau_curve(rank_accept: Sequence[Sequence[float]], max_nodes: int) -> np.ndarray:
    """tau(N) for N = 0 .. max_nodes: [max_nodes + 1] float64, tau(0) = 1 (the bonus token alone).

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
    taus = np.ones(max_nodes + 1)
    # Frontier entries: (-probability, depth index j, rank r, probability of the parent path).
    frontier = [(-a[0, 0], 0, 0, 1.0)] if n else []
    total = 1.0
    for size in range(1, max_nodes + 1):
        if frontier:
            neg, j, r, parent = heapq.heappop(frontier)
            total -= neg
            if r + 1 < k:  # the next sibling: the same parent, the next candidate at position j
                heapq.heappush(frontier, (-parent * a[j, r + 1], j, r + 1, parent))
            if j + 1 < n:  # the first child: the best candidate one position deeper
                heapq.heappush(frontier, (neg * a[j + 1, 0], j + 1, 0, -neg))
        taus[size] = total
    return taus
