"""
Seq2seq alignments: the four built-in scoring functions
=======================================================

In a sequence-to-sequence model (a translator, a captioner), the decoder
looks back at the encoder's states at every step: its state scores every
source position with an *alignment function*, a softmax turns the scores
into weights, and the weighted sum of the encoder states (the *context*)
feeds the next prediction.  :class:`attncore.Attention` does this with the
built-in alignments of Luong and Bahdanau, and :func:`attncore.plot_alignment`
draws the weights.

The states here are synthetic: every target word's decoder state is built
near the encoder state of the source word it translates (note the reordered
"zone économique européenne" and "a été" ← "was"), so a good alignment
function should recover the word alignment.  This is ``python -m attncore``'s
demo, grown to all four built-ins.
"""
import time

import matplotlib.pyplot as plt
import numpy as np

import attncore

source = ["The", "agreement", "on", "the", "European", "Economic", "Area", "was",
          "signed", "in", "August", "1992", ".", "<end>"]
target = ["L'", "accord", "sur", "la", "zone", "économique", "européenne", "a", "été",
          "signé", "en", "août", "1992", ".", "<end>"]
# the source word each target word translates
align = [0, 1, 2, 3, 6, 5, 4, 7, 7, 8, 9, 10, 11, 12, 13]

rng = np.random.default_rng(0)
S, T, D = len(source), len(target), 64
enc = rng.standard_normal((1, S, D)).astype(np.float32)                  # encoder states
dec = (enc[:, align] + 0.5 * rng.standard_normal((1, T, D))).astype(np.float32)

# %%
# Four alignment functions
# ------------------------
# * ``dot``: q · k, here with a scale (a learned scalar in Keras' ``Attention(use_scale=True)``);
# * ``scaled_dot``: q · k / √D;
# * ``bilinear`` (Luong's "general"): q W kᵀ;
# * ``mlp`` (Bahdanau's additive): vᵀ tanh(W_q q + W_k k + b).
#
# Untrained, the additive function needs parameters that make it measure
# similarity.  With ``A = 2D`` hidden units, ``W_q = [sI; -sI]``,
# ``W_k = [-sI; sI]``, ``b = β`` and ``v = 1`` its score is
# ``Σ_d tanh(s(q_d - k_d) + β) + tanh(-s(q_d - k_d) + β)``: largest where q
# and k agree, a smooth, outlier-robust negative distance.
s, beta = 0.8, 1.0
eye = np.eye(D, dtype=np.float32)
alignments = {
    "dot": attncore.Attention("dot", scale=0.15),
    "scaled_dot": attncore.Attention("scaled_dot"),
    "bilinear": attncore.Attention(
        "bilinear",
        weight=(0.06 * eye + 0.01 * rng.standard_normal((D, D))).astype(np.float32)),
    "mlp": attncore.Attention(
        "mlp", q_weight=np.vstack([s * eye, -s * eye]), k_weight=np.vstack([-s * eye, s * eye]),
        v=np.full(2 * D, 0.12, np.float32), bias=np.full(2 * D, beta, np.float32)),
}

# %%
# Decode step by step
# -------------------
# :meth:`~attncore.Attention.prepare` does the work that depends only on the
# source once (``bilinear`` multiplies the keys by W, ``mlp`` computes
# W_k k + b); :meth:`~attncore.Attention.step` then runs one decoder step.
# Calling the layer with all T queries at once gives the same result.
weights = {}
for name, att in alignments.items():
    memory = att.prepare(enc)
    att.step(dec[:, 0], memory)                                          # warm up
    t0 = time.perf_counter()
    steps = [att.step(dec[:, t], memory, return_weights=True) for t in range(T)]
    per_step = (time.perf_counter() - t0) / T
    w = np.stack([w for _, w in steps], axis=1)[0]                      # (T, S)
    ctx_all, w_all = att(dec, enc, return_weights=True)
    ctx_steps = np.stack([c for c, _ in steps], axis=1)
    hits = int(sum(np.argmax(w[t]) == align[t] for t in range(T)))
    print(f"{name:>10}: {1e6 * per_step:6.1f} µs per step, strongest source word is the "
          f"aligned one for {hits:2d} of {T} target words, step-by-step vs all at once: "
          f"{np.abs(ctx_steps - ctx_all).max():.1e}")
    weights[name] = w

# %%
# The alignment pictures
# ----------------------
# White is weight 1, black 0; rows are target words, columns source words.
fig, axes = plt.subplots(2, 2, figsize=(11, 11))
for ax, (name, w) in zip(axes.flat, weights.items()):
    attncore.plot_alignment(w, source, target, ax=ax)
    ax.set_title(name, y=-0.08)
fig.tight_layout()

# %%
# Masked source positions
# -----------------------
# A batch of sentences of different lengths is padded; the ``mask`` (True =
# the source position takes part) keeps the padding out of every weight.
enc2 = np.concatenate([enc, enc], axis=0)
dec2 = np.concatenate([dec, dec], axis=0)
valid = np.ones((2, S), dtype=bool)
valid[1, 8:] = False                                                     # a shorter sentence
ctx, w = alignments["bilinear"](dec2, enc2, mask=valid, return_weights=True)
print("weight on padding:", float(w[1, :, 8:].sum()), "; rows sum to",
      np.round(w.sum(-1).min(), 6), "..", np.round(w.sum(-1).max(), 6))
