# cython: language_level=3
"""Thin wrappers over csrc/kv_cells.h and csrc/slot_finder.h.

`Cells` owns one cell table (one stream). `KVCells` owns the tables of every stream of one KV
cache with their heads and the sequence -> stream map: the metadata half of llama_kv_cache
(find_slot, apply_ubatch, prepare and the seq_* operations). Arguments are validated here with
the GIL held; the C calls run without it.
"""
from libc.stdint cimport int32_t, uint32_t, uint64_t
from libc.stdlib cimport malloc, free
from libc.string cimport memset

import numpy as np
cimport numpy as cnp

from llamax._native.kv_cells cimport *
from llamax._native.slot_finder cimport *

cnp.import_array()

MAX_SEQ = LX_MAX_SEQ

# the layout of lx_cell_state, for snapshots
CELL_STATE_DTYPE = np.dtype([("pos", "<i4"), ("shift", "<i4"), ("x", "<i4"), ("y", "<i4"), ("tok", "<i4"), ("seq", "<u8", (4,))],
                            align=True)
assert CELL_STATE_DTYPE.itemsize == sizeof(lx_cell_state)

SWA_TYPES = {"none": LX_SWA_NONE, "standard": LX_SWA_STANDARD, "chunked": LX_SWA_CHUNKED,
             "symmetric": LX_SWA_SYMMETRIC}


cdef inline lx_pos _clamp_pos(long long p):
    # positions beyond int32 saturate; negative ones mean "unbounded" for the range ops
    if p > 2147483647:
        return 2147483647
    if p < -1:
        return -1
    return <lx_pos> p


cdef object _view(object owner, void *data, cnp.npy_intp n, int typenum):
    """A read-only numpy view of C memory that keeps `owner` alive."""
    cdef cnp.npy_intp dims[1]
    dims[0] = n
    arr = cnp.PyArray_SimpleNewFromData(1, dims, typenum, data)
    cnp.PyArray_CLEARFLAGS(<cnp.ndarray> arr, cnp.NPY_ARRAY_WRITEABLE)
    cnp.Py_INCREF(owner)
    cnp.PyArray_SetBaseObject(<cnp.ndarray> arr, owner)
    return arr


cdef class Cells:
    """The cell table of one stream (llama_kv_cells). Owns one lx_cells handle."""
    cdef lx_cells *c

    def __cinit__(self, uint32_t n):
        self.c = lx_cells_new(n)
        if self.c == NULL:
            raise MemoryError(f"cannot allocate a cell table of {n} cells")

    def __dealloc__(self):
        if self.c != NULL:
            lx_cells_free(self.c)
            self.c = NULL

    @property
    def size(self) -> int:
        return lx_cells_size(self.c)

    @property
    def used(self) -> int:
        return lx_cells_get_used(self.c)

    @property
    def used_min(self) -> int:
        return lx_cells_used_min(self.c)

    @property
    def used_max_p1(self) -> int:
        return lx_cells_used_max_p1(self.c)

    @property
    def has_shift(self) -> bool:
        return lx_cells_get_has_shift(self.c)

    def reset(self) -> None:
        lx_cells_reset(self.c)

    def reset_shift(self) -> None:
        lx_cells_reset_shift(self.c)

    def pos_view(self):
        """int32 [size], -1 for empty cells (read-only view)."""
        return _view(self, <void *> lx_cells_pos_data(self.c), lx_cells_size(self.c), cnp.NPY_INT32)

    def shift_view(self):
        """int32 [size]: pending K-shift of each cell (read-only view)."""
        return _view(self, <void *> lx_cells_shift_data(self.c), lx_cells_size(self.c), cnp.NPY_INT32)

    def seq_view(self):
        """uint64 [size, 4]: the sequence set of each cell as a 256-bit set (read-only view)."""
        flat = _view(self, <void *> lx_cells_seq_data(self.c), 4 * <cnp.npy_intp> lx_cells_size(self.c),
                     cnp.NPY_UINT64)
        return flat.reshape(-1, 4)

    cdef inline void _check_cell(self, long long i) except *:
        if i < 0 or i >= lx_cells_size(self.c):
            raise IndexError(f"cell {i} outside [0, {lx_cells_size(self.c)})")

    def is_empty(self, long long i) -> bool:
        self._check_cell(i)
        return lx_cell_is_empty(self.c, <uint32_t> i)

    def pos_get(self, long long i) -> int:
        self._check_cell(i)
        return lx_cells_pos_data(self.c)[i]

    def ext_get(self, long long i) -> tuple:
        self._check_cell(i)
        cdef lx_cell_ext e = lx_cell_ext_get(self.c, <uint32_t> i)
        return (e.x, e.y, e.tok)

    def seq_count(self, long long i) -> int:
        self._check_cell(i)
        return lx_cell_seq_count(self.c, <uint32_t> i)

    def seq_has(self, long long i, int s) -> bool:
        self._check_cell(i)
        _check_seq(s)
        return lx_cell_seq_has(self.c, <uint32_t> i, s)

    def seq_pos_min(self, int s) -> int:
        _check_seq(s)
        return lx_cells_seq_pos_min(self.c, s)

    def seq_pos_max(self, int s) -> int:
        _check_seq(s)
        return lx_cells_seq_pos_max(self.c, s)

    def seq_n_cells(self, int s) -> int:
        _check_seq(s)
        return lx_cells_seq_n_cells(self.c, s)

    def cells(self) -> list:
        """(pos, frozenset of sequence ids) of every cell in cell order; (-1, frozenset()) when empty."""
        pos = self.pos_view()
        bits = self.seq_view()
        out = []
        empty = frozenset()
        for i in range(pos.shape[0]):
            if pos[i] < 0:
                out.append((-1, empty))
            else:
                out.append((int(pos[i]), _bits_to_set(bits[i])))
        return out

    def snapshot(self, idxs):
        """The saved states (CELL_STATE_DTYPE [n]) of cells idxs."""
        cdef uint32_t[::1] ix = self._idxs(idxs)
        out = np.zeros(ix.shape[0], dtype=CELL_STATE_DTYPE)
        cdef cnp.ndarray o = out
        with nogil:
            lx_cells_cp(self.c, &ix[0] if ix.shape[0] else NULL, <uint32_t> ix.shape[0], <lx_cell_state *> o.data)
        return out

    def restore(self, idxs, states) -> None:
        """Set cells idxs to saved states (from snapshot)."""
        cdef uint32_t[::1] ix = self._idxs(idxs)
        st = np.ascontiguousarray(states, dtype=CELL_STATE_DTYPE)
        if st.shape != (ix.shape[0],):
            raise ValueError(f"{st.shape[0]} states for {ix.shape[0]} cells")
        if np.any(st["pos"] < -1):
            raise ValueError("a saved cell position is below -1")
        cdef cnp.ndarray s = st
        cdef lx_status rc
        with nogil:
            rc = lx_cells_set(self.c, &ix[0] if ix.shape[0] else NULL, <uint32_t> ix.shape[0],
                              <const lx_cell_state *> s.data)
        if rc != LX_OK:
            raise MemoryError("cannot grow the position pool")

    cdef uint32_t[::1] _idxs(self, idxs):
        ix = np.ascontiguousarray(idxs, dtype=np.int64).reshape(-1)
        if ix.size and (ix.min() < 0 or ix.max() >= lx_cells_size(self.c)):
            raise IndexError(f"cell index outside [0, {lx_cells_size(self.c)})")
        if ix.size > 1 and not (np.diff(ix) > 0).all() and np.unique(ix).size != ix.size:  # sorted: no repeat
            raise ValueError("repeated cell index")
        return ix.astype(np.uint32)


cdef inline void _check_seq(long long s) except *:
    if s < 0 or s >= LX_MAX_SEQ:
        raise ValueError(f"seq_id {s} outside [0, {LX_MAX_SEQ})")


def _bits_to_set(bits) -> frozenset:
    out = []
    for k in range(4):
        w = int(bits[k])
        while w:
            low = w & -w
            out.append(k * 64 + low.bit_length() - 1)
            w ^= low
    return frozenset(out)


cdef class KVCells:
    """The cells, heads and sequence -> stream map of one KV cache (llama_kv_cache's metadata).

    Args:
        kv_size: cells per stream.
        n_stream: 1 for a unified cache, else n_seq_max (one stream per sequence).
        n_seq_max: number of sequences, at most 256.
        n_swa, swa_type: the sliding window; cells masked for their only sequence are reusable.
    """
    cdef lx_kv_meta meta
    cdef lx_cells **cptr
    cdef readonly list streams
    cdef readonly object heads            # uint32 [n_stream], the search head of each stream
    cdef readonly object seq_to_stream    # uint32 [256]
    cdef readonly int n_seq_max
    cdef uint32_t[::1] _heads
    cdef uint32_t[::1] _s2s

    def __cinit__(self, uint32_t kv_size, uint32_t n_stream=1, int n_seq_max=1, int n_swa=0, swa_type="none"):
        if n_stream < 1 or n_seq_max < 1 or n_seq_max > LX_MAX_SEQ:
            raise ValueError(f"n_stream {n_stream} / n_seq_max {n_seq_max} out of range")
        if n_stream != 1 and n_stream != n_seq_max:
            raise ValueError(f"n_stream must be 1 (unified) or n_seq_max ({n_seq_max}), not {n_stream}")
        if swa_type not in SWA_TYPES:
            raise ValueError(f"swa_type {swa_type!r} not in {sorted(SWA_TYPES)}")
        if SWA_TYPES[swa_type] != LX_SWA_NONE and n_swa <= 0:
            raise ValueError(f"swa_type {swa_type!r} needs n_swa > 0")
        self.n_seq_max = n_seq_max
        self.streams = [Cells(kv_size) for _ in range(n_stream)]
        self.cptr = <lx_cells **> malloc(n_stream * sizeof(lx_cells *))
        if self.cptr == NULL:
            raise MemoryError()
        for s in range(n_stream):
            self.cptr[s] = (<Cells> self.streams[s]).c
        self.heads = np.zeros(n_stream, dtype=np.uint32)
        s2s = np.zeros(LX_MAX_SEQ, dtype=np.uint32)
        if n_stream > 1:
            s2s[:n_seq_max] = np.arange(n_seq_max, dtype=np.uint32)
        self.seq_to_stream = s2s
        self._heads = self.heads
        self._s2s = self.seq_to_stream
        self.meta.cells = self.cptr
        self.meta.heads = &self._heads[0]
        self.meta.seq_to_stream = &self._s2s[0]
        self.meta.n_stream = n_stream
        self.meta.n_swa = n_swa
        self.meta.swa_type = SWA_TYPES[swa_type]

    def __dealloc__(self):
        if self.cptr != NULL:
            free(self.cptr)
            self.cptr = NULL

    @property
    def n_stream(self) -> int:
        return self.meta.n_stream

    @property
    def kv_size(self) -> int:
        return lx_cells_size(self.cptr[0])

    @property
    def n_swa(self) -> int:
        return self.meta.n_swa

    @property
    def swa_type(self) -> str:
        for k, v in SWA_TYPES.items():
            if v == self.meta.swa_type:
                return k

    cdef inline void _check(self, long long s) except *:
        if s < 0 or s >= self.n_seq_max:
            raise ValueError(f"seq_id {s} outside [0, n_seq_max={self.n_seq_max})")

    cdef inline lx_cells *_of(self, int s):
        return self.cptr[self._s2s[s]]

    def is_masked_swa(self, lx_pos p0, lx_pos p1) -> bool:
        """True if a query at p1 cannot see a key at p0 through the sliding window."""
        return lx_is_masked_swa(self.meta.n_swa, self.meta.swa_type, p0, p1)

    def masked_swa(self, p0, lx_pos p1):
        """is_masked_swa for every key position of p0 (an int array): bool array of p0's shape."""
        a = np.ascontiguousarray(p0, dtype=np.int32)
        out = np.empty(a.shape, dtype=np.bool_)
        cdef const lx_pos[::1] pv = a.reshape(-1)              # IN
        cdef cnp.uint8_t[::1] ov = out.reshape(-1).view(np.uint8)  # OUT
        cdef Py_ssize_t i, n = pv.shape[0]
        cdef int32_t n_swa = self.meta.n_swa
        cdef lx_swa_type t = self.meta.swa_type
        with nogil:
            for i in range(n):
                ov[i] = lx_is_masked_swa(n_swa, t, pv[i], p1)
        return out

    # ---- sequences -------------------------------------------------------------------------
    def seq_pos_min(self, int s) -> int:
        self._check(s)
        return lx_cells_seq_pos_min(self._of(s), s)

    def seq_pos_max(self, int s) -> int:
        self._check(s)
        return lx_cells_seq_pos_max(self._of(s), s)

    def seq_rm(self, int s, long long p0=-1, long long p1=-1) -> bool:
        """Remove s (every sequence when s == -1) from the cells with pos in [p0, p1)."""
        if s != -1:
            self._check(s)
        cdef lx_pos a = _clamp_pos(p0), b = _clamp_pos(p1)
        cdef uint32_t st
        if s >= 0:
            st = self._s2s[s]
            lx_cells_seq_rm(self.cptr[st], s, a, b, &self._heads[st])
        else:
            for st in range(self.meta.n_stream):
                lx_cells_seq_rm(self.cptr[st], -1, a, b, &self._heads[st])
        return True

    def seq_cp(self, int src, int dst, long long p0=-1, long long p1=-1):
        """Give dst the cells of src in [p0, p1). Returns (src_stream, dst_stream) when the rows must
        be copied across streams (only whole sequences can be), else None."""
        self._check(src)
        self._check(dst)
        cdef uint32_t s0 = self._s2s[src], s1 = self._s2s[dst]
        cdef lx_status rc
        if s0 == s1:
            rc = lx_cells_seq_cp(self.cptr[s0], src, dst, _clamp_pos(p0), _clamp_pos(p1))
            if rc != LX_OK:
                raise MemoryError("cannot grow the position pool")
            return None
        size = lx_cells_size(self.cptr[0])
        if (0 < p0 and p0 + 1 < size) or (0 < p1 and p1 + 1 < size):
            raise ValueError(f"seq_cp across streams copies whole sequences only, not [{p0}, {p1})")
        rc = lx_cells_seq_cp_stream(self.cptr[s1], self.cptr[s0], src, dst)
        if rc != LX_OK:
            raise MemoryError("cannot grow the position pool")
        self._heads[s1] = self._heads[s0]
        return (int(s0), int(s1))

    def seq_keep(self, int s) -> None:
        self._check(s)
        cdef uint32_t st = self._s2s[s]
        lx_cells_seq_keep(self.cptr[st], s, &self._heads[st])

    def seq_add(self, int s, long long p0, long long p1, long long shift) -> None:
        self._check(s)
        if shift > 2147483647 or shift < -2147483647:
            raise ValueError(f"shift {shift} outside int32")
        cdef uint32_t st = self._s2s[s]
        lx_cells_seq_add(self.cptr[st], s, _clamp_pos(p0), _clamp_pos(p1), <lx_pos> shift, &self._heads[st])

    def seq_div(self, int s, long long p0, long long p1, int d) -> None:
        self._check(s)
        if d <= 0:
            raise ValueError(f"seq_div by {d}: the divisor must be positive")
        lx_cells_seq_div(self._of(s), s, _clamp_pos(p0), _clamp_pos(p1), d)

    def clear(self) -> None:
        for st in range(self.meta.n_stream):
            lx_cells_reset(self.cptr[st])
            self._heads[st] = 0

    # ---- slots -----------------------------------------------------------------------------
    cdef int _view_of(self, object ub, lx_ubatch_view *v, list keep) except -1:
        pos = np.ascontiguousarray(ub.pos, dtype=np.int32)
        seq = np.ascontiguousarray(ub.seq_bits, dtype=np.uint64)
        unq = np.ascontiguousarray(ub.seq_id_unq, dtype=np.int32)
        tok = getattr(ub, "token", None)
        n = pos.shape[0]
        if n == 0:
            raise ValueError("empty ubatch")
        if seq.shape != (n, 4):
            raise ValueError(f"seq_bits shape {seq.shape} != ({n}, 4)")
        if unq.shape[0] == 0 or unq.min() < 0 or unq.max() >= self.n_seq_max:
            raise ValueError("seq_id_unq empty or outside [0, n_seq_max)")
        if self.meta.n_stream > 1 and n % unq.shape[0] != 0:
            raise ValueError(f"{n} tokens do not split evenly over {unq.shape[0]} sequences")
        if pos.min() < 0:
            raise ValueError("negative position in the ubatch")
        cdef int32_t[::1] pmv = pos
        cdef uint64_t[:, ::1] smv = seq
        cdef int32_t[::1] umv = unq
        cdef int32_t[::1] tmv
        v.n_tokens = n
        v.pos = &pmv[0]
        v.seq = <const lx_seq_bits *> &smv[0, 0]
        v.n_seqs_unq = unq.shape[0]
        v.seq_id_unq = &umv[0]
        v.token = NULL
        if tok is not None:
            tok = np.ascontiguousarray(tok, dtype=np.int32)
            if tok.shape[0] != n:
                raise ValueError("token and pos lengths differ")
            tmv = tok
            v.token = &tmv[0]
        keep.extend((pos, seq, unq, tok))
        return 0

    def n_parts(self, ub) -> int:
        return 1 if self.meta.n_stream == 1 else len(ub.seq_id_unq)

    def find_slot(self, ub, bint cont=False):
        """Cells for the ubatch (nothing changes): (strm uint32 [n_parts], idxs uint32 [n_tokens]) or None."""
        cdef lx_ubatch_view v
        keep = []
        self._view_of(ub, &v, keep)
        strm = np.zeros(lx_slot_n_parts(&self.meta, &v), dtype=np.uint32)
        idxs = np.zeros(v.n_tokens, dtype=np.uint32)
        cdef uint32_t[::1] sm = strm, im = idxs
        cdef lx_status rc
        with nogil:
            rc = lx_find_slot(&self.meta, &v, cont, &sm[0], &im[0])
        return (strm, idxs) if rc == LX_OK else None

    def apply_ubatch(self, ub, strm, idxs) -> None:
        """Write the ubatch into the slot found by find_slot/prepare."""
        cdef lx_ubatch_view v
        keep = []
        self._view_of(ub, &v, keep)
        sa = np.ascontiguousarray(strm, dtype=np.uint32)
        ia = np.ascontiguousarray(idxs, dtype=np.uint32)
        if sa.shape[0] != lx_slot_n_parts(&self.meta, &v) or ia.shape[0] != v.n_tokens:
            raise ValueError("slot does not match the ubatch")
        if sa.max() >= self.meta.n_stream or ia.max() >= lx_cells_size(self.cptr[0]):
            raise ValueError("slot outside the cache")
        cdef uint32_t[::1] sm = sa, im = ia
        cdef lx_status rc
        with nogil:
            rc = lx_apply_ubatch(&self.meta, &v, &sm[0], &im[0])
        if rc != LX_OK:
            raise MemoryError("cannot grow the position pool")

    def prepare(self, ubatches, bint cont=False):
        """Place every ubatch in turn and roll back: a list of (strm, idxs), or None if one does not fit."""
        cdef Py_ssize_t n = len(ubatches), u
        if n == 0:
            return []
        cdef lx_ubatch_view *views = <lx_ubatch_view *> malloc(n * sizeof(lx_ubatch_view))
        if views == NULL:
            raise MemoryError()
        keep = []
        cdef Py_ssize_t n_parts = 0, n_tok = 0
        try:
            for u in range(n):
                self._view_of(ubatches[u], &views[u], keep)
                n_parts += lx_slot_n_parts(&self.meta, &views[u])
                n_tok += views[u].n_tokens
            strm = np.zeros(n_parts, dtype=np.uint32)
            idxs = np.zeros(n_tok, dtype=np.uint32)
            sm = strm
            im = idxs
            rc = self._prepare(views, n, cont, strm, idxs)
        finally:
            free(views)
        if rc == LX_ERR_NOMEM:
            raise MemoryError("cannot grow the position pool")
        if rc != LX_OK:
            return None
        out = []
        cdef Py_ssize_t o_p = 0, o_t = 0, k
        for u in range(n):
            k = 1 if self.meta.n_stream == 1 else len(ubatches[u].seq_id_unq)
            out.append((strm[o_p:o_p + k], idxs[o_t:o_t + len(ubatches[u].pos)]))
            o_p += k
            o_t += len(ubatches[u].pos)
        return out

    cdef lx_status _prepare(self, lx_ubatch_view *views, Py_ssize_t n, bint cont, strm, idxs):
        cdef uint32_t[::1] sm = strm, im = idxs
        cdef lx_status rc
        with nogil:
            rc = lx_prepare(&self.meta, views, <uint32_t> n, cont, &sm[0], &im[0])
        return rc

    @staticmethod
    def is_contiguous(strm, idxs) -> bool:
        """slot_info::is_contiguous: the cells of every part are consecutive."""
        ia = np.ascontiguousarray(idxs, dtype=np.uint32)
        n_parts = len(strm)
        if n_parts == 0 or ia.shape[0] == 0:
            return True
        cdef uint32_t[::1] im = ia
        return lx_slot_is_contiguous(<uint32_t> n_parts, <uint32_t> (ia.shape[0] // n_parts), &im[0])

    # ---- inspection ------------------------------------------------------------------------
    @property
    def n_used(self) -> int:
        return sum(lx_cells_get_used(self.cptr[st]) for st in range(self.meta.n_stream))

    def get_has_shift(self) -> bool:
        return any(lx_cells_get_has_shift(self.cptr[st]) for st in range(self.meta.n_stream))

    def cells(self, int stream=-1) -> list:
        """(pos, frozenset(seqs)) per cell in cell order: one stream, or every stream concatenated."""
        if stream >= 0:
            return self.streams[stream].cells()
        out = []
        for c in self.streams:
            out.extend(c.cells())
        return out

    def dump(self) -> str:
        """The cell map as llama.cpp's debug print: '.' empty, the sequence id (0-9) if one, 'M' if more."""
        lines = []
        for st, c in enumerate(self.streams):
            pos = c.pos_view()
            bits = c.seq_view()
            cnt = np.zeros(pos.shape[0], dtype=np.int64)
            for k in range(4):
                w = bits[:, k]
                for b in range(64):
                    cnt += ((w >> np.uint64(b)) & np.uint64(1)).astype(np.int64)
            chars = []
            for i in range(pos.shape[0]):
                if pos[i] < 0:
                    chars.append(".")
                elif cnt[i] > 1:
                    chars.append("M")
                else:
                    s = min(_bits_to_set(bits[i]))
                    chars.append(str(s % 10))
            row = "".join(chars)
            lines.append(f"stream {st} head {int(self.heads[st])}:")
            lines.extend(row[i:i + 256] for i in range(0, len(row), 256))
        return "\n".join(lines)
