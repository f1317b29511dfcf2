"""attncore.rotary_embedding against transformers' Llama (rotate_half) and
GPT-J (interleaved) implementations and a float64 NumPy reference of the
published formula (Su et al., RoFormer, eq. 34)."""
import numpy as np
import pytest

import attncore
from attncore import rotary_embedding
from attncore._core import _rotary as _krot

from reference import rand

try:
    import torch
except ImportError:  # pragma: no cover - torch is a test extra
    torch = None

try:
    from transformers import LlamaConfig
    from transformers.models.gptj import modeling_gptj
    from transformers.models.llama.modeling_llama import (LlamaRotaryEmbedding,
                                                          apply_rotary_pos_emb)
except Exception:  # pragma: no cover - transformers is a test extra
    LlamaConfig = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch not installed")
needs_hf = pytest.mark.skipif(torch is None or LlamaConfig is None,
                              reason="transformers (with torch) not installed")


def reference(x, positions, inv_freq, layout="half", rotary_dim=None):
    """float64 RoPE from the formula: pair (a, b) at position p rotated by
    the angle p * f_j (angles formed exactly in float64 / long double)."""
    x = np.asarray(x, dtype=np.float64)
    f = np.asarray(inv_freq, dtype=np.float64)
    rd = 2 * f.shape[0] if rotary_dim is None else rotary_dim
    h = rd // 2
    p = np.asarray(positions)
    if p.ndim == 1:
        p = p[None]
    ang = p[..., None].astype(np.longdouble) * f.astype(np.longdouble)   # (P, L, h)
    c = np.cos(ang).astype(np.float64)
    s = np.sin(ang).astype(np.float64)
    extra = x.ndim - 3
    c = c.reshape(c.shape[:1] + (1,) * max(extra, 0) + c.shape[1:]) if x.ndim > 2 else c[0]
    s = s.reshape(s.shape[:1] + (1,) * max(extra, 0) + s.shape[1:]) if x.ndim > 2 else s[0]
    out = x.copy()
    if layout == "half":
        a, b = x[..., :h], x[..., h:rd]
        out[..., :h] = a * c - b * s
        out[..., h:rd] = b * c + a * s
    else:
        a, b = x[..., 0:rd:2], x[..., 1:rd:2]
        out[..., 0:rd:2] = a * c - b * s
        out[..., 1:rd:2] = b * c + a * s
    return out


def default_freq(rd, base=10000.0):
    return base ** -(np.arange(0, rd, 2, dtype=np.float64) / rd)


# ---------------------------------------------------------------- transformers
def _llama_cos_sin(inv_freq, position_ids):
    """transformers' cos / sin layout (B, L, D) = cat(freqs, freqs), here
    from float64 angles so that the comparison tests the convention."""
    ang = position_ids[..., None].astype(np.float64) * np.asarray(inv_freq, np.float64)
    emb = np.concatenate([ang, ang], axis=-1)
    return torch.from_numpy(np.cos(emb)), torch.from_numpy(np.sin(emb))


@needs_hf
@pytest.mark.parametrize("rope", ["default", "llama3"])
def test_llama_apply_rotary_pos_emb(rope):
    """Llama's rotate_half convention, with LlamaRotaryEmbedding's inv_freq
    (Llama 3 scaling included) passed through inv_freq=."""
    params = {"rope_type": "default", "rope_theta": 10000.0}
    if rope == "llama3":
        params = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}
    cfg = LlamaConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=32, rope_parameters=params, max_position_embeddings=4096)
    rot = LlamaRotaryEmbedding(cfg)
    inv = rot.inv_freq.numpy()
    B, H, L, D = 2, 4, 40, 32
    q = rand((B, H, L, D), 1, np.float64)
    k = rand((B, 2, L, D), 2, np.float64)
    pos = np.random.default_rng(3).integers(0, 3000, size=(B, L))
    cos, sin = _llama_cos_sin(inv, pos)
    q_ref, k_ref = apply_rotary_pos_emb(torch.from_numpy(q), torch.from_numpy(k), cos, sin)
    q_out = rotary_embedding(q, pos, inv_freq=rot.inv_freq)
    k_out = rotary_embedding(k, pos, inv_freq=inv)
    np.testing.assert_allclose(q_out, q_ref.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(k_out, k_ref.numpy(), rtol=1e-12, atol=1e-12)
    # and with transformers' own cos / sin (float32 angles: error ~ p * 6e-8)
    xt = torch.from_numpy(q.astype(np.float32))
    pid = torch.from_numpy(pos)
    cos32, sin32 = rot(xt, pid)
    q32, _ = apply_rotary_pos_emb(xt, xt, cos32, sin32)
    out32 = rotary_embedding(xt, pid, inv_freq=rot.inv_freq)
    assert isinstance(out32, torch.Tensor) and out32.dtype == torch.float32
    np.testing.assert_allclose(out32.numpy(), q32.numpy(), rtol=0, atol=3000 * 6e-8 * 8)


@needs_hf
def test_llama_default_base_matches_rotary_embedding_module():
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=2, head_dim=32)
    rot = LlamaRotaryEmbedding(cfg)
    # transformers forms inv_freq in float32; base= here forms it in float64
    np.testing.assert_allclose(default_freq(32), rot.inv_freq.numpy(), rtol=1e-6)
    x = rand((1, 2, 16, 32), dtype=np.float64)
    pos = np.arange(16)[None]
    cos, sin = _llama_cos_sin(default_freq(32), pos)
    ref, _ = apply_rotary_pos_emb(torch.from_numpy(x), torch.from_numpy(x), cos, sin)
    np.testing.assert_allclose(rotary_embedding(x), ref.numpy(), rtol=1e-12, atol=1e-12)


@needs_hf
@pytest.mark.parametrize("rotary_dim", [64, 16])
def test_gptj_interleaved(rotary_dim):
    """GPT-J's rotate_every_two on (B, L, H, rotary_dim), the rest passed
    through as its attention does (k_rot / k_pass)."""
    B, L, H, D = 2, 21, 3, 64
    x = rand((B, L, H, D), 5, np.float64)
    pos = np.random.default_rng(6).integers(0, 2048, size=(B, L))
    inv = default_freq(rotary_dim)
    ang = pos[..., None].astype(np.float64) * inv                     # (B, L, rd/2)
    sin, cos = torch.from_numpy(np.sin(ang)), torch.from_numpy(np.cos(ang))
    xt = torch.from_numpy(x)
    rot = modeling_gptj.apply_rotary_pos_emb(xt[..., :rotary_dim], sin, cos)
    ref = torch.cat([rot, xt[..., rotary_dim:]], dim=-1).numpy()
    # x (B, L, H, D) -> (B, H, L, D) view: no copy, any strides
    out = rotary_embedding(x.transpose(0, 2, 1, 3), pos, layout="interleaved",
                           rotary_dim=rotary_dim)
    np.testing.assert_allclose(out.transpose(0, 2, 1, 3), ref, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- the formula
@pytest.mark.parametrize("layout", ["half", "interleaved"])
@pytest.mark.parametrize("dtype,tol", [(np.float64, 5e-11), (np.float32, 2e-6),
                                       (np.float16, 2e-3)])
def test_formula_dtypes_and_layouts(layout, dtype, tol):
    # float64: the angle p * f is rounded once, ~p * 1.1e-16 radians (p < 1e5)
    x = rand((3, 2, 17, 48), 7, dtype)
    pos = np.random.default_rng(8).integers(-5000, 100000, size=(3, 17))
    for rd in (48, 20):
        out = rotary_embedding(x, pos, layout=layout, rotary_dim=rd, base=500.0)
        assert out.dtype == dtype and out.shape == x.shape
        ref = reference(x, pos, default_freq(rd, 500.0), layout, rd)
        np.testing.assert_allclose(out.astype(np.float64), ref, rtol=tol, atol=tol * 4)
        # the channels beyond rotary_dim are copied exactly
        np.testing.assert_array_equal(out[..., rd:], x[..., rd:])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_long_positions_stay_accurate(dtype):
    """Angles formed in float64: at positions near 2**31 the result still
    matches the extended-precision reference (float32 angles would be off
    by up to 64 radians there)."""
    x = rand((1, 8, 64), 9, dtype)
    pos = np.array([0, 1, 2**20, 2**24 + 1, 10**9, 2**31 - 1, -(2**31), 123456789])
    out = rotary_embedding(x[:, :8], pos, inv_freq=default_freq(64))
    ref = reference(x[:, :8], pos, default_freq(64))
    # float64: the angle p * f is rounded once (relative 1.1e-16): ~2.4e-7
    # radians at p = 2**31; float32: the rounding of cos / sin to float32
    atol = 5e-7 if dtype == np.float64 else 2e-6
    np.testing.assert_allclose(out, ref, rtol=0, atol=atol * 4)


def test_huge_frequencies_take_the_slow_path():
    """inv_freq > 1 can push angles past the fast reduction's range."""
    x = rand((4, 6), 10, np.float64)
    inv = np.array([3.0, 1e6, 1e3])
    pos = np.array([0, 5, 2**30, -7])
    np.testing.assert_allclose(rotary_embedding(x, pos, inv_freq=inv),
                               reference(x, pos, inv), rtol=1e-9, atol=1e-9)


def test_default_positions_and_broadcast_rows():
    x = rand((2, 3, 4, 5, 16), 11)
    out = rotary_embedding(x)
    ref = reference(x, np.arange(5), default_freq(16))
    np.testing.assert_allclose(out, ref, rtol=2e-6, atol=2e-6)
    # (B, L) positions pair with x's first axis, whatever lies between
    pos = np.array([[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]])
    out = rotary_embedding(x, pos)
    for b in range(2):
        np.testing.assert_allclose(out[b], reference(x[b], pos[b], default_freq(16)),
                                   rtol=2e-6, atol=2e-6)
    # (1, L) is (L,)
    np.testing.assert_array_equal(rotary_embedding(x, pos[:1]), rotary_embedding(x, pos[0]))
    # 2-D x (L, D)
    y = rand((5, 8), 12, np.float64)
    np.testing.assert_allclose(rotary_embedding(y, [0, 2, 4, 6, 8]),
                               reference(y, [0, 2, 4, 6, 8], default_freq(8)), rtol=1e-12,
                               atol=1e-12)


def test_any_strides_and_input_unchanged():
    base = rand((4, 6, 9, 40), 13)
    views = [base[:, ::2, 1:8, :32], base[::-1, :, ::-2, 4:36], base.transpose(2, 0, 1, 3)[..., :32],
             np.asfortranarray(base)[..., :32], base[..., ::-1][..., :32]]
    for v in views:
        before = v.copy()
        out = rotary_embedding(v)
        np.testing.assert_array_equal(v, before)
        np.testing.assert_allclose(out, reference(v, np.arange(v.shape[-2]), default_freq(32)),
                                   rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_out_and_in_place(layout):
    x = rand((2, 3, 11, 24), 14)
    pos = np.arange(100, 111)
    ref = rotary_embedding(x, pos, layout=layout, rotary_dim=16)
    # a separate output, with other strides
    out = np.zeros((3, 2, 11, 24), np.float32).transpose(1, 0, 2, 3)
    r = rotary_embedding(x, pos, layout=layout, rotary_dim=16, out=out)
    assert r is out
    np.testing.assert_array_equal(out, ref)
    # in place, also on a strided view (the untouched channels stay)
    y = x.copy()
    r = rotary_embedding(y, pos, layout=layout, rotary_dim=16, out=y)
    assert r is y
    np.testing.assert_array_equal(y, ref)
    big = np.zeros((2, 3, 11, 50), np.float32)
    view = big[..., 1:49:2]
    view[...] = x
    rotary_embedding(view, pos, layout=layout, rotary_dim=16, out=view)
    np.testing.assert_array_equal(view, ref)
    assert not big[..., 0::2].any()


@needs_torch
def test_torch_in_place_and_types():
    x = torch.from_numpy(rand((1, 2, 7, 16), 15))
    ref = rotary_embedding(x.numpy().copy())
    y = x.clone()
    r = rotary_embedding(y, out=y)
    assert r is y
    np.testing.assert_array_equal(y.numpy(), ref)
    # float16 and bfloat16 tensors come back in their dtype
    h = rotary_embedding(x.half())
    assert h.dtype == torch.float16
    np.testing.assert_allclose(h.float().numpy(), ref, atol=4e-3)
    b = rotary_embedding(x.bfloat16())
    assert b.dtype == torch.bfloat16
    np.testing.assert_allclose(b.float().numpy(), ref, atol=3e-2)
    with pytest.raises(TypeError, match="out= is not supported for bfloat16"):
        rotary_embedding(x.bfloat16(), out=x.bfloat16())


def test_jax_array():
    jnp = pytest.importorskip("jax.numpy")
    x = rand((2, 5, 8), 16)
    out = rotary_embedding(jnp.asarray(x), jnp.arange(5))
    assert type(out).__module__.startswith("jax")
    np.testing.assert_allclose(np.asarray(out), rotary_embedding(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="out must be a writable array"):
        xj = jnp.asarray(x)
        rotary_embedding(xj, out=xj)


@pytest.mark.parametrize("nt", [1, 2, 3, -1, None])
def test_threads_give_the_same_result(nt):
    x = rand((2, 4, 300, 64), 17)
    pos = np.random.default_rng(18).integers(0, 10**6, size=(2, 300))
    ref = rotary_embedding(x, pos, num_threads=1)
    np.testing.assert_array_equal(rotary_embedding(x, pos, num_threads=nt), ref)


def test_empty_inputs():
    for shape in [(0, 4, 8), (2, 0, 8), (3, 0, 5, 8)]:
        x = np.zeros(shape, np.float32)
        out = rotary_embedding(x)
        assert out.shape == shape and out.dtype == np.float32


# ---------------------------------------------------------------- bad inputs
@pytest.mark.parametrize("kwargs,exc,pattern", [
    (dict(positions=np.arange(5.0)), TypeError, "positions must be an integer array"),
    (dict(positions=np.ones(5, bool)), TypeError, "positions must be an integer array"),
    (dict(positions=np.arange(4)), ValueError, r"positions must have shape \(L,\) = \(5,\)"),
    (dict(positions=np.zeros((3, 5), int)), ValueError,
     r"positions must have shape \(L,\) = \(5,\) or \(B, L\) = \(2, 5\)"),
    (dict(positions=np.zeros((2, 5, 1), int)), ValueError, "positions must have shape"),
    (dict(positions=np.array([0, 1, 2, 3, 2**31])), ValueError, "int32 range"),
    (dict(positions=np.array([0, 1, 2, 3, -(2**31) - 1])), ValueError, "int32 range"),
    (dict(positions=np.array([0, 1, 2, 3, 2**63], dtype=np.uint64)), ValueError, "int32 range"),
    (dict(rotary_dim=7), ValueError, "rotary_dim must be an even int >= 2, got 7"),
    (dict(rotary_dim=0), ValueError, "rotary_dim must be an even int >= 2, got 0"),
    (dict(rotary_dim=18), ValueError, r"rotary_dim must be <= the last dimension of x \(D=16\)"),
    (dict(rotary_dim=2.0), TypeError, "rotary_dim must be None or an even int"),
    (dict(inv_freq=np.ones(9)), ValueError, r"rotary_dim must be <= .*2 \* len\(inv_freq\)"),
    (dict(inv_freq=np.ones(4), rotary_dim=16), ValueError,
     "inv_freq must have rotary_dim / 2 = 8 frequencies, got 4"),
    (dict(inv_freq=np.ones((2, 4))), ValueError, "inv_freq must be a non-empty 1-D array"),
    (dict(inv_freq=np.array([1.0, np.nan])), ValueError, "inv_freq must be finite"),
    (dict(inv_freq=np.ones(2, complex)), TypeError, "inv_freq must be a real"),
    (dict(inv_freq=np.ones(8), base=500.0), ValueError, "pass either base"),
    (dict(base=-1.0), ValueError, "base must be finite and > 0"),
    (dict(base="10000"), TypeError, "base must be a positive real number"),
    (dict(layout="neox"), ValueError, "layout must be 'half'"),
    (dict(num_threads=0), ValueError, "num_threads must be None, -1"),
    (dict(num_threads=1.5), TypeError, "num_threads must be None or an int"),
    (dict(out=np.zeros((2, 3, 5, 16), np.float64)), ValueError, "out must have x's shape"),
    (dict(out=np.zeros((2, 3, 5, 8), np.float32)), ValueError, "out must have x's shape"),
    (dict(out=[0.0]), TypeError, "out must be an array like x"),
])
def test_bad_inputs(kwargs, exc, pattern):
    x = rand((2, 3, 5, 16))
    before = x.copy()
    with pytest.raises(exc, match=pattern):
        rotary_embedding(x, **kwargs)
    np.testing.assert_array_equal(x, before)


def test_bad_x():
    with pytest.raises(TypeError, match="x must be a float16, float32 or float64 array"):
        rotary_embedding(np.ones((4, 8), np.int32))
    with pytest.raises(ValueError, match="x must have shape .*at least 2-D"):
        rotary_embedding(np.ones(8, np.float32))
    with pytest.raises(ValueError, match="x last dimension D must be even"):
        rotary_embedding(np.ones((4, 7), np.float32))
    x = rand((2, 4, 8))
    with pytest.raises(ValueError, match="out overlaps x without being x itself"):
        rotary_embedding(x[:, :, :4], out=x[:, :, 2:6])
    # column blocks of one buffer side by side do not overlap (the bounds
    # check refused them): out is written, x is not changed
    before = x.copy()
    got = rotary_embedding(x[:, :, :4], out=x[:, :, 4:])
    assert np.shares_memory(got, x[:, :, 4:])
    np.testing.assert_array_equal(x[:, :, :4], before[:, :, :4])
    np.testing.assert_allclose(x[:, :, 4:], reference(before[:, :, :4], np.arange(4), default_freq(4)),
                               rtol=1e-5, atol=1e-6)
    ro = x.copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="out must be a writable array"):
        rotary_embedding(x, out=ro)


# ---------------------------------------------------------------- kernel pieces
def test_kernel_sincos_matches_numpy():
    rng = np.random.default_rng(19)
    a = np.concatenate([rng.uniform(-10, 10, 20000), rng.uniform(-2.9e9, 2.9e9, 20000),
                        np.arange(0, 2**31, 104729, dtype=np.float64), [0.0, -0.0, 1e-300]])
    s, c = np.empty_like(a), np.empty_like(a)
    _krot.sincos(a, s, c)
    np.testing.assert_allclose(s, np.sin(a), rtol=0, atol=4e-16)
    np.testing.assert_allclose(c, np.cos(a), rtol=0, atol=4e-16)


def test_kernel_portable_half_conversions_match_numpy():
    """The conversions compilers without _Float16 use, over every half
    value and a sweep of floats (ties, subnormals, overflow, NaN)."""
    h = np.arange(65536, dtype=np.uint16)
    f = np.empty(65536, np.float32)
    _krot.half_to_float(h, f)
    ref = h.view(np.float16).astype(np.float32)
    nan = np.isnan(ref)
    np.testing.assert_array_equal(np.isnan(f), nan)
    np.testing.assert_array_equal(f[~nan].view(np.uint32), ref[~nan].view(np.uint32))
    rng = np.random.default_rng(20)
    finite = h[:31743].view(np.float16)                 # 0 .. the largest finite below 65504
    x = np.concatenate([
        (rng.standard_normal(200000) * 10.0 ** rng.integers(-9, 6, 200000)).astype(np.float32),
        np.arange(0, 2**32, 4099, dtype=np.uint64).astype(np.uint32).view(np.float32),
        # exact ties between neighbouring halves, normal and subnormal
        (finite.astype(np.float64) + np.spacing(finite).astype(np.float64) / 2).astype(np.float32)])
    out = np.empty(x.size, np.uint16)
    _krot.float_to_half(x, out)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16)
    isn = np.isnan(x)
    np.testing.assert_array_equal(out[~isn], want[~isn].view(np.uint16))
    assert np.isnan(out[isn].view(np.float16)).all()


def test_exported():
    assert "rotary_embedding" in attncore.__all__
    assert attncore.rotary_embedding is rotary_embedding
