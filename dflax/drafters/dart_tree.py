"""DART's draft tree: a beam over the drafted depths, pruned by an n-gram prior (arXiv 2601.19278).

At each depth l (0-based) the drafter's top k tokens are kept, their probabilities renormalised over those
k. Every beam member (the root alone at depth 0) is extended by each of them, and the child scores

    score(child) = score(parent) + (l + 1)^-0.7 * (0.9^l * log(p + 1e-10) + 0.5 * log(p_ngram + 1e-10))

with no n-gram term at depth 0. p_ngram(token | the two tokens before it on the path, the root included)
comes from counts with back-off (trigram, then bigram: the longest context under which the token was
seen, as DART's released trie does); a token never seen after any context scores 1e-10. The W best children
of a depth (those ending in an end-of-sequence token last) form the next depth's beam. Of all children of
all depths, the N best scores form the tree. Every term is <= 0, so a child never outscores its parent;
ties go to the earlier (shallower) candidate, so each kept node's parent is kept and comes first.
Everything is static-shape jnp run inside the decode step; the n-gram counts travel as arrays.

Glossary: B batch, d depths, k tokens per depth, W beam width, C candidates, N nodes, Q queries.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dflax.decoding.tree import DraftTree
from dflax.drafters.ngram import NgramTable, find_rows

UNSEEN = 1e-10  # added to every probability before its log, as published


@dataclasses.dataclass(frozen=True)
class BeamSettings:
    """The beam's constants (the paper's and its released code's by default).

    Attributes:
      top_k: tokens per depth (softmax over these).
      beam_width: W, beam members carried to the next depth.
      depth_exponent: depth weight (l + 1)^-depth_exponent.
      logit_decay: the drafter term's weight decay^l.
      ngram_weight: the n-gram term's weight.
    """

    top_k: int = 25
    beam_width: int = 20
    depth_exponent: float = 0.7
    logit_decay: float = 0.9
    ngram_weight: float = 0.5

    def num_candidates(self, depths: int, top_k: int) -> int:
        """C, children scored over `depths` depths with `top_k` tokens each."""
        total, width = 0, 1
        for _ in range(depths):
            total += width * top_k
            width = min(self.beam_width, width * top_k)
        return total


@struct.dataclass
class NgramPrior:
    """Counts of one order n for conditional probabilities: count(context + token) / count(context).

    Attributes:
      grams: [E, n] int32 distinct n-grams, sorted lexicographically.
      gram_counts: [E] int32 their counts.
      contexts: [C, n - 1] int32 distinct contexts, sorted.
      context_counts: [C] int32 how many n-grams start with each.
    """

    grams: jax.Array
    gram_counts: jax.Array
    contexts: jax.Array
    context_counts: jax.Array

    @property
    def order(self) -> int:
        """n."""
        return self.grams.shape[1]

    @classmethod
    def from_table(cls, table: NgramTable) -> NgramPrior:
        """The prior of a compact n-gram table (dflax.drafters.ngram), as numpy arrays."""
        starts = np.asarray(table.starts)
        per_context = np.diff(starts)
        contexts = np.repeat(np.asarray(table.contexts), per_context, axis=0)
        grams = np.concatenate([contexts, np.asarray(table.next_tokens)[:, None]], axis=1)
        order = np.lexsort(grams.T[::-1])
        counts = np.asarray(table.counts, np.int64)
        totals = np.add.reduceat(counts, starts[:-1]) if len(counts) else np.zeros(0, np.int64)
        return cls(
            grams=grams[order].astype(np.int32),
            gram_counts=counts[order].astype(np.int32),
            contexts=np.asarray(table.contexts, np.int32),
            context_counts=totals.astype(np.int32),
        )


def ngram_probability(priors: Sequence[NgramPrior], context: jax.Array, tokens: jax.Array) -> jax.Array:
    """p(token | context) with back-off: the longest order whose context was followed by the token.

    Args:
      priors: one prior per order, longest first.
      context: [Q, c] int32 the tokens before each query (c >= the longest order - 1).
      tokens: [Q] int32.

    Returns:
      [Q] float32, 0 where no order saw the token after its context.
    """
    prob = jnp.zeros(tokens.shape, jnp.float32)
    found = jnp.zeros(tokens.shape, jnp.bool_)
    for prior in priors:
        ctx = context[:, context.shape[1] - (prior.order - 1) :]
        gram = find_rows(prior.grams, jnp.concatenate([ctx, tokens[:, None]], axis=1))  # [Q]
        total = jnp.asarray(prior.context_counts)[jnp.maximum(find_rows(prior.contexts, ctx), 0)]
        count = jnp.asarray(prior.gram_counts)[jnp.maximum(gram, 0)]
        here = (gram >= 0) & ~found
        prob = jnp.where(here, count / jnp.maximum(total, 1), prob)
        found |= here
    return prob


def dart_tree(
    probs: jax.Array,
    token_ids: jax.Array,
    root: jax.Array,
    eos_ids: jax.Array,
    priors: Sequence[NgramPrior] | None,
    num_nodes: int,
    settings: BeamSettings = BeamSettings(),
) -> DraftTree:
    """DART's beam tree per row (see the module docstring).

    Args:
      probs: [B, d, k] the drafter's probabilities of its top k tokens per depth (summing to 1 over k).
      token_ids: [B, d, k] int32 those tokens.
      root: [B] int32 the last committed token (the first n-gram context token).
      eos_ids: [E] int32 end-of-sequence tokens (beam members ending in one go last).
      priors: n-gram priors (longest order first, orders 2 and 3), or None for no n-gram term.
      num_nodes: N <= C, nodes kept.
      settings: the beam's constants.

    Returns:
      A `DraftTree` of N nodes, best score first (a parent before its children).
    """
    _, d, k = probs.shape
    available = settings.num_candidates(d, k)
    if not 1 <= num_nodes <= available:
        raise ValueError(
            f"a DART tree of {num_nodes} nodes: the beam scores {available} candidates over {d} depths "
            f"of top {k}; choose a tree budget in [1, {available}]"
        )
    row = lambda p, t, r: _dart_tree_row(p, t, r, eos_ids, priors or (), num_nodes, settings)
    return jax.vmap(row)(probs, token_ids, root)


def _dart_tree_row(probs, token_ids, root, eos_ids, priors, num_nodes, settings: BeamSettings) -> DraftTree:
    """`dart_tree` for one row: probs, token_ids [d, k]."""
    d, k = probs.shape
    log_p = jnp.log(probs.astype(jnp.float32) + UNSEEN)  # [d, k]
    # Depth 0: the root's k children, no n-gram term.
    score = log_p[0]  # [k] (depth weight and decay are 1 at depth 0)
    tokens, before = token_ids[0], jnp.broadcast_to(root, (k,))
    parent = jnp.full((k,), -1, jnp.int32)
    scores, all_tokens, parents = [score], [tokens], [parent]
    level_start = 0
    for level in range(1, d):
        width = min(settings.beam_width, score.shape[0])
        is_eos = jnp.any(tokens[:, None] == eos_ids[None], axis=-1)
        _, beam = jax.lax.top_k(jnp.where(is_eos, score - 1e9, score), width)  # [W] in this level
        child_tokens = jnp.broadcast_to(token_ids[level], (width, k))  # [W, k]
        term = settings.logit_decay**level * jnp.broadcast_to(log_p[level], (width, k))
        if priors:
            context = jnp.stack([before[beam], tokens[beam]], axis=-1)  # [W, 2]
            context = jnp.repeat(context, k, axis=0)  # [W * k, 2]
            p_ngram = ngram_probability(priors, context, child_tokens.reshape(-1)).reshape(width, k)
            term += settings.ngram_weight * jnp.log(p_ngram + UNSEEN)
        weight = (level + 1) ** -settings.depth_exponent
        child_score = score[beam][:, None] + weight * term  # [W, k]
        parent = jnp.broadcast_to(level_start + beam[:, None], (width, k)).reshape(-1).astype(jnp.int32)
        level_start += score.shape[0]
        score = child_score.reshape(-1)
        before = jnp.repeat(tokens[beam], k)
        tokens = child_tokens.reshape(-1)
        scores.append(score)
        all_tokens.append(tokens)
        parents.append(parent)
    score, tokens, parent = (jnp.concatenate(x) for x in (scores, all_tokens, parents))  # [C]
    _, chosen = jax.lax.top_k(score, num_nodes)  # best first; ties: the earlier (shallower) candidate
    node_of = jnp.zeros(score.shape, jnp.int32).at[chosen].set(jnp.arange(1, num_nodes + 1, dtype=jnp.int32))
    chosen_parent = parent[chosen]
    parents_out = jnp.where(chosen_parent >= 0, node_of[jnp.maximum(chosen_parent, 0)], 0)
    return DraftTree(tokens=tokens[chosen].astype(jnp.int32), parents=parents_out)
