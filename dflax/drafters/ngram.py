"""A compact n-gram model: counts of (context, next token) as sorted arrays, queried inside jit.

For DART's tree pruning (design/methods.md): the counts come from a token corpus (a drafter's training
responses), are built once on the host with numpy, saved as one .npz beside the drafter, and queried on
device by a lexicographic binary search over the sorted contexts, so a lookup costs log2(C) steps of B
comparisons and no hash collisions exist.

Layout of one order n: the C distinct contexts (n - 1 tokens) sorted lexicographically; for context c
its next tokens at [starts[c], starts[c + 1]) of `next_tokens` / `counts`, most frequent first (ties: the
smaller token id first).

Glossary: B queries, C contexts, E distinct n-grams, k next tokens asked for.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


@struct.dataclass
class NgramTable:
    """The counts of one order n.

    Attributes:
      contexts: [C, n - 1] int32 distinct contexts, lexicographically sorted.
      starts: [C + 1] int32 offsets of each context's next tokens.
      next_tokens: [E] int32 next tokens, per context most frequent first.
      counts: [E] int32 their counts.
    """

    contexts: jax.Array
    starts: jax.Array
    next_tokens: jax.Array
    counts: jax.Array

    @property
    def order(self) -> int:
        """n: context length + 1."""
        return self.contexts.shape[1] + 1


def build_ngram_table(sequences: Iterable[np.ndarray], order: int, min_count: int = 1) -> NgramTable:
    """Counts every n-gram of the sequences (n-grams do not cross sequence ends).

    Args:
      sequences: 1-D int token arrays.
      order: n >= 2.
      min_count: keep only the n-grams seen at least this often (a smaller table).

    Returns:
      The table as numpy arrays (jnp-compatible; move with jax.device_put).

    Raises:
      ValueError: for order < 2 or a corpus with no n-gram.
    """
    if order < 2:
        raise ValueError(f"an n-gram model needs order >= 2 (a context and a next token), got {order}")
    grams = [
        np.lib.stride_tricks.sliding_window_view(np.asarray(s, np.int32), order)
        for s in sequences
        if len(s) >= order
    ]
    if not grams:
        raise ValueError(f"the corpus holds no sequence of {order} tokens: nothing to count")
    unique, counts = np.unique(np.concatenate(grams), axis=0, return_counts=True)  # [E, n] sorted
    keep = counts >= min_count
    if not keep.any():
        raise ValueError(f"no {order}-gram occurs {min_count} times: lower min_count or add data")
    unique, counts = unique[keep], counts[keep]
    contexts, context_of = np.unique(unique[:, :-1], axis=0, return_inverse=True)
    context_of = context_of.reshape(-1)
    order_in_context = np.lexsort((unique[:, -1], -counts, context_of))  # by context, count desc, token
    starts = np.searchsorted(context_of[order_in_context], np.arange(len(contexts) + 1))
    return NgramTable(
        contexts=contexts.astype(np.int32),
        starts=starts.astype(np.int32),
        next_tokens=unique[order_in_context, -1].astype(np.int32),
        counts=counts[order_in_context].astype(np.int32),
    )


def find_context(table: NgramTable, context: jax.Array) -> jax.Array:
    """Index of each context in the table, or -1.

    Args:
      table: the counts of order n.
      context: [B, n - 1] int32 contexts.

    Returns:
      [B] int32 context indices (-1 where the context never occurred).
    """
    return find_rows(table.contexts, context)


def find_rows(rows: jax.Array, query: jax.Array) -> jax.Array:
    """Index of each query in lexicographically sorted distinct rows, or -1 (binary search).

    Args:
      rows: [C, w] int32, sorted lexicographically, distinct.
      query: [B, w] int32.

    Returns:
      [B] int32 row indices (-1 where the query is not a row).
    """
    rows = jnp.asarray(rows)
    num = rows.shape[0]
    lo = jnp.zeros(query.shape[:1], jnp.int32)
    hi = jnp.full(query.shape[:1], num, jnp.int32)

    def halve(_, bounds):  # invariant: rows[:lo] < query <= rows[hi:]
        lo, hi = bounds
        mid = (lo + hi) // 2
        diff = rows[jnp.minimum(mid, num - 1)] - query  # [B, w]
        first = jnp.argmax(diff != 0, axis=-1)
        below = jnp.take_along_axis(diff, first[:, None], axis=-1)[:, 0] < 0  # rows[mid] < query
        open_ = lo < hi
        return jnp.where(open_ & below, mid + 1, lo), jnp.where(open_ & ~below, mid, hi)

    lo, _ = jax.lax.fori_loop(0, max(num, 1).bit_length(), halve, (lo, hi))
    found = (lo < num) & jnp.all(rows[jnp.minimum(lo, num - 1)] == query, axis=-1)
    return jnp.where(found, lo, -1)


def top_next(table: NgramTable, context: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The k most frequent next tokens after each context.

    Args:
      table: the counts of order n.
      context: [B, n - 1] int32 contexts.
      k: next tokens per context.

    Returns:
      tokens [B, k] int32 (most frequent first; -1 past the context's distinct next tokens) and their
      counts [B, k] int32 (0 there, and everywhere for an unseen context).
    """
    index = find_context(table, context)  # [B]
    starts = jnp.asarray(table.starts)
    begin = starts[jnp.maximum(index, 0)]
    end = jnp.where(index >= 0, starts[jnp.maximum(index, 0) + 1], begin)  # [B]
    slot = begin[:, None] + jnp.arange(k)  # [B, k]
    valid = slot < end[:, None]
    last = max(int(table.next_tokens.shape[0]) - 1, 0)
    tokens = jnp.asarray(table.next_tokens)[jnp.minimum(slot, last)]
    counts = jnp.asarray(table.counts)[jnp.minimum(slot, last)]
    return jnp.where(valid, tokens, -1), jnp.where(valid, counts, 0)


def count_of(table: NgramTable, context: jax.Array, token: jax.Array, max_next: int) -> jax.Array:
    """How often `token` [B] followed `context` [B, n - 1] (0 if never), searching the context's
    `max_next` most frequent next tokens (a static bound: pass the table's widest context to be exact)."""
    tokens, counts = top_next(table, context, max_next)
    return jnp.sum(jnp.where(tokens == token[:, None], counts, 0), axis=-1)


def widest_context(table: NgramTable) -> int:
    """The most distinct next tokens any context has (the exact bound for `count_of`)."""
    return int(np.max(np.diff(np.asarray(table.starts)))) if len(table.starts) > 1 else 0


def save_ngram_table(path: str | Path, table: NgramTable) -> None:
    """Writes the table as one .npz (int32 arrays)."""
    np.savez(path, **{name: np.asarray(getattr(table, name)) for name in NgramTable.__dataclass_fields__})


def load_ngram_table(path: str | Path) -> NgramTable:
    """Reads a table written by `save_ngram_table`."""
    with np.load(path) as data:
        return NgramTable(**{name: data[name] for name in NgramTable.__dataclass_fields__})
