"""Dequantization of GGUF tensors to float32 (the native kernels, bit-exact with ggml's)."""
from __future__ import annotations

import numpy as np

from llamax._native import quants


def dequantize(ggml_type: int, raw: np.ndarray, shape: tuple[int, ...], n_threads: int | None = None) -> np.ndarray:
    """float32 array of `shape` from the raw bytes of a GGUF tensor of type ggml_type."""
    if not quants.can_dequantize(ggml_type):
        from llamax.errors import ModelError

        raise ModelError(f"tensor type {ggml_type} cannot be dequantized")
    return quants.dequantize(ggml_type, np.ascontiguousarray(raw), tuple(shape), n_threads)
