"""A forced kernel path runs its own compiled code.

The kernels that rely on the vectorizer (the BLAS path's tiles, the
weights path, the elementwise exp, the additive kernel, rotary embeddings)
are compiled once per target: baseline, AVX2 + FMA, AVX-512.  The C
dispatchers record the variant they called (``_sdpa._variants_ran``); each
forced path must run its own variant and no other, so the baseline code
that CPUs without AVX2 run is tested on an AVX-512 machine too.  Each
result is also checked against a float64 NumPy reference.  The kernel-path
state has one home: forcing it through any extension forces it for all.
"""
import numpy as np
import pytest

import attncore
from attncore import _kernels
from attncore._core import _linalg, _sdpa

from reference import additive_attention
from reference import attention as ref
from reference import rand

PATHS = _kernels.available_kernel_paths()


@pytest.fixture(params=PATHS)
def forced(request):
    with _kernels.forced_kernel_path(request.param):
        _sdpa._variants_ran(reset=True)
        yield request.param
    _sdpa._variants_ran(reset=True)


def only(kernel, path):
    ran = _sdpa._variants_ran(reset=True)
    # the neon path runs the portable variants (its own code: the decode body)
    assert ran[kernel] == ("portable" if path == "neon" else path,), ran


def test_sdpa_blas_path_float64(forced):
    q, k, v = (rand((2, 3, 37, 16), 1, np.float64), rand((2, 3, 45, 16), 2, np.float64),
               rand((2, 3, 45, 8), 3, np.float64))
    out = attncore.scaled_dot_product_attention(q, k, v, is_causal="lower_right", num_threads=1)
    only("sdpa", forced)
    np.testing.assert_allclose(out, ref(q, k, v, causal=2)[0], rtol=1e-12, atol=1e-13)


def test_weights_path_float32(forced):
    q, k, v = (rand((2, 20, 16), s) for s in (4, 5, 6))
    mask = np.random.default_rng(7).random((2, 20, 20)) > 0.3
    out, w = attncore.scaled_dot_product_attention(q, k, v, mask, return_weights=True,
                                                   num_threads=1)
    only("weights", forced)
    r_out, r_w = ref(q, k, v, mask)
    np.testing.assert_allclose(w, r_w, rtol=3e-5, atol=3e-6)
    np.testing.assert_allclose(out, r_out, rtol=3e-5, atol=3e-6)


@pytest.mark.parametrize("dtype, tol", [(np.float32, 2e-6), (np.float64, 1e-15)])
def test_exp(forced, dtype, tol):
    x = np.linspace(-80, 80, 1001).astype(dtype)
    y = _sdpa.exp_array(x)
    only("exp", forced)
    np.testing.assert_allclose(y, np.exp(x.astype(np.float64)), rtol=tol)


@pytest.mark.parametrize("masked", [False, True])
def test_additive_kernel(forced, masked):
    rng = np.random.default_rng(8)
    q, k, vals = rand((2, 5, 6), 9, np.float64), rand((2, 7, 6), 10, np.float64), rand((2, 7, 3), 11, np.float64)
    wq, wk, v = rand((8, 6), 12, np.float64) * 0.5, rand((8, 6), 13, np.float64) * 0.5, rand(8, 14, np.float64)
    mask = rng.random((2, 7)) > 0.3 if masked else None
    att = attncore.Attention("mlp", q_weight=wq, k_weight=wk, v=v)
    ctx, w = att(q, k, vals, mask=mask, return_weights=True)
    only("additive", forced)
    r_ctx, r_w = additive_attention(q, k, vals, v, wq, wk, mask=mask)
    np.testing.assert_allclose(w, r_w, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(ctx, r_ctx, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("dtype, tol", [(np.float32, 1e-6), (np.float64, 1e-14)])
def test_rotary(forced, dtype, tol):
    x = rand((2, 9, 16), 15, dtype)
    pos = np.arange(9)
    out = attncore.rotary_embedding(x, pos, num_threads=1)
    only("rotary", forced)
    ang = pos[:, None] * 10000.0 ** (-np.arange(8) / 8)
    a, b = x[..., :8].astype(np.float64), x[..., 8:].astype(np.float64)
    expected = np.concatenate([a * np.cos(ang) - b * np.sin(ang),
                               b * np.cos(ang) + a * np.sin(ang)], -1)
    np.testing.assert_allclose(out, expected, rtol=tol, atol=tol)


def test_one_home_for_the_kernel_path():
    best = _kernels.kernel_path()
    try:
        # forced through _linalg: _sdpa (and so every kernel) sees it
        assert _linalg.set_kernel_path(0)
        assert _sdpa.kernel_path() == "portable"
        _sdpa._variants_ran(reset=True)
        attncore.rotary_embedding(rand((1, 3, 4), dtype=np.float64), np.arange(3))
        assert _sdpa._variants_ran()["rotary"] == ("portable",)
        assert _sdpa.set_kernel_path(best) == "portable"
        assert _kernels.kernel_path() == best
    finally:
        _kernels.set_kernel_path(best)
    assert _kernels.kernel_path() == best


def test_constants_read_from_c():
    # the planner's constants are the C kernels' (not a second copy); the
    # planner's rules over them: test_blas_policy
    from attncore import _call

    assert _call.SMALL_ROWS == _sdpa.SMALL_ROWS == _sdpa.cpu_features()["small_rows"]
    for path in PATHS[1:]:
        with _kernels.forced_kernel_path(path):
            assert _sdpa.cpu_features()["fused_panel_rows"] == _sdpa.PANEL_ROWS[path]
