"""Helpers shared by the asv benchmarks in ``bench/bench_*.py``.

* ``THREADS``: the thread-count parameter of every benchmark, ``"1"`` and
  ``"all"`` (every core this process may run on).  Functions that take
  ``num_threads`` get ``1`` / ``-1``; layers that do not are run under a
  threadpoolctl limit on OpenMP and BLAS (:class:`ThreadLimited`).
* ``require(name)``: the public attncore attribute, or ``NotImplementedError``
  so that asv skips the benchmark on commits that predate it.  Call it from
  ``setup``, never at import time: the modules must import on every commit.
* ``memo(key, factory)``: inputs built once per benchmark process.  asv may
  run ``setup`` again before each sample; memoised inputs keep that cheap.
* ``numpy_attention``: the plain NumPy softmax attention the ``track_``
  benchmarks measure attncore against.
* ``speedup(reference, candidate)``: the in-run ratio reference time /
  attncore time (median of interleaved samples; > 1 means attncore is
  faster).  Ratios measured side by side stay readable on noisy machines
  where absolute times drift.
"""
from __future__ import annotations

import os
import statistics

import numpy as np

import attncore

from .timing import seconds_per_call

__all__ = ["THREADS", "DTYPES", "TIMEOUT", "n_threads", "api_threads", "require",
           "memo", "rng", "ThreadLimited", "numpy_attention", "numpy_softmax",
           "speedup"]

THREADS = ["1", "all"]
DTYPES = ["float32", "float64"]
# per-benchmark timeout (seconds); every case here runs in well under it
TIMEOUT = 120


def _all_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def n_threads(threads: str) -> int:
    """The thread count a ``threads`` parameter stands for."""
    return 1 if threads == "1" else _all_cores()


def api_threads(threads: str) -> int:
    """The ``num_threads=`` argument for a ``threads`` parameter."""
    return 1 if threads == "1" else -1


def require(name: str, obj=attncore):
    """``obj.name`` (dotted names allowed), or NotImplementedError: asv skips."""
    for part in name.split("."):
        nxt = getattr(obj, part, None)
        if nxt is None:
            raise NotImplementedError(f"attncore.{name} does not exist in this commit")
        obj = nxt
    return obj


_memo: dict = {}


def memo(key, factory):
    """``factory()`` built once per process for ``key``."""
    try:
        return _memo[key]
    except KeyError:
        value = _memo[key] = factory()
        return value


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def random(shape, dtype, seed=0, scale=1.0):
    a = rng(seed).standard_normal(shape, dtype=np.float64) * scale
    return a.astype(dtype)


_controller = None


def _threadpool_controller():
    global _controller
    if _controller is None:
        from threadpoolctl import ThreadpoolController

        _controller = ThreadpoolController()
    return _controller


class ThreadLimited:
    """Mixin: OpenMP and BLAS held to the ``threads`` parameter.

    For layers without a ``num_threads`` argument.  The class's
    ``param_names`` must contain ``"threads"``.
    """

    def _limit_threads(self, threads: str) -> None:
        self._limits = None
        n = n_threads(threads)
        try:
            self._limits = _threadpool_controller().limit(limits=n)
        except Exception:  # no threadpoolctl-visible runtime: nothing to limit
            self._limits = None

    def teardown(self, *params):
        limits = getattr(self, "_limits", None)
        if limits is not None:
            limits.restore_original_limits()
            self._limits = None


class blas_limit:
    """Context manager: BLAS (NumPy / SciPy) held to ``n`` threads."""

    def __init__(self, n: int):
        self.n = n

    def __enter__(self):
        try:
            self._lim = _threadpool_controller().limit(limits=self.n, user_api="blas")
        except Exception:
            self._lim = None
        return self

    def __exit__(self, *exc):
        if self._lim is not None:
            self._lim.restore_original_limits()
        return False


# --------------------------------------------------------------------------
# plain NumPy references (materialise the scores; no attncore code involved)
# --------------------------------------------------------------------------
def numpy_softmax(s, mask=None):
    """Softmax over the last axis; ``mask`` bool, True = take part."""
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    m = s.max(-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    s = np.exp(s - m)
    d = s.sum(-1, keepdims=True)
    return s / np.where(d > 0, d, 1.0)


def numpy_attention(q, k, v, mask=None, causal=False, scale=None, return_weights=False):
    """softmax(q kᵀ · scale [+ masks]) v for (..., N, D) arrays."""
    if scale is None:
        scale = 1.0 / np.sqrt(q.shape[-1])
    s = (q @ np.swapaxes(k, -1, -2)) * q.dtype.type(scale)
    if causal:
        N, M = s.shape[-2:]
        # lower-right alignment; equals upper-left when N == M
        tri = np.tril(np.ones((N, M), dtype=bool), k=M - N)
        mask = tri if mask is None else (mask & tri)
    w = numpy_softmax(s, mask).astype(q.dtype, copy=False)
    out = w @ v
    return (out, w) if return_weights else out


# --------------------------------------------------------------------------
# in-run ratio
# --------------------------------------------------------------------------
def speedup(reference, candidate, repeats=7, min_sample=0.01, number=None):
    """Median time of ``reference`` / median time of ``candidate``.

    Both run interleaved in this process with the same thread limits; each
    sample lasts at least ``min_sample`` seconds unless ``number`` fixes the
    calls per sample.  > 1 means the candidate (attncore) is faster.
    """
    fns = (reference, candidate)
    numbers = []
    for fn in fns:
        t = seconds_per_call(fn, 1)  # warm-up and calibration
        numbers.append(number or max(1, min(1000, int(min_sample / max(t, 1e-7)) + 1)))
    samples = ([], [])
    for _ in range(repeats):
        for fn, num, out in zip(fns, numbers, samples):
            out.append(seconds_per_call(fn, num))
    return statistics.median(samples[0]) / statistics.median(samples[1])
