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
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from .._validation import parse_bool
from ._base import Alignment

__all__ = ["register", "get", "create", "available", "refresh",
           "AlignmentNotFoundError", "AlignmentConflictError", "AlignmentLoadError",
           "ENTRY_POINT_GROUP", "DISABLE_ENV", "Registry"]

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

# warnings raised inside the registry point at the caller of the public function
_STACK = 4


class AlignmentNotFoundError(ValueError, LookupError):
    """No alignment of that name (the message lists the available ones)."""


class AlignmentConflictError(ValueError, LookupError):
    """Several installed distributions provide an alignment of that name."""


class AlignmentLoadError(ImportError):
    """A plugin alignment failed to import or is not a valid Alignment."""


def _autoload_disabled() -> bool:
    return os.environ.get(DISABLE_ENV, "").strip().lower() not in ("", "0", "false", "no")


def _entry_points() -> list:
    """The entry points of our group (importlib.metadata, any Python >= 3.9)."""
    from importlib import metadata

    eps = metadata.entry_points()
    if hasattr(eps, "select"):
        return list(eps.select(group=ENTRY_POINT_GROUP))
    return list(eps.get(ENTRY_POINT_GROUP, []))  # Python 3.9


def _dist_name(ep: Any) -> str:
    dist = getattr(ep, "dist", None)
    name = getattr(dist, "name", None) if dist is not None else None
    if not name and dist is not None:
        try:
            name = dist.metadata["Name"]
        except Exception:
            name = None
    return name or "unknown distribution"


def _describe_ep(ep: Any) -> str:
    return f"{_dist_name(ep)} ({ep.value})"


def _load_target(target: Any) -> Any:
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


def _validate_class(obj: Any, what: str) -> type:
    if not (isinstance(obj, type) and issubclass(obj, Alignment)):
        raise TypeError(f"{what} must be a subclass of attncore.Alignment, got {obj!r}")
    if obj.score is Alignment.score:
        raise TypeError(f"{what} ({obj.__qualname__}) does not implement score(query, prepared)")
    return obj


def _check_name(name: Any) -> str:
    if not isinstance(name, str) or not name.strip():
        raise TypeError(f"alignment name must be a non-empty str, got {name!r}")
    return name


def _group_entry_points(entries: Iterable[Any]) -> dict[str, list]:
    """Entry points by name; the same distribution seen twice (e.g. twice on
    sys.path) is one plugin."""
    found: dict[str, list] = {}
    for ep in entries:
        group = found.setdefault(ep.name, [])
        if not any(_dist_name(o) == _dist_name(ep) and o.value == ep.value for o in group):
            group.append(ep)
    return found


def _missing_module(ep: Any) -> str | None:
    """The top-level module of an entry point if it is not installed (imports nothing)."""
    top = ep.value.split(":")[0].strip().split(".")[0]
    try:
        return top if importlib.util.find_spec(top) is None else None
    except Exception:
        return None


@dataclass
class _Entry:
    """What the registry knows about one name from one source.

    ``origin`` is "registered", "built-in" or "entry point"; ``target`` a
    class, a lazy "pkg.mod:Class" string, or (entry point) the tuple of
    entry points offering the name.  ``conflict`` and ``error`` say why the
    name cannot be used; ``loaded`` is the class once resolved.
    """

    origin: str
    target: Any
    distribution: str | None = None
    conflict: str | None = None
    error: str | None = None
    loaded: type | None = None

    def reset(self) -> None:
        self.error = None
        self.loaded = None

    def describe_target(self) -> str:
        if self.origin == "entry point":
            return " | ".join(ep.value for ep in self.target)
        if isinstance(self.target, str):
            return self.target
        return f"{self.target.__module__}:{self.target.__qualname__}"

    def status(self) -> str:
        if self.error is not None:
            return f"broken: {self.error}"
        if self.conflict is not None:
            return f"conflict: {self.conflict}"
        return "loaded" if self.loaded is not None else "not loaded"

    def details(self) -> dict:
        return {"origin": self.origin, "distribution": self.distribution,
                "target": self.describe_target(), "status": self.status()}


def _builtin_entries() -> dict[str, _Entry]:
    return {name: _Entry("built-in", target, "attncore") for name, target in _BUILTINS.items()}


class Registry:
    """Name -> alignment class, from registrations, built-ins and entry points.

    attncore uses one instance (the module functions :func:`register`,
    :func:`get`, :func:`create`, :func:`available` and :func:`refresh`
    delegate to it); tests build their own.

    Parameters
    ----------
    entry_points : callable, optional
        Returns the entry points of the group ``attncore.alignments``
        (default: read from ``importlib.metadata``).
    """

    def __init__(self, entry_points: Callable[[], Iterable[Any]] | None = None) -> None:
        self._entry_points = entry_points if entry_points is not None else _entry_points
        self._lock = threading.RLock()
        self._registered: dict[str, _Entry] = {}
        self._builtins = _builtin_entries()
        self._discovered: dict[str, _Entry] | None = None  # None until scanned

    # -- discovery ---------------------------------------------------------
    def _scan(self) -> dict[str, _Entry]:
        """The entry-point records (scanned once; warnings at discovery)."""
        if self._discovered is None:
            found = {}
            for name, group in sorted(self._read_entry_points().items()):
                found[name] = self._discover(name, group)
            self._discovered = found
        return self._discovered

    def _read_entry_points(self) -> dict[str, list]:
        if _autoload_disabled():
            return {}
        try:
            entries = self._entry_points()
        except Exception as exc:  # a broken metadata directory must not break attncore
            warnings.warn(f"attncore: scanning entry points of {ENTRY_POINT_GROUP!r} "
                          f"failed: {exc!r}", RuntimeWarning, stacklevel=_STACK + 1)
            entries = []
        return _group_entry_points(entries)

    def _discover(self, name: str, group: list) -> _Entry:
        """The record of an entry-point name; warn about conflicts, shadowing
        and plugins whose module is not installed."""
        entry = _Entry("entry point", tuple(group), " and ".join(_dist_name(ep) for ep in group))
        if len(group) > 1:
            who = " and ".join(_describe_ep(ep) for ep in group)
            entry.conflict = (f"alignment {name!r} is provided by several installed "
                              f"distributions: {who}")
            warnings.warn(f"attncore: {entry.conflict}; requesting it is an error until one is "
                          "uninstalled (or register the one you want with "
                          "attncore.alignments.register)", RuntimeWarning, stacklevel=_STACK + 1)
        elif name in self._builtins and name not in self._registered:
            warnings.warn(f"attncore: entry point {name!r} of {_describe_ep(group[0])} is "
                          "shadowed by the built-in alignment of that name and is ignored",
                          RuntimeWarning, stacklevel=_STACK + 1)
        elif name not in self._registered:
            # an explicit registration wins over any entry point of that name:
            # a broken one must not shadow it, so only the others are checked
            top = _missing_module(group[0])
            if top is not None:
                entry.error = (f"alignment {name!r} from {_describe_ep(group[0])}: "
                               f"module {top!r} is not installed")
                warnings.warn(f"attncore: {entry.error}", RuntimeWarning, stacklevel=_STACK + 1)
        return entry

    def _entry(self, name: str) -> _Entry | None:
        """The winning record: explicit registration > built-in > entry point."""
        for source in (self._registered, self._builtins):
            if name in source:
                return source[name]
        return self._scan().get(name)

    # -- loading -----------------------------------------------------------
    def _not_found(self, name: str) -> AlignmentNotFoundError:
        hint = "" if not _autoload_disabled() else \
            f" ({DISABLE_ENV} is set: installed plugins are not discovered)"
        return AlignmentNotFoundError(
            f"unknown alignment {name!r}; available: {', '.join(self.available())}{hint}")

    @staticmethod
    def _check_usable(name: str, entry: _Entry) -> None:
        if entry.error is not None:
            raise AlignmentLoadError(f"alignment {name!r} could not be loaded: {entry.error}")
        if entry.conflict is not None:
            raise AlignmentConflictError(
                f"{entry.conflict}; uninstall one of them, or register the class you want "
                "with attncore.alignments.register(name, cls)")

    @staticmethod
    def _load(name: str, entry: _Entry) -> type:
        """Import and validate the class of a record; a plugin or registered
        target that fails is recorded as broken and warned about once."""
        if entry.origin == "entry point":
            ep = entry.target[0]
            what = f"entry point {name!r} of {_describe_ep(ep)}"
            fail = f"plugin alignment {name!r} from {_describe_ep(ep)} failed to load"
            load: Callable[[], Any] = ep.load
        else:
            what = f"the alignment registered as {name!r}"
            fail = f"alignment {name!r} ({entry.origin}, {entry.target!r}) failed to load"

            def load() -> Any:
                return _load_target(entry.target)
        try:
            return _validate_class(load(), what)
        except Exception as exc:
            msg = f"{fail}: {type(exc).__name__}: {exc}"
            if entry.origin != "built-in":
                entry.error = msg
                warnings.warn(f"attncore: {msg}", RuntimeWarning, stacklevel=_STACK)
            raise AlignmentLoadError(msg) from exc

    # -- public API --------------------------------------------------------
    def register(self, name: str, obj: type | str | None = None, *,
                 replace: bool = False) -> Any:
        """See :func:`register`."""
        _check_name(name)
        replace = parse_bool(replace, "replace")
        if obj is None:
            def decorator(cls: type) -> type:
                self.register(name, cls, replace=replace)
                return cls
            return decorator
        if isinstance(obj, str):
            if not _TARGET_RE.match(obj):
                raise TypeError(f"a lazy alignment target must look like 'package.module:Class', "
                                f"got {obj!r}")
        else:
            _validate_class(obj, f"the alignment registered as {name!r}")
        with self._lock:
            current = self._registered.get(name)
            if current is not None and current.target is not obj and current.target != obj \
                    and not replace:
                raise ValueError(f"alignment {name!r} is already registered ({current.target!r}); "
                                 "pass replace=True to replace it")
            if current is None and name in self._builtins and not replace:
                raise ValueError(f"{name!r} is a built-in alignment; pass replace=True to "
                                 "override it")
            self._registered[name] = _Entry("registered", obj)
        return obj

    def unregister(self, name: str) -> None:
        """Remove an explicit registration (for tests and interactive use)."""
        with self._lock:
            self._registered.pop(name, None)

    def get(self, name: str | type) -> type:
        """See :func:`get`."""
        if isinstance(name, type):
            return _validate_class(name, "alignment")
        _check_name(name)
        with self._lock:
            entry = self._entry(name)
            if entry is None:
                raise self._not_found(name)
            if entry.loaded is None:
                self._check_usable(name, entry)
                entry.loaded = self._load(name, entry)
            return entry.loaded

    def create(self, name: str | type, **params: Any) -> Alignment:
        """See :func:`create`."""
        cls = self.get(name)
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

    def available(self, details: bool = False) -> list[str] | dict[str, dict]:
        """See :func:`available`."""
        details = parse_bool(details, "details")
        with self._lock:
            names = sorted(set(self._registered) | set(self._builtins) | set(self._scan()))
            if not details:
                return names
            out = {}
            for name in names:
                entry = self._entry(name)
                assert entry is not None
                out[name] = entry.details()
            return out

    def refresh(self) -> None:
        """See :func:`refresh`."""
        with self._lock:
            importlib.invalidate_caches()
            self._discovered = None
            for entry in (*self._registered.values(), *self._builtins.values()):
                entry.reset()


_default = Registry()


# --------------------------------------------------------------------------
# public API: the default registry
# --------------------------------------------------------------------------
def register(name: str, obj: type | str | None = None, *, replace: bool = False) -> Any:
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
    return _default.register(name, obj, replace=replace)


def _unregister(name: str) -> None:
    """Remove an explicit registration (for tests and interactive use)."""
    _default.unregister(name)


def get(name: str | type) -> type:
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
    return _default.get(name)


def create(name: str | type, **params: Any) -> Alignment:
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
    return _default.create(name, **params)


def available(details: bool = False) -> list[str] | dict[str, dict]:
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
    return _default.available(details)


def refresh() -> None:
    """Forget discovered entry points and loaded plugins; rescan on next use.

    Explicit registrations are kept.  Call it after installing or
    uninstalling a plugin in a running interpreter.
    """
    _default.refresh()
