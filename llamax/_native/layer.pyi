"""Type stub of layer.pyx (the decoder layer of csrc/layer.h: rms_norm, the gated FFN, the native Stack)."""
from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray
from typing_extensions import disjoint_base

ACTS: dict[str, int]

def _set_team(on: bool) -> None: ...
def _team_runs() -> int: ...
def rms_norm(x: ArrayLike, w: ArrayLike, eps: float, n_threads: int | None = 1, ref: bool = False) -> NDArray[np.float32]: ...
def gated(gu: ArrayLike, n_ff: int, act: str = "silu", gelu_table: NDArray[np.float32] | None = None,
          n_threads: int | None = 1, ref: bool = False) -> NDArray[np.float32]: ...

@disjoint_base
class Stack:
    n_layer: int  # readonly
    n_embd: int  # readonly
    def __init__(self, layers: list[dict[str, Any]]) -> None: ...
    # views: one llamax.memory LayerView per layer
    def forward(self, x: NDArray[np.float32], pos: ArrayLike, views: list[Any],
                out_rows: Sequence[int] | NDArray[Any] | None = None,
                n_threads: int | None = None) -> NDArray[np.float32]: ...
