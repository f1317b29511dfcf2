"""Sinusoidal positional encoding against the float64 formula, the PyTorch
tutorial's torch composition and the tensor2tensor spacing."""
import math

import numpy as np
import pytest

from attncore import add_positional_encoding, sinusoidal_encoding

try:
    import torch
except ImportError:  # pragma: no cover - torch is a test extra
    torch = None


def formula(positions, dim, base=10000.0, layout="interleaved"):
    """Column by column, in float64 (Vaswani et al. 2017, section 3.5)."""
    positions = np.asarray(positions, dtype=np.float64).reshape(-1)
    out = np.empty((positions.size, dim))
    for r, p in enumerate(positions):
        for c in range(dim):
            i = c // 2
            angle = p / base ** (2 * i / dim)
            out[r, c] = math.sin(angle) if c % 2 == 0 else math.cos(angle)
    if layout == "split":  # sines (even columns) first, then cosines (odd columns)
        out = np.concatenate([out[:, 0::2], out[:, 1::2]], axis=1)
    return out


@pytest.mark.parametrize("layout", ["interleaved", "split"])
@pytest.mark.parametrize("dim", [1, 2, 7, 16, 33])
def test_against_formula(layout, dim):
    pe = sinusoidal_encoding(40, dim, layout=layout, dtype=np.float64)
    assert pe.shape == (40, dim) and pe.dtype == np.float64
    np.testing.assert_allclose(pe, formula(np.arange(40), dim, layout=layout), rtol=0, atol=1e-12)


def test_odd_dim_has_one_more_sine():
    pe = sinusoidal_encoding(5, 5, dtype=np.float64)
    # columns 0, 2, 4 are sines (0 at position 0), 1, 3 cosines (1 at position 0)
    np.testing.assert_array_equal(pe[0], [0, 1, 0, 1, 0])
    split = sinusoidal_encoding(5, 5, layout="split", dtype=np.float64)
    np.testing.assert_array_equal(split[0], [0, 0, 0, 1, 1])
    np.testing.assert_array_equal(split, pe[:, [0, 2, 4, 1, 3]])


@pytest.mark.skipif(torch is None, reason="torch not installed")
def test_against_torch_tutorial_composition():
    """The PyTorch tutorial's PositionalEncoding, composed of torch ops."""
    L, d = 300, 64
    position = torch.arange(L, dtype=torch.float64).unsqueeze(1)
    div_term = torch.exp(torch.arange(0, d, 2, dtype=torch.float64) * (-math.log(10000.0) / d))
    pe = torch.zeros(L, d, dtype=torch.float64)
    pe[:, 0::2] = torch.sin(position * div_term)
    pe[:, 1::2] = torch.cos(position * div_term)
    np.testing.assert_allclose(sinusoidal_encoding(L, d, dtype=np.float64), pe.numpy(),
                               rtol=0, atol=1e-10)
    np.testing.assert_allclose(sinusoidal_encoding(L, d), pe.numpy(), rtol=0, atol=1e-6)


def test_tensor2tensor_spacing_via_base():
    """tensor2tensor / fairseq: inv_timescale_i = exp(-i log(base) / (h - 1)), sin | cos."""
    L, d = 50, 12
    h = d // 2
    inv = np.exp(-np.arange(h) * math.log(10000.0) / (h - 1))
    t2t = np.concatenate([np.sin(np.arange(L)[:, None] * inv), np.cos(np.arange(L)[:, None] * inv)],
                         axis=1)
    ours = sinusoidal_encoding(L, d, layout="split", base=10000.0 ** (h / (h - 1)),
                               dtype=np.float64)
    np.testing.assert_allclose(ours, t2t, rtol=0, atol=1e-12)


def test_large_positions_exact_in_float32():
    pos = np.array([0, 1, 99_999, 100_000, 2**20 + 3])
    pe = sinusoidal_encoding(pos, 32)
    assert pe.dtype == np.float32 and pe.shape == (5, 32)
    expected = formula(pos, 32)
    # within one float32 rounding of the float64 value (|values| <= 1: half an ulp <= 6e-8)
    np.testing.assert_allclose(pe, expected, rtol=0, atol=6e-8)
    # computing the angles in float32 instead would be off by far more
    naive = np.sin(pos[:, None].astype(np.float32) * np.float32(1.0 / 10000 ** (2 / 32)))
    assert np.abs(naive[-2:, 0] - expected[-2:, 2]).max() > 1e-4


def test_position_arrays_and_dtypes():
    pos = np.array([[3, 4], [10, 11]], dtype=np.int16)
    pe = sinusoidal_encoding(pos, 8, dtype=np.float64)
    assert pe.shape == (2, 2, 8)
    np.testing.assert_allclose(pe.reshape(4, 8), formula(pos, 8), atol=1e-12)
    frac = sinusoidal_encoding(np.array([0.5, 2.25]), 6, dtype=np.float64)
    np.testing.assert_allclose(frac, formula([0.5, 2.25], 6), atol=1e-12)
    np.testing.assert_array_equal(sinusoidal_encoding(np.array([5]), 8),
                                  sinusoidal_encoding(10, 8)[5:6])
    assert sinusoidal_encoding(0, 4).shape == (0, 4)
    assert sinusoidal_encoding(3, 4, dtype=np.float16).dtype == np.float16
    np.testing.assert_allclose(sinusoidal_encoding(20, 6, base=100.0, dtype=np.float64),
                               formula(np.arange(20), 6, base=100.0), atol=1e-12)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_add_positional_encoding(dtype):
    x = np.random.default_rng(0).standard_normal((2, 7, 10)).astype(dtype)
    x0 = x.copy()
    y = add_positional_encoding(x)
    assert y.dtype == dtype and y.shape == x.shape
    np.testing.assert_allclose(y, x + formula(np.arange(7), 10), rtol=1e-6, atol=1e-6)
    y5 = add_positional_encoding(x, offset=5, layout="split")
    np.testing.assert_allclose(y5, x + formula(np.arange(5, 12), 10, layout="split"),
                               rtol=1e-6, atol=1e-6)
    c = add_positional_encoding(x, offset=3, mode="concat")
    assert c.shape == (2, 7, 20) and c.dtype == dtype
    np.testing.assert_array_equal(c[..., :10], x)                         # features first
    np.testing.assert_allclose(c[0, :, 10:], formula(np.arange(3, 10), 10), atol=1e-6)
    np.testing.assert_array_equal(c[0, :, 10:], c[1, :, 10:])
    np.testing.assert_array_equal(x, x0)                                  # never modified
    # decoding one step at a time equals encoding the whole sequence
    steps = [add_positional_encoding(x[:, t:t + 1], offset=t) for t in range(7)]
    np.testing.assert_array_equal(np.concatenate(steps, axis=1), y)


_X = np.zeros((3, 4), np.float32)

# (id, exception, message pattern naming the argument, the bad call)
BAD_CALLS = [
    ("dim-zero", ValueError, "dim must be >= 1, got 0", lambda: sinusoidal_encoding(4, 0)),
    ("dim-float", TypeError, "dim must be an int", lambda: sinusoidal_encoding(4, 8.0)),
    ("layout", ValueError, "layout must be 'interleaved' or 'split', got 'sin'",
     lambda: sinusoidal_encoding(4, 8, layout="sin")),
    ("base-one", ValueError, "base must be finite and > 1, got 1.0",
     lambda: sinusoidal_encoding(4, 8, base=1.0)),
    ("length-negative", ValueError, r"length_or_positions as a length must be >= 0 .*got -1",
     lambda: sinusoidal_encoding(-1, 8)),
    ("length-huge", ValueError, r"length_or_positions as a length must be .* at most 2\*\*53",
     lambda: sinusoidal_encoding(2**63, 8)),
    ("length-numpy-float", TypeError, "length_or_positions must be an int length or an array",
     lambda: sinusoidal_encoding(np.float32(3.0), 8)),
    ("layout-array", ValueError, "layout must be 'interleaved' or 'split'",
     lambda: sinusoidal_encoding(4, 8, layout=np.array(["split", "split"]))),
    ("mode-array", ValueError, "mode must be 'add' or 'concat'",
     lambda: add_positional_encoding(_X, mode=np.array(["add", "add"]))),
    ("dim-huge", ValueError, r"dim must be below 2\*\*31", lambda: sinusoidal_encoding(4, 2**63)),
    ("positions-bool", TypeError, "length_or_positions must be .*got dtype bool",
     lambda: sinusoidal_encoding(np.array([True]), 8)),
    ("dtype-int", TypeError, "dtype must be float16, float32 or float64, got int32",
     lambda: sinusoidal_encoding(4, 8, dtype=np.int32)),
    ("positions-nan", ValueError, "length_or_positions must be finite",
     lambda: sinusoidal_encoding(np.array([np.nan]), 8)),
    ("mode", ValueError, "mode must be 'add' or 'concat', got 'mul'",
     lambda: add_positional_encoding(_X, mode="mul")),
    ("x-1d", ValueError, r"x must have at least 2 dimensions .* got shape \(4,\)",
     lambda: add_positional_encoding(_X[0])),
    ("x-int", TypeError, "x must be a float16, float32 or float64 array",
     lambda: add_positional_encoding(np.zeros((3, 4), np.int64))),
    ("offset-str", TypeError, "offset must be an int or a float",
     lambda: add_positional_encoding(_X, offset="1")),
]


@pytest.mark.parametrize("exc, match, call", [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
def test_errors(exc, match, call):
    with pytest.raises(exc, match=match):
        call()


def test_float_scalar_length_is_rejected():
    with pytest.raises(TypeError, match=r"length_or_positions must be an int length.*pass int\(5.0\)"):
        sinusoidal_encoding(5.0, 4)
    # one position as an explicit array is fine
    np.testing.assert_allclose(sinusoidal_encoding(np.array([5.0]), 4)[0],
                               [np.sin(5.0), np.cos(5.0), np.sin(5.0 / 100.0), np.cos(5.0 / 100.0)],
                               rtol=1e-6)


def test_numpy_integer_lengths_are_lengths():
    """A NumPy integer scalar is a length, as a Python int is (it was taken
    as one position); dtype=None is the default float32."""
    ref = sinusoidal_encoding(5, 8)
    for n in (np.int64(5), np.uint8(5), np.int32(5)):
        np.testing.assert_array_equal(sinusoidal_encoding(n, 8), ref)
    assert sinusoidal_encoding(5, 8, dtype=None).dtype == np.float32
    # against the published formula (Vaswani et al.), float64
    pos, i = np.arange(5)[:, None], np.arange(4)[None, :]
    ang = pos / 10000.0 ** (2 * i / 8)
    want = np.empty((5, 8))
    want[:, 0::2], want[:, 1::2] = np.sin(ang), np.cos(ang)
    np.testing.assert_allclose(sinusoidal_encoding(np.int64(5), 8, dtype=np.float64), want,
                               rtol=1e-12, atol=1e-12)
