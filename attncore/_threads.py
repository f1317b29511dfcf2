"""Thread counts and BLAS thread limits.

One place decides how many OpenMP threads a call uses, and keeps the BLAS
that scipy provides single-threaded while attncore's own threads call it
(BLAS inside a parallel region must not start threads of its own).

The BLAS limit is reference-counted: several Python threads may run attncore
at once; the first one in sets the limit, the last one out restores it.  A
cached :class:`threadpoolctl.ThreadpoolController` keeps this at a couple of
microseconds per call instead of the ~200 us of a fresh ``threadpool_limits``.
"""
from __future__ import annotations

import numbers
import threading

from ._core import _sdpa

__all__ = ["resolve_num_threads", "blas_single_threaded"]


def resolve_num_threads(num_threads) -> int:
    """Number of OpenMP threads a call may use.

    ``None``: OpenMP's default for the calling thread (``OMP_NUM_THREADS``,
    threadpoolctl limits); ``-1``: every processor; ``k >= 1``: ``k``.
    Always 1 when attncore was built without OpenMP.
    """
    if num_threads is None:
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
    if not _sdpa.openmp_enabled():
        return 1
    return max(1, int(n))


_lock = threading.Lock()
_depth = 0
_limiter = None
_controller = None


def _get_controller():
    global _controller
    if _controller is None:
        from threadpoolctl import ThreadpoolController

        _controller = ThreadpoolController()
    return _controller


_blas_libs = None


def _get_blas_libs():
    """The controller's BLAS libraries (cached; empty if threadpoolctl finds none)."""
    global _blas_libs
    if _blas_libs is None:
        try:
            _blas_libs = [lc for lc in _get_controller().lib_controllers if lc.user_api == "blas"]
        except Exception:  # no threadpoolctl-visible BLAS: nothing to limit
            _blas_libs = []
    return _blas_libs


class _BlasSingleThreaded:
    """Context manager: BLAS runs on one thread inside (reference-counted).

    Talks to each BLAS library's controller directly (get / set the thread
    count, under a microsecond each) rather than through
    ``ThreadpoolController.limit``, which queries every library's info and
    costs ~20 us per enter/exit -- too much for per-token decoding calls.
    """

    __slots__ = ()

    def __enter__(self):
        global _depth, _limiter
        with _lock:
            if _depth == 0:
                saved = []
                for lc in _get_blas_libs():
                    try:
                        n = lc.get_num_threads()
                        if n is not None and n != 1:
                            lc.set_num_threads(1)
                            saved.append((lc, n))
                    except Exception:  # pragma: no cover - a library that cannot be limited
                        pass
                _limiter = saved
            _depth += 1
        return self

    def __exit__(self, *exc):
        global _depth, _limiter
        with _lock:
            _depth -= 1
            if _depth == 0 and _limiter:
                for lc, n in _limiter:
                    lc.set_num_threads(n)
                _limiter = None
        return False


blas_single_threaded = _BlasSingleThreaded()
