"""Type stub of delta_net.pyx (the gated delta rule of a linear-attention layer, csrc/delta_net.h)."""
import numpy as np
from numpy.typing import NDArray

def rule(state: NDArray[np.float32], cells: NDArray[np.int32], q: NDArray[np.float32], k: NDArray[np.float32],
         v: NDArray[np.float32], g: NDArray[np.float32], beta: NDArray[np.float32], n_t: int,
         n_threads: int | None = None, hist: NDArray[np.float32] | None = None,
         hist_row: NDArray[np.int32] | None = None,
         undo: NDArray[np.float32] | None = None, undo_slot: NDArray[np.int32] | None = None) -> NDArray[np.float32]: ...
