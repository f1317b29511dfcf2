"""KVCache's own methods: the layer fills a cache through them only."""
import numpy as np

import attncore


def test_cross_cache_binds_memory_and_views():
    rng = np.random.default_rng(0)
    mha = attncore.MultiHeadAttention(8, 2, num_kv_heads=1, rng=0)
    mem = rng.standard_normal((2, 5, 8)).astype(np.float32)
    km = np.ones((2, 5), bool)
    km[1, 3:] = False
    cache = mha.new_cache(2, 5)
    y = rng.standard_normal((2, 1, 8)).astype(np.float32)
    out, _ = mha(y, mem, key_mask=km, cache=cache)
    assert cache.mode == "cross" and cache.source is mem and len(cache) == 5
    np.testing.assert_array_equal(cache.key_mask.reshape(2, 5), km)
    k, v = cache.view(5)
    np.testing.assert_array_equal(k, cache.keys)
    np.testing.assert_array_equal(v, cache.values)
    # the keys held are the projected memory (float64 reference)
    kp = mem.astype(np.float64) @ mha.k_weight.T.astype(np.float64) + mha.k_bias
    np.testing.assert_allclose(k[:, 0], kp, rtol=1e-5, atol=1e-5)
    # a later step reuses them and the stored mask
    out2, _ = mha(y, cache=cache)
    np.testing.assert_allclose(out2, out, rtol=1e-6, atol=1e-6)


def test_self_cache_appends():
    mha = attncore.MultiHeadAttention(8, 2, rng=0)
    x = np.random.default_rng(1).standard_normal((1, 4, 8)).astype(np.float32)
    cache = mha.new_cache(1, 6)
    mha(x[:, :3], cache=cache, is_causal="lower_right")
    assert cache.mode == "self" and len(cache) == 3 and cache.source is None
    cache.append_self(np.zeros((1, 2, 2, 4), np.float32), np.ones((1, 2, 2, 4), np.float32))
    assert len(cache) == 5
    np.testing.assert_array_equal(cache.values[:, :, 3:], 1)
