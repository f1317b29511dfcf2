"""asv benchmarks: ``attncore.Attention`` with each built-in alignment.

Seq2seq shape B=32, T=50 decoder steps, S=50 encoder states,
Dq = Dk = Dv = A = 256, float32:

* ``all``: every decoder step at once, ``att(queries, keys, values)``;
* ``step``: one decoder step ``att.step(query, memory)`` on a memory made
  once by ``att.prepare(keys, values)`` (what a decoder loop repeats).

The layer has no ``num_threads`` argument: the thread count is a
threadpoolctl limit on OpenMP and BLAS.  On commits without ``Attention``
every benchmark here is skipped.
"""
import numpy as np

from .common import (THREADS, TIMEOUT, ThreadLimited, blas_limit, memo, n_threads,
                     numpy_softmax, random, require, speedup)

B, T, S, D, A = 32, 50, 50, 256, 256
ALIGNMENTS = ["dot", "scaled_dot", "bilinear", "mlp"]
MODES = ["all", "step"]


def make_params(alignment):
    """The alignment's parameters (names fixed by the design contract)."""
    if alignment == "bilinear":
        return {"weight": random((D, D), "float32", seed=10, scale=D ** -0.5)}
    if alignment == "mlp":
        return {"q_weight": random((A, D), "float32", seed=11, scale=D ** -0.5),
                "k_weight": random((A, D), "float32", seed=12, scale=D ** -0.5),
                "v": random((A,), "float32", seed=13, scale=A ** -0.5),
                "bias": random((A,), "float32", seed=14, scale=0.1)}
    return {}


def make_state(alignment):
    layer = require("Attention")(alignment, **make_params(alignment))
    queries = random((B, T, D), "float32", seed=1)
    keys = random((B, S, D), "float32", seed=2)
    values = random((B, S, D), "float32", seed=3)
    return layer, queries, keys, values


# ---------------------------------------------------------------- reference
def numpy_prepare(alignment, params, keys):
    """What depends on the keys only (the key projection of ``mlp``)."""
    if alignment == "mlp":
        return keys @ params["k_weight"].T + params["bias"]
    if alignment == "bilinear":
        return keys @ params["weight"].T  # (B, S, Dq): q W kᵀ = q · (k Wᵀ)
    return keys


def numpy_scores(alignment, params, query, prepared):
    """Scores (B, T, S) of a query (B, T, Dq) against prepared keys."""
    if alignment == "mlp":
        qp = query @ params["q_weight"].T                          # (B, T, A)
        e = np.tanh(qp[:, :, None, :] + prepared[:, None, :, :])   # (B, T, S, A)
        return e @ params["v"]
    s = query @ np.swapaxes(prepared, -1, -2)
    if alignment == "scaled_dot":
        s *= np.float32(1.0 / np.sqrt(query.shape[-1]))
    return s


def numpy_attention_layer(alignment, params, query, keys, values):
    """Context (B, T, Dv): softmax over the source of the alignment's scores."""
    w = numpy_softmax(numpy_scores(alignment, params, query,
                                   numpy_prepare(alignment, params, keys)))
    return w.astype(np.float32, copy=False) @ values


# --------------------------------------------------------------- benchmarks
class AttentionLayer(ThreadLimited):
    """time_ / peakmem_ per alignment, all steps at once or one step."""

    params = (ALIGNMENTS, MODES, THREADS)
    param_names = ["alignment", "mode", "threads"]
    timeout = TIMEOUT

    def setup(self, alignment, mode, threads):
        layer, queries, keys, values = memo(alignment, lambda: make_state(alignment))
        self.layer, self.queries, self.keys, self.values = layer, queries, keys, values
        if mode == "step":
            self.memory = memo((alignment, "memory"), lambda: layer.prepare(keys, values))
            self.query = np.ascontiguousarray(queries[:, 0])   # (B, Dq)
        self._limit_threads(threads)

    def _run(self, mode):
        if mode == "all":
            self.layer(self.queries, self.keys, self.values)
        else:
            self.layer.step(self.query, self.memory)

    def time_attention(self, alignment, mode, threads):
        self._run(mode)

    def peakmem_attention(self, alignment, mode, threads):
        self._run(mode)


class AttentionPrepare(ThreadLimited):
    """time_ / peakmem_ of ``prepare`` (once per source sequence)."""

    params = (ALIGNMENTS, THREADS)
    param_names = ["alignment", "threads"]
    timeout = TIMEOUT

    def setup(self, alignment, threads):
        self.layer, _, self.keys, self.values = memo(alignment, lambda: make_state(alignment))
        self._limit_threads(threads)

    def time_prepare(self, alignment, threads):
        self.layer.prepare(self.keys, self.values)

    def peakmem_prepare(self, alignment, threads):
        self.layer.prepare(self.keys, self.values)


class AttentionSpeedup(ThreadLimited):
    """track_: NumPy-reference / attncore time, all steps at once."""

    params = (ALIGNMENTS, THREADS)
    param_names = ["alignment", "threads"]
    timeout = TIMEOUT
    unit = "ratio"

    def setup(self, alignment, threads):
        self.layer, self.queries, self.keys, self.values = make_state(alignment)
        self.params_ = make_params(alignment)
        self._limit_threads(threads)

    def track_speedup_vs_numpy(self, alignment, threads):
        layer, q, k, v, p = self.layer, self.queries, self.keys, self.values, self.params_
        with blas_limit(n_threads(threads)):
            return speedup(lambda: numpy_attention_layer(alignment, p, q, k, v),
                           lambda: layer(q, k, v), repeats=5)
