"""KVCache's own methods: the layer fills a cache through them only."""
import numpy as np
import pytest

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


def test_append_and_view_check_their_arguments():
    """KVCache's public hooks (documented members) check what they take:
    wrong heads / batch / head dims were broadcast or stored, complex values
    lost their imaginary part, None leaked an AttributeError, and view()
    took any slice bound."""
    m = attncore.MultiHeadAttention(16, 2, rng=0)
    c = m.new_cache(2, 8)
    ok = np.arange(2 * 3 * 2 * 8, dtype=np.float32).reshape(2, 3, 2, 8)
    bad = [((ok[:, :, :1], ok[:, :, :1]), ValueError, r"k_new must have shape \(B, T, 2, 8\)"),
           ((ok[:1], ok[:1]), ValueError, "k_new's batch must be batch_size=2, got 1"),
           ((ok[..., :1], ok[..., :1]), ValueError, "k_new must have shape"),
           ((ok + 1j, ok + 1j), TypeError, "k_new must be a float array, got dtype complex"),
           ((None, None), TypeError, "k_new must be a NumPy array, got NoneType"),
           ((ok, ok[:, :2]), ValueError, "k_new and v_new must have the same")]
    for args, exc, match in bad:
        with pytest.raises(exc, match=match):
            c.append_self(*args)
        assert len(c) == 0 and c.mode is None
    with pytest.raises(ValueError, match="k_mem's batch must be batch_size=2 .or 1"):
        c.bind_memory(np.ones((3, 4, 2, 8), np.float32), np.ones((3, 4, 2, 8), np.float32),
                      None, None)
    c.append_self(ok, ok + 1)
    for length, exc in ((-1, ValueError), (4, ValueError), (2**63, ValueError),
                        (True, TypeError), (None, TypeError), (1.5, TypeError)):
        with pytest.raises(exc, match="length must be"):
            c.view(length)
    k, v = c.view(2)
    np.testing.assert_array_equal(k, ok[:, :2].transpose(0, 2, 1, 3))
    np.testing.assert_array_equal(v, ok[:, :2].transpose(0, 2, 1, 3) + 1)
    # a memory shared by the batch: batch 1
    s = m.new_cache(2, 8)
    s.bind_memory(ok[:1], ok[:1], "mem", None)
    assert s.shared and s.view(3)[0].shape == (1, 2, 3, 8)


def test_dtype_none_is_the_default_float32():
    """dtype=None means the documented default, float32, everywhere (it gave
    float64 caches, layers and tables: twice the memory)."""
    from attncore._mha import KVCache

    assert KVCache(1, 4, 2, 8, 8, dtype=None).dtype == np.float32
    assert attncore.PagedKVCache(4, 4, 2, 8, dtype=None).k_blocks.dtype == np.float32
    assert attncore.MultiHeadAttention(8, 2, dtype=None).dtype == np.float32
    assert attncore.sinusoidal_encoding(3, 4, dtype=None).dtype == np.float32
    for bad in (2**31, 2**63):
        with pytest.raises(ValueError, match="must be below 2\\*\\*31"):
            attncore.PagedKVCache(4, bad, 2, 8)
        with pytest.raises(ValueError, match="max_length must be below 2\\*\\*31"):
            KVCache(1, bad, 2, 8, 8)
