/*
 * tools/neon_check.c -- the neon path's decode body against a float64
 * reference, for aarch64 (run by tools/neon_test.sh, cross-compiled and
 * run under qemu-aarch64; it also builds natively on any aarch64 machine:
 * gcc -O2 -Iattncore/_core/src tools/neon_check.c -lm).
 *
 * Part 1, the kernels: ac_scores_small_neon / ac_pv_small_neon (ac_small.h)
 * for float32, bfloat16, float16 and int8 (with per-row scales) operands,
 * and the portable path's loops (ac_scores_small_f32 / ac_pv_small_f32 of
 * ac_sdpa_impl.inc) on the same rows decoded to float32, over random data:
 * head sizes 1 - 256 (odd ones, tails of every length), 1 - 4 query rows
 * (a grouped-query head group), 0 - 100 keys, padded row strides, scales
 * of stride 1 and 2, first or accumulating P.V.  Each result is checked
 * against a float64 sum of the same (exactly decoded) elements, to the
 * float32 rounding bound of a sum of that many terms; the cells around the
 * results (padding) must be left untouched.
 *
 * Part 2, the dispatch: ac_sdpa_range_f32 + ac_sdpa_finish_f32 on one
 * block of 1 - 4 query rows with the neon body on (ac_neon_on, the neon
 * path) and off (the portable path), for every format of keys and values,
 * over several key tiles, with no mask, a boolean mask, an additive mask,
 * causal (lower-right) and a sliding window; each against a float64
 * softmax(q k^T scale + mask) v of the harness.
 *
 * Exits 1 on any mismatch (the first few are printed), else prints the
 * number of checks.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "ac_sdpa.h"

#if !AC_HAVE_NEON
#error "tools/neon_check.c is for aarch64 with NEON (aarch64-linux-gnu-gcc)"
#endif

static const char *FMT_NAME[4] = {"f32", "bf16", "f16", "int8"};
static long n_checks, n_fail;
static unsigned long long rng_state = 0x9E3779B97F4A7C15ull;

static double urand(void) /* [0, 1) */
{
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (double)(rng_state >> 11) / 9007199254740992.0;
}

static float frand(void) { return (float)(2.0 * urand() - 1.0); }

/* one element of format fmt from a float: stored at dst[i], and the exact
 * value it stands for returned (int8: a code in [-128, 127]) */
static double put_elem(int fmt, void *dst, ptrdiff_t i, float x)
{
    if (fmt == AC_SE_F32) {
        ((float *)dst)[i] = x;
        return x;
    }
    if (fmt == AC_SE_BF16) { /* round to nearest even */
        uint32_t u;
        memcpy(&u, &x, 4);
        u += 0x7FFFu + ((u >> 16) & 1u);
        const uint16_t h = (uint16_t)(u >> 16);
        ((uint16_t *)dst)[i] = h;
        const uint32_t w = (uint32_t)h << 16;
        float f;
        memcpy(&f, &w, 4);
        return f;
    }
    if (fmt == AC_SE_F16) {
        const __fp16 h = (__fp16)x;
        memcpy((uint16_t *)dst + i, &h, 2);
        return (double)(float)h;
    }
    int c = (int)lrint(x * 128.0f);
    c = c < -128 ? -128 : (c > 127 ? 127 : c);
    ((int8_t *)dst)[i] = (int8_t)c;
    return c;
}

/* |got - ref| within the float32 rounding of a sum of n terms whose
 * magnitudes add to mag (gamma_n = n u / (1 - n u), u = 2^-24, with room
 * for the scale and the conversions) */
static int close_to(double got, double ref, double mag, int n)
{
    const double u = 5.9604644775390625e-08, g = (n + 4) * u / (1 - (n + 4) * u);
    return fabs(got - ref) <= 2.0 * g * mag + 1e-30 && !isnan(got);
}

static void fail(const char *what, int fmt, int D, int nq, int nk, int r, int j, double got,
                 double ref)
{
    if (n_fail++ < 12)
        fprintf(stderr, "MISMATCH %s fmt=%s D=%d nq=%d nk=%d at (%d, %d): got %.9g want %.9g\n",
                what, FMT_NAME[fmt], D, nq, nk, r, j, got, ref);
}

#define SENT -12345.0f
#define PAD 3

/* one case of part 1: scores and P.V of nq rows over nk keys of D / Dv
 * columns, format fmt; the neon body (neon 1) or the portable loops on the
 * decoded rows (neon 0) */
static void kernel_case(int neon, int fmt, int D, int nq, int nk, int ss, int first)
{
    const int Dv = D, ldS = nk + PAD;
    const ptrdiff_t q_rs = D + PAD, k_rs = D + 1, es = (ptrdiff_t)ac_se_size(fmt);
    const float scale = 0.37f;
    float *q = malloc(sizeof(float) * (size_t)(4 * q_rs + 1));
    void *k = malloc((size_t)((nk + 1) * k_rs * es + 16));
    void *v = malloc((size_t)((nk + 1) * k_rs * es + 16));
    double *kd = malloc(sizeof(double) * (size_t)(nk * D + 1));
    double *vd = malloc(sizeof(double) * (size_t)(nk * D + 1));
    float *kf = malloc(sizeof(float) * (size_t)(nk * D + 1));
    float *vf = malloc(sizeof(float) * (size_t)(nk * D + 1));
    float *ks = malloc(sizeof(float) * (size_t)(ss * nk + 1));
    float *vs = malloc(sizeof(float) * (size_t)(ss * nk + 1));
    float *S = malloc(sizeof(float) * (size_t)(4 * ldS + PAD));
    float *acc = malloc(sizeof(float) * (size_t)(4 * Dv + PAD));
    float *acc0 = malloc(sizeof(float) * (size_t)(4 * Dv + PAD));
    for (int i = 0; i < 4 * q_rs; i++) q[i] = frand();
    for (int j = 0; j < nk; j++) {
        ks[j * ss] = fmt == AC_SE_I8 ? (float)(0.5 + urand()) / 128.0f : 1.0f;
        vs[j * ss] = fmt == AC_SE_I8 ? (float)(0.5 + urand()) / 128.0f : 1.0f;
        for (int d = 0; d < D; d++) {
            kd[j * D + d] = put_elem(fmt, k, j * k_rs + d, frand());
            vd[j * D + d] = put_elem(fmt, v, j * k_rs + d, frand());
            kf[j * D + d] = (float)kd[j * D + d] * ks[j * ss];
            vf[j * D + d] = (float)vd[j * D + d] * vs[j * ss];
        }
    }
    for (int i = 0; i < 4 * ldS + PAD; i++) S[i] = SENT;
    for (int i = 0; i < 4 * Dv + PAD; i++) acc[i] = acc0[i] = i < nq * Dv ? frand() : SENT;
    if (neon)
        /* kn / vn (the rows read next, prefetched: no result changes): the
           same rows again in every other case */
        ac_scores_small_neon[fmt](nq, nk, D, scale, q, q_rs, k, k_rs, ks, ss, S, ldS,
                                  first ? k : NULL);
    else
        ac_scores_small_f32(nq, nk, D, scale, q, q_rs, kf, D, S, ldS);
    for (int r = 0; r < 4; r++)
        for (int j = 0; j < ldS; j++) {
            const float got = S[r * ldS + j];
            n_checks++;
            if (r >= nq || j >= nk) {
                if (got != SENT) fail(neon ? "neon scores pad" : "portable scores pad", fmt,
                                      D, nq, nk, r, j, got, SENT);
                continue;
            }
            double ref = 0, mag = 0;
            for (int d = 0; d < D; d++) {
                ref += (double)q[r * q_rs + d] * kd[j * D + d];
                mag += fabs((double)q[r * q_rs + d] * kd[j * D + d]);
            }
            const double sc = (double)scale * ks[j * ss];
            if (!close_to(got, ref * sc, mag * fabs(sc), D))
                fail(neon ? "neon scores" : "portable scores", fmt, D, nq, nk, r, j, got,
                     ref * sc);
        }
    /* P.V: the scores as probabilities (any values will do) */
    if (neon)
        ac_pv_small_neon[fmt](nq, nk, Dv, S, ldS, v, k_rs, vs, ss, acc, first,
                              first ? v : NULL);
    else
        ac_pv_small_f32(nq, nk, Dv, S, ldS, vf, Dv, acc, first);
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < Dv; c++) {
            const float got = acc[r * Dv + c];
            n_checks++;
            if (r >= nq) {
                if (got != SENT) fail(neon ? "neon pv pad" : "portable pv pad", fmt, D, nq,
                                      nk, r, c, got, SENT);
                continue;
            }
            double ref = first ? 0 : acc0[r * Dv + c], mag = fabs(ref);
            for (int j = 0; j < nk; j++) {
                const double t = (double)S[r * ldS + j] * vs[j * ss] * vd[j * D + c];
                ref += t;
                mag += fabs(t);
            }
            if (!close_to(got, ref, mag, nk + 2))
                fail(neon ? "neon pv" : "portable pv", fmt, D, nq, nk, r, c, got, ref);
        }
    if (acc[4 * Dv] != SENT) fail("pv tail pad", fmt, D, nq, nk, 4, 0, acc[4 * Dv], SENT);
    free(q); free(k); free(v); free(kd); free(vd); free(kf); free(vf); free(ks); free(vs);
    free(S); free(acc); free(acc0);
}

static void part1(void)
{
    static const int Ds[] = {1, 3, 4, 5, 7, 8, 12, 16, 17, 31, 32, 33, 40, 63, 64, 65, 80, 96,
                             100, 127, 128, 129, 160, 256};
    static const int NKs[] = {0, 1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 33, 100};
    for (int fmt = 0; fmt < 4; fmt++)
        for (size_t a = 0; a < sizeof Ds / sizeof *Ds; a++)
            for (int nq = 1; nq <= 4; nq++)
                for (size_t b = 0; b < sizeof NKs / sizeof *NKs; b++)
                    for (int neon = 0; neon < 2; neon++)
                        kernel_case(neon, fmt, Ds[a], nq, NKs[b], 1 + (int)(b % 2),
                                    (int)((a + b + nq) % 2));
}

static void no_gemm(char *ta, char *tb, int *m, int *n, int *k, float *al, float *a, int *lda,
                    float *b, int *ldb, float *be, float *c, int *ldc)
{
    (void)ta; (void)tb; (void)m; (void)n; (void)k; (void)al; (void)a; (void)lda; (void)b;
    (void)ldb; (void)be; (void)c; (void)ldc;
    fprintf(stderr, "BLAS called for a small block\n");
    exit(2);
}

/* the mask kinds of part 2 */
enum { MK_NONE, MK_BOOL, MK_ADD, MK_CAUSAL, MK_WINDOW, MK_COUNT };
static const char *MK_NAME[MK_COUNT] = {"none", "bool", "additive", "causal", "window"};

/* one case of part 2: rows [i0, i0 + nq) of N query rows over M keys, keys
 * of format kf, values of format vf; the output of the neon path (neon 1)
 * or the portable path against a float64 softmax */
static void range_case(int neon, int kfm, int vfm, int D, int N, int M, int i0, int nq,
                       int mk, double cap, double slope)
{
    ac_params p;
    memset(&p, 0, sizeof p);
    const int Dv = D + 4, Bk = 32;
    const int kh = kfm == AC_SE_BF16 || kfm == AC_SE_F16 ? kfm : 0;
    const int vh = vfm == AC_SE_BF16 || vfm == AC_SE_F16 ? vfm : 0;
    ac_size_scratch(&p, D, Dv, nq > 4 ? nq : 4, Bk, 0, kfm == AC_SE_I8, vfm == AC_SE_I8, 0, kh,
                    vh, 0, 0);
    p.N = N;
    p.M = M;
    p.q_rs = D;
    p.k_rs = D + 2;
    p.v_rs = Dv + 1;
    p.ks_rs = p.vs_rs = 1;
    p.win_l = p.win_r = -1;
    p.scale = 1.0 / sqrt((double)D);
    p.sink = -INFINITY;
    p.mask_kind = mk == MK_BOOL ? AC_MASK_BOOL : (mk == MK_ADD ? AC_MASK_ADD : AC_MASK_NONE);
    p.mask_rs = M;
    p.mask_cs = 1;
    if (mk == MK_CAUSAL) p.causal = AC_CAUSAL_LOWER_RIGHT;
    if (mk == MK_WINDOW) p.win_l = 5, p.win_r = 3;
    p.band = mk == MK_CAUSAL || mk == MK_WINDOW;
    p.softcap = cap;
    p.alibi_on = slope != 0;
    p.alibi = slope;
    float *q = malloc(sizeof(float) * (size_t)(N * D));
    char *k = malloc((size_t)(M * p.k_rs) * ac_se_size(kfm) + 16);
    char *v = malloc((size_t)(M * p.v_rs) * ac_se_size(vfm) + 16);
    double *kd = malloc(sizeof(double) * (size_t)(M * D)), *vd = malloc(sizeof(double) * (size_t)(M * Dv));
    float *ksc = malloc(sizeof(float) * (size_t)M), *vsc = malloc(sizeof(float) * (size_t)M);
    uint8_t *mb = malloc((size_t)(N * M));
    float *mf = malloc(sizeof(float) * (size_t)(N * M));
    for (int i = 0; i < N * D; i++) q[i] = 2 * frand();
    for (int j = 0; j < M; j++) {
        ksc[j] = kfm == AC_SE_I8 ? (float)(0.5 + urand()) / 64.0f : 1.0f;
        vsc[j] = vfm == AC_SE_I8 ? (float)(0.5 + urand()) / 64.0f : 1.0f;
        for (int d = 0; d < D; d++)
            kd[j * D + d] = put_elem(kfm, k, j * p.k_rs + d, 2 * frand()) * ksc[j];
        for (int d = 0; d < Dv; d++)
            vd[j * Dv + d] = put_elem(vfm, v, j * p.v_rs + d, frand()) * vsc[j];
    }
    for (int i = 0; i < N * M; i++) {
        mb[i] = urand() < 0.7;
        mf[i] = urand() < 0.2 ? -INFINITY : (float)(urand() - 0.5);
    }
    float *S = aligned_alloc(64, sizeof(float) * (size_t)(p.s_len + 16));
    float *acc = malloc(sizeof(float) * (size_t)(nq * Dv)), *out = malloc(sizeof(float) * (size_t)(nq * Dv));
    float *m = malloc(sizeof(float) * (size_t)nq * 3), *l = m + nq, *alpha = l + nq;
    int *bad = malloc(sizeof(int) * (size_t)nq);
    ac_set_kernel_path(neon ? AC_PATH_NEON : AC_PATH_PORTABLE);
    const int any = ac_sdpa_range_f32(&p, q, (const float *)(const void *)k,
                                      (const float *)(const void *)v, ksc, vsc,
                                      mk == MK_BOOL ? mb : NULL, mk == MK_ADD ? mf : NULL, i0, nq,
                                      0, M, S, acc, m, l, alpha, bad, no_gemm);
    ac_sdpa_finish_f32(nq, Dv, any, acc, l, bad, out, Dv, m, p.sink);
    for (int r = 0; r < nq; r++) {
        const int i = i0 + r;
        double mx = -INFINITY, sum = 0;
        double *s = malloc(sizeof(double) * (size_t)(M + 1));
        for (int j = 0; j < M; j++) {
            double t = 0;
            for (int d = 0; d < D; d++) t += (double)q[i * D + d] * kd[j * D + d];
            t *= p.scale;
            if (cap > 0) t = cap * tanh(t / cap);
            if (slope != 0) t -= slope * fabs((double)(i + M - N - j));
            int c0, c1;
            ac_band_cols(&p, i, j, 1, &c0, &c1);
            if (c1 <= c0 || (mk == MK_BOOL && !mb[i * M + j])) t = -INFINITY;
            if (mk == MK_ADD) t += mf[i * M + j];
            s[j] = t;
            if (t > mx) mx = t;
        }
        for (int j = 0; j < M; j++) sum += s[j] = mx == -INFINITY ? 0 : exp(s[j] - mx);
        for (int c = 0; c < Dv; c++) {
            double o = 0, mag = 0;
            for (int j = 0; j < M; j++) {
                o += s[j] * vd[j * Dv + c];
                mag += fabs(s[j] * vd[j * Dv + c]);
            }
            o = sum > 0 ? o / sum : 0;
            mag = sum > 0 ? mag / sum : 0;
            const double got = out[r * Dv + c];
            n_checks++;
            /* float32 scores through exp: a relative 1e-5 of the weights */
            if (!(fabs(got - o) <= 5e-5 * mag + 1e-7))
                if (n_fail++ < 12)
                    fprintf(stderr,
                            "MISMATCH range %s k=%s v=%s mask=%s cap=%g alibi=%g D=%d M=%d "
                            "rows %d+%d at (%d, %d): got %.9g want %.9g\n",
                            neon ? "neon" : "portable", FMT_NAME[kfm], FMT_NAME[vfm],
                            MK_NAME[mk], cap, slope, D, M, i0, nq, r, c, got, o);
        }
        free(s);
    }
    free(q); free(k); free(v); free(kd); free(vd); free(ksc); free(vsc); free(mb); free(mf);
    free(S); free(acc); free(out); free(m); free(bad);
}

static void part2(void)
{
    static const int Ds[] = {8, 13, 64, 96, 128};
    static const int Ms[] = {1, 5, 31, 32, 70, 129};
    for (int kfm = 0; kfm < 4; kfm++)
        for (int vfm = 0; vfm < 4; vfm++)
            for (size_t a = 0; a < sizeof Ds / sizeof *Ds; a++)
                for (size_t b = 0; b < sizeof Ms / sizeof *Ms; b++)
                    for (int mk = 0; mk < MK_COUNT; mk++) {
                        const int nq = 1 + (int)((a + b + (size_t)mk) % 4), N = 6;
                        const int i0 = (int)(b % 3);
                        for (int neon = 0; neon < 2; neon++)
                            range_case(neon, kfm, vfm, Ds[a], N, Ms[b], i0, nq, mk, 0, 0);
                    }
}

/* Part 3, the fused panels on the neon path (ac_fused_panel_f32_neon /
 * _neonh through ac_sdpa_range_f32): blocks of 5 - 40 query rows (whole
 * 8-row panels, a 4-row half panel, and the last rows left to the direct
 * loops), keys over several tiles, every mask kind, a soft cap and ALiBi,
 * every key / value format (int8 and half rows converted per chunk) */
static void part3(void)
{
    static const int Ds[] = {8, 13, 64, 128};
    static const int Ms[] = {3, 70, 300};
    static const int NQs[] = {5, 8, 12, 17, 40};
    int n = 0;
    for (size_t a = 0; a < sizeof Ds / sizeof *Ds; a++)
        for (size_t b = 0; b < sizeof Ms / sizeof *Ms; b++)
            for (size_t c = 0; c < sizeof NQs / sizeof *NQs; c++)
                for (int mk = 0; mk < MK_COUNT; mk++, n++) {
                    const int nq = NQs[c], N = nq + 3, i0 = n % 4;
                    /* formats in turn: float32 most often */
                    const int kfm = n % 3 ? AC_SE_F32 : (n / 3) % 4;
                    const int vfm = n % 5 ? AC_SE_F32 : (n / 5) % 4;
                    const double cap = n % 7 == 3 ? 1.5 : 0, slope = n % 6 == 1 ? 0.25 : 0;
                    range_case(1, kfm, vfm, Ds[a], N, Ms[b], i0, nq, mk, cap, slope);
                }
}

int main(void)
{
    ac_cpu_init();
    if (!ac_neon_on || ac_set_kernel_path(AC_PATH_AVX2) == 0) {
        fprintf(stderr, "the neon path is not the default, or avx2 was accepted\n");
        return 1;
    }
    part1();
    const long k1 = n_checks;
    part2();
    const long k2 = n_checks;
    part3();
    if (n_fail) {
        fprintf(stderr, "neon_check: %ld of %ld checks FAILED\n", n_fail, n_checks);
        return 1;
    }
    printf("neon_check: all %ld checks passed (kernels %ld, dispatch %ld, fused panels %ld)\n",
           n_checks, k1, k2 - k1, n_checks - k2);
    return 0;
}
