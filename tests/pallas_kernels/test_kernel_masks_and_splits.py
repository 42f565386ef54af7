"""The kernels' compact masks, causal tile skipping, tile planning and the GPU's split-KV, in interpret mode.

Masks reach the kernels as bit words or as "causal by index" (`tree_mask=None`); both must give what the
dense mask gives, checked against the float64 oracle of test_tree_attention. The plans (which chunks of new
keys a query tile visits, which it sees whole) are checked on a hand-worked case, and the causal plan from
shapes alone must equal the plan read from the causal mask's own words.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from test_tree_attention import TOLERANCE, call, case_seed, dense_oracle, make_inputs

from pallas_kernels.tree_attention import (
    GpuBlockSizes,
    TpuBlockSizes,
    masks,
    tree_attention,
    tree_attention_gpu,
    tree_attention_tpu,
)
from pallas_kernels.tree_attention.tpu import plan_tiles

# ----------------------------------------------------------------------------------------------------------
# Bit words and plans
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("group, rows_per_word", [(3, 8), (2, 32), (1, 16)])
def test_mask_words_expand_to_the_packed_row_mask(group, rows_per_word):
    rng = np.random.default_rng(group)
    t, rows_pad, u_pad = 7, 32, 16
    vis = rng.random((2, t, t)) < 0.5
    words = masks.mask_words(jnp.asarray(vis), group, rows_pad, u_pad, rows_per_word)
    want = np.zeros((2, rows_pad, u_pad), bool)
    want[:, : t * group, :t] = np.repeat(vis, group, axis=1)  # packed row r is token r // group
    got = np.stack([np.asarray(masks.expand_words(w, rows_per_word)) for w in words])
    np.testing.assert_array_equal(got, want)


def test_causal_plan_by_hand_and_from_its_own_words():
    # 10 tokens x 2 heads = 20 packed rows in tiles of 8 (the last has 4 real rows), chunks of 4 keys.
    plan = np.asarray(masks.causal_plan(1, 10, 2, 24, 8, 4, whole_ok=True)).reshape(3, 4)
    # (first, end, full_lo, full_hi): tile 0 (tokens 0-3) sees chunk 0 only, on its diagonal; tile 1
    # (tokens 4-7) sees chunk 0 whole and chunk 1 masked; tile 2 (tokens 8-9) chunks 0-1 whole, 2 masked.
    np.testing.assert_array_equal(plan, [[0, 1, 1, 1], [0, 2, 0, 1], [0, 3, 0, 2]])
    tril = jnp.asarray(np.tril(np.ones((10, 10), bool))[None])
    words = masks.mask_words(tril, 2, 24, 12, 8)
    from_words = masks.words_plan(words, masks.real_row_words(10, 2, 24, 8), 8, 8, 4)
    np.testing.assert_array_equal(np.asarray(from_words).reshape(3, 4), plan)
    windowed = np.asarray(masks.causal_plan(1, 10, 2, 24, 8, 4, whole_ok=False)).reshape(3, 4)
    np.testing.assert_array_equal(windowed[:, :2], plan[:, :2])  # same chunks, all of them masked
    assert (windowed[:, 2] == windowed[:, 3]).all()


def test_tpu_tiles_round_to_the_dtype_packing_and_fit_the_vmem_budget():
    f32 = plan_tiles(5, 1, 64, 128, jnp.float32, TpuBlockSizes(), causal=False, windowed=False)
    bf16 = plan_tiles(5, 1, 64, 128, jnp.bfloat16, TpuBlockSizes(), causal=False, windowed=False)
    assert (f32.block_q, f32.chunk) == (8, 8) and (bf16.block_q, bf16.chunk) == (16, 16)
    assert plan_tiles(40, 1, 0, 128, jnp.bfloat16, TpuBlockSizes(block_q=40), causal=True,
                      windowed=False).block_q == 32  # fmt: skip
    prefill = plan_tiles(4096, 4, 0, 128, jnp.bfloat16, TpuBlockSizes(), causal=False, windowed=True)
    assert prefill.block_q == 512 and prefill.vmem_bytes <= prefill.vmem_limit_bytes <= 64 * 2**20
    small = TpuBlockSizes(vmem_limit_bytes=8 * 2**20)
    tight = plan_tiles(4096, 4, 8192, 256, jnp.float32, small, causal=False, windowed=True)
    assert tight.block_q < 512 and tight.vmem_bytes <= tight.vmem_limit_bytes == 8 * 2**20


def test_gpu_split_estimate_fills_the_sms():
    bs = GpuBlockSizes()
    assert bs.kv_splits_for(programs=8, kv_tiles=64) == 16  # batch-1 verify, 8 KV heads: 128 programs
    assert bs.kv_splits_for(programs=8, kv_tiles=1000) == 17
    assert bs.kv_splits_for(programs=132, kv_tiles=64) == 1  # already full
    assert bs.kv_splits_for(programs=8, kv_tiles=6) == 1  # too short to split
    assert GpuBlockSizes(kv_splits=5).kv_splits_for(programs=500, kv_tiles=3) == 3


# ----------------------------------------------------------------------------------------------------------
# Kernels (interpret mode) against the float64 oracle
# ----------------------------------------------------------------------------------------------------------

KERNELS = {
    "tpu": lambda *a, block_sizes, **kw: tree_attention_tpu(
        *a, **kw, block_sizes=block_sizes, interpret=pltpu.InterpretParams()
    ),
    "gpu": lambda *a, block_sizes, **kw: tree_attention_gpu(
        *a, **kw, block_sizes=block_sizes, interpret=True
    ),
}

# (n, cache_lens, max_len, heads, kv_heads, head_dim, dtype, tree, window, causal by index, tpu, gpu blocks)
CASES = {
    # A prompt after ragged prefixes (0, 45, 64): several query tiles and chunks; tiles skip the chunks
    # above their diagonal and run the ones below unmasked.
    "causal300_ragged_gqa2_f32": (
        300, [0, 45, 64], 64, 4, 2, 64, jnp.float32, "chain", None, True,
        TpuBlockSizes(block_q=128, block_kv=128), GpuBlockSizes(block_q=64, block_kv=32),
    ),
    "causal200_gqa3_bf16": (
        200, [0, 19], 32, 6, 2, 128, jnp.bfloat16, "chain", None, True,
        TpuBlockSizes(block_q=256, block_kv=128), GpuBlockSizes(block_q=32, block_kv=64),
    ),
    # The causal form under a sliding window: every visited chunk masked by positions too.
    "causal150_window_f32": (
        150, [100, 7], 128, 2, 1, 64, jnp.float32, "chain", 40, True,
        TpuBlockSizes(block_q=64, block_kv=128), GpuBlockSizes(block_q=32, block_kv=32),
    ),
    # Trees from parent indices, as bit words: several tiles of words (TPU 512 rows: 16 words of 32).
    "tree160_words_gqa4_bf16": (
        160, [33, 0], 64, 8, 2, 64, jnp.bfloat16, "random", None, False,
        TpuBlockSizes(block_q=512, block_kv=128), GpuBlockSizes(block_q=64, block_kv=32),
    ),
    # GPU split-KV: 3 splits of 16-slot tiles over caches (37, 100, 5) that no tile size divides.
    "split3_tree7_f32": (
        7, [37, 100, 5], 100, 4, 2, 32, jnp.float32, "random", None, False,
        None, GpuBlockSizes(block_kv=16, kv_splits=3),
    ),
    "split_estimate_chain16_bf16": (
        16, [250, 1000], 1000, 4, 1, 64, jnp.bfloat16, "chain", None, True,
        None, GpuBlockSizes(block_kv=16),  # 2 programs, 63 tiles -> 15 splits by the estimate
    ),
    "split4_window_cap_bf16": (
        5, [90, 200], 200, 2, 1, 64, jnp.bfloat16, "random", 60, False,
        None, GpuBlockSizes(block_kv=16, kv_splits=4),
    ),
}  # fmt: skip


@pytest.mark.parametrize(
    "backend, case", [(b, c) for c in CASES for b in ("tpu", "gpu") if CASES[c][10 if b == "tpu" else 11]]
)
def test_kernel_matches_float64_oracle(backend, case):
    n, lens, max_len, heads, kv_heads, head_dim, dtype, tree, window, by_index, tpu_bs, gpu_bs = CASES[case]
    inputs = make_inputs(
        case_seed(case), n=n, cache_lens=lens, max_len=max_len, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=head_dim, dtype=dtype, tree=tree,
    )  # fmt: skip
    cap = 25.0 if "cap" in case else None
    want = dense_oracle(inputs, sliding_window=window, logit_soft_cap=cap)  # from the dense mask
    if by_index:
        inputs = dict(inputs, tree_mask=None)
    got = call(KERNELS[backend], inputs, block_sizes=tpu_bs if backend == "tpu" else gpu_bs,
               sliding_window=window, logit_soft_cap=cap)  # fmt: skip
    assert got.dtype == dtype and got.shape == inputs["q"].shape
    atol, rtol = TOLERANCE[dtype]
    np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)), want, atol=atol, rtol=rtol)


def test_causal_by_index_equals_the_dense_causal_mask_in_every_backend():
    inputs = make_inputs(11, n=40, cache_lens=[9, 0], max_len=16, num_heads=4, num_kv_heads=2, head_dim=32,
                         dtype=jnp.float32)  # fmt: skip
    want = dense_oracle(inputs)
    for backend in ("reference", "chunked", "tpu", "gpu"):
        got = call(tree_attention, dict(inputs, tree_mask=None), backend=backend, interpret=True)
        np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=2e-5, err_msg=backend)
