"""setup.py's OpenMP probe compiles and links with the flags the extensions
get (issue 11, defect 2).  Needs a C compiler; skipped without one."""
import importlib.util
import os
import shutil
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETUP = os.path.join(ROOT, "setup.py")

pytestmark = pytest.mark.skipif(
    not os.path.exists(SETUP) or sys.platform != "linux" or shutil.which("cc") is None,
    reason="needs the source tree, Linux and a C compiler")


def _setup_module():
    spec = importlib.util.spec_from_file_location("attncore_setup_under_test", SETUP)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)          # defines the helpers; setup() runs only as __main__
    return mod


def _compiler():
    ccompiler = pytest.importorskip("setuptools._distutils.ccompiler")
    sysconfig = pytest.importorskip("setuptools._distutils.sysconfig")
    cc = ccompiler.new_compiler()
    sysconfig.customize_compiler(cc)      # reads CC / CFLAGS / LDFLAGS as build_ext does
    return cc


@pytest.mark.filterwarnings("ignore:OpenMP test program failed")
def test_probe_links_with_ldflags(monkeypatch):
    """A link flag that cannot work must make the probe fail (it was ignored)."""
    mod = _setup_module()
    monkeypatch.setenv("LDFLAGS", "-lattncore_no_such_library")
    monkeypatch.delenv("CFLAGS", raising=False)
    assert mod._check_openmp(_compiler()) is False


def test_probe_passes_with_sanitizer_flags(monkeypatch):
    """CFLAGS = LDFLAGS = -fsanitize=address,undefined: the probe compiles
    with the sanitizer and must link its runtime too (it failed to link,
    so a sanitized build silently became serial)."""
    mod = _setup_module()
    monkeypatch.delenv("CFLAGS", raising=False)
    monkeypatch.delenv("LDFLAGS", raising=False)
    if not mod._check_openmp(_compiler()):
        pytest.skip("this compiler builds no OpenMP program at all")
    monkeypatch.setenv("CFLAGS", "-fsanitize=address,undefined")
    monkeypatch.setenv("LDFLAGS", "-fsanitize=address,undefined")
    assert mod._check_openmp(_compiler()) is True


def test_fail_message_does_not_promise_a_serial_build():
    mod = _setup_module()
    assert "building serial kernels" not in mod._no_openmp_message(True)
    assert "ATTNCORE_FAIL_NO_OPENMP is set" in mod._no_openmp_message(True)
    assert "building serial kernels" in mod._no_openmp_message(False)
