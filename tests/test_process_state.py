"""A call never changes process-wide state: what another thread of the
program reads through threadpoolctl while attncore computes (the README's
and threads.rst's claim about ``threadpoolctl.threadpool_info()``)."""
import threading
import time

import numpy as np
import pytest

import attncore
from attncore import _kernels

threadpoolctl = pytest.importorskip("threadpoolctl")


def _snapshot():
    return sorted((i["user_api"], i["internal_api"], i["filepath"], i["num_threads"])
                  for i in threadpoolctl.threadpool_info())


def _blas_heavy_calls():
    """Calls that reach BLAS from attncore's threads: float64 attention
    (tiles through gemm), returned weights, the portable float32 path, the
    additive alignment's products and float64 layer projections."""
    rng = np.random.default_rng(0)
    q64 = rng.standard_normal((2, 4, 300, 64))
    k64 = rng.standard_normal((2, 4, 700, 64))
    q32, k32 = q64.astype(np.float32), k64.astype(np.float32)
    mlp = attncore.Attention("mlp", q_weight=rng.standard_normal((128, 64)),
                             k_weight=rng.standard_normal((128, 64)), v=rng.standard_normal(128),
                             num_threads=2)
    mha = attncore.MultiHeadAttention(256, 4, dtype=np.float64, rng=0)
    x = rng.standard_normal((4, 200, 256))

    def run():
        attncore.scaled_dot_product_attention(q64, k64, k64, num_threads=2)
        attncore.scaled_dot_product_attention(q32, k32, k32, return_weights=True, num_threads=2)
        with _kernels.forced_kernel_path("portable"):
            attncore.scaled_dot_product_attention(q32, k32, k32, is_causal=True, num_threads=2)
        mlp(q64[:, 0], k64[:, 0])
        mha(x)
    return run


def test_threadpool_info_of_another_thread_is_unchanged_while_attncore_runs():
    """attncore computes on this thread (and its OpenMP team) while another
    thread polls ``threadpool_info()``: every poll sees the BLAS and OpenMP
    thread counts the program set, never a count attncore set meanwhile."""
    if not any(i["user_api"] == "blas" for i in threadpoolctl.threadpool_info()):
        pytest.skip("no BLAS library visible to threadpoolctl")
    run = _blas_heavy_calls()
    run()  # warm: libraries loaded, so the snapshots list the same entries
    # a BLAS thread count the program chose, distinct from 1 and from the default
    with threadpoolctl.threadpool_limits(limits=3, user_api="blas"):
        expected = _snapshot()
        assert any(api == "blas" and n == 3 for api, _, _, n in expected)
        stop = threading.Event()
        seen = []

        def poll():
            while not stop.is_set():
                seen.append(_snapshot())
                time.sleep(0.002)

        reader = threading.Thread(target=poll)
        reader.start()
        try:
            calls = 0
            t_end = time.perf_counter() + 2.0
            while time.perf_counter() < t_end or calls < 3:
                run()
                calls += 1
        finally:
            stop.set()
            reader.join()
        assert len(seen) > 50
        changed = [s for s in seen if s != expected]
        assert not changed, f"another thread saw {changed[0]}, expected {expected}"
        assert _snapshot() == expected


_FORK_SCRIPT = r"""
import multiprocessing as mp
import numpy as np
import attncore

rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, 4, 256, 64), dtype=np.float32) for _ in range(3))
want = attncore.scaled_dot_product_attention(q, k, v, num_threads=2)   # a team ran

def child(conn):
    outs = [attncore.scaled_dot_product_attention(q, k, v, num_threads=nt)
            for nt in (2, None, -1)]
    x = rng.standard_normal((2, 64, 32), dtype=np.float32)
    outs.append(attncore.MultiHeadAttention(32, 2, rng=0)(x, num_threads=2)[0])
    conn.send([float(np.abs(o - want).max()) for o in outs[:3]] + [outs[3].shape])

if __name__ == "__main__":
    a, b = mp.Pipe()
    p = mp.get_context("fork").Process(target=child, args=(b,))
    p.start()
    p.join(60)
    if p.is_alive():
        p.kill()
        raise SystemExit("the forked child hung")
    print(a.recv())
"""


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="no fork on this platform")
def test_forked_child_after_a_team_does_not_hang(tmp_path):
    """A child forked after a multi-threaded call (multiprocessing's fork
    start method) runs its calls on one thread: GNU OpenMP's team threads
    do not survive the fork, and its first region of several threads waited
    forever.  The results are the parent's."""
    import subprocess
    import sys

    script = tmp_path / "fork_child.py"
    script.write_text(_FORK_SCRIPT)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                       timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    *diffs, shape = eval(r.stdout.strip().splitlines()[-1])
    assert max(diffs) < 1e-5 and shape == (2, 64, 32)
