"""Generation with shared prefixes equals generation without: token for token at T=0, and with the same
seeds at T>0, for plain decoding, DFlash chains and trees, and prompt lookup.

The batch mixes rows under one long common prefix (ragged rests, one of a single token), rows repeating
one prompt (a second group), and a row sharing nothing (the group without a prefix).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dflax
from dflax.decoding.sampling import SamplingParams
from dflax.decoding.shared_prefix import PrefixGroup, prefill_shared, share_groups
from dflax.drafters import load_drafter, prompt_lookup
from dflax.models.cache import KVCache
from dflax.runtime.shapes import packed_bucket
from dflax.runtime.static_batches import _shared_prefix_inputs, generate_ids

SYSTEM = [int(x) for x in np.random.default_rng(0).integers(3, 60, size=45)]
REPEATED = [7, 8, 9] * 14
PROMPTS = [
    SYSTEM + [61, 62, 63, 64, 65],
    SYSTEM + [70],
    SYSTEM + [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22],
    REPEATED,
    REPEATED,
    REPEATED,
    [40, 41, 42],
]


@pytest.fixture(scope="module")
def target(tiny_checkpoint):
    return dflax.load_target(str(tiny_checkpoint("qwen3")[0]))


def run(target, shared, drafter=None, sampling=None, max_new=24):
    return generate_ids(
        target,
        PROMPTS,
        max_new_tokens=max_new,
        sampling=sampling or SamplingParams.make(),
        row_seeds=[11 + i for i in range(len(PROMPTS))],
        batch_size=8,
        drafter=drafter,
        shared_prefix=shared,
    )


def test_share_groups_finds_common_prefixes():
    assert share_groups(PROMPTS) == [
        PrefixGroup([0, 1, 2], 45),
        PrefixGroup([3, 4, 5], 41),  # one token of its own each
        PrefixGroup([6], 0),
    ]
    assert share_groups([SYSTEM[:20] + [1], SYSTEM[:20] + [2]]) == []  # 20 < 32 common tokens
    assert share_groups([[1, 2], [3, 4]]) == []


@pytest.mark.parametrize(
    "drafter_kind", ["plain", "dflash_chain", "dflash_tree", "lookup_chain", "lookup_tree"]
)
def test_greedy_shared_equals_unshared(target, drafter_kind):
    drafter = {
        "plain": None,
        "dflash_chain": load_drafter("untrained", target, block_size=4),
        "dflash_tree": load_drafter("untrained", target, block_size=4).with_tree_budget(6),
        "lookup_chain": prompt_lookup(4),
        "lookup_tree": prompt_lookup(4, tree_budget=6),
    }[drafter_kind]
    want = run(target, "none", drafter)
    got = run(target, "auto", drafter)
    assert [r.tokens for r in got] == [r.tokens for r in want]
    assert [r.stats["steps"] for r in got] == [r.stats["steps"] for r in want]
    assert [r.stats["shared_prefix_tokens"] for r in got] == [45, 45, 45, 41, 41, 41, 0]
    assert all(r.stats["prompt_tokens"] == len(p) for r, p in zip(got, PROMPTS))
    assert got[0].stats["kv_cache_bytes"] < want[0].stats["kv_cache_bytes"]


def test_sampled_shared_equals_unshared_with_the_same_seeds(target):
    sampling = SamplingParams.make(0.9, 0, 0.95)
    want = run(target, "none", sampling=sampling)
    got = run(target, "auto", sampling=sampling)
    assert [r.tokens for r in got] == [r.tokens for r in want]
    # The three rows repeating one prompt drew different samples (their seeds differ).
    assert len({tuple(r.tokens) for r in got[3:6]}) == 3


def test_sampled_dflash_chain_shared_equals_unshared(target):
    drafter = load_drafter("untrained", target, block_size=4)
    sampling = SamplingParams.make(0.8)
    want = run(target, "none", drafter, sampling)
    got = run(target, "auto", drafter, sampling)
    assert [r.tokens for r in got] == [r.tokens for r in want]


def test_bad_shared_prefix_setting(target):
    with pytest.raises(ValueError, match="shared_prefix must be one of"):
        dflax.generate(target, ["hi"], shared_prefix="yes")
    with pytest.raises(ValueError, match="refill_every=None"):
        dflax.generate(target, ["hi"], shared_prefix="auto", refill_every=4)


def test_prefix_kernel_in_generation(tiny_checkpoint, target):
    """With the Pallas backend (interpret mode) the prefix level runs as the kernel: same tokens."""
    kernel_target = dflax.load_target(str(tiny_checkpoint("qwen3")[0]), attention_backend="pallas_interpret")
    want = run(target, "none", max_new=8)
    got = run(kernel_target, "auto", max_new=8)
    assert [r.tokens for r in got] == [r.tokens for r in want]


def test_packed_prefill_equals_padded_prefill(target):
    """The ragged prompt rests (5, 1, 18, 1, 1, 1, 3 tokens) and the prefixes packed back to back give the
    cache of the padded prefill: every layer's K/V in every read slot, and the same first tokens (rows 0-6;
    row 7 is padding in no group, whose prefix part is unspecified)."""
    groups, n = share_groups(PROMPTS), len(PROMPTS)
    batch, offsets = 8, np.zeros(8, np.int32)
    for group in groups:
        offsets[group.rows] = group.length
    lens = np.ones(batch, np.int32)  # a padding row holds one token
    tokens = np.zeros((batch, 32), np.int32)
    for r, ids in enumerate(PROMPTS):
        lens[r] = len(ids) - offsets[r]
        tokens[r, : lens[r]] = ids[offsets[r] :]
    shared_inputs = _shared_prefix_inputs(PROMPTS, groups, batch, offsets)
    sizes = dict(
        packed_prefix=packed_bucket(sum(g.length for g in groups), *shared_inputs[0].shape),
        packed_own=packed_bucket(int(lens.sum()), batch, 32),
    )
    assert None not in sizes.values()  # both parts do run packed here
    rest = (
        jnp.asarray(tokens), jnp.asarray(lens), KVCache.init(target.config, batch, 64, target.cache_dtype),
        jnp.full((batch,), 4), jax.vmap(jax.random.key)(jnp.arange(batch)),
        jnp.asarray(target.eos_ids, jnp.int32), SamplingParams.make(),
    )  # fmt: skip

    def run(**packed):
        prefill = functools.partial(prefill_shared, target.module, max_tokens=4, **packed)
        return jax.jit(prefill)(target.params, *shared_inputs, *rest)

    padded, packed = run(), run(**sizes)
    np.testing.assert_array_equal(packed.last_token[:n], padded.last_token[:n])
    close = functools.partial(np.testing.assert_allclose, atol=1e-5, rtol=1e-5)
    for layer in range(target.config.num_layers):
        for kind in ("k", "v"):
            got, want = getattr(packed.cache, kind)[layer], getattr(padded.cache, kind)[layer]
            for r in range(n):
                close(got[r, :, : lens[r]], want[r, :, : lens[r]])
            got, want = getattr(packed.cache.shared, kind)[layer], getattr(padded.cache.shared, kind)[layer]
            for g, plen in enumerate(np.asarray(padded.cache.shared.lengths)):
                close(got[g, :, :plen], want[g, :, :plen])
