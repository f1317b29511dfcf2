# Stub for the compiled dense-layer helper (private; see attncore._linear).
from typing import Optional

import numpy as np

def linear(x: np.ndarray, w: np.ndarray, bias: Optional[np.ndarray], out: np.ndarray,
           nthreads: int, w_fmt: int = ..., bf16dot: int = ...,
           wblock: int = ...) -> None: ...
def set_blas_local(addresses: tuple[int, ...]) -> None: ...
def set_kernel_path(path: int) -> bool: ...
