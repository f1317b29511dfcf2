/*
 * ac_int8dot.h -- int8 Q.K^T (precision="int8") for the fused AVX-512
 * kernel: vpdpbusd (AVX512_VNNI, four u8 x s8 products per int32 lane)
 * with an exact int32 sum, then one float scaling per score before the
 * float32 online softmax.  P.V is not touched (float32, or bfloat16 pairs
 * where that path is on).
 *
 * Operands (made by attncore._int8 through ac_i8_quantize_rows):
 *   queries: int8 rows (row length a multiple of 4, zero padded) and one
 *            float scale per row (symmetric, per token);
 *   keys:    int8 rows likewise, with per key the pair (scale,
 *            128 * sum_d k8[d]) (ac_params.kq8 with ks_rs = 2; the second
 *            an int32 stored in the float's bits).
 * vpdpbusd multiplies an unsigned byte by a signed one.  The query panel
 * is packed with its bytes offset by 128 (q8 + 128 in [1, 255]) and the
 * keys are the signed operand, broadcast 4 bytes at a time from their
 * natural row layout, so int8 keys (an int8 KV cache) are read as they
 * are.  The offset adds 128 sum_d k8[d] to each dot product: it is taken
 * back exactly, in int32, by starting the key's accumulators at minus
 * that sum.
 *
 * Layout: QT4[t][r] = the 4 offset bytes q8[r][4t .. 4t+3] of query row r
 * (32 lanes), so one 32-bit broadcast of a key's 4 bytes feeds 32 rows.
 *
 * Each micro-kernel exists twice: with the instruction (target
 * avx512vnni), and with the same integer arithmetic in AVX-512BW (bytes
 * widened to 16 bits, vpmaddwd) for tests of the path on any AVX-512 CPU.
 */
#ifndef AC_INT8DOT_H
#define AC_INT8DOT_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include "ac_cpu.h"
#include "ac_half.h"

/* row r of x (row stride x_rs elements; fmt 0 float32, else 16-bit bits
   converted into ybuf, D floats) as float32 */
static inline const float *ac_i8_row(const void *x, int fmt, ptrdiff_t x_rs, ptrdiff_t r, int D,
                                     float *ybuf)
{
    if (!fmt) return (const float *)x + r * x_rs;
    ac_half_rows_f32(fmt, (const uint16_t *)x + r * x_rs, x_rs, 1, D, ybuf, D);
    return ybuf;
}

/*
 * The int8 operands of precision="int8": rows r < n of x (row stride
 * x_rs elements; fmt 0 float32, AC_H_BF16 / AC_H_F16 16-bit) as
 *   y[d] = (x[d] - sub[d]) * w[d]           (sub may be NULL: 0)
 *   scale = max_d |y[d]| / 127,  q8[d] = round(y[d] / scale)
 * into out (row length ld bytes, zero padded beyond D), scales[r] =
 * scale (0 for a row of zeros, NaN for a row with inf / NaN), and, when
 * dots is not NULL, dots[r] = sum_d x[d] dv[d] and, when ksum is not
 * NULL, ksum[r] = 128 sum_d q8[d] (an int32).  ybuf: D floats.
 * Rounding to nearest even by adding and subtracting 1.5 * 2^23 (|y /
 * scale| <= 127): the loops vectorize, without a libm call.
 */
#define AC_DEF_I8_QUANT(NAME, TGT)                                                         \
static TGT void NAME(const void *x, int fmt, ptrdiff_t x_rs, ptrdiff_t n, int D,          \
                     const float *sub, const float *w, const float *dv, int8_t *out,      \
                     ptrdiff_t ld, float *scales, float *dots, int32_t *ksum, float *ybuf) \
{                                                                                          \
    const float magic = 12582912.0f;                                                       \
    for (ptrdiff_t r = 0; r < n; r++) {                                                    \
        const float *xr = ac_i8_row(x, fmt, x_rs, r, D, ybuf);                             \
        if (dots) {                                                                        \
            float dot = 0.0f;                                                              \
            _Pragma("omp simd reduction(+:dot)")                                           \
            for (int d = 0; d < D; d++) dot += xr[d] * dv[d];                              \
            dots[r] = dot;                                                                 \
        }                                                                                  \
        float amax = 0.0f;                                                                 \
        int nonfinite = 0;                                                                 \
        _Pragma("omp simd reduction(max:amax) reduction(|:nonfinite)")                     \
        for (int d = 0; d < D; d++) {                                                      \
            const float y = (sub ? xr[d] - sub[d] : xr[d]) * w[d];                         \
            ybuf[d] = y;                                                                   \
            const float a = fabsf(y);                                                      \
            nonfinite |= !(a <= 3.0e38f);                                                  \
            amax = a > amax ? a : amax;                                                    \
        }                                                                                  \
        int8_t *o = out + r * ld;                                                          \
        int sum = 0;                                                                       \
        if (nonfinite || amax == 0.0f) {                                                   \
            memset(o, 0, (size_t)ld);                                                      \
            scales[r] = nonfinite ? NAN : 0.0f;                                            \
        } else {                                                                           \
            /* a row below 2^-64 is first scaled up by 2^64 (exactly): 127 /     \
               amax would overflow */                                                      \
            const float up = amax < 0x1p-64f ? 0x1p64f : 1.0f;                             \
            const float inv = 127.0f / (amax * up);                                        \
            _Pragma("omp simd reduction(+:sum)")                                           \
            for (int d = 0; d < D; d++) {                                                  \
                float t = ((ybuf[d] * up) * inv + magic) - magic;                          \
                t = t > 127.0f ? 127.0f : (t < -127.0f ? -127.0f : t);                     \
                const int it = (int)t;                                                     \
                o[d] = (int8_t)it;                                                         \
                sum += it;                                                                 \
            }                                                                              \
            for (ptrdiff_t d = D; d < ld; d++) o[d] = 0;                                   \
            scales[r] = amax / 127.0f;                                                     \
        }                                                                                  \
        if (ksum) ksum[r] = 128 * sum;                                                     \
    }                                                                                      \
}

/*
 * Column statistics of rows r < n of x (as ac_i8_quantize_rows), over the
 * finite entries of each column only:
 *   mean not NULL: mean[d] = the column's mean (0 without a finite entry),
 *                  mabs[d] = the mean of |x - mean[d]|, amax[d] = the
 *                  largest |x - mean[d]|;
 *   mean NULL:     mabs[d] = the mean of |x|, amax[d] = the largest |x|.
 * (A mean absolute value, not a maximum: one outlier entry moves it by its
 * share only.)  Sums in double.  ybuf: D floats; acc: 3 D doubles.
 */
#define AC_DEF_I8_STATS(NAME, TGT)                                                         \
static TGT void NAME(const void *x, int fmt, ptrdiff_t x_rs, ptrdiff_t n, int D,          \
                     float *mean, float *mabs, float *amax, float *ybuf, double *acc)      \
{                                                                                          \
    double *cnt = acc + D, *dev = acc + 2 * D;                                             \
    for (int d = 0; d < D; d++) {                                                          \
        acc[d] = 0.0;                                                                      \
        cnt[d] = 0.0;                                                                      \
        dev[d] = 0.0;                                                                      \
        amax[d] = 0.0f;                                                                    \
    }                                                                                      \
    for (int pass = 0; pass < (mean ? 2 : 1); pass++) {                                    \
        for (ptrdiff_t r = 0; r < n; r++) {                                                \
            const float *y = ac_i8_row(x, fmt, x_rs, r, D, ybuf);                          \
            if (pass == 0) {                                                               \
                _Pragma("omp simd")                                                        \
                for (int d = 0; d < D; d++) {                                              \
                    const float a = fabsf(y[d]);                                           \
                    const int ok = a <= 3.4028234663852886e38f;                            \
                    acc[d] += ok ? (double)y[d] : 0.0;                                     \
                    dev[d] += ok ? (double)a : 0.0;                                        \
                    cnt[d] += ok ? 1.0 : 0.0;                                              \
                    amax[d] = (ok && a > amax[d]) ? a : amax[d];                           \
                }                                                                          \
            } else {                                                                       \
                _Pragma("omp simd")                                                        \
                for (int d = 0; d < D; d++) {                                              \
                    const double t = (double)y[d] - (double)mean[d];                       \
                    const int ok = fabsf(y[d]) <= 3.4028234663852886e38f;                  \
                    const double at = t < 0 ? -t : t;                                      \
                    dev[d] += ok ? at : 0.0;                                               \
                    amax[d] = (ok && at > amax[d]) ? (float)at : amax[d];                  \
                }                                                                          \
            }                                                                              \
        }                                                                                  \
        if (pass == 0 && mean) {                                                           \
            for (int d = 0; d < D; d++) {                                                  \
                mean[d] = cnt[d] > 0 ? (float)(acc[d] / cnt[d]) : 0.0f;                    \
                dev[d] = 0.0;                                                              \
                amax[d] = 0.0f;                                                            \
            }                                                                              \
        }                                                                                  \
    }                                                                                      \
    for (int d = 0; d < D; d++) mabs[d] = cnt[d] > 0 ? (float)(dev[d] / cnt[d]) : 0.0f;    \
}

AC_DEF_I8_QUANT(ac_i8_quantize_rows_c, )
AC_DEF_I8_STATS(ac_i8_col_stats_c, )
#if AC_HAVE_X86
/* the same in AVX-512 (16 columns a vector, the last one masked) */
static AC_TGT_AVX512 void ac_i8_quantize_rows_avx512(
    const void *x, int fmt, ptrdiff_t x_rs, ptrdiff_t n, int D, const float *sub,
    const float *w, const float *dv, int8_t *out, ptrdiff_t ld, float *scales, float *dots,
    int32_t *ksum, float *ybuf)
{
    const __m512 absm = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
    for (ptrdiff_t r = 0; r < n; r++) {
        const float *xr = ac_i8_row(x, fmt, x_rs, r, D, ybuf);
        __m512 vdot = _mm512_setzero_ps(), vmax = _mm512_setzero_ps();
        __mmask16 nf = 0;
        for (int d = 0; d < D; d += 16) {
            const __mmask16 m = D - d >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (D - d)) - 1u);
            const __m512 xv = _mm512_maskz_loadu_ps(m, xr + d);
            if (dots) vdot = _mm512_fmadd_ps(xv, _mm512_maskz_loadu_ps(m, dv + d), vdot);
            __m512 y = sub ? _mm512_sub_ps(xv, _mm512_maskz_loadu_ps(m, sub + d)) : xv;
            y = _mm512_mul_ps(y, _mm512_maskz_loadu_ps(m, w + d));
            _mm512_mask_storeu_ps(ybuf + d, m, y);
            const __m512 a = _mm512_and_ps(y, absm);
            nf |= _mm512_mask_cmp_ps_mask(m, a, _mm512_set1_ps(3.0e38f), _CMP_NLE_UQ);
            vmax = _mm512_max_ps(vmax, a);
        }
        if (dots) dots[r] = _mm512_reduce_add_ps(vdot);
        const float amax = _mm512_reduce_max_ps(vmax);
        int8_t *o = out + r * ld;
        int sum = 0;
        if (nf || amax == 0.0f) {
            memset(o, 0, (size_t)ld);
            scales[r] = nf ? NAN : 0.0f;
        } else {
            /* a row below 2^-64 is first scaled up by 2^64 (exactly): 127 /
               amax would overflow */
            const float up = amax < 0x1p-64f ? 0x1p64f : 1.0f;
            const __m512 inv = _mm512_set1_ps(127.0f / (amax * up)), vup = _mm512_set1_ps(up);
            __m512i vs = _mm512_setzero_si512();
            for (int d = 0; d < D; d += 16) {
                const __mmask16 m = D - d >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (D - d)) - 1u);
                __m512i it = _mm512_cvtps_epi32(_mm512_mul_ps(
                    _mm512_mul_ps(_mm512_maskz_loadu_ps(m, ybuf + d), vup), inv));
                it = _mm512_max_epi32(_mm512_min_epi32(it, _mm512_set1_epi32(127)), _mm512_set1_epi32(-127));
                vs = _mm512_add_epi32(vs, it);
                _mm_mask_storeu_epi8(o + d, m, _mm512_cvtepi32_epi8(it));
            }
            sum = _mm512_reduce_add_epi32(vs);
            for (ptrdiff_t d = D; d < ld; d++) o[d] = 0;
            scales[r] = amax / 127.0f;
        }
        if (ksum) ksum[r] = 128 * sum;
    }
}
/* the same in AVX-512, 16 columns at a time, float sums (the statistics
   steer the quantization; their last bits do not matter) */
static AC_TGT_AVX512 void
ac_i8_col_stats_avx512(const void *x, int fmt, ptrdiff_t x_rs, ptrdiff_t n, int D, float *mean,
                       float *mabs, float *amax, float *ybuf, double *accd)
{
    float *sum = (float *)(void *)accd, *cnt = sum + D, *dev = cnt + D;
    const __m512 absm = _mm512_castsi512_ps(_mm512_set1_epi32(0x7FFFFFFF));
    const __m512 big = _mm512_set1_ps(3.4028234663852886e38f), one = _mm512_set1_ps(1.0f);
    for (int d = 0; d < D; d++) sum[d] = cnt[d] = dev[d] = amax[d] = 0.0f;
    for (int pass = 0; pass < (mean ? 2 : 1); pass++) {
        for (ptrdiff_t r = 0; r < n; r++) {
            const float *y = ac_i8_row(x, fmt, x_rs, r, D, ybuf);
            for (int d = 0; d < D; d += 16) {
                const __mmask16 m = D - d >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (D - d)) - 1u);
                const __m512 yv = _mm512_maskz_loadu_ps(m, y + d);
                const __mmask16 ok = _mm512_mask_cmp_ps_mask(m, _mm512_and_ps(yv, absm), big,
                                                             _CMP_LE_OQ);
                if (pass == 0) {
                    const __m512 c = _mm512_maskz_loadu_ps(m, cnt + d);
                    _mm512_mask_storeu_ps(cnt + d, m, _mm512_mask_add_ps(c, ok, c, one));
                    if (mean) {
                        const __m512 sm = _mm512_maskz_loadu_ps(m, sum + d);
                        _mm512_mask_storeu_ps(sum + d, m, _mm512_mask_add_ps(sm, ok, sm, yv));
                        continue;
                    }
                }
                /* |y| (queries) or |y - mean| (keys, second pass) */
                const __m512 t = mean ? _mm512_and_ps(_mm512_sub_ps(yv, _mm512_maskz_loadu_ps(m, mean + d)), absm)
                                      : _mm512_and_ps(yv, absm);
                const __m512 dv = _mm512_maskz_loadu_ps(m, dev + d);
                _mm512_mask_storeu_ps(dev + d, m, _mm512_mask_add_ps(dv, ok, dv, t));
                const __m512 am = _mm512_maskz_loadu_ps(m, amax + d);
                _mm512_mask_storeu_ps(amax + d, m, _mm512_mask_max_ps(am, ok, am, t));
            }
        }
        if (pass == 0 && mean)
            for (int d = 0; d < D; d++) mean[d] = cnt[d] > 0 ? sum[d] / cnt[d] : 0.0f;
    }
    for (int d = 0; d < D; d++) mabs[d] = cnt[d] > 0 ? dev[d] / cnt[d] : 0.0f;
}
#endif

static void ac_i8_quantize_rows(const void *x, int fmt, ptrdiff_t x_rs, ptrdiff_t n, int D,
                                const float *sub, const float *w, const float *dv,
                                int8_t *out, ptrdiff_t ld, float *scales, float *dots,
                                int32_t *ksum, float *ybuf)
{
#if AC_HAVE_X86
    if (ac_kernel_path == AC_PATH_AVX512) {
        ac_i8_quantize_rows_avx512(x, fmt, x_rs, n, D, sub, w, dv, out, ld, scales, dots, ksum,
                                   ybuf);
        return;
    }
#endif
    ac_i8_quantize_rows_c(x, fmt, x_rs, n, D, sub, w, dv, out, ld, scales, dots, ksum, ybuf);
}

static void ac_i8_col_stats(const void *x, int fmt, ptrdiff_t x_rs, ptrdiff_t n, int D,
                            float *mean, float *mabs, float *amax, float *ybuf, double *acc)
{
#if AC_HAVE_X86
    if (ac_kernel_path == AC_PATH_AVX512) {
        ac_i8_col_stats_avx512(x, fmt, x_rs, n, D, mean, mabs, amax, ybuf, acc);
        return;
    }
#endif
    ac_i8_col_stats_c(x, fmt, x_rs, n, D, mean, mabs, amax, ybuf, acc);
}

/* int8 query / key rows are read 4 bytes (one vpdpbusd group) at a time:
   their length (row stride of the int8 operands) is a multiple of this */
#define AC_I8_ROW_ALIGN 4

#if AC_HAVE_X86

static AC_TGT_AVX512_VNNI inline __m512i ac_dp_u8s8(__m512i acc, __m512i a, __m512i b)
{
    /* written out so that the sum accumulates in its register (the
       intrinsic made GCC 12 copy every accumulator around each
       instruction: a third of the micro-kernel's issue slots) */
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
    return acc;
}

/* the same four u8 x s8 products per lane in AVX-512BW: even / odd bytes
   widened to 16 bits, two vpmaddwd (each sums two products < 2^15 x 2^8:
   exact) */
static AC_TGT_AVX512 inline __m512i ac_dp_u8s8_emu(__m512i acc, __m512i a, __m512i b)
{
    const __m512i lo8 = _mm512_set1_epi16(0x00FF);
    const __m512i ae = _mm512_and_si512(a, lo8), ao = _mm512_srli_epi16(a, 8);
    const __m512i be = _mm512_srai_epi16(_mm512_slli_epi16(b, 8), 8);
    const __m512i bo = _mm512_srai_epi16(b, 8);
    return _mm512_add_epi32(acc, _mm512_add_epi32(_mm512_madd_epi16(ae, be),
                                                  _mm512_madd_epi16(ao, bo)));
}

/* QT4 (Dq x 32 words) from int8 query rows r < nr (rows nr..31: 0 bytes,
   i.e. offset 0x80 each, with scale 0), then rs[32] = qs * scale of each
   row */
static void ac_i8_pack_panel(const int8_t *q, ptrdiff_t q_rs, const float *qsc, int nr, int D,
                             float qs, uint32_t *QT4)
{
    const int Dq = (D + 3) / 4;
    for (int r = 0; r < 32; r++) {
        const int8_t *qr = q + (ptrdiff_t)r * q_rs;
        for (int t = 0; t < Dq; t++) {
            uint32_t u = 0;
            if (r < nr) memcpy(&u, qr + 4 * t, 4);
            QT4[(ptrdiff_t)t * 32 + r] = u ^ 0x80808080u;
        }
    }
    float *rsc = (float *)(void *)(QT4 + (ptrdiff_t)Dq * 32);
    for (int r = 0; r < 32; r++) rsc[r] = r < nr ? qs * qsc[r] : 0.0f;
}

/* scores of KU keys (int8 rows of ld k_rs bytes; kp: per key (scale,
 * 128 sum k8)) x 32 query lanes into ST rows (ld 32); running tile max */
#define AC_DEF_I8_QK(KU, NAME, TGT, DP)                                                    \
static TGT AC_NOINLINE void NAME(const uint32_t *QT4, int Dq,              \
                                               const int8_t *kr, ptrdiff_t k_rs,          \
                                               const float *kp, float *ST, __m512 *mx0,   \
                                               __m512 *mx1)                               \
{                                                                                          \
    __m512i a0[KU], a1[KU];                                                                \
    _Pragma("GCC unroll 8")                                                                \
    for (int u = 0; u < KU; u++) {                                                        \
        int32_t c_;                                                                        \
        memcpy(&c_, kp + 2 * u + 1, 4);                                                    \
        a0[u] = _mm512_set1_epi32(-c_);                                                    \
        a1[u] = a0[u];                                                                     \
    }                                                                                      \
    for (int t = 0; t < Dq; t++) {                                                         \
        const __m512i q0 = _mm512_loadu_si512((const void *)(QT4 + (ptrdiff_t)t * 32));      \
        const __m512i q1 = _mm512_loadu_si512((const void *)(QT4 + (ptrdiff_t)t * 32 + 16)); \
        _Pragma("GCC unroll 8")                                                            \
        for (int u = 0; u < KU; u++) {                                                     \
            int32_t w;                                                                     \
            memcpy(&w, kr + (ptrdiff_t)u * k_rs + 4 * t, 4);                               \
            const __m512i b = _mm512_set1_epi32(w);                                        \
            a0[u] = DP(a0[u], q0, b);                                                      \
            a1[u] = DP(a1[u], q1, b);                                                      \
        }                                                                                  \
    }                                                                                      \
    const float *rsc = (const float *)(const void *)(QT4 + (ptrdiff_t)Dq * 32);            \
    const __m512 s0 = _mm512_loadu_ps(rsc), s1 = _mm512_loadu_ps(rsc + 16);                \
    __m512 m0 = *mx0, m1 = *mx1;                                                           \
    _Pragma("GCC unroll 8")                                                                \
    for (int u = 0; u < KU; u++) {                                                         \
        const __m512 ks = _mm512_set1_ps(kp[2 * u]);                                       \
        const __m512 x0 = _mm512_mul_ps(_mm512_cvtepi32_ps(a0[u]), _mm512_mul_ps(s0, ks)); \
        const __m512 x1 = _mm512_mul_ps(_mm512_cvtepi32_ps(a1[u]), _mm512_mul_ps(s1, ks)); \
        _mm512_storeu_ps(ST + u * 32, x0);                                                 \
        _mm512_storeu_ps(ST + u * 32 + 16, x1);                                            \
        m0 = _mm512_max_ps(x0, m0);                                                        \
        m1 = _mm512_max_ps(x1, m1);                                                        \
    }                                                                                      \
    *mx0 = m0;                                                                             \
    *mx1 = m1;                                                                             \
}

AC_DEF_I8_QK(8, ac_i8_qk8, AC_TGT_AVX512_VNNI, ac_dp_u8s8)
AC_DEF_I8_QK(1, ac_i8_qk1, AC_TGT_AVX512_VNNI, ac_dp_u8s8)
AC_DEF_I8_QK(8, ac_i8_qk8_emu, AC_TGT_AVX512, ac_dp_u8s8_emu)
AC_DEF_I8_QK(1, ac_i8_qk1_emu, AC_TGT_AVX512, ac_dp_u8s8_emu)

/* the 16 horizontal int32 sums of a[0..15] (lane i: sum of a[i]), the
 * transposing tree of ac_hsum16_avx512 in integers (exact) */
static AC_TGT_AVX512 inline __m512i ac_hsum16_epi32(const __m512i *a)
{
    __m512i t[8], u[4];
    for (int i = 0; i < 8; i++)
        t[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(a[2 * i], a[2 * i + 1]),
                                _mm512_unpackhi_epi32(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        u[i] = _mm512_add_epi32(_mm512_unpacklo_epi64(t[2 * i], t[2 * i + 1]),
                                _mm512_unpackhi_epi64(t[2 * i], t[2 * i + 1]));
    const __m512i x01 = _mm512_add_epi32(_mm512_shuffle_i32x4(u[0], u[1], 0x44),
                                         _mm512_shuffle_i32x4(u[0], u[1], 0xEE));
    const __m512i x23 = _mm512_add_epi32(_mm512_shuffle_i32x4(u[2], u[3], 0x44),
                                         _mm512_shuffle_i32x4(u[2], u[3], 0xEE));
    return _mm512_add_epi32(_mm512_shuffle_i32x4(x01, x23, 0x88),
                            _mm512_shuffle_i32x4(x01, x23, 0xDD));
}

/* S[r, j] = scale * sq[r] * ks[j] * (q8_r . k8_j) for a few query rows
 * (decoding), keys read in place: 16 keys at a time, each key's bytes
 * (offset by 128: the unsigned operand) against the query row's, the 16
 * sums reduced together.  The offset adds 128 sum_d q8_r[d] to every sum
 * of row r: subtracted once.  Query rows are zero padded to ld bytes,
 * keys are read for D bytes only. */
#define AC_DEF_I8_SMALL(NAME, TGT, DP)                                                     \
static TGT void NAME(int nq, int nk, int D, float scale, const int8_t *q, ptrdiff_t q_rs,  \
                     const float *sq, const int8_t *k, ptrdiff_t k_rs, const float *ks,   \
                     ptrdiff_t ks_rs, float *S, int ldS)                                  \
{                                                                                          \
    const int nc = (D + 63) / 64;                                                          \
    const __m512i off = _mm512_set1_epi8((char)0x80);                                      \
    const __m512i idx = _mm512_mullo_epi32(                                                \
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),           \
        _mm512_set1_epi32((int)ks_rs));                                                    \
    for (int r = 0; r < nq; r++) {                                                         \
        const int8_t *qr = q + r * q_rs;                                                   \
        __m512i qv[4];                                                                     \
        __mmask64 cm[4];                                                                   \
        int qsum = 0;                                                                      \
        for (int c = 0; c < nc && c < 4; c++) {                                            \
            const int n = D - 64 * c < 64 ? D - 64 * c : 64;                               \
            cm[c] = n == 64 ? ~(__mmask64)0 : (((__mmask64)1 << n) - 1);                   \
            qv[c] = _mm512_maskz_loadu_epi8(cm[c], qr + 64 * c);                           \
        }                                                                                  \
        for (int d = 0; d < D; d++) qsum += qr[d];                                         \
        const __m512i comp = _mm512_set1_epi32(128 * qsum);                                \
        const float rs = scale * sq[r];                                                    \
        float *Sr = S + (ptrdiff_t)r * ldS;                                                \
        int j = 0;                                                                         \
        for (; j < nk; j += 16) {                                                          \
            const int nu = nk - j < 16 ? nk - j : 16;                                      \
            const int8_t *kb = k + (ptrdiff_t)j * k_rs;                                    \
            if (j + 48 <= nk) /* the block after next, a line at a time */                \
                for (int u = 0; u < 16; u++)                                               \
                    for (int o = 0; o < D; o += 64)                                        \
                        _mm_prefetch((const char *)(kb + (ptrdiff_t)(u + 32) * k_rs + o),  \
                                     _MM_HINT_T0);                                         \
            __m512i a[16];                                                                 \
            for (int u = 0; u < 16; u++) {                                                 \
                __m512i acc = _mm512_setzero_si512();                                      \
                if (u < nu) {                                                              \
                    const int8_t *kr = kb + (ptrdiff_t)u * k_rs;                           \
                    if (nc <= 4) {                                                         \
                        for (int c = 0; c < nc; c++)                                       \
                            acc = DP(acc, _mm512_xor_si512(                                \
                                              _mm512_maskz_loadu_epi8(cm[c], kr + 64 * c), off), \
                                     qv[c]);                                               \
                    } else {                                                               \
                        for (int c = 0; c < nc; c++) {                                     \
                            const int n = D - 64 * c < 64 ? D - 64 * c : 64;               \
                            const __mmask64 m = n == 64 ? ~(__mmask64)0 : (((__mmask64)1 << n) - 1); \
                            acc = DP(acc, _mm512_xor_si512(_mm512_maskz_loadu_epi8(m, kr + 64 * c), off), \
                                     _mm512_maskz_loadu_epi8(m, qr + 64 * c));             \
                        }                                                                  \
                    }                                                                      \
                }                                                                          \
                a[u] = acc;                                                                \
            }                                                                              \
            const __mmask16 live = (__mmask16)(nu == 16 ? 0xFFFFu : ((1u << nu) - 1u));     \
            const __m512 kscale = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, idx,  \
                                                           ks + (ptrdiff_t)j * ks_rs, 4);  \
            const __m512 sc = _mm512_mul_ps(                                               \
                _mm512_cvtepi32_ps(_mm512_sub_epi32(ac_hsum16_epi32(a), comp)),            \
                                            _mm512_mul_ps(kscale, _mm512_set1_ps(rs)));    \
            _mm512_mask_storeu_ps(Sr + j, live, sc);                                       \
        }                                                                                  \
    }                                                                                      \
}

AC_DEF_I8_SMALL(ac_i8_scores_small, AC_TGT_AVX512_VNNI, ac_dp_u8s8)
AC_DEF_I8_SMALL(ac_i8_scores_small_emu, AC_TGT_AVX512, ac_dp_u8s8_emu)

/* scores of nk keys from kr (ld k_rs bytes), kp (ld 2 floats): mode 1
   vpdpbusd, 2 its AVX-512BW spelling */
static void ac_i8_scores(int mode, const uint32_t *QT4, int Dq, const int8_t *kr,
                         ptrdiff_t k_rs, const float *kp, int nk, float *ST, __m512 *t0,
                         __m512 *t1)
{
    int j = 0;
    if (mode == 1) {
        for (; j + 8 <= nk; j += 8)
            ac_i8_qk8(QT4, Dq, kr + j * k_rs, k_rs, kp + 2 * j, ST + (ptrdiff_t)j * 32, t0, t1);
        for (; j < nk; j++)
            ac_i8_qk1(QT4, Dq, kr + j * k_rs, k_rs, kp + 2 * j, ST + (ptrdiff_t)j * 32, t0, t1);
    } else {
        for (; j + 8 <= nk; j += 8)
            ac_i8_qk8_emu(QT4, Dq, kr + j * k_rs, k_rs, kp + 2 * j, ST + (ptrdiff_t)j * 32, t0,
                          t1);
        for (; j < nk; j++)
            ac_i8_qk1_emu(QT4, Dq, kr + j * k_rs, k_rs, kp + 2 * j, ST + (ptrdiff_t)j * 32, t0,
                          t1);
    }
}
#endif /* AC_HAVE_X86 */

#endif /* AC_INT8DOT_H */
