"""The chunked CPU attention (`tree_attention_chunked`) against the float64 dense oracle.

It reads the cache in chunks up to the batch's longest row and scores new tokens in query blocks, so the
cases put cache lengths at, just before and just after chunk boundaries, on caches whose size is not a
multiple of the chunk (the last chunk is moved back and must not count a slot twice), and prompts longer
than one query block under the causal promise. Stale slots hold NaN: any read of them shows.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxpr_equations import equations
from test_tree_attention import call, dense_oracle, make_inputs

from pallas_kernels.tree_attention import tree_attention, tree_attention_chunked
from pallas_kernels.tree_attention.chunked import chunk_size

TOL = dict(atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize(
    "n, cache_lens, max_len, heads, kv_heads, tree, window, cap",
    [
        (1, [0, 1, 127, 128, 129, 300], 300, 3, 1, "chain", None, None),  # decode, S % 128 != 0
        (1, [127, 128, 129], 130, 12, 3, "chain", None, None),  # GQA 4, edges of chunk 2
        (1, [5, 150, 190], 192, 4, 4, "chain", 20, 3.0),  # GQA 1: window far from slot 0, cap
        (1, [40], 40, 6, 2, "chain", None, None),  # a cache smaller than one chunk
        (16, [0, 128, 129, 300], 320, 9, 3, "chain", None, None),  # verify chain, chunk 128
        (9, [1, 255, 256], 272, 8, 2, "random", None, None),  # tree
        (8, [70, 130], 200, 6, 3, "full", 50, None),  # diffusion block (all visible), window
        (12, [250, 260], 270, 4, 1, "random", 100, 2.0),  # tree, window, cap, full last chunk
    ],
)
def test_chunked_matches_dense_oracle(n, cache_lens, max_len, heads, kv_heads, tree, window, cap):
    inputs = make_inputs(
        11, n=n, cache_lens=cache_lens, max_len=max_len, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=16, dtype=jnp.float32, tree=tree,
    )  # fmt: skip
    opts = dict(sliding_window=window, logit_soft_cap=cap)
    got = np.asarray(call(tree_attention_chunked, inputs, **opts))
    assert np.isfinite(got).all()  # NaN in stale slots never leaks
    np.testing.assert_allclose(got, dense_oracle(inputs, **opts), **TOL)


@pytest.mark.parametrize("window", [None, 9])
def test_chunked_prefill_in_query_blocks(window):
    """A 70-token causal prompt in query blocks of 16 with padding rows (a right-padded batch)."""
    inputs = make_inputs(
        12, n=70, cache_lens=[0, 0], max_len=0, num_heads=6, num_kv_heads=2, head_dim=8, dtype=jnp.float32
    )
    lens = np.array([70, 33])
    mask = np.tril(np.ones((70, 70), bool))[None] & (np.arange(70)[None, None, :] < lens[:, None, None])
    inputs["tree_mask"] = jnp.asarray(mask)
    want = dense_oracle(inputs, sliding_window=window)
    for causal in (True, False):
        got = call(tree_attention_chunked, inputs, sliding_window=window, causal=causal, query_block=16)
        np.testing.assert_allclose(np.asarray(got), want, **TOL)


def test_chunked_continues_a_prefilled_prompt():
    """A prompt's second half attends to its first half in the cache: equals prefilling it whole."""
    whole = make_inputs(13, n=96, cache_lens=[0], max_len=0, num_heads=4, num_kv_heads=2, head_dim=8,
                        dtype=jnp.float32)  # fmt: skip
    full = np.asarray(call(tree_attention_chunked, whole, causal=True, query_block=32))
    head_major = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731  [B, T, K, H] -> the cache's [B, K, T, H]
    pad_slots = ((0, 0), (0, 0), (0, 24), (0, 0))
    second = dict(
        whole,
        q=whole["q"][:, 40:],
        k_cache=jnp.pad(head_major(whole["k_new"][:, :40]), pad_slots, constant_values=np.nan),
        v_cache=jnp.pad(head_major(whole["v_new"][:, :40]), pad_slots, constant_values=np.nan),
        cache_len=jnp.asarray([40], jnp.int32),
        k_new=whole["k_new"][:, 40:],
        v_new=whole["v_new"][:, 40:],
        tree_mask=whole["tree_mask"][:, 40:, 40:],
        q_positions=whole["q_positions"][:, 40:],
    )
    got = np.asarray(call(tree_attention_chunked, second, causal=True, query_block=32))
    np.testing.assert_allclose(got, full[:, 40:], **TOL)


def test_chunked_bf16_inputs_accumulate_in_fp32():
    inputs = make_inputs(14, n=4, cache_lens=[100, 3], max_len=136, num_heads=4, num_kv_heads=2, head_dim=16,
                         dtype=jnp.bfloat16)  # fmt: skip
    got = call(tree_attention_chunked, inputs)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), dense_oracle(inputs), atol=2e-2, rtol=2e-2)


def test_chunked_reads_only_the_filled_chunks(monkeypatch):
    """The prefix loop runs over the chunks that hold filled, in-window slots: its trip count follows the
    longest row (and the window), not the number of cache slots."""
    c = chunk_size(1024)
    trips = []
    original = jax.lax.fori_loop

    def counted(lo, hi, body, init):
        return original(lo, hi, lambda i, s: (trips.append(int(i)), body(i, s))[1], init)

    monkeypatch.setattr(jax.lax, "fori_loop", counted)
    inputs = make_inputs(15, n=1, cache_lens=[c, 3], max_len=1024, num_heads=2, num_kv_heads=1, head_dim=8,
                         dtype=jnp.float32)  # fmt: skip
    with jax.disable_jit():  # the loop runs in Python, one body call per chunk
        call(tree_attention_chunked, inputs)
        assert trips == [0]
        trips.clear()
        inputs = dict(inputs, cache_len=jnp.asarray([4 * c, 3 * c + 1], jnp.int32))
        inputs["q_positions"] = inputs["cache_len"][:, None]
        call(tree_attention_chunked, inputs, sliding_window=c + 2)  # row 1 reaches back into chunk 2
        assert trips == [2, 3]


def test_auto_is_chunked_on_cpu():
    inputs = make_inputs(16, n=3, cache_lens=[10, 70], max_len=96, num_heads=2, num_kv_heads=1, head_dim=16,
                         dtype=jnp.float32, tree="random")  # fmt: skip
    auto = call(tree_attention, inputs, backend="auto")
    chunked = call(tree_attention_chunked, inputs)
    np.testing.assert_allclose(np.asarray(auto), np.asarray(chunked), atol=0, rtol=0)


@pytest.mark.parametrize("n", [1, 2, 16])
def test_chunk_products_are_batched_over_leading_row_and_head_axes(n):
    """Both products of the chunk loop batch over (row, kv head) as their two leading axes, with one kv
    head's queries as the rows of each matmul: the form XLA's CPU backend gives its matmul library. With
    the query axis first ([B, T, K, G, C] scores), it emitted a generic dot for the value mix that cost
    a batch-8 verify of 2 tokens 12 ms over 30 layers."""
    inputs = make_inputs(3, n=n, cache_lens=[40, 70], max_len=200, num_heads=6, num_kv_heads=2, head_dim=16,
                         dtype=jnp.float32)  # fmt: skip
    jaxpr = jax.make_jaxpr(lambda x: call(tree_attention_chunked, x))(inputs).jaxpr
    loops = [eqn for eqn in equations(jaxpr) if eqn.primitive.name == "while"]
    assert len(loops) == 1, "the prefix is read in one chunk loop"
    batch_dims = [
        eqn.params["dimension_numbers"][1]  # (lhs batch dims, rhs batch dims)
        for eqn in equations(loops[0].params["body_jaxpr"].jaxpr)
        if eqn.primitive.name == "dot_general"
    ]
    assert batch_dims == [((0, 1), (0, 1))] * 2, batch_dims
