/*
 * ac_fused_impl.h -- body of the fused float32 attention kernel, included
 * once per instruction set by ac_fused_x86.h with these macros defined:
 *
 *   AC_ISA     name suffix (avx512 / avx2)       AC_TGT  target attribute
 *   VEC        vector type, AC_W lanes              AC_P    panel rows (2 AC_W)
 *   AC_KU      keys per score micro-tile
 *   AC_RU, AC_CV   rows x vectors of value columns per P.V micro-tile
 *   VZERO VLOAD VSTORE VSET1 VFMA VMAX VADD VSUB VMUL   vector operations
 *   VLOADN / VSTOREN (p, n)   the first n lanes only (the rest read as 0)
 *   VPACK(x, x_rs, nr, D, scale, XT)   a panel of rows, transposed
 *   VEXP2(x)   2^x for x <= 0 (NaN propagates, below -125 gives exactly 0)
 *   VCAUSAL(v, lane0, t)   lanes whose row index (lane0 + lane) <= t -> -inf
 *   VZERO_IF_NINF(v)       lanes equal to -inf -> 0
 *
 * Layout: queries in SIMD lanes.  A panel of P query rows is packed once,
 * transposed and pre-scaled by scale * log2(e): QT[d][P].  Keys and values
 * are read in place (row-major, any row stride) through scalar broadcasts,
 * so nothing of K or V is ever packed or copied.  Per key tile of up to
 * AC_BK keys:
 *   ST[j][P] = QT^T k_j                       (micro-tiles of AC_KU keys,
 *                                              running max in registers)
 *   mask / causal -> -inf, float mask added (times log2 e)
 *   m' = max(m, tile max);  P = 2^(ST - m');  l = l 2^(m - m') + sum P
 *   O[r][:] = O 2^(m - m') + sum_j P[j][r] v_j    (natural layout; micro-
 *                                              tiles of AC_RU rows x AC_CV
 *                                              vectors of value columns)
 * Row statistics are per lane, so the softmax needs no horizontal
 * reductions at all.  The base-2 exponent (log2 e folded into the query
 * scale) saves the argument reduction of exp.
 */
#define AC_FCAT3(a, b, c) a##_##b##_##c
#define AC_FCAT(a, b, c) AC_FCAT3(a, b, c)
#define AC_F(name) AC_FCAT(name, f32, AC_ISA)

/* The micro-kernels are AC_NOINLINE: each gets the whole register file
 * (inlined into the tile loop, the running max / sum vectors made the P.V
 * kernel spill two accumulators to the stack: measured 28 % of its
 * samples). */

/* score micro-tile: KU keys x P query lanes, ST rows j (ld P); b0 (or
 * NULL): a value per key added to the finished scores (a per-key bias:
 * one rounding, as adding it afterwards) */
#define AC_DEF_QK(KU, NAME)                                                        \
static AC_TGT AC_NOINLINE void AC_F(NAME)(const float *QT, int D,        \
                                          const float *kr, ptrdiff_t k_rs,   \
                                          float *ST, VEC *mx0, VEC *mx1,     \
                                          const float *b0)                   \
{                                                                            \
    VEC a0[KU], a1[KU];                                                      \
    _Pragma("GCC unroll 16")                                                 \
    for (int u = 0; u < KU; u++) { a0[u] = VZERO(); a1[u] = VZERO(); }       \
    const float *kp[KU];                                                     \
    _Pragma("GCC unroll 16")                                                 \
    for (int u = 0; u < KU; u++) kp[u] = kr + u * k_rs;                      \
    for (int d = 0; d < D; d++) {                                            \
        const VEC q0 = VLOAD(QT + (ptrdiff_t)d * AC_P);                      \
        const VEC q1 = VLOAD(QT + (ptrdiff_t)d * AC_P + AC_W);                  \
        _Pragma("GCC unroll 16")                                             \
        for (int u = 0; u < KU; u++) {                                       \
            const VEC b = VSET1(kp[u][d]);                                   \
            a0[u] = VFMA(q0, b, a0[u]);                                      \
            a1[u] = VFMA(q1, b, a1[u]);                                      \
        }                                                                    \
    }                                                                        \
    if (b0) {                                                                \
        _Pragma("GCC unroll 16")                                             \
        for (int u = 0; u < KU; u++) {                                       \
            const VEC bu = VSET1(b0[u]);                                     \
            a0[u] = VADD(a0[u], bu);                                         \
            a1[u] = VADD(a1[u], bu);                                         \
        }                                                                    \
    }                                                                        \
    VEC m0 = *mx0, m1 = *mx1;                                                \
    _Pragma("GCC unroll 16")                                                 \
    for (int u = 0; u < KU; u++) {                                           \
        VSTORE(ST + u * AC_P, a0[u]);                                        \
        VSTORE(ST + u * AC_P + AC_W, a1[u]);                                    \
        m0 = VMAX(a0[u], m0);                                                \
        m1 = VMAX(a1[u], m1);                                                \
    }                                                                        \
    *mx0 = m0;                                                               \
    *mx1 = m1;                                                               \
}

/* P.V micro-tile, natural layout: rows r..r+RU-1 of the accumulator O (ld
 * ldo), CV full vectors of value columns, rescaled by alpha[u], plus the nk
 * keys of this tile: O[u][:] = alpha[u] O[u][:] + sum_j P[j][u] v_j[:] */
#define AC_DEF_PV(RU, CV, NAME)                                              \
static AC_TGT AC_NOINLINE void AC_F(NAME)(const float *PT, int nk,           \
                                          const float *vc, ptrdiff_t v_rs,   \
                                          float *O, ptrdiff_t ldo,           \
                                          const float *alpha)                \
{                                                                            \
    VEC a[RU][CV];                                                           \
    _Pragma("GCC unroll 8")                                                  \
    for (int u = 0; u < RU; u++) {                                           \
        const VEC al = VSET1(alpha[u]);                                      \
        _Pragma("GCC unroll 8")                                              \
        for (int c = 0; c < CV; c++)                                         \
            a[u][c] = VMUL(VLOAD(O + u * ldo + c * AC_W), al);               \
    }                                                                        \
    for (int j = 0; j < nk; j++) {                                           \
        const float *vj = vc + (ptrdiff_t)j * v_rs;                          \
        const float *pj = PT + (ptrdiff_t)j * AC_P;                          \
        VEC x[CV];                                                           \
        _Pragma("GCC unroll 8")                                              \
        for (int c = 0; c < CV; c++) x[c] = VLOAD(vj + c * AC_W);            \
        _Pragma("GCC unroll 8")                                              \
        for (int u = 0; u < RU; u++) {                                       \
            const VEC b = VSET1(pj[u]);                                      \
            _Pragma("GCC unroll 8")                                          \
            for (int c = 0; c < CV; c++) a[u][c] = VFMA(b, x[c], a[u][c]);   \
        }                                                                    \
    }                                                                        \
    _Pragma("GCC unroll 8")                                                  \
    for (int u = 0; u < RU; u++)                                             \
        _Pragma("GCC unroll 8")                                              \
        for (int c = 0; c < CV; c++) VSTORE(O + u * ldo + c * AC_W, a[u][c]); \
}

/* the same for the last n < W value columns (one partial vector) */
#define AC_DEF_PV_TAIL(RU, NAME)                                             \
static AC_TGT AC_NOINLINE void AC_F(NAME)(const float *PT, int nk,           \
                                          const float *vc, ptrdiff_t v_rs,   \
                                          float *O, ptrdiff_t ldo,           \
                                          const float *alpha, int n)         \
{                                                                            \
    VEC a[RU];                                                               \
    _Pragma("GCC unroll 8")                                                  \
    for (int u = 0; u < RU; u++)                                             \
        a[u] = VMUL(VLOADN(O + u * ldo, n), VSET1(alpha[u]));                \
    for (int j = 0; j < nk; j++) {                                           \
        const VEC x = VLOADN(vc + (ptrdiff_t)j * v_rs, n);                   \
        const float *pj = PT + (ptrdiff_t)j * AC_P;                          \
        _Pragma("GCC unroll 8")                                              \
        for (int u = 0; u < RU; u++) a[u] = VFMA(VSET1(pj[u]), x, a[u]);     \
    }                                                                        \
    _Pragma("GCC unroll 8")                                                  \
    for (int u = 0; u < RU; u++) VSTOREN(O + u * ldo, a[u], n);              \
}

/* O rows [0, nr) (ld ldo) of value columns [0, Dv) */
#define AC_PV_ROWS(RU, MAIN, ONE, TAIL)                                      \
    do {                                                                     \
        int d_ = 0;                                                          \
        for (; d_ + AC_CV * AC_W <= Dv; d_ += AC_CV * AC_W)                   \
            AC_F(MAIN)(ST + r_, nk, vr + d_, vr_rs, acc + r_ * Dv + d_, Dv, \
                       alpha + r_);                                          \
        for (; d_ + AC_W <= Dv; d_ += AC_W)                                  \
            AC_F(ONE)(ST + r_, nk, vr + d_, vr_rs, acc + r_ * Dv + d_, Dv,  \
                      alpha + r_);                                           \
        if (d_ < Dv)                                                         \
            AC_F(TAIL)(ST + r_, nk, vr + d_, vr_rs, acc + r_ * Dv + d_, Dv, \
                       alpha + r_, Dv - d_);                                 \
    } while (0)

/* XT[d][r] = scale * x[r][d] for r < nr, 0 for nr <= r < P: a panel of
 * rows transposed (VPACK: register transposes of W x W blocks) */
static AC_TGT void AC_F(ac_pack_rows)(const float *x, ptrdiff_t x_rs, int nr,
                                      int D, float scale, float *XT)
{
    VPACK(x, x_rs, nr, D, scale, XT);
}

AC_DEF_QK(AC_KU, ac_qkmain)
AC_DEF_QK(2, ac_qk2)
AC_DEF_QK(1, ac_qk1)
AC_DEF_PV(AC_RU, AC_CV, ac_pv_main)
AC_DEF_PV(AC_RU, 1, ac_pv_one)
AC_DEF_PV_TAIL(AC_RU, ac_pv_tail)
AC_DEF_PV(2, AC_CV, ac_pv2_main)
AC_DEF_PV(2, 1, ac_pv2_one)
AC_DEF_PV_TAIL(2, ac_pv2_tail)
AC_DEF_PV(1, AC_CV, ac_pv1_main)
AC_DEF_PV(1, 1, ac_pv1_one)
AC_DEF_PV_TAIL(1, ac_pv1_tail)

/*
 * Attention of the query rows [i0, i0 + nr) (nr <= P) over keys [ks, ke):
 * the unnormalized accumulator goes to acc (nr x Dv, ld Dv, natural
 * layout), the running max (natural-log units) to m, the sum to l, and bad
 * is cleared, or -1 for a row whose scores left the float range in base-2
 * units or are NaN (see the end).  Returns 1 if a key tile was processed.
 * scratch: AC_FUSED_SCRATCH floats, 64-byte aligned.
 *
 * One panel may also run over consecutive key chunks in several calls
 * (phase AC_PH_INIT on the first, AC_PH_FINISH on the last): QT (D x P)
 * and state (2 P floats: running max and sum) then carry the panel from
 * call to call.  kc / vc, when not NULL, are the key / value rows of
 * [ks, ke) already converted to float (ld D / Dv): a query block converts
 * each chunk of int8 / half rows once for all its panels.
 */
static AC_TGT int AC_F(ac_fused_panel)(
    const ac_params *p, const float *q, const float *k, const float *v,
    const float *ksc, const float *vsc,
    const uint8_t *mb, const float *mf, ptrdiff_t i0, int nr, ptrdiff_t ks,
    ptrdiff_t ke, float *scratch, float *acc, float *m, float *l, int *bad,
    float *QT, float *state, int phase, const float *kc, const float *vc,
    const ac_bf16_chunk *bt)
{
#if !AC_BF16_PANEL
    (void)bt;
    const int i8 = 0;
#else
    /* int8 Q.K^T (ac_int8dot.h): int8 query / key rows */
    const int i8 = p->qk8 == 1 || p->qk8 == 2;
#endif
    /* int8 / half keys and values: each tile is converted into these
       buffers */
    float *KB = scratch + p->dq_off, *VB = KB + (ptrdiff_t)AC_BK * p->D;
    const int D = p->D, Dv = p->Dv;
    float *ST = scratch + (ptrdiff_t)D * AC_P;
    const float log2e = 1.44269504088896341f;
    /* scores in base-2 units: log2(e) goes into the query scale, or after
       the soft cap when there is one */
    const int capped = p->softcap > 0;
    const float qs = capped ? (float)p->scale : (float)p->scale * log2e;
    const float ninf = -INFINITY;

    float alpha[AC_P];
    VEC m0, m1, l0, l1;
    if (phase & AC_PH_INIT) {
        /* pack the panel: QT[d][r] = qs * q[i0 + r][d], zero rows beyond
           nr (half queries: converted to float rows first) */
        const float *qrow = q + i0 * p->q_rs;
        ptrdiff_t qrs = p->q_rs;
        if (p->qh) {
            float *QB = scratch + p->qb_off;
            ac_half_rows_f32(p->qh, (const uint16_t *)(const void *)q + i0 * p->q_rs, p->q_rs,
                             nr, D, QB, D);
            qrow = QB;
            qrs = D;
        }
#if AC_BF16_PANEL
        if (i8) /* offset bytes and the rows' scales (times qs) */
            ac_i8_pack_panel((const int8_t *)(const void *)q + i0 * p->q_rs, p->q_rs,
                             p->qsc + i0, nr, D, qs, (uint32_t *)(void *)QT);
        else if (bt) /* bfloat16 pairs, unscaled (the scale goes on the scores) */
            ac_pack_pairs_panel(qrow, qrs, nr, D, AC_P, (uint32_t *)(void *)QT);
        else
#endif
        AC_F(ac_pack_rows)(qrow, qrs, nr, D, qs, QT);
        /* the accumulator: natural layout, rows beyond nr never touched */
        memset(acc, 0, sizeof(float) * (size_t)nr * (size_t)Dv);
        m0 = VSET1(ninf);
        m1 = VSET1(ninf);
        l0 = VZERO();
        l1 = VZERO();
    } else {
        m0 = VLOAD(state);
        m1 = VLOAD(state + AC_W);
        l0 = VLOAD(state + AC_P);
        l1 = VLOAD(state + AC_P + AC_W);
    }
    ptrdiff_t kend = ke, kstart = ks;
    if (p->band) {
        /* the keys some row of the panel may see: skip the rest */
        ptrdiff_t lim = ac_causal_limit(p, i0 + nr - 1);
        if (lim < kend) kend = lim;
        ptrdiff_t lo = ac_band_lo(p, i0);
        if (lo > kstart) kstart = lo;
    }
    const ptrdiff_t off = ac_band_off(p);
    const ptrdiff_t right = ac_band_right(p);
    /* ALiBi where every key a row sees lies at or before the row's ALiBi
       diagonal (causal and windows ending there, no soft cap): with c the
       panel's middle row, -slope |i + M - N - j| = slope (j - c - (M - N))
       - slope (i - c), a per-key term the micro-kernel adds to its scores
       (no pass over the tile) and a per-row constant that the softmax
       ignores -- it is put back into the row's max (so the lse) at the end.
       Only for |slope| <= 1 (every model's slopes): the per-key term is up
       to |slope| AC_P / 2 larger than the true one, and float32 scores of
       that size lose the digits of q . k (a slope of 1e30 left nothing of
       them, and the lse came out as rounding noise); larger slopes take the
       explicit pass below, exact at each row's own diagonal. */
    int alibi_lin = p->alibi_on && !capped && right >= 0 &&
                    off + right <= (ptrdiff_t)p->M - p->N && fabs(p->alibi) <= 1.0;
#if AC_BF16_PANEL
    if (bt || i8) alibi_lin = 0;
#endif
    int processed = 0;
    for (ptrdiff_t jb = kstart; jb < kend; jb += AC_BK) {
        int nk = (int)((kend - jb < AC_BK) ? (kend - jb) : AC_BK);
        ptrdiff_t j0 = jb;
        if (p->mask_kind != AC_MASK_NONE) {
            int lo, hi;
            if (!ac_tile_range_f32(p, mb, mf, i0, nr, jb, nk, &lo, &hi))
                continue; /* whole tile masked out */
            j0 = jb + lo;
            nk = hi - lo;
        }
        /* band: does the tile reach past the first row's right edge, or
           before the last row's left edge? */
        const int diag = p->band && (j0 + nk > ac_causal_limit(p, i0) ||
                                     j0 < ac_band_lo(p, i0 + nr - 1));
        const int plain = (p->mask_kind == AC_MASK_NONE) && !diag && !capped &&
                          (!p->alibi_on || alibi_lin);

        /* the key / value rows of this tile, in place or dequantized */
        const float *kr = KB, *vr = VB;
        ptrdiff_t kr_rs = D, vr_rs = Dv;
        if (kc) {
            kr = kc + (j0 - ks) * D;
        } else if (i8) {
            /* int8 keys are read as they are (the scores below) */
        } else if (p->kq8) {
            AC_DEQUANT(float, (const int8_t *)(const void *)k + j0 * p->k_rs, p->k_rs,
                       ksc + j0 * p->ks_rs, p->ks_rs, nk, D, KB);
        } else if (p->kh) {
            ac_half_rows_f32(p->kh, (const uint16_t *)(const void *)k + j0 * p->k_rs, p->k_rs,
                             nk, D, KB, D);
        } else {
            kr = k + j0 * p->k_rs;
            kr_rs = p->k_rs;
        }
        if (vc) {
            vr = vc + (j0 - ks) * Dv;
        } else if (p->vq8) {
            AC_DEQUANT(float, (const int8_t *)(const void *)v + j0 * p->v_rs, p->v_rs,
                       vsc + j0 * p->vs_rs, p->vs_rs, nk, Dv, VB);
        } else if (p->vh) {
            ac_half_rows_f32(p->vh, (const uint16_t *)(const void *)v + j0 * p->v_rs, p->v_rs,
                             nk, Dv, VB, Dv);
        } else {
            vr = v + j0 * p->v_rs;
            vr_rs = p->v_rs;
        }

        /* ---- scores ---- */
        VEC t0 = VSET1(ninf), t1 = VSET1(ninf);
#if AC_BF16_PANEL
        if (i8) {
            ac_i8_scores(p->qk8, (const uint32_t *)(const void *)QT, (D + 3) / 4,
                         (const int8_t *)(const void *)k + j0 * p->k_rs, p->k_rs,
                         ksc + j0 * p->ks_rs, nk, ST, &t0, &t1);
        } else if (bt) {
            const int Dh = (D + 1) / 2;
            ac_bf16_scores(bt->mode, (const uint32_t *)(const void *)QT, Dh,
                           bt->k16 + (j0 - ks) * Dh, nk, qs, ST, &t0, &t1);
        } else
#endif
        {
            /* ALiBi as a per-key term of the scores (see alibi_lin) */
            float bias[AC_BK];
            const float *bl = NULL;
            if (alibi_lin) {
                const float s2 = (float)(p->alibi * 1.4426950408889634);
                const ptrdiff_t base = j0 - (i0 + AC_P / 2) - ((ptrdiff_t)p->M - p->N);
                for (int c = 0; c < nk; c++) bias[c] = s2 * (float)(base + c);
                bl = bias;
            }
            int j = 0;
            for (; j + AC_KU <= nk; j += AC_KU)
                AC_F(ac_qkmain)(QT, D, kr + j * kr_rs, kr_rs,
                                ST + (ptrdiff_t)j * AC_P, &t0, &t1, bl ? bl + j : NULL);
            for (; j + 2 <= nk; j += 2)
                AC_F(ac_qk2)(QT, D, kr + j * kr_rs, kr_rs,
                             ST + (ptrdiff_t)j * AC_P, &t0, &t1, bl ? bl + j : NULL);
            for (; j < nk; j++)
                AC_F(ac_qk1)(QT, D, kr + j * kr_rs, kr_rs,
                             ST + (ptrdiff_t)j * AC_P, &t0, &t1, bl ? bl + j : NULL);
        }
        int holes = 0; /* entries of the tile hidden by mask / causal */
        if (!plain) {
            /* mask and causal structure, then the tile max again */
            int touched = 0;
            const ptrdiff_t cs = p->mask_cs;
            if (capped) {
                /* s -> cap tanh(s / cap), then to base-2 units */
                const VEC icap = VSET1((float)(1.0 / p->softcap));
                const VEC cl = VSET1((float)p->softcap * log2e);
                for (int c = 0; c < nk; c++) {
                    float *sr = ST + (ptrdiff_t)c * AC_P;
                    VSTORE(sr, VMUL(cl, VTANH(VMUL(VLOAD(sr), icap))));
                    VSTORE(sr + AC_W, VMUL(cl, VTANH(VMUL(VLOAD(sr + AC_W), icap))));
                }
                touched = 1;
            }
            if (p->alibi_on && !alibi_lin) {
                /* ALiBi, after the soft cap, before the mask: score -=
                   slope |i + M - N - j| (base-2 units) */
                const VEC sl = VSET1((float)(-p->alibi * 1.4426950408889634));
                const VEC io0 = VIOTA(), io1 = VADD(VIOTA(), VSET1((float)AC_W));
                const ptrdiff_t base = i0 + (ptrdiff_t)p->M - p->N - j0;
                for (int c = 0; c < nk; c++) {
                    float *sr = ST + (ptrdiff_t)c * AC_P;
                    const VEC b = VSET1((float)(base - c));
                    VSTORE(sr, VFMA(sl, VABS(VADD(io0, b)), VLOAD(sr)));
                    VSTORE(sr + AC_W, VFMA(sl, VABS(VADD(io1, b)), VLOAD(sr + AC_W)));
                }
                touched = 1;
            }
            if (p->mask_kind != AC_MASK_NONE && p->mask_rs == 0) {
                /* one mask row for every query row (key padding) */
                for (int c = 0; c < nk; c++) {
                    float *sr = ST + (ptrdiff_t)c * AC_P;
                    const ptrdiff_t j = j0 + c;
                    if (mb) {
                        if (!mb[j * cs]) {
                            VSTORE(sr, VSET1(ninf));
                            VSTORE(sr + AC_W, VSET1(ninf));
                            holes = 1;
                        }
                    } else {
                        const float mv = mf[j * cs];
                        if (mv == ninf) {
                            VSTORE(sr, VSET1(ninf));
                            VSTORE(sr + AC_W, VSET1(ninf));
                            holes = 1;
                        } else if (mv != 0) {
                            const VEC a = VSET1(mv * log2e);
                            VSTORE(sr, VADD(VLOAD(sr), a));
                            VSTORE(sr + AC_W, VADD(VLOAD(sr + AC_W), a));
                            touched = 1;
                        }
                    }
                }
            } else if (p->mask_kind != AC_MASK_NONE) {
                for (int r = 0; r < nr; r++) {
                    const ptrdiff_t i = i0 + r;
                    float *sc = ST + r;
                    if (mb) {
                        const uint8_t *mr = mb + i * p->mask_rs + j0 * cs;
                        for (int c = 0; c < nk; c++)
                            if (!mr[c * cs]) {
                                sc[(ptrdiff_t)c * AC_P] = ninf;
                                holes = 1;
                            }
                    } else {
                        const float *mr = mf + i * p->mask_rs + j0 * cs;
                        for (int c = 0; c < nk; c++) {
                            const float mv = mr[c * cs];
                            float *e = sc + (ptrdiff_t)c * AC_P;
                            if (mv == ninf) {
                                *e = ninf;
                                holes = 1;
                            } else {
                                *e += mv * log2e;
                            }
                        }
                        touched = 1;
                    }
                }
            }
            if (diag) {
                /* key j is hidden from rows i with j > i + off + right
                   (lanes r <= t) and with j < i + off - win_l (lanes
                   r >= u) */
                for (int c = 0; c < nk; c++) {
                    float *sr = ST + (ptrdiff_t)c * AC_P;
                    const ptrdiff_t j = j0 + c;
                    if (right >= 0) {
                        const ptrdiff_t t = j - off - right - 1 - i0;
                        if (t >= 0) {
                            VSTORE(sr, VCAUSAL(VLOAD(sr), 0, t));
                            VSTORE(sr + AC_W, VCAUSAL(VLOAD(sr + AC_W), AC_W, t));
                        }
                    }
                    if (p->win_l >= 0) {
                        const ptrdiff_t u = j - off + p->win_l + 1 - i0;
                        if (u < AC_P) {
                            VSTORE(sr, VHIDE_FROM(VLOAD(sr), 0, u));
                            VSTORE(sr + AC_W, VHIDE_FROM(VLOAD(sr + AC_W), AC_W, u));
                        }
                    }
                }
                holes = 1;
            }
            if (holes || touched) {
                t0 = VSET1(ninf);
                t1 = VSET1(ninf);
                for (int c = 0; c < nk; c++) {
                    t0 = VMAX(VLOAD(ST + (ptrdiff_t)c * AC_P), t0);
                    t1 = VMAX(VLOAD(ST + (ptrdiff_t)c * AC_P + AC_W), t1);
                }
            }
        }

        /* ---- online softmax, per lane ---- */
        const VEC n0 = VMAX(t0, m0), n1 = VMAX(t1, m1);
        const VEC s0 = VZERO_IF_NINF(n0), s1 = VZERO_IF_NINF(n1);
        const VEC al0 = VEXP2(VSUB(m0, s0)), al1 = VEXP2(VSUB(m1, s1));
        VEC u0 = VZERO(), u1 = VZERO(), w0 = VZERO(), w1 = VZERO();
        {
            int c = 0;
            for (; c + 2 <= nk; c += 2) {
                float *sr = ST + (ptrdiff_t)c * AC_P;
                const VEC e0 = VEXP2(VSUB(VLOAD(sr), s0));
                const VEC e1 = VEXP2(VSUB(VLOAD(sr + AC_W), s1));
                const VEC e2 = VEXP2(VSUB(VLOAD(sr + AC_P), s0));
                const VEC e3 = VEXP2(VSUB(VLOAD(sr + AC_P + AC_W), s1));
                VSTORE(sr, e0);
                VSTORE(sr + AC_W, e1);
                VSTORE(sr + AC_P, e2);
                VSTORE(sr + AC_P + AC_W, e3);
                u0 = VADD(u0, e0);
                u1 = VADD(u1, e1);
                w0 = VADD(w0, e2);
                w1 = VADD(w1, e3);
            }
            for (; c < nk; c++) {
                float *sr = ST + (ptrdiff_t)c * AC_P;
                const VEC e0 = VEXP2(VSUB(VLOAD(sr), s0));
                const VEC e1 = VEXP2(VSUB(VLOAD(sr + AC_W), s1));
                VSTORE(sr, e0);
                VSTORE(sr + AC_W, e1);
                u0 = VADD(u0, e0);
                u1 = VADD(u1, e1);
            }
        }
        l0 = VADD(VMUL(l0, al0), VADD(u0, w0));
        l1 = VADD(VMUL(l1, al1), VADD(u1, w1));
        m0 = n0;
        m1 = n1;

        /* ---- P.V ---- */
        VSTORE(alpha, al0);
        VSTORE(alpha + AC_W, al1);
        if (holes && ac_rows_nonfinite_f32(vr, nk, Dv, vr_rs)) {
            /* inf / NaN among these values: multiply attended keys only,
               so that 0 * inf never reaches a query */
            const ptrdiff_t cs = p->mask_cs;
            for (int r = 0; r < nr; r++) {
                float *ar = acc + (ptrdiff_t)r * Dv;
                for (int d = 0; d < Dv; d++) ar[d] *= alpha[r];
                const ptrdiff_t i = i0 + r;
                int c0, ncol;
                ac_band_cols(p, i, j0, nk, &c0, &ncol);
                for (int c = c0; c < ncol; c++) {
                    const ptrdiff_t j = j0 + c;
                    if (mb && !mb[i * p->mask_rs + j * cs]) continue;
                    if (mf && mf[i * p->mask_rs + j * cs] == ninf) continue;
                    const float pc = ST[(ptrdiff_t)c * AC_P + r];
                    const float *vj = vr + (ptrdiff_t)c * vr_rs;
                    for (int d = 0; d < Dv; d++) ar[d] += pc * vj[d];
                }
            }
        }
#if AC_BF16_PANEL
        else if (bt && bt->vfin) {
            /* probabilities rounded to bfloat16 pairs; the pairs of VI
               start at the chunk's first key: a tile starting at an odd
               offset takes a zero probability for the key before it */
            const int shift = (int)((j0 - ks) & 1);
            const int npairs = (shift + nk + 1) / 2;
            ac_pack_probs(ST, -shift, nk, bt->pt2, npairs);
            ac_bf16_pv_rows(bt->mode, bt->pt2, npairs, bt->vi + ((j0 - ks - shift) / 2) * Dv,
                            Dv, acc, alpha, nr);
        }
#endif
        else {
            int r_ = 0;
            for (; r_ + AC_RU <= nr; r_ += AC_RU)
                AC_PV_ROWS(AC_RU, ac_pv_main, ac_pv_one, ac_pv_tail);
            for (; r_ + 2 <= nr; r_ += 2)
                AC_PV_ROWS(2, ac_pv2_main, ac_pv2_one, ac_pv2_tail);
            for (; r_ < nr; r_++)
                AC_PV_ROWS(1, ac_pv1_main, ac_pv1_one, ac_pv1_tail);
        }
        processed = 1;
    }

    if (!(phase & AC_PH_FINISH)) {
        VSTORE(state, m0);
        VSTORE(state + AC_W, m1);
        VSTORE(state + AC_P, l0);
        VSTORE(state + AC_P + AC_W, l1);
        return processed;
    }
    /* ---- row statistics (the accumulator is already in place) ---- */
    {
        float mm[AC_P], ll[AC_P];
        VSTORE(mm, m0);
        VSTORE(mm + AC_W, m1);
        VSTORE(ll, l0);
        VSTORE(ll + AC_W, l1);
        const float ln2 = 0.693147180559945309f;
        /* Out of range in base-2 units: a score or float mask entry beyond
           FLT_MAX / log2(e) gives +inf (l NaN) or -inf (a row that attends
           keys but has no finite score).  NaN from the inputs also shows
           as l NaN.  Such a row is flagged bad = -1: the caller computes
           it again in natural units. */
        for (int r = 0; r < nr; r++) {
            m[r] = mm[r] * ln2;
            if (alibi_lin && mm[r] > -INFINITY && mm[r] < INFINITY)
                m[r] -= (float)(p->alibi * (r - AC_P / 2));  /* the row's ALiBi term */
            l[r] = ll[r];
            bad[r] = (!(ll[r] <= FLT_MAX) || mm[r] == INFINITY ||
                      (processed && mm[r] == -INFINITY &&
                       ac_row_attends_f32(p, mb, mf, i0 + r, ks, ke))) ? -1 : 0;
        }
    }
    return processed;
}


/*
 * Dense layer rows on the same micro-kernel: out[r0 + r][c] = x_r . w_c
 * (+ bias[c]) for r < nr <= P and c in [c0, c1).  The x rows are packed
 * transposed into XT (K x P) and act as the "queries"; the rows of w are
 * read in place through broadcasts like keys.  T: AC_KU x P scratch.
 */
static AC_TGT void AC_F(ac_linear_panel)(const float *x, ptrdiff_t x_rs, int nr,
                                         const float *w, ptrdiff_t w_rs,
                                         const float *bias, float *out,
                                         ptrdiff_t o_rs, int c0, int c1, int K,
                                         float *XT, float *T)
{
    AC_F(ac_pack_rows)(x, x_rs, nr, K, 1.0f, XT);
    VEC t0 = VZERO(), t1 = VZERO();
    int c = c0;
    for (; c < c1; c += AC_KU) {
        const int nc = (c1 - c < AC_KU) ? c1 - c : AC_KU;
        if (nc == AC_KU) {
            AC_F(ac_qkmain)(XT, K, w + c * w_rs, w_rs, T, &t0, &t1, NULL);
        } else {
            for (int u = 0; u < nc; u++)
                AC_F(ac_qk1)(XT, K, w + (c + u) * w_rs, w_rs, T + u * AC_P, &t0, &t1, NULL);
        }
        /* row by row: each row's nc values are adjacent (column by column,
           rows 4 KiB apart all fall in one L1 set) */
        for (int r = 0; r < nr; r++) {
            float *orow = out + r * o_rs + c;
            for (int u = 0; u < nc; u++)
                orow[u] = T[u * AC_P + r] + (bias ? bias[c + u] : 0.0f);
        }
    }
}

#undef AC_F
#undef AC_FCAT
#undef AC_FCAT3
