"""attncore's dtype policy, in one place (private).

Every entry point asks :func:`resolve` which dtype a call computes in,
which dtype it returns and which products it uses; :func:`is_bf16`,
:func:`half_code`, :func:`bfloat16_dtype` and :func:`is_bf16_arg` are the
only places that know how a bfloat16 array looks, and :func:`storage_name`
the one parser of storage dtype arguments (layers, caches, rotary,
interop).

Storage dtypes
    float64, float32, float16 and bfloat16 (NumPy arrays of ``ml_dtypes``'
    ``bfloat16``; torch and JAX bfloat16 arrive as such a view, zero-copy).
    float16 and bfloat16 operands are read in place by the kernels (a tile
    at a time is converted in registers or in a small per-thread buffer).

Promotion (the result dtype of mixed inputs)
    ===========================  =========  ========
    inputs                       computed   returned
    ===========================  =========  ========
    all float64 / any float64    float64    float64
    float32 with anything else   float32    float32
    all float16                  float32    float16
    all bfloat16                 float32    bfloat16
    bfloat16 with float16        TypeError (no common 16-bit type; cast one)
    ===========================  =========  ========

    The log-sum-exp is float64 for float64 calls and float32 otherwise.

Products (``precision=``)
    ``None``: the inputs' own: float64 products for float64, bfloat16
    products (float32 accumulation) for all-bfloat16 inputs on a CPU that
    takes bfloat16 dot products (AVX512_BF16 on AMD: ``_sdpa.bf16_mode()``),
    float32 products otherwise.  ``"float32"``: float32 products.
    ``"bfloat16"``: bfloat16 products on such a CPU, float32 products
    elsewhere (the accuracy is then that of float32).  ``"int8"``: Q.K^T of int8 rows (smoothed keys, per-token
    scales; attncore._int8), P.V as without it.  float64 inputs take no
    reduced precision.
"""
from __future__ import annotations

import sys
from typing import Any, NamedTuple, Optional, Sequence

import numpy as np

__all__ = ["PRECISIONS", "Policy", "resolve", "is_bf16", "is_bf16_arg", "half_code", "cast",
           "bfloat16_dtype", "dtype_name", "storage_name", "parse_precision", "to_float"]

#: the values ``precision=`` takes
PRECISIONS = (None, "float32", "bfloat16", "int8")

# the kernel's operand formats (ac_half.h: AC_H_NONE / AC_H_BF16 / AC_H_F16)
HALF_NONE, HALF_BF16, HALF_F16 = 0, 1, 2

_F16 = np.dtype(np.float16)
_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)


def is_bf16(dt: np.dtype) -> bool:
    """Whether ``dt`` is bfloat16 (``ml_dtypes.bfloat16``)."""
    return dt.kind == "V" and dt.name == "bfloat16"


def storage_name(d: Any, default: Optional[str] = "float32") -> Optional[str]:
    """The name of a storage dtype argument: a string as it is; a torch
    dtype by its name (``torch.bfloat16`` -> ``"bfloat16"``); anything
    ``numpy.dtype`` takes (``ml_dtypes.bfloat16``, a JAX dtype) by NumPy's
    name.  None gives ``default``; anything else None (for the caller to
    refuse)."""
    if d is None:
        return default
    if isinstance(d, str):
        return d
    if type(d).__module__ == "torch":
        return str(d).replace("torch.", "")
    try:
        return np.dtype(d).name
    except (TypeError, ValueError):
        return None


def is_bf16_arg(d: Any) -> bool:
    """Whether a dtype argument, or an array's ``.dtype`` (NumPy with
    ml_dtypes, torch, JAX), is bfloat16 (:func:`storage_name`)."""
    return storage_name(d, None) == "bfloat16"


def half_code(dt: np.dtype) -> int:
    """The kernel's operand format of an array of dtype ``dt``."""
    if dt == _F16:
        return HALF_F16
    if is_bf16(dt):
        return HALF_BF16
    return HALF_NONE


# arrays from this many elements convert on the kernels' threads (smaller
# ones: NumPy's cast, whose call costs less than starting a team)
_CAST_MIN = 65536


def cast(a: np.ndarray, dt: Any, nthreads: int = 1) -> np.ndarray:
    """``a.astype(dt)`` (a new array): between float32 and bfloat16 /
    float16, a C-contiguous ``a`` of at least ``_CAST_MIN`` elements is
    converted by the kernels on ``nthreads`` threads (F16C / integer
    rounding to nearest, ties to even: NumPy's and ml_dtypes' results bit
    for bit, except that a NaN's payload bits may differ -- a NaN stays a
    NaN of its sign; NumPy's and ml_dtypes' casts run single-threaded,
    float32 -> float16 at 0.5 G elements/s on an Intel Xeon); anything
    else by NumPy."""
    dt = np.dtype(dt)
    if a.size >= _CAST_MIN and a.flags.c_contiguous and a.dtype != dt:
        to, frm = half_code(dt), half_code(a.dtype)
        if (to and a.dtype == _F32) or (frm and dt == _F32):
            from ._core import _sdpa

            out = np.empty(a.shape, dt)
            if to:
                _sdpa.cast_half(a, out.view(np.uint16), to, nthreads)
            else:
                _sdpa.cast_half(a.view(np.uint16), out, frm, nthreads)
            return out
    return a.astype(dt)


def dtype_name(dt: np.dtype) -> str:
    return "bfloat16" if is_bf16(dt) else str(dt)


def bfloat16_dtype(purpose: str = "a bfloat16 result") -> np.dtype:
    """NumPy's bfloat16 dtype (from ml_dtypes), or TypeError naming what needed it."""
    ml: Any = sys.modules.get("ml_dtypes")
    if ml is None:
        try:
            import ml_dtypes as ml  # noqa: PLC0415 - optional, only for bfloat16
        except ImportError:
            raise TypeError(f"{purpose} needs the ml_dtypes package (pip install ml_dtypes, "
                            f"or attncore[torch])") from None
    return np.dtype(ml.bfloat16)


def bfloat16_available() -> bool:
    """Whether ml_dtypes can be imported (bfloat16 NumPy arrays)."""
    try:
        bfloat16_dtype()
    except TypeError:
        return False
    return True


def to_float(a: np.ndarray, dt: np.dtype) -> np.ndarray:
    """``a`` in the float dtype ``dt`` (itself when it already is)."""
    return a if a.dtype == dt else a.astype(dt)


class Policy(NamedTuple):
    """How one call treats its dtypes."""

    compute: np.dtype    #: accumulation / kernel dtype (float32 or float64)
    result: np.dtype     #: the output's dtype
    lse: np.dtype        #: the log-sum-exp's dtype
    products: str        #: "float64", "float32", "bfloat16" or "int8" (Q.K^T)


def parse_precision(precision: Any, name: str = "precision") -> Optional[str]:
    """``precision`` checked against :data:`PRECISIONS`."""
    if precision is None:
        return None
    if not isinstance(precision, str):
        raise TypeError(f"{name} must be None, 'float32', 'bfloat16' or 'int8', got "
                        f"{type(precision).__name__} {precision!r}")
    if precision not in PRECISIONS:
        raise ValueError(f"{name} must be None, 'float32', 'bfloat16' or 'int8', got "
                         f"{precision!r}")
    return precision


def resolve(dtypes: Sequence[np.dtype], names: Sequence[str] = (),
            precision: Any = None, *, bf16_products: bool = False) -> Policy:
    """The :class:`Policy` of a call whose float operands have ``dtypes``.

    ``names`` name the operands in errors.  ``bf16_products``: whether
    bfloat16 dot products are on (``_sdpa.bf16_mode()``: AMD's AVX512_BF16
    by default).
    """
    prec = parse_precision(precision)
    d0 = dtypes[0]
    same = all(d == d0 for d in dtypes)
    if same:
        res = d0
    elif any(d == _F64 for d in dtypes):
        res = _F64
    elif any(d == _F32 for d in dtypes):
        res = _F32
    else:
        desc = ", ".join(f"{n} {dtype_name(d)}" for n, d in zip(names, dtypes)) or \
            ", ".join(dtype_name(d) for d in dtypes)
        raise TypeError(f"bfloat16 and float16 inputs have no common 16-bit dtype ({desc}): "
                        f"cast one of them (float32 with either promotes to float32)")
    comp = _F64 if res == _F64 else _F32
    if comp == _F64 and prec is not None:
        raise ValueError(f"precision={prec!r} is for float32, float16 and bfloat16 inputs; "
                         f"float64 inputs are computed in float64 (pass precision=None)")
    if comp == _F64:
        products = "float64"
    elif prec == "int8":
        products = "int8"
    elif prec == "bfloat16" or (prec is None and is_bf16(res) and same):
        products = "bfloat16" if bf16_products else "float32"
    else:
        products = "float32"
    return Policy(comp, res, comp, products)
