"""int8 keys and values: symmetric quantization with one scale per row.

:func:`quantize_kv` turns a float array into ``(int8 array, float32
scales)``; ``scaled_dot_product_attention`` accepts such a pair for its key
and / or value and dequantizes tile by tile inside the kernel (a float copy
of K / V is never made).  A row here is a token of a head: the scales have
the array's shape without its last axis.
"""
from __future__ import annotations

import numbers
from typing import Any, Tuple

import numpy as np

from ._interop import foreign_arrays
from ._validation import as_float_array

__all__ = ["quantize_kv"]


@foreign_arrays(("x",), keep_bf16=False)
def quantize_kv(x: Any, axis: int = -1) -> Tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 quantization with one float32 scale per slice along ``axis``.

    ``scale = max(|x|) / 127`` over ``axis`` and ``q = round(x / scale)``
    (round half to even), so that ``|q * scale - x| <= scale / 2`` for
    every element.  All-zero slices get scale 0 (and dequantize to 0).

    Parameters
    ----------
    x : array_like of float
        Keys or values, e.g. shape (..., M, D); must be finite.
    axis : int, default -1
        The axis each scale covers.  The attention kernel takes scales per
        row (token and head), i.e. ``axis=-1``.

    Returns
    -------
    q : ndarray of int8, the shape of ``x``
    scales : ndarray of float32, the shape of ``x`` without ``axis``
        Of the input's array type (torch in, torch out; see the interop
        rules of :func:`scaled_dot_product_attention`).

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
    if a.size and not np.all(np.isfinite(a)):
        raise ValueError("x must be finite to be quantized: it holds inf or NaN")
    if a.shape[ax] == 0:
        return (np.zeros(a.shape, np.int8),
                np.zeros(a.shape[:ax] + a.shape[ax + 1:], np.float32))
    amax = np.max(np.abs(a), axis=ax, keepdims=True).astype(np.float64)
    scale = (amax / 127.0).astype(np.float32)
    denom = np.where(scale == 0, 1.0, scale.astype(np.float64))
    q = np.clip(np.rint(a.astype(np.float64) / denom), -127, 127).astype(np.int8)
    return q, np.squeeze(scale, axis=ax)


def split_quantized(arg: Any, name: str):
    """``(array, scales)`` for a quantized pair, ``(arg, None)`` otherwise.

    A tuple / list of two is a quantized pair: an int8 array and its
    scales of the array's shape without the last axis.  A bare int8 array
    is an error (its scales are missing).
    """
    if isinstance(arg, (tuple, list)) and len(arg) == 2 and not np.isscalar(arg[0]) \
            and np.ndim(arg[0]) >= 1 and (
                getattr(arg[0], "dtype", None) is not None or isinstance(arg[0], np.ndarray)):
        data, scales = arg
        d = np.asarray(data)
        if d.dtype != np.int8:
            raise TypeError(f"{name}: a quantized pair must hold an int8 array (from "
                            f"attncore.quantize_kv), got dtype {d.dtype}")
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
    if a is not None and np.dtype(a) == np.int8:
        raise TypeError(f"{name} is an int8 array without scales: pass the pair "
                        f"({name}_int8, scales) that attncore.quantize_kv returns")
    return arg, None


def dequantize(data: np.ndarray, scales: np.ndarray, dtype) -> np.ndarray:
    """``data * scales[..., None]`` as ``dtype`` (a float copy)."""
    return (data.astype(dtype) * scales.astype(dtype)[..., None]).astype(dtype, copy=False)
