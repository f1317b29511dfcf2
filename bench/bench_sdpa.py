"""asv benchmarks: ``attncore.scaled_dot_product_attention``.

Cases (B x H x N x M x D): prefill, causal, key-padding mask (last 25 % of
the keys masked out), decoding (one query over a long key sequence),
a tiny overhead-bound seq2seq call, and the weights-returning path; in
float32 and float64, on 1 thread and on every core.
"""
import numpy as np

import attncore

from .common import (DTYPES, THREADS, TIMEOUT, api_threads, blas_limit, memo,
                     n_threads, numpy_attention, random, speedup)

# name -> (B, H, N, M, D, variant)
CASES = {
    "prefill 1x8x1024x1024x64": (1, 8, 1024, 1024, 64, "none"),
    "causal 4x12x512x512x64": (4, 12, 512, 512, 64, "causal"),
    "masked 4x12x512x512x64": (4, 12, 512, 512, 64, "keypad"),
    "decode 1x8x1x16384x64": (1, 8, 1, 16384, 64, "none"),
    "tiny 32x1x1x50x256": (32, 1, 1, 50, 256, "none"),
    "weights 2x8x256x256x64": (2, 8, 256, 256, 64, "weights"),
}


def make_inputs(case, dtype):
    """(args, kwargs) of one call, plus the reference's keyword arguments."""
    B, H, N, M, D, variant = CASES[case]
    q = random((B, H, N, D), dtype, seed=1)
    k = random((B, H, M, D), dtype, seed=2)
    v = random((B, H, M, D), dtype, seed=3)
    kwargs, ref = {}, {}
    if variant == "causal":
        kwargs["is_causal"] = True
        ref["causal"] = True
    elif variant == "keypad":
        mask = np.ones((B, 1, 1, M), dtype=bool)
        mask[..., M - M // 4:] = False
        kwargs["attn_mask"] = ref["mask"] = mask
    elif variant == "weights":
        kwargs["return_weights"] = ref["return_weights"] = True
    return (q, k, v), kwargs, ref


class SDPA:
    """time_ / peakmem_ of one call, per case, dtype and thread count."""

    params = (list(CASES), DTYPES, THREADS)
    param_names = ["case", "dtype", "threads"]
    timeout = TIMEOUT

    def setup(self, case, dtype, threads):
        self.args, kwargs, _ = memo((case, dtype), lambda: make_inputs(case, dtype))
        self.kwargs = dict(kwargs, num_threads=api_threads(threads))

    def time_sdpa(self, case, dtype, threads):
        attncore.scaled_dot_product_attention(*self.args, **self.kwargs)

    def peakmem_sdpa(self, case, dtype, threads):
        attncore.scaled_dot_product_attention(*self.args, **self.kwargs)


class SDPASpeedup:
    """track_: NumPy-reference time / attncore time, same threads, same run."""

    params = (list(CASES), THREADS)
    param_names = ["case", "threads"]
    timeout = TIMEOUT
    unit = "ratio"

    def setup(self, case, threads):
        self.args, kwargs, self.ref = make_inputs(case, "float32")
        self.kwargs = dict(kwargs, num_threads=api_threads(threads))

    def track_speedup_vs_numpy(self, case, threads):
        args, kwargs, ref = self.args, self.kwargs, self.ref
        with blas_limit(n_threads(threads)):
            return speedup(lambda: numpy_attention(*args, **ref),
                           lambda: attncore.scaled_dot_product_attention(*args, **kwargs))


# 16-bit inputs (read in place): name -> (B, H, N, M, D, causal)
HALF_CASES = {
    "decode 1x8x1x32768x64": (1, 8, 1, 32768, 64, False),
    "prefill 1x8x1024x1024x64": (1, 8, 1024, 1024, 64, False),
    "causal 1x8x2048x2048x128": (1, 8, 2048, 2048, 128, True),
}


def _half_inputs(case, dtype):
    B, H, N, M, D, causal = HALF_CASES[case]
    if dtype == "bfloat16":
        import ml_dtypes  # an optional extra: the benchmark is skipped without it

        dt = np.dtype(ml_dtypes.bfloat16)
    else:
        dt = np.dtype(np.float16)
    return tuple(random(s, "float32", seed=i + 1).astype(dt)
                 for i, s in enumerate(((B, H, N, D), (B, H, M, D), (B, H, M, D)))), causal


class SDPAHalf:
    """time_ / peakmem_ of bfloat16 / float16 calls (bfloat16 dot products
    where the CPU takes them: AMD's AVX512_BF16), and their speedup over the float32 call
    of the same values in the same run."""

    params = (list(HALF_CASES), ["bfloat16", "float16"], THREADS)
    param_names = ["case", "dtype", "threads"]
    timeout = TIMEOUT

    def setup(self, case, dtype, threads):
        try:
            self.args, self.causal = memo(("half", case, dtype), lambda: _half_inputs(case, dtype))
        except ImportError:
            raise NotImplementedError("ml_dtypes is not installed") from None
        self.nt = api_threads(threads)

    def time_sdpa(self, case, dtype, threads):
        attncore.scaled_dot_product_attention(*self.args, is_causal=self.causal,
                                              num_threads=self.nt)

    def peakmem_sdpa(self, case, dtype, threads):
        attncore.scaled_dot_product_attention(*self.args, is_causal=self.causal,
                                              num_threads=self.nt)

    def track_speedup_vs_float32(self, case, dtype, threads):
        f32 = tuple(a.astype(np.float32) for a in self.args)
        return speedup(
            lambda: attncore.scaled_dot_product_attention(*f32, is_causal=self.causal,
                                                          num_threads=self.nt),
            lambda: attncore.scaled_dot_product_attention(*self.args, is_causal=self.causal,
                                                          num_threads=self.nt))

    track_speedup_vs_float32.unit = "ratio"


INT8_CASES = {
    "prefill 1x8x1024x1024x64": (1, 8, 1024, 1024, 64, False),
    "prefill 1x8x1024x1024x128": (1, 8, 1024, 1024, 128, False),
    "causal 1x8x2048x2048x128": (1, 8, 2048, 2048, 128, True),
}


class SDPAInt8:
    """time_ of precision="int8" (int8 Q.K^T; quantizing included) on
    float32 inputs, and its speedup over float32 products in the same
    run."""

    params = (list(INT8_CASES), THREADS)
    param_names = ["case", "threads"]
    timeout = TIMEOUT

    def setup(self, case, threads):
        B, H, N, M, D, self.causal = INT8_CASES[case]
        self.args = memo(("int8", case), lambda: tuple(
            random(s, "float32", seed=i + 1)
            for i, s in enumerate(((B, H, N, D), (B, H, M, D), (B, H, M, D)))))
        self.nt = api_threads(threads)

    def _call(self, precision):
        return attncore.scaled_dot_product_attention(*self.args, is_causal=self.causal,
                                                     num_threads=self.nt, precision=precision)

    def time_sdpa_int8(self, case, threads):
        self._call("int8")

    def track_speedup_vs_float32(self, case, threads):
        return speedup(lambda: self._call(None), lambda: self._call("int8"))

    track_speedup_vs_float32.unit = "ratio"
