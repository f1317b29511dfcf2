"""The README's Python examples run as they stand (the guide's run as
doctests: ``pytest docs/guide``).

Here they run in the test environment, a block skipped when a package it
imports is missing; ``tools/readme_blocks.py`` (CI) runs each one in a fresh
virtual environment holding only what the README's commands before it
installed.  The last test checks, without installing anything, that the
commands before each block install every package it imports."""
import ast
import pathlib
import re
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
sys.path.insert(0, str(ROOT / "tools"))
try:
    import readme_blocks
except ImportError:  # an installed copy of the tests, without tools/
    readme_blocks = None
finally:
    sys.path.pop(0)


def python_blocks():
    if not README.exists():
        return []
    return re.findall(r"^```python\n(.*?)^```$", README.read_text(encoding="utf-8"), re.M | re.S)


BLOCKS = python_blocks()


def imported(code):
    """The top-level packages a block imports."""
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module.split(".")[0])
    return names


def test_readme_has_examples():
    if not README.exists():
        pytest.skip("README.md is not in this checkout")
    assert len(BLOCKS) >= 3


@pytest.mark.parametrize("code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_readme_example_runs(code):
    for name in sorted(imported(code)):
        pytest.importorskip(name)
    ns = {}
    exec(compile(code, str(README), "exec"), ns)
    if "attn_implementation" in code:
        assert ns["model"].config._attn_implementation == "attncore"
        assert ns["tokens"].shape[0] == 1 and 4 < ns["tokens"].shape[1] <= 12  # (an end token stops it)


# what the README's pip specs install, for the packages its blocks import
PROVIDES = {".": {"attncore", "numpy", "scipy", "threadpoolctl"},
            ".[transformers]": {"attncore", "numpy", "scipy", "threadpoolctl", "transformers", "torch"}}


def test_readme_blocks_install_what_they_import():
    if readme_blocks is None or not README.exists():
        pytest.skip("README.md / tools/readme_blocks.py are not in this checkout")
    have, checked = set(), 0
    for lang, _, code in readme_blocks.to_run(README.read_text(encoding="utf-8")):
        if lang == "bash":
            for args in readme_blocks.pip_installs(code):
                for a in args:
                    if not a.startswith("-") and "://" not in a:
                        have |= PROVIDES.get(a, {a})
            continue
        missing = imported(code) - have - set(sys.stdlib_module_names)
        assert not missing, f"README block imports {missing} before a command installs it:\n{code}"
        checked += 1
    assert checked == len(BLOCKS)
