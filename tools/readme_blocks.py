"""Run the README's Python examples as a new user would: each in a fresh
virtual environment that holds only what the README's commands installed
before it.

    python tools/readme_blocks.py                  # README.md of this checkout
    python tools/readme_blocks.py --keep DIR       # keep the venv and wheel in DIR
    python tools/readme_blocks.py --drop-index-url # CI: no --index-url (see below)

What a user has installed when they reach a block:

- the first command of the section holding the README's first ``bash``
  block, the install (``pip install -e . && python -m attncore``); the other
  set-up commands (the test extras, the wheel) are alternatives a user does
  not need for the examples, so they are not run;
- every ``pip install`` of the ``bash`` blocks after that section, up to
  the Python block.

The virtual environment is made with ``python -m venv`` (no system site
packages).  attncore is built once, as a wheel (``pip wheel --no-deps``; a
build that finds the in-tree extensions compiled with the same sources and
flags reuses them, see setup.py), and the README's ``-e .`` / ``".[extra]"``
specs install that wheel (with the extra).  Only the ``pip install`` parts
of a ``bash`` block run; its other commands (``python -m attncore``, the
test suite) are left to the rest of CI.  Each Python block runs in a fresh
interpreter in the README's directory.  ``--drop-index-url`` drops
``--index-url URL`` from the commands, for a machine that cannot reach that
index and picks the build through PIP_CONSTRAINT instead (CI: the CPU torch
of .ci/constraints.txt).

Exit status 0 when every Python block ran; the first failure stops the run.
"""
import argparse
import glob
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FENCE = re.compile(r"^```(\w+)\n(.*?)^```$", re.M | re.S)
HEADING = re.compile(r"^## ", re.M)


def blocks(text):
    """The README's fenced ``bash`` and ``python`` blocks, in order, as
    (language, section number, code); a section starts at each ``## `` heading
    (its ``###`` subsections belong to it)."""
    out = []
    for m in FENCE.finditer(text):
        lang = m.group(1)
        if lang in ("bash", "python"):
            section = len(HEADING.findall(text, 0, m.start()))
            out.append((lang, section, m.group(2)))
    return out


def to_run(text):
    """The blocks a new user runs, in order (see the module docstring)."""
    found = blocks(text)
    first = next(i for i, b in enumerate(found) if b[0] == "bash")
    setup_section = found[first][1]
    chosen = [found[first]]
    for lang, section, code in found[first + 1:]:
        if section != setup_section:
            chosen.append((lang, section, code))
    while chosen and chosen[-1][0] != "python":
        chosen.pop()
    return chosen


def pip_installs(code):
    """The argument lists of the ``pip install`` commands of a bash block."""
    out = []
    for line in code.replace("\\\n", " ").splitlines():
        for cmd in line.split("&&"):
            words = shlex.split(cmd, comments=True)
            if words[:2] == ["pip", "install"]:
                out.append(words[2:])
    return out


def translate(args, wheel, drop_index_url):
    """A README ``pip install`` argument list for this venv: the checkout
    (``-e .``, ``.``, ``".[extra]"``) becomes the wheel."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a == "-e":
            continue
        if drop_index_url and a == "--index-url":
            skip = True
            continue
        m = re.fullmatch(r"\.(\[[\w,-]+\])?", a)
        out.append(wheel + (m.group(1) or "") if m else a)
    return out


def run(cmd, **kw):
    print("+", " ".join(shlex.quote(c) for c in cmd), flush=True)
    subprocess.run(cmd, check=True, **kw)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--readme", default=os.path.join(ROOT, "README.md"))
    ap.add_argument("--keep", help="make the venv and the wheel here (default: a temporary directory)")
    ap.add_argument("--drop-index-url", action="store_true")
    a = ap.parse_args(argv)
    with open(a.readme, encoding="utf-8") as f:
        chosen = to_run(f.read())
    work = a.keep or tempfile.mkdtemp(prefix="readme-blocks-")
    t0 = time.perf_counter()
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", os.path.join(work, "wheel"), ROOT])
    wheel = sorted(glob.glob(os.path.join(work, "wheel", "attncore-*.whl")))[-1]
    venv = os.path.join(work, "venv")
    run([sys.executable, "-m", "venv", "--clear", venv])
    py = os.path.join(venv, "bin", "python")
    n = 0
    for lang, _, code in chosen:
        if lang == "bash":
            for args in pip_installs(code):
                run([py, "-m", "pip", "install", "--quiet", *translate(args, wheel, a.drop_index_url)])
            continue
        n += 1
        print(f"--- README Python block {n}:\n{code}", flush=True)
        t = time.perf_counter()
        run([py, "-c", code], cwd=os.path.dirname(os.path.abspath(a.readme)))
        print(f"--- block {n} ran in {time.perf_counter() - t:.1f} s", flush=True)
    print(f"readme_blocks: {n} Python blocks ran, {time.perf_counter() - t0:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
