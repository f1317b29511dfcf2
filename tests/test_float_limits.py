"""Values near the float32 maximum: float32-computed calls (float32 and
bfloat16 inputs) give the finite result the float64 reference gives, not
inf (their unnormalized P.V sums exceed float32 before the division by the
row sum; such calls are computed again in float64)."""
import warnings

import numpy as np
import pytest

import attncore
from reference import sdpa_ref

ml_dtypes = pytest.importorskip("ml_dtypes")
BIG = 3e38


def _qkv(N, M, D, seed=0, lead=(1, 2)):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal(lead + (N, D)).astype(np.float32)
    k = rng.standard_normal(lead + (M, D)).astype(np.float32)
    v = np.full(lead + (M, D), BIG, np.float32)
    v[..., ::2] *= -1  # both signs
    v[..., 1, :] *= 0.5
    return q, k, v


def _near(out, ref):
    out = np.asarray(out, np.float64)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, rtol=1e-2, atol=0)


@pytest.mark.parametrize("dtype", [np.float32, "bfloat16"])
@pytest.mark.parametrize("N", [1, 3, 40])
def test_sdpa_values_near_float32_max(path, dtype, N):
    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    q, k, v = (a.astype(dt) for a in _qkv(N, 70, 16))
    for kw in ({}, {"is_causal": "lower_right"}, {"return_lse": True},
               {"return_weights": True}):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no overflow warnings either
            res = attncore.scaled_dot_product_attention(q, k, v, **kw)
        out = res[0] if isinstance(res, tuple) else res
        assert out.dtype == dt
        ref = sdpa_ref(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                       is_causal=kw.get("is_causal", False))
        _near(out, ref)
        if kw.get("return_lse"):
            _, rlse = sdpa_ref(q.astype(np.float64), k.astype(np.float64),
                               v.astype(np.float64), return_lse=True)
            assert res[1].dtype == np.float32
            np.testing.assert_allclose(res[1], rlse, rtol=1e-5, atol=1e-5)


def test_sdpa_nan_inputs_still_propagate(path):
    """The float64 recomputation keeps the NaN rules: NaN in an attended
    value gives NaN in that output column only."""
    q, k, v = _qkv(5, 20, 8)
    v = np.ones_like(v)
    v[0, 0, 3, 2] = np.nan
    out = attncore.scaled_dot_product_attention(q, k, v)
    assert out.dtype == np.float32
    assert np.isnan(out[0, 0, :, 2]).all()
    np.testing.assert_allclose(np.delete(out[0, 0], 2, axis=-1), 1, rtol=1e-6)
    np.testing.assert_allclose(out[0, 1], 1, rtol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, "bfloat16"])
def test_varlen_values_near_float32_max(path, dtype):
    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    q, k, v = _qkv(30, 40, 16, lead=())
    q, k, v = (np.repeat(a[:, None, :], 2, axis=1).astype(dt) for a in (q, k, v))
    cq, ck = [0, 10, 30], [0, 15, 40]
    out = attncore.varlen_attention(q, k, v, cq, ck, is_causal=True)
    assert out.dtype == dt
    for b in range(2):
        qs, ks = slice(cq[b], cq[b + 1]), slice(ck[b], ck[b + 1])
        ref = sdpa_ref(*(np.swapaxes(a[s], 0, 1).astype(np.float64)
                         for a, s in ((q, qs), (k, ks), (v, ks))), is_causal="lower_right")
        _near(np.swapaxes(out[qs], 0, 1), ref)
