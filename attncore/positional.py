"""Sinusoidal positional encoding.

Two layouts of the same table:

* ``"interleaved"`` (Attention Is All You Need)::

      PE[p, 2i]     = sin(p * base ** (-2i / dim))
      PE[p, 2i + 1] = cos(p * base ** (-2i / dim))

* ``"split"``: the same sines in the first half of the columns and the same
  cosines in the second half (the tensor2tensor / Marian arrangement)::

      PE[p, i]         = sin(p * base ** (-2i / dim)),  i < ceil(dim / 2)
      PE[p, h + i]     = cos(p * base ** (-2i / dim)),  h = ceil(dim / 2), i < floor(dim / 2)

Both are computed in float64 and cast to the requested dtype at the end, so
an encoding at position 100 000 is as exact as the output dtype allows.
"""
from __future__ import annotations

import math
import numbers

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from ._validation import _positive_real, as_float_array, parse_float_dtype, parse_positive_int, to_array
from ._interop import foreign_arrays

__all__ = ["sinusoidal_encoding", "add_positional_encoding"]

_LAYOUTS = ("interleaved", "split")
_MODES = ("add", "concat")


def _check_base(base) -> float:
    """``base`` as a float: a real number (TypeError), finite and > 1."""
    try:
        b = _positive_real(base, "base", "a real number > 1")
    except ValueError:          # not finite, or <= 0
        b = 0.0
    if b <= 1.0:
        raise ValueError(f"base must be finite and > 1, got {float(base)}")
    return b


def _check_layout(layout) -> str:
    if not isinstance(layout, str) or layout not in _LAYOUTS:
        raise ValueError(f"layout must be 'interleaved' or 'split', got {layout!r}")
    return layout


def _positions(length_or_positions) -> np.ndarray:
    """float64 positions from an int length or an array of positions."""
    x = length_or_positions
    if isinstance(x, (bool, np.bool_)):
        raise TypeError("length_or_positions must be an int length or an array of positions, "
                        "got bool")
    if isinstance(x, numbers.Integral):
        n = int(x)
        if n < 0 or n > 2**53:
            raise ValueError(f"length_or_positions as a length must be >= 0 and at most 2**53 "
                             f"(positions exact in float64), got {n}")
        return np.arange(n, dtype=np.float64)
    if isinstance(x, numbers.Real):
        # a bare float is ambiguous (a length? one position?): make it explicit
        raise TypeError(
            f"length_or_positions must be an int length or an array of positions, got "
            f"{type(x).__name__} {x!r}; pass int({x!r}) for a length or [{x!r}] for one position")
    p = to_array(x, "length_or_positions")
    if p.dtype.kind not in "iuf":
        raise TypeError("length_or_positions must be an int length or an array of integer or "
                        f"float positions, got dtype {p.dtype}")
    if p.dtype.kind == "f" and not np.all(np.isfinite(p)):
        raise ValueError("length_or_positions must be finite")
    return p.astype(np.float64)


def _table(pos: np.ndarray, dim: int, base: float, layout: str) -> np.ndarray:
    """float64 encoding, shape pos.shape + (dim,)."""
    n_sin = (dim + 1) // 2          # columns 0, 2, 4, ... of the interleaved layout
    n_cos = dim // 2                # columns 1, 3, 5, ...
    inv_freq = np.power(base, -2.0 * np.arange(n_sin, dtype=np.float64) / dim)
    angle = pos[..., None] * inv_freq                    # (..., n_sin)
    out = np.empty(pos.shape + (dim,), dtype=np.float64)
    if layout == "interleaved":
        np.sin(angle, out=out[..., 0::2])
        np.cos(angle[..., :n_cos], out=out[..., 1::2])
    else:
        np.sin(angle, out=out[..., :n_sin])
        np.cos(angle[..., :n_cos], out=out[..., n_sin:])
    return out


@foreign_arrays(("length_or_positions",), dtype_arg="dtype")
def sinusoidal_encoding(length_or_positions: int | ArrayLike, dim: int, *, base: float = 10000.0,
                        layout: str = "interleaved", dtype: DTypeLike = np.float32) -> np.ndarray:
    """Sinusoidal positional encoding table.

    Parameters
    ----------
    length_or_positions : int or array_like
        An int ``L`` gives positions ``0 .. L-1`` and a table of shape
        ``(L, dim)``.  An array of positions (integer or float, any shape,
        e.g. ``np.arange(t, t + 1)`` for one decoding step, or fractional
        positions) gives shape ``positions.shape + (dim,)``.
    dim : int
        Number of features, >= 1.
    base : float, default 10000.0
        Wavelength base; frequency ``i`` is ``base ** (-2i / dim)``.
    layout : {'interleaved', 'split'}, default 'interleaved'
        ``'interleaved'``: sin at even columns, cos at odd columns
        (Vaswani et al.).  ``'split'``: all sines in the first
        ``ceil(dim / 2)`` columns, then the cosines (tensor2tensor / Marian
        arrangement); the same values as ``'interleaved'``, permuted.
    dtype : dtype, default float32
        float16, float32 or float64 result (None: float32).  The table is computed in
        float64 and cast once.

    Returns
    -------
    ndarray, shape (L, dim) or positions.shape + (dim,)

    Notes
    -----
    * **Odd** ``dim``: the formula is applied column by column, so there is
      one more sine than cosine: column ``dim - 1`` (interleaved) or column
      ``ceil(dim / 2) - 1`` (split) is ``sin(p * base ** (-(dim - 1) / dim))``.
      No zero column is padded (tensor2tensor and fairseq pad one).
    * tensor2tensor and fairseq space their frequencies as
      ``base ** (-i / (h - 1))`` with ``h = dim // 2`` instead of
      ``base ** (-2i / dim)``.  For an even ``dim`` that is this function
      with ``layout='split'`` and ``base=base ** (h / (h - 1))``.

    Examples
    --------
    >>> pe = sinusoidal_encoding(50, 512)                    # (50, 512) float32
    >>> step = sinusoidal_encoding(np.array([17]), 512)      # position 17 only
    """
    dim = parse_positive_int(dim, "dim")
    base = _check_base(base)
    layout = _check_layout(layout)
    dt = parse_float_dtype(np.float32 if dtype is None else dtype)
    pos = _positions(length_or_positions)
    return _table(pos, dim, base, layout).astype(dt, copy=False)


@foreign_arrays(("x",))
def add_positional_encoding(x: ArrayLike, *, offset: float = 0, mode: str = "add",
                            base: float = 10000.0, layout: str = "interleaved") -> np.ndarray:
    """Add (or append) a sinusoidal encoding of the positions along axis -2.

    Parameters
    ----------
    x : array_like, shape (..., L, dim)
        float16, float32 or float64 features; row ``j`` of axis -2 is
        position ``offset + j``.  Never modified.
    offset : int or float, default 0
        Position of the first row, e.g. the number of tokens already decoded.
    mode : {'add', 'concat'}, default 'add'
        ``'add'``: ``x + PE`` (shape unchanged).  ``'concat'``: the
        ``dim``-wide encoding is appended after the features of every row,
        ``concatenate([x_j, PE_j])``, giving shape (..., L, 2 * dim).
    base, layout
        As in :func:`sinusoidal_encoding`.

    Returns
    -------
    ndarray
        A new array of x's dtype (the encoding is computed in float64 and
        cast to it).
    """
    a = as_float_array(x, "x")
    if a.ndim < 2:
        raise ValueError(f"x must have at least 2 dimensions (..., length, dim), got shape {a.shape}")
    if not isinstance(mode, str) or mode not in _MODES:
        raise ValueError(f"mode must be 'add' or 'concat', got {mode!r}")
    if isinstance(offset, (bool, np.bool_)) or not isinstance(offset, numbers.Real):
        raise TypeError(f"offset must be an int or a float, got {type(offset).__name__} {offset!r}")
    if not math.isfinite(float(offset)):
        raise ValueError(f"offset must be finite, got {offset}")
    L, dim = a.shape[-2], a.shape[-1]
    if dim < 1:
        raise ValueError(f"x last dimension (dim) must be >= 1, got shape {a.shape}")
    pos = float(offset) + np.arange(L, dtype=np.float64)
    pe = _table(pos, dim, _check_base(base), _check_layout(layout)).astype(a.dtype, copy=False)
    if mode == "add":
        return a + pe
    out = np.empty(a.shape[:-1] + (2 * dim,), dtype=a.dtype)
    out[..., :dim] = a
    out[..., dim:] = pe
    return out
