"""Type stub of ssd.pyx (a Mamba-2 layer's selective scan, csrc/ssd.h)."""
import numpy as np
from numpy.typing import NDArray

def scan(state: NDArray[np.float32], cells: NDArray[np.int32], x: NDArray[np.float32], dt: NDArray[np.float32],
         A: NDArray[np.float32], B: NDArray[np.float32], C: NDArray[np.float32], D: NDArray[np.float32],
         z: NDArray[np.float32], n_t: int, n_group: int, n_threads: int | None = None,
         hist: NDArray[np.float32] | None = None, hist_row: NDArray[np.int32] | None = None,
         undo: NDArray[np.float32] | None = None, undo_slot: NDArray[np.int32] | None = None) -> NDArray[np.float32]: ...
