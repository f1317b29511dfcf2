# The BLAS gemm pointer types the C kernels take (cimport this file).
#
# The kernels call gemm through a pointer so that they never link BLAS
# themselves: the drivers pass scipy.linalg.cython_blas's sgemm / dgemm,
# cast to these types.  The C typedefs live in src/ac_common.h.
cdef extern from "ac_common.h" nogil:
    ctypedef void (*ac_sgemm_t)(char *, char *, int *, int *, int *, float *, float *, int *,
                                float *, int *, float *, float *, int *) noexcept nogil
    ctypedef void (*ac_dgemm_t)(char *, char *, int *, int *, int *, double *, double *, int *,
                                double *, int *, double *, double *, int *) noexcept nogil
