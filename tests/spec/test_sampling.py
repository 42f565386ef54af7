"""The top-k / top-p filter: the exact kept set, the candidate path vs the full sort, batch independence."""

from __future__ import annotations

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest

from dflax.spec import sampling

VOCAB = 4096  # > the filter's candidate count, so both of its paths run


def kept_by_definition(logits: np.ndarray, top_k: int, top_p: float) -> np.ndarray:
    """float64 reference: the top-k set, then the smallest most-likely prefix whose mass reaches top_p."""
    order = np.argsort(-logits, kind="stable")
    k = top_k if top_k > 0 else logits.size
    in_k = order[:k]
    probs = np.exp(logits[in_k] - logits[in_k].max())
    probs /= probs.sum()
    before = np.cumsum(probs) - probs
    n_keep = max(int(np.sum(before < top_p)), 1)
    kept = np.zeros(logits.size, bool)
    kept[logits >= logits[in_k[n_keep - 1]]] = True
    return kept


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
        want = kept_by_definition(row.astype(np.float64), top_k, top_p)
        assert (got_row == want).all(), (int(got_row.sum()), int(want.sum()))


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
