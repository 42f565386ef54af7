"""A token's hidden states and logits do not depend on how many tokens share its forward.

Greedy speculative decoding is lossless bit for bit only when a verify block computes each position as a
1-token decode step would. Two XLA CPU programs broke that, and a bf16 target turned their last-bit
differences into top-2 flips: a reduce orders its additions by the whole array's shape (an RMSNorm
summed with `jnp.mean` differed between [1, 576] and [8, 576]; the norm test fails with it), and RoPE's
angle product fused into its cos and sin rounded differently for 1 and 8 new tokens (the whole-model
test fails for float32 without the barrier in `apply_rope`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflax.models.cache import KVCache
from dflax.models.config import ModelConfig
from dflax.models.layers import RMSNorm, row_sum
from dflax.models.transformer import Transformer

WIDTH = 576  # SmolLM2-135M's hidden size, a width where XLA's order changed with the row count


@pytest.mark.parametrize("width", [1, 7, 64, 576, 1000])
def test_row_sum_is_the_sum(width):
    x = np.random.default_rng(width).standard_normal((3, width)).astype(np.float32)
    got = np.asarray(jax.jit(row_sum)(jnp.asarray(x)))
    assert got.shape == (3, 1)
    np.testing.assert_allclose(got[:, 0], x.astype(np.float64).sum(axis=-1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [8, 19])
def test_rms_norm_of_a_row_alone_equals_it_among_others(rows):
    x = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, WIDTH)), jnp.float32)
    norm = RMSNorm(1e-5)
    params = norm.init(jax.random.key(0), x)
    apply = jax.jit(norm.apply)
    np.testing.assert_array_equal(np.asarray(apply(params, x[:1])), np.asarray(apply(params, x))[:1])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_verify_blocks_first_row_equals_a_decode_step(dtype):
    """Two llama layers of SmolLM2's widths over a 40-token prefix: the logits of one new token alone
    and of the same token first in an 8-token block are bitwise equal."""
    config = ModelConfig(
        arch="llama",
        vocab_size=512,
        hidden_size=WIDTH,
        intermediate_size=1536,
        num_layers=2,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
    )
    model = Transformer(config, dtype)
    prefix, block = 40, 8
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(3, 512, (1, prefix + block)), jnp.int32)
    empty = KVCache.init(config, 1, 64, jnp.float32)
    params = model.init(jax.random.key(0), tokens[:, :prefix], jnp.arange(prefix)[None], empty, None)

    @jax.jit
    def prefill(params):
        _, cache, _ = model.apply(
            params, tokens[:, :prefix], jnp.arange(prefix)[None], empty, None, empty_cache=True
        )
        return cache.replace(lengths=jnp.array([prefix], jnp.int32))

    @jax.jit
    def logits(params, cache, new):  # new [1, T] after the prefix -> [1, T, V]
        positions = prefix + jnp.arange(new.shape[1])[None]
        hidden, _, _ = model.apply(params, new, positions, cache, None)
        return model.apply(params, hidden, method=model.logits)

    cache = prefill(params)
    alone = logits(params, cache, tokens[:, prefix : prefix + 1])
    first_of_block = logits(params, cache, tokens[:, prefix:])[:, :1]
    np.testing.assert_array_equal(np.asarray(alone), np.asarray(first_of_block))
