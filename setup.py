"""Build script: the Cython extensions of attncore, with OpenMP when the
compiler supports it.

Environment variables
---------------------
ATTNCORE_NO_OPENMP=1
    Build without OpenMP (every kernel then runs on one thread).
ATTNCORE_FAIL_NO_OPENMP=1
    Fail the build instead of falling back to a serial build when the
    compiler cannot compile and link an OpenMP program.
CFLAGS
    Added to every compile (setuptools reads it), which is how a build sets
    the kernels' compile-time constants, e.g. ``CFLAGS=-DAC_BK=64`` (keys
    per tile of the fused kernel, attncore/_core/src/ac_fused_x86.h) or
    ``CFLAGS=-DAC_NO_X86_KERNELS`` (the portable kernels only).  Rebuild with
    ``--force`` after changing it only for ``build_ext --inplace`` builds
    that predate the build cache below (the cache key holds every flag).

Build cache
-----------
Each extension's compile is keyed by a hash of what goes into it: its
Cython-generated C file, every kernel source under attncore/_core/src, the
compile and link commands and flags (OpenMP included, CFLAGS / LDFLAGS
through the compiler object) and the Python ABI suffix.  When the in-tree
extension (attncore/_core/*.so, which an editable install or
``build_ext --inplace`` leaves there) was built with the same key, it is
reused instead of compiled: so ``pip install -e ".[test]"`` after
``pip install -e .`` does not compile again, although pip builds each in a
fresh temporary directory.  The keys are in build/attncore-build-keys/;
``--force`` (or deleting them) compiles anyway.  The build prints a line
per extension to stderr (what it compiled or reused, and the time);
``pip install -v`` shows them.

Compile time (gcc 12, -O3, CPU-seconds on one Intel Emerald Rapids core,
with Python's default ``-g``): ``_sdpa`` 108 (84 with ``-g0``; 29 without
the fused x86 kernels, ``-DAC_NO_X86_KERNELS``, so those kernels' ISA
variants are three quarters of it), ``_linalg`` 23, ``_additive`` 14,
``_rotary`` 12; nearly all of it in GCC's optimization and code generation
(``-ftime-report``: 97 %), not in parsing.  Debug information is off
(``-g0``) unless CFLAGS holds a ``-g`` flag.

Platforms
---------
GCC / Clang (Linux, macOS): OpenMP when the probe below compiles and links
an OpenMP program with the build's flags.  Apple Clang has no OpenMP of its
own: install libomp and point CPPFLAGS / LDFLAGS at it (the release wheels
do so, see ``[tool.cibuildwheel.macos]`` in pyproject.toml), otherwise the
build is serial.

MSVC (Windows): a serial build, compiled as C11 (``/std:c11``: MSVC accepts
the ``_Pragma`` operator the kernel headers use only in its C11 / C17
modes).  MSVC's ``/openmp`` implements OpenMP 2.0, which rejects the
kernels' ``#pragma omp simd`` loops (error C3001), and its
``/openmp:experimental``, which accepts them, turns on ``/fp:fast`` inside
them, which the masked softmax's -inf / NaN logic cannot tolerate.  So the
Cython ``prange`` loops run on one thread there.  The fused x86 kernels are
GCC / Clang code (function target attributes, ``__builtin_cpu_supports``),
compiled only for ``__GNUC__`` on x86-64: an MSVC build runs the portable
path (BLAS products + portable loops).
"""
import hashlib
import json
import os
import re
import shlex
import sys
import shutil
import tempfile
import textwrap
import time
import warnings

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join("attncore", "_core", "src")


def _src_deps(*roots):
    """The kernel sources (attncore/_core/src) that the headers ``roots``
    include, themselves included, for the ``depends`` of an extension: the
    ``#include "ac_..."`` lines followed transitively, and the bodies that
    ac_variants.inc includes (``#define AC_VARIANT_BODY "ac_..."``)."""
    seen, todo = set(), list(roots)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        with open(os.path.join(HERE, SRC, name), encoding="utf-8") as f:
            todo += re.findall(r'^\s*#\s*(?:include|define\s+AC_VARIANT_BODY)\s+'
                               r'"(ac_\w+\.(?:h|inc))"', f.read(), re.M)
    return [os.path.join(SRC, n) for n in sorted(seen)]


def _flag(name):
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


def _openmp_flags(compiler):
    if compiler.compiler_type == "msvc":
        return ["/openmp"], []
    if sys.platform == "darwin":
        return ["-Xpreprocessor", "-fopenmp"], ["-lomp"]
    return ["-fopenmp"], ["-fopenmp"]


def _env_link_flags():
    """The flags from the environment that the extensions are linked with.

    ``customize_compiler`` appends ``LDFLAGS`` and ``CFLAGS`` to the shared
    library linker command, but not to the executable linker the probe
    uses; they are added to the probe's link by hand (e.g. with
    ``-fsanitize=address`` in both, the probe must link the sanitizer
    runtime as the extensions do).
    """
    flags = []
    for var in ("LDFLAGS", "CFLAGS"):
        flags += shlex.split(os.environ.get(var, ""))
    return flags


def _check_openmp(compiler):
    """Compile and link a tiny OpenMP program with the build's compiler and
    the flags the extensions get (the compiler object carries CFLAGS /
    CPPFLAGS once customized; LDFLAGS / CFLAGS are added to the link)."""
    cflags, lflags = _openmp_flags(compiler)
    code = textwrap.dedent(
        """\
        #include <omp.h>
        #include <stdio.h>
        int main(void) {
            int n = 0;
            #pragma omp parallel reduction(+:n)
            n += 1;
            printf("%d %d\\n", n, omp_get_max_threads());
            return n < 1;
        }
        """
    )
    tmp = tempfile.mkdtemp()
    cwd = os.getcwd()
    try:
        os.chdir(tmp)
        with open("omp_test.c", "w") as f:
            f.write(code)
        objs = compiler.compile(["omp_test.c"], output_dir="objs", extra_postargs=cflags)
        compiler.link_executable(objs, "omp_test", extra_preargs=_env_link_flags(),
                                 extra_postargs=lflags)
        return True
    except Exception as exc:  # any compile / link failure means "no OpenMP"
        warnings.warn(f"OpenMP test program failed to build: {exc}", stacklevel=2)
        return False
    finally:
        os.chdir(cwd)
        shutil.rmtree(tmp, ignore_errors=True)


def _no_openmp_message(fail):
    """What the build says when the OpenMP probe failed."""
    if fail:
        return ("attncore: the compiler cannot compile and link an OpenMP program with the "
                "build's flags (CFLAGS / LDFLAGS; see the warning above) and "
                "ATTNCORE_FAIL_NO_OPENMP is set: stopping the build.")
    return ("attncore: the compiler cannot compile and link an OpenMP program with the "
            "build's flags (CFLAGS / LDFLAGS); building serial kernels (one thread). Set "
            "ATTNCORE_FAIL_NO_OPENMP=1 to make this an error.")


def _say(msg):
    """A line of the build's progress, on stderr (pip shows it with -v)."""
    print(f"attncore build: {msg}", file=sys.stderr, flush=True)


def _build_key(cmd, ext):
    """The hash of everything that goes into compiling ``ext`` with the
    build_ext command ``cmd`` (see "Build cache" in the docstring)."""
    h = hashlib.sha256()
    cc = cmd.compiler
    config = [ext.name, sorted(ext.sources), ext.include_dirs, ext.define_macros,
              ext.undef_macros, ext.extra_compile_args, ext.extra_link_args, ext.libraries,
              getattr(cc, "compiler_so", None), getattr(cc, "linker_so", None),
              cmd.get_ext_filename(ext.name), sys.version, sys.platform]
    h.update(json.dumps(config, default=str).encode())
    src_dir = os.path.join(HERE, SRC)
    files = [os.path.join(HERE, f) for f in sorted(ext.sources)]
    files += [os.path.join(src_dir, f) for f in sorted(os.listdir(src_dir))]
    for path in files:
        h.update(path.encode())
        with open(path, "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()


def _file_hash(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _key_file(ext):
    return os.path.join(HERE, "build", "attncore-build-keys", ext.name + ".json")


def _in_tree(cmd, ext):
    """Where the extension lies in the source tree after an in-place build."""
    return os.path.join(HERE, cmd.get_ext_filename(ext.name))


def _reusable(cmd, ext, key):
    """The in-tree extension, if it was built with ``key``; else None."""
    path = _in_tree(cmd, ext)
    try:
        with open(_key_file(ext), encoding="utf-8") as f:
            stamp = json.load(f)
        if stamp["key"] == key and os.path.isfile(path) and _file_hash(path) == stamp["so"]:
            return path
    except (OSError, ValueError, KeyError):
        pass
    return None


def _record(ext, key, built):
    """Remember that ``built`` (the fresh extension) was compiled with ``key``."""
    os.makedirs(os.path.dirname(_key_file(ext)), exist_ok=True)
    with open(_key_file(ext), "w", encoding="utf-8") as f:
        json.dump({"key": key, "so": _file_hash(built)}, f)


class BuildExt(build_ext):
    def finalize_options(self):
        super().finalize_options()
        # pip / `python -m build` pass no -j: compile the four extensions
        # side by side (about half the wall time of a wheel build on two
        # cores); an explicit -j N still wins
        if not self.parallel:
            self.parallel = min(len(self.extensions or ()) or 1, os.cpu_count() or 1)

    def build_extensions(self):
        use_omp = False
        msvc = self.compiler.compiler_type == "msvc"
        if _flag("ATTNCORE_NO_OPENMP"):
            warnings.warn("ATTNCORE_NO_OPENMP is set: building attncore without OpenMP", stacklevel=2)
        elif msvc:
            msg = ("attncore: MSVC's OpenMP (2.0) rejects the kernels' `omp simd` loops: "
                   "building serial kernels (one thread); see setup.py's docstring")
            if _flag("ATTNCORE_FAIL_NO_OPENMP"):
                raise RuntimeError(msg + " (and ATTNCORE_FAIL_NO_OPENMP is set: stopping the build)")
            warnings.warn(msg, stacklevel=2)
        else:
            use_omp = _check_openmp(self.compiler)
            if not use_omp:
                fail = _flag("ATTNCORE_FAIL_NO_OPENMP")
                msg = _no_openmp_message(fail)
                if fail:
                    raise RuntimeError(msg)
                warnings.warn(msg, stacklevel=2)
        cflags, lflags = _openmp_flags(self.compiler) if use_omp else ([], [])
        if msvc:
            base = ["/O2", "/std:c11"]
        else:
            # -ffast-math is deliberately absent: it breaks the -inf / NaN
            # logic of the masked softmax.  -fopenmp-simd keeps the
            # `omp simd` loops vectorized in a serial build.
            base = ["-O3", "-fno-math-errno", "-fno-trapping-math",
                    "-Wno-unused-function"]
            # no debug information unless CFLAGS asks for it (Python's own
            # flags carry -g): it is a fifth of _sdpa's compile time (108 ->
            # 84 CPU-seconds measured) and most of the extensions' size
            if not any(f.startswith("-g") for f in shlex.split(os.environ.get("CFLAGS", ""))):
                base.append("-g0")
            if not use_omp:
                base.append("-fopenmp-simd")
        for ext in self.extensions:
            ext.extra_compile_args = base + cflags + list(ext.extra_compile_args or [])
            ext.extra_link_args = lflags + list(ext.extra_link_args or [])
        t0 = time.perf_counter()
        _say(f"{len(self.extensions)} extensions, up to {self.parallel or 1} compiled at a time; "
             "compiling all takes about 2 minutes on two idle cores (more on busy ones), "
             "an extension unchanged since the last build is reused")
        super().build_extensions()
        _say(f"extensions done in {time.perf_counter() - t0:.0f} s")

    def build_extension(self, ext):
        key = _build_key(self, ext)
        dest = self.get_ext_fullpath(ext.name)
        cached = None if self.force else _reusable(self, ext, key)
        if cached is not None:
            if os.path.abspath(cached) != os.path.abspath(dest):
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                shutil.copy2(cached, dest)
            _say(f"{ext.name}: unchanged since the last build, reusing {os.path.relpath(cached, HERE)}")
            return
        _say(f"{ext.name}: compiling")
        t0 = time.perf_counter()
        if os.path.exists(dest):  # else setuptools' timestamp check may skip a changed flag
            os.remove(dest)
        super().build_extension(ext)
        if os.path.isfile(dest):
            _record(ext, key, dest)
        _say(f"{ext.name}: compiled in {time.perf_counter() - t0:.0f} s")


def extensions():
    from Cython.Build import cythonize

    exts = [
        Extension(
            "attncore._core._sdpa",
            [os.path.join("attncore", "_core", "_sdpa.pyx")],
            include_dirs=[SRC],
            depends=_src_deps("ac_sdpa.h", "ac_team.h"),
        ),
        Extension(
            "attncore._core._additive",
            [os.path.join("attncore", "_core", "_additive.pyx")],
            include_dirs=[SRC],
            depends=_src_deps("ac_additive.h"),
        ),
        Extension(
            "attncore._core._rotary",
            [os.path.join("attncore", "_core", "_rotary.pyx")],
            include_dirs=[SRC],
            depends=_src_deps("ac_rotary.h"),
        ),
        Extension(
            "attncore._core._linalg",
            [os.path.join("attncore", "_core", "_linalg.pyx")],
            include_dirs=[SRC],
            depends=_src_deps("ac_linear.h"),
        ),
    ]
    return cythonize(
        exts,
        compiler_directives={
            "language_level": 3,
            "boundscheck": False,
            "wraparound": False,
            "cdivision": True,
            "initializedcheck": False,
        },
    )


if __name__ == "__main__":  # (also under pip / build: setuptools runs this file as __main__)
    setup(ext_modules=extensions(), cmdclass={"build_ext": BuildExt})
