"""The 4-bit key/value cache of MultiHeadAttention (new_cache(dtype="int4")):
each call's output against a float64 layer written plainly here, whose
keys / values before the recent window are decoded from the cache's stored
4-bit codes by the documented format (codes, float16 scale and offset per
group, then the inverse normalized Hadamard transform of scipy), and whose
window and new tokens are the float projections; beam reordering, crop,
memory and the errors."""
import numpy as np
import pytest
from scipy.linalg import hadamard

import attncore


def _layer(E=128, H=4, Hk=2, seed=0):   # head_dim 32
    return attncore.MultiHeadAttention(E, H, num_kv_heads=Hk, rng=seed, bias=True)


def _decode4(cache, which, n):
    """Tokens [0, n) of the cache's keys (0) / values (1) decoded from its
    stored codes, float64 (B, Hk, n, D): the documented format, written
    out: low nibble the even element, s * c + o per group, rotated rows
    brought back by the normalized Hadamard matrix."""
    codes = (cache._kc, cache._vc)[which][:, :, :n]
    sc = (cache._kss, cache._vss)[which][:, :, :n].astype(np.float64)
    of = (cache._kso, cache._vso)[which][:, :, :n].astype(np.float64)
    c = np.empty(codes.shape[:-1] + (2 * codes.shape[-1],))
    c[..., 0::2] = codes & 15
    c[..., 1::2] = codes >> 4
    g = cache.group_size
    c = c.reshape(c.shape[:-1] + (c.shape[-1] // g, g)) * sc[..., None] + of[..., None]
    r = c.reshape(codes.shape[:-1] + (2 * codes.shape[-1],))
    if cache.rotate:
        D = r.shape[-1]
        r = r @ (hadamard(D) / np.sqrt(D))
    return r


def _reference(mha, x_all, n_old, L, f0, cache, float_k, float_v):
    """The layer's output for tokens [n_old, n_old + L) of x_all: keys /
    values of tokens < f0 decoded from the cache, the rest the float
    projections float_k / float_v (B, Hk, n, D); causal, lower right."""
    H, Hk = mha.num_heads, mha.num_kv_heads
    x = x_all[:, n_old:n_old + L].astype(np.float64)
    q = x @ mha.q_weight.T.astype(np.float64) + mha.q_bias
    B = x.shape[0]
    D = mha.head_dim
    q = q.reshape(B, L, H, D).transpose(0, 2, 1, 3)
    n = n_old + L
    k = float_k[:, :, :n].astype(np.float64).copy()
    v = float_v[:, :, :n].astype(np.float64).copy()
    if f0:
        k[:, :, :f0] = _decode4(cache, 0, f0)
        v[:, :, :f0] = _decode4(cache, 1, f0)
    k = np.repeat(k, H // Hk, axis=1)
    v = np.repeat(v, H // Hk, axis=1)
    s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(D)
    pos = n_old + np.arange(L)
    s[..., np.arange(n)[None, :] > pos[:, None]] = -np.inf
    p = np.exp(s - s.max(-1, keepdims=True))
    o = (p / p.sum(-1, keepdims=True)) @ v
    o = o.transpose(0, 2, 1, 3).reshape(B, L, H * D)
    return o @ mha.out_weight.T.astype(np.float64) + mha.out_bias


@pytest.mark.parametrize("window,group,rotate", [(8, 16, True), (0, 32, False), (100, 16, True)])
def test_calls_match_the_documented_cache(window, group, rotate):
    mha = _layer()
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 60, 128)).astype(np.float32)
    c4 = mha.new_cache(2, 64, dtype="int4", window=window, group_size=group, rotate=rotate)
    cf = mha.new_cache(2, 64)   # the float projections of every token
    n = 0
    for L in (20, 1, 1, 9, 1, 1, 1, 12, 1):
        f0 = max(0, n - window)   # tokens before the window: 4-bit
        y, _ = mha(x[:, n:n + L], cache=c4, is_causal="lower_right")
        mha(x[:, n:n + L], cache=cf, is_causal="lower_right")
        ref = _reference(mha, x, n, L, f0, c4, cf.keys, cf.values)
        np.testing.assert_allclose(y, ref, rtol=2e-4, atol=2e-4 * np.abs(ref).max())
        n += L
    assert len(c4) == n
    # keys / values held: the window's in float, the older ones decoded
    f = max(0, n - window)
    np.testing.assert_array_equal(c4.keys[:, :, f:], cf.keys[:, :, f:])
    np.testing.assert_allclose(c4.keys[:, :, :f], _decode4(c4, 0, f), rtol=1e-5, atol=1e-5)


def test_quantization_error_is_that_of_the_format():
    """Decoding with a window of 0: the output differs from the float
    cache's by the 4-bit error, bounded by half a scale per element."""
    mha = _layer()
    x = np.random.default_rng(2).standard_normal((1, 40, 128)).astype(np.float32)
    c4 = mha.new_cache(1, 40, dtype="int4", window=0)
    cf = mha.new_cache(1, 40)
    mha(x, cache=c4, is_causal="lower_right")
    mha(x, cache=cf, is_causal="lower_right")
    rot = hadamard(32) / np.sqrt(32)
    kr = cf.keys.astype(np.float64) @ rot          # the rotated rows quantized
    err = np.abs(_decode4(c4, 0, 40) @ rot - kr)
    half = np.repeat(c4._kss[:, :, :40].astype(np.float64), 16, axis=-1) / 2
    assert (err <= half * (1 + 1e-3) + 1e-6).all()


def test_reorder_and_crop():
    mha = _layer()
    x = np.random.default_rng(3).standard_normal((2, 30, 128)).astype(np.float32)
    a = mha.new_cache(2, 40, dtype="int4", window=6)
    mha(x[:, :25], cache=a, is_causal="lower_right")
    b = mha.new_cache(2, 40, dtype="int4", window=6)
    mha(x[::-1, :25], cache=b, is_causal="lower_right")
    a.reorder([1, 0])
    ya, _ = mha(x[::-1, 25:26], cache=a, is_causal="lower_right")
    yb, _ = mha(x[::-1, 25:26], cache=b, is_causal="lower_right")
    # (the projections of a batch row may round differently at another
    # row position: float32 rounding, not the cache)
    np.testing.assert_allclose(ya, yb, rtol=1e-5, atol=1e-6)
    assert np.abs(ya - yb).max() < 1e-2 * np.abs(ya - mha(x[::-1, 25:26])[0]).max()
    # crop: the tokens kept in float stay in float (those that had left
    # the window stay 4-bit): the next call as documented
    c = mha.new_cache(2, 40, dtype="int4", window=6)
    cf = mha.new_cache(2, 40)
    for t in range(12):
        mha(x[:, t:t + 1], cache=c, is_causal="lower_right")
        mha(x[:, t:t + 1], cache=cf, is_causal="lower_right")
    c.crop(9)
    cf.crop(9)
    y, _ = mha(x[:, 9:10], cache=c, is_causal="lower_right")
    mha(x[:, 9:10], cache=cf, is_causal="lower_right")
    ref = _reference(mha, x, 9, 1, 6, c, cf.keys, cf.values)   # tokens 6..8 still in float
    np.testing.assert_allclose(y, ref, rtol=2e-4, atol=2e-4 * np.abs(ref).max())
    assert len(c) == 10


def test_bytes_and_repr():
    mha = _layer(E=128, H=2, Hk=2)   # head_dim 64
    c = mha.new_cache(3, 1000, dtype="int4", window=128)
    per_token = 2 * 2 * (64 // 2 + 2 * 2 * (64 // 16))   # K and V, 2 heads: codes + f16 pairs
    window = 2 * 3 * 2 * 128 * 64 * 4
    assert c.nbytes == 3 * 1000 * per_token + window
    assert "storage=int4" in repr(c) and "window=128" in repr(c)


def test_cross_attention_memory_is_quantized_whole():
    mha = _layer()
    rng = np.random.default_rng(4)
    mem = rng.standard_normal((2, 30, 128)).astype(np.float32)
    y = rng.standard_normal((2, 3, 128)).astype(np.float32)
    c = mha.new_cache(2, 30, dtype="int4")
    out1, _ = mha(y, mem, cache=c)
    out2, _ = mha(y, cache=c)
    np.testing.assert_array_equal(out1, out2)
    # against the layer over the decoded memory (float64 reference)
    H, Hk, D = 4, 2, 32
    q = (y.astype(np.float64) @ mha.q_weight.T + mha.q_bias).reshape(2, 3, H, D).transpose(
        0, 2, 1, 3)
    k = np.repeat(_decode4(c, 0, 30), H // Hk, axis=1)
    v = np.repeat(_decode4(c, 1, 30), H // Hk, axis=1)
    s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(D)
    p = np.exp(s - s.max(-1, keepdims=True))
    o = ((p / p.sum(-1, keepdims=True)) @ v).transpose(0, 2, 1, 3).reshape(2, 3, H * D)
    ref = o @ mha.out_weight.T + mha.out_bias
    np.testing.assert_allclose(out1, ref, rtol=2e-4, atol=2e-4 * np.abs(ref).max())


def test_errors():
    mha = _layer()
    with pytest.raises(ValueError, match="window must be an int >= 0"):
        mha.new_cache(1, 8, dtype="int4", window=-1)
    with pytest.raises(ValueError, match="group_size"):
        mha.new_cache(1, 8, dtype="int4", group_size=5)
    with pytest.raises(ValueError, match="options of a 4-bit cache"):
        mha.new_cache(1, 8, window=4)
    with pytest.raises(ValueError, match="'int4'"):
        mha.new_cache(1, 8, dtype="int3")
    bf = attncore.MultiHeadAttention(64, 4, rng=0, dtype="float16")
    with pytest.raises(ValueError, match="float32 layers"):
        bf.new_cache(1, 8, dtype="int4")
    c = mha.new_cache(1, 8, dtype="int4")
    x = np.ones((1, 2, 128), np.float32)
    with pytest.raises(ValueError, match="need_weights"):
        mha(x, cache=c, is_causal="lower_right", need_weights=True)
    bad = np.full((1, 1, 128), np.inf, np.float32)
    c2 = mha.new_cache(1, 8, dtype="int4")
    with pytest.raises(ValueError, match="cannot be quantized"):
        mha(bad, cache=c2)
    assert len(c2) == 0
