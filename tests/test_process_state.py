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
