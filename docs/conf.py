"""Sphinx configuration of the attncore documentation.

Build (from the repository root; warnings are errors)::

    pip install -e ".[docs]" && sphinx-build -W -b html docs docs/_build/html

Nothing is fetched from the network: the intersphinx inventories are
written from ``docs/inventories.py`` at build time, and the gallery's
examples use only files that ship in installed packages.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)  # inventories.py
sys.path.insert(0, os.path.join(HERE, "_ext"))  # readme_section.py

# The documented command installs attncore (pip install -e .).  From a source
# checkout built in place (python setup.py build_ext --inplace) without an
# install, import it from the checkout instead.
if importlib.util.find_spec("attncore") is None:
    sys.path.insert(0, ROOT)

import attncore  # noqa: E402
import inventories  # noqa: E402

# -- project -----------------------------------------------------------------
project = "attncore"
author = "the attncore developers"
copyright = f"{time.gmtime().tm_year}, {author}"
release = attncore.__version__
version = ".".join(release.split(".")[:2])

# -- extensions --------------------------------------------------------------
extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.intersphinx",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
    "numpydoc",
    "sphinx_gallery.gen_gallery",
    "readme_section",
]

templates_path = ["_templates"]
exclude_patterns = ["_build", "examples", "auto_examples/*.ipynb", "auto_examples/*.py",
                    "auto_examples/*.zip", "auto_examples/*.md5", "auto_examples/*.json",
                    "**/*.codeobj.json"]
default_role = "py:obj"
# the README's tables and guide pages use a few characters Sphinx's smart
# quotes would change inside inline literals of option names
smartquotes = True

# -- autodoc / autosummary / numpydoc ---------------------------------------
autosummary_generate = True
autosummary_imported_members = False
autodoc_default_options = {"members": True, "inherited-members": False}
autodoc_typehints = "none"           # the numpydoc sections carry the types
autodoc_member_order = "bysource"
numpydoc_show_class_members = False  # the autosummary class template lists them
numpydoc_class_members_toctree = False
numpydoc_attributes_as_param_list = True
numpydoc_xref_param_type = True
numpydoc_xref_aliases = {
    "ndarray": "numpy.ndarray",
    "dtype": "numpy.dtype",
    "array_like": ":term:`numpy:array_like`",
    "Generator": "numpy.random.Generator",
    "Axes": "matplotlib.axes.Axes",
    "Alignment": "attncore.Alignment",
    "Attention": "attncore.Attention",
    "Memory": "attncore.Memory",
    "KVCache": "attncore.KVCache",
    "MultiHeadAttention": "attncore.MultiHeadAttention",
}
numpydoc_xref_ignore = {"optional", "default", "of", "or", "shape", "and", "each", "one", "per",
                        "arrays", "any", "ints", "anything"}
# numpydoc's own docstring checks are left to review; Sphinx -W still fails on
# malformed sections
numpydoc_validation_checks: set = set()

# -- intersphinx (offline) ---------------------------------------------------
# The build machine and CI may have no network, and -W must never fail because
# a site is unreachable.  Instead of downloading objects.inv files, small
# inventories of the names these pages refer to are written from
# docs/inventories.py; the links point at the projects' real pages.
_INV_DIR = os.path.join(HERE, "_build", "inventories")
intersphinx_mapping = inventories.write_all(_INV_DIR)
intersphinx_timeout = 1

# -- sphinx-gallery ----------------------------------------------------------
sphinx_gallery_conf = {
    "examples_dirs": "examples",
    "gallery_dirs": "auto_examples",
    "filename_pattern": r"/plot_",     # execute every plot_*.py
    "within_subsection_order": "FileNameSortKey",
    "backreferences_dir": "gen_modules/backreferences",
    "doc_module": ("attncore",),
    "reference_url": {"attncore": None},
    "download_all_examples": False,
    "remove_config_comments": True,
    "abort_on_example_error": True,
    "matplotlib_animations": False,
    "image_scrapers": ("matplotlib",),
    "show_memory": False,
    "min_reported_time": 0,
}

# -- HTML --------------------------------------------------------------------
html_theme = "pydata_sphinx_theme" if importlib.util.find_spec("pydata_sphinx_theme") \
    else "alabaster"
html_title = f"attncore {release}"
html_static_path = ["_static"]
html_show_sourcelink = False
if html_theme == "pydata_sphinx_theme":
    html_theme_options = {
        "navigation_with_keys": False,
        "show_toc_level": 2,
        "secondary_sidebar_items": ["page-toc"],
    }
