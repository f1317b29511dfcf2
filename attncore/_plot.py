"""``attncore.plot_alignment``: a heat map of attention weights (matplotlib)."""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
from numpy.typing import ArrayLike

from ._interop import foreign_arrays

__all__ = ["plot_alignment"]


def _require_matplotlib():
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            "attncore.plot_alignment needs matplotlib, which is not installed; install it "
            "with `pip install 'attncore[plot]'` (or `pip install matplotlib`)") from exc


@foreign_arrays(("weights",), convert_out=False)
def plot_alignment(weights: ArrayLike, source_labels: Optional[Sequence[object]] = None,
                   target_labels: Optional[Sequence[object]] = None, ax: Any = None) -> Any:
    """Draw attention weights as a grey-scale heat map (white = 1, black = 0).

    Parameters
    ----------
    weights : array_like, shape (T, S)
        One sequence's weights, target steps (rows) by source positions
        (columns), e.g. ``weights[b]`` of :class:`attncore.Attention` with
        ``return_weights=True``.  Leading axes of size 1 are dropped.
    source_labels : sequence of str, optional
        S labels along the top (the source words).
    target_labels : sequence of str, optional
        T labels along the left (the target words).
    ax : matplotlib.axes.Axes, optional
        Where to draw; default a new figure from ``matplotlib.pyplot``.

    Returns
    -------
    matplotlib.axes.Axes

    Raises
    ------
    ImportError
        matplotlib is not installed (the optional extra ``attncore[plot]``).
    """
    _require_matplotlib()
    w = np.asarray(weights)
    while w.ndim > 2 and w.shape[0] == 1:
        w = w[0]
    if w.ndim != 2:
        raise ValueError(f"weights must have shape (T, S), got shape {np.shape(weights)}")
    if w.dtype.kind not in "fiub":
        raise TypeError(f"weights must be a real array, got dtype {w.dtype}")
    T, S = w.shape
    for name, labels in (("source_labels", source_labels), ("target_labels", target_labels)):
        if labels is not None and (isinstance(labels, (str, bytes, np.ndarray))
                                   and np.ndim(labels) != 1 or not hasattr(labels, "__len__")):
            raise TypeError(f"{name} must be a sequence of labels, got "
                            f"{type(labels).__name__} {labels!r}")
    if source_labels is not None and len(source_labels) != S:
        raise ValueError(f"source_labels must have S = {S} entries (weights shape {w.shape}), "
                         f"got {len(source_labels)}")
    if target_labels is not None and len(target_labels) != T:
        raise ValueError(f"target_labels must have T = {T} entries (weights shape {w.shape}), "
                         f"got {len(target_labels)}")
    if ax is None:
        import matplotlib.pyplot as plt

        _, ax = plt.subplots(figsize=(1 + 0.45 * S, 1 + 0.45 * T))
    ax.imshow(np.asarray(w, dtype=np.float64), cmap="gray", vmin=0.0, vmax=1.0,
              interpolation="nearest", aspect="equal")
    ax.xaxis.tick_top()
    ax.set_xticks(range(S))
    ax.set_yticks(range(T))
    if source_labels is not None:
        ax.set_xticklabels([str(s) for s in source_labels], rotation=90)
    if target_labels is not None:
        ax.set_yticklabels([str(t) for t in target_labels])
    ax.set_xlabel("source")
    ax.set_ylabel("target")
    ax.xaxis.set_label_position("top")
    return ax
