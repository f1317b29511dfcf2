"""attncore.dask on a two-worker LocalCluster: out-of-core keys and batch throughput.

A script, not a timed test and not an asv benchmark:

    python bench/compare_dask.py [--quick]

1. Out-of-core keys: keys and values of 1 x 8 x 65536 x 64 (float32, 128 MiB
   each) generated on the workers in 8 chunks along M, a block of 4096 new
   queries attending them with the lower-right causal mask; each worker's
   ``memory_limit`` is below the K/V size.  Checked against the float64
   reference on a slice of queries of every head.
2. Throughput: 64 x 8 x 512 x 512 x 64 (float32), batch-chunked on 2
   workers x 1 thread, against the in-memory call with num_threads=2.  The
   inputs are persisted on the workers first; the cluster time is
   ``persist`` of the result (it stays on the workers, as it would on its
   way to ``to_zarr``), and, separately, ``compute`` (result gathered to
   the client).

Prints the CPU model, the task counts, the times (median of repeats) and the
peak resident memory of each worker process.
"""
from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import dask  # noqa: E402
import dask.array as da  # noqa: E402
from dask.graph_manipulation import clone  # noqa: E402
import distributed  # noqa: E402

import attncore  # noqa: E402
import attncore.dask as ad  # noqa: E402
from reference import attention as ref  # noqa: E402

MiB = 1 << 20


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if line.startswith("Model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def peak_rss_mib() -> float:
    """Peak resident memory of this process (runs on a worker)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / MiB


def n_tasks(arr) -> int:
    return len(dict(arr.__dask_graph__()))


def median_time(fn, repeat: int) -> float:
    ts = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def cluster(memory_limit):
    return distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                    memory_limit=memory_limit, dashboard_address=None,
                                    silence_logs=40)


def out_of_core(quick: bool) -> None:
    B, H, M, D = 1, 8, 65536, 64
    N = 512 if quick else 4096
    kv_bytes = 2 * B * H * M * D * 4
    limit = 240 * MiB
    print(f"\n[1] out-of-core keys: q {B}x{H}x{N}x{D}, k/v {B}x{H}x{M}x{D} float32 "
          f"({kv_bytes // MiB} MiB together, {kv_bytes // 2 // MiB} MiB each), 8 key chunks, "
          f"lower-right causal; 2 workers x 1 thread, memory_limit {limit // MiB} MiB each")
    rng = da.random.default_rng(0)
    q = rng.standard_normal((B, H, N, D), chunks=(1, H, N, D), dtype=np.float32)
    k = rng.standard_normal((B, H, M, D), chunks=(1, H, M // 8, D), dtype=np.float32)
    v = rng.standard_normal((B, H, M, D), chunks=(1, H, M // 8, D), dtype=np.float32)
    out = ad.scaled_dot_product_attention(q, k, v, is_causal="lower_right", num_threads=1)
    print(f"    tasks: {n_tasks(out)} in all ({len([1 for key in dict(out.__dask_graph__()) if isinstance(key, tuple) and key[0].endswith('-partial')])} attention partials)")
    with cluster(limit) as cl, distributed.Client(cl) as client:
        base = client.run(peak_rss_mib)
        t = time.perf_counter()
        res = out.compute()
        dt = time.perf_counter() - t
        peaks = client.run(peak_rss_mib)
    flops = 4.0 * B * H * N * M * D
    print(f"    compute: {dt:.2f} s ({flops / dt / 1e9:.0f} GFLOP/s incl. generating K/V on the workers)")
    for w, p in sorted(peaks.items()):
        b = f"at start {base[w]:.0f} MiB" if w in base else "a restarted worker"
        print(f"    worker {w}: peak RSS {p:.0f} MiB ({b})")
    # the float64 reference on a slice of queries (first and last rows of every head)
    rows = np.r_[0:16, N - 16:N]
    with dask.config.set(scheduler="synchronous"):
        qs, kk, vv = da.compute(q[:, :, rows], k, v)
    err = 0.0
    for h in range(H):
        qf = qs[:, h:h + 1]
        # lower-right: global row i sees keys j <= i + M - N
        mask = np.arange(M)[None, :] <= (rows + M - N)[:, None]
        r = ref(qf, kk[:, h:h + 1], vv[:, h:h + 1], mask)[0]
        err = max(err, float(np.abs(res[:, h:h + 1][:, :, rows] - r).max()))
    print(f"    max |out - float64 reference| over {len(rows)} query rows x {H} heads: {err:.1e}")


def in_memory(shape, repeat: int) -> float:
    g = np.random.default_rng(0)
    qn, kn, vn = (g.standard_normal(shape, dtype=np.float32) for _ in range(3))
    attncore.scaled_dot_product_attention(qn, kn, vn, num_threads=2)
    return median_time(lambda: attncore.scaled_dot_product_attention(qn, kn, vn, num_threads=2),
                       repeat)


def throughput(quick: bool, bc: int = 16) -> None:
    B, H, N, D = (16 if quick else 64), 8, 512, 64
    repeat = 3 if quick else 5
    print(f"\n[2] throughput: {B}x{H}x{N}x{N}x{D} float32, batch chunks of {bc}, 2 workers x 1 thread "
          f"vs in-memory num_threads=2 (median of {repeat})")
    t_mem = in_memory((B, H, N, D), repeat)
    flops = 4.0 * B * H * N * N * D
    print(f"    in memory, num_threads=2: {t_mem * 1e3:.0f} ms ({flops / t_mem / 1e9:.0f} GFLOP/s)")
    with cluster("2GiB") as cl, distributed.Client(cl) as client:
        # inputs generated on the workers (not shipped in the graph), then held there
        rng = da.random.default_rng(1)
        q, k, v = (rng.standard_normal((B, H, N, D), chunks=(bc, H, N, D), dtype=np.float32)
                   for _ in range(3))
        q, k, v = client.persist([q, k, v])
        distributed.wait([q, k, v])
        out = ad.scaled_dot_product_attention(q, k, v, num_threads=1)
        print(f"    tasks: {n_tasks(out)} in the attention graph (inputs persisted)")
        keys = [key for key in dict(out.__dask_graph__()) if not (
            isinstance(key, tuple) and key[0] in (q.name, k.name, v.name))]

        def released():
            # the same graph again must not find the last run's results
            while client.run_on_scheduler(
                    lambda dask_scheduler: sum(key in dask_scheduler.tasks for key in keys)):
                time.sleep(0.01)

        def run_persist():
            # a clone of the graph (new keys, the persisted inputs shared):
            # never races with the release of the previous repeat's results
            r = client.persist(clone(out, omit=[q, k, v]))
            distributed.wait(r)
            return r

        ts = []
        for _ in range(repeat + 1):
            t = time.perf_counter()
            r = run_persist()
            ts.append(time.perf_counter() - t)
            del r
        t_p = statistics.median(ts[1:])
        tc = []
        for _ in range(repeat):
            released()
            t = time.perf_counter()
            out.compute()
            tc.append(time.perf_counter() - t)
        t_c = statistics.median(tc)
        peaks = client.run(peak_rss_mib)
        q2, k2, v2 = da.compute(q[:2], k[:2], v[:2])
        np.testing.assert_allclose(out[:2].compute(), ref(q2, k2, v2)[0], rtol=1e-4, atol=1e-5)
    print(f"    cluster, persist (result stays on the workers): {t_p * 1e3:.0f} ms, "
          f"{t_mem / t_p:.2f}x in-memory")
    print(f"    cluster, compute (result gathered to the client): {t_c * 1e3:.0f} ms, "
          f"{t_mem / t_c:.2f}x in-memory")
    for w, p in sorted(peaks.items()):
        print(f"    worker {w}: peak RSS {p:.0f} MiB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    ap.add_argument("--only", choices=["out-of-core", "throughput"])
    ap.add_argument("--batch-chunk", type=int, default=16,
                    help="batch chunk of the throughput case (default 16: 4 tasks)")
    args = ap.parse_args()
    print(f"CPU: {cpu_model()}, {os.cpu_count()} logical CPUs; attncore {attncore.__version__}, "
          f"dask {dask.__version__}, distributed {distributed.__version__}, numpy {np.__version__}")
    print(f"client process RSS at start: {rss_mib():.0f} MiB")
    if args.only in (None, "out-of-core"):
        out_of_core(args.quick)
    if args.only in (None, "throughput"):
        throughput(args.quick, args.batch_chunk)


if __name__ == "__main__":
    main()
