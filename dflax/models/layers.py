"""Shared building blocks: linear and embedding layers in checkpoint layout, RMSNorm, RoPE, gated MLP.

Parameters are stored in the HF checkpoint layout (`weight` is [out, in]) so loading is a plain name map.
Glossary: B batch, T positions, D model width, F FFN width, V vocabulary, N query heads, K kv heads,
H head_dim.
"""

from __future__ import annotations

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dflax.cpu_kernels.few_rows_matmul import (
    few_rows_matmul,
    few_rows_matmul_applies,
    few_rows_matmul_reference,
)
from dflax.models.config import RopeScaling


@jax.custom_vjp
def _matmul_float32(x: jax.Array, weight: jax.Array) -> jax.Array:
    """x [..., in] times weight [out, in] transposed -> [..., out] float32 (the inputs' precision).

    The product is taken on x's rows as one [rows, in] matrix: XLA's CPU backend multiplies a 2-D left
    operand by the weight as stored, but gives a bf16 product with more leading axes (a [B, T, in] verify
    block) a transposed copy of the weight, which inside the decode loop is hoisted and paid once per
    call: a copy of every weight of the model per `generate` batch. A few rows on a CPU go to
    `few_rows_matmul`, which reads the weight once at memory speed where XLA's product does not.
    """
    rows = x.reshape(-1, x.shape[-1])  # [rows, in]
    if few_rows_matmul_applies(rows, weight):
        out = jax.lax.platform_dependent(rows, weight, cpu=few_rows_matmul, default=few_rows_matmul_reference)
    else:
        out = few_rows_matmul_reference(rows, weight)  # [rows, out]
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _matmul_float32_fwd(x, weight):
    return _matmul_float32(x, weight), (x, weight)


def _matmul_float32_bwd(residuals, grad):
    """The backward products at the weights' precision too (a bf16 product stays on the bf16 units; the
    float32 cotangent would otherwise make both products float32), accumulated in float32."""
    x, weight = residuals
    grad = grad.astype(weight.dtype)  # [..., out]
    dx = jnp.einsum("...o,oi->...i", grad, weight, preferred_element_type=jnp.float32)
    rows = (-1, grad.shape[-1]), (-1, x.shape[-1])  # every leading position is one row of the product
    dw = jnp.einsum(
        "ro,ri->oi", grad.reshape(rows[0]), x.reshape(rows[1]), preferred_element_type=jnp.float32
    )
    return dx.astype(x.dtype), dw.astype(weight.dtype)


_matmul_float32.defvjp(_matmul_float32_fwd, _matmul_float32_bwd)


def _matmul_float32_two_rows(x: jax.Array, weight: jax.Array) -> jax.Array:
    """A one-row product computed as two rows (the second zero): XLA's CPU path for one bf16 row is slow."""
    xs = jnp.pad(x.reshape(1, -1), ((0, 1), (0, 0)))  # [2, in]
    return _matmul_float32(xs, weight)[:1].reshape(*x.shape[:-1], -1)


def dot_float32(x: jax.Array, weight: jax.Array) -> jax.Array:
    """x [..., in] times weight [out, in] transposed -> [..., out] float32 (accumulated in float32).

    For bf16 weights this is what TPU and GPU matmuls do. On a CPU with AMX (this project's 2-core Xeon) it
    is also XLA's fast path: SmolLM2's projections for 4 rows take 19 ms with a float32 result and 145 ms
    with a bf16 one. XLA's single-row bf16 product is slow there too (116 ms), so a bf16 input of one row
    lowered for the CPU is computed as two (decided by the lowering platform, so a TPU or GPU program
    compiled on this CPU keeps its one row), unless `few_rows_matmul` takes it. Its gradient's products also
    run at the inputs' precision (bf16 training).
    """
    one_bf16_row = math.prod(x.shape[:-1]) == 1 and x.dtype == jnp.bfloat16
    if one_bf16_row and not few_rows_matmul_applies(x.reshape(1, -1), weight):
        return jax.lax.platform_dependent(x, weight, cpu=_matmul_float32_two_rows, default=_matmul_float32)
    return _matmul_float32(x, weight)


class Linear(nn.Module):
    """y = x W^T (+ b), with W stored as [out, in] like PyTorch checkpoints."""

    features: int
    use_bias: bool = False
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        weight = self.param(
            "weight", nn.initializers.normal(0.02), (self.features, x.shape[-1]), self.dtype
        )  # [out, in]
        y = dot_float32(x, weight).astype(x.dtype)
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (self.features,), self.dtype)
        return y


def row_sum(x: jax.Array) -> jax.Array:
    """[..., D] -> [..., 1]: each row summed in one fixed order, whatever the leading shape.

    XLA's CPU reduce orders its additions by the whole array's shape: one row of 576 was summed in vector
    lanes, eight rows one after another, so an RMSNorm of a 1-token decode step and of the same token in
    an 8-token verify block differed in the last bit (2e-7), and a bf16 target's rounding turned that into
    top-2 logit flips (20 of 40 HumanEval answers parted from plain decoding at B=8). Here the row is
    halved by elementwise adds (zero-padded to a power of two first, which leaves every sum exact), a
    pairwise order that no leading shape changes. `RMSNorm` sums this way on the CPU only: the ladder of
    slices added 12% to a SmolLM2 TPU program's compile (42.6 -> 47.8 s), and the lossless tests run here.
    """
    width = 1 << (x.shape[-1] - 1).bit_length()  # the next power of two
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - x.shape[-1])])
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32.

    Attributes:
      eps: variance epsilon.
      unit_offset: Gemma's convention, scale = 1 + w (weights stored as offsets from one).
    """

    eps: float = 1e-5
    unit_offset: bool = False
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        init = nn.initializers.zeros if self.unit_offset else nn.initializers.ones
        weight = self.param("weight", init, (x.shape[-1],), self.dtype).astype(jnp.float32)
        xf = x.astype(jnp.float32)
        mean_square = jax.lax.platform_dependent(  # [..., 1]; TPU and GPU programs keep XLA's reduce
            xf,
            cpu=lambda v: row_sum(v * v) / x.shape[-1],
            default=lambda v: jnp.mean(v * v, axis=-1, keepdims=True),
        )
        y = xf * jax.lax.rsqrt(mean_square + self.eps)
        scale = 1.0 + weight if self.unit_offset else weight
        return (y * scale).astype(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> np.ndarray:
    """Inverse RoPE frequencies [H // 2] (float64 on host), with optional Llama-3 / linear scaling."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    # Llama 3: keep high frequencies, divide low ones by `factor`, interpolate in between.
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return np.where(mid, (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq, scaled)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotates x by its positions, HF "rotate_half" layout (first half / second half pairs).

    Args:
      x: [B, T, N, H].
      positions: [B, T] int32 absolute positions.
      inv_freq: [H // 2] inverse frequencies.

    Returns:
      [B, T, N, H] in x's dtype.
    """
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)  # [B, T, H/2]
    # Fused into the cos and sin, XLA's CPU code rounded the product differently for 1 and for 8 new
    # tokens (a decode step's keys and the same token's in a verify block parted in the last bit); apart,
    # each token's angles and rotation are computed alike whatever T.
    angles = jax.lax.optimization_barrier(angles)
    cos = jnp.cos(angles)[:, :, None, :]  # [B, T, 1, H/2]
    sin = jnp.sin(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)): SwiGLU (silu) for the llama family, GeGLU (tanh gelu) for Gemma."""

    intermediate_size: int
    activation: str = "silu"
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        act = jax.nn.silu if self.activation == "silu" else (lambda v: jax.nn.gelu(v, approximate=True))
        gate = Linear(self.intermediate_size, dtype=self.dtype, name="gate_proj")(x)  # [B, T, F]
        up = Linear(self.intermediate_size, dtype=self.dtype, name="up_proj")(x)  # [B, T, F]
        return Linear(x.shape[-1], dtype=self.dtype, name="down_proj")(act(gate) * up)
