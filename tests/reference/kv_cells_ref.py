"""Pure-Python reference of llama.cpp's KV-cache bookkeeping (the test oracle).

Mirrors, on plain lists / sets / Counters and with clarity over speed:

- ``llama_kv_cells`` (src/llama-kv-cells.h)            -> :class:`RefCells` (one stream)
- ``llama_ubatch`` (src/llama-batch.h)                  -> :class:`RefUBatch`
- ``llama_kv_cache::slot_info`` (src/llama-kv-cache.h)  -> :class:`RefSlotInfo`
- ``llama_kv_cache`` metadata (src/llama-kv-cache.cpp)  -> :class:`RefKVCells`
  (find_slot, apply_ubatch, prepare, init_batch, update, seq_rm/cp/keep/add/div,
  seq_pos_min/max, clear)
- ``llama_kv_cache_iswa`` (src/llama-kv-cache-iswa.cpp) -> :class:`RefISWACells`
- ``llama_batch_allocr::split_simple / split_equal(sequential=True)``
  (src/llama-batch.cpp)                                 -> :func:`split_simple`, :func:`split_equal`
- ``llama_hparams::is_masked_swa`` (src/llama-hparams.cpp) -> :func:`is_masked_swa`

Semantics are llama.cpp's, except for these deliberate llamax decisions (the C core
follows them too):

(a) ``pos_div`` records ``shift += new_pos - old_pos``; llama.cpp records
    ``old - new``, which rotates K the wrong way at the next K-shift.
(b) ``seq_cp`` inside one stream adds ``dst`` only to cells that lack it
    (llama.cpp asserts; a double insertion would corrupt the position multiset).
(c) ``seq_cp`` across streams (non-unified cache) is supported only when llama.cpp's
    ``is_full`` test passes (ValueError otherwise, where llama.cpp aborts); it resets
    the destination stream, copies every cell of ``src`` as a cell holding ``dst`` only
    (position ``pos - shift`` then ``pos_add(shift)``, ext copied), copies the head and
    queues the pending row copy ``(src_stream, dst_stream)``.
(d) ``seq_div`` with ``d <= 0`` raises ValueError; sequence ids outside
    ``[0, n_seq_max)`` raise ValueError (``seq_rm`` also accepts -1 = every sequence).
    llama.cpp accepts any id < 256 in a unified cache.
(e) ``prepare`` restores *every* cell and head, so the cells end identical to before.
    llama.cpp restores only the cells of each slot, so cells purged by apply_ubatch
    outside the slot (SWA caches) stay purged, and it restores
    ``head[strm[s]] = v_heads_old[s]`` (part index, not stream index), which is wrong
    for a multi-stream ubatch whose first sequence is not 0.
(f) ``pos_add`` that empties a cell also resets its ext (llama.cpp leaves the stale ext
    of the now-empty cell, which nothing can observe).
(g) :class:`RefCells` ``cp``/``set`` save and restore ``shift`` too (llama.cpp asserts it
    is 0, which holds once ``update()`` has run before a batch).

Positions are Python ints; ``p1 < 0`` means ``POS_MAX`` (INT32_MAX) as in llama.cpp.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable, Sequence

LLAMA_MAX_SEQ = 256
POS_MAX = 2**31 - 1          # std::numeric_limits<llama_pos>::max()
TOKEN_NULL = -1              # LLAMA_TOKEN_NULL
EXT_NONE = (0, 0, TOKEN_NULL)  # llama_kv_cell_ext{} as (x, y, tok)
SWA_TYPES = ("none", "standard", "chunked", "symmetric")


def is_masked_swa(n_swa: int, swa_type: str, p0: int, p1: int) -> bool:
    """True if a query at position p1 must not see a key at position p0 (llama_hparams::is_masked_swa).

    Args:
        n_swa: window size in tokens (> 0 unless swa_type is "none").
        swa_type: one of SWA_TYPES.
        p0: key (cell) position, >= 0.
        p1: query position, >= 0.
    """
    assert p0 >= 0 and p1 >= 0
    if swa_type == "none":
        return False
    if swa_type == "standard":
        return p1 - p0 >= n_swa
    if swa_type == "chunked":
        return p0 < (p1 // n_swa) * n_swa
    if swa_type == "symmetric":
        half = n_swa // 2
        d = p1 - p0
        return d < -half or d > half
    raise ValueError(f"unknown swa_type {swa_type!r}")


def pad(x: int, n: int) -> int:
    """GGML_PAD: x rounded up to a multiple of n."""
    return (x + n - 1) // n * n


# ---------------------------------------------------------------------------------------
# llama_kv_cells: one stream of cells
# ---------------------------------------------------------------------------------------


class RefCells:
    """The cell table of one stream (llama_kv_cells).

    Invariants (checked by :meth:`check`):
      - ``pos[i] == -1`` (empty) or ``pos[i] >= 0``; ``used == {i : pos[i] != -1}``;
      - an empty cell has no sequence, ``shift == 0`` and ``ext == EXT_NONE``;
      - ``seq_pos[s]`` is the multiset ``{pos[i] : s in seq[i]}`` (a position may repeat).
    """

    def __init__(self, size: int) -> None:
        self.pos: list[int] = [-1] * size
        self.shift: list[int] = [0] * size
        self.ext: list[tuple[int, int, int]] = [EXT_NONE] * size
        self.seq: list[set[int]] = [set() for _ in range(size)]
        self.seq_pos: list[Counter] = [Counter() for _ in range(LLAMA_MAX_SEQ)]
        self.used: set[int] = set()
        self._has_shift = False

    # --- whole table --------------------------------------------------------------------

    def reset(self) -> None:
        for i in range(self.size()):
            self.pos[i] = -1
            self.ext[i] = EXT_NONE
            self.shift[i] = 0
            self.seq[i] = set()
        self._has_shift = False
        self.used = set()
        for s in range(LLAMA_MAX_SEQ):
            self.seq_pos[s] = Counter()

    def reset_shift(self) -> None:
        self._has_shift = False
        for i in range(self.size()):
            self.shift[i] = 0

    def size(self) -> int:
        return len(self.pos)

    def is_empty(self, i: int) -> bool:
        return self.pos[i] == -1

    def get_used(self) -> int:
        """Number of used (non-empty) cells."""
        return len(self.used)

    def used_min(self) -> int:
        """Index of the first used cell, 0 if none."""
        return min(self.used) if self.used else 0

    def used_max_p1(self) -> int:
        """Index of the last used cell + 1, 0 if none."""
        return max(self.used) + 1 if self.used else 0

    def get_has_shift(self) -> bool:
        return self._has_shift

    has_shift = get_has_shift

    # --- save / restore (prepare's rollback) -------------------------------------------

    def cp(self, idxs: Iterable[int]) -> list[tuple[int, tuple[int, int, int], frozenset[int], int]]:
        """Saved state (pos, ext, seqs, shift) of the cells idxs, in that order."""
        return [(self.pos[i], self.ext[i], frozenset(self.seq[i]), self.shift[i]) for i in idxs]

    def set(self, idxs: Sequence[int], saved: Sequence[tuple]) -> None:
        """Restore the cells idxs from :meth:`cp`'s result (same order)."""
        assert len(idxs) == len(saved)
        for i, (p, e, seqs, sh) in zip(idxs, saved):
            if self.pos[i] == -1 and p != -1:
                self.used.add(i)
            if self.pos[i] != -1 and p == -1:
                self.used.discard(i)
            if self.pos[i] != -1:
                self._seq_pos_rm(i)
            self.pos[i] = p
            self.ext[i] = e
            self.seq[i] = set(seqs)
            self.shift[i] = sh
            if self.pos[i] != -1:
                self._seq_pos_add(i)

    # --- one cell -----------------------------------------------------------------------

    def rm(self, i: int) -> None:
        """Clear a non-empty cell."""
        assert self.pos[i] != -1
        self._seq_pos_rm(i)
        self.seq[i] = set()
        self.pos[i] = -1
        self.ext[i] = EXT_NONE
        self.shift[i] = 0
        self.used.discard(i)

    def seq_rm(self, i: int, seq_id: int) -> bool:
        """Remove seq_id from cell i (which must hold it); True if the cell became empty."""
        assert seq_id >= 0 and seq_id in self.seq[i] and self.pos[i] != -1
        self.seq[i].discard(seq_id)
        self._seq_pos_dec(seq_id, self.pos[i])
        if not self.seq[i]:
            self.pos[i] = -1
            self.ext[i] = EXT_NONE
            self.shift[i] = 0
            self.used.discard(i)
            return True
        return False

    def seq_keep(self, i: int, seq_id: int) -> bool:
        """Keep only seq_id in cell i; True if the cell became empty (it did not hold seq_id)."""
        if seq_id in self.seq[i]:
            self._seq_pos_rm(i)
            self.seq[i] = {seq_id}
            self._seq_pos_inc(seq_id, self.pos[i])
            return False
        if self.seq[i]:
            self._seq_pos_rm(i)
            self.seq[i] = set()
            self.pos[i] = -1
            self.ext[i] = EXT_NONE
            self.shift[i] = 0
            self.used.discard(i)
            return True
        assert self.pos[i] == -1
        return False

    def seq_count(self, i: int) -> int:
        assert self.pos[i] != -1
        return len(self.seq[i])

    def seq_has(self, i: int, seq_id: int) -> bool:
        assert seq_id >= 0
        return seq_id in self.seq[i]

    def seq_add(self, i: int, seq_id: int) -> None:
        """Add seq_id to the non-empty cell i (which must not hold it yet)."""
        assert self.pos[i] != -1 and seq_id not in self.seq[i]
        self.seq[i].add(seq_id)
        self._seq_pos_inc(seq_id, self.pos[i])

    def seq_get(self, i: int) -> int:
        """The only sequence of cell i (call only for cells with exactly one)."""
        assert len(self.seq[i]) == 1
        return min(self.seq[i])

    def seq_pos_min(self, seq_id: int) -> int:
        """Smallest position of seq_id in this stream, -1 if absent."""
        assert 0 <= seq_id < LLAMA_MAX_SEQ
        c = self.seq_pos[seq_id]
        return min(c) if c else -1

    def seq_pos_max(self, seq_id: int) -> int:
        """Largest position of seq_id in this stream, -1 if absent."""
        assert 0 <= seq_id < LLAMA_MAX_SEQ
        c = self.seq_pos[seq_id]
        return max(c) if c else -1

    def pos_get(self, i: int) -> int:
        assert self.pos[i] != -1
        return self.pos[i]

    def ext_get(self, i: int) -> tuple[int, int, int]:
        assert self.pos[i] != -1
        return self.ext[i]

    def ext_set(self, i: int, ext: tuple[int, int, int]) -> None:
        self.ext[i] = tuple(ext)

    def get_shift(self, i: int) -> int:
        assert self.pos[i] != -1
        return self.shift[i]

    def pos_in(self, i: int, p0: int, p1: int) -> bool:
        """True if cell i is non-empty with position in [p0, p1) (p0 >= 0)."""
        return p0 <= self.pos[i] < p1

    def pos_set(self, i: int, p: int) -> None:
        """Set the position of the empty cell i (no sequence yet); has_shift untouched."""
        assert self.pos[i] == -1 and not self.seq[i]
        self.pos[i] = p
        self.used.add(i)

    def pos_add(self, i: int, d: int) -> bool:
        """pos += d, shift += d, has_shift; the cell is emptied if pos < 0 (returns True then)."""
        assert self.pos[i] != -1
        self._seq_pos_rm(i)
        self.pos[i] += d
        self.shift[i] += d
        self._has_shift = True
        if self.pos[i] < 0:
            self.seq[i] = set()
            self.pos[i] = -1
            self.ext[i] = EXT_NONE  # (f)
            self.shift[i] = 0
            self.used.discard(i)
            return True
        self._seq_pos_add(i)
        return False

    def pos_div(self, i: int, d: int) -> None:
        """pos //= d (d > 0), shift += new - old (llamax decision (a)), has_shift."""
        assert self.pos[i] != -1 and d > 0
        p_old = self.pos[i]
        self._seq_pos_rm(i)
        self.pos[i] = p_old // d
        self.shift[i] += self.pos[i] - p_old
        self._seq_pos_add(i)
        self._has_shift = True

    # --- seq_pos multiset helpers -------------------------------------------------------

    def _seq_pos_dec(self, s: int, p: int) -> None:
        c = self.seq_pos[s]
        assert c[p] > 0
        c[p] -= 1
        if c[p] == 0:
            del c[p]

    def _seq_pos_inc(self, s: int, p: int) -> None:
        self.seq_pos[s][p] += 1

    def _seq_pos_rm(self, i: int) -> None:
        for s in self.seq[i]:
            self._seq_pos_dec(s, self.pos[i])

    def _seq_pos_add(self, i: int) -> None:
        for s in self.seq[i]:
            self._seq_pos_inc(s, self.pos[i])

    # --- tests --------------------------------------------------------------------------

    def cells(self) -> list[tuple[int, frozenset[int]]]:
        """(pos, seq ids) of every cell in cell order; (-1, frozenset()) when empty."""
        return [(p, frozenset(s)) for p, s in zip(self.pos, self.seq)]

    def snapshot(self) -> tuple:
        """Everything, for equality checks."""
        return (
            tuple(self.pos), tuple(self.shift), tuple(self.ext),
            tuple(frozenset(s) for s in self.seq),
            tuple(sorted(self.used)), self._has_shift,
            tuple(tuple(sorted(c.items())) for c in self.seq_pos),
        )

    def check(self) -> None:
        """Assert the invariants listed in the class docstring."""
        expect = [Counter() for _ in range(LLAMA_MAX_SEQ)]
        for i in range(self.size()):
            p = self.pos[i]
            assert p == -1 or p >= 0, (i, p)
            assert (i in self.used) == (p != -1), i
            if p == -1:
                assert not self.seq[i] and self.shift[i] == 0 and self.ext[i] == EXT_NONE, i
            for s in self.seq[i]:
                expect[s][p] += 1
        assert expect == self.seq_pos


# ---------------------------------------------------------------------------------------
# ubatches and slot infos
# ---------------------------------------------------------------------------------------


@dataclass
class RefUBatch:
    """A micro-batch as the cache sees it (llama_ubatch, metadata only).

    Attributes:
        pos: [n_tokens] position of each token.
        seq_ids: [n_tokens] every sequence of each token (distinct, at least one).
        n_seqs: number of sequence sets (llama's n_seqs); 0 means n_tokens (split_simple).
            For caches with several streams the tokens are grouped by sequence:
            n_tokens = n_seqs_unq * n_seq_tokens and tokens
            [s*n_seq_tokens, (s+1)*n_seq_tokens) belong to seq_id_unq[s] alone.
        tokens: optional [n_tokens] token ids, stored in the cells' ext.tok.
        xy: optional [n_tokens] (x, y) 2-D positions (M-RoPE), stored in ext.x/ext.y.
        seq_id_unq: sorted distinct sequence ids (derived).
    """

    pos: list[int]
    seq_ids: list[list[int]]
    n_seqs: int = 0
    equal_seqs: bool = False
    tokens: list[int] | None = None
    xy: list[tuple[int, int]] | None = None
    seq_id_unq: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.pos = [int(p) for p in self.pos]
        self.seq_ids = [_as_seq_list(s) for s in self.seq_ids]
        n = len(self.pos)
        if n == 0 or len(self.seq_ids) != n:
            raise ValueError(f"ubatch needs n_tokens > 0 and one seq list per token ({n}, {len(self.seq_ids)})")
        for i, ss in enumerate(self.seq_ids):
            if not ss or len(set(ss)) != len(ss):
                raise ValueError(f"token {i}: seq ids {ss} must be non-empty and distinct")
        for name in ("tokens", "xy"):
            v = getattr(self, name)
            if v is not None and len(v) != n:
                raise ValueError(f"{name} has {len(v)} entries, expected {n}")
        if self.n_seqs == 0:
            self.n_seqs = n
        if n % self.n_seqs:
            raise ValueError(f"n_tokens {n} is not a multiple of n_seqs {self.n_seqs}")
        self.seq_id_unq = sorted({s for ss in self.seq_ids for s in ss})

    @property
    def n_tokens(self) -> int:
        return len(self.pos)

    @property
    def n_seq_tokens(self) -> int:
        return self.n_tokens // self.n_seqs

    @property
    def n_seqs_unq(self) -> int:
        return len(self.seq_id_unq)


@dataclass
class RefSlotInfo:
    """Where a ubatch goes (llama_kv_cache::slot_info).

    Attributes:
        s0, s1: smallest / largest stream touched (inclusive).
        strm: [n_parts] the stream of each part (one part per sequence when n_stream > 1).
        idxs: [n_parts][n_tokens per part] cell index of each token, in token order.
    """

    s0: int
    s1: int
    strm: list[int]
    idxs: list[list[int]]

    def n_stream(self) -> int:
        return len(self.strm)

    def size(self) -> int:
        return len(self.idxs[0])

    def head(self) -> int:
        assert len(self.idxs) == 1 and self.idxs[0]
        return self.idxs[0][0]

    def is_contiguous(self) -> bool:
        """llama.cpp's slot_info::is_contiguous: one part whose idxs are h, h+1, h+2, ...

        Note: llama.cpp returns False whenever there is more than one part
        (multi-stream ubatch), whatever the indices; see :meth:`parts_contiguous`.
        """
        if not self.idxs or not self.idxs[0]:
            return True
        if len(self.idxs) > 1:
            return False
        return _consecutive(self.idxs[0])

    def parts_contiguous(self) -> bool:
        """True if each part's idxs are consecutive (not a llama.cpp method)."""
        return all(_consecutive(p) for p in self.idxs)


def _consecutive(idxs: Sequence[int]) -> bool:
    return all(idxs[k] == idxs[0] + k for k in range(len(idxs)))


def _as_seq_list(s: int | Iterable[int]) -> list[int]:
    if isinstance(s, int):
        return [s]
    return [int(x) for x in s]


# ---------------------------------------------------------------------------------------
# batch splitting (llama_batch_allocr)
# ---------------------------------------------------------------------------------------


def _norm_batch(positions: Sequence[int], seq_ids, tokens):
    n = len(positions)
    if isinstance(seq_ids, int) or seq_ids is None:
        seq_ids = [0 if seq_ids is None else seq_ids] * n
    seq_ids = [_as_seq_list(s) for s in seq_ids]
    if len(seq_ids) != n:
        raise ValueError(f"{len(seq_ids)} seq id entries for {n} tokens")
    if tokens is not None and len(tokens) != n:
        raise ValueError(f"{len(tokens)} tokens for {n} positions")
    return [int(p) for p in positions], seq_ids, tokens


def _ubatch_add(positions, seq_ids, tokens, idxs, n_seqs, equal_seqs) -> RefUBatch:
    return RefUBatch(
        pos=[positions[i] for i in idxs],
        seq_ids=[list(seq_ids[i]) for i in idxs],
        n_seqs=n_seqs,
        equal_seqs=equal_seqs,
        tokens=None if tokens is None else [tokens[i] for i in idxs],
    )


def split_simple(positions: Sequence[int], seq_ids, n_ubatch: int, tokens=None) -> list[RefUBatch]:
    """llama_batch_allocr::split_simple repeated: consecutive chunks of n_ubatch tokens.

    Args:
        positions: [n_tokens] positions.
        seq_ids: [n_tokens] an int or a list of ints per token (or one int for all).
        n_ubatch: tokens per ubatch (> 0).
        tokens: optional [n_tokens] token ids.
    """
    if n_ubatch <= 0:
        raise ValueError(f"n_ubatch must be > 0, got {n_ubatch}")
    positions, seq_ids, tokens = _norm_batch(positions, seq_ids, tokens)
    out = []
    for b in range(0, len(positions), n_ubatch):
        idxs = list(range(b, min(b + n_ubatch, len(positions))))
        out.append(_ubatch_add(positions, seq_ids, tokens, idxs, len(idxs), False))
    return out


def split_equal(positions: Sequence[int], seq_ids, n_ubatch: int, tokens=None,
                sequential: bool = True) -> list[RefUBatch]:
    """llama_batch_allocr::split_equal(n_ubatch, sequential) repeated.

    Each ubatch takes non-overlapping sequence sets (in order of first appearance among
    the unused tokens; with sequential, single sequences with consecutive ids), the same
    number of tokens from each, at most n_ubatch in all (llama.cpp's rule, including its
    quirk of exceeding n_ubatch when there are more sequence sets than n_ubatch). Tokens
    are grouped by sequence set in the ubatch. sequential=True is what caches with
    several streams use.

    Raises:
        ValueError: sequential and a token belongs to several sequences (coupled
            sequences; llama.cpp refuses a sequential split then).
    """
    if n_ubatch <= 0:
        raise ValueError(f"n_ubatch must be > 0, got {n_ubatch}")
    positions, seq_ids, tokens = _norm_batch(positions, seq_ids, tokens)
    n = len(positions)
    if sequential and any(len(s) > 1 for s in seq_ids):
        raise ValueError("sequential split is not supported with coupled sequences (a token with several seq ids)")
    seq_set = [frozenset(s) for s in seq_ids]
    set_map: dict[frozenset, list[int]] = {}
    for i in range(n):
        set_map.setdefault(seq_set[i], []).append(i)
    used = [False] * n
    out = []
    while True:
        cur: list[frozenset] = []
        last = -1
        for i in range(n):
            if used[i]:
                continue
            add = all(not (c & seq_set[i]) for c in cur)
            if sequential:
                add = add and (not cur or seq_ids[i][0] == last + 1)
            if add:
                cur.append(seq_set[i])
                last = seq_ids[i][0]
                if len(cur) > n_ubatch:
                    break
        if not cur:
            break
        cur_idx = [0] * len(cur)
        for s in range(len(cur)):
            while used[set_map[cur[s]][cur_idx[s]]]:
                cur_idx[s] += 1
        per_seq: list[list[int]] = [[] for _ in cur]
        while True:
            if any(cur_idx[s] >= len(set_map[cur[s]]) for s in range(len(cur))):
                break
            for s in range(len(cur)):
                idx = set_map[cur[s]][cur_idx[s]]
                per_seq[s].append(idx)
                used[idx] = True
                cur_idx[s] += 1
            if (len(per_seq[0]) + 1) * len(cur) > n_ubatch:
                break
        idxs = [i for part in per_seq for i in part]
        out.append(_ubatch_add(positions, seq_ids, tokens, idxs, len(cur), True))
    return out


# ---------------------------------------------------------------------------------------
# llama_kv_cache (metadata side)
# ---------------------------------------------------------------------------------------


class RefKVCells:
    """The cell bookkeeping of llama_kv_cache: one RefCells and one head per stream.

    Args:
        kv_size: cells per stream (> 0).
        n_seq_max: sequences, 1..256.
        unified: one stream shared by every sequence; else one stream per sequence.
        n_swa: sliding window (> 0 when swa_type is not "none").
        swa_type: "none", "standard", "chunked" or "symmetric".
    """

    def __init__(self, kv_size: int, n_seq_max: int = 1, unified: bool = True,
                 n_swa: int = 0, swa_type: str = "none") -> None:
        if kv_size <= 0:
            raise ValueError(f"kv_size must be > 0, got {kv_size}")
        if not 1 <= n_seq_max <= LLAMA_MAX_SEQ:
            raise ValueError(f"n_seq_max must be in [1, {LLAMA_MAX_SEQ}], got {n_seq_max}")
        if swa_type not in SWA_TYPES:
            raise ValueError(f"swa_type must be one of {SWA_TYPES}, got {swa_type!r}")
        if swa_type != "none" and n_swa <= 0:
            raise ValueError(f"n_swa must be > 0 for swa_type {swa_type!r}, got {n_swa}")
        self.kv_size = kv_size
        self.n_seq_max = n_seq_max
        self.unified = unified
        self.n_swa = n_swa
        self.swa_type = swa_type
        self.n_stream = 1 if unified else n_seq_max
        self.seq_to_stream = [0 if unified else s for s in range(n_seq_max)]
        self.v_cells = [RefCells(kv_size) for _ in range(self.n_stream)]
        self.heads = [0] * self.n_stream
        self.pending_copies: list[tuple[int, int]] = []

    # --- queries ------------------------------------------------------------------------

    def get_size(self) -> int:
        return self.kv_size

    def get_has_shift(self) -> bool:
        return any(c.get_has_shift() for c in self.v_cells)

    def n_used(self) -> int:
        return sum(c.get_used() for c in self.v_cells)

    def cells(self, stream: int = 0) -> list[tuple[int, frozenset[int]]]:
        """(pos, seq ids) of every cell of the stream, in cell order; (-1, frozenset()) if empty."""
        return self.v_cells[stream].cells()

    def seq_pos_min(self, seq_id: int) -> int:
        self._check_seq(seq_id)
        return self.v_cells[self.seq_to_stream[seq_id]].seq_pos_min(seq_id)

    def seq_pos_max(self, seq_id: int) -> int:
        self._check_seq(seq_id)
        return self.v_cells[self.seq_to_stream[seq_id]].seq_pos_max(seq_id)

    def is_masked_swa(self, p0: int, p1: int) -> bool:
        return is_masked_swa(self.n_swa, self.swa_type, p0, p1)

    def snapshot(self) -> tuple:
        return (tuple(c.snapshot() for c in self.v_cells), tuple(self.heads), tuple(self.pending_copies))

    def check(self) -> None:
        for c in self.v_cells:
            c.check()
        for st, c in enumerate(self.v_cells):
            for i in c.used:
                for s in c.seq[i]:
                    assert 0 <= s < self.n_seq_max and self.seq_to_stream[s] == st, (st, i, s)

    def _check_seq(self, seq_id: int, allow_all: bool = False) -> None:
        if allow_all and seq_id == -1:
            return
        if not 0 <= seq_id < self.n_seq_max:
            raise ValueError(f"seq_id {seq_id} outside [0, {self.n_seq_max})")

    # --- sequence operations ------------------------------------------------------------

    def clear(self) -> None:
        """Empty every stream and reset the heads (pending copies are kept, as in llama.cpp)."""
        for s in range(self.n_stream):
            self.v_cells[s].reset()
            self.heads[s] = 0

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        """Remove seq_id (-1: every sequence) from the cells with position in [p0, p1). Always True."""
        self._check_seq(seq_id, allow_all=True)
        if p0 < 0:
            p0 = 0
        if p1 < 0:
            p1 = POS_MAX
        streams = [self.seq_to_stream[seq_id]] if seq_id >= 0 else list(range(self.n_stream))
        for st in streams:
            cells = self.v_cells[st]
            new_head = cells.size()
            for i in range(cells.size()):
                if not cells.pos_in(i, p0, p1):
                    continue
                if seq_id >= 0:
                    freed = cells.seq_has(i, seq_id) and cells.seq_rm(i, seq_id)
                else:
                    cells.rm(i)
                    freed = True
                if freed and new_head == cells.size():
                    new_head = i
            # if we freed up a slot, set head to it so searching can start there
            if new_head != cells.size() and new_head < self.heads[st]:
                self.heads[st] = new_head
        return True

    def seq_cp(self, seq_id_src: int, seq_id_dst: int, p0: int = -1, p1: int = -1) -> None:
        """Make dst share src's cells in [p0, p1) (one stream), or copy src's stream (decision (c))."""
        self._check_seq(seq_id_src)
        self._check_seq(seq_id_dst)
        s0 = self.seq_to_stream[seq_id_src]
        s1 = self.seq_to_stream[seq_id_dst]
        if s0 == s1:
            cells = self.v_cells[s0]
            if seq_id_src == seq_id_dst:
                return
            if p0 < 0:
                p0 = 0
            if p1 < 0:
                p1 = POS_MAX
            for i in range(cells.size()):
                if not cells.pos_in(i, p0, p1):
                    continue
                # (b): llama.cpp asserts the cell lacks dst; we skip cells that have it
                if cells.seq_has(i, seq_id_src) and not cells.seq_has(i, seq_id_dst):
                    cells.seq_add(i, seq_id_dst)
            return

        # cross-stream: llama.cpp's is_full test (on the unclamped p0/p1)
        size = self.get_size()
        is_full = True
        if p0 > 0 and p0 + 1 < size:
            is_full = False
        if p1 > 0 and p1 + 1 < size:
            is_full = False
        if not is_full:
            raise ValueError(
                f"seq_cp across streams ({seq_id_src} -> {seq_id_dst}) supports only the full range, "
                f"got p0={p0}, p1={p1} with {size} cells")

        self.pending_copies.append((s0, s1))
        src, dst = self.v_cells[s0], self.v_cells[s1]
        dst.reset()
        for i in range(src.size()):
            if not src.seq_has(i, seq_id_src):
                continue
            pos = src.pos_get(i)
            shift = src.get_shift(i)
            ext = src.ext_get(i)
            if shift != 0:
                pos -= shift
                assert pos >= 0
            dst.pos_set(i, pos)
            dst.seq_add(i, seq_id_dst)
            if shift != 0:
                dst.pos_add(i, shift)
            dst.ext_set(i, ext)
        self.heads[s1] = self.heads[s0]

    def seq_keep(self, seq_id: int) -> None:
        """Drop every sequence but seq_id from its stream."""
        self._check_seq(seq_id)
        st = self.seq_to_stream[seq_id]
        cells = self.v_cells[st]
        new_head = cells.size()
        for i in range(cells.size()):
            if cells.seq_keep(i, seq_id) and new_head == cells.size():
                new_head = i
        if new_head != cells.size() and new_head < self.heads[st]:
            self.heads[st] = new_head

    def seq_add(self, seq_id: int, p0: int, p1: int, shift: int) -> None:
        """Add shift to the positions of seq_id's cells in [p0, p1) (shared cells move for everyone)."""
        self._check_seq(seq_id)
        st = self.seq_to_stream[seq_id]
        cells = self.v_cells[st]
        if shift == 0:
            return
        new_head = cells.size()
        if p0 < 0:
            p0 = 0
        if p1 < 0:
            p1 = POS_MAX
        if p0 == p1:
            return
        for i in range(cells.size()):
            if not cells.pos_in(i, p0, p1):
                continue
            if cells.seq_has(i, seq_id) and cells.pos_add(i, shift) and new_head == cells.size():
                new_head = i
        # if we freed up a slot, set head to it; otherwise start the next search from 0
        self.heads[st] = new_head if new_head != cells.size() else 0

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        """Integer-divide by d > 0 the positions of seq_id's cells in [p0, p1)."""
        self._check_seq(seq_id)
        if d <= 0:
            raise ValueError(f"seq_div: d must be > 0, got {d}")
        cells = self.v_cells[self.seq_to_stream[seq_id]]
        if d == 1:
            return
        if p0 < 0:
            p0 = 0
        if p1 < 0:
            p1 = POS_MAX
        if p0 == p1:
            return
        for i in range(cells.size()):
            if not cells.pos_in(i, p0, p1):
                continue
            if cells.seq_has(i, seq_id):
                cells.pos_div(i, d)

    # --- batch placement ----------------------------------------------------------------

    def find_slot(self, ubatch: RefUBatch, cont: bool = False) -> RefSlotInfo | None:
        """Find cells for the ubatch without changing anything (llama_kv_cache::find_slot).

        A cell is usable if it is empty, or held by exactly one sequence and SWA-masked
        for it (is_masked_swa(cell pos, seq_pos_max(seq) + 1)). The scan starts at the
        stream's head (or at 0 if head > used + 2*n_tokens), wraps around the ring and
        gives up once every cell was tested. cont: the cells must be consecutive.

        Returns:
            The slot, or None if the ubatch does not fit.
        """
        for ss in ubatch.seq_ids:
            for s in ss:
                self._check_seq(s)
        n_tokens = ubatch.n_tokens
        n_seqs = 1
        if self.n_stream > 1:
            if n_tokens % ubatch.n_seqs_unq != 0:
                raise ValueError(f"n_tokens {n_tokens} is not a multiple of n_seqs_unq {ubatch.n_seqs_unq}")
            n_seqs = ubatch.n_seqs_unq
            n_tokens //= n_seqs

        res = RefSlotInfo(s0=LLAMA_MAX_SEQ, s1=0, strm=[0] * n_seqs, idxs=[[] for _ in range(n_seqs)])
        for s in range(n_seqs):
            seq_id = ubatch.seq_id_unq[s]
            if self.n_stream > 1:
                first = ubatch.seq_ids[s * n_tokens]
                if first != [seq_id] or any(ubatch.seq_ids[s * n_tokens + k] != [seq_id] for k in range(n_tokens)):
                    raise ValueError(f"ubatch tokens [{s * n_tokens}, {(s + 1) * n_tokens}) must all be of "
                                     f"sequence {seq_id} alone in a cache with {self.n_stream} streams")
            st = self.seq_to_stream[seq_id]
            res.s0 = min(res.s0, st)
            res.s1 = max(res.s1, st)
            res.strm[s] = st
            cells = self.v_cells[st]
            idxs = res.idxs[s]

            head_cur = self.heads[st]
            # enough unused cells before the head -> search from the beginning, hoping to fill it
            if head_cur > cells.get_used() + 2 * n_tokens:
                head_cur = 0
            if n_tokens > cells.size():
                return None

            n_tested = 0
            n_test = n_tokens if cont else 1
            pos_max_cache: dict[int, int] = {}  # seq_pos_max is constant during the scan
            while True:
                if head_cur + n_test > cells.size():
                    n_tested += cells.size() - head_cur
                    head_cur = 0
                    continue
                for _ in range(n_test):
                    idx = head_cur
                    head_cur += 1
                    n_tested += 1
                    can_use = cells.is_empty(idx)
                    if not can_use and cells.seq_count(idx) == 1:
                        seq_cell = cells.seq_get(idx)
                        if seq_cell not in pos_max_cache:
                            pos_max_cache[seq_cell] = cells.seq_pos_max(seq_cell)
                        if self.is_masked_swa(cells.pos_get(idx), pos_max_cache[seq_cell] + 1):
                            can_use = True
                    if can_use:
                        idxs.append(idx)
                    elif cont:
                        break
                if len(idxs) == n_tokens:
                    break
                if cont:
                    idxs.clear()
                if n_tested >= cells.size():
                    return None
            if len(idxs) < n_tokens:
                return None
        assert res.s1 >= res.s0
        return res

    def apply_ubatch(self, sinfo: RefSlotInfo, ubatch: RefUBatch) -> None:
        """Write the ubatch into the slot's cells (llama_kv_cache::apply_ubatch).

        An overwritten (SWA-reused) cell first loses its old position; every sequence that
        lost positions is then purged over [seq_pos_min, max overwritten pos] so that its
        positions stay one contiguous range. Each stream's head moves after its last cell.
        """
        seq_pos_max_rm: dict[int, int] = {}
        assert ubatch.n_tokens == sinfo.n_stream() * sinfo.size()
        for s in range(sinfo.n_stream()):
            cells = self.v_cells[sinfo.strm[s]]
            for ii in range(sinfo.size()):
                i = s * sinfo.size() + ii
                idx = sinfo.idxs[s][ii]
                if not cells.is_empty(idx):
                    assert cells.seq_count(idx) == 1
                    seq_id = cells.seq_get(idx)
                    seq_pos_max_rm[seq_id] = max(seq_pos_max_rm.get(seq_id, -1), cells.pos_get(idx))
                    cells.rm(idx)
                cells.pos_set(idx, ubatch.pos[i])
                if ubatch.xy is not None or ubatch.tokens is not None:
                    x, y = ubatch.xy[i] if ubatch.xy is not None else (0, 0)
                    tok = ubatch.tokens[i] if ubatch.tokens is not None else TOKEN_NULL
                    cells.ext_set(idx, (x, y, tok))
                for seq_id in ubatch.seq_ids[i]:
                    cells.seq_add(idx, seq_id)

        # keep every sequence contiguous: purge the positions below those overwritten
        for seq_id in sorted(seq_pos_max_rm):
            cells = self.v_cells[self.seq_to_stream[seq_id]]
            if cells.seq_pos_min(seq_id) <= seq_pos_max_rm[seq_id]:
                self.seq_rm(seq_id, cells.seq_pos_min(seq_id), seq_pos_max_rm[seq_id] + 1)

        for s in range(sinfo.n_stream()):
            self.heads[sinfo.strm[s]] = sinfo.idxs[s][-1] + 1

    def prepare(self, ubatches: Sequence[RefUBatch]) -> list[RefSlotInfo] | None:
        """Find a slot for each ubatch in turn (applying each, so later ones see earlier ones),
        then restore every cell and head (decision (e)). None if some ubatch does not fit.
        """
        saved_cells = [c.cp(range(c.size())) for c in self.v_cells]
        saved_heads = list(self.heads)
        res: list[RefSlotInfo] = []
        success = True
        for ub in ubatches:
            sinfo = self.find_slot(ub, False)
            if sinfo is None:
                success = False
                break
            res.append(sinfo)
            self.apply_ubatch(sinfo, ub)
        for c, saved in zip(self.v_cells, saved_cells):
            c.set(range(c.size()), saved)
        self.heads[:] = saved_heads
        return res if success else None

    def split(self, positions: Sequence[int], seq_ids, n_ubatch: int, tokens=None) -> list[RefUBatch]:
        """llama_kv_cache::init_batch's split: split_simple for one stream, else split_equal."""
        if self.n_stream == 1:
            return split_simple(positions, seq_ids, n_ubatch, tokens)
        return split_equal(positions, seq_ids, n_ubatch, tokens)

    def init_batch(self, positions: Sequence[int], seq_ids, n_ubatch: int,
                   tokens=None) -> list[tuple[RefUBatch, RefSlotInfo]] | None:
        """Split and prepare (llama_kv_cache::init_batch); None on FAILED_PREPARE. Cells unchanged."""
        ubatches = self.split(positions, seq_ids, n_ubatch, tokens)
        sinfos = self.prepare(ubatches)
        if sinfos is None:
            return None
        return list(zip(ubatches, sinfos))

    def update(self) -> tuple[bool, list[tuple[int, int]]]:
        """The memory update before a batch: hand over the pending stream copies and, if
        any cell was shifted, apply the K-shift (reset every shift).

        Returns:
            (did_shift, copies): whether a K-shift was due and the (src, dst) stream copies.
        """
        copies = self.pending_copies
        self.pending_copies = []
        do_shift = self.get_has_shift()
        if do_shift:
            for c in self.v_cells:
                c.reset_shift()
        return do_shift, copies


# ---------------------------------------------------------------------------------------
# llama_kv_cache_iswa: base cache + SWA cache
# ---------------------------------------------------------------------------------------


class RefISWACells:
    """Two RefKVCells as llama_kv_cache_iswa: ``base`` (no SWA) and ``swa``.

    size_swa = pad256(min(kv_size, n_swa * (n_seq_max if unified else 1) + n_ubatch)),
    or kv_size when swa_full. Every seq_* goes to both; a batch must fit in both.

    Args:
        seq_pos_from: which cache answers seq_pos_min/max. "swa" is what llama.cpp
            0c1e57098 (the reference outputs) does; newer llama.cpp answers from "base".
    """

    def __init__(self, kv_size: int, n_seq_max: int = 1, unified: bool = True, *,
                 n_swa: int, swa_type: str = "standard", swa_full: bool = False,
                 n_ubatch: int = 512, seq_pos_from: str = "swa") -> None:
        if seq_pos_from not in ("swa", "base"):
            raise ValueError(f"seq_pos_from must be 'swa' or 'base', got {seq_pos_from!r}")
        size_swa = kv_size if swa_full else pad(min(kv_size, n_swa * (n_seq_max if unified else 1) + n_ubatch), 256)
        self.unified = unified
        self.seq_pos_from = seq_pos_from
        self.base = RefKVCells(kv_size, n_seq_max, unified, 0, "none")
        self.swa = RefKVCells(size_swa, n_seq_max, unified, n_swa, swa_type)

    @property
    def can_shift(self) -> bool:
        return self.base.get_size() == self.swa.get_size()

    def _pos_cache(self) -> RefKVCells:
        return self.swa if self.seq_pos_from == "swa" else self.base

    def clear(self) -> None:
        self.base.clear()
        self.swa.clear()

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        r = self.base.seq_rm(seq_id, p0, p1)
        return self.swa.seq_rm(seq_id, p0, p1) and r

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        self.base.seq_cp(src, dst, p0, p1)
        self.swa.seq_cp(src, dst, p0, p1)

    def seq_keep(self, seq_id: int) -> None:
        self.base.seq_keep(seq_id)
        self.swa.seq_keep(seq_id)

    def seq_add(self, seq_id: int, p0: int, p1: int, shift: int) -> None:
        self.base.seq_add(seq_id, p0, p1, shift)
        self.swa.seq_add(seq_id, p0, p1, shift)

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        self.base.seq_div(seq_id, p0, p1, d)
        self.swa.seq_div(seq_id, p0, p1, d)

    def seq_pos_min(self, seq_id: int) -> int:
        return self._pos_cache().seq_pos_min(seq_id)

    def seq_pos_max(self, seq_id: int) -> int:
        return self._pos_cache().seq_pos_max(seq_id)

    def init_batch(self, positions: Sequence[int], seq_ids, n_ubatch: int, tokens=None):
        """llama_kv_cache_iswa::init_batch: split_simple first (unified only), then split_equal
        (sequential when not unified); each split must prepare in both caches.

        Returns:
            [(ubatch, (sinfo_base, sinfo_swa))] or None.
        """
        attempts = []
        if self.unified:
            attempts.append(lambda: split_simple(positions, seq_ids, n_ubatch, tokens))
        attempts.append(lambda: split_equal(positions, seq_ids, n_ubatch, tokens, sequential=not self.unified))
        for make in attempts:
            try:
                ubatches = make()
            except ValueError:  # no suitable split (coupled sequences in a sequential split)
                continue
            sb = self.base.prepare(ubatches)
            if sb is None:
                continue
            sw = self.swa.prepare(ubatches)
            if sw is None:
                continue
            return list(zip(ubatches, zip(sb, sw)))
        return None

    def apply_ubatch(self, sinfos: tuple[RefSlotInfo, RefSlotInfo], ubatch: RefUBatch) -> None:
        self.base.apply_ubatch(sinfos[0], ubatch)
        self.swa.apply_ubatch(sinfos[1], ubatch)

    def update(self) -> tuple[bool, list[tuple[int, int]]]:
        a, ca = self.base.update()
        b, cb = self.swa.update()
        return a or b, ca + cb


def decode(mem, positions: Sequence[int], seq_ids, n_ubatch: int, tokens=None):
    """What llama_decode does to the cells: update(), split + prepare, then apply each ubatch.

    Args:
        mem: a RefKVCells or RefISWACells.

    Returns:
        The slot infos (one per ubatch), or None if the batch does not fit (cells unchanged
        apart from update()'s shift reset).
    """
    mem.update()
    plan = mem.init_batch(positions, seq_ids, n_ubatch, tokens)
    if plan is None:
        return None
    for ub, sinfo in plan:
        mem.apply_ubatch(sinfo, ub)
    return [sinfo for _, sinfo in plan]
