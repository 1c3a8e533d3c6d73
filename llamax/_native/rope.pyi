"""Type stub of rope.pyx (ggml's RoPE and llama.cpp's K-shift, csrc/rope.h; kind 0 norm, 2 neox)."""
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

ROPE_NORM: int
ROPE_NEOX: int
ROPE_MAX_ROT: int

def rope_cache(p: int, n_rot: int, freq_base: float = 10000.0, freq_scale: float = 1.0) -> NDArray[np.float32]: ...
def rope_f32(x: NDArray[np.float32], pos: ArrayLike, n_rot: int, freq_base: float = 10000.0, freq_scale: float = 1.0,
             kind: int = 0, n_threads: int | None = None) -> NDArray[np.float32]: ...
def rope_f32_ref(x: NDArray[np.float32], pos: ArrayLike, n_rot: int, freq_base: float = 10000.0,
                 freq_scale: float = 1.0, kind: int = 0) -> NDArray[np.float32]: ...
def k_shift(k_rows: NDArray[Any], shift: ArrayLike, n_head_kv: int, head_dim: int, n_rot: int,
            freq_base: float = 10000.0, freq_scale: float = 1.0, kind: int = 0, n_threads: int | None = None, *,
            type: int | str | None = None, rot_block: int = 0) -> NDArray[Any]: ...
def k_shift_ref(k_rows: NDArray[Any], shift: ArrayLike, n_head_kv: int, head_dim: int, n_rot: int,
                freq_base: float = 10000.0, freq_scale: float = 1.0, kind: int = 0, *,
                type: int | str | None = None, rot_block: int = 0) -> NDArray[Any]: ...
