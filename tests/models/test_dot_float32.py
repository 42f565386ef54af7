"""`dot_float32`: float32 results accumulated in float32, whatever the dtype and the row count."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflax.models.layers import dot_float32


def _inputs(rows: int, dtype) -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(rows)
    x = jnp.asarray(rng.standard_normal((rows, 1, 64)), dtype)  # [rows, 1, in]
    w = jnp.asarray(rng.standard_normal((32, 64)), dtype)  # [out, in]
    return x, w


def test_float32_is_the_plain_product():
    x, w = _inputs(3, jnp.float32)
    np.testing.assert_array_equal(dot_float32(x, w), jnp.einsum("...i,oi->...o", x, w))


@pytest.mark.parametrize("rows", [1, 2, 5])
def test_bfloat16_is_accumulated_in_float32(rows):
    """One row (computed as two on the CPU) and several rows give the float64 product of the bf16 values."""
    x, w = _inputs(rows, jnp.bfloat16)
    y = jax.jit(dot_float32)(x, w)
    assert y.dtype == jnp.float32 and y.shape == (rows, 1, 32)
    exact = np.einsum("...i,oi->...o", np.asarray(x, np.float64), np.asarray(w, np.float64))
    np.testing.assert_allclose(np.asarray(y), exact, rtol=1e-5, atol=1e-4)
