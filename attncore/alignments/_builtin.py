"""The built-in alignment functions.

Their ``prepare`` / ``score`` methods are plain NumPy (the reference
semantics, usable on their own); :class:`attncore.Attention` recognizes
these classes and runs native fused paths instead:

========================  ==========================================  =====================
name (aliases)            score(q, k)                                 native path
========================  ==========================================  =====================
``dot``                   q . k  (times ``scale`` if given)           core SDPA kernel
``scaled_dot``            q . k / sqrt(d)                             core SDPA kernel
``bilinear`` (general)    q W_a k^T                                   one gemm (W_a k, once
                                                                      per memory) + SDPA
``mlp`` (additive,        v^T tanh(W_q q + W_k k + b)                 fused tanh-reduce
concat)                                                               kernel (_additive)
========================  ==========================================  =====================
"""
from __future__ import annotations

import math

import numpy as np

from .._linear import linear
from .._validation import to_array
from ._base import Alignment

__all__ = ["Dot", "ScaledDot", "Bilinear", "MLP"]


def _param(value, name, owner, ndim, expect):
    """A parameter as a float array of ``ndim`` dimensions, else a named error."""
    if value is None:
        raise TypeError(f"{owner}: missing parameter {name!r} (expected {expect})")
    a = to_array(value, f"{owner}: parameter {name!r}")
    if a.dtype.kind != "f" or a.dtype.itemsize not in (2, 4, 8):
        raise TypeError(f"{owner}: parameter {name!r} must be a float16/32/64 array "
                        f"{expect}, got dtype {a.dtype}")
    if a.ndim != ndim:
        raise ValueError(f"{owner}: parameter {name!r} must have shape {expect}, got "
                         f"shape {a.shape}")
    if any(n == 0 for n in a.shape):
        raise ValueError(f"{owner}: parameter {name!r} must not be empty, got shape {a.shape}")
    return a


def _cast(a, dtype):
    """``a`` in ``dtype``: cast on every use, never cached, so a parameter
    replaced or edited in place (``+=``) is seen by every later call, in
    every dtype (a cached copy went stale in the dtype it was made for).
    The cast costs a read of the parameter, less than the product it feeds."""
    if a is None or a.dtype == dtype:
        return a
    return np.ascontiguousarray(a, dtype=dtype)


def _check_dim(owner, what, got, expected, arr_name, shape):
    if got != expected:
        raise ValueError(f"{owner}: {what} must be {expected}, got {arr_name} of shape {shape}")


class Dot(Alignment):
    """``score = q . k``, times an optional scalar ``scale``.

    Parameters
    ----------
    scale : float, optional
        A (learned) scalar factor; Keras ``Attention(use_scale=True)`` keeps
        it in its ``scale`` weight.  ``None``: no scaling (plain q . k).

    Notes
    -----
    Needs Dq == Dk.  The layer runs it on the core attention kernel.
    """

    _label = "dot"

    def __init__(self, scale=None):
        if scale is not None:
            s = np.asarray(scale)
            if s.size != 1 or s.dtype.kind not in "fiu" or isinstance(scale, (bool, np.bool_)):
                raise TypeError(f"dot: parameter 'scale' must be a real scalar or None, got "
                                f"{scale!r}")
            scale = float(s.reshape(()))
            if not np.isfinite(scale):
                raise ValueError(f"dot: parameter 'scale' must be finite, got {scale!r}")
        self.scale = scale

    def check_dims(self, Dq, Dk):
        if Dq != Dk:
            raise ValueError(f"{self._label}: the query dimension (Dq = {Dq}) must equal "
                             f"the key dimension (Dk = {Dk})")

    def score(self, query, prepared):
        self.check_dims(query.shape[-1], prepared.shape[-1])
        s = np.matmul(query, np.swapaxes(prepared, -1, -2))
        return s if self.scale is None else s * np.asarray(self.scale, dtype=s.dtype)

    def __repr__(self):
        return f"Dot(scale={self.scale!r})"


class ScaledDot(Dot):
    """``score = q . k / sqrt(d)`` (Transformer scaling; no parameters)."""

    _label = "scaled_dot"

    def __init__(self):
        self.scale = None

    def score(self, query, prepared):
        self.check_dims(query.shape[-1], prepared.shape[-1])
        s = np.matmul(query, np.swapaxes(prepared, -1, -2))
        return s * np.asarray(1.0 / math.sqrt(query.shape[-1]), dtype=s.dtype)

    def __repr__(self):
        return "ScaledDot()"


class Bilinear(Alignment):
    """``score = q W_a k^T`` (Luong's "general").

    Parameters
    ----------
    weight : array_like, shape (Dq, Dk)
        W_a.  :meth:`prepare` computes ``k W_a^T`` once per memory, so every
        decoder step is a plain dot product.
    """

    def __init__(self, weight=None):
        self.weight = _param(weight, "weight", "bilinear", 2, "(Dq, Dk)")

    @property
    def query_dim(self):
        return self.weight.shape[0]

    @property
    def key_dim(self):
        return self.weight.shape[1]

    def check_key_dim(self, Dk):
        _check_dim("bilinear", "the key dimension (weight.shape[1])", Dk,
                   self.weight.shape[1], "keys", f"(..., {Dk})")

    def check_query_dim(self, Dq):
        if Dq != self.weight.shape[0]:
            raise ValueError(f"bilinear: the query dimension must be weight.shape[0] = "
                             f"{self.weight.shape[0]}, got Dq = {Dq}")

    def prepare(self, keys, *, num_threads=None):
        """``k W_a^T`` (B, S, Dq); ``num_threads`` as in
        :func:`attncore.scaled_dot_product_attention` (the layer passes its
        own)."""
        self.check_key_dim(keys.shape[-1])
        w = _cast(self.weight, keys.dtype)
        B, S, Dk = keys.shape
        return linear(keys.reshape(B * S, Dk), w,
                      num_threads=num_threads).reshape(B, S, w.shape[0])

    def score(self, query, prepared):
        self.check_query_dim(query.shape[-1])
        return np.matmul(query, np.swapaxes(prepared, -1, -2))

    def __repr__(self):
        return f"Bilinear(weight: {self.weight.shape})"


class MLP(Alignment):
    """``score = v^T tanh(W_q q + W_k k + b)`` (Bahdanau additive, Luong "concat").

    Parameters
    ----------
    q_weight : array_like, shape (A, Dq), optional
        W_q.  ``None``: identity (then Dq must equal A).
    k_weight : array_like, shape (A, Dk), optional
        W_k.  ``None``: identity (then Dk must equal A).
    v : array_like, shape (A,)
        The output vector.
    bias : array_like, shape (A,), optional
        b, added inside the tanh (folded into the projected keys).

    Notes
    -----
    With both weights ``None`` and ``v`` set to Keras' scale vector this is
    ``keras.layers.AdditiveAttention``; ``Attention(score_mode="concat")``
    is ``q_weight = k_weight = scale * I`` and ``v = concat_score_weight``
    times ones.  :meth:`prepare` projects the keys once per memory.
    """

    def __init__(self, q_weight=None, k_weight=None, v=None, bias=None):
        owner = "mlp"
        self.v = _param(v, "v", owner, 1, "(A,)")
        A = self.v.shape[0]
        self.q_weight = None if q_weight is None else _param(q_weight, "q_weight", owner, 2,
                                                             f"(A, Dq) = ({A}, Dq)")
        self.k_weight = None if k_weight is None else _param(k_weight, "k_weight", owner, 2,
                                                             f"(A, Dk) = ({A}, Dk)")
        self.bias = None if bias is None else _param(bias, "bias", owner, 1, f"(A,) = ({A},)")
        for nm, a in (("q_weight", self.q_weight), ("k_weight", self.k_weight),
                      ("bias", self.bias)):
            if a is not None and a.shape[0] != A:
                raise ValueError(f"{owner}: parameter {nm!r} must have {A} rows (A = len(v)), "
                                 f"got shape {a.shape}")

    @property
    def attention_dim(self):
        return self.v.shape[0]

    def param(self, name, dtype):
        """Parameter ``name`` cast to ``dtype``."""
        return _cast(getattr(self, name), dtype)

    def _check_dim(self, what: str, weight: str, d: int) -> None:
        """``d``, the key or query dimension, checked against ``weight``."""
        w = getattr(self, weight)
        want = self.v.shape[0] if w is None else w.shape[1]
        if d != want:
            src = f"A = len(v) ({weight} is None: identity)" if w is None else f"{weight}.shape[1]"
            raise ValueError(f"mlp: the {what} dimension must be {src} = {want}, got "
                             f"D{what[0]} = {d}")

    def check_key_dim(self, Dk):
        self._check_dim("key", "k_weight", Dk)

    def check_query_dim(self, Dq):
        self._check_dim("query", "q_weight", Dq)

    def project_keys(self, keys, *, num_threads=None):
        """``W_k k + b`` as a C-contiguous (B, S, A) array of keys' dtype
        (``num_threads``: the projection's, the layer passes its own)."""
        self.check_key_dim(keys.shape[-1])
        dt = keys.dtype
        B, S, Dk = keys.shape
        A = self.v.shape[0]
        if self.k_weight is None:
            kp = np.array(keys, dtype=dt, order="C", copy=True)
        else:
            kp = linear(keys.reshape(B * S, Dk), self.param("k_weight", dt),
                        self.param("bias", dt) if self.bias is not None else None,
                        num_threads=num_threads).reshape(B, S, A)
            return kp
        if self.bias is not None:
            kp += self.param("bias", dt)
        return kp

    def project_queries(self, query, *, num_threads=None):
        """``W_q q`` as a C-contiguous (B, T, A) array of query's dtype
        (``num_threads``: the projection's, the layer passes its own)."""
        self.check_query_dim(query.shape[-1])
        B, T, Dq = query.shape
        if self.q_weight is None:
            return np.ascontiguousarray(query)
        return linear(query.reshape(B * T, Dq), self.param("q_weight", query.dtype),
                      num_threads=num_threads).reshape(B, T, self.v.shape[0])

    def prepare(self, keys, *, num_threads=None):
        return self.project_keys(keys, num_threads=num_threads)

    def score(self, query, prepared):
        qp = self.project_queries(query)
        v = self.param("v", prepared.dtype)
        return np.tanh(qp[..., :, None, :] + prepared[..., None, :, :]) @ v

    def __repr__(self):
        qs = None if self.q_weight is None else self.q_weight.shape
        ks = None if self.k_weight is None else self.k_weight.shape
        return (f"MLP(q_weight: {qs}, k_weight: {ks}, v: {self.v.shape}, "
                f"bias: {None if self.bias is None else self.bias.shape})")
