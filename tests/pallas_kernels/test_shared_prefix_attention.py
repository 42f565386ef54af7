"""Two-level (shared prefix + own part) attention against per-row attention in float64.

Groups of different sizes (with free places), ragged prefixes and own caches (empty ones included), chains
and trees of new tokens, decode (one query) and prefill-like blocks; unread prefix and cache slots hold NaN,
so any read of them shows. A mis-grouped layout (rows swapped between groups) must fail the same check.
The Pallas path (the prefix kernel for level 1, the tree kernel with its log-sum-exp for level 2): the same
oracle in interpret mode on both platforms, the prefix tiles its index map fetches (once per group and KV
head), and lowering for TPU (Mosaic) and CUDA (Triton).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_tree_attention import TRITON_TARGETS

from dflax.decoding.tree import ancestor_mask
from pallas_kernels.shared_prefix import GroupLayout, shared_prefix_attention, shared_prefix_reference
from pallas_kernels.shared_prefix.pallas import prefix_tiles
from pallas_kernels.shared_prefix.traffic import decode_step_traffic, kv_bytes_per_token

TOL = dict(atol=2e-5, rtol=2e-5)


def make_case(seed, groups, prefix_lens, cache_lens, t, heads, kv_heads, mask_kind, slots=40, h=8):
    """Random inputs for rows grouped as `groups` (lists of row indices)."""
    rng = np.random.default_rng(seed)
    b = len(cache_lens)
    prefix_k = rng.normal(size=(len(groups), kv_heads, 48, h)).astype(np.float32)
    prefix_v = rng.normal(size=prefix_k.shape).astype(np.float32)
    for g, plen in enumerate(prefix_lens):
        prefix_k[g, :, plen:], prefix_v[g, :, plen:] = np.nan, np.nan
    k_cache = rng.normal(size=(b, kv_heads, slots, h)).astype(np.float32)
    v_cache = rng.normal(size=k_cache.shape).astype(np.float32)
    for row, clen in enumerate(cache_lens):
        k_cache[row, :, clen:], v_cache[row, :, clen:] = np.nan, np.nan
    if mask_kind == "chain":
        mask = np.broadcast_to(np.tril(np.ones((t, t), bool)), (b, t, t))
    else:  # a random tree per row in topological order: node i's parent is before it
        parents = np.stack([[-1] + [int(rng.integers(0, i)) for i in range(1, t)] for _ in range(b)])
        mask = np.asarray(ancestor_mask(jnp.asarray(parents, jnp.int32)))
    return dict(
        q=rng.normal(size=(b, t, heads, h)).astype(np.float32),
        prefix_k=prefix_k,
        prefix_v=prefix_v,
        prefix_len=np.asarray(prefix_lens, np.int32),
        k_cache=k_cache,
        v_cache=v_cache,
        cache_len=np.asarray(cache_lens, np.int32),
        k_new=rng.normal(size=(b, t, kv_heads, h)).astype(np.float32),
        v_new=rng.normal(size=(b, t, kv_heads, h)).astype(np.float32),
        new_mask=np.ascontiguousarray(mask),
    )


def run_jnp(case, layout, causal):
    args = {k: jnp.asarray(v) for k, v in case.items()}
    return np.asarray(
        shared_prefix_attention(
            args["q"], args["prefix_k"], args["prefix_v"], args["prefix_len"], layout, args["k_cache"],
            args["v_cache"], args["cache_len"], args["k_new"], args["v_new"], args["new_mask"],
            sm_scale=0.3, causal=causal, query_block=4,
        )
    )  # fmt: skip


def run_reference(case, row_group):
    c = case
    return shared_prefix_reference(
        c["q"], c["prefix_k"], c["prefix_v"], c["prefix_len"], row_group, c["k_cache"], c["v_cache"],
        c["cache_len"], c["k_new"], c["v_new"], c["new_mask"], 0.3,
    )  # fmt: skip


CASES = [
    # groups (row lists), prefix lengths, own cache lengths, new tokens, heads, kv heads, mask
    ([[0, 1, 2, 3]], [37], [0, 0, 0, 0], 1, 4, 2, "chain"),  # one group, decode right after the prompt
    ([[0, 3], [1], [2, 4, 5]], [45, 0, 12], [3, 33, 0, 40, 1, 17], 1, 6, 3, "chain"),  # sizes 2, 1, 3
    ([[4, 1, 0], [2, 3]], [20, 48], [0, 9, 35, 2, 40], 5, 8, 2, "chain"),  # verify chain, rows out of order
    ([[0, 1], [2, 3, 4]], [31, 7], [6, 0, 39, 12, 33], 7, 4, 1, "tree"),  # draft trees, MQA
    ([[0, 1, 2]], [48], [0, 0, 0], 9, 6, 2, "chain"),  # a suffix prefill in query blocks of 4
]


@pytest.mark.parametrize("groups, prefix_lens, cache_lens, t, heads, kv_heads, mask", CASES)
def test_two_level_equals_per_row_attention(groups, prefix_lens, cache_lens, t, heads, kv_heads, mask):
    case = make_case(3, groups, prefix_lens, cache_lens, t, heads, kv_heads, mask)
    b = len(cache_lens)
    layout = GroupLayout.of_groups(groups, b, num_groups=len(groups), group_rows=4)  # spare places
    got = run_jnp(case, layout, causal=True)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, run_reference(case, np.asarray(layout.row_group)), **TOL)


def test_a_wrong_grouping_is_caught():
    """The same inputs with two rows' groups swapped differ from the oracle: the check sees grouping."""
    groups, prefix_lens, cache_lens = [[0, 1], [2, 3]], [30, 30], [4, 4, 4, 4]
    case = make_case(5, groups, prefix_lens, cache_lens, 2, 4, 2, "chain")
    wrong = GroupLayout.of_groups([[0, 2], [1, 3]], 4, 2, 2)
    want = run_reference(case, np.array([0, 0, 1, 1]))
    assert not np.allclose(run_jnp(case, wrong, causal=True), want, **TOL)


def test_layout_rejects_overfull_groups():
    with pytest.raises(ValueError, match="do not fit"):
        GroupLayout.of_groups([[0, 1, 2]], 3, num_groups=1, group_rows=2)
    with pytest.raises(ValueError, match="two groups"):
        GroupLayout.of_groups([[0, 1], [1]], 3, num_groups=2, group_rows=2)


# ----------------------------------------------------------------------------------------------------------
# The Pallas kernels (level 1 and 2): interpret mode, tiles fetched, lowering for TPU and CUDA
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("platform", ["gpu", "tpu"])
@pytest.mark.parametrize(
    "case", [CASES[1], CASES[3], CASES[4]], ids=["decode-ragged-groups", "trees", "suffix-prefill"]
)
def test_pallas_levels_equal_per_row_attention(case, platform):
    """Both levels as the platform's kernels (interpret mode): level 1 the prefix tiles, level 2 the tree
    kernel with its log-sum-exp, merged; chains go in causal by index (new_mask=None)."""
    groups, prefix_lens, cache_lens, t, heads, kv_heads, mask = case
    inputs = make_case(4, groups, prefix_lens, cache_lens, t, heads, kv_heads, mask, h=16)  # GPU: H >= 16
    layout = GroupLayout.of_groups(groups, len(cache_lens), num_groups=len(groups), group_rows=4)
    args = {k: jnp.asarray(v) for k, v in inputs.items()}
    new_mask = None if mask == "chain" else args["new_mask"]
    got = shared_prefix_attention(
        args["q"], args["prefix_k"], args["prefix_v"], args["prefix_len"], layout, args["k_cache"],
        args["v_cache"], args["cache_len"], args["k_new"], args["v_new"], new_mask,
        sm_scale=0.3, causal=True, prefix_kernel=platform, interpret=True,
    )  # fmt: skip
    np.testing.assert_allclose(np.asarray(got), run_reference(inputs, np.asarray(layout.row_group)), **TOL)


@pytest.mark.parametrize("rows, t", [(1, 1), (6, 1), (6, 9)])
def test_prefix_tiles_fetched_once_per_group_and_kv_head(rows, t):
    """The prefix K index map, recorded in interpret mode, asks for each (group, KV head, tile) once:
    the same fetches for one row or six, one new token or nine (the per-row layout fetches rows x more)."""
    g, kv, h, slots, block = 2, 3, 16, 256, 64
    q_per_kv = 2
    rng = np.random.default_rng(0)
    x = -(-rows * t * q_per_kv // 8) * 8
    queries = jnp.asarray(rng.normal(size=(g, kv, x, h)), jnp.float32)
    prefix = jnp.asarray(rng.normal(size=(g, kv, slots, h)), jnp.float32)
    fetched = []
    prefix_tiles(
        queries, prefix, prefix, jnp.array([256, 200], jnp.int32), block_kv=block, interpret=True,
        index_probe=lambda *idx: fetched.append(tuple(int(i) for i in idx)),
    )  # fmt: skip
    jax.effects_barrier()
    expected = [(gi, ki, ti) for gi in range(g) for ki in range(kv) for ti in range(slots // block)]
    assert sorted(fetched) == expected


def lowering_args(dtype):
    b, t, heads, kv, h, slots, prefix_slots = 8, 4, 8, 2, 128, 256, 1024
    spec = jax.ShapeDtypeStruct
    return (
        spec((b, t, heads, h), dtype),
        spec((2, kv, prefix_slots, h), dtype),
        spec((2, kv, prefix_slots, h), dtype),
        spec((2,), jnp.int32),
        GroupLayout.of_groups([[0, 1, 2, 3], [4, 5, 6, 7]], b, 2, 4),
        spec((b, kv, slots, h), dtype),
        spec((b, kv, slots, h), dtype),
        spec((b,), jnp.int32),
        spec((b, t, kv, h), dtype),
        spec((b, t, kv, h), dtype),
        spec((b, t, t), jnp.bool_),
    )


def _with_kernel(platform):
    return lambda *args: shared_prefix_attention(*args, sm_scale=0.1, causal=True, prefix_kernel=platform)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_prefix_kernel_lowers_for_tpu(dtype):
    exported = jax.export.export(jax.jit(_with_kernel("tpu")), platforms=["tpu"])(*lowering_args(dtype))
    text = exported.mlir_module()
    assert "tpu_custom_call" in text and "shared_prefix_tiles" in text


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_prefix_kernel_lowers_for_cuda(dtype):
    """Lowered to Triton IR; the export's check of custom-call stability is disabled for Triton's call
    (see test_tree_attention.test_gpu_kernel_lowers)."""
    allow = [jax.export.DisabledSafetyCheck.custom_call(t) for t in TRITON_TARGETS]
    exported = jax.export.export(jax.jit(_with_kernel("gpu")), platforms=["cuda"], disabled_checks=allow)(
        *lowering_args(dtype)
    )
    text = exported.mlir_module()
    assert any(t in text for t in TRITON_TARGETS) and "shared_prefix_tiles" in text


def test_traffic_formula_equals_fetched_tiles():
    """MEMORY_TRAFFIC.md's prefix bytes (one layer) are the kernel's fetched tiles times the tile size."""
    g, kv, h, slots, block, rows = 2, 3, 16, 256, 64, 6
    fetched = []
    prefix = jnp.zeros((g, kv, slots, h), jnp.float32)
    prefix_tiles(
        jnp.zeros((g, kv, 8, h), jnp.float32), prefix, prefix, jnp.array([256, 256], jnp.int32),
        block_kv=block, interpret=True, index_probe=lambda *idx: fetched.append(idx),
    )  # fmt: skip
    jax.effects_barrier()
    tile_bytes = 2 * block * h * 4  # a K tile and its V tile, fp32
    traffic = decode_step_traffic(
        kv_bytes_per_token(1, kv, h, 4), rows=rows * g, prefix=slots, own=0, groups=g
    )
    assert len(fetched) * tile_bytes == traffic.prefix_shared
    assert traffic.prefix_unshared == rows * traffic.prefix_shared
