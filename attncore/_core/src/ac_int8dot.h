/*
 * ac_int8dot.h -- int8 Q.K^T (precision="int8") for the fused AVX-512
 * kernel (and, at the end, for the fused AVX2 kernel: vpmaddubsw with the
 * sign trick, AVX-VNNI): vpdpbusd (AVX512_VNNI, four u8 x s8 products per int32 lane)
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
#include "ac_bf16dot.h"

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

/* the same in AVX2 (8 columns a vector, the last one through lane masks):
   the AVX2 path's quantizer, as fast there as the AVX-512 one is on its
   path (the portable loops took 4x the time) */
static AC_TGT_AVX2 inline __m256i ac_i8_lanes_avx2(int n)
{
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

static AC_TGT_AVX2 inline float ac_i8_hmax_avx2(__m256 v)
{
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_shuffle_ps(x, x, 1));
    return _mm_cvtss_f32(x);
}

/* 8 floats at p: a plain load for a full vector, else lanes m only */
#define AC_I8_LD8(p, full, m) ((full) ? _mm256_loadu_ps(p) : _mm256_maskload_ps((p), (m)))

static AC_TGT_AVX2 void ac_i8_quantize_rows_avx2(
    const void *x, int fmt, ptrdiff_t x_rs, ptrdiff_t n, int D, const float *sub,
    const float *w, const float *dv, int8_t *out, ptrdiff_t ld, float *scales, float *dots,
    int32_t *ksum, float *ybuf)
{
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256 big = _mm256_set1_ps(3.0e38f);
    const __m256i ones = _mm256_set1_epi32(-1);
    for (ptrdiff_t r = 0; r < n; r++) {
        const float *xr = ac_i8_row(x, fmt, x_rs, r, D, ybuf);
        __m256 vdot = _mm256_setzero_ps(), vmax = _mm256_setzero_ps(), nf = _mm256_setzero_ps();
        for (int d = 0; d < D; d += 8) {
            /* full vectors unmasked, the last one through lane masks */
            const int full = D - d >= 8;
            const __m256i m = full ? ones : ac_i8_lanes_avx2(D - d);
            const __m256 xv = AC_I8_LD8(xr + d, full, m);
            if (dots) vdot = _mm256_fmadd_ps(xv, AC_I8_LD8(dv + d, full, m), vdot);
            __m256 y = sub ? _mm256_sub_ps(xv, AC_I8_LD8(sub + d, full, m)) : xv;
            y = _mm256_mul_ps(y, AC_I8_LD8(w + d, full, m));
            if (full)
                _mm256_storeu_ps(ybuf + d, y);
            else
                _mm256_maskstore_ps(ybuf + d, m, y);
            const __m256 a = _mm256_and_ps(y, absm);
            /* lanes beyond D are 0: never > 3e38, never NaN */
            nf = _mm256_or_ps(nf, _mm256_cmp_ps(a, big, _CMP_NLE_UQ));
            vmax = _mm256_max_ps(vmax, a);
        }
        if (dots) dots[r] = ac_hsum1_avx2(vdot);
        const float amax = ac_i8_hmax_avx2(vmax);
        const int nonfinite = _mm256_movemask_ps(nf) != 0;
        int8_t *o = out + r * ld;
        int sum = 0;
        if (nonfinite || amax == 0.0f) {
            memset(o, 0, (size_t)ld);
            scales[r] = nonfinite ? NAN : 0.0f;
        } else {
            /* a row below 2^-64 is first scaled up by 2^64 (exactly): 127 /
               amax would overflow */
            const float up = amax < 0x1p-64f ? 0x1p64f : 1.0f;
            const __m256 inv = _mm256_set1_ps(127.0f / (amax * up)), vup = _mm256_set1_ps(up);
            __m256i vs = _mm256_setzero_si256();
            for (int d = 0; d < D; d += 8) {
                const int full = D - d >= 8;
                const __m256i m = full ? ones : ac_i8_lanes_avx2(D - d);
                __m256i it = _mm256_cvtps_epi32(_mm256_mul_ps(
                    _mm256_mul_ps(AC_I8_LD8(ybuf + d, full, m), vup), inv));
                it = _mm256_max_epi32(_mm256_min_epi32(it, _mm256_set1_epi32(127)),
                                      _mm256_set1_epi32(-127));
                it = _mm256_and_si256(it, m);
                vs = _mm256_add_epi32(vs, it);
                const __m128i h = _mm_packs_epi32(_mm256_castsi256_si128(it),
                                                  _mm256_extracti128_si256(it, 1));
                const __m128i b = _mm_packs_epi16(h, h);
                if (D - d >= 8) {
                    _mm_storel_epi64((__m128i *)(void *)(o + d), b);
                } else {
                    int8_t tmp[16];
                    _mm_storeu_si128((__m128i *)(void *)tmp, b);
                    memcpy(o + d, tmp, (size_t)(D - d));
                }
            }
            const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(vs),
                                             _mm256_extracti128_si256(vs, 1));
            const __m128i s2 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
            sum = _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0xB1)));
            for (ptrdiff_t d = D; d < ld; d++) o[d] = 0;
            scales[r] = amax / 127.0f;
        }
        if (ksum) ksum[r] = 128 * sum;
    }
}

/* the column statistics in AVX2, float sums (as the AVX-512 one).
   float32 rows: blocks of rows that fit L1 (16 KiB), each 16 columns at a
   time over the block's rows with the running sums in registers -- each
   column's sums still in row order, as the row by row loop, which loaded
   and stored every sum for every row (_sdpa.int8_col_stats alone, AVX2
   path, one thread, Xeon (Sapphire Rapids class): 8 x 1024 x 128 keys
   0.51 -> 0.38 ms, queries 0.32 -> 0.29, 64 x 128 x 64 keys 0.25 ->
   0.15; within a call the first read of the rows from memory dominates).
   16-bit rows: converted row by row, 8 columns at a time. */
/* 16 floats of a row at p (lanes m0, m1: the rest read as 0) and which
   of them are finite */
static AC_TGT_AVX2 inline void ac_i8_row16_avx2(const float *p, __m256i m0, __m256i m1,
                                                __m256 *y0, __m256 *y1, __m256 *ok0,
                                                __m256 *ok1)
{
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256 big = _mm256_set1_ps(3.4028234663852886e38f);
    *y0 = _mm256_maskload_ps(p, m0);
    *y1 = _mm256_maskload_ps(p + 8, m1);
    *ok0 = _mm256_cmp_ps(_mm256_and_ps(*y0, absm), big, _CMP_LE_OQ);
    *ok1 = _mm256_cmp_ps(_mm256_and_ps(*y1, absm), big, _CMP_LE_OQ);
}

static AC_TGT_AVX2 void ac_i8_col_stats_f32_avx2(const float *x, ptrdiff_t x_rs, ptrdiff_t n,
                                                 int D, float *mean, float *mabs, float *amax,
                                                 float *sum, float *cnt, float *dev)
{
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256 one = _mm256_set1_ps(1.0f);
    const ptrdiff_t RB = D < 512 ? 4096 / D : 8;
    for (int d = 0; d < D; d++) sum[d] = cnt[d] = dev[d] = amax[d] = 0.0f;
    for (int pass = 0; pass < (mean ? 2 : 1); pass++) {
        const int counts = pass == 0, sums = pass == 0 && mean;
        for (ptrdiff_t r0 = 0; r0 < n; r0 += RB) {
            const ptrdiff_t r1 = n - r0 < RB ? n : r0 + RB;
            for (int d0 = 0; d0 < D; d0 += 16) {
                /* lanes beyond D: loaded as 0, never stored */
                const __m256i m0 = ac_i8_lanes_avx2(D - d0), m1 = ac_i8_lanes_avx2(D - d0 - 8);
                const float *xc = x + d0;
                __m256 c0 = _mm256_maskload_ps(cnt + d0, m0), c1 = _mm256_maskload_ps(cnt + d0 + 8, m1);
                if (sums) {
                    __m256 s0 = _mm256_maskload_ps(sum + d0, m0);
                    __m256 s1 = _mm256_maskload_ps(sum + d0 + 8, m1);
                    for (ptrdiff_t r = r0; r < r1; r++) {
                        __m256 y0, y1, ok0, ok1;
                        ac_i8_row16_avx2(xc + r * x_rs, m0, m1, &y0, &y1, &ok0, &ok1);
                        c0 = _mm256_add_ps(c0, _mm256_and_ps(ok0, one));
                        c1 = _mm256_add_ps(c1, _mm256_and_ps(ok1, one));
                        s0 = _mm256_add_ps(s0, _mm256_and_ps(ok0, y0));
                        s1 = _mm256_add_ps(s1, _mm256_and_ps(ok1, y1));
                    }
                    _mm256_maskstore_ps(sum + d0, m0, s0);
                    _mm256_maskstore_ps(sum + d0 + 8, m1, s1);
                    _mm256_maskstore_ps(cnt + d0, m0, c0);
                    _mm256_maskstore_ps(cnt + d0 + 8, m1, c1);
                    continue;
                }
                /* |y| (queries) or |y - mean| (keys, second pass) */
                const __m256 mu0 = mean ? _mm256_maskload_ps(mean + d0, m0) : _mm256_setzero_ps();
                const __m256 mu1 = mean ? _mm256_maskload_ps(mean + d0 + 8, m1) : _mm256_setzero_ps();
                __m256 v0 = _mm256_maskload_ps(dev + d0, m0), v1 = _mm256_maskload_ps(dev + d0 + 8, m1);
                __m256 a0 = _mm256_maskload_ps(amax + d0, m0);
                __m256 a1 = _mm256_maskload_ps(amax + d0 + 8, m1);
                for (ptrdiff_t r = r0; r < r1; r++) {
                    __m256 y0, y1, ok0, ok1;
                    ac_i8_row16_avx2(xc + r * x_rs, m0, m1, &y0, &y1, &ok0, &ok1);
                    if (counts) {
                        c0 = _mm256_add_ps(c0, _mm256_and_ps(ok0, one));
                        c1 = _mm256_add_ps(c1, _mm256_and_ps(ok1, one));
                    }
                    const __m256 t0 = _mm256_and_ps(_mm256_sub_ps(y0, mu0), absm);
                    const __m256 t1 = _mm256_and_ps(_mm256_sub_ps(y1, mu1), absm);
                    v0 = _mm256_add_ps(v0, _mm256_and_ps(ok0, t0));
                    v1 = _mm256_add_ps(v1, _mm256_and_ps(ok1, t1));
                    a0 = _mm256_blendv_ps(a0, _mm256_max_ps(a0, t0), ok0);
                    a1 = _mm256_blendv_ps(a1, _mm256_max_ps(a1, t1), ok1);
                }
                _mm256_maskstore_ps(dev + d0, m0, v0);
                _mm256_maskstore_ps(dev + d0 + 8, m1, v1);
                _mm256_maskstore_ps(amax + d0, m0, a0);
                _mm256_maskstore_ps(amax + d0 + 8, m1, a1);
                if (counts) {
                    _mm256_maskstore_ps(cnt + d0, m0, c0);
                    _mm256_maskstore_ps(cnt + d0 + 8, m1, c1);
                }
            }
        }
        if (sums)
            for (int d = 0; d < D; d++) mean[d] = cnt[d] > 0 ? sum[d] / cnt[d] : 0.0f;
    }
    for (int d = 0; d < D; d++) mabs[d] = cnt[d] > 0 ? dev[d] / cnt[d] : 0.0f;
}

static AC_TGT_AVX2 void ac_i8_col_stats_avx2(const void *x, int fmt, ptrdiff_t x_rs,
                                             ptrdiff_t n, int D, float *mean, float *mabs,
                                             float *amax, float *ybuf, double *accd)
{
    float *sum = (float *)(void *)accd, *cnt = sum + D, *dev = cnt + D;
    if (!fmt) {
        ac_i8_col_stats_f32_avx2((const float *)x, x_rs, n, D, mean, mabs, amax, sum, cnt, dev);
        return;
    }
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    const __m256 big = _mm256_set1_ps(3.4028234663852886e38f), one = _mm256_set1_ps(1.0f);
    for (int d = 0; d < D; d++) sum[d] = cnt[d] = dev[d] = amax[d] = 0.0f;
    for (int pass = 0; pass < (mean ? 2 : 1); pass++) {
        for (ptrdiff_t r = 0; r < n; r++) {
            const float *y = ac_i8_row(x, fmt, x_rs, r, D, ybuf);
            for (int d = 0; d < D; d += 8) {
                const __m256i m = ac_i8_lanes_avx2(D - d);
                const __m256 yv = _mm256_maskload_ps(y + d, m);
                /* finite entries (lanes beyond D: 0, never stored) */
                const __m256 ok = _mm256_cmp_ps(_mm256_and_ps(yv, absm), big, _CMP_LE_OQ);
                if (pass == 0) {
                    const __m256 c = _mm256_maskload_ps(cnt + d, m);
                    _mm256_maskstore_ps(cnt + d, m, _mm256_add_ps(c, _mm256_and_ps(ok, one)));
                    if (mean) {
                        const __m256 sm = _mm256_maskload_ps(sum + d, m);
                        _mm256_maskstore_ps(sum + d, m, _mm256_add_ps(sm, _mm256_and_ps(ok, yv)));
                        continue;
                    }
                }
                /* |y| (queries) or |y - mean| (keys, second pass) */
                const __m256 t = mean ? _mm256_and_ps(_mm256_sub_ps(yv, _mm256_maskload_ps(mean + d, m)), absm)
                                      : _mm256_and_ps(yv, absm);
                const __m256 dvv = _mm256_maskload_ps(dev + d, m);
                _mm256_maskstore_ps(dev + d, m, _mm256_add_ps(dvv, _mm256_and_ps(ok, t)));
                const __m256 am = _mm256_maskload_ps(amax + d, m);
                _mm256_maskstore_ps(amax + d, m, _mm256_blendv_ps(am, _mm256_max_ps(am, t), ok));
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
    if (ac_kernel_path == AC_PATH_AVX2) {
        ac_i8_quantize_rows_avx2(x, fmt, x_rs, n, D, sub, w, dv, out, ld, scales, dots, ksum,
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
    if (ac_kernel_path == AC_PATH_AVX2) {
        ac_i8_col_stats_avx2(x, fmt, x_rs, n, D, mean, mabs, amax, ybuf, acc);
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
                _mm512_cvtepi32_ps(_mm512_sub_epi32(                                       \
                    _mm512_castps_si512(ac_hsum16_avx512((const __m512 *)a, 1)), comp)),   \
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

/* ------------------------------------------------------------------------
 * The same Q.K^T for the fused AVX2 kernel (16-row panels, 2 ymm of query
 * lanes), AC_PATH_AVX2.  Three spellings of one exact int32 sum, chosen by
 * the qk8 code:
 *   AC_QK8_MADDUBS (4)  AVX2 alone: vpmaddubsw + vpmaddwd with the sign
 *       trick.  vpmaddubsw multiplies unsigned bytes by signed ones and
 *       adds adjacent pairs into int16 with saturation; with |q| as the
 *       unsigned operand and q's sign moved onto the key (vpsignb), both
 *       factors stay within +-128 / +-127 and a pair sums to at most 2 x
 *       128 x 127 = 32512 < 32767: never saturated.  vpmaddwd with ones
 *       then adds the pairs into int32.  The query bytes are packed as they
 *       are (|q| is taken once per 4 channels, not per key), no correction.
 *       (A key byte of -128 has no positive counterpart for vpsignb: int8
 *       keys given by the caller that hold -128 take code 6, see
 *       attncore._call.)
 *   AC_QK8_AVXVNNI (5)  vpdpbusd on ymm (AVX-VNNI, VEX encoded): the layout
 *       of the AVX-512 kernel above, query bytes offset by 128, the key's
 *       128 sum k8 taken back by the accumulators' start value.
 *   AC_QK8_AVXVNNI_EMU (6)  code 5's arithmetic in AVX2 (bytes widened to
 *       16 bits, vpmaddwd): tests of that layout on any AVX2 CPU, and the
 *       full int8 range of keys for code 4.
 * Layout: QT4[t][r] = the 4 bytes q8[r][4t .. 4t+3] of query row r (16
 * lanes; xor 0x80 for codes 5 / 6), then the 16 rows' scales.  Dq x 16 +
 * 16 words: within the panel's D x 16 floats for D >= 2.
 * ---------------------------------------------------------------------- */
#define AC_QK8_MADDUBS 4
#define AC_QK8_AVXVNNI 5
#define AC_QK8_AVXVNNI_EMU 6
/* the qk8 codes of the fused AVX2 kernel */
#define AC_QK8_AVX2(c) ((c) >= AC_QK8_MADDUBS && (c) <= AC_QK8_AVXVNNI_EMU)
/* keys per score micro-tile: 2 KU accumulators of 16 ymm registers (the
   sign trick needs 5 more: |q|, q and the key's signed bytes, temps) */
#ifndef AC_I8_KU_MADDUBS
#define AC_I8_KU_MADDUBS 3
#endif
#ifndef AC_I8_KU_VNNI256
#define AC_I8_KU_VNNI256 6
#endif

static AC_TGT_AVXVNNI inline __m256i ac_dp256_u8s8(__m256i acc, __m256i a, __m256i b)
{
    /* {vex}: the AVX-VNNI encoding (an assembler picks EVEX for the bare
       mnemonic, an AVX512_VNNI + VL instruction); asm as ac_dp_u8s8 */
    __asm__("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(a), "x"(b));
    return acc;
}

/* the same four u8 x s8 products per lane in AVX2 (as ac_dp_u8s8_emu) */
static AC_TGT_AVX2 inline __m256i ac_dp256_u8s8_emu(__m256i acc, __m256i a, __m256i b)
{
    const __m256i lo8 = _mm256_set1_epi16(0x00FF);
    const __m256i ae = _mm256_and_si256(a, lo8), ao = _mm256_srli_epi16(a, 8);
    const __m256i be = _mm256_srai_epi16(_mm256_slli_epi16(b, 8), 8);
    const __m256i bo = _mm256_srai_epi16(b, 8);
    return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(ae, be),
                                                  _mm256_madd_epi16(ao, bo)));
}

/* QT4 (Dq x 16 words) from int8 query rows r < nr (rows nr..15: zero
   bytes, offset for codes 5 / 6, with scale 0), then rs[16] = qs * scale
   of each row */
static void ac_i8_pack_panel16(int mode, const int8_t *q, ptrdiff_t q_rs, const float *qsc,
                               int nr, int D, float qs, uint32_t *QT4)
{
    const int Dq = (D + 3) / 4;
    const uint32_t x = mode == AC_QK8_MADDUBS ? 0u : 0x80808080u;
    for (int r = 0; r < 16; r++) {
        const int8_t *qr = q + (ptrdiff_t)r * q_rs;
        for (int t = 0; t < Dq; t++) {
            uint32_t u = 0;
            if (r < nr) memcpy(&u, qr + 4 * t, 4);
            QT4[(ptrdiff_t)t * 16 + r] = u ^ x;
        }
    }
    float *rsc = (float *)(void *)(QT4 + (ptrdiff_t)Dq * 16);
    for (int r = 0; r < 16; r++) rsc[r] = r < nr ? qs * qsc[r] : 0.0f;
}

/* the tile's float scores from the int32 sums: ST rows (ld 16), running
   tile max */
#define AC_I8_FINISH256(KU)                                                                \
    const float *rsc = (const float *)(const void *)(QT4 + (ptrdiff_t)Dq * 16);            \
    const __m256 s0 = _mm256_loadu_ps(rsc), s1 = _mm256_loadu_ps(rsc + 8);                 \
    __m256 m0 = *mx0, m1 = *mx1;                                                           \
    _Pragma("GCC unroll 8")                                                                \
    for (int u = 0; u < KU; u++) {                                                         \
        const __m256 ks = _mm256_set1_ps(kp[2 * u]);                                       \
        const __m256 x0 = _mm256_mul_ps(_mm256_cvtepi32_ps(a0[u]), _mm256_mul_ps(s0, ks)); \
        const __m256 x1 = _mm256_mul_ps(_mm256_cvtepi32_ps(a1[u]), _mm256_mul_ps(s1, ks)); \
        _mm256_storeu_ps(ST + u * 16, x0);                                                 \
        _mm256_storeu_ps(ST + u * 16 + 8, x1);                                             \
        m0 = _mm256_max_ps(x0, m0);                                                        \
        m1 = _mm256_max_ps(x1, m1);                                                        \
    }                                                                                      \
    *mx0 = m0;                                                                             \
    *mx1 = m1;

/* codes 5 / 6: scores of KU keys (int8 rows of ld k_rs bytes; kp: per key
 * (scale, 128 sum k8)) x 16 query lanes into ST rows (ld 16) */
#define AC_DEF_I8_QK256(KU, NAME, TGT, DP)                                                 \
static TGT AC_NOINLINE void NAME(const uint32_t *QT4, int Dq, const int8_t *kr,           \
                                 ptrdiff_t k_rs, const float *kp, float *ST, __m256 *mx0,  \
                                 __m256 *mx1)                                              \
{                                                                                          \
    __m256i a0[KU], a1[KU];                                                                \
    _Pragma("GCC unroll 8")                                                                \
    for (int u = 0; u < KU; u++) {                                                         \
        int32_t c_;                                                                        \
        memcpy(&c_, kp + 2 * u + 1, 4);                                                    \
        a0[u] = _mm256_set1_epi32(-c_);                                                    \
        a1[u] = a0[u];                                                                     \
    }                                                                                      \
    for (int t = 0; t < Dq; t++) {                                                         \
        const __m256i q0 = _mm256_loadu_si256((const __m256i *)(QT4 + (ptrdiff_t)t * 16));  \
        const __m256i q1 = _mm256_loadu_si256((const __m256i *)(QT4 + (ptrdiff_t)t * 16 + 8)); \
        _Pragma("GCC unroll 8")                                                            \
        for (int u = 0; u < KU; u++) {                                                     \
            int32_t w;                                                                     \
            memcpy(&w, kr + (ptrdiff_t)u * k_rs + 4 * t, 4);                               \
            const __m256i b = _mm256_set1_epi32(w);                                        \
            a0[u] = DP(a0[u], q0, b);                                                      \
            a1[u] = DP(a1[u], q1, b);                                                      \
        }                                                                                  \
    }                                                                                      \
    AC_I8_FINISH256(KU)                                                                    \
}

/* code 4, the sign trick: per lane sum over 4 channels of |q| (q's sign
 * on k): vpsignb zeroes the key bytes where q is 0 */
#define AC_DEF_I8_QK256S(KU, NAME)                                                         \
static AC_TGT_AVX2 AC_NOINLINE void NAME(const uint32_t *QT4, int Dq, const int8_t *kr,   \
                                         ptrdiff_t k_rs, const float *kp, float *ST,       \
                                         __m256 *mx0, __m256 *mx1)                         \
{                                                                                          \
    __m256i a0[KU], a1[KU];                                                                \
    const __m256i ones = _mm256_set1_epi16(1);                                             \
    _Pragma("GCC unroll 8")                                                                \
    for (int u = 0; u < KU; u++) {                                                         \
        a0[u] = _mm256_setzero_si256();                                                    \
        a1[u] = a0[u];                                                                     \
    }                                                                                      \
    for (int t = 0; t < Dq; t++) {                                                         \
        const __m256i q0 = _mm256_loadu_si256((const __m256i *)(QT4 + (ptrdiff_t)t * 16));  \
        const __m256i q1 = _mm256_loadu_si256((const __m256i *)(QT4 + (ptrdiff_t)t * 16 + 8)); \
        const __m256i u0 = _mm256_abs_epi8(q0), u1 = _mm256_abs_epi8(q1);                  \
        _Pragma("GCC unroll 8")                                                            \
        for (int u = 0; u < KU; u++) {                                                     \
            int32_t w;                                                                     \
            memcpy(&w, kr + (ptrdiff_t)u * k_rs + 4 * t, 4);                               \
            const __m256i b = _mm256_set1_epi32(w);                                        \
            a0[u] = _mm256_add_epi32(a0[u], _mm256_madd_epi16(                             \
                _mm256_maddubs_epi16(u0, _mm256_sign_epi8(b, q0)), ones));                \
            a1[u] = _mm256_add_epi32(a1[u], _mm256_madd_epi16(                             \
                _mm256_maddubs_epi16(u1, _mm256_sign_epi8(b, q1)), ones));                \
        }                                                                                  \
    }                                                                                      \
    AC_I8_FINISH256(KU)                                                                    \
}

AC_DEF_I8_QK256S(AC_I8_KU_MADDUBS, ac_i8_qk_mb)
AC_DEF_I8_QK256S(1, ac_i8_qk1_mb)
AC_DEF_I8_QK256(AC_I8_KU_VNNI256, ac_i8_qk_avxvnni, AC_TGT_AVXVNNI, ac_dp256_u8s8)
AC_DEF_I8_QK256(1, ac_i8_qk1_avxvnni, AC_TGT_AVXVNNI, ac_dp256_u8s8)
AC_DEF_I8_QK256(AC_I8_KU_VNNI256, ac_i8_qk_avxvnni_emu, AC_TGT_AVX2, ac_dp256_u8s8_emu)
AC_DEF_I8_QK256(1, ac_i8_qk1_avxvnni_emu, AC_TGT_AVX2, ac_dp256_u8s8_emu)

typedef void (*ac_i8_qk256_fn)(const uint32_t *, int, const int8_t *, ptrdiff_t, const float *,
                               float *, __m256 *, __m256 *);

/* scores of nk keys from kr (ld k_rs bytes), kp (ld 2 floats) for the
   16-row panel QT4: mode AC_QK8_MADDUBS / AVXVNNI / AVXVNNI_EMU */
static void ac_i8_scores16(int mode, const uint32_t *QT4, int Dq, const int8_t *kr,
                           ptrdiff_t k_rs, const float *kp, int nk, float *ST, __m256 *t0,
                           __m256 *t1)
{
    ac_i8_qk256_fn fm, f1;
    int ku;
    if (mode == AC_QK8_MADDUBS) {
        fm = ac_i8_qk_mb;
        f1 = ac_i8_qk1_mb;
        ku = AC_I8_KU_MADDUBS;
    } else if (mode == AC_QK8_AVXVNNI) {
        fm = ac_i8_qk_avxvnni;
        f1 = ac_i8_qk1_avxvnni;
        ku = AC_I8_KU_VNNI256;
    } else {
        fm = ac_i8_qk_avxvnni_emu;
        f1 = ac_i8_qk1_avxvnni_emu;
        ku = AC_I8_KU_VNNI256;
    }
    int j = 0;
    for (; j + ku <= nk; j += ku)
        fm(QT4, Dq, kr + j * k_rs, k_rs, kp + 2 * j, ST + (ptrdiff_t)j * 16, t0, t1);
    for (; j < nk; j++)
        f1(QT4, Dq, kr + j * k_rs, k_rs, kp + 2 * j, ST + (ptrdiff_t)j * 16, t0, t1);
}

/* S[r, j] = scale * sq[r] * ks[j] * (q8_r . k8_j) for a few query rows on
 * the AVX2 path (decoding), keys read in place, 8 keys at a time, 32 bytes
 * per load (the last chunk of a row through a 4-byte lane mask: rows are
 * zero padded to a multiple of 4 bytes), the 8 sums reduced together.
 * Code 4 takes the sign trick the other way round: |k| is the unsigned
 * operand and k's sign moves onto q (queries come from the quantizer,
 * +-127: every int8 key, -128 included, is exact); codes 5 / 6 the keys
 * offset by 128 as the unsigned operand, 128 sum_d q8_r[d] subtracted. */
static AC_TGT_AVX2 inline __m256i ac_dp256_mb_k(__m256i acc, __m256i kv, __m256i qv)
{
    return _mm256_add_epi32(acc, _mm256_madd_epi16(
        _mm256_maddubs_epi16(_mm256_abs_epi8(kv), _mm256_sign_epi8(qv, kv)),
        _mm256_set1_epi16(1)));
}

static AC_TGT_AVXVNNI inline __m256i ac_dp256_off_k(__m256i acc, __m256i kv, __m256i qv)
{
    return ac_dp256_u8s8(acc, _mm256_xor_si256(kv, _mm256_set1_epi8((char)0x80)), qv);
}

static AC_TGT_AVX2 inline __m256i ac_dp256_off_k_emu(__m256i acc, __m256i kv, __m256i qv)
{
    return ac_dp256_u8s8_emu(acc, _mm256_xor_si256(kv, _mm256_set1_epi8((char)0x80)), qv);
}

#define AC_DEF_I8_SMALL256(NAME, TGT, DP, OFFSET)                                          \
static TGT void NAME(int nq, int nk, int D, float scale, const int8_t *q, ptrdiff_t q_rs,  \
                     const float *sq, const int8_t *k, ptrdiff_t k_rs, const float *ks,   \
                     ptrdiff_t ks_rs, float *S, int ldS)                                  \
{                                                                                          \
    const int Dw = (D + 3) / 4, nf = Dw / 8, rest = Dw % 8;                                \
    const __m256i tail = _mm256_cmpgt_epi32(_mm256_set1_epi32(rest),                       \
                                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));    \
    for (int r = 0; r < nq; r++) {                                                         \
        const int8_t *qr = q + r * q_rs;                                                   \
        int qsum = 0;                                                                      \
        if (OFFSET)                                                                        \
            for (int d = 0; d < 4 * Dw; d++) qsum += qr[d];                                \
        const __m256i comp = _mm256_set1_epi32(128 * qsum);                                \
        const float rs = scale * sq[r];                                                    \
        float *Sr = S + (ptrdiff_t)r * ldS;                                                \
        for (int j = 0; j < nk; j += 8) {                                                  \
            const int nu = nk - j < 8 ? nk - j : 8;                                        \
            const int8_t *kb = k + (ptrdiff_t)j * k_rs;                                    \
            if (j + 24 <= nk) /* the block after next, a line at a time */                \
                for (int u = 0; u < 8; u++)                                                \
                    for (int o = 0; o < 4 * Dw; o += 64)                                   \
                        _mm_prefetch((const char *)(kb + (ptrdiff_t)(u + 16) * k_rs + o),  \
                                     _MM_HINT_T0);                                         \
            __m256i a[8];                                                                  \
            for (int u = 0; u < 8; u++) a[u] = _mm256_setzero_si256();                     \
            for (int c = 0; c < nf; c++) {                                                 \
                const __m256i qv = _mm256_loadu_si256((const __m256i *)(qr + 32 * c));     \
                for (int u = 0; u < nu; u++)                                               \
                    a[u] = DP(a[u], _mm256_loadu_si256(                                    \
                               (const __m256i *)(kb + (ptrdiff_t)u * k_rs + 32 * c)), qv); \
            }                                                                              \
            if (rest) {                                                                    \
                const __m256i qv = _mm256_maskload_epi32((const int *)(qr + 32 * nf), tail); \
                for (int u = 0; u < nu; u++)                                               \
                    a[u] = DP(a[u], _mm256_maskload_epi32(                                 \
                               (const int *)(kb + (ptrdiff_t)u * k_rs + 32 * nf), tail), qv); \
            }                                                                              \
            float sc[8];                                                                   \
            for (int u = 0; u < 8; u++) sc[u] = u < nu ? ks[(ptrdiff_t)(j + u) * ks_rs] : 0.0f; \
            __m256i t = _mm256_castps_si256(ac_hsum8_avx2((const __m256 *)a, 1));          \
            if (OFFSET) t = _mm256_sub_epi32(t, comp);                                     \
            const __m256 x = _mm256_mul_ps(_mm256_cvtepi32_ps(t),                          \
                                           _mm256_mul_ps(_mm256_loadu_ps(sc),              \
                                                         _mm256_set1_ps(rs)));             \
            if (nu == 8) {                                                                 \
                _mm256_storeu_ps(Sr + j, x);                                               \
            } else {                                                                       \
                float xb[8];                                                               \
                _mm256_storeu_ps(xb, x);                                                   \
                for (int u = 0; u < nu; u++) Sr[j + u] = xb[u];                            \
            }                                                                              \
        }                                                                                  \
    }                                                                                      \
}

AC_DEF_I8_SMALL256(ac_i8_scores_small_mb, AC_TGT_AVX2, ac_dp256_mb_k, 0)
AC_DEF_I8_SMALL256(ac_i8_scores_small_avxvnni, AC_TGT_AVXVNNI, ac_dp256_off_k, 1)
AC_DEF_I8_SMALL256(ac_i8_scores_small_avxvnni_emu, AC_TGT_AVX2, ac_dp256_off_k_emu, 1)

/* the int8 scores of a few rows on the AVX2 path, code `mode` (4 - 6) */
static void ac_i8_scores_small16(int mode, int nq, int nk, int D, float scale,
                                 const int8_t *q, ptrdiff_t q_rs, const float *sq,
                                 const int8_t *k, ptrdiff_t k_rs, const float *ks,
                                 ptrdiff_t ks_rs, float *S, int ldS)
{
    (mode == AC_QK8_MADDUBS   ? ac_i8_scores_small_mb
     : mode == AC_QK8_AVXVNNI ? ac_i8_scores_small_avxvnni
                              : ac_i8_scores_small_avxvnni_emu)(nq, nk, D, scale, q, q_rs, sq,
                                                                k, k_rs, ks, ks_rs, S, ldS);
}
#endif /* AC_HAVE_X86 */

/*
 * int16 P.V on the AVX2 panel (under int8 Q.K^T; ac_params.bf16dot 3:
 * AVX-VNNI vpdpwssd, 4: the same sums in AVX2, vpmaddwd + vpaddd) and on
 * the 32-row AVX-512 panel (3: AVX512_VNNI vpdpwssd on zmm, 4: the same
 * sums in AVX-512BW; ac_pv16_pack_probs32, ac_pv16_rows32).
 *
 * A key chunk's value rows become integers q_jd = round(v_jd AC_PV16_V /
 * (c_d s_j)): c_d the largest |v| of column d in the chunk, s_j the
 * largest |v_jd| / c_d of row j (at most 1).  Per column first, so that a
 * channel much larger than the others does not set their steps (with a
 * row scale alone, a channel 1000x the others left them a few steps: 1 -
 * cos 4e-2 on theirs); then per key, so that a value never coarsens
 * another key's (a masked key's outlier sets a column's c_d, and every
 * other key's s_j then takes its own values back to full range).  A tile's
 * probabilities take the key's scale, p'_j = p_j s_j, and become, per
 * query row, round(p'_j AC_PV16_P / M_r) with M_r the row's largest p' in
 * the tile (14 bits relative to the tile: a dominant key -- an attention
 * sink -- costs the precision of its own tile only).  Both are paired
 * along the keys, (key 2t, key 2t+1) in the 16-bit halves of a 32-bit
 * word, so one vpdpwssd adds two keys' products per int32 lane, exactly:
 * a tile's sums stay below (AC_BK + 1) AC_PV16_P AC_PV16_V < 2^31.  They
 * are scaled back per row and column, c_d M_r / (AC_PV16_P AC_PV16_V), and
 * added to the float32 accumulator (rescaled by the online softmax as
 * usual).
 */
#define AC_PV16_P 16383.0f
#define AC_PV16_V 1015.0f
/* words per key pair of a chunk's paired values: Dv rounded up to 16 (the
   columns beyond Dv are zero) */
#define AC_PV16_LD(Dv) (((ptrdiff_t)(Dv) + 15) / 16 * 16)
/* the panel rows a tile's probability pairs are laid out for: the widest
   panel's (32, AVX-512; the 16-row AVX2 panel uses the first half) */
#define AC_PV16_ROWS 32
/* 32-bit words of the packed chunk: the value pairs (AC_BK / 2 + 1 pairs),
   the columns' factors while the pairs are made (AC_PV16_LD(Dv) floats), a
   tile's probability pairs (AC_BK / 2 + 2 pairs x AC_PV16_ROWS rows,
   from pt2), the keys' scales (AC_BK + 2 floats, AC_PV16_VCS), the rows'
   (AC_PV16_ROWS floats, AC_PV16_RSC) and the columns' (AC_PV16_LD(Dv)
   floats, AC_PV16_CSC) */
#define AC_PV16_CHUNK(Dv)                                                            \
    ((AC_BK / 2 + 3) * AC_PV16_LD(Dv) + (ptrdiff_t)(AC_BK / 2 + 2) * AC_PV16_ROWS + \
     (AC_BK + 2) + AC_PV16_ROWS)
#define AC_PV16_VCS(pt2) ((float *)(void *)((pt2) + (ptrdiff_t)(AC_BK / 2 + 2) * AC_PV16_ROWS))
#define AC_PV16_RSC(pt2) (AC_PV16_VCS(pt2) + AC_BK + 2)
#define AC_PV16_CSC(pt2) (AC_PV16_RSC(pt2) + AC_PV16_ROWS)
/* scales below this (a key's largest |v|, a row's largest p') take
   float32 P.V: their reciprocals would leave the float range */
#define AC_PV16_TINY 1e-30f
/* a chunk of nk keys takes float32 P.V where a column's largest |v| is
   above this many times the column's mean |v| (N(0, 1) values: about 4 at
   128 keys; one outlier among n keys: about n) */
#define AC_PV16_OUTLIER(nk) ((nk) >= 128 ? 32.0f : (nk) >= 6 ? (float)(nk) / 4.0f : 1.5f)

#if AC_HAVE_X86
/* VI[t][d] = (q[2t][d], q[2t + 1][d]) (16-bit halves; a missing last key
 * 0), q[j][d] = round(u[j][d] AC_PV16_V / s_j) with u[j][d] = v[j][d] /
 * c_d, cs[d] = c_d = max_j |v[j][d]| (at least AC_PV16_TINY where not 0)
 * and sv[j] = s_j = max_d |u[j][d]|, for the nk <= AC_BK rows of v (row
 * stride rs) and columns d < Dv (VI and cs 0 up to AC_PV16_LD(Dv); g:
 * scratch of as many floats, the 1 / c_d).  Returns 0 (nothing usable)
 * if a value is not finite, a column has an outlier (AC_PV16_OUTLIER) or
 * a row's s_j is below AC_PV16_TINY but not 0. */
static AC_TGT_AVX2 int ac_pv16_pack_values(const float *v, ptrdiff_t rs, int nk, int Dv,
                                           uint32_t *VI, float *sv, float *cs, float *g)
{
    const ptrdiff_t ld = AC_PV16_LD(Dv);
    const __m256 sign = _mm256_set1_ps(-0.0f), zero = _mm256_setzero_ps();
    const __m256i io = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    /* the columns' largest |v| (columns beyond Dv: 0) and their sums of
       |v| (in g), and whether every value is finite */
    for (int d = 0; d < ld; d += 8) {
        _mm256_storeu_ps(cs + d, zero);
        _mm256_storeu_ps(g + d, zero);
    }
    __m256 bad = zero;
    for (int j = 0; j < nk; j++) {
        const float *vj = v + (ptrdiff_t)j * rs;
        for (int d = 0; d < Dv; d += 8) {
            const __m256i lm = _mm256_cmpgt_epi32(_mm256_set1_epi32(Dv - d), io);
            const __m256 x = _mm256_maskload_ps(vj + d, lm);
            const __m256 ax = _mm256_andnot_ps(sign, x);
            bad = _mm256_or_ps(bad, _mm256_cmp_ps(_mm256_sub_ps(x, x), zero, _CMP_NEQ_UQ));
            _mm256_storeu_ps(cs + d, _mm256_max_ps(_mm256_loadu_ps(cs + d), ax));
            _mm256_storeu_ps(g + d, _mm256_add_ps(_mm256_loadu_ps(g + d), ax));
        }
    }
    if (_mm256_movemask_ps(bad)) return 0;
    /* a column whose largest |v| stands out of the rest (above
       AC_PV16_OUTLIER(nk) times its mean |v|: a few keys' outliers) would
       set the steps of every other key in it -- a key no row sees as well
       (masked, beyond a causal row, out of a window), whose own
       probabilities are 0: float32 P.V for the chunk */
    {
        const float t = AC_PV16_OUTLIER(nk) / (float)(nk > 0 ? nk : 1);
        __m256 out = zero;
        for (int d = 0; d < ld; d += 8)
            out = _mm256_or_ps(out, _mm256_cmp_ps(_mm256_loadu_ps(cs + d),
                                                  _mm256_mul_ps(_mm256_loadu_ps(g + d),
                                                                _mm256_set1_ps(t)),
                                                  _CMP_GT_OQ));
        if (_mm256_movemask_ps(out)) return 0;
    }
    const __m256 tiny = _mm256_set1_ps(AC_PV16_TINY);
    for (int d = 0; d < ld; d += 8) {
        __m256 c = _mm256_loadu_ps(cs + d);
        const __m256 pos = _mm256_cmp_ps(c, zero, _CMP_GT_OQ);
        c = _mm256_blendv_ps(c, _mm256_max_ps(c, tiny), pos);
        _mm256_storeu_ps(cs + d, c);
        _mm256_storeu_ps(g + d, _mm256_and_ps(_mm256_div_ps(_mm256_set1_ps(1.0f), c), pos));
    }
    /* the rows' largest |u| */
    for (int j = 0; j < nk; j++) {
        const float *vj = v + (ptrdiff_t)j * rs;
        __m256 c = zero;
        for (int d = 0; d < Dv; d += 8) {
            const __m256i lm = _mm256_cmpgt_epi32(_mm256_set1_epi32(Dv - d), io);
            c = _mm256_max_ps(c, _mm256_andnot_ps(
                                     sign, _mm256_mul_ps(_mm256_maskload_ps(vj + d, lm),
                                                         _mm256_loadu_ps(g + d))));
        }
        float cm[8];
        _mm256_storeu_ps(cm, c);
        float m = 0.0f;
        for (int i = 0; i < 8; i++) m = cm[i] > m ? cm[i] : m;
        sv[j] = m;
        if (m > 0.0f && m < AC_PV16_TINY) return 0;
    }
    for (int t = 0; 2 * t < nk; t++) {
        const float *a = v + (ptrdiff_t)(2 * t) * rs;
        const int two = 2 * t + 1 < nk;
        const __m256 fa = _mm256_set1_ps(sv[2 * t] > 0.0f ? AC_PV16_V / sv[2 * t] : 0.0f);
        const __m256 fb = _mm256_set1_ps(two && sv[2 * t + 1] > 0.0f ? AC_PV16_V / sv[2 * t + 1]
                                                                       : 0.0f);
        for (int d = 0; d < ld; d += 8) {
            const int n = Dv - d;
            const __m256i lm = _mm256_cmpgt_epi32(_mm256_set1_epi32(n > 0 ? n : 0), io);
            const __m256 gd = _mm256_loadu_ps(g + d);
            const __m256i qa = _mm256_cvtps_epi32(
                _mm256_mul_ps(_mm256_mul_ps(_mm256_maskload_ps(a + d, lm), gd), fa));
            __m256i qb = _mm256_setzero_si256();
            if (two)
                qb = _mm256_cvtps_epi32(
                    _mm256_mul_ps(_mm256_mul_ps(_mm256_maskload_ps(a + rs + d, lm), gd), fb));
            _mm256_storeu_si256((__m256i *)(void *)(VI + (ptrdiff_t)t * ld + d),
                                _mm256_blend_epi16(qa, _mm256_slli_epi32(qb, 16), 0xAA));
        }
    }
    return 1;
}

/* PT[t][r] = (round(p'[first + 2t][r] AC_PV16_P / M_r), the same for key
 * first + 2t + 1) for the 16 rows of the probability tile ST (ld 16),
 * p'[j][r] = P[j][r] sv[j], M_r = max_j p'[j][r] over j < nk (keys
 * outside [0, nk) 0), t < npairs; rsc[r] = M_r / (AC_PV16_P AC_PV16_V).
 * Returns 0 (nothing packed: float32 P.V) if some M_r is below
 * AC_PV16_TINY but not 0. */
static AC_TGT_AVX2 int ac_pv16_pack_probs(const float *ST, int first, int nk, const float *sv,
                                          uint32_t *PT, int npairs, float *rsc)
{
    __m256 m0 = _mm256_setzero_ps(), m1 = _mm256_setzero_ps();
    for (int j = 0; j < nk; j++) {
        const __m256 s = _mm256_set1_ps(sv[j]);
        m0 = _mm256_max_ps(m0, _mm256_mul_ps(_mm256_loadu_ps(ST + (ptrdiff_t)j * 16), s));
        m1 = _mm256_max_ps(m1, _mm256_mul_ps(_mm256_loadu_ps(ST + (ptrdiff_t)j * 16 + 8), s));
    }
    const __m256 tiny = _mm256_set1_ps(AC_PV16_TINY), zero = _mm256_setzero_ps();
    const __m256 small = _mm256_or_ps(
        _mm256_and_ps(_mm256_cmp_ps(m0, tiny, _CMP_LT_OQ), _mm256_cmp_ps(m0, zero, _CMP_GT_OQ)),
        _mm256_and_ps(_mm256_cmp_ps(m1, tiny, _CMP_LT_OQ), _mm256_cmp_ps(m1, zero, _CMP_GT_OQ)));
    if (_mm256_movemask_ps(small)) return 0;
    const __m256 P = _mm256_set1_ps(AC_PV16_P);
    /* AC_PV16_P / M_r, 0 for a row with nothing in the tile */
    const __m256 r0 = _mm256_and_ps(_mm256_div_ps(P, m0), _mm256_cmp_ps(m0, zero, _CMP_GT_OQ));
    const __m256 r1 = _mm256_and_ps(_mm256_div_ps(P, m1), _mm256_cmp_ps(m1, zero, _CMP_GT_OQ));
    const __m256 back = _mm256_set1_ps(1.0f / (AC_PV16_P * AC_PV16_V));
    _mm256_storeu_ps(rsc, _mm256_mul_ps(m0, back));
    _mm256_storeu_ps(rsc + 8, _mm256_mul_ps(m1, back));
    for (int t = 0; t < npairs; t++) {
        const int ja = first + 2 * t, jb = ja + 1;
        __m256i a0 = _mm256_setzero_si256(), a1 = a0, b0 = a0, b1 = a0;
        if (ja >= 0 && ja < nk) {
            const __m256 s = _mm256_set1_ps(sv[ja]);
            const float *sr = ST + (ptrdiff_t)ja * 16;
            a0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(sr), s), r0));
            a1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(sr + 8), s), r1));
        }
        if (jb >= 0 && jb < nk) {
            const __m256 s = _mm256_set1_ps(sv[jb]);
            const float *sr = ST + (ptrdiff_t)jb * 16;
            b0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(sr), s), r0));
            b1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(sr + 8), s), r1));
        }
        _mm256_storeu_si256((__m256i *)(void *)(PT + (ptrdiff_t)t * 16),
                            _mm256_or_si256(a0, _mm256_slli_epi32(b0, 16)));
        _mm256_storeu_si256((__m256i *)(void *)(PT + (ptrdiff_t)t * 16 + 8),
                            _mm256_or_si256(a1, _mm256_slli_epi32(b1, 16)));
    }
    return 1;
}

static AC_TGT_AVXVNNI inline __m256i ac_pv16_dp(__m256i acc, __m256i a, __m256i b)
{
    /* {vex} and asm as ac_dp256_u8s8 */
    __asm__("%{vex%} vpdpwssd %2, %1, %0" : "+x"(acc) : "x"(a), "x"(b));
    return acc;
}

static AC_TGT_AVX2 inline __m256i ac_pv16_dp_emu(__m256i acc, __m256i a, __m256i b)
{
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
}

/* O[u][0 .. n) = alpha[u] O[u] + rsc[u] cs[..] sum_t PT[t][u] . VI[t][0 ..
 * 16) for RU rows (O ld ldo, PT ld 16, VI ld ld words, cs: the columns'
 * scales, 16 read), n <= 16 columns */
#define AC_DEF_PV16(RU, NAME, TGT, DP)                                                     \
static TGT AC_NOINLINE void NAME(const uint32_t *PT, int np, const uint32_t *vi,           \
                                 ptrdiff_t ld, float *O, ptrdiff_t ldo,                    \
                                 const float *alpha, const float *rsc, const float *cs,    \
                                 int n)                                                    \
{                                                                                          \
    __m256i a[RU][2];                                                                      \
    _Pragma("GCC unroll 8")                                                                \
    for (int u = 0; u < RU; u++) a[u][0] = a[u][1] = _mm256_setzero_si256();               \
    for (int t = 0; t < np; t++) {                                                         \
        const uint32_t *vt = vi + (ptrdiff_t)t * ld;                                       \
        const __m256i x0 = _mm256_loadu_si256((const __m256i *)(const void *)vt);          \
        const __m256i x1 = _mm256_loadu_si256((const __m256i *)(const void *)(vt + 8));    \
        const uint32_t *pt = PT + (ptrdiff_t)t * 16;                                       \
        _Pragma("GCC unroll 8")                                                            \
        for (int u = 0; u < RU; u++) {                                                     \
            const __m256i b = _mm256_set1_epi32((int)pt[u]);                               \
            a[u][0] = DP(a[u][0], b, x0);                                                  \
            a[u][1] = DP(a[u][1], b, x1);                                                  \
        }                                                                                  \
    }                                                                                      \
    const __m256i io = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);                          \
    const __m256i m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(n), io);                       \
    const __m256i m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(n - 8), io);                   \
    const __m256 c0 = _mm256_loadu_ps(cs), c1 = _mm256_loadu_ps(cs + 8);                   \
    _Pragma("GCC unroll 8")                                                                \
    for (int u = 0; u < RU; u++) {                                                         \
        float *o = O + (ptrdiff_t)u * ldo;                                                 \
        const __m256 al = _mm256_set1_ps(alpha[u]), s = _mm256_set1_ps(rsc[u]);            \
        const __m256 f0 = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(a[u][0]), s), c0); \
        const __m256 f1 = _mm256_mul_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(a[u][1]), s), c1); \
        if (n == 16) {                                                                     \
            _mm256_storeu_ps(o, _mm256_fmadd_ps(al, _mm256_loadu_ps(o), f0));              \
            _mm256_storeu_ps(o + 8, _mm256_fmadd_ps(al, _mm256_loadu_ps(o + 8), f1));      \
        } else {                                                                           \
            _mm256_maskstore_ps(o, m0, _mm256_fmadd_ps(al, _mm256_maskload_ps(o, m0), f0)); \
            _mm256_maskstore_ps(o + 8, m1,                                                 \
                                _mm256_fmadd_ps(al, _mm256_maskload_ps(o + 8, m1), f1));   \
        }                                                                                  \
    }                                                                                      \
}

AC_DEF_PV16(6, ac_pv16_r6, AC_TGT_AVXVNNI, ac_pv16_dp)
AC_DEF_PV16(5, ac_pv16_r5, AC_TGT_AVXVNNI, ac_pv16_dp)
AC_DEF_PV16(4, ac_pv16_r4, AC_TGT_AVXVNNI, ac_pv16_dp)
AC_DEF_PV16(2, ac_pv16_r2, AC_TGT_AVXVNNI, ac_pv16_dp)
AC_DEF_PV16(1, ac_pv16_r1, AC_TGT_AVXVNNI, ac_pv16_dp)
AC_DEF_PV16(6, ac_pv16_r6_emu, AC_TGT_AVX2, ac_pv16_dp_emu)
AC_DEF_PV16(5, ac_pv16_r5_emu, AC_TGT_AVX2, ac_pv16_dp_emu)
AC_DEF_PV16(4, ac_pv16_r4_emu, AC_TGT_AVX2, ac_pv16_dp_emu)
AC_DEF_PV16(2, ac_pv16_r2_emu, AC_TGT_AVX2, ac_pv16_dp_emu)
AC_DEF_PV16(1, ac_pv16_r1_emu, AC_TGT_AVX2, ac_pv16_dp_emu)

typedef void (*ac_pv16_fn)(const uint32_t *, int, const uint32_t *, ptrdiff_t, float *,
                           ptrdiff_t, const float *, const float *, const float *, int);

/* acc rows [0, nr) (nr <= 16, ld Dv) = alpha acc + P.V over np key pairs
 * (PT: the tile's probability pairs, rsc their rows' scales, VI the
 * values' pairs, cs their columns' scales), mode 3 vpdpwssd, 4 its AVX2
 * spelling: micro-tiles of 6 rows (16 = 6 + 5 + 5), 16 columns */
static void ac_pv16_rows(int mode, const uint32_t *PT, int np, const uint32_t *vi, int Dv,
                         float *acc, const float *alpha, const float *rsc, const float *cs,
                         int nr)
{
    static const ac_pv16_fn fn[2][7] = {
        {NULL, ac_pv16_r1, ac_pv16_r2, NULL, ac_pv16_r4, ac_pv16_r5, ac_pv16_r6},
        {NULL, ac_pv16_r1_emu, ac_pv16_r2_emu, NULL, ac_pv16_r4_emu, ac_pv16_r5_emu,
         ac_pv16_r6_emu}};
    const ac_pv16_fn *f = fn[mode == 3 ? 0 : 1];
    const ptrdiff_t ld = AC_PV16_LD(Dv);
    /* the micro-tile rows for the rows left (16 = 6 + 5 + 5, 8 = 4 + 4) */
    static const int8_t ru_of[17] = {0, 1, 2, 2, 4, 5, 6, 5, 4, 5, 5, 6, 6, 6, 6, 6, 6};
    for (int r = 0; r < nr;) {
        const int ru = ru_of[nr - r > 16 ? 16 : nr - r];
        for (int c0 = 0; c0 < Dv; c0 += 16)
            f[ru](PT + r, np, vi + c0, ld, acc + (ptrdiff_t)r * Dv + c0, Dv, alpha + r, rsc + r,
                  cs + c0, Dv - c0 < 16 ? Dv - c0 : 16);
        r += ru;
    }
}

/* ac_pv16_pack_probs for the 32 rows of an AVX-512 panel's probability
 * tile (ST ld 32, PT ld 32, rsc 32 floats): the same integers, rounded the
 * same way (a row's integers do not depend on the panel it is in) */
static AC_TGT_AVX512BW int ac_pv16_pack_probs32(const float *ST, int first, int nk,
                                                const float *sv, uint32_t *PT, int npairs,
                                                float *rsc)
{
    __m512 m0 = _mm512_setzero_ps(), m1 = _mm512_setzero_ps();
    for (int j = 0; j < nk; j++) {
        const __m512 s = _mm512_set1_ps(sv[j]);
        m0 = _mm512_max_ps(m0, _mm512_mul_ps(_mm512_loadu_ps(ST + (ptrdiff_t)j * 32), s));
        m1 = _mm512_max_ps(m1, _mm512_mul_ps(_mm512_loadu_ps(ST + (ptrdiff_t)j * 32 + 16), s));
    }
    const __m512 tiny = _mm512_set1_ps(AC_PV16_TINY), zero = _mm512_setzero_ps();
    const __mmask16 p0 = _mm512_cmp_ps_mask(m0, zero, _CMP_GT_OQ);
    const __mmask16 p1 = _mm512_cmp_ps_mask(m1, zero, _CMP_GT_OQ);
    if (_mm512_mask_cmp_ps_mask(p0, m0, tiny, _CMP_LT_OQ) |
        _mm512_mask_cmp_ps_mask(p1, m1, tiny, _CMP_LT_OQ))
        return 0;
    const __m512 P = _mm512_set1_ps(AC_PV16_P);
    /* AC_PV16_P / M_r, 0 for a row with nothing in the tile */
    const __m512 r0 = _mm512_maskz_div_ps(p0, P, m0);
    const __m512 r1 = _mm512_maskz_div_ps(p1, P, m1);
    const __m512 back = _mm512_set1_ps(1.0f / (AC_PV16_P * AC_PV16_V));
    _mm512_storeu_ps(rsc, _mm512_mul_ps(m0, back));
    _mm512_storeu_ps(rsc + 16, _mm512_mul_ps(m1, back));
    for (int t = 0; t < npairs; t++) {
        const int ja = first + 2 * t, jb = ja + 1;
        __m512i a0 = _mm512_setzero_si512(), a1 = a0, b0 = a0, b1 = a0;
        if (ja >= 0 && ja < nk) {
            const __m512 s = _mm512_set1_ps(sv[ja]);
            const float *sr = ST + (ptrdiff_t)ja * 32;
            a0 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(sr), s), r0));
            a1 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(sr + 16), s), r1));
        }
        if (jb >= 0 && jb < nk) {
            const __m512 s = _mm512_set1_ps(sv[jb]);
            const float *sr = ST + (ptrdiff_t)jb * 32;
            b0 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(sr), s), r0));
            b1 = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(sr + 16), s), r1));
        }
        _mm512_storeu_si512((void *)(PT + (ptrdiff_t)t * 32),
                            _mm512_or_si512(a0, _mm512_slli_epi32(b0, 16)));
        _mm512_storeu_si512((void *)(PT + (ptrdiff_t)t * 32 + 16),
                            _mm512_or_si512(a1, _mm512_slli_epi32(b1, 16)));
    }
    return 1;
}

static AC_TGT_AVX512_VNNI inline __m512i ac_pv16_dpz(__m512i acc, __m512i a, __m512i b)
{
    /* asm as ac_dp_u8s8 (the intrinsic: every accumulator copied around
       each instruction by GCC 12; 1 x 8 x 1024^2 x 64 int8, one thread,
       Xeon: 10.75 -> 9.48 ms) */
    __asm__("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
    return acc;
}

static AC_TGT_AVX512BW inline __m512i ac_pv16_dpz_emu(__m512i acc, __m512i a, __m512i b)
{
    return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
}

/* O[u][0 .. 16 CV) = alpha[u] O[u] + rsc[u] cs[..] sum_t PT[t][u] . VI[t][..] for
 * RU rows (O ld ldo, PT ld 32, VI ld ld words: zero beyond the value
 * columns, so read whole) and CV vectors of 16 columns, the last one's
 * columns those of the mask last; RU CV int32 accumulators (RU and CV
 * constants: the accumulators stay in registers, no copies between them) */
#define AC_DEF_PV16Z(RU, CV, NAME, TGT, DP)                                                \
static TGT AC_NOINLINE void NAME(const uint32_t *PT, int np, const uint32_t *vi,           \
                                 ptrdiff_t ld, float *O, ptrdiff_t ldo,                    \
                                 const float *alpha, const float *rsc, const float *cs,    \
                                 __mmask16 last)                                           \
{                                                                                          \
    __m512i a[RU][CV];                                                                     \
    _Pragma("GCC unroll 8")                                                                \
    for (int u = 0; u < RU; u++)                                                           \
        _Pragma("GCC unroll 4")                                                            \
        for (int c = 0; c < CV; c++) a[u][c] = _mm512_setzero_si512();                     \
    for (int t = 0; t < np; t++) {                                                         \
        const uint32_t *vt = vi + (ptrdiff_t)t * ld;                                       \
        __m512i x[CV];                                                                     \
        _Pragma("GCC unroll 4")                                                            \
        for (int c = 0; c < CV; c++) x[c] = _mm512_loadu_si512((const void *)(vt + c * 16)); \
        _Pragma("GCC unroll 8")                                                            \
        for (int u = 0; u < RU; u++) {                                                     \
            const __m512i b = _mm512_set1_epi32((int)PT[(ptrdiff_t)t * 32 + u]);           \
            _Pragma("GCC unroll 4")                                                        \
            for (int c = 0; c < CV; c++) a[u][c] = DP(a[u][c], b, x[c]);                   \
        }                                                                                  \
    }                                                                                      \
    _Pragma("GCC unroll 8")                                                                \
    for (int u = 0; u < RU; u++) {                                                         \
        const __m512 al = _mm512_set1_ps(alpha[u]), s = _mm512_set1_ps(rsc[u]);            \
        _Pragma("GCC unroll 4")                                                            \
        for (int c = 0; c < CV; c++) {                                                     \
            const __mmask16 k = c == CV - 1 ? last : (__mmask16)0xFFFF;                    \
            float *o = O + (ptrdiff_t)u * ldo + c * 16;                                    \
            const __m512 f = _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(a[u][c]), s),  \
                                           _mm512_loadu_ps(cs + c * 16));                  \
            _mm512_mask_storeu_ps(o, k, _mm512_fmadd_ps(al, _mm512_maskz_loadu_ps(k, o), f)); \
        }                                                                                  \
    }                                                                                      \
}

/* the micro-tiles of both spellings: RU 1 - AC_PV16Z_RU rows x CV 1 - 4
   vectors */
#define AC_PV16Z_RU 4
#define AC_DEF_PV16Z_CV(RU, SUF, TGT, DP)                  \
    AC_DEF_PV16Z(RU, 1, ac_pv16z_##RU##x1##SUF, TGT, DP)   \
    AC_DEF_PV16Z(RU, 2, ac_pv16z_##RU##x2##SUF, TGT, DP)   \
    AC_DEF_PV16Z(RU, 3, ac_pv16z_##RU##x3##SUF, TGT, DP)   \
    AC_DEF_PV16Z(RU, 4, ac_pv16z_##RU##x4##SUF, TGT, DP)
#define AC_DEF_PV16Z_ALL(SUF, TGT, DP)  \
    AC_DEF_PV16Z_CV(1, SUF, TGT, DP)    \
    AC_DEF_PV16Z_CV(2, SUF, TGT, DP)    \
    AC_DEF_PV16Z_CV(3, SUF, TGT, DP)    \
    AC_DEF_PV16Z_CV(4, SUF, TGT, DP)
AC_DEF_PV16Z_ALL(, AC_TGT_AVX512_VNNI, ac_pv16_dpz)
AC_DEF_PV16Z_ALL(_emu, AC_TGT_AVX512BW, ac_pv16_dpz_emu)

typedef void (*ac_pv16z_fn)(const uint32_t *, int, const uint32_t *, ptrdiff_t, float *,
                            ptrdiff_t, const float *, const float *, const float *, __mmask16);
#define AC_PV16Z_ROW(RU, SUF) \
    {ac_pv16z_##RU##x1##SUF, ac_pv16z_##RU##x2##SUF, ac_pv16z_##RU##x3##SUF, ac_pv16z_##RU##x4##SUF}

/* ac_pv16_rows for the rows [0, nr) (nr <= 32) of an AVX-512 panel (PT ld
 * 32): micro-tiles of 4 rows x 64 columns; mode 3 vpdpwssd (AVX512_VNNI),
 * 4 its AVX-512BW spelling */
static void ac_pv16_rows32(int mode, const uint32_t *PT, int np, const uint32_t *vi, int Dv,
                           float *acc, const float *alpha, const float *rsc, const float *cs,
                           int nr)
{
    static const ac_pv16z_fn fn[2][AC_PV16Z_RU][4] = {
        {AC_PV16Z_ROW(1, ), AC_PV16Z_ROW(2, ), AC_PV16Z_ROW(3, ), AC_PV16Z_ROW(4, )},
        {AC_PV16Z_ROW(1, _emu), AC_PV16Z_ROW(2, _emu), AC_PV16Z_ROW(3, _emu),
         AC_PV16Z_ROW(4, _emu)}};
    const ac_pv16z_fn(*f)[4] = fn[mode == 3 ? 0 : 1];
    const ptrdiff_t ld = AC_PV16_LD(Dv);
    for (int r = 0; r < nr; r += AC_PV16Z_RU) {
        const int ru = nr - r < AC_PV16Z_RU ? nr - r : AC_PV16Z_RU;
        for (int c0 = 0; c0 < Dv; c0 += 64) {
            const int w = Dv - c0 < 64 ? Dv - c0 : 64;
            const int cv = (w + 15) / 16, tail = w - 16 * (cv - 1);
            const __mmask16 last = (__mmask16)(tail == 16 ? 0xFFFFu : ((1u << tail) - 1u));
            f[ru - 1][cv - 1](PT + r, np, vi + c0, ld, acc + (ptrdiff_t)r * Dv + c0, Dv,
                              alpha + r, rsc + r, cs + c0, last);
        }
    }
}
#endif /* AC_HAVE_X86 */

#if !AC_HAVE_X86
/* the dispatcher's test of the AVX2 panel's codes (ac_sdpa_variant.inc):
   never true without the x86 kernels (it was an undeclared function on
   aarch64) */
#define AC_QK8_AVX2(c) ((void)(c), 0)
#endif

#endif /* AC_INT8DOT_H */
