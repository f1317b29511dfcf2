"""Arrays of other libraries in, the same array type out.

Every public function and layer call of attncore is wrapped by
:func:`foreign_arrays`, which

1. lets NumPy arrays, Python scalars, lists and ``None`` through untouched
   (the fast path: a few type checks per call);
2. turns CPU arrays of other libraries into NumPy arrays **without a copy**
   where the layout allows:

   * torch tensors: ``tensor.detach().numpy()`` (shares memory; a tensor
     with ``requires_grad`` is read detached: attncore computes no
     gradients);
   * JAX arrays: ``numpy.asarray`` (a read-only view of the CPU buffer);
   * any other object with ``__dlpack__``: ``numpy.from_dlpack``;
   * bfloat16 (torch, JAX or ``ml_dtypes`` NumPy arrays): functions that
     read half precision natively (``half_native``, e.g.
     :func:`attncore.scaled_dot_product_attention`) get an ``ml_dtypes``
     bfloat16 view (zero-copy); the others get a float32 copy, and so does
     every function when ml_dtypes is not installed;

   and raises ``TypeError`` naming the argument and the device for an array
   on a GPU or any other non-CPU device (no silent transfers);
3. gives the result back as the type of the first array argument (the
   query): a torch tensor (``torch.from_numpy``, zero-copy), a JAX array
   (DLPack, zero-copy where XLA accepts the buffer), an array of the
   query's array-API namespace, or NumPy otherwise.  bfloat16 inputs give
   bfloat16 results where float16 inputs give float16 results.

torch and JAX are never imported here: an input is recognised by the module
of its type, and the library is taken from ``sys.modules`` (it is loaded,
since one of its arrays exists).
"""
from __future__ import annotations

import functools
import sys
import weakref
from typing import Any, Callable, TypeVar, cast

import numpy as np

from ._dtypes import bfloat16_available, is_bf16 as _is_bf16, is_bf16_arg
from ._validation import to_array

__all__ = ["foreign_arrays", "foreign_dtype", "torch_to_numpy", "numpy_to_torch",
           "torch_bits_view", "torch_bits_tensor", "weight_array"]

# argument types that need no conversion (NumPy handles them as before)
_PLAIN = frozenset({type(None), bool, int, float, complex, list, tuple, str})

# DLPack device types whose memory the CPU can read: kDLCPU, kDLCUDAHost (pinned)
_DLPACK_CPU = (1, 3)

_NUMPY, _TORCH, _JAX, _XP = 0, 1, 2, 3


def _plain_dtype(d) -> bool:
    """True for a dtype argument NumPy takes as it is (no torch dtype, no bfloat16)."""
    return d is None or not (type(d).__module__.startswith("torch") or is_bf16_arg(d))


def _kind_of(x) -> int:
    mod = type(x).__module__
    if mod == "torch" or mod.startswith("torch."):
        return _TORCH
    if mod.startswith(("jax.", "jaxlib.")) or mod in ("jax", "jaxlib"):
        return _JAX
    return _XP


_CPU_REMEDY = "pass a CPU array (e.g. tensor.cpu())"


def _device_error(name: str, device, remedy: str = _CPU_REMEDY) -> TypeError:
    return TypeError(
        f"{name} is on device {device!s}; attncore computes on the CPU and never moves data "
        f"between devices: {remedy}")


# --------------------------------------------------------------------------
# views of live tensors, so that one tensor passed twice (e.g. a
# cross-attention memory given again with its KV cache) is one NumPy object
# --------------------------------------------------------------------------
class _ViewMemo:
    """id(tensor) -> (weakref, NumPy view, layout signature), dropped with the tensor."""

    def __init__(self):
        self._d = {}

    def get(self, x, sig):
        e = self._d.get(id(x))
        if e is not None and e[0]() is x and e[2] == sig:
            return e[1]
        return None

    def put(self, x, sig, view):
        key = id(x)
        d = self._d

        def drop(ref):
            e = d.get(key)
            if e is not None and e[0] is ref:
                del d[key]

        try:
            ref = weakref.ref(x, drop)
        except TypeError:  # not weak-referenceable: no memo
            return
        d[key] = (ref, view, sig)


_memo = _ViewMemo()


def torch_to_numpy(t, name, half=True, remedy=_CPU_REMEDY):
    """(NumPy array, was converted from bfloat16) for a CPU torch tensor.

    The one torch -> NumPy conversion of attncore: a view where the layout
    allows (``detach``: attncore computes no gradients); conj / neg views
    are resolved (a copy, never cached: its source may change); bfloat16
    becomes an ``ml_dtypes`` view when ``half`` and ml_dtypes is
    installed, else a float32 copy (flagged, so that the result goes back
    to bfloat16).  ``remedy``: what the error of a tensor on another device
    tells the caller to do.
    """
    torch = sys.modules["torch"]
    dev = t.device
    if dev.type != "cpu":
        raise _device_error(name, dev, remedy)
    if t.layout is not torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
    bf = t.dtype is torch.bfloat16
    if bf and not (half and bfloat16_available()):
        return t.detach().float().numpy(), True
    # _version changes with every in-place write to the tensor's storage
    # through it, so a cached view is never stale
    try:
        version = t._version
    except RuntimeError:  # inference tensors keep no version counter: never cached
        version = None
    sig = (t.data_ptr(), t.shape, t.stride(), t.dtype, version)
    a = _memo.get(t, sig) if version is not None else None
    if a is not None:
        return a, False
    d = t.detach()
    resolved = d.is_conj() or d.is_neg()
    if resolved:
        d = d.resolve_conj().resolve_neg()
    try:
        if bf:
            from ._dtypes import bfloat16_dtype
            a = d.view(torch.int16).numpy().view(bfloat16_dtype())
        else:
            a = d.numpy()
    except (RuntimeError, TypeError) as exc:
        raise TypeError(f"{name}: cannot read this torch tensor as an array ({exc})") from None
    if not resolved and version is not None:
        # a resolved conj / neg view is a copy of a source that may change
        # in place under the same key: never cached
        _memo.put(t, sig, a)
    return a, False


def numpy_to_torch(a, dtype=None):
    """A torch tensor sharing ``a``'s memory (bfloat16 for ml_dtypes
    bfloat16); converted to the torch ``dtype`` where one is given and
    differs."""
    torch = sys.modules["torch"]
    if not a.flags.writeable or any(s < 0 for s in a.strides):
        a = np.array(a)  # torch views only writable arrays with non-negative strides
    if _is_bf16(a.dtype):
        t = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_numpy(a)
    return t if dtype is None or t.dtype is dtype else t.to(dtype)


def torch_bits_view(t, bits):
    """A NumPy view of a CPU tensor of a model's own dtype (float32 /
    float16; bfloat16 as its int16 bits where ``bits``), without
    :func:`torch_to_numpy`'s checks and caching: the Hugging Face lean
    path's conversion, one call per layer and step (RuntimeError /
    TypeError for a tensor it cannot view: the caller takes the general
    path)."""
    if bits:
        t = t.view(sys.modules["torch"].int16)
    try:
        return t.numpy()
    except RuntimeError:    # a tensor that requires grad: its detached view
        return t.detach().numpy()


def torch_bits_tensor(a, bits):
    """A torch tensor viewing the fresh, writable NumPy result ``a``
    (bfloat16 from its int16 bits where ``bits``): the inverse of
    :func:`torch_bits_view`."""
    torch = sys.modules["torch"]
    t = torch.from_numpy(a)
    return t.view(torch.bfloat16) if bits else t


def weight_array(t, name):
    """A torch tensor, Keras variable or array-like as a NumPy array (the
    weight loaders': a tensor on another device is copied to the CPU, as
    weights are loaded once)."""
    if hasattr(t, "detach") and hasattr(t, "cpu"):        # torch.Tensor
        return torch_to_numpy(t.detach().cpu(), name)[0]
    if hasattr(t, "numpy") and not isinstance(t, np.ndarray):   # Keras / TF variable
        try:
            return np.asarray(t.numpy())
        except Exception:  # pragma: no cover - fall back to the array protocol
            pass
    a = to_array(t, name)
    if a.dtype == object:
        raise TypeError(f"{name} must be an array, got {type(t).__name__}")
    return a


def _jax_to_numpy(x, name, half=True):
    """(NumPy array, was bfloat16) for a JAX array on the CPU."""
    devs = getattr(x, "devices", None)
    if devs is not None:
        try:
            devices = devs()
        except Exception:  # a tracer: no concrete buffer
            raise TypeError(
                f"{name} is a traced JAX value (inside jit / vmap / grad); attncore runs on "
                f"concrete CPU arrays, outside JAX transformations") from None
        for d in devices:
            if d.platform != "cpu":
                raise _device_error(name, d)
    deleted = getattr(x, "is_deleted", None)
    if deleted is not None and deleted():
        raise TypeError(f"{name} is a deleted (donated) JAX array")
    a = _memo.get(x, None)
    if a is None:
        try:
            a = np.asarray(x)
        except Exception as exc:
            raise TypeError(f"{name}: cannot read this JAX array ({exc})") from None
        _memo.put(x, None, a)
    if _is_bf16(a.dtype) and not half:
        return a.astype(np.float32), True
    return a, False


def _other_to_numpy(x, name, half=True):
    """(NumPy array or x itself, kind, was bfloat16) for any other object."""
    dl = getattr(type(x), "__dlpack__", None)
    if dl is not None:
        try:
            dev = x.__dlpack_device__()
        except Exception:
            dev = None
        if dev is not None and int(dev[0]) not in _DLPACK_CPU:
            raise _device_error(name, f"{dev!r} (DLPack device type, id)")
        try:
            a = np.from_dlpack(x)
        except Exception:
            a = np.asarray(x) if hasattr(x, "__array__") else None
        if a is not None:
            if _is_bf16(a.dtype) and not half:
                return a.astype(np.float32), _XP, True
            return a, _XP, False
    if hasattr(x, "__array_namespace__") and hasattr(x, "__array__"):
        a = np.asarray(x)
        if _is_bf16(a.dtype) and not half:
            return a.astype(np.float32), _XP, True
        return a, _XP, False
    # anything else (array-likes, NumPy scalars, subclasses): NumPy converts it
    return x, _NUMPY, False


def _to_numpy(x, name, half=False):
    """(converted, kind, was converted from bfloat16).  ``half``: keep
    bfloat16 as bfloat16 (ml_dtypes) where possible."""
    if type(x) in _PLAIN or (isinstance(x, np.generic) and not _is_bf16(x.dtype)):
        return x, _NUMPY, False   # (NumPy scalars stay scalars: np.int64(5) is a length)
    if isinstance(x, np.ndarray):
        if _is_bf16(x.dtype) and not half:
            return x.astype(np.float32), _NUMPY, True
        return x, _NUMPY, False
    kind = _kind_of(x)
    if kind == _TORCH:
        if not hasattr(x, "numpy"):  # torch.dtype, torch.Size, ...: not arrays
            return x, _NUMPY, False
        a, bf = torch_to_numpy(x, name, half)
        return a, _TORCH, bf
    if kind == _JAX:
        a, bf = _jax_to_numpy(x, name, half)
        return a, _JAX, bf
    return _other_to_numpy(x, name, half)


# --------------------------------------------------------------------------
# results back to the caller's array type
# --------------------------------------------------------------------------
def _bf16_numpy_dtype():
    from ._dtypes import bfloat16_dtype
    return bfloat16_dtype("a bfloat16 NumPy result")


def _torch_out(a, bf16):
    torch = sys.modules["torch"]
    t = numpy_to_torch(a)
    return t.to(torch.bfloat16) if bf16 else t


def _jax_out(a, bf16, like):
    if bf16:
        a = a.astype(_bf16_numpy_dtype())
    jax = sys.modules["jax"]
    try:
        if _is_bf16(a.dtype):
            raise TypeError("bfloat16: through jax.numpy")
        return jax.dlpack.from_dlpack(a)
    except Exception:  # layouts XLA does not take as they are: a copy
        return jax.numpy.asarray(a)


def _xp_out(a, bf16, like):
    if bf16:
        a = a.astype(_bf16_numpy_dtype())
    ns = getattr(like, "__array_namespace__", None)
    if ns is None:
        return a
    xp = ns()
    try:
        return xp.from_dlpack(a)
    except Exception:
        return xp.asarray(a)


def _restore(r, kind, bf16, like):
    if isinstance(r, np.ndarray):
        if bf16 and r.dtype != np.float32:
            bf16 = False  # promoted by another input (e.g. float64): keep that dtype
        if kind == _TORCH:
            return _torch_out(r, bf16)
        if kind == _JAX:
            return _jax_out(r, bf16, like)
        if kind == _XP:
            return _xp_out(r, bf16, like)
        return r.astype(_bf16_numpy_dtype()) if bf16 else r
    if type(r) is tuple:
        return tuple(_restore(x, kind, bf16, like) for x in r)
    if kind != _NUMPY and hasattr(r, "_map_arrays"):   # a QuantizedKV: its arrays
        return r._map_arrays(lambda a: _restore(a, kind, False, like))
    return r


# --------------------------------------------------------------------------
# the decorator
# --------------------------------------------------------------------------
_F = TypeVar("_F", bound=Callable[..., Any])


def foreign_arrays(data, masks=(), *, convert_out=True, keep_bf16=True, dtype_arg=None,
                   last_in_compute_dtype=None,
                   half_native=False) -> Callable[[_F], _F]:
    """Wrap a public function so that it takes and returns foreign arrays.

    Parameters
    ----------
    data : tuple of str
        Names of the float array arguments; the first one (the query)
        decides the output type.  bfloat16 results are returned when every
        one of them that is given is bfloat16 (and ``keep_bf16``).
    masks : tuple of str
        Names of further array arguments (masks) converted the same way but
        not deciding the output type or dtype.
    convert_out : bool
        Convert the result (arrays, or arrays in a tuple) to the query's
        array type.
    keep_bf16 : bool
        Return bfloat16 for bfloat16 inputs (False where the function's
        result dtype is fixed, e.g. by a layer's dtype).
    last_in_compute_dtype : str, optional
        A bool keyword: when the call passes it True, the last array of the
        result tuple stays in the compute dtype (float32) for bfloat16
        inputs (the log-sum-exp of ``return_lse``: 3 significant digits
        would spoil merging).
    dtype_arg : str, optional
        An argument that takes a dtype: torch dtypes are accepted there
        (and a torch dtype makes the result a torch tensor when no array
        argument decides), bfloat16 is computed in float32.
    half_native : bool
        The function takes bfloat16 (ml_dtypes) arrays itself and returns
        results in the dtype it chooses: bfloat16 inputs are passed as
        zero-copy ml_dtypes views (float32 copies only when ml_dtypes is
        missing).
    """
    data = tuple(data)
    names = data + tuple(masks)
    first = data[0]

    def deco(fn: _F) -> _F:
        code = fn.__code__
        pos = code.co_varnames[:code.co_argcount]
        slots = tuple((pos.index(n) if n in pos else 1 << 30, n) for n in names)
        dslot = None
        if dtype_arg is not None:
            dslot = (pos.index(dtype_arg) if dtype_arg in pos else 1 << 30, dtype_arg)

        pidx = tuple(i for i, _ in slots if i < 1 << 30)
        nameset = frozenset(names)
        ndarray, plain = np.ndarray, _PLAIN

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            # Fast path: the array arguments are NumPy arrays, scalars, lists
            # or None.  Their dtypes are not looked at here: a bfloat16 NumPy
            # array (ml_dtypes) is rejected by the function with a TypeError,
            # and only then converted (see _has_bf16).
            n = len(args)
            for i in pidx:
                if i < n:
                    t = type(args[i])
                    if t is not ndarray and t not in plain:
                        break
            else:
                for nm in kwargs:
                    if nm in nameset:
                        t = type(kwargs[nm])
                        if t is not ndarray and t not in plain:
                            break
                else:
                    if dslot is None or _plain_dtype(
                            args[dslot[0]] if dslot[0] < n else kwargs.get(dslot[1])):
                        if half_native:
                            return fn(*args, **kwargs)
                        try:
                            return fn(*args, **kwargs)
                        except TypeError:
                            if not _has_bf16(slots, args, kwargs):
                                raise
            return _call(fn, slots, dslot, first, data, convert_out, keep_bf16, args, kwargs,
                         last_in_compute_dtype, half_native)

        return cast(_F, wrapper)  # the signature type checkers see is fn's

    return deco


def _has_bf16(slots, args, kwargs) -> bool:
    """Whether a NumPy array argument is bfloat16 (ml_dtypes)."""
    n = len(args)
    for i, nm in slots:
        x = args[i] if i < n else kwargs.get(nm)
        if isinstance(x, np.ndarray) and _is_bf16(x.dtype):
            return True
    return False


def _call(fn, slots, dslot, first, data, convert_out, keep_bf16, args, kwargs,
          last_in_compute_dtype=None, half_native=False):
    args = list(args)
    n = len(args)
    done = {}                       # id(input) -> converted: one object stays one object
    kind, like, n_bf16, n_data = _NUMPY, None, 0, 0
    for i, nm in slots:
        if i < n:
            x = args[i]
        elif nm in kwargs:
            x = kwargs[nm]
        else:
            continue
        if x is None:
            continue
        hit = done.get(id(x))
        if hit is not None and hit[0] is x:
            a, k, bf = hit[1]
        else:
            a, k, bf = _to_numpy(x, nm, half_native)
            done[id(x)] = (x, (a, k, bf))
        if nm == first:
            kind, like = k, x
        if nm in data:
            n_data += 1
            n_bf16 += bf
        if i < n:
            args[i] = a
        else:
            kwargs[nm] = a
    bf16_out = keep_bf16 and n_bf16 > 0 and n_bf16 == n_data
    if dslot is not None:
        i, nm = dslot
        d = args[i] if i < n else kwargs.get(nm)
        if d is not None:
            nd, from_torch, bf = foreign_dtype(d, nm)
            if bf:
                nd, bf16_out = np.dtype(np.float32), True
            if i < n:
                args[i] = nd
            else:
                kwargs[nm] = nd
            if from_torch and kind == _NUMPY:
                kind = _TORCH
    r = fn(*args, **kwargs)
    if not convert_out:
        return r
    if (bf16_out and last_in_compute_dtype and type(r) is tuple
            and _truthy(kwargs.get(last_in_compute_dtype))):
        return (_restore(r[:-1], kind, bf16_out, like)
                + (_restore(r[-1], kind, False, like),))
    return _restore(r, kind, bf16_out, like)


def _truthy(x) -> bool:
    """A bool keyword's value as the function reads it (True / numpy.True_)."""
    return x is True or (isinstance(x, np.bool_) and bool(x))


def foreign_dtype(d, name="dtype"):
    """``(NumPy dtype, came from torch, is bfloat16)`` for a dtype argument.

    ``d`` may be anything ``numpy.dtype`` takes, a torch dtype, or bfloat16
    (``torch.bfloat16``, ``ml_dtypes.bfloat16``, ``"bfloat16"``), which is
    mapped to float32 (the compute dtype; the caller casts the result).
    Anything else is returned unchanged, for the function to reject.
    """
    if type(d).__module__ == "torch" and type(d).__name__ == "dtype":
        torch = sys.modules["torch"]
        if d is torch.bfloat16:
            return np.dtype(np.float32), True, True
        try:
            return torch.empty((), dtype=d).numpy().dtype, True, False
        except Exception:
            raise TypeError(f"{name}: torch dtype {d} has no NumPy equivalent") from None
    if is_bf16_arg(d):
        return np.dtype(np.float32), False, True
    try:
        return np.dtype(d), False, False
    except TypeError:
        return d, False, False
