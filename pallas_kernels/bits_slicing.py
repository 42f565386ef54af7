"""Dynamic slices and gathers of 16-bit float arrays that XLA's CPU backend does not widen to float32.

XLA's CPU backend has no bf16 (or fp16) dynamic-slice or gather: it converts the whole operand to
float32, slices that and converts the slice back. For a loop-invariant operand the whole-array convert is
hoisted out of the loop: reading one chunk of a bf16 KV cache per iteration writes a float32 copy of every
slot, empty ones included, and looking up one token's embedding writes a float32 copy of the table (113 MB
for SmolLM2) once per program call. Slicing the array's bits (uint16) gives bit for bit the same values;
XLA still materializes the bits view as a same-size copy of the operand (also hoisted), but that copy
writes half the bytes of the float32 one and needs no conversion.

Only the CPU takes the bits path (`jax.lax.platform_dependent`, resolved when the program is lowered):
TPU and GPU slice and gather bf16 natively, and on TPU the bits view is a real copy too (a Qwen3-8B
decode step held a 1.24 GB uint16 copy of its embedding table, compiled for v6e).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_NARROW = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _on_cpu_bits(op, x: jax.Array, *args) -> jax.Array:
    """op(x, *args), computed on x's bits on the CPU when x is bf16/fp16, and directly elsewhere."""
    if x.dtype not in _NARROW:
        return op(x, *args)

    def on_bits(x, *args):
        bits = jax.lax.bitcast_convert_type(x, jnp.uint16)
        return jax.lax.bitcast_convert_type(op(bits, *args), x.dtype)

    return jax.lax.platform_dependent(x, *args, cpu=on_bits, default=op)


def dynamic_slice_in_dim(x: jax.Array, start: jax.Array, size: int, axis: int) -> jax.Array:
    """`jax.lax.dynamic_slice_in_dim`, on x's bits on the CPU when x is bf16/fp16."""
    return _on_cpu_bits(lambda x, start: jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis), x, start)


def take(x: jax.Array, indices: jax.Array, axis: int = 0) -> jax.Array:
    """`jnp.take(x, indices, axis)`, on x's bits on the CPU when x is bf16/fp16 (an embedding lookup)."""
    return _on_cpu_bits(lambda x, indices: jnp.take(x, indices, axis=axis), x, indices)
