"""Every float32 kernel path (AVX-512, AVX2 + FMA, portable BLAS) against the
float64 reference: odd tile remainders, every mask kind and causal
alignment, GQA, strided inputs, the NaN / inf rules, threads, and the dense
layer kernel.  Paths the CPU lacks are skipped, so an AVX-512 machine tests
all three."""
import os
import threading

import numpy as np
import pytest

import attncore
from attncore import scaled_dot_product_attention as sdpa
from attncore import _call, _kernels
from attncore._core import _sdpa
from attncore._linear import linear

from reference import attention as ref
from reference import make_mask, rand

TOL32 = dict(rtol=3e-5, atol=3e-6)


def check(q, k, v, mask=None, causal=0, group=1, scale=None, **kw):
    causal_arg = {0: False, 1: True, 2: "lower_right"}[causal]
    out = attncore.scaled_dot_product_attention(q, k, v, mask, is_causal=causal_arg, scale=scale,
                                                enable_gqa=group > 1, **kw)
    expected = ref(q, k, v, mask, causal=causal, scale=scale, group=group)[0]
    np.testing.assert_allclose(out, expected, **TOL32)
    return out


def test_switch_reports_and_restores():
    best = _kernels.kernel_path()
    forced = os.environ.get("ATTNCORE_TEST_KERNEL_PATH")  # tests/conftest.py
    assert best == (forced or _kernels.available_kernel_paths()[-1])
    with _kernels.forced_kernel_path("portable"):
        assert _kernels.kernel_path() == "portable"
        assert _sdpa.cpu_features()["kernel_path"] == "portable"
    assert _kernels.kernel_path() == best
    with pytest.raises(ValueError, match="kernel path"):
        _kernels.set_kernel_path("sse9")


# ------------------------------------------------------------ tile remainders
@pytest.mark.parametrize("N,M", [(5, 1), (5, 7), (17, 129), (31, 255), (33, 257), (64, 128),
                                 (65, 300), (97, 1), (130, 513)])
@pytest.mark.parametrize("D,Dv", [(1, 1), (3, 9), (16, 7), (64, 64), (100, 33), (129, 17)])
def test_remainders(path, N, M, D, Dv):
    q, k, v = rand((2, N, D), 1), rand((2, M, D), 2), rand((2, M, Dv), 3)
    check(q, k, v)


@pytest.mark.parametrize("Dv", [8, 16, 20, 64])
def test_micro_tile_sequences(path, Dv):
    """Every split of a panel's rows into P.V micro-tiles (AVX2: 6 + 6 + 4,
    6 + 4, 6 + 2 + 1, ...; the 8-row panel 4 + 4) and of a key tile into
    score micro-tiles (6 + 2 keys run as 4 + 4, remainders 4 / 2 / 1), in
    one key tile and over several."""
    for N in (4, 6, 7, 10, 11, 12, 13, 14, 15, 16, 22, 24, 28, 30, 40, 48):
        for M in list(range(1, 15)) + [20, 50, 128, 134, 260]:
            q, k, v = rand((1, N, 24), N), rand((1, M, 24), M + 1), rand((1, M, Dv), M + 2)
            check(q, k, v)


@pytest.mark.parametrize("D", [1, 2, 7, 8, 15, 31, 63, 127, 200, 255, 256, 257, 383, 511, 512])
def test_every_head_size_exact(path, D):
    q, k, v = rand((1, 2, 37, D), 4), rand((1, 2, 45, D), 5), rand((1, 2, 45, 512 + 1 - D), 6)
    check(q, k, v)


# ------------------------------------------------------------ few query rows
@pytest.mark.parametrize("N", [1, 2, 3, 4])
@pytest.mark.parametrize("Dv", [8, 24, 56, 64, 72, 96, 120, 128, 136, 200, 256, 264])
@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "float16", "int8"])
def test_few_rows_value_chunks(path, N, Dv, fmt):
    """The direct loops of 1-4 query rows (decoding): P.V in register
    chunks of columns whose width depends on the rows and the path (whole
    chunks, halves, quarters, a masked tail), each key / value format read
    in place, over one key tile and several; float64 reference of the
    rounded operands."""
    rng = np.random.default_rng(N * 1000 + Dv)
    q = rng.standard_normal((2, 1, N, 40)).astype(np.float32)
    k = rng.standard_normal((2, 1, 700, 40)).astype(np.float32)
    v = rng.standard_normal((2, 1, 700, Dv)).astype(np.float32)
    if fmt == "int8":
        kq, vq = attncore.quantize_kv(k), attncore.quantize_kv(v)
        kd, vd = (a[0] * a[1][..., None].astype(np.float64) for a in (kq, vq))
    elif fmt == "bfloat16":
        bf = pytest.importorskip("ml_dtypes").bfloat16
        kq, vq = k.astype(bf), v.astype(bf)
        kd, vd = kq.astype(np.float64), vq.astype(np.float64)
        q = q.astype(bf)
    else:
        kq, vq = k.astype(fmt), v.astype(fmt)
        kd, vd = kq.astype(np.float64), vq.astype(np.float64)
        q = q.astype(fmt)
    def first(x, M):  # the first M keys (both halves of an int8 pair)
        return (x[0][..., :M, :], x[1][..., :M]) if isinstance(x, tuple) else x[..., :M, :]

    for M in (1, 13, 700):
        out = sdpa(q, first(kq, M), first(vq, M))
        want = ref(q.astype(np.float64), kd[..., :M, :], vd[..., :M, :])[0]
        tol = TOL32 if fmt in ("float32", "int8") else dict(rtol=1e-2, atol=1e-2)
        np.testing.assert_allclose(out.astype(np.float64), want, **tol)


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8"])
def test_prefetch_hints_change_no_result(path, fmt):
    """The decode loops' rows prefetched into L1 or L2 (set_prefetch_l2_rows:
    rows of 64 / 256 bytes or more, or none) give the same output, bit for
    bit, and the float64 reference's; one and several query rows, rows of
    64 to 1024 bytes, a stride of 2 KiB; the setting is restored and a
    negative one refused."""
    rng = np.random.default_rng(11)
    if fmt == "bfloat16":
        bf = pytest.importorskip("ml_dtypes").bfloat16
    for N, D, stride in ((1, 64, 64), (1, 256, 256), (3, 128, 128), (1, 128, 512)):
        q = rng.standard_normal((2, 2, N, D)).astype(np.float32)
        kk = rng.standard_normal((2, 2, 600, stride)).astype(np.float32)[..., :D]
        vv = rng.standard_normal((2, 2, 600, stride)).astype(np.float32)[..., :D]
        if fmt == "int8":
            kq, vq = attncore.quantize_kv(kk), attncore.quantize_kv(vv)
            kd, vd = (a[0] * a[1][..., None].astype(np.float64) for a in (kq, vq))
        elif fmt == "bfloat16":
            kq, vq = kk.astype(bf), vv.astype(bf)
            kd, vd = kq.astype(np.float64), vq.astype(np.float64)
        else:
            kq, vq, kd, vd = kk, vv, kk.astype(np.float64), vv.astype(np.float64)
        outs = []
        before = _sdpa.set_prefetch_l2_rows(0)
        try:
            for nbytes in (0, 64, 256, 0):
                assert _sdpa.set_prefetch_l2_rows(nbytes) in (0, 64, 256)
                outs.append(sdpa(q, kq, vq, num_threads=2))
        finally:
            assert _sdpa.set_prefetch_l2_rows(before) == 0
        assert _sdpa.cpu_features()["prefetch_l2_rows"] == before
        for o in outs[1:]:
            np.testing.assert_array_equal(o, outs[0])
        tol = TOL32 if fmt != "bfloat16" else dict(rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(outs[0], ref(q.astype(np.float64), kd, vd)[0], **tol)
    with pytest.raises(ValueError, match="nbytes must be >= 0, got -1"):
        _sdpa.set_prefetch_l2_rows(-1)
    assert _sdpa.cpu_features()["prefetch_l2_rows"] == before


# ------------------------------------------------------------ masks and causal
MASKS = ["none", "bool_full", "bool_keypad", "bool_rows", "float_full", "float_keypad",
         "float_row_broadcast", "neg_inf_stretches"]


@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("causal", [0, 1, 2])
@pytest.mark.parametrize("N,M", [(70, 300), (300, 70), (129, 129)])
def test_masks_and_causal(path, mask_kind, causal, N, M):
    B, H, D = 2, 2, 24
    q, k, v = rand((B, H, N, D), 1), rand((B, H, M, D), 2), rand((B, H, M, D), 3)
    out = check(q, k, v, make_mask(mask_kind, B, H, N, M, dtype=np.float32), causal)
    assert np.all(np.isfinite(out))


@pytest.mark.parametrize("Hk", [1, 2, 4])
def test_gqa(path, Hk):
    q, k, v = rand((2, 8, 50, 32), 1), rand((2, Hk, 90, 32), 2), rand((2, Hk, 90, 16), 3)
    check(q, k, v, group=8 // Hk)


def test_strided_inputs(path):
    base = rand((2, 200, 3, 40), 1)                    # (B, L, H, D) rows, stride 120
    q = base.transpose(0, 2, 1, 3)[..., :33]
    k = rand((2, 3, 300, 66), 2)[:, :, ::2, 1::2]      # row stride 132, column step 2
    v = rand((2, 3, 150, 20), 3)[:, :, ::-1]           # negative row stride
    check(q, k, v, scale=0.2)


def test_float16(path):
    q, k, v = (rand((2, 3, 70, 32), s, np.float16) for s in (1, 2, 3))
    out = attncore.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.dtype == np.float16
    np.testing.assert_allclose(out.astype(np.float64), ref(q, k, v, causal=1)[0],
                               rtol=2e-3, atol=2e-3)


# ------------------------------------------------------------ NaN / inf rules
def test_nan_in_attended_query_propagates(path):
    q, k, v = rand((1, 40, 16), 1), rand((1, 300, 16), 2), rand((1, 300, 16), 3)
    q[0, 7, 3] = np.nan
    out = attncore.scaled_dot_product_attention(q, k, v)
    assert np.all(np.isnan(out[0, 7]))
    others = np.delete(out[0], 7, axis=0)
    np.testing.assert_allclose(others, np.delete(ref(q, k, v)[0][0], 7, axis=0), **TOL32)


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("causal", [0, 1])
def test_nonfinite_in_unattended_keys_and_values_never_leak(path, bad, causal):
    N, M = 64, 300
    q, k, v = rand((1, N, 16), 1), rand((1, M, 16), 2), rand((1, M, 16), 3)
    mask = np.ones((1, 1, M), bool)
    mask[..., 200:260] = False
    k[0, 210] = bad
    v[0, 220] = bad
    if causal:
        v[0, N + 5] = bad   # beyond every query's diagonal
        k[0, N + 9] = bad
    out = attncore.scaled_dot_product_attention(q, k, v, mask, is_causal=bool(causal))
    assert np.all(np.isfinite(out))
    clean_k, clean_v = k.copy(), v.copy()
    clean_k[~np.isfinite(clean_k)] = 0
    clean_v[~np.isfinite(clean_v)] = 0
    np.testing.assert_allclose(out, ref(q, clean_k, clean_v, mask, causal=causal)[0], **TOL32)


def test_nan_in_attended_value_propagates_only_to_its_queries(path):
    N, M = 40, 100
    q, k, v = rand((1, N, 8), 1), rand((1, M, 8), 2), rand((1, M, 8), 3)
    v[0, 30, 2] = np.nan
    out = attncore.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert np.all(np.isnan(out[0, 30:, 2]))          # queries that attend key 30
    assert np.all(np.isfinite(out[0, :30]))          # queries that do not


def test_special_values_agree_with_portable_path(path):
    """Scores of -inf / +inf from the inputs (not the mask): every path
    gives what the portable BLAS path gives."""
    q, k, v = rand((1, 1, 40, 16), 1), rand((1, 1, 200, 16), 2), rand((1, 1, 200, 16), 3)
    q[..., 3, :] = -np.inf
    k[..., 50, :] = np.inf
    q[..., 9, 0] = np.inf
    out = attncore.scaled_dot_product_attention(q, k, v)
    with _kernels.forced_kernel_path("portable"):
        expected = attncore.scaled_dot_product_attention(q, k, v)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(expected))
    fin = np.isfinite(expected)
    np.testing.assert_allclose(out[fin], expected[fin], **TOL32)


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


# ------------------------------------------------------------ threads
@pytest.mark.parametrize("shape", [(1, 8, 1, 5000, 64), (1, 2, 300, 3000, 32), (3, 4, 130, 90, 48)])
def test_threads_and_key_splits(path, shape):
    B, H, N, M, D = shape
    q, k, v = rand((B, H, N, D), 1), rand((B, H, M, D), 2), rand((B, H, M, D), 3)
    expected = ref(q, k, v)[0]
    for t in (1, 2, 3):
        np.testing.assert_allclose(
            attncore.scaled_dot_product_attention(q, k, v, num_threads=t), expected, **TOL32)


def test_concurrent_python_threads_give_serial_results(path):
    args = [(rand((2, 4, 100, 32), s), rand((2, 4, 150, 32), s + 1), rand((2, 4, 150, 32), s + 2))
            for s in range(0, 24, 3)]
    # the same calls one after the other (the same thread counts: tiles may
    # depend on them, and with them the rounding)
    serial = [attncore.scaled_dot_product_attention(*a, num_threads=1 + i % 2)
              for i, a in enumerate(args)]
    results = [None] * len(args)
    errors = []

    def work(i):
        try:
            for _ in range(5):
                results[i] = attncore.scaled_dot_product_attention(*args[i], num_threads=1 + i % 2)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(args))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for got, want, a in zip(results, serial, args):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(got, ref(*a)[0], **TOL32)


# ------------------------------------------------------------ direct kernel entry
@pytest.mark.parametrize("Bq,Bk,nsplit", [(3, 5, 1), (5, 7, 3), (37, 5, 3), (33, 64, 2)])
@pytest.mark.parametrize("causal", [0, 2])
def test_kernel_entry_odd_tiles(path, Bq, Bk, nsplit, causal):
    N, M, D, Dv = 41, 90, 13, 11
    q, k, v = rand((2, N, D), 1), rand((2, M, D), 2), rand((2, M, Dv), 3)
    mask = np.random.default_rng(4).random((2, 1, M)) > 0.3
    chunk = -(-M // nsplit)
    out = np.empty((2, N, Dv), np.float32)
    fused = _sdpa.kernel_path() in _sdpa.PANEL_ROWS
    call = _call.Call(q=q, k=k, v=v, mask=mask, mask_kind=1, bshape=(2,), group=1, N=N, M=M,
                      D=D, Dv=Dv, causal=causal, scale=0.3, window=(-1, -1), softcap=0.0,
                      k_scales=None, v_scales=None, q_scales=None, fmts=(0, 0, 0), slopes=None,
                      sinks=None, bf16dot=0, qk8=0,
                      plan=_call.Plan(Bq, Bk, nsplit, chunk, 2, fused),
                      compute=np.dtype(np.float32))
    _sdpa.sdpa(call, out)
    np.testing.assert_allclose(out, ref(q, k, v, mask, causal=causal, scale=0.3)[0], **TOL32)


# ------------------------------------------------------------ dense layer kernel
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_last_columns(path, with_bias):
    """The last columns after the full score micro-tiles: 4, 2, 1 at a time."""
    for C in range(1, 26):
        x, w = rand((40, 33), C), rand((C, 33), C + 1)
        b = rand((C,), C + 2) if with_bias else None
        expected = x.astype(np.float64) @ w.astype(np.float64).T + (0 if b is None else b)
        np.testing.assert_allclose(linear(x, w, b, num_threads=1), expected, rtol=3e-5,
                                   atol=3e-5)


@pytest.mark.parametrize("R", [1, 2, 5, 8, 9, 31, 33, 100])
@pytest.mark.parametrize("C,K", [(1, 1), (7, 13), (16, 64), (17, 100), (130, 33)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear(path, R, C, K, with_bias):
    x, w = rand((R, K), 1), rand((C, K), 2)
    b = rand((C,), 3) if with_bias else None
    expected = x.astype(np.float64) @ w.astype(np.float64).T
    if with_bias:
        expected += b
    for t in (1, 2):
        np.testing.assert_allclose(linear(x, w, b, num_threads=t), expected, rtol=3e-5, atol=3e-5)


# ------------------------------------------------------------ key chunks
@pytest.mark.parametrize("opts", [
    {},
    {"is_causal": True},
    {"is_causal": "lower_right", "window": (333, 0)},
    {"mask": True},
    {"window": (210, 170), "softcap": 20.0},
    {"alibi_slopes": np.array([0.5, 0.03])},
])
def test_key_chunks_change_no_result(path, opts):
    # float32 keys / values over more than 256 KiB: a query block's panels
    # take turns over chunks of keys (Plan.kchunk); the chunks cut no tile,
    # so blocks of 8 panels (one thread) and of 2 (eight threads)
    # and the direct loops give the same bits, and the float64 answer (the
    # planner's rule that chunks this shape: test_blas_policy)
    opts = dict(opts)
    B, H, N, M, D = 1, 2, 300, 1100, 64
    q, k, v = rand((B, H, N, D), 11), rand((B, H, M, D), 12), rand((B, H, M, D), 13)
    mask = None
    if opts.pop("mask", False):
        mask = np.random.default_rng(5).random((B, 1, N, M)) > 0.4
    outs = [sdpa(q, k, v, mask, num_threads=t, **opts) for t in (1, 3, 8)]
    for o in outs[1:]:
        if path not in _sdpa.PANEL_ROWS:   # BLAS tiles sized by the thread count
            np.testing.assert_allclose(o, outs[0], **TOL32)
        else:
            np.testing.assert_array_equal(o, outs[0])
    causal = opts.pop("is_causal", False)
    want = ref(q, k, v, mask, causal={False: 0, True: 1, "lower_right": 2}[causal], **opts)[0]
    np.testing.assert_allclose(outs[0], want, **TOL32)
