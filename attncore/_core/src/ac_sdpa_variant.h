/*
 * ac_sdpa_variant.h -- the attention kernels that rely on the vectorizer,
 * included by ac_sdpa_impl.h once per dtype and compiled variant, with
 * AC_VAR (portable / avx2 / avx512: the name suffix) and AC_VTGT (its
 * target attribute, ac_common.h) defined.  ac_sdpa_impl.h dispatches on the
 * kernel path in use.  Not a standalone header.
 */
#define AC_VFN(name) AC_CAT(AC_CAT(name, AC_VAR), AC_SUF)

/*
 * Attention of query rows [i0, i0+nq) over keys [ks, ke).  q, k, v, mb, mf
 * point at the start of this batch element.  Leaves the unnormalized
 * accumulator in acc (nq x Dv, contiguous), the running max in m, the
 * running sum in l and NaN flags in bad.  Returns 1 if any key tile was
 * processed (acc is then initialized), 0 otherwise.
 */
static AC_VTGT int AC_VFN(ac_sdpa_range)(
    const ac_params *p, const AC_T *q, const AC_T *k, const AC_T *v,
    const AC_T *ksc, const AC_T *vsc,
    const uint8_t *mb, const AC_T *mf, ptrdiff_t i0, int nq, ptrdiff_t ks,
    ptrdiff_t ke, AC_T *S, AC_T *acc, AC_T *m, AC_T *l, AC_T *alpha,
    int *bad, AC_GEMM_T gemm)
{
    const int Bk = p->Bk, ldS = p->ldS, Dv = p->Dv;
#if AC_IS_F32
    /* the fused kernel (no BLAS, nothing of K / V packed) where the CPU
       has one; a handful of rows stay with the direct loops below */
    if (ac_kernel_path != AC_PATH_PORTABLE && nq > AC_SMALL_ROWS &&
        (!p->qk8 || (p->qk8 <= 2 && ac_kernel_path == AC_PATH_AVX512))) {
        int any = ac_fused_range_f32(p, q, k, v, ksc, vsc, mb, mf, i0, nq, ks, ke, S,
                                     acc, m, l, bad);
        /* rows whose scores left the range of the fused kernel's base-2
           units (or are NaN), bad = -1: again in natural units, up to
           AC_SMALL_ROWS adjacent ones at a time, on the direct loops below
           (no BLAS inside the fused path's threads) */
        for (int r = 0; r < nq;) {
            if (bad[r] >= 0) {
                r++;
                continue;
            }
            int n = 1;
            while (n < AC_SMALL_ROWS && r + n < nq && bad[r + n] < 0) n++;
            any |= AC_VFN(ac_sdpa_range)(p, q, k, v, ksc, vsc, mb, mf, i0 + r, n, ks, ke, S,
                                         acc + (ptrdiff_t)r * Dv, m + r, l + r, alpha + r,
                                         bad + r, gemm);
            r += n;
        }
        return any;
    }
#endif
    /* int8 / half keys and values: each tile is converted into these
       buffers; half queries: the block is converted into QB */
    AC_T *KB = S + p->dq_off, *VB = KB + (ptrdiff_t)Bk * p->D;
    const AC_T *qb = q + i0 * p->q_rs;
    ptrdiff_t qb_rs = p->q_rs;
    if (p->qh) {
        AC_T *QB = S + p->qb_off;
        AC_HALF_ROWS(p->qh, (const uint16_t *)(const void *)q + i0 * p->q_rs, p->q_rs, nq,
                     p->D, QB, p->D);
        qb = QB;
        qb_rs = p->D;
    } else if (p->qk8) {
        /* int8 queries (precision="int8"): the block's rows dequantized;
           with the keys' the products are those of the int8 rows, to
           float rounding */
        AC_T *QB = S + p->qb_off;
        for (int r = 0; r < nq; r++) {
            const int8_t *xr = (const int8_t *)(const void *)q + (i0 + r) * p->q_rs;
            const AC_T s_ = (AC_T)p->qsc[i0 + r];
            for (int d = 0; d < p->D; d++) QB[(ptrdiff_t)r * p->D + d] = s_ * (AC_T)xr[d];
        }
        qb = QB;
        qb_rs = p->D;
    }
    for (int r = 0; r < nq; r++) {
        m[r] = -INFINITY;
        l[r] = 0;
        bad[r] = 0;
    }
    ptrdiff_t kend = ke, kstart = ks;
    if (p->band) {
        ptrdiff_t lim = ac_causal_limit(p, i0 + nq - 1);
        if (lim < kend) kend = lim;
        ptrdiff_t lo = ac_band_lo(p, i0);
        if (lo > kstart) kstart = lo;
    }
    int first = 1;
    for (ptrdiff_t jb = kstart; jb < kend; jb += Bk) {
        int nk = (int)((kend - jb < Bk) ? (kend - jb) : Bk);
        ptrdiff_t j0 = jb;
        if (p->mask_kind != AC_MASK_NONE) {
            int lo, hi;
            if (!AC_FN(ac_tile_range)(p, mb, mf, i0, nq, jb, nk, &lo, &hi))
                continue; /* whole tile masked out: skipped, not computed */
            j0 = jb + lo;
            nk = hi - lo;
        }
        /* the key / value rows of this tile, in place or dequantized */
        const AC_T *kt = KB, *vt = VB;
        ptrdiff_t kt_rs = p->D, vt_rs = Dv;
#if AC_IS_F32 && AC_HAVE_X86
        /* a few rows on AVX-512: int8 and half rows are read as they are */
        const int k_direct = (p->kq8 || p->kh) && ac_avx512_ok && nq <= AC_SMALL_ROWS;
        const int v_direct = (p->vq8 || p->vh) && ac_avx512_ok && nq <= AC_SMALL_ROWS &&
                             !AC_FN(ac_tile_has_masked)(p, i0, nq, j0, nk);
#else
        const int k_direct = 0, v_direct = 0;
#endif
        if (k_direct) {
        } else if (p->kq8) {
            AC_DEQUANT(AC_T, (const int8_t *)(const void *)k + j0 * p->k_rs, p->k_rs,
                       ksc + j0 * p->ks_rs, p->ks_rs, nk, p->D, KB);
        } else if (p->kh) {
            AC_HALF_ROWS(p->kh, (const uint16_t *)(const void *)k + j0 * p->k_rs, p->k_rs, nk,
                         p->D, KB, p->D);
        } else {
            kt = k + j0 * p->k_rs;
            kt_rs = p->k_rs;
        }
        if (v_direct) {
        } else if (p->vq8) {
            AC_DEQUANT(AC_T, (const int8_t *)(const void *)v + j0 * p->v_rs, p->v_rs,
                       vsc + j0 * p->vs_rs, p->vs_rs, nk, Dv, VB);
        } else if (p->vh) {
            AC_HALF_ROWS(p->vh, (const uint16_t *)(const void *)v + j0 * p->v_rs, p->v_rs, nk,
                         Dv, VB, Dv);
        } else {
            vt = v + j0 * p->v_rs;
            vt_rs = p->v_rs;
        }
        if (nq <= AC_SMALL_ROWS) {
#if AC_IS_F32 && AC_HAVE_X86
            if (k_direct && (p->qk8 == 1 || p->qk8 == 2))
                (p->qk8 == 1 ? ac_i8_scores_small : ac_i8_scores_small_emu)(
                    nq, nk, p->D, (float)p->scale, (const int8_t *)(const void *)q + i0 * p->q_rs,
                    p->q_rs, p->qsc + i0, (const int8_t *)(const void *)k + j0 * p->k_rs,
                    p->k_rs, ksc + j0 * p->ks_rs, p->ks_rs, S, ldS);
            else if (k_direct && p->kq8)
                ac_scores_small_q8_avx512(nq, nk, p->D, (AC_T)p->scale, qb, qb_rs,
                                          (const int8_t *)(const void *)k + j0 * p->k_rs,
                                          p->k_rs, ksc + j0 * p->ks_rs, p->ks_rs, S, ldS);
            else if (k_direct)
                ac_scores_small_h_avx512(p->kh, nq, nk, p->D, (AC_T)p->scale, qb, qb_rs,
                                         (const uint16_t *)(const void *)k + j0 * p->k_rs,
                                         p->k_rs, S, ldS);
            else if (ac_avx512_ok)
                ac_scores_small_f32_avx512(nq, nk, p->D, (AC_T)p->scale, qb, qb_rs,
                                           kt, kt_rs, S, ldS);
            else
#endif
            AC_FN(ac_scores_small)(nq, nk, p->D, (AC_T)p->scale, qb, qb_rs, kt, kt_rs, S,
                                   ldS);
        } else {
            char ta = 'T', tb = 'N';
            int mm = nk, nn = nq, kk = p->D;
            int lda = (int)kt_rs, ldb = (int)qb_rs, ldc = ldS;
            AC_T al = (AC_T)p->scale, be = 0;
            gemm(&ta, &tb, &mm, &nn, &kk, &al, (AC_T *)kt,
                 &lda, (AC_T *)qb, &ldb, &be, S, &ldc);
        }
        AC_FN(ac_softmax_tile)(p, mb, mf, i0, nq, j0, nk, S, m, l, alpha, bad);
        if (!first) {
            for (int r = 0; r < nq; r++) {
                const AC_T a = alpha[r];
                if (a != 1) {
                    AC_T *ar = acc + (ptrdiff_t)r * Dv;
#pragma omp simd
                    for (int d = 0; d < Dv; d++) ar[d] *= a;
                }
            }
        }
        if (AC_FN(ac_tile_has_masked)(p, i0, nq, j0, nk) &&
            AC_FN(ac_rows_nonfinite)(vt, nk, Dv, vt_rs)) {
            AC_FN(ac_pv_attended)(p, mb, mf, i0, nq, j0, nk, S, ldS, vt, vt_rs,
                                  acc, Dv, first);
        } else if (nq <= AC_SMALL_ROWS) {
#if AC_IS_F32 && AC_HAVE_X86
            if (v_direct && p->vq8)
                ac_pv_small_q8_avx512(nq, nk, Dv, S, ldS,
                                      (const int8_t *)(const void *)v + j0 * p->v_rs, p->v_rs,
                                      vsc + j0 * p->vs_rs, p->vs_rs, acc, first);
            else if (v_direct)
                ac_pv_small_h_avx512(p->vh, nq, nk, Dv, S, ldS,
                                     (const uint16_t *)(const void *)v + j0 * p->v_rs, p->v_rs,
                                     acc, first);
            else if (ac_avx512_ok)
                ac_pv_small_f32_avx512(nq, nk, Dv, S, ldS, vt, vt_rs, acc, first);
            else
#endif
            AC_FN(ac_pv_small)(nq, nk, Dv, S, ldS, vt, vt_rs,
                               acc, first);
        } else {
            char ta = 'N', tb = 'N';
            int mm = Dv, nn = nq, kk = nk;
            int lda = (int)vt_rs, ldb = ldS, ldc = Dv;
            AC_T one = 1, be = first ? 0 : 1;
            gemm(&ta, &tb, &mm, &nn, &kk, &one, (AC_T *)vt,
                 &lda, S, &ldb, &be, acc, &ldc);
        }
        first = 0;
    }
    return !first;
}

/*
 * The materializing path (return_weights=True): W (nq x M, ld M) receives
 * the attention weights of query rows [i0, i0+nq), out (ld o_rs) the
 * attended values.
 */
static AC_VTGT void AC_VFN(ac_weights_block)(
    const ac_params *p, const AC_T *q, const AC_T *k, const AC_T *v,
    const uint8_t *mb, const AC_T *mf, ptrdiff_t i0, int nq, AC_T *W,
    AC_T *out, ptrdiff_t o_rs, AC_T *lse, AC_GEMM_T gemm)
{
    const int M = p->M, Dv = p->Dv;
    const AC_T ninf = -INFINITY;
    {
        char ta = 'T', tb = 'N';
        int mm = M, nn = nq, kk = p->D;
        int lda = (int)p->k_rs, ldb = (int)p->q_rs, ldc = M;
        AC_T al = (AC_T)p->scale, be = 0;
        gemm(&ta, &tb, &mm, &nn, &kk, &al, (AC_T *)k, &lda,
             (AC_T *)(q + i0 * p->q_rs), &ldb, &be, W, &ldc);
    }
    for (int r = 0; r < nq; r++) {
        AC_T *row = W + (ptrdiff_t)r * M;
        const ptrdiff_t i = i0 + r;
        int c_lo, ncol;
        ac_band_cols(p, i, 0, M, &c_lo, &ncol);
        for (int c = 0; c < c_lo; c++) row[c] = ninf;
        if (p->softcap > 0) {
            const AC_T cap = (AC_T)p->softcap, icap = 1 / cap;
            for (int c = c_lo; c < ncol; c++) row[c] = cap * AC_TANH(row[c] * icap);
        }
        if (p->alibi_on) {
            const AC_T sl = -(AC_T)p->alibi;
            const ptrdiff_t base = i + (ptrdiff_t)p->M - p->N;
            for (int c = c_lo; c < ncol; c++) {
                const ptrdiff_t dd = base - c;
                row[c] += sl * (AC_T)(dd < 0 ? -dd : dd);
            }
        }
        /* the mask only over the band (see ac_softmax_tile) */
        if (mb) {
            const uint8_t *mr = mb + i * p->mask_rs;
            const ptrdiff_t cs = p->mask_cs;
            for (int c = c_lo; c < ncol; c++) row[c] = mr[c * cs] ? row[c] : ninf;
        } else if (mf) {
            const AC_T *mr = mf + i * p->mask_rs;
            const ptrdiff_t cs = p->mask_cs;
            for (int c = c_lo; c < ncol; c++) {
                AC_T mv = mr[c * cs];
                row[c] = (mv == ninf) ? ninf : row[c] + mv;
            }
        }
        for (int c = ncol; c < M; c++) row[c] = 0;
        AC_T bm = ninf;
        int nan = 0;
#pragma omp simd reduction(max : bm) reduction(| : nan)
        for (int c = 0; c < ncol; c++) {
            AC_T x = row[c];
            bm = x > bm ? x : bm;
            nan |= (x != x);
        }
        if (nan || bm == (AC_T)INFINITY) {
            /* a NaN score, or a +inf one (exp(inf - inf)): the whole row
               of weights is NaN, the columns outside the band included */
            for (int c = 0; c < M; c++) row[c] = (AC_T)NAN;
            if (lse) lse[r] = (AC_T)NAN;
            continue;
        }
        if (bm == ninf) { /* nothing to attend */
            for (int c = 0; c < ncol; c++) row[c] = 0;
            if (lse) lse[r] = (AC_T)p->sink; /* -inf without a sink */
            continue;
        }
        if (p->sink > bm) bm = (AC_T)p->sink; /* the sink joins the softmax */
        AC_T s = 0;
#pragma omp simd reduction(+ : s)
        for (int c = 0; c < ncol; c++) {
            AC_T e = AC_EXP(row[c] - bm);
            row[c] = e;
            s += e;
        }
        if (p->sink > -INFINITY) s += AC_EXP((AC_T)p->sink - bm);
        const AC_T inv = 1 / s;
#pragma omp simd
        for (int c = 0; c < ncol; c++) row[c] *= inv;
        if (lse) lse[r] = bm + log(s);
    }
    if (AC_FN(ac_tile_has_masked)(p, i0, nq, 0, M) &&
        AC_FN(ac_rows_nonfinite)(v, M, Dv, p->v_rs)) {
        AC_FN(ac_pv_attended)(p, mb, mf, i0, nq, 0, M, W, M, v, p->v_rs,
                              out + i0 * o_rs, o_rs, 1);
    } else {
        char ta = 'N', tb = 'N';
        int mm = Dv, nn = nq, kk = M;
        int lda = (int)p->v_rs, ldb = M, ldc = (int)o_rs;
        AC_T one = 1, be = 0;
        gemm(&ta, &tb, &mm, &nn, &kk, &one, (AC_T *)v, &lda, W, &ldb, &be,
             out + i0 * o_rs, &ldc);
    }
    /* rows with nothing to attend: exactly 0, whatever V holds */
    for (int r = 0; r < nq; r++) {
        const AC_T *row = W + (ptrdiff_t)r * M;
        int empty = 1;
        for (int c = 0; c < M && empty; c++) empty = (row[c] == 0);
        if (empty) {
            AC_T *o = out + (i0 + r) * o_rs;
            for (int d = 0; d < Dv; d++) o[d] = 0;
        }
    }
}

/* y = exp(x), elementwise (exposed for the accuracy tests) */
static AC_VTGT void AC_VFN(ac_exp_array)(const AC_T *x, AC_T *y, ptrdiff_t n)
{
#pragma omp simd
    for (ptrdiff_t i = 0; i < n; i++) y[i] = AC_EXP(x[i]);
}

#undef AC_VFN
