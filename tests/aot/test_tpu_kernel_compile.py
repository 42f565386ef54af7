"""The TPU tree-attention kernel compiled for real TPUs on this CPU (libtpu's deviceless compile, Mosaic's
layout and verification passes included).

What compiles depends only on static shapes and options: dtype, heads / kv heads / head_dim, batch, new
tokens n, cache slots S (an empty cache is the prefill path), the mask's form (a dense mask arrives as bit
words, in one tile or several; `tree_mask=None` is causal by index), sliding window and soft cap. Cache
lengths and mask values are runtime data of the same program; interpret-mode tests (tests/pallas_kernels)
check what it computes for them. The cases below are a chosen cover of the kernel's static paths (each
head layout, dtype, prefix form, mask form and option at least once), not their cross product: each entry
is one compile, and the compiles are among the slowest tests.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from dflax.aot.report import CompiledNumbers
from dflax.aot.topology import on_device, tpu_topology
from pallas_kernels.tree_attention import tree_attention

# name -> (heads, kv heads, head_dim): the models' shapes and the lane-packing paths of the kernel.
HEADS = {
    "smollm2_9x3_hd64": (9, 3, 64),  # head_dim 64: one 64-lane block per kv head
    "gqa2_hd64": (4, 2, 64),  # two kv heads per 128-lane block (queries widened)
    "qwen3_32x8_hd128": (32, 8, 128),
    "gemma3_4x1_hd256": (4, 1, 256),
}
# name -> (batch, n, cache slots): decode, verify chain/tree, a one-slot cache, prefill, a second chunk.
SHAPES = {
    "decode_b2": (2, 1, 1024),
    "verify16": (1, 16, 2048),
    "tree60": (1, 60, 2048),
    "verify16_one_slot": (1, 16, 1),
    "prefill16": (1, 16, 0),
    "prefill64_b2": (2, 64, 0),
    "prefill1024": (1, 1024, 0),
    "prefill1024_after128": (1, 1024, 128),
}
PREFILL_8K = (1, 8192, 0)
ALL_SHAPES = {**SHAPES, "prefill8192": PREFILL_8K}
OPTIONS = {"window512": (512, None), "cap50": (None, 50.0), "window512_cap30": (512, 30.0)}
DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32}


def kernel_args(batch, n, slots, heads, kv_heads, head_dim, dtype):
    """Abstract tree_attention inputs: q, k_cache, v_cache, cache_len, k_new, v_new, tree_mask."""
    s = jax.ShapeDtypeStruct
    return (
        s((batch, n, heads, head_dim), dtype),
        s((batch, kv_heads, slots, head_dim), dtype),
        s((batch, kv_heads, slots, head_dim), dtype),
        s((batch,), jnp.int32),
        s((batch, n, kv_heads, head_dim), dtype),
        s((batch, n, kv_heads, head_dim), dtype),
        s((batch, n, n), jnp.bool_),
    )


def compile_kernel(device, shape, heads, dtype, window=None, cap=None, causal=False):
    """Compiles tree_attention(backend="tpu") for `device` (with `causal`, tree_mask=None: causal by index);
    returns the compiled executable."""
    options = dict(backend="tpu", sliding_window=window, logit_soft_cap=cap)
    if causal:
        fn = lambda *a: tree_attention(*a[:6], None, **options)
    else:
        fn = lambda *a: tree_attention(*a, **options)
    lowered = jax.jit(fn).lower(*on_device(kernel_args(*shape, *heads, dtype), device))
    assert "tree_attention_tpu" in lowered.as_text()  # the Mosaic kernel, not a fallback
    return lowered.compile()


# (dtype, heads, shape, option, mask): a "dense" mask reaches the kernel as bit words; "causal" is
# tree_mask=None.
COVER = [
    ("bf16", "qwen3_32x8_hd128", "decode_b2", None, "dense"),
    ("bf16", "qwen3_32x8_hd128", "verify16", None, "dense"),
    ("bf16", "qwen3_32x8_hd128", "tree60", None, "dense"),
    ("bf16", "qwen3_32x8_hd128", "prefill8192", None, "causal"),
    ("f32", "qwen3_32x8_hd128", "prefill1024_after128", None, "dense"),  # words in several tiles
    ("bf16", "smollm2_9x3_hd64", "prefill1024", None, "dense"),
    ("bf16", "smollm2_9x3_hd64", "prefill1024", None, "causal"),
    ("bf16", "smollm2_9x3_hd64", "verify16", "cap50", "dense"),
    ("f32", "smollm2_9x3_hd64", "decode_b2", None, "dense"),
    ("bf16", "gqa2_hd64", "verify16_one_slot", None, "dense"),
    ("f32", "gqa2_hd64", "prefill16", None, "dense"),
    ("bf16", "gqa2_hd64", "prefill64_b2", None, "causal"),
    ("bf16", "gemma3_4x1_hd256", "verify16", "window512_cap30", "dense"),
    ("bf16", "gemma3_4x1_hd256", "prefill1024", "window512", "causal"),
    ("f32", "gemma3_4x1_hd256", "tree60", "window512_cap30", "dense"),
]
# name -> (dtype, heads, shape, window, soft cap, causal by index)
CASES = {
    "-".join(x for x in (d, h, s, o, m) if x): (
        DTYPES[d], HEADS[h], ALL_SHAPES[s], *OPTIONS.get(o, (None, None)), m == "causal"
    )
    for d, h, s, o, m in COVER
}


@pytest.mark.parametrize("case", list(CASES))
def test_kernel_compiles_for_v5e(tpu_device, case):
    dtype, heads, shape, window, cap, causal = CASES[case]
    compiled = compile_kernel(tpu_device("v5e:2x2"), shape, heads, dtype, window, cap, causal)
    numbers = CompiledNumbers.of(compiled)
    # No dense [rows, keys] mask and no copy of the cache: the temporaries stay below twice the q tensor's
    # size (the packed queries and output) plus 1 MiB.
    batch, n, _ = shape
    q_bytes = batch * n * heads[0] * heads[2] * jnp.dtype(dtype).itemsize
    assert numbers.temp_bytes <= 2 * q_bytes + 2**20, (case, numbers)


# A few configurations for the other generations dflax targets (each compile starts a new topology).
OTHER_GENERATIONS = ["v5p:2x2x1", "v6e:2x2"]
OTHER_CASES = ["bf16-qwen3_32x8_hd128-verify16-dense", "bf16-smollm2_9x3_hd64-prefill1024-causal"]


@pytest.mark.parametrize("topology", OTHER_GENERATIONS)
@pytest.mark.parametrize("case", OTHER_CASES)
def test_kernel_compiles_for_v5p_and_v6e(tpu_device, topology, case):
    dtype, heads, shape, window, cap, causal = CASES[case]
    compile_kernel(tpu_device(topology), shape, heads, dtype, window, cap, causal)  # raises Mosaic's errors


def _verify_numbers(device, n, slots):
    return CompiledNumbers.of(compile_kernel(device, (1, n, slots), HEADS["qwen3_32x8_hd128"], jnp.bfloat16))


def _cache_bytes(slots):
    _, kv_heads, head_dim = HEADS["qwen3_32x8_hd128"]
    return 2 * slots * kv_heads * head_dim * 2  # K and V, bf16


def test_verify_traffic_grows_with_the_cache_not_with_n_times_the_cache(tpu_device):
    """The shared-prefix design: every prefix KV tile is read once per kv head for the whole tree, so the
    compiled verify step's memory traffic does not grow with n, and grows linearly with the cache."""
    device = tpu_device("v5e:2x2")
    decode, verify, verify_short = (
        _verify_numbers(device, n, s) for n, s in ((1, 8192), (16, 8192), (16, 1024))
    )
    assert verify.bytes_accessed < 1.5 * decode.bytes_accessed, (verify, decode)
    assert 6 < verify.bytes_accessed / verify_short.bytes_accessed < 10, (verify, verify_short)
    assert verify.temp_bytes < _cache_bytes(8192) / 8, verify  # no cache-sized scratch
    assert verify.bytes_accessed < 1.5 * _cache_bytes(8192), verify  # one read of the cache, no copy


@pytest.mark.parametrize("heads", ["smollm2_9x3_hd64", "qwen3_32x8_hd128"])
def test_kernel_with_its_log_sum_exp_compiles(tpu_device, heads):
    """return_lse (level 2 of the shared-prefix attention) adds a lane-replicated statistics output."""
    device = tpu_device("v5e:2x2")
    fn = lambda *a: tree_attention(*a, backend="tpu", return_lse=True)
    args = on_device(kernel_args(2, 16, 1024, *HEADS[heads], jnp.bfloat16), device)
    out, lse = jax.jit(fn).lower(*args).compile().out_info
    assert out.shape == args[0].shape and lse.shape == args[0].shape[:3] and lse.dtype == jnp.float32


def test_sharded_kernel_compiles_inside_shard_map(tpu_device):
    """Mosaic kernels are not partitioned automatically: under a batch-sharded mesh the kernel must run
    inside shard_map, one shard per device (the plain jit of the same call is refused). The kernel's
    output declares no varying mesh axes, so shard_map runs with check_vma=False."""
    tpu_device("v5e:2x2")
    topology = tpu_topology("v5e:2x2")
    mesh = jax.sharding.Mesh(topology.devices, ("data",))
    rows = NamedSharding(mesh, PartitionSpec("data"))
    args = [
        jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rows)
        for a in kernel_args(4, 16, 1024, *HEADS["qwen3_32x8_hd128"], jnp.bfloat16)
    ]
    call = lambda *a: tree_attention(*a, backend="tpu")
    with pytest.raises(Exception, match="shard_map"):
        jax.jit(call).lower(*args).compile()
    spec = PartitionSpec("data")
    sharded = jax.shard_map(call, mesh=mesh, in_specs=(spec,) * 7, out_specs=spec, check_vma=False)
    lowered = jax.jit(sharded).lower(*args)
    assert "tree_attention_tpu" in lowered.as_text()
    lowered.compile()
