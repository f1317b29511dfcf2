"""The seq2seq part of ``python -m attncore``: attention over a source
sentence, step by step, with an alignment picture when matplotlib is there."""
from __future__ import annotations

import os
import tempfile

import numpy as np

import attncore

SOURCE = ["The", "agreement", "on", "the", "European", "Economic", "Area", "was",
          "signed", "in", "August", "1992", ".", "<end>"]
TARGET = ["L'", "accord", "sur", "la", "zone", "économique", "européenne", "a", "été",
          "signé", "en", "août", "1992", ".", "<end>"]
# source position each target word mostly looks at (note the reordered
# "zone économique européenne" and "a été" <- "was")
ALIGN = [0, 1, 2, 3, 6, 5, 4, 7, 7, 8, 9, 10, 11, 12, 13]


def _picture_path(name="attncore_alignment.png"):
    here = os.getcwd()
    if os.access(here, os.W_OK):
        return os.path.join(here, name)
    return os.path.join(tempfile.gettempdir(), name)


def seq2seq_demo(rng=None, picture=True) -> None:
    """Luong ("general") attention decoding a 15-word target against a 14-word source.

    ``picture``: True writes the alignment picture to the default place
    (``attncore_alignment.png`` in the working directory, else the
    temporary directory), a path writes it there, False skips it."""
    rng = np.random.default_rng(0) if rng is None else rng
    S, T, D = len(SOURCE), len(TARGET), 64
    print(f"\ndemo: seq2seq attention ('general', Luong), {S} source and {T} target words, "
          f"state size {D}")
    enc = rng.standard_normal((1, S, D)).astype(np.float32)          # encoder states
    # decoder states that resemble the encoder state they should attend to
    dec = (enc[:, ALIGN] + 0.5 * rng.standard_normal((1, T, D))).astype(np.float32)
    W = (0.06 * np.eye(D) + 0.01 * rng.standard_normal((D, D))).astype(np.float32)
    att = attncore.Attention("general", weight=W)
    memory = att.prepare(enc)                       # k W^T computed once
    steps = [att.step(dec[:, t], memory, return_weights=True) for t in range(T)]
    w_steps = np.stack([w for _, w in steps], axis=1)[0]
    ctx_all, w_all = att(dec, enc, return_weights=True)
    ctx_steps = np.stack([c for c, _ in steps], axis=1)
    print(f"  step-by-step vs all at once: max |difference| {np.abs(ctx_steps - ctx_all).max():.1e}")
    hits = sum(int(np.argmax(w_all[0, t]) == ALIGN[t]) for t in range(T))
    print(f"  strongest source word is the aligned one for {hits} of {T} target words")
    if picture is False:
        return
    try:
        from matplotlib.figure import Figure
    except ImportError:
        print("  alignment picture skipped: matplotlib is not installed "
              "(pip install 'attncore[plot]')")
        return
    fig = Figure(figsize=(7.5, 7.5))
    ax = fig.add_subplot()
    attncore.plot_alignment(w_steps, SOURCE, TARGET, ax=ax)
    fig.tight_layout()
    if picture is not True:  # the caller's path: its errors are the caller's to see
        fig.savefig(os.fspath(picture), dpi=100)
        print(f"  alignment picture written to {os.fspath(picture)}")
        return
    path = _picture_path()
    try:
        fig.savefig(path, dpi=100)
    except OSError:
        path = os.path.join(tempfile.gettempdir(), os.path.basename(path))
        fig.savefig(path, dpi=100)
    print(f"  alignment picture written to {path}")
