"""Public functions: argument checks, broadcasting, dtype policy, kernel choice.

Every public entry point of attncore funnels its checks through the helpers
here, so errors read the same everywhere: a ``TypeError`` or ``ValueError``
naming the argument, with the expected and the actual shape or dtype.

Dispatch::

    scaled_dot_product_attention
        |- validate (dtypes, ranks, shapes, mask, causal, scale, threads)
        |- lay out: last axis contiguous, per-batch element offsets
        |  (broadcast and grouped-query heads become offsets, never copies)
        |- choose tiles, thread count, key splits (split-KV for decoding)
        `- _core._sdpa.sdpa  (flash path, or the weights path when
                              return_weights=True)
"""
from __future__ import annotations

import functools
import math
import os
from typing import Literal, NamedTuple, Sequence, overload

import numpy as np
from numpy.typing import ArrayLike

from . import _int8
from ._core import _sdpa
from ._quant import dequantize, split_quantized
from ._threads import (OPENBLAS_SERIAL_MNK, SERIAL_FLOPS, blas_hold_supported,
                       blas_parallel_threads,
                       blas_small_products_ok, resolve_num_threads)
# the shared checkers live in ._validation; the names stay importable from here
from ._validation import (as_float_array, compute_dtype, parse_bool, parse_causal,  # noqa: F401
                          head_values, parse_float_dtype, parse_mask, parse_positive_int,
                          parse_scale, parse_softcap, parse_window)
from ._validation import all_finite
from ._validation import blas_rows as _rows_ok
from ._validation import batch_shape as _batch_shape
from ._validation import check_mask as _check_mask
from ._validation import check_operands as _check_operands
from ._interop import foreign_arrays
from ._dtypes import HALF_BF16, Policy, half_code, resolve, to_float

__all__ = ["scaled_dot_product_attention", "merge_attention"]

_INT32_MAX = 2**31 - 1
# query blocks of at most this many rows take the direct loops (decoding);
# the C kernels' constant
_SMALL_ROWS = _sdpa.SMALL_ROWS





def _l2_bytes() -> int:
    """Per-core L2 size (Linux sysconf), 1 MiB when unknown."""
    try:
        n = os.sysconf("SC_LEVEL2_CACHE_SIZE")
    except (ValueError, OSError, AttributeError):
        n = 0
    return n if n and n > 0 else 1 << 20


_L2 = _l2_bytes()


def _tiles(dtype, N: int, M: int, D: int, Dv: int, causal: int, nb: int, nthreads: int):
    """(query block, key block) sizes of the BLAS path (float64, the
    portable float32 path, return_weights).

    Key blocks of 512 (float32; 256 for float64, halved for D + Dv > 256).
    Query blocks as tall as keep the thread's score tile and accumulator in
    three quarters of its L2 (the key / value tiles stream through BLAS'
    packing), at most 256 rows (128 under a causal mask up to N = 1024,
    where taller diagonal blocks waste more than they save: measured), then
    halved while the work items would not give every thread two.
    """
    isz = dtype.itemsize
    Bk = 512 if isz == 4 else 256
    if D + Dv > 256:
        Bk //= 2
    Bk = max(1, min(Bk, M))
    Bq = 128 if (causal and N <= 1024) else 256
    budget = 3 * _L2 // 4
    while Bq > 32 and isz * Bq * (Bk + Dv) > budget:
        Bq //= 2
    while Bq > 32 and nb * -(-N // Bq) < 2 * nthreads:
        Bq //= 2
    return max(1, min(Bq, N)), Bk


class Plan(NamedTuple):
    """How one call runs: query / key block sizes, key splits, threads."""

    Bq: int
    Bk: int
    nsplit: int
    chunk: int
    nthreads: int
    fused: bool


def plan(dtype, N: int, M: int, D: int, Dv: int, causal: int, nb: int, nthreads: int,
         return_weights: bool = False, kernel_path: str | None = None,
         blas_mnk: int | None = None, converted_kv: bool = False) -> Plan:
    """Blocking, key splits and thread count of one attention call (pure).

    The fused float32 kernel (``kernel_path`` 'avx512' / 'avx2', queries
    in panels of 32 / 16 rows, no BLAS) takes query blocks of two panels,
    fewer when there would not be two per thread; a handful of query rows
    (decoding) and everything else use the BLAS path's tiles (``_tiles``).
    Decoding-like calls with fewer work items than threads split the keys
    (flash decoding) into chunks of at least 256 keys.  Work below
    ``SERIAL_FLOPS`` (attncore._threads) runs on the calling thread alone.  ``blas_mnk`` caps
    the size (m n k) of every BLAS product of the BLAS path: the tiles then
    shrink so that a BLAS that starts threads above a size (OpenBLAS) keeps
    each product on the calling thread.  ``converted_kv`` (int8 / half
    keys or values, converted a tile at a time for all the panels of a
    query block): query blocks of four panels, so that each conversion
    serves more rows.
    """
    if kernel_path is None:
        kernel_path = _sdpa.kernel_path()
    if 2.0 * nb * N * M * (D + Dv) < SERIAL_FLOPS:
        nthreads = 1
    fused = (dtype == np.float32 and not return_weights and kernel_path != "portable"
             and N > _SMALL_ROWS)
    if fused:
        panel = _sdpa.PANEL_ROWS[kernel_path]
        Bq = (4 if converted_kv else 2) * panel
        while Bq > panel and nb * -(-N // Bq) < 2 * nthreads:
            Bq //= 2
        Bq = min(Bq, N)
        Bk = max(1, min(512, M))  # only sizes the key splits here
    else:
        Bq, Bk = _tiles(np.dtype(dtype), N, M, D, Dv, causal, nb, nthreads)
        if blas_mnk:
            width = max(D, Dv)
            if return_weights:  # products over all M keys at once
                Bq = max(1, min(Bq, blas_mnk // max(1, M * width)))
            else:
                while Bk > 32 and Bq * Bk * width > blas_mnk:
                    Bk //= 2
                while Bq > 1 and Bq * Bk * width > blas_mnk:
                    Bq //= 2
    nqb = -(-N // Bq)
    work = nb * nqb
    nsplit, chunk = 1, M
    if not return_weights and work < nthreads and M >= 1024:
        nsplit = min(-(-nthreads // work), -(-M // 256))
        chunk = -(-M // nsplit)
        chunk = -(-chunk // Bk) * Bk
        nsplit = -(-M // chunk)
    nthreads = max(1, min(nthreads, work * nsplit))
    return Plan(Bq, Bk, nsplit, chunk, nthreads, fused)


def plan_call(dtype, N: int, M: int, D: int, Dv: int, causal: int, nb: int, nthreads: int,
              return_weights: bool = False, kernel_path: str | None = None,
              converted_kv: bool = False) -> Plan:
    """:func:`plan` and the BLAS thread policy of one call, decided together.

    The one place where a call's tiles meet the BLAS it loads, so that
    re-planning for the BLAS keeps every other argument of the plan.  Where
    the planned kernel calls BLAS (neither the fused kernel nor the direct
    loops of a few rows) and a BLAS library cannot be held to one thread
    per thread (``attncore._threads``):

    * an OpenBLAS gets tiles whose products stay below
      ``OPENBLAS_SERIAL_MNK``, so it runs each one on the calling thread:
      at any thread count, so that ``num_threads=1`` uses one core;
    * any other such BLAS gets a region of one thread, and keeps its own.
    """
    args = (dtype, N, M, D, Dv, causal, nb, nthreads, return_weights, kernel_path)
    pl = plan(*args, converted_kv=converted_kv)
    uses_blas = not pl.fused and (return_weights or N > _SMALL_ROWS)
    if uses_blas and not blas_hold_supported():
        if blas_small_products_ok():
            pl = plan(*args, blas_mnk=OPENBLAS_SERIAL_MNK, converted_kv=converted_kv)
        elif pl.nthreads > 1:
            pl = pl._replace(nthreads=blas_parallel_threads(pl.nthreads))
    return pl


# --------------------------------------------------------------------------
# scaled_dot_product_attention: checks (the kernel call is planned below)
# --------------------------------------------------------------------------
def _empty_result(q, k, v, attn_mask, bshape, rdt, cdt, need_w, need_lse, is_causal, scale,
                  enable_gqa, num_threads, window=(-1, -1), softcap=0.0, key_arg=None,
                  alibi=None, sinks=None, sink_values=None):
    """(out, weights or None, lse or None) when a batch, N, M or Dv is 0.
    ``key_arg``: the key to score with when ``k`` is a stand-in (an int8
    pair); ``sink_values``: ``sinks`` as _per_batch returns them."""
    N, M, Dv = q.shape[-2], k.shape[-2], v.shape[-1]
    nb = math.prod(bshape)
    out = np.zeros(bshape + (N, Dv), dtype=rdt)
    if Dv == 0 and (need_w or need_lse) and nb and N and M:
        # weights and lse are still defined: compute them with a dummy value column
        _, w, lse = _attention(q, k if key_arg is None else key_arg,
                               np.zeros(v.shape[:-1] + (1,), dtype=v.dtype), attn_mask,
                               is_causal, scale, enable_gqa, need_w, need_lse, num_threads,
                               window, softcap, alibi=alibi, sinks=sinks)
        return out, w, lse
    w = np.zeros(bshape + (N, M), dtype=rdt) if need_w else None
    lse = np.full(bshape + (N,), -np.inf, dtype=cdt) if need_lse else None
    if lse is not None and sink_values is not None and lse.size:
        # no key: the sink is the whole softmax
        lse[...] = sink_values.reshape(bshape)[..., None]
    return out, w, lse


def _per_batch(x, bshape: tuple, name: str, compute, allow_neg_inf: bool = False,
               max_distance: int | None = None) -> np.ndarray:
    """A per-head (per batch element) float array broadcast to the batch
    shape: (H,) matches the head axis (-3 of the query), (B, H) batch and
    heads, NumPy broadcasting from the right.  Returns it as a flat
    float64 array of one value per batch element, its values checked
    against the compute dtype ``compute`` (attncore._validation.head_values)."""
    f = head_values(x, name, compute, allow_neg_inf=allow_neg_inf, max_distance=max_distance)
    if f.ndim > len(bshape):
        raise ValueError(f"{name} must have at most {len(bshape)} dimensions (one per batch axis, "
                         f"the last one the heads), broadcastable to the batch shape {bshape}; "
                         f"got shape {f.shape}")
    try:
        b = np.broadcast_to(f, bshape)
    except ValueError:
        raise ValueError(f"{name} of shape {f.shape} does not broadcast to the batch shape "
                         f"{bshape} ((H,) per head or (B, H))") from None
    return np.ascontiguousarray(b).reshape(-1)


def _quantized_operand(data: np.ndarray, scales: np.ndarray, cdt):
    """An int8 operand laid out for the kernel (last axis contiguous, rows
    at least D apart) and its scales as (..., M, 1) of the compute dtype."""
    D = data.shape[-1]
    st = data.strides
    if (D > 1 and st[-1] != 1) or (data.shape[-2] > 1 and st[-2] < D) or any(s < 0 for s in st):
        data = np.ascontiguousarray(data)
    sc = scales.astype(cdt, copy=False)
    if any(s % sc.itemsize or s < 0 for s in sc.strides) or not sc.flags.aligned:
        sc = np.ascontiguousarray(sc)
    return data, sc[..., None]


def _broadcast_rows(res, bshape, N: int):
    """The one-row result ``res`` (out, weights, lse; None where not asked
    for) repeated over N query rows, as new arrays."""
    def spread(a):
        if a is None:
            return None
        full = np.empty(bshape + (N,) + a.shape[len(bshape) + 1:], dtype=a.dtype)
        full[...] = a
        return full
    return tuple(spread(a) for a in res)


# --------------------------------------------------------------------------
# scaled_dot_product_attention
# --------------------------------------------------------------------------
@overload
def scaled_dot_product_attention(
    query: ArrayLike, key: ArrayLike, value: ArrayLike, attn_mask: ArrayLike | None = None, *,
    is_causal: bool | Literal["upper_left", "lower_right"] = False, scale: float | None = None,
    enable_gqa: bool = False, return_weights: Literal[False] = False,
    return_lse: Literal[False] = False, window: tuple[int, int] | None = None,
    softcap: float | None = None, num_threads: int | None = None,
    precision: Literal["float32", "bfloat16", "int8"] | None = None,
    alibi_slopes: ArrayLike | None = None, sinks: ArrayLike | None = None,
) -> np.ndarray: ...


@overload
def scaled_dot_product_attention(
    query: ArrayLike, key: ArrayLike, value: ArrayLike, attn_mask: ArrayLike | None = None, *,
    is_causal: bool | Literal["upper_left", "lower_right"] = False, scale: float | None = None,
    enable_gqa: bool = False, return_weights: Literal[True],
    return_lse: Literal[False] = False, window: tuple[int, int] | None = None,
    softcap: float | None = None, num_threads: int | None = None,
    precision: Literal["float32", "bfloat16", "int8"] | None = None,
    alibi_slopes: ArrayLike | None = None, sinks: ArrayLike | None = None,
) -> tuple[np.ndarray, np.ndarray]: ...


@overload
def scaled_dot_product_attention(
    query: ArrayLike, key: ArrayLike, value: ArrayLike, attn_mask: ArrayLike | None = None, *,
    is_causal: bool | Literal["upper_left", "lower_right"] = False, scale: float | None = None,
    enable_gqa: bool = False, return_weights: Literal[False] = False,
    return_lse: Literal[True], window: tuple[int, int] | None = None,
    softcap: float | None = None, num_threads: int | None = None,
    precision: Literal["float32", "bfloat16", "int8"] | None = None,
    alibi_slopes: ArrayLike | None = None, sinks: ArrayLike | None = None,
) -> tuple[np.ndarray, np.ndarray]: ...


@overload
def scaled_dot_product_attention(
    query: ArrayLike, key: ArrayLike, value: ArrayLike, attn_mask: ArrayLike | None = None, *,
    is_causal: bool | Literal["upper_left", "lower_right"] = False, scale: float | None = None,
    enable_gqa: bool = False, return_weights: bool = False,
    return_lse: bool = False, window: tuple[int, int] | None = None,
    softcap: float | None = None, num_threads: int | None = None,
    precision: Literal["float32", "bfloat16", "int8"] | None = None,
    alibi_slopes: ArrayLike | None = None, sinks: ArrayLike | None = None,
) -> np.ndarray | tuple[np.ndarray, ...]: ...


@foreign_arrays(("query", "key", "value"), ("attn_mask", "alibi_slopes", "sinks"),
                last_in_compute_dtype="return_lse", half_native=True)
def scaled_dot_product_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    attn_mask: ArrayLike | None = None,
    *,
    is_causal: bool | Literal["upper_left", "lower_right"] = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_weights: bool = False,
    return_lse: bool = False,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    num_threads: int | None = None,
    precision: Literal["float32", "bfloat16", "int8"] | None = None,
    alibi_slopes: ArrayLike | None = None,
    sinks: ArrayLike | None = None,
) -> np.ndarray | tuple[np.ndarray, ...]:
    """Scaled dot-product attention, ``softmax(Q K^T * scale + mask) V``.

    Computed tile by tile with an online softmax (flash attention): memory
    beyond the output grows with the tile size, not with N x M.

    Parameters
    ----------
    query : array_like, shape (..., N, D)
    key : array_like, shape (..., M, D)
    value : array_like, shape (..., M, Dv)
        bfloat16, float16, float32 or float64 (bfloat16: torch / JAX
        tensors or ``ml_dtypes`` NumPy arrays).  Leading (batch) dimensions
        broadcast by NumPy rules.  Any strides are accepted; inputs are
        never modified.  bfloat16 and float16 are read in place (converted
        a tile at a time, never copied to float32 as a whole) and the
        output comes back in that dtype.
        ``key`` and / or ``value`` may also be an int8 pair ``(q, scales)``
        from :func:`attncore.quantize_kv`: a tuple or list of two is read
        as such a pair only when its first element is an int8 array (NumPy,
        a ``torch.int8`` tensor, or any array whose dtype is int8);
        anything else is an ordinary array-like.
    attn_mask : array_like, optional
        Broadcastable to (..., N, M).  **bool**: True = the query may attend
        to that key (take part), False = masked out.  **float**: added to
        the scaled scores (``-inf`` masks the entry out).  A broadcast mask
        such as key padding of shape (B, 1, 1, M) is read in place, and key
        tiles it masks out entirely are skipped.  Its leading dimensions
        take part in broadcasting the output batch shape.
    is_causal : bool or {'upper_left', 'lower_right'}, default False
        ``True`` / ``'upper_left'``: query i attends to keys 0..i (PyTorch's
        and Keras' causal mask).  ``'lower_right'``: the causal diagonal is
        aligned to the last key, query i attends to keys 0..i + M - N; this
        is the alignment for a chunk of N new queries after M - N cached
        keys (decoding).  With ``attn_mask`` as well, both apply: a key is
        attended only if the mask and the causal structure both allow it.
    scale : float, optional
        Factor on ``Q K^T``; default ``1 / sqrt(D)``.  Must be finite and > 0.
    enable_gqa : bool, default False
        Grouped-query / multi-query attention: axis -3 (heads) of key and
        value may be Hk dividing the query's Hq; query head h uses key/value
        head ``h // (Hq // Hk)``.  K and V are not copied.
    return_weights : bool, default False
        Also return the attention weights, shape (..., N, M) (this
        materializes them).
    window : (int, int), optional
        Sliding-window (local) attention: query i attends keys j with
        ``i + off - left <= j <= i + off + right``, where ``off`` follows the
        causal alignment in use (0 without causal or for ``'upper_left'``,
        ``M - N`` for ``'lower_right'``); ``-1`` leaves that side unbounded
        (flash-attention's ``window_size`` convention).  Combines with the
        mask and causal (every one applies).  Key tiles outside the band
        are skipped, so the cost grows with N x window, not N x M.  A row
        whose band holds no key gives 0.
    softcap : float, optional
        Logit soft-capping: the scaled scores become
        ``softcap * tanh(score / softcap)`` before the mask is applied
        (Gemma 2's order).  From 1e-30 to 1e30; the tanh is accurate to a
        few float32 ulps relative on every kernel path (so a cap far above
        the scores leaves them unchanged).
    return_lse : bool, default False
        Also return the log-sum-exp of each query row, shape (..., N), in
        the compute dtype (float32 for float16 inputs): the natural log of
        the sum over the keys the row attends of ``exp(scale * q.k + mask)``;
        ``-inf`` for a row with nothing to attend (its output is 0), NaN
        where an attended score is NaN (from the query, keys or a float
        mask; NaN in values makes the output NaN but leaves lse finite).
        With it, results over disjoint key sets combine exactly
        (:func:`attncore.merge_attention`).
    num_threads : int, optional
        ``None``: OpenMP's default (``OMP_NUM_THREADS``, threadpoolctl);
        ``-1``: all cores; ``k >= 1``: k threads.  Results agree across
        thread counts to float rounding.
    precision : {None, 'float32', 'bfloat16', 'int8'}, optional
        The dot products' precision.  ``None``: the inputs' own (float64
        for float64; bfloat16 products with float32 accumulation for
        all-bfloat16 inputs on a CPU with AVX512_BF16; float32
        otherwise).  ``'float32'``: float32 products for any
        float32 / float16 / bfloat16 input.  ``'bfloat16'``: bfloat16
        products where the CPU has AVX512_BF16 (float32 elsewhere).
        ``'int8'``: Q.K^T of int8 rows with exact int32 sums (vpdpbusd on
        AVX512_VNNI; the dequantized rows' float products elsewhere): the
        keys minus their mean over the keys, channels balanced between
        queries and keys, one symmetric scale per query row and per key
        row; int8 keys given as a ``(data, scales)`` pair are used as
        they are.  P.V keeps the precision it has without the option; the
        weights and the lse are those of the int8 scores.  Documented
        error: 1 - cos about 4e-5 on N(0, 1) inputs (docs' variants page).
        The softmax and the accumulation are float32 in every case;
        float64 inputs take no reduced precision (ValueError).  See
        ``attncore.show_config()`` for what this CPU runs.
    alibi_slopes : array_like, optional
        ALiBi (BLOOM, MPT): shape (H,) (one slope per head, the query's
        axis -3) or (B, H), broadcastable to the batch shape.  The score of
        query i and key j becomes ``score - slope * |i + M - N - j|``
        (flash-attention's convention: the distance of the lower-right
        aligned positions, whatever ``is_causal`` is), added after the soft
        cap and before the mask.  Computed tile by tile in the kernel,
        never as an N x M array.  Finite floats of any float dtype
        (bfloat16 and torch tensors too); in a float32 computation
        (float32 / float16 / bfloat16 inputs) ``|slope| * max(1, max(N, M)
        - 1)`` must not exceed the float32 maximum (ValueError otherwise:
        the ALiBi term of every score stays within float32).
    sinks : array_like, optional
        Attention sinks (gpt-oss): one logit per head, shape (H,) or
        (B, H) like ``alibi_slopes``.  ``exp(sink)`` joins each row's
        softmax denominator as an extra column that takes no part in the
        output, so the weights of a row sum to less than 1.  The lse then
        includes the sink's term (a row with no key to attend gives output
        0 and ``lse = sink``).  Finite floats of any float dtype, or -inf
        for no sink; within the float32 range (about 3.4e38) in a float32
        computation (ValueError otherwise).

    Returns
    -------
    out : ndarray, shape (..., N, Dv)
    weights : ndarray, shape (..., N, M)
        Only with ``return_weights=True``; rows sum to 1, or are all 0 for a
        query with nothing to attend, or are NaN across the whole row (keys
        outside a causal / window band included) where an attended score is
        NaN or +inf (from the inputs or a float mask entry).
    lse : ndarray, shape (..., N)
        Only with ``return_lse=True`` (after ``weights`` when both are
        asked for).

    Notes
    -----
    * A query row with no key to attend (fully masked, or before the first
      key under ``'lower_right'`` with N > M) gives output 0 and weights 0,
      as PyTorch >= 2.5.  This is decided from the mask and causal
      structure; NaN in query, keys, values or mask entries that take part
      propagates to the affected outputs, while inf / NaN in the keys or
      values of a key a query does not attend never reach that query.  ``M == 0`` gives an all-zero
      output; ``N == 0`` an empty one.
    * A row whose attended scores are *all* -inf because of -inf / inf in
      the query or keys (not the mask) also gives output 0 and weights 0,
      as PyTorch does; a +inf score (or NaN from inf - inf in ``q . k``)
      gives NaN.
    * Scores, ``scale`` and float mask entries are used as they are over
      the whole float range, on every kernel path: a mask of
      ``numpy.finfo(numpy.float32).min`` on every key of a row (Hugging
      Face's masked value) gives that row's plain average of the values
      and a finite lse (about -3.4e38), not the result of an empty row.
    * dtypes: float32 and float64 are computed natively; float16 and
      bfloat16 are read in place, computed with float32 accumulation and
      returned in their dtype (the lse stays float32).  Mixed dtypes:
      float64 with anything gives float64, float32 with a 16-bit dtype
      float32; bfloat16 with float16 is a TypeError (no common 16-bit
      type).  ``return_weights=True`` with 16-bit inputs converts them to
      float32 (the weights are materialized anyway).  A float mask is
      converted to the compute dtype and does not take part in
      promotion.  Integer, bool, complex and object inputs raise TypeError.
    * The GIL is released while computing; calls from several Python
      threads at once are safe.
    """
    return_weights = parse_bool(return_weights, "return_weights")
    return_lse = parse_bool(return_lse, "return_lse")
    enable_gqa = parse_bool(enable_gqa, "enable_gqa")
    win = parse_window(window)
    cap = parse_softcap(softcap)
    out, weights, lse = _attention(query, key, value, attn_mask, is_causal, scale, enable_gqa,
                                   return_weights, return_lse, num_threads, win, cap, precision,
                                   alibi=alibi_slopes, sinks=sinks)
    if not (return_weights or return_lse):
        return out
    return (out,) + ((weights,) if return_weights else ()) + ((lse,) if return_lse else ())


def _policy(q, k, v, k8, v8, precision) -> Policy:
    """The call's dtype policy; an int8 key / value takes no part in it
    (it counts as the query's dtype)."""
    kd = q.dtype if k8 is not None else k.dtype
    vd = q.dtype if v8 is not None else v.dtype
    return resolve((q.dtype, kd, vd), ("query", "key", "value"), precision,
                   bf16_products=_sdpa.bf16_mode() != 0)


def _int8_products(D: int) -> int:
    """The kernel's int8 Q.K^T code for ``precision="int8"`` on the path in
    use: 1 / 2 the vpdpbusd kernel (native / emulated, on the AVX-512 path),
    3 products of the dequantized rows (forced, or a head size outside the
    kernel's exact range), 0 float32 products where this CPU and path have
    no int8 kernel (no slower than float32, and more accurate)."""
    qk8 = _sdpa.int8_mode()
    if qk8 in (1, 2) and _sdpa.kernel_path() != "avx512":
        return 0
    # (int32 sums of D products of up to 255 x 127: exact below 66313)
    if qk8 in (1, 2) and (D < 2 or D > 65536):
        return 3
    return qk8


def _attention(query, key, value, attn_mask, is_causal, scale, enable_gqa: bool,
               return_weights: bool, return_lse: bool, num_threads,
               window: tuple[int, int] = (-1, -1), softcap: float = 0.0, precision=None, *,
               alibi=None, sinks=None, compute_out: bool = False):
    """(out, weights or None, lse or None): the checked call.
    ``compute_out``: out and weights stay in the compute dtype (float32 for
    16-bit inputs) instead of the result dtype (attncore.dask merges such
    partial results before rounding them once)."""
    operands = (query, key, value)
    key, k_scales = split_quantized(key, "key")
    value, v_scales = split_quantized(value, "value")
    k8 = v8 = None
    if k_scales is not None or v_scales is not None:
        qdt = as_float_array(query, "query", allow_bf16=True).dtype
        if k_scales is not None:
            # shape checks on a float stand-in; int8 takes no part in promotion
            k8, key = key, np.broadcast_to(np.zeros((), qdt), key.shape)
        if v_scales is not None:
            v8, value = value, np.broadcast_to(np.zeros((), qdt), value.shape)
    q, k, v = _check_operands(query, key, value)
    pol = _policy(q, k, v, k8, v8, precision)
    cdt, rdt = pol.compute, pol.result
    if compute_out:
        rdt = cdt
    if return_weights and (k8 is not None or v8 is not None):
        # the weights path multiplies whole rows: dequantize (a copy)
        k = k if k8 is None else dequantize(k8, k_scales, cdt)
        v = v if v8 is None else dequantize(v8, v_scales, cdt)
        k8 = v8 = k_scales = v_scales = None
    N, D = q.shape[-2], q.shape[-1]
    M, Dv = k.shape[-2], v.shape[-1]
    causal = parse_causal(is_causal)
    sc = parse_scale(scale, D)
    nthreads = resolve_num_threads(num_threads)
    m, mask_kind = _check_mask(attn_mask, N, M)
    bshape, group = _batch_shape(q, k, v, m, enable_gqa)
    nb = math.prod(bshape)
    out_shape = bshape + (N, Dv)
    slopes = None if alibi is None else _per_batch(alibi, bshape, "alibi_slopes", cdt,
                                                   max_distance=max(N, M) - 1)
    sk = None if sinks is None else _per_batch(sinks, bshape, "sinks", cdt, allow_neg_inf=True)

    if nb == 0 or N == 0 or M == 0 or Dv == 0:
        return _empty_result(q, k, v, attn_mask, bshape, rdt, cdt, return_weights, return_lse,
                             is_causal, scale, enable_gqa, num_threads, window, softcap,
                             key_arg=None if k8 is None else (k8, k_scales),
                             alibi=alibi, sinks=sinks, sink_values=sk)
    if cdt == np.float64 or return_weights:
        # the float64 kernel and the weights path (BLAS over whole rows)
        # take 16-bit operands converted (a copy)
        q, k, v = (a if (a is None or not half_code(a.dtype)) else to_float(a, cdt)
                   for a in (q, k, v))
    banded = causal or window != (-1, -1)
    quantized = k8 is not None or v8 is not None
    if N > 1 and q.strides[-2] == 0 and not banded and not quantized and alibi is None and \
            sinks is None and (m is None or m.shape[-2] == 1):
        # a broadcast query row axis: every row of a batch element is the
        # same query with the same keys, so compute one and broadcast it
        # (never copy the N identical rows)
        return _broadcast_rows(
            _attention(q[..., :1, :], k if k8 is None else (k8, k_scales),
                       v if v8 is None else (v8, v_scales), m, False, sc, enable_gqa,
                       return_weights, return_lse, num_threads, window, softcap, precision,
                       compute_out=compute_out),
            bshape, N)

    # ---- lay out operands ----
    if max(N, M, D, Dv) > _INT32_MAX:
        raise ValueError("sequence lengths and head dimensions must be below 2**31")
    # 16-bit operands are passed as they are (the kernel converts tiles)
    qf, kf, vf = half_code(q.dtype), half_code(k.dtype), half_code(v.dtype)
    q = _rows_ok(q if (qf or q.dtype == cdt) else q.astype(cdt))
    ks = vs = None
    if k8 is not None:
        k, ks = _quantized_operand(k8, k_scales, cdt)
        kf = 0
    else:
        k = _rows_ok(k if (kf or k.dtype == cdt) else k.astype(cdt))
    if v8 is not None:
        v, vs = _quantized_operand(v8, v_scales, cdt)
        vf = 0
    else:
        v = _rows_ok(v if (vf or v.dtype == cdt) else v.astype(cdt))
    if m is not None:
        if mask_kind == 2 and (m.dtype != cdt or not m.dtype.isnative):
            m = m.astype(cdt)
        if any(st % m.itemsize for st in m.strides):
            m = np.ascontiguousarray(m)

    # bfloat16 products; with int8 Q.K^T, P.V as bfloat16 pairs where the
    # CPU has them
    qk8 = _int8_products(D) if pol.products == "int8" else 0
    bf16dot = pol.products == "bfloat16" or (qk8 != 0 and _sdpa.bf16_mode() != 0)
    q_scales = q_mu = None
    if qk8:
        # int8 Q.K^T (attncore._int8): the operands quantized once per call
        i8 = _int8.quantize(q, qf, None if ks is not None else k, kf,
                            k if ks is not None else None,
                            None if ks is None else ks[..., 0], bshape, group,
                            nthreads if 2.0 * nb * N * M * (D + Dv) >= SERIAL_FLOPS else 1,
                            pairs=qk8 != 3 and N > _SMALL_ROWS)
        if return_weights or softcap > 0 or sk is not None:
            # the scores' level matters (the weights' path, a soft cap, a
            # sink): float rows whose products are the int8 ones, q . mu
            # included as one more channel (a copy of Q and K)
            q, k = _int8.dequantized(i8, bshape, D)
            qf = kf = qk8 = 0
            ks = None
            D = D + 1
        else:
            q, k, ks = i8.q8.reshape(bshape + i8.q8.shape[1:]), i8.k8, i8.k_pairs
            q_scales, q_mu = i8.q_scales, i8.q_mu
            kf = qf = 0
    # (int8 Q.K^T reads its int8 keys in place: only the values convert)
    conv = bool(vf or vs is not None or bf16dot) if qk8 else \
        bool(kf or vf or ks is not None or vs is not None or bf16dot)
    pl = plan_call(cdt, N, M, D, Dv, causal, nb, nthreads, return_weights,
                   kernel_path="portable" if qk8 == 3 else None, converted_kv=conv)
    nthreads = pl.nthreads

    out = np.empty((nb, N, Dv), dtype=cdt)
    weights = np.empty((nb, N, M), dtype=cdt) if return_weights else None
    lse = np.empty((nb, N), dtype=cdt) if return_lse else None
    # bfloat16 (ml_dtypes) exports no buffer format: the kernel reads its bits
    q, k, v = (a.view(np.uint16) if f == HALF_BF16 else a for a, f in ((q, qf), (k, kf), (v, vf)))
    _sdpa.sdpa(q, k, v, m, out, weights, bshape, group, mask_kind, N, M, D, Dv, causal, sc,
               pl.Bq, pl.Bk, pl.nsplit, pl.chunk, nthreads, lse, window[0], window[1], softcap,
               ks, vs, qf, kf, vf, slopes, sk,
               _sdpa.bf16_mode() if (bf16dot and pl.fused) else 0, q_scales, qk8)
    if cdt == np.float32 and not all_finite(out) and _finite_operands(operands):
        # float32 accumulation overflowed (values near the float32 maximum:
        # the unnormalized P.V sums exceed it before the division by the
        # row sum): the call again in float64
        return _float64_rerun(operands, rdt, attn_mask, is_causal, scale, enable_gqa,
                              return_weights, return_lse, num_threads, window, softcap,
                              alibi=alibi, sinks=sinks)
    if lse is not None and q_mu is not None:
        # the per-row term q . mu the smoothing took out of the scores
        lse += np.float32(sc) * q_mu

    out = out.reshape(out_shape)
    if rdt != cdt:
        out = out.astype(rdt)
    if return_weights:
        weights = weights.reshape(bshape + (N, M))
        if rdt != cdt:
            weights = weights.astype(rdt)
    if return_lse:
        lse = lse.reshape(bshape + (N,))
    return out, weights, lse


def _float64_operands(operands) -> list:
    """(query, key, value) as float64 arrays (int8 pairs dequantized)."""
    ops = [as_float_array(operands[0], "query", allow_bf16=True).astype(np.float64)]
    for x, name in zip(operands[1:], ("key", "value")):
        x, s = split_quantized(x, name)
        ops.append(dequantize(x, s, np.float64) if s is not None
                   else as_float_array(x, name, allow_bf16=True).astype(np.float64))
    return ops


def _finite_operands(operands) -> bool:
    """Whether query, keys and values are all finite (a non-finite output
    of finite operands is a float32 overflow; of others, their inf / NaN)."""
    return all(all_finite(a) for a in _float64_operands(operands))


def _float64_rerun(operands, rdt, attn_mask, *args, **kwargs):
    """A float32-computed call of finite operands whose output overflowed,
    computed again in float64 (a copy of the operands) and returned in the
    first call's dtypes: output and weights in ``rdt``, the lse in float32."""
    ops = _float64_operands(operands)
    out, weights, lse = _attention(*ops, attn_mask, *args, **kwargs)
    return (out.astype(rdt), None if weights is None else weights.astype(rdt),
            None if lse is None else lse.astype(np.float32))


# --------------------------------------------------------------------------
# a lean call for integrations (the Hugging Face backend's decoding steps)
# --------------------------------------------------------------------------
@functools.lru_cache(maxsize=512)
def _plan_cached(dtype: str, N: int, M: int, D: int, Dv: int, causal: int, nb: int,
                 nthreads: int, kernel_path: str, converted: bool) -> Plan:
    return plan(np.dtype(dtype), N, M, D, Dv, causal, nb, nthreads,
                kernel_path=kernel_path, converted_kv=converted)


def _kernel_rows(a: np.ndarray) -> bool:
    """Whether the kernel reads ``a`` (4-D) as it is (see blas_rows)."""
    st, isz = a.strides, a.itemsize
    return (a.flags.aligned and st[3] == isz and st[2] >= a.shape[3] * isz
            and st[2] % isz == 0 and st[1] % isz == 0 and st[0] % isz == 0
            and st[1] >= 0 and st[0] >= 0)


def attention_prepared(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: int,
                       scale: float | None, nthreads: int, window: tuple[int, int] = (-1, -1),
                       softcap: float = 0.0) -> np.ndarray | None:
    """Attention of already-checked operands, without the general call's
    argument handling (private: for integrations that call attncore per
    layer and per decoding step, where that handling costs as much as a
    small kernel call).

    q (B, H, L, D), k / v (B, Hk, S, D / Dv): NumPy arrays of one dtype
    (float32, float16 or bfloat16), Hk dividing H, no mask; ``causal`` a
    kernel code (0, 1 upper-left, 2 lower-right), ``nthreads`` >= 1,
    ``window`` / ``softcap`` as parsed by the general call.  Returns the
    output (B, H, L, Dv) in q's dtype, or None when the call needs the
    general path (other layouts or dtypes, the BLAS path, empty shapes):
    the caller then uses :func:`scaled_dot_product_attention`.
    """
    dt = q.dtype
    if (q.ndim != 4 or k.ndim != 4 or v.ndim != 4 or k.dtype != dt or v.dtype != dt
            or not (dt == np.float32 or half_code(dt))):
        return None
    B, H, N, D = q.shape
    Bk, Hk, M, Dk = k.shape
    Dv = v.shape[3]
    if (Bk != B or v.shape[:3] != (B, Hk, M) or Dk != D or Hk == 0 or H % Hk
            or 0 in (B, H, N, M, D, Dv) or max(N, M, D, Dv) > _INT32_MAX
            or not (_kernel_rows(q) and _kernel_rows(k) and _kernel_rows(v))):
        return None
    if scale is None:
        sc = 1.0 / math.sqrt(D)
    else:
        sc = float(scale)
        if not (math.isfinite(sc) and sc > 0):
            return None
    fmt = half_code(dt)
    # bfloat16 inputs: bfloat16 products where the CPU has them (the policy)
    bfm = _sdpa.bf16_mode() if fmt == HALF_BF16 else 0
    pl = _plan_cached(dt.str if not fmt else "float32", N, M, D, Dv, causal, B * H, nthreads,
                      _sdpa.kernel_path(), bool(fmt))
    if not pl.fused and N > _SMALL_ROWS:
        return None  # the BLAS path: the general call decides its threads
    out = np.empty((B * H, N, Dv), dtype=np.float32)
    if fmt == HALF_BF16:
        q, k, v = q.view(np.uint16), k.view(np.uint16), v.view(np.uint16)
    _sdpa.sdpa(q, k, v, None, out, None, (B, H), H // Hk, 0, N, M, D, Dv, causal, sc,
               pl.Bq, pl.Bk, pl.nsplit, pl.chunk, pl.nthreads, None, window[0], window[1],
               softcap, None, None, fmt, fmt, fmt, None, None, bfm if pl.fused else 0)
    if not all_finite(out):
        return None  # an overflow or non-finite inputs: the general call decides
    out = out.reshape(B, H, N, Dv)
    return out.astype(dt) if fmt else out


# --------------------------------------------------------------------------
# merge_attention
# --------------------------------------------------------------------------
def merge_attention(outputs: Sequence[ArrayLike], lses: Sequence[ArrayLike]
                    ) -> tuple[np.ndarray, np.ndarray]:
    """Combine attention over disjoint key sets into attention over all keys.

    ``outputs[i]``, ``lses[i]`` are what
    ``scaled_dot_product_attention(..., return_lse=True)`` returned for the
    i-th part of the keys (the same queries, masks and scale).  The result
    equals one call over all the keys, to float rounding: the outputs are
    averaged with the weights ``exp(lse_i - lse)``, where
    ``lse = log(sum_i exp(lse_i))``.

    Parameters
    ----------
    outputs : sequence of array_like, each of shape (..., N, Dv)
    lses : sequence of array_like, each of shape (..., N)
        One per output; batch shapes broadcast.

    Returns
    -------
    out : ndarray, shape (..., N, Dv)
        In the outputs' (promoted) dtype.
    lse : ndarray, shape (..., N)
        The log-sum-exp over all the keys (float32 at least).
        Both are NumPy arrays whatever the parts were (the parts may be any
        arrays NumPy reads: torch CPU tensors, JAX arrays, ...).

    Notes
    -----
    A row that attends no key in a part (``lse_i = -inf``) takes nothing
    from it; a row empty in every part gives output 0 and ``lse = -inf``,
    as a single call does.  NaN in a part's lse or in the output of a part
    the row attends propagates to the merged row.  Attention weights of a
    part (``return_weights=True``) are normalized within that part: the
    weights over all keys are ``weights_i * exp(lse_i - lse)``.
    """
    if isinstance(outputs, np.ndarray) or isinstance(lses, np.ndarray):
        raise TypeError("outputs and lses must be sequences (lists / tuples) of arrays, one "
                        "per key part")
    outs = [as_float_array(o, f"outputs[{i}]") for i, o in enumerate(outputs)]
    ls = [as_float_array(x, f"lses[{i}]") for i, x in enumerate(lses)]
    if not outs:
        raise ValueError("merge_attention needs at least one part, got none")
    if len(outs) != len(ls):
        raise ValueError(f"outputs and lses must have one entry per part, got {len(outs)} "
                         f"outputs and {len(ls)} lses")
    for i, (o, x) in enumerate(zip(outs, ls)):
        if o.ndim < 2:
            raise ValueError(f"outputs[{i}] must have shape (..., N, Dv), got {o.shape}")
        if x.shape[-1:] != o.shape[-2:-1]:
            raise ValueError(f"lses[{i}] must have shape (..., N) matching outputs[{i}] "
                             f"{o.shape}, got {x.shape}")
    Dv = outs[0].shape[-1]
    for i, o in enumerate(outs):
        if o.shape[-1] != Dv:
            raise ValueError(f"outputs[{i}] has value dimension {o.shape[-1]}, outputs[0] has {Dv}")
    odt = np.result_type(*outs)
    wdt = np.result_type(odt, *ls, np.float32)
    try:
        shape_l = np.broadcast_shapes(*[x.shape for x in ls], *[o.shape[:-1] for o in outs])
    except ValueError:
        raise ValueError("the outputs and lses of the parts must broadcast to one shape, got "
                         f"outputs {[o.shape for o in outs]} and lses "
                         f"{[x.shape for x in ls]}") from None
    L = [np.broadcast_to(x.astype(wdt, copy=False), shape_l) for x in ls]
    with np.errstate(invalid="ignore", over="ignore"):
        mx = np.full(shape_l, -np.inf, dtype=wdt)
        for x in L:
            mx = np.maximum(mx, np.where(x == -np.inf, -np.inf, x))  # NaN propagates
        safe = np.where(np.isfinite(mx), mx, 0)
        total = np.zeros(shape_l, dtype=wdt)
        acc = np.zeros(shape_l + (Dv,), dtype=wdt)
        for o, x in zip(outs, L):
            live = x != -np.inf
            w = np.where(live, np.exp(x - safe), 0)
            total += w
            # a live part contributes even where its weight underflows, so
            # NaN in its output still reaches the row
            acc += np.where(live[..., None], w[..., None] * o, 0)
        empty = total == 0
        out = np.where(empty[..., None], 0, acc / np.where(empty, 1, total)[..., None])
        lse = np.where(empty, -np.inf, safe + np.log(np.where(empty, 1, total)))
        nan = np.isnan(mx) | np.isnan(total)
        lse = np.where(nan, np.nan, lse)
        out = np.where(nan[..., None], np.nan, out)
    return out.astype(odt, copy=False), lse.astype(wdt, copy=False)
