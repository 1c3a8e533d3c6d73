"""Type stub of sampling.pyx (the sampler chain of csrc/sampling.h)."""
from collections.abc import Iterable

import numpy as np
from numpy.typing import NDArray
from typing_extensions import Self, disjoint_base

MAX_VOCAB: int

def argmax(x: NDArray[np.float32]) -> int: ...

@disjoint_base
class Chain:
    def __new__(cls, cap: int) -> Self: ...
    @property
    def cap(self) -> int: ...
    def sample(self, logits: NDArray[np.float32], history: Iterable[int], repeat_penalty: float, top_k: int,
               top_p: float, min_p: float, temperature: float, u: float) -> int: ...
