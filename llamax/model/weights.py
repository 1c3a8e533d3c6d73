"""Weights of a model: dequantization to float32 and the product of a weight with activations.

A weight W [n_out, n_in] is kept twice: dequantized to float32 for BLAS (prefill, many tokens at
a time) and as the GGUF's raw blocks for the native quantized matmul (decode, where reading W
once per token is the whole cost).
"""
from __future__ import annotations

import numpy as np


def dequantize(ggml_type: int, raw: np.ndarray, shape: tuple[int, ...], n_threads: int | None = None) -> np.ndarray:
    """float32 array of `shape` from the raw bytes of a GGUF tensor of type ggml_type."""
    if ggml_type == 0:  # F32
        return np.ascontiguousarray(raw).view(np.float32).reshape(shape)
    if ggml_type == 1:  # F16
        return np.ascontiguousarray(raw).view(np.float16).astype(np.float32).reshape(shape)
    from gguf import quants

    return np.asarray(quants.dequantize(np.ascontiguousarray(raw), ggml_type), dtype=np.float32).reshape(shape)
