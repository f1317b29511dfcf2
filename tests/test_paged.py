"""paged_attention and PagedKVCache against plain float64 references.

The reference gathers each sequence's keys from its blocks (NumPy fancy
indexing) and runs the float64 attention of tests/reference.py on them.
Blocks and slots no sequence owns are filled with NaN, so a kernel that
reads outside a sequence's keys shows it.
"""
import tracemalloc
import warnings

import numpy as np
import pytest

import attncore
from attncore import PagedKVCache, paged_attention
from attncore._core import _sdpa
from reference import rand, sdpa_ref

PATHS = _sdpa.available_kernel_paths()


def make_batch(lens, nqs, Hq=8, Hk=2, D=32, Dv=None, bs=16, seed=0, extra_blocks=7,
               dtype=np.float32):
    """(q, k_cache, v_cache, block_table, seq_lens, cu_q): shuffled block
    tables; unused blocks, unused slots and unused table entries hold NaN /
    -1 garbage."""
    rng = np.random.default_rng(seed)
    Dv = D if Dv is None else Dv
    lens = np.asarray(lens)
    nblk = -(-lens // bs)
    NB = int(nblk.sum()) + extra_blocks
    kc = np.full((NB, bs, Hk, D), np.nan, np.float32)
    vc = np.full((NB, bs, Hk, Dv), np.nan, np.float32)
    perm = rng.permutation(NB)
    bt = np.full((len(lens), int(nblk.max(initial=0)) + 2), -1, np.int32)
    o = 0
    for s, L in enumerate(lens):
        ids = perm[o:o + nblk[s]]
        o += nblk[s]
        bt[s, :len(ids)] = ids
        kk, vv = rand((L, Hk, D), rng), rand((L, Hk, Dv), rng)
        for b, i in enumerate(ids):
            n = min(bs, L - b * bs)
            kc[i, :n], vc[i, :n] = kk[b * bs:b * bs + n], vv[b * bs:b * bs + n]
    cq = np.concatenate([[0], np.cumsum(nqs)]).astype(np.int32)
    q = rand((int(cq[-1]), Hq, D), rng)
    return q.astype(dtype), kc.astype(dtype), vc.astype(dtype), bt, lens.astype(np.int32), cq


def gather(cache, table_row, L):
    """A sequence's keys (L, Hk, D) from its blocks."""
    bs = cache.shape[1]
    nb = -(-L // bs)
    return cache[table_row[:nb]].reshape((nb * bs,) + cache.shape[2:])[:L]


def paged_ref(q, kc, vc, bt, lens, cq, is_causal=True, window=None, softcap=None, alibi=None,
              sinks=None, scale=None):
    """float64 (out, lse) of the paged call, one sequence at a time."""
    Hq, Hk = q.shape[1], kc.shape[2]
    out = np.zeros(q.shape[:2] + (vc.shape[3],))
    lse = np.zeros(q.shape[:2])
    for s in range(len(lens)):
        lo, hi = cq[s], cq[s + 1]
        if hi == lo:
            continue
        K = gather(kc, bt[s], lens[s]).astype(np.float64).transpose(1, 0, 2)
        V = gather(vc, bt[s], lens[s]).astype(np.float64).transpose(1, 0, 2)
        Q = q[lo:hi].astype(np.float64).transpose(1, 0, 2)
        sl = None if alibi is None else np.broadcast_to(alibi, (len(lens), Hq))[s]
        sk = None if sinks is None else np.broadcast_to(sinks, (len(lens), Hq))[s]
        o, ls = sdpa_ref(Q, K, V, is_causal=2 if is_causal else 0, scale=scale, window=window,
                         softcap=softcap, alibi_slopes=sl, sinks=sk, group=Hq // Hk,
                         diagonal="lower_right", return_lse=True)
        out[lo:hi], lse[lo:hi] = o.transpose(1, 0, 2), ls.T
    return out, lse


MIXED = dict(lens=[1, 37, 300, 5, 129, 700, 16, 64], nqs=[1, 1, 100, 5, 1, 64, 16, 1])
OPTIONS = {
    "plain": {},
    "not causal": dict(is_causal=False),
    "window": dict(window=(50, 0)),
    "window alone": dict(is_causal=False, window=(40, 3)),
    "softcap": dict(softcap=5.0),
    "alibi": dict(alibi=np.linspace(0.01, 0.3, 8)),
    "sinks": dict(sinks=np.linspace(-1, 2, 8)),
    "all": dict(window=(90, 0), softcap=8.0, sinks=np.linspace(-1, 2, 8), scale=0.2),
}


def call(q, kc, vc, bt, lens, cq, alibi=None, **kw):
    return paged_attention(q, kc, vc, block_table=bt, seq_lens=lens, cu_seqlens_q=cq,
                           enable_gqa=True, alibi_slopes=alibi, **kw)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", list(OPTIONS))
@pytest.mark.parametrize("threads", [1, 2])
def test_float32_mixed_batch(path, name, threads):
    opts = OPTIONS[name]
    q, kc, vc, bt, lens, cq = make_batch(**MIXED)
    prev = _sdpa.set_kernel_path(path)
    try:
        out, lse = call(q, kc, vc, bt, lens, cq, return_lse=True, num_threads=threads, **opts)
    finally:
        _sdpa.set_kernel_path(prev)
    ref, rlse = paged_ref(q, kc, vc, bt, lens, cq, **opts)
    assert out.dtype == np.float32 and out.shape == (cq[-1], 8, 32)
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=0)
    np.testing.assert_allclose(lse, rlse, atol=2e-5, rtol=1e-6)


@pytest.mark.parametrize("path", [p for p in PATHS if p in _sdpa.PANEL_ROWS])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_window_results_do_not_depend_on_the_thread_count(path, dtype):
    # a window's left edge starts each query block's keys elsewhere, and
    # the block size follows the thread count (one sequence: query blocks
    # of 128 - 32 rows at 1 - 3 threads; under 1024 keys, so no key
    # splits): the fused
    # kernel's tiles and chunks lie on a grid from the sequence's key 0
    # (ac_params.kbase), so the bits do not move (they did at 2 and 3
    # threads; with float16 caches before the chunks of keys too)
    q, kc, vc, bt, lens, cq = make_batch([1000], [300], Hq=1, Hk=1, D=64, bs=64, dtype=dtype,
                                         seed=4)
    prev = _sdpa.set_kernel_path(path)
    try:
        for opts in (dict(window=(100, 0)), dict(is_causal=False, window=(250, 30))):
            outs = [call(q, kc, vc, bt, lens, cq, num_threads=t, **opts) for t in (1, 2, 3)]
            for o in outs[1:]:
                np.testing.assert_array_equal(o, outs[0])
            np.testing.assert_allclose(outs[0], paged_ref(q, kc, vc, bt, lens, cq, **opts)[0],
                                       atol=2e-3 if dtype == np.float16 else 3e-6)
    finally:
        _sdpa.set_kernel_path(prev)


def test_float64_and_dv():
    q, kc, vc, bt, lens, cq = make_batch(**MIXED, Dv=24, dtype=np.float64)
    out = call(q, kc, vc, bt, lens, cq, window=(30, 0), sinks=np.ones(8))
    ref, _ = paged_ref(q, kc, vc, bt, lens, cq, window=(30, 0), sinks=np.ones(8))
    assert out.dtype == np.float64
    np.testing.assert_allclose(out, ref, atol=1e-12, rtol=0)


@pytest.mark.parametrize("Hq,Hk", [(8, 8), (8, 1), (16, 2), (6, 3)])
@pytest.mark.parametrize("D", [1, 7, 64, 128])
def test_decode_head_groups(Hq, Hk, D):
    """One query per sequence: the query heads of a key head run as rows
    of one item (fold); every group size and head size."""
    lens = [1, 3, 17, 64, 200, 513]
    q, kc, vc, bt, lens, cq = make_batch(lens, [1] * 6, Hq=Hq, Hk=Hk, D=D, bs=8, seed=D)
    out = paged_attention(q, kc, vc, block_table=bt, seq_lens=lens, enable_gqa=True,
                          num_threads=2)
    ref, _ = paged_ref(q, kc, vc, bt, lens, cq)
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=0)


@pytest.mark.parametrize("nqs", [[1, 1], [1, 40], [300, 1]])
@pytest.mark.parametrize("opts", ["plain", "window", "sinks"])
def test_key_splits(nqs, opts):
    """Few long sequences at two threads split over keys (two single-row
    items: the rule in test_blas_policy); the partials merge exactly."""
    q, kc, vc, bt, lens, cq = make_batch([3000, 2500], nqs, bs=32, seed=3)
    out, lse = call(q, kc, vc, bt, lens, cq, num_threads=2, return_lse=True, **OPTIONS[opts])
    ref, rlse = paged_ref(q, kc, vc, bt, lens, cq, **OPTIONS[opts])
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=0)
    np.testing.assert_allclose(lse, rlse, atol=2e-5, rtol=1e-6)


@pytest.mark.parametrize("path", PATHS)
def test_consecutive_blocks_and_strided_caches(path):
    """Tables whose blocks follow each other in memory (read as one range)
    and caches that are views with other strides give the same results."""
    q, kc, vc, bt, lens, cq = make_batch(**MIXED, seed=5)
    ref, _ = paged_ref(q, kc, vc, bt, lens, cq)
    # the same keys laid out in order: consecutive ids
    nblk = -(-lens // kc.shape[1])
    order = np.concatenate([bt[s, :nblk[s]] for s in range(len(lens))])
    kc2, vc2 = kc[order], vc[order]
    bt2 = np.full_like(bt, -1)
    off = np.concatenate([[0], np.cumsum(nblk)])
    for s in range(len(lens)):
        bt2[s, :nblk[s]] = np.arange(off[s], off[s + 1])
    # a pool with heads interleaved differently (a transposed view)
    big = np.zeros((kc.shape[0], kc.shape[2], kc.shape[1], kc.shape[3]), np.float32)
    big[...] = kc.transpose(0, 2, 1, 3)
    kc3 = big.transpose(0, 2, 1, 3)
    prev = _sdpa.set_kernel_path(path)
    try:
        o2 = call(q, kc2, vc2, bt2, lens, cq)
        o3 = call(q, kc3, vc, bt, lens, cq)
    finally:
        _sdpa.set_kernel_path(prev)
    np.testing.assert_allclose(o2, ref, atol=2e-5, rtol=0)
    np.testing.assert_allclose(o3, ref, atol=2e-5, rtol=0)


def _torch_error(q, kc, vc, bt, lens, cq, tdt, ref):
    """torch's own max error on the same dtype (SDPA per sequence, lower-
    right causal through an explicit mask)."""
    torch = pytest.importorskip("torch")
    err = 0.0
    Hq, Hk = q.shape[1], kc.shape[2]
    for s in range(len(lens)):
        lo, hi = cq[s], cq[s + 1]
        K = torch.from_numpy(gather(kc, bt[s], lens[s]).astype(np.float32)).to(tdt)
        V = torch.from_numpy(gather(vc, bt[s], lens[s]).astype(np.float32)).to(tdt)
        Q = torch.from_numpy(q[lo:hi].astype(np.float32)).to(tdt)
        n, m = hi - lo, lens[s]
        mask = torch.from_numpy(np.arange(m)[None, :] <= np.arange(n)[:, None] + m - n)
        o = torch.nn.functional.scaled_dot_product_attention(
            Q.transpose(0, 1), K.transpose(0, 1).repeat_interleave(Hq // Hk, 0),
            V.transpose(0, 1).repeat_interleave(Hq // Hk, 0), attn_mask=mask)
        err = max(err, float(np.abs(o.transpose(0, 1).float().numpy() - ref[lo:hi]).max()))
    return err


@pytest.mark.parametrize("dt", ["bfloat16", "float16"])
@pytest.mark.parametrize("path", PATHS)
def test_half_caches_against_torch_error(dt, path):
    """16-bit queries and caches read in place: within 1.5x torch's own
    error on the same dtype, against float64 of the rounded inputs."""
    torch = pytest.importorskip("torch")
    ml = pytest.importorskip("ml_dtypes")
    npdt = ml.bfloat16 if dt == "bfloat16" else np.float16
    q, kc, vc, bt, lens, cq = make_batch(**MIXED, seed=7)
    q, kc, vc = (a.astype(npdt) for a in (q, kc, vc))
    prev = _sdpa.set_kernel_path(path)
    try:
        out = call(q, kc, vc, bt, lens, cq)
    finally:
        _sdpa.set_kernel_path(prev)
    assert out.dtype == np.dtype(npdt)
    ref, _ = paged_ref(q, kc, vc, bt, lens, cq)
    mine = float(np.abs(out.astype(np.float64) - ref).max())
    theirs = _torch_error(q, kc, vc, bt, lens, cq, getattr(torch, dt), ref)
    assert mine <= 1.5 * theirs, (mine, theirs)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("threads", [1, 2])
def test_int8_caches(path, threads):
    """int8 (array, scales) caches read in place: the float64 attention of
    the dequantized rows, and the dense call on the same int8 pairs."""
    q, kc, vc, bt, lens, cq = make_batch(**MIXED, seed=9)
    kc, vc = np.nan_to_num(kc), np.nan_to_num(vc)
    k8, v8 = attncore.quantize_kv(kc), attncore.quantize_kv(vc)
    prev = _sdpa.set_kernel_path(path)
    try:
        out = call(q, k8, v8, bt, lens, cq, num_threads=threads, sinks=np.zeros(8))
        dense = []
        for s in range(len(lens)):
            g = [(gather(a, bt[s], lens[s]).transpose(1, 0, 2).copy(),
                  gather(sc, bt[s], lens[s]).T.copy()) for a, sc in (k8, v8)]
            o = attncore.scaled_dot_product_attention(
                q[cq[s]:cq[s + 1]].transpose(1, 0, 2), g[0], g[1], is_causal="lower_right",
                enable_gqa=True, sinks=np.zeros(8))
            dense.append(o.transpose(1, 0, 2))
    finally:
        _sdpa.set_kernel_path(prev)
    kd, vd = k8[0] * k8[1][..., None], v8[0] * v8[1][..., None]
    ref, _ = paged_ref(q, kd, vd, bt, lens, cq, sinks=np.zeros(8))
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=0)
    np.testing.assert_allclose(out, np.concatenate(dense), atol=2e-5, rtol=0)


def test_int8_error_within_quantize_kv_decode_error():
    """Against the float cache, an int8 cache's error is the one
    quantize_kv gives a dense decode (the same rows, the same scales)."""
    q, kc, vc, bt, lens, cq = make_batch([200, 700, 64], [1, 1, 1], seed=11)
    kc, vc = np.nan_to_num(kc), np.nan_to_num(vc)
    k8, v8 = attncore.quantize_kv(kc), attncore.quantize_kv(vc)
    ref, _ = paged_ref(q, kc, vc, bt, lens, cq)
    mine = np.abs(call(q, k8, v8, bt, lens, cq) - ref).max()
    kd, vd = k8[0] * k8[1][..., None], v8[0] * v8[1][..., None]
    quant, _ = paged_ref(q, kd, vd, bt, lens, cq)
    assert mine <= 1.5 * np.abs(quant - ref).max() + 1e-6


def test_precision_modes():
    q, kc, vc, bt, lens, cq = make_batch(**MIXED, seed=13)
    ref, _ = paged_ref(q, kc, vc, bt, lens, cq)
    for prec, tol in (("float32", 2e-5), ("int8", 2e-5), ("bfloat16", 5e-2)):
        out = call(q, kc, vc, bt, lens, cq, precision=prec)
        assert out.dtype == np.float32
        np.testing.assert_allclose(out, ref, atol=tol, rtol=0)


@pytest.mark.parametrize("mode", ["emulate", "native"])
def test_bf16_products_on_prefill_chunks(mode):
    """bfloat16 dot products of the fused AVX-512 kernel (emulated on any
    AVX-512 CPU): prefill chunks over bf16 caches within bf16 accuracy."""
    if "avx512" not in PATHS:
        pytest.skip("no AVX-512 kernel path on this CPU")
    ml = pytest.importorskip("ml_dtypes")
    try:
        prev = _sdpa.set_bf16_mode(mode)
    except (ValueError, RuntimeError):
        pytest.skip(f"this CPU has no {mode} bf16 mode")
    try:
        q, kc, vc, bt, lens, cq = make_batch([300, 700], [200, 300], seed=17)
        q, kc, vc = (a.astype(ml.bfloat16) for a in (q, kc, vc))
        out = call(q, kc, vc, bt, lens, cq, sinks=np.zeros(8))
    finally:
        _sdpa.set_bf16_mode(prev)
    ref, _ = paged_ref(q, kc, vc, bt, lens, cq, sinks=np.zeros(8))
    np.testing.assert_allclose(out.astype(np.float64), ref, atol=3e-2, rtol=0)


def test_inputs_never_modified_and_torch_in_torch_out():
    torch = pytest.importorskip("torch")
    q, kc, vc, bt, lens, cq = make_batch(**MIXED, seed=19)
    saved = [a.copy() for a in (q, kc, vc, bt, lens, cq)]
    call(q, kc, vc, bt, lens, cq, sinks=np.ones(8))
    for a, b in zip(saved, (q, kc, vc, bt, lens, cq)):
        np.testing.assert_array_equal(a, b)
    t = paged_attention(*(torch.from_numpy(a) for a in (q, kc, vc)),
                        block_table=torch.from_numpy(bt), seq_lens=torch.from_numpy(lens),
                        cu_seqlens_q=torch.from_numpy(cq), enable_gqa=True)
    assert isinstance(t, torch.Tensor)
    np.testing.assert_array_equal(t.numpy(), call(q, kc, vc, bt, lens, cq))


def test_empty_cases():
    q, kc, vc, bt, lens, cq = make_batch([5, 0, 9], [2, 0, 3], seed=23)
    out, lse = call(q, kc, vc, bt, lens, cq, return_lse=True)
    ref, rlse = paged_ref(q, kc, vc, bt, lens, cq)
    np.testing.assert_allclose(out, ref, atol=2e-5)
    empty = paged_attention(q[:0], kc, vc, block_table=bt[:0], seq_lens=lens[:0],
                            enable_gqa=True)
    assert empty.shape == (0, 8, 32)


BAD = [
    (dict(block_table=np.array([[0, 99]], np.int32)), ValueError, "out of range"),
    (dict(block_table=np.array([[-1, 0]], np.int32)), ValueError, "out of range"),
    (dict(seq_lens=np.array([40])), ValueError, "beyond the blocks"),
    (dict(seq_lens=np.array([-1])), ValueError, "seq_lens"),
    (dict(cu_seqlens_q=[0, 3]), ValueError, "cu_seqlens_q"),
    (dict(cu_seqlens_q=[0, 2, 2]), ValueError, "num_seqs"),
    (dict(q_rows=20, cu_seqlens_q=[0, 20]), ValueError, "queries"),
    (dict(block_table=np.array([[0.0, 1.0]])), TypeError, "block_table"),
    (dict(seq_lens=np.array([20, 3])), ValueError, "seq_lens"),
    (dict(kdtype=np.float64), ValueError, "dtype"),
    (dict(kshape=(4, 8, 2, 16)), ValueError, "k_cache last dimension"),
    (dict(vshape=(4, 4, 2, 32)), ValueError, "v_cache must match"),
    (dict(gqa=False), ValueError, "enable_gqa"),
    (dict(no_cu=True), ValueError, "one query"),
    (dict(alibi=np.ones(3)), ValueError, "alibi_slopes"),
    (dict(sinks=np.full(4, np.nan)), ValueError, "sinks"),
    (dict(window=(1,)), TypeError, "window"),
]


@pytest.mark.parametrize("bad,exc,words", BAD)
def test_bad_inputs(bad, exc, words):
    rng = np.random.default_rng(0)
    Hq, Hk, D, bs = 4, 2, 32, 8
    kc = rand(bad.get("kshape", (4, bs, Hk, D)), rng).astype(bad.get("kdtype", np.float32))
    vc = rand(bad.get("vshape", (4, bs, Hk, D)), rng)
    n = bad.get("q_rows", 2)
    q = rand((n, Hq, D), rng)
    kw = dict(block_table=np.array([[0, 1]], np.int32), seq_lens=np.array([12]),
              cu_seqlens_q=[0, n], enable_gqa=bad.get("gqa", True))
    for key in ("block_table", "seq_lens", "cu_seqlens_q", "window"):
        if key in bad:
            kw[key] = bad[key]
    if bad.get("no_cu"):
        del kw["cu_seqlens_q"]
    if "alibi" in bad:
        kw["alibi_slopes"] = bad["alibi"]
    if "sinks" in bad:
        kw["sinks"] = bad["sinks"]
    with pytest.raises(exc, match=words):
        paged_attention(q, kc, vc, **kw)


def test_mixed_int8_and_float_caches_refused():
    kc = rand((4, 8, 2, 16))
    with pytest.raises(ValueError, match="both"):
        paged_attention(rand((1, 2, 16)), attncore.quantize_kv(kc), kc,
                        block_table=[[0]], seq_lens=[3])


def test_decode_spelling_refuses_a_sequence_without_keys():
    """A sequence of seq_lens 0 with its one query: the documented "more
    queries than keys" error whether cu_seqlens_q is None or spelled out
    (None returned zeros and the sink as its lse)."""
    kc = rand((4, 4, 2, 8))
    q = rand((2, 2, 8), seed=1)
    kw = dict(block_table=[[0], [1]], seq_lens=[3, 0], sinks=[0.5, 0.5])
    for cu in (None, [0, 1, 2]):
        with pytest.raises(ValueError,
                           match=r"sequence 1 has 1 queries but seq_lens\[1\] = 0 keys"):
            paged_attention(q, kc, kc, cu_seqlens_q=cu, **kw)


def _overflowing_pool(nblocks, lens, bs=32, Hk=8, D=128, seed=0):
    """(k pool, v pool, block table): float32 pools of ``nblocks`` zero
    blocks, sequence s's blocks shuffled and filled with standard-normal
    keys and values; sequence 1's values lie near +3e38, so its float32
    sums overflow (its rows come out non-finite and run again in float64)."""
    rng = np.random.default_rng(seed)
    kc = np.zeros((nblocks, bs, Hk, D), np.float32)
    vc = np.zeros_like(kc)
    nb = [-(-L // bs) for L in lens]
    ids = rng.permutation(nblocks)[:sum(nb)]
    bt = np.full((len(lens), max(nb)), -1, np.int32)
    o = 0
    for s, n in enumerate(nb):
        bt[s, :n] = ids[o:o + n]
        o += n
        kc[bt[s, :n]] = rng.standard_normal((n, bs, Hk, D), dtype=np.float32)
        vc[bt[s, :n]] = (rng.uniform(2e38, 3e38, (n, bs, Hk, D)).astype(np.float32) if s == 1
                         else rng.standard_normal((n, bs, Hk, D), dtype=np.float32))
    return kc, vc, bt


def test_float64_rerun_converts_only_the_affected_sequences_blocks():
    """A step in which one sequence's float32 sums overflow: only that
    sequence runs again in float64, over its own blocks -- the memory the
    step takes beyond its output is that sequence's blocks in float64 and
    a little scratch (it converted the whole pool: 128 MiB of float64 for
    this 64 MiB pool), and every row is the float64 reference's."""
    lens, Hq = [512] * 8, 16
    kc, vc, bt = _overflowing_pool(256, lens)           # 32 + 32 MiB
    q = rand((len(lens), Hq, 128), seed=3)
    kw = dict(block_table=bt, seq_lens=lens, enable_gqa=True, num_threads=1)
    paged_attention(q, kc, vc, **kw)                    # warm (plans, imports)
    tracemalloc.start()
    try:
        out = paged_attention(q, kc, vc, **kw)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    own = 2 * (512 // 32) * kc[0].size * 8              # sequence 1's K and V blocks, float64
    assert peak - out.nbytes <= own + 16 * 2**20, (peak - out.nbytes) / 2**20
    assert own + 16 * 2**20 < (kc.nbytes + vc.nbytes) * 2 / 4   # far below a pool copy
    ref, _ = paged_ref(q, kc, vc, bt, np.array(lens), np.arange(len(lens) + 1))
    assert np.isfinite(ref).all() and np.abs(ref[1]).max() > 1e38
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("threads", [1, 2])
def test_float64_rerun_of_some_sequences_keeps_their_options(threads):
    """Per-sequence ALiBi slopes and sinks, a window, the lse, prompt
    chunks: the sequences run again in float64 (1 and 4, overflowing) take
    their own rows of the options; the others keep the float32 answer;
    all are the float64 reference's."""
    q, kc, vc, bt, lens, cq = make_batch(**MIXED, seed=5)
    for s in (1, 4):   # values near +3e38: float32 sums overflow
        nb = -(-lens[s] // 16)
        vc[bt[s, :nb]] = np.abs(vc[bt[s, :nb]]) * np.float32(1e37) + np.float32(2e38)
    S = len(lens)
    alibi = np.linspace(0.01, 0.3, S * 8).reshape(S, 8)
    sinks = np.linspace(-1, 2, S * 8).reshape(S, 8)
    opts = dict(window=(90, 0), sinks=sinks, alibi=alibi)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = call(q, kc, vc, bt, lens, cq, return_lse=True, num_threads=threads, **opts)
    ref, rlse = paged_ref(q, kc, vc, bt, lens, cq, **opts)
    rows = np.concatenate([np.arange(cq[s], cq[s + 1]) for s in (1, 4)])
    assert np.abs(ref[rows]).max() > 1e38
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(lse, rlse, rtol=1e-5, atol=1e-5)


def test_int8_rerun_with_inf_scales_in_unowned_slots_warns_nothing():
    """An int8 pool with inf scales in slots no sequence owns (a block
    nobody holds, the slots past a sequence's last token) and a sequence
    whose float32 sums overflow: the float64 re-run dequantizes that
    sequence's blocks without NumPy's "invalid value encountered in
    multiply" (0 * inf) warning, and answers as the float64 reference of
    the dequantized pool."""
    rng = np.random.default_rng(7)
    nb, bs, Hk, D = 12, 8, 2, 16
    data = rng.integers(-127, 128, (nb, bs, Hk, D), dtype=np.int8)
    ks = rng.uniform(0.005, 0.02, (nb, bs, Hk)).astype(np.float32)
    vs = ks.copy()
    vd = rng.integers(100, 128, (nb, bs, Hk, D), dtype=np.int8)
    bt = np.array([[3, 7, -1], [0, 5, 9]], np.int32)
    lens = np.array([13, 20])
    vs[[0, 5, 9]] = np.float32(2.5e36)       # sequence 1's values near 3e38: overflow
    data[11], vd[11] = 0, 0
    ks[11], vs[11] = np.inf, np.inf          # a block nobody holds
    ks[9, 4:], vs[9, 4:] = np.inf, np.inf    # past sequence 1's 20th token
    data[9, 4:], vd[9, 4:] = 0, 0
    q = rand((2, 4, D), seed=8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = paged_attention(q, (data, ks), (vd, vs), block_table=bt, seq_lens=lens,
                              enable_gqa=True)
    with np.errstate(invalid="ignore"):     # 0 * inf: NaN where nobody reads
        kdq = data.astype(np.float64) * ks.astype(np.float64)[..., None]
        vdq = vd.astype(np.float64) * vs.astype(np.float64)[..., None]
    ref, _ = paged_ref(q, kdq, vdq, bt, lens, np.arange(3))
    assert np.isfinite(ref).all() and np.abs(ref[1]).max() > 1e38
    np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-5)


# --------------------------------------------------------------------------
# PagedKVCache
# --------------------------------------------------------------------------
class Model:
    """The cache's meaning, written plainly: each sequence's tokens in a list."""

    def __init__(self):
        self.k, self.v = {}, {}

    def append(self, ids, k, v, cu):
        for i, s in enumerate(ids):
            self.k.setdefault(s, []).extend(k[cu[i]:cu[i + 1]])
            self.v.setdefault(s, []).extend(v[cu[i]:cu[i + 1]])


def contents(cache, s):
    """A sequence's keys / values read back through its block table."""
    bt, L = cache.block_table([s])[0], cache.seq_lens([s])[0]
    kb, vb = cache.k_blocks, cache.v_blocks
    if cache.dtype == "int8":
        kb, vb = kb[0] * kb[1][..., None], vb[0] * vb[1][..., None]
    return gather(kb, bt, L), gather(vb, bt, L)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "int8"])
def test_cache_append_fork_crop_free(dtype):
    rng = np.random.default_rng(1)
    ml = pytest.importorskip("ml_dtypes") if dtype == "bfloat16" else None
    st = ml.bfloat16 if ml else (np.float32 if dtype == "int8" else np.dtype(dtype))
    cache = PagedKVCache(num_blocks=64, block_size=8, num_kv_heads=2, head_dim=16,
                         dtype=dtype)
    model = Model()

    def put(ids, counts):
        cu = np.concatenate([[0], np.cumsum(counts)])
        k = rand((cu[-1], 2, 16), rng).astype(st)
        v = rand((cu[-1], 2, 16), rng).astype(st)
        cache.append(ids, k, v, cu_seqlens=cu)
        if dtype == "int8":   # the model holds what quantize_kv keeps
            k8, v8 = attncore.quantize_kv(k), attncore.quantize_kv(v)
            k, v = k8[0] * k8[1][..., None], v8[0] * v8[1][..., None]
        model.append(ids, k, v, cu)

    put([7, 9], [1, 20])
    put([7, 9], [1, 1])
    put([9], [3])                      # 24 tokens: three full blocks
    cache.fork(9, 10)                  # shares all three
    put([10, 9], [5, 2])               # each writes its own fourth block
    model.k[10] = model.k[9][:24] + model.k[10]
    model.v[10] = model.v[9][:24] + model.v[10]
    cache.fork(7, 11)                  # shares a partial block
    put([11], [4])                     # copy on write: 7 unchanged
    model.k[11] = model.k[7][:2] + model.k[11]
    model.v[11] = model.v[7][:2] + model.v[11]
    put([7], [1])
    for s in (7, 9, 10, 11):
        k, v = contents(cache, s)
        np.testing.assert_array_equal(k.astype(np.float32), np.array(model.k[s], np.float32))
        np.testing.assert_array_equal(v.astype(np.float32), np.array(model.v[s], np.float32))
    used = {b for s in (7, 9, 10, 11) for b in cache.block_table([s])[0][:-(-cache.seq_lens(
        [s])[0] // 8)]}
    assert cache.num_free_blocks == 64 - len(used)
    cache.crop(9, 10)
    k, _ = contents(cache, 9)
    np.testing.assert_array_equal(k.astype(np.float32), np.array(model.k[9][:10], np.float32))
    k, _ = contents(cache, 10)         # the fork keeps its shared blocks
    np.testing.assert_array_equal(k.astype(np.float32), np.array(model.k[10], np.float32))
    for s in (7, 9, 10, 11):
        cache.free(s)
    assert cache.num_free_blocks == 64 and cache.sequences == []


def test_cache_attention_matches_dense():
    """paged_attention over a cache filled by appends (a mixed batch)
    equals the float64 attention over each sequence's tokens in order."""
    rng = np.random.default_rng(2)
    cache = PagedKVCache(num_blocks=256, block_size=16, num_kv_heads=2, head_dim=32)
    toks = {}
    for ids, counts in (([1, 2, 3], [100, 7, 1]), ([2, 3], [1, 50]), ([1, 3], [1, 1])):
        cu = np.concatenate([[0], np.cumsum(counts)])
        k, v = rand((cu[-1], 2, 32), rng), rand((cu[-1], 2, 32), rng)
        cache.append(ids, k, v, cu_seqlens=cu)
        for i, s in enumerate(ids):
            a, b = toks.get(s, (np.zeros((0, 2, 32)), np.zeros((0, 2, 32))))
            toks[s] = (np.concatenate([a, k[cu[i]:cu[i + 1]]]),
                       np.concatenate([b, v[cu[i]:cu[i + 1]]]))
    ids, nq = [1, 2, 3], [3, 1, 20]
    cq = np.concatenate([[0], np.cumsum(nq)])
    q = rand((cq[-1], 8, 32), rng)
    out = paged_attention(q, cache.k_blocks, cache.v_blocks, block_table=cache.block_table(ids),
                          seq_lens=cache.seq_lens(ids), cu_seqlens_q=cq, enable_gqa=True)
    for i, s in enumerate(ids):
        K, V = (t.transpose(1, 0, 2) for t in toks[s])
        ref = sdpa_ref(q[cq[i]:cq[i + 1]].transpose(1, 0, 2), K, V, is_causal=2, group=4)
        np.testing.assert_allclose(out[cq[i]:cq[i + 1]], ref.transpose(1, 0, 2), atol=2e-5)


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_cache_signature_of_the_contract(dtype):
    """The constructor of the design contract: ``v_head_dim`` (the name of
    MultiHeadAttention / KVCache) and ``dtype`` keyword-only; a value head
    size other than the key's gives value blocks of that size, and the
    attention over them equals the float64 reference."""
    import inspect

    sig = inspect.signature(PagedKVCache)
    # (group_size / rotate: the int4 format, keyword-only after the contract's)
    assert list(sig.parameters) == ["num_blocks", "block_size", "num_kv_heads", "head_dim",
                                    "v_head_dim", "dtype", "group_size", "rotate"]
    assert all(sig.parameters[n].kind is inspect.Parameter.KEYWORD_ONLY
               for n in ("v_head_dim", "dtype", "group_size", "rotate"))
    with pytest.raises(TypeError):
        PagedKVCache(8, 4, 2, 16, "int8")
    with pytest.raises(TypeError):
        PagedKVCache(8, 4, 2, 16, head_dim_v=8)
    with pytest.raises(ValueError, match="v_head_dim"):
        PagedKVCache(8, 4, 2, 16, v_head_dim=0)
    rng = np.random.default_rng(3)
    cache = PagedKVCache(8, 4, 2, 16, v_head_dim=8, dtype=dtype)
    assert cache.v_head_dim == 8 and "v_head_dim=8" in repr(cache)
    k, v = rand((11, 2, 16), rng), rand((11, 2, 8), rng)
    cache.append([5], k, v, cu_seqlens=[0, 11])
    vb = cache.v_blocks[0] if dtype == "int8" else cache.v_blocks
    assert vb.shape == (8, 4, 2, 8)
    with pytest.raises(ValueError, match="v"):
        cache.append([5], k[:1], k[:1])          # values of the key's size
    if dtype == "int8":   # the reference reads what the cache keeps
        k, v = (p[0] * p[1][..., None] for p in (attncore.quantize_kv(k), attncore.quantize_kv(v)))
    q = rand((1, 4, 16), rng)
    out = paged_attention(q, cache.k_blocks, cache.v_blocks, block_table=cache.block_table([5]),
                          seq_lens=cache.seq_lens([5]), enable_gqa=True)
    ref = sdpa_ref(q.transpose(1, 0, 2).astype(np.float64),
                   k.transpose(1, 0, 2).astype(np.float64),
                   v.transpose(1, 0, 2).astype(np.float64), is_causal=2, group=2)
    assert out.shape == (1, 4, 8)
    np.testing.assert_allclose(out, ref.transpose(1, 0, 2), atol=3e-5)


def test_empty_batch_given_as_lists():
    """An empty batch's lengths / offsets as Python lists (NumPy reads [] as
    float64) are integers like any list of them: an empty result, not a
    TypeError about their dtype; float arrays stay refused."""
    q = np.zeros((0, 2, 8), np.float32)
    kc = rand((4, 4, 2, 8))
    bt = np.zeros((0, 3), np.int32)
    for kw in (dict(seq_lens=[]), dict(seq_lens=(), cu_seqlens_q=[0])):
        out = paged_attention(q, kc, kc, block_table=bt, **kw)
        assert out.shape == (0, 2, 8) and out.dtype == np.float32
    with pytest.raises(TypeError, match="seq_lens"):
        paged_attention(q, kc, kc, block_table=bt, seq_lens=np.zeros(0))
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        paged_attention(q, kc, kc, block_table=bt, seq_lens=[], cu_seqlens_q=[])


def test_cache_full_pool_changes_nothing():
    cache = PagedKVCache(num_blocks=4, block_size=4, num_kv_heads=1, head_dim=4)
    x = rand((10, 1, 4))
    cache.append([0], x, x, cu_seqlens=[0, 10])
    before = (cache.block_table([0]).copy(), cache.seq_lens([0]).copy(), cache.k_blocks.copy(),
              cache.num_free_blocks)
    with pytest.raises(RuntimeError, match="exhausted"):
        cache.append([0, 1], rand((9, 1, 4)), rand((9, 1, 4)), cu_seqlens=[0, 2, 9])
    after = (cache.block_table([0]), cache.seq_lens([0]), cache.k_blocks, cache.num_free_blocks)
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)
    assert cache.sequences == [0]
    # a shared partial block needs one more block to be copied on write
    cache.fork(0, 1)
    cache.fork(0, 2)
    cache.append([0], rand((1, 1, 4)), rand((1, 1, 4)))   # takes the last free block
    with pytest.raises(RuntimeError, match="exhausted"):
        cache.append([1], rand((1, 1, 4)), rand((1, 1, 4)))
    assert cache.seq_lens([0, 1, 2]).tolist() == [11, 10, 10]


@pytest.mark.parametrize("args,exc,words", [
    (dict(num_blocks=0), ValueError, "num_blocks"),
    (dict(block_size=2.5), TypeError, "block_size"),
    (dict(dtype="int4"), ValueError, "dtype"),
])
def test_cache_bad_construction(args, exc, words):
    kw = dict(num_blocks=4, block_size=4, num_kv_heads=1, head_dim=4) | args
    with pytest.raises(exc, match=words):
        PagedKVCache(**kw)


def test_cache_bad_calls():
    cache = PagedKVCache(num_blocks=8, block_size=4, num_kv_heads=2, head_dim=4)
    x = rand((3, 2, 4))
    with pytest.raises(ValueError, match="shape"):
        cache.append([0], rand((3, 1, 4)), x, cu_seqlens=[0, 3])
    with pytest.raises(ValueError, match="dtype"):
        cache.append([0], x.astype(np.float64), x, cu_seqlens=[0, 3])
    with pytest.raises(ValueError, match="repeat"):
        cache.append([0, 0], x, x, cu_seqlens=[0, 1, 3])
    with pytest.raises(ValueError, match="cu_seqlens"):
        cache.append([0], x, x, cu_seqlens=[0, 2])
    with pytest.raises(ValueError, match="one token"):
        cache.append([0, 1], x, x)
    with pytest.raises(ValueError, match="not in the cache"):
        cache.free(5)
    cache.append([0], x, x, cu_seqlens=[0, 3])
    with pytest.raises(ValueError, match="already"):
        cache.fork(0, 0)
    with pytest.raises(ValueError, match="exceed"):
        cache.crop(0, 4)
    with pytest.raises(TypeError, match="seq_id"):
        cache.free("0")
    assert cache.seq_lens([0]).tolist() == [3] and cache.num_free_blocks == 7


@pytest.mark.parametrize("sharers", [2, 3])
def test_cache_fork_then_every_sharer_appends_at_once(sharers):
    """Sequences sharing a partly filled block all append in one call: all
    but the last holder get copies, the last writes in place -- every
    sequence reads its own tokens, the pool needs no more blocks than
    that, and freeing everything returns every block."""
    c = PagedKVCache(num_blocks=sharers, block_size=4, num_kv_heads=1, head_dim=2)
    first = np.full((1, 1, 2), 1.0, np.float32)
    c.append(0, first, first)
    for s in range(1, sharers):
        c.fork(0, s)
    new = np.arange(sharers * 2, dtype=np.float32).reshape(sharers, 1, 2) + 10
    c.append(list(range(sharers)), new, new)       # needs sharers - 1 copies: fits
    assert c.num_free_blocks == 0
    for s in range(sharers):
        k, v = contents(c, s)
        np.testing.assert_array_equal(k[:, 0], np.concatenate([first[:, 0], new[s:s + 1, 0]]))
        np.testing.assert_array_equal(v[:, 0], k[:, 0])
    for s in range(sharers):
        c.free(s)
    assert c.num_free_blocks == sharers


def test_cache_argument_errors_name_the_argument():
    c = PagedKVCache(num_blocks=4, block_size=4, num_kv_heads=1, head_dim=2)
    k = np.ones((1, 1, 2), np.float32)
    with pytest.raises(TypeError, match="seq_ids must be an int or a sequence of ints, got float"):
        c.append(2.0, k, k)
    c.append(np.array(7), k, k)          # a 0-d integer array is one id
    assert c.seq_lens([7]).tolist() == [1]
    c8 = PagedKVCache(num_blocks=4, block_size=4, num_kv_heads=1, head_dim=2, dtype="int8")
    bad = k.copy()
    bad[0, 0, 1] = np.nan
    with pytest.raises(ValueError, match="k must be finite for an int8 cache"):
        c8.append(1, bad, k)
    with pytest.raises(ValueError, match="v must be finite for an int8 cache"):
        c8.append(1, k, bad)
    assert c8.num_free_blocks == 4       # nothing was written


@pytest.mark.parametrize("ids", [{7, 9}, frozenset({7, 9}), {7: 0, 9: 0}.keys(),
                                 {7: 0, 9: 0}, {7: 7, 9: 9}.values()],
                         ids=["set", "frozenset", "keys view", "dict", "values view"])
def test_cache_refuses_unordered_seq_ids(ids):
    """A set, a dict or a view of one as seq_ids: a TypeError naming
    seq_ids (a set's iteration order gave seq 7 two tokens and seq 9 one),
    nothing written; the queries refuse them too."""
    c = PagedKVCache(num_blocks=4, block_size=4, num_kv_heads=1, head_dim=2)
    x = rand((3, 1, 2))
    with pytest.raises(TypeError, match="seq_ids must be an int or an ordered sequence"):
        c.append(ids, x, x, cu_seqlens=[0, 1, 3])
    assert c.sequences == [] and c.num_free_blocks == 4
    c.append([7, 9], x, x, cu_seqlens=[0, 1, 3])
    for query in (c.seq_lens, c.block_table):
        with pytest.raises(TypeError, match="seq_ids"):
            query(ids)


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_cache_single_id_takes_every_token(dtype):
    """append(0, k, v) with a multi-token k: all of k's tokens are sequence
    0's, as with cu_seqlens=[0, n] (it was refused); a list of ids keeps
    one token each."""
    rng = np.random.default_rng(4)
    k, v = rand((11, 2, 8), rng), rand((11, 2, 8), rng)
    a = PagedKVCache(num_blocks=8, block_size=4, num_kv_heads=2, head_dim=8, dtype=dtype)
    b = PagedKVCache(num_blocks=8, block_size=4, num_kv_heads=2, head_dim=8, dtype=dtype)
    a.append(0, k[:5], v[:5])
    a.append(np.int64(0), k[5:], v[5:])
    b.append([0], k, v, cu_seqlens=[0, 11])
    assert a.seq_lens([0]).tolist() == [11] and a.num_free_blocks == 5
    for x, y, want in zip(contents(a, 0), contents(b, 0), (k, v)):
        np.testing.assert_array_equal(x, y)
        tol = 0 if dtype == "float32" else 0.5 / 127 * np.abs(want).max()
        np.testing.assert_allclose(x, want, rtol=0, atol=tol)
    with pytest.raises(ValueError, match="one token"):
        a.append([0], k[:2], v[:2])


def test_paged_negative_seq_len_is_named():
    q = np.ones((1, 1, 4), np.float32)
    pool = np.ones((2, 4, 1, 4), np.float32)
    with pytest.raises(ValueError, match=r"seq_lens must be >= 0, got seq_lens\[0\] = -1"):
        paged_attention(q, pool, pool, block_table=[[0]], seq_lens=[-1])


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("view", ["reversed", "broadcast", "overlapping"])
def test_query_token_stride_any(dtype, view, causal):
    """Query rows whose token stride (axis 0, the kernels' row axis of a
    prompt chunk) is negative, zero or below a row: read as a copy, the
    float64 reference's answer on every path (they went to BLAS as an
    illegal leading dimension: wrong answers)."""
    from numpy.lib.stride_tricks import as_strided
    rng = np.random.default_rng(0)
    k = rng.standard_normal((1, 64, 1, 8)).astype(dtype)
    v = rng.standard_normal((1, 64, 1, 8)).astype(dtype)
    base = rng.standard_normal((40, 1, 8)).astype(dtype)
    if view == "reversed":
        q = base[::-1]
    elif view == "broadcast":
        q = np.broadcast_to(base[:1], (40, 1, 8))
    else:  # token rows one element apart (overlapping)
        q = as_strided(base, (33, 1, 8), (base.itemsize, 8 * base.itemsize, base.itemsize))
    n = q.shape[0]
    kw = dict(block_table=[[0]], seq_lens=[64], cu_seqlens_q=[0, n], is_causal=causal,
              num_threads=1)
    # float64 reference of the same rows: (n, 1, 8) as one head's (1, n, 8);
    # the n queries are the last n of the 64 tokens (lower-right causal)
    want = sdpa_ref(np.asarray(q, np.float64).transpose(1, 0, 2), k[0].transpose(1, 0, 2),
                    v[0].transpose(1, 0, 2),
                    is_causal="lower_right" if causal else False).transpose(1, 0, 2)
    tol = 1e-12 if dtype == np.float64 else 2e-6
    for path in attncore._kernels.available_kernel_paths():
        with attncore._kernels.forced_kernel_path(path):
            got = attncore.paged_attention(q, k, v, **kw)
            np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
            got = attncore.varlen_attention(q, k[0], v[0], [0, n], [0, 64], is_causal=causal,
                                            num_threads=1)
            np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
