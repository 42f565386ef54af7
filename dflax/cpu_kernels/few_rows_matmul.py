"""Products of a few rows by a [out, in] weight that read the weight once (few_rows_matmul.cc), with the
einsum they replace as reference."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp

from dflax.cpu_kernels.build import library_path, load_kernel

MAX_ROWS = 32
"""Up to this many rows the kernel beats XLA's product on an AVX2 CPU (a 1,536 x 576 float32 weight, 2 cores:
2-8 rows 0.18-0.24 ms against 0.45-0.60 ms, 16 rows 0.31 against 0.69, 32 rows 0.57 against 0.95)."""

_SOURCE = Path(__file__).with_suffix(".cc")
_TARGETS = {  # the FFI handler for each weight dtype
    jnp.dtype(jnp.float32): "dflax_few_rows_matmul_f32",
    jnp.dtype(jnp.bfloat16): "dflax_few_rows_matmul_bf16",
}


def few_rows_matmul_reference(rows: jax.Array, weight: jax.Array) -> jax.Array:
    """rows [M, in] times weight [out, in] transposed -> [M, out] float32, XLA's product."""
    return jnp.einsum("ri,oi->ro", rows, weight, preferred_element_type=jnp.float32)


def cpu_products() -> str:
    """What computes a few rows' products on this CPU: the kernel's build (named by its source), or "xla"
    when it is off or did not build. Part of the key of measured decode-step costs."""
    return library_path(_SOURCE).stem if load_kernel(_SOURCE, tuple(_TARGETS.values())) else "xla"


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
        and load_kernel(_SOURCE, tuple(_TARGETS.values()))
    )


def few_rows_matmul(rows: jax.Array, weight: jax.Array) -> jax.Array:
    """rows [M, in] times weight [out, in] transposed -> [M, out] float32, on the CPU.

    Each row's result is computed the same way whatever the other rows (bitwise), and bf16 weights are
    widened to float32 as they are read. Only for products `few_rows_matmul_applies` accepts.
    """
    out = jax.ShapeDtypeStruct((rows.shape[0], weight.shape[0]), jnp.float32)
    call = jax.ffi.ffi_call(_TARGETS[weight.dtype], out, vmap_method="sequential")
    return call(rows.astype(jnp.float32), weight)
