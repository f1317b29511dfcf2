"""scaled_dot_product_attention against a float64 NumPy reference and torch."""
import os
import threading

import numpy as np
import pytest

import attncore
from attncore import scaled_dot_product_attention as sdpa

from reference import attention as ref
from reference import rand

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # pragma: no cover - torch is a test extra
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch not installed")

TOL = {np.float32: dict(rtol=2e-5, atol=2e-6), np.float64: dict(rtol=1e-11, atol=1e-12)}


def qkv(shape_q, shape_k, shape_v, dtype=np.float64, seed=0):
    return rand(shape_q, seed, dtype), rand(shape_k, seed + 1, dtype), rand(shape_v, seed + 2, dtype)


# ---------------------------------------------------------------- basics
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("N,M,D,Dv", [
    (1, 1, 8, 8), (1, 37, 16, 16), (37, 1, 16, 4), (70, 90, 16, 8), (90, 70, 32, 64),
    (600, 530, 64, 64), (33, 1100, 256, 48), (5, 2100, 64, 64),
    (3, 300, 13, 200), (2, 1000, 100, 7), (4, 50, 256, 256), (1, 700, 17, 129), (1, 5, 64, 64),
])
def test_against_reference(dtype, N, M, D, Dv):
    q, k, v = qkv((2, 3, N, D), (2, 3, M, D), (2, 3, M, Dv), dtype)
    out = sdpa(q, k, v)
    assert out.dtype == dtype and out.shape == (2, 3, N, Dv)
    np.testing.assert_allclose(out, ref(q, k, v)[0], **TOL[dtype])


@pytest.mark.parametrize("shapes", [
    ((7, 8), (9, 8), (9, 5)),                                 # 2-D
    ((4, 7, 8), (1, 9, 8), (9, 5)),                           # broadcast batch
    ((2, 3, 7, 8), (3, 9, 8), (2, 1, 9, 5)),                  # 4-D with broadcasting
    ((2, 1, 3, 7, 8), (1, 4, 3, 9, 8), (2, 4, 1, 9, 5)),      # 5-D
])
def test_broadcast_batch_dims(shapes):
    q, k, v = qkv(*shapes)
    out = sdpa(q, k, v)
    expected = ref(q, k, v)[0]
    assert out.shape == expected.shape
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)


def test_noncontiguous_and_transposed_inputs():
    base = rand((2, 40, 3, 16), dtype=np.float64)                     # (B, L, H, D): BLHD layout
    q = base.transpose(0, 2, 1, 3)                  # (B, H, L, D) view, row stride 48
    k = rand((2, 3, 16, 50), dtype=np.float64).transpose(0, 1, 3, 2)  # last axis not contiguous
    v = rand((2, 3, 100, 24), dtype=np.float64)[:, :, ::2, ::3]       # strided rows and columns
    kc, vc = k.copy(), v.copy()
    qc = q.copy()
    out = sdpa(q, k, v)
    np.testing.assert_allclose(out, ref(q, k, v)[0], rtol=1e-12, atol=1e-12)
    # inputs untouched
    np.testing.assert_array_equal(q, qc)
    np.testing.assert_array_equal(k, kc)
    np.testing.assert_array_equal(v, vc)
    # negative strides and Fortran order
    q2 = np.asfortranarray(rand((30, 16), dtype=np.float64)[::-1])
    k2 = rand((40, 16), dtype=np.float64)[::-1]
    v2 = np.asfortranarray(rand((40, 8), dtype=np.float64))
    np.testing.assert_allclose(sdpa(q2, k2, v2), ref(q2, k2, v2)[0], rtol=1e-12, atol=1e-12)


def test_scale():
    q, k, v = qkv((2, 10, 8), (2, 12, 8), (2, 12, 8))
    np.testing.assert_allclose(sdpa(q, k, v, scale=0.3), ref(q, k, v, scale=0.3)[0], rtol=1e-12)


# ---------------------------------------------------------------- masks / causal
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("mask_shape", [(2, 3, 70, 600), (2, 1, 1, 600), (1, 70, 600), (600,), (2, 3, 70, 1)])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_masks(dtype, mask_shape, kind):
    q, k, v = qkv((2, 3, 70, 16), (2, 3, 600, 16), (2, 3, 600, 8), dtype)
    rng = np.random.default_rng(5)
    mb = rng.random(mask_shape) > 0.4
    if kind == "bool":
        mask = mb
    else:
        mask = np.where(mb, rng.standard_normal(mask_shape), -np.inf).astype(dtype)
    mcopy = mask.copy()
    out = sdpa(q, k, v, mask)
    np.testing.assert_allclose(out, ref(q, k, v, mask)[0], **TOL[dtype])
    np.testing.assert_array_equal(mask, mcopy)


def test_key_padding_blocks_skipped_match():
    # long masked stretches cover whole key tiles (which are skipped)
    q, k, v = qkv((2, 4, 100, 32), (2, 4, 3000, 32), (2, 4, 3000, 32))
    mask = np.zeros((2, 1, 1, 3000), bool)
    mask[0, ..., :700] = True
    mask[1, ..., 1500:1600] = True
    np.testing.assert_allclose(sdpa(q, k, v, mask), ref(q, k, v, mask)[0], rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("causal,code", [(True, 1), ("upper_left", 1), ("lower_right", 2)])
@pytest.mark.parametrize("N,M", [(64, 64), (40, 100), (100, 40), (1, 50), (700, 700), (300, 1300)])
def test_causal(causal, code, N, M):
    q, k, v = qkv((2, 2, N, 16), (2, 2, M, 16), (2, 2, M, 16))
    np.testing.assert_allclose(sdpa(q, k, v, is_causal=causal), ref(q, k, v, causal=code)[0],
                               rtol=1e-11, atol=1e-12)


def test_causal_with_mask_both_apply():
    q, k, v = qkv((2, 50, 16), (2, 50, 16), (2, 50, 16))
    mask = np.random.default_rng(1).random((2, 50, 50)) > 0.5
    np.testing.assert_allclose(sdpa(q, k, v, mask, is_causal=True),
                               ref(q, k, v, mask, causal=1)[0], rtol=1e-11, atol=1e-12)


def test_fully_masked_rows_give_zero():
    q, k, v = qkv((2, 10, 8), (2, 700, 8), (2, 700, 8))
    mask = np.ones((2, 10, 700), bool)
    mask[0, 3] = False
    mask[1, 7] = False
    out, w = sdpa(q, k, v, mask, return_weights=True)
    assert np.all(out[0, 3] == 0) and np.all(out[1, 7] == 0)
    assert np.all(w[0, 3] == 0) and np.all(w[1, 7] == 0)
    assert np.all(np.isfinite(out))
    # float mask of all -inf: same
    fm = np.where(mask, 0.0, -np.inf)
    np.testing.assert_array_equal(sdpa(q, k, v, fm)[0, 3], 0)
    # lower-right causal with N > M: the first N - M queries see nothing
    q2, k2, v2 = qkv((12, 8), (5, 8), (5, 8))
    out2 = sdpa(q2, k2, v2, is_causal="lower_right")
    assert np.all(out2[:7] == 0)
    np.testing.assert_allclose(out2, ref(q2, k2, v2, causal=2)[0], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("where", ["q", "k", "v", "mask"])
@pytest.mark.parametrize("return_weights", [False, True])
def test_nan_propagates(where, return_weights):
    q, k, v = qkv((1, 6, 8), (1, 900, 8), (1, 900, 8))
    mask = np.zeros((1, 6, 900))
    if where == "q":
        q[0, 2, 3] = np.nan
    elif where == "k":
        k[0, 800, 1] = np.nan
    elif where == "v":
        v[0, 10, 4] = np.nan
    else:
        mask[0, 4, 20] = np.nan
    res = sdpa(q, k, v, mask, return_weights=return_weights)
    out = res[0] if return_weights else res
    expected = ref(q, k, v, mask)[0]
    np.testing.assert_array_equal(np.isnan(out), np.isnan(expected))
    assert np.isnan(out).any()
    np.testing.assert_allclose(out[~np.isnan(out)], expected[~np.isnan(expected)], rtol=1e-12)


def test_nan_in_masked_out_key_does_not_poison_scores():
    q, k, v = qkv((1, 6, 8), (1, 900, 8), (1, 900, 8))
    k[0, 100] = np.nan
    mask = np.ones((1, 1, 900), bool)
    mask[..., 100] = False
    out = sdpa(q, k, v, mask)
    assert np.all(np.isfinite(out))
    np.testing.assert_allclose(out, ref(q, np.nan_to_num(k), v, mask)[0], rtol=1e-12)


# ---------------------------------------------------------------- -inf scores from values
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("N,M,threads", [(3, 5, 1), (1, 5000, 2), (300, 700, 2), (2, 40, 1)])
@pytest.mark.parametrize("return_weights", [False, True])
def test_all_minus_inf_scores_from_values_give_zero(dtype, N, M, threads, return_weights):
    """Every attended score of row 0 is -inf because the query holds -inf
    (and the keys' matching column is > 0): the row comes out 0 (weights
    0), as for a row with nothing to attend and as PyTorch gives; a row of
    +inf scores is NaN (inf - inf); the other rows are the reference's."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((N, 4)).astype(dtype)
    k = (np.abs(rng.standard_normal((M, 4))) + 0.5).astype(dtype)
    v = rng.standard_normal((M, 3)).astype(dtype)
    q[0, 0] = -np.inf
    if N > 1:
        q[1, 0] = np.inf
    res = sdpa(q, k, v, return_weights=return_weights, num_threads=threads)
    out, w = res if return_weights else (res, None)
    np.testing.assert_array_equal(out[0], 0)
    if w is not None:
        np.testing.assert_array_equal(w[0], 0)
    if N > 1:
        assert np.isnan(out[1]).all()
    if N > 2:
        tol = dict(rtol=2e-5, atol=2e-6) if dtype == np.float32 else dict(rtol=1e-11, atol=1e-12)
        np.testing.assert_allclose(out[2:], ref(q[2:], k, v)[0], **tol)


@needs_torch
def test_all_minus_inf_scores_match_torch():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 3, 6, 8)).astype(np.float32)
    k = (np.abs(rng.standard_normal((2, 3, 9, 8))) + 0.5).astype(np.float32)
    v = rng.standard_normal((2, 3, 9, 4)).astype(np.float32)
    q[:, :, 0, 3] = -np.inf
    q[1, 2, 4, 5] = -np.inf
    expected = torch.nn.functional.scaled_dot_product_attention(
        torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v)).numpy()
    np.testing.assert_allclose(sdpa(q, k, v), expected, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- GQA
@pytest.mark.parametrize("Hk", [1, 2, 4, 8])
def test_gqa(Hk):
    q, k, v = qkv((2, 8, 20, 16), (2, Hk, 30, 16), (2, Hk, 30, 8))
    out = sdpa(q, k, v, enable_gqa=True, is_causal="lower_right")
    np.testing.assert_allclose(out, ref(q, k, v, causal=2, group=8 // Hk)[0], rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- weights
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_return_weights(dtype):
    q, k, v = qkv((2, 3, 50, 16), (2, 3, 70, 16), (2, 3, 70, 8), dtype)
    mask = np.random.default_rng(3).random((2, 1, 50, 70)) > 0.3
    mask[0, 0, 5] = False
    out, w = sdpa(q, k, v, mask, is_causal=True, return_weights=True)
    ro, rw = ref(q, k, v, mask, causal=1)
    np.testing.assert_allclose(out, ro, **TOL[dtype])
    np.testing.assert_allclose(w, rw, **TOL[dtype])
    sums = w.sum(-1)
    empty = ~(mask & np.tril(np.ones((50, 70), bool))).any(-1)
    empty = np.broadcast_to(empty, sums.shape)
    np.testing.assert_allclose(sums[~empty], 1, rtol=1e-5)
    assert np.all(sums[empty] == 0)
    np.testing.assert_allclose(out, sdpa(q, k, v, mask, is_causal=True), **TOL[dtype])


# ---------------------------------------------------------------- dtypes
def test_float16_and_promotion():
    q, k, v = qkv((2, 10, 8), (2, 12, 8), (2, 12, 8), np.float16)
    out = sdpa(q, k, v)
    assert out.dtype == np.float16
    np.testing.assert_allclose(out.astype(np.float64), ref(q, k, v)[0], rtol=1e-2, atol=2e-3)
    out = sdpa(q.astype(np.float32), k.astype(np.float64), v)
    assert out.dtype == np.float64
    out = sdpa(q, k.astype(np.float32), v)
    assert out.dtype == np.float32
    # a float64 mask does not promote float32 inputs
    out = sdpa(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), np.zeros((10, 12)))
    assert out.dtype == np.float32


def test_float32_large_accuracy():
    """float32 within 1e-5 relative of the float64 reference at N = M = 4096."""
    q, k, v = qkv((1, 1, 4096, 64), (1, 1, 4096, 64), (1, 1, 4096, 64), np.float32)
    out = sdpa(q, k, v)
    expected = ref(q, k, v)[0]
    err = np.abs(out - expected).max() / np.abs(expected).max()
    assert err < 1e-5, err
    out = sdpa(q, k, v, is_causal=True)
    expected = ref(q, k, v, causal=1)[0]
    assert np.abs(out - expected).max() / np.abs(expected).max() < 1e-5


# ---------------------------------------------------------------- edge sizes
def test_empty_sizes():
    q, k, v = qkv((2, 0, 8), (2, 5, 8), (2, 5, 3))
    out, w = sdpa(q, k, v, return_weights=True)
    assert out.shape == (2, 0, 3) and w.shape == (2, 0, 5)
    q, k, v = qkv((2, 4, 8), (2, 0, 8), (2, 0, 3))
    out, w = sdpa(q, k, v, return_weights=True)
    assert out.shape == (2, 4, 3) and np.all(out == 0) and w.shape == (2, 4, 0)
    q, k, v = qkv((0, 4, 8), (0, 6, 8), (0, 6, 3))
    assert sdpa(q, k, v).shape == (0, 4, 3)
    q, k, v = qkv((2, 4, 8), (2, 6, 8), (2, 6, 0))
    out, w = sdpa(q, k, v, return_weights=True)
    assert out.shape == (2, 4, 0)
    np.testing.assert_allclose(w, ref(q, k, np.zeros((2, 6, 1)))[1], rtol=1e-12)


# ---------------------------------------------------------------- threads
@pytest.mark.parametrize("shape", [(2, 4, 300, 600, 32), (1, 2, 1, 5000, 64), (1, 1, 2000, 2000, 16)])
def test_thread_count_agnostic(shape):
    B, H, N, M, D = shape
    q, k, v = qkv((B, H, N, D), (B, H, M, D), (B, H, M, D), np.float32)
    mask = np.random.default_rng(2).random((B, 1, 1, M)) > 0.2
    outs = [sdpa(q, k, v, mask, is_causal="lower_right", num_threads=t) for t in (1, 2, 3, 8, -1, None)]
    for o in outs[1:]:
        np.testing.assert_allclose(o, outs[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(outs[0], ref(q, k, v, mask, causal=2)[0], rtol=2e-5, atol=2e-6)


def test_many_python_threads():
    q, k, v = qkv((4, 4, 200, 32), (4, 4, 300, 32), (4, 4, 300, 32), np.float32)
    expected = ref(q, k, v, causal=1)[0]
    results, errors = [None] * 8, []

    def work(i):
        try:
            for _ in range(5):
                results[i] = sdpa(q, k, v, is_causal=True)
        except Exception as exc:  # pragma: no cover
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    # every thread's result is the float64 reference to float32 rounding
    # (BLAS may round differently from another calling thread)
    for r in results:
        np.testing.assert_allclose(r, expected, **TOL[np.float32])


# ---------------------------------------------------------------- errors
def _err(exc, match, *args, **kw):
    with pytest.raises(exc, match=match):
        sdpa(*args, **kw)


def _args(*args, **kw):
    return args, kw


# (id, exception, message pattern naming the argument, (q, k, v) -> (args, kwargs))
BAD_INPUTS = [
    ("query-1d", ValueError, r"query must have at least 2 dimensions.*\(8,\)",
     lambda q, k, v: _args(q[0, 0], k, v)),
    ("key-dim", ValueError, r"key last dimension must equal query's \(D = 8\)",
     lambda q, k, v: _args(q, k[..., :5], v)),
    ("value-rows", ValueError, r"value must have as many rows as key \(M = 6\)",
     lambda q, k, v: _args(q, k, v[:, :5])),
    ("batch-not-broadcastable", ValueError,
     r"batch dimensions .* not broadcastable: query \(2,\), key \(3,\)",
     lambda q, k, v: _args(q, rand((3, 6, 8), dtype=np.float64), rand((3, 6, 3), dtype=np.float64))),
    ("attn_mask-shape", ValueError,
     r"attn_mask must be broadcastable to \(\.\.\., N, M\) = \(\.\.\., 4, 6\), got shape \(4, 5\)",
     lambda q, k, v: _args(q, k, v, np.ones((4, 5), bool))),
    ("attn_mask-batch", ValueError, r"batch dimensions .*attn_mask \(3,\)",
     lambda q, k, v: _args(q, k, v, np.ones((3, 4, 6), bool))),
    ("attn_mask-int", TypeError, r"attn_mask must be a bool array .* got dtype int64",
     lambda q, k, v: _args(q, k, v, np.ones((4, 6), np.int64))),
    ("is_causal-str", ValueError,
     r"is_causal must be False, True, 'upper_left' or 'lower_right', got 'lower'",
     lambda q, k, v: _args(q, k, v, is_causal="lower")),
    ("is_causal-int", ValueError, r"is_causal .* got 1",
     lambda q, k, v: _args(q, k, v, is_causal=1)),
    ("scale-zero", ValueError, r"scale must be finite and > 0",
     lambda q, k, v: _args(q, k, v, scale=0.0)),
    ("scale-negative", ValueError, r"scale must be finite and > 0",
     lambda q, k, v: _args(q, k, v, scale=-1.0)),
    ("scale-inf", ValueError, r"scale must be finite and > 0",
     lambda q, k, v: _args(q, k, v, scale=float("inf"))),
    ("scale-nan", ValueError, r"scale must be finite and > 0",
     lambda q, k, v: _args(q, k, v, scale=float("nan"))),
    ("scale-str", TypeError, r"scale must be a positive real number",
     lambda q, k, v: _args(q, k, v, scale="1")),
    ("num_threads-zero", ValueError, r"num_threads must be None, -1 \(all cores\) or >= 1, got 0",
     lambda q, k, v: _args(q, k, v, num_threads=0)),
    ("num_threads-minus2", ValueError, r"num_threads .* got -2",
     lambda q, k, v: _args(q, k, v, num_threads=-2)),
    ("num_threads-float", TypeError, r"num_threads must be None or an int",
     lambda q, k, v: _args(q, k, v, num_threads=1.5)),
    *[(f"query-{np.dtype(dt)}", TypeError,
       rf"query must be a bfloat16, float16, float32 or float64 array, got dtype {np.dtype(dt)}",
       lambda q, k, v, dt=dt: _args(q.astype(dt), k, v))
      for dt in (np.int32, np.complex64, object, bool)],
    ("value-int64", TypeError, r"value must be a bfloat16, float16, float32 or float64",
     lambda q, k, v: _args(q, k, v.astype(np.int64))),
]


@pytest.mark.parametrize("exc, match, make", [c[1:] for c in BAD_INPUTS],
                         ids=[c[0] for c in BAD_INPUTS])
def test_bad_inputs(exc, match, make):
    args, kw = make(*qkv((2, 4, 8), (2, 6, 8), (2, 6, 3)))
    _err(exc, match, *args, **kw)


# (id, exception, message pattern, key/value heads, (q, k, v) -> (args, kwargs))
BAD_GQA = [
    ("heads-do-not-divide", ValueError, r"key/value heads \(axis -3, 3\) must divide the query heads \(8\)",
     3, lambda q, k, v: _args(q, k, v, enable_gqa=True)),
    ("enable_gqa-missing", ValueError, r"pass enable_gqa=True",
     2, lambda q, k, v: _args(q, k, v)),
    ("value-heads", ValueError, r"key and value must have the same number of heads",
     2, lambda q, k, v: _args(q, k, v[:, :1], enable_gqa=True)),
    ("enable_gqa-no-head-axis", ValueError, r"enable_gqa=True needs a head axis",
     2, lambda q, k, v: _args(q[0, 0], k[0, 0], v[0, 0], enable_gqa=True)),
]


@pytest.mark.parametrize("exc, match, kv_heads, make", [c[1:] for c in BAD_GQA],
                         ids=[c[0] for c in BAD_GQA])
def test_bad_gqa(exc, match, kv_heads, make):
    q, k, v = qkv((2, 8, 4, 8), (2, kv_heads, 6, 8), (2, kv_heads, 6, 8))
    args, kw = make(q, k, v)
    _err(exc, match, *args, **kw)


# ---------------------------------------------------------------- torch
@needs_torch
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", ["plain", "bool_mask", "float_mask", "causal", "lower_right", "gqa", "keypad"])
def test_against_torch(dtype, case):
    B, H, N, M, D, Dv = 2, 4, 130, 700, 64, 32
    if case == "causal":
        M = N
    q, k, v = qkv((B, H, N, D), (B, H, M, D), (B, H, M, Dv), dtype)
    kw, tkw, mask = {}, {}, None
    rng = np.random.default_rng(7)
    if case == "bool_mask":
        mask = rng.random((B, H, N, M)) > 0.3
    elif case == "float_mask":
        mask = rng.standard_normal((B, 1, N, M)).astype(dtype)
    elif case == "keypad":
        mask = np.ones((B, 1, 1, M), bool)
        mask[0, ..., 500:] = False
    elif case == "causal":
        kw["is_causal"] = tkw["is_causal"] = True
    elif case == "lower_right":
        kw["is_causal"] = "lower_right"
        from torch.nn.attention.bias import causal_lower_right
        mask_t = causal_lower_right(N, M)
        tkw["attn_mask"] = mask_t
    elif case == "gqa":
        k, v = k[:, :2], v[:, :2]
        kw["enable_gqa"] = tkw["enable_gqa"] = True
    out = sdpa(q, k, v, mask, **kw)
    tm = None if mask is None else torch.from_numpy(mask)
    with torch.inference_mode():
        expected = F.scaled_dot_product_attention(
            torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v),
            **({"attn_mask": tm} if tm is not None else {}), **tkw).numpy()
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == np.float32 else dict(rtol=1e-10, atol=1e-11)
    np.testing.assert_allclose(out, expected, **tol)


@needs_torch
def test_fully_masked_rows_match_torch():
    q, k, v = qkv((1, 2, 5, 8), (1, 2, 6, 8), (1, 2, 6, 8))
    mask = np.ones((1, 2, 5, 6), bool)
    mask[0, 1, 2] = False
    out = sdpa(q, k, v, mask)
    with torch.inference_mode():
        expected = F.scaled_dot_product_attention(
            torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v),
            attn_mask=torch.from_numpy(mask)).numpy()
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)
    assert np.all(out[0, 1, 2] == 0)


# ---------------------------------------------------------------- kernel exp
@pytest.mark.parametrize("dtype,lo,ulp", [(np.float32, -87.3, 2.0), (np.float64, -708.0, 2.0)])
def test_kernel_exp_accuracy(dtype, lo, ulp):
    from attncore._core import _sdpa

    x = np.linspace(lo, 0, 1_000_001).astype(dtype)
    y = _sdpa.exp_array(x)
    exact = np.exp(x.astype(np.longdouble))
    err = np.abs(y.astype(np.longdouble) - exact) / np.spacing(exact.astype(dtype)).astype(np.longdouble)
    assert float(err.max()) <= ulp
    special = np.array([-np.inf, np.inf, np.nan, 0.0, -1e4, 1e4], dtype)
    got = _sdpa.exp_array(special)
    np.testing.assert_array_equal(got[[0, 1, 3, 4, 5]], [0, np.inf, 1, 0, np.inf])
    assert np.isnan(got[2])


def test_show_config(capsys):
    attncore.show_config()
    out = capsys.readouterr().out
    assert "OpenMP" in out and "BLAS" in out and "numpy" in out


@pytest.mark.skipif(os.environ.get("ATTNCORE_NO_OPENMP", "") not in ("", "0"),
                    reason="deliberately built without OpenMP")
def test_openmp_built_in():
    from attncore._core import _sdpa

    assert _sdpa.openmp_enabled(), "attncore was built without OpenMP"


@pytest.mark.skipif(os.environ.get("ATTNCORE_NO_OPENMP", "") not in ("", "0"),
                    reason="deliberately built without OpenMP")
def test_num_threads_none_follows_openmp_settings():
    import subprocess
    import sys

    code = ("import attncore._threads as t, threadpoolctl, numpy as np\n"
            "print(t.resolve_num_threads(None))\n"
            "with threadpoolctl.threadpool_limits(limits=1, user_api='openmp'):\n"
            "    print(t.resolve_num_threads(None))\n")
    env = dict(os.environ, OMP_NUM_THREADS="3")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert res.stdout.split() == ["3", "1"]


def test_read_only_inputs():
    q, k, v = qkv((2, 20, 8), (2, 30, 8), (2, 30, 8))
    mask = np.random.default_rng(0).random((2, 1, 30)) > 0.3
    for a in (q, k, v, mask):
        a.flags.writeable = False
    np.testing.assert_allclose(sdpa(q, k, v, mask), ref(q, k, v, mask)[0], rtol=1e-12, atol=1e-12)
    # broadcast views (read-only, zero strides) work too
    kb = np.broadcast_to(k[:1], (2, 30, 8))
    np.testing.assert_allclose(sdpa(q, kb, v), ref(q, kb, v)[0], rtol=1e-12, atol=1e-12)


def test_non_native_byte_order():
    """Big-endian arrays (as read from some files) give the same results."""
    q, k, v = qkv((2, 7, 8), (2, 9, 8), (2, 9, 5), np.float32)
    mask = np.random.default_rng(4).standard_normal((7, 9)).astype(">f8")
    expected = ref(q, k, v, mask.astype(np.float64))[0]
    for dt in (">f4", ">f8"):
        qb, kb, vb = (a.astype(dt) for a in (q, k, v))
        out = sdpa(qb, kb, vb, mask)
        assert out.dtype.isnative and out.dtype.itemsize == np.dtype(dt).itemsize
        np.testing.assert_allclose(out, expected, rtol=2e-5, atol=2e-6)
    out16 = sdpa(q.astype(">f2"), k.astype(">f2"), v.astype(">f2"))
    assert out16.dtype == np.float16


@pytest.mark.parametrize("bad", [np.inf, np.nan])
@pytest.mark.parametrize("N", [300, 3])
def test_nonfinite_values_of_unattended_keys_do_not_leak(bad, N):
    """inf / NaN in a value row only reaches the queries that attend that key,
    whatever the thread count, the tile sizes or the kernel path."""
    q, k, v = qkv((1, 1, N, 16), (1, 1, 300, 16), (1, 1, 300, 16), np.float32)
    v[0, 0, 200] = bad
    km = np.ones(300, bool)
    km[200] = False
    cases = [(dict(attn_mask=km), np.zeros(N, bool))]
    if N == 300:  # upper-left causal: rows >= 200 attend key 200
        cases.append((dict(is_causal=True), np.arange(N) >= 200))
    for kw, reached in cases:
        for nt in (1, 2, 8):
            for rw in (False, True):
                res = sdpa(q, k, v, num_threads=nt, return_weights=rw, **kw)
                out = res[0] if rw else res
                assert np.array_equal(~np.isfinite(out).all(-1)[0, 0], reached), (kw, nt, rw)
                clean = np.isfinite(out).all(-1)[0, 0]
                v2 = v.copy()
                v2[0, 0, 200] = 0
                np.testing.assert_allclose(out[0, 0, clean], ref(q, k, v2, **(
                    {"mask": km} if "attn_mask" in kw else {"causal": 1}))[0][0, 0, clean],
                    rtol=2e-5, atol=2e-6)
