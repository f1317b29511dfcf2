/*
 * ac_sdpa.h -- flash-style scaled dot-product attention, one (query block,
 * key range) at a time.
 *
 * The Cython driver (_sdpa.pyx) splits the problem into work items, hands
 * each OpenMP thread its own scratch, and calls these functions; they never
 * allocate, never touch Python, and never start threads (BLAS is kept
 * single-threaded by the driver while they run).
 *
 * Per query block and per key block of width Bk:
 *   S    = scale * Q_blk K_blk^T                      (gemm)
 *   S    = mask / causal applied, masked entries -> -inf
 *   m'   = max(m, rowmax S);  P = exp(S - m');  l = l * exp(m - m') + rowsum P
 *   acc  = acc * exp(m - m') + P V_blk                (gemm)
 * and finally out = acc / l.  A row with no key to attend (decided by the
 * mask / causal structure: l stays exactly 0) gives 0; a NaN among the
 * scores that take part marks the row, which then comes out NaN.
 *
 * Everything is row-major.  Row strides are in elements; the last dimension
 * of q, k, v is contiguous.  The mask (bool as uint8, or additive float) is
 * addressed with arbitrary element strides so broadcast masks (stride 0) are
 * read in place, never expanded.
 */
#ifndef AC_SDPA_H
#define AC_SDPA_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <math.h>
#include "ac_common.h"
#include "ac_math.h"
#include "ac_small.h"
#include "ac_half.h"
#include "ac_bf16dot.h"
#include "ac_int8dot.h"

enum { AC_MASK_NONE = 0, AC_MASK_BOOL = 1, AC_MASK_ADD = 2 };
/* AC_ALIGN_LOWER_RIGHT: no causal bound, but the window aligned lower-right
   (off = M - N), flash-attention's convention for its window (varlen) */
enum { AC_CAUSAL_NONE = 0, AC_CAUSAL_UPPER_LEFT = 1, AC_CAUSAL_LOWER_RIGHT = 2,
       AC_ALIGN_LOWER_RIGHT = 3 };

typedef struct {
    int N, M, D, Dv;          /* query rows, key rows, qk dim, value dim     */
    int Bq, Bk;               /* tile sizes                                  */
    ptrdiff_t s_len;          /* floats of score scratch per thread (the
                                 fused kernel's panel scratch included)    */
    int ldS;                  /* row stride of the score tile: Bk rounded up
                                 to 64 bytes, so that every row starts
                                 aligned and the vectorized reductions sum
                                 in the same order whatever the buffer     */
    ptrdiff_t q_rs, k_rs, v_rs;   /* row strides (elements)                  */
    ptrdiff_t mask_rs, mask_cs;   /* mask strides (elements; 0 = broadcast)  */
    int mask_kind;            /* AC_MASK_*                                   */
    int causal;               /* AC_CAUSAL_*                                 */
    int win_l, win_r;         /* sliding window: query i attends keys
                                 i + off - win_l .. i + off + win_r (-1: no
                                 bound on that side); off = M - N under
                                 lower-right causal alignment, else 0      */
    int band;                 /* causal or a window bound: rows see a band */
    double scale;
    double softcap;           /* > 0: s -> softcap tanh(s / softcap) after
                                 scaling, before the mask; 0: none         */
    int kq8, vq8;             /* key / value given as int8 + a scale per
                                 row: the k / v pointers then point at
                                 int8_t data, the scales come separately */
    ptrdiff_t ks_rs, vs_rs;   /* row strides of the scales (elements)      */
    int kq4, vq4;             /* key / value given as 4-bit codes (the
                                 group size; 0: not): the k / v pointers
                                 point at uint8_t codes, two per byte
                                 (even element low; row strides in bytes),
                                 the scales at per row D / kq4 float16
                                 (scale, offset) pairs, each pair one
                                 float32 slot (ks_rs / vs_rs: slots per
                                 row); kq8 / vq8 are then 0.  float32
                                 calls only                               */
    ptrdiff_t dq_off;         /* offset (elements) in the score scratch of
                                 the dequantized key / value tile buffers  */
    int qh, kh, vh;           /* AC_H_BF16 / AC_H_F16: that operand is
                                 bfloat16 / float16, read in place (its
                                 pointer points at uint16_t data, strides
                                 in its own elements); AC_H_NONE: the
                                 compute dtype                             */
    ptrdiff_t qb_off;         /* offset in the score scratch of the query
                                 block buffer (half queries: max(Bq, 32)
                                 rows x D)                                 */
    int alibi_on;             /* ALiBi: score(i, j) -= alibi * |i + M - N - j|
                                 (alibi: this batch element's slope)      */
    double alibi;
    double sink;              /* attention sink logit of this batch
                                 element: exp(sink) joins every row's
                                 softmax denominator; -inf for none       */
    int bf16dot;              /* fused AVX-512 kernel with bfloat16 dot
                                 products: 1 vdpbf16ps, 2 the same in
                                 AVX-512F (tests), 0 float32 products; on
                                 the AVX2 path under int8 Q.K^T (qk8 4 -
                                 6), int16 P.V: 3 vpdpwssd (AVX-VNNI), 4
                                 the same sums in AVX2 (ac_int8dot.h)      */
    ptrdiff_t bf_off;         /* offset in the score scratch of the packed
                                 bfloat16 chunk (ac_bf16dot.h)            */
    int qk8;                  /* precision="int8": the q pointer points at
                                 int8 query rows (scales in qsc), the keys
                                 are int8 (kq8, ks_rs = 2: per key its
                                 scale and 128 sum k8); 1 vpdpbusd, 2 its
                                 AVX-512BW spelling (tests), 3 products of
                                 the dequantized rows (other paths); on
                                 the AVX2 path 4 vpmaddubsw (sign trick),
                                 5 AVX-VNNI vpdpbusd, 6 its AVX2 spelling
                                 (ac_int8dot.h, AC_QK8_*)                  */
    const float *qsc;         /* the query rows' scales of this batch
                                 element (qk8)                             */
    ptrdiff_t mp_off;         /* offset in the score scratch of the fused
                                 kernel's per-panel state when a block's
                                 panels share converted key / value tiles
                                 or take turns over chunks of float32 keys
                                 (kchunk): ceil(Bq / 16) x (32 D + 64)
                                 floats                                    */
    int kvcopy;               /* the fused kernel copies the float32 rows
                                 of each query block once for all its
                                 panels, rows in place not contiguous (a
                                 head view of a projection): 1 the values,
                                 2 the keys (attncore._call.plan;
                                 ac_size_kvcopy)                          */
    int kchunk;               /* float32 keys / values of the fused kernel:
                                 > 0, a query block's panels take turns
                                 over chunks of this many keys (each chunk
                                 read from memory once for all of them,
                                 then from L2); 0, each panel runs over
                                 all the block's keys (ac_size_kvcopy)    */
    ptrdiff_t kbase;          /* the index of key 0 of k / v among the
                                 keys of the sequence (a paged range: the
                                 keys of [kbase, kbase + M) given from
                                 there): the fused kernel's tiles and
                                 chunks lie on a grid from the sequence's
                                 key 0, so that where a range starts -- a
                                 query block's first visible key, with the
                                 block size (the thread count) -- changes
                                 no result                                */
    int resume;               /* 1: ac_sdpa_range continues the running
                                 state (acc, m, l, bad) of an earlier range
                                 of the same rows instead of starting one
                                 (a paged sequence's blocks, read in place
                                 one after the other); never the fused
                                 kernel's (such a call takes the direct
                                 loops / BLAS)                            */
    const void *knext, *vnext; /* the key / value rows (same format and row
                                 strides as k / v) of the range the caller
                                 runs next, or NULL: the small-row loops'
                                 prefetch runs on into them in the last
                                 tile (a paged block's rows, a 4 KiB
                                 multiple apart, each on its own page: no
                                 hardware prefetcher runs ahead across
                                 them)                                    */
} ac_params;

/* rows [0, nk) of an int8 tile (row stride x_rs) times their scales (row
   stride s_rs) into out (nk x D, dense) */
#define AC_DEQUANT(T, x, x_rs, sc, s_rs, nk, D, out)                         \
    do {                                                                    \
        for (int c_ = 0; c_ < (nk); c_++) {                                 \
            const int8_t *xr_ = (x) + (ptrdiff_t)c_ * (x_rs);              \
            const T s_ = (sc)[(ptrdiff_t)c_ * (s_rs)];                      \
            T *o_ = (out) + (ptrdiff_t)c_ * (D);                            \
            _Pragma("omp simd")                                             \
            for (int d_ = 0; d_ < (D); d_++) o_[d_] = s_ * (T)xr_[d_];      \
        }                                                                   \
    } while (0)

/* rows [0, nk) of a 4-bit tile (codes of row stride x_rs bytes; per row
   D / gs float16 (scale, offset) pairs at sp, row stride s_rs pairs) into
   out (nk x D, dense): s c + o */
#define AC_DEQUANT4(T, x, x_rs, sp, s_rs, nk, D, gs, out)                    \
    do {                                                                    \
        for (int c_ = 0; c_ < (nk); c_++) {                                 \
            const uint8_t *xr_ = (x) + (ptrdiff_t)c_ * (x_rs);             \
            const uint16_t *pr_ = (sp) + (ptrdiff_t)c_ * (s_rs) * 2;        \
            T *o_ = (out) + (ptrdiff_t)c_ * (D);                            \
            for (int g_ = 0; g_ < (D) / (gs); g_++) {                       \
                const T s_ = (T)ac_f16_f32(pr_[2 * g_]);                    \
                const T z_ = (T)ac_f16_f32(pr_[2 * g_ + 1]);                \
                for (int d_ = g_ * (gs); d_ < (g_ + 1) * (gs); d_++)        \
                    o_[d_] = s_ * (T)((xr_[d_ >> 1] >> ((d_ & 1) * 4)) & 15) + z_; \
            }                                                               \
        }                                                                   \
    } while (0)

/* the alignment offset of the causal diagonal and of the window */
static inline ptrdiff_t ac_band_off(const ac_params *p)
{
    return (p->causal == AC_CAUSAL_LOWER_RIGHT || p->causal == AC_ALIGN_LOWER_RIGHT)
        ? (ptrdiff_t)p->M - (ptrdiff_t)p->N : 0;
}

/* the right edge of the band, relative to the diagonal: -1 for none */
static inline ptrdiff_t ac_band_right(const ac_params *p)
{
    ptrdiff_t e = (p->causal == AC_CAUSAL_UPPER_LEFT || p->causal == AC_CAUSAL_LOWER_RIGHT)
        ? 0 : -1;
    if (p->win_r >= 0 && (e < 0 || p->win_r < e)) e = p->win_r;
    return e;
}

/* first key column a query row may not see (exclusive limit; M without an
   upper bound) */
static inline ptrdiff_t ac_causal_limit(const ac_params *p, ptrdiff_t i)
{
    const ptrdiff_t e = ac_band_right(p);
    if (e < 0) return p->M;
    const ptrdiff_t lim = i + ac_band_off(p) + e + 1;
    return lim < p->M ? lim : p->M;
}

/* first key column a query row may see (0 without a lower bound) */
static inline ptrdiff_t ac_band_lo(const ac_params *p, ptrdiff_t i)
{
    if (p->win_l < 0) return 0;
    const ptrdiff_t lo = i + ac_band_off(p) - p->win_l;
    return lo > 0 ? lo : 0;
}

/* keys [*ks, *ke) narrowed to those some row of [i0, i0 + n) may see under
   the causal / window band (unchanged without one; *ke may end below *ks) */
static inline void ac_band_keys(const ac_params *p, ptrdiff_t i0, ptrdiff_t n,
                                ptrdiff_t *ks, ptrdiff_t *ke)
{
    if (!p->band) return;
    const ptrdiff_t lim = ac_causal_limit(p, i0 + n - 1);
    if (lim < *ke) *ke = lim;
    const ptrdiff_t lo = ac_band_lo(p, i0);
    if (lo > *ks) *ks = lo;
}

/* the columns [*c0, *c1) of a tile of nk keys from key j0 that row i may
   see under the causal / window band (all of them without one) */
static inline void ac_band_cols(const ac_params *p, ptrdiff_t i, ptrdiff_t j0,
                                int nk, int *c0, int *c1)
{
    int a = 0, b = nk;
    if (p->band) {
        const ptrdiff_t lim = ac_causal_limit(p, i) - j0;
        if (lim < b) b = lim < 0 ? 0 : (int)lim;
        const ptrdiff_t lo = ac_band_lo(p, i) - j0;
        if (lo > a) a = lo > b ? b : (int)lo;
    }
    *c0 = a;
    *c1 = b;
}

/* a row's flag (bad) after a key range: 1 NaN (a NaN score, a +inf one);
   AC_BAD_OVF: finite operands whose attended scores all overflowed to -inf
   and no finite score in the range -- the row is NaN unless another key
   range of it gives a finite score (merges drop the flag then) */
#define AC_BAD_OVF 4

/* query blocks of at most this many rows use direct loops, not BLAS
   (the planner in attncore._call reads it: _sdpa.SMALL_ROWS) */
#ifndef AC_SMALL_ROWS
#define AC_SMALL_ROWS 4
#endif

/* query rows per panel of the fused kernel: two vectors of floats
   (attncore._call.plan reads them: _sdpa.PANEL_ROWS) */
#define AC_PANEL_ROWS_AVX512 32
#define AC_PANEL_ROWS_AVX2 16
#define AC_PANEL_ROWS_NEON 8
/* the fewest rows a panel of this build's paths has (the scratch for the
   panels of a query block is sized by it) */
#if AC_HAVE_NEON
#define AC_PANEL_ROWS_MIN AC_PANEL_ROWS_NEON
#else
#define AC_PANEL_ROWS_MIN AC_PANEL_ROWS_AVX2
#endif
/* whether the path in use has the fused kernel: the x86 paths, or neon */
#if AC_HAVE_NEON
#define AC_FUSED_ON (ac_neon_on)
#else
#define AC_FUSED_ON (ac_kernel_path != AC_PATH_PORTABLE)
#endif

/* the fused float32 kernel's entry, declared here and defined in
   ac_fused_x86.h (which uses the float helpers instantiated below) */
#define AC_FUSED_RANGE_F32                                                                 \
    int ac_fused_range_f32(const ac_params *p, const float *q, const float *k,             \
                           const float *v, const float *ksc, const float *vsc,             \
                           const uint8_t *mb, const float *mf, ptrdiff_t i0, int nq,       \
                           ptrdiff_t ks, ptrdiff_t ke, float *scratch, float *acc, float *m, \
                           float *l, int *bad)
static AC_FUSED_RANGE_F32;

/* instantiate for float and double */
#define AC_T float
#define AC_IS_F32 1
#define AC_SUF f32
#define AC_EXP ac_expf
#define AC_TANH tanhf
#define AC_GEMM_T ac_sgemm_t
#define AC_HALF_ROWS ac_half_rows_f32
#include "ac_sdpa_impl.inc"

/* the fused float32 kernel (uses the float helpers above) */
#include "ac_fused_x86.h"

#define AC_T double
#define AC_IS_F32 0
#define AC_SUF f64
#define AC_EXP ac_exp
#define AC_TANH tanh
#define AC_GEMM_T ac_dgemm_t
#define AC_HALF_ROWS ac_half_rows_f64
#include "ac_sdpa_impl.inc"

/* round a count of floats / doubles up to 64 bytes' worth of floats */
#define AC_ROUND16(n) (((n) + 15) / 16 * 16)

/*
 * The tile sizes and the layout of each thread's score scratch for these
 * operand formats: p->D, Dv, Bq, Bk, ldS, s_len (the scratch's length, in
 * elements of the compute dtype), kq8, vq8, qh, kh, vh, qk8, bf16dot, and
 * the offsets dq_off, qb_off, bf_off, mp_off (0 when not used); ks_rs,
 * vs_rs and qsc are cleared.  is64: the float64 kernel (no fused kernel);
 * have_ks / have_vs: int8 keys / values; q_fmt, k_fmt, v_fmt: AC_H_*;
 * bf16dot, qk8: the fused kernel's bfloat16 / int8 products (ac_params).
 *
 *   [0, s_len0)     the score tile (Bq x ldS), or the fused kernel's panel
 *                   scratch (AC_FUSED_SCRATCH) if larger
 *   dq_off          converted key / value tiles: max(Bk, AC_BK) rows of
 *                   D + Dv (int8 / half keys or values)
 *   qb_off          the converted query block or fused panel: max(Bq, 32)
 *                   rows of D (half or int8 queries)
 *   bf_off          the packed bfloat16 chunk (AC_BF16_CHUNK)
 *   mp_off          per fused panel of the block (panels of 16 rows at
 *                   least): AC_FUSED_PANEL_STATE (converted operands or
 *                   bfloat16 products, float32)
 * Every part starts 64 bytes after the one before it (AC_ROUND16).
 */
static AC_UNUSED void ac_size_scratch(ac_params *p, int D, int Dv, int Bq, int Bk, int is64,
                                      int have_ks, int have_vs, int q_fmt, int k_fmt,
                                      int v_fmt, int bf16dot, int qk8)
{
    const int conv = have_ks || have_vs || k_fmt || v_fmt;
    p->D = D;
    p->Dv = Dv;
    p->Bq = Bq;
    p->Bk = Bk;
    p->ldS = AC_ROUND16(Bk);
    p->s_len = (ptrdiff_t)Bq * p->ldS;
    if (!is64 && AC_FUSED_SCRATCH(D, Dv) > p->s_len) p->s_len = AC_FUSED_SCRATCH(D, Dv);
    p->s_len = AC_ROUND16(p->s_len);
    p->kq8 = have_ks;
    p->vq8 = have_vs;
    p->kq4 = 0;
    p->vq4 = 0;
    p->qh = q_fmt;
    p->kh = k_fmt;
    p->vh = v_fmt;
    p->dq_off = 0;
    p->qb_off = 0;
    p->ks_rs = 0;
    p->vs_rs = 0;
    if (conv) {
        /* converted key / value tile buffers after the score scratch */
        const ptrdiff_t dq_rows = Bk > AC_BK ? Bk : AC_BK;
        p->dq_off = p->s_len;
        p->s_len += AC_ROUND16(dq_rows * (D + Dv));
    }
    p->qk8 = qk8;
    p->qsc = NULL;
    if (q_fmt || qk8) {
        /* the converted query block (or fused panel: 32 rows at most) */
        const ptrdiff_t rows = Bq > AC_PANEL_ROWS_AVX512 ? Bq : AC_PANEL_ROWS_AVX512;
        p->qb_off = p->s_len;
        p->s_len += AC_ROUND16(rows * D);
    }
    p->bf16dot = bf16dot;
    p->bf_off = 0;
    if (bf16dot) {
        /* the packed bfloat16 chunk: K16, VI and the probability pairs */
        p->bf_off = p->s_len;
        p->s_len += AC_ROUND16(bf16dot >= 3 ? AC_PV16_CHUNK(Dv) : AC_BF16_CHUNK(D, Dv));
    }
    p->kvcopy = 0;
    p->kchunk = 0;
    p->kbase = 0;
    p->resume = 0;
    p->knext = NULL;
    p->vnext = NULL;
    p->mp_off = 0;
    if (!is64 && (conv || bf16dot)) {
        /* the fused kernel's panels sharing converted key / value tiles:
           packed queries and running statistics of each (panels of
           AC_PANEL_ROWS_MIN rows at least) */
        p->mp_off = p->s_len;
        p->s_len += (ptrdiff_t)((Bq + AC_PANEL_ROWS_MIN - 1) / AC_PANEL_ROWS_MIN) *
                    AC_FUSED_PANEL_STATE(D);
    }
}

/* The scratch of a call whose fused kernel copies its float32 key / value
 * rows (p->kvcopy, set after ac_size_scratch from the plan --
 * attncore._call.plan): each query block copies the rows of the keys it
 * may see, at most M, once for all its panels (ac_fused_range_f32): keys
 * (M x D) at dq_off, values (M x Dv) after them. */
static AC_UNUSED void ac_size_kvcopy(ac_params *p)
{
    if (p->dq_off || p->mp_off) p->kvcopy = 0; /* converted operands: not copied */
    if (p->mp_off) p->kchunk = 0;
    if (p->kchunk > 0) {
        /* float32 chunks shared by a block's panels: each panel's packed
           queries and running statistics between chunks */
        p->mp_off = p->s_len;
        p->s_len += (ptrdiff_t)((p->Bq + AC_PANEL_ROWS_MIN - 1) / AC_PANEL_ROWS_MIN) *
                    AC_FUSED_PANEL_STATE(p->D);
    }
    if (!p->kvcopy) return;
    p->dq_off = p->s_len;
    p->s_len += AC_ROUND16((ptrdiff_t)p->M * p->D) + AC_ROUND16((ptrdiff_t)p->M * p->Dv);
}

#endif /* AC_SDPA_H */
