"""attncore._dtypes.cast: float32 <-> bfloat16 / float16 on the kernels'
threads, against NumPy's float16 cast and ml_dtypes' bfloat16 cast (round
to nearest, ties to even) -- bit for bit, NaN for NaN -- on every kernel
path and thread count."""
import numpy as np
import pytest

from attncore._core import _sdpa
from attncore._dtypes import _CAST_MIN, cast

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)



def _floats(n, seed=0):
    """float32 values covering the roundings: random bit patterns (NaNs,
    infinities, subnormals included), float16's range edges and ties, and
    bfloat16 ties."""
    rng = np.random.default_rng(seed)
    bits = rng.integers(0, 2**32, size=n, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32).copy()
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 65504.0, 65519.996, 65520.0,
                        -65520.0, 65536.0, 2.0**-24, 2.0**-25, 3 * 2.0**-25, 2.0**-26,
                        2.0**-14, 2.0**-14 - 2.0**-25, 2.0**-14 - 2.0**-26, 6.1e-5,
                        1 + 2.0**-11, 1 + 3 * 2.0**-11, 1 + 2.0**-8, 1 + 3 * 2.0**-8,
                        -(1 + 2.0**-8), 3.3895314e38, 1e-40, -1e-45], dtype=np.float32)
    x[:special.size] = special
    # float16-range normals, their ties (13 bits below the kept ones) and
    # bfloat16 ties (16 bits below)
    m = n // 4
    y = (rng.standard_normal(m) * np.exp2(rng.integers(-26, 17, m))).astype(np.float32)
    yb = y.view(np.uint32)
    y[: m // 2] = ((yb[: m // 2] & ~np.uint32(0x1FFF)) | np.uint32(0x1000)).view(np.float32)
    y[m // 2:] = ((yb[m // 2:] & ~np.uint32(0xFFFF)) | np.uint32(0x8000)).view(np.float32)
    x[n - m:] = y
    return x


def _same(got, want):
    """Equal bit for bit, NaN where NaN with the same sign (payloads may differ)."""
    g, w = got.view(np.uint16 if got.itemsize == 2 else np.uint32), \
        want.view(np.uint16 if want.itemsize == 2 else np.uint32)
    gn = np.isnan(got.astype(np.float32))
    wn = np.isnan(want.astype(np.float32))
    np.testing.assert_array_equal(gn, wn)
    np.testing.assert_array_equal(g[~wn], w[~wn])
    sign = np.uint16(0x8000) if got.itemsize == 2 else np.uint32(0x80000000)
    np.testing.assert_array_equal(g[wn] & sign, w[wn] & sign)


@pytest.mark.parametrize("dt", [BF16, F16], ids=["bf16", "f16"])
@pytest.mark.parametrize("nthreads", [1, 3])
def test_cast_float32_to_half_matches_numpy(path, dt, nthreads):
    x = _floats(3 * _CAST_MIN + 37).reshape(-1, 1)  # C-contiguous, 2-D
    x0 = x.copy()
    with np.errstate(all="ignore"):
        want = x.astype(dt)
    got = cast(x, dt, nthreads)
    assert got.dtype == dt and got.shape == x.shape
    _same(got, want)
    np.testing.assert_array_equal(x.view(np.uint32), x0.view(np.uint32))  # input untouched


@pytest.mark.parametrize("dt", [BF16, F16], ids=["bf16", "f16"])
@pytest.mark.parametrize("nthreads", [1, 2])
def test_cast_half_to_float32_is_exact(path, dt, nthreads):
    rng = np.random.default_rng(1)
    h = rng.integers(0, 2**16, size=3 * (_CAST_MIN // 2 + 7), dtype=np.uint32).astype(np.uint16)
    h[:4] = [0x0000, 0x8000, 0x0001, 0x7C00]
    x = h.view(dt).reshape(3, -1)
    got = cast(x, np.float32, nthreads)
    assert got.dtype == np.float32 and got.shape == x.shape
    _same(got, x.astype(np.float32))


def test_cast_small_strided_and_other_dtypes_use_numpy():
    x = np.linspace(-3, 3, 101, dtype=np.float32)
    for dt in (BF16, F16, np.float64):
        _same(cast(x, dt).astype(np.float32), x.astype(dt).astype(np.float32))
    big = _floats(2 * _CAST_MIN)[::2]  # strided: NumPy's cast
    with np.errstate(all="ignore"):
        _same(cast(big, F16), big.astype(F16))


def test_cast_half_errors():
    x = np.zeros(8, np.float32)
    with pytest.raises(ValueError, match="fmt"):
        _sdpa.cast_half(x, np.zeros(8, np.uint16), 3, 1)
    with pytest.raises(ValueError, match="sizes"):
        _sdpa.cast_half(x, np.zeros(9, np.uint16), 1, 1)
    with pytest.raises(TypeError, match="float32"):
        _sdpa.cast_half(x, np.zeros(8, np.float32), 1, 1)
    with pytest.raises(TypeError, match="src must be in native byte order"):
        _sdpa.cast_half(np.arange(8, dtype=">f4"), np.zeros(8, np.uint16), 1, 1)
    with pytest.raises(TypeError, match="dst must be in native byte order"):
        _sdpa.cast_half(np.zeros(8, np.uint16), np.zeros(8, ">f4"), 2, 1)


def test_cast_big_endian_input_goes_through_numpy():
    """A big-endian float32 array of any size converts to the right values."""
    x = np.linspace(-3, 3, 70000).astype(">f4")
    np.testing.assert_array_equal(cast(x, np.float16, 2), x.astype(np.float16))
