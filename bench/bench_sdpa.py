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
