"""Compiled kernels of attncore (private)."""
try:
    from . import _sdpa  # noqa: F401
except ImportError as exc:  # pragma: no cover - only on a broken / unbuilt checkout
    raise ImportError(
        "attncore's compiled core (attncore._core._sdpa) is missing: this looks like an "
        "unbuilt source tree. Install with `pip install -e .` (or `pip install .` and run "
        "outside the source directory)."
    ) from exc
