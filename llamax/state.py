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
metadata describes. A reader checks the lengths, the CRC and the XOR before it parses anything (a
file's reader: the XOR once the data is read, still before anything is installed), so a truncated
blob or one bit flipped anywhere is refused before a single count is trusted (the CRC
catches every burst of up to 32 bits in the small regions; the word XOR catches every odd number of
flips in a bit lane of the data at memory speed). A writer copies the data chunks from the memory
and takes their XOR in the same pass (csrc/buffers.h, one native call), into a new bytes object
(StateWriter.getvalue) or a buffer the caller keeps (write_into: Context.state_get_data_into); a
reader takes the XOR in one pass, then a KV cache installs all its chunks in one native call.

Metadata, in order (little-endian; `u32[n]` is an array of n):

    whole context only, the outputs of the last decode (llama_context's output ids and logits):
        n_outputs u32, n_vocab u32, n_batch u32, row_of i32[n_batch]      -> data: f32[n_outputs, n_vocab]
    the memory, per KV cache (KVCache.state_write; a KVCacheISWA writes tag 2, then its base and its SWA cache):
        tag u32 (1 = kv_cache), type_k 8s, type_v 8s, v_trans, n_layer, rot_k, rot_v, n_stream,
        kv_size, n_seq_max u32, n_swa i32, swa_type u32, n_head_kv, head_dim, head_dim_v u32,
        seq_id i32 (-1: every sequence, else the one written)
        row bytes u64[n_layer, 2] (K row, V row or, with v_trans, V column of one cell, per layer)
        heads u32[n_stream]                                   (whole states only)
        per stream: n_cells u32, n_runs u32, runs u32[n_runs, 2] (first cell, length),
                    cells CELL_DTYPE[n_cells] (pos, ext x y tok, sequence bitset) in cell order
        -> data, per stream: per layer the K rows of each run ([n, row]); per layer the V rows of each
           run, or with v_trans the V columns of each run ([n_head_kv, head_dim_v, n])
    the memory, for a recurrent memory (RecurrentMemory.state_write):
        tag u32 (3 = memory_recurrent), n_layer u32 (layers with a state), mem_size u32, n_seq_max u32,
        seq_id i32, rank of r u32, rank of s u32, layer ids u32[n_layer], r and s shapes u32[...],
        n_cells u32, cells (cell u32, pos i32, seq i32)[n_cells]
        -> data: per layer the conv rows of the cells ([n_cells, *r]), then per layer their ssm rows
    a hybrid memory (HybridMemory) writes tag 4, then its KV cache's section, then its recurrent one.

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
A file is never read whole: open_file checks both headers against the file's length (the blob's
64 + meta_len + padding + data_len bytes must end exactly at the end of the file) before it reads the
tokens; restore then reads the metadata (CRC checked before a count is trusted) and each data chunk
from the file when the memory asks for it, and checks the data's XOR before anything is installed.
Loading holds at most the metadata and the chunks the memory asked for, never the file. Saving
writes a new file next to the path (NAME.HEX16.tmp, flock'ed while written), fsyncs it, renames it
over the path and fsyncs the directory; a failure (a full disk) removes it, a killed process leaves
it behind for remove_stale_tmp. A path that exists and is not a regular file (a directory, a
symbolic link, a FIFO, a device) is refused and left as it is.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
import stat
import struct
import zlib
from collections.abc import Iterable

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; remove_stale_tmp removes every temporary file
    fcntl = None  # type: ignore[assignment]  # a module or None, tested before each use

import numpy as np

from llamax import checks
from llamax._native import buffers as _buffers
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
TAG_RECURRENT = 3
TAG_HYBRID = 4
TAG_NAMES = {TAG_KV: "kv_cache", TAG_ISWA: "kv_cache_iswa", TAG_RECURRENT: "memory_recurrent",
             TAG_HYBRID: "memory_hybrid"}

NO_FINGERPRINT = bytes(16)

_HEADER = struct.Struct("<8sII16sQQQII")
assert _HEADER.size == 64
_CRC_AT = 56
_FILE_HEAD = struct.Struct("<8sII")
_U32 = struct.Struct("<I")
_OUTPUTS = struct.Struct("<III")
_CHUNK = 1 << 24  # bytes of a file read (and XORed) at a time



def fingerprint_bytes(fingerprint: bytes | str | None) -> bytes:
    """The 16 bytes stored for a fingerprint: zeros for None, else blake2b-128 of it."""
    if fingerprint is None:
        return NO_FINGERPRINT
    if isinstance(fingerprint, str):
        fingerprint = fingerprint.encode()
    return hashlib.blake2b(bytes(fingerprint), digest_size=16).digest()


#: threads of a pass over memory already mapped (the checksum of a blob, a copy into a kept buffer
#: or into the cache): one core moves about as many bytes as two, and a pass split over two threads
#: waits for whichever core is busy elsewhere (measured on a shared 2-core EPYC: 2 ms on one thread,
#: 5 on two, for the 47 MB checksum). A new blob's pages are faulted in by every core (getvalue).
PASS_THREADS = 1


def _xor64(flat) -> int:
    """XOR of the little-endian uint64 words of a C-contiguous buffer zero-padded to a multiple of 8."""
    return _buffers.xor64(flat, PASS_THREADS)


def _rows(a: np.ndarray, copy: bool) -> np.ndarray:
    """[rows, n] uint8: one row per index of a's leading axes, a view if they merge into one axis
    and the last is contiguous, else (copy) a contiguous copy."""
    r = a.reshape(-1, a.shape[-1]) if a.ndim else a.reshape(1, 1)
    strided = r.shape[-1] > 1 and r.strides[-1] != r.itemsize
    if strided or r.__array_interface__["data"][0] != a.__array_interface__["data"][0]:
        assert copy, f"no row view of an array of shape {a.shape} and strides {a.strides}"
        r = np.ascontiguousarray(r)  # reshape copied, or the rows are strided: one contiguous copy
    return r.view(np.uint8)


def row_view(a: np.ndarray) -> np.ndarray:
    """a's bytes as a 2-D uint8 array [rows, n] whose rows are contiguous, in a's order: one row
    when a is C-contiguous (a run of K rows), else a view with one row per index of the leading
    axes when they merge into one (the V columns of a run in a transposed V: one row per
    channel), else a contiguous copy."""
    a = np.asarray(a)
    if a.flags.c_contiguous:
        return a.reshape(1, -1).view(np.uint8)
    return _rows(a, copy=True)


def row_views(dst: np.ndarray, src: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Views of the same [rows, n] shape for a copy from src to dst (arrays of one shape), for
    buffers.copy_rows: one row each when both are C-contiguous, else one row per index of the
    leading axes (dst always a view of dst: asserted)."""
    assert dst.shape == src.shape, (dst.shape, src.shape)
    if dst.flags.c_contiguous and src.flags.c_contiguous:
        return dst.reshape(1, -1).view(np.uint8), src.reshape(1, -1).view(np.uint8)
    return _rows(dst, copy=False), _rows(np.asarray(src), copy=True)


# ---- the two ends of a blob -----------------------------------------------------------------------
class StateWriter:
    """Collects a blob: metadata bytes and data chunks. The chunks are kept as row views of the
    memory and copied once, checksummed as they are copied, when the blob is written (getvalue,
    write_into); the memory must not change in between."""

    def __init__(self) -> None:
        self._meta = bytearray()
        self._chunks: list[np.ndarray] = []  # [rows, n] uint8 views
        self._at: list[int] = []             # where each chunk starts in the data region (multiples of 8)
        self._data_len = 0

    def pack(self, st: struct.Struct, *values) -> None:
        """Append fixed fields to the metadata."""
        self._meta += st.pack(*values)

    def array(self, a: np.ndarray) -> None:
        """Append an array (already in its wire dtype) to the metadata."""
        self._meta += np.ascontiguousarray(a).tobytes()

    def data(self, a: np.ndarray) -> None:
        """Append an array's bytes to the data region as one chunk (padded to 8 bytes), in a's order.

        Kept as a view when its rows are contiguous (row_view); copied only when the blob is written."""
        rows = row_view(a)
        self._chunks.append(rows)
        self._at.append(self._data_len)
        self._data_len += rows.size + (-rows.size % 8)

    @property
    def _data_at(self) -> int:
        return _HEADER.size + len(self._meta) + (-len(self._meta) % 8)

    @property
    def size(self) -> int:
        """Bytes of the blob: header, padded metadata, data."""
        return self._data_at + self._data_len

    def _head(self, kind: int, fingerprint: bytes, data_xor: int) -> bytes:
        """The header and the padded metadata, with both checksums."""
        head = bytearray(_HEADER.pack(MAGIC, VERSION, kind, fingerprint, len(self._meta), self._data_len,
                                      data_xor, 0, 0))
        head += self._meta
        head += bytes(-len(self._meta) % 8)
        crc = zlib.crc32(memoryview(head)[_CRC_AT + 4:], zlib.crc32(memoryview(head)[:_CRC_AT]))
        struct.pack_into("<I", head, _CRC_AT, crc)
        return bytes(head)

    def _pads(self) -> list[tuple[int, int]]:
        """(offset in the blob, bytes) of the zero padding after each chunk that needs some."""
        at0 = self._data_at
        return [(at0 + at + c.size, -c.size % 8) for at, c in zip(self._at, self._chunks) if c.size % 8]

    def parts(self, kind: int, fingerprint: bytes) -> list:
        """The blob as a list of buffers (header with the padded metadata, then the data chunks and
        their padding), for a file: the checksum takes one read of the data, the file write the other."""
        out: list = []
        data_xor = 0
        for c in self._chunks:
            flat = np.ascontiguousarray(c).reshape(-1)  # a copy only for strided rows (a transposed V)
            data_xor ^= _xor64(flat.data)  # a chunk starts on a word of the data region
            out.append(flat)
            if flat.size % 8:
                out.append(bytes(-flat.size % 8))
        return [self._head(kind, fingerprint, data_xor)] + out

    def getvalue(self, kind: int, fingerprint: bytes) -> bytes:
        """The blob as one new bytes object: every data chunk copied once (by every thread), its
        checksum taken as it is copied."""
        b = _buffers.BytesBuilder(self.size)
        data_xor = _buffers.gather_xor(b, [self._data_at + at for at in self._at], self._chunks)
        for at, n in self._pads():
            b.write(at, bytes(n))
        b.write(0, self._head(kind, fingerprint, data_xor))
        return b.take()

    def write_into(self, out: bytearray | memoryview | np.ndarray, kind: int, fingerprint: bytes) -> int:
        """Write the blob at the start of a writable buffer of at least size bytes; returns size.

        Raises:
            ValueError: the buffer is shorter than the blob (nothing is written) or read-only."""
        mv = (out.data if isinstance(out, np.ndarray) else memoryview(out)).cast("B")
        if mv.readonly:
            raise ValueError("the output buffer is read-only")
        if mv.nbytes < self.size:
            raise ValueError(f"the output buffer holds {mv.nbytes} bytes, the state takes {self.size}")
        data_xor = _buffers.gather_xor(mv, [self._data_at + at for at in self._at], self._chunks, PASS_THREADS)
        for at, n in self._pads():
            mv[at:at + n] = bytes(n)
        head = self._head(kind, fingerprint, data_xor)
        mv[:len(head)] = head
        return self.size


class _Head:
    """A blob's header, its lengths checked against the n bytes available (exact: n must be the blob).

    Raises:
        StateError: too short for a header, another magic or version, a data length that is not a
            multiple of 8, fewer bytes than announced (or more, when exact).
    """

    def __init__(self, buf, n: int, exact: bool, where: str = "") -> None:
        if n < _HEADER.size:
            raise StateError(f"{where}state truncated: {n} bytes, the header alone takes {_HEADER.size}")
        (magic, version, self.kind, self.fingerprint, meta_len, self.data_len, self.data_xor, self.crc,
         self.reserved) = _HEADER.unpack_from(buf, 0)
        if magic != MAGIC:
            raise StateError(f"{where}not a llamax state (magic {magic!r}, expected {MAGIC!r})")
        if version != VERSION:
            raise StateError(f"{where}state format version {version} is not supported "
                             f"(this llamax reads version {VERSION})")
        if self.data_len % 8:
            raise StateError(f"{where}corrupt state: data length {self.data_len} is not a multiple of 8")
        self.meta_end = _HEADER.size + meta_len
        self.data_at = self.meta_end + (-meta_len % 8)  # the metadata region is padded to 8 bytes
        self.size = self.data_at + self.data_len
        if n < self.size:
            raise StateError(f"{where}state truncated: {n} bytes, the header announces {self.size}")
        if exact and n > self.size:
            raise StateError(f"{where}{n - self.size} unexpected bytes after the state ({self.size} bytes)")
        self.where = where

    def check_crc(self, mv: memoryview) -> None:
        """mv holds the header and the padded metadata."""
        c = zlib.crc32(mv[_CRC_AT + 4:_HEADER.size], zlib.crc32(mv[:_CRC_AT]))
        c = zlib.crc32(mv[_HEADER.size:self.data_at], c)
        if c != self.crc:
            raise StateError(f"{self.where}corrupt state: checksum of the header and metadata is {c:#010x}, "
                             f"expected {self.crc:#010x}")

    def check_xor(self, x: int) -> None:
        if x != self.data_xor:
            raise StateError(f"{self.where}corrupt state: checksum of the K/V data is {x:#018x}, "
                             f"expected {self.data_xor:#018x}")

    def check_kind(self, kind: int, fingerprint: bytes) -> None:
        if self.reserved != 0:
            raise StateError(f"{self.where}corrupt state: reserved header field is {self.reserved}")
        if self.kind != kind:
            raise StateError(f"{self.where}this is a {KIND_NAMES.get(self.kind, f'kind-{self.kind}')} state, "
                             f"expected a {KIND_NAMES[kind]} state")
        if self.fingerprint != fingerprint:
            raise StateError(f"{self.where}state of another model: fingerprint {self.fingerprint.hex()}, "
                             f"this one is {fingerprint.hex()}")


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
        h = _Head(mv, mv.nbytes, exact)
        h.check_crc(mv)
        h.check_xor(_xor64(mv[h.data_at:h.size]))
        h.check_kind(kind, fingerprint)
        self._start(mv, h)

    def _start(self, mv: memoryview, h: _Head) -> None:
        """Read from mv (the metadata at least) the regions h describes."""
        self._mv = mv
        self._meta = _HEADER.size
        self._meta_end = h.meta_end
        self._data = h.data_at
        self._data_end = h.size
        self.size = h.size

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

    def _take_data(self, nbytes: int, what: str) -> tuple[int, int]:
        """(offset, padded size) of the next data chunk of nbytes."""
        at = self._data
        step = nbytes + (-nbytes % 8)
        if step > self._data_end - at:
            raise StateError(f"state data ends early: {what} needs {nbytes} bytes, {self._data_end - at} left")
        self._data = at + step
        return at, step

    def data(self, nbytes: int, what: str) -> np.ndarray:
        """The next data chunk of nbytes (uint8 view; the chunk's padding is skipped)."""
        at, _ = self._take_data(nbytes, what)
        return np.frombuffer(self._mv, np.uint8, count=nbytes, offset=at)

    def finish(self) -> None:
        """Both regions must be read exactly."""
        if self._meta != self._meta_end:
            raise StateError(f"{self._meta_end - self._meta} unexpected bytes at the end of the state metadata")
        if self._data != self._data_end:
            raise StateError(f"{self._data_end - self._data} unexpected bytes at the end of the state data")


class _FileReader(StateReader):
    """A StateReader over the blob of an open state file (StateFile), for restore: it holds the
    metadata and the data chunks the memory asked for, never the file. The constructor reads the
    padded metadata (its size was checked against the file's) and checks the CRC, the kind and the
    fingerprint; data() reads each chunk from the file when the memory asks for it, in bounded
    pieces XORed as they arrive; finish() checks that the data was read exactly and its XOR, before
    anything is installed. A blob whose memory section asks for less data than the file holds is
    refused without reading the rest.
    """

    def __init__(self, sf: "StateFile", *, kind: int, fingerprint: bytes) -> None:
        h = sf.head
        buf = bytearray(h.data_at)
        buf[:_HEADER.size] = sf.head_bytes
        _read_exactly(sf, memoryview(buf)[_HEADER.size:])
        mv = memoryview(buf).toreadonly()
        h.check_crc(mv)
        h.check_kind(kind, fingerprint)
        self._start(mv, h)
        self._sf = sf
        self._head = h
        self._xor = 0

    def data(self, nbytes: int, what: str) -> np.ndarray:
        """The next data chunk of nbytes, read from the file into a new uint8 array."""
        _, step = self._take_data(nbytes, what)
        out = np.empty(step, np.uint8)
        mv = out.data  # memoryview(out); numpy types ndarray as a Buffer only for Python >= 3.12
        for at in range(0, step, _CHUNK):
            _read_exactly(self._sf, mv[at:at + _CHUNK])
            self._xor ^= _xor64(out[at:at + _CHUNK])
        return out[:nbytes]

    def finish(self) -> None:
        """Both regions must be read exactly, and the data's XOR must be the header's."""
        super().finish()
        self._head.check_xor(self._xor)


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


# ---- whole blobs -------------------------------------------------------------------------------------
def empty(memory, seq_id: int) -> None:
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

    Args:
        data: a bytes-like blob, or an open StateFile (its blob read from the file as the memory
            asks for it; always exact: open_file checked the lengths against the file's).
    Returns:
        (bytes read, (logits, row_of) copies when kind is KIND_CONTEXT, else None).
    Raises:
        StateError: nothing was installed and the destination is left empty (as on any exception:
            an OSError reading a StateFile too).
    """
    try:
        if isinstance(data, StateFile):
            r = data.reader(kind=kind, fingerprint=fingerprint)
        else:
            r = StateReader(data, kind=kind, fingerprint=fingerprint, exact=exact)
        outputs = None
        if kind == KIND_CONTEXT:
            assert n_vocab is not None, "a context's state holds its logits: restore needs n_vocab"
            outputs = read_outputs(r, n_vocab)
        install = memory.state_read(r, seq_id)
        r.finish()
        if outputs is not None:
            outputs = (np.array(outputs[0], dtype=np.float32), np.array(outputs[1], dtype=np.int32))
        install()
    except BaseException:
        empty(memory, seq_id)
        raise
    return r.size, outputs


def get_data(memory, seq_id: int = -1, *, fingerprint: bytes | str | None = None) -> bytes:
    """The state of a standalone memory (KVCache, KVCacheISWA): every sequence, or seq_id's cells only.

    Args:
        fingerprint: anything identifying the model that filled the cache (checked by set_data).
    Complexity: O(cells) metadata, one copy of the saved K/V bytes.
    """
    if seq_id != -1:
        seq_id = checks.seq_id(seq_id, memory.n_seq_max, "seq_id")
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
        seq_id = checks.seq_id(seq_id, memory.n_seq_max, "dest_seq_id")
    kind = KIND_MEMORY if seq_id < 0 else KIND_SEQ
    return restore(memory, data, seq_id, kind=kind, fingerprint=fingerprint_bytes(fingerprint))[0]


def _tokens_i32(tokens: Iterable[int]) -> np.ndarray:
    t = np.asarray(list(tokens) if not isinstance(tokens, np.ndarray) else tokens)
    if t.ndim != 1 or (t.size and t.dtype.kind not in "iu"):
        raise ValueError("tokens must be a sequence of ints")
    t = t.astype(np.int64)
    if t.size and (t.min() < 0 or t.max() >= 2**31):
        raise ValueError(f"a token id is outside [0, 2**31): {int(t.min())}..{int(t.max())}")
    return t.astype("<i4")


def _kind_of(mode: int) -> str:
    """What a path that is not a regular file is, for messages."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return f"a file of type {stat.S_IFMT(mode):#o}"


_TMP_NAME = re.compile(r"^(?P<name>.+)\.[0-9a-f]{16}\.tmp$")  # save_file's temporary files: NAME.HEX16.tmp


def _tmp_name(name: str) -> str:
    """A new temporary name beside name, of the form is_tmp_name recognises."""
    return f"{name}.{secrets.token_hex(8)}.tmp"


def is_tmp_name(name: str) -> bool:
    """True for the name of one of save_file's temporary files (NAME.HEX16.tmp)."""
    return _TMP_NAME.match(name) is not None


def _fsync_dir(directory: str) -> None:
    """Make a rename in directory durable (where directories can be opened and synced)."""
    try:
        dfd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # a platform without directory handles (Windows): the rename is as durable as it gets
        return
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def save_file(path, tokens: Iterable[int], parts: list) -> None:
    """Write the file header with its tokens, then the blob parts, to a new file next to path
    (NAME.HEX16.tmp, locked while it is written), fsync it, rename it over path and fsync the
    directory: a reader, a crash or a kill at any point sees the old file or the new one, never half
    of one. A kill leaves at most the temporary file (remove_stale_tmp removes it later).

    Raises:
        ValueError: a token id outside [0, 2**31) (nothing is written).
        StateError: path exists and is not a regular file (a directory, a symbolic link, even to a
            regular file, a FIFO, a device, ...): it would be replaced; nothing is written.
        OSError: the directory cannot be written, the disk is full (ENOSPC, EFBIG, EDQUOT at a write
            or at the fsync): the temporary file is removed and path is left as it was.
    """
    toks = _tokens_i32(tokens)
    name = os.fsdecode(path)
    try:
        mode = os.lstat(name).st_mode
    except FileNotFoundError:
        mode = stat.S_IFREG
    if not stat.S_ISREG(mode):
        raise StateError(f"{name} is {_kind_of(mode)}, not a regular file: a state file is not saved over it")
    head = _FILE_HEAD.pack(FILE_MAGIC, VERSION, toks.size) + toks.tobytes()
    tmp = _tmp_name(name)
    # O_EXCL: a new file, never an existing one or the target of a symbolic link planted at tmp
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        if fcntl is not None:  # held until the fd closes (or the process dies): remove_stale_tmp skips it
            fcntl.flock(fd, fcntl.LOCK_EX)
        with open(fd, "wb", closefd=False) as f:
            f.write(head)
            f.write(_U32.pack(zlib.crc32(head)))
            f.writelines(parts)
            f.flush()
            os.fsync(fd)  # the data on disk before the name points at it (a full disk may only say so here)
        os.replace(tmp, name)
        _fsync_dir(os.path.dirname(os.path.abspath(name)))
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)
        raise
    finally:
        os.close(fd)


def remove_stale_tmp(directory) -> list[str]:
    """Remove the temporary files save_file left in directory when its process was killed mid-save
    (NAME.HEX16.tmp, no process holding its lock: a save in progress, even in another process, is
    left alone). Returns the names removed.

    Complexity: one pass over the directory; opens only the names that look like temporary files.
    """
    removed = []
    directory = os.fsdecode(directory)
    for entry in os.scandir(directory):
        if not is_tmp_name(entry.name) or not entry.is_file(follow_symlinks=False):
            continue
        try:
            fd = os.open(entry.path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            continue
        try:
            if fcntl is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError:  # a writer holds it: a save in progress
                    continue
            # still the file behind that name (not renamed away and replaced meanwhile)
            if os.fstat(fd).st_ino == os.lstat(entry.path).st_ino:
                os.remove(entry.path)
                removed.append(entry.name)
        except FileNotFoundError:
            pass
        finally:
            os.close(fd)
    return removed


class StateFile:
    """An open state file whose headers were checked against its length (open_file): `tokens`, and
    the blob that starts at the file's position, read by restore. Close it (or use `with`).
    """

    def __init__(self, name: str, f, tokens: list[int], head_bytes: bytes, head: _Head) -> None:
        self.name = name
        self.file = f
        self.tokens = tokens
        self.head_bytes = head_bytes
        self.head = head

    def reader(self, *, kind: int, fingerprint: bytes) -> StateReader:
        """A StateReader that reads the blob from the file (its metadata now, its data on demand)."""
        return _FileReader(self, kind=kind, fingerprint=fingerprint)

    def close(self) -> None:
        self.file.close()

    def __enter__(self) -> "StateFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _read_exactly(sf: StateFile, mv: memoryview) -> None:
    if sf.file.readinto(mv) != mv.nbytes:
        raise StateError(f"{sf.name}: the state file changed while it was read")


def open_file(path) -> StateFile:
    """Open a state file and check what its headers declare before reading any more of it: the
    file's magic and version, its token count against the file's length, the tokens' CRC, then the
    blob's magic, version and lengths, which must end exactly at the end of the file. Reads
    84 + 4 * n_tokens bytes, whatever the file's size (the blob's header before the tokens).

    Raises:
        StateError: path is not a regular file (a directory, a FIFO, a device: refused without
            reading or waiting), not a llamax state file, an unsupported version, a corrupt token
            list (its CRC, or a negative id, which save_file never writes), or lengths that are not
            the file's (truncated, trailing bytes).
        OSError: path cannot be opened (missing, no permission).
    """
    name = os.fsdecode(path)
    mode = os.stat(name).st_mode  # a socket cannot even be opened
    if not stat.S_ISREG(mode):
        raise StateError(f"{name} is {_kind_of(mode)}, not a state file")
    fd = os.open(name, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO swapped in meanwhile: no wait
    f = open(fd, "rb")
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise StateError(f"{name} is {_kind_of(st.st_mode)}, not a state file")
        size = st.st_size
        head = f.read(_FILE_HEAD.size)
        if len(head) < _FILE_HEAD.size:
            raise StateError(f"{name}: truncated state file ({size} bytes)")
        magic, version, n_tokens = _FILE_HEAD.unpack(head)
        if magic != FILE_MAGIC:
            raise StateError(f"{name}: not a llamax state file (magic {magic!r}, expected {FILE_MAGIC!r})")
        if version != VERSION:
            raise StateError(f"{name}: state file version {version} is not supported (this llamax reads {VERSION})")
        at = _FILE_HEAD.size + 4 * n_tokens + 4  # where the blob starts
        if size - at < _HEADER.size:
            raise StateError(f"{name}: truncated state file: {size} bytes cannot hold {n_tokens} tokens and a state")
        f.seek(at)  # the blob's lengths first: a wrong token count or size is refused before the tokens are read
        blob_head = f.read(_HEADER.size)
        if len(blob_head) != _HEADER.size:
            raise StateError(f"{name}: the state file changed while it was read")
        h = _Head(blob_head, size - at, exact=True, where=f"{name}: ")
        f.seek(_FILE_HEAD.size)
        toks = f.read(4 * n_tokens + 4)
        if len(toks) != 4 * n_tokens + 4:
            raise StateError(f"{name}: the state file changed while it was read")
        (crc,) = _U32.unpack_from(toks, 4 * n_tokens)
        if zlib.crc32(memoryview(toks)[:-4], zlib.crc32(head)) != crc:
            raise StateError(f"{name}: corrupt state file: checksum of the header and tokens does not match")
        ids = np.frombuffer(toks, "<i4", count=n_tokens)
        if n_tokens and ids.min() < 0:   # save_file writes ids in [0, 2**31) only
            i = int(np.argmax(ids < 0))
            raise StateError(f"{name}: corrupt state file: token {i} is {int(ids[i])}, outside [0, 2**31)")
        f.seek(at + _HEADER.size)
        return StateFile(name, f, ids.tolist(), blob_head, h)
    except BaseException:
        f.close()
        raise
