"""The package's structure, read from its source with ``ast``: the import
graph of attncore's modules has no circle (each module builds only on the
ones below it), and the kernels' call description (attncore._call.Call) is
built in the front door alone, by keyword."""
from __future__ import annotations

import ast
import os

import attncore

ROOT = os.path.dirname(os.path.abspath(attncore.__file__))


def _modules(root: str) -> dict[str, str]:
    """{dotted module name: path} of the .py files under ``root`` (the
    package ``attncore``; a package is named by its ``__init__``)."""
    mods = {}
    for base, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith((".", "_core", "__pycache__"))]
        rel = os.path.relpath(base, root)
        parts = ["attncore"] + ([] if rel == "." else rel.split(os.sep))
        for f in files:
            if f.endswith(".py"):
                name = parts if f == "__init__.py" else parts + [f[:-3]]
                mods[".".join(name)] = os.path.join(base, f)
    return mods


def _imports(name: str, path: str, mods: dict[str, str]) -> set[str]:
    """The attncore modules that module ``name`` imports, at its top level or
    inside a function (an import in a function is still a dependency).  An
    import of the module's own package (``from . import __version__``) is
    left out: a package is initialised before its modules anyway."""
    is_pkg = path.endswith("__init__.py")
    package = name if is_pkg else name.rpartition(".")[0]
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), path)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # ``from pkg import name``: the submodule pkg.name where there is one
            targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod
                       for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in mods:   # a name inside a module: that module
                t = t.rpartition(".")[0]
            if t and t != name and not (name.startswith(t + ".")):
                found.add(t)
    return found


def import_graph(root: str = ROOT) -> dict[str, set[str]]:
    """{module: the attncore modules it imports} of the package at ``root``."""
    mods = _modules(root)
    return {name: _imports(name, path, mods) for name, path in mods.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan):
    each is a set of modules that import each other in a circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_circles_finds_a_circle():
    """The checker itself: a circle of three modules and a self-contained
    chain beside it."""
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(g) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_import_graph_reads_relative_imports():
    """The graph sees the imports the package is known to have (the front
    door builds on the kernels' policies; the public functions on it)."""
    g = import_graph()
    assert "attncore._call" in g["attncore.functional"]
    assert "attncore._threads" in g["attncore._call"]
    assert "attncore.alignments._base" in g["attncore._alignment_layer"]


def test_no_import_circles():
    """No two attncore modules import each other, directly or through
    others (also by imports inside functions)."""
    assert circles(import_graph()) == []


def call_constructions(root: str = ROOT) -> list[tuple[str, int, int]]:
    """(module, line, positional arguments) of every construction of the
    kernels' call description in the package: a call of a name ``Call``
    (``Call(...)``, ``_call.Call(...)``, ``Call._make(...)``)."""
    found = []
    for name, path in sorted(_modules(root).items()):
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), path)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr == "_make":
                f = f.value
            named = (f.id if isinstance(f, ast.Name)
                     else f.attr if isinstance(f, ast.Attribute) else None)
            if named == "Call":
                found.append((name, node.lineno, len(node.args)))
    return found


def test_call_built_in_the_front_door_by_keyword():
    """attncore._call.Call (33 fields, two of them swapped would go
    unnoticed) is built in attncore._call only, every field by keyword."""
    sites = call_constructions()
    assert sites, "no construction found: the checker reads nothing"
    assert [s for s in sites if s[0] != "attncore._call" or s[2]] == []
