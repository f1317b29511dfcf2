"""Attention over 4-bit and rotated keys / values (QuantizedKV) against the
float64 reference over the documented dequantized data, on every kernel path."""
import dataclasses

import numpy as np
import pytest

import attncore
from attncore import quantize_kv
from reference import rand, sdpa_ref
from test_kv4 import deq_ref, rotate_ref


def values_of(kv):
    """float64 values a container stands for, in the original basis, from
    the documented math (independent of the library's dequantize)."""
    r = deq_ref(kv)
    if kv.rotate:
        D = r.shape[-1]
        r = rotate_ref(r, D if D & (D - 1) == 0 else D & -D)
    return r


def close(out, ref, tol=1e-5):
    out = np.asarray(out, np.float64)
    scale = max(np.abs(ref).max(), 1e-30)
    err = np.abs(out - ref).max() / scale
    assert err <= tol, err


FORMATS = {
    "q4": dict(bits=4),
    "q4-sym-rot": dict(bits=4, symmetric=True, rotate=True),
    "q4-g64-rot": dict(bits=4, group_size=64, rotate=True),
    "q4-g16": dict(bits=4, group_size=16),
    "q4-g8": dict(bits=4, group_size=8),          # not a multiple of 16: dequantized tiles
    "i8-rot": dict(rotate=True),
}


def kv_data(shape, seed):
    x = rand(shape, seed)
    x[..., 5] *= 8.0      # an outlier channel
    return x


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("N", [1, 3, 70])
def test_formats_every_path(path, fmt, N):
    B, H, M, D = 2, 3, 203, 64
    q = rand((B, H, N, D), 1)
    k4 = quantize_kv(kv_data((B, H, M, D), 2), **FORMATS[fmt])
    v4 = quantize_kv(kv_data((B, H, M, D), 3), **FORMATS[fmt])
    ref = sdpa_ref(q, values_of(k4), values_of(v4))
    close(attncore.scaled_dot_product_attention(q, k4, v4), ref)
    # one side quantized, the other float
    v = rand((B, H, M, D), 4)
    close(attncore.scaled_dot_product_attention(q, k4, v), sdpa_ref(q, values_of(k4), v))
    k = rand((B, H, M, D), 5)
    close(attncore.scaled_dot_product_attention(q, k, v4), sdpa_ref(q, k, values_of(v4)))


@pytest.mark.parametrize("D", [32, 96, 128])
def test_head_dims(path, D):
    q = rand((1, 2, 2, D), 6)
    for kw in (dict(bits=4, rotate=True), dict(bits=4), dict(rotate=True)):
        k4 = quantize_kv(kv_data((1, 2, 77, D), 7), **kw)
        v4 = quantize_kv(kv_data((1, 2, 77, D), 8), **kw)
        close(attncore.scaled_dot_product_attention(q, k4, v4),
              sdpa_ref(q, values_of(k4), values_of(v4)))


@pytest.mark.parametrize("D, gs", [(48, 48), (80, 16), (128, 128), (256, 128), (160, 32),
                                   (512, 32), (544, 32)])
@pytest.mark.parametrize("N", [1, 2, 4])
def test_decode_shapes(path, D, gs, N):
    # the 4-bit decode loops' shapes: group sizes that are odd multiples of
    # 16 (a 32-code unit across two groups on AVX-512), a group wider than a
    # P.V chunk of columns, several chunks, the widest row read in place
    # (512) and one beyond it (dequantized tiles); 601 keys: partial key
    # blocks and the P.V sums of several blocks of keys
    q = rand((1, 2, N, D), 30)
    k4 = quantize_kv(kv_data((1, 2, 601, D), 31), bits=4, group_size=gs)
    v4 = quantize_kv(kv_data((1, 2, 601, D), 32), bits=4, group_size=gs)
    close(attncore.scaled_dot_product_attention(q, k4, v4),
          sdpa_ref(q, values_of(k4), values_of(v4)))


@pytest.mark.parametrize("N", [1, 2, 5])
def test_gqa(path, N):
    B, Hq, Hk, M, D = 2, 8, 2, 150, 64
    q = rand((B, Hq, N, D), 9)
    k4 = quantize_kv(kv_data((B, Hk, M, D), 10), bits=4, rotate=True)
    v4 = quantize_kv(kv_data((B, Hk, M, D), 11), bits=4, rotate=True)
    out = attncore.scaled_dot_product_attention(q, k4, v4, enable_gqa=True)
    close(out, sdpa_ref(q, values_of(k4), values_of(v4), group=4))


@pytest.mark.parametrize("opts", [
    dict(is_causal=True), dict(window=(20, 0)), dict(softcap=5.0),
    dict(alibi_slopes=np.array([0.1, 0.05])), dict(sinks=np.array([0.5, -1.0])),
    dict(mask=True), dict(mask="float"),
])
@pytest.mark.parametrize("N", [1, 4, 60])
def test_options(path, opts, N):
    B, H, M, D = 1, 2, 130, 64
    q = rand((B, H, N, D), 12)
    k4 = quantize_kv(kv_data((B, H, M, D), 13), bits=4, rotate=True)
    v4 = quantize_kv(kv_data((B, H, M, D), 14), bits=4)
    kw = dict(opts)
    ref_kw = dict(opts)
    if "mask" in kw:
        rng = np.random.default_rng(15)
        m = rng.random((N, M)) > 0.3
        if kw.pop("mask") == "float":
            m = np.where(m, rng.standard_normal((N, M)), -np.inf).astype(np.float32)
        kw["attn_mask"] = m
        ref_kw.pop("mask")
        ref_kw["attn_mask"] = m
    out, lse = attncore.scaled_dot_product_attention(q, k4, v4, return_lse=True, **kw)
    ref, lref = sdpa_ref(q, values_of(k4), values_of(v4), return_lse=True, **ref_kw)
    close(out, ref)
    np.testing.assert_allclose(lse, lref, rtol=1e-5, atol=1e-5)


def test_key_splits_and_threads(path):
    # a long decode: key splits over threads, merged exactly
    q = rand((1, 2, 1, 64), 16)
    k4 = quantize_kv(kv_data((1, 2, 5000, 64), 17), bits=4, rotate=True)
    v4 = quantize_kv(kv_data((1, 2, 5000, 64), 18), bits=4, rotate=True)
    kd, vd = values_of(k4), values_of(v4)
    ref = sdpa_ref(q, kd, vd)
    # (over 5000 keys the output is a long average, far below the values:
    # the bound is the float32 kernel's own error on the same data, or 1e-5)
    f32 = attncore.scaled_dot_product_attention(q, kd.astype(np.float32), vd.astype(np.float32))
    tol = max(1e-5, 2 * np.abs(f32 - ref).max() / np.abs(ref).max())
    for nt in (1, 2, 3):
        close(attncore.scaled_dot_product_attention(q, k4, v4, num_threads=nt), ref, tol)


def test_weights_float64_and_16bit_queries():
    q = rand((1, 2, 3, 64), 19)
    k4 = quantize_kv(kv_data((1, 2, 40, 64), 20), bits=4, rotate=True)
    v4 = quantize_kv(kv_data((1, 2, 40, 64), 21), bits=4)
    kd, vd = values_of(k4), values_of(v4)
    out, w = attncore.scaled_dot_product_attention(q, k4, v4, return_weights=True)
    ref, wref = sdpa_ref(q, kd, vd, return_weights=True)
    close(out, ref)
    close(w, wref)
    out64 = attncore.scaled_dot_product_attention(q.astype(np.float64), k4, v4)
    assert out64.dtype == np.float64
    close(out64, ref)
    q16 = q.astype(np.float16)
    out16 = attncore.scaled_dot_product_attention(q16, k4, v4)
    assert out16.dtype == np.float16
    close(out16, sdpa_ref(q16.astype(np.float64), kd, vd), 2e-3)


def test_torch_operands():
    torch = pytest.importorskip("torch")
    q = rand((1, 2, 1, 64), 22)
    k = kv_data((1, 2, 50, 64), 23)
    v = kv_data((1, 2, 50, 64), 24)
    k4 = quantize_kv(torch.from_numpy(k), bits=4, rotate=True)
    v4 = quantize_kv(torch.from_numpy(v), bits=4, rotate=True)
    out = attncore.scaled_dot_product_attention(torch.from_numpy(q), k4, v4)
    assert isinstance(out, torch.Tensor)
    close(out.numpy(), sdpa_ref(q, values_of(k4.numpy()), values_of(v4.numpy())))


def test_copied_pairs_and_strided_containers(path):
    # scales and offsets that do not lie side by side (a container built by
    # hand), and a head view (strided codes)
    q = rand((1, 2, 2, 64), 25)
    k4 = quantize_kv(kv_data((1, 4, 60, 64), 26), bits=4)
    v4 = quantize_kv(kv_data((1, 4, 60, 64), 27), bits=4)
    k4b = dataclasses.replace(k4, scales=k4.scales.copy(), offsets=k4.offsets.copy())
    ref = sdpa_ref(q, values_of(k4[:, 1:3]), values_of(v4[:, ::2]))
    close(attncore.scaled_dot_product_attention(q, k4b[:, 1:3], v4[:, ::2]), ref)


def test_inputs_not_modified():
    q = rand((1, 2, 1, 64), 28)
    k4 = quantize_kv(kv_data((1, 2, 30, 64), 29), bits=4, rotate=True)
    v4 = quantize_kv(kv_data((1, 2, 30, 64), 30), bits=4, rotate=True)
    before = [a.copy() for a in (q, k4.codes, k4.scales, k4.offsets, v4.codes)]
    attncore.scaled_dot_product_attention(q, k4, v4)
    for a, b in zip(before, (q, k4.codes, k4.scales, k4.offsets, v4.codes)):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("bad, exc, match", [
    (lambda kv: dataclasses.replace(kv, scales=kv.scales.astype(np.float32)), ValueError,
     "key: scales"),
    (lambda kv: dataclasses.replace(kv, codes=kv.codes.view(np.int8)), TypeError,
     "key: 4-bit codes must be uint8"),
    (lambda kv: dataclasses.replace(kv, group_size=24), ValueError, "key: group_size"),
    (lambda kv: dataclasses.replace(kv, bits=8), TypeError, "key: 8-bit codes"),
    (lambda kv: dataclasses.replace(kv, offsets=kv.offsets[..., :1]), ValueError,
     "key: offsets"),
])
def test_bad_containers(bad, exc, match):
    q = rand((1, 2, 1, 64), 31)
    k4 = quantize_kv(kv_data((1, 2, 30, 64), 32), bits=4)
    with pytest.raises(exc, match=match):
        attncore.scaled_dot_product_attention(q, bad(k4), rand((1, 2, 30, 64), 33))


def test_int8_pairs_unchanged():
    q = rand((1, 2, 1, 64), 34)
    k8 = quantize_kv(kv_data((1, 2, 30, 64), 35))
    assert isinstance(k8, tuple)
    out = attncore.scaled_dot_product_attention(q, k8, k8)
    d = k8[0].astype(np.float64) * k8[1][..., None]
    close(out, sdpa_ref(q, d, d))


def test_int8_pair_beside_a_container(path):
    # an int8 (array, scales) key with a 4-bit value, and the other way round
    q = rand((1, 2, 2, 64), 36)
    k8 = quantize_kv(kv_data((1, 2, 40, 64), 37))
    v4 = quantize_kv(kv_data((1, 2, 40, 64), 38), bits=4, rotate=True)
    d8 = k8[0].astype(np.float64) * k8[1][..., None]
    close(attncore.scaled_dot_product_attention(q, k8, v4), sdpa_ref(q, d8, values_of(v4)))
    k4 = quantize_kv(kv_data((1, 2, 40, 64), 39), bits=4)
    close(attncore.scaled_dot_product_attention(q, k4, k8), sdpa_ref(q, values_of(k4), d8))


def container8(x, rotate):
    """An 8-bit QuantizedKV of x (rotate=False: the int8 pair in a container)."""
    if rotate:
        return quantize_kv(x, rotate=True)
    c, s = quantize_kv(x)
    return attncore.QuantizedKV(codes=c, scales=s[..., None], offsets=None, bits=8,
                                group_size=x.shape[-1], rotate=False)


@pytest.mark.parametrize("rot_k, rot_v", [(True, True), (True, False), (False, True),
                                          (False, False)])
@pytest.mark.parametrize("Hq", [4, 8])
def test_int8_containers_cached_calls(path, rot_k, rot_v, Hq):
    """8-bit containers without options take the cached plain call (their
    codes and scales as the kernel's int8 pair, the query rotated, the
    output rotated back): new data under one metadata, three times, each
    against the float64 reference of its own documented values."""
    B, Hk, M, D = 2, 4, 97, 64
    for seed in range(3):
        q = rand((B, Hq, 1, D), 10 + seed)
        k8, v8 = (container8(kv_data((B, Hk, M, D), s), r)
                  for s, r in ((20 + seed, rot_k), (30 + seed, rot_v)))
        ref = sdpa_ref(q, np.repeat(values_of(k8), Hq // Hk, axis=1),
                       np.repeat(values_of(v8), Hq // Hk, axis=1))
        out = attncore.scaled_dot_product_attention(q, k8, v8, enable_gqa=Hq != Hk)
        assert out.dtype == np.float32 and out.shape == (B, Hq, 1, D)
        close(out, ref)
    # a float64 query: the general path (computed in float64)
    out = attncore.scaled_dot_product_attention(q.astype(np.float64), k8, v8,
                                                enable_gqa=Hq != Hk)
    assert out.dtype == np.float64
    close(out, ref)
