"""The Python-side cost of a small attention call, warm and with cold caches.

    python bench/call_overhead.py
    python bench/call_overhead.py --sweep-mib 3.2 --repeats 21

A call of one query row over two keys (1 x 1 x 1 x 2 x 8 float32, one
thread) costs almost nothing in its kernel: its time is the argument
handling, the cached description's lookup and the launch.  With torch and
transformers installed, also the Hugging Face backend's lean decoding step
(``attncore.integrations.transformers.attention_forward`` on torch tensors,
8 query heads over 2 key heads of 16 keys x 64, float32 and bfloat16: the
prepared call, attncore._lean.attention_prepared).  Measured twice:

* ``warm``: the call repeated back to back;
* ``cold``: each call right after a BLAS ``sdot`` over two vectors of
  ``--sweep-mib`` MiB in all (what a decoding step over that much K/V does
  to the caches), minus the ``sdot`` alone.

Medians over interleaved repeats (``timing.interleaved_medians``, one thread).  A benchmark, never a test.  For
benchmarking, unset OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE in the command that
runs this script.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np
from scipy.linalg import blas

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import attncore  # noqa: E402
from timing import cpu_model, interleaved_medians  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep-mib", type=float, default=3.2)
    ap.add_argument("--repeats", type=int, default=21)
    args = ap.parse_args(argv)
    sd = attncore.scaled_dot_product_attention
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 1, n, 8), dtype=np.float32) for n in (1, 2, 2))
    n = max(16, int(args.sweep_mib * 2**20 / 8))
    x, y = np.ones(n, np.float32), np.ones(n, np.float32)

    def call():
        sd(q, k, v, num_threads=1)

    def sweep():
        blas.sdot(x, y)

    def sweep_call():
        blas.sdot(x, y)
        sd(q, k, v, num_threads=1)

    fns = {"warm": call, "sweep": sweep, "sweep+call": sweep_call}
    fns.update(_lean_steps(sweep))
    med = {nm: 1e6 * t for nm, t in interleaved_medians(fns, 1, args.repeats).items()}
    print(f"CPU: {cpu_model()}, {os.cpu_count()} CPUs; attncore {attncore.__version__}, "
          f"kernel path {attncore._core._sdpa.kernel_path()}, numpy {np.__version__}")
    print(f"empty call 1x1x1x2x8 float32, one thread: warm {med['warm']:.1f} us, "
          f"after a {args.sweep_mib:g} MiB sweep {med['sweep+call'] - med['sweep']:.1f} us "
          f"(sweep alone {med['sweep']:.1f} us)")
    for dt in ("float32", "bfloat16"):
        if f"lean {dt}" in med:
            print(f"HF lean decoding step 1x8x1x64 over 2 heads x 16 keys, {dt}, one thread: "
                  f"warm {med[f'lean {dt}']:.1f} us, after the sweep "
                  f"{med[f'sweep+lean {dt}'] - med['sweep']:.1f} us")


def _lean_steps(sweep) -> dict:
    """The Hugging Face backend's lean decoding step, warm and after
    ``sweep``, float32 and bfloat16 (none without torch / transformers)."""
    try:
        import torch
        from attncore.integrations import transformers as hf
    except ImportError:
        return {}
    module = type("Layer", (), {"is_causal": True, "training": False})()
    fns = {}
    for dt in (torch.float32, torch.bfloat16):
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, h, n, 64, generator=g).to(dt)
                   for h, n in ((8, 1), (2, 16), (2, 16)))

        def step(q=q, k=k, v=v):
            with torch.inference_mode():
                hf.attention_forward(module, q, k, v, None, scaling=0.125)

        def sweep_step(step=step):
            sweep()
            step()
        name = str(dt).split(".")[-1]
        fns[f"lean {name}"], fns[f"sweep+lean {name}"] = step, sweep_step
    return fns


if __name__ == "__main__":
    main()
