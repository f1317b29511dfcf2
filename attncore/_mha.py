"""Multi-head attention layer and its key/value cache.

The layer holds its projection weights as NumPy arrays in PyTorch's Linear
layout (out_features, in_features).  A call

1. projects query / key / value with one BLAS gemm each on 2-D
   (batch * length, features) arrays -- one fused gemm for Q, K and V in
   self-attention, one for K and V when key and value are the same array;
2. hands the projected (B, L, heads * head_dim) arrays to
   :func:`attncore.scaled_dot_product_attention` as strided
   (B, heads, L, head_dim) views (no per-head copies; grouped-query heads
   through ``enable_gqa``, K/V never repeated);
3. applies the output projection with one more gemm.

Storage: when query, key and value have the same input width, the three
input projections live in one (Nq + Nk + Nv, E) buffer and ``q_weight``,
``k_weight`` and ``v_weight`` are row blocks (views) of it, so the fused
gemm needs no concatenation per call and in-place edits of the attributes
are seen by the next call.
"""
from __future__ import annotations

import math
import numbers
from typing import Any, Literal, NamedTuple

import numpy as np
from numpy.typing import ArrayLike, DTypeLike

from ._convert import keras_arrays, torch_arrays
from ._interop import weight_array
from ._dtypes import cast, half_code, is_bf16, parse_precision
from ._interop import foreign_arrays
from ._linear import head_rows, linear
from ._validation import (as_float_array, head_values, parse_bool, parse_causal,
                          parse_mask, parse_positive_int, to_array,
                          parse_window)
from ._rotary import apply_rotary, parse_rotary, rotary_positions
from ._threads import resolve_num_threads
from .functional import scaled_dot_product_attention
from ._kvcache import KVCache, _compute_dtype, _layer_dtype
from ._kvcache4 import KVCache4

__all__ = ["MultiHeadAttention", "KVCache"]


# --------------------------------------------------------------------------
# small checks
# --------------------------------------------------------------------------
def _seeded(rng: Any) -> np.random.Generator:
    """``numpy.random.default_rng(rng)`` for a seed: None or an int >= 0
    (TypeError / ValueError naming ``rng`` otherwise)."""
    if rng is not None:
        if isinstance(rng, (bool, np.bool_)) or not isinstance(rng, numbers.Integral):
            raise TypeError(f"rng must be a numpy.random.Generator, an int seed >= 0 or None, "
                            f"got {type(rng).__name__} {rng!r}")
        if rng < 0:
            raise ValueError(f"rng as a seed must be >= 0, got {rng}")
    return np.random.default_rng(rng)


def _weight(a, shape, name: str, dtype) -> np.ndarray:
    """``a`` as a float array of exactly ``shape`` (a new array, never a view of the input)."""
    arr = as_float_array(weight_array(a, name), name, allow_bf16=True)
    if arr.shape != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {arr.shape}")
    return np.array(arr, dtype=dtype, copy=True)


# --------------------------------------------------------------------------
# KV cache
# --------------------------------------------------------------------------
def _weight_arrays(*weights) -> list[np.ndarray]:
    """The projections (q, k, v, out) as non-empty 2-D float arrays."""
    names = ("q_weight", "k_weight", "v_weight", "out_weight")
    ws = [as_float_array(weight_array(w, nm), nm, allow_bf16=True) for w, nm in zip(weights, names)]
    for nm, w in zip(names, ws):
        if w.ndim != 2 or 0 in w.shape:
            raise ValueError(
                f"{nm} must be a non-empty 2-D array (out_features, in_features), got "
                f"shape {w.shape}")
    return ws


def _per_head(w: np.ndarray, name: str, heads: int, heads_name: str, hint: str = "") -> int:
    """Rows of the projection ``w`` per head, checked to divide evenly."""
    if w.shape[0] % heads:
        raise ValueError(f"{name} rows must be a multiple of {heads_name}={heads}{hint}, got "
                         f"{name} shape {w.shape}")
    return w.shape[0] // heads


def _check_width(w: np.ndarray, axis: int, name: str, product: str, heads: int, dim: int):
    """``w.shape[axis]`` checked to be ``heads * dim`` (``product`` names them)."""
    if w.shape[axis] != heads * dim:
        raise ValueError(f"{name} must have {product} = {heads} * {dim} = {heads * dim} "
                         f"{('rows', 'columns')[axis]}, got {name} shape {w.shape}")


def _head_sizes(num_heads, num_kv_heads, qw, kw, vw, ow) -> tuple[int, int, int, int]:
    """(num_heads, num_kv_heads, head_dim, v_head_dim) of the projections,
    checked against each other."""
    H = parse_positive_int(num_heads, "num_heads")
    Hkv = parse_positive_int(num_kv_heads, "num_kv_heads", True) or H
    if H % Hkv:
        raise ValueError(
            f"num_kv_heads must divide num_heads, got num_kv_heads={Hkv} and num_heads={H}")
    hd = _per_head(qw, "q_weight", H, "num_heads", " (num_heads * head_dim)")
    _check_width(kw, 0, "k_weight", "num_kv_heads * head_dim", Hkv, hd)
    hdv = _per_head(vw, "v_weight", Hkv, "num_kv_heads")
    _check_width(ow, 1, "out_weight", "num_heads * v_head_dim", H, hdv)
    return H, Hkv, hd, hdv


class _Parts(NamedTuple):
    """A call's keys and values over a 4-bit cache (``KVCache4.parts``):
    ``quant`` the (keys, values) QuantizedKV of its 4-bit tokens, or None;
    ``flt`` the (keys, values) float arrays of the window and the call's
    tokens."""
    quant: Any
    flt: Any


# --------------------------------------------------------------------------
# the layer
# --------------------------------------------------------------------------
_BIAS_NAMES = ("q_bias", "k_bias", "v_bias")


def _weight_property(attr: str, name: str, doc: str) -> property:
    """A projection weight of MultiHeadAttention: the buffer ``attr``,
    assigned in place (checked, converted to the layer's dtype)."""
    return property(lambda self: getattr(self, attr),
                    lambda self, v: self._set_weight(getattr(self, attr), name, v), doc=doc)


def _bias_property(i: int, doc: str) -> property:
    """Input projection bias ``i`` (q, k, v) of MultiHeadAttention: None
    where the projection has none."""
    return property(lambda self: (self._bq, self._bk, self._bv)[i] if self._has_b[i] else None,
                    lambda self, v: self._set_bias(i, _BIAS_NAMES[i], v), doc=doc)


class MultiHeadAttention:
    """Multi-head attention with PyTorch-layout weights, grouped-query heads
    and a key/value cache.

    ``out = concat_h(softmax(Q_h K_h^T / sqrt(head_dim) + mask) V_h) W_o^T + b_o``
    with ``Q = query W_q^T + b_q``, ``K = key W_k^T + b_k``,
    ``V = value W_v^T + b_v``.

    Parameters
    ----------
    embed_dim : int
        Width of the query (and, by default, of key and value).  Must be
        divisible by ``num_heads``; head_dim = embed_dim // num_heads.
    num_heads : int
        Number of query heads.
    kdim, vdim : int, optional
        Widths of the key and value inputs (default ``embed_dim``).
    num_kv_heads : int, optional
        Key/value heads for grouped-query (``1``: multi-query) attention;
        must divide ``num_heads``.  Default ``num_heads``.  Keys and values
        are projected once per key/value head and never repeated in memory.
    bias : bool, default True
        Whether the four projections have biases.
    out_dim : int, optional
        Width of the output (default ``embed_dim``).
    dtype : {float32, float64, float16, "bfloat16"}, default float32
        dtype of the weights, of the KV cache and of the output (None:
        float32).  float32 and float64 layers compute in their dtype
        (inputs of another float dtype are converted to it).  float16 / bfloat16 layers (bfloat16:
        ``"bfloat16"``, ``ml_dtypes.bfloat16`` or ``torch.bfloat16``) keep
        weights and cache in 16 bits -- half the memory, read in place by
        the kernels -- and compute with float32 activations, biases and
        accumulation: inputs are converted to float32, the output comes
        back in the layer's dtype.
    rng : numpy.random.Generator or int, optional
        Source (or seed) for the random initial weights: Glorot-uniform
        weights and zero biases, for demos and tests.  Real weights come
        through :meth:`from_torch`, :meth:`from_keras` or :meth:`from_arrays`.
    window : (int, int), optional
        Sliding window ``(left, right)`` applied to every call, the KV cache
        included (the ``window`` of
        :func:`attncore.scaled_dot_product_attention`: query i attends keys
        ``i + off - left .. i + off + right``, ``-1`` = unbounded on that
        side, ``off`` following the call's causal alignment).  Default None:
        every key.  Also a settable attribute.
    rotary : bool or dict, optional
        Rotary position embeddings of the projected queries and keys
        (Llama, Mistral, Qwen, GPT-NeoX, GPT-J): ``True`` for the defaults,
        or a dict with any of ``base``, ``inv_freq``, ``layout``,
        ``rotary_dim``; see :attr:`rotary`.
    num_threads : int, optional
        Default OpenMP threads of every kernel a call runs (projections,
        rotary embeddings, attention): ``None`` OpenMP's default, ``-1``
        all cores, ``k >= 1`` k.  A call's ``num_threads=`` overrides it.
    alibi_slopes : array_like, optional
        ALiBi slopes, one per query head (BLOOM, MPT), applied in the
        kernel on every call (:attr:`alibi_slopes`); any float dtype,
        bfloat16 (torch or ml_dtypes) included, within the range of the
        layer's compute dtype (float32 for float32 / 16-bit layers).
    precision : {None, 'float32', 'bfloat16', 'int8'}, optional
        The dot products' precision of the attention
        (:attr:`precision`; as in the core).  With bfloat16 weights on a
        CPU with fast AVX512_BF16 (AMD's; see :func:`attncore.show_config`)
        the projections use bfloat16 products unless
        it is ``'float32'``, and ``None`` gives the attention bfloat16
        products too (float32 where the CPU lacks them).

    Attributes
    ----------
    q_weight, k_weight, v_weight, out_weight : ndarray
        (out_features, in_features): (num_heads * head_dim, embed_dim),
        (num_kv_heads * head_dim, kdim), (num_kv_heads * v_head_dim, vdim),
        (out_dim, num_heads * v_head_dim).  Assigning an array of the same
        shape replaces the values (copied, converted to ``dtype``).
    q_bias, k_bias, v_bias, out_bias : ndarray or None
        None where the projection has no bias.
    embed_dim, kdim, vdim, num_heads, num_kv_heads, head_dim, v_head_dim,
    out_dim, dtype
        Sizes.  ``head_dim`` (query/key per head) and ``v_head_dim`` differ
        from ``embed_dim // num_heads`` only for layers loaded with other
        sizes (e.g. Keras' ``key_dim`` / ``value_dim``).
    scale : float
        ``1 / sqrt(head_dim)``.
    window : (int, int) or None
        The sliding window of every call (settable).

    Examples
    --------
    >>> mha = MultiHeadAttention(512, 8, rng=0)
    >>> x = np.random.default_rng(1).standard_normal((2, 10, 512), dtype=np.float32)
    >>> out, _ = mha(x, is_causal=True)                    # self-attention
    >>> out, w = mha(x[:, :3], x, need_weights=True)        # cross-attention, w (2, 3, 10)
    """

    # ------------------------------------------------------------ creation
    def __init__(self, embed_dim: int, num_heads: int, *, kdim: int | None = None,
                 vdim: int | None = None, num_kv_heads: int | None = None, bias: bool = True,
                 out_dim: int | None = None, dtype: DTypeLike = np.float32,
                 rng: np.random.Generator | int | None = None,
                 window: tuple[int, int] | None = None, rotary: Any = None,
                 num_threads: int | None = None, alibi_slopes: ArrayLike | None = None,
                 precision: str | None = None) -> None:
        bias = parse_bool(bias, "bias")
        self.window = window
        self.num_threads = num_threads
        self.precision = precision
        embed_dim = parse_positive_int(embed_dim, "embed_dim")
        num_heads = parse_positive_int(num_heads, "num_heads")
        kdim = parse_positive_int(kdim, "kdim", True) or embed_dim
        vdim = parse_positive_int(vdim, "vdim", True) or embed_dim
        out_dim = parse_positive_int(out_dim, "out_dim", True) or embed_dim
        num_kv_heads = parse_positive_int(num_kv_heads, "num_kv_heads", True) or num_heads
        if embed_dim % num_heads:
            raise ValueError(
                f"embed_dim must be divisible by num_heads, got embed_dim={embed_dim} and "
                f"num_heads={num_heads}")
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_kv_heads must divide num_heads, got num_kv_heads={num_kv_heads} and "
                f"num_heads={num_heads}")
        dt = _layer_dtype(dtype)
        gen = rng if isinstance(rng, np.random.Generator) else _seeded(rng)
        hd = embed_dim // num_heads

        def glorot(n_out, n_in):
            lim = math.sqrt(6.0 / (n_in + n_out))
            return gen.uniform(-lim, lim, size=(n_out, n_in))

        qw = glorot(num_heads * hd, embed_dim)
        kw = glorot(num_kv_heads * hd, kdim)
        vw = glorot(num_kv_heads * hd, vdim)
        ow = glorot(out_dim, num_heads * hd)
        biases = [np.zeros(w.shape[0]) if bias else None for w in (qw, kw, vw, ow)]
        self._setup(num_heads, num_kv_heads, qw, kw, vw, ow, *biases, dtype=dt)
        self.rotary = rotary
        self.alibi_slopes = alibi_slopes
        self.precision = precision        # again: checked against the dtype

    @property
    def rotary(self) -> dict | None:
        """Rotary position embeddings of the queries and keys (None: off).

        Set with ``True`` (base 10000, ``"half"`` layout, every channel of a
        head), a dict with any of the keys ``base``, ``inv_freq``,
        ``layout``, ``rotary_dim`` (as in :func:`attncore.rotary_embedding`;
        e.g. ``{"inv_freq": LlamaRotaryEmbedding(config).inv_freq}`` for
        Llama 3 / YaRN scaling, ``{"rotary_dim": 32}`` for a partial
        rotation), ``None`` or ``False``.  Read: a dict with the four keys
        resolved (``inv_freq``: the float64 frequencies in use, read-only;
        ``base``: None when ``inv_freq`` was given).

        With rotary embeddings, a self-attention call rotates the projected
        queries and keys of its tokens at their absolute positions:
        ``positions=`` of the call, else ``arange(L)`` after the tokens a
        cache holds (decoding continues the positions).  The cache stores
        rotated keys.  Cross-attention calls are refused (positions of a
        separate memory are not defined by the layer).
        """
        r = getattr(self, "_rotary", None)
        return None if r is None else dict(r)

    @rotary.setter
    def rotary(self, value: Any) -> None:
        self._rotary = parse_rotary(value, self.head_dim)

    @property
    def alibi_slopes(self) -> np.ndarray | None:
        """ALiBi slopes of every call, one per query head (None: none);
        settable.  Applied in the kernel (see
        :func:`attncore.scaled_dot_product_attention`)."""
        return self._alibi

    @alibi_slopes.setter
    def alibi_slopes(self, value: ArrayLike | None) -> None:
        if value is None:
            self._alibi = None
            return
        # bfloat16 (torch or ml_dtypes) as the functions take it; finite and
        # within the range of the layer's compute dtype (the call checks the
        # ALiBi term against its distances too)
        a = head_values(weight_array(value, "alibi_slopes"), "alibi_slopes", self._cdt)
        if a.shape != (self.num_heads,):
            raise ValueError(f"alibi_slopes must have shape (num_heads,) = ({self.num_heads},), "
                             f"got {a.shape}")
        self._alibi = a

    @property
    def precision(self) -> str | None:
        """The dot products' precision of every call (None, 'float32',
        'bfloat16' or 'int8'; see :func:`attncore.scaled_dot_product_attention`)."""
        return self._precision

    @precision.setter
    def precision(self, value: str | None) -> None:
        prec = parse_precision(value)
        if prec is not None and getattr(self, "_cdt", None) == np.float64:
            raise ValueError(f"precision={prec!r} is for float32, float16 and bfloat16 layers; "
                             f"this layer computes in float64 (pass precision=None)")
        self._precision = prec

    @property
    def num_threads(self) -> int | None:
        """Default OpenMP threads of the layer's calls (projections, rotary
        embeddings, attention): ``None`` OpenMP's default, ``-1`` all cores,
        ``k >= 1`` k; a call's ``num_threads=`` overrides it.  Settable."""
        return getattr(self, "_num_threads", None)

    @num_threads.setter
    def num_threads(self, value: int | None) -> None:
        resolve_num_threads(value)  # validated now
        self._num_threads = value

    @property
    def window(self) -> tuple[int, int] | None:
        """Sliding window ``(left, right)`` of every call (None: all keys);
        see :func:`attncore.scaled_dot_product_attention`.  Settable."""
        return getattr(self, "_window", None)

    @window.setter
    def window(self, value: tuple[int, int] | None) -> None:
        win = parse_window(value)
        self._window = None if win == (-1, -1) else win

    def _setup(self, num_heads, num_kv_heads, qw, kw, vw, ow, qb, kb, vb, ob, *, dtype):
        """Check the shapes against each other and lay the weights out."""
        dt = _layer_dtype(dtype)
        qw, kw, vw, ow = _weight_arrays(qw, kw, vw, ow)
        H, Hkv, hd, hdv = _head_sizes(num_heads, num_kv_heads, qw, kw, vw, ow)
        self.embed_dim, self.kdim, self.vdim = qw.shape[1], kw.shape[1], vw.shape[1]
        self.num_heads, self.num_kv_heads = H, Hkv
        self.head_dim, self.v_head_dim = hd, hdv
        self.out_dim = ow.shape[0]
        self.dtype = dt
        # 16-bit layers: weights and caches stay 16-bit (read in place by
        # the kernels); activations, biases and products are float32
        self._cdt = _compute_dtype(dt)
        self.scale = 1.0 / math.sqrt(hd)
        self._projections(qw, kw, vw, dt)
        self._wo = np.array(ow, dtype=dt, copy=True)
        # biases: one buffer (zeros where a projection has none)
        Nq, Nk, Nv = qw.shape[0], kw.shape[0], vw.shape[0]
        self._b_in = np.zeros(Nq + Nk + Nv, dtype=self._cdt)
        self._bq, self._bk, self._bv = (self._b_in[:Nq], self._b_in[Nq:Nq + Nk],
                                        self._b_in[Nq + Nk:])
        self._has_b = [False, False, False]
        for i, (nm, b) in enumerate(zip(_BIAS_NAMES, (qb, kb, vb))):
            self._set_bias(i, nm, b)
        self._bo = None
        self.out_bias = ob

    def _projections(self, qw, kw, vw, dt):
        """The input projections' buffers, filled: one buffer where the
        input widths allow a fused gemm (q, k and v; else k and v)."""
        (Nq, E), (Nk, kdim), (Nv, vdim) = qw.shape, kw.shape, vw.shape
        if E == kdim == vdim:
            self._w_qkv = np.empty((Nq + Nk + Nv, E), dtype=dt)
            self._wq, self._w_kv = self._w_qkv[:Nq], self._w_qkv[Nq:]
        else:
            self._w_qkv = None
            self._wq = np.empty((Nq, E), dtype=dt)
            self._w_kv = np.empty((Nk + Nv, kdim), dtype=dt) if kdim == vdim else None
        if self._w_kv is not None:
            self._wk, self._wv = self._w_kv[:Nk], self._w_kv[Nk:]
        else:
            self._wk, self._wv = np.empty((Nk, kdim), dtype=dt), np.empty((Nv, vdim), dtype=dt)
        self._wq[...], self._wk[...], self._wv[...] = qw, kw, vw

    # ------------------------------------------------------------ attributes
    def _set_weight(self, buf, name, value):
        buf[...] = _weight(value, buf.shape, name, self.dtype)

    def _set_bias(self, i, name, value):
        buf = (self._bq, self._bk, self._bv)[i]
        if value is None:
            buf[...] = 0
            self._has_b[i] = False
        else:
            buf[...] = _weight(value, buf.shape, name, self._cdt)
            self._has_b[i] = True

    q_weight = _weight_property("_wq", "q_weight", "Query projection (num_heads * head_dim, embed_dim).")
    k_weight = _weight_property("_wk", "k_weight", "Key projection (num_kv_heads * head_dim, kdim).")
    v_weight = _weight_property("_wv", "v_weight", "Value projection (num_kv_heads * v_head_dim, vdim).")
    out_weight = _weight_property("_wo", "out_weight",
                                  "Output projection (out_dim, num_heads * v_head_dim).")
    q_bias = _bias_property(0, "Query bias (num_heads * head_dim,) or None.")
    k_bias = _bias_property(1, "Key bias (num_kv_heads * head_dim,) or None.")
    v_bias = _bias_property(2, "Value bias (num_kv_heads * v_head_dim,) or None.")

    @property
    def out_bias(self):
        """Output bias (out_dim,) or None."""
        return self._bo

    @out_bias.setter
    def out_bias(self, value):
        self._bo = None if value is None else _weight(value, (self.out_dim,), "out_bias",
                                                      self._cdt)

    def __repr__(self) -> str:
        extra = ""
        if self.kdim != self.embed_dim or self.vdim != self.embed_dim:
            extra += f", kdim={self.kdim}, vdim={self.vdim}"
        if self.num_kv_heads != self.num_heads:
            extra += f", num_kv_heads={self.num_kv_heads}"
        if self.head_dim * self.num_heads != self.embed_dim or self.v_head_dim != self.head_dim:
            extra += f", head_dim={self.head_dim}, v_head_dim={self.v_head_dim}"
        if self.out_dim != self.embed_dim:
            extra += f", out_dim={self.out_dim}"
        has_bias = any(self._has_b) or self._bo is not None
        return (f"MultiHeadAttention(embed_dim={self.embed_dim}, num_heads={self.num_heads}"
                f"{extra}, bias={has_bias}, dtype={self.dtype})")

    # ------------------------------------------------------------ loaders
    @classmethod
    def from_arrays(cls, *, q_weight: ArrayLike, k_weight: ArrayLike, v_weight: ArrayLike,
                    out_weight: ArrayLike, q_bias: ArrayLike | None = None,
                    k_bias: ArrayLike | None = None, v_bias: ArrayLike | None = None,
                    out_bias: ArrayLike | None = None, num_heads: int,
                    num_kv_heads: int | None = None, dtype: DTypeLike | None = None,
                    window: tuple[int, int] | None = None, rotary: Any = None,
                    num_threads: int | None = None, alibi_slopes: ArrayLike | None = None,
                    precision: str | None = None) -> MultiHeadAttention:
        """Layer from weight arrays in PyTorch's Linear layout.

        Parameters
        ----------
        q_weight : array_like, (num_heads * head_dim, embed_dim)
        k_weight : array_like, (num_kv_heads * head_dim, kdim)
        v_weight : array_like, (num_kv_heads * v_head_dim, vdim)
        out_weight : array_like, (out_dim, num_heads * v_head_dim)
        q_bias, k_bias, v_bias, out_bias : array_like or None
            Each optional on its own (e.g. a key projection without bias).
        num_heads : int
        num_kv_heads : int, optional
            Default ``num_heads``.
        dtype : {float32, float64, float16, "bfloat16"}, optional
            Default: ``q_weight``'s dtype if float64, float16 or bfloat16,
            else float32.
        window : (int, int), optional
            Sliding window ``(left, right)`` of every call (see the class
            parameters); default None, every key.
        rotary, num_threads, alibi_slopes, precision : optional
            As in the constructor (:attr:`rotary`, :attr:`num_threads`,
            :attr:`alibi_slopes`, :attr:`precision`).

        The arrays are copied; head sizes follow from the shapes, so
        ``head_dim`` need not be ``embed_dim // num_heads``.
        """
        if dtype is None:  # float64 and 16-bit weights keep their dtype
            wdt = weight_array(q_weight, "q_weight").dtype
            dtype = wdt if (wdt == np.float64 or half_code(wdt)) else np.float32
        self = cls.__new__(cls)
        self.window = window
        self.num_threads = num_threads
        self._setup(num_heads, num_kv_heads, q_weight, k_weight, v_weight, out_weight,
                    q_bias, k_bias, v_bias, out_bias, dtype=dtype)
        self.rotary = rotary
        self.alibi_slopes = alibi_slopes
        self.precision = precision
        return self

    @classmethod
    def from_torch(cls, state_dict_or_module: Any, num_heads: int | None = None, *,
                   dtype: DTypeLike | None = None,
                   window: tuple[int, int] | None = None) -> MultiHeadAttention:
        """Layer from a ``torch.nn.MultiheadAttention`` or its state dict.

        Parameters
        ----------
        state_dict_or_module : torch.nn.MultiheadAttention or mapping
            A module, or its ``state_dict()`` (tensors or arrays), packed
            (``in_proj_weight``) or separate (``q_proj_weight``,
            ``k_proj_weight``, ``v_proj_weight`` when kdim / vdim differ),
            with or without biases.  Keys may carry a common prefix
            (``"encoder.attn."``) as in a whole model's state dict.
        num_heads : int
            Required with a state dict; with a module it defaults to (and
            must equal) ``module.num_heads``.
        dtype : {float32, float64, float16, "bfloat16"}, optional
            Default: the tensors' dtype if float64, float16 or bfloat16,
            else float32.
        window : (int, int), optional
            As in :meth:`from_arrays` (torch's module has no such option:
            this adds one).

        Raises
        ------
        ValueError
            Missing, unexpected or misshaped tensors (each named).
        NotImplementedError
            ``add_bias_kv=True`` (``bias_k`` / ``bias_v``) or
            ``add_zero_attn=True``.

        Notes
        -----
        Converting a PyTorch call to attncore:

        * PyTorch's default is sequence-first (L, B, E); attncore is
          batch-first (B, L, E): ``x.transpose(1, 0, 2)`` unless the module
          has ``batch_first=True``.
        * ``key_padding_mask`` has the **opposite polarity**: PyTorch's
          True means *ignore this key*; attncore's ``key_mask`` True means
          *take part*.  Pass ``key_mask=~key_padding_mask``.  A float
          ``key_padding_mask`` (added to the scores) becomes
          ``attn_mask=kpm[:, None, None, :]``.
        * A bool ``attn_mask`` is inverted too (PyTorch's True = not
          allowed): pass ``attn_mask=~attn_mask``; a float one is additive
          in both.  PyTorch's 3-D (B * num_heads, L, S) mask becomes
          ``attn_mask.reshape(B, num_heads, L, S)``.
        * ``need_weights`` defaults to True in PyTorch and False here;
          dropout is not applied (inference).
        """
        return cls.from_arrays(**torch_arrays(state_dict_or_module, num_heads, dtype),
                               window=window)

    @classmethod
    def from_keras(cls, layer_or_weights: Any, config: dict | None = None, *,
                   dtype: DTypeLike | None = None, window: tuple[int, int] | None = None
                   ) -> MultiHeadAttention:
        """Layer from a Keras 3 ``keras.layers.MultiHeadAttention``.

        Parameters
        ----------
        layer_or_weights : keras.layers.MultiHeadAttention or list of arrays
            A built layer, or its ``get_weights()`` list: query kernel
            (E, H, key_dim), [query bias (H, key_dim)], key kernel
            (kdim, H, key_dim), [key bias], value kernel (vdim, H, value_dim),
            [value bias], output kernel (H, value_dim, out), [output bias
            (out,)] -- 8 arrays with biases, 4 without.
        config : dict, optional
            The layer's ``get_config()`` when passing weights; checked for
            unsupported options.
        dtype : {float32, float64}, optional
            Default: float64 if the kernels are, else float32.
        window : (int, int), optional
            As in :meth:`from_arrays`.

        Notes
        -----
        ``key_dim`` (query/key size per head), ``value_dim``,
        ``output_shape`` (an int or a 1-tuple) and ``use_bias=False`` carry
        over; the scale is ``1 / sqrt(key_dim)`` as in Keras.  Keras calls
        ``layer(query, value, key=None)``; the attncore equivalent is
        ``mha(query, key, value)``.  Keras' ``attention_mask`` (True / 1 =
        attend) is attncore's ``attn_mask`` as is, ``value_mask`` is
        ``key_mask``, ``use_causal_mask=True`` is ``is_causal=True``; Keras
        returns attention scores per head, which is
        ``need_weights=True, average_attn_weights=False``.

        Raises
        ------
        NotImplementedError
            ``attention_axes`` other than the default (attention over the
            sequence axis of (batch, length, features) inputs), a
            multi-dimensional ``output_shape``, ``use_gate=True`` or a
            ``sliding_window``.
        """
        return cls.from_arrays(**keras_arrays(layer_or_weights, config, dtype), window=window)

    # ------------------------------------------------------------ cache
    def new_cache(self, batch_size: int, max_length: int, dtype: Any = None, *,
                  window: int | None = None, group_size: int | None = None,
                  rotate: bool = True) -> KVCache:
        """An empty, preallocated :class:`KVCache` for this layer.

        Parameters
        ----------
        batch_size : int
        max_length : int
            Fixed capacity in tokens (self-attention: prompt plus generated
            tokens; cross-attention: the memory length).  Nothing is
            reallocated; exceeding it raises ValueError.
        dtype : None or "int8", optional
            None: keys and values stored in the layer's dtype.  ``"int8"``
            (or ``numpy.int8``): stored quantized, one float32 scale per
            token and head (:func:`attncore.quantize_kv`; appending
            quantizes only the new tokens); attention reads them through
            the kernel's int8 path, about a quarter of the bytes per token.
            ``"int4"``: 4-bit groups (:func:`attncore.quantize_kv` with
            ``bits=4``: a float16 scale and offset per ``group_size``
            elements, rows rotated when ``rotate``), the ``window`` most
            recent tokens also kept in float and read in float; attention
            is the 4-bit tokens' and the float tokens' (the window, then
            the call's own new tokens), merged (:func:`attncore.merge_attention`).
            Float32 layers; not with ALiBi, the layer's sliding ``window``
            or ``need_weights`` in self-attention.
        window : int, optional, keyword-only
            ``"int4"`` only: recent tokens kept in float (default 128; 0:
            none).
        group_size : int, optional, keyword-only
            ``"int4"`` only: elements per scale along the head dimension
            (default 16).  Defaults measured on SmolLM2-135M over real text
            (``bench/kv4_accuracy.py``: groups of 16, rotated, 128 recent
            tokens in float: KL from float32 1.5e-3).
        rotate : bool, keyword-only
            ``"int4"`` only: rotate rows before quantizing (default True).

        Examples
        --------
        >>> import numpy as np, attncore
        >>> mha = attncore.MultiHeadAttention(64, 4, rng=0)
        >>> T = 5
        >>> x = np.random.default_rng(0).standard_normal((1, T, 64), dtype=np.float32)
        >>> cache = mha.new_cache(batch_size=1, max_length=2048)
        >>> for t in range(T):
        ...     y_t, _ = mha(x[:, t:t + 1], cache=cache, is_causal="lower_right")
        >>> len(cache), y_t.shape
        (5, (1, 1, 64))
        """
        quantized = False
        if isinstance(dtype, str) and dtype == "int4":
            return KVCache4(batch_size, max_length, self.num_kv_heads, self.head_dim,
                            self.v_head_dim, self.dtype, window=window, group_size=group_size,
                            rotate=rotate)
        if window is not None or group_size is not None or rotate is not True:
            raise ValueError("window, group_size and rotate are options of a 4-bit cache "
                             "(dtype='int4')")
        if dtype is not None:
            ok = isinstance(dtype, str) and dtype == "int8"
            if not ok:
                try:
                    ok = not isinstance(dtype, str) and np.dtype(dtype) == np.int8
                except TypeError:
                    ok = False
            if not ok:
                raise ValueError(f"new_cache dtype must be None (the layer's dtype), 'int8' or "
                                 f"'int4', got {dtype!r}")
            quantized = True
        return KVCache(batch_size, max_length, self.num_kv_heads, self.head_dim,
                       self.v_head_dim, self.dtype, quantized=quantized)

    # ------------------------------------------------------------ call
    def _input(self, x, name, width, ndim, nthreads=1):
        a = as_float_array(x, name, "key_mask or attn_mask", allow_bf16=True)
        if a.ndim != ndim:
            if name == "query":
                raise ValueError(f"query must be (batch, length, {width}) or unbatched "
                                 f"(length, {width}), got shape {a.shape}")
            raise ValueError(f"{name} must have as many dimensions as query ({ndim}), got shape "
                             f"{a.shape}")
        if a.shape[-1] != width:
            attr = {"query": "embed_dim", "key": "kdim", "value": "vdim"}[name]
            raise ValueError(f"{name} last dimension must be {attr}={width}, got shape {a.shape}")
        if ndim == 2:
            a = a[None]
        return a if a.dtype == self._cdt else cast(a, self._cdt, nthreads)

    def _check_attn_mask(self, attn_mask, B, L, S, batched):
        am, _ = parse_mask(attn_mask, "attn_mask")
        H = self.num_heads
        if batched:
            forms = f"(L, S), (B, L, S) or (B, num_heads, L, S) = ({L}, {S}), ({B}, {L}, {S}) " \
                    f"or ({B}, {H}, {L}, {S})"
        else:
            forms = f"(L, S) or (num_heads, L, S) = ({L}, {S}) or ({H}, {L}, {S})"
        ok = am.ndim >= 2 and am.shape[-2] in (1, L) and am.shape[-1] in (1, S)
        if ok:
            if batched and am.ndim == 3:
                ok = am.shape[0] in (1, B)
                am = am[:, None]
            elif batched and am.ndim == 4:
                ok = am.shape[0] in (1, B) and am.shape[1] in (1, H)
            elif not batched and am.ndim == 3:
                ok = am.shape[0] in (1, H)
            elif am.ndim != 2:
                ok = False
        if not ok:
            raise ValueError(f"attn_mask must have shape {forms} (size-1 axes broadcast), got "
                             f"{np.shape(attn_mask)}")
        if (am.dtype.kind == "f" or half_code(am.dtype)) and am.dtype != self._cdt:
            am = am.astype(self._cdt)
        return am

    @foreign_arrays(("query", "key", "value"), ("key_mask", "attn_mask", "positions"),
                    keep_bf16=False)
    def __call__(self, query: ArrayLike, key: ArrayLike | None = None,
                 value: ArrayLike | None = None, *, key_mask: ArrayLike | None = None,
                 attn_mask: ArrayLike | None = None,
                 is_causal: bool | Literal["upper_left", "lower_right"] = False,
                 need_weights: bool = False, average_attn_weights: bool = True,
                 cache: KVCache | None = None, positions: ArrayLike | None = None,
                 num_threads: int | None = None) -> tuple[np.ndarray, np.ndarray | None]:
        """Attend from ``query`` to ``key`` / ``value``.

        Parameters
        ----------
        query : array_like, (B, L, embed_dim) or unbatched (L, embed_dim)
        key : array_like, (B, S, kdim) or (S, kdim), optional
            Default: ``query`` (self-attention).  With a batched query, a
            2-D key (S, kdim) is a memory **shared by the whole batch** (a
            bank of style tokens, a fixed set of image regions): projected
            once and attended by every batch row through broadcasting,
            never copied B times.
        value : array_like, (B, S, vdim) or (S, vdim), optional
            Default: ``key``.  2-D exactly when the key is.
        key_mask : bool array_like, (B, S) or (S,), optional
            True = the key is a real token (takes part), False = padding.
            A shared memory also takes (S,), one mask for every row.
            With a self-attention cache, S is the cached length after this
            call's tokens are appended.
        attn_mask : array_like, optional
            As in :func:`attncore.scaled_dot_product_attention`: bool (True =
            take part) or float (added to the scaled scores); shape (L, S),
            (B, L, S) or (B, num_heads, L, S); unbatched (L, S) or
            (num_heads, L, S).  Combined with ``key_mask`` (both apply).
        is_causal : bool or {'upper_left', 'lower_right'}, default False
            As in the core.  With a self-attention cache holding earlier
            tokens use ``'lower_right'`` (the new tokens are the last
            queries); ``True`` / ``'upper_left'`` is then an error.
        need_weights : bool, default False
            Also return the attention weights.
        average_attn_weights : bool, default True
            Weights averaged over the heads, (B, L, S); else per head,
            (B, num_heads, L, S).
        cache : KVCache, optional
            From :meth:`new_cache`; see :class:`KVCache`.  Self-attention
            (no key, or ``key is query``) appends this call's keys and
            values and attends over all cached tokens; cross-attention
            projects ``key`` / ``value`` into an empty cache once and later
            calls reuse them (pass ``key=None``).
        positions : int array_like, (L,) or (B, L), optional
            Only for a layer with :attr:`rotary` embeddings: the absolute
            positions of this call's L tokens (e.g. per row for left-padded
            batches).  Default: ``arange(L)``, after the tokens a cache
            holds.
        num_threads : int, optional
            OpenMP threads of this call's kernels (projections, rotary
            embeddings, attention); default :attr:`num_threads`.

        Returns
        -------
        out : ndarray, (B, L, out_dim) or (L, out_dim), of the layer's dtype
        weights : ndarray or None
            None unless ``need_weights``.  Rows with no key to attend are 0.

        Notes
        -----
        The inputs are never modified.  Inputs of another float dtype are
        converted to the layer's dtype.
        """
        need_weights = parse_bool(need_weights, "need_weights")
        average_attn_weights = parse_bool(average_attn_weights, "average_attn_weights")
        nt = self.num_threads if num_threads is None else num_threads
        nthr = resolve_num_threads(nt)
        if key is None and value is not None:
            raise ValueError("value given without key; pass key as well (value defaults to key)")
        q_arr = to_array(query, "query", "key_mask or attn_mask")
        batched = q_arr.ndim == 3
        ndim = 3 if batched else 2
        q = self._input(q_arr, "query", self.embed_dim, ndim if q_arr.ndim in (2, 3) else 3,
                        nthr)
        B, L, _ = q.shape
        causal = parse_causal(is_causal)
        x_q = q.reshape(B * L, self.embed_dim)

        # checks first: a call that fails leaves the cache as it was
        self_attn, k_in, v_in, S, stored_mask = self._resolve_kv(
            query, key, value, cache, x_q, B, L, ndim, causal, is_causal)
        rot_pos = self._rotary_positions(positions, self_attn, cache, B, L)
        shared = (k_in is not None and k_in.shape[0] != B) or (
            k_in is None and cache is not None and cache.mode == "cross" and cache.shared)
        mask = self._combine_masks(key_mask, attn_mask, stored_mask, B, L, S, batched, shared)
        heads = list(self._project_heads(x_q, self_attn, key, value, k_in, v_in, cache,
                                         key_mask, mask, attn_mask, B, L, S, batched,
                                         shared, rot_pos, nt))
        # Each large temporary is dropped as soon as it is used up (here the
        # query converted to the compute dtype; in _attend the projections
        # and the attention output), so that the next one reuses its memory:
        # a call's peak above about twice its largest block makes glibc
        # return the heap to the system, and every call then faults its
        # buffers in afresh (E 512 bfloat16 layer, 4 x 512 tokens, 2
        # threads, AVX2 path: peak 26.1 -> 16.1 MiB (tracemalloc), 42.6-50.4
        # -> 34.0-35.1 ms against the float32 layer's 33.1-34.1)
        del q, x_q
        return self._attend(heads, mask, is_causal, need_weights, average_attn_weights,
                            B, L, batched, nt)

    # ------------------------------------------------------------ call steps
    def _resolve_kv(self, query, key, value, cache, x_q, B, L, ndim, causal, is_causal):
        """Where keys / values come from: (self-attention?, key input, value
        input, key length S, key mask stored with a cross-attention cache).
        A shared memory's key / value inputs have batch size 1."""
        self_attn = key is None or (key is query and (value is None or value is query))
        if cache is None:
            if self_attn:
                if self._w_qkv is None:
                    self._project_self(x_q, None)           # raises: needs key and value
                return True, None, None, L, None
            k_in, v_in = self._kv_inputs(key, value, ndim, B)
            return False, k_in, v_in, k_in.shape[1], None
        self._check_cache(cache, B)
        if cache.mode == "cross":
            if key is not None and key is not cache.source:
                raise ValueError(
                    "cache already holds the projected keys/values of a cross-attention "
                    "memory; pass key=None (or the same memory array) to reuse them, or "
                    "reset() the cache for a new memory")
            return False, None, None, len(cache), cache.key_mask
        if self_attn:
            if self._w_qkv is None:
                self._project_self(x_q, None)               # raises: needs key and value
            if causal == 1 and len(cache) > 0:
                raise ValueError(
                    f"is_causal={is_causal!r} (upper-left) with a cache holding "
                    f"{len(cache)} tokens would hide them from the new queries; use "
                    "is_causal='lower_right'")
            cache._check_room(L)
            return True, None, None, len(cache) + L, None
        if cache.mode == "self":
            raise ValueError("cache holds self-attention keys/values; cross-attention "
                             "needs a cache of its own")
        k_in, v_in = self._kv_inputs(key, value, ndim, B)
        cache._check_room(k_in.shape[1])
        return False, k_in, v_in, k_in.shape[1], None

    def _rotary_positions(self, positions, self_attn, cache, B, L):
        """This call's (P, L) int64 rotary positions, or None without rotary."""
        rot = getattr(self, "_rotary", None)
        if rot is None:
            if positions is not None:
                raise ValueError("positions= applies to a layer with rotary embeddings "
                                 "(rotary=...); this layer has none")
            return None
        if not self_attn:
            raise ValueError(
                "rotary embeddings apply to self-attention (key None or the query itself): "
                "this layer has rotary=... and was called with a separate key / memory")
        start = len(cache) if cache is not None else 0
        return rotary_positions(positions, start, B, L)

    def _check_cache(self, cache, B):
        if not isinstance(cache, KVCache):
            raise TypeError(f"cache must be a KVCache from new_cache(), got "
                            f"{type(cache).__name__}")
        Hkv, hd, hdv = self.num_kv_heads, self.head_dim, self.v_head_dim
        if (cache.num_kv_heads, cache.head_dim, cache.v_head_dim, cache.dtype) != \
                (Hkv, hd, hdv, self.dtype):
            raise ValueError(
                f"cache does not fit this layer: cache has num_kv_heads={cache.num_kv_heads}, "
                f"head_dim={cache.head_dim}, v_head_dim={cache.v_head_dim}, "
                f"dtype={cache.dtype}; layer has {Hkv}, {hd}, {hdv}, {self.dtype}")
        if B != cache.batch_size:
            raise ValueError(f"query batch size {B} does not match the cache's "
                             f"batch_size={cache.batch_size}")

    def _check_key_mask(self, key_mask, B, S, batched, shared=False):
        km, _ = parse_mask(key_mask, "key_mask", allow_float=False)
        if shared and km.shape == (S,):
            return km.reshape(1, 1, 1, S)
        want = (B, S) if batched else (S,)
        if km.shape != want:
            also = f" or (S,) = ({S},) for the shared memory" if shared else ""
            raise ValueError(f"key_mask must have shape {want} (batch, key length){also}, got "
                             f"{km.shape}")
        return km.reshape(B, 1, 1, S)

    def _combine_masks(self, key_mask, attn_mask, stored_mask, B, L, S, batched, shared):
        """One mask for the kernel: key_mask (or the one stored with a
        cross-attention memory: a key_mask given now overrides it) and
        attn_mask, both applying."""
        mask = stored_mask if key_mask is None else \
            self._check_key_mask(key_mask, B, S, batched, shared)
        if attn_mask is None:
            return mask
        am = self._check_attn_mask(attn_mask, B, L, S, batched)
        if mask is None:
            return am
        if am.dtype == np.bool_:
            return am & mask
        return np.where(mask, am, am.dtype.type(-np.inf))

    def _project_heads(self, x_q, self_attn, key, value, k_in, v_in, cache, key_mask, mask,
                       attn_mask, B, L, S, batched, shared, rot_pos, nt):
        """Projected (B, heads, length, head_dim) query / key / value views
        (batch 1 for a shared memory's keys / values), the cache updated
        with this call's keys and values."""
        H, Hkv, hd, hdv = self.num_heads, self.num_kv_heads, self.head_dim, self.v_head_dim
        Nq = H * hd
        Nk = Hkv * hd
        if self_attn:
            qkv = self._project_self(x_q, nt)
            q_p, k_p, v_p = qkv[:, :Nq], qkv[:, Nq:Nq + Nk], qkv[:, Nq + Nk:]
        else:
            q_p = self._project(x_q, self._wq, self._bq if self._has_b[0] else None, nt)
            if k_in is not None:
                k_p, v_p = self._project_kv(value is None or value is key, k_in, v_in, nt)
        q4 = q_p.reshape(B, L, H, hd).transpose(0, 2, 1, 3)
        if rot_pos is not None:
            # in place on the projection buffer: the query and key heads of a
            # row are adjacent blocks of hd, one (B, H + Hkv, L, hd) view
            rot = self._rotary
            qk4 = qkv[:, :Nq + Nk].reshape(B, L, H + Hkv, hd).transpose(0, 2, 1, 3)
            apply_rotary(qk4, rot_pos, rot["inv_freq"], rot["layout"] == "interleaved", qk4, nt)
        Bk = B if k_in is None else k_in.shape[0]
        if cache is None:
            # (Bk*S, Hkv*hd) rows -> (Bk, Hkv, S, hd) strided views
            k4 = k_p.reshape(Bk, S, Hkv, hd).transpose(0, 2, 1, 3)
            v4 = v_p.reshape(Bk, S, Hkv, hdv).transpose(0, 2, 1, 3)
            return q4, k4, v4
        if self_attn and hasattr(cache, "parts"):
            # a 4-bit cache: its 4-bit tokens and its float ones (the
            # window, then this call's), attended apart and merged
            kn, vn = k_p.reshape(B, -1, Hkv, hd), v_p.reshape(B, -1, Hkv, hdv)
            parts = _Parts(*cache.parts(kn, vn))
            cache.append_self(kn, vn)
            return q4, parts, None
        if self_attn:
            cache.append_self(k_p.reshape(B, -1, Hkv, hd), v_p.reshape(B, -1, Hkv, hdv))
        elif k_in is not None:
            stored = None
            if key_mask is not None:
                stored = mask if attn_mask is None else \
                    self._check_key_mask(key_mask, B, S, batched, shared)
            cache.bind_memory(k_p.reshape(Bk, -1, Hkv, hd), v_p.reshape(Bk, -1, Hkv, hdv),
                              key, stored)
        k4, v4 = cache.view(S)
        return q4, k4, v4

    def _attn_precision(self):
        """The attention's precision: the layer's, and for a bfloat16 layer
        without one, bfloat16 products (float32 where the CPU does not take
        them: show_config),
        as a bfloat16 model computes."""
        if self._precision is None and is_bf16(np.dtype(self.dtype)):
            return "bfloat16"
        return self._precision

    def _attend(self, heads, mask, is_causal, need_weights, average_attn_weights,
                B, L, batched, nt):
        """Attention of the projected heads ``[q4, k4, v4]`` (the list is
        emptied: this call then holds the only references to the projection
        buffer and frees it after the attention), then the output
        projection."""
        H, hdv = self.num_heads, self.v_head_dim
        q4, k4, v4 = heads
        heads.clear()
        if isinstance(k4, _Parts):
            res = self._attend_parts(q4, k4, mask, is_causal, need_weights, nt)
        else:
            res = scaled_dot_product_attention(
                q4, k4, v4, mask, is_causal=is_causal, scale=self.scale,
                enable_gqa=self.num_kv_heads != H, return_weights=need_weights,
                window=self.window, num_threads=nt, alibi_slopes=self._alibi,
                precision=self._attn_precision())
        del q4, k4, v4
        if need_weights:
            o, w = res
            if w.shape[:2] != (B, H):
                w = np.broadcast_to(w, (B, H) + w.shape[2:])
            w = w.mean(axis=1) if average_attn_weights else w
            if not batched:
                w = w[0]
        else:
            o, w = res, None
        # (B, H, L, hdv) -> (B*L, H*hdv) -> output projection
        o2 = o.transpose(0, 2, 1, 3).reshape(B * L, H * hdv)
        del o, res
        out = self._project(o2, self._wo, self._bo, nt, heads=False).reshape(B, L, self.out_dim)
        del o2
        if not batched:
            out = out[0]
        if self._cdt != self.dtype:  # a 16-bit layer returns its dtype
            out = cast(out, self.dtype, resolve_num_threads(nt))
            w = None if w is None else w.astype(self.dtype)
        return out, w

    def _attend_parts(self, q4, parts, mask, is_causal, need_weights, nt):
        """Attention over a 4-bit cache's parts (:class:`_Parts`): the
        4-bit tokens, which precede every query of the call (no causal
        mask), and the float ones under the call's causal alignment,
        merged by their log-sum-exp."""
        if need_weights or self._alibi is not None or self.window is not None:
            raise ValueError("a 4-bit cache (dtype='int4') attends its 4-bit and float tokens "
                             "apart: need_weights, ALiBi and the layer's sliding window are "
                             "not available with it (use a float or int8 cache)")
        return KVCache4.attend(q4, parts, mask, is_causal, scale=self.scale,
                               enable_gqa=self.num_kv_heads != self.num_heads, num_threads=nt,
                               precision=self._attn_precision())

    # ------------------------------------------------------------ pieces
    def _kv_inputs(self, key, value, ndim, B):
        """Key / value inputs as (B, S, kdim) / (B, S, vdim) arrays, or
        (1, S, .) for a memory shared by a batched query (2-D key)."""
        k_arr = to_array(key, "key", "key_mask or attn_mask")
        kndim = ndim
        if ndim == 3 and k_arr.ndim == 2:
            kndim = 2                                    # shared by the batch
        elif ndim == 3 and k_arr.ndim != 3:
            raise ValueError(f"key must be (B, S, kdim) = ({B}, S, {self.kdim}), or (S, "
                             f"{self.kdim}) shared by the whole batch, got shape {k_arr.shape}")
        k = self._input(k_arr, "key", self.kdim, kndim)
        if value is None:
            value = key
        if value is key and self.vdim == self.kdim:
            v = k
        else:
            if kndim == 2 and ndim == 3 and np.ndim(value) != 2:
                raise ValueError(f"value must be 2-D (S, vdim) like the shared key (shape "
                                 f"{k_arr.shape}), got shape {np.shape(value)}")
            v = self._input(value, "value", self.vdim, kndim)
        Bk = 1 if kndim != ndim else B
        if k.shape[0] != Bk or v.shape[0] != Bk:
            raise ValueError(f"key and value must have the query's batch size {B}, got key "
                             f"shape {np.shape(key)} and value shape {np.shape(value)}")
        if v.shape[1] != k.shape[1]:
            raise ValueError(f"key and value must have the same length (axis -2), got key shape "
                             f"{np.shape(key)} and value shape {np.shape(value)}")
        return k, v

    def _project(self, x2d, w, b, nt, *, heads: bool = True):
        # on attncore's threads with single-threaded BLAS blocks (see _linear);
        # bfloat16 weights: bfloat16 products where the CPU takes them, unless
        # precision="float32".  heads: the result is viewed as heads (rows
        # padded where their stride would alias in L1, _linear.head_rows)
        out = head_rows(x2d.shape[0], w.shape[0], x2d.dtype) if heads else None
        return linear(x2d, w, b, num_threads=nt, out=out, precision=self._precision)

    def _project_self(self, x2d, nt):
        """(B*L, Nq+Nk+Nv): Q, K and V of one input, one gemm where the weights allow."""
        b = self._b_in if any(self._has_b) else None
        if self._w_qkv is not None:
            return self._project(x2d, self._w_qkv, b, nt)
        if self.kdim != self.embed_dim or self.vdim != self.embed_dim:
            raise ValueError(
                f"self-attention needs kdim == vdim == embed_dim, got kdim={self.kdim}, "
                f"vdim={self.vdim}, embed_dim={self.embed_dim}; pass key and value")
        raise AssertionError("unreachable")  # pragma: no cover

    def _project_kv(self, same, k_in, v_in, nt):
        """Projected keys (B*S, Nk) and values (B*S, Nv)."""
        B, S = k_in.shape[:2]
        Nk = self.num_kv_heads * self.head_dim
        xk = k_in.reshape(B * S, self.kdim)
        if same and self._w_kv is not None:
            b = self._b_in[self._bq.shape[0]:] if (self._has_b[1] or self._has_b[2]) else None
            kv = self._project(xk, self._w_kv, b, nt)
            return kv[:, :Nk], kv[:, Nk:]
        k_p = self._project(xk, self._wk, self._bk if self._has_b[1] else None, nt)
        xv = v_in.reshape(B * S, self.vdim)
        v_p = self._project(xv, self._wv, self._bv if self._has_b[2] else None, nt)
        return k_p, v_p
