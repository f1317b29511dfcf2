"""The guide's examples run as doctests: ``pytest docs/guide`` (pyproject's
``--doctest-glob=*.rst``), part of the README's test command and of CI.

Every ``>>>`` example of a page runs, in order, in one namespace per page.
What a page's examples take from the reader's own program (a PyTorch
module, input arrays) is made here, in :data:`SETUP`, the way Sphinx's
``testsetup`` would: the page shows the call, this file the stand-in.  A
page whose setup or examples need an optional package names it in
:data:`REQUIRES`; without that package the page is skipped with the reason
(nothing fails).  Each page starts from NumPy's default print options and
an empty alignment registry of its own, and leaves neither changed.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("KERAS_BACKEND", "torch")

# optional packages each page's examples import (page: modules)
REQUIRES = {
    "mha.rst": ["torch"],
    "pytorch.rst": ["torch", "transformers"],
    "dask.rst": ["dask", "distributed"],
    "precision.rst": ["ml_dtypes"],
}


def _mha(ns, tmp):
    """mha.rst: the layers and arrays of the reader's model."""
    import torch

    import attncore

    rng = np.random.default_rng(0)
    E, H, hd = 512, 8, 64
    torch.manual_seed(0)
    ns["torch_mha"] = torch.nn.MultiheadAttention(E, H, batch_first=True)
    # Keras' get_weights() order: query, key, value kernels (E, H, key_dim)
    # and biases (H, key_dim), output kernel (H, key_dim, E) and bias (E,)
    kernel = lambda *s: rng.standard_normal(s).astype(np.float32) * 0.05  # noqa: E731
    ns["keras_mha"] = [kernel(E, H, hd), kernel(H, hd), kernel(E, H, hd), kernel(H, hd),
                       kernel(E, H, hd), kernel(H, hd), kernel(H, hd, E), kernel(E)]
    for nm in ("wq", "wk", "wv", "wo"):
        ns[nm] = kernel(E, E)
    ns["x"] = rng.standard_normal((2, 10, E), dtype=np.float32)
    ns["memory"] = rng.standard_normal((2, 15, E), dtype=np.float32)
    ns["valid"] = np.arange(15) < np.array([[15], [11]])
    ns["prompt"] = rng.standard_normal((1, 16, E), dtype=np.float32)
    ns["tokens"] = [rng.standard_normal((1, 1, E), dtype=np.float32) for _ in range(4)]
    ns["dec_cross_attn"] = attncore.MultiHeadAttention(E, H, rng=1)
    ns["h_t"] = rng.standard_normal((1, 1, E), dtype=np.float32)
    ns["memory_len"] = 15
    ns["enc_memory"] = ns["memory"][:1]


def _threads(ns, tmp):
    """threads.rst: a layer and its input."""
    import attncore

    ns["mha"] = attncore.MultiHeadAttention(256, 4, rng=0)
    ns["x"] = np.random.default_rng(0).standard_normal((2, 64, 256), dtype=np.float32)


def _pytorch(ns, tmp):
    """pytorch.rst: a small model's config, and the model saved where
    ``from_pretrained(path)`` finds it (nothing is downloaded)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    ns["config"] = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128,
                               num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, max_position_embeddings=128)
    LlamaForCausalLM(ns["config"]).save_pretrained(tmp)
    ns["path"] = str(tmp)


SETUP = {"mha.rst": _mha, "threads.rst": _threads, "pytorch.rst": _pytorch}


@pytest.fixture(autouse=True)
def _guide_page(request, doctest_namespace, monkeypatch, tmp_path):
    path = getattr(request.node, "path", None)
    if path is None or path.suffix != ".rst":
        yield
        return
    for mod in REQUIRES.get(path.name, ()):
        pytest.importorskip(mod, reason=f"{path.name}'s examples need {mod}")
    from attncore.alignments import _registry

    monkeypatch.setattr(_registry, "_default", _registry.Registry())
    setup = SETUP.get(path.name)
    if setup is not None:
        setup(doctest_namespace, tmp_path)
    printopts = np.get_printoptions()
    try:
        yield
    finally:
        np.set_printoptions(**printopts)
