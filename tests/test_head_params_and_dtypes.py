"""Sinks and ALiBi slopes at the edges of the compute dtype's range, bfloat16 head
parameters of every array library, cu_seqlens error values, and Dask results in
the inputs' 16-bit dtype (regression tests: each failed before its fix),
on every forced kernel path (the ``path`` fixture of conftest.py).

3. ``sinks`` / ``alibi_slopes`` beyond the float32 range in a float32 (or
   float16 / bfloat16) call gave NaN output and an inf lse; now refused with
   a ValueError (the float64 call keeps the documented result).  Slopes
   within the range but large gave a wrong lse on the fused paths under a
   causal mask (the kernel's linearized ALiBi term lost the scores' digits):
   now compared with the float64 call.
4. torch bfloat16 ``sinks`` / ``alibi_slopes`` failed with torch's
   "unsupported ScalarType BFloat16"; ``MultiHeadAttention(alibi_slopes=)``
   refused bfloat16 slopes (torch or ml_dtypes).
6. a uint64 ``cu_seqlens`` offset of 2**63 showed as -9223372036854775808 in
   the error.
7. ``attncore.dask`` on ml_dtypes bfloat16 arrays computed to raw void
   (``|V2``) garbage.
(5, the guide's claims about what raises, is checked by the executed
examples of docs/guide/pytorch.rst and semantics.rst.)
"""
import numpy as np
import pytest

from attncore import MultiHeadAttention, varlen_attention
from attncore import scaled_dot_product_attention as sdpa

from reference import sdpa_ref
from reference import rand

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)
F32_MAX = float(np.finfo(np.float32).max)
HALF = [np.dtype(np.float32), BF16, np.dtype(np.float16)]   # the float32-compute dtypes


def qkv(N=5, M=7, dtype=np.float32, H=2, D=8):
    """Operands rounded to ``dtype``, and the same values in float64."""
    q, k, v = rand((1, H, N, D), 1, dtype), rand((1, H, M, D), 2, dtype), rand((1, H, M, D), 3, dtype)
    return (q, k, v), tuple(x.astype(np.float64) for x in (q, k, v))


def tol(dtype):
    """(atol of the output, rtol of the lse) of a float32-compute call of ``dtype``
    against float64 on the same (rounded) inputs."""
    return (2e-6, 1e-6) if dtype == np.float32 else (1e-2, 1e-3)


# --------------------------------------------------------------------------
# 3. sinks / alibi_slopes and the float32 range
# --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", HALF, ids=lambda d: d.name)
@pytest.mark.parametrize("sink", [1e300, 3.5e38, -1e300])
def test_sinks_beyond_float32_are_refused(path, dtype, sink):
    (q, k, v), (q64, k64, v64) = qkv(dtype=dtype)
    copies = [x.copy() for x in (q, k, v)]
    sinks = np.array([sink, 0.5])
    with pytest.raises(ValueError, match=r"sinks must lie within the float32 range "
                                         r"\(\|sinks\| <= 3\.4028235e\+38.*got " + f"{sink:.8g}"
                                         .replace("+", r"\+")):
        sdpa(q, k, v, sinks=sinks, return_lse=True)
    for x, c in zip((q, k, v), copies):
        np.testing.assert_array_equal(x, c)
    # the float64 call: the documented result (a 1e300 sink takes the whole
    # softmax: output 0, lse = the sink), as the reference
    out, lse = sdpa(q64, k64, v64, sinks=sinks, return_lse=True)
    rout, rlse = sdpa_ref(q64, k64, v64, sinks=sinks, return_lse=True)
    np.testing.assert_allclose(out, rout, atol=1e-12)
    np.testing.assert_allclose(lse, rlse, rtol=1e-12)
    if sink == 1e300:
        assert (out[0, 0] == 0).all() and (lse[0, 0] == 1e300).all()


@pytest.mark.parametrize("dtype", HALF, ids=lambda d: d.name)
def test_slopes_beyond_float32_are_refused(path, dtype):
    (q, k, v), (q64, k64, v64) = qkv(dtype=dtype)
    for s in (1e300, -1e300, 3.5e38):
        with pytest.raises(ValueError, match=r"alibi_slopes must keep the ALiBi term .* float32 "
                                             r"range .*largest distance 6"):
            sdpa(q, k, v, alibi_slopes=[s, 0.5])
    # the float64 call gives the ALiBi diagonal (query i: key i + M - N)
    out, lse = sdpa(q64, k64, v64, alibi_slopes=[1e300, 0.5], return_lse=True)
    rout, rlse = sdpa_ref(q64, k64, v64, alibi_slopes=[1e300, 0.5], return_lse=True)
    np.testing.assert_allclose(out, rout, atol=1e-12)
    np.testing.assert_allclose(out[0, 0], v64[0, 0, 2:], atol=1e-12)
    np.testing.assert_allclose(lse, rlse, rtol=1e-12)


@pytest.mark.parametrize("dtype", HALF, ids=lambda d: d.name)
def test_slope_limit_is_the_largest_distance(path, dtype):
    """|slope| * max(1, max(N, M) - 1) <= float32 max: the limit itself is
    taken and equals the float64 call; just above it is refused."""
    (q, k, v), (q64, k64, v64) = qkv(N=5, M=7, dtype=dtype)
    lim = F32_MAX / 6
    for s in (lim, -lim):
        out, lse = sdpa(q, k, v, alibi_slopes=[s, 0.5], return_lse=True)
        rout, rlse = sdpa_ref(q64, k64, v64, alibi_slopes=[s, 0.5], return_lse=True)
        assert np.isfinite(out.astype(np.float64)).all() and np.isfinite(lse).all()
        atol, rtol = tol(dtype)
        np.testing.assert_allclose(out.astype(np.float64), rout, atol=atol)
        np.testing.assert_allclose(lse, rlse, rtol=rtol, atol=atol)
    with pytest.raises(ValueError, match=r"\|alibi_slopes\| <= 5\.67"):
        sdpa(q, k, v, alibi_slopes=[lim * 1.001, 0.5])
    # one query and one key: distance 0, the limit is the float32 maximum
    one = q[..., :1, :]
    assert np.isfinite(sdpa(one, one, one, alibi_slopes=[F32_MAX, -F32_MAX]).astype(float)).all()
    with pytest.raises(ValueError, match="alibi_slopes"):
        sdpa(one, one, one, alibi_slopes=[1e39, 0.0])


CASES = [dict(), dict(causal=True), dict(softcap=5.0), dict(causal=True, window=(3, 0))]


@pytest.mark.parametrize("dtype", HALF, ids=lambda d: d.name)
@pytest.mark.parametrize("N,M", [(1, 9), (3, 9), (40, 40), (70, 130)])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_large_values_within_float32_match_float64(path, dtype, N, M, case):
    """Slopes up to the limit and sinks up to the float32 maximum: no NaN,
    and output and lse of the float64 call / the float64 reference (the
    causal cases ran the fused kernels' linearized ALiBi term, whose lse was
    rounding noise for slopes of 1e30)."""
    kw = CASES[case]
    (q, k, v), (q64, k64, v64) = qkv(N, M, dtype)
    c = "lower_right" if kw.get("causal") else False
    call = dict(is_causal=c, window=kw.get("window"), softcap=kw.get("softcap"), return_lse=True)
    d = max(N, M) - 1
    atol, rtol = tol(dtype)
    trials = [dict(alibi_slopes=[s, 0.5]) for s in (2.0, 30.0, 1e30, -1e30, F32_MAX / d,
                                                   -F32_MAX / d)]
    trials += [dict(sinks=[s, 0.5]) for s in (3e38, F32_MAX, -F32_MAX, 1e30)]
    trials += [dict(alibi_slopes=[1e30, 0.25], sinks=[1e30, -2.0])]
    for t in trials:
        out, lse = sdpa(q, k, v, **call, **t)
        out = out.astype(np.float64)
        assert not np.isnan(out).any() and not np.isnan(lse).any(), t
        o64, l64 = sdpa(q64, k64, v64, **call, **t)
        rout, rlse = sdpa_ref(q64, k64, v64, **call, **t)
        np.testing.assert_allclose(o64, rout, atol=1e-9, err_msg=str(t))
        np.testing.assert_allclose(out, rout, atol=atol, err_msg=str(t))
        np.testing.assert_allclose(lse, rlse, rtol=rtol, atol=atol, err_msg=str(t))


@pytest.mark.parametrize("dtype", HALF, ids=lambda d: d.name)
def test_return_weights_and_empty_rows_with_large_values(path, dtype):
    (q, k, v), (q64, k64, v64) = qkv(4, 6, dtype)
    atol, rtol = tol(dtype)
    o, w = sdpa(q, k, v, alibi_slopes=[1e30, -1e30], sinks=[3e38, 0.0], return_weights=True)
    rout = sdpa_ref(q64, k64, v64, alibi_slopes=[1e30, -1e30], sinks=[3e38, 0.0])
    np.testing.assert_allclose(o.astype(np.float64), rout, atol=atol)
    assert (w[0, 0] == 0).all()             # the 3e38 sink takes the whole softmax
    # no key: lse = the sink, as float32 holds it
    _, lse = sdpa(q, k[..., :0, :], v[..., :0, :], sinks=[F32_MAX, -F32_MAX], return_lse=True)
    np.testing.assert_array_equal(lse[0, :, 0], np.float32([F32_MAX, -F32_MAX]))
    with pytest.raises(ValueError, match="sinks must lie within the float32 range"):
        sdpa(q, k[..., :0, :], v[..., :0, :], sinks=[1e300, 0.0], return_lse=True)


@pytest.mark.parametrize("dtype", HALF, ids=lambda d: d.name)
def test_varlen_slopes_and_the_float32_range(path, dtype):
    rng = np.random.default_rng(4)
    cu = np.array([0, 3, 20, 50])
    x = rng.standard_normal((50, 2, 8)).astype(dtype)
    x64 = x.astype(np.float64)
    with pytest.raises(ValueError, match=r"alibi_slopes must keep the ALiBi term .* float32 range "
                                         r"up to this call's largest distance 29 .*got 1e\+300"):
        varlen_attention(x, x, x, cu, cu, alibi_slopes=[1e300, 0.5])
    atol, _ = tol(dtype)
    for slopes in ([1e300, 0.5], [1e30, -1e30], [F32_MAX / 29, 2.0]):
        for causal in (False, True):
            got64 = varlen_attention(x64, x64, x64, cu, cu, alibi_slopes=slopes, is_causal=causal)
            for b in range(3):
                s = slice(cu[b], cu[b + 1])
                xb = x64[s].transpose(1, 0, 2)
                rout = sdpa_ref(xb, xb, xb, is_causal=causal, alibi_slopes=slopes, diagonal="lower_right")
                np.testing.assert_allclose(got64[s].transpose(1, 0, 2), rout, atol=1e-9)
            if slopes[0] == 1e300:
                continue
            got = varlen_attention(x, x, x, cu, cu, alibi_slopes=slopes, is_causal=causal)
            assert got.dtype == dtype
            np.testing.assert_allclose(got.astype(np.float64), got64, atol=atol)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, "bfloat16"])
def test_mha_slopes_and_the_float32_range(dtype):
    with pytest.raises(ValueError, match=r"alibi_slopes must lie within the float32 range "
                                         r"\(\|alibi_slopes\| <= 3\.4028235e\+38.*got 1e\+300"):
        MultiHeadAttention(16, 2, dtype=dtype, alibi_slopes=[1e300, 0.5])
    mha = MultiHeadAttention(16, 2, dtype=dtype, rng=0)
    with pytest.raises(ValueError, match="alibi_slopes must lie within the float32 range"):
        mha.alibi_slopes = [0.5, -3.5e38]
    assert mha.alibi_slopes is None                       # unchanged by the refused value
    # within float32 but too large for this call's distances: refused by the call
    mha.alibi_slopes = [1e38, 0.5]
    x = rand((1, 6, 16), 5)
    with pytest.raises(ValueError, match="alibi_slopes must keep the ALiBi term"):
        mha(x)
    # large but valid: the float64 layer of the same weights
    mha.alibi_slopes = [1e30, -1e30]
    m64 = MultiHeadAttention.from_arrays(
        **{f"{p}_{w}": getattr(mha, f"{p}_{w}") for p in ("q", "k", "v", "out")
           for w in ("weight", "bias")}, num_heads=2, dtype=np.float64, alibi_slopes=[1e30, -1e30])
    out, _ = mha(x, is_causal=True)
    out64, _ = m64(x.astype(np.float64), is_causal=True)
    assert np.isfinite(out.astype(np.float64)).all()
    np.testing.assert_allclose(out.astype(np.float64), out64,
                               atol=1e-5 if dtype == np.float32 else 5e-2)


def test_mha_float64_layer_takes_float64_slopes():
    mha = MultiHeadAttention(16, 2, dtype=np.float64, alibi_slopes=[1e300, 0.5], rng=0)
    x = rand((1, 5, 16), 6, np.float64)
    out, _ = mha(x)
    assert np.isfinite(out).all()


# --------------------------------------------------------------------------
# 4. bfloat16 sinks / alibi_slopes (torch and ml_dtypes)
# --------------------------------------------------------------------------
def test_torch_bfloat16_slopes_and_sinks(path):
    torch = pytest.importorskip("torch")
    (q, k, v), (q64, k64, v64) = qkv(6, 9)
    vals = [0.5, -1.25]                                   # exact in bfloat16
    expect_out, expect_lse = sdpa_ref(q64, k64, v64, is_causal="lower_right", alibi_slopes=vals, sinks=vals,
                                      return_lse=True)
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    tb = torch.tensor(vals, dtype=torch.bfloat16)
    nb = np.array(vals, BF16)
    for f32, args in ((True, (tq, tk, tv)), (True, (q, k, v)),
                      (False, (tq.bfloat16(), tk.bfloat16(), tv.bfloat16()))):
        for slopes, sinks in ((tb, tb), (nb, nb), (tb, nb), (tb.float(), tb)):
            out, lse = sdpa(*args, is_causal="lower_right", alibi_slopes=slopes, sinks=sinks,
                            return_lse=True)
            base = sdpa(*args, is_causal="lower_right", alibi_slopes=np.array(vals),
                        sinks=np.array(vals), return_lse=True)
            for a, b in zip((out, lse), base):         # the float64 values' call, exactly
                a = a.float().numpy() if hasattr(a, "numpy") else a.astype(np.float32)
                b = b.float().numpy() if hasattr(b, "numpy") else b.astype(np.float32)
                np.testing.assert_array_equal(a, b)
            if f32:
                o = out.numpy() if hasattr(out, "numpy") else out
                np.testing.assert_allclose(o, expect_out, atol=2e-6)
                np.testing.assert_allclose(np.asarray(lse), expect_lse, rtol=1e-6, atol=2e-6)
    assert tb.dtype is torch.bfloat16 and tb.tolist() == vals     # inputs untouched
    # varlen with torch bfloat16 slopes, too
    x = torch.randn(12, 2, 8)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    a = varlen_attention(x, x, x, cu, cu, alibi_slopes=tb, is_causal=True)
    b = varlen_attention(x, x, x, cu, cu, alibi_slopes=np.array(vals), is_causal=True)
    np.testing.assert_array_equal(a.numpy(), b.numpy())


@pytest.mark.parametrize("kind", ["torch", "ml_dtypes"])
@pytest.mark.parametrize("dtype", [np.float32, "bfloat16"])
def test_mha_takes_bfloat16_slopes(kind, dtype):
    vals = [0.5, 0.125]
    if kind == "torch":
        torch = pytest.importorskip("torch")
        slopes = torch.tensor(vals, dtype=torch.bfloat16)
    else:
        slopes = np.array(vals, BF16)
    mha = MultiHeadAttention(16, 2, dtype=dtype, alibi_slopes=slopes, rng=0)
    assert mha.alibi_slopes.dtype == np.float64
    np.testing.assert_array_equal(mha.alibi_slopes, vals)
    ref_layer = MultiHeadAttention(16, 2, dtype=dtype, alibi_slopes=np.array(vals), rng=0)
    x = rand((2, 7, 16), 7)
    np.testing.assert_array_equal(mha(x, is_causal=True)[0], ref_layer(x, is_causal=True)[0])
    mha.alibi_slopes = None
    mha.alibi_slopes = slopes                              # the setter, too
    np.testing.assert_array_equal(mha.alibi_slopes, vals)


# --------------------------------------------------------------------------
# 6. cu_seqlens: the values the input holds
# --------------------------------------------------------------------------
@pytest.mark.parametrize("arg", ["cu_seqlens_q", "cu_seqlens_k"])
def test_uint64_offsets_beyond_int64_show_their_value(arg):
    x = np.zeros((8, 1, 4), np.float32)
    good = np.array([0, 3, 8], np.uint64)
    cases = [([0, 2**63, 8], rf"{arg} must be non-decreasing, got {arg}\[1\] = "
                             rf"9223372036854775808 > {arg}\[2\] = 8$"),
             ([2**63, 8], rf"{arg} must start at 0, got {arg}\[0\] = 9223372036854775808$"),
             ([0, 3, 2**64 - 1], rf"{arg} must end at the total length \((q|k)\.shape\[0\] = 8\), "
                                 rf"got {arg}\[-1\] = 18446744073709551615$")]
    for vals, msg in cases:
        bad = np.array(vals, np.uint64)
        copy = bad.copy()
        kw = {"cu_seqlens_q": good, "cu_seqlens_k": good}
        kw[arg] = bad
        if len(vals) != 3:
            kw = {a: (bad if a == arg else np.array([0, 8], np.uint64)) for a in kw}
        with pytest.raises(ValueError, match=msg):
            varlen_attention(x, x, x, kw["cu_seqlens_q"], kw["cu_seqlens_k"])
        np.testing.assert_array_equal(bad, copy)
    # valid uint64 offsets: the int32 offsets' result
    r = rand((8, 1, 4), 8)
    np.testing.assert_array_equal(varlen_attention(r, r, r, good, good),
                                  varlen_attention(r, r, r, good.astype(np.int32),
                                                   good.astype(np.int32)))


# --------------------------------------------------------------------------
# 7. attncore.dask keeps 16-bit dtypes
# --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float16)], ids=lambda d: d.name)
def test_dask_16_bit_results(path, dtype):
    dask = pytest.importorskip("dask")
    da = pytest.importorskip("dask.array")
    import attncore.dask as ad

    q, k, v = (rand(s, i, dtype) for i, s in enumerate(((2, 3, 40, 16), (2, 3, 50, 16),
                                                          (2, 3, 50, 8))))
    core, core_lse = sdpa(q, k, v, return_lse=True)
    rout, rlse = sdpa_ref(q, k, v, return_lse=True)
    eps = float(ml_dtypes.finfo(dtype).eps)
    with dask.config.set(scheduler="synchronous"):
        for qc, kc, bc, hc in ((40, 50, 2, 3), (13, 50, 1, 3), (40, 20, 1, 1), (9, 16, 1, 2)):
            Q = da.from_array(q, chunks=(bc, hc, qc, 16))
            K = da.from_array(k, chunks=(bc, hc, kc, 16))
            V = da.from_array(v, chunks=(bc, hc, kc, 8))
            out, lse = ad.scaled_dot_product_attention(Q, K, V, return_lse=True)
            assert out.dtype == dtype and out._meta.dtype == dtype
            assert lse.dtype == np.float32
            got, got_lse = dask.compute(out, lse)
            assert got.dtype == dtype and got_lse.dtype == np.float32
            if (qc, kc, bc, hc) == (40, 50, 2, 3):     # one chunk: the core's result exactly
                np.testing.assert_array_equal(got, core)
                np.testing.assert_array_equal(got_lse, core_lse)
            # more chunks: the core's result to the rounding of the dtype, and the
            # float64 reference to the error of the 16-bit result
            g = got.astype(np.float64)
            np.testing.assert_allclose(g, core.astype(np.float64), rtol=0,
                                       atol=2 * eps * np.abs(rout).max())
            np.testing.assert_allclose(g, rout, rtol=0, atol=4 * eps * np.abs(rout).max())
            np.testing.assert_allclose(got_lse, rlse, rtol=1e-3, atol=1e-3)
