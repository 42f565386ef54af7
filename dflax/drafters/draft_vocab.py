"""A drafter's pruned vocabulary: the target tokens its LM head reads out (as in FR-Spec and EAGLE-3).

Reading out the V' most frequent tokens of the training responses instead of all V makes the drafter's LM
head (most of a draft forward and of a training step) V / V' times cheaper. Verification still scores the
full vocabulary, so decoding stays exact: a token outside the draft vocabulary is never drafted, only
produced by the target as its correction or bonus token.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


def frequent_tokens(sequences: Iterable[tuple[np.ndarray, int]], size: int, vocab_size: int) -> np.ndarray:
    """The `size` most frequent response tokens, most frequent first (equal counts: lower id first).

    Args:
      sequences: (ids [S] int, prompt_len) pairs; the response is ids[prompt_len:].
      size: V', tokens to keep (1 <= size <= vocab_size).
      vocab_size: V of the target.

    Returns:
      [V'] int32 token ids.
    """
    if not 1 <= size <= vocab_size:
        raise ValueError(f"draft vocabulary size must be in [1, {vocab_size}] (the target's), got {size}")
    counts = np.zeros(vocab_size, np.int64)
    for ids, prompt_len in sequences:
        counts += np.bincount(np.asarray(ids[prompt_len:], np.int64), minlength=vocab_size)[:vocab_size]
    order = np.lexsort((np.arange(vocab_size), -counts))  # by count descending, then by id
    return order[:size].astype(np.int32)


def check_draft_vocab(draft_vocab: np.ndarray, vocab_size: int) -> np.ndarray:
    """The ids as a [V'] int32 array; raises ValueError unless they are distinct target token ids."""
    ids = np.asarray(draft_vocab)
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(
            f"a draft vocabulary is a non-empty 1-D array of token ids, got {ids.dtype}{ids.shape}"
        )
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ValueError(
            f"draft vocabulary ids must lie in [0, {vocab_size}), got [{ids.min()}, {ids.max()}]"
        )
    if np.unique(ids).size != ids.size:
        raise ValueError("draft vocabulary ids must be distinct")
    return ids.astype(np.int32)


def vocab_index(draft_vocab: np.ndarray, vocab_size: int) -> np.ndarray:
    """[V] int32: each target token's index in the draft vocabulary, -1 for tokens outside it."""
    index = np.full(vocab_size, -1, np.int32)
    index[draft_vocab] = np.arange(len(draft_vocab), dtype=np.int32)
    return index
