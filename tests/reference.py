"""Shared test helpers: random inputs, and the plain float64 NumPy
references the tests compare against.

The references are written for clarity, not speed: every score is
materialized, masks are applied literally, and a query row with nothing to
attend gets weights 0.
"""
import numpy as np


def rand(shape, seed=0, dtype=np.float32):
    """Standard-normal values of ``shape`` cast to ``dtype``.

    ``seed``: an int (a fresh ``numpy.random.default_rng(seed)``, so equal
    seeds give equal arrays), or a ``numpy.random.Generator`` whose stream
    the draw continues (several arrays from one generator).
    """
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def allowed(N, M, mask=None, causal=0):
    """Boolean (..., N, M) 'may attend' for a mask and a causal mode.

    causal: 0 none, 1 upper-left (key j <= i), 2 lower-right (j <= i + M - N).
    A bool mask allows where True; a float mask allows where it is not -inf.
    """
    ok = np.ones((N, M), dtype=bool)
    if causal:
        off = 0 if causal == 1 else M - N
        ok = np.arange(M)[None, :] <= np.arange(N)[:, None] + off
    if mask is not None:
        mask = np.asarray(mask)
        if mask.dtype == bool:
            ok = ok & mask
        else:
            ok = ok & (mask != -np.inf)
    return ok


def attention(q, k, v, mask=None, causal=0, scale=None, group=1):
    """float64 attention; returns (out, weights)."""
    q = np.asarray(q, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    if group > 1:  # grouped-query: repeat K/V heads (axis -3)
        k = np.repeat(k, group, axis=-3)
        v = np.repeat(v, group, axis=-3)
    N, D = q.shape[-2:]
    M = k.shape[-2]
    if scale is None:
        scale = 1.0 / np.sqrt(D)
    s = np.matmul(q, np.swapaxes(k, -1, -2)) * scale
    if mask is not None and np.asarray(mask).dtype != bool:
        s = s + np.asarray(mask, dtype=np.float64)
    ok = allowed(N, M, mask, causal)
    ok = np.broadcast_to(ok, np.broadcast_shapes(ok.shape, s.shape))
    s = np.broadcast_to(s, ok.shape)
    s = np.where(ok, s, -np.inf)
    row_any = ok.any(axis=-1, keepdims=True)
    mx = np.where(row_any, np.max(np.where(ok, s, -np.inf), axis=-1, keepdims=True), 0.0)
    with np.errstate(invalid="ignore"):
        e = np.where(ok, np.exp(s - mx), 0.0)
    tot = e.sum(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        w = np.where(row_any, e / np.where(row_any, tot, 1.0), 0.0)
    out = np.matmul(w, v)
    out = np.where(row_any, out, 0.0)
    return out, w


def sdpa_ref(q, k, v, attn_mask=None, is_causal=False, window=None, softcap=None,
             return_lse=False, return_weights=False, scale=None):
    """Plain float64 attention with the documented semantics: causal
    alignment, window band, soft cap (before the mask), mask, empty rows 0."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    N, D = q.shape[-2:]
    M = k.shape[-2]
    s = q @ np.swapaxes(k, -1, -2) * (1 / np.sqrt(D) if scale is None else scale)
    if softcap:
        s = softcap * np.tanh(s / softcap)
    off = M - N if is_causal == "lower_right" else 0
    i, j = np.arange(N)[:, None], np.arange(M)[None, :]
    ok = np.ones((N, M), bool)
    if is_causal:
        ok &= j <= i + off
    if window is not None:
        lo, hi = window
        if lo >= 0:
            ok &= j >= i + off - lo
        if hi >= 0:
            ok &= j <= i + off + hi
    if attn_mask is not None:
        m = np.asarray(attn_mask)
        if m.dtype == bool:
            ok = ok & m
        else:
            ok = ok & (m != -np.inf)
            s = s + np.where(m == -np.inf, 0, m)
    ok = np.broadcast_to(ok, np.broadcast_shapes(ok.shape, s.shape))
    s = np.where(ok, np.broadcast_to(s, ok.shape), -np.inf)
    any_ = ok.any(-1, keepdims=True)
    mx = np.where(any_, s.max(-1, keepdims=True), 0)
    e = np.where(ok, np.exp(s - mx), 0)
    tot = e.sum(-1, keepdims=True)
    w = np.where(any_, e / np.where(any_, tot, 1), 0)
    out = w @ v
    res = [out]
    if return_weights:
        res.append(w)
    if return_lse:
        with np.errstate(divide="ignore"):
            res.append(np.where(any_[..., 0], mx[..., 0] + np.log(np.where(any_, tot, 1)[..., 0]),
                                -np.inf))
    return res[0] if len(res) == 1 else tuple(res)


def alibi_sinks(q, k, v, slopes=None, sinks=None, causal=False, window=None, softcap=None,
                mask=None, group=1):
    """float64 ALiBi and attention sinks: scores, soft cap, - slope
    |i + M - N - j|, mask / causal / window, a literal sink column in the
    softmax; (out, lse)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    if group > 1:
        k, v = np.repeat(k, group, -3), np.repeat(v, group, -3)
    N, M, D = q.shape[-2], k.shape[-2], q.shape[-1]
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(D)
    if softcap:
        s = softcap * np.tanh(s / softcap)
    i, j = np.arange(N)[:, None], np.arange(M)[None, :]
    if slopes is not None:
        s = s - np.asarray(slopes, np.float64)[..., None, None] * np.abs(i + M - N - j)
    ok = np.ones((N, M), bool)
    if causal:
        ok &= j <= i + M - N
    if window is not None:  # aligned like the causal diagonal: upper-left without causal
        off = M - N if causal else 0
        ok &= (j >= i + off - window[0]) & (j <= i + off + window[1])
    if mask is not None:
        ok = ok & mask
    ok = np.broadcast_to(ok, s.shape)
    s = np.where(ok, s, -np.inf)
    if sinks is not None:
        col = np.broadcast_to(np.asarray(sinks, np.float64)[..., None, None], s.shape[:-1] + (1,))
        s = np.concatenate([s, col], -1)
    mx = s.max(-1, keepdims=True)
    mx = np.where(np.isfinite(mx), mx, 0)
    e = np.exp(s - mx)
    tot = e.sum(-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(tot > 0, e / np.where(tot > 0, tot, 1), 0)
        lse = np.where(tot[..., 0] > 0, mx[..., 0] + np.log(np.where(tot > 0, tot, 1)[..., 0]),
                       -np.inf)
    if sinks is not None:
        p = p[..., :-1]
    return p @ v, lse
