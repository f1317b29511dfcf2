# Stub for the compiled fused additive-attention driver (private; see
# attncore._alignment_layer).
import numpy as np
from typing import Optional

def additive_attention(
    qp: np.ndarray, kp: np.ndarray, v: np.ndarray, mask: Optional[np.ndarray],
    values: np.ndarray, out: np.ndarray, weights: Optional[np.ndarray],
    block: int, nthreads: int, factored: bool = ...,
) -> None: ...
def tanh_array(x: np.ndarray) -> np.ndarray: ...
def set_blas_local(addresses: tuple[int, ...]) -> None: ...
