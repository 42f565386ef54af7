"""`few_rows_matmul` (few_rows_matmul.cc through XLA's FFI) against XLA's product, row by row bitwise, and
where the models use it."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflax.cpu_kernels import build
from dflax.cpu_kernels.few_rows_matmul import (
    MAX_ROWS,
    cpu_has_avx512_bf16,
    few_rows_matmul,
    few_rows_matmul_applies,
    few_rows_matmul_reference,
    takes_bf16_rows,
)
from dflax.models.layers import dot_float32

pytestmark = pytest.mark.skipif(
    not build.cpu_has_avx2_fma(), reason="the kernel is for x86 CPUs with AVX2 and FMA"
)


def _operands(rows, width, outputs, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((rows, width)), dtype)  # [rows, in]
    w = jnp.asarray(rng.standard_normal((outputs, width)) / np.sqrt(width), dtype)  # [out, in]
    return x, w


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 13, MAX_ROWS])
def test_matches_xlas_product(dtype, rows):
    # 131 outputs: chunks of 48, then single weight rows after the tiles of 3 (one row: of 4).
    x, w = _operands(rows, 576, 131, dtype)
    assert few_rows_matmul_applies(x, w)
    got = jax.jit(few_rows_matmul)(x, w)
    assert got.dtype == jnp.float32 and got.shape == (rows, 131)
    np.testing.assert_allclose(got, few_rows_matmul_reference(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_rows_result_does_not_depend_on_the_other_rows(dtype):
    x, w = _operands(MAX_ROWS, 1536, 576, dtype, seed=1)
    together = np.asarray(jax.jit(few_rows_matmul)(x, w))
    for count in (1, 2, 3, 5, 8):
        np.testing.assert_array_equal(np.asarray(jax.jit(few_rows_matmul)(x[:count], w)), together[:count])
    np.testing.assert_array_equal(np.asarray(jax.jit(few_rows_matmul)(x[7:8], w)), together[7:8])


@pytest.mark.skipif(not cpu_has_avx512_bf16(), reason="the bf16 path is for CPUs with AVX-512 BF16")
@pytest.mark.parametrize("rows", [1, 3, 4, 7, 16])
def test_bf16_rows_take_the_bf16_path_and_match_the_widened_product(rows):
    # bf16 products are exact in float32, so only the order of the float32 sums differs from the widening
    # path and from XLA's product; 100 outputs: tiles of 4 weight rows, one chunk of 48 ends mid-tile.
    x, w = _operands(rows, 576, 100, jnp.bfloat16, seed=2)
    assert takes_bf16_rows(x, w) and not takes_bf16_rows(x.astype(jnp.float32), w)
    got = np.asarray(jax.jit(few_rows_matmul)(x, w))
    widened = np.asarray(jax.jit(few_rows_matmul)(x.astype(jnp.float32), w))
    assert not np.array_equal(got, widened)  # a different path, not the widening one again
    np.testing.assert_allclose(got, widened, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, few_rows_matmul_reference(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not cpu_has_avx512_bf16(), reason="the bf16 path is for CPUs with AVX-512 BF16")
def test_a_bf16_models_products_take_the_bf16_path():
    x, w = _operands(4, 64, 48, jnp.bfloat16)
    hlo = jax.jit(dot_float32).lower(x, w).compile().as_text()
    assert "dflax_few_rows_matmul_bf16_dot" in hlo


def test_bf16_rows_of_a_width_off_32_are_widened():
    x, w = _operands(4, 72, 16, jnp.bfloat16)  # a multiple of 8, not of 32
    assert few_rows_matmul_applies(x, w) and not takes_bf16_rows(x, w)
    got = jax.jit(few_rows_matmul)(x, w)
    np.testing.assert_allclose(got, few_rows_matmul_reference(x, w), rtol=1e-5, atol=1e-5)


def test_products_it_does_not_take():
    x, w = _operands(MAX_ROWS + 1, 64, 16, jnp.float32)
    assert not few_rows_matmul_applies(x, w)  # too many rows
    x, w = _operands(4, 60, 16, jnp.float32)
    assert not few_rows_matmul_applies(x, w)  # a width that is not a multiple of 8
    x, w = _operands(4, 64, 16, jnp.float16)
    assert not few_rows_matmul_applies(x, w)
    x, w = _operands(4, 64, 16, jnp.float32)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((2, 4), ("data", "model"))):
        assert not few_rows_matmul_applies(x, w)  # XLA would gather a sharded weight for an FFI call
    assert few_rows_matmul_applies(x, w)


def test_models_products_go_through_it_on_the_cpu_and_keep_their_gradient():
    x, w = _operands(2, 64, 48, jnp.float32)
    hlo = jax.jit(dot_float32).lower(x, w).compile().as_text()
    assert "dflax_few_rows_matmul_f32" in hlo
    grads = jax.grad(lambda x, w: dot_float32(x, w).sum(), argnums=(0, 1))(x, w)
    expected = jax.grad(lambda x, w: few_rows_matmul_reference(x, w).sum(), argnums=(0, 1))(x, w)
    for got, want in zip(grads, expected):
        np.testing.assert_allclose(got, want, rtol=1e-6)


def test_a_failed_build_warns_once_and_leaves_xlas_product(monkeypatch, tmp_path):
    monkeypatch.setenv("DFLAX_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # a compiler that always fails
    load = build.load_kernel.__wrapped__  # not the process's cached answer
    source = tmp_path / "broken.cc"
    source.write_text("int main() {}\n")
    with pytest.warns(UserWarning, match="broken.cc not built, XLA's own products are used instead"):
        assert load(source, ("missing_symbol",)) is False


def test_turned_off_by_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("DFLAX_CPU_KERNELS", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert build.load_kernel.__wrapped__(tmp_path / "never_built.cc", ("x",)) is False
