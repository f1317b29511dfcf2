"""Plain float64 NumPy references the tests compare against.

Written for clarity, not speed: every score is materialized, masks are
applied literally, and a query row with nothing to attend gets weights 0.
"""
import numpy as np


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
