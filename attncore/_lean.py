"""Calls whose description is cached by their operands' metadata (private):
the plain calls of :func:`attncore.scaled_dot_product_attention`
(:func:`plain_call`) and the integrations' prepared call
(:func:`attention_prepared`, the Hugging Face backend's lean path).

A small call's checks cost as much as its kernel, and more when the caches
are cold (between a model's layers every distinct Python or NumPy
operation costs microseconds).  Both calls describe an operand metadata
(shapes, strides, dtypes, options, threads, the kernels' process state)
once, through the front door (``attncore._call.check`` ->
``describe``), and keep the description's fields after its operands: a
later call with that metadata puts its own operands in front and launches
(``attncore._call.launch_plain``).  A metadata whose call the kernel cannot
read as it is (copies, conversions, the BLAS path, broadcast query rows,
an empty call) is cached as ``False``: the general path runs every time.
"""
from __future__ import annotations

import numpy as np

from . import _call
from ._core import _sdpa
from ._kv4 import QuantizedKV, fwht
from ._dtypes import _CAST_MIN, HALF_BF16, bfloat16_available, bfloat16_dtype, cast, is_bf16
from ._threads import resolve_num_threads
from ._validation import parse_bool

__all__ = ["plain_call", "attention_prepared", "int8_pair", "int8_container", "container_call"]

# (operands' metadata, options, threads, the kernels' call state) -> (the
# fields of the call's description after its operands, the shape q is read
# in or None, the output's shape, the compute dtype, the result dtype where
# it differs or None, threads, which operands the kernel reads as bfloat16
# bits or None), or False where a call of that metadata needs the general
# path every time
_PLAIN: dict = {}
_PREPARED: dict = {}
_CACHE_MAX = 256
# where a description's int8 scales sit among its fields after the operands
# (a cached description holds None there: each call's own scales go in)
_KS = _call.Call._fields.index("k_scales") - 3
_VS = _call.Call._fields.index("v_scales") - 3
_FMTS = _call.Call._fields.index("fmts") - 3


def int8_pair(x) -> bool:
    """Whether ``x`` is an ``(int8 array, scales)`` tuple of two NumPy
    arrays (:func:`attncore.quantize_kv`'s pair), which a plain call takes."""
    return (type(x) is tuple and len(x) == 2 and type(x[0]) is np.ndarray
            and type(x[1]) is np.ndarray and x[0].dtype == np.int8)


def int8_container(x) -> bool:
    """Whether ``x`` is an 8-bit :class:`~attncore.QuantizedKV` (rotated or
    not) of NumPy arrays in the layout :func:`attncore.quantize_kv` makes:
    int8 codes, float32 scales ``(..., M, 1)``, no offsets -- the kernel's
    ``(int8 array, scales)`` pair with the scales' last axis dropped, which
    :func:`container_call` hands to :func:`plain_call`."""
    if type(x) is not QuantizedKV or x.bits != 8 or x.offsets is not None or x.axis != -1:
        return False
    c, s = x.codes, x.scales
    return (type(c) is np.ndarray and type(s) is np.ndarray and c.dtype == np.int8
            and s.dtype == np.float32 and c.ndim >= 2 and s.shape == c.shape[:-1] + (1,)
            and type(x.group_size) is int and x.group_size == c.shape[-1])


def container_call(query: np.ndarray, key, value, is_causal, scale, enable_gqa,
                   num_threads, precision=None) -> np.ndarray | None:
    """A plain call whose key / value may be 8-bit containers
    (:func:`int8_container`): their ``(codes, scales)`` pairs through
    :func:`plain_call`, a float32 query rotated (``fwht``) where the keys
    are, the output rotated back where the values are -- what the general
    path does (``_call.describe``, ``_call.launch``) without its checks on
    every call (a decode call's rotation cost 130 us of checks, against
    20 us for the plain int8 pair).  None where the general path must
    run."""
    kq, vq = type(key) is QuantizedKV, type(value) is QuantizedKV
    if kq or vq:
        if query.dtype != np.float32:
            return None    # (the general path's conversions decide)
        if kq:
            if key.rotate:
                query = fwht(query)
            key = (key.codes, key.scales[..., 0])
        rot_v = vq and value.rotate
        if vq:
            value = (value.codes, value.scales[..., 0])
    else:
        rot_v = False
    out = plain_call(query, key, value, is_causal, scale, enable_gqa, num_threads, precision)
    return fwht(out) if rot_v and out is not None else out


def _meta(a) -> tuple:
    """An operand's metadata for the plain calls' cache: shape, strides and
    dtype (of both arrays of an int8 pair)."""
    if type(a) is tuple:
        d, s = a
        return (d.shape, d.strides, d.dtype, s.shape, s.strides, s.dtype)
    return (a.shape, a.strides, a.dtype)


def _remember(cache: dict, key: tuple, entry) -> None:
    if len(cache) >= _CACHE_MAX:
        cache.clear()
    cache[key] = entry


# --------------------------------------------------------------------------
# the cache entry of a checked call: its description with the operands out
# --------------------------------------------------------------------------
def _scales_of(a, s: np.ndarray) -> bool:
    """Whether the description's scales ``a`` are the caller's scales ``s``
    as they are, viewed as (..., M, 1): no cast, no copy."""
    return (isinstance(a, np.ndarray) and a.dtype == s.dtype and a.shape == s.shape + (1,)
            and a.strides[:-1] == s.strides
            and a.__array_interface__["data"][0] == s.__array_interface__["data"][0])


def _bits_of(a, b) -> bool:
    """Whether the kernel's operand ``a`` is the bits of the caller's
    bfloat16 operand ``b`` (``_call.bits``: a uint16 view of the same
    memory), which a cached call can take again from ``b``."""
    return (isinstance(a, np.ndarray) and a.dtype == np.uint16 and is_bf16(b.dtype)
            and a.shape == b.shape and a.strides == b.strides
            and a.__array_interface__["data"][0] == b.__array_interface__["data"][0])


def _entry(chk: _call.Checked, query, key, value):
    """The cache entry of the checked call ``chk`` of these operands (see
    ``_PLAIN``), or False where the kernel would not read them as they are."""
    kd = key[0] if type(key) is tuple else key
    vd = value[0] if type(value) is tuple else value
    kr = chk.k if chk.k8 is None else chk.k8[0]
    vr = chk.v if chk.v8 is None else chk.v8[0]
    if (chk.empty or _call.broadcast_query(chk) or chk.q is not query or kr is not kd
            or chk.pol.products == "int8" or vr is not vd
            or (chk.k8 is None) != (type(key) is not tuple)
            or (chk.v8 is None) != (type(value) is not tuple)):
        return False   # (operands converted by the checks: a byte order, say)
    rows = _call.grouped_rows(chk)
    read = chk if rows is None else rows
    c = _call.describe(read)
    pl = c.plan
    ops = ((c.q, read.q), (c.k, kd), (c.v, vd))
    if (c.block_table is not None or c.mask is not None
            or not all(a is b or _bits_of(a, b) for a, b in ops)
            or not (pl.fused or c.N <= _call.SMALL_ROWS) or c.need_weights
            or c.need_lse or c.lse_shift is not None
            or (type(key) is tuple and not _scales_of(c.k_scales, key[1]))
            or (type(value) is tuple and not _scales_of(c.v_scales, value[1]))):
        return False   # operands copied or converted, or the BLAS path
    rdt = chk.pol.result
    bits = tuple(a is not b for a, b in ops)
    tail = list(tuple(c)[3:])
    tail[_KS] = tail[_VS] = None   # (each call's own; the cache holds no data)
    return (tuple(tail), None if rows is None else rows.q.shape,
            chk.bshape + (chk.q.shape[-2], c.Dv), c.compute,
            None if rdt == c.compute else rdt, pl.nthreads, bits if any(bits) else None)


def _aligned(*operands) -> bool:
    """Whether every array of the operands (int8 pairs' both) is aligned:
    the checks copy a misaligned one, so nothing is cached for its
    metadata (which aligned operands share)."""
    return all(a.flags.aligned for x in operands for a in (x if type(x) is tuple else (x,)))


# --------------------------------------------------------------------------
# plain calls of scaled_dot_product_attention
# --------------------------------------------------------------------------
def plain_call(query: np.ndarray, key, value, is_causal, scale,
               enable_gqa, num_threads, precision=None) -> np.ndarray | None:
    """A call without mask or options beyond ``is_causal`` / ``scale`` /
    ``enable_gqa`` / ``num_threads`` on NumPy arrays or ``(int8 array,
    scales)`` key / value pairs of NumPy arrays (and ``precision=
    "int8"`` where the size rule gives it float32 products: a call whose
    products are int8 takes the general path, its int8 stage runs on
    every call), from its description cached by the operands' metadata
    (an int8 pair's checks cost 50-70 us against 10 us for float32
    operands: 8 heads x 1 key x 64, one thread).  None where the general
    path must run (it then raises any error, as it would have)."""
    try:
        nt = resolve_num_threads(num_threads)
    except (TypeError, ValueError):
        return None
    # (the data's alignment is the one property of the operands the key
    # leaves out: _sdpa.sdpa checks it, and a misaligned operand takes the
    # general path, whose checks copy it; int8 pairs' scales are checked
    # below)
    key_ = (query.shape, query.strides, query.dtype, _meta(key), _meta(value),
            type(is_causal), is_causal, type(scale),
            scale, type(enable_gqa), enable_gqa, nt, precision, _sdpa.call_state())
    try:
        hit = _PLAIN.get(key_)
    except TypeError:   # an unhashable argument: the general path says what it is
        return None
    if hit is None:
        if not _aligned(query, key, value):
            return None
        chk = _call.check(query, key, value, None, is_causal, scale,
                          parse_bool(enable_gqa, "enable_gqa"), False, False, num_threads,
                          precision=precision)
        hit = _entry(chk, query, key, value)
        _remember(_PLAIN, key_, hit)
    if hit is False:
        return None
    tail, qread, oshape, cdt, rdt, nthr, bits = hit
    q = query if qread is None else query.reshape(qread)
    if bits:   # bfloat16 operands: the kernel reads their bits (_call.bits)
        q, key, value = (a.view(np.uint16) if b else a for a, b in zip((q, key, value), bits))
    if type(key) is tuple or type(value) is tuple:
        tail = _with_scales(tail, key, value)
        if tail is None:
            return None
        key, value = (x[0] if type(x) is tuple else x for x in (key, value))
    try:
        # the description's fields with the operands in front
        out, finite = _call.launch_plain((q, key, value) + tail, oshape, cdt)
    except _sdpa.Misaligned:
        return None
    if not finite:
        return None  # an overflow or non-finite inputs: the general path decides
    return out if rdt is None else cast(out, rdt, nthr)


def _with_scales(tail: tuple, key, value) -> tuple | None:
    """The cached fields with the int8 pairs' scales as (..., M, 1) views
    (their base must be aligned: None for a misaligned one, which takes the
    general path, whose checks copy it)."""
    tail_ = list(tail)
    for x, at in ((key, _KS), (value, _VS)):
        if type(x) is tuple:
            if not x[1].flags.aligned:
                return None
            tail_[at] = x[1][..., None]
    return tuple(tail_)


# --------------------------------------------------------------------------
# the prepared call of integrations (the Hugging Face backend's lean path)
# --------------------------------------------------------------------------
# the kernels' causal codes as the front door's is_causal
_IS_CAUSAL = {0: False, 1: "upper_left", 2: "lower_right"}


def _prepared_entry(q, k, v, causal, scale, nthreads, window, softcap, bf16_bits):
    """The cache entry of a prepared call: its checks and description
    through the front door (attncore._call.check / describe), from
    bfloat16 views of bfloat16 bits; False where it needs the general path
    (the front door refuses it, or the kernel would not read it as it is)."""
    stand_in = False
    if bf16_bits:
        if bfloat16_available():
            q, k, v = (a.view(bfloat16_dtype()) for a in (q, k, v))
        elif _sdpa.bf16_mode() == 0:
            # no ml_dtypes: described as float16 operands of the same
            # layout -- a bfloat16 call takes the same plan and float32
            # products where bfloat16 products are off -- then read as
            # bfloat16 (the formats, below)
            q, k, v = (a.view(np.float16) for a in (q, k, v))
            stand_in = True
        else:
            return False   # (bfloat16 products: the general path)
    if causal not in _IS_CAUSAL or q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        return False
    try:
        chk = _call.check(q, k, v, None, _IS_CAUSAL[causal], scale, True, False, False,
                          nthreads, window, softcap)
        hit = _entry(chk, q, k, v)
    except (TypeError, ValueError):
        return False   # the general call raises it, or takes it otherwise
    if stand_in and hit:
        tail = list(hit[0])
        tail[_FMTS] = tuple(HALF_BF16 if f else f for f in tail[_FMTS])
        hit = (tuple(tail),) + hit[1:]
    return hit


def attention_prepared(q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: int,
                       scale: float | None, nthreads: int, window: tuple[int, int] = (-1, -1),
                       softcap: float = 0.0, bf16_bits: bool = False) -> np.ndarray | None:
    """Attention of already-checked operands, without the general call's
    argument handling (private: for integrations that call attncore per
    layer and per decoding step, where that handling costs as much as a
    small kernel call -- and more when the caches are cold, as they are
    between a model's layers: every distinct Python or NumPy operation then
    costs microseconds, so the description is cached by metadata and the
    call does as few as it can).

    q (B, H, L, D), k / v (B, Hk, S, D / Dv): NumPy arrays of one dtype,
    Hk dividing H, no mask; ``causal`` a kernel code (0, 1 upper-left, 2
    lower-right), ``nthreads`` >= 1, ``window`` / ``softcap`` as parsed by
    the general call.  Returns the output (B, H, L, Dv) in q's dtype, or
    None when the call needs the general path (other layouts or dtypes,
    the BLAS path, empty shapes, a non-finite output): the caller then uses
    :func:`attncore.scaled_dot_product_attention`.

    ``bf16_bits``: q, k and v are int16 arrays holding bfloat16 bits (a
    bfloat16 tensor's ``view(torch.int16)``); the output then is an int16
    array of bfloat16 bits too (rounded to nearest, ties to even).  Each
    NumPy or torch operation of a call per layer and step costs about a
    microsecond, more with cold caches: the bits save the dtype views on
    both sides.  (Its description is made once per metadata from
    ml_dtypes' bfloat16 views; without ml_dtypes, from float16 views of the
    same layout, read as bfloat16 -- unless bfloat16 products are on: then
    None.)
    """
    dt = q.dtype
    if bf16_bits != (dt == np.int16):
        return None  # bits only as int16, and int16 only as bits
    if (k.dtype != dt or v.dtype != dt
            or not (scale is None or type(scale) is float or type(scale) is int)):
        return None  # (any other scale, as the general call takes or refuses it)
    # (of the kernels' process state, only the path and the bfloat16 mode
    # decide a prepared call, which never takes int8 products: two calls
    # that cost less than _sdpa.call_state's one)
    key_ = (q.shape, q.strides, k.shape, k.strides, v.shape, v.strides, dt, causal, scale,
            nthreads, window, softcap, _sdpa.kernel_path(), _sdpa.bf16_mode())
    try:
        hit = _PREPARED.get(key_)
    except TypeError:   # an unhashable argument
        return None
    if hit is None:
        if not _aligned(q, k, v):
            return None
        hit = _prepared_entry(q, k, v, causal, scale, nthreads, window, softcap, bf16_bits)
        _remember(_PREPARED, key_, hit)
    if hit is False:
        return None
    tail, qread, oshape, cdt, rdt, nthr, bits = hit
    if qread is not None:
        q = q.reshape(qread)
    if bits and not bf16_bits:   # bfloat16 arrays: the kernel reads their bits
        q, k, v = q.view(np.uint16), k.view(np.uint16), v.view(np.uint16)
    try:
        out, finite = _call.launch_plain((q, k, v) + tail, oshape, cdt)
    except _sdpa.Misaligned:
        return None  # (the general call copies a misaligned operand)
    if not finite:
        return None  # an overflow or non-finite inputs: the general call decides
    if bf16_bits:
        out_bits = np.empty(oshape, np.int16)
        _sdpa.cast_half(out, out_bits, HALF_BF16, nthr if out.size >= _CAST_MIN else 1)
        return out_bits
    return out if rdt is None else cast(out, rdt, nthr)
