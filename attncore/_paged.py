"""Attention over a paged key / value cache: :func:`paged_attention`
(private module; :class:`attncore.PagedKVCache` lives in ``_paged_cache``).

flash-attention's paged layout: every sequence's keys and values sit in
fixed-size blocks of one pool, ``k_cache[block, slot, head, :]``, and a
block table row lists a sequence's blocks in order.  The kernel reads the
blocks in place (never a gathered copy), runs one work list over
(sequence, head or head group, query block, key split) costliest first,
and merges key ranges with the exact log-sum-exp rule
(``attncore._core._sdpa.sdpa_paged``).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Literal, NamedTuple, Optional, Tuple

import numpy as np
from numpy.typing import ArrayLike

from . import _call
from ._dtypes import to_float
from ._interop import foreign_arrays
from ._kv4 import QuantizedKV, checked as _kv_checked, fwht, kernel_slots, rotation_blocks
from ._quant import split_quantized
from ._rerun import PIECE, rerun_sequences, subset_heads
from ._threads import resolve_num_threads
from ._validation import (INT32_MAX, as_float_array, check_offsets, head_values,
                          int_sequence, packed_group, parse_bool, parse_scale, parse_softcap,
                          parse_window, to_array)

__all__ = ["paged_attention"]

class _Pool(NamedTuple):
    """A cache operand as the kernel reads it: ``data`` (num_blocks,
    block_size, Hk, D) floats, int8 rows or 4-bit codes (..., D / 2);
    ``scales`` None, int8 scales (num_blocks, block_size, Hk) or 4-bit
    float32 slots (..., D / gs); ``gs`` the 4-bit group size (0: not
    4-bit); ``rotate`` whether the rows were rotated (a QuantizedKV's);
    ``D`` the head dimension; ``kv`` the container (None for arrays and
    pairs)."""
    data: np.ndarray
    scales: Optional[np.ndarray]
    gs: int
    rotate: bool
    D: int
    kv: Any


def _cache_operand(x: Any, name: str, qdtype: np.dtype) -> _Pool:
    """A float cache (num_blocks, block_size, Hk, D) of q's dtype, an int8
    (array, scales) pair with scales (num_blocks, block_size, Hk), or a
    :class:`attncore.QuantizedKV` of such pools (4-bit or rotated)."""
    if isinstance(x, QuantizedKV):
        kv = _kv_checked(x, name)
        if kv.codes.ndim != 4:
            raise ValueError(f"{name} must be 4-D (num_blocks, block_size, Hk, D), got a "
                             f"QuantizedKV of shape {kv.shape}")
        if kv.bits == 8:
            return _Pool(kv.codes, kv.scales[..., 0], 0, kv.rotate, kv.shape[3], kv)
        return _Pool(kv.codes, kernel_slots(kv), kv.group_size, kv.rotate, kv.shape[3], kv)
    data, scales = split_quantized(x, name)
    if scales is None:
        a = as_float_array(data, name, allow_bf16=True)
        if a.ndim != 4:
            raise ValueError(f"{name} must be 4-D (num_blocks, block_size, Hk, D), got shape "
                             f"{a.shape}")
        if a.dtype != qdtype:
            raise ValueError(f"{name} must have q's dtype ({qdtype}) or be an int8 "
                             f"(array, scales) pair or a QuantizedKV, got dtype {a.dtype}")
        return _Pool(a, None, 0, False, a.shape[3], None)
    d = np.asarray(data)
    if d.ndim != 4:
        raise ValueError(f"{name} must be 4-D (num_blocks, block_size, Hk, D), got shape "
                         f"{d.shape}")
    return _Pool(d, as_float_array(scales, f"{name} scales"), 0, False, d.shape[3], None)


def _check_caches(q, k_cache, v_cache, enable_gqa: bool):
    """(q, k pool, v pool, group): the operands checked against each other."""
    qa = as_float_array(q, "q", allow_bf16=True)
    if qa.ndim != 3:
        raise ValueError(f"q must be 3-D (total_q, Hq, D), got shape {qa.shape}")
    kp = _cache_operand(k_cache, "k_cache", qa.dtype)
    vp = _cache_operand(v_cache, "v_cache", qa.dtype)
    if (kp.scales is None) != (vp.scales is None):
        raise ValueError("k_cache and v_cache must both be float arrays or both quantized "
                         "(int8 (array, scales) pairs or QuantizedKV)")
    total_q, Hq, D = qa.shape
    nb, bs, Hk = kp.data.shape[:3]
    if vp.data.shape[:3] != (nb, bs, Hk):
        raise ValueError(f"v_cache must match k_cache in (num_blocks, block_size, Hk) = "
                         f"{(nb, bs, Hk)}, got v_cache shape {vp.data.shape[:3] + (vp.D,)}")
    if kp.D != D:
        raise ValueError(f"k_cache last dimension must equal q's (D = {D}), got k_cache shape "
                         f"{kp.data.shape[:3] + (kp.D,)}")
    if D == 0 or vp.D == 0:
        raise ValueError(f"head dimensions must be >= 1, got q shape {qa.shape} and v_cache "
                         f"shape {vp.data.shape[:3] + (vp.D,)}")
    if bs == 0:
        raise ValueError(f"block_size (k_cache.shape[1]) must be >= 1, got "
                         f"{kp.data.shape[:3] + (kp.D,)}")
    return qa, kp, vp, packed_group(Hq, Hk, enable_gqa, "the caches")


def _check_table(block_table, seq_lens, num_blocks: int, block_size: int):
    """(block_table int32 C-contiguous, seq_lens int64): integer arrays of
    matching lengths, every block a sequence uses within the pool."""
    bt = int_sequence(block_table, to_array(block_table, "block_table"))
    sl = int_sequence(seq_lens, to_array(seq_lens, "seq_lens"))
    for nm, a in (("block_table", bt), ("seq_lens", sl)):
        if a.dtype.kind not in "iu":
            raise TypeError(f"{nm} must be an int32 array, got dtype {a.dtype}")
    if bt.ndim != 2:
        raise ValueError(f"block_table must be 2-D (num_seqs, max_blocks), got shape "
                         f"{bt.shape}")
    if sl.ndim != 1 or sl.shape[0] != bt.shape[0]:
        raise ValueError(f"seq_lens must be 1-D with one length per block table row "
                         f"({bt.shape[0]},), got shape {sl.shape}")
    if sl.size and int(sl.min()) < 0:
        bad = int(np.argmax(sl < 0))
        raise ValueError(f"seq_lens must be >= 0, got seq_lens[{bad}] = {int(sl[bad])}")
    if sl.size and int(sl.max()) > bt.shape[1] * block_size:
        bad = int(np.argmax(sl > bt.shape[1] * block_size))
        raise ValueError(f"seq_lens[{bad}] = {int(sl[bad])} is beyond the blocks the table "
                         f"gives (0 .. max_blocks * block_size = {bt.shape[1]} * {block_size})")
    lens = sl.astype(np.int64)
    nblk = -(-lens // block_size)
    used = np.arange(bt.shape[1])[None, :] < nblk[:, None]
    if used.any():
        ids = bt[used]
        out = (ids < 0) | (ids >= num_blocks)
        if out.any():
            s, j = np.argwhere(used & ((bt < 0) | (bt >= num_blocks)))[0]
            raise ValueError(f"block_table[{s}, {j}] = {int(bt[s, j])} is out of range: the "
                             f"caches hold {num_blocks} blocks")
    return np.ascontiguousarray(bt, dtype=np.int32), lens


def _per_head(x, name: str, S: int, Hq: int, compute, **kw) -> Optional[np.ndarray]:
    """ALiBi slopes / sinks (Hq,) or (num_seqs, Hq) as a flat float64
    (num_seqs * Hq,) array (attncore._validation.head_values)."""
    if x is None:
        return None
    f = head_values(x, name, compute, **kw)
    if f.shape not in ((Hq,), (S, Hq)):
        raise ValueError(f"{name} must have shape (Hq,) = ({Hq},) or (num_seqs, Hq) = "
                         f"({S}, {Hq}), got {f.shape}")
    return np.ascontiguousarray(np.broadcast_to(f, (S, Hq))).reshape(-1)


def _query_offsets(cu_seqlens_q, qshape: tuple, lens: np.ndarray) -> np.ndarray:
    """The checked query offsets (int64, num_seqs + 1) of q (shape
    ``qshape``) for sequences of ``lens`` keys (None: one query each);
    either way a sequence has at most as many queries as keys."""
    S, total_q = lens.shape[0], qshape[0]
    if cu_seqlens_q is None:
        if total_q != S:
            raise ValueError(f"without cu_seqlens_q every sequence has one query: q must have "
                             f"num_seqs = {S} rows, got q shape {qshape}")
        cq = np.arange(S + 1, dtype=np.int64)
    else:
        cq = check_offsets(cu_seqlens_q, "cu_seqlens_q", total_q, "q")
        if cq.shape[0] != S + 1:
            raise ValueError(f"cu_seqlens_q must hold num_seqs + 1 = {S + 1} offsets (one "
                             f"sequence per block table row), got {cq.shape[0]}")
    lq = np.diff(cq)
    if (lq > lens).any():
        s = int(np.argmax(lq > lens))
        raise ValueError(f"sequence {s} has {int(lq[s])} queries but seq_lens[{s}] = "
                         f"{int(lens[s])} keys: a sequence's queries are its last tokens")
    return cq


def _blocks_f64(pool: _Pool, ids: np.ndarray) -> np.ndarray:
    """Blocks ``ids`` of the pool (int8 ones dequantized with their scales,
    a container's as it documents: in the original basis) as one float64
    array, converted a piece at a time."""
    a, s, kv = pool.data, pool.scales, pool.kv
    dst = np.empty((ids.shape[0],) + (a.shape[1:] if kv is None else kv.shape[1:]),
                   dtype=np.float64)
    step = max(1, PIECE // max(1, dst[:1].size))
    # inf / NaN scales of slots no sequence reads make NaN there (0 * inf):
    # not read, so not worth NumPy's warning
    with np.errstate(invalid="ignore", over="ignore"):
        for i in range(0, ids.shape[0], step):
            sel = ids[i:i + step]
            if kv is not None:   # the container's documented values
                dst[i:i + step] = dataclasses.replace(
                    kv, codes=kv.codes[sel], scales=kv.scales[sel],
                    offsets=None if kv.offsets is None else kv.offsets[sel]).dequantize()
            elif s is None:
                dst[i:i + step] = a[sel]
            else:   # dequantize's products, in float64, into place
                np.multiply(a[sel], s[sel][..., None], out=dst[i:i + step], dtype=np.float64)
    return dst
    dst = np.empty((ids.shape[0],) + a.shape[1:], dtype=np.float64)
    step = max(1, PIECE // max(1, a[:1].size))
    # inf / NaN scales of slots no sequence reads make NaN there (0 * inf):
    # not read, so not worth NumPy's warning
    with np.errstate(invalid="ignore", over="ignore"):
        for i in range(0, ids.shape[0], step):
            sel = ids[i:i + step]
            if s is None:
                dst[i:i + step] = a[sel]
            else:   # dequantize's products, in float64, into place
                np.multiply(a[sel], s[sel][..., None], out=dst[i:i + step], dtype=np.float64)
    return dst


def _float64_redo(ops: tuple, bt: np.ndarray, lens: np.ndarray, cq: np.ndarray, kw: dict):
    """The float64 re-run of sequences ``sel`` (query rows ``rows``) of a
    paged call (attncore._rerun.rerun_sequences): only their query rows and
    their own blocks are converted (an int8 pool's dequantized)."""
    qa, kp, vp = ops

    def redo(sel: np.ndarray, rows: np.ndarray):
        lq, sl = np.diff(cq)[sel], lens[sel]
        bs = kp.data.shape[1]
        tab = bt[sel]
        used = np.arange(tab.shape[1])[None, :] < (-(-sl // bs))[:, None]
        ids, local = np.unique(tab[used], return_inverse=True)
        tab2 = np.zeros_like(tab)
        tab2[used] = local.reshape(-1)
        q64 = to_float(qa[rows], np.dtype(np.float64))
        k64, v64 = _blocks_f64(kp, ids), _blocks_f64(vp, ids)
        kw2 = dict(kw, alibi_slopes=subset_heads(kw["alibi_slopes"], sel),
                   sinks=subset_heads(kw["sinks"], sel))
        got = paged_attention(q64, k64, v64, block_table=tab2, seq_lens=sl,
                              cu_seqlens_q=np.concatenate([[0], np.cumsum(lq)]), **kw2)
        return got if kw["return_lse"] else (got, None)
    return redo


@foreign_arrays(("q", "k_cache", "v_cache"),
                ("block_table", "seq_lens", "cu_seqlens_q", "alibi_slopes", "sinks"),
                last_in_compute_dtype="return_lse", half_native=True)
def paged_attention(
    q: ArrayLike, k_cache: Any, v_cache: Any, *, block_table: ArrayLike, seq_lens: ArrayLike,
    cu_seqlens_q: Optional[ArrayLike] = None, is_causal: bool = True,
    scale: Optional[float] = None, window: Optional[Tuple[int, int]] = None,
    softcap: Optional[float] = None, alibi_slopes: Optional[ArrayLike] = None,
    sinks: Optional[ArrayLike] = None, enable_gqa: bool = False, return_lse: bool = False,
    num_threads: Optional[int] = None,
    precision: Optional[Literal["float32", "bfloat16", "int8"]] = None,
) -> Any:
    """Attention of packed queries over a paged key / value cache.

    flash-attention's ``flash_attn_with_kvcache`` layout: the keys and
    values of every sequence sit in fixed-size blocks of one pool,
    ``k_cache[block, slot, head, :]``; row ``s`` of ``block_table`` lists
    sequence ``s``'s blocks in order, and its first ``seq_lens[s]`` slots
    are its keys.  One call serves a mixed batch (decoding sequences and
    prompt chunks of any lengths).  The blocks are read where they are,
    never gathered into a copy; a one-query sequence runs the query heads
    of a key head together (its keys read once for the group); long
    sequences split over keys when threads would idle, and the key ranges
    are merged with the exact log-sum-exp rule.

    Parameters
    ----------
    q : array_like, shape (total_q, Hq, D)
        The new tokens' queries, packed as in
        :func:`attncore.varlen_attention`: sequence ``s`` has rows
        ``cu_seqlens_q[s]:cu_seqlens_q[s + 1]``.  float32, float64,
        bfloat16 or float16 (16-bit ones read in place; torch / JAX in,
        the same type out).
    k_cache, v_cache : array_like, shape (num_blocks, block_size, Hk, D / Dv)
        The caches, of q's dtype, or int8 ``(array, scales)`` pairs as
        :func:`attncore.quantize_kv` makes them (scales of shape
        (num_blocks, block_size, Hk)), or :class:`attncore.QuantizedKV`
        pools (4-bit or rotated: ``quantize_kv(cache, bits=4, ...)``,
        :class:`attncore.PagedKVCache` ``(dtype="int4")``'s blocks), whose
        4-bit codes float32 and 16-bit queries read in place (the
        queries rotated inside the call where the keys are, the output
        rotated back where the values are; float64 queries over their
        sequences' blocks dequantized).  Both quantized or both float.
        Any strides (last axis contiguous to be read in place); never
        modified.
    block_table : array_like of int, shape (num_seqs, max_blocks)
        Each sequence's blocks in order; entries beyond a sequence's last
        block are not read (any value, e.g. -1).
    seq_lens : array_like of int, shape (num_seqs,)
        Keys of each sequence, its new tokens included.
    cu_seqlens_q : array_like of int, shape (num_seqs + 1,), optional
        Where each sequence's queries start in ``q`` (start 0,
        non-decreasing, end ``total_q``).  ``None``: one query per
        sequence (pure decoding).  A sequence's queries are its last
        tokens: at most ``seq_lens[s]`` of them.
    is_causal : bool, default True
        Causal, aligned lower-right per sequence: query ``i`` of ``Nq``
        sees keys ``j <= i + seq_len - Nq``.
    scale : float, optional
        Score scale, ``1 / sqrt(D)`` by default.
    window : (int, int), optional
        Sliding window ``(left, right)`` (-1: unbounded), aligned like the
        causal diagonal; blocks outside it are skipped, not read.
    softcap : float, optional
        ``s -> softcap * tanh(s / softcap)`` on the scaled scores.
    alibi_slopes : array_like, shape (Hq,) or (num_seqs, Hq), optional
        ALiBi: ``-slope * |i + seq_len - Nq - j|`` joins each score.
    sinks : array_like, shape (Hq,) or (num_seqs, Hq), optional
        Attention sink logits: ``exp(sink)`` joins each row's softmax
        denominator.
    enable_gqa : bool
        Allow ``Hk`` to divide ``Hq`` (query head ``h`` reads cache head
        ``h // (Hq // Hk)``).
    return_lse : bool
        Also return the log-sum-exp of each row, shape (total_q, Hq), in
        the compute dtype (float32 for 16-bit inputs).
    num_threads : int, optional
        As for :func:`attncore.scaled_dot_product_attention`.
    precision : {None, 'float32', 'bfloat16', 'int8'}, optional
        The dot products' precision, as for
        :func:`attncore.scaled_dot_product_attention`.  ``"int8"`` is
        accepted and takes float32 products here (the paged kernel has no
        int8 Q.K^T yet; an int8 cache is read in place either way).
        A float32 computation whose output has rows that are not finite
        (sums beyond the float32 range, inf / NaN inputs) computes those
        rows' sequences again in float64, over their own blocks only.

    Returns
    -------
    out : ndarray, shape (total_q, Hq, Dv)
        In q's dtype (float32 for an int8 cache with float32 queries).
    lse : ndarray, shape (total_q, Hq)
        Only with ``return_lse=True``.

    Raises
    ------
    TypeError
        Non-float queries / caches, non-integer tables or lengths.
    ValueError
        Shapes or dtypes of the caches that do not match ``q``; block ids
        out of range; ``seq_lens`` beyond the blocks the table gives; a
        ``cu_seqlens_q`` inconsistent with ``q``; more queries than keys
        in a sequence.

    Examples
    --------
    >>> import numpy as np, attncore
    >>> rng = np.random.default_rng(0)
    >>> k_cache = rng.standard_normal((8, 4, 2, 16), dtype=np.float32)   # 8 blocks of 4
    >>> v_cache = rng.standard_normal((8, 4, 2, 16), dtype=np.float32)
    >>> table = np.array([[5, 1, 7], [2, 0, -1]], dtype=np.int32)
    >>> q = rng.standard_normal((2, 2, 16), dtype=np.float32)              # one query each
    >>> out = attncore.paged_attention(q, k_cache, v_cache, block_table=table,
    ...                                seq_lens=[10, 6])
    >>> out.shape
    (2, 2, 16)
    """
    is_causal = parse_bool(is_causal, "is_causal")
    enable_gqa = parse_bool(enable_gqa, "enable_gqa")
    return_lse = parse_bool(return_lse, "return_lse")
    win = parse_window(window)
    cap = parse_softcap(softcap)
    qa, kp, vp, group = _check_caches(q, k_cache, v_cache, enable_gqa)
    (total_q, Hq, D), (nblocks, bs), Dv = qa.shape, kp.data.shape[:2], vp.D
    bt, lens = _check_table(block_table, seq_lens, nblocks, bs)
    S = lens.shape[0]
    cq = _query_offsets(cu_seqlens_q, qa.shape, lens)
    sc = parse_scale(scale, D)
    nthreads = resolve_num_threads(num_threads)
    pol = _call.policy((qa.dtype, qa.dtype, qa.dtype), ("q", "k_cache", "v_cache"), precision)
    cdt, rdt = pol.compute, pol.result
    longest = int(lens.max()) if S else 0
    slopes = _per_head(alibi_slopes, "alibi_slopes", S, Hq, cdt, max_distance=longest)
    snk = _per_head(sinks, "sinks", S, Hq, cdt, allow_neg_inf=True)
    if max(D, Dv, longest) > INT32_MAX:
        raise ValueError("sequence lengths and head dimensions must be below 2**31")
    lse = np.empty((total_q, Hq), dtype=cdt) if return_lse else None
    if not (total_q and Hq):
        out = np.zeros((total_q, Hq, Dv), dtype=rdt)
        return (out, lse) if return_lse else out
    causal = 2 if is_causal else (3 if win != (-1, -1) else 0)
    redo = _float64_redo((qa, kp, vp), bt, lens, cq, dict(
        is_causal=is_causal, scale=sc, window=window, softcap=softcap,
        alibi_slopes=alibi_slopes, sinks=sinks, enable_gqa=enable_gqa,
        return_lse=return_lse, num_threads=num_threads))
    q4 = (kp.gs, vp.gs)
    if any(q4) and cdt != np.float32:
        # (4-bit pools are read in place by float32 calls: a float64 call
        # runs over its sequences' own blocks dequantized)
        out, lse = redo(np.arange(S), np.arange(total_q))
        return (out, lse) if return_lse else out
    qk = qa
    if kp.rotate:   # rotated keys: the queries rotated the same way
        qk = fwht(to_float(qa, cdt) if qa.dtype != cdt else qa).astype(cdt, copy=False)
    out, _, lse, finite = _call.launch(_call.describe_paged(
        qk, kp.data, kp.scales, vp.data, vp.scales, block_table=bt, seq_lens=lens, cu_q=cq,
        pol=pol, group=group, scale=sc, causal=causal, window=win, softcap=cap, slopes=slopes,
        sinks=snk, nthreads=nthreads, need_lse=return_lse, q4=q4,
        rot_out=rotation_blocks(Dv) if vp.rotate else 0))
    if not finite and cdt == np.float32:
        # float32 sums overflowed (values near the float32 maximum), or
        # finite scores overflowed, or inf / NaN inputs reached the output:
        # those sequences again in float64, over their own blocks
        out, lse = rerun_sequences(out, lse, cq, rdt, redo)
    out = out if rdt == out.dtype else out.astype(rdt)
    return (out, lse) if return_lse else out
