"""Side-by-side timing of attncore.Attention's built-in alignments against
PyTorch and NumPy compositions (score + softmax + context).

    python bench/compare_alignments.py                    # B=32 T=50 S=50, 1 and 2 threads
    python bench/compare_alignments.py --threads 1 2 --repeats 15 --json out.json

Same method as bench/compare.py: every case runs attncore, torch and NumPy
interleaved in one process, with the same thread count for all
(torch.set_num_threads, threadpoolctl for NumPy's BLAS, num_threads for
attncore), and reports medians and the ratios torch/attncore and
numpy/attncore (> 1: attncore is faster).  Peak memory of the additive case
is measured per implementation in a fresh subprocess (tracemalloc, which
sees NumPy's and attncore's array allocations).  A benchmark, never a test.

Unset OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE in the command that runs it.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

import numpy as np

import attncore
from timing import interleaved_medians

try:
    import torch
except ImportError:  # torch is a benchmark extra
    torch = None

B, T, S, D, A = 32, 50, 50, 256, 256


def make(seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    f = lambda *shape, s=1.0: (rng.standard_normal(shape) * s).astype(dtype)  # noqa: E731
    return dict(q=f(B, T, D), k=f(B, S, D), vals=f(B, S, D), Wq=f(A, D, s=D ** -0.5),
                Wk=f(A, D, s=D ** -0.5), v=f(A), b=f(A, s=0.1), Wa=f(D, D, s=D ** -0.5))


# ---- NumPy compositions (what one writes without a framework) ----
def np_softmax_ctx(s, vals):
    s -= s.max(-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(-1, keepdims=True)
    return s @ vals


def np_additive(d):
    qp = d["q"] @ d["Wq"].T
    kp = d["k"] @ d["Wk"].T + d["b"]
    s = np.tanh(qp[:, :, None, :] + kp[:, None, :, :]) @ d["v"]
    return np_softmax_ctx(s, d["vals"])


def np_bilinear(d):
    return np_softmax_ctx((d["q"] @ d["Wa"]) @ d["k"].transpose(0, 2, 1), d["vals"])


def np_dot(d):
    return np_softmax_ctx(d["q"] @ d["k"].transpose(0, 2, 1), d["vals"])


# ---- torch compositions ----
def torch_fns(d):
    t = {n: torch.from_numpy(a) for n, a in d.items()}

    def additive():
        with torch.inference_mode():
            qp = t["q"] @ t["Wq"].T
            kp = t["k"] @ t["Wk"].T + t["b"]
            s = torch.tanh(qp[:, :, None, :] + kp[:, None, :, :]) @ t["v"]
            return torch.softmax(s, -1) @ t["vals"]

    def bilinear():
        with torch.inference_mode():
            s = (t["q"] @ t["Wa"]) @ t["k"].transpose(1, 2)
            return torch.softmax(s, -1) @ t["vals"]

    def dot():
        with torch.inference_mode():
            return torch.softmax(t["q"] @ t["k"].transpose(1, 2), -1) @ t["vals"]

    return {"additive": additive, "bilinear": bilinear, "dot": dot}


def attncore_fns(d, threads):
    mlp = attncore.Attention("mlp", q_weight=d["Wq"], k_weight=d["Wk"], v=d["v"], bias=d["b"],
                             num_threads=threads)
    gen = attncore.Attention("bilinear", weight=d["Wa"], num_threads=threads)
    dot = attncore.Attention("dot", num_threads=threads)
    return {"additive": lambda: mlp(d["q"], d["k"], d["vals"]),
            "bilinear": lambda: gen(d["q"], d["k"], d["vals"]),
            "dot": lambda: dot(d["q"], d["k"], d["vals"])}


def run_case(case, threads, repeats, d):
    fns = {"attncore": attncore_fns(d, threads)[case]}
    if torch is not None:
        fns["torch"] = torch_fns(d)[case]
    fns["numpy"] = {"additive": np_additive, "bilinear": np_bilinear, "dot": np_dot}[case]
    fns["numpy"] = (lambda f: (lambda: f(d)))(fns["numpy"])
    med = interleaved_medians(fns, threads, repeats, torch=torch)
    row = {"case": case, "threads": threads, "ms": {k: 1e3 * v for k, v in med.items()}}
    for other in ("torch", "numpy"):
        if other in med:
            row[f"{other}_over_attncore"] = med[other] / med["attncore"]
    return row


_PEAK = r"""
import sys, tracemalloc
sys.path.insert(0, {here!r})
import compare_alignments as ca
d = ca.make()
impl = {impl!r}
if impl == "attncore":
    fn = ca.attncore_fns(d, {threads})["additive"]
else:
    fn = lambda: ca.np_additive(d)
fn()
tracemalloc.start()
fn()
print(tracemalloc.get_traced_memory()[1])
"""


def peak_memory(threads):
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    out = {}
    for impl in ("attncore", "numpy"):
        code = _PEAK.format(here=here, impl=impl, threads=threads)
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True)
        out[impl] = int(r.stdout.strip().splitlines()[-1])
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--cases", nargs="+", default=["additive", "bilinear", "dot"])
    ap.add_argument("--json", help="write the rows to this file")
    ap.add_argument("--no-memory", action="store_true")
    args = ap.parse_args(argv)
    d = make()
    print(f"B={B} T={T} S={S} Dq=Dk=A=Dv={D} float32; torch "
          f"{torch.__version__ if torch is not None else 'absent'}, numpy {np.__version__}")
    print(f"{'case':<10}{'thr':>4}{'attncore ms':>13}{'torch ms':>10}{'numpy ms':>10}"
          f"{'torch/ac':>10}{'numpy/ac':>10}")
    rows = []
    for case in args.cases:
        for th in args.threads:
            r = run_case(case, th, args.repeats, d)
            rows.append(r)
            ms = r["ms"]
            print(f"{case:<10}{th:>4}{ms['attncore']:>13.3f}{ms.get('torch', float('nan')):>10.3f}"
                  f"{ms['numpy']:>10.3f}{r.get('torch_over_attncore', float('nan')):>10.2f}"
                  f"{r['numpy_over_attncore']:>10.2f}")
    if not args.no_memory and "additive" in args.cases:
        for th in args.threads:
            pm = peak_memory(th)
            ratio = pm["attncore"] / pm["numpy"]
            rows.append({"case": "additive peak memory", "threads": th, "bytes": pm,
                         "attncore_over_numpy": ratio})
            print(f"additive peak memory, {th} thread(s): attncore {pm['attncore'] / 2**20:.1f} "
                  f"MiB, numpy {pm['numpy'] / 2**20:.1f} MiB ({100 * ratio:.1f} %)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
