"""The block pool of a paged key / value cache: :class:`PagedKVCache`
(private module; exported as ``attncore.PagedKVCache``)."""
from __future__ import annotations

import numbers
from collections.abc import Mapping, MappingView
from collections.abc import Set as AbstractSet
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
from numpy.typing import ArrayLike

from ._dtypes import bfloat16_dtype, storage_name
from ._interop import _to_numpy
from ._kv4 import (DEFAULT_CACHE_GROUP, DEFAULT_GROUP, QuantizedKV, check_format, kernel_slots,
                   rotation_blocks)
from ._quant import _quantize_container, quantize_new
from ._validation import parse_bool
from ._validation import INT32_MAX, as_float_array, check_offsets

__all__ = ["PagedKVCache"]

_DTYPES = ("float32", "float64", "float16", "bfloat16", "int8", "int4")


def _count(x: Any, name: str, low: int = 1) -> int:
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(x).__name__} {x!r}")
    if int(x) < low:
        raise ValueError(f"{name} must be >= {low}, got {int(x)}")
    if int(x) > INT32_MAX:
        raise ValueError(f"{name} must be below 2**31, got {int(x)}")
    return int(x)


def _seq_id(x: Any, name: str = "seq_id") -> int:
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(x).__name__} {x!r}")
    return int(x)


def _one_id(x: Any) -> bool:
    """Whether ``seq_ids`` is one id (an integer or a 0-d array), not a
    collection of them."""
    return isinstance(x, numbers.Integral) or (isinstance(x, np.ndarray) and x.ndim == 0)


class PagedKVCache:
    """A pool of fixed-size key / value blocks shared by many sequences.

    The bookkeeping of a paged KV cache, over NumPy arrays that
    :func:`attncore.paged_attention` reads in place: every sequence owns a
    list of blocks (its block table row), new tokens are written into their
    slots with one vectorized assignment, and blocks are allocated as
    sequences grow and returned when they are freed or cropped.
    :meth:`fork` lets a sequence share another's blocks (reference counted);
    a shared block that is not full is copied when either sequence writes
    into it (copy on write).

    Parameters
    ----------
    num_blocks : int
        Blocks in the pool.
    block_size : int
        Tokens per block.
    num_kv_heads : int
        Key / value heads (``Hk``).
    head_dim : int
        Key head size (``D``).
    v_head_dim : int, optional (keyword-only)
        Value head size (``Dv``), ``head_dim`` by default (the name of
        :class:`attncore.MultiHeadAttention`'s and ``KVCache``'s).
    dtype : {'float32', 'float64', 'float16', 'bfloat16', 'int8', 'int4'}, default 'float32' (keyword-only)
        Storage (None: float32).  ``"bfloat16"`` needs ml_dtypes.  ``"int8"``
        quantizes each token and head on the way in (:func:`attncore.quantize_kv`: one
        float32 scale per row); the blocks are then ``(int8 array, scales)``
        pairs.  ``"int4"`` quantizes each token and head in groups along
        the head dimension (``quantize_kv(x, bits=4, group_size=...,
        rotate=...)``: two codes per byte, a float16 scale and offset per
        group, 5 - 6 bits per value); the blocks are then
        :class:`attncore.QuantizedKV` containers of the pools, which
        :func:`attncore.paged_attention` reads in place (float32 queries:
        the codes unpacked in registers).  No float window of recent
        tokens (``MultiHeadAttention.new_cache(dtype="int4")`` has one).
    group_size : int, optional (keyword-only)
        ``"int4"`` only: elements per scale and offset, an even divisor of
        both head sizes (default 16 where it divides them, else 32).
    rotate : bool, optional (keyword-only)
        ``"int4"`` only: rotate each row by the normalized Hadamard
        transform before quantizing (default True; the queries are rotated
        inside :func:`attncore.paged_attention` and the output rotated
        back).  Needs head sizes that are powers of two or multiples of 32.

    Attributes
    ----------
    k_blocks, v_blocks : ndarray, (ndarray, ndarray) or QuantizedKV
        The pools, shape (num_blocks, block_size, num_kv_heads, D / Dv)
        (int8: with scales of shape (num_blocks, block_size,
        num_kv_heads); int4: a QuantizedKV over the pools, codes (...,
        D / 2)): the ``k_cache`` / ``v_cache`` of
        :func:`attncore.paged_attention`.  Slots no sequence has written
        hold zeros.
    group_size, rotate : int, bool or None
        The int4 format (None for the other dtypes).

    Notes
    -----
    Not thread-safe: one thread appends, forks and frees at a time.
    Operations that fail (an exhausted pool, bad arguments) raise before
    anything is written or allocated, and leave the cache as it was.

    The pools are allocated zeroed, and the operating system maps each
    page on its first write: an ``append`` into blocks never written before
    (the first appends into a fresh pool) is slower than one into blocks
    written before.  Measured (float32, 8 heads of 128, blocks of 32,
    Intel Xeon, 2 vCPUs, shared): a 512-token prompt 1.7 ms against 0.6 -
    0.8 ms (2.2 - 2.7x); one new token for each of 32 sequences 1.2 - 5.7 ms
    against 0.26 - 0.38 ms (4.5x or more).  The cache does not pre-fault
    its pools at construction: that would cost as much up front (0.5 -
    0.65 ms per MiB of pool: 250 - 340 ms for two pools of 256 MiB, against
    0.1 ms) and hold the whole pool's memory from the start.  A server that
    wants even step times from its first step writes its pools once after
    construction (``cache.k_blocks[...] = 0`` for a float cache).

    Examples
    --------
    >>> import numpy as np, attncore
    >>> cache = attncore.PagedKVCache(num_blocks=64, block_size=16, num_kv_heads=2, head_dim=8)
    >>> rng = np.random.default_rng(0)
    >>> k = rng.standard_normal((21, 2, 8), dtype=np.float32)
    >>> cache.append([7, 9], k, k, cu_seqlens=[0, 1, 21])   # seq 7: 1 token, seq 9: 20
    >>> cache.seq_lens([7, 9])
    array([ 1, 20], dtype=int32)
    >>> q = rng.standard_normal((2, 2, 8), dtype=np.float32)  # one new query each
    >>> out = attncore.paged_attention(q, cache.k_blocks, cache.v_blocks,
    ...                                block_table=cache.block_table([7, 9]),
    ...                                seq_lens=cache.seq_lens([7, 9]))
    >>> cache.fork(9, 10); cache.free(7); cache.num_free_blocks
    62
    """

    def __init__(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 *, v_head_dim: Optional[int] = None, dtype: Any = "float32",
                 group_size: Optional[int] = None, rotate: Optional[bool] = None) -> None:
        nb = _count(num_blocks, "num_blocks")
        bs = _count(block_size, "block_size")
        hk = _count(num_kv_heads, "num_kv_heads")
        d = _count(head_dim, "head_dim")
        dv = d if v_head_dim is None else _count(v_head_dim, "v_head_dim")
        name = storage_name(dtype) or repr(dtype)
        if name not in _DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(repr(x) for x in _DTYPES)}, got "
                             f"{dtype!r}")
        self.num_blocks, self.block_size, self.num_kv_heads = nb, bs, hk
        self.head_dim, self.v_head_dim, self.dtype = d, dv, name
        self.group_size, self.rotate = self._format(group_size, rotate)
        if self.group_size is not None:   # int4
            # codes two per byte; per group a float32 slot holding the float16
            # (scale, offset) pair, as the kernels read them in place
            g = self.group_size
            self._k = np.zeros((nb, bs, hk, d // 2), np.uint8)
            self._v = np.zeros((nb, bs, hk, dv // 2), np.uint8)
            self._ks = np.zeros((nb, bs, hk, d // g), np.float32)
            self._vs = np.zeros((nb, bs, hk, dv // g), np.float32)
        elif name == "int8":
            self._k = np.zeros((nb, bs, hk, d), np.int8)
            self._v = np.zeros((nb, bs, hk, dv), np.int8)
            self._ks = np.zeros((nb, bs, hk), np.float32)
            self._vs = np.zeros((nb, bs, hk), np.float32)
        else:
            dt = bfloat16_dtype() if name == "bfloat16" else np.dtype(name)
            self._k = np.zeros((nb, bs, hk, d), dt)
            self._v = np.zeros((nb, bs, hk, dv), dt)
        self._refs = np.zeros(nb, np.int32)
        self._free: List[int] = list(range(nb - 1, -1, -1))   # pop() takes the lowest id
        self._tables: Dict[int, List[int]] = {}
        self._lens: Dict[int, int] = {}

    def _format(self, group_size: Any, rotate: Any) -> Tuple[Optional[int], Optional[bool]]:
        """(group_size, rotate) of an int4 cache (None, None for the others):
        groups of 16 where they divide both head sizes, else 32 (else the
        caller gives one), rows rotated by default."""
        if self.dtype != "int4":
            if group_size is not None or rotate is not None:
                raise ValueError(f"group_size and rotate are for dtype='int4' caches, got "
                                 f"dtype={self.dtype!r} with group_size={group_size!r}, "
                                 f"rotate={rotate!r}")
            return None, None
        rot = True if rotate is None else parse_bool(rotate, "rotate")
        d, dv = self.head_dim, self.v_head_dim
        g = group_size
        if g is None:
            g = next((c for c in (DEFAULT_CACHE_GROUP, DEFAULT_GROUP)
                      if d % c == 0 and dv % c == 0), None)
            if g is None:
                raise ValueError(f"dtype='int4' needs a group_size dividing both head_dim "
                                 f"({d}) and v_head_dim ({dv}) into even groups; none of "
                                 f"{DEFAULT_CACHE_GROUP} / {DEFAULT_GROUP} does: give one")
        for n in (d, dv):
            check_format(4, g, rot, False, n, 3, 4)
        if rot:
            for n in (d, dv):
                rotation_blocks(n)   # (ValueError naming D where no rotation fits)
        return int(g), rot

    # -- the pools -------------------------------------------------------
    def _container(self, codes: np.ndarray, slots: np.ndarray) -> QuantizedKV:
        """A 4-bit pool as a QuantizedKV: its float16 scales and offsets are
        views of the slots (read by the kernels in place)."""
        so = slots.view(np.float16)
        return QuantizedKV(codes, so[..., 0::2], so[..., 1::2], 4, int(self.group_size or 0),
                           bool(self.rotate))

    @property
    def k_blocks(self) -> Union[np.ndarray, Tuple[np.ndarray, np.ndarray], QuantizedKV]:
        if self.dtype == "int4":
            return self._container(self._k, self._ks)
        return (self._k, self._ks) if self.dtype == "int8" else self._k

    @property
    def v_blocks(self) -> Union[np.ndarray, Tuple[np.ndarray, np.ndarray], QuantizedKV]:
        if self.dtype == "int4":
            return self._container(self._v, self._vs)
        return (self._v, self._vs) if self.dtype == "int8" else self._v

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds."""
        return len(self._free)

    @property
    def sequences(self) -> List[int]:
        """The ids of the sequences in the cache."""
        return list(self._tables)

    def __repr__(self) -> str:
        return (f"PagedKVCache(num_blocks={self.num_blocks}, block_size={self.block_size}, "
                f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"v_head_dim={self.v_head_dim}, dtype={self.dtype!r}"
                + (f", group_size={self.group_size}, rotate={self.rotate}"
                   if self.dtype == "int4" else "")
                + f"; {len(self._tables)} sequences, "
                f"{self.num_free_blocks} free blocks)")

    # -- queries ---------------------------------------------------------
    def _known(self, seq_id: Any, name: str = "seq_id") -> int:
        s = _seq_id(seq_id, name)
        if s not in self._tables:
            raise ValueError(f"{name} {s} is not in the cache")
        return s

    def _ids(self, seq_ids: Any, known: bool = True) -> List[int]:
        if _one_id(seq_ids):
            given = [seq_ids.item() if isinstance(seq_ids, np.ndarray) else seq_ids]
        elif isinstance(seq_ids, (AbstractSet, Mapping, MappingView)):
            # their order is not the caller's: rows / token ranges would go
            # to sequences in an order nobody chose
            raise TypeError(f"seq_ids must be an int or an ordered sequence of ints (a list, "
                            f"tuple or array), got {type(seq_ids).__name__}, whose order "
                            f"is not defined")
        else:
            try:
                given = list(seq_ids)
            except TypeError:
                raise TypeError(f"seq_ids must be an int or a sequence of ints, got "
                                f"{type(seq_ids).__name__}") from None
        ids = [self._known(s, "seq_ids entry") if known else _seq_id(s, "seq_ids entry")
               for s in given]
        if len(set(ids)) != len(ids):
            raise ValueError(f"seq_ids must not repeat a sequence, got {ids}")
        return ids

    def seq_lens(self, seq_ids: Sequence[int]) -> np.ndarray:
        """Tokens of each sequence, (len(seq_ids),) int32."""
        return np.array([self._lens[s] for s in self._ids(seq_ids)], dtype=np.int32)

    def block_table(self, seq_ids: Sequence[int]) -> np.ndarray:
        """The sequences' blocks in order, (len(seq_ids), max_blocks) int32
        (max_blocks: the longest list among them, at least 1); entries
        beyond a sequence's blocks are 0 (never read)."""
        rows = [self._tables[s] for s in self._ids(seq_ids)]
        out = np.zeros((len(rows), max([1] + [len(r) for r in rows])), dtype=np.int32)
        for i, r in enumerate(rows):
            out[i, :len(r)] = r
        return out

    # -- writing ---------------------------------------------------------
    def _rows(self, x: Any, name: str, width: int) -> Any:
        a = as_float_array(_to_numpy(x, name, True)[0], name, allow_bf16=True)
        if a.ndim != 3 or a.shape[1:] != (self.num_kv_heads, width):
            raise ValueError(f"{name} must have shape (total, num_kv_heads, head_dim) = "
                             f"(total, {self.num_kv_heads}, {width}), got {a.shape}")
        if self.dtype not in ("int8", "int4") and a.dtype != self._k.dtype:
            raise ValueError(f"{name} must have the cache's dtype ({self.dtype}), got "
                             f"{a.dtype}")
        return a

    def _plan_blocks(self, ids: List[int], counts: np.ndarray) -> Tuple[int, List[int]]:
        """(blocks needed, sequences whose shared partial last block is
        copied on write)."""
        need, cow = 0, []
        bs = self.block_size
        left: dict = {}   # a shared block's holders not yet moved off it by this call
        for s, n in zip(ids, counts):
            if n == 0:
                continue
            L, tab = self._lens.get(s, 0), self._tables.get(s, [])
            if L % bs:
                b = tab[-1]
                r = left.get(b, int(self._refs[b]))
                if r > 1:   # still shared: copied; the last holder writes in place
                    cow.append(s)
                    need += 1
                    left[b] = r - 1
            need += max(0, -(-(L + int(n)) // bs) - len(tab))
        return need, cow

    def append(self, seq_ids: Union[int, Sequence[int]], k: ArrayLike, v: ArrayLike,
               cu_seqlens: Optional[ArrayLike] = None) -> None:
        """Write new tokens' keys and values at the end of their sequences.

        Parameters
        ----------
        seq_ids : int or sequence of int
            The sequences (new ids start a sequence), in the order of their
            tokens in ``k`` / ``v``.  No repeats; an ordered sequence (a
            list, tuple or array), not a set or a dict's keys.
        k : array_like, shape (total, num_kv_heads, head_dim)
        v : array_like, shape (total, num_kv_heads, v_head_dim)
            The tokens, packed: sequence ``seq_ids[i]`` gets rows
            ``cu_seqlens[i]:cu_seqlens[i + 1]``.  Of the cache's dtype (any
            float dtype for an int8 / int4 cache, quantized per token and
            head).
        cu_seqlens : array_like of int, shape (len(seq_ids) + 1,), optional
            ``None``: one token per sequence of a sequence of ids; all of
            ``k``'s tokens for a single id (an int: ``append(0, k, v)``
            appends a whole prompt).

        Raises
        ------
        RuntimeError
            The pool has too few free blocks; nothing is written.
        ValueError, TypeError
            Bad ids (a set or other unordered collection: TypeError),
            shapes, dtypes or offsets; nothing is written.

        Notes
        -----
        The first write into a block of a fresh pool maps its pages: see
        the class's Notes.
        """
        ids = self._ids(seq_ids, known=False)
        ka = self._rows(k, "k", self.head_dim)
        va = self._rows(v, "v", self.v_head_dim)
        if va.shape[0] != ka.shape[0]:
            raise ValueError(f"k and v must hold the same tokens, got {ka.shape[0]} and "
                             f"{va.shape[0]}")
        cu = self._offsets(ids, _one_id(seq_ids), ka.shape[0], cu_seqlens)
        if self.dtype == "int4":
            new = (self._quantized4(ka, "k"), self._quantized4(va, "v"))
        elif self.dtype == "int8":
            new = (self._quantized(ka, "k"), self._quantized(va, "v"))
        else:
            new = (ka, va)
        counts = np.diff(cu)
        need, cow = self._plan_blocks(ids, counts)
        if need > len(self._free):
            raise RuntimeError(f"the cache's pool is exhausted: this append needs {need} free "
                               f"blocks and {len(self._free)} are free (num_blocks = "
                               f"{self.num_blocks}); nothing was written")
        self._copy_on_write(cow)
        self._grow(ids, counts)
        self._write(ids, cu, counts, new)

    def _offsets(self, ids: List[int], one: bool, total: int, cu_seqlens: Any) -> np.ndarray:
        """The checked token offsets (int64, len(ids) + 1) of an append of
        ``total`` tokens; ``one``: seq_ids was a single id."""
        if cu_seqlens is None:
            if one:
                return np.array([0, total], dtype=np.int64)
            if total != len(ids):
                raise ValueError(f"without cu_seqlens every sequence gets one token: k must "
                                 f"have len(seq_ids) = {len(ids)} rows, got {total}")
            return np.arange(len(ids) + 1, dtype=np.int64)
        cu = check_offsets(_to_numpy(cu_seqlens, "cu_seqlens")[0], "cu_seqlens", total, "k")
        if cu.shape[0] != len(ids) + 1:
            raise ValueError(f"cu_seqlens must hold len(seq_ids) + 1 = {len(ids) + 1} "
                             f"offsets, got {cu.shape[0]}")
        return cu

    @staticmethod
    def _quantized(a: np.ndarray, name: str) -> Tuple[np.ndarray, np.ndarray]:
        """An int8 cache's new rows quantized (and checked finite) before
        anything is allocated."""
        if a.size and not np.all(np.isfinite(a)):
            raise ValueError(f"{name} must be finite for an int8 cache (it is quantized per "
                             f"token and head): it holds inf or NaN")
        return quantize_new(a)

    def _quantized4(self, a: np.ndarray, name: str) -> Tuple[np.ndarray, np.ndarray]:
        """An int4 cache's new rows (total, Hk, D) as (codes, slots):
        rotated where the cache rotates, quantized in groups (ValueError for
        non-finite values or values beyond the float16 range) before
        anything is allocated."""
        if a.shape[0] == 0:
            return (np.zeros(a.shape[:2] + (a.shape[2] // 2,), np.uint8),
                    np.zeros(a.shape[:2] + (a.shape[2] // self.group_size,), np.float32))
        try:
            kv = _quantize_container(np.asarray(a, dtype=np.float32), 2, 4, self.group_size,
                                     self.rotate, False)
        except ValueError as e:
            raise ValueError(f"{name} cannot be quantized for an int4 cache ({e}); nothing "
                             f"was written") from None
        return kv.codes, kernel_slots(kv)

    def _copy_on_write(self, cow: List[int]) -> None:
        """The shared partial last block of each sequence of ``cow`` becomes
        the sequence's own copy."""
        bs = self.block_size
        for s in cow:
            old, new = self._tables[s][-1], self._free.pop()
            fill = self._lens[s] % bs
            for a in self._pools():
                a[new, :fill] = a[old, :fill]
            self._refs[old] -= 1
            self._refs[new] = 1
            self._tables[s][-1] = new

    def _grow(self, ids: List[int], counts: np.ndarray) -> None:
        """Free blocks appended to the tables of sequences that grow past
        their blocks (new sequences get their tables)."""
        bs = self.block_size
        for s, n in zip(ids, counts):
            tab = self._tables.setdefault(s, [])
            self._lens.setdefault(s, 0)
            for _ in range(-(-(self._lens[s] + int(n)) // bs) - len(tab)):
                b = self._free.pop()
                self._refs[b] = 1
                tab.append(b)

    def _write(self, ids: List[int], cu: np.ndarray, counts: np.ndarray, new: tuple) -> None:
        """Every token's (block, slot), then one assignment per pool; the
        sequences' lengths grow."""
        bs = self.block_size
        seq = np.repeat(np.arange(len(ids)), counts)
        start = np.array([self._lens[s] for s in ids], dtype=np.int64)
        pos = np.arange(int(cu[-1]), dtype=np.int64) - np.repeat(cu[:-1], counts) + start[seq]
        tab2 = np.zeros((len(ids), max([1] + [len(self._tables[s]) for s in ids])), np.int64)
        for i, s in enumerate(ids):
            tab2[i, :len(self._tables[s])] = self._tables[s]
        blk, slot = tab2[seq, pos // bs], pos % bs
        if self.dtype in ("int8", "int4"):
            k8, v8 = new
            self._k[blk, slot], self._ks[blk, slot] = k8
            self._v[blk, slot], self._vs[blk, slot] = v8
        else:
            self._k[blk, slot], self._v[blk, slot] = new
        for s, n in zip(ids, counts):
            self._lens[s] += int(n)

    def _pools(self) -> List[np.ndarray]:
        return [self._k, self._v] + ([self._ks, self._vs] if self.dtype in ("int8", "int4")
                                     else [])

    # -- sharing and releasing --------------------------------------------
    def fork(self, src: int, dst: int) -> None:
        """Start sequence ``dst`` as a continuation of ``src``: it shares
        all of ``src``'s blocks (no copy); a shared block that is not full
        is copied when either sequence appends to it."""
        s = self._known(src, "src")
        d = _seq_id(dst, "dst")
        if d in self._tables:
            raise ValueError(f"dst {d} is already in the cache (free it first)")
        self._tables[d] = list(self._tables[s])
        self._lens[d] = self._lens[s]
        for b in self._tables[d]:
            self._refs[b] += 1

    def _release(self, blocks: List[int]) -> None:
        for b in blocks:
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)

    def free(self, seq_id: int) -> None:
        """Remove a sequence; blocks no other sequence shares return to the pool."""
        s = self._known(seq_id)
        self._release(self._tables.pop(s)[::-1])
        del self._lens[s]

    def crop(self, seq_id: int, length: int) -> None:
        """Keep the first ``length`` tokens of a sequence (0 <= length <=
        its length); blocks beyond them are released."""
        s = self._known(seq_id)
        n = _count(length, "length", low=0)
        if n > self._lens[s]:
            raise ValueError(f"length ({n}) must not exceed the sequence's length "
                             f"({self._lens[s]})")
        keep = -(-n // self.block_size)
        tab = self._tables[s]
        self._release(tab[keep:][::-1])
        del tab[keep:]
        self._lens[s] = n
