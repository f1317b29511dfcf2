"""Side-by-side timing of attncore against PyTorch and a NumPy reference.

    python bench/compare.py                 # every case at 1 and 2 threads
    python bench/compare.py --threads 1 2 4 --repeats 15 --cases prefill decode
    python bench/compare.py --json results.json
    python bench/compare.py --suite mha     # MultiHeadAttention: bench/compare_mha.py

Each case runs attncore, torch (when installed) and NumPy interleaved in one
process, with the same thread count for all three, and reports medians over
the repeats and the ratios torch/attncore and numpy/attncore (> 1 means
attncore is faster).  With several threads, each sample is preceded by a
short idle pause (--settle) so that the worker threads one library leaves
spinning (OpenBLAS, OpenMP runtimes) do not slow down the next one.  This is a benchmark, never a test: timings on shared
machines are noisy, so only the ratios measured side by side mean much.

For benchmarking, unset OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE in the command
that runs this script (they pin OpenBLAS to slower kernels).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import attncore  # noqa: E402
from timing import interleaved_medians  # noqa: E402

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # torch is a benchmark extra
    torch = None


# name, group, B, H, N, M, D, variant
CASES = [
    ("prefill 1x8x1024x64", "prefill", 1, 8, 1024, 1024, 64, "none"),
    ("prefill 4x12x512x64", "prefill", 4, 12, 512, 512, 64, "none"),
    ("prefill 1x8x4096x64", "prefill", 1, 8, 4096, 4096, 64, "none"),
    ("prefill 1x16x2048x128", "prefill", 1, 16, 2048, 2048, 128, "none"),
    ("causal 1x8x1024x64", "causal", 1, 8, 1024, 1024, 64, "causal"),
    ("causal 4x12x512x64", "causal", 4, 12, 512, 512, 64, "causal"),
    ("causal 1x8x4096x64", "causal", 1, 8, 4096, 4096, 64, "causal"),
    ("causal 1x16x2048x128", "causal", 1, 16, 2048, 2048, 128, "causal"),
    ("masked25 4x12x512x64", "masked", 4, 12, 512, 512, 64, "keypad"),
    ("decode 1x32x1x4096x128", "decode", 1, 32, 1, 4096, 128, "none"),
    ("decode 8x8x1x2048x64", "decode", 8, 8, 1, 2048, 64, "none"),
    ("decode 1x8x1x32768x64", "decode", 1, 8, 1, 32768, 64, "none"),
    ("seq2seq 32x1x1x50x256", "seq2seq", 32, 1, 1, 50, 256, "none"),
    ("seq2seq 32x1x50x50x256", "seq2seq", 32, 1, 50, 50, 256, "none"),
]


def make_inputs(B, H, N, M, D, variant, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, N, D), dtype=np.float32).astype(dtype)
    k = rng.standard_normal((B, H, M, D), dtype=np.float32).astype(dtype)
    v = rng.standard_normal((B, H, M, D), dtype=np.float32).astype(dtype)
    mask = None
    if variant == "keypad":
        mask = np.ones((B, 1, 1, M), dtype=bool)
        mask[..., M - M // 4:] = False  # last 25 % of the keys are padding
    return q, k, v, mask


def numpy_reference(q, k, v, mask=None, causal=False):
    """Plain NumPy attention (materializes the scores)."""
    s = q @ np.swapaxes(k, -1, -2)
    s *= 1.0 / np.sqrt(q.shape[-1])
    if causal:
        N, M = s.shape[-2:]
        s = np.where(np.tril(np.ones((N, M), bool)), s, -np.inf)
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    s -= s.max(-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(-1, keepdims=True)
    return s @ v


def run_case(case, threads, repeats, with_numpy=True, settle=0.12):
    name, group, B, H, N, M, D, variant = case
    q, k, v, mask = make_inputs(B, H, N, M, D, variant)
    causal = variant == "causal"
    flops = 4.0 * B * H * N * M * D * (0.5 if causal else 1.0)
    nbytes = (k.nbytes + v.nbytes)
    fns = {}
    fns["attncore"] = lambda: attncore.scaled_dot_product_attention(
        q, k, v, mask, is_causal=causal, num_threads=threads)
    if torch is not None:
        tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
        tm = torch.from_numpy(mask) if mask is not None else None

        def run_torch():
            with torch.inference_mode():
                return F.scaled_dot_product_attention(tq, tk, tv, attn_mask=tm, is_causal=causal)

        fns["torch"] = run_torch
    small = B * H * N * M <= 64 * 2**20
    if with_numpy and small:
        fns["numpy"] = lambda: numpy_reference(q, k, v, mask, causal)
    med = interleaved_medians(fns, threads, repeats, settle=settle, torch=torch)
    row = {"case": name, "group": group, "threads": threads,
           "ms": {key: 1e3 * t for key, t in med.items()},
           "gflops_attncore": flops / med["attncore"] / 1e9,
           "gbps_attncore": nbytes / med["attncore"] / 1e9}
    if "torch" in med:
        row["torch_over_attncore"] = med["torch"] / med["attncore"]
    if "numpy" in med:
        row["numpy_over_attncore"] = med["numpy"] / med["attncore"]
    return row


_PEAK_SNIPPET = r"""
import numpy as np, attncore
def rss_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
N, D = {N}, {D}
rng = np.random.default_rng(0)
q = rng.standard_normal((1, 1, N, D), dtype=np.float32)
k = rng.standard_normal((1, 1, N, D), dtype=np.float32)
v = rng.standard_normal((1, 1, N, D), dtype=np.float32)
attncore.scaled_dot_product_attention(q[..., :64, :], k[..., :64, :], v[..., :64, :])  # warm
with open("/proc/self/clear_refs", "w") as f:  # reset the peak (VmHWM) to the current RSS
    f.write("5")
base = rss_kib("VmRSS:")
out = attncore.scaled_dot_product_attention(q, k, v, num_threads={T})
peak = rss_kib("VmHWM:")
print((peak - base) * 1024, out.nbytes)
"""


def peak_memory(N=16384, D=64, threads=1):
    """Peak RSS growth of one attncore call in a fresh process (bytes, Linux)."""
    code = _PEAK_SNIPPET.format(N=N, D=D, T=threads)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    growth, out_bytes = (int(x) for x in res.stdout.split())
    return growth, out_bytes


def header():
    lines = [f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
             f"python {platform.python_version()}",
             f"attncore {attncore.__version__}, numpy {np.__version__}"
             + (f", torch {torch.__version__}" if torch is not None else ", torch not installed")]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--cases", nargs="*", default=None,
                    help="only cases whose name contains one of these words")
    ap.add_argument("--no-numpy", action="store_true")
    ap.add_argument("--no-peak", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--settle", type=float, default=0.12,
                    help="seconds of idle time before each multi-threaded sample (default 0.12)")
    ap.add_argument("--suite", choices=["sdpa", "mha"], default="sdpa",
                    help="mha: run bench/compare_mha.py (MultiHeadAttention, cached decoding)")
    args = ap.parse_args(argv)
    if args.suite == "mha":
        import compare_mha

        return compare_mha.main(
            ["--threads", *map(str, args.threads), "--repeats", str(args.repeats)]
            + (["--cases", *args.cases] if args.cases else [])
            + (["--json", args.json] if args.json else []))
    cases = [c for c in CASES if not args.cases or any(w in c[0] for w in args.cases)]
    print(header())
    rows = []
    fmt = "{:<26} {:>3} {:>10} {:>10} {:>10} {:>9} {:>9} {:>8}"
    print(fmt.format("case (BxHxNxMxD)", "thr", "attncore", "torch", "numpy",
                     "torch/ac", "numpy/ac", "GFLOP/s"))
    for threads in args.threads:
        for case in cases:
            row = run_case(case, threads, args.repeats, not args.no_numpy, args.settle)
            rows.append(row)
            ms = row["ms"]
            print(fmt.format(
                row["case"], threads, f"{ms['attncore']:.3f}",
                f"{ms['torch']:.3f}" if "torch" in ms else "-",
                f"{ms['numpy']:.3f}" if "numpy" in ms else "-",
                f"{row['torch_over_attncore']:.2f}" if "torch_over_attncore" in row else "-",
                f"{row['numpy_over_attncore']:.2f}" if "numpy_over_attncore" in row else "-",
                f"{row['gflops_attncore']:.1f}"), flush=True)
    if not args.no_peak:
        growth, out_bytes = peak_memory()
        print(f"peak memory 1x1x16384^2x64 float32: growth {growth / 2**20:.1f} MiB "
              f"(output {out_bytes / 2**20:.1f} MiB, bar: output + 64 MiB)")
        rows.append({"case": "peakmem 1x1x16384x64", "growth_bytes": growth,
                     "output_bytes": out_bytes})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
