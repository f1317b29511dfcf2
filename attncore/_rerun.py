"""The float64 re-run of a packed float32 call whose output is not all
finite (private): :func:`rerun_sequences`, shared by
:func:`attncore.paged_attention` and :func:`attncore.varlen_attention`.

A float32 output that is not finite (sums beyond the float32 range, finite
scores that overflowed, inf / NaN inputs that reached it) is computed
again in float64: for a packed call, only the sequences that own such a
row, each over its own keys, so that the memory the re-run takes is those
sequences' operands in float64 and pieces of scratch, never the whole
cache.  The dense door's re-run (``attncore.functional._float64_rerun``)
repeats the whole call: its batch elements may share broadcast operands.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

import numpy as np

__all__ = ["PIECE", "bad_rows", "rerun_sequences", "subset_heads"]

# elements of float64 scratch per piece of the re-run's conversions and checks
PIECE = 1 << 18


def bad_rows(out: np.ndarray) -> np.ndarray:
    """Whether each row (axis 0) of ``out`` holds a non-finite element,
    checked a piece at a time (no output-sized temporary)."""
    n = out.shape[0]
    step = max(1, PIECE // max(1, out[:1].size))
    bad = np.zeros(n, dtype=bool)
    for i in range(0, n, step):
        part = out[i:i + step]
        bad[i:i + step] = ~np.isfinite(part.reshape(part.shape[0], -1)).all(axis=1)
    return bad


def subset_heads(x: Any, sel: np.ndarray) -> Any:
    """Per-head values (Hq,) as given, (num_seqs, Hq) ones of sequences ``sel``."""
    if x is None:
        return None
    a = np.asarray(x)
    return a[sel] if a.ndim == 2 else a


def rerun_sequences(out: np.ndarray, lse: Optional[np.ndarray], cu_q: np.ndarray, rdt: Any,
                    redo: Callable[[np.ndarray, np.ndarray], Tuple[np.ndarray, Any]]
                    ) -> Tuple[np.ndarray, Optional[np.ndarray]]:
    """The packed float32 result (out (total_q, ...), lse or None) in the
    result dtype ``rdt``, the sequences (query offsets ``cu_q``) that own a
    row that is not all finite computed again: ``redo(sel, rows)`` returns
    the float64 (out, lse or None) of sequences ``sel``, whose query rows
    are ``rows``, packed in that order."""
    bad = bad_rows(out)
    res = out if rdt == out.dtype else out.astype(rdt)
    if not bad.any():
        return res, lse
    sel = np.unique(np.searchsorted(cu_q, np.flatnonzero(bad), side="right") - 1)
    rows = np.concatenate([np.arange(cu_q[s], cu_q[s + 1]) for s in sel])
    got, glse = redo(sel, rows)
    if lse is not None:
        with np.errstate(over="ignore"):  # an lse beyond float32: -inf / inf there
            lse[rows] = glse.astype(lse.dtype)
    res[rows] = got.astype(rdt)
    return res, lse
