/*
 * ac_small_avx2.h -- AVX2 products for query blocks of a few rows
 * (decoding), keys and values read in place in every storage format.
 *
 * One body per product, parameterized by the element loader (8 elements
 * of a row as 8 floats): float32, bfloat16 (a shift), float16 (F16C) and
 * int8 (a sign extension, the row's scale applied to the sum).  AVX2 has
 * 16 vector registers: the scores take 8 keys at a time (8 accumulators,
 * their sums reduced together by a transposing tree of horizontal adds),
 * and P.V keeps 64 columns of the accumulator in 8 registers across all
 * keys.  Nothing is converted to a float copy first, so a 16-bit or int8
 * cache is read at its own size.
 *
 * Chosen at run time on the avx2 kernel path (ac_sdpa_variant.inc); the
 * avx512 path has its own loops (ac_small_x86.h, ac_half.h).
 */
#ifndef AC_SMALL_AVX2_H
#define AC_SMALL_AVX2_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include "ac_common.h"
#include "ac_cpu.h"

#if AC_HAVE_X86

/* element formats of the loaders: 0 float32, 1 bfloat16, 2 float16, 3 int8 */
#define AC_SE_F32 0
#define AC_SE_BF16 1
#define AC_SE_F16 2
#define AC_SE_I8 3

static inline size_t ac_se_size(int fmt)
{
    return fmt == AC_SE_F32 ? 4 : (fmt == AC_SE_I8 ? 1 : 2);
}

/* 8 elements at p (fmt, a compile-time constant in every caller) as floats */
static AC_TGT_AVX2 inline __m256 ac_ld8(int fmt, const void *p)
{
    if (fmt == AC_SE_F32)
        return _mm256_loadu_ps((const float *)p);
    if (fmt == AC_SE_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
    if (fmt == AC_SE_F16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

/* the first n < 8 elements at p as floats, the rest 0 */
static AC_TGT_AVX2 inline __m256 ac_ld8_part(int fmt, const void *p, int n)
{
    unsigned char tmp[32] = {0};
    memcpy(tmp, p, ac_se_size(fmt) * (size_t)n);
    return ac_ld8(fmt, tmp);
}

/* lane u of the result: the sum of a[u]'s 8 lanes */
static AC_TGT_AVX2 inline __m256 ac_hsum8_avx2(const __m256 *a)
{
    const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
    const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
    /* u0: sums of a[0..3] over lanes 0-3 (low half) and 4-7 (high half) */
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20),
                         _mm256_permute2f128_ps(u0, u1, 0x31));
}

static AC_TGT_AVX2 inline float ac_hsum1_avx2(__m256 a)
{
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 h = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
}

/* the dot product of the float row q with the row x of format fmt */
static AC_TGT_AVX2 inline __m256 ac_dot8_acc(int fmt, const float *q, const char *x,
                                                 int D, __m256 a)
{
    const size_t es = ac_se_size(fmt);
    const int Dm = D & ~7;
    int d = 0;
    for (; d < Dm; d += 8)
        a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), ac_ld8(fmt, x + d * es), a);
    if (d < D)
        a = _mm256_fmadd_ps(ac_ld8_part(AC_SE_F32, q + d, D - d),
                            ac_ld8_part(fmt, x + d * es, D - d), a);
    return a;
}

/* S[r, j] = scale * (ks[j] if int8) * q_r . k_j, r < nq, j < nk: 8 keys at
 * a time, with the block after next prefetched */
static AC_TGT_AVX2 inline void ac_scores_small_avx2(
    int fmt, int nq, int nk, int D, float scale, const float *q, ptrdiff_t q_rs,
    const void *k, ptrdiff_t k_rs, const float *ks, ptrdiff_t ks_rs, float *S, int ldS)
{
    const size_t es = ac_se_size(fmt);
    const char *kc = (const char *)k;
    const ptrdiff_t krb = k_rs * (ptrdiff_t)es;  /* row stride in bytes */
    const int Dm = D & ~7;
    const __m256 vs = _mm256_set1_ps(scale);
    for (int r = 0; r < nq; r++) {
        const float *qr = q + r * q_rs;
        float *Sr = S + (ptrdiff_t)r * ldS;
        int j = 0;
        for (; j + 8 <= nk; j += 8) {
            const char *kb = kc + (ptrdiff_t)j * krb;
            if (j + 24 <= nk)
                for (int u = 0; u < 8; u++)
                    for (size_t o = 0; o < (size_t)D * es; o += 64)
                        _mm_prefetch(kb + (ptrdiff_t)(u + 16) * krb + o, _MM_HINT_T0);
            __m256 a[8];
            for (int u = 0; u < 8; u++) a[u] = _mm256_setzero_ps();
            int d = 0;
            for (; d < Dm; d += 8) {
                const __m256 qv = _mm256_loadu_ps(qr + d);
                for (int u = 0; u < 8; u++)
                    a[u] = _mm256_fmadd_ps(qv, ac_ld8(fmt, kb + u * krb + d * es), a[u]);
            }
            if (d < D) {
                const __m256 qv = ac_ld8_part(AC_SE_F32, qr + d, D - d);
                for (int u = 0; u < 8; u++)
                    a[u] = _mm256_fmadd_ps(qv, ac_ld8_part(fmt, kb + u * krb + d * es, D - d),
                                           a[u]);
            }
            __m256 s = _mm256_mul_ps(ac_hsum8_avx2(a), vs);
            if (fmt == AC_SE_I8) {
                float sc[8];
                for (int u = 0; u < 8; u++) sc[u] = ks[(ptrdiff_t)(j + u) * ks_rs];
                s = _mm256_mul_ps(s, _mm256_loadu_ps(sc));
            }
            _mm256_storeu_ps(Sr + j, s);
        }
        for (; j < nk; j++) {
            const float s = ac_hsum1_avx2(
                ac_dot8_acc(fmt, qr, kc + (ptrdiff_t)j * krb, D, _mm256_setzero_ps()));
            Sr[j] = s * scale * (fmt == AC_SE_I8 ? ks[(ptrdiff_t)j * ks_rs] : 1.0f);
        }
    }
}

/* acc[r, :] (+)= sum_j P[r, j] (vs[j] if int8) v_j: 64 columns at a time
 * kept in 8 registers across all keys */
static AC_TGT_AVX2 inline void ac_pv_small_avx2(
    int fmt, int nq, int nk, int Dv, const float *S, int ldS, const void *v, ptrdiff_t v_rs,
    const float *vsc, ptrdiff_t vs_rs, float *acc, int first)
{
    const size_t es = ac_se_size(fmt);
    const ptrdiff_t vrb = v_rs * (ptrdiff_t)es;
    for (int r = 0; r < nq; r++) {
        const float *Sr = S + (ptrdiff_t)r * ldS;
        float *ar = acc + (ptrdiff_t)r * Dv;
        for (int c0 = 0; c0 < Dv; c0 += 64) {
            const int cw = (Dv - c0 < 64) ? (Dv - c0) : 64;
            const int nv = cw >> 3, rem = cw & 7;
            __m256 x[8], xr = _mm256_setzero_ps();
            for (int t = 0; t < 8; t++)
                x[t] = (first || t >= nv) ? _mm256_setzero_ps() : _mm256_loadu_ps(ar + c0 + 8 * t);
            if (rem && !first) xr = ac_ld8_part(AC_SE_F32, ar + c0 + 8 * nv, rem);
            const char *vc = (const char *)v + (size_t)c0 * es;
            for (int j = 0; j < nk; j++, vc += vrb) {
                const float pf = fmt == AC_SE_I8 ? Sr[j] * vsc[(ptrdiff_t)j * vs_rs] : Sr[j];
                const __m256 pj = _mm256_set1_ps(pf);
                if (j + 16 < nk)
                    for (size_t o = 0; o < (size_t)cw * es; o += 64)
                        _mm_prefetch(vc + 16 * vrb + o, _MM_HINT_T0);
                if (nv == 8) {
                    for (int t = 0; t < 8; t++)
                        x[t] = _mm256_fmadd_ps(pj, ac_ld8(fmt, vc + 8 * t * es), x[t]);
                } else {
                    for (int t = 0; t < nv; t++)
                        x[t] = _mm256_fmadd_ps(pj, ac_ld8(fmt, vc + 8 * t * es), x[t]);
                    if (rem)
                        xr = _mm256_fmadd_ps(pj, ac_ld8_part(fmt, vc + 8 * nv * es, rem), xr);
                }
            }
            for (int t = 0; t < nv; t++) _mm256_storeu_ps(ar + c0 + 8 * t, x[t]);
            if (rem) {
                float tmp[8];
                _mm256_storeu_ps(tmp, xr);
                memcpy(ar + c0 + 8 * nv, tmp, sizeof(float) * (size_t)rem);
            }
        }
    }
}

/* one function per format, so each body is compiled with its loader */
#define AC_DEF_SMALL_AVX2(FMT, SUF)                                                    \
static AC_TGT_AVX2 void ac_scores_small_##SUF##_avx2(                              \
    int nq, int nk, int D, float scale, const float *q, ptrdiff_t q_rs, const void *k, \
    ptrdiff_t k_rs, const float *ks, ptrdiff_t ks_rs, float *S, int ldS)               \
{                                                                                      \
    ac_scores_small_avx2(FMT, nq, nk, D, scale, q, q_rs, k, k_rs, ks, ks_rs, S, ldS);  \
}                                                                                      \
static AC_TGT_AVX2 void ac_pv_small_##SUF##_avx2(                                  \
    int nq, int nk, int Dv, const float *S, int ldS, const void *v, ptrdiff_t v_rs,    \
    const float *vsc, ptrdiff_t vs_rs, float *acc, int first)                          \
{                                                                                      \
    ac_pv_small_avx2(FMT, nq, nk, Dv, S, ldS, v, v_rs, vsc, vs_rs, acc, first);        \
}
AC_DEF_SMALL_AVX2(AC_SE_F32, f32)
AC_DEF_SMALL_AVX2(AC_SE_BF16, bf16)
AC_DEF_SMALL_AVX2(AC_SE_F16, f16)
AC_DEF_SMALL_AVX2(AC_SE_I8, q8)

/* the direct products of the avx2 path by the operand's storage:
 * int8 (q8 set), 16-bit (h: 1 bfloat16, 2 float16) or float32 */
static void ac_scores_small_any_avx2(int q8, int h, int nq, int nk, int D, float scale,
                                     const float *q, ptrdiff_t q_rs, const void *k,
                                     ptrdiff_t k_rs, const float *ks, ptrdiff_t ks_rs,
                                     float *S, int ldS)
{
    if (q8)
        ac_scores_small_q8_avx2(nq, nk, D, scale, q, q_rs, k, k_rs, ks, ks_rs, S, ldS);
    else if (h == 1)
        ac_scores_small_bf16_avx2(nq, nk, D, scale, q, q_rs, k, k_rs, ks, ks_rs, S, ldS);
    else if (h == 2)
        ac_scores_small_f16_avx2(nq, nk, D, scale, q, q_rs, k, k_rs, ks, ks_rs, S, ldS);
    else
        ac_scores_small_f32_avx2(nq, nk, D, scale, q, q_rs, k, k_rs, ks, ks_rs, S, ldS);
}

static void ac_pv_small_any_avx2(int q8, int h, int nq, int nk, int Dv, const float *S,
                                 int ldS, const void *v, ptrdiff_t v_rs, const float *vsc,
                                 ptrdiff_t vs_rs, float *acc, int first)
{
    if (q8)
        ac_pv_small_q8_avx2(nq, nk, Dv, S, ldS, v, v_rs, vsc, vs_rs, acc, first);
    else if (h == 1)
        ac_pv_small_bf16_avx2(nq, nk, Dv, S, ldS, v, v_rs, vsc, vs_rs, acc, first);
    else if (h == 2)
        ac_pv_small_f16_avx2(nq, nk, Dv, S, ldS, v, v_rs, vsc, vs_rs, acc, first);
    else
        ac_pv_small_f32_avx2(nq, nk, Dv, S, ldS, v, v_rs, vsc, vs_rs, acc, first);
}
#endif /* AC_HAVE_X86 */

#endif /* AC_SMALL_AVX2_H */
