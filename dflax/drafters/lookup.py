"""Prompt lookup: a training-free drafter that copies what followed the latest n-gram's last occurrence.

Each row keeps its token history (prompt and output so far) on device, one slot per position. To draft,
the row's last n tokens (n = 3, then 2, then 1: the longest n that matches wins) are matched against
the history, and the k tokens that followed the most recent earlier occurrence are proposed as a chain.
Where the history ends before k tokens, the match's continuation repeats (a repeating pattern goes on
repeating). Without any match the row proposes its last token k times, which costs a verify like any
draft. Drafts are deterministic, so the delta rule verifies them at every temperature.

As in HF transformers' `prompt_lookup_num_tokens` (Saxena, "Prompt Lookup Decoding", 2023), everything
here is static-shape jnp inside the decode loop: one [B, S] comparison per n-gram size and position.

Glossary: B batch, S history slots (the target cache's), k drafts per step, g n-gram size.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from dflax.decoding.cache import write_rows

NGRAM_SIZES = (3, 2, 1)
LOOKUP_BLOCK_SIZE = 8  # the last token + 7 drafts (HF's prompt_lookup_num_tokens defaults to 10 drafts)


@struct.dataclass
class History:
    """A row's tokens by absolute position.

    Attributes:
      tokens: [B, S] int32; slot j holds the token at position j for every position whose K/V the target's
        cache holds (slots from the cache length on are stale and never read).
    """

    tokens: jax.Array


def latest_match(sequence: jax.Array, length: jax.Array, ngram_sizes: tuple[int, ...] = NGRAM_SIZES):
    """Where the last n tokens occurred most recently before, for the longest n that occurs at all.

    Args:
      sequence: [B, S] int32 tokens; entries at or beyond `length` are ignored.
      length: [B] int32 valid tokens per row (>= 1).
      ngram_sizes: n-gram sizes to try, longest first.

    Returns:
      continuation_start: [B] int32 index of the token that followed the matched occurrence (the
        occurrence ends before length - 1, so it has one), or -1 where no size matched.
    """
    b, s = sequence.shape
    index = jnp.arange(s)
    found = jnp.full((b,), -1, jnp.int32)
    for g in sorted(ngram_sizes):  # shorter sizes first, so each longer size overrides them
        tail_index = jnp.maximum(length[:, None] - g + jnp.arange(g), 0)  # [B, g]
        tail = jnp.take_along_axis(sequence, tail_index, axis=1)  # [B, g]
        matches = jnp.ones((b, s), jnp.bool_)
        for t in range(g):  # window starting at j equals the tail: sequence[j + t] == tail[t]
            shifted = jnp.pad(sequence[:, t:], ((0, 0), (0, t)), constant_values=-1)  # [B, S]
            matches &= shifted == tail[:, t : t + 1]
        # j + g <= length - 1: the occurrence ends before the last token, so a token followed it.
        matches &= index[None] + g <= length[:, None] - 1
        latest = jnp.max(jnp.where(matches, index[None], -1), axis=1)  # [B]
        found = jnp.where(latest >= 0, latest + g, found).astype(jnp.int32)
    return found


def lookup_drafts(sequence: jax.Array, length: jax.Array, num_draft: int) -> jax.Array:
    """The k tokens that followed the latest occurrence of the row's last n-gram (see module docstring).

    Args:
      sequence: [B, S] int32 tokens, valid up to `length`.
      length: [B] int32 valid tokens per row (>= 1).
      num_draft: k.

    Returns:
      [B, k] int32 drafts.
    """
    start = latest_match(sequence, length)  # [B]
    last = jnp.take_along_axis(sequence, (length - 1)[:, None], axis=1)  # [B, 1]
    period = jnp.maximum(length - start, 1)[:, None]  # [B, 1] tokens known after the match
    offsets = start[:, None] + jnp.arange(num_draft) % period  # [B, k]
    copied = jnp.take_along_axis(sequence, jnp.clip(offsets, 0, sequence.shape[1] - 1), axis=1)
    return jnp.where(start[:, None] >= 0, copied, last).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class PromptLookupProposer:
    """Prompt lookup as the decode loop's `Proposer` (equal settings compare equal: one compile).

    Attributes:
      num_draft: k, drafts per step.
    """

    num_draft: int
    tap_layers: tuple[int, ...] = ()

    def init_state(self, batch: int, slots: int, dtype: jnp.dtype) -> History:
        """An empty history of one slot per cache slot."""
        return History(jnp.zeros((batch, slots), jnp.int32))

    def observe(self, params, history: History, tokens, taps, positions, count) -> History:
        """Writes the tokens at their positions (those past `count` land beyond the length: stale)."""
        return History(write_rows(history.tokens, tokens, positions[:, 0]))

    def propose(self, params, target_params, state, keys) -> tuple[jax.Array, None]:
        """Drafts [B, k] from the history plus the last committed token (at position cache length)."""
        length = state.cache.lengths
        sequence = write_rows(state.drafter_state.tokens, state.last_token[:, None], length)  # [B, S]
        return lookup_drafts(sequence, length + 1, self.num_draft), None


@dataclasses.dataclass(frozen=True)
class LookupDrafter:
    """Prompt lookup bound for `dflax.generate(..., drafter=)`: no parameters, k drafts per step.

    Attributes:
      proposer: the static proposer.
      name: "lookup".
    """

    proposer: PromptLookupProposer
    name: str = "lookup"
    params: None = None

    def with_block_size(self, block_size: int) -> LookupDrafter:
        """Prompt lookup verifying blocks of `block_size` tokens (the last token + block_size - 1 drafts)."""
        return prompt_lookup(block_size)


def prompt_lookup(block_size: int = LOOKUP_BLOCK_SIZE) -> LookupDrafter:
    """A prompt-lookup drafter: each step verifies the last token and block_size - 1 copied drafts.

    Raises:
      ValueError: when block_size < 2.
    """
    if block_size < 2:
        raise ValueError(f"block size must be >= 2 (the anchor plus at least one draft), got {block_size}")
    return LookupDrafter(PromptLookupProposer(block_size - 1))
