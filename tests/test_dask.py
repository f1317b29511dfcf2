"""attncore.dask against the float64 reference (synchronous scheduler), a
real two-process LocalCluster, graph structure, layers over batches,
pickling, and errors."""
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

dask = pytest.importorskip("dask")
da = pytest.importorskip("dask.array")

import attncore  # noqa: E402
import attncore.dask as ad  # noqa: E402
from attncore.alignments import _registry  # noqa: E402

from reference import allowed, lse_ref, make_mask, sdpa_ref  # noqa: E402
from reference import attention as ref  # noqa: E402
from reference import rand  # noqa: E402

TOL = {np.float32: dict(rtol=5e-5, atol=5e-6), np.float64: dict(rtol=1e-11, atol=1e-12)}
CAUSAL = {False: 0, True: 1, "upper_left": 1, "lower_right": 2}


@pytest.fixture(autouse=True)
def synchronous():
    with dask.config.set(scheduler="synchronous"):
        yield


def qkv(B, H, N, M, D=8, Dv=8, dtype=np.float64, Hk=None):
    Hk = H if Hk is None else Hk
    return (rand((B, H, N, D), 1, dtype), rand((B, Hk, M, D), 2, dtype),
            rand((B, Hk, M, Dv), 3, dtype))


def chunked(x, *chunks):
    return da.from_array(x, chunks=chunks)


def run(q, k, v, mask=None, *, qc, kc, bc=1, hc=None, mask_dask=True, **kw):
    """attncore.dask on q chunked (bc, hc, qc) and k/v (bc, hc, kc): result."""
    hq = hc or q.shape[1]
    hk = hc or k.shape[1]
    if kw.get("enable_gqa") and hc:
        hk = max(1, hc * k.shape[1] // q.shape[1])
    Q = chunked(q, bc, hq, qc, -1)
    K = chunked(k, bc, hk, kc, -1)
    V = chunked(v, bc, hk, kc, -1)
    m = mask
    if mask is not None and mask_dask:
        mc = tuple(c if s != 1 else 1 for c, s in zip((bc, hq, qc, kc)[-mask.ndim:], mask.shape))
        m = chunked(mask, *mc)
    out = ad.scaled_dot_product_attention(Q, K, V, m, **kw)
    if kw.get("return_lse"):          # (out, lse): both lazy, computed together
        assert all(isinstance(x, da.Array) for x in out)
        res = dask.compute(*out)
        assert all(r.shape == x.shape and r.dtype == x.dtype for r, x in zip(res, out))
        return res, out
    assert isinstance(out, da.Array)
    res = out.compute()
    assert res.shape == out.shape and res.dtype == out.dtype
    return res, out


def partial_keys(arr):
    deps = arr.__dask_graph__().get_all_dependencies()
    return {key: d for key, d in deps.items() if isinstance(key, tuple) and key[0].endswith("-partial")}


# ---------------------------------------------------------------- the math
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("N,M", [(37, 53), (53, 37), (1, 40), (40, 1), (16, 16)])
@pytest.mark.parametrize("qc,kc", [(-1, -1), (10, 7), (-1, 9), (13, -1), (4, 25)])
def test_key_and_query_chunked(dtype, N, M, qc, kc):
    q, k, v = qkv(2, 3, N, M, D=16, Dv=5, dtype=dtype)
    res, out = run(q, k, v, qc=qc, kc=kc)
    assert res.dtype == dtype
    np.testing.assert_allclose(res, ref(q, k, v)[0], **TOL[dtype])
    assert out.chunks[-2] == da.from_array(q, chunks=(1, 3, qc, -1)).chunks[-2]


@pytest.mark.parametrize("causal", [False, True, "lower_right"])
def test_chunks_of_size_one(causal):
    q, k, v = qkv(1, 2, 7, 9)
    res, out = run(q, k, v, qc=1, kc=1, is_causal=causal)
    np.testing.assert_allclose(res, ref(q, k, v, causal=CAUSAL[causal])[0], **TOL[np.float64])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [True, "upper_left", "lower_right"])
@pytest.mark.parametrize("N,M", [(30, 30), (20, 45), (45, 20), (1, 33), (33, 1)])
@pytest.mark.parametrize("qc,kc", [((7, 3, 11, 9), (6, 14, 5, 20)), (8, 8), (5, 12), (12, 5)])
def test_causal_both_alignments_uneven_chunks(dtype, causal, N, M, qc, kc):
    q, k, v = qkv(2, 2, N, M, dtype=dtype)
    if isinstance(qc, tuple):  # uneven chunks that fit the lengths
        qc = tuple(np.diff(np.unique(np.clip(np.cumsum((0,) + qc), 0, N))).tolist()) or (N,)
        kc = tuple(np.diff(np.unique(np.clip(np.cumsum((0,) + kc), 0, M))).tolist()) or (M,)
        if sum(qc) < N:
            qc = qc + (N - sum(qc),)
        if sum(kc) < M:
            kc = kc + (M - sum(kc),)
    res, out = run(q, k, v, qc=qc, kc=kc, is_causal=causal)
    r = ref(q, k, v, causal=CAUSAL[causal])[0]
    np.testing.assert_allclose(res, r, **TOL[dtype])
    # no task for a (query chunk, key chunk) pair above the diagonal
    ok = allowed(N, M, causal=CAUSAL[causal])
    qb = np.cumsum((0,) + out.chunks[-2])
    kb = np.cumsum((0,) + da.from_array(k, chunks=(1, 2, kc, -1)).chunks[-2])
    live = sum(bool(ok[qb[i]:qb[i + 1], kb[j]:kb[j + 1]].any())
               for i in range(len(qb) - 1) for j in range(len(kb) - 1))
    assert len(partial_keys(out)) == live * 2 * 1   # batch blocks (2) x heads in one chunk


def test_causal_skips_blocks_and_no_task_holds_all_keys():
    N = M = 64
    q, k, v = qkv(1, 1, N, M)
    Q, K, V = chunked(q, 1, 1, 16, -1), chunked(k, 1, 1, 16, -1), chunked(v, 1, 1, 16, -1)
    out = ad.scaled_dot_product_attention(Q, K, V, is_causal=True)
    parts = partial_keys(out)
    assert len(parts) == 10                             # 4 x 4 blocks, 10 on or below the diagonal
    for deps in parts.values():
        key_blocks = {d for d in deps if d[0] == K.name}
        assert len(key_blocks) == 1                     # one key chunk per task
    # no task returns more than a (query chunk, Dv) block: the graph has
    # partials, merges and the output blocks only, never an N x M array
    np.testing.assert_allclose(out.compute(), ref(q, k, v, causal=1)[0], rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("split_every", [2, 3, 16])
def test_tree_reduction(split_every):
    q, k, v = qkv(1, 2, 9, 80)
    res, out = run(q, k, v, qc=-1, kc=10, split_every=split_every)
    np.testing.assert_allclose(res, ref(q, k, v)[0], rtol=1e-11, atol=1e-12)
    deps = out.__dask_graph__().get_all_dependencies()
    merges = [key for key in deps if isinstance(key, tuple) and key[0].endswith("-merge")]
    for key in merges:
        assert len(deps[key]) <= split_every
    expected = {2: 7, 3: 4, 16: 1}[split_every]          # merge tasks per output block
    assert len(merges) == expected


MASKS = ["bool", "float", "padding", "query_padding", "2d", "bool_with_empty_rows"]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kind", MASKS)
@pytest.mark.parametrize("mask_dask", [True, False])
@pytest.mark.parametrize("causal", [False, True, "lower_right"])
def test_masks(dtype, kind, mask_dask, causal):
    N, M = 21, 34
    q, k, v = qkv(2, 2, N, M, dtype=dtype)
    mask = make_mask(kind, 2, 2, N, M)
    res, out = run(q, k, v, mask, qc=8, kc=(10, 4, 20), mask_dask=mask_dask, is_causal=causal)
    r = ref(q, k, v, mask, causal=CAUSAL[causal])[0]
    np.testing.assert_allclose(res, r, **TOL[dtype])
    ok = np.broadcast_to(allowed(N, M, mask, CAUSAL[causal]), (2, 2, N, M))
    assert np.all(res[~ok.any(-1)] == 0)              # rows with nothing to attend give 0


def test_numpy_mask_removes_fully_masked_pairs():
    N, M = 16, 40
    q, k, v = qkv(2, 1, N, M)
    mask = np.ones((2, 1, 1, M), dtype=bool)
    mask[:, ..., 20:] = False                     # key chunks 2 and 3 (of 10) masked everywhere
    mask[1, ..., :10] = False                     # and chunk 0 for batch element 1
    Q, K, V = chunked(q, 1, 1, 8, -1), chunked(k, 1, 1, 10, -1), chunked(v, 1, 1, 10, -1)
    out = ad.scaled_dot_product_attention(Q, K, V, mask)
    assert len(partial_keys(out)) == 2 * (2 + 1)   # query chunks x live key chunks
    np.testing.assert_allclose(out.compute(), ref(q, k, v, mask)[0], rtol=1e-11, atol=1e-12)
    # a dask mask is not inspected: every pair runs, same result
    outd = ad.scaled_dot_product_attention(Q, K, V, chunked(mask, 1, 1, 1, 10))
    assert len(partial_keys(outd)) == 2 * 2 * 4
    np.testing.assert_allclose(outd.compute(), out.compute(), rtol=1e-12, atol=0)
    # a query chunk whose every key chunk is removed still gives its (zero) block
    mask2 = np.zeros((N, M), dtype=bool)
    mask2[8:, :5] = True
    out2 = ad.scaled_dot_product_attention(Q, K, V, mask2)
    res2 = out2.compute()
    assert np.all(res2[..., :8, :] == 0)
    np.testing.assert_allclose(res2, ref(q, k, v, mask2)[0], rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("Hk", [1, 2, 3])
@pytest.mark.parametrize("hc", [None, 1, 2, 4])
@pytest.mark.parametrize("causal", [False, "lower_right"])
def test_gqa(dtype, Hk, hc, causal):
    N, M = 11, 19
    q, k, v = qkv(2, 6, N, M, dtype=dtype, Hk=Hk)
    Q = chunked(q, 1, hc or 6, 4, -1)
    hk = Hk if hc is None else max(1, min(Hk, hc))
    K, V = chunked(k, 2, hk, 7, -1), chunked(v, 1, Hk, 7, -1)
    out = ad.scaled_dot_product_attention(Q, K, V, enable_gqa=True, is_causal=causal)
    r = ref(q, k, v, causal=CAUSAL[causal], group=6 // Hk)[0]
    np.testing.assert_allclose(out.compute(), r, **TOL[dtype])
    assert sum(out.chunks[1]) == 6
    if Hk > 1:     # without enable_gqa the heads do not broadcast: the error says so
        with pytest.raises(ValueError, match="pass enable_gqa=True"):
            ad.scaled_dot_product_attention(Q, K, V)


def test_broadcast_batch_dims_and_batch_chunks_unified():
    N, M = 12, 20
    q = rand((4, 3, N, 8), 1, np.float64)
    k = rand((1, 3, M, 8), 2, np.float64)                 # shared over the batch
    v = rand((3, M, 6), 3, np.float64)                    # no batch axis
    mask = rand((4, 1, 1, M), 4, np.float64) > -1.0
    Q = chunked(q, (1, 3), (2, 1), 5, -1)
    K = chunked(k, 1, (1, 2), 7, -1)
    V = chunked(v, 3, 7, -1)
    out = ad.scaled_dot_product_attention(Q, K, V, chunked(mask, 2, 1, 1, 7))
    assert out.shape == (4, 3, N, 6)
    assert out.chunks[:2] == ((1, 1, 2), (1, 1, 1))
    np.testing.assert_allclose(out.compute(), ref(q, k, v, mask)[0], rtol=1e-11, atol=1e-12)
    # a mask with more dimensions than the operands widens the output
    m5 = rand((2, 1, 1, N, M), 5, np.float64) > 0
    out5 = ad.scaled_dot_product_attention(Q, K, V, m5)
    assert out5.shape == (2, 4, 3, N, 6)
    np.testing.assert_allclose(out5.compute(), ref(q, k, v, m5)[0], rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [False, True])
def test_nan_in_attended_inputs(dtype, causal):
    N, M = 10, 24
    q0, k0, v0 = qkv(1, 1, N, M, dtype=dtype)
    q, k, v = q0.copy(), k0.copy(), v0.copy()
    q[0, 0, 6, 2] = np.nan                     # one query row
    v[0, 0, 15, 1] = np.nan                    # a value that rows >= 15 attend (causal)
    k[0, 0, 20, 0] = np.nan                    # a key of another chunk
    res, _ = run(q, k, v, qc=4, kc=8, is_causal=causal)
    rows = np.isnan(res[0, 0]).any(-1)
    if causal:
        # rows 0..9 see keys <= row: none of the NaN keys / values but the
        # query's own; the others equal the computation without NaN (the
        # reference would let 0 * NaN of unattended values through)
        assert rows.tolist() == [i == 6 for i in range(N)]
        np.testing.assert_allclose(np.delete(res[0, 0], 6, 0),
                                   np.delete(ref(q0, k0, v0, causal=1)[0][0, 0], 6, 0), **TOL[dtype])
    else:
        assert rows.all()


def test_float16_and_mixed_dtypes():
    q, k, v = qkv(1, 2, 9, 13, dtype=np.float16)
    res, out = run(q, k, v, qc=4, kc=5)
    assert out.dtype == np.float16 and res.dtype == np.float16
    np.testing.assert_allclose(res, ref(q, k, v)[0], rtol=2e-3, atol=2e-3)
    res, out = run(q.astype(np.float32), k, v.astype(np.float64), qc=4, kc=5)
    assert res.dtype == np.float64


def test_numpy_operands_are_wrapped_and_not_modified():
    q, k, v = qkv(2, 2, 9, 30)
    mask = rand((2, 1, 9, 30), 4, np.float64) > -0.5
    copies = [x.copy() for x in (q, k, v, mask)]
    K = chunked(k, 1, 2, 10, -1)
    out = ad.scaled_dot_product_attention(q, K, v, mask, is_causal="lower_right")
    assert out.chunks[-2] == (9,)
    assert len({key[-1] for key in partial_keys(out)}) == 3     # v and mask follow key's chunks
    np.testing.assert_allclose(out.compute(), ref(q, k, v, mask, causal=2)[0], rtol=1e-11, atol=1e-12)
    out = ad.scaled_dot_product_attention(q, k, v)            # all NumPy: one chunk each
    np.testing.assert_allclose(out.compute(), ref(q, k, v)[0], rtol=1e-11, atol=1e-12)
    for x, c in zip((q, k, v, mask), copies):
        np.testing.assert_array_equal(x, c)


def test_chunked_head_dims_and_scale():
    q, k, v = qkv(1, 2, 10, 12, D=16, Dv=10)
    Q, K, V = chunked(q, 1, 1, 5, 4), chunked(k, 1, 2, 6, 8), chunked(v, 1, 2, 6, 3)
    out = ad.scaled_dot_product_attention(Q, K, V, scale=0.2)
    assert out.chunks[-1] == (10,)
    np.testing.assert_allclose(out.compute(), ref(q, k, v, scale=0.2)[0], rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("shape", [(0, 5), (5, 0), (0, 0)])
def test_empty_lengths(shape):
    N, M = shape
    q, k, v = qkv(1, 2, N, M)
    out = ad.scaled_dot_product_attention(chunked(q, 1, 1, 3, -1), chunked(k, 1, 1, 3, -1),
                                          chunked(v, 1, 1, 3, -1))
    res = out.compute()
    assert res.shape == (1, 2, N, 8) and np.all(res == 0)


@pytest.mark.parametrize("batch", [(0, 2), (2, 0)])
def test_empty_batch_axes_with_a_mask(batch):
    """A batch or head axis of size 0 beside a mask of the same shape: an
    empty result, as in memory (dask refused the empty chunking)."""
    B, H = batch
    q, k, v = qkv(B, H, 4, 6)
    mask = np.ones((B, H, 4, 6), bool)
    out = ad.scaled_dot_product_attention(chunked(q, 1, 1, 2, -1), chunked(k, 1, 1, 3, -1),
                                          chunked(v, 1, 1, 3, -1), attn_mask=mask)
    assert out.compute().shape == (B, H, 4, 8)


def test_num_threads_passes_through():
    q, k, v = qkv(1, 2, 40, 50)
    for nt in (None, -1, 2):
        res, _ = run(q, k, v, qc=20, kc=25, num_threads=nt)
        np.testing.assert_allclose(res, ref(q, k, v)[0], rtol=1e-11, atol=1e-12)


# ---------------------------------------------------------------- the core's options
def live_pairs(ok, qchunks, kchunks):
    """The (query chunk, key chunk) pairs in which some query sees some key."""
    qb, kb = np.cumsum((0,) + tuple(qchunks)), np.cumsum((0,) + tuple(kchunks))
    return {(i, j) for i in range(len(qb) - 1) for j in range(len(kb) - 1)
            if ok[qb[i]:qb[i + 1], kb[j]:kb[j + 1]].any()}


def task_pairs(out):
    return {key[-2:] for key in partial_keys(out)}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [False, True, "lower_right"])
@pytest.mark.parametrize("window", [(6, 0), (3, 5), (-1, 4), (9, -1), (0, 0), (4, 2)])
@pytest.mark.parametrize("N,M,qc,kc", [(40, 40, 7, 5), (24, 45, 8, 6), (45, 24, 6, 8),
                                       (1, 33, 1, 4), (30, 30, (3, 20, 7), (11, 2, 17))])
def test_window_matches_band_and_skips_blocks_outside_it(dtype, causal, window, N, M, qc, kc):
    q, k, v = qkv(2, 2, N, M, dtype=dtype)
    res, out = run(q, k, v, qc=qc, kc=kc, is_causal=causal, window=window)
    ok = allowed(N, M, causal=CAUSAL[causal], window=window)
    np.testing.assert_allclose(res, ref(q, k, v, ok)[0], **TOL[dtype])
    # the in-memory call agrees too
    core = attncore.scaled_dot_product_attention(q, k, v, is_causal=causal, window=window)
    np.testing.assert_allclose(res, core, **TOL[dtype])
    qch = da.from_array(q, chunks=(1, 2, qc, -1)).chunks[-2]
    kch = da.from_array(k, chunks=(1, 2, kc, -1)).chunks[-2]
    assert task_pairs(out) == live_pairs(ok, qch, kch)


def test_windowed_causal_graph_has_no_task_outside_the_band():
    """A long causal sequence with a short window: the tasks are exactly the
    (query chunk, key chunk) pairs the band crosses -- a diagonal strip,
    not the lower triangle."""
    N = M = 4096
    q, k, v = (da.zeros((1, 2, N, 16), chunks=(1, 2, 256, 16), dtype=np.float32)
               for _ in range(3))
    out = ad.scaled_dot_product_attention(q, k, v, is_causal=True, window=(300, 0))
    ok = allowed(N, M, causal=1, window=(300, 0))
    pairs = task_pairs(out)
    assert pairs == live_pairs(ok, q.chunks[-2], k.chunks[-2])
    # rows 256 i .. 256 i + 255 see keys from 256 i - 300: key chunks i, i - 1, i - 2
    assert len(pairs) == 16 + 15 + 14                # 136 under plain causal
    assert all(0 <= i - j <= 2 for i, j in pairs)


@pytest.mark.parametrize("causal", [False, True])
def test_softcap(causal):
    q, k, v = qkv(2, 3, 30, 41, D=16)
    q *= 4.0                               # scores of several units: the cap matters
    res, _ = run(q, k, v, qc=8, kc=9, is_causal=causal, softcap=2.5)
    o = sdpa_ref(q, k, v, is_causal=causal, softcap=2.5)
    np.testing.assert_allclose(res, o, rtol=1e-10, atol=1e-11)
    assert not np.allclose(res, ref(q, k, v, causal=int(causal))[0], atol=1e-3)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal,window", [(False, None), (True, (5, 0)), ("lower_right", None)])
def test_return_lse(dtype, causal, window):
    q, k, v = qkv(2, 2, 23, 37, dtype=dtype)
    mask = rand((2, 1, 1, 37), 9, np.float64) > -0.8
    (res, lse), (out, lse_d) = run(q, k, v, mask, qc=6, kc=7, is_causal=causal, window=window,
                                   return_lse=True, mask_dask=False)
    o, l_ref = sdpa_ref(q, k, v, mask, causal, window=window, return_lse=True)
    np.testing.assert_allclose(res, o, **TOL[dtype])
    np.testing.assert_allclose(lse, l_ref, **TOL[dtype])
    core_out, core_lse = attncore.scaled_dot_product_attention(
        q, k, v, mask, is_causal=causal, window=window, return_lse=True)
    assert lse.dtype == core_lse.dtype and lse_d.chunks == out.chunks[:-1]
    np.testing.assert_allclose(lse, core_lse, **TOL[dtype])


def test_return_lse_of_rows_with_nothing_to_attend():
    # lower-right with N > M: the first rows see no key; a key chunk holds
    # no partial for them, so their lse is -inf and their output 0
    q, k, v = qkv(1, 1, 20, 8)
    (res, lse), _ = run(q, k, v, qc=5, kc=3, is_causal="lower_right", return_lse=True)
    assert np.all(np.isneginf(lse[..., :12])) and np.all(res[..., :12, :] == 0)
    np.testing.assert_allclose(lse[..., 12:], lse_ref(q, k, causal=2)[..., 12:],
                               rtol=1e-12)


def test_return_lse_with_empty_value_columns():
    q, k, v = qkv(1, 2, 9, 14, Dv=0)
    (res, lse), _ = run(q, k, v, qc=4, kc=5, return_lse=True)
    assert res.shape == (1, 2, 9, 0)
    np.testing.assert_allclose(lse, lse_ref(q, k), rtol=1e-12)


def pair_parts(x, dask_data, dask_scales, kc):
    d, s = attncore.quantize_kv(x)
    if dask_data:
        d = chunked(d, 1, x.shape[1], kc, -1)
    if dask_scales:
        s = chunked(s, 1, 1, 5)           # chunked its own way: rechunked like the data
    return d, s


@pytest.mark.parametrize("which", ["key", "value", "both"])
@pytest.mark.parametrize("dask_data,dask_scales", [(True, True), (True, False), (False, True)])
def test_int8_pairs_match_the_core(which, dask_data, dask_scales):
    q, k, v = qkv(2, 2, 26, 35, D=16, Dv=8, dtype=np.float32)
    kk = pair_parts(k, dask_data, dask_scales, 7) if which in ("key", "both") else chunked(k, 1, 2, 7, -1)
    vv = pair_parts(v, dask_data, dask_scales, 7) if which in ("value", "both") else chunked(v, 1, 2, 7, -1)
    mask = rand((2, 1, 26, 35), 3, np.float64) > -1.0
    out, lse = ad.scaled_dot_product_attention(chunked(q, 1, 2, 9, -1), kk, vv, mask,
                                               is_causal="lower_right", window=(20, 0),
                                               return_lse=True)
    res, res_lse = dask.compute(out, lse)

    def mem(p):
        return tuple(np.asarray(x) for x in p) if isinstance(p, tuple) else np.asarray(p)
    core, core_lse = attncore.scaled_dot_product_attention(
        q, mem(kk), mem(vv), mask, is_causal="lower_right", window=(20, 0), return_lse=True)
    assert res.dtype == core.dtype == np.float32
    np.testing.assert_allclose(res, core, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(res_lse, core_lse, rtol=2e-5, atol=2e-6)
    # and against float64 attention over the dequantized arrays
    deq = {"key": k, "value": v}
    for nm, p in (("key", kk), ("value", vv)):
        if isinstance(p, tuple):
            d, s = mem(p)
            deq[nm] = d.astype(np.float64) * s[..., None]
    np.testing.assert_allclose(res, sdpa_ref(q, deq["key"], deq["value"], mask, "lower_right", window=(20, 0)),
                               rtol=2e-4, atol=2e-5)


def test_int8_pairs_with_gqa_and_float64_query():
    q, k, v = qkv(1, 4, 12, 30, Hk=2)
    kq, vq = attncore.quantize_kv(k), attncore.quantize_kv(v)
    out = ad.scaled_dot_product_attention(
        chunked(q, 1, 2, 5, -1), (chunked(kq[0], 1, 1, 10, -1), kq[1]),
        (chunked(vq[0], 1, 1, 10, -1), vq[1]), enable_gqa=True).compute()
    core = attncore.scaled_dot_product_attention(q, kq, vq, enable_gqa=True)
    assert out.dtype == np.float64
    np.testing.assert_allclose(out, core, rtol=1e-12, atol=1e-13)


def test_num_threads_default_is_the_cores():
    import inspect

    core = inspect.signature(attncore.scaled_dot_product_attention).parameters
    ours = inspect.signature(ad.scaled_dot_product_attention).parameters
    assert ours["num_threads"].default is core["num_threads"].default is None
    # every option of the core but return_weights is taken, with its default
    # (alibi_slopes and sinks are not: their terms depend on the absolute
    # positions / the whole row, which key-chunked partials do not see)
    for nm, p in core.items():
        if nm not in ("return_weights", "alibi_slopes", "sinks"):
            assert nm in ours and ours[nm].default == p.default, nm


def _q8():
    q, k, v = qkv(1, 2, 8, 12)
    return chunked(q, 1, 1, 4, -1), chunked(k, 1, 1, 6, -1), chunked(v, 1, 1, 6, -1), q, k, v


@pytest.mark.parametrize("kw", [
    dict(window=(-2, 0)), dict(window=5), dict(window=(1.5, 0)), dict(softcap=0.0),
    dict(softcap="3"), dict(return_lse="yes"), dict(num_threads=0), dict(num_threads=1.5),
    dict(key="int8"), dict(key="pair-float"), dict(key="pair-short-scales"),
    dict(value="int8"),
], ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_errors_are_the_cores(kw):
    """The same bad argument gives the same exception and message as the
    in-memory call: the checks are the core's own."""
    Q, K, V, q, k, v = _q8()
    kw = dict(kw)
    dask_args, core_args = [Q, K, V], [q, k, v]
    for pos, nm in ((1, "key"), (2, "value")):
        what = kw.pop(nm, None)
        src = (k, v)[pos - 1]
        if what == "int8":
            core_args[pos] = attncore.quantize_kv(src)[0]
            dask_args[pos] = chunked(core_args[pos], 1, 1, 6, -1)
        elif what == "pair-float":
            core_args[pos] = (src, np.ones(src.shape[:-1], np.float32))
            dask_args[pos] = (chunked(src, 1, 1, 6, -1), core_args[pos][1])
        elif what == "pair-short-scales":
            d, s = attncore.quantize_kv(src)
            core_args[pos] = (d, s[..., :5])
            dask_args[pos] = (chunked(d, 1, 1, 6, -1), s[..., :5])
    with pytest.raises((TypeError, ValueError)) as core_err:
        attncore.scaled_dot_product_attention(*core_args, **kw)
    with pytest.raises(core_err.type) as ours:
        ad.scaled_dot_product_attention(*dask_args, **kw)
    assert str(ours.value) == str(core_err.value)


# ---------------------------------------------------------------- errors
def _ops():
    q, k, v = qkv(1, 2, 8, 12)
    return chunked(q, 1, 1, 4, -1), chunked(k, 1, 1, 6, -1), chunked(v, 1, 1, 6, -1)


@pytest.mark.parametrize("arg", ["query", "key", "value", "attn_mask"])
def test_non_arrays_rejected(arg):
    Q, K, V = _ops()
    kw = dict(query=Q, key=K, value=V, attn_mask=None)
    kw[arg] = np.ones((1, 2, 8, 12), dtype=bool).tolist() if arg == "attn_mask" else Q.compute().tolist()
    with pytest.raises(TypeError, match=arg):
        ad.scaled_dot_product_attention(**kw)


def test_bad_dtypes_rejected():
    Q, K, V = _ops()
    with pytest.raises(TypeError, match="key must be a bfloat16, float16, float32 or float64"):
        ad.scaled_dot_product_attention(Q, K.astype(int), V)
    with pytest.raises(TypeError, match="attn_mask"):
        ad.scaled_dot_product_attention(Q, K, V, da.ones((8, 12), dtype=np.int8))


def test_key_chunks_must_agree():
    Q, K, V = _ops()
    with pytest.raises(ValueError, match=r"value must be chunked like key.*\(6, 6\).*\(4, 4, 4\)"):
        ad.scaled_dot_product_attention(Q, K, V.rechunk({2: 4}))
    mask = da.ones((1, 1, 8, 12), chunks=(1, 1, 4, 4), dtype=bool)
    with pytest.raises(ValueError, match=r"attn_mask must be chunked like key.*\(4, 4, 4\).*\(6, 6\)"):
        ad.scaled_dot_product_attention(Q, K, V, mask)
    mask = da.ones((1, 1, 8, 12), chunks=(1, 1, 8, 6), dtype=bool)
    with pytest.raises(ValueError, match=r"attn_mask must be chunked like query.*\(8,\).*\(4, 4\)"):
        ad.scaled_dot_product_attention(Q, K, V, mask)


def test_unknown_chunks_cannot_be_unified():
    Q, K, V = _ops()
    rows = da.from_array(np.arange(2), chunks=1)
    Kn = K[:, rows >= 0]                                  # unknown head chunk sizes
    with pytest.raises(ValueError, match=r"key has unknown chunk sizes.*cannot be unified"):
        ad.scaled_dot_product_attention(Q, Kn, V[:, :2])
    Qn = Q[:, :, da.from_array(np.arange(8), chunks=4) >= 0]
    with pytest.raises(ValueError, match=r"query has unknown chunk sizes.*compute_chunk_sizes"):
        ad.scaled_dot_product_attention(Qn, K, V)


def test_shape_and_option_errors():
    Q, K, V = _ops()
    with pytest.raises(ValueError, match="key last dimension"):
        ad.scaled_dot_product_attention(Q, K[..., :4], V)
    with pytest.raises(ValueError, match="value must have as many rows as key"):
        ad.scaled_dot_product_attention(Q, K, V[:, :, :5])
    with pytest.raises(ValueError, match="attn_mask must be broadcastable"):
        ad.scaled_dot_product_attention(Q, K, V, da.ones((8, 5), dtype=bool))
    with pytest.raises(ValueError, match="not broadcastable"):
        ad.scaled_dot_product_attention(da.concatenate([Q] * 2), da.concatenate([K] * 3), V)
    with pytest.raises(ValueError, match="is_causal"):
        ad.scaled_dot_product_attention(Q, K, V, is_causal="lower")
    with pytest.raises(ValueError, match="split_every"):
        ad.scaled_dot_product_attention(Q, K, V, split_every=1)
    with pytest.raises(TypeError, match="num_threads"):
        ad.scaled_dot_product_attention(Q, K, V, num_threads=1.5)
    with pytest.raises(ValueError, match="scale"):
        ad.scaled_dot_product_attention(Q, K, V, scale=-1.0)


# ---------------------------------------------------------------- layers
class Halved(attncore.Alignment):
    """A plugin: half the dot product, with a learned per-feature weight."""

    def __init__(self, weight=None):
        self.weight = None if weight is None else np.asarray(weight, dtype=np.float64)

    def score(self, query, prepared):
        w = 1.0 if self.weight is None else self.weight.astype(query.dtype)
        return 0.5 * np.matmul(query * w, np.swapaxes(prepared, -1, -2))


@pytest.fixture
def plugin():
    attncore.alignments.register("dask_test_halved", Halved, replace=True)
    yield "dask_test_halved"
    _registry._unregister("dask_test_halved")


def builtin_layers(D, rng):
    A = 6
    mlp = dict(q_weight=rng.standard_normal((A, D)), k_weight=rng.standard_normal((A, D)),
               v=rng.standard_normal(A), bias=rng.standard_normal(A))
    return {
        "dot": attncore.Attention("dot", scale=0.7),
        "scaled_dot": attncore.Attention("scaled_dot"),
        "bilinear": attncore.Attention("bilinear", weight=rng.standard_normal((D, D))),
        "general": attncore.Attention("general", weight=rng.standard_normal((D, D)),
                                      combine_weight=rng.standard_normal((2 * D, 5))),
        "mlp": attncore.Attention("mlp", **mlp),
        "additive": attncore.Attention("additive", **mlp),
        "concat": attncore.Attention("concat", **{**mlp, "bias": None}),
    }


def test_every_builtin_alignment_is_covered():
    # installed plugins (CI installs attncore-cosine) are not built-ins
    builtin = {name for name, info in attncore.alignments.available(details=True).items()
               if info["origin"] == "built-in"}
    assert set(builtin_layers(4, np.random.default_rng(0))) == builtin


def _same_layer_output(a, b, *args, **kw):
    ra, rb = a(*args, **kw), b(*args, **kw)
    ra = ra if isinstance(ra, tuple) else (ra,)
    rb = rb if isinstance(rb, tuple) else (rb,)
    for x, y in zip(ra, rb):
        if x is None:
            assert y is None
        else:
            np.testing.assert_array_equal(x, y)


def test_layers_pickle_with_their_weights(plugin):
    rng = np.random.default_rng(0)
    D = 8
    x = rng.standard_normal((3, 5, D)).astype(np.float32)
    keys = rng.standard_normal((3, 7, D)).astype(np.float32)
    mask = rng.random((3, 7)) > 0.3
    layers = dict(builtin_layers(D, rng))
    layers["plugin"] = attncore.Attention(plugin, weight=rng.standard_normal(D))
    for name, layer in layers.items():
        back = pickle.loads(pickle.dumps(layer))
        assert type(back.alignment) is type(layer.alignment), name
        _same_layer_output(layer, back, x, keys, mask=mask, return_weights=True)
    for mha in (attncore.MultiHeadAttention(D, 4, rng=1),
                attncore.MultiHeadAttention(D, 4, num_kv_heads=2, kdim=6, vdim=5, rng=2,
                                            dtype=np.float64)):
        back = pickle.loads(pickle.dumps(mha))
        for w in ("q_weight", "k_weight", "v_weight", "out_weight", "q_bias", "out_bias"):
            np.testing.assert_array_equal(getattr(back, w), getattr(mha, w))
        kin = rng.standard_normal((3, 7, mha.k_weight.shape[1]))
        vin = rng.standard_normal((3, 7, mha.v_weight.shape[1]))
        _same_layer_output(mha, back, x, kin, vin, key_mask=mask, need_weights=True)


def test_map_batches_multi_head_attention():
    rng = np.random.default_rng(1)
    mha = attncore.MultiHeadAttention(16, 4, num_kv_heads=2, rng=0)
    x = rng.standard_normal((11, 6, 16)).astype(np.float32)
    valid = rng.random((11, 6)) > 0.3
    valid[4] = False                                        # a fully padded sequence
    X = chunked(x, 3, 6, 16)
    out, w = ad.map_batches(mha, X, key_mask=chunked(valid, 4, 6))
    assert w is None and isinstance(out, da.Array) and out.shape == (11, 6, 16)
    r_out, _ = mha(x, key_mask=valid)
    np.testing.assert_allclose(out.compute(), r_out, rtol=1e-6, atol=1e-6)
    out, w = ad.map_batches(mha, X, key_mask=chunked(valid, 4, 6), need_weights=True, is_causal=True)
    r_out, r_w = mha(x, key_mask=valid, need_weights=True, is_causal=True)
    np.testing.assert_allclose(out.compute(), r_out, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(w.compute(), r_w, rtol=1e-6, atol=1e-6)
    # the layer is one key of the graph, shared by every batch task
    layer_keys = [k for k, val in dict(out.__dask_graph__()).items()
                  if not isinstance(k, tuple) and k.startswith("attncore-map-batches-fn")]
    assert len(layer_keys) == 1


@pytest.mark.parametrize("name", ["dot", "scaled_dot", "bilinear", "general", "mlp", "additive",
                                  "concat", "plugin"])
def test_map_batches_attention_layers(name, plugin):
    rng = np.random.default_rng(2)
    D = 8
    layer = (attncore.Attention(plugin, weight=rng.standard_normal(D)) if name == "plugin"
             else builtin_layers(D, rng)[name])
    query = rng.standard_normal((9, 4, D))
    keys = rng.standard_normal((9, 7, D))
    mask = rng.random((9, 7)) > 0.3
    res = ad.map_batches(layer, chunked(query, 4, 4, D), keys, mask=chunked(mask, 2, 7),
                         return_weights=True)
    expected = layer(query, keys, mask=mask, return_weights=True)
    assert isinstance(res, tuple) and len(res) == len(expected)
    for got, exp in zip(res, expected):
        assert got.chunks[0] == (2, 2, 2, 2, 1)
        np.testing.assert_allclose(got.compute(), exp, rtol=1e-12, atol=1e-12)


def test_map_batches_any_callable_and_errors():
    x = rand((10, 3), dtype=np.float64)
    res = ad.map_batches(lambda a, b, *, c: a * b + c, chunked(x, 4, 3), x, c=1.0)
    np.testing.assert_allclose(res.compute(), x * x + 1.0)
    with pytest.raises(TypeError, match="fn must be callable"):
        ad.map_batches(3, x)
    with pytest.raises(TypeError, match=r"arrays\[1\]"):
        ad.map_batches(np.add, x, [1, 2])
    with pytest.raises(ValueError, match=r"arrays\[1\] has batch length 4"):
        ad.map_batches(np.add, chunked(x, 5, 3), x[:4])
    with pytest.raises(ValueError, match="keep the batch axis first"):
        ad.map_batches(lambda a: a.sum(0), chunked(x, 5, 3))


# ---------------------------------------------------------------- packaging
def test_import_attncore_does_not_import_dask():
    code = ("import sys, attncore; bad = [m for m in ('dask', 'distributed', 'dask.array') "
            "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


# ---------------------------------------------------------------- a real cluster
def test_local_cluster_two_processes():
    distributed = pytest.importorskip("distributed")
    q, k, v = qkv(1, 2, 48, 64, D=16, Dv=16, dtype=np.float32)
    mask = rand((1, 1, 1, 64), 4, np.float64) > -1.0
    mha = attncore.MultiHeadAttention(16, 4, rng=0)
    x = rand((12, 10, 16), 5)
    valid = rand((12, 10), 6, np.float64) > -0.5
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                  dashboard_address=None, silence_logs=40) as cluster, \
            distributed.Client(cluster) as client:
        out = ad.scaled_dot_product_attention(chunked(q, 1, 1, 16, -1), chunked(k, 1, 1, 16, -1),
                                              chunked(v, 1, 1, 16, -1), mask,
                                              is_causal="lower_right")
        enc, _ = ad.map_batches(mha, chunked(x, 3, 10, 16), key_mask=chunked(valid, 3, 10))
        # the core's options: window, softcap, int8 key / value pairs, lse
        kq, vq = attncore.quantize_kv(k), attncore.quantize_kv(v)
        opts = dict(is_causal="lower_right", window=(20, 0), softcap=3.0, return_lse=True)
        out8, lse8 = ad.scaled_dot_product_attention(
            chunked(q, 1, 1, 16, -1), (chunked(kq[0], 1, 1, 16, -1), kq[1]),
            (chunked(vq[0], 1, 1, 16, -1), chunked(vq[1], 1, 1, 16)), mask, **opts)
        res, res_enc, res8, res_lse8 = client.compute([out, enc, out8, lse8], sync=True)
        workers = client.run(lambda: os.getpid())
    assert len(set(workers.values())) == 2
    np.testing.assert_allclose(res, ref(q, k, v, mask, causal=2)[0], rtol=5e-5, atol=5e-6)
    np.testing.assert_allclose(res_enc, mha(x, key_mask=valid)[0], rtol=1e-6, atol=1e-6)
    core8, core_lse8 = attncore.scaled_dot_product_attention(q, kq, vq, mask, **opts)
    np.testing.assert_allclose(res8, core8, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(res_lse8, core_lse8, rtol=2e-5, atol=2e-6)


def test_empty_chunks_on_broadcast_axes():
    """A size-1 (broadcast) axis chunked (0, 1) -- what compute_chunk_sizes
    gives after boolean indexing -- is read as its one element: the result
    declared (3, 6, 4) computed as (0, 6, 4) or failed, and such a mask
    axis gave a false shape error."""
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((1, 6, 4)), rng.standard_normal((3, 8, 4))
    out = ad.scaled_dot_product_attention(da.from_array(q, chunks=((0, 1), 6, 4)),
                                          chunked(k, 1, 4, -1), chunked(k, 1, 4, -1))
    assert out.shape == (3, 6, 4)
    np.testing.assert_allclose(out.compute(), ref(q, k, k)[0], rtol=1e-11, atol=1e-12)
    q3 = rng.standard_normal((3, 3, 4))
    for mshape, mchunks in (((3, 1, 8), (1, (0, 1), 4)), ((3, 3, 1), (1, 3, (0, 1)))):
        m = rng.random(mshape) > 0.3
        m[..., 0] = True
        out = ad.scaled_dot_product_attention(
            chunked(q3, 1, 3, -1), chunked(k, 1, 4, -1), chunked(k, 1, 4, -1),
            attn_mask=da.from_array(m, chunks=mchunks))
        np.testing.assert_allclose(out.compute(), ref(q3, k, k, m)[0], rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("sign", [1, -1])
def test_float32_scores_beyond_the_float32_range_over_key_chunks(sign):
    """Scores beyond the float32 range: each key chunk's float64 re-run
    keeps its lse in float64 for the merge (cast to float32 it became
    +-inf, and the merged rows NaN).  The result is the in-memory call's,
    which the float64 reference gives."""
    rng = np.random.default_rng(1)
    q = (np.abs(rng.standard_normal((4, 8))) * 1e20).astype(np.float32)
    k = (sign * np.abs(rng.standard_normal((16, 8))) * 1e20).astype(np.float32)
    v = rng.standard_normal((16, 3)).astype(np.float32)
    scale = 1.0
    want = ref(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64), scale=scale)[0]
    for kc in (16, 8, 4):
        out = ad.scaled_dot_product_attention(q, chunked(k, kc, 8), chunked(v, kc, 3), scale=scale)
        np.testing.assert_allclose(out.compute(), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(attncore.scaled_dot_product_attention(q, k, v, scale=scale), want,
                               rtol=1e-5, atol=1e-6)


def test_values_near_the_float32_maximum_over_key_chunks():
    """The merge of key chunks sums in float64: values near the float32
    maximum gave inf (the in-memory call gives the finite answer)."""
    q, k = np.zeros((2, 4), np.float32), np.zeros((8, 4), np.float32)
    v = np.full((8, 1), 3e38, np.float32)
    for kc in (4, 1):
        out = ad.scaled_dot_product_attention(q, chunked(k, kc, 4), chunked(v, kc, 1)).compute()
        np.testing.assert_allclose(out, np.full((2, 1), 3e38), rtol=1e-6)


def test_split_every_from_a_dask_config_dict():
    """dask's reductions take split_every={axis: n} from dask.config: the
    merge tree takes the largest n (a TypeError leaked before)."""
    q, k, v = qkv(1, 2, 4, 12)
    want = ref(q, k, v)[0]
    with dask.config.set(split_every={0: 2, 1: 3}):
        out = ad.scaled_dot_product_attention(q, chunked(k, 1, 1, 1, -1), chunked(v, 1, 1, 1, -1))
        np.testing.assert_allclose(out.compute(), want, rtol=1e-11, atol=1e-12)
    with dask.config.set(split_every="x"):
        with pytest.raises(TypeError, match="dask.config's split_every"):
            ad.scaled_dot_product_attention(q, chunked(k, 1, 1, 1, -1), chunked(v, 1, 1, 1, -1))
