"""The n-gram counts a DART drafter ships with: trigrams and bigrams of its training responses."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from dflax.drafters.ngram import NgramTable, build_ngram_table

DART_NGRAM_ORDERS = (3, 2)  # the beam backs off from trigram to bigram counts


def response_ngram_tables(
    sequences: Iterable[tuple[np.ndarray, int]], min_count: int = 1
) -> tuple[NgramTable, ...]:
    """Trigram and bigram tables of the responses (ids[prompt_len:]), n-grams seen >= min_count times.

    Args:
      sequences: (ids [S] int, prompt_len) pairs.
      min_count: pruning threshold (1 keeps everything).

    Returns:
      The tables, longest order first.
    """
    responses = [np.asarray(ids[prompt_len:], np.int32) for ids, prompt_len in sequences]
    return tuple(build_ngram_table(responses, order, min_count) for order in DART_NGRAM_ORDERS)
