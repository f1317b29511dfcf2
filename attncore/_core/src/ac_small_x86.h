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

/* S[r, j] = scale * q_r . k_j for r < nq, j < nk */
static AC_TGT_AVX512F void ac_scores_small_f32_avx512(
    int nq, int nk, int D, float scale, const float *q, ptrdiff_t q_rs,
    const float *k, ptrdiff_t k_rs, float *S, int ldS)
{
    const int Dm = D & ~15;
    const __mmask16 tail = (__mmask16)((1u << (D - Dm)) - 1u);
    for (int r = 0; r < nq; r++) {
        const float *qr = q + r * q_rs;
        float *Sr = S + (ptrdiff_t)r * ldS;
        int j = 0;
        for (; j + 4 <= nk; j += 4) {
            const float *k0 = k + (ptrdiff_t)j * k_rs;
            const float *k1 = k0 + k_rs, *k2 = k1 + k_rs, *k3 = k2 + k_rs;
            __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
            __m512 a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();
            int d = 0;
            for (; d < Dm; d += 16) {
                __m512 qv = _mm512_loadu_ps(qr + d);
                a0 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k0 + d), a0);
                a1 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k1 + d), a1);
                a2 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k2 + d), a2);
                a3 = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k3 + d), a3);
            }
            if (tail) {
                __m512 qv = _mm512_maskz_loadu_ps(tail, qr + d);
                a0 = _mm512_fmadd_ps(qv, _mm512_maskz_loadu_ps(tail, k0 + d), a0);
                a1 = _mm512_fmadd_ps(qv, _mm512_maskz_loadu_ps(tail, k1 + d), a1);
                a2 = _mm512_fmadd_ps(qv, _mm512_maskz_loadu_ps(tail, k2 + d), a2);
                a3 = _mm512_fmadd_ps(qv, _mm512_maskz_loadu_ps(tail, k3 + d), a3);
            }
            Sr[j + 0] = _mm512_reduce_add_ps(a0) * scale;
            Sr[j + 1] = _mm512_reduce_add_ps(a1) * scale;
            Sr[j + 2] = _mm512_reduce_add_ps(a2) * scale;
            Sr[j + 3] = _mm512_reduce_add_ps(a3) * scale;
        }
        for (; j < nk; j++) {
            const float *kj = k + (ptrdiff_t)j * k_rs;
            __m512 a0 = _mm512_setzero_ps();
            int d = 0;
            for (; d < Dm; d += 16)
                a0 = _mm512_fmadd_ps(_mm512_loadu_ps(qr + d), _mm512_loadu_ps(kj + d), a0);
            if (tail)
                a0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, qr + d),
                                     _mm512_maskz_loadu_ps(tail, kj + d), a0);
            Sr[j] = _mm512_reduce_add_ps(a0) * scale;
        }
    }
}

/* acc[r, :] (+)= sum_j P[r, j] v_j ; acc is nq x Dv contiguous */
static AC_TGT_AVX512F void ac_pv_small_f32_avx512(
    int nq, int nk, int Dv, const float *S, int ldS, const float *v,
    ptrdiff_t v_rs, float *acc, int first)
{
    /* columns in chunks of up to 8 vectors (128 floats) kept in registers */
    for (int r = 0; r < nq; r++) {
        const float *Sr = S + (ptrdiff_t)r * ldS;
        float *ar = acc + (ptrdiff_t)r * Dv;
        for (int c0 = 0; c0 < Dv; c0 += 128) {
            const int cw = (Dv - c0 < 128) ? (Dv - c0) : 128;
            const int nv = (cw + 15) >> 4;
            const __mmask16 last = (__mmask16)((cw & 15) ? ((1u << (cw & 15)) - 1u) : 0xFFFFu);
            __m512 x[8];
            for (int t = 0; t < 8; t++) x[t] = _mm512_setzero_ps();
            if (!first) {
                for (int t = 0; t < nv; t++)
                    x[t] = _mm512_maskz_loadu_ps(t == nv - 1 ? last : 0xFFFF, ar + c0 + 16 * t);
            }
            const float *vc = v + c0;
            if (nv == 8 && last == 0xFFFF) {
                for (int j = 0; j < nk; j++, vc += v_rs) {
                    const __m512 pj = _mm512_set1_ps(Sr[j]);
                    x[0] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vc + 0), x[0]);
                    x[1] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vc + 16), x[1]);
                    x[2] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vc + 32), x[2]);
                    x[3] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vc + 48), x[3]);
                    x[4] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vc + 64), x[4]);
                    x[5] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vc + 80), x[5]);
                    x[6] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vc + 96), x[6]);
                    x[7] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vc + 112), x[7]);
                }
            } else if (nv == 4 && last == 0xFFFF) {
                for (int j = 0; j < nk; j++, vc += v_rs) {
                    const __m512 pj = _mm512_set1_ps(Sr[j]);
                    x[0] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vc + 0), x[0]);
                    x[1] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vc + 16), x[1]);
                    x[2] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vc + 32), x[2]);
                    x[3] = _mm512_fmadd_ps(pj, _mm512_loadu_ps(vc + 48), x[3]);
                }
            } else {
                for (int j = 0; j < nk; j++, vc += v_rs) {
                    const __m512 pj = _mm512_set1_ps(Sr[j]);
                    for (int t = 0; t < nv; t++)
                        x[t] = _mm512_fmadd_ps(
                            pj, _mm512_maskz_loadu_ps(t == nv - 1 ? last : 0xFFFF, vc + 16 * t), x[t]);
                }
            }
            for (int t = 0; t < nv; t++)
                _mm512_mask_storeu_ps(ar + c0 + 16 * t, t == nv - 1 ? last : 0xFFFF, x[t]);
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
