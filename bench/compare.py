"""Side-by-side timing of attncore against PyTorch, ONNX Runtime and NumPy.

    python bench/compare.py                 # every case at 1 and 2 threads
    python bench/compare.py --threads 1 2 4 --repeats 15 --cases prefill decode
    python bench/compare.py --json results.json
    python bench/compare.py --concurrency   # Python threads calling at once
    python bench/compare.py --variants      # sliding window, softcap, int8 K/V
    python bench/compare.py --suite mha     # MultiHeadAttention: bench/compare_mha.py
    python bench/compare.py --suite attention / varlen   # compare_alignments / compare_varlen
    python bench/compare.py --dtype bfloat16 float16   # 16-bit inputs: bench/compare_dtype.py
    python bench/compare.py --precision int8           # int8 Q.K^T: bench/compare_int8.py
    python bench/compare.py --simulate-avx2 ...        # an AVX2-only core on an AVX-512 one

Each case runs attncore, torch SDPA, ONNX Runtime's contrib
``com.microsoft.MultiHeadAttention`` ("ort mha") and standard ``Attention``
operator ("ort attn", opset 23) -- see ``bench/peers.py`` -- and NumPy
(the ``heads`` case: Q, K, V the head views of one (B, N, 3 H D)
projection, read in place; ONNX Runtime gets that layout itself),
interleaved in one process, with the same thread count for all
(``intra_op_num_threads`` for ONNX Runtime), and reports medians over the
repeats, the ratio best-peer/attncore (> 1 means attncore is faster than
the fastest of torch and the two ONNX Runtime operators), attncore's
GFLOP/s and the float32 matrix-product rate (sgemm 2048^3 through NumPy's
BLAS at the same thread count) measured in the same run.  The header names
the CPU model.  With several threads, each sample is preceded by a
short idle pause (--settle) so that the worker threads one library leaves
spinning (OpenBLAS, OpenMP runtimes) do not slow down the next one.  This is a benchmark, never a test: timings on shared
machines are noisy, so only the ratios measured side by side mean much.

For benchmarking, unset OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE in the command
that runs this script (they pin OpenBLAS to slower kernels).

``--simulate-avx2`` (with any other options) times an AVX2-only core on an
AVX-512 machine: attncore's kernel path forced to ``avx2``,
``OPENBLAS_CORETYPE=Haswell`` (NumPy's sgemm, the ceiling, at the AVX2
rate), ``ATEN_CPU_CAPABILITY=avx2`` for torch with
``MKL_ENABLE_INSTRUCTIONS=AVX2`` / ``ONEDNN_MAX_CPU_ISA=AVX2`` for the MKL
and oneDNN under it (on an Intel CPU they ignore ATEN's setting), and ONNX
Runtime left out
(its MLAS cannot be held to AVX2).  The script re-runs itself with those
variables set; every table's header says that it was simulated.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys

# ATEN_CPU_CAPABILITY holds torch's own kernels to AVX2, not the BLAS and
# oneDNN under them: on an Intel CPU MKL's sgemm would still run on AVX-512
# (measured on a Xeon with AMX: torch's SDPA 17.8 ms with ATEN alone, 22.4 ms
# with MKL and oneDNN held to AVX2 too); on AMD MKL picks AVX2 by itself.
SIMULATE_ENV = {"OPENBLAS_CORETYPE": "Haswell", "ATEN_CPU_CAPABILITY": "avx2",
                "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                "ATTNCORE_BENCH_SIMULATE_AVX2": "1"}
SIMULATE_TEXT = ("attncore path avx2, OPENBLAS_CORETYPE=Haswell, ATEN_CPU_CAPABILITY=avx2, "
                 "MKL_ENABLE_INSTRUCTIONS=AVX2, ONEDNN_MAX_CPU_ISA=AVX2, ONNX Runtime left out")
if "--simulate-avx2" in sys.argv[1:] and os.environ.get("ATTNCORE_BENCH_SIMULATE_AVX2") != "1":
    # the variables must be set before NumPy (OpenBLAS) and torch load
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_L2_SIZE"}
    env.update(SIMULATE_ENV)
    os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *sys.argv[1:]], env)
SIMULATED = os.environ.get("ATTNCORE_BENCH_SIMULATE_AVX2") == "1"

import numpy as np  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import attncore  # noqa: E402
import attncore._kernels  # noqa: E402,F401
from timing import cpu_model, interleaved_medians  # noqa: E402

import peers  # noqa: E402

if SIMULATED:
    attncore._kernels.set_kernel_path("avx2")
    peers.ort = None  # ONNX Runtime cannot be held to AVX2

try:
    import torch
    import torch.nn.functional as F
except ImportError:  # torch is a benchmark extra
    torch = None


# name, group, B, H, N, M, D, variant
CASES = [
    ("prefill 1x8x1024x64", "prefill", 1, 8, 1024, 1024, 64, "none"),
    ("prefill 4x12x512x64", "prefill", 4, 12, 512, 512, 64, "none"),
    ("prefill 1x8x1024x128", "prefill", 1, 8, 1024, 1024, 128, "none"),
    ("prefill 1x8x4096x64", "prefill", 1, 8, 4096, 4096, 64, "none"),
    ("prefill 1x16x2048x128", "prefill", 1, 16, 2048, 2048, 128, "none"),
    ("causal 1x8x1024x64", "causal", 1, 8, 1024, 1024, 64, "causal"),
    ("causal 4x12x512x64", "causal", 4, 12, 512, 512, 64, "causal"),
    ("causal 1x8x2048x64", "causal", 1, 8, 2048, 2048, 64, "causal"),
    ("causal 1x8x4096x64", "causal", 1, 8, 4096, 4096, 64, "causal"),
    ("causal 1x16x2048x128", "causal", 1, 16, 2048, 2048, 128, "causal"),
    ("masked25 4x12x512x64", "masked", 4, 12, 512, 512, 64, "keypad"),
    ("decode 1x32x1x4096x128", "decode", 1, 32, 1, 4096, 128, "none"),
    ("decode 8x8x1x2048x64", "decode", 8, 8, 1, 2048, 64, "none"),
    ("decode 1x8x1x32768x64", "decode", 1, 8, 1, 32768, 64, "none"),
    ("seq2seq 32x1x1x50x256", "seq2seq", 32, 1, 1, 50, 256, "none"),
    ("seq2seq 32x1x50x50x256", "seq2seq", 32, 1, 50, 50, 256, "none"),
    ("heads 4x8x512x64", "heads", 4, 8, 512, 512, 64, "heads"),
]


def make_inputs(B, H, N, M, D, variant, dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    if variant == "heads":
        # the heads of a (B, N, 3 H D) Q/K/V projection viewed as (B, H, N,
        # D), read in place by every side (ONNX Runtime's MultiHeadAttention
        # takes the (B, N, H D) layout itself)
        x = rng.standard_normal((B, N, 3, H, D), dtype=np.float32).astype(dtype)
        q, k, v = (x[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
        return q, k, v, None
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
    for key, build in (("ort mha", peers.ort_mha), ("ort attn", peers.ort_attention)):
        fn = build(q, k, v, mask, causal, threads) if peers.available() else None
        if fn is not None:
            fns[key] = fn
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
    best = [med[key] for key in ("torch", "ort mha", "ort attn") if key in med]
    if best:
        row["best_peer_over_attncore"] = min(best) / med["attncore"]
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
    ort = peers.ort.__version__ if peers.available() else "not installed"
    lines = [f"cpu: {cpu_model()}, {os.cpu_count()} CPUs, python {platform.python_version()}",
             f"attncore {attncore.__version__} (kernel path {attncore._kernels.kernel_path()}), "
             f"numpy {np.__version__}"
             + (f", torch {torch.__version__}" if torch is not None else ", torch not installed")
             + f", onnxruntime {ort}"]
    if SIMULATED:
        lines.append("SIMULATED AVX2 core: " + SIMULATE_TEXT)
    return "\n".join(lines)


def sgemm_rate(threads):
    """sgemm GFLOP/s at ``threads`` (NumPy's BLAS), in this process."""
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=threads, user_api="blas"):
        return peers.sgemm_gflops(2048)


def variants(threads, repeats):
    """Sliding window, soft-capping and int8 keys / values (bars in the
    rows): attncore's variant against torch with the equivalent mask or
    against attncore's own plain call; and the int8 cache's bytes."""
    rows = []
    rng = np.random.default_rng(0)

    def rand(*shape):
        return rng.standard_normal(shape, dtype=np.float32)

    # sliding window (1024, 0) + causal over 8192 keys
    q, k, v = rand(1, 8, 8192, 64), rand(1, 8, 8192, 64), rand(1, 8, 8192, 64)
    fns = {"window": lambda: attncore.scaled_dot_product_attention(
        q, k, v, is_causal=True, window=(1024, 0), num_threads=threads),
        "causal": lambda: attncore.scaled_dot_product_attention(
        q, k, v, is_causal=True, num_threads=threads)}
    if torch is not None:
        i = np.arange(8192)[:, None]
        j = np.arange(8192)[None, :]
        tb = torch.from_numpy((j <= i) & (j >= i - 1024))
        tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))

        def torch_band():
            with torch.inference_mode():
                return F.scaled_dot_product_attention(tq, tk, tv, attn_mask=tb)

        fns["torch band mask"] = torch_band
    med = interleaved_medians(fns, threads, max(3, repeats // 2), torch=torch)
    rows.append(("window 1x8x8192^2x64 (1024,0) causal", med, "window",
                 [("own causal", "causal", 3.0), ("torch band mask", "torch band mask", 3.0)]))
    # softcap
    q, k, v = rand(4, 12, 512, 64), rand(4, 12, 512, 64), rand(4, 12, 512, 64)
    fns = {"softcap": lambda: attncore.scaled_dot_product_attention(
        q, k, v, softcap=50.0, num_threads=threads),
        "plain": lambda: attncore.scaled_dot_product_attention(q, k, v, num_threads=threads)}
    med = interleaved_medians(fns, threads, repeats, torch=torch)
    rows.append(("softcap 4x12x512^2x64", med, "softcap", [("plain / softcap", "plain", 1 / 1.15)]))
    # int8 keys / values
    for B, H, N, M in ((1, 8, 1, 32768), (8, 8, 1, 2048), (4, 12, 512, 512)):
        q, k, v = rand(B, H, N, 64), rand(B, H, M, 64), rand(B, H, M, 64)
        kq, vq = attncore.quantize_kv(k), attncore.quantize_kv(v)
        fns = {"int8": lambda q=q, kq=kq, vq=vq: attncore.scaled_dot_product_attention(
            q, kq, vq, num_threads=threads),
            "float32": lambda q=q, k=k, v=v: attncore.scaled_dot_product_attention(
            q, k, v, num_threads=threads)}
        med = interleaved_medians(fns, threads, repeats, torch=torch)
        bar = 1.8 if N == 1 else 1 / 1.2
        rows.append((f"int8 K/V {B}x{H}x{N}x{M}x64", med, "int8", [("float32", "float32", bar)]))
    fmt = "{:<38} {:>3} {:>10} {:>22} {:>8} {:>6}"
    print(fmt.format("variant", "thr", "ms", "vs (ms)", "ratio", "bar"))
    out = []
    for name, med, key, comps in rows:
        for label, other, bar in comps:
            ratio = med[other] / med[key]
            print(fmt.format(name, threads, f"{1e3 * med[key]:.2f}",
                             f"{label} {1e3 * med[other]:.2f}", f"{ratio:.2f}", f">={bar:.2f}"))
            out.append({"case": name, "threads": threads, "vs": label,
                        "ms": 1e3 * med[key], "other_ms": 1e3 * med[other], "ratio": ratio,
                        "bar": bar})
    mha = attncore.MultiHeadAttention(512, 8)
    c8, c32 = mha.new_cache(1, 4096, dtype="int8"), mha.new_cache(1, 4096)
    print(f"int8 KV cache E512 H8 4096 tokens: {c8.nbytes / 2**20:.2f} MiB vs float32 "
          f"{c32.nbytes / 2**20:.2f} MiB = {c8.nbytes / c32.nbytes:.3f}x (bar <= 0.3)")
    out.append({"case": "int8 cache bytes", "ratio": c8.nbytes / c32.nbytes})
    return out


def concurrency(repeats=5, shape=(1, 8, 768, 768, 64)):
    """Throughput of Python threads calling at num_threads=1 at once, over
    the same calls made one after the other (2 and 4 threads)."""
    import threading
    import time

    B, H, N, M, D = shape
    q, k, v, _ = make_inputs(B, H, N, M, D, "none")

    def call():
        attncore.scaled_dot_product_attention(q, k, v, num_threads=1)

    def serial(n):
        t0 = time.perf_counter()
        for _ in range(n):
            call()
        return time.perf_counter() - t0

    def together(nt, n):
        ths = [threading.Thread(target=lambda: [call() for _ in range(n)]) for _ in range(nt)]
        t0 = time.perf_counter()
        for t in ths:
            t.start()
        for t in ths:
            t.join()
        return time.perf_counter() - t0

    call()
    out = {}
    for nt in (2, 4):
        ratios = []
        for _ in range(repeats):
            ratios.append(serial(nt * 6) / together(nt, 6))
        out[nt] = sorted(ratios)[len(ratios) // 2]
    return out


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
    ap.add_argument("--concurrency", action="store_true",
                    help="also time Python threads calling at num_threads=1 at once")
    ap.add_argument("--variants", action="store_true",
                    help="also time sliding windows, soft-capping and int8 keys / values")
    ap.add_argument("--dtype", nargs="+", default=None, choices=["bfloat16", "float16", "float32"],
                    help="run bench/compare_dtype.py: the 16-bit cases against attncore's "
                         "float32 call and torch on the same dtype")
    ap.add_argument("--path", default=None, choices=["portable", "avx2", "avx512"],
                    help="with --dtype: force this kernel path")
    ap.add_argument("--precision", default=None, choices=["int8"],
                    help="run bench/compare_int8.py: precision='int8' against float32 and "
                         "bfloat16 products (with --dtype float32 / bfloat16 inputs)")
    ap.add_argument("--simulate-avx2", action="store_true",
                    help="time an AVX2-only core on an AVX-512 machine (see the module's doc)")
    ap.add_argument("--suite", choices=["sdpa", "mha", "attention", "varlen"], default="sdpa",
                    help="mha: run bench/compare_mha.py (MultiHeadAttention, cached decoding); "
                         "attention: bench/compare_alignments.py (the Attention layer); "
                         "varlen: bench/compare_varlen.py")
    args = ap.parse_args(argv)
    if SIMULATED:
        print("SIMULATED AVX2 core (every table below): " + SIMULATE_TEXT)
        args.path = "avx2"
    if args.precision == "int8":
        import compare_int8

        return compare_int8.main(
            ["--threads", *map(str, args.threads), "--repeats", str(args.repeats)]
            + (["--dtype", *args.dtype] if args.dtype else []))
    if args.dtype and "float32" in args.dtype:
        ap.error("--dtype float32 goes with --precision int8 (16-bit runs: bfloat16 / float16)")
    if args.dtype:
        import compare_dtype

        return compare_dtype.main(
            ["--dtype", *args.dtype, "--threads", *map(str, args.threads), "--repeats",
             str(args.repeats)] + (["--path", args.path] if args.path else [])
            + (["--no-peak"] if args.no_peak else []))
    if args.suite != "sdpa":
        import importlib

        mod = importlib.import_module({"mha": "compare_mha", "attention": "compare_alignments",
                                       "varlen": "compare_varlen"}[args.suite])
        return mod.main(
            ["--threads", *map(str, args.threads), "--repeats", str(args.repeats)]
            + (["--cases", *args.cases] if args.cases and args.suite != "varlen" else [])
            + (["--json", args.json] if args.json else []))
    cases = [c for c in CASES if not args.cases or any(w in c[0] for w in args.cases)]
    print(header())
    rows = []
    fmt = "{:<24} {:>3} {:>9} {:>9} {:>9} {:>9} {:>9} {:>8} {:>8} {:>7} {:>7}"
    print(fmt.format("case (BxHxNxMxD)", "thr", "attncore", "torch", "ort mha", "ort attn",
                     "numpy", "best/ac", "GFLOP/s", "sgemm", "%sgemm"))

    def cell(ms, key):
        return f"{ms[key]:.3f}" if key in ms else "-"

    for threads in args.threads:
        sg = sgemm_rate(threads)
        rows.append({"case": "sgemm 2048^3", "threads": threads, "gflops": sg})
        for case in cases:
            row = run_case(case, threads, args.repeats, not args.no_numpy, args.settle)
            row["sgemm_gflops"] = sg
            rows.append(row)
            ms = row["ms"]
            print(fmt.format(
                row["case"], threads, cell(ms, "attncore"), cell(ms, "torch"), cell(ms, "ort mha"),
                cell(ms, "ort attn"), cell(ms, "numpy"),
                f"{row['best_peer_over_attncore']:.2f}" if "best_peer_over_attncore" in row
                else "-",
                f"{row['gflops_attncore']:.1f}", f"{sg:.0f}",
                f"{100 * row['gflops_attncore'] / sg:.0f}"), flush=True)
    if args.variants:
        for threads in args.threads:
            rows.extend(variants(threads, args.repeats))
    if args.concurrency:
        conc = concurrency()
        print(f"concurrency 1x8x768^2x64, num_threads=1: 2 Python threads {conc[2]:.2f}x, "
              f"4 Python threads {conc[4]:.2f}x the throughput of serial calls")
        rows.append({"case": "concurrency", "two_threads": conc[2], "four_threads": conc[4]})
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
