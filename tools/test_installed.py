"""Test an installed attncore (a wheel), not the source tree.

    python tools/test_installed.py [PROJECT_DIR] [pytest arguments ...]

Run with the Python of the environment the wheel is installed in.  It

1. checks that ``import attncore`` resolves to that environment's
   site-packages (never to PROJECT_DIR), with its compiled extensions;
2. runs ``python -m attncore`` (the configuration and the short demo);
3. copies PROJECT_DIR's ``tests/`` (with ``pyproject.toml`` for the pytest
   settings and ``bench/`` for the benchmark-layout test) into a temporary
   directory that holds no ``attncore`` package, and runs pytest there, so
   the tests import the installed package.  Tests whose optional packages
   (torch, keras, jax, transformers, dask, ...) are missing skip; the
   source-tree-only build test skips (no setup.py beside the copy).

PROJECT_DIR defaults to the directory above this script.  Plain Python, so
that cibuildwheel's test command runs it on Linux, macOS and Windows
(``[tool.cibuildwheel] test-command`` in pyproject.toml); tools/wheel_test.sh
runs it in a fresh virtual environment per Python version.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile


def _run(cmd: list[str], cwd: str) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=cwd, check=True)


def check_import(cwd: str, project: str) -> str:
    """Where attncore is imported from (in a child started in ``cwd``)."""
    code = (
        "import attncore, attncore._core._sdpa as s, attncore._core._additive, "
        "attncore._core._linalg; print(attncore.__file__); print(s.__file__)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=cwd, check=True,
                         capture_output=True, text=True).stdout.split()
    pkg, ext = out[0], out[1]
    site = {os.path.realpath(sysconfig.get_paths()[k]) for k in ("purelib", "platlib")}
    real = os.path.realpath(pkg)
    if not any(real.startswith(s + os.sep) for s in site):
        sys.exit(f"test_installed: attncore comes from {pkg}, not from site-packages {sorted(site)}")
    if real.startswith(os.path.realpath(project) + os.sep):
        sys.exit(f"test_installed: attncore comes from the project directory ({pkg})")
    print(f"test_installed: attncore from {pkg}\n                extension {ext}", flush=True)
    return pkg


def main(argv: list[str]) -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    project = os.path.dirname(here)
    if argv and not argv[0].startswith("-"):
        project = os.path.abspath(argv.pop(0))
    if not os.path.isdir(os.path.join(project, "tests")):
        sys.exit(f"test_installed: no tests/ in {project}")
    work = tempfile.mkdtemp(prefix="attncore-installed-")
    try:
        shutil.copytree(os.path.join(project, "tests"), os.path.join(work, "tests"),
                        ignore=shutil.ignore_patterns("__pycache__"))
        if os.path.isdir(os.path.join(project, "bench")):
            shutil.copytree(os.path.join(project, "bench"), os.path.join(work, "bench"),
                            ignore=shutil.ignore_patterns("__pycache__", ".asv"))
        shutil.copy(os.path.join(project, "pyproject.toml"), work)  # [tool.pytest.ini_options]
        check_import(work, project)
        _run([sys.executable, "-m", "attncore"], cwd=work)
        cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--rootdir", work]
        cmd += argv or ["tests", "-q"]
        print("+", " ".join(cmd), flush=True)
        return subprocess.run(cmd, cwd=work).returncode
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
