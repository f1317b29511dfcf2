"""
Writing an alignment plugin
===========================

:class:`attncore.Attention` takes any scoring function that follows the
:class:`attncore.Alignment` contract: ``prepare(keys)`` precomputes what
depends only on the keys (once per source sequence), ``score(query,
prepared)`` returns scores of shape (B, T, S).  The layer does the masking,
the softmax and the context, checks the plugin's output and names the
plugin in every error.

This is the cosine-similarity alignment of the example plugin distribution
``plugins/attncore-cosine`` in attncore's repository, registered here by
hand with :func:`attncore.alignments.register`.  Published in a package,
the same class becomes available to every user through an entry point (see
:doc:`../guide/plugins`).
"""
import math

import matplotlib.pyplot as plt
import numpy as np

import attncore


class Cosine(attncore.Alignment):
    """Cosine-similarity alignment, ``temperature * cos(q, k)``.

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


# %%
# Registering it
# --------------
# An explicit registration takes precedence over an installed plugin of the
# same name (``replace=True`` also allows re-running this script in one
# session).  The registry lists every name without importing any plugin.
attncore.alignments.register("cosine", Cosine, replace=True)
print("available:", attncore.alignments.available())
print("cosine:", attncore.alignments.available(details=True)["cosine"])

# %%
# Using it
# --------
# Parameters are passed by name to :class:`attncore.Attention`; masks,
# spatial keys, ``prepare`` / ``step`` and ``return_weights`` work as for
# the built-ins.
rng = np.random.default_rng(0)
B, S, T, D = 2, 12, 8, 32
keys = rng.standard_normal((B, S, D)).astype(np.float32)
queries = (keys[:, ::-1][:, :T] + 0.3 * rng.standard_normal((B, T, D))).astype(np.float32)
valid = np.ones((B, S), dtype=bool)
valid[1, 9:] = False

att = attncore.Attention("cosine", temperature=10.0)
print(att)
context, weights = att(queries, keys, mask=valid, return_weights=True)

# the same in NumPy, for comparison
qn = queries / np.linalg.norm(queries, axis=-1, keepdims=True)
kn = keys / np.linalg.norm(keys, axis=-1, keepdims=True)
s = np.where(valid[:, None, :], 10.0 * qn @ kn.transpose(0, 2, 1), -np.inf)
p = np.exp(s - s.max(-1, keepdims=True))
p /= p.sum(-1, keepdims=True)
print(f"vs NumPy: weights {np.abs(weights - p).max():.1e}, context "
      f"{np.abs(context - p @ keys).max():.1e}")

# %%
# Errors name the plugin
# ----------------------
# Bad parameters and bad inputs are reported with the alignment's name and
# class, so a user can tell the plugin's messages from attncore's:
for bad in (lambda: attncore.Attention("cosine", temperature=float("inf")),
            lambda: att(queries[..., :16], keys)):
    try:
        bad()
    except (TypeError, ValueError) as exc:
        print(f"{type(exc).__name__}: {exc}")

# %%
# The weights of the second sentence: the queries were built from the keys
# in reverse order, and the three padded keys get no weight.
fig, ax = plt.subplots(figsize=(5, 4))
attncore.plot_alignment(weights[1], [f"k{j}" for j in range(S)], [f"q{t}" for t in range(T)],
                        ax=ax)
fig.tight_layout()
