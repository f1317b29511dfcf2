"""One-query grouped-query calls (decoding steps) read a key head once for
its group of query heads: as the rows of one dense call over the key heads
(attncore._call.grouped_rows), or, with per-head sinks, as the paged
kernel's folded items (attncore._call._folded_decode).  The same results as
the float64 reference, and the per-head dense items wherever neither
applies."""
import numpy as np
import pytest

import attncore
from attncore import _kernels
from attncore._core import _sdpa
from reference import rand, sdpa_ref

sdpa = attncore.scaled_dot_product_attention


@pytest.fixture
def kernels(monkeypatch):
    """Which compiled launcher each call took."""
    seen = []
    for name in ("sdpa", "sdpa_paged"):
        real = getattr(_sdpa, name)

        def spy(*args, _real=real, _name=name):
            seen.append(_name)
            return _real(*args)
        monkeypatch.setattr(_sdpa, name, spy)
    return seen


CASES = {
    "plain": {},
    "lower-right causal": dict(is_causal="lower_right"),
    "softcap": dict(softcap=4.0),
    "sinks": dict(sinks=np.linspace(-1, 1, 8)),
    "scale": dict(scale=0.3),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("B,Hk,M,D", [(1, 2, 300, 64), (3, 4, 37, 16), (2, 1, 1000, 128)])
@pytest.mark.parametrize("threads", [1, 2])
def test_folded_decode_matches_reference(kernels, name, B, Hk, M, D, threads):
    kw = CASES[name]
    q, k, v = rand((B, 8, 1, D), 0), rand((B, Hk, M, D), 1), rand((B, Hk, M, D), 2)
    out, lse = sdpa(q, k, v, enable_gqa=True, return_lse=True, num_threads=threads, **kw)
    ref, rlse = sdpa_ref(q, k, v, is_causal=2 if kw.get("is_causal") else 0, group=8 // Hk,
                         scale=kw.get("scale"), softcap=kw.get("softcap"),
                         sinks=kw.get("sinks"), return_lse=True)
    assert kernels == (["sdpa_paged"] if name == "sinks" else ["sdpa"])
    assert out.shape == (B, 8, 1, D) and lse.shape == (B, 8, 1)
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=0)
    np.testing.assert_allclose(lse, rlse, atol=2e-5, rtol=1e-6)


def test_folded_decode_int8_and_half(kernels):
    q, k, v = rand((2, 8, 1, 64), 3), rand((2, 2, 200, 64), 4), rand((2, 2, 200, 64), 5)
    k8, v8 = attncore.quantize_kv(k), attncore.quantize_kv(v)
    out = sdpa(q, k8, v8, enable_gqa=True)
    kd, vd = k8[0] * k8[1][..., None], v8[0] * v8[1][..., None]
    np.testing.assert_allclose(out, sdpa_ref(q, kd, vd, group=4), atol=2e-5, rtol=0)
    h = [a.astype(np.float16) for a in (q, k, v)]
    out = sdpa(*h, enable_gqa=True)
    assert out.dtype == np.float16
    ref = sdpa_ref(*(a.astype(np.float64) for a in h), group=4)
    np.testing.assert_allclose(out.astype(np.float64), ref, atol=2e-3, rtol=0)
    assert kernels == ["sdpa", "sdpa"]
    out = sdpa(*h, enable_gqa=True, sinks=np.zeros(8))  # the folded items
    np.testing.assert_allclose(out.astype(np.float64), sdpa_ref(
        *(a.astype(np.float64) for a in h), group=4, sinks=np.zeros(8)), atol=2e-3, rtol=0)
    assert kernels == ["sdpa", "sdpa", "sdpa_paged"]


@pytest.mark.parametrize("kw", [dict(is_causal=True), dict(attn_mask=np.ones((1, 50), bool)),
                                dict(alibi_slopes=np.ones(8)), dict(window=(3, 0)),
                                dict(return_weights=True)])
def test_dense_kernel_where_the_fold_does_not_apply(kernels, kw):
    q, k, v = rand((1, 8, 1, 32), 6), rand((1, 2, 50, 32), 7), rand((1, 2, 50, 32), 8)
    sdpa(q, k, v, enable_gqa=True, **kw)
    assert kernels == ["sdpa"]


def test_no_group_keeps_the_dense_kernel(kernels):
    q, k = rand((2, 4, 1, 32), 9), rand((2, 4, 60, 32), 10)
    sdpa(q, k, k)
    assert kernels == ["sdpa"]


@pytest.mark.parametrize("causal", [0, 2])
@pytest.mark.parametrize("B,H,Hk,M,D", [(1, 12, 4, 300, 64), (2, 8, 2, 37, 16), (1, 4, 1, 65, 20)])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_prepared_grouped_decode(kernels, causal, B, H, Hk, M, D, dtype):
    """The prepared path (the Hugging Face backend's decoding steps) runs a
    key head's query heads as the rows of one block: one dense call over
    Hk heads, the reference's result for every query head, q given as the
    backend gives it (a transposed (B, 1, H, D) array)."""
    from attncore._lean import attention_prepared

    q = np.ascontiguousarray(rand((B, 1, H, D), 6)).astype(dtype).transpose(0, 2, 1, 3)
    k, v = rand((B, Hk, M, D), 7).astype(dtype), rand((B, Hk, M, D), 8).astype(dtype)
    out = attention_prepared(q, k, v, causal, 0.3, 2, (-1, -1), 2.0)
    ref = sdpa_ref(q, k, v, is_causal=causal, scale=0.3, softcap=2.0, group=H // Hk)
    assert kernels == ["sdpa"] and out.shape == (B, H, 1, D) and out.dtype == dtype
    np.testing.assert_allclose(out, ref, atol=2e-5 if dtype == np.float32 else 2e-3, rtol=0)


def test_prepared_layouts_share_no_verdict():
    """The prepared path caches what the operands' metadata decide: calls
    of one shape with other strides (rows apart, heads interleaved, a
    transposed query) each read their own layout, and an operand the
    kernel cannot read in place (a misaligned view, a column stride) is
    handed back to the general call (None), whatever came before."""
    from attncore._lean import attention_prepared

    B, H, Hk, M, D = 2, 8, 2, 37, 16
    q = rand((B, H, 1, D), 20)
    k, v = rand((B, Hk, M, D), 21), rand((B, Hk, M, D), 22)
    ref = sdpa_ref(q, k, v, scale=0.25, group=H // Hk)
    spread = np.zeros((B, Hk, M, 2 * D), np.float32)       # rows 2 D apart
    spread[..., :D] = k
    qt = np.ascontiguousarray(q.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    heads = np.ascontiguousarray(k.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    for qq, kk in [(q, k), (q, spread[..., :D]), (qt, k), (q, heads), (qt, spread[..., :D])]:
        out = attention_prepared(qq, kk, v, 0, 0.25, 1)
        assert out.shape == (B, H, 1, D)
        np.testing.assert_allclose(out, ref, atol=2e-5, rtol=0)
    raw = np.zeros(k.size * 4 + 1, np.uint8)
    odd = raw[1:].view(np.float32).reshape(k.shape)        # misaligned by one byte
    odd[...] = k
    assert not odd.flags.aligned
    assert attention_prepared(q, odd, v, 0, 0.25, 1) is None
    assert attention_prepared(q, np.asfortranarray(k), v, 0, 0.25, 1) is None
    out = attention_prepared(q, k, v, 0, 0.25, 1)           # the same call again
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=0)
    assert attention_prepared(q, k.astype(np.float16), v, 0, 0.25, 1) is None  # mixed dtypes


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("N", [1, 7, 40])
def test_prepared_equals_the_general_call(dtype, N):
    """The prepared path runs the general call's kernel and products: for
    16-bit operands the same output, bit for bit (float16 never takes the
    bfloat16 products that bfloat16 operands take where the CPU has
    them)."""
    from attncore._lean import attention_prepared

    if dtype == "bfloat16":
        dt = pytest.importorskip("ml_dtypes").bfloat16
    else:
        dt = np.float16
    q, k, v = (rand(s, i + 30).astype(dt) for i, s in
               enumerate([(2, 8, N, 32), (2, 2, 45, 32), (2, 2, 45, 32)]))
    out = attention_prepared(q, k, v, 2, 0.3, 1)
    if out is None:   # the BLAS path (portable, more than a few rows): the general call's
        assert _kernels.kernel_path() not in _sdpa.PANEL_ROWS and N > _sdpa.SMALL_ROWS
        return
    ref = sdpa(q, k, v, is_causal="lower_right", scale=0.3, enable_gqa=True, num_threads=1)
    assert out.dtype == ref.dtype
    np.testing.assert_array_equal(out.astype(np.float32), ref.astype(np.float32))


@pytest.mark.parametrize("N", [1, 7])
def test_prepared_bfloat16_bits(N, monkeypatch):
    """bfloat16 operands given as their int16 bits (``bf16_bits``, the
    Hugging Face backend's lean path, no ml_dtypes needed) return the
    output's bfloat16 bits: the float64 reference of the rounded inputs,
    to bfloat16 rounding, and bit for bit the bfloat16-dtype call's
    result; any other dtype given as bits is handed back (None)."""
    from attncore._lean import attention_prepared

    def bits_of(x):   # float32 -> bfloat16 bits, round to nearest even (a published rule)
        u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16).view(np.int16)

    def float_of(b):  # bfloat16 bits -> float32, exact
        return (b.view(np.uint16).astype(np.uint32) << 16).view(np.float32)

    shapes = [(2, 8, N, 32), (2, 2, 45, 32), (2, 2, 45, 24)]
    qb, kb, vb = (bits_of(rand(s, i + 50)) for i, s in enumerate(shapes))
    q0, k0, v0 = (qb.copy(), kb.copy(), vb.copy())
    out = attention_prepared(qb, kb, vb, 2, 0.3, 1, (-1, -1), 0.0, True)
    if out is None:   # the BLAS path (portable, more than a few rows)
        assert _kernels.kernel_path() not in _sdpa.PANEL_ROWS and N > _sdpa.SMALL_ROWS
        return
    assert out.dtype == np.int16 and out.shape == (2, 8, N, 24)
    for a, b in ((qb, q0), (kb, k0), (vb, v0)):
        np.testing.assert_array_equal(a, b)
    ref = sdpa_ref(*(float_of(b).astype(np.float64) for b in (qb, kb, vb)),
                   is_causal=2, scale=0.3, group=4)
    np.testing.assert_allclose(float_of(out), ref, atol=1e-2, rtol=1e-2)
    ml = pytest.importorskip("ml_dtypes")
    same = attention_prepared(*(b.view(ml.bfloat16) for b in (qb, kb, vb)), 2, 0.3, 1)
    np.testing.assert_array_equal(out, same.view(np.int16))
    # without ml_dtypes (a user's torch + transformers install): the same
    # bits, where bfloat16 products are off; else the general call's (None)
    import attncore._lean as lean
    saved = dict(lean._PREPARED)
    lean._PREPARED.clear()
    try:
        monkeypatch.setattr(lean, "bfloat16_available", lambda: False)
        got = attention_prepared(qb, kb, vb, 2, 0.3, 1, (-1, -1), 0.0, True)
        if _sdpa.bf16_mode() == 0:
            np.testing.assert_array_equal(got, out)
        else:
            assert got is None
    finally:
        lean._PREPARED.clear()
        lean._PREPARED.update(saved)
    assert attention_prepared(qb.view(np.uint16), kb, vb, 2, 0.3, 1, (-1, -1), 0.0, True) is None
    # int16 operands not given as bits are integers: the general call's (None)
    ints = [np.abs(b) // 512 for b in (qb, kb, vb)]
    assert attention_prepared(*ints, 2, 0.3, 1) is None
    f = float_of(qb)
    assert attention_prepared(f, float_of(kb), float_of(vb), 2, 0.3, 1, (-1, -1), 0.0,
                              True) is None
