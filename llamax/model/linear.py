"""A weight matrix W [n_out, n_in] and its product with activations x [n_tokens, n_in].

Kept twice: float32 (dequantized once at load) for BLAS when many tokens come at once, and the
GGUF's raw blocks for the native quantized product when few do (a decode step), where the cost
is reading W and the raw blocks are 4-8x smaller than float32. Also the one RMSNorm the
architectures share.
"""
from __future__ import annotations

import numpy as np

from llamax._native import matmul
from llamax.model.gguf import GGUFFile

# up to this many tokens the native quantized product beats BLAS on dequantized float32
NATIVE_MAX_TOKENS = 8


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * w over the last axis (any leading shape); a new C-contiguous array."""
    ms = np.einsum("...i,...i->...", x, x) / np.float32(x.shape[-1])
    return x * (1.0 / np.sqrt(ms + np.float32(eps)))[..., None].astype(np.float32) * w


class Linear:
    """y = x @ W.T, for W one tensor or several stacked along n_out.

    W's raw blocks are kept as runs of consecutive tensors of one type (Q/K/V of a layer may mix
    Q5_0 and Q8_0): the native product runs once per run and the columns are joined.
    """

    def __init__(self, f32: np.ndarray, parts: list[tuple[np.ndarray, int]], n_threads: int) -> None:
        self.f32 = f32            # [n_out, n_in] float32, C-contiguous
        self.parts = parts        # [(raw [rows, row_bytes] uint8, ggml type)], rows summing to n_out
        self.n_threads = n_threads

    @property
    def shape(self) -> tuple[int, int]:
        return self.f32.shape

    @property
    def ggml_type(self) -> int:
        """The weights' type, -1 when the stacked tensors mix types."""
        return self.parts[0][1] if len(self.parts) == 1 else -1

    @classmethod
    def load(cls, g: GGUFFile, name: str, n_threads: int, f32: np.ndarray | None = None) -> "Linear":
        w = g.f32(name, n_threads) if f32 is None else f32
        return cls(np.ascontiguousarray(w, dtype=np.float32), [(np.ascontiguousarray(g.raw(name)), g.ggml_type(name))],
                   n_threads)

    @classmethod
    def concat(cls, g: GGUFFile, names: list[str], n_threads: int) -> "Linear":
        """The weights stacked along n_out (one product instead of several)."""
        f32 = np.ascontiguousarray(np.concatenate([g.f32(n, n_threads) for n in names], axis=0))
        runs: list[tuple[list[np.ndarray], int]] = []
        for n in names:
            t = g.ggml_type(n)
            if runs and runs[-1][1] == t:
                runs[-1][0].append(g.raw(n))
            else:
                runs.append(([g.raw(n)], t))
        parts = [(np.ascontiguousarray(np.concatenate(raws, axis=0)), t) for raws, t in runs]
        return cls(f32, parts, n_threads)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if x.shape[0] <= NATIVE_MAX_TOKENS:
            x = np.ascontiguousarray(x, dtype=np.float32)
            ys = [matmul.mul_mat(raw, t, x, n_threads=self.n_threads) for raw, t in self.parts]
            return ys[0] if len(ys) == 1 else np.concatenate(ys, axis=1)
        return x @ self.f32.T
