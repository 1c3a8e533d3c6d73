"""A weight matrix W [n_out, n_in] and its product with activations x [n_tokens, n_in]; the token
embedding; the one RMSNorm the architectures share.

W stays in the GGUF's blocks (no float32 copy of any weight matrix) and every product is native,
through the one rule of csrc/product.h (gemm.product), which the native layer step follows too. For
the types the GEMM has (csrc/gemm.h: q4_0, q4_1, q5_0, q5_1, q8_0, q4_K, q5_K, q6_K: every registry
model's) the activations are rounded per block to the weight's dot type as ggml does (q8_0 / q8_1 /
q8_K), so the numerics are llama.cpp's CPU ones, and a token's result is the same bits whatever
else is in the batch (decode step, prefill, chunked prompt: one fixed arithmetic per output). Other
types (f16, f32, bf16, q2_K, q3_K weights) take the float product (csrc/matmul.h: x times the
dequantized W).
"""
from __future__ import annotations

import weakref
from typing import NamedTuple

import numpy as np

from llamax._native import gemm, quants
from llamax._native import layer as _layer
from llamax.model.gguf import GGUFFile


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * w over the last axis (any leading shape), as ggml's rms_norm and
    the native layer step compute it (csrc/layer.h); a new C-contiguous array."""
    return _layer.rms_norm(x, w, eps)


class WeightSlab:
    """Large 2 MB-aligned blocks that the repacked weights of one GGUF file are carved from.

    A decode step streams every weight once; in blocks of this size numpy's allocator asks the
    kernel for transparent huge pages (madvise), so the stream takes one TLB entry per 2 MB instead
    of per 4 KB page (the matrices alone, 0.2-1 MB each, would never be huge-paged). A piece is a
    view: the block lives as long as any of its weights."""

    BLOCK = 64 << 20
    ALIGN = 2 << 20

    def __init__(self) -> None:
        self._block: np.ndarray | None = None
        self._off = 0

    def take(self, shape: tuple[int, int]) -> np.ndarray:
        """A new uint8 array of this shape (contents undefined), 64-byte aligned."""
        n = int(shape[0]) * int(shape[1])
        if self._block is None or self._off + n > self._block.size:
            size = max(self.BLOCK, n)
            raw = np.empty(size + self.ALIGN, np.uint8)
            start = (-raw.ctypes.data) % self.ALIGN
            self._block, self._off = raw[start:start + size], 0
        piece = self._block[self._off:self._off + n].reshape(shape)
        self._off = (self._off + n + 63) & ~63
        return piece


_slabs: "weakref.WeakKeyDictionary[GGUFFile, WeightSlab]" = weakref.WeakKeyDictionary()


def _slab(g: GGUFFile) -> WeightSlab:
    """The slab of this file's weights (one per open GGUFFile)."""
    slab = _slabs.get(g)
    if slab is None:
        slab = _slabs[g] = WeightSlab()
    return slab


class Part(NamedTuple):
    """Rows of W of one ggml type: the GGUF's rows, or (r8) the GEMM's row-interleaved layout of
    them (gemm.pack_r8: 8 rows interleaved 4 bytes at a time, padded to a multiple of 8), which the
    decode step streams best."""

    raw: np.ndarray   # uint8 [rows, row_bytes], or [ceil(rows / 8) * 8, row_bytes] when r8
    type: int
    rows: int
    r8: bool

    @classmethod
    def load(cls, g: GGUFFile, names: list[str], t: int) -> "Part":
        """Tensors of type t stacked along n_out as one Part, copied into the file's WeightSlab:
        repacked to r8 when the type has that layout, else the GGUF's rows; the mapping's pages of
        the tensors are released."""
        raws = [g.raw(n) for n in names]
        rows, row_bytes = sum(r.shape[0] for r in raws), raws[0].shape[1]
        slab = _slab(g)
        if t in gemm.R8_TYPES:   # 8-row groups may straddle two tensors: pack their rows joined
            raw = raws[0] if len(raws) == 1 else np.concatenate(raws, axis=0)
            out = slab.take(((rows + 7) // 8 * 8, row_bytes))
            part = cls(gemm.pack_r8(np.ascontiguousarray(raw), t, out=out), t, rows, True)
        else:                    # each tensor straight into its rows of the piece
            out, r0 = slab.take((rows, row_bytes)), 0
            for r in raws:
                out[r0:r0 + r.shape[0]] = r
                r0 += r.shape[0]
            part = cls(out, t, rows, False)
        for n in names:
            g.release(n)
        return part

    def product(self, x: np.ndarray, n_threads: int) -> np.ndarray:
        """x @ W.T, float32 [len(x), rows], through csrc/product.h's engine for this type and layout."""
        return gemm.product(self.raw, self.type, x, r8=self.r8, n_out=self.rows, n_threads=n_threads)


class Linear:
    """y = x @ W.T, for W one tensor or several stacked along n_out.

    W is kept as runs of consecutive tensors of one type (Q/K/V of a layer may mix Q5_0 and Q8_0),
    each one Part: the product runs once per run and the columns are joined. Every Part is a copy in
    the file's WeightSlab (the r8 types q4_0, q4_1, q5_0, q8_0, q4_K, q5_K, q6_K repacked), and the mapping's pages of
    its tensors are released.
    """

    def __init__(self, parts: list[Part], n_in: int, n_threads: int) -> None:
        self.parts = parts        # rows summing to n_out
        self.n_in = n_in
        self.n_threads = n_threads

    @classmethod
    def load(cls, g: GGUFFile, name: str, n_threads: int) -> "Linear":
        return cls.concat(g, [name], n_threads)

    @classmethod
    def concat(cls, g: GGUFFile, names: list[str], n_threads: int) -> "Linear":
        """The weights stacked along n_out (one product instead of several)."""
        runs: list[tuple[list[str], int]] = []
        for n in names:
            t = g.ggml_type(n)
            if runs and runs[-1][1] == t:
                runs[-1][0].append(n)
            else:
                runs.append(([n], t))
        return cls([Part.load(g, run, t) for run, t in runs], g.shape(names[0])[1], n_threads)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        ys = [p.product(x, self.n_threads) for p in self.parts]
        return ys[0] if len(ys) == 1 else np.concatenate(ys, axis=1)


class Embedding:
    """The token embedding [n_vocab, n_embd], also the tied output: one Part (the r8 layout for q4_0,
    q4_1, q5_0, q8_0: both registry models' Q8_0, so a decode step's logits stream it once,
    contiguously; else the GGUF's rows)."""

    def __init__(self, g: GGUFFile, name: str, n_threads: int) -> None:
        self.type = g.ggml_type(name)
        self.n_vocab, self.n_embd = g.shape(name)
        self.n_threads = n_threads
        self.part = Part.load(g, [name], self.type)

    @property
    def r8(self) -> bool:
        return self.part.r8

    @property
    def raw(self) -> np.ndarray:
        return self.part.raw

    def rows(self, tokens: np.ndarray, scale: np.float32 | None = None) -> np.ndarray:
        """float32 [len(tokens), n_embd]: the rows of these tokens, dequantized (ggml_get_rows), each
        value times scale when given (an embedding scale)."""
        if self.r8:   # one native call (a decode step's embedding row)
            return gemm.rows_r8_f32(self.raw, self.type, tokens, None if scale is None else float(scale))
        x = quants.dequantize(self.type, self.raw[tokens], (len(tokens), self.n_embd), self.n_threads)
        if scale is not None:
            x *= scale
        return x

    def logits(self, x: np.ndarray) -> np.ndarray:
        """x @ E.T, float32 [n, n_vocab], from the blocks: the same bits in either layout (gemm.h)."""
        return self.part.product(np.ascontiguousarray(x, dtype=np.float32), self.n_threads)
