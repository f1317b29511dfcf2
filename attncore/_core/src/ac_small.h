/*
 * ac_small.h -- products for query blocks of a few rows (decoding, one
 * decoder step of a seq2seq model, a grouped-query head group) on the AVX2
 * and AVX-512 paths, keys and values read in place in every storage
 * format: float32, bfloat16 (a shift; by pairs of vectors, a shift and a
 * mask), float16 (F16C) and int8 (a sign extension; the row's scale
 * applied to the sum).
 *
 * At these sizes the work is streaming K and V once.  One body
 * (ac_small_impl.inc), instantiated per instruction set and parameterized
 * by the element loader, scores a block of keys x query rows at a time
 * with one accumulator each (16 zmm / 8 ymm registers) whose sums are
 * reduced together by a transposing tree (one query row on AVX-512: the
 * row in registers, each key row read in order), prefetches the rows a
 * few KiB ahead, and keeps the P.V accumulator of
 * up to 8 vectors of columns x rows in registers across all keys: each key
 * and value row is loaded once for all the block's query rows.  Nothing is
 * converted to a float copy first, so a 16-bit or int8 cache is read at
 * its own size.
 *
 * Chosen at run time (ac_sdpa_variant.inc: ac_scores_small_x86 /
 * ac_pv_small_x86); the portable loops are in ac_sdpa_impl.inc.
 */
#ifndef AC_SMALL_H
#define AC_SMALL_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include "ac_common.h"
#include "ac_cpu.h"

/* 4-bit keys / values read in place by the small-row loops: at most
 * AC_Q4_MAXG groups and AC_Q4_MAXD columns per row (the query rows' and
 * pairs' copies live on the stack), the group size (ac_params.kq4 / vq4) a
 * multiple of 16; other formats take dequantized tiles */
#define AC_Q4_MAXG 16
#define AC_Q4_MAXD 512
#define AC_Q4_DIRECT(gs, D) ((gs) > 0 && (gs) % 16 == 0 && (D) % (gs) == 0 && \
                             (D) / (gs) <= AC_Q4_MAXG && (D) <= AC_Q4_MAXD)

/* element formats of an operand read in place (the 16-bit codes are
 * ac_half.h's AC_H_BF16 / AC_H_F16) */
#define AC_SE_F32 0
#define AC_SE_BF16 1
#define AC_SE_F16 2
#define AC_SE_I8 3

/* the format of an operand from its int8 flag and 16-bit code (AC_H_*) */
#define AC_SMALL_FMT(q8, h) ((q8) ? AC_SE_I8 : (h))

static inline size_t ac_se_size(int fmt)
{
    return fmt == AC_SE_F32 ? 4 : (fmt == AC_SE_I8 ? 1 : 2);
}

#if AC_HAVE_X86 || AC_HAVE_NEON

#define AC_SINLINE inline __attribute__((always_inline))

/* software prefetch distances in bytes of rows ahead, whatever the
 * element format: keys (scores) and values (P.V).  Tuned on Zen 5 (float32
 * 4 / 2 KiB against 8 / 4 KiB: 1.05-1.3x at 2 threads).  Rows of 16-bit
 * and int8 elements went twice as far (8 / 4 KiB: 1.05x on Zen 5) until a
 * Xeon with AMX (family 6 model 167) ran bf16 / f16 decode at D 128 1.2-1.4x
 * slower with them than with 4 / 2 KiB, on both paths and at 1 and 2
 * threads (bench/compare_decode.py), and no faster anywhere else */
#ifndef AC_SMALL_PF_K
#define AC_SMALL_PF_K 4096
#endif
#ifndef AC_SMALL_PF_V
#define AC_SMALL_PF_V 2048
#endif

/* rows of at least ac_pf_l2_rows bytes read for one query row are
 * prefetched into L2 only (prefetcht1); by default none are (AC_PF_L2_ROWS
 * 0), as the data said on Emerald Rapids (family 6 model 207), both paths
 * forced, the two settings alternating in one process (rows below the
 * threshold run one code both ways: a noise floor of 0.98-1.01), L1 time /
 * L2 time for rows of 256 bytes or more:
 *   - K/V streamed from beyond the L3 (calls of 134-268 MB): bf16 / f16 at
 *     D 128 1.06-1.12 at 1 thread, 1.01-1.09 at 2; float32 1.00-1.06
 *     (bench/compare_decode.py --prefetch-ab);
 *   - K/V the L3 holds from call to call (32 MiB: 8x8x1x2048 x 64 float32,
 *     x 128 bfloat16): 0.92-0.96, both paths and thread counts;
 *   - the grouped rows of a GQA step: no gain, hence one row only.
 * A rule by the call's K+V bytes against the L3 would take the gain
 * without the loss; until one is measured on more machines, L1 it is.
 * Zen 3's prefetcht1 fills L1 anyway; Zen 4 / Zen 5's fills L2 (and may be
 * dropped).  _sdpa.set_prefetch_l2_rows changes the setting (A/B runs) */

/* whether rows `stride` bytes apart, rb bytes of each read for nq query
 * rows, are prefetched into L2 only: where rows a multiple of 2 KiB apart
 * share the L1 sets (the heads of a paged block, 4 KiB apart: prefetched
 * into L1 they would evict the rows in use), and rows of ac_pf_l2_rows
 * bytes or more read for one query row */
static inline int ac_small_pf_l2(ptrdiff_t stride, ptrdiff_t rb, int nq)
{
    return stride % 2048 == 0 || (nq == 1 && ac_pf_l2_rows > 0 && rb >= ac_pf_l2_rows);
}

/* the line at p: into L2 only where l2 (ac_small_pf_l2), else into L1 */
static inline __attribute__((always_inline)) void ac_small_prefetch(const char *p, int l2)
{
#if AC_HAVE_X86
    if (l2)
        _mm_prefetch(p, _MM_HINT_T1);
    else
        _mm_prefetch(p, _MM_HINT_T0);
#else /* prfm pldl2keep / pldl1keep */
    if (l2)
        __builtin_prefetch(p, 0, 2);
    else
        __builtin_prefetch(p, 0, 3);
#endif
}

/* rows of rb bytes that make about `bytes` (at least one) */
static inline int ac_small_pf_rows(ptrdiff_t rb, ptrdiff_t bytes)
{
    const ptrdiff_t n = bytes / (rb > 0 ? rb : 1);
    return n < 1 ? 1 : (int)n;
}

/* the small-row products of a key / value operand (k_rs / v_rs, ks_rs /
 * vs_rs in elements; ks / vsc: int8 rows' scales, else unused; kn / vn:
 * NULL, or the rows of the same format and stride read next, whose first
 * rows the last keys prefetch) */
typedef void (*ac_scores_small_fn)(int nq, int nk, int D, float scale, const float *q,
                                   ptrdiff_t q_rs, const void *k, ptrdiff_t k_rs,
                                   const float *ks, ptrdiff_t ks_rs, float *S, int ldS,
                                   const void *kn);
typedef void (*ac_pv_small_fn)(int nq, int nk, int Dv, const float *S, int ldS,
                               const void *v, ptrdiff_t v_rs, const float *vsc,
                               ptrdiff_t vs_rs, float *acc, int first, const void *vn);

#endif /* AC_HAVE_X86 || AC_HAVE_NEON */

#if AC_HAVE_X86

/* 16 elements at p (fmt, a compile-time constant in every caller) as
 * floats; the _m form reads only the lanes of m (the rest are 0) */
static AC_TGT_AVX512 AC_SINLINE __m512 ac_ld16_m(int fmt, const void *p, __mmask16 m)
{
    if (fmt == AC_SE_F32)
        return _mm512_maskz_loadu_ps(m, p);
    if (fmt == AC_SE_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
    if (fmt == AC_SE_F16)
        return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p)));
}

static AC_TGT_AVX512 AC_SINLINE __m512 ac_ld16(int fmt, const void *p)
{
    return ac_ld16_m(fmt, p, (__mmask16)0xFFFF);
}

/* 8 elements at p as floats; the _n form the first n < 8 (the rest 0) */
static AC_TGT_AVX2 AC_SINLINE __m256 ac_ld8(int fmt, const void *p)
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

static AC_TGT_AVX2 AC_SINLINE __m256 ac_ld8_n(int fmt, const void *p, int n)
{
    unsigned char tmp[32] = {0};
    memcpy(tmp, p, ac_se_size(fmt) * (size_t)n);
    return ac_ld8(fmt, tmp);
}

static AC_TGT_AVX2 AC_SINLINE void ac_st8_n(float *p, __m256 x, int n)
{
    float tmp[8];
    _mm256_storeu_ps(tmp, x);
    memcpy(p, tmp, sizeof(float) * (size_t)n);
}

/* 4-bit codes (ac_params.kq4 / vq4: two per byte, the even element in the
 * low nibble): the 2 W codes of the W bytes at p (W = 16 / 8) as two
 * vectors of floats, lo the codes of the even-numbered elements (the low
 * nibbles), hi those of the odd-numbered (the high nibbles), 0..15 -- a
 * zero extension of the bytes to 32 bits (vpmovzxbd, the load folded in),
 * a mask (lo) or a shift (hi: nothing above the nibble is left), a
 * conversion each.  The query rows (scores) and the P.V accumulators
 * (columns) are held in the same even / odd order (SDEINT / SINTER), as
 * for bfloat16 pairs.  The _h form: the first W / 2 bytes (lanes W / 2
 * on: 0). */
static AC_TGT_AVX512 AC_SINLINE void ac_ldq4_16(const void *p, __m512 *lo, __m512 *hi)
{
    const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    *lo = _mm512_cvtepi32_ps(_mm512_and_si512(x, _mm512_set1_epi32(15)));
    *hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(x, 4));
}

static AC_TGT_AVX512 AC_SINLINE void ac_ldq4_16h(const void *p, __m512 *lo, __m512 *hi)
{
    const __m512i x = _mm512_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    *lo = _mm512_cvtepi32_ps(_mm512_and_si512(x, _mm512_set1_epi32(15)));
    *hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(x, 4));
}

static AC_TGT_AVX2 AC_SINLINE void ac_ldq4_8(const void *p, __m256 *lo, __m256 *hi)
{
    const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    *lo = _mm256_cvtepi32_ps(_mm256_and_si256(x, _mm256_set1_epi32(15)));
    *hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(x, 4));
}

/* a vector of a in lanes 0-7 and b in lanes 8-15: the scales of a unit of
 * 32 codes of AVX-512 whose halves lie in two groups (16 codes each) */
static AC_TGT_AVX512 AC_SINLINE __m512 ac_set2_16(float a, float b)
{
    return _mm512_insertf32x8(_mm512_set1_ps(a), _mm256_set1_ps(b), 1);
}

/* the n (even) float16 at p as floats at out (F16C, 8 / 4 at a time) */
static AC_TGT_AVX2 AC_SINLINE void ac_h2f(const uint16_t *p, int n, float *out)
{
    int i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + i))));
    if (i + 4 <= n) {
        _mm_storeu_ps(out + i, _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(p + i))));
        i += 4;
    }
    if (i < n) {
        out[i] = _cvtsh_ss(p[i]);
        out[i + 1] = _cvtsh_ss(p[i + 1]);
    }
}

/* bfloat16 pairs: 2 x 16 / 2 x 8 elements at p as two vectors of floats,
 * lo the even-numbered elements (0, 2, ...), hi the odd-numbered: a float
 * is a bfloat16 in its high half, so one load, a shift (the even element
 * of each 32-bit pair) and a mask (the odd one) -- no widening shuffle
 * per vector (vpmovzxwd: a port-5 uop each on Intel, the bound of the
 * AVX2 bfloat16 decode loops).  The query rows (scores) and the P.V
 * accumulators (columns) are held in the same even / odd order
 * (ac_deint* / ac_inter*), once per call / per chunk. */
static AC_TGT_AVX512 AC_SINLINE void ac_ldbf2_16(const void *p, __m512 *lo, __m512 *hi)
{
    const __m512i x = _mm512_loadu_si512(p);
    *lo = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
    *hi = _mm512_castsi512_ps(_mm512_and_si512(x, _mm512_set1_epi32((int)0xFFFF0000u)));
}

static AC_TGT_AVX2 AC_SINLINE void ac_ldbf2_8(const void *p, __m256 *lo, __m256 *hi)
{
    const __m256i x = _mm256_loadu_si256((const __m256i *)p);
    *lo = _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
    *hi = _mm256_castsi256_ps(_mm256_and_si256(x, _mm256_set1_epi32((int)0xFFFF0000u)));
}

/* the elements of (a, b) -- 2 W consecutive floats -- as (even, odd)
 * vectors, and back */
static AC_TGT_AVX512 AC_SINLINE void ac_deint16(__m512 a, __m512 b, __m512 *e, __m512 *o)
{
    const __m512i ie = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                         28, 30);
    *e = _mm512_permutex2var_ps(a, ie, b);
    *o = _mm512_permutex2var_ps(a, _mm512_add_epi32(ie, _mm512_set1_epi32(1)), b);
}

static AC_TGT_AVX512 AC_SINLINE void ac_inter16(__m512 e, __m512 o, __m512 *a, __m512 *b)
{
    const __m512i ia = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7,
                                         23);
    *a = _mm512_permutex2var_ps(e, ia, o);
    *b = _mm512_permutex2var_ps(e, _mm512_add_epi32(ia, _mm512_set1_epi32(8)), o);
}

static AC_TGT_AVX2 AC_SINLINE void ac_deint8(__m256 a, __m256 b, __m256 *e, __m256 *o)
{
    /* shuffle: (a0 a2 b0 b2 | a4 a6 b4 b6); the 64-bit quarters 0 2 1 3 */
    *e = _mm256_castpd_ps(_mm256_permute4x64_pd(
        _mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)), 0xD8));
    *o = _mm256_castpd_ps(_mm256_permute4x64_pd(
        _mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xDD)), 0xD8));
}

static AC_TGT_AVX2 AC_SINLINE void ac_inter8(__m256 e, __m256 o, __m256 *a, __m256 *b)
{
    const __m256 lo = _mm256_unpacklo_ps(e, o), hi = _mm256_unpackhi_ps(e, o);
    *a = _mm256_permute2f128_ps(lo, hi, 0x20);
    *b = _mm256_permute2f128_ps(lo, hi, 0x31);
}

/* lane i of the result: the sum of a[i]'s lanes, for the 16 / 8 vectors
 * a[] of floats, or of int32 (ints: exact integer sums; the shuffles are
 * the same) -- a transposing tree of adds (45 shuffles / adds for 16 sums,
 * against about 10 per sum one at a time) */
static AC_TGT_AVX512 AC_SINLINE __m512 ac_add16(__m512 a, __m512 b, int ints)
{
    return ints ? _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(a),
                                                       _mm512_castps_si512(b)))
                : _mm512_add_ps(a, b);
}

static AC_TGT_AVX512 AC_SINLINE __m512 ac_hsum16_avx512(const __m512 *a, int ints)
{
    __m512 t[8], u[4];
    for (int i = 0; i < 8; i++)
        t[i] = ac_add16(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                        _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]), ints);
    /* t[i], 128-bit lane L: partial sums of a[2i], a[2i+1], a[2i], a[2i+1] */
    for (int i = 0; i < 4; i++) {
        const __m512d x = _mm512_castps_pd(t[2 * i]), y = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = ac_add16(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                        _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)), ints);
    }
    /* u[g], lane L: partial sums (over lane L's elements) of a[4g .. 4g+3] */
    const __m512 x01 = ac_add16(_mm512_shuffle_f32x4(u[0], u[1], 0x44),
                                _mm512_shuffle_f32x4(u[0], u[1], 0xEE), ints);
    const __m512 x23 = ac_add16(_mm512_shuffle_f32x4(u[2], u[3], 0x44),
                                _mm512_shuffle_f32x4(u[2], u[3], 0xEE), ints);
    return ac_add16(_mm512_shuffle_f32x4(x01, x23, 0x88),
                    _mm512_shuffle_f32x4(x01, x23, 0xDD), ints);
}

static AC_TGT_AVX2 AC_SINLINE __m256 ac_hadd8(__m256 a, __m256 b, int ints)
{
    return ints ? _mm256_castsi256_ps(_mm256_hadd_epi32(_mm256_castps_si256(a),
                                                        _mm256_castps_si256(b)))
                : _mm256_hadd_ps(a, b);
}

static AC_TGT_AVX2 AC_SINLINE __m256 ac_hsum8_avx2(const __m256 *a, int ints)
{
    const __m256 t0 = ac_hadd8(a[0], a[1], ints), t1 = ac_hadd8(a[2], a[3], ints);
    const __m256 t2 = ac_hadd8(a[4], a[5], ints), t3 = ac_hadd8(a[6], a[7], ints);
    const __m256 u0 = ac_hadd8(t0, t1, ints), u1 = ac_hadd8(t2, t3, ints);
    /* u0: sums of a[0..3] over lanes 0-3 (low half) and 4-7 (high half) */
    const __m256 lo = _mm256_permute2f128_ps(u0, u1, 0x20);
    const __m256 hi = _mm256_permute2f128_ps(u0, u1, 0x31);
    return ints ? _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(lo),
                                                       _mm256_castps_si256(hi)))
                : _mm256_add_ps(lo, hi);
}

static AC_TGT_AVX2 AC_SINLINE float ac_hsum1_avx2(__m256 a)
{
    const __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 h = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_shuffle_ps(h, h, 1)));
}

/* AVX-512 */
#define AC_SISA avx512
#define AC_STGT AC_TGT_AVX512
/* the decode loops' functions start on a cache line: their loops' places
   no longer move with unrelated code (a change elsewhere in _sdpa.so moved
   the AVX-512 scores function from 0 to 16 bytes past a line: float32
   decode 8 x 8 x 1 x 4096 x 128, one thread, Zen 5, 7.7 -> 8.4 ms; aligned:
   7.9) */
#define AC_SFN_ATTR __attribute__((aligned(64)))
#define SVEC __m512
#define AC_SW 16
#define SZERO() _mm512_setzero_ps()
#define SLOAD(p) _mm512_loadu_ps(p)
#define SLOADN(p, n) _mm512_maskz_loadu_ps((__mmask16)((1u << (n)) - 1u), (p))
#define SSTORE(p, x) _mm512_storeu_ps((p), (x))
#define SSTOREN(p, x, n) _mm512_mask_storeu_ps((p), (__mmask16)((1u << (n)) - 1u), (x))
#define SSET1(x) _mm512_set1_ps(x)
#define SFMA(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define SMUL(a, b) _mm512_mul_ps((a), (b))
#define SLDF(fmt, p) ac_ld16((fmt), (p))
#define SLDFN(fmt, p, n) ac_ld16_m((fmt), (p), (__mmask16)((1u << (n)) - 1u))
#define SHSUM(a) ac_hsum16_avx512((a), 0)
#define SREDUCE(x) _mm512_reduce_add_ps(x)
#define SLDBF2(p, lo, hi) ac_ldbf2_16((p), (lo), (hi))
#define SLDQ4(p, lo, hi) ac_ldq4_16((p), (lo), (hi))
#define SLDQ4H(p, lo, hi) ac_ldq4_16h((p), (lo), (hi))
#define SSET2(a, b) ac_set2_16((a), (b))
#define SADD(a, b) _mm512_add_ps((a), (b))
#define SDEINT(a, b, e, o) ac_deint16((a), (b), (e), (o))
#define SINTER(e, o, a, b) ac_inter16((e), (o), (a), (b))
#define AC_SKEYMAJ(D) ((D) % 16 == 0 && (D) <= 128)
#include "ac_small_impl.inc"

/* AVX2 */
#define AC_SISA avx2
#define AC_STGT AC_TGT_AVX2
#define AC_SFN_ATTR __attribute__((aligned(64)))
#define SVEC __m256
#define AC_SW 8
#define SZERO() _mm256_setzero_ps()
#define SLOAD(p) _mm256_loadu_ps(p)
#define SLOADN(p, n) ac_ld8_n(AC_SE_F32, (p), (n))
#define SSTORE(p, x) _mm256_storeu_ps((p), (x))
#define SSTOREN(p, x, n) ac_st8_n((p), (x), (n))
#define SSET1(x) _mm256_set1_ps(x)
#define SFMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define SMUL(a, b) _mm256_mul_ps((a), (b))
#define SLDF(fmt, p) ac_ld8((fmt), (p))
#define SLDFN(fmt, p, n) ac_ld8_n((fmt), (p), (n))
#define SHSUM(a) ac_hsum8_avx2((a), 0)
#define SREDUCE(x) ac_hsum1_avx2(x)
#define SLDBF2(p, lo, hi) ac_ldbf2_8((p), (lo), (hi))
#define SLDQ4(p, lo, hi) ac_ldq4_8((p), (lo), (hi))
#define SLDQ4H(p, lo, hi) ac_ldq4_8((p), (lo), (hi))
#define SSET2(a, b) _mm256_set1_ps(a)
#define SADD(a, b) _mm256_add_ps((a), (b))
#define SDEINT(a, b, e, o) ac_deint8((a), (b), (e), (o))
#define SINTER(e, o, a, b) ac_inter8((e), (o), (a), (b))
#define AC_SKEYMAJ(D) 0
#include "ac_small_impl.inc"

/* the products of operand format fmt (AC_SE_*) on the AVX-512 (avx512
 * set) or the AVX2 path */
static void ac_scores_small_x86(int avx512, int fmt, int nq, int nk, int D, float scale,
                                const float *q, ptrdiff_t q_rs, const void *k, ptrdiff_t k_rs,
                                const float *ks, ptrdiff_t ks_rs, float *S, int ldS,
                                const void *kn)
{
    (avx512 ? ac_scores_small_avx512 : ac_scores_small_avx2)[fmt](
        nq, nk, D, scale, q, q_rs, k, k_rs, ks, ks_rs, S, ldS, kn);
}

static void ac_pv_small_x86(int avx512, int fmt, int nq, int nk, int Dv, const float *S,
                            int ldS, const void *v, ptrdiff_t v_rs, const float *vsc,
                            ptrdiff_t vs_rs, float *acc, int first, const void *vn)
{
    (avx512 ? ac_pv_small_avx512 : ac_pv_small_avx2)[fmt](
        nq, nk, Dv, S, ldS, v, v_rs, vsc, vs_rs, acc, first, vn);
}
/* 4-bit keys / values (ac_small_impl.inc: ac_scores_small_q4 /
 * ac_pv_small_q4; their group size gs a multiple of 16) */
static void ac_scores_small_q4_x86(int avx512, int nq, int nk, int D, int gs, float scale,
                                   const float *q, ptrdiff_t q_rs, const uint8_t *k,
                                   ptrdiff_t krb, const uint16_t *sp, ptrdiff_t sp_rs, float *S,
                                   int ldS)
{
    (avx512 ? ac_scores_small_q4_avx512 : ac_scores_small_q4_avx2)(
        nq, nk, D, gs, scale, q, q_rs, k, krb, sp, sp_rs, S, ldS);
}

static void ac_pv_small_q4_x86(int avx512, int nq, int nk, int Dv, int gs, const float *S,
                               int ldS, const uint8_t *v, ptrdiff_t vrb, const uint16_t *sp,
                               ptrdiff_t sp_rs, float *acc, int first)
{
    (avx512 ? ac_pv_small_q4_avx512 : ac_pv_small_q4_avx2)(
        nq, nk, Dv, gs, S, ldS, v, vrb, sp, sp_rs, acc, first);
}
#endif /* AC_HAVE_X86 */

#if AC_HAVE_NEON
/* aarch64: the same body on 128-bit NEON vectors (4 float lanes; NEON is
 * the AArch64 baseline, so no target attribute).  One query row scores 4
 * keys at a time, two accumulators each (AC_SACC2: even / odd vectors of
 * columns, 8 independent FMA chains); the sums reduced by a transposing tree of 3 vpaddq_f32
 * (ac_hsum4_neon);
 * P.V keeps up to 16 vectors (64 columns) of accumulators for one row.
 * Partial vectors go through a small buffer (NEON has no masked loads). */

/* 4 elements at p (fmt, a compile-time constant in every caller) as
 * floats: float32 a load, bfloat16 a widening shift (the bits are the
 * float's high half), float16 a conversion (fcvtl), int8 a sign extension
 * by two widening moves and a conversion (the row's scale is applied to
 * the sum) */
static AC_SINLINE float32x4_t ac_ld4(int fmt, const void *p)
{
    if (fmt == AC_SE_F32)
        return vld1q_f32((const float *)p);
    if (fmt == AC_SE_BF16)
        return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16((const uint16_t *)p), 16));
    if (fmt == AC_SE_F16)
        return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16((const uint16_t *)p)));
    uint32_t w;
    memcpy(&w, p, 4); /* 4 bytes: never past the row; one ldr s (a dup
                         of them cost one more instruction a vector) */
    const int16x8_t h = vmovl_s8(vcreate_s8((uint64_t)w));
    return vcvtq_f32_s32(vmovl_s16(vget_low_s16(h)));
}

/* the first n < 4 elements at p as floats (the rest 0) */
static AC_SINLINE float32x4_t ac_ld4_n(int fmt, const void *p, int n)
{
    unsigned char tmp[16] = {0};
    memcpy(tmp, p, ac_se_size(fmt) * (size_t)n);
    return ac_ld4(fmt, tmp);
}

static AC_SINLINE void ac_st4_n(float *p, float32x4_t x, int n)
{
    float tmp[4];
    vst1q_f32(tmp, x);
    memcpy(p, tmp, sizeof(float) * (size_t)n);
}

/* bfloat16 pairs: 8 elements at p as two vectors, lo the even-numbered
 * elements, hi the odd-numbered (one load, a shift and a mask; see
 * ac_ldbf2_8) */
static AC_SINLINE void ac_ldbf2_4(const void *p, float32x4_t *lo, float32x4_t *hi)
{
    const uint32x4_t x = vld1q_u32((const uint32_t *)p);
    *lo = vreinterpretq_f32_u32(vshlq_n_u32(x, 16));
    *hi = vreinterpretq_f32_u32(vandq_u32(x, vdupq_n_u32(0xFFFF0000u)));
}

/* the elements of (a, b) -- 8 consecutive floats -- as (even, odd)
 * vectors, and back */
static AC_SINLINE void ac_deint4(float32x4_t a, float32x4_t b, float32x4_t *e,
                                 float32x4_t *o)
{
    *e = vuzp1q_f32(a, b);
    *o = vuzp2q_f32(a, b);
}

static AC_SINLINE void ac_inter4(float32x4_t e, float32x4_t o, float32x4_t *a,
                                 float32x4_t *b)
{
    *a = vzip1q_f32(e, o);
    *b = vzip2q_f32(e, o);
}

/* lane i: the sum of a[i]'s lanes, for the 4 vectors a[] (pairwise adds:
 * (a0 a1) -> a0's and a1's half sums, then the whole sums) */
static AC_SINLINE float32x4_t ac_hsum4_neon(const float32x4_t *a)
{
    return vpaddq_f32(vpaddq_f32(a[0], a[1]), vpaddq_f32(a[2], a[3]));
}

#define AC_SISA neon
#define AC_STGT
#define AC_SFN_ATTR __attribute__((aligned(64)))
#define SVEC float32x4_t
#define AC_SW 4
#define SZERO() vdupq_n_f32(0.0f)
#define SLOAD(p) vld1q_f32(p)
#define SLOADN(p, n) ac_ld4_n(AC_SE_F32, (p), (n))
#define SSTORE(p, x) vst1q_f32((p), (x))
#define SSTOREN(p, x, n) ac_st4_n((p), (x), (n))
#define SSET1(x) vdupq_n_f32(x)
#define SFMA(a, b, c) vfmaq_f32((c), (a), (b))
#define SMUL(a, b) vmulq_f32((a), (b))
#define SLDF(fmt, p) ac_ld4((fmt), (p))
#define SLDFN(fmt, p, n) ac_ld4_n((fmt), (p), (n))
#define SHSUM(a) ac_hsum4_neon(a)
#define SREDUCE(x) vaddvq_f32(x)
#define SLDBF2(p, lo, hi) ac_ldbf2_4((p), (lo), (hi))
#define SDEINT(a, b, e, o) ac_deint4((a), (b), (e), (o))
#define SINTER(e, o, a, b) ac_inter4((e), (o), (a), (b))
/* not key-major: with the row in registers (D <= 32 here) each key is
 * one chain of FMAs, and the unrolled block's guards cost more than the
 * column loop's two accumulators per key (llvm-mca, D 64: 66.7 against
 * 48.6 cycles per 4 keys on apple-m1, 107 / 105 on neoverse-n1) */
#define AC_SKEYMAJ(D) 0
#define AC_SIDX ptrdiff_t
/* 8 accumulators for one row: 2 per key (4-cycle FMA latency, 2 pipes) */
#define AC_SACC2 1
#define SADD(a, b) vaddq_f32((a), (b))
#include "ac_small_impl.inc"

/* the products of operand format fmt (AC_SE_*) on the neon path */
static AC_UNUSED void ac_scores_small_neon_fmt(int fmt, int nq, int nk, int D, float scale,
                                               const float *q, ptrdiff_t q_rs, const void *k,
                                               ptrdiff_t k_rs, const float *ks,
                                               ptrdiff_t ks_rs, float *S, int ldS,
                                               const void *kn)
{
    ac_scores_small_neon[fmt](nq, nk, D, scale, q, q_rs, k, k_rs, ks, ks_rs, S, ldS, kn);
}

static AC_UNUSED void ac_pv_small_neon_fmt(int fmt, int nq, int nk, int Dv, const float *S,
                                           int ldS, const void *v, ptrdiff_t v_rs,
                                           const float *vsc, ptrdiff_t vs_rs, float *acc,
                                           int first, const void *vn)
{
    ac_pv_small_neon[fmt](nq, nk, Dv, S, ldS, v, v_rs, vsc, vs_rs, acc, first, vn);
}
#endif /* AC_HAVE_NEON */

#endif /* AC_SMALL_H */
