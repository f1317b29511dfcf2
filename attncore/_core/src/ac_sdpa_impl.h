/*
 * ac_sdpa_impl.h -- body of the attention kernels, included once per dtype
 * by ac_sdpa.h with AC_T (float / double), AC_SUF (f32 / f64), AC_EXP and
 * AC_GEMM_T defined.  Not a standalone header.
 */
#define AC_CAT2(a, b) a##_##b
#define AC_CAT(a, b) AC_CAT2(a, b)
#define AC_FN(name) AC_CAT(name, AC_SUF)

/*
 * Valid key columns of one tile: the smallest [lo, hi) (relative to j0)
 * that holds every (row, column) the mask and causal structure let through.
 * Returns 0 when the whole tile is masked out; the tile is then skipped.
 */
AC_INLINE int AC_FN(ac_tile_range)(const ac_params *p, const uint8_t *mb,
                                const AC_T *mf, ptrdiff_t i0, int nq,
                                ptrdiff_t j0, int nk, int *lo, int *hi)
{
    int L = nk, H = 0;
    /* a mask broadcast over query rows: one row decides for all */
    const int rows = (p->mask_rs == 0) ? 1 : nq;
    const ptrdiff_t cs = p->mask_cs;
    for (int r = 0; r < rows; r++) {
        ptrdiff_t i = i0 + r;
        int ncol = nk, a = 0;
        if (p->band) {
            ptrdiff_t lim = ac_causal_limit(p, rows == 1 ? i0 + nq - 1 : i) - j0;
            if (lim < ncol) ncol = lim < 0 ? 0 : (int)lim;
            ptrdiff_t lo = ac_band_lo(p, rows == 1 ? i0 : i) - j0;
            if (lo > a) a = lo > ncol ? ncol : (int)lo;
        }
        int b = ncol;
        if (mb) {
            const uint8_t *mr = mb + i * p->mask_rs + j0 * cs;
            while (a < ncol && !mr[a * cs]) a++;
            if (a == ncol) continue;
            while (b > a && !mr[(b - 1) * cs]) b--;
        } else {
            const AC_T *mr = mf + i * p->mask_rs + j0 * cs;
            const AC_T ninf = -INFINITY;
            while (a < ncol && mr[a * cs] == ninf) a++;
            if (a == ncol) continue;
            while (b > a && mr[(b - 1) * cs] == ninf) b--;
        }
        if (a < L) L = a;
        if (b > H) H = b;
    }
    if (H <= L) return 0;
    *lo = L;
    *hi = H;
    return 1;
}

/*
 * Mask + causal + online softmax on one score tile S (nq x nk, ld ldS) whose
 * first key column is j0.  Updates m, l, writes alpha (the factor the
 * accumulator rows must be scaled by) and ORs NaN flags into bad.  On return
 * S holds P (zeros where masked).
 */
AC_INLINE void AC_FN(ac_softmax_tile)(const ac_params *p,
                                          const uint8_t *mb, const AC_T *mf,
                                          ptrdiff_t i0, int nq, ptrdiff_t j0,
                                          int nk, AC_T *S, AC_T *m, AC_T *l,
                                          AC_T *alpha, int *bad)
{
    const int ldS = p->ldS;
    const AC_T ninf = -INFINITY;
    for (int r = 0; r < nq; r++) {
        AC_T *row = S + (ptrdiff_t)r * ldS;
        const ptrdiff_t i = i0 + r;
        int c_lo, ncol;
        ac_band_cols(p, i, j0, nk, &c_lo, &ncol);
        if (p->softcap > 0) { /* after scaling, before the mask */
            const AC_T cap = (AC_T)p->softcap, icap = 1 / cap;
            for (int c = c_lo; c < ncol; c++) row[c] = cap * AC_TANH(row[c] * icap);
        }
        if (p->alibi_on) { /* after the soft cap, before the mask */
            const AC_T sl = -(AC_T)p->alibi;
            const ptrdiff_t base = i + (ptrdiff_t)p->M - p->N - j0;
            for (int c = c_lo; c < ncol; c++) {
                const ptrdiff_t dd = base - c;
                row[c] += sl * (AC_T)(dd < 0 ? -dd : dd);
            }
        }
        for (int c = 0; c < c_lo; c++) row[c] = ninf; /* before the window */
        /* the mask only over the band: columns before it stay -inf, so a
           NaN / inf mask entry there never reaches the row */
        if (mb) {
            const uint8_t *mr = mb + i * p->mask_rs + j0 * p->mask_cs;
            const ptrdiff_t cs = p->mask_cs;
            if (cs == 1) {
#pragma omp simd
                for (int c = c_lo; c < ncol; c++) row[c] = mr[c] ? row[c] : ninf;
            } else {
                for (int c = c_lo; c < ncol; c++) row[c] = mr[c * cs] ? row[c] : ninf;
            }
        } else if (mf) {
            const AC_T *mr = mf + i * p->mask_rs + j0 * p->mask_cs;
            const ptrdiff_t cs = p->mask_cs;
            if (cs == 1) {
#pragma omp simd
                for (int c = c_lo; c < ncol; c++) {
                    AC_T mv = mr[c];
                    row[c] = (mv == ninf) ? ninf : row[c] + mv;
                }
            } else {
                for (int c = c_lo; c < ncol; c++) {
                    AC_T mv = mr[c * cs];
                    row[c] = (mv == ninf) ? ninf : row[c] + mv;
                }
            }
        }
        AC_T bm = ninf;
        int nan = 0;
#pragma omp simd reduction(max : bm) reduction(| : nan)
        for (int c = 0; c < ncol; c++) {
            AC_T x = row[c];
            bm = x > bm ? x : bm;
            nan |= (x != x);
        }
        bad[r] |= nan;
        const AC_T mo = m[r];
        const AC_T mn = bm > mo ? bm : mo;
        if (mn == ninf) { /* nothing valid in this row so far */
            memset(row, 0, sizeof(AC_T) * (size_t)nk);
            alpha[r] = 1;
            continue;
        }
        AC_T s = 0;
#pragma omp simd reduction(+ : s)
        for (int c = 0; c < ncol; c++) {
            AC_T e = AC_EXP(row[c] - mn);
            row[c] = e;
            s += e;
        }
        for (int c = ncol; c < nk; c++) row[c] = 0;
        const AC_T a = AC_EXP(mo - mn);
        l[r] = l[r] * a + s;
        m[r] = mn;
        alpha[r] = a;
    }
}

/*
 * Score and P.V products for a handful of query rows (decoding, one-step
 * seq2seq): direct loops that stream K and V once.  BLAS would pack both
 * operands first, which costs more than the product itself at these sizes.
 */
AC_INLINE void AC_FN(ac_scores_small)(int nq, int nk, int D, AC_T scale,
                                      const AC_T *q, ptrdiff_t q_rs,
                                      const AC_T *k, ptrdiff_t k_rs, AC_T *S,
                                      int ldS)
{
    for (int j = 0; j < nk; j++) {
        const AC_T *kj = k + j * k_rs;
        for (int r = 0; r < nq; r++) {
            const AC_T *qr = q + r * q_rs;
            AC_T s = 0;
#pragma omp simd reduction(+ : s)
            for (int d = 0; d < D; d++) s += qr[d] * kj[d];
            S[(ptrdiff_t)r * ldS + j] = s * scale;
        }
    }
}

AC_INLINE void AC_FN(ac_pv_small)(int nq, int nk, int Dv, const AC_T *S,
                                  int ldS, const AC_T *v, ptrdiff_t v_rs,
                                  AC_T *acc, int first)
{
    if (first) memset(acc, 0, sizeof(AC_T) * (size_t)nq * (size_t)Dv);
    for (int j = 0; j < nk; j++) {
        const AC_T *vj = v + j * v_rs;
        for (int r = 0; r < nq; r++) {
            const AC_T pj = S[(ptrdiff_t)r * ldS + j];
            AC_T *ar = acc + (ptrdiff_t)r * Dv;
#pragma omp simd
            for (int d = 0; d < Dv; d++) ar[d] += pj * vj[d];
        }
    }
}

/*
 * inf / NaN in the values of keys a query does not attend.  The products
 * below multiply whole tiles, so such a value would reach a query through
 * 0 * inf = NaN.  When a tile holds masked entries (a mask, or the causal
 * diagonal) and its value rows hold a non-finite number, the P.V product
 * of that tile is taken entry by entry over the attended keys only.  The
 * check is a read of the value tile, cheap next to the product, and only
 * on tiles that have masked entries.
 */
AC_INLINE int AC_FN(ac_tile_has_masked)(const ac_params *p, ptrdiff_t i0,
                                        int nq, ptrdiff_t j0, int nk)
{
    if (p->mask_kind != AC_MASK_NONE) return 1;
    if (p->band)
        return j0 + nk > ac_causal_limit(p, i0) || j0 < ac_band_lo(p, i0 + nq - 1);
    return 0;
}

AC_INLINE int AC_FN(ac_rows_nonfinite)(const AC_T *v, int nk, int Dv,
                                       ptrdiff_t v_rs)
{
    for (int j = 0; j < nk; j++) {
        const AC_T *vj = v + j * v_rs;
        AC_T z = 0;
#pragma omp simd reduction(+ : z)
        for (int d = 0; d < Dv; d++) z += vj[d] * 0; /* NaN iff inf or NaN */
        if (z != z) return 1;
    }
    return 0;
}

/* acc rows (+)= sum over the keys row i0 + r attends of P[r, c] v_{j0+c} */
static void AC_FN(ac_pv_attended)(const ac_params *p, const uint8_t *mb,
                                  const AC_T *mf, ptrdiff_t i0, int nq,
                                  ptrdiff_t j0, int nk, const AC_T *S,
                                  int ldS, const AC_T *vt, ptrdiff_t vt_rs,
                                  AC_T *acc, ptrdiff_t acc_rs, int first)
{
    const int Dv = p->Dv;
    const ptrdiff_t cs = p->mask_cs;
    const AC_T ninf = -INFINITY;
    for (int r = 0; r < nq; r++) {
        AC_T *ar = acc + r * acc_rs;
        if (first)
            for (int d = 0; d < Dv; d++) ar[d] = 0;
        const ptrdiff_t i = i0 + r;
        int c0, ncol;
        ac_band_cols(p, i, j0, nk, &c0, &ncol);
        const AC_T *Sr = S + (ptrdiff_t)r * ldS;
        for (int c = c0; c < ncol; c++) {
            const ptrdiff_t j = j0 + c;
            if (mb && !mb[i * p->mask_rs + j * cs]) continue;
            if (mf && mf[i * p->mask_rs + j * cs] == ninf) continue;
            const AC_T pc = Sr[c];
            const AC_T *vj = vt + (ptrdiff_t)c * vt_rs;
#pragma omp simd
            for (int d = 0; d < Dv; d++) ar[d] += pc * vj[d];
        }
    }
}

/* the compiled variants (ac_common.h): one body, three targets */
#define AC_VAR portable
#define AC_VTGT AC_VTGT_PORTABLE
#include "ac_sdpa_variant.h"
#undef AC_VAR
#undef AC_VTGT
#if AC_HAVE_X86
#define AC_VAR avx2
#define AC_VTGT AC_VTGT_AVX2
#include "ac_sdpa_variant.h"
#undef AC_VAR
#undef AC_VTGT
#define AC_VAR avx512
#define AC_VTGT AC_VTGT_AVX512
#include "ac_sdpa_variant.h"
#undef AC_VAR
#undef AC_VTGT
/* call the variant v of kernel `name` with `args` */
#define AC_SDPA_VCALL(v, name, args)                                         \
    ((v) == AC_PATH_AVX512 ? AC_FN(name##_avx512) args                       \
     : (v) == AC_PATH_AVX2 ? AC_FN(name##_avx2) args : AC_FN(name##_portable) args)
#else
#define AC_SDPA_VCALL(v, name, args) ((void)(v), AC_FN(name##_portable) args)
#endif

/*
 * Attention of query rows [i0, i0+nq) over keys [ks, ke) (ac_sdpa_variant.h),
 * in the variant of the kernel path in use.
 */
static int AC_FN(ac_sdpa_range)(
    const ac_params *p, const AC_T *q, const AC_T *k, const AC_T *v,
    const AC_T *ksc, const AC_T *vsc,
    const uint8_t *mb, const AC_T *mf, ptrdiff_t i0, int nq, ptrdiff_t ks,
    ptrdiff_t ke, AC_T *S, AC_T *acc, AC_T *m, AC_T *l, AC_T *alpha,
    int *bad, AC_GEMM_T gemm)
{
    return AC_SDPA_VCALL(ac_variant(AC_K_SDPA), ac_sdpa_range,
                         (p, q, k, v, ksc, vsc, mb, mf, i0, nq, ks, ke, S, acc, m, l, alpha,
                          bad, gemm));
}

/* out rows = acc / l, 0 for rows with nothing to attend, NaN for flagged;
 * with an attention sink (sink > -inf), exp(sink) joins the denominator:
 * acc e^m / (l e^m + e^sink), computed relative to max(m, sink) */
static void AC_FN(ac_sdpa_finish)(int nq, int Dv, int processed,
                                  const AC_T *acc, const AC_T *l,
                                  const int *bad, AC_T *out, ptrdiff_t o_rs,
                                  const AC_T *m, double sink)
{
    for (int r = 0; r < nq; r++) {
        AC_T *o = out + (ptrdiff_t)r * o_rs;
        if (processed && bad[r]) {
            for (int d = 0; d < Dv; d++) o[d] = (AC_T)NAN;
        } else if (!processed || l[r] == 0) {
            for (int d = 0; d < Dv; d++) o[d] = 0;
        } else {
            AC_T inv = 1 / l[r];
            if (sink > -INFINITY) {
                const AC_T mx = m[r] > (AC_T)sink ? m[r] : (AC_T)sink;
                const AC_T a = AC_EXP(m[r] - mx);
                inv = a / (l[r] * a + AC_EXP((AC_T)sink - mx));
            }
            const AC_T *ar = acc + (ptrdiff_t)r * Dv;
            for (int d = 0; d < Dv; d++) o[d] = ar[d] * inv;
        }
    }
}

/*
 * Merge split-KV partials: nsplit partial (acc, m, l, bad) sets for nq rows.
 * Partial s of row r: acc at pacc + s*acc_ss + r*Dv, m/l at [s*ml_ss + r],
 * bad at pbad[s*bad_ss + r].
 * A partial with l == 0 saw no valid key and carries no acc.
 */
static void AC_FN(ac_sdpa_merge)(int nsplit, int nq, int Dv,
                                 const AC_T *pacc, ptrdiff_t acc_ss,
                                 const AC_T *pm, const AC_T *pl,
                                 ptrdiff_t ml_ss, const int *pbad,
                                 ptrdiff_t bad_ss, AC_T *out, ptrdiff_t o_rs,
                                 AC_T *lse, double sink)
{
    for (int r = 0; r < nq; r++) {
        AC_T *o = out + (ptrdiff_t)r * o_rs;
        int bad = 0, any = 0;
        AC_T mx = -INFINITY;
        for (int s = 0; s < nsplit; s++) {
            bad |= pbad[s * bad_ss + r];
            if (pl[s * ml_ss + r] != 0) {
                any = 1;
                if (pm[s * ml_ss + r] > mx) mx = pm[s * ml_ss + r];
            }
        }
        if (bad) {
            for (int d = 0; d < Dv; d++) o[d] = (AC_T)NAN;
            if (lse) lse[r] = (AC_T)NAN;
            continue;
        }
        for (int d = 0; d < Dv; d++) o[d] = 0;
        if (!any) {
            if (lse) lse[r] = (AC_T)sink;  /* -inf without a sink */
            continue;
        }
        AC_T L = 0;
        for (int s = 0; s < nsplit; s++) {
            const AC_T ls = pl[s * ml_ss + r];
            if (ls == 0) continue;
            const AC_T w = AC_EXP(pm[s * ml_ss + r] - mx);
            L += ls * w;
            const AC_T *ar = pacc + s * acc_ss + (ptrdiff_t)r * Dv;
            for (int d = 0; d < Dv; d++) o[d] += w * ar[d];
        }
        AC_T inv = 1 / L, top = mx, tot = L;
        if (sink > -INFINITY) { /* exp(sink) joins the denominator */
            top = mx > (AC_T)sink ? mx : (AC_T)sink;
            const AC_T a = AC_EXP(mx - top);
            tot = L * a + AC_EXP((AC_T)sink - top);
            inv = a / tot;
        }
        for (int d = 0; d < Dv; d++) o[d] *= inv;
        if (lse) lse[r] = top + log(tot);
    }
}

/* the materializing path (return_weights=True, ac_sdpa_variant.h), in the
   variant of the kernel path in use */
static void AC_FN(ac_weights_block)(
    const ac_params *p, const AC_T *q, const AC_T *k, const AC_T *v,
    const uint8_t *mb, const AC_T *mf, ptrdiff_t i0, int nq, AC_T *W,
    AC_T *out, ptrdiff_t o_rs, AC_T *lse, AC_GEMM_T gemm)
{
    AC_SDPA_VCALL(ac_variant(AC_K_WEIGHTS), ac_weights_block,
                  (p, q, k, v, mb, mf, i0, nq, W, out, o_rs, lse, gemm));
}

/* y = exp(x), elementwise (exposed for the accuracy tests) */
static void AC_FN(ac_exp_array)(const AC_T *x, AC_T *y, ptrdiff_t n)
{
    AC_SDPA_VCALL(ac_variant(AC_K_EXP), ac_exp_array, (x, y, n));
}

#undef AC_SDPA_VCALL
#undef AC_FN
#undef AC_CAT
#undef AC_CAT2
