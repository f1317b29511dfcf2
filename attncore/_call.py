"""The front door of the attention kernels (private): one validated call
description, one launcher, each policy decided once.

Every entry point that runs attention builds its call here::

    check(...)      the user's arguments -> Checked: operands checked and
                    broadcast, options parsed, the dtype policy, the batch
                    shape and grouped-query heads, per-head parameters;
                    computes nothing (attncore.dask runs it on stand-ins
                    of its dask arrays' metadata)
    describe(chk)   -> Call: operands in the kernel's layout and formats,
                    the kernel's mode codes (16-bit formats, bfloat16 and
                    int8 products), the plan (tiles, key splits, threads,
                    the BLAS policy); immutable
    describe_paged(...)  -> Call of a paged call (paged_attention, a
                    packed varlen_attention batch, a folded decoding
                    step): the checked pools and block table, laid out and
                    planned (plan_paged)
    launch(call)    the one call of the kernels (dense or packed variable
                    length); returns the output, weights and lse in the
                    compute dtype, and whether the output is all finite

``Call`` is built here alone, every field by keyword
(tests/test_structure.py); the descriptions cached by operand metadata
(``attncore._lean``) are made by check and describe.

Policies and their homes:

* dtypes / precision -> kernel mode codes: :func:`modes` (over
  ``attncore._dtypes.resolve``);
* how a bfloat16 looks: ``attncore._dtypes`` (``half_code``, ``is_bf16``);
* array-library conversions: ``attncore._interop``;
* the layout test: ``attncore._validation.blas_rows``;
* per-head float parameters (ALiBi slopes, sinks): :func:`per_batch` (over
  ``attncore._validation.head_values``);
* BLAS, threads and key splits: :func:`plan_call` (over
  ``attncore._threads``), :func:`plan_paged` / :func:`paged_splits` for
  paged calls;
* the causal / window band: the kernels' codes from
  ``attncore._validation.parse_causal`` / ``parse_window``.
"""
from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import numpy as np

from . import _int8
from ._core import _sdpa
from ._dtypes import HALF_BF16, Policy, half_code, resolve, to_float
from ._kernels import L2_BYTES as _L2
from ._kv4 import QuantizedKV, checked as _kv_checked, fwht, kernel_slots, rotation_blocks
from ._quant import split_quantized
from ._threads import (OPENBLAS_SERIAL_MNK, blas_hold_supported, blas_parallel_threads,
                       blas_small_products_ok, resolve_num_threads, serial_or)
from ._validation import (INT32_MAX, aligned, aliasing_rows, all_finite, as_float_array,
                          batch_shape, blas_rows, check_mask, check_operands, head_values,
                          parse_causal, parse_scale)

__all__ = ["Plan", "plan", "plan_call", "Checked", "Call", "check", "describe",
           "describe_paged", "launch",
           "modes", "per_batch"]

F32, F64 = np.dtype(np.float32), np.dtype(np.float64)
# query blocks of at most this many rows take the direct loops (decoding);
# the C kernels' constant
SMALL_ROWS = _sdpa.SMALL_ROWS
# query rows x head size of a block whose key / value tiles are packed as
# pairs (bfloat16 / int8 products): 1024 rows of 128 (1 MiB of packed
# queries per thread)
PACKED_QUERY_ELEMS = 131072
# float32 keys / values in place whose rows are not contiguous (head views
# of a (B, L, H * hd) projection), for calls of more than ALIASED_V_ROWS
# query rows: the fused kernel copies each query block's key / value rows
# once for its panels (Plan.kvcopy; blocks of COPIED_KV_PANELS panels)
# while M x (D + Dv) x 4 stays within COPIED_KV_BYTES of each thread's
# scratch.  Otherwise values whose rows alias in L1 (aliasing_rows) get a
# copy of the whole operand before the call (_dense_rows)
COPIED_KV_PANELS = 32
COPIED_KV_BYTES = 2 << 20
# float32 keys / values of the fused kernel over more than KCHUNK_BYTES per
# head: query blocks of KCHUNK_PANELS panels that take turns over chunks of
# KCHUNK_BYTES worth of keys (Plan.kchunk), each chunk read from memory or
# L3 once for the block, then from L2 (a chunk is half of Zen 3's 512 KiB
# of L2).  One thread, avx2 path, Emerald Rapids (2 MiB of L2), GFLOP/s
# panel by panel -> chunked: 1 x 8 x 4096^2 x 64 64 -> 69-72, 1 x 16 x
# 2048^2 x 128 69 -> 74; two threads 94 -> 121-132 and 100 -> 114-142;
# the same on the avx512 path 131 -> 140 and 134 -> 147
KCHUNK_BYTES = 256 << 10
KCHUNK_PANELS = 8


def kchunk_keys(D: int, Dv: int) -> int:
    """Keys per chunk of :data:`KCHUNK_BYTES` float32 key and value rows
    (the kernel rounds it up to its tile of keys)."""
    return max(128, KCHUNK_BYTES // (4 * max(1, D + Dv)) // 128 * 128)


# --------------------------------------------------------------------------
# the plan: tiles, key splits, threads, and the BLAS policy
# --------------------------------------------------------------------------
def _tiles(dtype, N: int, M: int, D: int, Dv: int, causal: int, nb: int, nthreads: int):
    """(query block, key block) sizes of the BLAS path (float64, the
    portable float32 path, return_weights).

    Key blocks of 512 (float32; 256 for float64, halved for D + Dv > 256).
    Query blocks as tall as keep the thread's score tile and accumulator in
    three quarters of its L2 (the key / value tiles stream through BLAS'
    packing), at most 256 rows (128 under a causal mask up to N = 1024,
    where taller diagonal blocks waste more than they save: measured), then
    halved while the work items would not give every thread two.
    """
    isz = dtype.itemsize
    Bk = 512 if isz == 4 else 256
    if D + Dv > 256:
        Bk //= 2
    Bk = max(1, min(Bk, M))
    Bq = 128 if (causal and N <= 1024) else 256
    budget = 3 * _L2 // 4
    while Bq > 32 and isz * Bq * (Bk + Dv) > budget:
        Bq //= 2
    while Bq > 32 and nb * -(-N // Bq) < 2 * nthreads:
        Bq //= 2
    return max(1, min(Bq, N)), Bk


class Plan(NamedTuple):
    """How one call runs: query / key block sizes, key splits, threads."""

    Bq: int
    Bk: int
    nsplit: int
    chunk: int
    nthreads: int
    fused: bool
    kvcopy: bool = False      #: the fused kernel copies each block's strided K / V rows
    kchunk: int = 0           #: float32 K / V: a block's panels take turns over chunks of this many keys


def _blas_tiles(Bq: int, Bk: int, M: int, width: int, return_weights: bool,
                blas_mnk: int) -> tuple[int, int]:
    """Tiles whose BLAS products stay below ``blas_mnk`` multiply-adds."""
    if return_weights:  # products over all M keys at once
        return max(1, min(Bq, blas_mnk // max(1, M * width))), Bk
    while Bk > 32 and Bq * Bk * width > blas_mnk:
        Bk //= 2
    while Bq > 1 and Bq * Bk * width > blas_mnk:
        Bq //= 2
    return Bq, Bk


def plan(dtype, N: int, M: int, D: int, Dv: int, causal: int, nb: int, nthreads: int,
         return_weights: bool = False, kernel_path: str | None = None,
         blas_mnk: int | None = None, converted_kv: int = 0,
         copied_kv: bool = False) -> Plan:
    """Blocking, key splits and thread count of one attention call (pure).

    The fused float32 kernel (``kernel_path`` 'avx512' / 'avx2', queries
    in panels of 32 / 16 rows, no BLAS) takes query blocks of two panels,
    fewer when there would not be two per thread; a handful of query rows
    (decoding) and everything else use the BLAS path's tiles (``_tiles``).
    Decoding-like calls with fewer work items than threads split the keys
    (flash decoding) into chunks of at least 256 keys.  Work below
    ``SERIAL_FLOPS`` (attncore._threads) runs on the calling thread alone.  ``blas_mnk`` caps
    the size (m n k) of every BLAS product of the BLAS path: the tiles then
    shrink so that a BLAS that starts threads above a size (OpenBLAS) keeps
    each product on the calling thread.  ``converted_kv`` (int8 / half
    keys or values, converted a tile at a time for all the panels of a
    query block): query blocks of four panels, so that each conversion
    serves more rows; 2 (tiles packed as pairs for bfloat16 or int8 dot
    products): blocks of up to 32 panels.  ``copied_kv`` (float32 keys /
    values with rows not contiguous, read in place by every panel of a
    block): blocks of ``COPIED_KV_PANELS`` panels, each copying its key /
    value rows once (``Plan.kvcopy``).  Zen 5, one thread, 4 x 8 x 512^2 x
    64 on the head views of 4 x 512 x 1536 projections, avx2 path: 21.1
    ms read in place, 19.3 ms copied per 32-panel block, 19.4 ms on
    contiguous operands; on 4 x 512 x (1536 + 16) (rows padded off the
    1 KiB multiples) 20.1 ms in place, 19.0 contiguous.  Float32 keys /
    values in place over more than :func:`kchunk_keys` keys: blocks of
    ``KCHUNK_PANELS`` panels taking turns over chunks of that many keys
    (``Plan.kchunk``; see ``KCHUNK_BYTES``).
    """
    if kernel_path is None:
        kernel_path = _sdpa.kernel_path()
    nthreads = serial_or(2.0 * nb * N * M * (D + Dv), nthreads)
    # (the fused kernels: the x86 paths and neon; the portable path runs
    # BLAS tiles)
    fused = (dtype == np.float32 and not return_weights and kernel_path in _sdpa.PANEL_ROWS
             and N > SMALL_ROWS)
    if fused:
        panel = _sdpa.PANEL_ROWS[kernel_path]
        if converted_kv == 2:
            # pair-packed key / value tiles (bfloat16 or int8 products):
            # the packing of each tile serves every panel of the block, so
            # blocks up to 32 panels (measured: 1.3x on bf16 / int8
            # prefill against 4 panels), their packed queries kept near
            # PACKED_QUERY_ELEMS elements per thread
            Bq = max(4, min(32, PACKED_QUERY_ELEMS // max(D, 1) // panel)) * panel
        elif copied_kv:
            Bq = COPIED_KV_PANELS * panel
        elif not converted_kv and M > kchunk_keys(D, Dv):
            Bq = KCHUNK_PANELS * panel
        else:
            Bq = (4 if converted_kv else 2) * panel
        while Bq > panel and nb * -(-N // Bq) < 2 * nthreads:
            Bq //= 2
        Bq = min(Bq, N)
        Bk = max(1, min(512, M))  # only sizes the key splits here
    else:
        Bq, Bk = _tiles(np.dtype(dtype), N, M, D, Dv, causal, nb, nthreads)
        if blas_mnk:
            Bq, Bk = _blas_tiles(Bq, Bk, M, max(D, Dv), return_weights, blas_mnk)
    nqb = -(-N // Bq)
    work = nb * nqb
    nsplit, chunk = 1, M
    if not return_weights and work < nthreads and M >= 1024:
        nsplit = min(-(-nthreads // work), -(-M // 256))
        chunk = -(-M // nsplit)
        chunk = -(-chunk // Bk) * Bk
        nsplit = -(-M // chunk)
    nthreads = max(1, min(nthreads, work * nsplit))
    kvcopy = bool(fused and copied_kv and Bq > _sdpa.PANEL_ROWS[kernel_path])
    kchunk = 0
    if fused and not converted_kv and Bq > _sdpa.PANEL_ROWS[kernel_path] and \
            min(chunk, M) > kchunk_keys(D, Dv):
        kchunk = kchunk_keys(D, Dv)
    return Plan(Bq, Bk, nsplit, chunk, nthreads, fused, kvcopy, kchunk)


def plan_call(dtype, N: int, M: int, D: int, Dv: int, causal: int, nb: int, nthreads: int,
              return_weights: bool = False, kernel_path: str | None = None,
              converted_kv: int = 0, copied_kv: bool = False) -> Plan:
    """:func:`plan` and the BLAS thread policy of one call, decided together.

    The one place where a call's tiles meet the BLAS it loads, so that
    re-planning for the BLAS keeps every other argument of the plan.  Where
    the planned kernel calls BLAS (neither the fused kernel nor the direct
    loops of a few rows) and a BLAS library cannot be held to one thread
    per thread (``attncore._threads``):

    * an OpenBLAS gets tiles whose products stay below
      ``OPENBLAS_SERIAL_MNK``, so it runs each one on the calling thread:
      at any thread count, so that ``num_threads=1`` uses one core;
    * any other such BLAS gets a region of one thread, and keeps its own.

    The tiles are cached per argument set (:func:`plan` is pure once the
    kernel path is known); the BLAS policy is applied to them on every call
    (it reads the BLAS libraries' current thread counts).
    """
    args = (np.dtype(dtype), N, M, D, Dv, causal, nb, nthreads, bool(return_weights),
            kernel_path or _sdpa.kernel_path())
    pl = _plan_cached(*args, None, int(converted_kv), bool(copied_kv))
    uses_blas = not pl.fused and (return_weights or N > SMALL_ROWS)
    if uses_blas and not blas_hold_supported():
        if blas_small_products_ok():
            pl = _plan_cached(*args, OPENBLAS_SERIAL_MNK, int(converted_kv), bool(copied_kv))
        elif pl.nthreads > 1:
            pl = pl._replace(nthreads=blas_parallel_threads(pl.nthreads))
    return pl


_plan_cached = functools.lru_cache(maxsize=1024)(plan)


# paged / packed calls' key splits: a sequence splits over keys when the
# work list would give a thread fewer than PAGED_ITEMS_PER_THREAD items, in
# chunks of at least PAGED_MIN_CHUNK keys
PAGED_ITEMS_PER_THREAD = 4
PAGED_MIN_CHUNK = 512
# panels (fused-kernel query rows) of a prompt chunk's query block
PREFILL_PANELS = 8


def paged_splits(lens: np.ndarray, items: int, nthreads: int,
                 block_size: int) -> tuple[int, int]:
    """(nsplit, chunk): key splits of a paged call (chunks of whole blocks)
    where its work list would leave threads idle; (1, 0) for none."""
    longest = int(lens.max()) if lens.size else 0
    if (nthreads <= 1 or items >= PAGED_ITEMS_PER_THREAD * nthreads
            or longest < 2 * PAGED_MIN_CHUNK):
        return 1, 0
    want = -(-PAGED_ITEMS_PER_THREAD * nthreads // max(items, 1))
    chunk = max(PAGED_MIN_CHUNK, -(-longest // want))
    chunk = -(-chunk // block_size) * block_size
    nsplit = -(-longest // chunk)
    return (nsplit, chunk) if nsplit > 1 else (1, 0)


def _paged_items(lq: np.ndarray, one: np.ndarray, Bq: int, Hq: int) -> int:
    """Work items of a paged call before key splits: a query block of a
    head, or one item for a folded one-query sequence."""
    return int(((-(-lq // Bq)) * Hq)[~one].sum() + one.sum())


def plan_paged(pl: Plan, lq: np.ndarray, lens: np.ndarray, Hq: int, block_size: int,
               fold_rows: np.ndarray) -> Plan:
    """The plan of a paged call from :func:`plan_call`'s plan ``pl`` of its
    longest sequence: prompt chunks' query blocks of up to
    ``PREFILL_PANELS`` panels on the fused kernel (each staged range of
    keys serving more rows; measured: 256 rows against 64 take the mixed
    batch of compare_serving from 0.84 to ~1.0 of varlen's time), fewer
    where threads would idle; folded one-query sequences (``fold_rows``)
    one item each; key splits (:func:`paged_splits`)."""
    fold = bool(fold_rows.any())
    maxq = int(lq.max()) if lq.size else 1
    Bq = pl.Bq
    if pl.fused:
        panel = _sdpa.PANEL_ROWS[_sdpa.kernel_path()]
        Bq = max(Bq, min(PREFILL_PANELS * panel, -(-maxq // panel) * panel))
        while Bq > pl.Bq and _paged_items(lq, fold_rows, Bq, Hq) < 2 * pl.nthreads:
            Bq = max(pl.Bq, Bq // 2)
    Bq = max(Bq, Hq) if fold else Bq
    items = _paged_items(lq, fold_rows, Bq, Hq)
    nsplit, chunk = paged_splits(lens, items, pl.nthreads, block_size)
    nthr = max(1, min(pl.nthreads, items * nsplit))
    return pl._replace(Bq=Bq, nsplit=nsplit, chunk=chunk, nthreads=nthr)


# --------------------------------------------------------------------------
# policies decided once
# --------------------------------------------------------------------------
class Modes(NamedTuple):
    """The kernel's mode codes of a call's dtype policy."""

    bf16dot: int   #: bfloat16 dot products: 0 none, 1 vdpbf16ps, 2 emulated; int16 P.V
    #: under int8 Q.K^T: 3 vpdpwssd, 4 emulated (_sdpa.pv16_code)
    qk8: int       #: int8 Q.K^T: 0 none, 1 vpdpbusd, 2 emulated, 3 dequantized rows,
    #: 4 vpmaddubsw (AVX2), 5 AVX-VNNI, 6 AVX-VNNI emulated (_sdpa.int8_mode)


def int8_products(D: int) -> int:
    """The kernel's int8 Q.K^T code for ``precision="int8"`` on the path in
    use: 1 / 2 the vpdpbusd kernel (native / emulated, on the AVX-512 path),
    4 / 5 / 6 the AVX2 path's (vpmaddubsw sign trick, AVX-VNNI vpdpbusd, its
    AVX2 spelling), 3 products of the dequantized rows (forced, or a head
    size outside the kernels' exact range), 0 float32 products where this
    CPU and path have no int8 kernel faster than float32 (no slower, and
    more accurate).  The default mode already picks per path
    (``_sdpa.int8_mode``); a forced code of another path gives 0."""
    qk8 = _sdpa.int8_mode()
    path = _sdpa.kernel_path()
    if (qk8 in (1, 2) and path != "avx512") or (qk8 in (4, 5, 6) and path != "avx2"):
        return 0
    # (int32 sums of D products of up to 255 x 127: exact below 66313;
    # the 16-lane / 32-lane panels hold D >= 2)
    if qk8 in (1, 2, 4, 5, 6) and (D < 2 or D > 65536):
        return 3
    return qk8


def policy(dtypes, names, precision) -> Policy:
    """The dtype policy of a call (``attncore._dtypes.resolve``), with this
    CPU's bfloat16 dot products (cached per argument set where
    ``precision`` is None or a string: a small call's checks are a good
    part of its time)."""
    bf = _sdpa.bf16_mode() != 0
    if precision is None or type(precision) is str:
        return _policy_cached(tuple(dtypes), tuple(names), precision, bf)
    return resolve(dtypes, names, precision, bf16_products=bf)


@functools.lru_cache(maxsize=256)
def _policy_cached(dtypes: tuple, names: tuple, precision, bf: bool) -> Policy:
    return resolve(dtypes, names, precision, bf16_products=bf)


def modes(pol: Policy, D: int) -> Modes:
    """The kernel's mode codes of the policy ``pol``: bfloat16 products for
    bfloat16 policies (and for P.V under int8 Q.K^T where the CPU has
    them); the int8 Q.K^T code."""
    qk8 = int8_products(D) if pol.products == "int8" else 0
    # (bfloat16 P.V under int8 Q.K^T: the AVX-512 panel's, codes 1 / 2)
    bf = pol.products == "bfloat16" or (qk8 in (1, 2, 3) and _sdpa.bf16_mode() != 0)
    pv = _sdpa.pv16_code(qk8) if qk8 else 0
    if pv and not bf:
        # (int16 P.V under the int8 Q.K^T of either path's panel: codes 3 / 4)
        return Modes(pv, qk8)
    return Modes(_sdpa.bf16_mode() if bf else 0, qk8)


def per_batch(x, bshape: tuple, name: str, compute, allow_neg_inf: bool = False,
              max_distance: int | None = None) -> np.ndarray:
    """A per-head (per batch element) float array broadcast to the batch
    shape: (H,) matches the head axis (-3 of the query), (B, H) batch and
    heads, NumPy broadcasting from the right.  Returns it as a flat
    float64 array of one value per batch element, its values checked
    against the compute dtype ``compute`` (attncore._validation.head_values)."""
    f = head_values(x, name, compute, allow_neg_inf=allow_neg_inf, max_distance=max_distance)
    if f.ndim > len(bshape):
        raise ValueError(f"{name} must have at most {len(bshape)} dimensions (one per batch axis, "
                         f"the last one the heads), broadcastable to the batch shape {bshape}; "
                         f"got shape {f.shape}")
    try:
        b = np.broadcast_to(f, bshape)
    except ValueError:
        raise ValueError(f"{name} of shape {f.shape} does not broadcast to the batch shape "
                         f"{bshape} ((H,) per head or (B, H))") from None
    return np.ascontiguousarray(b).reshape(-1)


# --------------------------------------------------------------------------
# checking: the user's arguments -> Checked
# --------------------------------------------------------------------------
class Checked(NamedTuple):
    """A call's arguments checked (nothing laid out or computed yet)."""

    q: np.ndarray             #: query, float (16-bit kept)
    k: np.ndarray             #: key, float; a float stand-in for an int8 key
    v: np.ndarray             #: value, likewise
    k8: tuple[np.ndarray, np.ndarray] | None   #: (int8 key, scales) or None
    v8: tuple[np.ndarray, np.ndarray] | None   #: (int8 value, scales) or None
    mask: np.ndarray | None
    mask_kind: int
    pol: Policy
    bshape: tuple
    group: int
    causal: int
    scale: float
    nthreads: int
    window: tuple
    softcap: float
    slopes: np.ndarray | None  #: flat float64, one per batch element
    sinks: np.ndarray | None
    need_weights: bool
    need_lse: bool
    kq: Any = None            #: the key's QuantizedKV (4-bit / rotated), NumPy
    vq: Any = None            #: the value's

    @property
    def empty(self) -> bool:
        """Whether the call has nothing to compute (a 0-sized axis)."""
        return (math.prod(self.bshape) == 0 or self.q.shape[-2] == 0
                or self.k.shape[-2] == 0 or self.v.shape[-1] == 0)


def _kernel_pair(kv: QuantizedKV) -> tuple:
    """What the kernels read of a container: (codes, scales) -- int8 rows
    and their float32 scales (..., M), or 4-bit codes and their float32
    slots of float16 (scale, offset) pairs (..., M, G)."""
    if kv.bits == 8:
        return kv.codes, kv.scales[..., 0]
    return kv.codes, kernel_slots(kv)


def _split_int8(query, key, value):
    """(key, value, k8, v8, kq, vq): an int8 (array, scales) key / value,
    or a QuantizedKV (kq / vq, checked, its kernel pair in k8 / v8),
    replaced by a float stand-in of the query's dtype for the shape checks
    (quantized operands take no part in the dtype rules)."""
    kq = _kv_checked(key, "key") if isinstance(key, QuantizedKV) else None
    vq = _kv_checked(value, "value") if isinstance(value, QuantizedKV) else None
    k8 = _kernel_pair(kq) if kq is not None else None
    v8 = _kernel_pair(vq) if vq is not None else None
    if kq is None:
        key, k_scales = split_quantized(key, "key")
        k8 = None if k_scales is None else (key, k_scales)
    if vq is None:
        value, v_scales = split_quantized(value, "value")
        v8 = None if v_scales is None else (value, v_scales)
    if k8 is not None or v8 is not None:
        qdt = as_float_array(query, "query", allow_bf16=True).dtype
        if k8 is not None:
            key = np.broadcast_to(np.zeros((), qdt), kq.shape if kq is not None else k8[0].shape)
        if v8 is not None:
            value = np.broadcast_to(np.zeros((), qdt),
                                    vq.shape if vq is not None else v8[0].shape)
    return key, value, k8, v8, kq, vq


def check(query, key, value, attn_mask=None, is_causal=False, scale=None,
          enable_gqa: bool = False, return_weights: bool = False, return_lse: bool = False,
          num_threads=None, window: tuple = (-1, -1), softcap: float = 0.0,
          precision=None, *, alibi=None, sinks=None) -> Checked:
    """Check a call's arguments (``window`` / ``softcap`` / the bools
    already parsed); raises the documented TypeError / ValueError."""
    key, value, k8, v8, kq, vq = _split_int8(query, key, value)
    q, k, v = check_operands(query, key, value)
    pol = policy((q.dtype, k.dtype, v.dtype), ("query", "key", "value"), precision)
    if _q4(kq) or _q4(vq):
        # 4-bit keys / values: float32 products of the dequantized codes
        # (their loops read the codes in place)
        pol = pol._replace(products="float32")
    N, D, M = q.shape[-2], q.shape[-1], k.shape[-2]
    m, mask_kind = check_mask(attn_mask, N, M)
    bshape, group = batch_shape(q, k, v, m, enable_gqa)
    cdt = pol.compute
    slopes = None if alibi is None else per_batch(alibi, bshape, "alibi_slopes", cdt,
                                                  max_distance=max(N, M) - 1)
    sk = None if sinks is None else per_batch(sinks, bshape, "sinks", cdt, allow_neg_inf=True)
    causal = parse_causal(is_causal)
    if (pol.products == "int8" and k8 is None and _sdpa.int8_mode_name() is None
            and not int8_pays(N, M, D, v.shape[-1], math.prod(bshape), bool(causal))):
        # float keys too few, or too little work, to repay their
        # quantization: float32 products for every route of the call
        # (INT8_MIN_ROWS)
        pol = pol._replace(products="float32")
    return Checked(q, k, v, k8, v8, m, mask_kind, pol, bshape, group, causal,
                   parse_scale(scale, D), resolve_num_threads(num_threads), window, softcap,
                   slopes, sk, return_weights, return_lse, kq, vq)


def _q4(kv) -> int:
    """The group size of a 4-bit container, else 0."""
    return kv.group_size if kv is not None and kv.bits == 4 else 0


# --------------------------------------------------------------------------
# describing: Checked -> Call (layout, formats, modes, plan)
# --------------------------------------------------------------------------
class Call(NamedTuple):
    """One kernel call, immutable: what :func:`launch` passes to the
    kernels.  Dense calls: ``bshape`` batch elements of (N, M); paged
    calls: ``cu_q`` offsets of the queries, a ``block_table`` (k / v the
    block pools) and, for packed variable-length calls (one block, the
    whole key array), ``cu_k``, the sequences' first keys."""

    q: Any                    #: np.ndarray (bfloat16 as its bits; None in a cached template)
    k: Any
    v: Any
    mask: np.ndarray | None
    mask_kind: int
    bshape: tuple
    group: int
    N: int
    M: int
    D: int
    Dv: int
    causal: int
    scale: float
    window: tuple
    softcap: float
    k_scales: np.ndarray | None
    v_scales: np.ndarray | None
    q_scales: np.ndarray | None
    fmts: tuple               #: (q, k, v): 0 the compute dtype, 1 bfloat16, 2 float16
    slopes: np.ndarray | None
    sinks: np.ndarray | None
    bf16dot: int
    qk8: int
    plan: Plan
    compute: np.dtype
    need_weights: bool = False
    need_lse: bool = False
    lse_shift: np.ndarray | None = None   #: added to the lse (int8 smoothing's q . mu)
    cu_q: np.ndarray | None = None
    cu_k: np.ndarray | None = None
    block_table: np.ndarray | None = None   #: paged calls: (S, max_blocks) int32
    seq_lens: np.ndarray | None = None      #: paged calls: (S,) int64 keys per sequence
    fold: bool = False        #: paged: a one-query sequence's query heads as rows of one item
    q4: tuple | None = None   #: (key, value) 4-bit group sizes (0: not 4-bit)
    rot_out: int = 0          #: rotated values: the output rotated back (fwht blocks)


# _sdpa.sdpa reads the leading fields of a Call and its Plan by position
if (Call._fields[:len(_sdpa.CALL_FIELDS)] != _sdpa.CALL_FIELDS
        or Plan._fields[:len(_sdpa.PLAN_FIELDS)] != _sdpa.PLAN_FIELDS):
    raise ImportError("attncore._core._sdpa reads other Call / Plan fields than "
                      "attncore._call defines: rebuild the extension")
if Call._fields.index("q4") != getattr(_sdpa, "CALL_Q4_INDEX", -1):
    raise ImportError("attncore._core._sdpa reads the 4-bit formats elsewhere than "
                      "attncore._call defines them: rebuild the extension")


def _quantized_operand(data: np.ndarray, scales: np.ndarray, cdt, q4: int = 0):
    """An int8 operand laid out for the kernel (last axis contiguous, rows
    at least D apart) and its scales as (..., M, 1) of the compute dtype;
    a 4-bit one (``q4``, its group size) with its (..., M, G) slots as
    they are (see attncore._kv4.kernel_slots)."""
    D = data.shape[-1]
    st = data.strides
    if (D > 1 and st[-1] != 1) or (data.shape[-2] > 1 and st[-2] < D) or any(s < 0 for s in st):
        data = np.ascontiguousarray(data)
    if q4:
        sst = scales.strides
        if ((scales.shape[-1] > 1 and sst[-1] != 4) or any(x % 4 or x < 0 for x in sst)
                or not scales.flags.aligned):
            scales = np.ascontiguousarray(scales)
        return data, scales
    sc = scales.astype(cdt, copy=False)
    if any(s % sc.itemsize or s < 0 for s in sc.strides) or not sc.flags.aligned:
        sc = np.ascontiguousarray(sc)
    return data, sc[..., None]


def _float_operand(a: np.ndarray, cdt) -> tuple[np.ndarray, int]:
    """A float operand in the kernel's layout and its format code (16-bit
    operands are read in place; others take the compute dtype)."""
    f = half_code(a.dtype)
    return blas_rows(a if (f or a.dtype == cdt) else a.astype(cdt)), f


# query rows above which float32 values whose rows alias in L1
# (attncore._validation.aliasing_rows) are copied: the fused kernel reads
# each value row once per panel of queries, and at 4 KiB apart a 4 x 8 x
# 512^2 x 64 call ran 1.5x (AVX2) / 1.2x (AVX-512) slower than on
# contiguous values (Zen 5, one thread).  Copied by the fused kernel, a
# query block at a time (Plan.kvcopy), or else here, the whole operand
# before the call (_dense_rows: a fresh array, 1 ms of the 22 ms call
# above with its page faults)
ALIASED_V_ROWS = 32


def _strided_rows(a: np.ndarray) -> bool:
    """Whether the rows of ``a`` (its last two axes) are apart by more
    than a row."""
    return a.shape[-2] > 1 and a.strides[-2] != a.shape[-1] * a.itemsize


def copies_kv(N: int, M: int, D: int, Dv: int, strided: bool) -> bool:
    """Whether the fused kernel copies a call's plain float32 keys / values
    a query block at a time (``plan(copied_kv=...)``): rows not contiguous
    (``strided``), more than ALIASED_V_ROWS query rows, M x (D + Dv)
    floats within COPIED_KV_BYTES.  The rule of :func:`describe` and of
    the integrations' prepared call alike."""
    return bool(strided and N > ALIASED_V_ROWS and M * (D + Dv) * 4 <= COPIED_KV_BYTES)


def _dense_rows(a: np.ndarray) -> np.ndarray:
    """A C-contiguous copy of ``a``'s rows whose broadcast (stride-0) batch
    axes stay broadcast: each distinct row is copied once."""
    own = tuple(slice(0, 1) if st == 0 else slice(None) for st in a.strides[:-2])
    return np.broadcast_to(np.ascontiguousarray(a[own]), a.shape)


def _layout(chk: Checked):
    """(q, k, v, k_scales, v_scales, mask, fmts, aliased): the operands
    laid out; aliased: float32 values whose rows alias in L1, for a call
    of many query rows (ALIASED_V_ROWS): copied by the kernel or by
    :func:`_dense_rows`."""
    cdt = chk.pol.compute
    q, qf = _float_operand(chk.q, cdt)
    if chk.k8 is not None:
        (k, ks), kf = _quantized_operand(chk.k8[0], chk.k8[1], cdt, _q4(chk.kq)), 0
    else:
        (k, kf), ks = _float_operand(chk.k, cdt), None
    aliased = False
    if chk.v8 is not None:
        (v, vs), vf = _quantized_operand(chk.v8[0], chk.v8[1], cdt, _q4(chk.vq)), 0
    else:
        (v, vf), vs = _float_operand(chk.v, cdt), None
        aliased = (not vf and cdt == F32 and not chk.need_weights
                   and chk.q.shape[-2] > ALIASED_V_ROWS and aliasing_rows(v))
    m = chk.mask
    if m is not None:
        if chk.mask_kind == 2 and (m.dtype != cdt or not m.dtype.isnative):
            # (float64 entries beyond the float32 range become +-inf here,
            # silently: a call whose float32 result is not finite runs again
            # in float64 with the mask as given)
            with np.errstate(over="ignore"):
                m = m.astype(cdt)
        if any(st % m.itemsize for st in m.strides):
            m = np.ascontiguousarray(m)
    return q, k, v, ks, vs, m, (qf, kf, vf), aliased


# elements of Q and K from which precision="int8" quantizes them on several
# threads (below: about 0.4 ms on one thread at most, on one Zen 5 core).
# At 1 << 24 the quantizer of 1x8x1024^2 x 64 / x 128 ran on one thread
# beside a 2-thread kernel: int8 1.00-1.23x float32 at 2 threads on the
# avx2 path (AVX-VNNI), against 1.19-1.33x threaded (Zen 5, quiet machine)
INT8_QUANT_THREADED = 1 << 19

# precision="int8" with float keys quantizes them on every call: two passes
# over the keys (their statistics, then their int8 rows), the same for the
# queries, and a fixed part in Python of about 0.3 ms.  Under the default
# int8 mode a call where that cannot pay takes float32 products instead
# (more accurate, never slower): fewer than INT8_MIN_ROWS query or key
# rows, or fewer than INT8_MIN_WORK multiply-adds N M (D + Dv) over its
# batch elements (half of it for a causal call).  The rule leaves out the
# thread count, so that a call's result never depends on it (fewer
# threads would repay the quantization sooner).  Measured (Xeon,
# AVX512_VNNI, and its avx2 path with AVX-VNNI; float32 / int8 time, 8
# heads, one / two threads, bench/compare_int8.py --size-rule): a decoding
# step over 32768 float keys 0.29 / 0.25, N 64 over 4096 keys 0.83 /
# 0.80 (the keys' quantization is paid for 64 rows), N 128 1.29 / 1.16;
# N = M = 384 at D 64 (1.5e8) 1.08 / 0.85, 512 (2.7e8) 1.26 / 1.20;
# causal 512^2 (1.3e8) 0.96 / 0.93.  Int8 keys given (quantize_kv) are
# not quantized again: their calls keep the int8 products at any size.
INT8_MIN_ROWS = 128
INT8_MIN_WORK = 200_000_000


def int8_pays(N: int, M: int, D: int, Dv: int, nb: int, causal: bool = False) -> bool:
    """Whether precision="int8" on float keys repays quantizing them (see
    INT8_MIN_ROWS)."""
    work = N * M * (D + Dv) * nb // (2 if causal else 1)
    return min(N, M) >= INT8_MIN_ROWS and work >= INT8_MIN_WORK


def _int8_stage(chk: Checked, q, k, ks, fmts, md: Modes):
    """int8 Q.K^T (attncore._int8): the operands quantized once per call.
    Returns (q, k, k_scales, fmts, qk8, q_scales, q_mu, D)."""
    qf, kf, vf = fmts
    bshape, D = chk.bshape, chk.q.shape[-1]
    N, M = chk.q.shape[-2], chk.k.shape[-2]
    nb = math.prod(bshape)
    # the quantizer's own work (its four passes each open an OpenMP region
    # when threaded, and a region's barrier waits for every thread to be
    # scheduled: on a 2-core machine busy with other processes 2 threads
    # once took 50-70 ms against 1.2 ms on one, for 1x8x1024^2 x 64
    # operands -- as the kernel's own region would): threaded where the
    # rows are many enough to repay four regions
    rows_work = nb * (N + M) * D
    i8 = _int8.quantize(q, qf, None if ks is not None else k, kf,
                        k if ks is not None else None,
                        None if ks is None else ks[..., 0], bshape, chk.group,
                        chk.nthreads if rows_work >= INT8_QUANT_THREADED else 1,
                        pairs=md.qk8 != 3 and N > SMALL_ROWS)
    qk8 = md.qk8
    if qk8 == 4 and ks is not None and N > SMALL_ROWS and i8.k8.size and i8.k8.min() == -128:
        # int8 keys given with -128 (not from quantize_kv): vpsignb has no
        # +128 for the sign trick; the AVX-VNNI layout in AVX2 takes any
        # int8 key
        qk8 = 6
    if (chk.need_weights or chk.softcap > 0 or chk.sinks is not None
            or (i8.q_mu is not None and not all_finite(i8.q_mu))):
        # the scores' level matters (the weights' path, a soft cap, a
        # sink): float rows whose products are the int8 ones, q . mu
        # included as one more channel (a copy of Q and K); and where q . mu
        # overflowed float32 (the lse's shift: that channel turns the rows
        # NaN, and the call is computed again in float64)
        q, k = _int8.dequantized(i8, bshape, D)
        return q, k, None, (0, 0, vf), 0, None, None, D + 1
    return (i8.q8.reshape(bshape + i8.q8.shape[1:]), i8.k8, i8.k_pairs, (0, 0, vf), qk8,
            i8.q_scales, i8.q_mu, D)


def bits(a: np.ndarray, fmt: int) -> np.ndarray:
    """An operand as the kernel reads it: bfloat16 (ml_dtypes) exports no
    buffer format, so the kernel reads its bits."""
    return a.view(np.uint16) if fmt == HALF_BF16 else a


def conversion(md: Modes, qk8: int, fmts: tuple, ks, vs) -> int:
    """The plan's ``converted_kv``: 2 where the fused AVX-512 kernel packs
    key / value tiles as pairs (bfloat16 or int8 products), 1 where it
    converts them (16-bit or int8 operands), else 0.  (int8 Q.K^T reads
    its int8 keys in place: only the values convert.)"""
    if (md.bf16dot or qk8 in (1, 2)) and _sdpa.kernel_path() == "avx512":
        return 2
    if md.bf16dot in (3, 4):  # int16 value pairs of the AVX2 / AVX-512 panels
        return 2
    if qk8:
        return int(bool(fmts[2] or vs is not None or md.bf16dot))
    return int(bool(fmts[1] or fmts[2] or ks is not None or vs is not None or md.bf16dot))


def _grouped_step(chk: Checked) -> bool:
    """Whether ``chk`` is a one-query grouped-query call (a decoding step,
    (B, Hq, 1, D) over (B, Hk, M, D)) whose every query row sees every key:
    no mask, weights, ALiBi, int8 Q.K^T, upper-left causal alignment or
    window, no broadcast batch axes -- what :func:`grouped_rows` and
    :func:`_folded_decode` run with each key head read once for its group."""
    q, k, v = chk.q, chk.k, chk.v
    return not (chk.group < 2 or q.ndim != 4 or q.shape[2] != 1 or k.ndim != 4
                or v.ndim != 4 or chk.mask is not None or chk.need_weights
                or chk.slopes is not None or chk.causal not in (0, 2)
                or chk.window != (-1, -1) or chk.pol.products == "int8"
                or not q.shape[0] == k.shape[0] == v.shape[0] or chk.bshape != q.shape[:2])


def _folded_decode(chk: Checked) -> Call | None:
    """A one-query grouped-query call (a decoding step, (B, Hq, 1, D) over
    (B, Hk, M, D)) as the paged kernel's folded items: each batch
    element's query heads run a key head at a time as the rows of one
    range, so a key head's keys and values are read once for its group
    (the dense kernel's items read them once per query head).  The keys
    are a pool of one block per batch element, a view.  None where this
    does not apply (:func:`_grouped_step`; keys of another dtype).  Calls
    without sinks take :func:`grouped_rows` first."""
    q, k, v = chk.q, chk.k, chk.v
    k8, v8 = chk.k8, chk.v8
    if (not _grouped_step(chk) or (k8 is None) != (v8 is None) or _q4(chk.kq) or _q4(chk.vq)
            or (k8 is None and not q.dtype == k.dtype == v.dtype)):
        return None
    B, M = q.shape[0], k.shape[2]
    kp, vp = (x[0] if x is not None else y for x, y in ((k8, k), (v8, v)))
    ks, vs = (None if x is None else x[1].transpose(0, 2, 1) for x in (k8, v8))
    c = describe_paged(q[:, :, 0], kp.transpose(0, 2, 1, 3), ks, vp.transpose(0, 2, 1, 3), vs,
                       block_table=np.arange(B, dtype=np.int32)[:, None],
                       seq_lens=np.full(B, M, np.int64), cu_q=np.arange(B + 1, dtype=np.int64),
                       pol=chk.pol, group=chk.group, scale=chk.scale, causal=0,
                       window=(-1, -1), softcap=chk.softcap, slopes=None, sinks=chk.sinks,
                       nthreads=chk.nthreads, need_lse=chk.need_lse)
    return c._replace(bshape=chk.bshape, N=1, M=M)


def broadcast_query(chk: Checked) -> bool:
    """Whether every query row of a batch element is the same row with the
    same keys (a stride-0 query row axis, nothing row-dependent): the call
    computes one row and broadcasts it (attncore.functional)."""
    m = chk.mask
    return (chk.q.shape[-2] > 1 and chk.q.strides[-2] == 0 and not chk.causal
            and chk.window == (-1, -1) and chk.k8 is None and chk.v8 is None
            and chk.slopes is None and chk.sinks is None and (m is None or m.shape[-2] == 1))


def grouped_rows(chk: Checked) -> Checked | None:
    """A one-query grouped-query call (a decoding step, (B, Hq, 1, D) over
    (B, Hk, M, D)) as a dense call over the Hk key heads whose rows are
    each key head's query heads: every row sees every key, so a key head's
    keys and values are read once for its group, and the dense kernel's
    items (batch element, key head) and key splits keep every thread busy.
    The output's memory order is the original call's.  None where this
    does not apply (:func:`_grouped_step`; sinks, one per query head: then
    :func:`_folded_decode`)."""
    if chk.sinks is not None or not _grouped_step(chk):
        return None
    B, H, _, D = chk.q.shape
    return chk._replace(q=chk.q.reshape(B, H // chk.group, chk.group, D),
                        bshape=(B, H // chk.group), group=1, causal=0)


def describe(chk: Checked) -> Call:
    """The kernel call of a checked, non-empty call."""
    cdt = chk.pol.compute
    if cdt == F64 or chk.need_weights:
        # the float64 kernel and the weights path (BLAS over whole rows)
        # take 16-bit operands converted (a copy)
        chk = chk._replace(
            q=to_float(chk.q, cdt) if half_code(chk.q.dtype) else chk.q,
            k=to_float(chk.k, cdt) if half_code(chk.k.dtype) and chk.k8 is None else chk.k,
            v=to_float(chk.v, cdt) if half_code(chk.v.dtype) and chk.v8 is None else chk.v)
    rot_out = 0
    if chk.kq is not None and chk.kq.rotate:
        # rotated keys: the queries rotated the same way (q . k = qH . kH)
        qf = to_float(chk.q, cdt) if half_code(chk.q.dtype) else chk.q
        chk = chk._replace(q=fwht(qf.astype(cdt, copy=False)).astype(cdt, copy=False))
    if chk.vq is not None and chk.vq.rotate:
        rot_out = rotation_blocks(chk.v.shape[-1])
    folded = _folded_decode(chk)
    if folded is not None:
        return folded._replace(rot_out=rot_out)
    (_, _, _, _, _, _, mask_kind, pol, bshape, group, causal, scale, nthreads, window, softcap,
     slopes, sinks, need_w, need_lse) = chk[:19]
    q4 = (_q4(chk.kq), _q4(chk.vq))
    N, D = chk.q.shape[-2:]
    M, Dv = chk.k.shape[-2], chk.v.shape[-1]
    if max(N, M, D, Dv) > INT32_MAX:
        raise ValueError("sequence lengths and head dimensions must be below 2**31")
    q, k, v, ks, vs, m, fmts, aliased = _layout(chk)
    md = modes(pol, D)
    if any(q4):
        md = md._replace(bf16dot=0)
    q_scales = q_mu = None
    qk8 = md.qk8
    if qk8:
        q, k, ks, fmts, qk8, q_scales, q_mu, D = _int8_stage(chk, q, k, ks, fmts, md)
    if md.bf16dot in (3, 4) and qk8 not in (1, 2, 4, 5, 6):
        # the int16 P.V runs under the panels' int8 scores only (a call
        # the int8 stage sent to float products -- a soft cap, sinks, an
        # inf query -- takes float32 P.V)
        md = md._replace(bf16dot=0)
    conv = conversion(md, qk8, fmts, ks, vs)
    # strided float32 keys / values: copied a block at a time by the fused
    # kernel (plain float32 operands, the copy within COPIED_KV_BYTES);
    # aliasing values otherwise here
    copied_kv = (not conv and not qk8 and cdt == F32 and not need_w
                 and copies_kv(N, M, D, Dv, _strided_rows(k) or _strided_rows(v)))
    pl = plan_call(cdt, N, M, D, Dv, causal, math.prod(bshape), nthreads, need_w,
                   kernel_path="portable" if qk8 == 3 or any(q4) else None, converted_kv=conv,
                   copied_kv=copied_kv)
    if aliased and not pl.kvcopy:
        v = _dense_rows(v)
    if HALF_BF16 in fmts:
        q, k, v = bits(q, fmts[0]), bits(k, fmts[1]), bits(v, fmts[2])
    if q_mu is not None:
        # (the row terms of a huge scale may leave the float32 range: the
        # call's float64 re-run handles it, NumPy need not warn)
        with np.errstate(over="ignore"):
            q_mu = np.float32(scale) * q_mu
    return Call(q=q, k=k, v=v, mask=m, mask_kind=mask_kind, bshape=bshape, group=group, N=N,
                M=M, D=D, Dv=Dv, causal=causal, scale=scale, window=window, softcap=softcap,
                k_scales=ks, v_scales=vs, q_scales=q_scales, fmts=fmts, slopes=slopes,
                sinks=sinks, bf16dot=md.bf16dot if pl.fused else 0, qk8=qk8, plan=pl,
                compute=cdt, need_weights=need_w, need_lse=need_lse, lse_shift=q_mu,
                q4=q4 if any(q4) else None, rot_out=rot_out)


# --------------------------------------------------------------------------
# describing a paged call (attncore.paged_attention, varlen_attention, a
# folded decoding step) -> Call
# --------------------------------------------------------------------------
def _cache_layout(a: np.ndarray) -> np.ndarray:
    """A cache array (num_blocks, block_size, H, D) as the kernel reads it
    in place (last axis contiguous, strides non-negative multiples of the
    item size, a block's rows at least D apart, within a BLAS leading
    dimension), else a contiguous copy (only for caches the kernel cannot
    read)."""
    a = aligned(a)
    isz, st = a.itemsize, a.strides
    ok = all(s >= 0 and s % isz == 0 for s in st)
    if ok and a.shape[-1] > 1 and st[-1] != isz:
        ok = False
    if ok and a.shape[1] > 1 and (st[1] < a.shape[-1] * isz or st[1] // isz > INT32_MAX):
        ok = False
    return a if ok else np.ascontiguousarray(a)


def _paged_layout(q, k, ks, v, vs, cdt):
    """(q, k, k_scales, v, v_scales, fmts): a paged call's operands laid out
    for the kernel (16-bit ones read in place, converted for float64)."""
    if cdt == F64:
        # the float64 kernel takes 16-bit operands converted (a copy)
        q, k, v = (a if not half_code(a.dtype) else to_float(a, cdt) for a in (q, k, v))
    fmts = (half_code(q.dtype), 0 if ks is not None else half_code(k.dtype),
            0 if vs is not None else half_code(v.dtype))
    q = blas_rows(q if (fmts[0] or q.dtype == cdt) else q.astype(cdt))
    # the kernels' row axis of q is its tokens' (axis 0: BLAS's leading
    # dimension of a prompt chunk); blas_rows checked the heads' (axis 1)
    st0 = q.strides[0]
    if q.shape[0] > 1 and (st0 < q.shape[2] * q.itemsize or st0 % q.itemsize
                           or st0 // q.itemsize > INT32_MAX):
        q = np.ascontiguousarray(q)
    if ks is None:
        k = k if (fmts[1] or k.dtype == cdt) else k.astype(cdt)
        v = v if (fmts[2] or v.dtype == cdt) else v.astype(cdt)
    else:
        ks, vs = (_cache_layout(s.astype(cdt, copy=False)) for s in (ks, vs))
    return q, _cache_layout(k), ks, _cache_layout(v), vs, fmts


def describe_paged(q, k, ks, v, vs, *, block_table, seq_lens, cu_q, pol: Policy, group: int,
                   scale: float, causal: int, window: tuple, softcap: float, slopes, sinks,
                   nthreads: int, need_lse: bool, cu_k=None, q4: tuple = (0, 0),
                   rot_out: int = 0) -> Call:
    """The description of one paged call: q (total_q, Hq, D), k / v block
    pools (num_blocks, block_size, Hk, D / Dv) (int8 ones with scales
    ``ks`` / ``vs``; 4-bit ones, ``q4`` their (key, value) group sizes,
    codes (..., D / 2) with float32 slots (..., D / gs) as scales: float32
    calls), checked; ``cu_k``: each sequence's first slot in its blocks
    (packed variable-length calls: the keys are one block, the sequences'
    offsets), else 0; ``rot_out``: rotated values (the output rotated
    back, blocks of that size)."""
    cdt = pol.compute
    if any(q4) and cdt != F32:
        raise ValueError("4-bit caches: float32 calls only (the caller dequantizes otherwise)")
    q, k, ks, v, vs, fmts = _paged_layout(q, k, ks, v, vs, cdt)
    Hq, D = q.shape[1], q.shape[2]
    Dv = v.shape[3] * (2 if q4[1] else 1)
    lq = np.diff(cu_q)
    flops = 2.0 * Hq * float(np.dot(lq.astype(np.float64), seq_lens.astype(np.float64))) * \
        (D + Dv)
    md = modes(pol._replace(products="float32") if pol.products == "int8" else pol, D)
    if any(q4):
        md = md._replace(bf16dot=0)
    maxq = int(lq.max()) if lq.size else 1
    pl = plan_call(cdt, max(maxq, 1), max(int(seq_lens.max()), 1), D, Dv, causal,
                   len(lq) * Hq, serial_or(flops, nthreads),
                   kernel_path="portable" if any(q4) else None,
                   converted_kv=conversion(md, 0, fmts, ks, vs))
    # one-query sequences: all query heads in one item (fold), each key
    # head's group of rows on each block in turn
    one = (lq == 1) & (slopes is None)
    pl = plan_paged(pl, lq, seq_lens, Hq, k.shape[1], one)
    q, k, v = (bits(a, f) for a, f in zip((q, k, v), fmts))
    return Call(q=q, k=k, v=v, mask=None, mask_kind=0, bshape=(Hq,), group=group, N=0, M=0,
                D=D, Dv=Dv, causal=causal, scale=scale, window=window, softcap=softcap,
                k_scales=ks, v_scales=vs, q_scales=None, fmts=fmts, slopes=slopes,
                sinks=sinks, bf16dot=md.bf16dot if pl.fused else 0, qk8=0, plan=pl,
                compute=cdt, need_lse=need_lse, cu_q=cu_q, cu_k=cu_k,
                block_table=block_table, seq_lens=seq_lens, fold=bool(one.any()),
                q4=tuple(q4) if any(q4) else None, rot_out=rot_out)


# --------------------------------------------------------------------------
# launching: the one call of the kernels
# --------------------------------------------------------------------------
def launch(c: Call) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None, bool]:
    """Run the kernel of ``c``: (out, weights or None, lse or None, whether
    out is all finite), in the compute dtype; dense calls (nb, N, Dv) /
    (nb, N, M) / (nb, N), packed ones (total_q, Hq, Dv).  The one call site
    of the compiled kernels (with :func:`launch_plain`), which read the
    description itself."""
    if c.block_table is not None:
        out = np.empty((c.q.shape[0], c.q.shape[1], c.Dv), dtype=c.compute)
        lse = np.empty(c.q.shape[:2], dtype=c.compute) if c.need_lse else None
        finite = _sdpa.sdpa_paged(c, out, lse)
        if c.N:  # a dense one-query call run folded (_folded_decode): its shapes
            nb = math.prod(c.bshape)
            out, lse = out.reshape(nb, 1, c.Dv), None if lse is None else lse.reshape(nb, 1)
        if c.rot_out:  # rotated values: the output rotated back
            out = fwht(out, c.rot_out)
        return out, None, lse, finite
    nb = math.prod(c.bshape)
    out = np.empty((nb, c.N, c.Dv), dtype=c.compute)
    weights = np.empty((nb, c.N, c.M), dtype=c.compute) if c.need_weights else None
    lse = np.empty((nb, c.N), dtype=c.compute) if c.need_lse else None
    finite = _sdpa.sdpa(c, out, weights, lse)
    if lse is not None and c.lse_shift is not None:
        lse += c.lse_shift
    if c.rot_out:  # rotated values: the output rotated back
        out = fwht(out, c.rot_out)
    return out, weights, lse, finite


def launch_plain(fields: tuple, shape: tuple, dtype: np.dtype) -> tuple[np.ndarray, bool]:
    """:func:`launch` of a dense call without weights, lse or lse shift
    whose :class:`Call` comes as a plain tuple of its fields (the lean path
    of the descriptions that attncore._lean caches by operand
    metadata): (out, whether it is all finite), out allocated in ``shape``
    (its elements those of (nb, N, Dv) in order) of the compute dtype."""
    out = np.empty(shape, dtype=dtype)
    return out, _sdpa.sdpa(fields, out, None, None)


def stand_in(shape: tuple, dtype: Any) -> np.ndarray:
    """A read-only array of ``shape`` and ``dtype`` whose memory is one
    element: :func:`check` runs on it as on the real operand (metadata
    only; attncore.dask's dask arrays)."""
    dt = np.dtype(dtype)
    return np.broadcast_to(np.zeros((), dt if dt.isnative else dt.newbyteorder("=")), shape)
