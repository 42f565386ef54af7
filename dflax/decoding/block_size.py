"""Choosing the DFlash block size from a cost model: expected tokens per step over the time of a step.

A speculative step with block size B drafts B - 1 tokens in one drafter forward and verifies the anchor plus
the drafts in one target forward over B tokens. With acc_k = P(draft k accepted | drafts 1..k-1 accepted)
(the drafter's measured per-position acceptance), a step commits on average

    tau(B) = 1 + sum_{k=1}^{B-1} prod_{j<=k} acc_j

tokens (the bonus token included), and takes t_draft(B) + t_verify(B). A plain step commits one token in
t_verify(1). The predicted speedup of B over plain decoding is therefore

    speedup(B) = tau(B) * t_verify(1) / (t_draft(B) + t_verify(B)),

and the chosen block size is the one with the best predicted speedup, or none (plain decoding) when no
block size is predicted to beat plain decoding by the required margin. Given the drafter's rank acceptance,
best-first trees of N nodes over the largest block compete with the chains (dflax.decoding.tree_budget).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np

from dflax.decoding.tree_budget import tree_tau_curve

# A block size must be predicted at least this much faster than plain decoding to be chosen: the model
# ignores the step's bookkeeping (acceptance, cache and drafter-context updates), which costs a few percent.
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


def interpolate(curve: Mapping[int, float], n: int) -> float:
    """The cost at n tokens from costs measured at some token counts (linear between them).

    Raises:
      ValueError: when n lies outside the measured range.
    """
    sizes = sorted(int(k) for k in curve)
    if not sizes[0] <= n <= sizes[-1]:
        raise ValueError(f"{n} tokens lies outside the measured {sizes[0]}..{sizes[-1]}")
    return float(np.interp(n, sizes, [curve[k] for k in sizes]))


@dataclasses.dataclass(frozen=True)
class BlockSizeChoice:
    """What the cost model chose.

    Attributes:
      block_size: the chosen B, or None for plain decoding (nothing pays).
      predicted: {B: (tau, predicted speedup over plain decoding)} for every candidate chain.
      tree_budget: the chosen tree's node budget N over blocks of `block_size`, or 0 for a chain.
      predicted_trees: {N: (tau, predicted speedup)} for every candidate tree (empty without rank stats).
    """

    block_size: int | None
    predicted: dict[int, tuple[float, float]]
    tree_budget: int = 0
    predicted_trees: dict[int, tuple[float, float]] = dataclasses.field(default_factory=dict)

    def describe(self) -> str:
        """One line for a user: the choice and why."""
        options = {f"B={b}": p for b, p in self.predicted.items()}
        options.update({f"a tree of {n} nodes": p for n, p in self.predicted_trees.items()})
        best = max(options, key=lambda name: options[name][1])
        tau, speedup = options[best]
        if self.block_size is None:
            return (
                f"block size auto: plain decoding (no block size or tree pays; best predicted {best}: "
                f"tau {tau:.2f}, {speedup:.2f}x)"
            )
        return f"block size auto: {best} (predicted tau {tau:.2f}, {speedup:.2f}x over plain decoding)"


def choose_block_size(
    accept: Sequence[float],
    verify_s: Mapping[int, float],
    draft_s: Mapping[int, float],
    min_speedup: float = MIN_PREDICTED_SPEEDUP,
    rank_accept: Sequence[Sequence[float]] | None = None,
    tree_draft_s: Mapping[int, float] | None = None,
) -> BlockSizeChoice:
    """The chain or tree with the best predicted speedup, or plain decoding when none reaches `min_speedup`.

    Args:
      accept: the drafter's per-position conditional acceptance acc_1, acc_2, ...
      verify_s: seconds of one target forward over n tokens, for measured n (1 included); made
        non-decreasing in n before use.
      draft_s: seconds of one drafter forward per candidate block size (the candidate chains).
      min_speedup: the predicted speedup a block size needs to be chosen over plain decoding.
      rank_accept: [n, K] the drafter's rank acceptance (dflax.decoding.tree_budget), or None: no trees.
      tree_draft_s: seconds of one drafter forward plus the tree build per candidate node budget N, the
        trees drawn over blocks of the largest candidate chain (verify_s must reach N + 1).
    """
    # A forward over more tokens never costs less: a running maximum keeps one noisy timing from making a
    # larger verify look cheaper than a smaller one (or than the plain step).
    sizes = sorted(verify_s)
    verify_s = dict(zip(sizes, np.maximum.accumulate([verify_s[n] for n in sizes])))
    plain = verify_s[1]
    predicted = {}
    for b in sorted(draft_s):
        if b - 1 > len(accept):
            continue
        tau = expected_tau(accept, b)
        predicted[b] = (tau, tau * plain / (draft_s[b] + interpolate(verify_s, b)))
    if not predicted:
        raise ValueError(f"no candidate block size fits the {len(accept)} measured acceptance positions")
    trees = {}
    if rank_accept is not None and tree_draft_s:
        block = max(predicted)
        taus = tree_tau_curve(np.asarray(rank_accept)[: block - 1], max(tree_draft_s))
        for n in sorted(tree_draft_s):
            trees[n] = (taus[n], taus[n] * plain / (tree_draft_s[n] + interpolate(verify_s, n + 1)))
    best = max(predicted, key=lambda b: predicted[b][1])
    best_tree = max(trees, key=lambda n: trees[n][1], default=None)
    if best_tree is not None and trees[best_tree][1] > predicted[best][1]:
        chosen = (max(predicted), best_tree) if trees[best_tree][1] >= min_speedup else (None, 0)
        return BlockSizeChoice(chosen[0], predicted, chosen[1], trees)
    return BlockSizeChoice(best if predicted[best][1] >= min_speedup else None, predicted, 0, trees)
