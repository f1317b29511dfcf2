"""Name -> alignment class registry with lazy entry-point discovery.

Three sources, in order of precedence:

1. explicit :func:`register` calls (a class or a lazy ``"pkg.mod:Class"``);
2. the built-ins of attncore (lazy strings into ``._builtin``);
3. entry points of the group ``attncore.alignments`` of installed
   distributions.

Nothing happens at import time.  The entry points are scanned (names only,
no plugin module imported) the first time the registry is asked for a name
or a listing, and a plugin is imported only when its name is requested.
``ATTNCORE_DISABLE_PLUGIN_AUTOLOAD=1`` turns the scan off; built-ins and
explicit registrations still work.

Failures stay local: two distributions offering one name give a warning at
discovery and an :class:`AlignmentConflictError` when that name is
requested; a plugin that cannot be imported or is not an
:class:`~attncore.Alignment` gives one warning and an
:class:`AlignmentLoadError` whenever it is requested; every other name keeps
working.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import re
import threading
import warnings

from .._validation import parse_bool
from ._base import Alignment

__all__ = ["register", "get", "create", "available", "refresh",
           "AlignmentNotFoundError", "AlignmentConflictError", "AlignmentLoadError",
           "ENTRY_POINT_GROUP", "DISABLE_ENV"]

ENTRY_POINT_GROUP = "attncore.alignments"
DISABLE_ENV = "ATTNCORE_DISABLE_PLUGIN_AUTOLOAD"

_BUILTIN_MODULE = "attncore.alignments._builtin"
_BUILTINS = {
    "dot": f"{_BUILTIN_MODULE}:Dot",
    "scaled_dot": f"{_BUILTIN_MODULE}:ScaledDot",
    "bilinear": f"{_BUILTIN_MODULE}:Bilinear",
    "general": f"{_BUILTIN_MODULE}:Bilinear",
    "mlp": f"{_BUILTIN_MODULE}:MLP",
    "additive": f"{_BUILTIN_MODULE}:MLP",
    "concat": f"{_BUILTIN_MODULE}:MLP",
}


_TARGET_RE = re.compile(r"^[A-Za-z_][\w.]*\s*:\s*[A-Za-z_][\w.]*$|^[A-Za-z_][\w]*(\.[A-Za-z_]\w*)+$")


class AlignmentNotFoundError(ValueError, LookupError):
    """No alignment of that name (the message lists the available ones)."""


class AlignmentConflictError(ValueError, LookupError):
    """Several installed distributions provide an alignment of that name."""


class AlignmentLoadError(ImportError):
    """A plugin alignment failed to import or is not a valid Alignment."""


_lock = threading.RLock()
_registered: dict = {}     # name -> class or "pkg.mod:Class"
_loaded: dict = {}         # name -> class (resolved lazy targets)
_broken: dict = {}         # name -> message of the load failure
_eps = None                # None until scanned: name -> list of entry points
_scan_problems: dict = {}  # name -> message recorded at discovery


def _autoload_disabled() -> bool:
    return os.environ.get(DISABLE_ENV, "").strip().lower() not in ("", "0", "false", "no")


def _entry_points():
    """The entry points of our group (importlib.metadata, any Python >= 3.9)."""
    from importlib import metadata

    eps = metadata.entry_points()
    if hasattr(eps, "select"):
        return list(eps.select(group=ENTRY_POINT_GROUP))
    return list(eps.get(ENTRY_POINT_GROUP, []))  # Python 3.9


def _dist_name(ep) -> str:
    dist = getattr(ep, "dist", None)
    name = getattr(dist, "name", None) if dist is not None else None
    if not name and dist is not None:
        try:
            name = dist.metadata["Name"]
        except Exception:
            name = None
    return name or "unknown distribution"


def _describe_ep(ep) -> str:
    return f"{_dist_name(ep)} ({ep.value})"


def _scan():
    """Group the entry points by name (once); warn about conflicts."""
    global _eps
    if _eps is not None:
        return _eps
    found: dict = {}
    problems: dict = {}
    if not _autoload_disabled():
        try:
            entries = _entry_points()
        except Exception as exc:  # a broken metadata directory must not break attncore
            warnings.warn(f"attncore: scanning entry points of {ENTRY_POINT_GROUP!r} "
                          f"failed: {exc!r}", RuntimeWarning, stacklevel=3)
            entries = []
        for ep in entries:
            group = found.setdefault(ep.name, [])
            # the same distribution seen twice (e.g. twice on sys.path) is one plugin
            if any(_dist_name(o) == _dist_name(ep) and o.value == ep.value for o in group):
                continue
            group.append(ep)
        for name, group in sorted(found.items()):
            if len(group) > 1:
                who = " and ".join(_describe_ep(ep) for ep in group)
                problems[name] = (f"alignment {name!r} is provided by several installed "
                                  f"distributions: {who}")
                warnings.warn(f"attncore: {problems[name]}; requesting it is an error until "
                              "one is uninstalled (or register the one you want with "
                              "attncore.alignments.register)", RuntimeWarning, stacklevel=3)
            elif name in _BUILTINS and name not in _registered:
                warnings.warn(f"attncore: entry point {name!r} of {_describe_ep(group[0])} "
                              "is shadowed by the built-in alignment of that name and is "
                              "ignored", RuntimeWarning, stacklevel=3)
            elif name in _registered:
                # an explicit registration wins over any entry point of that
                # name: a broken one must not shadow it
                continue
            else:
                mod = group[0].value.split(":")[0].strip()
                top = mod.split(".")[0]
                try:
                    missing = importlib.util.find_spec(top) is None  # imports nothing
                except Exception:
                    missing = False
                if missing:
                    problems[name] = (f"alignment {name!r} from {_describe_ep(group[0])}: "
                                      f"module {top!r} is not installed")
                    _broken[name] = problems[name]
                    warnings.warn(f"attncore: {problems[name]}", RuntimeWarning, stacklevel=3)
    _eps = found
    _scan_problems.clear()
    _scan_problems.update(problems)
    return _eps


def _load_target(target):
    """A class from a class or a "pkg.mod:Class" / "pkg.mod.Class" string."""
    if not isinstance(target, str):
        return target
    if ":" in target:
        mod, _, attr = target.partition(":")
    else:
        mod, _, attr = target.rpartition(".")
    obj = importlib.import_module(mod.strip())
    for part in attr.strip().split("."):
        obj = getattr(obj, part)
    return obj


def _validate_class(obj, what: str):
    if not (isinstance(obj, type) and issubclass(obj, Alignment)):
        raise TypeError(f"{what} must be a subclass of attncore.Alignment, got {obj!r}")
    if obj.score is Alignment.score:
        raise TypeError(f"{what} ({obj.__qualname__}) does not implement score(query, prepared)")
    return obj


def _check_name(name):
    if not isinstance(name, str) or not name.strip():
        raise TypeError(f"alignment name must be a non-empty str, got {name!r}")
    return name


# --------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------
def register(name, obj=None, *, replace=False):
    """Register an alignment class under ``name``.

    Usable as a call, ``register("cosine", Cosine)`` or
    ``register("cosine", "mypkg.align:Cosine")`` (imported on first use), or
    as a class decorator, ``@register("cosine")``.

    Parameters
    ----------
    name : str
        The name :func:`get`, :func:`create` and ``attncore.Attention`` use.
    obj : type or str, optional
        A subclass of :class:`attncore.Alignment`, or a lazy
        ``"package.module:Class"`` string.  Omitted: return a decorator.
    replace : bool, default False
        Allow replacing an earlier registration or a built-in of that name.
        Registering the identical object again is always allowed.  An
        explicit registration takes precedence over an entry point of the
        same name without ``replace``.

    Returns
    -------
    obj, or a decorator returning its argument.

    Raises
    ------
    ValueError
        ``name`` is taken (registered or built-in) and ``replace`` is False.
    TypeError
        ``obj`` is neither an Alignment subclass nor a "module:Class" string.
    """
    _check_name(name)
    replace = parse_bool(replace, "replace")
    if obj is None:
        def decorator(cls):
            register(name, cls, replace=replace)
            return cls
        return decorator
    if isinstance(obj, str):
        if not _TARGET_RE.match(obj):
            raise TypeError(f"a lazy alignment target must look like 'package.module:Class', "
                            f"got {obj!r}")
    else:
        _validate_class(obj, f"the alignment registered as {name!r}")
    with _lock:
        current = _registered.get(name)
        if current is not None and current is not obj and current != obj and not replace:
            raise ValueError(f"alignment {name!r} is already registered ({current!r}); "
                             "pass replace=True to replace it")
        if current is None and name in _BUILTINS and not replace:
            raise ValueError(f"{name!r} is a built-in alignment; pass replace=True to "
                             "override it")
        _registered[name] = obj
        _loaded.pop(name, None)
        _broken.pop(name, None)
    return obj


def _unregister(name):
    """Remove an explicit registration (for tests and interactive use)."""
    with _lock:
        _registered.pop(name, None)
        _loaded.pop(name, None)
        _broken.pop(name, None)


def _origin(name):
    """(origin, distribution or None, target or entry points) of a name."""
    if name in _registered:
        return "registered", None, _registered[name]
    if name in _BUILTINS:
        return "built-in", "attncore", _BUILTINS[name]
    eps = _scan()
    if name in eps:
        group = eps[name]
        return "entry point", " and ".join(_dist_name(ep) for ep in group), group
    return None, None, None


def get(name):
    """The alignment class registered under ``name`` (plugins load here).

    Parameters
    ----------
    name : str or type
        A registered name (explicit > built-in > entry point), or an
        :class:`attncore.Alignment` subclass (returned after validation).

    Returns
    -------
    type
        A subclass of :class:`attncore.Alignment`.

    Raises
    ------
    AlignmentNotFoundError
        Unknown name; the message lists the available names.
    AlignmentConflictError
        Several installed distributions provide the name.
    AlignmentLoadError
        The plugin failed to import or is not a valid Alignment.
    """
    if isinstance(name, type):
        return _validate_class(name, "alignment")
    _check_name(name)
    with _lock:
        if name in _loaded:
            return _loaded[name]
        if name in _broken:
            raise AlignmentLoadError(f"alignment {name!r} could not be loaded: {_broken[name]}")
        origin, dist, target = _origin(name)
        if origin is None:
            names = ", ".join(available())
            hint = "" if not _autoload_disabled() else \
                f" ({DISABLE_ENV} is set: installed plugins are not discovered)"
            raise AlignmentNotFoundError(
                f"unknown alignment {name!r}; available: {names}{hint}")
        if origin == "entry point":
            if len(target) > 1:
                raise AlignmentConflictError(
                    f"{_scan_problems.get(name, name)}; uninstall one of them, or register "
                    "the class you want with attncore.alignments.register(name, cls)")
            ep = target[0]
            try:
                cls = _validate_class(ep.load(), f"entry point {name!r} of {_describe_ep(ep)}")
            except Exception as exc:
                msg = (f"plugin alignment {name!r} from {_describe_ep(ep)} failed to load: "
                       f"{type(exc).__name__}: {exc}")
                _broken[name] = msg
                warnings.warn(f"attncore: {msg}", RuntimeWarning, stacklevel=2)
                raise AlignmentLoadError(msg) from exc
        else:
            try:
                cls = _validate_class(_load_target(target),
                                      f"the alignment registered as {name!r}")
            except Exception as exc:
                msg = (f"alignment {name!r} ({origin}, {target!r}) failed to load: "
                       f"{type(exc).__name__}: {exc}")
                if origin == "registered":
                    _broken[name] = msg
                    warnings.warn(f"attncore: {msg}", RuntimeWarning, stacklevel=2)
                raise AlignmentLoadError(msg) from exc
        _loaded[name] = cls
        return cls


def create(name, **params):
    """An alignment instance: ``get(name)(**params)``.

    Parameters
    ----------
    name : str or type
        See :func:`get`.
    **params
        The alignment's parameters (validated by its ``__init__``).

    Returns
    -------
    Alignment
    """
    cls = get(name)
    label = name if isinstance(name, str) else cls.__name__
    try:
        inst = cls(**params)
    except (TypeError, ValueError) as exc:
        if str(exc).startswith(f"alignment {label!r}"):
            raise
        raise type(exc)(f"alignment {label!r} ({cls.__module__}.{cls.__qualname__}): "
                        f"{exc}") from exc
    if isinstance(name, str) and getattr(inst, "name", None) is None:
        try:
            inst.name = name
        except Exception:
            pass
    return inst


def available(details=False):
    """The alignment names, without importing any plugin.

    Parameters
    ----------
    details : bool, default False
        Also describe every name.

    Returns
    -------
    list of str
        Sorted names (``details=False``).
    dict
        ``details=True``: name -> ``{"origin": "registered" | "built-in" |
        "entry point", "distribution": str or None, "target": str,
        "status": "loaded" | "not loaded" | "conflict: ..." |
        "broken: ..."}``.  A name offered by an entry point but taken by a
        registration or a built-in is listed under its winner.
    """
    details = parse_bool(details, "details")
    with _lock:
        names = set(_registered) | set(_BUILTINS) | set(_scan())
        if not details:
            return sorted(names)
        out = {}
        for name in sorted(names):
            origin, dist, target = _origin(name)
            if origin == "entry point":
                tgt = " | ".join(ep.value for ep in target)
            elif isinstance(target, str):
                tgt = target
            else:
                tgt = f"{target.__module__}:{target.__qualname__}"
            if name in _broken:
                status = f"broken: {_broken[name]}"
            elif origin == "entry point" and len(target) > 1:
                status = f"conflict: {_scan_problems.get(name, '')}"
            elif name in _loaded:
                status = "loaded"
            else:
                status = "not loaded"
            out[name] = {"origin": origin, "distribution": dist, "target": tgt,
                         "status": status}
        return out


def refresh():
    """Forget discovered entry points and loaded plugins; rescan on next use.

    Explicit registrations are kept.  Call it after installing or
    uninstalling a plugin in a running interpreter.
    """
    global _eps
    with _lock:
        import importlib as _il

        _il.invalidate_caches()
        _eps = None
        _loaded.clear()
        _broken.clear()
        _scan_problems.clear()
