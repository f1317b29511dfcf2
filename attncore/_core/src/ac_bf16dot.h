/*
 * ac_bf16dot.h -- bfloat16 dot products (AVX512_BF16 vdpbf16ps) for the
 * fused AVX-512 kernel: Q.K^T and P.V with bfloat16 operands and float32
 * accumulation, the softmax in float32 (as torch's and flash-attention's
 * bf16 kernels do: P is rounded to bfloat16 for P.V).
 *
 * Layout (queries in SIMD lanes, as the float kernel):
 *   QT2[t][r]  = (bf16 q[r][2t+1] << 16) | bf16 q[r][2t]     (panel, P lanes)
 *   K16[j][t]  = (bf16 k[j][2t+1] << 16) | bf16 k[j][2t]     (a key chunk)
 *   VI[jp][c]  = (bf16 v[2jp+1][c] << 16) | bf16 v[2jp][c]   (a value chunk,
 *                                                              keys paired)
 *   PT2[jp][r] = (bf16 P[2jp+1][r] << 16) | bf16 P[2jp][r]   (a tile)
 * so that one 32-bit broadcast of a key pair (or of a row's probability
 * pair) feeds vdpbf16ps against a vector of 16 lanes.  A missing half of a
 * pair (odd D, odd key count) is 0.  Chunks are packed once per query
 * block and serve all its panels.
 *
 * Each micro-kernel exists twice: with the instruction (target
 * avx512bf16), and with the same arithmetic spelled in AVX-512F (two FMAs
 * of the widened halves) -- the second lets every other line of this path
 * run, and be tested, on a CPU without AVX512_BF16.  vdpbf16ps is
 * symmetric in the two halves of a pair; it rounds to nearest even and
 * treats denormal inputs and results as zero.
 */
#ifndef AC_BF16DOT_H
#define AC_BF16DOT_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include "ac_cpu.h"

/* one key chunk's bfloat16 operands (see ac_fused_range_f32) */
typedef struct {
    int mode;            /* 1: vdpbf16ps, 2: its AVX-512F spelling; 3 /
                            4: int16 P.V (ac_int8dot.h)                 */
    const uint32_t *k16; /* K16 of the chunk's keys (ld (D + 1) / 2)      */
    const uint32_t *vi;  /* VI of the chunk's key pairs (ld Dv)           */
    uint32_t *pt2;       /* a tile's probability pairs (scratch)          */
    int vfin;            /* every value of the chunk is finite            */
    const float *vcs;    /* int16 P.V (mode 3 / 4): the chunk's keys'
                            value scales (ac_int8dot.h, AC_PV16_*)      */
} ac_bf16_chunk;

/* float -> bfloat16 bits, round to nearest even (NaN stays a quiet NaN) */
static inline uint32_t ac_bf16_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (u >> 16) | 0x40u;
    return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}

/* out[r][t] = pair (x[r][2t], x[r][2t+1]) for rows r < n (ld ldo words) */
static void ac_pack_pairs_rows(const float *x, ptrdiff_t rs, int n, int D, uint32_t *out,
                               ptrdiff_t ldo)
{
    const int Dh = (D + 1) / 2;
    for (int r = 0; r < n; r++) {
        const float *xr = x + (ptrdiff_t)r * rs;
        uint32_t *o = out + (ptrdiff_t)r * ldo;
        for (int t = 0; t < D / 2; t++)
            o[t] = ac_bf16_bits(xr[2 * t]) | (ac_bf16_bits(xr[2 * t + 1]) << 16);
        if (D & 1) o[Dh - 1] = ac_bf16_bits(xr[D - 1]);
    }
}

/* out[jp][c] = pair (v[2jp][c], v[2jp+1][c]) for key pairs jp < (nk+1)/2 */
static void ac_pack_pairs_keys(const float *v, ptrdiff_t rs, int nk, int Dv, uint32_t *out)
{
    for (int jp = 0; 2 * jp < nk; jp++) {
        const float *a = v + (ptrdiff_t)(2 * jp) * rs;
        uint32_t *o = out + (ptrdiff_t)jp * Dv;
        if (2 * jp + 1 < nk) {
            const float *b = a + rs;
            for (int c = 0; c < Dv; c++) o[c] = ac_bf16_bits(a[c]) | (ac_bf16_bits(b[c]) << 16);
        } else {
            for (int c = 0; c < Dv; c++) o[c] = ac_bf16_bits(a[c]);
        }
    }
}

/* QT2[t][r] (ld P) from query rows r < nr; rows nr..P-1 are 0 */
static void ac_pack_pairs_panel(const float *q, ptrdiff_t rs, int nr, int D, int P,
                                uint32_t *QT2)
{
    const int Dh = (D + 1) / 2;
    for (int t = 0; t < Dh; t++) {
        uint32_t *o = QT2 + (ptrdiff_t)t * P;
        for (int r = 0; r < P; r++) {
            if (r >= nr) {
                o[r] = 0;
                continue;
            }
            const float *qr = q + (ptrdiff_t)r * rs;
            const uint32_t lo = ac_bf16_bits(qr[2 * t]);
            const uint32_t hi = (2 * t + 1 < D) ? ac_bf16_bits(qr[2 * t + 1]) : 0u;
            o[r] = lo | (hi << 16);
        }
    }
}

#if AC_HAVE_X86

static AC_TGT_AVX512_BF16 inline __m512 ac_dp_bf16(__m512 acc, __m512i a, __m512i b)
{
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

/* the same sum of two products per lane in AVX-512F (both halves widened) */
static AC_TGT_AVX512BW inline __m512 ac_dp_bf16_emu(__m512 acc, __m512i a, __m512i b)
{
    const __m512i hi = _mm512_set1_epi32((int)0xFFFF0000u);
    const __m512 alo = _mm512_castsi512_ps(_mm512_slli_epi32(a, 16));
    const __m512 blo = _mm512_castsi512_ps(_mm512_slli_epi32(b, 16));
    const __m512 ahi = _mm512_castsi512_ps(_mm512_and_si512(a, hi));
    const __m512 bhi = _mm512_castsi512_ps(_mm512_and_si512(b, hi));
    return _mm512_fmadd_ps(ahi, bhi, _mm512_fmadd_ps(alo, blo, acc));
}

/* PT2[jp][r] for the pairs of probabilities in rows ST[j][32] (j < nk;
 * first: the index in ST of the pair's first key, -1 for a leading 0) */
static AC_TGT_AVX512BW void ac_pack_probs(const float *ST, int first, int nk, uint32_t *PT2,
                                       int npairs)
{
    const __m512i bias = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1);
    for (int jp = 0; jp < npairs; jp++) {
        const int ja = first + 2 * jp, jb = ja + 1;
        for (int h = 0; h < 32; h += 16) {
            __m512i a = _mm512_setzero_si512(), b = _mm512_setzero_si512();
            /* probabilities are finite and >= 0: no NaN case */
            if (ja >= 0 && ja < nk) {
                const __m512i u = _mm512_castps_si512(_mm512_loadu_ps(ST + (ptrdiff_t)ja * 32 + h));
                a = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, bias),
                                                       _mm512_and_si512(_mm512_srli_epi32(u, 16), one)), 16);
            }
            if (jb >= 0 && jb < nk) {
                const __m512i u = _mm512_castps_si512(_mm512_loadu_ps(ST + (ptrdiff_t)jb * 32 + h));
                b = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, bias),
                                                       _mm512_and_si512(_mm512_srli_epi32(u, 16), one)), 16);
            }
            _mm512_storeu_si512((void *)(PT2 + (ptrdiff_t)jp * 32 + h),
                                _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
        }
    }
}

/* scores of KU keys (K16 rows, ld kw words) x 32 query lanes, scaled by
 * qs, into ST rows (ld 32); running tile max in *mx0 / *mx1 */
#define AC_DEF_BF16_QK(KU, NAME, TGT, DP)                                                  \
static TGT AC_NOINLINE void NAME(const uint32_t *QT2, int Dh,              \
                                               const uint32_t *kr, ptrdiff_t kw,          \
                                               float qs, float *ST, __m512 *mx0,          \
                                               __m512 *mx1)                               \
{                                                                                          \
    __m512 a0[KU], a1[KU];                                                                 \
    for (int u = 0; u < KU; u++) { a0[u] = _mm512_setzero_ps(); a1[u] = _mm512_setzero_ps(); } \
    for (int t = 0; t < Dh; t++) {                                                         \
        const __m512i q0 = _mm512_loadu_si512((const void *)(QT2 + (ptrdiff_t)t * 32));      \
        const __m512i q1 = _mm512_loadu_si512((const void *)(QT2 + (ptrdiff_t)t * 32 + 16)); \
        _Pragma("GCC unroll 8")                                                            \
        for (int u = 0; u < KU; u++) {                                                     \
            const __m512i b = _mm512_set1_epi32((int)kr[(ptrdiff_t)u * kw + t]);          \
            a0[u] = DP(a0[u], q0, b);                                                      \
            a1[u] = DP(a1[u], q1, b);                                                      \
        }                                                                                  \
    }                                                                                      \
    const __m512 s = _mm512_set1_ps(qs);                                                   \
    __m512 m0 = *mx0, m1 = *mx1;                                                           \
    for (int u = 0; u < KU; u++) {                                                         \
        const __m512 x0 = _mm512_mul_ps(a0[u], s), x1 = _mm512_mul_ps(a1[u], s);          \
        _mm512_storeu_ps(ST + u * 32, x0);                                                 \
        _mm512_storeu_ps(ST + u * 32 + 16, x1);                                            \
        m0 = _mm512_max_ps(x0, m0);                                                        \
        m1 = _mm512_max_ps(x1, m1);                                                        \
    }                                                                                      \
    *mx0 = m0;                                                                             \
    *mx1 = m1;                                                                             \
}

/* O[u][c0..c0+16 cv) = alpha[u] O + sum_jp PT2[jp][u] . VI[jp][..] for ru
 * rows (<= 4) and cv full vectors (<= 4) of 16 value columns; the last
 * vector may be partial (n columns: tail mask) */
#define AC_DEF_BF16_PV(NAME, TGT, DP)                                                      \
static TGT AC_NOINLINE void NAME(const uint32_t *PT2, int np,              \
                                               const uint32_t *vi, ptrdiff_t vw,          \
                                               float *O, ptrdiff_t ldo, const float *alpha, \
                                               int ru, int cv, __mmask16 last)            \
{                                                                                          \
    __m512 a[4][4];                                                                        \
    for (int u = 0; u < 4; u++)                                                            \
        for (int c = 0; c < 4; c++) a[u][c] = _mm512_setzero_ps();                         \
    for (int u = 0; u < ru; u++) {                                                         \
        const __m512 al = _mm512_set1_ps(alpha[u]);                                        \
        for (int c = 0; c < cv; c++)                                                       \
            a[u][c] = _mm512_mul_ps(_mm512_maskz_loadu_ps(c == cv - 1 ? last : 0xFFFF,    \
                                                          O + u * ldo + c * 16), al);      \
    }                                                                                      \
    if (ru == 4 && cv == 4) {                                                              \
        for (int jp = 0; jp < np; jp++) {                                                  \
            const uint32_t *vr = vi + (ptrdiff_t)jp * vw;                                  \
            __m512i x[4];                                                                  \
            _Pragma("GCC unroll 4")                                                        \
            for (int c = 0; c < 4; c++) x[c] = _mm512_loadu_si512((const void *)(vr + c * 16)); \
            _Pragma("GCC unroll 4")                                                        \
            for (int u = 0; u < 4; u++) {                                                  \
                const __m512i b = _mm512_set1_epi32((int)PT2[(ptrdiff_t)jp * 32 + u]);    \
                _Pragma("GCC unroll 4")                                                    \
                for (int c = 0; c < 4; c++) a[u][c] = DP(a[u][c], x[c], b);                \
            }                                                                              \
        }                                                                                  \
    } else {                                                                               \
        for (int jp = 0; jp < np; jp++) {                                                  \
            const uint32_t *vr = vi + (ptrdiff_t)jp * vw;                                  \
            __m512i x[4];                                                                  \
            for (int c = 0; c < cv; c++)                                                   \
                x[c] = _mm512_maskz_loadu_epi32(c == cv - 1 ? last : 0xFFFF,               \
                                                (const void *)(vr + c * 16));              \
            for (int u = 0; u < ru; u++) {                                                 \
                const __m512i b = _mm512_set1_epi32((int)PT2[(ptrdiff_t)jp * 32 + u]);    \
                for (int c = 0; c < cv; c++) a[u][c] = DP(a[u][c], x[c], b);               \
            }                                                                              \
        }                                                                                  \
    }                                                                                      \
    for (int u = 0; u < ru; u++)                                                           \
        for (int c = 0; c < cv; c++)                                                       \
            _mm512_mask_storeu_ps(O + u * ldo + c * 16, c == cv - 1 ? last : 0xFFFF,       \
                                  a[u][c]);                                                \
}

AC_DEF_BF16_QK(8, ac_bf16_qk8, AC_TGT_AVX512_BF16, ac_dp_bf16)
AC_DEF_BF16_QK(1, ac_bf16_qk1, AC_TGT_AVX512_BF16, ac_dp_bf16)
AC_DEF_BF16_PV(ac_bf16_pv, AC_TGT_AVX512_BF16, ac_dp_bf16)
AC_DEF_BF16_QK(8, ac_bf16_qk8_emu, AC_TGT_AVX512BW, ac_dp_bf16_emu)
AC_DEF_BF16_QK(1, ac_bf16_qk1_emu, AC_TGT_AVX512BW, ac_dp_bf16_emu)
AC_DEF_BF16_PV(ac_bf16_pv_emu, AC_TGT_AVX512BW, ac_dp_bf16_emu)

/* bfloat16 dot products: 0 off, 1 the instruction, 2 its AVX-512F spelling
 * (tests: the same path on a CPU without AVX512_BF16).  Set per call by
 * the driver (ac_params.bf16dot). */
static void ac_bf16_scores(int mode, const uint32_t *QT2, int Dh, const uint32_t *k16,
                           int nk, float qs, float *ST, __m512 *t0, __m512 *t1)
{
    int j = 0;
    if (mode == 1) {
        for (; j + 8 <= nk; j += 8)
            ac_bf16_qk8(QT2, Dh, k16 + (ptrdiff_t)j * Dh, Dh, qs, ST + (ptrdiff_t)j * 32, t0, t1);
        for (; j < nk; j++)
            ac_bf16_qk1(QT2, Dh, k16 + (ptrdiff_t)j * Dh, Dh, qs, ST + (ptrdiff_t)j * 32, t0, t1);
    } else {
        for (; j + 8 <= nk; j += 8)
            ac_bf16_qk8_emu(QT2, Dh, k16 + (ptrdiff_t)j * Dh, Dh, qs, ST + (ptrdiff_t)j * 32, t0,
                            t1);
        for (; j < nk; j++)
            ac_bf16_qk1_emu(QT2, Dh, k16 + (ptrdiff_t)j * Dh, Dh, qs, ST + (ptrdiff_t)j * 32, t0,
                            t1);
    }
}

/* acc rows [0, nr) (ld Dv) = alpha acc + P.V over np key pairs */
static void ac_bf16_pv_rows(int mode, const uint32_t *PT2, int np, const uint32_t *vi, int Dv,
                            float *acc, const float *alpha, int nr)
{
    for (int r = 0; r < nr; r += 4) {
        const int ru = nr - r < 4 ? nr - r : 4;
        for (int c0 = 0; c0 < Dv; c0 += 64) {
            const int w = Dv - c0 < 64 ? Dv - c0 : 64;
            const int cv = (w + 15) / 16, tail = w - 16 * (cv - 1);
            const __mmask16 last = (__mmask16)(tail == 16 ? 0xFFFFu : ((1u << tail) - 1u));
            if (mode == 1)
                ac_bf16_pv(PT2 + r, np, vi + c0, Dv, acc + (ptrdiff_t)r * Dv + c0, Dv, alpha + r,
                           ru, cv, last);
            else
                ac_bf16_pv_emu(PT2 + r, np, vi + c0, Dv, acc + (ptrdiff_t)r * Dv + c0, Dv,
                               alpha + r, ru, cv, last);
        }
    }
}
#endif /* AC_HAVE_X86 */

#endif /* AC_BF16DOT_H */
