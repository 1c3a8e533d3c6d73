"""The memory interface (llama.cpp's llama_memory_i) shared by every cache type.

A memory holds what a context remembers between decodes. The context talks to it only through
this interface: the seq_* operations, plan() (init_batch: split a batch and reserve its slots
without changing anything), update() (pending K-shift and stream copies), and per layer store()
and attend() while a plan is being applied. Nothing mutates the cells except the seq_* operations
and the application of a plan's ubatches.
"""
from __future__ import annotations

import abc
from typing import Iterator


class Memory(abc.ABC):
    """Abstract base of KVCache and KVCacheISWA."""

    # ---- sequences (llama_memory_seq_*) -------------------------------------------------------
    @abc.abstractmethod
    def clear(self, data: bool = True) -> None:
        """Empty every cell; with data=True also zero the K/V buffers."""

    @abc.abstractmethod
    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        """Remove seq_id (every sequence if -1) from the cells with pos in [p0, p1).

        p0 < 0 means 0 and p1 < 0 means infinity. Returns True (a KV cache can always remove)."""

    @abc.abstractmethod
    def seq_cp(self, seq_id_src: int, seq_id_dst: int, p0: int = -1, p1: int = -1) -> None:
        """Make the cells of src in [p0, p1) part of dst too (no copy within a stream)."""

    @abc.abstractmethod
    def seq_keep(self, seq_id: int) -> None:
        """Drop every sequence but seq_id."""

    @abc.abstractmethod
    def seq_add(self, seq_id: int, p0: int, p1: int, shift: int) -> None:
        """Add shift to the positions of seq_id in [p0, p1); K is rotated at the next update."""

    @abc.abstractmethod
    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        """Divide the positions of seq_id in [p0, p1) by d > 0; K is rotated at the next update."""

    @abc.abstractmethod
    def seq_pos_min(self, seq_id: int) -> int:
        """Smallest position of seq_id in the memory, -1 if none."""

    @abc.abstractmethod
    def seq_pos_max(self, seq_id: int) -> int:
        """Largest position of seq_id in the memory, -1 if none."""

    # ---- shape ----------------------------------------------------------------------------------
    @property
    @abc.abstractmethod
    def can_shift(self) -> bool:
        """True if seq_add / seq_div may change positions (K can be rotated)."""

    @property
    @abc.abstractmethod
    def n_cells(self) -> int:
        """Total cells (over every stream and sub-cache)."""

    @property
    @abc.abstractmethod
    def n_used(self) -> int:
        """Cells in use."""

    @property
    @abc.abstractmethod
    def n_seq_max(self) -> int:
        """Number of sequence ids the memory accepts."""

    @abc.abstractmethod
    def breakdown(self) -> dict[str, int]:
        """Bytes per buffer."""

    @abc.abstractmethod
    def cells(self) -> list[tuple[int, frozenset[int]]]:
        """(pos, sequence ids) of every cell in cell order; (-1, frozenset()) when empty."""

    # ---- decoding -------------------------------------------------------------------------------
    @abc.abstractmethod
    def update(self) -> bool:
        """Apply pending stream copies and K-shifts (llama_memory_i::init_update). True if anything ran."""

    @abc.abstractmethod
    def plan(self, batch, n_ubatch: int = 512, **kwargs) -> "Iterator":
        """Validate and split the batch and reserve slots for all of it (init_batch)."""

    @abc.abstractmethod
    def store(self, il: int, ubatch, k, v) -> None:
        """Write the K/V rows of the ubatch being applied for layer il."""

    @abc.abstractmethod
    def attend(self, il: int, ubatch, q, *, scale: float | None = None, softcap: float = 0.0):
        """Attention of the ubatch's queries over layer il of the cache."""
