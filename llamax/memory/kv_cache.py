"""The KV cache (llama.cpp's llama_kv_cache): cells in C, K/V rows in numpy buffers.

Layout per layer (n_stream = 1 for a unified cache, else one stream per sequence):
    K  [n_stream, kv_size, n_head_kv, head_dim]       f32 / f16
    K  [n_stream, kv_size, row_bytes]                 q8_0 / q4_0: one quantized row of n_head_kv * head_dim
                                                      values per cell (34 / 18 bytes per 32 values)
    V  [n_stream, kv_size, n_head_kv, head_dim_v]     or, v_trans (flash attention off, f32 / f16 only):
    V  [n_stream, n_head_kv, head_dim_v, kv_size]     one row per channel, cells along it
A cell index is the row of its token in every layer. A quantized K (V) is stored rotated by a
Walsh-Hadamard matrix per head (llama.cpp's attn_rot_k / attn_rot_v): q is rotated the same way before
the dot products and the attention output is rotated back, so the result is unchanged but the
quantization error is spread over the block instead of sitting on outlier channels.
The cell table (positions, sequence sets, pending shifts), the slot finder, the mask, the row writes
(set_rows), the K-shift and attention run in C; this module holds the buffers and the policy.
"""
from __future__ import annotations

import logging
import math
import os
import struct
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np

from llamax._native import attention as _attn
from llamax._native import buffers as _buffers
from llamax._native import hadamard as _had
from llamax._native import kq_mask as _mask
from llamax._native import quants as _quants
from llamax._native import rope as _rope
from llamax._native.cells import CELL_STATE_DTYPE, SWA_TYPES, KVCells
from llamax import checks
from llamax.batch import BatchAllocator, UBatch
from llamax.dtypes import (FLOAT_CACHE_DTYPES, LLAMA_MAX_SEQ, N_KV_PAD, POS_MAX, QUANTIZED_CACHE_TYPES,
                           SEQ_WORDS, block_size, check_cache_type, has_seq, pad, row_bytes, seq_mask)
from llamax.errors import LlamaxError, NoKVSlotError, StalePlanError, StateError
from llamax.memory.base import KVMemory, LayerView, Memory, MemoryContext, check_streams, locked, split_batch
from llamax.threads import resolve_n_threads
from llamax.rope import RoPE
from llamax.state import PASS_THREADS, TAG_KV, StateReader, StateWriter, read_tag, row_views, write_tag

log = logging.getLogger("llamax")

#: the cache section of a state (see llamax/state.py): types, v_trans, n_layer, rot_k, rot_v, n_stream,
#: kv_size, n_seq_max, n_swa, swa type, n_head_kv, head_dim, head_dim_v, seq_id; then per stream
#: n_cells and n_runs; one cell on the wire: position, the ext fields (M-RoPE x/y, token), sequences
_KV_HEAD = struct.Struct("<8s8sIIIIIIIiIIIIi")
_STREAM = struct.Struct("<II")
CELL_DTYPE = np.dtype([("pos", "<i4"), ("x", "<i4"), ("y", "<i4"), ("tok", "<i4"), ("seq", "<u8", (SEQ_WORDS,))])
assert CELL_DTYPE.itemsize == 48
_SWA_CODE = {name: int(code) for name, code in SWA_TYPES.items()}
_SWA_NAME = {code: name for name, code in _SWA_CODE.items()}

MiB = 1024.0 * 1024.0
LX_DEBUG = int(os.environ.get("LX_DEBUG", "0") or 0)  # > 0: log the cell map after every ubatch


def _row_layout(t: str, n_stream: int, kv_size: int, n_head: int, d: int) -> tuple[tuple, type]:
    """Shape and dtype of a K (or untransposed V) buffer of type t."""
    if t in QUANTIZED_CACHE_TYPES:
        return (n_stream, kv_size, row_bytes(t, n_head * d)), np.uint8
    return (n_stream, kv_size, n_head, d), FLOAT_CACHE_DTYPES[t]


def _rot_disabled() -> bool:
    """llama.cpp's LLAMA_ATTN_ROT_DISABLE (also read as LLAMAX_ATTN_ROT_DISABLE)."""
    return any(os.environ.get(v, "0") not in ("", "0") for v in ("LLAMAX_ATTN_ROT_DISABLE", "LLAMA_ATTN_ROT_DISABLE"))


def _layer_ropes(rope, n_layer: int, head_dim: int) -> tuple[RoPE | None, ...] | None:
    """KVCache's rope argument as one entry per stored layer (None: no RoPE given at all).

    Raises:
        TypeError: not a RoPE, None or a sequence of them. ValueError: a sequence of another length
            than n_layer, or an n_rot beyond head_dim.
    """
    if rope is None:
        return None
    if isinstance(rope, RoPE):
        ropes: tuple = (rope,) * n_layer
    elif isinstance(rope, Sequence) and not isinstance(rope, (str, bytes)):
        ropes = tuple(rope)
        if len(ropes) != n_layer:
            raise ValueError(f"rope: {len(ropes)} entries for {n_layer} layers (one RoPE or None per layer)")
        bad = [type(r).__name__ for r in ropes if r is not None and not isinstance(r, RoPE)]
        if bad:
            raise TypeError(f"rope entries must be llamax.RoPE or None, got {bad[0]}")
    else:
        raise TypeError(f"rope must be a llamax.RoPE or a sequence of them (None for NoPE layers), "
                        f"got {type(rope).__name__}")
    for i, r in enumerate(ropes):
        if r is not None and r.n_rot > head_dim:
            raise ValueError(f"rope.n_rot {r.n_rot} > head_dim {head_dim} (layer entry {i})")
    return ropes


@dataclass
class _Active:
    """The ubatch being applied: its slot and the masks built for it (one per causal flag)."""

    ubatch: UBatch
    strm: np.ndarray   # uint32 [n_parts]
    idxs: np.ndarray   # uint32 [n_tokens]
    contiguous: bool
    masks: dict
    generation: int    # the memory's generation right after the apply
    perm: np.ndarray | None = None  # the mask's column -> cell map (None: column j is cell j)


class KVCache(KVMemory):
    """llama.cpp's KV cache, usable on its own by Python model code.

    Args:
        n_layer: layers stored (K/V buffers per layer).
        n_head_kv, head_dim: K/V heads and K head size; head_dim_v defaults to head_dim.
        kv_size: cells per stream.
        n_seq_max: sequence ids accepted, [1, 256].
        unified: one stream shared by every sequence (llama.cpp's kv_unified), else one stream
            of kv_size cells per sequence.
        type_k, type_v: "f32", "f16", "q8_0" or "q4_0" (llama.cpp's block layouts; a quantized cache
            needs head sizes that are multiples of 32, and a quantized V needs v_trans=False).
        v_trans: store V transposed (llama.cpp does when flash attention is off).
        n_swa, swa_type: sliding window ("none", "standard", "chunked", "symmetric"); cells that the
            window hides from their only sequence are reused.
        rope: enables K-shift (seq_add / seq_div); can_shift is False without it. One RoPE for every
            layer, or a sequence with one entry per stored layer (in the order of layer_ids): that
            layer's RoPE (its own base, scale, frequency factors, YaRN), or None for a layer whose K
            carries no RoPE (NoPE: the K-shift leaves its K untouched, positions only mask).
        n_threads: threads of the native kernels (None or -1: every core).
        layer_ids: the model's layer numbers stored here (default range(n_layer)); store() and
            attend() take these numbers.
        name: label in the log lines.
        rotate: rotate quantized K / V by a Walsh-Hadamard matrix per head (llama.cpp's attn_rot_k /
            attn_rot_v). None: as llama.cpp, on for a quantized type whose head size is a multiple of 64,
            unless LLAMA_ATTN_ROT_DISABLE (or LLAMAX_ATTN_ROT_DISABLE) is set. The block is the largest
            power of two <= head_dim dividing it for K, 64 for V (rot_k / rot_v, 0 = no rotation).
    """

    def __init__(self, n_layer: int, n_head_kv: int, head_dim: int, kv_size: int, *,
                 head_dim_v: int | None = None, n_seq_max: int = 1, unified: bool = True,
                 type_k: str = "f16", type_v: str = "f16", v_trans: bool = False,
                 n_swa: int = 0, swa_type: str = "none", rope: RoPE | Sequence[RoPE | None] | None = None,
                 n_threads: int | None = None, layer_ids: Sequence[int] | None = None,
                 name: str = "llama_kv_cache", rotate: bool | None = None) -> None:
        super().__init__()
        n_layer, n_head_kv, head_dim = (checks.positive(v, w) for v, w in
                                        ((n_layer, "n_layer"), (n_head_kv, "n_head_kv"), (head_dim, "head_dim")))
        kv_size = checks.positive(kv_size, "kv_size")
        head_dim_v = None if head_dim_v is None else checks.positive(head_dim_v, "head_dim_v")
        n_seq_max = checks.in_range(n_seq_max, "n_seq_max", 1, LLAMA_MAX_SEQ + 1)
        n_swa = checks.in_range(n_swa, "n_swa", 0, 2**31)
        if swa_type not in SWA_TYPES:
            raise ValueError(f"swa_type {swa_type!r} not in {sorted(SWA_TYPES)}")
        if swa_type != "none" and n_swa <= 0:
            raise ValueError(f"swa_type {swa_type!r} needs n_swa > 0, got {n_swa}")
        layer_ropes = _layer_ropes(rope, n_layer, head_dim)
        self.layer_ids = list(range(n_layer)) if layer_ids is None else [int(i) for i in layer_ids]
        if len(self.layer_ids) != n_layer or len(set(self.layer_ids)) != n_layer:
            raise ValueError(f"layer_ids must list {n_layer} distinct layers")
        self._layer = {il: k for k, il in enumerate(self.layer_ids)}

        self.n_layer = n_layer
        self.n_head_kv = n_head_kv
        self.head_dim = head_dim
        self.kv_size = kv_size
        self._n_seq_max = n_seq_max
        self.unified = bool(unified)
        self.n_stream = 1 if unified else n_seq_max
        self.type_k, self.type_v = type_k, type_v
        self.v_trans = bool(v_trans)
        check_cache_type(type_k, "type_k")
        check_cache_type(type_v, "type_v")
        self.head_dim_v = head_dim if head_dim_v is None else head_dim_v
        for t, d, what in ((type_k, head_dim, "head_dim"), (type_v, self.head_dim_v, "head_dim_v")):
            if d % block_size(t):
                raise ValueError(f"a {t} cache needs {what} to be a multiple of {block_size(t)}, got {d}")
        if type_v in QUANTIZED_CACHE_TYPES and self.v_trans:
            raise ValueError(f"a quantized V cache (type_v {type_v!r}) requires flash attention: it cannot be "
                             "stored transposed (v_trans=True)")
        if rotate is None:
            rotate = not _rot_disabled()
        self.rot_k = _had.rot_block(head_dim) if rotate and type_k in QUANTIZED_CACHE_TYPES else 0
        self.rot_v = _had.rot_block_v(self.head_dim_v) if rotate and type_v in QUANTIZED_CACHE_TYPES else 0
        self.n_swa = int(n_swa) if swa_type != "none" else 0
        self.swa_type = swa_type
        #: the one RoPE of every stored layer (a per-layer list whose entries all agree counts as one), else the
        #: per-layer tuple; None: no RoPE given
        self.rope = (None if layer_ropes is None else layer_ropes[0]
                     if layer_ropes and layer_ropes[0] is not None and all(r == layer_ropes[0] for r in layer_ropes)
                     else layer_ropes)
        #: each stored layer's RoPE (None: NoPE), in the order of layer_ids; None: the cache cannot shift
        self.layer_ropes: tuple[RoPE | None, ...] | None = layer_ropes
        self.n_threads = resolve_n_threads(n_threads)
        self.name = name

        self.meta = KVCells(kv_size, self.n_stream, n_seq_max, self.n_swa, swa_type)
        ks, kdt = _row_layout(type_k, self.n_stream, kv_size, n_head_kv, head_dim)
        if self.v_trans:
            vs, vdt = (self.n_stream, n_head_kv, self.head_dim_v, kv_size), FLOAT_CACHE_DTYPES[type_v]
        else:
            vs, vdt = _row_layout(type_v, self.n_stream, kv_size, n_head_kv, self.head_dim_v)
        self.k: list[np.ndarray] = [np.zeros(ks, dtype=kdt) for _ in range(n_layer)]
        self.v: list[np.ndarray] = [np.zeros(vs, dtype=vdt) for _ in range(n_layer)]
        # per range of streams (s0, s1): each layer's K and V views over it (the buffers never move)
        self._stream_views: dict[tuple[int, int], list[tuple[np.ndarray, np.ndarray]]] = {}
        self._type_ids = (_quants.type_id(type_k), _quants.type_id(type_v))
        self._pending_copies: list[tuple[int, int]] = []
        self._active: _Active | None = None
        log.info("%s", self.summary())

    # ---- shape ----------------------------------------------------------------------------------
    @property
    def n_seq_max(self) -> int:
        return self._n_seq_max

    @property
    def exact_cut(self) -> bool:
        """No sliding window (see Memory.exact_cut)."""
        return self.n_swa == 0

    @property
    def can_shift(self) -> bool:
        """A RoPE was given (for every layer, or per layer: a cache whose layers are all NoPE shifts
        positions only)."""
        return self.layer_ropes is not None

    @property
    def n_cells(self) -> int:
        return self.kv_size * self.n_stream

    @property
    @locked
    def n_used(self) -> int:
        return self.meta.n_used

    @property
    @locked
    def n_free(self) -> int:
        """Empty cells over every stream: n_cells - n_used."""
        return self.kv_size * self.n_stream - self.meta.n_used

    def breakdown(self) -> dict[str, int]:
        """Bytes of the K and V buffers (the cell table is not counted, as in llama.cpp)."""
        return {"k": sum(a.nbytes for a in self.k), "v": sum(a.nbytes for a in self.v)}

    def summary(self) -> str:
        """The KV size line llama.cpp logs when it creates a cache."""
        b = self.breakdown()
        return ("size = %7.2f MiB (%6u cells, %3d layers, %2u/%u seqs), K (%s): %7.2f MiB, V (%s): %7.2f MiB"
                % ((b["k"] + b["v"]) / MiB, self.kv_size, self.n_layer, self._n_seq_max, self.n_stream,
                   self.type_k, b["k"] / MiB, self.type_v, b["v"] / MiB))

    @locked
    def cells(self) -> list[tuple[int, frozenset[int]]]:
        return self.meta.cells()

    def __repr__(self) -> str:
        return f"KVCache({self.summary()}, used {self.n_used})"

    # ---- sequences ------------------------------------------------------------------------------
    # Arguments are checked before anything changes (llamax.checks): ids in [0, n_seq_max) (-1 for
    # every sequence where allowed), bounds p0 / p1 negative (unbounded) or at most POS_MAX, and no
    # position may leave [0, POS_MAX) upwards (one shifted below 0 removes its cell, as llama.cpp).
    def _seq(self, seq_id, what: str = "seq_id", every: bool = False) -> int:
        return checks.seq_id(seq_id, self.n_seq_max, what, every=every)

    @locked
    def clear(self, data: bool = True) -> None:
        self.meta.clear()
        self._pending_copies.clear()
        self._active = None
        if data:
            for a in self.k + self.v:
                a.fill(0)
        self._changed()

    @locked
    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        seq_id = self._seq(seq_id, every=True)
        p0, p1 = checks.pos_bound(p0, "p0"), checks.pos_bound(p1, "p1")
        self.meta.seq_rm(seq_id, p0, p1)
        self._changed()
        return True

    @locked
    def seq_cp(self, seq_id_src: int, seq_id_dst: int, p0: int = -1, p1: int = -1) -> None:
        src, dst = self._seq(seq_id_src, "seq_id_src"), self._seq(seq_id_dst, "seq_id_dst")
        p0, p1 = checks.pos_bound(p0, "p0"), checks.pos_bound(p1, "p1")
        pending = self.meta.seq_cp(src, dst, p0, p1)
        if pending is not None:
            self._pending_copies.append(pending)
        self._changed()

    @locked
    def seq_keep(self, seq_id: int) -> None:
        self.meta.seq_keep(self._seq(seq_id))
        self._changed()

    def _check_shift(self, what: str) -> None:
        if not self.can_shift:
            raise LlamaxError(f"{what}: this cache cannot shift positions (can_shift is False: "
                              + ("no RoPE was given" if self.rope is None else "see can_shift") + ")")

    @locked
    def range_pos_max(self, seq_id: int, p0: int, p1: int) -> int:
        """The largest position of seq_id in [p0, p1) (bounds as seq_add's, checked), -1 if none."""
        cells = self.meta.streams[self.meta.seq_to_stream[seq_id]]
        if cells.seq_n_cells(seq_id) == 0:
            return -1
        pos = cells.pos_view()
        sel = has_seq(cells.seq_view(), seq_id) & (pos >= max(p0, 0))
        if p1 >= 0:
            sel &= pos < p1
        return int(pos[sel].max()) if sel.any() else -1

    @locked
    def check_seq_add(self, seq_id, p0, p1, shift) -> tuple[int, int, int, int]:
        """seq_add's arguments, checked and normalised (seq_id, p0, p1, shift); changes nothing.

        Raises:
            TypeError: a non-integer. ValueError: an id or bound out of range, or a position the
                shift would move to POS_MAX or beyond. LlamaxError: the cache cannot shift.
        """
        seq_id = self._seq(seq_id)
        p0, p1 = checks.pos_bound(p0, "p0"), checks.pos_bound(p1, "p1")
        shift = checks.integer(shift, "shift")
        if shift != 0:
            self._check_shift(f"seq_add({seq_id}, {p0}, {p1}, {shift})")
        if shift > 0 and self.seq_pos_max(seq_id) + shift >= POS_MAX:
            top = self.range_pos_max(seq_id, p0, p1)
            if top >= 0 and top + shift >= POS_MAX:
                raise ValueError(f"seq_add({seq_id}, {p0}, {p1}, {shift}) would move position {top} to "
                                 f"{top + shift}, beyond the largest position {POS_MAX - 1}")
        return seq_id, p0, p1, max(shift, -POS_MAX)  # a shift below -POS_MAX removes as much as -POS_MAX

    @locked
    def seq_add(self, seq_id: int, p0: int, p1: int, shift: int) -> None:
        seq_id, p0, p1, shift = self.check_seq_add(seq_id, p0, p1, shift)
        if shift == 0:
            return
        self.meta.seq_add(seq_id, p0, p1, shift)
        self._changed()

    @locked
    def check_seq_div(self, seq_id, p0, p1, d) -> tuple[int, int, int, int]:
        """seq_div's arguments, checked and normalised (seq_id, p0, p1, d); changes nothing."""
        seq_id = self._seq(seq_id)
        p0, p1 = checks.pos_bound(p0, "p0"), checks.pos_bound(p1, "p1")
        d = checks.integer(d, "d")
        if d <= 0:
            raise ValueError(f"seq_div by {d}: the divisor must be positive")
        if d != 1:
            self._check_shift(f"seq_div({seq_id}, {p0}, {p1}, {d})")
        return seq_id, p0, p1, min(d, POS_MAX)  # any divisor beyond the largest position gives 0

    @locked
    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        seq_id, p0, p1, d = self.check_seq_div(seq_id, p0, p1, d)
        if d == 1:
            return
        self.meta.seq_div(seq_id, p0, p1, d)
        self._changed()

    @locked
    def seq_pos_min(self, seq_id: int) -> int:
        return self.meta.seq_pos_min(self._seq(seq_id))

    @locked
    def seq_pos_max(self, seq_id: int) -> int:
        return self.meta.seq_pos_max(self._seq(seq_id))

    # ---- sharing (for a serving layer's prefix cache) ---------------------------------------------
    def _seq_cells(self, seq_id: int, p0: int = -1, p1: int = -1):
        """(cells, stream, mask of seq_id's cells with pos in [p0, p1)) of seq_id's stream."""
        st = int(self.meta.seq_to_stream[seq_id])
        cells = self.meta.streams[st]
        pos = cells.pos_view()
        sel = has_seq(cells.seq_view(), seq_id) & (pos >= max(p0, 0))
        if p1 >= 0:
            sel &= pos < p1
        return cells, st, sel

    @locked
    def seq_unshare(self, seq_id: int, p0: int = -1, p1: int = -1) -> int:
        """Give seq_id a cell of its own for each of its cells in [p0, p1) that another sequence
        shares (after seq_cp), so that a later seq_add / seq_div of seq_id moves no other sequence's
        positions (in llama.cpp's cell model a shift of a shared cell moves it for every sequence).
        The copies are placed as a ubatch would be (find_slot) and their K/V rows copied; the shared
        cells stay with the other sequences. A shared cell that seq_id's sliding window no longer
        shows is dropped from seq_id instead of copied. Pending K-shifts are applied first.

        Returns:
            the number of cells copied.
        Raises:
            NoKVSlotError: too few free cells for the copies (nothing changed).
        """
        seq_id = self._seq(seq_id)
        p0, p1 = checks.pos_bound(p0, "p0"), checks.pos_bound(p1, "p1")
        self.update()
        cells, st, sel = self._seq_cells(seq_id, p0, p1)
        own = seq_mask(seq_id)
        src = np.flatnonzero(sel & (cells.seq_view() & ~own).any(axis=1))
        if src.size == 0:
            return 0
        states = cells.snapshot(src)
        hidden = (self.meta.masked_swa(states["pos"], self.meta.seq_pos_max(seq_id) + 1) if self.n_swa
                  else np.zeros(src.size, dtype=bool))
        copy = ~hidden  # a cell the window hides from seq_id is not copied: seq_id just leaves it
        ub = UBatch.of_sequence(seq_id, states["pos"][copy], states["tok"][copy])
        slot = self.meta.prepare([ub]) if copy.any() else [None]
        if not slot:
            raise NoKVSlotError(f"seq_unshare({seq_id}): no room for {int(copy.sum())} copied cells "
                                f"({self.n_used}/{self.n_cells} cells used)")
        left = states.copy()
        left["seq"] &= ~own
        cells.restore(src, left)
        src, states = src[copy], states[copy]
        if src.size == 0:
            self._changed()
            return 0
        s0 = slot[0]
        assert s0 is not None  # copy.any(): the return above took the other case
        strm, dst = s0
        assert int(strm[0]) == st
        self.apply_ubatch(ub, s0)
        self.release_ubatch()
        dst = np.asarray(dst, dtype=np.int64)
        if np.any(states["x"]) or np.any(states["y"]):
            placed = cells.snapshot(dst)
            placed["x"], placed["y"] = states["x"], states["y"]
            cells.restore(dst, placed)
        for a in self.k:
            a[st, dst] = a[st, src]
        for a in self.v:
            if self.v_trans:
                a[st, ..., dst] = a[st, ..., src]
            else:
                a[st, dst] = a[st, src]
        self._changed()
        return int(src.size)

    @locked
    def reusable_prefix(self, seq_id: int, n: int) -> int:
        """The largest m <= n such that seq_id's cells hold what a token at position m attends to
        among positions [0, m): all of them, or with a standard sliding window the last n_swa - 1
        (older cells may have been reused by the slot finder). A sequence given seq_id's cells
        [0, m) (seq_cp) then decodes position m as if it had computed [0, m) itself. O(n_cells)."""
        seq_id = self._seq(seq_id)
        n = checks.integer(n, "n")
        if n <= 0:
            return 0
        cells, _, sel = self._seq_cells(seq_id, 0, n)
        have = np.zeros(n + 1, dtype=bool)
        have[cells.pos_view()[sel]] = True
        if not have[:n].all():
            if self.swa_type != "standard" or self.n_swa <= 0:
                return int(np.argmin(have))  # the first missing position
            # run[m]: how many positions just below m are held; m is usable when run[m] >= min(m, n_swa - 1)
            last_gap = np.maximum.accumulate(np.where(have[:n], -1, np.arange(n)))
            run = np.concatenate(([0], np.arange(n) - last_gap))
            ok = run >= np.minimum(np.arange(n + 1), self.n_swa - 1)
            return int(np.flatnonzero(ok).max())
        return n

    @locked
    def held_only_by(self, seq_ids: Iterable[int]) -> tuple[int, int]:
        """(cells, K/V bytes) in use whose sequences are all among seq_ids (e.g. held only by a
        prefix cache)."""
        mask = seq_mask([self._seq(s) for s in seq_ids])
        n = 0
        for cells in self.meta.streams:
            used = cells.pos_view() >= 0
            n += int(np.count_nonzero(used & ~np.any(cells.seq_view() & ~mask, axis=1)))
        b = self.breakdown()
        return n, n * ((b["k"] + b["v"]) // self.n_cells)

    # ---- update ---------------------------------------------------------------------------------
    @locked
    def update(self) -> bool:
        """Copy pending stream rows (cross-stream seq_cp), then rotate K of shifted cells, each layer by
        its own RoPE (layer_ropes; NoPE layers untouched)."""
        did = False
        for s0, s1 in self._pending_copies:
            for a in self.k + self.v:
                a[s1] = a[s0]
            did = True
        self._pending_copies.clear()
        if self.meta.get_has_shift():
            assert self.layer_ropes is not None, "shifts are refused without a RoPE"
            for st, cells in enumerate(self.meta.streams):
                shift = cells.shift_view()
                if not shift.any():
                    continue
                for k, r in zip(self.k, self.layer_ropes):
                    if r is None:
                        continue  # NoPE layer: its K has no position in it
                    _rope.k_shift(k[st].reshape(self.kv_size, -1), shift, self.n_head_kv, self.head_dim,
                                  r.n_rot, r.freq_base, r.freq_scale, r.mode, self.n_threads,
                                  type=self.type_k, rot_block=self.rot_k, **r.scaling_kwargs)
            for cells in self.meta.streams:
                cells.reset_shift()
            did = True
        return did

    # ---- planning and applying -----------------------------------------------------------------
    @locked
    def init_batch(self, balloc: BatchAllocator, n_ubatch: int) -> MemoryContext:
        """Split the batch (split_simple; split_equal with one stream per sequence) and reserve cells
        for every ubatch, then roll back (llama_kv_cache::init_batch). Nothing changes.

        Raises:
            BatchError: a token of several sequences in a cache with one stream per sequence.
            NoKVSlotError: the batch does not fit.
        """
        check_streams(self, balloc)
        ubatches = split_batch(balloc, n_ubatch, equal=self.n_stream > 1, sequential=not self.unified)
        slots = None if ubatches is None else self.prepare(ubatches)
        if ubatches is None or slots is None:
            raise NoKVSlotError(f"no KV slot for a batch of {balloc.n_tokens} tokens "
                                f"({self.n_used}/{self.n_cells} cells used)")
        return MemoryContext(self, ubatches, slots)

    @locked
    def prepare(self, ubatches: list[UBatch]) -> list[tuple[np.ndarray, np.ndarray]] | None:
        """Place every ubatch in turn and roll the cells back (llama_kv_cache::prepare): each one's
        (streams, cell indices), or None if one does not fit. Nothing changes."""
        return self.meta.prepare(ubatches)

    @locked
    def apply_ubatch(self, ubatch: UBatch, slot: tuple[np.ndarray, np.ndarray]) -> None:
        """Write the cells init_batch reserved for the ubatch (slot: (streams, cell indices)) and make
        it the ubatch store() and attend() act on (llama_kv_cache::apply_ubatch)."""
        strm, idxs = slot
        self.meta.apply_ubatch(ubatch, strm, idxs)
        self._changed()
        self._active = _Active(ubatch, strm, idxs, KVCells.is_contiguous(strm, idxs), {}, self._generation)
        if LX_DEBUG:
            log.info("%s: cells after a ubatch of %d tokens:\n%s", self.name, ubatch.n_tokens, self.meta.dump())

    @locked
    def release_ubatch(self) -> None:
        self._active = None

    def _active_ubatch(self, ubatch: UBatch) -> _Active:
        """The applied ubatch, if it is this one and the cells did not change since its apply."""
        act = self._active
        if act is None or act.ubatch is not ubatch:
            raise ValueError("this ubatch is not the one being applied: apply it (iterate the plan) and "
                             "store/attend before the next one")
        if act.generation != self._generation:
            raise StalePlanError("the memory changed since this ubatch was applied (a seq_* operation, a clear, "
                                 "a restore or another ubatch): store and attend refuse its stale cells")
        return act

    def _active_for(self, il: int, ubatch: UBatch) -> tuple[_Active, int]:
        act = self._active_ubatch(ubatch)
        if il not in self._layer:
            raise ValueError(f"layer {il} is not stored in this cache (layers {self.layer_ids[:8]}...)")
        return act, self._layer[il]

    @locked
    def store(self, il: int, ubatch: UBatch, k, v) -> None:
        """Write K/V rows of layer il for the tokens of the ubatch being applied (set_rows).

        Args:
            k: [n_tokens, n_head_kv, head_dim], float32 or float16.
            v: [n_tokens, n_head_kv, head_dim_v], float32 or float16.
        """
        act, li = self._active_for(il, ubatch)
        n = ubatch.n_tokens
        k = _as_float(k, (n, self.n_head_kv, self.head_dim), "k")
        v = _as_float(v, (n, self.n_head_kv, self.head_dim_v), "v")
        K, V = self.k[li], self.v[li]
        n_parts = len(act.strm)
        n_per = n // n_parts
        if self.type_k in QUANTIZED_CACHE_TYPES:
            k = self._rotated(k, self.rot_k)
        if self.type_v in QUANTIZED_CACHE_TYPES:
            v = self._rotated(v, self.rot_v)
        for p in range(n_parts):
            st = int(act.strm[p])
            ix = act.idxs[p * n_per:(p + 1) * n_per]
            sel = slice(int(ix[0]), int(ix[0]) + n_per) if act.contiguous else ix
            kp, vp = k[p * n_per:(p + 1) * n_per], v[p * n_per:(p + 1) * n_per]
            if self.type_k in QUANTIZED_CACHE_TYPES:
                _quants.set_rows(self.type_k, kp, K[st], ix, self.n_threads)
            else:
                K[st, sel] = kp
            if self.type_v in QUANTIZED_CACHE_TYPES:
                _quants.set_rows(self.type_v, vp, V[st], ix, self.n_threads)
            elif self.v_trans:
                V[st][:, :, sel] = vp.transpose(1, 2, 0)
            else:
                V[st, sel] = vp

    def _rotated(self, x: np.ndarray, block: int) -> np.ndarray:
        """x [n, n_head, d] as float32 rows [n, n_head * d], rotated per head when block > 0 (then a
        copy; otherwise a view of x when it already is C-contiguous float32)."""
        rows = np.ascontiguousarray(x, dtype=np.float32).reshape(x.shape[0], -1)
        if block:
            rows = rows.copy() if np.may_share_memory(rows, x) else rows
            _had.hadamard_rows(rows, block, self.n_threads)
        return rows

    @locked
    def n_kv(self, strm: np.ndarray | None = None) -> int:
        """Cells attention looks at: llama.cpp's get_n_kv (used range padded to 256, at most kv_size)."""
        streams = range(self.n_stream) if strm is None else (int(s) for s in strm)
        n = 0
        for st in streams:
            used = self.meta.streams[st].used_max_p1
            n = max(n, min(self.kv_size, max(N_KV_PAD, pad(used, N_KV_PAD))))
        return n

    @locked
    def mask(self, ubatch: UBatch, *, causal: bool = True) -> np.ndarray:
        """The KQ mask of the ubatch being applied, [n_parts, n_tps_pad, n_kv] (built once per ubatch)."""
        act = self._active_ubatch(ubatch)
        m = act.masks.get(causal)
        if m is None:
            n_kv = self.n_kv(act.strm)
            streams = [self.meta.streams[int(s)] for s in act.strm]
            pos = [c.pos_view()[:n_kv] for c in streams]
            bits = [c.seq_view()[:n_kv] for c in streams]
            if not act.masks:
                act.perm = _column_order(pos, bits, ubatch)
            if act.perm is not None:
                pos = [p[o] for p, o in zip(pos, act.perm)]
                bits = [b[o] for b, o in zip(bits, act.perm)]
            m = _mask.kq_mask_fill(pos, bits, ubatch.pos, ubatch.seq_id, causal=causal, n_swa=self.n_swa,
                                   swa_type=SWA_TYPES[self.swa_type], alibi=False, n_threads=self.n_threads)
            act.masks[causal] = m
        return m

    @locked
    def attend(self, il: int, ubatch: UBatch, q, *, scale: float | None = None, softcap: float = 0.0,
               causal: bool = True, out: np.ndarray | None = None) -> np.ndarray:
        """Attention of q over layer il with the mask llama.cpp builds, in the native kernel.

        Args:
            q: [n_tokens, n_head, head_dim] float32 (n_head a multiple of n_head_kv).
            scale: score scale, default 1/sqrt(head_dim). softcap: logit softcap, 0 = off.
        Returns:
            float32 [n_tokens, n_head, head_dim_v].
        """
        act, li = self._active_for(il, ubatch)
        q = np.ascontiguousarray(q, dtype=np.float32)
        n = ubatch.n_tokens
        if q.ndim != 3 or q.shape[0] != n or q.shape[2] != self.head_dim or q.shape[1] % self.n_head_kv:
            raise ValueError(f"q shape {q.shape}: expected ({n}, k*{self.n_head_kv}, {self.head_dim})")
        m = self.mask(ubatch, causal=causal)
        s0, s1 = int(act.strm[0]), int(act.strm[-1])
        if s1 - s0 + 1 != len(act.strm):
            raise LlamaxError(f"the ubatch spans streams {act.strm.tolist()}, which are not consecutive")
        scale = 1.0 / math.sqrt(self.head_dim) if scale is None else float(scale)
        if self.rot_k:  # the dot products run in the rotated frame of the stored K
            q = q.copy()
            _had.hadamard_rows(q.reshape(n, -1), self.rot_k, self.n_threads)
        out = _attn.attn(q, self.k[li][s0:s1 + 1], self.v[li][s0:s1 + 1], m, out, n_kv=m.shape[2],
                         scale=scale, softcap=float(softcap), v_trans=self.v_trans, n_threads=self.n_threads,
                         type_k=self.type_k, type_v=self.type_v, perm=act.perm)
        if self.rot_v:  # a weighted sum of rotated V rows: rotate it back
            _had.hadamard_rows(out.reshape(n, -1), self.rot_v, self.n_threads)
        return out

    @locked
    def layer_view(self, il: int, ubatch: UBatch) -> LayerView:
        """What a native layer step needs of layer il for the ubatch being applied: the buffers of
        its streams, each token's cell and the (causal) mask. Same checks as store / attend."""
        act, li = self._active_for(il, ubatch)
        return self._views(act, ubatch, [(il, li)])[il]

    @locked
    def layer_views(self, ubatch: UBatch) -> dict[int, LayerView]:
        """layer_view of every layer stored here, by layer number (the checks and the mask once)."""
        return self._views(self._active_ubatch(ubatch), ubatch, self._layer.items())

    def _views(self, act: _Active, ubatch: UBatch, layers) -> dict[int, LayerView]:
        s0, s1 = int(act.strm[0]), int(act.strm[-1])
        if s1 - s0 + 1 != len(act.strm):
            raise LlamaxError(f"the ubatch spans streams {act.strm.tolist()}, which are not consecutive")
        mask, (tk, tv) = self.mask(ubatch), self._type_ids
        kv = self._stream_views.get((s0, s1))
        if kv is None:
            kv = self._stream_views[(s0, s1)] = [(k[s0:s1 + 1], v[s0:s1 + 1]) for k, v in zip(self.k, self.v)]
        vt, idxs, rk, rv, perm = self.v_trans, act.idxs, self.rot_k, self.rot_v, act.perm
        return {il: LayerView(kv[li][0], kv[li][1], tk, tv, vt, mask, idxs, rk, rv, perm) for il, li in layers}

    # ---- state (llama_state_*; the framing is in llamax/state.py) -------------------------------
    def _cells_to_save(self, st: int, seq_id: int) -> np.ndarray:
        """Indices (ascending) of the cells of stream st to save: used, holding seq_id (any if -1), and
        not hidden by the sliding window from every sequence that holds them."""
        cells = self.meta.streams[st]
        pos = cells.pos_view()
        bits = cells.seq_view()
        sel = pos >= 0
        swa = self.swa_type != "none" and self.n_swa > 0
        if seq_id >= 0:
            sel &= has_seq(bits, seq_id)
            if swa and sel.any():
                sel &= ~self.meta.masked_swa(pos, cells.seq_pos_max(seq_id))
        elif swa and sel.any():
            seen = np.zeros(pos.shape[0], dtype=bool)
            for s in range(self.n_seq_max):
                if cells.seq_n_cells(s):
                    has = has_seq(bits, s)
                    seen |= has & ~self.meta.masked_swa(pos, cells.seq_pos_max(s))
            sel &= seen
        return np.flatnonzero(sel)

    def _row_bytes(self) -> np.ndarray:
        """u64 [n_layer, 2]: bytes of one cell's K row and V row (V column when v_trans), per layer."""
        return np.array([(math.prod(k.shape[2:]) * k.itemsize,
                          math.prod(v.shape[1:-1] if self.v_trans else v.shape[2:]) * v.itemsize)
                         for k, v in zip(self.k, self.v)], dtype="<u8").reshape(self.n_layer, 2)

    @locked
    def state_write(self, w: StateWriter, seq_id: int = -1) -> None:
        """Append this cache's section to a state: every sequence (seq_id -1) or seq_id's cells
        alone, written as that sequence. Pending stream copies and K-shifts are applied first
        (update()), so the saved rows match the saved positions. The cells the sliding window hides
        from every sequence holding them are not written. O(kv_size) metadata work plus one slice
        per run of consecutive cells and layer (no per-cell loop).

        Section: tag, header (_KV_HEAD), row bytes per layer, heads (whole states), per stream the
        cell runs and cells (CELL_DTYPE); data: per stream and layer the K rows of every run, then
        the V rows (or V columns with v_trans)."""
        self.update()
        write_tag(w, TAG_KV)
        w.pack(_KV_HEAD, _name8(self.type_k), _name8(self.type_v), int(self.v_trans), self.n_layer,
               self.rot_k, self.rot_v, self.n_stream, self.kv_size, self.n_seq_max,
               self.n_swa, _SWA_CODE[self.swa_type], self.n_head_kv, self.head_dim, self.head_dim_v, seq_id)
        w.array(self._row_bytes())
        if seq_id < 0:
            w.array(np.asarray(self.meta.heads, dtype="<u4"))
        all_runs = []
        for st, cells in enumerate(self.meta.streams):
            idx = self._cells_to_save(st, seq_id)
            runs = _runs(idx)
            snap = cells.snapshot(idx)
            wire = np.zeros(idx.size, dtype=CELL_DTYPE)
            for f in ("pos", "x", "y", "tok"):
                wire[f] = snap[f]
            if seq_id < 0:
                wire["seq"] = snap["seq"]
            else:
                wire["seq"] = seq_mask(seq_id)
            w.pack(_STREAM, idx.size, runs.shape[0])
            w.array(runs.astype("<u4"))
            w.array(wire)
            all_runs.append(runs)
        for st, runs in enumerate(all_runs):
            for k in self.k:
                for a, n in runs:
                    w.data(k[st, a:a + n])
            for v in self.v:
                for a, n in runs:
                    w.data(v[st, ..., a:a + n] if self.v_trans else v[st, a:a + n])

    @locked
    def state_read(self, r: StateReader, seq_id: int = -1) -> Callable[[], None]:
        """Parse and validate this cache's section of a state without changing anything; returns
        the function that installs it. A whole state goes back into the same cells with the same
        heads; a sequence state is placed after seq_rm(seq_id) through the reservation a decode uses
        (prepare and apply of one ubatch; contiguous cells if there are, else any free ones).

        Raises:
            StateError: type_k/type_v, v_trans, n_layer, head sizes, row sizes, rotation, n_stream or
                the window differ from this cache's, or counts / positions / sequence ids are out of range.
        """
        where = self.name
        read_tag(r, TAG_KV)
        (tk, tv, v_trans, n_layer, rot_k, rot_v, n_stream, _kv_size, _n_seq_max, n_swa, swa_code, n_head_kv, head_dim,
         head_dim_v, src_seq) = r.unpack(_KV_HEAD, "cache header")  # kv_size / n_seq_max may differ: ids are checked
        _check("type_k", _unname8(tk), self.type_k, where)
        _check("type_v", _unname8(tv), self.type_v, where)
        _check("v_trans", bool(v_trans), self.v_trans, where)
        _check("n_layer", n_layer, self.n_layer, where)
        _check("n_head_kv", n_head_kv, self.n_head_kv, where)
        _check("head_dim", head_dim, self.head_dim, where)
        _check("head_dim_v", head_dim_v, self.head_dim_v, where)
        _check("rot_k (K rotation block)", rot_k, self.rot_k, where)
        _check("rot_v (V rotation block)", rot_v, self.rot_v, where)
        _check("n_stream", n_stream, self.n_stream, where)
        _check("swa_type", _SWA_NAME.get(swa_code, f"type-{swa_code}"), self.swa_type, where)
        _check("n_swa", n_swa, self.n_swa, where)
        if seq_id < 0 and src_seq != -1:
            raise StateError(f"{where}: the state holds sequence {src_seq} only, not every sequence")
        if seq_id >= 0 and not 0 <= src_seq < LLAMA_MAX_SEQ:
            raise StateError(f"{where}: the sequence state names sequence {src_seq}, outside [0, {LLAMA_MAX_SEQ})")
        rows = r.array("<u8", 2 * n_layer, "row sizes").reshape(n_layer, 2)
        want = self._row_bytes()
        bad = np.flatnonzero((rows != want).any(axis=1))
        if bad.size:
            li = int(bad[0])
            raise StateError(f"{where}: layer {self.layer_ids[li]} rows are {rows[li].tolist()} bytes (K, V) in the "
                             f"state, {want[li].tolist()} in this cache")
        heads = r.array("<u4", n_stream, "heads") if seq_id < 0 else None

        allowed = seq_mask(range(self.n_seq_max))
        streams = []
        for st in range(n_stream):
            n_cells, n_runs = r.unpack(_STREAM, "stream header")
            if n_cells > self.kv_size:
                raise StateError(f"{where}: stream {st} of the state holds {n_cells} cells, the cache has {self.kv_size}")
            if n_runs > n_cells or (n_cells > 0) != (n_runs > 0):
                raise StateError(f"{where}: stream {st} of the state has {n_runs} runs for {n_cells} cells")
            runs = r.array("<u4", 2 * n_runs, "cell runs").reshape(n_runs, 2).astype(np.int64)
            cells = r.array(CELL_DTYPE, n_cells, "cells")
            if n_cells == 0:
                continue
            first, lens = runs[:, 0], runs[:, 1]
            if lens.min() < 1 or int(lens.sum()) != n_cells or np.any(first[1:] < first[:-1] + lens[:-1]):
                raise StateError(f"{where}: stream {st} of the state has malformed cell runs")
            if seq_id < 0 and int(first[-1] + lens[-1]) > self.kv_size:
                raise StateError(f"{where}: stream {st} of the state uses cell {int(first[-1] + lens[-1]) - 1}, "
                                 f"the cache has {self.kv_size} cells")
            pos = cells["pos"]
            if pos.min() < 0 or pos.max() >= POS_MAX:
                raise StateError(f"{where}: a position of the state is outside [0, {POS_MAX})")
            bits = cells["seq"]
            if seq_id >= 0:
                if np.any(bits != seq_mask(src_seq)):
                    raise StateError(f"{where}: a cell of the sequence state does not hold exactly sequence {src_seq}")
            else:
                if np.any(bits & ~allowed):
                    raise StateError(f"{where}: the state holds sequence ids outside [0, n_seq_max={self.n_seq_max})")
                if not np.all(bits.any(axis=1)):
                    raise StateError(f"{where}: a used cell of the state holds no sequence")
                if n_stream > 1:
                    if np.any(bits != seq_mask(st)):
                        raise StateError(f"{where}: stream {st} of the state holds another sequence than {st}")
            streams.append((st, runs, cells))
        if seq_id >= 0 and len(streams) > 1:
            raise StateError(f"{where}: the sequence state has cells in {len(streams)} streams")

        rows_k, rows_v = [int(x) for x in want[:, 0]], [int(x) for x in want[:, 1]]
        chunks = []  # per saved stream: (K chunks per layer per run, V chunks per layer per run)
        for st, runs, cells in streams:
            run_lens = [int(n) for n in runs[:, 1]]
            ks = [[r.data(n * rows_k[li], "K rows").view(self.k[li].dtype).reshape((n,) + self.k[li].shape[2:])
                   for n in run_lens] for li in range(n_layer)]
            if self.v_trans:
                vs = [[r.data(n * rows_v[li], "V columns").view(self.v[li].dtype).reshape(self.v[li].shape[1:-1] + (n,))
                       for n in run_lens] for li in range(n_layer)]
            else:
                vs = [[r.data(n * rows_v[li], "V rows").view(self.v[li].dtype).reshape((n,) + self.v[li].shape[2:])
                       for n in run_lens] for li in range(n_layer)]
            chunks.append((ks, vs))

        def copy_rows(st: int, lens: list[int], dst_runs: np.ndarray, ks, vs) -> None:
            """Every layer's rows of the saved runs into the cells of dst_runs, in one native call."""
            pairs = []
            for j, off, d0, n in _pair_runs(lens, dst_runs):
                for li in range(n_layer):
                    pairs.append(row_views(self.k[li][st, d0:d0 + n], ks[li][j][off:off + n]))
                    if self.v_trans:
                        pairs.append(row_views(self.v[li][st, ..., d0:d0 + n], vs[li][j][..., off:off + n]))
                    else:
                        pairs.append(row_views(self.v[li][st, d0:d0 + n], vs[li][j][off:off + n]))
            dsts, srcs = zip(*pairs) if pairs else ((), ())
            _buffers.copy_rows(dsts, srcs, PASS_THREADS)

        def install_all() -> None:
            with self.lock:
                _install_all()

        def _install_all() -> None:
            self.clear(data=False)
            for (st, runs, cells), (ks, vs) in zip(streams, chunks):
                idx = np.concatenate([np.arange(a, a + n) for a, n in runs])
                states = np.zeros(idx.size, dtype=CELL_STATE_DTYPE)
                for f in ("pos", "x", "y", "tok", "seq"):
                    states[f] = cells[f]
                self.meta.streams[st].restore(idx, states)
                copy_rows(st, [int(n) for n in runs[:, 1]], runs, ks, vs)
            h = np.asarray(heads, dtype=np.int64)
            self.meta.heads[:] = np.where(h <= self.kv_size, h, 0)  # a head may sit just past the last cell
            self._changed()

        def install_seq() -> None:
            with self.lock:
                _install_seq()

        def _install_seq() -> None:
            self.seq_rm(seq_id, -1, -1)
            if not streams:
                return
            (_, runs, cells), (ks, vs) = streams[0], chunks[0]
            n = cells.shape[0]
            ub = UBatch.of_sequence(seq_id, cells["pos"], cells["tok"])
            slot = self.meta.prepare([ub], cont=True) or self.meta.prepare([ub])
            if not slot:
                raise StateError(f"{where}: no room for the {n} cells of the saved sequence "
                                 f"({self.n_used}/{self.n_cells} cells used)")
            self.apply_ubatch(ub, slot[0])
            self.release_ubatch()
            strm, idxs = slot[0]
            st = int(strm[0])
            if np.any(cells["x"]) or np.any(cells["y"]):
                c = self.meta.streams[st]
                states = c.snapshot(idxs)
                states["x"], states["y"] = cells["x"], cells["y"]
                c.restore(idxs, states)
            copy_rows(st, [int(n) for n in runs[:, 1]], _runs(np.asarray(idxs)), ks, vs)

        return install_all if seq_id < 0 else install_seq


def _as_float(a, shape: tuple, what: str) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype not in (np.float32, np.float16):
        raise ValueError(f"{what} must be float32 or float16, got {a.dtype}")
    if a.shape != shape:
        raise ValueError(f"{what} shape {a.shape} != {shape}")
    return a


def _column_order(pos: list[np.ndarray], bits: list[np.ndarray], ubatch: UBatch) -> np.ndarray | None:
    """The order of the mask's columns: None (the cells' own order) when every sequence of the
    ubatch holds its cells in position order, as a sequence decoded alone does; else per stream
    the cells sorted by position (int32 [n_stream, n_kv]). Attention takes a row's visible cells
    in column order, so its bits then depend only on the positions and contents of those cells,
    not on where a prefix cache's seq_cp, an eviction or a restore put them. One O(n_kv) pass per
    stream for all the ubatch's sequences (kq_mask.cells_in_order)."""
    seqs = ubatch.seq_id_unq if ubatch.seq_id_unq.size else np.unique(ubatch.seq_id)
    if all(_mask.cells_in_order(p, b, seqs) for p, b in zip(pos, bits)):
        return None
    return np.ascontiguousarray(np.stack([np.argsort(p, kind="stable") for p in pos]).astype(np.int32))


# ---- state helpers --------------------------------------------------------------------------
def _runs(idx: np.ndarray) -> np.ndarray:
    """[n_runs, 2] (first, length) of the runs of consecutive values in idx (in its order)."""
    if idx.size == 0:
        return np.zeros((0, 2), dtype=np.int64)
    idx = idx.astype(np.int64)
    cut = np.flatnonzero(np.diff(idx) != 1) + 1
    starts = np.concatenate(([0], cut))
    ends = np.concatenate((cut, [idx.size]))
    return np.stack([idx[starts], ends - starts], axis=1)


def _name8(s: str) -> bytes:
    return s.encode("ascii")[:8]


def _unname8(b: bytes) -> str:
    return b.rstrip(b"\0").decode("ascii", "replace")


def _check(what: str, got, want, where: str) -> None:
    if got != want:
        raise StateError(f"{where}: the state was saved with {what} {got!r}, this cache has {want!r}")


def _pair_runs(src_lens: list[int], dst_runs: np.ndarray) -> list[tuple[int, int, int, int]]:
    """Copies that move cells saved in runs of src_lens (in order) to the destination runs
    [n, 2] (first cell, length) holding the same number of cells: (src run, offset, first dst cell, n)."""
    out = []
    j, off = 0, 0
    for d0, dn in dst_runs:
        d0, dn = int(d0), int(dn)
        while dn:
            n = min(dn, src_lens[j] - off)
            out.append((j, off, d0, n))
            d0 += n
            dn -= n
            off += n
            if off == src_lens[j]:
                j, off = j + 1, 0
    return out
