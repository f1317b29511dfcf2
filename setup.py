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
    ``--force`` after changing it: setuptools does not track flags.

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
import os
import re
import shlex
import sys
import shutil
import tempfile
import textwrap
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
            if not use_omp:
                base.append("-fopenmp-simd")
        for ext in self.extensions:
            ext.extra_compile_args = base + cflags + list(ext.extra_compile_args or [])
            ext.extra_link_args = lflags + list(ext.extra_link_args or [])
        super().build_extensions()


def extensions():
    from Cython.Build import cythonize

    exts = [
        Extension(
            "attncore._core._sdpa",
            [os.path.join("attncore", "_core", "_sdpa.pyx")],
            include_dirs=[SRC],
            depends=_src_deps("ac_sdpa.h"),
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
