"""The TPU kernel with more new tokens than one KV tile (long prefill, big trees), in interpret mode.

The new tokens then run in several chunks on the grid's last axis, and a query tile only visits the
chunks it can see (for a causal prefill: up to its diagonal). Each case is checked against the reference.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from test_tree_attention import TOLERANCE, call, make_inputs

from pallas_kernels.tree_attention import TpuBlockSizes, tree_attention_reference, tree_attention_tpu

# (n, cache_lens, max_len, heads, kv_heads, head_dim, dtype, tree, window, block sizes)
CHUNKED_CASES = {
    # Empty cache, 3 chunks of 128 keys, 5 query tiles of 128 rows: tiles skip chunks above the diagonal.
    "prefill300_gqa2_f32": (
        300, [0, 0], 0, 4, 2, 64, jnp.float32, "chain", None, TpuBlockSizes(block_q=128, block_kv=128),
    ),
    # A 200-node tree over a ragged prefix, in bf16 under a sliding window (some chunks fully masked).
    "tree200_window_bf16": (
        200, [130, 7], 256, 2, 1, 128, jnp.bfloat16, "random", 64, TpuBlockSizes(block_q=64, block_kv=128),
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CHUNKED_CASES))
def test_chunked_tree_part_matches_reference(case):
    n, lens, max_len, heads, kv_heads, head_dim, dtype, tree, window, block_sizes = CHUNKED_CASES[case]
    inputs = make_inputs(
        7, n=n, cache_lens=lens, max_len=max_len, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
        dtype=dtype, tree=tree,
    )  # fmt: skip
    want = np.asarray(call(tree_attention_reference, inputs, sliding_window=window).astype(jnp.float32))
    got = call(
        tree_attention_tpu,
        inputs,
        sliding_window=window,
        block_sizes=block_sizes,
        interpret=pltpu.InterpretParams(),
    )
    atol, rtol = TOLERANCE[dtype]
    np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)), want, atol=atol, rtol=rtol)
