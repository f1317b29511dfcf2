"""Side-by-side timing of attncore.MultiHeadAttention against PyTorch.

    python bench/compare_mha.py                       # every case at 1 and 2 threads
    python bench/compare_mha.py --threads 1 --repeats 5 --cases decode
    python bench/compare_mha.py --json mha.json

Cases:

* ``mha self`` / ``mha cross``: E=512, 8 heads, batch 4, L = S = 512, float32,
  attncore's layer against ``torch.nn.MultiheadAttention`` (batch_first,
  ``need_weights=False``, same weights) under ``torch.inference_mode()``.
* ``decode``: one new token per call with a key/value cache of 2048 tokens
  (E=512, 8 heads, batch 1 and 8): attncore's ``mha(x_t, cache=cache)``
  against torch doing the same by hand -- one ``F.linear`` for Q, K, V,
  the new K/V written into a preallocated (B, H, 2048 + steps, 64) cache,
  ``F.scaled_dot_product_attention`` over the prefix and ``F.linear`` for
  the output.  Each timed call decodes ``--steps`` tokens; both caches are
  rewound to 2048 tokens before every sample.
* ``mha self bf16`` / ``mha self f16``: the ``mha self`` layer loaded with
  ``dtype="bfloat16"`` / ``"float16"`` (weights and activations in that
  dtype) against attncore's own float32 layer: in these rows the ``torch``
  column holds the float32 layer's time and ``torch/ac`` is float32 layer /
  16-bit layer (the bar: never slower than the float32 layer on a CPU
  without fast bfloat16 products).

Same timing method as ``bench/compare.py``: both sides interleaved in one
process, the same thread count for both (``threadpoolctl`` for OpenMP and
BLAS, ``torch.set_num_threads``), medians over the repeats, ratio
torch / attncore (> 1: attncore is faster); ``max|diff|`` compares the two
outputs once, as a sanity check.  A benchmark, never a test.

For benchmarking, unset OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE in the command
that runs this script.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
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

# name, kind, E, H, B, L, S
CASES = [
    ("mha self E512 H8 B4 L512", "self", 512, 8, 4, 512, 512),
    ("mha cross E512 H8 B4 L512 S512", "cross", 512, 8, 4, 512, 512),
    ("decode E512 H8 B1 2048 cached", "decode", 512, 8, 1, 1, 2048),
    ("decode E512 H8 B8 2048 cached", "decode", 512, 8, 8, 1, 2048),
    ("mha self bf16 E512 H8 B4 L512", "self-bfloat16", 512, 8, 4, 512, 512),
    ("mha self f16 E512 H8 B4 L512", "self-float16", 512, 8, 4, 512, 512),
]
BARS = {"self": 1.3, "cross": 1.1, "decode": 1.2, "self-bfloat16": 1.0, "self-float16": 1.0}


def _setup_layer(kind, E, H, B, L, S, steps):
    rng = np.random.default_rng(0)
    tm = torch.nn.MultiheadAttention(E, H, batch_first=True).eval()
    with torch.no_grad():  # non-zero biases, so the bias adds are timed too
        tm.in_proj_bias.normal_()
        tm.out_proj.bias.normal_()
    mha = attncore.MultiHeadAttention.from_torch(tm)
    fns = {}
    if kind.startswith("self-"):  # a 16-bit layer against the float32 one
        import ml_dtypes

        dt = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}[kind[5:]]
        mh = attncore.MultiHeadAttention.from_torch(tm, dtype=dt)
        x = rng.standard_normal((B, L, E), dtype=np.float32)
        xh = x.astype(dt)
        fns["attncore"] = lambda: mh(xh)
        fns["torch"] = lambda: mha(x)  # the float32 layer, in the torch column
        err = float(np.abs(fns["attncore"]()[0].astype(np.float32) - fns["torch"]()[0]).max())
        return fns, err
    if kind in ("self", "cross"):
        x = rng.standard_normal((B, L, E), dtype=np.float32)
        mem = rng.standard_normal((B, S, E), dtype=np.float32)
        tx, tmem = torch.from_numpy(x), torch.from_numpy(mem)
        if kind == "self":
            fns["attncore"] = lambda: mha(x)

            def run_torch():
                with torch.inference_mode():
                    return tm(tx, tx, tx, need_weights=False)
        else:
            fns["attncore"] = lambda: mha(x, mem)

            def run_torch():
                with torch.inference_mode():
                    return tm(tx, tmem, tmem, need_weights=False)
        fns["torch"] = run_torch
        err = float(np.abs(fns["attncore"]()[0] - run_torch()[0].numpy()).max())
        return fns, err

    # ---- decoding with a cache of S tokens ----
    hd = E // H
    prompt = rng.standard_normal((B, S, E), dtype=np.float32)
    toks = rng.standard_normal((B, steps, E), dtype=np.float32)
    cache = mha.new_cache(B, S + steps)
    mha(prompt, cache=cache, is_causal=True)          # prefill
    w_in = tm.in_proj_weight.detach()
    b_in = tm.in_proj_bias.detach()
    w_o = tm.out_proj.weight.detach()
    b_o = tm.out_proj.bias.detach()
    kc = torch.zeros(B, H, S + steps, hd)
    vc = torch.zeros(B, H, S + steps, hd)
    kc[:, :, :S] = torch.from_numpy(np.ascontiguousarray(cache.keys))
    vc[:, :, :S] = torch.from_numpy(np.ascontiguousarray(cache.values))
    ttoks = torch.from_numpy(toks)

    def run_attncore():
        cache._len = S  # rewind (keeps the prefill)
        for t in range(steps):
            y, _ = mha(toks[:, t:t + 1], cache=cache, is_causal="lower_right")
        return y

    def run_torch():
        with torch.inference_mode():
            for t in range(steps):
                qkv = F.linear(ttoks[:, t:t + 1], w_in, b_in)          # (B, 1, 3E)
                q, k, v = qkv.view(B, 1, 3, H, hd).permute(2, 0, 3, 1, 4)
                n = S + t
                kc[:, :, n:n + 1] = k
                vc[:, :, n:n + 1] = v
                o = F.scaled_dot_product_attention(q, kc[:, :, :n + 1], vc[:, :, :n + 1])
                y = F.linear(o.transpose(1, 2).reshape(B, 1, E), w_o, b_o)
        return y

    fns["attncore"] = run_attncore
    fns["torch"] = run_torch
    # same numbers on both sides
    a, b = run_attncore(), run_torch().numpy()
    err = float(np.abs(a - b).max())
    return fns, err


def run_case(case, threads, repeats, steps):
    name, kind, E, H, B, L, S = case
    fns, err = _setup_layer(kind, E, H, B, L, S, steps)
    med = interleaved_medians(fns, threads, repeats, sample_seconds=0.05, torch=torch)
    per = steps if kind == "decode" else 1
    med = {key: t / per for key, t in med.items()}
    return {"case": name, "kind": kind, "threads": threads,
            "ms": {key: 1e3 * t for key, t in med.items()},
            "torch_over_attncore": med["torch"] / med["attncore"], "bar": BARS[kind],
            "max_abs_diff": err}


def header():
    return (f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
            f"python {platform.python_version()}\nattncore {attncore.__version__}, numpy "
            f"{np.__version__}, torch {torch.__version__}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--steps", type=int, default=16, help="decoded tokens per timed call")
    ap.add_argument("--cases", nargs="*", default=None,
                    help="only cases whose name contains one of these words")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if torch is None:
        sys.exit("compare_mha.py needs torch (pip install '.[bench]')")
    cases = [c for c in CASES if not args.cases or any(w in c[0] for w in args.cases)]
    print(header())
    fmt = "{:<32} {:>3} {:>12} {:>12} {:>9} {:>5} {:>9}"
    print(fmt.format("case", "thr", "attncore ms", "torch ms", "torch/ac", "bar", "max|diff|"))
    rows = []
    for threads in args.threads:
        for case in cases:
            row = run_case(case, threads, args.repeats, args.steps)
            rows.append(row)
            ms = row["ms"]
            print(fmt.format(row["case"], threads, f"{ms['attncore']:.3f}", f"{ms['torch']:.3f}",
                             f"{row['torch_over_attncore']:.2f}", f"{row['bar']:.1f}",
                             f"{row['max_abs_diff']:.1e}"),
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
