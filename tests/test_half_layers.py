"""16-bit layers: MultiHeadAttention(dtype="bfloat16" / float16), its KV
cache, linear with 16-bit weights read in place, the Attention layer with
16-bit memories -- against float64 references of the rounded weights and
inputs, and against torch on the same dtype."""
import numpy as np
import pytest

import attncore
from attncore import _kernels
from attncore._core import _sdpa
from attncore._linear import linear

from reference import sdpa_ref

ml_dtypes = pytest.importorskip("ml_dtypes")
BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
HALF = [pytest.param(BF16, id="bf16"), pytest.param(F16, id="f16")]
ULP = {BF16: 2.0 ** -8, F16: 2.0 ** -11}



@pytest.mark.parametrize("dt", HALF)
@pytest.mark.parametrize("R,C,K", [(1, 100, 37), (5, 130, 64), (70, 200, 96), (300, 257, 512),
                                   # columns converted 64 at a time (wide K) and a
                                   # thread's whole block at once (narrow K)
                                   (40, 300, 2100), (600, 1000, 64),
                                   # many rows on two threads: w converted by the team
                                   # in chunks of up to 4 MiB (two here: 2016 + 84 rows)
                                   (70, 2100, 520)])
def test_linear_with_half_weights(path, dt, R, C, K):
    rng = np.random.default_rng(R + C + K)
    x = rng.standard_normal((R, K)).astype(np.float32)
    w = rng.standard_normal((C, K)).astype(dt)
    b = rng.standard_normal(C).astype(np.float32)
    w0 = w.copy()
    r = x.astype(np.float64) @ w.astype(np.float64).T + b
    for nt in (1, 2):
        # float32 products (a CPU that takes bf16 products by default, AMD's
        # AVX512_BF16: test_linear_bf16_products)
        out = linear(x, w, b, num_threads=nt, precision="float32")
        assert out.dtype == np.float32
        np.testing.assert_allclose(out, r, rtol=0, atol=2e-5 * np.abs(r).max())
    assert np.array_equal(w.view(np.uint16), w0.view(np.uint16))


def _layers(dt, E=64, H=4, Hkv=2, seed=0):
    """A 16-bit layer and a float64 layer holding the same (rounded) weights."""
    rng = np.random.default_rng(seed)
    hd = E // H
    ws = dict(q_weight=rng.standard_normal((E, E)) * 0.2,
              k_weight=rng.standard_normal((Hkv * hd, E)) * 0.2,
              v_weight=rng.standard_normal((Hkv * hd, E)) * 0.2,
              out_weight=rng.standard_normal((E, E)) * 0.2,
              q_bias=rng.standard_normal(E) * 0.1, out_bias=rng.standard_normal(E) * 0.1)
    ws = {k: v.astype(np.float32).astype(dt) if k.endswith("weight") else v.astype(np.float32)
          for k, v in ws.items()}
    half = attncore.MultiHeadAttention.from_arrays(**ws, num_heads=H, num_kv_heads=Hkv)
    # float32 products (bf16 ones, the default on AMD's AVX512_BF16, are held to
    # torch's bf16 error in test_bf16_from_torch_matches_torch_bf16)
    half.precision = "float32"
    ref = attncore.MultiHeadAttention.from_arrays(
        **{k: v.astype(np.float64) for k, v in ws.items()}, num_heads=H, num_kv_heads=Hkv)
    return half, ref


@pytest.mark.parametrize("dt", HALF)
def test_mha_half_layer_matches_float64_of_the_rounded_weights(path, dt):
    half, ref = _layers(dt)
    assert half.dtype == dt and half.q_weight.dtype == dt
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 20, 64)).astype(np.float32)
    for kw in (dict(), dict(is_causal=True), dict(key_mask=np.arange(20) < np.array([[20], [15], [7]]))):
        out, _ = half(x, **kw)
        r, _ = ref(x.astype(np.float64), **kw)
        assert out.dtype == dt and out.shape == r.shape
        # the output rounding, and a float32 computation
        np.testing.assert_allclose(out.astype(np.float64), r, rtol=0,
                                   atol=2 * ULP[dt] * np.abs(r).max() + 1e-5)
    out, w = half(x.astype(dt), need_weights=True)   # 16-bit inputs too
    assert out.dtype == dt and w.dtype == dt


@pytest.mark.parametrize("dt", HALF)
def test_half_cache_decoding_reorder_crop(dt):
    half, ref = _layers(dt, seed=2)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 12, 64)).astype(np.float32)
    cache = half.new_cache(batch_size=2, max_length=16)
    c32 = attncore.MultiHeadAttention(64, 4, num_kv_heads=2).new_cache(2, 16)
    assert cache.keys.dtype == dt and cache.nbytes == c32.nbytes // 2
    steps = [half(x[:, t:t + 1], cache=cache, is_causal="lower_right")[0] for t in range(12)]
    full, _ = ref(x.astype(np.float64), is_causal=True)
    got = np.concatenate(steps, axis=1).astype(np.float64)
    # keys / values are stored rounded to the layer's dtype
    np.testing.assert_allclose(got, full, rtol=0, atol=8 * ULP[dt] * np.abs(full).max())
    cache.reorder([1, 0])
    cache.crop(8)
    assert len(cache) == 8 and cache.keys.dtype == dt
    nxt, _ = half(x[::-1, 8:9], cache=cache, is_causal="lower_right")
    r, _ = ref(x[::-1, :9].astype(np.float64), is_causal=True)
    np.testing.assert_allclose(nxt[:, 0].astype(np.float64), r[:, 8], rtol=0,
                               atol=8 * ULP[dt] * np.abs(r).max())
    q8 = half.new_cache(batch_size=2, max_length=16, dtype="int8")
    steps = [half(x[:, t:t + 1], cache=q8, is_causal="lower_right")[0] for t in range(12)]
    np.testing.assert_allclose(np.concatenate(steps, 1).astype(np.float64), full, atol=2e-2 * np.abs(full).max())


@pytest.fixture
def bf16_products():
    """bfloat16 products of the dense layers on (the AVX-512F spelling of
    vdpbf16ps where the CPU lacks AVX512_BF16)."""
    if "avx512" not in _kernels.available_kernel_paths():
        pytest.skip("needs AVX-512")
    native = _sdpa.cpu_features()["bf16_dot"]
    prev = _sdpa.set_bf16_mode("native" if native else "emulate")
    try:
        with _kernels.forced_kernel_path("avx512"):  # also under a forced test path
            yield
    finally:
        _sdpa.set_bf16_mode(prev)


@pytest.mark.parametrize("R,C,K", [(9, 100, 64), (70, 200, 96), (300, 257, 512), (40, 64, 37)])
def test_linear_bf16_products(bf16_products, R, C, K):
    """bfloat16 weights on a CPU with bf16 products: the rows of x are
    rounded to bfloat16 and the products summed in float32 (odd K: float32
    products); precision="float32" keeps float32 products."""
    rng = np.random.default_rng(R + C + K)
    x = rng.standard_normal((R, K)).astype(np.float32)
    w = rng.standard_normal((C, K)).astype(BF16)
    b = rng.standard_normal(C).astype(np.float32)
    exact = x.astype(np.float64) @ w.astype(np.float64).T + b
    rounded = x.astype(BF16).astype(np.float64) @ w.astype(np.float64).T + b
    for nt in (1, 2):
        out = linear(x, w, b, num_threads=nt)
        want = exact if K % 2 else rounded
        np.testing.assert_allclose(out, want, rtol=0, atol=2e-5 * np.abs(want).max())
    if K % 2 == 0:
        assert np.abs(out - exact).max() > 1e-3 * np.abs(exact).max()
    out32 = linear(x, w, b, precision="float32")
    np.testing.assert_allclose(out32, exact, rtol=0, atol=2e-5 * np.abs(exact).max())


@pytest.mark.parametrize("products", ["float32", "bf16"])
def test_bf16_from_torch_matches_torch_bf16(request, products):
    if products == "bf16":
        request.getfixturevalue("bf16_products")
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    tm = torch.nn.MultiheadAttention(64, 4, batch_first=True).to(torch.bfloat16).eval()
    layer = attncore.MultiHeadAttention.from_torch(tm)
    assert str(layer.dtype) == "bfloat16"
    x = torch.randn(2, 9, 64).to(torch.bfloat16)
    with torch.no_grad():
        out, _ = layer(x)
        t16, _ = tm(x, x, x, need_weights=False)
        t64, _ = tm.double()(x.double(), x.double(), x.double(), need_weights=False)
    assert isinstance(out, torch.Tensor) and out.dtype is torch.bfloat16
    err = (out.double() - t64).abs().max().item()
    assert err <= 1.5 * (t16.double() - t64).abs().max().item() + 1e-6


@pytest.mark.parametrize("dt", HALF)
def test_attention_layer_with_half_memory_and_query(dt):
    rng = np.random.default_rng(4)
    keys = rng.standard_normal((2, 15, 32)).astype(dt)
    q = rng.standard_normal((2, 3, 32)).astype(dt)
    att = attncore.Attention("scaled_dot")
    out = att(q, keys)
    r = sdpa_ref(q, keys, keys)
    assert out.dtype == dt
    np.testing.assert_allclose(out.astype(np.float64), r, atol=2 * ULP[dt] * np.abs(r).max())
    mem = att.prepare(keys)
    np.testing.assert_allclose(att.step(q, mem).astype(np.float64), r,
                               atol=2 * ULP[dt] * np.abs(r).max())


def test_layer_dtype_errors():
    with pytest.raises(TypeError, match="dtype must be float32, float64, float16 or bfloat16"):
        attncore.MultiHeadAttention(64, 4, dtype=np.int8)
    with pytest.raises(TypeError, match="dtype must be float32, float64, float16 or bfloat16"):
        attncore.MultiHeadAttention(64, 4, dtype="float8")


def test_mha_alibi_and_precision():
    """The layer's ALiBi slopes reach the kernel: equal to the core call on
    the layer's own projections; cached decoding continues the distances."""
    rng = np.random.default_rng(5)
    mha = attncore.MultiHeadAttention(32, 4, rng=0, alibi_slopes=[0.5, 0.25, 0.125, 0.0625],
                                      precision="float32")
    x = rng.standard_normal((2, 7, 32)).astype(np.float32)
    out, _ = mha(x, is_causal=True)
    q = (x @ mha.q_weight.T + mha.q_bias).reshape(2, 7, 4, 8).transpose(0, 2, 1, 3)
    k = (x @ mha.k_weight.T + mha.k_bias).reshape(2, 7, 4, 8).transpose(0, 2, 1, 3)
    v = (x @ mha.v_weight.T + mha.v_bias).reshape(2, 7, 4, 8).transpose(0, 2, 1, 3)
    p_v = sdpa_ref(q, k, v, is_causal=True, alibi_slopes=mha.alibi_slopes)
    o = p_v.transpose(0, 2, 1, 3).reshape(2, 7, 32) @ mha.out_weight.T + mha.out_bias
    np.testing.assert_allclose(out, o, atol=2e-5)
    cache = mha.new_cache(2, 8)
    steps = [mha(x[:, t:t + 1], cache=cache, is_causal="lower_right")[0] for t in range(7)]
    np.testing.assert_allclose(np.concatenate(steps, 1), out, atol=2e-5)
    with pytest.raises(ValueError, match=r"alibi_slopes must have shape \(num_heads,\) = \(4,\)"):
        mha.alibi_slopes = [1.0, 2.0]
    with pytest.raises(ValueError, match="precision must be None, 'float32', 'bfloat16' or 'int8'"):
        mha.precision = "int4"
