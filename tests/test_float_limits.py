"""Values at the limits of the float32 range, on every forced kernel path.

* Values near the float32 maximum: float32-computed calls (float32 and
  bfloat16 inputs) give the finite result the float64 reference gives, not
  inf (their unnormalized P.V sums exceed float32 before the division by
  the row sum; such calls are computed again in float64).
* Float masks of ``finfo(float32).min`` on every key of a row (the fused
  paths folded scale * log2(e) into the scores, which overflowed: output 0
  and lse -inf), and +3e38 mask entries.
* Scores or ``scale`` near the float32 maximum (NaN on the fused paths).
"""
import warnings

import numpy as np
import pytest

import attncore
from attncore import quantize_kv
from attncore import scaled_dot_product_attention as sdpa

from reference import allowed, lse_ref, rand, sdpa_ref
from reference import attention as ref

BIG = 3e38
TOL32 = dict(rtol=3e-5, atol=3e-6)
F32_MIN = float(np.finfo(np.float32).min)   # -3.4028235e38


def _dtype(name):
    """The dtype of a parameter; bfloat16 needs ml_dtypes (skipped without)."""
    if name == "bfloat16":
        return np.dtype(pytest.importorskip("ml_dtypes").bfloat16)
    return np.dtype(name)


def _qkv(N, M, D, seed=0, lead=(1, 2)):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal(lead + (N, D)).astype(np.float32)
    k = rng.standard_normal(lead + (M, D)).astype(np.float32)
    v = np.full(lead + (M, D), BIG, np.float32)
    v[..., ::2] *= -1  # both signs
    v[..., 1, :] *= 0.5
    return q, k, v


def _near(out, ref):
    out = np.asarray(out, np.float64)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, rtol=1e-2, atol=0)


@pytest.mark.parametrize("dtype", [np.float32, "bfloat16"])
@pytest.mark.parametrize("N", [1, 3, 40])
def test_sdpa_values_near_float32_max(path, dtype, N):
    dt = _dtype(dtype)
    q, k, v = (a.astype(dt) for a in _qkv(N, 70, 16))
    for kw in ({}, {"is_causal": "lower_right"}, {"return_lse": True},
               {"return_weights": True}):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no overflow warnings either
            res = attncore.scaled_dot_product_attention(q, k, v, **kw)
        out = res[0] if isinstance(res, tuple) else res
        assert out.dtype == dt
        ref = sdpa_ref(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                       is_causal=kw.get("is_causal", False))
        _near(out, ref)
        if kw.get("return_lse"):
            _, rlse = sdpa_ref(q.astype(np.float64), k.astype(np.float64),
                               v.astype(np.float64), return_lse=True)
            assert res[1].dtype == np.float32
            np.testing.assert_allclose(res[1], rlse, rtol=1e-5, atol=1e-5)


def test_sdpa_nan_inputs_still_propagate(path):
    """The float64 recomputation keeps the NaN rules: NaN in an attended
    value gives NaN in that output column only."""
    q, k, v = _qkv(5, 20, 8)
    v = np.ones_like(v)
    v[0, 0, 3, 2] = np.nan
    out = attncore.scaled_dot_product_attention(q, k, v)
    assert out.dtype == np.float32
    assert np.isnan(out[0, 0, :, 2]).all()
    np.testing.assert_allclose(np.delete(out[0, 0], 2, axis=-1), 1, rtol=1e-6)
    np.testing.assert_allclose(out[0, 1], 1, rtol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, "bfloat16"])
def test_varlen_values_near_float32_max(path, dtype):
    dt = _dtype(dtype)
    q, k, v = _qkv(30, 40, 16, lead=())
    q, k, v = (np.repeat(a[:, None, :], 2, axis=1).astype(dt) for a in (q, k, v))
    cq, ck = [0, 10, 30], [0, 15, 40]
    out = attncore.varlen_attention(q, k, v, cq, ck, is_causal=True)
    assert out.dtype == dt
    for b in range(2):
        qs, ks = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        ref = sdpa_ref(*(np.swapaxes(a[s], 0, 1).astype(np.float64)
                         for a, s in ((q, qs), (k, ks), (v, ks))), is_causal="lower_right")
        _near(np.swapaxes(out[qs], 0, 1), ref)


# ------------------------------------------ float masks of finfo(float32).min
def test_issue_reproducer_min_mask(path):
    rng = np.random.default_rng(0)
    m = np.full((8, 3), F32_MIN, np.float32)
    out, lse = sdpa(rng.random((8, 4)).astype(np.float32), rng.random((3, 4)).astype(np.float32),
                    np.array([[1.0], [2.0], [3.0]], np.float32), m, return_lse=True)
    np.testing.assert_allclose(out, 2.0, rtol=1e-6)
    np.testing.assert_allclose(lse, F32_MIN + np.log(3), rtol=1e-6)


@pytest.mark.parametrize("layout", ["rows", "keypad"])
@pytest.mark.parametrize("causal", [0, 1])
def test_min_mask_rows_average(path, layout, causal):
    """Rows whose every key carries finfo(float32).min: in float32,
    s + min rounds to min for every |s| < 2**103, so the row is the plain
    average of the values it attends, and its lse min + log(count).  Rows
    with min on some keys only match float64 (those keys weigh 0)."""
    B, H, N, M = 2, 2, 70, 300
    rng = np.random.default_rng(1)
    q, k, v = rand((B, H, N, 16), 2), rand((B, H, M, 16), 3), rand((B, H, M, 8), 4)
    if layout == "rows":
        mask = rand((B, 1, N, M), 5)
        mask[rng.random((B, 1, N, M)) < 0.3] = F32_MIN
        full = rng.random((B, 1, N)) < 0.3          # rows masked with min on every key
        mask[full] = F32_MIN
    else:
        mask = np.zeros((B, 1, 1, M), np.float32)
        mask[0] = F32_MIN                           # batch element 0: every key
        mask[1, ..., ::3] = F32_MIN                 # batch element 1: a third of the keys
        full = np.zeros((B, 1, N), bool)
        full[0] = True
    full = np.broadcast_to(full, (B, H, N))
    out, lse = sdpa(q, k, v, mask, is_causal=bool(causal), return_lse=True)
    e_out, _ = ref(q, k, v, mask, causal=causal)
    e_lse = lse_ref(q, k, mask, causal=causal)
    ok = allowed(N, M, None, causal)                # (N, M): the band
    avg = (ok / ok.sum(-1, keepdims=True)) @ v.astype(np.float64)
    e_out = np.where(full[..., None], avg, e_out)
    e_lse = np.where(full, F32_MIN + np.log(ok.sum(-1)), e_lse)
    assert np.all(np.isfinite(lse))
    np.testing.assert_allclose(out, e_out, **TOL32)
    np.testing.assert_allclose(lse, e_lse, rtol=1e-6, atol=3e-6)


@pytest.mark.parametrize("int8", [False, True])
def test_min_mask_rows_split_keys_and_int8(path, int8):
    """The same with the keys split over threads (flash decoding: one work
    item, 2048 keys) and with int8 keys / values."""
    N, M = 8, 2048
    q, k, v = rand((1, 1, N, 16), 37), rand((1, 1, M, 16), 38), rand((1, 1, M, 8), 39)
    mask = rand((1, 1, N, M), 40)
    mask[..., ::2, :] = F32_MIN                       # even rows: every key
    mask[..., 1::2, : M // 2] = F32_MIN               # odd rows: the first half
    kk, vv = k, v
    if int8:
        (k8, ks), (v8, vs) = quantize_kv(k), quantize_kv(v)
        kk, vv = (k8, ks), (v8, vs)
        k = k8.astype(np.float64) * ks.astype(np.float64)[..., None]
        v = v8.astype(np.float64) * vs.astype(np.float64)[..., None]
    e_out, _ = ref(q, k, v, mask)
    e_lse = lse_ref(q, k, mask)
    e_out[..., ::2, :] = v.astype(np.float64).mean(-2)[..., None, :]
    e_lse[..., ::2] = F32_MIN + np.log(M)
    for t in (1, 2):
        out, lse = sdpa(q, kk, vv, mask, return_lse=True, num_threads=t)
        np.testing.assert_allclose(out, e_out, **TOL32)
        np.testing.assert_allclose(lse, e_lse, rtol=1e-6, atol=3e-6)


def test_huge_positive_mask_entry(path):
    """+3e38 on one key of each row: that key takes all the weight (the
    fused kernel turned it into +inf, then NaN)."""
    q, k, v = rand((40, 16), 6), rand((50, 16), 7), rand((50, 8), 8)
    mask = np.zeros((40, 50), np.float32)
    hot = np.arange(40) % 50
    mask[np.arange(40), hot] = 3e38
    out, lse = sdpa(q, k, v, mask, return_lse=True)
    np.testing.assert_allclose(out, v[hot], **TOL32)
    np.testing.assert_allclose(lse, lse_ref(q, k, mask), rtol=1e-6)


def test_float64_mask_beyond_float32_range_warns_nothing(path):
    """A float64 mask with entries beyond the float32 range on float32
    operands: the hot key takes all the weight (the float32 call's cast
    overflows to inf, and the call runs again in float64), and no NumPy
    RuntimeWarning from that cast reaches the caller."""
    q, k, v = rand((6, 16), 11), rand((9, 16), 12), rand((9, 8), 13)
    mask = np.zeros((6, 9))
    mask[:, 4] = 1e300
    mask[:, 7] = -1e300
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = sdpa(q, k, v, mask)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, np.broadcast_to(v[4], out.shape), **TOL32)


# ---------------------------------------------- scores or scale near the max
def test_huge_scale_zero_queries(path):
    v = rand((3, 5), 9)
    out, lse = sdpa(np.zeros((8, 4), np.float32), np.ones((3, 4), np.float32), v, scale=3e38,
                    return_lse=True)
    np.testing.assert_allclose(out, np.broadcast_to(v.mean(0), (8, 5)), **TOL32)
    np.testing.assert_allclose(lse, np.log(3), rtol=1e-6)


@pytest.mark.parametrize("keys", [(1.0, 0.5, -1.0, 0.25), (-1.0, -0.5, 1.0, 0.0),
                                  (-1.0, -0.9, -0.95, -0.99)],
                         ids=["largest-first", "negated", "all-negative"])
def test_scores_near_float32_max(path, keys):
    """q, k of sqrt(3e38), scale 1: scores of +-3e38; the largest wins (in
    the last case every score is below -2.36e38, beyond the base-2 range)."""
    a = np.float32(np.sqrt(3e38))
    q = np.full((8, 1), a, np.float32)
    k = (np.array(keys, np.float64)[:, None] * a).astype(np.float32)
    v = rand((len(keys), 5), 10)
    out, lse = sdpa(q, k, v, scale=1.0, return_lse=True)
    np.testing.assert_allclose(out, ref(q, k, v, scale=1.0)[0], **TOL32)
    np.testing.assert_allclose(lse, lse_ref(q, k, scale=1.0), rtol=1e-6)


def test_scores_spread_over_the_float32_range(path):
    """Random scores up to 3e38 in magnitude (most beyond the base-2 range
    of 2.36e38), with key padding and causal: float64 says."""
    q, k, v = rand((2, 40, 16), 11), rand((2, 60, 16), 12), rand((2, 60, 8), 13)
    s = np.abs(q.astype(np.float64) @ np.swapaxes(k, -1, -2)).max()
    f = np.float32(np.sqrt(3e38 / s))
    q, k = q * f, k * f
    mask = np.ones((2, 1, 60), bool)
    mask[1, :, 45:] = False
    for causal in (0, 1):
        out, lse = sdpa(q, k, v, mask, scale=1.0, is_causal=bool(causal), return_lse=True)
        np.testing.assert_allclose(out, ref(q, k, v, mask, causal=causal, scale=1.0)[0], **TOL32)
        np.testing.assert_allclose(lse, lse_ref(q, k, mask, causal=causal, scale=1.0), rtol=1e-6)


def test_huge_scale_tiny_keys(path):
    """scale 2e38 times queries of a few units overflows once scale and
    query are multiplied first; the scores themselves are O(1)."""
    q, k, v = rand((40, 16), 14) * 3, rand((30, 16), 15) * np.float32(1e-38), rand((30, 8), 16)
    out, lse = sdpa(q, k, v, scale=2e38, return_lse=True)
    np.testing.assert_allclose(out, ref(q, k, v, scale=2e38)[0], **TOL32)
    np.testing.assert_allclose(lse, lse_ref(q, k, scale=2e38), rtol=1e-5, atol=1e-5)



# ----------------------------------- q.k beyond float32 with finite operands
def _overflowing(N, M, D, seed, dt=np.float32, lead=(1, 2)):
    """Finite q, k whose every score q.k / sqrt(D) lies at or below -2^128
    (beyond -FLT_MAX), keys of three magnitudes so that the float64 softmax
    averages the least negative third; powers of two times 1, 1.125, 1.25,
    so that every product and sum is exact (ties stay ties in the float64
    reference whatever its summation order); values N(0, 1)."""
    rng = np.random.default_rng(seed)
    q = np.full(lead + (N, D), 2.0 ** 63)
    k = np.full(lead + (M, D), -(2.0 ** 63)) * (1 + (np.arange(M) % 3) / 8)[:, None]
    v = rng.standard_normal(lead + (M, D))
    return q.astype(dt), k.astype(dt), v.astype(dt)


@pytest.mark.parametrize("dtype", [np.float32, "bfloat16"])
@pytest.mark.parametrize("N,M", [(1, 3), (3, 50), (40, 70), (1, 3000), (17, 600)])
def test_scores_below_float32_range(path, dtype, N, M):
    """Every score of a row overflows float32 to -inf although the row
    attends keys: the float64 result, never 0 (a fully masked row's answer)
    and never NaN.  Dense, causal, with padding, lse and weights; split
    over keys at two threads."""
    dt = _dtype(dtype)
    q, k, v = _overflowing(N, M, 16, N * M, dt)
    q64, k64, v64 = (a.astype(np.float64) for a in (q, k, v))
    pad = np.ones((1, 1, M), bool)
    pad[..., M - M // 3:] = False
    # one thread: blocks of several panels, whose 16-bit keys / values are
    # converted a chunk of keys at a time (with the last chunk masked, or
    # beyond a causal row's diagonal, the rows came back 0)
    for kw in ({}, {"is_causal": "lower_right"}, {"attn_mask": pad}, {"return_lse": True},
               {"return_weights": True}, {"num_threads": 2}, {"attn_mask": pad, "num_threads": 1},
               {"is_causal": "lower_right", "num_threads": 1}):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no overflow warnings either
            res = attncore.scaled_dot_product_attention(q, k, v, **kw)
        out = res[0] if isinstance(res, tuple) else res
        assert out.dtype == dt
        want = sdpa_ref(q64, k64, v64, kw.get("attn_mask"), kw.get("is_causal", False),
                        return_weights=True, return_lse=True)
        np.testing.assert_allclose(out.astype(np.float64), want[0],
                                   **(TOL32 if dt == np.float32 else dict(rtol=1e-2, atol=1e-2)))
        if kw.get("return_lse"):
            with np.errstate(over="ignore"):   # -4e38 is -inf in float32
                np.testing.assert_array_equal(res[1], want[2].astype(np.float32))
        if kw.get("return_weights"):
            np.testing.assert_allclose(res[1].astype(np.float64), want[1], atol=1e-2)


@pytest.mark.parametrize("N,M", [(1, 3), (3, 50), (40, 70), (1, 3000), (40, 600)])
def test_scores_below_float32_range_int8_keys(path, N, M):
    """Keys as quantize_kv pairs (read in place by the few-row loops,
    converted per tile otherwise): the float64 result of the dequantized
    keys."""
    q, k, v = _overflowing(N, M, 16, 7)
    kq = quantize_kv(k)
    kd = kq[0].astype(np.float64) * kq[1][..., None]
    pad = np.ones((1, 1, M), bool)
    pad[..., M - M // 3:] = False
    for kw in ({}, {"is_causal": "lower_right"}, {"num_threads": 2},
               {"is_causal": "lower_right", "num_threads": 1},
               {"attn_mask": pad, "num_threads": 1}):
        out = sdpa(q, kq, v, **kw)
        want = sdpa_ref(q.astype(np.float64), kd, v.astype(np.float64), kw.get("attn_mask"),
                        is_causal=kw.get("is_causal", False))
        np.testing.assert_allclose(out, want, **TOL32)


@pytest.mark.parametrize("dtype", ["bfloat16", np.float32])
@pytest.mark.parametrize("N,M", [(1, 3), (3, 50), (40, 70)])
def test_minus_inf_keys_still_give_zero(path, dtype, N, M):
    """-inf in the keys (not an overflow: the inputs' own infinities) keeps
    the documented rule: a row whose attended scores are all -inf gives 0,
    16-bit keys read in place included; the rows with finite scores are
    the reference's."""
    dt = _dtype(dtype)
    rng = np.random.default_rng(N + M)
    q = np.abs(rng.standard_normal((2, N, 8))).astype(dt)
    q[1] = rng.standard_normal((N, 8))
    k = rng.standard_normal((2, M, 8)).astype(dt)
    k[:, :, 0] = -np.inf
    v = rng.standard_normal((2, M, 8)).astype(dt)
    q[1, :, 0] = 0   # 0 * -inf: NaN scores in head 1
    out = sdpa(q, k, v)
    np.testing.assert_array_equal(out[0].astype(np.float64), 0)
    assert np.isnan(out[1].astype(np.float64)).all()


_PACKED_CQ, _PACKED_CK = np.array([0, 1, 6]), np.array([0, 15, 40])
_PACKED_TABLE = np.array([[0, 1, -1, -1, -1], [2, 3, 4, 5, 6]])


def _packed_overflowing():
    """Two sequences (1 x 15 and 5 x 25 rows, 2 heads) whose scores lie
    below the float32 range: packed (T, H, D) q, k, v."""
    q, k, v = _overflowing(6, 40, 16, 5, lead=())
    return tuple(np.repeat(a[:, None, :], 2, axis=1) for a in (q, k, v))


def _paged_pool(k, v, fill):
    """k / v of _packed_overflowing in a pool of 10 blocks of 8 slots
    (_PACKED_TABLE), every other slot ``fill``; and each sequence's float64
    reference rows (lower-right causal) with its query slice."""
    bs, ck = 8, _PACKED_CK
    kc = np.full((10, bs, 2, 16), fill, np.float32)
    vc = np.full_like(kc, fill)
    for s in range(2):
        for j in range(ck[s + 1] - ck[s]):
            kc[_PACKED_TABLE[s, j // bs], j % bs] = k[ck[s] + j]
            vc[_PACKED_TABLE[s, j // bs], j % bs] = v[ck[s] + j]
    return kc, vc


def _packed_refs(q, k, v):
    """(query slice, float64 reference (H, n, Dv)) of each sequence."""
    cq, ck = _PACKED_CQ, _PACKED_CK
    for s in range(2):
        qs, ks_ = slice(cq[s], cq[s + 1]), slice(ck[s], ck[s + 1])
        yield qs, sdpa_ref(*(np.swapaxes(a[sl], 0, 1).astype(np.float64)
                             for a, sl in ((q, qs), (k, ks_), (v, ks_))), is_causal="lower_right")


def test_scores_below_float32_range_varlen_and_paged(path):
    """The same rows through varlen_attention and paged_attention."""
    q, k, v = _packed_overflowing()
    cq, ck = _PACKED_CQ, _PACKED_CK
    out = attncore.varlen_attention(q, k, v, cq, ck, is_causal=True)
    kc, vc = _paged_pool(k, v, 0.0)
    paged = attncore.paged_attention(q, kc, vc, block_table=_PACKED_TABLE, seq_lens=np.diff(ck),
                                     cu_seqlens_q=cq)
    for qs, want in _packed_refs(q, k, v):
        np.testing.assert_allclose(np.swapaxes(out[qs], 0, 1), want, **TOL32)
        np.testing.assert_allclose(np.swapaxes(paged[qs], 0, 1), want, **TOL32)


def test_overflowed_tiles_beside_finite_scores(path):
    """Only some key tiles of a row overflow: the finite scores elsewhere
    decide (float64 has the answer in its own range; float32 too, split
    over keys at two threads)."""
    rng = np.random.default_rng(3)
    for dt, big, M in ((np.float64, 2.0 ** 511, 300), (np.float32, 2.0 ** 63, 600),
                       (np.float32, 2.0 ** 63, 5000)):
        q = np.full((1, 2, 16), big, dt)
        k = np.full((1, M, 16), -big, dt)
        v = rng.standard_normal((1, M, 4)).astype(dt)
        for last in (True, False):
            kk = k.copy()
            kk[0, -1 if last else 0] = 1e-3
            for thr in (1, 2):
                out = sdpa(q, kk, v, num_threads=thr)
                np.testing.assert_allclose(out[0], np.broadcast_to(v[0, -1 if last else 0], (2, 4)),
                                           rtol=1e-6)


def test_overflowed_rows_beside_infinite_inputs(path):
    """A float32 call whose output is not finite is computed again in
    float64 also where an operand holds inf or NaN: a row whose finite
    scores overflowed gets the float64 answer -- never NaN, never the 0 of
    an empty row -- in the same head as an inf, in another head, beside an
    inf / NaN value the row does not attend, or beside a -inf key element
    that only removes its own key; a row of inf-input keys alone keeps its
    documented 0 (float64 reference: the same call on float64 operands,
    and the plain averages these rows reduce to)."""
    rng = np.random.default_rng(4)

    def both(q, k, v, *mask):
        got = sdpa(q, k, v, *mask)
        ref = sdpa(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), *mask)
        np.testing.assert_allclose(got, ref, rtol=1e-6, equal_nan=True)
        return got

    q = np.full((2, 1, 16), 2.0 ** 63, np.float32)
    q[1, 0, 0] = np.inf
    k = np.full((2, 600, 16), -(2.0 ** 63), np.float32)
    v = rng.standard_normal((2, 600, 4)).astype(np.float32)
    o = both(q, k, v)
    np.testing.assert_allclose(o[0, 0], v[0].astype(np.float64).mean(0), rtol=1e-5)
    np.testing.assert_array_equal(o[1], 0)   # every score -inf from the query's inf
    q1 = np.full((1, 16), 2.0 ** 63, np.float32)
    k3 = np.full((3, 16), -(2.0 ** 63), np.float32)
    for bad in (np.inf, np.nan):
        v3 = np.array([[1.0], [2.0], [bad]], np.float32)
        np.testing.assert_allclose(both(q1, k3, v3, np.array([True, True, False])), [[1.5]],
                                   rtol=1e-6)
    for M, inf_key in ((2, 0), (600, 0), (600, 590)):
        kk = np.full((M, 16), -(2.0 ** 63), np.float32)
        kk[inf_key, 0] = -np.inf
        vv = np.arange(M, dtype=np.float32)[:, None]
        expected = np.delete(vv, inf_key, 0).astype(np.float64).mean(0)
        np.testing.assert_allclose(both(q1, kk, vv)[0], expected, rtol=1e-5)
    kk = np.full((3, 16), 1.0, np.float32)
    kk[:, 0] = -np.inf     # every attended score -inf from the keys' own inf
    np.testing.assert_array_equal(both(q1, kk, np.ones((3, 1), np.float32)), 0)


def test_overflowed_scores_beside_a_masked_nan_value(path):
    """A key whose score overflows float32's dot product (q . k = 4e38,
    scaled 2e38) beside a NaN value of a masked-out key: the float64
    answer (the dominant key's value, lse 2e38), not NaN; and with many
    rows, no NaN row and every row within float32 rounding of float64."""
    q = np.ones((1, 4), np.float32)
    k = np.array([[1e38] * 4, [0.0] * 4], np.float32)
    v = np.array([[1.0] * 4, [np.nan] * 4], np.float32)
    out, lse = sdpa(q, k, v, np.array([[True, False]]), return_lse=True)
    np.testing.assert_array_equal(out, np.ones((1, 4), np.float32))
    np.testing.assert_allclose(lse, [2e38], rtol=1e-6)
    rng = np.random.default_rng(1)
    q = rng.standard_normal((64, 64)).astype(np.float32)
    k = rng.standard_normal((128, 64)).astype(np.float32)
    k[-1] = 1e38
    v = rng.standard_normal((128, 64)).astype(np.float32)
    v[1, 0] = np.nan
    mask = np.ones((64, 128), bool)
    mask[:, 1] = False
    ref = sdpa(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), mask)
    for nt in (1, 2):
        got = sdpa(q, k, v, mask, num_threads=nt)
        assert np.isfinite(got).all()
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


def test_overflowed_row_with_a_sink(path):
    """With an attention sink: float32 rows take float64's answer -- 0 and
    the sink's lse where the true scores lie far below the sink, the keys'
    average where a small scale brings q.k (beyond float32) far above it;
    float64 rows beyond the float64 range are NaN."""
    q = np.full((1, 2, 16), 2.0 ** 63, np.float32)
    k = np.full((1, 3, 16), -(2.0 ** 63), np.float32)
    v = np.arange(12, dtype=np.float32).reshape(1, 3, 4)
    out, lse = sdpa(q, k, v, sinks=np.array([0.5]), return_lse=True)
    np.testing.assert_array_equal(out, 0)
    np.testing.assert_allclose(lse, 0.5, rtol=1e-6)
    for prec in (None, "int8"):
        out = sdpa(q, k, v, scale=1e-10, sinks=np.array([-3e38]), precision=prec)
        np.testing.assert_allclose(out[0], np.broadcast_to(v[0].mean(0), (2, 4)), rtol=1e-5)
    out = sdpa(q.astype(np.float64) * 2.0 ** 448, k.astype(np.float64) * 2.0 ** 448,
               v.astype(np.float64), sinks=np.array([0.5]))
    assert np.isnan(out).all()


def test_int8_precision_overflowed_rows(path):
    """precision="int8" where q . k (and the smoothing's q . mu) overflow
    float32: the output of float64's softmax, with weights, a soft cap and
    without."""
    q = np.full((1, 1, 16), 2.0 ** 63, np.float32)
    k = np.full((1, 3, 16), -(2.0 ** 63), np.float32) * np.array([1, 1.125, 1.25],
                                                                  np.float32)[:, None]
    v = np.array([7.0, 1.0, 2.0], np.float32)[None, :, None]
    np.testing.assert_allclose(sdpa(q, k, v, precision="int8"), [[[7.0]]], rtol=1e-6)
    out, w = sdpa(q, k, v, precision="int8", return_weights=True)
    np.testing.assert_allclose(out, [[[7.0]]], rtol=1e-6)
    np.testing.assert_allclose(w, [[[1.0, 0.0, 0.0]]], atol=1e-6)
    np.testing.assert_allclose(sdpa(q, k, v, precision="int8", softcap=30.0), [[[10 / 3]]],
                               rtol=1e-5)
    # the lse too (the smoothing's q . mu shift overflowed float32)
    out, lse = sdpa(q, k, v, precision="int8", scale=1e-10, return_lse=True)
    want = lse_ref(q.astype(np.float64), k.astype(np.float64), scale=1e-10)
    np.testing.assert_allclose(out, [[[7.0]]], rtol=1e-6)
    np.testing.assert_allclose(lse, want, rtol=1e-6)


def test_overflowed_rows_beside_nan_elsewhere_varlen_and_paged(path):
    """Rows whose scores leave the float32 range get the float64 answer
    also where NaN sits in rows they never read: another sequence's values
    (varlen: that sequence's row is NaN in the value's column, the other
    sequence exact) and blocks of
    the paged pool no sequence uses."""
    q, k, v = _packed_overflowing()
    cq, ck = _PACKED_CQ, _PACKED_CK
    v_nan = v.copy()
    v_nan[3, 1, 0] = np.nan        # a value of sequence 0, which its one row attends
    out = attncore.varlen_attention(q, k, v_nan, cq, ck, is_causal=True)
    assert np.isnan(out[0, 1, 0]) and np.isfinite(out[0, 1, 1:]).all()   # its column only
    assert np.isfinite(out[0, 0]).all()
    # NaN everywhere else: blocks 7 - 9 and the slots past sequence 0's 15 tokens
    kc, vc = _paged_pool(k, v, np.nan)
    paged = attncore.paged_attention(q, kc, vc, block_table=_PACKED_TABLE, seq_lens=np.diff(ck),
                                     cu_seqlens_q=cq)
    for i, (qs, want) in enumerate(_packed_refs(q, k, v)):
        np.testing.assert_allclose(np.swapaxes(paged[qs], 0, 1), want, **TOL32)
        if i == 1:
            np.testing.assert_allclose(np.swapaxes(out[qs], 0, 1), want, **TOL32)


def test_paged_int8_pool_and_lse_of_overflowed_rows(path):
    """paged_attention over an int8 pool: the float64 answer on the
    dequantized pool; return_lse without an overflow warning (the lse
    beyond float32 is -inf)."""
    q = np.full((1, 1, 16), 2.0 ** 63, np.float32)
    kc = np.full((2, 4, 1, 16), -(2.0 ** 63), np.float32)
    kc[0, :, 0] *= (1 + np.arange(4) / 8)[:, None]
    vc = np.random.default_rng(5).standard_normal((2, 4, 1, 16)).astype(np.float32)
    for pair in (False, True):
        kk, vv = (quantize_kv(kc), quantize_kv(vc)) if pair else (kc, vc)
        kd = kk[0].astype(np.float64) * kk[1][..., None] if pair else kc.astype(np.float64)
        vd = vv[0].astype(np.float64) * vv[1][..., None] if pair else vc.astype(np.float64)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            out, lse = attncore.paged_attention(q, kk, vv, block_table=[[0]], seq_lens=[3],
                                                return_lse=True)
        want = sdpa_ref(q[:, 0].astype(np.float64), kd[0, :3, 0], vd[0, :3, 0])
        np.testing.assert_allclose(out[:, 0], want, **TOL32)
        assert lse[0, 0] == -np.inf


def test_merging_parts_whose_lse_is_beyond_float32(path):
    """Halves of a row whose scores all lie below -FLT_MAX: each half's
    float64 answer comes back with lse -inf.  merge_attention cannot weigh
    them (NaN, not the 0 of an empty row); beside a half with a finite lse
    that half takes all the weight, as in float64."""
    q, k, v = _overflowing(2, 8, 16, 9, lead=())
    parts = [sdpa(q, k[s], v[s], return_lse=True) for s in (slice(0, 4), slice(4, 8))]
    assert np.all(parts[0][1] == -np.inf) and np.any(parts[0][0] != 0)
    out, lse = attncore.merge_attention([p[0] for p in parts], [p[1] for p in parts])
    assert np.isnan(out).all() and np.isnan(lse).all()
    kf = k.copy()
    kf[5] = 0.5
    parts[1] = sdpa(q, kf[4:], v[4:], return_lse=True)
    out, lse = attncore.merge_attention([p[0] for p in parts], [p[1] for p in parts])
    np.testing.assert_allclose(out, np.broadcast_to(v[5], (2, 16)), rtol=1e-6)
    empty = attncore.merge_attention([np.zeros((2, 3))], [np.full(2, -np.inf)])
    np.testing.assert_array_equal(empty[0], 0)


def test_scores_below_float64_range_are_nan(path):
    """A float64 call whose scores all overflow float64 has no answer in
    its own type (and none is computed in a wider one): NaN, not the 0 of
    a fully masked row.  A fully masked row stays 0."""
    q = np.full((2, 8), 2.0 ** 511)
    k = np.full((3, 8), -(2.0 ** 511))
    v = np.ones((3, 4))
    assert np.isnan(sdpa(q, k, v)).all()
    mask = np.zeros((2, 3), bool)
    np.testing.assert_array_equal(sdpa(q, k, v, mask), 0)



@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_all_finite_finds_every_nonfinite_element(path, dtype):
    """The output check behind the float64 re-run (_sdpa.all_finite):
    inf, -inf and NaN at the start, across a block boundary and at the
    end, on every kernel path; extreme finite values are finite."""
    from attncore._core import _sdpa
    info = np.finfo(dtype)
    for n in (1, 7, 4095, 4096, 4097, 20000):
        a = np.random.default_rng(n).standard_normal(n).astype(dtype)
        a[0], a[-1] = info.max, info.smallest_subnormal
        assert _sdpa.all_finite(a)
        for bad in (np.inf, -np.inf, np.nan):
            for pos in {0, min(4096, n - 1), n // 2, n - 1}:
                b = a.copy()
                b[pos] = bad
                assert not _sdpa.all_finite(b), (n, pos, bad)
