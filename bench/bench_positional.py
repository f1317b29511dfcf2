"""asv benchmarks: ``attncore.sinusoidal_encoding`` and
``attncore.add_positional_encoding``.

Skipped on commits without them.  Neither takes ``num_threads``: the thread
count is a threadpoolctl limit on OpenMP and BLAS.
"""
import numpy as np

from .common import THREADS, TIMEOUT, ThreadLimited, memo, random, require, speedup

# name -> (length, dim)
CASES = {
    "1024x512": (1024, 512),
    "8192x1024": (8192, 1024),
}


def numpy_sinusoidal(length, dim, base=10000.0, dtype=np.float32):
    """Attention Is All You Need: sin at even, cos at odd feature indices."""
    pos = np.arange(length, dtype=np.float64)[:, None]
    inv = base ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    angle = pos * inv
    out = np.empty((length, dim), dtype=np.float64)
    out[:, 0::2] = np.sin(angle)
    out[:, 1::2] = np.cos(angle[:, : dim // 2])
    return out.astype(dtype)


class Sinusoidal(ThreadLimited):
    """time_ / peakmem_ of one table (float32, interleaved layout)."""

    params = (list(CASES), THREADS)
    param_names = ["case", "threads"]
    timeout = TIMEOUT

    def setup(self, case, threads):
        self.fn = require("sinusoidal_encoding")
        self.length, self.dim = CASES[case]
        self._limit_threads(threads)

    def time_sinusoidal_encoding(self, case, threads):
        self.fn(self.length, self.dim)

    def peakmem_sinusoidal_encoding(self, case, threads):
        self.fn(self.length, self.dim)


class SinusoidalSpeedup(ThreadLimited):
    """track_: NumPy-reference / attncore time of one table."""

    params = (list(CASES), THREADS)
    param_names = ["case", "threads"]
    timeout = TIMEOUT
    unit = "ratio"

    def setup(self, case, threads):
        self.fn = require("sinusoidal_encoding")
        self.length, self.dim = CASES[case]
        self._limit_threads(threads)

    def track_speedup_vs_numpy(self, case, threads):
        fn, L, D = self.fn, self.length, self.dim
        return speedup(lambda: numpy_sinusoidal(L, D), lambda: fn(L, D), repeats=5)


class AddPositional(ThreadLimited):
    """time_ / peakmem_ of ``add_positional_encoding`` on (8, 512, 512) float32."""

    params = (["add", "concat"], THREADS)
    param_names = ["mode", "threads"]
    timeout = TIMEOUT

    def setup(self, mode, threads):
        self.fn = require("add_positional_encoding")
        self.x = memo("x", lambda: random((8, 512, 512), "float32", seed=1))
        self._limit_threads(threads)

    def time_add_positional_encoding(self, mode, threads):
        self.fn(self.x, mode=mode)

    def peakmem_add_positional_encoding(self, mode, threads):
        self.fn(self.x, mode=mode)
