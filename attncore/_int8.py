"""int8 Q.K^T (``precision="int8"``): the operands' quantization.

The scores of ``precision="int8"`` are products of int8 query and key rows
with an exact int32 sum (``vpdpbusd``: AVX512_VNNI, or AVX-VNNI on the
AVX2 path), scaled to float32 before the float32 online softmax; P.V runs
as 16-bit integer pairs where the CPU has ``vpdpwssd`` (the kernels:
``ac_int8dot.h``).  Calls on float keys too small to repay quantizing them
take float32 products (``attncore._call.int8_pays``).  Before quantizing:

* **Smoothing.**  The keys' mean over the keys the call sees, per channel
  and per (batch element, key head), is subtracted from every key:
  ``q . k = q . (k - mu) + q . mu`` and the last term is the same for all
  keys of a query row, which the softmax ignores.  Real models' keys carry
  large per-channel offsets; without them the int8 range is spent on the
  spread of the keys only.  The term ``q . mu`` is put back where the
  result depends on it: the log-sum-exp, and the scores themselves when a
  soft cap or an attention sink makes the softmax depend on their level.
* **Channel balancing** (SmoothQuant's migration, alpha = 1/2).  Channel c
  of the smoothed keys is divided by ``s_c = sqrt(a(k_c - mu_c) / a(q_c))``
  and the queries' channel c multiplied by it: exact in real arithmetic, it
  shares an outlier channel's range between the two operands, so that it
  no longer sets every token's scale alone.  ``a(x)`` is the channel's
  largest magnitude, SmoothQuant's choice, but at most 16 times its mean
  magnitude: with the plain maximum one outlier entry of one query sets the
  factor of its channel for every other query, while a mean alone (no
  maximum) lost accuracy on a real decoder, whose outlier channels are
  large in every token (bench/int8_accuracy.py: the other rows beside one
  outlier, and the real decoder's KL divergence).  The statistics skip inf / NaN entries: such a row's own NaN
  scale reaches exactly the scores it takes part in.
* **Scales**: symmetric, one per query row and one per key row (per
  token): ``x8 = round(x / (max|x| / 127))``.  Measured against per-block
  scales (64 rows) on N(0, 1) inputs, per token halves the error
  (``docs/guide/variants.rst``) and costs one float multiply per score.

Int8 keys given by the caller (an int8 KV cache from
:func:`attncore.quantize_kv`) are used as they are: their quantization is
already done, without smoothing.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np

from ._core import _sdpa

_F32 = np.float32

# what is done to the keys before quantizing (private; benchmarks show
# the method's parts): "full" (smoothing and channel balancing), "mean"
# (smoothing only), "off" (neither)
_SMOOTHING = "full"

# the balancing statistic of a channel: its largest magnitude, but at most
# this many times its mean magnitude (see the module's docstring)
_CLIP = 16.0


def _set_smoothing(mode: str) -> str:
    """Private, process-wide (benchmarks): 'full', 'mean' or 'off'.
    Returns the previous mode."""
    global _SMOOTHING
    if mode not in ("full", "mean", "off"):
        raise ValueError(f"smoothing must be 'full', 'mean' or 'off', got {mode!r}")
    prev, _SMOOTHING = _SMOOTHING, mode
    return prev


class Int8Operands(NamedTuple):
    """What the kernel reads for ``precision="int8"``."""

    q8: np.ndarray            #: int8 (nb, N, ld) query rows, ld a multiple of 4
    q_scales: np.ndarray      #: float32 (nb, N)
    q_mu: Optional[np.ndarray]  #: float32 (nb, N): q . mu (None: no smoothing)
    k8: np.ndarray            #: int8 (..., M, ld) key rows (the keys' own batch shape)
    k_pairs: np.ndarray       #: float32 (..., M, 2): per key (scale, 128 sum k8 as int32 bits)


def _ld(D: int) -> int:
    return (D + 3) // 4 * 4


def _heads(a: np.ndarray, rows: int, D: int) -> np.ndarray:
    """``a`` (..., rows, D) as (n, rows, D), a view where the layout allows."""
    h = a.reshape(-1, rows, D)
    if D > 1 and h.strides[-1] != h.itemsize:
        h = np.ascontiguousarray(h)
    return h


def _bits(a: np.ndarray, fmt: int) -> np.ndarray:
    """16-bit operands as their bits (the C code converts them)."""
    return a.view(np.uint16) if fmt and a.dtype != np.uint16 else a


def _per_key_head(x: np.ndarray, bshape: tuple, group: int, kown: tuple,
                  reduce=np.max) -> np.ndarray:
    """Per query head values ``x`` (nb, D) reduced (``reduce``: np.max or
    np.mean) over the query heads of each of the keys' own heads
    (prod(kown), D): over a group's query heads and over the batch axes
    along which the keys broadcast."""
    D = x.shape[-1]
    H = bshape[-1] if bshape else 1
    lead = tuple(bshape[:-1])
    a = reduce(x.reshape(lead + (H // group, group, D)), axis=-2)
    kb = lead + (H // group,)
    kp = (1,) * (len(kb) - len(kown)) + tuple(kown)
    for i, (n_k, n_b) in enumerate(zip(kp, kb)):
        if n_k == 1 and n_b > 1:
            a = reduce(a, axis=i, keepdims=True)
    return a.reshape(-1, D)


def _per_query_head(x: np.ndarray, bshape: tuple, group: int, kown: tuple) -> np.ndarray:
    """Per key head values ``x`` (prod(kown), D) spread to every query head
    (nb, D), C-contiguous float32."""
    D = x.shape[-1]
    H = bshape[-1] if bshape else 1
    lead = tuple(bshape[:-1])
    kb = lead + (H // group,)
    kp = (1,) * (len(kb) - len(kown)) + tuple(kown)
    a = np.broadcast_to(x.reshape(kp + (D,)), kb + (D,))
    a = np.repeat(a, group, axis=-2)
    return np.ascontiguousarray(a.reshape(-1, D), dtype=_F32)


def _balance(kh: np.ndarray, kf: int, qh: np.ndarray, qf: int, bshape: tuple, group: int,
             kown: tuple, nt: int) -> tuple[np.ndarray, np.ndarray]:
    """(s, mu) per key head (prod(kown), D): the channel balance and the
    keys' mean (see the module's docstring; ``_SMOOTHING`` may turn either
    off)."""
    nkh, D = kh.shape[0], kh.shape[-1]
    mu, kmean, kmax = (np.empty((nkh, D), _F32) for _ in range(3))
    _sdpa.int8_col_stats(kh, kf, mu, kmean, kmax, nt)
    qmean_h, qmax_h = (np.empty((qh.shape[0], D), _F32) for _ in range(2))
    _sdpa.int8_col_stats(qh, qf, None, qmean_h, qmax_h, nt)
    with np.errstate(over="ignore"):     # (a huge mean: the maximum is smaller)
        ak = np.minimum(kmax, _CLIP * kmean)
        aq = np.minimum(_per_key_head(qmax_h, bshape, group, kown),
                        _CLIP * _per_key_head(qmean_h, bshape, group, kown, np.mean))
    # columns whose k - mu could overflow float32: neither smoothed nor
    # balanced (inf / NaN entries take no part in the statistics: the
    # rows holding them get a NaN scale, which reaches exactly the
    # scores those rows take part in)
    safe = (np.abs(mu) + kmax) < 1e37
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        s = np.sqrt(ak / aq)
    ok = np.isfinite(s) & (ak > 0) & (aq > 0) & safe
    s = np.where(ok, np.clip(s, 2.0 ** -16, 2.0 ** 16), 1.0).astype(_F32)
    mu = np.where(safe, mu, 0).astype(_F32)
    if _SMOOTHING != "full":
        s = np.ones_like(s)
        if _SMOOTHING == "off":
            mu = np.zeros_like(mu)
    return s, mu


def _float_keys(qh: np.ndarray, qf: int, k: np.ndarray, kf: int, bshape: tuple, group: int,
                nt: int) -> Int8Operands:
    """The int8 operands of float keys: smoothed, balanced, quantized."""
    nb, N, D = qh.shape
    ld, M, kown = _ld(D), k.shape[-2], tuple(k.shape[:-2])
    kh = _heads(_bits(k, kf), M, D)
    s, mu = _balance(kh, kf, qh, qf, bshape, group, kown, nt)
    k_out = np.empty((kh.shape[0], M, ld), np.int8)
    sk = np.empty((kh.shape[0], M), _F32)
    ksum = np.empty((kh.shape[0], M), np.int32)
    _sdpa.int8_quantize(kh, kf, mu, np.ascontiguousarray(1.0 / s, dtype=_F32), None,
                        k_out, sk, None, ksum, nt)
    w_q = _per_query_head(s, bshape, group, kown)
    mu_q = _per_query_head(mu, bshape, group, kown)
    q_out = np.empty((nb, N, ld), np.int8)
    sq = np.empty((nb, N), _F32)
    qmu = np.empty((nb, N), _F32)
    _sdpa.int8_quantize(qh, qf, None, w_q, mu_q, q_out, sq, qmu, None, nt)
    kpairs = np.stack([sk, ksum.view(_F32)], axis=-1).reshape(kown + (M, 2))
    return Int8Operands(q_out, sq, qmu, k_out.reshape(kown + (M, ld)), kpairs)


def _given_keys(qh: np.ndarray, qf: int, k8: np.ndarray, k8_scales: np.ndarray, nt: int,
                pairs: bool) -> Int8Operands:
    """The int8 operands of int8 keys as given: no smoothing, no balancing
    (their quantization is done); rows padded to a multiple of 4 bytes
    where they are not."""
    nb, N, D = qh.shape
    ld, M, st = _ld(D), k8.shape[-2], k8.strides
    if (D % 4 or st[-1] != 1 or (M > 1 and st[-2] % 4) or any(x < 0 for x in st)
            or k8.ctypes.data % 4):
        kp8 = np.zeros(k8.shape[:-1] + (ld,), np.int8)
        kp8[..., :D] = k8
        k8 = kp8
    sc = np.asarray(k8_scales, dtype=_F32)
    if pairs:
        ksum = (128 * k8[..., :D].sum(axis=-1, dtype=np.int64)).astype(np.int32)
        kpr = np.stack([np.broadcast_to(sc, ksum.shape), ksum.view(_F32)], axis=-1)
    else:
        kpr = sc[..., None]
        if any(x % 4 or x < 0 for x in kpr.strides) or not kpr.flags.aligned:
            kpr = np.ascontiguousarray(kpr)
    q_out = np.empty((nb, N, ld), np.int8)
    sq = np.empty((nb, N), _F32)
    _sdpa.int8_quantize(qh, qf, None, np.ones((nb, D), _F32), None, q_out, sq, None, None, nt)
    return Int8Operands(q_out, sq, None, k8, kpr)


def quantize(q: np.ndarray, qf: int, k: Optional[np.ndarray], kf: int,
             k8: Optional[np.ndarray], k8_scales: Optional[np.ndarray],
             bshape: tuple, group: int, nthreads: int, pairs: bool = True) -> Int8Operands:
    """The int8 operands of one call.

    q: the queries as laid out for the kernel (float32, or 16-bit with
    ``qf``), broadcastable to ``bshape + (N, D)``.  Either k (float keys,
    format ``kf``) or k8 / k8_scales (int8 keys and their per-row scales,
    ``(..., M)``).  ``pairs``: int8 keys given get the per-key pairs (scale,
    128 sum k8) the fused kernel reads; else (the direct loops of a few
    rows, decoding) their scales alone, ``(..., M, 1)`` (no pass over the
    keys).
    """
    N, D = q.shape[-2], q.shape[-1]
    qh = _heads(_bits(np.broadcast_to(q, tuple(bshape) + (N, D)), qf), N, D)
    nt = max(1, int(nthreads))
    if k8 is None:
        assert k is not None
        return _float_keys(qh, qf, k, kf, tuple(bshape), group, nt)
    assert k8_scales is not None
    return _given_keys(qh, qf, k8, k8_scales, nt, pairs)


def dequantized(ops: Int8Operands, bshape: tuple, D: int) -> tuple[np.ndarray, np.ndarray]:
    """float32 query and key rows whose products are those of the int8
    rows (to float rounding), with one more channel carrying ``q . mu``:
    ``[q8 sq, q.mu] . [k8 sk, 1] = scores / scale``.  The path of the calls
    the kernel's int8 mode does not take (attention weights, a soft cap,
    sinks): a copy of Q and K."""
    N = ops.q8.shape[1]
    nb = ops.q8.shape[0]
    qt = np.empty((nb, N, D + 1), _F32)
    qt[..., :D] = ops.q8[..., :D] * ops.q_scales[..., None]
    # q . mu beyond float32 (finite rows, huge keys' means): NaN, so that
    # the row is NaN and the call is computed again in float64 (an inf
    # here would read as the inputs' own -inf scores: a row of 0)
    qt[..., D] = 0.0 if ops.q_mu is None else np.where(np.isinf(ops.q_mu), np.nan, ops.q_mu)
    kt = np.empty(ops.k8.shape[:-1] + (D + 1,), _F32)
    kt[..., :D] = ops.k8[..., :D] * ops.k_pairs[..., :1]
    kt[..., D] = 1.0
    return qt.reshape(tuple(bshape) + (N, D + 1)), kt
