"""Every ``>>>`` example in attncore's docstrings runs and prints what it
shows (two failed with NameErrors: their examples used names they never
made).  Examples marked ``# doctest: +SKIP`` stand for the reader's own
program; the rest must be self-contained."""
import doctest
import importlib
import io
import pkgutil

import numpy as np
import pytest

import attncore

# modules that need an optional extra to import at all
_EXTRAS = {"attncore.dask": "dask", "attncore.integrations._hf_int4": "transformers"}


def _modules():
    names = ["attncore"] + [info.name for info in
                            pkgutil.walk_packages(attncore.__path__, "attncore.")]
    return sorted(n for n in names if not n.startswith("attncore._core"))


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples(name):
    if name in _EXTRAS:
        pytest.importorskip(_EXTRAS[name])
        if name == "attncore.integrations._hf_int4":
            pytest.importorskip("torch")
    mod = importlib.import_module(name)
    tests = [t for t in doctest.DocTestFinder().find(mod, name) if t.examples]
    if not tests:
        pytest.skip(f"{name} has no docstring examples")
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report = io.StringIO()
    opts = np.get_printoptions()
    try:
        failed = [t.name for t in tests if runner.run(t, out=report.write).failed]
    finally:
        np.set_printoptions(**opts)
    assert not failed, f"docstring examples failed: {failed}\n{report.getvalue()}"
