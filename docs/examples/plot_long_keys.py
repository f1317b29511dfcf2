"""
Long keys in pieces: ``return_lse`` and ``merge_attention``
===========================================================

Attention over a very long context does not need all the keys at once.
Split the keys (and values, and the mask's key axis) into disjoint parts,
attend to each part with ``return_lse=True`` -- which also returns the
log-sum-exp of every query row, the log of its softmax denominator -- and
:func:`attncore.merge_attention` combines the partial results into exactly
what one call over all the keys gives.  The parts can be computed one after
the other in little memory, in other processes, or on other machines (Dask,
at the end, with :mod:`attncore.dask`): only ``N × (Dv + 1)`` numbers per
part travel to the merge.
"""
import time

import dask
import dask.array as da
import matplotlib.pyplot as plt
import numpy as np

import attncore
import attncore.dask

rng = np.random.default_rng(0)
B, H, N, M, D = 1, 4, 8, 65536, 64
parts = 8
q = rng.standard_normal((B, H, N, D), dtype=np.float32)
k = rng.standard_normal((B, H, M, D), dtype=np.float32)
v = rng.standard_normal((B, H, M, D), dtype=np.float32)
# a "needle" for every query: a key at a random position that matches it
needle = rng.integers(0, M, size=N)
k[:, :, needle] = 0.5 * q.transpose(0, 1, 2, 3)
# the last 1000 keys are padding (True = take part)
valid = np.ones((B, 1, 1, M), dtype=bool)
valid[..., M - 1000:] = False
print(f"keys and values: {2 * k.nbytes / 2**20:.0f} MiB in {parts} parts of {M // parts} keys")

# %%
# Part by part, then merged
# -------------------------
# Each part gets its slice of the keys, the values and the mask.
edges = np.linspace(0, M, parts + 1).astype(int)
outs, lses = [], []
t0 = time.perf_counter()
for a, b in zip(edges[:-1], edges[1:]):
    o, lse = attncore.scaled_dot_product_attention(
        q, k[..., a:b, :], v[..., a:b, :], attn_mask=valid[..., a:b], return_lse=True)
    outs.append(o)
    lses.append(lse)
out, lse = attncore.merge_attention(outs, lses)
t_parts = time.perf_counter() - t0

t0 = time.perf_counter()
whole, lse_whole = attncore.scaled_dot_product_attention(q, k, v, attn_mask=valid,
                                                         return_lse=True)
t_whole = time.perf_counter() - t0
print(f"merged vs one call: output {np.abs(out - whole).max():.1e}, "
      f"lse {np.abs(lse - lse_whole).max():.1e}")
print(f"time: {1e3 * t_parts:.1f} ms in {parts} parts, {1e3 * t_whole:.1f} ms in one call")

# %%
# Where each query's attention went
# ---------------------------------
# ``exp(lse_i - lse)`` is the share of a query's softmax mass that part
# *i* holds: every query attends mostly to the part holding its needle.
share = np.exp(np.stack(lses) - lse)[:, 0, 0]                  # (parts, N) of head 0
fig, ax = plt.subplots(figsize=(8, 3.2))
im = ax.imshow(share, cmap="viridis", vmin=0, vmax=1, aspect="auto")
ax.plot(np.arange(N), needle // (M // parts), "r+", ms=12, label="part holding the needle")
ax.set_xlabel("query")
ax.set_ylabel("key part")
ax.legend(loc="upper right", fontsize=8)
fig.colorbar(im, ax=ax, label="share of the softmax mass")
fig.tight_layout()

# %%
# Causal masks across parts
# -------------------------
# ``is_causal`` aligns with each call's own keys; over parts, write the
# causal structure as a bool mask of absolute positions.  Here the N queries
# are the last N positions (``"lower_right"``), so query *i* sees keys up to
# ``M - N + i``:
qpos = M - N + np.arange(N)[:, None]
outs, lses = [], []
for a, b in zip(edges[:-1], edges[1:]):
    causal = np.arange(a, b)[None, :] <= qpos                  # (N, part length)
    o, lse = attncore.scaled_dot_product_attention(
        q, k[..., a:b, :], v[..., a:b, :], attn_mask=causal & valid[..., a:b],
        return_lse=True)
    outs.append(o)
    lses.append(lse)
out, _ = attncore.merge_attention(outs, lses)
ref = attncore.scaled_dot_product_attention(q, k, v, attn_mask=valid, is_causal="lower_right")
print(f"causal, merged vs one call: {np.abs(out - ref).max():.1e}")

# %%
# On Dask
# -------
# :func:`attncore.dask.scaled_dot_product_attention` does all of the above
# for chunked dask arrays: one task per (query chunk, key chunk) pair, each
# a core call with ``return_lse=True`` (``num_threads=1`` here: the threaded
# scheduler already runs two tasks at once), merged by a
# tree of :func:`attncore.merge_attention` (``split_every`` partials at a
# time).  Causal masks use absolute positions, so no hand-made mask is
# needed: pairs above the diagonal create no task.  Here it runs on Dask's
# local threaded scheduler; with a ``distributed`` ``Client`` the same graph
# runs on the cluster's workers (:doc:`/guide/dask`).
kd = da.from_array(k, chunks=(B, H, M // parts, D))
vd = da.from_array(v, chunks=(B, H, M // parts, D))
res = attncore.dask.scaled_dot_product_attention(q, kd, vd, attn_mask=valid, num_threads=1)
print(f"attncore.dask: {len(res.dask)} tasks in the graph for {kd.numblocks[-2]} key chunks")
with dask.config.set(scheduler="threads", num_workers=2):
    print(f"attncore.dask vs one call: {np.abs(res.compute() - whole).max():.1e}")
    res_c = attncore.dask.scaled_dot_product_attention(q, kd, vd, attn_mask=valid,
                                                       is_causal="lower_right", num_threads=1)
    print(f"attncore.dask causal vs one call: {np.abs(res_c.compute() - ref).max():.1e}")

# %%
# The same tree by hand with ``dask.delayed``, for parts that come from
# somewhere a dask array cannot describe (files, a database, other
# programs): every part is a task, and the merges form a binary tree.


@dask.delayed
def part(a, b):
    return attncore.scaled_dot_product_attention(
        q, k[..., a:b, :], v[..., a:b, :], attn_mask=valid[..., a:b], return_lse=True,
        num_threads=1)


@dask.delayed
def merge(x, y):
    return attncore.merge_attention([x[0], y[0]], [x[1], y[1]])


level = [part(a, b) for a, b in zip(edges[:-1], edges[1:])]
while len(level) > 1:
    level = [merge(level[i], level[i + 1]) if i + 1 < len(level) else level[i]
             for i in range(0, len(level), 2)]
out_dask, _ = level[0].compute(scheduler="threads", num_workers=2)
print(f"dask.delayed ({parts} part tasks, {parts - 1} merges) vs one call: "
      f"{np.abs(out_dask - whole).max():.1e}")
