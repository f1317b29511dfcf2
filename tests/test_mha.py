"""MultiHeadAttention and KVCache against torch.nn.MultiheadAttention, Keras 3
(torch backend) and a float64 NumPy reference written from the formula."""
import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import attncore  # noqa: E402
from attncore import MultiHeadAttention  # noqa: E402

from reference import attention as ref_attention  # noqa: E402
from reference import rand  # noqa: E402

try:
    import torch
except ImportError:  # pragma: no cover - torch is a test extra
    torch = None

try:
    import keras
    if keras.backend.backend() != "torch":  # pragma: no cover
        keras = None
except Exception:  # pragma: no cover - keras is an optional test extra
    keras = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch not installed")
needs_keras = pytest.mark.skipif(keras is None, reason="keras (torch backend) not installed")

TOL32 = dict(rtol=2e-5, atol=2e-6)
TOL64 = dict(rtol=1e-11, atol=1e-12)


def reference_mha(m, query, key=None, value=None, mask=None, causal=0):
    """float64 multi-head attention from the layer's weights (heads repeated by hand)."""
    key = query if key is None else key
    value = key if value is None else value
    f = lambda a: np.asarray(a, dtype=np.float64)  # noqa: E731
    H, Hkv, hd, hdv = m.num_heads, m.num_kv_heads, m.head_dim, m.v_head_dim

    def lin(x, w, b):
        y = f(x) @ f(w).T
        return y if b is None else y + f(b)

    q = lin(query, m.q_weight, m.q_bias)
    k = lin(key, m.k_weight, m.k_bias)
    v = lin(value, m.v_weight, m.v_bias)
    B, L, S = q.shape[0], q.shape[1], k.shape[1]
    q = q.reshape(B, L, H, hd).transpose(0, 2, 1, 3)
    k = k.reshape(B, S, Hkv, hd).transpose(0, 2, 1, 3)
    v = v.reshape(B, S, Hkv, hdv).transpose(0, 2, 1, 3)
    o, w = ref_attention(q, k, v, mask=mask, causal=causal, group=H // Hkv)
    o = o.transpose(0, 2, 1, 3).reshape(B, L, H * hdv)
    return lin(o, m.out_weight, m.out_bias), w


# ---------------------------------------------------------------- torch
def torch_pair(E=32, H=4, kdim=None, vdim=None, bias=True, dtype=np.float32, seed=0):
    torch.manual_seed(seed)
    tm = torch.nn.MultiheadAttention(E, H, bias=bias, kdim=kdim, vdim=vdim, batch_first=True)
    if dtype == np.float64:
        tm = tm.double()
    tm.eval()
    if bias:
        with torch.no_grad():
            tm.in_proj_bias.normal_()
            tm.out_proj.bias.normal_()
    return tm, MultiHeadAttention.from_torch(tm)


def tcall(tm, q, k, v, **kw):
    with torch.no_grad():
        o, w = tm(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v), **kw)
    return o.numpy(), (None if w is None else w.numpy())


@needs_torch
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("average", [True, False])
def test_self_attention_vs_torch(dtype, average):
    tm, m = torch_pair(dtype=dtype)
    assert m.dtype == dtype
    x = rand((3, 9, 32), dtype=dtype)
    out, w = m(x, need_weights=True, average_attn_weights=average)
    to, tw = tcall(tm, x, x, x, need_weights=True, average_attn_weights=average)
    tol = TOL32 if dtype == np.float32 else TOL64
    assert out.dtype == dtype and out.shape == (3, 9, 32)
    assert w.shape == ((3, 9, 9) if average else (3, 4, 9, 9))
    np.testing.assert_allclose(out, to, **tol)
    np.testing.assert_allclose(w, tw, **tol)
    out2, none = m(x)
    assert none is None
    np.testing.assert_allclose(out2, out, **tol)


@needs_torch
@pytest.mark.parametrize("bias", [True, False])
def test_cross_attention_kdim_vdim_vs_torch(bias):
    tm, m = torch_pair(E=48, H=6, kdim=20, vdim=12, bias=bias)
    assert (m.kdim, m.vdim, m.head_dim) == (20, 12, 8)
    assert (m.q_bias is None) == (not bias) and (m.out_bias is None) == (not bias)
    q, k, v = rand((2, 5, 48)), rand((2, 11, 20), 1), rand((2, 11, 12), 2)
    out, w = m(q, k, v, need_weights=True, average_attn_weights=False)
    to, tw = tcall(tm, q, k, v, need_weights=True, average_attn_weights=False)
    np.testing.assert_allclose(out, to, **TOL32)
    np.testing.assert_allclose(w, tw, **TOL32)


@needs_torch
def test_cross_attention_same_memory_vs_torch():
    tm, m = torch_pair()
    q, mem = rand((2, 5, 32)), rand((2, 13, 32), 1)
    out, _ = m(q, mem)                      # value defaults to key: fused K/V projection
    np.testing.assert_allclose(out, tcall(tm, q, mem, mem)[0], **TOL32)
    out2, _ = m(q, mem, mem.copy())         # separate K and V projections
    np.testing.assert_allclose(out2, out, **TOL32)


@needs_torch
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_head_rows_padded_vs_torch(dtype):
    """Widths whose projection rows are a multiple of 1 KiB (E = 256 float32,
    128 float64): the projections are written with padded rows
    (_linear.head_rows); self, cross (fused and separate K / V) and cached
    decoding against torch."""
    from attncore._linear import head_rows
    E = 256 if dtype == np.float32 else 128
    buf = head_rows(6, E, dtype)
    assert buf.shape == (6, E) and buf.strides[0] == E * buf.itemsize + 64
    assert head_rows(6, E + 8, dtype).flags.c_contiguous
    tm, m = torch_pair(E=E, H=4, dtype=dtype)
    tol = TOL32 if dtype == np.float32 else TOL64
    x, mem = rand((2, 40, E), dtype=dtype), rand((2, 33, E), 1, dtype=dtype)
    np.testing.assert_allclose(m(x)[0], tcall(tm, x, x, x)[0], **tol)
    np.testing.assert_allclose(m(x, mem)[0], tcall(tm, x, mem, mem)[0], **tol)
    np.testing.assert_allclose(m(x, mem, mem.copy())[0], tcall(tm, x, mem, mem)[0], **tol)
    cache = m.new_cache(2, 41)
    m(x, cache=cache, is_causal=True)
    step = rand((2, 1, E), 2, dtype=dtype)
    out, _ = m(step, cache=cache, is_causal="lower_right")
    full = np.concatenate([x, step], axis=1)
    ref = tcall(tm, full, full, full, attn_mask=torch.from_numpy(
        np.triu(np.ones((41, 41), bool), 1)))[0][:, -1:]
    np.testing.assert_allclose(out, ref, **tol)


@needs_torch
def test_key_mask_polarity_conversion_from_torch():
    """torch's key_padding_mask True = ignore; attncore's key_mask True = take part."""
    tm, m = torch_pair()
    q, mem = rand((3, 6, 32)), rand((3, 10, 32), 1)
    key_padding_mask = np.zeros((3, 10), dtype=bool)
    key_padding_mask[1, 7:] = True           # torch: these keys are padding
    key_padding_mask[2, :3] = True
    to, tw = tcall(tm, q, mem, mem, key_padding_mask=torch.from_numpy(key_padding_mask))
    out, w = m(q, mem, key_mask=~key_padding_mask, need_weights=True)
    np.testing.assert_allclose(out, to, **TOL32)
    np.testing.assert_allclose(w, tw, **TOL32)
    assert np.all(w[1, :, 7:] == 0)
    # float key_padding_mask (added) becomes an additive attn_mask
    fk = np.where(key_padding_mask, -np.inf, 0.0).astype(np.float32)
    fk[0, 2] = -1.5
    to2, _ = tcall(tm, q, mem, mem, key_padding_mask=torch.from_numpy(fk))
    out2, _ = m(q, mem, attn_mask=fk[:, None, None, :])
    np.testing.assert_allclose(out2, to2, **TOL32)


@needs_torch
def test_causal_vs_torch():
    tm, m = torch_pair()
    x = rand((2, 12, 32))
    torch_causal = torch.triu(torch.ones(12, 12, dtype=torch.bool), 1)   # True = not allowed
    to, tw = tcall(tm, x, x, x, attn_mask=torch_causal, need_weights=True)
    out, w = m(x, is_causal=True, need_weights=True)
    np.testing.assert_allclose(out, to, **TOL32)
    np.testing.assert_allclose(w, tw, **TOL32)
    out2, _ = m(x, attn_mask=~torch_causal.numpy())   # the same as an explicit bool mask
    np.testing.assert_allclose(out2, out, **TOL32)


@needs_torch
@pytest.mark.parametrize("kind", ["bool2d", "bool3d", "float2d", "float3d"])
def test_attn_masks_vs_torch(kind):
    tm, m = torch_pair()
    B, H, L, S = 2, 4, 7, 9
    q, mem = rand((B, L, 32)), rand((B, S, 32), 1)
    rng = np.random.default_rng(5)
    shape = (L, S) if kind.endswith("2d") else (B * H, L, S)
    allowed = rng.random(shape) < 0.7
    allowed[..., 0] = True                         # every row attends to something
    if kind.startswith("bool"):
        tmask, mask = ~allowed, allowed            # torch: True = not allowed
    else:
        mask = np.where(allowed, rng.standard_normal(shape), -np.inf).astype(np.float32)
        tmask = mask
    if kind.endswith("3d"):                        # torch (B*H, L, S) -> (B, H, L, S)
        mask = mask.reshape(B, H, L, S)
    key_ok = np.ones((B, S), dtype=bool)
    key_ok[1, 6:] = False
    to, tw = tcall(tm, q, mem, mem, attn_mask=torch.from_numpy(tmask),
                   key_padding_mask=torch.from_numpy(~key_ok), need_weights=True,
                   average_attn_weights=False)
    out, w = m(q, mem, attn_mask=mask, key_mask=key_ok, need_weights=True,
               average_attn_weights=False)
    np.testing.assert_allclose(out, to, **TOL32)
    np.testing.assert_allclose(w, tw, **TOL32)


@needs_torch
def test_batched_3d_attn_mask_and_unbatched_vs_torch():
    tm, m = torch_pair()
    q, mem = rand((5, 32)), rand((8, 32), 1)
    allowed = np.random.default_rng(1).random((4, 5, 8)) < 0.6
    allowed[..., 3] = True
    to, tw = tcall(tm, q, mem, mem, attn_mask=torch.from_numpy(~allowed), need_weights=True)
    out, w = m(q, mem, attn_mask=allowed, need_weights=True)
    assert out.shape == (5, 32) and w.shape == (5, 8)
    np.testing.assert_allclose(out, to, **TOL32)
    np.testing.assert_allclose(w, tw, **TOL32)
    # (B, L, S) mask on batched input
    qb, mb = rand((2, 5, 32)), rand((2, 8, 32), 3)
    am = np.random.default_rng(2).random((2, 5, 8)) < 0.6
    am[..., 0] = True
    tmask = torch.from_numpy(np.repeat(~am, 4, axis=0))
    out, _ = m(qb, mb, attn_mask=am)
    np.testing.assert_allclose(out, tcall(tm, qb, mb, mb, attn_mask=tmask)[0], **TOL32)


@needs_torch
def test_from_torch_state_dicts():
    tm, m = torch_pair(bias=True)
    x = rand((2, 6, 32))
    expected = m(x)[0]
    sd = tm.state_dict()
    assert set(sd) == {"in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"}
    np.testing.assert_array_equal(MultiHeadAttention.from_torch(sd, num_heads=4)(x)[0], expected)
    # numpy arrays and a prefixed state dict of a bigger model
    big = {"decoder.layers.0.self_attn." + k: v.numpy() for k, v in sd.items()}
    np.testing.assert_array_equal(MultiHeadAttention.from_torch(big, num_heads=4)(x)[0], expected)
    # separate layout without bias
    tm2, _ = torch_pair(kdim=16, vdim=24, bias=False)
    sd2 = tm2.state_dict()
    assert set(sd2) == {"q_proj_weight", "k_proj_weight", "v_proj_weight", "out_proj.weight"}
    m2 = MultiHeadAttention.from_torch(sd2, num_heads=4)
    k, v = rand((2, 7, 16), 1), rand((2, 7, 24), 2)
    np.testing.assert_allclose(m2(x, k, v)[0], tcall(tm2, x, k, v)[0], **TOL32)
    # the loaded arrays are copies: changing the module later does not change the layer
    with torch.no_grad():
        tm.in_proj_weight.zero_()
    np.testing.assert_array_equal(m(x)[0], expected)


@needs_torch
def test_from_torch_errors():
    tm, _ = torch_pair()
    sd = {k: v.clone() for k, v in tm.state_dict().items()}
    with pytest.raises(ValueError, match="num_heads is required"):
        MultiHeadAttention.from_torch(sd)
    bad = dict(sd)
    del bad["in_proj_bias"]
    with pytest.raises(ValueError, match=r"missing tensors \['in_proj_bias'\]"):
        MultiHeadAttention.from_torch(bad, num_heads=4)
    bad = dict(sd)
    del bad["out_proj.weight"]
    with pytest.raises(ValueError, match="missing tensors.*out_proj.weight"):
        MultiHeadAttention.from_torch(bad, num_heads=4)
    bad = dict(sd, extra_scale=torch.ones(1))
    with pytest.raises(ValueError, match=r"unexpected tensors \['extra_scale'\]"):
        MultiHeadAttention.from_torch(bad, num_heads=4)
    bad = dict(sd, in_proj_weight=torch.ones(90, 32))
    with pytest.raises(ValueError, match=r"in_proj_weight must have shape \(96, 32\), got \(90, 32\)"):
        MultiHeadAttention.from_torch(bad, num_heads=4)
    bad = dict(sd, in_proj_bias=torch.ones(95))
    with pytest.raises(ValueError, match=r"in_proj_bias must have shape \(96,\), got \(95,\)"):
        MultiHeadAttention.from_torch(bad, num_heads=4)
    with pytest.raises(ValueError, match="embed_dim=32.*divisible by num_heads=5"):
        MultiHeadAttention.from_torch(sd, num_heads=5)
    with pytest.raises(ValueError, match="disagrees with the module's num_heads=4"):
        MultiHeadAttention.from_torch(tm, num_heads=8)
    kv = torch.nn.MultiheadAttention(32, 4, add_bias_kv=True)
    with pytest.raises(NotImplementedError, match="add_bias_kv"):
        MultiHeadAttention.from_torch(kv)
    with pytest.raises(NotImplementedError, match="add_bias_kv"):
        MultiHeadAttention.from_torch(kv.state_dict(), num_heads=4)
    with pytest.raises(NotImplementedError, match="add_zero_attn"):
        MultiHeadAttention.from_torch(torch.nn.MultiheadAttention(32, 4, add_zero_attn=True))
    with pytest.raises(TypeError, match="state_dict_or_module"):
        MultiHeadAttention.from_torch(42, num_heads=4)


# ---------------------------------------------------------------- keras
def keras_layer(num_heads, key_dim, q_dim, kv_dim, seed=0, **kw):
    keras.utils.set_random_seed(seed)
    layer = keras.layers.MultiHeadAttention(num_heads=num_heads, key_dim=key_dim, **kw)
    layer(np.zeros((1, 2, q_dim), np.float32), np.zeros((1, 3, kv_dim), np.float32))  # build
    if kw.get("use_bias", True):                 # non-zero biases
        rng = np.random.default_rng(seed)
        layer.set_weights([w if w.ndim == 3 else w + rng.standard_normal(w.shape).astype(w.dtype)
                           for w in layer.get_weights()])                   # kernels are 3-D
    return layer


def kcall(layer, q, v, **kw):
    with torch.no_grad():
        res = layer(q, v, **kw)
    if isinstance(res, tuple):
        return tuple(np.asarray(keras.ops.convert_to_numpy(r)) for r in res)
    return np.asarray(keras.ops.convert_to_numpy(res))


@needs_keras
@pytest.mark.parametrize("kw", [
    dict(),
    dict(value_dim=5, output_shape=11),
    dict(use_bias=False, output_shape=(7,)),
])
def test_keras_cross_attention(kw):
    layer = keras_layer(3, 4, q_dim=10, kv_dim=6, **kw)      # key_dim 4 != 10 / 3
    m = MultiHeadAttention.from_keras(layer)
    assert m.head_dim == 4 and m.num_heads == 3 and m.kdim == 6
    assert m.v_head_dim == kw.get("value_dim", 4)
    assert (m.q_bias is None) == (kw.get("use_bias") is False)
    q, v = rand((2, 5, 10)), rand((2, 8, 6), 1)
    ko, ks = kcall(layer, q, v, return_attention_scores=True)
    out, w = m(q, v, need_weights=True, average_attn_weights=False)
    assert out.shape == ko.shape
    np.testing.assert_allclose(out, ko, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(w, ks, rtol=1e-5, atol=1e-6)
    # the same from get_weights() + get_config()
    m2 = MultiHeadAttention.from_keras(layer.get_weights(), layer.get_config())
    np.testing.assert_array_equal(m2(q, v)[0], m(q, v)[0])


@needs_keras
def test_keras_separate_key_input():
    """Keras layer(query, value, key=key) is attncore's mha(query, key, value)."""
    keras.utils.set_random_seed(1)
    layer = keras.layers.MultiHeadAttention(num_heads=2, key_dim=3, value_dim=4)
    q, k, v = rand((2, 5, 6)), rand((2, 7, 9), 1), rand((2, 7, 8), 2)
    ko = kcall(layer, q, v, key=k)
    m = MultiHeadAttention.from_keras(layer)
    assert (m.embed_dim, m.kdim, m.vdim, m.out_dim) == (6, 9, 8, 6)
    np.testing.assert_allclose(m(q, k, v)[0], ko, rtol=1e-5, atol=1e-5)


@needs_keras
def test_keras_self_attention_masks_and_causal():
    layer = keras_layer(4, 8, q_dim=16, kv_dim=16)
    m = MultiHeadAttention.from_keras(layer)
    x = rand((2, 7, 16))
    allowed = np.random.default_rng(3).random((2, 7, 7)) < 0.7
    allowed[..., 0] = True
    ko = kcall(layer, x, x, attention_mask=allowed)           # Keras: True = attend
    np.testing.assert_allclose(m(x, attn_mask=allowed)[0], ko, rtol=1e-5, atol=1e-5)
    ko = kcall(layer, x, x, use_causal_mask=True)
    np.testing.assert_allclose(m(x, is_causal=True)[0], ko, rtol=1e-5, atol=1e-5)
    # value_mask (Keras) = key_mask (attncore)
    mem = rand((2, 9, 16), 4)
    vmask = np.ones((2, 9), dtype=bool)
    vmask[0, 5:] = False
    ko = kcall(layer, x, mem, value_mask=vmask)
    np.testing.assert_allclose(m(x, mem, key_mask=vmask)[0], ko, rtol=1e-5, atol=1e-5)


@needs_keras
def test_keras_unsupported():
    layer = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4, attention_axes=(1, 2))
    layer(np.zeros((1, 3, 4, 8), np.float32), np.zeros((1, 3, 4, 8), np.float32))
    with pytest.raises(NotImplementedError, match="attention_axes"):
        MultiHeadAttention.from_keras(layer)
    unbuilt = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)
    with pytest.raises(ValueError, match="no weights yet"):
        MultiHeadAttention.from_keras(unbuilt)
    multi = keras_layer(2, 4, q_dim=8, kv_dim=8, output_shape=(2, 3))
    with pytest.raises(NotImplementedError, match="multi-dimensional output_shape"):
        MultiHeadAttention.from_keras(multi)
    with pytest.raises(ValueError, match="expected 8 weight arrays"):
        MultiHeadAttention.from_keras(layer.get_weights()[:5])


def test_from_keras_weights_without_keras():
    """Keras' kernel layout, checked against the float64 formula (no keras needed)."""
    rng = np.random.default_rng(0)
    E, H, kd, vd, out, kdim = 10, 3, 4, 5, 7, 6
    qk, kk = rng.standard_normal((E, H, kd)), rng.standard_normal((kdim, H, kd))
    vk, ok = rng.standard_normal((kdim, H, vd)), rng.standard_normal((H, vd, out))
    qb, kb, vb, ob = (rng.standard_normal(s) for s in ((H, kd), (H, kd), (H, vd), (out,)))
    m = MultiHeadAttention.from_keras([qk, qb, kk, kb, vk, vb, ok, ob])
    assert m.dtype == np.float64
    q, v = rand((2, 3, E), dtype=np.float64), rand((2, 4, kdim), 1, np.float64)
    # Keras' einsums written out
    Q = np.einsum("bte,ehd->bthd", q, qk) + qb
    K = np.einsum("bse,ehd->bshd", v, kk) + kb
    V = np.einsum("bse,ehd->bshd", v, vk) + vb
    s = np.einsum("bshd,bthd->bhts", K, Q) / np.sqrt(kd)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ctx = np.einsum("bhts,bshd->bthd", p, V)
    expected = np.einsum("bthd,hdo->bto", ctx, ok) + ob
    np.testing.assert_allclose(m(q, v)[0], expected, **TOL64)
    with pytest.raises(NotImplementedError, match="use_gate"):
        MultiHeadAttention.from_keras([qk, qb, kk, kb, vk, vb, ok, ob], {"use_gate": True})
    with pytest.raises(NotImplementedError, match="attention_axes"):
        MultiHeadAttention.from_keras([qk, kk, vk, ok], {"attention_axes": (2,)})


# ---------------------------------------------------------------- GQA / arrays
def gqa_pair(H=8, Hkv=2, E=64, seed=0, dtype=np.float64):
    m = MultiHeadAttention(E, H, num_kv_heads=Hkv, rng=seed, dtype=dtype)
    rng = np.random.default_rng(seed + 1)
    m.k_bias = rng.standard_normal(m.k_weight.shape[0])
    m.v_bias = rng.standard_normal(m.v_weight.shape[0])
    m.q_bias = rng.standard_normal(m.q_weight.shape[0])
    hd, g = m.head_dim, H // Hkv
    # the same layer with every key/value head repeated g times, by hand
    rep = lambda a: np.repeat(a.reshape(Hkv, hd, *a.shape[1:]), g, axis=0).reshape(  # noqa: E731
        H * hd, *a.shape[1:])
    full = MultiHeadAttention.from_arrays(
        q_weight=m.q_weight, k_weight=rep(m.k_weight), v_weight=rep(m.v_weight),
        out_weight=m.out_weight, q_bias=m.q_bias, k_bias=rep(m.k_bias), v_bias=rep(m.v_bias),
        out_bias=m.out_bias, num_heads=H)
    return m, full


@pytest.mark.parametrize("Hkv", [1, 2, 4])
def test_gqa_vs_repeated_kv(Hkv):
    m, full = gqa_pair(Hkv=Hkv)
    assert m.k_weight.shape == (Hkv * 8, 64) and full.k_weight.shape == (64, 64)
    x = rand((2, 9, 64), dtype=np.float64)
    mem = rand((2, 11, 64), 1, np.float64)
    for args in ((x,), (x, mem)):
        out, w = m(*args, is_causal=len(args) == 1, need_weights=True, average_attn_weights=False)
        out_f, w_f = full(*args, is_causal=len(args) == 1, need_weights=True,
                          average_attn_weights=False)
        np.testing.assert_allclose(out, out_f, **TOL64)
        np.testing.assert_allclose(w, w_f, **TOL64)
        np.testing.assert_allclose(out, reference_mha(m, *args, causal=len(args) == 1)[0],
                                   **TOL64)


def test_from_arrays_general_head_sizes():
    rng = np.random.default_rng(0)
    H, hd, hdv, E, kdim, vdim, out = 3, 5, 7, 9, 4, 6, 2
    w = dict(q_weight=rng.standard_normal((H * hd, E)), k_weight=rng.standard_normal((H * hd, kdim)),
             v_weight=rng.standard_normal((H * hdv, vdim)),
             out_weight=rng.standard_normal((out, H * hdv)), k_bias=rng.standard_normal(H * hd))
    copies = {k: v.copy() for k, v in w.items()}
    m = MultiHeadAttention.from_arrays(**w, num_heads=H)
    assert (m.head_dim, m.v_head_dim, m.out_dim) == (hd, hdv, out)
    assert m.q_bias is None and m.k_bias is not None and m.out_bias is None
    assert m.k_weight is not w["k_weight"]
    q, k, v = rand((2, 3, E), dtype=np.float64), rand((2, 4, kdim), 1, np.float64), \
        rand((2, 4, vdim), 2, np.float64)
    np.testing.assert_allclose(m(q, k, v)[0], reference_mha(m, q, k, v)[0], **TOL64)
    for key in w:
        np.testing.assert_array_equal(w[key], copies[key])
    with pytest.raises(ValueError, match=r"out_weight must have num_heads \* v_head_dim = 3 \* 7 = 21"):
        MultiHeadAttention.from_arrays(**dict(w, out_weight=np.ones((2, 20))), num_heads=H)
    with pytest.raises(ValueError, match=r"k_weight must have num_kv_heads \* head_dim"):
        MultiHeadAttention.from_arrays(**dict(w, k_weight=np.ones((14, 4))), num_heads=H)
    with pytest.raises(ValueError, match=r"k_bias must have shape \(15,\), got \(14,\)"):
        MultiHeadAttention.from_arrays(**dict(w, k_bias=np.ones(14)), num_heads=H)


def test_weight_attributes_are_live_and_checked():
    m = MultiHeadAttention(16, 2, rng=0, dtype=np.float64)
    x = rand((1, 4, 16), dtype=np.float64)
    before = m(x)[0]
    m.q_weight = np.zeros((16, 16))                 # replaces the values in the fused buffer
    assert np.all(m.q_weight == 0)
    after = m(x)[0]
    np.testing.assert_allclose(after, reference_mha(m, x)[0], **TOL64)
    assert not np.allclose(before, after)
    m.v_weight[:] *= 2                              # in-place edits are seen as well
    np.testing.assert_allclose(m(x)[0], reference_mha(m, x)[0], **TOL64)
    assert m.q_bias is not None
    m.q_bias = None
    assert m.q_bias is None
    np.testing.assert_allclose(m(x)[0], reference_mha(m, x)[0], **TOL64)
    with pytest.raises(ValueError, match=r"k_weight must have shape \(16, 16\), got \(16, 15\)"):
        m.k_weight = np.zeros((16, 15))
    with pytest.raises(TypeError, match="out_bias must be a bfloat16, float16, float32 or float64 array"):
        m.out_bias = np.zeros(16, dtype=np.int64)


def test_constructor():
    m = MultiHeadAttention(24, 4, kdim=10, vdim=6, num_kv_heads=2, out_dim=5, rng=3)
    assert m.q_weight.shape == (24, 24) and m.k_weight.shape == (12, 10)
    assert m.v_weight.shape == (12, 6) and m.out_weight.shape == (5, 24)
    assert m.q_weight.dtype == np.float32 and m.q_bias.shape == (24,) and not m.q_bias.any()
    np.testing.assert_array_equal(
        m.q_weight, MultiHeadAttention(24, 4, kdim=10, vdim=6, num_kv_heads=2, out_dim=5,
                                       rng=3).q_weight)
    assert MultiHeadAttention(8, 2, bias=False).out_bias is None
    assert "num_kv_heads=2" in repr(m)
    q, k, v = rand((2, 3, 24)), rand((2, 5, 10), 1), rand((2, 5, 6), 2)
    out, _ = m(q, k, v)
    assert out.shape == (2, 3, 5) and out.dtype == np.float32
    np.testing.assert_allclose(out, reference_mha(m, q, k, v)[0], rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="self-attention needs kdim == vdim == embed_dim"):
        m(q)


def test_inputs_not_modified_and_dtypes():
    m = MultiHeadAttention(16, 4, rng=0)
    x = rand((2, 5, 16), dtype=np.float64)
    mem = np.asfortranarray(rand((2, 6, 16), 1, np.float16))
    key_mask = np.ones((2, 6), bool)
    key_mask[0, 4:] = False
    copies = [a.copy() for a in (x, mem, key_mask)]
    out, w = m(x, mem, key_mask=key_mask, need_weights=True)
    assert out.dtype == np.float32 and w.dtype == np.float32   # the layer's dtype
    for a, c in zip((x, mem, key_mask), copies):
        np.testing.assert_array_equal(a, c)
    np.testing.assert_allclose(out, reference_mha(m, x, mem, mask=key_mask[:, None, None, :])[0],
                               rtol=1e-4, atol=1e-5)


def test_fully_masked_rows_give_zero_context():
    m = MultiHeadAttention(16, 4, rng=0, bias=False)
    x = rand((2, 3, 16))
    key_mask = np.ones((2, 3), bool)
    key_mask[1] = False                            # nothing to attend in batch 1
    out, w = m(x, key_mask=key_mask, need_weights=True)
    assert np.all(out[1] == 0) and np.all(w[1] == 0)
    assert np.all(np.isfinite(out))


# ---------------------------------------------------------------- errors
def _err(exc, pattern, fn, *a, **kw):
    with pytest.raises(exc, match=pattern):
        fn(*a, **kw)


# (id, exception, message pattern naming the argument, (embed_dim, num_heads), keywords)
BAD_CONSTRUCTION = [
    ("embed_dim-not-divisible", ValueError,
     "embed_dim must be divisible by num_heads, got embed_dim=10 and num_heads=3",
     (10, 3), {}),
    ("num_kv_heads-not-dividing", ValueError,
     "num_kv_heads must divide num_heads, got num_kv_heads=3 and num_heads=4",
     (16, 4), dict(num_kv_heads=3)),
    ("num_heads-float", TypeError, "num_heads must be an int", (16, 4.0), {}),
    ("embed_dim-zero", ValueError, "embed_dim must be >= 1", (0, 1), {}),
    ("dtype-int", TypeError, "dtype must be float32, float64, float16 or bfloat16",
     (16, 4), dict(dtype=np.int32)),
]


@pytest.mark.parametrize("exc, pattern, args, kw", [c[1:] for c in BAD_CONSTRUCTION],
                         ids=[c[0] for c in BAD_CONSTRUCTION])
def test_bad_construction(exc, pattern, args, kw):
    _err(exc, pattern, MultiHeadAttention, *args, **kw)


def _args(*args, **kw):
    return args, kw


# (id, exception, message pattern naming the argument,
#  (q, k, v) -> (args, kwargs) of a call of MultiHeadAttention(16, 4, kdim=8, vdim=6))
BAD_CALLS = [
    ("query-embed_dim", ValueError, r"query last dimension must be embed_dim=16, got shape \(2, 3, 15\)",
     lambda q, k, v: _args(rand((2, 3, 15)), k, v)),
    ("key-kdim", ValueError, r"key last dimension must be kdim=8, got shape \(2, 5, 6\)",
     lambda q, k, v: _args(q, v, v)),
    ("value-vdim", ValueError, r"value last dimension must be vdim=6, got shape \(2, 5, 8\)",
     lambda q, k, v: _args(q, k, k)),
    ("key-value-length", ValueError,
     r"key and value must have the same length .* key shape \(2, 5, 8\) and value shape \(2, 4, 6\)",
     lambda q, k, v: _args(q, k, v[:, :4])),
    ("key-batch", ValueError, "key and value must have the query's batch size 2",
     lambda q, k, v: _args(q, k[:1], v[:1])),
    ("key-rank", ValueError, r"key must be \(B, S, kdim\) = \(2, S, 8\), or \(S, 8\) shared",
     lambda q, k, v: _args(q, k[None], v[None])),
    ("shared-value-rank", ValueError, r"value must be 2-D \(S, vdim\) like the shared key",
     lambda q, k, v: _args(q, k[0], v)),
    ("query-rank", ValueError, r"query must be \(batch, length, 16\) or unbatched",
     lambda q, k, v: _args(q[None], k, v)),
    ("query-int", TypeError, "query must be a bfloat16, float16, float32 or float64 array, got dtype int64",
     lambda q, k, v: _args(np.ones((2, 3, 16), dtype=np.int64), k, v)),
    ("value-without-key", ValueError, "value given without key",
     lambda q, k, v: _args(q, value=v)),
    ("key_mask-shape", ValueError, r"key_mask must have shape \(2, 5\) \(batch, key length\), got \(2, 4\)",
     lambda q, k, v: _args(q, k, v, key_mask=np.ones((2, 4), bool))),
    ("key_mask-int", TypeError, "key_mask must be a bool array .*got dtype int64",
     lambda q, k, v: _args(q, k, v, key_mask=np.ones((2, 5), dtype=np.int64))),
    ("attn_mask-shape", ValueError,
     r"attn_mask must have shape \(L, S\), \(B, L, S\) or \(B, num_heads, L, S\) "
     r"= \(3, 5\), \(2, 3, 5\) or \(2, 4, 3, 5\).*got \(3, 4\)",
     lambda q, k, v: _args(q, k, v, attn_mask=np.ones((3, 4), bool))),
    ("attn_mask-heads", ValueError, r"attn_mask must have shape",
     lambda q, k, v: _args(q, k, v, attn_mask=np.ones((2, 3, 3, 5), bool))),
    ("attn_mask-int", TypeError, "attn_mask must be a bool array .* got dtype int64",
     lambda q, k, v: _args(q, k, v, attn_mask=np.ones((3, 5), dtype=np.int64))),
    ("is_causal-str", ValueError, "is_causal must be False, True, 'upper_left' or 'lower_right'",
     lambda q, k, v: _args(q, k, v, is_causal="yes")),
]


@pytest.mark.parametrize("exc, pattern, make", [c[1:] for c in BAD_CALLS],
                         ids=[c[0] for c in BAD_CALLS])
def test_bad_inputs(exc, pattern, make):
    m = MultiHeadAttention(16, 4, kdim=8, vdim=6, rng=0)
    args, kw = make(rand((2, 3, 16)), rand((2, 5, 8)), rand((2, 5, 6)))
    _err(exc, pattern, m, *args, **kw)


# ---------------------------------------------------------------- KV cache
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_cache_token_by_token_equals_full_causal(dtype):
    m = MultiHeadAttention(32, 4, rng=1, dtype=dtype)
    m.q_bias = m.k_bias = m.v_bias = m.out_bias = np.linspace(-1, 1, 32)
    x = rand((3, 13, 32), dtype=dtype)
    full, _ = m(x, is_causal=True)
    cache = m.new_cache(batch_size=3, max_length=16)
    assert len(cache) == 0 and cache.mode is None
    k_buf = cache._k
    steps = []
    for t in range(13):
        y, w = m(x[:, t:t + 1], cache=cache, is_causal="lower_right", need_weights=True)
        assert w.shape == (3, 1, t + 1)
        steps.append(y)
    assert len(cache) == 13 and cache.mode == "self"
    assert cache._k is k_buf                        # no reallocation
    tol = TOL32 if dtype == np.float32 else TOL64
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, **tol)
    np.testing.assert_allclose(np.concatenate(steps, axis=1),
                               reference_mha(m, x, causal=1)[0], **tol)


def test_cache_chunked_prefill_gqa_and_reset():
    m, full = gqa_pair(H=8, Hkv=2, E=64)
    x = rand((2, 20, 64), dtype=np.float64)
    expected, _ = full(x, is_causal=True)
    cache = m.new_cache(2, 32)
    outs = []
    for a, b in ((0, 7), (7, 8), (8, 15), (15, 20)):  # chunks of 7, 1, 7, 5 tokens
        outs.append(m(x[:, a:b], cache=cache, is_causal="lower_right")[0])
    np.testing.assert_allclose(np.concatenate(outs, axis=1), expected, **TOL64)
    assert cache.keys.shape == (2, 2, 20, 8)          # kv heads only, never repeated
    with pytest.raises(ValueError):
        cache.keys[0, 0, 0, 0] = 1.0                  # read-only view
    cache.reset()
    assert len(cache) == 0 and cache.mode is None
    out, _ = m(x[:, :5], cache=cache, is_causal=True)  # upper-left is fine on an empty cache
    np.testing.assert_allclose(out, expected[:, :5], **TOL64)


def test_cache_key_mask_left_padding():
    m = MultiHeadAttention(16, 2, rng=0, dtype=np.float64)
    x = rand((2, 9, 16), dtype=np.float64)
    valid = np.ones((2, 9), bool)
    valid[1, :3] = False                              # batch 1 left-padded by 3 tokens
    full, _ = m(x, key_mask=valid, is_causal=True)
    cache = m.new_cache(2, 9)
    m(x[:, :6], cache=cache, key_mask=valid[:, :6], is_causal="lower_right")
    for t in range(6, 9):
        y, _ = m(x[:, t:t + 1], cache=cache, key_mask=valid[:, :t + 1], is_causal="lower_right")
        np.testing.assert_allclose(y[:, 0], full[:, t], **TOL64)


def test_cross_attention_cache_projects_memory_once():
    m = MultiHeadAttention(32, 4, kdim=12, vdim=12, rng=2, dtype=np.float64)
    mem = rand((2, 10, 12), 3, np.float64)
    mem_ok = np.ones((2, 10), bool)
    mem_ok[0, 8:] = False
    y = rand((2, 6, 32), 4, np.float64)
    expected, _ = m(y, mem, key_mask=mem_ok)
    cache = m.new_cache(2, 10)
    first, _ = m(y[:, :1], mem, cache=cache, key_mask=mem_ok)
    assert cache.mode == "cross" and len(cache) == 10
    keys = cache.keys.copy()
    outs = [first]
    for t in range(1, 6):
        outs.append(m(y[:, t:t + 1], cache=cache, is_causal="lower_right")[0])  # key=None: reuse
        again, _ = m(y[:, t:t + 1], mem, cache=cache)                          # same object: ok
        np.testing.assert_array_equal(again, outs[-1])
    np.testing.assert_allclose(np.concatenate(outs, axis=1), expected, **TOL64)
    np.testing.assert_array_equal(cache.keys, keys)
    assert len(cache) == 10
    with pytest.raises(ValueError, match="already holds the projected keys/values"):
        m(y[:, :1], mem.copy(), cache=cache)
    with pytest.raises(ValueError, match="self-attention needs kdim == vdim"):
        m(y[:, :1], cache=m.new_cache(2, 4))


def test_cache_errors():
    m = MultiHeadAttention(16, 4, rng=0)
    x = rand((2, 5, 16))
    cache = m.new_cache(batch_size=2, max_length=6)
    _err(ValueError, "query batch size 3 does not match the cache's batch_size=2",
         m, rand((3, 1, 16)), cache=cache)
    m(x, cache=cache, is_causal=True)
    _err(ValueError, r"KV cache overflow: it holds 5 of max_length=6 tokens and cannot take 2 "
         r"more; make a larger cache with new_cache\(batch_size, max_length>=7\)",
         m, x[:, :2], cache=cache, is_causal="lower_right")
    assert len(cache) == 5                            # the failed call appended nothing
    _err(ValueError, r"key_mask must have shape \(2, 6\)", m, x[:, :1], cache=cache,
         key_mask=np.ones((2, 5), bool), is_causal="lower_right")
    assert len(cache) == 5
    _err(ValueError, "use is_causal='lower_right'", m, x[:, :1], cache=cache, is_causal=True)
    _err(ValueError, "cross-attention needs a cache of its own", m, x[:, :1], x, cache=cache)
    _err(ValueError, "cache does not fit this layer",
         MultiHeadAttention(16, 2), x[:, :1], cache=cache)
    _err(TypeError, "cache must be a KVCache", m, x, cache={})
    _err(ValueError, "max_length must be >= 1", m.new_cache, 2, 0)
    _err(TypeError, "batch_size must be an int", m.new_cache, 2.5, 4)
    assert "length=5" in repr(cache)


def test_unbatched_with_cache():
    m = MultiHeadAttention(16, 4, rng=0, dtype=np.float64)
    x = rand((7, 16), dtype=np.float64)
    full, _ = m(x, is_causal=True)
    assert full.shape == (7, 16)
    cache = m.new_cache(1, 7)
    outs = [m(x[t:t + 1], cache=cache, is_causal="lower_right")[0] for t in range(7)]
    np.testing.assert_allclose(np.concatenate(outs), full, **TOL64)


def test_exports():
    for name in ("MultiHeadAttention", "KVCache", "sinusoidal_encoding", "add_positional_encoding"):
        assert name in attncore.__all__ and hasattr(attncore, name)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_self_attention_call_frees_its_temporaries_early(dtype):
    """A call's peak memory (tracemalloc, which sees NumPy's buffers) stays
    at the projection buffer plus one block of the output's size: the
    converted input, the projections and the attention output are each
    dropped once used up.  Holding them all to the end (the Q/K/V buffer,
    the attention output, its (B*L, E) copy and the output) made the peak
    about 6 blocks, and a peak above twice the largest buffer makes glibc
    hand the heap back after every call (each call then faults its memory
    in again)."""
    import tracemalloc

    if dtype == "bfloat16":
        dt = pytest.importorskip("ml_dtypes").bfloat16
    else:
        dt = np.float32
    B, L, E, H = 2, 256, 64, 4
    rng = np.random.default_rng(0)
    mha = MultiHeadAttention(E, H, dtype=dt, rng=rng)
    x = rng.standard_normal((B, L, E)).astype(np.float32).astype(dt)
    block = B * L * E * 4                     # one (B, L, E) float32 array
    mha(x, num_threads=1)
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        out, _ = mha(x, num_threads=1)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert out.shape == (B, L, E)
    # Q/K/V (3 blocks) + the attention output (1) + a little
    assert peak <= 4.5 * block, (peak / block)
