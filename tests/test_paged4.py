"""paged_attention over 4-bit and rotated pools (QuantizedKV blocks) and
PagedKVCache(dtype="int4"), against the float64 reference of tests/test_paged
over the documented dequantized values (tests/test_kv4_attention's
values_of: test_kv4's deq_ref and rotate_ref, independent of the
library's dequantize).

Slots no sequence owns get NaN scales, so a kernel that reads outside a
sequence's keys shows it."""
import numpy as np
import pytest

from attncore import PagedKVCache, QuantizedKV, paged_attention, quantize_kv
from reference import rand
from test_kv4_attention import close, values_of
from test_paged import OPTIONS, call, gather, make_batch, paged_ref

FORMATS = {
    "q4-g16-rot": dict(bits=4, group_size=16, rotate=True),
    "q4-g32": dict(bits=4, group_size=32),
    "q4-g8": dict(bits=4, group_size=8),        # not a multiple of 16: dequantized tiles
    "q4-sym-rot": dict(bits=4, symmetric=True, rotate=True),
    "i8-rot": dict(rotate=True),
}


def owned_slots(bt, lens, shape):
    """(num_blocks, block_size) True where a sequence's key sits."""
    own = np.zeros(shape, bool)
    bs = shape[1]
    for s, L in enumerate(lens):
        for t in range(L):
            own[bt[s, t // bs], t % bs] = True
    return own


def quantized_batch(fmt, lens, nqs, **kw):
    """make_batch's call with both pools quantized in the format ``fmt``
    (unowned slots: NaN scales)."""
    q, kc, vc, bt, sl, cq = make_batch(lens, nqs, **kw)
    own = owned_slots(bt, sl, kc.shape[:2])
    pools = []
    for c in (kc, vc):
        kv = quantize_kv(np.where(own[..., None, None], c, 0).astype(np.float32), **FORMATS[fmt])
        kv.scales[~own] = np.nan
        pools.append(kv)
    return q, pools[0], pools[1], bt, sl, cq


MIXED = dict(lens=[1, 37, 300, 5, 129, 700, 16, 64], nqs=[1, 1, 100, 5, 1, 64, 16, 1])


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("threads", [1, 2])
def test_quantized_pools_mixed_batch(path, fmt, threads):
    q, k4, v4, bt, sl, cq = quantized_batch(fmt, D=64, **MIXED)
    out = call(q, k4, v4, bt, sl, cq, num_threads=threads)
    ref, _ = paged_ref(q, values_of(k4), values_of(v4), bt, sl, cq)
    assert out.dtype == np.float32 and out.shape == q.shape[:2] + (64,)
    close(out, ref)


@pytest.mark.parametrize("name", list(OPTIONS))
def test_quantized_pools_options(path, name):
    q, k4, v4, bt, sl, cq = quantized_batch("q4-g16-rot", D=64, seed=3, **MIXED)
    opts = OPTIONS[name]
    out, lse = call(q, k4, v4, bt, sl, cq, return_lse=True, **opts)
    ref, rlse = paged_ref(q, values_of(k4), values_of(v4), bt, sl, cq, **opts)
    close(out, ref)
    np.testing.assert_allclose(lse, rlse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("Hq,Hk", [(8, 8), (8, 2), (16, 4)])
@pytest.mark.parametrize("D", [64, 128, 96])
def test_decode_groups_and_head_sizes(path, Hq, Hk, D):
    """Decoding steps (one query a sequence: the query heads of a key head
    read its blocks together), D a power of two or a multiple of 32."""
    lens = [3, 77, 512, 33]
    q, k4, v4, bt, sl, cq = quantized_batch("q4-g16-rot", lens, [1] * 4, Hq=Hq, Hk=Hk, D=D,
                                            bs=32, seed=D)
    out = paged_attention(q, k4, v4, block_table=bt, seq_lens=sl, enable_gqa=Hq != Hk)
    ref, _ = paged_ref(q, values_of(k4), values_of(v4), bt, sl, cq)
    close(out, ref)


def test_float64_and_16bit_queries():
    """float64 queries: the sequences' own blocks dequantized, computed in
    float64; float16 queries: float32 computation, float16 result."""
    q, k4, v4, bt, sl, cq = quantized_batch("q4-g16-rot", D=64, **MIXED)
    ref, rlse = paged_ref(q, values_of(k4), values_of(v4), bt, sl, cq)
    out, lse = call(q.astype(np.float64), k4, v4, bt, sl, cq, return_lse=True)
    assert out.dtype == np.float64
    close(out, ref, 1e-12)
    np.testing.assert_allclose(lse, rlse, rtol=1e-12)
    out16 = call(q.astype(np.float16), k4, v4, bt, sl, cq)
    ref16, _ = paged_ref(q.astype(np.float16), values_of(k4), values_of(v4), bt, sl, cq)
    assert out16.dtype == np.float16
    close(out16, ref16, 2e-3)


def test_overflowing_scores_rerun_over_dequantized_blocks():
    """Scores beyond the float32 range: the affected sequences again in
    float64 over their blocks dequantized (finite, the reference's)."""
    q, k4, v4, bt, sl, cq = quantized_batch("q4-g32", D=64, **MIXED)
    q = q.copy()
    q[cq[2]:cq[3]] *= np.float32(1e37)   # sequence 2's scores overflow float32
    out = call(q, k4, v4, bt, sl, cq)
    ref, _ = paged_ref(q, values_of(k4), values_of(v4), bt, sl, cq)
    assert np.all(np.isfinite(out))
    close(out, ref)


def test_pools_not_modified_and_torch_in_torch_out():
    torch = pytest.importorskip("torch")
    q, k4, v4, bt, sl, cq = quantized_batch("q4-g16-rot", D=64, **MIXED)
    before = [a.copy() for a in (q, k4.codes, k4.scales, k4.offsets)]
    out = call(q, k4, v4, bt, sl, cq)
    for a, b in zip(before, (q, k4.codes, k4.scales, k4.offsets)):
        np.testing.assert_array_equal(a, b)
    tk = QuantizedKV(torch.from_numpy(k4.codes), torch.from_numpy(k4.scales.copy()),
                     torch.from_numpy(k4.offsets.copy()), 4, 16, True)
    tv = QuantizedKV(torch.from_numpy(v4.codes), torch.from_numpy(v4.scales.copy()),
                     torch.from_numpy(v4.offsets.copy()), 4, 16, True)
    tout = call(torch.from_numpy(q), tk, tv, bt, sl, cq)
    assert isinstance(tout, torch.Tensor)
    np.testing.assert_allclose(tout.numpy(), out, rtol=1e-6, atol=1e-6)


def test_mismatched_pools_refused():
    q, k4, v4, bt, sl, cq = quantized_batch("q4-g16-rot", D=64, **MIXED)
    _, kc, vc, *_ = make_batch(D=64, **MIXED)
    with pytest.raises(ValueError, match="both"):
        call(q, k4, vc, bt, sl, cq)
    with pytest.raises(ValueError, match="4-D"):
        call(q, quantize_kv(kc[0], bits=4), v4, bt, sl, cq)
    with pytest.raises(ValueError, match="k_cache last dimension"):
        call(q[..., :32], k4, v4, bt, sl, cq)


# --------------------------------------------------------------------------
# PagedKVCache(dtype="int4")
# --------------------------------------------------------------------------
@pytest.mark.parametrize("gs,rotate", [(None, None), (32, False), (8, True)])
def test_int4_cache_stores_quantize_kv_of_its_tokens(gs, rotate):
    """Each appended token's blocks hold quantize_kv(x, bits=4, ...) of it;
    attention over the cache's blocks equals the float64 reference over
    their documented values, through prompt, decode, fork and crop."""
    rng = np.random.default_rng(5)
    cache = PagedKVCache(32, 8, 2, 64, dtype="int4", group_size=gs, rotate=rotate)
    g, rot = cache.group_size, cache.rotate
    assert (g, rot) == ((16, True) if gs is None else (gs, rotate))
    k, v = rand((21, 2, 64), rng), rand((21, 2, 64), rng)
    cache.append([3, 4], k, v, cu_seqlens=[0, 9, 21])
    want = quantize_kv(k, bits=4, group_size=g, rotate=rot)
    kb = cache.k_blocks
    assert isinstance(kb, QuantizedKV) and (kb.group_size, kb.rotate) == (g, rot)
    bt, L = cache.block_table([4]), cache.seq_lens([4])
    np.testing.assert_array_equal(gather(kb.codes, bt[0], L[0]), want.codes[9:])
    np.testing.assert_array_equal(gather(kb.scales, bt[0], L[0]), want.scales[9:])
    np.testing.assert_array_equal(gather(kb.offsets, bt[0], L[0]), want.offsets[9:])
    cache.fork(4, 5)
    cache.crop(3, 5)
    for _ in range(3):             # decode steps: one token each
        kn, vn = rand((3, 2, 64), rng), rand((3, 2, 64), rng)
        cache.append([3, 4, 5], kn, vn)
    ids = [3, 4, 5]
    bt, sl = cache.block_table(ids), cache.seq_lens(ids)
    assert list(sl) == [8, 15, 15]
    q = rand((3, 4, 64), rng)
    cq = np.arange(4)
    out = paged_attention(q, cache.k_blocks, cache.v_blocks, block_table=bt, seq_lens=sl,
                          enable_gqa=True)
    ref, _ = paged_ref(q, values_of(cache.k_blocks), values_of(cache.v_blocks), bt, sl, cq)
    close(out, ref)
    assert "dtype='int4'" in repr(cache) and f"group_size={g}" in repr(cache)


def test_int4_cache_errors_name_the_argument():
    with pytest.raises(ValueError, match="group_size"):
        PagedKVCache(8, 4, 2, 16, dtype="float32", group_size=16)
    with pytest.raises(ValueError, match="group_size"):
        PagedKVCache(8, 4, 2, 16, dtype="int8", rotate=True)
    with pytest.raises(ValueError, match="group_size"):
        PagedKVCache(8, 4, 2, 64, dtype="int4", group_size=12)
    with pytest.raises(ValueError, match="D = 48"):
        PagedKVCache(8, 4, 2, 48, dtype="int4")       # 48: no rotation fits
    with pytest.raises(TypeError, match="rotate"):
        PagedKVCache(8, 4, 2, 64, dtype="int4", rotate="yes")
    cache = PagedKVCache(8, 4, 2, 64, dtype="int4")
    k = rand((3, 2, 64), np.random.default_rng(0))
    bad = k.copy()
    bad[1, 0, 5] = np.inf
    with pytest.raises(ValueError, match="k cannot be quantized"):
        cache.append(0, bad, k)
    big = k * np.float32(1e6)
    with pytest.raises(ValueError, match="v cannot be quantized"):
        cache.append(0, k, big)
    assert cache.sequences == [] and cache.num_free_blocks == 8   # nothing written
    cache48 = PagedKVCache(8, 4, 2, 48, dtype="int4", rotate=False)
    assert cache48.group_size == 16


def test_int4_cache_memory():
    """5 bits per value at groups of 32 (and 6 at 16) against 32."""
    f = PagedKVCache(16, 32, 8, 128)
    q = PagedKVCache(16, 32, 8, 128, dtype="int4", group_size=32)
    nb = sum(a.nbytes for a in (f.k_blocks, f.v_blocks))
    assert sum(kv.nbytes for kv in (q.k_blocks, q.v_blocks)) == nb * 5 // 32


def test_float64_rerun_takes_only_the_affected_sequences_blocks():
    """One sequence's scores overflow float32: it runs again in float64 over
    its own blocks dequantized, a piece at a time -- the step's memory
    beyond its output stays within those blocks in float64 + 16 MiB (the
    whole pool in float64 would be 128 MiB)."""
    import tracemalloc

    from test_paged import _overflowing_pool
    lens, Hq = [512] * 8, 16
    kc, vc, bt = _overflowing_pool(256, lens)
    vc = np.where(np.abs(vc) > 1e30, np.float32(1), vc)     # float16-range values
    k4 = quantize_kv(kc, bits=4, group_size=16, rotate=True)
    v4 = quantize_kv(vc, bits=4, group_size=16, rotate=True)
    q = rand((len(lens), Hq, 128), seed=3)
    q[1] *= np.float32(1e37)                                   # sequence 1's scores overflow
    kw = dict(block_table=bt, seq_lens=lens, enable_gqa=True, num_threads=1)
    paged_attention(q, k4, v4, **kw)                          # warm
    tracemalloc.start()
    try:
        out = paged_attention(q, k4, v4, **kw)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    own = 2 * (512 // 32) * kc[0].size * 8
    assert peak - out.nbytes <= own + 16 * 2**20, (peak - out.nbytes) / 2**20
    ref, _ = paged_ref(q, values_of(k4), values_of(v4), bt, np.array(lens),
                       np.arange(len(lens) + 1))
    assert np.all(np.isfinite(out))
    close(out, ref)


@pytest.mark.parametrize("nqs", [[1], [1, 1], [40, 1]])
def test_long_sequences_split_over_keys(path, nqs):
    """A long sequence with idle threads: its keys split into ranges merged
    by their lse, the 4-bit codes read in each."""
    lens = [3000, 700][:len(nqs)]
    q, k4, v4, bt, sl, cq = quantized_batch("q4-g16-rot", lens, nqs, D=64, bs=32, seed=11)
    out = call(q, k4, v4, bt, sl, cq, num_threads=2)
    ref, _ = paged_ref(q, values_of(k4), values_of(v4), bt, sl, cq)
    close(out, ref)
