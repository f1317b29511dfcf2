"""The tables of record: every performance table the README includes (and
the guide through it), and the int8 accuracy table of the guide.

    python bench/report.py sdpa            # scaled_dot_product_attention vs torch / ONNX Runtime
    python bench/report.py variants        # sliding window, soft-capping, int8 keys / values
    python bench/report.py mha             # MultiHeadAttention vs torch, cached decoding
    python bench/report.py alignments      # Attention's alignments vs torch / NumPy
    python bench/report.py transformers    # a Llama-style model, "attncore" vs "sdpa"
    python bench/report.py int8-accuracy   # docs/guide/variants.rst's relative errors
    python bench/report.py all             # every table above, in this order
    python bench/report.py sdpa --threads 2 --repeats 9 --cases prefill   # some rows again

Each table runs the cases of its comparison script (``bench/compare.py``,
``compare_mha.py``, ``compare_alignments.py``, ``compare_transformers.py``:
the same cases, the same timing method -- medians of interleaved repeats in
one process, the same thread count on every side) and is printed as
Markdown with exactly the columns of the README's table, after a line with
the CPU model, the thread counts and the command that made it.  The text
beside a table in the README names that command; paste the table over the
old one, with the CPU line.  The int8 accuracy table is printed as the
reStructuredText list-table of ``docs/guide/variants.rst``.

For timing, unset OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE in the command that
runs this script.  A benchmark, never a test.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import platform
import statistics
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import attncore  # noqa: E402
import attncore._kernels  # noqa: E402,F401
from timing import cpu_model  # noqa: E402

SECTIONS = ("sdpa", "variants", "mha", "alignments", "transformers", "int8-accuracy")


# --------------------------------------------------------------------------
# formatting
# --------------------------------------------------------------------------
def num(x: float) -> str:
    """Three significant figures, never in exponent notation (21.4, 333, 0.071)."""
    if x != x:
        return "-"
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    if x >= 1:
        return f"{x:.2f}"
    return f"{x:.3g}" if x >= 0.001 else f"{x:.1e}"


def ratio(x: float) -> str:
    """A ratio to two decimals (three figures from 10 on), bold when attncore
    is 5 % faster or more."""
    if x != x:
        return "-"
    r = f"{x:.1f}" if x >= 10 else f"{x:.2f}"
    return f"**{r}**" if x >= 1.05 else r


def shape_name(label: str, B: int, H: int, N: int, M: int, D: int) -> str:
    dims = f"{B}×{H}×{N}²×{D}" if N == M else f"{B}×{H}×{N}×{M}×{D}"
    return f"{label} {dims}"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def machine_line(threads: list[int], command: str) -> str:
    """The line printed above every table."""
    try:
        import torch
        tv = f", torch {torch.__version__}"
    except ImportError:
        tv = ""
    return (f"cpu: {cpu_model()}, {os.cpu_count()} CPUs; threads: "
            f"{' and '.join(map(str, threads))}; attncore {attncore.__version__} (kernel path "
            f"{attncore._kernels.kernel_path()}), numpy {np.__version__}{tv}, python "
            f"{platform.python_version()}\ncommand: {command}")


# --------------------------------------------------------------------------
# the tables
# --------------------------------------------------------------------------
_SDPA_LABELS = {"prefill": "prefill", "causal": "causal", "masked": "25 % keys masked",
                "decode": "decode", "seq2seq": "seq2seq"}


def sdpa(threads, repeats, cases, settle, concurrency=True, peak=True):
    """README: scaled_dot_product_attention against torch and ONNX Runtime."""
    import compare

    header = ["case (B×H×N×M×D)", "thr", "attncore ms", "torch ms", "ORT MHA ms", "ORT attn ms",
              "best / attncore", "GFLOP/s", "% of sgemm"]
    rows, notes = [], []
    chosen = [c for c in compare.CASES if not cases or any(w in c[0] for w in cases)]
    for t in threads:
        sg = compare.sgemm_rate(t)
        notes.append(f"sgemm 2048³ (NumPy), {t} thread(s): {sg:.0f} GFLOP/s")
        for case in chosen:
            name, group, B, H, N, M, D, variant = case
            r = compare.run_case(case, t, repeats, with_numpy=False, settle=settle)
            ms = r["ms"]
            rate = variant != "keypad" and N > 4   # GFLOP/s would count skipped keys / no gemm
            rows.append([shape_name(_SDPA_LABELS[group], B, H, N, M, D), str(t),
                         num(ms["attncore"]), num(ms.get("torch", float("nan"))),
                         num(ms.get("ort mha", float("nan"))), num(ms.get("ort attn", float("nan"))),
                         ratio(r["best_peer_over_attncore"]) if "best_peer_over_attncore" in r else "-",
                         f"{r['gflops_attncore']:.0f}" if rate else "",
                         f"{100 * r['gflops_attncore'] / sg:.0f}" if rate else ""])
            print(f"  ... {rows[-1][0]} at {t} thread(s) done", file=sys.stderr, flush=True)
    out = [table(header, rows)] + notes
    if concurrency:
        c = compare.concurrency()
        out.append(f"concurrency (1×8×768²×64, num_threads=1 per call): 2 Python threads "
                   f"{c[2]:.2f}×, 4 Python threads {c[4]:.2f}× the throughput of the same calls "
                   f"one after the other")
    if peak:
        growth, out_bytes = compare.peak_memory()
        out.append(f"peak RSS growth of one 1×1×16384²×64 call: {growth / 2**20:.1f} MiB for a "
                   f"{out_bytes / 2**20:.1f} MiB output")
    return "\n".join(out)


def variants(threads, repeats):
    """README: sliding window, soft-capping, int8 keys / values; the int8 cache's bytes."""
    import compare

    header = ["variant", "thr", "attncore ms", "against", "ms", "ratio", "bar"]
    rows = []
    for t in threads:
        with contextlib.redirect_stdout(io.StringIO()):   # compare.variants prints its own table
            res = compare.variants(t, repeats)
        for r in res:
            if "vs" not in r:
                continue
            rows.append([r["case"].replace("x", "×").replace("^2", "²"), str(t), num(r["ms"]),
                         r["vs"], num(r["other_ms"]), ratio(r["ratio"]), f"≥ {r['bar']:.2f}"])
    mha = attncore.MultiHeadAttention(512, 8)
    c8, c32 = mha.new_cache(1, 4096, dtype="int8"), mha.new_cache(1, 4096)
    note = (f"int8 KV cache of a 512-wide, 8-head layer, 4096 tokens: {c8.nbytes / 2**20:.2f} MiB "
            f"against {c32.nbytes / 2**20:.1f} MiB in float32 ({c8.nbytes / c32.nbytes:.2f}×)")
    return table(header, rows) + "\n" + note


def mha(threads, repeats, steps=16):
    """README: MultiHeadAttention vs torch.nn.MultiheadAttention, cached decoding."""
    import compare_mha

    if compare_mha.torch is None:
        sys.exit("the mha table needs torch (pip install '.[bench]')")
    labels = {"mha self E512 H8 B4 L512": "self-attention B4 L512",
              "mha cross E512 H8 B4 L512 S512": "cross-attention B4 L=S=512",
              "decode E512 H8 B1 2048 cached": "decode step, B1, 2048 cached",
              "decode E512 H8 B8 2048 cached": "decode step, B8, 2048 cached"}
    header = ["case"]
    for t in threads:
        header += [f"{t} thr: attncore", "torch", "ratio"]
    rows = []
    for case in compare_mha.CASES:
        if case[1].startswith("self-"):  # 16-bit layers: timed against attncore's float32 one
            continue
        row = [labels.get(case[0], case[0])]
        for t in threads:
            r = compare_mha.run_case(case, t, repeats, steps)
            row += [num(r["ms"]["attncore"]), num(r["ms"]["torch"]),
                    ratio(r["torch_over_attncore"])]
        rows.append(row)
    return table(header, rows)


def alignments(threads, repeats):
    """README: Attention's built-in alignments vs torch and NumPy compositions."""
    import compare_alignments as ca

    d = ca.make()
    header = ["alignment"]
    for t in threads:
        header += [f"{t} thr: attncore ms", "torch / attncore", "NumPy / attncore"]
    rows = []
    for case, label in (("additive", "mlp (additive)"), ("bilinear", "bilinear"), ("dot", "dot")):
        row = [label]
        for t in threads:
            r = ca.run_case(case, t, repeats, d)
            row += [num(r["ms"]["attncore"]), ratio(r.get("torch_over_attncore", float("nan"))),
                    ratio(r["numpy_over_attncore"])]
        rows.append(row)
    notes = []
    for t in threads:
        pm = ca.peak_memory(t)
        notes.append(f"additive peak memory, {t} thread(s): attncore {pm['attncore'] / 2**20:.1f} "
                     f"MiB, NumPy {pm['numpy'] / 2**20:.0f} MiB "
                     f"({100 * pm['attncore'] / pm['numpy']:.1f} %)")
    return table(header, rows) + "\n" + "\n".join(notes)


def transformers(threads, repeats, decode_steps=128):
    """README: a random Llama-style model with attn_implementation="attncore" vs "sdpa"."""
    import compare_transformers as ct

    if ct.torch is None:
        sys.exit("the transformers table needs torch and transformers "
                 "(pip install '.[transformers]')")
    ct._register_timed()
    models = ct._models()
    labels = {"prefill 1x4096": "prefill 1×4096",
              "prefill 4x512 left-pad": "prefill 4×512, left padding",
              "decode 128 after 2048": f"decode {decode_steps} after 2048 (per step)"}
    header = ["case", "thr", "attncore ms", "sdpa ms", "ratio", "attention alone: attncore",
              "sdpa", "ratio"]
    rows = []
    for t in threads:
        for case in ct.CASES:
            r = ct.run_case(case, models, t, repeats, decode_steps)
            rows.append([labels[case], str(t), num(r["ms"]["attncore"]), num(r["ms"]["sdpa"]),
                         ratio(r["end_to_end_ratio"]), num(r["attention_ms"]["attncore"]),
                         num(r["attention_ms"]["sdpa"]), ratio(r["attention_ratio"])])
    return f"transformers {ct.transformers.__version__}\n" + table(header, rows)


def int8_errors(seed: int) -> dict[str, float]:
    """Relative errors ||out_int8 - out|| / ||out|| against the float32 call on
    the data variants.rst describes: keys N(0, 1) plus the sinusoidal
    encoding, values likewise, 8 heads x 2048 keys x 64, 64 queries
    (tests/test_quant.py checks the table against the same recipe)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((1, 8, 2048, 64)).astype(np.float32)
    pos = attncore.sinusoidal_encoding(2048, 64)
    k, v = x + pos, rng.standard_normal(x.shape).astype(np.float32) + pos
    q = rng.standard_normal((1, 8, 64, 64)).astype(np.float32)
    sdpa_ = attncore.scaled_dot_product_attention
    full = sdpa_(q, k, v)

    def rel(out):
        return float(np.linalg.norm(out - full) / np.linalg.norm(full))
    return {"keys only": rel(sdpa_(q, attncore.quantize_kv(k), v)),
            "values only": rel(sdpa_(q, k, attncore.quantize_kv(v))),
            "keys and values": rel(sdpa_(q, attncore.quantize_kv(k), attncore.quantize_kv(v)))}


def int8_accuracy(seeds=range(5)):
    """docs/guide/variants.rst: the int8 accuracy table (median over seeds)."""
    runs = [int8_errors(s) for s in seeds]
    lines = [".. list-table::", "   :header-rows: 1", "", "   * - int8", "     - relative error"]
    for case in runs[0]:
        med = statistics.median(r[case] for r in runs)
        lines += [f"   * - {case}", f"     - {med:.1e}".replace("e-0", "e-")]
    return "\n".join(lines)


# --------------------------------------------------------------------------
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("section", choices=SECTIONS + ("all",))
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=None,
                    help="default: 7 (sdpa, variants, mha), 9 (alignments), 3 (transformers)")
    ap.add_argument("--cases", nargs="*", default=None,
                    help="sdpa: only cases whose name contains one of these words")
    ap.add_argument("--settle", type=float, default=0.12)
    ap.add_argument("--no-concurrency", action="store_true")
    ap.add_argument("--no-peak", action="store_true")
    args = ap.parse_args(argv)
    command = "python bench/report.py " + " ".join(argv if argv is not None else sys.argv[1:])
    sections = SECTIONS if args.section == "all" else (args.section,)
    for sec in sections:
        reps = args.repeats
        if sec == "sdpa":
            body = sdpa(args.threads, reps or 7, args.cases, args.settle,
                        not args.no_concurrency, not args.no_peak)
        elif sec == "variants":
            body = variants(args.threads, reps or 7)
        elif sec == "mha":
            body = mha(args.threads, reps or 7)
        elif sec == "alignments":
            body = alignments(args.threads, reps or 9)
        elif sec == "transformers":
            body = transformers(args.threads, reps or 3)
        else:
            body = int8_accuracy()
        threads = args.threads if sec != "int8-accuracy" else [attncore._threads.resolve_num_threads(None)]
        print(f"## {sec}\n{machine_line(threads, command)}\n\n{body}\n", flush=True)


if __name__ == "__main__":
    main()
