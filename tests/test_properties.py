"""Property tests (hypothesis): scaled_dot_product_attention against the
plain float64 reference over shapes, broadcasting, grouped-query heads,
memory layouts, masks, causal alignments, scales, dtypes and thread counts.

Profiles (``ATTNCORE_HYPOTHESIS_PROFILE``):

* ``ci`` (default): a few hundred examples in total, derandomized, well
  under a minute;
* ``long``: thousands of random examples for a deeper run, e.g.
  ``ATTNCORE_HYPOTHESIS_PROFILE=long pytest tests/test_properties.py``.
"""
import os

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.extra import numpy as hnp  # noqa: E402

import attncore  # noqa: E402
from attncore import scaled_dot_product_attention as sdpa  # noqa: E402

from reference import additive_attention  # noqa: E402
from reference import attention as ref  # noqa: E402

settings.register_profile(
    "ci", max_examples=100, deadline=None, derandomize=True, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile(
    "long", max_examples=3000, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
PROFILE = os.environ.get("ATTNCORE_HYPOTHESIS_PROFILE", "ci")
settings.load_profile(PROFILE)
# the main property gets more of the budget than the side ones
MAIN_EXAMPLES = settings.default.max_examples * 4

DTYPES = [np.float16, np.float32, np.float64]
LAYOUTS = ["C", "fortran", "transposed", "negative", "row_step", "step2", "unaligned",
           "read_only", "batch_stride0", "row_stride0"]


# ------------------------------------------------------------------ helpers
def realize(x, layout):
    """An array with the values of ``x`` (or, for the stride-0 layouts, of
    ``x`` broadcast from its first row / batch element) in ``layout``."""
    x = np.asarray(x)
    if layout == "C":
        return np.ascontiguousarray(x)
    if layout == "fortran":
        return np.asfortranarray(x)
    if layout == "transposed":
        return np.swapaxes(np.ascontiguousarray(np.swapaxes(x, -1, -2)), -1, -2)
    if layout == "negative":
        return np.ascontiguousarray(x[..., ::-1, ::-1])[..., ::-1, ::-1]
    if layout == "row_step":
        big = np.zeros(x.shape[:-2] + (2 * x.shape[-2], x.shape[-1]), x.dtype)
        big[..., ::2, :] = x
        return big[..., ::2, :]
    if layout == "step2":
        big = np.zeros(x.shape[:-2] + (2 * x.shape[-2], 2 * x.shape[-1]), x.dtype)
        big[..., ::2, ::2] = x
        return big[..., ::2, ::2]
    if layout == "unaligned":
        raw = np.zeros(x.nbytes + 1, np.uint8)
        out = np.frombuffer(raw.data, x.dtype, count=x.size, offset=1).reshape(x.shape)
        out[...] = x
        return out
    if layout == "read_only":
        out = x.copy()
        out.flags.writeable = False
        return out
    if layout == "batch_stride0" and x.ndim > 2 and x.shape[0] > 0:
        return np.broadcast_to(x[:1], x.shape)
    if layout == "row_stride0" and x.shape[-2] > 0:
        return np.broadcast_to(x[..., :1, :], x.shape)
    return x


def tolerance(result_dtype, compute_dtype, scale_of_values):
    if result_dtype == np.float16:
        tol = 4e-3
    elif compute_dtype == np.float32:
        tol = 1e-4
    else:
        tol = 1e-9
    return dict(rtol=tol, atol=tol * max(1.0, scale_of_values))


def reference(q, k, v, mask, causal, scale, group):
    """(out, weights) in float64, broadcast to the batch shape of every
    operand (the mask's included)."""
    N, M, Dv = q.shape[-2], k.shape[-2], v.shape[-1]
    if group > 1:
        k = np.repeat(np.asarray(k, np.float64), group, axis=-3)
        v = np.repeat(np.asarray(v, np.float64), group, axis=-3)
    shapes = [q.shape[:-2], k.shape[:-2], v.shape[:-2]]
    if mask is not None:
        m = np.asarray(mask)
        shapes.append(m.reshape((1,) * max(0, 2 - m.ndim) + m.shape).shape[:-2])
    bshape = np.broadcast_shapes(*shapes)
    out, w = ref(q, k, v, mask, causal, scale)
    return (np.broadcast_to(out, bshape + (N, Dv)), np.broadcast_to(w, bshape + (N, M)))


# ------------------------------------------------------------------ strategies
@st.composite
def problems(draw):
    """One call: arrays (already laid out), keyword arguments and what the
    reference needs."""
    gqa = draw(st.booleans())
    small = draw(st.integers(0, 9))
    if small == 0:          # now and then a size that reaches the BLAS / split-KV paths
        N = draw(st.sampled_from([1, 2, 70]))
        M = draw(st.sampled_from([300, 1100]))
        D = draw(st.sampled_from([8, 33]))
        Dv = draw(st.sampled_from([1, 16]))
    else:
        N = draw(st.integers(0, 7))
        M = draw(st.integers(0, 7))
        D = draw(st.integers(1, 5))
        Dv = draw(st.integers(0, 4))
    big = N * M > 200
    shapes = draw(hnp.mutually_broadcastable_shapes(
        num_shapes=4, min_dims=0, max_dims=1 if big else 3, max_side=2 if big else 3))
    bq, bk, bv, bm = shapes.input_shapes
    group = 1
    if gqa:
        Hk = draw(st.integers(1, 2))
        group = draw(st.integers(1, 3))
        bq, bk, bv = bq + (Hk * group,), bk + (Hk,), bv + (Hk,)
        bm = bm + (draw(st.sampled_from([1, Hk * group])),)
    dq, dk, dv = (np.dtype(draw(st.sampled_from(DTYPES))) for _ in range(3))
    if draw(st.booleans()):     # mostly one dtype
        dk = dv = dq
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    q = rng.uniform(-2, 2, bq + (N, D)).astype(dq)
    k = rng.uniform(-2, 2, bk + (M, D)).astype(dk)
    v = rng.uniform(-3, 3, bv + (M, Dv)).astype(dv)

    mask_kind = draw(st.sampled_from([None, "bool", "float", "neginf"]))
    mask = None
    if mask_kind is not None:
        rows = draw(st.sampled_from([N, 1]))
        cols = draw(st.sampled_from([M, 1]))
        mshape = bm + (rows, cols)
        if not bm and draw(st.integers(0, 4)) == 0:   # lower ranks: (M,), (1,), ()
            mshape = draw(st.sampled_from([(cols,), ()]))
        p = draw(st.sampled_from([0.0, 0.3, 0.8, 1.0]))     # share of entries taking part
        keep = np.asarray(rng.random(mshape) < p)
        if mask_kind == "bool":
            mask = keep
        else:
            mdt = draw(st.sampled_from(DTYPES))
            vals = rng.uniform(-2, 2, mshape) if mask_kind == "float" else np.zeros(mshape)
            mask = np.where(keep, vals, -np.inf).astype(mdt)
        mask = realize(mask, draw(st.sampled_from(["C", "unaligned", "read_only"])))

    layouts = [draw(st.sampled_from(LAYOUTS)) for _ in range(3)]
    q, k, v = (realize(a, lay) for a, lay in zip((q, k, v), layouts))
    causal = draw(st.sampled_from([False, True, "upper_left", "lower_right"]))
    scale = draw(st.one_of(st.none(), st.floats(0.05, 3.0)))
    return dict(
        q=q, k=k, v=v, mask=mask, gqa=gqa, group=group, layouts=layouts,
        causal=causal, causal_code={False: 0, True: 1, "upper_left": 1, "lower_right": 2}[causal],
        scale=scale, return_weights=draw(st.booleans()),
        num_threads=draw(st.sampled_from([None, 1, 2, 3])))


# ------------------------------------------------------------------ properties
@settings(max_examples=MAIN_EXAMPLES)
@given(problems())
def test_sdpa_matches_reference(p):
    q, k, v, mask = p["q"], p["k"], p["v"], p["mask"]
    before = [None if a is None else np.array(a, copy=True) for a in (q, k, v, mask)]
    res = sdpa(q, k, v, mask, is_causal=p["causal"], scale=p["scale"], enable_gqa=p["gqa"],
               return_weights=p["return_weights"], num_threads=p["num_threads"])
    out, w = res if p["return_weights"] else (res, None)

    # inputs never modified
    for a, b in zip((q, k, v, mask), before):
        if a is not None:
            np.testing.assert_array_equal(a, b)

    rdt = np.result_type(q.dtype, k.dtype, v.dtype)
    cdt = np.float32 if rdt == np.float16 else rdt
    group = p["group"] if p["gqa"] else 1
    scale = p["scale"]
    out_ref, w_ref = reference(q, k, v, mask, p["causal_code"], scale, group)
    assert out.dtype == rdt and out.shape == out_ref.shape
    tol = tolerance(rdt, cdt, float(np.abs(v).max()) if v.size else 1.0)
    np.testing.assert_allclose(out, out_ref, **tol)
    if w is not None:
        assert w.dtype == rdt and w.shape == w_ref.shape
        np.testing.assert_allclose(w, w_ref, **tolerance(rdt, cdt, 1.0))
        # every row sums to 1 or is all 0 (nothing to attend)
        if w.size:
            sums = w.astype(np.float64).sum(axis=-1)
            empty = (w == 0).all(axis=-1)
            ok = empty | np.isclose(sums, 1.0, rtol=0, atol=tolerance(rdt, cdt, 1.0)["rtol"] * 10)
            assert ok.all(), sums[~ok]
            assert (w >= 0).all()


@given(problems(), st.sampled_from([1, 2, 3]))
def test_thread_count_does_not_change_results(p, threads):
    q, k, v, mask = p["q"], p["k"], p["v"], p["mask"]
    kw = dict(is_causal=p["causal"], scale=p["scale"], enable_gqa=p["gqa"],
              return_weights=p["return_weights"])
    a = sdpa(q, k, v, mask, num_threads=1, **kw)
    b = sdpa(q, k, v, mask, num_threads=threads, **kw)
    a, b = (a, b) if p["return_weights"] else ((a,), (b,))
    rdt = np.result_type(q.dtype, k.dtype, v.dtype)
    cdt = np.float32 if rdt == np.float16 else rdt
    for x, y in zip(a, b):
        np.testing.assert_allclose(x, y, **tolerance(rdt, cdt, float(np.abs(v).max()) if v.size else 1.0))


@st.composite
def layer_inputs(draw):
    B = draw(st.integers(1, 3))
    L = draw(st.integers(1, 6))
    S = draw(st.integers(1, 6))
    H = draw(st.sampled_from([1, 2]))
    hd = draw(st.integers(1, 4))
    dtype = np.dtype(draw(st.sampled_from([np.float32, np.float64])))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1, 1, (B, L, H * hd)).astype(dtype)
    mem = rng.uniform(-1, 1, (B, S, H * hd)).astype(dtype)
    key_mask = rng.random((B, S)) < draw(st.sampled_from([0.0, 0.5, 1.0]))
    return dict(x=realize(x, draw(st.sampled_from(LAYOUTS))),
                mem=realize(mem, draw(st.sampled_from(LAYOUTS))),
                key_mask=key_mask, H=H, hd=hd, dtype=dtype, seed=seed,
                causal=draw(st.booleans()), need_weights=draw(st.booleans()))


@given(layer_inputs())
def test_mha_matches_reference(p):
    """MultiHeadAttention (projections + attention) against float64 NumPy."""
    H, hd, dt = p["H"], p["hd"], p["dtype"]
    E = H * hd
    mha = attncore.MultiHeadAttention(E, H, rng=p["seed"], dtype=dt)
    x, mem, km = p["x"], p["mem"], p["key_mask"]
    before = (x.copy(), mem.copy())
    out, w = mha(x, mem, key_mask=km, is_causal=p["causal"], need_weights=p["need_weights"])
    np.testing.assert_array_equal(x, before[0])
    np.testing.assert_array_equal(mem, before[1])

    f = np.float64
    B, L, _ = x.shape
    S = mem.shape[1]
    qp = x.astype(f) @ mha.q_weight.astype(f).T + mha.q_bias
    kp = mem.astype(f) @ mha.k_weight.astype(f).T + mha.k_bias
    vp = mem.astype(f) @ mha.v_weight.astype(f).T + mha.v_bias
    split = lambda a, n: a.reshape(B, n, H, hd).transpose(0, 2, 1, 3)  # noqa: E731
    o, wr = ref(split(qp, L), split(kp, S), split(vp, S), km[:, None, None, :],
                causal=1 if p["causal"] else 0)
    o = o.transpose(0, 2, 1, 3).reshape(B, L, E) @ mha.out_weight.astype(f).T + mha.out_bias
    tol = dict(rtol=1e-4, atol=1e-5) if dt == np.float32 else dict(rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(out, o, **tol)
    if p["need_weights"]:
        np.testing.assert_allclose(w, wr.mean(axis=1), **tol)
    else:
        assert w is None


@st.composite
def alignment_inputs(draw):
    B, T, S = draw(st.integers(1, 3)), draw(st.integers(1, 5)), draw(st.integers(1, 6))
    D, A = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    dtype = np.dtype(draw(st.sampled_from([np.float32, np.float64])))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    params = dict(q_weight=rng.uniform(-1, 1, (A, D)), k_weight=rng.uniform(-1, 1, (A, D)),
                  v=rng.uniform(-1, 1, A), bias=rng.uniform(-1, 1, A))
    q = rng.uniform(-2, 2, (B, T, D)).astype(dtype)
    keys = rng.uniform(-2, 2, (B, S, D)).astype(dtype)
    vals = rng.uniform(-2, 2, (B, S, 3)).astype(dtype)
    mask = rng.random((B, S)) < draw(st.sampled_from([0.0, 0.5, 1.0]))
    lay = [draw(st.sampled_from(LAYOUTS)) for _ in range(3)]
    return dict(params=params, q=realize(q, lay[0]), keys=realize(keys, lay[1]),
                vals=realize(vals, lay[2]), mask=mask, dtype=dtype)


@given(alignment_inputs())
def test_additive_attention_matches_reference(p):
    """Attention("mlp") (the fused additive kernel) against float64 NumPy."""
    att = attncore.Attention("mlp", **p["params"])
    ctx, w = att(p["q"], p["keys"], p["vals"], mask=p["mask"], return_weights=True)
    pr = p["params"]
    ctx_ref, w_ref = additive_attention(p["q"], p["keys"], p["vals"], pr["v"], pr["q_weight"],
                                        pr["k_weight"], pr["bias"], p["mask"])
    tol = dict(rtol=2e-4, atol=2e-5) if p["dtype"] == np.float32 else dict(rtol=1e-9, atol=1e-11)
    np.testing.assert_allclose(w, w_ref, **tol)
    np.testing.assert_allclose(ctx, ctx_ref, **tol)
