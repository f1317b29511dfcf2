"""attncore's own time, this build against another build of attncore (a
previous commit's), on the cases of ``bench/compare.py``.

    git worktree add --detach /tmp/prev HEAD~1
    (cd /tmp/prev && python setup.py build_ext --inplace)
    python bench/compare_builds.py /tmp/prev --rounds 3 --cases prefill decode causal
    python bench/compare_builds.py /tmp/prev --simulate-avx2   # the avx2 path

Each round runs ``bench/compare.py`` (float32 inputs) once per build,
alternating the builds, in
fresh processes with ``PYTHONPATH`` pointing at each tree, and keeps
attncore's median time of every case; the table gives the median over the
rounds of each build and the ratio this / other (below 1: this build is
faster).  Alternating rounds spread a shared machine's drift over both
builds.  A benchmark, never a test.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def run_once(tree, args, out):
    env = dict(os.environ, PYTHONPATH=tree)
    env.pop("OPENBLAS_CORETYPE", None)
    env.pop("OPENBLAS_L2_SIZE", None)
    cmd = [sys.executable, os.path.join(HERE, "compare.py"), "--threads", *map(str, args.threads),
           "--repeats", str(args.repeats), "--no-numpy", "--no-peak", "--json", out]
    if args.cases:
        cmd += ["--cases", *args.cases]
    if args.simulate_avx2:
        cmd += ["--simulate-avx2"]
    subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        rows = json.load(f)["rows"]
    return {(r["case"], r["threads"]): r["ms"]["attncore"] for r in rows if "ms" in r}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("other", help="source tree of the other build (built in place)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, nargs="+", default=[1])
    ap.add_argument("--cases", nargs="*", default=None)
    ap.add_argument("--simulate-avx2", action="store_true",
                    help="the avx2 path (compare.py --simulate-avx2)")
    args = ap.parse_args(argv)
    times = {"this": {}, "other": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, tree in (("this", ROOT), ("other", os.path.abspath(args.other))):
                res = run_once(tree, args, os.path.join(tmp, f"{name}{r}.json"))
                for key, ms in res.items():
                    times[name].setdefault(key, []).append(ms)
    print(f"{'case':<26} {'thr':>3} {'this ms':>9} {'other ms':>9} {'this/other':>10}")
    for key in times["this"]:
        a = statistics.median(times["this"][key])
        b = statistics.median(times["other"].get(key, [float("nan")]))
        print(f"{key[0]:<26} {key[1]:>3} {a:>9.3f} {b:>9.3f} {a / b:>10.3f}")


if __name__ == "__main__":
    main()
