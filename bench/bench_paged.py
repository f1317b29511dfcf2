"""asv benchmarks: ``attncore.paged_attention`` (serving).

Cases: a decode step of 32 sequences of 256..8192 tokens (Hq 32, Hk 8,
D 128, blocks of 32 shuffled over the pool), and a mixed batch (4 prompt
chunks of 512 on 512 cached tokens + 28 decoding sequences); float32, on
1 thread and on every core.  ``bench/compare_serving.py`` times the same
shapes side by side with the alternatives.
"""
import numpy as np

import attncore

from .common import THREADS, TIMEOUT, api_threads, memo
from .paged_inputs import pool


def _inputs(case):
    rng = np.random.default_rng(1)
    if case == "decode 32 seqs 256..8192":
        lens = np.geomspace(256, 8192, 32).astype(np.int64)
        nq = np.ones(32, np.int64)
    else:
        dec = np.geomspace(256, 4096, 28).astype(np.int64)
        lens = np.concatenate([[1024] * 4, dec])
        nq = np.concatenate([[512] * 4, [1] * 28])
    kc, vc, bt = pool(lens, Hk=8, D=128, bs=32)
    cq = np.concatenate([[0], np.cumsum(nq)]).astype(np.int32)
    q = rng.standard_normal((int(cq[-1]), 32, 128), dtype=np.float32)
    return q, kc, vc, dict(block_table=bt, seq_lens=lens.astype(np.int32), cu_seqlens_q=cq,
                           enable_gqa=True)


class Paged:
    """time_ of one paged_attention call, per case and thread count."""

    params = (["decode 32 seqs 256..8192", "mixed 4x512 + 28 decoding"], THREADS)
    param_names = ["case", "threads"]
    timeout = TIMEOUT

    def setup(self, case, threads):
        self.q, self.kc, self.vc, kw = memo(("paged", case), lambda: _inputs(case))
        self.kw = dict(kw, num_threads=api_threads(threads))

    def time_paged(self, case, threads):
        attncore.paged_attention(self.q, self.kc, self.vc, **self.kw)
