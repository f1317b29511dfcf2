"""attncore on Dask arrays: attention over data that outgrows one machine.

Two ways to scale out, both on an existing Dask cluster (or Dask's local
schedulers), with no scheduler of attncore's own:

* :func:`scaled_dot_product_attention` -- the functional API on dask arrays.
  Batch and head axes are split by their chunks (chunks unified across the
  operands), query chunks are independent, and **key / value chunks are
  attended separately**: each (query chunk, key chunk) pair gives a partial
  result ``(out, lse)`` (``attncore.scaled_dot_product_attention(...,
  return_lse=True)``), and the partials of one query chunk are merged by a
  tree reduction (:func:`attncore.merge_attention`, ``split_every`` at a
  time).  No task ever holds an N x M array, and no task holds more than one
  key chunk.
* :func:`map_batches` -- any layer (``MultiHeadAttention``, ``Attention``)
  or callable applied to batch chunks.

Task graph of one query chunk ``i`` over key chunks ``j``::

    partial(i, 0)  partial(i, 1)  ...  partial(i, J-1)     one core call each
          \\____________|____________/ ... (split_every)
                  merge(i, ...)                           merge_attention
                        |
                   out block i                            cast to the result dtype

Structure known when the graph is built removes work: a (query chunk, key
chunk) pair above the causal diagonal creates no task, one below it runs
without a causal mask, and only pairs the diagonal crosses pay for it.  A
NumPy ``attn_mask`` is inspected too (pairs it masks entirely create no
task); a dask mask is not computed to build the graph, so its fully masked
pairs still run (quickly: the kernel skips masked key tiles) and contribute
nothing.

Importing :mod:`attncore` does not import Dask; this module does (install
``attncore[dask]``).
"""
from __future__ import annotations

import itertools
import math
import numbers
from typing import Any, Callable, Literal, Sequence

import numpy as np

import dask
import dask.array as da
from dask.base import tokenize
from dask.highlevelgraph import HighLevelGraph

from .functional import _batch_shape, merge_attention
from .functional import scaled_dot_product_attention as _sdpa
from ._threads import resolve_num_threads
from ._validation import compute_dtype, parse_bool, parse_causal, parse_scale

__all__ = ["scaled_dot_product_attention", "map_batches"]


# --------------------------------------------------------------------------
# inputs
# --------------------------------------------------------------------------
def _kind(x: Any, name: str, optional: bool = False) -> str:
    """'dask' or 'numpy', else TypeError naming the argument."""
    if isinstance(x, da.Array):
        return "dask"
    if isinstance(x, np.ndarray) and not isinstance(x, np.ma.MaskedArray):
        return "numpy"
    what = "a dask array or a NumPy array" + (" (or None)" if optional else "")
    raise TypeError(f"{name} must be {what}, got {type(x).__module__}.{type(x).__qualname__}")


def _check_float(x: Any, name: str) -> None:
    dt = x.dtype
    if dt.kind != "f" or dt.itemsize not in (2, 4, 8):
        raise TypeError(f"{name} must be a float16, float32 or float64 array, got dtype {dt}")


def _check_known(x: da.Array, name: str) -> None:
    for ax, c in enumerate(x.chunks):
        if any(math.isnan(n) for n in c):
            raise ValueError(
                f"{name} has unknown chunk sizes along axis {ax} (chunks {c}): they cannot be "
                f"unified with the other operands; call {name}.compute_chunk_sizes() first")


def _wrap(x: np.ndarray, axis_chunks: dict[int, tuple[int, ...]]) -> da.Array:
    """A NumPy operand as a dask array: the axes in ``axis_chunks`` (negative
    indices) take the given chunks, the others one chunk each."""
    chunks = []
    for ax in range(x.ndim):
        c = axis_chunks.get(ax - x.ndim)
        chunks.append(c if c is not None and sum(c) == x.shape[ax] else (x.shape[ax],))
    return da.from_array(x, chunks=tuple(chunks))


def _boundaries(chunks: Sequence[int]) -> list[int]:
    return [0] + list(itertools.accumulate(chunks))


def _chunks_from(bounds: Sequence[int]) -> tuple[int, ...]:
    return tuple(int(b - a) for a, b in zip(bounds[:-1], bounds[1:]))


def _unify_batch(arrays: list[da.Array], bshape: tuple[int, ...], head_scale: list[int]
                 ) -> tuple[list[da.Array], list[tuple[int, ...]]]:
    """Rechunk the batch axes (all but the last two) to one common chunking:
    (the arrays, the output's chunks of those axes).

    Arrays of size 1 on an axis broadcast.  ``head_scale[n]`` is the number
    of query heads per head of array n on axis -3 (the grouped-query group
    for key and value, else 1): a chunk of query heads must then cover whole
    groups, so boundaries inside a group are dropped.
    """
    nbatch = len(bshape)
    new_chunks: list[list[tuple[int, ...] | None]] = [[None] * nbatch for _ in arrays]
    out_chunks = []
    for ax in range(nbatch):
        bounds: set[int] = {0, bshape[ax]}
        step = 1
        for n, a in enumerate(arrays):
            if a.shape[ax] != 1:
                s = head_scale[n] if ax == nbatch - 1 else 1
                step = max(step, s)
                bounds.update(b * s for b in _boundaries(a.chunks[ax]))
        common = sorted(b for b in bounds if b % step == 0 or b == bshape[ax])
        out_chunks.append(_chunks_from(common) if bshape[ax] else (0,))
        for n, a in enumerate(arrays):
            if a.shape[ax] == 1:
                continue
            s = head_scale[n] if ax == nbatch - 1 else 1
            c = _chunks_from([b // s for b in common])
            if c != a.chunks[ax]:
                new_chunks[n][ax] = c
    out = []
    for n, a in enumerate(arrays):
        spec = {ax: c for ax, c in enumerate(new_chunks[n]) if c is not None}
        out.append(a.rechunk(spec) if spec else a)
    return out, out_chunks


def _parse_split_every(split_every: Any) -> int:
    if split_every is None:
        return max(2, int(dask.config.get("split_every", 4) or 4))
    if isinstance(split_every, (bool, np.bool_)) or not isinstance(split_every, numbers.Integral):
        raise TypeError(f"split_every must be None or an int >= 2, got "
                        f"{type(split_every).__name__} {split_every!r}")
    if split_every < 2:
        raise ValueError(f"split_every must be >= 2, got {split_every}")
    return int(split_every)


# --------------------------------------------------------------------------
# the tasks (plain functions of NumPy blocks; pickled by reference)
# --------------------------------------------------------------------------
def _cast(x: np.ndarray, dt: np.dtype) -> np.ndarray:
    return x if x.dtype == dt else x.astype(dt)


def _block_partial(q: np.ndarray, k: np.ndarray, v: np.ndarray, m: np.ndarray | None,
                   shift: int | None, scale: float, gqa: bool, num_threads: int | None,
                   cdt: str) -> tuple[np.ndarray, np.ndarray]:
    """(out, lse) of one query block over one key block, in the compute dtype.

    ``shift``: None when every key of the block is visible to every query of
    it; else query row r (of the block) sees key column c when
    ``c <= r + shift`` (the causal diagonal in the block's own coordinates).
    """
    dt = np.dtype(cdt)
    q, k, v = _cast(q, dt), _cast(k, dt), _cast(v, dt)
    n, mk = q.shape[-2], k.shape[-2]

    def call(qq, kk, vv, mm, causal):
        return _sdpa(qq, kk, vv, mm, is_causal=causal, scale=scale, enable_gqa=gqa,
                     return_lse=True, num_threads=num_threads)

    if shift is None or shift >= mk - 1:
        return call(q, k, v, m, False)
    if shift == 0:
        return call(q, k, v, m, True)
    if shift == mk - n and n <= mk:
        return call(q, k, v, m, "lower_right")
    if shift > 0:
        # keys [0, shift) are visible to every row; keys [shift, mk) form an
        # upper-left causal block
        def keys(mm, sl):
            return mm if mm is None or mm.shape[-1] == 1 else mm[..., sl]
        a = call(q, k[..., :shift, :], v[..., :shift, :], keys(m, slice(None, shift)), False)
        b = call(q, k[..., shift:, :], v[..., shift:, :], keys(m, slice(shift, None)), True)
        return merge_attention([a[0], b[0]], [a[1], b[1]])
    # shift < 0: rows [0, -shift) see nothing; row r >= -shift sees keys
    # c <= r + shift, an upper-left causal block of the later rows
    r0 = -shift
    mm = m if m is None or m.shape[-2] == 1 else m[..., r0:, :]
    o2, l2 = call(q[..., r0:, :], k, v, mm, True)
    out = np.zeros(o2.shape[:-2] + (n, o2.shape[-1]), dtype=o2.dtype)
    lse = np.full(l2.shape[:-1] + (n,), -np.inf, dtype=l2.dtype)
    out[..., r0:, :] = o2
    lse[..., r0:] = l2
    return out, lse


def _merge_partials(parts: list) -> tuple[np.ndarray, np.ndarray]:
    return merge_attention([p[0] for p in parts], [p[1] for p in parts])


def _finish(part: tuple[np.ndarray, np.ndarray], rdt: str) -> np.ndarray:
    return _cast(part[0], np.dtype(rdt))


def _zeros(shape: tuple[int, ...], rdt: str) -> np.ndarray:
    return np.zeros(shape, dtype=np.dtype(rdt))


# --------------------------------------------------------------------------
# scaled_dot_product_attention
# --------------------------------------------------------------------------
def scaled_dot_product_attention(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any = None,
    *,
    is_causal: bool | Literal["upper_left", "lower_right"] = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    num_threads: int | None = 1,
    split_every: int | None = None,
) -> da.Array:
    """Scaled dot-product attention on dask arrays, key chunks merged exactly.

    The same computation as :func:`attncore.scaled_dot_product_attention`
    (same arguments, masks, causal alignments, grouped-query heads, dtype
    rules), run as a Dask graph: lazily, chunk by chunk.

    Parameters
    ----------
    query : dask.array.Array or numpy.ndarray, shape (..., N, D)
    key : dask.array.Array or numpy.ndarray, shape (..., M, D)
    value : dask.array.Array or numpy.ndarray, shape (..., M, Dv)
        float16, float32 or float64.  Leading (batch, head) dimensions
        broadcast by NumPy rules and may be chunked any way: their chunks are
        unified (rechunked to the common refinement).  The query axis (N) of
        ``query`` and the key axis (M) of ``key`` / ``value`` may be chunked
        any way; ``value`` must be chunked like ``key`` along M.  The last
        axes (D, Dv) are brought to one chunk.  A NumPy operand is wrapped
        with the chunks of its dask partners along N and M (one chunk per
        axis when it has none).
    attn_mask : dask.array.Array or numpy.ndarray, optional
        bool (True = attend) or float (added to the scaled scores),
        broadcastable to (..., N, M), e.g. key padding (B, 1, 1, M); never
        expanded.  Along N it must be chunked like ``query``, along M like
        ``key`` (a NumPy mask is wrapped that way).  With a NumPy mask,
        (query chunk, key chunk) pairs it masks out entirely create no task.
    is_causal : bool or {'upper_left', 'lower_right'}, default False
        ``True`` / ``'upper_left'``: query i attends to keys j <= i;
        ``'lower_right'``: to keys j <= i + M - N.  Positions are absolute
        (over the whole arrays, not per chunk).  Pairs of chunks above the
        diagonal create no task.
    scale : float, optional
        Factor on ``Q K^T``; default ``1 / sqrt(D)``.
    enable_gqa : bool, default False
        Grouped-query attention: key / value heads (axis -3) Hk dividing the
        query heads Hq; a chunk of query heads then covers whole groups.
    num_threads : int, optional, default 1
        OpenMP threads of each task's attncore call (``None``: OpenMP's
        default, ``-1``: all cores).  Keep ``workers x threads per worker x
        num_threads`` at or below the cores.
    split_every : int, optional
        How many partial results one merge task combines (the fan-in of the
        tree reduction over key chunks); default Dask's ``split_every``
        setting, else 4.

    Returns
    -------
    dask.array.Array, shape (..., N, Dv)
        Lazy; chunked like the (unified) batch axes and the query axis, one
        chunk along Dv.  In the result dtype of the in-memory call.
        ``.compute()`` equals it to float rounding.

    Raises
    ------
    TypeError
        An operand that is neither a dask nor a NumPy array, or of a wrong
        dtype; bad option types.
    ValueError
        Shapes that do not match or broadcast; chunks that cannot be
        unified (unknown sizes) or that disagree along the key / query axis
        (``value`` vs ``key``, ``attn_mask`` vs ``key`` / ``query``).

    Notes
    -----
    * Memory of one task: a query chunk (Nc x D), one key and value chunk
      (Mc x (D + Dv)), the mask chunk, and the partial result (Nc x Dv plus
      Nc log-sum-exps) per batch block; a merge task holds ``split_every``
      partials.  Nothing of size N x M exists.
    * A query row with nothing to attend (masked, or before the first key
      under ``'lower_right'`` with N > M) gives 0; NaN in attended inputs
      propagates, as in the in-memory call.
    """
    for nm, x, opt in (("query", query, False), ("key", key, False), ("value", value, False),
                       ("attn_mask", attn_mask, True)):
        if x is not None or not opt:
            if _kind(x, nm, opt) == "dask":
                _check_known(x, nm)
    for nm, x in (("query", query), ("key", key), ("value", value)):
        _check_float(x, nm)
        if x.ndim < 2:
            raise ValueError(f"{nm} must have at least 2 dimensions (..., length, dim), got shape {x.shape}")
    if attn_mask is not None:
        mdt = attn_mask.dtype
        if not (mdt == np.bool_ or (mdt.kind == "f" and mdt.itemsize in (2, 4, 8))):
            raise TypeError(f"attn_mask must be a bool array (True = take part) or a float array "
                            f"(added to the scores), got dtype {mdt}")
    N, D = query.shape[-2], query.shape[-1]
    M, Dv = key.shape[-2], value.shape[-1]
    if key.shape[-1] != D:
        raise ValueError(f"key last dimension must equal query's (D = {D}), got key shape "
                         f"{key.shape} and query shape {query.shape}")
    if value.shape[-2] != M:
        raise ValueError(f"value must have as many rows as key (M = {M}) in axis -2, got value "
                         f"shape {value.shape} and key shape {key.shape}")
    if D == 0:
        raise ValueError(f"query last dimension (D) must be >= 1, got query shape {query.shape}")
    m = attn_mask
    if m is not None:
        if m.ndim < 2:
            m = m[(None,) * (2 - m.ndim)]
        if m.shape[-2] not in (1, N) or m.shape[-1] not in (1, M):
            raise ValueError(f"attn_mask must be broadcastable to (..., N, M) = (..., {N}, {M}), "
                             f"got shape {attn_mask.shape}")
    causal = parse_causal(is_causal)
    sc = parse_scale(scale, D)
    enable_gqa = parse_bool(enable_gqa, "enable_gqa")
    if num_threads is not None:
        resolve_num_threads(num_threads)  # validates
    se = _parse_split_every(split_every)
    bshape, group = _batch_shape(query, key, value, m, enable_gqa)
    cdt, rdt = compute_dtype(np.dtype(query.dtype), np.dtype(key.dtype), np.dtype(value.dtype))

    # ---- every operand as a dask array, chunked consistently ----
    def first_dask_chunks(cands):
        for x, ax, size in cands:
            if isinstance(x, da.Array) and x.shape[ax] == size and size != 1:
                return x.chunks[ax]
        return None

    n_chunks = first_dask_chunks([(query, -2, N), (m, -2, N)] if m is not None else [(query, -2, N)])
    m_cands = [(key, -2, M), (value, -2, M)] + ([(m, -1, M)] if m is not None else [])
    m_chunks = first_dask_chunks(m_cands)
    mask_np = m if isinstance(m, np.ndarray) else None
    ops = {}
    for nm, x in (("query", query), ("key", key), ("value", value), ("attn_mask", m)):
        if x is None:
            continue
        if isinstance(x, np.ndarray):
            spec = {-2: n_chunks} if nm == "query" else {-2: m_chunks}
            if nm == "attn_mask":
                spec = {-2: n_chunks, -1: m_chunks}
            x = _wrap(x, {a: c for a, c in spec.items() if c is not None})
        ops[nm] = x
    q, k, v = ops["query"], ops["key"], ops["value"]
    dm = ops.get("attn_mask")
    # last axes whole (one chunk) -- D is contracted, Dv is a row of the output
    q = q if len(q.chunks[-1]) == 1 else q.rechunk({q.ndim - 1: -1})
    k = k if len(k.chunks[-1]) == 1 else k.rechunk({k.ndim - 1: -1})
    v = v if len(v.chunks[-1]) == 1 else v.rechunk({v.ndim - 1: -1})
    if v.chunks[-2] != k.chunks[-2]:
        raise ValueError(
            f"value must be chunked like key along the key axis (-2): key chunks {k.chunks[-2]}, "
            f"value chunks {v.chunks[-2]}; rechunk one of them")
    if dm is not None:
        if dm.shape[-1] == M and M != 1 and dm.chunks[-1] != k.chunks[-2]:
            raise ValueError(
                f"attn_mask must be chunked like key along the key axis: attn_mask chunks along "
                f"axis -1 {dm.chunks[-1]}, key chunks along axis -2 {k.chunks[-2]}; rechunk "
                f"attn_mask")
        if dm.shape[-2] == N and N != 1 and dm.chunks[-2] != q.chunks[-2]:
            raise ValueError(
                f"attn_mask must be chunked like query along the query axis: attn_mask chunks "
                f"along axis -2 {dm.chunks[-2]}, query chunks along axis -2 {q.chunks[-2]}; "
                f"rechunk attn_mask")

    # ---- one rank for all; batch axes unified ----
    L = len(bshape) + 2
    arrs = [q, k, v] + ([dm] if dm is not None else [])
    arrs = [a[(None,) * (L - a.ndim)] if a.ndim < L else a for a in arrs]
    if mask_np is not None:
        mask_np = mask_np.reshape((1,) * (L - mask_np.ndim) + mask_np.shape)
    gq = group if enable_gqa and group > 1 else 1
    scales = [1, gq, gq] + ([1] if dm is not None else [])
    arrs, out_batch_chunks = _unify_batch(arrs, tuple(bshape), scales)
    q, k, v = arrs[:3]
    dm = arrs[3] if dm is not None else None

    out_chunks = tuple(out_batch_chunks) + (q.chunks[-2], (Dv,))
    out_shape = tuple(bshape) + (N, Dv)
    token = tokenize(q, k, v, dm, causal, sc, enable_gqa, num_threads, se, str(cdt), str(rdt))
    name = f"attncore-sdpa-{token}"
    meta = np.empty((0,) * L, dtype=rdt)
    if 0 in out_shape or M == 0:
        return da.zeros(out_shape, chunks=out_chunks, dtype=rdt)

    # ---- structure known now: causal diagonal, NumPy mask ----
    qb = _boundaries(q.chunks[-2])
    kb = _boundaries(k.chunks[-2])
    off = 0 if causal != 2 else M - N
    live_mask = None
    if mask_np is not None and dm is not None:
        allowed = mask_np if mask_np.dtype == np.bool_ else (mask_np != -np.inf)
        live_mask = np.zeros(dm.numblocks, dtype=bool)
        bnds = [_boundaries(c) for c in dm.chunks]
        for idx in np.ndindex(*dm.numblocks):
            sl = tuple(slice(b[i], b[i + 1]) for b, i in zip(bnds, idx))
            live_mask[idx] = bool(allowed[sl].any())

    def block_of(a: da.Array, ax: int, b: int) -> int:
        return b if a.numblocks[ax] > 1 else 0

    dsk: dict = {}
    pname, mname = f"{name}-partial", f"{name}-merge"
    nq, nk = len(qb) - 1, len(kb) - 1
    cdt_s, rdt_s = np.dtype(cdt).str, np.dtype(rdt).str
    batch_ranges = [range(len(c)) for c in out_batch_chunks]
    for bidx in itertools.product(*batch_ranges):
        bsizes = tuple(out_batch_chunks[ax][b] for ax, b in enumerate(bidx))
        for i in range(nq):
            i0, i1 = qb[i], qb[i + 1]
            qkey = (q.name,) + tuple(block_of(q, ax, b) for ax, b in enumerate(bidx)) + (i, 0)
            parts = []
            for j in range(nk):
                j0, j1 = kb[j], kb[j + 1]
                if i1 == i0 or j1 == j0:
                    continue
                shift: int | None = None
                if causal:
                    shift = i0 + off - j0
                    if j0 > i1 - 1 + off:        # above the diagonal: nothing to attend
                        continue
                    if j1 - 1 <= i0 + off:       # below it: every key visible
                        shift = None
                mkey = None
                if dm is not None:
                    mb = tuple(block_of(dm, ax, b) for ax, b in enumerate(bidx))
                    mb += (i if dm.numblocks[-2] > 1 else 0, j if dm.numblocks[-1] > 1 else 0)
                    if live_mask is not None and not live_mask[mb]:
                        continue
                    mkey = (dm.name,) + mb
                kbi = tuple(block_of(k, ax, b) for ax, b in enumerate(bidx))
                vbi = tuple(block_of(v, ax, b) for ax, b in enumerate(bidx))
                key_ = (pname,) + bidx + (i, j)
                dsk[key_] = (_block_partial, qkey, (k.name,) + kbi + (j, 0), (v.name,) + vbi + (j, 0),
                             mkey, shift, sc, enable_gqa, num_threads, cdt_s)
                parts.append(key_)
            okey = (name,) + bidx + (i, 0)
            if not parts:
                dsk[okey] = (_zeros, bsizes + (i1 - i0, Dv), rdt_s)
                continue
            level, depth = parts, 0
            while len(level) > 1:
                nxt = []
                for g in range(0, len(level), se):
                    grp = level[g:g + se]
                    if len(grp) == 1:
                        nxt.append(grp[0])
                        continue
                    ck = (mname,) + (depth,) + bidx + (i, g // se)
                    dsk[ck] = (_merge_partials, list(grp))
                    nxt.append(ck)
                level, depth = nxt, depth + 1
            dsk[okey] = (_finish, level[0], rdt_s)
    deps: list[Any] = [q, k, v] + ([dm] if dm is not None else [])
    graph = HighLevelGraph.from_collections(name, dsk, dependencies=deps)
    return da.Array(graph, name, chunks=out_chunks, dtype=rdt, meta=meta)



# --------------------------------------------------------------------------
# map_batches
# --------------------------------------------------------------------------
class _Bound:
    """``fn`` with its constant keyword arguments: one graph key, so that a
    layer is serialized once and sent once to each worker that needs it."""

    __slots__ = ("fn", "kwargs")

    def __init__(self, fn: Callable[..., Any], kwargs: dict[str, Any]) -> None:
        self.fn = fn
        self.kwargs = kwargs

    def __getstate__(self):
        return (self.fn, self.kwargs)

    def __setstate__(self, state):
        self.fn, self.kwargs = state


def _apply_batch(bound: _Bound, arg_names: tuple, *blocks: np.ndarray) -> Any:
    args = [b for nm, b in zip(arg_names, blocks) if nm is None]
    kw = dict(bound.kwargs)
    kw.update({nm: b for nm, b in zip(arg_names, blocks) if nm is not None})
    return bound.fn(*args, **kw)


def _take(result: Any, n: int, nb: int) -> np.ndarray:
    x = result[n] if n >= 0 else result
    x = np.asarray(x)
    if x.ndim == 0 or x.shape[0] != nb:
        raise ValueError(f"map_batches: output {max(n, 0)} of the function has shape "
                         f"{x.shape} for a batch chunk of {nb}; outputs must keep the batch "
                         f"axis first")
    return x


def map_batches(fn: Callable[..., Any], *arrays: Any, **kwargs: Any) -> Any:
    """Apply ``fn`` to chunks of a batch, lazily, on Dask.

    ``fn`` is a :class:`attncore.MultiHeadAttention`, an
    :class:`attncore.Attention` layer or any callable whose inputs and
    outputs are batch-first and whose batch rows are independent.  It is
    called once per batch chunk with the chunks of the arrays.

    Parameters
    ----------
    fn : callable
        Picklable (layers are; a registered alignment plugin must be
        importable on the workers).  It is stored once in the graph and
        sent once to each worker that runs a chunk.
    *arrays : dask.array.Array or numpy.ndarray
        Batched inputs, batch axis first, all of one batch length B.  The
        batch axis is split at the unified chunks of the dask arrays (a
        NumPy array is wrapped with them); every other axis is brought to
        one chunk.
    **kwargs
        Keyword arguments of ``fn``.  A dask array among them is batched
        like ``arrays`` (e.g. ``key_mask=valid`` of shape (B, S)); anything
        else, NumPy arrays included, is passed whole to every call.

    Returns
    -------
    dask.array.Array, or a tuple of them (None where ``fn`` returns None)
        With the structure of ``fn``'s result (a tuple for
        ``MultiHeadAttention``: ``(out, None)`` without weights), chunked
        like the batch.

    Notes
    -----
    To learn the shapes and dtypes of its outputs, ``fn`` is called once,
    when the graph is built, on a batch of one element of zeros.

    Threads: a layer uses its own thread setting in each task
    (``Attention(num_threads=...)``; ``MultiHeadAttention`` follows OpenMP's
    default).  Workers of ``distributed`` start with ``OMP_NUM_THREADS=1``;
    under Dask's threaded scheduler every task would start all cores, so
    set the layer's threads (or ``OMP_NUM_THREADS``) to 1 there.

    Decoding with a KV cache (``cache=``) is step-by-step state, out of
    scope here.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if not arrays:
        raise TypeError("map_batches needs at least one batched array after fn")
    batched: list[tuple[str | None, Any]] = [(None, a) for a in arrays]
    static: dict[str, Any] = {}
    for nm, x in kwargs.items():
        if isinstance(x, da.Array):
            batched.append((nm, x))
        else:
            static[nm] = x
    labels = [f"arrays[{i}]" for i in range(len(arrays))] + [str(nm) for nm, _ in batched[len(arrays):]]
    B = None
    for lab, (_, x) in zip(labels, batched):
        _kind(x, lab)
        if x.ndim < 1:
            raise ValueError(f"{lab} must have a batch axis (axis 0), got shape {x.shape}")
        if B is None:
            B = x.shape[0]
        elif x.shape[0] != B:
            raise ValueError(f"{lab} has batch length {x.shape[0]} (axis 0), {labels[0]} has {B}; "
                             f"all batched arrays must have the same batch length")
    assert B is not None
    bounds: set[int] = {0, B}
    for lab, (_, x) in zip(labels, batched):
        if isinstance(x, da.Array):
            _check_known(x, lab)
            bounds.update(_boundaries(x.chunks[0]))
    bchunks = _chunks_from(sorted(bounds)) if B else (0,)
    darrs = []
    for (_, x) in batched:
        if isinstance(x, np.ndarray):
            x = da.from_array(x, chunks=(bchunks,) + tuple((n,) for n in x.shape[1:]))
        spec: dict[int, Any] = {ax: -1 for ax in range(1, x.ndim) if len(x.chunks[ax]) != 1}
        if x.chunks[0] != bchunks:
            spec[0] = bchunks
        darrs.append(x.rechunk(spec) if spec else x)

    # the structure of fn's result, from one element of zeros
    probe_args = [np.zeros((1,) + x.shape[1:], dtype=x.dtype) for x in darrs]
    with np.errstate(all="ignore"):
        res = _apply_batch(_Bound(fn, static), tuple(nm for nm, _ in batched), *probe_args)
    if isinstance(res, (tuple, list)):
        outs: list[Any] = [None if r is None else _take(res, n, 1) for n, r in enumerate(res)]
    else:
        outs = [_take(res, -1, 1)]

    token = tokenize(fn, static, [x.name for x in darrs], [nm for nm, _ in batched])
    fname = f"attncore-map-batches-fn-{token}"
    tname = f"attncore-map-batches-{token}"
    dsk: dict = {fname: _Bound(fn, static)}
    arg_names = tuple(nm for nm, _ in batched)
    for b in range(len(bchunks)):
        dsk[(tname, b)] = (_apply_batch, fname, arg_names,
                           *[(x.name, b) + (0,) * (x.ndim - 1) for x in darrs])
    graph_deps: list[Any] = list(darrs)
    results: list[Any] = []
    for n, o in enumerate(outs):
        if o is None:
            results.append(None)
            continue
        oname = f"attncore-map-batches-out{n}-{token}"
        odsk: dict = {}
        for b in range(len(bchunks)):
            odsk[(oname, b) + (0,) * (o.ndim - 1)] = (
                _take, (tname, b), n if isinstance(res, (tuple, list)) else -1, bchunks[b])
        layer = {**dsk, **odsk}
        graph = HighLevelGraph.from_collections(oname, layer, dependencies=graph_deps)
        chunks = (bchunks,) + tuple((s,) for s in o.shape[1:])
        results.append(da.Array(graph, oname, chunks=chunks, dtype=o.dtype,
                                meta=np.empty((0,) * o.ndim, dtype=o.dtype)))
    if isinstance(res, (tuple, list)):
        return tuple(results)
    return results[0]
