"""
Causal self-attention and token-by-token decoding
=================================================

A decoder-only language model attends causally: token *t* sees tokens
``0..t`` and nothing after.  At generation time it produces one token per
step, and recomputing the keys and values of the whole prefix at every step
would cost O(L²) projections; a *KV cache* keeps them instead.  This example
builds the input of such a model (token embeddings plus sinusoidal
positions), runs :class:`attncore.MultiHeadAttention` over the whole
sequence at once, then again token by token through a
:class:`attncore.KVCache`, and checks the two agree; then once more through
an int8 cache.  It ends with pictures of the causal and sliding-window
patterns.
"""
import matplotlib.pyplot as plt
import numpy as np

import attncore

rng = np.random.default_rng(0)
vocab, E, heads, L = 100, 64, 4, 24
embedding = (0.3 * rng.standard_normal((vocab, E))).astype(np.float32)
tokens = rng.integers(0, vocab, size=(1, L))

# %%
# Positions
# ---------
# :func:`attncore.add_positional_encoding` adds the sinusoidal table of
# *Attention Is All You Need* along the length axis; ``offset`` gives the
# position of the first row, which is what a decoding step needs.
x = attncore.add_positional_encoding(embedding[tokens])                   # (1, L, E)
table = attncore.sinusoidal_encoding(L, E)
print("x:", x.shape, " max |x - (embedding + table)|:",
      float(np.abs(x - (embedding[tokens] + table)).max()))

# %%
# The whole sequence at once
# --------------------------
# ``is_causal=True`` (the upper-left alignment): query *i* sees keys
# ``0..i``.  The layer's weights are random (``rng=``); real ones come from
# :meth:`~attncore.MultiHeadAttention.from_torch`, ``from_keras`` or
# ``from_arrays``.
mha = attncore.MultiHeadAttention(E, heads, rng=1)
full, w_full = mha(x, is_causal=True, need_weights=True)
print("full:", full.shape, " weights above the diagonal:", float(np.triu(w_full[0], 1).sum()))

# %%
# Token by token through the KV cache
# -----------------------------------
# The cache has a fixed capacity, allocated once.  A prompt of 8 tokens is
# processed in one call (prefill), then every later token alone, with its
# position as ``offset``.  The new tokens are the *last* queries over the
# cached keys, so the causal alignment is ``"lower_right"``.
cache = mha.new_cache(batch_size=1, max_length=L)
prompt = 8
outs = [mha(x[:, :prompt], cache=cache, is_causal="lower_right")[0]]
for t in range(prompt, L):
    x_t = attncore.add_positional_encoding(embedding[tokens[:, t:t + 1]], offset=t)
    y_t, _ = mha(x_t, cache=cache, is_causal="lower_right")
    outs.append(y_t)
decoded = np.concatenate(outs, axis=1)
print(cache)
print(f"token by token vs all at once: max |difference| {np.abs(decoded - full).max():.2e}")

try:
    mha(x[:, :1], cache=cache, is_causal="lower_right")
except ValueError as exc:
    print("one token too many:", exc)

# %%
# An int8 cache
# -------------
# ``new_cache(..., dtype="int8")`` stores the keys and values as int8 with
# one float32 scale per token and head, about a quarter of the memory; the
# kernel reads them through its int8 path.  The same decoding again:
cache8 = mha.new_cache(batch_size=1, max_length=L, dtype="int8")
outs = [mha(x[:, :prompt], cache=cache8, is_causal="lower_right")[0]]
for t in range(prompt, L):
    x_t = attncore.add_positional_encoding(embedding[tokens[:, t:t + 1]], offset=t)
    outs.append(mha(x_t, cache=cache8, is_causal="lower_right")[0])
decoded8 = np.concatenate(outs, axis=1)
print(cache8)
print(f"cache bytes: {cache8.nbytes} int8 vs {cache.nbytes} float32")
print(f"int8 cache vs float32, relative error "
      f"{np.linalg.norm(decoded8 - full) / np.linalg.norm(full):.1e}")

# %%
# Causal alignments and sliding windows
# -------------------------------------
# The two causal alignments differ when there are fewer queries than keys
# (N < M): ``"upper_left"`` lets query *i* see keys ``0..i``,
# ``"lower_right"`` keys ``0..i + M - N``, the alignment of N new tokens
# after M - N cached ones.  A sliding window (each token sees itself and
# the ``window - 1`` tokens before it) is ``window=(window - 1, 0)``: the
# band follows the causal diagonal, and key tiles outside it are skipped.
# The weights of each pattern, from
# :func:`attncore.scaled_dot_product_attention` with ``return_weights=True``:
N, M, D, window = 6, 16, 16, 4
q = rng.standard_normal((N, D)).astype(np.float32)
k = rng.standard_normal((M, D)).astype(np.float32)
v = rng.standard_normal((M, D)).astype(np.float32)
i = np.arange(N)[:, None] + (M - N)          # absolute position of each query
j = np.arange(M)[None, :]
sliding = (j <= i) & (j > i - window)

patterns = {
    "is_causal='upper_left'": dict(is_causal="upper_left"),
    "is_causal='lower_right'": dict(is_causal="lower_right"),
    f"window=({window - 1}, 0), 'lower_right'": dict(is_causal="lower_right",
                                                   window=(window - 1, 0)),
}
fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
for ax, (title, kw) in zip(axes, patterns.items()):
    out, w = attncore.scaled_dot_product_attention(q, k, v, return_weights=True, **kw)
    ax.imshow(w, cmap="Blues", vmin=0, vmax=1)
    ax.imshow(np.ma.masked_where(w > 0, np.ones_like(w)), cmap="Greys", vmin=0, vmax=4,
              alpha=0.5)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("key position")
    ax.set_ylabel("query")
    print(f"{title:>38}: keys per query {(w > 0).sum(1).tolist()}")
fig.tight_layout()

# %%
# The sliding-window result against a plain NumPy softmax over the same band
# written as a bool mask (True = take part), which ``attn_mask=`` would take
# as well:
s = q @ k.T / np.sqrt(D)
s = np.where(sliding, s, -np.inf)
p = np.exp(s - s.max(1, keepdims=True))
ref = (p / p.sum(1, keepdims=True)) @ v
out = attncore.scaled_dot_product_attention(q, k, v, is_causal="lower_right",
                                            window=(window - 1, 0))
print(f"window= vs NumPy: max |difference| {np.abs(out - ref).max():.1e}")
out_mask = attncore.scaled_dot_product_attention(q, k, v, attn_mask=sliding)
print(f"window= vs the bool mask: max |difference| {np.abs(out - out_mask).max():.1e}")
