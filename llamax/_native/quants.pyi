"""Type stub of quants.pyx (ggml's block formats, csrc/quants.h).

A type argument `t` is a ggml type number (TYPE_Q4_0, ...) or a name ("q4_0", "Q4_0", "f16", ...).
"""
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

_Type = int | str

TYPE_F32: int
TYPE_F16: int
TYPE_Q4_0: int
TYPE_Q4_1: int
TYPE_Q5_0: int
TYPE_Q5_1: int
TYPE_Q8_0: int
TYPE_Q8_1: int
TYPE_Q2_K: int
TYPE_Q3_K: int
TYPE_Q4_K: int
TYPE_Q5_K: int
TYPE_Q6_K: int
TYPE_Q8_K: int
TYPE_BF16: int
TYPE_NAMES: dict[int, str]
CACHE_TYPE_NAMES: tuple[str, ...]

def type_id(t: _Type) -> int: ...
def type_name(t: _Type) -> str: ...
def block_size(t: _Type) -> int: ...
def block_bytes(t: _Type) -> int: ...
def row_bytes(t: _Type, n: int) -> int: ...
def can_dequantize(t: _Type) -> bool: ...
def dequantize(t: _Type, raw: NDArray[Any], shape: tuple[int, ...], n_threads: int | None = None) -> NDArray[np.float32]: ...
def dequantize_ref(t: _Type, raw: NDArray[Any], shape: tuple[int, ...]) -> NDArray[np.float32]: ...
def quantize(t: _Type, x: ArrayLike) -> NDArray[np.uint8]: ...
def quantize_ref(t: _Type, x: ArrayLike) -> NDArray[np.uint8]: ...
def set_rows(t: _Type, src: ArrayLike, dst: NDArray[Any], idxs: ArrayLike, n_threads: int | None = None) -> NDArray[Any]: ...
def set_rows_ref(t: _Type, src: ArrayLike, dst: NDArray[Any], idxs: ArrayLike) -> NDArray[Any]: ...
