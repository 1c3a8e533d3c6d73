"""The recurrent memory (llama.cpp's llama_memory_recurrent): one state per sequence, not cells per token.

A recurrent layer (Mamba, RWKV) does not keep its past tokens; it folds each one into a fixed-size
state. The memory holds mem_size = n_seq_max cells; a sequence owns at most one cell (its tail), and
the cell's pos is the position of the last token folded into it. Per stateful layer, two buffers with
a row per cell:

    conv  [mem_size, *r_shape]   llama.cpp's r_l (Mamba: the last d_conv - 1 inputs of each channel,
                                 [d_inner, d_conv - 1])
    ssm   [mem_size, *s_shape]   llama.cpp's s_l (Mamba: the scan's state, [d_inner, d_state])

float32 always: a state feeds back into itself every token, so quantization error would compound.

Rollback (speculative decoding, llama.cpp's per-token states): after reserve_rollback(n), two more
buffers per layer keep, for every cell, the state after each of its sequence's last n positions (at
most; the layers' kernels write them as they fold the tokens in, csrc/ssm.h), a ring of n rows:

    conv_hist [mem_size, n, *r_shape]    the conv state after position p in row
                                         (hist_row0 + p - hist_pos0) % n, hist_pos0 <= p <= pos
    ssm_hist  [mem_size, n, *s_shape]    likewise the ssm state

The window [hist_pos0, pos] holds hist_n <= n positions: a ubatch of n_t tokens extends it by n_t (the
oldest rows overwritten), so a sequence's last ubatch is always in it, and so are the ubatches of one
batch that a split cut a sequence into. seq_rm(seq, p0, -1) with hist_pos0 <= p0 - 1 < pos puts the row
of p0 - 1 back: the state a decode of the tokens up to p0 - 1 alone would have left, bit for bit (the
rows are copies of the state), and the window then ends at p0 - 1. The window is each cell's own: a
ubatch without the cell's sequence leaves it; any other change of the cell (seq_cp to it, seq_div, a
restore, clear, a failed batch, freeing it) drops it, seq_add moves it with the pos. A state file does
not carry it.

What follows from one state per sequence, as in llama.cpp:
    - seq_rm cannot cut a state: it removes a sequence's state whole or not at all, and returns False
      (changing nothing) for a range that covers only part of it. A state holds every position up to
      its pos, so [p0, p1) must reach from 0 (or before) to past pos, or lie entirely after pos. The
      one exception is a tail [p0, past pos) whose p0 - 1 the rollback window holds (above).
    - seq_cp gives the destination a copy of the source's state (its own cell, the bytes copied), so
      the two continue independently; the whole state is copied whatever [p0, p1).
    - seq_add / seq_div move the pos of the state only (there is no K to rotate); can_shift is True.
    - seq_pos_min == seq_pos_max == the state's pos.
    - A batch is split with split_equal (sequential): every ubatch holds n_seqs sequences of the
      same number of tokens, and a token may belong to one sequence only (BatchError otherwise: decode
      the shared prefix for one sequence and seq_cp it).

llamax departs from llama.cpp where llama.cpp loses data: a forward pass that fails in the middle of
a batch leaves every state as it was before the batch (forget_batch puts back the rows saved when the
batch first changed them), where llama.cpp's seq_rm of the batch's tokens can only fail. The memory
copies the touched cells' rows at the batch's first ubatch; with kernel_undo (the models' memories) it
copies only the small conv rows, and each layer's scan copies the ssm rows it is about to change as it
first reads them (csrc/ssm.h's Undo: one stream of writes, not a second pass over megabytes of state).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Callable, Iterable, NamedTuple, Sequence

import numpy as np

from llamax import checks
from llamax._native import buffers as _buffers
from llamax.batch import BatchAllocator, UBatch
from llamax.dtypes import LLAMA_MAX_SEQ, POS_MAX
from llamax.errors import BatchError, NoKVSlotError, StalePlanError, StateError
from llamax.memory.base import Memory, MemoryContext, locked, split_batch
from llamax.state import TAG_RECURRENT, StateReader, StateWriter, read_tag, write_tag

#: the recurrent section of a state: n_layer, mem_size, n_seq_max, seq_id, the ranks of r and s
_RS_HEAD = struct.Struct("<IIIiII")
#: one saved cell: its index, pos and sequence
CELL_DTYPE = np.dtype([("cell", "<u4"), ("pos", "<i4"), ("seq", "<i4")])


def check_one_sequence_per_token(balloc: BatchAllocator) -> None:
    """A recurrent state belongs to one sequence: a token of several sequences cannot be folded in.

    Raises:
        BatchError: naming the first such token."""
    assert balloc.batch is not None, "the allocator holds a validated batch (init() ran)"
    multi = np.flatnonzero(np.asarray(balloc.batch.n_seq_id) > 1)
    if multi.size:
        raise BatchError(f"token {int(multi[0])} belongs to several sequences, but a recurrent memory keeps "
                         f"one state per sequence: decode it for one sequence, then seq_cp the state")


class RecurrentView(NamedTuple):
    """Layer il of a recurrent memory for the ubatch being applied: the buffers a Mamba step reads
    and updates in place, and the cell of each of the ubatch's sequences (csrc/ssm.h)."""

    conv: np.ndarray     # float32 [mem_size, *r_shape]
    ssm: np.ndarray      # float32 [mem_size, *s_shape]
    cells: np.ndarray    # int32 [n_seqs]: sequence s of the ubatch (tokens s*n_t .. s*n_t+n_t-1) is in cells[s]
    conv_hist: np.ndarray | None = None   # float32 [mem_size, n, *r_shape]: the rollback rows (None: not reserved)
    ssm_hist: np.ndarray | None = None    # float32 [mem_size, n, *s_shape]
    hist_row: np.ndarray | None = None    # int32 [n_seqs]: the ring row of the state after sequence s's token
                                          # n_t - min(n_t, n) (the kernels' hist_row)
    ssm_undo: np.ndarray | None = None    # float32 [k, *s_shape]: the undo rows (kernel_undo; None: none to copy)
    undo_slot: np.ndarray | None = None   # int32 [n_seqs]: sequence s's undo row, -1 none; the scan sets -1 once
                                          # it copied (csrc/ssm.h's Undo)


@dataclass
class _Slot:
    """What init_batch reserved for one ubatch: each sequence's cell, and which cells are new (their
    state starts from zeros)."""

    cells: np.ndarray    # int32 [n_seqs]
    fresh: np.ndarray    # bool [n_seqs]
    first: bool          # the batch's first ubatch: the rows it will touch are saved before it applies
    touched: np.ndarray  # int32: every cell the whole batch writes


def _copy_cells(saved: list[np.ndarray], states: list[np.ndarray], cells: np.ndarray, *, to_cells: bool,
                n_threads: int | None) -> None:
    """saved[i][j] <- states[i][cells[j]] for every i and j (to_cells: the other way), in one native call: a
    run of consecutive cells (the usual case: cells are taken first-free) as one block per array, else a
    row per cell."""
    k = len(cells)
    if not k:
        return
    first = int(cells[0])
    run = bool(np.all(np.diff(cells) == 1)) if k > 1 else True
    dsts, srcs = [], []
    for sv, st in zip(saved, states):
        sv8, st8 = sv.reshape(len(sv), -1).view(np.uint8), st.reshape(len(st), -1).view(np.uint8)
        pairs = [(sv8[:k], st8[first:first + k])] if run else [(sv8[j:j + 1], st8[c:c + 1])
                                                                 for j, c in enumerate(cells.tolist())]
        for a, b in pairs:
            dsts.append(b if to_cells else a)
            srcs.append(a if to_cells else b)
    _buffers.copy_rows(dsts, srcs, n_threads)


@dataclass
class _Undo:
    """The cells and rows before a batch, to put back if its forward pass fails."""

    pos: np.ndarray
    owner: np.ndarray
    tail: np.ndarray
    touched: np.ndarray
    conv_rows: list[np.ndarray]         # per layer the touched cells' conv rows
    ssm_rows: list[np.ndarray] | None   # and their ssm rows (None: kernel_undo, the scans copy them into ssm_undo)
    generation: int = -1
    slot_of: dict[int, int] = field(default_factory=dict)   # kernel_undo: a saved cell's undo row
    handed: dict[tuple[int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = field(default_factory=dict)
    # kernel_undo: (ubatch's generation, layer index) -> (cells, undo rows, the view's undo_slot) of each view


class RecurrentMemory(Memory):
    """llama.cpp's llama_memory_recurrent, usable on its own by Python model code.

    Args:
        n_layer: the model's layer count.
        r_shape, s_shape: one cell's conv and ssm state in a layer (Mamba: (d_inner, d_conv - 1) and
            (d_inner, d_state)).
        n_seq_max: sequence ids accepted, [1, 256]; the memory has as many cells (mem_size).
        layer_ids: the layers with a state (default all; a hybrid model's recurrent layers).
        n_threads: threads of the native steps that read this memory (None or -1: every core).
        kernel_undo: the layers' scans copy the ssm rows a batch changes as they first read them (the
            views carry ssm_undo and undo_slot; csrc/ssm.h's Undo), where the memory would otherwise copy
            them before the batch: a failed batch is undone the same, for a stream of writes instead of a
            copy. Only for model code that passes every view's undo arguments to its scans (llamax's
            models do); code that writes the states itself leaves it False.
    """

    def __init__(self, n_layer: int, r_shape: Sequence[int], s_shape: Sequence[int], *, n_seq_max: int = 1,
                 layer_ids: Sequence[int] | None = None, n_threads: int | None = None,
                 name: str = "llama_memory_recurrent", kernel_undo: bool = False) -> None:
        super().__init__()
        n_layer = checks.positive(n_layer, "n_layer")
        self.n_layer_model = n_layer
        self.r_shape = tuple(checks.in_range(x, "r_shape", 0, 2**31) for x in r_shape)
        self.s_shape = tuple(checks.in_range(x, "s_shape", 0, 2**31) for x in s_shape)
        self._n_seq_max = checks.in_range(n_seq_max, "n_seq_max", 1, LLAMA_MAX_SEQ + 1)
        ids = list(range(n_layer)) if layer_ids is None else [checks.in_range(i, "layer_ids", 0, n_layer)
                                                              for i in layer_ids]
        if len(set(ids)) != len(ids):
            raise ValueError(f"layer_ids repeat a layer: {ids}")
        self.layer_ids = ids
        self._layer = {il: i for i, il in enumerate(ids)}
        self.n_threads = n_threads
        self.name = name
        self.mem_size = self._n_seq_max
        self.conv = [np.zeros((self.mem_size,) + self.r_shape, np.float32) for _ in ids]
        self.ssm = [np.zeros((self.mem_size,) + self.s_shape, np.float32) for _ in ids]
        self._pos = np.full(self.mem_size, -1, np.int32)      # last position folded into the cell
        self._owner = np.full(self.mem_size, -1, np.int32)    # the sequence holding the cell, -1: free
        self._tail = np.full(self._n_seq_max, -1, np.int32)   # each sequence's cell, -1: none
        self.n_rollback = 0                                     # history rows per cell (reserve_rollback)
        self.conv_hist: list[np.ndarray] = []                   # per layer [mem_size, n_rollback, *r_shape]
        self.ssm_hist: list[np.ndarray] = []                    # per layer [mem_size, n_rollback, *s_shape]
        self._hist_pos0 = np.zeros(self.mem_size, np.int32)     # first position of each cell's window
        self._hist_row0 = np.zeros(self.mem_size, np.int32)     # the ring row of that position
        self._hist_n = np.zeros(self.mem_size, np.int32)        # positions in the window, ending at pos (0: none)
        # the applied ubatch, its cells, the generation, its hist_row and undo_slot (kernel_undo)
        self._active: tuple[UBatch, np.ndarray, int, np.ndarray | None, np.ndarray | None] | None = None
        self._undo: _Undo | None = None
        self._undo_bufs: list[tuple[np.ndarray, np.ndarray]] = []   # _save_rows' buffers (conv, ssm) per layer
        self.kernel_undo = bool(kernel_undo)

    # ---- shape ----------------------------------------------------------------------------------
    @property
    def n_seq_max(self) -> int:
        return self._n_seq_max

    @property
    def can_shift(self) -> bool:
        return True

    @property
    def n_cells(self) -> int:
        return self.mem_size

    @property
    @locked
    def n_used(self) -> int:
        return int(np.count_nonzero(self._owner >= 0))

    @property
    @locked
    def n_free(self) -> int:
        """States no sequence holds: n_cells - n_used."""
        return self.mem_size - int(np.count_nonzero(self._owner >= 0))

    @property
    @locked
    def token_room(self) -> int:
        """No limit: a sequence's tokens fold into its one state."""
        return POS_MAX

    def _cell_bytes(self) -> int:
        return 4 * len(self.layer_ids) * (int(np.prod(self.r_shape)) + int(np.prod(self.s_shape)))

    def breakdown(self) -> dict[str, int]:
        """Bytes of the conv states ("r"), the ssm states ("s"), their rollback rows ("rollback",
        mem_size * n * (r + s) bytes per layer after reserve_rollback(n), else 0) and the undo rows a batch
        saves the states it changes in ("undo": r + s bytes per layer for each cell of the most cells one
        batch has changed; 0 before the first batch)."""
        return {"r": sum(a.nbytes for a in self.conv), "s": sum(a.nbytes for a in self.ssm),
                "rollback": sum(a.nbytes for a in self.conv_hist + self.ssm_hist),
                "undo": sum(a.nbytes + b.nbytes for a, b in self._undo_bufs)}

    @locked
    def cells(self) -> list[tuple[int, frozenset[int]]]:
        return [(int(p), frozenset() if o < 0 else frozenset((int(o),)))
                for p, o in zip(self._pos, self._owner)]

    def summary(self) -> str:
        """The size line llama.cpp logs when it creates a recurrent memory."""
        b, mib = self.breakdown(), 1024.0 * 1024.0
        return ("size = %7.2f MiB (%6u cells, %3d layers, %2u seqs), R (f32): %7.2f MiB, S (f32): %7.2f MiB"
                % ((b["r"] + b["s"]) / mib, self.mem_size, len(self.layer_ids), self._n_seq_max, b["r"] / mib,
                   b["s"] / mib))

    def __repr__(self) -> str:
        return f"RecurrentMemory({self.summary()}, used {self.n_used})"

    # ---- cells ----------------------------------------------------------------------------------
    def _seq(self, seq_id, what: str = "seq_id", every: bool = False) -> int:
        return checks.seq_id(seq_id, self._n_seq_max, what, every=every)

    def _free(self, c: int) -> None:
        s = int(self._owner[c])
        if s >= 0 and self._tail[s] == c:
            self._tail[s] = -1
        self._owner[c] = -1
        self._pos[c] = -1
        self._hist_n[c] = 0

    @staticmethod
    def _find_free(owner: np.ndarray) -> int:
        """The first free cell (there always is one for a sequence without a cell: each sequence
        holds at most one of the n_seq_max cells)."""
        free = np.flatnonzero(owner < 0)
        assert free.size, "a sequence without a cell always finds a free one"
        return int(free[0])

    def _zero(self, c: int) -> None:
        for a in self.conv + self.ssm:
            a[c] = 0

    # ---- rollback -------------------------------------------------------------------------------
    @locked
    def reserve_rollback(self, n: int) -> None:
        """Keep, from the next ubatch on, the state after each of the last n tokens of every
        sequence's ubatch, so that seq_rm(seq, p, -1) can take back up to n - 1 of them.

        Allocates conv_hist and ssm_hist (mem_size * n * (r + s) float32 per layer, breakdown's
        "rollback"). Idempotent; a larger n grows the buffers (the windows kept, and a plan made before
        refuses to apply: StalePlanError), a smaller one keeps them; n = 1 keeps nothing.

        Raises:
            ValueError: n < 0.
            TypeError: n is not an integer.
        """
        n = checks.integer(n, "n")
        if n < 0:
            raise ValueError(f"reserve_rollback({n}): n must be >= 0")
        if n <= max(self.n_rollback, 1):      # one position per ubatch: nothing to take back, nothing kept
            return
        conv = [np.zeros((self.mem_size, n) + self.r_shape, np.float32) for _ in self.layer_ids]
        ssm = [np.zeros((self.mem_size, n) + self.s_shape, np.float32) for _ in self.layer_ids]
        for c in np.flatnonzero(self._hist_n > 0).tolist():     # each window unrolled to rows 0 ..
            rows = self._ring_row(c, int(self._hist_pos0[c]) + np.arange(int(self._hist_n[c])))
            for new, old in zip(conv + ssm, self.conv_hist + self.ssm_hist):
                new[c, :rows.size] = old[c, rows]
            self._hist_row0[c] = 0
        self.conv_hist, self.ssm_hist, self.n_rollback = conv, ssm, n
        self._changed()

    @locked
    def rollback_window(self, seq_id: int) -> tuple[int, int]:
        """(first, last): the positions whose state seq_id can go back to, (-1, -1) when none;
        seq_rm(seq_id, p0, -1) rolls back for first + 1 <= p0 <= last + 1 (p0 - 1: the position kept last)."""
        c = int(self._tail[self._seq(seq_id)])
        if c < 0 or self._hist_n[c] < 2:
            return -1, -1
        return int(self._hist_pos0[c]), int(self._pos[c]) - 1

    def _ring_row(self, c: int, p):
        """The ring row of cell c's state after position p (an int or an array of them)."""
        return (int(self._hist_row0[c]) + p - int(self._hist_pos0[c])) % self.n_rollback

    def _roll_back(self, c: int, keep: int) -> None:
        """Put cell c's state back to the one after position keep (inside its window)."""
        j = keep - int(self._hist_pos0[c])
        assert 0 <= j < int(self._hist_n[c]) - 1, "keep lies inside the cell's window, before its pos"
        row = self._ring_row(c, keep)
        for a, h in zip(self.conv + self.ssm, self.conv_hist + self.ssm_hist):
            a[c] = h[c, row]
        self._pos[c] = keep
        self._hist_n[c] = j + 1

    # ---- sequences ------------------------------------------------------------------------------
    @locked
    def clear(self, data: bool = True) -> None:
        self._pos.fill(-1)
        self._owner.fill(-1)
        self._tail.fill(-1)
        self._hist_n.fill(0)
        self._active = None
        self._undo = None
        if data:
            for a in self.conv + self.ssm + self.conv_hist + self.ssm_hist:
                a.fill(0)
        self._changed()

    @locked
    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        """Remove seq_id's state (every state if seq_id is -1) if [p0, p1) covers all of it, or roll
        it back when [p0, p1) is a tail whose p0 - 1 the cell's rollback window holds.

        Returns False, changing nothing, when the range covers only part of a state and cannot be
        rolled back: for one sequence, p0 in (0, pos] or p1 in (0, pos], unless p1 is past pos and
        p0 - 1 >= the window's first position (the state after p0 - 1 is put back, pos becomes
        p0 - 1 and the window ends there); for every sequence, any range but everything or nothing.
        True otherwise (also when the range misses the state)."""
        seq_id = self._seq(seq_id, every=True)
        p0, p1 = checks.pos_bound(p0, "p0"), checks.pos_bound(p1, "p1")
        lo, hi = max(p0, 0), (p1 if p1 >= 0 else POS_MAX)
        if seq_id >= 0:
            c = int(self._tail[seq_id])
            if c < 0:
                return True
            pos = int(self._pos[c])
            if 0 < lo <= pos and hi > pos and self._hist_n[c] > 1 and lo - 1 >= self._hist_pos0[c]:
                self._roll_back(c, lo - 1)
                self._changed()
                return True
            if 0 < lo <= pos or 0 < hi <= pos:
                return False
            if lo <= pos < hi:
                self._free(c)
                self._changed()
            return True
        if lo != hi and not (lo == 0 and hi == POS_MAX):
            return False
        hit = np.flatnonzero((self._owner >= 0) & (self._pos >= lo) & (self._pos < hi))
        for cell in hit.tolist():
            self._free(cell)
        if hit.size:
            self._changed()
        return True

    @locked
    def seq_cp(self, seq_id_src: int, seq_id_dst: int, p0: int = -1, p1: int = -1) -> None:
        """dst gets a copy of src's state in a cell of its own (its old state is dropped); without a
        state, src leaves dst empty. The whole state is copied whatever [p0, p1) (it cannot be cut)."""
        src, dst = self._seq(seq_id_src, "seq_id_src"), self._seq(seq_id_dst, "seq_id_dst")
        checks.pos_bound(p0, "p0"), checks.pos_bound(p1, "p1")
        if src == dst:
            return
        if self._tail[dst] >= 0:
            self._free(int(self._tail[dst]))
        cs = int(self._tail[src])
        if cs >= 0:
            cd = self._find_free(self._owner)
            for a in self.conv + self.ssm:
                a[cd] = a[cs]
            self._owner[cd] = dst
            self._pos[cd] = self._pos[cs]
            self._tail[dst] = cd
            self._hist_n[cd] = 0     # the copy starts without a rollback window
        self._changed()

    @locked
    def seq_keep(self, seq_id: int) -> None:
        seq_id = self._seq(seq_id)
        for c in np.flatnonzero((self._owner >= 0) & (self._owner != seq_id)):
            self._free(int(c))
        self._changed()

    def _move(self, seq_id: int, p0: int, p1: int, f: Callable[[int], int], shift: int | None) -> None:
        """Move the pos of seq_id's state by f if it lies in [p0, p1). The cell's rollback window
        moves with it by shift when the whole window lies in the range and stays at positions >= 0;
        when the range takes only part of it, or f is not a shift (shift None), it is dropped."""
        c = int(self._tail[seq_id])
        if c < 0:
            return
        pos = int(self._pos[c])
        lo, hi = max(p0, 0), (p1 if p1 >= 0 else POS_MAX)
        if self._hist_n[c]:
            h0 = int(self._hist_pos0[c])
            assert h0 + int(self._hist_n[c]) - 1 == pos, "a cell's window ends at its pos"
            if h0 < hi and pos >= lo:      # the range reaches into the window
                if shift is not None and lo <= h0 and pos < hi and h0 + shift >= 0:
                    self._hist_pos0[c] = h0 + shift
                else:
                    self._hist_n[c] = 0
                    self._changed()
        if lo <= pos < hi:
            new = f(pos)
            if new < 0:      # shifted before the start, as a KV cache drops such cells
                self._free(c)
            else:
                self._pos[c] = new
            self._changed()

    @locked
    def seq_add(self, seq_id: int, p0: int, p1: int, shift: int) -> None:
        """Add shift to the state's pos if it lies in [p0, p1) (a pos moved below 0 drops the state)."""
        seq_id = self._seq(seq_id)
        p0, p1 = checks.pos_bound(p0, "p0"), checks.pos_bound(p1, "p1")
        shift = checks.integer(shift, "shift")
        c = int(self._tail[seq_id])
        if shift > 0 and c >= 0 and int(self._pos[c]) + shift >= POS_MAX and \
                max(p0, 0) <= int(self._pos[c]) and (p1 < 0 or int(self._pos[c]) < p1):
            raise ValueError(f"seq_add({seq_id}, {p0}, {p1}, {shift}) would move position {int(self._pos[c])} "
                             f"beyond the largest position {POS_MAX - 1}")
        if shift:
            self._move(seq_id, p0, p1, lambda p: p + int(shift), int(shift))

    @locked
    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        """Divide the state's pos by d > 0 if it lies in [p0, p1)."""
        seq_id = self._seq(seq_id)
        p0, p1 = checks.pos_bound(p0, "p0"), checks.pos_bound(p1, "p1")
        d = checks.integer(d, "d")
        if d <= 0:
            raise ValueError(f"seq_div by {d}: the divisor must be positive")
        if d != 1:
            self._move(seq_id, p0, p1, lambda p: p // d, None)

    @locked
    def seq_pos_min(self, seq_id: int) -> int:
        c = int(self._tail[self._seq(seq_id)])
        return -1 if c < 0 else int(self._pos[c])

    @locked
    def seq_pos_max(self, seq_id: int) -> int:
        return self.seq_pos_min(seq_id)

    @locked
    def seq_unshare(self, seq_id: int, p0: int = -1, p1: int = -1) -> int:
        """Nothing to do: a recurrent cell is never shared (seq_cp copies). Returns 0."""
        self._seq(seq_id)
        return 0

    @locked
    def held_only_by(self, seq_ids: Iterable[int]) -> tuple[int, int]:
        ids = [self._seq(s) for s in seq_ids]
        n = int(np.count_nonzero(np.isin(self._owner, ids)))
        return n, n * self._cell_bytes()

    # ---- decoding -------------------------------------------------------------------------------
    @locked
    def update(self) -> bool:
        """Nothing is ever pending (no K to rotate, copies are made at seq_cp)."""
        return False

    @locked
    def init_batch(self, balloc: BatchAllocator, n_ubatch: int) -> MemoryContext:
        """Split the batch with split_equal (sequential, as llama_memory_recurrent::init_batch) and
        give each sequence its cell (a free one, zeroed when applied, for a sequence without a state).
        Nothing changes.

        Raises:
            BatchError: a token belongs to several sequences.
            NoKVSlotError: the batch cannot be split (not reached: every sequence fits).
        """
        check_one_sequence_per_token(balloc)
        ubatches = split_batch(balloc, n_ubatch, equal=True, sequential=True)
        if ubatches is None:
            raise NoKVSlotError(f"{self.name}: the batch of {balloc.n_tokens} tokens cannot be split into "
                                f"equal sequences")
        return MemoryContext(self, ubatches, self.prepare(ubatches))

    @locked
    def prepare(self, ubatches: list[UBatch]) -> list[_Slot]:
        """Each ubatch's cells, in turn, without changing anything (llama_memory_recurrent::prepare):
        a sequence keeps its cell, one without a state takes the first free cell. Every equal split
        fits (a sequence holds at most one of the n_seq_max cells)."""
        owner, slots = self._owner.copy(), list[_Slot]()
        for ub in ubatches:
            seqs = ub.seq_id[::ub.n_seq_tokens]          # each sequence's first token (one id per token)
            cells = np.empty(ub.n_seqs, np.int32)
            fresh = np.zeros(ub.n_seqs, np.bool_)
            for j, s in enumerate(seqs.tolist()):
                held = np.flatnonzero(owner == s)          # its cell, or one an earlier ubatch takes
                c = int(held[0]) if held.size else -1
                if c < 0:
                    c = self._find_free(owner)
                    owner[c] = s
                    fresh[j] = True
                cells[j] = c
            slots.append(_Slot(cells, fresh, not slots, np.empty(0, np.int32)))
        if slots:
            slots[0].touched = slots[0].cells if len(slots) == 1 else \
                np.unique(np.concatenate([sl.cells for sl in slots]))
        return slots

    @locked
    def apply_ubatch(self, ubatch: UBatch, slot: _Slot) -> None:
        """Give each sequence of the ubatch its cell (a new one starts from zero states) and set the
        cells' pos to each sequence's last position in the ubatch; the states themselves are written
        by the layers (recurrent_view). With rollback reserved, each cell's window takes in the
        ubatch's positions (its last n_rollback positions, the earlier ones of a cell that had a
        window kept up to n_rollback in all); the layers write their rows."""
        if slot.first:
            self._undo = _Undo(self._pos.copy(), self._owner.copy(), self._tail.copy(), slot.touched,
                               *self._save_rows(slot.touched))
        n_t, n = ubatch.n_seq_tokens, self.n_rollback
        seqs = ubatch.seq_id[::n_t]
        hist_row = np.zeros(ubatch.n_seqs, np.int32) if n else None
        u = self._undo if self.kernel_undo else None
        undo_slot = np.full(ubatch.n_seqs, -1, np.int32)
        for j, (s, c) in enumerate(zip(seqs.tolist(), slot.cells.tolist())):
            if u is not None and not slot.fresh[j] and c not in u.slot_of:   # the batch's first change of c
                undo_slot[j] = u.slot_of[c] = len(u.slot_of)
            if slot.fresh[j]:
                self._zero(c)
                self._owner[c] = s
                self._tail[s] = c
                self._hist_n[c] = 0
            last = int(ubatch.pos[j * n_t + n_t - 1])
            self._pos[c] = last
            if hist_row is not None:
                # a sequence's positions are consecutive (the batch checks Y = X + 1 and no holes), so
                # the ubatch continues the cell's window right after its end
                first_row = last - min(n_t, n) + 1          # the first position the layers write
                if self._hist_n[c]:
                    hist_row[j] = self._ring_row(c, first_row)
                    k = min(n, int(self._hist_n[c]) + n_t)
                    self._hist_row0[c] = self._ring_row(c, last - k + 1)
                else:
                    k = min(n, n_t)
                    self._hist_row0[c] = 0
                self._hist_pos0[c], self._hist_n[c] = last - k + 1, k
        self._changed()
        self._active = (ubatch, slot.cells, self._generation, hist_row,
                        undo_slot if bool(np.any(undo_slot >= 0)) else None)
        if self._undo is not None:
            self._undo.generation = self._generation

    def _save_rows(self, touched: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
        """Copies of the touched cells' state rows (kernel_undo: the conv rows; the ssm buffers are the
        views' ssm_undo), into buffers kept from batch to batch (a state is
        megabytes: a fresh allocation per batch costs its page faults on every generation step), in one
        native call over the threads (buffers.copy_rows: a copy that streams at both cores' bandwidth, about
        half the time of numpy's one-threaded copy of the same bytes)."""
        k = len(touched)
        if self._undo_bufs and len(self._undo_bufs[0][0]) < k:
            self._undo_bufs = []
        if not self._undo_bufs:
            self._undo_bufs = [(np.empty((k,) + self.r_shape, np.float32), np.empty((k,) + self.s_shape, np.float32))
                               for _ in self.conv]
        conv = [r[:k] for r, _ in self._undo_bufs]
        ssm = None if self.kernel_undo else [b[:k] for _, b in self._undo_bufs]   # kernel_undo: the scans copy them
        _copy_cells(conv + (ssm or []), self.conv + (self.ssm if ssm else []), touched, to_cells=False,
                    n_threads=self.n_threads)
        return conv, ssm

    @locked
    def release_ubatch(self) -> None:
        self._active = None
        self._undo = None

    @locked
    def forget_batch(self, balloc: BatchAllocator) -> None:
        """Put back the cells and states as they were before the batch (saved at its first ubatch),
        if nothing else changed them since its last ubatch was applied; the rollback windows of the
        cells it touched are dropped either way."""
        u, self._undo = self._undo, None
        self._active = None
        if u is None:
            return
        if u.generation == self._generation:
            self._pos[:], self._owner[:], self._tail[:] = u.pos, u.owner, u.tail
            _copy_cells(u.conv_rows + (u.ssm_rows or []), self.conv + (self.ssm if u.ssm_rows else []), u.touched,
                        to_cells=True, n_threads=self.n_threads)
            # kernel_undo: the ssm rows the scans copied (their undo_slot back at -1); a layer whose scan did
            # not run did not change its rows
            for (_gen, i), (cells, slots, done) in u.handed.items():
                for j in np.flatnonzero((slots >= 0) & (done == -1)).tolist():
                    self.ssm[i][cells[j]] = self._undo_bufs[i][1][slots[j]]
        self._hist_n[u.touched] = 0     # the batch's layers wrote over these cells' windows
        self._changed()

    @locked
    def recurrent_view(self, il: int, ubatch: UBatch) -> RecurrentView:
        """Layer il's states and the ubatch's cells, for the ubatch being applied.

        Raises:
            ValueError: ubatch is not the one applied last, or layer il has no state here.
            StalePlanError: the memory changed since the ubatch was applied.
        """
        act = self._active
        if act is None or act[0] is not ubatch:
            raise ValueError("this ubatch is not the one being applied: apply it (iterate the plan) first")
        if act[2] != self._generation:
            raise StalePlanError("the memory changed since this ubatch was applied (a seq_* operation, a "
                                 "clear, a restore or another ubatch): its states are stale")
        i = self._layer.get(il)
        if i is None:
            raise ValueError(f"layer {il} has no recurrent state here (layers {self.layer_ids[:8]}...)")
        undo, slot = None, None
        if act[4] is not None:   # kernel_undo: one undo_slot per layer and ubatch, however many views
            assert self._undo is not None, "an applied ubatch with undo rows belongs to a batch being undone"
            cells, slots, done = self._undo.handed.setdefault((act[2], i), (act[1], act[4], act[4].copy()))
            undo, slot = self._undo_bufs[i][1], done
        if act[3] is not None:
            return RecurrentView(self.conv[i], self.ssm[i], act[1], self.conv_hist[i], self.ssm_hist[i], act[3],
                                 undo, slot)
        return RecurrentView(self.conv[i], self.ssm[i], act[1], ssm_undo=undo, undo_slot=slot)

    # ---- state ----------------------------------------------------------------------------------
    @locked
    def state_write(self, w: StateWriter, seq_id: int = -1) -> None:
        """Append this memory's section: every cell in use (seq_id -1, each at its own index) or
        seq_id's cell alone, written as that sequence.

        Section: tag, header (_RS_HEAD), the layer ids, r_shape and s_shape, n_cells, the cells
        (CELL_DTYPE); data: per layer the conv rows of the cells, then per layer their ssm rows (not
        the rollback windows)."""
        write_tag(w, TAG_RECURRENT)
        w.pack(_RS_HEAD, len(self.layer_ids), self.mem_size, self._n_seq_max, seq_id,
               len(self.r_shape), len(self.s_shape))
        w.array(np.asarray(self.layer_ids, "<u4"))
        w.array(np.asarray(self.r_shape + self.s_shape, "<u4"))
        if seq_id < 0:
            idx = np.flatnonzero(self._owner >= 0)
        else:
            c = int(self._tail[seq_id])
            idx = np.array([c] if c >= 0 else [], np.int64)
        wire = np.zeros(idx.size, CELL_DTYPE)
        wire["cell"] = idx
        wire["pos"] = self._pos[idx]
        wire["seq"] = self._owner[idx]
        w.pack(struct.Struct("<I"), idx.size)
        w.array(wire)
        for a in self.conv:
            w.data(a[idx])
        for a in self.ssm:
            w.data(a[idx])

    @locked
    def state_read(self, r: StateReader, seq_id: int = -1) -> Callable[[], None]:
        """Parse and validate this memory's section without changing anything; returns the function
        that installs it (every cell back at its own index, or the saved sequence's state into a free
        cell as seq_id after seq_rm(seq_id)).

        Raises:
            StateError: the layers, state shapes, counts, cells, positions or sequence ids do not fit.
        """
        where = self.name
        read_tag(r, TAG_RECURRENT)
        n_layer, _mem_size, _n_seq_max, src_seq, nr, ns = r.unpack(_RS_HEAD, "recurrent header")
        if n_layer != len(self.layer_ids):
            raise StateError(f"{where}: the state has {n_layer} recurrent layers, this memory {len(self.layer_ids)}")
        if (nr, ns) != (len(self.r_shape), len(self.s_shape)):
            raise StateError(f"{where}: the state's r/s ranks are {nr}/{ns}, this memory's "
                             f"{len(self.r_shape)}/{len(self.s_shape)}")
        layers = r.array("<u4", n_layer, "layer ids").tolist()
        if layers != self.layer_ids:
            raise StateError(f"{where}: the state's recurrent layers are {layers[:8]}, this memory's "
                             f"{self.layer_ids[:8]}")
        shapes = tuple(r.array("<u4", nr + ns, "state shapes").tolist())
        if shapes != self.r_shape + self.s_shape:
            raise StateError(f"{where}: the state's r/s shapes are {shapes[:nr]}/{shapes[nr:]}, this memory's "
                             f"{self.r_shape}/{self.s_shape}")
        if seq_id < 0 and src_seq != -1:
            raise StateError(f"{where}: the state holds sequence {src_seq} only, not every sequence")
        if seq_id >= 0 and not 0 <= src_seq < LLAMA_MAX_SEQ:
            raise StateError(f"{where}: the sequence state names sequence {src_seq}, outside [0, {LLAMA_MAX_SEQ})")
        (n,) = r.unpack(struct.Struct("<I"), "cell count")
        if n > (self.mem_size if seq_id < 0 else 1):
            raise StateError(f"{where}: the state holds {n} cells, "
                             + (f"the memory has {self.mem_size}" if seq_id < 0 else "a sequence has one"))
        cells = r.array(CELL_DTYPE, n, "cells")
        pos, seq, idx = cells["pos"], cells["seq"], cells["cell"].astype(np.int64)
        if n and (pos.min() < 0 or pos.max() >= POS_MAX):
            raise StateError(f"{where}: a position of the state is outside [0, {POS_MAX})")
        if seq_id < 0:
            if n and (idx.max() >= self.mem_size or np.unique(idx).size != n):
                raise StateError(f"{where}: the state's cells are not distinct cells of [0, {self.mem_size})")
            if n and (seq.min() < 0 or seq.max() >= self._n_seq_max or np.unique(seq).size != n):
                raise StateError(f"{where}: the state's sequences are not distinct ids in "
                                 f"[0, n_seq_max={self._n_seq_max})")
        elif n and int(seq[0]) != src_seq:
            raise StateError(f"{where}: the cell of the sequence state does not hold sequence {src_seq}")
        rb = [4 * int(np.prod(self.r_shape))] * n_layer
        sb = [4 * int(np.prod(self.s_shape))] * n_layer
        rs = [r.data(n * b, "conv states").view(np.float32).reshape((n,) + self.r_shape) for b in rb]
        ss = [r.data(n * b, "ssm states").view(np.float32).reshape((n,) + self.s_shape) for b in sb]

        def install_all() -> None:
            with self.lock:
                self.clear(data=True)
                self._pos[idx] = pos
                self._owner[idx] = seq
                self._tail[seq] = idx
                for a, b, x, y in zip(self.conv, self.ssm, rs, ss):
                    a[idx] = x
                    b[idx] = y
                self._changed()

        def install_seq() -> None:
            with self.lock:
                self.seq_rm(seq_id, -1, -1)
                if n == 0:
                    return
                c = self._find_free(self._owner)
                self._pos[c] = pos[0]
                self._owner[c] = seq_id
                self._tail[seq_id] = c
                self._hist_n[c] = 0
                for a, b, x, y in zip(self.conv, self.ssm, rs, ss):
                    a[c] = x[0]
                    b[c] = y[0]
                self._changed()

        return install_all if seq_id < 0 else install_seq
