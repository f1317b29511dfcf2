import os
import sys

sys.path.insert(0, os.path.dirname(__file__))


import pytest  # noqa: E402

from attncore import _kernels  # noqa: E402

KERNEL_PATHS = ["avx512", "avx2", "portable"]
# aarch64: the neon path (the portable path's code but for the decode body)
if "neon" in _kernels.available_kernel_paths():
    KERNEL_PATHS.append("neon")
# ATTNCORE_TEST_KERNEL_PATH=avx2 (or portable) runs the whole session on that
# float32 path, as a CPU without AVX-512 (or without AVX2) would: CI runs the
# kernel tests so on its AVX-512 machine.  The `path` fixture then runs that
# path alone.  (ATTNCORE_CPU_FEATURES, read by attncore itself, goes further:
# the dispatcher and every mode default act as on a CPU without the
# features it takes away.)
from reference import FORCED_PATH  # noqa: E402


def pytest_configure(config):
    if FORCED_PATH:
        _kernels.set_kernel_path(FORCED_PATH)  # ValueError: a path this CPU cannot run


@pytest.fixture(params=KERNEL_PATHS)
def path(request):
    """Every float32 kernel path this CPU runs, forced in turn (the others
    are skipped), so an AVX-512 machine also tests the AVX2 and portable
    code."""
    if request.param not in _kernels.available_kernel_paths():
        pytest.skip(f"this CPU cannot run the {request.param} path")
    if FORCED_PATH and request.param != FORCED_PATH:
        pytest.skip(f"ATTNCORE_TEST_KERNEL_PATH={FORCED_PATH}")
    with _kernels.forced_kernel_path(request.param):
        yield request.param


def pytest_report_header(config):
    """Which attncore the run tests (the source tree or an installed wheel)."""
    import attncore
    from attncore._core import _sdpa

    return (f"attncore {getattr(attncore, '__version__', '?')} from {os.path.dirname(attncore.__file__)} "
            f"(float32 kernel paths {', '.join(_kernels.available_kernel_paths())}"
            f"{'; forced: ' + FORCED_PATH if FORCED_PATH else ''}; "
            f"OpenMP {'on' if _sdpa.openmp_enabled() else 'off'})")
