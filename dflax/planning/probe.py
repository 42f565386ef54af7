"""The probe: how many of a run's first prompts auto decodes with its first choice, and the drafter's
held-out acceptance scaled to what those prompts accepted, for the second choice."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from dflax.planning.block_size import expected_tau
from dflax.planning.tree_budget import tree_commit_moments

PROBE_PROMPTS = 4  # prompts (whole batches, at least) decoded before auto chooses again


def probe_size(rows: int, prompts: int) -> int:
    """How many of a run's prompts auto decodes before choosing again: whole batches of `rows`, at least
    PROBE_PROMPTS; 0 when that would leave no prompt for the second choice."""
    rows = max(rows, 1)
    size = rows * -(-PROBE_PROMPTS // rows)
    return size if size < prompts else 0


def scaled_to_probe(
    drafter, accept_hist: Sequence[int], block_size: int, tree_budget: int = 0
) -> tuple[Any, float | None]:
    """The drafter with its held-out acceptance scaled to what the run's own first prompts accepted.

    Args:
      drafter: the drafter auto chose from (its `accept`, `rank_accept` and `tree_commits` from
        TRAINING.json).
      accept_hist: steps by tokens committed (index = count, `GenerationResult.stats`), summed over the
        probe's rows.
      block_size: B of the probe's chain, or of the blocks its tree was drawn over.
      tree_budget: N of the probe's tree, 0 for a chain.

    Returns:
      (the drafter with acc_k and the rank acceptance times s, clipped to probabilities, and the simulated
      trees' accepted drafts times the ratio that makes the chain of B predict its drafts times s; or
      unchanged when the probe verified nothing; s, or None). For a chain, s = drafts the probe accepted
      over those the held-out acceptance predicts for the same steps, sum_k N(c > k) / sum_k N(c >= k)
      acc_k. For a tree, the s that scales the held-out prediction of that tree to the probe's tau: its
      simulated drafts (`tree_commits`) scaled alike, or else the rank acceptance's estimate
      (`tree_commit_moments`) of the scaled rank acceptance.
    """
    hist = np.asarray(accept_hist, np.float64)
    drafts = block_size - 1
    if not hist.sum():
        return drafter, None
    if tree_budget:
        tau = float(np.sum(np.arange(len(hist)) * hist) / hist.sum())
        if drafter.tree_commits and tree_budget < len(drafter.tree_commits):
            held_out = drafter.tree_commits[tree_budget][0]
            scale = _scale_for_drafts(drafter.accept, block_size, (tau - 1) / max(held_out - 1, 1e-9))
        elif drafter.rank_accept:
            scale = _scale_for_tree(np.asarray(drafter.rank_accept)[:drafts], tree_budget, tau)
        else:
            return drafter, None
    else:
        at_least = np.cumsum(hist[::-1])[::-1]  # N(c >= k)
        reached = at_least[1 : drafts + 1]  # N(c >= k), k = 1 .. B - 1
        expected = float(np.sum(reached * np.asarray(drafter.accept[:drafts])))
        if drafts < 1 or expected <= 0:
            return drafter, None
        scale = float(np.sum(at_least[2 : drafts + 2])) / expected
    accept = tuple(float(a) for a in np.clip(np.asarray(drafter.accept) * scale, 0.0, 1.0))
    rank_accept = drafter.rank_accept
    if rank_accept:
        ranks = np.asarray(rank_accept) * scale
        ranks /= np.maximum(ranks.sum(axis=1, keepdims=True), 1.0)  # each position's ranks sum to <= 1
        rank_accept = tuple(tuple(float(a) for a in row) for row in ranks)
    tree_commits = drafter.tree_commits
    if tree_commits:
        before = expected_tau(drafter.accept, block_size) - 1
        ratio = (expected_tau(accept, block_size) - 1) / max(before, 1e-9)
        tree_commits = tuple((1 + ratio * (c - 1), 1 + ratio * (c2 - 1)) for c, c2 in tree_commits)
    scaled = dataclasses.replace(drafter, accept=accept, rank_accept=rank_accept, tree_commits=tree_commits)
    return scaled, scale


def _bisect_scale(predicted: Callable[[float], float], wanted: float, high: float) -> float:
    """The s in [0, high] where the increasing `predicted(s)` reaches `wanted` (high when it never does)."""
    if predicted(high) <= wanted:
        return high
    low = 0.0
    for _ in range(50):
        middle = (low + high) / 2
        low, high = (middle, high) if predicted(middle) < wanted else (low, middle)
    return (low + high) / 2


def _scale_for_drafts(accept: Sequence[float], block_size: int, ratio: float) -> float:
    """The s that multiplies the drafts a chain of `block_size` is predicted to accept (tau - 1) by
    `ratio`, acc_k times s clipped to probabilities."""
    base = expected_tau(accept, block_size) - 1
    a = np.asarray(accept, np.float64)

    def drafts(scale: float) -> float:
        return expected_tau(tuple(np.clip(a * scale, 0.0, 1.0)), block_size) - 1

    return _bisect_scale(drafts, ratio * base, 1.0 / max(float(a.min()), 1e-9))


def _scale_for_tree(ranks: np.ndarray, tree_budget: int, tau: float) -> float:
    """The s whose scaled rank acceptance [n, K] predicts `tau` for the best-first tree of `tree_budget`
    nodes (rows stay probabilities)."""

    def predicted(scale: float) -> float:
        return float(tree_commit_moments(ranks * scale, tree_budget)[tree_budget, 0])

    return _bisect_scale(predicted, tau, 1.0 / max(float(ranks.sum(axis=1).max()), 1e-9))
