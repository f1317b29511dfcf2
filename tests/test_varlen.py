"""attncore.varlen_attention: packed variable-length batches (flash-attention's
varlen layout), against a plain float64 NumPy reference written from
flash-attention's documented semantics and against a loop of per-sequence
scaled_dot_product_attention calls, on every kernel path."""
import numpy as np
import pytest

import attncore
from attncore._core import _sdpa

from reference import sdpa_ref

va = attncore.varlen_attention
sd = attncore.scaled_dot_product_attention
PATHS = list(_sdpa.available_kernel_paths())



def packed(lq, lk, H, D, Dv=None, Hk=None, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    Dv = D if Dv is None else Dv
    Hk = H if Hk is None else Hk
    cq = np.r_[0, np.cumsum(lq)].astype(np.int32)
    ck = np.r_[0, np.cumsum(lk)].astype(np.int32)
    q = rng.standard_normal((cq[-1], H, D)).astype(dtype)
    k = rng.standard_normal((ck[-1], Hk, D)).astype(dtype)
    v = rng.standard_normal((ck[-1], Hk, Dv)).astype(dtype)
    return q, k, v, cq, ck


def reference(q, k, v, cq, ck, group=1, causal=False, slopes=None, **kw):
    """float64 varlen attention from flash-attention's documented semantics:
    sequence b is q[cq[b]:cq[b + 1]] (N, H, D) against k / v[ck[b]:ck[b + 1]],
    causal and window aligned lower-right (key j seen by query i when
    j - (i + M - N) lies in [-left, right], causal: right = 0); each
    sequence through reference.sdpa_ref."""
    out = np.zeros(q.shape[:2] + (v.shape[2],))
    for b in range(len(cq) - 1):
        qs, ks, vs = (np.swapaxes(x[c[b]:c[b + 1]], 0, 1) for x, c in ((q, cq), (k, ck), (v, ck)))
        sl = None if slopes is None else np.broadcast_to(slopes, (len(cq) - 1, q.shape[1]))[b]
        o = sdpa_ref(qs, ks, vs, is_causal=causal, diagonal="lower_right", group=group, alibi_slopes=sl,
                     **kw)
        out[cq[b]:cq[b + 1]] = np.swapaxes(o, 0, 1)
    return out


def loop(q, k, v, cq, ck, causal=False, **kw):
    """The per-sequence loop of scaled_dot_product_attention calls."""
    out = np.zeros(q.shape[:2] + (v.shape[2],), dtype=q.dtype)
    for b in range(len(cq) - 1):
        qs = q[cq[b]:cq[b + 1]].transpose(1, 0, 2)
        ks = k[ck[b]:ck[b + 1]].transpose(1, 0, 2)
        vs = v[ck[b]:ck[b + 1]].transpose(1, 0, 2)
        r = sd(qs, ks, vs, is_causal="lower_right" if causal else False, **kw)
        out[cq[b]:cq[b + 1]] = r.transpose(1, 0, 2)
    return out


# lengths with empty sequences, one-row (decode) sequences, N > M and N < M,
# and sequences longer than one query / key block
LQ = [5, 0, 1, 70, 200, 33, 0, 130]
LK = [9, 4, 0, 70, 150, 300, 0, 1]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("causal", [False, True])
def test_against_reference_and_loop(path, causal, threads):
    q, k, v, cq, ck = packed(LQ, LK, 4, 32, Dv=24)
    out = va(q, k, v, cq, ck, is_causal=causal, num_threads=threads)
    assert out.shape == (q.shape[0], 4, 24) and out.dtype == np.float32
    np.testing.assert_allclose(out, reference(q, k, v, cq, ck, causal=causal), atol=3e-6)
    np.testing.assert_allclose(out, loop(q, k, v, cq, ck, causal, num_threads=1), atol=2e-6)


@pytest.mark.parametrize("causal", [False, True])
def test_long_sequences_key_chunks(path, causal):
    # sequences over more than 256 KiB of float32 keys and values: query
    # blocks of 8 panels take turns over chunks of keys (Plan.kchunk),
    # varlen's ranges as the dense call's
    lq, lk = [300, 40, 700], [1300, 900, 700]
    q, k, v, cq, ck = packed(lq, lk, 2, 64, seed=3)
    for win in (None, (400, 90)):
        out = va(q, k, v, cq, ck, is_causal=causal, window=win, num_threads=2)
        np.testing.assert_allclose(out, reference(q, k, v, cq, ck, causal=causal, window=win),
                                   atol=3e-6, err_msg=str(win))
    out = va(q, k, v, cq, ck, is_causal=causal, num_threads=2)
    np.testing.assert_allclose(out, loop(q, k, v, cq, ck, causal, num_threads=1), atol=2e-6)


@pytest.mark.parametrize("Hk,lq,lk,win", [
    (1, 300, 1000, (20, 0)), (1, 300, 1000, (300, 40)), (2, 300, 1000, (20, 0)),
    (2, 300, 1000, (300, 40)),
])
def test_window_results_do_not_depend_on_the_thread_count(path, Hk, lq, lk, win):
    # (see test_paged's of the same name) one and two key heads side by
    # side (under 1024 keys: no key splits)
    if path == "portable":
        pytest.skip("BLAS tiles sized by the thread count")
    q, k, v, cq, ck = packed([lq], [lk], 2, 64, Hk=Hk, seed=6)
    outs = [va(q, k, v, cq, ck, window=win, enable_gqa=True, num_threads=t) for t in (1, 2, 3)]
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])
    np.testing.assert_allclose(outs[0], reference(q, k, v, cq, ck, group=2 // Hk, window=win),
                               atol=3e-6)


def test_causal_rows_without_keys_are_zero(path):
    # flash-attention: query i sees keys j <= i + M - N; with N > M the
    # first N - M rows see none
    q, k, v, cq, ck = packed([10, 6], [4, 6], 2, 16)
    out = va(q, k, v, cq, ck, is_causal=True)
    assert np.all(out[:6] == 0) and np.all(out[6:10] != 0)
    np.testing.assert_allclose(out, reference(q, k, v, cq, ck, causal=True), atol=2e-6)


def test_float64(path):
    q, k, v, cq, ck = packed(LQ, LK, 3, 20, dtype=np.float64)
    for causal in (False, True):
        out = va(q, k, v, cq, ck, is_causal=causal, num_threads=2)
        assert out.dtype == np.float64
        np.testing.assert_allclose(out, reference(q, k, v, cq, ck, causal=causal),
                                   atol=1e-12, rtol=0)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("causal", [False, True])
def test_window(path, causal, threads):
    q, k, v, cq, ck = packed(LQ, LK, 2, 32)
    for win in ((8, 0), (16, 4), (-1, 3), (5, -1)):
        out = va(q, k, v, cq, ck, is_causal=causal, window=win, num_threads=threads)
        np.testing.assert_allclose(out, reference(q, k, v, cq, ck, causal=causal, window=win),
                                   atol=3e-6, err_msg=str(win))
        if causal:  # the loop aligns the window lower-right only with causal
            np.testing.assert_allclose(
                out, loop(q, k, v, cq, ck, True, window=win, num_threads=1), atol=2e-6)


@pytest.mark.parametrize("causal", [False, True])
def test_softcap_alibi_scale(path, causal):
    q, k, v, cq, ck = packed(LQ, LK, 4, 32, seed=1)
    q *= 3
    slopes = np.array([0.5, 0.25, 0.125, 0.0625], np.float32)
    out = va(q, k, v, cq, ck, is_causal=causal, softcap=5.0, alibi_slopes=slopes, scale=0.2,
             num_threads=2)
    np.testing.assert_allclose(out, reference(q, k, v, cq, ck, causal=causal, softcap=5.0,
                                              slopes=slopes, scale=0.2), atol=5e-6)
    np.testing.assert_allclose(out, loop(q, k, v, cq, ck, causal, softcap=5.0,
                                         alibi_slopes=slopes, scale=0.2), atol=3e-6)
    # per-sequence slopes (B, H)
    sl2 = np.random.default_rng(2).uniform(0.01, 0.5, (len(LQ), 4)).astype(np.float32)
    out = va(q, k, v, cq, ck, is_causal=causal, alibi_slopes=sl2)
    np.testing.assert_allclose(out, reference(q, k, v, cq, ck, causal=causal, slopes=sl2),
                               atol=3e-6)


@pytest.mark.parametrize("threads", [1, 2])
def test_gqa(path, threads):
    q, k, v, cq, ck = packed(LQ, LK, 6, 32, Hk=2)
    for causal in (False, True):
        out = va(q, k, v, cq, ck, is_causal=causal, enable_gqa=True, num_threads=threads)
        np.testing.assert_allclose(out, reference(q, k, v, cq, ck, group=3, causal=causal),
                                   atol=3e-6)


@pytest.mark.parametrize("half", ["float16", "bfloat16"])
def test_half(path, half):
    if half == "bfloat16":
        ml_dtypes = pytest.importorskip("ml_dtypes")
        dt = np.dtype(ml_dtypes.bfloat16)
    else:
        dt = np.dtype(np.float16)
    q, k, v, cq, ck = packed(LQ, LK, 4, 32)
    qh, kh, vh = q.astype(dt), k.astype(dt), v.astype(dt)
    for causal in (False, True):
        out = va(qh, kh, vh, cq, ck, is_causal=causal, num_threads=2)
        assert out.dtype == dt
        r = reference(qh.astype(np.float64), kh.astype(np.float64), vh.astype(np.float64),
                      cq, ck, causal=causal)
        # the output rounded once to the 16-bit dtype
        ulp = 2.0 ** -8 if half == "bfloat16" else 2.0 ** -11
        np.testing.assert_allclose(out.astype(np.float64), r, atol=2 * ulp * np.abs(r).max())
        # the loop's tiles differ (each call plans its own): one rounding apart
        np.testing.assert_allclose(out.astype(np.float64),
                                   loop(qh, kh, vh, cq, ck, causal).astype(np.float64),
                                   atol=2 * ulp * np.abs(r).max())
    # mixed: float32 query with 16-bit keys promotes to float32
    out = va(q, kh, vh, cq, ck)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, reference(q, kh.astype(np.float64), vh.astype(np.float64),
                                              cq, ck), atol=3e-6)


def test_strided_inputs_and_int64_offsets(path):
    q, k, v, cq, ck = packed(LQ, LK, 3, 16)
    # heads-major buffers seen as (total, H, D): rows D apart, heads total * D apart
    qs = np.ascontiguousarray(q.transpose(1, 0, 2)).transpose(1, 0, 2)
    kv = np.concatenate([k, v], axis=2)  # fused K|V rows: the last axis is not the row
    ks, vs = kv[:, :, :16], kv[:, :, 16:]
    before = [a.copy() for a in (qs, kv)]
    out = va(qs, ks, vs, cq.astype(np.int64), ck.astype(np.int64), is_causal=True)
    np.testing.assert_allclose(out, reference(q, k, v, cq, ck, causal=True), atol=3e-6)
    for a, b in zip((qs, kv), before):
        np.testing.assert_array_equal(a, b)
    # head-major keys / values (rows D apart: read in place, not copied)
    kh, vh = (np.ascontiguousarray(a.transpose(1, 0, 2)).transpose(1, 0, 2) for a in (k, v))
    out = va(q, kh, vh, cq, ck, is_causal=True, num_threads=2)
    np.testing.assert_allclose(out, reference(q, k, v, cq, ck, causal=True), atol=3e-6)


def test_empty_everything():
    H, D = 2, 8
    z = np.zeros((0, H, D), np.float32)
    cu = np.zeros(1, np.int32)
    assert va(z, z, z, cu, cu).shape == (0, H, D)
    # every sequence empty, or queries without keys
    q, k, v, cq, ck = packed([0, 3, 0], [0, 0, 0], H, D)
    out = va(q, k, v, cq, ck, is_causal=True)
    assert out.shape == (3, H, D) and np.all(out == 0)
    # Dv = 0
    q, k, v, cq, ck = packed([2, 3], [4, 1], H, D, Dv=0)
    assert va(q, k, v, cq, ck).shape == (5, H, 0)


def test_torch_tensors():
    torch = pytest.importorskip("torch")
    q, k, v, cq, ck = packed(LQ, LK, 4, 32)
    tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
    out = va(tq, tk, tv, torch.from_numpy(cq), torch.from_numpy(ck), is_causal=True)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    np.testing.assert_allclose(out.numpy(), reference(q, k, v, cq, ck, causal=True), atol=3e-6)
    # bfloat16 tensors come back bfloat16
    out = va(tq.bfloat16(), tk.bfloat16(), tv.bfloat16(), torch.from_numpy(cq),
             torch.from_numpy(ck))
    assert out.dtype == torch.bfloat16


def test_against_torch_sdpa_per_sequence():
    """A third-party check: torch's SDPA on each sequence, lower-right causal
    expressed as an explicit boolean mask."""
    torch = pytest.importorskip("torch")
    q, k, v, cq, ck = packed(LQ, LK, 4, 32)
    out = va(q, k, v, cq, ck, is_causal=True)
    for b in range(len(LQ)):
        n, m = LQ[b], LK[b]
        if n == 0:
            continue
        if m == 0:
            assert np.all(out[cq[b]:cq[b + 1]] == 0)
            continue
        mask = torch.from_numpy(np.arange(m)[None, :] <= np.arange(n)[:, None] + m - n)
        t = [torch.from_numpy(a[lo:hi].transpose(1, 0, 2).astype(np.float64))
             for a, lo, hi in ((q, cq[b], cq[b + 1]), (k, ck[b], ck[b + 1]),
                               (v, ck[b], ck[b + 1]))]
        r = torch.nn.functional.scaled_dot_product_attention(*t, attn_mask=mask)
        r = torch.nan_to_num(r, nan=0.0).numpy().transpose(1, 0, 2)  # rows with no key
        np.testing.assert_allclose(out[cq[b]:cq[b + 1]], r, atol=3e-6)


# --------------------------------------------------------------------------
# bad inputs
# --------------------------------------------------------------------------
def _ok():
    return packed([3, 4], [2, 5], 2, 8)


@pytest.mark.parametrize("cu, exc, msg", [
    (np.array([0, 4, 3], np.int32), ValueError, r"cu_seqlens_q must be non-decreasing"),
    (np.array([1, 3, 7], np.int32), ValueError, r"cu_seqlens_q must start at 0, got .*= 1"),
    (np.array([0, 3, 6], np.int32), ValueError,
     r"cu_seqlens_q must end at the total length \(q.shape\[0\] = 7\), got .*= 6"),
    (np.array([0.0, 3.0, 7.0]), TypeError, r"cu_seqlens_q must be an int32 .*got dtype float64"),
    (np.array([False, True]), TypeError, r"cu_seqlens_q must be an int32 .*got dtype bool"),
    (np.array([[0, 3, 7]], np.int32), ValueError, r"cu_seqlens_q must be 1-D .*\(1, 3\)"),
    (np.zeros(0, np.int32), ValueError, r"cu_seqlens_q must hold B \+ 1 >= 1"),
    (np.array([0, 7], np.int32), ValueError, r"cu_seqlens_q and cu_seqlens_k must both hold"),
])
def test_bad_cu_seqlens(cu, exc, msg):
    q, k, v, cq, ck = _ok()
    with pytest.raises(exc, match=msg):
        va(q, k, v, cu, ck)


def test_bad_cu_seqlens_k():
    q, k, v, cq, ck = _ok()
    with pytest.raises(ValueError, match=r"cu_seqlens_k must end at the total length "
                                         r"\(k.shape\[0\] = 7\)"):
        va(q, k, v, cq, np.array([0, 2, 8], np.int32))
    with pytest.raises(ValueError, match="cu_seqlens_k must be non-decreasing"):
        va(q, k, v, cq, np.array([0, 8, 7], np.int32))


def test_bad_shapes_and_args():
    q, k, v, cq, ck = _ok()
    with pytest.raises(ValueError, match=r"q must be 3-D \(total_q, Hq, D\), got shape \(7, 16\)"):
        va(q.reshape(7, 16), k, v, cq, ck)
    with pytest.raises(ValueError, match=r"k last dimension must equal q's \(D = 8\)"):
        va(q, k[..., :4], v, cq, ck)
    with pytest.raises(ValueError, match=r"v must match k in its first two axes"):
        va(q, k, v[:6], cq, ck)
    with pytest.raises(ValueError, match=r"k / v have 1 heads and q has 2: pass enable_gqa"):
        va(q, k[:, :1], v[:, :1], cq, ck)
    q3 = np.zeros((7, 3, 8), np.float32)
    with pytest.raises(ValueError, match=r"the heads of k / v \(2\) must divide the q heads \(3\)"):
        va(q3, k, v, cq, ck, enable_gqa=True)
    with pytest.raises(TypeError, match="q must be a bfloat16, float16, float32 or float64"):
        va(q.astype(np.int32), k, v, cq, ck)
    with pytest.raises(ValueError, match=r"max_seqlen_q \(3\) is smaller than the longest "
                                         r"sequence \(4\)"):
        va(q, k, v, cq, ck, max_seqlen_q=3)
    with pytest.raises(TypeError, match="max_seqlen_k must be None or an int"):
        va(q, k, v, cq, ck, max_seqlen_k=5.0)
    with pytest.raises(TypeError, match="is_causal must be a bool"):
        va(q, k, v, cq, ck, is_causal="lower_right")
    with pytest.raises(ValueError, match=r"alibi_slopes must have shape \(Hq,\) = \(2,\) or "
                                         r"\(B, Hq\) = \(2, 2\), got \(3,\)"):
        va(q, k, v, cq, ck, alibi_slopes=np.ones(3, np.float32))
    with pytest.raises(ValueError, match="alibi_slopes must be finite"):
        va(q, k, v, cq, ck, alibi_slopes=np.array([1, np.nan], np.float32))
    with pytest.raises(ValueError, match="num_threads"):
        va(q, k, v, cq, ck, num_threads=0)
    # max_seqlen_* equal to or above the true maximum are fine
    out = va(q, k, v, cq, ck, max_seqlen_q=4, max_seqlen_k=100)
    np.testing.assert_allclose(out, reference(q, k, v, cq, ck), atol=3e-6)


@pytest.mark.parametrize("mode", ["native", "emulate", "off"])
def test_bf16_products_as_the_dense_call(mode):
    """bfloat16 inputs take the same dtype policy in every entry point (one
    home, attncore._call): with bfloat16 products (on the CPU's
    instruction, or its AVX-512F spelling) a packed batch gives the bits
    of the dense call on each sequence, and so does a one-chunk block of
    attncore.dask."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    if "avx512" not in PATHS:
        pytest.skip("the bfloat16 products run on the avx512 path")
    try:
        prev = _sdpa.set_bf16_mode(mode)
    except ValueError:
        pytest.skip(f"this CPU has no {mode} bf16 mode")
    # (the fused kernel: the same tiles per row in both calls, so the same bits)
    prev_path = _sdpa.set_kernel_path("avx512")
    bf = np.dtype(ml_dtypes.bfloat16)
    try:
        lens = [70, 130, 33]
        cu = np.concatenate([[0], np.cumsum(lens)])
        rng = np.random.default_rng(3)
        q, k, v = (rng.standard_normal((cu[-1], h, 64)).astype(bf) for h in (4, 2, 2))
        out = attncore.varlen_attention(q, k, v, cu, cu, is_causal=True, enable_gqa=True)
        assert out.dtype == bf
        for b in range(len(lens)):
            s = slice(cu[b], cu[b + 1])
            dense = attncore.scaled_dot_product_attention(
                *(np.swapaxes(a[s], 0, 1) for a in (q, k, v)), is_causal=True, enable_gqa=True)
            np.testing.assert_array_equal(np.swapaxes(dense, 0, 1).view(np.uint16),
                                          out[s].view(np.uint16))
        da = pytest.importorskip("dask.array")
        import attncore.dask as ad
        qs, ks, vs = (np.swapaxes(a[:70], 0, 1)[None] for a in (q, k, v))
        block = ad.scaled_dot_product_attention(
            *(da.from_array(a, chunks=a.shape) for a in (qs, ks, vs)), is_causal=True,
            enable_gqa=True).compute(scheduler="synchronous")
        dense = attncore.scaled_dot_product_attention(qs, ks, vs, is_causal=True,
                                                      enable_gqa=True)
        np.testing.assert_array_equal(block.view(np.uint16), dense.view(np.uint16))
        if mode != "off":  # bfloat16 products are not float32 ones
            _sdpa.set_bf16_mode("off")
            off = attncore.varlen_attention(q, k, v, cu, cu, is_causal=True, enable_gqa=True)
            assert not np.array_equal(off.view(np.uint16), out.view(np.uint16))
    finally:
        _sdpa.set_bf16_mode(prev)
        _sdpa.set_kernel_path(prev_path)


def test_float64_rerun_converts_only_the_affected_sequences():
    """A batch in which one sequence's float32 sums overflow (values near
    3e38): only that sequence runs again in float64, over its own rows --
    the memory the call takes beyond its output is that sequence's keys
    and values in float64 and a little scratch (it converted the whole
    batch: 32 MiB of float64 keys and values here), and every row is the
    float64 reference's, the overflowing sequence's above 1e38."""
    import tracemalloc

    lq, lk = [4] * 8, [2048] * 8
    q, k, v, cq, ck = packed(lq, lk, 4, 64, Hk=2, seed=7)
    rng = np.random.default_rng(8)
    v[ck[5]:ck[6]] = rng.uniform(2e38, 3e38, v[ck[5]:ck[6]].shape).astype(np.float32)
    kw = dict(is_causal=True, enable_gqa=True, num_threads=1)
    va(q, k, v, cq, ck, **kw)                           # warm (plans, imports)
    tracemalloc.start()
    try:
        out = va(q, k, v, cq, ck, **kw)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    own = 2 * 2048 * 2 * 64 * 8                         # sequence 5's k and v, float64
    assert peak - out.nbytes <= own + 4 * 2**20, (peak - out.nbytes) / 2**20
    assert own + 4 * 2**20 < k.nbytes + v.nbytes       # half a float64 copy of them all
    ref = reference(q, k, v, cq, ck, group=2, causal=True)
    assert np.isfinite(ref).all() and np.abs(ref[cq[5]:cq[6]]).min() > 1e38
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)
