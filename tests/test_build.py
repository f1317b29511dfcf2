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


class _FakeCompiler:
    compiler_so = ["gcc", "-O3"]
    linker_so = ["gcc", "-shared"]


class _FakeBuildExt:
    """What setup.py's build cache reads of a build_ext command."""
    compiler = _FakeCompiler()

    def get_ext_filename(self, name):
        return os.path.join(*name.split(".")) + ".so"


def _tree(tmp_path, mod):
    """A source tree with one extension's C file and a kernel header."""
    src = tmp_path / "attncore" / "_core" / "src"
    src.mkdir(parents=True)
    (src / "ac_x.h").write_text("static int f(void) { return 1; }\n")
    (tmp_path / "attncore" / "_core" / "_x.c").write_text("#include \"ac_x.h\"\n")
    mod.HERE = str(tmp_path)
    ext = mod.Extension("attncore._core._x", [os.path.join("attncore", "_core", "_x.c")],
                        extra_compile_args=["-O3", "-fopenmp"])
    return ext, src


def test_build_key_follows_sources_and_flags(tmp_path):
    """The cache key changes with a kernel header, the C source, a compile
    flag and the compiler command, and with nothing else."""
    mod = _setup_module()
    ext, src = _tree(tmp_path, mod)
    cmd = _FakeBuildExt()
    key = mod._build_key(cmd, ext)
    assert mod._build_key(cmd, ext) == key
    (src / "ac_x.h").write_text("static int f(void) { return 2; }\n")
    key2 = mod._build_key(cmd, ext)
    assert key2 != key
    (tmp_path / "attncore" / "_core" / "_x.c").write_text("/* changed */\n")
    key3 = mod._build_key(cmd, ext)
    assert key3 != key2
    ext.extra_compile_args = ["-O3"]                       # e.g. a serial build
    key4 = mod._build_key(cmd, ext)
    assert key4 != key3
    cmd.compiler = type("C", (), {"compiler_so": ["gcc", "-O3", "-DAC_BK=64"],
                                  "linker_so": ["gcc", "-shared"]})()
    assert mod._build_key(cmd, ext) != key4


def test_in_tree_extension_reused_only_as_recorded(tmp_path):
    """An in-tree extension is reused when its key was recorded for exactly
    that file; a different key, a changed file or no record compiles."""
    mod = _setup_module()
    ext, _ = _tree(tmp_path, mod)
    cmd = _FakeBuildExt()
    key = mod._build_key(cmd, ext)
    so = tmp_path / "attncore" / "_core" / "_x.so"
    so.write_bytes(b"built")
    assert mod._reusable(cmd, ext, key) is None            # nothing recorded
    mod._record(ext, key, str(so))
    assert mod._reusable(cmd, ext, key) == str(so)
    assert mod._reusable(cmd, ext, "another key") is None
    so.write_bytes(b"built by something else")
    assert mod._reusable(cmd, ext, key) is None
