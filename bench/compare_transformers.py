"""A transformers model with attn_implementation="attncore" against "sdpa".

    python bench/compare_transformers.py                    # every case at 1 and 2 threads
    python bench/compare_transformers.py --threads 2 --repeats 5 --cases decode
    python bench/compare_transformers.py --json hf.json
    python bench/compare_transformers.py --dtype bfloat16   # a bf16 model (also: float16)

Model: a random Llama-style ``LlamaForCausalLM`` (hidden 768, 12 heads, 4
key/value heads, 6 layers, MLP 2048, vocabulary 1000), float32, built from a
config (nothing downloaded); the "attncore" and the "sdpa" model share one
set of weights.  Under ``torch.inference_mode()``:

* ``prefill 1x4096``: one 4096-token prompt (causal, no padding);
* ``prefill 4x512 left-pad``: 4 prompts of 512 positions with 0, 64, 128 and
  192 tokens of left padding (boolean masks);
* ``decode 128 after 2048``: 128 single-token steps with a ``DynamicCache``
  holding a 2048-token prompt (the cache is cropped back to the prompt
  before every sample), reported per step.

Columns: end-to-end milliseconds per call for each side, then the time spent
inside the attention functions alone (each registered function wrapped with
a timer; for attncore this includes reading the tensors as NumPy views and
returning a torch tensor, for sdpa its own layout work), and the ratios
sdpa / attncore (> 1: attncore is faster), with the issue's bars.

``--dtype bfloat16`` / ``float16``: both models in that dtype (16-bit
tensors reach attncore in place), plus a third, float32 "attncore" model
whose attention time is shown as "attn: ac f32" -- the bf16 issue's bar
compares the 16-bit attention with attncore's own float32 attention.

Threads: ``torch.set_num_threads(n)`` (the backend hands
``torch.get_num_threads()`` to attncore, so both sides run n threads) and
``threadpoolctl`` for BLAS / OpenMP.  Both sides are interleaved sample by
sample in one process; medians over ``--repeats``.  A benchmark, never a
test.  For benchmarking, unset OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE in the
command that runs this script.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

try:
    import torch
    import transformers
    from transformers import AttentionInterface, DynamicCache, LlamaConfig, LlamaForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
except ImportError:  # torch and transformers are benchmark extras
    torch = None

from threadpoolctl import threadpool_limits

import attncore
import attncore.integrations.transformers as act

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import accumulating, cpu_model  # noqa: E402

CASES = ["prefill 1x4096", "prefill 4x512 left-pad", "decode 128 after 2048"]
# issue 10: attention alone >= 1.3x sdpa; end to end prefill at 4096 >= 1.05x; decode >= 1.0x
BARS = {"prefill 1x4096": (1.05, 1.3), "prefill 4x512 left-pad": (None, 1.3),
        "decode 128 after 2048": (1.0, 1.3)}
IMPLS = ("attncore", "sdpa")
F32 = "attncore_f32"   # the float32 attncore model of a --dtype run

_attn_seconds = {name: 0.0 for name in IMPLS + (F32,)}


def _timed(name, fn):
    """``fn`` adding its wall time to ``_attn_seconds[name]``."""
    return accumulating(_attn_seconds, name, fn)


def _register_timed():
    act.register("attncore")
    AttentionInterface.register("attncore", _timed("attncore", act.attention_forward))
    AttentionInterface.register("sdpa", _timed("sdpa", sdpa_attention_forward))
    act.register(F32)
    AttentionInterface.register(F32, _timed(F32, act.attention_forward))


def _config():
    return LlamaConfig(vocab_size=1000, hidden_size=768, intermediate_size=2048,
                       num_hidden_layers=6, num_attention_heads=12, num_key_value_heads=4,
                       max_position_embeddings=8192, pad_token_id=0, bos_token_id=1,
                       eos_token_id=2)


def _models(dtype="float32"):
    torch.manual_seed(0)
    models = {}
    state = None
    impls = IMPLS + ((F32,) if dtype != "float32" else ())
    for impl in impls:
        m = LlamaForCausalLM._from_config(_config(), attn_implementation=impl).eval()
        if state is None:
            state = m.state_dict()
        else:
            m.load_state_dict(state, assign=True)      # the same weight tensors
        models[impl] = m
    if dtype != "float32":
        for impl in IMPLS:   # the 16-bit models; the float32 one keeps the originals
            models[impl] = models[impl].to(getattr(torch, dtype))
    return models


def _cache_kw(model):
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _setup(case, models, decode_steps):
    """{impl: callable returning the logits} for one case."""
    g = torch.Generator().manual_seed(1)
    fns = {}
    if case == "prefill 1x4096":
        ids = torch.randint(3, 1000, (1, 4096), generator=g)
        for impl, m in models.items():
            fns[impl] = lambda m=m: m(ids, logits_to_keep=1).logits
    elif case == "prefill 4x512 left-pad":
        ids = torch.randint(3, 1000, (4, 512), generator=g)
        mask = torch.ones_like(ids)
        for b, pad in enumerate((0, 64, 128, 192)):
            mask[b, :pad] = 0
            ids[b, :pad] = 0
        for impl, m in models.items():
            fns[impl] = lambda m=m: m(ids, attention_mask=mask, logits_to_keep=1).logits
    else:
        prompt = torch.randint(3, 1000, (1, 2048), generator=g)
        steps = torch.randint(3, 1000, (1, decode_steps), generator=g)
        for impl, m in models.items():
            kw = _cache_kw(m)
            cache = DynamicCache(config=m.config)
            with torch.inference_mode():
                m(prompt, use_cache=True, logits_to_keep=1, **{kw: cache})

            def run(m=m, cache=cache, kw=kw):
                excess = cache.get_seq_length() - 2048
                if excess > 0:
                    cache.crop(-excess)      # back to the prompt
                for t in range(decode_steps):
                    out = m(steps[:, t:t + 1], use_cache=True, **{kw: cache}).logits
                return out
            fns[impl] = run
    return fns


def run_case(case, models, threads, repeats, decode_steps, settle=0.1):
    fns = _setup(case, models, decode_steps)
    per = decode_steps if case.startswith("decode") else 1
    torch.set_num_threads(threads)
    total = {k: [] for k in fns}
    attn = {k: [] for k in fns}
    with threadpool_limits(limits=threads), torch.inference_mode():
        outs = {k: fn() for k, fn in fns.items()}                 # warm-up, and a check
        err = float((outs["attncore"].float() - outs["sdpa"].float()).abs().max())
        for _ in range(repeats):
            for k, fn in fns.items():
                if threads > 1 and settle:
                    time.sleep(settle)       # let the other side's spinning threads sleep
                _attn_seconds[k] = 0.0
                t0 = time.perf_counter()
                fn()
                total[k].append(time.perf_counter() - t0)
                attn[k].append(_attn_seconds[k])
    ms = {k: 1e3 * statistics.median(v) / per for k, v in total.items()}
    attn_ms = {k: 1e3 * statistics.median(v) / per for k, v in attn.items()}
    if F32 in attn_ms:
        attn_ms["f32_over_attncore"] = attn_ms[F32] / attn_ms["attncore"]
    return {"case": case, "threads": threads, "ms": ms, "attention_ms": attn_ms,
            "end_to_end_ratio": ms["sdpa"] / ms["attncore"],
            "attention_ratio": attn_ms["sdpa"] / attn_ms["attncore"],
            "bars": BARS[case], "max_abs_diff_logits": err}


def header():
    return (f"cpu: {cpu_model()}, {os.cpu_count()} CPUs, python {platform.python_version()}\n"
            f"attncore {attncore.__version__}, numpy {np.__version__}, torch {torch.__version__}, "
            f"transformers {transformers.__version__}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--decode-steps", type=int, default=128)
    ap.add_argument("--cases", nargs="*", default=None,
                    help="only cases whose name contains one of these words")
    ap.add_argument("--json", default=None)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = ap.parse_args(argv)
    if torch is None:
        sys.exit("compare_transformers.py needs torch and transformers "
                 "(pip install '.[transformers]')")
    _register_timed()
    models = _models(args.dtype)
    cases = [c for c in CASES if not args.cases or any(w in c for w in args.cases)]
    print(header())
    fmt = "{:<24} {:>3} {:>10} {:>10} {:>7} {:>5} {:>10} {:>10} {:>7} {:>5} {:>9}"
    print(fmt.format("case (ms per call/step)", "thr", "attncore", "sdpa", "ratio", "bar",
                     "attn: ac", "attn: sdpa", "ratio", "bar", "max|diff|"))
    rows = []
    for threads in args.threads:
        for case in cases:
            r = run_case(case, models, threads, args.repeats, args.decode_steps)
            rows.append(r)
            e2e_bar, attn_bar = r["bars"]
            print(fmt.format(case, threads, f"{r['ms']['attncore']:.1f}", f"{r['ms']['sdpa']:.1f}",
                             f"{r['end_to_end_ratio']:.2f}",
                             "-" if e2e_bar is None else f"{e2e_bar:.2f}",
                             f"{r['attention_ms']['attncore']:.1f}",
                             f"{r['attention_ms']['sdpa']:.1f}", f"{r['attention_ratio']:.2f}",
                             f"{attn_bar:.2f}", f"{r['max_abs_diff_logits']:.1e}")
                  + (f"   attn: ac f32 {r['attention_ms'][F32]:.1f} "
                     f"({r['attention_ms']['f32_over_attncore']:.2f}x)"
                     if F32 in r["attention_ms"] else ""), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"header": header(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
