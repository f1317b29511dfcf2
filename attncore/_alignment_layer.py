"""``attncore.Attention``: classic (seq2seq / spatial) attention with a
pluggable alignment function.

Dispatch::

    Attention.prepare(keys, values, mask)           once per source sequence
        |- validate, flatten spatial keys (B, H, W, Dk) -> (B, S, Dk)
        `- alignment-specific precomputation
             dot / scaled_dot : the keys themselves
             bilinear         : k W_a^T            (one gemm)
             mlp              : W_k k + b          (one gemm)
             plugin           : plugin.prepare(keys)
    Attention.step(query, memory)                   per decoder step (or all at once)
        |- dot / scaled_dot / bilinear -> attncore.scaled_dot_product_attention
        |- mlp -> W_q q (one gemm), then _core._additive: fused tanh-reduce,
        |         masked softmax and context, OpenMP over (batch, query block)
        `- plugin -> plugin.score(query, prepared), checked, then masked
                     softmax and context in NumPy
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np
from numpy.typing import ArrayLike

from . import alignments as _alignments
from ._core import _additive
from ._threads import OPENBLAS_SERIAL_MNK, blas_parallel_threads, resolve_num_threads, threads_for
from ._interop import foreign_arrays
from .alignments._base import Alignment
from .alignments._builtin import MLP, Bilinear, Dot, ScaledDot
from ._validation import aligned, as_float_array, compute_dtype, parse_bool, parse_mask
from .functional import scaled_dot_product_attention

__all__ = ["Attention", "Memory"]

# The additive kernel's factored form, tanh(x + y) = 1 - 2 / (1 + e^{2x} e^{2y})
# with e^{2x} per query and e^{2y} per key precomputed, needs one division per
# term instead of a full tanh.  It is used while every projected query and key
# is at most this large in magnitude, so that e^{2x} e^{2y} <= e^{4L} stays
# finite (float32: e^84 ~ 3e36; float64: e^680 ~ 1e295); otherwise (or with
# inf / NaN about) the kernel evaluates tanh directly.
_FACTOR_LIMIT = {np.dtype(np.float32): 21.0, np.dtype(np.float64): 170.0}


def _reraise(exc, label):
    """Re-raise ``exc`` (from plugin code) with the plugin named in the message."""
    msg = f"{label}: {exc}"
    try:
        new = type(exc)(msg)
    except Exception:
        new = RuntimeError(msg)
    raise new from exc


class Memory:
    """Keys (and values, mask) prepared once per source sequence.

    Returned by :meth:`Attention.prepare`, passed to :meth:`Attention.step`.

    Attributes
    ----------
    batch : int
        B (1 for a memory shared by the batch).
    shared : bool
        True for 2-D keys (S, Dk): one memory that every batch row of the
        query attends (broadcast, never copied).
    length : int
        S, the number of keys (H * W for spatial keys).
    spatial : tuple of int or None
        (H, W) for spatial keys, else None.
    mask : ndarray of bool, shape (B, S), or None
        True = the key takes part ((1, S) for a shared memory).
    values : ndarray, shape (B, S, Dv)
    prepared
        What the alignment precomputed from the keys.
    dtype : numpy.dtype
        The compute dtype (float32 or float64).
    """

    __slots__ = ("keys", "values", "mask", "prepared", "dtype", "result_dtype", "batch",
                 "length", "spatial", "key_dim", "shared", "_alignment", "_mask_u8", "_src",
                 "_aux")
    keys: np.ndarray
    values: np.ndarray
    mask: np.ndarray | None
    prepared: Any
    dtype: np.dtype
    result_dtype: np.dtype
    batch: int
    length: int
    spatial: tuple[int, int] | None
    key_dim: int
    shared: bool
    _alignment: Alignment
    _mask_u8: np.ndarray | None
    _src: tuple[np.ndarray, np.ndarray]
    _aux: np.ndarray | None

    def __repr__(self):
        sp = f", spatial={self.spatial}" if self.spatial else ""
        sp += ", shared" if self.shared else ""
        return (f"Memory(batch={self.batch}, length={self.length}{sp}, key_dim={self.key_dim}, "
                f"value_dim={self.values.shape[-1]}, dtype={self.dtype}, "
                f"masked={self.mask is not None})")


class Attention:
    """Attention with a pluggable alignment (scoring) function.

    A query (decoder state) scores every key (encoder state) with the
    alignment function; a masked softmax turns the scores into weights; the
    context is the weighted sum of the values.

    Parameters
    ----------
    alignment : str, type or Alignment, default "dot"
        A registered name (built-ins: ``"dot"``, ``"scaled_dot"``,
        ``"bilinear"`` / ``"general"``, ``"mlp"`` / ``"additive"`` /
        ``"concat"``; plugins: see :mod:`attncore.alignments`), an
        :class:`attncore.Alignment` subclass, or an instance (then pass no
        ``**params``).
    combine_weight : array_like, shape (Dq + Dv, Dh), optional
        Luong's attentional state: the layer also returns
        ``tanh(concatenate([h, c], axis=-1) @ combine_weight)``, h the query
        (decoder state), c the context.  Rows 0..Dq-1 multiply h, rows
        Dq..Dq+Dv-1 multiply c (the transpose of Luong's W_c, whose layout is
        (Dh, Dh + Dc) acting on [c; h] in the paper's column order: build
        ours as ``numpy.concatenate([W_c[:, Dc:], W_c[:, :Dc]], 1).T``).
    num_threads : int, optional
        ``None``: OpenMP's default; ``-1``: all cores; ``k >= 1``: k.
    **params
        The alignment's parameters, e.g. ``weight`` for ``"bilinear"``,
        ``q_weight``, ``k_weight``, ``v``, ``bias`` for ``"mlp"``,
        ``scale`` for ``"dot"``.

    Examples
    --------
    >>> att = attncore.Attention("mlp", q_weight=Wq, k_weight=Wk, v=v)  # doctest: +SKIP
    >>> memory = att.prepare(encoder_states, mask=src_valid)            # doctest: +SKIP
    >>> context, weights = att.step(decoder_state, memory, return_weights=True)  # doctest: +SKIP
    >>> context = att(queries, encoder_states, mask=src_valid)          # doctest: +SKIP

    Notes
    -----
    * Shapes: query (B, Dq) for one decoder step or (B, T, Dq); keys
      (B, S, Dk) or spatial (B, H, W, Dk) (flattened to S = H * W, weights
      returned as (B, [T,] H, W)); values (B, S, Dv) / (B, H, W, Dv),
      default the keys; mask (B, S) / (B, H, W) bool, True = the key takes
      part (batch size 1 broadcasts).
    * A query whose keys are all masked out gets context 0 and weights 0.
      NaN in inputs that take part propagates: a query whose scores hold
      NaN gets a NaN context and a row of weights NaN across the whole row
      (masked keys included), for every alignment.
    * dtypes: float32 / float64 computed natively, float16 computed in
      float32 and returned as float16; query, keys and values promote as
      NumPy does.  Alignment parameters are cast to the compute dtype
      when used (a parameter replaced or edited in place is seen by the
      next call); they do not take part in promotion.
    * Native paths: ``dot`` / ``scaled_dot`` / ``bilinear`` run on the core
      attention kernel (``bilinear`` first projects the keys with one gemm
      per memory); ``mlp`` runs a fused kernel that never builds the
      (B, T, S, A) tensor.  Plugins run ``score`` in Python, then a NumPy
      masked softmax; their output is checked (shape (B, T, S), real float
      dtype) and every error names the plugin.
    """

    def __init__(self, alignment: str | type | Alignment = "dot", *,
                 combine_weight: ArrayLike | None = None, num_threads: int | None = None,
                 **params: Any) -> None:
        if isinstance(alignment, Alignment):
            if params:
                raise TypeError(
                    f"Attention: alignment is an instance ({alignment!r}); its parameters "
                    f"cannot also be passed ({', '.join(sorted(params))})")
            inst = alignment
            name = alignment.name or type(alignment).__name__
        else:
            inst = _alignments.create(alignment, **params)
            name = alignment if isinstance(alignment, str) else type(inst).__name__
        self.alignment = inst
        self.alignment_name = name
        cls = type(inst)
        self._label = f"alignment {name!r} ({cls.__module__}.{cls.__qualname__})"
        if cls is Dot or cls is ScaledDot:
            self._kind = "dot"
        elif cls is Bilinear:
            self._kind = "bilinear"
        elif cls is MLP:
            self._kind = "mlp"
        else:
            self._kind = "plugin"
        if combine_weight is not None:
            cw = as_float_array(combine_weight, "combine_weight")
            if cw.ndim != 2:
                raise ValueError(f"combine_weight must have shape (Dq + Dv, Dh), got shape "
                                 f"{cw.shape}")
            combine_weight = cw
        self.combine_weight = combine_weight
        resolve_num_threads(num_threads)  # validate now
        self.num_threads = num_threads

    def __repr__(self):
        cw = "" if self.combine_weight is None else f", combine_weight: {self.combine_weight.shape}"
        return f"Attention({self.alignment_name!r}: {self.alignment!r}{cw})"

    # ------------------------------------------------------------------
    @foreign_arrays(("keys", "values"), ("mask",), convert_out=False)
    def prepare(self, keys: ArrayLike, values: ArrayLike | None = None, *,
                mask: ArrayLike | None = None) -> Memory:
        """Precompute what depends only on the keys (once per source sequence).

        Parameters
        ----------
        keys : array_like, shape (B, S, Dk), (B, H, W, Dk) or (S, Dk)
            2-D keys are a memory **shared by the whole batch** (a bank of
            style tokens, a fixed set of image regions): prepared once and
            attended by every batch row of the query through broadcasting,
            never copied B times.
        values : array_like, shape (B, S, Dv), (B, H, W, Dv) or (S, Dv), optional
            Default: the keys.
        mask : array_like of bool, shape (B, S), (B, H, W) or (S,), optional
            True = the key takes part.  Batch size 1 broadcasts.

        Returns
        -------
        Memory
        """
        k = as_float_array(keys, "keys", "mask")
        if k.ndim not in (2, 3, 4):
            raise ValueError(f"keys must have shape (B, S, Dk), (B, H, W, Dk) or (S, Dk) "
                             f"(shared by the batch), got shape {k.shape}")
        v = k if values is None else as_float_array(values, "values", "mask")
        if v.ndim != k.ndim or v.shape[:-1] != k.shape[:-1]:
            lead = {2: "(S,)", 3: "(B, S)", 4: "(B, H, W)"}[k.ndim]
            raise ValueError(f"values must have the leading shape {lead} = {k.shape[:-1]} of "
                             f"the keys, got values shape {v.shape} and keys shape {k.shape}")
        shared = k.ndim == 2
        if shared:
            k, v = k[None], v[None]
        spatial = tuple(k.shape[1:3]) if k.ndim == 4 else None
        B = k.shape[0]
        S = k.shape[1] if k.ndim == 3 else k.shape[1] * k.shape[2]
        if k.shape[-1] == 0:
            raise ValueError(f"keys last dimension (Dk) must be >= 1, got keys shape {k.shape}")
        m = None
        if mask is not None:
            m, _ = parse_mask(mask, "mask", allow_float=False)
            want = k.shape[:-1]
            if shared and m.ndim == 1:
                m = m[None]
            if m.shape != want and not (m.ndim == len(want) and m.shape[0] == 1
                                        and m.shape[1:] == want[1:]):
                form = "(B, H, W)" if k.ndim == 4 else "(S,)" if shared else "(B, S)"
                raise ValueError(
                    f"mask must have shape {form} = {want[1:] if shared else want} (True = "
                    f"take part), got shape {np.shape(mask)}")
            m = np.ascontiguousarray(np.broadcast_to(m, want).reshape(B, S))
        cdt, rdt = compute_dtype(k.dtype, v.dtype)
        return self._build(k.reshape(B, S, k.shape[-1]), v.reshape(B, S, v.shape[-1]), m,
                           spatial, cdt, rdt, shared)

    def _build(self, k, v, m, spatial, cdt, rdt, shared=False):
        mem = Memory()
        mem._src = (k, v)
        mem.shared = shared
        mem.batch, mem.length = k.shape[0], k.shape[1]
        mem.key_dim = k.shape[-1]
        mem.spatial = spatial
        mem.dtype, mem.result_dtype = cdt, rdt
        mem.mask = m
        mem._mask_u8 = None if m is None or m.all() else m.view(np.uint8)
        kc = k if k.dtype == cdt else k.astype(cdt)
        vc = v if v.dtype == cdt else v.astype(cdt)
        mem.keys = kc
        mem._alignment = self.alignment
        mem._aux = None
        kind = self._kind
        if kind == "dot":
            prepared = kc
        elif kind == "bilinear":
            prepared = self.alignment.prepare(kc, num_threads=self.num_threads)
        elif kind == "mlp":
            prepared = self.alignment.project_keys(kc, num_threads=self.num_threads)
            vc = aligned(np.ascontiguousarray(vc))
            if prepared.size and np.abs(prepared).max() <= _FACTOR_LIMIT[np.dtype(cdt)]:
                mem._aux = np.exp(prepared * np.asarray(2, dtype=cdt))   # e^{2 kp}
        else:
            try:
                prepared = self.alignment.prepare(kc)
            except Exception as exc:
                _reraise(exc, f"{self._label}.prepare")
        mem.prepared = prepared
        mem.values = vc
        return mem

    # ------------------------------------------------------------------
    @foreign_arrays(("query", "keys", "values"), ("mask",))
    def __call__(self, query: ArrayLike, keys: ArrayLike, values: ArrayLike | None = None, *,
                 mask: ArrayLike | None = None,
                 return_weights: bool = False) -> np.ndarray | tuple[np.ndarray, ...]:
        """All decoder steps at once: ``step(query, prepare(keys, values, mask=mask))``.

        Parameters
        ----------
        query : array_like, shape (B, T, Dq) or (B, Dq)
        keys : array_like, shape (B, S, Dk), (B, H, W, Dk) or (S, Dk)
            2-D keys: one memory shared by every batch row (see
            :meth:`prepare`).
        values : array_like, shape (B, S, Dv), (B, H, W, Dv) or (S, Dv), optional
            Default: the keys.
        mask : array_like of bool, shape (B, S), (B, H, W) or (S,), optional
            True = the key takes part.
        return_weights : bool, default False

        Returns
        -------
        context, attentional_state, weights
            As :meth:`step`.
        """
        return_weights = parse_bool(return_weights, "return_weights")
        return self.step(query, self.prepare(keys, values, mask=mask),
                         return_weights=return_weights)

    @foreign_arrays(("query",))
    def step(self, query: ArrayLike, memory: Memory, *,
             return_weights: bool = False) -> np.ndarray | tuple[np.ndarray, ...]:
        """Attend from one decoder step (or T of them) to a prepared memory.

        Parameters
        ----------
        query : array_like, shape (B, Dq) or (B, T, Dq)
        memory : Memory
            From :meth:`prepare` of this layer.
        return_weights : bool, default False

        Returns
        -------
        context : ndarray, shape (B, Dv) or (B, T, Dv)
        attentional_state : ndarray, shape (B, [T,] Dh)
            Only with ``combine_weight``: ``tanh([h; c] @ combine_weight)``.
        weights : ndarray, shape (B, [T,] S) or (B, [T,] H, W)
            Only with ``return_weights=True``.
        """
        return_weights = parse_bool(return_weights, "return_weights")
        if not isinstance(memory, Memory):
            raise TypeError(f"memory must be the Memory returned by Attention.prepare, got "
                            f"{type(memory).__name__}")
        if not hasattr(memory, "_alignment"):
            raise TypeError("memory must be the Memory returned by Attention.prepare, got a "
                            "Memory that no Attention.prepare made")
        if memory._alignment is not self.alignment:
            raise ValueError("memory was prepared by an Attention layer with another alignment")
        q = as_float_array(query, "query", "mask")
        if q.ndim not in (2, 3):
            raise ValueError(f"query must have shape (B, Dq) or (B, T, Dq), got shape {q.shape}")
        single = q.ndim == 2
        q3 = q[:, None, :] if single else q
        B, T, Dq = q3.shape
        if B != memory.batch and not memory.shared:
            raise ValueError(f"query batch size ({B}, query shape {q.shape}) must equal the "
                             f"memory's ({memory.batch})")
        cdt, _ = compute_dtype(q.dtype, memory.dtype)
        rdt = np.result_type(q.dtype, memory.result_dtype)
        if cdt != memory.dtype:  # a wider query: prepare again in its dtype
            spatial = memory.spatial
            memory = self._build(memory._src[0], memory._src[1], memory.mask, spatial, cdt, rdt,
                                 memory.shared)
        q3 = q3 if q3.dtype == cdt else q3.astype(cdt)
        S = memory.length
        Dv = memory.values.shape[-1]

        if T == 0 or S == 0:
            ctx = np.zeros((B, T, Dv), dtype=cdt)
            w = np.zeros((B, T, S), dtype=cdt)
        elif self._kind in ("dot", "bilinear"):
            ctx, w = self._dot_path(q3, memory, return_weights)
        elif self._kind == "mlp":
            ctx, w = self._mlp_path(q3, memory, return_weights)
        else:
            ctx, w = self._plugin_path(q3, memory)

        results = [ctx]
        if self.combine_weight is not None:
            results.append(self._attentional_state(q3, ctx, cdt))
        if return_weights:
            if memory.spatial is not None:
                w = w.reshape((B, T) + memory.spatial)
            results.append(w)
        out = []
        for r in results:
            if single:
                r = r[:, 0]
            if r.dtype != rdt:
                r = r.astype(rdt)
            out.append(r)
        return out[0] if len(out) == 1 else tuple(out)

    def _attentional_state(self, q3, ctx, cdt):
        """``tanh([h; c] @ combine_weight)`` of the queries ``q3`` and their
        contexts ``ctx`` (the weight cast to the compute dtype ``cdt`` on each
        call: a replaced or edited weight is seen in every dtype)."""
        cw = self.combine_weight
        Dq, Dv = q3.shape[-1], ctx.shape[-1]
        if cw.shape[0] != Dq + Dv:
            raise ValueError(f"combine_weight must have Dq + Dv = {Dq} + {Dv} = {Dq + Dv} "
                             f"rows, got shape {cw.shape}")
        cwc = np.ascontiguousarray(cw, dtype=cdt)
        return np.tanh(q3 @ cwc[:Dq] + ctx @ cwc[Dq:])

    # ------------------------------------------------------------------
    def _dot_path(self, q3, memory, return_weights):
        a = self.alignment
        Dq = q3.shape[-1]
        if self._kind == "bilinear":
            a.check_query_dim(Dq)
            scale = 1.0
        else:
            a.check_dims(Dq, memory.key_dim)
            if type(a) is ScaledDot:
                scale = 1.0 / math.sqrt(Dq)
            elif a.scale is None:
                scale = 1.0
            elif a.scale > 0 and math.isfinite(a.scale):
                scale = a.scale
            else:  # a learned scale may be <= 0: fold it into the queries
                q3 = q3 * np.asarray(a.scale, dtype=q3.dtype)
                scale = 1.0
        mask = None if memory._mask_u8 is None else memory.mask[:, None, :]
        r = scaled_dot_product_attention(q3, memory.prepared, memory.values, mask, scale=scale,
                                         return_weights=return_weights,
                                         num_threads=self.num_threads)
        return r if return_weights else (r, None)

    def _mlp_path(self, q3, memory, return_weights):
        a = self.alignment
        B, T, _ = q3.shape
        S = memory.length
        qp = aligned(a.project_queries(q3, num_threads=self.num_threads))
        A = qp.shape[-1]
        cdt = q3.dtype
        v = aligned(np.ascontiguousarray(a.param("v", cdt)))
        kp = memory.prepared
        factored = (memory._aux is not None and qp.size > 0
                    and np.abs(qp).max() <= _FACTOR_LIMIT[np.dtype(cdt)])
        if factored:
            two = np.asarray(2, dtype=cdt)
            qp = np.exp(qp * two)                  # e^{2 qp}
            kp = memory._aux
            v = v * -two
        values = memory.values
        Dv = values.shape[-1]
        if Dv == 0:  # weights are still defined: use a dummy value column
            values = np.zeros((values.shape[0], S, 1), dtype=cdt)
        out = np.empty((B, T, values.shape[-1]), dtype=cdt)
        weights = np.empty((B, T, S), dtype=cdt) if return_weights else None
        # about two flops per tanh evaluation of the (B, T, S, A) scores
        nthreads = threads_for(2.0 * B * T * S * A, self.num_threads)
        block = max(1, min(16, -(-(B * T) // (4 * nthreads)), T))
        items = B * (-(-T // block))
        nthreads = max(1, min(nthreads, items))
        # OpenBLAS runs a product below OPENBLAS_SERIAL_MNK multiply-adds on the
        # calling thread alone; the weights @ values products stay below it
        # for the shapes of seq2seq models (16 rows x S keys x Dv)
        if block * S * values.shape[-1] >= OPENBLAS_SERIAL_MNK:
            # products this large may start BLAS threads: only where the
            # BLAS can be held to one thread per thread (attncore._threads)
            nthreads = blas_parallel_threads(nthreads)
        args = (qp, kp, v, memory._mask_u8, values, out, weights, block, nthreads, factored)
        _additive.additive_attention(*args)
        if Dv == 0:
            out = out[..., :0]
        return out, weights

    def _plugin_path(self, q3, memory):
        label = self._label
        B, T, _ = q3.shape
        S = memory.length
        try:
            s = self.alignment.score(q3, memory.prepared)
        except Exception as exc:
            _reraise(exc, f"{label}.score")
        try:
            s = np.asarray(s)
        except Exception as exc:
            raise TypeError(f"{label}: score returned {type(s).__name__}, not an array") from exc
        if s.dtype.kind != "f" or s.dtype.itemsize not in (2, 4, 8):
            raise TypeError(f"{label}: score must return a real float array (float16/32/64), "
                            f"got dtype {s.dtype}")
        if s.shape != (B, T, S):
            raise ValueError(f"{label}: score must return scores of shape (B, T, S) = "
                             f"{(B, T, S)}, got shape {s.shape}")
        cdt = q3.dtype
        s = s.astype(cdt, copy=True)
        m = memory.mask if memory._mask_u8 is not None else None
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            if m is not None:
                s[~np.broadcast_to(m[:, None, :], s.shape)] = -np.inf
            mx = np.max(s, axis=-1, keepdims=True)
            mx = np.where(mx == -np.inf, 0, mx)
            e = np.exp(s - mx)
            z = e.sum(axis=-1, keepdims=True)
            w = e / np.where(z == 0, 1, z)
        values = memory.values
        if m is not None:  # values of masked keys are never read (NaN there cannot leak)
            values = np.where(m[:, :, None], values, 0)
        return np.matmul(w, values), w
