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
* :func:`make_mask` -- random masks of the kinds the tests sweep.
* :func:`additive_scores` / :func:`additive_attention` -- Bahdanau's
  additive score ``v . tanh(Wq q + Wk k + b)`` and the attention over it,
  with :func:`masked_softmax`.
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


def make_mask(kind, B, H, N, M, seed=7, *, drop=0.3, dtype=np.float64):
    """A random attention mask of one kind, from ``default_rng(seed)``.

    ``drop`` is the share of masked entries of the random kinds; float
    masks are of ``dtype``.  Kinds:

    * ``None`` / ``'none'``: no mask;
    * ``'bool'`` / ``'bool_full'``: (B, H, N, M) bool;
    * ``'float'`` / ``'float_full'``: (B, H, N, M) standard-normal values,
      -inf where masked;
    * ``'padding'`` / ``'bool_keypad'``: (B, 1, 1, M) key padding, the last
      third of batch 0's keys and the first fifth of the last batch's
      masked;
    * ``'float_keypad'``: (B, 1, 1, M) float, -inf where masked;
    * ``'bool_rows'``: (B, H, N, 1), whole query rows masked;
    * ``'query_padding'``: (B, 1, N, 1), the first half of batch 0's rows
      masked;
    * ``'float_row_broadcast'``: (1, 1, N, M) finite float values;
    * ``'2d'``: (N, M) float shared by every batch and head, -inf where
      masked;
    * ``'bool_with_empty_rows'``: (B, H, N, M) bool, every third query row
      fully masked;
    * ``'neg_inf_stretches'``: (B, 1, N, M) float, keys 10 .. 199 and query
      row 3 (nothing to attend) -inf.
    """
    rng = np.random.default_rng(seed)
    if kind in (None, "none"):
        return None
    if kind in ("bool", "bool_full"):
        return rng.random((B, H, N, M)) >= drop
    if kind in ("float", "float_full", "float_keypad", "2d"):
        shape = {"float_keypad": (B, 1, 1, M), "2d": (N, M)}.get(kind, (B, H, N, M))
        return np.where(rng.random(shape) >= drop, rng.standard_normal(shape),
                        -np.inf).astype(dtype)
    if kind in ("padding", "bool_keypad"):
        m = np.ones((B, 1, 1, M), bool)
        m[0, ..., M - M // 3:] = False
        m[-1, ..., : M // 5] = False
        return m
    if kind == "bool_rows":
        return rng.random((B, H, N, 1)) >= drop
    if kind == "query_padding":
        m = np.ones((B, 1, N, 1), bool)
        m[0, :, : N // 2] = False
        return m
    if kind == "float_row_broadcast":
        return rng.standard_normal((1, 1, N, M)).astype(dtype)
    if kind == "bool_with_empty_rows":
        m = rng.random((B, H, N, M)) >= drop
        m[:, :, ::3] = False
        return m
    if kind == "neg_inf_stretches":
        m = np.zeros((B, 1, N, M), dtype)
        m[..., 10:200] = -np.inf
        m[..., 3, :] = -np.inf
        return m
    raise AssertionError(kind)


def additive_scores(q, k, v, q_weight=None, k_weight=None, bias=None):
    """float64 Bahdanau scores ``v . tanh(Wq q_t + Wk k_s + b)``, (..., T, S).

    ``q`` (..., T, Dq), ``k`` (..., S, Dk); a weight of None is the
    identity, a bias of None zero.
    """
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    hq = q if q_weight is None else q @ np.asarray(q_weight, np.float64).T
    hk = k if k_weight is None else k @ np.asarray(k_weight, np.float64).T
    if bias is not None:
        hk = hk + np.asarray(bias, np.float64)
    return np.tanh(hq[..., :, None, :] + hk[..., None, :, :]) @ v


def masked_softmax(s, mask=None):
    """float64 softmax over the last axis of scores (..., T, S).

    ``mask`` (..., S) bool: key s is attended where True, for every target.
    A row with nothing to attend (masked or -inf scores) gets weights 0; a
    NaN score makes its row NaN.
    """
    s = np.array(s, dtype=np.float64)
    if mask is not None:
        s = np.where(np.asarray(mask)[..., None, :], s, -np.inf)
    ok = ~np.isinf(s)
    mx = np.max(np.where(ok, s, -np.inf), axis=-1, keepdims=True, initial=-np.inf)
    mx = np.where(np.isneginf(mx), 0.0, mx)
    with np.errstate(invalid="ignore", over="ignore"):
        e = np.where(ok, np.exp(s - mx), 0.0)
    tot = e.sum(axis=-1, keepdims=True)
    return e / np.where(tot == 0, 1.0, tot)


def additive_attention(q, k, vals, v, q_weight=None, k_weight=None, bias=None, mask=None):
    """Bahdanau attention in float64: ``(context, weights)`` of the
    :func:`masked_softmax` of :func:`additive_scores`."""
    w = masked_softmax(additive_scores(q, k, v, q_weight, k_weight, bias), mask)
    return w @ np.asarray(vals, np.float64), w


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
