"""Packed variable-length batches: :func:`varlen_attention` (private module).

flash-attention's ``flash_attn_varlen_func`` layout: the sequences of a
batch are concatenated along the first axis, and ``cu_seqlens`` gives where
each one starts.  The kernel runs one work item per (sequence, head, query
block) in a single parallel region, costliest first, so no padding is
computed and threads balance across sequences of very different lengths
(the paged kernel, ``attncore._core._sdpa.sdpa_paged``, with the keys as
one block).
"""
from __future__ import annotations

import numbers
from typing import Any, Optional, Tuple

import numpy as np
from numpy.typing import ArrayLike

from . import _call
from ._dtypes import to_float
from ._interop import foreign_arrays
from ._rerun import rerun_sequences, subset_heads
from ._threads import resolve_num_threads
from ._validation import (INT32_MAX, as_float_array, check_offsets, head_values,
                          packed_group, parse_bool, parse_scale, parse_softcap, parse_window)

__all__ = ["varlen_attention"]



def _check_max(x: Any, name: str, actual: int) -> None:
    """``max_seqlen_*``: None or an int >= the longest sequence (a hint;
    the kernel uses the true lengths)."""
    if x is None:
        return
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name} must be None or an int, got {type(x).__name__} {x!r}")
    if int(x) < actual:
        raise ValueError(f"{name} ({int(x)}) is smaller than the longest sequence ({actual})")


def _slopes(alibi: Any, B: int, Hq: int, compute: np.dtype, max_distance: int) -> np.ndarray:
    """ALiBi slopes (Hq,) or (B, Hq) as a flat float64 (B * Hq,) array,
    checked against the compute dtype (attncore._validation.head_values)."""
    f = head_values(alibi, "alibi_slopes", compute, max_distance=max_distance)
    if f.shape not in ((Hq,), (B, Hq)):
        raise ValueError(f"alibi_slopes must have shape (Hq,) = ({Hq},) or (B, Hq) = "
                         f"({B}, {Hq}), got {f.shape}")
    return np.ascontiguousarray(np.broadcast_to(f, (B, Hq))).reshape(-1)


def _packed_call(qa, ka, va, cq, ck, pol, group: int, scale: float, causal: int,
                 win: tuple, cap: float, slopes, nthreads: int) -> _call.Call:
    """The description of one packed call: the paged kernel's, the keys /
    values one block (a (1, total_k, Hk, D) view) that every sequence
    reads from its offset."""
    S = ck.shape[0] - 1
    return _call.describe_paged(qa, ka[None], None, va[None], None,
                                block_table=np.zeros((S, 1), np.int32), seq_lens=np.diff(ck),
                                cu_q=cq, pol=pol, group=group, scale=scale, causal=causal,
                                window=win, softcap=cap, slopes=slopes, sinks=None,
                                nthreads=nthreads, need_lse=False, cu_k=ck)


def _check_packed(q, k, v, enable_gqa: bool):
    """(q, k, v, group): the packed operands checked (3-D, matching axes,
    grouped-query heads)."""
    qa = as_float_array(q, "q", allow_bf16=True)
    ka = as_float_array(k, "k", allow_bf16=True)
    va = as_float_array(v, "v", allow_bf16=True)
    for nm, a, shp in (("q", qa, "(total_q, Hq, D)"), ("k", ka, "(total_k, Hk, D)"),
                       ("v", va, "(total_k, Hk, Dv)")):
        if a.ndim != 3:
            raise ValueError(f"{nm} must be 3-D {shp}, got shape {a.shape}")
    total_q, Hq, D = qa.shape
    total_k, Hk, Dk = ka.shape
    if Dk != D:
        raise ValueError(f"k last dimension must equal q's (D = {D}), got k shape {ka.shape} "
                         f"and q shape {qa.shape}")
    if va.shape[:2] != (total_k, Hk):
        raise ValueError(f"v must match k in its first two axes (total_k, Hk) = "
                         f"({total_k}, {Hk}), got v shape {va.shape}")
    if D == 0:
        raise ValueError(f"q last dimension (D) must be >= 1, got q shape {qa.shape}")
    return qa, ka, va, packed_group(Hq, Hk, enable_gqa, "k / v")


def _check_offsets(cu_seqlens_q, cu_seqlens_k, total_q: int, total_k: int, max_seqlen_q,
                   max_seqlen_k):
    """(cu_q, cu_k, longest query run, longest key run): the offsets checked."""
    cq = check_offsets(cu_seqlens_q, "cu_seqlens_q", total_q, "q")
    ck = check_offsets(cu_seqlens_k, "cu_seqlens_k", total_k, "k")
    if cq.shape != ck.shape:
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must both hold B + 1 offsets, got "
                         f"{cq.shape[0]} and {ck.shape[0]}")
    B = cq.shape[0] - 1
    lq, lk = np.diff(cq), np.diff(ck)
    maxq = int(lq.max()) if B else 0
    maxk = int(lk.max()) if B else 0
    _check_max(max_seqlen_q, "max_seqlen_q", maxq)
    _check_max(max_seqlen_k, "max_seqlen_k", maxk)
    return cq, ck, maxq, maxk


@foreign_arrays(("q", "k", "v"), ("cu_seqlens_q", "cu_seqlens_k", "alibi_slopes"),
                half_native=True)
def varlen_attention(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    cu_seqlens_q: ArrayLike,
    cu_seqlens_k: ArrayLike,
    *,
    max_seqlen_q: Optional[int] = None,
    max_seqlen_k: Optional[int] = None,
    is_causal: bool = False,
    scale: Optional[float] = None,
    window: Optional[Tuple[int, int]] = None,
    softcap: Optional[float] = None,
    alibi_slopes: Optional[ArrayLike] = None,
    enable_gqa: bool = False,
    num_threads: Optional[int] = None,
) -> np.ndarray:
    """Attention over a packed batch of sequences of different lengths.

    The layout of flash-attention's ``flash_attn_varlen_func``: sequence
    ``b`` has queries ``q[cu_seqlens_q[b]:cu_seqlens_q[b + 1]]`` and keys /
    values ``k[cu_seqlens_k[b]:cu_seqlens_k[b + 1]]``; each attends only
    its own keys.  Nothing is padded: each (sequence, head, query block)
    is one work item, and the items run costliest first on a dynamic
    schedule, so threads stay busy however unequal the lengths are.

    Parameters
    ----------
    q : array_like, shape (total_q, Hq, D)
    k : array_like, shape (total_k, Hk, D)
    v : array_like, shape (total_k, Hk, Dv)
        bfloat16, float16, float32 or float64 (as
        :func:`attncore.scaled_dot_product_attention`: 16-bit operands are
        read in place and the output comes back in their dtype).  Any
        strides; never modified.
    cu_seqlens_q, cu_seqlens_k : array_like of int, shape (B + 1,)
        Offsets of the sequences: start at 0, non-decreasing, end at
        ``total_q`` / ``total_k``.  int32 as in flash-attention; any
        integer dtype (int64 too) is accepted.  Empty sequences (equal
        neighbouring offsets) are allowed.
    max_seqlen_q, max_seqlen_k : int, optional
        The longest sequence, as flash-attention takes them.  Only checked
        (a value below the true maximum raises ValueError); attncore reads
        the lengths from the offsets.
    is_causal : bool
        Causal mask aligned lower-right per sequence (flash-attention's
        convention): query ``i`` of a sequence with ``Nq`` queries and
        ``Nk`` keys sees keys ``j <= i + Nk - Nq``.  With ``Nq > Nk`` the
        first ``Nq - Nk`` rows see no key and come out 0.
    scale : float, optional
        Score scale, ``1 / sqrt(D)`` by default.
    window : (int, int), optional
        Sliding window ``(left, right)`` (-1: no bound on that side):
        query ``i`` sees keys ``i + Nk - Nq - left .. i + Nk - Nq + right``,
        aligned lower-right per sequence with or without ``is_causal`` (as
        flash-attention's ``window_size``).
    softcap : float, optional
        Caps the scaled scores, ``s -> softcap * tanh(s / softcap)``.
    alibi_slopes : array_like, shape (Hq,) or (B, Hq), optional
        ALiBi: the score of query ``i`` and key ``j`` gets
        ``-slope * |i + Nk - Nq - j|`` (flash-attention's convention).
        Finite floats (bfloat16 too); with float32 / 16-bit operands
        ``|slope|`` times the longest sequence's largest distance must not
        exceed the float32 maximum (ValueError).
    enable_gqa : bool
        Allow ``Hk`` to divide ``Hq`` (grouped-query attention: query head
        ``h`` reads key / value head ``h // (Hq // Hk)``).
    num_threads : int, optional
        As for :func:`attncore.scaled_dot_product_attention`.

    Returns
    -------
    ndarray, shape (total_q, Hq, Dv)
        In q's dtype by the rules of
        :func:`attncore.scaled_dot_product_attention` (torch / JAX in, the
        same type out).  Rows with no key to attend are 0.

    Raises
    ------
    TypeError
        Non-float operands, non-integer ``cu_seqlens_*``, bad argument types.
    ValueError
        Ranks or shapes that do not match, head counts that do not divide,
        offsets that do not start at 0, decrease or do not end at the
        total length.

    Examples
    --------
    >>> import numpy as np, attncore
    >>> rng = np.random.default_rng(0)
    >>> lens = [3, 5]                                   # two sequences
    >>> cu = np.array([0, 3, 8], dtype=np.int32)
    >>> q = rng.standard_normal((8, 2, 16), dtype=np.float32)
    >>> out = attncore.varlen_attention(q, q, q, cu, cu, is_causal=True)
    >>> out.shape
    (8, 2, 16)
    """
    is_causal = parse_bool(is_causal, "is_causal")
    enable_gqa = parse_bool(enable_gqa, "enable_gqa")
    win = parse_window(window)
    cap = parse_softcap(softcap)
    qa, ka, va, group = _check_packed(q, k, v, enable_gqa)
    (total_q, Hq, D), total_k, Dv = qa.shape, ka.shape[0], va.shape[2]
    cq, ck, maxq, maxk = _check_offsets(cu_seqlens_q, cu_seqlens_k, total_q, total_k,
                                        max_seqlen_q, max_seqlen_k)
    B = cq.shape[0] - 1
    sc = parse_scale(scale, D)
    nthreads = resolve_num_threads(num_threads)
    pol = _call.policy((qa.dtype, ka.dtype, va.dtype), ("q", "k", "v"), None)
    cdt, rdt = pol.compute, pol.result
    operands = (qa, ka, va)
    slopes = None if alibi_slopes is None else _slopes(alibi_slopes, B, Hq, cdt,
                                                       max(maxq, maxk) - 1)
    if max(D, Dv) > INT32_MAX:
        raise ValueError("head dimensions must be below 2**31")

    if not (total_q and Hq and Dv and total_k):
        return np.zeros((total_q, Hq, Dv), dtype=rdt)
    # causal: lower-right per sequence (2); a window alone: lower-right
    # alignment without the causal bound (3)
    causal = 2 if is_causal else (3 if win != (-1, -1) else 0)
    out, _, _, finite = _call.launch(_packed_call(qa, ka, va, cq, ck, pol, group, sc, causal, win,
                                                  cap, slopes, nthreads))
    if not finite and cdt == np.float32:
        # float32 sums overflowed (values near the float32 maximum), or
        # finite scores overflowed, or inf / NaN inputs reached the output:
        # those sequences again in float64, over their own keys
        return rerun_sequences(out, None, cq, rdt, _float64_redo(operands, cq, ck, dict(
            is_causal=is_causal, scale=sc, window=window, softcap=softcap,
            alibi_slopes=alibi_slopes, enable_gqa=enable_gqa, num_threads=num_threads)))[0]
    return out if rdt == cdt else out.astype(rdt)


def _float64_redo(operands: tuple, cq: np.ndarray, ck: np.ndarray, kw: dict):
    """The float64 re-run of sequences ``sel`` (query rows ``rows``) of a
    packed call (attncore._rerun.rerun_sequences): only their rows of q, k
    and v are converted."""
    def redo(sel: np.ndarray, rows: np.ndarray):
        krows = np.concatenate([np.arange(ck[s], ck[s + 1]) for s in sel])
        f64 = np.dtype(np.float64)
        qa, ka, va = (to_float(a[r], f64) for a, r in zip(operands, (rows, krows, krows)))
        offsets = [np.concatenate([[0], np.cumsum(np.diff(c)[sel])]) for c in (cq, ck)]
        return varlen_attention(qa, ka, va, *offsets, **dict(
            kw, alibi_slopes=subset_heads(kw["alibi_slopes"], sel))), None
    return redo
