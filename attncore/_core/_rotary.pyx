# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Rotary position embeddings, fused cos / sin (private; see attncore._rotary).

``rotary`` rotates the first ``2 h`` channels of every row of ``x`` into
``out`` (which may be ``x`` itself) with the C kernel of ``ac_rotary.h``:
work items are blocks of positions of one position row, spread over an
OpenMP team; each computes its cos / sin table once, in per-thread scratch,
and applies it to every row of x sharing those positions.
"""
from cpython.buffer cimport PyBUF_RECORDS_RO, PyBUF_RECORDS
from cpython.pycapsule cimport PyCapsule_Import
from cython.parallel cimport prange, parallel
from libc.stdint cimport int64_t, uint16_t
from libc.stdlib cimport malloc, free

from attncore._core._buffers cimport _Buffers, _acquire, _release_all

cdef extern from "ac_rotary.h" nogil:
    ctypedef struct ac_rope_params:
        const void *x
        void *o
        const int64_t *x_off
        const int64_t *o_off
        int64_t x_ls, x_ds, o_ls, o_ds
        const int64_t *pos
        int64_t pos_ps
        const double *inv_freq
        int64_t P, R, L, D, h, Lb
        int interleaved
        int copy_rest
    int64_t ac_rope_items(const ac_rope_params *p)
    size_t ac_rope_scratch_bytes(const ac_rope_params *p)
    void ac_rope_item_f32(const ac_rope_params *p, int64_t item, void *scratch)
    void ac_rope_item_f64(const ac_rope_params *p, int64_t item, void *scratch)
    void ac_rope_item_f16(const ac_rope_params *p, int64_t item, void *scratch)
    void ac_rope_half_to_float_array(const uint16_t *h, float *f, int64_t n)
    void ac_rope_float_to_half_array(const float *f, uint16_t *h, int64_t n)
    void ac_rope_sincos_array(const double *a, double *s, double *c, int64_t n)
    void ac_state_attach(void *home)


# the kernel-path state lives in _sdpa (ac_common.h)
ac_state_attach(PyCapsule_Import("attncore._core._sdpa._kernel_state", 0))


cdef inline void _item(const ac_rope_params *p, int itemsize, int64_t it,
                       void *scratch) noexcept nogil:
    if itemsize == 4:
        ac_rope_item_f32(p, it, scratch)
    elif itemsize == 8:
        ac_rope_item_f64(p, it, scratch)
    else:
        ac_rope_item_f16(p, it, scratch)


cdef int _run(const ac_rope_params *p, int itemsize, int nthreads) noexcept nogil:
    """Every item, on ``nthreads`` threads; 0, or -1 when scratch ran out."""
    cdef int64_t nitems = ac_rope_items(p)
    cdef size_t nbytes = ac_rope_scratch_bytes(p)
    cdef void *scratch = NULL
    cdef int err = 0
    cdef int *errp = &err
    cdef Py_ssize_t it
    if nthreads <= 1 or nitems <= 1:
        scratch = malloc(nbytes)
        if scratch == NULL:
            return -1
        for it in range(nitems):
            _item(p, itemsize, it, scratch)
        free(scratch)
        return 0
    with parallel(num_threads=nthreads):
        scratch = malloc(nbytes)
        if scratch == NULL:
            errp[0] = -1
        # every thread reaches the worksharing loop (one without scratch
        # skips its items; the call then raises)
        for it in prange(nitems, schedule='static'):
            if scratch != NULL:
                _item(p, itemsize, it, scratch)
        free(scratch)
    return err


def rotary(x, out, const int64_t[::1] x_off, const int64_t[::1] o_off,
           const int64_t[:, ::1] pos, const double[::1] inv_freq, bint interleaved,
           bint copy_rest, Py_ssize_t block, int nthreads):
    """Rotate ``x`` (..., L, D) into ``out`` (same shape and dtype; may be x).

    The leading axes are given by ``x_off`` / ``o_off``: (P * R,) element
    offsets of each row's element [.., 0, 0], P = ``pos.shape[0]`` position
    rows (pos: (P, L)), R rows per position row.  ``inv_freq``: (h,)
    frequencies, rotating the first 2 h channels; ``block``: positions per
    work item.  float32 / float64 / float16 by the item size.  Validation
    is the caller's (attncore._rotary); only the layout is checked here.
    """
    cdef _Buffers bufs
    cdef Py_buffer *bx
    cdef Py_buffer *bo
    cdef ac_rope_params p
    cdef int itemsize, nd, err = 0
    bufs.n = 0
    try:
        bx = _acquire(&bufs, x, PyBUF_RECORDS_RO)
        bo = _acquire(&bufs, out, PyBUF_RECORDS)
        nd = bx.ndim
        itemsize = <int>bx.itemsize
        if nd < 2 or bo.ndim != nd or bo.itemsize != itemsize or itemsize not in (2, 4, 8):
            raise ValueError("rotary: x and out must be float arrays of one dtype, ndim >= 2")
        if bo.shape[nd - 2] != bx.shape[nd - 2] or bo.shape[nd - 1] != bx.shape[nd - 1]:
            raise ValueError("rotary: x and out shapes differ")
        if (bx.strides[nd - 2] % itemsize or bx.strides[nd - 1] % itemsize
                or bo.strides[nd - 2] % itemsize or bo.strides[nd - 1] % itemsize):
            raise ValueError("rotary: strides must be multiples of the item size")
        p.x = bx.buf
        p.o = bo.buf
        p.L = bx.shape[nd - 2]
        p.D = bx.shape[nd - 1]
        p.x_ls = bx.strides[nd - 2] // itemsize
        p.x_ds = bx.strides[nd - 1] // itemsize
        p.o_ls = bo.strides[nd - 2] // itemsize
        p.o_ds = bo.strides[nd - 1] // itemsize
        p.P = pos.shape[0]
        if p.P < 1 or pos.shape[1] != p.L or x_off.shape[0] % p.P \
                or o_off.shape[0] != x_off.shape[0]:
            raise ValueError("rotary: positions / offsets do not match x")
        p.R = x_off.shape[0] // p.P
        p.h = inv_freq.shape[0]
        if 2 * p.h > p.D or block < 1:
            raise ValueError("rotary: 2 * len(inv_freq) must be <= D, block >= 1")
        if p.L == 0 or p.R == 0 or p.h == 0:
            return
        p.x_off = &x_off[0]
        p.o_off = &o_off[0]
        p.pos = &pos[0, 0]
        p.pos_ps = p.L
        p.inv_freq = &inv_freq[0]
        p.Lb = block
        p.interleaved = interleaved
        p.copy_rest = copy_rest
        with nogil:
            err = _run(&p, itemsize, nthreads)
        if err:
            raise MemoryError("rotary: out of memory for the cos / sin scratch")
    finally:
        _release_all(&bufs)


def half_to_float(const uint16_t[::1] h, float[::1] f):
    """Test hook: the kernel's portable float16 -> float32 conversion."""
    if f.shape[0] != h.shape[0]:
        raise ValueError("half_to_float: lengths differ")
    if h.shape[0]:
        ac_rope_half_to_float_array(&h[0], &f[0], h.shape[0])


def float_to_half(const float[::1] f, uint16_t[::1] h):
    """Test hook: the kernel's portable float32 -> float16 conversion."""
    if f.shape[0] != h.shape[0]:
        raise ValueError("float_to_half: lengths differ")
    if f.shape[0]:
        ac_rope_float_to_half_array(&f[0], &h[0], f.shape[0])


def sincos(const double[::1] a, double[::1] s, double[::1] c):
    """Test hook: the kernel's double sin / cos (fast path, |a| < 3e9)."""
    if s.shape[0] != a.shape[0] or c.shape[0] != a.shape[0]:
        raise ValueError("sincos: lengths differ")
    if a.shape[0]:
        ac_rope_sincos_array(&a[0], &s[0], &c[0], a.shape[0])
