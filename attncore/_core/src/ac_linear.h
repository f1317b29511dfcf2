/*
 * ac_linear.h -- dense layers without BLAS: out[r][c] = x_r . w_c (+
 * bias[c]) (PyTorch's Linear layout: w holds one row per output column),
 * for the float32 x86 paths of attncore._core._linalg.
 *
 * The rows of x act as the queries of the fused attention kernel and the
 * rows of w as its keys: a panel of x rows is packed transposed once, the
 * rows of w are read in place through broadcasts, and the products are the
 * fused kernel's score micro-kernels (ac_fused_impl.inc: ac_qkmain /
 * ac_qk1, AC_KU columns at a time).  A few rows (decoding) take dot
 * products instead (the small-row score kernels).  bfloat16 weights are
 * read in place as pairs by the bfloat16 score micro-kernels
 * (ac_bf16dot.h).
 *
 *   ac_linear_rows_f32       rows x a column range, float32 x and w
 *   ac_bf16_linear_rows      the same for bfloat16 w with bfloat16
 *                            products (AVX-512 path)
 */
#ifndef AC_LINEAR_H
#define AC_LINEAR_H

#include <stddef.h>
#include <stdint.h>
#include "ac_sdpa.h" /* the fused and small-row kernels, the bfloat16 ones */

/* scratch floats ac_linear_rows_f32 needs: the packed panel (K x 32) and
   a tile of AC_KU x 32 products */
#define AC_LINEAR_SCRATCH(K) ((ptrdiff_t)((K) + 16) * 32)
/* row blocks of at most this many rows use dot products (decoding) */
#define AC_LINEAR_SMALL 8
/* ac_bf16_linear_rows: panels of this many rows of x, and the scratch
   floats it needs (the packed panel: K / 2 x 32 words, and an 8 x 32
   tile) */
#define AC_BF16_LINEAR_ROWS 32
#define AC_BF16_LINEAR_SCRATCH(K) ((ptrdiff_t)((K) / 2) * 32 + 8 * 32)

#if AC_HAVE_X86
/*
 * Dense layer rows on the fused kernel's micro-kernel: out[r][c] = x_r .
 * w_c (+ bias[c]) for r < nr <= P and c in [c0, c1).  The x rows are
 * packed transposed into XT (K x P) and act as the "queries"; the rows of
 * w are read in place through broadcasts like keys.  T: KU x P scratch.
 * One definition per instruction set of the fused kernel (ISA: its name
 * suffix, TGT its target, VEC its vector type, ZERO a zero vector, KU its
 * keys per score micro-tile, P its panel rows).
 */
#define AC_DEF_LINEAR_PANEL(ISA, TGT, VEC, ZERO, KU, P)                            \
static TGT void ac_linear_panel_f32_##ISA(const float *x, ptrdiff_t x_rs, int nr,  \
                                          const float *w, ptrdiff_t w_rs,          \
                                          const float *bias, float *out,           \
                                          ptrdiff_t o_rs, int c0, int c1, int K,   \
                                          float *XT, float *T)                     \
{                                                                                  \
    ac_pack_rows_f32_##ISA(x, x_rs, nr, K, 1.0f, XT);                              \
    VEC t0 = ZERO, t1 = ZERO;                                                      \
    int c = c0;                                                                    \
    for (; c < c1; c += KU) {                                                      \
        const int nc = (c1 - c < KU) ? c1 - c : KU;                                \
        if (nc == KU) {                                                            \
            ac_qkmain_f32_##ISA(XT, K, w + c * w_rs, w_rs, T, &t0, &t1, NULL);     \
        } else { /* the last nc < KU columns: 4, 2, then 1 at a time */          \
            int u = 0;                                                             \
            for (; u + 4 <= nc; u += 4)                                            \
                ac_qk4_f32_##ISA(XT, K, w + (c + u) * w_rs, w_rs, T + u * P, &t0,  \
                                 &t1, NULL);                                       \
            for (; u + 2 <= nc; u += 2)                                            \
                ac_qk2_f32_##ISA(XT, K, w + (c + u) * w_rs, w_rs, T + u * P, &t0,  \
                                 &t1, NULL);                                       \
            for (; u < nc; u++)                                                    \
                ac_qk1_f32_##ISA(XT, K, w + (c + u) * w_rs, w_rs, T + u * P, &t0,  \
                                 &t1, NULL);                                       \
        }                                                                          \
        /* row by row: each row's nc values are adjacent (column by column,        \
           rows 4 KiB apart all fall in one L1 set) */                             \
        for (int r = 0; r < nr; r++) {                                             \
            float *orow = out + r * o_rs + c;                                      \
            for (int u = 0; u < nc; u++)                                           \
                orow[u] = T[u * P + r] + (bias ? bias[c + u] : 0.0f);              \
        }                                                                          \
    }                                                                              \
}

AC_DEF_LINEAR_PANEL(avx512, AC_TGT_AVX512F, __m512, _mm512_setzero_ps(), AC_KU512,
                    AC_PANEL_ROWS_AVX512)
AC_DEF_LINEAR_PANEL(avx2, AC_TGT_AVX2, __m256, _mm256_setzero_ps(), AC_KU256,
                    AC_PANEL_ROWS_AVX2)

/* Dense layer rows with bfloat16 products: out[r][c] = x_r . w_c (+
 * bias[c]) for rows r < nr <= 32 of x (float32, rounded to bfloat16 pairs
 * once: QT2) and columns [c0, c1) of bfloat16 weights read in place as
 * pairs (K even, w_rs even: a row's consecutive pairs are its 32-bit
 * words).  mode 1 vdpbf16ps, 2 its AVX-512F spelling.  QT2: K / 2 x 32
 * words; T: 8 x 32 floats. */
static AC_TGT_AVX512BW void ac_bf16_linear_panel(int mode, const float *x, ptrdiff_t x_rs,
                                              int nr, const uint16_t *w, ptrdiff_t w_rs,
                                              const float *bias, float *out, ptrdiff_t o_rs,
                                              int c0, int c1, int K, uint32_t *QT2, float *T)
{
    const int Dh = K / 2;
    const ptrdiff_t kw = w_rs / 2;
    ac_pack_pairs_panel(x, x_rs, nr, K, 32, QT2);
    for (int c = c0; c < c1; c += 8) {
        const int nc = (c1 - c < 8) ? c1 - c : 8;
        const uint32_t *kr = (const uint32_t *)(const void *)(w + (ptrdiff_t)c * w_rs);
        __m512 t0 = _mm512_setzero_ps(), t1 = _mm512_setzero_ps();
        if (nc == 8) {
            if (mode == 1)
                ac_bf16_qk8(QT2, Dh, kr, kw, 1.0f, T, &t0, &t1);
            else
                ac_bf16_qk8_emu(QT2, Dh, kr, kw, 1.0f, T, &t0, &t1);
        } else {
            for (int u = 0; u < nc; u++) {
                if (mode == 1)
                    ac_bf16_qk1(QT2, Dh, kr + u * kw, kw, 1.0f, T + u * 32, &t0, &t1);
                else
                    ac_bf16_qk1_emu(QT2, Dh, kr + u * kw, kw, 1.0f, T + u * 32, &t0, &t1);
            }
        }
        for (int r = 0; r < nr; r++) {
            float *orow = out + (ptrdiff_t)r * o_rs + c;
            for (int u = 0; u < nc; u++) orow[u] = T[u * 32 + r] + (bias ? bias[c + u] : 0.0f);
        }
    }
}

/*
 * out[r][c] = x_r . w_c (+ bias[c]) for rows [r0, r0 + nr) and columns
 * [c0, c1), without BLAS: panels of the fused kernel's micro-kernel, or dot
 * products for a few rows.  Returns 0, or -1 on the portable path (the
 * caller then uses BLAS).
 */
static int ac_linear_rows_f32(const float *x, ptrdiff_t x_rs, int r0, int nr,
                              const float *w, ptrdiff_t w_rs,
                              const float *bias, float *out, ptrdiff_t o_rs,
                              int c0, int c1, int K, float *scratch)
{
    if (ac_kernel_path == AC_PATH_PORTABLE) return -1;
    if (c1 <= c0 || nr <= 0) return 0;
    if (nr <= AC_LINEAR_SMALL) {
        float *o = out + r0 * o_rs + c0;
        ac_scores_small_x86(ac_kernel_path == AC_PATH_AVX512, AC_SE_F32, nr, c1 - c0, K, 1.0f,
                            x + r0 * x_rs, x_rs, w + c0 * w_rs, w_rs, NULL, 0, o, (int)o_rs,
                            NULL);
        if (bias)
            for (int r = 0; r < nr; r++)
                for (int c = 0; c < c1 - c0; c++) o[r * o_rs + c] += bias[c0 + c];
        return 0;
    }
    const int P = ac_fused_panel_rows();
    float *XT = scratch, *T = scratch + (ptrdiff_t)K * 32;
    for (int p0 = r0; p0 < r0 + nr; p0 += P) {
        const int n = (r0 + nr - p0 < P) ? r0 + nr - p0 : P;
        if (ac_kernel_path == AC_PATH_AVX512)
            ac_linear_panel_f32_avx512(x + p0 * x_rs, x_rs, n, w, w_rs, bias,
                                       out + p0 * o_rs, o_rs, c0, c1, K, XT, T);
        else
            ac_linear_panel_f32_avx2(x + p0 * x_rs, x_rs, n, w, w_rs, bias,
                                     out + p0 * o_rs, o_rs, c0, c1, K, XT, T);
    }
    return 0;
}

/* out[r][c] for rows [0, nr) of x in panels of AC_BF16_LINEAR_ROWS and
 * columns [c0, c1) of bfloat16 w (K and w_rs even), with bfloat16
 * products (mode 1 vdpbf16ps, 2 its AVX-512F spelling); scratch:
 * AC_BF16_LINEAR_SCRATCH(K) floats */
static void ac_bf16_linear_rows(int mode, const float *x, ptrdiff_t x_rs, int nr,
                                const uint16_t *w, ptrdiff_t w_rs, const float *bias,
                                float *out, ptrdiff_t o_rs, int c0, int c1, int K,
                                float *scratch)
{
    uint32_t *QT2 = (uint32_t *)(void *)scratch;
    float *T = scratch + (ptrdiff_t)(K / 2) * 32;
    for (int p0 = 0; p0 < nr; p0 += AC_BF16_LINEAR_ROWS) {
        const int n = nr - p0 < AC_BF16_LINEAR_ROWS ? nr - p0 : AC_BF16_LINEAR_ROWS;
        ac_bf16_linear_panel(mode, x + p0 * x_rs, x_rs, n, w, w_rs, bias, out + p0 * o_rs,
                             o_rs, c0, c1, K, QT2, T);
    }
}

#else
static int ac_linear_rows_f32(const float *x, ptrdiff_t x_rs, int r0, int nr,
                              const float *w, ptrdiff_t w_rs,
                              const float *bias, float *out, ptrdiff_t o_rs,
                              int c0, int c1, int K, float *scratch)
{
    (void)x; (void)x_rs; (void)r0; (void)nr; (void)w; (void)w_rs; (void)bias;
    (void)out; (void)o_rs; (void)c0; (void)c1; (void)K; (void)scratch;
    return -1;
}
static void ac_bf16_linear_rows(int mode, const float *x, ptrdiff_t x_rs, int nr,
                                const uint16_t *w, ptrdiff_t w_rs, const float *bias,
                                float *out, ptrdiff_t o_rs, int c0, int c1, int K,
                                float *scratch)
{
    (void)mode; (void)x; (void)x_rs; (void)nr; (void)w; (void)w_rs; (void)bias; (void)out;
    (void)o_rs; (void)c0; (void)c1; (void)K; (void)scratch;
}
#endif /* AC_HAVE_X86 */

#endif /* AC_LINEAR_H */
