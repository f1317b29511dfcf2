"""asv imports every module of bench/: only bench_*.py may define benchmarks.

A helper in the comparison scripts named like an asv benchmark (time_*,
peakmem_*, ...) would be collected and fail in `asv run`; `asv check` does
not catch it (the name is a valid benchmark), so this test does.
"""
import ast
import pathlib

BENCH = pathlib.Path(__file__).resolve().parent.parent / "bench"
PREFIXES = ("time_", "timeraw_", "peakmem_", "mem_", "track_")


def test_only_bench_modules_define_asv_names():
    offenders = []
    for path in sorted(BENCH.glob("*.py")):
        if path.name.startswith("bench_"):
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        scopes = [tree.body] + [n.body for n in tree.body if isinstance(n, ast.ClassDef)]
        for body in scopes:
            for node in body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                        and node.name.startswith(PREFIXES):
                    offenders.append(f"{path.name}:{node.lineno} {node.name}")
    assert not offenders, f"asv would collect these as benchmarks: {offenders}"
