"""Read by mypy (pyproject's ``[tool.mypy] files``), never run: the public
functions and methods keep their signatures for type checkers.  The
foreign-array decorator had erased them, so a user's type checker saw each
of these as ``Any`` and accepted any arguments."""
from typing import assert_type

import numpy as np

import attncore

x = np.ones((1, 2, 4, 8), np.float32)
kv8 = attncore.quantize_kv(x)
assert_type(kv8, tuple[np.ndarray, np.ndarray])
kv4 = attncore.quantize_kv(x, bits=4, rotate=True)
assert_type(kv4, attncore.QuantizedKV)
assert_type(attncore.varlen_attention(x[0], x[0], x[0], [0, 2], [0, 2]), np.ndarray)
assert_type(attncore.sinusoidal_encoding(5, 8), np.ndarray)
assert_type(attncore.add_positional_encoding(x), np.ndarray)
mha = attncore.MultiHeadAttention(8, 2)
assert_type(mha(x[0]), tuple[np.ndarray, np.ndarray | None])
att = attncore.Attention("dot")
memory = att.prepare(x[0])
assert_type(memory, attncore.Memory)
