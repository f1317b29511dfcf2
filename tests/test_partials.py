"""Log-sum-exp partials: ``return_lse`` and ``merge_attention`` against the
float64 reference.

The reference lse (reference.lse_ref) is the log of the sum of
exp(score) over the keys a row attends, -inf for a row that attends
nothing.
"""
import numpy as np
import pytest

import attncore
from attncore import merge_attention
from attncore import scaled_dot_product_attention as sdpa

from reference import allowed, lse_ref, make_mask
from reference import attention as ref
from reference import rand

TOL = {np.float32: dict(rtol=2e-5, atol=2e-6), np.float64: dict(rtol=1e-11, atol=1e-12)}
LTOL = {np.float32: dict(rtol=1e-5, atol=1e-5), np.float64: dict(rtol=1e-12, atol=1e-12)}


def slice_keys(mask, sl):
    if mask is None or np.shape(mask)[-1] == 1:
        return mask
    return mask[..., sl]


CASES = [(1, 1), (5, 9), (9, 5), (40, 70), (70, 40), (1, 1500), (3, 2100), (64, 600)]


# ---------------------------------------------------------------- return_lse
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("N,M", CASES)
@pytest.mark.parametrize("mask_kind", [None, "bool", "float", "padding"])
def test_lse_against_reference(dtype, N, M, mask_kind):
    q, k, v = rand((2, 3, N, 16), 1, dtype), rand((2, 3, M, 16), 2, dtype), rand((2, 3, M, 8), 3, dtype)
    mask = make_mask(mask_kind, 2, 3, N, M, seed=5)
    out, lse = sdpa(q, k, v, mask, return_lse=True)
    assert lse.shape == (2, 3, N) and lse.dtype == dtype
    np.testing.assert_allclose(out, ref(q, k, v, mask)[0], **TOL[dtype])
    np.testing.assert_allclose(lse, lse_ref(q, k, mask), **LTOL[dtype])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [True, "lower_right"])
@pytest.mark.parametrize("N,M", [(7, 7), (5, 12), (12, 5), (100, 300), (300, 100), (2, 1100)])
def test_lse_causal(dtype, causal, N, M):
    q, k, v = rand((2, N, 16), 1, dtype), rand((2, M, 16), 2, dtype), rand((2, M, 16), 3, dtype)
    code = 1 if causal is True else 2
    out, lse = sdpa(q, k, v, is_causal=causal, return_lse=True)
    np.testing.assert_allclose(out, ref(q, k, v, causal=code)[0], **TOL[dtype])
    np.testing.assert_allclose(lse, lse_ref(q, k, causal=code), **LTOL[dtype])
    if code == 2 and N > M:                        # rows before the first key
        assert np.all(lse[:, :N - M] == -np.inf) and np.all(out[:, :N - M] == 0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_lse_with_weights_gqa_and_scale(dtype):
    q, k, v = rand((2, 4, 9, 8), 1, dtype), rand((2, 2, 11, 8), 2, dtype), rand((2, 2, 11, 5), 3, dtype)
    mask = rand((9, 11), 4, np.float64) > -0.7
    out, w, lse = sdpa(q, k, v, mask, enable_gqa=True, scale=0.3, return_weights=True,
                       return_lse=True)
    r_out, r_w = ref(q, k, v, mask, scale=0.3, group=2)
    np.testing.assert_allclose(out, r_out, **TOL[dtype])
    np.testing.assert_allclose(w, r_w, **TOL[dtype])
    np.testing.assert_allclose(lse, lse_ref(q, k, mask, scale=0.3, group=2), **LTOL[dtype])


def test_lse_float16_is_float32():
    q, k, v = (rand((3, 6, 8), s, np.float16) for s in (1, 2, 3))
    out, lse = sdpa(q, k, v, return_lse=True)
    assert out.dtype == np.float16 and lse.dtype == np.float32
    np.testing.assert_allclose(lse, lse_ref(q, k), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("return_weights", [False, True])
def test_lse_fully_masked_rows(dtype, return_weights):
    q, k, v = rand((2, 6, 8), 1, dtype), rand((2, 50, 8), 2, dtype), rand((2, 50, 8), 3, dtype)
    mask = np.ones((2, 6, 50), dtype=bool)
    mask[0, 2] = False
    mask[1] = False
    res = sdpa(q, k, v, mask, return_lse=True, return_weights=return_weights)
    out, lse = res[0], res[-1]
    assert np.all(lse[0, 2] == -np.inf) and np.all(lse[1] == -np.inf)
    assert np.all(out[0, 2] == 0) and np.all(out[1] == 0)
    np.testing.assert_allclose(lse, lse_ref(q, k, mask), **LTOL[dtype])
    fmask = np.where(mask, 0.0, -np.inf)
    np.testing.assert_array_equal(sdpa(q, k, v, fmask, return_lse=True)[1] == -np.inf, lse == -np.inf)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("M", [40, 1500])
def test_lse_nan(dtype, M):
    q, k, v = rand((1, 5, 8), 1, dtype), rand((1, M, 8), 2, dtype), rand((1, M, 8), 3, dtype)
    mask = np.ones((5, M), dtype=bool)
    mask[3, 7] = False
    q1 = q.copy()
    q1[0, 1, 0] = np.nan                       # one query row
    out, lse = sdpa(q1, k, v, mask, return_lse=True)
    assert np.isnan(lse[0, 1]) and np.isnan(out[0, 1]).all()
    np.testing.assert_allclose(np.delete(lse, 1, axis=1), np.delete(lse_ref(q, k, mask), 1, axis=1),
                               **LTOL[dtype])
    k1 = k.copy()
    k1[0, 7, 0] = np.nan                       # a key that row 3 does not attend
    out, lse = sdpa(q, k1, v, mask, return_lse=True)
    assert np.isnan(lse[0, [0, 1, 2, 4]]).all() and np.isfinite(lse[0, 3])
    np.testing.assert_allclose(out[0, 3], ref(q, k1, v, mask)[0][0, 3], **TOL[dtype])
    v1 = v.copy()
    v1[0, 7, 0] = np.nan                       # a value: scores, hence lse, stay finite
    out, lse = sdpa(q, k, v1, mask, return_lse=True)
    np.testing.assert_allclose(lse, lse_ref(q, k, mask), **LTOL[dtype])
    assert np.isnan(out[0, [0, 1, 2, 4], 0]).all() and not np.isnan(out[0, 3]).any()


# ---------------------------------------------------------------- merge_attention
def parts_of(q, k, v, mask, bounds, **kw):
    """(outputs, lses, weights) of one call per key range."""
    outs, lses, ws = [], [], []
    for a, b in zip(bounds[:-1], bounds[1:]):
        res = sdpa(q, k[..., a:b, :], v[..., a:b, :], slice_keys(mask, slice(a, b)),
                   return_lse=True, **kw)
        outs.append(res[0])
        lses.append(res[-1])
        if kw.get("return_weights"):
            ws.append(res[1])
    return outs, lses, ws


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("mask_kind", [None, "bool", "float", "padding"])
@pytest.mark.parametrize("bounds", [(0, 20, 47), (0, 1, 2, 47), (0, 30, 31, 46, 47), (0, 47)])
def test_merge_equals_one_call(dtype, mask_kind, bounds):
    N, M = 13, 47
    q, k, v = rand((2, 3, N, 16), 1, dtype), rand((2, 3, M, 16), 2, dtype), rand((2, 3, M, 8), 3, dtype)
    mask = make_mask(mask_kind, 2, 3, N, M, seed=5)
    outs, lses, _ = parts_of(q, k, v, mask, bounds)
    out, lse = merge_attention(outs, lses)
    assert out.dtype == dtype and lse.dtype == dtype
    np.testing.assert_allclose(out, ref(q, k, v, mask)[0], **TOL[dtype])
    np.testing.assert_allclose(lse, lse_ref(q, k, mask), **LTOL[dtype])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_merge_is_associative(dtype):
    q, k, v = rand((2, 9, 8), 1, dtype), rand((2, 60, 8), 2, dtype), rand((2, 60, 8), 3, dtype)
    outs, lses, _ = parts_of(q, k, v, None, (0, 10, 35, 60))
    ab = merge_attention(outs[:2], lses[:2])
    left = merge_attention([ab[0], outs[2]], [ab[1], lses[2]])
    bc = merge_attention(outs[1:], lses[1:])
    right = merge_attention([outs[0], bc[0]], [lses[0], bc[1]])
    flat = merge_attention(outs, lses)
    r = ref(q, k, v)[0]
    for o, lse in (left, right, flat):
        np.testing.assert_allclose(o, r, **TOL[dtype])
        np.testing.assert_allclose(lse, lse_ref(q, k), **LTOL[dtype])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("N,M", [(6, 20), (20, 6), (9, 9)])
def test_merge_lower_right_causal_split_by_keys(dtype, N, M):
    """The prefix-cache split: keys before the diagonal's start are visible to
    every row, the rest form a lower-right causal block; and any other split
    with the causal structure given as a sliced boolean mask."""
    q, k, v = rand((2, N, 8), 1, dtype), rand((2, M, 8), 2, dtype), rand((2, M, 8), 3, dtype)
    r_out, r_lse = ref(q, k, v, causal=2)[0], lse_ref(q, k, causal=2)
    P = max(M - N, 0)
    head = sdpa(q, k[:, :P], v[:, :P], return_lse=True)
    tail = sdpa(q, k[:, P:], v[:, P:], is_causal="lower_right", return_lse=True)
    out, lse = merge_attention([head[0], tail[0]], [head[1], tail[1]])
    np.testing.assert_allclose(out, r_out, **TOL[dtype])
    np.testing.assert_allclose(lse, r_lse, **LTOL[dtype])
    causal_mask = allowed(N, M, causal=2)
    for bounds in [(0, M // 3, M), (0, 1, M - 1, M)]:
        outs, lses, _ = parts_of(q, k, v, causal_mask, bounds)
        out, lse = merge_attention(outs, lses)
        np.testing.assert_allclose(out, r_out, **TOL[dtype])
        np.testing.assert_allclose(lse, r_lse, **LTOL[dtype])
    if N > M:
        assert np.all(out[:, :N - M] == 0) and np.all(lse[:, :N - M] == -np.inf)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_merge_mixed_empty_parts(dtype):
    N, M = 6, 30
    q, k, v = rand((1, N, 8), 1, dtype), rand((1, M, 8), 2, dtype), rand((1, M, 8), 3, dtype)
    mask = np.ones((N, M), dtype=bool)
    mask[0, :10] = False            # row 0: empty in part 0
    mask[1, 10:] = False            # row 1: empty in parts 1 and 2
    mask[2] = False                 # row 2: empty in every part
    mask[:, 20:] = False            # part 2: empty for every row
    outs, lses, _ = parts_of(q, k, v, mask, (0, 10, 20, M))
    assert np.all(lses[2] == -np.inf) and np.all(outs[2] == 0)
    out, lse = merge_attention(outs, lses)
    np.testing.assert_allclose(out, ref(q, k, v, mask)[0], **TOL[dtype])
    np.testing.assert_allclose(lse, lse_ref(q, k, mask), **LTOL[dtype])
    assert np.all(out[0, 2] == 0) and lse[0, 2] == -np.inf
    # every part empty for every row
    out, lse = merge_attention([np.zeros((1, N, 8), dtype)] * 2, [np.full((1, N), -np.inf, dtype)] * 2)
    assert np.all(out == 0) and np.all(lse == -np.inf)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_merge_nan_propagation(dtype):
    N, M = 5, 24
    q, k, v = rand((1, N, 8), 1, dtype), rand((1, M, 8), 2, dtype), rand((1, M, 8), 3, dtype)
    mask = np.ones((N, M), dtype=bool)
    mask[4, 3] = False                          # row 4 does not attend key 3
    for arr in ("k", "v"):
        kk, vv = k.copy(), v.copy()
        (kk if arr == "k" else vv)[0, 3, 0] = np.nan
        outs, lses, _ = parts_of(q, kk, vv, mask, (0, 12, M))
        out, lse = merge_attention(outs, lses)
        assert np.isnan(out[0, :4]).any(axis=-1).all()
        assert not np.isnan(out[0, 4]).any()
        # row 4 never reads key 3: it equals the clean computation
        np.testing.assert_allclose(out[0, 4], ref(q, k, v, mask)[0][0, 4], **TOL[dtype])
        if arr == "k":
            assert np.isnan(lse[0, :4]).all() and np.isfinite(lse[0, 4])
        else:
            np.testing.assert_allclose(lse, lse_ref(q, k, mask), **LTOL[dtype])
    # NaN reaches the merged row even when its part's weight underflows
    o = [np.ones((1, 1, 2), dtype), np.full((1, 1, 2), np.nan, dtype)]
    out, lse = merge_attention(o, [np.array([[0.0]], dtype), np.array([[-1e4]], dtype)])
    assert np.isnan(out).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [False, True])
def test_merge_with_weights(dtype, causal):
    """A part's weights are normalized within the part; times
    exp(lse_part - lse_total) they are the full weights over its keys."""
    N, M = 8, 33
    q, k, v = rand((2, 2, N, 8), 1, dtype), rand((2, 2, M, 8), 2, dtype), rand((2, 2, M, 8), 3, dtype)
    mask = make_mask("bool", 2, 2, N, M, seed=5)
    if causal:  # upper-left causal given as a mask, sliced with the keys
        mask = mask & allowed(N, M, causal=1)
    bounds = (0, 5, 20, M)
    outs, lses, ws = parts_of(q, k, v, mask, bounds, return_weights=True)
    out, lse = merge_attention(outs, lses)
    r_out, r_w = ref(q, k, v, mask)
    np.testing.assert_allclose(out, r_out, **TOL[dtype])
    with np.errstate(invalid="ignore"):
        scaled = [np.where((lp == -np.inf)[..., None], 0, w * np.exp(lp - lse)[..., None])
                  for w, lp in zip(ws, lses)]
    full = np.concatenate(scaled, axis=-1)
    full = np.where((lse == -np.inf)[..., None], 0, full)
    np.testing.assert_allclose(full, r_w, **TOL[dtype])


def test_merge_single_part_and_broadcast():
    q, k, v = rand((2, 4, 8), 1, np.float64), rand((2, 9, 8), 2, np.float64), rand((2, 9, 8), 3, np.float64)
    out, lse = sdpa(q, k, v, return_lse=True)
    o1, l1 = merge_attention([out], [lse])
    np.testing.assert_allclose(o1, out, rtol=1e-15, atol=1e-15)
    np.testing.assert_allclose(l1, lse, rtol=1e-15, atol=1e-15)
    # a shared (broadcast) key part: the same keys for both batch elements
    a = sdpa(q, k[:1, :5], v[:1, :5], return_lse=True)
    b = sdpa(q, k[:1, 5:], v[:1, 5:], return_lse=True)
    out, lse = merge_attention([a[0], b[0]], [a[1], b[1]])
    np.testing.assert_allclose(out, ref(q, k[:1], v[:1])[0], rtol=1e-11, atol=1e-12)


def test_merge_inputs_not_modified():
    q, k, v = rand((2, 4, 8), 1, np.float64), rand((2, 9, 8), 2, np.float64), rand((2, 9, 8), 3, np.float64)
    outs, lses, _ = parts_of(q, k, v, None, (0, 4, 9))
    copies = [x.copy() for x in outs + lses]
    merge_attention(outs, lses)
    for x, c in zip(outs + lses, copies):
        np.testing.assert_array_equal(x, c)


@pytest.mark.parametrize("call,match", [
    (lambda o, x: merge_attention([], []), "at least one"),
    (lambda o, x: merge_attention([o, o], [x]), "one entry per part"),
    (lambda o, x: merge_attention(o, x), "outputs must be a sequence"),
    (lambda o, x: merge_attention([o], [x[..., :2]]), r"lses\[0\]"),
    (lambda o, x: merge_attention([o, o[..., :3]], [x, x]), r"outputs\[1\]"),
    (lambda o, x: merge_attention([o.astype(int)], [x]), r"outputs\[0\]"),
])
def test_merge_errors_name_the_argument(call, match):
    o, x = np.zeros((2, 4, 8)), np.zeros((2, 4))
    with pytest.raises((TypeError, ValueError), match=match):
        call(o, x)


def test_public_names():
    assert attncore.merge_attention is merge_attention


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_merge_bfloat16_parts(kind):
    """bfloat16 parts -- what a bfloat16 call returns, as ml_dtypes arrays
    or torch tensors -- merge into the one-call answer (float64 reference
    of the same bfloat16-rounded inputs), in bfloat16; bfloat16 beside a
    float16 part promotes to float32."""
    ml = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s).astype(ml.bfloat16)
               for s in ((1, 2, 4, 8), (1, 2, 10, 8), (1, 2, 10, 8)))
    parts = [sdpa(q, k[..., sl, :], v[..., sl, :], return_lse=True)
             for sl in (slice(0, 5), slice(5, 10))]
    outs, lses = [p[0] for p in parts], [p[1] for p in parts]
    if kind == "torch":
        torch = pytest.importorskip("torch")
        outs = [torch.from_numpy(o.astype(np.float32)).to(torch.bfloat16) for o in outs]
        lses = [torch.from_numpy(x) for x in lses]
    out, lse = merge_attention(outs, lses)
    assert out.dtype == np.dtype(ml.bfloat16) and lse.dtype == np.float32
    s = np.einsum("bhnd,bhmd->bhnm", q.astype(np.float64), k.astype(np.float64)) / np.sqrt(8)
    p = np.exp(s - s.max(-1, keepdims=True))
    want = (p / p.sum(-1, keepdims=True)) @ v.astype(np.float64)
    np.testing.assert_allclose(out.astype(np.float64), want, rtol=2e-2, atol=2e-2)
    np.testing.assert_allclose(lse, np.log(np.exp(s).sum(-1)), rtol=1e-4, atol=1e-4)
    mixed, _ = merge_attention([parts[0][0], parts[1][0].astype(np.float16)],
                               [parts[0][1], parts[1][1]])
    assert mixed.dtype == np.float32
    np.testing.assert_allclose(mixed, want, rtol=2e-2, atol=2e-2)


def test_merge_sums_in_float64_and_takes_a_part_beyond_the_range():
    """Parts whose outputs are near the float32 maximum merge without
    overflowing (float32 sums gave inf), and a part whose lse is +inf (an
    lse beyond the float range) takes all the weight of its row (NaN
    before); two such parts make the row NaN."""
    big = np.full((1, 2, 3), 3e38, np.float32)
    lse = np.zeros((1, 2), np.float32)
    out, l2 = merge_attention([big, big], [lse, lse])
    assert out.dtype == np.float32 and l2.dtype == np.float32
    np.testing.assert_allclose(out, big, rtol=1e-6)
    np.testing.assert_allclose(l2, np.log(2.0), rtol=1e-6)
    a, b = np.array([[1.0, 2.0]], np.float32), np.array([[5.0, 6.0]], np.float32)
    out, l2 = merge_attention([a, b], [np.array([np.inf], np.float32), np.array([0.0], np.float32)])
    np.testing.assert_array_equal(out, a)
    assert l2[0] == np.inf
    out, l2 = merge_attention([a, b], [np.array([np.inf], np.float32)] * 2)
    assert np.isnan(out).all() and np.isnan(l2).all()
