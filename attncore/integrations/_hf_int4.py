"""A 4-bit key/value cache for Hugging Face transformers' ``generate``
(:class:`Int4Cache`), read in place by attncore's attention function.

Each layer keeps an :class:`attncore._kvcache4.KVCache4`: every token in
4-bit groups, the most recent ``window`` tokens also in float.  The layer's
``update`` returns, instead of the whole keys / values, two placeholder
tensors of their shape (no storage: a broadcast zero) that carry the
layer's parts (:meth:`KVCache4.parts`); attncore's attention function
(``register()``) reads the parts and attends them apart, merged by
log-sum-exp.  Any other torch operation on a placeholder raises a
TypeError saying that the cache needs ``attn_implementation="attncore"``
(another attention would otherwise compute over the placeholders).

Needs torch and transformers (imported by
:mod:`attncore.integrations.transformers`).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .._interop import torch_to_numpy
from .._kvcache4 import DEFAULT_WINDOW, KVCache4

__all__ = ["Int4Cache", "parts_of"]

_MSG = ("this key / value tensor is a placeholder of attncore.integrations.transformers."
        "Int4Cache, whose 4-bit keys and values only attncore's attention reads: load the "
        "model with attn_implementation='attncore' (after attncore.integrations.transformers."
        "register())")
# what a placeholder allows: its metadata
_META = {"shape", "dtype", "device", "size", "dim", "ndim", "layout", "requires_grad",
         "is_cuda", "__repr__", "__format__", "is_floating_point", "element_size"}


class _Placeholder(torch.Tensor):
    """A tensor of the keys' / values' shape, no data, carrying a 4-bit
    cache layer's parts (``_attncore_parts``)."""

    _attncore_parts: Any

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in _META or getattr(getattr(func, "__self__", None), "__name__", "") in _META:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        raise TypeError(_MSG)


def _placeholder(shape, dtype, parts) -> torch.Tensor:
    base = torch.zeros((), dtype=dtype).expand(*shape)
    t = torch.Tensor._make_subclass(_Placeholder, base)
    t._attncore_parts = parts
    return t


def parts_of(key: Any):
    """The parts an :class:`Int4Cache` layer gave with its keys (``quant``:
    (keys, values) QuantizedKV of the 4-bit tokens, or None; ``flt``: (keys,
    values) float32 arrays (B, Hk, P + T, D) of the window and the new
    tokens), or None for any other tensor."""
    return getattr(key, "_attncore_parts", None) if isinstance(key, _Placeholder) else None


class _Int4Layer(CacheLayerMixin):
    """One decoder layer's 4-bit cache: a :class:`KVCache4` that doubles
    its capacity as the sequence grows."""

    is_croppable = True

    def __init__(self, window: int, group_size: int | None, rotate: bool):
        super().__init__()
        self._opts = dict(window=window, group_size=group_size, rotate=rotate)
        self._store: KVCache4 | None = None
        self.cumulative_length = 0

    def lazy_initialization(self, key_states, value_states) -> None:
        B, Hk, _, D = key_states.shape
        self.device = key_states.device
        self._store = KVCache4(B, 256, Hk, D, value_states.shape[-1], np.float32, **self._opts)
        self.is_initialized = True

    def _room(self, T: int) -> KVCache4:
        s = self._store
        assert s is not None
        n = len(s)
        if n + T <= s.max_length:
            return s
        cap = max(2 * s.max_length, n + T)
        new = KVCache4(s.batch_size, cap, s.num_kv_heads, s.head_dim, s.v_head_dim, np.float32,
                       **self._opts)
        for a in ("_kc", "_kss", "_kso", "_vc", "_vss", "_vso"):
            getattr(new, a)[:, :, :n] = getattr(s, a)[:, :, :n]
        new._fk[:] = s._fk
        new._fv[:] = s._fv
        new._len, new._f0, new.mode = n, s._f0, s.mode
        self._store = new
        return new

    def update(self, key_states, value_states, *args, **kwargs):
        if key_states.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"Int4Cache: key_states must be float32, float16 or bfloat16, got "
                            f"{key_states.dtype}")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        T = key_states.shape[-2]
        st = self._room(T)
        k = torch_to_numpy(key_states.float(), "key_states")[0].transpose(0, 2, 1, 3)
        v = torch_to_numpy(value_states.float(), "value_states")[0].transpose(0, 2, 1, 3)
        parts = st.parts(k, v)
        st.append_self(k, v)
        self.cumulative_length += T
        n = len(st)
        B, Hk = key_states.shape[:2]
        return (_placeholder((B, Hk, n, key_states.shape[-1]), key_states.dtype, parts),
                _placeholder((B, Hk, n, value_states.shape[-1]), value_states.dtype, parts))

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return 0 if self._store is None else len(self._store)

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        if self._store is not None:
            self._store.reset()
        self.cumulative_length = 0

    def crop(self, max_length: int) -> None:
        if self._store is None:
            return
        n = len(self._store)
        keep = n + max_length if max_length < 0 else min(max_length, n)
        self._store.crop(max(0, keep))
        self.cumulative_length = len(self._store)

    def reorder_cache(self, beam_idx) -> None:
        if self._store is not None and len(self._store):
            self._store.reorder(np.asarray(beam_idx.cpu()))

    def offload(self):
        pass

    def prefetch(self):
        pass


class Int4Cache(Cache):
    """A 4-bit key/value cache for ``model.generate(past_key_values=...)``,
    read in place by attncore's attention (``attn_implementation=
    "attncore"`` after :func:`attncore.integrations.transformers.register`).

    Every token's keys and values are stored in 4-bit groups
    (:func:`attncore.quantize_kv` with ``bits=4``: a float16 scale and
    offset per ``group_size`` elements of a row, rows rotated when
    ``rotate``), and the ``window`` most recent tokens also in float32,
    which attention reads instead (see ``MultiHeadAttention.new_cache(...,
    dtype="int4")``).  About 6 bits per value (groups of 16) against 16 or
    32, the window aside.

    Parameters
    ----------
    config : transformers.PretrainedConfig
        The model's configuration (its number of layers; full-attention
        layers only).
    window : int, default 128
    group_size : int, optional
        Default 16 (where it divides the head dimension).
    rotate : bool, default True

    Notes
    -----
    Another attention implementation given this cache's tensors raises a
    TypeError (they are placeholders).  Beam search (``reorder_cache``)
    and ``crop`` are supported; the cache lives on the CPU.
    """

    def __init__(self, config: Any, window: int = DEFAULT_WINDOW, group_size: int | None = None,
                 rotate: bool = True) -> None:
        cfg = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
        bad = set(types) - {"full_attention"}
        if bad:
            raise ValueError(f"Int4Cache holds full-attention layers only; this model has "
                             f"{sorted(bad)} layers")
        super().__init__(layers=[_Int4Layer(window, group_size, rotate)
                                 for _ in range(cfg.num_hidden_layers)])
