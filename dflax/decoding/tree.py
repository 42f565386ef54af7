"""Draft trees: their ancestor masks, the acceptance walk, and compaction of the accepted path's K/V.

A tree of N draft nodes hangs below the root, node 0, which is the row's last committed token. Nodes are in
topological order: node i's parent is < i. Node i sits at position committed_length + depth[i] and
attends to the committed prefix and to its ancestors (itself included), so one target forward over the
N + 1 nodes scores every path at once (design/verification.md, "Tree shape, masks and KV").

Acceptance is the delta rule generalised to trees: at each node on the walk, sample the target once
(temperature, top-k, top-p applied); move to the child whose token equals the sample, else stop and commit
the sample. Every committed token is then a draw from the target's own conditional, so this is exact at
every temperature for drafts chosen without sampling; at temperature 0 it accepts the longest path whose
every token equals the target's argmax at its parent. Siblings with equal tokens are allowed: the first
one is taken.

Glossary: B batch, N draft nodes (N + 1 with the root), S cache slots, V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from dflax.decoding.acceptance import Acceptance, commit_tokens
from dflax.decoding.sampling import SamplingParams, sample
from dflax.models.cache import KVCache, write_kv


@struct.dataclass
class DraftTree:
    """One draft tree per row.

    Attributes:
      tokens: [B, N] int32 token of nodes 1..N.
      parents: [B, N] int32 parent of nodes 1..N: node i's parent is in [0, i) (0 = the root).
    """

    tokens: jax.Array
    parents: jax.Array

    @property
    def num_nodes(self) -> int:
        """N, draft nodes per row (the root not counted)."""
        return self.tokens.shape[1]

    @classmethod
    def chain(cls, tokens: jax.Array) -> DraftTree:
        """The chain [B, N] as a tree: node i's parent is node i - 1."""
        b, n = tokens.shape
        return cls(tokens.astype(jnp.int32), jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), (b, n)))


def with_root(tree: DraftTree, root_tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Node tokens [B, N + 1] (root first) and parents [B, N + 1] (the root's is -1)."""
    b = root_tokens.shape[0]
    tokens = jnp.concatenate([root_tokens[:, None].astype(jnp.int32), tree.tokens], axis=1)
    parents = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32), tree.parents.astype(jnp.int32)], axis=1)
    return tokens, parents


def ancestor_mask(parents: jax.Array) -> jax.Array:
    """[B, N + 1] parents (root first, -1) -> [B, N + 1, N + 1] bool: node i sees node j (j an ancestor of i,
    or i itself). Lower-triangular, since parents precede their children."""
    b, m = parents.shape
    eye = jnp.broadcast_to(jnp.eye(m, dtype=jnp.bool_), (b, m, m))

    def add_parent_row(i, mask):  # mask[:, i] |= mask[:, parent[i]]; rows before i are final
        parent_row = jnp.take_along_axis(mask, jnp.maximum(parents[:, i], 0)[:, None, None], axis=1)
        return mask.at[:, i].set(mask[:, i] | parent_row[:, 0])

    return jax.lax.fori_loop(1, m, add_parent_row, eye)


def depths(mask: jax.Array) -> jax.Array:
    """[B, N + 1] int32 depth of each node (root 0) from its ancestor mask."""
    return jnp.sum(mask, axis=-1, dtype=jnp.int32) - 1


def first_matching_child(tokens: jax.Array, parents: jax.Array, wanted: jax.Array) -> jax.Array:
    """[B, N + 1] the first child of each node whose token equals wanted[:, node], or -1.

    Args:
      tokens: [B, N + 1] node tokens (root first).
      parents: [B, N + 1] node parents (root first, -1).
      wanted: [B, N + 1] the token sought below each node.
    """
    is_child = parents[:, None, :] == jnp.arange(parents.shape[1])[None, :, None]  # [B, node, child]
    match = is_child & (tokens[:, None, :] == wanted[:, :, None])
    return jnp.where(jnp.any(match, axis=-1), jnp.argmax(match, axis=-1), -1).astype(jnp.int32)


def walk(next_node: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Follows next_node [B, N + 1] (-1 = stop) from the root.

    Returns:
      path: [B, N + 1] int32 node indices, path[:, 0] = 0; after the last node the last node repeats.
      num_accepted: [B] int32 nodes on the path below the root.
    """
    b, m = next_node.shape

    def step(d, carry):
        node, num, path = carry
        nxt = jnp.take_along_axis(next_node, node[:, None], axis=1)[:, 0]
        moves = (nxt >= 0) & (num == d)  # still walking: every earlier step moved
        node = jnp.where(moves, nxt, node)
        return node, num + moves, path.at[:, d + 1].set(node)

    start = (jnp.zeros((b,), jnp.int32), jnp.zeros((b,), jnp.int32), jnp.zeros((b, m), jnp.int32))
    _, num_accepted, path = jax.lax.fori_loop(0, m - 1, step, start)
    return path, num_accepted


def accept_tree(
    key: jax.Array, tree: DraftTree, root_tokens: jax.Array, target_logits: jax.Array, params: SamplingParams
) -> tuple[Acceptance, jax.Array]:
    """The tree delta rule: sample the target once at every node, walk down matching children.

    Args:
      key: one PRNG key, or [B] row keys.
      tree: the drafts, chosen without sampling from a proposal distribution.
      root_tokens: [B] the last committed token of each row (node 0).
      target_logits: [B, N + 1, V] target logits at every node (node i scores the token after node i).
      params: the target's sampling settings (temperature 0 samples the argmax).

    Returns:
      (the accepted path's tokens then the target's sample at its last node, as `Acceptance` with
      tokens [B, N + 1]; path [B, N + 1] node indices from the root, see `walk`).
    """
    tokens, parents = with_root(tree, root_tokens)
    target_tokens = sample(key, target_logits, params)  # [B, N + 1]
    path, num_accepted = walk(first_matching_child(tokens, parents, target_tokens))
    path_tokens = jnp.take_along_axis(tokens, path, axis=1)  # [B, N + 1]
    next_tokens = jnp.take_along_axis(target_tokens, path, axis=1)  # [B, N + 1]
    return commit_tokens(path_tokens[:, 1:], num_accepted, next_tokens), path


def gather_path(values: jax.Array, path: jax.Array) -> jax.Array:
    """values [B, N + 1, ...] per node -> [B, N + 1, ...] along the path."""
    index = path.reshape(path.shape + (1,) * (values.ndim - 2))
    return jnp.take_along_axis(values, index, axis=1)


def compact_path(cache: KVCache, path: jax.Array) -> KVCache:
    """Moves the path's K/V to contiguous slots: node path[i], written at slot lengths + i by the tree's
    forward, is copied to slot lengths + path[i] -> lengths + i. Slots past the accepted path are left
    stale (they lie beyond the length the caller commits).

    Args:
      cache: the cache after the tree's forward wrote nodes 0..N at slots [lengths, lengths + N + 1).
      path: [B, N + 1] node indices from `accept_tree`.

    Returns:
      The cache with `lengths` unchanged.
    """
    width = path.shape[1]

    def compact(buffer):  # [B, K, S, H]
        nodes = jax.vmap(lambda buf, s: jax.lax.dynamic_slice_in_dim(buf, s, width, axis=1))(
            buffer, cache.lengths
        )  # [B, K, N + 1, H]
        return write_kv(buffer, gather_path(jnp.swapaxes(nodes, 1, 2), path), cache.lengths)

    return cache.replace(k=tuple(map(compact, cache.k)), v=tuple(map(compact, cache.v)))
