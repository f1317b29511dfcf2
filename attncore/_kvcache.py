"""The preallocated key/value cache of :class:`attncore.MultiHeadAttention`
(:class:`KVCache`: float or int8 storage), and the layer / cache dtype
rules it shares with the layer."""
from __future__ import annotations

import numbers
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from ._dtypes import bfloat16_dtype, half_code, is_bf16, storage_name
from ._quant import dequantize, quantize_new
from ._validation import parse_bool, parse_float_dtype, parse_positive_int, to_array

__all__ = ["KVCache"]


def _layer_dtype(dtype) -> np.dtype:
    """A layer's / cache's dtype: float32, float64, float16 or bfloat16
    (``"bfloat16"``, ``ml_dtypes.bfloat16`` or ``torch.bfloat16``; needs
    ml_dtypes); None: float32, the default."""
    name = storage_name(dtype)
    if name == "bfloat16":
        return bfloat16_dtype("a bfloat16 layer")
    try:
        return parse_float_dtype(name or dtype, "dtype", (2, 4, 8))
    except TypeError:
        raise TypeError(f"dtype must be float32, float64, float16 or bfloat16, got "
                        f"{dtype!r}") from None


def _compute_dtype(dt: np.dtype) -> np.dtype:
    """The dtype a layer of storage dtype ``dt`` computes in: float32 for
    the 16-bit dtypes (their weights and caches are read in place)."""
    return np.dtype(np.float32) if half_code(dt) else dt


class KVCache:
    """Preallocated key/value cache of one :class:`MultiHeadAttention` layer.

    Made by :meth:`MultiHeadAttention.new_cache`.  Keys and values are kept
    already projected, per key/value head, in two buffers of shape
    (batch_size, num_kv_heads, max_length, head_dim) allocated once.

    **Capacity is fixed**: nothing is reallocated while decoding; appending
    past ``max_length`` tokens raises a ``ValueError`` that says how many
    tokens the cache holds.  Make a larger cache (or :meth:`reset`) instead.

    A cache is in one of three states, set by the first call that uses it:

    * empty (``mode is None``);
    * ``"self"``: ``mha(x_t, cache=cache)`` (no key/value, or
      ``key is query``) projects the new tokens, appends their keys and
      values, and attends over everything cached so far;
    * ``"cross"``: ``mha(y, memory, cache=cache)`` on an empty cache projects
      the memory's keys and values once; later calls pass ``key=None`` (or
      the same ``memory`` object) and reuse them, so cross-attention to a
      fixed memory costs only the query and output projections per step.
      A memory shared by the batch (a 2-D key) is stored once, in row 0.

    :meth:`reorder` selects batch rows (beam search) and :meth:`crop` drops
    trailing tokens (speculative decoding), in place.

    Attributes
    ----------
    batch_size, max_length, num_kv_heads, head_dim, v_head_dim, dtype
    mode : None, 'self' or 'cross'
    shared : bool
        True for a cross-attention memory shared by the whole batch.
    """

    __slots__ = ("batch_size", "max_length", "num_kv_heads", "head_dim", "v_head_dim",
                 "dtype", "mode", "quantized", "_k", "_v", "_ks", "_vs", "_len", "_source",
                 "_key_mask", "shared")
    mode: str | None
    _source: object
    _key_mask: np.ndarray | None

    def __init__(self, batch_size: int, max_length: int, num_kv_heads: int, head_dim: int,
                 v_head_dim: int, dtype: DTypeLike = np.float32, quantized: bool = False) -> None:
        self._set_sizes(batch_size, max_length, num_kv_heads, head_dim, v_head_dim, dtype)
        self.quantized = parse_bool(quantized, "quantized")
        shape = (self.batch_size, self.num_kv_heads, self.max_length)
        store = np.int8 if self.quantized else self.dtype
        self._k = np.zeros(shape + (self.head_dim,), dtype=store)
        self._v = np.zeros(shape + (self.v_head_dim,), dtype=store)
        # int8 storage: one float32 scale per token and head
        self._ks = np.zeros(shape if self.quantized else (0, 0, 0), np.float32)
        self._vs = np.zeros(shape if self.quantized else (0, 0, 0), np.float32)
        KVCache.reset(self)

    def _set_sizes(self, batch_size, max_length, num_kv_heads, head_dim, v_head_dim,
                   dtype) -> None:
        """The sizes and dtype, checked (every cache variant's)."""
        self.batch_size = parse_positive_int(batch_size, "batch_size")
        self.max_length = parse_positive_int(max_length, "max_length")
        self.num_kv_heads = parse_positive_int(num_kv_heads, "num_kv_heads")
        self.head_dim = parse_positive_int(head_dim, "head_dim")
        self.v_head_dim = parse_positive_int(v_head_dim, "v_head_dim")
        self.dtype = _layer_dtype(dtype)

    def __len__(self) -> int:
        """Number of tokens (positions) held."""
        return self._len

    def __repr__(self) -> str:
        return (f"KVCache(batch_size={self.batch_size}, length={self._len}, "
                f"max_length={self.max_length}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, mode={self.mode!r}, dtype={self.dtype}"
                + (", storage=int8)" if self.quantized else ")"))

    @property
    def nbytes(self) -> int:
        """Bytes of the cache's buffers (keys, values and int8 scales)."""
        n = self._k.nbytes + self._v.nbytes
        if self.quantized:
            n += self._ks.nbytes + self._vs.nbytes
        return n

    def reset(self) -> None:
        """Forget every token (keeps the buffers; no reallocation)."""
        self._len = 0
        self.mode = None
        self._source = None
        self._key_mask = None
        self.shared = False

    def _token_arrays(self) -> list:
        """The stored per-token buffers: every array attribute laid out
        (batch_size, num_kv_heads, max_length, ...) -- keys, values, and
        the scales or any other per-token storage of a cache variant."""
        want = (self.batch_size, self.num_kv_heads, self.max_length)
        seen, out = set(), []
        for cls in type(self).__mro__:
            for name in getattr(cls, "__slots__", ()):
                a = getattr(self, name, None)
                if isinstance(a, np.ndarray) and a.shape[:3] == want and id(a) not in seen:
                    seen.add(id(a))
                    out.append(a)
        return out

    def reorder(self, indices: ArrayLike) -> None:
        """Select batch rows in place: row ``i`` becomes old row ``indices[i]``
        (beam search: the beams that survive a step, some repeated).

        Parameters
        ----------
        indices : int array_like, (batch_size,)
            Values in ``[0, batch_size)``.  Applies to every stored array
            (keys, values, int8 scales) and to the key mask stored with a
            cross-attention memory; a memory shared by the batch is left as
            it is.  The capacity is unchanged (nothing is reallocated).
        """
        idx = to_array(indices, "indices")
        if idx.dtype.kind not in "iu":
            raise TypeError(f"indices must be an integer array (batch rows), got dtype "
                            f"{idx.dtype}")
        B = self.batch_size
        if idx.shape != (B,):
            raise ValueError(f"indices must have shape (batch_size,) = ({B},), got shape "
                             f"{idx.shape}")
        if B and (idx.min() < 0 or idx.max() >= B):
            raise ValueError(f"indices must lie in [0, batch_size) = [0, {B}), got values from "
                             f"{idx.min()} to {idx.max()}")
        idx = idx.astype(np.intp, copy=False)
        n = self._len
        if n == 0 or (idx == np.arange(B)).all():
            return
        if self._key_mask is not None and self._key_mask.shape[0] == B:
            self._key_mask = self._key_mask[idx]
        if self.shared:
            return
        for a in self._token_arrays():
            a[:, :, :n] = a[idx, :, :n]           # the gather is a copy: no aliasing

    def crop(self, length: int) -> None:
        """Keep the first ``length`` tokens, drop the rest (speculative
        decoding: reject draft tokens).  ``crop(0)`` empties the cache like
        :meth:`reset`.  Only for self-attention caches; the buffers are kept.

        Parameters
        ----------
        length : int
            ``0 <= length <= len(cache)``.
        """
        if isinstance(length, (bool, np.bool_)) or not isinstance(length, numbers.Integral):
            raise TypeError(f"length must be an int, got {type(length).__name__} {length!r}")
        length = int(length)
        n = self._len
        if not 0 <= length <= n:
            raise ValueError(f"crop length must be between 0 and the cached length {n}, got "
                             f"{length}")
        if length == n:
            return
        if self.mode == "cross":
            raise ValueError("crop drops trailing tokens of a self-attention cache; this cache "
                             "holds a cross-attention memory (reset() it for a new memory)")
        if length == 0:
            self.reset()
        else:
            self._len = length

    @property
    def keys(self) -> np.ndarray:
        """Projected keys held, a read-only view (batch, num_kv_heads, len, head_dim);
        for an int8 cache their dequantized values (a new array)."""
        return self._held(0)

    @property
    def values(self) -> np.ndarray:
        """Projected values held, a read-only view (batch, num_kv_heads, len, v_head_dim);
        for an int8 cache their dequantized values (a new array)."""
        return self._held(1)

    def _held(self, which: int) -> np.ndarray:
        a = self.view(self._len)[which]
        if self.quantized:
            a = dequantize(a[0], a[1], _compute_dtype(self.dtype))
        if self.shared:  # one row for the whole batch
            a = np.broadcast_to(a, (self.batch_size,) + a.shape[1:])
        else:
            a = a.view()
        a.flags.writeable = False
        return a

    def _check_room(self, T: int) -> None:
        n = self._len
        if n + T > self.max_length:
            raise ValueError(
                f"KV cache overflow: it holds {n} of max_length={self.max_length} tokens and "
                f"cannot take {T} more; make a larger cache with "
                f"new_cache(batch_size, max_length>={n + T}) or reset() it")

    def _check_new(self, k_new: Any, v_new: Any, shared_ok: bool,
                   names: tuple[str, str] = ("k_new", "v_new")) -> None:
        """TypeError / ValueError unless k_new, v_new are float arrays of
        shapes (B, T, Hkv, hd), (B, T, Hkv, hdv) with B the batch size (or
        1 where ``shared_ok``: a memory shared by the batch)."""
        for name, a, hd in ((names[0], k_new, self.head_dim), (names[1], v_new, self.v_head_dim)):
            if not isinstance(a, np.ndarray):
                raise TypeError(f"{name} must be a NumPy array, got {type(a).__name__}")
            if a.dtype.kind != "f" and not is_bf16(a.dtype):
                raise TypeError(f"{name} must be a float array, got dtype {a.dtype}")
            if a.ndim != 4 or a.shape[2:] != (self.num_kv_heads, hd):
                raise ValueError(f"{name} must have shape (B, T, {self.num_kv_heads}, {hd}) "
                                 f"(num_kv_heads, head dim), got shape {a.shape}")
        if k_new.shape[:2] != v_new.shape[:2]:
            raise ValueError(f"{names[0]} and {names[1]} must have the same (B, T), got shapes "
                             f"{k_new.shape} and {v_new.shape}")
        B = k_new.shape[0]
        if B != self.batch_size and not (shared_ok and B == 1):
            raise ValueError(f"{names[0]}'s batch must be batch_size={self.batch_size}"
                             + (" (or 1: a memory shared by the batch)" if shared_ok else "")
                             + f", got {B}")

    def _append(self, k_new: np.ndarray, v_new: np.ndarray) -> None:
        """k_new (B, T, Hkv, hd), v_new (B, T, Hkv, hdv), any strides; a
        batch of 1 for a shared memory (stored in row 0)."""
        T = k_new.shape[1]
        self._check_room(T)
        n = self._len
        if k_new.shape[0] != self.batch_size:
            self.shared = True
            k, v, ks, vs = self._k[:1], self._v[:1], self._ks[:1], self._vs[:1]
        else:
            k, v, ks, vs = self._k, self._v, self._ks, self._vs
        if self.quantized:
            # only the new tokens are quantized (one scale per token and head)
            try:
                kq, kqs = quantize_new(k_new.transpose(0, 2, 1, 3))
                vq, vqs = quantize_new(v_new.transpose(0, 2, 1, 3))
            except ValueError:
                raise ValueError(
                    "int8 KV cache: the projected keys / values of the new tokens hold inf or "
                    "NaN, which cannot be quantized (a float cache would carry them); the cache "
                    "is unchanged") from None
            k[:, :, n:n + T] = kq
            v[:, :, n:n + T] = vq
            ks[:, :, n:n + T] = kqs
            vs[:, :, n:n + T] = vqs
        else:
            k[:, :, n:n + T] = k_new.transpose(0, 2, 1, 3)
            v[:, :, n:n + T] = v_new.transpose(0, 2, 1, 3)
        self._len = n + T

    def append_self(self, k_new: np.ndarray, v_new: np.ndarray) -> None:
        """Append projected self-attention keys / values, (B, T, Hkv, hd) and
        (B, T, Hkv, hdv), and mark the cache ``"self"``."""
        self._check_new(k_new, v_new, False)
        self._append(k_new, v_new)
        self.mode = "self"

    def bind_memory(self, k_mem: np.ndarray, v_mem: np.ndarray, source: object,
                    key_mask: np.ndarray | None) -> None:
        """Store a cross-attention memory's projected keys / values (layout as
        in :meth:`append_self`), the memory object they came from and its
        (B, 1, 1, S) key mask (or None); marks the cache ``"cross"``.  A
        batch of 1 is a memory shared by the whole batch."""
        self._check_new(k_mem, v_mem, True, ("k_mem", "v_mem"))
        self._append(k_mem, v_mem)
        self.mode = "cross"
        self._source = source
        self._key_mask = key_mask

    @property
    def source(self) -> object:
        """The memory a ``"cross"`` cache was filled from (else None)."""
        return self._source

    @property
    def key_mask(self) -> np.ndarray | None:
        """The key mask stored with a cross-attention memory, (B, 1, 1, S) bool, or None."""
        return self._key_mask

    def view(self, length: int) -> tuple:
        """The first ``length`` keys and values as (B, Hkv, length, hd) views
        (writable: the layer's own access); for an int8 cache the
        ``(int8 view, scales view)`` pairs the attention kernel reads.  A
        shared memory: batch 1 (broadcast by the kernel)."""
        if isinstance(length, (bool, np.bool_)) or not isinstance(length, numbers.Integral):
            raise TypeError(f"length must be an int, got {type(length).__name__} {length!r}")
        if not 0 <= length <= self._len:
            raise ValueError(f"length must be from 0 to the {self._len} tokens held, got "
                             f"{length}")
        length = int(length)
        b = 1 if self.shared else self.batch_size
        if self.quantized:
            return ((self._k[:b, :, :length], self._ks[:b, :, :length]),
                    (self._v[:b, :, :length], self._vs[:b, :, :length]))
        return self._k[:b, :, :length], self._v[:b, :, :length]
