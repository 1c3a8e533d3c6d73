"""Type stub of attention.pyx (attention over one layer's KV cache, csrc/attention.h; layouts in its docstring)."""
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

MAX_D: int
CHUNK: int
MAX_GROUP: int
MAX_ERR: float

def _set_min_work(macs: int) -> None: ...
def fp32_to_fp16(x: ArrayLike) -> NDArray[np.float16]: ...
def fp32_to_fp16_ref(x: ArrayLike) -> NDArray[np.float16]: ...
def fp16_to_fp32(x: ArrayLike) -> NDArray[np.float32]: ...
def fp16_to_fp32_ref(x: ArrayLike) -> NDArray[np.float32]: ...
def attn(q: NDArray[np.float32], k: NDArray[Any], v: NDArray[Any], mask: NDArray[np.float32],
         out: NDArray[np.float32] | None = None, *, n_kv: int, scale: float, softcap: float = 0.0,
         v_trans: bool = False, n_threads: int | None = None, use_scratch: bool = True,
         type_k: int | str | None = None, type_v: int | str | None = None,
         perm: ArrayLike | None = None) -> NDArray[np.float32]: ...
def attn_ref(q: NDArray[np.float32], k: NDArray[Any], v: NDArray[Any], mask: NDArray[np.float32],
             out: NDArray[np.float32] | None = None, *, n_kv: int, scale: float, softcap: float = 0.0,
             v_trans: bool = False, n_threads: int | None = None,
             type_k: int | str | None = None, type_v: int | str | None = None,
             perm: ArrayLike | None = None) -> NDArray[np.float32]: ...
