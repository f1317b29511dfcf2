"""attncore: fast CPU attention on NumPy and SciPy.

Scaled dot-product attention with boolean / additive / causal masks in
float32 and float64, computed tile by tile with an online softmax by a
Cython + OpenMP core that reaches BLAS through ``scipy.linalg.cython_blas``.

Public API
----------
scaled_dot_product_attention
    Batched (masked, causal, grouped-query) attention; with
    ``return_lse=True`` also the log-sum-exp of each query row.
varlen_attention
    Attention over a packed batch of variable-length sequences
    (flash-attention's varlen layout), without padding.
paged_attention
    Attention of packed queries over a paged key / value cache (mixed
    decode + prefill batches), the blocks read in place.
PagedKVCache
    The block pool of a paged cache: append, fork (copy on write), free,
    crop, block tables.
merge_attention
    Combine attention over disjoint key sets into attention over all keys.
show_config
    Versions, OpenMP and BLAS facts of this installation.
MultiHeadAttention, KVCache
    Multi-head (grouped-query) attention layer with PyTorch / Keras weight
    loaders, and its preallocated key/value cache for decoding.
sinusoidal_encoding, add_positional_encoding
    Sinusoidal positional encoding.
rotary_embedding
    Rotary position embeddings (RoPE) of queries and keys.
Attention, Alignment, alignments, plot_alignment
    Classic (seq2seq / spatial) attention with pluggable alignment
    functions, their registry, and a heat map of the weights.
"""
from .functional import merge_attention, scaled_dot_product_attention
from ._quant import quantize_kv
from ._kv4 import QuantizedKV
from ._varlen import varlen_attention
from ._paged import paged_attention
from ._paged_cache import PagedKVCache
from ._config import show_config
from ._kvcache import KVCache
from ._mha import MultiHeadAttention
from .positional import add_positional_encoding, sinusoidal_encoding
from ._rotary import rotary_embedding
from . import alignments
from .alignments import Alignment
from ._alignment_layer import Attention, Memory
from ._plot import plot_alignment

__version__ = "0.1.0"

__all__ = ["scaled_dot_product_attention", "merge_attention", "quantize_kv", "QuantizedKV",
           "show_config", "__version__"]
__all__ += ["MultiHeadAttention", "KVCache", "sinusoidal_encoding", "add_positional_encoding"]
__all__ += ["rotary_embedding", "varlen_attention", "paged_attention",
            "PagedKVCache"]
__all__ += ["Attention", "Memory", "Alignment", "alignments", "plot_alignment"]
