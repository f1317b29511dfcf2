"""Sliding windows and logit soft-capping against an explicit float64
formulation (band mask / tanh cap written out) and torch's SDPA with the
equivalent mask, on every kernel path."""
import numpy as np
import pytest

import attncore
from attncore import scaled_dot_product_attention as sdpa
from attncore._quant import dequantize

from reference import allowed, make_mask, sdpa_ref
from reference import attention as ref
from reference import rand

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # pragma: no cover - torch is a test extra
    torch = None

TOL = {np.float16: dict(rtol=3e-3, atol=3e-3), np.float32: dict(rtol=3e-5, atol=3e-6),
       np.float64: dict(rtol=1e-10, atol=1e-11)}


MASKS = ["none", "bool_full", "padding", "2d"]     # reference.make_mask kinds


# ------------------------------------------------------------------ window
@pytest.mark.parametrize("window", [(16, 0), (5, 9), (-1, 3), (40, -1), (0, 0)])
@pytest.mark.parametrize("causal", [False, True, "lower_right"])
@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("N,M", [(90, 200), (200, 90)])
def test_window_against_band_reference(path, window, causal, mask_kind, N, M):
    B, H, D = 2, 2, 16
    q, k, v = rand((B, H, N, D), 1, np.float64), rand((B, H, M, D), 2, np.float64), rand((B, H, M, 8), 3, np.float64)
    mask = make_mask(mask_kind, B, 1, N, M, seed=3)
    want = ref(q, k, v, mask, causal, window=window)[0]
    for dtype in (np.float32, np.float64):
        out = attncore.scaled_dot_product_attention(
            q.astype(dtype), k.astype(dtype), v.astype(dtype),
            None if mask is None else mask.astype(dtype) if mask.dtype != bool else mask,
            is_causal=causal, window=window)
        np.testing.assert_allclose(out, want, **TOL[dtype])


@pytest.mark.parametrize("Hk", [1, 2])
def test_window_gqa_float16_threads(path, Hk):
    q, k, v = (rand((1, 4, 300, 32), 1, np.float64), rand((1, Hk, 300, 32), 2, np.float64),
               rand((1, Hk, 300, 32), 3, np.float64))
    expected = ref(q, k, v, allowed(300, 300, causal=True, window=(50, 0)), group=4 // Hk)[0]
    for t in (1, 2):
        out = attncore.scaled_dot_product_attention(
            q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), is_causal=True,
            window=(50, 0), enable_gqa=True, num_threads=t)
        np.testing.assert_allclose(out, expected, **TOL[np.float32])
    out16 = attncore.scaled_dot_product_attention(
        q.astype(np.float16), k.astype(np.float16), v.astype(np.float16), is_causal=True,
        window=(50, 0), enable_gqa=True)
    assert out16.dtype == np.float16
    np.testing.assert_allclose(out16.astype(np.float64), expected, **TOL[np.float16])


def test_window_leaving_rows_empty_gives_zero(path):
    # lower-right with N > M: the first N - M rows see no key; a window
    # (0, 0) under no causal lets row i see only key i, so rows >= M are empty
    q, k, v = rand((1, 50, 8), 1), rand((1, 20, 8), 2), rand((1, 20, 8), 3)
    out, lse = attncore.scaled_dot_product_attention(q, k, v, window=(0, 0), return_lse=True)
    assert np.all(out[0, 20:] == 0) and np.all(np.isneginf(lse[0, 20:]))
    np.testing.assert_allclose(out[0, :20], v[0], rtol=1e-6)


def test_window_weights_and_lse(path):
    q, k, v = rand((2, 60, 16), 1), rand((2, 80, 16), 2), rand((2, 80, 4), 3)
    ok = allowed(60, 80, causal="lower_right", window=(7, 2))
    out, w, lse = attncore.scaled_dot_product_attention(
        q, k, v, is_causal="lower_right", window=(7, 2), return_weights=True, return_lse=True)
    eo, ew = ref(q, k, v, ok)
    np.testing.assert_allclose(out, eo, **TOL[np.float32])
    np.testing.assert_allclose(w, ew, **TOL[np.float32])
    s = np.where(ok, q.astype(np.float64) @ np.swapaxes(k, -1, -2) / 4, -np.inf)
    np.testing.assert_allclose(lse, np.log(np.exp(s).sum(-1)), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(torch is None, reason="torch not installed")
def test_window_matches_torch_with_explicit_mask(path):
    q, k, v = (rand((2, 4, 128, 32), s) for s in (1, 2, 3))
    ok = allowed(128, 128, causal=True, window=(31, 0))
    out = attncore.scaled_dot_product_attention(q, k, v, is_causal=True, window=(31, 0))
    with torch.inference_mode():
        expected = F.scaled_dot_product_attention(*map(torch.from_numpy, (q, k, v)),
                                                  attn_mask=torch.from_numpy(ok)).numpy()
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ softcap
@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("cap", [0.5, 5.0, 50.0])
def test_softcap_against_tanh_reference(path, mask_kind, causal, cap):
    B, N, M = 2, 70, 150
    q, k, v = (rand((B, 2, N, 16), 1, np.float64) * 3, rand((B, 2, M, 16), 2, np.float64),
               rand((B, 2, M, 8), 3, np.float64))
    mask = make_mask(mask_kind, B, 1, N, M, seed=3)
    expected = sdpa_ref(q, k, v, mask, causal, softcap=cap)
    for dtype in (np.float32, np.float64):
        m = None if mask is None else mask if mask.dtype == bool else mask.astype(dtype)
        out = attncore.scaled_dot_product_attention(
            q.astype(dtype), k.astype(dtype), v.astype(dtype), m, is_causal=causal, softcap=cap)
        np.testing.assert_allclose(out, expected, **TOL[dtype])


def test_softcap_with_infinite_scores_and_weights(path):
    # +-inf scores from the inputs are capped to +-cap (before the mask)
    q, k, v = rand((1, 40, 8), 1), rand((1, 60, 8), 2), rand((1, 60, 4), 3)
    q[0, 5] = 0
    q[0, 5, 0] = np.inf   # scores +inf / -inf by the sign of k[:, 0]
    out, w = attncore.scaled_dot_product_attention(q, k, v, softcap=2.0, return_weights=True)
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(w))
    with np.errstate(invalid="ignore"):
        expected = sdpa_ref(q, k, v, softcap=2.0)
    np.testing.assert_allclose(out, expected, **TOL[np.float32])


# softcap accuracy: the fused kernels' vector tanh, over the whole
# documented range of softcap
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
    """The reported case (q, k 64 x 16, v 64 x 8, N(0, 1)) over the whole
    documented range of softcap, output and lse against float64."""
    q, k, v = rand((64, 16), 1), rand((64, 16), 2), rand((64, 8), 3)
    out, lse = sdpa(q, k, v, softcap=cap, return_lse=True)
    eo, el = sdpa_ref(q, k, v, softcap=cap, return_lse=True)
    np.testing.assert_allclose(out, eo, **TOL[np.float32])
    np.testing.assert_allclose(lse, el, **TOL[np.float32])


@pytest.mark.parametrize("cap", [1e-3, 0.1, 1.0, 10.0, 30.0])
def test_softcap_attention_scores_near_the_cap(path, cap):
    """Scores of the order of the cap (tanh arguments around 0.01 .. 3);
    larger caps with such scores are ill-conditioned in float32 (the
    score's own rounding), the sweep above covers their tanh."""
    q, k, v = rand((2, 40, 16), 4), rand((2, 70, 16), 5), rand((2, 70, 8), 6)
    q = q * np.float32(cap / 2)
    out, lse = sdpa(q, k, v, softcap=cap, return_lse=True, scale=0.25)
    eo, el = sdpa_ref(q, k, v, scale=0.25, softcap=cap, return_lse=True)
    np.testing.assert_allclose(out, eo, **TOL[np.float32])
    np.testing.assert_allclose(lse, el, **TOL[np.float32])


@pytest.mark.parametrize("bad,exc", [((1,), TypeError), ((1, 2, 3), TypeError), ((-2, 0), ValueError),
                                     ((1.5, 0), TypeError), ((True, 0), TypeError), ("10", TypeError),
                                     (5, TypeError), ({1, 2}, TypeError)])
def test_bad_window(bad, exc):
    q = np.zeros((4, 8), np.float32)
    with pytest.raises(exc, match="window"):
        attncore.scaled_dot_product_attention(q, q, q, window=bad)


@pytest.mark.parametrize("bad,exc", [(0, ValueError), (-1.0, ValueError), (np.inf, ValueError),
                                     (np.nan, ValueError), ("5", TypeError), (True, TypeError),
                                     (1e-40, ValueError), (1e39, ValueError)])
def test_bad_softcap(bad, exc):
    q = np.zeros((4, 8), np.float32)
    with pytest.raises(exc, match="softcap"):
        attncore.scaled_dot_product_attention(q, q, q, softcap=bad)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("return_weights", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_nonfinite_float_mask_outside_the_window_never_leaks(path, bad, return_weights, dtype):
    """A NaN / inf float-mask entry at a key outside a row's band is not
    attended: the row is what it is without that entry."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((8, 4)).astype(dtype)
    k = rng.standard_normal((5, 4)).astype(dtype)
    v = rng.standard_normal((5, 3)).astype(dtype)
    mask = np.zeros((8, 5), dtype)
    mask[3, 0] = bad          # row 3 sees keys 2..4 under window (1, 1)
    mask[7, 1] = bad          # row 7's band (6..8) lies past the keys: empty
    res = attncore.scaled_dot_product_attention(q, k, v, mask, window=(1, 1), return_lse=True,
                                                return_weights=return_weights)
    out, lse = res[0], res[-1]
    ok = allowed(8, 5, causal=False, window=(1, 1))
    np.testing.assert_allclose(out, ref(q, k, v, ok)[0], **TOL[dtype])
    assert np.all(np.isfinite(lse[:5])) and np.all(np.isneginf(lse[6:]))
    assert np.all(out[6:] == 0)


@pytest.mark.skipif(torch is None, reason="torch not installed")
def test_lse_of_bfloat16_inputs_stays_float32():
    t = torch.from_numpy(rand((2, 6, 8), 1)).to(torch.bfloat16)
    out, lse = attncore.scaled_dot_product_attention(t, t, t, return_lse=True)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32


# ------------------------------------------------------------------ layers
def _mha_by_hand(mha, x, ok):
    """The layer's output written out in float64: projections, attention
    restricted to ``ok`` (N, M), output projection."""
    H, hd = mha.num_heads, mha.head_dim
    f = {n: getattr(mha, n).astype(np.float64) for n in
         ("q_weight", "k_weight", "v_weight", "out_weight", "q_bias", "k_bias", "v_bias",
          "out_bias")}
    B, L, _ = x.shape

    def heads(y):
        return y.reshape(B, L, H, hd).transpose(0, 2, 1, 3)
    q = heads(x @ f["q_weight"].T + f["q_bias"])
    k = heads(x @ f["k_weight"].T + f["k_bias"])
    v = heads(x @ f["v_weight"].T + f["v_bias"])
    o = ref(q, k, v, ok)[0].transpose(0, 2, 1, 3).reshape(B, L, H * hd)
    return o @ f["out_weight"].T + f["out_bias"]


@pytest.mark.parametrize("loader", ["init", "from_arrays", "from_torch", "attribute"])
def test_mha_window_from_every_constructor(loader):
    """MultiHeadAttention's ``window`` reaches every call, whichever way the
    layer was made, and the cached decode steps too."""
    rng = np.random.default_rng(3)
    E, H, L, win = 32, 4, 24, (5, 0)
    base = attncore.MultiHeadAttention(E, H, rng=1)
    base.q_bias = rng.standard_normal(E)
    base.k_bias = rng.standard_normal(E)
    weights = dict(q_weight=base.q_weight, k_weight=base.k_weight, v_weight=base.v_weight,
                   out_weight=base.out_weight, q_bias=base.q_bias, k_bias=base.k_bias,
                   v_bias=base.v_bias, out_bias=base.out_bias)
    if loader == "init":
        mha = attncore.MultiHeadAttention(E, H, rng=1, window=win)
        mha.q_bias, mha.k_bias = base.q_bias, base.k_bias
    elif loader == "from_arrays":
        mha = attncore.MultiHeadAttention.from_arrays(**weights, num_heads=H, window=win)
    elif loader == "from_torch":
        if torch is None:
            pytest.skip("torch not installed")
        sd = {"in_proj_weight": torch.from_numpy(np.concatenate(
                  [weights["q_weight"], weights["k_weight"], weights["v_weight"]])),
              "in_proj_bias": torch.from_numpy(np.concatenate(
                  [weights["q_bias"], weights["k_bias"], weights["v_bias"]])),
              "out_proj.weight": torch.from_numpy(weights["out_weight"]),
              "out_proj.bias": torch.from_numpy(weights["out_bias"])}
        mha = attncore.MultiHeadAttention.from_torch(sd, num_heads=H, window=win)
    else:
        mha = attncore.MultiHeadAttention.from_arrays(**weights, num_heads=H)
        assert mha.window is None
        mha.window = win
    assert mha.window == win
    x = rng.standard_normal((2, L, E)).astype(np.float32)
    ok = allowed(L, L, causal=True, window=win)
    expected = _mha_by_hand(mha, x.astype(np.float64), ok)
    out, _ = mha(x, is_causal=True)
    np.testing.assert_allclose(out, expected, rtol=2e-4, atol=2e-5)
    # the KV cache: a prompt, then one token at a time (lower-right alignment)
    cache = mha.new_cache(2, L)
    steps = [mha(x[:, :10], cache=cache, is_causal="lower_right")[0]]
    steps += [mha(x[:, t:t + 1], cache=cache, is_causal="lower_right")[0] for t in range(10, L)]
    np.testing.assert_allclose(np.concatenate(steps, axis=1), expected, rtol=2e-4, atol=2e-5)


def test_mha_window_is_validated_by_every_loader():
    mha = attncore.MultiHeadAttention(16, 2, rng=0)
    w = dict(q_weight=mha.q_weight, k_weight=mha.k_weight, v_weight=mha.v_weight,
             out_weight=mha.out_weight)
    with pytest.raises(ValueError, match="window left"):
        attncore.MultiHeadAttention.from_arrays(**w, num_heads=2, window=(-2, 0))
    with pytest.raises(TypeError, match="window"):
        attncore.MultiHeadAttention(16, 2, window=5)


# ------------------------------------------------------------ panel tails
@pytest.mark.parametrize("N", [5, 8, 9, 12, 13, 16, 17, 18, 20, 21, 33, 35, 40, 44, 48, 50, 52, 66])
@pytest.mark.parametrize("opts", [
    {}, {"is_causal": True}, {"is_causal": "lower_right"}, {"window": (7, 3)},
    {"softcap": 2.0}, {"mask": "bool_full"}, {"mask": "2d"},
    {"alibi_slopes": np.array([0.5, 0.125])}, {"sinks": np.array([0.3, -1.0])}])
def test_panel_tail_rows_against_reference(path, N, opts):
    """A call whose last query panel has a few rows (the fused kernel
    leaves them to the direct loops: 50 = 3 x 16 + 2 on AVX2, 35 = 32 + 3
    on AVX-512) or at most half a panel (the one-vector panels, 16 rows on
    AVX-512: 40 = 32 + 8, 50 = 32 + 16 + 2 direct rows, 9 alone; 8 on AVX2:
    40 = 2 x 16 + 8, 44 = 2 x 16 + 8 + 4, 12 = 8 + 4), every option,
    float32 against the float64 reference."""
    B, H, M, D, Dv = 2, 2, 41, 24, 20
    q, k, v = rand((B, H, N, D), 1), rand((B, H, M, D), 2), rand((B, H, M, Dv), 3)
    opts = dict(opts)
    kind = opts.pop("mask", "none")
    mask = make_mask(kind, B, 1, N, M, seed=3)
    if mask is not None and mask.dtype != bool:
        mask = mask.astype(np.float32)
    out, lse = sdpa(q, k, v, mask, return_lse=True, **opts)
    ref_kw = {kk: vv for kk, vv in opts.items() if kk != "is_causal"}
    ro, rl = sdpa_ref(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                      None if mask is None else mask.astype(mask.dtype if mask.dtype == bool
                                                            else np.float64),
                      opts.get("is_causal", False), return_lse=True, **ref_kw)
    np.testing.assert_allclose(out, ro, rtol=3e-5, atol=3e-6)
    np.testing.assert_allclose(lse, rl, rtol=3e-5, atol=3e-5)


@pytest.mark.parametrize("N", [5, 8, 12, 16, 20])
@pytest.mark.parametrize("kv", ["float16", "int8"])
def test_short_panels_with_converted_keys_and_values(path, N, kv):
    """A single short panel (5 - 20 query rows: the AVX-512 path's 16-row
    panel, with direct rows after it) over float16 or int8 keys and values
    (converted a tile at a time in the panel), causal and not, against the
    float64 reference of the rounded / dequantized operands."""
    B, H, M, D = 2, 3, 70, 32
    q, k, v = rand((B, H, N, D), 4), rand((B, H, M, D), 5), rand((B, H, M, D), 6)
    if kv == "float16":
        kk, vv = k.astype(np.float16), v.astype(np.float16)
        kr, vr = kk.astype(np.float64), vv.astype(np.float64)
    else:
        kk, vv = attncore.quantize_kv(k), attncore.quantize_kv(v)
        kr = dequantize(*kk, np.float64)
        vr = dequantize(*vv, np.float64)
    for causal in (False, "lower_right"):
        out = sdpa(q, kk, vv, is_causal=causal)
        ref = sdpa_ref(q.astype(np.float64), kr, vr, is_causal=causal)
        np.testing.assert_allclose(out, ref, rtol=3e-5, atol=3e-6)
