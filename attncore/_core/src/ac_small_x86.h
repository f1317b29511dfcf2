/*
 * ac_small_x86.h -- AVX-512 products for query blocks of a few rows
 * (decoding, one decoder step of a seq2seq model).
 *
 * At these sizes the work is streaming K and V once; the portable loops in
 * ac_sdpa_impl.inc spend most of their time in the horizontal sum of every
 * dot product and in reloading / storing the accumulator for every key.
 * Here four keys are scored at once (independent FMA chains, one reduction
 * each) and the P.V accumulator lives in registers across all keys.
 *
 * Compiled with the AVX-512 target attribute (ac_cpu.h) and chosen at run
 * time (the AVX-512 path), so the extension still runs on CPUs without it.
 */
#ifndef AC_SMALL_X86_H
#define AC_SMALL_X86_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include "ac_cpu.h"

#if AC_HAVE_X86

/* the 16 horizontal sums of a[0..15], lane i = sum of a[i]: a transposing
 * tree of adds (45 shuffles / adds for 16 sums, against about 10 per sum
 * for one reduction at a time) */
static AC_TGT_AVX512F inline __attribute__((always_inline)) __m512 ac_hsum16_avx512(const __m512 *a)
{
    __m512 t[8], u[4];
    for (int i = 0; i < 8; i++)
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    /* t[i], 128-bit lane L: partial sums of a[2i], a[2i+1], a[2i], a[2i+1] */
    for (int i = 0; i < 4; i++) {
        const __m512d x = _mm512_castps_pd(t[2 * i]), y = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    /* u[g], lane L: partial sums (over lane L's elements) of a[4g .. 4g+3] */
    const __m512 x01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x44),
                                     _mm512_shuffle_f32x4(u[0], u[1], 0xEE));
    const __m512 x23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x44),
                                     _mm512_shuffle_f32x4(u[2], u[3], 0xEE));
    return _mm512_add_ps(_mm512_shuffle_f32x4(x01, x23, 0x88),
                         _mm512_shuffle_f32x4(x01, x23, 0xDD));
}

/* S[r, j] = scale * q_r . k_j for r < NQ, j < nk: each key row is loaded
   once for all the rows (a row's keys read again per query row would
   come from L2 -- or further: the rows of a paged cache block lie a
   4 KiB multiple apart and compete for one L1 set) */
static AC_TGT_AVX512F inline __attribute__((always_inline)) void ac_scores_rows_avx512(
    const int NQ, int nk, int D, float scale, const float *q, ptrdiff_t q_rs,
    const float *k, ptrdiff_t k_rs, float *S, int ldS)
{
    const int Dm = D & ~15;
    const __mmask16 tail = (__mmask16)((1u << (D - Dm)) - 1u);
    int j = 0;
    /* accumulators of row r, key t: a<r><t> (named: an array of 16
       vectors would live in memory) */
#define AC_RQ4(r)                                                             \
    __m512 a##r##0 = _mm512_setzero_ps(), a##r##1 = _mm512_setzero_ps();      \
    __m512 a##r##2 = _mm512_setzero_ps(), a##r##3 = _mm512_setzero_ps()
#define AC_FQ4(r, LOADQ)                                                      \
    if (NQ > r) {                                                             \
        const __m512 qv = LOADQ;                                              \
        a##r##0 = _mm512_fmadd_ps(qv, x0, a##r##0);                           \
        a##r##1 = _mm512_fmadd_ps(qv, x1, a##r##1);                           \
        a##r##2 = _mm512_fmadd_ps(qv, x2, a##r##2);                           \
        a##r##3 = _mm512_fmadd_ps(qv, x3, a##r##3);                           \
    }
#define AC_SQ4(r)                                                             \
    if (NQ > r) {                                                             \
        float *Sr_ = S + (ptrdiff_t)r * ldS + j;                              \
        Sr_[0] = _mm512_reduce_add_ps(a##r##0) * scale;                       \
        Sr_[1] = _mm512_reduce_add_ps(a##r##1) * scale;                       \
        Sr_[2] = _mm512_reduce_add_ps(a##r##2) * scale;                       \
        Sr_[3] = _mm512_reduce_add_ps(a##r##3) * scale;                       \
    }
    for (; j + 4 <= nk; j += 4) {
        const float *k0 = k + (ptrdiff_t)j * k_rs;
        const float *k1 = k0 + k_rs, *k2 = k1 + k_rs, *k3 = k2 + k_rs;
        AC_RQ4(0); AC_RQ4(1); AC_RQ4(2); AC_RQ4(3);
        int d = 0;
        for (; d < Dm; d += 16) {
            const __m512 x0 = _mm512_loadu_ps(k0 + d), x1 = _mm512_loadu_ps(k1 + d);
            const __m512 x2 = _mm512_loadu_ps(k2 + d), x3 = _mm512_loadu_ps(k3 + d);
            AC_FQ4(0, _mm512_loadu_ps(q + d))
            AC_FQ4(1, _mm512_loadu_ps(q + q_rs + d))
            AC_FQ4(2, _mm512_loadu_ps(q + 2 * q_rs + d))
            AC_FQ4(3, _mm512_loadu_ps(q + 3 * q_rs + d))
        }
        if (tail) {
            const __m512 x0 = _mm512_maskz_loadu_ps(tail, k0 + d);
            const __m512 x1 = _mm512_maskz_loadu_ps(tail, k1 + d);
            const __m512 x2 = _mm512_maskz_loadu_ps(tail, k2 + d);
            const __m512 x3 = _mm512_maskz_loadu_ps(tail, k3 + d);
            AC_FQ4(0, _mm512_maskz_loadu_ps(tail, q + d))
            AC_FQ4(1, _mm512_maskz_loadu_ps(tail, q + q_rs + d))
            AC_FQ4(2, _mm512_maskz_loadu_ps(tail, q + 2 * q_rs + d))
            AC_FQ4(3, _mm512_maskz_loadu_ps(tail, q + 3 * q_rs + d))
        }
        if (NQ == 4) {
            /* the 16 scores at once; row r's four are lane r */
            const __m512 a16[16] = {a00, a01, a02, a03, a10, a11, a12, a13,
                                    a20, a21, a22, a23, a30, a31, a32, a33};
            const __m512 sums = _mm512_mul_ps(ac_hsum16_avx512(a16), _mm512_set1_ps(scale));
            _mm_storeu_ps(S + j, _mm512_extractf32x4_ps(sums, 0));
            _mm_storeu_ps(S + ldS + j, _mm512_extractf32x4_ps(sums, 1));
            _mm_storeu_ps(S + 2 * (ptrdiff_t)ldS + j, _mm512_extractf32x4_ps(sums, 2));
            _mm_storeu_ps(S + 3 * (ptrdiff_t)ldS + j, _mm512_extractf32x4_ps(sums, 3));
        } else {
            AC_SQ4(0) AC_SQ4(1) AC_SQ4(2) AC_SQ4(3)
        }
    }
#undef AC_RQ4
#undef AC_FQ4
#undef AC_SQ4
    for (; j < nk; j++) {
        const float *kj = k + (ptrdiff_t)j * k_rs;
        __m512 a[4];
        for (int r = 0; r < NQ; r++) a[r] = _mm512_setzero_ps();
        int d = 0;
        for (; d < Dm; d += 16) {
            const __m512 x = _mm512_loadu_ps(kj + d);
            for (int r = 0; r < NQ; r++)
                a[r] = _mm512_fmadd_ps(_mm512_loadu_ps(q + r * q_rs + d), x, a[r]);
        }
        if (tail) {
            const __m512 x = _mm512_maskz_loadu_ps(tail, kj + d);
            for (int r = 0; r < NQ; r++)
                a[r] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, q + r * q_rs + d), x, a[r]);
        }
        for (int r = 0; r < NQ; r++) S[(ptrdiff_t)r * ldS + j] = _mm512_reduce_add_ps(a[r]) * scale;
    }
}

/* S[r, j] = scale * q_r . k_j for r < nq (at most 4 at a time), j < nk */
static AC_TGT_AVX512F void ac_scores_small_f32_avx512(
    int nq, int nk, int D, float scale, const float *q, ptrdiff_t q_rs,
    const float *k, ptrdiff_t k_rs, float *S, int ldS)
{
    for (int r = 0; r < nq; r += 4) {
        const float *qr = q + r * q_rs;
        float *Sr = S + (ptrdiff_t)r * ldS;
        switch (nq - r >= 4 ? 4 : nq - r) {
        case 1: ac_scores_rows_avx512(1, nk, D, scale, qr, q_rs, k, k_rs, Sr, ldS); break;
        case 2: ac_scores_rows_avx512(2, nk, D, scale, qr, q_rs, k, k_rs, Sr, ldS); break;
        case 3: ac_scores_rows_avx512(3, nk, D, scale, qr, q_rs, k, k_rs, Sr, ldS); break;
        default: ac_scores_rows_avx512(4, nk, D, scale, qr, q_rs, k, k_rs, Sr, ldS); break;
        }
    }
}

/* acc[r, :] (+)= sum_j P[r, j] v_j for r < NQ, in column chunks of 4
   vectors kept in registers across all keys: each value row is loaded
   once for all the rows (one row: ac_pv_row_avx512, 8 vectors a chunk) */
static AC_TGT_AVX512F inline __attribute__((always_inline)) void ac_pv_rows_avx512(
    const int NQ, int nk, int Dv, const float *S, int ldS, const float *v, ptrdiff_t v_rs,
    float *acc, int first)
{
    for (int c0 = 0; c0 < Dv; c0 += 64) {
        const int cw = (Dv - c0 < 64) ? (Dv - c0) : 64;
        const int nv = (cw + 15) >> 4;
        const __mmask16 last = (__mmask16)((cw & 15) ? ((1u << (cw & 15)) - 1u) : 0xFFFFu);
        __mmask16 mk[4];
        for (int t = 0; t < 4; t++) mk[t] = t < nv - 1 ? 0xFFFF : (t == nv - 1 ? last : 0);
        /* accumulators of row r, vector t: x<r><t> (named, in registers) */
#define AC_XL(r, t)                                                           \
    __m512 x##r##t = (NQ > r && !first)                                       \
        ? _mm512_maskz_loadu_ps(mk[t], acc + (ptrdiff_t)r * Dv + c0 + 16 * t) \
        : _mm512_setzero_ps()
#define AC_XR(r) AC_XL(r, 0); AC_XL(r, 1); AC_XL(r, 2); AC_XL(r, 3)
#define AC_XF(r)                                                              \
    if (NQ > r) {                                                             \
        const __m512 pj = _mm512_set1_ps(S[(ptrdiff_t)r * ldS + j]);          \
        x##r##0 = _mm512_fmadd_ps(pj, v0, x##r##0);                           \
        x##r##1 = _mm512_fmadd_ps(pj, v1, x##r##1);                           \
        x##r##2 = _mm512_fmadd_ps(pj, v2, x##r##2);                           \
        x##r##3 = _mm512_fmadd_ps(pj, v3, x##r##3);                           \
    }
#define AC_XS(r)                                                              \
    if (NQ > r) {                                                             \
        float *ar_ = acc + (ptrdiff_t)r * Dv + c0;                            \
        _mm512_mask_storeu_ps(ar_, mk[0], x##r##0);                           \
        if (nv > 1) _mm512_mask_storeu_ps(ar_ + 16, mk[1], x##r##1);          \
        if (nv > 2) _mm512_mask_storeu_ps(ar_ + 32, mk[2], x##r##2);          \
        if (nv > 3) _mm512_mask_storeu_ps(ar_ + 48, mk[3], x##r##3);          \
    }
        AC_XR(0); AC_XR(1); AC_XR(2); AC_XR(3);
        const float *vc = v + c0;
        if (nv == 4 && last == 0xFFFF) {
            for (int j = 0; j < nk; j++, vc += v_rs) {
                const __m512 v0 = _mm512_loadu_ps(vc), v1 = _mm512_loadu_ps(vc + 16);
                const __m512 v2 = _mm512_loadu_ps(vc + 32), v3 = _mm512_loadu_ps(vc + 48);
                AC_XF(0) AC_XF(1) AC_XF(2) AC_XF(3)
            }
        } else {
            for (int j = 0; j < nk; j++, vc += v_rs) {
                const __m512 v0 = _mm512_maskz_loadu_ps(mk[0], vc);
                const __m512 v1 = _mm512_maskz_loadu_ps(mk[1], vc + 16);
                const __m512 v2 = _mm512_maskz_loadu_ps(mk[2], vc + 32);
                const __m512 v3 = _mm512_maskz_loadu_ps(mk[3], vc + 48);
                AC_XF(0) AC_XF(1) AC_XF(2) AC_XF(3)
            }
        }
        AC_XS(0) AC_XS(1) AC_XS(2) AC_XS(3)
#undef AC_XL
#undef AC_XR
#undef AC_XF
#undef AC_XS
    }
}

/* acc[:] (+)= sum_j P[j] v_j for one row, columns in chunks of up to 8
   vectors (128 floats) kept in registers */
static AC_TGT_AVX512F inline void ac_pv_row_avx512(int nk, int Dv, const float *Sr,
                                                   const float *v, ptrdiff_t v_rs, float *ar,
                                                   int first)
{
    for (int c0 = 0; c0 < Dv; c0 += 128) {
        const int cw = (Dv - c0 < 128) ? (Dv - c0) : 128;
        const int nv = (cw + 15) >> 4;
        const __mmask16 last = (__mmask16)((cw & 15) ? ((1u << (cw & 15)) - 1u) : 0xFFFFu);
        __m512 x0, x1, x2, x3, x4, x5, x6, x7;
        x0 = x1 = x2 = x3 = x4 = x5 = x6 = x7 = _mm512_setzero_ps();
        if (!first && nv == 8 && last == 0xFFFF) {
            x0 = _mm512_loadu_ps(ar + c0);
            x1 = _mm512_loadu_ps(ar + c0 + 16);
            x2 = _mm512_loadu_ps(ar + c0 + 32);
            x3 = _mm512_loadu_ps(ar + c0 + 48);
            x4 = _mm512_loadu_ps(ar + c0 + 64);
            x5 = _mm512_loadu_ps(ar + c0 + 80);
            x6 = _mm512_loadu_ps(ar + c0 + 96);
            x7 = _mm512_loadu_ps(ar + c0 + 112);
        }
        const float *vc = v + c0;
        if (nv == 8 && last == 0xFFFF) {
            for (int j = 0; j < nk; j++, vc += v_rs) {
                const __m512 pj = _mm512_set1_ps(Sr[j]);
                x0 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vc + 0), x0);
                x1 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vc + 16), x1);
                x2 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vc + 32), x2);
                x3 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vc + 48), x3);
                x4 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vc + 64), x4);
                x5 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vc + 80), x5);
                x6 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vc + 96), x6);
                x7 = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vc + 112), x7);
            }
            float *o = ar + c0;
            _mm512_storeu_ps(o, x0);
            _mm512_storeu_ps(o + 16, x1);
            _mm512_storeu_ps(o + 32, x2);
            _mm512_storeu_ps(o + 48, x3);
            _mm512_storeu_ps(o + 64, x4);
            _mm512_storeu_ps(o + 80, x5);
            _mm512_storeu_ps(o + 96, x6);
            _mm512_storeu_ps(o + 112, x7);
        } else {
            /* a partial chunk: 4 vectors at a time */
            ac_pv_rows_avx512(1, nk, cw, Sr, 0, vc, v_rs, ar + c0, first);
        }
    }
}

/* acc[r, :] (+)= sum_j P[r, j] v_j ; acc is nq x Dv contiguous */
static AC_TGT_AVX512F void ac_pv_small_f32_avx512(
    int nq, int nk, int Dv, const float *S, int ldS, const float *v,
    ptrdiff_t v_rs, float *acc, int first)
{
    for (int r = 0; r < nq; r += 4) {
        const float *Sr = S + (ptrdiff_t)r * ldS;
        float *ar = acc + (ptrdiff_t)r * Dv;
        switch (nq - r >= 4 ? 4 : nq - r) {
        case 1: ac_pv_row_avx512(nk, Dv, Sr, v, v_rs, ar, first); break;
        case 2: ac_pv_rows_avx512(2, nk, Dv, Sr, ldS, v, v_rs, ar, first); break;
        case 3: ac_pv_rows_avx512(3, nk, Dv, Sr, ldS, v, v_rs, ar, first); break;
        default: ac_pv_rows_avx512(4, nk, Dv, Sr, ldS, v, v_rs, ar, first); break;
        }
    }
}

/* 16 int8 values from p as floats; n < 16 reads only the first n (the
 * rest are 0) */
static AC_TGT_AVX512F inline __m512 ac_i8x16(const int8_t *p, int n)
{
    if (n >= 16)
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    int8_t tmp[16] = {0};
    memcpy(tmp, p, (size_t)n);
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)tmp)));
}

/* S[r, j] = scale * ks[j] * (q_r . k8_j): int8 keys scored without a float
 * copy (decoding at a quarter of the key bytes) */
static AC_TGT_AVX512F void ac_scores_small_q8_avx512(
    int nq, int nk, int D, float scale, const float *q, ptrdiff_t q_rs,
    const int8_t *k, ptrdiff_t k_rs, const float *ks, ptrdiff_t ks_rs,
    float *S, int ldS)
{
    const int Dm = D & ~15;
    const __mmask16 tail = (__mmask16)((1u << (D - Dm)) - 1u);
    for (int r = 0; r < nq; r++) {
        const float *qr = q + r * q_rs;
        float *Sr = S + (ptrdiff_t)r * ldS;
        int j = 0;
        for (; j + 4 <= nk; j += 4) {
            const int8_t *k0 = k + (ptrdiff_t)j * k_rs;
            const int8_t *k1 = k0 + k_rs, *k2 = k1 + k_rs, *k3 = k2 + k_rs;
            __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
            __m512 a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
            int d = 0;
            for (; d < Dm; d += 16) {
                const __m512 qv = _mm512_loadu_ps(qr + d);
                a0 = _mm512_fmadd_ps(qv, ac_i8x16(k0 + d, 16), a0);
                a1 = _mm512_fmadd_ps(qv, ac_i8x16(k1 + d, 16), a1);
                a2 = _mm512_fmadd_ps(qv, ac_i8x16(k2 + d, 16), a2);
                a3 = _mm512_fmadd_ps(qv, ac_i8x16(k3 + d, 16), a3);
            }
            if (tail) {
                const __m512 qv = _mm512_maskz_loadu_ps(tail, qr + d);
                a0 = _mm512_fmadd_ps(qv, ac_i8x16(k0 + d, D - Dm), a0);
                a1 = _mm512_fmadd_ps(qv, ac_i8x16(k1 + d, D - Dm), a1);
                a2 = _mm512_fmadd_ps(qv, ac_i8x16(k2 + d, D - Dm), a2);
                a3 = _mm512_fmadd_ps(qv, ac_i8x16(k3 + d, D - Dm), a3);
            }
            Sr[j + 0] = _mm512_reduce_add_ps(a0) * (scale * ks[(ptrdiff_t)(j + 0) * ks_rs]);
            Sr[j + 1] = _mm512_reduce_add_ps(a1) * (scale * ks[(ptrdiff_t)(j + 1) * ks_rs]);
            Sr[j + 2] = _mm512_reduce_add_ps(a2) * (scale * ks[(ptrdiff_t)(j + 2) * ks_rs]);
            Sr[j + 3] = _mm512_reduce_add_ps(a3) * (scale * ks[(ptrdiff_t)(j + 3) * ks_rs]);
        }
        for (; j < nk; j++) {
            const int8_t *kj = k + (ptrdiff_t)j * k_rs;
            __m512 a0 = _mm512_setzero_ps();
            int d = 0;
            for (; d < Dm; d += 16)
                a0 = _mm512_fmadd_ps(_mm512_loadu_ps(qr + d), ac_i8x16(kj + d, 16), a0);
            if (tail)
                a0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, qr + d), ac_i8x16(kj + d, D - Dm), a0);
            Sr[j] = _mm512_reduce_add_ps(a0) * (scale * ks[(ptrdiff_t)j * ks_rs]);
        }
    }
}

/* acc[r, :] (+)= sum_j P[r, j] vs[j] v8_j (acc nq x Dv contiguous) */
static AC_TGT_AVX512F void ac_pv_small_q8_avx512(
    int nq, int nk, int Dv, const float *S, int ldS, const int8_t *v,
    ptrdiff_t v_rs, const float *vs, ptrdiff_t vs_rs, float *acc, int first)
{
    for (int r = 0; r < nq; r++) {
        const float *Sr = S + (ptrdiff_t)r * ldS;
        float *ar = acc + (ptrdiff_t)r * Dv;
        for (int c0 = 0; c0 < Dv; c0 += 128) {
            const int cw = (Dv - c0 < 128) ? (Dv - c0) : 128;
            const int nv = (cw + 15) >> 4;
            const int lastn = cw - 16 * (nv - 1);
            const __mmask16 last = (__mmask16)((lastn == 16) ? 0xFFFFu : ((1u << lastn) - 1u));
            __m512 x[8];
            for (int t = 0; t < 8; t++) x[t] = _mm512_setzero_ps();
            if (!first)
                for (int t = 0; t < nv; t++)
                    x[t] = _mm512_maskz_loadu_ps(t == nv - 1 ? last : 0xFFFF, ar + c0 + 16 * t);
            const int8_t *vc = v + c0;
            if (nv == 4 && lastn == 16) {
                for (int j = 0; j < nk; j++, vc += v_rs) {
                    const __m512 pj = _mm512_set1_ps(Sr[j] * vs[(ptrdiff_t)j * vs_rs]);
                    x[0] = _mm512_fmadd_ps(pj, ac_i8x16(vc + 0, 16), x[0]);
                    x[1] = _mm512_fmadd_ps(pj, ac_i8x16(vc + 16, 16), x[1]);
                    x[2] = _mm512_fmadd_ps(pj, ac_i8x16(vc + 32, 16), x[2]);
                    x[3] = _mm512_fmadd_ps(pj, ac_i8x16(vc + 48, 16), x[3]);
                }
            } else {
                for (int j = 0; j < nk; j++, vc += v_rs) {
                    const __m512 pj = _mm512_set1_ps(Sr[j] * vs[(ptrdiff_t)j * vs_rs]);
                    for (int t = 0; t < nv; t++)
                        x[t] = _mm512_fmadd_ps(pj, ac_i8x16(vc + 16 * t, t == nv - 1 ? lastn : 16),
                                               x[t]);
                }
            }
            for (int t = 0; t < nv; t++)
                _mm512_mask_storeu_ps(ar + c0 + 16 * t, t == nv - 1 ? last : 0xFFFF, x[t]);
        }
    }
}

#endif /* AC_HAVE_X86 */

#endif /* AC_SMALL_X86_H */
