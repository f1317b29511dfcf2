"""bfloat16 and float16 operands read in place (issue: half precision as
first-class dtypes).

Every result is compared with a float64 NumPy reference computed from the
*rounded* inputs (the half values as they are), and the error is held
against the error of torch's own SDPA on the same half-precision inputs.
"""
import os
import tracemalloc

import numpy as np
import pytest

import attncore
from attncore._core import _sdpa
from reference import FORCED_PATH, rand, sdpa_ref


ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
HALF = [pytest.param(BF16, id="bf16"), pytest.param(F16, id="f16")]
PATHS = list(_sdpa.available_kernel_paths())

sd = attncore.scaled_dot_product_attention


# kernel paths, and on AVX-512 the bfloat16 dot products: "off" (float32
# products), "emulate" (the bf16 kernels with vdpbf16ps spelled in
# AVX-512F: every line of that path but the instruction), "native" where
# the CPU has AVX512_BF16
BF16_MODES = (["emulate"] if "avx512" in PATHS else []) + \
    (["native"] if _sdpa.cpu_features()["bf16_dot"] else [])
PATH_MODES = [(p, "off") for p in PATHS] + [("avx512", m) for m in BF16_MODES]


@pytest.fixture(params=PATH_MODES, ids=lambda pm: f"{pm[0]}-{pm[1]}")
def path(request):
    """Each kernel path, and the avx512 path's bfloat16 product modes
    (ATTNCORE_TEST_KERNEL_PATH: that path alone, as conftest's fixture)."""
    p, mode = request.param
    if FORCED_PATH and p != FORCED_PATH:
        pytest.skip(f"ATTNCORE_TEST_KERNEL_PATH={FORCED_PATH}")
    prev = _sdpa.set_kernel_path(p)
    prev_mode = _sdpa.set_bf16_mode(mode)
    yield p
    _sdpa.set_kernel_path(prev)
    _sdpa.set_bf16_mode(None)
    del prev_mode


def _f64(*xs):
    return [np.asarray(x).astype(np.float64) for x in xs]


def _torch_err(q, k, v, dt, ref, **kw):
    """max |error| of torch's SDPA on the same half inputs, vs ref."""
    torch = pytest.importorskip("torch")
    tdt = torch.bfloat16 if dt == BF16 else torch.float16
    tq, tk, tv = (torch.from_numpy(np.asarray(x).astype(np.float32)).to(tdt) for x in (q, k, v))
    o = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, **kw)
    return np.abs(o.float().numpy().astype(np.float64) - ref).max()


# shapes of the kernel-path tests: decode (direct loops), a few rows,
# fused panels with tails, D / Dv not multiples of the vector width
SHAPES = [
    (1, 2, 1, 300, 64, 64),
    (2, 2, 3, 129, 40, 24),
    (1, 2, 70, 300, 64, 64),
    (1, 1, 37, 200, 19, 33),
    (2, 3, 33, 65, 128, 128),
]


@pytest.mark.parametrize("dt", HALF)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("causal", [False, "lower_right", True])
def test_half_matches_reference_of_rounded_inputs(path, dt, shape, causal):
    B, H, N, M, D, Dv = shape
    rng = np.random.default_rng(hash(shape) % 2**32)
    q, k, v = (rand(s, rng).astype(dt) for s in ((B, H, N, D), (B, H, M, D), (B, H, M, Dv)))
    out, lse = sd(q, k, v, is_causal=causal, return_lse=True)
    assert out.dtype == dt and out.shape == (B, H, N, Dv)
    assert lse.dtype == np.float32
    rout, rlse = sdpa_ref(*_f64(q, k, v), is_causal=causal, return_lse=True)
    err = np.abs(out.astype(np.float64) - rout).max()
    # the output rounding alone is half an ulp of the result's dtype
    ulp = 2.0 ** -8 if dt == BF16 else 2.0 ** -11
    assert err <= 1.01 * ulp * np.abs(rout).max() + 1e-6
    fin = np.isfinite(rlse)
    np.testing.assert_allclose(lse[fin], rlse[fin], rtol=2e-5, atol=2e-5)
    if causal is not True:
        terr = _torch_err(q, k, v, dt, rout, is_causal=False) if not causal else None
        if terr is not None:
            assert err <= 1.5 * terr + 1e-7


@pytest.mark.parametrize("dt", HALF)
def test_half_masks_window_softcap_gqa(path, dt):
    rng = np.random.default_rng(1)
    B, Hq, Hk, N, M, D = 2, 4, 2, 40, 150, 32
    q, k, v = (rand(s, rng).astype(dt) for s in ((B, Hq, N, D), (B, Hk, M, D), (B, Hk, M, D)))
    bmask = rng.random((B, 1, N, M)) > 0.3
    fmask = np.where(rng.random((B, 1, 1, M)) > 0.2, rng.standard_normal((B, 1, 1, M)), -np.inf)
    kr, vr = np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1)
    for kw in (dict(attn_mask=bmask), dict(attn_mask=fmask.astype(np.float32)),
               dict(attn_mask=fmask.astype(dt)), dict(window=(7, 3)),
               dict(is_causal=True, window=(20, -1)), dict(softcap=5.0, is_causal="lower_right")):
        out = sd(q, k, v, enable_gqa=True, **kw)
        assert out.dtype == dt
        ref_kw = dict(kw)
        if "attn_mask" in ref_kw:
            ref_kw["attn_mask"] = np.asarray(ref_kw["attn_mask"]).astype(
                bool if ref_kw["attn_mask"].dtype == bool else np.float64)
        rout = sdpa_ref(*_f64(q, kr, vr), **ref_kw)
        ulp = 2.0 ** -8 if dt == BF16 else 2.0 ** -11
        np.testing.assert_allclose(out.astype(np.float64), rout, atol=1.01 * ulp * 4 + 1e-5, rtol=0)


@pytest.mark.parametrize("dt", HALF)
@pytest.mark.parametrize("nthreads", [1, 2])
def test_half_long_rows_and_key_splits(dt, nthreads):
    """M = 32768: float32 accumulation over a long row, split over threads."""
    rng = np.random.default_rng(2)
    q, k, v = rand((1, 2, 1, 64), rng).astype(dt), rand((1, 2, 32768, 64), rng).astype(dt), \
        rand((1, 2, 32768, 64), rng).astype(dt)
    out = sd(q, k, v, num_threads=nthreads)
    rout = sdpa_ref(*_f64(q, k, v))
    err = np.abs(out.astype(np.float64) - rout).max()
    assert err <= 1.5 * _torch_err(q, k, v, dt, rout) + 1e-7


@pytest.mark.parametrize("D,Dv", [(8, 8), (16, 48), (24, 32), (40, 136), (64, 64),
                                  (128, 128), (136, 200), (256, 16), (520, 40), (600, 256)])
@pytest.mark.parametrize("N", [1, 2, 3, 5])
@pytest.mark.parametrize("dt", HALF)
def test_half_values_with_float32_queries_in_the_decode_loops(path, dt, D, Dv, N):
    """The loops of a few query rows read 16-bit keys / values in place
    (bfloat16 by pairs of vectors, the query rows and the P.V accumulators
    held as even / odd columns): a float32 query gives a float32 result,
    held to float32 rounding against float64 of the rounded inputs.  700
    keys: more than one key tile (the accumulators leave and re-enter the
    column order); strided key rows; grouped-query rows (a group of N
    rows per key head)."""
    rng = np.random.default_rng(D * 1000 + Dv + N)
    B, Hk, M = 1, 2, 700
    q = rand((B, 2 * Hk, N, D), rng)
    kw = rand((B, Hk, M, D + 8), rng).astype(dt)
    k = kw[..., 3:D + 3]                       # rows D + 8 elements apart, odd offset
    v = rand((B, Hk, M, Dv), rng).astype(dt)
    q0, k0, v0 = q.copy(), k.copy(), v.copy()
    out = sd(q, k, v, enable_gqa=True, num_threads=1)
    assert out.dtype == np.float32
    kr, vr = np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1)
    rout = sdpa_ref(*_f64(q, kr, vr))
    np.testing.assert_allclose(out, rout, rtol=2e-5, atol=2e-6)
    for a, a0 in ((q, q0), (k, k0), (v, v0)):
        assert np.array_equal(a.view(np.uint8), a0.view(np.uint8))


@pytest.mark.parametrize("dt", HALF)
def test_non_native_byte_order_half_operands(path, dt):
    """16-bit operands of the other byte order (a file's big-endian data,
    say) are read as the values they hold: the result of the native
    operands, through every entry point that takes 16-bit arrays (an
    adversarial run found bfloat16 ones read as swapped bits: a silent
    wrong answer)."""
    rng = np.random.default_rng(8)
    q, k, v = (rand(s, rng).astype(dt) for s in ((1, 2, 3, 64), (1, 2, 300, 64),
                                                 (1, 2, 300, 64)))
    sw = [a.astype(a.dtype.newbyteorder(">" if a.dtype.isnative and np.little_endian
                                        else "<")) for a in (q, k, v)]
    assert not any(a.dtype.isnative for a in sw)
    want = sd(q, k, v, is_causal="lower_right")
    for i in range(4):   # one operand swapped at a time, then all
        ops = [sw[j] if i in (j, 3) else a for j, a in enumerate((q, k, v))]
        for _ in range(2):   # the second call of the same metadata too
            out = sd(*ops, is_causal="lower_right")
            np.testing.assert_array_equal(out.astype(np.float32), want.astype(np.float32))
    q32 = q.astype(np.float32)
    np.testing.assert_array_equal(sd(q32, sw[1], sw[2]), sd(q32, k, v))
    # packed sequences (varlen_attention: the paged kernel's operands)
    cu = np.array([0, 120, 300], np.int32)
    qp, kp, vp = (rand((300, 2, 64), rng).astype(dt) for _ in range(3))
    swp = [a.astype(sw[0].dtype) for a in (qp, kp, vp)]
    np.testing.assert_array_equal(
        attncore.varlen_attention(*swp, cu, cu, is_causal=True).astype(np.float32),
        attncore.varlen_attention(qp, kp, vp, cu, cu, is_causal=True).astype(np.float32))


@pytest.mark.parametrize("dt", HALF)
def test_half_agrees_across_paths_and_threads(dt):
    rng = np.random.default_rng(3)
    q, k, v = rand((2, 3, 50, 48), rng).astype(dt), rand((2, 3, 700, 48), rng).astype(dt), \
        rand((2, 3, 700, 48), rng).astype(dt)
    outs = []
    for p in PATHS:
        prev = _sdpa.set_kernel_path(p)
        try:
            for t in (1, 2):
                outs.append(sd(q, k, v, is_causal=True, num_threads=t).astype(np.float32))
        finally:
            _sdpa.set_kernel_path(prev)
    for o in outs[1:]:
        np.testing.assert_allclose(o, outs[0], atol=2e-2, rtol=0)


def test_float16_with_float32_and_float64_promotes():
    rng = np.random.default_rng(4)
    q16 = rand((2, 5, 16), rng).astype(F16)
    k32 = rng.standard_normal((2, 9, 16), dtype=np.float32)
    v64 = rng.standard_normal((2, 9, 16))
    assert sd(q16, k32, k32).dtype == np.float32
    out = sd(q16, k32, v64)
    assert out.dtype == np.float64
    np.testing.assert_allclose(out, sdpa_ref(*_f64(q16, k32, v64)), atol=1e-12)
    qb = q16.astype(BF16)
    assert sd(qb, k32, k32).dtype == np.float32
    np.testing.assert_allclose(sd(qb, k32, k32), sdpa_ref(*_f64(qb, k32, k32)), atol=1e-5)


def test_bfloat16_with_float16_is_a_clear_error():
    q = np.zeros((3, 4), BF16)
    k = np.zeros((3, 4), F16)
    with pytest.raises(TypeError, match="bfloat16 and float16 .*query bfloat16, key float16"):
        sd(q, k, k)


@pytest.mark.parametrize("mode", BF16_MODES)
@pytest.mark.parametrize("offset", [0.0, 10.0])
def test_precision_bfloat16_on_float32_inputs(mode, offset):
    """float32 inputs with precision="bfloat16" on the bf16 kernels: the
    error of bf16-rounded Q, K, P and V with float32 accumulation, held to
    torch's bf16 SDPA on the same values rounded to bfloat16 (keys with
    per-channel offsets too: real models' keys have them)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(11)
    q = rng.standard_normal((1, 2, 256, 64), dtype=np.float32)
    k = rng.standard_normal((1, 2, 384, 64), dtype=np.float32)
    k += (rng.standard_normal(64) * offset).astype(np.float32)
    v = rng.standard_normal((1, 2, 384, 64), dtype=np.float32)
    prev_path = _sdpa.set_kernel_path("avx512")
    _sdpa.set_bf16_mode(mode)
    try:
        out = sd(q, k, v, precision="bfloat16")
        ref32 = sd(q, k, v, precision="float32")
    finally:
        _sdpa.set_bf16_mode(None)
        _sdpa.set_kernel_path(prev_path)
    rout = sdpa_ref(*_f64(q, k, v))
    tt = [torch.from_numpy(x).to(torch.bfloat16) for x in (q, k, v)]
    tor = torch.nn.functional.scaled_dot_product_attention(*tt).double().numpy()
    err, terr = np.abs(out - rout).max(), np.abs(tor - rout).max()
    assert err <= 1.5 * terr
    assert np.abs(ref32 - rout).max() < 1e-5 < err   # the products really were bf16


def test_precision_argument():
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((2, 7, 8), dtype=np.float32) for _ in range(3))
    r = sdpa_ref(*_f64(q, k, v))
    for p in (None, "float32", "bfloat16"):
        np.testing.assert_allclose(sd(q, k, v, precision=p), r, atol=2e-2 if p == "bfloat16" else 2e-6)
    with pytest.raises(ValueError, match="precision must be None, 'float32', 'bfloat16' or 'int8', got 'fp8'"):
        sd(q, k, v, precision="fp8")
    with pytest.raises(TypeError, match="precision must be None"):
        sd(q, k, v, precision=16)
    with pytest.raises(TypeError, match="precision must be None"):   # (not compared by value)
        sd(q, k, v, precision=np.array(["int8", "int8"]))
    with pytest.raises(ValueError, match="'int8' is for float32, float16 and bfloat16"):
        sd(q.astype(np.float64), k, v, precision="int8")
    q64 = q.astype(np.float64)
    with pytest.raises(ValueError, match="precision='bfloat16' is for float32, float16 and bfloat16"):
        sd(q64, q64, q64, precision="bfloat16")
    np.testing.assert_allclose(sd(q64, q64, q64), sdpa_ref(*_f64(q, q, q)), atol=1e-12)


@pytest.mark.parametrize("dt", HALF)
def test_return_weights_with_half_inputs(dt):
    rng = np.random.default_rng(6)
    q, k, v = rand((2, 6, 8), rng).astype(dt), rand((2, 9, 8), rng).astype(dt), rand((2, 9, 8), rng).astype(dt)
    out, w, lse = sd(q, k, v, return_weights=True, return_lse=True)
    rout, rw, rlse = sdpa_ref(*_f64(q, k, v), return_weights=True, return_lse=True)
    assert out.dtype == dt and w.dtype == dt and lse.dtype == np.float32
    np.testing.assert_allclose(w.astype(np.float64), rw, atol=1e-2)
    np.testing.assert_allclose(lse, rlse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dt", HALF)
def test_inputs_not_modified_and_no_float32_copy(dt):
    """Peak memory of a decode over a long half cache stays far below one
    float32 copy of K (tracemalloc sees NumPy's allocations)."""
    rng = np.random.default_rng(7)
    M, D = 1 << 17, 64
    q, k, v = rand((1, 2, 1, D), rng).astype(dt), rand((1, 2, M, D), rng).astype(dt), rand((1, 2, M, D), rng).astype(dt)
    k0, v0 = k.copy(), v.copy()
    tracemalloc.start()
    sd(q, k, v)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    f32_copy = 2 * M * D * 4
    assert peak < f32_copy / 8, (peak, f32_copy)
    assert np.array_equal(k.view(np.uint16), k0.view(np.uint16))
    assert np.array_equal(v.view(np.uint16), v0.view(np.uint16))


def test_torch_bf16_and_f16_in_place_same_type_out():
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(0)
    for tdt in (torch.bfloat16, torch.float16):
        q, k, v = (torch.randn(1, 4, 40, 32, generator=g).to(tdt) for _ in range(3))
        q.requires_grad_(False)
        out, lse = sd(q, k, v, is_causal=True, return_lse=np.True_)
        assert isinstance(out, torch.Tensor) and out.dtype is tdt
        assert lse.dtype is torch.float32
        ref = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                                               is_causal=True)
        tor = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        err = (out.double() - ref).abs().max().item()
        assert err <= 1.5 * (tor.double() - ref).abs().max().item() + 1e-7


def test_torch_bf16_non_contiguous_and_gqa():
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 30, 8, 16, generator=g).to(torch.bfloat16).transpose(1, 2)  # (B, H, L, D) view
    k = torch.randn(2, 50, 2, 16, generator=g).to(torch.bfloat16).transpose(1, 2)
    v = torch.randn(2, 50, 2, 16, generator=g).to(torch.bfloat16).transpose(1, 2)
    out = sd(q, k, v, enable_gqa=True)
    ref = sdpa_ref(*_f64(q.float().numpy(), np.repeat(k.float().numpy(), 4, 1),
                         np.repeat(v.float().numpy(), 4, 1)))
    np.testing.assert_allclose(out.float().numpy(), ref, atol=2 ** -8 * 4)


def test_jax_bf16():
    jnp = pytest.importorskip("jax.numpy")
    rng = np.random.default_rng(8)
    q = rand((2, 10, 16), rng).astype(BF16)
    out = sd(jnp.asarray(q), jnp.asarray(q), jnp.asarray(q))
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(out).astype(np.float64), sdpa_ref(*_f64(q, q, q)),
                               atol=2 ** -8 * 4)


def test_half_int8_values_mix():
    rng = np.random.default_rng(9)
    q, k = rand((2, 12, 16), rng).astype(BF16), rand((2, 40, 16), rng).astype(BF16)
    v = rng.standard_normal((2, 40, 8)).astype(np.float32)
    v8, vs = attncore.quantize_kv(v)
    out = sd(q, k, (v8, vs))
    assert out.dtype == BF16
    rv = v8.astype(np.float64) * vs[..., None]
    np.testing.assert_allclose(out.astype(np.float64), sdpa_ref(*_f64(q, k, rv)), atol=2e-2)


def test_nonfinite_values_of_unattended_keys_never_leak(path):
    """inf / NaN in the values (and keys) of keys a query does not attend
    stay out of its output on every path, the bf16 kernels included (their
    key pairs span a masked neighbour)."""
    rng = np.random.default_rng(12)
    q = rng.standard_normal((1, 1, 70, 32)).astype(np.float32)
    k = rng.standard_normal((1, 1, 200, 32)).astype(np.float32)
    v = rng.standard_normal((1, 1, 200, 16)).astype(np.float32)
    mask = np.ones((70, 200), bool)
    bad = [0, 5, 77, 128, 199]
    mask[:, bad] = False
    v[..., bad, :] = np.inf
    v[..., 77, 3] = np.nan
    k[..., 128, :] = np.nan
    for prec in (None, "bfloat16"):
        for x in (np.float32, BF16):
            out = sd(q.astype(x), k.astype(x), v.astype(x), mask, precision=prec)
            assert np.isfinite(np.asarray(out, np.float32)).all()
            keep = np.ones(200, bool)
            keep[bad] = False
            r = sdpa_ref(*_f64(q.astype(x), k.astype(x)[..., keep, :], v.astype(x)[..., keep, :]))
            np.testing.assert_allclose(np.asarray(out, np.float64), r, atol=2e-2)


@pytest.mark.parametrize("causal", [False, True])
def test_tall_query_blocks_of_packed_tiles(path, causal):
    """Long prefill with bfloat16 products and int8 Q.K^T: the planner takes
    query blocks of up to 32 panels there (the pair-packed key / value
    tiles serve every panel of a block); the results still match the
    float64 reference (of the rounded inputs), rows past a block included."""
    N, M, D = 1100, 1300, 72
    q, k, v = (rand((1, 2, n, D), s) for s, n in ((0, N), (1, M), (2, M)))
    qb, kb, vb = (x.astype(BF16) for x in (q, k, v))
    ref = sdpa_ref(*_f64(qb, kb, vb), is_causal=causal)
    out = sd(qb, kb, vb, is_causal=causal, num_threads=2)
    assert np.abs(out.astype(np.float64) - ref).max() <= 1.5 * _torch_err(
        qb, kb, vb, BF16, ref, is_causal=causal) + 1e-3
    o8 = sd(q, k, v, is_causal=causal, precision="int8", num_threads=2).astype(np.float64)
    r32 = sdpa_ref(q, k, v, is_causal=causal)
    assert 1 - (o8 * r32).sum() / np.linalg.norm(o8) / np.linalg.norm(r32) < 1e-4


def _cpuinfo_vendor_and_flags():
    """(vendor_id, flags) of the first CPU in /proc/cpuinfo, or None."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return None
    vendor = next((ln.split(":", 1)[1].strip() for ln in text.splitlines()
                   if ln.startswith("vendor_id")), None)
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines()
                  if ln.startswith("flags")), None)
    return None if vendor is None or flags is None else (vendor, set(flags))


def test_bf16_products_default_follows_the_cpu():
    """bfloat16 dot products are the default only where the CPU has
    AVX512_BF16 and is an AMD core (Intel's vdpbf16ps issues at half the
    rate of its float32 FMAs), read from /proc/cpuinfo; show_config says
    which products bfloat16 inputs get (on the avx512 path only), and a
    forced mode is undone by set_bf16_mode(None)."""
    from attncore import _config

    info = _cpuinfo_vendor_and_flags()
    if info is None:
        pytest.skip("no /proc/cpuinfo")
    vendor, flags = info
    # (less the features ATTNCORE_CPU_FEATURES takes away)
    flags -= set(os.environ.get("ATTNCORE_CPU_FEATURES", "").replace("-", "").split(","))
    if _sdpa.cpu_features()["best_path"] == "portable" and "avx2" in flags:
        pytest.skip("built without the x86 kernels (AC_NO_X86_KERNELS)")
    # (vdpbf16ps runs on the avx512 path: AVX-512 F / BW / VL / DQ)
    has = {"avx512_bf16", "avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags
    assert _sdpa.cpu_features()["bf16_dot"] == has
    fast = has and vendor == "AuthenticAMD"
    assert _sdpa.cpu_features()["bf16_dot_fast"] == fast
    prev = _sdpa.set_bf16_mode(None)
    try:
        assert _sdpa.bf16_mode() == (1 if fast else 0)
        on512 = _sdpa.kernel_path() == "avx512"  # (a forced avx2 / portable session)
        lines = _config._BF16_LINES[
            "float32" if not has else "float32-path" if not on512
            else "bfloat16" if fast else "float32-slow"]
        assert _config.config_dict()["bf16_products"] == (
            "bfloat16" if fast and on512 else "float32")
        import io
        import contextlib
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            attncore.show_config()
        assert all(line in buf.getvalue() for line in lines)
        if has:  # forcing the instruction on such a CPU, off, and back
            _sdpa.set_bf16_mode("native")
            assert _config.config_dict()["bf16_products"] == ("bfloat16" if on512 else "float32")
            prev_path = _sdpa.set_kernel_path("avx2")  # bf16 products: avx512 only
            try:
                assert _config.config_dict()["bf16_products"] == "float32"
                assert _config._bf16_line(_config.config_dict()) == "float32-path"
            finally:
                _sdpa.set_kernel_path(prev_path)
            _sdpa.set_bf16_mode("off")
            assert _config._bf16_line(_config.config_dict()) == (
                "float32-path" if not on512 else "float32-forced" if fast else "float32-slow")
            _sdpa.set_bf16_mode(None)
            assert _sdpa.bf16_mode() == (1 if fast else 0)
    finally:
        _sdpa.set_bf16_mode(prev)


@pytest.mark.parametrize("N", [1, 40, 64, 100])
@pytest.mark.parametrize("kw", [{"is_causal": True}, {"window": (20, 0)},
                                {"window": (100, 100)}], ids=["causal", "window", "window2"])
def test_bf16_products_do_not_depend_on_the_thread_count(path, N, kw):
    """A call's products (bfloat16 pairs or float32) must not depend on
    how its rows were split into blocks: a block of one panel took float32
    products where larger blocks took the bfloat16 ones, so 3 threads gave
    another result than 1 (1e-2 at N 64 for float32 inputs), and under a
    window the key chunks started at the block's first key (1.6e-3).  At
    1, 2 and 3 threads the same to float32 rounding (float32 inputs; the portable
    path's BLAS tiles sum in another order per block size) or one
    bfloat16 rounding of the output (bfloat16 inputs), and near
    float64."""
    rng = np.random.default_rng(N)
    q = rng.standard_normal((1, 4, N, 64)).astype(np.float32)
    k, v = (rng.standard_normal((1, 4, 385, 64)).astype(np.float32) for _ in range(2))
    ref = sdpa_ref(*_f64(q, k, v), **kw)
    for x, tol in (((q, k, v), 1e-5), (tuple(a.astype(BF16) for a in (q, k, v)), 2.0 ** -7)):
        outs = [np.asarray(sd(*x, precision="bfloat16", num_threads=t, **kw), np.float32)
                for t in (1, 2, 3)]
        for o in outs[1:]:
            np.testing.assert_allclose(o, outs[0], rtol=tol, atol=1e-6)
        assert np.abs(outs[0] - ref).max() < 0.05
