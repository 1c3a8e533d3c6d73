"""The interleaved sliding-window cache (llama.cpp's llama_kv_cache_iswa).

Two KV caches behind one memory: the base cache holds the full-attention layers, the SWA cache
holds the sliding-window layers and only needs the window (plus one ubatch) per sequence:
    size_swa = pad256(min(size_base, n_swa * (n_seq_max if unified else 1) + n_ubatch))
(size_base when swa_full). Every seq_* goes to both; a batch is placed in both or in neither.

Shifting with the small SWA cache (llama.cpp refuses it: can_shift is false there, see llama.cpp
#12357). Both caches shift their cells and rotate their K, each layer with its own RoPE. What the small cache
lacks are the cells of a sequence older than the window, overwritten once the ring wrapped; the
cells inside the window are all there (only cells the window hides are reused). After a context
shift that keeps a prefix and discards n positions after it, the window of the next token reaches
back n positions further, so it shows the kept prefix again when n is large: the SWA layers of a
swa_full cache would attend to those prefix cells, the small cache no longer has them. As long as
n <= exact_shift_limit(seq_id, keep_end) the window stays clear of every prefix cell the small cache
has lost, and the shift gives what a swa_full cache gives (the same cells are visible; only their
order in the cache, and so the summation order, differs). llamax.generate clamps its discards to it.
"""
from __future__ import annotations

import logging
from typing import Iterable, Sequence

from llamax import checks, state
from llamax.batch import BatchAllocator, UBatch
from llamax.dtypes import N_CTX_PAD, pad
from llamax.errors import LlamaxError, NoKVSlotError
from llamax.memory.base import KVMemory, Memory, MemoryContext, check_streams, locked, split_batch
from llamax.memory.kv_cache import KVCache
from llamax.rope import RoPE

log = logging.getLogger("llamax")


def swa_cache_size(kv_size: int, n_swa: int, n_seq_max: int, unified: bool, n_ubatch: int,
                   swa_full: bool) -> int:
    """Cells per stream of the SWA cache, as llama.cpp sizes it."""
    if swa_full:
        return kv_size
    return min(kv_size, pad(n_swa * (n_seq_max if unified else 1) + n_ubatch, N_CTX_PAD))


class KVCacheISWA(KVMemory):
    """A base KVCache for the full-attention layers and a SWA KVCache for `swa_layers`.

    Args:
        n_layer, n_head_kv, head_dim, kv_size: as KVCache (kv_size is the base cache's, per stream).
        swa_layers: the layers with sliding-window attention (llama.cpp's hparams.swa_layers).
        n_swa, swa_type: the window; swa_type "standard", "chunked" or "symmetric".
        swa_full: give the SWA cache the full size (llama.cpp's --swa-full); only then can it shift.
        n_ubatch: the context's ubatch size, part of the SWA cache size.
        rope, rope_swa: RoPE of the base and of the SWA layers (rope_swa defaults to rope): each one RoPE
            for every layer of its cache, or a sequence with one entry per layer of its cache, in layer
            order (the base cache's layers for rope, swa_layers for rope_swa): the layer's RoPE, or None
            for a NoPE layer (KVCache's rope). A sequence for rope needs rope_swa given too.
        other keywords: as KVCache (head_dim_v, n_seq_max, unified, type_k, type_v, v_trans, n_threads).
    """

    def __init__(self, n_layer: int, n_head_kv: int, head_dim: int, kv_size: int, *,
                 swa_layers: Sequence[int], n_swa: int, swa_type: str = "standard", swa_full: bool = False,
                 n_ubatch: int = 512, rope: RoPE | Sequence[RoPE | None] | None = None,
                 rope_swa: RoPE | Sequence[RoPE | None] | None = None,
                 n_seq_max: int = 1, unified: bool = True, **kw) -> None:
        super().__init__()
        swa = sorted({checks.integer(i, "swa_layers entry") for i in swa_layers})
        if any(i < 0 or i >= n_layer for i in swa):
            raise ValueError(f"swa_layers {swa} outside [0, {n_layer})")
        if swa_type == "none" or n_swa <= 0:
            raise ValueError(f"KVCacheISWA needs a sliding window (n_swa {n_swa}, swa_type {swa_type!r})")
        base = [i for i in range(n_layer) if i not in set(swa)]
        if not base or not swa:
            raise ValueError("KVCacheISWA needs both full-attention and sliding-window layers")
        if rope_swa is None and rope is not None and not isinstance(rope, RoPE):
            raise ValueError("rope is per layer of the base cache: give rope_swa for the SWA layers too")
        size_swa = swa_cache_size(kv_size, n_swa, n_seq_max, unified, n_ubatch, swa_full)
        if swa_full:
            log.warning("llama_kv_cache_iswa: using full-size SWA cache")
        log.info("llama_kv_cache_iswa: creating non-SWA KV cache, size = %d cells", kv_size)
        self.base = KVCache(len(base), n_head_kv, head_dim, kv_size, n_seq_max=n_seq_max, unified=unified,
                            rope=rope, layer_ids=base, **kw)
        log.info("llama_kv_cache_iswa: creating     SWA KV cache, size = %d cells", size_swa)
        self.swa = KVCache(len(swa), n_head_kv, head_dim, size_swa, n_seq_max=n_seq_max, unified=unified,
                           n_swa=n_swa, swa_type=swa_type, rope=rope_swa if rope_swa is not None else rope,
                           layer_ids=swa, **kw)
        self.unified = bool(unified)
        self.swa_full = bool(swa_full)
        self.n_layer = n_layer
        self._of = {il: self.base for il in base} | {il: self.swa for il in swa}

    @property
    def generation(self):
        """The pair of the two caches' generations: a change made through either moves it on."""
        return (self.base.generation, self.swa.generation)

    def cache_of(self, il: int) -> KVCache:
        """The sub-cache that stores layer il."""
        try:
            return self._of[il]
        except KeyError:
            raise ValueError(f"layer {il} outside [0, {self.n_layer})") from None

    # ---- shape ----------------------------------------------------------------------------------
    @property
    def n_seq_max(self) -> int:
        return self.base.n_seq_max

    @property
    def exact_cut(self) -> bool:
        """swa_full: the sliding layers keep every cell too (see Memory.exact_cut)."""
        return self.swa_full and self.base.exact_cut

    @property
    def can_shift(self) -> bool:
        """Both caches have a RoPE, and the SWA cache is full size or slides a standard window (a
        chunked window's cells are not a suffix of the sequence, so a small cache cannot shift them)."""
        full = self.base.kv_size == self.swa.kv_size
        return self.base.can_shift and self.swa.can_shift and (full or self.swa.swa_type == "standard")

    @locked
    def exact_shift_limit(self, seq_id: int, keep_end: int) -> int | None:
        """The largest n_discard for which discarding [keep_end, keep_end + n_discard) of seq_id and
        moving the rest down gives the same visible cells as a swa_full cache would: the window of
        the next token must not reach a prefix cell the small SWA cache has overwritten. None when
        any discard is exact (full-size SWA cache, or the SWA cache still holds the whole prefix);
        a value < 1 means no discard is exact. O(1).

        With the sequence's positions [p_start, n_past), the SWA cache holding [swa_min, n_past) and
        m = min(swa_min, keep_end), the lost prefix cells are [p_start, m); the next token after the
        shift sits at n_past - n and sees positions > n_past - n - n_swa, so the limit is
        n_past + 1 - n_swa - m."""
        if self.base.kv_size == self.swa.kv_size:
            return None
        start, swa_min = self.base.seq_pos_min(seq_id), self.swa.seq_pos_min(seq_id)
        if start < 0 or swa_min <= start or keep_end <= start:
            return None
        n_past = self.swa.seq_pos_max(seq_id) + 1
        return n_past + 1 - self.swa.n_swa - min(swa_min, keep_end)

    @property
    def n_cells(self) -> int:
        return self.base.n_cells + self.swa.n_cells

    @property
    @locked
    def n_used(self) -> int:
        return self.base.n_used + self.swa.n_used

    @property
    @locked
    def n_free(self) -> int:
        """The base cache's empty cells: every position takes one there, while the SWA cache reuses
        the cells that left the window."""
        return self.base.n_free

    def breakdown(self) -> dict[str, int]:
        b, s = self.base.breakdown(), self.swa.breakdown()
        return {"k": b["k"], "v": b["v"], "k_swa": s["k"], "v_swa": s["v"]}

    @locked
    def cells(self) -> list[tuple[int, frozenset[int]]]:
        """The base cache's cells then the SWA cache's."""
        return self.base.cells() + self.swa.cells()

    # ---- sequences ------------------------------------------------------------------------------
    # Both caches check the same arguments the same way, so the base cache raising first leaves both
    # unchanged; seq_add / seq_div check both caches before either changes.
    @locked
    def clear(self, data: bool = True) -> None:
        self.base.clear(data)
        self.swa.clear(data)

    @locked
    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        r0 = self.base.seq_rm(seq_id, p0, p1)
        r1 = self.swa.seq_rm(seq_id, p0, p1)
        return r0 and r1

    @locked
    def seq_cp(self, seq_id_src: int, seq_id_dst: int, p0: int = -1, p1: int = -1) -> None:
        self.base.seq_cp(seq_id_src, seq_id_dst, p0, p1)
        self.swa.seq_cp(seq_id_src, seq_id_dst, p0, p1)

    @locked
    def seq_keep(self, seq_id: int) -> None:
        self.base.seq_keep(seq_id)
        self.swa.seq_keep(seq_id)

    def _check_shift(self, what: str) -> None:
        if not self.can_shift:
            raise LlamaxError(f"{what}: this iSWA cache cannot shift positions (can_shift is False: it needs a "
                              "RoPE for both caches, and a full-size SWA cache (swa_full=True) unless its window "
                              "is a standard sliding window)")

    @locked
    def seq_add(self, seq_id: int, p0: int, p1: int, shift: int) -> None:
        args = self.base.check_seq_add(seq_id, p0, p1, shift)
        if args[3] != 0:
            self._check_shift(f"seq_add({seq_id}, {p0}, {p1}, {shift})")
        self.swa.check_seq_add(*args)
        self.base.seq_add(*args)
        self.swa.seq_add(*args)

    @locked
    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        args = self.base.check_seq_div(seq_id, p0, p1, d)
        if args[3] != 1:
            self._check_shift(f"seq_div({seq_id}, {p0}, {p1}, {d})")
        self.swa.check_seq_div(*args)
        self.base.seq_div(*args)
        self.swa.seq_div(*args)

    @locked
    def seq_pos_min(self, seq_id: int) -> int:
        """From the SWA cache, as llama.cpp: the oldest position any layer still sees."""
        return self.swa.seq_pos_min(seq_id)

    @locked
    def seq_pos_max(self, seq_id: int) -> int:
        return self.swa.seq_pos_max(seq_id)

    # ---- sharing -------------------------------------------------------------------------------
    @locked
    def seq_unshare(self, seq_id: int, p0: int = -1, p1: int = -1) -> int:
        """KVCache.seq_unshare in both caches (the SWA cache copies only the cells its window still
        shows). On NoKVSlotError the base cache may already have its copies: a state as valid as
        before, with fewer shared cells."""
        return self.base.seq_unshare(seq_id, p0, p1) + self.swa.seq_unshare(seq_id, p0, p1)

    @locked
    def reusable_prefix(self, seq_id: int, n: int) -> int:
        """KVCache.reusable_prefix of both caches: every position in the base cache, the window's
        in the SWA cache (whose older cells the slot finder reuses once the window hides them)."""
        return self.swa.reusable_prefix(seq_id, self.base.reusable_prefix(seq_id, n))

    @locked
    def held_only_by(self, seq_ids: Iterable[int]) -> tuple[int, int]:
        seq_ids = list(seq_ids)
        (a, x), (b, y) = self.base.held_only_by(seq_ids), self.swa.held_only_by(seq_ids)
        return a + b, x + y

    # ---- decoding -------------------------------------------------------------------------------
    @locked
    def update(self) -> bool:
        a = self.base.update()
        b = self.swa.update()
        return a or b

    @locked
    def init_batch(self, balloc: BatchAllocator, n_ubatch: int) -> MemoryContext:
        """As KVCache.init_batch, placing every ubatch in both caches: first with a simple split
        (unified caches), then with an equal split, as llama_kv_cache_iswa::init_batch does. A
        ubatch's slot is the pair (base slot, SWA slot).

        Raises:
            BatchError: as KVCache.init_batch. NoKVSlotError: it does not fit in both caches.
        """
        check_streams(self, balloc)
        for equal in ((False, True) if self.unified else (True,)):
            ubatches = split_batch(balloc, n_ubatch, equal=equal, sequential=not self.unified)
            if ubatches is None:
                continue
            sb = self.base.meta.prepare(ubatches)
            if sb is None:
                continue
            ss = self.swa.meta.prepare(ubatches)
            if ss is None:
                continue
            return MemoryContext(self, ubatches, list(zip(sb, ss)))
        raise NoKVSlotError(f"no KV slot for a batch of {balloc.n_tokens} tokens "
                            f"(base {self.base.n_used}/{self.base.n_cells}, swa {self.swa.n_used}/{self.swa.n_cells} "
                            "cells used)")

    @locked
    def apply_ubatch(self, ubatch: UBatch, slot: tuple) -> None:
        """Write the ubatch's cells in both caches (slot: (base slot, SWA slot))."""
        self.base.apply_ubatch(ubatch, slot[0])
        self.swa.apply_ubatch(ubatch, slot[1])

    @locked
    def release_ubatch(self) -> None:
        self.base.release_ubatch()
        self.swa.release_ubatch()

    @locked
    def store(self, il: int, ubatch, k, v) -> None:
        self.cache_of(il).store(il, ubatch, k, v)

    @locked
    def attend(self, il: int, ubatch, q, *, scale: float | None = None, softcap: float = 0.0,
               causal: bool = True, out=None):
        return self.cache_of(il).attend(il, ubatch, q, scale=scale, softcap=softcap, causal=causal, out=out)

    @locked
    def layer_view(self, il: int, ubatch):
        return self.cache_of(il).layer_view(il, ubatch)

    @locked
    def layer_views(self, ubatch):
        return {**self.base.layer_views(ubatch), **self.swa.layer_views(ubatch)}

    # ---- state (llama_state_*; the format is in llamax/state.py) --------------------------------
    @locked
    def state_write(self, w, seq_id: int = -1) -> None:
        """The base cache's state, then the SWA cache's (which keeps only the cells in the window)."""
        state.write_tag(w, state.TAG_ISWA)
        self.base.state_write(w, seq_id)
        self.swa.state_write(w, seq_id)

    @locked
    def state_read(self, r, seq_id: int = -1):
        """Validate both sections before either cache changes; the installer restores both."""
        state.read_tag(r, state.TAG_ISWA)
        install_base = self.base.state_read(r, seq_id)
        install_swa = self.swa.state_read(r, seq_id)

        def install() -> None:
            with self.lock:
                install_base()
                install_swa()

        return install
