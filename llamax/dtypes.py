"""The type facts every module shares, in one place and read from the native constants.

Cache element types and their block layouts (ggml's type traits), the sequence-id bound
(LLAMA_MAX_SEQ), the position range, and the paddings llama.cpp applies to context sizes and
to the attended cell count. Nothing here is restated elsewhere: the other modules import it.
"""
from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from llamax._native import cells as _cells
from llamax._native import quants as _quants

__all__ = [
    "CACHE_TYPES", "QUANTIZED_CACHE_TYPES", "FLOAT_CACHE_DTYPES", "LLAMA_MAX_SEQ", "SEQ_WORDS", "POS_MAX",
    "N_CTX_PAD", "N_KV_PAD", "block_size", "block_bytes", "row_bytes", "pad", "check_cache_type",
    "seq_mask", "has_seq",
]

#: KV cache element types (llama.cpp's -ctk / -ctv names), in the native layer's order.
CACHE_TYPES: tuple[str, ...] = tuple(_quants.CACHE_TYPE_NAMES)
#: The block-quantized ones (ggml_is_quantized): one block of block_size values per block_bytes.
QUANTIZED_CACHE_TYPES: frozenset[str] = frozenset(t for t in CACHE_TYPES if _quants.block_size(t) > 1)
#: numpy element types of the unquantized cache types.
FLOAT_CACHE_DTYPES: dict[str, type] = {"f32": np.float32, "f16": np.float16}
assert set(FLOAT_CACHE_DTYPES) | QUANTIZED_CACHE_TYPES == set(CACHE_TYPES)

#: llama.cpp's LLAMA_MAX_SEQ (csrc's LX_MAX_SEQ): sequence ids live in [0, LLAMA_MAX_SEQ).
LLAMA_MAX_SEQ: int = int(_cells.MAX_SEQ)
#: uint64 words in a sequence bitset.
SEQ_WORDS: int = LLAMA_MAX_SEQ // 64
#: positions are int32; -1 marks an empty cell, so a stored position lies in [0, POS_MAX).
POS_MAX: int = 2**31 - 1

#: n_ctx and n_ctx_seq are padded to a multiple of this (GGML_PAD(n_ctx, 256)).
N_CTX_PAD: int = 256
#: attention looks at the used cells padded to this (llama_kv_cache::get_n_kv), so the shapes stay put.
N_KV_PAD: int = 256


def seq_mask(seq_ids: int | Iterable[int]) -> np.ndarray:
    """The sequence bitset of seq_ids (one id or any iterable of ids, repeats allowed): uint64[SEQ_WORDS]
    with bit s % 64 of word s // 64 set for each id s (csrc/common.h's lx_seq_bits; a cell's "seq" field,
    a row of Batch.seq_bits). O(LLAMA_MAX_SEQ + len(seq_ids)).

    Raises:
        ValueError: an id outside [0, LLAMA_MAX_SEQ).
    """
    mask = np.zeros(SEQ_WORDS, dtype=np.uint64)
    if isinstance(seq_ids, (int, np.integer)):  # one id: the common case, no array of ids
        s = int(seq_ids)
        if not 0 <= s < LLAMA_MAX_SEQ:
            raise ValueError(f"seq_id {s} is outside [0, {LLAMA_MAX_SEQ})")
        mask[s >> 6] = np.uint64(1 << (s & 63))
        return mask
    ids = np.fromiter(seq_ids, dtype=np.int64)
    if ids.size == 0:
        return mask
    bad = (ids < 0) | (ids >= LLAMA_MAX_SEQ)
    if bad.any():
        raise ValueError(f"seq_id {int(ids[np.argmax(bad)])} is outside [0, {LLAMA_MAX_SEQ})")
    flags = np.zeros(LLAMA_MAX_SEQ, dtype=np.bool_)
    flags[ids] = True
    mask[:] = np.packbits(flags, bitorder="little").view("<u8")
    return mask


def has_seq(bits: np.ndarray, seq_id: int) -> np.ndarray:
    """bool[n]: which rows of the bitsets bits (uint64[n, SEQ_WORDS]) hold sequence seq_id. O(n)."""
    s = int(seq_id)
    return ((bits[:, s >> 6] >> np.uint64(s & 63)) & np.uint64(1)).astype(bool)


def pad(x: int, n: int) -> int:
    """GGML_PAD: the smallest multiple of n that is >= x."""
    return (x + n - 1) // n * n


def block_size(t: str) -> int:
    """Values per block of cache type t (1 for f32/f16, 32 for q8_0/q4_0)."""
    return int(_quants.block_size(t))


def block_bytes(t: str) -> int:
    """Bytes per block of cache type t (34 for q8_0, 18 for q4_0)."""
    return int(_quants.block_bytes(t))


def row_bytes(t: str, n: int) -> int:
    """Bytes of a row of n values of type t (n a multiple of block_size(t))."""
    return int(_quants.row_bytes(t, n))


def check_cache_type(t: str, what: str) -> str:
    """t if it is a cache type, else ValueError naming `what`."""
    if t not in CACHE_TYPES:
        raise ValueError(f"{what} = {t!r}: not in the supported cache types {CACHE_TYPES}")
    return t
