# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Dense layers on attncore's own threads (private).

``linear`` computes ``out = x @ w.T (+ bias)`` (PyTorch's Linear layout) by
splitting the product into row (or column) blocks over an OpenMP team, each
block one single-threaded gemm from ``scipy.linalg.cython_blas``.  The layers
use it for their projections so that one call never has two thread pools
(OpenBLAS' and OpenMP's) competing for the cores.
"""
from cpython.buffer cimport PyBUF_RECORDS_RO, PyBUF_RECORDS
from cpython.pycapsule cimport PyCapsule_Import
from cython.parallel cimport prange, parallel
from scipy.linalg.cython_blas cimport sgemm, dgemm, sgemv, dgemv

from libc.stdlib cimport malloc, free
from libc.stdint cimport uint16_t

from attncore._core._buffers cimport _Buffers, _acquire, _release_all
from attncore._core._openmp cimport ac_blas_hold, ac_blas_release, set_blas_local_fns

cdef extern from "ac_linear.h" nogil:
    void ac_state_attach(void *home)
    int ac_kernel_path
    int ac_set_kernel_path(int path)
    int ac_fused_panel_rows()
    int AC_PATH_PORTABLE, AC_PATH_AVX512
    int AC_LINEAR_SMALL
    Py_ssize_t AC_LINEAR_SCRATCH(int K)
    Py_ssize_t AC_BF16_LINEAR_SCRATCH(int K)
    int ac_linear_rows_f32(const float *x, Py_ssize_t x_rs, int r0, int nr, const float *w,
                           Py_ssize_t w_rs, const float *bias, float *out, Py_ssize_t o_rs,
                           int c0, int c1, int K, float *scratch)
    void ac_half_rows_f32(int fmt, const uint16_t *x, Py_ssize_t rs, int n, int D, float *out,
                          Py_ssize_t ldo)
    int ac_cpu_bf16_dot()
    void ac_bf16_linear_rows(int mode, const float *x, Py_ssize_t x_rs, int nr,
                             const uint16_t *w, Py_ssize_t w_rs, const float *bias,
                             float *out, Py_ssize_t o_rs, int c0, int c1, int K,
                             float *scratch)

# the kernel-path state lives in _sdpa (ac_common.h)
ac_state_attach(PyCapsule_Import("attncore._core._sdpa._kernel_state", 0))


def set_kernel_path(int path):
    """Select the float32 path (0 portable / BLAS, 1 AVX2, 2 AVX-512, -1
    the best); False if this CPU lacks it.  The same state as
    _sdpa.set_kernel_path (one home, ac_common.h).  Private."""
    return ac_set_kernel_path(path) == 0


cdef inline void _fused_item(int t, int nrb, int rstep, int cstep, const float *x,
                             Py_ssize_t x_rs, const float *w, Py_ssize_t w_rs,
                             const float *bias, float *out, Py_ssize_t o_rs, int R, int C,
                             int K, float *scratch) noexcept nogil:
    """Item t of _run_fused: one row block x one column block (column
    blocks outer: a thread's consecutive items share their rows of w)."""
    cdef int cb = t // nrb
    cdef int r0 = (t - cb * nrb) * rstep
    cdef int c0 = cb * cstep
    ac_linear_rows_f32(x, x_rs, r0, min(rstep, R - r0), w, w_rs, bias, out, o_rs,
                       c0, min(C, c0 + cstep), K, scratch)


cdef int _run_fused(const float *x, Py_ssize_t x_rs, const float *w, Py_ssize_t w_rs,
                    const float *bias, float *out, Py_ssize_t o_rs, int R, int C, int K,
                    int nthreads, Py_ssize_t wblock) noexcept nogil:
    """float32 without BLAS (x86 fused path): row panels x column blocks
    over the team.  wblock (0: none): weights of more than this many
    floats are taken in column blocks of at most that many, each over
    all the row panels, so that a block's rows of w stay in L2 instead of
    streaming from L3 for every panel (2048 x 1536 x 512, Xeon (Sapphire
    Rapids class), 2 MiB L2, blocks of 512 KiB / 1 MiB, 1 / 2 threads:
    AVX2 path 36.1 / 18.6 -> 30.8-31.2 / 16.6-16.8 ms, AVX-512 23.9 / 12.5
    -> 20.4-20.9 / 11.1-11.4; each block packs the row panels again, so
    much smaller blocks lose part of it: 128 KiB 6 % slower than 512 KiB).
    0 on success, -1 when scratch memory ran out."""
    cdef int P = ac_fused_panel_rows()
    cdef int rstep = R if R <= AC_LINEAR_SMALL else P
    cdef int nrb = (R + rstep - 1) // rstep
    cdef int ncb = 1, cstep, nitems, t, cw
    cdef float *scratch = NULL
    cdef int err = 0
    cdef int *errp = &err
    if nthreads > 1 and nrb < 2 * nthreads:
        ncb = min((2 * nthreads + nrb - 1) // nrb, (C + 63) // 64)
        ncb = max(ncb, 1)
    cstep = (C + ncb - 1) // ncb
    cstep = (cstep + 15) // 16 * 16
    if wblock > 0 and nrb > 1 and <Py_ssize_t>C * K > wblock:
        cw = max(64, <int>(wblock // max(K, 1)) // 16 * 16)
        if cw < cstep:
            cstep = cw
    ncb = (C + cstep - 1) // cstep
    nitems = nrb * ncb
    if nthreads <= 1 or nitems <= 1:
        scratch = <float *>malloc(AC_LINEAR_SCRATCH(K) * sizeof(float))
        if scratch == NULL:
            return -1
        for t in range(nitems):
            _fused_item(t, nrb, rstep, cstep, x, x_rs, w, w_rs, bias, out, o_rs, R, C, K,
                        scratch)
        free(scratch)
        return 0
    with parallel(num_threads=nthreads):
        scratch = <float *>malloc(AC_LINEAR_SCRATCH(K) * sizeof(float))
        if scratch == NULL:
            errp[0] = -1
        # every thread reaches the worksharing loop (one without scratch
        # skips its items; the call then raises)
        for t in prange(nitems, schedule='static'):
            if scratch != NULL:
                _fused_item(t, nrb, rstep, cstep, x, x_rs, w, w_rs, bias, out, o_rs, R, C, K,
                            scratch)
        free(scratch)
    return err

ctypedef fused floating:
    float
    double


cdef inline void _gemm_block(const floating *x, Py_ssize_t x_rs, const floating *w,
                             Py_ssize_t w_rs, const floating *bias, floating *out,
                             Py_ssize_t o_rs, int r0, int r1, int c0, int c1,
                             int K) noexcept nogil:
    """out[r0:r1, c0:c1] = x[r0:r1] @ w[c0:c1].T (+ bias[c0:c1])."""
    cdef char ta = b'T'
    cdef char tb = b'N'
    cdef int m = c1 - c0, n = r1 - r0, k = K
    cdef int lda = <int>w_rs, ldb = <int>x_rs, ldc = <int>o_rs
    cdef floating one = 1, beta = 0
    cdef Py_ssize_t r, c
    if m <= 0 or n <= 0:
        return
    if bias != NULL:
        for r in range(r0, r1):
            for c in range(c0, c1):
                out[r * o_rs + c] = bias[c]
        beta = 1
    if K == 0:
        if bias == NULL:
            for r in range(r0, r1):
                for c in range(c0, c1):
                    out[r * o_rs + c] = 0
        return
    cdef int inc = 1
    if n <= 2:
        # a row or two (decoding): gemv streams w once; gemm would first
        # copy (pack) all of w, which costs more than the product
        for r in range(r0, r1):
            if floating is float:
                sgemv(&ta, &k, &m, &one, <float *>(w + c0 * w_rs), &lda,
                      <float *>(x + r * x_rs), &inc, &beta, out + r * o_rs + c0, &inc)
            else:
                dgemv(&ta, &k, &m, &one, <double *>(w + c0 * w_rs), &lda,
                      <double *>(x + r * x_rs), &inc, &beta, out + r * o_rs + c0, &inc)
        return
    if floating is float:
        sgemm(&ta, &tb, &m, &n, &k, &one, <float *>(w + c0 * w_rs), &lda,
              <float *>(x + r0 * x_rs), &ldb, &beta, out + r0 * o_rs + c0, &ldc)
    else:
        dgemm(&ta, &tb, &m, &n, &k, &one, <double *>(w + c0 * w_rs), &lda,
              <double *>(x + r0 * x_rs), &ldb, &beta, out + r0 * o_rs + c0, &ldc)


cdef void _run(const floating *x, Py_ssize_t x_rs, const floating *w, Py_ssize_t w_rs,
               const floating *bias, floating *out, Py_ssize_t o_rs, int R, int C, int K,
               int nthreads) noexcept nogil:
    cdef int t, nblk, step
    cdef bint by_rows = R >= C
    if nthreads <= 1:
        ac_blas_hold()
        _gemm_block(x, x_rs, w, w_rs, bias, out, o_rs, 0, R, 0, C, K)
        ac_blas_release()
        return
    # blocks: a few per thread, at least 16 rows / 64 columns each
    if by_rows:
        step = max(16, (R + 2 * nthreads - 1) // (2 * nthreads))
        nblk = (R + step - 1) // step
    else:
        step = max(64, (C + 2 * nthreads - 1) // (2 * nthreads))
        step = (step + 15) // 16 * 16
        nblk = (C + step - 1) // step
    with parallel(num_threads=nthreads):
        ac_blas_hold()
        for t in prange(nblk, schedule='dynamic'):
            if by_rows:
                _gemm_block(x, x_rs, w, w_rs, bias, out, o_rs,
                            t * step, min(R, (t + 1) * step), 0, C, K)
            else:
                _gemm_block(x, x_rs, w, w_rs, bias, out, o_rs,
                            0, R, t * step, min(C, (t + 1) * step), K)
        ac_blas_release()


# columns of half weights converted at a time (for all the rows of x): at
# least _HCHUNK, and up to a thread's whole column block while the float32
# copy stays within _HCHUNK_FLOATS (512 KiB) or the fused path's weight
# block (linear's wblock) where that is larger, so that each panel of x is
# packed once per block instead of once per 64 columns (E 512 self-attention
# layer, bfloat16 / float16 weights, 2 threads: the projections 1.4-2x
# faster on an Intel Xeon whose 2 MiB L2 does not hold the 4 MiB of x)
cdef enum:
    _HCHUNK = 64
    _HCHUNK_FLOATS = 131072
    # many rows of x: up to this many float32 elements of w (4 MiB) are
    # converted at once, over the team, then multiplied like float32 weights
    # (_run_fused): each panel of x is packed once per such chunk
    _HWHOLE_FLOATS = 1048576
    _HWHOLE_ROWS = 64


cdef void _half_block(const float *x, Py_ssize_t x_rs, const uint16_t *w, Py_ssize_t w_rs,
                      int fmt, const float *bias, float *out, Py_ssize_t o_rs, int R,
                      int c0, int c1, int K, float *buf, float *scratch,
                      int bf16dot, int hc) noexcept nogil:
    """out[:, c0:c1] = x @ w[c0:c1].T (+ bias) for bfloat16 / float16 w:
    hc rows of w at a time are converted to float32 (buf) and serve
    every row of x (fused kernel, or a single-threaded gemm).  bf16dot (1
    vdpbf16ps, 2 its AVX-512F spelling): bfloat16 w read in place as pairs
    against panels of rows of x rounded to bfloat16 (buf: the packed panel
    and a tile, AC_BF16_LINEAR_SCRATCH(K) floats)."""
    cdef int cc = c0, n
    if bf16dot:
        ac_bf16_linear_rows(bf16dot, x, x_rs, R, w, w_rs, bias, out, o_rs, c0, c1, K, buf)
        return
    while cc < c1:
        n = min(hc, c1 - cc)
        ac_half_rows_f32(fmt, w + cc * w_rs, w_rs, n, K, buf, K)
        if ac_kernel_path != AC_PATH_PORTABLE:
            ac_linear_rows_f32(x, x_rs, 0, R, buf, K, bias + cc if bias != NULL else NULL,
                               out + cc, o_rs, 0, n, K, scratch)
        else:
            _gemm_block(x, x_rs, <const float *>buf, K, bias + cc if bias != NULL else NULL,
                        out + cc, o_rs, 0, R, 0, n, K)
        cc += n


cdef int _run_half_whole(const float *x, Py_ssize_t x_rs, const uint16_t *w,
                         Py_ssize_t w_rs, int fmt, const float *bias, float *out,
                         Py_ssize_t o_rs, int R, int C, int K, int nthreads,
                         Py_ssize_t wblock) noexcept nogil:
    """float32 x (at least _HWHOLE_ROWS rows) with half weights: chunks
    of w converted to float32 over the team, each then multiplied as
    float32 weights are (_run_fused), so the layer runs at the float32
    layer's rate plus one conversion pass.  (With each thread converting
    and multiplying its own column blocks, every panel of x is packed once
    per block chunk, 8 times for the E 512 self-attention layer's input
    projection at 2 threads: that layer, bfloat16, AVX2 path, 34.1-34.6 ->
    33.3-33.4 ms.)  0 on success, -1 when memory ran out."""
    cdef int chunk = C
    cdef int c0, n, nb, t
    cdef int err = 0
    cdef float *buf
    if <Py_ssize_t>C * K > _HWHOLE_FLOATS:
        chunk = max(<int>_HCHUNK, <int>(_HWHOLE_FLOATS // max(K, 1)) // 16 * 16)
    buf = <float *>malloc((<Py_ssize_t>chunk * K + 16) * sizeof(float))
    if buf == NULL:
        return -1
    c0 = 0
    while c0 < C and err == 0:
        n = min(chunk, C - c0)
        nb = (n + _HCHUNK - 1) // _HCHUNK
        if nthreads > 1 and nb > 1:
            for t in prange(nb, num_threads=nthreads, schedule='static'):
                ac_half_rows_f32(fmt, w + (c0 + t * _HCHUNK) * w_rs, w_rs,
                                 min(<int>_HCHUNK, n - t * _HCHUNK), K,
                                 buf + <Py_ssize_t>t * _HCHUNK * K, K)
        else:
            ac_half_rows_f32(fmt, w + c0 * w_rs, w_rs, n, K, buf, K)
        err = _run_fused(x, x_rs, buf, K, bias + c0 if bias != NULL else NULL, out + c0,
                         o_rs, R, n, K, nthreads, wblock)
        c0 += n
    free(buf)
    return err


cdef int _run_half(const float *x, Py_ssize_t x_rs, const uint16_t *w, Py_ssize_t w_rs,
                   int fmt, const float *bias, float *out, Py_ssize_t o_rs, int R, int C,
                   int K, int nthreads, int bf16dot, Py_ssize_t wblock) noexcept nogil:
    """float32 x with half weights read in place: column blocks over the
    team (many rows of x: _run_half_whole).  0 on success, -1 when scratch
    memory ran out."""
    cdef Py_ssize_t nbuf
    cdef int step, nblk, t, hc
    cdef float *buf = NULL
    cdef int err = 0
    cdef int *errp = &err
    # (one thread: the blocks below, whose converted rows stay in L2 for
    # all of x, are 3-5 % faster than converting first: E 512 layer, AVX2)
    if (not bf16dot and nthreads > 1 and R >= _HWHOLE_ROWS
            and ac_kernel_path != AC_PATH_PORTABLE):
        return _run_half_whole(x, x_rs, w, w_rs, fmt, bias, out, o_rs, R, C, K, nthreads,
                               wblock)
    step = (C + 2 * nthreads - 1) // (2 * nthreads) if nthreads > 1 else C
    step = max(_HCHUNK, (step + _HCHUNK - 1) // _HCHUNK * _HCHUNK)
    nblk = (C + step - 1) // step
    # (a few rows -- decoding -- pack no panel: 64 columns at a time)
    # (float32 copies of up to a weight block of the fused path: each
    # chunk packs the panels of x again)
    hc = <int>min(<Py_ssize_t>step, max(<Py_ssize_t>_HCHUNK,
                                        max(<Py_ssize_t>_HCHUNK_FLOATS, wblock)
                                        // max(K, 1) // 16 * 16))
    if R <= AC_LINEAR_SMALL:
        hc = min(step, <int>_HCHUNK)
    nbuf = max(<Py_ssize_t>hc * K + AC_LINEAR_SCRATCH(K), AC_BF16_LINEAR_SCRATCH(K)) + 16
    if nthreads <= 1 or nblk <= 1:
        buf = <float *>malloc(nbuf * sizeof(float))
        if buf == NULL:
            return -1
        ac_blas_hold()
        _half_block(x, x_rs, w, w_rs, fmt, bias, out, o_rs, R, 0, C, K, buf,
                    buf + <Py_ssize_t>hc * K, bf16dot, hc)
        ac_blas_release()
        free(buf)
        return 0
    with parallel(num_threads=nthreads):
        buf = <float *>malloc(nbuf * sizeof(float))
        if buf == NULL:
            errp[0] = -1
        ac_blas_hold()
        for t in prange(nblk, schedule='static'):
            if buf != NULL:
                _half_block(x, x_rs, w, w_rs, fmt, bias, out, o_rs, R, t * step,
                            min(C, (t + 1) * step), K, buf, buf + <Py_ssize_t>hc * K, bf16dot,
                            hc)
        ac_blas_release()
        free(buf)
    return err


cdef inline Py_ssize_t _rs(Py_buffer *b, int cols) noexcept nogil:
    """Row stride in elements, valid as a BLAS leading dimension."""
    cdef Py_ssize_t rs
    if b.shape[0] <= 1:
        return max(cols, 1)
    rs = b.strides[0] // b.itemsize
    return rs if rs >= max(cols, 1) else max(cols, 1)


def set_blas_local(tuple addresses):
    """Install the BLAS libraries' thread-local thread-count setters."""
    set_blas_local_fns(addresses)


def linear(x, w, bias, out, int nthreads, int w_fmt=0, int bf16dot=0,
           Py_ssize_t wblock=0):
    """out[...] = x @ w.T (+ bias), on ``nthreads`` OpenMP threads.

    w_fmt: 0 when w has x's dtype; 1 (bfloat16) / 2 (float16) for 16-bit
    weights read in place with float32 x, bias and out (passed as uint16 /
    float16 arrays).  bf16dot (bfloat16 w, the AVX-512 path, more than
    AC_LINEAR_SMALL rows, K and w's row stride even; else ignored):
    bfloat16 products, 1 vdpbf16ps (the CPU must have AVX512_BF16), 2 the
    same arithmetic in AVX-512F (tests).  wblock: bytes of float32
    weights (converted ones for 16-bit w) per column block of the fused
    path (about half an L2; 0: one block).

    x: (R, K), w: (C, K), out: (R, C), all of one dtype (float32 / float64)
    with contiguous rows; bias: None or a contiguous (C,) array.  The caller
    ``nthreads`` must be 1 when the BLAS path (float64, or float32 without
    AVX2) would run on threads whose BLAS cannot be held to one thread
    (attncore._threads.blas_parallel_threads).  The float32 path on x86
    calls no BLAS.
    """
    cdef _Buffers bufs
    cdef Py_buffer *bx
    cdef Py_buffer *bw
    cdef Py_buffer *bo
    cdef Py_buffer *bb = NULL
    cdef bint have_b
    cdef int R, C, K
    cdef int err = 0
    bufs.n = 0
    try:
        bx = _acquire(&bufs, x, PyBUF_RECORDS_RO)
        bw = _acquire(&bufs, w, PyBUF_RECORDS_RO)
        bo = _acquire(&bufs, out, PyBUF_RECORDS)
        if bias is not None:
            bb = _acquire(&bufs, bias, PyBUF_RECORDS_RO)
        have_b = bb != NULL
        if bx.ndim != 2 or bw.ndim != 2 or bo.ndim != 2:
            raise ValueError("linear: x, w and out must be 2-D")
        R = <int>bx.shape[0]
        K = <int>bx.shape[1]
        C = <int>bw.shape[0]
        if bw.shape[1] != K or bo.shape[0] != R or bo.shape[1] != C:
            raise ValueError(f"linear: x (R, K), w (C, K) and out (R, C) do not match: x "
                             f"{(bx.shape[0], bx.shape[1])}, w {(bw.shape[0], bw.shape[1])}, "
                             f"out {(bo.shape[0], bo.shape[1])}")
        if have_b and (bb.ndim != 1 or bb.shape[0] != C):
            raise ValueError(f"linear: bias must have shape ({C},), got "
                             f"{tuple([bb.shape[i] for i in range(bb.ndim)])}")
        if (bw.itemsize != (2 if w_fmt else bx.itemsize) or bx.itemsize != bo.itemsize
                or (w_fmt and bx.itemsize != 4) or w_fmt not in (0, 1, 2)
                or (have_b and bb.itemsize != bx.itemsize)):
            raise TypeError("linear: x, w, bias and out must share one dtype")
        if ((K > 1 and (bx.strides[1] != bx.itemsize or bw.strides[1] != bw.itemsize))
                or (C > 1 and bo.strides[1] != bo.itemsize)
                or (have_b and C > 1 and bb.strides[0] != bb.itemsize)):
            raise ValueError("linear: rows must be contiguous")
        if R == 0 or C == 0:
            return
        if bf16dot not in (0, 1, 2) or (bf16dot == 1 and not ac_cpu_bf16_dot()):
            raise ValueError("linear: invalid bf16dot")
        if (w_fmt != 1 or ac_kernel_path != AC_PATH_AVX512 or R <= AC_LINEAR_SMALL or K % 2
                or _rs(bw, K) % 2):
            bf16dot = 0
        if w_fmt:
            with nogil:
                err = _run_half(<const float *>bx.buf, _rs(bx, K), <const uint16_t *>bw.buf,
                                _rs(bw, K), w_fmt, <const float *>bb.buf if have_b else NULL,
                                <float *>bo.buf, _rs(bo, C), R, C, K, nthreads, bf16dot,
                                wblock // 4)
            if err:
                raise MemoryError("attncore: could not allocate the kernel's scratch memory")
        elif bx.itemsize == 4 and ac_kernel_path != AC_PATH_PORTABLE:
            with nogil:
                err = _run_fused(<const float *>bx.buf, _rs(bx, K), <const float *>bw.buf,
                                 _rs(bw, K), <const float *>bb.buf if have_b else NULL,
                                 <float *>bo.buf, _rs(bo, C), R, C, K, nthreads, wblock // 4)
            if err:
                raise MemoryError("attncore: could not allocate the kernel's scratch memory")
        elif bx.itemsize == 4:
            with nogil:
                _run(<const float *>bx.buf, _rs(bx, K), <const float *>bw.buf, _rs(bw, K),
                     <const float *>bb.buf if have_b else NULL, <float *>bo.buf,
                     _rs(bo, C), R, C, K, nthreads)
        elif bx.itemsize == 8:
            with nogil:
                _run(<const double *>bx.buf, _rs(bx, K), <const double *>bw.buf, _rs(bw, K),
                     <const double *>bb.buf if have_b else NULL, <double *>bo.buf,
                     _rs(bo, C), R, C, K, nthreads)
        else:
            raise TypeError("linear: float32 or float64 expected")
    finally:
        _release_all(&bufs)
