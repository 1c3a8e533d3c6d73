"""Type stub of matmul.pyx (y = x @ W.T in float32 over the dequantized W, csrc/matmul.h; w_type a ggml type number)."""
from typing import Any

import numpy as np
from numpy.typing import NDArray

TILE: int
ROWS: int
NT: int

def err_factor(n_in: int) -> float: ...
def mul_mat(w: NDArray[Any], w_type: int, x: NDArray[np.float32], out: NDArray[np.float32] | None = None,
            n_threads: int | None = None) -> NDArray[np.float32]: ...
def mul_mat_ref(w: NDArray[Any], w_type: int, x: NDArray[np.float32]) -> NDArray[np.float32]: ...
def mul_mat_f32_ordered(w: NDArray[np.float32], x: NDArray[np.float32],
                        n_threads: int | None = None) -> NDArray[np.float32]: ...
