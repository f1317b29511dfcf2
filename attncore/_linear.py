"""``linear``: the layers' projections, on attncore's own threads.

``x @ w.T + b`` with ``w`` in PyTorch's (out_features, in_features) layout.
Large products are split into row (or column) blocks over an OpenMP team,
each block a single-threaded BLAS gemm, instead of being handed to a
multi-threaded BLAS: a layer call then never has OpenBLAS' thread pool and
OpenMP's competing for the same cores (OpenBLAS workers keep spinning for
~0.1 s after each call, which stalls a following OpenMP region badly on a
machine with few cores).
"""
from __future__ import annotations

import numpy as np

from ._core import _linalg, _sdpa
from ._dtypes import HALF_BF16, PRECISIONS, half_code
from ._kernels import L2_BYTES
from ._threads import blas_parallel_threads, threads_for
from ._validation import ALIASING_STRIDE, aligned, blas_rows

__all__ = ["linear", "head_rows"]

# float32 weights per column block of the fused path: half the L2 (256
# KiB - 1 MiB), so a block's rows of w stay there for every row panel of x
# (_linalg.linear; 512 KiB and 1 MiB blocks measured the same on a 2 MiB L2)
_WBLOCK_BYTES = max(256 << 10, min(L2_BYTES // 2, 1 << 20))

# OpenBLAS would start threads above this many multiply-adds (see functional)


def _rows(a: np.ndarray) -> np.ndarray:
    """``a`` (2-D) aligned, with contiguous rows and a BLAS-valid row stride."""
    if a.ndim != 2:
        raise ValueError(f"linear expects 2-D operands, got shape {a.shape}")
    if not a.dtype.isnative:
        a = a.astype(a.dtype.newbyteorder("="))
    return blas_rows(a)


def head_rows(R: int, C: int, dtype) -> np.ndarray:
    """An empty (R, C) array for a projection whose columns are viewed as
    heads, (R, C) -> (B, L, H, hd) -> (B, H, L, hd): its rows are not a
    multiple of 1 KiB apart (64 bytes of padding after each where they
    would be).  A head's rows are then not all in the same few L1 sets:
    the attention of 4 x 8 x 512^2 x 64 heads 2 / 4 KiB apart ran 1.45x
    slower on the AVX2 path and 1.17x on the AVX-512 path than on the same
    buffers padded (Zen 5, one thread)."""
    dt = np.dtype(dtype)
    pad = 64 // dt.itemsize if (C * dt.itemsize) % ALIASING_STRIDE == 0 else 0
    return np.empty((R, C + pad), dtype=dt)[:, :C]


def linear(x2d: np.ndarray, w: np.ndarray, b: np.ndarray | None = None, *,
           num_threads: int | None = None, out: np.ndarray | None = None,
           precision: str | None = None) -> np.ndarray:
    """``x2d @ w.T (+ b)`` as a new C-contiguous (R, C) array, or written
    into ``out`` (R, C) of x2d's dtype with contiguous rows (any row
    stride: :func:`head_rows`' padded rows).

    x2d (R, K) and w (C, K) must share a float32 / float64 dtype (b too),
    or w is bfloat16 / float16 with float32 x2d (and b): then w is read in
    place, a thread's block of its rows (up to a weight block of half the
    L2, 256 KiB - 1 MiB, as float32, at least 64 rows) converted to float32
    at a time (on several threads with at least 64 rows of x2d: up to 4 MiB
    of w converted by the team, then multiplied as float32 weights, in
    weight blocks) -- or, for
    bfloat16 w on a CPU with fast AVX512_BF16 (AMD's; unless ``precision`` is
    "float32"), multiplied as bfloat16 pairs against the rows of x2d
    rounded to bfloat16 (float32 accumulation).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    x2d = _rows(x2d)
    w = _rows(w)
    R, K = x2d.shape
    C = w.shape[0]
    if w.shape[1] != K:
        raise ValueError(f"linear: w must be (C, K) with K = x2d.shape[1] = {K}, got w of "
                         f"shape {w.shape}")
    if out is None:
        out = np.empty((R, C), dtype=x2d.dtype)
    elif out.shape != (R, C):
        raise ValueError(f"linear: out must have shape {(R, C)}, got {out.shape}")
    if b is not None:
        b = aligned(np.ascontiguousarray(b))
        if b.shape != (C,):
            raise ValueError(f"linear: b must have shape ({C},) (one entry per row of w), got "
                             f"shape {b.shape}")
    fmt = half_code(w.dtype)
    if fmt and (x2d.dtype != np.float32 or K == 0):
        w, fmt = w.astype(x2d.dtype), 0
    macs = R * C * K
    nthreads = threads_for(2.0 * macs, num_threads)
    if x2d.dtype != np.float32 or _sdpa.kernel_path() not in ("avx512", "avx2"):
        # the BLAS path: only where the BLAS can be held to one thread per
        # thread does it run on several (see attncore._threads)
        nthreads = blas_parallel_threads(nthreads)
    bf16dot = _sdpa.bf16_mode() if (fmt == HALF_BF16 and precision != "float32") else 0
    _linalg.linear(x2d, w.view(np.uint16) if fmt == HALF_BF16 else w, b, out, nthreads, fmt,
                   bf16dot, _WBLOCK_BYTES)
    return out
