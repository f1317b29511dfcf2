"""``attncore.rotary_embedding``: rotary position embeddings (RoPE).

Dispatch::

    rotary_embedding(x, positions, ...)
        |- validate x (float16/32/64, (..., L, D), any strides), positions
        |  ((L,) or (B, L) integers in the int32 range), the frequencies
        |  (base or inv_freq), layout, rotary_dim, out
        |- element offsets of the leading axes (small: one per (..., L, D) row
        |  block; x itself is read in place, never copied)
        `- _core._rotary.rotary: blocks of positions over an OpenMP team; each
           block's cos / sin table computed once in double (per-thread
           scratch) and applied to every head that shares the positions

The layer side (:class:`attncore.MultiHeadAttention` with ``rotary=``) uses
:func:`parse_rotary` once and :func:`apply_rotary` per call (in place on its
projection buffer).
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Literal

import numpy as np
from numpy.typing import ArrayLike

from ._core import _rotary
from ._dtypes import is_bf16_arg
from ._interop import foreign_arrays, weight_array
from ._threads import threads_for
from ._validation import INT32_MAX, _positive_real, aligned, as_float_array, to_array

__all__ = ["rotary_embedding", "parse_rotary", "apply_rotary", "rotary_positions",
           "ROTARY_KEYS"]

_LAYOUTS = ("half", "interleaved")
_POS_MIN, _POS_MAX = -INT32_MAX - 1, INT32_MAX
_DEFAULT_BASE = 10000.0
# the keys of a MultiHeadAttention rotary configuration
ROTARY_KEYS = ("base", "inv_freq", "layout", "rotary_dim")
# bytes of the cos / sin table of one work item (the kernel's scratch)
_TABLE_BYTES = 32768


# --------------------------------------------------------------------------
# argument checks
# --------------------------------------------------------------------------
def _parse_layout(layout: Any) -> bool:
    """True for "interleaved", False for "half"."""
    if not isinstance(layout, str) or layout not in _LAYOUTS:
        raise ValueError(f"layout must be 'half' (GPT-NeoX / Llama rotate_half) or "
                         f"'interleaved' (GPT-J / RoFormer pairs), got {layout!r}")
    return layout == "interleaved"


def _parse_inv_freq(inv_freq: Any) -> np.ndarray:
    """A 1-D finite real array as a new float64 C-contiguous array."""
    a = to_array(inv_freq, "inv_freq")
    if a.dtype.kind not in "fiu":
        raise TypeError(f"inv_freq must be a real float (or integer) array, got dtype {a.dtype}")
    if a.ndim != 1 or a.shape[0] == 0:
        raise ValueError(f"inv_freq must be a non-empty 1-D array of rotary_dim / 2 "
                         f"frequencies, got shape {a.shape}")
    f = np.array(a, dtype=np.float64, copy=True)
    if not np.isfinite(f).all():
        raise ValueError("inv_freq must be finite (it holds inf or NaN)")
    return f


def _parse_rotary_dim(rotary_dim: Any, D: int | None, n_freq: int | None) -> int:
    """The number of rotated channels: even, >= 2, <= D, 2 * n_freq when
    inv_freq is given.  ``D`` None: not known yet (checked later)."""
    if rotary_dim is None:
        rd = 2 * n_freq if n_freq is not None else D
        if rd is None:
            return -1
        if n_freq is None and (rd < 2 or rd % 2):
            raise ValueError(f"x last dimension D must be even and >= 2 for rotary_dim=None "
                             f"(all channels rotate), got D={D}; pass an even rotary_dim")
    else:
        if isinstance(rotary_dim, (bool, np.bool_)) or not isinstance(rotary_dim,
                                                                      numbers.Integral):
            raise TypeError(f"rotary_dim must be None or an even int >= 2, got "
                            f"{type(rotary_dim).__name__} {rotary_dim!r}")
        rd = int(rotary_dim)
        if rd < 2 or rd % 2:
            raise ValueError(f"rotary_dim must be an even int >= 2, got {rd}")
        if n_freq is not None and n_freq != rd // 2:
            raise ValueError(f"inv_freq must have rotary_dim / 2 = {rd // 2} frequencies, got "
                             f"{n_freq}")
    if D is not None and rd > D:
        raise ValueError(f"rotary_dim must be <= the last dimension of x (D={D}), got {rd}"
                         + (" (2 * len(inv_freq))" if rotary_dim is None else ""))
    return rd


def _frequencies(base: Any, inv_freq: Any, rotary_dim: Any, D: int | None):
    """(float64 inv_freq, rotary_dim)."""
    if inv_freq is None:
        b = _positive_real(base, "base", "a positive real number")
        rd = _parse_rotary_dim(rotary_dim, D, None)
        return default_inv_freq(rd, b), rd
    if base is not None and base != _DEFAULT_BASE:
        raise ValueError(f"pass either base (got {base!r}) or inv_freq, not both: inv_freq "
                         "already holds the frequencies")
    f = _parse_inv_freq(inv_freq)
    return f, _parse_rotary_dim(rotary_dim, D, f.shape[0])


def default_inv_freq(rotary_dim: int, base: float = _DEFAULT_BASE) -> np.ndarray:
    """``base ** (-2 j / rotary_dim)`` for ``j = 0 .. rotary_dim / 2 - 1``, float64."""
    return base ** -(np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)


def _overlaps(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether a and b share an element (undecidable cheaply: True)."""
    if not np.may_share_memory(a, b):
        return False
    work: Any = 1 << 16   # (numpy's stubs allow only -1 / 0 here)
    try:
        return bool(np.shares_memory(a, b, max_work=work))
    except RuntimeError:  # numpy TooHardError (numpy.exceptions from 1.25 on)
        return True


def _parse_positions(positions: Any, shape: tuple) -> np.ndarray:
    """(P, L) int64 positions for x of ``shape`` (..., L, D): P = 1, or the
    first axis of x."""
    L = shape[-2]
    if positions is None:
        return np.arange(L, dtype=np.int64)[None]
    p = to_array(positions, "positions")
    if p.dtype.kind not in "iu":
        raise TypeError(f"positions must be an integer array, got dtype {p.dtype}")
    forms = f"(L,) = ({L},) or (B, L) with B the first axis of x"
    if p.ndim == 1:
        if p.shape[0] != L:
            raise ValueError(f"positions must have shape {forms}; x has shape {shape}, got "
                             f"positions shape {p.shape}")
    elif p.ndim == 2:
        if p.shape[1] != L or (p.shape[0] != 1 and (len(shape) < 3 or p.shape[0] != shape[0])):
            want = f"(L,) = ({L},)" if len(shape) < 3 else \
                f"(L,) = ({L},) or (B, L) = ({shape[0]}, {L})"
            raise ValueError(f"positions must have shape {want} for x of shape {shape} "
                             f"(B: the first axis of x), got positions shape {p.shape}")
    else:
        raise ValueError(f"positions must have shape {forms}, got shape {p.shape}")
    if p.size:
        lo, hi = p.min(), p.max()
        if lo < _POS_MIN or hi > _POS_MAX:
            raise ValueError(f"positions must lie in the int32 range [-2**31, 2**31 - 1], got "
                             f"values from {lo} to {hi}")
    return np.array(p.reshape(-1, L), dtype=np.int64, order="C", copy=True)


def _offsets(a: np.ndarray, nlead: int) -> np.ndarray:
    """Element offsets of a[i0, .., i_{nlead-1}, 0, 0] for every leading
    index, C order, as a flat int64 array."""
    off = np.zeros((), dtype=np.int64)
    isz = a.itemsize
    for n, st in zip(a.shape[:nlead], a.strides[:nlead]):
        off = off[..., None] + np.arange(n, dtype=np.int64) * (st // isz)
    return np.ascontiguousarray(off.reshape(-1))


def _check_out(out: Any, x: np.ndarray) -> np.ndarray:
    if not isinstance(out, np.ndarray):
        raise TypeError(f"out must be an array like x ({x.dtype}, shape {x.shape}), got "
                        f"{type(out).__name__}")
    if out.shape != x.shape or out.dtype != x.dtype:
        raise ValueError(f"out must have x's shape {x.shape} and dtype {x.dtype}, got shape "
                         f"{out.shape} and dtype {out.dtype}")
    if not out.flags.writeable:
        raise ValueError("out must be a writable array (JAX arrays and read-only views "
                         "cannot be written in place)")
    if not out.flags.aligned or any(s % out.itemsize for s in out.strides):
        raise ValueError("out must be aligned, with strides that are multiples of its item "
                         "size")
    return out


def _same_layout(a: np.ndarray, b: np.ndarray) -> bool:
    return (a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
            and a.strides == b.strides)


# --------------------------------------------------------------------------
# the kernel call
# --------------------------------------------------------------------------
def apply_rotary(x: np.ndarray, pos: np.ndarray, inv_freq: np.ndarray, interleaved: bool,
                 out: np.ndarray | None, num_threads) -> np.ndarray:
    """Checked arrays in, rotated array out: x (..., L, D) float16/32/64
    aligned, pos (P, L) int64 C-contiguous (P = 1 or x.shape[0]), inv_freq
    (h,) float64 contiguous, out None (a new C-contiguous array) or an array
    of x's shape and dtype that is x itself or does not overlap it."""
    if out is None:
        out = np.empty(x.shape, dtype=x.dtype)
        in_place = False
    else:
        in_place = _same_layout(out, x)
        # exact overlap (interleaved column blocks of one buffer do not
        # overlap); a case too hard to decide counts as overlapping
        if not in_place and _overlaps(out, x):
            raise ValueError("out overlaps x without being x itself (same memory and "
                             "strides); pass out=x to rotate in place, or a separate array")
    if x.size == 0:
        return out
    L, D = x.shape[-2:]
    h = inv_freq.shape[0]
    P = pos.shape[0]
    nlead = x.ndim - 2
    rows = math.prod(x.shape[:nlead])
    nthreads = threads_for(float(P * L * h) * (40.0 + 6.0 * rows / P), num_threads)
    block = max(1, min(L, _TABLE_BYTES // (16 * h)))
    if nthreads > 1:
        # at least a few items per thread
        per_row = -(-4 * nthreads // P)
        block = max(1, min(block, -(-L // per_row)))
    x_off = _offsets(x, nlead)
    o_off = x_off if in_place else _offsets(out, nlead)
    _rotary.rotary(x, out, x_off, o_off, pos, inv_freq, interleaved,
                   (not in_place) and 2 * h < D, block, nthreads)
    return out


@foreign_arrays(("x",), ("positions", "inv_freq", "out"))
def _rotary_embedding(x, positions, base, inv_freq, layout, rotary_dim, num_threads, out):
    a = as_float_array(x, "x")
    if a.ndim < 2:
        raise ValueError(f"x must have shape (..., L, D), at least 2-D, got shape {a.shape}")
    interleaved = _parse_layout(layout)
    freq, rd = _frequencies(base, inv_freq, rotary_dim, a.shape[-1])
    pos = _parse_positions(positions, a.shape)
    if out is not None:
        out = _check_out(out, a)
    threads_for(0, num_threads)  # validated even for empty inputs
    return apply_rotary(aligned(a), pos, freq[:rd // 2], interleaved, out, num_threads)


def rotary_embedding(x: ArrayLike, positions: ArrayLike | None = None, *,
                     base: float = _DEFAULT_BASE, inv_freq: ArrayLike | None = None,
                     layout: Literal["half", "interleaved"] = "half",
                     rotary_dim: int | None = None, num_threads: int | None = None,
                     out: Any = None) -> Any:
    """Rotary position embedding (RoPE) of queries or keys.

    Channel pairs ``(a, b)`` of each row of ``x`` at position ``p`` are
    rotated by the angles ``p * inv_freq[j]``::

        out_a = x_a cos(p f_j) - x_b sin(p f_j)
        out_b = x_b cos(p f_j) + x_a sin(p f_j)

    Parameters
    ----------
    x : array_like, (..., L, D)
        float16, float32 or float64 (bfloat16 torch / JAX / ml_dtypes arrays
        are computed through a float32 copy).  Any strides: a (B, L, H, D)
        tensor is passed as ``x.transpose(0, 2, 1, 3)``, a view.
    positions : array_like of int, (L,) or (B, L), optional
        Position of each of the L rows; (B, L) gives each index of x's first
        axis its own positions (left-padded batches, decoding).  Values in
        the int32 range.  Default ``arange(L)``.
    base : float, default 10000.0
        ``inv_freq[j] = base ** (-2 j / rotary_dim)`` when ``inv_freq`` is
        not given.
    inv_freq : array_like, (rotary_dim / 2,), optional
        The frequencies themselves, for scaled variants computed by the
        caller: linear (``inv_freq / factor``), NTK, Llama 3, YaRN (e.g.
        transformers' ``LlamaRotaryEmbedding(config).inv_freq``).  YaRN's
        attention factor, which transformers multiplies into cos and sin,
        is not applied (multiply the attention scale by its square).
        Exclusive with ``base``.
    layout : {"half", "interleaved"}, default "half"
        ``"half"``: pairs ``(j, j + rotary_dim / 2)``, the GPT-NeoX / Llama
        ``rotate_half`` convention (transformers' ``apply_rotary_pos_emb``);
        ``"interleaved"``: pairs ``(2 j, 2 j + 1)``, GPT-J / RoFormer.
    rotary_dim : int, optional
        Rotate only the first ``rotary_dim`` channels (even); the others are
        copied.  Default: ``2 * len(inv_freq)``, else D.
    num_threads : int, optional
        ``None``: OpenMP's default; ``-1``: all cores; ``k >= 1``: k.
    out : array, optional
        Where to write the result: x's shape, dtype and array type, either
        ``x`` itself (in-place rotation) or memory that does not overlap x.
        Not for bfloat16.

    Returns
    -------
    array, the shape, dtype and array type of x
        ``out`` itself when given.

    Notes
    -----
    The angle ``p * inv_freq[j]`` is formed in float64 and its cos / sin
    evaluated in float64 (absolute error ~1e-16 at any position of the
    int32 range), then rounded to x's dtype for the rotation (float32
    arithmetic for float16 and float32 inputs).  transformers forms the
    angle in float32, so at position p its cos / sin differ from these by
    up to ~p * 6e-8.  Each block of positions computes its cos / sin table
    once for every head; nothing the size of x is allocated besides the
    output.  x is never modified unless ``out`` is x.

    Examples
    --------
    >>> import numpy as np, attncore
    >>> q = np.random.default_rng(0).standard_normal((1, 8, 16, 64), dtype=np.float32)
    >>> q_rot = attncore.rotary_embedding(q)                     # positions 0..15
    >>> k_new = attncore.rotary_embedding(k_new, [16], out=k_new)  # doctest: +SKIP
    """
    if out is not None and (is_bf16_arg(getattr(out, "dtype", None))
                            or is_bf16_arg(getattr(x, "dtype", None))):
        raise TypeError("out= is not supported for bfloat16 arrays (they are computed "
                        "through a float32 copy); use the returned array")
    r = _rotary_embedding(x, positions, base, inv_freq, layout, rotary_dim, num_threads, out)
    return r if out is None else out


# --------------------------------------------------------------------------
# MultiHeadAttention's configuration
# --------------------------------------------------------------------------
def parse_rotary(spec: Any, head_dim: int) -> dict | None:
    """A layer's rotary configuration: None (no rotation) or a dict with the
    keys :data:`ROTARY_KEYS` resolved (``inv_freq`` a read-only float64
    array of ``rotary_dim / 2`` frequencies, ``base`` None when inv_freq was
    given)."""
    if spec is None or spec is False:
        return None
    if spec is True:
        spec = {}
    elif not isinstance(spec, dict):
        raise TypeError(f"rotary must be None, a bool or a dict with keys "
                        f"{', '.join(ROTARY_KEYS)}, got {type(spec).__name__} {spec!r}")
    unknown = sorted(set(spec) - set(ROTARY_KEYS))
    if unknown:
        raise ValueError(f"rotary: unknown keys {unknown}; the keys are "
                         f"{', '.join(ROTARY_KEYS)}")
    layout = spec.get("layout", "half")
    _parse_layout(layout)
    inv = spec.get("inv_freq")
    if inv is not None and not isinstance(inv, np.ndarray):
        inv = weight_array(inv, "inv_freq")
    base = spec.get("base", None if inv is not None else _DEFAULT_BASE)
    try:
        freq, rd = _frequencies(base, inv, spec.get("rotary_dim"), head_dim)
    except ValueError as exc:
        msg = str(exc).replace("the last dimension of x (D=", "head_dim (")
        raise ValueError(f"rotary: {msg}") from None
    freq = freq[:rd // 2]
    freq.flags.writeable = False
    return {"base": None if inv is not None else float(base), "inv_freq": freq,
            "layout": layout, "rotary_dim": rd}


def rotary_positions(positions: Any, start: int, B: int, L: int) -> np.ndarray:
    """A layer call's (P, L) int64 positions: ``positions`` (L,) or (B, L),
    or ``start + arange(L)``."""
    if positions is None:
        if start + L - 1 > _POS_MAX:
            raise ValueError("positions beyond the int32 range")
        return np.arange(start, start + L, dtype=np.int64)[None]
    p = to_array(positions, "positions")
    if p.dtype.kind not in "iu":
        raise TypeError(f"positions must be an integer array, got dtype {p.dtype}")
    if p.ndim not in (1, 2) or p.shape[-1] != L or (p.ndim == 2 and p.shape[0] not in (1, B)):
        raise ValueError(f"positions must have shape (L,) = ({L},) or (B, L) = ({B}, {L}), got "
                         f"shape {p.shape}")
    return _parse_positions(p, (B, 1, L, 1))
