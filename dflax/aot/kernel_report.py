"""Compiles the tree-attention kernels for v5e (libtpu) and H100 (the CUDA plugin) on this CPU and prints the
compiler's numbers as a markdown table: `python -m dflax.aot.kernel_report`.

Shapes: prefill (one 4096-token prompt, empty cache) and verify (16 chain tokens over a 4096-token cache) of
SmolLM2-135M (9 query / 3 KV heads of 64) and a Qwen3-8B-like layer (32 / 8 heads of 128), bf16. Memory
numbers are XLA's memory_analysis of the whole call (the kernel and its wrapper's XLA ops); the TPU cost
numbers are XLA's cost_analysis, where a Pallas call counts what its `pl.CostEstimate` declares. Nothing
runs on a chip.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp

from dflax.aot.report import CompiledNumbers
from dflax.aot.topology import on_device, tpu_topology
from pallas_kernels.tree_attention import tree_attention

MODELS = {"smollm2-135m": (9, 3, 64), "qwen3-8b": (32, 8, 128)}  # heads, kv heads, head_dim
STAGES = {"prefill4096": (1, 4096, 0), "verify16@4096": (1, 16, 4096)}  # batch, new tokens, cache slots


def abstract_inputs(batch, n, slots, heads, kv_heads, head_dim, dtype, with_mask=True):
    """ShapeDtypeStructs of tree_attention's positional inputs (the mask left out when not `with_mask`)."""
    s = jax.ShapeDtypeStruct
    args = [
        s((batch, n, heads, head_dim), dtype),
        s((batch, kv_heads, slots, head_dim), dtype),
        s((batch, kv_heads, slots, head_dim), dtype),
        s((batch,), jnp.int32),
        s((batch, n, kv_heads, head_dim), dtype),
        s((batch, n, kv_heads, head_dim), dtype),
    ]
    if with_mask:
        args.append(s((batch, n, n), jnp.bool_))
    return tuple(args)


def compile_case(platform: str, model: str, stage: str, dense_mask: bool):
    """Compiles one (platform, model, stage); returns (CompiledNumbers, seconds to lower and compile)."""
    if platform == "tpu":
        device = tpu_topology("v5e:2x2").devices[0]
    else:
        from dflax.aot.gpu import gpu_topology

        device = gpu_topology("h100").devices[0]
    args = abstract_inputs(*STAGES[stage], *MODELS[model], jnp.bfloat16, with_mask=dense_mask)
    if dense_mask:
        fn = lambda *a: tree_attention(*a, backend=platform, causal=True)
    else:  # causal by index: the mask is computed in the kernel
        fn = lambda *a: tree_attention(*a, None, backend=platform, causal=True)
    start = time.perf_counter()
    compiled = jax.jit(fn).lower(*on_device(args, device)).compile()
    return CompiledNumbers.of(compiled), time.perf_counter() - start


def main() -> None:
    """Prints one markdown row per compiled case."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--platforms", default="tpu,gpu")
    parser.add_argument(
        "--causal-mask",
        choices=("dense", "none", "both"),
        default="both",
        help="prefill/verify with a dense [B, T, T] mask, with tree_mask=None, or both",
    )
    args = parser.parse_args()
    masks = {"dense": (True,), "none": (False,), "both": (True, False)}[args.causal_mask]
    print(
        "| chip | model | stage | mask | arguments MiB | outputs MiB | temp MiB | TPU GFLOP "
        "| TPU GB accessed | compile s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for platform in args.platforms.split(","):
        for model in MODELS:
            for stage in STAGES:
                for dense in masks:
                    numbers, seconds = compile_case(platform, model, stage, dense)
                    flops = f"{numbers.flops / 1e9:.2f}" if platform == "tpu" else "-"
                    traffic = f"{numbers.bytes_accessed / 1e9:.3f}" if platform == "tpu" else "-"
                    chip = "v5e" if platform == "tpu" else "H100"
                    mib = [f"{x / 2**20:.1f}" for x in (numbers.argument_bytes, numbers.output_bytes,
                                                        numbers.temp_bytes)]  # fmt: skip
                    mask = "dense bool" if dense else "None (causal)"
                    cells = (chip, model, stage, mask, *mib, flops, traffic, f"{seconds:.1f}")
                    print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
