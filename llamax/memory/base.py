"""The memory interface (llama.cpp's llama_memory_i) shared by every cache type.

A memory holds what a context remembers between decodes. The context talks to it only through
this interface: the seq_* operations, plan() (init_batch: split a batch and reserve its slots
without changing anything), update() (pending K-shift and stream copies), and per layer store()
and attend() while a plan is being applied. Plan, make_allocator and split_batch are the planning
machinery every cache shares (llama_batch_allocr + llama_memory_context_i). Nothing mutates the cells except the seq_* operations
and the application of a plan's ubatches.
"""
from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Callable, Iterator

import numpy as np

from llamax.batch import Batch, BatchAllocator, UBatch
from llamax.errors import BatchError

if TYPE_CHECKING:
    from llamax.state import StateReader, StateWriter


def pad(x: int, n: int) -> int:
    """x rounded up to a multiple of n (GGML_PAD)."""
    return (x + n - 1) // n * n


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
    def plan(self, batch, n_ubatch: int = 512, **kwargs) -> "Plan":
        """Validate and split the batch and reserve slots for all of it (init_batch)."""

    @abc.abstractmethod
    def store(self, il: int, ubatch, k, v) -> None:
        """Write the K/V rows of the ubatch being applied for layer il."""

    @abc.abstractmethod
    def attend(self, il: int, ubatch, q, *, scale: float | None = None, softcap: float = 0.0):
        """Attention of the ubatch's queries over layer il of the cache."""

    # ---- state (llama_state_*; the format is in llamax/state.py) --------------------------------
    @abc.abstractmethod
    def state_write(self, w: "StateWriter", seq_id: int = -1) -> None:
        """Append this memory's section to a state: every sequence (seq_id -1) or only seq_id's cells.

        Only cells the sliding window still shows to a sequence holding them are written."""

    @abc.abstractmethod
    def state_read(self, r: "StateReader", seq_id: int = -1) -> Callable[[], None]:
        """Parse and validate this memory's section of a state without changing anything, and return
        the function that installs it: the whole memory (seq_id -1), or the saved sequence as seq_id.

        Raises:
            StateError: the section does not fit this memory (configuration, counts, ids).
        """


class Plan:
    """The ubatches of one batch with their reserved slots (llama_memory_context_i).

    Iterating applies each ubatch to the cells (apply_ubatch) and yields it; between two steps the
    caller stores K/V and attends for every layer. A plan that raised nothing fits entirely.
    """

    def __init__(self, memory: "Memory", balloc: BatchAllocator, ubatches: list[UBatch], slots: list):
        self.memory = memory
        self.balloc = balloc
        self.ubatches = ubatches
        self.slots = slots  # per sub-cache, a list of (strm, idxs) per ubatch

    def __len__(self) -> int:
        return len(self.ubatches)

    def __iter__(self) -> Iterator[UBatch]:
        for u, ub in enumerate(self.ubatches):
            self.memory._apply(ub, [s[u] for s in self.slots])
            yield ub
        self.memory._finish()

    @property
    def n_outputs(self) -> int:
        return self.balloc.n_outputs


def make_allocator(memory: Memory, batch: Batch, *, n_vocab: int | None, n_batch: int | None,
                   output_all: bool) -> BatchAllocator:
    """A batch allocator initialised with `batch`, validated against `memory` (positions, sequences).

    Raises:
        BatchError: an invalid batch; also a token of several sequences when every sequence has its
            own stream (the cache cannot share a cell across streams).
    """
    balloc = BatchAllocator(n_seq_max=memory.n_seq_max, n_vocab=n_vocab, n_batch=n_batch)
    balloc.init(batch, memory, output_all=output_all)
    if not getattr(memory, "unified", True):
        multi = np.flatnonzero(np.asarray(batch.n_seq_id) > 1)
        if multi.size:
            raise BatchError(f"token {int(multi[0])} belongs to several sequences, but the cache keeps one "
                             f"stream per sequence (unified=False): a token can belong to one only")
    return balloc


def split_batch(balloc: BatchAllocator, n_ubatch: int, *, equal: bool, sequential: bool) -> list[UBatch] | None:
    """Every ubatch of the batch: split_simple, or split_equal (sequential for one stream per
    sequence); None if the allocator cannot split all of it (llama.cpp's failed prepare)."""
    balloc.split_reset()
    ubatches = []
    while True:
        ub = balloc.split_equal(n_ubatch, sequential) if equal else balloc.split_simple(n_ubatch)
        if ub is None or ub.n_tokens == 0:
            break
        ubatches.append(ub)
    if balloc.n_used < balloc.n_tokens:
        return None
    return ubatches
