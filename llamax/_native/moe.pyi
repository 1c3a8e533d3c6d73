"""Type stub of moe.pyx (the mixture-of-experts feed-forward of csrc/moe.h; types are ggml type numbers)."""
import numpy as np
from numpy.typing import NDArray
from typing_extensions import disjoint_base

GATINGS: dict[str, int]
ACTS: dict[str, int]

def pack_experts(raw: NDArray[np.uint8], ggml_type: int, out: NDArray[np.uint8] | None = None) -> NDArray[np.uint8]: ...

@disjoint_base
class MoE:
    router: NDArray[np.uint8]  # readonly
    gate: NDArray[np.uint8]  # readonly
    up: NDArray[np.uint8]  # readonly
    down: NDArray[np.uint8]  # readonly
    def __init__(self, router: tuple[NDArray[np.uint8], int], gate: tuple[NDArray[np.uint8], int],
                 up: tuple[NDArray[np.uint8], int], down: tuple[NDArray[np.uint8], int], n_used: int, *,
                 gating: str = "softmax", norm_w: bool = False, w_scale: float = 0.0, act: str = "silu",
                 gelu_table: NDArray[np.float32] | None = None, r8: bool = True) -> None: ...
    @property
    def n_embd(self) -> int: ...
    @property
    def n_ff_exp(self) -> int: ...
    @property
    def n_expert(self) -> int: ...
    @property
    def n_used(self) -> int: ...
    def forward(self, x: NDArray[np.float32], n_threads: int | None = None, ref: bool = False,
                out: NDArray[np.float32] | None = None) -> NDArray[np.float32]: ...
    def route(self, x: NDArray[np.float32], n_threads: int | None = None) -> tuple[NDArray[np.int32], NDArray[np.float32]]: ...
