"""This machine's limits for a target, measured in-process: how fast can a decode step possibly be?

Two numbers bound a decode step of `rows` rows from below:
- the weight pass: one GEMV through every weight matrix (each read once), the floor of a batch-1 step,
  where a step is bound by reading the weights from memory;
- the matmul rate: `rows` rows through every weight matrix at once, the floor of a large-batch step, where
  a step is bound by the matrix multiplies.
Bench figures divided by these say how far from the machine's limit a step is.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp

from dflax.cpu_info import cpu_model_and_flags
from dflax.cpu_kernels.few_rows_matmul import cpu_products
from dflax.cpu_kernels.tree_attention import cpu_attention
from dflax.models.layers import dot_float32

# CPU features that decide how fast a bf16 or float32 product runs (AMX and AVX-512 BF16 multiply bf16
# natively; AVX2 has no bf16 arithmetic).
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def machine_facts() -> dict[str, Any]:
    """What this process computes on: backend, devices, CPU model and its matmul-relevant flags, what takes
    a few rows' products on the CPU (`dflax.cpu_kernels.few_rows_matmul.cpu_products`) and a decode step's
    attention (`dflax.cpu_kernels.tree_attention.cpu_attention`), jax."""
    model, flags = cpu_model_and_flags()
    return {
        "backend": jax.default_backend(),
        "devices": [d.device_kind for d in jax.devices()],
        "cpu": model,
        "cpu_flags": [flag for flag in CPU_FLAGS if flag in flags],
        "cpu_count": os.cpu_count(),
        "cpu_products": cpu_products(),
        "cpu_attention": cpu_attention(),
        "jax": jax.__version__,
    }


def _weight_matrices(params) -> list[jax.Array]:
    return [w for w in jax.tree.leaves(params) if getattr(w, "ndim", 0) == 2]


def median_time(fn, *args, reps: int) -> float:
    """Median wall time of fn(*args) over `reps` calls, after one call that compiles it."""
    jax.block_until_ready(fn(*args))  # compile
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_roofline(params, rows: int = 64, reps: int = 7) -> dict[str, Any]:
    """Weight-pass time and matmul rate of these parameters on this machine.

    Args:
      params: a target's parameters (every 2-D leaf is a weight matrix [out, in] or an embedding [V, D],
        the LM head of a tied target).
      rows: rows per matrix in the matmul-rate measurement.
      reps: timed repetitions (the median is reported).

    Returns:
      {"weight_bytes", "weight_pass_s", "weight_pass_gb_per_s", "matmul_rows", "matmul_s",
       "matmul_gflop_per_s"}.
    """
    matrices = _weight_matrices(params)

    def through_all(xs, ws):  # [rows, in] x [out, in]^T for every matrix, summed so nothing is skipped
        # The model's own product (`dot_float32`: float32 accumulation; on the CPU a few rows go to
        # `few_rows_matmul`); a plain bf16 `x @ w` takes XLA's slow single-row path, ~7x a decode step.
        return sum(jnp.sum(dot_float32(x, w)) for x, w in zip(xs, ws))

    fn = jax.jit(through_all)
    weight_bytes = sum(w.size * w.dtype.itemsize for w in matrices)
    flops = 2 * rows * sum(w.size for w in matrices)
    pass_s = median_time(fn, [jnp.ones((1, w.shape[1]), w.dtype) for w in matrices], matrices, reps=reps)
    matmul_s = median_time(fn, [jnp.ones((rows, w.shape[1]), w.dtype) for w in matrices], matrices, reps=reps)
    return {
        "weight_bytes": weight_bytes,
        "weight_pass_s": pass_s,
        "weight_pass_gb_per_s": weight_bytes / pass_s / 1e9,
        "matmul_rows": rows,
        "matmul_s": matmul_s,
        "matmul_gflop_per_s": flops / matmul_s / 1e9,
    }


def step_floor_s(roofline: dict[str, Any], rows: int) -> float:
    """The lower bound of one decode step of `rows` rows (tokens through the weights) on this machine."""
    per_row = roofline["matmul_s"] / roofline["matmul_rows"]
    return max(roofline["weight_pass_s"], rows * per_row)
