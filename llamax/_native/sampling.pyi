"""Type stub of sampling.pyx (the sampler chain and the logprobs of csrc/sampling.h)."""
from collections.abc import Collection

import numpy as np
from numpy.typing import NDArray
from typing_extensions import Self, disjoint_base

MAX_VOCAB: int
LOGPROBS_MAX_K: int

def argmax(x: NDArray[np.float32]) -> int: ...

@disjoint_base
class Chain:
    def __new__(cls, cap: int) -> Self: ...
    @property
    def cap(self) -> int: ...
    def sample(self, logits: NDArray[np.float32], history: Collection[int], repeat_penalty: float, top_k: int,
               top_p: float, min_p: float, temperature: float, u: float, *, frequency_penalty: float = 0.0,
               presence_penalty: float = 0.0, allowed: NDArray[np.uint32] | None = None,
               bias_ids: NDArray[np.int32] | None = None, bias_values: NDArray[np.float32] | None = None) -> int: ...

def logprobs(row: NDArray[np.float32], token: int, k: int
             ) -> tuple[float, NDArray[np.int32], NDArray[np.float32]]: ...
def logprobs_rows(rows: NDArray[np.float32], tokens: NDArray[np.int32], k: int, n_threads: int | None = None
                  ) -> tuple[NDArray[np.float32], NDArray[np.int32], NDArray[np.float32]]: ...
