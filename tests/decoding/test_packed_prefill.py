"""Packed prefill (the token-wise work on the real prompt tokens only) equals the padded prefill.

Compared: the first sampled token and its logits' source (the last hidden state), every filled cache slot
of every layer, and the DFlash drafter's context cache, on ragged prompts, for a llama-family target and a
Gemma 3 target whose sliding window (8) is shorter than the prompts.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflax
from dflax.decoding.decode import prefill
from dflax.decoding.sampling import SamplingParams
from dflax.models.cache import KVCache
from dflax.models.packing import Packing
from dflax.runtime.shapes import packed_bucket

LENGTHS = [45, 1, 60, 7]  # a one-token prompt; rows inside and across the pack's blocks of 64
BUCKET = 64


def run_prefill(target, drafter, packed):
    b = len(LENGTHS)
    rng = np.random.default_rng(0)
    tokens = np.zeros((b, BUCKET), np.int32)
    for r, n in enumerate(LENGTHS):
        tokens[r, :n] = rng.integers(3, target.config.vocab_size, n)
    fn = jax.jit(
        functools.partial(
            prefill, target.module, proposer=drafter.proposer, max_tokens=8, packed_tokens=packed
        )
    )
    return fn(
        target.params,
        jnp.asarray(tokens),
        jnp.asarray(LENGTHS, jnp.int32),
        KVCache.init(target.config, b, 128, jnp.float32),
        jnp.full((b,), 8, jnp.int32),
        jax.vmap(jax.random.key)(jnp.arange(b, dtype=jnp.uint32)),
        jnp.asarray([0], jnp.int32),
        SamplingParams.make(0.0),
        drafter.params,
    )


def assert_filled_slots_equal(a: KVCache, b: KVCache):
    for layer_a, layer_b in zip(a.k + a.v, b.k + b.v):
        for r, n in enumerate(LENGTHS):
            np.testing.assert_allclose(layer_a[r, :, :n], layer_b[r, :, :n], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("arch", ["smollm2-like", "gemma3"])
def test_packed_prefill_equals_padded(tiny_checkpoint, arch):
    target = dflax.load_target(str(tiny_checkpoint(arch)[0]))
    drafter = dflax.load_drafter("untrained", target, block_size=4)
    packed = packed_bucket(sum(LENGTHS), len(LENGTHS), BUCKET)
    assert packed == 128  # 113 tokens: a pack of 128 against 4 x 64 padded
    want, got = run_prefill(target, drafter, None), run_prefill(target, drafter, packed)
    np.testing.assert_array_equal(got.last_token, want.last_token)
    np.testing.assert_array_equal(got.cache.lengths, want.cache.lengths)
    assert_filled_slots_equal(got.cache, want.cache)
    assert_filled_slots_equal(got.drafter_state, want.drafter_state)


def test_pack_and_unpack_round_trip():
    lengths = jnp.asarray([3, 1, 4], jnp.int32)
    packing = Packing.of_lengths(lengths, 4, 10)
    np.testing.assert_array_equal(packing.segment_ids, [0, 0, 0, 1, 2, 2, 2, 2, -1, -1])
    np.testing.assert_array_equal(packing.index, [0, 1, 2, 4, 8, 9, 10, 11, 12, 12])
    x = jnp.arange(12).reshape(3, 4) + 1
    packed = packing.pack(x)
    np.testing.assert_array_equal(packed, [1, 2, 3, 5, 9, 10, 11, 12, 0, 0])
    np.testing.assert_array_equal(packing.unpack(packed), [[1, 2, 3, 0], [5, 0, 0, 0], [9, 10, 11, 12]])


def test_packed_bucket_sizes():
    assert packed_bucket(51, 4, 32) == 64
    assert packed_bucket(7045, 64, 512) == 7168 and packed_bucket(6000, 64, 512) == 6144
    assert packed_bucket(120, 4, 32) is None  # no saving against 4 x 32
