"""The 4-bit key/value cache of :class:`attncore.MultiHeadAttention`
(``new_cache(..., dtype="int4")``): every token's keys and values in 4-bit
groups (:func:`attncore.quantize_kv`), and the most recent ``window``
tokens also in float, which attention reads instead of their 4-bit codes.

Attention over such a cache is two calls over disjoint keys merged by
their log-sum-exp (:func:`attncore.merge_attention`): the 4-bit tokens
before the window, none of which lies after a query of the call, and the
float tokens (the window's, then the call's own new tokens, read as
projected), under the call's causal alignment.  The float part of a call
is thus the window plus the call's own tokens: a prompt chunk attends its
own tokens in float, as decoding attends the window.
"""
from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from ._kv4 import DEFAULT_CACHE_GROUP, DEFAULT_GROUP, QuantizedKV, check_format
from ._kvcache import KVCache
from ._validation import parse_bool

__all__ = ["KVCache4", "DEFAULT_WINDOW", "DEFAULT_CACHE_GROUP"]

# the default recent window of a 4-bit cache (the group size:
# attncore._kv4.DEFAULT_CACHE_GROUP)
DEFAULT_WINDOW = 128


class KVCache4(KVCache):
    """A :class:`KVCache` whose keys and values are stored in 4 bits (see the
    module's docstring), made by ``MultiHeadAttention.new_cache(...,
    dtype="int4")``.

    Attributes (beyond :class:`KVCache`'s)
    --------------------------------------
    window : int
        Recent tokens also held in float (0: none).
    group_size : int
        Elements per float16 scale and offset along the head dimension.
    rotate : bool
        Whether rows are rotated (normalized Hadamard) before quantizing.
    """

    __slots__ = ("window", "group_size", "rotate", "_kc", "_kss", "_kso", "_vc", "_vss",
                 "_vso", "_fk", "_fv", "_f0")

    def __init__(self, batch_size: int, max_length: int, num_kv_heads: int, head_dim: int,
                 v_head_dim: int, dtype: Any = np.float32, *, window: Any = None,
                 group_size: Any = None, rotate: Any = True) -> None:
        self._set_sizes(batch_size, max_length, num_kv_heads, head_dim, v_head_dim, dtype)
        if self.dtype != np.float32:
            raise ValueError(f"a 4-bit cache (dtype='int4') is for float32 layers, got a layer "
                             f"of dtype {self.dtype}")
        self.quantized = False
        if window is None:
            window = DEFAULT_WINDOW
        if isinstance(window, (bool, np.bool_)) or not isinstance(window, numbers.Integral) \
                or window < 0:
            raise ValueError(f"window must be an int >= 0 (recent tokens kept in float), got "
                             f"{window!r}")
        self.window = int(window)
        self.rotate = parse_bool(rotate, "rotate")
        gs = {}
        for name, d in (("head_dim", self.head_dim), ("v_head_dim", self.v_head_dim)):
            g = group_size
            if g is None:
                g = DEFAULT_CACHE_GROUP if d % DEFAULT_CACHE_GROUP == 0 else (
                    DEFAULT_GROUP if d % DEFAULT_GROUP == 0 else d)
            check_format(4, g, self.rotate, False, d, 3, 4)
            gs[name] = int(g)
        if gs["head_dim"] != gs["v_head_dim"] and group_size is not None:
            raise ValueError("group_size must divide both head_dim and v_head_dim")
        self.group_size = gs["head_dim"]
        shape = (self.batch_size, self.num_kv_heads, self.max_length)
        hd, hdv = self.head_dim, self.v_head_dim
        self._kc = np.zeros(shape + (hd // 2,), np.uint8)
        self._vc = np.zeros(shape + (hdv // 2,), np.uint8)
        self._kss = np.zeros(shape + (hd // gs["head_dim"],), np.float16)
        self._kso = np.zeros_like(self._kss)
        self._vss = np.zeros(shape + (hdv // gs["v_head_dim"],), np.float16)
        self._vso = np.zeros_like(self._vss)
        W = min(self.window, self.max_length)
        self._fk = np.zeros((self.batch_size, self.num_kv_heads, W, hd), np.float32)
        self._fv = np.zeros((self.batch_size, self.num_kv_heads, W, hdv), np.float32)
        # (the float / int8 fields of KVCache, empty)
        self._k = np.zeros((0, 0, 0, 0), np.float32)
        self._v = np.zeros((0, 0, 0, 0), np.float32)
        self._ks = self._vs = np.zeros((0, 0, 0), np.float32)
        self.reset()

    def __repr__(self) -> str:
        return (f"KVCache(batch_size={self.batch_size}, length={self._len}, "
                f"max_length={self.max_length}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, mode={self.mode!r}, dtype={self.dtype}, "
                f"storage=int4, group_size={self.group_size}, rotate={self.rotate}, "
                f"window={self.window})")

    @property
    def nbytes(self) -> int:
        """Bytes of the cache's buffers (4-bit codes, float16 scales and
        offsets, the float window)."""
        return sum(a.nbytes for a in (self._kc, self._kss, self._kso, self._vc, self._vss,
                                      self._vso, self._fk, self._fv))

    def reset(self) -> None:
        KVCache.reset(self)
        self._f0 = 0

    def reorder(self, indices: Any) -> None:
        n = self._len
        # (KVCache.reorder checks the indices and moves the per-token arrays)
        KVCache.reorder(self, indices)
        if n and not self.shared and self._fk.shape[2]:
            idx = np.asarray(indices).astype(np.intp)
            self._fk[:] = self._fk[idx]
            self._fv[:] = self._fv[idx]

    def crop(self, length: int) -> None:
        KVCache.crop(self, length)
        if self._len < self._f0:
            self._f0 = self._len

    # ------------------------------------------------------------ storage
    def _slot(self, t0: int, t1: int) -> np.ndarray:
        """Window slots of tokens [t0, t1) (token t at t % W)."""
        return np.arange(t0, t1) % self._fk.shape[2]

    def _append(self, k_new: np.ndarray, v_new: np.ndarray) -> None:
        from ._quant import _quantize_container

        T = k_new.shape[1]
        self._check_room(T)
        n = self._len
        b = self.batch_size
        if k_new.shape[0] != self.batch_size:
            self.shared = True
            b = 1
        kt = np.ascontiguousarray(k_new.transpose(0, 2, 1, 3), np.float32)
        vt = np.ascontiguousarray(v_new.transpose(0, 2, 1, 3), np.float32)
        try:
            # (quantize_kv's 4-bit form without its argument handling)
            kq = _quantize_container(kt, 3, 4, self.group_size, self.rotate, False)
            vq = _quantize_container(vt, 3, 4, self.group_size, self.rotate, False)
        except ValueError as e:
            raise ValueError(f"4-bit KV cache: the projected keys / values of the new tokens "
                             f"cannot be quantized ({e}); the cache is unchanged") from None
        for dst, src in ((self._kc, kq.codes), (self._kss, kq.scales), (self._kso, kq.offsets),
                         (self._vc, vq.codes), (self._vss, vq.scales), (self._vso, vq.offsets)):
            dst[:b, :, n:n + T] = src
        W = self._fk.shape[2]
        if self.mode != "cross" and W:
            t0 = max(n, n + T - W)
            s = self._slot(t0, n + T)
            self._fk[:b, :, s] = kt[:, :, t0 - n:]
            self._fv[:b, :, s] = vt[:, :, t0 - n:]
        self._len = n + T
        self._f0 = max(self._f0, self._len - W)

    def bind_memory(self, k_mem, v_mem, source, key_mask) -> None:
        # (a memory is quantized whole: no float window)
        self.mode = "cross"
        KVCache.bind_memory(self, k_mem, v_mem, source, key_mask)
        self._f0 = self._len

    def quantized_view(self, length: int) -> tuple:
        """(keys, values) of tokens [0, length) as :class:`QuantizedKV`
        views (B, Hkv, length, ...) of the 4-bit store."""
        b = 1 if self.shared else self.batch_size

        def kv(c, s, o):
            return QuantizedKV(c[:b, :, :length], s[:b, :, :length], o[:b, :, :length], 4,
                               self.group_size, self.rotate)
        return (kv(self._kc, self._kss, self._kso), kv(self._vc, self._vss, self._vso))

    def view(self, length: int) -> tuple:
        """The first ``length`` keys and values as :class:`QuantizedKV`
        views of the 4-bit store (every token, the window's included)."""
        if isinstance(length, (bool, np.bool_)) or not isinstance(length, numbers.Integral):
            raise TypeError(f"length must be an int, got {type(length).__name__} {length!r}")
        if not 0 <= length <= self._len:
            raise ValueError(f"length must be from 0 to the {self._len} tokens held, got "
                             f"{length}")
        return self.quantized_view(int(length))

    def _held(self, which: int) -> np.ndarray:
        """Keys (0) / values (1) held: the window's tokens in float, the
        older ones dequantized (a new array)."""
        n, f0 = self._len, self._f0
        a = self.quantized_view(n)[which].dequantize()
        if n > f0:
            b = a.shape[0]
            a[:, :, f0:n] = (self._fk, self._fv)[which][:b, :, self._slot(f0, n)]
        if self.shared:
            a = np.broadcast_to(a, (self.batch_size,) + a.shape[1:])
        a.flags.writeable = False
        return a

    @staticmethod
    def attend(q, parts, mask, is_causal, **kw):
        """Attention of queries ``q`` over a call's ``parts`` (:meth:`parts`:
        the 4-bit tokens, which precede every query of the call, so no
        causal mask; the float ones under the call's ``is_causal``), merged
        by log-sum-exp; ``mask``'s columns (the keys) are cut as the parts,
        or broadcast.  ``kw``: the rest of
        :func:`attncore.scaled_dot_product_attention`'s arguments."""
        from .functional import merge_attention, scaled_dot_product_attention

        quant, (fk, fv) = parts
        if quant is None:
            return scaled_dot_product_attention(q, fk, fv, mask, is_causal=is_causal, **kw)
        f0 = quant[0].shape[-2]
        m0 = m1 = mask
        if mask is not None and mask.shape[-1] != 1:
            m0, m1 = mask[..., :f0], mask[..., f0:]
        o0, l0 = scaled_dot_product_attention(q, quant[0], quant[1], m0, return_lse=True, **kw)
        o1, l1 = scaled_dot_product_attention(q, fk, fv, m1, is_causal=is_causal,
                                              return_lse=True, **kw)
        if mask is not None:
            return merge_attention([o0, o1], [l0, l1])[0]
        # (no mask: every query attends its own key in the float part, a
        # finite lse there, so the weights are plain exponentials)
        m = np.maximum(l0, l1)
        w0, w1 = np.exp(l0 - m)[..., None], np.exp(l1 - m)[..., None]
        return (o0 * w0 + o1 * w1) / (w0 + w1)

    def parts(self, k_new: np.ndarray | None, v_new: np.ndarray | None) -> tuple:
        """Before appending a call's new tokens ``k_new`` / ``v_new`` (B,
        T, Hkv, hd; None for a cross-attention memory already held): the
        4-bit part (QuantizedKV keys, values over tokens [0, f0), or None)
        and the float part ((B, Hkv, P + T, hd) keys and values: the
        window's P tokens, then the new ones; None where empty)."""
        n, f0 = self._len, self._f0
        quant = self.quantized_view(f0) if f0 > 0 else None
        if k_new is None or v_new is None:
            return quant, None
        s = self._slot(f0, n)
        b = 1 if self.shared else self.batch_size
        fk = np.concatenate([self._fk[:b, :, s], k_new.transpose(0, 2, 1, 3)], axis=2)
        fv = np.concatenate([self._fv[:b, :, s], v_new.transpose(0, 2, 1, 3)], axis=2)
        return quant, (fk, fv)
