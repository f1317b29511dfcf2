"""attncore_cosine: a cosine-similarity alignment function for attncore.

score(q, k) = temperature * (q . k) / (max(|q|, eps) * max(|k|, eps))

Published through the entry-point group ``attncore.alignments`` under the
name ``cosine``; use it as ``attncore.Attention("cosine", temperature=...)``.
"""
from __future__ import annotations

import math

import numpy as np

from attncore import Alignment

__all__ = ["Cosine"]
__version__ = "0.1.0"


class Cosine(Alignment):
    """Cosine-similarity alignment.

    Parameters
    ----------
    temperature : float, default 1.0
        Factor on the cosine similarity (sharpens the softmax); finite.
    eps : float, default 1e-8
        Lower bound of the norms (zero vectors score 0).
    """

    def __init__(self, temperature=1.0, eps=1e-8):
        for name, val in (("temperature", temperature), ("eps", eps)):
            if isinstance(val, bool) or not isinstance(val, (int, float, np.floating)):
                raise TypeError(f"parameter {name!r} must be a real number, got {val!r}")
            if not math.isfinite(val):
                raise ValueError(f"parameter {name!r} must be finite, got {val!r}")
        if eps <= 0:
            raise ValueError(f"parameter 'eps' must be > 0, got {eps!r}")
        self.temperature = float(temperature)
        self.eps = float(eps)

    def prepare(self, keys):
        """Unit-normalized keys (once per memory)."""
        norm = np.linalg.norm(keys, axis=-1, keepdims=True)
        return keys / np.maximum(norm, np.asarray(self.eps, dtype=keys.dtype))

    def score(self, query, prepared):
        """(B, T, Dq) x (B, S, Dk) -> (B, T, S); needs Dq == Dk."""
        if query.shape[-1] != prepared.shape[-1]:
            raise ValueError(f"query dimension {query.shape[-1]} must equal the key "
                             f"dimension {prepared.shape[-1]}")
        norm = np.linalg.norm(query, axis=-1, keepdims=True)
        qn = query / np.maximum(norm, np.asarray(self.eps, dtype=query.dtype))
        s = np.matmul(qn, np.swapaxes(prepared, -1, -2))
        return s * np.asarray(self.temperature, dtype=s.dtype)
