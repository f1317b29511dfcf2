/*
 * ac_fused_x86.h -- the fused float32 attention kernel (ac_fused_impl.inc)
 * for AVX-512 and for AVX2 + FMA, and the run-time choice between them and
 * the portable path (BLAS products + portable loops in ac_sdpa_impl.inc).
 *
 * Blockings (measured on AMD Zen 4, whose AVX-512 runs on a 256-bit
 * datapath, and meant for 512-bit cores as well; the AVX-512 P.V tile's 6
 * rows on an Intel Xeon, see AC_RU512):
 *   AVX-512: panels of 32 query rows (2 zmm), 8 keys per score micro-tile
 *            (16 accumulators, 2 vector loads + 8 broadcasts per 16 FMAs);
 *            P.V tiles of 6 rows x 64 value columns (24 accumulators, 4
 *            loads + 6 broadcasts per 24 FMAs).
 *   AVX2:    panels of 16 query rows (2 ymm), 6 keys per score tile (12
 *            accumulators of 16 registers); P.V 6 rows x 16 columns (a
 *            16-row panel as 6 + 5 + 5 rows, see AC_PV5).
 * Key tiles hold AC_BK keys.
 *
 * Part of ac_sdpa.h, which includes it after the float instantiation of
 * ac_sdpa_impl.inc (it uses ac_tile_range_f32, ac_rows_nonfinite_f32 and
 * the rest of ac_sdpa.h).  Included on its own, it includes ac_sdpa.h
 * first; included from ac_sdpa.h, that inclusion is a no-op (ac_sdpa.h's
 * guard is already defined) and everything it needs is declared by then.
 */
#ifndef AC_FUSED_X86_H
#define AC_FUSED_X86_H

#include <float.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* keys per tile of the fused kernel, and per chunk of converted keys /
   values that the panels of a query block share (a build may set it:
   CFLAGS=-DAC_BK=64; a multiple of 2, see AC_BF16_CHUNK) */
#ifndef AC_BK
#define AC_BK 128
#endif
/* The scratch of the fused kernel, in floats (ac_size_scratch lays it out):
 * AC_FUSED_SCRATCH  one panel (largest panel: 32 rows): its packed
 *                   queries (D x 32), score tile (AC_BK x 32) and room
 *                   for a Dv x 32 tile
 * AC_FUSED_PANEL_STATE  a panel's packed queries and running max / sum
 *                   (2 x 32) when the panels of a block share converted
 *                   chunks (ac_fused_range_f32; ac_params.mp_off)
 * AC_BF16_CHUNK     the packed bfloat16 chunk (ac_params.bf_off), in
 *                   32-bit words: K16 (AC_BK x (D + 1) / 2), VI (AC_BK / 2
 *                   + 1 key pairs x Dv) and a tile's probability pairs
 *                   (AC_BK / 2 + 2 pairs x 32 rows) */
#define AC_FUSED_SCRATCH(D, Dv) ((ptrdiff_t)((D) + AC_BK + (Dv)) * 32)
#define AC_FUSED_PANEL_STATE(D) ((ptrdiff_t)(D) * 32 + 64)
#define AC_BF16_CHUNK(D, Dv)                                                  \
    ((ptrdiff_t)AC_BK * (((D) + 1) / 2) + (ptrdiff_t)(AC_BK / 2 + 1) * (Dv) + \
     (ptrdiff_t)(AC_BK / 2 + 2) * 32)
#if AC_BK < 2 || AC_BK % 2
#error "AC_BK must be an even number of keys"
#endif

/* after the constants above: ac_sdpa.h's ac_size_scratch uses them */
#include "ac_sdpa.h"

#if AC_HAVE_X86 || AC_HAVE_NEON
/* phases of a panel run over key chunks in several calls (ac_fused_impl.inc) */
enum { AC_PH_INIT = 1, AC_PH_FINISH = 2 };

/* the vector tanh of both instruction sets (ac_tanh_avx512): below
   AC_TANH_SMALL, tanh(x) = x + x z p(z), z = x^2, with p(z) = P0 + P1 z +
   ... + P4 z^4 fitted to the relative error (0.8 ulp in float32) */
#define AC_TANH_SMALL 0.625f
#define AC_TANH_P0 -0.3333328068256378f
#define AC_TANH_P1 0.13331444561481476f
#define AC_TANH_P2 -0.053739890456199646f
#define AC_TANH_P3 0.02063967101275921f
#define AC_TANH_P4 -0.005705652758479118f

#if AC_HAVE_X86
/* ---------------------------------------------------------------- AVX-512 */
#define AC_ISA avx512
#define AC_TGT AC_TGT_AVX512F
#define VEC __m512
#define AC_W 16
#define AC_P AC_PANEL_ROWS_AVX512 /* 2 AC_W */
#define AC_NV 2
#ifndef AC_KU512
#define AC_KU512 8
#endif
#define AC_KU AC_KU512
/* P.V micro-tiles of 6 rows x 4 vectors: 24 accumulators, 4 value loads
   and 6 broadcasts per 24 FMAs (4 rows: 4 loads per 16 FMAs, and a
   panel's 8 micro-tiles each read the whole value tile, from L2 where it
   outgrows L1: D 256 waited on those loads).  A 32-row panel runs 6 x 4 +
   4 + 4 rows.  4 -> 6 rows, float32, one thread, Xeon (Sapphire Rapids
   class): 32 x 1 x 50^2 x 256 0.90-0.94 -> 0.87-0.90 ms, 1 x 8 x 1024^2 x
   64 15.1-16.0 -> 14.4-14.8, x 128 27.9-29.7 -> 26.9-28.3 */
#ifndef AC_RU512
#define AC_RU512 6
#endif
#define AC_RU AC_RU512
#define AC_CV 4
#define VZERO() _mm512_setzero_ps()
#define VLOAD(a) _mm512_loadu_ps(a)
#define VSTORE(a, x) _mm512_storeu_ps((a), (x))
#define VSET1(x) _mm512_set1_ps(x)
#define VFMA(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define VMAX(a, b) _mm512_max_ps((a), (b))
#define VADD(a, b) _mm512_add_ps((a), (b))
#define VSUB(a, b) _mm512_sub_ps((a), (b))
#define VMUL(a, b) _mm512_mul_ps((a), (b))
#define VEXP2(x) ac_exp2_avx512(x)
#define VCAUSAL(x, lane0, t) ac_causal_avx512((x), (lane0), (t))
#define VZERO_IF_NINF(x) ac_zero_ninf_avx512(x)
#define VHIDE_FROM(x, lane0, u) ac_hide_from_avx512((x), (lane0), (u))
#define VTANH(x) ac_tanh_avx512(x)
#define VIOTA() _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
#define VABS(x) _mm512_abs_ps(x)
#define VLOADN(p, n) _mm512_maskz_loadu_ps((__mmask16)((1u << (n)) - 1u), (p))
#define VSTOREN(p, x, n) _mm512_mask_storeu_ps((p), (__mmask16)((1u << (n)) - 1u), (x))
#define VGATHER(p, stride, lane0, nr) ac_gather_avx512((p), (stride), (lane0), (nr))
#define VPACK ac_pack_avx512

static AC_TGT inline __m512 ac_gather_avx512(const float *p, ptrdiff_t stride, int lane0, int nr)
{
    const __m512i lane = _mm512_add_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(lane0));
    const __mmask16 live = _mm512_cmplt_epi32_mask(lane, _mm512_set1_epi32(nr));
    const __m512i idx = _mm512_mullo_epi32(lane, _mm512_set1_epi32((int)stride));
    return _mm512_mask_i32gather_ps(_mm512_setzero_ps(), live, idx, p, 4);
}

/* XT[d][r] = scale * x[r][d] for r < nr, 0 for nr <= r < P (P = 16 or
 * 32, XT's row length): 16 x 16 blocks transposed in registers (unpack,
 * then 128-bit lane shuffles) */
static AC_TGT inline void ac_pack_p_avx512(const float *x, ptrdiff_t x_rs, int nr, int D,
                                           float scale, float *XT, const int P)
{
    const __m512 sc = _mm512_set1_ps(scale);
    for (int rb = 0; rb < P; rb += 16) {
        for (int d0 = 0; d0 < D; d0 += 16) {
            const int nd = (D - d0 < 16) ? D - d0 : 16;
            const __mmask16 dm = (__mmask16)((1u << nd) - 1u);
            __m512 r[16], t[16];
            for (int i = 0; i < 16; i++)
                r[i] = (rb + i < nr)
                           ? _mm512_mul_ps(_mm512_maskz_loadu_ps(dm, x + (rb + i) * x_rs + d0), sc)
                           : _mm512_setzero_ps();
            for (int i = 0; i < 8; i++) {
                t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
                t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
            }
            for (int g = 0; g < 4; g++) {
                const __m512d a = _mm512_castps_pd(t[4 * g]), b = _mm512_castps_pd(t[4 * g + 2]);
                const __m512d c = _mm512_castps_pd(t[4 * g + 1]), e = _mm512_castps_pd(t[4 * g + 3]);
                r[4 * g + 0] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
                r[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
                r[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, e));
                r[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, e));
            }
            /* r[4g + k], 128-bit lane L: rows 4g..4g+3 of column 4L + k */
            for (int k = 0; k < 4; k++) {
                const __m512 A = _mm512_shuffle_f32x4(r[k], r[4 + k], 0x44);
                const __m512 B = _mm512_shuffle_f32x4(r[k], r[4 + k], 0xEE);
                const __m512 C = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0x44);
                const __m512 E = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0xEE);
                const __m512 o[4] = {_mm512_shuffle_f32x4(A, C, 0x88), _mm512_shuffle_f32x4(A, C, 0xDD),
                                     _mm512_shuffle_f32x4(B, E, 0x88), _mm512_shuffle_f32x4(B, E, 0xDD)};
                for (int L = 0; L < 4; L++)
                    if (4 * L + k < nd)
                        _mm512_storeu_ps(XT + (ptrdiff_t)(d0 + 4 * L + k) * P + rb, o[L]);
            }
        }
    }
}

static AC_TGT void ac_pack_avx512(const float *x, ptrdiff_t x_rs, int nr, int D, float scale,
                                  float *XT)
{
    ac_pack_p_avx512(x, x_rs, nr, D, scale, XT, 32);
}

static AC_TGT void ac_pack16_avx512(const float *x, ptrdiff_t x_rs, int nr, int D, float scale,
                                    float *XT)
{
    ac_pack_p_avx512(x, x_rs, nr, D, scale, XT, 16);
}

/* 2^x for x <= 0: degree-5 minimax polynomial on [-1/2, 1/2] (about 2 ulp),
 * scaled by 2^round(x); below -125 exactly 0 (no subnormal weights); NaN
 * propagates. */
static AC_TGT inline __m512 ac_exp2_avx512(__m512 x)
{
    const __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-125.0f), _CMP_LT_OQ);
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(x, n);
    __m512 y = _mm512_set1_ps(1.3276885729283094e-3f);
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(9.67568438500166e-3f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(5.550713092088699e-2f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.4022117257118225e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(6.931469440460205e-1f));
    y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.0000001192092896f));
    return _mm512_maskz_mov_ps((__mmask16)~under, _mm512_scalef_ps(y, n));
}

static AC_TGT inline __m512 ac_causal_avx512(__m512 x, int lane0, ptrdiff_t t)
{
    const int tt = t > 64 ? 64 : (int)t;
    const __m512i iota = _mm512_add_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(lane0));
    const __mmask16 hide = _mm512_cmple_epi32_mask(iota, _mm512_set1_epi32(tt));
    return _mm512_mask_mov_ps(x, hide, _mm512_set1_ps(-INFINITY));
}

/* lanes whose row index (lane0 + lane) >= u -> -inf */
static AC_TGT inline __m512 ac_hide_from_avx512(__m512 x, int lane0, ptrdiff_t u)
{
    const int uu = u < -64 ? -64 : (int)u;
    const __m512i iota = _mm512_add_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(lane0));
    const __mmask16 hide = _mm512_cmpge_epi32_mask(iota, _mm512_set1_epi32(uu));
    return _mm512_mask_mov_ps(x, hide, _mm512_set1_ps(-INFINITY));
}

/* tanh(x), relative error about 2 ulp over the whole float range:
 *   |x| <  0.625: x + x z p(z), z = x^2 (p: degree-4 fit of the relative
 *                 error; tanh(x) -> x as x -> 0, subnormals included)
 *   |x| >= 0.625: sign(x) (1 - e) / (1 + e), e = exp(-2|x|) = 2^(-2 log2(e) |x|)
 * NaN propagates, +-inf give +-1. */
static AC_TGT inline __m512 ac_tanh_avx512(__m512 x)
{
    const __m512 ax = _mm512_abs_ps(x);
    const __mmask16 lo = _mm512_cmp_ps_mask(ax, _mm512_set1_ps(AC_TANH_SMALL), _CMP_LT_OQ);
    __m512 t = _mm512_setzero_ps();
    /* each piece only where a lane needs it (typical capped scores are all
       small: the exp and the division are then skipped) */
    if (lo != 0xFFFF) {
        const __m512 e = ac_exp2_avx512(_mm512_mul_ps(ax, _mm512_set1_ps(-2.8853900817779268f)));
        const __m512 one = _mm512_set1_ps(1.0f);
        t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
    }
    if (lo) {
        const __m512 z = _mm512_mul_ps(ax, ax);
        __m512 pz = _mm512_set1_ps(AC_TANH_P4);
        pz = _mm512_fmadd_ps(pz, z, _mm512_set1_ps(AC_TANH_P3));
        pz = _mm512_fmadd_ps(pz, z, _mm512_set1_ps(AC_TANH_P2));
        pz = _mm512_fmadd_ps(pz, z, _mm512_set1_ps(AC_TANH_P1));
        pz = _mm512_fmadd_ps(pz, z, _mm512_set1_ps(AC_TANH_P0));
        t = _mm512_mask_mov_ps(t, lo, _mm512_fmadd_ps(_mm512_mul_ps(ax, z), pz, ax));
    }
    /* copy the sign of x (NaN keeps its NaN) */
    return _mm512_castsi512_ps(_mm512_or_si512(
        _mm512_castps_si512(t),
        _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0x80000000u))));
}

static AC_TGT inline __m512 ac_zero_ninf_avx512(__m512 x)
{
    const __mmask16 k = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ);
    return _mm512_mask_mov_ps(x, k, _mm512_setzero_ps());
}

#define AC_BF16_PANEL 1
/* int16 P.V under int8 Q.K^T (bt mode 3 / 4; ac_int8dot.h) */
#define AC_PV16_PANEL 1
#define AC_PV16_PACK ac_pv16_pack_probs32
#define AC_PV16_RUN ac_pv16_rows32
/* int8 Q.K^T: vpdpbusd (1) or its AVX-512BW spelling (2), 32 lanes */
#define AC_I8(c) ((c) == 1 || (c) == 2)
#define AC_I8_PACK(mode, ...) ac_i8_pack_panel(__VA_ARGS__)
#define AC_I8_SCORES ac_i8_scores
#include "ac_fused_impl.inc"

/* The 16-row AVX-512 panel (ac_fused_panel_f32_avx512h): one vector of
 * rows, for a last panel of AC_SMALL_ROWS + 1 to 16 rows of a float32
 * call, where the 32-row panel would run twice the score products (50
 * rows = 32 + 16 + 2).  Float32 products only (no bfloat16 or int8
 * panel); 8 keys per score micro-tile (12 and 16 measured the same). */
#undef AC_ISA
#undef AC_P
#undef AC_NV
#undef VPACK
#undef AC_BF16_PANEL
#undef AC_I8
#undef AC_I8_PACK
#undef AC_I8_SCORES
#define AC_ISA avx512h
#define AC_P (AC_PANEL_ROWS_AVX512 / 2)
#define AC_NV 1
#ifndef AC_KU512H
#define AC_KU512H 8
#endif
#undef AC_KU
#define AC_KU AC_KU512H
#define VPACK ac_pack16_avx512
#define AC_BF16_PANEL 0
#undef AC_PV16_PANEL
#define AC_PV16_PANEL 0
#define AC_I8(c) 0
#define AC_I8_PACK(...) ((void)0)
#define AC_I8_SCORES(...) ((void)0)
#include "ac_fused_impl.inc"

#include "ac_fused_undef.inc"

/* ------------------------------------------------------------ AVX2 + FMA */
#define AC_ISA avx2
#define AC_TGT AC_TGT_AVX2
#define VEC __m256
#define AC_W 8
#define AC_P AC_PANEL_ROWS_AVX2 /* 2 AC_W */
#define AC_NV 2
#ifndef AC_KU256
#define AC_KU256 6
#endif
/* P.V micro-tiles of 6 rows x 2 vectors: 12 accumulators, so 12
   independent FMA chains (8 left a 4-cycle FMA latency with no slack on
   two pipes); a 16-row panel runs 6 + 6 + 4 rows.  4 -> 6 rows, float32,
   one thread, Zen 5: 4 x 12 x 512^2 x 64 31.0 -> 30.2 ms, 1 x 8 x 1024^2 x
   128 40.1 -> 37.9 ms */
#ifndef AC_RU256
#define AC_RU256 6
#endif
#ifndef AC_CV256
#define AC_CV256 2
#endif
#define AC_KU AC_KU256
#define AC_RU AC_RU256
#define AC_CV AC_CV256
/* a full 16-row panel's P.V as 6 + 5 + 5 rows (10 accumulators in the
   5-row tiles): the 4-row tile of 6 + 6 + 4 has 8 FMA chains, too few for
   two pipes of 4-cycle latency: perf, precision="int8" prefill 1 x 8 x
   1024^2 x 128, one thread, AVX2 path, Xeon (Sapphire Rapids class): the
   4-row tile took 1.5x the time per FMA of the 6-row one; the 5-row tiles
   take the 6-row one's, and P.V went from 53 to 51 % of the call */
#ifndef AC_PV5
#define AC_PV5 1
#endif
#define VZERO() _mm256_setzero_ps()
#define VLOAD(a) _mm256_loadu_ps(a)
#define VSTORE(a, x) _mm256_storeu_ps((a), (x))
#define VSET1(x) _mm256_set1_ps(x)
#define VFMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define VMAX(a, b) _mm256_max_ps((a), (b))
#define VADD(a, b) _mm256_add_ps((a), (b))
#define VSUB(a, b) _mm256_sub_ps((a), (b))
#define VMUL(a, b) _mm256_mul_ps((a), (b))
#define VEXP2(x) ac_exp2_avx2(x)
#define VCAUSAL(x, lane0, t) ac_causal_avx2((x), (lane0), (t))
#define VZERO_IF_NINF(x) ac_zero_ninf_avx2(x)
#define VHIDE_FROM(x, lane0, u) ac_hide_from_avx2((x), (lane0), (u))
#define VTANH(x) ac_tanh_avx2(x)
#define VIOTA() _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7)
#define VABS(x) _mm256_andnot_ps(_mm256_set1_ps(-0.0f), (x))
#define VLOADN(p, n) _mm256_maskload_ps((p), ac_lanes_avx2(n))
#define VSTOREN(p, x, n) _mm256_maskstore_ps((p), ac_lanes_avx2(n), (x))
#define VGATHER(p, stride, lane0, nr) ac_gather_avx2((p), (stride), (lane0), (nr))
#define VPACK ac_pack_avx2

/* integer lane mask: lanes < n set */
static AC_TGT inline __m256i ac_lanes_avx2(int n)
{
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

static AC_TGT inline __m256 ac_gather_avx2(const float *p, ptrdiff_t stride, int lane0, int nr)
{
    const __m256i lane = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                          _mm256_set1_epi32(lane0));
    const __m256 live = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(nr), lane));
    const __m256i idx = _mm256_mullo_epi32(lane, _mm256_set1_epi32((int)stride));
    return _mm256_mask_i32gather_ps(_mm256_setzero_ps(), p, idx, live, 4);
}

/* XT[d][r] = scale * x[r][d] for r < nr, 0 for nr <= r < P (P = 8 or 16,
 * XT's row length): 8 x 8 blocks transposed in registers */
static AC_TGT inline void ac_pack_p_avx2(const float *x, ptrdiff_t x_rs, int nr, int D,
                                         float scale, float *XT, const int P)
{
    const __m256 sc = _mm256_set1_ps(scale);
    for (int rb = 0; rb < P; rb += 8) {
        AC_MCA_BEGIN("fused-pack");
        for (int d0 = 0; d0 < D; d0 += 8) {
            const int nd = (D - d0 < 8) ? D - d0 : 8;
            const __m256i dm = _mm256_cmpgt_epi32(_mm256_set1_epi32(nd),
                                                  _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
            __m256 r[8], t[8], u[8];
            for (int i = 0; i < 8; i++)
                r[i] = (rb + i < nr)
                           ? _mm256_mul_ps(_mm256_maskload_ps(x + (rb + i) * x_rs + d0, dm), sc)
                           : _mm256_setzero_ps();
            for (int i = 0; i < 4; i++) {
                t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
                t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
            }
            for (int g = 0; g < 2; g++) {
                u[4 * g + 0] = _mm256_shuffle_ps(t[4 * g], t[4 * g + 2], 0x44);
                u[4 * g + 1] = _mm256_shuffle_ps(t[4 * g], t[4 * g + 2], 0xEE);
                u[4 * g + 2] = _mm256_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0x44);
                u[4 * g + 3] = _mm256_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0xEE);
            }
            for (int k = 0; k < 4; k++) {
                if (k < nd)
                    _mm256_storeu_ps(XT + (ptrdiff_t)(d0 + k) * P + rb,
                                     _mm256_permute2f128_ps(u[k], u[4 + k], 0x20));
                if (k + 4 < nd)
                    _mm256_storeu_ps(XT + (ptrdiff_t)(d0 + k + 4) * P + rb,
                                     _mm256_permute2f128_ps(u[k], u[4 + k], 0x31));
            }
        }
        AC_MCA_END("fused-pack");
    }
}

static AC_TGT void ac_pack_avx2(const float *x, ptrdiff_t x_rs, int nr, int D, float scale,
                                float *XT)
{
    ac_pack_p_avx2(x, x_rs, nr, D, scale, XT, 16);
}

static AC_TGT void ac_pack8_avx2(const float *x, ptrdiff_t x_rs, int nr, int D, float scale,
                                 float *XT)
{
    ac_pack_p_avx2(x, x_rs, nr, D, scale, XT, 8);
}

static AC_TGT inline __m256 ac_exp2_avx2(__m256 x)
{
    const __m256 under = _mm256_cmp_ps(x, _mm256_set1_ps(-125.0f), _CMP_LT_OQ);
    const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 f = _mm256_sub_ps(x, n);
    __m256 y = _mm256_set1_ps(1.3276885729283094e-3f);
    y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(9.67568438500166e-3f));
    y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(5.550713092088699e-2f));
    y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(2.4022117257118225e-1f));
    y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(6.931469440460205e-1f));
    y = _mm256_fmadd_ps(y, f, _mm256_set1_ps(1.0000001192092896f));
    /* 2^n in the exponent field; n is in [-125, 0] wherever it is used */
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
}

static AC_TGT inline __m256 ac_causal_avx2(__m256 x, int lane0, ptrdiff_t t)
{
    const int tt = t > 64 ? 64 : (int)t;
    const __m256i iota = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                          _mm256_set1_epi32(lane0));
    const __m256 hide = _mm256_castsi256_ps(
        _mm256_cmpgt_epi32(_mm256_set1_epi32(tt + 1), iota));
    return _mm256_blendv_ps(x, _mm256_set1_ps(-INFINITY), hide);
}

static AC_TGT inline __m256 ac_hide_from_avx2(__m256 x, int lane0, ptrdiff_t u)
{
    const int uu = u < -64 ? -64 : (int)u;
    const __m256i iota = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                                          _mm256_set1_epi32(lane0));
    const __m256 hide = _mm256_castsi256_ps(
        _mm256_cmpgt_epi32(iota, _mm256_set1_epi32(uu - 1)));
    return _mm256_blendv_ps(x, _mm256_set1_ps(-INFINITY), hide);
}

/* tanh(x): the two pieces of ac_tanh_avx512 */
static AC_TGT inline __m256 ac_tanh_avx2(__m256 x)
{
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256 ax = _mm256_andnot_ps(sign, x);
    const __m256 lo = _mm256_cmp_ps(ax, _mm256_set1_ps(AC_TANH_SMALL), _CMP_LT_OQ);
    const int lanes = _mm256_movemask_ps(lo);
    __m256 t = _mm256_setzero_ps();
    if (lanes != 0xFF) {
        const __m256 e = ac_exp2_avx2(_mm256_mul_ps(ax, _mm256_set1_ps(-2.8853900817779268f)));
        const __m256 one = _mm256_set1_ps(1.0f);
        t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
    }
    if (lanes) {
        const __m256 z = _mm256_mul_ps(ax, ax);
        __m256 pz = _mm256_set1_ps(AC_TANH_P4);
        pz = _mm256_fmadd_ps(pz, z, _mm256_set1_ps(AC_TANH_P3));
        pz = _mm256_fmadd_ps(pz, z, _mm256_set1_ps(AC_TANH_P2));
        pz = _mm256_fmadd_ps(pz, z, _mm256_set1_ps(AC_TANH_P1));
        pz = _mm256_fmadd_ps(pz, z, _mm256_set1_ps(AC_TANH_P0));
        t = _mm256_blendv_ps(t, _mm256_fmadd_ps(_mm256_mul_ps(ax, z), pz, ax), lo);
    }
    return _mm256_or_ps(t, _mm256_and_ps(sign, x));
}

static AC_TGT inline __m256 ac_zero_ninf_avx2(__m256 x)
{
    const __m256 k = _mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ);
    return _mm256_andnot_ps(k, x);
}

#define AC_BF16_PANEL 0
/* int16 P.V under int8 Q.K^T (bt mode 3 / 4; ac_int8dot.h) */
#define AC_PV16_PANEL 1
#define AC_PV16_PACK ac_pv16_pack_probs
#define AC_PV16_RUN ac_pv16_rows
/* int8 Q.K^T: the sign trick, AVX-VNNI or its AVX2 spelling, 16 lanes */
#define AC_I8(c) AC_QK8_AVX2(c)
#define AC_I8_PACK ac_i8_pack_panel16
#define AC_I8_SCORES ac_i8_scores16
#include "ac_fused_impl.inc"

/* The 8-row AVX2 panel (ac_fused_panel_f32_avx2h), as the AVX-512 path's
 * 16-row one: one vector of rows for a last panel of AC_SMALL_ROWS + 1 to
 * 8 rows (40 = 2 x 16 + 8); 12 keys per score micro-tile (12
 * accumulators). */
#undef AC_ISA
#undef AC_P
#undef AC_NV
#undef AC_KU
#undef VPACK
#undef AC_I8
#undef AC_I8_PACK
#undef AC_I8_SCORES
#undef AC_RU
#undef AC_PV5
#define AC_PV5 0
#undef AC_PV16_PANEL
#define AC_PV16_PANEL 0
#define AC_ISA avx2h
#define AC_P (AC_PANEL_ROWS_AVX2 / 2)
#define AC_RU 4 /* 8 rows: two micro-tiles of 4 */
#define AC_NV 1
#ifndef AC_KU256H
#define AC_KU256H 12
#endif
#define AC_KU AC_KU256H
#define VPACK ac_pack8_avx2
#define AC_I8(c) 0
#define AC_I8_PACK(...) ((void)0)
#define AC_I8_SCORES(...) ((void)0)
#include "ac_fused_impl.inc"

#include "ac_fused_undef.inc"
#endif /* AC_HAVE_X86 */

#if AC_HAVE_NEON
/* ------------------------------------------------------------------ NEON */
/* aarch64 (NEON is the baseline: no target attribute), 128-bit vectors of
 * 4 floats in 32 registers: panels of 8 query rows (2 vectors); score
 * micro-tiles of 12 keys (24 accumulators, 2 query loads + 12 key
 * broadcasts per 24 FMAs); P.V tiles of 4 rows x 4 vectors (16 columns:
 * 16 accumulators, 4 value loads + 4 broadcasts per 16 FMAs), so an
 * 8-row panel is two of them.  Blockings chosen on llvm-mca's
 * neoverse-n1 / neoverse-v1 / apple-m1 models (bench/mca.py), not on a
 * measured core. */
#define AC_ISA neon
#define AC_TGT
#define VEC float32x4_t
#define AC_W 4
#define AC_P AC_PANEL_ROWS_NEON /* 2 AC_W */
#define AC_NV 2
#ifndef AC_KUNEON
#define AC_KUNEON 8
#endif
#define AC_KU AC_KUNEON
#ifndef AC_RUNEON
#define AC_RUNEON 4
#endif
#define AC_RU AC_RUNEON
#define AC_CV 4
#define AC_PV5 0
#define VZERO() vdupq_n_f32(0.0f)
#define VLOAD(a) vld1q_f32(a)
#define VSTORE(a, x) vst1q_f32((a), (x))
#define VSET1(x) vdupq_n_f32(x)
#define VFMA(a, b, c) vfmaq_f32((c), (a), (b))
/* (NaN in either operand gives NaN: a NaN score then makes the row's sum
   NaN, and the row is flagged for the direct loops, as on x86) */
#define VMAX(a, b) vmaxq_f32((a), (b))
#define VADD(a, b) vaddq_f32((a), (b))
#define VSUB(a, b) vsubq_f32((a), (b))
#define VMUL(a, b) vmulq_f32((a), (b))
#define VEXP2(x) ac_exp2_neon(x)
#define VCAUSAL(x, lane0, t) ac_causal_neon((x), (lane0), (t))
#define VZERO_IF_NINF(x) ac_zero_ninf_neon(x)
#define VHIDE_FROM(x, lane0, u) ac_hide_from_neon((x), (lane0), (u))
#define VTANH(x) ac_tanh_neon(x)
#define VIOTA() ac_iota_neon()
#define VABS(x) vabsq_f32(x)
#define VLOADN(p, n) ac_loadn_neon((p), (n))
#define VSTOREN(p, x, n) ac_storen_neon((p), (x), (n))
#define VPACK ac_pack_neon

static inline float32x4_t ac_iota_neon(void)
{
    static const float io[4] = {0.0f, 1.0f, 2.0f, 3.0f};
    return vld1q_f32(io);
}

static inline int32x4_t ac_iota_s32_neon(int lane0)
{
    static const int32_t io[4] = {0, 1, 2, 3};
    return vaddq_s32(vld1q_s32(io), vdupq_n_s32(lane0));
}

/* the first n < 4 floats at p (the rest 0) / stored at p */
static inline float32x4_t ac_loadn_neon(const float *p, int n)
{
    float t[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    memcpy(t, p, sizeof(float) * (size_t)n);
    return vld1q_f32(t);
}

static inline void ac_storen_neon(float *p, float32x4_t x, int n)
{
    float t[4];
    vst1q_f32(t, x);
    memcpy(p, t, sizeof(float) * (size_t)n);
}

/* XT[d][r] = scale * x[r][d] for r < nr, 0 for nr <= r < P (P = 8 or 4,
 * XT's row length): 4 x 4 blocks transposed in registers (zip / uzp of
 * 64-bit halves) */
static inline void ac_pack_p_neon(const float *x, ptrdiff_t x_rs, int nr, int D, float scale,
                                  float *XT, const int P)
{
    const float32x4_t sc = vdupq_n_f32(scale);
    for (int rb = 0; rb < P; rb += 4) {
        for (int d0 = 0; d0 < D; d0 += 4) {
            const int nd = (D - d0 < 4) ? D - d0 : 4;
            float32x4_t r[4];
            for (int i = 0; i < 4; i++) {
                if (rb + i >= nr)
                    r[i] = vdupq_n_f32(0.0f);
                else if (nd == 4)
                    r[i] = vmulq_f32(vld1q_f32(x + (rb + i) * x_rs + d0), sc);
                else
                    r[i] = vmulq_f32(ac_loadn_neon(x + (rb + i) * x_rs + d0, nd), sc);
            }
            /* rows (a b c d) -> columns */
            const float32x4_t t0 = vtrn1q_f32(r[0], r[1]), t1 = vtrn2q_f32(r[0], r[1]);
            const float32x4_t t2 = vtrn1q_f32(r[2], r[3]), t3 = vtrn2q_f32(r[2], r[3]);
            float32x4_t c[4];
            c[0] = vreinterpretq_f32_f64(vtrn1q_f64(vreinterpretq_f64_f32(t0),
                                                    vreinterpretq_f64_f32(t2)));
            c[1] = vreinterpretq_f32_f64(vtrn1q_f64(vreinterpretq_f64_f32(t1),
                                                    vreinterpretq_f64_f32(t3)));
            c[2] = vreinterpretq_f32_f64(vtrn2q_f64(vreinterpretq_f64_f32(t0),
                                                    vreinterpretq_f64_f32(t2)));
            c[3] = vreinterpretq_f32_f64(vtrn2q_f64(vreinterpretq_f64_f32(t1),
                                                    vreinterpretq_f64_f32(t3)));
            for (int kk = 0; kk < nd; kk++) vst1q_f32(XT + (ptrdiff_t)(d0 + kk) * P + rb, c[kk]);
        }
    }
}

static void ac_pack_neon(const float *x, ptrdiff_t x_rs, int nr, int D, float scale, float *XT)
{
    ac_pack_p_neon(x, x_rs, nr, D, scale, XT, AC_PANEL_ROWS_NEON);
}

static void ac_pack4_neon(const float *x, ptrdiff_t x_rs, int nr, int D, float scale,
                          float *XT)
{
    ac_pack_p_neon(x, x_rs, nr, D, scale, XT, AC_PANEL_ROWS_NEON / 2);
}

/* 2^x for x <= 0 (the x86 kernels' polynomial): NaN propagates, below
   -125 exactly 0 */
static inline float32x4_t ac_exp2_neon(float32x4_t x)
{
    const uint32x4_t under = vcltq_f32(x, vdupq_n_f32(-125.0f));
    const float32x4_t n = vrndnq_f32(x);
    const float32x4_t f = vsubq_f32(x, n);
    float32x4_t y = vdupq_n_f32(1.3276885729283094e-3f);
    y = vfmaq_f32(vdupq_n_f32(9.67568438500166e-3f), y, f);
    y = vfmaq_f32(vdupq_n_f32(5.550713092088699e-2f), y, f);
    y = vfmaq_f32(vdupq_n_f32(2.4022117257118225e-1f), y, f);
    y = vfmaq_f32(vdupq_n_f32(6.931469440460205e-1f), y, f);
    y = vfmaq_f32(vdupq_n_f32(1.0000001192092896f), y, f);
    /* 2^n in the exponent field; n is in [-125, 0] wherever it is used */
    const int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
    const float32x4_t r = vmulq_f32(y, vreinterpretq_f32_s32(e));
    return vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(r), under));
}

static inline float32x4_t ac_causal_neon(float32x4_t x, int lane0, ptrdiff_t t)
{
    const int tt = t > 64 ? 64 : (int)t;
    const uint32x4_t hide = vcltq_s32(ac_iota_s32_neon(lane0), vdupq_n_s32(tt + 1));
    return vbslq_f32(hide, vdupq_n_f32(-INFINITY), x);
}

static inline float32x4_t ac_hide_from_neon(float32x4_t x, int lane0, ptrdiff_t u)
{
    const int uu = u < -64 ? -64 : (int)u;
    const uint32x4_t hide = vcgtq_s32(ac_iota_s32_neon(lane0), vdupq_n_s32(uu - 1));
    return vbslq_f32(hide, vdupq_n_f32(-INFINITY), x);
}

/* tanh(x): the two pieces of ac_tanh_avx512 */
static inline float32x4_t ac_tanh_neon(float32x4_t x)
{
    const float32x4_t ax = vabsq_f32(x);
    const uint32x4_t lo = vcltq_f32(ax, vdupq_n_f32(AC_TANH_SMALL));
    const uint32_t nlo = vaddvq_u32(vshrq_n_u32(lo, 31)); /* lanes below */
    float32x4_t t = vdupq_n_f32(0.0f);
    if (nlo != 4) {
        const float32x4_t e = ac_exp2_neon(vmulq_f32(ax, vdupq_n_f32(-2.8853900817779268f)));
        const float32x4_t one = vdupq_n_f32(1.0f);
        t = vdivq_f32(vsubq_f32(one, e), vaddq_f32(one, e));
    }
    if (nlo) {
        const float32x4_t z = vmulq_f32(ax, ax);
        float32x4_t pz = vdupq_n_f32(AC_TANH_P4);
        pz = vfmaq_f32(vdupq_n_f32(AC_TANH_P3), pz, z);
        pz = vfmaq_f32(vdupq_n_f32(AC_TANH_P2), pz, z);
        pz = vfmaq_f32(vdupq_n_f32(AC_TANH_P1), pz, z);
        pz = vfmaq_f32(vdupq_n_f32(AC_TANH_P0), pz, z);
        t = vbslq_f32(lo, vfmaq_f32(ax, vmulq_f32(ax, z), pz), t);
    }
    /* the sign of x back on */
    const uint32x4_t sign = vdupq_n_u32(0x80000000u);
    return vreinterpretq_f32_u32(vorrq_u32(vreinterpretq_u32_f32(t),
                                           vandq_u32(sign, vreinterpretq_u32_f32(x))));
}

static inline float32x4_t ac_zero_ninf_neon(float32x4_t x)
{
    const uint32x4_t k = vceqq_f32(x, vdupq_n_f32(-INFINITY));
    return vreinterpretq_f32_u32(vbicq_u32(vreinterpretq_u32_f32(x), k));
}

#define AC_BF16_PANEL 0
#define AC_PV16_PANEL 0
#define AC_I8(c) 0
#define AC_I8_PACK(...) ((void)0)
#define AC_I8_SCORES(...) ((void)0)
#include "ac_fused_impl.inc"

/* the 4-row panel (ac_fused_panel_f32_neonh) of a short last panel */
#undef AC_ISA
#undef AC_P
#undef AC_NV
#undef AC_KU
#undef VPACK
#define AC_ISA neonh
#define AC_P (AC_PANEL_ROWS_NEON / 2)
#define AC_NV 1
#ifndef AC_KUNEONH
#define AC_KUNEONH 16
#endif
#define AC_KU AC_KUNEONH
#define VPACK ac_pack4_neon
#include "ac_fused_impl.inc"

#include "ac_fused_undef.inc"
#endif /* AC_HAVE_NEON */

/* -------------------------------------------------------------- dispatch */
/* rows [0, n) of `bytes` bytes each, `rs` bytes apart, into L2 (the
   hint T0 took the L1 of the running panel: AVX-512 D 128 1 % slower) */
#if AC_HAVE_X86
#define AC_PREFETCH_T1(a) _mm_prefetch((a), _MM_HINT_T1)
#else
#define AC_PREFETCH_T1(a) __builtin_prefetch((a), 0, 2)
#endif
static inline void ac_prefetch_rows(const char *x, ptrdiff_t rs, int n, ptrdiff_t bytes)
{
    for (int r = 0; r < n; r++)
        for (ptrdiff_t b = 0; b < bytes; b += 64) AC_PREFETCH_T1(x + r * rs + b);
}

/* query rows per panel of the path in use (the driver sizes blocks by it) */
static int ac_fused_panel_rows(void)
{
#if AC_HAVE_NEON
    return AC_PANEL_ROWS_NEON;
#else
    return ac_kernel_path == AC_PATH_AVX512 ? AC_PANEL_ROWS_AVX512 : AC_PANEL_ROWS_AVX2;
#endif
}

static int ac_fused_panel_call(const ac_params *p, const float *q, const float *k,
                               const float *v, const float *ksc, const float *vsc,
                               const uint8_t *mb, const float *mf, ptrdiff_t i0, int nr,
                               ptrdiff_t ks, ptrdiff_t ke, float *scratch, float *acc,
                               float *m, float *l, int *bad, float *QT, float *state,
                               int phase, const float *kc, const float *vc,
                               const ac_bf16_chunk *bt)
{
#if AC_HAVE_NEON
    return ac_fused_panel_f32_neon(p, q, k, v, ksc, vsc, mb, mf, i0, nr, ks, ke, scratch, acc,
                                   m, l, bad, QT, state, phase, kc, vc, bt);
#else
    if (ac_kernel_path == AC_PATH_AVX512)
        return ac_fused_panel_f32_avx512(p, q, k, v, ksc, vsc, mb, mf, i0, nr, ks, ke, scratch,
                                         acc, m, l, bad, QT, state, phase, kc, vc, bt);
    return ac_fused_panel_f32_avx2(p, q, k, v, ksc, vsc, mb, mf, i0, nr, ks, ke, scratch,
                                   acc, m, l, bad, QT, state, phase, kc, vc, bt);
#endif
}

/* the one-vector panel of the path in use (half the rows of a panel: a
   short last panel's) */
typedef int (*ac_fused_panel_fn)(const ac_params *, const float *, const float *,
                                 const float *, const float *, const float *, const uint8_t *,
                                 const float *, ptrdiff_t, int, ptrdiff_t, ptrdiff_t, float *,
                                 float *, float *, float *, int *, float *, float *, int,
                                 const float *, const float *, const ac_bf16_chunk *);
static ac_fused_panel_fn ac_fused_half_panel(void)
{
#if AC_HAVE_NEON
    return ac_fused_panel_f32_neonh;
#else
    return ac_kernel_path == AC_PATH_AVX512 ? ac_fused_panel_f32_avx512h
                                            : ac_fused_panel_f32_avx2h;
#endif
}

/* After chunks of keys taken in turn by a block's panels: a row whose
   every score came out -inf although it attends some key of [kst, ken)
   gets bad = -1 (see the end of ac_fused_range_f32) */
static void ac_flag_unseen_rows(const ac_params *p, const uint8_t *mb, const float *mf,
                                ptrdiff_t i0, int nq, ptrdiff_t kst, ptrdiff_t ken,
                                const float *m, int *bad, int processed)
{
    if (processed)
        for (int r = 0; r < nq; r++)
            if (!bad[r] && m[r] == -INFINITY && ac_row_attends_f32(p, mb, mf, i0 + r, kst, ken))
                bad[r] = -1;
}

/* Attention of query rows [i0, i0 + nq) over keys [ks, ke), panel by panel:
 * the same contract as ac_sdpa_range_f32, except that a row whose scores
 * (the scale, a float mask entry) are out of range for the base-2 units
 * of the fused kernel, or NaN, comes back with bad = -1: the caller then
 * computes it on its own loops.  So do the rows of a last panel of at most
 * AC_SMALL_ROWS rows of a float32 call (the small loops read each key and
 * value row once for them; a panel would cost all its lanes).
 *
 * float32 keys / values are read in place by every panel.  int8 and half
 * keys / values are converted once per chunk of AC_BK keys for all the
 * panels of the block (p->mp_off: each panel's packed queries and running
 * statistics between chunks), not once per panel. */
static AC_FUSED_RANGE_F32
{
    const int P = ac_fused_panel_rows();
    const int D = p->D, Dv = p->Dv;
    /* scale log2(e) folded into the queries must be a float */
    if (!((float)p->scale * 1.44269504088896341f <= FLT_MAX)) {
        for (int r = 0; r < nq; r++) bad[r] = -1;
        return 0;
    }
    int processed = 0;
    /* bfloat16 dot products: the AVX-512 panels, chunks shared by a block */
    const int bfm = (p->bf16dot == 1 || p->bf16dot == 2) && ac_kernel_path == AC_PATH_AVX512;
    /* int16 P.V under int8 Q.K^T: the AVX2 and the AVX-512 panels, value
       chunks shared by a block */
    const int pvm = (p->bf16dot == 3 || p->bf16dot == 4) &&
                    ((ac_kernel_path == AC_PATH_AVX2 && AC_QK8_AVX2(p->qk8)) ||
                     (ac_kernel_path == AC_PATH_AVX512 && (p->qk8 == 1 || p->qk8 == 2)));
    /* int8 Q.K^T reads its int8 keys in place */
    const int i8 = p->qk8 == 1 || p->qk8 == 2 || AC_QK8_AVX2(p->qk8);
    const int kconv = (p->kq8 && !i8) || p->kh, vconv = p->vq8 || p->vh;
    const int convert = kconv || vconv || bfm || pvm;
    /* (a block of one panel or less takes the chunks too under bfloat16
       or int16 products: the products must not depend on how the rows
       were split into blocks -- the thread count; a single panel's block
       took float32 products, 1e-2 off at 3 threads for precision=
       "bfloat16" 1 x 4 x 64^2 x 64) */
    if (!convert || (nq <= P && !pvm && !bfm)) {
        float state[64];
        /* a last panel of a few rows (50 = 3 x 16 + 2 on AVX2) would cost
           a whole panel's products: its rows come back bad = -1, for the
           caller's direct loops, which read each key / value row once for
           all of them (32 x 50 x 50 x 256 float32 on AVX2: 1.20 -> 0.98 ms, Zen 5) */
        const int tail = nq % P;
        /* a last panel of at most P / 2 rows: the one-vector panel of the
           path (and then 1 - AC_SMALL_ROWS rows after it to the direct
           loops: 50 = 32 + 16 + 2 on AVX-512; 32 x 1 x N x 50 x 256
           float32, one thread, Zen 5: N 50 0.59 -> 0.53 ms, 40 0.51 ->
           0.44, 16 0.23 -> 0.18) */
        /* (not for converted operands: a block of more than one panel
           runs every panel whole on the shared chunks below, and a block
           of one panel or less must compute its rows the same way -- the
           block size follows the thread count) */
        const int H = P / 2, half = !p->qk8 && !p->bf16dot && !convert;
        int direct = 0;
        if (nq > P && tail > 0 && tail <= AC_SMALL_ROWS && half)
            direct = tail;
        else if (half && tail > H && tail <= H + AC_SMALL_ROWS)
            direct = tail - H;
        if (direct) {
            nq -= direct;
            for (int r = 0; r < direct; r++) bad[nq + r] = -1;
        }
        /* float32 key / value rows in place, not contiguous (a head view
           of a projection: rows 2 KiB apart for 8 heads of 64 share a few
           L1 sets): every panel would read them from L2 again; the
           block's copy (p->kvcopy, at most M rows of each at dq_off) keeps
           them dense for all its panels */
        const float *kcp = NULL, *vcp = NULL;
        if (p->kvcopy && nq > P) {
            /* the keys some row of the block may see (their slots: c - ks) */
            ptrdiff_t c0 = ks, c1 = ke;
            ac_band_keys(p, i0, nq, &c0, &c1);
            float *KC = scratch + p->dq_off;
            float *VC = KC + ((ptrdiff_t)p->M * D + 15) / 16 * 16; /* ac_size_kvcopy */
            if (p->kvcopy & 2) {
                for (ptrdiff_t c = c0; c < c1; c++)
                    memcpy(KC + (c - ks) * D, k + c * p->k_rs, sizeof(float) * (size_t)D);
                kcp = KC;
            }
            if (p->kvcopy & 1) {
                for (ptrdiff_t c = c0; c < c1; c++)
                    memcpy(VC + (c - ks) * Dv, v + c * p->v_rs, sizeof(float) * (size_t)Dv);
                vcp = VC;
            }
        }
        /* float32 rows in place, a block of several panels over more keys
           than p->kchunk (attncore._call.plan): the panels take turns over
           chunks of p->kchunk keys (rounded up to AC_BK), so that a chunk
           comes from memory or L3 once for the block and from L2 for its
           other panels; panel by panel, each panel streamed every key of
           the block again (one thread, 1 x 8 x 4096^2 x 64 on AVX2: 64 ->
           72 GFLOP/s, Emerald Rapids; more on a core of 512 KiB of L2).
           The chunks lie on a grid from the sequence's key 0 (p->kbase),
           and so do a panel's tiles (ac_fused_panel): a tile never crosses
           a chunk's edge, so the chunks change no tile, and no result */
        ptrdiff_t kst = ks, ken = ke;
        const ptrdiff_t ch = ((ptrdiff_t)p->kchunk + AC_BK - 1) / AC_BK * AC_BK;
        if (ch > 0 && p->mp_off && nq > P) ac_band_keys(p, i0, nq, &kst, &ken);
        if (ch > 0 && p->mp_off && nq > P && ken - kst > ch) {
            const ptrdiff_t per = AC_FUSED_PANEL_STATE(D);
            float *mp = scratch + p->mp_off;
            ptrdiff_t c0 = kst;
            do {
                const ptrdiff_t e = ((c0 + p->kbase) / ch + 1) * ch - p->kbase,
                                c1 = e < ken ? e : ken;
                const int phase = (c0 == kst ? AC_PH_INIT : 0) | (c1 >= ken ? AC_PH_FINISH : 0);
                for (int r0 = 0, pn = 0; r0 < nq; r0 += P, pn++) {
                    const int nr = (nq - r0 < P) ? nq - r0 : P;
                    float *QT = mp + pn * per;
                    const float *kcc = kcp ? kcp + (c0 - ks) * D : NULL;
                    const float *vcc = vcp ? vcp + (c0 - ks) * Dv : NULL;
                    if (half && nr <= H)
                        processed |= ac_fused_half_panel()(
                            p, q, k, v, ksc, vsc, mb, mf, i0 + r0, nr, c0, c1, scratch,
                            acc + (ptrdiff_t)r0 * Dv, m + r0, l + r0, bad + r0, QT,
                            QT + (ptrdiff_t)D * 32, phase, kcc, vcc, NULL);
                    else
                        processed |= ac_fused_panel_call(
                            p, q, k, v, ksc, vsc, mb, mf, i0 + r0, nr, c0, c1, scratch,
                            acc + (ptrdiff_t)r0 * Dv, m + r0, l + r0, bad + r0, QT,
                            QT + (ptrdiff_t)D * 32, phase, kcc, vcc, NULL);
                }
                c0 = c1;
            } while (c0 < ken);
            /* (as after the converted chunks below) */
            ac_flag_unseen_rows(p, mb, mf, i0, nq, kst, ken, m, bad, processed);
            return processed;
        }
        /* bytes per query element: int8 / half / float32 rows */
        const int qes = p->qk8 ? 1 : p->qh ? 2 : 4;
        for (int r0 = 0; r0 < nq; r0 += P) {
            const int nr = (nq - r0 < P) ? nq - r0 : P;
            if (r0 + P < nq) {
                /* the next panel's query rows and accumulator rows, into
                   the caches while this panel computes (its packing and
                   its zeroed accumulator otherwise wait on memory: 3 % of
                   4 x 12 x 512^2 x 64 float32 on AVX2, Zen 5) */
                const int nn = (nq - r0 - P < P) ? nq - r0 - P : P;
                ac_prefetch_rows((const char *)(const void *)q +
                                     (i0 + r0 + P) * p->q_rs * qes,
                                 p->q_rs * qes, nn, (ptrdiff_t)D * qes);
                ac_prefetch_rows((const char *)(const void *)(acc + (ptrdiff_t)(r0 + P) * Dv),
                                 0, 1, (ptrdiff_t)nn * Dv * 4);
            }
            if (half && nr <= H)
                processed |= ac_fused_half_panel()(
                    p, q, k, v, ksc, vsc, mb, mf, i0 + r0, nr, ks, ke, scratch,
                    acc + (ptrdiff_t)r0 * Dv, m + r0, l + r0, bad + r0, scratch, state,
                    AC_PH_INIT | AC_PH_FINISH, kcp, vcp, NULL);
            else
                processed |= ac_fused_panel_call(
                    p, q, k, v, ksc, vsc, mb, mf, i0 + r0, nr, ks, ke, scratch,
                    acc + (ptrdiff_t)r0 * Dv, m + r0, l + r0, bad + r0, scratch, state,
                    AC_PH_INIT | AC_PH_FINISH, kcp, vcp, NULL);
        }
        return processed;
    }
    /* the keys some row of the block may see */
    ptrdiff_t kst = ks, ken = ke;
    ac_band_keys(p, i0, nq, &kst, &ken);
    if (ken < kst) ken = kst;
    /* int16 P.V and bfloat16 products: whole chunks on a grid of AC_BK
       keys from key 0 (within [ks, ke)), whatever keys the block sees:
       the values' column scales, a tile's probability scales and the key
       pairs are per chunk, and the block's keys -- a window's left edge, a
       causal block's last key -- move with the block, so with the thread
       count (they gave other results per block size: 1.6e-3 for
       precision="bfloat16" under a window); a panel skips the keys its
       rows do not see */
    if (pvm || bfm) {
        const ptrdiff_t kb = p->kbase;
        const ptrdiff_t a = (kst + kb) / AC_BK * AC_BK - kb,
                        e = (ken + kb + AC_BK - 1) / AC_BK * AC_BK - kb;
        kst = a > ks ? a : ks;
        ken = e < ke ? e : ke;
    }
    float *KC = scratch + p->dq_off, *VC = KC + (ptrdiff_t)AC_BK * D;
    /* bfloat16 chunk: K16 (AC_BK x (D+1)/2), VI (AC_BK/2 x Dv), PT2 */
    uint32_t *K16 = (uint32_t *)(void *)(scratch + p->bf_off);
    uint32_t *VI = K16 + (ptrdiff_t)AC_BK * ((D + 1) / 2);
    ac_bf16_chunk bt;
    bt.mode = p->bf16dot;
    bt.k16 = K16;
    bt.vi = VI;
    bt.pt2 = VI + (ptrdiff_t)(AC_BK / 2 + 1) * Dv;
    bt.vfin = 0;
    bt.vcs = NULL;
    if (pvm) {
        /* int16 chunk: VI (AC_BK / 2 + 1 pairs, then the columns'
           factors), PT, the keys' scales (then the rows', the panel's, and
           the columns': AC_PV16_CHUNK) */
        const ptrdiff_t ld = AC_PV16_LD(Dv);
        bt.vi = K16;
        bt.pt2 = K16 + (AC_BK / 2 + 2) * ld;
        bt.vcs = AC_PV16_VCS(bt.pt2);
    }
    const ptrdiff_t per = AC_FUSED_PANEL_STATE(D); /* a panel's QT and state */
    float *mp = scratch + p->mp_off;
    ptrdiff_t c0 = kst;
    do {
        /* chunks on the grid of AC_BK keys from the sequence's key 0 (the
           panels' tiles lie on it too: a chunk cuts none) */
        const ptrdiff_t e = ((c0 + p->kbase) / AC_BK + 1) * AC_BK - p->kbase;
        const ptrdiff_t c1 = e < ken ? e : ken;
        const int nk = (int)(c1 - c0);
        if (nk > 0) {
            if (i8)
                ;
            else if (p->kq8)
                AC_DEQUANT(float, (const int8_t *)(const void *)k + c0 * p->k_rs, p->k_rs,
                           ksc + c0 * p->ks_rs, p->ks_rs, nk, D, KC);
            else if (p->kh)
                ac_half_rows_f32(p->kh, (const uint16_t *)(const void *)k + c0 * p->k_rs,
                                 p->k_rs, nk, D, KC, D);
            if (p->vq8)
                AC_DEQUANT(float, (const int8_t *)(const void *)v + c0 * p->v_rs, p->v_rs,
                           vsc + c0 * p->vs_rs, p->vs_rs, nk, Dv, VC);
            else if (p->vh)
                ac_half_rows_f32(p->vh, (const uint16_t *)(const void *)v + c0 * p->v_rs,
                                 p->v_rs, nk, Dv, VC, Dv);
            if (bfm) {
                /* the chunk's bfloat16 operands, from the float rows */
                const float *ksrc = kconv ? KC : k + c0 * p->k_rs;
                const float *vsrc = vconv ? VC : v + c0 * p->v_rs;
                const ptrdiff_t krs = kconv ? D : p->k_rs, vrs = vconv ? Dv : p->v_rs;
                if (!i8) ac_pack_pairs_rows(ksrc, krs, nk, D, K16, (D + 1) / 2);
                ac_pack_pairs_keys(vsrc, vrs, nk, Dv, VI);
                bt.vfin = !ac_rows_nonfinite_f32(vsrc, nk, Dv, vrs);
            }
#if AC_HAVE_X86 /* (pvm: the x86 panels only) */
            if (pvm) {
                const float *vsrc = vconv ? VC : v + c0 * p->v_rs;
                bt.vfin = ac_pv16_pack_values(vsrc, vconv ? Dv : p->v_rs, nk, Dv,
                                              (uint32_t *)bt.vi, (float *)bt.vcs,
                                              AC_PV16_CSC(bt.pt2),
                                              (float *)(void *)(K16 + (AC_BK / 2 + 1) *
                                                                          AC_PV16_LD(Dv)));
            }
#endif
        }
        const int phase = (c0 == kst ? AC_PH_INIT : 0) | (c1 >= ken ? AC_PH_FINISH : 0);
        for (int r0 = 0, pn = 0; r0 < nq; r0 += P, pn++) {
            const int nr = (nq - r0 < P) ? nq - r0 : P;
            float *QT = mp + pn * per;
            processed |= ac_fused_panel_call(
                p, q, k, v, ksc, vsc, mb, mf, i0 + r0, nr, c0, c1, scratch,
                acc + (ptrdiff_t)r0 * Dv, m + r0, l + r0, bad + r0, QT, QT + (ptrdiff_t)D * 32,
                phase, kconv ? KC : NULL, vconv ? VC : NULL, (bfm || pvm) ? &bt : NULL);
        }
        c0 = c1;
    } while (c0 < ken);
    /* A row whose every score came out -inf although it attends keys is
       flagged for the caller's recomputation by its panel's FINISH phase,
       which sees only the last chunk's keys: where that chunk holds none
       the row attends (masked, or beyond a causal row's diagonal), ask
       over the block's keys (the row came back 0, a fully masked row's
       answer, for bfloat16 / float16 / int8 keys and values with all scores
       below -FLT_MAX). */
    ac_flag_unseen_rows(p, mb, mf, i0, nq, kst, ken, m, bad, processed);
    return processed;
}

#else
static int ac_fused_panel_rows(void) { return AC_PANEL_ROWS_AVX2; }
static AC_FUSED_RANGE_F32
{
    (void)ksc; (void)vsc;
    (void)p; (void)q; (void)k; (void)v; (void)mb; (void)mf; (void)i0;
    (void)nq; (void)ks; (void)ke; (void)scratch; (void)acc; (void)m;
    (void)l; (void)bad;
    return 0;
}
#endif

#endif /* AC_FUSED_X86_H */
