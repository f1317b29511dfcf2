"""Inputs of unusual memory layouts: unaligned arrays (at an address that is
not a multiple of the element size) reach the compiled kernels of
scaled_dot_product_attention, the additive (MLP) alignment, the dense layer
and MultiHeadAttention only as aligned copies, with the same results; a
broadcast (stride-0) query row axis is not copied in full."""
import tracemalloc

import numpy as np
import pytest

import attncore
from attncore import scaled_dot_product_attention as sdpa
from attncore import _linear
from attncore._core import _additive, _linalg, _sdpa

from reference import additive_attention
from reference import attention as ref
from reference import rand


def unaligned(a):
    """A copy of ``a`` (C order) at an address that is not a multiple of
    its element size (and so, strides included, not aligned)."""
    a = np.ascontiguousarray(a)
    raw = np.zeros(a.nbytes + 1, dtype=np.uint8)
    out = np.frombuffer(raw.data, dtype=a.dtype, count=a.size, offset=1).reshape(a.shape)
    out[...] = a
    assert not out.flags.aligned
    return out


# ---------------------------------------------------------------- unaligned arrays
def _arrays(args):
    for a in args:
        if isinstance(a, np.ndarray):
            yield a


@pytest.fixture
def kernels_see_aligned(monkeypatch):
    """Wrap the compiled entry points: every array they get must be aligned."""
    seen = []

    def wrap(mod, name):
        real = getattr(mod, name)

        def checked(*args, **kw):
            for a in _arrays(list(args) + list(kw.values())):
                assert a.flags.aligned, f"{mod.__name__}.{name} got an unaligned array"
                assert a.ctypes.data % a.itemsize == 0
            seen.append(name)
            return real(*args, **kw)

        monkeypatch.setattr(mod, name, checked)

    wrap(_sdpa, "sdpa")
    wrap(_additive, "additive_attention")
    wrap(_linalg, "linear")
    return seen


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("which", ["query", "key", "value", "mask", "all"])
@pytest.mark.parametrize("return_weights", [False, True])
def test_unaligned_sdpa_inputs(kernels_see_aligned, dtype, which, return_weights):
    q, k, v = rand((2, 3, 9, 8), dtype=dtype), rand((2, 3, 11, 8), 1, dtype), rand((2, 3, 11, 5), 2, dtype)
    m = np.where(rand((9, 11), 3, np.float64) > -1.0, 0.0, -np.inf).astype(dtype)
    args = {"query": q, "key": k, "value": v, "mask": m}
    for nm in args:
        if which in (nm, "all"):
            args[nm] = unaligned(args[nm])
    before = {nm: a.copy() for nm, a in args.items()}
    res = sdpa(args["query"], args["key"], args["value"], args["mask"],
               return_weights=return_weights)
    out_ref, w_ref = ref(q, k, v, m)
    tol = dict(rtol=2e-5, atol=2e-6) if dtype == np.float32 else dict(rtol=1e-11, atol=1e-12)
    if return_weights:
        np.testing.assert_allclose(res[0], out_ref, **tol)
        np.testing.assert_allclose(res[1], w_ref, **tol)
    else:
        np.testing.assert_allclose(res, out_ref, **tol)
    assert kernels_see_aligned == ["sdpa"]
    for nm, a in args.items():
        np.testing.assert_array_equal(a, before[nm])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_unaligned_float16_free_path_and_mlp(kernels_see_aligned, dtype):
    """Attention("mlp") with unaligned keys / values / query / parameters."""
    rng = np.random.default_rng(0)
    B, T, S, D, A = 2, 3, 7, 6, 5
    qw, kw, vv, bias = (rng.standard_normal(s).astype(dtype) for s in ((A, D), (A, D), (A,), (A,)))
    q, keys, vals = rand((B, T, D), 1, dtype), rand((B, S, D), 2, dtype), rand((B, S, 4), 3, dtype)
    att = attncore.Attention("mlp", q_weight=unaligned(qw), k_weight=unaligned(kw),
                             v=unaligned(vv), bias=unaligned(bias))
    ctx, w = att(unaligned(q), unaligned(keys), unaligned(vals), return_weights=True)
    # independent float64 reference
    ctx_ref, w_ref = additive_attention(q, keys, vals, vv, qw, kw, bias)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == np.float32 else dict(rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(w, w_ref, **tol)
    np.testing.assert_allclose(ctx, ctx_ref, **tol)
    assert "additive_attention" in kernels_see_aligned and "linear" in kernels_see_aligned


def test_unaligned_mlp_identity_projections(kernels_see_aligned):
    """q_weight = k_weight = None: the query itself goes to the kernel."""
    B, T, S, A = 2, 3, 6, 4
    q, keys, vv = rand((B, T, A), 1), rand((B, S, A), 2), rand((A,), 3)
    att = attncore.Attention("additive", v=unaligned(vv))
    ctx, w = att(unaligned(q), unaligned(keys), return_weights=True)
    ctx_ref, w_ref = additive_attention(q, keys, keys, vv)
    np.testing.assert_allclose(w, w_ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(ctx, ctx_ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_unaligned_linear_and_mha(kernels_see_aligned, dtype):
    x, w, b = rand((5, 7), dtype=dtype), rand((3, 7), 1, dtype), rand((3,), 2, dtype)
    out = _linear.linear(unaligned(x), unaligned(w), unaligned(b))
    np.testing.assert_allclose(out, x.astype(np.float64) @ w.T + b, rtol=1e-5, atol=1e-5)
    mha = attncore.MultiHeadAttention(8, 2, rng=0, dtype=dtype)
    xx = rand((2, 4, 8), 3, dtype)
    np.testing.assert_array_equal(mha(unaligned(xx))[0], mha(xx)[0])


# ---------------------------------------------------------------- stride-0 rows
def _peak_bytes(fn):
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        res = fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return res, peak


def test_broadcast_query_rows_not_copied():
    N, D, M, Dv = 1 << 20, 8, 4, 1
    row = rand((D,))
    q = np.broadcast_to(row, (N, D))                 # 32 MiB if copied
    k, v = rand((M, D), 1), rand((M, Dv), 2)
    out, peak = _peak_bytes(lambda: sdpa(q, k, v))
    out_bytes = N * Dv * 4
    assert peak < 2 * out_bytes + (1 << 20), f"peak {peak} bytes for a {out_bytes}-byte output"
    assert out.shape == (N, Dv) and out.flags.writeable
    expected = ref(row[None], k, v)[0]
    np.testing.assert_allclose(out, np.broadcast_to(expected, (N, Dv)), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("mask_shape", [None, (1, 7), (3, 1, 7)])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_broadcast_query_rows_match_reference(mask_shape, dtype):
    row = rand((3, 1, 5), dtype=dtype)
    q = np.broadcast_to(row, (3, 6, 5))
    k, v = rand((3, 7, 5), 1, dtype), rand((3, 7, 4), 2, dtype)
    m = None if mask_shape is None else rand(mask_shape, 3, np.float64) > -0.5
    out, w = sdpa(q, k, v, m, return_weights=True)
    out_ref, w_ref = ref(q, k, v, m)
    tol = {np.float16: dict(rtol=2e-3, atol=2e-3), np.float32: dict(rtol=2e-5, atol=2e-6),
           np.float64: dict(rtol=1e-11, atol=1e-12)}[dtype]
    assert out.dtype == dtype and out.shape == (3, 6, 4) and w.shape == (3, 6, 7)
    np.testing.assert_allclose(out, out_ref, **tol)
    np.testing.assert_allclose(w, w_ref, **tol)
    out[...] = 0                                     # results are writable arrays of their own
    w[...] = 0


@pytest.mark.parametrize("causal", [True, "lower_right"])
def test_broadcast_query_rows_with_causal_or_row_mask(causal):
    """Rows told apart by the causal structure or a per-row mask: still right."""
    row = rand((1, 5), dtype=np.float64)
    q = np.broadcast_to(row, (6, 5))
    k, v = rand((8, 5), 1, np.float64), rand((8, 3), 2, np.float64)
    code = 1 if causal is True else 2
    np.testing.assert_allclose(sdpa(q, k, v, is_causal=causal),
                               ref(q, k, v, causal=code)[0], rtol=1e-12, atol=1e-12)
    m = rand((6, 8), 4, np.float64) > 0
    np.testing.assert_allclose(sdpa(q, k, v, m), ref(q, k, v, m)[0], rtol=1e-12, atol=1e-12)


# ------------------------------------------------- heads viewed from projections
@pytest.mark.parametrize("N", [5, 32, 33, 100])
@pytest.mark.parametrize("width", [2, 3, 4])
@pytest.mark.parametrize("copy_bytes", [None, 0])
def test_head_views_with_aliasing_rows(path, N, width, copy_bytes, monkeypatch):
    """q / k / v as the heads of (B, L, width * H * hd) projections,
    rows a multiple of 1 KiB apart (2, 3, 4 KiB): for calls of many query
    rows (attncore._call.ALIASED_V_ROWS) the values are copied -- by the
    fused kernel a query block at a time (plan.kvcopy), or before the call
    where it does not (other paths, values beyond COPIED_KV_BYTES) --, read
    in place otherwise; the same results every way (causal, a boolean
    mask, key splits, two threads), the inputs untouched."""
    from attncore import _call
    from attncore._validation import aliasing_rows
    if copy_bytes is not None:
        monkeypatch.setattr(_call, "COPIED_KV_BYTES", copy_bytes)
    B, H, hd, M = 2, 4, 64, 70
    qb, kvb = rand((B, N, width * H * hd), 1), rand((B, M, width * H * hd), 2)
    heads = lambda x, i: x[..., i * H * hd:(i + 1) * H * hd].reshape(  # noqa: E731
        x.shape[0], x.shape[1], H, hd).transpose(0, 2, 1, 3)
    q, k, v = heads(qb, 0), heads(kvb, 0), heads(kvb, 1)
    assert aliasing_rows(v) and not aliasing_rows(np.ascontiguousarray(v))
    before, qbefore = kvb.copy(), qb.copy()
    c = _call.describe(_call.check(q, k, v))
    fused = path in _sdpa.PANEL_ROWS
    assert c.plan.kvcopy == (N > _call.ALIASED_V_ROWS and fused and copy_bytes is None)
    assert c.v.flags.c_contiguous == (N > _call.ALIASED_V_ROWS and not c.plan.kvcopy)
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    r, _ = ref(q64, k64, v64, causal=2)
    for nt in (1, 2):
        out = sdpa(q, k, v, is_causal="lower_right", num_threads=nt)
        np.testing.assert_allclose(out, r, rtol=3e-5, atol=3e-6)
    m = rand((N, M), 5) > -0.5
    np.testing.assert_allclose(sdpa(q, k, v, m), ref(q64, k64, v64, m)[0], rtol=3e-5, atol=3e-6)
    np.testing.assert_array_equal(kvb, before)
    np.testing.assert_array_equal(qb, qbefore)


def test_aliasing_values_copied_by_blocks_long_keys(path):
    """Head views of aliasing values over many keys (several query blocks,
    key tiles and, on two threads, blocks on both threads): the fused
    kernel's per-block copies against the float64 reference."""
    from attncore import _call
    B, H, hd, N, M = 1, 2, 64, 700, 1300
    kvb = rand((B, M, 4 * H * hd), 7)
    heads = lambda x, i: x[..., i * H * hd:(i + 1) * H * hd].reshape(  # noqa: E731
        x.shape[0], x.shape[1], H, hd).transpose(0, 2, 1, 3)
    q, k, v = rand((B, H, N, hd), 8), heads(kvb, 0), heads(kvb, 3)
    v = v[..., :40]  # Dv 40: rows of 160 bytes, 2 KiB apart
    c = _call.describe(_call.check(q, k, v))
    assert c.plan.kvcopy == (path in _sdpa.PANEL_ROWS)
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    for causal, code in ((False, 0), ("upper_left", 1)):
        r, _ = ref(q64, k64, v64, causal=code)
        for nt in (1, 2):
            out = sdpa(q, k, v, is_causal=causal, num_threads=nt)
            np.testing.assert_allclose(out, r, rtol=3e-5, atol=3e-6)
    # a sliding window: each block copies only the keys its rows may see
    i, j = np.arange(N)[:, None], np.arange(M)[None, :]
    r, _ = ref(q64, k64, v64, (j >= i - 300) & (j <= i + 20))
    for nt in (1, 2):
        out = sdpa(q, k, v, window=(300, 20), num_threads=nt)
        np.testing.assert_allclose(out, r, rtol=3e-5, atol=3e-6)


@pytest.mark.parametrize("which", ["k", "v", "kv"])
def test_strided_key_value_rows_copied_by_blocks(path, which):
    """Keys and / or values whose rows are not contiguous but do not alias
    in L1 (heads of a projection padded off the 1 KiB multiples, as
    MultiHeadAttention lays them out): read in place before the call, the
    fused kernel copies each block's strided rows; against the float64
    reference, with a mask and on two threads; contiguous operands are
    never copied."""
    from attncore import _call
    from attncore._validation import aliasing_rows
    B, H, hd, N, M = 2, 3, 64, 90, 77
    buf = rand((B, M, 2 * H * hd + 16), 4)  # rows 1600 floats apart
    heads = lambda x, i: x[..., i * H * hd:(i + 1) * H * hd].reshape(  # noqa: E731
        x.shape[0], x.shape[1], H, hd).transpose(0, 2, 1, 3)
    q = rand((B, H, N, hd), 5)
    k = heads(buf, 0) if "k" in which else rand((B, H, M, hd), 6)
    v = heads(buf, 1) if "v" in which else rand((B, H, M, hd), 7)
    assert not aliasing_rows(k) and not aliasing_rows(v)
    before = buf.copy()
    c = _call.describe(_call.check(q, k, v))
    assert c.plan.kvcopy == (path in _sdpa.PANEL_ROWS)
    assert np.shares_memory(c.k, buf) == ("k" in which)
    assert np.shares_memory(c.v, buf) == ("v" in which)
    c2 = _call.describe(_call.check(q, np.ascontiguousarray(k), np.ascontiguousarray(v)))
    assert not c2.plan.kvcopy
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    m = rand((N, M), 8) > -0.7
    r, _ = ref(q64, k64, v64, m)
    for nt in (1, 2):
        np.testing.assert_allclose(sdpa(q, k, v, m, num_threads=nt), r, rtol=3e-5, atol=3e-6)
    r, _ = ref(q64, k64, v64, causal=2)
    np.testing.assert_allclose(sdpa(q, k, v, is_causal="lower_right"), r, rtol=3e-5, atol=3e-6)
    np.testing.assert_array_equal(buf, before)


@pytest.mark.parametrize("pad", [0, 16])
def test_prepared_head_views_copied_by_blocks(path, pad):
    """The integrations' prepared call (attention_prepared) on the head
    views of a (B, S, 3 H D) projection, rows 3 KiB apart or padded off
    the 1 KiB multiples: the fused kernel copies the keys and values a
    block at a time, as the general call does; against the float64
    reference, causal and not, one and two threads."""
    from attncore import _call, _lean
    B, S, H, D = 2, 90, 4, 64
    x = rand((B, S, 3 * H * D + pad), 9)
    heads = lambda i: x[..., i * H * D:(i + 1) * H * D].reshape(  # noqa: E731
        B, S, H, D).transpose(0, 2, 1, 3)
    q, k, v = heads(0), heads(1), heads(2)
    before = x.copy()
    _lean._PREPARED.clear()
    first = _lean.attention_prepared(q, k, v, 2, None, 2)
    (prep,) = _lean._PREPARED.values()
    if path not in _sdpa.PANEL_ROWS:
        assert first is None and prep is False   # the BLAS path: the general call
        return
    assert dict(zip(_call.Call._fields[3:], prep[0]))["plan"].kvcopy
    q64, k64, v64 = (a.astype(np.float64) for a in (q, k, v))
    for causal in (0, 2):
        r, _ = ref(q64, k64, v64, causal=causal)
        for nt in (1, 2):
            out = _lean.attention_prepared(q, k, v, causal, None, nt)
            np.testing.assert_allclose(out, r, rtol=3e-5, atol=3e-6)
    np.testing.assert_array_equal(x, before)


def test_aliasing_values_broadcast_batch_not_expanded(monkeypatch):
    """Values with aliasing rows broadcast over a batch axis (stride 0)
    are copied once per distinct row, not once per batch element."""
    from attncore import _call
    B, H, hd, M, N = 6, 4, 64, 50, 40
    kvb = rand((1, M, 2 * H * hd), 2)
    v = kvb[..., H * hd:].reshape(1, M, H, hd).transpose(0, 2, 1, 3)
    vb = np.broadcast_to(v, (B, H, M, hd))
    q, k = rand((B, H, N, hd), 1), rand((B, H, M, hd), 3)
    monkeypatch.setattr(_call, "COPIED_KV_BYTES", 0)  # the copy before the call
    c = _call.describe(_call.check(q, k, vb))
    assert c.v.strides[0] == 0 and c.v.strides[-2] == hd * c.v.itemsize  # dense rows, once
    np.testing.assert_array_equal(np.asarray(c.v), vb)
    out = sdpa(q, k, vb)
    r, _ = ref(q.astype(np.float64), k.astype(np.float64), vb.astype(np.float64))
    np.testing.assert_allclose(out, r, rtol=3e-5, atol=3e-6)
