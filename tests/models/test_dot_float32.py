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
    """The product up to float32 summation order (a few rows on the CPU take `few_rows_matmul`)."""
    x, w = _inputs(3, jnp.float32)
    exact = np.einsum("...i,oi->...o", np.asarray(x, np.float64), np.asarray(w, np.float64))
    np.testing.assert_allclose(np.asarray(dot_float32(x, w)), exact, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 2, 5])
def test_bfloat16_is_accumulated_in_float32(rows):
    """One row (on the CPU `few_rows_matmul`, or two rows without it) and several rows give the float64
    product of the bf16 values."""
    x, w = _inputs(rows, jnp.bfloat16)
    y = jax.jit(dot_float32)(x, w)
    assert y.dtype == jnp.float32 and y.shape == (rows, 1, 32)
    exact = np.einsum("...i,oi->...o", np.asarray(x, np.float64), np.asarray(w, np.float64))
    np.testing.assert_allclose(np.asarray(y), exact, rtol=1e-5, atol=1e-4)


def test_float32_gradient_is_the_plain_products_gradient():
    x, w = _inputs(3, jnp.float32)
    ct = jnp.asarray(np.random.default_rng(7).standard_normal((3, 1, 32)), jnp.float32)
    loss = lambda f: lambda a, b: jnp.sum(f(a, b) * ct)  # noqa: E731
    got = jax.grad(loss(dot_float32), argnums=(0, 1))(x, w)
    want = jax.grad(loss(lambda a, b: jnp.einsum("...i,oi->...o", a, b)), argnums=(0, 1))(x, w)
    for g, e in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 4])
def test_bfloat16_gradient_is_the_bf16_cotangents_product(rows):
    """The backward products take the cotangent rounded to bf16 (bf16 training): dx = g W, dW = g^T x of
    the bf16 values, accumulated in float32, returned in the inputs' dtype."""
    x, w = _inputs(rows, jnp.bfloat16)
    ct = np.random.default_rng(7).standard_normal((rows, 1, 32)).astype(np.float32)
    dx, dw = jax.jit(jax.grad(lambda a, b: jnp.sum(dot_float32(a, b) * ct), argnums=(0, 1)))(x, w)
    assert dx.dtype == dw.dtype == jnp.bfloat16
    g = np.asarray(jnp.asarray(ct, jnp.bfloat16), np.float64)
    x64, w64 = np.asarray(x, np.float64), np.asarray(w, np.float64)
    want_dx = np.einsum("...o,oi->...i", g, w64)
    want_dw = np.einsum("ro,ri->oi", g.reshape(rows, 32), x64.reshape(rows, 64))
    np.testing.assert_allclose(np.asarray(dx, np.float64), want_dx, rtol=1e-2, atol=1e-2)
    np.testing.assert_allclose(np.asarray(dw, np.float64), want_dw, rtol=1e-2, atol=1e-2)
