import os
import sys

sys.path.insert(0, os.path.dirname(__file__))


import pytest  # noqa: E402

from attncore import _kernels  # noqa: E402

KERNEL_PATHS = ["avx512", "avx2", "portable"]


@pytest.fixture(params=KERNEL_PATHS)
def path(request):
    """Every float32 kernel path this CPU runs, forced in turn (the others
    are skipped), so an AVX-512 machine also tests the AVX2 and portable
    code."""
    if request.param not in _kernels.available_kernel_paths():
        pytest.skip(f"this CPU cannot run the {request.param} path")
    with _kernels.forced_kernel_path(request.param):
        yield request.param


def pytest_report_header(config):
    """Which attncore the run tests (the source tree or an installed wheel)."""
    import attncore
    from attncore._core import _sdpa

    return (f"attncore {getattr(attncore, '__version__', '?')} from {os.path.dirname(attncore.__file__)} "
            f"(float32 kernel paths {', '.join(_kernels.available_kernel_paths())}; "
            f"OpenMP {'on' if _sdpa.openmp_enabled() else 'off'})")
