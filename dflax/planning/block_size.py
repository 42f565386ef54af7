"""Choosing the DFlash block size from a cost model: expected tokens per step over the time of a step.

A speculative step with block size B drafts B - 1 tokens in one drafter forward, verifies the anchor plus
the drafts in one target forward over B tokens and commits the accepted ones. With acc_k = P(draft k
accepted | drafts 1..k-1 accepted) (the drafter's measured per-position acceptance), a step commits on
average

    tau(B) = 1 + sum_{k=1}^{B-1} prod_{j<=k} acc_j

tokens (the bonus token included), and takes t_step(B), a whole decode step timed on this machine
(`dflax.planning.cost_curve.step_costs`). A plain step commits one token in t_step(plain). The predicted
speedup of B over plain decoding is therefore

    speedup(B) = tau(B) * t_step(plain) / t_step(B),

and the chosen block size is the one with the best predicted speedup, or none (plain decoding) when no
block size is predicted to beat plain decoding by the required margin. Best-first trees of N nodes over
the largest block compete with the chains, their tau from the drafter's simulated held-out trees
(dflax.train.tree_acceptance) or, without those, from its rank acceptance (dflax.planning.tree_budget).

A static batch of R rows runs until its slowest row is done. Plain rows of L new tokens all take L steps;
a speculative row takes a random number of steps, about normal with mean L / tau (plus its last step's
overshoot) and variance L var / tau^3 (var: the variance of the tokens one step commits, steps taken as
independent), so the batch takes about L / tau + e_R sqrt(L var / tau^3) steps, e_R the mean of the largest
of R standard normals, and L over that replaces tau in the speedup. Rows whose acceptance differs with their
content idle more than this; the required margin covers part of that.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np

from dflax.planning.tree_budget import tree_commit_moments

# A block size must be predicted at least this much faster than plain decoding to be chosen: timings move
# by several percent between runs on a shared CPU, and acceptance on the prompts at hand is not the
# held-out answers' acceptance.
MIN_PREDICTED_SPEEDUP = 1.1


def expected_tau(accept: Sequence[float], block_size: int) -> float:
    """Mean tokens committed per step with block size B, from per-position conditional acceptance.

    Args:
      accept: acc_k for draft positions k = 1, 2, ... (at least B - 1 of them).
      block_size: B, the anchor plus B - 1 drafts.

    Raises:
      ValueError: when fewer than B - 1 positions were measured.
    """
    drafts = block_size - 1
    if drafts > len(accept):
        raise ValueError(
            f"block size {block_size} needs acceptance for {drafts} positions, have {len(accept)}"
        )
    return 1.0 + float(np.sum(np.cumprod(np.asarray(accept[:drafts], np.float64))))


def expected_square(accept: Sequence[float], block_size: int) -> float:
    """E[c^2] of the tokens c committed by one step with block size B (for their variance):
    1 + sum_{k=1}^{B-1} (2k + 1) prod_{j<=k} acc_j, since P(c > k) is the product up to k.

    Raises:
      ValueError: when fewer than B - 1 positions were measured.
    """
    expected_tau(accept, block_size)  # the same check
    survive = np.cumprod(np.asarray(accept[: block_size - 1], np.float64))
    return 1.0 + float(np.sum((2 * np.arange(1, block_size) + 1) * survive))


def mean_of_largest_normal(rows: int) -> float:
    """E[max of `rows` independent standard normals] (0 for one row), by quadrature."""
    if rows <= 1:
        return 0.0
    x = np.linspace(-12.0, 12.0, 24_001)
    cdf = 0.5 * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))
    density = rows * np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi) * cdf ** (rows - 1)
    return float(np.sum(x * density) * (x[1] - x[0]))


def static_batch_tau(tau: float, square: float, rows: int, new_tokens: int) -> float:
    """Tokens per row per step of a static batch of `rows` rows that each decode `new_tokens` tokens: the
    batch steps until its slowest row is done (see the module docstring).

    Args:
      tau: E[c], tokens one step commits in a row.
      square: E[c^2].
      rows: rows decoded together (1: no waiting, `tau` itself).
      new_tokens: L, tokens each row decodes.
    """
    if rows <= 1:
        return tau
    variance = max(square - tau * tau, 0.0)
    # A row's last step overshoots its budget: by Wald's identity, tau E[steps] = L - 1 + E[overshoot]
    # with the overshoot past L - 1 of a stationary renewal, (E[c^2] + E[c]) / (2 E[c]).
    mean_steps = (new_tokens - 1 + (square + tau) / (2 * tau)) / tau
    steps = mean_steps + mean_of_largest_normal(rows) * math.sqrt(new_tokens * variance / tau**3)
    return new_tokens / steps


@dataclasses.dataclass(frozen=True)
class BlockSizeChoice:
    """What the cost model chose.

    Attributes:
      block_size: the chosen B, or None for plain decoding (nothing pays).
      predicted: {B: (tau, predicted speedup over plain decoding)} for every candidate chain.
      tree_budget: the chosen tree's node budget N over blocks of `block_size`, or 0 for a chain.
      predicted_trees: {N: (tau, predicted speedup)} for every candidate tree (empty without tree stats).
      untimed: why the steps were not timed on this machine (the choice then came from a prior), or "".
    """

    block_size: int | None
    predicted: dict[int, tuple[float, float]]
    tree_budget: int = 0
    predicted_trees: dict[int, tuple[float, float]] = dataclasses.field(default_factory=dict)
    untimed: str = ""

    def describe(self) -> str:
        """One line for a user: the choice and why."""
        options = {f"B={b}": p for b, p in self.predicted.items()}
        options.update({f"a tree of {n} nodes": p for n, p in self.predicted_trees.items()})
        why = f" ({self.untimed}: a CPU prior)" if self.untimed else ""
        if not options:
            return f"block size auto: plain decoding{why}"
        best = max(options, key=lambda name: options[name][1])
        tau, speedup = options[best]
        if self.block_size is None:
            return (
                f"block size auto: plain decoding (no block size or tree pays; best predicted {best}: "
                f"tau {tau:.2f}, {speedup:.2f}x){why}"
            )
        return f"block size auto: {best} (predicted tau {tau:.2f}, {speedup:.2f}x over plain decoding){why}"


def _nondecreasing(costs: Mapping[int, float], floor: float) -> dict[int, float]:
    """Costs made non-decreasing in their key and at least `floor`: one noisy timing cannot make a larger
    step look cheaper than a smaller one (or than the plain step)."""
    sizes = sorted(costs)
    return dict(zip(sizes, np.maximum.accumulate([max(costs[n], floor) for n in sizes])))


def choose_block_size(
    accept: Sequence[float],
    plain_s: float,
    chain_s: Mapping[int, float],
    min_speedup: float = MIN_PREDICTED_SPEEDUP,
    rank_accept: Sequence[Sequence[float]] | None = None,
    tree_s: Mapping[int, float] | None = None,
    rows: int = 1,
    new_tokens: int | None = None,
    tree_commits: Sequence[Sequence[float]] | None = None,
) -> BlockSizeChoice:
    """The chain or tree with the best predicted speedup, or plain decoding when none reaches `min_speedup`.

    Args:
      accept: the drafter's per-position conditional acceptance acc_1, acc_2, ...
      plain_s: seconds of one plain decode step.
      chain_s: seconds of one decode step per candidate block size B (the candidate chains).
      min_speedup: the predicted speedup a block size needs to be chosen over plain decoding.
      rank_accept: [n, K] the drafter's rank acceptance (dflax.planning.tree_budget), or None: no trees
        unless `tree_commits` is given.
      tree_s: seconds of one decode step per candidate node budget N, the trees drawn over blocks of the
        largest candidate chain.
      rows, new_tokens: a static batch of `rows` rows decoding `new_tokens` each waits for its slowest
        row (module docstring); None (continuous batching, or one row) leaves that out.
      tree_commits: [N + 1, 2] E[c] and E[c^2] of a best-first tree of N nodes over the trained block,
        simulated on held-out blocks (`dflax.train.tree_acceptance`); preferred to the rank acceptance's
        independent-position estimate, which misses how a tree adapts to each block. Budgets past its
        last N are left out.
    """
    chain_s = _nondecreasing(chain_s, plain_s)

    def speedup(tau: float, square: float, step_s: float) -> float:
        if new_tokens is not None:
            tau = static_batch_tau(tau, square, rows, new_tokens)
        return tau * plain_s / step_s

    predicted = {}
    for b in sorted(chain_s):
        if b - 1 > len(accept):
            continue
        tau = expected_tau(accept, b)
        predicted[b] = (tau, speedup(tau, expected_square(accept, b), chain_s[b]))
    if not predicted:
        raise ValueError(f"no candidate block size fits the {len(accept)} measured acceptance positions")
    trees = {}
    if (rank_accept is not None or tree_commits is not None) and tree_s:
        tree_s = _nondecreasing(tree_s, plain_s)
        if tree_commits is not None:
            moments = np.asarray(tree_commits, np.float64)
        else:
            moments = tree_commit_moments(np.asarray(rank_accept)[: max(predicted) - 1], max(tree_s))
        for n in sorted(tree_s):
            if n < len(moments):
                trees[n] = (float(moments[n, 0]), speedup(*moments[n], tree_s[n]))
    best = max(predicted, key=lambda b: predicted[b][1])
    best_tree = max(trees, key=lambda n: trees[n][1], default=None)
    if best_tree is not None and trees[best_tree][1] > predicted[best][1]:
        chosen = (max(predicted), best_tree) if trees[best_tree][1] >= min_speedup else (None, 0)
        return BlockSizeChoice(chosen[0], predicted, chosen[1], trees)
    return BlockSizeChoice(best if predicted[best][1] >= min_speedup else None, predicted, 0, trees)
