#!/usr/bin/env bash
# Run the Hugging Face backend's tests (tests/test_transformers.py and
# tests/test_hf_continuous_batching.py) against the minor release of
# transformers before the one installed, so the backend is tested on the two
# most recent minor releases (CI runs this after the whole suite, which
# covers the installed one).
#
#   tools/test_transformers_prev.sh                  # installed 5.Y -> 5.(Y-1).*
#   tools/test_transformers_prev.sh 5.22.*           # any other release
#   tools/test_transformers_prev.sh 5.23.* -k mask   # pytest arguments after it
#
# A throwaway virtualenv holds only that transformers (installed without its
# dependencies); everything else -- attncore, torch, the test tools -- comes
# from the current Python environment, whose site-packages the virtualenv
# adds behind its own.  The installed environment is not touched.
# ATTNCORE_TF_PREV_DIR=path keeps the virtualenv there (default: a temporary
# directory, removed after).  Needs network access to the package index.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python}"

if [ "$#" -ge 1 ] && [[ "$1" != -* ]]; then
    SPEC="$1"
    shift
else
    SPEC="$("$PY" - <<'EOF'
import transformers
major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
if minor == 0:
    raise SystemExit(f"transformers {transformers.__version__}: no earlier minor release of "
                     f"this major version; name one")
print(f"{major}.{minor - 1}.*")
EOF
)"
fi

if [ -n "${ATTNCORE_TF_PREV_DIR:-}" ]; then
    VENV="$ATTNCORE_TF_PREV_DIR"
else
    VENV="$(mktemp -d)"
    trap 'rm -rf "$VENV"' EXIT
fi

BASE_SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
"$PY" -m venv --without-pip "$VENV"
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# the current environment's packages (and its .pth files: an editable
# attncore) behind the virtualenv's own
echo "import site; site.addsitedir('$BASE_SITE')" > "$SITE/attncore_base_env.pth"
"$PY" -m pip install --quiet --no-deps --target "$SITE" "transformers==$SPEC"

"$VENV/bin/python" -c 'import transformers, attncore, sys
print(f"transformers {transformers.__version__} from {transformers.__file__}")
print(f"attncore from {attncore.__file__}")
sys.exit(0 if transformers.__file__.startswith(sys.prefix) else 1)'
"$VENV/bin/python" -m pytest tests/test_transformers.py tests/test_hf_continuous_batching.py -q "$@"
