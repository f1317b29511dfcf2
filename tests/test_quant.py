"""int8 keys / values: quantize_kv's round-trip bound (also for values at
the ends of the float32 range), the kernel with quantized K, V or both
against float64 attention over the dequantized arrays (every path, decode
and prefill shapes, masks, causal, windows, GQA, threads, values of width
0), the int8 KV cache of MultiHeadAttention, what is read as an int8
``(data, scales)`` pair, and bad inputs."""
import os
import re
import sys

import numpy as np
import pytest

import attncore
from attncore import quantize_kv
from attncore import scaled_dot_product_attention as sdpa

from reference import attention as ref
from reference import lse_ref
from reference import rand

try:
    import torch
except ImportError:  # pragma: no cover - torch is a test extra
    torch = None

TOL32 = dict(rtol=3e-5, atol=3e-6)
F32_MAX = float(np.finfo(np.float32).max)


def deq(pair):
    q, s = pair
    return q.astype(np.float64) * s.astype(np.float64)[..., None]


@pytest.mark.parametrize("shape,axis", [((3, 5, 17), -1), ((2, 4, 9, 64), -1), ((6, 8), 0),
                                        ((4, 3), 1)])
def test_round_trip_bound(shape, axis):
    x = rand(shape, 1, np.float64) * 7
    x[0] = 0  # an all-zero slice
    q, s = quantize_kv(x, axis=axis)
    assert q.dtype == np.int8 and s.dtype == np.float32
    assert s.shape == tuple(n for i, n in enumerate(shape) if i != axis % len(shape))
    se = np.expand_dims(s.astype(np.float64), axis)
    assert np.all(np.abs(q * se - x) <= se / 2 + 1e-12)
    assert np.all(np.abs(q) <= 127)
    # the largest magnitude of every slice maps to +-127
    assert np.all(np.max(np.abs(q), axis=axis)[np.max(np.abs(x), axis=axis) > 0] == 127)


@pytest.mark.parametrize("which", ["k", "v", "kv"])
@pytest.mark.parametrize("N,M", [(1, 3000), (3, 130), (70, 300), (300, 1000)])
@pytest.mark.parametrize("causal", [0, 2])
def test_kernel_against_dequantized(path, which, N, M, causal):
    q, k, v = rand((2, 4, N, 64), 1), rand((2, 2, M, 64), 2), rand((2, 2, M, 40), 3)
    kq, vq = quantize_kv(k), quantize_kv(v)
    kk = kq if "k" in which else k
    vv = vq if "v" in which else v
    expected = ref(q, deq(kq) if "k" in which else k, deq(vq) if "v" in which else v,
                   causal=causal, group=2)[0]
    for t in (1, 2):
        out = attncore.scaled_dot_product_attention(
            q, kk, vv, is_causal={0: False, 2: "lower_right"}[causal], enable_gqa=True,
            num_threads=t)
        np.testing.assert_allclose(out, expected, **TOL32)


def test_kernel_with_masks_windows_and_weights(path):
    q, k, v = rand((2, 2, 50, 32), 1), rand((2, 2, 200, 32), 2), rand((2, 2, 200, 16), 3)
    kq, vq = quantize_kv(k), quantize_kv(v)
    mask = np.random.default_rng(4).random((2, 1, 1, 200)) > 0.3
    i = np.arange(50)[:, None] + 150
    j = np.arange(200)[None, :]
    band = (j <= i) & (j >= i - 20)
    out, w = attncore.scaled_dot_product_attention(
        q, kq, vq, mask, is_causal="lower_right", window=(20, 0), return_weights=True)
    eo, ew = ref(q, deq(kq), deq(vq), mask & band)
    np.testing.assert_allclose(out, eo, **TOL32)
    np.testing.assert_allclose(w, ew, **TOL32)


def test_float64_query_with_quantized_keys():
    q, k, v = rand((1, 10, 16), 1, np.float64), rand((1, 40, 16), 2), rand((1, 40, 8), 3)
    kq = quantize_kv(k)
    out = attncore.scaled_dot_product_attention(q, kq, v)
    assert out.dtype == np.float64
    np.testing.assert_allclose(out, ref(q, deq(kq), v)[0], rtol=1e-10, atol=1e-12)


DOCS = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "guide", "variants.rst")


def quoted_int8_errors():
    """{"keys only": 1.0e-3, ...}: the accuracy table of docs/guide/variants.rst."""
    if not os.path.exists(DOCS):
        pytest.skip("docs/guide/variants.rst is not in this checkout")
    with open(DOCS, encoding="utf-8") as f:
        text = f.read()
    rows = re.findall(r"^   \* - (keys only|values only|keys and values)\n     - ([0-9.e-]+)$",
                      text, re.M)
    assert len(rows) == 3, "the int8 accuracy table of variants.rst changed its layout"
    return {name: float(val) for name, val in rows}


def int8_errors(seed):
    """The recipe of ``python bench/report.py int8-accuracy`` (imported from
    it, so the script that prints the table and this test measure the same
    thing)."""
    bench = os.path.join(os.path.dirname(__file__), os.pardir, "bench")
    if not os.path.exists(os.path.join(bench, "report.py")):
        pytest.skip("bench/report.py is not in this checkout")
    bench = os.path.abspath(bench)
    sys.path.insert(0, bench)
    try:
        import report
    finally:  # report.py puts bench/ on the path too: take both off
        sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != bench]
    return report.int8_errors(seed)


def test_accuracy_is_the_figure_the_docs_quote(path):
    """int8 attention is as close to the float attention it replaces as
    variants.rst's table says: each measured error within 20 % of the quoted
    figure (so a figure that is too optimistic fails, and so does one that
    is far too pessimistic)."""
    quoted = quoted_int8_errors()
    for seed in (11, 12):
        for case, err in int8_errors(seed).items():
            assert 0.8 * quoted[case] < err < 1.2 * quoted[case], (case, seed, err, quoted[case])


def test_mha_int8_cache_equals_attention_over_dequantized_cache():
    rng = np.random.default_rng(0)
    mha = attncore.MultiHeadAttention(64, 4, num_kv_heads=2, rng=0)
    x = rng.standard_normal((2, 40, 64)).astype(np.float32)
    cache = mha.new_cache(2, 64, dtype="int8")
    mha(x[:, :30], cache=cache, is_causal="lower_right")
    y, _ = mha(x[:, 30:31], cache=cache, is_causal="lower_right")
    # the same step by hand: projections, attention over the dequantized cache
    keys, values = cache.keys.astype(np.float64), cache.values.astype(np.float64)
    assert keys.shape == (2, 2, 31, 16)
    xq = x[:, 30:31].astype(np.float64) @ mha.q_weight.T.astype(np.float64) + mha.q_bias
    q4 = xq.reshape(2, 1, 4, 16).transpose(0, 2, 1, 3)
    o = ref(q4, keys, values, group=2)[0]
    o = o.transpose(0, 2, 1, 3).reshape(2, 1, 64) @ mha.out_weight.T.astype(np.float64) \
        + mha.out_bias
    np.testing.assert_allclose(y, o, rtol=2e-4, atol=2e-5)
    # appending quantized only the new tokens: the first 30 are unchanged
    before = cache.keys[:, :, :30].copy()
    mha(x[:, 31:32], cache=cache, is_causal="lower_right")
    np.testing.assert_array_equal(cache.keys[:, :, :30], before)
    f32 = mha.new_cache(2, 64)
    assert cache.nbytes < 0.35 * f32.nbytes


@pytest.mark.parametrize("key,exc,match", [
    (np.zeros((5, 8), np.int8), TypeError, "without scales"),
    ((np.zeros((5, 8), np.float32), np.ones(5, np.float32)), TypeError, "int8"),
    ((np.zeros((5, 8), np.int8), np.ones(4, np.float32)), ValueError, "scales"),
    ((np.zeros((5, 8), np.int8), np.ones((5, 8), np.float32)), ValueError, "scales"),
], ids=["int8-without-scales", "float-pair", "short-scales", "scales-with-last-axis"])
def test_bad_quantized_inputs(key, exc, match):
    q = np.zeros((3, 8), np.float32)
    with pytest.raises(exc, match=match):
        attncore.scaled_dot_product_attention(q, key, np.zeros((5, 8), np.float32))


def test_bad_quantize_kv_inputs():
    with pytest.raises(ValueError, match="finite"):
        quantize_kv(np.array([[1.0, np.inf]]))
    with pytest.raises(TypeError, match="axis"):
        quantize_kv(np.ones((2, 2)), axis=1.0)
    with pytest.raises(ValueError, match="axis"):
        quantize_kv(np.ones((2, 2)), axis=2)
    with pytest.raises(TypeError):
        quantize_kv(np.ones((2, 2), np.int32))
    mha = attncore.MultiHeadAttention(16, 2)
    with pytest.raises(ValueError, match="'int8' or 'int4'"):
        mha.new_cache(1, 8, dtype="int2")


# ------------------------------------------------ int8 key, value of width 0
@pytest.mark.parametrize("N", [3, 9])
def test_int8_key_empty_value_lse(path, N):
    q, k = rand((2, 3, N, 16), 17), rand((2, 3, 20, 16), 18)
    kq = quantize_kv(k)
    kd = kq[0].astype(np.float64) * kq[1].astype(np.float64)[..., None]
    v0 = np.zeros((2, 3, 20, 0), np.float32)
    out, lse = sdpa(q, kq, v0, return_lse=True, is_causal="lower_right")
    assert out.shape == (2, 3, N, 0)
    np.testing.assert_allclose(lse, lse_ref(q, kd, causal=2), **TOL32)
    # and the float key's lse, up to the quantization
    np.testing.assert_allclose(lse, sdpa(q, k, v0, return_lse=True, is_causal="lower_right")[1],
                               atol=0.05)
    out, w, lse_w = sdpa(q, kq, v0, return_weights=True, return_lse=True)
    np.testing.assert_allclose(lse_w, lse_ref(q, kd), **TOL32)
    np.testing.assert_allclose(w, ref(q, kd, np.zeros((2, 3, 20, 1)))[1], **TOL32)


# ------------------------------------------------ quantize_kv's value range
@pytest.mark.parametrize("big", [1e41, 3.5e38])
def test_quantize_kv_beyond_float32_range(big):
    x = np.array([[1.0, -2.0], [big, 1.0]])
    with pytest.raises(ValueError, match=r"x must lie within the float32 range.*max \|x\|"):
        quantize_kv(x)


def _check_bound(x, q, s):
    se = s.astype(np.float64)[..., None]
    assert np.all(np.abs(q.astype(np.float64) * se - x) <= se / 2)
    assert np.all(np.abs(q.astype(np.int16)) <= 127)
    assert np.all(s[np.max(np.abs(x), axis=-1) > 0] > 0)


def test_quantize_kv_at_float32_max():
    x = np.array([[F32_MAX, 1.0, -3e38], [-F32_MAX, F32_MAX, 0.0]])
    q, s = quantize_kv(x)
    _check_bound(x, q, s)
    deq = q.astype(np.float32) * s[:, None]        # what the kernel computes
    assert np.all(np.isfinite(deq))
    assert abs(int(q[0, 0])) == 127 and np.all(np.abs(q[1, :2]) == 127)


@pytest.mark.parametrize("mag", [1e-36, 1e-40, 2.5e-43, 1e-44, 5e-46, 1e-300])
def test_quantize_kv_tiny_values(mag):
    """Scales below float32's normal range: rounded up, the half-step bound
    still holds and no slice but an all-zero one gets scale 0."""
    x = rand((6, 33), 19, np.float64) * mag
    x[2] = 0
    x[3, 5] = mag * 7                     # a larger outlier
    q, s = quantize_kv(x)
    _check_bound(x, q, s)
    assert s[2] == 0 and np.all(q[2] == 0)


def test_quantize_kv_tiny_values_in_attention(path):
    q = rand((6, 8), 20)
    k = rand((10, 8), 21, np.float64) * 1e-40
    v = rand((10, 8), 22, np.float64) * 1e-40
    kq, vq = quantize_kv(k), quantize_kv(v)
    kd = kq[0].astype(np.float64) * kq[1].astype(np.float64)[:, None]
    vd = vq[0].astype(np.float64) * vq[1].astype(np.float64)[:, None]
    out = sdpa(q, kq, vq)
    expected = ref(q, kd, vd)[0]
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


# ------------------------------------------- what is read as an int8 pair
def test_issue_reproducer_tuple_key(path):
    out = sdpa(np.ones((1, 2)), (np.array([1.0, 0.0]), np.array([0.0, 1.0])), np.eye(2))
    np.testing.assert_allclose(out, ref(np.ones((1, 2)), np.eye(2), np.eye(2))[0])


@pytest.mark.parametrize("container", [tuple, list])
def test_two_float_rows_are_an_array_like(path, container):
    q, k, v = rand((7, 4), 23), rand((2, 4), 24), rand((2, 3), 25)
    expected = ref(q, k, v)[0]
    for key, value in [(container(k), v), (k, container(v)), (container(k), container(v)),
                       (container([list(k[0]), list(k[1])]), v)]:
        np.testing.assert_allclose(sdpa(q, key, value), expected, **TOL32)


@pytest.mark.skipif(torch is None, reason="needs torch")
def test_two_torch_rows_and_torch_int8_pairs(path):
    q, k, v = rand((7, 4), 26), rand((2, 4), 27), rand((2, 3), 28)
    expected = ref(q, k, v)[0]
    tk = (torch.from_numpy(k[0].copy()), torch.from_numpy(k[1].copy()))
    out = sdpa(torch.from_numpy(q), tk, torch.from_numpy(v))
    np.testing.assert_allclose(out.numpy(), expected, **TOL32)
    # a torch int8 pair (from quantize_kv on a tensor) is still a pair
    k2, v2 = rand((20, 4), 29), rand((20, 3), 30)
    pair = quantize_kv(torch.from_numpy(k2))
    assert isinstance(pair[0], torch.Tensor) and pair[0].dtype == torch.int8
    kd = pair[0].numpy().astype(np.float64) * pair[1].numpy().astype(np.float64)[:, None]
    for key in (pair, list(pair)):
        out = sdpa(torch.from_numpy(q), key, torch.from_numpy(v2))
        np.testing.assert_allclose(out.numpy(), ref(q, kd, v2)[0], **TOL32)


def test_int8_pairs_still_pairs(path):
    q, k, v = rand((7, 4), 31), rand((20, 4), 32), rand((20, 3), 33)
    kq, vq = quantize_kv(k), quantize_kv(v)
    deq = [a.astype(np.float64) * s.astype(np.float64)[:, None] for a, s in (kq, vq)]
    expected = ref(q, deq[0], deq[1])[0]
    for key, value in [(kq, vq), (list(kq), list(vq))]:
        np.testing.assert_allclose(sdpa(q, key, value), expected, **TOL32)


def test_int8_pair_rule_documented():
    for doc in (attncore.scaled_dot_product_attention.__doc__, attncore.quantize_kv.__doc__):
        assert "first element is an" in doc and "int8" in doc


