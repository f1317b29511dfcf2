"""Side-by-side timing of the model pieces around the kernel (issue 18).

    python bench/compare_model_parts.py                   # every case at 1 and 2 threads
    python bench/compare_model_parts.py --threads 1 --repeats 5 --cases rotary
    python bench/compare_model_parts.py --json parts.json

Cases:

* ``rotary``: rotary embeddings of a query and a key, each (1, 32, 4096, 128)
  float32, positions 0..4095, Llama's default frequencies.  attncore:
  ``rotary_embedding(q)`` and ``rotary_embedding(k)`` (cos / sin computed
  inside, new outputs) against transformers' ``apply_rotary_pos_emb(q, k,
  cos, sin)`` in torch -- ``torch apply``: cos / sin precomputed outside
  the timing (the bar compares with this one); ``torch cos/sin+apply``:
  ``LlamaRotaryEmbedding`` forward included, the same work as attncore's.
  ``attncore out=`` rotates in place (the layer's way).
* ``shared memory``: a style-token layer, ``MultiHeadAttention(256, 4)``
  with one query per row (B 64, L 1) attending 10 tokens (S 10, E 256)
  shared by the batch: the 2-D memory (projected once, broadcast) against
  the same layer on ``numpy.broadcast_to(tokens, (64, 10, 256))``.
* ``alibi``: causal 1x8x2048^2x64 float32 with BLOOM's slopes, applied in
  the kernel, against the same causal call without ALiBi (bar: at most
  1.15x its time, shown as none / alibi >= 0.87) and against torch's SDPA
  with the materialized causal + ALiBi float bias (bar 3x).

Both sides run interleaved in one process with the same thread count
(threadpoolctl for OpenMP and BLAS, ``torch.set_num_threads``); medians over
the repeats; the ratio is other / attncore (> 1: attncore is faster).
``max|diff|`` compares the outputs once, as a sanity check.  A benchmark,
never a test.
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
from timing import cpu_model, interleaved_medians, lscpu_model  # noqa: E402

try:
    import torch
except ImportError:  # torch is a benchmark extra
    torch = None

# alibi_self: time with ALiBi <= 1.15x without, i.e. none / alibi >= 1 / 1.15
BARS = {"rotary": 2.0, "shared": 3.0, "alibi_self": 0.87, "alibi_torch": 3.0}


def _rotary_fns():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import (LlamaRotaryEmbedding,
                                                          apply_rotary_pos_emb)

    B, H, L, D = 1, 32, 4096, 128
    rng = np.random.default_rng(0)
    q = rng.standard_normal((B, H, L, D), dtype=np.float32)
    k = rng.standard_normal((B, H, L, D), dtype=np.float32)
    cfg = LlamaConfig(hidden_size=H * D, num_attention_heads=H, head_dim=D,
                      max_position_embeddings=L)
    rot = LlamaRotaryEmbedding(cfg)
    inv = rot.inv_freq.numpy()
    tq, tk = torch.from_numpy(q), torch.from_numpy(k)
    pid = torch.arange(L)[None]
    cos, sin = rot(tq, pid)
    q_in, k_in = q.copy(), k.copy()

    def run_attncore():
        return (attncore.rotary_embedding(q, inv_freq=inv),
                attncore.rotary_embedding(k, inv_freq=inv))

    def run_attncore_inplace():
        # rotating the same buffers again and again: same work, no output allocation
        attncore.rotary_embedding(q_in, inv_freq=inv, out=q_in)
        attncore.rotary_embedding(k_in, inv_freq=inv, out=k_in)

    def run_torch_apply():
        with torch.inference_mode():
            return apply_rotary_pos_emb(tq, tk, cos, sin)

    def run_torch_full():
        with torch.inference_mode():
            c, s = rot(tq, pid)
            return apply_rotary_pos_emb(tq, tk, c, s)

    fns = {"attncore": run_attncore, "attncore out=": run_attncore_inplace,
           "torch apply": run_torch_apply, "torch cos/sin+apply": run_torch_full}
    a, b = run_attncore(), run_torch_full()
    err = max(float(np.abs(a[0] - b[0].numpy()).max()), float(np.abs(a[1] - b[1].numpy()).max()))
    return fns, "torch apply", err


def _shared_fns():
    B, L, S, E, H = 64, 1, 10, 256, 4
    rng = np.random.default_rng(0)
    mha = attncore.MultiHeadAttention(E, H, rng=0)
    x = rng.standard_normal((B, L, E), dtype=np.float32)
    tokens = rng.standard_normal((S, E), dtype=np.float32)
    tokens_b = np.broadcast_to(tokens, (B, S, E))
    fns = {"attncore": lambda: mha(x, tokens),
           "broadcast_to": lambda: mha(x, tokens_b)}
    err = float(np.abs(fns["attncore"]()[0] - fns["broadcast_to"]()[0]).max())
    return fns, "broadcast_to", err


def _alibi_inputs():
    B, H, N, D = 1, 8, 2048, 64
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((B, H, N, D), dtype=np.float32) for _ in range(3))
    slopes = 2.0 ** (-8.0 * np.arange(1, H + 1) / H)
    return q, k, v, slopes


def _alibi_self_fns():
    q, k, v, slopes = _alibi_inputs()
    sd = attncore.scaled_dot_product_attention
    fns = {"attncore": lambda: sd(q, k, v, is_causal=True, alibi_slopes=slopes),
           "no alibi": lambda: sd(q, k, v, is_causal=True)}
    return fns, "no alibi", float("nan")


def _alibi_torch_fns():
    q, k, v, slopes = _alibi_inputs()
    N = q.shape[-2]
    i, j = np.arange(N)[:, None], np.arange(N)[None, :]
    bias = np.where(j <= i, -slopes[:, None, None] * np.abs(i - j), -np.inf).astype(np.float32)
    tq, tk, tv, tb = (torch.from_numpy(x) for x in (q, k, v, bias[None]))
    sd = attncore.scaled_dot_product_attention
    fns = {"attncore": lambda: sd(q, k, v, is_causal=True, alibi_slopes=slopes),
           "torch bias": lambda: torch.nn.functional.scaled_dot_product_attention(
               tq, tk, tv, attn_mask=tb)}
    err = float(np.abs(fns["attncore"]() - fns["torch bias"]().numpy()).max())
    return fns, "torch bias", err


CASES = [
    ("rotary q+k 1x32x4096x128 f32", "rotary", _rotary_fns),
    ("shared memory B64 L1 S10 E256 H4", "shared", _shared_fns),
    ("alibi causal 1x8x2048x64 vs none", "alibi_self", _alibi_self_fns),
    ("alibi causal 1x8x2048x64 vs torch", "alibi_torch", _alibi_torch_fns),
]


def run_case(case, threads, repeats):
    name, kind, setup = case
    fns, other, err = setup()
    med = interleaved_medians(fns, threads, repeats, sample_seconds=0.05, torch=torch)
    return {"case": name, "kind": kind, "threads": threads,
            "ms": {key: 1e3 * t for key, t in med.items()}, "other": other,
            "other_over_attncore": med[other] / med["attncore"], "bar": BARS[kind],
            "max_abs_diff": err}


def header():
    return (f"CPU: {cpu_model()} (lscpu Model name: {lscpu_model()}), {os.cpu_count()} CPUs, "
            f"python {platform.python_version()}\nattncore {attncore.__version__}, numpy "
            f"{np.__version__}, torch {torch.__version__ if torch else '-'}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--cases", nargs="*", default=None,
                    help="only cases whose name contains one of these words")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if torch is None:
        sys.exit("compare_model_parts.py needs torch and transformers (pip install '.[bench]')")
    cases = [c for c in CASES if not args.cases or any(w in c[0] for w in args.cases)]
    print(header())
    rows = []
    for threads in args.threads:
        for case in cases:
            row = run_case(case, threads, args.repeats)
            rows.append(row)
            ms = "  ".join(f"{k} {v:.3f}" for k, v in row["ms"].items())
            print(f"{row['case']:<34} thr {threads}  ms: {ms}  |  {row['other']} / attncore "
                  f"{row['other_over_attncore']:.2f} (bar {row['bar']:.1f})  max|diff| "
                  f"{row['max_abs_diff']:.1e}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
