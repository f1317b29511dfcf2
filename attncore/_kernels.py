"""Which compiled code path the float32 kernels take (private).

``'avx512'`` and ``'avx2'``: the fused kernels (attention and dense layers
without BLAS: queries / rows in SIMD lanes, keys / weights read in place),
chosen at import for the best instruction set the CPU runs.
``'portable'``: BLAS products plus portable loops (also every float64 call).
``'neon'`` (aarch64 only, its best path): the float32 attention kernels on
NEON -- the decode body (query blocks of at most ``_sdpa.SMALL_ROWS`` rows),
which reads bfloat16 / float16 / int8 keys and values in place, and the
fused prefill panels of 8 query rows --; the dense layers, int8 / bfloat16
products and the rest run the portable path's BLAS and loops.

:func:`set_kernel_path` forces a path so that a machine with AVX-512 also
tests the others; the forced path also picks the compiled variant (baseline,
AVX2 + FMA, AVX-512) of the vectorized loops that every path shares
(float64 attention, the weights path, the additive kernel, rotary
embeddings).  The state has one home, in the ``_sdpa`` extension, which
every other extension reads.  It is process-wide state meant for test
set-up and benchmarks, not for use while other threads run attncore.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

from ._core import _sdpa

__all__ = ["kernel_path", "set_kernel_path", "available_kernel_paths", "forced_kernel_path",
           "L2_BYTES"]

def kernel_path() -> str:
    """The float32 path in use: 'avx512', 'avx2', 'portable' or 'neon'."""
    return _sdpa.kernel_path()


def available_kernel_paths() -> tuple:
    """The paths this CPU runs, best last."""
    return tuple(_sdpa.available_kernel_paths())


def set_kernel_path(path: str | None) -> str:
    """Force a path ('avx512', 'avx2', 'portable', 'neon'; None = the best this CPU
    runs); returns the previous one.  ValueError for an unknown name or a
    path the CPU cannot run."""
    return _sdpa.set_kernel_path(path)


@contextmanager
def forced_kernel_path(path: str | None) -> Iterator[str]:
    """Context manager around :func:`set_kernel_path`."""
    prev = set_kernel_path(path)
    try:
        yield kernel_path()
    finally:
        set_kernel_path(prev)


# --------------------------------------------------------------------------
# the CPU's per-core L2 (sizes the BLAS path's tiles and the dense layers'
# weight blocks)
# --------------------------------------------------------------------------
_CACHE_SYSFS = "/sys/devices/system/cpu/cpu0/cache"


def _l2_bytes() -> int:
    """Per-core L2 size (Linux sysconf, else sysfs: CPython's os.sysconf
    may not know the name), 1 MiB when unknown."""
    try:
        n = os.sysconf("SC_LEVEL2_CACHE_SIZE")
    except (ValueError, OSError, AttributeError):
        n = 0
    if n and n > 0:
        return n
    base = _CACHE_SYSFS
    try:
        entries = sorted(os.listdir(base))
    except OSError:
        entries = []
    for idx in entries:
        try:
            with open(f"{base}/{idx}/level") as f:
                if f.read().strip() != "2":
                    continue
            with open(f"{base}/{idx}/size") as f:
                size = f.read().strip().upper()
            mult = {"K": 1 << 10, "M": 1 << 20}.get(size[-1:], 1)
            n = int(size.rstrip("KM")) * mult
        except (OSError, ValueError):
            continue
        if n > 0:
            return n
    return 1 << 20


L2_BYTES = _l2_bytes()
