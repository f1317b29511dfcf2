# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""Scaled dot-product attention: the compiled driver.

Private.  ``attncore.functional`` validates and lays out the arrays; this
module only splits the work into (batch element, query block[, key split])
items, gives every thread (of attncore's own team, src/ac_team.h, or of an
OpenMP region) its own scratch and calls the C kernels in ``src/ac_sdpa.h``
without the GIL.

Operands arrive as NumPy arrays plus, per operand, an array of element
offsets (one per flattened batch element).  Offsets carry broadcasting
(stride 0), grouped-query head mapping and arbitrary batch strides, so no
operand is ever expanded or copied here.
"""
from cpython.buffer cimport (PyBUF_RECORDS_RO, PyBUF_RECORDS, PyBUF_C_CONTIGUOUS, PyBUF_WRITABLE,
                             PyBuffer_IsContiguous, PyObject_GetBuffer, PyBuffer_Release)
from cpython.pycapsule cimport PyCapsule_New
from cython.parallel cimport prange, parallel
from libc.stdlib cimport malloc, calloc, free, qsort
from libc.string cimport memcpy
from libc.stdint cimport uint8_t, uint16_t, int8_t, int32_t, int64_t
from libc.math cimport exp, log, NAN, INFINITY
from scipy.linalg.cython_blas cimport sgemm, dgemm

from attncore._core._blas cimport ac_sgemm_t, ac_dgemm_t
from attncore._core._elementwise cimport _map_array
from attncore._core._buffers cimport _Buffers, _acquire, _release_all
cdef extern from "ac_team.h" nogil:
    ctypedef void (*ac_team_item_fn)(void *ctx, Py_ssize_t i, int slot) noexcept nogil
    ctypedef void (*ac_team_done_fn)(void *ctx, int slot) noexcept nogil
    void ac_team_run(int nthreads, Py_ssize_t n, ac_team_item_fn item, ac_team_done_fn done,
                     void *ctx)
    int ac_team_started()

from attncore._core._openmp cimport (
    AC_OPENMP_ENABLED, omp_get_max_threads, omp_get_num_procs, ac_blas_hold,
    ac_blas_release, set_blas_local_fns)

import os

ctypedef fused floating:
    float
    double

cdef extern from "ac_sdpa.h" nogil:
    void ac_f32_half(int fmt, const float *x, uint16_t *y, Py_ssize_t n)
    void ac_half_rows_f32(int fmt, const uint16_t *x, Py_ssize_t rs, int n, int D, float *out,
                          Py_ssize_t ldo)
    ctypedef struct ac_params:
        int N, M, D, Dv
        Py_ssize_t s_len
        int Bq, Bk, ldS
        Py_ssize_t q_rs, k_rs, v_rs
        Py_ssize_t mask_rs, mask_cs
        int mask_kind
        int causal
        int win_l, win_r, band
        double scale
        double softcap
        int kq8, vq8
        Py_ssize_t ks_rs, vs_rs, dq_off
        int kq4, vq4
        int qh, kh, vh
        Py_ssize_t qb_off, mp_off
        int alibi_on
        double alibi, sink
        int bf16dot
        Py_ssize_t bf_off
        int qk8
        const float *qsc
        int kvcopy
        int kchunk
        Py_ssize_t kbase
        int resume
        const void *knext
        const void *vnext

    int ac_sdpa_range_f32(const ac_params *p, const float *q, const float *k, const float *v,
                          const float *ksc, const float *vsc,
                          const uint8_t *mb, const float *mf, Py_ssize_t i0, int nq,
                          Py_ssize_t ks, Py_ssize_t ke, float *S, float *acc, float *m,
                          float *l, float *alpha, int *bad, ac_sgemm_t gemm)
    int ac_sdpa_range_f64(const ac_params *p, const double *q, const double *k, const double *v,
                          const double *ksc, const double *vsc,
                          const uint8_t *mb, const double *mf, Py_ssize_t i0, int nq,
                          Py_ssize_t ks, Py_ssize_t ke, double *S, double *acc, double *m,
                          double *l, double *alpha, int *bad, ac_dgemm_t gemm)
    void ac_sdpa_finish_f32(int nq, int Dv, int processed, const float *acc, const float *l,
                            const int *bad, float *out, Py_ssize_t o_rs, const float *m,
                            double sink)
    void ac_sdpa_finish_f64(int nq, int Dv, int processed, const double *acc, const double *l,
                            const int *bad, double *out, Py_ssize_t o_rs, const double *m,
                            double sink)
    int ac_sdpa_finish_finite_f32(int nq, int Dv, int processed, const float *acc,
                                  const float *l, const int *bad, float *out, Py_ssize_t o_rs,
                                  const float *m, double sink)
    int ac_sdpa_finish_finite_f64(int nq, int Dv, int processed, const double *acc,
                                  const double *l, const int *bad, double *out,
                                  Py_ssize_t o_rs, const double *m, double sink)
    void ac_sdpa_merge_f32(int nsplit, int nq, int Dv, const float *pacc, Py_ssize_t acc_ss,
                           const float *pm, const float *pl, Py_ssize_t ml_ss, const int *pbad,
                           Py_ssize_t bad_ss, float *out, Py_ssize_t o_rs, float *lse,
                           double sink)
    void ac_sdpa_merge_f64(int nsplit, int nq, int Dv, const double *pacc, Py_ssize_t acc_ss,
                           const double *pm, const double *pl, Py_ssize_t ml_ss, const int *pbad,
                           Py_ssize_t bad_ss, double *out, Py_ssize_t o_rs, double *lse,
                           double sink)
    void ac_weights_block_f32(const ac_params *p, const float *q, const float *k, const float *v,
                              const uint8_t *mb, const float *mf, Py_ssize_t i0, int nq,
                              float *W, float *out, Py_ssize_t o_rs, float *lse, ac_sgemm_t gemm)
    void ac_weights_block_f64(const ac_params *p, const double *q, const double *k, const double *v,
                              const uint8_t *mb, const double *mf, Py_ssize_t i0, int nq,
                              double *W, double *out, Py_ssize_t o_rs, double *lse,
                              ac_dgemm_t gemm)
    Py_ssize_t ac_causal_limit(const ac_params *p, Py_ssize_t i)
    Py_ssize_t ac_band_lo(const ac_params *p, Py_ssize_t i)
    void ac_cpu_init()
    void ac_cpu_set_mask(unsigned mask)
    unsigned ac_cpu_mask
    int AC_F_AVX2, AC_F_FMA, AC_F_F16C, AC_F_AVX512F, AC_F_AVX512BW, AC_F_AVX512VL
    int AC_F_AVX512DQ, AC_F_AVX512_BF16, AC_F_AVX512_VNNI, AC_F_AVX_VNNI
    int ac_avx512_ok
    int ac_pf_l2_rows
    int ac_best_path
    int ac_kernel_path
    int ac_neon_on
    int AC_HAVE_NEON
    int ac_set_kernel_path(int path)
    int ac_fused_panel_rows()
    int ac_cpu_bf16_dot()
    int ac_cpu_bf16_dot_fast()
    int ac_cpu_vnni()
    int ac_cpu_avxvnni()
    void ac_i8_quantize_rows(const void *x, int fmt, Py_ssize_t x_rs, Py_ssize_t n, int D,
                             const float *sub, const float *w, const float *dv,
                             int8_t *out, Py_ssize_t ld, float *scales, float *dots,
                             int32_t *ksum, float *ybuf)
    void ac_i8_col_stats(const void *x, int fmt, Py_ssize_t x_rs, Py_ssize_t n, int D,
                         float *mean, float *mabs, float *amax, float *ybuf, double *acc)
    void ac_size_scratch(ac_params *p, int D, int Dv, int Bq, int Bk, int is64, int have_ks,
                         int have_vs, int q_fmt, int k_fmt, int v_fmt, int bf16dot, int qk8)
    void ac_size_kvcopy(ac_params *p)
    void ac_exp_array_f32(const float *x, float *y, Py_ssize_t n)
    int ac_all_finite_f32(const float *x, Py_ssize_t n)
    int ac_all_finite_f64(const double *x, Py_ssize_t n)
    void ac_exp_array_f64(const double *x, double *y, Py_ssize_t n)
    void *ac_state_home()
    unsigned ac_variants_ran(int reset)
    int AC_K_COUNT, AC_VAR_BITS
    int AC_SMALL_ROWS, AC_PANEL_ROWS_AVX512, AC_PANEL_ROWS_AVX2, AC_PANEL_ROWS_NEON
    int AC_BAD_OVF, AC_BK
    int AC_PATH_AVX512, AC_PATH_AVX2, AC_PATH_NEON, AC_MASK_NONE, AC_MASK_BOOL, AC_MASK_ADD, AC_CAUSAL_NONE
    int AC_I8_ROW_ALIGN


# the CPU features ATTNCORE_CPU_FEATURES can take away (their /proc/cpuinfo
# names): the dispatcher and every mode default then act as on a CPU
# without them (CI runs the suite as an AVX2-only core and as an AVX2 +
# AVX-VNNI core on its AVX-512 machine)
CPU_FEATURE_BITS = {"avx2": AC_F_AVX2, "fma": AC_F_FMA, "f16c": AC_F_F16C,
                    "avx512f": AC_F_AVX512F, "avx512bw": AC_F_AVX512BW,
                    "avx512vl": AC_F_AVX512VL, "avx512dq": AC_F_AVX512DQ,
                    "avx512_bf16": AC_F_AVX512_BF16, "avx512_vnni": AC_F_AVX512_VNNI,
                    "avx_vnni": AC_F_AVX_VNNI}


def parse_cpu_mask(spec):
    """The mask bits of an ``ATTNCORE_CPU_FEATURES`` value: features to
    take away, comma-separated, each with a leading ``-`` (for example
    ``-avx512f,-avx_vnni``); empty: none.  ValueError names the variable
    and the features it knows."""
    cdef unsigned mask = 0
    for item in (spec or "").replace(" ", "").split(","):
        if not item:
            continue
        name = item[1:].lower()
        if item[0] != "-" or name not in CPU_FEATURE_BITS:
            raise ValueError(
                f"ATTNCORE_CPU_FEATURES must list features to take away as -name, "
                f"comma-separated, the names among {', '.join(CPU_FEATURE_BITS)}; "
                f"got {item!r} in {spec!r}")
        mask |= CPU_FEATURE_BITS[name]
    return mask


def masked_cpu_features():
    """The features ``ATTNCORE_CPU_FEATURES`` took away at import."""
    return tuple(n for n, b in CPU_FEATURE_BITS.items() if ac_cpu_mask & b)


ac_cpu_set_mask(parse_cpu_mask(os.environ.get("ATTNCORE_CPU_FEATURES", "")))
ac_cpu_init()
# the kernel-path state's one home: the other extensions point at it when
# imported (ac_common.h), so set_kernel_path forces every kernel's path
_kernel_state = PyCapsule_New(ac_state_home(), "attncore._core._sdpa._kernel_state", NULL)


# by code (AC_PATH_*); "neon" (aarch64) is the portable path's code but for
# the small-row decode body, which runs on NEON (ac_small.h): there
# ac_kernel_path stays AC_PATH_PORTABLE and ac_neon_on is set
_PATHS = ("portable", "avx2", "avx512", "neon")


cdef inline int _path_code() noexcept nogil:
    """The code (AC_PATH_*) of the path in use."""
    return AC_PATH_NEON if ac_neon_on else ac_kernel_path


cdef inline int _best_code() noexcept nogil:
    """The code of the best path this CPU runs."""
    return AC_PATH_NEON if AC_HAVE_NEON else ac_best_path
# constants of the C kernels that attncore._call plans with
SMALL_ROWS = AC_SMALL_ROWS  # query blocks of at most this many rows: direct loops
# rows per panel of the fused float32 attention kernel, by path
PANEL_ROWS = {"avx512": AC_PANEL_ROWS_AVX512, "avx2": AC_PANEL_ROWS_AVX2, "neon": AC_PANEL_ROWS_NEON}
KEY_BLOCK = AC_BK  # keys per tile of the fused kernels (a build may set it: -DAC_BK=64)


def set_prefetch_l2_rows(int nbytes):
    """The decode loops' rows of at least ``nbytes`` bytes read for one
    query row are prefetched into L2 only (0, the default: none, every row
    into L1); returns the previous setting.  For benchmarks that compare
    both settings in one process (bench/compare_decode.py --prefetch-ab):
    a prefetch hint changes no result.  Process-wide, as the kernel path."""
    global ac_pf_l2_rows
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    old = ac_pf_l2_rows
    ac_pf_l2_rows = nbytes
    return old


def cpu_features():
    """Instruction-set paths chosen at run time."""
    return {"kernel_path": _PATHS[_path_code()], "best_path": _PATHS[_best_code()],
            "avx512_small_rows": bool(ac_avx512_ok),
            "bf16_dot": bool(ac_cpu_bf16_dot()),
            "bf16_dot_fast": bool(ac_cpu_bf16_dot_fast()),
            "int8_dot": bool(ac_cpu_vnni()),
            "avx_vnni": bool(ac_cpu_avxvnni()),
            "fused_panel_rows": ac_fused_panel_rows() if _path_code() else 0,
            "prefetch_l2_rows": ac_pf_l2_rows,
            "small_rows": AC_SMALL_ROWS,
            "masked": masked_cpu_features()}


# bfloat16 dot products: 1 vdpbf16ps where the CPU has AVX512_BF16 and the
# instruction outpaces its float32 FMAs (ac_cpu_bf16_dot_fast: AMD's; not
# Intel's), else 0 (bfloat16 rows converted and multiplied in float32);
# set_bf16_mode("native") forces the instruction on any CPU that has it,
# set_bf16_mode("emulate") runs the same kernels with the instruction
# spelled in AVX-512F (tests of the path on any AVX-512 CPU)
_BF16_DEFAULT = 1 if ac_cpu_bf16_dot() and ac_cpu_bf16_dot_fast() else 0
_bf16_mode = _BF16_DEFAULT


def bf16_mode():
    """0: float32 products for bfloat16; 1: vdpbf16ps; 2: emulated (tests)."""
    return _bf16_mode


def _mode_code(mode, what, choices, default):
    """The code of ``mode`` among ``choices`` ({name: code, or None where
    this CPU cannot run it}); ``default`` for None."""
    if mode is None:
        return default
    code = choices.get(mode) if isinstance(mode, str) else None
    if code is None:
        names = ", ".join(repr(n) for n in choices)
        raise ValueError(f"{what} mode must be {names} or None and runnable on this CPU, "
                         f"got {mode!r}")
    return code


def set_bf16_mode(mode):
    """Private, process-wide (tests and benchmarks): 'native' (needs
    AVX512_BF16), 'emulate' (needs AVX-512), 'off', or None (the default
    of this CPU: 'native' where vdpbf16ps outpaces its float32 FMAs, else
    'off').  Returns the previous mode's name."""
    global _bf16_mode
    prev = ("off", "native", "emulate")[_bf16_mode]
    _bf16_mode = _mode_code(
        mode, "bf16", {"native": 1 if ac_cpu_bf16_dot() else None,
                       "emulate": 2 if ac_best_path == AC_PATH_AVX512 else None, "off": 0},
        _BF16_DEFAULT)
    return prev


# int8 Q.K^T (precision="int8"), the kernel's qk8 codes:
#   avx512 path: 1 vpdpbusd (AVX512_VNNI), 2 its AVX-512BW spelling (tests);
#   avx2 path:   4 vpmaddubsw + vpmaddwd with the sign trick (AVX2), 5
#                vpdpbusd on ymm (AVX-VNNI), 6 code 5's AVX2 spelling (tests);
#   any path:    3 float products of the dequantized int8 rows (tests, the
#                method's numbers), 0 float32 products (no int8 at all).
# A code of another path than the one in use takes float32 products
# (attncore._call.int8_products).  The default ("auto", None) is, per path,
# the int8 kernel of this CPU where it is faster than float32 products, else
# float32 products, so that precision="int8" is never slower than float32:
# measured on AMD Zen 5 with the avx2 path forced (docs/guide/variants.rst).
_INT8_CODES = {"float32": 0, "native": 1, "emulate": 2, "dequantize": 3, "avx2": 4,
               "avxvnni": 5, "avxvnni-emulate": 6}
_INT8_NAMES = {c: n for n, c in _INT8_CODES.items()}
# whether the avx2 path's int8 kernels beat float32 products (prefill
# 1x8x1024^2 x 64 / x 128, causal too: bench/compare_int8.py --avx2-modes;
# AMD Zen 5, one thread: AVX-VNNI 1.16-1.28x, vpmaddubsw 0.98-1.05x, within
# noise); the default takes one only where it does
INT8_AVX2_DEFAULTS = {"avxvnni": True, "avx2": False}
_int8_mode = -1  # -1: auto


def _int8_auto():
    """The qk8 code of the default mode on the kernel path in use."""
    if ac_kernel_path == AC_PATH_AVX512:
        return 1 if ac_cpu_vnni() else 0
    if ac_kernel_path == AC_PATH_AVX2:
        if ac_cpu_avxvnni() and INT8_AVX2_DEFAULTS["avxvnni"]:
            return 5
        if INT8_AVX2_DEFAULTS["avx2"]:
            return 4
    return 0


def int8_mode():
    """The qk8 code precision="int8" asks for on the kernel path in use:
    0 float32 products; 1 vpdpbusd, 2 emulated in AVX-512BW (avx512 path);
    3 float products of the dequantized int8 rows; 4 vpmaddubsw (sign
    trick), 5 AVX-VNNI vpdpbusd, 6 code 5 emulated in AVX2 (avx2 path).
    attncore._call.int8_products maps a code of another path to 0."""
    return _int8_auto() if _int8_mode < 0 else _int8_mode


def int8_mode_name():
    """The name of the mode set (None: the default, "auto")."""
    return None if _int8_mode < 0 else _INT8_NAMES[_int8_mode]


def set_int8_mode(mode):
    """Private, process-wide (tests and benchmarks): 'native' (vpdpbusd,
    needs AVX512_VNNI), 'emulate' (its AVX-512BW spelling, needs AVX-512),
    'avx2' (vpmaddubsw sign trick, needs AVX2), 'avxvnni' (needs AVX-VNNI),
    'avxvnni-emulate' (its AVX2 spelling, needs AVX2), 'dequantize',
    'float32', or None (the default: per kernel path, this CPU's int8
    kernel where it beats float32 products).  Returns the previous mode's
    name (None for the default)."""
    global _int8_mode
    prev = int8_mode_name()
    avx2 = ac_best_path >= AC_PATH_AVX2
    if mode is None:
        _int8_mode = -1
        return prev
    _int8_mode = _mode_code(
        mode, "int8", {"native": 1 if ac_cpu_vnni() else None,
                       "emulate": 2 if ac_best_path == AC_PATH_AVX512 else None, "dequantize": 3,
                       "float32": 0, "avx2": 4 if avx2 else None,
                       "avxvnni": 5 if ac_cpu_avxvnni() and avx2 else None,
                       "avxvnni-emulate": 6 if avx2 else None},
        -1)
    return prev


# int16 P.V under int8 Q.K^T (precision="int8"), the kernel's bf16dot codes
# there: 3 vpdpwssd -- on ymm (AVX-VNNI) under the avx2 path's int8 scores
# (codes 4 - 6), on zmm (AVX512_VNNI) under the avx512 path's (codes 1 / 2)
# --, 4 the same int32 sums in AVX2 / AVX-512BW (vpmaddwd + vpaddd: tests; no
# faster than float32 FMAs), 0 float32 P.V.  The default takes vpdpwssd
# where the CPU has either (twice the products per instruction of a
# float32 FMA); under the avx512 path's scores bfloat16 P.V, where its
# products are on (bf16_mode), comes first.
_PV16_DEFAULT = 3 if ((ac_cpu_avxvnni() and ac_best_path >= AC_PATH_AVX2)
                      or (ac_cpu_vnni() and ac_best_path == AC_PATH_AVX512)) else 0
_pv16_mode = _PV16_DEFAULT


def pv16_mode():
    """The int16 P.V mode set: 0 float32 P.V, 3 vpdpwssd (AVX-VNNI or
    AVX512_VNNI), 4 its AVX2 / AVX-512BW spelling (tests)."""
    return _pv16_mode


def pv16_code(int qk8):
    """The kernel's bf16dot code for int16 P.V under the int8 Q.K^T code
    qk8: the mode set, where qk8's panel has it (codes 1 / 2: the AVX-512
    panel, native needing AVX512_VNNI; 4 - 6: the AVX2 panel, native
    needing AVX-VNNI), else 0 (float32 P.V)."""
    if _pv16_mode == 0 or qk8 not in (1, 2, 4, 5, 6):
        return 0
    if _pv16_mode == 3 and not (ac_cpu_vnni() if qk8 <= 2 else ac_cpu_avxvnni()):
        return 0
    return _pv16_mode


def set_pv16_mode(mode):
    """Private, process-wide (tests and benchmarks): 'native' (vpdpwssd,
    needs AVX-VNNI or AVX512_VNNI; a path whose instruction the CPU lacks
    takes float32 P.V), 'emulate' (the same sums in AVX2 / AVX-512BW),
    'off' (float32 P.V), or None (the default: 'native' where the CPU has
    either, else 'off').  Returns the previous mode's name."""
    global _pv16_mode
    prev = {0: "off", 3: "native", 4: "emulate"}[_pv16_mode]
    _pv16_mode = _mode_code(
        mode, "pv16", {"native": 3 if _PV16_DEFAULT == 3 else None,
                       "emulate": 4 if ac_best_path >= AC_PATH_AVX2 else None, "off": 0},
        _PV16_DEFAULT)
    return prev


cdef int _check_rows3(const Py_buffer *bx, int fmt, str who) except -1:
    """x of int8_quantize / int8_col_stats: 3-D (nh, R, D) float32 (fmt 0)
    or 16-bit bits, its last axis contiguous, strides whole elements."""
    if (bx.ndim != 3 or bx.itemsize != (2 if fmt else 4)
            or (bx.shape[2] > 1 and bx.strides[2] != bx.itemsize)
            or bx.strides[0] % bx.itemsize or bx.strides[1] % bx.itemsize):
        raise ValueError(f"{who}: x must be 3-D float32 (or 16-bit with fmt) with contiguous "
                         f"rows")
    return 0


def int8_quantize(x, int fmt, sub, w, dv, out, scales, dots, ksum, int nthreads):
    """Rows of the 3-D array x (nh, R, D; float32, or 16-bit bits as
    uint16 with fmt 1 bfloat16 / 2 float16; last axis contiguous) quantized
    per row for precision="int8" (ac_i8_quantize_rows): out (nh, R, ld)
    C-contiguous int8, scales (nh, R) float32; sub / dv None or (nh, D)
    float32 C-contiguous, w (nh, D) float32 C-contiguous; dots None or
    (nh, R) float32 C-contiguous; ksum None or (nh, R) int32 C-contiguous
    (128 times each row's sum of int8 values)."""
    cdef _Buffers bufs
    cdef Py_buffer *bx
    cdef Py_buffer *bo
    cdef const float[:, ::1] wv = w
    cdef const float[:, ::1] subv
    cdef const float[:, ::1] dvv
    cdef float[:, ::1] scv = scales
    cdef float[:, ::1] dotsv
    cdef int32_t[:, ::1] ksv
    cdef const float *psub = NULL
    cdef const float *pdv = NULL
    cdef float *pdots = NULL
    cdef int32_t *pks = NULL
    cdef Py_ssize_t nh, R, D, ld, h, xs_h, xs_r
    cdef float *yb
    cdef char *xb
    cdef int8_t *ob
    cdef int err = 0
    cdef int *errp = &err
    bufs.n = 0
    try:
        bx = _acquire(&bufs, x, PyBUF_RECORDS_RO)
        bo = _acquire(&bufs, out, PyBUF_RECORDS)
        _check_rows3(bx, fmt, "int8_quantize")
        if bo.ndim != 3 or bo.itemsize != 1:
            raise ValueError("int8_quantize: out must be 3-D int8")
        nh, R, D = bx.shape[0], bx.shape[1], bx.shape[2]
        ld = bo.shape[2]
        if (bo.shape[0] != nh or bo.shape[1] != R or ld < D
                or bo.strides[2] != 1 or bo.strides[1] != ld or bo.strides[0] != R * ld
                or wv.shape[0] != nh or wv.shape[1] != D
                or scv.shape[0] != nh or scv.shape[1] != R):
            raise ValueError("int8_quantize: inconsistent operands")
        if sub is not None:
            subv = sub
            if subv.shape[0] != nh or subv.shape[1] != D:
                raise ValueError("int8_quantize: sub must be (nh, D)")
            psub = &subv[0, 0]
        if dv is not None:
            dvv = dv
            dotsv = dots
            if dvv.shape[0] != nh or dvv.shape[1] != D or dotsv.shape[0] != nh or dotsv.shape[1] != R:
                raise ValueError("int8_quantize: dv must be (nh, D), dots (nh, R)")
            pdv = &dvv[0, 0]
            pdots = &dotsv[0, 0]
        if ksum is not None:
            ksv = ksum
            if ksv.shape[0] != nh or ksv.shape[1] != R:
                raise ValueError("int8_quantize: ksum must be (nh, R)")
            pks = &ksv[0, 0]
        if nh == 0 or R == 0 or D == 0:
            return
        xs_h = bx.strides[0] // bx.itemsize
        xs_r = bx.strides[1] // bx.itemsize
        xb = <char *>bx.buf
        ob = <int8_t *>bo.buf
        with nogil, parallel(num_threads=nthreads if nthreads > 1 else 1):
            yb = <float *>malloc(D * sizeof(float))
            if yb == NULL:
                errp[0] = -1
            for h in prange(nh, schedule='static'):
                if yb != NULL:
                    ac_i8_quantize_rows(xb + h * xs_h * bx.itemsize, fmt, xs_r, R, <int>D,
                                        psub + h * D if psub != NULL else NULL,
                                        &wv[0, 0] + h * D,
                                        pdv + h * D if pdv != NULL else NULL,
                                        ob + h * R * ld, ld, &scv[0, 0] + h * R,
                                        pdots + h * R if pdots != NULL else NULL,
                                        pks + h * R if pks != NULL else NULL, yb)
            free(yb)
        if err:
            raise MemoryError("attncore: could not allocate the quantizer's scratch memory")
    finally:
        _release_all(&bufs)


def int8_col_stats(x, int fmt, mean, mabs, amax, int nthreads):
    """Per head h of the 3-D array x (as int8_quantize), over the finite
    entries of each column: mean (None or (nh, D) float32) receives the
    column means and mabs (nh, D) float32 the mean |x - mean| (with mean
    None: the mean |x|); amax (nh, D) float32 the largest finite |x|."""
    cdef _Buffers bufs
    cdef Py_buffer *bx
    cdef float[:, ::1] mav = mabs
    cdef float[:, ::1] amv = amax
    cdef float[:, ::1] mv
    cdef float *pm = NULL
    cdef Py_ssize_t nh, R, D, h, xs_h, xs_r
    cdef float *yb
    cdef double *ab
    cdef char *xb
    cdef int err = 0
    cdef int *errp = &err
    bufs.n = 0
    try:
        bx = _acquire(&bufs, x, PyBUF_RECORDS_RO)
        _check_rows3(bx, fmt, "int8_col_stats")
        nh, R, D = bx.shape[0], bx.shape[1], bx.shape[2]
        if (amv.shape[0] != nh or amv.shape[1] != D
                or mav.shape[0] != nh or mav.shape[1] != D):
            raise ValueError("int8_col_stats: inconsistent operands")
        if mean is not None:
            mv = mean
            if mv.shape[0] != nh or mv.shape[1] != D:
                raise ValueError("int8_col_stats: mean must be (nh, D)")
            pm = &mv[0, 0]
        if nh == 0 or D == 0:
            return
        xs_h = bx.strides[0] // bx.itemsize
        xs_r = bx.strides[1] // bx.itemsize
        xb = <char *>bx.buf
        with nogil, parallel(num_threads=nthreads if nthreads > 1 else 1):
            yb = <float *>malloc(D * sizeof(float))
            ab = <double *>malloc(3 * D * sizeof(double))
            if yb == NULL or ab == NULL:
                errp[0] = -1
            for h in prange(nh, schedule='static'):
                if yb != NULL and ab != NULL:
                    ac_i8_col_stats(xb + h * xs_h * bx.itemsize, fmt, xs_r, R, <int>D,
                                    pm + h * D if pm != NULL else NULL,
                                    &mav[0, 0] + h * D, &amv[0, 0] + h * D, yb, ab)
            free(yb)
            free(ab)
        if err:
            raise MemoryError("attncore: could not allocate the quantizer's scratch memory")
    finally:
        _release_all(&bufs)


def kernel_path():
    """The float32 kernel path in use: 'avx512', 'avx2', 'portable' or (aarch64)
    'neon'."""
    return _PATHS[_path_code()]


def call_state():
    """The process-wide state a call's description depends on, as one int
    (the kernel path in use, the bfloat16, int8 and int16 P.V modes): the
    key of the descriptions cached by operand metadata
    (attncore._lean)."""
    return ((_path_code() * 4 + _bf16_mode) * 16 + _int8_mode + 1) * 8 + _pv16_mode


class Misaligned(ValueError):
    """An operand of :func:`sdpa` whose data is not aligned to its item
    size (the kernels read typed elements)."""


def set_kernel_path(path):
    """Select the float32 kernel path (private; for tests and benchmarks).

    path: 'avx512', 'avx2', 'portable', 'neon' (aarch64) or None (the best this
    CPU runs).
    Process-wide (every extension reads this module's state, so the path of
    every kernel, the dense layers' included, follows): meant for test
    set-up, not for use while other threads call attncore.  Raises ValueError for an unknown name or a path this
    CPU cannot run.  Returns the previous path.
    """
    prev = _PATHS[_path_code()]
    if path is None:
        ac_set_kernel_path(-1)
        return prev
    if path not in _PATHS:
        raise ValueError(f"kernel path must be one of {_PATHS} or None, got {path!r}")
    if ac_set_kernel_path(_PATHS.index(path)) != 0:
        raise ValueError(f"this CPU cannot run the {path!r} kernel path "
                         f"(best available: {_PATHS[_best_code()]!r})")
    return prev


_KERNELS = ("sdpa", "weights", "exp", "additive", "rotary")


def _variants_ran(bint reset=True):
    """The compiled variants (ac_common.h) that ran since the last reset,
    per kernel: {"sdpa": ("portable",), ...} (private; for the tests).
    reset: clear the record afterwards."""
    cdef unsigned bits = ac_variants_ran(reset)
    return {name: tuple(p for v, p in enumerate(_PATHS) if bits >> (AC_VAR_BITS * i + v) & 1)
            for i, name in enumerate(_KERNELS[:AC_K_COUNT])}


def available_kernel_paths():
    """The kernel paths this CPU can run, best last."""
    return _PATHS[:ac_best_path + 1] + (("neon",) if AC_HAVE_NEON else ())


# --------------------------------------------------------------------------
# OpenMP facts
# --------------------------------------------------------------------------
def set_blas_local(tuple addresses):
    """Install the BLAS libraries' thread-local thread-count setters
    (attncore._threads does this once)."""
    set_blas_local_fns(addresses)


def openmp_enabled():
    """True when the extension was compiled with OpenMP."""
    return bool(AC_OPENMP_ENABLED)


def omp_max_threads():
    """OpenMP's default team size for the calling thread (OMP_NUM_THREADS,
    omp_set_num_threads / threadpoolctl)."""
    return omp_get_max_threads()


def omp_num_procs():
    """Processors available to OpenMP (1 without OpenMP)."""
    return omp_get_num_procs() if AC_OPENMP_ENABLED else 1


# --------------------------------------------------------------------------
# per work item
# --------------------------------------------------------------------------
cdef inline int _range(const ac_params *p, const floating *q, const floating *k,
                       const floating *v, const floating *ksc, const floating *vsc,
                       const uint8_t *mb, const floating *mf,
                       Py_ssize_t i0, int nq, Py_ssize_t ks, Py_ssize_t ke,
                       floating *S, floating *acc, floating *m, floating *l,
                       floating *alpha, int *bad) noexcept nogil:
    if floating is float:
        return ac_sdpa_range_f32(p, q, k, v, ksc, vsc, mb, mf, i0, nq, ks, ke, S, acc, m, l,
                                 alpha, bad, <ac_sgemm_t>sgemm)
    else:
        return ac_sdpa_range_f64(p, q, k, v, ksc, vsc, mb, mf, i0, nq, ks, ke, S, acc, m, l,
                                 alpha, bad, <ac_dgemm_t>dgemm)


cdef inline void _finish(int nq, int Dv, int processed, const floating *acc,
                         const floating *l, const int *bad, floating *out,
                         Py_ssize_t o_rs, const floating *m, double sink) noexcept nogil:
    if floating is float:
        ac_sdpa_finish_f32(nq, Dv, processed, acc, l, bad, out, o_rs, m, sink)
    else:
        ac_sdpa_finish_f64(nq, Dv, processed, acc, l, bad, out, o_rs, m, sink)


cdef inline void _merge(int nsplit, int nq, int Dv, const floating *pacc,
                        Py_ssize_t acc_ss, const floating *pm, const floating *pl,
                        Py_ssize_t ml_ss, const int *pbad, Py_ssize_t bad_ss,
                        floating *out, Py_ssize_t o_rs, floating *lse, double sink) noexcept nogil:
    if floating is float:
        ac_sdpa_merge_f32(nsplit, nq, Dv, pacc, acc_ss, pm, pl, ml_ss, pbad, bad_ss, out, o_rs,
                          lse, sink)
    else:
        ac_sdpa_merge_f64(nsplit, nq, Dv, pacc, acc_ss, pm, pl, ml_ss, pbad, bad_ss, out, o_rs,
                          lse, sink)


cdef inline void _weights(const ac_params *p, const floating *q, const floating *k,
                          const floating *v, const uint8_t *mb, const floating *mf,
                          Py_ssize_t i0, int nq, floating *W, floating *out,
                          Py_ssize_t o_rs, floating *lse) noexcept nogil:
    if floating is float:
        ac_weights_block_f32(p, q, k, v, mb, mf, i0, nq, W, out, o_rs, lse, <ac_sgemm_t>sgemm)
    else:
        ac_weights_block_f64(p, q, k, v, mb, mf, i0, nq, W, out, o_rs, lse, <ac_dgemm_t>dgemm)


cdef struct _Ops:
    char *q
    char *k
    char *v
    char *mask
    char *out
    char *w
    char *lse
    const Py_ssize_t *qo
    const Py_ssize_t *ko
    const Py_ssize_t *vo
    const Py_ssize_t *mo
    char *ksc
    char *vsc
    const Py_ssize_t *kso
    const Py_ssize_t *vso
    const double *slopes   # ALiBi slope of each batch element, or NULL
    const double *sinks    # sink logit of each batch element, or NULL
    const float *qsc       # int8 query rows' scales (nb, N), or NULL


cdef inline void _lse_rows(int nq, int processed, const floating *m, const floating *l,
                           const int *bad, floating *lse, double sink) noexcept nogil:
    """log-sum-exp of finished rows: m + log(l); -inf for a row with
    nothing to attend, NaN for a flagged one (l carries NaN otherwise).
    With a sink (> -inf) its exp joins the sum (an empty row: the sink)."""
    cdef int r
    cdef double top, tot
    for r in range(nq):
        if processed and bad[r]:
            lse[r] = NAN
        elif not processed or l[r] == 0:
            lse[r] = sink
        elif sink > -INFINITY:
            top = m[r] if m[r] > sink else sink
            tot = l[r] * exp(m[r] - top) + exp(sink - top)
            lse[r] = top + log(tot)
        else:
            lse[r] = m[r] + log(l[r])


cdef inline const ac_params *_batch_params(const ac_params *p0, _Ops *ops, Py_ssize_t b,
                                           ac_params *pb) noexcept nogil:
    """The params of batch element b: p0 itself, or (with ALiBi slopes or
    sinks) a private copy pb holding that element's slope / sink."""
    if ops.slopes == NULL and ops.sinks == NULL and ops.qsc == NULL:
        return p0
    pb[0] = p0[0]
    if ops.qsc != NULL:
        pb.qsc = ops.qsc + b * p0.N
    if ops.slopes != NULL:
        pb.alibi = ops.slopes[b]
    if ops.sinks != NULL:
        pb.sink = ops.sinks[b]
    return pb


cdef inline bint _finish_finite(int nq, int Dv, int processed, const floating *acc,
                                const floating *l, const int *bad, floating *out,
                                Py_ssize_t o_rs, const floating *m, double sink) noexcept nogil:
    """_finish, then whether every element it wrote is finite (one
    vectorized pass over the rows)."""
    if floating is float:
        return ac_sdpa_finish_finite_f32(nq, Dv, processed, acc, l, bad, out, o_rs, m,
                                         sink) != 0
    else:
        return ac_sdpa_finish_finite_f64(nq, Dv, processed, acc, l, bad, out, o_rs, m,
                                         sink) != 0


cdef inline bint _rows_finite(const floating *x, Py_ssize_t n) noexcept nogil:
    """Whether the n elements at x are all finite (a work item's output
    rows, checked while they are in cache: a pass over the whole output
    after the run cost 2 % of 32 x 50^2 x 256 float32 at one thread)."""
    if floating is float:
        return ac_all_finite_f32(x, n) != 0
    else:
        return ac_all_finite_f64(x, n) != 0


cdef inline int _flash_item(const ac_params *p0, _Ops *ops, floating *buf,
                            Py_ssize_t w, Py_ssize_t nqb, int nsplit,
                            Py_ssize_t chunk, floating *part, int *pbad) noexcept nogil:
    """One work item of the flash path; buf is the calling thread's scratch.
    Returns 1 where the item wrote output rows that are not all finite
    (a partial of a split item: 0, its merge says)."""
    cdef Py_ssize_t per_b = nqb * nsplit
    cdef Py_ssize_t b = w // per_b
    cdef ac_params pb
    cdef const ac_params *p = _batch_params(p0, ops, b, &pb)
    cdef Py_ssize_t rem = w - b * per_b
    cdef Py_ssize_t qb = rem // nsplit
    cdef Py_ssize_t s = rem - qb * nsplit
    cdef Py_ssize_t i0 = qb * p.Bq
    cdef int nq = p.Bq if p.N - i0 > p.Bq else <int>(p.N - i0)
    cdef const floating *q
    cdef const floating *k
    cdef const floating *v
    cdef const floating *ksc = NULL
    cdef const floating *vsc = NULL
    # int8 keys / values: element offsets are byte offsets; half operands:
    # offsets in 16-bit elements (the kernel reads them as uint16_t)
    if p.qh:
        q = <const floating *>((<const uint16_t *>ops.q) + ops.qo[b])
    elif p.qk8:
        q = <const floating *>(ops.q + ops.qo[b])
    else:
        q = (<const floating *>ops.q) + ops.qo[b]
    if p.kq8 or p.kq4:
        k = <const floating *>(ops.k + ops.ko[b])
        ksc = (<const floating *>ops.ksc) + ops.kso[b]
    elif p.kh:
        k = <const floating *>((<const uint16_t *>ops.k) + ops.ko[b])
    else:
        k = (<const floating *>ops.k) + ops.ko[b]
    if p.vq8 or p.vq4:
        v = <const floating *>(ops.v + ops.vo[b])
        vsc = (<const floating *>ops.vsc) + ops.vso[b]
    elif p.vh:
        v = <const floating *>((<const uint16_t *>ops.v) + ops.vo[b])
    else:
        v = (<const floating *>ops.v) + ops.vo[b]
    cdef const uint8_t *mb = NULL
    cdef const floating *mf = NULL
    if p.mask_kind == AC_MASK_BOOL:
        mb = (<const uint8_t *>ops.mask) + ops.mo[b]
    elif p.mask_kind == AC_MASK_ADD:
        mf = (<const floating *>ops.mask) + ops.mo[b]
    cdef Py_ssize_t Bq = p.Bq, Dv = p.Dv
    cdef floating *S = buf
    cdef floating *acc = S + p.s_len
    cdef floating *m = acc + Bq * Dv
    cdef floating *l = m + Bq
    cdef floating *alpha = l + Bq
    cdef int *bad = <int *>(alpha + Bq)
    cdef int processed
    cdef bint fin
    cdef Py_ssize_t ks, ke
    cdef floating *o
    if nsplit == 1:
        # the output rows (contiguous, ld Dv) are the accumulator: the
        # finish then scales them in place instead of copying
        o = (<floating *>ops.out) + (b * p.N + i0) * Dv
        processed = _range(p, q, k, v, ksc, vsc, mb, mf, i0, nq, 0, p.M, S, o, m, l, alpha, bad)
        fin = _finish_finite(nq, p.Dv, processed, o, l, bad, o, Dv, m, p.sink)
        if ops.lse != NULL:
            _lse_rows(nq, processed, m, l, bad, (<floating *>ops.lse) + b * p.N + i0, p.sink)
        return 0 if fin else 1
    else:
        ks = s * chunk
        ke = ks + chunk
        if ke > p.M:
            ke = p.M
        # partial (acc, m, l) of item w live in part; flags in pbad
        acc = part + w * Bq * (Dv + 2)
        m = acc + Bq * Dv
        l = m + Bq
        _range(p, q, k, v, ksc, vsc, mb, mf, i0, nq, ks, ke, S, acc, m, l, alpha,
               pbad + w * Bq)
        return 0


cdef inline int _merge_item(const ac_params *p, _Ops *ops, Py_ssize_t t,
                            Py_ssize_t nqb, int nsplit, floating *part,
                            int *pbad) noexcept nogil:
    """Merges the split partials of query block t into the output; 1 where
    its rows are not all finite."""
    cdef Py_ssize_t b = t // nqb
    cdef Py_ssize_t qb = t - b * nqb
    cdef Py_ssize_t i0 = qb * p.Bq
    cdef int nq = p.Bq if p.N - i0 > p.Bq else <int>(p.N - i0)
    cdef Py_ssize_t Bq = p.Bq, Dv = p.Dv
    cdef Py_ssize_t w0 = t * nsplit
    cdef floating *acc = part + w0 * Bq * (Dv + 2)
    _merge(nsplit, nq, p.Dv, acc, Bq * (Dv + 2), acc + Bq * Dv, acc + Bq * Dv + Bq,
           Bq * (Dv + 2), pbad + w0 * Bq, Bq, (<floating *>ops.out) + (b * p.N + i0) * Dv, Dv,
           (<floating *>ops.lse) + b * p.N + i0 if ops.lse != NULL else NULL,
           ops.sinks[b] if ops.sinks != NULL else -INFINITY)
    cdef floating *o = (<floating *>ops.out) + (b * p.N + i0) * Dv
    return 0 if _rows_finite(o, nq * Dv) else 1


cdef inline void *_align64(void *raw) noexcept nogil:
    """The first 64-byte boundary after raw (a block malloc'ed 64 bytes
    larger than needed); NULL for NULL."""
    if raw == NULL:
        return NULL
    return <void *>(<char *>raw + (64 - (<size_t>raw & 63)))


# --------------------------------------------------------------------------
# the threaded runs, on attncore's own team (src/ac_team.h: the calling
# thread works too, a member that starts late finds nothing left, idle
# members spin only briefly) -- never an OpenMP region, whose end waits for
# every member and whose idle threads spin for milliseconds
# --------------------------------------------------------------------------
cdef struct _TeamJob:
    const ac_params *p
    void *ops                # _Ops * / _POps *
    const void *items        # the paged items (_PItem *)
    Py_ssize_t nqb, chunk, nbytes
    int nsplit, dbl
    void *part
    int *pbad
    void **raw               # per slot: its scratch (malloc'ed on its first item)
    int *nf                  # per slot: items that wrote rows not all finite
    int *err                 # per slot: its scratch could not be allocated


cdef inline void *_slot_scratch(_TeamJob *j, int slot) noexcept nogil:
    """Slot's scratch (aligned), allocated on its first item, the BLAS then
    held to one thread on its thread; NULL when memory ran out."""
    if j.raw[slot] == NULL:
        if j.err[slot]:
            return NULL
        j.raw[slot] = malloc(j.nbytes + 64)
        if j.raw[slot] == NULL:
            j.err[slot] = 1
            return NULL
        ac_blas_hold()
    return _align64(j.raw[slot])


cdef void _slot_done(void *c, int slot) noexcept nogil:
    cdef _TeamJob *j = <_TeamJob *>c
    if j.raw[slot] != NULL:
        ac_blas_release()
        free(j.raw[slot])
        j.raw[slot] = NULL


cdef void _flash_job_item(void *c, Py_ssize_t w, int slot) noexcept nogil:
    cdef _TeamJob *j = <_TeamJob *>c
    cdef void *buf = _slot_scratch(j, slot)
    if buf == NULL:
        return
    if j.dbl:
        j.nf[slot] += _flash_item(j.p, <_Ops *>j.ops, <double *>buf, w, j.nqb, j.nsplit,
                                  j.chunk, <double *>j.part, j.pbad)
    else:
        j.nf[slot] += _flash_item(j.p, <_Ops *>j.ops, <float *>buf, w, j.nqb, j.nsplit,
                                  j.chunk, <float *>j.part, j.pbad)


cdef void _merge_job_item(void *c, Py_ssize_t t, int slot) noexcept nogil:
    cdef _TeamJob *j = <_TeamJob *>c
    if j.dbl:
        j.nf[slot] += _merge_item(j.p, <_Ops *>j.ops, t, j.nqb, j.nsplit, <double *>j.part,
                                  j.pbad)
    else:
        j.nf[slot] += _merge_item(j.p, <_Ops *>j.ops, t, j.nqb, j.nsplit, <float *>j.part,
                                  j.pbad)


cdef int _team_job_init(_TeamJob *j, int nthreads) noexcept nogil:
    """Per-slot arrays of j; -1 when memory ran out."""
    j.raw = <void **>calloc(nthreads, sizeof(void *))
    j.nf = <int *>calloc(nthreads, sizeof(int))
    j.err = <int *>calloc(nthreads, sizeof(int))
    if j.raw == NULL or j.nf == NULL or j.err == NULL:
        _team_job_free(j, nthreads, NULL)
        return -1
    return 0


cdef int _team_job_free(_TeamJob *j, int nthreads, int *nf) noexcept nogil:
    """Adds the slots' non-finite counts to nf; -1 where a slot had no
    scratch, else 0."""
    cdef int t, err = 0
    if j.nf != NULL and j.err != NULL:
        for t in range(nthreads):
            if nf != NULL:
                nf[0] += j.nf[t]
            if j.err[t]:
                err = -1
    free(j.raw)
    free(j.nf)
    free(j.err)
    return err


cdef int _flash_team(const ac_params *p, _Ops *ops, Py_ssize_t nb, Py_ssize_t nqb, Py_ssize_t W,
                     int nsplit, Py_ssize_t chunk, Py_ssize_t nbuf, int nthreads,
                     floating *part, int *pbad, int *nf, floating dummy) noexcept nogil:
    """The flash items, then the merge of split ones, on nthreads threads
    of the team; 0, or -1 when memory ran out."""
    cdef _TeamJob j
    cdef int err
    j.p = p
    j.ops = ops
    j.nqb = nqb
    j.chunk = chunk
    j.nbytes = nbuf * sizeof(floating)
    j.nsplit = nsplit
    j.dbl = floating is double
    j.part = part
    j.pbad = pbad
    if _team_job_init(&j, nthreads):
        return -1
    ac_team_run(nthreads, W, _flash_job_item, _slot_done, &j)
    err = _team_job_free(&j, nthreads, nf)
    if nsplit > 1 and err == 0:
        if _team_job_init(&j, nthreads):
            return -1
        ac_team_run(nthreads, nb * nqb, _merge_job_item, NULL, &j)
        err = _team_job_free(&j, nthreads, nf)
    return err


def team_started():
    """Threads of attncore's own team started so far in this process (0
    without OpenMP, or off POSIX: everything then runs on the calling
    thread)."""
    return ac_team_started()


cdef int _run_flash(const ac_params *p, _Ops *ops, Py_ssize_t nb, int nsplit,
                    Py_ssize_t chunk, int nthreads, int *nonfinite,
                    floating dummy) noexcept nogil:
    """Returns 0 on success, -1 when memory ran out; nonfinite: set nonzero
    where some output row is not all finite (each item checks its own rows
    while they are in cache)."""
    cdef Py_ssize_t nqb = (p.N + p.Bq - 1) // p.Bq
    cdef Py_ssize_t W = nb * nqb * nsplit
    cdef Py_ssize_t Bq = p.Bq
    cdef Py_ssize_t nbuf = p.s_len + Bq * p.Dv + 4 * Bq + Bq
    cdef void *raw = NULL
    cdef floating *buf = NULL
    cdef floating *part = NULL
    cdef int *pbad = NULL
    cdef int err = 0
    cdef Py_ssize_t w, t
    cdef int nf = 0
    if nsplit > 1:
        part = <floating *>malloc(W * Bq * (p.Dv + 2) * sizeof(floating))
        pbad = <int *>malloc(W * Bq * sizeof(int))
        if part == NULL or pbad == NULL:
            free(part)
            free(pbad)
            return -1
    if nthreads <= 1:
        raw = malloc(nbuf * sizeof(floating) + 64)
        buf = <floating *>_align64(raw)
        if buf == NULL:
            err = -1
        else:
            ac_blas_hold()
            for w in range(W):
                nf = nf + _flash_item(p, ops, buf, w, nqb, nsplit, chunk, part, pbad)
            ac_blas_release()
            free(raw)
        if nsplit > 1 and err == 0:
            for t in range(nb * nqb):
                nf = nf + _merge_item(p, ops, t, nqb, nsplit, part, pbad)
    else:
        err = _flash_team(p, ops, nb, nqb, W, nsplit, chunk, nbuf, nthreads, part, pbad, &nf,
                          dummy)
    free(part)
    free(pbad)
    nonfinite[0] = nf
    return err


cdef inline void _weights_item(const ac_params *p0, _Ops *ops, Py_ssize_t w, Py_ssize_t nqb,
                               floating dummy) noexcept nogil:
    """One query block of the weights-returning path."""
    cdef Py_ssize_t b = w // nqb
    cdef ac_params pb
    cdef const ac_params *p = _batch_params(p0, ops, b, &pb)
    cdef Py_ssize_t qb = w - b * nqb
    cdef Py_ssize_t i0 = qb * p.Bq
    cdef int nq = p.Bq if p.N - i0 > p.Bq else <int>(p.N - i0)
    cdef const uint8_t *mb = NULL
    cdef const floating *mf = NULL
    if p.mask_kind == AC_MASK_BOOL:
        mb = (<const uint8_t *>ops.mask) + ops.mo[b]
    elif p.mask_kind == AC_MASK_ADD:
        mf = (<const floating *>ops.mask) + ops.mo[b]
    _weights(p, (<const floating *>ops.q) + ops.qo[b], (<const floating *>ops.k) + ops.ko[b],
             (<const floating *>ops.v) + ops.vo[b], mb, mf, i0, nq,
             (<floating *>ops.w) + (b * p.N + i0) * p.M,
             (<floating *>ops.out) + b * p.N * p.Dv, p.Dv,
             (<floating *>ops.lse) + b * p.N + i0 if ops.lse != NULL else NULL)


cdef void _run_weights(const ac_params *p, _Ops *ops, Py_ssize_t nb, int nthreads,
                       floating dummy) noexcept nogil:
    cdef Py_ssize_t nqb = (p.N + p.Bq - 1) // p.Bq
    cdef Py_ssize_t w
    if nthreads <= 1:
        ac_blas_hold()
        for w in range(nb * nqb):
            _weights_item(p, ops, w, nqb, dummy)
        ac_blas_release()
        return
    with parallel(num_threads=nthreads):
        ac_blas_hold()
        for w in prange(nb * nqb, schedule='dynamic'):
            _weights_item(p, ops, w, nqb, dummy)
        ac_blas_release()


# --------------------------------------------------------------------------
# Python entry point
# --------------------------------------------------------------------------
cdef int _fill_offsets(const Py_buffer *buf, Py_ssize_t nd, const Py_ssize_t *shp,
                       Py_ssize_t group, Py_ssize_t *out) noexcept nogil:
    """Element offset of every batch element (C order over the batch shape
    shp[0:nd]) of the operand in buf, broadcast to that shape.

    The operand's batch axes (all but its last two) align right with shp;
    missing and size-1 axes broadcast (stride 0).  group > 1 maps the last
    batch axis (query heads) to key/value head index // group (grouped-query
    attention).
    """
    cdef Py_ssize_t st[32]
    cdef Py_ssize_t idx[32]
    cdef Py_ssize_t d, b, nb = 1, off = 0, j
    cdef Py_ssize_t nbd = buf.ndim - 2
    for d in range(nd):
        st[d] = 0
        idx[d] = 0
        nb *= shp[d]
    for d in range(nbd):
        j = nd - nbd + d
        if buf.shape[d] != 1:
            st[j] = buf.strides[d] // buf.itemsize
    for b in range(nb):
        out[b] = off
        # advance the odometer
        d = nd - 1
        while d >= 0:
            idx[d] += 1
            if idx[d] < shp[d]:
                if d == nd - 1 and group > 1:
                    off += st[d] if idx[d] % group == 0 else 0
                else:
                    off += st[d]
                break
            if d == nd - 1 and group > 1:
                off -= st[d] * ((shp[d] - 1) // group)
            else:
                off -= st[d] * (shp[d] - 1)
            idx[d] = 0
            d -= 1
    return 0


cdef inline Py_ssize_t _row_stride(const Py_buffer *buf) noexcept nogil:
    """Row stride (elements) of the last two axes, valid as a BLAS ld."""
    cdef Py_ssize_t rows = buf.shape[buf.ndim - 2], cols = buf.shape[buf.ndim - 1]
    if rows <= 1:
        return cols if cols > 1 else 1
    return buf.strides[buf.ndim - 2] // buf.itemsize


# the leading fields of attncore._call.Call and Plan that sdpa reads, by
# position (_call checks its classes against these names at import)
CALL_FIELDS = ("q", "k", "v", "mask", "mask_kind", "bshape", "group", "N", "M", "D", "Dv",
               "causal", "scale", "window", "softcap", "k_scales", "v_scales", "q_scales",
               "fmts", "slopes", "sinks", "bf16dot", "qk8", "plan")
PLAN_FIELDS = ("Bq", "Bk", "nsplit", "chunk", "nthreads", "fused", "kvcopy", "kchunk")
cdef enum:
    _C_Q, _C_K, _C_V, _C_MASK, _C_MASK_KIND, _C_BSHAPE, _C_GROUP, _C_N, _C_M, _C_D, _C_DV
    _C_CAUSAL, _C_SCALE, _C_WINDOW, _C_SOFTCAP, _C_K_SCALES, _C_V_SCALES, _C_Q_SCALES
    _C_FMTS, _C_SLOPES, _C_SINKS, _C_BF16DOT, _C_QK8, _C_PLAN
cdef enum:
    _P_BQ, _P_BK, _P_NSPLIT, _P_CHUNK, _P_NTHREADS, _P_FUSED, _P_KVCOPY, _P_KCHUNK
# where a Call holds its 4-bit group sizes (key, value), when it is that
# long (a shorter tuple: none); _call checks its class against it
CALL_Q4_INDEX = 33


cdef int _q4_operand(Py_buffer *bx, Py_buffer *bs, int gs, int D) except -1:
    """Check a 4-bit operand: uint8 codes (..., M, >= D / 2) and float32
    slots (..., M, D / gs) of (scale, offset) float16 pairs."""
    if (bx == NULL or bs == NULL or gs <= 0 or gs % 2 or D % gs or bx.itemsize != 1
            or bs.itemsize != 4 or bx.shape[bx.ndim - 1] * 2 < D
            or bs.shape[bs.ndim - 1] != D // gs
            or (bs.shape[bs.ndim - 1] > 1 and bs.strides[bs.ndim - 1] != 4)):
        raise ValueError("4-bit operands: uint8 codes (..., M, D / 2) and (..., M, D / gs) "
                         "float32 slots of float16 (scale, offset) pairs")
    return 0


cdef int _set_q4(ac_params *p, tuple q4, Py_buffer *bk, Py_buffer *bv, Py_buffer *bks,
                 Py_buffer *bvs, int D, int Dv, bint other) except -1:
    """The 4-bit key / value formats of a call (its (key, value) group
    sizes, 0: not 4-bit): float32 calls without int8 / bfloat16 products."""
    cdef int kq4 = q4[0], vq4 = q4[1]
    if (kq4 or vq4) and other:
        raise ValueError("4-bit keys / values: float32 calls only, without int8 / bfloat16 "
                         "products")
    if kq4:
        _q4_operand(bk, bks, kq4, D)
        p.kq4 = kq4
        p.kq8 = 0
    if vq4:
        _q4_operand(bv, bvs, vq4, Dv)
        p.vq4 = vq4
        p.vq8 = 0
    return 0


def sdpa(call, out, weights=None, lse=None):
    """Run the dense kernel of ``call``, an attncore._call.Call (the one
    description of a call: see attncore._call.describe), into ``out``
    (C-contiguous (nb, N, Dv)), ``weights`` (None for the flash path, else
    C-contiguous (nb, N, M), filled with the attention weights) and ``lse``
    (None or a C-contiguous (nb, N) array receiving the row log-sum-exp),
    all of the compute dtype.  The fields of ``call``:

    q, k, v: float32 or float64 arrays (one dtype, native byte order), or
    16-bit ones as their uint16 bits (fmts), whose
    last axis is contiguous and whose row stride is at least the row length;
    their batch axes (all but the last two) broadcast to ``bshape`` by NumPy
    rules, and key/value head index (last batch axis) is query head // group.
    mask: None, a bool array (read as bytes) or an additive array of the
    compute dtype, at least 2-D, broadcastable to bshape + (N, M), strides
    multiples of its item size; mask_kind its kind.
    window (win_l, win_r): sliding window (-1: unbounded on that side), aligned like
    the causal diagonal.  softcap: > 0 caps the scaled scores (s -> softcap
    tanh(s / softcap)) before the mask; 0 for none.
    fmts (q_fmt, k_fmt, v_fmt): 0 when that operand has the compute dtype (out's),
    1 for bfloat16, 2 for float16 (16-bit elements read in place; not with
    weights, nor for an int8 key / value).
    slopes, sinks: None or a C-contiguous float64 array of one value
    per batch element (nb): the ALiBi slope (score(i, j) -= slope |i + M -
    N - j|) and the attention sink logit (its exp joins every row's softmax
    denominator) of each.
    bf16dot: bfloat16 dot products in the fused AVX-512 kernel (float32
    compute dtype): 1 vdpbf16ps (the CPU must have AVX512_BF16), 2 the same
    arithmetic in AVX-512F (tests), 0 float32 products.
    qk8: int8 Q.K^T (float32 compute dtype; see attncore._int8): q is then
    int8 bshape + (N, ld) C-contiguous, ld a multiple of 4 >= D, zero padded;
    q_scales its rows' scales, (nb, N) float32 C-contiguous; the keys are
    int8 rows likewise padded with k_scales (..., M, 2) = per key (scale,
    128 sum k8 as the bits of an int32) ((..., M, 1), the scales alone, for
    qk8 3 or N <= SMALL_ROWS).  1 vpdpbusd (the CPU must have AVX512_VNNI),
    2 the same in AVX-512BW (tests), 3 products of the dequantized rows; 4
    vpmaddubsw with the sign trick (AVX2; keys in [-127, 127]), 5 AVX-VNNI
    vpdpbusd, 6 its AVX2 spelling (tests).  1 / 2 run on the avx512 path's
    fused kernel, 4 - 6 on the avx2 path's; elsewhere (a few rows, another
    path) the dequantized rows' float products.
    plan: Bq, Bk (tiles), nsplit, chunk (key splits), nthreads.

    Returns whether every element of ``out`` is finite (a float32 output of
    finite operands that is not: an overflow, computed again in float64).
    """
    # the fields by position (CALL_FIELDS, PLAN_FIELDS): a named field's
    # lookup is several dictionary probes, and a small call right after a
    # large one finds them out of cache (about 1 microsecond each)
    if not (isinstance(call, tuple) and isinstance(call[_C_PLAN], tuple)):
        raise TypeError(f"call must be an attncore._call.Call, got {type(call).__name__}")
    cdef tuple c = <tuple>call
    cdef tuple pl = <tuple>c[_C_PLAN]
    q, k, v, mask = c[_C_Q], c[_C_K], c[_C_V], c[_C_MASK]
    cdef tuple bshape = c[_C_BSHAPE]
    cdef Py_ssize_t group = c[_C_GROUP]
    cdef int mask_kind = c[_C_MASK_KIND]
    cdef int N = c[_C_N], M = c[_C_M], D = c[_C_D], Dv = c[_C_DV], causal = c[_C_CAUSAL]
    cdef double scale = c[_C_SCALE], softcap = c[_C_SOFTCAP]
    cdef int Bq = pl[_P_BQ], Bk = pl[_P_BK], nsplit = pl[_P_NSPLIT], nthreads = pl[_P_NTHREADS]
    cdef Py_ssize_t chunk = pl[_P_CHUNK]
    cdef tuple window = c[_C_WINDOW], fmts = c[_C_FMTS]
    cdef int win_l = window[0], win_r = window[1]
    k_scales, v_scales, q_scales = c[_C_K_SCALES], c[_C_V_SCALES], c[_C_Q_SCALES]
    cdef int q_fmt = fmts[0], k_fmt = fmts[1], v_fmt = fmts[2]
    alibi_slopes, sinks = c[_C_SLOPES], c[_C_SINKS]
    cdef int bf16dot = c[_C_BF16DOT], qk8 = c[_C_QK8]
    cdef bint kvcopy = pl[_P_KVCOPY], fused = pl[_P_FUSED]
    cdef const double[::1] slopes_v
    cdef const double[::1] sinks_v
    cdef _Buffers bufs
    cdef Py_buffer *bq
    cdef Py_buffer *bk
    cdef Py_buffer *bv
    cdef Py_buffer *bo
    cdef Py_buffer *bm = NULL
    cdef Py_buffer *bw = NULL
    cdef Py_buffer *bl = NULL
    cdef Py_buffer *bks = NULL
    cdef Py_buffer *bvs = NULL
    cdef Py_buffer *bqs = NULL
    cdef bint have_m, have_w, have_ks, have_vs
    cdef ac_params p
    cdef _Ops ops
    cdef Py_ssize_t nb = 1, d, nd = len(bshape)
    cdef Py_ssize_t shp[32]
    cdef Py_ssize_t *offs = NULL
    cdef int err = 0
    cdef int nonfinite = 0
    cdef bint is64
    if nd > 32:
        raise ValueError("at most 32 batch dimensions are supported")
    for d in range(nd):
        shp[d] = bshape[d]
        nb *= shp[d]
    if nb == 0 or N == 0:
        return True
    offs = <Py_ssize_t *>malloc(6 * nb * sizeof(Py_ssize_t))
    if offs == NULL:
        raise MemoryError()
    bufs.n = 0
    try:
        bq = _acquire(&bufs, q, PyBUF_RECORDS_RO)
        bk = _acquire(&bufs, k, PyBUF_RECORDS_RO)
        bv = _acquire(&bufs, v, PyBUF_RECORDS_RO)
        bo = _acquire(&bufs, out, PyBUF_RECORDS)
        if mask is not None:
            bm = _acquire(&bufs, mask, PyBUF_RECORDS_RO)
        if weights is not None:
            bw = _acquire(&bufs, weights, PyBUF_RECORDS)
        if lse is not None:
            bl = _acquire(&bufs, lse, PyBUF_RECORDS)
            if bl.itemsize != bo.itemsize or bl.len != nb * N * bl.itemsize:
                raise ValueError("lse must be a C-contiguous (nb, N) array of the kernel dtype")
        if bo.itemsize == 8:
            is64 = True
        elif bo.itemsize == 4:
            is64 = False
        else:
            raise TypeError("kernel dtype must be float32 or float64")
        if (q_fmt not in (0, 1, 2) or k_fmt not in (0, 1, 2) or v_fmt not in (0, 1, 2)
                or (weights is not None and (q_fmt or k_fmt or v_fmt))
                or (k_scales is not None and k_fmt) or (v_scales is not None and v_fmt)):
            raise ValueError("invalid operand formats")
        if qk8:
            if (qk8 not in (1, 2, 3, 4, 5, 6) or (qk8 == 1 and not ac_cpu_vnni())
                    or (qk8 == 2 and ac_best_path != AC_PATH_AVX512)
                    or (qk8 in (4, 6) and ac_best_path < AC_PATH_AVX2)
                    or (qk8 == 5 and not (ac_cpu_avxvnni() and ac_best_path >= AC_PATH_AVX2))
                    or is64 or q_fmt or k_fmt
                    or weights is not None or k_scales is None or q_scales is None):
                raise ValueError("invalid qk8")
            bqs = _acquire(&bufs, q_scales, PyBUF_RECORDS_RO)
            if (bq.itemsize != 1 or bq.len != nb * N * bq.shape[bq.ndim - 1]
                    or bq.shape[bq.ndim - 1] % AC_I8_ROW_ALIGN or bq.shape[bq.ndim - 1] < D
                    or not PyBuffer_IsContiguous(bq, b'C')
                    or bqs.itemsize != 4 or bqs.len != nb * N * 4
                    or not PyBuffer_IsContiguous(bqs, b'C')):
                raise ValueError("qk8: q must be int8 bshape + (N, ld) C-contiguous, q_scales "
                                 "(nb, N) float32")
        if k_scales is not None:
            bks = _acquire(&bufs, k_scales, PyBUF_RECORDS_RO)
        if v_scales is not None:
            bvs = _acquire(&bufs, v_scales, PyBUF_RECORDS_RO)
        have_m = bm != NULL
        have_w = bw != NULL
        have_ks = bks != NULL
        have_vs = bvs != NULL
        if (bq.itemsize != (2 if q_fmt else 1 if qk8 else bo.itemsize)
                or bk.itemsize != (1 if have_ks else 2 if k_fmt else bo.itemsize)
                or bv.itemsize != (1 if have_vs else 2 if v_fmt else bo.itemsize)
                or (have_w and bw.itemsize != bo.itemsize)
                or (have_ks and bks.itemsize != bo.itemsize)
                or (have_vs and bvs.itemsize != bo.itemsize)):
            raise TypeError("query, key, value and out must share one dtype (int8 key / value "
                            "with scales of that dtype)")
        if ((<size_t>bq.buf) % <size_t>bq.itemsize or (<size_t>bk.buf) % <size_t>bk.itemsize
                or (<size_t>bv.buf) % <size_t>bv.itemsize):
            # (the checks give the kernels aligned operands; a call from a
            # description cached by metadata, _lean.plain_call, meets
            # a misaligned one here and takes the general path)
            raise Misaligned("query, key and value must be aligned to their item size")
        if have_w and (have_ks or have_vs):
            raise TypeError("the weights path takes float keys and values")
        if ((have_ks and (bks.ndim < 2 or bks.ndim - 2 > nd))
                or (have_vs and (bvs.ndim < 2 or bvs.ndim - 2 > nd))):
            raise ValueError("scale ranks do not match the batch shape")
        if (bq.ndim < 2 or bk.ndim < 2 or bv.ndim < 2 or bq.ndim - 2 > nd or bk.ndim - 2 > nd
                or bv.ndim - 2 > nd or (have_m and (bm.ndim < 2 or bm.ndim - 2 > nd))):
            raise ValueError("operand ranks do not match the batch shape")
        _fill_offsets(bq, nd, shp, 1, offs)
        _fill_offsets(bk, nd, shp, group, offs + nb)
        _fill_offsets(bv, nd, shp, group, offs + 2 * nb)
        p.N = N
        p.M = M
        if (bf16dot not in (0, 1, 2, 3, 4) or (bf16dot == 1 and not ac_cpu_bf16_dot())
                or (bf16dot == 3 and not (ac_cpu_vnni() if qk8 in (1, 2) else ac_cpu_avxvnni()))
                or (bf16dot in (3, 4) and qk8 not in (1, 2, 4, 5, 6))):
            raise ValueError("invalid bf16dot")
        ac_size_scratch(&p, D, Dv, Bq, Bk, is64, have_ks, have_vs, q_fmt, k_fmt, v_fmt,
                        0 if is64 else bf16dot, qk8)
        if have_ks:
            _fill_offsets(bks, nd, shp, group, offs + 4 * nb)
            p.ks_rs = _row_stride(bks)

        if have_vs:
            _fill_offsets(bvs, nd, shp, group, offs + 5 * nb)
            p.vs_rs = _row_stride(bvs)
        if len(c) > CALL_Q4_INDEX and c[CALL_Q4_INDEX] is not None:
            _set_q4(&p, c[CALL_Q4_INDEX], bk, bv, bks, bvs, D, Dv,
                    is64 or qk8 != 0 or bf16dot != 0)
        p.q_rs = _row_stride(bq)
        p.k_rs = _row_stride(bk)
        p.v_rs = _row_stride(bv)
        # float32 keys / values whose rows are not contiguous: each query
        # block of the fused kernel copies them once for its panels
        # (plan.kvcopy; 1 values, 2 keys)
        p.kvcopy = 0
        if kvcopy and fused and not is64 and not qk8 and not bf16dot:
            if not have_vs and not v_fmt and p.v_rs != Dv:
                p.kvcopy |= 1
            if not have_ks and not k_fmt and p.k_rs != D:
                p.kvcopy |= 2
        # float32 keys / values over many keys: a block's panels take turns
        # over chunks (plan.kchunk)
        if fused and not is64 and not qk8 and not bf16dot and not have_ks and not have_vs \
                and not k_fmt and not v_fmt:
            p.kchunk = pl[_P_KCHUNK]
        ac_size_kvcopy(&p)
        # (the fused kernel's int8 products read per key (scale, 128 sum k8);
        # the direct loops of a few rows only the scale)
        if qk8 and ((N > AC_SMALL_ROWS and qk8 != 3
                     and (bks.shape[bks.ndim - 1] != 2 or (M > 1 and p.ks_rs != 2)))
                    or (bks.shape[bks.ndim - 1] == 2 and bks.strides[bks.ndim - 1] != 4)
                    or bks.shape[bks.ndim - 1] > 2 or bk.shape[bk.ndim - 1] % 4
                    or bk.shape[bk.ndim - 1] < D or p.k_rs % 4
                    or (<size_t>bk.buf) % 4):
            raise ValueError("qk8: keys must be int8 rows of a multiple of 4 bytes, k_scales "
                             "(..., M, 2) float32 pairs")
        p.mask_rs = 0
        p.mask_cs = 0
        if have_m:
            _fill_offsets(bm, nd, shp, 1, offs + 3 * nb)
            if bm.shape[bm.ndim - 2] != 1:
                p.mask_rs = bm.strides[bm.ndim - 2] // bm.itemsize
            if bm.shape[bm.ndim - 1] != 1:
                p.mask_cs = bm.strides[bm.ndim - 1] // bm.itemsize
        p.mask_kind = mask_kind if have_m else AC_MASK_NONE
        p.causal = causal
        p.win_l = win_l
        p.win_r = win_r
        p.band = 1 if (causal != 0 or win_l >= 0 or win_r >= 0) else 0
        p.scale = scale
        p.softcap = softcap
        p.alibi_on = 0
        p.alibi = 0.0
        p.sink = -INFINITY
        ops.slopes = NULL
        ops.sinks = NULL
        ops.qsc = <const float *>bqs.buf if bqs != NULL else NULL
        if alibi_slopes is not None:
            slopes_v = alibi_slopes
            if slopes_v.shape[0] != nb:
                raise ValueError("alibi_slopes must hold one value per batch element")
            p.alibi_on = 1
            ops.slopes = &slopes_v[0]
        if sinks is not None:
            sinks_v = sinks
            if sinks_v.shape[0] != nb:
                raise ValueError("sinks must hold one value per batch element")
            ops.sinks = &sinks_v[0]
        ops.q = <char *>bq.buf
        ops.k = <char *>bk.buf
        ops.v = <char *>bv.buf
        ops.out = <char *>bo.buf
        ops.mask = <char *>bm.buf if have_m else NULL
        ops.w = <char *>bw.buf if have_w else NULL
        ops.lse = <char *>bl.buf if bl != NULL else NULL
        ops.qo = offs
        ops.ko = offs + nb
        ops.vo = offs + 2 * nb
        ops.mo = offs + 3 * nb
        ops.ksc = <char *>bks.buf if have_ks else NULL
        ops.vsc = <char *>bvs.buf if have_vs else NULL
        ops.kso = offs + 4 * nb
        ops.vso = offs + 5 * nb
        with nogil:
            if have_w:
                if is64:
                    _run_weights(&p, &ops, nb, nthreads, <double>0)
                else:
                    _run_weights(&p, &ops, nb, nthreads, <float>0)
            else:
                if is64:
                    err = _run_flash(&p, &ops, nb, nsplit, chunk, nthreads, &nonfinite,
                                     <double>0)
                else:
                    err = _run_flash(&p, &ops, nb, nsplit, chunk, nthreads, &nonfinite,
                                     <float>0)
        if err:
            raise MemoryError("attncore: could not allocate the kernel's scratch memory")
        # the flash items checked their own rows; the weights path writes
        # the output in one pass
        return _finite(bo) if have_w else nonfinite == 0
    finally:
        _release_all(&bufs)
        free(offs)


# --------------------------------------------------------------------------
# paged key / value caches
# --------------------------------------------------------------------------
# keys a query block of a few rows stages at a time (all its key heads:
# 64 rows of 8 x 128 float32 keys and values are 512 KiB, within an L2)
DEF _STAGE_SMALL = 64
DEF _STAGE_BYTES = 2097152


cdef struct _PItem:
    double gcost    # the same of its (sequence, head): the order of the work list
    double cost     # query rows x keys seen by this item
    int seq
    int head        # query head; with fold, the key head
    int fold        # 1: the rows are the query heads of one key head (one query)
    int qb          # query block (rows of the sequence, or of the head group)
    int split       # key split of the item
    int nsplit      # key splits of its (sequence, head, block)
    int slot        # where a split item's partial lives (part, pbad)


cdef struct _POps:
    char *q
    char *k
    char *v
    char *ksc
    char *vsc
    char *out
    char *lse
    char *part      # split items' partials: Bq x (Dv + 2) per slot
    int *pbad       # their flags: Bq per slot
    const int32_t *bt
    const int64_t *cuq
    const int64_t *lens
    const int64_t *koff           # packed calls: the sequences' first keys (else NULL)
    Py_ssize_t bt_rs              # block table row stride (elements)
    Py_ssize_t q_hs               # query head stride (elements; q_rs: token stride)
    Py_ssize_t k_bs, k_hs, v_bs, v_hs     # block / head strides (elements)
    Py_ssize_t ks_bs, ks_hs, vs_bs, vs_hs   # the same of int8 scales
    Py_ssize_t chunk              # keys per split (a multiple of bs)
    int Hq, group, bs
    int qkind, kkind, vkind       # 0 compute dtype, 1 16-bit, 2 int8 (bytes)
    int runs                      # physically consecutive blocks read as one range
    Py_ssize_t k_isz, v_isz       # bytes per cache element
    Py_ssize_t sc_isz             # bytes per int8 scale (the compute dtype)
    # keys staged (dense, in the thread's scratch) at a time by query
    # blocks of more than AC_SMALL_ROWS rows (stage) and of a few
    # (stage_small); strided: a head's key / value rows are not dense
    # (query blocks of many rows then stage every range)
    int stage
    int stage_small
    int strided
    Py_ssize_t stage_rows         # (key, head) rows the staging buffer holds
    Py_ssize_t stage_off          # bytes from a thread's scratch to its staging rows
    Py_ssize_t tag_off            # ... and to the _Staged record of what they hold
    const double *slopes          # ALiBi slope per (sequence, query head), or NULL
    const double *sinks           # sink logit per (sequence, query head), or NULL


cdef inline const floating *_elems(const char *base, Py_ssize_t off, int kind,
                                   floating dummy) noexcept nogil:
    """The operand at element offset off: kind 0 compute-dtype elements,
    1 16-bit elements (read as uint16_t by the kernel), 2 int8 (bytes)."""
    if kind == 1:
        return <const floating *>((<const uint16_t *>base) + off)
    if kind == 2:
        return <const floating *>(base + off)
    return (<const floating *>base) + off


cdef inline void _absorb(int nq, int Dv, floating *acc, floating *m, floating *l, int *bad,
                         const floating *acc2, const floating *m2, const floating *l2,
                         const int *bad2) noexcept nogil:
    """Fold the partial (acc2, m2, l2, bad2) of a further key range into
    the running state (acc, m, l, bad): the exact online-softmax merge."""
    cdef int r, d
    cdef floating mx, a, b
    cdef floating *ar
    cdef const floating *br
    for r in range(nq):
        bad[r] = bad[r] | bad2[r]
        if l[r] != 0 or l2[r] != 0:
            # a finite score in either range: an overflowed one's flag drops
            # (ac_sdpa.h, AC_BAD_OVF)
            bad[r] = bad[r] & ~AC_BAD_OVF
        if l2[r] == 0:
            continue
        ar = acc + r * Dv
        br = acc2 + r * Dv
        if l[r] == 0:
            memcpy(ar, br, Dv * sizeof(floating))
            m[r] = m2[r]
            l[r] = l2[r]
            continue
        mx = m[r] if m[r] > m2[r] else m2[r]
        a = exp(m[r] - mx)
        b = exp(m2[r] - mx)
        for d in range(Dv):
            ar[d] = a * ar[d] + b * br[d]
        l[r] = a * l[r] + b * l2[r]
        m[r] = mx


cdef inline Py_ssize_t _stage_end(Py_ssize_t cap, Py_ssize_t j, Py_ssize_t ke) noexcept nogil:
    """The end of the range _stage_keys stages from key j."""
    return ke if ke - j < cap else j + cap


cdef inline Py_ssize_t _stage_bytes(const ac_params *pb, const _POps *ops,
                                    Py_ssize_t cap) noexcept nogil:
    """Bytes of the staging area of cap (key, head) rows: K rows, V rows,
    then the int8 scales (one of the compute dtype per row each)."""
    return cap * (pb.D * ops.k_isz + pb.Dv * ops.v_isz + 2 * ops.sc_isz)


cdef struct _Staged:
    Py_ssize_t seq, hk0, j, je, cap   # what a thread's staging buffer holds (seq -1: nothing)
    int nh


cdef inline void _stage_rows(char *dst, const char *src, Py_ssize_t take, Py_ssize_t nh,
                             Py_ssize_t srs, Py_ssize_t shs, Py_ssize_t w) noexcept nogil:
    """take rows of nh pieces of w bytes (rows srs bytes apart, pieces shs
    apart) made dense at dst, row after row: one copy when the pieces and
    the rows follow each other, one per row when the pieces do."""
    cdef Py_ssize_t r, t
    if shs == w and (srs == nh * w or take == 1):
        memcpy(dst, src, take * nh * w)
    elif shs == w:
        for r in range(take):
            memcpy(dst + r * nh * w, src + r * srs, nh * w)
    else:
        for r in range(take):
            for t in range(nh):
                memcpy(dst + (r * nh + t) * w, src + r * srs + t * shs, w)


cdef inline void _stage_keys(const ac_params *pb, const _POps *ops, const int32_t *row,
                             Py_ssize_t base, Py_ssize_t hk0, int nh, Py_ssize_t j,
                             Py_ssize_t je, Py_ssize_t cap, char *st) noexcept nogil:
    """Copy keys [j, je) (at most cap) of key heads hk0 .. hk0 + nh - 1
    of the sequence whose key 0 is slot base of its blocks (row) dense
    into st, as the pool lays them out (key after key, each key's heads
    side by side): K rows at st, V rows at st + cap nh D (key bytes), the
    int8 scales after them (_stage_bytes).  A block's keys of all heads are
    usually one stretch of the pool: one copy, read in order."""
    cdef Py_ssize_t bs = ops.bs, n = 0, blk, bid, off, take
    cdef Py_ssize_t kb = pb.D * ops.k_isz, vb = pb.Dv * ops.v_isz, sc = ops.sc_isz
    cdef char *vd = st + cap * nh * kb
    cdef char *ksd = vd + cap * nh * vb
    cdef char *vsd = ksd + cap * nh * sc
    while j < je:
        blk = (base + j) // bs
        bid = row[blk]
        off = base + j - blk * bs
        take = bs - off
        if take > je - j:
            take = je - j
        _stage_rows(st + n * nh * kb,
                    ops.k + (bid * ops.k_bs + off * pb.k_rs + hk0 * ops.k_hs) * ops.k_isz,
                    take, nh, pb.k_rs * ops.k_isz, ops.k_hs * ops.k_isz, kb)
        _stage_rows(vd + n * nh * vb,
                    ops.v + (bid * ops.v_bs + off * pb.v_rs + hk0 * ops.v_hs) * ops.v_isz,
                    take, nh, pb.v_rs * ops.v_isz, ops.v_hs * ops.v_isz, vb)
        if ops.kkind == 2:
            _stage_rows(ksd + n * nh * sc,
                        ops.ksc + (bid * ops.ks_bs + off * pb.ks_rs + hk0 * ops.ks_hs) * sc,
                        take, nh, pb.ks_rs * sc, ops.ks_hs * sc, sc)
        if ops.vkind == 2:
            _stage_rows(vsd + n * nh * sc,
                        ops.vsc + (bid * ops.vs_bs + off * pb.vs_rs + hk0 * ops.vs_hs) * sc,
                        take, nh, pb.vs_rs * sc, ops.vs_hs * sc, sc)
        n += take
        j += take


cdef inline Py_ssize_t _paged_range(const _POps *ops, const int32_t *row, Py_ssize_t base,
                                    Py_ssize_t j, Py_ssize_t ke, Py_ssize_t *bid,
                                    Py_ssize_t *off) noexcept nogil:
    """The end of the range of keys from key j (< ke) read in place: its
    block, or the run of physically consecutive blocks from it (ops.runs),
    within ke; bid / off: its block id and first slot."""
    cdef Py_ssize_t bs = ops.bs, blk = (base + j) // bs
    cdef Py_ssize_t je = (blk + 1) * bs - base
    bid[0] = row[blk]
    off[0] = base + j - blk * bs
    if ops.runs:
        while je < ke and row[(base + je) // bs] == row[(base + je) // bs - 1] + 1:
            je += bs
    return ke if je > ke else je


cdef inline int _paged_keys_fold(const ac_params *pb, const _POps *ops, Py_ssize_t s,
                                 Py_ssize_t hk0, int nh, const floating *q, int nq,
                                 Py_ssize_t ks, Py_ssize_t ke, floating *buf) noexcept nogil:
    """_paged_keys of a folded item of at most AC_SMALL_ROWS rows per key
    head (a one-query sequence's query heads, a key head's group at a
    time): the keys read in place, a block (or a run of physically
    consecutive ones) at a time, every key head's group of rows on it in
    turn (the block's stretch of the pool read while it is in cache), each
    group's running state continued from range to range (ac_params.resume:
    no staging copy, no merge), and the kernel's prefetch running on into
    the rows read next (the next head's, after the last head the next
    block's: ac_params.knext / vnext).  Returns whether any key tile was
    processed."""
    cdef Py_ssize_t Dv = pb.Dv
    cdef floating *S = buf
    cdef floating *acc = S + pb.s_len
    cdef floating *m = acc + pb.Bq * Dv
    cdef floating *l = m + pb.Bq
    cdef floating *alpha = l + pb.Bq
    cdef int *bad = <int *>(alpha + pb.Bq)
    cdef const int32_t *row = ops.bt + s * ops.bt_rs
    cdef Py_ssize_t base = ops.koff[s] if ops.koff != NULL else 0
    cdef ac_params pc = pb[0]
    cdef Py_ssize_t j = ks, je, jn, bid, off, bidn = 0, offn = 0, hk, ko, vo
    cdef Py_ssize_t qstep = ops.group * ops.q_hs * (2 if ops.qkind == 1 else sizeof(floating))
    cdef int any = 0, got = 0, t
    cdef const floating *ksp = NULL
    cdef const floating *vsp = NULL
    cdef floating dummy = 0
    je = _paged_range(ops, row, base, j, ke, &bid, &off) if j < ke else ke
    while j < ke:
        jn = _paged_range(ops, row, base, je, ke, &bidn, &offn) if je < ke else ke
        # key j of the sequence is key 0 of this range (M shifted by j)
        pc.M = <int>(pb.M - j)
        pc.kbase = pb.kbase + j
        pc.resume = any
        for t in range(nh):
            hk = hk0 + t
            ko = bid * ops.k_bs + off * pb.k_rs + hk * ops.k_hs
            vo = bid * ops.v_bs + off * pb.v_rs + hk * ops.v_hs
            if t + 1 < nh:
                pc.knext = _elems(ops.k, ko + ops.k_hs, ops.kkind, dummy)
                pc.vnext = _elems(ops.v, vo + ops.v_hs, ops.vkind, dummy)
            elif je < ke:
                pc.knext = _elems(ops.k, bidn * ops.k_bs + offn * pb.k_rs + hk0 * ops.k_hs,
                                  ops.kkind, dummy)
                pc.vnext = _elems(ops.v, bidn * ops.v_bs + offn * pb.v_rs + hk0 * ops.v_hs,
                                  ops.vkind, dummy)
            else:
                pc.knext = NULL
                pc.vnext = NULL
            if ops.kkind == 2:
                ksp = ((<const floating *>ops.ksc) + bid * ops.ks_bs + off * pb.ks_rs
                       + hk * ops.ks_hs)
            if ops.vkind == 2:
                vsp = ((<const floating *>ops.vsc) + bid * ops.vs_bs + off * pb.vs_rs
                       + hk * ops.vs_hs)
            got = _range(&pc, <const floating *>((<const char *>q) + t * qstep),
                         _elems(ops.k, ko, ops.kkind, dummy), _elems(ops.v, vo, ops.vkind, dummy),
                         ksp, vsp, NULL, <const floating *>NULL, 0, nq, 0, je - j, S,
                         acc + t * nq * Dv, m + t * nq, l + t * nq, alpha, bad + t * nq)
        any = any | got
        j = je
        je = jn
        bid = bidn
        off = offn
    if not any:
        for t in range(nq * nh):
            m[t] = -INFINITY
            l[t] = 0
            bad[t] = 0
    return any


cdef inline int _paged_keys(const ac_params *pb, const _POps *ops, Py_ssize_t s,
                            Py_ssize_t hk0, int nh, const floating *q, Py_ssize_t i0, int nq,
                            Py_ssize_t ks, Py_ssize_t ke, floating *buf) noexcept nogil:
    """Query rows [i0, i0 + nq) of pb over the sequence's keys [ks, ke)
    into the running state at buf + s_len (acc, m, l, alpha, bad), the next
    range's partial after it; nh > 1 (a folded item): key heads hk0 ..
    hk0 + nh - 1 in turn on each range (the block's rows are read while
    they are in cache), their query rows G * q_hs elements apart and their
    state one after the other.  Keys are read in place a run of physically
    consecutive blocks at a time, or staged dense in the thread's scratch
    (_stage_keys, the pool read in its own order): every range where a
    head's rows are not dense (the paged layout, heads side by side: read
    head by head in place, a block is pieces a 4 KiB multiple apart that
    the hardware prefetchers follow badly), up to ops.stage_small keys of
    all the item's heads for a few query rows and ops.stage keys for
    more, and otherwise the runs shorter than that (the kernel's tiles
    stay long, its per-range work amortized).  A thread's staged keys serve
    its next item of the same head and key range.  Returns whether any key
    tile was processed."""
    cdef Py_ssize_t Bq = pb.Bq, Dv = pb.Dv, bs = ops.bs
    cdef floating *S = buf
    cdef floating *acc = S + pb.s_len
    cdef floating *m = acc + Bq * Dv
    cdef floating *l = m + Bq
    cdef floating *alpha = l + Bq
    cdef int *bad = <int *>(alpha + Bq)
    cdef floating *acc2 = alpha + 2 * Bq
    cdef floating *m2 = acc2 + Bq * Dv
    cdef floating *l2 = m2 + Bq
    cdef int *bad2 = <int *>(l2 + Bq)
    cdef const int32_t *row = ops.bt + s * ops.bt_rs
    # where the sequence's key 0 lies in its blocks (packed calls: one block,
    # the whole key array)
    cdef Py_ssize_t base = ops.koff[s] if ops.koff != NULL else 0
    cdef char *st = (<char *>buf) + ops.stage_off
    cdef _Staged *tag = <_Staged *>((<char *>buf) + ops.tag_off)
    cdef char *sth
    cdef ac_params pc = pb[0]
    cdef Py_ssize_t j = ks, je, blk, bid, off, hk, r0
    cdef Py_ssize_t qstep = ops.group * ops.q_hs * (2 if ops.qkind == 1 else sizeof(floating))
    cdef int any = 0, got, done = 0, t
    cdef bint staged
    cdef const floating *kp
    cdef const floating *vp
    cdef const floating *ksp = NULL
    cdef const floating *vsp = NULL
    cdef floating dummy = 0
    cdef Py_ssize_t cap = ops.stage if nq > AC_SMALL_ROWS else ops.stage_small
    if cap * nh > ops.stage_rows:
        cap = ops.stage_rows // nh  # the buffer holds stage_rows (key, head) rows
    cdef const floating *qt
    while j < ke:
        blk = (base + j) // bs
        bid = row[blk]
        je = (blk + 1) * bs - base
        if ops.runs:
            while je < ke and row[(base + je) // bs] == row[(base + je) // bs - 1] + 1:
                je += bs
        if je > ke:
            je = ke
        off = base + j - blk * bs
        staged = cap > 0 and (ops.strided or (je - j < cap and je < ke))
        if staged:
            je = _stage_end(cap, j, ke)
            # the keys this thread staged last serve here too when they
            # are the same head's from the same key (the blocks of one head,
            # costliest -- widest -- first)
            if not (tag.seq == s and tag.hk0 == hk0 and tag.nh == nh and tag.j == j
                    and tag.je >= je and tag.cap == cap):
                _stage_keys(pb, ops, row, base, hk0, nh, j, je, cap, st)
                tag.seq = s
                tag.hk0 = hk0
                tag.nh = nh
                tag.j = j
                tag.je = je
                tag.cap = cap
        pc.M = <int>(pb.M - j)
        pc.kbase = pb.kbase + j
        for t in range(nh):
            hk = hk0 + t
            if staged:
                # head t of the staged keys (_stage_keys' layout)
                sth = st + cap * nh * pb.D * ops.k_isz
                kp = <const floating *>(st + t * pb.D * ops.k_isz)
                vp = <const floating *>(sth + t * pb.Dv * ops.v_isz)
                sth = sth + cap * nh * pb.Dv * ops.v_isz
                ksp = (<const floating *>sth) + t
                vsp = (<const floating *>sth) + cap * nh + t
                pc.k_rs = nh * pb.D
                pc.v_rs = nh * pb.Dv
                pc.ks_rs = nh
                pc.vs_rs = nh
            else:
                pc.k_rs = pb.k_rs
                pc.v_rs = pb.v_rs
                pc.ks_rs = pb.ks_rs
                pc.vs_rs = pb.vs_rs
                kp = _elems(ops.k, bid * ops.k_bs + off * pb.k_rs + hk * ops.k_hs, ops.kkind,
                            dummy)
                vp = _elems(ops.v, bid * ops.v_bs + off * pb.v_rs + hk * ops.v_hs, ops.vkind,
                            dummy)
                if ops.kkind == 2:
                    ksp = ((<const floating *>ops.ksc) + bid * ops.ks_bs + off * pb.ks_rs
                           + hk * ops.ks_hs)
                if ops.vkind == 2:
                    vsp = ((<const floating *>ops.vsc) + bid * ops.vs_bs + off * pb.vs_rs
                           + hk * ops.vs_hs)
            # key j of the sequence is key 0 of this range (M shifted by j:
            # the band and ALiBi see the same distances)
            r0 = t * nq
            qt = <const floating *>((<const char *>q) + t * qstep)
            if not any:
                got = _range(&pc, qt, kp, vp, ksp, vsp, NULL, <const floating *>NULL, i0, nq, 0,
                             je - j, S, acc + r0 * Dv, m + r0, l + r0, alpha, bad + r0)
                done = done | got
            else:
                got = _range(&pc, qt, kp, vp, ksp, vsp, NULL, <const floating *>NULL, i0, nq, 0,
                             je - j, S, acc2, m2, l2, alpha, bad2)
                if got:
                    _absorb(nq, pb.Dv, acc + r0 * Dv, m + r0, l + r0, bad + r0, acc2, m2, l2,
                            bad2)
        any = done
        j = je
    if not any:
        for got in range(nq * nh):
            m[got] = -INFINITY
            l[got] = 0
            bad[got] = 0
    return any


cdef inline void _paged_rows(const ac_params *p0, const _POps *ops, const _PItem *it,
                             ac_params *pb, Py_ssize_t *h0, Py_ssize_t *i0, int *nq,
                             Py_ssize_t *orow, Py_ssize_t *ors, Py_ssize_t *lrow,
                             Py_ssize_t *lrs) noexcept nogil:
    """The params and rows of item it: pb (this sequence's N, M, slope;
    a folded item: no band, all query heads of the one query as rows), its first
    query head h0 and rows [i0, i0 + nq), its first output row and row
    stride (elements of out) and the same of the lse."""
    cdef Py_ssize_t s = it.seq, q0 = ops.cuq[it.seq], G = ops.group, Bq = p0.Bq
    pb[0] = p0[0]
    pb.M = <int>ops.lens[s]
    if it.fold:
        # every query head of the sequence's one query; the kernel sees
        # them a key head (G rows) at a time
        h0[0] = 0
        i0[0] = 0
        nq[0] = ops.Hq
        pb.N = <int>G
        pb.q_rs = ops.q_hs
        pb.causal = AC_CAUSAL_NONE
        pb.band = 0
        orow[0] = q0 * ops.Hq * p0.Dv + h0[0] * p0.Dv
        ors[0] = p0.Dv
        lrow[0] = q0 * ops.Hq + h0[0]
        lrs[0] = 1
    else:
        h0[0] = it.head
        i0[0] = it.qb * Bq
        pb.N = <int>(ops.cuq[s + 1] - q0)
        nq[0] = <int>(Bq if pb.N - i0[0] > Bq else pb.N - i0[0])
        orow[0] = (q0 + i0[0]) * ops.Hq * p0.Dv + h0[0] * p0.Dv
        ors[0] = ops.Hq * p0.Dv
        lrow[0] = (q0 + i0[0]) * ops.Hq + h0[0]
        lrs[0] = ops.Hq
        if ops.slopes != NULL:
            pb.alibi = ops.slopes[s * ops.Hq + it.head]


cdef inline void _paged_item(const ac_params *p0, const _POps *ops, const _PItem *it,
                             floating *buf) noexcept nogil:
    """One (sequence, head or head group, query block, key split) of a
    paged call; buf is the calling thread's scratch."""
    cdef ac_params pb
    cdef Py_ssize_t h0, i0, orow, ors, lrow, lrs, lo, hi, ks, ke, r, hq
    cdef Py_ssize_t s = it.seq, Bq = p0.Bq, Dv = p0.Dv
    cdef int nq, processed
    cdef floating dummy = 0
    _paged_rows(p0, ops, it, &pb, &h0, &i0, &nq, &orow, &ors, &lrow, &lrs)
    cdef const floating *q = _elems(ops.q, ops.cuq[s] * p0.q_rs + h0 * ops.q_hs, ops.qkind,
                                    dummy)
    # the keys the rows see (the band's hull), within this split
    lo = 0
    hi = pb.M
    if it.fold:
        if p0.win_l >= 0:
            lo = pb.M - 1 - p0.win_l
    elif pb.band:
        lo = ac_band_lo(&pb, i0)
        hi = ac_causal_limit(&pb, i0 + nq - 1)
    ks = it.split * ops.chunk if it.nsplit > 1 else 0
    ke = ks + ops.chunk if it.nsplit > 1 else pb.M
    if ks < lo:
        ks = lo
    if ks < 0:
        ks = 0
    if ke > hi:
        ke = hi
    if it.fold and ops.group <= AC_SMALL_ROWS:
        processed = _paged_keys_fold(&pb, ops, s, 0, ops.Hq // ops.group, q, ops.group, ks, ke,
                                     buf)
    elif it.fold:
        processed = _paged_keys(&pb, ops, s, 0, ops.Hq // ops.group, q, 0, ops.group, ks, ke,
                                buf)
    else:
        processed = _paged_keys(&pb, ops, s, h0 // ops.group, 1, q, i0, nq, ks, ke, buf)
    cdef floating *acc = buf + pb.s_len
    cdef floating *m = acc + Bq * Dv
    cdef floating *l = m + Bq
    cdef int *bad = <int *>(l + 2 * Bq)
    cdef floating *part
    if it.nsplit > 1:
        part = (<floating *>ops.part) + it.slot * Bq * (Dv + 2)
        memcpy(part, acc, nq * Dv * sizeof(floating))
        memcpy(part + Bq * Dv, m, nq * sizeof(floating))
        memcpy(part + Bq * Dv + Bq, l, nq * sizeof(floating))
        memcpy(ops.pbad + it.slot * Bq, bad, nq * sizeof(int))
        return
    for r in range(nq):
        hq = h0 + r if it.fold else h0
        _finish(1, pb.Dv, processed, acc + r * Dv, l + r, bad + r,
                (<floating *>ops.out) + orow + r * ors, Dv, m + r,
                ops.sinks[s * ops.Hq + hq] if ops.sinks != NULL else -INFINITY)
        if ops.lse != NULL:
            _lse_rows(1, processed, m + r, l + r, bad + r,
                      (<floating *>ops.lse) + lrow + r * lrs,
                      ops.sinks[s * ops.Hq + hq] if ops.sinks != NULL else -INFINITY)


cdef inline void _paged_merge(const ac_params *p0, const _POps *ops, const _PItem *it,
                              floating dummy) noexcept nogil:
    """The key splits of item it's (sequence, head, block) merged into
    the output (it: the first split)."""
    cdef ac_params pb
    cdef Py_ssize_t h0, i0, orow, ors, lrow, lrs, r, hq
    cdef Py_ssize_t Bq = p0.Bq, Dv = p0.Dv, ss = Bq * (Dv + 2)
    cdef int nq
    cdef floating *part = (<floating *>ops.part) + it.slot * ss
    _paged_rows(p0, ops, it, &pb, &h0, &i0, &nq, &orow, &ors, &lrow, &lrs)
    for r in range(nq):
        hq = h0 + r if it.fold else h0
        _merge(it.nsplit, 1, pb.Dv, part + r * Dv, ss, part + Bq * Dv + r,
               part + Bq * Dv + Bq + r, ss, ops.pbad + it.slot * Bq + r, Bq,
               (<floating *>ops.out) + orow + r * ors, Dv,
               (<floating *>ops.lse) + lrow + r * lrs if ops.lse != NULL else NULL,
               ops.sinks[it.seq * ops.Hq + hq] if ops.sinks != NULL else -INFINITY)


cdef int _pitem_cmp(const void *a, const void *b) noexcept nogil:
    """(sequence, head) pairs costliest first, and within one its blocks
    costliest first: a thread works through one head's keys together (its
    staged keys serve the next block of the same head), the longest
    sequences start first and the cheapest blocks of the shortest ones fill
    the gaps at the end."""
    cdef const _PItem *x = <const _PItem *>a
    cdef const _PItem *y = <const _PItem *>b
    if x.gcost != y.gcost:
        return -1 if x.gcost > y.gcost else 1
    if x.seq != y.seq:
        return -1 if x.seq < y.seq else 1
    if x.head != y.head:
        return -1 if x.head < y.head else 1
    if x.cost != y.cost:
        return -1 if x.cost > y.cost else 1
    if x.qb != y.qb:
        return -1 if x.qb < y.qb else 1
    return -1 if x.split < y.split else (1 if x.split > y.split else 0)


cdef int _run_paged(const ac_params *p, const _POps *ops, const _PItem *items, Py_ssize_t W,
                    const _PItem *firsts, Py_ssize_t F, int nthreads,
                    floating dummy) noexcept nogil:
    """The items, claimed one at a time in the order given by the team's
    threads (attncore's own team, src/ac_team.h), then the merge of the
    split ones (firsts: their first splits).  Each thread's scratch: the
    kernel's, the running state and one partial.  0 on success, -1 when
    memory ran out."""
    cdef Py_ssize_t total = ops.tag_off + sizeof(_Staged)
    cdef void *raw = NULL
    cdef floating *buf = NULL
    cdef int err = 0
    cdef Py_ssize_t w
    cdef _TeamJob j
    if nthreads <= 1:
        raw = malloc(total + 64)
        buf = <floating *>_align64(raw)
        if buf == NULL:
            return -1
        (<_Staged *>((<char *>buf) + ops.tag_off)).seq = -1
        ac_blas_hold()
        for w in range(W):
            _paged_item(p, ops, items + w, buf)
        ac_blas_release()
        free(raw)
        for w in range(F):
            _paged_merge(p, ops, firsts + w, dummy)
        return 0
    j.p = p
    j.ops = <void *>ops
    j.items = items
    j.nbytes = total
    j.dbl = floating is double
    if _team_job_init(&j, nthreads):
        return -1
    ac_team_run(nthreads, W, _paged_job_item, _slot_done, &j)
    err = _team_job_free(&j, nthreads, NULL)
    if err == 0 and F:
        j.items = firsts
        ac_team_run(nthreads, F, _paged_job_merge, NULL, &j)
    return err


cdef void _paged_job_item(void *c, Py_ssize_t w, int slot) noexcept nogil:
    cdef _TeamJob *j = <_TeamJob *>c
    cdef const _POps *ops = <const _POps *>j.ops
    cdef int fresh = j.raw[slot] == NULL
    cdef void *buf = _slot_scratch(j, slot)
    if buf == NULL:
        return
    if fresh:
        (<_Staged *>((<char *>buf) + ops.tag_off)).seq = -1
    if j.dbl:
        _paged_item(j.p, ops, (<const _PItem *>j.items) + w, <double *>buf)
    else:
        _paged_item(j.p, ops, (<const _PItem *>j.items) + w, <float *>buf)


cdef void _paged_job_merge(void *c, Py_ssize_t w, int slot) noexcept nogil:
    cdef _TeamJob *j = <_TeamJob *>c
    if j.dbl:
        _paged_merge(j.p, <const _POps *>j.ops, (<const _PItem *>j.items) + w, <double>0)
    else:
        _paged_merge(j.p, <const _POps *>j.ops, (<const _PItem *>j.items) + w, <float>0)


cdef inline Py_ssize_t _stride(const Py_buffer *b, int axis) noexcept nogil:
    return b.strides[axis] // b.itemsize


cdef inline void _paged_items(_PItem *items, Py_ssize_t *w, _PItem *firsts, Py_ssize_t *F,
                              Py_ssize_t *nslot, Py_ssize_t s, Py_ssize_t h, int fold,
                              Py_ssize_t qb, Py_ssize_t ns, double cost) noexcept nogil:
    """Append the ns key splits of one (sequence, head, block) to the work
    list (and its first split to firsts when it splits)."""
    cdef Py_ssize_t sp
    for sp in range(ns):
        items[w[0]].cost = cost
        items[w[0]].seq = <int>s
        items[w[0]].head = <int>h
        items[w[0]].fold = fold
        items[w[0]].qb = <int>qb
        items[w[0]].split = <int>sp
        items[w[0]].nsplit = <int>ns
        items[w[0]].slot = <int>(nslot[0] + sp) if ns > 1 else 0
        w[0] += 1
    if ns > 1:
        firsts[F[0]] = items[w[0] - ns]
        F[0] += 1
        nslot[0] += ns


def sdpa_paged(call, out, lse=None):
    """Run the paged kernel of ``call``, an attncore._call.Call with a
    block table (see attncore._paged), into ``out`` (C-contiguous
    (total_q, Hq, Dv) of the compute dtype) and ``lse`` (None or
    C-contiguous (total_q, Hq)).  Its fields:

    q (total_q, Hq, D): the compute dtype or 16-bit bits (fmts[0]), last
    axis contiguous.  k (num_blocks, bs, Hk, D), v (num_blocks, bs, Hk,
    Dv): the caches, of the compute dtype, 16-bit bits (fmts) or int8 with
    k_scales / v_scales (num_blocks, bs, Hk) of the compute dtype, or
    4-bit (q4: the group sizes) codes (num_blocks, bs, Hk, D / 2) with
    float32 slots (num_blocks, bs, Hk, D / gs) as their scales (float32
    calls; read in place, never staged); last axis contiguous, strides
    non-negative multiples of the item size.
    block_table (S, max_blocks) int32 C-contiguous; seq_lens (S,) int64
    (keys of each sequence; its blocks are the table row's first
    ceil(len / bs)); cu_q (S + 1,) int64 (the sequences' queries; the
    caller has checked everything against the shapes).  causal: 0 or 2
    (lower-right per sequence), 3 a window alone.  slopes / sinks: None or
    C-contiguous float64 (S * Hq,).  fold: the query heads of a key head
    of a one-query sequence run as rows of one item, key head after key head
    on each block (no ALiBi; plan.Bq must be at least Hq; at most
    AC_SMALL_ROWS rows per key head: the keys read in place, each head's
    state continued from block to block, _paged_keys_fold).
    plan: Bq, Bk, nthreads; plan.chunk: keys per split (a multiple of bs)
    and plan.nsplit > 1 where sequences split over keys.

    Work items are (sequence, head -- or key head with its query heads,
    for a one-query sequence when fold --, query block, key split),
    costliest first on a dynamic schedule.  Keys are read block by block in
    place (consecutive blocks as one range), the ranges merged exactly.
    Returns whether every element of ``out`` is finite.
    """
    q, k, v = call.q, call.k, call.v
    cdef const int32_t[:, ::1] bt = call.block_table
    cdef const int64_t[::1] lens = call.seq_lens
    cdef const int64_t[::1] cu_q = call.cu_q
    cdef const int64_t[::1] koff
    pl = call.plan
    cdef int group = call.group, D = call.D, Dv = call.Dv
    cdef int Bq = pl.Bq, Bk = pl.Bk, nthreads = pl.nthreads
    cdef Py_ssize_t chunk = pl.chunk
    cdef int q_fmt = call.fmts[0], k_fmt = call.fmts[1], v_fmt = call.fmts[2]
    cdef bint fold = call.fold
    # 4-bit pools: (key, value) group sizes (0: not 4-bit); codes (num_blocks,
    # bs, Hk, D / 2) read in place with float32 slots (num_blocks, bs, Hk,
    # D / gs) of float16 (scale, offset) pairs as their scales
    q4 = call.q4 if call.q4 is not None else (0, 0)
    cdef int kq4 = q4[0], vq4 = q4[1]
    cdef const double[::1] slopes_v
    cdef const double[::1] sinks_v
    cdef _Buffers bufs
    cdef Py_buffer *bq
    cdef Py_buffer *bk
    cdef Py_buffer *bv
    cdef Py_buffer *bo
    cdef Py_buffer *bl = NULL
    cdef Py_buffer *bks = NULL
    cdef Py_buffer *bvs = NULL
    cdef ac_params p
    cdef _POps ops
    cdef Py_ssize_t S = lens.shape[0], W = 0, F = 0, w, s, h, qb, nqb, ns, nq, i0, L, lo
    cdef Py_ssize_t hi, nslot = 0, H, w0, w1
    cdef double cost, gcost
    cdef _PItem *items = NULL
    cdef _PItem *firsts = NULL
    cdef char *part = NULL
    cdef int *pbad = NULL
    cdef int err = 0
    cdef bint is64
    bufs.n = 0
    try:
        bq = _acquire(&bufs, q, PyBUF_RECORDS_RO)
        bk = _acquire(&bufs, k, PyBUF_RECORDS_RO)
        bv = _acquire(&bufs, v, PyBUF_RECORDS_RO)
        bo = _acquire(&bufs, out, PyBUF_RECORDS)
        if lse is not None:
            bl = _acquire(&bufs, lse, PyBUF_RECORDS)
        if call.k_scales is not None:
            bks = _acquire(&bufs, call.k_scales, PyBUF_RECORDS_RO)
        if call.v_scales is not None:
            bvs = _acquire(&bufs, call.v_scales, PyBUF_RECORDS_RO)
        if bo.itemsize == 8:
            is64 = True
        elif bo.itemsize == 4:
            is64 = False
        else:
            raise TypeError("kernel dtype must be float32 or float64")
        if (bq.ndim != 3 or bk.ndim != 4 or bv.ndim != 4 or bo.ndim != 3
                or not PyBuffer_IsContiguous(bo, b'C')
                or (bl != NULL and (bl.itemsize != bo.itemsize
                                    or bl.len != bo.shape[0] * bo.shape[1] * bl.itemsize))
                or (bks != NULL and (bks.ndim != (4 if kq4 else 3)
                                     or bks.itemsize != bo.itemsize or bk.itemsize != 1))
                or (bvs != NULL and (bvs.ndim != (4 if vq4 else 3)
                                     or bvs.itemsize != bo.itemsize or bv.itemsize != 1))
                or (kq4 and bks == NULL) or (vq4 and bvs == NULL)
                or bq.itemsize != (2 if q_fmt else bo.itemsize)
                or (bks == NULL and bk.itemsize != (2 if k_fmt else bo.itemsize))
                or (bvs == NULL and bv.itemsize != (2 if v_fmt else bo.itemsize))):
            raise ValueError("sdpa_paged: operand layouts do not match")
        H = bq.shape[1]
        if (bo.shape[1] != H or bo.shape[2] != Dv or bq.shape[2] != D
                or bk.shape[3] * (2 if kq4 else 1) != D
                or bv.shape[3] * (2 if vq4 else 1) != Dv or group < 1 or bk.shape[2] * group != H
                or bv.shape[0] != bk.shape[0] or bv.shape[1] != bk.shape[1]
                or bv.shape[2] != bk.shape[2] or bo.shape[0] != bq.shape[0]
                or cu_q.shape[0] != S + 1 or cu_q[S] != bq.shape[0] or bt.shape[0] != S
                or Bq < 1 or Bk < 1):
            raise ValueError("sdpa_paged: operand shapes do not match")
        if fold and call.slopes is None and Bq < H:
            raise ValueError("sdpa_paged: fold needs plan.Bq >= Hq")
        if S == 0 or H == 0 or bq.shape[0] == 0 or Dv == 0:
            return True
        ac_size_scratch(&p, D, Dv, Bq, Bk, is64, bks != NULL, bvs != NULL, q_fmt, k_fmt,
                        v_fmt, 0 if is64 else call.bf16dot, 0)
        if kq4 or vq4:
            _set_q4(&p, q4, bk, bv, bks, bvs, D, Dv, is64 or call.bf16dot != 0)
        # float32 keys / values over many keys: a block's panels take turns
        # over chunks of each range (plan.kchunk)
        if (pl.fused and not is64 and bks == NULL and bvs == NULL and not k_fmt and not v_fmt
                and not call.bf16dot):
            p.kchunk = pl.kchunk
        ac_size_kvcopy(&p)
        p.N = 0
        p.M = 0
        p.q_rs = _stride(bq, 0)
        p.k_rs = _stride(bk, 1)
        p.v_rs = _stride(bv, 1)
        p.ks_rs = _stride(bks, 1) if bks != NULL else 0
        p.vs_rs = _stride(bvs, 1) if bvs != NULL else 0
        p.mask_rs = 0
        p.mask_cs = 0
        p.mask_kind = AC_MASK_NONE
        p.causal = call.causal
        p.win_l = call.window[0]
        p.win_r = call.window[1]
        p.band = 1 if (p.causal != 0 or p.win_l >= 0 or p.win_r >= 0) else 0
        p.scale = call.scale
        p.softcap = call.softcap
        p.alibi_on = 0
        p.alibi = 0.0
        p.sink = -INFINITY
        ops.slopes = NULL
        ops.sinks = NULL
        if call.slopes is not None:
            slopes_v = call.slopes
            if slopes_v.shape[0] != S * H:
                raise ValueError("alibi slopes must hold one value per (sequence, head)")
            p.alibi_on = 1
            ops.slopes = &slopes_v[0]
            fold = False
        if call.sinks is not None:
            sinks_v = call.sinks
            if sinks_v.shape[0] != S * H:
                raise ValueError("sinks must hold one value per (sequence, head)")
            ops.sinks = &sinks_v[0]
        ops.q = <char *>bq.buf
        ops.k = <char *>bk.buf
        ops.v = <char *>bv.buf
        ops.ksc = <char *>bks.buf if bks != NULL else NULL
        ops.vsc = <char *>bvs.buf if bvs != NULL else NULL
        ops.out = <char *>bo.buf
        ops.lse = <char *>bl.buf if bl != NULL else NULL
        ops.bt = &bt[0, 0] if bt.shape[1] else NULL
        ops.bt_rs = bt.shape[1]
        ops.cuq = &cu_q[0]
        ops.lens = &lens[0]
        ops.koff = NULL
        if call.cu_k is not None:
            koff = call.cu_k
            if koff.shape[0] < S or bk.shape[0] != 1 or bt.shape[1] < 1:
                raise ValueError("sdpa_paged: packed keys are one block read from offsets")
            for s in range(S):
                if koff[s] < 0 or koff[s] + lens[s] > bk.shape[1]:
                    raise ValueError("sdpa_paged: packed key offsets out of range")
                if bt[s, 0] != 0:
                    raise ValueError("sdpa_paged: packed keys are block 0")
            ops.koff = &koff[0]
        ops.q_hs = _stride(bq, 1)
        ops.k_bs = _stride(bk, 0)
        ops.k_hs = _stride(bk, 2)
        ops.v_bs = _stride(bv, 0)
        ops.v_hs = _stride(bv, 2)
        ops.ks_bs = _stride(bks, 0) if bks != NULL else 0
        ops.ks_hs = _stride(bks, 2) if bks != NULL else 0
        ops.vs_bs = _stride(bvs, 0) if bvs != NULL else 0
        ops.vs_hs = _stride(bvs, 2) if bvs != NULL else 0
        ops.Hq = <int>H
        ops.group = group
        ops.bs = <int>bk.shape[1]
        ops.qkind = 1 if q_fmt else 0
        ops.kkind = 2 if bks != NULL else (1 if k_fmt else 0)
        ops.vkind = 2 if bvs != NULL else (1 if v_fmt else 0)
        ops.chunk = chunk if pl.nsplit > 1 else 0
        ops.k_isz = bk.itemsize
        ops.v_isz = bv.itemsize
        ops.sc_isz = bo.itemsize
        # query blocks of many rows read keys staged dense, up to 256 of
        # them (at most 256 KiB) at a time, where blocks are shorter: the
        # kernel's tiles stay long and its per-range work (the query
        # panels, the merge) is amortized
        # query blocks of many rows stage up to 2 MiB of keys at a time (a
        # head's keys staged once serve its next blocks on the thread)
        ops.stage = _STAGE_BYTES // (D * ops.k_isz + Dv * ops.v_isz + 2 * ops.sc_isz)
        L = 1
        for s in range(S):
            if lens[s] > L:
                L = lens[s]
        ops.stage = max(1, min(L, ops.stage))
        ops.stage_small = min(ops.stage, _STAGE_SMALL)
        ops.stage_rows = max(ops.stage, ops.stage_small * (H // group))
        if kq4 or vq4:
            # 4-bit pools are read in place, never staged (_stage_keys copies
            # whole-byte rows with one scale each)
            ops.stage = 0
            ops.stage_small = 0
            ops.stage_rows = 0
        ops.strided = p.k_rs != D or p.v_rs != Dv
        ops.stage_off = ((p.s_len + 2 * (Bq * Dv + 5 * Bq)) * bo.itemsize + 63) // 64 * 64
        ops.tag_off = (ops.stage_off + _stage_bytes(&p, &ops, ops.stage_rows) + 63) // 64 * 64
        # consecutive block ids are one range where a block follows the
        # previous one in memory (every cache array's block stride is its
        # block's rows)
        ops.runs = (ops.k_bs == ops.bs * p.k_rs and ops.v_bs == ops.bs * p.v_rs
                    and (bks == NULL or ops.ks_bs == ops.bs * p.ks_rs)
                    and (bvs == NULL or ops.vs_bs == ops.bs * p.vs_rs))
        # the work list
        for s in range(S):
            nq = cu_q[s + 1] - cu_q[s]
            ns = (lens[s] + chunk - 1) // chunk if (ops.chunk and lens[s] > 0) else 1
            if fold and nq == 1:
                W += ns
                F += 1 if ns > 1 else 0
            else:
                W += (nq + Bq - 1) // Bq * H * ns
                F += (nq + Bq - 1) // Bq * H if ns > 1 else 0
        items = <_PItem *>malloc((W + 1) * sizeof(_PItem))
        firsts = <_PItem *>malloc((F + 1) * sizeof(_PItem))
        if items == NULL or firsts == NULL:
            raise MemoryError()
        with nogil:
            w = 0
            F = 0
            for s in range(S):
                nq = cu_q[s + 1] - cu_q[s]
                L = lens[s]
                ns = (L + chunk - 1) // chunk if (ops.chunk and L > 0) else 1
                p.N = <int>nq
                p.M = <int>L
                w0 = w
                if fold and nq == 1:
                    _paged_items(items, &w, firsts, &F, &nslot, s, 0, 1, 0, ns, <double>H * L / ns)
                else:
                    nqb = (nq + Bq - 1) // Bq
                    for qb in range(nqb):
                        i0 = qb * Bq
                        lo = 0
                        hi = L
                        if p.band:
                            hi = ac_causal_limit(&p, i0 + (Bq if nq - i0 > Bq else nq - i0) - 1)
                            lo = ac_band_lo(&p, i0)
                        if hi < lo:
                            hi = lo
                        cost = <double>(Bq if nq - i0 > Bq else nq - i0) * (hi - lo + 16) / ns
                        for h in range(H):
                            _paged_items(items, &w, firsts, &F, &nslot, s, h, 0, qb, ns, cost)
                # a head's items together: every head of a sequence costs the same
                gcost = 0
                for w1 in range(w0, w):
                    if items[w1].head == items[w0].head:
                        gcost += items[w1].cost
                for w1 in range(w0, w):
                    items[w1].gcost = gcost
            qsort(items, W, sizeof(_PItem), _pitem_cmp)
            p.N = 0
            p.M = 0
        if nslot:
            part = <char *>malloc(nslot * Bq * (Dv + 2) * bo.itemsize)
            pbad = <int *>malloc(nslot * Bq * sizeof(int))
            if part == NULL or pbad == NULL:
                raise MemoryError()
        ops.part = part
        ops.pbad = pbad
        with nogil:
            if is64:
                err = _run_paged(&p, &ops, items, W, firsts, F, nthreads, <double>0)
            else:
                err = _run_paged(&p, &ops, items, W, firsts, F, nthreads, <float>0)
        if err:
            raise MemoryError("attncore: could not allocate the kernel's scratch memory")
        return _finite(bo)
    finally:
        _release_all(&bufs)
        free(items)
        free(firsts)
        free(part)
        free(pbad)


cdef bint _finite(const Py_buffer *view) noexcept nogil:
    """Whether every float32 / float64 element of the contiguous buffer is
    finite: one vectorized pass (the kernel path's instructions)."""
    if view.itemsize == 4:
        return ac_all_finite_f32(<const float *>view.buf, view.len // 4) != 0
    return ac_all_finite_f64(<const double *>view.buf, view.len // 8) != 0


def all_finite(a):
    """Whether every element of the C-contiguous float32 / float64 array
    ``a`` is finite: one vectorized pass (x - x summed: NaN exactly where
    an element is inf or NaN; no temporary, no NumPy warning), the GIL
    released."""
    cdef Py_buffer view
    cdef bint ok
    PyObject_GetBuffer(a, &view, PyBUF_C_CONTIGUOUS)
    try:
        if view.itemsize not in (4, 8):
            raise TypeError("all_finite: float32 or float64 arrays only")
        with nogil:
            ok = _finite(&view)
        return ok
    finally:
        PyBuffer_Release(&view)


# elements converted per work item of cast_half
DEF _CAST_CHUNK = 65536


def cast_half(src, dst, int fmt, int nthreads):
    """``dst`` = ``src`` converted between float32 and a 16-bit format
    (``fmt`` 1 bfloat16, 2 float16, held as uint16 bits): float32 ``src``
    rounded into uint16 ``dst`` (to nearest, ties to even), or uint16
    ``src`` widened into float32 ``dst`` (exact).  Both C-contiguous with
    the same number of elements, in native byte order (TypeError
    otherwise); on ``nthreads`` threads, the GIL released.  A NaN stays a
    NaN of its sign; its payload bits may differ from NumPy's cast (the
    F16C instructions return quiet NaNs)."""
    cdef Py_buffer bs, bd
    cdef Py_ssize_t n, nchunks, c, lo, cnt
    cdef int widen
    if fmt not in (1, 2):
        raise ValueError(f"cast_half: fmt must be 1 (bfloat16) or 2 (float16), got {fmt}")
    for a, name in ((src, "src"), (dst, "dst")):
        dt = getattr(a, "dtype", None)
        if dt is not None and not dt.isnative:
            raise TypeError(f"cast_half: {name} must be in native byte order, got dtype {dt}")
    PyObject_GetBuffer(src, &bs, PyBUF_C_CONTIGUOUS)
    try:
        PyObject_GetBuffer(dst, &bd, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE)
        try:
            if bs.itemsize == 4 and bd.itemsize == 2:
                widen = 0
            elif bs.itemsize == 2 and bd.itemsize == 4:
                widen = 1
            else:
                raise TypeError("cast_half: float32 -> uint16 or uint16 -> float32")
            n = bs.len // bs.itemsize
            if bd.len // bd.itemsize != n:
                raise ValueError("cast_half: src and dst sizes differ")
            nchunks = (n + _CAST_CHUNK - 1) // _CAST_CHUNK
            if nthreads > nchunks:
                nthreads = <int>nchunks
            with nogil:
                for c in prange(nchunks, num_threads=max(nthreads, 1), schedule='static'):
                    lo = c * _CAST_CHUNK
                    cnt = min(<Py_ssize_t>_CAST_CHUNK, n - lo)
                    if widen:
                        ac_half_rows_f32(fmt, (<const uint16_t *>bs.buf) + lo, cnt, 1, <int>cnt,
                                         (<float *>bd.buf) + lo, cnt)
                    else:
                        ac_f32_half(fmt, (<const float *>bs.buf) + lo, (<uint16_t *>bd.buf) + lo,
                                    cnt)
        finally:
            PyBuffer_Release(&bd)
    finally:
        PyBuffer_Release(&bs)


def exp_array(x):
    """Elementwise exp with the kernels' own exp (float32 / float64, 1-D).

    Exposed for the accuracy tests only.
    """
    return _map_array(x, "exp_array", ac_exp_array_f32, ac_exp_array_f64)
