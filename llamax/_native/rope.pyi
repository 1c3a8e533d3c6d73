"""Type stub of rope.pyx (ggml's RoPE and llama.cpp's K-shift, csrc/rope.h; kind 0 norm, 2 neox).

The keyword-only scaling arguments (freq_factors float32 [n_rot/2] or None, ext_factor, attn_factor,
corr_dims) default to plain RoPE."""
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

ROPE_NORM: int
ROPE_NEOX: int
ROPE_MAX_ROT: int

def yarn_corr_dims(n_dims: int, n_ctx_orig: int, freq_base: float, beta_fast: float = 32.0,
                   beta_slow: float = 1.0) -> tuple[float, float]: ...
def rope_cache(p: int, n_rot: int, freq_base: float = 10000.0, freq_scale: float = 1.0, *,
               freq_factors: NDArray[np.float32] | None = None, ext_factor: float = 0.0, attn_factor: float = 1.0,
               corr_dims: tuple[float, float] = (0.0, 0.0)) -> NDArray[np.float32]: ...
def rope_f32(x: NDArray[np.float32], pos: ArrayLike, n_rot: int, freq_base: float = 10000.0, freq_scale: float = 1.0,
             kind: int = 0, n_threads: int | None = None, *, freq_factors: NDArray[np.float32] | None = None,
             ext_factor: float = 0.0, attn_factor: float = 1.0,
             corr_dims: tuple[float, float] = (0.0, 0.0)) -> NDArray[np.float32]: ...
def rope_f32_ref(x: NDArray[np.float32], pos: ArrayLike, n_rot: int, freq_base: float = 10000.0,
                 freq_scale: float = 1.0, kind: int = 0, *, freq_factors: NDArray[np.float32] | None = None,
                 ext_factor: float = 0.0, attn_factor: float = 1.0,
                 corr_dims: tuple[float, float] = (0.0, 0.0)) -> NDArray[np.float32]: ...
def k_shift(k_rows: NDArray[Any], shift: ArrayLike, n_head_kv: int, head_dim: int, n_rot: int,
            freq_base: float = 10000.0, freq_scale: float = 1.0, kind: int = 0, n_threads: int | None = None, *,
            type: int | str | None = None, rot_block: int = 0, freq_factors: NDArray[np.float32] | None = None,
            ext_factor: float = 0.0, attn_factor: float = 1.0,
            corr_dims: tuple[float, float] = (0.0, 0.0)) -> NDArray[Any]: ...
def k_shift_ref(k_rows: NDArray[Any], shift: ArrayLike, n_head_kv: int, head_dim: int, n_rot: int,
                freq_base: float = 10000.0, freq_scale: float = 1.0, kind: int = 0, *,
                type: int | str | None = None, rot_block: int = 0, freq_factors: NDArray[np.float32] | None = None,
                ext_factor: float = 0.0, attn_factor: float = 1.0,
                corr_dims: tuple[float, float] = (0.0, 0.0)) -> NDArray[Any]: ...
