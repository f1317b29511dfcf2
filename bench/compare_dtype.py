"""attncore on bfloat16 / float16 inputs against its own float32 call and
torch on the same dtype (``python bench/compare.py --dtype bfloat16``).

    python bench/compare_dtype.py --dtype bfloat16 float16 --threads 1 2

Every row is timed side by side in one process (``timing.interleaved_medians``:
medians of interleaved repeats, the same thread count on every side):

* ``attncore`` on the 16-bit inputs (read in place),
* ``ac f32``: attncore on the float32 inputs of the same values,
* ``ac prec``: float32 inputs with ``precision=<dtype>`` (bfloat16 only),
* ``torch``: ``torch.nn.functional.scaled_dot_product_attention`` on the
  16-bit tensors,

then the ratios ``f32/ac`` (> 1: the 16-bit call is faster than attncore's
float32 call) and ``torch/ac``, and the issue's bar for that row.  The
header names the CPU model and whether bfloat16 dot products run
(AVX512_BF16, taken by default on AMD only: ``--bf16-mode native`` forces
them where the CPU has them, ``off`` turns them off).  ``--path avx2`` forces a kernel path for every attncore
call of the table (the fallbacks; the float32 reference too).  The peak
memory row measures a bf16 decode over a 1x8x262144x64 cache in a fresh
process.  A benchmark, never a test.

For benchmarking, unset OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE in the command
that runs this script.
"""
from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import attncore  # noqa: E402
import attncore._kernels  # noqa: E402
from timing import cpu_model, interleaved_medians  # noqa: E402

try:
    import torch
except ImportError:  # a benchmark extra
    torch = None

# name, B, H, N, M, D, causal, bar vs attncore float32, bar vs torch
CASES = [
    ("decode 1x8x1x32768x64", 1, 8, 1, 32768, 64, False, 1.7, 3.0),
    ("decode 8x8x1x4096x128", 8, 8, 1, 4096, 128, False, 1.7, 3.0),
    ("prefill 1x8x1024x64", 1, 8, 1024, 1024, 64, False, 1.5, None),
    ("prefill 1x8x1024x128", 1, 8, 1024, 1024, 128, False, 1.7, None),
    ("causal 1x8x2048x128", 1, 8, 2048, 2048, 128, True, 1.7, None),
]


def _flags():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    fl = set(line.split(":", 1)[1].split())
                    return [x for x in ("avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16",
                                        "f16c") if x in fl]
    except OSError:
        pass
    return []


def header():
    from attncore import _config

    info = _config.config_dict()
    bf = {"bfloat16": "yes", "bfloat16-emulated": "emulated"}.get(
        info["bf16_products"], "no, " + " ".join(_config._BF16_LINES[_config._bf16_line(info)]))
    return (f"cpu: {cpu_model()}, {os.cpu_count()} CPUs, flags {' '.join(_flags())}, "
            f"python {platform.python_version()}\n"
            f"attncore {attncore.__version__} (kernel path {attncore._kernels.kernel_path()}, "
            f"bf16 dot products: {bf}), numpy {np.__version__}"
            + (f", torch {torch.__version__}" if torch is not None else ""))


def _inputs(B, H, N, M, D, dt, seed=0):
    rng = np.random.default_rng(seed)
    f32 = [rng.standard_normal(s, dtype=np.float32) for s in ((B, H, N, D), (B, H, M, D), (B, H, M, D))]
    half = [a.astype(dt) for a in f32]
    return [a.astype(np.float32) for a in half], half  # the same values in both


def run(dtype_name, threads, repeats, path=None):
    import ml_dtypes

    dt = np.dtype(ml_dtypes.bfloat16) if dtype_name == "bfloat16" else np.dtype(np.float16)
    sd = attncore.scaled_dot_product_attention
    rows = []
    fmt = "{:<26} {:>3} {:>9} {:>9} {:>9} {:>9} {:>7} {:>6} {:>8} {:>6}"
    print(fmt.format(f"{dtype_name} case", "thr", "attncore", "ac f32", "ac prec", "torch", "f32/ac",
                     "bar", "torch/ac", "bar"))
    prev = attncore._kernels.set_kernel_path(path) if path else None
    try:
        for name, B, H, N, M, D, causal, bar32, bart in CASES:
            f32, half = _inputs(B, H, N, M, D, dt)
            fns = {
                "attncore": lambda h=half, c=causal: sd(*h, is_causal=c, num_threads=threads),
                "ac f32": lambda f=f32, c=causal: sd(*f, is_causal=c, num_threads=threads),
            }
            if dtype_name == "bfloat16":
                fns["ac prec"] = lambda f=f32, c=causal: sd(*f, is_causal=c, num_threads=threads,
                                                            precision="bfloat16")
            if torch is not None:
                tdt = torch.bfloat16 if dtype_name == "bfloat16" else torch.float16
                tt = [torch.from_numpy(a).to(tdt) for a in f32]
                fns["torch"] = lambda t=tt, c=causal: torch.nn.functional.scaled_dot_product_attention(
                    *t, is_causal=c)
            ms = {k: 1e3 * s for k, s in interleaved_medians(fns, threads, repeats, torch=torch).items()}
            r32 = ms["ac f32"] / ms["attncore"]
            rt = ms["torch"] / ms["attncore"] if "torch" in ms else float("nan")
            print(fmt.format(name, threads, f"{ms['attncore']:.2f}", f"{ms['ac f32']:.2f}",
                             f"{ms['ac prec']:.2f}" if "ac prec" in ms else "-",
                             f"{ms['torch']:.2f}" if "torch" in ms else "-", f"{r32:.2f}",
                             f"{bar32:.1f}" if bar32 else "-", f"{rt:.2f}", f"{bart:.1f}" if bart else "-"),
                  flush=True)
            rows.append({"case": name, "dtype": dtype_name, "threads": threads, "ms": ms,
                         "path": path or attncore._kernels.kernel_path(),
                         "f32_over_attncore": r32, "torch_over_attncore": rt})
    finally:
        if path:
            attncore._kernels.set_kernel_path(prev)
    return rows


_PEAK = """
import numpy as np, ml_dtypes, attncore
def rss(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1])
dt = ml_dtypes.bfloat16
rng = np.random.default_rng(0)
M, D = 262144, 64
k = np.empty((1, 8, M, D), dt); v = np.empty((1, 8, M, D), dt)
for h in range(8):
    k[0, h] = rng.standard_normal((M, D), dtype=np.float32).astype(dt)
    v[0, h] = rng.standard_normal((M, D), dtype=np.float32).astype(dt)
q = rng.standard_normal((1, 8, 1, D), dtype=np.float32).astype(dt)
attncore.scaled_dot_product_attention(q, k[..., :64, :], v[..., :64, :])
open("/proc/self/clear_refs", "w").write("5")
base = rss("VmRSS:")
out = attncore.scaled_dot_product_attention(q, k, v, num_threads={T})
print((rss("VmHWM:") - base) * 1024, out.nbytes, k.nbytes)
"""


def peak_memory(threads=1):
    res = subprocess.run([sys.executable, "-c", _PEAK.format(T=threads)], capture_output=True,
                         text=True, check=True)
    growth, out_bytes, k_bytes = (int(x) for x in res.stdout.split())
    print(f"peak memory, bf16 decode over a 1x8x262144x64 bf16 cache ({threads} thr): growth "
          f"{growth / 2**20:.1f} MiB (output {out_bytes / 2**10:.1f} KiB; one float32 copy of K "
          f"would be {2 * k_bytes / 2**20:.0f} MiB; bar: output + 64 MiB)")
    return {"case": "peakmem bf16 decode 1x8x262144x64", "growth_bytes": growth,
            "output_bytes": out_bytes}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", nargs="+", default=["bfloat16", "float16"],
                    choices=["bfloat16", "float16"])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--path", default=None, choices=["portable", "avx2", "avx512"],
                    help="force this kernel path for every attncore call")
    ap.add_argument("--no-peak", action="store_true")
    ap.add_argument("--bf16-mode", default=None, choices=["native", "emulate", "off"],
                    help="force bfloat16 dot products on ('native': the CPU's vdpbf16ps, "
                         "'emulate': spelled in AVX-512F) or off (the default: on where they "
                         "outpace float32, AMD's AVX512_BF16)")
    args = ap.parse_args(argv)
    if args.bf16_mode:
        attncore._core._sdpa.set_bf16_mode(args.bf16_mode)
    print(header())
    rows = []
    for d in args.dtype:
        for t in args.threads:
            rows += run(d, t, args.repeats, args.path)
    if not args.no_peak:
        rows.append(peak_memory())
    return rows


if __name__ == "__main__":
    main()
