"""Static shapes of a generation: prompt buckets, cache slots and pack sizes, so a shape compiles once and
serves every later batch that falls in the same bucket."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dflax.decoding.decode import Proposer

if TYPE_CHECKING:
    pass


_MIN_PROMPT_BUCKET = 16


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, (n - 1).bit_length())


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def prompt_bucket(longest: int) -> int:
    """The static prompt length P for prompts of at most `longest` tokens (a power of two, >= 16)."""
    return max(_MIN_PROMPT_BUCKET, next_pow2(longest))


def cache_slots(bucket_p: int, max_new_tokens: int, proposer: Proposer | None) -> int:
    """Cache slots S for a prompt bucket and budget.

    Headroom: a verify step writes n + 1 slots past the committed length. Slots follow the prompt bucket
    (one decode compile per bucket); empty slots cost nothing to the attention on any backend.
    """
    return _round_up(bucket_p + max_new_tokens + (proposer.num_draft if proposer else 0) + 1, 64)


def packed_bucket(tokens: int, rows: int, length: int) -> int | None:
    """The static pack size for `tokens` real prompt tokens of a [rows, length] bucket, or None when packing
    would not save work. Sizes are multiples of an eighth of the next power of two (at least 16): at most
    four sizes (compiles) per octave, at most 1.25x the need."""
    size = _round_up(tokens, max(_MIN_PROMPT_BUCKET, next_pow2(tokens) // 8))
    return size if size < rows * length else None
