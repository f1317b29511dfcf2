"""int8 keys and values: symmetric quantization with one scale per row.

:func:`quantize_kv` turns a float array into ``(int8 array, float32
scales)``; ``scaled_dot_product_attention`` accepts such a pair for its key
and / or value and dequantizes tile by tile inside the kernel (a float copy
of K / V is never made).  A row here is a token of a head: the scales have
the array's shape without its last axis.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Literal, Optional, Tuple, Union, overload

import numpy as np

from . import _kv4
from ._kv4 import QuantizedKV
from ._interop import _to_numpy, foreign_arrays
from ._validation import as_float_array

__all__ = ["quantize_kv"]

_F32_MAX = float(np.finfo(np.float32).max)
_F32_TINY = np.float32(np.finfo(np.float32).tiny)


@overload
def quantize_kv(x: Any, axis: int = -1, *, bits: Literal[8] = 8, group_size: None = None,
                rotate: Literal[False] = False,
                symmetric: bool = False) -> Tuple[np.ndarray, np.ndarray]: ...


@overload
def quantize_kv(x: Any, axis: int = -1, *, bits: Literal[4], group_size: Optional[int] = None,
                rotate: bool = False, symmetric: bool = False) -> QuantizedKV: ...


@overload
def quantize_kv(x: Any, axis: int = -1, *, bits: int = 8, group_size: Optional[int] = None,
                rotate: Literal[True], symmetric: bool = False) -> QuantizedKV: ...


@overload
def quantize_kv(x: Any, axis: int = -1, *, bits: int = 8, group_size: Optional[int] = None,
                rotate: bool = False,
                symmetric: bool = False) -> Union[Tuple[np.ndarray, np.ndarray], QuantizedKV]: ...


@foreign_arrays(("x",), keep_bf16=False)
def quantize_kv(x: Any, axis: int = -1, *, bits: int = 8, group_size: Optional[int] = None,
                rotate: bool = False, symmetric: bool = False) -> Any:
    """Quantize keys or values: int8 rows (the default), 4-bit groups, rotated forms.

    With the defaults (``bits=8``, no ``group_size``, ``rotate=False``):
    symmetric int8 quantization with one float32 scale per slice along
    ``axis``, returned as the pair ``(int8 array, float32 scales)``.
    Otherwise (``bits=4`` or ``rotate=True``) a :class:`attncore.QuantizedKV`
    (its class documents the formats' math).

    ``scale = max(|x|) / 127`` over ``axis`` and ``q = round(x / scale)``
    (round half to even), so that ``|q * scale - x| <= scale / 2`` for
    every element.  All-zero slices get scale 0 (and dequantize to 0).

    The scales are float32, and so is the dequantized ``q * scale``:
    ``|x|`` must not exceed the float32 maximum (about 3.4e38; larger
    float64 values raise ``ValueError``), and a scale whose ``127 * scale``
    would round past it is taken one float32 step lower.  A slice so small
    that ``max(|x|) / 127`` is below float32's smallest normal number
    (``max(|x|)`` below about 1.5e-36) gets that quotient rounded *up* to
    a float32 (subnormal, at least about 1.4e-45) rather than to nearest:
    the bound above then still holds for every element, while the slice's
    largest magnitude may map to less than 127 (to 0 when ``max(|x|)`` is
    below about 7e-46).

    Parameters
    ----------
    x : array_like of float
        Keys or values, e.g. shape (..., M, D); must be finite.
    axis : int, default -1
        The axis each scale covers.  The attention kernel takes scales per
        row (token and head), i.e. ``axis=-1``; ``bits=4`` and ``rotate``
        take only -1.
    bits : {8, 4}, keyword-only
        8: int8 codes, one float32 scale per row.  4: two 4-bit codes per
        byte along D, a float16 scale (and offset) per group of
        ``group_size`` elements of a row.
    group_size : int, optional, keyword-only
        4 bits: the elements per scale, an even divisor of D (default 32,
        or D where 32 does not divide it).  8 bits: None or D.
    rotate : bool, default False, keyword-only
        Rotate each row by the normalized Hadamard transform along D before
        quantizing (:func:`attncore.QuantizedKV` Notes): a fast
        Walsh-Hadamard transform, O(D log D) per row.  D a power of two: one
        transform over D; D a multiple of 32 that is not (96, 160, 192,
        ...): a block-diagonal transform over blocks of the largest power of
        two dividing D (96: three blocks of 32); any other D: ValueError.
        Spreads outlier channels over all of them: on SmolLM2-135M the
        int8 cache's KL from float32 went from 1.0e-3 to 2.7e-4
        (``bench/kv4_accuracy.py``).
    symmetric : bool, default False, keyword-only
        4 bits only: symmetric groups (codes -7..7, no offset) instead of
        asymmetric ones (an offset per group, codes 0..15).

    Returns
    -------
    (q, scales) : ndarray of int8 and ndarray of float32
        The defaults: ``q`` of the shape of ``x``, ``scales`` of the shape
        of ``x`` without ``axis``.
    QuantizedKV
        ``bits=4`` or ``rotate=True``.

    Both are of the input's array type (torch in, torch out; see the
    interop rules of :func:`scaled_dot_product_attention`).

    Raises
    ------
    ValueError
        ``bits`` not 4 or 8, a group size that does not divide D (or odd
        for 4 bits), ``rotate`` with an unsupported D, non-finite values,
        values beyond float32 (int8) or float16 (4 bits: ``|x| <= 65504``).
    TypeError
        Non-float ``x``, a non-int ``bits`` / ``group_size`` / ``axis``.

    Notes
    -----
    :func:`attncore.scaled_dot_product_attention` takes the result as a
    ``(q, scales)`` tuple or list for its ``key`` / ``value``.  A tuple or
    list of two is read as such a pair only when its first element is an
    int8 array (NumPy, a torch tensor of ``torch.int8``, or any array whose
    dtype is int8); anything else is an ordinary array-like (e.g. two
    float rows of a key).

    Examples
    --------
    >>> kq, k_scale = attncore.quantize_kv(k)          # doctest: +SKIP
    >>> out = attncore.scaled_dot_product_attention(q, (kq, k_scale), (vq, v_scale))  # doctest: +SKIP
    """
    a = as_float_array(x, "x")
    if isinstance(axis, (bool, np.bool_)) or not isinstance(axis, numbers.Integral):
        raise TypeError(f"axis must be an int, got {type(axis).__name__} {axis!r}")
    if a.ndim == 0:
        raise ValueError("x must have at least one dimension to quantize along, got a 0-d array")
    ax = int(axis)
    if not -a.ndim <= ax < a.ndim:
        raise ValueError(f"axis {ax} is out of range for x of shape {a.shape}")
    ax %= a.ndim
    if type(bits) is int and bits == 8 and group_size is None and rotate is False:
        return quantize_rows(a, ax)
    return _quantize_container(a, ax, bits, group_size, rotate, symmetric)


def _quantize_container(a: np.ndarray, ax: int, bits, group_size, rotate, symmetric):
    """:func:`quantize_kv`'s 4-bit and rotated forms."""
    D = a.shape[-1]
    nb, gs = _kv4.check_format(bits, group_size, rotate, symmetric, D, ax, a.ndim)
    if nb == 8 and not rotate:
        return quantize_rows(a, ax)
    if a.ndim < 2:
        raise ValueError(f"x must have at least 2 dimensions (..., length, D) for bits=4 or "
                         f"rotate=True, got shape {a.shape}")
    big = float(np.max(np.abs(a), initial=0.0))
    if not math.isfinite(big):
        raise ValueError("x must be finite to be quantized: it holds inf or NaN")
    if rotate:
        a = _kv4.fwht(a)
    if nb == 8:
        codes, scales = quantize_rows(a, a.ndim - 1)
        return _kv4.QuantizedKV(codes, scales[..., None], None, 8, D, bool(rotate))
    big = float(np.max(np.abs(a), initial=0.0))
    if big > _kv4._F16_MAX:
        raise ValueError(f"x must lie within the float16 range for bits=4 (|x| <= 65504: "
                         f"the scales and offsets are float16), got max |x| = {big:.6g}"
                         f"{' after the rotation' if rotate else ''}")
    codes, scales, offs = _kv4.quantize4(a, gs, bool(symmetric))
    return _kv4.QuantizedKV(codes, scales, offs, 4, gs, bool(rotate))


def quantize_rows(a: np.ndarray, ax: int) -> Tuple[np.ndarray, np.ndarray]:
    """:func:`quantize_kv` of a float NumPy array ``a`` along its axis
    ``ax`` (0 <= ax < a.ndim), without the argument checks: the int8 KV
    cache quantizes each step's new tokens here (ValueError for non-finite
    or out-of-range values, as quantize_kv).  The rare corrections below
    the normal range and near the float32 maximum run only where a scale
    can need them, the rounding in place: 69 -> 39 us for 8 heads x 1
    token x 64 (Emerald Rapids, a busy machine), the same results."""
    if a.shape[ax] == 0:
        return (np.zeros(a.shape, np.int8),
                np.zeros(a.shape[:ax] + a.shape[ax + 1:], np.float32))
    amax = np.max(np.abs(a), axis=ax, keepdims=True)
    # (a NaN or inf anywhere is the largest maximum's)
    big = float(np.max(amax, initial=0.0))
    if not math.isfinite(big):
        raise ValueError("x must be finite to be quantized: it holds inf or NaN")
    if big > _F32_MAX:
        raise ValueError(f"x must lie within the float32 range (|x| <= {_F32_MAX:.8g}: the "
                         f"scales and the dequantized values are float32), got max |x| = "
                         f"{big:.6g}")
    quot = amax.astype(np.float64)
    quot /= 127.0
    scale = quot.astype(np.float32)
    # below the normal range a float32 scale rounded to nearest can be far
    # below the quotient (or 0): then round it up, so |x| / scale <= 127
    # (no clipping) and the half-step bound holds
    if np.min(scale, initial=np.float32(np.inf)) < _F32_TINY:
        low = (scale < _F32_TINY) & (scale.astype(np.float64) < quot)
        if np.any(low):
            scale = np.where(low, np.nextafter(scale, np.float32(np.inf)), scale)
    # near the float32 maximum, a scale rounded up can make 127 * scale
    # overflow in float32: then one step down (|x| / scale stays below 127.5)
    if big > 0.5 * _F32_MAX:
        with np.errstate(over="ignore"):
            over = np.isinf(scale * np.float32(127))
        if np.any(over):
            scale = np.where(over, np.nextafter(scale, np.float32(0)), scale)
    denom = scale.astype(np.float64)
    denom[denom == 0] = 1.0
    t = a.astype(np.float64)
    t /= denom
    np.rint(t, out=t)
    np.minimum(t, 127.0, out=t)
    np.maximum(t, -127.0, out=t)
    q = t.astype(np.int8)
    return q, np.squeeze(scale, axis=ax)


def quantize_new(a) -> Tuple[np.ndarray, np.ndarray]:
    """The caches' quantization of new keys / values (..., T, D) along the
    last axis: float32 / float64 NumPy arrays straight to
    :func:`quantize_rows`, anything else through :func:`quantize_kv`'s
    checks."""
    if type(a) is np.ndarray and a.dtype in (np.float32, np.float64) and a.ndim:
        return quantize_rows(a, a.ndim - 1)
    return quantize_kv(a)


def _is_int8_array(x: Any) -> bool:
    """Whether ``x`` is an int8 array: a NumPy array, a torch tensor of
    ``torch.int8`` (recognised without importing torch) or another array
    object (JAX, ...) whose dtype NumPy reads as int8."""
    if isinstance(x, np.ndarray):
        return x.dtype == np.int8
    dt = getattr(x, "dtype", None)
    if dt is None or isinstance(x, (np.generic, str, bytes)):
        return False
    if type(x).__module__.split(".")[0] == "torch":
        return str(dt) == "torch.int8"
    if not (hasattr(x, "__array__") or hasattr(x, "__dlpack__")):
        return False
    try:
        return np.dtype(dt) == np.int8
    except TypeError:
        return False


def split_quantized(arg: Any, name: str):
    """``(array, scales)`` for a quantized pair, ``(arg, None)`` otherwise.

    A tuple / list of two whose first element is an int8 array (see
    :func:`_is_int8_array`) is a quantized pair: the int8 array and its
    scales of the array's shape without the last axis.  Any other tuple /
    list is an ordinary array-like, except one that can only be a pair
    whose first element is not int8 (its second element has the first's
    shape without the last axis, which no array-like has): a TypeError.
    A bare int8 array is an error (its scales are missing).
    """
    if isinstance(arg, (tuple, list)) and len(arg) == 2:
        data, scales = arg
        if not _is_int8_array(data):
            sh0, sh1 = _shape_of(data), _shape_of(scales)
            if sh0 is not None and sh1 is not None and len(sh0) >= 1 and sh1 == sh0[:-1]:
                raise TypeError(f"{name}: a quantized pair must hold an int8 array (from "
                                f"attncore.quantize_kv), got dtype {np.asarray(data).dtype}")
            return arg, None
        # torch / JAX parts through the one conversion (a tensor that
        # requires grad is read detached, as every other input)
        d = np.asarray(_to_numpy(data, name)[0])
        scales = _to_numpy(scales, f"{name} scales", True)[0]
        if d.ndim < 2:
            raise ValueError(f"{name}: the int8 array must have at least 2 dimensions "
                             f"(..., length, dim), got shape {d.shape}")
        s = as_float_array(scales, f"{name} scales")
        if s.shape != d.shape[:-1]:
            raise ValueError(f"{name} scales must have the int8 array's shape without its last "
                             f"axis, {d.shape[:-1]}, got {s.shape} (quantize_kv with axis=-1 "
                             f"makes them)")
        if not d.dtype.isnative:
            d = d.astype(d.dtype.newbyteorder("="))
        return d, s
    a = getattr(arg, "dtype", None)
    if a is not None and _is_int8_array(arg):
        raise TypeError(f"{name} is an int8 array without scales: pass the pair "
                        f"({name}_int8, scales) that attncore.quantize_kv returns")
    return arg, None


def _shape_of(x: Any):
    """The shape of an array object (not of a list or a scalar), else None."""
    if isinstance(x, (list, tuple, str, bytes)) or np.isscalar(x):
        return None
    sh = getattr(x, "shape", None)
    try:
        return tuple(int(n) for n in sh) if sh is not None else None
    except TypeError:
        return None


def dequantize(data: np.ndarray, scales: np.ndarray, dtype) -> np.ndarray:
    """``data * scales[..., None]`` as ``dtype`` (a float copy)."""
    return (data.astype(dtype) * scales.astype(dtype)[..., None]).astype(dtype, copy=False)
