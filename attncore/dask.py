"""attncore on Dask arrays: attention over data that outgrows one machine.

Two ways to scale out, both on an existing Dask cluster (or Dask's local
schedulers), with no scheduler of attncore's own:

* :func:`scaled_dot_product_attention` -- the functional API on dask arrays
  (the core's arguments: masks, causal alignments, ``window``, ``softcap``,
  int8 ``(array, scales)`` pairs, ``return_lse``; the core's checks).
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
chunk) pair above the causal diagonal or outside every row's sliding window
creates no task, one entirely inside runs without a causal mask or window,
and only pairs the band's edges cross pay for it.  A
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
from typing import Any, Callable, Literal, NamedTuple, Sequence

import numpy as np

try:
    import dask
    import dask.array as da
    from dask.base import tokenize
    from dask.highlevelgraph import HighLevelGraph
except ImportError as exc:
    raise ImportError(
        "attncore.dask needs dask[array], which is not installed; install it with "
        "`pip install 'attncore[dask]'`") from exc

from . import _call
from .functional import _attention, merge_attention
from ._validation import parse_bool, parse_softcap, parse_window

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
    specs: list[dict[int, tuple[int, ...]]] = [{} for _ in arrays]
    out_chunks = []
    for ax in range(nbatch):
        # (n, array, query heads per head) of the arrays not broadcast along ax
        live = [(n, a, head_scale[n] if ax == nbatch - 1 else 1)
                for n, a in enumerate(arrays) if a.shape[ax] != 1]
        step = max([1] + [s for _, _, s in live])
        bounds = {0, bshape[ax]}.union(*({b * s for b in _boundaries(a.chunks[ax])}
                                         for _, a, s in live))
        common = sorted(b for b in bounds if b % step == 0 or b == bshape[ax])
        out_chunks.append(_chunks_from(common) if bshape[ax] else (0,))
        for n, a, s in live:
            c = _chunks_from([b // s for b in common]) if bshape[ax] else (0,)
            if c != a.chunks[ax]:
                specs[n][ax] = c
    return [a.rechunk(spec) if spec else a for a, spec in zip(arrays, specs)], out_chunks


def _parse_split_every(split_every: Any) -> int:
    if split_every is None:
        cfg = dask.config.get("split_every", 4) or 4
        if isinstance(cfg, dict):  # dask's reductions take {axis: n}: the largest
            ns = [int(v) for v in cfg.values() if isinstance(v, numbers.Integral)]
            cfg = max(ns) if ns else 4
        if isinstance(cfg, (bool, np.bool_)) or not isinstance(cfg, numbers.Integral):
            raise TypeError(f"dask.config's split_every must be an int or a dict of ints, got "
                            f"{type(cfg).__name__} {cfg!r}")
        return max(2, int(cfg))
    if isinstance(split_every, (bool, np.bool_)) or not isinstance(split_every, numbers.Integral):
        raise TypeError(f"split_every must be None or an int >= 2, got "
                        f"{type(split_every).__name__} {split_every!r}")
    if split_every < 2:
        raise ValueError(f"split_every must be >= 2, got {split_every}")
    return int(split_every)


# --------------------------------------------------------------------------
# the tasks (plain functions of NumPy blocks; pickled by reference)
# --------------------------------------------------------------------------
def _block_partial(q: np.ndarray, k: np.ndarray, ks: np.ndarray | None, v: np.ndarray,
                   vs: np.ndarray | None, m: np.ndarray | None,
                   band: tuple[int | None, int | None] | None, scale: float, gqa: bool,
                   softcap: float | None, num_threads: int | None,
                   precision: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """(out, lse) of one query block over one key block, in the compute dtype.

    The blocks are passed to the core in their own dtypes (16-bit ones read
    in place, as the in-memory call reads them), and the core's output is
    kept in the compute dtype: the partials are merged before the one
    rounding to the result dtype (``_finish``).  ``ks`` / ``vs``: the
    scales (..., Mc, 1) of an int8 key / value block, or None for a float
    block.  ``band``: None when every key of the block is
    visible to every query of it; else ``(a, b)``: query row r (of the
    block) sees key column c when ``r - a <= c <= r + b`` (None: no bound on
    that side) -- the causal diagonal and the sliding window in the block's
    own coordinates.  The core's ``window`` cannot begin a row's keys after
    the row's own column (a < 0) nor end them before it (b < 0): the keys
    before the first visible one, or the rows that see nothing, are sliced
    off first, and those rows give 0 (lse -inf).
    """
    n = q.shape[-2]
    r0 = c0 = 0
    window = (-1, -1)
    if band is not None:
        a, b = band
        if a is not None and a < 0:      # keys [0, -a) are before every row's band
            c0, b, a = -a, (None if b is None else b + a), 0
        if b is not None and b < 0:      # rows [0, -b) see no key of this block
            r0, a, b = -b, (None if a is None else a + b), 0
        window = (-1 if a is None else a, -1 if b is None else b)

    def operand(x, s):
        x = x[..., c0:, :] if c0 else x
        if s is None:
            return x
        return (x, (s[..., c0:, :] if c0 else s)[..., 0])
    if m is not None:
        if r0 and m.shape[-2] != 1:
            m = m[..., r0:, :]
        if c0 and m.shape[-1] != 1:
            m = m[..., c0:]
    out, _, lse = _attention(q[..., r0:, :] if r0 else q, operand(k, ks), operand(v, vs), m,
                             False, scale, gqa, False, True, num_threads, parse_window(window),
                             parse_softcap(softcap), precision, compute_out=True, lse_f64=True)
    if r0:
        full = np.zeros(out.shape[:-2] + (n, out.shape[-1]), dtype=out.dtype)
        full_lse = np.full(lse.shape[:-1] + (n,), -np.inf, dtype=lse.dtype)
        full[..., r0:, :] = out
        full_lse[..., r0:] = lse
        out, lse = full, full_lse
    return out, lse


def _merge_partials(parts: list) -> tuple[np.ndarray, np.ndarray]:
    return merge_attention([p[0] for p in parts], [p[1] for p in parts])


# (dtypes travel in the graph as numpy.dtype objects: the ``.str`` of
# ml_dtypes' bfloat16 is '<V2', raw void)
def _finish(part: tuple[np.ndarray, np.ndarray], n: int, dt: np.dtype) -> np.ndarray:
    """Item ``n`` of a merged partial (0 the output, 1 the lse) as ``dt``."""
    x, dt = part[n], np.dtype(dt)
    with np.errstate(over="ignore"):  # an lse beyond float32: +-inf, as in memory
        return x if x.dtype == dt else x.astype(dt)


def _full(shape: tuple[int, ...], fill: float, dt: np.dtype) -> np.ndarray:
    return np.full(shape, fill, dtype=np.dtype(dt))


# --------------------------------------------------------------------------
# scaled_dot_product_attention: arguments
# --------------------------------------------------------------------------
def _stand_in(x: Any, name: str, optional: bool = False) -> np.ndarray:
    """attncore._call.stand_in of the dask or NumPy array ``x`` (anything
    else: TypeError; dask chunks of unknown size: ValueError)."""
    if _kind(x, name, optional) == "dask":
        _check_known(x, name)
    return _call.stand_in(x.shape, x.dtype)


def _operand(x: Any, name: str) -> tuple[Any, Any, Any]:
    """(array, scales or None, stand-in) of ``key`` / ``value``: an array,
    or the ``(int8 array, scales)`` pair of :func:`attncore.quantize_kv`
    (each part a dask or a NumPy array; the stand-in a pair then)."""
    if isinstance(x, (tuple, list)) and len(x) == 2:
        data, scales = x
        pair = (_stand_in(data, name), _stand_in(scales, f"{name} scales"))
        if pair[0].dtype != np.int8 and pair[1].shape != pair[0].shape[:-1]:
            _kind(x, name)  # no quantized pair (nor one array): TypeError
        return data, scales, pair
    return x, None, _stand_in(x, name)


class _Operands(NamedTuple):
    """The operands by role (None: absent); dask arrays chunked
    consistently after :func:`_aligned`."""

    q: Any
    k: Any
    v: Any
    m: Any
    ks: Any     #: scales of an int8 key; (..., M, 1) once a dask array
    vs: Any     #: likewise of an int8 value


def _checked(query: Any, key: Any, value: Any, attn_mask: Any, opts: tuple
             ) -> tuple[_call.Checked, _Operands]:
    """The in-memory call's checks (attncore._call.check, with the options
    ``opts`` after the mask) on stand-ins of the operands, and the operands
    (the parts of int8 pairs apart)."""
    q_s = _stand_in(query, "query")
    kdata, kscales, k_s = _operand(key, "key")
    vdata, vscales, v_s = _operand(value, "value")
    m_s = None if attn_mask is None else _stand_in(attn_mask, "attn_mask", True)
    chk = _call.check(q_s, k_s, v_s, m_s, *opts)
    m = attn_mask
    if m is not None and m.ndim < 2:
        m = m[(None,) * (2 - m.ndim)]
    return chk, _Operands(query, kdata, vdata, m, kscales, vscales)


def _first_dask_chunks(cands: list[tuple[Any, int, int]]) -> tuple[int, ...] | None:
    """The chunks along ``ax`` of the first dask array ``x`` of the
    candidates ``(x, ax, size)`` that is not broadcast along it."""
    for x, ax, size in cands:
        if isinstance(x, da.Array) and x.shape[ax] == size and size != 1:
            return x.chunks[ax]
    return None


def _as_dask(ops: _Operands, N: int, M: int) -> _Operands:
    """Every operand as a dask array: a NumPy one wrapped with the chunks of
    its dask partners along N and M (scales laid out like their array, as
    (..., M, 1))."""
    n_chunks = _first_dask_chunks([(ops.q, -2, N), (ops.m, -2, N)])
    m_chunks = _first_dask_chunks([(ops.k, -2, M), (ops.v, -2, M), (ops.ks, -1, M),
                                   (ops.vs, -1, M), (ops.m, -1, M)])
    axes = {"q": {-2: n_chunks}, "m": {-2: n_chunks, -1: m_chunks}}
    out = []
    for nm, x in zip(_Operands._fields, ops):
        if x is not None and nm in ("ks", "vs"):
            x = x[..., None]
        if isinstance(x, np.ndarray):
            x = _wrap(x, {a: c for a, c in axes.get(nm, {-2: m_chunks}).items() if c is not None})
        elif x is not None:
            # an axis of size 1 in one chunk: it broadcasts, and its blocks
            # are addressed as block 0 (chunks such as (0, 1), which
            # compute_chunk_sizes gives after boolean indexing, put the
            # element in block 1)
            one = {a: 1 for a, (s, c) in enumerate(zip(x.shape, x.chunks))
                   if s == 1 and len(c) > 1}
            x = x.rechunk(one) if one else x
        out.append(x)
    return _Operands(*out)


def _aligned(ops: _Operands, N: int, M: int) -> _Operands:
    """The last axes (D, Dv) in one chunk each -- D is contracted, Dv is a
    row of the output -- and the key / query axes chunked alike across the
    operands (the scales rechunked like their array; others: ValueError)."""
    q, k, v = (x if len(x.chunks[-1]) == 1 else x.rechunk({x.ndim - 1: -1})
               for x in (ops.q, ops.k, ops.v))
    if v.chunks[-2] != k.chunks[-2]:
        raise ValueError(
            f"value must be chunked like key along the key axis (-2): key chunks {k.chunks[-2]}, "
            f"value chunks {v.chunks[-2]}; rechunk one of them")
    kss, vss = ((s if s is None or s.chunks[:-1] == a.chunks[:-1]
                 else s.rechunk(a.chunks[:-1] + ((1,),)))
                for s, a in ((ops.ks, k), (ops.vs, v)))
    dm = ops.m
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
    return _Operands(q, k, v, dm, kss, vss)


def _unified(ops: _Operands, bshape: tuple[int, ...], gq: int
             ) -> tuple[_Operands, list[tuple[int, ...]]]:
    """The operands brought to one rank, their batch axes unified
    (:func:`_unify_batch`; ``gq`` query heads per key / value head): (the
    operands, the output's chunks of the batch axes)."""
    L = len(bshape) + 2
    head_scale = (1, gq, gq, 1, gq, gq)
    present = [n for n, a in enumerate(ops) if a is not None]
    arrs = [ops[n][(None,) * (L - ops[n].ndim)] if ops[n].ndim < L else ops[n] for n in present]
    arrs, out_batch_chunks = _unify_batch(arrs, bshape, [head_scale[n] for n in present])
    new = list(ops)
    for n, a in zip(present, arrs):
        new[n] = a
    return _Operands(*new), out_batch_chunks


class _Band(NamedTuple):
    """The keys query i may see, over the whole arrays: ``i + lo <= j <=
    i + hi`` (None: unbounded) -- the causal diagonal and the window."""

    lo: int | None
    hi: int | None

    def live(self, i0: int, i1: int, j0: int, j1: int) -> bool:
        """Whether some query of [i0, i1) sees some key of [j0, j1)."""
        # each row's keys form an interval moving right by one per row, so
        # the rows' intervals together cover [i0 + lo, i1 - 1 + hi]
        return ((self.lo is None or i0 + self.lo <= j1 - 1)
                and (self.hi is None or i1 - 1 + self.hi >= j0))

    def block(self, i0: int, i1: int, j0: int, j1: int) -> tuple[int | None, int | None] | None:
        """The band in the block's coordinates, ``(a, b)`` of
        :func:`_block_partial`; None when every query sees every key."""
        if ((self.lo is None or i1 - 1 + self.lo <= j0)
                and (self.hi is None or i0 + self.hi >= j1 - 1)):
            return None
        shift = i0 - j0
        return (None if self.lo is None else -(shift + self.lo),
                None if self.hi is None else shift + self.hi)


def _band(causal: int, window: tuple[int, int], N: int, M: int) -> _Band | None:
    """The core's causal and window rules as one band (None: no band)."""
    left, right = window
    if not causal and left == -1 and right == -1:
        return None
    off = M - N if causal == 2 else 0
    hi = None if right == -1 else right
    if causal:
        hi = 0 if hi is None else min(hi, 0)
    return _Band(None if left == -1 else off - left, None if hi is None else off + hi)


# --------------------------------------------------------------------------
# scaled_dot_product_attention: the graph
# --------------------------------------------------------------------------
def _live_blocks(mask_np: np.ndarray | None, dm: da.Array | None) -> np.ndarray | None:
    """Per block of the (dask) mask ``dm``: whether its NumPy original
    ``mask_np`` lets any query see any key there (None: no NumPy mask)."""
    if mask_np is None or dm is None:
        return None
    mask_np = mask_np.reshape((1,) * (dm.ndim - mask_np.ndim) + mask_np.shape)
    allowed = mask_np if mask_np.dtype == np.bool_ else (mask_np != -np.inf)
    live = np.zeros(dm.numblocks, dtype=bool)
    bnds = [_boundaries(c) for c in dm.chunks]
    for idx in np.ndindex(*dm.numblocks):
        sl = tuple(slice(b[i], b[i + 1]) for b, i in zip(bnds, idx))
        live[idx] = bool(allowed[sl].any())
    return live


def _block_key(a: da.Array, idx: tuple[int, ...]) -> tuple:
    """The key of block ``idx`` of the output's grid in ``a`` (axes of one
    block, broadcast or not, take block 0)."""
    return (a.name,) + tuple(b if n > 1 else 0 for n, b in zip(a.numblocks, idx))


class _Graph(NamedTuple):
    """What the tasks of one call share."""

    name: str                    #: of the output; the lse's is ``lname``
    lname: str
    qb: list[int]                #: query chunk boundaries
    kb: list[int]                #: key chunk boundaries
    band: _Band | None
    live: np.ndarray | None      #: per mask block (a NumPy mask): any key seen
    se: int                      #: split_every
    task_args: tuple             #: _block_partial's (scale, gqa, softcap, threads, precision)
    rdt: np.dtype
    ldt: np.dtype
    Dv: int


def _partials(dsk: dict, g: _Graph, ops: _Operands, bidx: tuple[int, ...], i: int) -> list:
    """The partial tasks of query chunk ``i`` of batch block ``bidx``, one
    per key chunk with something to attend; returns their keys."""
    i0, i1 = g.qb[i], g.qb[i + 1]
    parts = []
    for j in range(len(g.kb) - 1):
        j0, j1 = g.kb[j], g.kb[j + 1]
        if i1 == i0 or j1 == j0 or (g.band is not None and not g.band.live(i0, i1, j0, j1)):
            continue                       # outside every row's band: no task
        mkey = None if ops.m is None else _block_key(ops.m, bidx + (i, j))
        if mkey is not None and g.live is not None and not g.live[mkey[1:]]:
            continue
        kv = [None if a is None else _block_key(a, bidx + (j, 0))
              for a in (ops.k, ops.ks, ops.v, ops.vs)]
        key_ = (f"{g.name}-partial",) + bidx + (i, j)
        dsk[key_] = (_block_partial, _block_key(ops.q, bidx + (i, 0)), *kv, mkey,
                     None if g.band is None else g.band.block(i0, i1, j0, j1), *g.task_args)
        parts.append(key_)
    return parts


def _merged(dsk: dict, g: _Graph, parts: list, tail: tuple[int, ...]) -> Any:
    """Merge tasks combining ``parts`` ``split_every`` at a time, as a tree;
    returns the key of the last one (or the one part)."""
    level, depth, se = parts, 0, g.se
    while len(level) > 1:
        nxt = []
        for n in range(0, len(level), se):
            grp = level[n:n + se]
            if len(grp) == 1:
                nxt.append(grp[0])
                continue
            ck = (f"{g.name}-merge", depth) + tail + (n // se,)
            dsk[ck] = (_merge_partials, list(grp))
            nxt.append(ck)
        level, depth = nxt, depth + 1
    return level[0]


def _graph(g: _Graph, ops: _Operands, out_batch_chunks: list[tuple[int, ...]]) -> dict:
    """The tasks of the output and lse blocks."""
    dsk: dict = {}
    for bidx in itertools.product(*[range(len(c)) for c in out_batch_chunks]):
        bsizes = tuple(out_batch_chunks[ax][b] for ax, b in enumerate(bidx))
        for i in range(len(g.qb) - 1):
            okey, lkey = (g.name,) + bidx + (i, 0), (g.lname,) + bidx + (i,)
            parts = _partials(dsk, g, ops, bidx, i)
            rows = bsizes + (g.qb[i + 1] - g.qb[i],)
            if not parts:
                dsk[okey] = (_full, rows + (g.Dv,), 0.0, g.rdt)
                dsk[lkey] = (_full, rows, -np.inf, g.ldt)
                continue
            top = _merged(dsk, g, parts, bidx + (i,))
            dsk[okey] = (_finish, top, 0, g.rdt)
            dsk[lkey] = (_finish, top, 1, g.ldt)
    return dsk


def _array(dsk: dict, name: str, other: str, deps: _Operands, chunks: tuple, dt: np.dtype
           ) -> da.Array:
    """The dask array ``name`` of the graph ``dsk`` (less the tasks of the
    array ``other``)."""
    layer = {key: t for key, t in dsk.items() if key[0] != other}
    graph = HighLevelGraph.from_collections(name, layer, dependencies=[a for a in deps if a is not None])
    return da.Array(graph, name, chunks=chunks, dtype=dt, meta=np.empty((0,) * len(chunks), dtype=dt))


# --------------------------------------------------------------------------
# scaled_dot_product_attention
# --------------------------------------------------------------------------
def scaled_dot_product_attention(
    query: Any, key: Any, value: Any, attn_mask: Any = None, *,
    is_causal: bool | Literal["upper_left", "lower_right"] = False, scale: float | None = None,
    enable_gqa: bool = False, return_lse: bool = False, window: tuple[int, int] | None = None,
    softcap: float | None = None, num_threads: int | None = None,
    precision: Literal["float32", "bfloat16", "int8"] | None = None,
    split_every: int | None = None,
) -> Any:
    """Scaled dot-product attention on dask arrays, key chunks merged exactly.

    The computation of :func:`attncore.scaled_dot_product_attention` -- the
    same arguments except ``return_weights`` (an N x M array is what this
    module avoids), ``alibi_slopes`` and ``sinks`` (not supported here: a
    key chunk's partial result cannot carry them), plus ``split_every``; the same masks, causal alignments,
    sliding windows, soft-capping, int8 keys / values, grouped-query heads,
    dtype rules and errors (the core's own argument checks run on the
    arrays' shapes and dtypes) -- run as a Dask graph: lazily, chunk by
    chunk.

    Parameters
    ----------
    query : dask.array.Array or numpy.ndarray, shape (..., N, D)
    key : dask.array.Array or numpy.ndarray, shape (..., M, D), or a pair
    value : dask.array.Array or numpy.ndarray, shape (..., M, Dv), or a pair
        float16, float32 or float64; ``key`` and ``value`` may also be the
        ``(int8 array, float scales (..., M))`` pair of
        :func:`attncore.quantize_kv` (each part a dask or a NumPy array;
        the scales are chunked like their array).  Leading (batch, head)
        dimensions broadcast by NumPy rules and may be chunked any way:
        their chunks are unified (rechunked to the common refinement).  The
        query axis (N) of ``query`` and the key axis (M) of ``key`` /
        ``value`` may be chunked any way; ``value`` must be chunked like
        ``key`` along M.  The last axes (D, Dv) are brought to one chunk.  A
        NumPy operand is wrapped with the chunks of its dask partners along
        N and M (one chunk per axis when it has none).
    attn_mask : dask.array.Array or numpy.ndarray, optional
        bool (True = attend) or float (added to the scaled scores),
        broadcastable to (..., N, M), e.g. key padding (B, 1, 1, M); never
        expanded.  Along N it must be chunked like ``query``, along M like
        ``key`` (a NumPy mask is wrapped that way).  With a NumPy mask,
        (query chunk, key chunk) pairs it masks out entirely create no task.
    is_causal : bool or {'upper_left', 'lower_right'}, default False
        ``True`` / ``'upper_left'``: query i attends to keys j <= i;
        ``'lower_right'``: to keys j <= i + M - N.  Positions are absolute
        (over the whole arrays, not per chunk).
    scale : float, optional
        Factor on ``Q K^T``; default ``1 / sqrt(D)``.
    enable_gqa : bool, default False
        Grouped-query attention: key / value heads (axis -3) Hk dividing the
        query heads Hq; a chunk of query heads then covers whole groups.
    return_lse : bool, default False
        Also return the log-sum-exp of each query row, shape (..., N), in
        the compute dtype, as the core does.
    window : (int, int), optional
        Sliding window ``(left, right)`` over absolute positions, the core's
        convention (``-1``: unbounded on that side; it follows the causal
        alignment).  A (query chunk, key chunk) pair outside every row's
        band creates no task, as one above the causal diagonal does.
    softcap : float, optional
        Logit soft-capping, ``softcap * tanh(score / softcap)``, as the core.
    num_threads : int, optional
        OpenMP threads of each task's core call, with the core's meaning:
        ``None`` (default) OpenMP's default *on the worker* (``distributed``
        workers start with ``OMP_NUM_THREADS=1``; under Dask's threaded
        scheduler every task would use all cores: pass 1 there), ``-1`` all
        cores, ``k >= 1`` k threads.  Keep ``workers x threads per worker x
        num_threads`` at or below the cores.
    precision : {None, 'float32', 'bfloat16', 'int8'}, optional
        The dot products' precision, as the core (each block is computed
        in the compute dtype).
    split_every : int, optional
        How many partial results one merge task combines (the fan-in of the
        tree reduction over key chunks); default Dask's ``split_every``
        setting, else 4.

    Returns
    -------
    out : dask.array.Array, shape (..., N, Dv)
        Lazy; chunked like the (unified) batch axes and the query axis, one
        chunk along Dv.  In the result dtype of the in-memory call.
        ``.compute()`` equals it to float rounding -- except for a row
        whose every key is masked by a huge finite additive value (such as
        ``numpy.finfo(dtype).min``, or -1e30 in float64) split over several
        key chunks: each chunk's lse then rounds to the mask value, the
        log of its key count lost, so the chunks are merged with equal
        weights instead of weights by their sizes.  Masks of -inf or
        booleans are exact.  Each chunk's lse is rounded to the compute
        dtype before the merge, so rows whose scores are nearly exact and
        large in magnitude (about 1e4 in float32, 1e12 in float64) carry a
        relative error of about the lse's magnitude times the dtype's
        epsilon that the in-memory call does not have.
    lse : dask.array.Array, shape (..., N)
        Only with ``return_lse=True``; chunked like ``out`` without its
        last axis.

    Raises
    ------
    TypeError
        An operand that is neither a dask nor a NumPy array (nor, for key
        and value, such a pair), or of a wrong dtype; bad option types.
    ValueError
        Shapes that do not match or broadcast; bad option values; chunks
        that cannot be unified (unknown sizes) or that disagree along the
        key / query axis (``value`` vs ``key``, ``attn_mask`` vs ``key`` /
        ``query``).

    Notes
    -----
    * Memory of one task: a query chunk (Nc x D), one key and value chunk
      (Mc x (D + Dv), a quarter of that in int8), the mask chunk, and the
      partial result (Nc x Dv plus Nc log-sum-exps) per batch block; a
      merge task holds ``split_every`` partials.  Nothing of size N x M
      exists.
    * A query row with nothing to attend (masked, outside its window, or
      before the first key under ``'lower_right'`` with N > M) gives 0 and
      lse -inf; NaN in attended inputs propagates, as in the in-memory call.
    """
    enable_gqa = parse_bool(enable_gqa, "enable_gqa")
    return_lse = parse_bool(return_lse, "return_lse")
    win = parse_window(window)
    chk, ops = _checked(query, key, value, attn_mask,
                        (is_causal, scale, enable_gqa, False, return_lse, num_threads, win,
                         parse_softcap(softcap), precision))
    se = _parse_split_every(split_every)
    cap = chk.softcap or None
    N, M, Dv = chk.q.shape[-2], chk.k.shape[-2], chk.v.shape[-1]
    bshape, cdt, rdt = chk.bshape, chk.pol.compute, chk.pol.result
    ldt = cdt  # the core's log-sum-exp dtype
    dv_dummy = Dv == 0 and return_lse and N > 0 and M > 0 and math.prod(bshape) > 0
    if dv_dummy:
        # the lse is defined without value columns: run with one zero column
        # (of value's dtype, as the core's own dummy column)
        ops = ops._replace(v=np.broadcast_to(np.zeros((), chk.v.dtype), chk.v.shape[:-1] + (1,)),
                           vs=None)
    mask_np = ops.m if isinstance(ops.m, np.ndarray) else None
    gq = chk.group if enable_gqa and chk.group > 1 else 1
    dops, out_batch_chunks = _unified(_aligned(_as_dask(ops, N, M), N, M), tuple(bshape), gq)
    q, k, v, dm, kss, vss = dops
    token = tokenize(q, k, v, dm, kss, vss, chk.causal, chk.scale, enable_gqa, win, cap,
                     num_threads, se, return_lse, str(cdt), str(rdt), precision)
    out_shape = tuple(bshape) + (N, v.shape[-1])
    lse_chunks = tuple(out_batch_chunks) + (q.chunks[-2],)
    if 0 in out_shape or M == 0:
        out = da.zeros(out_shape, chunks=lse_chunks + ((v.shape[-1],),), dtype=rdt)
        lse = da.full(out_shape[:-1], -np.inf, chunks=lse_chunks, dtype=ldt)
    else:
        g = _Graph(f"attncore-sdpa-{token}", f"attncore-sdpa-lse-{token}",
                   _boundaries(q.chunks[-2]), _boundaries(k.chunks[-2]),
                   _band(chk.causal, win, N, M), _live_blocks(mask_np, dm), se,
                   (chk.scale, enable_gqa, cap, num_threads,
                    None if precision is None else str(precision)),
                   np.dtype(rdt), np.dtype(ldt), v.shape[-1])
        dsk = _graph(g, dops, out_batch_chunks)
        out = _array(dsk, g.name, g.lname, dops, lse_chunks + ((v.shape[-1],),), g.rdt)
        lse = _array(dsk, g.lname, g.name, dops, lse_chunks, g.ldt) if return_lse else out
    if dv_dummy:
        out = out[..., :0]
    return (out, lse) if return_lse else out


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


def _batched(arrays: tuple, kwargs: dict[str, Any]
             ) -> tuple[list[tuple[str | None, Any]], dict[str, Any], list[str]]:
    """(the batched arguments as (keyword or None, array), the constant
    keyword arguments, the batched arguments' labels in errors); checks
    that every batched array has one batch length."""
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
    return batched, static, labels


def _batch_chunked(batched: list[tuple[str | None, Any]], labels: list[str]
                   ) -> tuple[list[da.Array], tuple[int, ...]]:
    """(the batched arrays as dask arrays chunked alike along the batch axis,
    one chunk along every other; the batch chunks)."""
    B = batched[0][1].shape[0]
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
    return darrs, bchunks


def _probe(fn: Callable[..., Any], static: dict[str, Any], arg_names: tuple,
           darrs: list[da.Array]) -> tuple[list[Any], bool]:
    """The structure of ``fn``'s result, from one batch element of zeros:
    (its outputs, None where ``fn`` returns None; whether it is a tuple /
    list)."""
    probe_args = [np.zeros((1,) + x.shape[1:], dtype=x.dtype) for x in darrs]
    with np.errstate(all="ignore"):
        res = _apply_batch(_Bound(fn, static), arg_names, *probe_args)
    if isinstance(res, (tuple, list)):
        return [None if r is None else _take(res, n, 1) for n, r in enumerate(res)], True
    return [_take(res, -1, 1)], False


def _output(dsk: dict, o: np.ndarray, n: int, oname: str, tname: str,
            bchunks: tuple[int, ...], deps: list[Any]) -> da.Array:
    """Output ``n`` (-1: the one output) of the batch tasks ``tname`` of the
    graph ``dsk``, shaped like ``o`` (its value on one batch element)."""
    odsk: dict = {}
    for b in range(len(bchunks)):
        odsk[(oname, b) + (0,) * (o.ndim - 1)] = (_take, (tname, b), n, bchunks[b])
    graph = HighLevelGraph.from_collections(oname, {**dsk, **odsk}, dependencies=deps)
    chunks = (bchunks,) + tuple((s,) for s in o.shape[1:])
    return da.Array(graph, oname, chunks=chunks, dtype=o.dtype,
                    meta=np.empty((0,) * o.ndim, dtype=o.dtype))


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
    batched, static, labels = _batched(arrays, kwargs)
    darrs, bchunks = _batch_chunked(batched, labels)
    arg_names = tuple(nm for nm, _ in batched)
    outs, multi = _probe(fn, static, arg_names, darrs)
    token = tokenize(fn, static, [x.name for x in darrs], list(arg_names))
    fname = f"attncore-map-batches-fn-{token}"
    tname = f"attncore-map-batches-{token}"
    dsk: dict = {fname: _Bound(fn, static)}
    for b in range(len(bchunks)):
        dsk[(tname, b)] = (_apply_batch, fname, arg_names,
                           *[(x.name, b) + (0,) * (x.ndim - 1) for x in darrs])
    results = [None if o is None else
               _output(dsk, o, n if multi else -1, f"attncore-map-batches-out{n}-{token}", tname,
                       bchunks, list(darrs)) for n, o in enumerate(outs)]
    return tuple(results) if multi else results[0]
