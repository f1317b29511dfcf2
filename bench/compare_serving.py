"""Serving side by side: paged_attention against its alternatives.

    python bench/compare_serving.py --threads 1 2 --repeats 7
    python bench/compare_serving.py --quick          # smaller shapes (a smoke run)
    python bench/compare_serving.py --hf             # + Hugging Face generate_batch
    python bench/compare_serving.py --plot docs/_static/serving_decode.png   # the docs' plot

Cases (all sides in one process, the same thread count, medians of
interleaved repeats: ``timing.interleaved_medians``):

* **decode step**: 32 sequences of 256..8192 tokens (geometric), Hq 32,
  Hk 8, D 128, blocks of 32 shuffled over the pool, one query each:
  ``paged_attention`` against (a) a loop of attncore calls over contiguous
  per-sequence caches, (b) torch: ``index_select`` of each sequence's
  blocks, then SDPA (``enable_gqa``), (c) one padded batch with a key mask
  (attncore), and the thread scaling (2 threads against 1);
* **quantized pools**: the decode step over the same pool as int8 rows and
  as the int4 cache's format, against the float32 pool;
* **mixed batch**: 4 prompt chunks of 512 new tokens (on 512 cached ones)
  and 28 decoding sequences, against ``varlen_attention`` over contiguous
  copies gathered beforehand (the copy not timed: the paging penalty
  alone);
* **peak memory** of the decode step beyond its output (a fresh process,
  VmHWM reset through /proc/self/clear_refs, Linux);
* with ``--hf``: ``bench/serving_hf.py`` (transformers' ``generate_batch``).

Ratios above 1 mean attncore's paged call is faster.  A benchmark, never a
test.  For benchmarking, unset OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE in the
command that runs this script.
"""
from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import attncore  # noqa: E402
from attncore import _kernels  # noqa: E402
from paged_inputs import pool  # noqa: E402
from timing import cpu_model, interleaved_medians  # noqa: E402

try:
    import torch
except ImportError:  # the torch column is left out
    torch = None


def contiguous(kc, bt, lens):
    """Each sequence's keys gathered: a list of (1, Hk, L, D) arrays."""
    bs = kc.shape[1]
    out = []
    for s, L in enumerate(lens):
        nb = -(-L // bs)
        out.append(np.ascontiguousarray(
            kc[bt[s, :nb]].reshape((nb * bs,) + kc.shape[2:])[:L].transpose(1, 0, 2)[None]))
    return out


def decode_case(quick):
    S = 8 if quick else 32
    lens = np.geomspace(256, 2048 if quick else 8192, S).astype(np.int64)
    return dict(lens=lens, Hq=32, Hk=8, D=128, bs=32)


def decode_fns(case, threads):
    lens, Hq, Hk, D, bs = (case[k] for k in ("lens", "Hq", "Hk", "D", "bs"))
    S = len(lens)
    kc, vc, bt = pool(lens, Hk, D, bs)
    q = np.random.default_rng(1).standard_normal((S, Hq, D), dtype=np.float32)
    sl = lens.astype(np.int32)
    ks, vs = contiguous(kc, bt, lens), contiguous(vc, bt, lens)
    fns = {"paged": lambda: attncore.paged_attention(q, kc, vc, block_table=bt, seq_lens=sl,
                                                     enable_gqa=True, num_threads=threads)}

    def loop():
        return [attncore.scaled_dot_product_attention(q[s][None, :, None], ks[s], vs[s],
                                                      enable_gqa=True, num_threads=threads)
                for s in range(S)]
    fns["loop"] = loop
    # one padded batch with a key mask (the padding's keys are computed)
    M = int(lens.max())
    kp = np.zeros((S, Hk, M, D), np.float32)
    vp = np.zeros((S, Hk, M, D), np.float32)
    for s in range(S):
        kp[s, :, :lens[s]], vp[s, :, :lens[s]] = ks[s][0], vs[s][0]
    mask = (np.arange(M)[None, :] < lens[:, None])[:, None, None, :]
    fns["padded"] = lambda: attncore.scaled_dot_product_attention(
        q[:, :, None], kp, vp, mask, enable_gqa=True, num_threads=threads)
    if torch is not None:
        tk, tv, tq = torch.from_numpy(kc), torch.from_numpy(vc), torch.from_numpy(q)
        tbt = [torch.from_numpy(bt[s, :-(-lens[s] // bs)].astype(np.int64)) for s in range(S)]

        def torch_paged():
            with torch.inference_mode():
                outs = []
                for s in range(S):
                    L = int(lens[s])
                    k = tk.index_select(0, tbt[s]).reshape(-1, Hk, D)[:L].transpose(0, 1)
                    v = tv.index_select(0, tbt[s]).reshape(-1, Hk, D)[:L].transpose(0, 1)
                    outs.append(torch.nn.functional.scaled_dot_product_attention(
                        tq[s][None, :, None], k[None], v[None], enable_gqa=True))
                return outs
        fns["torch"] = torch_paged
    kv_bytes = 2 * int(lens.sum()) * Hk * D * 4
    return fns, kv_bytes


def pool_fns(case, threads):
    """The decode step over the float32 pool and over the same pool
    quantized: int8 rows (``quantize_kv``'s pairs) and the int4 cache's
    default format (groups of 16, rotated: ``PagedKVCache(dtype="int4")``'s
    blocks)."""
    lens, Hq, Hk, D, bs = (case[k] for k in ("lens", "Hq", "Hk", "D", "bs"))
    kc, vc, bt = pool(lens, Hk, D, bs)
    q = np.random.default_rng(1).standard_normal((len(lens), Hq, D), dtype=np.float32)
    pools = {"float32": (kc, vc),
             "int8": (attncore.quantize_kv(kc), attncore.quantize_kv(vc)),
             "int4": (attncore.quantize_kv(kc, bits=4, group_size=16, rotate=True),
                      attncore.quantize_kv(vc, bits=4, group_size=16, rotate=True))}
    sl = lens.astype(np.int32)
    return {name: (lambda k=k, v=v: attncore.paged_attention(
        q, k, v, block_table=bt, seq_lens=sl, enable_gqa=True, num_threads=threads))
        for name, (k, v) in pools.items()}


def sweep(counts, threads, repeats, length=2048):
    """Decode-step tokens per second (sequences / step time) of each
    contender for each number of concurrent sequences of ``length``
    tokens."""
    rows = []
    for S in counts:
        case = dict(lens=np.full(S, length, dtype=np.int64), Hq=32, Hk=8, D=128, bs=32)
        fns, _ = decode_fns(case, threads)
        med = interleaved_medians(fns, threads, repeats, torch=torch)
        rows.append((S, {k: S / t for k, t in med.items()}))
    return rows


def plot(rows, path, threads):
    """tokens/s against concurrent sequences, one line per contender."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    names = {"paged": "attncore paged_attention", "loop": "loop of attncore calls",
             "padded": "padded batch + key mask", "torch": "torch index_select + SDPA"}
    for key, label in names.items():
        if key in rows[0][1]:
            ax.plot([r[0] for r in rows], [r[1][key] for r in rows], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent sequences (2048 tokens each)")
    ax.set_ylabel("decode tokens / s (attention)")
    ax.set_title(f"{cpu_model()}, {threads} thread(s)", fontsize=8)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def mixed_fns(quick, threads):
    Hq, Hk, D, bs = 32, 8, 128, 32
    rng = np.random.default_rng(2)
    ndec = 12 if quick else 28
    dec = np.geomspace(256, 2048 if quick else 4096, ndec).astype(np.int64)
    lens = np.concatenate([[1024] * 4, dec])
    nq = np.concatenate([[512] * 4, [1] * ndec])
    kc, vc, bt = pool(lens, Hk, D, bs, seed=3)
    cq = np.concatenate([[0], np.cumsum(nq)]).astype(np.int32)
    q = rng.standard_normal((int(cq[-1]), Hq, D), dtype=np.float32)
    ks = np.concatenate([k[0].transpose(1, 0, 2) for k in contiguous(kc, bt, lens)])
    vs = np.concatenate([v[0].transpose(1, 0, 2) for v in contiguous(vc, bt, lens)])
    ck = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    sl = lens.astype(np.int32)
    return {
        "paged": lambda: attncore.paged_attention(q, kc, vc, block_table=bt, seq_lens=sl,
                                                  cu_seqlens_q=cq, enable_gqa=True,
                                                  num_threads=threads),
        "varlen": lambda: attncore.varlen_attention(q, ks, vs, cq, ck, is_causal=True,
                                                    enable_gqa=True, num_threads=threads),
    }


_PEAK = r"""
import sys, numpy as np, attncore
sys.path.insert(0, {here!r})
from compare_serving import pool, decode_case
def kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
case = decode_case({quick})
lens = case["lens"]
kc, vc, bt = pool(lens, case["Hk"], case["D"], case["bs"])
q = np.random.default_rng(1).standard_normal((len(lens), case["Hq"], case["D"]), dtype=np.float32)
args = dict(block_table=bt, seq_lens=lens.astype(np.int32), enable_gqa=True, num_threads={T})
attncore.paged_attention(q, kc, vc, **args)                  # warm
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
base = kib("VmRSS:")
out = attncore.paged_attention(q, kc, vc, **args)
print((kib("VmHWM:") - base) * 1024, out.nbytes)
"""


def peak_memory(quick, threads):
    code = _PEAK.format(here=HERE, quick=quick, T=threads)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    growth, out_bytes = (int(x) for x in res.stdout.split())
    return max(0, growth - out_bytes)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--hf", action="store_true", help="also run bench/serving_hf.py")
    ap.add_argument("--plot", metavar="PNG", help="sweep 1..32 concurrent sequences and plot "
                    "decode tokens/s (at the largest --threads)")
    a = ap.parse_args(argv)
    print(f"cpu: {cpu_model()}, {os.cpu_count()} CPUs, python {platform.python_version()}")
    print(f"attncore {attncore.__version__} (kernel path {_kernels.kernel_path()}), "
          f"numpy {np.__version__}, torch {torch.__version__ if torch else 'not installed'}")
    case = decode_case(a.quick)
    print(f"\ndecode step: {len(case['lens'])} sequences of {case['lens'].min()}.."
          f"{case['lens'].max()} tokens, Hq {case['Hq']}, Hk {case['Hk']}, D {case['D']}, "
          f"blocks of {case['bs']} (shuffled)")
    print("| threads | paged ms | K+V GB/s | vs loop of calls | vs torch index_select+SDPA "
          "| vs padded batch + mask |")
    print("|---|---|---|---|---|---|")
    paged_ms = {}
    for t in a.threads:
        fns, kv = decode_fns(case, t)
        med = interleaved_medians(fns, t, a.repeats, torch=torch)
        paged_ms[t] = med["paged"] * 1e3
        tv = f"{med['torch'] / med['paged']:.2f}" if "torch" in med else "-"
        print(f"| {t} | {med['paged'] * 1e3:.2f} | {kv / med['paged'] / 1e9:.1f} | "
              f"{med['loop'] / med['paged']:.2f} | {tv} | {med['padded'] / med['paged']:.2f} |")
    if 1 in paged_ms and len(paged_ms) > 1:
        for t, ms in paged_ms.items():
            if t != 1:
                print(f"thread scaling, decode step: {t} threads {paged_ms[1] / ms:.2f}x 1 thread")
    print("\nthe decode step over quantized pools (the same keys / values; int4: groups of 16, "
          "rotated, PagedKVCache(dtype='int4')'s format)")
    print("| threads | float32 ms | int8 ms | int4 ms | int8 speed-up | int4 speed-up |")
    print("|---|---|---|---|---|---|")
    for t in a.threads:
        med = interleaved_medians(pool_fns(case, t), t, a.repeats)
        print(f"| {t} | {med['float32'] * 1e3:.2f} | {med['int8'] * 1e3:.2f} | "
              f"{med['int4'] * 1e3:.2f} | {med['float32'] / med['int8']:.2f} | "
              f"{med['float32'] / med['int4']:.2f} |")
    print("\nmixed batch: 4 prompt chunks of 512 (on 512 cached tokens) + decoding sequences")
    print("| threads | paged ms | varlen over gathered copies ms | ratio |")
    print("|---|---|---|---|")
    for t in a.threads:
        med = interleaved_medians(mixed_fns(a.quick, t), t, a.repeats)
        print(f"| {t} | {med['paged'] * 1e3:.2f} | {med['varlen'] * 1e3:.2f} | "
              f"{med['varlen'] / med['paged']:.2f} |")
    if sys.platform.startswith("linux"):
        for t in a.threads:
            print(f"peak memory of the decode step beyond its output ({t} threads): "
                  f"{peak_memory(a.quick, t) / 2**20:.2f} MiB")
    if a.plot:
        t = max(a.threads)
        rows = sweep([1, 2, 4, 8, 16, 32], t, a.repeats)
        print(f"\ndecode tokens/s, sequences of 2048 tokens, {t} thread(s)")
        print("| sequences | " + " | ".join(rows[0][1]) + " |")
        print("|---" * (len(rows[0][1]) + 1) + "|")
        for S, r in rows:
            print(f"| {S} | " + " | ".join(f"{x:.0f}" for x in r.values()) + " |")
        plot(rows, a.plot, t)
        print(f"plot: {a.plot}")
    if a.hf:
        import serving_hf

        serving_hf.main(["--threads"] + [str(t) for t in a.threads])


if __name__ == "__main__":
    main()
