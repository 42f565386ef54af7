"""Best-first draft trees over a block drafter's per-position distributions (DDTree, arXiv 2604.12989).

One forward of a block-parallel drafter (DFlash) scores every draft position at once. A path that takes
the r_1-th most likely token at position 1, the r_2-th at position 2, ... scores sum_j log p_j(r_j). The
N best such paths by this cumulative log-probability form a tree: every prefix of a path scores at least
as much as the path, so a node's parent is always chosen before it. They are enumerated best first: the
frontier holds, for every chosen node, its first child (the best token one position deeper) and its next
sibling (the next token at the same position under the same parent), and each step takes the frontier's
best. Everything is static-shape jnp (N steps over a frontier of N + 1 slots), run inside the decode step.

Glossary: B batch, n draft positions, K candidates per position, N nodes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflax.decoding.tree import DraftTree

_EMPTY = -jnp.inf


def best_first_tree(log_probs: jax.Array, token_ids: jax.Array, num_nodes: int) -> DraftTree:
    """The num_nodes best paths through per-position candidates, as a tree.

    Args:
      log_probs: [B, n, K] candidate log-probabilities per position, descending along K.
      token_ids: [B, n, K] int32 the candidates' tokens.
      num_nodes: N, nodes in the tree (the root not counted).

    Returns:
      A `DraftTree` of N nodes in the order they were chosen (a node's parent comes before it). Node depth
      d holds a candidate of position d.
    """
    return jax.vmap(lambda lp, ids: _best_first_row(lp, ids, num_nodes))(log_probs, token_ids)


def _best_first_row(log_probs: jax.Array, token_ids: jax.Array, num_nodes: int) -> DraftTree:
    """`best_first_tree` for one row: log_probs, token_ids [n, K]."""
    n, k = log_probs.shape
    slots = num_nodes + 1  # the root's first child, then at most one new slot per chosen node
    # Frontier slot: score, parent node, depth (1-based position) and rank of its candidate.
    score = jnp.full((slots,), _EMPTY).at[0].set(log_probs[0, 0])
    parent = jnp.zeros((slots,), jnp.int32)
    depth = jnp.ones((slots,), jnp.int32)
    rank = jnp.zeros((slots,), jnp.int32)
    tokens = jnp.zeros((num_nodes,), jnp.int32)
    parents = jnp.zeros((num_nodes,), jnp.int32)

    def choose(i, carry):
        score, parent, depth, rank, tokens, parents = carry
        best = jnp.argmax(score)
        d, r, s = depth[best], rank[best], score[best]
        node = i + 1  # node 0 is the root
        tokens = tokens.at[i].set(token_ids[d - 1, r])
        parents = parents.at[i].set(parent[best])
        # The chosen slot becomes its next sibling.
        sibling = r + 1 < k
        next_score = s - log_probs[d - 1, r] + log_probs[d - 1, jnp.minimum(r + 1, k - 1)]
        score = score.at[best].set(jnp.where(sibling, next_score, _EMPTY))
        rank = rank.at[best].set(r + 1)
        # Its first child takes a new slot.
        child = d < n
        new = i + 1
        score = score.at[new].set(jnp.where(child, s + log_probs[jnp.minimum(d, n - 1), 0], _EMPTY))
        parent = parent.at[new].set(node)
        depth = depth.at[new].set(d + 1)
        rank = rank.at[new].set(0)
        return score, parent, depth, rank, tokens, parents

    carry = jax.lax.fori_loop(0, num_nodes, choose, (score, parent, depth, rank, tokens, parents))
    return DraftTree(tokens=carry[4], parents=carry[5])
