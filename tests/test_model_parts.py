"""MultiHeadAttention pieces real models need (issue 18): rotary embeddings
(against transformers' LlamaAttention and a float64 reference), KV-cache
reorder / crop (against recomputing from scratch), num_threads, and
memories shared by the batch (against numpy.broadcast_to inputs), also for
the alignment layer ``attncore.Attention``."""
import numpy as np
import pytest

import attncore
from attncore import Attention, MultiHeadAttention
from attncore import _mha

from reference import attention as ref_attention
from reference import rand

try:
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding
except Exception:  # pragma: no cover - torch / transformers are test extras
    torch = None

needs_hf = pytest.mark.skipif(torch is None, reason="torch / transformers not installed")

TOL32 = dict(rtol=2e-5, atol=2e-5)
TOL64 = dict(rtol=1e-10, atol=1e-10)


def tol(dtype):
    return TOL64 if dtype == np.float64 else TOL32


# ---------------------------------------------------------------- float64 reference
def rope64(x, pos, inv_freq, layout="half"):
    """float64 RoPE of x (B, H, L, hd) at positions pos (L,) or (B, L)."""
    f = np.asarray(inv_freq, np.float64)
    h = f.shape[0]
    p = np.asarray(pos, np.float64)
    ang = (p[..., None] * f)                                 # (L, h) or (B, L, h)
    c, s = np.cos(ang), np.sin(ang)
    if ang.ndim == 3:
        c, s = c[:, None], s[:, None]
    out = x.copy()
    if layout == "half":
        a, b = x[..., :h], x[..., h:2 * h]
        out[..., :h], out[..., h:2 * h] = a * c - b * s, b * c + a * s
    else:
        a, b = x[..., 0:2 * h:2], x[..., 1:2 * h:2]
        out[..., 0:2 * h:2], out[..., 1:2 * h:2] = a * c - b * s, b * c + a * s
    return out


def reference_rotary_mha(m, x, pos, causal=True):
    """float64 self-attention of layer m with rotary q / k (written from the
    formula: project, rotate, attend, project)."""
    f = lambda a: np.asarray(a, np.float64)  # noqa: E731
    H, Hkv, hd = m.num_heads, m.num_kv_heads, m.head_dim
    rot = m.rotary

    def lin(w, b):
        y = f(x) @ f(w).T
        return y if b is None else y + f(b)

    B, L = x.shape[:2]
    q = lin(m.q_weight, m.q_bias).reshape(B, L, H, hd).transpose(0, 2, 1, 3)
    k = lin(m.k_weight, m.k_bias).reshape(B, L, Hkv, hd).transpose(0, 2, 1, 3)
    v = lin(m.v_weight, m.v_bias).reshape(B, L, Hkv, -1).transpose(0, 2, 1, 3)
    q = rope64(q, pos, rot["inv_freq"], rot["layout"])
    k = rope64(k, pos, rot["inv_freq"], rot["layout"])
    o, _ = ref_attention(q, k, v, causal=1 if causal else 0, group=H // Hkv)
    o = o.transpose(0, 2, 1, 3).reshape(B, L, -1)
    out = o @ f(m.out_weight).T
    return out if m.out_bias is None else out + f(m.out_bias)


# ---------------------------------------------------------------- rotary layer
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("rotary", [True, {"layout": "interleaved", "base": 500.0},
                                    {"rotary_dim": 8}])
def test_rotary_layer_matches_reference(dtype, rotary):
    m = MultiHeadAttention(48, 4, num_kv_heads=2, rng=1, dtype=dtype, rotary=rotary)
    m.q_bias = np.linspace(-1, 1, 48)
    x = rand((2, 11, 48), 2, dtype)
    out, _ = m(x, is_causal=True)
    np.testing.assert_allclose(out, reference_rotary_mha(m, x, np.arange(11)), **tol(dtype))
    assert m.rotary["rotary_dim"] == (8 if isinstance(rotary, dict) and "rotary_dim" in rotary
                                      else 12)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("cache_dtype", [None, "int8"])
def test_rotary_cached_decoding_equals_full_call(dtype, cache_dtype):
    m = MultiHeadAttention(32, 4, num_kv_heads=2, rng=3, dtype=dtype, rotary=True)
    x = rand((3, 14, 32), 4, dtype)
    full, _ = m(x, is_causal=True)
    cache = m.new_cache(3, 20, dtype=cache_dtype)
    outs = [m(x[:, :5], cache=cache, is_causal="lower_right")[0]]       # prompt
    for t in range(5, 14):                                               # then token by token
        outs.append(m(x[:, t:t + 1], cache=cache, is_causal="lower_right")[0])
    got = np.concatenate(outs, axis=1)
    if cache_dtype is None:
        np.testing.assert_allclose(got, full, **tol(dtype))
        # the cache holds rotated keys: those of the full-sequence projection
        k = (x.astype(np.float64) @ m.k_weight.T.astype(np.float64)
             + m.k_bias).reshape(3, 14, 2, 8).transpose(0, 2, 1, 3)
        np.testing.assert_allclose(cache.keys, rope64(k, np.arange(14),
                                                      m.rotary["inv_freq"]), **tol(dtype))
    else:
        np.testing.assert_allclose(got, full, rtol=0, atol=0.05)


def test_rotary_positions_per_row():
    """Left-padded batch: (B, L) positions equal each row run on its own."""
    m = MultiHeadAttention(32, 2, rng=5, rotary=True)
    x = rand((2, 6, 32), 6)
    pos = np.array([[0, 0, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5]])
    km = pos > 0
    km[0, 2], km[1, 0] = True, True
    out, _ = m(x, positions=pos, key_mask=km, is_causal=True)
    ref0, _ = m(x[:1, 2:], positions=np.arange(4))
    ref0c, _ = m(x[:1, 2:], is_causal=True)
    np.testing.assert_allclose(out[0, 2:], ref0c[0], **TOL32)
    assert not np.allclose(ref0, ref0c)
    ref1, _ = m(x[1:], is_causal=True)
    np.testing.assert_allclose(out[1], ref1[0], **TOL32)
    # decoding continues each row at the position given
    cache = m.new_cache(2, 8)
    m(x, positions=pos, key_mask=km, is_causal=True, cache=cache)
    y = rand((2, 1, 32), 7)
    step, _ = m(y, positions=np.array([[4], [6]]), cache=cache,
                key_mask=np.concatenate([km, [[True], [True]]], 1), is_causal="lower_right")
    full, _ = m(np.concatenate([x[1:], y[1:]], 1), is_causal=True)
    np.testing.assert_allclose(step[1, 0], full[0, -1], **TOL32)


@needs_hf
@pytest.mark.parametrize("rope", ["default", "llama3"])
def test_rotary_layer_matches_llama_attention(rope):
    params = {"rope_type": "default", "rope_theta": 10000.0}
    if rope == "llama3":
        params = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 16}
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                      rope_parameters=params, attention_bias=False,
                      max_position_embeddings=256)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    attn = LlamaAttention(cfg, layer_idx=0).eval()
    rot = LlamaRotaryEmbedding(cfg)
    B, L = 2, 24
    x = torch.randn(B, L, 64)
    pid = torch.arange(L)[None].expand(B, L)
    cos, sin = rot(x, pid)
    causal = torch.full((L, L), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        ref, _ = attn(x, position_embeddings=(cos, sin), attention_mask=causal)
    m = MultiHeadAttention.from_arrays(
        q_weight=attn.q_proj.weight, k_weight=attn.k_proj.weight, v_weight=attn.v_proj.weight,
        out_weight=attn.o_proj.weight, num_heads=4, num_kv_heads=2,
        rotary={"inv_freq": rot.inv_freq})
    out, _ = m(x.numpy(), is_causal=True)
    np.testing.assert_allclose(out, ref.numpy(), rtol=1e-4, atol=2e-5)
    # a torch query gives a torch result
    out_t, _ = m(x, is_causal=True)
    assert isinstance(out_t, torch.Tensor)
    # decoding with a cache: prompt of 10, then one token at a time
    cache = m.new_cache(B, L)
    steps = [m(x[:, :10].numpy(), cache=cache, is_causal="lower_right")[0]]
    for t in range(10, L):
        steps.append(m(x[:, t:t + 1].numpy(), cache=cache, is_causal="lower_right")[0])
    np.testing.assert_allclose(np.concatenate(steps, 1), ref.numpy(), rtol=1e-4, atol=2e-5)


def test_rotary_attribute_and_errors():
    m = MultiHeadAttention(32, 4, rng=0)
    assert m.rotary is None
    m.rotary = {"base": 1000.0, "rotary_dim": 4}
    r = m.rotary
    assert r["base"] == 1000.0 and r["layout"] == "half" and r["rotary_dim"] == 4
    np.testing.assert_allclose(r["inv_freq"], 1000.0 ** -(np.arange(0, 4, 2) / 4))
    assert not r["inv_freq"].flags.writeable
    m.rotary = {"inv_freq": [1.0, 0.5, 0.25]}
    assert m.rotary["rotary_dim"] == 6 and m.rotary["base"] is None
    m.rotary = False
    assert m.rotary is None
    x = rand((1, 3, 32))
    with pytest.raises(ValueError, match="positions= applies to a layer with rotary"):
        m(x, positions=np.arange(3))
    bad = [({"rotary_dim": 5}, ValueError, "rotary: rotary_dim must be an even int"),
           ({"rotary_dim": 10}, ValueError, r"rotary: rotary_dim must be <= head_dim \(8\)"),
           ({"inv_freq": np.ones(5)}, ValueError, r"rotary: rotary_dim must be <= head_dim"),
           ({"inv_freq": np.ones(2), "rotary_dim": 8}, ValueError,
            "inv_freq must have rotary_dim / 2 = 4 frequencies, got 2"),
           ({"theta": 1.0}, ValueError, r"rotary: unknown keys \['theta'\]"),
           ({"layout": "gptj"}, ValueError, "layout must be 'half'"),
           ("yes", TypeError, "rotary must be None, a bool or a dict"),
           ({"base": 0.0}, ValueError, "base must be finite and > 0")]
    for spec, exc, pattern in bad:
        with pytest.raises(exc, match=pattern):
            m.rotary = spec
        with pytest.raises(exc, match=pattern):
            MultiHeadAttention(32, 4, rotary=spec)
    m.rotary = True
    with pytest.raises(ValueError, match="rotary embeddings apply to self-attention"):
        m(x, rand((1, 5, 32), 1))
    for pos, pattern in [(np.arange(4), r"positions must have shape \(L,\) = \(3,\) or "
                                        r"\(B, L\) = \(1, 3\)"),
                         (np.arange(3.0), "positions must be an integer array"),
                         (np.array([0, 1, 2**31]), "int32 range")]:
        with pytest.raises((ValueError, TypeError), match=pattern):
            m(x, positions=pos)
    # a failed call leaves the cache as it was
    cache = m.new_cache(1, 8)
    with pytest.raises(TypeError):
        m(x, positions=np.arange(3.0), cache=cache)
    assert len(cache) == 0


# ---------------------------------------------------------------- reorder / crop
def _decode(m, cache, xs, start_causal="lower_right"):
    return np.concatenate([m(x, cache=cache, is_causal=start_causal)[0] for x in xs], 1)


@pytest.mark.parametrize("cache_dtype", [None, "int8"])
@pytest.mark.parametrize("rotary", [None, True])
def test_reorder_then_decode_equals_recompute(cache_dtype, rotary):
    m = MultiHeadAttention(32, 4, num_kv_heads=2, rng=8, rotary=rotary)
    B = 4
    hist = rand((B, 7, 32), 9)
    new = rand((B, 3, 32), 10)
    cache = m.new_cache(B, 12, dtype=cache_dtype)
    m(hist, cache=cache, is_causal=True)
    idx = np.array([2, 0, 0, 3])
    cache.reorder(idx)
    got = _decode(m, cache, [new[:, t:t + 1] for t in range(3)])
    fresh = m.new_cache(B, 12, dtype=cache_dtype)
    m(hist[idx], cache=fresh, is_causal=True)
    want = _decode(m, fresh, [new[:, t:t + 1] for t in range(3)])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    if cache_dtype is None:
        full, _ = m(np.concatenate([hist[idx], new], 1), is_causal=True)
        np.testing.assert_allclose(got, full[:, 7:], **TOL32)


@pytest.mark.parametrize("cache_dtype", [None, "int8"])
@pytest.mark.parametrize("rotary", [None, True])
def test_crop_then_decode_equals_recompute(cache_dtype, rotary):
    m = MultiHeadAttention(32, 4, rng=11, rotary=rotary)
    x = rand((2, 9, 32), 12)
    draft = rand((2, 4, 32), 13)
    cache = m.new_cache(2, 16, dtype=cache_dtype)
    m(x, cache=cache, is_causal=True)
    m(draft, cache=cache, is_causal="lower_right")          # 4 draft tokens
    cache.crop(10)                                         # keep one of them
    assert len(cache) == 10
    new = rand((2, 2, 32), 14)
    got = _decode(m, cache, [new])
    fresh = m.new_cache(2, 16, dtype=cache_dtype)
    m(np.concatenate([x, draft[:, :1]], 1), cache=fresh, is_causal=True)
    want = _decode(m, fresh, [new])
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    cache.crop(0)
    assert len(cache) == 0 and cache.mode is None


def test_reorder_cross_cache_and_key_mask():
    m = MultiHeadAttention(16, 2, rng=15)
    mem = rand((3, 6, 16), 16)
    km = np.ones((3, 6), bool)
    km[0, 4:] = False
    km[2, :2] = False
    cache = m.new_cache(3, 6)
    y = rand((3, 1, 16), 17)
    m(y, mem, key_mask=km, cache=cache)
    idx = np.array([2, 2, 0])
    cache.reorder(idx)
    got, _ = m(y, cache=cache)
    want, _ = m(y, mem[idx], key_mask=km[idx])
    np.testing.assert_allclose(got, want, **TOL32)
    with pytest.raises(ValueError, match="crop drops trailing tokens of a self-attention cache"):
        cache.crop(3)


def test_reorder_crop_errors():
    m = MultiHeadAttention(16, 2, rng=0)
    cache = m.new_cache(3, 8)
    m(rand((3, 4, 16)), cache=cache, is_causal=True)
    keys = cache.keys.copy()
    for idx, exc, pattern in [
            (np.array([0, 1, 3]), ValueError, r"indices must lie in \[0, batch_size\) = \[0, 3\)"),
            (np.array([0, -1, 2]), ValueError, r"indices must lie in \[0, batch_size\)"),
            (np.array([0, 1]), ValueError, r"indices must have shape \(batch_size,\) = \(3,\)"),
            (np.array([[0, 1, 2]]), ValueError, "indices must have shape"),
            (np.array([0.0, 1.0, 2.0]), TypeError, "indices must be an integer array"),
            (np.array([True, False, True]), TypeError, "indices must be an integer array")]:
        with pytest.raises(exc, match=pattern):
            cache.reorder(idx)
    for length, exc, pattern in [
            (5, ValueError, "crop length must be between 0 and the cached length 4, got 5"),
            (-1, ValueError, "crop length must be between 0 and the cached length 4, got -1"),
            (2.0, TypeError, "length must be an int"), (True, TypeError, "length must be an int")]:
        with pytest.raises(exc, match=pattern):
            cache.crop(length)
    np.testing.assert_array_equal(cache.keys, keys)
    assert len(cache) == 4
    cache.reorder([0, 1, 2])                               # identity: nothing moves
    np.testing.assert_array_equal(cache.keys, keys)
    cache.reorder([1, 1, 1])
    np.testing.assert_array_equal(cache.keys, keys[[1, 1, 1]])


def test_reorder_covers_every_stored_array():
    """The generic rule: every (batch, heads, max_length, ...) buffer moves."""
    m = MultiHeadAttention(16, 2, rng=0)
    cache = m.new_cache(2, 4, dtype="int8")
    names = {id(a) for a in cache._token_arrays()}
    assert names == {id(cache._k), id(cache._v), id(cache._ks), id(cache._vs)}
    plain = m.new_cache(2, 4)
    assert {id(a) for a in plain._token_arrays()} == {id(plain._k), id(plain._v)}


# ---------------------------------------------------------------- num_threads
def test_num_threads_results_match():
    m = MultiHeadAttention(64, 4, num_kv_heads=2, rng=18, rotary=True)
    x = rand((3, 40, 64), 19)
    mem = rand((40, 64), 20)
    cross = MultiHeadAttention(64, 4, num_kv_heads=2, rng=18)
    ref, _ = m(x, is_causal=True, num_threads=1)
    ref_x, _ = cross(x, mem, num_threads=1)
    for nt in (2, 3, -1, None):
        out, _ = m(x, is_causal=True, num_threads=nt)
        np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)
        out, _ = cross(x, mem, num_threads=nt)
        np.testing.assert_allclose(out, ref_x, rtol=1e-6, atol=1e-6)
        m2 = MultiHeadAttention(64, 4, num_kv_heads=2, rng=18, rotary=True, num_threads=nt)
        assert m2.num_threads == nt
        np.testing.assert_allclose(m2(x, is_causal=True)[0], ref, rtol=1e-6, atol=1e-6)
        cache = m2.new_cache(3, 40)
        steps = [m2(x[:, :30], cache=cache, is_causal="lower_right")[0]]
        steps += [m2(x[:, t:t + 1], cache=cache, is_causal="lower_right", num_threads=1)[0]
                  for t in range(30, 40)]
        np.testing.assert_allclose(np.concatenate(steps, 1), ref, rtol=1e-5, atol=1e-5)


def test_num_threads_reaches_every_kernel(monkeypatch):
    seen = []

    def spy(name, fn):
        def wrapped(*a, **kw):
            seen.append((name, kw.get("num_threads", a[-1] if name == "rotary" else None)))
            return fn(*a, **kw)
        monkeypatch.setattr(_mha, name if name != "rotary" else "apply_rotary", wrapped)

    spy("linear", _mha.linear)
    spy("scaled_dot_product_attention", _mha.scaled_dot_product_attention)
    spy("rotary", _mha.apply_rotary)
    m = MultiHeadAttention(32, 4, rng=0, rotary=True, num_threads=3)
    x = rand((2, 5, 32))
    m(x, is_causal=True)
    assert {n for n, _ in seen} == {"linear", "scaled_dot_product_attention", "rotary"}
    assert all(nt == 3 for _, nt in seen), seen
    seen.clear()
    cache = m.new_cache(2, 8)
    m(x, cache=cache, is_causal=True, num_threads=2)
    assert seen and all(nt == 2 for _, nt in seen), seen
    seen.clear()
    m.rotary = None
    m(x, rand((2, 7, 32)), num_threads=1)
    assert len(seen) == 4 and all(nt == 1 for _, nt in seen), seen


def test_num_threads_invalid():
    for bad, exc in [(0, ValueError), (-2, ValueError), (1.5, TypeError), ("2", TypeError),
                     (True, TypeError)]:
        with pytest.raises(exc, match="num_threads must be None"):
            MultiHeadAttention(16, 2, num_threads=bad)
        m = MultiHeadAttention(16, 2, rng=0)
        with pytest.raises(exc, match="num_threads must be None"):
            m.num_threads = bad
        cache = m.new_cache(1, 4)
        with pytest.raises(exc, match="num_threads must be None"):
            m(rand((1, 2, 16)), cache=cache, num_threads=bad)
        assert len(cache) == 0
    with pytest.raises(ValueError, match="num_threads must be None"):
        MultiHeadAttention.from_arrays(q_weight=np.eye(4), k_weight=np.eye(4),
                                       v_weight=np.eye(4), out_weight=np.eye(4), num_heads=2,
                                       num_threads=0)


# ---------------------------------------------------------------- shared memories
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kv", [1, 2, 4])
def test_shared_memory_equals_broadcast(dtype, kv):
    m = MultiHeadAttention(32, 4, num_kv_heads=kv, kdim=24, vdim=24, rng=21, dtype=dtype)
    m.k_bias = np.linspace(0, 1, m.k_weight.shape[0])
    B, L, S = 5, 3, 10
    x = rand((B, L, 32), 22, dtype)
    mem = rand((S, 24), 23, dtype)
    km = np.random.default_rng(24).random(S) > 0.3
    kmB = np.random.default_rng(25).random((B, S)) > 0.3
    am = np.random.default_rng(26).random((L, S)) > 0.2
    memB = np.broadcast_to(mem, (B, S, 24))
    for kw, kwB in [({}, {}), ({"key_mask": km}, {"key_mask": np.broadcast_to(km, (B, S))}),
                    ({"key_mask": kmB}, {"key_mask": kmB}),
                    ({"attn_mask": am, "key_mask": km},
                     {"attn_mask": am, "key_mask": np.broadcast_to(km, (B, S))})]:
        out, w = m(x, mem, need_weights=True, **kw)
        outB, wB = m(x, memB, need_weights=True, **kwB)
        np.testing.assert_allclose(out, outB, **tol(dtype))
        np.testing.assert_allclose(w, wB, **tol(dtype))
        outh, wh = m(x, mem, mem, need_weights=True, average_attn_weights=False, **kw)
        outhB, whB = m(x, memB, memB, need_weights=True, average_attn_weights=False, **kwB)
        np.testing.assert_allclose(outh, outhB, **tol(dtype))
        np.testing.assert_allclose(wh, whB, **tol(dtype))
        assert wh.shape == (B, 4, L, S)


def test_shared_memory_is_projected_once(monkeypatch):
    rows = []
    real = _mha.linear

    def spy(x2d, w, b=None, **kw):
        rows.append(x2d.shape[0])
        return real(x2d, w, b, **kw)

    monkeypatch.setattr(_mha, "linear", spy)
    m = MultiHeadAttention(32, 4, rng=0)
    B, L, S = 64, 1, 10
    m(rand((B, L, 32)), rand((S, 32), 1))
    assert sorted(rows) == sorted([B * L, S, B * L]), rows   # q, fused k|v, out


@pytest.mark.parametrize("cache_dtype", [None, "int8"])
def test_shared_memory_cross_cache(cache_dtype):
    m = MultiHeadAttention(32, 4, num_kv_heads=2, rng=27)
    B, S = 6, 9
    mem = rand((S, 32), 28)
    km = np.arange(S) < 7
    cache = m.new_cache(B, S, dtype=cache_dtype)
    ys = rand((B, 4, 32), 29)
    outs = [m(ys[:, :1], mem, key_mask=km, cache=cache)[0]]
    assert cache.mode == "cross" and cache.shared and len(cache) == S
    assert not cache._k[1:].any()                           # stored once, in row 0
    outs += [m(ys[:, t:t + 1], cache=cache)[0] for t in range(1, 4)]
    outs.append(m(ys[:, :1], mem, cache=cache)[0])          # the same memory object
    want, _ = m(ys, np.broadcast_to(mem, (B, S, 32)), key_mask=np.broadcast_to(km, (B, S)))
    got = np.concatenate(outs[:4], 1)
    t = TOL32 if cache_dtype is None else dict(rtol=0, atol=0.05)
    np.testing.assert_allclose(got, want, **t)
    np.testing.assert_allclose(outs[4], want[:, :1], **t)
    assert cache.keys.shape == (B, 2, S, 8)
    cache.reorder([5, 4, 3, 2, 1, 0])                        # a shared memory stays
    np.testing.assert_allclose(m(ys[:, :1], cache=cache)[0], want[:, :1], **t)


def test_shared_memory_errors():
    m = MultiHeadAttention(32, 4, kdim=24, vdim=16, rng=0)
    x = rand((2, 3, 32))
    mem = rand((5, 24))
    cases = [((x, rand((5, 20))), {}, r"key last dimension must be kdim=24, got shape \(5, 20\)"),
             ((x, mem, rand((5, 12))), {}, r"value last dimension must be vdim=16"),
             ((x, mem, rand((2, 5, 16))), {}, r"value must be 2-D \(S, vdim\) like the shared key"),
             ((x, mem, rand((4, 16))), {}, "key and value must have the same length"),
             ((x, mem, rand((5, 16))), {"key_mask": np.ones(4, bool)},
              r"key_mask must have shape \(2, 5\) \(batch, key length\) or \(S,\) = \(5,\) for "
              r"the shared memory"),
             ((x, rand((1, 1, 5, 24))), {}, r"key must be \(B, S, kdim\)")]
    for args, kw, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            m(*args, **kw)


# ---------------------------------------------------------------- Attention layer
ALIGNMENTS = {
    "dot": {}, "scaled_dot": {},
    "bilinear": {"weight": rand((8, 6), 30, np.float64)},
    "mlp": {"q_weight": rand((5, 8), 31, np.float64), "k_weight": rand((5, 6), 32, np.float64),
            "v": rand((5,), 33, np.float64)},
}


@pytest.mark.parametrize("name", list(ALIGNMENTS))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_attention_layer_shared_memory(name, dtype):
    B, T, S = 4, 3, 7
    Dq = 6 if name in ("dot", "scaled_dot") else 8
    att = Attention(name, **ALIGNMENTS[name])
    q = rand((B, T, Dq), 34, dtype)
    keys = rand((S, 6), 35, dtype)
    vals = rand((S, 5), 36, dtype)
    mask = np.arange(S) % 3 != 1
    kB = np.broadcast_to(keys, (B, S, 6))
    vB = np.broadcast_to(vals, (B, S, 5))
    mB = np.broadcast_to(mask, (B, S))
    for qq in (q, q[:, 0]):                                  # (B, T, Dq) and one step (B, Dq)
        c, w = att(qq, keys, vals, mask=mask, return_weights=True)
        cB, wB = att(qq, kB, vB, mask=mB, return_weights=True)
        np.testing.assert_allclose(c, cB, **tol(dtype))
        np.testing.assert_allclose(w, wB, **tol(dtype))
    mem = att.prepare(keys, vals, mask=mask)
    assert mem.shared and mem.batch == 1
    c1 = att.step(q[:, 1], mem)
    np.testing.assert_allclose(c1, att(q[:, 1], kB, vB, mask=mB), **tol(dtype))


def test_attention_layer_shared_memory_plugin_and_errors():
    class NegDist(attncore.Alignment):
        name = "negdist"

        def score(self, query, prepared):
            return -((query[:, :, None, :] - prepared[:, None, :, :]) ** 2).sum(-1)

    att = Attention(NegDist())
    q = rand((3, 2, 4), 37)
    keys = rand((5, 4), 38)
    c = att(q, keys)
    np.testing.assert_allclose(c, att(q, np.broadcast_to(keys, (3, 5, 4))), **TOL32)
    dot = Attention("dot")
    with pytest.raises(ValueError, match=r"values must have the leading shape \(S,\) = \(5,\)"):
        dot.prepare(keys, rand((3, 5, 4)))
    with pytest.raises(ValueError, match=r"mask must have shape \(S,\) = \(5,\)"):
        dot.prepare(keys, mask=np.ones((3, 5), bool))
    with pytest.raises(ValueError, match="query"):
        dot(rand((3, 2, 6)), keys)                          # Dq 6 vs Dk 4
    with pytest.raises(ValueError, match=r"keys must have shape \(B, S, Dk\), \(B, H, W, Dk\) "
                                         r"or \(S, Dk\)"):
        dot.prepare(rand((4,)))
