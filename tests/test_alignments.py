"""Built-in alignments against independent references: Bahdanau and Luong
"general" written plainly in float64 NumPy / PyTorch, Keras 3 Attention and
AdditiveAttention (torch backend), and the kernels' tanh."""
import os

import numpy as np
import pytest

import attncore
from attncore._core import _additive
from reference import additive_attention, additive_scores

os.environ.setdefault("KERAS_BACKEND", "torch")
torch = pytest.importorskip("torch")

# Keras' torch backend converts tensors with np.array(x), which NumPy 2 flags
pytestmark = pytest.mark.filterwarnings(
    "ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning")


def luong_general_torch(q, k, vals, W, mask=None):
    """Luong 'general' with PyTorch in float64: softmax(q W k^T) V."""
    tq, tk, tv, tw = (torch.as_tensor(np.asarray(a, np.float64)) for a in (q, k, vals, W))
    s = torch.einsum("btd,de,bse->bts", tq, tw, tk)
    if mask is not None:
        s = s.masked_fill(~torch.as_tensor(mask)[:, None, :], float("-inf"))
    w = torch.softmax(s, dim=-1)
    return (w @ tv).numpy(), w.numpy()


@pytest.fixture
def data():
    rng = np.random.default_rng(42)
    B, T, S, Dq, Dk, A, Dv = 3, 4, 7, 5, 6, 8, 3
    d = dict(
        q=rng.standard_normal((B, T, Dq)), k=rng.standard_normal((B, S, Dk)),
        vals=rng.standard_normal((B, S, Dv)),
        Wq=rng.standard_normal((A, Dq)) * 0.5, Wk=rng.standard_normal((A, Dk)) * 0.5,
        v=rng.standard_normal(A), b=rng.standard_normal(A) * 0.3,
        Wa=rng.standard_normal((Dq, Dk)) * 0.4,
    )
    mask = rng.random((B, S)) > 0.3
    mask[:, 0] = True
    d["mask"] = mask
    return d


@pytest.fixture(params=["factored", "tanh"])
def mlp_form(request, monkeypatch):
    """Run the fused additive kernel in its factored form (the default for
    moderate pre-activations) or force its direct-tanh form."""
    if request.param == "tanh":
        from attncore import _alignment_layer

        monkeypatch.setattr(_alignment_layer, "_FACTOR_LIMIT",
                            {np.dtype(np.float32): -1.0, np.dtype(np.float64): -1.0})
    return request.param


@pytest.mark.parametrize("dtype, tol", [(np.float64, 1e-12), (np.float32, 2e-5)])
@pytest.mark.parametrize("masked", [False, True])
def test_mlp_vs_bahdanau(data, dtype, tol, masked, mlp_form):
    d = data
    mask = d["mask"] if masked else None
    att = attncore.Attention("mlp", q_weight=d["Wq"], k_weight=d["Wk"], v=d["v"], bias=d["b"])
    ctx, w = att(d["q"].astype(dtype), d["k"].astype(dtype), d["vals"].astype(dtype),
                 mask=mask, return_weights=True)
    assert ctx.dtype == dtype and w.dtype == dtype
    rc, rw = additive_attention(d["q"].astype(dtype), d["k"].astype(dtype),
                                d["vals"].astype(dtype), d["v"].astype(dtype),
                                d["Wq"].astype(dtype), d["Wk"].astype(dtype),
                                d["b"].astype(dtype), mask)
    np.testing.assert_allclose(w, rw, rtol=tol, atol=tol)
    np.testing.assert_allclose(ctx, rc, rtol=tol, atol=tol)


def test_mlp_identity_projections(data):
    d = data
    rng = np.random.default_rng(1)
    q = rng.standard_normal((2, 3, 8))
    k = rng.standard_normal((2, 5, 8))
    att = attncore.Attention("additive", v=d["v"])
    ctx, w = att(q, k, return_weights=True)
    rc, rw = additive_attention(q, k, k, d["v"])
    np.testing.assert_allclose(w, rw, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(ctx, rc, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("masked", [False, True])
def test_bilinear_vs_luong_general(data, masked):
    d = data
    mask = d["mask"] if masked else None
    for name in ("bilinear", "general"):
        ctx, w = attncore.Attention(name, weight=d["Wa"])(d["q"], d["k"], d["vals"], mask=mask,
                                                           return_weights=True)
        rc, rw = luong_general_torch(d["q"], d["k"], d["vals"], d["Wa"], mask)
        np.testing.assert_allclose(w, rw, rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(ctx, rc, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("name, scale", [("dot", None), ("dot", 0.7), ("dot", -1.3),
                                         ("scaled_dot", None)])
def test_dot_vs_torch(name, scale):
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 3, 6))
    k = rng.standard_normal((2, 5, 6))
    vals = rng.standard_normal((2, 5, 4))
    mask = np.array([[1, 1, 0, 1, 0], [0, 1, 1, 1, 1]], bool)
    params = {} if scale is None else {"scale": scale}
    ctx, w = attncore.Attention(name, **params)(q, k, vals, mask=mask, return_weights=True)
    s = torch.as_tensor(q) @ torch.as_tensor(k).transpose(1, 2)
    if name == "scaled_dot":
        s = s / np.sqrt(6)
    elif scale is not None:
        s = s * scale
    s = s.masked_fill(~torch.as_tensor(mask)[:, None, :], float("-inf"))
    tw = torch.softmax(s, -1)
    np.testing.assert_allclose(w, tw.numpy(), rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(ctx, (tw @ torch.as_tensor(vals)).numpy(), rtol=1e-12, atol=1e-13)


def test_builtin_score_methods_follow_the_contract(data):
    """prepare / score of the built-ins used directly (the plugin contract)."""
    d = data
    a = attncore.alignments.create("mlp", q_weight=d["Wq"], k_weight=d["Wk"], v=d["v"],
                                   bias=d["b"])
    s = a.score(d["q"], a.prepare(d["k"]))
    ref = additive_scores(d["q"], d["k"], d["v"], d["Wq"], d["Wk"], d["b"])
    np.testing.assert_allclose(s, ref, rtol=1e-12, atol=1e-12)
    g = attncore.alignments.create("general", weight=d["Wa"])
    np.testing.assert_allclose(g.score(d["q"], g.prepare(d["k"])),
                               np.einsum("btd,de,bse->bts", d["q"], d["Wa"], d["k"]),
                               rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_mlp_large_preactivations_and_inf(dtype):
    """|W q|, |W k| beyond the factored form's range: the exact tanh form is used."""
    rng = np.random.default_rng(9)
    q = (rng.standard_normal((2, 3, 4)) * 60).astype(dtype)
    k = (rng.standard_normal((2, 6, 4)) * 60).astype(dtype)
    vals = rng.standard_normal((2, 6, 2)).astype(dtype)
    v = rng.standard_normal(4).astype(dtype) * 0.5
    att = attncore.Attention("additive", v=v)
    ctx, w = att(q, k, vals, return_weights=True)
    rc, rw = additive_attention(q, k, vals, v)
    tol = 1e-12 if dtype == np.float64 else 2e-5
    np.testing.assert_allclose(w, rw, rtol=tol, atol=tol)
    np.testing.assert_allclose(ctx, rc, rtol=tol, atol=tol)
    q[0, 1, 2] = np.inf                # tanh saturates: scores stay finite
    ctx, w = att(q, k, vals, return_weights=True)
    rc, rw = additive_attention(q, k, vals, v)
    np.testing.assert_allclose(w, rw, rtol=tol, atol=tol)
    assert np.isfinite(ctx).all()


def test_mlp_threads_agree_and_nan_handling(mlp_form):
    rng = np.random.default_rng(5)
    B, T, S, A = 4, 9, 33, 40
    q = rng.standard_normal((B, T, A)).astype(np.float32)
    k = rng.standard_normal((B, S, A)).astype(np.float32)
    vals = rng.standard_normal((B, S, 6)).astype(np.float32)
    mask = rng.random((B, S)) > 0.2
    mask[2] = False                    # batch element 2 has nothing to attend
    vals[0, ~mask[0]] = np.nan         # NaN in masked-out values must not leak
    v = rng.standard_normal(A).astype(np.float32)
    outs = []
    for nt in (1, 2, 3):
        att = attncore.Attention("mlp", v=v, k_weight=np.eye(A) * 0.5, num_threads=nt)
        outs.append(att(q, k, vals, mask=mask, return_weights=True))
    for c, w in outs[1:]:
        np.testing.assert_allclose(c, outs[0][0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(w, outs[0][1], rtol=1e-5, atol=1e-7)
    c, w = outs[0]
    assert np.isfinite(c).all()
    assert (c[2] == 0).all() and (w[2] == 0).all()
    np.testing.assert_allclose(w[[0, 1, 3]].sum(-1), 1, rtol=1e-5)
    assert (w[~np.broadcast_to(mask[:, None, :], w.shape)] == 0).all()
    q[1, 3, 0] = np.nan                # NaN in a query that takes part propagates
    c, w = attncore.Attention("mlp", v=v)(q, k, vals, mask=mask, return_weights=True)
    assert np.isnan(c[1, 3]).all() and np.isnan(w[1, 3, mask[1]]).all()
    assert np.isnan(w[1, 3]).all()          # a NaN row is NaN across the row, masked keys too
    assert np.isfinite(c[1, [0, 1, 2, 4]]).all()


def test_kernel_tanh_accuracy_and_special_values():
    x = np.concatenate([np.linspace(-12, 12, 400_001), np.geomspace(1e-30, 12, 20_000),
                        -np.geomspace(1e-30, 12, 20_000)])
    x32 = x.astype(np.float32)
    y = _additive.tanh_array(x32)
    ref = np.tanh(x32.astype(np.float64))
    ulp = np.abs(y - ref) / np.spacing(np.abs(ref).astype(np.float32)).astype(np.float64)
    assert ulp.max() <= 8
    assert np.abs(y.astype(np.float64) - ref).max() <= 4e-7
    y64 = _additive.tanh_array(x)
    assert np.abs(y64 - np.tanh(x)).max() <= 4e-16
    for dt in (np.float32, np.float64):
        sp = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 30.0, -30.0], dt)
        r = _additive.tanh_array(sp)
        assert np.isnan(r[0])
        np.testing.assert_array_equal(r[1:], np.array([1, -1, 0, -0.0, 1, -1], dt))
        assert np.signbit(r[4])
        big = np.linspace(9 if dt == np.float32 else 20, 1e4, 1000).astype(dt)
        assert (_additive.tanh_array(big) == 1).all() and (_additive.tanh_array(-big) == -1).all()
        assert (np.abs(_additive.tanh_array(np.linspace(-9, 9, 10001).astype(dt))) <= 1).all()


# --------------------------------------------------------------------------
# Keras 3 parity (torch backend)
# --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def keras():
    if os.environ.get("KERAS_BACKEND", "torch") != "torch":
        pytest.skip("Keras parity tests run on the torch backend")
    return pytest.importorskip("keras")


def _keras_call(layer, q, v, mask):
    from keras import ops

    out, w = layer([q, v], mask=[None, mask], return_attention_scores=True)
    return ops.convert_to_numpy(out), ops.convert_to_numpy(w)


def _assert_as_keras(layer, att, q, v, mask):
    """attncore's ``att`` gives Keras ``layer``'s context and weights."""
    kout, kw = _keras_call(layer, q, v, mask)
    ctx, w = att(q, v, mask=mask, return_weights=True)
    np.testing.assert_allclose(w, kw, rtol=1e-5, atol=2e-6)
    np.testing.assert_allclose(ctx, kout, rtol=1e-5, atol=2e-6)


@pytest.fixture
def kdata():
    rng = np.random.default_rng(7)
    q = rng.standard_normal((3, 4, 6)).astype(np.float32)
    v = rng.standard_normal((3, 5, 6)).astype(np.float32)
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 0, 1, 1]], bool)
    return q, v, mask


def test_keras_additive_attention(keras, kdata):
    q, v, mask = kdata
    layer = keras.layers.AdditiveAttention(use_scale=True)
    _keras_call(layer, q, v, mask)  # build
    scale = np.random.default_rng(8).standard_normal(6).astype(np.float32)
    layer.set_weights([scale])
    _assert_as_keras(layer, attncore.Attention("additive", v=scale), q, v, mask)


@pytest.mark.parametrize("use_scale", [False, True])
def test_keras_attention_dot(keras, kdata, use_scale):
    q, v, mask = kdata
    layer = keras.layers.Attention(use_scale=use_scale, score_mode="dot")
    _keras_call(layer, q, v, mask)
    params = {}
    if use_scale:
        layer.set_weights([np.array(0.37, np.float32)])
        params["scale"] = 0.37
    _assert_as_keras(layer, attncore.Attention("dot", **params), q, v, mask)


@pytest.mark.parametrize("use_scale", [False, True])
def test_keras_attention_concat(keras, kdata, use_scale):
    q, v, mask = kdata
    layer = keras.layers.Attention(use_scale=use_scale, score_mode="concat")
    _keras_call(layer, q, v, mask)
    scale, c = 0.8, 1.7
    layer.set_weights([np.array(scale, np.float32), np.array(c, np.float32)] if use_scale
                      else [np.array(c, np.float32)])
    D = q.shape[-1]
    eye = np.eye(D, dtype=np.float32) * (scale if use_scale else 1.0)
    att = attncore.Attention("concat", q_weight=eye, k_weight=eye, v=np.full(D, c, np.float32))
    _assert_as_keras(layer, att, q, v, mask)


@pytest.mark.parametrize("S", [20, 300])
def test_dot_and_bilinear_short_and_long_memories(S):
    """Both core paths (weights path for short memories, flash for long) agree
    with a plain torch composition."""
    rng = np.random.default_rng(S)
    q = rng.standard_normal((2, 7, 16))
    k = rng.standard_normal((2, S, 16))
    vals = rng.standard_normal((2, S, 5))
    mask = rng.random((2, S)) > 0.25
    W = rng.standard_normal((16, 16)) * 0.3
    for name, params, Wt in (("dot", {}, np.eye(16)), ("bilinear", {"weight": W}, W)):
        ctx = attncore.Attention(name, **params)(q, k, vals, mask=mask)
        rc, _ = luong_general_torch(q, k, vals, Wt, mask)
        np.testing.assert_allclose(ctx, rc, rtol=1e-11, atol=1e-12)
