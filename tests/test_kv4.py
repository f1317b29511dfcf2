"""4-bit and rotated K/V formats (quantize_kv bits=4 / rotate=True,
QuantizedKV) against a plain float64 NumPy reference of the documented math."""
import math

import numpy as np
import pytest

import attncore
from attncore import QuantizedKV, quantize_kv


def hadamard(n):
    """The Sylvester Hadamard matrix of order n (a power of two), normalized,
    by its definition: H[i, j] = (-1)^popcount(i & j) / sqrt(n)."""
    i = np.arange(n)
    pc = np.vectorize(lambda x: bin(x).count("1"))(i[:, None] & i[None, :])
    return (-1.0) ** pc / math.sqrt(n)


def rotate_ref(x, block):
    """x (..., D) times the block-diagonal normalized Hadamard matrix."""
    D = x.shape[-1]
    H = np.kron(np.eye(D // block), hadamard(block))
    return x.astype(np.float64) @ H


def unpack_ref(codes):
    """Low nibble first, element by element."""
    c = np.asarray(codes).astype(np.int64)
    out = np.empty(c.shape[:-1] + (2 * c.shape[-1],), np.int64)
    for i in range(c.shape[-1]):
        out[..., 2 * i] = c[..., i] % 16
        out[..., 2 * i + 1] = c[..., i] // 16
    return out


def deq_ref(kv):
    """The documented values in the rotated basis (float64)."""
    gs = kv.group_size
    if kv.bits == 4:
        c = unpack_ref(kv.codes).astype(np.float64)
        if kv.offsets is None:
            c -= 8
    else:
        c = np.asarray(kv.codes).astype(np.float64)
    s = np.repeat(np.asarray(kv.scales).astype(np.float64), gs, axis=-1)
    r = c * s
    if kv.offsets is not None:
        r += np.repeat(np.asarray(kv.offsets).astype(np.float64), gs, axis=-1)
    return r


def data(shape, seed=0, outliers=True):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape).astype(np.float32)
    if outliers:
        x[..., 3] *= 20
        x[..., -1] += 5
    return x


@pytest.mark.parametrize("D", [1, 2, 8, 32, 64, 128, 96, 160, 192])
def test_fwht_is_the_normalized_hadamard(D):
    x = data((3, 5, D), outliers=False).astype(np.float64)
    block = attncore._kv4.rotation_blocks(D)
    assert block == (D if D & (D - 1) == 0 else D & -D)
    y = attncore._kv4.fwht(x.astype(np.float64))
    np.testing.assert_allclose(y, rotate_ref(x, block), rtol=1e-12, atol=1e-12)
    # orthogonal and its own inverse; norms kept
    np.testing.assert_allclose(attncore._kv4.fwht(y), x, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1),
                               rtol=1e-12)


@pytest.mark.parametrize("D", [3, 48, 80, 100])
def test_rotate_rejects_other_head_dims(D):
    with pytest.raises(ValueError, match=f"D = {D}"):
        quantize_kv(np.ones((2, 4, D), np.float32), rotate=True)


def test_bits8_default_is_todays_pair():
    x = data((2, 3, 7, 64))
    q, s = quantize_kv(x, bits=8)
    q0, s0 = quantize_kv(x)
    assert isinstance(q, np.ndarray) and q.dtype == np.int8 and s.dtype == np.float32
    np.testing.assert_array_equal(q, q0)
    np.testing.assert_array_equal(s, s0)
    # the documented symmetric rule, in float64
    amax = np.abs(x.astype(np.float64)).max(-1)
    np.testing.assert_allclose(s, (amax / 127).astype(np.float32), rtol=0)
    q2, s2 = quantize_kv(x, bits=8, group_size=64)
    np.testing.assert_array_equal(q2, q0)


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("gs", [None, 16, 32, 64])
@pytest.mark.parametrize("rotate", [False, True])
def test_int4_round_trip_bound(symmetric, gs, rotate):
    x = data((2, 3, 33, 64), seed=1)
    kv = quantize_kv(x, bits=4, group_size=gs, rotate=rotate, symmetric=symmetric)
    g = 32 if gs is None else gs
    assert isinstance(kv, QuantizedKV)
    assert (kv.bits, kv.group_size, kv.rotate, kv.axis) == (4, g, rotate, -1)
    assert kv.codes.dtype == np.uint8 and kv.codes.shape == (2, 3, 33, 32)
    assert kv.scales.dtype == np.float16 and kv.scales.shape == (2, 3, 33, 64 // g)
    assert (kv.offsets is None) == symmetric
    if not symmetric:
        assert kv.offsets.dtype == np.float16 and kv.offsets.shape == kv.scales.shape
    assert kv.shape == x.shape and kv.dtype == np.float32
    assert kv.nbytes == kv.codes.nbytes + kv.scales.nbytes * (1 if symmetric else 2)
    xr = rotate_ref(x, 64) if rotate else x.astype(np.float64)
    r = deq_ref(kv)
    s = np.repeat(kv.scales.astype(np.float64), g, axis=-1)
    # every element within half a (stored) scale of the rotated input
    assert np.all(np.abs(xr - r) <= s / 2 * (1 + 1e-6) + 1e-30)
    codes = unpack_ref(kv.codes)
    assert codes.min() >= (1 if symmetric else 0) and codes.max() <= 15
    # dequantize(): the documented math, float32, back in the original basis
    d = kv.dequantize()
    assert d.dtype == np.float32 and d.shape == x.shape
    want = rotate_ref(r, 64) if rotate else r
    np.testing.assert_allclose(d, want, rtol=1e-5, atol=1e-5 * np.abs(x).max())
    np.testing.assert_allclose(kv.dequantize(rotated=True), r, rtol=1e-5,
                               atol=1e-5 * np.abs(x).max())


def test_int4_asymmetric_scale_is_the_range():
    x = data((4, 64), seed=2)
    kv = quantize_kv(x, bits=4)
    g = x.astype(np.float64).reshape(4, 2, 32)
    lo, hi = g.min(-1), g.max(-1)
    off = kv.offsets.astype(np.float64)
    sc = kv.scales.astype(np.float64)
    # offset: the minimum rounded down to float16; scale: (max - offset) / 15 rounded up
    assert np.all(off <= lo) and np.all(lo - off <= np.abs(lo) * 2.0 ** -10)
    assert np.all(sc * 15 >= hi - off)
    assert np.all(sc <= (hi - off) / 15 * (1 + 2.0 ** -10))
    c = unpack_ref(kv.codes).reshape(4, 2, 32)
    # each group's minimum maps to code 0, its maximum to code 15
    assert np.all(c.min(-1) == 0) and np.all(c.max(-1) == 15)


@pytest.mark.parametrize("D", [64, 96])
def test_rotated_int8(D):
    x = data((2, 5, D), seed=3)
    kv = quantize_kv(x, rotate=True)
    assert isinstance(kv, QuantizedKV) and kv.bits == 8 and kv.rotate
    assert kv.codes.dtype == np.int8 and kv.codes.shape == x.shape
    assert kv.scales.dtype == np.float32 and kv.scales.shape == (2, 5, 1)
    assert kv.offsets is None and kv.group_size == D
    xr = rotate_ref(x, attncore._kv4.rotation_blocks(D))
    np.testing.assert_allclose(kv.scales[..., 0], (np.abs(xr).max(-1) / 127).astype(np.float32),
                               rtol=1e-6)
    r = deq_ref(kv)
    assert np.all(np.abs(xr - r) <= kv.scales.astype(np.float64) / 2 * (1 + 1e-6))
    np.testing.assert_allclose(kv.dequantize(), rotate_ref(r, attncore._kv4.rotation_blocks(D)),
                               rtol=1e-5, atol=1e-6 * np.abs(x).max())


def test_rotation_helps_outlier_channels():
    # one huge channel sets every row's scale: rotation spreads it
    x = data((1, 256, 64), seed=4, outliers=False)
    x[..., 5] *= 50
    err = [np.abs(quantize_kv(x, bits=4, rotate=r).dequantize() - x).mean() for r in (False, True)]
    assert err[1] < err[0]


def test_torch_in_torch_out():
    torch = pytest.importorskip("torch")
    x = data((2, 3, 8, 64), seed=5)
    kv = quantize_kv(torch.from_numpy(x), bits=4, rotate=True)
    assert isinstance(kv.codes, torch.Tensor) and kv.codes.dtype == torch.uint8
    assert kv.scales.dtype == torch.float16
    ref = quantize_kv(x, bits=4, rotate=True)
    np.testing.assert_array_equal(kv.codes.numpy(), ref.codes)
    np.testing.assert_array_equal(kv.numpy().offsets, ref.offsets)
    np.testing.assert_array_equal(kv.dequantize(), ref.dequantize())


def test_indexing_and_repr():
    x = data((2, 3, 8, 64), seed=6)
    kv = quantize_kv(x, bits=4)
    np.testing.assert_array_equal(kv[1].dequantize(), kv.dequantize()[1])
    np.testing.assert_array_equal(kv[:, 2, 1:5].dequantize(), kv.dequantize()[:, 2, 1:5])
    np.testing.assert_array_equal(kv[..., :3, :].dequantize(), kv.dequantize()[..., :3, :])
    with pytest.raises(IndexError):
        kv[..., :8]
    assert "bits=4" in repr(kv)
    with pytest.raises(AttributeError):
        kv.bits = 8  # type: ignore[misc]


def test_inputs_not_modified():
    x = data((2, 8, 64), seed=7)
    x0 = x.copy()
    quantize_kv(x, bits=4, rotate=True)
    quantize_kv(x, rotate=True)
    np.testing.assert_array_equal(x, x0)


@pytest.mark.parametrize("kw, exc, match", [
    (dict(bits=3), ValueError, "bits must be 4 or 8"),
    (dict(bits=16), ValueError, "bits must be 4 or 8"),
    (dict(bits=4.0), TypeError, "bits must be an int"),
    (dict(bits=True), TypeError, "bits must be an int"),
    (dict(bits=4, group_size=24), ValueError, "group_size"),
    (dict(bits=4, group_size=3), ValueError, "group_size"),
    (dict(bits=4, group_size=0), ValueError, "group_size"),
    (dict(bits=4, group_size=2.0), TypeError, "group_size"),
    (dict(bits=8, group_size=32), ValueError, "group_size"),
    (dict(bits=4, axis=-2), ValueError, "axis"),
    (dict(rotate=1), TypeError, "rotate must be a bool"),
    (dict(bits=4, symmetric="no"), TypeError, "symmetric must be a bool"),
])
def test_bad_arguments(kw, exc, match):
    with pytest.raises(exc, match=match):
        quantize_kv(np.ones((2, 4, 64), np.float32), **kw)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("kw", [dict(bits=4), dict(rotate=True), dict(bits=4, rotate=True)])
def test_non_finite(bad, kw):
    x = np.ones((2, 4, 64), np.float32)
    x[1, 2, 3] = bad
    with pytest.raises(ValueError, match="x must be finite"):
        quantize_kv(x, **kw)


def test_float16_range_and_dtypes():
    x = np.ones((2, 4, 64), np.float32)
    x[0, 0, 0] = 70000.0
    with pytest.raises(ValueError, match="float16 range"):
        quantize_kv(x, bits=4)
    quantize_kv(x, rotate=True)  # int8 scales are float32
    with pytest.raises(TypeError, match="x"):
        quantize_kv(np.ones((2, 4, 64), np.int32), bits=4)
    with pytest.raises(ValueError, match="2 dimensions"):
        quantize_kv(np.ones(64, np.float32), bits=4)


def test_zero_rows():
    x = np.zeros((1, 3, 64), np.float32)
    for kw in (dict(bits=4), dict(bits=4, symmetric=True), dict(rotate=True)):
        np.testing.assert_array_equal(quantize_kv(x, **kw).dequantize(), x)
