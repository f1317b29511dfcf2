"""ALiBi slopes and attention sinks in the kernel, on every kernel path,
against torch's SDPA with the materialized bias / a literal sink column,
BLOOM's ``build_alibi_tensor`` and a plain float64 reference."""
import numpy as np
import pytest

import attncore
from attncore._core import _sdpa

from reference import sdpa_ref
from reference import rand

sd = attncore.scaled_dot_product_attention
PATHS = list(_sdpa.available_kernel_paths())



SHAPES = [(1, 300), (3, 50), (37, 37), (70, 200), (33, 1500)]


@pytest.mark.parametrize("N,M", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_alibi_and_sinks_every_path(path, N, M, causal):
    rng = np.random.default_rng(N * 1000 + M)
    B, H, D = 2, 4, 16
    q, k, v = rand((B, H, N, D), rng), rand((B, H, M, D), rng), rand((B, H, M, 8), rng)
    slopes = 2.0 ** -np.arange(1, H + 1)
    sinks = rng.standard_normal(H) * 3
    c = "lower_right" if causal else False
    for kw in (dict(alibi_slopes=slopes), dict(sinks=sinks), dict(alibi_slopes=slopes, sinks=sinks)):
        for nt in (1, 2):
            out, lse = sd(q, k, v, is_causal=c, return_lse=True, num_threads=nt, **kw)
            rout, rlse = sdpa_ref(q, k, v, is_causal=c, return_lse=True, **kw)
            np.testing.assert_allclose(out, rout, atol=2e-6, rtol=0)
            np.testing.assert_allclose(lse, rlse, atol=2e-5, rtol=1e-6)
        o, w = sd(q, k, v, is_causal=c, return_weights=True, **kw)
        np.testing.assert_allclose(o, rout, atol=2e-6, rtol=0)


def test_alibi_with_masks_window_softcap_gqa_half(path):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(5)
    B, Hq, Hk, N, M, D = 2, 4, 2, 40, 130, 32
    q, k, v = rand((B, Hq, N, D), rng), rand((B, Hk, M, D), rng), rand((B, Hk, M, D), rng)
    slopes = np.array([[0.5, 0.1, 0.02, 0.7], [0.3, 0.2, 0.1, 0.05]])  # (B, H)
    mask = rng.random((B, 1, N, M)) > 0.2
    for kw in (dict(attn_mask=mask), dict(window=(20, 3)), dict(softcap=4.0, is_causal="lower_right")):
        out = sd(q, k, v, alibi_slopes=slopes, enable_gqa=True, **kw)
        rout = sdpa_ref(q, k, v, alibi_slopes=slopes, group=2, **kw)
        np.testing.assert_allclose(out, rout, atol=1e-5, rtol=0)
    for dt in (np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16)):
        qh, kh, vh = (x.astype(dt) for x in (q, k, v))
        out = sd(qh, kh, vh, alibi_slopes=slopes, sinks=slopes[0], enable_gqa=True,
                 is_causal="lower_right")
        assert out.dtype == dt
        rout = sdpa_ref(qh, kh, vh, alibi_slopes=slopes, sinks=slopes[0], group=2, is_causal="lower_right")
        ulp = 2.0 ** -8 if dt != np.float16 else 2.0 ** -11
        np.testing.assert_allclose(out.astype(np.float64), rout, atol=2 * ulp * np.abs(rout).max())


def test_alibi_against_torch_with_the_materialized_bias():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(6)
    B, H, N, M, D = 2, 8, 33, 90, 16
    q, k, v = rand((B, H, N, D), rng), rand((B, H, M, D), rng), rand((B, H, M, D), rng)
    # BLOOM's slopes: 2^(-8 h / H)
    slopes = 2.0 ** (-8.0 * np.arange(1, H + 1) / H)
    i, j = np.arange(N)[:, None], np.arange(M)[None, :]
    bias = -slopes[:, None, None] * np.abs(i + M - N - j)
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    expect = torch.nn.functional.scaled_dot_product_attention(
        tq, tk, tv, attn_mask=torch.from_numpy(bias.astype(np.float32))).numpy()
    np.testing.assert_allclose(sd(q, k, v, alibi_slopes=slopes), expect, atol=2e-6)


def test_alibi_agrees_with_bloom_under_causal():
    """BLOOM adds slope * j (key position); under the causal mask this equals
    -slope (i - j) up to a per-row constant, which softmax ignores."""
    pytest.importorskip("torch")
    bloom = pytest.importorskip("transformers.models.bloom.modeling_bloom")
    import torch
    rng = np.random.default_rng(7)
    B, H, N, D = 1, 6, 40, 16
    q, k, v = rand((B, H, N, D), rng), rand((B, H, N, D), rng), rand((B, H, N, D), rng)
    alibi = bloom.build_alibi_tensor(torch.ones(B, N, dtype=torch.long), H, torch.float32)
    bias = alibi.reshape(B, H, 1, N).numpy().astype(np.float64)
    causal = np.tril(np.ones((N, N), bool))
    s = np.asarray(q, np.float64) @ np.swapaxes(k, -1, -2).astype(np.float64) / np.sqrt(D) + bias
    s = np.where(causal, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    slopes = alibi.reshape(B, H, N)[0, :, 1].numpy()  # slope * 1
    np.testing.assert_allclose(sd(q, k, v, alibi_slopes=slopes, is_causal=True),
                               p @ v.astype(np.float64), atol=2e-6)


def test_sinks_rows_with_nothing_to_attend_and_int8_values():
    rng = np.random.default_rng(8)
    q, k, v = rand((2, 3, 4, 8), rng), rand((2, 3, 6, 8), rng), rand((2, 3, 6, 8), rng)
    mask = np.ones((4, 6), bool)
    mask[1] = False
    sinks = np.array([1.0, -2.0, -np.inf])   # -inf: no sink on that head
    out, lse = sd(q, k, v, mask, sinks=sinks, return_lse=True)
    assert (out[:, :, 1] == 0).all()
    np.testing.assert_array_equal(lse[:, :, 1], np.broadcast_to(sinks, (2, 3)))
    rout, rlse = sdpa_ref(q, k, v, mask, sinks=np.where(np.isinf(sinks), -1e300, sinks), return_lse=True)
    keep = np.arange(4) != 1
    np.testing.assert_allclose(out[:, :, keep], rout[:, :, keep], atol=2e-6)
    np.testing.assert_allclose(lse[:, :, keep], rlse[:, :, keep], atol=2e-5)
    _, lse0 = sd(q, k[..., :0, :], v[..., :0, :], sinks=sinks, return_lse=True)
    np.testing.assert_array_equal(lse0, np.broadcast_to(sinks[:, None], (2, 3, 4)))
    v8, vs = attncore.quantize_kv(v)
    out8 = sd(q, k, (v8, vs), sinks=sinks, alibi_slopes=[0.1, 0.2, 0.3])
    rv = v8.astype(np.float64) * vs[..., None]
    np.testing.assert_allclose(out8, sdpa_ref(q, k, rv, sinks=np.where(np.isinf(sinks), -1e300, sinks),
                                              alibi_slopes=np.array([0.1, 0.2, 0.3])), atol=2e-6)


@pytest.mark.parametrize("kw,exc,match", [
    (dict(alibi_slopes=np.ones(5)), ValueError, r"alibi_slopes of shape \(5,\) does not broadcast"),
    (dict(alibi_slopes=np.ones((1, 2, 3, 4))), ValueError, "alibi_slopes must have at most 2"),
    (dict(alibi_slopes=[1.0, np.nan, 1.0]), ValueError, "alibi_slopes must be finite, got nan"),
    (dict(alibi_slopes=[1.0, np.inf, 1.0]), ValueError, "alibi_slopes must be finite"),
    (dict(alibi_slopes=np.ones(3, int)), TypeError, "alibi_slopes must be a"),
    (dict(sinks=[1.0, np.nan, 0.0]), ValueError, r"sinks must be finite \(or -inf"),
    (dict(sinks=[1.0, np.inf, 0.0]), ValueError, "sinks must be finite"),
    (dict(sinks=np.ones(4)), ValueError, "sinks of shape"),
])
def test_bad_slopes_and_sinks(kw, exc, match):
    x = np.zeros((2, 3, 4, 8), np.float32)
    with pytest.raises(exc, match=match):
        sd(x, x, x, **kw)
