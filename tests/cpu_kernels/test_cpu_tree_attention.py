"""`cpu_tree_attention` (tree_attention.cc through XLA's FFI) against the jnp reference, row by row bitwise
where a row's keys are the same, its gradient, and where the models use it."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflax.cpu_kernels import build
from dflax.cpu_kernels.tree_attention import MAX_TOKENS, cpu_tree_attention, cpu_tree_attention_applies
from dflax.models.attention import AttentionConfig, attend
from pallas_kernels.tree_attention import tree_attention_reference

pytestmark = pytest.mark.skipif(
    not build.cpu_has_avx2_fma(), reason="the kernel is for x86 CPUs with AVX2 and FMA"
)

_kernel = jax.jit(cpu_tree_attention, static_argnums=7)


def _operands(batch, tokens, heads, kv_heads, slots, head_dim, seed=0):
    """q, k_cache, v_cache, k_new, v_new (float32) with NaN in the caches' last slots (never filled)."""
    rng = np.random.default_rng(seed)

    def normal(*shape):
        return jnp.asarray(rng.standard_normal(shape), jnp.float32)

    k_cache = normal(batch, kv_heads, slots, head_dim).at[:, :, -3:].set(jnp.nan)
    v_cache = normal(batch, kv_heads, slots, head_dim).at[:, :, -3:].set(jnp.nan)
    q, k_new, v_new = (normal(batch, tokens, n, head_dim) for n in (heads, kv_heads, kv_heads))
    return q, k_cache, v_cache, k_new, v_new


def _tree_mask(batch, tokens, seed=0):
    """[B, T, T] random ancestor-like masks: each token sees itself and a random subset of the others."""
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.random((batch, tokens, tokens)) < 0.5) | jnp.eye(tokens, dtype=bool)


@pytest.mark.parametrize(
    "batch, tokens, heads, kv_heads, slots, head_dim",
    [(1, 1, 9, 3, 300, 64), (2, 17, 9, 3, 300, 64), (3, 5, 4, 4, 40, 32), (2, MAX_TOKENS, 8, 2, 70, 128),
     (1, 3, 2, 1, 16, 256)],
)  # fmt: skip
@pytest.mark.parametrize("masked", [False, True])
def test_matches_the_reference(batch, tokens, heads, kv_heads, slots, head_dim, masked):
    q, k_cache, v_cache, k_new, v_new = _operands(batch, tokens, heads, kv_heads, slots, head_dim)
    cache_len = jnp.asarray([0, slots - 3, 11][:batch], jnp.int32)  # an empty cache and a full one
    mask = _tree_mask(batch, tokens) if masked else None
    assert cpu_tree_attention_applies(q, k_cache, k_new, None, None)
    scale = head_dim**-0.5
    got = _kernel(q, k_cache, v_cache, cache_len, k_new, v_new, mask, scale)
    want = tree_attention_reference(q, k_cache, v_cache, cache_len, k_new, v_new, mask, sm_scale=scale)
    assert not np.isnan(np.asarray(got)).any()
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-6)


def test_a_query_that_sees_no_key_gives_zero():
    q, k_cache, v_cache, k_new, v_new = _operands(1, 2, 2, 1, 8, 64)
    mask = jnp.asarray([[[False, False], [True, True]]])
    got = np.asarray(_kernel(q, k_cache, v_cache, jnp.zeros((1,), jnp.int32), k_new, v_new, mask, 0.125))
    np.testing.assert_array_equal(got[0, 0], 0.0)
    assert np.abs(got[0, 1]).min() > 0


def test_a_rows_result_does_not_depend_on_the_other_rows_or_tokens():
    # 4 query heads per kv head, taken 3 rows at a time: 9 tokens and 4 group their rows differently.
    q, k_cache, v_cache, k_new, v_new = _operands(3, 9, 8, 2, 64, 64, seed=1)
    cache_len = jnp.asarray([40, 7, 61], jnp.int32)
    together = np.asarray(_kernel(q, k_cache, v_cache, cache_len, k_new, v_new, None, 0.125))
    for b in range(3):  # one batch row alone
        alone = _kernel(*(x[b : b + 1] for x in (q, k_cache, v_cache, cache_len, k_new, v_new)), None, 0.125)
        np.testing.assert_array_equal(np.asarray(alone)[0], together[b])
    for count in (1, 4):  # the chain's first tokens
        fewer = _kernel(
            q[:, :count], k_cache, v_cache, cache_len, k_new[:, :count], v_new[:, :count], None, 0.125
        )
        np.testing.assert_array_equal(np.asarray(fewer), together[:, :count])


def test_a_chain_position_attends_bitwise_as_decoding_it_alone_would():
    # Verifying a chain of 6 tokens after 30 cached ones: token i sees the cache and new tokens 0..i;
    # decoding it alone, tokens 0..i-1 are in the cache and it is the one new token.
    q, k_cache, v_cache, k_new, v_new = _operands(1, 6, 9, 3, 64, 64, seed=2)
    verified = np.asarray(_kernel(q, k_cache, v_cache, jnp.asarray([30]), k_new, v_new, None, 0.125))
    for i in range(6):
        k_i = k_cache.at[:, :, 30 : 30 + i].set(jnp.moveaxis(k_new[:, :i], 1, 2))
        v_i = v_cache.at[:, :, 30 : 30 + i].set(jnp.moveaxis(v_new[:, :i], 1, 2))
        decoded = _kernel(
            q[:, i : i + 1],
            k_i,
            v_i,
            jnp.asarray([30 + i]),
            k_new[:, i : i + 1],
            v_new[:, i : i + 1],
            None,
            0.125,
        )
        np.testing.assert_array_equal(np.asarray(decoded)[0, 0], verified[0, i])


def test_a_tree_node_attends_bitwise_as_decoding_it_after_its_ancestors_would():
    # A tree of 7 tokens after 29 cached ones (29 + 1: a node's place among the keys it sees differs from
    # its index, in another of the sums' 8 lanes): token 0 the root, 1-3 its children, 4 a child of 2, 5 of
    # 4, 6 of 1. Decoding node 5 alone, its ancestors 0, 2, 4 are in the cache, without the siblings between.
    parents = [-1, 0, 0, 0, 2, 4, 1]
    q, k_cache, v_cache, k_new, v_new = _operands(1, 7, 9, 3, 64, 64, seed=3)
    ancestry = np.eye(7, dtype=bool)
    for node, parent in enumerate(parents):
        if parent >= 0:
            ancestry[node] |= ancestry[parent]
    verified = np.asarray(
        _kernel(q, k_cache, v_cache, jnp.asarray([29]), k_new, v_new, jnp.asarray(ancestry[None]), 0.125)
    )
    for node in range(7):
        path = [u for u in range(node) if ancestry[node, u]]  # its ancestors, root first
        k_i = k_cache.at[:, :, 29 : 29 + len(path)].set(jnp.moveaxis(k_new[:, path], 1, 2))
        v_i = v_cache.at[:, :, 29 : 29 + len(path)].set(jnp.moveaxis(v_new[:, path], 1, 2))
        decoded = _kernel(
            q[:, node : node + 1],
            k_i,
            v_i,
            jnp.asarray([29 + len(path)]),
            k_new[:, node : node + 1],
            v_new[:, node : node + 1],
            None,
            0.125,
        )
        np.testing.assert_array_equal(np.asarray(decoded)[0, 0], verified[0, node])


def test_its_gradient_is_the_references():
    q, k_cache, v_cache, k_new, v_new = _operands(2, 5, 4, 2, 24, 32, seed=3)
    k_cache, v_cache = jnp.nan_to_num(k_cache), jnp.nan_to_num(v_cache)
    cache_len, mask = jnp.asarray([10, 20], jnp.int32), _tree_mask(2, 5, seed=3)

    def loss(attention):
        def f(q, k_cache, v_cache, k_new, v_new):
            out = attention(q, k_cache, v_cache, cache_len, k_new, v_new, mask)
            return jnp.sum(out * jnp.cos(out))

        return jax.grad(f, argnums=(0, 1, 2, 3, 4))(q, k_cache, v_cache, k_new, v_new)

    got = loss(lambda *a: cpu_tree_attention(*a, 32**-0.5))
    want = loss(lambda *a: tree_attention_reference(*a, sm_scale=32**-0.5))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_attention_it_does_not_take():
    q, k_cache, v_cache, k_new, v_new = _operands(1, MAX_TOKENS + 1, 4, 2, 8, 64)
    assert not cpu_tree_attention_applies(q, k_cache, k_new, None, None)  # a prompt: too many tokens
    q, k_cache, k_new = q[:, :4], k_cache, k_new[:, :4]
    assert cpu_tree_attention_applies(q, k_cache, k_new, None, None)
    assert not cpu_tree_attention_applies(q, k_cache, k_new, 512, None)  # a sliding window
    assert not cpu_tree_attention_applies(q, k_cache, k_new, None, 30.0)  # a logit soft cap
    bf16 = q.astype(jnp.bfloat16)
    assert not cpu_tree_attention_applies(
        bf16, k_cache.astype(jnp.bfloat16), k_new.astype(jnp.bfloat16), None, None
    )
    assert not cpu_tree_attention_applies(q[..., :48], k_cache[..., :48], k_new[..., :48], None, None)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((2, 4), ("data", "model"))):
        assert not cpu_tree_attention_applies(q, k_cache, k_new, None, None)


def test_models_decode_and_verify_attention_goes_through_it_on_the_cpu():
    q, k_cache, v_cache, k_new, v_new = _operands(2, 3, 4, 2, 16, 64)
    cfg = AttentionConfig(256, 4, 2, 64, scale=0.125, rope_theta=1e4, backend="auto")
    cache_len, positions = jnp.asarray([5, 9], jnp.int32), jnp.asarray([[5, 6, 7], [9, 10, 11]], jnp.int32)

    def run(q, k_cache, v_cache, k_new, v_new):
        return attend(cfg, q, k_cache, v_cache, cache_len, k_new, v_new, None, positions, causal=True)

    hlo = jax.jit(run).lower(q, k_cache, v_cache, k_new, v_new).compile().as_text()
    assert "dflax_tree_attention_f32" in hlo
    window = dataclasses.replace(cfg, sliding_window=4)
    chunked = dataclasses.replace(cfg, backend="chunked")
    hlo = (
        jax.jit(lambda *a: attend(window, *a[:3], cache_len, *a[3:], None, positions))
        .lower(q, k_cache, v_cache, k_new, v_new)
        .compile()
        .as_text()
    )
    assert "dflax_tree_attention_f32" not in hlo
    hlo = (
        jax.jit(lambda *a: attend(chunked, *a[:3], cache_len, *a[3:], None, positions))
        .lower(q, k_cache, v_cache, k_new, v_new)
        .compile()
        .as_text()
    )
    assert "dflax_tree_attention_f32" not in hlo  # "chunked" names the jnp path


def test_a_16_bit_models_steps_take_it_over_their_float32_cache():
    """A bf16 target keeps a float32 cache on the CPU: its bf16 queries and new keys and values widen
    (exactly) to take the kernel, and the result, in bf16, is the reference's over the widened operands."""
    q, k_cache, v_cache, k_new, v_new = _operands(2, 3, 4, 2, 16, 64)
    q, k_new, v_new = (x.astype(jnp.bfloat16) for x in (q, k_new, v_new))
    cfg = AttentionConfig(256, 4, 2, 64, scale=0.125, rope_theta=1e4, backend="auto")
    cache_len, positions = jnp.asarray([5, 9], jnp.int32), jnp.asarray([[5, 6, 7], [9, 10, 11]], jnp.int32)

    def run(q, k_cache, v_cache, k_new, v_new):
        return attend(cfg, q, k_cache, v_cache, cache_len, k_new, v_new, None, positions, causal=True)

    assert "dflax_tree_attention_f32" in jax.jit(run).lower(q, k_cache, v_cache, k_new, v_new).as_text()
    got = jax.jit(run)(q, k_cache, v_cache, k_new, v_new)
    q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k_new, v_new))
    want = tree_attention_reference(q32, k_cache, v_cache, cache_len, k32, v32, None, sm_scale=0.125)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want.astype(jnp.bfloat16), np.float32),
                               atol=1e-2)  # fmt: skip
