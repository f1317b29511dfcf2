/*
 * ac_half.h -- bfloat16 and float16 operands read in place.
 *
 * A half-precision query, key or value is never copied to float32 as a
 * whole: the kernels convert the rows of one tile at a time into a small
 * buffer of the thread's scratch (the key / value tile buffers the int8
 * operands use, and a query block buffer), or convert in registers (the
 * AVX-512 loops of a few query rows).
 *
 *   bfloat16 -> float32: the 16 bits are the high half of the float32
 *                        (a shift; exact)
 *   float16  -> float32: F16C vcvtph2ps on the AVX2 / AVX-512 paths, a
 *                        portable bit conversion otherwise (exact, with
 *                        subnormals, inf and NaN)
 *
 * The conversion follows the kernel path in use (ac_kernel_path), so
 * forcing the portable path runs the portable conversion too.
 */
#ifndef AC_HALF_H
#define AC_HALF_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include "ac_cpu.h"
#include "ac_small_x86.h"  /* ac_hsum16_avx512 */

/* storage formats of a query / key / value operand */
enum { AC_H_NONE = 0, AC_H_BF16 = 1, AC_H_F16 = 2 };

static inline float ac_bf16_f32(uint16_t h)
{
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* IEEE binary16 -> binary32, bit by bit (every value exact) */
static inline float ac_f16_f32(uint16_t h)
{
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1Fu;
    uint32_t man = h & 0x3FFu;
    uint32_t u;
    if (exp == 0x1Fu) {                 /* inf / NaN (payload kept) */
        u = sign | 0x7F800000u | (man << 13);
    } else if (exp != 0) {              /* normal */
        u = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {              /* +-0 */
        u = sign;
    } else {                            /* subnormal: normalize */
        int e = -1;
        do {
            man <<= 1;
            e++;
        } while (!(man & 0x400u));
        u = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3FFu) << 13);
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float ac_half_f32(int fmt, uint16_t h)
{
    return fmt == AC_H_BF16 ? ac_bf16_f32(h) : ac_f16_f32(h);
}

/* out[r][d] = x[r][d] as float, r < n, d < D (x row stride rs elements,
 * out row stride ldo): the portable loops */
static void ac_half_rows_f32_portable(int fmt, const uint16_t *x, ptrdiff_t rs,
                                      int n, int D, float *out, ptrdiff_t ldo)
{
    for (int r = 0; r < n; r++) {
        const uint16_t *xr = x + (ptrdiff_t)r * rs;
        float *o = out + (ptrdiff_t)r * ldo;
        if (fmt == AC_H_BF16) {
            for (int d = 0; d < D; d++) o[d] = ac_bf16_f32(xr[d]);
        } else {
            for (int d = 0; d < D; d++) o[d] = ac_f16_f32(xr[d]);
        }
    }
}

/* the same into double (the float64 kernel with a half operand) */
static void ac_half_rows_f64(int fmt, const uint16_t *x, ptrdiff_t rs, int n,
                             int D, double *out, ptrdiff_t ldo)
{
    for (int r = 0; r < n; r++) {
        const uint16_t *xr = x + (ptrdiff_t)r * rs;
        double *o = out + (ptrdiff_t)r * ldo;
        for (int d = 0; d < D; d++) o[d] = (double)ac_half_f32(fmt, xr[d]);
    }
}

#if AC_HAVE_X86

/* 16 halves at p as floats (n < 16: only the first n are read, the rest 0) */
static AC_TGT_AVX512BW inline __m512 ac_h16_avx512(int fmt, const uint16_t *p, int n)
{
    __m256i h;
    if (n >= 16) {
        h = _mm256_loadu_si256((const __m256i *)(const void *)p);
    } else {
        uint16_t tmp[16] = {0};
        memcpy(tmp, p, sizeof(uint16_t) * (size_t)n);
        h = _mm256_loadu_si256((const __m256i *)(const void *)tmp);
    }
    if (fmt == AC_H_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
}

static AC_TGT_AVX2 inline __m256 ac_h8_avx2(int fmt, const uint16_t *p)
{
    const __m128i h = _mm_loadu_si128((const __m128i *)(const void *)p);
    if (fmt == AC_H_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
}

static AC_TGT_AVX512BW void ac_half_rows_f32_avx512(int fmt, const uint16_t *x, ptrdiff_t rs,
                                                int n, int D, float *out, ptrdiff_t ldo)
{
    const int Dm = D & ~15;
    for (int r = 0; r < n; r++) {
        const uint16_t *xr = x + (ptrdiff_t)r * rs;
        float *o = out + (ptrdiff_t)r * ldo;
        int d = 0;
        if (fmt == AC_H_BF16) {
            for (; d < Dm; d += 16) _mm512_storeu_ps(o + d, ac_h16_avx512(AC_H_BF16, xr + d, 16));
        } else {
            for (; d < Dm; d += 16) _mm512_storeu_ps(o + d, ac_h16_avx512(AC_H_F16, xr + d, 16));
        }
        for (; d < D; d++) o[d] = fmt == AC_H_BF16 ? ac_bf16_f32(xr[d]) : _cvtsh_ss(xr[d]);
    }
}

static AC_TGT_AVX2 void ac_half_rows_f32_avx2(int fmt, const uint16_t *x, ptrdiff_t rs,
                                              int n, int D, float *out, ptrdiff_t ldo)
{
    const int Dm = D & ~7;
    for (int r = 0; r < n; r++) {
        const uint16_t *xr = x + (ptrdiff_t)r * rs;
        float *o = out + (ptrdiff_t)r * ldo;
        int d = 0;
        if (fmt == AC_H_BF16) {
            for (; d < Dm; d += 8) _mm256_storeu_ps(o + d, ac_h8_avx2(AC_H_BF16, xr + d));
        } else {
            for (; d < Dm; d += 8) _mm256_storeu_ps(o + d, ac_h8_avx2(AC_H_F16, xr + d));
        }
        for (; d < D; d++) o[d] = fmt == AC_H_BF16 ? ac_bf16_f32(xr[d]) : _cvtsh_ss(xr[d]);
    }
}

/* S[r, j] = scale * q_r . k_j for half keys read in place (q float):
 * 16 keys at a time, their sums reduced together */
#define AC_DEF_SCORES_SMALL_H(FMT, NAME)                                               \
static AC_TGT_AVX512BW void NAME(int nq, int nk, int D, float scale, const float *q,      \
                             ptrdiff_t q_rs, const uint16_t *k, ptrdiff_t k_rs,        \
                             float *S, int ldS)                                        \
{                                                                                      \
    const int Dm = D & ~15, nt = D - Dm;                                              \
    const __mmask16 tail = (__mmask16)((1u << nt) - 1u);                               \
    const __m512 vs = _mm512_set1_ps(scale);                                           \
    for (int r = 0; r < nq; r++) {                                                     \
        const float *qr = q + r * q_rs;                                                \
        float *Sr = S + (ptrdiff_t)r * ldS;                                            \
        int j = 0;                                                                     \
        for (; j + 16 <= nk; j += 16) {                                                \
            const uint16_t *kb = k + (ptrdiff_t)j * k_rs;                              \
            if (j + 48 <= nk) /* the block after next, a line at a time */            \
                for (int u = 0; u < 16; u++)                                           \
                    for (int o = 0; o < D; o += 32)                                    \
                        _mm_prefetch((const char *)(kb + (ptrdiff_t)(u + 32) * k_rs + o), \
                                     _MM_HINT_T0);                                     \
            __m512 a[16];                                                              \
            for (int u = 0; u < 16; u++) a[u] = _mm512_setzero_ps();                   \
            int d = 0;                                                                 \
            for (; d < Dm; d += 16) {                                                  \
                const __m512 qv = _mm512_loadu_ps(qr + d);                             \
                for (int u = 0; u < 16; u++)                                           \
                    a[u] = _mm512_fmadd_ps(qv, ac_h16_avx512(FMT, kb + u * k_rs + d, 16), \
                                           a[u]);                                      \
            }                                                                          \
            if (nt) {                                                                  \
                const __m512 qv = _mm512_maskz_loadu_ps(tail, qr + d);                 \
                for (int u = 0; u < 16; u++)                                           \
                    a[u] = _mm512_fmadd_ps(qv, ac_h16_avx512(FMT, kb + u * k_rs + d, nt), \
                                           a[u]);                                      \
            }                                                                          \
            _mm512_storeu_ps(Sr + j, _mm512_mul_ps(ac_hsum16_avx512(a), vs));          \
        }                                                                              \
        for (; j + 4 <= nk; j += 4) {                                                  \
            const uint16_t *k0 = k + (ptrdiff_t)j * k_rs;                              \
            const uint16_t *k1 = k0 + k_rs, *k2 = k1 + k_rs, *k3 = k2 + k_rs;          \
            __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();                 \
            __m512 a2 = _mm512_setzero_ps(), a3 = _mm512_setzero_ps();                 \
            int d = 0;                                                                 \
            for (; d < Dm; d += 16) {                                                  \
                const __m512 qv = _mm512_loadu_ps(qr + d);                             \
                a0 = _mm512_fmadd_ps(qv, ac_h16_avx512(FMT, k0 + d, 16), a0);          \
                a1 = _mm512_fmadd_ps(qv, ac_h16_avx512(FMT, k1 + d, 16), a1);          \
                a2 = _mm512_fmadd_ps(qv, ac_h16_avx512(FMT, k2 + d, 16), a2);          \
                a3 = _mm512_fmadd_ps(qv, ac_h16_avx512(FMT, k3 + d, 16), a3);          \
            }                                                                          \
            if (nt) {                                                                  \
                const __m512 qv = _mm512_maskz_loadu_ps(tail, qr + d);                 \
                a0 = _mm512_fmadd_ps(qv, ac_h16_avx512(FMT, k0 + d, nt), a0);          \
                a1 = _mm512_fmadd_ps(qv, ac_h16_avx512(FMT, k1 + d, nt), a1);          \
                a2 = _mm512_fmadd_ps(qv, ac_h16_avx512(FMT, k2 + d, nt), a2);          \
                a3 = _mm512_fmadd_ps(qv, ac_h16_avx512(FMT, k3 + d, nt), a3);          \
            }                                                                          \
            Sr[j + 0] = _mm512_reduce_add_ps(a0) * scale;                              \
            Sr[j + 1] = _mm512_reduce_add_ps(a1) * scale;                              \
            Sr[j + 2] = _mm512_reduce_add_ps(a2) * scale;                              \
            Sr[j + 3] = _mm512_reduce_add_ps(a3) * scale;                              \
        }                                                                              \
        for (; j < nk; j++) {                                                          \
            const uint16_t *kj = k + (ptrdiff_t)j * k_rs;                              \
            __m512 a0 = _mm512_setzero_ps();                                           \
            int d = 0;                                                                 \
            for (; d < Dm; d += 16)                                                    \
                a0 = _mm512_fmadd_ps(_mm512_loadu_ps(qr + d),                          \
                                     ac_h16_avx512(FMT, kj + d, 16), a0);              \
            if (nt)                                                                    \
                a0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, qr + d),              \
                                     ac_h16_avx512(FMT, kj + d, nt), a0);              \
            Sr[j] = _mm512_reduce_add_ps(a0) * scale;                                  \
        }                                                                              \
    }                                                                                  \
}

/* acc[r, :] (+)= sum_j P[r, j] v_j for half values read in place */
#define AC_DEF_PV_SMALL_H(FMT, NAME)                                                   \
static AC_TGT_AVX512BW void NAME(int nq, int nk, int Dv, const float *S, int ldS,          \
                             const uint16_t *v, ptrdiff_t v_rs, float *acc, int first) \
{                                                                                      \
    for (int r = 0; r < nq; r++) {                                                     \
        const float *Sr = S + (ptrdiff_t)r * ldS;                                      \
        float *ar = acc + (ptrdiff_t)r * Dv;                                           \
        for (int c0 = 0; c0 < Dv; c0 += 128) {                                         \
            const int cw = (Dv - c0 < 128) ? (Dv - c0) : 128;                          \
            const int nv = (cw + 15) >> 4;                                             \
            const int lastn = cw - 16 * (nv - 1);                                      \
            const __mmask16 last =                                                     \
                (__mmask16)((lastn == 16) ? 0xFFFFu : ((1u << lastn) - 1u));           \
            __m512 x[8];                                                               \
            for (int t = 0; t < 8; t++) x[t] = _mm512_setzero_ps();                    \
            if (!first)                                                                \
                for (int t = 0; t < nv; t++)                                           \
                    x[t] = _mm512_maskz_loadu_ps(t == nv - 1 ? last : 0xFFFF,          \
                                                 ar + c0 + 16 * t);                    \
            const uint16_t *vc = v + c0;                                               \
            if (nv == 4 && lastn == 16) {                                              \
                for (int j = 0; j < nk; j++, vc += v_rs) {                             \
                    const __m512 pj = _mm512_set1_ps(Sr[j]);                           \
                    if (j + 16 < nk) {                                                 \
                        _mm_prefetch((const char *)(vc + 16 * v_rs), _MM_HINT_T0);     \
                        _mm_prefetch((const char *)(vc + 16 * v_rs + 32), _MM_HINT_T0); \
                    }                                                                  \
                    x[0] = _mm512_fmadd_ps(pj, ac_h16_avx512(FMT, vc + 0, 16), x[0]);  \
                    x[1] = _mm512_fmadd_ps(pj, ac_h16_avx512(FMT, vc + 16, 16), x[1]); \
                    x[2] = _mm512_fmadd_ps(pj, ac_h16_avx512(FMT, vc + 32, 16), x[2]); \
                    x[3] = _mm512_fmadd_ps(pj, ac_h16_avx512(FMT, vc + 48, 16), x[3]); \
                }                                                                      \
            } else if (nv == 8 && lastn == 16) {                                       \
                for (int j = 0; j < nk; j++, vc += v_rs) {                             \
                    const __m512 pj = _mm512_set1_ps(Sr[j]);                           \
                    if (j + 16 < nk)                                                   \
                        for (int o = 0; o < 128; o += 32)                              \
                            _mm_prefetch((const char *)(vc + 16 * v_rs + o), _MM_HINT_T0); \
                    for (int t = 0; t < 8; t++)                                        \
                        x[t] = _mm512_fmadd_ps(pj, ac_h16_avx512(FMT, vc + 16 * t, 16), \
                                               x[t]);                                  \
                }                                                                      \
            } else {                                                                   \
                for (int j = 0; j < nk; j++, vc += v_rs) {                             \
                    const __m512 pj = _mm512_set1_ps(Sr[j]);                           \
                    for (int t = 0; t < nv; t++)                                       \
                        x[t] = _mm512_fmadd_ps(                                        \
                            pj, ac_h16_avx512(FMT, vc + 16 * t, t == nv - 1 ? lastn : 16), \
                            x[t]);                                                     \
                }                                                                      \
            }                                                                          \
            for (int t = 0; t < nv; t++)                                               \
                _mm512_mask_storeu_ps(ar + c0 + 16 * t, t == nv - 1 ? last : 0xFFFF, x[t]); \
        }                                                                              \
    }                                                                                  \
}

AC_DEF_SCORES_SMALL_H(AC_H_BF16, ac_scores_small_bf16_avx512)
AC_DEF_SCORES_SMALL_H(AC_H_F16, ac_scores_small_f16_avx512)
AC_DEF_PV_SMALL_H(AC_H_BF16, ac_pv_small_bf16_avx512)
AC_DEF_PV_SMALL_H(AC_H_F16, ac_pv_small_f16_avx512)

static void ac_scores_small_h_avx512(int fmt, int nq, int nk, int D, float scale,
                                     const float *q, ptrdiff_t q_rs, const uint16_t *k,
                                     ptrdiff_t k_rs, float *S, int ldS)
{
    if (fmt == AC_H_BF16)
        ac_scores_small_bf16_avx512(nq, nk, D, scale, q, q_rs, k, k_rs, S, ldS);
    else
        ac_scores_small_f16_avx512(nq, nk, D, scale, q, q_rs, k, k_rs, S, ldS);
}

/* bfloat16 values, Dv a multiple of 32 up to 128: 32 columns per 512-bit
 * load, widened by interleaving with zeros (one shuffle per 16 floats in
 * place of a widening move and a shift); the columns then sit permuted
 * within the accumulators ([0-3, 8-11, 16-19, 24-27] and [4-7, 12-15, ...]
 * per 32) and are put back in order once, at the end */
static AC_TGT_AVX512BW void ac_pv_small_bf16x32_avx512(int nq, int nk, int Dv, const float *S,
                                                   int ldS, const uint16_t *v, ptrdiff_t v_rs,
                                                   float *acc, int first)
{
    const int nb = Dv >> 5; /* blocks of 32 columns, 1..4 */
    const __m512i zero = _mm512_setzero_si512();
    for (int r = 0; r < nq; r++) {
        const float *Sr = S + (ptrdiff_t)r * ldS;
        float *ar = acc + (ptrdiff_t)r * Dv;
        __m512 lo[4], hi[4];
        for (int b = 0; b < 4; b++) {
            lo[b] = _mm512_setzero_ps();
            hi[b] = _mm512_setzero_ps();
        }
        if (!first)
            for (int b = 0; b < nb; b++) {
                const __m512 A = _mm512_loadu_ps(ar + 32 * b), B = _mm512_loadu_ps(ar + 32 * b + 16);
                lo[b] = _mm512_shuffle_f32x4(A, B, 0x88);
                hi[b] = _mm512_shuffle_f32x4(A, B, 0xDD);
            }
        const uint16_t *vc = v;
#define AC_BF16X32_STEP(b)                                                                   \
    do {                                                                                     \
        const __m512i x_ = _mm512_loadu_si512((const void *)(vc + 32 * (b)));               \
        lo[b] = _mm512_fmadd_ps(pj, _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, x_)), lo[b]); \
        hi[b] = _mm512_fmadd_ps(pj, _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, x_)), hi[b]); \
    } while (0)
        if (nb == 2) {
            for (int j = 0; j < nk; j++, vc += v_rs) {
                const __m512 pj = _mm512_set1_ps(Sr[j]);
                if (j + 16 < nk) {
                    _mm_prefetch((const char *)(vc + 16 * v_rs), _MM_HINT_T0);
                    _mm_prefetch((const char *)(vc + 16 * v_rs + 32), _MM_HINT_T0);
                }
                AC_BF16X32_STEP(0);
                AC_BF16X32_STEP(1);
            }
        } else if (nb == 4) {
            for (int j = 0; j < nk; j++, vc += v_rs) {
                const __m512 pj = _mm512_set1_ps(Sr[j]);
                if (j + 16 < nk)
                    for (int o = 0; o < 128; o += 32)
                        _mm_prefetch((const char *)(vc + 16 * v_rs + o), _MM_HINT_T0);
                AC_BF16X32_STEP(0);
                AC_BF16X32_STEP(1);
                AC_BF16X32_STEP(2);
                AC_BF16X32_STEP(3);
            }
        } else {
            for (int j = 0; j < nk; j++, vc += v_rs) {
                const __m512 pj = _mm512_set1_ps(Sr[j]);
                for (int b = 0; b < nb; b++) AC_BF16X32_STEP(b);
            }
        }
#undef AC_BF16X32_STEP
        for (int b = 0; b < nb; b++) {
            const __m512 t0 = _mm512_shuffle_f32x4(lo[b], hi[b], 0x44);
            const __m512 t1 = _mm512_shuffle_f32x4(lo[b], hi[b], 0xEE);
            _mm512_storeu_ps(ar + 32 * b, _mm512_shuffle_f32x4(t0, t0, 0xD8));
            _mm512_storeu_ps(ar + 32 * b + 16, _mm512_shuffle_f32x4(t1, t1, 0xD8));
        }
    }
}

static void ac_pv_small_h_avx512(int fmt, int nq, int nk, int Dv, const float *S, int ldS,
                                 const uint16_t *v, ptrdiff_t v_rs, float *acc, int first)
{
    if (fmt == AC_H_BF16 && (Dv & 31) == 0 && Dv <= 128)
        ac_pv_small_bf16x32_avx512(nq, nk, Dv, S, ldS, v, v_rs, acc, first);
    else if (fmt == AC_H_BF16)
        ac_pv_small_bf16_avx512(nq, nk, Dv, S, ldS, v, v_rs, acc, first);
    else
        ac_pv_small_f16_avx512(nq, nk, Dv, S, ldS, v, v_rs, acc, first);
}
#endif /* AC_HAVE_X86 */

/* rows of a half tile as float, on the kernel path in use */
static void ac_half_rows_f32(int fmt, const uint16_t *x, ptrdiff_t rs, int n, int D,
                             float *out, ptrdiff_t ldo)
{
#if AC_HAVE_X86
    if (ac_kernel_path == AC_PATH_AVX512) {
        ac_half_rows_f32_avx512(fmt, x, rs, n, D, out, ldo);
        return;
    }
    if (ac_kernel_path == AC_PATH_AVX2) {
        ac_half_rows_f32_avx2(fmt, x, rs, n, D, out, ldo);
        return;
    }
#endif
    ac_half_rows_f32_portable(fmt, x, rs, n, D, out, ldo);
}

#endif /* AC_HALF_H */
