#!/usr/bin/env bash
# Build attncore with AddressSanitizer + UndefinedBehaviorSanitizer in a
# throwaway copy of the source tree and run tests there under the
# sanitizers (halting on the first report).  The normal build / install is
# not touched.
#
#   tools/sanitize.sh                       # property tests (CI profile), test_sdpa, test_kernel_paths,
#                                           # 16-bit, int8 Q.K^T, ALiBi / sinks, varlen, forced paths
#   tools/sanitize.sh tests                 # the whole suite
#   tools/sanitize.sh tests/test_mha.py -k cache
#
# Needs gcc (or a compiler whose `-print-file-name=libasan.so` works) and the
# build requirements (setuptools>=77, Cython>=3, numpy, scipy) plus the test
# extra in the current Python environment.  ATTNCORE_SANITIZE_DIR=path keeps
# the sanitized copy there (default: a temporary directory, removed after).
set -euo pipefail
SRC="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-python}"
CC_BIN="${CC:-gcc}"

if [ "$#" -eq 0 ]; then
    set -- tests/test_properties.py tests/test_sdpa.py tests/test_kernel_paths.py \
        tests/test_half.py tests/test_int8.py tests/test_alibi_sinks.py tests/test_varlen.py \
        tests/test_forced_paths.py tests/test_paged.py tests/test_folded_decode.py \
        tests/test_paged4.py tests/test_kv4_attention.py
fi

if [ -n "${ATTNCORE_SANITIZE_DIR:-}" ]; then
    WORK="$ATTNCORE_SANITIZE_DIR"
    mkdir -p "$WORK"
else
    WORK="$(mktemp -d)"
    trap 'rm -rf "$WORK"' EXIT
fi

# the tracked and untracked-but-not-ignored files: no build outputs copied
(cd "$SRC" && git ls-files -z --cached --others --exclude-standard) |
    (cd "$SRC" && xargs -0 cp --parents -t "$WORK" 2>/dev/null || true)

# -g1: line tables only (file:line in the reports); full -g made GCC track
# variables through the kernels: the ASan compile of _sdpa.c took about 28
# CPU-minutes against 18.5 with -g1 (Xeon family 6 model 207)
SAN="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -g1"
echo "sanitize: building in $WORK"
(cd "$WORK" && CC="$CC_BIN" CFLAGS="$SAN" LDFLAGS="$SAN" ATTNCORE_FAIL_NO_OPENMP=1 \
    "$PY" setup.py build_ext --inplace -q)

LIBASAN="$("$CC_BIN" -print-file-name=libasan.so)"
LIBUBSAN="$("$CC_BIN" -print-file-name=libubsan.so)"
echo "sanitize: running pytest $* (LD_PRELOAD=$LIBASAN $LIBUBSAN)"
cd "$WORK"
# the sanitized copy, not an installed attncore, must be the one imported
PYTHONPATH="$WORK" "$PY" -c "import importlib.util as u, sys; f = u.find_spec('attncore').origin; \
sys.exit(0 if f.startswith('$WORK') else 'sanitize: attncore would come from ' + f)"
LD_PRELOAD="$LIBASAN $LIBUBSAN" \
ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=1:${ASAN_OPTIONS:-}" \
UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1:${UBSAN_OPTIONS:-}" \
PYTHONPATH="$WORK" \
    "$PY" -m pytest -q -p no:cacheprovider "$@"
