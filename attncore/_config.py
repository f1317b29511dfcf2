"""``attncore.show_config()``: what this installation is built with."""
from __future__ import annotations

import os
import platform
import sys


def config_dict() -> dict:
    """The facts :func:`show_config` prints, as a dict."""
    info = _versions()
    info["blas"] = _blas_info()
    info.update(_kernel_info())
    info.update(_int8_info(info["kernel_path"], info["bf16_products"]))
    return info


def _versions() -> dict:
    """attncore's, Python's, NumPy's and SciPy's versions, the platform,
    OpenMP and the processors."""
    import numpy
    import scipy

    from . import __version__
    from ._core import _sdpa

    return {
        "attncore": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "numpy": numpy.__version__,
        "scipy": scipy.__version__,
        "openmp": bool(_sdpa.openmp_enabled()),
        "omp_max_threads": _sdpa.omp_max_threads(),
        "omp_num_procs": _sdpa.omp_num_procs(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "cpu_count": os.cpu_count(),
    }


def _blas_info() -> dict:
    """SciPy's BLAS: as built, and as loaded (threadpoolctl)."""
    import scipy

    blas = {}
    try:
        deps = scipy.show_config(mode="dicts")["Build Dependencies"]["blas"]
        blas = {"name": deps.get("name"), "version": deps.get("version"),
                "openblas configuration": deps.get("openblas configuration")}
    except Exception:
        pass
    try:
        import scipy.linalg  # noqa: F401  (loads scipy's BLAS)

        from threadpoolctl import threadpool_info

        for lib in threadpool_info():
            if lib.get("user_api") == "blas":
                blas.setdefault("runtime", []).append(
                    {k: lib.get(k) for k in ("internal_api", "version", "num_threads",
                                              "threading_layer", "architecture", "filepath")})
    except Exception:
        pass
    return blas


def _kernel_info() -> dict:
    """The kernel path, the BLAS hold and the CPU features the kernels use."""
    from ._core import _sdpa
    from ._kernels import available_kernel_paths, kernel_path
    from ._threads import blas_hold_supported

    info: dict = {"kernel_path": kernel_path()}
    info["kernel_paths_available"] = available_kernel_paths()
    info["blas_thread_local_hold"] = blas_hold_supported()
    info["bf16_dot"] = _sdpa.cpu_features()["bf16_dot"]
    info["bf16_dot_fast"] = _sdpa.cpu_features()["bf16_dot_fast"]
    # bfloat16 products run on the avx512 path only
    info["bf16_products"] = ("float32", "bfloat16", "bfloat16-emulated")[
        _sdpa.bf16_mode() if info["kernel_path"] == "avx512" else 0]
    info["decode_prefetch_l2_rows"] = _sdpa.cpu_features()["prefetch_l2_rows"]
    info["int8_dot"] = _sdpa.cpu_features()["int8_dot"]
    info["avx_vnni"] = _sdpa.cpu_features()["avx_vnni"]
    # ATTNCORE_CPU_FEATURES: the features taken away at import
    info["cpu_features_masked"] = _sdpa.cpu_features()["masked"]
    return info


def _int8_info(path: str, bf16_products: str) -> dict:
    """What precision="int8" multiplies with on kernel path ``path``."""
    from ._core import _sdpa

    mode = _sdpa.int8_mode()
    info = {"int8_products": (
        "int8" if mode in (1, 2) and path == "avx512"
        else {4: "int8-avx2", 5: "int8-avxvnni", 6: "int8-avxvnni-emulated"}[mode]
        if mode in (4, 5, 6) and path == "avx2"
        else "dequantized" if mode == 3 else "float32")}
    info["int8_mode"] = _sdpa.int8_mode_name() or "auto"
    # P.V under int8 Q.K^T: bfloat16 pairs where the avx512 path's bfloat16
    # products are on, else int16 pairs (vpdpwssd: AVX-VNNI on the avx2
    # path, AVX512_VNNI on the avx512 one) or float32
    on_path = info["int8_products"] not in ("float32", "dequantized")
    info["int8_pv"] = ("bfloat16" if info["int8_products"] == "int8"
                       and bf16_products != "float32" else
                       {3: "int16", 4: "int16-emulated"}.get(
                           _sdpa.pv16_code(mode) if on_path else 0, "float32"))
    return info


# what precision="int8" computes, by info["int8_products"]: one fact a line
_INT8_LINES = {
    "int8": ["Q.K^T on vpdpbusd (AVX512_VNNI)"],
    "int8-avx2": ["Q.K^T on vpmaddubsw + vpmaddwd (AVX2, sign trick)"],
    "int8-avxvnni": ["Q.K^T on 256-bit vpdpbusd (AVX-VNNI)"],
    "int8-avxvnni-emulated": ["Q.K^T in AVX-VNNI's layout spelled in AVX2 (forced)"],
    "dequantized": ["Q.K^T as float products of the dequantized int8 rows (forced)"],
    "float32": ["float32 products: no int8 kernel beats float32 on this CPU and path",
                "(the AVX512_VNNI kernel runs on the avx512 path, AVX-VNNI's on the avx2 path;",
                "the AVX2 vpmaddubsw kernel measured no faster than float32)"],
}


# P.V under int8 Q.K^T, by info["int8_pv"]
_INT8_PV_LINES = {
    "float32": "P.V in float32",
    "bfloat16": "P.V as bfloat16 pairs (AVX512_BF16)",
    "int16": "P.V as 16-bit integer pairs on vpdpwssd",
    "int16-emulated": "P.V as 16-bit integer pairs, vpdpwssd's sums spelled in AVX2 / AVX-512BW (forced)",
}


def _int8_lines(info: dict) -> list:
    """What precision="int8" computes on this CPU, one fact a line."""
    from . import _call

    lines = list(_INT8_LINES[info["int8_products"]])
    if info["int8_products"] in ("float32", "dequantized"):
        return lines
    isa = "AVX512_VNNI" if info["kernel_path"] == "avx512" else "AVX-VNNI"
    lines.append(_INT8_PV_LINES[info["int8_pv"]] + (f" ({isa})" if info["int8_pv"] == "int16" else ""))
    if info["int8_mode"] == "auto":
        lines += [f"small calls on float keys take float32 products: fewer than "
                  f"{_call.INT8_MIN_ROWS} query or key rows,",
                  f"  or fewer than {_call.INT8_MIN_WORK:.0e} multiply-adds "
                  "(quantizing the keys costs more than it saves)"]
    return lines


# what bfloat16 inputs and precision="bfloat16" multiply with
_BF16_LINES = {
    "bfloat16": ["bfloat16 dot products (AVX512_BF16) for bfloat16 inputs and precision='bfloat16'"],
    "bfloat16-emulated": ["bfloat16 dot products spelled in AVX-512F (forced)"],
    "float32": ["float32 products (no AVX512_BF16 on this CPU)"],
    "float32-path": ["float32 products (bfloat16 products run on the avx512 path only)"],
    "float32-forced": ["float32 products (bfloat16 products turned off)"],
    "float32-slow": ["float32 products: bfloat16 dot products (AVX512_BF16) are taken on AMD only",
                     "(Intel's vdpbf16ps issues at about a third of the rate of its float32 FMAs;",
                     "bfloat16 kernels measured 0.6-0.68x of float32)"],
}


def _bf16_line(info: dict) -> str:
    """The key of _BF16_LINES that says what bfloat16 inputs multiply with."""
    if info["bf16_products"] != "float32":
        return info["bf16_products"]
    if not info["bf16_dot"]:
        return "float32"
    if info["kernel_path"] != "avx512":
        return "float32-path"
    return "float32-forced" if info["bf16_dot_fast"] else "float32-slow"


def _print_lines(name: str, lines: list) -> None:
    """One configuration entry: its name on the first line, one fact a line."""
    for i, line in enumerate(lines):
        print(f"{name if i == 0 else '':>16}{':' if i == 0 else ' '} {line}")


def show_config() -> None:
    """Print versions, OpenMP on/off and thread counts, and scipy's BLAS."""
    info = config_dict()
    print("attncore configuration")
    print("----------------------")
    for key in ("attncore", "python", "platform", "numpy", "scipy"):
        print(f"{key:>16}: {info[key]}")
    print(f"{'OpenMP':>16}: {'enabled' if info['openmp'] else 'DISABLED (serial build)'}")
    print(f"{'threads':>16}: {info['omp_max_threads']} by default "
          f"(OMP_NUM_THREADS={info['OMP_NUM_THREADS']}), {info['omp_num_procs']} processors")
    print(f"{'float32 kernels':>16}: {info['kernel_path']} (this CPU runs "
          f"{', '.join(info['kernel_paths_available'])})")
    if info["kernel_path"] == "neon":
        from . import _call

        _print_lines("neon path", [
            f"the decode body (query blocks of up to {_call.SMALL_ROWS} rows) on NEON,",
            "bfloat16 / float16 / int8 keys and values read in place;",
            "prefill, dense layers and the rest: the portable path (BLAS + portable loops)"])
    if info["cpu_features_masked"]:
        print(f"{'CPU features':>16}: taken as absent (ATTNCORE_CPU_FEATURES): "
              f"{', '.join(info['cpu_features_masked'])}")
    _print_lines("16-bit inputs", ["bfloat16 / float16 read in place"] + _BF16_LINES[_bf16_line(info)])
    pf = info["decode_prefetch_l2_rows"]
    if pf and info["kernel_path"] != "portable":   # (set for a benchmark)
        print(f"{'decode prefetch':>16}: one query row's key / value rows of {pf} bytes "
              f"or more into L2, shorter ones into L1")
    _print_lines("precision=int8", _int8_lines(info))
    blas = info["blas"]
    print(f"{'BLAS (scipy)':>16}: {blas.get('name')} {blas.get('version')}; "
          + ("held to one thread per attncore thread (thread-locally)"
             if info["blas_thread_local_hold"] else
             "no thread-local limit: attention keeps each product below OpenBLAS' threading "
             "threshold; other BLAS work of the layers runs on one attncore thread"))
    if blas.get("openblas configuration"):
        print(f"{'':>16}  {blas['openblas configuration']}")
    for lib in blas.get("runtime", []):
        print(f"{'':>16}  runtime: {lib.get('internal_api')} {lib.get('version')}, "
              f"{lib.get('num_threads')} threads, arch {lib.get('architecture')}")
