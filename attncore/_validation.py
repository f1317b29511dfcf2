"""Argument checks shared by every public entry point (private).

Each checker takes the user's value and the argument's name and returns the
value in the form the next layer needs, or raises a ``TypeError`` /
``ValueError`` that names the argument and shows the expected and the
actual value, shape or dtype.  ``attncore.functional``, the layers and the
positional encoding all use these, so an error reads the same wherever it
comes from.

Arrays handed to the compiled kernels go through :func:`aligned` (or
:func:`blas_rows`, which includes it): C reads every element through a
typed pointer, which is undefined behaviour on a misaligned address
(``np.frombuffer(raw, np.float32, offset=1)`` is one).
"""
from __future__ import annotations

import math
import numbers
import sys
from typing import Any, Iterable, Literal, Optional, Tuple, overload

import numpy as np

from ._core import _sdpa
from ._dtypes import is_bf16, resolve

__all__ = [
    "to_array", "as_float_array", "aligned", "blas_rows", "parse_bool", "parse_positive_int",
    "parse_float_dtype", "compute_dtype", "parse_causal", "parse_scale", "parse_mask",
    "parse_window", "parse_softcap", "broadcast_batch", "check_operands", "check_mask",
    "batch_shape", "head_values",
]

# the kernels' int indices and strides (in elements) stay below these
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
_F32_MAX = float(np.finfo(np.float32).max)
_F64_MAX = float(np.finfo(np.float64).max)

MASK_BOOL = 1
MASK_FLOAT = 2


def _is_masked_array(x: Any) -> bool:
    # numpy.ma is not imported by ``import numpy``; no masked array can
    # exist before it is, so the common path costs one dict lookup
    ma = sys.modules.get("numpy.ma")
    return ma is not None and isinstance(x, ma.MaskedArray)


def to_array(x: Any, name: str, mask_arg: Optional[str] = None) -> np.ndarray:
    """``x`` as an ndarray (not copied when it is one).

    A ``numpy.ma.MaskedArray`` is refused (the kernels would silently ignore
    its mask); ``mask_arg`` names the argument that takes a mask instead.
    Conversion errors (a ragged nested list, say) name ``name``.
    """
    if type(x) is np.ndarray:
        return x
    if _is_masked_array(x):
        hint = (f"pass the data (x.data) and say which entries take part with {mask_arg}"
                if mask_arg else "pass a plain ndarray (x.filled(...) or x.data)")
        raise TypeError(
            f"{name} must not be a numpy.ma.MaskedArray: attncore would ignore its mask; {hint}")
    if isinstance(x, np.ndarray):
        return x
    try:
        return np.asarray(x)
    except (ValueError, TypeError) as exc:
        raise type(exc)(f"{name} could not be converted to an array: {exc}") from None


def as_float_array(x: Any, name: str, mask_arg: Optional[str] = None,
                   allow_bf16: bool = False) -> np.ndarray:
    """``x`` as an array of float16 / float32 / float64 (and bfloat16 with
    ``allow_bf16``) in native byte order (non-native arrays are
    converted), else TypeError."""
    a = to_array(x, name, mask_arg)
    dt = a.dtype
    if allow_bf16 and is_bf16(dt):
        # (the kernels read a bfloat16's bits as a native uint16)
        return a if dt.isnative else a.astype(dt.newbyteorder("="))
    if dt.kind != "f" or dt.itemsize not in (2, 4, 8):
        allowed = "bfloat16, float16, float32 or float64" if allow_bf16 else \
            "float16, float32 or float64"
        raise TypeError(f"{name} must be a {allowed} array, got dtype {dt}")
    if not dt.isnative:  # e.g. '>f4' from a file: the kernels read native floats
        a = a.astype(dt.newbyteorder("="))
    return a


def aligned(a: np.ndarray) -> np.ndarray:
    """``a`` itself when its address and strides are multiples of its
    element size, else an aligned copy (same shape and values)."""
    if a.flags.aligned:
        return a
    return np.array(a, order="K", copy=True)


# row strides (bytes) whose multiples put a strided operand's rows in the
# same few L1 cache sets
ALIASING_STRIDE = 1024


def aliasing_rows(a: np.ndarray) -> bool:
    """Whether the rows of ``a`` (its last two axes) are apart by a
    multiple of :data:`ALIASING_STRIDE` bytes with gaps between them (the
    heads of a (B, L, H * hd) projection viewed as (B, H, L, hd) at
    H * hd * itemsize = 2 KiB, 4 KiB, ...): read in place, each row's lines
    share their L1 sets with the others'."""
    if a.ndim < 2 or a.shape[-2] < 2:
        return False
    st = a.strides[-2]
    return st > a.shape[-1] * a.itemsize and st % ALIASING_STRIDE == 0


def blas_rows(a: np.ndarray) -> np.ndarray:
    """``a`` itself when a kernel can read it in place as BLAS row blocks
    (aligned, last axis contiguous, row stride at least the row length and
    below 2**31 elements), else a C-contiguous copy."""
    flags = a.flags
    if flags.c_contiguous and flags.aligned:
        return a
    isz = a.itemsize
    st = a.strides
    rows, cols = a.shape[-2], a.shape[-1]
    ok = flags.aligned
    if ok:
        for x in st:
            if x % isz:
                ok = False
                break
    if ok and cols > 1 and st[-1] != isz:
        ok = False
    if ok and rows > 1 and (st[-2] < cols * isz or st[-2] // isz > INT32_MAX):
        ok = False
    if ok:
        return a
    out = np.ascontiguousarray(a)
    return out if out.flags.aligned else out.copy()


def parse_bool(x: Any, name: str) -> bool:
    """``x`` as a bool; only ``bool`` and ``numpy.bool_`` are accepted (a
    string such as ``"False"`` would otherwise read as True)."""
    if x is True or x is False:
        return x
    if isinstance(x, (bool, np.bool_)):
        return bool(x)
    raise TypeError(f"{name} must be a bool (True or False), got {type(x).__name__} {x!r}")


@overload
def parse_positive_int(x: Any, name: str, allow_none: Literal[False] = False) -> int: ...


@overload
def parse_positive_int(x: Any, name: str, allow_none: bool) -> Optional[int]: ...


def parse_positive_int(x: Any, name: str, allow_none: bool = False) -> Optional[int]:
    """``x`` as an int from 1 to 2**31 - 1 (a size: the kernels index
    with 32-bit lengths; ``None`` passes when ``allow_none``)."""
    if x is None and allow_none:
        return None
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name} must be an int >= 1, got {type(x).__name__} {x!r}")
    x = int(x)
    if x < 1:
        raise ValueError(f"{name} must be >= 1, got {x}")
    if x > 2**31 - 1:
        raise ValueError(f"{name} must be below 2**31, got {x}")
    return x


def parse_float_dtype(dtype: Any, name: str = "dtype",
                      itemsizes: Iterable[int] = (2, 4, 8)) -> np.dtype:
    """``dtype`` as a native-byte-order float dtype of one of ``itemsizes``."""
    itemsizes = tuple(itemsizes)
    names = [f"float{8 * n}" for n in itemsizes]
    allowed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{name} must be {allowed}, got {dtype!r}") from None
    if dt.kind != "f" or dt.itemsize not in itemsizes:
        raise TypeError(f"{name} must be {allowed}, got {dt}")
    return dt if dt.isnative else dt.newbyteorder("=")


def compute_dtype(*dtypes: np.dtype) -> Tuple[np.dtype, np.dtype]:
    """(compute dtype, result dtype) of the inputs: attncore._dtypes.resolve.

    float16 / bfloat16 results are computed in float32.
    """
    pol = resolve(dtypes)
    return pol.compute, pol.result


def parse_causal(is_causal: Any) -> int:
    """0 (none), 1 (upper-left) or 2 (lower-right)."""
    if is_causal is False or is_causal is np.False_:
        return 0
    if is_causal is True or is_causal is np.True_:
        return 1
    if isinstance(is_causal, str):
        if is_causal == "upper_left":
            return 1
        if is_causal == "lower_right":
            return 2
    raise ValueError(
        "is_causal must be False, True, 'upper_left' or 'lower_right', got "
        f"{is_causal!r}")


def _positive_real(x: Any, name: str, what: str) -> float:
    """A finite float > 0 (bool and non-reals: TypeError naming ``name``)."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be {what}, got {type(x).__name__} {x!r}")
    v = float(x)
    if not math.isfinite(v) or v <= 0:
        raise ValueError(f"{name} must be finite and > 0, got {v}")
    return v


def parse_scale(scale: Any, D: int) -> float:
    """The score scale: ``1 / sqrt(D)`` for None, else a finite float > 0."""
    if scale is None:
        return 1.0 / math.sqrt(D)
    return _positive_real(scale, "scale", "a positive real number or None")


def parse_window(window: Any, name: str = "window") -> Tuple[int, int]:
    """A sliding window ``(left, right)`` as two ints >= -1 (-1: unbounded
    on that side); ``(-1, -1)`` for None."""
    if window is None:
        return -1, -1
    if (isinstance(window, (str, bytes, set, frozenset, dict)) or not hasattr(window, "__len__")
            or len(window) != 2):
        raise TypeError(f"{name} must be None or a pair (left, right) of ints (-1 for no bound), "
                        f"got {type(window).__name__} {window!r}")
    out = []
    for side, w in zip(("left", "right"), window):
        if isinstance(w, (bool, np.bool_)) or not isinstance(w, numbers.Integral):
            raise TypeError(f"{name} {side} must be an int >= 0 or -1 (no bound), got "
                            f"{type(w).__name__} {w!r}")
        w = int(w)
        if w < -1:
            raise ValueError(f"{name} {side} must be >= 0, or -1 for no bound, got {w}")
        out.append(min(w, 2**31 - 1))
    return out[0], out[1]


def parse_softcap(softcap: Any) -> float:
    """The logit soft cap: 0.0 for None, else a finite float in [1e-30, 1e30]."""
    if softcap is None:
        return 0.0
    c = _positive_real(softcap, "softcap", "None or a positive real number")
    if not 1e-30 <= c <= 1e30:
        # 1 / softcap and softcap * log2(e) must stay finite in float32
        raise ValueError(f"softcap must be between 1e-30 and 1e30, got {c}")
    return c


def head_values(x: Any, name: str, compute: Any, *, allow_neg_inf: bool = False,
                max_distance: Optional[int] = None) -> np.ndarray:
    """Per-head values (ALiBi slopes, attention sinks) as a float64 array
    (a copy; shapes are the caller's to check), checked against the range
    of the compute dtype ``compute``.

    Finite values only (and -inf with ``allow_neg_inf``: no sink).  The
    kernels of a float32 computation (float32, float16 and bfloat16 inputs)
    hold these values in float32, so their magnitude must not exceed the
    float32 maximum (about 3.4e38).  ``max_distance`` (ALiBi slopes): the
    largest ``|i + M - N - j|`` of the call; the term ``slope * distance``
    of every score must stay within the compute dtype's range too.
    """
    a = as_float_array(x, name, allow_bf16=True)
    f = np.array(a, dtype=np.float64)
    bad = ~np.isfinite(f)
    if allow_neg_inf:
        bad &= f != -np.inf
    if bad.any():
        raise ValueError(f"{name} must be finite{' (or -inf: no sink)' if allow_neg_inf else ''}, "
                         f"got {f[bad].flat[0]}")
    f32 = np.dtype(compute) != np.float64
    top = _F32_MAX if f32 else _F64_MAX
    why = ": float32, float16 and bfloat16 inputs are computed in float32" if f32 else ""
    rng = "float32" if f32 else "float64"
    finite = f[np.isfinite(f)]
    d = 1 if max_distance is None else max(1, int(max_distance))
    if finite.size and np.abs(finite).max() > top / d:
        big = finite[np.argmax(np.abs(finite))]
        if max_distance is None:
            raise ValueError(f"{name} must lie within the {rng} range (|{name}| <= {top:.8g}"
                             f"{why}), got {big:.8g}")
        raise ValueError(
            f"{name} must keep the ALiBi term slope * |i + M - N - j| within the {rng} range up "
            f"to this call's largest distance {d} (|{name}| <= {top / d:.8g}{why}), got "
            f"{big:.8g}")
    return f


def parse_mask(mask: Any, name: str, allow_float: bool = True) -> Tuple[np.ndarray, int]:
    """The one mask parser: ``(array, kind)`` with kind ``MASK_BOOL`` or
    ``MASK_FLOAT``.

    bool: True = take part.  float (float16/32/64, only with
    ``allow_float``): added to the scores.  A float mask in non-native byte
    order or at a misaligned address is copied; shapes are the caller's to
    check.
    """
    m = to_array(mask, name)
    dt = m.dtype
    if dt == np.bool_:
        return m, MASK_BOOL
    if allow_float and is_bf16(dt):
        return m, MASK_FLOAT
    if allow_float and dt.kind == "f" and dt.itemsize in (2, 4, 8):
        if not dt.isnative:
            m = m.astype(dt.newbyteorder("="))
        return aligned(m), MASK_FLOAT
    if allow_float:
        raise TypeError(
            f"{name} must be a bool array (True = take part) or a float array "
            f"(added to the scores), got dtype {dt}")
    raise TypeError(f"{name} must be a bool array (True = take part), got dtype {dt}")


# --------------------------------------------------------------------------
# scaled_dot_product_attention's operands (attncore.functional and
# attncore.dask both call these)
# --------------------------------------------------------------------------
def broadcast_batch(shapes, names):
    """NumPy broadcasting of batch shapes, with an error naming the inputs."""
    nd = max((len(s) for s in shapes), default=0)
    out = [1] * nd
    for s in shapes:
        for i, n in enumerate(s):
            j = nd - len(s) + i
            if n != 1:
                if out[j] == 1:
                    out[j] = n
                elif out[j] != n:
                    desc = ", ".join(f"{nm} {tuple(sh)}" for nm, sh in zip(names, shapes))
                    raise ValueError(
                        f"batch dimensions (all but the last two) are not broadcastable: {desc}")
    return tuple(out)


def check_operands(query, key, value):
    """query, key, value as float arrays of matching trailing shapes.

    Dtype, rank and trailing-shape checks only: an array whose memory is
    never read (``numpy.broadcast_to(numpy.zeros((), dtype), shape)``) is
    checked like the array it stands for, which is how ``attncore.dask``
    runs these same checks on dask arrays without computing them.
    """
    q = as_float_array(query, "query", "attn_mask", allow_bf16=True)
    k = as_float_array(key, "key", "attn_mask", allow_bf16=True)
    v = as_float_array(value, "value", "attn_mask", allow_bf16=True)
    for nm, a in (("query", q), ("key", k), ("value", v)):
        if a.ndim < 2:
            raise ValueError(f"{nm} must have at least 2 dimensions (..., length, dim), got shape {a.shape}")
    D, Dk = q.shape[-1], k.shape[-1]
    M, Mv = k.shape[-2], v.shape[-2]
    if Dk != D:
        raise ValueError(
            f"key last dimension must equal query's (D = {D}), got key shape {k.shape} "
            f"and query shape {q.shape}")
    if Mv != M:
        raise ValueError(
            f"value must have as many rows as key (M = {M}) in axis -2, got value shape "
            f"{v.shape} and key shape {k.shape}")
    if D == 0:
        raise ValueError(f"query last dimension (D) must be >= 1, got query shape {q.shape}")
    return q, k, v


def check_mask(attn_mask, N: int, M: int):
    """(mask array of >= 2 dims or None, kind: 0 none, 1 bool, 2 float)."""
    if attn_mask is None:
        return None, 0
    m, kind = parse_mask(attn_mask, "attn_mask")
    if m.ndim < 2:
        m = m.reshape((1,) * (2 - m.ndim) + m.shape)
    if m.shape[-2] not in (1, N) or m.shape[-1] not in (1, M):
        raise ValueError(
            f"attn_mask must be broadcastable to (..., N, M) = (..., {N}, {M}), got shape "
            f"{np.shape(attn_mask)}")
    return m, kind


def packed_group(Hq: int, Hk: int, enable_gqa: bool, what: str) -> int:
    """Query heads per key / value head of a packed or paged call whose
    query has Hq heads and whose ``what`` (the key / value arrays) has Hk:
    equal, or Hk dividing Hq with ``enable_gqa``."""
    if Hk != Hq:
        if not enable_gqa:
            raise ValueError(f"{what} have {Hk} heads and q has {Hq}: pass enable_gqa=True for "
                             f"grouped-query attention (Hk dividing Hq)")
        if Hk == 0 or Hq % Hk:
            raise ValueError(f"with enable_gqa=True the heads of {what} ({Hk}) must divide the "
                             f"q heads ({Hq})")
    return Hq // Hk if Hk else 1


def batch_shape(q, k, v, m, enable_gqa: bool):
    """(broadcast batch shape, query heads per key/value head)."""
    qb, kb, vb = q.shape[:-2], k.shape[:-2], v.shape[:-2]
    mb = () if m is None else m.shape[:-2]
    group = 1
    if enable_gqa:
        if q.ndim < 3 or k.ndim < 3 or v.ndim < 3:
            raise ValueError(
                "enable_gqa=True needs a head axis (-3) on query, key and value, got shapes "
                f"query {q.shape}, key {k.shape}, value {v.shape}")
        Hq, Hk, Hv = q.shape[-3], k.shape[-3], v.shape[-3]
        if Hk != Hv:
            raise ValueError(
                f"key and value must have the same number of heads (axis -3), got key {Hk} "
                f"and value {Hv}")
        if Hk == 0 or Hq % Hk != 0:
            raise ValueError(
                f"with enable_gqa=True the key/value heads (axis -3, {Hk}) must divide the "
                f"query heads ({Hq})")
        group = Hq // Hk
        if group > 1:
            kb = kb[:-1] + (Hq,)
            vb = vb[:-1] + (Hq,)
    if qb == kb == vb and not mb:
        return qb, group
    try:
        return broadcast_batch([qb, kb, vb, mb], ["query", "key", "value", "attn_mask"]), group
    except ValueError as exc:
        if (not enable_gqa and q.ndim >= 3 and k.ndim >= 3
                and k.shape[-3] not in (1, q.shape[-3])
                and q.shape[-3] % max(k.shape[-3], 1) == 0):
            raise ValueError(
                f"{exc}; key/value have {k.shape[-3]} heads (axis -3) and query has "
                f"{q.shape[-3]}: pass enable_gqa=True for grouped-query attention") from None
        raise


_F32_DT, _F64_DT = np.dtype(np.float32), np.dtype(np.float64)
_FLOATS = (_F32_DT, _F64_DT)   # native byte order


def all_finite(a: np.ndarray) -> bool:
    """Whether every element of ``a`` is finite: for the kernels' C-contiguous
    float32 / float64 outputs one vectorized pass in C (no temporary, no
    warning); otherwise NumPy's element-wise test."""
    dt = a.dtype
    if (dt is _F32_DT or dt is _F64_DT or dt in _FLOATS) and a.flags.c_contiguous:
        return _sdpa.all_finite(a)
    with np.errstate(over="ignore", invalid="ignore"):
        return bool(np.isfinite(a).all())



def int_sequence(x: Any, a: np.ndarray) -> np.ndarray:
    """``a`` (``to_array`` of ``x``) as int64 where ``x`` is an empty Python
    sequence (NumPy reads ``[]`` as float64): an empty batch's lengths or
    offsets given as a list are integers like any other list of them."""
    if a.size == 0 and a.dtype.kind == "f" and isinstance(x, (list, tuple)):
        return a.astype(np.int64)
    return a


def check_offsets(cu: Any, name: str, total: int, total_name: str) -> np.ndarray:
    """``cu`` as a C-contiguous int64 array of B + 1 offsets: integer dtype,
    1-D, at least one entry, starting at 0, non-decreasing, ending at
    ``total``."""
    a = int_sequence(cu, to_array(cu, name))
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an int32 (or int64) array of sequence offsets, got "
                        f"dtype {a.dtype}")
    if a.ndim != 1:
        raise ValueError(f"{name} must be 1-D (B + 1,), got shape {a.shape}")
    if a.shape[0] < 1:
        raise ValueError(f"{name} must hold B + 1 >= 1 offsets, got shape {a.shape}")
    if a.dtype.kind == "u" and int(a.max()) > INT64_MAX:
        # uint64 offsets beyond int64 (never valid: past every total): checked
        # as Python ints, so that the messages show the values the array holds
        a = np.array([int(x) for x in a], dtype=object)
    else:
        a = a.astype(np.int64)  # a copy: never the caller's memory
    if a[0] != 0:
        raise ValueError(f"{name} must start at 0, got {name}[0] = {a[0]}")
    d = np.diff(a)
    neg = np.asarray(d < 0, dtype=bool)
    if neg.any():
        i = int(np.argmax(neg))
        raise ValueError(f"{name} must be non-decreasing, got {name}[{i}] = {a[i]} > "
                         f"{name}[{i + 1}] = {a[i + 1]}")
    if a[-1] != total:
        raise ValueError(f"{name} must end at the total length ({total_name}.shape[0] = "
                         f"{total}), got {name}[-1] = {a[-1]}")
    if d.size and d.max() > INT32_MAX:
        raise ValueError(f"{name}: sequence lengths must be below 2**31, got {d.max()}")
    return a
