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
#include "ac_math.h"  /* ac_float_to_half */
#include "ac_small.h"  /* ac_half_rows_f32_avx512 / _avx2 */

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

/* float32 -> bfloat16 / float16, rounded to nearest (ties to even); NaN
 * stays a quiet NaN of the same sign, float16 overflow gives infinity and
 * its subnormals are kept (the roundings of NumPy's and ml_dtypes' casts;
 * NaN payloads may differ) */
static inline uint16_t ac_f32_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

#if AC_HAVE_X86
/* the same for 8 floats at a time (F16C; integers for bfloat16) */
static AC_TGT_AVX2 void ac_f32_half_avx2(int fmt, const float *x, uint16_t *y, ptrdiff_t n)
{
    ptrdiff_t i = 0;
    if (fmt == AC_H_F16) {
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128((__m128i *)(void *)(y + i),
                             _mm256_cvtps_ph(_mm256_loadu_ps(x + i),
                                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        for (; i < n; i++) y[i] = ac_float_to_half(x[i]);
        return;
    }
    const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7FFF);
    const __m256i absm = _mm256_set1_epi32(0x7FFFFFFF), inf = _mm256_set1_epi32(0x7F800000);
    const __m256i quiet = _mm256_set1_epi32(0x40);
    for (; i + 8 <= n; i += 8) {
        const __m256i u = _mm256_castps_si256(_mm256_loadu_ps(x + i));
        const __m256i hi = _mm256_srli_epi32(u, 16);
        const __m256i r = _mm256_srli_epi32(
            _mm256_add_epi32(_mm256_add_epi32(u, bias), _mm256_and_si256(hi, one)), 16);
        const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, absm), inf);
        const __m256i h = _mm256_blendv_epi8(r, _mm256_or_si256(hi, quiet), nan);
        const __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(h, h), 0xD8);
        _mm_storeu_si128((__m128i *)(void *)(y + i), _mm256_castsi256_si128(p));
    }
    for (; i < n; i++) y[i] = ac_f32_bf16(x[i]);
}
#endif

/* y[i] = x[i] rounded to bfloat16 / float16 (fmt) for i < n, on the kernel
 * path in use (the AVX2 loop on both x86 paths) */
static void ac_f32_half(int fmt, const float *x, uint16_t *y, ptrdiff_t n)
{
#if AC_HAVE_X86
    if (ac_kernel_path != AC_PATH_PORTABLE) {
        ac_f32_half_avx2(fmt, x, y, n);
        return;
    }
#endif
    if (fmt == AC_H_BF16)
        for (ptrdiff_t i = 0; i < n; i++) y[i] = ac_f32_bf16(x[i]);
    else
        for (ptrdiff_t i = 0; i < n; i++) y[i] = ac_float_to_half(x[i]);
}

#endif /* AC_HALF_H */
