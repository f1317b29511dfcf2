/*
 * ac_additive_impl.h -- body of the additive-attention kernels, included
 * once per dtype by ac_additive.h with AC_T, AC_SUF, AC_TANH, AC_EXP and
 * AC_GEMM_T defined.  Not a standalone header.
 */
#define AC_ADD_CAT2(a, b) a##_##b
#define AC_ADD_CAT(a, b) AC_ADD_CAT2(a, b)
#define AC_ADD_FN(name) AC_ADD_CAT(name, AC_SUF)

/*
 * Scores of nq query rows against the nvalid keys listed in idx:
 *   W[i * w_rs + idx[j]] = sum_a v[a] tanh(qp[i, a] + kp[idx[j], a]).
 * Four keys per pass share the loads of qp and v; the loop over A is one
 * `omp simd` reduction per key (vectorized tanh, no temporaries).
 */
AC_CLONES
static void AC_ADD_FN(ac_add_scores)(const AC_T *qp, ptrdiff_t qp_rs, int nq,
                                     const AC_T *kp, ptrdiff_t kp_rs,
                                     const int *idx, int nvalid,
                                     const AC_T *v, int A,
                                     AC_T *W, ptrdiff_t w_rs)
{
    for (int i = 0; i < nq; i++) {
        const AC_T *q = qp + i * qp_rs;
        AC_T *w = W + i * w_rs;
        int j = 0;
        for (; j + 4 <= nvalid; j += 4) {
            const AC_T *k0 = kp + (ptrdiff_t)idx[j] * kp_rs;
            const AC_T *k1 = kp + (ptrdiff_t)idx[j + 1] * kp_rs;
            const AC_T *k2 = kp + (ptrdiff_t)idx[j + 2] * kp_rs;
            const AC_T *k3 = kp + (ptrdiff_t)idx[j + 3] * kp_rs;
            AC_T s0 = 0, s1 = 0, s2 = 0, s3 = 0;
#pragma omp simd reduction(+:s0, s1, s2, s3)
            for (int a = 0; a < A; a++) {
                AC_T qa = q[a], va = v[a];
                s0 += va * AC_TANH(qa + k0[a]);
                s1 += va * AC_TANH(qa + k1[a]);
                s2 += va * AC_TANH(qa + k2[a]);
                s3 += va * AC_TANH(qa + k3[a]);
            }
            w[idx[j]] = s0;
            w[idx[j + 1]] = s1;
            w[idx[j + 2]] = s2;
            w[idx[j + 3]] = s3;
        }
        for (; j < nvalid; j++) {
            const AC_T *k0 = kp + (ptrdiff_t)idx[j] * kp_rs;
            AC_T s0 = 0;
#pragma omp simd reduction(+:s0)
            for (int a = 0; a < A; a++)
                s0 += v[a] * AC_TANH(q[a] + k0[a]);
            w[idx[j]] = s0;
        }
    }
}

/*
 * The same scores through exponentials factored per operand:
 *   tanh(x + y) = 1 - 2 / (1 + e^{2x} e^{2y}),
 * so with eq = exp(2 qp) (per query row) and ek = exp(2 kp) (once per
 * memory) every (query, key, a) term costs one fma and one division:
 *   W[i, idx[j]] = sum_a vm[a] / (1 + eq[i, a] ek[idx[j], a]),  vm = -2 v,
 * which is the score minus the constant sum_a v[a] (softmax ignores it).
 * The caller uses this form only when |qp| and |kp| are small enough that
 * e^{2 qp} e^{2 kp} cannot overflow (see _alignment_layer).
 */
AC_CLONES
static void AC_ADD_FN(ac_add_scores_exp)(const AC_T *eq, ptrdiff_t qp_rs, int nq,
                                         const AC_T *ek, ptrdiff_t kp_rs,
                                         const int *idx, int nvalid,
                                         const AC_T *vm, int A,
                                         AC_T *W, ptrdiff_t w_rs)
{
    for (int i = 0; i < nq; i++) {
        const AC_T *q = eq + i * qp_rs;
        AC_T *w = W + i * w_rs;
        int j = 0;
        for (; j + 4 <= nvalid; j += 4) {
            const AC_T *k0 = ek + (ptrdiff_t)idx[j] * kp_rs;
            const AC_T *k1 = ek + (ptrdiff_t)idx[j + 1] * kp_rs;
            const AC_T *k2 = ek + (ptrdiff_t)idx[j + 2] * kp_rs;
            const AC_T *k3 = ek + (ptrdiff_t)idx[j + 3] * kp_rs;
            AC_T s0 = 0, s1 = 0, s2 = 0, s3 = 0;
#pragma omp simd reduction(+:s0, s1, s2, s3)
            for (int a = 0; a < A; a++) {
                AC_T qa = q[a], va = vm[a];
                s0 += va / (qa * k0[a] + (AC_T)1);
                s1 += va / (qa * k1[a] + (AC_T)1);
                s2 += va / (qa * k2[a] + (AC_T)1);
                s3 += va / (qa * k3[a] + (AC_T)1);
            }
            w[idx[j]] = s0;
            w[idx[j + 1]] = s1;
            w[idx[j + 2]] = s2;
            w[idx[j + 3]] = s3;
        }
        for (; j < nvalid; j++) {
            const AC_T *k0 = ek + (ptrdiff_t)idx[j] * kp_rs;
            AC_T s0 = 0;
#pragma omp simd reduction(+:s0)
            for (int a = 0; a < A; a++)
                s0 += vm[a] / (q[a] * k0[a] + (AC_T)1);
            w[idx[j]] = s0;
        }
    }
}

/* out[i, :] += sum over valid keys j of W[i, j] * values[j, :] */
AC_CLONES
static void AC_ADD_FN(ac_add_context_sparse)(const AC_T *W, ptrdiff_t w_rs, int nq,
                                             const int *idx, int nvalid,
                                             const AC_T *values, ptrdiff_t val_rs,
                                             int Dv, AC_T *out, ptrdiff_t o_rs)
{
    for (int jj = 0; jj < nvalid; jj++) {
        const ptrdiff_t j = idx[jj];
        const AC_T *vr = values + j * val_rs;
        for (int i = 0; i < nq; i++) {
            const AC_T wij = W[i * w_rs + j];
            AC_T *o = out + i * o_rs;
#pragma omp simd
            for (int d = 0; d < Dv; d++)
                o[d] += wij * vr[d];
        }
    }
}

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
    if (factored)
        AC_ADD_FN(ac_add_scores_exp)(qp, p->qp_rs, nq, kp, p->kp_rs, idx, nvalid, v, p->A,
                                     W, p->w_rs);
    else
        AC_ADD_FN(ac_add_scores)(qp, p->qp_rs, nq, kp, p->kp_rs, idx, nvalid, v, p->A,
                                 W, p->w_rs);
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
        AC_ADD_FN(ac_add_context_sparse)(W, p->w_rs, nq, idx, nvalid, values,
                                         p->val_rs, Dv, out, p->o_rs);
    }
}

#undef AC_ADD_CAT2
#undef AC_ADD_CAT
#undef AC_ADD_FN
