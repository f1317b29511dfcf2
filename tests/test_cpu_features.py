"""ATTNCORE_CPU_FEATURES: CPU features taken away at import.

The dispatcher, the kernel paths and the int8 / bfloat16 mode defaults must
then act as on a CPU without those features (the rules of
attncore/_core/src/ac_cpu.h and docs/guide/development.rst), and results
must still match the float64 reference.  Each case runs in a fresh
interpreter, since the mask is read once, at import.
"""
import json
import os
import subprocess
import sys

import pytest

from attncore._core import _sdpa

ZEN3 = "-avx512f,-avx512bw,-avx512vl,-avx512dq,-avx512_bf16,-avx512_vnni,-avx_vnni"
ALDER_LAKE = "-avx512f,-avx512bw,-avx512vl,-avx512dq,-avx512_bf16,-avx512_vnni"
HERE = os.path.dirname(os.path.abspath(__file__))

_PROBE = r"""
import json, sys
import numpy as np
sys.path.insert(0, sys.argv[1])
import attncore
from attncore._core import _sdpa
from attncore._config import config_dict
from reference import sdpa_ref
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, 2, n, 64)).astype(np.float32) for n in (40, 300, 300))
errs = [float(np.abs(attncore.scaled_dot_product_attention(q, k, v, precision=p, is_causal=c)
                     - sdpa_ref(q, k, v, None, int(c))).max())
        for p in (None, "int8") for c in (False, True)]
f = _sdpa.cpu_features()
info = config_dict()
print(json.dumps({"features": {k: f[k] for k in ("kernel_path", "best_path", "bf16_dot",
                                                 "int8_dot", "avx_vnni", "masked")},
                  "paths": list(_sdpa.available_kernel_paths()),
                  "int8_mode": _sdpa.int8_mode(), "bf16_mode": _sdpa.bf16_mode(),
                  "pv16_mode": _sdpa.pv16_mode(), "int8_products": info["int8_products"],
                  "errs": errs}))
"""


def _probe(mask):
    env = dict(os.environ, ATTNCORE_CPU_FEATURES=mask)
    env.pop("ATTNCORE_TEST_KERNEL_PATH", None)
    r = subprocess.run([sys.executable, "-c", _PROBE, HERE], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def _has(path):
    # the CPU's own paths: the session may run under a mask itself
    return path in _probe("")["paths"]


def test_parse_cpu_mask():
    bits = _sdpa.CPU_FEATURE_BITS
    assert _sdpa.parse_cpu_mask("") == 0
    assert _sdpa.parse_cpu_mask(None) == 0
    assert _sdpa.parse_cpu_mask("-avx512f") == bits["avx512f"]
    assert _sdpa.parse_cpu_mask(" -AVX512F , -avx_vnni,") == bits["avx512f"] | bits["avx_vnni"]
    assert len(set(bits.values())) == len(bits)
    for bad in ("avx512f", "-sse9", "+avx2", "-"):
        with pytest.raises(ValueError, match="ATTNCORE_CPU_FEATURES.*avx512_vnni"):
            _sdpa.parse_cpu_mask(bad)


def test_bad_mask_fails_import_with_the_reason():
    env = dict(os.environ, ATTNCORE_CPU_FEATURES="-avx9000")
    r = subprocess.run([sys.executable, "-c", "import attncore"], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode != 0
    assert "ATTNCORE_CPU_FEATURES" in r.stderr and "'-avx9000'" in r.stderr


def test_zen3_mask_acts_as_an_avx2_only_core():
    """No AVX-512, no VNNI, no AVX-VNNI: the avx2 path at best, no bfloat16
    or int8 dot products, precision="int8" on float32 products (the avx2
    path's vpmaddubsw kernel is not the default: docs/guide/variants.rst),
    float32 P.V."""
    if not _has("avx2"):
        pytest.skip("this CPU has no avx2 path")
    r = _probe(ZEN3)
    f = r["features"]
    assert f["best_path"] == f["kernel_path"] == "avx2"
    assert r["paths"] == ["portable", "avx2"]
    assert not (f["bf16_dot"] or f["int8_dot"] or f["avx_vnni"])
    assert set(f["masked"]) == {n.lstrip("-") for n in ZEN3.split(",")}
    assert r["int8_mode"] == 0 and r["bf16_mode"] == 0 and r["pv16_mode"] == 0
    assert r["int8_products"] == "float32"
    assert max(r["errs"]) < 1e-5


def test_alder_lake_mask_keeps_avx_vnni():
    """AVX2 + AVX-VNNI: the avx2 path, int8 Q.K^T on AVX-VNNI where this CPU
    has it (the default there), int16 P.V on vpdpwssd."""
    if not _has("avx2"):
        pytest.skip("this CPU has no avx2 path")
    r = _probe(ALDER_LAKE)
    f = r["features"]
    assert f["kernel_path"] == "avx2" and not (f["bf16_dot"] or f["int8_dot"])
    if f["avx_vnni"]:
        assert r["int8_mode"] == 5 and r["pv16_mode"] == 3
        assert r["int8_products"] == "int8-avxvnni"
    assert max(r["errs"][:1] + r["errs"][2:3]) < 1e-5       # float32 calls
    assert max(r["errs"]) < 5e-2                             # int8 ones


def test_no_avx2_mask_runs_the_portable_path():
    r = _probe("-avx2")
    assert r["paths"] == ["portable"] and r["features"]["kernel_path"] == "portable"
    assert not (r["features"]["avx_vnni"] or r["features"]["int8_dot"])
    assert r["int8_mode"] == 0
    assert max(r["errs"]) < 1e-5


def test_show_config_names_the_mask():
    env = dict(os.environ, ATTNCORE_CPU_FEATURES="-avx_vnni")
    r = subprocess.run([sys.executable, "-c", "import attncore; attncore.show_config()"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "ATTNCORE_CPU_FEATURES" in r.stdout and "avx_vnni" in r.stdout
    env.pop("ATTNCORE_CPU_FEATURES")
    r = subprocess.run([sys.executable, "-c", "import attncore; attncore.show_config()"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert "ATTNCORE_CPU_FEATURES" not in r.stdout
