"""bench/mca.py, the llvm-mca model of the kernels' hot loops: a smoke run
(where llvm-mca-14 and gcc are installed) and its assembly helpers.

Speed is never asserted; the smoke run checks that every region is found
and modelled, and that the sgemm reference sits at the model's FMA bound
(a plain FMA micro-kernel: 2 FMAs per cycle on Zen 3's two FMA pipes)."""
import importlib.util
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "mca.py"
# the kernels' C sources: a source checkout has them, an installed wheel's
# test copy does not (the wheel ships no .c / .h)
SOURCES = ROOT / "attncore" / "_core" / "src" / "ac_cpu.h"


def _load():
    spec = importlib.util.spec_from_file_location("attncore_bench_mca", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # (its dataclass looks its module up)
    spec.loader.exec_module(mod)
    return mod


def test_loop_body_takes_the_inner_loop():
    mca = _load()
    lines = ["\tmovl\t$0, %eax", ".L2:", "\tvxorps\t%xmm0, %xmm0, %xmm0", ".L3:",
             "\tvfmadd231ps\t(%rdi), %ymm1, %ymm0", "\taddq\t$32, %rdi",
             "\tcmpq\t%rdi, %rsi", "\tjne\t.L3", "\taddl\t$1, %eax", "\tjmp\t.L2"]
    body = mca.loop_body(lines)
    assert body == ["\tvfmadd231ps\t(%rdi), %ymm1, %ymm0", "\taddq\t$32, %rdi",
                    "\tcmpq\t%rdi, %rsi", "\tjne\t.L3"]
    rest = mca.loop_body(lines, outside=True)
    assert "\tvxorps\t%xmm0, %xmm0, %xmm0" in rest and body[0] not in rest


def test_fma_as_mul_keeps_the_memory_operand_and_destination():
    mca = _load()
    out = mca.fma_as_mul(["\tvfmadd231ps\t8(%rax,%rbx,4), %ymm1, %ymm2",
                          "\tvfmadd132ps\t%ymm1, %ymm3, %ymm0", "\tvaddps\t%ymm1, %ymm2, %ymm3"])
    assert out == ["\tvmulps\t8(%rax,%rbx,4), %ymm2, %ymm2", "\tvmulps\t%ymm1, %ymm0, %ymm0",
                   "\tvaddps\t%ymm1, %ymm2, %ymm3"]


@pytest.mark.skipif(shutil.which("llvm-mca-14") is None or shutil.which("gcc") is None,
                    reason="needs llvm-mca-14 and gcc")
@pytest.mark.skipif(not SOURCES.is_file(), reason="needs the kernels' C sources (a source checkout)")
def test_quick_run_prints_a_summary_line_per_region():
    p = subprocess.run([sys.executable, str(SCRIPT), "--quick"], capture_output=True,
                       text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr
    lines = re.findall(r"^mca (\S+) (\S+) (.*) per (key|tile)$", p.stdout, re.M)
    got = {(k, m) for k, m, _, _ in lines}
    want = {(k, "znver3-fma2") for k in (
        "fused-d64", "fused-d128", "sgemm-ref-d64", "sgemm-ref-d128",
        "decode-f32-d64", "decode-f32-d128")}
    assert want <= got, want - got
    if shutil.which("aarch64-linux-gnu-gcc"):
        assert ("decode-f32-d64", "neoverse-n1") in got
        # the neon column: the NEON body compiled and modelled (a number, not '-')
        neon = [rest for k, m, rest, _ in lines if (k, m) == ("decode-f32-d64", "neoverse-n1")]
        assert re.match(r"neon \d+\.\d+ portable \d+\.\d+$", neon[0]), neon
        # the fused NEON panel, 8 rows x bk keys: its 2 bk (D + Dv) 128-bit
        # FMAs at Neoverse N1's two per cycle bound it from below
        for D, bk in ((64, 128), (128, 64)):
            row = [rest for k, m, rest, _ in lines if (k, m) == (f"fused-d{D}", "neoverse-n1")]
            assert row and row[0].startswith("neon "), row
            assert float(row[0].split()[1]) >= 2 * bk * 2 * D / 2
    vals = {(k, m): float(rest.split()[-1]) for k, m, rest, _ in lines if m == "znver3-fma2"}
    for D, bk in ((64, 128), (128, 64)):
        # the sgemm tile's products, 16 rows x bk keys x (D + Dv) / 8 lanes
        # ymm FMAs, at two per cycle
        bound = 2 * bk * 2 * D / 2
        assert bound <= vals[f"sgemm-ref-d{D}", "znver3-fma2"] <= 1.05 * bound
        assert vals[f"fused-d{D}", "znver3-fma2"] >= bound


@pytest.mark.skipif(shutil.which("llvm-mca-14") is None or shutil.which("gcc") is None
                    or not SOURCES.exists(),
                    reason="needs llvm-mca-14, gcc and the kernels' C sources")
def test_q4_loops_are_modelled_one_key_per_iteration():
    """q4_key divides nothing: each of the 4-bit regions' loops must read
    exactly one key's codes per iteration (D / 16 loads of 8 code bytes,
    each widened by vpmovzxbd), or its cycles would not be per key."""
    mca = _load()
    funcs = mca.functions(mca.compile_asm(shutil.which("gcc"), mca.X86_DRIVER))
    for D in (64, 128):
        for fn, marker in ((f"mca_q4qk_d{D}", "decode-q4-qk"), (f"mca_q4pv_d{D}", "decode-q4-pv")):
            body = mca.loop_body(mca.region(funcs[fn], marker))
            assert sum("vpmovzxbd" in x for x in body) == D // 16, (fn, body)
        r = mca.q4_key(funcs, D, "znver3")
        assert 0 < r["qk"] < 1000 and 0 < r["pv"] < 1000
        assert r["bytes"] == 2 * (D // 2 + 4 * (D // 32))
