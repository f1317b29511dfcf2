"""Public functions: :func:`scaled_dot_product_attention` and
:func:`merge_attention`.

Every call goes through the front door (attncore._call)::

    scaled_dot_product_attention
        |- _lean.container_call -> plain_call: a call without options, from its description
        |  cached by operand metadata (made by check -> describe once)
        `- _attention: empty shapes, a broadcast query row axis, an
           overflowed float32 output (again in float64); else
           _call.check -> _call.describe -> _call.launch
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Iterable, Literal, Sequence, overload

import numpy as np
from numpy.typing import ArrayLike

from . import _call
from ._dtypes import cast, is_bf16
from ._interop import _to_numpy, foreign_arrays
from ._lean import container_call, int8_container, int8_pair
from ._kv4 import QuantizedKV
from ._quant import dequantize, split_quantized
from ._validation import as_float_array, parse_bool, parse_softcap, parse_window

__all__ = ["scaled_dot_product_attention", "merge_attention"]



# --------------------------------------------------------------------------
# scaled_dot_product_attention: checks (the kernel call is planned below)
# --------------------------------------------------------------------------
def _empty_result(chk: _call.Checked, rdt, redo):
    """(out, weights or None, lse or None) when a batch, N, M or Dv is 0.
    ``redo(value)``: the call again with another value (the weights and
    the lse are still defined without value columns: one dummy column)."""
    N, M, Dv = chk.q.shape[-2], chk.k.shape[-2], chk.v.shape[-1]
    bshape = chk.bshape
    nb = math.prod(bshape)
    out = np.zeros(bshape + (N, Dv), dtype=rdt)
    if Dv == 0 and (chk.need_weights or chk.need_lse) and nb and N and M:
        _, w, lse = redo(np.zeros(chk.v.shape[:-1] + (1,), dtype=chk.v.dtype))
        return out, w, lse
    w = np.zeros(bshape + (N, M), dtype=rdt) if chk.need_weights else None
    lse = np.full(bshape + (N,), -np.inf, dtype=chk.pol.compute) if chk.need_lse else None
    if lse is not None and chk.sinks is not None and lse.size:
        # no key: the sink is the whole softmax
        lse[...] = chk.sinks.reshape(bshape)[..., None]
    return out, w, lse


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
if TYPE_CHECKING:
    from typing import TypedDict

    from typing_extensions import Unpack

    class _SdpaOptions(TypedDict, total=False):
        """The keywords of scaled_dot_product_attention that its overloads
        share (all but return_weights and return_lse)."""

        is_causal: bool | Literal["upper_left", "lower_right"]
        scale: float | None
        enable_gqa: bool
        window: tuple[int, int] | None
        softcap: float | None
        num_threads: int | None
        precision: Literal["float32", "bfloat16", "int8"] | None
        alibi_slopes: ArrayLike | None
        sinks: ArrayLike | None


@overload
def scaled_dot_product_attention(
    query: ArrayLike, key: ArrayLike, value: ArrayLike, attn_mask: ArrayLike | None = None, *,
    return_weights: Literal[False] = False, return_lse: Literal[False] = False,
    **options: Unpack[_SdpaOptions],
) -> np.ndarray: ...


@overload
def scaled_dot_product_attention(
    query: ArrayLike, key: ArrayLike, value: ArrayLike, attn_mask: ArrayLike | None = None, *,
    return_weights: Literal[True], return_lse: Literal[False] = False,
    **options: Unpack[_SdpaOptions],
) -> tuple[np.ndarray, np.ndarray]: ...


@overload
def scaled_dot_product_attention(
    query: ArrayLike, key: ArrayLike, value: ArrayLike, attn_mask: ArrayLike | None = None, *,
    return_weights: Literal[False] = False, return_lse: Literal[True],
    **options: Unpack[_SdpaOptions],
) -> tuple[np.ndarray, np.ndarray]: ...


@overload
def scaled_dot_product_attention(
    query: ArrayLike, key: ArrayLike, value: ArrayLike, attn_mask: ArrayLike | None = None, *,
    return_weights: bool = False, return_lse: bool = False, **options: Unpack[_SdpaOptions],
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
        all-bfloat16 inputs on a CPU whose AVX512_BF16 outpaces its
        float32 FMAs -- AMD's, not Intel's; float32 otherwise).
        ``'float32'``: float32 products for any float32 / float16 /
        bfloat16 input.  ``'bfloat16'``: bfloat16 products on such a CPU
        (float32 elsewhere: :func:`attncore.show_config` says which).
        ``'int8'``: Q.K^T of int8 rows with exact int32 sums (vpdpbusd:
        AVX512_VNNI on the AVX-512 path, AVX-VNNI on the AVX2 path;
        float32 products on a CPU and path without such a kernel): the
        keys minus their mean over the keys, channels balanced between
        queries and keys, one symmetric scale per query row and per key
        row; int8 keys given as a ``(data, scales)`` pair are used as
        they are.  P.V: 16-bit integer pairs (values scaled per column and
        per key, probabilities per row, exact int32 sums) where the CPU has
        vpdpwssd, bfloat16 pairs where bfloat16 products are on, float32
        otherwise.  A call on float keys with fewer than 128 query or key
        rows, or below 2e8 multiply-adds (N M (D + Dv) over the batch,
        half of it if causal), takes float32 products: quantizing its
        keys would cost more than the int8 products save (int8 keys given
        keep them).  The weights and the
        lse are those of the int8 scores.  Documented error: 1 - cos
        about 4e-5 on N(0, 1) inputs (docs' variants page).
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
      gives NaN.  A float32-computed call whose output is not all finite
      is computed again in float64: scores that overflow (``|q . k|``
      beyond the float32 range) or an output that does (values near the
      float32 maximum) then come out right, also where operands hold inf /
      NaN that the affected rows do not attend; inf / NaN that take part
      give the same result in float64.  Such a row is NaN in a float64
      call beyond the float64 range.
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
    if (attn_mask is None and window is None and softcap is None
            and (precision is None or (type(precision) is str and precision == "int8"))
            and alibi_slopes is None and sinks is None and return_weights is False
            and return_lse is False and type(query) is np.ndarray
            and (type(key) is np.ndarray or int8_pair(key) or int8_container(key))
            and (type(value) is np.ndarray or int8_pair(value) or int8_container(value))):
        out = container_call(query, key, value, is_causal, scale, enable_gqa, num_threads,
                             precision)
        if out is not None:
            return out
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


def _dequantized(chk: _call.Checked) -> _call.Checked:
    """The weights path multiplies whole rows: int8 keys / values
    dequantized (a copy)."""
    cdt = chk.pol.compute

    def deq(x, x8, xq):
        if xq is not None:   # a QuantizedKV: its values in the original basis
            return xq.dequantize().astype(cdt, copy=False)
        return x if x8 is None else dequantize(x8[0], x8[1], cdt)
    return chk._replace(k=deq(chk.k, chk.k8, chk.kq), v=deq(chk.v, chk.v8, chk.vq), k8=None,
                        v8=None, kq=None, vq=None)


def _finish(c: _call.Call, bshape: tuple, rdt, out, weights, lse):
    """The kernel's results in the call's shapes and result dtype."""
    out = out.reshape(bshape + (c.N, c.Dv))
    if rdt != c.compute:
        out = cast(out, rdt, c.plan.nthreads)
    if weights is not None:
        weights = weights.reshape(bshape + (c.N, c.M))
        if rdt != c.compute:
            weights = cast(weights, rdt, c.plan.nthreads)
    if lse is not None:
        lse = lse.reshape(bshape + (c.N,))
    return out, weights, lse


def _attention(query, key, value, attn_mask, is_causal, scale, enable_gqa: bool,
               return_weights: bool, return_lse: bool, num_threads,
               window: tuple[int, int] = (-1, -1), softcap: float = 0.0, precision=None, *,
               alibi=None, sinks=None, compute_out: bool = False, lse_f64: bool = False):
    """(out, weights or None, lse or None): the checked call, through the
    front door (attncore._call: check, describe, launch).
    ``compute_out``: out and weights stay in the compute dtype (float32 for
    16-bit inputs) instead of the result dtype (attncore.dask merges such
    partial results before rounding them once).  ``lse_f64``: the lse of a
    float32 call recomputed in float64 stays float64 (a partial lse beyond
    the float32 range must not become +-inf before the merge)."""
    opts = (is_causal, scale, enable_gqa, return_weights, return_lse, num_threads, window,
            softcap, precision)
    kw = dict(alibi=alibi, sinks=sinks, compute_out=compute_out, lse_f64=lse_f64)
    chk = _call.check(query, key, value, attn_mask, *opts, alibi=alibi, sinks=sinks)
    if ((return_weights and (chk.k8 is not None or chk.v8 is not None))
            or (chk.pol.compute == _call.F64 and (_call._q4(chk.kq) or _call._q4(chk.vq)))):
        # (4-bit keys / values are read in place by float32 calls only)
        chk = _dequantized(chk)
    rdt = chk.pol.compute if compute_out else chk.pol.result
    if chk.empty:
        return _empty_result(chk, rdt, lambda val: _attention(
            chk.q, key, val, attn_mask, *opts, **kw))
    if _call.broadcast_query(chk):
        # compute one row and broadcast it (never copy the N identical rows)
        return _broadcast_rows(
            _attention(chk.q[..., :1, :], key, value, chk.mask, *opts, **kw),
            chk.bshape, chk.q.shape[-2])
    rows = _call.grouped_rows(chk)
    c = _call.describe(chk if rows is None else rows)
    out, weights, lse, finite = _call.launch(c)
    if rows is not None:  # (B Hk, group, Dv) is (B Hq, 1, Dv) in memory
        c = c._replace(N=1)
    if not finite and c.compute == _call.F32:
        # float32 accumulation overflowed (values near the float32 maximum:
        # the unnormalized P.V sums exceed it before the division by the row
        # sum), or finite scores did, or inf / NaN inputs reached the output:
        # the call again in float64 (_float64_rerun)
        return _float64_rerun((query, key, value), rdt, attn_mask, *opts[:-1], **kw)
    return _finish(c, chk.bshape, rdt, out, weights, lse)


def _float64_operands(operands) -> list:
    """(query, key, value) as float64 arrays (int8 pairs dequantized)."""
    ops = [as_float_array(operands[0], "query", allow_bf16=True).astype(np.float64)]
    for x, name in zip(operands[1:], ("key", "value")):
        if isinstance(x, QuantizedKV):
            ops.append(x.dequantize().astype(np.float64))
            continue
        x, s = split_quantized(x, name)
        ops.append(dequantize(x, s, np.float64) if s is not None
                   else as_float_array(x, name, allow_bf16=True).astype(np.float64))
    return ops


def _float64_rerun(operands, rdt, attn_mask, *args, **kwargs):
    """A float32-computed call whose output is not finite, computed again in
    float64 (one float64 copy of the operands) and returned in the first
    call's dtypes: output and weights in ``rdt``, the lse in float32.  The
    output overflowed (values near the float32 maximum), or finite scores
    did (rows the kernels flag NaN), or inf / NaN inputs reached it.  Also
    where some operand is not finite: an inf / NaN the rows do not attend
    (a masked-out key's value, another sequence's rows) must not keep an
    overflowed row NaN; inf / NaN that take part come out the same in
    float64."""
    ops = _float64_operands(operands)
    out, weights, lse = _attention(*ops, attn_mask, *args, **kwargs)
    if lse is not None and not kwargs.get("lse_f64"):
        with np.errstate(over="ignore"):  # an lse beyond float32 is -inf / inf there
            lse = lse.astype(np.float32)
    return (out.astype(rdt), None if weights is None else weights.astype(rdt), lse)


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
        In the outputs' (promoted) dtype: bfloat16 parts (ml_dtypes
        arrays, torch / JAX tensors) give bfloat16; bfloat16 beside
        another dtype promotes as float32 would.
    lse : ndarray, shape (..., N)
        The log-sum-exp over all the keys (float32 at least).
        Both are NumPy arrays whatever the parts were (the parts may be any
        arrays NumPy reads: torch CPU tensors, JAX arrays, ...).

    Notes
    -----
    A row that attends no key in a part (``lse_i = -inf``) takes nothing
    from it; a row empty in every part gives output 0 and ``lse = -inf``,
    as a single call does.  NaN in a part's lse or in the output of a part
    the row attends propagates to the merged row.  The sums run in float64,
    so outputs near the float maximum merge without overflowing.  A part
    with ``lse_i = +inf`` (an lse beyond the float range, as a float32 call
    computed again in float64 returns it) takes all the weight of its row;
    two such parts make the row NaN.  A part with ``lse_i =
    -inf`` but a nonzero output row has an lse beyond the float range (a
    float32 call computed again in float64 whose scores lie below -3.4e38):
    the merged row is NaN unless another part has a finite lse (whose keys
    then take all the weight).  Attention weights of a
    part (``return_weights=True``) are normalized within that part: the
    weights over all keys are ``weights_i * exp(lse_i - lse)``.
    """
    outs, ls = _merge_parts(outputs, lses)
    odt, ldt, wdt = _merge_dtypes(outs, ls)
    try:
        shape_l = np.broadcast_shapes(*[x.shape for x in ls], *[o.shape[:-1] for o in outs])
    except ValueError:
        raise ValueError("the outputs and lses of the parts must broadcast to one shape, got "
                         f"outputs {[o.shape for o in outs]} and lses "
                         f"{[x.shape for x in ls]}") from None
    L = [np.broadcast_to(x.astype(wdt, copy=False), shape_l) for x in ls]
    with np.errstate(invalid="ignore", over="ignore"):
        out, lse, mx, nan = _merge_sums(outs, L, shape_l, wdt)
        out, lse = _merge_beyond_range(outs, L, mx, nan, out, lse)
    return out.astype(odt, copy=False), lse.astype(ldt, copy=False)


def _merge_parts(outputs, lses) -> tuple[list, list]:
    """The parts of :func:`merge_attention` as float arrays (bfloat16 kept),
    checked: sequences of as many outputs (..., N, Dv) as lses (..., N),
    one Dv."""
    for name, parts in (("outputs", outputs), ("lses", lses)):
        if isinstance(parts, (np.ndarray, str, bytes)) or not isinstance(parts, Iterable):
            raise TypeError(f"{name} must be a sequence (list / tuple) of arrays, one per key "
                            f"part, got {type(parts).__name__}")
    # bfloat16 parts (ml_dtypes arrays, torch / JAX tensors) are merged too:
    # scaled_dot_product_attention returns them for bfloat16 inputs
    outs = [as_float_array(_to_numpy(o, f"outputs[{i}]", True)[0], f"outputs[{i}]",
                           allow_bf16=True) for i, o in enumerate(outputs)]
    ls = [as_float_array(_to_numpy(x, f"lses[{i}]", True)[0], f"lses[{i}]", allow_bf16=True)
          for i, x in enumerate(lses)]
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
    return outs, ls


def _merge_dtypes(outs: list, ls: list) -> tuple[np.dtype, np.dtype, np.dtype]:
    """(output dtype, lse dtype, dtype of the sums) of a merge."""
    # bfloat16 beside another dtype promotes as float32 (bfloat16 and
    # float16 have no common NumPy dtype)
    dts = [o.dtype for o in outs]
    odt = dts[0] if len(set(dts)) == 1 else \
        np.result_type(*[np.float32 if is_bf16(d) else d for d in dts])
    # the lse's dtype; the sums run in float64 whatever the parts (float32
    # sums of values near the float32 maximum overflowed)
    ldt = np.result_type(np.float32, *[np.float32 if is_bf16(d) else d
                                       for d in [odt] + [x.dtype for x in ls]])
    wdt = np.dtype(np.float64) if ldt.itemsize <= 8 else ldt
    return odt, ldt, wdt


def _merge_sums(outs: list, L: list, shape_l: tuple, wdt: np.dtype):
    """(out, lse, the rows' largest lse, the NaN rows): the parts' outputs
    weighted by ``exp(lse_i - lse)``; empty rows 0 and -inf."""
    mx = np.full(shape_l, -np.inf, dtype=wdt)
    for x in L:
        mx = np.maximum(mx, np.where(x == -np.inf, -np.inf, x))  # NaN propagates
    safe = np.where(np.isfinite(mx), mx, 0)
    total = np.zeros(shape_l, dtype=wdt)
    acc = np.zeros(shape_l + (outs[0].shape[-1],), dtype=wdt)
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
    return out, lse, mx, np.isnan(mx) | np.isnan(total)


def _merge_beyond_range(outs: list, L: list, mx, nan, out, lse):
    """(out, lse) with the rows whose parts' lse lie beyond the float range
    (-inf beside a nonzero output, +inf) and the NaN rows resolved."""
    # a part whose lse is -inf but whose output is not 0 is no empty
    # part: its lse lies beyond the float range (a float32 result of a
    # float64 re-run).  With no finite lse beside it, the row has no
    # answer in this dtype: NaN, not the 0 of an empty row.
    for o, x in zip(outs, L):
        nan |= (mx == -np.inf) & (x == -np.inf) & np.any(o != 0, axis=-1)
    # a part whose lse is +inf lies beyond the float range above: it takes
    # all the weight; two such parts cannot be weighed against each other
    n_top = sum((x == np.inf).astype(np.intp) for x in L)
    nan |= n_top > 1
    one = (n_top == 1) & ~nan
    if one.any():
        for o, x in zip(outs, L):
            out = np.where((one & (x == np.inf))[..., None], o, out)
        lse = np.where(one, np.inf, lse)
    lse = np.where(nan, np.nan, lse)
    out = np.where(nan[..., None], np.nan, out)
    return out, lse
