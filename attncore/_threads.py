"""Thread counts and BLAS thread limits.

One place decides how many OpenMP threads a call uses, and keeps the BLAS
that scipy provides single-threaded while attncore's own threads call it
(BLAS inside a parallel region must not start threads of its own).

No process-wide state changes during a call: another thread of the program
that runs a matrix product meanwhile, or asks threadpoolctl, sees the
counts it set itself.  The float32 kernels on x86 call no BLAS at all.
Where BLAS is called (float64, return_weights, CPUs without AVX2), every
thread of a kernel region holds its own BLAS to one thread through a truly
thread-local setter, in C, inside the region.  Where the BLAS has none:
with OpenBLAS (its pthreads builds, as in the NumPy / SciPy wheels) the
attention kernel keeps every product below OpenBLAS' own threading
threshold (blas_small_products_ok), and any other region runs on one
attncore thread (blas_parallel_threads).
"""
from __future__ import annotations

import numbers
import os
import threading

from ._core import _sdpa

__all__ = ["resolve_num_threads", "max_threads", "threads_for", "serial_or", "SERIAL_FLOPS",
           "blas_parallel_threads", "blas_hold_supported", "blas_small_products_ok", "OPENBLAS_SERIAL_MNK"]


# below this much work a kernel runs on the calling thread, without an
# OpenMP region (measured: at ~1e6 flops two threads already beat one when
# K/V stream from L3; at ~2e5 the OpenMP start-up is as large as the work)
SERIAL_FLOPS = 250_000


def threads_for(flops: float, num_threads) -> int:
    """Threads for a call doing about ``flops`` floating-point operations:
    1 below :data:`SERIAL_FLOPS`, else :func:`resolve_num_threads`.  The
    one place that decides when work is too small to share."""
    return serial_or(flops, resolve_num_threads(num_threads))


def serial_or(flops: float, nthreads: int) -> int:
    """1 for work of fewer than :data:`SERIAL_FLOPS` floating-point
    operations, else ``nthreads`` (a count already resolved): the rule of
    :func:`threads_for`, for the planners that hold a resolved count."""
    return 1 if flops < SERIAL_FLOPS else nthreads


def resolve_num_threads(num_threads) -> int:
    """Number of OpenMP threads a call may use.

    ``None``: OpenMP's default for the calling thread (``OMP_NUM_THREADS``,
    threadpoolctl limits); ``-1``: every processor; ``k >= 1``: ``k``, at
    most :func:`max_threads` (a larger count is taken as that maximum:
    more threads would only queue on the processors, and tens of thousands
    exhausted the OpenMP runtime).  Always 1 in a child forked after a
    team ran, and when attncore was built without OpenMP.
    """
    if type(num_threads) is int and num_threads >= 1:  # the common case, first
        n = num_threads
    elif num_threads is None:
        n = _sdpa.omp_max_threads()
    else:
        if isinstance(num_threads, (bool,)) or not isinstance(num_threads, numbers.Integral):
            raise TypeError(
                f"num_threads must be None or an int (-1 or >= 1), got "
                f"{type(num_threads).__name__} {num_threads!r}")
        num_threads = int(num_threads)
        if num_threads == -1:
            n = _sdpa.omp_num_procs()
        elif num_threads >= 1:
            n = num_threads
        else:
            raise ValueError(
                f"num_threads must be None, -1 (all cores) or >= 1, got {num_threads}")
    if _ONE_THREAD:
        return 1
    # (no OpenMP query below _FEW_THREADS: right after a call that swept
    # the caches, omp_get_num_procs -- a system call -- and its Python
    # steps cost microseconds on every call)
    n = int(n)
    n = max(1, n if n <= _FEW_THREADS else min(n, max_threads()))
    if n > 1:
        _note_team()
    return n


# A child forked after OpenMP ran a team (the ``fork`` start method of
# multiprocessing, os.fork) inherits a runtime whose worker threads did not
# come along: its first region of several threads would wait for them
# forever (GNU OpenMP; a plain C program hangs the same way).  Such a child
# runs every call on its calling thread instead.
_team_started = False


def _note_team() -> None:
    global _team_started
    _team_started = True


def _after_fork_in_child() -> None:
    global _ONE_THREAD
    if _team_started:
        _ONE_THREAD = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def max_threads() -> int:
    """The most threads one call runs: 4 per processor, at least 256."""
    return max(256, 4 * _sdpa.omp_num_procs())


# thread counts resolve_num_threads returns as given without asking OpenMP
# (below every max_threads()); _ONE_THREAD: every call runs on its calling
# thread (no OpenMP, or a child forked after a team)
_FEW_THREADS = 256
_ONE_THREAD = not _sdpa.openmp_enabled()


_lock = threading.Lock()
_unheld = None  # BLAS controllers without a thread-local setter


def _blas_controllers():
    try:
        from threadpoolctl import ThreadpoolController

        return [lc for lc in ThreadpoolController().lib_controllers if lc.user_api == "blas"]
    except Exception:  # no threadpoolctl-visible BLAS: nothing to hold
        return []


def _local_setter(lc):
    """Address of the library's thread-local thread-count setter, or None.

    MKL's ``mkl_set_num_threads_local`` is thread-local.  OpenBLAS exports
    ``openblas_set_num_threads_local`` from 0.3.27 on, but in its pthreads
    builds (the wheels of NumPy and SciPy) it changes the count every
    thread's calls use -- measured with OpenBLAS 0.3.30: while one thread
    holds it at 1, a matrix product on another thread runs on one thread --
    so it is used only in OpenBLAS' OpenMP builds.
    """
    import ctypes

    names = {"mkl": ("MKL_Set_Num_Threads_Local", "mkl_set_num_threads_local")}
    if lc.internal_api == "openblas" and getattr(lc, "threading_layer", "") == "openmp":
        names["openblas"] = ("openblas_set_num_threads_local",)
    for name in names.get(lc.internal_api, ()):
        fn = getattr(lc.dynlib, name, None)
        if fn is not None:
            return ctypes.cast(fn, ctypes.c_void_p).value
    return None


def _setup():
    """Find the BLAS libraries once and install their thread-local setters in
    the kernels; remember the libraries that have none."""
    global _unheld
    with _lock:
        if _unheld is not None:
            return _unheld
        from ._core import _additive, _linalg

        addrs, unheld = [], []
        for lc in _blas_controllers():
            addr = _local_setter(lc)
            if addr:
                addrs.append(addr)
            else:
                unheld.append(lc)
        for mod in (_sdpa, _linalg, _additive):
            mod.set_blas_local(tuple(addrs[:8]))
        _unheld = unheld
        return unheld


def blas_parallel_threads(nthreads: int) -> int:
    """Threads a kernel region that calls BLAS may use.

    Each thread of such a region holds the BLAS to one thread with the
    library's thread-local setter (MKL, OpenBLAS built with OpenMP), which
    changes nothing for any other thread of the program.  A BLAS without a
    truly thread-local one (OpenBLAS' pthreads builds, as in the NumPy and
    SciPy wheels; BLIS; ...) that runs several threads cannot be held that
    way, and attncore never changes its process-wide count: such a region
    then runs on one attncore thread and lets the BLAS use its own threads
    (as many as the program set), so the cores are never oversubscribed.
    The float32 kernels on x86 (AVX2 or AVX-512) call no BLAS at all; this
    concerns float64, ``return_weights`` and CPUs without AVX2.
    """
    unheld = _unheld if _unheld is not None else _setup()
    if nthreads <= 1 or not unheld:
        return nthreads
    for lc in unheld:
        try:
            n = lc.get_num_threads()
        except Exception:  # pragma: no cover - a library that cannot be queried
            n = None
        if n is None or n > 1:
            return 1
    return nthreads


def blas_hold_supported() -> bool:
    """True when every BLAS library found can be held to one thread per
    thread (thread-locally)."""
    unheld = _unheld if _unheld is not None else _setup()
    return not unheld


# OpenBLAS runs a product on the calling thread alone when m * n * k is below
# twice this (interface/gemm.c: threads = m n k / (65536 * 4))
OPENBLAS_SERIAL_MNK = 65536 * 4


def blas_small_products_ok() -> bool:
    """True when every BLAS library that cannot be held thread-locally is an
    OpenBLAS: products kept below :data:`OPENBLAS_SERIAL_MNK` multiply-adds
    then run single-threaded by OpenBLAS' own rule, so attncore's threads may
    call it in parallel without touching any thread count."""
    unheld = _unheld if _unheld is not None else _setup()
    return all(lc.internal_api == "openblas" for lc in unheld)
