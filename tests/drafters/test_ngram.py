"""The compact n-gram model: its counts and lookups equal a Python dict built from the same corpus."""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflax.drafters.ngram import (
    build_ngram_table,
    count_of,
    load_ngram_table,
    save_ngram_table,
    top_next,
    widest_context,
)

VOCAB = 5


def corpus(seed=0, num=40):
    rng = np.random.default_rng(seed)
    # Skewed token frequencies, so counts differ and ties between them are broken by token id too.
    return [rng.choice(VOCAB, rng.integers(0, 30), p=[0.4, 0.25, 0.15, 0.12, 0.08]) for _ in range(num)]


def reference(sequences, order):
    """context tuple -> Counter of next tokens, counted with a Python loop."""
    table = defaultdict(Counter)
    for s in sequences:
        for i in range(len(s) - order + 1):
            table[tuple(int(t) for t in s[i : i + order - 1])][int(s[i + order - 1])] += 1
    return table


@pytest.mark.parametrize("order", [2, 3])
def test_lookups_equal_a_python_dict(order, tmp_path):
    sequences = corpus()
    expected = reference(sequences, order)
    table = build_ngram_table(sequences, order)
    save_ngram_table(tmp_path / "ngram.npz", table)
    table = jax.device_put(load_ngram_table(tmp_path / "ngram.npz"))  # what a drafter would query
    assert len(table.contexts) == len(expected) and int(table.counts.sum()) == sum(
        sum(c.values()) for c in expected.values()
    )
    every = list(itertools.product(range(VOCAB + 1), repeat=order - 1))  # token VOCAB never occurs
    context = jnp.asarray(every, jnp.int32)
    k = VOCAB + 1
    tokens, counts = jax.jit(top_next, static_argnums=2)(table, context, k)
    bound = widest_context(table)
    for token in range(VOCAB + 1):
        got = count_of(table, context, jnp.full((len(every),), token, jnp.int32), bound)
        np.testing.assert_array_equal(got, [expected.get(c, Counter())[token] for c in every])
    for i, c in enumerate(every):
        ranked = sorted(expected.get(c, Counter()).items(), key=lambda item: (-item[1], item[0]))
        want_tokens = [t for t, _ in ranked] + [-1] * (k - len(ranked))
        want_counts = [n for _, n in ranked] + [0] * (k - len(ranked))
        assert tokens[i].tolist() == want_tokens and counts[i].tolist() == want_counts, c
    assert any(c not in expected for c in every)  # unseen contexts are asked too


def test_bad_corpus_or_order_is_refused():
    with pytest.raises(ValueError, match="order >= 2"):
        build_ngram_table(corpus(), 1)
    with pytest.raises(ValueError, match="no sequence of 3 tokens"):
        build_ngram_table([np.asarray([1, 2])], 3)
