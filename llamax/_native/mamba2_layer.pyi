"""Type stub of mamba2_layer.pyx (the Mamba-2 mixer of csrc/mamba2_layer.h: the native Mamba2Layers)."""
from typing import Any

import numpy as np
from numpy.typing import NDArray
from typing_extensions import disjoint_base

@disjoint_base
class Mamba2Layers:
    n_layer: int  # readonly
    n_embd: int  # readonly
    def __init__(self, layers: list[dict[str, Any]]) -> None: ...
    # views: one llamax.memory.recurrent RecurrentView per layer
    def forward(self, x: NDArray[np.float32], views: list[Any], n_t: int,
                n_threads: int | None = None) -> NDArray[np.float32]: ...
    def mixer(self, il: int, h: NDArray[np.float32], view: Any, n_t: int,
              n_threads: int | None = None) -> NDArray[np.float32]: ...
