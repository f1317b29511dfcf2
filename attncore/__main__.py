"""``python -m attncore``: print the configuration and run a short demo."""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np

import attncore


def _reference(q, k, v, causal):
    s = q.astype(np.float64) @ np.swapaxes(k, -1, -2).astype(np.float64) / np.sqrt(q.shape[-1])
    if causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], bool)), s, -np.inf)
    s = np.exp(s - s.max(-1, keepdims=True))
    return (s / s.sum(-1, keepdims=True)) @ v.astype(np.float64)


def demo() -> None:
    rng = np.random.default_rng(0)
    B, H, N, D = 2, 8, 512, 64
    q, k, v = (rng.standard_normal((B, H, N, D), dtype=np.float32) for _ in range(3))
    print(f"\ndemo: causal self-attention, batch {B}, {H} heads, {N} tokens, head dim {D}, float32")
    attncore.scaled_dot_product_attention(q, k, v, is_causal=True)  # warm-up
    t0 = time.perf_counter()
    out = attncore.scaled_dot_product_attention(q, k, v, is_causal=True)
    dt = time.perf_counter() - t0
    err = np.abs(out - _reference(q, k, v, True)).max()
    print(f"  attncore: {dt * 1e3:.2f} ms, output {out.shape}, max |error| vs float64 NumPy {err:.1e}")
    key_ok = np.ones((B, 1, 1, N), dtype=bool)
    key_ok[1, ..., 400:] = False  # second sequence padded after 400 tokens
    out, w = attncore.scaled_dot_product_attention(q, k, v, attn_mask=key_ok, return_weights=True)
    print(f"  key-padding mask: weights on padded keys {w[1, ..., 400:].sum():.1f}, "
          f"rows sum to {w.sum(-1).min():.4f}..{w.sum(-1).max():.4f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m attncore",
        description="Print attncore's configuration (kernel path, threads, BLAS), then run a "
                    "short demo: causal self-attention checked against float64 NumPy, and "
                    "seq2seq attention whose alignment is drawn as a picture (with matplotlib).")
    ap.add_argument("--config", action="store_true",
                    help="print the configuration only, no demo")
    pic = ap.add_mutually_exclusive_group()
    pic.add_argument("--picture", metavar="PATH",
                     help="where to write the alignment picture (default: "
                          "attncore_alignment.png in the working directory, or in the "
                          "temporary directory when that is not writable)")
    pic.add_argument("--no-picture", action="store_true", help="do not draw the picture")
    args = ap.parse_args(argv)
    attncore.show_config()
    if args.config:
        return 0
    demo()
    from ._demo_alignment import seq2seq_demo

    try:
        seq2seq_demo(picture=False if args.no_picture else (args.picture or True))
    except OSError as exc:
        print(f"python -m attncore: cannot write the picture to {args.picture!r}: {exc}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
