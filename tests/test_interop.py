"""Arrays of other libraries in, the same array type out (attncore._interop).

References: float64 NumPy (tests/reference.py) and torch's own functions.
"""
import os
import subprocess
import sys

import numpy as np
import pytest

import attncore
import reference as ref

torch = pytest.importorskip("torch")
F = torch.nn.functional

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _rng(seed=0):
    return np.random.default_rng(seed)


def _qkv(B=2, H=4, Hkv=2, L=7, S=9, D=16, dtype=np.float32, seed=0):
    r = _rng(seed)
    q = r.standard_normal((B, H, L, D)).astype(dtype)
    k = r.standard_normal((B, Hkv, S, D)).astype(dtype)
    v = r.standard_normal((B, Hkv, S, D)).astype(dtype)
    return q, k, v


class _Spy:
    """Stands in for the compiled module: records the arrays the kernel gets."""

    def __init__(self, real):
        self._real = real
        self.arrays = []

    def __getattr__(self, name):
        return getattr(self._real, name)

    def sdpa(self, call, *args, **kwargs):
        self.arrays = [a for a in (*call, *args) if isinstance(a, np.ndarray)]
        return self._real.sdpa(call, *args, **kwargs)


@pytest.fixture
def spy(monkeypatch):
    import attncore._call as call  # the one kernel launcher
    s = _Spy(call._sdpa)
    monkeypatch.setattr(call, "_sdpa", s)
    return s


def _shares_any(a, arrays):
    return any(np.shares_memory(a, b) for b in arrays)


# --------------------------------------------------------------------------
# import hygiene
# --------------------------------------------------------------------------
def test_import_attncore_imports_no_framework():
    code = ("import attncore, attncore.integrations, attncore.integrations.transformers, sys; "
            "bad = [m for m in ('torch', 'jax', 'ml_dtypes', 'transformers') if m in sys.modules]; "
            "assert not bad, bad")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=REPO)


# --------------------------------------------------------------------------
# torch
# --------------------------------------------------------------------------
def test_torch_in_torch_out_matches_references():
    q, k, v = _qkv()
    tq, tk, tv = map(torch.from_numpy, (q, k, v))
    out = attncore.scaled_dot_product_attention(tq, tk, tv, is_causal=True, enable_gqa=True)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    expected, _ = ref.attention(q, k, v, causal=1, group=2)
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5, atol=1e-5)
    theirs = F.scaled_dot_product_attention(tq, tk, tv, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, theirs, rtol=1e-5, atol=1e-5)


def test_torch_contiguous_float32_is_not_copied(spy):
    q, k, v = _qkv(Hkv=4)
    tq, tk, tv = map(torch.from_numpy, (q, k, v))
    out = attncore.scaled_dot_product_attention(tq, tk, tv)
    for t in (tq, tk, tv):
        assert _shares_any(t.numpy(), spy.arrays)
    assert _shares_any(out.numpy(), spy.arrays)   # the kernel's output buffer, not a copy


def test_torch_transposed_views_are_read_in_place(spy):
    # (B, L, H, D) projections viewed as (B, H, L, D), as transformers does
    r = _rng(1)
    base = torch.from_numpy(r.standard_normal((2, 11, 4, 8)).astype(np.float32))
    kv = torch.from_numpy(r.standard_normal((2, 13, 4, 8)).astype(np.float32))
    q, k = base.transpose(1, 2), kv.transpose(1, 2)
    assert not q.is_contiguous()
    out = attncore.scaled_dot_product_attention(q, k, k)
    assert _shares_any(base.numpy(), spy.arrays) and _shares_any(kv.numpy(), spy.arrays)
    expected, _ = ref.attention(q.numpy(), k.numpy(), k.numpy())
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5, atol=1e-5)


def test_torch_requires_grad_is_read_detached():
    q, k, v = _qkv(Hkv=4)
    tq = torch.from_numpy(q).requires_grad_()
    tk = torch.from_numpy(k).requires_grad_()
    before = tq.detach().clone()
    out = attncore.scaled_dot_product_attention(tq, tk, torch.from_numpy(v))
    assert isinstance(out, torch.Tensor) and not out.requires_grad
    torch.testing.assert_close(out, F.scaled_dot_product_attention(tq, tk, torch.from_numpy(v))
                               .detach(), rtol=1e-5, atol=1e-5)
    assert torch.equal(tq.detach(), before)      # inputs never modified


def test_torch_float16_and_bfloat16():
    q, k, v = _qkv(Hkv=4)
    for dt, tol in ((torch.float16, 2e-3), (torch.bfloat16, 1.6e-2)):
        tq, tk, tv = (torch.from_numpy(a).to(dt) for a in (q, k, v))
        mask = torch.from_numpy(_rng(2).random((2, 1, 7, 9)) > 0.3)
        out = attncore.scaled_dot_product_attention(tq, tk, tv, mask)
        assert isinstance(out, torch.Tensor) and out.dtype == dt
        # the reference sees the same rounded inputs, in float64
        expected, _ = ref.attention(tq.double().numpy(), tk.double().numpy(),
                                    tv.double().numpy(), mask.numpy())
        np.testing.assert_allclose(out.double().numpy(), expected, rtol=tol, atol=tol)


def test_torch_bfloat16_mixed_with_float32_promotes():
    q, k, v = _qkv(Hkv=4)
    out = attncore.scaled_dot_product_attention(
        torch.from_numpy(q).bfloat16(), torch.from_numpy(k), torch.from_numpy(v))
    assert out.dtype == torch.float32               # as torch promotes bfloat16 + float32


def test_torch_weights_and_masks():
    q, k, v = _qkv(Hkv=4)
    tq, tk, tv = map(torch.from_numpy, (q, k, v))
    mask = torch.from_numpy(_rng(3).random((2, 1, 1, 9)) > 0.5)
    mask[0] = False                                  # a fully masked batch element
    out, w = attncore.scaled_dot_product_attention(tq, tk, tv, mask, return_weights=True)
    assert isinstance(out, torch.Tensor) and isinstance(w, torch.Tensor)
    eo, ew = ref.attention(q, k, v, mask.numpy())
    np.testing.assert_allclose(out.numpy(), eo, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(w.numpy(), ew, rtol=1e-5, atol=1e-6)
    assert not torch.isnan(out).any() and (out[0] == 0).all()


def test_numpy_query_decides_the_output_type():
    q, k, v = _qkv(Hkv=4)
    out = attncore.scaled_dot_product_attention(q, torch.from_numpy(k), torch.from_numpy(v))
    assert type(out) is np.ndarray
    out = attncore.scaled_dot_product_attention(torch.from_numpy(q), k, v.tolist())
    assert isinstance(out, torch.Tensor)
    np.testing.assert_allclose(out.numpy(), ref.attention(q, k, v)[0], rtol=1e-5, atol=1e-5)


def test_device_tensors_are_rejected_with_the_argument_and_device_named():
    q, k, v = map(torch.from_numpy, _qkv(Hkv=4))
    meta = torch.empty(q.shape, device="meta")
    with pytest.raises(TypeError, match=r"query is on device meta"):
        attncore.scaled_dot_product_attention(meta, k, v)
    # mixed devices: a CPU query with a key elsewhere
    with pytest.raises(TypeError, match=r"key is on device meta"):
        attncore.scaled_dot_product_attention(q, torch.empty(k.shape, device="meta"), v)
    with pytest.raises(TypeError, match=r"attn_mask is on device meta"):
        attncore.scaled_dot_product_attention(
            q, k, v, attn_mask=torch.empty((1, 1, 7, 9), dtype=torch.bool, device="meta"))
    mha = attncore.MultiHeadAttention(16, 4, rng=0)
    with pytest.raises(TypeError, match=r"query is on device meta"):
        mha(torch.empty((2, 3, 16), device="meta"))


def test_torch_integer_tensor_is_still_a_clear_type_error():
    q, k, v = _qkv(Hkv=4)
    with pytest.raises(TypeError, match="query must be a (bfloat16, )?float16, float32 or float64"):
        attncore.scaled_dot_product_attention(torch.ones(q.shape, dtype=torch.int32),
                                              torch.from_numpy(k), torch.from_numpy(v))


def test_generic_dlpack_object():
    class Wrapped:                      # a minimal DLPack producer, no array namespace
        def __init__(self, a):
            self._a = a

        def __dlpack__(self, **kw):
            return self._a.__dlpack__(**kw)

        def __dlpack_device__(self):
            return self._a.__dlpack_device__()

    class OnGPU(Wrapped):
        def __dlpack_device__(self):
            return (2, 0)               # kDLCUDA

    q, k, v = _qkv(Hkv=4)
    out = attncore.scaled_dot_product_attention(Wrapped(q), Wrapped(k), Wrapped(v))
    assert type(out) is np.ndarray
    np.testing.assert_allclose(out, ref.attention(q, k, v)[0], rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match=r"value is on device \(2, 0\)"):
        attncore.scaled_dot_product_attention(q, k, OnGPU(v))


def test_ml_dtypes_bfloat16_numpy_arrays():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    q, k, v = (a.astype(ml_dtypes.bfloat16) for a in _qkv(Hkv=4))
    out = attncore.scaled_dot_product_attention(q, k, v)
    assert type(out) is np.ndarray and out.dtype == ml_dtypes.bfloat16
    expected, _ = ref.attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64))
    np.testing.assert_allclose(out.astype(np.float64), expected, rtol=1.6e-2, atol=1.6e-2)


# --------------------------------------------------------------------------
# JAX
# --------------------------------------------------------------------------
def test_jax_in_jax_out():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    q, k, v = _qkv()
    jq, jk, jv = map(jnp.asarray, (q, k, v))
    out = attncore.scaled_dot_product_attention(jq, jk, jv, is_causal="lower_right",
                                                enable_gqa=True)
    assert isinstance(out, jax.Array) and out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), ref.attention(q, k, v, causal=2, group=2)[0],
                               rtol=1e-5, atol=1e-5)
    ob = attncore.scaled_dot_product_attention(jq.astype(jnp.bfloat16), jk.astype(jnp.bfloat16),
                                               jv.astype(jnp.bfloat16), enable_gqa=True)
    assert isinstance(ob, jax.Array) and ob.dtype == jnp.bfloat16


def test_jax_float32_is_not_copied(spy):
    jax = pytest.importorskip("jax")
    q, k, v = _qkv(Hkv=4)
    jq, jk, jv = map(jax.numpy.asarray, (q, k, v))
    attncore.scaled_dot_product_attention(jq, jk, jv)
    for a in (jq, jk, jv):
        assert _shares_any(np.asarray(a), spy.arrays)


# --------------------------------------------------------------------------
# layers and positional encoding
# --------------------------------------------------------------------------
def test_multihead_attention_torch_in_torch_out():
    torch.manual_seed(0)
    tm = torch.nn.MultiheadAttention(16, 4, batch_first=True).eval()
    mha = attncore.MultiHeadAttention.from_torch(tm)
    x = torch.randn(2, 5, 16, requires_grad=True)
    mem = torch.randn(2, 6, 16)
    with torch.no_grad():
        e_self, e_w = tm(x, x, x, need_weights=True)
        e_cross, _ = tm(x, mem, mem)
    out, w = mha(x, need_weights=True)
    assert isinstance(out, torch.Tensor) and isinstance(w, torch.Tensor)
    torch.testing.assert_close(out, e_self, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w, e_w, rtol=1e-5, atol=1e-6)
    out, _ = mha(x, mem)
    torch.testing.assert_close(out, e_cross, rtol=1e-5, atol=1e-5)
    # bfloat16 input: computed in the layer's dtype, returned in it (as float16 is)
    out, _ = mha(x.bfloat16())
    assert out.dtype == torch.float32


def test_multihead_attention_caches_with_torch_tensors():
    torch.manual_seed(1)
    tm = torch.nn.MultiheadAttention(16, 4, batch_first=True).eval()
    mha = attncore.MultiHeadAttention.from_torch(tm)
    x = torch.randn(1, 6, 16)
    mem = torch.randn(1, 5, 16)
    causal = torch.ones(6, 6).triu(1).bool()          # torch's polarity: True = masked
    with torch.no_grad():
        e_self, _ = tm(x, x, x, attn_mask=causal)
        e_cross, _ = tm(x, mem, mem)
    cache = mha.new_cache(1, 6)
    steps = [mha(x[:, t:t + 1], cache=cache, is_causal="lower_right")[0] for t in range(6)]
    torch.testing.assert_close(torch.cat(steps, 1), e_self, rtol=1e-5, atol=1e-5)
    cross = mha.new_cache(1, 5)
    # the same memory tensor passed again is recognised as the cached memory
    steps = [mha(x[:, t:t + 1], mem, cache=cross)[0] for t in range(6)]
    torch.testing.assert_close(torch.cat(steps, 1), e_cross, rtol=1e-5, atol=1e-5)


def test_attention_layer_torch_and_jax():
    r = _rng(4)
    q = r.standard_normal((2, 3, 8)).astype(np.float32)
    keys = r.standard_normal((2, 6, 8)).astype(np.float32)
    mask = r.random((2, 6)) > 0.3
    att = attncore.Attention("scaled_dot")
    expected = ref.attention(q, keys, keys, mask[:, None, :])
    ctx, w = att(torch.from_numpy(q).requires_grad_(), torch.from_numpy(keys),
                 mask=torch.from_numpy(mask), return_weights=True)
    assert isinstance(ctx, torch.Tensor) and isinstance(w, torch.Tensor)
    np.testing.assert_allclose(ctx.numpy(), expected[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(w.numpy(), expected[1], rtol=1e-5, atol=1e-6)
    memory = att.prepare(torch.from_numpy(keys), mask=torch.from_numpy(mask))
    step = att.step(torch.from_numpy(q[:, 0]), memory)
    assert isinstance(step, torch.Tensor)
    np.testing.assert_allclose(step.numpy(), expected[0][:, 0], rtol=1e-5, atol=1e-5)
    step = att.step(torch.from_numpy(q[:, 0]).bfloat16(), memory)
    assert step.dtype == torch.bfloat16
    jax = pytest.importorskip("jax")
    ctx = att(jax.numpy.asarray(q), keys, mask=mask)
    assert isinstance(ctx, jax.Array)
    np.testing.assert_allclose(np.asarray(ctx), expected[0], rtol=1e-5, atol=1e-5)


def test_positional_encoding_types_and_dtypes():
    pos = torch.arange(3, 8)
    pe = attncore.sinusoidal_encoding(pos, 6)
    assert isinstance(pe, torch.Tensor) and pe.dtype == torch.float32
    p = np.arange(3, 8, dtype=np.float64)[:, None]
    inv = 10000.0 ** (-np.arange(0, 6, 2) / 6)
    expected = np.empty((5, 6))
    expected[:, 0::2] = np.sin(p * inv)
    expected[:, 1::2] = np.cos(p * inv)
    np.testing.assert_allclose(pe.numpy(), expected, rtol=1e-6, atol=1e-6)
    pe = attncore.sinusoidal_encoding(5, 6, dtype=torch.float64)
    assert isinstance(pe, torch.Tensor) and pe.dtype == torch.float64
    assert attncore.sinusoidal_encoding(5, 6, dtype=torch.bfloat16).dtype == torch.bfloat16
    x = torch.zeros(2, 5, 6, dtype=torch.bfloat16)
    y = attncore.add_positional_encoding(x, offset=3)
    assert isinstance(y, torch.Tensor) and y.dtype == torch.bfloat16
    np.testing.assert_allclose(y[0].double().numpy(), expected, rtol=1e-2, atol=1e-2)
    assert (x == 0).all()


def test_plot_alignment_takes_a_tensor_that_requires_grad():
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    ax = Figure().add_subplot()
    w = torch.eye(3).requires_grad_()
    assert attncore.plot_alignment(w, ax=ax) is ax
    np.testing.assert_array_equal(ax.images[0].get_array(), np.eye(3))


def test_issue21_reused_neg_view_is_recomputed_and_requires_grad_scales():
    """A resolved neg / conj view is never served from the cache after its
    source changes in place; an int8 pair whose scales require grad is read
    detached like any other input; return_lse=np.True_ keeps the lse float32."""
    torch = pytest.importorskip("torch")
    sd = attncore.scaled_dot_product_attention
    z = torch.randn(5, 4, dtype=torch.complex64)
    qn = z.conj().imag
    k, v = torch.randn(6, 4), torch.randn(6, 3)
    r1 = sd(qn, k, v)
    z.mul_(3.0)
    r2 = sd(qn, k, v)
    ref = torch.nn.functional.scaled_dot_product_attention(qn.resolve_neg(), k, v)
    torch.testing.assert_close(r2, ref, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(r1, r2)
    k8, ks = attncore.quantize_kv(k.numpy())
    pair = (torch.from_numpy(k8), torch.from_numpy(ks).requires_grad_())
    out = sd(torch.randn(2, 4), pair, v)
    assert isinstance(out, torch.Tensor)
    qb = torch.randn(3, 4).to(torch.bfloat16)
    o, lse = sd(qb, qb, qb, return_lse=np.True_)
    assert o.dtype is torch.bfloat16 and lse.dtype is torch.float32


def test_dask_module_without_dask_names_the_extra(tmp_path):
    """``import attncore.dask`` without Dask says which extra to install (a
    bare "No module named 'dask'" before), like the plot and transformers
    extras.  A dask package that fails to import stands in for a missing one."""
    fake = tmp_path / "dask"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('dask is not installed here')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(tmp_path)] + [p for p in sys.path if p]))
    r = subprocess.run([sys.executable, "-c", "import attncore.dask"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "pip install 'attncore[dask]'" in r.stderr, r.stderr


def test_every_spelling_of_a_storage_dtype_is_one_name():
    """The one parser of storage dtype arguments (layers, caches, rotary,
    interop): a string, a NumPy / ml_dtypes / JAX dtype or scalar type and
    a torch dtype name the same dtype; bfloat16 is recognized in each
    spelling and in an array's ``.dtype``; anything else names nothing."""
    from attncore._dtypes import is_bf16_arg, storage_name

    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf16 = ["bfloat16", torch.bfloat16, ml_dtypes.bfloat16, np.dtype(ml_dtypes.bfloat16),
            torch.zeros(1, dtype=torch.bfloat16).dtype,
            np.zeros(1, ml_dtypes.bfloat16).dtype]
    for d in bf16:
        assert storage_name(d) == "bfloat16" and is_bf16_arg(d), d
    for want, spellings in (("float16", ["float16", np.float16, np.dtype("f2"), torch.float16]),
                            ("float32", [None, "float32", np.float32, torch.float32]),
                            ("float64", [float, np.float64, torch.float64])):
        for d in spellings:
            assert storage_name(d) == want and not is_bf16_arg(d), d
    assert storage_name(object()) is None and not is_bf16_arg(object())
    assert storage_name(None, None) is None and not is_bf16_arg(None)
