"""The one timing method of the side-by-side comparison scripts.

``interleaved_medians`` runs every contender in one process, interleaved
repeat by repeat, with the same thread budget (threadpoolctl for BLAS and
OpenMP, ``torch.set_num_threads`` for torch), and returns the median seconds
per call of each.  Before each multi-threaded sample it idles briefly and
runs the contender untimed once more, so that worker threads another library
left spinning (OpenBLAS spins ~0.1 s, OpenMP runtimes a while) do not steal
the cores, and clocks and caches are warm again.
"""
from __future__ import annotations

import platform
import statistics
import time

from threadpoolctl import threadpool_limits


def seconds_per_call(fn, number=1, clock=time.perf_counter):
    """Mean seconds per call over ``number`` back-to-back calls."""
    t0 = clock()
    for _ in range(number):
        fn()
    return (clock() - t0) / number


def interleaved_medians(fns, threads, repeats, *, sample_seconds=0.02, settle=0.12, torch=None,
                        clock=time.perf_counter):
    """Median seconds per call for each callable in ``fns`` (a dict).

    ``clock=time.process_time`` measures the process's CPU seconds (all
    threads, spin-waiting included) instead of wall time: steadier on a
    shared machine."""
    if torch is not None:
        torch.set_num_threads(threads)
    with threadpool_limits(limits=threads):
        numbers = {}
        for key, fn in fns.items():
            fn()  # warm-up
            # calls per sample from the fastest of three: a single first
            # call may wait milliseconds for an idle core to wake (a VM's
            # parked vCPU), and a sample of one or two such calls would time
            # the wake-up, not the contender
            per = min(seconds_per_call(fn) for _ in range(3))
            numbers[key] = max(1, int(sample_seconds / max(per, 1e-7)))
        samples = {key: [] for key in fns}
        for _ in range(repeats):
            for key, fn in fns.items():
                if threads > 1 and settle:
                    time.sleep(settle)
                    seconds_per_call(fn, numbers[key])  # untimed: wake threads, warm caches
                samples[key].append(seconds_per_call(fn, numbers[key], clock))
    return {key: statistics.median(s) for key, s in samples.items()}


def accumulating(totals, name, fn):
    """``fn`` adding the wall seconds of every call to ``totals[name]``
    (the attention functions of a model run, timed inside it)."""
    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - t0
    return timed


def cpu_model():
    """The CPU's model name with its family / model numbers (Linux
    /proc/cpuinfo; platform otherwise): virtual machines often report a bare
    "AMD EPYC", and family 25 model 17 (Zen 4) is what tells cores apart."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor is enough
                key, _, val = line.partition(":")
                fields[key.strip()] = val.strip()
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or platform.machine()
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']} model {fields['model']})"
    return name


def lscpu_model():
    """lscpu's "Model name" (Linux), or an empty string."""
    import subprocess

    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    except OSError:
        return ""
    for line in out.splitlines():
        if line.startswith("Model name"):
            return line.split(":", 1)[1].strip()
    return ""
