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


@pytest.mark.parametrize("wblock", [0, 1, 64 * 300 * 4, 200 * 300 * 4, 1 << 40])
@pytest.mark.parametrize("num_threads", [1, 2, 3])
@pytest.mark.parametrize("half", [None, np.float16])
def test_linear_weight_column_blocks(wblock, num_threads, half):
    """The fused path's column blocks of w (wblock bytes, each over every
    row panel; 1000 columns: blocks of 64, a ragged last one, 192, one)
    give the float64 product: float32 weights and converted 16-bit ones,
    rows not a multiple of a panel, 1-3 threads."""
    from attncore._core import _linalg

    rng = np.random.default_rng(wblock % 997 + num_threads)
    x = rng.standard_normal((70, 300)).astype(np.float32)
    w = rng.standard_normal((1000, 300)).astype(np.float32)
    b = rng.standard_normal(1000).astype(np.float32)
    if half is not None:
        w = w.astype(half)
    expected = x.astype(np.float64) @ w.astype(np.float64).T + b
    out = np.full((70, 1000), np.nan, np.float32)
    _linalg.linear(x, w, b, out, num_threads, 2 if half is not None else 0, 0, wblock)
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)


def test_linear_strided_operands():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((40, 96))[:, ::2]   # non-contiguous columns
    w = rng.standard_normal((64, 48)).T.copy().T  # Fortran order
    np.testing.assert_allclose(linear(x, w, num_threads=2), x @ w.T, rtol=1e-12, atol=1e-12)


def test_linear_rejects_mismatched_operands():
    """Bad operands get a ValueError naming the operand, the expected and
    the actual shape -- never a read past the end of a short bias."""
    x = np.ones((2, 5), np.float32)
    w = np.ones((4, 5), np.float32)
    buf = np.full(1000, 7.0, np.float32)
    with pytest.raises(ValueError, match=r"b must have shape \(4,\).*\(3,\)"):
        linear(x, w, buf[:3])
    with pytest.raises(ValueError, match=r"b must have shape \(4,\).*\(5,\)"):
        linear(x, w, buf[:5])
    with pytest.raises(ValueError, match=r"w must be \(C, K\) with K = x2d.shape\[1\] = 5.*"
                                         r"\(4, 6\)"):
        linear(x, np.ones((4, 6), np.float32))
    with pytest.raises(ValueError, match=r"out must have shape \(2, 4\), got \(2, 3\)"):
        linear(x, w, out=np.empty((2, 3), np.float32))
    with pytest.raises(ValueError, match="precision must be one of .* got 'fp8'"):
        linear(x, w, precision="fp8")
    np.testing.assert_array_equal(linear(x, w, buf[:4]), np.full((2, 4), 12.0, np.float32))


def test_private_linear_checks_the_bias_length():
    """The kernel entry itself never reads past a bias of the wrong length."""
    from attncore._core import _linalg

    x, w, o = np.ones((2, 5), np.float32), np.ones((4, 5), np.float32), np.empty((2, 4), np.float32)
    for b, got in ((np.ones(3, np.float32), r"\(3,\)"), (np.ones((4, 1), np.float32), r"\(4, 1\)")):
        with pytest.raises(ValueError, match=r"bias must have shape \(4,\), got " + got):
            _linalg.linear(x, w, b, o, 1)
