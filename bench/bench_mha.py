"""asv benchmarks: ``attncore.MultiHeadAttention`` and its KV cache.

* self- and cross-attention, E=512, H=8 (batch-first (B, L, E)), float32
  and float64;
* token-by-token decoding with the cache: one new token attending over
  ``cached`` tokens already in the cache (``is_causal="lower_right"``).

The layer has no ``num_threads`` argument: the thread count is a
threadpoolctl limit on OpenMP and BLAS.  On commits without
``MultiHeadAttention`` every benchmark here is skipped.
"""
import numpy as np

from .common import (DTYPES, THREADS, TIMEOUT, ThreadLimited, blas_limit, memo,
                     numpy_attention, n_threads, random, require, speedup)

E, H = 512, 8

# name -> (B, query length, key/value length)
CASES = {
    "self B2 L256": (2, 256, 256),
    "cross B2 L128 S512": (2, 128, 512),
}

# name -> (B, tokens already in the cache)
DECODE_CASES = {
    "B1 cached2048": (1, 2048),
    "B8 cached1024": (8, 1024),
}
DECODE_HEADROOM = 256  # cache capacity beyond the prompt


def make_layer(dtype):
    cls = require("MultiHeadAttention")
    return cls(E, H, dtype=np.dtype(dtype), rng=np.random.default_rng(0))


def make_inputs(case, dtype):
    B, L, S = CASES[case]
    x = random((B, L, E), dtype, seed=1)
    if case.startswith("self"):
        return (x,)
    mem = random((B, S, E), dtype, seed=2)
    return (x, mem, mem)


# ---------------------------------------------------------------- reference
def _linear(x, w, b):
    y = x @ w.T
    if b is not None:
        y += b
    return y


def _split_heads(y, B, L):
    return y.reshape(B, L, H, -1).transpose(0, 2, 1, 3)


def numpy_mha(layer, query, key=None, value=None, causal=False):
    """Plain NumPy multi-head attention with the layer's weights."""
    key = query if key is None else key
    value = key if value is None else value
    B, L = query.shape[:2]
    S = key.shape[1]
    q = _split_heads(_linear(query, layer.q_weight, layer.q_bias), B, L)
    k = _split_heads(_linear(key, layer.k_weight, layer.k_bias), B, S)
    v = _split_heads(_linear(value, layer.v_weight, layer.v_bias), B, S)
    ctx = numpy_attention(q, k, v, causal=causal)
    ctx = ctx.transpose(0, 2, 1, 3).reshape(B, L, -1)
    return _linear(ctx, layer.out_weight, layer.out_bias)


class NumpyDecoder:
    """Reference decoding step: preallocated K/V, one token per call."""

    def __init__(self, layer, prompt, capacity):
        B, P = prompt.shape[:2]
        self.layer, self.B, self.P = layer, B, P
        d = E // H
        self.k = np.zeros((B, H, capacity, d), prompt.dtype)
        self.v = np.zeros((B, H, capacity, d), prompt.dtype)
        self.k[:, :, :P] = _split_heads(_linear(prompt, layer.k_weight, layer.k_bias), B, P)
        self.v[:, :, :P] = _split_heads(_linear(prompt, layer.v_weight, layer.v_bias), B, P)
        self.n = P

    def reset(self):
        self.n = self.P

    def __call__(self, x_t):
        lay, B, n = self.layer, self.B, self.n
        q = _split_heads(_linear(x_t, lay.q_weight, lay.q_bias), B, 1)
        self.k[:, :, n:n + 1] = _split_heads(_linear(x_t, lay.k_weight, lay.k_bias), B, 1)
        self.v[:, :, n:n + 1] = _split_heads(_linear(x_t, lay.v_weight, lay.v_bias), B, 1)
        self.n = n + 1
        ctx = numpy_attention(q, self.k[:, :, :n + 1], self.v[:, :, :n + 1])
        return _linear(ctx.transpose(0, 2, 1, 3).reshape(B, 1, -1), lay.out_weight, lay.out_bias)


# --------------------------------------------------------------- benchmarks
class MHA(ThreadLimited):
    """time_ / peakmem_ of one forward call (self or cross)."""

    params = (list(CASES), DTYPES, THREADS)
    param_names = ["case", "dtype", "threads"]
    timeout = TIMEOUT

    def setup(self, case, dtype, threads):
        self.layer = memo(("layer", dtype), lambda: make_layer(dtype))
        self.inputs = memo((case, dtype), lambda: make_inputs(case, dtype))
        self._limit_threads(threads)

    def time_forward(self, case, dtype, threads):
        self.layer(*self.inputs)

    def peakmem_forward(self, case, dtype, threads):
        self.layer(*self.inputs)


class MHASpeedup(ThreadLimited):
    """track_: NumPy-reference time / attncore time for one forward call."""

    params = (list(CASES), THREADS)
    param_names = ["case", "threads"]
    timeout = TIMEOUT
    unit = "ratio"

    def setup(self, case, threads):
        self.layer = make_layer("float32")
        self.inputs = make_inputs(case, "float32")
        self._limit_threads(threads)

    def track_speedup_vs_numpy(self, case, threads):
        layer, inputs = self.layer, self.inputs
        with blas_limit(n_threads(threads)):
            return speedup(lambda: numpy_mha(layer, *inputs), lambda: layer(*inputs))


def _decode_state(case):
    """Layer, prompt and next token of a decoding case (float32)."""
    B, P = DECODE_CASES[case]
    layer = make_layer("float32")
    prompt = random((B, P, E), "float32", seed=1)
    x_t = random((B, 1, E), "float32", seed=2)
    return layer, prompt, x_t


class MHADecode(ThreadLimited):
    """time_ / peakmem_ of one cached decoding step.

    ``number = 1``: setup (a fresh cache holding the prompt) runs before
    every timed step, so each sample is one token after exactly ``cached``
    tokens.
    """

    params = (list(DECODE_CASES), THREADS)
    param_names = ["case", "threads"]
    timeout = TIMEOUT
    number = 1
    repeat = (3, 10, 10.0)
    warmup_time = 0.0

    def setup(self, case, threads):
        self._limit_threads(threads)
        self.layer, prompt, self.x_t = memo(case, lambda: _decode_state(case))
        B, P = DECODE_CASES[case]
        cache = getattr(self, "cache", None)
        if cache is None or getattr(self, "_cache_case", None) != case:
            self.cache = self.layer.new_cache(B, P + DECODE_HEADROOM)
            self._cache_case = case
        else:
            self.cache = _reset_cache(cache, self.layer, B, P + DECODE_HEADROOM)
        self.layer(prompt, cache=self.cache, is_causal="lower_right")

    def time_decode_step(self, case, threads):
        self.layer(self.x_t, cache=self.cache, is_causal="lower_right")

    def peakmem_decode_step(self, case, threads):
        self.layer(self.x_t, cache=self.cache, is_causal="lower_right")


def _reset_cache(cache, layer, batch, capacity):
    """An empty cache: ``cache.reset()``, or a new one where that is absent."""
    reset = getattr(cache, "reset", None)
    if reset is None:
        return layer.new_cache(batch, capacity)
    reset()
    return cache


class MHADecodeSpeedup(ThreadLimited):
    """track_: NumPy-reference / attncore time of a cached decoding step."""

    params = (list(DECODE_CASES), THREADS)
    param_names = ["case", "threads"]
    timeout = TIMEOUT
    unit = "ratio"

    def setup(self, case, threads):
        self._limit_threads(threads)
        self.layer, prompt, self.x_t = _decode_state(case)
        B, P = DECODE_CASES[case]
        self.cache = self.layer.new_cache(B, P + DECODE_HEADROOM)
        self.layer(prompt, cache=self.cache, is_causal="lower_right")
        self.ref = NumpyDecoder(self.layer, prompt, P + DECODE_HEADROOM)

    def track_speedup_vs_numpy(self, case, threads):
        # both grow by one token per call: fixed calls per sample keep them
        # within the cache's headroom and at the same lengths
        layer, cache, ref, x_t = self.layer, self.cache, self.ref, self.x_t
        with blas_limit(n_threads(threads)):
            return speedup(lambda: ref(x_t),
                           lambda: layer(x_t, cache=cache, is_causal="lower_right"),
                           repeats=15, number=4)
