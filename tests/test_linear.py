"""The layers' projection helper against a float64 NumPy product."""
import numpy as np
import pytest

from attncore._linear import linear


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("R,K,C", [(1, 512, 1536), (2, 64, 1000), (3, 7, 5), (300, 64, 40),
                                   (2048, 128, 96), (0, 4, 3), (4, 0, 3), (1, 3, 1)])
@pytest.mark.parametrize("num_threads", [1, 2, 5])
@pytest.mark.parametrize("with_bias", [True, False])
def test_linear_matches_numpy(dtype, R, K, C, num_threads, with_bias):
    rng = np.random.default_rng(R * 7 + K + C)
    x = rng.standard_normal((R, K)).astype(dtype)
    w = rng.standard_normal((C, K)).astype(dtype)
    b = rng.standard_normal(C).astype(dtype) if with_bias else None
    x0, w0 = x.copy(), w.copy()
    y = linear(x, w, b, num_threads=num_threads)
    expected = x.astype(np.float64) @ w.T.astype(np.float64)
    if with_bias:
        expected = expected + b
    assert y.shape == (R, C) and y.dtype == dtype
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == np.float32 else dict(rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(y, expected, **tol)
    np.testing.assert_array_equal(x, x0)
    np.testing.assert_array_equal(w, w0)


def test_linear_strided_operands():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((40, 96))[:, ::2]   # non-contiguous columns
    w = rng.standard_normal((64, 48)).T.copy().T  # Fortran order
    np.testing.assert_allclose(linear(x, w, num_threads=2), x @ w.T, rtol=1e-12, atol=1e-12)
