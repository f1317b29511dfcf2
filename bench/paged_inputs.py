"""Inputs of the paged-cache benchmarks (bench/compare_serving.py and the asv
case bench/bench_paged.py): a pool with each sequence's blocks shuffled."""
from __future__ import annotations

import numpy as np


def pool(lens, Hk, D, bs, seed=0, dtype=np.float32, extra=16):
    """(k_cache, v_cache, block_table): each sequence's blocks shuffled over
    the pool."""
    rng = np.random.default_rng(seed)
    nblk = -(-np.asarray(lens) // bs)
    NB = int(nblk.sum()) + extra
    kc = rng.standard_normal((NB, bs, Hk, D), dtype=np.float32).astype(dtype)
    vc = rng.standard_normal((NB, bs, Hk, D), dtype=np.float32).astype(dtype)
    perm = rng.permutation(NB).astype(np.int32)
    bt = np.zeros((len(lens), int(nblk.max())), np.int32)
    o = 0
    for s, n in enumerate(nblk):
        bt[s, :n] = perm[o:o + n]
        o += n
    return kc, vc, bt
