"""``precision="int8"`` (int8 Q.K^T) against float32 products, bfloat16
products and torch (``python bench/compare.py --precision int8``).

    python bench/compare_int8.py --threads 1 2 --repeats 7
    python bench/compare_int8.py --dtype bfloat16        # bf16 inputs
    python bench/compare_int8.py --avx2-modes            # the avx2 path's int8 kernels
    python bench/compare_int8.py --avx512-modes          # the avx512 path's P.V modes
    python bench/compare_int8.py --size-rule             # small calls: float32 products

Every row is timed side by side in one process (``timing.interleaved_medians``:
medians of interleaved repeats, the same thread count on every side):

* ``int8``: ``precision="int8"`` (quantizing Q and K included),
* ``f32``: the same call with float32 products (``precision=None`` for
  float32 inputs; for ``--dtype bfloat16``, ``precision="float32"``),
* ``bf16``: ``precision="bfloat16"`` (bfloat16 products where the CPU
  takes them, AMD's AVX512_BF16; float32 products elsewhere),
* ``torch``: ``torch.nn.functional.scaled_dot_product_attention`` on the
  same tensors,

then ``f32/int8`` and ``bf16/int8`` (> 1: int8 is faster) and the issue's
bars.  The int8-cache decode row compares ``precision="int8"`` on an int8
KV cache (``quantize_kv`` keys and values) with the same call without it
(today's int8-cache decode: keys widened to float).  The header names the
CPU model and its int8 / bf16 dot-product flags.

``--avx2-modes`` forces the ``avx2`` kernel path (an AVX2 core simulated on
an AVX-512 one) and times, per prefill case (1x8x1024^2 x 64 / x 128,
causal too), float32 against ``precision="int8"`` under each int8 mode of
that path (``_sdpa.set_int8_mode``: ``avx2`` vpmaddubsw with the sign trick,
``avxvnni`` where the CPU has AVX-VNNI), P.V in float32, and ``avxvnni+pv16``:
AVX-VNNI with P.V as 16-bit integer pairs on vpdpwssd (``_sdpa.set_pv16_mode``):
the measurements behind ``_sdpa.INT8_AVX2_DEFAULTS`` and the int16 P.V default.
``--avx512-modes`` does the same on the avx512 path (a CPU with AVX512_VNNI):
``vnni`` (vpdpbusd scores, P.V in float32) and ``vnni+pv16`` (P.V as 16-bit
integer pairs on zmm vpdpwssd), and ``vnni+bf16`` (P.V as bfloat16 pairs)
where the CPU has AVX512_BF16.  ``--size-rule`` times the default mode's
rule (``attncore._call.int8_pays``: calls on float keys too small to repay
their quantization take float32 products) against float32 and against
the int8 kernel forced, on both sides of its bounds.  A benchmark, never a test.  For
benchmarking, unset OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE in the command that
runs this script.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import attncore  # noqa: E402
import attncore._kernels  # noqa: E402,F401
from compare_dtype import header  # noqa: E402
from timing import interleaved_medians  # noqa: E402

try:
    import torch
except ImportError:  # a benchmark extra
    torch = None

# name, B, H, N, M, D, causal, bar vs float32 products, bar vs bf16 products
CASES = [
    ("prefill 1x8x1024x64", 1, 8, 1024, 1024, 64, False, 1.7, None),
    ("prefill 1x8x1024x128", 1, 8, 1024, 1024, 128, False, 2.0, 1.2),
    ("causal 1x8x2048x128", 1, 8, 2048, 2048, 128, True, 2.0, 1.2),
]
CACHE_CASE = ("int8-cache decode 1x8x1x32768x64", 1, 8, 1, 32768, 64, 1.2)


def _inputs(B, H, N, M, D, dt, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(s, dtype=np.float32).astype(dt)
            for s in ((B, H, N, D), (B, H, M, D), (B, H, M, D))]


def run(dtype_name, threads, repeats):
    if dtype_name == "bfloat16":
        import ml_dtypes
        dt = np.dtype(ml_dtypes.bfloat16)
    else:
        dt = np.dtype(np.float32)
    sd = attncore.scaled_dot_product_attention
    rows = []
    fmt = "{:<34} {:>3} {:>8} {:>8} {:>8} {:>8} {:>8} {:>5} {:>8} {:>5}"
    print(fmt.format(f"{dtype_name} case", "thr", "int8", "f32", "bf16", "torch", "f32/i8", "bar",
                     "bf16/i8", "bar"))
    for name, B, H, N, M, D, causal, bar32, barbf in CASES:
        ops = _inputs(B, H, N, M, D, dt)
        base = dict(is_causal=causal, num_threads=threads)
        fns = {p_: (lambda o=ops, b=base, p=p_: sd(*o, precision=p, **b))
               for p_ in ("int8", "float32", "bfloat16")}
        fns["f32"], fns["bf16"] = fns.pop("float32"), fns.pop("bfloat16")
        q, k, v = ops
        if torch is not None:
            tt = [torch.from_numpy(a.astype(np.float32)) for a in (q, k, v)]
            if dtype_name == "bfloat16":
                tt = [t.to(torch.bfloat16) for t in tt]
            fns["torch"] = lambda t=tt, c=causal: torch.nn.functional.scaled_dot_product_attention(
                *t, is_causal=c)
        ms = {key: 1e3 * s for key, s in interleaved_medians(fns, threads, repeats, torch=torch).items()}
        r32, rbf = ms["f32"] / ms["int8"], ms["bf16"] / ms["int8"]
        print(fmt.format(name, threads, f"{ms['int8']:.2f}", f"{ms['f32']:.2f}", f"{ms['bf16']:.2f}",
                         f"{ms['torch']:.2f}" if "torch" in ms else "-", f"{r32:.2f}",
                         f"{bar32:.1f}", f"{rbf:.2f}", f"{barbf:.1f}" if barbf else "-"), flush=True)
        rows.append({"case": name, "dtype": dtype_name, "threads": threads, "ms": ms,
                     "f32_over_int8": r32, "bf16_over_int8": rbf})
    # an int8 KV cache: int8 keys fed to the integer dot products vs widened
    name, B, H, N, M, D, bar = CACHE_CASE
    q, k, v = _inputs(B, H, N, M, D, np.float32)
    k8, v8 = attncore.quantize_kv(k), attncore.quantize_kv(v)
    fns = {"int8": lambda: sd(q, k8, v8, precision="int8", num_threads=threads),
           "today": lambda: sd(q, k8, v8, num_threads=threads)}
    ms = {key: 1e3 * s for key, s in interleaved_medians(fns, threads, repeats, torch=torch).items()}
    r = ms["today"] / ms["int8"]
    print(f"{name:<34} {threads:>3} int8 Q.K^T {ms['int8']:.2f} ms, without {ms['today']:.2f} ms: "
          f"{r:.2f}x (bar {bar:.1f})", flush=True)
    rows.append({"case": name, "threads": threads, "ms": ms, "today_over_int8": r})
    return rows


AVX2_CASES = [
    ("prefill 1x8x1024x64", 1024, 64, False),
    ("prefill 1x8x1024x128", 1024, 128, False),
    ("causal 1x8x1024x64", 1024, 64, True),
    ("causal 1x8x1024x128", 1024, 128, True),
]


def run_avx2_modes(threads, repeats, clock=None, path="avx2"):
    """float32 against precision="int8" under each int8 mode of the kernel
    path ``path`` (forced)."""
    from attncore._core import _sdpa

    sd = attncore.scaled_dot_product_attention
    feats = _sdpa.cpu_features()
    # label: (int8 mode, int16 P.V mode, bfloat16 mode); P.V in float32 but
    # for "+pv16" / "+bf16"
    if path == "avx2":
        modes = {"avx2": ("avx2", "off", "off")}
        if feats["avx_vnni"]:
            modes.update({"avxvnni": ("avxvnni", "off", "off"),
                          "avxvnni+pv16": ("avxvnni", "native", "off")})
    else:
        modes = {"vnni": ("native", "off", "off"), "vnni+pv16": ("native", "native", "off")}
        if feats["bf16_dot"]:
            modes["vnni+bf16"] = ("native", "off", "native")
    rows = []
    prev_path = attncore._kernels.set_kernel_path(path)
    prev, prev16 = _sdpa.set_int8_mode(None), _sdpa.set_pv16_mode(None)
    prevbf = _sdpa.set_bf16_mode(None)
    try:
        for name, N, D, causal in AVX2_CASES:
            q, k, v = _inputs(1, 8, N, N, D, np.float32)

            def call(mode, q=q, k=k, v=v, c=causal):
                _sdpa.set_int8_mode(modes[mode][0])
                _sdpa.set_pv16_mode(modes[mode][1])
                _sdpa.set_bf16_mode(modes[mode][2])
                return sd(q, k, v, precision="int8", is_causal=c, num_threads=threads)

            fns = {"f32": lambda q=q, k=k, v=v, c=causal: sd(q, k, v, is_causal=c,
                                                                num_threads=threads)}
            fns.update({m: (lambda m=m: call(m)) for m in modes})
            kw = {"clock": clock} if clock else {}
            ms = {key: 1e3 * s for key, s in interleaved_medians(fns, threads, repeats, **kw).items()}
            print(f"{name:<24} {threads:>3} f32 {ms['f32']:7.2f}  " + "  ".join(
                f"{m} {ms[m]:7.2f} ({ms['f32'] / ms[m]:.2f}x)" for m in modes), flush=True)
            rows.append({"case": name, "threads": threads, "ms": ms})
    finally:
        _sdpa.set_int8_mode(prev)
        _sdpa.set_pv16_mode(prev16)
        _sdpa.set_bf16_mode(prevbf)
        attncore._kernels.set_kernel_path(prev_path)
    return rows


# name, N, M, D, causal: the default int8 mode's size rule
# (attncore._call.int8_pays) on both sides of its bounds, 8 heads
RULE_CASES = [
    ("decode 1x8x1x32768x64", 1, 32768, 64, False),
    ("16 rows over 2048 keys", 16, 2048, 64, False),
    ("64 rows over 4096 keys", 64, 4096, 64, False),
    ("128 rows over 4096 keys", 128, 4096, 64, False),
    ("384^2 x 64", 384, 384, 64, False),
    ("512^2 x 64", 512, 512, 64, False),
    ("causal 512^2 x 64", 512, 512, 64, True),
    ("causal 1024^2 x 64", 1024, 1024, 64, True),
]


def run_size_rule(threads, repeats):
    """float32 against precision="int8" under the default mode (``auto``:
    the size rule) and under this CPU's int8 kernel forced (``forced``)."""
    from attncore._core import _sdpa

    sd = attncore.scaled_dot_product_attention
    code = _sdpa.int8_mode()
    forced = _sdpa._INT8_NAMES[code] if code else None
    rows = []
    prev = _sdpa.set_int8_mode(None)
    try:
        for name, N, M, D, causal in RULE_CASES:
            q, k, v = _inputs(1, 8, N, M, D, np.float32)

            def call(mode, q=q, k=k, v=v, c=causal):
                _sdpa.set_int8_mode(mode)
                return sd(q, k, v, precision="int8", is_causal=c, num_threads=threads)

            fns = {"f32": lambda q=q, k=k, v=v, c=causal: sd(q, k, v, is_causal=c,
                                                                num_threads=threads),
                   "auto": lambda: call(None), "forced": lambda: call(forced)}
            ms = {key: 1e3 * s for key, s in interleaved_medians(fns, threads, repeats).items()}
            _sdpa.set_int8_mode(None)
            pays = attncore._call.int8_pays(N, M, D, D, 8, causal)
            print(f"{name:<26} {threads:>3} f32 {ms['f32']:8.3f}  auto {ms['auto']:8.3f} "
                  f"({ms['f32'] / ms['auto']:.2f}x, {'int8' if pays else 'float32'})  forced "
                  f"{ms['forced']:8.3f} ({ms['f32'] / ms['forced']:.2f}x)", flush=True)
            rows.append({"case": name, "threads": threads, "ms": ms, "int8_pays": pays})
    finally:
        _sdpa.set_int8_mode(prev)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", nargs="+", default=["float32"], choices=["float32", "bfloat16"])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--avx2-modes", action="store_true",
                    help="the avx2 path's int8 modes against float32 (avx2 path forced)")
    ap.add_argument("--avx512-modes", action="store_true",
                    help="the avx512 path's int8 P.V modes against float32 (AVX512_VNNI)")
    ap.add_argument("--size-rule", action="store_true",
                    help="the default mode's size rule (small calls: float32 products) "
                         "against float32 and the int8 kernel forced")
    ap.add_argument("--cpu-time", action="store_true",
                    help="with --avx2-modes / --avx512-modes: the process's CPU seconds (time.process_time: "
                         "steadier on a busy machine; all threads' time, spinning included)")
    args = ap.parse_args(argv)
    feats = attncore._core._sdpa.cpu_features()
    print(header() + f"\nint8 dot products (AVX512_VNNI): {'yes' if feats['int8_dot'] else 'no'}"
          f", AVX-VNNI: {'yes' if feats['avx_vnni'] else 'no'}")
    rows = []
    if args.size_rule:
        print("default int8 mode (auto) and this CPU's int8 kernel forced, against float32; "
              "medians of interleaved repeats, ms (f32 / int8)")
        for t in args.threads:
            rows += run_size_rule(t, args.repeats)
        return rows
    if args.avx2_modes or args.avx512_modes:
        import time
        path = "avx2" if args.avx2_modes else "avx512"
        if path == "avx512" and not feats["int8_dot"]:
            ap.error("--avx512-modes needs a CPU with AVX512_VNNI")
        print(f"{path} kernel path forced; medians of interleaved repeats, ms (f32 / int8)"
              + (", CPU time" if args.cpu_time else ", wall time"))
        for t in args.threads:
            rows += run_avx2_modes(t, args.repeats, time.process_time if args.cpu_time else None,
                                   path)
        return rows
    for d in args.dtype:
        for t in args.threads:
            rows += run(d, t, args.repeats)
    return rows


if __name__ == "__main__":
    main()
