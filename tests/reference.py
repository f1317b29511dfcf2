"""Shared test helpers: random inputs and the plain float64 NumPy reference
the tests compare against.

* :func:`rand` -- standard-normal arrays, one seeded generator per call.
* :func:`sdpa_ref` -- float64 scaled dot-product attention with every
  option of :func:`attncore.scaled_dot_product_attention` (mask, causal
  alignments, window, soft cap, grouped-query heads, ALiBi, sinks, scale,
  weights and lse), written for clarity, not speed: every score is
  materialized and masks are applied literally.
* :func:`attention` / :func:`lse_ref` -- the (out, weights) and the
  lse-only forms of :func:`sdpa_ref`.
* :func:`allowed` -- the boolean "may attend" array of a mask, a causal
  mode and a window.
"""
import contextlib
import os

import numpy as np

# ATTNCORE_TEST_KERNEL_PATH=avx2 (or portable) runs the whole session on that
# float32 path (tests/conftest.py forces it; its `path` fixture and the
# modules' own path fixtures then run that path alone)
FORCED_PATH = os.environ.get("ATTNCORE_TEST_KERNEL_PATH") or None


def rand(shape, seed=0, dtype=np.float32):
    """Standard-normal values of ``shape`` cast to ``dtype``.

    ``seed``: an int (a fresh ``numpy.random.default_rng(seed)``, so equal
    seeds give equal arrays), or a ``numpy.random.Generator`` whose stream
    the draw continues (several arrays from one generator).
    """
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _causal_code(is_causal):
    """0 none, 1 upper-left, 2 lower-right, from attncore's ``is_causal``
    values (False / True / 'upper_left' / 'lower_right') or those codes."""
    if isinstance(is_causal, str):
        return {"upper_left": 1, "lower_right": 2}[is_causal]
    return int(is_causal or 0)


def allowed(N, M, mask=None, causal=0, window=None, diagonal=None):
    """Boolean (..., N, M) 'may attend' for a mask, a causal mode and a window.

    causal: 0 / False none, 1 / True / 'upper_left' (key j <= i), 2 /
    'lower_right' (j <= i + M - N).
    window: (left, right): i + off - left <= j <= i + off + right, -1 leaving
    that side unbounded.
    diagonal: where query i's diagonal lies, for causal and window alike:
    'upper_left' (off = 0) or 'lower_right' (off = M - N); default the
    causal mode's (upper-left without causal), as in
    scaled_dot_product_attention (varlen_attention: always lower-right).
    A bool mask allows where True; a float mask allows where it is not -inf.
    """
    causal = _causal_code(causal)
    if diagonal is None:
        diagonal = "lower_right" if causal == 2 else "upper_left"
    off = {"upper_left": 0, "lower_right": M - N}[diagonal]
    i, j = np.arange(N)[:, None], np.arange(M)[None, :]
    ok = np.ones((N, M), dtype=bool)
    if causal:
        ok &= j <= i + off
    if window is not None:
        left, right = window
        if left >= 0:
            ok &= j >= i + off - left
        if right >= 0:
            ok &= j <= i + off + right
    if mask is not None:
        mask = np.asarray(mask)
        ok = ok & (mask if mask.dtype == bool else mask != -np.inf)
    return ok


def sdpa_ref(q, k, v, attn_mask=None, is_causal=False, scale=None, *, window=None, softcap=None,
             alibi_slopes=None, sinks=None, group=1, diagonal=None, return_weights=False,
             return_lse=False):
    """float64 attention with the documented semantics.

    Scores ``scale * q.k`` (default scale 1 / sqrt(D)), then the soft cap
    ``softcap * tanh(s / softcap)``, then ALiBi ``- slope * |i + M - N - j|``
    (``alibi_slopes`` broadcast against the heads, axis -3), then a float
    mask added; a key is attended where the mask, the causal mode and the
    window all allow it (:func:`allowed`; ``diagonal`` as there).  ``group``:
    each key / value head serves ``group`` consecutive query heads.
    ``sinks`` (one logit per head, -inf for none) join each row's softmax
    as a column that takes no part in the output.

    A row with nothing to attend (or whose attended scores are all -inf)
    gives output 0, weights 0 and lse -inf (lse = the sink with a sink);
    a NaN or +inf attended score makes the whole row NaN.  Sizes of 0 are
    allowed.  Returns ``out``, or a tuple ``(out[, weights][, lse])``.
    """
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    if group > 1:
        k, v = np.repeat(k, group, axis=-3), np.repeat(v, group, axis=-3)
    N, D = q.shape[-2:]
    M = k.shape[-2]
    s = q @ np.swapaxes(k, -1, -2) * (1 / np.sqrt(D) if scale is None else scale)
    if softcap:
        s = softcap * np.tanh(s / softcap)
    if alibi_slopes is not None:
        dist = np.abs(np.arange(N)[:, None] + M - N - np.arange(M)[None, :])
        s = s - np.asarray(alibi_slopes, np.float64)[..., None, None] * dist
    if attn_mask is not None and np.asarray(attn_mask).dtype != bool:
        m = np.asarray(attn_mask, np.float64)
        s = s + np.where(m == -np.inf, 0.0, m)
    ok = allowed(N, M, attn_mask, is_causal, window, diagonal)
    ok = np.broadcast_to(ok, np.broadcast_shapes(ok.shape, s.shape))
    s = np.where(ok, np.broadcast_to(s, ok.shape), -np.inf)
    if sinks is not None:
        col = np.broadcast_to(np.asarray(sinks, np.float64)[..., None, None], s.shape[:-1] + (1,))
        s = np.concatenate([s, col], axis=-1)
    mx = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
    mx = np.where(mx == -np.inf, 0.0, mx)      # nothing attended: every e is 0
    with np.errstate(invalid="ignore"):
        e = np.exp(s - mx)                     # -inf entries give 0; NaN / +inf rows NaN
    tot = e.sum(axis=-1, keepdims=True)
    w = e / np.where(tot == 0, 1.0, tot)
    with np.errstate(divide="ignore"):
        lse = (mx + np.log(tot))[..., 0]
    w = w[..., :M]                             # without the sink column
    out = np.where(tot == 0, 0.0, w @ v)       # 0 even where v holds inf / NaN
    res = (out,) + ((w,) if return_weights else ()) + ((lse,) if return_lse else ())
    return res[0] if len(res) == 1 else res


def attention(q, k, v, mask=None, causal=0, scale=None, group=1, **kw):
    """:func:`sdpa_ref` as ``(out, weights)``, positional arguments in this
    order (``causal``: a code of :func:`allowed`)."""
    return sdpa_ref(q, k, v, mask, causal, scale, group=group, return_weights=True, **kw)


def lse_ref(q, k, mask=None, causal=0, scale=None, **kw):
    """The lse of :func:`sdpa_ref` alone (no values needed)."""
    v = np.zeros(np.shape(k)[:-1] + (0,))
    return sdpa_ref(q, k, v, mask, causal, scale, return_lse=True, **kw)[1]


@contextlib.contextmanager
def int8_forced():
    """An int8 kernel forced on the kernel path in use (private
    ``_sdpa.set_int8_mode``): this CPU's default one where it has one,
    else one that every CPU of the path runs -- the AVX-512BW spelling of
    vpdpbusd (avx512 path), vpmaddubsw (avx2 path), float products of the
    dequantized int8 rows (portable path) -- so that a test needing int8
    products gets them on a CPU without VNNI too.  The default mode gives
    calls on float keys too small to repay their quantization float32
    products (``attncore._call.INT8_MIN_ROWS``); tests of small calls that
    need the int8 products force the mode."""
    from attncore import _kernels
    from attncore._core import _sdpa

    code = _sdpa.int8_mode() or {"avx512": 2, "avx2": 4}.get(_kernels.kernel_path(), 3)
    prev = _sdpa.set_int8_mode(_sdpa._INT8_NAMES[code])
    try:
        yield
    finally:
        _sdpa.set_int8_mode(prev)
