"""The alignment registry: register / get / create / available / refresh,
lazy entry-point discovery, precedence, conflicts and broken plugins."""
import os
import subprocess
import sys
import types
import warnings
from importlib.metadata import EntryPoint

import numpy as np
import pytest

import attncore
from attncore import alignments
from attncore.alignments import _registry

GROUP = "attncore.alignments"


class Half(attncore.Alignment):
    """score = q . k / 2 (a test alignment)."""

    def score(self, query, prepared):
        return np.matmul(query, np.swapaxes(prepared, -1, -2)) / 2


class _Dist:
    def __init__(self, name):
        self.name = name


def _ep(name, value, dist):
    ep = EntryPoint(name, value, GROUP)
    try:
        return ep._for(_Dist(dist))
    except AttributeError:  # older importlib.metadata: no dist on entry points
        return ep


@pytest.fixture
def fake_eps():
    """The entry points the test registry discovers (the test fills it in)."""
    return []


@pytest.fixture
def reg(fake_eps, monkeypatch):
    """A fresh registry reading its entry points from ``fake_eps``."""
    monkeypatch.delenv(alignments.DISABLE_ENV, raising=False)
    return _registry.Registry(entry_points=lambda: list(fake_eps))


@pytest.fixture
def fake_module(monkeypatch):
    """A throw-away plugin module importable as 'ac_fake_plugin'."""
    mod = types.ModuleType("ac_fake_plugin")
    mod.Half = Half
    mod.NotAlignment = object
    monkeypatch.setitem(sys.modules, "ac_fake_plugin", mod)
    return mod


def test_builtins_listed_and_created():
    names = alignments.available()
    for n in ("dot", "scaled_dot", "bilinear", "general", "mlp", "additive", "concat"):
        assert n in names
    assert alignments.get("general") is alignments.get("bilinear")
    assert alignments.get("concat") is alignments.get("mlp") is alignments.get("additive")
    a = alignments.create("bilinear", weight=np.eye(3))
    assert isinstance(a, attncore.Alignment) and a.name == "bilinear"
    d = alignments.available(details=True)
    assert d["dot"]["origin"] == "built-in"


def test_register_call_decorator_lazy_and_replace(reg, fake_module):
    assert reg.register("half", Half) is Half
    assert reg.register("half", Half) is Half  # identical: no-op

    @reg.register("half_deco")
    class Deco(Half):
        pass

    assert reg.get("half_deco") is Deco
    reg.register("half_lazy", "ac_fake_plugin:Half")
    assert reg.available(details=True)["half_lazy"]["status"] == "not loaded"
    assert reg.get("half_lazy") is Half
    with pytest.raises(ValueError, match="already registered"):
        reg.register("half", Deco)
    reg.register("half", Deco, replace=True)
    assert reg.get("half") is Deco
    with pytest.raises(ValueError, match="built-in"):
        reg.register("dot", Half)
    with pytest.raises(TypeError, match="Alignment"):
        reg.register("bad", object)
    with pytest.raises(TypeError, match="module:Class"):
        reg.register("bad", "not a target")
    with pytest.raises(TypeError, match="name"):
        reg.register("", Half)


def test_register_overrides_builtin_with_replace(reg):
    reg.register("scaled_dot", Half, replace=True)
    assert reg.get("scaled_dot") is Half
    assert reg.available(details=True)["scaled_dot"]["origin"] == "registered"
    reg.unregister("scaled_dot")
    assert reg.get("scaled_dot").__name__ == "ScaledDot"


def test_module_functions_use_one_default_registry():
    assert isinstance(_registry._default, _registry.Registry)
    try:
        alignments.register("half_default", Half)
        assert _registry._default.get("half_default") is Half
        assert "half_default" in alignments.available()
        assert attncore.Attention("half_default").alignment_name == "half_default"
    finally:
        _registry._unregister("half_default")
    assert "half_default" not in alignments.available()


def test_fresh_registries_are_independent(reg):
    reg.register("half_local", Half)
    assert reg.get("half_local") is Half
    assert "half_local" not in alignments.available()
    assert "half_local" not in _registry.Registry(entry_points=list).available()


def test_unknown_name_lists_available():
    with pytest.raises(alignments.AlignmentNotFoundError, match="available: .*dot.*mlp") as ei:
        alignments.get("nosuch")
    assert isinstance(ei.value, ValueError) and isinstance(ei.value, LookupError)
    with pytest.raises(ValueError, match="unknown alignment 'nosuch'"):
        attncore.Attention("nosuch")


def test_create_names_alignment_and_parameter():
    with pytest.raises(TypeError, match="alignment 'mlp'.*missing parameter 'v'"):
        alignments.create("mlp")
    with pytest.raises(ValueError, match="alignment 'bilinear'.*'weight'.*\\(Dq, Dk\\)"):
        alignments.create("bilinear", weight=np.ones(3))
    with pytest.raises(TypeError, match="unexpected keyword|weights"):
        alignments.create("bilinear", weights=np.ones((3, 3)))


def test_entry_point_discovered_lazily_and_loaded(reg, fake_eps, fake_module):
    fake_eps.append(_ep("half_ep", "ac_fake_plugin:Half", "fake-dist"))
    info = reg.available(details=True)["half_ep"]
    assert info["origin"] == "entry point" and info["status"] == "not loaded"
    assert info["distribution"] == "fake-dist"
    assert reg.get("half_ep") is Half
    assert reg.available(details=True)["half_ep"]["status"] == "loaded"
    q = np.ones((1, 2, 3))
    k = np.ones((1, 4, 3))
    ctx = attncore.Attention(reg.create("half_ep"))(q, k)
    np.testing.assert_allclose(ctx, np.ones((1, 2, 3)))


def test_precedence_registered_over_builtin_over_entry_point(reg, fake_eps, fake_module):
    fake_eps.append(_ep("dot", "ac_fake_plugin:Half", "shadow-dist"))
    fake_eps.append(_ep("mine", "ac_fake_plugin:Half", "other-dist"))
    with pytest.warns(RuntimeWarning, match="shadowed by the built-in"):
        reg.available()
    assert reg.get("dot").__name__ == "Dot"

    class Mine(Half):
        pass

    reg.register("mine", Mine)  # explicit beats the entry point, no replace needed
    assert reg.get("mine") is Mine
    assert reg.available(details=True)["mine"]["origin"] == "registered"


def test_duplicate_entry_points_warn_and_error(reg, fake_eps, fake_module):
    fake_eps.append(_ep("twin", "ac_fake_plugin:Half", "dist-one"))
    fake_eps.append(_ep("twin", "ac_fake_plugin:Half", "dist-two"))
    fake_eps.append(_ep("single", "ac_fake_plugin:Half", "dist-three"))
    with pytest.warns(RuntimeWarning, match="dist-one.*dist-two"):
        names = reg.available()
    assert "twin" in names
    with pytest.raises(alignments.AlignmentConflictError, match="dist-one.*dist-two"):
        reg.get("twin")
    assert "conflict" in reg.available(details=True)["twin"]["status"]
    assert reg.get("single") is Half  # others unaffected


def test_same_distribution_twice_is_not_a_conflict(reg, fake_eps, fake_module):
    fake_eps.append(_ep("once", "ac_fake_plugin:Half", "dist-a"))
    fake_eps.append(_ep("once", "ac_fake_plugin:Half", "dist-a"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert reg.get("once") is Half


@pytest.mark.parametrize("value, what", [
    ("ac_fake_plugin:Missing", "AttributeError"),
    ("ac_fake_plugin:NotAlignment", "subclass of attncore.Alignment"),
    ("ac_no_such_module_xyz:Thing", "not installed"),
])
def test_broken_plugin_one_warning_error_when_requested(reg, fake_eps, fake_module, value, what):
    fake_eps.append(_ep("broken", value, "broken-dist"))
    fake_eps.append(_ep("fine", "ac_fake_plugin:Half", "fine-dist"))
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        reg.available()
        assert reg.get("fine") is Half  # nothing else affected
        for _ in range(2):
            with pytest.raises(alignments.AlignmentLoadError, match="broken") as ei:
                reg.get("broken")
            assert what in str(ei.value)
        reg.available()
    runtime = [w for w in rec if issubclass(w.category, RuntimeWarning)]
    assert len(runtime) == 1, [str(w.message) for w in runtime]
    assert "broken-dist" in str(runtime[0].message)
    assert reg.available(details=True)["broken"]["status"].startswith("broken")


def test_registration_beats_a_broken_entry_point_of_the_same_name(reg, fake_eps, fake_module):
    fake_eps.append(_ep("mine2", "ac_no_such_module_xyz:Thing", "broken-dist"))

    class Mine(Half):
        pass

    reg.register("mine2", Mine)   # before the first scan
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # the shadowed broken plugin is not even reported
        reg.available()
    assert reg.get("mine2") is Mine
    reg.refresh()                 # and again after a rescan
    assert reg.get("mine2") is Mine


def test_disable_autoload(reg, fake_eps, fake_module, monkeypatch):
    fake_eps.append(_ep("half_ep", "ac_fake_plugin:Half", "fake-dist"))
    monkeypatch.setenv(alignments.DISABLE_ENV, "1")
    reg.refresh()
    assert "half_ep" not in reg.available()
    with pytest.raises(alignments.AlignmentNotFoundError, match="DISABLE_PLUGIN_AUTOLOAD"):
        reg.get("half_ep")
    assert reg.get("mlp").__name__ == "MLP"  # built-ins still work
    monkeypatch.delenv(alignments.DISABLE_ENV)
    reg.refresh()
    assert reg.get("half_ep") is Half


def test_refresh_rescans(reg, fake_eps, fake_module):
    assert "late" not in reg.available()
    fake_eps.append(_ep("late", "ac_fake_plugin:Half", "late-dist"))
    assert "late" not in reg.available()  # cached scan
    reg.refresh()
    assert "late" in reg.available()


def test_import_attncore_is_lazy():
    """import attncore scans no entry points and imports no plugin module."""
    code = (
        "import sys, importlib.metadata as md\n"
        "calls = []\n"
        "orig = md.entry_points\n"
        "md.entry_points = lambda *a, **k: calls.append(1) or orig(*a, **k)\n"
        "import attncore\n"
        "att = attncore.Attention('dot')\n"
        "assert not calls, 'entry points scanned at import'\n"
        "assert 'attncore_cosine' not in sys.modules\n"
        "names = attncore.alignments.available()\n"
        "assert calls, 'available() should scan'\n"
        "assert 'attncore_cosine' not in sys.modules, 'available() imported a plugin'\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "PYTHONWARNINGS": "ignore"}, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_real_entry_point_cosine_plugin():
    """The example plugin, discovered through the real importlib.metadata."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution("attncore-cosine")
    except PackageNotFoundError:
        pytest.skip("plugins/attncore-cosine is not installed (CI installs it)")
    alignments.refresh()
    info = alignments.available(details=True)["cosine"]
    assert info["origin"] == "entry point"
    assert info["distribution"] == "attncore-cosine"
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 3, 5))
    k = rng.standard_normal((2, 4, 5))
    ctx, w = attncore.Attention("cosine", temperature=3.0)(q, k, return_weights=True)
    qn = q / np.linalg.norm(q, axis=-1, keepdims=True)
    kn = k / np.linalg.norm(k, axis=-1, keepdims=True)
    s = 3.0 * qn @ kn.transpose(0, 2, 1)
    e = np.exp(s - s.max(-1, keepdims=True))
    ref = e / e.sum(-1, keepdims=True)
    np.testing.assert_allclose(w, ref, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(ctx, ref @ k, rtol=1e-12, atol=1e-14)
