"""asv benchmarks: the cost of ``import attncore`` in a fresh interpreter.

The design budget: attncore needs NumPy and SciPy only, so importing it
should cost about ``import numpy, scipy.linalg`` (0.27 s on the reference
machine), nowhere near a deep-learning framework; importing attncore loads
no alignment plugin.
"""


def timeraw_import_attncore():
    return "import attncore"


def timeraw_import_numpy_scipy_linalg():
    # the floor attncore's import stands on, for reading the number above
    return "import numpy, scipy.linalg"


timeraw_import_attncore.timeout = 60
timeraw_import_numpy_scipy_linalg.timeout = 60
