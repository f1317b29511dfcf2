/*
 * ac_additive_variant.h -- the additive-attention loops that rely on the
 * vectorizer, included by ac_additive_impl.h once per dtype and compiled
 * variant with AC_VAR (the name suffix) and AC_VTGT (its target attribute,
 * ac_common.h) defined; ac_additive_block dispatches on the kernel path in
 * use.  Not a standalone header.
 */
#define AC_ADD_VFN(name) AC_ADD_CAT(AC_ADD_CAT(name, AC_VAR), AC_SUF)

/*
 * Scores of nq query rows against the nvalid keys listed in idx:
 *   W[i * w_rs + idx[j]] = sum_a v[a] tanh(qp[i, a] + kp[idx[j], a]).
 * Four keys per pass share the loads of qp and v; the loop over A is one
 * `omp simd` reduction per key (vectorized tanh, no temporaries).
 */
static AC_VTGT void AC_ADD_VFN(ac_add_scores)(const AC_T *qp, ptrdiff_t qp_rs, int nq,
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
static AC_VTGT void AC_ADD_VFN(ac_add_scores_exp)(const AC_T *eq, ptrdiff_t qp_rs, int nq,
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
static AC_VTGT void AC_ADD_VFN(ac_add_context_sparse)(const AC_T *W, ptrdiff_t w_rs, int nq,
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

#undef AC_ADD_VFN
