"""The `kernels` stage of tools/device_check.py: each Pallas kernel of `pallas_kernels` against its reference.

Each case calls the kernel compiled for the device (Triton on GPU, Mosaic on TPU; interpret mode on a CPU)
and its reference at the same inputs, on the device, and records the largest absolute error, whether every
element is within the dtype's tolerance, and the kernel's median time. Unused cache slots hold NaN, so a
kernel that reads past a row's length shows NaN (counted as `nonfinite`).
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from device_check import Recorder, Settings


# Kernel vs reference tolerances (atol, rtol) by dtype, as tests/pallas_kernels use them.
TOLERANCE = {"float32": (2e-5, 2e-5), "bfloat16": (3e-2, 3e-2)}


@dataclasses.dataclass(frozen=True)
class AttentionCase:
    """One `tree_attention` call: new tokens per row over ragged caches (unused slots hold NaN)."""

    name: str
    new_tokens: int
    cache_lens: tuple[int, ...]
    slots: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    mask: str = "causal"  # "causal": tree_mask=None, as prefill and chains pass it; "tree": a random tree
    window: int | None = None
    soft_cap: float | None = None


@dataclasses.dataclass(frozen=True)
class SharedPrefixCase:
    """One `shared_prefix_attention` call with both levels as the platform's kernels."""

    name: str
    groups: tuple[tuple[int, ...], ...]
    prefix_lens: tuple[int, ...]
    prefix_slots: int
    cache_lens: tuple[int, ...]
    slots: int
    new_tokens: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str


# Qwen3-8B: 32 heads over 8 KV heads of 128; SmolLM2-135M: 9 over 3 of 64; Gemma 3 270M: 4 over 1 of 256.
ATTENTION_CASES = (
    AttentionCase("decode_qwen3_bf16", 1, (1000, 4000), 4096, 32, 8, 128, "bfloat16"),
    AttentionCase("verify16_qwen3_bf16", 16, (517, 4000), 4096, 32, 8, 128, "bfloat16"),
    AttentionCase("tree33_qwen3_bf16", 33, (517, 3000), 4096, 32, 8, 128, "bfloat16", mask="tree"),
    AttentionCase("verify16_qwen3_f32", 16, (200, 2000), 2048, 32, 8, 128, "float32"),
    AttentionCase("tree17_smollm2_bf16", 17, (300, 1000), 1024, 9, 3, 64, "bfloat16", mask="tree"),
    AttentionCase("prefill512_smollm2_bf16", 512, (0, 0), 512, 9, 3, 64, "bfloat16"),
    AttentionCase("verify16_gemma3_window_cap_f32", 16, (700, 1500), 2048, 4, 1, 256, "float32", "causal",
                  window=512, soft_cap=50.0),
)  # fmt: skip
SHARED_PREFIX_CASES = (
    SharedPrefixCase("shared_decode_f32", ((0, 1), (2, 3)), (1000, 600), 1024, (0, 37, 200, 5), 256, 1, 32, 8,
                     128, "float32"),
    SharedPrefixCase("shared_verify8_bf16", ((0, 1, 2), (3,)), (900, 300), 1024, (10, 64, 0, 150), 256, 8, 32,
                     8, 128, "bfloat16"),
)  # fmt: skip
DRY_ATTENTION_CASES = (AttentionCase("tiny_tree5_bf16", 5, (0, 17), 32, 4, 2, 16, "bfloat16", mask="tree"),)
DRY_SHARED_PREFIX_CASES = (
    SharedPrefixCase("tiny_shared_verify2_f32", ((0, 1), (2,)), (12, 7), 16, (3, 0, 5), 8, 2, 4, 2, 16,
                     "float32"),
)  # fmt: skip


def _random_tree_parents(rng, b: int, n: int):
    """[b, n] parents: node 0 the root (-1), node i's parent uniform in [0, i)."""
    import numpy as np

    return np.asarray([[-1] + [int(rng.integers(0, i)) for i in range(1, n)] for _ in range(b)], np.int32)


def _normal(rng, *shape):
    return rng.standard_normal(shape).astype("float32")


def _with_nan_past(x, lengths):
    """x [B, K, S, H] with slots >= lengths[b] set to NaN: a kernel that reads them shows it."""
    for row, length in enumerate(lengths):
        x[row, :, length:] = float("nan")
    return x


def attention_inputs(case: AttentionCase, seed: int = 0) -> tuple[tuple, dict]:
    """(positional args, keyword args) of `tree_attention` for a case, on the default device."""
    import jax.numpy as jnp
    import numpy as np

    from dflax.decoding.tree import ancestor_mask, depths

    rng = np.random.default_rng(seed)
    b, t, dtype = len(case.cache_lens), case.new_tokens, jnp.dtype(case.dtype)
    lens = np.asarray(case.cache_lens, np.int32)
    k_cache = _with_nan_past(_normal(rng, b, case.kv_heads, case.slots, case.head_dim), lens)
    v_cache = _with_nan_past(_normal(rng, b, case.kv_heads, case.slots, case.head_dim), lens)
    q = _normal(rng, b, t, case.heads, case.head_dim)
    k_new, v_new = (_normal(rng, b, t, case.kv_heads, case.head_dim) for _ in range(2))
    mask, options = None, {"sliding_window": case.window, "logit_soft_cap": case.soft_cap}
    if case.mask == "tree":
        mask = ancestor_mask(jnp.asarray(_random_tree_parents(rng, b, t)))
        options["q_positions"] = jnp.asarray(lens)[:, None] + depths(mask)
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    args = (cast(q), cast(k_cache), cast(v_cache), jnp.asarray(lens), cast(k_new), cast(v_new), mask)
    return args, options


def compare(got, want, dtype: str) -> dict:
    """Max abs error of `got` against `want` and whether every element is within the dtype's tolerance."""
    import numpy as np

    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    atol, rtol = TOLERANCE[dtype]
    finite = np.isfinite(got)
    err = np.abs(got - want)
    return {
        "max_abs_err": float(err[finite].max()) if finite.any() else None,
        "nonfinite": int((~finite).sum()),
        "atol": atol,
        "rtol": rtol,
        "passed": bool(finite.all() and np.all(err <= atol + rtol * np.abs(want))),
    }


def median_ms(fn, reps: int) -> float:
    """Median milliseconds of fn() over `reps` calls (fn compiled already)."""
    import jax

    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def run_attention_case(case: AttentionCase, backend: str, interpret: bool, reps: int) -> dict:
    """`tree_attention` on `backend` against `tree_attention_reference`, both on the default device."""
    import jax.numpy as jnp

    from pallas_kernels.tree_attention import tree_attention, tree_attention_reference

    args, options = attention_inputs(case)
    kernel = functools.partial(tree_attention, *args, **options, backend=backend, interpret=interpret)
    reference = functools.partial(tree_attention_reference, *args, **options)
    want = reference().astype(jnp.float32)
    got = kernel()
    return {
        **compare(got.astype(jnp.float32), want, case.dtype),
        "kernel_ms": median_ms(kernel, reps),
        "reference_ms": median_ms(reference, reps),
    }


def run_shared_prefix_case(case: SharedPrefixCase, platform_name: str, interpret: bool, reps: int) -> dict:
    """`shared_prefix_attention` with both levels as Pallas kernels against the float64 numpy oracle."""
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.shared_prefix import GroupLayout, shared_prefix_attention, shared_prefix_reference

    rng = np.random.default_rng(1)
    b, t, g = len(case.cache_lens), case.new_tokens, len(case.groups)
    kv, h, dtype = case.kv_heads, case.head_dim, jnp.dtype(case.dtype)
    # Rounded to the case's dtype first, so that the oracle sees what the kernels see.
    rounded = lambda x: np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))  # noqa: E731
    prefix_k, prefix_v = (
        rounded(_with_nan_past(_normal(rng, g, kv, case.prefix_slots, h), case.prefix_lens)) for _ in range(2)
    )
    k_cache, v_cache = (
        rounded(_with_nan_past(_normal(rng, b, kv, case.slots, h), case.cache_lens)) for _ in range(2)
    )
    q = rounded(_normal(rng, b, t, case.heads, h))
    k_new, v_new = (rounded(_normal(rng, b, t, kv, h)) for _ in range(2))
    layout = GroupLayout.of_groups(case.groups, b, num_groups=g, group_rows=max(map(len, case.groups)))
    causal = np.broadcast_to(np.tril(np.ones((t, t), bool)), (b, t, t))
    scale = case.head_dim**-0.5
    want = shared_prefix_reference(
        q, prefix_k, prefix_v, np.asarray(case.prefix_lens), np.asarray(layout.row_group), k_cache, v_cache,
        np.asarray(case.cache_lens), k_new, v_new, causal, scale,
    )  # fmt: skip
    cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
    kernel = functools.partial(
        shared_prefix_attention, cast(q), cast(prefix_k), cast(prefix_v),
        jnp.asarray(case.prefix_lens, jnp.int32), layout, cast(k_cache), cast(v_cache),
        jnp.asarray(case.cache_lens, jnp.int32), cast(k_new), cast(v_new), None,
        sm_scale=scale, causal=True, prefix_kernel=platform_name, interpret=interpret,
    )  # fmt: skip
    got = kernel()
    return {**compare(got.astype(jnp.float32), want, case.dtype), "kernel_ms": median_ms(kernel, reps)}


def stage_kernels(s: Settings, rec: Recorder) -> None:
    """Every kernel case on the device (interpret mode on a CPU), saved after each."""
    import jax

    backend = jax.default_backend()
    interpret = backend not in ("gpu", "tpu")
    kernel_platform = "gpu" if interpret else backend  # the CPU interprets the GPU (Triton) kernels
    rec.update(platform=kernel_platform, interpret=interpret, cases=[])
    attention = DRY_ATTENTION_CASES if s.dry_run else ATTENTION_CASES
    shared = DRY_SHARED_PREFIX_CASES if s.dry_run else SHARED_PREFIX_CASES
    runs = [("tree_attention", c, run_attention_case) for c in attention]
    runs += [("shared_prefix_attention", c, run_shared_prefix_case) for c in shared]
    for op, case, run in runs:
        entry = {"op": op, **dataclasses.asdict(case)}
        t0 = time.perf_counter()
        try:
            entry.update(run(case, kernel_platform, interpret, s.kernel_reps))
        except Exception as error:  # one failing case must not hide the others
            entry.update(passed=False, error=f"{type(error).__name__}: {error}"[:3000])
        entry["case_s"] = time.perf_counter() - t0
        rec["cases"].append(entry)
        passed = sum(c["passed"] for c in rec["cases"])
        rec.update(passed=passed, failed=len(rec["cases"]) - passed)
        rec.save()
