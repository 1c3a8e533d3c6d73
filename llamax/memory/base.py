"""The memory interface (llama.cpp's llama_memory_i) shared by every cache type.

A memory holds what a context remembers between decodes. A decode reaches it in one direction:

    update()                       pending stream copies and K-shifts (llama_memory_i::init_update)
    init_batch(balloc, n_ubatch)   split the validated batch into ubatches and reserve cells for all
                                   of them (prepare, then roll every cell back): a MemoryContext, or
                                   NoKVSlotError with nothing changed (llama_memory_i::init_batch)
    mctx.apply(i)                  ubatch i's cells are written (apply_ubatch), i = 0, 1, ...
    store(il, ub, k, v), attend(il, ub, q)   per attention layer, for the ubatch just applied (KVMemory)
    layer_view(il, ub)             or: what a native layer step needs to store and attend itself
    recurrent_view(il, ub)         per recurrent layer: the states a Mamba step reads and updates
                                   (RecurrentMemory)

Nothing mutates the cells except the seq_* operations, apply_ubatch and a state restore. plan()
is the same path for Python model code that runs without a Context: it makes the batch allocator
itself and returns a Plan (plan.apply(i) in turn, then plan.close(); a context manager, and
iterating it is that loop, closed however it ends).

Threads: every public operation of a memory runs under the memory's own lock (an RLock, `memory.lock`),
so calls from several threads wait for each other; the native work inside still runs without the
GIL. Staleness: every change of the cells (a seq_* operation, clear, apply_ubatch, a restore) moves
the memory's generation on. A MemoryContext (a Plan) remembers the generation it was made on and
refuses to apply a ubatch once the memory moved on without it (StalePlanError, nothing changed);
store() and attend() refuse the same way once the cells changed after the ubatch was applied.
"""
from __future__ import annotations

import abc
import functools
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Callable, Concatenate, Iterator, NamedTuple, ParamSpec, TypeVar

import numpy as np

from llamax.batch import Batch, BatchAllocator, UBatch
from llamax.checks import integer, positive
from llamax.errors import BatchError, StalePlanError

if TYPE_CHECKING:
    from llamax.state import StateReader, StateWriter


class LayerView(NamedTuple):
    """Layer il of a memory for the ubatch being applied, as a native layer step reads it
    (csrc/layer.h's lx_kv_layer): the memory chose every cell; the step writes K/V rows into them
    and attends with the mask built for the ubatch. (A tuple: a decode step makes one per layer.)"""

    k: np.ndarray        # the layer's K buffer from the ubatch's first stream (its streams, consecutive)
    v: np.ndarray        # V likewise (V^T [n_stream, n_head_kv, d_v, kv_size] when v_trans)
    type_k: int          # ggml type numbers of the cache rows
    type_v: int
    v_trans: bool
    mask: np.ndarray     # float32 [n_stream, n_tps_pad, n_kv]
    idxs: np.ndarray     # uint32 [n_tokens]: each token's cell in its stream
    rot_k: int           # Hadamard block of the stored K / V rows (0: none)
    rot_v: int
    perm: np.ndarray | None = None  # int32 [n_stream, n_kv]: the cell of each mask column (None: column = cell)


_M = TypeVar("_M", bound="Memory")
_P = ParamSpec("_P")
_R = TypeVar("_R")


def locked(method: Callable[Concatenate[_M, _P], _R]) -> Callable[Concatenate[_M, _P], _R]:
    """Run a memory's public method under the memory's own lock (the method keeps its signature)."""
    @functools.wraps(method)
    def run(self: _M, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self.lock:
            return method(self, *args, **kwargs)
    run.locked = True  # type: ignore[attr-defined]  # read by tests/test_contracts.py; mypy has no function attributes
    return run


class Memory(abc.ABC):
    """Abstract base of every memory: KVMemory (KVCache, KVCacheISWA), RecurrentMemory, HybridMemory.

    Subclasses call Memory.__init__ first (the lock and the generation), run every public
    operation under @locked and call _changed() after each change of the cells."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._generation = 0

    @property
    def generation(self):
        """A value that changes with every change of the cells (for stale-plan checks)."""
        return self._generation

    def _changed(self) -> None:
        self._generation += 1

    # ---- sequences (llama_memory_seq_*) -------------------------------------------------------
    @abc.abstractmethod
    def clear(self, data: bool = True) -> None:
        """Empty every cell; with data=True also zero the K/V buffers."""

    @abc.abstractmethod
    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        """Remove seq_id (every sequence if -1) from the cells with pos in [p0, p1).

        p0 < 0 means 0 and p1 < 0 means infinity. Returns True (a KV cache can always remove)."""

    @locked
    def seq_forget(self, seq_id: int, p0: int, p1: int) -> bool:
        """Drop what the memory holds of positions [p0, p1) of seq_id as far as it can (a context
        shift's discard): a cache of cells removes them (seq_rm); a recurrent state, which cannot
        forget part of what it folded in, stays whole. True when the whole range is gone."""
        return self.seq_rm(seq_id, p0, p1)

    @property
    @locked
    def token_room(self) -> int:
        """Tokens a batch can still place: n_free for a memory of one cell per position; a pure
        recurrent memory, one state per sequence whatever its length, has no such limit."""
        return self.n_free

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

    @abc.abstractmethod
    def seq_unshare(self, seq_id: int, p0: int = -1, p1: int = -1) -> int:
        """Give seq_id its own copy of each cell in [p0, p1) it shares with another sequence, so a
        later seq_add / seq_div of seq_id moves no other sequence (see KVCache.seq_unshare). Returns
        the cells copied; raises NoKVSlotError (nothing changed) when they do not fit."""

    @abc.abstractmethod
    def held_only_by(self, seq_ids: Iterable[int]) -> tuple[int, int]:
        """(cells, K/V bytes) in use whose sequences are all among seq_ids (e.g. held only by a
        prefix cache)."""

    # ---- shape ----------------------------------------------------------------------------------
    @property
    def exact_cut(self) -> bool:
        """True when a sequence's state cut back to any shorter prefix [0, m) (seq_rm of its tail) is
        what a decode of that prefix alone leaves, whatever ran since: a KV cache without a sliding
        window. Not a sliding-window cache (the slot finder reuses cells the window hid, so the window
        before a cut may be gone) nor a recurrent state (it cannot be cut). The host-RAM tier keeps
        evicted prefixes only for these."""
        return False

    @property
    @abc.abstractmethod
    def can_shift(self) -> bool:
        """True if seq_add / seq_div may change positions (K can be rotated)."""

    @locked
    def reserve_rollback(self, n: int) -> None:
        """Keep what is needed so that, after a decode, seq_rm(seq, p, -1) can remove up to the last
        n - 1 positions of a sequence's last ubatch (n: the positions of a verification ubatch per
        sequence, n_draft + 1; speculative decoding). Idempotent; a larger n grows what is kept, a
        smaller one keeps it. The default does nothing: a KV cache can always cut a tail (a recurrent
        memory keeps per-token states, RecurrentMemory.reserve_rollback).

        Raises:
            ValueError: n < 0.
            TypeError: n is not an integer.
        """
        n = integer(n, "n")
        if n < 0:
            raise ValueError(f"reserve_rollback({n}): n must be >= 0")

    @locked
    def exact_shift_limit(self, seq_id: int, keep_end: int) -> int | None:
        """The largest n_discard whose context shift (discard [keep_end, keep_end + n), move the rest
        down by n) loses nothing the model would still attend to; None when any is exact. Only a
        sliding-window cache smaller than the context has a limit (KVCacheISWA)."""
        return None

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
    def n_free(self) -> int:
        """Cells a batch can still take without overwriting any: n_cells - n_used of the cache that
        holds one cell per position (a KV cache; an iSWA cache's base, whose SWA cache reuses cells
        that left the window; a hybrid's attention cache; a recurrent memory's free states)."""

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
    def init_batch(self, balloc: BatchAllocator, n_ubatch: int) -> "MemoryContext":
        """Split the batch of an initialised allocator into ubatches and reserve cells for every one
        of them, then roll the cells back (llama_memory_i::init_batch). Nothing changes.

        Raises:
            BatchError: the batch cannot live in this memory (e.g. a token of several sequences when
                every sequence has its own stream).
            NoKVSlotError: it does not fit.
        """

    @abc.abstractmethod
    def apply_ubatch(self, ubatch: UBatch, slot: Any) -> None:
        """Write the cells of one prepared ubatch (slot: what init_batch reserved for it) and make it
        the ubatch that store() and attend() act on. Called by MemoryContext.apply, in order."""

    @abc.abstractmethod
    def release_ubatch(self) -> None:
        """Forget the ubatch applied last: store() and attend() refuse until the next apply."""

    @locked
    def forget_batch(self, balloc: BatchAllocator) -> None:
        """Undo a batch whose forward pass failed (after some of its ubatches were applied): remove
        its tokens from their sequences again, as llama.cpp's decode does. (A recurrent memory, whose
        states cannot lose tokens, puts back what it held before the batch instead.)"""
        for s in balloc.seq_id_unq:
            lo = balloc.seq_pos_min(int(s))
            if lo >= 0:
                self.seq_rm(int(s), lo, -1)

    @locked
    def plan(self, batch: Batch, n_ubatch: int = 512, *, n_vocab: int | None = None,
             n_batch: int | None = None, output_all: bool = False) -> "Plan":
        """Validate the batch, split it into ubatches of at most n_ubatch tokens and reserve cells
        for every one of them (for model code without a Context). Nothing changes until the plan
        applies its first ubatch (plan.apply(0), or iterating it). The plan holds for the cells it was
        made on: once anything else changes them (another plan applied, a seq_* operation, a clear, a
        restore), applying raises StalePlanError and changes nothing.

        Raises:
            BatchError: the batch is invalid (the message names the token and the rule).
            NoKVSlotError: it does not fit in the memory.
        """
        n_ubatch = positive(n_ubatch, "n_ubatch")
        self.update()
        balloc = BatchAllocator(n_seq_max=self.n_seq_max, n_vocab=n_vocab, n_batch=n_batch)
        balloc.init(batch, self, output_all=output_all)
        return Plan(self.init_batch(balloc, n_ubatch), balloc)

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


class KVMemory(Memory):
    """A memory of K/V cells (KVCache, KVCacheISWA): what an attention layer stores into and attends
    over, for the ubatch being applied."""

    @abc.abstractmethod
    def store(self, il: int, ubatch, k, v) -> None:
        """Write the K/V rows of the ubatch being applied for layer il."""

    @abc.abstractmethod
    def attend(self, il: int, ubatch, q, *, scale: float | None = None, softcap: float = 0.0):
        """Attention of the ubatch's queries over layer il of the cache."""

    @abc.abstractmethod
    def layer_view(self, il: int, ubatch) -> LayerView:
        """Layer il's buffers, cells and mask for the ubatch being applied (a native layer step)."""

    @abc.abstractmethod
    def layer_views(self, ubatch) -> dict[int, LayerView]:
        """layer_view of every layer, by layer number (one check and one mask for all of them)."""


class MemoryContext:
    """The ubatches of one batch and the cells reserved for each (llama_memory_context_i).

    Made by Memory.init_batch after every ubatch was placed and rolled back, so the whole batch
    fits; nothing has changed yet. apply(i) writes ubatch i's cells, in order i = 0, 1, ...;
    between two applies the model stores K/V and attends for every layer; close() ends it. It is
    valid for the memory's generation it was made on (and, after each apply, the one that apply made).
    """

    def __init__(self, memory: Memory, ubatches: list[UBatch], slots: list) -> None:
        assert len(ubatches) == len(slots)
        self.memory = memory
        self.ubatches = ubatches
        self.slots = slots      # per ubatch, what the memory reserved for it
        self.n_applied = 0
        self.generation = memory.generation
        self.closed = False

    def __len__(self) -> int:
        return len(self.ubatches)

    def apply(self, i: int) -> UBatch:
        """Write ubatch i's cells (llama_memory_context_i::apply) and return it.

        Raises:
            ValueError: i is not the next ubatch, or the context is closed.
            StalePlanError: the memory changed since this context was made (or since its last
                apply); nothing changes.
        """
        mem = self.memory
        with mem.lock:
            if self.closed:
                raise ValueError(f"ubatch {i} applied after the plan was closed ({self.n_applied} of {len(self)} "
                                 "ubatches were applied): plan the rest of the batch again")
            if i != self.n_applied:
                raise ValueError(f"ubatch {i} applied out of order: the next is {self.n_applied} of {len(self)}")
            if mem.generation != self.generation:
                raise StalePlanError(f"this plan was made for other cells: the memory changed since it was made "
                                     f"(another plan applied, a seq_* operation, a clear or a restore); "
                                     f"plan the batch again ({i} of {len(self)} ubatches were applied)")
            ub = self.ubatches[i]
            mem.apply_ubatch(ub, self.slots[i])
            self.generation = mem.generation
            self.n_applied += 1
        return ub

    def close(self) -> None:
        """The batch is done: the memory forgets its last ubatch (llama.cpp drops the memory context),
        unless the memory moved on since (then that ubatch is no longer this context's); nothing more
        is applied. Idempotent."""
        mem = self.memory
        with mem.lock:
            if not self.closed and self.n_applied and mem.generation == self.generation:
                mem.release_ubatch()
            self.closed = True


class Plan:
    """A validated batch and the cells reserved for each of its ubatches (Memory.plan): the whole batch
    fits, and nothing has changed yet. The protocol:

        ub = plan.apply(i)    write ubatch i's cells (i = 0, 1, ... in turn) and return it; the caller
                              then stores K/V and attends for every layer, before the next apply
        plan.close()          the batch is done: the memory forgets the ubatch applied last (store and
                              attend refuse it) and the plan applies nothing more; idempotent

    `with mem.plan(batch) as plan:` closes it on the way out. Iterating the plan is the loop over
    them: it applies each remaining ubatch in turn, yields it, and closes the plan when the loop ends,
    breaks or raises (ubatches already applied stay in the cells).
    """

    def __init__(self, mctx: MemoryContext, balloc: BatchAllocator) -> None:
        self.mctx = mctx
        self.balloc = balloc

    @property
    def memory(self) -> Memory:
        return self.mctx.memory

    @property
    def ubatches(self) -> list[UBatch]:
        return self.mctx.ubatches

    @property
    def n_outputs(self) -> int:
        return self.balloc.n_outputs

    @property
    def n_applied(self) -> int:
        """Ubatches applied so far."""
        return self.mctx.n_applied

    @property
    def closed(self) -> bool:
        return self.mctx.closed

    def __len__(self) -> int:
        return len(self.mctx)

    def apply(self, i: int) -> UBatch:
        """Write ubatch i's cells and return it (MemoryContext.apply).

        Raises:
            ValueError: i is not the next ubatch, or the plan is closed.
            StalePlanError: the memory changed since the plan was made (or since its last apply);
                nothing changes.
        """
        return self.mctx.apply(i)

    def close(self) -> None:
        """End the plan (MemoryContext.close)."""
        self.mctx.close()

    def __enter__(self) -> Plan:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __iter__(self) -> Iterator[UBatch]:
        """apply() each remaining ubatch in turn and yield it, then close(); a loop that breaks or
        raises drops this generator, whose finally closes the plan all the same."""
        try:
            while self.mctx.n_applied < len(self.mctx):
                yield self.apply(self.mctx.n_applied)
        finally:
            self.close()


def check_streams(memory: Memory, balloc: BatchAllocator) -> None:
    """A token of several sequences cannot live in a cache with one stream per sequence.

    Raises:
        BatchError: naming the first such token.
    """
    if not getattr(memory, "unified", True):
        assert balloc.batch is not None, "the allocator holds a validated batch (init() ran)"
        multi = np.flatnonzero(np.asarray(balloc.batch.n_seq_id) > 1)
        if multi.size:
            raise BatchError(f"token {int(multi[0])} belongs to several sequences, but the cache keeps one "
                             f"stream per sequence (unified=False): a token can belong to one only")


def split_batch(balloc: BatchAllocator, n_ubatch: int, *, equal: bool, sequential: bool) -> list[UBatch] | None:
    """Every ubatch of the batch: split_simple, or split_equal (sequential for one stream per
    sequence); None if the allocator cannot split all of it (llama.cpp's failed prepare)."""
    if n_ubatch <= 0:
        raise ValueError(f"n_ubatch must be > 0, got {n_ubatch}")
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
