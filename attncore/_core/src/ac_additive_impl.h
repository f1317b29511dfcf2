/*
 * ac_additive_impl.h -- body of the additive-attention kernels, included
 * once per dtype by ac_additive.h with AC_T, AC_SUF, AC_TANH, AC_EXP and
 * AC_GEMM_T defined.  Not a standalone header.
 */
#define AC_ADD_CAT2(a, b) a##_##b
#define AC_ADD_CAT(a, b) AC_ADD_CAT2(a, b)
#define AC_ADD_FN(name) AC_ADD_CAT(name, AC_SUF)

/* the compiled variants (ac_common.h): one body, three targets */
#define AC_VAR portable
#define AC_VTGT AC_VTGT_PORTABLE
#include "ac_additive_variant.h"
#undef AC_VAR
#undef AC_VTGT
#if AC_HAVE_X86
#define AC_VAR avx2
#define AC_VTGT AC_VTGT_AVX2
#include "ac_additive_variant.h"
#undef AC_VAR
#undef AC_VTGT
#define AC_VAR avx512
#define AC_VTGT AC_VTGT_AVX512
#include "ac_additive_variant.h"
#undef AC_VAR
#undef AC_VTGT
/* call the variant v of `name` with `args` */
#define AC_ADD_VCALL(v, name, args)                                              \
    do {                                                                         \
        if ((v) == AC_PATH_AVX512) AC_ADD_FN(name##_avx512) args;                \
        else if ((v) == AC_PATH_AVX2) AC_ADD_FN(name##_avx2) args;               \
        else AC_ADD_FN(name##_portable) args;                                    \
    } while (0)
#else
#define AC_ADD_VCALL(v, name, args) AC_ADD_FN(name##_portable) args
#endif

/*
 * One work item: nq query rows of one batch element.
 *   qp     nq x A projected queries, row stride p->qp_rs
 *   kp     M x A projected keys (bias included), row stride p->kp_rs
 *   factored  0: qp, kp, v as above (tanh form); 1: qp = exp(2 qp),
 *          kp = exp(2 kp), v = -2 v (the factored form, see above)
 *   mask   M bytes (nonzero = take part) or NULL
 *   values M x Dv
 *   W      nq x M weights rows (row stride p->w_rs): the caller's weights
 *          output or per-thread scratch
 *   out    nq x Dv context rows (row stride p->o_rs)
 *   idx    scratch for M ints
 */
static void AC_ADD_FN(ac_additive_block)(const ac_add_params *p, const AC_T *qp, int nq,
                                         const AC_T *kp, const AC_T *v,
                                         const uint8_t *mask, const AC_T *values,
                                         AC_T *W, AC_T *out, int *idx,
                                         int factored, AC_GEMM_T gemm)
{
    const int M = p->M, Dv = p->Dv;
    int nvalid = 0;
    if (mask) {
        for (int j = 0; j < M; j++)
            if (mask[j])
                idx[nvalid++] = j;
    } else {
        for (int j = 0; j < M; j++)
            idx[j] = j;
        nvalid = M;
    }
    if (nvalid < M) {
        for (int i = 0; i < nq; i++)
            memset(W + i * p->w_rs, 0, (size_t)M * sizeof(AC_T));
    }
    if (nvalid == 0) {
        for (int i = 0; i < nq; i++)
            memset(out + i * p->o_rs, 0, (size_t)Dv * sizeof(AC_T));
        return;
    }
    const int var = ac_variant(AC_K_ADDITIVE);
    (void)var;
    if (factored)
        AC_ADD_VCALL(var, ac_add_scores_exp,
                     (qp, p->qp_rs, nq, kp, p->kp_rs, idx, nvalid, v, p->A, W, p->w_rs));
    else
        AC_ADD_VCALL(var, ac_add_scores,
                     (qp, p->qp_rs, nq, kp, p->kp_rs, idx, nvalid, v, p->A, W, p->w_rs));
    /* masked softmax over the valid columns */
    for (int i = 0; i < nq; i++) {
        AC_T *w = W + i * p->w_rs;
        AC_T m = -INFINITY;
        for (int j = 0; j < nvalid; j++) {
            AC_T s = w[idx[j]];
            m = s > m ? s : m;          /* NaN never wins: it comes out below */
        }
        AC_T sum = 0;
        if (nvalid == M) {
#pragma omp simd reduction(+:sum)
            for (int j = 0; j < M; j++) {
                AC_T e = AC_EXP(w[j] - m);
                w[j] = e;
                sum += e;
            }
            const AC_T inv = (AC_T)1 / sum;
#pragma omp simd
            for (int j = 0; j < M; j++)
                w[j] *= inv;
        } else {
            for (int j = 0; j < nvalid; j++) {
                AC_T e = AC_EXP(w[idx[j]] - m);
                w[idx[j]] = e;
                sum += e;
            }
            const AC_T inv = (AC_T)1 / sum;
            for (int j = 0; j < nvalid; j++)
                w[idx[j]] *= inv;
            if (sum != sum) /* a NaN row is NaN across the row, masked keys too */
                for (int j = 0; j < M; j++) w[j] = (AC_T)NAN;
        }
    }
    /* context */
    if (nvalid == M) {
        char tn = 'N';
        int mm = Dv, nn = nq, kk = M;
        int lda = (int)p->val_rs, ldb = (int)p->w_rs, ldc = (int)p->o_rs;
        AC_T one = 1, zero = 0;
        if (M == 1 || lda < Dv) lda = Dv > 1 ? Dv : 1;
        if (nq == 1 || ldb < M) ldb = M;
        if (nq == 1 || ldc < Dv) ldc = Dv > 1 ? Dv : 1;
        gemm(&tn, &tn, &mm, &nn, &kk, &one, (AC_T *)values, &lda, W, &ldb, &zero,
             out, &ldc);
    } else {
        for (int i = 0; i < nq; i++)
            memset(out + i * p->o_rs, 0, (size_t)Dv * sizeof(AC_T));
        AC_ADD_VCALL(var, ac_add_context_sparse,
                     (W, p->w_rs, nq, idx, nvalid, values, p->val_rs, Dv, out, p->o_rs));
    }
}

#undef AC_ADD_CAT2
#undef AC_ADD_CAT
#undef AC_ADD_FN
#undef AC_ADD_VCALL
