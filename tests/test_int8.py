"""precision="int8": Q.K^T of int8 rows (issue: int8 Q.K^T on the integer
dot-product unit, smoothed keys, accuracy-gated).

Results are compared with the float64 reference of the same inputs (the
accuracy bars of the issue), and with a plain NumPy model of the
documented method (smoothing, channel balancing, per-token symmetric
scales: attncore._int8) computed in float64 -- the kernel's int32 sums
are exact, so the two agree to float rounding.  Every int8 path runs:
vpdpbusd where the CPU has AVX512_VNNI, its AVX-512BW spelling on any
AVX-512 CPU, and the dequantized rows of the other paths; on the avx2
path vpmaddubsw with the sign trick, AVX-VNNI's vpdpbusd where the CPU has
it and that layout spelled in AVX2.
"""
import contextlib

import numpy as np
import pytest

import attncore
from attncore import _kernels
from attncore._core import _sdpa
from reference import FORCED_PATH, int8_forced, rand, sdpa_ref

sd = attncore.scaled_dot_product_attention
PATHS = list(_sdpa.available_kernel_paths())
# the AVX2 path's modes (run with the avx2 path forced: AVX2_MODES)
AVX2_MODES = ((["avx2"] + (["avxvnni"] if _sdpa.cpu_features()["avx_vnni"] else [])
               + ["avxvnni-emulate"]) if "avx2" in PATHS else [])
I8_MODES = (["native"] if _sdpa.cpu_features()["int8_dot"] else []) + \
    (["emulate"] if "avx512" in PATHS else []) + AVX2_MODES + ["dequantize"]


@pytest.fixture(autouse=True)
def float32_pv():
    """P.V in float32 (the method model's and the float64 references of
    the int8 rows assume it): int16 P.V, the default under int8 Q.K^T where
    the CPU has AVX-VNNI / AVX512_VNNI, is tested on its own
    (``pv16_mode``)."""
    prev = _sdpa.set_pv16_mode("off")
    try:
        yield
    finally:
        _sdpa.set_pv16_mode(prev)


@pytest.fixture(params=I8_MODES)
def i8mode(request):
    """An int8 Q.K^T mode, P.V in float32 (the method model's; bfloat16 P.V,
    the default where the CPU takes bf16 products, is tested on its own)."""
    if request.param in AVX2_MODES and FORCED_PATH not in (None, "avx2"):
        pytest.skip(f"an avx2-path int8 mode; ATTNCORE_TEST_KERNEL_PATH={FORCED_PATH}")
    prev = _sdpa.set_int8_mode(request.param)
    prev_bf16 = _sdpa.set_bf16_mode("off")
    try:
        # (the AVX2 modes run on the avx2 path: forced for the test, unless
        # the `path` fixture forces another one inside it)
        with _kernels.forced_kernel_path("avx2" if request.param in AVX2_MODES
                                         else _kernels.kernel_path()):
            if not int8_in_use():
                pytest.skip("no int8 kernel on this path: precision='int8' is the float32 "
                            "call (test_no_int8_kernel_takes_float32_products)")
            yield request.param
    finally:
        _sdpa.set_int8_mode(prev)
        _sdpa.set_bf16_mode(prev_bf16)


def _cos_err(a, b):
    a = np.asarray(a, np.float64).ravel()
    b = np.asarray(b, np.float64).ravel()
    return 1 - a @ b / np.linalg.norm(a) / np.linalg.norm(b)


def _offset_keys(shape, seed=1):
    """Keys as real models' look: per-channel offsets (std 10) and 4
    outlier channels (x20)."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal(shape) + rng.standard_normal(shape[:-2] + (1, shape[-1])) * 10
    k[..., :4] *= 20
    return k.astype(np.float32)


def _q8(x):
    """Symmetric per-row int8, round half to even, in float64."""
    a = np.abs(x).max(-1, keepdims=True)
    s = np.where(a > 0, a / 127, 1.0)
    return np.clip(np.round(x / s), -127, 127) * s


def int8_in_use():
    """Whether precision="int8" multiplies int8 rows here (the documented
    rule): the vpdpbusd kernel (native or emulated) runs on the avx512
    path, the vpmaddubsw / AVX-VNNI ones (codes 4 - 6) on the avx2 path,
    the forced dequantize mode anywhere; otherwise (mode "float32", the
    default where no int8 kernel beats float32, or another path) float32
    products."""
    mode, path = _sdpa.int8_mode(), _sdpa.kernel_path()
    return (mode == 3 or (mode in (1, 2) and path == "avx512")
            or (mode in (4, 5, 6) and path == "avx2"))


def method_model(q, k, v, group=1, **kw):
    """The documented method in plain float64 NumPy: keys minus their mean
    over the keys, channel c balanced by s_c = sqrt(a(k_c - mu_c) / a(q_c))
    with a(x) = min(max|x|, 16 mean|x|) (queries of the key head's group),
    per-token int8, then the float64 reference attention of the quantized
    rows (+ q . mu, which only the lse and soft cap see).  Where int8 rows
    are not multiplied (int8_in_use), the plain reference."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    if not int8_in_use():
        return sdpa_ref(q, np.repeat(k, group, axis=-3), np.repeat(v, group, axis=-3), **kw)
    mu = k.mean(-2, keepdims=True)
    ks = k - mu
    ak = np.minimum(np.abs(ks).max(-2, keepdims=True), 16 * np.abs(ks).mean(-2, keepdims=True))
    if group > 1:
        sh = q.shape
        qg = np.abs(q).reshape(sh[:-3] + (sh[-3] // group, group) + sh[-2:])
        aq = np.minimum(qg.max((-3, -2))[..., None, :], 16 * qg.mean((-3, -2))[..., None, :])
    else:
        aq = np.minimum(np.abs(q).max(-2, keepdims=True), 16 * np.abs(q).mean(-2, keepdims=True))
    s = np.sqrt(np.where((ak > 0) & (aq > 0), ak / np.where(aq > 0, aq, 1), 1.0))
    kq = _q8(ks / s)
    sq = np.repeat(s, group, axis=-3)
    muq = np.repeat(mu, group, axis=-3)
    qq = _q8(q * sq)
    # [q8, q . mu] . [k8, 1]: the smoothed scores plus the row term
    qe = np.concatenate([qq, (q * muq).sum(-1, keepdims=True)], -1)
    ke = np.concatenate([kq, np.ones(kq.shape[:-1] + (1,))], -1)
    ke, ve = np.repeat(ke, group, axis=-3), np.repeat(v, group, axis=-3)
    return sdpa_ref(qe, ke, ve, scale=1 / np.sqrt(q.shape[-1]), **kw)


# ---------------------------------------------------------------------------
# accuracy bars (float64 reference of the same inputs)
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("D", [64, 128])
def test_normal_inputs_bar(i8mode, D):
    q, k, v = (rand((1, 8, 1024, D), s) for s in range(3))
    out = sd(q, k, v, precision="int8")
    err = _cos_err(out, sdpa_ref(q, k, v))
    assert err <= 1e-4, err
    # and it is int8: float32 products are ~1e-13 off
    assert err > 1e-7


@pytest.mark.parametrize("D", [64, 128])
def test_offset_outlier_keys_bar(i8mode, D):
    q, v = rand((1, 4, 512, D), 0), rand((1, 4, 512, D), 2)
    k = _offset_keys((1, 4, 512, D))
    err = _cos_err(sd(q, k, v, precision="int8"), sdpa_ref(q, k, v))
    assert err <= 5e-4, err


def test_causal_long_rows(i8mode):
    q, k, v = (rand((1, 1, 8192, 64), s) for s in range(3))
    q = q[:, :, -256:]
    out = sd(q, k, v, is_causal="lower_right", precision="int8")
    assert _cos_err(out, sdpa_ref(q, k, v, is_causal="lower_right")) <= 1e-4


def test_matches_the_method(i8mode, path):
    """The kernel computes the documented method (a float64 NumPy model of
    it), whichever path and int8 mode runs."""
    q, v = rand((2, 4, 200, 48), 0), rand((2, 2, 300, 48), 2)
    k = _offset_keys((2, 2, 300, 48))
    out = sd(q, k, v, precision="int8", enable_gqa=True)
    ref = method_model(q, k, v, group=2)
    assert _cos_err(out, ref) < 2e-6
    # (float32 vs float64 arithmetic before rounding to int8 may put an
    # entry a step apart: a few outputs move by a step's worth)
    np.testing.assert_allclose(out, ref, atol=0.05)
    assert np.mean(np.abs(out - ref) > 1e-3) < 0.01


def test_vnni_and_emulation_agree():
    """vpdpbusd and its AVX-512BW spelling sum the same integers: the same
    bits."""
    if "avx512" not in PATHS or not _sdpa.cpu_features()["int8_dot"]:
        pytest.skip("needs AVX512_VNNI")
    q, k, v = (rand((1, 4, 300, 72), s) for s in range(3))
    outs = []
    for mode in ("native", "emulate"):
        prev = _sdpa.set_int8_mode(mode)
        try:
            outs.append(sd(q, k, v, is_causal=True, precision="int8"))
        finally:
            _sdpa.set_int8_mode(prev)
    np.testing.assert_array_equal(outs[0], outs[1])


@pytest.mark.parametrize("bf16", ["emulate", "native"])
def test_bf16_pv_with_int8_scores(bf16):
    """Where the CPU has bfloat16 dot products, P.V runs as bfloat16 pairs
    under int8 Q.K^T (both instructions on the CPU, or spelled in
    AVX-512)."""
    if "avx512" not in PATHS:
        pytest.skip("needs AVX-512")
    if bf16 == "native" and not (_sdpa.cpu_features()["bf16_dot"]
                                 and _sdpa.cpu_features()["int8_dot"]):
        pytest.skip("needs AVX512_BF16 and AVX512_VNNI")
    q, v = rand((1, 4, 300, 64), 0), rand((1, 4, 400, 64), 2)
    k = _offset_keys((1, 4, 400, 64))
    prev_path = _sdpa.set_kernel_path("avx512")
    prev8 = _sdpa.set_int8_mode("emulate" if bf16 == "emulate" else "native")
    prevb = _sdpa.set_bf16_mode(bf16)
    try:
        out = sd(q, k, v, is_causal="lower_right", precision="int8")
        _sdpa.set_bf16_mode("off")
        out32 = sd(q, k, v, is_causal="lower_right", precision="int8")
    finally:
        _sdpa.set_int8_mode(prev8)
        _sdpa.set_bf16_mode(prevb)
        _sdpa.set_kernel_path(prev_path)
    ref = sdpa_ref(q, k, v, is_causal="lower_right")
    assert _cos_err(out, ref) <= 5e-4
    # bf16 probabilities and values: a visible, small difference
    assert 1e-8 < _cos_err(out, out32) < 2e-5


# ---------------------------------------------------------------------------
# combinations
# ---------------------------------------------------------------------------
CASES = {
    "bool_mask": dict(mask="bool"),
    "float_mask": dict(mask="float"),
    "causal": dict(is_causal=True),
    "lower_right": dict(is_causal="lower_right"),
    "window": dict(is_causal=True, window=(40, 0)),
    "softcap": dict(softcap=5.0),
    "lse": dict(return_lse=True),
    "weights": dict(return_weights=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_combinations(i8mode, path, case):
    kw = dict(CASES[case])
    N, M, D = 150, 230, 40
    q, v = rand((2, 3, N, D), 0), rand((2, 3, M, D), 2)
    k = _offset_keys((2, 3, M, D))
    mask = kw.pop("mask", None)
    if mask == "bool":
        mask = np.random.default_rng(5).random((N, M)) > 0.3
    elif mask == "float":
        mask = np.random.default_rng(5).standard_normal((N, M)).astype(np.float32)
        mask[:, ::7] = -np.inf
    want_w = kw.pop("return_weights", False)
    want_lse = kw.pop("return_lse", False)
    res = sd(q, k, v, attn_mask=mask, precision="int8", return_weights=want_w,
             return_lse=want_lse, **kw)
    ref = sdpa_ref(q, k, v, attn_mask=mask, return_lse=want_lse, return_weights=want_w, **kw)
    meth = method_model(q, k, v, attn_mask=mask, return_lse=want_lse,
                        return_weights=want_w, **kw)
    if want_w or want_lse:
        out, extra = res
        ref, rextra = ref
        meth, mextra = meth
        # the weights / the lse: those of the int8 scores (the method), near
        # the exact ones
        # (float32 vs float64 statistics may put an entry a step apart)
        np.testing.assert_allclose(extra, mextra, atol=1e-3, rtol=1e-4)
        if want_w:
            assert np.mean(np.abs(extra - mextra) > 2e-4) < 1e-4
        # (offset keys: scores in the hundreds)
        np.testing.assert_allclose(extra, rextra, rtol=5e-3, atol=0.25 if want_lse else 0.1)
    else:
        out = res
    assert _cos_err(out, meth) < 2e-6
    assert _cos_err(out, ref) < 5e-4


def test_sinks_and_alibi(i8mode):
    q, k, v = (rand((1, 4, 100, 32), s) for s in range(3))
    sinks = np.array([0.5, -1.0, 2.0, 0.0])
    slopes = np.array([0.5, 0.25, 0.125, 0.0625])
    for kw in (dict(sinks=sinks), dict(alibi_slopes=slopes, is_causal=True)):
        f = attncore.functional.scaled_dot_product_attention
        o8 = f(q, k, v, precision="int8", **kw)
        o32 = f(q, k, v, **kw)
        assert _cos_err(o8, o32) < 1e-4


def test_gqa_and_key_splits(i8mode):
    # one block of a few query rows (one panel of the path in use, so one
    # query block on every CPU), many keys, two threads: the keys are split
    # in two (the planner's rule: test_blas_policy) and the parts merged
    N = min(20, _sdpa.PANEL_ROWS.get(_sdpa.kernel_path(), 20))
    q = rand((1, 1, N, 64), 0)
    k, v = _offset_keys((1, 1, 5000, 64)), rand((1, 1, 5000, 64), 2)
    out, lse = sd(q, k, v, precision="int8", num_threads=2, return_lse=True)
    ref, rlse = method_model(q, k, v, return_lse=True)
    assert _cos_err(out, ref) < 2e-6
    np.testing.assert_allclose(lse, rlse, rtol=1e-4, atol=1e-3)
    # grouped-query heads
    q = rand((1, 4, 40, 64), 0)
    k, v = _offset_keys((1, 2, 500, 64)), rand((1, 2, 500, 64), 2)
    out = sd(q, k, v, enable_gqa=True, precision="int8", num_threads=2)
    assert _cos_err(out, method_model(q, k, v, group=2)) < 2e-6


@pytest.mark.parametrize("D", [1, 2, 3, 5, 130, 1100])
def test_odd_head_sizes(i8mode, D):
    q, k, v = (rand((1, 2, 70, D), s) for s in range(3))
    out = sd(q, k, v, precision="int8", is_causal=True)
    assert _cos_err(out, method_model(q, k, v, is_causal=True)) < 2e-6


def test_half_inputs(i8mode):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    for dt in (np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16)):
        q, k, v = (rand((1, 4, 200, 64), s).astype(dt) for s in range(3))
        out = sd(q, k, v, precision="int8", is_causal=True)
        assert out.dtype == dt
        ref = sdpa_ref(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                       is_causal=True)
        assert _cos_err(out.astype(np.float64), ref) < 1e-4


def test_int8_kv_cache_keys(i8mode):
    """int8 keys from quantize_kv are used as they are (no smoothing)."""
    q, k, v = (rand((1, 4, 100, 62), s) for s in range(3))
    k8 = attncore.quantize_kv(k)
    out = sd(q, k8, v, precision="int8")
    kd = k8[0] * k8[1][..., None].astype(np.float64)
    # the method without smoothing / balancing on the dequantized keys
    ref = sdpa_ref(_q8(q.astype(np.float64)), kd, v)
    assert _cos_err(out, ref) < 2e-6
    # decoding: one row
    out1 = sd(q[:, :, -1:], k8, v, precision="int8")
    assert _cos_err(out1, sdpa_ref(_q8(q[:, :, -1:].astype(np.float64)), kd, v)) < 2e-6


def test_int8_values_with_int8_products(i8mode):
    q, k, v = (rand((1, 2, 120, 32), s) for s in range(3))
    v8 = attncore.quantize_kv(v)
    out = sd(q, k, v8, precision="int8")
    vd = v8[0] * v8[1][..., None].astype(np.float64)
    assert _cos_err(out, method_model(q, k, vd)) < 2e-6


# ---------------------------------------------------------------------------
# non-finite values, inputs untouched, errors
# ---------------------------------------------------------------------------
def test_nan_rows_and_masked_keys(i8mode):
    """A NaN query row is NaN; an inf key element reaches only the rows
    that see its key (causal), and there as in a float call (the result is
    not finite, so the call runs again in float64): a +inf score makes the
    row NaN, a -inf one drops the key (plain float64 softmax of the other
    keys)."""
    q, k, v = (rand((1, 1, 64, 16), s) for s in range(3))
    q[0, 0, 3, 2] = np.nan
    k[0, 0, 10, 0] = np.inf            # a key only rows < 10 do not see
    out = sd(q, k, v, precision="int8", is_causal=True)
    assert np.isnan(out[0, 0, 3]).all()
    assert np.isfinite(out[0, 0, :3]).all()
    assert np.isfinite(out[0, 0, 4:10]).all()
    q64, k64, v64 = (a[0, 0].astype(np.float64) for a in (q, k, v))
    for r in range(10, 64):
        if q64[r, 0] > 0:
            assert np.isnan(out[0, 0, r]).all()
            continue
        keys = [j for j in range(r + 1) if j != 10]
        s_ = (k64[keys] @ q64[r]) / 4.0
        p_ = np.exp(s_ - s_.max())
        np.testing.assert_allclose(out[0, 0, r], p_ @ v64[keys] / p_.sum(), rtol=1e-5, atol=1e-6)


def test_tiny_and_huge_rows(i8mode):
    """Rows far below float32's normal range (their scale would overflow
    127 / max) and huge keys, with an int8 cache (no balancing)."""
    rng = np.random.default_rng(0)
    q = (rng.standard_normal((1, 2, 40, 16)) * 1e-39).astype(np.float32)
    k = (rng.standard_normal((1, 2, 40, 16)) * 5e37).astype(np.float32)
    assert np.isfinite(k).all()
    v = rand((1, 2, 40, 16), 2)
    k8 = attncore.quantize_kv(k)
    kd = k8[0] * k8[1][..., None].astype(np.float64)
    out = sd(q, k8, v, precision="int8")
    ref = sdpa_ref(_q8(q.astype(np.float64)), kd, v)
    np.testing.assert_allclose(out, ref, atol=1e-4)
    out = sd(q, k, v, precision="int8")
    assert _cos_err(out, sdpa_ref(q, k, v)) < 1e-3


def test_one_outlier_query_leaves_other_rows_alone(i8mode):
    """An inf (that row: NaN) or a large value in one query row must not
    degrade the other rows, heads or batch elements sharing the keys."""
    q = rand((4, 2, 64, 64), 0)
    k, v = rand((1, 2, 256, 64), 1), rand((1, 2, 256, 64), 2)
    ref = sdpa_ref(q, k, v)
    for bad in (np.inf, 1e3):
        q2 = q.copy()
        q2[0, 0, 0, 5] = bad
        out = sd(q2, k, v, precision="int8")
        if bad == np.inf:
            assert np.isnan(out[0, 0, 0]).all()
        assert _cos_err(out[1:], ref[1:]) < 1e-4
        assert _cos_err(out[0, :, 1:], ref[0, :, 1:]) < 1e-4


def _check_inputs_not_modified():
    q, k, v = (rand((1, 2, 80, 24), s) for s in range(3))
    copies = [x.copy() for x in (q, k, v)]
    sd(q, k, v, precision="int8", is_causal=True)
    for a, b in zip((q, k, v), copies):
        np.testing.assert_array_equal(a, b)


def test_inputs_not_modified(i8mode):
    _check_inputs_not_modified()


def test_bad_precision():
    q = rand((1, 1, 4, 8))
    with pytest.raises(ValueError, match="precision='int8' is for float32"):
        sd(q.astype(np.float64), q, q, precision="int8")
    with pytest.raises(ValueError, match="'int8', got 'int4'"):
        sd(q, q, q, precision="int4")
    with pytest.raises(TypeError, match="precision must be"):
        sd(q, q, q, precision=8)


def test_layer_precision_float64_is_refused():
    with pytest.raises(ValueError, match="float64"):
        attncore.MultiHeadAttention(16, 2, dtype="float64", precision="int8")
    mha = attncore.MultiHeadAttention(16, 2, dtype="float64")
    with pytest.raises(ValueError, match="float64"):
        mha.precision = "int8"
    assert mha.precision is None


def test_layer_precision():
    rng = np.random.default_rng(0)
    mha = attncore.MultiHeadAttention(64, 4, precision="int8", rng=rng)
    x = rand((2, 90, 64))
    with int8_forced():
        assert int8_in_use()    # (an int8 kernel of every CPU of the path)
        out8 = mha(x, x, x, is_causal=True)[0]
    mha.precision = None
    out32 = mha(x, x, x, is_causal=True)[0]
    assert 1e-9 < _cos_err(out8, out32) < 1e-4


def test_layer_int8_cache_decoding():
    """Decoding steps of a layer with an int8 cache and precision="int8":
    the cache's int8 keys feed the integer dot products."""
    mha = attncore.MultiHeadAttention(64, 4, rng=1)
    x = rand((1, 40, 64), 3)
    outs = {}
    for prec in (None, "int8"):
        mha.precision = prec
        cache = mha.new_cache(1, 64, dtype="int8")
        mha(x[:, :32], cache=cache, is_causal="lower_right")
        outs[prec] = np.concatenate(
            [mha(x[:, t:t + 1], cache=cache, is_causal="lower_right")[0] for t in range(32, 40)],
            axis=1)
    err = _cos_err(outs["int8"], outs[None])
    if int8_in_use():
        assert 0 < err < 1e-4
    else:  # float32 products: the same call
        np.testing.assert_array_equal(outs["int8"], outs[None])



@pytest.mark.parametrize("mode", ["float32", "native", "emulate", "avx2", "avxvnni",
                                  "avxvnni-emulate"])
def test_no_int8_kernel_takes_float32_products(mode, path):
    """Where this CPU and path have no int8 kernel (the vpdpbusd kernel runs
    on the avx512 path only; mode "float32" is the default of CPUs without
    AVX512_VNNI), precision="int8" takes float32 products: the bits of the
    float32 call, never slower than it."""
    try:
        prev = _sdpa.set_int8_mode(mode)
    except ValueError:
        pytest.skip(f"this CPU has no {mode} int8 mode")
    try:
        if int8_in_use():
            pytest.skip("an int8 kernel runs here")
        q, k, v = (rand((1, 4, 150, 64), s) for s in range(3))
        for kw in ({}, {"is_causal": True}, {"return_lse": True}):
            a = sd(q, k, v, precision="int8", **kw)
            b = sd(q, k, v, **kw)
            for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
                np.testing.assert_array_equal(x, y)
    finally:
        _sdpa.set_int8_mode(prev)


# ---------------------------------------------------------------------------
# the avx2 path's int8 kernels (vpmaddubsw with the sign trick, AVX-VNNI's
# vpdpbusd, its AVX2 spelling) against a float64 NumPy reference of the
# very int8 rows the call multiplies
# ---------------------------------------------------------------------------
@pytest.fixture(params=AVX2_MODES or ["none"])
def avx2_mode(request):
    """An AVX2-path int8 mode, the avx2 path forced, P.V in float32."""
    if request.param == "none":
        pytest.skip("this CPU has no AVX2")
    if FORCED_PATH not in (None, "avx2"):
        pytest.skip(f"ATTNCORE_TEST_KERNEL_PATH={FORCED_PATH}")
    prev = _sdpa.set_int8_mode(request.param)
    prev_bf16 = _sdpa.set_bf16_mode("off")
    try:
        with _kernels.forced_kernel_path("avx2"):
            yield request.param
    finally:
        _sdpa.set_int8_mode(prev)
        _sdpa.set_bf16_mode(prev_bf16)


def _int8_rows_ref(q, k, v, **kw):
    """float64 attention of the dequantized int8 rows the call multiplies:
    attncore._int8's operands (smoothed, balanced, per-token scales; the
    keys as given for an int8 (keys, scales) pair), made on the path in use
    as the call makes them."""
    from attncore import _int8
    q = np.asarray(q, np.float32)
    bshape, (N, D) = q.shape[:-2], q.shape[-2:]
    if isinstance(k, tuple):
        ops = _int8.quantize(q, 0, None, 0, k[0], k[1], bshape, 1, 1)
        k8, ks = ops.k8[..., :D], ops.k_pairs[..., 0]
    else:
        ops = _int8.quantize(q, 0, k, 0, None, None, bshape, 1, 1)
        k8, ks = ops.k8[..., :D], ops.k_pairs[..., 0]
    # the quantizer's range: +-127 (the sign trick needs no -128 query)
    assert ops.q8.min() >= -127 and k8.min() >= -127
    qd = ops.q8.reshape(bshape + (N, -1))[..., :D] * ops.q_scales.reshape(bshape + (N, 1)).astype(np.float64)
    kd = k8 * ks[..., None].astype(np.float64)
    return sdpa_ref(qd, kd, v, scale=1 / np.sqrt(D), **kw)


def _mask(kind, N, M):
    rng = np.random.default_rng(5)
    if kind == "bool":
        m = rng.random((N, M)) > 0.3
        m[:, 0] = True
        return dict(attn_mask=m)
    if kind == "float":
        m = rng.standard_normal((N, M)).astype(np.float32)
        m[:, 1::7] = -np.inf
        return dict(attn_mask=m)
    if kind == "causal":
        return dict(is_causal=True)
    return {}


@pytest.mark.parametrize("D", [1, 3, 4, 63, 64, 128, 129])
@pytest.mark.parametrize("N", [3, 100])
@pytest.mark.parametrize("case", ["plain", "causal", "bool", "float"])
def test_avx2_kernels_match_float64_of_int8_rows(avx2_mode, D, N, case):
    """Every AVX2 int8 mode computes the attention of its int8 rows: the
    int32 sums are exact, only float32 rounding is left.  D 1 (the
    dequantized rows), odd and padded row lengths (63, 129: rows padded
    to a multiple of 4 bytes); N 3: the direct loops of a few rows, N 100:
    the fused AVX2 panels (16 rows; a partial last panel)."""
    M = 150
    q, v = rand((2, 2, N, D), 0), rand((2, 2, M, D), 2)
    k = _offset_keys((2, 2, M, D))
    kw = _mask(case, N, M)
    out = sd(q, k, v, precision="int8", **kw)
    ref = _int8_rows_ref(q, k, v, **kw)
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)
    # and the exact attention is near
    assert _cos_err(out, sdpa_ref(q, k, v, **kw)) < 1e-3


def test_avx2_kernels_int8_keys_given(avx2_mode):
    """int8 keys from quantize_kv (no smoothing), zero query and key rows
    (scale 0: their scores are 0), full-scale rows at +-127 and long rows
    (D 1100: int32 sums of 127 x 127 x 1100)."""
    for D in (64, 1100):
        q, k, v = (rand((1, 2, 120, D), s) for s in range(3))
        q[0, 0, 7] = 0
        q[0, 1, 30] = np.where(np.arange(D) % 2, 5.0, -5.0)
        k[0, :, 11] = 0
        k[0, :, 12] = 3.0
        k[0, :, 13] = -3.0
        k8 = attncore.quantize_kv(k)
        assert k8[0].min() >= -127
        out = sd(q, k8, v, precision="int8", is_causal=True)
        np.testing.assert_allclose(out, _int8_rows_ref(q, k8, v, is_causal=True),
                                   rtol=1e-4, atol=1e-5)


def test_avx2_kernels_keys_of_minus_128(avx2_mode):
    """int8 keys given with -128 entries (not from quantize_kv: it gives
    +-127): vpsignb cannot negate -128, so the sign-trick mode takes the
    AVX-VNNI layout in AVX2 for such a call -- still exact."""
    q, v = rand((1, 2, 100, 36), 0), rand((1, 2, 90, 36), 2)
    k8 = np.random.default_rng(3).integers(-128, 128, (1, 2, 90, 36), dtype=np.int8)
    k8[..., ::5, :] = -128
    ks = np.abs(rand((1, 2, 90), 4)) / 100
    out = sd(q, (k8, ks), v, precision="int8", is_causal=True)
    qf = q.astype(np.float64)
    qd = _q8(qf)
    ref = sdpa_ref(qd, k8 * ks[..., None].astype(np.float64), v, is_causal=True)
    assert _cos_err(out, ref) < 2e-6
    np.testing.assert_allclose(out, ref, atol=0.02)


def test_avx2_modes_sum_the_same_integers():
    """vpmaddubsw (sign trick), AVX-VNNI and its AVX2 spelling sum the same
    integers: the same bits; and the same output as the AVX-512 kernel to
    float rounding."""
    if not AVX2_MODES or FORCED_PATH not in (None, "avx2"):
        pytest.skip("needs the avx2 path")
    q, k, v = (rand((1, 3, 300, 72), s) for s in range(3))
    mask = np.random.default_rng(5).random((300, 300)) > 0.2
    outs = {}
    prev, prev_bf16 = _sdpa.set_int8_mode(None), _sdpa.set_bf16_mode("off")
    try:
        with _kernels.forced_kernel_path("avx2"):
            for mode in AVX2_MODES:
                _sdpa.set_int8_mode(mode)
                assert int8_in_use()
                outs[mode] = (sd(q, k, v, is_causal=True, precision="int8"),
                              sd(q, k, v, attn_mask=mask, precision="int8"))
        if "avx512" in PATHS:
            with _kernels.forced_kernel_path("avx512"):
                _sdpa.set_int8_mode("emulate")
                outs["avx512"] = (sd(q, k, v, is_causal=True, precision="int8"),
                                  sd(q, k, v, attn_mask=mask, precision="int8"))
    finally:
        _sdpa.set_int8_mode(prev)
        _sdpa.set_bf16_mode(prev_bf16)
    first = outs[AVX2_MODES[0]]
    for mode in AVX2_MODES[1:]:
        for a, b in zip(first, outs[mode]):
            np.testing.assert_array_equal(a, b)
    if "avx512" in outs:
        for a, b in zip(first, outs["avx512"]):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_avx2_mode_choice_and_config(capsys):
    """The default on the avx2 path is the AVX2 int8 kernel that beats
    float32 products (_sdpa.INT8_AVX2_DEFAULTS), and show_config says what
    precision="int8" computes; another path's code takes float32
    products; unknown modes are refused."""
    if "avx2" not in PATHS:
        pytest.skip("needs the avx2 path")
    from attncore import _config
    vnni = _sdpa.cpu_features()["avx_vnni"]
    prev = _sdpa.set_int8_mode(None)
    try:
        with _kernels.forced_kernel_path("avx2"):
            want = (5 if vnni and _sdpa.INT8_AVX2_DEFAULTS["avxvnni"]
                    else 4 if _sdpa.INT8_AVX2_DEFAULTS["avx2"] else 0)
            assert _sdpa.int8_mode() == want
            for mode, key in [("avx2", "int8-avx2"), ("avxvnni", "int8-avxvnni"),
                              ("avxvnni-emulate", "int8-avxvnni-emulated"),
                              ("float32", "float32"), ("dequantize", "dequantized")]:
                if mode not in AVX2_MODES + ["float32", "dequantize"]:
                    continue
                _sdpa.set_int8_mode(mode)
                assert _config.config_dict()["int8_products"] == key
                attncore.show_config()
                out = capsys.readouterr().out
                assert all(line in out for line in _config._INT8_LINES[key])
            for mode in ("native", "emulate"):
                if mode in I8_MODES:
                    _sdpa.set_int8_mode(mode)
                    assert _config.config_dict()["int8_products"] == "float32"
        if "avx512" in PATHS:
            with _kernels.forced_kernel_path("avx512"):
                _sdpa.set_int8_mode("avx2")
                assert not int8_in_use()
                assert attncore._call.int8_products(64) == 0
        with pytest.raises(ValueError, match="int8 mode"):
            _sdpa.set_int8_mode("avx3")
    finally:
        _sdpa.set_int8_mode(prev)


def _col_stats_ref(x, centered):
    """Per head and column, over the finite entries only, in float64: the
    mean (centered) and the mean and largest |x - mean| (else of |x|)."""
    nh, _, D = x.shape
    mean, mabs, amax = (np.zeros((nh, D)) for _ in range(3))
    for h in range(nh):
        for d in range(D):
            col = x[h, :, d].astype(np.float64)
            col = col[np.isfinite(col)]
            if col.size == 0:
                continue
            mu = float(np.float32(col.mean())) if centered else 0.0
            t = np.abs(col - mu)
            mean[h, d], mabs[h, d], amax[h, d] = mu, t.mean(), t.max()
    return mean, mabs, amax


@pytest.mark.parametrize("fmt", [0, 1, 2])
@pytest.mark.parametrize("D", [1, 7, 8, 16, 37, 128])
@pytest.mark.parametrize("centered", [True, False])
def test_int8_column_statistics(path, fmt, D, centered):
    """The column statistics that steer precision="int8"'s smoothing
    (_sdpa.int8_col_stats) against a float64 NumPy reference: float32 and
    16-bit rows (strided: every other row of a larger array), a column
    tail shorter than a vector, inf / NaN entries left out of their
    column, a column without a finite entry, 1-3 threads."""
    rng = np.random.default_rng(D * 10 + fmt)
    nh, R = 3, 41
    x = (rng.standard_normal((nh, 2 * R, D)) * 3 + rng.standard_normal(D) * 2).astype(np.float32)
    x = x[:, ::2]
    x[0, 5, 0] = np.inf
    x[1, 7, D - 1] = np.nan
    x[2, :, D // 2] = -np.inf          # no finite entry at all
    if fmt:
        dt = pytest.importorskip("ml_dtypes").bfloat16 if fmt == 1 else np.float16
        xr = x.astype(dt)
        xin, x = xr.view(np.uint16), xr.astype(np.float32)
    else:
        xin = x
    mean, mabs, amax = _col_stats_ref(x, centered)
    for nt in (1, 2, 3):
        got_mean = np.full((nh, D), -1.0, np.float32) if centered else None
        got_mabs, got_amax = (np.full((nh, D), -1.0, np.float32) for _ in range(2))
        _sdpa.int8_col_stats(xin, fmt, got_mean, got_mabs, got_amax, nt)
        if centered:
            np.testing.assert_allclose(got_mean, mean, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got_mabs, mabs, rtol=1e-4, atol=1e-6)
        np.testing.assert_allclose(got_amax, amax, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------
# int16 P.V under int8 Q.K^T (vpdpwssd: AVX-VNNI on the avx2 path's 16-row
# panel, AVX512_VNNI on the avx512 path's 32-row one; their AVX2 / AVX-512BW
# spellings): probabilities as 14-bit integers per row and key tile, values
# as 10-bit integers per key row
# ---------------------------------------------------------------------------
_FEATS = _sdpa.cpu_features()
# (path, int16 P.V mode): the native instruction where the CPU has it
PV16_CASES = ([("avx2", m) for m in (["native"] if _FEATS["avx_vnni"] else []) + ["emulate"]]
              if "avx2" in PATHS else []) + \
    ([("avx512", m) for m in (["native"] if _FEATS["int8_dot"] else []) + ["emulate"]]
     if "avx512" in PATHS else [])
# the int8 Q.K^T mode each path's int16 P.V runs under in these tests
PV16_INT8 = {"avx2": "avxvnni-emulate", "avx512": "native" if _FEATS["int8_dot"] else "emulate"}


@contextlib.contextmanager
def _pv16_modes(path, mode):
    """int8 Q.K^T of ``path``'s panel (AVX-VNNI's layout in its AVX2
    spelling on the avx2 path: the same int32 sums on any AVX2 CPU), int16
    P.V mode ``mode`` (bfloat16 P.V off), the path forced."""
    prev8 = _sdpa.set_int8_mode(PV16_INT8[path])
    prev = _sdpa.set_pv16_mode(mode)
    prevbf = _sdpa.set_bf16_mode("off")
    try:
        with _kernels.forced_kernel_path(path):
            yield mode
    finally:
        _sdpa.set_int8_mode(prev8)
        _sdpa.set_pv16_mode(prev)
        _sdpa.set_bf16_mode(prevbf)


@pytest.fixture(params=PV16_CASES or [("none", "none")], ids="-".join)
def pv16_mode(request):
    """An int16 P.V mode on a kernel path (see _pv16_modes)."""
    path, mode = request.param
    if path == "none":
        pytest.skip("needs the avx2 or the avx512 path")
    if FORCED_PATH not in (None, path):
        pytest.skip(f"ATTNCORE_TEST_KERNEL_PATH={FORCED_PATH}")
    with _pv16_modes(path, mode):
        yield mode


def _with_float32_pv(fn):
    prev = _sdpa.set_pv16_mode("off")
    try:
        return fn()
    finally:
        _sdpa.set_pv16_mode(prev)


@pytest.mark.parametrize("D", [64, 128])
def test_pv16_normal_inputs_bar(pv16_mode, D):
    """The accuracy bar of precision="int8" holds with the int16 P.V, and
    the int16 rounding is a small part of the error."""
    q, k, v = (rand((1, 8, 1024, D), s) for s in range(3))
    out = sd(q, k, v, precision="int8")
    out32 = _with_float32_pv(lambda: sd(q, k, v, precision="int8"))
    assert _cos_err(out, sdpa_ref(q, k, v)) <= 1e-4
    # integer probabilities and values: a visible, small difference
    assert 1e-10 < _cos_err(out, out32) < 2e-6


def test_pv16_matches_a_model_of_its_integers(pv16_mode):
    """One key tile (M <= AC_BK keys, the build's key block: 128 by
    default, so M is 100 or the block): each value as round(u 1015 / s_j),
    u = v / c_d (c_d: the column's largest |v|, s_j: the row's largest
    |u|), each probability times its key's s_j as round(p' 16383 / M_r)
    (M_r: the row's largest p'), the integer products scaled back (times
    c_d), over the float sum of p -- in float64 from the very int8 rows
    the call multiplies.  A probability may round a step the other way
    (float32 exp2 against float64): the bound is a few steps' worth."""
    from attncore import _int8
    B, H, N, M, D, Dv = 2, 2, 64, min(100, _sdpa.KEY_BLOCK), 40, 37
    q, v = rand((B, H, N, D), 0), rand((B, H, M, Dv), 2)
    k = _offset_keys((B, H, M, D))
    v[0, 0, 3, :] = 0.0                     # an all-zero value row
    v[1, 1, 7, :] *= 4                      # one large value row (50x: an outlier,
    #                                         whose chunk takes float32 P.V)
    out = sd(q, k, v, precision="int8")
    ops = _int8.quantize(q, 0, k, 0, None, None, (B, H), 1, 1)
    qd = ops.q8.reshape(B, H, N, -1)[..., :D] * ops.q_scales.reshape(B, H, N, 1).astype(np.float64)
    kd = ops.k8[..., :D] * ops.k_pairs[..., 0][..., None].astype(np.float64)
    s_ = qd @ np.swapaxes(kd, -1, -2) / np.sqrt(D)
    p = np.exp(s_ - s_.max(-1, keepdims=True))
    cd = np.abs(v.astype(np.float64)).max(-2, keepdims=True)     # (B, H, 1, Dv)
    u = v / cd
    sv = np.abs(u).max(-1)                                       # (B, H, M)
    vq = np.round(u * np.where(sv > 0, 1015 / np.where(sv > 0, sv, 1), 0)[..., None])
    pp = p * sv[..., None, :]
    mr = pp.max(-1, keepdims=True)
    model = ((np.round(pp * 16383 / mr) @ vq) * (mr / (16383 * 1015)) * cd
             / p.sum(-1, keepdims=True))
    step = mr / 16383 / p.sum(-1, keepdims=True) * cd    # one probability step's worth
    assert np.all(np.abs(out - model) <= 3 * step + 1e-5)
    # and it is the int16 P.V: float32 P.V is off the model by more
    out32 = _with_float32_pv(lambda: sd(q, k, v, precision="int8"))
    assert np.abs(out32 - model).max() > 10 * np.abs(out - model).max()


def test_pv16_long_tail_and_masked_outliers(pv16_mode):
    """The cases fixed-point probabilities and shared value scales get
    wrong: a dominant key (an attention sink, score gap 9.5) over a long
    tail of 1023 keys each below 1e-4 of it -- the tail carries 7 % of the
    mass and all of the output --; and a masked key whose values are 1e6
    (another key's scale must not see it).  Both as close to float64 as
    the float32-P.V call."""
    H, N, M, D = 4, 64, 1024, 64
    rng = np.random.default_rng(0)
    q = np.zeros((H, N, D), np.float32)
    q[..., 0] = 1.0
    q += 0.001 * rng.standard_normal(q.shape).astype(np.float32)
    k = np.zeros((H, M, D), np.float32)
    k[:, 0, 0] = 9.5 * np.sqrt(D)
    v = np.ones((H, M, D), np.float32)
    v[:, 0] = 0.0
    ref = sdpa_ref(q, k, v)
    out = sd(q, k, v, precision="int8")
    out32 = _with_float32_pv(lambda: sd(q, k, v, precision="int8"))
    assert np.abs(out - ref).max() <= max(2 * np.abs(out32 - ref).max(), 1e-5)
    q, k, v = (rng.standard_normal((4, n, 64)).astype(np.float32) for n in (64, 256, 256))
    v[:, 5] = 1e6
    mask = np.ones((64, 256), bool)
    mask[:, 5] = False
    ref = sdpa_ref(q, k, v, attn_mask=mask)
    out = sd(q, k, v, attn_mask=mask, precision="int8")
    out32 = _with_float32_pv(lambda: sd(q, k, v, attn_mask=mask, precision="int8"))
    assert np.linalg.norm(out - ref) <= 1.2 * np.linalg.norm(out32 - ref)


@pytest.mark.parametrize("big", [100.0, 1e4, 1e8])
def test_pv16_value_outlier_channel(pv16_mode, big):
    """A value channel far larger than the others (in every key) must not
    set the others' integer steps: each column is scaled first.  With a
    per-key scale alone the other channels had 1 - cos 4e-2 at 1000x and
    0.55 at 1e4x against float64; here as near as the float32-P.V call."""
    q, k, v = rand((1, 2, 256, 64), 0), rand((1, 2, 256, 64), 1), rand((1, 2, 256, 48), 2)
    v[..., 7] *= big
    ref = sdpa_ref(q, k, v)
    out = sd(q, k, v, precision="int8")
    out32 = _with_float32_pv(lambda: sd(q, k, v, precision="int8"))
    rest = np.r_[0:7, 8:48]
    assert _cos_err(out[..., rest], ref[..., rest]) <= 1.2 * _cos_err(out32[..., rest],
                                                                      ref[..., rest])
    assert _cos_err(out[..., 7], ref[..., 7]) <= 1.2 * _cos_err(out32[..., 7], ref[..., 7])


@pytest.mark.parametrize("hide", ["mask", "causal", "window"])
@pytest.mark.parametrize("big", [1e6, 1e35])
def test_pv16_unseen_key_outlier_element(pv16_mode, hide, big):
    """One value of 1e6 (1e35) in one column of a key that some rows do not
    see (masked for all, beyond a causal row, out of a window): that
    column's scale must not take the other keys' values of the column from
    those rows (1 - cos 0.15-0.47 on it when it did: the chunk now takes
    float32 P.V).  Against float64, as near as the float32-P.V call."""
    N = M = 256
    q, k, v = rand((1, 1, N, 64), 0), rand((1, 1, M, 64), 1), rand((1, 1, M, 32), 2)
    j = {"mask": 100, "causal": 200, "window": 60}[hide]
    v[0, 0, j, 0] = big
    kw = ({"attn_mask": np.arange(M) != j} if hide == "mask" else
          {"is_causal": True} if hide == "causal" else {"window": (8, 8)})
    rows = (np.arange(N) < j if hide == "causal" else
            np.abs(np.arange(N) - j) > 8 if hide == "window" else slice(None))
    ref = sdpa_ref(q, k, v, **kw)[0, 0, rows]
    out = sd(q, k, v, precision="int8", **kw)[0, 0, rows]
    out32 = _with_float32_pv(lambda: sd(q, k, v, precision="int8", **kw))[0, 0, rows]
    for c in (0, 1):
        assert _cos_err(out[:, c], ref[:, c]) <= 1.2 * _cos_err(out32[:, c], ref[:, c]) + 1e-6


@pytest.mark.parametrize("case", ["softcap", "sinks", "inf query"])
def test_pv16_with_float_scores(pv16_mode, case):
    """Calls whose int8 stage takes float products (a soft cap, sinks, an
    inf in a query row) take float32 P.V too: the same result as with the
    int16 P.V off, no error."""
    q, k, v = (rand((1, 2, 40, 64), s) for s in range(3))
    kw = dict(softcap=30.0) if case == "softcap" else \
        dict(sinks=np.zeros(2, np.float32)) if case == "sinks" else {}
    if case == "inf query":
        q[0, 0, 2, 1] = np.inf
    out = sd(q, k, v, precision="int8", **kw)
    out32 = _with_float32_pv(lambda: sd(q, k, v, precision="int8", **kw))
    np.testing.assert_array_equal(out, out32)


@pytest.mark.parametrize("case", ["plain", "causal", "bool", "float", "window", "lse"])
@pytest.mark.parametrize("Dv", [5, 16, 37, 200])
def test_pv16_combinations(pv16_mode, case, Dv):
    """Masks, causal rows, windows and the lse with the int16 P.V, value
    widths below, at and off a 16-column micro-tile, several key chunks
    (M 300: chunks of 128 keys, tiles starting at odd keys under masks):
    near the float32-P.V call, and the native and AVX2 spellings give the
    same bits (see test_pv16_spellings_agree)."""
    N, M, D = 100, 300, 48
    q, k, v = rand((2, 2, N, D), 0), rand((2, 2, M, D), 1), rand((2, 2, M, Dv), 2)
    kw = dict(window=(40, 0), is_causal=True) if case == "window" else \
        dict(return_lse=True) if case == "lse" else _mask(case, N, M)
    out = sd(q, k, v, precision="int8", **kw)
    out32 = _with_float32_pv(lambda: sd(q, k, v, precision="int8", **kw))
    if case == "lse":
        np.testing.assert_allclose(out[1], out32[1], rtol=1e-6, atol=1e-6)
        out, out32 = out[0], out32[0]
    assert np.isfinite(out).all()
    # (a row whose mass sits on a few keys moves by up to a few 1e-3:
    # steps of 1 / 4095 of its largest probability)
    np.testing.assert_allclose(out, out32, atol=5e-3)
    assert _cos_err(out, out32) < 1e-6
    ref = sdpa_ref(q, k, v, **({} if case == "lse" else kw))
    assert _cos_err(out, ref) < 1e-3


@pytest.mark.parametrize("path", ["avx2", "avx512"])
def test_pv16_spellings_agree(path):
    """vpdpwssd and its AVX2 / AVX-512BW spelling sum the same integers:
    the same bits, on every thread count."""
    if (path, "native") not in PV16_CASES or FORCED_PATH not in (None, path):
        pytest.skip(f"needs the {path} path's vpdpwssd")
    q, k, v = rand((1, 3, 300, 72), 0), rand((1, 3, 333, 72), 1), rand((1, 3, 333, 50), 2)
    mask = np.random.default_rng(5).random((300, 333)) > 0.2
    outs = {}
    for mode in ("native", "emulate"):
        with _pv16_modes(path, mode):
            outs[mode] = [sd(q, k, v, is_causal=True, precision="int8", num_threads=t)
                          for t in (1, 2, 3)] + [sd(q, k, v, attn_mask=mask, precision="int8")]
    for a, b in zip(outs["native"], outs["emulate"]):
        np.testing.assert_array_equal(a, b)
    for a in outs["native"][1:3]:
        np.testing.assert_array_equal(a, outs["native"][0])


def test_pv16_non_finite_values(pv16_mode):
    """A key chunk with an inf / NaN value takes float32 P.V (the int16
    pairs would spread it over the column's scale): a masked key's inf
    value stays out, an attended one reaches its rows as in a float call."""
    q, k, v = rand((1, 1, 64, 16), 0), rand((1, 1, 200, 16), 1), rand((1, 1, 200, 24), 2)
    mask = np.ones((64, 200), bool)
    mask[:, 150] = False
    v[0, 0, 150, 3] = np.inf               # masked out everywhere
    v[0, 0, 20, 5] = np.nan                # chunk 1: attended
    out = sd(q, k, v, attn_mask=mask, precision="int8")
    out32 = _with_float32_pv(lambda: sd(q, k, v, attn_mask=mask, precision="int8"))
    np.testing.assert_array_equal(np.isnan(out), np.isnan(out32))
    assert np.isnan(out[..., 5]).all() and np.isfinite(np.delete(out, 5, -1)).all()
    ref = sdpa_ref(q, k, np.where(np.isfinite(v), v, 0), attn_mask=mask)
    np.testing.assert_allclose(np.delete(out, 5, -1), np.delete(ref, 5, -1), atol=2e-3)


@pytest.mark.parametrize("N", [16, 40, 64, 100])
@pytest.mark.parametrize("kw", [{}, {"is_causal": True, "window": (50, 0)},
                                {"window": (70, 30)}], ids=["plain", "causal-window", "window"])
def test_pv16_does_not_depend_on_the_thread_count(pv16_mode, N, kw):
    """The int16 P.V of a row must not depend on how the rows were split
    into blocks (the block size follows the thread count).  It did: a
    block of one panel took float32 P.V (2e-3 at N 64), a last block of
    at most 4 rows the direct loops' float32 P.V (1.5e-4 at N 100), and
    under a window the key chunks started at the block's first key, so a
    tile's probability scales changed with the block size.  Bitwise the
    same at 1, 2 and 3 threads."""
    M = 600
    q, k, v = rand((1, 2, N, 64), 0), rand((1, 2, M, 64), 1), rand((1, 2, M, 40), 2)
    outs = [sd(q, k, v, precision="int8", num_threads=t, **kw) for t in (1, 2, 3)]
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])
    assert _cos_err(outs[0], sdpa_ref(q, k, v, **kw)) < 1e-4


def test_pv16_inputs_not_modified(pv16_mode):
    _check_inputs_not_modified()


def test_pv16_mode_choice_and_config(capsys):
    """The default takes vpdpwssd where the CPU has AVX-VNNI or
    AVX512_VNNI, else float32 P.V; each path's panel takes the native
    instruction only where the CPU has its own; bfloat16 P.V, where its
    products are on, comes first on the avx512 path; show_config says
    which; unknown modes are refused."""
    from attncore import _config
    prev, prev8, prevbf = (_sdpa.set_pv16_mode(None), _sdpa.set_int8_mode(None),
                           _sdpa.set_bf16_mode(None))
    try:
        vnni2 = _FEATS["avx_vnni"] and "avx2" in PATHS
        vnni512 = _FEATS["int8_dot"] and "avx512" in PATHS
        assert _sdpa.pv16_mode() == (3 if vnni2 or vnni512 else 0)
        with pytest.raises(ValueError, match="pv16 mode"):
            _sdpa.set_pv16_mode("fast")
        for path, i8, native in (("avx2", "avxvnni-emulate", _FEATS["avx_vnni"]),
                                 ("avx512", "emulate", _FEATS["int8_dot"])):
            if path not in PATHS:
                continue
            with _kernels.forced_kernel_path(path):
                _sdpa.set_int8_mode(i8)
                _sdpa.set_bf16_mode("off")
                for mode in ("emulate", "off") + (("native",) if vnni2 or vnni512 else ()):
                    _sdpa.set_pv16_mode(mode)
                    code = {"native": 3 if native else 0, "emulate": 4, "off": 0}[mode]
                    key = {3: "int16", 4: "int16-emulated", 0: "float32"}[code]
                    assert _config.config_dict()["int8_pv"] == key
                    assert attncore._call.modes(attncore._call.policy(
                        (np.float32,) * 3, ("q", "k", "v"), "int8"), 64).bf16dot == code
                    attncore.show_config()
                    assert _config._INT8_PV_LINES[key] in capsys.readouterr().out
                if path == "avx512":
                    _sdpa.set_bf16_mode("emulate")
                    _sdpa.set_pv16_mode("emulate")
                    md = attncore._call.modes(attncore._call.policy(
                        (np.float32,) * 3, ("q", "k", "v"), "int8"), 64)
                    assert md.bf16dot == 2
                    assert _config.config_dict()["int8_pv"] == "bfloat16"
    finally:
        _sdpa.set_pv16_mode(prev)
        _sdpa.set_int8_mode(prev8)
        _sdpa.set_bf16_mode(prevbf)


def test_huge_scale_warns_nothing(i8mode):
    """A scale whose row terms (scale q . mu) leave the float32 range: the
    float64 re-run answers, and NumPy's overflow warning does not reach the
    user."""
    import warnings
    q, k, v = (rand((1, 2, 40, 64), s) for s in range(3))
    k += 5.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = sd(q, k, v, scale=1e38, precision="int8")
    assert np.isfinite(out).all()


# ---------------------------------------------------------------------------
# the default mode's size rule: float keys quantized per call must repay it
# ---------------------------------------------------------------------------
def test_int8_pays_rule():
    """attncore._call.int8_pays, the documented rule: at least
    INT8_MIN_ROWS query and key rows, and INT8_MIN_WORK multiply-adds
    (N M (D + Dv) over the batch elements, half of it for a causal call),
    whatever the thread count."""
    from attncore import _call
    assert _call.INT8_MIN_ROWS == 128 and _call.INT8_MIN_WORK == 2 * 10 ** 8
    pays = _call.int8_pays
    assert not pays(1, 32768, 64, 64, 8)                 # a decoding step
    assert not pays(127, 4096, 64, 64, 8) and pays(128, 4096, 64, 64, 8)
    assert not pays(4096, 127, 64, 64, 8) and pays(4096, 128, 64, 64, 8)
    assert pays(512, 512, 64, 64, 8)                     # 2.7e8 multiply-adds
    assert not pays(512, 512, 64, 64, 8, causal=True)
    assert not pays(384, 384, 64, 64, 8) and pays(384, 384, 128, 128, 8)


def test_small_calls_take_float32_products():
    """Under the default int8 mode a call on float keys below the rule
    (too few query rows: decoding, a short prompt over a long context)
    takes float32 products -- the float32 call's bits --; a forced int8
    mode, and int8 keys given (quantize_kv: nothing to quantize), keep the
    int8 products at any size; a call above the rule takes them."""
    if not int8_in_use():
        pytest.skip("no int8 kernel on this CPU and path")
    prev = _sdpa.set_int8_mode(None)
    try:
        q, k, v = rand((1, 2, 16, 64), 0), rand((1, 2, 600, 64), 1), rand((1, 2, 600, 64), 2)
        for qq in (q, q[:, :, :1]):
            np.testing.assert_array_equal(sd(qq, k, v, precision="int8"), sd(qq, k, v))
        out32 = sd(q, k, v)
        # (a forced mode after a call of the same operands: the cached
        # description of the plain call must not carry the rule over)
        with int8_forced():
            out8 = sd(q, k, v, precision="int8")
        assert 1e-9 < _cos_err(out8, out32) < 1e-4
        np.testing.assert_array_equal(sd(q, k, v, precision="int8"), out32)
        k8, v8 = attncore.quantize_kv(k), attncore.quantize_kv(v)
        assert 1e-9 < _cos_err(sd(q, k8, v8, precision="int8"), sd(q, k8, v8)) < 1e-4
        q, k, v = (rand((1, 8, 512, 64), s) for s in range(3))
        outs = [sd(q, k, v, precision="int8", num_threads=t) for t in (1, 2, 3)]
        assert 1e-9 < _cos_err(outs[0], sd(q, k, v)) < 1e-4
        for o in outs[1:]:          # (the rule leaves the thread count out)
            np.testing.assert_array_equal(o, outs[0])
        # a grouped-query decoding step takes the float32 call's route too
        q, k, v = rand((1, 8, 1, 64), 3), rand((1, 2, 3000, 64), 4), rand((1, 2, 3000, 64), 5)
        np.testing.assert_array_equal(sd(q, k, v, precision="int8", enable_gqa=True),
                                      sd(q, k, v, enable_gqa=True))
    finally:
        _sdpa.set_int8_mode(prev)
