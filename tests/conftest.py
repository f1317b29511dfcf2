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
