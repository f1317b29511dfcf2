/*
 * ac_math.h -- vectorizable exp for the attncore kernels.
 *
 * Branch-free, libm-free exp used inside `omp simd` loops.  The argument is
 * reduced with n = round(x / ln 2), r = x - n ln 2 (ln 2 split in a high and
 * a low part), exp(r) comes from the Cephes polynomial (float) or rational
 * (double) approximation, and 2^n is assembled directly in the exponent bits.
 *
 * Special values are handled by selects, never by -ffast-math:
 *   exp(-inf) = 0 exactly (so masked scores contribute exactly nothing),
 *   exp(x) = 0 for x below ln(smallest normal) (no denormal outputs),
 *   exp(NaN) = NaN (NaN survives the clamps because comparisons with NaN
 *   are false), exp(+inf) = +inf.
 *
 * Accuracy (checked by the test-suite against numpy over a sweep):
 * a few ulp in float, about 1 ulp in double.
 */
#ifndef AC_MATH_H
#define AC_MATH_H

#include <stdint.h>
#include <string.h>
#include <math.h>

#if defined(__GNUC__)
#define AC_INLINE static inline __attribute__((always_inline))
#else
#define AC_INLINE static inline
#endif

/* Horner's rule: from p, p x + c for each coefficient c in turn (highest
   degree first), in the type of p and x */
#define AC_HORNER1(p, x, a) ((p) * (x) + (a))
#define AC_HORNER2(p, x, a, b) AC_HORNER1(AC_HORNER1(p, x, a), x, b)
#define AC_HORNER4(p, x, a, b, c, d) AC_HORNER2(AC_HORNER2(p, x, a, b), x, c, d)

/* 2^n from t = n + magic (rounded to nearest by the addition, the low bits
   of t hold n): n + BIAS shifted into the exponent field */
#define AC_DEF_POW2N(NAME, FT, IT, UT, BIAS, MANT)   \
    AC_INLINE FT NAME(FT t)                          \
    {                                                \
        IT ti;                                       \
        memcpy(&ti, &t, sizeof ti);                  \
        const IT ei = (IT)((UT)(ti + BIAS) << MANT); \
        FT two_n;                                    \
        memcpy(&two_n, &ei, sizeof two_n);           \
        return two_n;                                \
    }
AC_DEF_POW2N(ac_pow2nf, float, int32_t, uint32_t, 127, 23)
AC_DEF_POW2N(ac_pow2n, double, int64_t, uint64_t, 1023, 52)

/* ------------------------------------------------------------------ float */
AC_INLINE float ac_expf(float x)
{
    const float hi = 88.3762626647949f;   /* ln(FLT_MAX) */
    const float lo = -87.3365447504019f;  /* ln(FLT_MIN) */
    const float magic = 12582912.0f;      /* 1.5 * 2^23: round-to-nearest */
    float xc = x > hi ? hi : x;
    xc = xc < lo ? lo : xc;
    float t = xc * 1.44269504088896341f + magic;
    float n = t - magic;
    float r = xc - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float r2 = r * r;
    float p = AC_HORNER1(AC_HORNER4(1.9875691500e-4f, r, 1.3981999507e-3f, 8.3334519073e-3f,
                                    4.1665795894e-2f, 1.6666665459e-1f),
                         r, 5.0000001201e-1f);
    p = p * r2 + r + 1.0f;
    float res = p * ac_pow2nf(t);
    res = x > hi ? (float)INFINITY : res;
    res = x < lo ? 0.0f : res;
    return res;
}

/* ----------------------------------------------------------------- double */
AC_INLINE double ac_exp(double x)
{
    const double hi = 709.782712893383973096;   /* ln(DBL_MAX) */
    const double lo = -708.396418532264106224;  /* ln(DBL_MIN) */
    const double magic = 6755399441055744.0;    /* 1.5 * 2^52 */
    double xc = x > hi ? hi : x;
    xc = xc < lo ? lo : xc;
    double t = xc * 1.4426950408889634073599 + magic;
    double n = t - magic;
    double r = xc - n * 6.93145751953125e-1;
    r = r - n * 1.42860682030941723212e-6;
    double rr = r * r;
    double px = r * ((1.26177193074810590878e-4 * rr
                      + 3.02994407707441961300e-2) * rr
                     + 9.99999999999999999910e-1);
    double qx = ((3.00198505138664455042e-6 * rr
                  + 2.52448340349684104192e-3) * rr
                 + 2.27265548208155028766e-1) * rr
                + 2.00000000000000000009e0;
    double e = 1.0 + 2.0 * (px / (qx - px));
    double res = e * ac_pow2n(t);
    res = x > hi ? (double)INFINITY : res;
    res = x < lo ? 0.0 : res;
    return res;
}

/* IEEE binary32 -> binary16, rounded to nearest (ties to even): NaN stays
 * a quiet NaN (payload's top bits kept), 65520 and beyond give infinity,
 * subnormals kept (rotary's float16 rows, ac_half.h's portable cast) */
AC_INLINE uint16_t ac_float_to_half(float f)
{
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u)                             /* NaN: quiet, keep payload bits */
        return (uint16_t)(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));
    if (ax >= 0x477ff000u)                            /* >= 65520: rounds to inf */
        return (uint16_t)(sign | 0x7c00u);
    if (ax < 0x38800000u) {                           /* below 2^-14: subnormal or zero */
        float af;
        memcpy(&af, &ax, sizeof af);
        /* m = round-to-even(|f| 2^24) <= 1024 (1024 is the smallest normal) */
        float t = af * 0x1p24f + 0x1p23f;     /* no -ffast-math: not reassociated */
        float mf = t - 0x1p23f;
        return (uint16_t)(sign | (uint16_t)mf);
    }
    uint32_t b = ax - (112u << 23);
    b = (b + 0xfffu + ((b >> 13) & 1u)) >> 13;
    return (uint16_t)(sign | b);
}

#endif /* AC_MATH_H */
