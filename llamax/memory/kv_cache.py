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
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from llamax._native import attention as _attn
from llamax._native import hadamard as _had
from llamax._native import kq_mask as _mask
from llamax._native import quants as _quants
from llamax._native import rope as _rope
from llamax._native.cells import SWA_TYPES, KVCells
from llamax.batch import Batch, UBatch
from llamax.errors import LlamaxError, NoKVSlotError
from llamax.memory.base import Memory, Plan, make_allocator, pad, split_batch
from llamax.params import resolve_n_threads
from llamax.rope import RoPE

log = logging.getLogger("llamax")

CACHE_TYPES = {"f32": np.float32, "f16": np.float16}
QUANT_TYPES = {"q8_0": 34, "q4_0": 18}  # bytes per block of 32 values (llama.cpp's block_q8_0 / block_q4_0)
QK = 32
N_KV_PAD = 256  # llama.cpp pads the attended cell count so the graph keeps its shape

MiB = 1024.0 * 1024.0
LX_DEBUG = int(os.environ.get("LX_DEBUG", "0") or 0)  # > 0: log the cell map after every ubatch


def _check_type(name: str, what: str) -> str:
    if name not in CACHE_TYPES and name not in QUANT_TYPES:
        raise ValueError(f"{what} {name!r} not in {sorted(CACHE_TYPES) + sorted(QUANT_TYPES)}")
    return name


def _row_layout(t: str, n_stream: int, kv_size: int, n_head: int, d: int) -> tuple[tuple, type]:
    """Shape and dtype of a K (or untransposed V) buffer of type t."""
    if t in QUANT_TYPES:
        return (n_stream, kv_size, n_head * d // QK * QUANT_TYPES[t]), np.uint8
    return (n_stream, kv_size, n_head, d), CACHE_TYPES[t]


def _rot_disabled() -> bool:
    """llama.cpp's LLAMA_ATTN_ROT_DISABLE (also read as LLAMAX_ATTN_ROT_DISABLE)."""
    return any(os.environ.get(v, "0") not in ("", "0") for v in ("LLAMAX_ATTN_ROT_DISABLE", "LLAMA_ATTN_ROT_DISABLE"))


@dataclass
class _Active:
    """The ubatch being applied: its slot and the masks built for it (one per causal flag)."""

    ubatch: UBatch
    strm: np.ndarray   # uint32 [n_parts]
    idxs: np.ndarray   # uint32 [n_tokens]
    contiguous: bool
    masks: dict


class KVCache(Memory):
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
        rope: enables K-shift (seq_add / seq_div); can_shift is False without it.
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
                 n_swa: int = 0, swa_type: str = "none", rope: RoPE | None = None,
                 n_threads: int | None = None, layer_ids: Sequence[int] | None = None,
                 name: str = "llama_kv_cache", rotate: bool | None = None) -> None:
        for what, val in (("n_layer", n_layer), ("n_head_kv", n_head_kv), ("head_dim", head_dim),
                          ("kv_size", kv_size)):
            if not isinstance(val, (int, np.integer)) or val <= 0:
                raise ValueError(f"{what} must be a positive int, got {val!r}")
        if not 1 <= n_seq_max <= 256:
            raise ValueError(f"n_seq_max must be in [1, 256], got {n_seq_max}")
        if swa_type not in SWA_TYPES:
            raise ValueError(f"swa_type {swa_type!r} not in {sorted(SWA_TYPES)}")
        if swa_type != "none" and n_swa <= 0:
            raise ValueError(f"swa_type {swa_type!r} needs n_swa > 0, got {n_swa}")
        if rope is not None and not isinstance(rope, RoPE):
            raise TypeError(f"rope must be a llamax.RoPE, got {type(rope).__name__}")
        if rope is not None and rope.n_rot > head_dim:
            raise ValueError(f"rope.n_rot {rope.n_rot} > head_dim {head_dim}")
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
        _check_type(type_k, "type_k")
        _check_type(type_v, "type_v")
        self.head_dim_v = head_dim if head_dim_v is None else head_dim_v
        for t, d, what in ((type_k, head_dim, "head_dim"), (type_v, self.head_dim_v, "head_dim_v")):
            if t in QUANT_TYPES and d % QK:
                raise ValueError(f"a {t} cache needs {what} to be a multiple of {QK}, got {d}")
        if type_v in QUANT_TYPES and self.v_trans:
            raise ValueError(f"a quantized V cache (type_v {type_v!r}) requires flash attention: it cannot be "
                             "stored transposed (v_trans=True)")
        if rotate is None:
            rotate = not _rot_disabled()
        self.rot_k = _had.rot_block(head_dim) if rotate and type_k in QUANT_TYPES else 0
        self.rot_v = _had.rot_block_v(self.head_dim_v) if rotate and type_v in QUANT_TYPES else 0
        self.n_swa = int(n_swa) if swa_type != "none" else 0
        self.swa_type = swa_type
        self.rope = rope
        self.n_threads = resolve_n_threads(n_threads)
        self.name = name

        self.meta = KVCells(kv_size, self.n_stream, n_seq_max, self.n_swa, swa_type)
        ks, kdt = _row_layout(type_k, self.n_stream, kv_size, n_head_kv, head_dim)
        if self.v_trans:
            vs, vdt = (self.n_stream, n_head_kv, self.head_dim_v, kv_size), CACHE_TYPES[type_v]
        else:
            vs, vdt = _row_layout(type_v, self.n_stream, kv_size, n_head_kv, self.head_dim_v)
        self.k = [np.zeros(ks, dtype=kdt) for _ in range(n_layer)]
        self.v = [np.zeros(vs, dtype=vdt) for _ in range(n_layer)]
        self._pending_copies: list[tuple[int, int]] = []
        self._active: _Active | None = None
        log.info("%s", self.summary())

    # ---- shape ----------------------------------------------------------------------------------
    @property
    def n_seq_max(self) -> int:
        return self._n_seq_max

    @property
    def can_shift(self) -> bool:
        return self.rope is not None

    @property
    def n_cells(self) -> int:
        return self.kv_size * self.n_stream

    @property
    def n_used(self) -> int:
        return self.meta.n_used

    def breakdown(self) -> dict[str, int]:
        """Bytes of the K and V buffers (the cell table is not counted, as in llama.cpp)."""
        return {"k": sum(a.nbytes for a in self.k), "v": sum(a.nbytes for a in self.v)}

    def summary(self) -> str:
        """The KV size line llama.cpp logs when it creates a cache."""
        b = self.breakdown()
        return ("size = %7.2f MiB (%6u cells, %3d layers, %2u/%u seqs), K (%s): %7.2f MiB, V (%s): %7.2f MiB"
                % ((b["k"] + b["v"]) / MiB, self.kv_size, self.n_layer, self._n_seq_max, self.n_stream,
                   self.type_k, b["k"] / MiB, self.type_v, b["v"] / MiB))

    def cells(self) -> list[tuple[int, frozenset[int]]]:
        return self.meta.cells()

    def __repr__(self) -> str:
        return f"KVCache({self.summary()}, used {self.n_used})"

    # ---- sequences ------------------------------------------------------------------------------
    def clear(self, data: bool = True) -> None:
        self.meta.clear()
        self._pending_copies.clear()
        self._active = None
        if data:
            for a in self.k + self.v:
                a.fill(0)

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        return self.meta.seq_rm(seq_id, p0, p1)

    def seq_cp(self, seq_id_src: int, seq_id_dst: int, p0: int = -1, p1: int = -1) -> None:
        pending = self.meta.seq_cp(seq_id_src, seq_id_dst, p0, p1)
        if pending is not None:
            self._pending_copies.append(pending)

    def seq_keep(self, seq_id: int) -> None:
        self.meta.seq_keep(seq_id)

    def _check_shift(self, what: str) -> None:
        if not self.can_shift:
            raise LlamaxError(f"{what}: this cache cannot shift positions (can_shift is False: "
                              + ("no RoPE was given" if self.rope is None else "see can_shift") + ")")

    def seq_add(self, seq_id: int, p0: int, p1: int, shift: int) -> None:
        if shift != 0:
            self._check_shift(f"seq_add({seq_id}, {p0}, {p1}, {shift})")
        self.meta.seq_add(seq_id, p0, p1, shift)

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        if d <= 0:
            raise ValueError(f"seq_div by {d}: the divisor must be positive")
        if d != 1:
            self._check_shift(f"seq_div({seq_id}, {p0}, {p1}, {d})")
        self.meta.seq_div(seq_id, p0, p1, d)

    def seq_pos_min(self, seq_id: int) -> int:
        return self.meta.seq_pos_min(seq_id)

    def seq_pos_max(self, seq_id: int) -> int:
        return self.meta.seq_pos_max(seq_id)

    # ---- update ---------------------------------------------------------------------------------
    def update(self) -> bool:
        """Copy pending stream rows (cross-stream seq_cp), then rotate K of shifted cells."""
        did = False
        for s0, s1 in self._pending_copies:
            for a in self.k + self.v:
                a[s1] = a[s0]
            did = True
        self._pending_copies.clear()
        if self.meta.get_has_shift():
            assert self.rope is not None, "shifts are refused without a RoPE"
            r = self.rope
            for st, cells in enumerate(self.meta.streams):
                shift = cells.shift_view()
                if not shift.any():
                    continue
                for k in self.k:
                    _rope.k_shift(k[st].reshape(self.kv_size, -1), shift, self.n_head_kv, self.head_dim,
                                  r.n_rot, r.freq_base, r.freq_scale, r.mode, self.n_threads,
                                  type=self.type_k, rot_block=self.rot_k)
            for cells in self.meta.streams:
                cells.reset_shift()
            did = True
        return did

    # ---- planning -------------------------------------------------------------------------------
    def plan(self, batch: Batch, n_ubatch: int = 512, *, n_vocab: int | None = None,
             n_batch: int | None = None, output_all: bool = False) -> Plan:
        """Validate the batch, split it into ubatches of at most n_ubatch tokens and reserve cells
        for every one of them (llama_kv_cache::init_batch). Nothing changes until the plan is iterated.

        Raises:
            BatchError: the batch is invalid (the message names the token and the rule).
            NoKVSlotError: it does not fit in the cache.
        """
        if n_ubatch <= 0:
            raise ValueError(f"n_ubatch must be > 0, got {n_ubatch}")
        self.update()
        balloc = make_allocator(self, batch, n_vocab=n_vocab, n_batch=n_batch, output_all=output_all)
        ubatches = split_batch(balloc, n_ubatch, equal=self.n_stream > 1, sequential=not self.unified)
        slots = None if ubatches is None else self.meta.prepare(ubatches)
        if slots is None:
            raise NoKVSlotError(f"no KV slot for a batch of {balloc.n_tokens} tokens "
                                f"({self.n_used}/{self.n_cells} cells used)")
        return Plan(self, balloc, ubatches, [slots])

    # ---- applying -------------------------------------------------------------------------------
    def _apply(self, ubatch: UBatch, slots: list) -> None:
        strm, idxs = slots[0]
        self.meta.apply_ubatch(ubatch, strm, idxs)
        self._active = _Active(ubatch, strm, idxs, KVCells.is_contiguous(strm, idxs), {})
        if LX_DEBUG:
            log.info("%s: cells after a ubatch of %d tokens:\n%s", self.name, ubatch.n_tokens, self.meta.dump())

    def _finish(self) -> None:
        self._active = None

    def _active_for(self, il: int, ubatch: UBatch) -> tuple[_Active, int]:
        act = self._active
        if act is None or act.ubatch is not ubatch:
            raise ValueError("this ubatch is not the one being applied: iterate the plan and store/attend "
                             "inside the loop")
        if il not in self._layer:
            raise ValueError(f"layer {il} is not stored in this cache (layers {self.layer_ids[:8]}...)")
        return act, self._layer[il]

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
        if self.type_k in QUANT_TYPES:
            k = self._rotated(k, self.rot_k)
        if self.type_v in QUANT_TYPES:
            v = self._rotated(v, self.rot_v)
        for p in range(n_parts):
            st = int(act.strm[p])
            ix = act.idxs[p * n_per:(p + 1) * n_per]
            sel = slice(int(ix[0]), int(ix[0]) + n_per) if act.contiguous else ix
            kp, vp = k[p * n_per:(p + 1) * n_per], v[p * n_per:(p + 1) * n_per]
            if self.type_k in QUANT_TYPES:
                _quants.set_rows(self.type_k, kp, K[st], ix, self.n_threads)
            else:
                K[st, sel] = kp
            if self.type_v in QUANT_TYPES:
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

    def n_kv(self, strm: np.ndarray | None = None) -> int:
        """Cells attention looks at: llama.cpp's get_n_kv (used range padded to 256, at most kv_size)."""
        streams = range(self.n_stream) if strm is None else (int(s) for s in strm)
        n = 0
        for st in streams:
            used = self.meta.streams[st].used_max_p1
            n = max(n, min(self.kv_size, max(N_KV_PAD, pad(used, N_KV_PAD))))
        return n

    def mask(self, ubatch: UBatch, *, causal: bool = True) -> np.ndarray:
        """The KQ mask of the ubatch being applied, [n_parts, n_tps_pad, n_kv] (built once per ubatch)."""
        act = self._active
        if act is None or act.ubatch is not ubatch:
            raise ValueError("this ubatch is not the one being applied")
        m = act.masks.get(causal)
        if m is None:
            n_kv = self.n_kv(act.strm)
            streams = [self.meta.streams[int(s)] for s in act.strm]
            m = _mask.kq_mask_fill([c.pos_view()[:n_kv] for c in streams],
                                   [c.seq_view()[:n_kv] for c in streams],
                                   ubatch.pos, ubatch.seq_id, causal=causal, n_swa=self.n_swa,
                                   swa_type=SWA_TYPES[self.swa_type], alibi=False, n_threads=self.n_threads)
            act.masks[causal] = m
        return m

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
                         type_k=self.type_k, type_v=self.type_v)
        if self.rot_v:  # a weighted sum of rotated V rows: rotate it back
            _had.hadamard_rows(out.reshape(n, -1), self.rot_v, self.n_threads)
        return out

    # ---- state (llama_state_*; the format is in llamax/state.py) --------------------------------
    def state_write(self, w, seq_id: int = -1) -> None:
        """Append this cache's state to a llamax.state.StateWriter: every sequence (seq_id -1) or
        seq_id's cells alone, written as that sequence. Pending stream copies and K-shifts are
        applied first (update()), so the saved rows match the saved positions. The cells the
        sliding window hides from every sequence holding them are not written. O(kv_size) metadata
        work plus one slice per run of consecutive cells and layer."""
        from llamax import state

        self.update()
        state.write_kv_cache(w, self, seq_id)

    def state_read(self, r, seq_id: int = -1):
        """Parse and validate this cache's section of a state (llamax.state.StateReader) without
        changing anything; returns the function that installs it. A whole state goes back into the
        same cells with the same heads; a sequence state is placed as a ubatch would be (contiguous
        cells if possible) after seq_rm(seq_id).

        Raises:
            StateError: type_k/type_v, v_trans, n_layer, head sizes, row sizes, rotation, n_stream or
                the window differ from this cache's, or counts / positions / sequence ids are out of range.
        """
        from llamax import state

        return state.read_kv_cache(r, self, seq_id)


def _as_float(a, shape: tuple, what: str) -> np.ndarray:
    a = np.asarray(a)
    if a.dtype not in (np.float32, np.float16):
        raise ValueError(f"{what} must be float32 or float16, got {a.dtype}")
    if a.shape != shape:
        raise ValueError(f"{what} shape {a.shape} != {shape}")
    return a
