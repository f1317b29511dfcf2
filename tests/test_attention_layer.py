"""attncore.Attention: step vs all at once, spatial keys, masks, empty rows,
Luong's attentional state, dtypes, bad inputs, plugin output checks, NaN
rows of weights, plot_alignment and the demo."""
import sys

import numpy as np
import pytest

import attncore
from attncore import alignments
from reference import additive_attention, additive_scores, masked_softmax


def plain_attention(scores, vals, mask=None):
    """float64 reference: masked softmax of given scores, then the context."""
    w = masked_softmax(scores, mask)
    return w @ np.asarray(vals, np.float64), w


class Half(attncore.Alignment):
    def score(self, query, prepared):
        return np.matmul(query, np.swapaxes(prepared, -1, -2)) / 2


def make(name, D=6, A=5, seed=0):
    rng = np.random.default_rng(seed)
    if name in ("dot", "scaled_dot"):
        return attncore.Attention(name)
    if name == "bilinear":
        return attncore.Attention(name, weight=rng.standard_normal((D, D)) * 0.3)
    if name == "mlp":
        return attncore.Attention(name, q_weight=rng.standard_normal((A, D)) * 0.4,
                                  k_weight=rng.standard_normal((A, D)) * 0.4,
                                  v=rng.standard_normal(A), bias=rng.standard_normal(A))
    return attncore.Attention(Half)


KINDS = ["dot", "scaled_dot", "bilinear", "mlp", "plugin"]


@pytest.fixture
def seq():
    rng = np.random.default_rng(11)
    B, T, S, D, Dv = 3, 5, 7, 6, 4
    mask = rng.random((B, S)) > 0.35
    mask[2] = False                           # nothing to attend in batch element 2
    mask[0, 0] = mask[1, 3] = True
    return dict(q=rng.standard_normal((B, T, D)), k=rng.standard_normal((B, S, D)),
                vals=rng.standard_normal((B, S, Dv)), mask=mask)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_step_equals_all_at_once(seq, kind, dtype):
    att = make(kind)
    q, k, vals = (seq[n].astype(dtype) for n in ("q", "k", "vals"))
    ctx, w = att(q, k, vals, mask=seq["mask"], return_weights=True)
    memory = att.prepare(k, vals, mask=seq["mask"])
    assert memory.batch == 3 and memory.length == 7
    tol = 1e-12 if dtype == np.float64 else 2e-6
    for t in range(q.shape[1]):
        c, wt = att.step(q[:, t], memory, return_weights=True)
        assert c.shape == (3, 4) and wt.shape == (3, 7) and c.dtype == dtype
        np.testing.assert_allclose(c, ctx[:, t], rtol=tol, atol=tol)
        np.testing.assert_allclose(wt, w[:, t], rtol=tol, atol=tol)
    # empty rows -> context 0, weights 0; masked keys weight 0
    assert (ctx[2] == 0).all() and (w[2] == 0).all()
    assert (w[~np.broadcast_to(seq["mask"][:, None, :], w.shape)] == 0).all()
    # against the alignment's own scores put through a plain masked softmax
    a = att.alignment
    s = a.score(q.astype(np.float64), a.prepare(k.astype(np.float64)))
    rc, rw = plain_attention(s, vals, seq["mask"])
    tol = 1e-11 if dtype == np.float64 else 1e-4
    np.testing.assert_allclose(w, rw, rtol=tol, atol=tol)
    np.testing.assert_allclose(ctx, rc, rtol=tol, atol=tol)


@pytest.mark.parametrize("kind", KINDS)
def test_spatial_keys(seq, kind):
    rng = np.random.default_rng(2)
    B, H, W, D = 2, 3, 4, 6
    feats = rng.standard_normal((B, H, W, D))
    mask = rng.random((B, H, W)) > 0.3
    q = rng.standard_normal((B, 2, D))
    att = make(kind)
    ctx, w = att(q, feats, mask=mask, return_weights=True)
    assert ctx.shape == (B, 2, D) and w.shape == (B, 2, H, W)
    c2, w2 = att(q, feats.reshape(B, H * W, D), mask=mask.reshape(B, -1), return_weights=True)
    np.testing.assert_allclose(ctx, c2, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(w.reshape(B, 2, -1), w2, rtol=1e-12, atol=1e-13)
    mem = att.prepare(feats, mask=mask)
    assert mem.spatial == (H, W)
    c1, w1 = att.step(q[:, 1], mem, return_weights=True)
    assert w1.shape == (B, H, W)
    np.testing.assert_allclose(w1, w[:, 1], rtol=1e-12, atol=1e-13)


def test_combine_weight_luong_attentional_state(seq):
    rng = np.random.default_rng(4)
    Dq, Dv, Dh = 6, 4, 3
    Wc = rng.standard_normal((Dq + Dv, Dh))
    att = attncore.Attention("general", weight=np.eye(6), combine_weight=Wc)
    ctx, state, w = att(seq["q"], seq["k"], seq["vals"], mask=seq["mask"], return_weights=True)
    ref = np.tanh(np.concatenate([seq["q"], ctx], -1) @ Wc)
    np.testing.assert_allclose(state, ref, rtol=1e-12, atol=1e-13)
    ctx1, state1 = att.step(seq["q"][:, 0], att.prepare(seq["k"], seq["vals"], mask=seq["mask"]))
    np.testing.assert_allclose(state1, ref[:, 0], rtol=1e-12, atol=1e-13)
    bad = attncore.Attention("dot", combine_weight=np.ones((3, 2)))
    with pytest.raises(ValueError, match="combine_weight.*Dq \\+ Dv"):
        bad(seq["q"], seq["k"])


def test_dtypes(seq):
    att = make("mlp")
    c = att(seq["q"].astype(np.float16), seq["k"].astype(np.float16))
    assert c.dtype == np.float16
    c = att(seq["q"].astype(np.float32), seq["k"].astype(np.float64))
    assert c.dtype == np.float64
    mem = att.prepare(seq["k"].astype(np.float32))
    c64 = att.step(seq["q"][:, 0], mem)            # float64 query, float32 memory
    assert c64.dtype == np.float64
    with pytest.raises(TypeError, match="query.*float"):
        att(seq["q"].astype(int), seq["k"])
    with pytest.raises(TypeError, match="keys.*float"):
        att(seq["q"], seq["k"].astype(complex))


@pytest.mark.parametrize("kind, pattern", [
    ("dot", "dot: the query dimension \\(Dq = 5\\) must equal the key dimension \\(Dk = 6\\)"),
    ("scaled_dot", "scaled_dot: the query dimension"),
    ("bilinear", "bilinear: the query dimension must be weight.shape\\[0\\] = 6, got Dq = 5"),
    ("mlp", "mlp: the query dimension must be q_weight.shape\\[1\\] = 6, got Dq = 5"),
])
def test_query_key_dim_mismatch(seq, kind, pattern):
    with pytest.raises(ValueError, match=pattern):
        make(kind)(seq["q"][..., :5], seq["k"])


def test_key_dim_mismatch_named(seq):
    with pytest.raises(ValueError, match="bilinear: the key dimension.*weight.shape\\[1\\]"):
        make("bilinear")(seq["q"], seq["k"][..., :5])
    with pytest.raises(ValueError, match="mlp: the key dimension must be k_weight.shape\\[1\\]"):
        make("mlp")(seq["q"], seq["k"][..., :5])
    with pytest.raises(ValueError, match="mlp: the key dimension must be A = len\\(v\\)"):
        attncore.Attention("mlp", v=np.ones(4))(seq["q"][..., :4], seq["k"])


# (id, exception, message pattern naming the argument,
#  (layer, seq) -> the bad call, on the "dot" layer)
BAD_SHAPES_AND_MASKS = [
    ("mask-shape", ValueError, "mask must have shape \\(B, S\\) = \\(3, 7\\)",
     lambda att, s: att(s["q"], s["k"], mask=np.ones((3, 6), bool))),
    ("mask-shape-2d-memory", ValueError, "mask must have shape \\(B, H, W\\)",
     lambda att, s: att(s["q"], s["k"].reshape(3, 7, 1, 6), mask=np.ones((3, 7), bool))),
    ("mask-float", TypeError, "mask must be a bool array",
     lambda att, s: att(s["q"], s["k"], mask=np.ones((3, 7)))),
    ("keys-rank", ValueError, "keys must have shape",
     lambda att, s: att(s["q"], s["k"][0, 0])),           # 2-D keys: a shared memory
    ("query-rank", ValueError, "query must have shape",
     lambda att, s: att(s["q"][0, 0], s["k"])),
    ("values-length", ValueError, "values must have the leading shape",
     lambda att, s: att(s["q"], s["k"], s["vals"][:, :5])),
    ("query-batch", ValueError, "query batch size",
     lambda att, s: att(s["q"][:2], s["k"])),
    ("memory-other-alignment", ValueError, "memory was prepared by .*another alignment",
     lambda att, s: att.step(s["q"][:, 0], make("bilinear").prepare(s["k"]))),
    ("memory-not-Memory", TypeError, "memory must be the Memory",
     lambda att, s: att.step(s["q"][:, 0], s["k"])),
]


@pytest.mark.parametrize("exc, match, call", [c[1:] for c in BAD_SHAPES_AND_MASKS],
                         ids=[c[0] for c in BAD_SHAPES_AND_MASKS])
def test_bad_shapes_and_masks(seq, exc, match, call):
    att = make("dot")
    with pytest.raises(exc, match=match):
        call(att, seq)


def test_mask_of_batch_size_one_broadcasts(seq):
    att = make("dot")
    c = att(seq["q"], seq["k"], mask=seq["mask"][:1])
    c2 = att(seq["q"], seq["k"], mask=np.repeat(seq["mask"][:1], 3, 0))
    np.testing.assert_array_equal(c, c2)


# (id, exception, message pattern naming the parameter, Attention arguments)
BAD_PARAMS = [
    ("mlp-v-missing", TypeError, "'mlp'.*missing parameter 'v'",
     ("mlp",), dict(q_weight=np.ones((3, 3)))),
    ("mlp-q_weight-rows", ValueError, "'q_weight' must have 4 rows",
     ("mlp",), dict(q_weight=np.ones((3, 3)), v=np.ones(4))),
    ("mlp-bias-shape", ValueError, "'bias' must have shape \\(A,\\)",
     ("mlp",), dict(v=np.ones(4), bias=np.ones((4, 1)))),
    ("bilinear-weight-int", TypeError, "'weight'.*dtype int",
     ("bilinear",), dict(weight=np.ones((3, 3), int))),
    ("general-weight-missing", TypeError, "missing parameter 'weight'", ("general",), {}),
    ("dot-scale-str", TypeError, "'scale' must be a real scalar", ("dot",), dict(scale="big")),
    ("scaled_dot-scale", TypeError, "scaled_dot.*unexpected keyword argument 'scale'",
     ("scaled_dot",), dict(scale=2.0)),
    ("unknown-alignment", ValueError, "unknown alignment 'nope'; available: .*bilinear", ("nope",), {}),
]


@pytest.mark.parametrize("exc, match, args, kw", [c[1:] for c in BAD_PARAMS],
                         ids=[c[0] for c in BAD_PARAMS])
def test_bad_params_named(exc, match, args, kw):
    with pytest.raises(exc, match=match):
        attncore.Attention(*args, **kw)


class WrongShape(attncore.Alignment):
    def score(self, query, prepared):
        return np.zeros(query.shape[:2] + (prepared.shape[1] + 1,))


class WrongDtype(attncore.Alignment):
    def score(self, query, prepared):
        return np.zeros(query.shape[:2] + (prepared.shape[1],), dtype=np.int64)


class Raises(attncore.Alignment):
    def score(self, query, prepared):
        raise ValueError("boom")


@pytest.fixture
def plugins():
    names = {"wrong_shape": WrongShape, "wrong_dtype": WrongDtype, "raises": Raises}
    for n, c in names.items():
        alignments.register(n, c)
    yield
    for n in names:
        alignments._registry._unregister(n)


def test_plugin_output_checked_and_named(seq, plugins):
    with pytest.raises(ValueError, match="alignment 'wrong_shape' \\(.*WrongShape\\).*"
                                         "shape \\(B, T, S\\) = \\(3, 5, 7\\), got shape "
                                         "\\(3, 5, 8\\)"):
        attncore.Attention("wrong_shape")(seq["q"], seq["k"])
    with pytest.raises(TypeError, match="alignment 'wrong_dtype'.*real float.*int64"):
        attncore.Attention("wrong_dtype")(seq["q"], seq["k"])
    with pytest.raises(ValueError, match="alignment 'raises' .*score: boom"):
        attncore.Attention("raises")(seq["q"], seq["k"])


def test_plugin_instance_and_nan(seq):
    att = attncore.Attention(Half())
    with pytest.raises(TypeError, match="cannot also be passed"):
        attncore.Attention(Half(), scale=1.0)
    k = seq["k"].copy()
    vals = seq["vals"].copy()
    vals[0, ~seq["mask"][0]] = np.nan          # masked-out values never leak
    ctx = att(seq["q"], k, vals, mask=seq["mask"])
    assert np.isfinite(ctx).all()
    k[1, 3, 0] = np.nan                        # a NaN key that takes part does
    ctx = att(seq["q"], k, vals, mask=seq["mask"])
    assert np.isnan(ctx[1]).all() and np.isfinite(ctx[0]).all()


@pytest.mark.parametrize("kind", ["dot", "scaled_dot", "bilinear", "mlp", "plugin"])
def test_nan_rows_of_layer_weights_span_the_row(path, kind):
    """The rule for NaN rows of weights (NaN across the whole row, as
    scaled_dot_product_attention's, test_kernel_paths.py) in
    attncore.Attention, whose key mask leaves masked keys at weight 0 in
    ordinary rows: a NaN row is NaN there too."""
    rng = np.random.default_rng(41)
    B, T, S, D = 2, 6, 9, 6
    q, k, vals = rng.standard_normal((B, T, D)), rng.standard_normal((B, S, D)), \
        rng.standard_normal((B, S, 4))
    mask = np.ones((B, S), bool)
    mask[:, 6:] = False
    q[1, 2, 0] = np.nan
    if kind == "bilinear":
        att = attncore.Attention(kind, weight=rng.standard_normal((D, D)) * 0.3)
    elif kind == "mlp":
        att = attncore.Attention(kind, q_weight=rng.standard_normal((5, D)) * 0.4,
                                 k_weight=rng.standard_normal((5, D)) * 0.4,
                                 v=rng.standard_normal(5))
    elif kind == "plugin":
        class Half(attncore.Alignment):
            def score(self, query, prepared):
                return np.matmul(query, np.swapaxes(prepared, -1, -2)) / 2
        att = attncore.Attention(Half())
    else:
        att = attncore.Attention(kind)
    ctx, w = att(q, k, vals, mask=mask, return_weights=True)
    assert np.all(np.isnan(w[1, 2])) and np.all(np.isnan(ctx[1, 2]))
    rest = np.ones((B, T), bool)
    rest[1, 2] = False
    assert np.all(np.isfinite(w[rest])) and np.all(w[rest][:, 6:] == 0)


# --------------------------------------------------------------------------
# plot_alignment and the demo
# --------------------------------------------------------------------------
def test_plot_alignment():
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    ax = Figure().add_subplot()
    w = np.eye(3)[None]
    out = attncore.plot_alignment(w, ["a", "b", "c"], ["x", "y", "z"], ax=ax)
    assert out is ax
    assert [t.get_text() for t in ax.get_xticklabels()] == ["a", "b", "c"]
    with pytest.raises(ValueError, match="source_labels must have S = 3"):
        attncore.plot_alignment(np.eye(3), ["a"], ax=ax)
    with pytest.raises(ValueError, match="shape \\(T, S\\)"):
        attncore.plot_alignment(np.ones((2, 2, 2)), ax=ax)
    for bad in (1.5, "abc", np.ones((3, 3))):  # len() leaked a TypeError naming nothing
        with pytest.raises(TypeError, match="source_labels must be a sequence of labels"):
            attncore.plot_alignment(np.eye(3), bad, ax=ax)


def test_plot_alignment_without_matplotlib(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match="attncore\\[plot\\]"):
        attncore.plot_alignment(np.eye(2))


def test_demo_writes_picture_or_skips(tmp_path, monkeypatch, capsys):
    from attncore._demo_alignment import seq2seq_demo

    monkeypatch.chdir(tmp_path)
    try:
        import matplotlib  # noqa: F401
        have = True
    except ImportError:
        have = False
    if have:
        seq2seq_demo()
        assert (tmp_path / "attncore_alignment.png").stat().st_size > 1000
        assert "15 of 15" in capsys.readouterr().out
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    seq2seq_demo()
    assert "picture skipped" in capsys.readouterr().out


def test_concurrent_calls_from_python_threads():
    """The layer releases the GIL in its kernels; concurrent calls agree."""
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(21)
    q = rng.standard_normal((8, 20, 32)).astype(np.float32)
    k = rng.standard_normal((8, 30, 32)).astype(np.float32)
    mask = rng.random((8, 30)) > 0.2
    att = attncore.Attention("mlp", q_weight=rng.standard_normal((16, 32)) * 0.2,
                             k_weight=rng.standard_normal((16, 32)) * 0.2,
                             v=rng.standard_normal(16), num_threads=2)
    ref = att(q, k, mask=mask)
    with ThreadPoolExecutor(4) as ex:
        outs = list(ex.map(lambda _: att(q, k, mask=mask), range(8)))
    for o in outs:
        np.testing.assert_array_equal(o, ref)


def test_dot_scale_must_be_finite_and_memory_must_be_prepared():
    """A non-finite dot scale is refused when the layer is built (the core
    call refuses it too), and a Memory that no prepare made gets the
    TypeError of any other bad memory, not an AttributeError."""
    for bad in (np.inf, -np.inf, np.nan):
        with pytest.raises(ValueError, match="'scale' must be finite"):
            attncore.Attention("dot", scale=bad)
    q, k = np.ones((1, 2, 4)), np.arange(12.0).reshape(1, 3, 4)
    ctx = attncore.Attention("dot", scale=-0.5)(q, k)          # a learned scale may be < 0
    ctx = ctx[0] if isinstance(ctx, tuple) else ctx
    s = -0.5 * (q[0] @ k[0].T)
    w = np.exp(s - s.max(-1, keepdims=True))
    np.testing.assert_allclose(ctx[0], (w / w.sum(-1, keepdims=True)) @ k[0], rtol=1e-12)
    with pytest.raises(TypeError, match="memory must be the Memory returned by "
                                        "Attention.prepare"):
        attncore.Attention("dot").step(np.ones((1, 4)), attncore.Memory())


def _bilinear_ref(q, k, vals, W):
    """float64: softmax(q W k^T) vals (Luong's general score)."""
    return plain_attention(np.asarray(q, np.float64) @ W @ np.swapaxes(k, -1, -2), vals)[0]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_replaced_or_edited_parameters_are_seen_in_every_dtype(seq, dtype):
    """A parameter replaced (assignment) or edited in place (``+=``) after a
    call is used by the next call in every dtype: a copy cast to the other
    dtype was cached on first use and went stale (a silently wrong answer
    in that dtype only)."""
    rng = np.random.default_rng(5)
    q, k, vals = seq["q"], seq["k"], seq["vals"]
    other = np.float64 if dtype == np.float32 else np.float32
    tol = dict(rtol=2e-5, atol=2e-5)
    W = rng.standard_normal((6, 6)) * 0.3
    att = attncore.Attention("bilinear", weight=W.astype(dtype))
    att(q.astype(other), k.astype(other), vals.astype(other))  # a cast made for `other`
    att.alignment.weight = (2 * W).astype(dtype)
    np.testing.assert_allclose(att(q.astype(other), k.astype(other), vals.astype(other)),
                               _bilinear_ref(q, k, vals, att.alignment.weight.astype(np.float64)),
                               **tol)
    att.alignment.weight += 1
    np.testing.assert_allclose(att(q.astype(other), k.astype(other), vals.astype(other)),
                               _bilinear_ref(q, k, vals, att.alignment.weight.astype(np.float64)),
                               **tol)
    Wq, Wk, v = (rng.standard_normal(sh) * 0.4 for sh in ((5, 6), (5, 6), (5,)))
    m = attncore.Attention("mlp", q_weight=Wq.astype(dtype), k_weight=Wk.astype(dtype),
                           v=v.astype(dtype))
    m(q.astype(other), k.astype(other), vals.astype(other))
    m.alignment.v = np.zeros(5, dtype)                          # uniform weights
    m.alignment.q_weight *= 2
    got = m(q.astype(other), k.astype(other), vals.astype(other), return_weights=True)
    np.testing.assert_allclose(got[1], np.full((3, 5, 7), 1 / 7), **tol)
    np.testing.assert_allclose(got[0], np.broadcast_to(vals.mean(1, keepdims=True), got[0].shape),
                               **tol)
    cw = rng.standard_normal((10, 3))
    a = attncore.Attention("dot", combine_weight=cw.astype(dtype))
    a(q.astype(other), k.astype(other)[..., :6], vals.astype(other))
    a.combine_weight = rng.standard_normal((10, 2)).astype(dtype)
    h = a(q.astype(other), k.astype(other), vals.astype(other))
    ctx = plain_attention(q @ np.swapaxes(k, -1, -2), vals)[0]
    want = np.tanh(np.concatenate([q, ctx], -1) @ a.combine_weight.astype(np.float64))
    np.testing.assert_allclose(h[1] if isinstance(h, tuple) else h, want, **tol)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_mlp_with_empty_batches_and_steps(dtype):
    """Zero-size batches, steps or keys give empty (or zero-context) results
    with projection weights, as with every other alignment (a reshape of the
    empty projected queries raised)."""
    rng = np.random.default_rng(2)
    Wq, Wk, v = (rng.standard_normal(sh) for sh in ((6, 4), (6, 4), (6,)))
    m = attncore.Attention("mlp", q_weight=Wq, k_weight=Wk, v=v)
    for qs, ks, want in [((0, 3, 4), (0, 5, 4), (0, 3, 4)), ((0, 3, 4), (5, 4), (0, 3, 4)),
                         ((0, 4), (0, 5, 4), (0, 4)), ((2, 0, 4), (2, 5, 4), (2, 0, 4))]:
        ctx, w = m(np.zeros(qs, dtype), np.zeros(ks, dtype), return_weights=True)
        assert ctx.shape == want and w.shape == want[:-1] + (ks[-2],)
    q, k = rng.standard_normal((2, 3, 4)).astype(dtype), np.zeros((2, 0, 4), dtype)
    ctx, w = m(q, k, return_weights=True)
    assert ctx.shape == (2, 3, 4) and w.shape == (2, 3, 0) and not ctx.any()
    # and a non-empty call still matches the float64 reference
    k = rng.standard_normal((2, 5, 4))
    np.testing.assert_allclose(m(q, k.astype(dtype)), additive_attention(q, k, k, v, Wq, Wk)[0],
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["bilinear", "mlp"])
def test_layer_num_threads_reaches_its_projections(seq, kind, monkeypatch):
    """The layer's ``num_threads`` is the thread count of every dense
    product it runs, the alignment's key and query projections included
    (they ran with OpenMP's default count: ``Attention(...,
    num_threads=1)`` used every core there); the result is the reference's
    all the same."""
    from attncore.alignments import _builtin
    seen = []
    real = _builtin.linear

    def recording(*args, **kw):
        seen.append(kw.get("num_threads"))
        return real(*args, **kw)

    monkeypatch.setattr(_builtin, "linear", recording)
    rng = np.random.default_rng(3)
    q, k, vals, mask = seq["q"], seq["k"], seq["vals"], seq["mask"]
    if kind == "bilinear":
        W = rng.standard_normal((6, 6)) * 0.3
        att = attncore.Attention("bilinear", weight=W, num_threads=3)
        s = q @ W @ np.swapaxes(k, -1, -2)
    else:
        Wq, Wk, v, b = (rng.standard_normal(sh) * 0.4 for sh in ((5, 6), (5, 6), (5,), (5,)))
        att = attncore.Attention("mlp", q_weight=Wq, k_weight=Wk, v=v, bias=b, num_threads=3)
        s = additive_scores(q, k, v, Wq, Wk, b)
    out = att(q, k, vals, mask=mask)
    want = plain_attention(s, vals, mask)[0]
    np.testing.assert_allclose(out, want, rtol=1e-10, atol=1e-12)
    assert seen and all(n == 3 for n in seen), seen
