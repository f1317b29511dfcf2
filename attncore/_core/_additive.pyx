# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Fused additive (Bahdanau / MLP / "concat") attention: the compiled driver.

Private.  ``attncore._alignment_layer`` projects queries and keys with BLAS
(keys once per memory), validates and lays out the arrays; this module
splits the work into (batch element, query block) items over an OpenMP
``prange`` and, per item, runs ``src/ac_additive.h`` without the GIL:

    score[t, s] = sum_a v[a] tanh(qp[t, a] + kp[s, a])   (vectorized over A;
                  or, factored, sum_a -2 v[a] / (1 + e^{2 qp} e^{2 kp}),
                  the same up to a constant per row)
    weights     = masked softmax over s
    out[t, :]   = weights[t, :] @ values                 (gemm, or a sparse
                                                          loop when keys are masked)

No (T, S, A) temporary exists: scratch is one (Bq, S) weights block and S
ints per thread.
"""
from cpython.pycapsule cimport PyCapsule_Import
from cython.parallel cimport prange, parallel
from libc.stdlib cimport malloc, free
from libc.stdint cimport uint8_t
from scipy.linalg.cython_blas cimport sgemm, dgemm

from attncore._core._blas cimport ac_sgemm_t, ac_dgemm_t
from attncore._core._elementwise cimport _map_array
from attncore._core._openmp cimport ac_blas_hold, ac_blas_release, set_blas_local_fns

ctypedef fused floating:
    float
    double

cdef extern from "ac_additive.h" nogil:
    ctypedef struct ac_add_params:
        int M, A, Dv
        Py_ssize_t qp_rs, kp_rs, val_rs, w_rs, o_rs

    void ac_additive_block_f32(const ac_add_params *p, const float *qp, int nq,
                               const float *kp, const float *v, const uint8_t *mask,
                               const float *values, float *W, float *out, int *idx,
                               int factored, ac_sgemm_t gemm)
    void ac_additive_block_f64(const ac_add_params *p, const double *qp, int nq,
                               const double *kp, const double *v, const uint8_t *mask,
                               const double *values, double *W, double *out, int *idx,
                               int factored, ac_dgemm_t gemm)
    void ac_tanh_array_f32(const float *x, float *y, Py_ssize_t n)
    void ac_tanh_array_f64(const double *x, double *y, Py_ssize_t n)
    void ac_state_attach(void *home)


# the kernel-path state lives in _sdpa (ac_common.h)
ac_state_attach(PyCapsule_Import("attncore._core._sdpa._kernel_state", 0))


cdef struct _Ops:
    const void *qp
    const void *kp
    const void *v
    const uint8_t *mask
    const void *values
    void *out
    void *w
    Py_ssize_t T, Bq
    Py_ssize_t kp_bs, val_bs, mask_bs
    int factored


cdef inline void _item(const ac_add_params *p, const _Ops *ops, Py_ssize_t it,
                       Py_ssize_t nqb, floating *scratch, int *idx) noexcept nogil:
    cdef Py_ssize_t b = it // nqb
    cdef Py_ssize_t i0 = (it - b * nqb) * ops.Bq
    cdef int nq = <int>(ops.T - i0 if ops.T - i0 < ops.Bq else ops.Bq)
    cdef const floating *qp = (<const floating *>ops.qp) + (b * ops.T + i0) * p.A
    cdef const floating *kp = (<const floating *>ops.kp) + b * ops.kp_bs
    cdef const floating *values = (<const floating *>ops.values) + b * ops.val_bs
    cdef const uint8_t *mask = NULL
    cdef floating *out = (<floating *>ops.out) + (b * ops.T + i0) * p.Dv
    cdef floating *W = scratch
    if ops.mask != NULL:
        mask = ops.mask + b * ops.mask_bs
    if ops.w != NULL:
        W = (<floating *>ops.w) + (b * ops.T + i0) * p.M
    if floating is float:
        ac_additive_block_f32(p, qp, nq, kp, <const float *>ops.v, mask, values, W, out,
                              idx, ops.factored, <ac_sgemm_t>sgemm)
    else:
        ac_additive_block_f64(p, qp, nq, kp, <const double *>ops.v, mask, values, W, out,
                              idx, ops.factored, <ac_dgemm_t>dgemm)


cdef int _run(const ac_add_params *p, const _Ops *ops, Py_ssize_t nb, int nthreads,
              floating dummy) noexcept nogil:
    """0 on success, -1 when scratch memory ran out."""
    cdef Py_ssize_t nqb = (ops.T + ops.Bq - 1) // ops.Bq
    cdef Py_ssize_t items = nb * nqb
    cdef Py_ssize_t nw = ops.Bq * p.M if ops.w == NULL else 0
    cdef floating *scratch = NULL
    cdef int *idx = NULL
    cdef int err = 0
    cdef int *errp = &err
    cdef Py_ssize_t it
    if nthreads <= 1 or items <= 1:
        scratch = <floating *>malloc((nw + 1) * sizeof(floating))
        idx = <int *>malloc((p.M + 1) * sizeof(int))
        if scratch == NULL or idx == NULL:
            err = -1
        else:
            ac_blas_hold()
            for it in range(items):
                _item(p, ops, it, nqb, scratch, idx)
            ac_blas_release()
        free(scratch)
        free(idx)
    else:
        with parallel(num_threads=nthreads):
            scratch = <floating *>malloc((nw + 1) * sizeof(floating))
            idx = <int *>malloc((p.M + 1) * sizeof(int))
            if scratch == NULL or idx == NULL:
                errp[0] = -1
            # every thread reaches the worksharing loop (one without scratch
            # skips its items; the call then raises)
            ac_blas_hold()
            for it in prange(items, schedule='dynamic'):
                if scratch != NULL and idx != NULL:
                    _item(p, ops, it, nqb, scratch, idx)
            ac_blas_release()
            free(scratch)
            free(idx)
    return err


def set_blas_local(tuple addresses):
    """Install the BLAS libraries' thread-local thread-count setters."""
    set_blas_local_fns(addresses)


def additive_attention(const floating[:, :, ::1] qp, const floating[:, :, ::1] kp,
                       const floating[::1] v, const uint8_t[:, ::1] mask,
                       const floating[:, :, ::1] values, floating[:, :, ::1] out,
                       floating[:, :, ::1] weights, int block, int nthreads,
                       bint factored=False):
    """Masked additive attention on projected operands (see the module doc).

    qp: (nb, T, A) projected queries (bias included).  kp: (nbk, M, A)
    projected keys, nbk in (1, nb).  v: (A,).  mask: None or (nbk, M) bytes,
    nonzero = take part.  values: (nbk, M, Dv).  out: (nb, T, Dv), written.
    weights: None or (nb, T, M), written.  block: query rows per work item.
    All of one dtype (float32 or float64), C-contiguous.
    factored: qp, kp, v hold exp(2 qp), exp(2 kp), -2 v instead (the
    division-only form of the scores; valid while exp(2 qp) exp(2 kp) stays
    finite).
    """
    cdef ac_add_params p
    cdef _Ops ops
    cdef Py_ssize_t nb = qp.shape[0]
    cdef int err = 0
    if kp.shape[0] not in (1, nb) or values.shape[0] != kp.shape[0]:
        raise ValueError("batch sizes of qp / kp / values disagree")
    if kp.shape[2] != qp.shape[2] or v.shape[0] != qp.shape[2]:
        raise ValueError("attention sizes of qp / kp / v disagree")
    if values.shape[1] != kp.shape[1] or out.shape[0] != nb or out.shape[1] != qp.shape[1] \
            or out.shape[2] != values.shape[2]:
        raise ValueError("out / values shapes disagree")
    if mask is not None and (mask.shape[0] != kp.shape[0] or mask.shape[1] != kp.shape[1]):
        raise ValueError("mask shape disagrees")
    if weights is not None and (weights.shape[0] != nb or weights.shape[1] != qp.shape[1]
                                or weights.shape[2] != kp.shape[1]):
        raise ValueError("weights shape disagrees")
    if nb == 0 or qp.shape[1] == 0:
        return
    p.M = <int>kp.shape[1]
    p.A = <int>qp.shape[2]
    p.Dv = <int>values.shape[2]
    p.qp_rs = p.A
    p.kp_rs = p.A
    p.val_rs = p.Dv
    p.w_rs = p.M
    p.o_rs = p.Dv
    ops.T = qp.shape[1]
    ops.factored = 1 if factored else 0
    ops.Bq = block if block >= 1 else 1
    ops.qp = &qp[0, 0, 0]
    ops.kp = &kp[0, 0, 0] if p.M > 0 and p.A > 0 else NULL
    ops.v = &v[0] if p.A > 0 else NULL
    ops.values = &values[0, 0, 0] if p.M > 0 and p.Dv > 0 else NULL
    ops.out = &out[0, 0, 0] if p.Dv > 0 else NULL
    ops.w = &weights[0, 0, 0] if weights is not None and p.M > 0 else NULL
    ops.mask = &mask[0, 0] if mask is not None and p.M > 0 else NULL
    ops.kp_bs = p.M * p.A if kp.shape[0] > 1 else 0
    ops.val_bs = p.M * p.Dv if values.shape[0] > 1 else 0
    ops.mask_bs = p.M if mask is not None and mask.shape[0] > 1 else 0
    if p.M == 0 or p.Dv == 0 or p.A == 0:
        raise ValueError("additive_attention needs M, A and Dv >= 1")
    with nogil:
        if floating is float:
            err = _run(&p, &ops, nb, nthreads, <float>0)
        else:
            err = _run(&p, &ops, nb, nthreads, <double>0)
    if err:
        raise MemoryError("attncore: could not allocate the additive kernel's scratch memory")


def tanh_array(x):
    """Elementwise tanh with the kernels' own tanh (float32 / float64, 1-D).

    Exposed for the accuracy tests only.
    """
    return _map_array(x, "tanh_array", ac_tanh_array_f32, ac_tanh_array_f64)
