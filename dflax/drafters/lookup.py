"""Prompt lookup: a training-free drafter that copies what followed the latest n-gram's last occurrence.

Each row keeps its token history (prompt and output so far) on device, one slot per position. To draft,
the row's last n tokens (n = 3, then 2, then 1: the longest n that matches wins) are matched against
the history, and the k tokens that followed the most recent earlier occurrence are proposed as a chain.
Where the history ends before k tokens, the match's continuation repeats (a repeating pattern goes on
repeating). Without any match the row proposes its last token k times. A step where no row matched
at least `min_match` tokens (default 2) skips the verify of drafts and runs a plain one-token step
(`worth_verifying`, see dflax.decoding.decode): on a CPU a verify of 8 tokens costs about two plain
steps, more than weak matches return. With a tree budget the continuations of the best several
occurrences form one tree, sharing their common prefixes. Drafts are deterministic, so the (tree) delta
rule verifies them at every temperature.

As in HF transformers' `prompt_lookup_num_tokens` (Saxena, "Prompt Lookup Decoding", 2023), everything
here is static-shape jnp inside the decode loop: one [B, S] comparison per n-gram size and position.

Glossary: B batch, S history slots (the target cache's), k drafts per step, g n-gram size.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from dflax.decoding.tree import DraftTree
from dflax.models.cache import write_rows

NGRAM_SIZES = (3, 2, 1)
LOOKUP_BLOCK_SIZE = 8  # the last token + 7 drafts (HF's prompt_lookup_num_tokens defaults to 10 drafts)
# Verify drafts only after a match of 2+ tokens: simulated on 40 HumanEval greedy outputs (B=8, this CPU's
# verify costing 2.2 plain steps), 1-token matches cost more verify time than they return.
DEFAULT_MIN_MATCH = 2


@struct.dataclass
class History:
    """A row's tokens by absolute position.

    Attributes:
      tokens: [B, S] int32; slot j holds the token at position j for every position whose K/V the target's
        cache holds (slots from the cache length on are stale and never read).
    """

    tokens: jax.Array


def match_lengths(
    sequence: jax.Array, length: jax.Array, ngram_sizes: tuple[int, ...] = NGRAM_SIZES
) -> jax.Array:
    """[B, S] int32: at each continuation start c, the longest n whose n-gram ending at c - 1 equals the
    row's last n tokens (0 where none does, and for c outside [n, length - 1])."""
    b, s = sequence.shape
    index = jnp.arange(s)
    longest = jnp.zeros((b, s), jnp.int32)
    for g in ngram_sizes:
        tail_index = jnp.maximum(length[:, None] - g + jnp.arange(g), 0)  # [B, g]
        tail = jnp.take_along_axis(sequence, tail_index, axis=1)  # [B, g]
        matches = jnp.ones((b, s), jnp.bool_)
        for t in range(g):  # the window ending at c - 1 equals the tail: sequence[c - g + t] == tail[t]
            shifted = jnp.pad(sequence[:, : s - (g - t)], ((0, 0), (g - t, 0)), constant_values=-1)  # [B, S]
            matches &= shifted == tail[:, t : t + 1]
        matches &= (index[None] >= g) & (index[None] <= length[:, None] - 1)
        longest = jnp.maximum(longest, jnp.where(matches, g, 0))
    return longest


def match_starts(
    sequence: jax.Array, length: jax.Array, num_matches: int, ngram_sizes: tuple[int, ...] = NGRAM_SIZES
) -> jax.Array:
    """Where the row's last n tokens occurred before: the best `num_matches` occurrences, longest n first,
    then most recent.

    An occurrence is named by its continuation start c, the index of the token that followed it; it ends
    before the last token (c <= length - 1), so it has one. Each c counts once, with the longest n whose
    n-gram ends at c - 1.

    Args:
      sequence: [B, S] int32 tokens; entries at or beyond `length` are ignored.
      length: [B] int32 valid tokens per row (>= 1).
      num_matches: M, how many occurrences to return.
      ngram_sizes: n-gram sizes to try.

    Returns:
      [B, M] int32 continuation starts, best first; -1 where fewer than M occurrences exist.
    """
    s = sequence.shape[1]
    longest = match_lengths(sequence, length, ngram_sizes)  # [B, S]
    key = jnp.where(longest > 0, longest * s + jnp.arange(s)[None], -1)  # longest first, then most recent
    best, starts = jax.lax.top_k(key, num_matches)  # [B, M]
    return jnp.where(best >= 0, starts, -1).astype(jnp.int32)


def continuations(sequence: jax.Array, length: jax.Array, starts: jax.Array, depth: int) -> jax.Array:
    """The `depth` tokens from each start [B, M]: [B, M, depth]. Where the sequence ends first, the known
    tokens after the start repeat; a start of -1 gives the row's last token `depth` times."""
    last = jnp.take_along_axis(sequence, (length - 1)[:, None], axis=1)[:, :, None]  # [B, 1, 1]
    period = jnp.maximum(length[:, None] - starts, 1)[..., None]  # [B, M, 1] tokens known after a start
    offsets = starts[..., None] + jnp.arange(depth) % period  # [B, M, depth]
    b, m, _ = offsets.shape
    flat = jnp.clip(offsets, 0, sequence.shape[1] - 1).reshape(b, m * depth)
    copied = jnp.take_along_axis(sequence, flat, axis=1).reshape(b, m, depth)
    return jnp.where(starts[..., None] >= 0, copied, last).astype(jnp.int32)


def lookup_drafts(sequence: jax.Array, length: jax.Array, num_draft: int) -> jax.Array:
    """The k tokens that followed the best occurrence of the row's last n-gram (see module docstring).

    Args:
      sequence: [B, S] int32 tokens, valid up to `length`.
      length: [B] int32 valid tokens per row (>= 1).
      num_draft: k.

    Returns:
      [B, k] int32 drafts.
    """
    starts = match_starts(sequence, length, 1)  # [B, 1]
    return continuations(sequence, length, starts, num_draft)[:, 0]


def lookup_tree(sequence: jax.Array, length: jax.Array, depth: int, num_nodes: int) -> DraftTree:
    """The continuations of the best ceil(N / depth) occurrences as one tree of N nodes.

    Branch m (the m-th best occurrence, the best one's where there are fewer) is a chain of `depth`
    nodes below the root; branches are laid out one after the other and the last one is cut at N nodes.
    A branch's node hangs below the first branch's node that holds the same prefix, so shared prefixes
    share nodes; a node whose prefix another branch holds already is an unreachable duplicate sibling (the
    walk takes the first matching child).

    Args:
      sequence: [B, S] int32 tokens, valid up to `length`.
      length: [B] int32 valid tokens per row (>= 1).
      depth: d, nodes per branch.
      num_nodes: N.

    Returns:
      A `DraftTree` of N nodes.
    """
    branches = -(-num_nodes // depth)
    starts = match_starts(sequence, length, branches)  # [B, M]
    starts = jnp.where(starts >= 0, starts, starts[:, :1])  # missing occurrences repeat the best
    chains = continuations(sequence, length, starts, depth)  # [B, M, d]
    # same[b, m, m2, t]: branches m and m2 agree on their first t + 1 tokens.
    same = jnp.cumprod(chains[:, :, None] == chains[:, None], axis=-1).astype(jnp.bool_)
    first_same = jnp.argmax(same, axis=2)  # [B, M, d] the first branch holding m's prefix of length t + 1
    node = 1 + first_same * depth + jnp.arange(depth)  # [B, M, d] that branch's node at depth t + 1
    parents = jnp.concatenate([jnp.zeros_like(node[..., :1]), node[..., :-1]], axis=-1)  # [B, M, d]
    b = sequence.shape[0]
    return DraftTree(
        tokens=chains.reshape(b, -1)[:, :num_nodes], parents=parents.reshape(b, -1)[:, :num_nodes]
    )


@dataclasses.dataclass(frozen=True)
class PromptLookupProposer:
    """Prompt lookup as the decode loop's `Proposer` (equal settings compare equal: one compile).

    Attributes:
      block_size: B; a chain proposes the B - 1 tokens after the best occurrence, a tree branches of B - 1.
      tree_budget: 0 proposes a chain; N > 0 a tree of N nodes over the best occurrences (`lookup_tree`).
      min_match: a step verifies drafts only when some active row's last `min_match` or more tokens
        occurred before (`worth_verifying`); otherwise it is a plain one-token step, which costs less
        than a verify of drafts that follow a weak match. 0 always verifies.
    """

    block_size: int
    tree_budget: int = 0
    min_match: int = DEFAULT_MIN_MATCH
    tap_layers: tuple[int, ...] = ()

    def __post_init__(self):
        if self.block_size < 2:
            raise ValueError(
                f"block size must be >= 2 (the anchor plus at least one draft), got {self.block_size}"
            )
        if self.tree_budget < 0:
            raise ValueError(f"tree budget must be >= 0 (0 = a chain), got {self.tree_budget}")
        if not 0 <= self.min_match <= max(NGRAM_SIZES):
            raise ValueError(
                f"min_match must be 0 (always verify) .. {max(NGRAM_SIZES)} (the longest n-gram matched), "
                f"got {self.min_match}"
            )

    @property
    def num_draft(self) -> int:
        """Drafts verified per step: B - 1 as a chain, or the tree budget's N nodes."""
        return self.tree_budget or self.block_size - 1

    def init_state(self, batch: int, slots: int, dtype: jnp.dtype) -> History:
        """An empty history of one slot per cache slot."""
        return History(jnp.zeros((batch, slots), jnp.int32))

    def observe(self, params, history: History, tokens, taps, positions, count) -> History:
        """Writes the tokens at their positions (those past `count` land beyond the length: stale)."""
        return History(write_rows(history.tokens, tokens, positions[:, 0]))

    def _sequence(self, state) -> tuple[jax.Array, jax.Array]:
        """The history plus the last committed token (at position cache length) [B, S], and its length [B]."""
        length = state.cache.positions
        return write_rows(state.drafter_state.tokens, state.last_token[:, None], length), length + 1

    def worth_verifying(self, params, state) -> jax.Array:
        """[B] bool: the row's last `min_match` tokens occurred before (all True when min_match is 0)."""
        sequence, length = self._sequence(state)
        if not self.min_match:
            return jnp.ones(length.shape, jnp.bool_)
        return jnp.max(match_lengths(sequence, length), axis=1) >= self.min_match

    def propose(self, params, target_params, state, keys) -> tuple[jax.Array | DraftTree, None]:
        """Drafts from the history plus the last committed token (at position cache length): [B, B - 1]
        as a chain, or a tree of N nodes."""
        sequence, length = self._sequence(state)
        if self.tree_budget:
            return lookup_tree(sequence, length, self.block_size - 1, self.tree_budget), None
        return lookup_drafts(sequence, length, self.block_size - 1), None


@dataclasses.dataclass(frozen=True)
class LookupDrafter:
    """Prompt lookup bound for `dflax.generate(..., drafter=)`: no parameters.

    Attributes:
      proposer: the static proposer.
      name: "lookup".
    """

    proposer: PromptLookupProposer
    name: str = "lookup"
    params: None = None

    def with_block_size(self, block_size: int) -> LookupDrafter:
        """Prompt lookup with chains (tree branches) of block_size - 1 drafts."""
        return dataclasses.replace(self, proposer=dataclasses.replace(self.proposer, block_size=block_size))

    def with_tree_budget(self, tree_budget: int) -> LookupDrafter:
        """Prompt lookup proposing trees of `tree_budget` nodes over several occurrences (0 = a chain)."""
        return dataclasses.replace(self, proposer=dataclasses.replace(self.proposer, tree_budget=tree_budget))


def prompt_lookup(
    block_size: int = LOOKUP_BLOCK_SIZE, tree_budget: int = 0, min_match: int = DEFAULT_MIN_MATCH
) -> LookupDrafter:
    """A prompt-lookup drafter: each step verifies the last token and block_size - 1 copied drafts, or with
    a tree budget N, a tree of N nodes holding the continuations of several occurrences; a step where no
    row's last `min_match` tokens occurred before is a plain one-token step (0: always verify drafts).

    Raises:
      ValueError: when block_size < 2, tree_budget < 0 or min_match outside 0..3.
    """
    return LookupDrafter(PromptLookupProposer(block_size, tree_budget, min_match))
