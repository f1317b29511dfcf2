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

import math
import numbers
import os
from typing import Literal

import numpy as np
from numpy.typing import ArrayLike

from ._core import _sdpa
from ._interop import foreign_arrays
from ._threads import blas_single_threaded, resolve_num_threads

__all__ = ["scaled_dot_product_attention"]

_INT32_MAX = 2**31 - 1
# OpenBLAS starts threads only above m*n*k = 65536 * 4; below that a gemm
# is single-threaded anyway and the thread limit need not be taken.
_BLAS_THREAD_THRESHOLD = 65536 * 4
# below this many flops a call runs serially, without an OpenMP region
# (measured: at ~1e6 flops two threads already beat one when K/V stream
# from L3; at ~2e5 the OpenMP start-up is as large as the work)
_SERIAL_FLOPS = 250_000


# --------------------------------------------------------------------------
# argument checks shared by the package
# --------------------------------------------------------------------------
def as_float_array(x, name: str) -> np.ndarray:
    """``x`` as an array of float16 / float32 / float64 in native byte order
    (non-native arrays are converted), else TypeError."""
    a = x if isinstance(x, np.ndarray) else np.asarray(x)
    dt = a.dtype
    if dt.kind != "f" or dt.itemsize not in (2, 4, 8):
        raise TypeError(
            f"{name} must be a float16, float32 or float64 array, got dtype {dt}")
    if not dt.isnative:  # e.g. '>f4' from a file: the kernels read native floats
        a = a.astype(dt.newbyteorder("="))
    return a


def parse_positive_int(x, name: str, allow_none: bool = False):
    """``x`` as an int >= 1 (``None`` passes when ``allow_none``)."""
    if x is None and allow_none:
        return None
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name} must be an int >= 1, got {type(x).__name__} {x!r}")
    x = int(x)
    if x < 1:
        raise ValueError(f"{name} must be >= 1, got {x}")
    return x


def parse_float_dtype(dtype, name: str = "dtype", itemsizes=(2, 4, 8)) -> np.dtype:
    """``dtype`` as a native-byte-order float dtype of one of ``itemsizes``."""
    names = [f"float{8 * n}" for n in itemsizes]
    allowed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{name} must be {allowed}, got {dtype!r}") from None
    if dt.kind != "f" or dt.itemsize not in itemsizes:
        raise TypeError(f"{name} must be {allowed}, got {dt}")
    return dt if dt.isnative else dt.newbyteorder("=")


def compute_dtype(*dtypes):
    """(compute dtype, result dtype) for NumPy's promotion of the inputs.

    float16 results are computed in float32 and returned as float16.
    """
    d0 = dtypes[0]
    for d in dtypes:
        if d is not d0:
            rt = np.result_type(*dtypes)
            break
    else:
        rt = d0
    if rt == np.float16:
        return np.dtype(np.float32), rt
    return rt, rt


def parse_causal(is_causal) -> int:
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


def parse_scale(scale, D: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(D)
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a positive real number or None, got {type(scale).__name__} {scale!r}")
    s = float(scale)
    if not math.isfinite(s) or s <= 0:
        raise ValueError(f"scale must be finite and > 0, got {s}")
    return s


def _broadcast_batch(shapes, names):
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


def _rows_ok(a: np.ndarray) -> np.ndarray:
    """``a`` itself when the kernel can read it in place (last axis
    contiguous, row stride at least the row length, element-aligned
    strides), else a C-contiguous copy."""
    if a.flags.c_contiguous:
        return a
    isz = a.itemsize
    st = a.strides
    rows, cols = a.shape[-2], a.shape[-1]
    ok = True
    for x in st:
        if x % isz:
            ok = False
            break
    if ok and cols > 1 and st[-1] != isz:
        ok = False
    if ok and rows > 1 and (st[-2] < cols * isz or st[-2] // isz > _INT32_MAX):
        ok = False
    return a if ok else np.ascontiguousarray(a)


def _l2_bytes() -> int:
    """Per-core L2 size (Linux sysconf), 1 MiB when unknown."""
    try:
        n = os.sysconf("SC_LEVEL2_CACHE_SIZE")
    except (ValueError, OSError, AttributeError):
        n = 0
    return n if n and n > 0 else 1 << 20


_L2 = _l2_bytes()


def _tiles(dtype, N: int, M: int, D: int, Dv: int, causal: int, nb: int, nthreads: int):
    """(query block, key block) sizes.

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


# --------------------------------------------------------------------------
# scaled_dot_product_attention
# --------------------------------------------------------------------------
@foreign_arrays(("query", "key", "value"), ("attn_mask",))
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
    num_threads: int | None = None,
) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """Scaled dot-product attention, ``softmax(Q K^T * scale + mask) V``.

    Computed tile by tile with an online softmax (flash attention): memory
    beyond the output grows with the tile size, not with N x M.

    Parameters
    ----------
    query : array_like, shape (..., N, D)
    key : array_like, shape (..., M, D)
    value : array_like, shape (..., M, Dv)
        float16, float32 or float64.  Leading (batch) dimensions broadcast
        by NumPy rules.  Any strides are accepted; inputs are never modified.
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
    num_threads : int, optional
        ``None``: OpenMP's default (``OMP_NUM_THREADS``, threadpoolctl);
        ``-1``: all cores; ``k >= 1``: k threads.  Results agree across
        thread counts to float rounding.

    Returns
    -------
    out : ndarray, shape (..., N, Dv)
    weights : ndarray, shape (..., N, M)
        Only with ``return_weights=True``; rows sum to 1, or are all 0 for a
        query with nothing to attend.

    Notes
    -----
    * A query row with no key to attend (fully masked, or before the first
      key under ``'lower_right'`` with N > M) gives output 0 and weights 0,
      as PyTorch >= 2.5.  This is decided from the mask and causal
      structure; NaN in query, keys, values or mask entries that take part
      propagates to the affected outputs, while inf / NaN in the keys or
      values of a key a query does not attend never reach that query.  ``M == 0`` gives an all-zero
      output; ``N == 0`` an empty one.
    * dtypes: float32 and float64 are computed natively; float16 is
      computed in float32 and returned as float16.  Mixed float dtypes
      promote as NumPy does (float32 with float64 gives float64).  A float
      mask is converted to the compute dtype and does not take part in
      promotion.  Integer, bool, complex and object inputs raise TypeError.
    * The GIL is released while computing; calls from several Python
      threads at once are safe.
    """
    q = as_float_array(query, "query")
    k = as_float_array(key, "key")
    v = as_float_array(value, "value")
    for nm, a in (("query", q), ("key", k), ("value", v)):
        if a.ndim < 2:
            raise ValueError(f"{nm} must have at least 2 dimensions (..., length, dim), got shape {a.shape}")
    N, D = q.shape[-2], q.shape[-1]
    M, Dk = k.shape[-2], k.shape[-1]
    Mv, Dv = v.shape[-2], v.shape[-1]
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
    causal = parse_causal(is_causal)
    sc = parse_scale(scale, D)
    nthreads = resolve_num_threads(num_threads)
    cdt, rdt = compute_dtype(q.dtype, k.dtype, v.dtype)

    # ---- mask ----
    m = None
    mask_kind = 0
    mb = ()
    if attn_mask is not None:
        m = attn_mask if isinstance(attn_mask, np.ndarray) else np.asarray(attn_mask)
        if m.dtype == np.bool_:
            mask_kind = 1
        elif m.dtype.kind == "f" and m.dtype.itemsize in (2, 4, 8):
            mask_kind = 2
        else:
            raise TypeError(
                f"attn_mask must be a bool array (True = take part) or a float array "
                f"(added to the scores), got dtype {m.dtype}")
        if m.ndim < 2:
            m = m.reshape((1,) * (2 - m.ndim) + m.shape)
        if m.shape[-2] not in (1, N) or m.shape[-1] not in (1, M):
            raise ValueError(
                f"attn_mask must be broadcastable to (..., N, M) = (..., {N}, {M}), got shape "
                f"{np.shape(attn_mask)}")
        mb = m.shape[:-2]

    # ---- batch shapes (grouped-query heads first) ----
    qb, kb, vb = q.shape[:-2], k.shape[:-2], v.shape[:-2]
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
        bshape = qb
    else:
        try:
            bshape = _broadcast_batch([qb, kb, vb, mb], ["query", "key", "value", "attn_mask"])
        except ValueError as exc:
            if (not enable_gqa and q.ndim >= 3 and k.ndim >= 3
                    and k.shape[-3] not in (1, q.shape[-3])
                    and q.shape[-3] % max(k.shape[-3], 1) == 0):
                raise ValueError(
                    f"{exc}; key/value have {k.shape[-3]} heads (axis -3) and query has "
                    f"{q.shape[-3]}: pass enable_gqa=True for grouped-query attention") from None
            raise
    nb = math.prod(bshape)
    out_shape = bshape + (N, Dv)

    if nb == 0 or N == 0 or M == 0 or Dv == 0:
        out = np.zeros(out_shape, dtype=rdt)
        if Dv == 0 and return_weights and nb and N and M:
            # weights are still defined: compute them with a dummy value column
            _, w = scaled_dot_product_attention(
                q, k, np.zeros(v.shape[:-1] + (1,), dtype=v.dtype), attn_mask,
                is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
                return_weights=True, num_threads=num_threads)
            return out, w
        if return_weights:
            return out, np.zeros(bshape + (N, M), dtype=rdt)
        return out

    # ---- lay out operands ----
    if max(N, M, D, Dv) > _INT32_MAX:
        raise ValueError("sequence lengths and head dimensions must be below 2**31")
    q = _rows_ok(q if q.dtype == cdt else q.astype(cdt))
    k = _rows_ok(k if k.dtype == cdt else k.astype(cdt))
    v = _rows_ok(v if v.dtype == cdt else v.astype(cdt))
    if m is not None:
        if mask_kind == 2 and (m.dtype != cdt or not m.dtype.isnative):
            m = m.astype(cdt)
        if any(st % m.itemsize for st in m.strides):
            m = np.ascontiguousarray(m)

    if 2.0 * nb * N * M * (D + Dv) < _SERIAL_FLOPS:
        nthreads = 1
    Bq, Bk = _tiles(cdt, N, M, D, Dv, causal, nb, nthreads)
    nqb = -(-N // Bq)
    work = nb * nqb
    nsplit, chunk = 1, M
    if not return_weights and work < nthreads and M >= 1024:
        nsplit = min(-(-nthreads // work), -(-M // 256))
        chunk = -(-M // nsplit)
        chunk = -(-chunk // Bk) * Bk
        nsplit = -(-M // chunk)
    nthreads = max(1, min(nthreads, work * nsplit))

    out = np.empty((nb, N, Dv), dtype=cdt)
    weights = np.empty((nb, N, M), dtype=cdt) if return_weights else None
    args = (q, k, v, m, out, weights, bshape, group, mask_kind,
            N, M, D, Dv, causal, sc, Bq, Bk, nsplit, chunk, nthreads)
    if return_weights or Bq * Bk * max(D, Dv) > _BLAS_THREAD_THRESHOLD:
        with blas_single_threaded:
            _sdpa.sdpa(*args)
    else:
        _sdpa.sdpa(*args)

    out = out.reshape(out_shape)
    if rdt != cdt:
        out = out.astype(rdt)
    if return_weights:
        weights = weights.reshape(bshape + (N, M))
        if rdt != cdt:
            weights = weights.astype(rdt)
        return out, weights
    return out
