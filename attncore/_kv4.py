"""4-bit and rotated keys and values: the container and its quantizers.

:func:`attncore.quantize_kv` returns a :class:`QuantizedKV` for
``bits=4`` or ``rotate=True``; its plain int8 result (``(int8 array,
float32 scales)``) stays as it was.  The math is documented on
:class:`QuantizedKV`; this module is NumPy only.

Choices, measured (``bench/kv4_accuracy.py``: SmolLM2-135M-Instruct, every
attention call's K/V replaced by their quantize-dequantize, KL of the
next-token distribution from float32's over 3 x 512 tokens; Xeon family 6
model 207):

* **Scales and offsets float16.**  A group of 32 four-bit codes is 16
  bytes; float32 scale and offset add 8 more (6 bits per value), float16
  ones 4 (5 bits per value), and decoding reads bytes.  A float16 scale is
  the float32 one rounded *up* (so the half-step bound holds with the
  stored scale), at most 2**-10 larger: the relative RMS error of the
  model's own K / V grew by 0.06 % (1.0023e-1 -> 1.0030e-1 for K), the KL
  did not move beyond its noise (4.6e-2 / 4.3e-2).  Values must then lie
  within the float16 range (``|x| <= 65504``).
* **Asymmetric** (an offset per group, the group's minimum rounded down):
  KL 6.6e-2 against 1.5e-1 for symmetric groups (4.3e-2 / 7.3e-2 rotated),
  for half a bit per value more.
* **Groups of 32** along D by default: 64 cost more accuracy (KL 5.7e-2
  rotated) than the half bit they save; 16 are more accurate (2.9e-2
  rotated; with the 128 most recent tokens unquantized 1.5e-3 against
  2.2e-3 for 32) but take 6 bits per value, 48 bytes per row of 64 against
  40, and decoding is bound by bytes.
* **Rotation** helps every format: int8 rows 1.0e-3 -> 2.7e-4.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Optional

import numpy as np

from ._linear import linear

__all__ = ["QuantizedKV", "fwht", "rotation_blocks", "quantize4", "check_format",
           "kernel_slots", "checked"]

_F16_MAX = 65504.0
DEFAULT_GROUP = 32
# the 4-bit caches' default group size (bench/kv4_accuracy.py, SmolLM2-135M
# over real text, rotated groups: 16 with the 128 most recent tokens in
# float, KL from float32 1.48e-3, against 2.22e-3 for groups of 32)
DEFAULT_CACHE_GROUP = 16


def rotation_blocks(D: int) -> int:
    """The size of the Hadamard blocks of ``rotate=True`` along a head
    dimension ``D``: ``D`` itself when it is a power of two; else the
    largest power of two dividing ``D`` when that is at least 32 (D a
    multiple of 32: 96 -> 3 blocks of 32, 192 -> 3 of 64); otherwise a
    ValueError naming D."""
    D = int(D)
    if D >= 1 and D & (D - 1) == 0:
        return D
    b = D & -D
    if D > 0 and b >= 32:
        return b
    raise ValueError(f"rotate=True needs a head dimension D that is a power of two or a "
                     f"multiple of 32 (a block-diagonal Hadamard transform over blocks of the "
                     f"largest power of two dividing D), got D = {D}")


# fwht as a matrix product for blocks up to _MATMUL_BLOCK (O(b) work per
# element instead of O(log b), on BLAS): faster at every size (the
# butterflies' log2(b) NumPy passes cost microseconds each: a decode call's
# 8 rows of 64, float32, 42 -> 4.3 us; 4096 x 3 rows of 64, 24 -> 2.3 ms;
# Xeon family 6 model 207)
_MATMUL_BLOCK = 256
# products of fewer multiply-adds run on the calling thread
_SERIAL_MACS = 1 << 22
_HADAMARD: dict = {}


def _hadamard(b: int, dt: np.dtype) -> np.ndarray:
    """The normalized Sylvester Hadamard matrix of order b (a power of
    two), of dtype dt, read-only and cached."""
    key = (b, dt.str)
    h = _HADAMARD.get(key)
    if h is None:
        m = np.ones((1, 1))
        while m.shape[0] < b:
            m = np.block([[m, m], [m, -m]])
        h = (m / math.sqrt(b)).astype(dt)
        h.flags.writeable = False
        _HADAMARD[key] = h
    return h


def fwht(x: np.ndarray, block: Optional[int] = None) -> np.ndarray:
    """The normalized Walsh-Hadamard transform of ``x`` along its last axis,
    block-diagonal over blocks of ``block`` elements (default
    :func:`rotation_blocks` of the last axis): ``y = x H`` with ``H`` the
    Sylvester Hadamard matrix of the block divided by ``sqrt(block)``,
    symmetric and orthogonal (``fwht(fwht(x)) == x``).  O(D log D) per row,
    vectorized: log2(block) passes of butterflies.  A new array of x's
    float dtype (float32 stays float32; others float64)."""
    a = np.asarray(x)
    dt = np.dtype(np.float32 if a.dtype == np.float32 else np.float64)
    D = a.shape[-1]
    b = rotation_blocks(D) if block is None else int(block)
    if b <= _MATMUL_BLOCK:
        # one matrix product with the normalized Hadamard matrix (symmetric:
        # x H = x H^T), on attncore's threads: NumPy's matmul would wake the
        # BLAS library's own thread pool, whose spinning workers then took a
        # core from the kernel's team (8 x 8 decode rows of 128 before a
        # 2-thread int8 call: 2.5 -> 5.4 ms)
        x2 = np.asarray(a, dtype=dt).reshape(-1, b)
        # (a call's query / output rows on the calling thread: an OpenMP
        # team's workers spinning after the product took a core from the
        # kernel's team, 8 x 8 rows of 128 at 2 threads: 3.9 -> 4.7 ms)
        y = linear(x2, _hadamard(b, dt),
                   num_threads=1 if x2.shape[0] * b * b < _SERIAL_MACS else None)
        return y.reshape(a.shape)
    y = np.array(a, dtype=dt, copy=True).reshape(-1, D // b, b)
    h = 1
    while h < b:
        z = y.reshape(y.shape[0], D // b, b // (2 * h), 2, h)
        lo = z[:, :, :, 0, :]
        hi = z[:, :, :, 1, :]
        s = lo + hi
        hi = lo - hi
        z[:, :, :, 0, :] = s
        z[:, :, :, 1, :] = hi
        h *= 2
    y *= dt.type(1.0 / math.sqrt(b))
    return y.reshape(a.shape)


@dataclasses.dataclass(frozen=True, eq=False)
class QuantizedKV:
    """Keys or values quantized by :func:`attncore.quantize_kv` in a 4-bit
    or rotated format.  Frozen; the arrays are NumPy arrays (torch tensors
    when ``quantize_kv`` was given torch tensors: see :meth:`numpy`).

    The original array ``x`` has shape ``(..., M, D)`` (``shape``); the
    format quantizes along D, in groups of ``group_size`` consecutive
    elements of a row.

    Attributes
    ----------
    codes : ndarray
        ``bits == 4``: uint8 ``(..., M, D // 2)``, two codes per byte along
        D, the even element in the low nibble (``x[..., 2i]`` -> ``codes[...,
        i] & 15``, ``x[..., 2i+1]`` -> ``codes[..., i] >> 4``).
        ``bits == 8``: int8 ``(..., M, D)``.
    scales : ndarray
        ``(..., M, D // group_size)``: float16 for 4 bits, float32 for 8.
    offsets : ndarray or None
        4-bit asymmetric groups: float16 ``(..., M, D // group_size)``, the
        value of code 0 (the group's minimum rounded down to float16).
        None: symmetric (4 bits: code ``c`` stands for ``c - 8``; 8 bits:
        signed codes).
    bits : int
        4 or 8.
    group_size : int
        Elements per scale along D (8 bits: D, one scale per row).
    rotate : bool
        Whether the rows were rotated (``fwht``) before quantizing.
    axis : int
        The axis quantized along: -1 (D).

    Notes
    -----
    With ``g = d // group_size`` for element ``d`` of a row, the value
    the format stands for, in the rotated basis when ``rotate``, is
    ``r[..., d] = scales[..., g] * c[..., d] + offsets[..., g]`` (4 bits,
    asymmetric, ``c`` in 0..15), ``scales[..., g] * (c[..., d] - 8)`` (4
    bits, symmetric) or ``scales[..., g] * c[..., d]`` (8 bits), computed in
    float32 from the stored values.  Every element is within half a scale
    of the (rotated) input: ``|xr - r| <= scales / 2``.  With ``rotate``,
    :meth:`dequantize` returns ``fwht(r)``: the rotation is its own inverse.
    Attention over rotated keys is that over the original keys when the
    queries are rotated the same way (``q . k = (q H) . (k H)``); over
    rotated values its output comes out rotated and is rotated back.
    """

    codes: Any
    scales: Any
    offsets: Any
    bits: int
    group_size: int
    rotate: bool
    axis: int = -1

    @property
    def shape(self) -> tuple:
        """The shape of the original array, ``(..., M, D)``."""
        sh = tuple(int(n) for n in self.codes.shape)
        return sh[:-1] + (sh[-1] * (2 if self.bits == 4 else 1),)

    @property
    def ndim(self) -> int:
        return len(self.codes.shape)

    @property
    def dtype(self) -> np.dtype:
        """The dtype of :meth:`dequantize`: float32."""
        return np.dtype(np.float32)

    @property
    def nbytes(self) -> int:
        """Bytes of the codes, scales and offsets."""
        return sum(_nbytes(a) for a in (self.codes, self.scales, self.offsets) if a is not None)

    def numpy(self) -> "QuantizedKV":
        """The same container with NumPy arrays (torch tensors read in
        place where they allow it)."""
        from ._interop import _to_numpy

        def cv(a, nm):
            return None if a is None else np.asarray(_to_numpy(a, nm)[0])
        return dataclasses.replace(self, codes=cv(self.codes, "codes"),
                                   scales=cv(self.scales, "scales"),
                                   offsets=cv(self.offsets, "offsets"))

    def _map_arrays(self, fn) -> "QuantizedKV":
        """The container with ``fn`` applied to each array (the interop
        layer's output conversion)."""
        return dataclasses.replace(self, codes=fn(self.codes), scales=fn(self.scales),
                                   offsets=None if self.offsets is None else fn(self.offsets))

    def dequantize(self, rotated: bool = False) -> np.ndarray:
        """The float32 values the format stands for (see the class's Notes),
        in the original basis (``rotated=False``) or, for a rotated
        container, the rotated one (what the kernels' products read)."""
        c = self.numpy()
        r = _unpack(c.codes, c.bits).astype(np.float32)
        sh = r.shape
        G = sh[-1] // c.group_size
        r = r.reshape(sh[:-1] + (G, c.group_size))
        s = c.scales.astype(np.float32)[..., None]
        if c.bits == 4 and c.offsets is None:
            r -= np.float32(8)
        r *= s
        if c.offsets is not None:
            r += c.offsets.astype(np.float32)[..., None]
        r = r.reshape(sh)
        if c.rotate and not rotated:
            r = fwht(r)
        return r

    def __getitem__(self, idx) -> "QuantizedKV":
        """Rows selected along the leading axes (not the last): ``kv[b]``,
        ``kv[:, h]``, ``kv[..., :m, :]``."""
        if not isinstance(idx, tuple):
            idx = (idx,)
        if any(i is Ellipsis for i in idx):
            k = idx.index(Ellipsis)
            idx = idx[:k] + (slice(None),) * (self.ndim - len(idx) + 1) + idx[k + 1:]
        if len(idx) >= self.ndim and idx[self.ndim - 1] != slice(None):
            raise IndexError("a QuantizedKV is indexed along its leading axes only (not D)")
        idx = idx[:self.ndim - 1]
        return self._map_arrays(lambda a: a[idx])

    def __repr__(self) -> str:
        form = ("asymmetric" if self.offsets is not None else "symmetric")
        return (f"QuantizedKV(shape={self.shape}, bits={self.bits}, {form}, "
                f"group_size={self.group_size}, rotate={self.rotate})")


def _nbytes(a) -> int:
    n = getattr(a, "nbytes", None)
    if n is None:       # torch
        return int(a.numel() * a.element_size())
    return int(n)


def _unpack(codes: np.ndarray, bits: int) -> np.ndarray:
    """uint8 codes (0..15, 4 bits) or int8 codes (8 bits) of every element."""
    if bits == 8:
        return codes
    out = np.empty(codes.shape[:-1] + (2 * codes.shape[-1],), np.uint8)
    out[..., 0::2] = codes & 15
    out[..., 1::2] = codes >> 4
    return out


def _pack(c: np.ndarray) -> np.ndarray:
    """Codes 0..15 of (..., D) two per byte, the even element low."""
    return (c[..., 0::2] | (c[..., 1::2] << 4)).astype(np.uint8)


def _f16_up(x: np.ndarray) -> np.ndarray:
    """float64 ``x >= 0`` as float16, rounded up."""
    h = x.astype(np.float16)
    low = h.astype(np.float64) < x
    return np.where(low, np.nextafter(h, np.float16(np.inf)), h)


def _f16_down(x: np.ndarray) -> np.ndarray:
    h = x.astype(np.float16)
    high = h.astype(np.float64) > x
    return np.where(high, np.nextafter(h, np.float16(-np.inf)), h)


def quantize4(a: np.ndarray, group_size: int, symmetric: bool) -> tuple:
    """(codes, scales, offsets) of float ``a`` (..., D), finite, within the
    float16 range, already rotated where asked.  Scales and offsets
    float16; the codes from the stored values (so that the half-step bound
    holds for them)."""
    sh = a.shape
    D = sh[-1]
    g = a.astype(np.float64).reshape(sh[:-1] + (D // group_size, group_size))
    if symmetric:
        s = _f16_up(np.max(np.abs(g), axis=-1) / 7.0)
        s64 = s.astype(np.float64)[..., None]
        den = np.where(s64 == 0, 1.0, s64)
        c = np.clip(np.rint(g / den), -7, 7) + 8
        off = None
    else:
        lo = _f16_down(np.min(g, axis=-1))
        lo64 = lo.astype(np.float64)[..., None]
        s = _f16_up((np.max(g, axis=-1) - lo.astype(np.float64)) / 15.0)
        s64 = s.astype(np.float64)[..., None]
        den = np.where(s64 == 0, 1.0, s64)
        c = np.clip(np.rint((g - lo64) / den), 0, 15)
        off = lo
    codes = _pack(c.astype(np.uint8).reshape(sh))
    if off is None:
        return codes, s, None
    # scale and offset side by side in memory (the kernels read each pair
    # as one 32-bit slot, in place: kernel_slots)
    so = np.empty(s.shape + (2,), np.float16)
    so[..., 0] = s
    so[..., 1] = off
    return codes, so[..., 0], so[..., 1]


def kernel_slots(kv: "QuantizedKV") -> np.ndarray:
    """The (scale, offset) pairs of a 4-bit container as the kernels read
    them: float32 ``(..., M, G)`` slots, each the two float16 of a group
    (scale in the low half).  A view where the container's scales and
    offsets lie side by side (as :func:`attncore.quantize_kv` makes them),
    else a copy (symmetric groups: offset ``-8 scale``)."""
    s, o = kv.scales, kv.offsets
    if (o is not None and s.shape == o.shape and s.strides == o.strides
            and o.ctypes.data == s.ctypes.data + 2 and s.ctypes.data % 4 == 0
            and all(st % 4 == 0 and st >= 0 for st in s.strides)):
        pair = np.lib.stride_tricks.as_strided(s, s.shape + (2,), s.strides + (2,),
                                               writeable=False)
        return pair.view(np.float32)[..., 0]
    if o is None:
        with np.errstate(over="ignore"):
            o = (np.float32(-8) * s.astype(np.float32)).astype(np.float16)
        if not np.all(np.isfinite(o[np.isfinite(s)])):
            raise ValueError("symmetric 4-bit scales above 8188 (|x| beyond about 57000) "
                             "are not read by the kernels: quantize asymmetrically")
    so = np.empty(s.shape + (2,), np.float16)
    so[..., 0] = s
    so[..., 1] = o
    return so.view(np.float32)[..., 0]


def checked(kv: "QuantizedKV", name: str) -> "QuantizedKV":
    """A container given as a key / value, its arrays as NumPy arrays,
    checked for one consistent format (ValueError / TypeError naming
    ``name``)."""
    kv = kv.numpy()
    c, s, o = kv.codes, kv.scales, kv.offsets
    if kv.bits not in (4, 8) or kv.axis != -1 or c.ndim < 2:
        raise ValueError(f"{name}: a QuantizedKV of bits 4 or 8 along axis -1 with at least 2 "
                         f"dimensions, got bits={kv.bits}, axis={kv.axis}, codes {c.shape}")
    want = np.uint8 if kv.bits == 4 else np.int8
    if c.dtype != want:
        raise TypeError(f"{name}: {kv.bits}-bit codes must be {np.dtype(want)}, got {c.dtype}")
    D = kv.shape[-1]
    gs = kv.group_size
    sdt = np.float16 if kv.bits == 4 else np.float32
    if (isinstance(gs, bool) or not isinstance(gs, numbers.Integral) or gs <= 0 or D % gs
            or (kv.bits == 8 and gs != D)):
        raise ValueError(f"{name}: group_size {gs!r} does not fit D = {D} ({kv.bits} bits)")
    G = D // gs
    for nm, a in (("scales", s), ("offsets", o)):
        if a is None:
            continue
        if a.dtype != sdt or a.shape != c.shape[:-1] + (G,):
            raise ValueError(f"{name}: {nm} of a {kv.bits}-bit container must be {np.dtype(sdt)} "
                             f"{c.shape[:-1] + (G,)} (one per group of {gs}), got {a.dtype} "
                             f"{a.shape}")
    if o is not None and kv.bits == 8:
        raise ValueError(f"{name}: 8-bit containers are symmetric (offsets None)")
    if kv.rotate:
        rotation_blocks(D)
    return kv


def check_format(bits: Any, group_size: Any, rotate: Any, symmetric: Any, D: int,
                 ax: int, ndim: int) -> tuple:
    """(bits, group_size) checked for an array whose last axis is D."""
    for nm, v in (("rotate", rotate), ("symmetric", symmetric)):
        if not isinstance(v, (bool, np.bool_)):
            raise TypeError(f"{nm} must be a bool, got {type(v).__name__} {v!r}")
    if isinstance(bits, (bool, np.bool_)) or not isinstance(bits, numbers.Integral):
        raise TypeError(f"bits must be an int (4 or 8), got {type(bits).__name__} {bits!r}")
    if int(bits) not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    bits = int(bits)
    if group_size is not None and (isinstance(group_size, (bool, np.bool_))
                                   or not isinstance(group_size, numbers.Integral)):
        raise TypeError(f"group_size must be an int or None, got "
                        f"{type(group_size).__name__} {group_size!r}")
    if (bits == 4 or rotate) and ax != ndim - 1:
        raise ValueError(f"bits=4 and rotate=True quantize along the last axis (D): axis must "
                         f"be -1, got axis {ax - ndim} of {ndim}")
    if bits == 8:
        if group_size is not None and int(group_size) != D:
            raise ValueError(f"group_size: 8-bit rows take one scale per row (group_size None "
                             f"or D = {D}), got {group_size}")
        return bits, D
    gs = DEFAULT_GROUP if group_size is None else int(group_size)
    if group_size is None and D % gs:
        gs = D if D % 2 == 0 else gs
    if gs <= 0 or gs % 2 or D % gs:
        raise ValueError(f"group_size must be a positive even divisor of D = {D} for 4-bit "
                         f"codes (two per byte), got {gs}")
    return bits, gs
