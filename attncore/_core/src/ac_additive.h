/*
 * ac_additive.h -- fused additive (Bahdanau / "concat" / MLP) attention.
 *
 *   score[t, s] = sum_a v[a] * tanh(qp[t, a] + kp[s, a])
 *   weights     = masked softmax over s
 *   out[t, :]   = sum_s weights[t, s] * values[s, :]
 *
 * qp = W_q q and kp = W_k k + bias are projected by the caller (BLAS, once
 * per memory for the keys); this file never materializes the (T, S, A)
 * tensor: each score is one vectorized reduction over A, either of tanh
 * (the rational ac_tanhf / exp-based ac_tanh below) or, in the factored
 * form, of one division per term:
 *   tanh(x + y) = 1 - 2 / (1 + e^{2x} e^{2y})
 * with e^{2x} per query row and e^{2y} per key precomputed by the caller
 * (used while |x|, |y| are small enough for the product to stay finite).
 *
 * The Cython driver (_additive.pyx) splits the work into (batch element,
 * query block) items, hands every OpenMP thread its own scratch and calls
 * ac_additive_block_* without the GIL.  These functions never allocate,
 * never touch Python and never start threads (BLAS is kept single-threaded
 * by the caller while they run).
 *
 * Masked keys are skipped entirely (no tanh work); a query row whose keys
 * are all masked gets weights 0 and output 0 (decided from the mask, not from
 * score values); a NaN score makes its whole row NaN, as a plain softmax
 * would.  Values of masked keys are never read, so NaN there cannot leak.
 */
#ifndef AC_ADDITIVE_H
#define AC_ADDITIVE_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <math.h>
#include "ac_cpu.h"
#include "ac_math.h"

/* ------------------------------------------------------------------ tanh */
/*
 * float: odd rational approximation tanh(x) ~ x P(x^2) / Q(x^2), degree 4
 * over 4 in x^2, fitted for attncore (iteratively reweighted linearized
 * least squares on [0, 7.9], relative error 6e-9 in exact arithmetic; about
 * 6 ulp once evaluated in float).  |x| > 7.9 saturates to exactly +-1
 * (tanh(7.9) is within 3e-7 of 1); NaN propagates (it fails every
 * comparison, so the clamps and selects let it through).
 */
AC_INLINE float ac_tanhf(float x)
{
    const float c = 7.9f;
    float xc = x > c ? c : x;
    xc = xc < -c ? -c : xc;
    float u = xc * xc;
    float p = AC_HORNER4(1.5428592320398948e-08f, u, 2.2023682486849942e-05f,
                         3.5790184776559931e-03f, 1.3450642865407042e-01f,
                         9.9999999438734477e-01f);
    float q = AC_HORNER4(8.5990301635849309e-07f, u, 3.4236938549199437e-04f,
                         2.6192338610343875e-02f, 4.6783970881006676e-01f, 1.0f);
    float r = (xc * p) / q;
    r = x > c ? 1.0f : r;
    r = x < -c ? -1.0f : r;
    return r;
}

/*
 * double: tanh(|x|) = (1 - e) / (1 + e) with e = exp(-2|x|) from the
 * kernels' exp; absolute error about 2e-16 (what an attention score, a sum
 * of v[a] tanh(...), needs), exactly +-1 for |x| > 19.1, NaN propagates.
 */
AC_INLINE double ac_tanh(double x)
{
    double ax = x < 0 ? -x : x;
    double e = ac_exp(-2.0 * ax);
    double r = (1.0 - e) / (1.0 + e);
    r = ax > 19.1 ? 1.0 : r;
    return copysign(r, x);
}

/* y[i] = tanh(x[i]) with the kernel's own tanh (the accuracy tests) */
static AC_UNUSED void ac_tanh_array_f32(const float *x, float *y, ptrdiff_t n)
{
    for (ptrdiff_t i = 0; i < n; i++) y[i] = ac_tanhf(x[i]);
}

static AC_UNUSED void ac_tanh_array_f64(const double *x, double *y, ptrdiff_t n)
{
    for (ptrdiff_t i = 0; i < n; i++) y[i] = ac_tanh(x[i]);
}

typedef struct {
    int M;                 /* keys per batch element                     */
    int A;                 /* attention (hidden) size                    */
    int Dv;                /* value dimension                            */
    ptrdiff_t qp_rs;       /* row stride of qp (elements)                */
    ptrdiff_t kp_rs;       /* row stride of kp                           */
    ptrdiff_t val_rs;      /* row stride of values                       */
    ptrdiff_t w_rs;        /* row stride of the weights rows W           */
    ptrdiff_t o_rs;        /* row stride of out                          */
} ac_add_params;

#define AC_T float
#define AC_SUF f32
#define AC_TANH ac_tanhf
#define AC_EXP ac_expf
#define AC_GEMM_T ac_sgemm_t
#include "ac_additive_impl.inc"

#define AC_T double
#define AC_SUF f64
#define AC_TANH ac_tanh
#define AC_EXP ac_exp
#define AC_GEMM_T ac_dgemm_t
#include "ac_additive_impl.inc"

#endif /* AC_ADDITIVE_H */
