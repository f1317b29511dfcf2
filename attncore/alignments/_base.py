"""The base class of alignment (scoring) functions."""
from __future__ import annotations

import numpy as np

__all__ = ["Alignment"]


class Alignment:
    """Base class of alignment (scoring) functions for :class:`attncore.Attention`.

    An alignment function scores every query (decoder state) against every
    key (encoder state); :class:`attncore.Attention` turns the scores into
    weights with a masked softmax and forms the context.  A subclass holds
    its parameters and implements :meth:`score`; :meth:`prepare` may
    precompute what depends only on the keys (done once per source sequence
    and reused for every decoder step).

    Subclasses are registered under a name with
    :func:`attncore.alignments.register`, or published by a package through
    the entry-point group ``attncore.alignments``.

    Parameters
    ----------
    **params
        The alignment's parameters.  ``__init__`` validates them and raises
        ``TypeError`` / ``ValueError`` naming the parameter.  The base class
        takes none.

    Notes
    -----
    The layer calls, with arrays of one float dtype (float32 or float64):

    * ``prepared = alignment.prepare(keys)`` with keys of shape (B, S, Dk)
      (spatial keys (B, H, W, Dk) arrive flattened to S = H * W);
    * ``scores = alignment.score(query, prepared)`` with query of shape
      (B, T, Dq) (a single decoder step has T = 1).  It must return a real
      float array of shape (B, T, S); the layer checks this and names the
      alignment in every error.

    Masking, softmax and the weighted sum of the values are the layer's job.
    """

    #: the registry name, filled in on instances created through the registry
    name: str | None = None

    def __init__(self, **params):
        if params:
            raise TypeError(
                f"{type(self).__name__} takes no parameters, got "
                f"{', '.join(sorted(params))}")

    def prepare(self, keys: np.ndarray):
        """Precompute what depends only on the keys (default: the keys).

        Parameters
        ----------
        keys : ndarray, shape (B, S, Dk)

        Returns
        -------
        prepared
            Anything :meth:`score` accepts as its second argument.
        """
        return keys

    def score(self, query: np.ndarray, prepared) -> np.ndarray:
        """Scores of every query against every key.

        Parameters
        ----------
        query : ndarray, shape (B, T, Dq)
        prepared
            What :meth:`prepare` returned for the keys.

        Returns
        -------
        scores : ndarray, shape (B, T, S)
        """
        raise NotImplementedError(f"{type(self).__name__} must implement score(query, prepared)")

    def __repr__(self):
        return f"{type(self).__name__}()" if self.name is None else \
            f"{type(self).__name__}(name={self.name!r})"
