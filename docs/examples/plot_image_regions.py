"""
Attention over image regions
============================

Image captioners and visual question answering models attend over a grid of
image regions: every region has a feature vector, and a query (a word being
generated, a question) weights the regions.  :class:`attncore.Attention`
takes such spatial keys directly, shape ``(B, H, W, D)``, and returns the
weights in the same ``(H, W)`` layout, ready to draw over the image.

The image ships with scikit-image (``skimage.data``).  Instead of a trained
network, each 16 × 16 patch is described by hand-made features -- its mean
colour in the perceptual Lab space, its colour spread, and its edge
strength -- and the queries are the features of a few chosen patches: each
query's weights show the regions that look like it.
"""
import matplotlib.pyplot as plt
import numpy as np
from skimage import color, data, filters

import attncore

image = data.astronaut()                                  # (512, 512, 3) uint8
P = 16                                                    # patch size
Hp, Wp = image.shape[0] // P, image.shape[1] // P         # 32 x 32 regions

# %%
# Patch features
# --------------
lab = color.rgb2lab(image)                                # L in 0..100, a and b around 0
edges = filters.sobel(color.rgb2gray(image))


def patches(a):
    """(H, W, ...) -> (Hp, Wp, P*P, ...): the pixels of every patch."""
    a = a[:Hp * P, :Wp * P]
    a = a.reshape(Hp, P, Wp, P, *a.shape[2:]).swapaxes(1, 2)
    return a.reshape(Hp, Wp, P * P, *a.shape[4:])


lab_p, edge_p = patches(lab), patches(edges)
features = np.concatenate([
    lab_p.mean(2) * [0.5, 1.0, 1.0],         # mean colour (lightness counts half)
    lab_p.std(2),                            # colour spread within the patch
    20 * edge_p.mean(2)[..., None],          # texture: mean edge strength
], axis=-1)
features = (features - features.mean((0, 1))) / features.std((0, 1))   # standardize
features /= np.linalg.norm(features, axis=-1, keepdims=True)           # unit length
keys = features[None].astype(np.float32)                               # (1, Hp, Wp, D)
print("keys:", keys.shape, keys.dtype)

# %%
# Queries and weights
# -------------------
# Three queries: a patch of the flag's blue canton, of the orange space
# suit, and of the dark background.  With unit-length features, ``"dot"`` scores the
# cosine similarity and its ``scale`` sharpens the softmax; the values
# default to the keys, and the weights come back as (B, T, Hp, Wp).
where = {"flag": (3, 1), "suit": (22, 5), "dark background": (19, 29)}
queries = np.stack([features[r, c] for r, c in where.values()])[None].astype(np.float32)
att = attncore.Attention("dot", scale=12.0)
context, weights = att(queries, keys, return_weights=True)
print("context:", context.shape, " weights:", weights.shape)
for (name, (r, c)), w in zip(where.items(), weights[0]):
    top = np.unravel_index(np.argsort(-w, axis=None)[:5], w.shape)
    print(f"{name:>15} query at region {(r, c)}: weight on itself {w[r, c]:.4f} "
          f"(uniform: {1 / w.size:.4f}), top regions "
          f"{list(zip(top[0].tolist(), top[1].tolist()))}")

# %%
# Drawn over the image: each query's region is outlined, its weights
# (upsampled to pixels) brighten the regions it attends to.
fig, axes = plt.subplots(1, 3, figsize=(12, 4.4))
for ax, (name, (r, c)), w in zip(axes, where.items(), weights[0]):
    heat = np.kron(w / w.max(), np.ones((P, P)))
    ax.imshow(image)
    ax.imshow(heat, cmap="magma", alpha=0.6, vmin=0, vmax=1)
    ax.add_patch(plt.Rectangle((c * P, r * P), P, P, fill=False, color="cyan", lw=2))
    ax.set_title(f"query: {name}")
    ax.axis("off")
fig.tight_layout()

# %%
# Masking regions
# ---------------
# A spatial mask of shape (B, Hp, Wp) (True = take part) removes regions,
# e.g. to attend only to the left half; the removed regions get weight 0.
left = np.zeros((1, Hp, Wp), dtype=bool)
left[..., : Wp // 2] = True
_, w_left = att(queries, keys, mask=left, return_weights=True)
print("weight on the masked right half:", float(w_left[..., Wp // 2:].sum()))
