"""Where a call multiplies with BLAS and the BLAS cannot be held to one
thread per thread (OpenBLAS' pthreads builds, as in the NumPy and SciPy
wheels), every product stays below OpenBLAS' own single-thread limit, so
BLAS starts no threads of its own: at any ``num_threads`` and on every
route to the BLAS path (float64, the portable path, ``return_weights``,
int8 Q.K^T computed on dequantized rows, ``varlen_attention``).  The tiles
are read from the kernel's arguments; the results are checked against the
float64 reference."""
from contextlib import nullcontext

import numpy as np
import pytest

import attncore
from attncore import _call, _kernels
from attncore._core import _sdpa
from attncore._threads import OPENBLAS_SERIAL_MNK
from reference import sdpa_ref
from reference import rand



@pytest.fixture
def openblas_unheld(monkeypatch):
    """The policy's view of a pthreads OpenBLAS: no thread-local hold, but
    small products run on the calling thread."""
    monkeypatch.setattr(_call, "blas_hold_supported", lambda: False)
    monkeypatch.setattr(_call, "blas_small_products_ok", lambda: True)


def _spy(monkeypatch, name):
    calls = []
    real = getattr(_sdpa, name)

    def spy(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(_sdpa, name, spy)
    return calls


def _assert_small_products(args, D):
    pl = args[0].plan  # the call description the kernel got
    assert pl.Bq * pl.Bk * D <= OPENBLAS_SERIAL_MNK, (pl, D)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("case", ["int8_dequantize", "float64", "portable", "weights"])
def test_blas_products_stay_serial(openblas_unheld, monkeypatch, threads, case):
    q, k, v = rand((1, 2, 256, 64), 0), rand((1, 2, 1024, 64), 1), rand((1, 2, 1024, 64), 2)
    kw = {"num_threads": threads}
    if case == "float64":
        q, k, v = (a.astype(np.float64) for a in (q, k, v))
    if case == "weights":
        kw["return_weights"] = True
    prev_mode = _sdpa.set_int8_mode("dequantize") if case == "int8_dequantize" else None
    calls = _spy(monkeypatch, "sdpa")
    try:
        with _kernels.forced_kernel_path("portable") if case == "portable" else nullcontext():
            res = attncore.scaled_dot_product_attention(
                q, k, v, precision="int8" if case == "int8_dequantize" else None, **kw)
    finally:
        if case == "int8_dequantize":
            _sdpa.set_int8_mode(prev_mode)
    assert len(calls) == 1
    _assert_small_products(calls[0], 64)
    assert 1 <= calls[0][0].plan.nthreads <= threads
    out = res[0] if isinstance(res, tuple) else res
    ref = sdpa_ref(q, k, v)
    err = 1 - np.vdot(out, ref) / np.linalg.norm(out) / np.linalg.norm(ref)
    assert err < {"int8_dequantize": 1e-4, "float64": 1e-12}.get(case, 1e-6)


@pytest.mark.parametrize("threads", [1, 2])
def test_varlen_blas_products_stay_serial(openblas_unheld, monkeypatch, threads):
    cu = [0, 300, 1000]
    q, k, v = rand((1000, 2, 64), 0), rand((1000, 2, 64), 1), rand((1000, 2, 64), 2)
    calls = _spy(monkeypatch, "sdpa_paged")
    with _kernels.forced_kernel_path("portable"):
        out = attncore.varlen_attention(q, k, v, cu, cu, is_causal=True, num_threads=threads)
    assert len(calls) == 1
    _assert_small_products(calls[0], 64)
    for b in range(2):
        s = slice(cu[b], cu[b + 1])
        ref = sdpa_ref(*(np.swapaxes(a[s], 0, 1) for a in (q, k, v)), is_causal=True)
        np.testing.assert_allclose(np.swapaxes(out[s], 0, 1), ref, rtol=1e-4, atol=1e-5)


def test_other_unheld_blas_gets_one_thread(monkeypatch):
    """A BLAS that is neither held nor an OpenBLAS: the region runs on one
    attncore thread (the BLAS keeps its own)."""
    monkeypatch.setattr(_call, "blas_hold_supported", lambda: False)
    monkeypatch.setattr(_call, "blas_small_products_ok", lambda: False)
    monkeypatch.setattr(_call, "blas_parallel_threads", lambda n: 1)
    calls = _spy(monkeypatch, "sdpa")
    q = rand((1, 4, 128, 32), 0).astype(np.float64)
    attncore.scaled_dot_product_attention(q, q, q, num_threads=2)
    assert calls[0][0].plan.nthreads == 1


# --------------------------------------------------------------------------
# the planner's documented rules (attncore._call.plan; the paged door's key
# splits, attncore._call.paged_splits): the other test files check results
# only, and name the rule here that makes their shapes reach a kernel path
# --------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["avx2", "avx512"])
def test_plan_fused_blocks_of_two_panels_or_key_chunks(path):
    """The fused float32 kernel: query blocks of two panels (its C
    constant ``PANEL_ROWS``); over more than ``kchunk_keys`` float32 keys,
    blocks of ``KCHUNK_PANELS`` panels taking turns over chunks of that
    many keys (512 for D = Dv = 64: 256 KiB)."""
    panel = _sdpa.PANEL_ROWS[path]
    pl = _call.plan(np.float32, 1000, 400, 64, 64, 0, 1, 1, kernel_path=path)
    assert pl.fused and pl.Bq == 2 * panel and pl.kchunk == 0
    assert _call.kchunk_keys(64, 64) == 512
    for N, M, nb in ((1000, 1000, 1), (300, 1100, 2)):  # test_kernel_paths' key chunks
        pl = _call.plan(np.float32, N, M, 64, 64, 0, nb, 1, kernel_path=path)
        assert pl.fused and pl.Bq == _call.KCHUNK_PANELS * panel and pl.kchunk == 512


def test_plan_splits_the_keys_of_a_few_rows_over_idle_threads():
    """Fewer work items than threads and at least 1024 keys: the keys split
    (flash decoding) into chunks of at least 256 keys, one per idle thread
    (test_int8's key-split case: one query block, 5000 keys, two threads);
    one thread or few keys: no split."""
    N = min(20, _sdpa.PANEL_ROWS.get(_sdpa.kernel_path(), 20))
    pl = _call.plan(np.float32, N, 5000, 64, 64, 0, 1, 2)
    assert pl.nsplit == 2 and pl.chunk >= 256 and pl.nthreads == 2
    assert pl.nsplit * pl.chunk >= 5000 and pl.chunk % pl.Bk == 0
    assert _call.plan(np.float32, N, 5000, 64, 64, 0, 1, 1).nsplit == 1
    assert _call.plan(np.float32, N, 1000, 64, 64, 0, 1, 2).nsplit == 1


def test_paged_split_plan_splits_few_long_sequences():
    """The paged door: when the work list gives a thread fewer than 4 items
    and the longest sequence has at least 1024 keys, the keys split in
    chunks of whole blocks of at least 512 keys (test_paged's key-split
    case: 2 items of 3000 keys for 2 threads); otherwise no split."""
    lens = np.array([3000, 2500])
    nsplit, chunk = _call.paged_splits(lens, 2, 2, 32)
    assert nsplit > 1 and chunk % 32 == 0 and chunk >= 512 and nsplit * chunk >= 3000
    assert _call.paged_splits(lens, 8, 2, 32) == (1, 0)
    assert _call.paged_splits(lens, 2, 1, 32) == (1, 0)
    assert _call.paged_splits(np.array([1000, 900]), 2, 2, 32) == (1, 0)


def test_plan_call_keeps_the_kernel_path(openblas_unheld):
    """Re-planning for the BLAS keeps the path and the converted-operand
    choice (a re-plan used to drop them and take the fused kernel's tiles)."""
    pl = _call.plan_call(np.float32, 1024, 1024, 64, 64, 0, 8, 2,
                              kernel_path="portable", converted_kv=True)
    assert not pl.fused
    assert pl.Bq * pl.Bk * 64 <= OPENBLAS_SERIAL_MNK


def test_l2_size_is_the_cpus():
    """The per-core L2 size that sizes the BLAS path's tiles and the dense
    layers' weight blocks is the one getconf reports (CPython's os.sysconf
    may lack the name: then sysfs), and 1 MiB where neither knows it."""
    import shutil
    import subprocess

    getconf = shutil.which("getconf")
    want = 0
    if getconf:
        res = subprocess.run([getconf, "LEVEL2_CACHE_SIZE"], capture_output=True, text=True)
        if res.returncode == 0 and res.stdout.strip().isdigit():
            want = int(res.stdout.strip())
    if want <= 0:
        pytest.skip("getconf does not report the L2 size here")
    assert _kernels._l2_bytes() == want


def test_l2_size_unknown(monkeypatch):
    def no_sysconf(name):
        raise ValueError(name)

    def no_sysfs(path):
        raise OSError(path)

    monkeypatch.setattr(_kernels.os, "sysconf", no_sysconf)
    monkeypatch.setattr(_kernels.os, "listdir", no_sysfs)
    assert _kernels._l2_bytes() == 1 << 20


def test_l2_size_from_sysfs(monkeypatch, tmp_path):
    """Without sysconf's answer, the level-2 entry of the CPU's cache
    directory gives the size; entries it cannot read are skipped."""
    def no_sysconf(name):
        raise ValueError(name)

    (tmp_path / "aaa").mkdir()                     # no level file
    for idx, level, size in (("index0", "1", "48K"), ("index1", "1", "64K"),
                             ("index2", "2", "512K"), ("index3", "3", "32M")):
        (tmp_path / idx).mkdir()
        (tmp_path / idx / "level").write_text(level + "\n")
        (tmp_path / idx / "size").write_text(size + "\n")
    monkeypatch.setattr(_kernels.os, "sysconf", no_sysconf)
    monkeypatch.setattr(_kernels, "_CACHE_SYSFS", str(tmp_path))
    assert _kernels._l2_bytes() == 512 << 10
    (tmp_path / "index2" / "size").write_text("2M\n")
    assert _kernels._l2_bytes() == 2 << 20
    (tmp_path / "index2" / "size").write_text("junk\n")
    assert _kernels._l2_bytes() == 1 << 20
