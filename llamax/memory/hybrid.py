"""The hybrid memory (llama.cpp's llama_memory_hybrid): a KV cache for the attention layers and a
recurrent memory for the others, side by side (Jamba, Granite 4, Qwen3-Next).

Every sequence operation goes to both, and both agree or neither changes:
    - seq_rm asks the recurrent memory first, which may refuse a partial removal (False); only when
      it agreed (it removed the state, or rolled it back to p0 - 1 after reserve_rollback) is the KV
      cache cut too, so a refusal leaves both as they were.
    - seq_cp, seq_keep, seq_add, seq_div: both (a shift needs both to shift: can_shift is the KV
      cache's, as a recurrent state's pos always moves).
    - seq_pos_min / seq_pos_max: the range both hold (the larger minimum, the smaller maximum).
A batch is split once, with split_equal (the recurrent memory's requirement), and placed in both
(the recurrent memory first, as llama.cpp): it fits both or raises with neither changed. The model
reaches the two as `attn` (store / attend / layer_view for the attention layers) and `recr`
(recurrent_view for the others). A failed forward pass is undone in both. The state is the KV cache's
section, then the recurrent memory's, behind one tag. The three share one lock.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

from llamax.batch import BatchAllocator, UBatch
from llamax.errors import NoKVSlotError
from llamax.memory.base import Memory, MemoryContext, check_streams, locked, split_batch
from llamax.memory.kv_cache import KVCache
from llamax.memory.recurrent import RecurrentMemory, check_one_sequence_per_token
from llamax.state import TAG_HYBRID, StateReader, StateWriter, read_tag, write_tag


class HybridMemory(Memory):
    """llama.cpp's llama_memory_hybrid over a KVCache (attention layers) and a RecurrentMemory (the
    other layers), which must accept the same sequence ids.

    Args:
        attn: the attention layers' cache (its layer_ids the attention layers).
        recr: the recurrent layers' memory (its layer_ids the others).
    """

    def __init__(self, attn: KVCache, recr: RecurrentMemory) -> None:
        super().__init__()
        if not isinstance(attn, KVCache) or not isinstance(recr, RecurrentMemory):
            raise TypeError(f"HybridMemory takes a KVCache and a RecurrentMemory, got {type(attn).__name__} and "
                            f"{type(recr).__name__}")
        if attn.n_seq_max != recr.n_seq_max:
            raise ValueError(f"the KV cache takes {attn.n_seq_max} sequences, the recurrent memory {recr.n_seq_max}")
        shared = set(attn.layer_ids) & set(recr.layer_ids)
        if shared:
            raise ValueError(f"layers {sorted(shared)} are in both the KV cache and the recurrent memory")
        self.attn, self.recr = attn, recr
        attn.lock = recr.lock = self.lock

    @property
    def generation(self):
        return (self._generation, self.attn.generation, self.recr.generation)

    # ---- sequences ------------------------------------------------------------------------------
    @locked
    def clear(self, data: bool = True) -> None:
        self.attn.clear(data)
        self.recr.clear(data)

    @locked
    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        """Remove from both, or from neither: False (nothing changed) when the recurrent memory
        refuses a partial removal."""
        if not self.recr.seq_rm(seq_id, p0, p1):
            return False
        return self.attn.seq_rm(seq_id, p0, p1)

    @locked
    def seq_forget(self, seq_id: int, p0: int, p1: int) -> bool:
        """The KV cache's cells of [p0, p1) go; the recurrent state stays whole unless the range
        covers it (a context shift: the attention layers forget, the state keeps what it folded in)."""
        gone = self.recr.seq_rm(seq_id, p0, p1)
        return self.attn.seq_rm(seq_id, p0, p1) and gone

    @locked
    def reserve_rollback(self, n: int) -> None:
        """The recurrent memory's (its per-token states); the KV cache can always cut a tail."""
        self.recr.reserve_rollback(n)

    @locked
    def seq_cp(self, seq_id_src: int, seq_id_dst: int, p0: int = -1, p1: int = -1) -> None:
        self.attn.seq_cp(seq_id_src, seq_id_dst, p0, p1)
        self.recr.seq_cp(seq_id_src, seq_id_dst, p0, p1)

    @locked
    def seq_keep(self, seq_id: int) -> None:
        self.attn.seq_keep(seq_id)
        self.recr.seq_keep(seq_id)

    @locked
    def seq_add(self, seq_id: int, p0: int, p1: int, shift: int) -> None:
        self.attn.check_seq_add(seq_id, p0, p1, shift)   # refuses (nothing changed) before either moves
        self.attn.seq_add(seq_id, p0, p1, shift)
        self.recr.seq_add(seq_id, p0, p1, shift)

    @locked
    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        self.attn.check_seq_div(seq_id, p0, p1, d)
        self.attn.seq_div(seq_id, p0, p1, d)
        self.recr.seq_div(seq_id, p0, p1, d)

    @locked
    def seq_pos_min(self, seq_id: int) -> int:
        return max(self.attn.seq_pos_min(seq_id), self.recr.seq_pos_min(seq_id))

    @locked
    def seq_pos_max(self, seq_id: int) -> int:
        return min(self.attn.seq_pos_max(seq_id), self.recr.seq_pos_max(seq_id))

    @locked
    def seq_unshare(self, seq_id: int, p0: int = -1, p1: int = -1) -> int:
        return self.attn.seq_unshare(seq_id, p0, p1)

    @locked
    def held_only_by(self, seq_ids: Iterable[int]) -> tuple[int, int]:
        ids = list(seq_ids)
        (a, ab), (r, rb) = self.attn.held_only_by(ids), self.recr.held_only_by(ids)
        return a + r, ab + rb

    # ---- shape ----------------------------------------------------------------------------------
    @property
    def can_shift(self) -> bool:
        return self.attn.can_shift and self.recr.can_shift

    @property
    def n_cells(self) -> int:
        return self.attn.n_cells + self.recr.n_cells

    @property
    @locked
    def n_used(self) -> int:
        return self.attn.n_used + self.recr.n_used

    @property
    @locked
    def n_free(self) -> int:
        """The attention cache's empty cells (a token takes one there; the recurrent memory holds
        one state per sequence, whatever its length)."""
        return self.attn.n_free

    @property
    def n_seq_max(self) -> int:
        return self.attn.n_seq_max

    def breakdown(self) -> dict[str, int]:
        return self.attn.breakdown() | self.recr.breakdown()

    @locked
    def cells(self) -> list[tuple[int, frozenset[int]]]:
        """The KV cache's cells, then the recurrent memory's."""
        return self.attn.cells() + self.recr.cells()

    def __repr__(self) -> str:
        return f"HybridMemory({self.attn!r}, {self.recr!r})"

    # ---- decoding -------------------------------------------------------------------------------
    @locked
    def update(self) -> bool:
        return self.attn.update()

    @locked
    def init_batch(self, balloc: BatchAllocator, n_ubatch: int) -> MemoryContext:
        """Split with split_equal and place every ubatch in the recurrent memory, then in the KV cache
        (llama_memory_hybrid::init_batch); nothing changes.

        Raises:
            BatchError: a token of several sequences (the recurrent memory), or one the KV cache's
                streams cannot take.
            NoKVSlotError: the batch does not fit the KV cache.
        """
        check_one_sequence_per_token(balloc)
        check_streams(self.attn, balloc)
        ubatches = split_batch(balloc, n_ubatch, equal=True, sequential=not self.attn.unified)
        if ubatches is None:
            raise NoKVSlotError(f"the batch of {balloc.n_tokens} tokens cannot be split into equal sequences")
        recr = self.recr.prepare(ubatches)
        attn = self.attn.prepare(ubatches)
        if attn is None:
            raise NoKVSlotError(f"no KV slot for a batch of {balloc.n_tokens} tokens "
                                f"({self.attn.n_used}/{self.attn.n_cells} cells used)")
        return MemoryContext(self, ubatches, list(zip(attn, recr)))

    @locked
    def apply_ubatch(self, ubatch: UBatch, slot: Any) -> None:
        attn, recr = slot
        self.recr.apply_ubatch(ubatch, recr)
        self.attn.apply_ubatch(ubatch, attn)

    @locked
    def release_ubatch(self) -> None:
        self.attn.release_ubatch()
        self.recr.release_ubatch()

    @locked
    def forget_batch(self, balloc: BatchAllocator) -> None:
        """The recurrent states put back as before the batch; the batch's tokens removed from the KV cache."""
        self.recr.forget_batch(balloc)
        self.attn.forget_batch(balloc)

    # ---- state ----------------------------------------------------------------------------------
    @locked
    def state_write(self, w: StateWriter, seq_id: int = -1) -> None:
        write_tag(w, TAG_HYBRID)
        self.attn.state_write(w, seq_id)
        self.recr.state_write(w, seq_id)

    @locked
    def state_read(self, r: StateReader, seq_id: int = -1) -> Callable[[], None]:
        read_tag(r, TAG_HYBRID)
        attn = self.attn.state_read(r, seq_id)
        recr = self.recr.state_read(r, seq_id)

        def install() -> None:
            with self.lock:
                attn()
                recr()

        return install
