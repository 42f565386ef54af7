"""The target distribution: temperature, top-k and top-p against their float64 definition, the candidate
path vs the full sort, batch independence."""

from __future__ import annotations

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from sampling_definition import kept_set, target_probs

from dflax.decoding import sampling

VOCAB = 4096  # > the filter's candidate count, so both of its paths run


def kept(logits: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    filtered = sampling._filter_top_k_top_p(jnp.asarray(logits), jnp.int32(top_k), jnp.float32(top_p))
    return np.asarray(filtered) > sampling.NEG_INF / 2


def rows(scales, seed=0) -> np.ndarray:
    """[len(scales), VOCAB] logits; a large scale gives a peaked distribution, a small one a flat one."""
    rng = np.random.default_rng(seed)
    return np.stack([rng.standard_normal(VOCAB) * s for s in scales]).astype(np.float32)


@pytest.mark.parametrize("top_k, top_p", [(0, 0.9), (0, 0.5), (40, 0.9), (600, 0.8), (1, 1.0)])
def test_kept_set_matches_the_definition(top_k, top_p):
    # Peaked rows have a nucleus inside the candidates; flat rows (scale 0.5) need the full sort.
    logits = rows([8.0, 4.0, 2.0, 0.5])
    got = kept(logits, top_k, top_p)
    for row, got_row in zip(logits, got):
        want = kept_set(row.astype(np.float64), top_k, top_p)
        assert (got_row == want).all(), (int(got_row.sum()), int(want.sum()))


@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [(0.7, 0, 0.9), (1.6, 40, 0.8), (0.5, 600, 1.0), (2.0, 0, 0.5), (0.0, 0, 0.9)],
)
def test_distribution_matches_the_definition(temperature, top_k, top_p):
    """Temperature first, then top-k and the nucleus of the tempered distribution (float64 definition)."""
    logits = rows([8.0, 4.0, 2.0, 0.5])
    params = sampling.SamplingParams.make(temperature, top_k, top_p)
    got = np.exp(np.asarray(sampling.target_log_probs(jnp.asarray(logits), params), np.float64))
    np.testing.assert_allclose(got, target_probs(logits, temperature, top_k, top_p), atol=1e-6, rtol=1e-4)


def test_a_row_keeps_the_same_set_alone_and_beside_a_row_needing_the_full_sort():
    peaked, flat = rows([6.0], seed=1), rows([0.3], seed=2)
    fast = kept(peaked, 0, 0.9)
    assert 1 <= fast.sum() < sampling._CANDIDATES  # alone: the candidate path
    beside = kept(np.concatenate([peaked, flat]), 0, 0.9)  # the flat row sends the batch to the sort
    assert beside[1].sum() > sampling._CANDIDATES
    assert (beside[0] == fast[0]).all()


def test_filter_is_skipped_without_top_k_or_top_p():
    logits = jnp.asarray(rows([1.0]))
    log_probs = sampling.target_log_probs(logits, sampling.SamplingParams.make(1.0))
    np.testing.assert_allclose(np.asarray(log_probs), np.asarray(jax.nn.log_softmax(logits)), atol=1e-6)


def _cond_depths_of_sorts(jaxpr, depth: int = 0) -> list[int]:
    """For every sort in a jaxpr (nested calls included): how many cond branches it sits inside."""
    depths = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "sort":
            depths.append(depth)
        inner = depth + (eqn.primitive.name == "cond")
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            depths += _cond_depths_of_sorts(sub, inner)
    return depths


def test_row_keys_keep_the_full_sort_behind_its_own_branch():
    # The sort must sit behind two branches: "is there a filter at all" and "does some row's nucleus
    # overflow the candidates". Drawing per row under vmap batches the second predicate, which turns that
    # cond into a select that sorts the whole vocabulary at every decode step (it halved batched decoding).
    logits = jnp.asarray(rows([8.0, 8.0, 8.0]))
    keys = jax.vmap(jax.random.key)(jnp.arange(3, dtype=jnp.uint32))
    params = sampling.SamplingParams.make(0.7, 0, 0.9)
    depths = _cond_depths_of_sorts(jax.make_jaxpr(sampling.sample)(keys, logits, params).jaxpr)
    assert depths and min(depths) >= 2, depths
    per_row = jax.vmap(lambda k, lg: sampling.sample(k, lg, params))
    per_row_depths = _cond_depths_of_sorts(jax.make_jaxpr(per_row)(keys, logits).jaxpr)
    assert min(per_row_depths) == min(depths) - 1  # the regression: one branch became a select


def test_row_keys_draw_each_row_from_its_own_key():
    logits = jnp.asarray(rows([0.5, 0.5, 0.5]))
    keys = jax.vmap(jax.random.key)(jnp.arange(3, dtype=jnp.uint32))
    params = sampling.SamplingParams.make(1.0)
    together = sampling.sample(keys, logits, params)
    alone = [sampling.sample(keys[i : i + 1], logits[i : i + 1], params)[0] for i in range(3)]
    assert together.tolist() == [int(a) for a in alone]


def test_first_argmax_is_jnp_argmax_ties_included():
    rng = np.random.default_rng(0)
    logits = rng.integers(-3, 4, size=(5, 7, 300)).astype(np.float32)  # many exact ties
    logits[0, 0] = -np.inf  # every token masked: index 0, as jnp.argmax gives
    logits[1, 2, 17] = logits[1, 2, 250] = 9.0  # the first of two maxima
    got = sampling.first_argmax(jnp.asarray(logits))
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(got, np.argmax(logits, axis=-1))
    assert int(got[1, 2]) == 17
