"""Plain calls (NumPy operands, no mask or options beyond ``is_causal``,
``scale``, ``enable_gqa`` and ``num_threads``) run from a description cached
by their operands' metadata (attncore._lean.plain_call).  What the
cache must never do: serve a call whose data, layout, dtype, options,
thread count or kernel path differ from the one that filled it, accept an
argument the general path refuses, or skip the float64 re-run of an
overflow.  Every result against the float64 reference."""
import numpy as np
import pytest

import attncore
from attncore import _kernels, _lean
from attncore._core import _sdpa
from reference import rand, sdpa_ref

sdpa = attncore.scaled_dot_product_attention


@pytest.fixture
def fresh():
    """An empty cache before and after the test."""
    _lean._PLAIN.clear()
    yield _lean._PLAIN
    _lean._PLAIN.clear()


def close(out, ref, dtype=np.float32):
    atol = {np.float64: 1e-12, np.float32: 3e-5, np.float16: 3e-3}[dtype]
    assert out.dtype == dtype
    np.testing.assert_allclose(out.astype(np.float64), ref, atol=atol, rtol=0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("shape", [(3, 2, 1, 7, 16), (2, 4, 6, 9, 8), (2, 2, 40, 33, 24)])
def test_new_data_same_metadata(path, fresh, dtype, shape):
    """Each call reads its own operands: three calls of one metadata, new
    data each time, each equal to its reference (and the cache filled)."""
    B, H, N, M, D = shape
    for seed in range(3):
        q, k, v = (rand(s, 10 * seed + i, dtype) for i, s in
                   enumerate([(B, H, N, D), (B, H, M, D), (B, H, M, D)]))
        for causal in (False, "lower_right"):
            out = sdpa(q, k, v, is_causal=causal, scale=0.3)
            close(out, sdpa_ref(q.astype(np.float64), k.astype(np.float64),
                                v.astype(np.float64), is_causal=causal, scale=0.3), dtype)
    # cached wherever no BLAS product runs: the fused kernel, or a few rows
    blas = N > 4 and (path not in _sdpa.PANEL_ROWS or dtype == np.float64)
    assert any(hit for hit in fresh.values()) != blas


@pytest.mark.parametrize("qdt", ["bfloat16", np.float32])
@pytest.mark.parametrize("shape", [(3, 2, 1, 7, 16), (2, 4, 6, 9, 8), (2, 2, 40, 33, 24)])
def test_bfloat16_operands_are_cached_too(path, fresh, qdt, shape):
    """bfloat16 operands (whose bits the kernel reads, a uint16 view) take
    the cached description as the other dtypes do -- their checks cost
    several times a small call's kernel -- and each call still reads its
    own operands: new data each time, queries bfloat16 or float32, one or
    two query heads per key head, against the reference of the rounded
    inputs."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    bf = np.dtype(ml_dtypes.bfloat16)
    qdt = bf if qdt == "bfloat16" else np.dtype(qdt)
    B, H, N, M, D = shape
    for seed in range(3):
        for g in (1, 2):
            q = rand((B, H * g, N, D), 10 * seed).astype(qdt)
            k, v = (rand((B, H, M, D), 10 * seed + i).astype(bf) for i in (1, 2))
            out = sdpa(q, k, v, is_causal="lower_right", enable_gqa=True)
            assert out.dtype == qdt
            ref = sdpa_ref(*(np.repeat(a.astype(np.float64), g if a is not q else 1, axis=1)
                             for a in (q, k, v)), is_causal="lower_right")
            tol = 1.01 * 2.0 ** -8 * np.abs(ref).max() + 1e-6 if qdt == bf else 3e-5
            np.testing.assert_allclose(out.astype(np.float64), ref, atol=tol, rtol=0)
    blas = N > 4 and path not in _sdpa.PANEL_ROWS
    assert any(hit for hit in fresh.values()) != blas


@pytest.mark.parametrize("shape", [(3, 2, 1, 7, 16), (2, 2, 1, 300, 64), (2, 2, 40, 33, 24)])
def test_int8_pairs_are_cached_too(path, fresh, shape):
    """(int8, scales) key / value pairs (quantize_kv's, an int8 KV cache's
    views) take the cached description as float operands do -- their
    checks cost several times a small decoding call's kernel -- and each
    call reads its own int8 rows *and scales*: new data and new scales of
    one metadata each time, a pair on either side or both, one or two query
    heads per key head, against the float64 reference of the dequantized
    rows.  The cache holds none of the callers' scales."""
    B, H, N, M, D = shape
    for seed in range(3):
        for g in (1, 2):
            q = rand((B, H * g, N, D), 10 * seed)
            kf, vf = (rand((B, H, M, D), 10 * seed + i) * (seed + 1) for i in (1, 2))
            kq, vq = attncore.quantize_kv(kf), attncore.quantize_kv(vf)
            kd, vd = (a[0].astype(np.float64) * a[1][..., None] for a in (kq, vq))
            for key, value, kr, vr in ((kq, vq, kd, vd), (kq, vf, kd, vf), (kf, vq, kf, vd)):
                out = sdpa(q, key, value, is_causal="lower_right", enable_gqa=True)
                ref = sdpa_ref(q.astype(np.float64), *(np.repeat(a.astype(np.float64), g, axis=1)
                                                       for a in (kr, vr)),
                               is_causal="lower_right")
                close(out, ref)
    blas = N > 4 and path not in _sdpa.PANEL_ROWS
    assert any(hit for hit in fresh.values()) != blas
    for hit in fresh.values():
        assert not hit or (hit[0][_lean._KS] is None and hit[0][_lean._VS] is None)


def test_int8_pair_scales_converted_or_misaligned(path, fresh):
    """Scales the checks convert (float64, another byte order, a misaligned
    view) under the metadata of a cached pair call: converted on every
    call, each result the reference's (never the cached call's scales)."""
    q = rand((1, 2, 1, 32), 1)
    kq, vq = (attncore.quantize_kv(rand((1, 2, 20, 32), i)) for i in (2, 3))
    ref = sdpa_ref(q, *(a[0].astype(np.float64) * a[1][..., None] for a in (kq, vq)))
    raw = np.zeros(kq[1].nbytes + 1, np.uint8)
    odd = raw[1:].view(np.float32).reshape(kq[1].shape)
    odd[...] = kq[1]
    assert not odd.flags.aligned
    for _ in range(2):
        close(sdpa(q, kq, vq), ref)
        close(sdpa(q, (kq[0], odd), vq), ref)
        close(sdpa(q, (kq[0], kq[1].astype(np.float64)), vq), ref)
        close(sdpa(q, kq, (vq[0], vq[1].astype(">f4"))), ref)
        close(sdpa(q, (kq[0], 2 * kq[1]), vq),
              sdpa_ref(q, kq[0].astype(np.float64) * 2 * kq[1][..., None],
                       vq[0].astype(np.float64) * vq[1][..., None]))


def test_layouts_and_options_are_part_of_the_key(path, fresh):
    """One shape, other strides / options / threads / grouped heads: every
    call its own reference, whatever ran before it."""
    q, k, v = rand((2, 4, 5, 16), 1), rand((2, 4, 9, 16), 2), rand((2, 4, 9, 16), 3)
    wide = np.zeros((2, 4, 9, 40), np.float32)
    wide[..., 3:19] = k
    kt = np.ascontiguousarray(k.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    kg, vg = k[:, :2], v[:, :2]
    qd = q.astype(np.float64)
    runs = [
        (dict(), (q, k, v), sdpa_ref(qd, k, v)),
        (dict(), (q, wide[..., 3:19], v), sdpa_ref(qd, k, v)),
        (dict(), (q, kt, v), sdpa_ref(qd, k, v)),
        (dict(is_causal=True), (q, k, v), sdpa_ref(qd, k, v, is_causal=True)),
        (dict(is_causal="lower_right"), (q, k, v), sdpa_ref(qd, k, v, is_causal="lower_right")),
        (dict(scale=0.5), (q, k, v), sdpa_ref(qd, k, v, scale=0.5)),
        (dict(scale=np.float32(0.5)), (q, k, v), sdpa_ref(qd, k, v, scale=0.5)),
        (dict(num_threads=1), (q, k, v), sdpa_ref(qd, k, v)),
        (dict(num_threads=2), (q, k, v), sdpa_ref(qd, k, v)),
        (dict(enable_gqa=True), (q, kg, vg), sdpa_ref(qd, kg, vg, group=2)),
        (dict(enable_gqa=True), (q[:, :, :1], kg, vg), sdpa_ref(qd[:, :, :1], kg, vg, group=2)),
        (dict(), (q[:, :, :1], k, v), sdpa_ref(qd[:, :, :1], k, v)),
        (dict(), (q, k, np.asfortranarray(v)), sdpa_ref(qd, k, v)),
        (dict(), (q, k, v[:, :, ::-1]), sdpa_ref(qd, k, v[:, :, ::-1])),
        (dict(), (np.asfortranarray(q), k, v), sdpa_ref(qd, k, v)),
        (dict(), (q[:, :, :1], k, v[:, :, ::-1]), sdpa_ref(qd[:, :, :1], k, v[:, :, ::-1])),
    ]
    for _ in range(2):
        for kw, (a, b, c), ref in runs:
            close(sdpa(a, b, c, **kw), ref)


def test_what_the_checks_convert_or_refuse(fresh):
    """Operands the checks convert (another byte order, an unaligned or a
    reversed view) are converted on every call, not read as the cached
    operand was; arguments the general path refuses stay refused after an
    accepted call of the same metadata."""
    q, k, v = rand((1, 2, 3, 8), 4), rand((1, 2, 6, 8), 5), rand((1, 2, 6, 8), 6)
    ref = sdpa_ref(q, k, v)
    close(sdpa(q, k, v), ref)
    close(sdpa(q, k.astype(">f4"), v), ref)
    raw = np.zeros(k.nbytes + 1, np.uint8)
    odd = raw[1:].view(np.float32).reshape(k.shape)
    odd[...] = k
    close(sdpa(q, odd, v), ref)
    close(sdpa(q, k[:, :, ::-1][:, :, ::-1], v), ref)
    fresh.clear()                              # a misaligned first call caches nothing
    close(sdpa(q, odd, v), ref)
    assert not fresh
    close(sdpa(q, k, v), ref)
    assert list(fresh.values()) and all(fresh.values())
    close(sdpa(q, k, v, is_causal=True), sdpa_ref(q, k, v, is_causal=True))
    for bad in (1, "causal", np.array(True)):
        with pytest.raises((ValueError, TypeError), match="is_causal"):
            sdpa(q, k, v, is_causal=bad)
    for bad in (0.0, -1.0, np.inf, "0.5"):
        with pytest.raises((ValueError, TypeError), match="scale"):
            sdpa(q, k, v, scale=bad)
    with pytest.raises((ValueError, TypeError), match="num_threads"):
        sdpa(q, k, v, num_threads=0)
    with pytest.raises((ValueError, TypeError), match="enable_gqa"):
        sdpa(q, k, v, enable_gqa="yes")


@pytest.mark.parametrize("which", [0, 1, 2])
def test_misaligned_operand_of_cached_metadata(path, fresh, which):
    """An operand whose data is misaligned (not a multiple of its item
    size) but whose shape, strides and dtype match a cached description:
    the plain call gives the reference (the general path copies it), and
    the integrations' prepared call declines (None, for the general call)
    instead of handing the kernels a misaligned pointer."""
    ops = [rand((2, 2, 5, 16), 1), rand((2, 2, 7, 16), 2), rand((2, 2, 7, 16), 3)]
    ref = sdpa_ref(*ops)
    close(sdpa(*ops), ref)
    # (the portable path's BLAS tiles are the general call's)
    assert (_lean.attention_prepared(*ops, 0, None, 1) is None) == (path not in _sdpa.PANEL_ROWS)
    raw = np.zeros(ops[which].nbytes + 1, np.uint8)
    odd = raw[1:].view(np.float32).reshape(ops[which].shape)
    odd[...] = ops[which]
    assert not odd.flags.aligned
    bad = list(ops)
    bad[which] = odd
    for _ in range(2):
        close(sdpa(*bad), ref)
        assert _lean.attention_prepared(*bad, 0, None, 1) is None


def test_kernel_path_is_part_of_the_key(fresh):
    """The same call under each forced path: each path's own description
    (its panel rows, its kernels), each result the reference's."""
    q, k, v = rand((2, 2, 37, 32), 7), rand((2, 2, 50, 32), 8), rand((2, 2, 50, 32), 9)
    ref = sdpa_ref(q, k, v, is_causal=True)
    for p in _kernels.available_kernel_paths() * 2:
        with _kernels.forced_kernel_path(p):
            close(sdpa(q, k, v, is_causal=True), ref)
    # (the key's last entry: the kernel path and the bfloat16 mode, one int)
    assert len({key[-1] for key in fresh}) == len(_kernels.available_kernel_paths())


def test_overflow_still_runs_again_in_float64(fresh):
    """A float32 call whose accumulation overflows is computed again in
    float64 on every call, cached or not."""
    q = np.zeros((1, 1, 2, 4), np.float32)
    k = np.zeros((1, 1, 3, 4), np.float32)
    v = np.full((1, 1, 3, 4), 3e38, np.float32)
    for _ in range(3):
        out = sdpa(q, k, v)
        assert out.dtype == np.float32
        np.testing.assert_allclose(out, np.full((1, 1, 2, 4), 3e38, np.float32), rtol=1e-6)
