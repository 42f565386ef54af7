"""Products of a few rows by a [out, in] weight that read the weight once (few_rows_matmul.cc), with the
einsum they replace as reference."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp

from dflax.cpu_info import cpu_model_and_flags
from dflax.cpu_kernels.build import library_path, load_kernel

MAX_ROWS = 64
"""Up to this many rows the kernel beats XLA's product on an AVX2 CPU (a 1,536 x 576 float32 weight, 2 cores:
2-8 rows 0.18-0.24 ms against 0.45-0.60 ms, 16 rows 0.31 against 0.69, 32 rows 0.57 against 0.95). A whole
SmolLM2 fp32 forward over n new tokens (context 256, 2-core Zen 3 EPYC) with the kernel up to 64 rows
against 32: 33 tokens 127-133 against 212-219 ms, 48 tokens 158-177 against 253-257, 64 tokens 232-239
against 310-327; at 96-192 tokens the two are within noise."""

_SOURCE = Path(__file__).with_suffix(".cc")
_TARGETS = {  # the FFI handler for each weight dtype (rows as float32)
    jnp.dtype(jnp.float32): "dflax_few_rows_matmul_f32",
    jnp.dtype(jnp.bfloat16): "dflax_few_rows_matmul_bf16",
}
_BF16_DOT = "dflax_few_rows_matmul_bf16_dot"  # bf16 rows x bf16 weights, on CPUs with AVX-512 BF16
_SYMBOLS = (*_TARGETS.values(), _BF16_DOT)


def few_rows_matmul_reference(rows: jax.Array, weight: jax.Array) -> jax.Array:
    """rows [M, in] times weight [out, in] transposed -> [M, out] float32, XLA's product."""
    return jnp.einsum("ri,oi->ro", rows, weight, preferred_element_type=jnp.float32)


def cpu_products() -> str:
    """What computes a few rows' products on this CPU: the kernel's build (named by its source), or "xla"
    when it is off or did not build. Part of the key of measured decode-step costs."""
    if not load_kernel(_SOURCE, _SYMBOLS):
        return "xla"
    return library_path(_SOURCE).stem + ("-bf16dot" if cpu_has_avx512_bf16() else "")


def few_rows_matmul_applies(rows: jax.Array, weight: jax.Array) -> bool:
    """Whether `few_rows_matmul` takes this product (decided at trace time; builds the kernel on first use):
    at most MAX_ROWS rows, an input width that is a multiple of 8, float32 or bfloat16 weights, no mesh of
    several devices being traced for (XLA cannot partition an FFI call: it would gather the weight), and a
    kernel that built on this CPU."""
    mesh = jax.sharding.get_abstract_mesh()
    return (
        (mesh.empty or mesh.size == 1)
        and rows.ndim == 2
        and rows.shape[0] <= MAX_ROWS
        and rows.shape[1] % 8 == 0
        and weight.dtype in _TARGETS
        and rows.dtype in (jnp.float32, weight.dtype)
        and load_kernel(_SOURCE, _SYMBOLS)
    )


def cpu_has_avx512_bf16() -> bool:
    """Whether this CPU multiplies bf16 pairs in 512-bit vectors (AVX-512 BF16: Zen 4 and later, Xeons
    since Cooper Lake), so bf16 rows times bf16 weights take the kernel's vdpbf16ps path."""
    return "avx512_bf16" in cpu_model_and_flags()[1]


def takes_bf16_rows(rows: jax.Array, weight: jax.Array) -> bool:
    """Whether `few_rows_matmul` multiplies these rows as bf16 (vdpbf16ps, no widening of either operand):
    bf16 rows and weights, an input width that is a multiple of 32, and a CPU with AVX-512 BF16."""
    return (
        rows.dtype == jnp.bfloat16
        and weight.dtype == jnp.bfloat16
        and rows.shape[1] % 32 == 0
        and cpu_has_avx512_bf16()
    )


def few_rows_matmul(rows: jax.Array, weight: jax.Array) -> jax.Array:
    """rows [M, in] times weight [out, in] transposed -> [M, out] float32, on the CPU.

    Each row's result is computed the same way whatever the other rows (bitwise). bf16 rows times bf16
    weights multiply as bf16 pairs with float32 sums where the CPU has AVX-512 BF16 (`takes_bf16_rows`);
    otherwise bf16 weights are widened to float32 as they are read. Only for products
    `few_rows_matmul_applies` accepts.
    """
    out = jax.ShapeDtypeStruct((rows.shape[0], weight.shape[0]), jnp.float32)
    if takes_bf16_rows(rows, weight):
        return jax.ffi.ffi_call(_BF16_DOT, out, vmap_method="sequential")(rows, weight)
    call = jax.ffi.ffi_call(_TARGETS[weight.dtype], out, vmap_method="sequential")
    return call(rows.astype(jnp.float32), weight)
