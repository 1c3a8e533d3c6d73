"""State save and load (llama.cpp's llama_state_*): the versioned binary format of a context's state.

A state blob is one header, one metadata region and one data region:

    offset  size  field
    0       8     magic b"LLAMAXST"
    8       4     version (1); any other is refused
    12      4     kind: 1 whole context, 2 whole memory (standalone cache), 3 one sequence
    16      16    fingerprint of the model (blake2b-128; zeros for a standalone cache without one)
    32      8     meta_len: bytes of metadata (the region is padded with zeros to a multiple of 8)
    40      8     data_len: bytes of data (a multiple of 8)
    48      8     data_xor: the XOR of the data region's little-endian uint64 words
    56      4     crc32 of bytes [0, 56) + [60, 64) + the padded metadata region
    60      4     reserved, 0
    64            metadata, then data

Every count and compatibility field lives in the metadata; the data region holds nothing but the
bulk arrays (logits, K rows, V rows or V columns), each chunk padded to 8 bytes, in the order the
metadata describes. A reader checks the lengths, the CRC and the XOR before it parses anything, so
a truncated blob or one bit flipped anywhere is refused before a single count is trusted (the CRC
catches every burst of up to 32 bits in the small regions; the word XOR catches every odd number of
flips in a bit lane of the data at memory speed).

Metadata, in order (little-endian; `u32[n]` is an array of n):

    whole context only, the outputs of the last decode (llama_context's output ids and logits):
        n_outputs u32, n_vocab u32, n_batch u32, row_of i32[n_batch]      -> data: f32[n_outputs, n_vocab]
    the memory, per KV cache (a KVCacheISWA writes tag 2, then its base and its SWA cache):
        tag u32 (1 = kv_cache), type_k 8s, type_v 8s, v_trans, n_layer, rot_k, rot_v, n_stream,
        kv_size, n_seq_max u32, n_swa i32, swa_type u32, n_head_kv, head_dim, head_dim_v u32,
        seq_id i32 (-1: every sequence, else the one written)
        row bytes u64[n_layer, 2] (K row, V row or, with v_trans, V column of one cell, per layer)
        heads u32[n_stream]                                   (whole states only)
        per stream: n_cells u32, n_runs u32, runs u32[n_runs, 2] (first cell, length),
                    cells CELL_DTYPE[n_cells] (pos, ext x y tok, sequence bitset) in cell order
        -> data, per stream: per layer the K rows of each run ([n, row]); per layer the V rows of each
           run, or with v_trans the V columns of each run ([n_head_kv, head_dim_v, n])

Only cells inside the sliding window are written: a cell the window hides from every sequence
holding it (for one sequence: from that sequence) can never be attended again and is skipped.
A whole restore puts every cell back at its own index (same heads), so the cache, the next slot
and the logits of the next decode are bit-identical, and saving again gives the same bytes.
A sequence restore removes the destination sequence, finds cells for the saved ones as a ubatch
would (contiguous if possible, as llama.cpp requires; otherwise any free cells, which llama.cpp
refuses) and copies the runs there.

Failure: any bad blob raises StateError before the memory changes; the destination is then made
empty (the whole cache cleared, or seq_rm of the destination sequence), never left half-written.

File format (state_save_file / state_seq_save_file): magic b"LLAMAXSF", version u32, n_tokens u32,
tokens i32[n_tokens], crc32 u32 of all that, then exactly one state blob up to the end of the file.
"""
from __future__ import annotations

import hashlib
import os
import struct
import zlib
from collections.abc import Callable, Iterable
from types import SimpleNamespace

import numpy as np

from llamax._native import buffers as _buffers
from llamax._native.cells import CELL_STATE_DTYPE, SWA_TYPES
from llamax.errors import StateError

MAGIC = b"LLAMAXST"
FILE_MAGIC = b"LLAMAXSF"
VERSION = 1

KIND_CONTEXT = 1  # whole context: outputs + memory
KIND_MEMORY = 2   # whole standalone memory
KIND_SEQ = 3      # one sequence of a memory
KIND_NAMES = {KIND_CONTEXT: "whole-context", KIND_MEMORY: "whole-memory", KIND_SEQ: "one-sequence"}

TAG_KV = 1
TAG_ISWA = 2
TAG_NAMES = {TAG_KV: "kv_cache", TAG_ISWA: "kv_cache_iswa"}

NO_FINGERPRINT = bytes(16)
POS_MAX = 2**31 - 1  # positions are int32 and -1 marks an empty cell

_HEADER = struct.Struct("<8sII16sQQQII")
assert _HEADER.size == 64
_CRC_AT = 56
_FILE_HEAD = struct.Struct("<8sII")
_U32 = struct.Struct("<I")
_OUTPUTS = struct.Struct("<III")
_KV_HEAD = struct.Struct("<8s8sIIIIIIIiIIIIi")
_STREAM = struct.Struct("<II")

#: one cell on the wire: position, the ext fields (M-RoPE x/y, token) and its sequence bitset
CELL_DTYPE = np.dtype([("pos", "<i4"), ("x", "<i4"), ("y", "<i4"), ("tok", "<i4"), ("seq", "<u8", (4,))])
assert CELL_DTYPE.itemsize == 48

_SWA_CODE = {name: int(code) for name, code in SWA_TYPES.items()}
_SWA_NAME = {code: name for name, code in _SWA_CODE.items()}


def fingerprint_bytes(fingerprint: bytes | str | None) -> bytes:
    """The 16 bytes stored for a fingerprint: zeros for None, else blake2b-128 of it."""
    if fingerprint is None:
        return NO_FINGERPRINT
    if isinstance(fingerprint, str):
        fingerprint = fingerprint.encode()
    return hashlib.blake2b(bytes(fingerprint), digest_size=16).digest()


def _xor64(flat: np.ndarray) -> int:
    """XOR of the little-endian uint64 words of a uint8 array zero-padded to a multiple of 8."""
    n = flat.shape[0]
    full = n - n % 8
    x = int(np.bitwise_xor.reduce(flat[:full].view(np.uint64))) if full else 0
    if n > full:
        x ^= int.from_bytes(flat[full:].tobytes(), "little")
    return x


# ---- the two ends of a blob -----------------------------------------------------------------------
class StateWriter:
    """Collects a blob: metadata bytes and data chunks (kept as views, copied once at the end)."""

    def __init__(self) -> None:
        self._meta = bytearray()
        self._data: list = []
        self._data_len = 0
        self._xor = 0

    def pack(self, st: struct.Struct, *values) -> None:
        """Append fixed fields to the metadata."""
        self._meta += st.pack(*values)

    def array(self, a: np.ndarray) -> None:
        """Append an array (already in its wire dtype) to the metadata."""
        self._meta += np.ascontiguousarray(a).tobytes()

    def data(self, a: np.ndarray) -> None:
        """Append an array's bytes to the data region as one chunk (padded to 8 bytes).

        A C-contiguous array is kept as a view and copied only when the blob is assembled."""
        flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        self._xor ^= _xor64(flat)
        self._data.append(flat)
        pad = -flat.shape[0] % 8
        if pad:
            self._data.append(bytes(pad))
        self._data_len += flat.shape[0] + pad

    def parts(self, kind: int, fingerprint: bytes) -> list:
        """The blob as a list of buffers: header, padded metadata, data chunks."""
        meta = bytes(self._meta) + bytes(-len(self._meta) % 8)
        head = bytearray(_HEADER.pack(MAGIC, VERSION, kind, fingerprint, len(self._meta), self._data_len,
                                      self._xor, 0, 0))
        crc = zlib.crc32(meta, zlib.crc32(head[_CRC_AT + 4:], zlib.crc32(head[:_CRC_AT])))
        struct.pack_into("<I", head, _CRC_AT, crc)
        return [bytes(head), meta] + self._data

    def getvalue(self, kind: int, fingerprint: bytes) -> bytes:
        """The blob as one bytes object (one copy of every data chunk, by every thread)."""
        return _buffers.join(self.parts(kind, fingerprint))


class StateReader:
    """Reads a blob written by StateWriter. The constructor checks the magic, the version, the
    lengths, both checksums, the kind and the fingerprint; then metadata and data are read in order.

    Args:
        data: any C-contiguous bytes-like object that starts with a blob.
        kind: the KIND_* expected.
        fingerprint: the 16 bytes expected.
        exact: the buffer must end with the blob (else bytes after it are left unread).
    Raises:
        StateError: on any mismatch, naming what and the numbers.
    """

    def __init__(self, data, *, kind: int, fingerprint: bytes, exact: bool) -> None:
        mv = memoryview(data)
        if not mv.c_contiguous:
            raise StateError("state data must be a contiguous buffer")
        if mv.ndim != 1 or mv.itemsize != 1:
            mv = mv.cast("B")
        n = mv.nbytes
        if n < _HEADER.size:
            raise StateError(f"state truncated: {n} bytes, the header alone takes {_HEADER.size}")
        magic, version, got_kind, fp, meta_len, data_len, data_xor, crc, reserved = _HEADER.unpack_from(mv, 0)
        if magic != MAGIC:
            raise StateError(f"not a llamax state (magic {magic!r}, expected {MAGIC!r})")
        if version != VERSION:
            raise StateError(f"state format version {version} is not supported (this llamax reads version {VERSION})")
        meta_pad = meta_len + (-meta_len % 8)
        total = _HEADER.size + meta_pad + data_len
        if data_len % 8:
            raise StateError(f"corrupt state: data length {data_len} is not a multiple of 8")
        if n < total:
            raise StateError(f"state truncated: {n} bytes, the header announces {total}")
        if exact and n > total:
            raise StateError(f"{n - total} unexpected bytes after the state ({total} bytes)")
        c = zlib.crc32(mv[_CRC_AT + 4:_HEADER.size], zlib.crc32(mv[:_CRC_AT]))
        c = zlib.crc32(mv[_HEADER.size:_HEADER.size + meta_pad], c)
        if c != crc:
            raise StateError(f"corrupt state: checksum of the header and metadata is {c:#010x}, expected {crc:#010x}")
        words = np.frombuffer(mv, np.uint64, count=data_len // 8, offset=_HEADER.size + meta_pad)
        x = int(np.bitwise_xor.reduce(words)) if words.size else 0
        if x != data_xor:
            raise StateError(f"corrupt state: checksum of the K/V data is {x:#018x}, expected {data_xor:#018x}")
        if reserved != 0:
            raise StateError(f"corrupt state: reserved header field is {reserved}")
        if got_kind != kind:
            raise StateError(f"this is a {KIND_NAMES.get(got_kind, f'kind-{got_kind}')} state, "
                             f"expected a {KIND_NAMES[kind]} state")
        if fp != fingerprint:
            raise StateError(f"state of another model: fingerprint {fp.hex()}, this one is {fingerprint.hex()}")
        self._mv = mv
        self._meta = _HEADER.size
        self._meta_end = _HEADER.size + meta_len
        self._data = _HEADER.size + meta_pad
        self._data_end = total
        self.size = total

    def _take_meta(self, nbytes: int, what: str) -> int:
        at = self._meta
        if nbytes > self._meta_end - at:
            raise StateError(f"state metadata ends early: {what} needs {nbytes} bytes, {self._meta_end - at} left")
        self._meta = at + nbytes
        return at

    def unpack(self, st: struct.Struct, what: str) -> tuple:
        """The next fixed fields of the metadata."""
        return st.unpack_from(self._mv, self._take_meta(st.size, what))

    def array(self, dtype, count: int, what: str) -> np.ndarray:
        """The next `count` items of the metadata, as a read-only view (nothing is allocated)."""
        dtype = np.dtype(dtype)
        at = self._take_meta(count * dtype.itemsize, what)
        return np.frombuffer(self._mv, dtype, count=count, offset=at)

    def data(self, nbytes: int, what: str) -> np.ndarray:
        """The next data chunk of nbytes (uint8 view; the chunk's padding is skipped)."""
        at = self._data
        step = nbytes + (-nbytes % 8)
        if step > self._data_end - at:
            raise StateError(f"state data ends early: {what} needs {nbytes} bytes, {self._data_end - at} left")
        self._data = at + step
        return np.frombuffer(self._mv, np.uint8, count=nbytes, offset=at)

    def finish(self) -> None:
        """Both regions must be read exactly."""
        if self._meta != self._meta_end:
            raise StateError(f"{self._meta_end - self._meta} unexpected bytes at the end of the state metadata")
        if self._data != self._data_end:
            raise StateError(f"{self._data_end - self._data} unexpected bytes at the end of the state data")


# ---- tags ------------------------------------------------------------------------------------------
def write_tag(w: StateWriter, tag: int) -> None:
    """The memory type of the section that follows."""
    w.pack(_U32, tag)


def read_tag(r: StateReader, tag: int) -> None:
    (got,) = r.unpack(_U32, "memory tag")
    if got != tag:
        raise StateError(f"the state holds a {TAG_NAMES.get(got, f'type-{got}')} memory, "
                         f"this memory is a {TAG_NAMES[tag]}")


# ---- outputs (llama_context's output ids and logits) -----------------------------------------------
def write_outputs(w: StateWriter, logits: np.ndarray, row_of: np.ndarray) -> None:
    """logits f32 [n_outputs, n_vocab]; row_of i32 [n_batch]: batch index -> row, -1 without one."""
    n_out, n_vocab = logits.shape
    w.pack(_OUTPUTS, n_out, n_vocab, row_of.shape[0])
    w.array(np.asarray(row_of, dtype="<i4"))
    w.data(np.asarray(logits, dtype="<f4"))


def read_outputs(r: StateReader, n_vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """Validated (logits, row_of) views of the blob."""
    n_out, nv, n_batch = r.unpack(_OUTPUTS, "outputs")
    if nv != n_vocab:
        raise StateError(f"the state's logits have {nv} columns, the model's vocabulary has {n_vocab}")
    if n_out > n_batch:
        raise StateError(f"the state has {n_out} output rows for a batch of {n_batch} tokens")
    row_of = r.array("<i4", n_batch, "output ids")
    has = row_of[row_of >= 0]
    if row_of.size and (row_of.min() < -1 or row_of.max() >= n_out):
        raise StateError(f"an output id of the state is outside [-1, {n_out})")
    if has.size != n_out or np.unique(has).size != n_out:
        raise StateError(f"the state's output ids do not name each of its {n_out} logits rows once")
    logits = r.data(n_out * n_vocab * 4, "logits").view("<f4").reshape(n_out, n_vocab)
    return logits, row_of


# ---- one KV cache -----------------------------------------------------------------------------------
def _has_seq(bits: np.ndarray, s: int) -> np.ndarray:
    return ((bits[:, s >> 6] >> np.uint64(s & 63)) & np.uint64(1)).astype(bool)


def _cells_to_write(kv, st: int, seq_id: int) -> np.ndarray:
    """Indices (ascending) of the cells of stream st to save: used, holding seq_id (any if -1), and
    not hidden by the sliding window from every sequence that holds them."""
    cells = kv.meta.streams[st]
    pos = cells.pos_view()
    bits = cells.seq_view()
    sel = pos >= 0
    swa = kv.swa_type != "none" and kv.n_swa > 0
    if seq_id >= 0:
        sel &= _has_seq(bits, seq_id)
        if swa and sel.any():
            sel &= ~kv.meta.masked_swa(pos, cells.seq_pos_max(seq_id))
    elif swa and sel.any():
        seen = np.zeros(pos.shape[0], dtype=bool)
        for s in range(kv.n_seq_max):
            if cells.seq_n_cells(s):
                has = _has_seq(bits, s)
                seen |= has & ~kv.meta.masked_swa(pos, cells.seq_pos_max(s))
        sel &= seen
    return np.flatnonzero(sel)


def _runs(idx: np.ndarray) -> np.ndarray:
    """[n_runs, 2] (first, length) of the runs of consecutive values in idx (in its order)."""
    if idx.size == 0:
        return np.zeros((0, 2), dtype=np.int64)
    idx = idx.astype(np.int64)
    cut = np.flatnonzero(np.diff(idx) != 1) + 1
    starts = np.concatenate(([0], cut))
    ends = np.concatenate((cut, [idx.size]))
    return np.stack([idx[starts], ends - starts], axis=1)


def _row_bytes(kv) -> np.ndarray:
    """u64 [n_layer, 2]: bytes of one cell's K row and V row (V column when v_trans), per layer."""
    out = np.zeros((kv.n_layer, 2), dtype="<u8")
    for li in range(kv.n_layer):
        k, v = kv.k[li], kv.v[li]
        out[li, 0] = int(np.prod(k.shape[2:])) * k.itemsize
        out[li, 1] = int(np.prod(v.shape[1:-1] if kv.v_trans else v.shape[2:])) * v.itemsize
    return out


def _name8(s: str) -> bytes:
    return s.encode("ascii")[:8]


def _unname8(b: bytes) -> str:
    return b.rstrip(b"\0").decode("ascii", "replace")


def write_kv_cache(w: StateWriter, kv, seq_id: int) -> None:
    """Append one KVCache's section (every sequence if seq_id == -1): see the module docstring.

    Runs of consecutive cells are copied whole (one slice per run and layer, no per-cell loop)."""
    write_tag(w, TAG_KV)
    w.pack(_KV_HEAD, _name8(kv.type_k), _name8(kv.type_v), int(kv.v_trans), kv.n_layer,
           int(getattr(kv, "rot_k", 0)), int(getattr(kv, "rot_v", 0)), kv.n_stream, kv.kv_size, kv.n_seq_max,
           kv.n_swa, _SWA_CODE[kv.swa_type], kv.n_head_kv, kv.head_dim, kv.head_dim_v, seq_id)
    w.array(_row_bytes(kv))
    if seq_id < 0:
        w.array(np.asarray(kv.meta.heads, dtype="<u4"))
    all_runs = []
    for st, cells in enumerate(kv.meta.streams):
        idx = _cells_to_write(kv, st, seq_id)
        runs = _runs(idx)
        snap = cells.snapshot(idx)
        wire = np.zeros(idx.size, dtype=CELL_DTYPE)
        for f in ("pos", "x", "y", "tok"):
            wire[f] = snap[f]
        if seq_id < 0:
            wire["seq"] = snap["seq"]
        else:
            wire["seq"][:, seq_id >> 6] = np.uint64(1) << np.uint64(seq_id & 63)
        w.pack(_STREAM, idx.size, runs.shape[0])
        w.array(runs.astype("<u4"))
        w.array(wire)
        all_runs.append(runs)
    for st, runs in enumerate(all_runs):
        for k in kv.k:
            for a, n in runs:
                w.data(k[st, a:a + n])
        for v in kv.v:
            for a, n in runs:
                w.data(v[st, ..., a:a + n] if kv.v_trans else v[st, a:a + n])


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


def read_kv_cache(r: StateReader, kv, seq_id: int) -> Callable[[], None]:
    """Parse and validate one KVCache's section without changing the cache; return the function
    that installs it (seq_id -1: the whole cache; else restore the saved sequence as seq_id).

    Raises:
        StateError: an incompatible configuration, counts beyond the cache, positions or sequence
            ids out of range, or a malformed section.
    """
    where = kv.name
    read_tag(r, TAG_KV)
    (tk, tv, v_trans, n_layer, rot_k, rot_v, n_stream, _kv_size, _n_seq_max, n_swa, swa_code, n_head_kv, head_dim,
     head_dim_v, src_seq) = r.unpack(_KV_HEAD, "cache header")  # kv_size / n_seq_max may differ: ids are checked
    _check("type_k", _unname8(tk), kv.type_k, where)
    _check("type_v", _unname8(tv), kv.type_v, where)
    _check("v_trans", bool(v_trans), kv.v_trans, where)
    _check("n_layer", n_layer, kv.n_layer, where)
    _check("n_head_kv", n_head_kv, kv.n_head_kv, where)
    _check("head_dim", head_dim, kv.head_dim, where)
    _check("head_dim_v", head_dim_v, kv.head_dim_v, where)
    _check("rot_k (K rotation block)", rot_k, int(getattr(kv, "rot_k", 0)), where)
    _check("rot_v (V rotation block)", rot_v, int(getattr(kv, "rot_v", 0)), where)
    _check("n_stream", n_stream, kv.n_stream, where)
    _check("swa_type", _SWA_NAME.get(swa_code, f"type-{swa_code}"), kv.swa_type, where)
    _check("n_swa", n_swa, kv.n_swa, where)
    if seq_id < 0 and src_seq != -1:
        raise StateError(f"{where}: the state holds sequence {src_seq} only, not every sequence")
    if seq_id >= 0 and not 0 <= src_seq < 256:
        raise StateError(f"{where}: the sequence state names sequence {src_seq}, outside [0, 256)")
    rows = r.array("<u8", 2 * n_layer, "row sizes").reshape(n_layer, 2)
    want = _row_bytes(kv)
    bad = np.flatnonzero((rows != want).any(axis=1))
    if bad.size:
        li = int(bad[0])
        raise StateError(f"{where}: layer {kv.layer_ids[li]} rows are {rows[li].tolist()} bytes (K, V) in the "
                         f"state, {want[li].tolist()} in this cache")
    heads = r.array("<u4", n_stream, "heads") if seq_id < 0 else None

    allowed = np.zeros(4, dtype=np.uint64)
    for s in range(kv.n_seq_max):
        allowed[s >> 6] |= np.uint64(1) << np.uint64(s & 63)
    streams = []
    for st in range(n_stream):
        n_cells, n_runs = r.unpack(_STREAM, "stream header")
        if n_cells > kv.kv_size:
            raise StateError(f"{where}: stream {st} of the state holds {n_cells} cells, the cache has {kv.kv_size}")
        if n_runs > n_cells or (n_cells > 0) != (n_runs > 0):
            raise StateError(f"{where}: stream {st} of the state has {n_runs} runs for {n_cells} cells")
        runs = r.array("<u4", 2 * n_runs, "cell runs").reshape(n_runs, 2).astype(np.int64)
        cells = r.array(CELL_DTYPE, n_cells, "cells")
        if n_cells == 0:
            continue
        first, lens = runs[:, 0], runs[:, 1]
        if lens.min() < 1 or int(lens.sum()) != n_cells or np.any(first[1:] < first[:-1] + lens[:-1]):
            raise StateError(f"{where}: stream {st} of the state has malformed cell runs")
        if seq_id < 0 and int(first[-1] + lens[-1]) > kv.kv_size:
            raise StateError(f"{where}: stream {st} of the state uses cell {int(first[-1] + lens[-1]) - 1}, "
                             f"the cache has {kv.kv_size} cells")
        pos = cells["pos"]
        if pos.min() < 0 or pos.max() >= POS_MAX:
            raise StateError(f"{where}: a position of the state is outside [0, {POS_MAX})")
        bits = cells["seq"]
        if seq_id >= 0:
            one = np.zeros(4, dtype=np.uint64)
            one[src_seq >> 6] = np.uint64(1) << np.uint64(src_seq & 63)
            if np.any(bits != one):
                raise StateError(f"{where}: a cell of the sequence state does not hold exactly sequence {src_seq}")
        else:
            if np.any(bits & ~allowed):
                raise StateError(f"{where}: the state holds sequence ids outside [0, n_seq_max={kv.n_seq_max})")
            if not np.all(bits.any(axis=1)):
                raise StateError(f"{where}: a used cell of the state holds no sequence")
            if n_stream > 1:
                own = np.zeros(4, dtype=np.uint64)
                own[st >> 6] = np.uint64(1) << np.uint64(st & 63)
                if np.any(bits != own):
                    raise StateError(f"{where}: stream {st} of the state holds another sequence than {st}")
        streams.append((st, runs, cells))
    if seq_id >= 0 and len(streams) > 1:
        raise StateError(f"{where}: the sequence state has cells in {len(streams)} streams")

    rows_k, rows_v = [int(x) for x in want[:, 0]], [int(x) for x in want[:, 1]]
    chunks = []  # per saved stream: (K chunks per layer per run, V chunks per layer per run)
    for st, runs, cells in streams:
        lens = [int(n) for n in runs[:, 1]]
        ks = [[r.data(n * rows_k[li], "K rows").view(kv.k[li].dtype).reshape((n,) + kv.k[li].shape[2:])
               for n in lens] for li in range(n_layer)]
        if kv.v_trans:
            vs = [[r.data(n * rows_v[li], "V columns").view(kv.v[li].dtype).reshape(kv.v[li].shape[1:-1] + (n,))
                   for n in lens] for li in range(n_layer)]
        else:
            vs = [[r.data(n * rows_v[li], "V rows").view(kv.v[li].dtype).reshape((n,) + kv.v[li].shape[2:])
                   for n in lens] for li in range(n_layer)]
        chunks.append((ks, vs))

    def copy_rows(st: int, lens: list[int], dst_runs: np.ndarray, ks, vs) -> None:
        for j, off, d0, n in _pair_runs(lens, dst_runs):
            for li in range(n_layer):
                np.copyto(kv.k[li][st, d0:d0 + n], ks[li][j][off:off + n])
                if kv.v_trans:
                    np.copyto(kv.v[li][st, ..., d0:d0 + n], vs[li][j][..., off:off + n])
                else:
                    np.copyto(kv.v[li][st, d0:d0 + n], vs[li][j][off:off + n])

    def install_all() -> None:
        kv.clear(data=False)
        for (st, runs, cells), (ks, vs) in zip(streams, chunks):
            idx = np.concatenate([np.arange(a, a + n) for a, n in runs])
            states = np.zeros(idx.size, dtype=CELL_STATE_DTYPE)
            for f in ("pos", "x", "y", "tok", "seq"):
                states[f] = cells[f]
            kv.meta.streams[st].restore(idx, states)
            copy_rows(st, [int(n) for n in runs[:, 1]], runs, ks, vs)
        h = np.asarray(heads, dtype=np.int64)
        kv.meta.heads[:] = np.where(h <= kv.kv_size, h, 0)  # a head may sit just past the last cell

    def install_seq() -> None:
        kv.seq_rm(seq_id, -1, -1)
        if not streams:
            return
        (_, runs, cells), (ks, vs) = streams[0], chunks[0]
        n = cells.shape[0]
        bits = np.zeros((n, 4), dtype=np.uint64)
        bits[:, seq_id >> 6] = np.uint64(1) << np.uint64(seq_id & 63)
        ub = SimpleNamespace(n_tokens=n, pos=np.ascontiguousarray(cells["pos"], dtype=np.int32), seq_bits=bits,
                             seq_id=np.full(n, seq_id, dtype=np.int32),
                             seq_id_unq=np.array([seq_id], dtype=np.int32),
                             token=np.ascontiguousarray(cells["tok"], dtype=np.int32))
        slot = kv.meta.find_slot(ub, True) or kv.meta.find_slot(ub, False)
        if slot is None:
            raise StateError(f"{where}: no room for the {n} cells of the saved sequence "
                             f"({kv.n_used}/{kv.n_cells} cells used)")
        strm, idxs = slot
        kv.meta.apply_ubatch(ub, strm, idxs)
        st = int(strm[0])
        if np.any(cells["x"]) or np.any(cells["y"]):
            c = kv.meta.streams[st]
            states = c.snapshot(idxs)
            states["x"], states["y"] = cells["x"], cells["y"]
            c.restore(idxs, states)
        copy_rows(st, [int(n) for n in runs[:, 1]], _runs(np.asarray(idxs)), ks, vs)

    return install_all if seq_id < 0 else install_seq


# ---- whole blobs -------------------------------------------------------------------------------------
def _check_seq_arg(memory, seq_id: int, what: str) -> int:
    if isinstance(seq_id, bool) or not isinstance(seq_id, (int, np.integer)):
        raise TypeError(f"{what} must be an int, got {type(seq_id).__name__}")
    seq_id = int(seq_id)
    if not 0 <= seq_id < memory.n_seq_max:
        raise ValueError(f"{what} {seq_id} outside [0, n_seq_max={memory.n_seq_max})")
    return seq_id


def _empty(memory, seq_id: int) -> None:
    """Leave the destination empty after a failed restore."""
    if seq_id < 0:
        memory.clear(data=True)
    else:
        memory.seq_rm(seq_id, -1, -1)


def writer(memory, seq_id: int = -1, outputs: tuple[np.ndarray, np.ndarray] | None = None) -> StateWriter:
    """A StateWriter holding the memory's state (of seq_id, or all if -1) and, if given, the outputs."""
    w = StateWriter()
    if outputs is not None:
        write_outputs(w, *outputs)
    memory.state_write(w, seq_id)
    return w


def restore(memory, data, seq_id: int = -1, *, kind: int, fingerprint: bytes, exact: bool = False,
            n_vocab: int | None = None) -> tuple[int, tuple | None]:
    """Validate a whole blob, then install it into the memory (of seq_id, or all if -1).

    Returns:
        (bytes read, (logits, row_of) copies when kind is KIND_CONTEXT, else None).
    Raises:
        StateError: nothing was installed and the destination is left empty.
    """
    try:
        r = StateReader(data, kind=kind, fingerprint=fingerprint, exact=exact)
        outputs = read_outputs(r, n_vocab) if kind == KIND_CONTEXT else None
        install = memory.state_read(r, seq_id)
        r.finish()
        if outputs is not None:
            outputs = (np.array(outputs[0], dtype=np.float32), np.array(outputs[1], dtype=np.int32))
        install()
    except BaseException:
        _empty(memory, seq_id)
        raise
    return r.size, outputs


def get_data(memory, seq_id: int = -1, *, fingerprint: bytes | str | None = None) -> bytes:
    """The state of a standalone memory (KVCache, KVCacheISWA): every sequence, or seq_id's cells only.

    Args:
        fingerprint: anything identifying the model that filled the cache (checked by set_data).
    Complexity: O(cells) metadata, one copy of the saved K/V bytes.
    """
    if seq_id != -1:
        seq_id = _check_seq_arg(memory, seq_id, "seq_id")
    kind = KIND_MEMORY if seq_id < 0 else KIND_SEQ
    return writer(memory, seq_id).getvalue(kind, fingerprint_bytes(fingerprint))


def set_data(memory, data, seq_id: int = -1, *, fingerprint: bytes | str | None = None) -> int:
    """Restore a standalone memory from get_data's bytes (seq_id -1: the whole memory, else the saved
    sequence into seq_id). Returns the bytes read; bytes after the blob are left unread.

    Raises:
        StateError: a truncated, corrupt, foreign or incompatible blob; the whole memory (or seq_id)
            is left empty.
    """
    if seq_id != -1:
        seq_id = _check_seq_arg(memory, seq_id, "dest_seq_id")
    kind = KIND_MEMORY if seq_id < 0 else KIND_SEQ
    return restore(memory, data, seq_id, kind=kind, fingerprint=fingerprint_bytes(fingerprint))[0]


# ---- contexts ----------------------------------------------------------------------------------------
def context_writer(ctx, seq_id: int = -1) -> tuple[StateWriter, int, bytes]:
    """(writer, kind, fingerprint) of a context's state: whole (outputs + memory) or one sequence."""
    if seq_id != -1:
        seq_id = _check_seq_arg(ctx.memory, seq_id, "seq_id")
        return writer(ctx.memory, seq_id), KIND_SEQ, fingerprint_bytes(ctx.model.fingerprint)
    return (writer(ctx.memory, -1, (ctx._logits, ctx._row_of)), KIND_CONTEXT,
            fingerprint_bytes(ctx.model.fingerprint))


def context_get_data(ctx, seq_id: int = -1) -> bytes:
    w, kind, fp = context_writer(ctx, seq_id)
    return w.getvalue(kind, fp)


def context_set_data(ctx, data, seq_id: int = -1, *, exact: bool = False) -> int:
    """Restore a context (seq_id -1: memory and outputs) or one of its sequences; bytes read."""
    if seq_id != -1:
        seq_id = _check_seq_arg(ctx.memory, seq_id, "dest_seq_id")
    kind = KIND_CONTEXT if seq_id < 0 else KIND_SEQ
    try:
        n, outputs = restore(ctx.memory, data, seq_id, kind=kind, fingerprint=fingerprint_bytes(ctx.model.fingerprint),
                             exact=exact, n_vocab=ctx.model.n_vocab)
    except BaseException:
        if seq_id < 0:
            ctx._logits = np.zeros((0, ctx.model.n_vocab), np.float32)
            ctx._row_of = np.zeros(0, np.int32)
        raise
    if outputs is not None:
        ctx._logits, ctx._row_of = outputs
    return n


def _tokens_i32(tokens: Iterable[int]) -> np.ndarray:
    t = np.asarray(list(tokens) if not isinstance(tokens, np.ndarray) else tokens)
    if t.ndim != 1 or (t.size and t.dtype.kind not in "iu"):
        raise ValueError("tokens must be a sequence of ints")
    t = t.astype(np.int64)
    if t.size and (t.min() < 0 or t.max() >= 2**31):
        raise ValueError(f"a token id is outside [0, 2**31): {int(t.min())}..{int(t.max())}")
    return t.astype("<i4")


def save_file(path, tokens: Iterable[int], parts: list) -> None:
    """Write the file header with its tokens, then the blob parts (to path.tmp, then renamed)."""
    toks = _tokens_i32(tokens)
    head = _FILE_HEAD.pack(FILE_MAGIC, VERSION, toks.size) + toks.tobytes()
    path = os.fspath(path)
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(head)
            f.write(_U32.pack(zlib.crc32(head)))
            f.writelines(parts)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def load_file(path) -> tuple[list[int], np.ndarray]:
    """(tokens, the blob) of a state file; sizes are checked against the file before reading.

    Raises:
        StateError: not a llamax state file, an unsupported version, a corrupt or truncated header.
        OSError: the file cannot be read.
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(_FILE_HEAD.size)
        if len(head) < _FILE_HEAD.size:
            raise StateError(f"{path}: truncated state file ({size} bytes)")
        magic, version, n_tokens = _FILE_HEAD.unpack(head)
        if magic != FILE_MAGIC:
            raise StateError(f"{path}: not a llamax state file (magic {magic!r}, expected {FILE_MAGIC!r})")
        if version != VERSION:
            raise StateError(f"{path}: state file version {version} is not supported (this llamax reads {VERSION})")
        rest = size - _FILE_HEAD.size - 4 * n_tokens - 4
        if rest < _HEADER.size:
            raise StateError(f"{path}: truncated state file: {size} bytes cannot hold {n_tokens} tokens and a state")
        toks = f.read(4 * n_tokens)
        (crc,) = _U32.unpack(f.read(4))
        if zlib.crc32(toks, zlib.crc32(head)) != crc:
            raise StateError(f"{path}: corrupt state file: checksum of the header and tokens does not match")
        blob = np.empty(rest, dtype=np.uint8)
        if f.readinto(memoryview(blob)) != rest:
            raise StateError(f"{path}: the state file changed while it was read")
    return np.frombuffer(toks, "<i4").tolist(), blob


def context_save_file(ctx, path, tokens: Iterable[int], seq_id: int = -1) -> None:
    w, kind, fp = context_writer(ctx, seq_id)
    save_file(path, tokens, w.parts(kind, fp))


def context_load_file(ctx, path, seq_id: int = -1) -> list[int]:
    """Restore a context (or one sequence into seq_id) from a file; the tokens saved with it.

    Raises:
        StateError: the file is not a valid state for this context; the destination is left empty.
    """
    if seq_id != -1:
        seq_id = _check_seq_arg(ctx.memory, seq_id, "dest_seq_id")
    try:
        tokens, blob = load_file(path)
    except StateError:
        _empty(ctx.memory, seq_id)
        if seq_id < 0:
            ctx._logits = np.zeros((0, ctx.model.n_vocab), np.float32)
            ctx._row_of = np.zeros(0, np.int32)
        raise
    context_set_data(ctx, blob, seq_id, exact=True)
    return tokens
