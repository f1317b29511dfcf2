"""Decoding at memory speed: K+V bytes per second of attncore's decode step
next to the stream rate of the same run.

    python bench/compare_decode.py --threads 1 2 --repeats 7
    python bench/compare_decode.py --paths avx2 avx512    # force kernel paths

A decoding step reads every key and value once, so its ceiling is the
memory system.  The stream rate is measured in the same process and the
same thread budget: NumPy's ``sdot`` over two 128 MiB float32 vectors
(``stream``), the read rate a BLAS reduction reaches.  Each row times one
K/V format -- float32, bfloat16, float16, and the int8 ``(array, scales)``
pairs of :func:`attncore.quantize_kv`, its rotated int8 and its 4-bit
containers (``bits=4``, rotated or not) -- with the same query, and prints
the K+V bytes the call reads per second, that rate as a fraction of the
stream rate (the bar: >= 0.8 for float32), the speed-up over the float32
call of the same path (the bars: >= 1.7 for the 16-bit formats, >= 2.5 for
int8, >= 5 for 4-bit) and over the int8 call (``i8/x``; the bar for 4-bit:
>= 1.6).  Medians of interleaved repeats
(``timing.interleaved_medians``).  A benchmark, never a test.

For benchmarking, unset OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE in the command
that runs this script (``sdot`` is the stream reference).

``--torch``: PyTorch's ``F.scaled_dot_product_attention`` on the same
float32, bfloat16 and float16 operands, interleaved with attncore's calls
(the same thread count), a row each: its K+V rate, that rate against the
stream rate, and ``ac/pt`` -- torch's time over attncore's on that format --
next to ``ceil``, the stream rate over torch's K+V rate: what a call that
read at exactly the stream rate would be against torch.  Where ``ceil`` is
below a bar on ``ac/pt``, no kernel reaches that bar on this machine's
memory (data that stays in the L3 from call to call can beat the stream
rate; and where ``sdot`` reads no faster on two threads than on one, as on
a 2-vCPU Emerald Rapids VM: 13.5 / 13.6 GB/s against attncore's 20-41 at
two threads, ``ceil`` means something at one thread only).  ``--case
BxHxMxD`` (repeatable) replaces the two cases.

``--prefetch-ab [BYTES]``: instead, every case and format twice, the decode
loops' rows prefetched into L1 (``set_prefetch_l2_rows(0)``) and rows of at
least BYTES (default 256) bytes into L2 only, the two settings alternating
call by call in one process, each timed call right after an untimed one of
the same setting (medians of single calls); the ratio is L1 time / L2 time
(> 1: the L2 prefetches are faster; rows shorter than BYTES run the same
code both ways, so their ratios show the noise).  The setting in use is
printed.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import numpy as np
from threadpoolctl import threadpool_limits

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import attncore  # noqa: E402
from attncore import _kernels  # noqa: E402
from timing import cpu_model, interleaved_medians  # noqa: E402

CASES = [(1, 8, 32768, 64), (8, 8, 4096, 128)]   # B, H, M, D (one query row)
BARS = {"float32": None, "bfloat16": 1.7, "float16": 1.7, "int8": 2.5, "int8 rot": 2.5,
        "int4": 5.0, "int4 rot": 5.0}


def stream_rate(threads, repeats):
    """Bytes per second of NumPy's sdot over two 128 MiB float32 vectors."""
    n = 32 * 2**20
    a = np.random.default_rng(0).standard_normal(n, dtype=np.float32)
    b = a[::-1].copy()
    med = interleaved_medians({"sdot": lambda: a @ b}, threads, repeats)
    return 2 * a.nbytes / med["sdot"]


def operands(B, H, M, D):
    """The query and the keys / values in every format, and their bytes."""
    import ml_dtypes

    rng = np.random.default_rng(1)
    q = rng.standard_normal((B, H, 1, D), dtype=np.float32)
    k = rng.standard_normal((B, H, M, D), dtype=np.float32)
    v = rng.standard_normal((B, H, M, D), dtype=np.float32)
    fmts = {"float32": (k, v), "bfloat16": (k.astype(ml_dtypes.bfloat16),
                                             v.astype(ml_dtypes.bfloat16)),
            "float16": (k.astype(np.float16), v.astype(np.float16)),
            "int8": (attncore.quantize_kv(k), attncore.quantize_kv(v)),
            "int8 rot": (attncore.quantize_kv(k, rotate=True),
                         attncore.quantize_kv(v, rotate=True)),
            "int4": (attncore.quantize_kv(k, bits=4), attncore.quantize_kv(v, bits=4)),
            "int4 rot": (attncore.quantize_kv(k, bits=4, rotate=True),
                         attncore.quantize_kv(v, bits=4, rotate=True))}

    def nbytes(x):
        return sum(p.nbytes for p in x) if isinstance(x, tuple) else x.nbytes
    return q, {f: (kv, nbytes(kv[0]) + nbytes(kv[1])) for f, kv in fmts.items()}


def torch_fns(q, fmts):
    """PyTorch's SDPA on the float32 / 16-bit operands (tensors sharing the
    arrays' memory; bfloat16 through its int16 bits)."""
    import torch
    import torch.nn.functional as F

    def tensor(a):
        if a.dtype.name == "bfloat16":
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(a)

    fns = {}
    for f in ("float32", "bfloat16", "float16"):
        (k, v), _ = fmts[f]
        tq, tk, tv = tensor(q.astype(k.dtype)), tensor(k), tensor(v)

        def call(tq=tq, tk=tk, tv=tv):
            with torch.inference_mode():
                return F.scaled_dot_product_attention(tq, tk, tv)
        fns["torch " + f] = call
    return fns


def run(path, threads, repeats, stream, cases=CASES, with_torch=False):
    for B, H, M, D in cases:
        q, fmts = operands(B, H, M, D)
        fns = {}
        for f, ((k, v), _) in fmts.items():
            qf = q.astype(k.dtype) if f in ("bfloat16", "float16") else q
            fns[f] = (lambda qf=qf, k=k, v=v: attncore.scaled_dot_product_attention(
                qf, k, v, num_threads=threads))
        if with_torch:
            import torch

            fns.update(torch_fns(q, fmts))
        with _kernels.forced_kernel_path(path):
            med = interleaved_medians(fns, threads, repeats,
                                      torch=torch if with_torch else None)
        for f, (_, nb) in fmts.items():
            rate = nb / med[f]
            sp = med["float32"] / med[f]
            bar = BARS[f]
            i8 = med["int8"] / med[f]
            print(f"{path:<8} {f'decode {B}x{H}x1x{M}x{D}':<24} {threads:>3} {f:<9} "
                  f"{1e3 * med[f]:>8.3f} {rate / 1e9:>7.2f} {rate / stream:>6.2f} "
                  f"{sp:>6.2f} {i8:>6.2f}{'' if bar is None else f' (bar {bar}'}"
                  f"{' / 1.6 over int8)' if f.startswith('int4') else ')' if bar else ''}",
                  flush=True)
        for f in ("float32", "bfloat16", "float16") if with_torch else ():
            nb = fmts[f][1]
            t = med["torch " + f]
            print(f"{'torch':<8} {f'decode {B}x{H}x1x{M}x{D}':<24} {threads:>3} {f:<9} "
                  f"{1e3 * t:>8.3f} {nb / t / 1e9:>7.2f} {nb / t / stream:>6.2f}   "
                  f"ac/pt {t / med[f]:.2f} ceil {stream / (nb / t):.2f}", flush=True)


def run_prefetch_ab(path, threads, repeats, nbytes, cases=CASES):
    """L1 against L2 prefetches of the rows of at least ``nbytes`` bytes."""
    from attncore._core import _sdpa

    def setting(n, fn):
        def call():
            _sdpa.set_prefetch_l2_rows(n)
            return fn()
        return call

    for B, H, M, D in cases:
        q, fmts = operands(B, H, M, D)
        fns = {}
        for f, ((k, v), _) in fmts.items():
            qf = q.astype(k.dtype) if f in ("bfloat16", "float16") else q

            def fn(qf=qf, k=k, v=v):
                return attncore.scaled_dot_product_attention(qf, k, v, num_threads=threads)
            fns[f, "L1"] = setting(0, fn)
            fns[f, "L2"] = setting(nbytes, fn)
        before = _sdpa.set_prefetch_l2_rows(0)
        samples = {key: [] for key in fns}
        keys = list(fns)
        try:
            with _kernels.forced_kernel_path(path), threadpool_limits(limits=threads):
                for r in range(repeats):
                    # every timed call right after an untimed one of the same
                    # operands and setting (the caches as warm for both
                    # settings), the order reversed every other round
                    for key in keys if r % 2 == 0 else keys[::-1]:
                        fns[key]()
                        t0 = time.perf_counter()
                        fns[key]()
                        samples[key].append(time.perf_counter() - t0)
        finally:
            _sdpa.set_prefetch_l2_rows(before)
        med = {key: statistics.median(t) for key, t in samples.items()}
        for f, ((k, _v), _) in fmts.items():
            rb = D * (k[0] if isinstance(k, tuple) else k).dtype.itemsize
            print(f"{path:<8} {f'decode {B}x{H}x1x{M}x{D}':<24} {threads:>3} {f:<9} {rb:>5} "
                  f"{1e3 * med[f, 'L1']:>8.3f} {1e3 * med[f, 'L2']:>8.3f} "
                  f"{med[f, 'L1'] / med[f, 'L2']:>6.2f}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--paths", nargs="+", default=None,
                    choices=["portable", "avx2", "avx512"],
                    help="kernel paths to force (default: every path this CPU runs but portable)")
    ap.add_argument("--prefetch-ab", type=int, nargs="?", const=256, default=None,
                    metavar="BYTES",
                    help="time L1 against L2 prefetches of rows of at least BYTES bytes")
    ap.add_argument("--torch", action="store_true",
                    help="also time PyTorch's SDPA on the same operands (ac/pt, ceil)")
    ap.add_argument("--case", action="append", default=None, metavar="BxHxMxD",
                    help="a decode case (one query row) instead of the default two; repeatable")
    args = ap.parse_args(argv)
    cases = CASES
    if args.case:
        try:
            cases = [tuple(int(x) for x in c.lower().split("x")) for c in args.case]
        except ValueError:
            ap.error(f"--case takes BxHxMxD (four integers), got {args.case}")
        if any(len(c) != 4 or min(c) < 1 for c in cases):
            ap.error(f"--case takes BxHxMxD (four positive integers), got {args.case}")
    paths = args.paths or [p for p in _kernels.available_kernel_paths() if p != "portable"]
    print(f"cpu: {cpu_model()}, {os.cpu_count()} CPUs, python {platform.python_version()}, "
          f"attncore {attncore.__version__}, numpy {np.__version__}")
    if args.prefetch_ab is not None:
        from attncore._core import _sdpa

        print(f"attncore prefetches rows of >= {_sdpa.cpu_features()['prefetch_l2_rows']} "
              f"bytes into L2 (0: none); L1 vs rows of >= {args.prefetch_ab} bytes into L2")
        print(f"{'path':<8} {'case (BxHxNxMxD)':<24} {'thr':>3} {'K/V':<9} {'row B':>5} "
              f"{'ms L1':>8} {'ms L2':>8} {'L1/L2':>6}")
        for threads in args.threads:
            for path in paths:
                run_prefetch_ab(path, threads, args.repeats, args.prefetch_ab, cases)
        return
    print(f"{'path':<8} {'case (BxHxNxMxD)':<24} {'thr':>3} {'K/V':<9} {'ms':>8} {'GB/s':>7} "
          f"{'/strm':>6} {'f32/x':>6} {'i8/x':>6}")
    for threads in args.threads:
        stream = stream_rate(threads, args.repeats)
        print(f"stream (numpy sdot, 2 x 128 MiB) at {threads} thread(s): {stream / 1e9:.2f} GB/s")
        for path in paths:
            run(path, threads, args.repeats, stream, cases, args.torch)


if __name__ == "__main__":
    main()
