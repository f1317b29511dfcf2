/*
 * ac_common.h -- declarations shared by the attncore C kernels.
 *
 * - gemm pointer types matching scipy.linalg.cython_blas (the Cython
 *   drivers pass sgemm / dgemm in, so nothing links a BLAS);
 * - the kernel-path state, with one home for the whole package;
 * - the compiled variants of the loops that rely on the vectorizer.
 *
 * Kernel paths.  AC_PATH_AVX512 / AC_PATH_AVX2 / AC_PATH_PORTABLE: picked at
 * import for the best instruction set the CPU runs, and forced by the tests
 * (attncore._core._sdpa.set_kernel_path) so that one machine runs them all.
 * The state lives in the _sdpa extension; every other extension includes
 * this header too but points ac_state at _sdpa's copy when it is imported
 * (ac_state_attach, through the capsule attncore._core._sdpa._kernel_state),
 * so one call forces the path of every kernel.
 *
 * The target attributes, the CPU features and the dispatch of the compiled
 * variants (one body, a function per instruction set) are in ac_cpu.h.
 */
#ifndef AC_COMMON_H
#define AC_COMMON_H

/* The kernels need IEEE inf and NaN: the masked softmax's -inf, the
 * output check's x - x (NaN exactly for inf / NaN).  -ffast-math or
 * -ffinite-math-only (in CFLAGS, or a compiler's default fast model)
 * would fold them away silently. */
#if defined(__FINITE_MATH_ONLY__) && __FINITE_MATH_ONLY__
#error "attncore's kernels need IEEE inf / NaN: build without -ffast-math / -ffinite-math-only"
#endif

typedef void (*ac_sgemm_t)(char *, char *, int *, int *, int *, float *,
                           float *, int *, float *, int *, float *, float *,
                           int *);
typedef void (*ac_dgemm_t)(char *, char *, int *, int *, int *, double *,
                           double *, int *, double *, int *, double *,
                           double *, int *);

/* kernel paths: the portable loops + BLAS, AVX2 + FMA, AVX-512; on
   aarch64, NEON (ac_cpu.h: the small-row decode body on NEON, everything
   else the portable path's code -- ac_kernel_path stays AC_PATH_PORTABLE
   there and ac_neon_on says whether the NEON body is on; AC_PATH_NEON is
   the code _sdpa._PATHS names it by, and the code ac_set_kernel_path
   takes) */
enum { AC_PATH_PORTABLE = 0, AC_PATH_AVX2 = 1, AC_PATH_AVX512 = 2, AC_PATH_NEON = 3 };

/* kernels whose variants ac_state->ran records (bits AC_VAR_BITS * kernel
   + variant) */
enum { AC_K_SDPA = 0, AC_K_WEIGHTS = 1, AC_K_EXP = 2, AC_K_ADDITIVE = 3, AC_K_ROTARY = 4,
       AC_K_COUNT = 5 };
#define AC_VAR_BITS 4

typedef struct {
    int best_path;   /* the best path this CPU runs                      */
    int kernel_path; /* the one in use                                   */
    int avx512_ok;   /* small-row AVX-512 loops on                       */
    unsigned ran;    /* compiled variants dispatched since the last reset */
    int pf_l2_rows;  /* small-row loops: rows of at least this many bytes
                        prefetched into L2 only (0: none; ac_small.h)     */
    unsigned cpu_mask; /* CPU features taken as absent (AC_F_* bits of
                          ac_cpu.h; ATTNCORE_CPU_FEATURES, read once at
                          import by the _sdpa extension)                  */
    int neon_on;     /* aarch64: the small-row decode body on NEON (the
                        neon path); 0 elsewhere                          */
} ac_state_t;

/* llvm-mca regions (bench/mca.py): assembler comments around the hot
 * loops, emitted only by a build with -DAC_MCA (bench/mca.py compiles the
 * kernels to assembly itself); empty in every other build, so the shipped
 * object code does not change.  A region names the loop right after
 * AC_MCA_BEGIN; the tool models that loop's body. */
#if defined(AC_MCA) && defined(__GNUC__)
#if defined(__aarch64__)
#define AC_MCA_BEGIN(name) __asm__ volatile("// LLVM-MCA-BEGIN " name)
#define AC_MCA_END(name) __asm__ volatile("// LLVM-MCA-END " name)
#else
#define AC_MCA_BEGIN(name) __asm__ volatile("# LLVM-MCA-BEGIN " name)
#define AC_MCA_END(name) __asm__ volatile("# LLVM-MCA-END " name)
#endif
#else
#define AC_MCA_BEGIN(name) ((void)0)
#define AC_MCA_END(name) ((void)0)
#endif

#if defined(__GNUC__)
#define AC_UNUSED __attribute__((unused))
#else
#define AC_UNUSED
#endif

/* this extension's copy, and the one in use (the _sdpa extension's once
   ac_state_attach has run) */
static AC_UNUSED ac_state_t ac_state_own = {AC_PATH_PORTABLE, AC_PATH_PORTABLE, 0, 0u, 0, 0u, 0};
static AC_UNUSED ac_state_t *ac_state = &ac_state_own;
#define ac_best_path (ac_state->best_path)
#define ac_kernel_path (ac_state->kernel_path)
#define ac_avx512_ok (ac_state->avx512_ok)
#define ac_pf_l2_rows (ac_state->pf_l2_rows)
#define ac_cpu_mask (ac_state->cpu_mask)
#define ac_neon_on (ac_state->neon_on)

static AC_UNUSED void *ac_state_home(void) { return (void *)&ac_state_own; }
static AC_UNUSED void ac_state_attach(void *home)
{
    if (home) ac_state = (ac_state_t *)home;
}

#endif /* AC_COMMON_H */
