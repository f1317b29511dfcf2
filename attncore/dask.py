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

import dask
import dask.array as da
from dask.base import tokenize
from dask.highlevelgraph import HighLevelGraph

from .functional import _attention, merge_attention
from ._quant import split_quantized
from ._threads import resolve_num_threads
from ._dtypes import resolve
from ._validation import (as_float_array, batch_shape, check_mask, check_operands,
                          parse_bool, parse_causal, parse_scale, parse_softcap, parse_window)

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
                             parse_softcap(softcap), precision, compute_out=True)
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
def _finish(part: tuple[np.ndarray, np.ndarray], rdt: np.dtype) -> np.ndarray:
    return _cast(part[0], np.dtype(rdt))


def _finish_lse(part: tuple[np.ndarray, np.ndarray], ldt: np.dtype) -> np.ndarray:
    return _cast(part[1], np.dtype(ldt))


def _zeros(shape: tuple[int, ...], rdt: np.dtype) -> np.ndarray:
    return np.zeros(shape, dtype=np.dtype(rdt))


def _neg_inf(shape: tuple[int, ...], ldt: np.dtype) -> np.ndarray:
    return np.full(shape, -np.inf, dtype=np.dtype(ldt))


# --------------------------------------------------------------------------
# scaled_dot_product_attention: arguments
# --------------------------------------------------------------------------
def _standin(x: Any) -> np.ndarray:
    """A NumPy array of ``x``'s shape and dtype whose memory is one element:
    the core's own checks run on it as on ``x``, without computing ``x``."""
    dt = np.dtype(x.dtype)
    return np.broadcast_to(np.zeros((), dt if dt.isnative else dt.newbyteorder("=")), x.shape)


def _operand(x: Any, name: str) -> tuple[Any, Any]:
    """(array, scales or None) of ``key`` / ``value``: an array, or the
    ``(int8 array, scales)`` pair of :func:`attncore.quantize_kv`; each part
    a dask or a NumPy array (the core's checks run on stand-ins)."""
    if isinstance(x, (tuple, list)) and len(x) == 2:
        data, scales = x
        for part, nm in ((data, name), (scales, f"{name} scales")):
            if _kind(part, nm) == "dask":
                _check_known(part, nm)
        split_quantized((_standin(data), _standin(scales)), name)
        return data, scales
    if _kind(x, name) == "dask":
        _check_known(x, name)
    split_quantized(_standin(x), name)          # a bare int8 array: an error
    return x, None


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
    return_lse: bool = False,
    window: tuple[int, int] | None = None,
    softcap: float | None = None,
    num_threads: int | None = None,
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
        ``.compute()`` equals it to float rounding.
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
    # ---- the core's checks, on stand-ins of the operands ----
    if _kind(query, "query") == "dask":
        _check_known(query, "query")
    kdata, kscales = _operand(key, "key")
    vdata, vscales = _operand(value, "value")
    if attn_mask is not None and _kind(attn_mask, "attn_mask", True) == "dask":
        _check_known(attn_mask, "attn_mask")
    q_s = _standin(query)
    k_s, v_s = _standin(kdata), _standin(vdata)
    if kscales is not None or vscales is not None:
        # int8 takes no part in the checks' dtype rules (as in the core)
        qdt = as_float_array(q_s, "query").dtype
        if kscales is not None:
            k_s = np.broadcast_to(np.zeros((), qdt), kdata.shape)
        if vscales is not None:
            v_s = np.broadcast_to(np.zeros((), qdt), vdata.shape)
    q_s, k_s, v_s = check_operands(q_s, k_s, v_s)
    N, D = q_s.shape[-2], q_s.shape[-1]
    M, Dv = k_s.shape[-2], v_s.shape[-1]
    m_s, _ = check_mask(None if attn_mask is None else _standin(attn_mask), N, M)
    causal = parse_causal(is_causal)
    sc = parse_scale(scale, D)
    enable_gqa = parse_bool(enable_gqa, "enable_gqa")
    return_lse = parse_bool(return_lse, "return_lse")
    win = parse_window(window)
    cap = parse_softcap(softcap) or None
    resolve_num_threads(num_threads)  # validates; each task resolves it on its worker
    se = _parse_split_every(split_every)
    bshape, group = batch_shape(q_s, k_s, v_s, m_s, enable_gqa)
    pol = resolve((q_s.dtype, k_s.dtype, v_s.dtype), ("query", "key", "value"), precision)
    cdt, rdt = pol.compute, pol.result
    pol_prec = None if precision is None else str(precision)
    ldt = cdt  # the core's log-sum-exp dtype
    m = attn_mask
    if m is not None and m.ndim < 2:
        m = m[(None,) * (2 - m.ndim)]
    dv_dummy = Dv == 0 and return_lse and N > 0 and M > 0 and math.prod(bshape) > 0
    if dv_dummy:
        # the lse is defined without value columns: run with one zero column
        # (of value's dtype, as the core's own dummy column)
        vdata, vscales = np.broadcast_to(np.zeros((), v_s.dtype), vdata.shape[:-1] + (1,)), None

    # ---- every operand as a dask array, chunked consistently ----
    def first_dask_chunks(cands):
        for x, ax, size in cands:
            if isinstance(x, da.Array) and x.shape[ax] == size and size != 1:
                return x.chunks[ax]
        return None

    n_chunks = first_dask_chunks([(query, -2, N)] + ([(m, -2, N)] if m is not None else []))
    m_cands = [(kdata, -2, M), (vdata, -2, M)]
    m_cands += [(s, -1, M) for s in (kscales, vscales) if s is not None]
    m_cands += [(m, -1, M)] if m is not None else []
    m_chunks = first_dask_chunks(m_cands)
    mask_np = m if isinstance(m, np.ndarray) else None
    ops: dict[str, Any] = {}
    for nm, x in (("query", query), ("key", kdata), ("value", vdata), ("attn_mask", m),
                  ("key scales", kscales), ("value scales", vscales)):
        if x is None:
            continue
        if nm.endswith("scales"):
            x = x[..., None]                 # (..., M, 1): laid out like its array
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
    # the scales follow their array (they are small: rechunked, not refused)
    kss, vss = ops.get("key scales"), ops.get("value scales")
    if kss is not None and kss.chunks[:-1] != k.chunks[:-1]:
        kss = kss.rechunk(k.chunks[:-1] + ((1,),))
    if vss is not None and vss.chunks[:-1] != v.chunks[:-1]:
        vss = vss.rechunk(v.chunks[:-1] + ((1,),))
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
    gq = group if enable_gqa and group > 1 else 1
    named = [("q", q, 1), ("k", k, gq), ("v", v, gq), ("m", dm, 1), ("ks", kss, gq),
             ("vs", vss, gq)]
    named = [(nm, a, s) for nm, a, s in named if a is not None]
    arrs = [a[(None,) * (L - a.ndim)] if a.ndim < L else a for _, a, _ in named]
    if mask_np is not None:
        mask_np = mask_np.reshape((1,) * (L - mask_np.ndim) + mask_np.shape)
    arrs, out_batch_chunks = _unify_batch(arrs, tuple(bshape), [s for _, _, s in named])
    unified = {nm: a for (nm, _, _), a in zip(named, arrs)}
    q, k, v = unified["q"], unified["k"], unified["v"]
    dm, kss, vss = unified.get("m"), unified.get("ks"), unified.get("vs")

    out_chunks = tuple(out_batch_chunks) + (q.chunks[-2], (v.shape[-1],))
    out_shape = tuple(bshape) + (N, v.shape[-1])
    lse_chunks = tuple(out_batch_chunks) + (q.chunks[-2],)
    token = tokenize(q, k, v, dm, kss, vss, causal, sc, enable_gqa, win, cap, num_threads, se,
                     return_lse, str(cdt), str(rdt), precision)
    name = f"attncore-sdpa-{token}"
    lname = f"attncore-sdpa-lse-{token}"

    def results(out: da.Array, lse: da.Array) -> Any:
        if dv_dummy:
            out = out[..., :0]
        return (out, lse) if return_lse else out

    if 0 in out_shape or M == 0:
        return results(da.zeros(out_shape, chunks=out_chunks, dtype=rdt),
                       da.full(out_shape[:-1], -np.inf, chunks=lse_chunks, dtype=ldt))

    # ---- structure known now: causal diagonal and window, NumPy mask ----
    qb = _boundaries(q.chunks[-2])
    kb = _boundaries(k.chunks[-2])
    band = _band(causal, win, N, M)
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

    def kv_key(a: da.Array | None, bidx: tuple[int, ...], j: int) -> Any:
        if a is None:
            return None
        return (a.name,) + tuple(block_of(a, ax, b) for ax, b in enumerate(bidx)) + (j, 0)

    dsk: dict = {}
    pname, mname = f"{name}-partial", f"{name}-merge"
    nq, nk = len(qb) - 1, len(kb) - 1
    rdt_s, ldt_s = np.dtype(rdt), np.dtype(ldt)
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
                blk = None
                if band is not None:
                    if not band.live(i0, i1, j0, j1):   # outside every row's band: no task
                        continue
                    blk = band.block(i0, i1, j0, j1)
                mkey = None
                if dm is not None:
                    mb = tuple(block_of(dm, ax, b) for ax, b in enumerate(bidx))
                    mb += (i if dm.numblocks[-2] > 1 else 0, j if dm.numblocks[-1] > 1 else 0)
                    if live_mask is not None and not live_mask[mb]:
                        continue
                    mkey = (dm.name,) + mb
                key_ = (pname,) + bidx + (i, j)
                dsk[key_] = (_block_partial, qkey, kv_key(k, bidx, j), kv_key(kss, bidx, j),
                             kv_key(v, bidx, j), kv_key(vss, bidx, j), mkey, blk, sc,
                             enable_gqa, cap, num_threads, pol_prec)
                parts.append(key_)
            okey = (name,) + bidx + (i, 0)
            lkey = (lname,) + bidx + (i,)
            if not parts:
                dsk[okey] = (_zeros, bsizes + (i1 - i0, v.shape[-1]), rdt_s)
                dsk[lkey] = (_neg_inf, bsizes + (i1 - i0,), ldt_s)
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
            dsk[lkey] = (_finish_lse, level[0], ldt_s)
    deps: list[Any] = [a for a in (q, k, v, dm, kss, vss) if a is not None]
    out_keys = {key: t for key, t in dsk.items() if key[0] != lname}
    lse_keys = {key: t for key, t in dsk.items() if key[0] != name}
    out = da.Array(HighLevelGraph.from_collections(name, out_keys, dependencies=deps), name,
                   chunks=out_chunks, dtype=rdt, meta=np.empty((0,) * L, dtype=rdt))
    if not return_lse:
        return results(out, out)
    lse = da.Array(HighLevelGraph.from_collections(lname, lse_keys, dependencies=deps), lname,
                   chunks=lse_chunks, dtype=ldt, meta=np.empty((0,) * (L - 1), dtype=ldt))
    return results(out, lse)


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
