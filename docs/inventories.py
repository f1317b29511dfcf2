"""Offline intersphinx inventories.

The documentation links to NumPy, SciPy, dask, PyTorch, matplotlib and
Python.  Sphinx normally downloads each project's ``objects.inv``; the build
machine and CI may have no network, so this module writes small inventories
of the names attncore's pages refer to, pointing at the projects' real
pages.  Add a line here when a page refers to a new outside name.
"""
from __future__ import annotations

import os
import zlib

# project -> (base URL, version, [(name, domain:role, relative URI), ...])
# A URI ending in "$" stands for the name itself (Sphinx's convention).
PROJECTS = {
    "python": ("https://docs.python.org/3/", "3", [
        ("int", "py:class", "library/functions.html#int"),
        ("float", "py:class", "library/functions.html#float"),
        ("str", "py:class", "library/stdtypes.html#str"),
        ("bool", "py:class", "library/functions.html#bool"),
        ("dict", "py:class", "library/stdtypes.html#dict"),
        ("list", "py:class", "library/stdtypes.html#list"),
        ("tuple", "py:class", "library/stdtypes.html#tuple"),
        ("type", "py:class", "library/functions.html#type"),
        ("None", "py:data", "library/constants.html#None"),
        ("True", "py:data", "library/constants.html#True"),
        ("False", "py:data", "library/constants.html#False"),
        ("callable", "py:function", "library/functions.html#callable"),
        ("contextlib.contextmanager", "py:function", "library/contextlib.html#$"),
        ("collections.namedtuple", "py:function", "library/collections.html#$"),
        ("bltin-boolean-values", "std:label", "library/stdtypes.html#$"),
        ("sequence", "std:term", "glossary.html#term-sequence"),
        ("iterable", "std:term", "glossary.html#term-iterable"),
        ("mapping", "std:term", "glossary.html#term-mapping"),
        ("generator", "std:term", "glossary.html#term-generator"),
        ("ValueError", "py:exception", "library/exceptions.html#ValueError"),
        ("TypeError", "py:exception", "library/exceptions.html#TypeError"),
        ("ImportError", "py:exception", "library/exceptions.html#ImportError"),
        ("LookupError", "py:exception", "library/exceptions.html#LookupError"),
        ("NotImplementedError", "py:exception", "library/exceptions.html#NotImplementedError"),
        ("RuntimeWarning", "py:exception", "library/exceptions.html#RuntimeWarning"),
        ("importlib.metadata", "py:module", "library/importlib.metadata.html#module-$"),
        ("threading", "py:module", "library/threading.html#module-$"),
    ]),
    "numpy": ("https://numpy.org/doc/stable/", "2.4", [
        ("numpy", "py:module", "reference/index.html#module-$"),
        ("numpy.inf", "py:data", "reference/constants.html#$"),
        ("numpy.nan", "py:data", "reference/constants.html#$"),
        ("numpy.random.RandomState", "py:class",
         "reference/random/legacy.html#$"),
        ("arrays.scalars", "std:label", "reference/arrays.scalars.html#$"),
        ("numpy.ndarray", "py:class", "reference/generated/numpy.ndarray.html#$"),
        ("numpy.dtype", "py:class", "reference/generated/numpy.dtype.html#$"),
        ("numpy.float16", "py:attribute", "reference/arrays.scalars.html#$"),
        ("numpy.float32", "py:attribute", "reference/arrays.scalars.html#$"),
        ("numpy.float64", "py:attribute", "reference/arrays.scalars.html#$"),
        ("numpy.random.Generator", "py:class",
         "reference/random/generator.html#$"),
        ("numpy.random.default_rng", "py:function",
         "reference/random/generator.html#$"),
        ("numpy.concatenate", "py:function", "reference/generated/numpy.concatenate.html#$"),
        ("numpy.from_dlpack", "py:function", "reference/generated/numpy.from_dlpack.html#$"),
        ("numpy.asarray", "py:function", "reference/generated/numpy.asarray.html#$"),
        ("array_like", "std:term", "glossary.html#term-array_like"),
        ("broadcasting", "std:label", "user/basics.broadcasting.html#basics-broadcasting"),
        ("basics.broadcasting", "std:label", "user/basics.broadcasting.html#$"),
    ]),
    "scipy": ("https://docs.scipy.org/doc/scipy/", "1.17", [
        ("scipy.linalg.cython_blas", "py:module", "reference/linalg.cython_blas.html#module-$"),
        ("scipy.linalg", "py:module", "reference/linalg.html#module-$"),
    ]),
    "dask": ("https://docs.dask.org/en/stable/", "2026", [
        ("dask.array.Array", "py:class", "generated/dask.array.Array.html#$"),
        ("dask.array", "py:module", "array.html#module-$"),
    ]),
    "torch": ("https://docs.pytorch.org/docs/stable/", "2.13", [
        ("torch.Tensor", "py:class", "tensors.html#$"),
        ("torch.nn.MultiheadAttention", "py:class",
         "generated/torch.nn.MultiheadAttention.html#$"),
        ("torch.nn.functional.scaled_dot_product_attention", "py:function",
         "generated/torch.nn.functional.scaled_dot_product_attention.html#$"),
        ("torch.set_num_threads", "py:function", "generated/torch.set_num_threads.html#$"),
    ]),
    "matplotlib": ("https://matplotlib.org/stable/", "3", [
        ("matplotlib.axes.Axes", "py:class", "api/_as_gen/matplotlib.axes.Axes.html#$"),
        ("matplotlib.pyplot", "py:module", "api/pyplot_summary.html#module-$"),
    ]),
}


def _inventory(project: str, version: str, entries) -> bytes:
    head = (f"# Sphinx inventory version 2\n# Project: {project}\n# Version: {version}\n"
            "# The remainder of this file is compressed using zlib.\n").encode()
    body = "".join(f"{name} {role} 1 {uri} -\n" for name, role, uri in entries)
    return head + zlib.compress(body.encode())


def write_all(directory: str) -> dict:
    """Write one ``<project>.inv`` per project; return ``intersphinx_mapping``."""
    os.makedirs(directory, exist_ok=True)
    mapping = {}
    for project, (url, version, entries) in PROJECTS.items():
        path = os.path.join(directory, f"{project}.inv")
        data = _inventory(project, version, entries)
        try:
            with open(path, "rb") as f:
                same = f.read() == data
        except OSError:
            same = False
        if not same:
            with open(path, "wb") as f:
                f.write(data)
        mapping[project] = (url, path)
    return mapping
