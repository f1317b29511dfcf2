#!/usr/bin/env bash
# tools/neon_test.sh -- the neon path's decode body on emulated aarch64 CPUs.
#
# Cross-compiles tools/neon_check.c (the NEON decode body and the portable
# loops against a float64 reference, every format of keys / values, and the
# dispatch through ac_sdpa_range_f32 with masks; see its first comment)
# and runs it under qemu-user:
#   -O2, -cpu cortex-a53   (ARMv8.0: NEON only)
#   -O2, -cpu max          (every extension QEMU has: dotprod, bf16, i8mm, SVE)
#   setup.py's flags (-O3 -fno-math-errno -fno-trapping-math -fwrapv),
#        -cpu cortex-a53   (the code the extension ships)
# Installs nothing: it names the packages to apt-get install when a tool is
# missing.  Exits non-zero on a missing tool or any mismatch.  About a
# minute on an idle x86 core (qemu-user runs the checks in ~10 s of CPU
# each); the whole Python extension under emulation is
# tools/aarch64_emulated.sh (much slower).
#
# Usage: tools/neon_test.sh [--quick]   (--quick: the cortex-a53 -O2 run only)
set -euo pipefail
cd "$(dirname "$0")/.."

CC=${CC_AARCH64:-aarch64-linux-gnu-gcc}
QEMU=""
for q in qemu-aarch64-static qemu-aarch64; do
    if command -v "$q" >/dev/null 2>&1; then QEMU=$q; break; fi
done
missing=()
command -v "$CC" >/dev/null 2>&1 || missing+=("gcc-aarch64-linux-gnu")
[ -n "$QEMU" ] || missing+=("qemu-user-static")
if [ ${#missing[@]} -gt 0 ]; then
    echo "neon_test: missing tools; install them with:" >&2
    echo "    apt-get update && apt-get install -y ${missing[*]}" >&2
    exit 2
fi

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
build() {  # name, flags...
    local name=$1
    shift
    # static: no aarch64 sysroot needed at run time
    "$CC" "$@" -static -Wall -Wno-unknown-pragmas -Wno-unused-function \
        -Iattncore/_core/src -o "$out/$name" tools/neon_check.c -lm
}
build o2 -O2
runs=("o2 cortex-a53")
if [ "${1:-}" != "--quick" ]; then
    build o3 -O3 -fwrapv -fno-math-errno -fno-trapping-math -DNDEBUG
    runs+=("o2 max" "o3 cortex-a53")
fi

status=0
for r in "${runs[@]}"; do
    set -- $r
    start=$(date +%s%N)
    if "$QEMU" -cpu "$2" "$out/$1"; then
        res=passed
    else
        res=FAILED
        status=1
    fi
    ms=$(( ($(date +%s%N) - start) / 1000000 ))
    printf 'neon_test: %s at -cpu %s: %s in %d.%d s\n' "$1" "$2" "$res" $((ms / 1000)) \
        $((ms % 1000 / 100))
done
exit $status
