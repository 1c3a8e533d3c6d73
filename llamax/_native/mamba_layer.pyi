"""Type stub of mamba_layer.pyx (the Mamba-1 layer of csrc/mamba_layer.h: the native MambaStack)."""
from typing import Any

import numpy as np
from numpy.typing import NDArray
from typing_extensions import disjoint_base

@disjoint_base
class MambaStack:
    n_layer: int  # readonly
    n_embd: int  # readonly
    def __init__(self, layers: list[dict[str, Any]]) -> None: ...
    # views: one llamax.memory.recurrent RecurrentView per layer
    def forward(self, x: NDArray[np.float32], views: list[Any], n_t: int,
                n_threads: int | None = None) -> NDArray[np.float32]: ...
