/*
 * ac_rotary.h -- rotary position embeddings (RoPE) with fused cos / sin.
 *
 * One work item is a block of positions of one position row: its cos / sin
 * table (block x rotary_dim / 2) is computed once into per-thread scratch
 * and applied to every row of x that shares those positions (all heads),
 * so the table is never materialized for the whole input and nothing the
 * size of x is allocated besides the output.
 *
 * Angles: angle = position * inv_freq[j] in double (one rounding; exact
 * position for |position| < 2^53), then a branch-free double sin / cos:
 * reduction by n = round(angle * 2 / pi) with pi / 2 split in three 22-bit
 * parts and a 53-bit tail (each n * part exact for |n| < 2^31, with or
 * without FMA contraction), and Taylor polynomials on |r| <= pi / 4 (sin to
 * r^17, cos to r^18: truncation below 1e-17).  Angles beyond the reduction's
 * range (|angle| >= 3e9, only with inv_freq > 1) take libm's sin / cos.
 *
 * Layouts (h = rotary_dim / 2, c_j = cos, s_j = sin of position * inv_freq[j]):
 *   half        (GPT-NeoX / Llama):  pairs (j, j + h)
 *   interleaved (GPT-J / RoFormer):  pairs (2j, 2j + 1)
 *   out_a = x_a c_j - x_b s_j,   out_b = x_b c_j + x_a s_j.
 * Channels from rotary_dim on are copied (unless out is x).
 *
 * float32 and float16 rotate in float (float16 loaded to float and rounded
 * back to nearest even once), float64 in double.  out may be x itself
 * (same address and strides): every element is read before it is written
 * by the same iteration, and iterations touch disjoint elements, so the
 * `omp simd` loops are valid in place.
 */
#ifndef AC_ROTARY_H
#define AC_ROTARY_H

#include <math.h>
#include <stdint.h>
#include <stddef.h>
#include <string.h>

#include "ac_cpu.h"
#include "ac_math.h"

/* below this |angle|, n = round(angle * 2 / pi) < 2^31 and the reduction is exact */
#define AC_ROPE_FAST_LIMIT 3.0e9

/* ------------------------------------------------------------ sin / cos */
AC_INLINE void ac_rope_sincos(double a, double *sp, double *cp)
{
    const double magic = 6755399441055744.0;      /* 1.5 * 2^52: round to nearest */
    /* pi / 2 = P1 + P2 + P3 + P4 (22, 22, 22 and 53 significant bits) */
    const double P1 = 0x1.921fb8p+0;
    const double P2 = -0x1.5dde98p-23;
    const double P3 = 0x1.846988p-48;
    const double P4 = 0x1.8cc51701b839ap-72;
    double t = a * 0.63661977236758134308 + magic;   /* 2 / pi */
    double n = t - magic;
    int64_t ti;
    memcpy(&ti, &t, sizeof ti);
    int64_t q = ti & 3;                               /* n mod 4 (also for n < 0) */
    double r = a - n * P1;
    r = r - n * P2;
    r = r - n * P3;
    r = r - n * P4;
    double r2 = r * r;
    /* Taylor series of sin and cos, in r2: the coefficients +-1/k! of sin
       (k = 17, 15, ..., 3) and cos (k = 18, 16, ..., 2) */
    double ps = AC_HORNER4(1.0 / 355687428096000.0, r2, -1.0 / 1307674368000.0,
                           1.0 / 6227020800.0, -1.0 / 39916800.0, 1.0 / 362880.0);
    ps = AC_HORNER1(AC_HORNER2(ps, r2, -1.0 / 5040.0, 1.0 / 120.0), r2, -1.0 / 6.0);
    double s = r + r * r2 * ps;
    double pc = AC_HORNER4(-1.0 / 6402373705728000.0, r2, 1.0 / 20922789888000.0,
                           -1.0 / 87178291200.0, 1.0 / 479001600.0, -1.0 / 3628800.0);
    pc = AC_HORNER4(pc, r2, 1.0 / 40320.0, -1.0 / 720.0, 1.0 / 24.0, -0.5);
    double c = 1.0 + r2 * pc;
    /* angle = n pi/2 + r: rotate (s, c) by the quadrant */
    double sa = (q & 1) ? c : s;
    double ca = (q & 1) ? s : c;
    *sp = (q & 2) ? -sa : sa;
    *cp = ((q + 1) & 2) ? -ca : ca;
}

/* ------------------------------------------------------------ float16 */
/* Portable IEEE binary16 <-> float conversions (round to nearest even;
 * float -> half: ac_float_to_half, ac_math.h); used where the compiler has
 * no _Float16, and checked by the tests against NumPy over every half
 * value. */
AC_INLINE float ac_half_to_float(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    uint32_t bits;
    float f;
    if (e == 0x1f) {
        bits = sign | 0x7f800000u | (m << 13);
    } else if (e == 0) {
        f = (float)m * 0x1p-24f;                      /* zero or subnormal: exact */
        memcpy(&bits, &f, sizeof bits);
        bits |= sign;
    } else {
        bits = sign | ((e + 112u) << 23) | (m << 13);
    }
    memcpy(&f, &bits, sizeof f);
    return f;
}

#if defined(__FLT16_MAX__) && !defined(AC_NO_FLOAT16)
typedef _Float16 ac_rope_half;
#define AC_H2F(v) ((float)(v))
#define AC_F2H(v) ((ac_rope_half)(v))
#else
typedef uint16_t ac_rope_half;
#define AC_H2F(v) ac_half_to_float(v)
#define AC_F2H(v) ac_float_to_half(v)
#endif

/* ------------------------------------------------------------ params */
typedef struct {
    const void *x;            /* element [0, ..., 0] of x */
    void *o;                  /* element [0, ..., 0] of out */
    const int64_t *x_off;     /* (P, R) element offsets of x's rows' first position */
    const int64_t *o_off;     /* the same for out */
    int64_t x_ls, x_ds;       /* x strides (elements) along L and D */
    int64_t o_ls, o_ds;
    const int64_t *pos;       /* positions, P rows of L */
    int64_t pos_ps;           /* element stride between position rows */
    const double *inv_freq;   /* h frequencies */
    int64_t P, R, L, D, h;    /* position rows, rows per position row, length, width, rd/2 */
    int64_t Lb;               /* positions per work item */
    int interleaved;          /* 0: half, 1: interleaved */
    int copy_rest;            /* copy channels 2h..D-1 (0 when out is x) */
} ac_rope_params;

/* Number of work items: position rows x position blocks. */
static int64_t ac_rope_items(const ac_rope_params *p)
{
    return p->P * ((p->L + p->Lb - 1) / p->Lb);
}

/* ------------------------------------------------------------ tables */
#define AC_ROPE_TABLE(NAME, CT)                                                         \
AC_INLINE void NAME(const ac_rope_params *p, int64_t prow, int64_t l0, int64_t nl, \
                         CT *cs, CT *sn)                                                \
{                                                                                       \
    const int64_t h = p->h;                                                             \
    const double *f = p->inv_freq;                                                      \
    for (int64_t l = 0; l < nl; l++) {                                                  \
        const double pos = (double)p->pos[prow * p->pos_ps + l0 + l];                   \
        CT *c = cs + l * h, *s = sn + l * h;                                            \
        int big = 0;                                                                    \
        _Pragma("omp simd reduction(|:big)")                                            \
        for (int64_t j = 0; j < h; j++) {                                               \
            double a = pos * f[j], sv, cv;                                              \
            big |= !(fabs(a) < AC_ROPE_FAST_LIMIT);                                     \
            ac_rope_sincos(a, &sv, &cv);                                                \
            c[j] = (CT)cv;                                                              \
            s[j] = (CT)sv;                                                              \
        }                                                                               \
        if (big) {                                                                      \
            for (int64_t j = 0; j < h; j++) {                                           \
                double a = pos * f[j];                                                  \
                if (!(fabs(a) < AC_ROPE_FAST_LIMIT)) {                                  \
                    c[j] = (CT)cos(a);                                                  \
                    s[j] = (CT)sin(a);                                                  \
                }                                                                       \
            }                                                                           \
        }                                                                               \
    }                                                                                   \
}

AC_ROPE_TABLE(ac_rope_table_f, float)
AC_ROPE_TABLE(ac_rope_table_d, double)

/* ------------------------------------------------------------ one item */
/* T: storage type, CT: compute type, LD / ST: conversions; TGT: the target
   attribute of the compiled variant (ac_cpu.h). */
#define AC_ROPE_ITEM_BODY(NAME, TGT, TABLE, T, CT, LD, ST)                              \
static TGT void NAME(const ac_rope_params *p, int64_t item, void *scratch)              \
{                                                                                       \
    const int64_t nlb = (p->L + p->Lb - 1) / p->Lb;                                     \
    const int64_t prow = item / nlb;                                                    \
    const int64_t l0 = (item - prow * nlb) * p->Lb;                                     \
    const int64_t nl = p->L - l0 < p->Lb ? p->L - l0 : p->Lb;                           \
    const int64_t h = p->h, D = p->D, rd = 2 * h;                                       \
    CT *cs = (CT *)scratch, *sn = cs + p->Lb * h;                                       \
    const int64_t xds = p->x_ds, ods = p->o_ds;                                         \
    const int contig = xds == 1 && ods == 1;                                            \
    TABLE(p, prow, l0, nl, cs, sn);                                                     \
    for (int64_t r = 0; r < p->R; r++) {                                                \
        const T *xb = (const T *)p->x + p->x_off[prow * p->R + r];                      \
        T *ob = (T *)p->o + p->o_off[prow * p->R + r];                                  \
        for (int64_t l = 0; l < nl; l++) {                                              \
            const T *xr = xb + (l0 + l) * p->x_ls;                                      \
            T *orow = ob + (l0 + l) * p->o_ls;                                          \
            const CT *c = cs + l * h, *s = sn + l * h;                                  \
            if (contig && !p->interleaved) {                                            \
                _Pragma("omp simd")                                                     \
                for (int64_t j = 0; j < h; j++) {                                       \
                    CT a = LD(xr[j]), b = LD(xr[j + h]);                                \
                    orow[j] = ST(a * c[j] - b * s[j]);                                  \
                    orow[j + h] = ST(b * c[j] + a * s[j]);                              \
                }                                                                       \
            } else if (contig) {                                                        \
                _Pragma("omp simd")                                                     \
                for (int64_t j = 0; j < h; j++) {                                       \
                    CT a = LD(xr[2 * j]), b = LD(xr[2 * j + 1]);                        \
                    orow[2 * j] = ST(a * c[j] - b * s[j]);                              \
                    orow[2 * j + 1] = ST(b * c[j] + a * s[j]);                          \
                }                                                                       \
            } else {                                                                    \
                const int64_t sb = p->interleaved ? 1 : h;   /* partner offset */      \
                const int64_t step = p->interleaved ? 2 : 1;                            \
                for (int64_t j = 0; j < h; j++) {                                       \
                    const int64_t ia = step * j, ib = ia + sb;                          \
                    CT a = LD(xr[ia * xds]), b = LD(xr[ib * xds]);                      \
                    orow[ia * ods] = ST(a * c[j] - b * s[j]);                           \
                    orow[ib * ods] = ST(b * c[j] + a * s[j]);                           \
                }                                                                       \
            }                                                                           \
            if (p->copy_rest) {                                                         \
                if (contig) {                                                           \
                    memcpy(orow + rd, xr + rd, (size_t)(D - rd) * sizeof(T));           \
                } else {                                                                \
                    for (int64_t k = rd; k < D; k++)                                    \
                        orow[k * ods] = xr[k * xds];                                    \
                }                                                                       \
            }                                                                           \
        }                                                                               \
    }                                                                                   \
}

#define AC_ROPE_ID(v) (v)
#define AC_ROPE_F32(v) ((float)(v))

/* one body, a variant per target, and the dispatcher on the kernel path */
#if AC_HAVE_X86
#define AC_ROPE_MORE(NAME, TABLE, T, CT, LD, ST)                                        \
AC_ROPE_ITEM_BODY(NAME##_avx2, AC_VTGT_AVX2, TABLE, T, CT, LD, ST)                        \
AC_ROPE_ITEM_BODY(NAME##_avx512, AC_VTGT_AVX512, TABLE, T, CT, LD, ST)
#else
#define AC_ROPE_MORE(NAME, TABLE, T, CT, LD, ST)
#endif
#define AC_ROPE_ITEM(NAME, TABLE, T, CT, LD, ST)                                        \
AC_ROPE_ITEM_BODY(NAME##_portable, AC_VTGT_PORTABLE, TABLE, T, CT, LD, ST)                \
AC_ROPE_MORE(NAME, TABLE, T, CT, LD, ST)                                                \
static void NAME(const ac_rope_params *p, int64_t item, void *scratch)                  \
{                                                                                       \
    AC_VCALL(ac_variant(AC_K_ROTARY), AC_VNAME, NAME, (p, item, scratch));            \
}

AC_ROPE_ITEM(ac_rope_item_f32, ac_rope_table_f, float, float, AC_ROPE_ID, AC_ROPE_ID)
AC_ROPE_ITEM(ac_rope_item_f64, ac_rope_table_d, double, double, AC_ROPE_ID, AC_ROPE_ID)
AC_ROPE_ITEM(ac_rope_item_f16, ac_rope_table_f, ac_rope_half, float, AC_H2F, AC_F2H)

/* Bytes of scratch one thread needs (the cos / sin tables of one item). */
static size_t ac_rope_scratch_bytes(const ac_rope_params *p)
{
    return (size_t)(2 * p->Lb * p->h) * sizeof(double);
}

/* Test hooks: the portable float16 conversions and the double sin / cos. */
static void ac_rope_half_to_float_array(const uint16_t *h, float *f, int64_t n)
{
    for (int64_t i = 0; i < n; i++) f[i] = ac_half_to_float(h[i]);
}

static void ac_rope_float_to_half_array(const float *f, uint16_t *h, int64_t n)
{
    for (int64_t i = 0; i < n; i++) h[i] = ac_float_to_half(f[i]);
}

static void ac_rope_sincos_array(const double *a, double *s, double *c, int64_t n)
{
    for (int64_t i = 0; i < n; i++) ac_rope_sincos(a[i], &s[i], &c[i]);
}

#endif /* AC_ROTARY_H */
