/*
 * ac_cpu.h -- the CPU side of the kernels, in one place:
 *
 * - AC_HAVE_X86: the x86-64 kernels are compiled (GCC / Clang on x86-64,
 *   unless the build defines AC_NO_X86_KERNELS); without them every kernel
 *   runs its portable loops and ac_cpu_init picks AC_PATH_PORTABLE --
 *   or, where AC_HAVE_NEON (aarch64), AC_PATH_NEON: the portable path's
 *   code but for the small-row decode body, compiled for NEON in
 *   ac_small.h (ac_neon_on);
 * - the target attributes of those kernels: one macro per instruction set,
 *   the only place where a target string is spelled;
 * - CPU feature detection (ac_cpu_init, ac_cpu_bf16_dot,
 *   ac_cpu_bf16_dot_fast, ac_cpu_vnni, ac_cpu_avxvnni), less the features
 *   a mask takes away (ac_cpu_set_mask: ATTNCORE_CPU_FEATURES), and
 *   the choice of the kernel path (ac_set_kernel_path);
 * - the dispatch of the compiled variants (ac_variant, AC_VCALL).
 *
 * Target attributes.  A function compiled for an instruction set beyond
 * the build's flags carries one of these; it runs only where the kernel
 * path in use (ac_kernel_path, chosen from the CPU's features) allows it.
 *   AC_TGT_AVX2          AVX2 + FMA + F16C: AC_PATH_AVX2
 *   AC_TGT_AVX512        AVX-512 F/BW/VL/DQ + the above: AC_PATH_AVX512
 *   AC_TGT_AVX512_BF16   + AVX512_BF16 (vdpbf16ps): AC_PATH_AVX512 with
 *                        ac_cpu_bf16_dot()
 *   AC_TGT_AVX512_VNNI   + AVX512_VNNI (vpdpbusd): AC_PATH_AVX512 with
 *                        ac_cpu_vnni()
 *   AC_TGT_AVXVNNI       AVX2 + AVX-VNNI (vpdpbusd on ymm, VEX encoded):
 *                        AC_PATH_AVX2 with ac_cpu_avxvnni()
 * The feature lists ac_cpu_init requires of a path are the lists of its
 * target, so a function of a path's target runs on every CPU that path is
 * chosen for.
 *
 * Compiled variants.  A kernel whose speed comes from auto-vectorized
 * loops is compiled three times from one body: for the baseline
 * (AC_VTGT_PORTABLE, nothing beyond the build's flags), for AVX2
 * (AC_VTGT_AVX2) and for AVX-512 (AC_VTGT_AVX512).  The variants are
 * noinline so the vectorizer sees each loop in its variant's target.
 * ac_variants.inc instantiates a body for the three; AC_VCALL calls the
 * variant of the path in use (ac_variant, which records it in
 * ac_state->ran: read by the tests through _sdpa._variants_ran), so the
 * forced portable path runs the baseline code that CPUs without AVX2 run.
 */
#ifndef AC_CPU_H
#define AC_CPU_H

#include "ac_common.h"

#if defined(__GNUC__)
#define AC_NOINLINE __attribute__((noinline))
#else
#define AC_NOINLINE
#endif

/* CPU features a mask can take away (ac_cpu_mask, ATTNCORE_CPU_FEATURES):
 * the dispatcher and every mode default then act as on a CPU without
 * them.  Taking away a feature a path needs takes away the path, and the
 * features that run on it (-avx512f: no AVX512_BF16 / AVX512_VNNI either;
 * -avx2: the portable path, no AVX-VNNI). */
enum {
    AC_F_AVX2 = 1 << 0, AC_F_FMA = 1 << 1, AC_F_F16C = 1 << 2, AC_F_AVX512F = 1 << 3,
    AC_F_AVX512BW = 1 << 4, AC_F_AVX512VL = 1 << 5, AC_F_AVX512DQ = 1 << 6,
    AC_F_AVX512_BF16 = 1 << 7, AC_F_AVX512_VNNI = 1 << 8, AC_F_AVX_VNNI = 1 << 9
};

/* set the mask (before ac_cpu_init) */
static AC_UNUSED void ac_cpu_set_mask(unsigned mask) { ac_cpu_mask = mask; }

/* AC_HAVE_NEON: aarch64 with NEON (the baseline of every AArch64 core: no
 * run-time detection), GCC / Clang: the small-row decode body is compiled
 * for NEON (ac_small.h) and the neon path (AC_PATH_NEON) runs it */
#if defined(__GNUC__) && defined(__aarch64__) && defined(__ARM_NEON)
#define AC_HAVE_NEON 1
#include <arm_neon.h>
#else
#define AC_HAVE_NEON 0
#endif

#if defined(__GNUC__) && defined(__x86_64__) && !defined(AC_NO_X86_KERNELS)
#define AC_HAVE_X86 1
#include <cpuid.h>
#include <immintrin.h>

/* the feature lists (target strings) of the paths */
#define AC_ISA_AVX2 "avx2,fma,f16c"
#define AC_ISA_AVX512F "avx512f," AC_ISA_AVX2
#define AC_ISA_AVX512BW "avx512bw," AC_ISA_AVX512F
#define AC_ISA_AVX512 "avx512vl,avx512dq," AC_ISA_AVX512BW
#define AC_TGT_AVX2 __attribute__((target(AC_ISA_AVX2)))
#define AC_TGT_AVX512F __attribute__((target(AC_ISA_AVX512F)))
#define AC_TGT_AVX512BW __attribute__((target(AC_ISA_AVX512BW)))
#define AC_TGT_AVX512 __attribute__((target(AC_ISA_AVX512)))
#define AC_TGT_AVX512_BF16 __attribute__((target("avx512bf16," AC_ISA_AVX512)))
#define AC_TGT_AVX512_VNNI __attribute__((target("avx512vnni," AC_ISA_AVX512)))
#define AC_TGT_AVXVNNI __attribute__((target("avxvnni," AC_ISA_AVX2)))

/* the compiled variants */
#define AC_VTGT_PORTABLE AC_NOINLINE
#define AC_VTGT_AVX2 AC_NOINLINE AC_TGT_AVX2
#define AC_VTGT_AVX512 AC_NOINLINE AC_TGT_AVX512

/* the decode loops' rows of at least this many bytes read for one query
 * row are prefetched into L2 only (ac_pf_l2_rows; 0: none, all into L1;
 * ac_small.h says why none by default) */
#ifndef AC_PF_L2_ROWS
#define AC_PF_L2_ROWS 0
#endif

/* the kernel-path state (ac_best_path, ac_kernel_path, ac_avx512_ok) is
   in ac_common.h: one home for every extension */

/* whether the CPU has `feat` (a __builtin_cpu_supports name) and the mask
   (ac_cpu_mask, ATTNCORE_CPU_FEATURES) leaves it (bit, AC_F_*) */
#define AC_HAS(feat, bit) (__builtin_cpu_supports(feat) && !(ac_cpu_mask & (bit)))

/* the best path of the CPU's features less the mask; run at import, after
   ac_cpu_set_mask */
static AC_UNUSED void ac_cpu_init(void)
{
    __builtin_cpu_init();
    /* F16C (float16 operands) comes with every AVX2 + FMA core; it is
       required all the same (AC_ISA_AVX2) */
    const int avx2 = AC_HAS("avx2", AC_F_AVX2) && AC_HAS("fma", AC_F_FMA) &&
                     AC_HAS("f16c", AC_F_F16C);
    /* AC_ISA_AVX512 */
    if (avx2 && AC_HAS("avx512f", AC_F_AVX512F) && AC_HAS("avx512bw", AC_F_AVX512BW) &&
        AC_HAS("avx512vl", AC_F_AVX512VL) && AC_HAS("avx512dq", AC_F_AVX512DQ))
        ac_best_path = AC_PATH_AVX512;
    else if (avx2)
        ac_best_path = AC_PATH_AVX2;
    else
        ac_best_path = AC_PATH_PORTABLE;
    ac_kernel_path = ac_best_path;
    ac_avx512_ok = ac_kernel_path == AC_PATH_AVX512;
    ac_pf_l2_rows = AC_PF_L2_ROWS;
}

/* whether the CPU has bfloat16 dot products (AVX512_BF16: vdpbf16ps) and
   the AVX-512 path they run on */
static AC_UNUSED int ac_cpu_bf16_dot(void)
{
    __builtin_cpu_init();
    return ac_best_path == AC_PATH_AVX512 && AC_HAS("avx512bf16", AC_F_AVX512_BF16);
}

/* whether vdpbf16ps outpaces the CPU's float32 FMAs, so that bfloat16
   dot products are the faster way to multiply bfloat16 rows: true on AMD
   (Zen 4 / Zen 5: bf16 prefill 1.5-1.7x float32), false elsewhere: Intel's
   cores with AVX512_BF16 (Cooper Lake, Sapphire / Emerald / Granite Rapids)
   issue one zmm vdpbf16ps per 2.7 zmm FMAs -- 0.73x their float32 products
   a cycle, measured on a Xeon with AMX (family 6 model 167), where the
   bf16 prefill kernels ran at 0.60-0.68x of float32 */
static AC_UNUSED int ac_cpu_bf16_dot_fast(void)
{
    return ac_cpu_bf16_dot() && __builtin_cpu_is("amd");
}

/* whether the CPU has vpdpbusd on 512-bit vectors (AVX512_VNNI) and the
   AVX-512 path they run on */
static AC_UNUSED int ac_cpu_vnni(void)
{
    __builtin_cpu_init();
    return ac_best_path == AC_PATH_AVX512 && AC_HAS("avx512vnni", AC_F_AVX512_VNNI);
}

/* whether the CPU has vpdpbusd on 256-bit vectors in its VEX encoding
   (AVX-VNNI: CPUID leaf 7 subleaf 1, EAX bit 4; Alder Lake and later, Zen
   5), with the AVX2 path (the OS saves the ymm state: the AVX2 check
   includes it) */
static AC_UNUSED int ac_cpu_avxvnni(void)
{
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (ac_best_path < AC_PATH_AVX2 || (ac_cpu_mask & AC_F_AVX_VNNI)) return 0;
    if (!__get_cpuid_count(7, 1, &a, &b, &c, &d)) return 0;
    return (int)((a >> 4) & 1u);
}

/* select a path (-1: the best); 0 on success, -1 if this CPU lacks it */
static AC_UNUSED int ac_set_kernel_path(int path)
{
    if (path < 0) path = ac_best_path;
    if (path > ac_best_path) return -1;
    ac_kernel_path = path;
    ac_avx512_ok = path == AC_PATH_AVX512;
    return 0;
}

#else
#define AC_HAVE_X86 0
#define AC_VTGT_PORTABLE
static AC_UNUSED int ac_cpu_bf16_dot(void) { return 0; }
static AC_UNUSED int ac_cpu_bf16_dot_fast(void) { return 0; }
static AC_UNUSED int ac_cpu_vnni(void) { return 0; }
static AC_UNUSED int ac_cpu_avxvnni(void) { return 0; }

/* the best path without x86 kernels: neon on aarch64, else portable */
#define AC_BEST_NOX86 (AC_HAVE_NEON ? AC_PATH_NEON : AC_PATH_PORTABLE)

/* select a path (-1: the best; AC_PATH_NEON where AC_HAVE_NEON); 0 on
   success, -1 if this build lacks it.  ac_kernel_path stays
   AC_PATH_PORTABLE: the neon path is the portable path's code but for
   the small-row decode body (ac_neon_on) */
static AC_UNUSED int ac_set_kernel_path(int path)
{
    if (path < 0) path = AC_BEST_NOX86;
    if (path != AC_PATH_PORTABLE && path != AC_BEST_NOX86) return -1;
    ac_kernel_path = AC_PATH_PORTABLE;
    ac_neon_on = path == AC_PATH_NEON;
    return 0;
}

static AC_UNUSED void ac_cpu_init(void) { ac_set_kernel_path(-1); }
#endif /* AC_HAVE_X86 */

/* the variant to run for kernel `kernel` (AC_PATH_*: 0 baseline, 1 AVX2, 2
   AVX-512), recorded in ac_state->ran */
static inline int ac_variant(int kernel)
{
    const int v = AC_HAVE_X86 ? ac_kernel_path : AC_PATH_PORTABLE;
    const unsigned bit = 1u << (AC_VAR_BITS * kernel + v);
#if defined(__GNUC__)
    /* read first: the cache line is written once, not by every call */
    if (!(__atomic_load_n(&ac_state->ran, __ATOMIC_RELAXED) & bit))
        __atomic_fetch_or(&ac_state->ran, bit, __ATOMIC_RELAXED);
#else
    ac_state->ran |= bit;
#endif
    return v;
}

/* the variants ac_variant has recorded; reset: clear the record */
static AC_UNUSED unsigned ac_variants_ran(int reset)
{
    const unsigned r = ac_state->ran;
    if (reset) ac_state->ran = 0u;
    return r;
}

/* Call the variant v (ac_variant) of kernel `name` with `args`: FN(name
 * suffix) spells a variant's function name, the suffix being
 * name##_portable, name##_avx2 or name##_avx512 (FN: AC_VNAME for no more
 * than that, or a family's own macro that adds the dtype). */
#define AC_VNAME(name) name
#if AC_HAVE_X86
#define AC_VCALL(v, FN, name, args)                                          \
    ((v) == AC_PATH_AVX512 ? FN(name##_avx512) args                          \
     : (v) == AC_PATH_AVX2 ? FN(name##_avx2) args : FN(name##_portable) args)
#else
#define AC_VCALL(v, FN, name, args) ((void)(v), FN(name##_portable) args)
#endif

#endif /* AC_CPU_H */
