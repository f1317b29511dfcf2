"""Regression tests for the defects of issue 21 (each failed before its fix),
on every forced kernel path (the ``path`` fixture of conftest.py).

1. the fused kernels' vector tanh lost its relative accuracy for small
   arguments: a large ``softcap`` gave wrong outputs and lse;
2. a float mask of ``finfo(float32).min`` on every key of a row gave 0 and
   lse -inf on the fused paths (scale * log2(e) folded into the scores
   overflowed);
3. scores or ``scale`` near the float32 maximum gave NaN on the fused paths;
4. an int8 key with a value of width 0 gave the lse of the placeholder
   zero keys;
7. ``quantize_kv`` of values beyond the float32 range gave scale inf, and of
   values too small for a normal float32 scale broke the half-step bound;
8. every 2-tuple / 2-list key or value was read as an int8 pair;
and the rule for NaN rows of weights: NaN across the whole row, also where a
+inf mask entry makes it NaN under a causal / window band.
"""
import numpy as np
import pytest

import attncore
from attncore import quantize_kv
from attncore import scaled_dot_product_attention as sdpa

from reference import allowed, lse_ref, sdpa_ref
from reference import attention as ref
from reference import rand

try:
    import torch
except ImportError:  # pragma: no cover - torch is a test extra
    torch = None

TOL32 = dict(rtol=3e-5, atol=3e-6)
F32_MIN = float(np.finfo(np.float32).min)   # -3.4028235e38
F32_MAX = float(np.finfo(np.float32).max)


# ------------------------------------------------------- 1. softcap accuracy
CAPS = [1e-30, 1e-3, 1.0, 30.0, 1e3, 1e4, 1e6, 1e8, 1e20, 1e30]


@pytest.mark.parametrize("cap", [1e-3, 1.0, 50.0, 1e4, 1e12, 1e30])
def test_softcap_capped_score_accuracy(path, cap):
    """One key per row: the lse is the capped score itself, so this sweeps
    the tanh over its whole argument range (both signs, small and large,
    around the switch between the kernel's two formulas).  One bound for
    every path: |lse - cap tanh(s / cap)| <= 3e-7 + 1e-6 |cap tanh(s / cap)|."""
    x = np.concatenate([np.logspace(-7, 1.6, 1500), np.linspace(0.55, 0.7, 301)])
    s = (np.concatenate([x, -x, [0.0]]) * cap).astype(np.float32)
    _, lse = sdpa(s[:, None], np.ones((1, 1), np.float32), np.ones((1, 1), np.float32),
                  scale=1.0, softcap=cap, return_lse=True)
    expected = cap * np.tanh(s.astype(np.float64) / cap)
    np.testing.assert_array_less(np.abs(lse - expected), 3e-7 + 1e-6 * np.abs(expected))


@pytest.mark.parametrize("cap", CAPS)
def test_softcap_attention_any_cap(path, cap):
    """The issue's case (q, k 64 x 16, v 64 x 8, N(0, 1)) over the whole
    documented range of softcap, output and lse against float64."""
    q, k, v = rand((64, 16), 1), rand((64, 16), 2), rand((64, 8), 3)
    out, lse = sdpa(q, k, v, softcap=cap, return_lse=True)
    eo, el = sdpa_ref(q, k, v, softcap=cap, return_lse=True)
    np.testing.assert_allclose(out, eo, **TOL32)
    np.testing.assert_allclose(lse, el, **TOL32)


@pytest.mark.parametrize("cap", [1e-3, 0.1, 1.0, 10.0, 30.0])
def test_softcap_attention_scores_near_the_cap(path, cap):
    """Scores of the order of the cap (tanh arguments around 0.01 .. 3);
    larger caps with such scores are ill-conditioned in float32 (the
    score's own rounding), the sweep above covers their tanh."""
    q, k, v = rand((2, 40, 16), 4), rand((2, 70, 16), 5), rand((2, 70, 8), 6)
    q = q * np.float32(cap / 2)
    out, lse = sdpa(q, k, v, softcap=cap, return_lse=True, scale=0.25)
    eo, el = sdpa_ref(q, k, v, scale=0.25, softcap=cap, return_lse=True)
    np.testing.assert_allclose(out, eo, **TOL32)
    np.testing.assert_allclose(lse, el, **TOL32)


# --------------------------------------- 2. float masks of finfo(float32).min
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


# ------------------------------------------- 3. scores or scale near the max
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


# -------------------------------------------- 4. int8 key, value of width 0
@pytest.mark.parametrize("N", [3, 9])
def test_int8_key_empty_value_lse(path, N):
    q, k = rand((2, 3, N, 16), 17), rand((2, 3, 20, 16), 18)
    kq = quantize_kv(k)
    kd = kq[0].astype(np.float64) * kq[1].astype(np.float64)[..., None]
    v0 = np.zeros((2, 3, 20, 0), np.float32)
    out, lse = sdpa(q, kq, v0, return_lse=True, is_causal="lower_right")
    assert out.shape == (2, 3, N, 0)
    np.testing.assert_allclose(lse, lse_ref(q, kd, causal=2), **TOL32)
    # and the float key's lse, up to the quantization
    np.testing.assert_allclose(lse, sdpa(q, k, v0, return_lse=True, is_causal="lower_right")[1],
                               atol=0.05)
    out, w, lse_w = sdpa(q, kq, v0, return_weights=True, return_lse=True)
    np.testing.assert_allclose(lse_w, lse_ref(q, kd), **TOL32)
    np.testing.assert_allclose(w, ref(q, kd, np.zeros((2, 3, 20, 1)))[1], **TOL32)


# ------------------------------------------------ 7. quantize_kv value range
@pytest.mark.parametrize("big", [1e41, 3.5e38])
def test_quantize_kv_beyond_float32_range(big):
    x = np.array([[1.0, -2.0], [big, 1.0]])
    with pytest.raises(ValueError, match=r"x must lie within the float32 range.*max \|x\|"):
        quantize_kv(x)


def _check_bound(x, q, s):
    se = s.astype(np.float64)[..., None]
    assert np.all(np.abs(q.astype(np.float64) * se - x) <= se / 2)
    assert np.all(np.abs(q.astype(np.int16)) <= 127)
    assert np.all(s[np.max(np.abs(x), axis=-1) > 0] > 0)


def test_quantize_kv_at_float32_max():
    x = np.array([[F32_MAX, 1.0, -3e38], [-F32_MAX, F32_MAX, 0.0]])
    q, s = quantize_kv(x)
    _check_bound(x, q, s)
    deq = q.astype(np.float32) * s[:, None]        # what the kernel computes
    assert np.all(np.isfinite(deq))
    assert abs(int(q[0, 0])) == 127 and np.all(np.abs(q[1, :2]) == 127)


@pytest.mark.parametrize("mag", [1e-36, 1e-40, 2.5e-43, 1e-44, 5e-46, 1e-300])
def test_quantize_kv_tiny_values(mag):
    """Scales below float32's normal range: rounded up, the half-step bound
    still holds and no slice but an all-zero one gets scale 0."""
    x = rand((6, 33), 19, np.float64) * mag
    x[2] = 0
    x[3, 5] = mag * 7                     # a larger outlier
    q, s = quantize_kv(x)
    _check_bound(x, q, s)
    assert s[2] == 0 and np.all(q[2] == 0)


def test_quantize_kv_tiny_values_in_attention(path):
    q = rand((6, 8), 20)
    k = rand((10, 8), 21, np.float64) * 1e-40
    v = rand((10, 8), 22, np.float64) * 1e-40
    kq, vq = quantize_kv(k), quantize_kv(v)
    kd = kq[0].astype(np.float64) * kq[1].astype(np.float64)[:, None]
    vd = vq[0].astype(np.float64) * vq[1].astype(np.float64)[:, None]
    out = sdpa(q, kq, vq)
    expected = ref(q, kd, vd)[0]
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


# ---------------------------------------------------------- 8. 2-tuple keys
def test_issue_reproducer_tuple_key(path):
    out = sdpa(np.ones((1, 2)), (np.array([1.0, 0.0]), np.array([0.0, 1.0])), np.eye(2))
    np.testing.assert_allclose(out, ref(np.ones((1, 2)), np.eye(2), np.eye(2))[0])


@pytest.mark.parametrize("container", [tuple, list])
def test_two_float_rows_are_an_array_like(path, container):
    q, k, v = rand((7, 4), 23), rand((2, 4), 24), rand((2, 3), 25)
    expected = ref(q, k, v)[0]
    for key, value in [(container(k), v), (k, container(v)), (container(k), container(v)),
                       (container([list(k[0]), list(k[1])]), v)]:
        np.testing.assert_allclose(sdpa(q, key, value), expected, **TOL32)


@pytest.mark.skipif(torch is None, reason="needs torch")
def test_two_torch_rows_and_torch_int8_pairs(path):
    q, k, v = rand((7, 4), 26), rand((2, 4), 27), rand((2, 3), 28)
    expected = ref(q, k, v)[0]
    tk = (torch.from_numpy(k[0].copy()), torch.from_numpy(k[1].copy()))
    out = sdpa(torch.from_numpy(q), tk, torch.from_numpy(v))
    np.testing.assert_allclose(out.numpy(), expected, **TOL32)
    # a torch int8 pair (from quantize_kv on a tensor) is still a pair
    k2, v2 = rand((20, 4), 29), rand((20, 3), 30)
    pair = quantize_kv(torch.from_numpy(k2))
    assert isinstance(pair[0], torch.Tensor) and pair[0].dtype == torch.int8
    kd = pair[0].numpy().astype(np.float64) * pair[1].numpy().astype(np.float64)[:, None]
    for key in (pair, list(pair)):
        out = sdpa(torch.from_numpy(q), key, torch.from_numpy(v2))
        np.testing.assert_allclose(out.numpy(), ref(q, kd, v2)[0], **TOL32)


def test_int8_pairs_still_pairs(path):
    q, k, v = rand((7, 4), 31), rand((20, 4), 32), rand((20, 3), 33)
    kq, vq = quantize_kv(k), quantize_kv(v)
    deq = [a.astype(np.float64) * s.astype(np.float64)[:, None] for a, s in (kq, vq)]
    expected = ref(q, deq[0], deq[1])[0]
    for key, value in [(kq, vq), (list(kq), list(vq))]:
        np.testing.assert_allclose(sdpa(q, key, value), expected, **TOL32)


def test_int8_pair_rule_documented():
    for doc in (attncore.scaled_dot_product_attention.__doc__, attncore.quantize_kv.__doc__):
        assert "first element is an" in doc and "int8" in doc


# ------------------------------------------------------- NaN rows of weights
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("band", [dict(is_causal=True), dict(window=(2, 1)),
                                  dict(is_causal="lower_right", window=(-1, 0))],
                         ids=["causal", "window", "lower-right"])
def test_nan_rows_of_weights_span_the_row(path, dtype, band):
    """A row NaN because of a +inf mask entry is NaN across the whole row,
    as a row NaN because of a NaN score is (the rule of the docstring);
    output and lse of the row are NaN on the flash path too."""
    N = M = 9
    q, k, v = rand((2, N, 4), 34, dtype), rand((2, M, 4), 35, dtype), rand((2, M, 3), 36, dtype)
    mask = np.zeros((2, N, M), dtype)
    mask[0, 3, 2] = np.inf                 # attended by row 3 under every band here
    q[1, 5, 0] = np.nan                    # a NaN score row
    out_w, w, lse_w = sdpa(q, k, v, mask, return_weights=True, return_lse=True, **band)
    out, lse = sdpa(q, k, v, mask, return_lse=True, **band)
    nan_rows = np.zeros((2, N), bool)
    nan_rows[0, 3] = nan_rows[1, 5] = True
    assert np.all(np.isnan(w[nan_rows]))                        # whole rows, every column
    assert not np.any(np.isnan(w[~nan_rows]))
    for o, ls in ((out_w, lse_w), (out, lse)):
        assert np.all(np.isnan(o[nan_rows])) and np.all(np.isnan(ls[nan_rows]))
        assert not np.any(np.isnan(o[~nan_rows])) and not np.any(np.isnan(ls[~nan_rows]))
    np.testing.assert_allclose(w[~nan_rows].sum(-1), 1, rtol=1e-5)


@pytest.mark.parametrize("kind", ["dot", "scaled_dot", "bilinear", "mlp", "plugin"])
def test_nan_rows_of_layer_weights_span_the_row(path, kind):
    """The same rule in attncore.Attention, whose key mask leaves masked
    keys at weight 0 in ordinary rows: a NaN row is NaN there too."""
    rng = np.random.default_rng(41)
    B, T, S, D = 2, 6, 9, 6
    q, k, vals = rng.standard_normal((B, T, D)), rng.standard_normal((B, S, D)), \
        rng.standard_normal((B, S, 4))
    mask = np.ones((B, S), bool)
    mask[:, 6:] = False
    q[1, 2, 0] = np.nan
    if kind == "bilinear":
        att = attncore.Attention(kind, weight=rng.standard_normal((D, D)) * 0.3)
    elif kind == "mlp":
        att = attncore.Attention(kind, q_weight=rng.standard_normal((5, D)) * 0.4,
                                 k_weight=rng.standard_normal((5, D)) * 0.4,
                                 v=rng.standard_normal(5))
    elif kind == "plugin":
        class Half(attncore.Alignment):
            def score(self, query, prepared):
                return np.matmul(query, np.swapaxes(prepared, -1, -2)) / 2
        att = attncore.Attention(Half())
    else:
        att = attncore.Attention(kind)
    ctx, w = att(q, k, vals, mask=mask, return_weights=True)
    assert np.all(np.isnan(w[1, 2])) and np.all(np.isnan(ctx[1, 2]))
    rest = np.ones((B, T), bool)
    rest[1, 2] = False
    assert np.all(np.isfinite(w[rest])) and np.all(w[rest][:, 6:] == 0)
