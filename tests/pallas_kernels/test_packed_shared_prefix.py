"""`packed_shared_prefix_attention` (packed prompt rests over shared prefixes, the CPU prefill path) against
the float64 two-level oracle.

Ragged rests (a single token, rows across block edges, one longer than a block), groups of different sizes
and prefix lengths, a group without a prefix whose rows are not next to each other, blocks spanning several
groups, and an unused pack tail. Unread prefix slots and the tail hold NaN, so any read of them shows. A
wrong row -> group map must fail the same check.
"""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.shared_prefix import shared_prefix_reference
from pallas_kernels.shared_prefix.packed import packed_shared_prefix_attention

TOL = dict(atol=2e-5, rtol=2e-5)


def make_case(seed, lengths, row_group, prefix_lens, size, heads, kv_heads, slots=48, h=8):
    """Random packed rests of `lengths` tokens (rows in order), their groups and the groups' prefixes."""
    rng = np.random.default_rng(seed)
    used = sum(lengths)
    prefix_k = rng.normal(size=(len(prefix_lens), kv_heads, slots, h)).astype(np.float32)
    prefix_v = rng.normal(size=prefix_k.shape).astype(np.float32)
    for g, plen in enumerate(prefix_lens):
        prefix_k[g, :, plen:], prefix_v[g, :, plen:] = np.nan, np.nan
    q = rng.normal(size=(size, heads, h)).astype(np.float32)
    k = rng.normal(size=(size, kv_heads, h)).astype(np.float32)
    v = rng.normal(size=(size, kv_heads, h)).astype(np.float32)
    k[used:], v[used:] = np.nan, np.nan
    segments = np.full(size, -1, np.int32)
    segments[:used] = np.repeat(np.arange(len(lengths)), lengths)
    return dict(
        q=q, k=k, v=v, segments=segments, lengths=lengths, row_group=np.asarray(row_group, np.int32),
        prefix_k=prefix_k, prefix_v=prefix_v, prefix_len=np.asarray(prefix_lens, np.int32),
    )  # fmt: skip


def run_packed(case, row_group, **options):
    segments = case["segments"]
    token_group = np.where(segments >= 0, row_group[np.maximum(segments, 0)], -1).astype(np.int32)
    out = packed_shared_prefix_attention(
        *(jnp.asarray(case[name]) for name in ("q", "k", "v", "segments")), jnp.asarray(token_group),
        *(jnp.asarray(case[name]) for name in ("prefix_k", "prefix_v", "prefix_len")), **options,
    )  # fmt: skip
    return np.asarray(out)


def oracle(case):
    """Each row's rest as T new tokens (causal) over an empty own cache, unpacked, by the float64 oracle."""
    lengths, kv = case["lengths"], case["k"].shape[1]
    b, t, h = len(lengths), max(lengths), case["q"].shape[2]
    starts = np.cumsum([0, *lengths[:-1]])

    def unpack(x):
        out = np.zeros((b, t, *x.shape[1:]), np.float32)
        for row, (s, n) in enumerate(zip(starts, lengths)):
            out[row, :n] = x[s : s + n]
        return out

    real = np.arange(t)[None, None, :] < np.asarray(lengths)[:, None, None]
    mask = np.tril(np.ones((t, t), bool))[None] & real  # [B, T, T] causal over each row's rest
    empty = np.zeros((b, kv, 0, h), np.float32)  # no own cache
    padded = shared_prefix_reference(
        unpack(case["q"]), case["prefix_k"], case["prefix_v"], case["prefix_len"], case["row_group"], empty,
        empty, np.zeros(b, np.int32), unpack(case["k"]), unpack(case["v"]), mask, h**-0.5,
    )  # fmt: skip
    return np.concatenate([padded[row, :n] for row, n in enumerate(lengths)])


CASES = {
    # 3 rows under a 45-slot prefix, 3 under a 41-slot one, 1 alone; blocks of 16 span groups.
    "two_groups_and_a_loner": dict(
        lengths=[5, 1, 18, 1, 1, 1, 3], row_group=[0, 0, 0, 1, 1, 1, 2], prefix_lens=[45, 41, 0], size=32,
        heads=4, kv_heads=2, block=16, prefix_chunk=16,
    ),
    # The prefix-less group's rows sit between shared ones; a rest longer than a block; a long tail.
    "loners_between_groups": dict(
        lengths=[2, 40, 7, 9, 1], row_group=[1, 0, 1, 0, 2], prefix_lens=[30, 0, 48], size=96, heads=6,
        kv_heads=3, block=16, prefix_chunk=8,
    ),
    # Default block and chunk, GQA 1, one group of all rows.
    "one_group_defaults": dict(
        lengths=[13, 29, 4], row_group=[0, 0, 0], prefix_lens=[37], size=64, heads=2, kv_heads=2,
        block=None, prefix_chunk=None,
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_packed_rests_match_rows_alone(name):
    spec = dict(CASES[name])
    options = dict(block=spec.pop("block"), prefix_chunk=spec.pop("prefix_chunk"))
    case = make_case(sum(spec["lengths"]), **spec)
    got = run_packed(case, case["row_group"], **options)
    used = sum(case["lengths"])
    np.testing.assert_allclose(got[:used], oracle(case), **TOL)
    assert np.all(got[used:] == 0)  # the unused tail sees nothing


def test_wrong_group_map_fails():
    spec = dict(CASES["two_groups_and_a_loner"])
    options = dict(block=spec.pop("block"), prefix_chunk=spec.pop("prefix_chunk"))
    case = make_case(1, **spec)
    swapped = case["row_group"].copy()
    swapped[[0, 3]] = swapped[[3, 0]]  # row 0 reads group 1's prefix and row 3 group 0's
    got = run_packed(case, swapped, **options)
    assert not np.allclose(got[: sum(case["lengths"])], oracle(case), **TOL)
