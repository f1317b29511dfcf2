"""The kernels' hot loops on llvm-mca's models of cores nobody here has.

Compiles the project's C kernels (``attncore/_core/src``) to assembly with
the flags ``setup.py`` gives the extensions plus ``-DAC_MCA``, which turns
the ``AC_MCA_BEGIN`` / ``AC_MCA_END`` markers around the hot loops into
assembler comments (in every other build they are empty: the shipped object
code is unchanged).  Each marked loop's body (or a marked straight block)
goes through ``llvm-mca-14 -mcpu=<model>``; the script composes the cycles
per iteration into cycles per tile (the fused AVX2 panel: 16 query rows x a
key tile) and per key (the decode body, one query row), and prints the
bottleneck, the FMA-pipe share of the products and a summary line per
kernel and model::

    mca <kernel> <model> <path> <cycles> per <key|tile>

(aarch64, issue 55's form: ``mca <kernel> <model> neon <cycles|-> portable
<cycles> per key``).  Every figure is a model's prediction, not a
measurement.  What the models leave out: caches and memory (every load hits
L1), branch mispredictions, the front end beyond the dispatch width, and the
overlap of one stage with the next (stages are modelled apart and added).

Model caveats (LLVM 14):

* ``znver3`` runs a 256-bit FMA at 1 per cycle (both FMA pipes for one
  cycle: llvm-project issue 59325); Zen 3 runs 2 per cycle (85.8 GFLOP/s
  sgemm at one thread needs more than 16 flops a cycle).  The column
  ``znver3-fma2`` reads every FMA as a multiply (same pipes, 2 per cycle,
  latency 3 instead of 4, one multiplicand's dependency dropped): the
  closer model of Zen 3's FMA pipes.
* ``alderlake`` is the Skylake model in LLVM 14, and ``sapphirerapids``
  Skylake-X's (the script says which model each name maps to).

Usage::

    python bench/mca.py            # every region, x86 and aarch64 models
    python bench/mca.py --quick    # znver3-fma2 and neoverse-n1 only
    python bench/mca.py --asm fused-exp   # print a region's modelled lines

Needs gcc and llvm-mca-14; aarch64-linux-gnu-gcc for the aarch64 part
(``apt-get install gcc-aarch64-linux-gnu``; skipped without it), which runs
on the newest llvm-mca on PATH: LLVM 14's neoverse-n1 / neoverse-v1 are
the Cortex-A57 model, LLVM 18+ (``apt-get install llvm-19``) has theirs.  Does not
need the extensions built.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(HERE), "attncore", "_core", "src")
MCA = "llvm-mca-14"
# the aarch64 models: the newest llvm-mca on PATH (--arm-mca).  LLVM 14 has
# no Neoverse models -- its -mcpu=neoverse-n1 / neoverse-v1 schedule on the
# Cortex-A57 model (64-bit FP pipes: a 128-bit FMA takes 2 cycles of one,
# latency 10; one load pipe) --; LLVM 18+ has N1's and V1's own
ARM_MCA_CANDIDATES = [f"llvm-mca-{v}" for v in range(21, 14, -1)] + [MCA]
ARM_MCA = next((t for t in ARM_MCA_CANDIDATES if shutil.which(t)), MCA)
# setup.py's flags (BuildExt.build_extensions) after Python's own CFLAGS
FLAGS = ["-O3", "-fwrapv", "-fPIC", "-DNDEBUG", "-fno-math-errno", "-fno-trapping-math",
         "-Wno-unused-function", "-fopenmp", "-DAC_MCA"]
X86_MODELS = ["znver3", "znver3-fma2", "alderlake", "skylake", "icelake-server",
              "sapphirerapids"]
ARM_MODELS = ["neoverse-n1", "neoverse-v1", "apple-m1"]
STREAM_B_PER_CYCLE = 6.5  # Zen 3, one thread: 22.9 GB/s at about 3.5 GHz (issue 53)

# The x86 driver: the shipped fused AVX2 panel (its noinline micro-kernels
# come with it), the decode body's shipped instantiations for one query row
# (format, keys per block, value vectors per chunk as ac_pv_rows picks
# them), and the sgemm ceiling: a plain 16 x 6 FMA micro-kernel over packed
# operands, k unrolled by 4.
X86_DRIVER = r"""
#include "ac_sdpa.h"
void *mca_fused_avx2(void) { return (void *)ac_fused_panel_f32_avx2; }
#define MCA_SBF2(fmt, nv) (AC_SMALL_BF2 && (fmt) == AC_SE_BF16 && (nv) % 2 == 0)
#define MCA_DEC(SUF, FMT, KB, NV)                                                       \
AC_TGT_AVX2 void mca_dqk_##SUF(int nk, int D, const float *q, const void *k,            \
                               ptrdiff_t krb, const float *ks, float *S)               \
{                                                                                       \
    ac_scores_rows_avx2(FMT, 1, KB, 0, nk, D, 0.125f, q, D, (const char *)k, krb, ks,   \
                        1, S, nk, NULL);                                                \
}                                                                                       \
AC_TGT_AVX2 void mca_dpv_##SUF(int nk, int Dv, const float *S, const void *v,           \
                               ptrdiff_t vrb, const float *vs, float *acc)             \
{                                                                                       \
    ac_pv_chunk_avx2(FMT, MCA_SBF2(FMT, NV), 1, NV, NV * 8, nk, S, 1, (const char *)v,  \
                     vrb, vs, 1, acc, Dv, 0, (ptrdiff_t)Dv * (ptrdiff_t)ac_se_size(FMT),  \
                     NULL);                                                             \
}
MCA_DEC(f32_d64, AC_SE_F32, 8, 8)
MCA_DEC(f32_d128, AC_SE_F32, 4, 16)
MCA_DEC(bf16_d128, AC_SE_BF16, 8, 16)
MCA_DEC(f16_d128, AC_SE_F16, 8, 16)
MCA_DEC(i8_d128, AC_SE_I8, 8, 16)
/* the 4-bit loops' instances of one query row (the dispatch's: 8 keys a
   block, D a constant, the asymmetric format's group size 32) */
#define MCA_Q4(D)                                                                       \
AC_TGT_AVX2 void mca_q4qk_d##D(int nk, const float *q, const uint8_t *k,                \
                               const uint16_t *sp, float *S)                            \
{ ac_q4_scores_rows_avx2(1, 8, 32, D, nk, D, 0.125f, q, D, k, D / 2, sp, D / 32, S, nk); } \
AC_TGT_AVX2 void mca_q4pv_d##D(int nk, const float *S, const uint8_t *v,                \
                               const uint16_t *sp, float *acc)                          \
{ ac_q4_pv_rows_avx2(1, 32, nk, D, S, nk, v, D / 2, sp, D / 32, acc, 1); }
MCA_Q4(64)
MCA_Q4(128)

AC_TGT_AVX2 void mca_sgemm_16x6(int K, const float *A, const float *B, float *C,
                                ptrdiff_t ldc)
{
    __m256 c0[6], c1[6];
    for (int u = 0; u < 6; u++) c0[u] = c1[u] = _mm256_setzero_ps();
    AC_MCA_BEGIN("sgemm");
    for (int k = 0; k < K; k += 4) {
#pragma GCC unroll 4
        for (int kk = 0; kk < 4; kk++) {
            const __m256 a0 = _mm256_loadu_ps(A + 16 * (k + kk));
            const __m256 a1 = _mm256_loadu_ps(A + 16 * (k + kk) + 8);
#pragma GCC unroll 6
            for (int u = 0; u < 6; u++) {
                const __m256 b = _mm256_broadcast_ss(B + 6 * (k + kk) + u);
                c0[u] = _mm256_fmadd_ps(a0, b, c0[u]);
                c1[u] = _mm256_fmadd_ps(a1, b, c1[u]);
            }
        }
    }
    AC_MCA_END("sgemm");
    for (int u = 0; u < 6; u++) {
        _mm256_storeu_ps(C + u * ldc, c0[u]);
        _mm256_storeu_ps(C + u * ldc + 8, c1[u]);
    }
}
"""

# aarch64: the portable path's decode loops (the compiler's vectorization of
# ac_scores_small / ac_pv_small), one query row.
ARM_PORTABLE_DRIVER = r"""
#include "ac_sdpa.h"
void mca_pqk(int nk, int D, const float *q, const float *k, float *S)
{ ac_scores_small_f32(1, nk, D, 0.125f, q, D, k, D, S, nk); }
void mca_ppv(int nk, int Dv, const float *S, const float *v, float *acc)
{ ac_pv_small_f32(1, nk, Dv, S, nk, v, Dv, acc, 0); }
"""
# aarch64, the neon path: the decode body's NEON instantiation (ac_small.h)
# for one query row as ac_scores_small_neon / ac_pv_rows_neon run it --
# blocks of 4 keys (AC_SW; rows of up to 512 bytes), P.V chunks of 16
# vectors (64 columns) -- per format (NEON_DECODE)
NEON_DRIVER = r"""
#include "ac_sdpa.h"
#define MCA_SBF2(fmt, nv) (AC_SMALL_BF2 && (fmt) == AC_SE_BF16 && (nv) % 2 == 0)
#define MCA_NDEC(SUF, FMT)                                                              \
void mca_nqk_##SUF(int nk, int D, const float *q, const void *k, ptrdiff_t krb,         \
                   const float *ks, float *S)                                           \
{                                                                                       \
    ac_scores_rows_neon(FMT, 1, 4, 0, nk, D, 0.125f, q, D, (const char *)k, krb, ks, 1, \
                        S, nk, NULL);                                                   \
}                                                                                       \
void mca_npv_##SUF(int nk, int Dv, const float *S, const void *v, ptrdiff_t vrb,        \
                   const float *vs, float *acc)                                         \
{                                                                                       \
    ac_pv_chunk_neon(FMT, MCA_SBF2(FMT, 16), 1, 16, 64, nk, S, 1, (const char *)v, vrb,  \
                     vs, 1, acc, Dv, 0, (ptrdiff_t)Dv * (ptrdiff_t)ac_se_size(FMT),     \
                     NULL);                                                             \
}
MCA_NDEC(f32, AC_SE_F32)
MCA_NDEC(bf16, AC_SE_BF16)
MCA_NDEC(f16, AC_SE_F16)
MCA_NDEC(i8, AC_SE_I8)

/* the fused NEON panel (its noinline micro-kernels come with it) */
void *mca_fused_neon(void) { return (void *)ac_fused_panel_f32_neon; }
"""
# the fused NEON panel's regions (ac_fused_x86.h's NEON section: 8-row
# panels, 8-key score micro-tiles, P.V tiles of 4 rows x 16 columns)
NEON_FUSED = {
    "qk8": ("ac_qkmain_f32_neon", "fused-qk", "loop"),     # 8 keys x 8 rows, one d
    "exp": ("ac_fused_panel_f32_neon", "fused-exp", "loop"),  # 2 keys x 8 rows
    "pv4": ("ac_pv_main_f32_neon", "fused-pv", "loop"),    # one key, 4 rows x 16 columns
}
NEON_KU = 8
# (format, bytes per element) of the neon rows
NEON_DECODE = {"f32": 4, "bf16": 2, "f16": 2, "i8": 1}


@dataclass
class Result:
    """llvm-mca's answer for one block of instructions on one model."""
    cycles: float                 # per iteration
    fma_pipes: float              # pressure on the model's FMA pipes, per iteration
    bottleneck: str               # the busiest resource
    pressure: dict = field(default_factory=dict)


def compile_asm(cc, driver, extra=()):
    """The driver's assembly, compiled with the project's flags."""
    inc = sysconfig.get_paths()["include"]
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "mca_driver.c")
        with open(src, "w", encoding="utf-8") as f:
            f.write(driver)
        out = os.path.join(tmp, "mca_driver.s")
        if not os.path.isfile(os.path.join(SRC, "ac_cpu.h")):
            sys.exit(f"mca.py: the kernels' C sources are not in {SRC} (run it from a source checkout)")
        p = subprocess.run([cc, "-S", *FLAGS, *extra, "-I" + SRC, "-I" + inc, src, "-o", out],
                           capture_output=True, text=True)
        if p.returncode:
            sys.exit(f"mca.py: {cc} could not compile the driver:\n{p.stderr[-2000:]}")
        with open(out, encoding="utf-8") as f:
            return f.read()


def functions(asm):
    """Function name (clone suffixes dropped) -> its assembly lines (the
    first function of that name)."""
    out, name, lines = {}, None, []
    for line in asm.splitlines():
        m = re.match(r"^([A-Za-z_][\w.]*):\s*$", line)
        if m and not line.startswith(".L"):
            if name is not None:
                out.setdefault(name.split(".")[0], lines)
            name, lines = m.group(1), []
        elif name is not None:
            lines.append(line)
    if name is not None:
        out.setdefault(name.split(".")[0], lines)
    return out


def region(lines, marker):
    """The lines between the first BEGIN / END pair of `marker`."""
    out, inside = [], False
    for line in lines:
        if re.search(r"LLVM-MCA-BEGIN %s\s*$" % re.escape(marker), line):
            inside, out = True, []
        elif re.search(r"LLVM-MCA-END %s\s*$" % re.escape(marker), line):
            if inside:
                return out
        elif inside:
            out.append(line)
    raise LookupError(f"region {marker!r} not found")


def _is_insn(line):
    s = line.strip()
    return bool(s) and not s.startswith((".", "#", "//", "@")) and not s.endswith(":")


def _branch_target(line):
    m = re.match(r"\s*(?:j[a-z]+|b(?:\.?[a-z]{2})?|cbn?z|tbn?z)\s+(?:[^,]*,\s*)*(\.L\w+)\s*$",
                 line)
    return m.group(1) if m else None


def loop_body(lines, outside=False):
    """The instructions of the innermost loop with the most FMAs (then
    the most instructions): from its label to the branch back to it (or,
    outside=True, every other instruction of `lines`)."""
    labels = {}
    loops = []
    for i, line in enumerate(lines):
        m = re.match(r"^(\.L\w+):", line)
        if m:
            labels[m.group(1)] = i
        t = _branch_target(line)
        if t is not None and t in labels:
            loops.append((labels[t], i))
    inner = [lp for lp in loops
             if not any(o != lp and lp[0] <= o[0] and o[1] <= lp[1] for o in loops)]
    if not inner:
        raise LookupError("no loop in the region")

    def weight(lp):
        body = [x for x in lines[lp[0]:lp[1] + 1] if _is_insn(x)]
        return (sum("fma" in x for x in body), len(body))
    a, b = max(inner, key=weight)
    if outside:
        return [x for x in lines[:a] + lines[b + 1:] if _is_insn(x)]
    return [x for x in lines[a:b + 1] if _is_insn(x)]


def block(lines):
    """Every instruction of the region (a straight block)."""
    return [x for x in lines if _is_insn(x)]


def fma_as_mul(insns):
    """vfmadd*ps X, Y, D -> vmulps X, D, D: the same pipes at 2 per cycle
    (see the module's caveats: LLVM 14's znver3 runs FMAs at 1 per cycle)."""
    out = []
    for x in insns:
        m = re.match(r"\s*vfn?m(?:add|sub)\d{3}([ps][sd])\s+([^,]+(?:\([^)]*\))?),\s*(%[xy]mm\d+),"
                     r"\s*(%[xy]mm\d+)\s*$", x)
        out.append(f"\tvmul{m.group(1)}\t{m.group(2)}, {m.group(4)}, {m.group(4)}" if m else x)
    return out


_CACHE: dict = {}


def _tool(triple):
    """The llvm-mca of a target: ARM_MCA for aarch64, MCA for x86."""
    return ARM_MCA if triple else MCA


def mca(insns, model, iterations=200):
    """llvm-mca on a block of instructions: cycles per iteration, the
    FMA-pipe pressure and the busiest resource."""
    cpu, triple = model, []
    if model == "znver3-fma2":
        cpu, insns = "znver3", fma_as_mul(insns)
    if model in ARM_MODELS:
        triple = ["-mtriple=aarch64"]
    key = (tuple(insns), model, iterations, _tool(triple))
    if key in _CACHE:
        return _CACHE[key]
    text = "\n".join(insns) + "\n"
    p = subprocess.run([_tool(triple), *triple, f"-mcpu={cpu}", f"-iterations={iterations}",
                        "-instruction-info=false", "-resource-pressure=true"],
                       input=text, capture_output=True, text=True, check=True)
    out = p.stdout
    total = float(re.search(r"Total Cycles:\s+(\d+)", out).group(1))
    names = re.findall(r"^\[([\d.]+)\]\s+-\s+(\S+)", out, re.M)
    m = re.search(r"Resource pressure per iteration:\n(.*)\n(.*)\n", out)
    cols = m.group(1).split()
    vals = [0.0 if v == "-" else float(v) for v in m.group(2).split()]
    ids = dict(names)
    pressure = {}
    for c, v in zip(cols, vals):
        n = ids.get(c.strip("[]"), c)
        pressure[n + ("" if "." not in c else c.strip("[]")[c.index("."):])] = v
    fp = fma_pipes(cpu, triple)
    r = Result(cycles=total / iterations,
               fma_pipes=sum(pressure.get(n, 0.0) for n in fp),
               bottleneck=max(pressure, key=pressure.get) if pressure else "-",
               pressure=pressure)
    _CACHE[key] = r
    return r


_PIPES: dict = {}


def fma_pipes(cpu, triple):
    """The resources a run of independent vector FMAs loads on a model
    (its FMA pipes), from llvm-mca itself."""
    k = (cpu, tuple(triple))
    if k not in _PIPES:
        if triple:
            body = [f"\tfmla\tv{i}.4s, v20.4s, v21.4s" for i in range(12)]
        else:
            body = [f"\tvfmadd231ps\t%ymm12, %ymm13, %ymm{i}" for i in range(12)]
        p = subprocess.run([_tool(triple), *triple, f"-mcpu={cpu}", "-iterations=100",
                            "-instruction-info=false"], input="\n".join(body) + "\n",
                           capture_output=True, text=True, check=True)
        out = p.stdout
        names = dict(re.findall(r"^\[([\d.]+)\]\s+-\s+(\S+)", out, re.M))
        m = re.search(r"Resource pressure per iteration:\n(.*)\n(.*)\n", out)
        cols = m.group(1).split()
        vals = [0.0 if v == "-" else float(v) for v in m.group(2).split()]
        _PIPES[k] = [names.get(c.strip("[]"), c) + ("" if "." not in c else
                                                    c.strip("[]")[c.index("."):])
                     for c, v in zip(cols, vals) if v > 0]
    return _PIPES[k]


def fma_rate(model):
    """Vector FMAs per cycle on a model (12 independent ones on x86; 24 on
    aarch64, whose 4-pipe cores -- Neoverse V1, Apple M1 -- need more than
    12 chains of latency 3 - 4 to fill their pipes)."""
    if model in ARM_MODELS:  # (by element too: LLVM's apple-m1 model gives it 3 pipes, 2 else)
        return max(24 / mca([f"\tfmla\tv{i}.4s, v30.4s, v31.{f}" for i in range(24)],
                            model).cycles for f in ("4s", "s[0]"))
    body = [f"\tvfmadd231ps\t%ymm12, %ymm13, %ymm{i}" for i in range(12)]
    return 12.0 / mca(body, model).cycles


def model_of(cpu, triple=()):
    """The scheduling model a -mcpu name maps to (its resources' prefix)."""
    p = subprocess.run([_tool(triple), *triple, f"-mcpu={cpu}", "-iterations=1"],
                       input="\tnop\n",
                       capture_output=True, text=True)
    m = re.search(r"^\[\d+\]\s+-\s+([A-Z][A-Za-z0-9]*?)(?:Port|Unit|FP|AGU|ALU|Divider|Div)",
                  p.stdout, re.M)
    return m.group(1) if m else "?"


# ---------------------------------------------------------------- regions
# (function, marker, how): the loop body ("loop") or the whole region
# ("block"), per iteration of which llvm-mca counts cycles
FUSED = {
    "qk6": ("ac_qkmain_f32_avx2", "fused-qk", "loop"),     # 6 keys x 16 rows, one d
    "qk4": ("ac_qk4_f32_avx2", "fused-qk", "loop"),        # 4 keys x 16 rows, one d
    "exp": ("ac_fused_panel_f32_avx2", "fused-exp", "loop"),  # 2 keys x 16 rows
    "pv6": ("ac_pv_main_f32_avx2", "fused-pv", "loop"),    # one key, 6 rows x 16 columns
    "pv5": ("ac_pv5_main_f32_avx2", "fused-pv", "loop"),   # one key, 5 rows x 16 columns
    "pack": ("ac_fused_panel_f32_avx2", "fused-pack", "loop"),  # 8 rows x 8 columns
    "sgemm": ("mca_sgemm_16x6", "sgemm", "loop"),          # 4 k steps of 16 x 6
}
# decode: (format, D, bytes per element, keys per score block, value vectors)
DECODE = {
    "f32-d64": ("f32_d64", 64, 4, 8),
    "f32-d128": ("f32_d128", 128, 4, 4),
    "bf16-d128": ("bf16_d128", 128, 2, 8),
    "f16-d128": ("f16_d128", 128, 2, 8),
    "i8-d128": ("i8_d128", 128, 1, 8),
}


def insns(funcs, fn, marker, how):
    lines = region(funcs[fn], marker)
    return loop_body(lines) if how == "loop" else block(lines)


def fused_tile(funcs, D, model):
    """Cycles and FMA-pipe cycles per key tile of the 16-row AVX2 panel,
    by stage (ac_fused_panel_f32_avx2's blocking: AC_BK 128 keys per tile,
    64 for rows of 65 - 128 columns; 6-key score micro-tiles with the 6 + 2
    keys as 4 + 4; P.V of 6 + 5 + 5 rows x 16 columns; Dv = D)."""
    bk = 64 if 64 < D <= 128 else 128
    n6 = bk // 6
    n4 = 0
    if bk % 6 == 2:
        n6, n4 = n6 - 1, 2
    elif bk % 6 == 4:
        n4 = 1
    r = {k: mca(insns(funcs, *FUSED[k]), model) for k in FUSED}
    # a micro-kernel call's own work around its loop (the accumulators'
    # set-up, stores, running max, rescale): the function's other
    # instructions as one block -- both sides of its branches, so an upper
    # bound
    ov = {k: mca(loop_body(funcs[FUSED[k][0]], outside=True), model)
          for k in ("qk6", "qk4", "pv6", "pv5")}
    npv = D / 16  # P.V calls per row group: 16 columns each
    st = {
        "Q.K^T": (D * (n6 * r["qk6"].cycles + n4 * r["qk4"].cycles),
                  D * (n6 * r["qk6"].fma_pipes + n4 * r["qk4"].fma_pipes)),
        "Q.K^T calls": (n6 * ov["qk6"].cycles + n4 * ov["qk4"].cycles,
                        n6 * ov["qk6"].fma_pipes + n4 * ov["qk4"].fma_pipes),
        "exp/max/sum": (bk / 2 * r["exp"].cycles, bk / 2 * r["exp"].fma_pipes),
        "P.V": (npv * bk * (r["pv6"].cycles + 2 * r["pv5"].cycles),
                npv * bk * (r["pv6"].fma_pipes + 2 * r["pv5"].fma_pipes)),
        "P.V calls": (npv * (ov["pv6"].cycles + 2 * ov["pv5"].cycles),
                      npv * (ov["pv6"].fma_pipes + 2 * ov["pv5"].fma_pipes)),
        # once per panel (2 x D / 8 blocks of 8 x 8), over 1024 keys' tiles
        "pack (1024 keys)": (2 * D / 8 * r["pack"].cycles / (1024 / bk),
                             2 * D / 8 * r["pack"].fma_pipes / (1024 / bk)),
    }
    products = 2 * bk * (D + D)  # ymm FMAs: 16 rows x bk keys x (D + Dv) / 8 lanes
    total = sum(c for c, _ in st.values())
    rate = fma_rate(model)
    sg = r["sgemm"].cycles / 4 / 12  # cycles per ymm FMA of the sgemm tile
    return {"bk": bk, "stages": st, "total": total, "products": products,
            "share": products / (rate * total), "sgemm": products * sg,
            "of_sgemm": products * sg / total,
            "bottleneck": {k: r[k].bottleneck for k in r}, "regions": r}


def decode_key(funcs, cfg, model):
    """Cycles per key of the AVX2 decode body (one query row: scores, then
    P.V), and the K + V bytes it reads per key."""
    suf, D, es, kb = DECODE[cfg]
    qf, pf = funcs["mca_dqk_" + suf], funcs["mca_dpv_" + suf]
    rb = D * es
    if es == 2 and "bf16" in cfg:
        dr = mca(loop_body(region(qf, "decode-qk-bf2")), model)
        dot = D / 16 * dr.cycles
    else:
        dr = mca(loop_body(region(qf, "decode-qk")), model)
        dot = D / 8 * dr.cycles
    qsum = mca(block(region(qf, "decode-qk-sum")), model).cycles
    # the prefetch loops (a line of 64 bytes per iteration): GCC lays the
    # scores' one out of line, after the loop; it is the same loop as P.V's
    pfl = mca(loop_body(region(pf, "decode-pv-pf")), model).cycles
    qpf = kb * (rb / 64) * pfl
    # (the block holds one key's products; the key loop's own counter and
    # branch, 3 - 4 integer instructions, are left out)
    pr = mca(block(region(pf, "decode-pv")), model)
    pv = pr.cycles
    ppf = rb / 64 * pfl
    qk = (dot + qsum + qpf) / kb
    nbytes = 2 * rb + (8 if es == 1 else 0)
    return {"qk": qk, "pv": pv + ppf, "total": qk + pv + ppf, "bytes": nbytes,
            "prefetch": qpf / kb + ppf,
            "bottleneck": "/".join(re.sub(r"^(Zn3|SKL|ICX|SKX)", "", b)
                                   for b in (dr.bottleneck, pr.bottleneck))}


def q4_key(funcs, D, model):
    """Cycles per key of the AVX2 4-bit decode loops (one query row, groups
    of 32, D = Dv): the scores' loop over a block's 8 keys (a key's codes
    unpacked, the products, the group scales and offsets per iteration)
    and P.V's over a block's keys (one key's codes times its weights).  Left
    out, as in decode_key: the per-block work outside the loops (the
    float16 pairs converted, P.V's weights and offsets' sums, per 16
    keys) and the prefetches.  Bytes: codes + a float16 scale and offset
    per group, K and V."""
    # (both regions' loops run one key per iteration: GCC keeps the block's
    # loop over its 8 keys rolled)
    qk = mca(loop_body(region(funcs[f"mca_q4qk_d{D}"], "decode-q4-qk")), model)
    pv = mca(loop_body(region(funcs[f"mca_q4pv_d{D}"], "decode-q4-pv")), model)
    return {"qk": qk.cycles, "pv": pv.cycles, "total": qk.cycles + pv.cycles,
            "bytes": 2 * (D // 2 + 4 * (D // 32))}


def report_q4(funcs, models, summary):
    print("\nAVX2 4-bit decode loops (groups of 32), one query row: cycles per key, "
          "llvm-mca prediction (the loops only: see q4_key)")
    print(_row("kernel", models))
    for D in (64, 128):
        res = {m: q4_key(funcs, D, m) for m in models}
        print(_row(f"decode-q4-d{D}", [res[m]["total"] for m in models]))
        print(_row("  scores / P.V", [f"{res[m]['qk']:.1f} / {res[m]['pv']:.1f}"
                                      for m in models]))
        print(_row("  K+V bytes / cycle", [res[m]["bytes"] / res[m]["total"] for m in models]))
        for m in models:
            summary.append(f"mca decode-q4-d{D} {m} avx2 {res[m]['total']:.1f} per key")


def arm_key(funcs, D, model, prefix="mca_p"):
    """Cycles per key of a one-row decode on aarch64: the vectorized dot
    product over D and the P.V update over Dv = D (loop iterations from
    the loop's own FMA count, 4 lanes each).  The vector loops only: the
    portable scores' scalar reduction per key is left out (in the portable
    path's favour)."""
    tot = 0.0
    for fn, marker in ((prefix + "qk", "portable-decode-qk"), (prefix + "pv", "portable-decode-pv")):
        body = loop_body(region(funcs[fn], marker))
        per = 4 * max(1, sum(bool(re.search(r"\bfml[as]\b.*\.4s", x)) for x in body))
        tot += D / per * mca(body, model).cycles
    return tot


def neon_key(funcs, fmt, D, model):
    """Cycles per key of the neon path's decode body, one query row:
    scores of 4 keys a block (the dot product's loop over columns, 8 an
    iteration into two accumulators per key -- bfloat16 pairs: 8 into one
    --, the transposing sum and scale per block, the prefetch of the rows
    4 KiB ahead) and P.V (a key's block of products per 64-column chunk,
    the prefetch of its row); as decode_key composes the AVX2 body's.
    (Keys' own loop counters left out, as there.)"""
    es = NEON_DECODE[fmt]
    qf, pf = funcs["mca_nqk_" + fmt], funcs["mca_npv_" + fmt]
    rb = D * es
    if fmt == "bf16":
        dot = D / 8 * mca(loop_body(region(qf, "decode-qk-bf2")), model).cycles
    else:
        dot = D / 8 * mca(loop_body(region(qf, "decode-qk2")), model).cycles
    qsum = mca(block(region(qf, "decode-qk-sum")), model).cycles
    pfl = mca(loop_body(region(pf, "decode-pv-pf")), model).cycles
    qpf = 4 * (rb / 64) * pfl
    pv = -(-D // 64) * mca(block(region(pf, "decode-pv")), model).cycles
    return (dot + qsum + qpf) / 4 + pv + rb / 64 * pfl


def neon_fused_tile(funcs, D, model):
    """Cycles per key tile of the 8-row NEON panel, by stage, as fused_tile
    composes the AVX2 one: AC_BK 128 keys per tile (64 for rows of 65 -
    128 columns), score micro-tiles of NEON_KU keys, P.V as two 4-row tiles
    per 16 columns, Dv = D; and the FMA pipes' share on the products."""
    bk = 64 if 64 < D <= 128 else 128
    r = {k: mca(insns(funcs, *NEON_FUSED[k]), model) for k in NEON_FUSED}
    ov = {k: mca(loop_body(funcs[NEON_FUSED[k][0]], outside=True), model)
          for k in ("qk8", "pv4")}
    nq = bk // NEON_KU
    st = {
        "Q.K^T": D * nq * r["qk8"].cycles,
        "Q.K^T calls": nq * ov["qk8"].cycles,
        "exp/max/sum": bk / 2 * r["exp"].cycles,
        "P.V": D / 16 * bk * 2 * r["pv4"].cycles,
        "P.V calls": D / 16 * 2 * ov["pv4"].cycles,
    }
    products = 2 * bk * (D + D)  # 128-bit FMAs: 8 rows x bk keys x (D + Dv) / 4 lanes
    total = sum(st.values())
    return {"bk": bk, "stages": st, "total": total,
            "share": products / (fma_rate(model) * total), "regions": r}


def report_neon_fused(neon, models, summary):
    for D in (64, 128):
        res = {m: neon_fused_tile(neon, D, m) for m in models}
        bk = res[models[0]]["bk"]
        print(f"\nfused NEON panel, D = Dv = {D}: cycles per tile of 8 rows x {bk} keys "
              "(llvm-mca prediction, not a measurement)")
        print(_row("stage", models))
        for st in res[models[0]]["stages"]:
            print(_row(st, [res[m]["stages"][st] for m in models]))
        print(_row("total", [res[m]["total"] for m in models]))
        print(_row("FMA pipes on products", [res[m]["share"] for m in models], "{:>15.2f}"))
        for k in NEON_FUSED:
            print(_row(f"{k}: cyc/iter", [res[m]["regions"][k].cycles for m in models],
                       "{:>15.2f}"))
        for m in models:
            summary.append(f"mca fused-d{D} {m} neon {res[m]['total']:.0f} per tile")


def _row(label, vals, fmt="{:>15.1f}"):
    w = int(re.search(r">(\d+)", fmt).group(1))
    return f"{label:<22}" + "".join(fmt.format(v) if isinstance(v, float) else f"{v:>{w}}"
                                     for v in vals)


def report_fused(funcs, models, summary):
    for D in (64, 128):
        res = {m: fused_tile(funcs, D, m) for m in models}
        bk = res[models[0]]["bk"]
        print(f"\nfused AVX2 panel, D = Dv = {D}: cycles per tile of 16 rows x {bk} keys "
              "(llvm-mca prediction, not a measurement)")
        print(_row("stage", models))
        for st in res[models[0]]["stages"]:
            print(_row(st, [res[m]["stages"][st][0] for m in models]))
        print(_row("total", [res[m]["total"] for m in models]))
        print(_row("sgemm, same products", [res[m]["sgemm"] for m in models]))
        print(_row("share of sgemm", [res[m]["of_sgemm"] for m in models], "{:>15.2f}"))
        print(_row("FMA pipes on products", [res[m]["share"] for m in models], "{:>15.2f}"))
        print("FMA-pipe cycles per tile, by stage:")
        for st in res[models[0]]["stages"]:
            print(_row(f"FMA pipes: {st.split(' (')[0]}",
                       [res[m]["stages"][st][1] for m in models]))
        for k in ("qk6", "exp", "pv6", "pack", "sgemm"):
            print(_row(f"{k}: cyc/iter", [res[m]["regions"][k].cycles for m in models],
                       "{:>15.2f}"))
            print(_row(f"{k}: bottleneck", [res[m]["bottleneck"][k] for m in models]))
        for m in models:
            summary.append(f"mca fused-d{D} {m} avx2 {res[m]['total']:.0f} per tile")
            summary.append(f"mca sgemm-ref-d{D} {m} avx2 {res[m]['sgemm']:.0f} per tile")


def report_decode(funcs, models, summary, cfgs):
    print("\nAVX2 decode body, one query row: cycles per key (scores + P.V), "
          "llvm-mca prediction")
    print(_row("kernel", models))
    res = {(c, m): decode_key(funcs, c, m) for c in cfgs for m in models}
    for c in cfgs:
        print(_row(f"decode-{c}", [res[c, m]["total"] for m in models]))
        print(_row("  of which prefetch", [res[c, m]["prefetch"] for m in models]))
        print(_row("  busiest (dot/P.V)", [res[c, m]["bottleneck"] for m in models]))
        print(_row("  K+V bytes / cycle", [res[c, m]["bytes"] / res[c, m]["total"]
                                           for m in models]))
    print(f"(Zen 3 streams about {STREAM_B_PER_CYCLE} B/cycle at one thread: 22.9 GB/s "
          "at ~3.5 GHz)")
    for c in cfgs:
        for m in models:
            summary.append(f"mca decode-{c} {m} avx2 {res[c, m]['total']:.1f} per key")


def report_arm(models, summary, quick):
    cc = shutil.which("aarch64-linux-gnu-gcc")
    if cc is None:
        print("\naarch64: aarch64-linux-gnu-gcc not found (apt-get install "
              "gcc-aarch64-linux-gnu); skipped")
        return
    funcs = functions(compile_asm(cc, ARM_PORTABLE_DRIVER))
    neon = functions(compile_asm(cc, NEON_DRIVER)) if NEON_DRIVER else None
    tri = ("-mtriple=aarch64",)
    print(f"\naarch64 models ({ARM_MCA}): " + ", ".join(f"{m} = {model_of(m, tri)}"
                                                       for m in models))
    print("aarch64 decode, one query row: cycles per key, llvm-mca prediction "
          "(neon: the decode body on NEON, ac_small.h; portable: the compiler's NEON "
          "vectorization of the portable loops, vector loops only -- for 16-bit and "
          "int8 rows the float32 loops, the rows' conversion left out: both in the "
          "portable path's favour)")
    print(_row("kernel", [f"{m[:11]} {p[:4]}" for m in models for p in ("neon", "portable")],
               "{:>17.1f}"))
    cfgs = [("f32", 64)] if quick else [("f32", 64), ("f32", 128), ("bf16", 128),
                                        ("f16", 128), ("i8", 128)]
    for fmt, D in cfgs:
        vals = []
        for m in models:
            n = neon_key(neon, fmt, D, m) if neon else None
            p = arm_key(funcs, D, m)
            vals += ["-" if n is None else n, p]
            summary.append(f"mca decode-{fmt}-d{D} {m} neon "
                           f"{'-' if n is None else f'{n:.1f}'} portable {p:.1f} per key")
        print(_row(f"decode-{fmt}-d{D}", vals, "{:>17.1f}"))
    if neon is not None:
        report_neon_fused(neon, models, summary)


def main(argv=None):
    global ARM_MCA
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="znver3-fma2 and neoverse-n1 only (the test's smoke run)")
    ap.add_argument("--models", help="comma-separated x86 models (default: all)")
    ap.add_argument("--arm-mca", metavar="TOOL",
                    help=f"llvm-mca for the aarch64 models (default: the newest on PATH, "
                         f"now {ARM_MCA}; llvm-mca-14's neoverse models are Cortex-A57's)")
    ap.add_argument("--asm", metavar="REGION",
                    help="print a fused region's modelled instructions (qk6, exp, pv6, ...)")
    a = ap.parse_args(argv)
    if a.arm_mca:
        ARM_MCA = a.arm_mca
    if shutil.which(MCA) is None:
        raise SystemExit(f"{MCA} not found on PATH")
    funcs = functions(compile_asm(shutil.which("gcc") or "gcc", X86_DRIVER))
    if a.asm:
        print("\n".join(insns(funcs, *FUSED[a.asm])))
        return
    models = (a.models.split(",") if a.models else
              ["znver3-fma2"] if a.quick else X86_MODELS)
    arm = ARM_MODELS[:1] if a.quick else ARM_MODELS
    print("models:", ", ".join(f"{m} = {model_of(m.replace('-fma2', ''))}" for m in models))
    summary: list = []
    report_fused(funcs, models, summary)
    report_decode(funcs, models, summary,
                  ["f32-d64", "f32-d128"] if a.quick else list(DECODE))
    if not a.quick:
        report_q4(funcs, models, summary)
    report_arm(arm, summary, a.quick)
    print()
    print("\n".join(summary))


if __name__ == "__main__":
    main()
