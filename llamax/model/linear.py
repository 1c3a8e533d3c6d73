"""A weight matrix W [n_out, n_in] and its product with activations x [n_tokens, n_in].

Kept twice: float32 (dequantized once at load) for BLAS when many tokens come at once, and the
GGUF's raw blocks for the native quantized product when few do (a decode step), where the cost
is reading W and the raw blocks are 4-8x smaller than float32.
"""
from __future__ import annotations

import numpy as np

from llamax._native import matmul
from llamax.model.gguf import GGUFFile

# up to this many tokens the native quantized product beats BLAS on dequantized float32
NATIVE_MAX_TOKENS = 8


class Linear:
    """y = x @ W.T."""

    def __init__(self, f32: np.ndarray, raw: np.ndarray | None, ggml_type: int, n_threads: int) -> None:
        self.f32 = f32            # [n_out, n_in] float32, C-contiguous
        self.raw = raw            # [n_out, row_bytes] uint8 or None
        self.ggml_type = ggml_type
        self.n_threads = n_threads

    @property
    def shape(self) -> tuple[int, int]:
        return self.f32.shape

    @classmethod
    def load(cls, g: GGUFFile, name: str, n_threads: int, f32: np.ndarray | None = None) -> "Linear":
        t = g.ggml_type(name)
        w = g.f32(name, n_threads) if f32 is None else f32
        return cls(np.ascontiguousarray(w, dtype=np.float32), np.ascontiguousarray(g.raw(name)), t, n_threads)

    @classmethod
    def concat(cls, g: GGUFFile, names: list[str], n_threads: int) -> "Linear":
        """The weights stacked along n_out (one product instead of several)."""
        types = {g.ggml_type(n) for n in names}
        f32 = np.concatenate([g.f32(n, n_threads) for n in names], axis=0)
        raw = np.concatenate([g.raw(n) for n in names], axis=0) if len(types) == 1 else None
        return cls(f32, raw, types.pop() if len(types) == 1 else -1, n_threads)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if self.raw is not None and x.shape[0] <= NATIVE_MAX_TOKENS:
            return matmul.mul_mat(self.raw, self.ggml_type, np.ascontiguousarray(x, dtype=np.float32),
                                  n_threads=self.n_threads)
        return x @ self.f32.T
