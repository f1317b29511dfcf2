"""attncore's own thread team (src/ac_team.h), which runs the attention
kernels' items in place of an OpenMP region: the results do not depend on
which thread ran which item, the team uses the threads a call asks for
(num_threads, threadpoolctl limits) and no more, calls from several Python
threads at once (each on a team of its own) give the same results, and the
team's C code is clean under ThreadSanitizer."""
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

import attncore
from attncore._core import _sdpa
from reference import rand, sdpa_ref

pytestmark = pytest.mark.skipif(not _sdpa.openmp_enabled(),
                                reason="attncore built without OpenMP: one thread only")

sdpa = attncore.scaled_dot_product_attention


def _decode(M=1500, Hq=32, Hk=8, D=64, seed=0):
    """A grouped-query decoding step (B 1, one query)."""
    return (rand((1, Hq, 1, D), seed), rand((1, Hk, M, D), seed + 1),
            rand((1, Hk, M, D), seed + 2))


def _paged(seed=0, Hq=8, Hk=2, D=32, bs=16):
    """A paged decode step: 5 sequences, blocks shuffled over the pool."""
    lens = np.array([1, 40, 300, 77, 1200])
    nblk = -(-lens // bs)
    perm = np.random.default_rng(seed).permutation(int(nblk.sum()) + 3).astype(np.int32)
    bt = np.zeros((len(lens), int(nblk.max())), np.int32)
    o = 0
    for s, n in enumerate(nblk):
        bt[s, :n] = perm[o:o + n]
        o += n
    NB = len(perm)
    q = rand((len(lens), Hq, D), seed)
    kc, vc = rand((NB, bs, Hk, D), seed + 1), rand((NB, bs, Hk, D), seed + 2)
    return q, kc, vc, bt, lens.astype(np.int32)


def _paged_ref(q, kc, vc, bt, lens):
    bs = kc.shape[1]
    out = []
    for s, L in enumerate(lens):
        blocks = bt[s, :-(-L // bs)]
        k = kc[blocks].reshape(-1, *kc.shape[2:])[:L].transpose(1, 0, 2)
        v = vc[blocks].reshape(-1, *vc.shape[2:])[:L].transpose(1, 0, 2)
        g = q.shape[1] // k.shape[0]
        out.append(sdpa_ref(q[s][:, None], k, v, group=g)[:, 0])
    return np.stack(out)


@pytest.mark.parametrize("M", [300, 1500, 5000])
def test_decode_step_is_the_one_thread_result(M):
    """Up to 8 threads (8 key heads: one item each, no key split) give the
    one-thread result bit for bit, and it is attention's, in float64.  More
    threads split the keys (a plan of their own): attention's result again,
    the same bits on every run whichever thread ran which split."""
    q, k, v = _decode(M)
    ref = sdpa_ref(q, k, v, group=4)
    one = sdpa(q, k, v, enable_gqa=True, num_threads=1)
    np.testing.assert_allclose(one, ref, rtol=2e-5, atol=2e-6)
    for t in (2, 3, 8):
        np.testing.assert_array_equal(sdpa(q, k, v, enable_gqa=True, num_threads=t), one)
    split = sdpa(q, k, v, enable_gqa=True, num_threads=64)
    np.testing.assert_allclose(split, ref, rtol=2e-5, atol=2e-6)
    for _ in range(5):
        np.testing.assert_array_equal(sdpa(q, k, v, enable_gqa=True, num_threads=64), split)


def test_prefill_and_float64_are_the_one_thread_result():
    q, k, v = rand((2, 4, 200, 32), 3), rand((2, 4, 300, 32), 4), rand((2, 4, 300, 32), 5)
    for dt in (np.float32, np.float64):
        a, b, c = (x.astype(dt) for x in (q, k, v))
        one = sdpa(a, b, c, is_causal=True, num_threads=1)
        tol = dict(rtol=2e-5, atol=2e-6) if dt == np.float32 else dict(rtol=1e-11, atol=1e-12)
        np.testing.assert_allclose(one, sdpa_ref(a, b, c, is_causal=True), **tol)
        for t in (2, 5):
            np.testing.assert_allclose(sdpa(a, b, c, is_causal=True, num_threads=t), one,
                                       rtol=1e-6 if dt == np.float32 else 1e-13, atol=0)


def test_paged_step_is_attention_and_the_same_on_every_run():
    """The paged step's key splits depend on the thread count (a plan per
    count), not on which thread runs which split: attention's result at
    every count, the same bits on every run."""
    q, kc, vc, bt, lens = _paged()
    ref = _paged_ref(q, kc, vc, bt, lens)
    for t in (1, 2, 3, 16):
        first = attncore.paged_attention(q, kc, vc, block_table=bt, seq_lens=lens,
                                         enable_gqa=True, num_threads=t)
        np.testing.assert_allclose(first, ref, rtol=2e-5, atol=2e-6)
        for _ in range(4):
            np.testing.assert_array_equal(
                attncore.paged_attention(q, kc, vc, block_table=bt, seq_lens=lens,
                                         enable_gqa=True, num_threads=t), first)


def test_a_non_finite_row_found_by_any_thread():
    """A NaN in one query head's row, whichever thread runs it: that head's
    output is NaN (the float64 re-run of the call agrees), the others are
    attention's."""
    q, k, v = _decode(1500)
    q[0, 29, 0, 5] = np.nan
    ref = sdpa_ref(q, k, v, group=4)
    for t in (1, 2, 3):
        out = sdpa(q, k, v, enable_gqa=True, num_threads=t)
        assert np.isnan(out[0, 29]).all()
        np.testing.assert_allclose(np.delete(out, 29, axis=1), np.delete(ref, 29, axis=1),
                                   rtol=2e-5, atol=2e-6)


_COUNT = r"""
import os, threadpoolctl, numpy as np, attncore
from attncore._core import _sdpa
rng = np.random.default_rng(0)
q = rng.standard_normal((1, 32, 1, 64), dtype=np.float32)
k = rng.standard_normal((1, 8, 3000, 64), dtype=np.float32)
tasks = lambda: len(os.listdir("/proc/self/task"))
def call(t):
    attncore.scaled_dot_product_attention(q, k, k, enable_gqa=True, num_threads=t)
    return _sdpa.team_started()
n0 = tasks()
seen = [call(1)]
with threadpoolctl.threadpool_limits(limits=1, user_api="openmp"):
    seen.append(call(None))
seen += [call(3), call(2), call(3)]
seen.append(tasks() - n0)
print(seen)
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux's /proc")
def test_the_team_starts_the_threads_asked_for_and_no_more():
    """In a fresh process: one thread asked (num_threads=1, or None under a
    threadpoolctl limit of 1) starts no thread; num_threads=3 starts two
    besides the caller, and later calls of 2 or 3 threads reuse them (the
    process holds two more threads, not one per call)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS",)}
    r = subprocess.run([sys.executable, "-c", _COUNT], capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert eval(r.stdout.strip().splitlines()[-1]) == [0, 0, 2, 2, 2, 2]


def test_calls_from_many_python_threads_at_once():
    """Eight Python threads, each running decoding steps and paged steps at
    2 and 3 threads while the others do (each caller takes a team of its
    own): every result is the serial one of its thread count, bit for
    bit."""
    dec = [_decode(M, seed=s) for s, M in enumerate((700, 2100, 4000))]
    pg = _paged(seed=7)
    want_dec = [sdpa(q, k, v, enable_gqa=True, num_threads=1) for q, k, v in dec]
    q, kc, vc, bt, lens = pg

    def paged(t):
        return attncore.paged_attention(q, kc, vc, block_table=bt, seq_lens=lens,
                                        enable_gqa=True, num_threads=t)
    want_pg = {t: paged(t) for t in (2, 3)}
    errors = []
    start = threading.Barrier(8)

    def work(i):
        try:
            start.wait()
            for r in range(6):
                j = (i + r) % 3
                t = 2 + (i + r) % 2
                np.testing.assert_array_equal(sdpa(*dec[j], enable_gqa=True, num_threads=t),
                                              want_dec[j])
                np.testing.assert_array_equal(paged(t), want_pg[t])
        except Exception as exc:  # collected: an assertion in a thread fails the test
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a call hung"
    assert not errors, errors[0]


@pytest.mark.skipif(sys.platform != "linux", reason="a Linux compiler with ThreadSanitizer")
def test_team_is_clean_under_thread_sanitizer(tmp_path):
    """src/ac_team.h in a C program of 20 threads running jobs at once
    (tests/team_stress.c), built with -fsanitize=thread: every item runs
    once, with its result, and ThreadSanitizer reports no data race."""
    import shutil

    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    here = os.path.dirname(os.path.abspath(__file__))
    src = os.path.join(os.path.dirname(here), "attncore", "_core", "src")
    exe = tmp_path / "team_stress"
    b = subprocess.run([cc, "-fopenmp", "-fsanitize=thread", "-g", "-O1", "-I", src,
                        os.path.join(here, "team_stress.c"), "-o", str(exe), "-lpthread"],
                       capture_output=True, text=True)
    if b.returncode != 0:
        pytest.skip(f"cannot build with ThreadSanitizer: {b.stderr[-300:]}")
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, TSAN_OPTIONS="halt_on_error=1"))
    assert "ThreadSanitizer" not in r.stderr, r.stderr[-2000:]
    assert r.returncode == 0 and r.stdout.split() == ["bad", "0"], r.stdout + r.stderr[-500:]
