"""Type stub of kq_mask.pyx (the attention mask of one ubatch, csrc/kq_mask.h)."""
from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

KQ_MASK_PAD: int
SWA_NONE: int
SWA_STANDARD: int
SWA_CHUNKED: int
SWA_SYMMETRIC: int

# cell_pos / cell_seq: per stream, one array each (a list, or an array with the stream axis first)
_PerStream = Sequence[NDArray[Any]] | NDArray[Any]

def kq_mask_n_tps_pad(n_tps: int) -> int: ...
def kq_mask_fill(cell_pos: _PerStream, cell_seq: _PerStream, tok_pos: ArrayLike, tok_seq: ArrayLike,
                 causal: bool = True, n_swa: int = 0, swa_type: int = 0, alibi: bool = False,
                 n_threads: int | None = None, out: NDArray[np.float32] | None = None,
                 scratch: bool = True) -> NDArray[np.float32]: ...
def kq_mask_fill_ref(cell_pos: _PerStream, cell_seq: _PerStream, tok_pos: ArrayLike, tok_seq: ArrayLike,
                     causal: bool = True, n_swa: int = 0, swa_type: int = 0, alibi: bool = False,
                     out: NDArray[np.float32] | None = None) -> NDArray[np.float32]: ...
def cells_in_order(cell_pos: NDArray[np.int32], cell_seq: NDArray[np.uint64], seqs: NDArray[np.int32]) -> bool: ...
