"""Type stub of ssm.pyx (a Mamba layer's causal convolution and selective scan, csrc/ssm.h)."""
import numpy as np
from numpy.typing import NDArray

MAX_CONV: int

def conv(state: NDArray[np.float32], cells: NDArray[np.int32], x: NDArray[np.float32], w: NDArray[np.float32],
         b: NDArray[np.float32] | None, n_t: int, n_threads: int | None = None,
         hist: NDArray[np.float32] | None = None, hist_row: NDArray[np.int32] | None = None) -> NDArray[np.float32]: ...
def scan(state: NDArray[np.float32], cells: NDArray[np.int32], x: NDArray[np.float32], dt: NDArray[np.float32],
         A: NDArray[np.float32], B: NDArray[np.float32], C: NDArray[np.float32], D: NDArray[np.float32],
         z: NDArray[np.float32], n_t: int, n_threads: int | None = None,
         hist: NDArray[np.float32] | None = None, hist_row: NDArray[np.int32] | None = None,
         undo: NDArray[np.float32] | None = None, undo_slot: NDArray[np.int32] | None = None) -> NDArray[np.float32]: ...
