/*
 * ac_common.h -- declarations shared by the attncore C kernels.
 *
 * gemm pointer types matching scipy.linalg.cython_blas (the Cython drivers
 * pass sgemm / dgemm in, so nothing links a BLAS), and AC_CLONES, which
 * compiles a kernel for AVX-512 (x86-64-v4), AVX2+FMA (x86-64-v3) and the
 * baseline, picked once at load time by the dynamic linker (GCC >= 11 on
 * x86-64 Linux; elsewhere one baseline build).  Cloned kernels are noinline
 * so the vectorizer sees each loop in its clone's target.
 */
#ifndef AC_COMMON_H
#define AC_COMMON_H

typedef void (*ac_sgemm_t)(char *, char *, int *, int *, int *, float *,
                           float *, int *, float *, int *, float *, float *,
                           int *);
typedef void (*ac_dgemm_t)(char *, char *, int *, int *, int *, double *,
                           double *, int *, double *, int *, double *,
                           double *, int *);

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && \
    (__GNUC__ >= 11) && defined(__linux__) && !defined(AC_NO_CLONES)
#define AC_CLONES __attribute__((noinline, target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define AC_CLONES
#endif

#endif /* AC_COMMON_H */
