"""Side-by-side timing of packed variable-length attention (issue 18, item 4).

    python bench/compare_varlen.py                    # 1 and 2 threads
    python bench/compare_varlen.py --threads 1 --repeats 9 --json varlen.json

The case of the issue: 16 sequences of lengths uniform in 64..2048
(``numpy.random.default_rng(0).integers(64, 2049, 16)``), 8 heads, D 64,
causal self-attention, float32.  Contenders, all attncore:

* ``varlen``: ``varlen_attention`` on the packed (total, 8, 64) arrays.
* ``padded``: ``scaled_dot_product_attention`` on the batch padded to the
  longest sequence, (16, 8, Lmax, 64), ``is_causal=True`` with a boolean key
  mask (16, 1, 1, Lmax); the padded arrays are built outside the timing.
* ``loop``: one ``scaled_dot_product_attention`` call per sequence on
  (8, L, 64) views of the packed arrays (read in place); the per-sequence
  outputs are not gathered back into a packed array (the loop's side is
  not charged for that copy).

Wall time: medians of interleaved repeats (``timing.interleaved_medians``),
the same thread count on each side.  Because the machines of this project
are often shared, the script also reports CPU time (``time.process_time``,
all threads of the process, spin-waiting included) as medians of the same
kind of interleaved repeats; ratios are other / varlen (> 1: varlen is
faster).  A benchmark, never a test.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import attncore  # noqa: E402
from timing import cpu_model, interleaved_medians, lscpu_model  # noqa: E402

BARS = {"padded": 1.5, "loop": 1.1}


def setup(nseq=16, lo=64, hi=2048, H=8, D=64, seed=0):
    rng = np.random.default_rng(seed)
    lens = rng.integers(lo, hi + 1, nseq)
    cu = np.r_[0, np.cumsum(lens)].astype(np.int32)
    total = int(cu[-1])
    q = rng.standard_normal((total, H, D), dtype=np.float32)
    k = rng.standard_normal((total, H, D), dtype=np.float32)
    v = rng.standard_normal((total, H, D), dtype=np.float32)
    L = int(lens.max())
    qp = np.zeros((nseq, H, L, D), np.float32)
    kp, vp = np.zeros_like(qp), np.zeros_like(qp)
    keymask = np.zeros((nseq, 1, 1, L), bool)
    for b in range(nseq):
        s = slice(cu[b], cu[b + 1])
        n = lens[b]
        qp[b, :, :n], kp[b, :, :n], vp[b, :, :n] = (a[s].transpose(1, 0, 2) for a in (q, k, v))
        keymask[b, ..., :n] = True
    views = [tuple(a[cu[b]:cu[b + 1]].transpose(1, 0, 2) for a in (q, k, v))
             for b in range(nseq)]
    sd = attncore.scaled_dot_product_attention

    def varlen():
        return attncore.varlen_attention(q, k, v, cu, cu, is_causal=True)

    def padded():
        return sd(qp, kp, vp, keymask, is_causal=True)

    def loop():
        return [sd(*t, is_causal=True) for t in views]

    # sanity: the three agree on every real row
    o = varlen()
    p = padded()
    r = loop()
    err = 0.0
    for b in range(nseq):
        ob = o[cu[b]:cu[b + 1]].transpose(1, 0, 2)
        err = max(err, float(np.abs(ob - p[b, :, :lens[b]]).max()),
                  float(np.abs(ob - r[b]).max()))
    return {"varlen": varlen, "padded": padded, "loop": loop}, lens, err


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    head = (f"CPU: {cpu_model()} (lscpu Model name: {lscpu_model()}), {os.cpu_count()} CPUs; "
            f"attncore {attncore.__version__}, kernel path "
            f"{attncore._core._sdpa.kernel_path()}, numpy {np.__version__}")
    print(head)
    fns, lens, err = setup()
    print(f"16 sequences, lengths {sorted(lens.tolist())} (total {int(lens.sum())}, max "
          f"{int(lens.max())}), H 8, D 64, causal, float32; max|diff| of the three {err:.1e}")
    rows = []
    for threads in args.threads:
        wall = interleaved_medians(fns, threads, args.repeats, sample_seconds=0.2)
        cpu = interleaved_medians(fns, threads, args.repeats, sample_seconds=0.2,
                                  clock=time.process_time)
        row = {"threads": threads, "wall_ms": {k: 1e3 * t for k, t in wall.items()},
               "cpu_ms": {k: 1e3 * t for k, t in cpu.items()}}
        for other, bar in BARS.items():
            row[f"{other}_over_varlen_wall"] = wall[other] / wall["varlen"]
            row[f"{other}_over_varlen_cpu"] = cpu[other] / cpu["varlen"]
            row[f"{other}_bar"] = bar
        rows.append(row)
        for kind, key in (("wall", "wall_ms"), ("cpu ", "cpu_ms")):
            ms = "  ".join(f"{k} {v:8.2f}" for k, v in row[key].items())
            ratios = "  ".join(f"{o}/varlen {row[f'{o}_over_varlen_{kind.strip()}']:.2f} "
                               f"(bar {b:.1f})" for o, b in BARS.items())
            print(f"thr {threads} {kind} ms: {ms}  |  {ratios}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": head, "lengths": lens.tolist(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
