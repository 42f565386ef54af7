"""The GPU (Triton) tree-attention kernel compiled for H100 and A100 on this CPU: the CUDA plugin's
deviceless compile runs Triton -> PTX -> ptxas. A chosen cover of the static configurations (a GPU compile
takes seconds, not tenths); interpret-mode tests check the numbers."""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import pytest
from test_tpu_kernel_compile import ALL_SHAPES, HEADS, kernel_args

from dflax.aot.report import CompiledNumbers
from dflax.aot.topology import on_device
from pallas_kernels.tree_attention import tree_attention

# The Triton custom call of this jaxlib (0.10.x; "triton_kernel_call_ffi" in later ones).
TRITON_TARGETS = ("__gpu$xla.gpu.triton", "triton_kernel_call_ffi")

# name -> (card, dtype, heads, static shape, window, soft cap, causal by index (tree_mask=None))
CASES = {
    # Batch-1 verify of 8 KV heads: 8 programs, split 8 ways over the 2048-slot cache (split-KV).
    "h100-bf16-qwen3-verify16": ("h100", jnp.bfloat16, "qwen3_32x8_hd128", "verify16", None, None, False),
    "h100-bf16-qwen3-decode_b2": ("h100", jnp.bfloat16, "qwen3_32x8_hd128", "decode_b2", None, None, False),
    "h100-f32-gqa2_hd64-tree60": ("h100", jnp.float32, "gqa2_hd64", "tree60", None, None, False),
    "h100-bf16-gemma3-verify16-window-cap": (
        "h100", jnp.bfloat16, "gemma3_4x1_hd256", "verify16", 512, 30.0, False,
    ),
    "h100-bf16-smollm2-prefill1024": (
        "h100", jnp.bfloat16, "smollm2_9x3_hd64", "prefill1024", None, None, False,
    ),
    "h100-bf16-qwen3-prefill8192-causal": (
        "h100", jnp.bfloat16, "qwen3_32x8_hd128", "prefill8192", None, None, True,
    ),
    "a100-bf16-qwen3-verify16": ("a100", jnp.bfloat16, "qwen3_32x8_hd128", "verify16", None, None, False),
    "a100-bf16-smollm2-prefill1024-window-causal": (
        "a100", jnp.bfloat16, "smollm2_9x3_hd64", "prefill1024", 512, None, True,
    ),
}


@pytest.fixture(scope="module")
def gpu_device():
    """gpu_device(card) -> the device of one such card, to compile for."""
    if importlib.util.find_spec("jax_cuda12_plugin") is None:
        pytest.skip("the CUDA plugin is not installed (bash .ci/setup --test installs it: dflax[gpu-aot])")
    from dflax.aot.gpu import gpu_topology

    return lambda card: gpu_topology(card).devices[0]


@pytest.mark.parametrize("case", list(CASES))
def test_gpu_kernel_compiles(gpu_device, case):
    card, dtype, heads_name, shape_name, window, cap, causal = CASES[case]
    heads, shape = HEADS[heads_name], ALL_SHAPES[shape_name]
    options = dict(backend="gpu", sliding_window=window, logit_soft_cap=cap)
    fn = lambda *a: tree_attention(*a[:6], None if causal else a[6], **options)
    compiled = jax.jit(fn).lower(*on_device(kernel_args(*shape, *heads, dtype), gpu_device(card))).compile()
    text = compiled.as_text()
    assert any(t in text for t in TRITON_TARGETS), case  # the Triton kernel, not a fallback
    numbers = CompiledNumbers.of(compiled)
    cache = 2 * shape[0] * shape[2] * heads[1] * heads[2] * jnp.dtype(dtype).itemsize
    q_bytes = shape[0] * shape[1] * heads[0] * heads[2] * jnp.dtype(dtype).itemsize
    # No copy of the cache, and no dense [rows, keys] mask: at most the split partials (fp32, within half
    # the cache) and the packed queries and outputs.
    assert numbers.temp_bytes < max(cache, 2**20) / 2 + 2 * q_bytes, numbers
