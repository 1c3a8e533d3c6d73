# cython: language_level=3
"""Bulk byte moves for state I/O (csrc/buffers.h): the rows of a state copied, and checksummed, in
one native call with the GIL released.

A 2048-token SmolLM2 sequence state is 47 MB in 60 runs of rows (K and V of 30 layers).
gather_xor copies them into a blob (a BytesBuilder's new bytes object, or a caller's buffer) and
returns the checksum of what it wrote, in one pass over the bytes with n_threads threads;
copy_rows copies a blob's runs into the cache; xor64 is the checksum a reader verifies before
anything is installed. Parts and rows are 2-D uint8 arrays whose rows are contiguous ([rows, n],
any row stride): a K run, or the V columns of a run in a transposed V.
"""
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from libc.stdint cimport int64_t, uint8_t, uint64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy

# the declarations of csrc/buffers.h come from buffers.pxd (same module name)

from llamax.threads import resolve_n_threads  # the one place n_threads is resolved


cdef class BytesBuilder:
    """A new bytes object of `size` bytes, not yet initialized, filled by write() and gather_xor()
    and handed out by take(): nothing else sees it before, and the builder is empty after.
    Every byte must be written before take().

    Raises:
        ValueError: size < 0.
        MemoryError: no room for it.
    """
    cdef object _out             # the bytes, or None once taken
    cdef readonly Py_ssize_t size

    def __cinit__(self, Py_ssize_t size):
        if size < 0:
            raise ValueError(f"size must be >= 0, got {size}")
        self._out = PyBytes_FromStringAndSize(NULL, size)
        self.size = size

    cdef uint8_t *_ptr(self) except NULL:
        if self._out is None:
            raise ValueError("the bytes were taken")
        return <uint8_t *> PyBytes_AS_STRING(self._out)

    def write(self, Py_ssize_t at, data) -> None:
        """Copy a C-contiguous buffer's bytes to [at, at + len).

        Raises:
            ValueError: the bytes do not fit in [0, size), or the bytes were taken.
        """
        cdef uint8_t *p = self._ptr()
        cdef const uint8_t[::1] d = memoryview(data).cast("B")  # IN
        cdef Py_ssize_t n = d.shape[0]
        if at < 0 or n > self.size - at:
            raise ValueError(f"{n} bytes at {at} do not fit in {self.size}")
        if n:
            memcpy(p + at, &d[0], n)

    def take(self) -> bytes:
        """The bytes (once).

        Raises:
            ValueError: they were taken already.
        """
        self._ptr()
        out, self._out = self._out, None
        return out


cdef object _gather_xor(object out, object offsets, list parts, int nth, bint ref):
    cdef uint8_t *base = NULL
    cdef Py_ssize_t size, i, n = len(parts)
    cdef uint8_t[::1] w
    if isinstance(out, BytesBuilder):
        base = (<BytesBuilder> out)._ptr()
        size = (<BytesBuilder> out).size
    else:
        w = memoryview(out).cast("B")  # OUT
        size = w.shape[0]
        if size:
            base = &w[0]
    if len(offsets) != n:
        raise ValueError(f"{len(offsets)} offsets for {n} parts")
    cdef lx_move *moves = <lx_move *> malloc(max(n, 1) * sizeof(lx_move))
    if moves == NULL:
        raise MemoryError()
    cdef const uint8_t[:, :] a
    cdef list keep = []  # the parts' buffers, held until the copy is done
    cdef int64_t m = 0
    cdef Py_ssize_t at
    cdef uint64_t x
    try:
        for i in range(n):
            a = parts[i]  # IN
            if a.shape[0] == 0 or a.shape[1] == 0:
                continue
            if a.shape[1] != 1 and a.strides[1] != 1:  # a 1-byte column is contiguous whatever its stride
                raise ValueError(f"part {i}: its rows are not contiguous (strides {a.strides[0]}, {a.strides[1]})")
            if a.shape[0] > 1 and a.strides[0] < 0:
                raise ValueError(f"part {i}: its rows are in reverse order")
            at = offsets[i]
            if at < 0 or a.shape[0] * a.shape[1] > size - at:
                raise ValueError(f"part {i}: {a.shape[0] * a.shape[1]} bytes at {at} do not fit in {size}")
            keep.append(a)
            moves[m].dst = base + at
            moves[m].src = &a[0, 0]
            moves[m].n = <size_t> a.shape[1]
            moves[m].rows = <size_t> a.shape[0]
            moves[m].dst_stride = <size_t> a.shape[1]
            moves[m].src_stride = <size_t> a.strides[0] if a.shape[0] > 1 else 0
            moves[m].at = <size_t> at
            m += 1
        with nogil:
            x = lx_move_xor_ref(moves, m) if ref else lx_move_xor(moves, m, nth)
        return x
    finally:
        free(moves)


def gather_xor(out, offsets, parts, n_threads=None) -> int:
    """Copy each part (a 2-D uint8 array with contiguous rows) to out at offsets[i], its rows back to
    back, and return the XOR of the little-endian uint64 words of out's bytes, counted from out's
    start, that the parts wrote (bytes no part wrote count as zeros).

    Args:
        out: a BytesBuilder, or a writable C-contiguous buffer.
        offsets: a byte offset into out per part; no two parts may overlap.
        parts: [rows, n] uint8 arrays (any row stride).
    Raises:
        ValueError: a part that does not fit, or whose rows are not contiguous.
    """
    return _gather_xor(out, offsets, list(parts), resolve_n_threads(n_threads), False)


def gather_xor_ref(out, offsets, parts) -> int:
    """Oracle of gather_xor: one memcpy per row on the caller's thread, the checksum byte by byte."""
    return _gather_xor(out, offsets, list(parts), 1, True)


cdef object _copy_rows(list dsts, list srcs, int nth, bint ref):
    cdef Py_ssize_t i, n = len(dsts)
    if len(srcs) != n:
        raise ValueError(f"{len(srcs)} sources for {n} destinations")
    cdef lx_move *moves = <lx_move *> malloc(max(n, 1) * sizeof(lx_move))
    if moves == NULL:
        raise MemoryError()
    cdef uint8_t[:, :] d
    cdef const uint8_t[:, :] s
    cdef list keep = []
    cdef int64_t m = 0
    try:
        for i in range(n):
            d = dsts[i]  # OUT
            s = srcs[i]  # IN
            if d.shape[0] != s.shape[0] or d.shape[1] != s.shape[1]:
                raise ValueError(f"copy {i}: {s.shape[0]}x{s.shape[1]} bytes into {d.shape[0]}x{d.shape[1]}")
            if d.shape[0] == 0 or d.shape[1] == 0:
                continue
            if d.shape[1] != 1 and (d.strides[1] != 1 or s.strides[1] != 1):
                raise ValueError(f"copy {i}: rows are not contiguous")
            if d.shape[0] > 1 and (d.strides[0] < 0 or s.strides[0] < 0):
                raise ValueError(f"copy {i}: rows are in reverse order")
            keep.append((d, s))
            moves[m].dst = &d[0, 0]
            moves[m].src = &s[0, 0]
            moves[m].n = <size_t> d.shape[1]
            moves[m].rows = <size_t> d.shape[0]
            moves[m].dst_stride = <size_t> d.strides[0] if d.shape[0] > 1 else 0
            moves[m].src_stride = <size_t> s.strides[0] if d.shape[0] > 1 else 0
            moves[m].at = 0
            m += 1
        with nogil:
            if ref:
                lx_move_xor_ref(moves, m)
            else:
                lx_move_xor(moves, m, nth)
    finally:
        free(moves)


def copy_rows(dsts, srcs, n_threads=None) -> None:
    """np.copyto(dsts[i], srcs[i]) for every i, in one native call: 2-D uint8 arrays of equal
    shapes with contiguous rows (any row stride). No destination may overlap another or a source.

    Raises:
        ValueError: shapes that differ, rows that are not contiguous, a read-only destination.
    """
    _copy_rows(list(dsts), list(srcs), resolve_n_threads(n_threads), False)


def copy_rows_ref(dsts, srcs) -> None:
    """Oracle of copy_rows: one memcpy per row on the caller's thread."""
    _copy_rows(list(dsts), list(srcs), 1, True)


cdef object _xor64(object buf, int nth, bint ref):
    cdef const uint8_t[::1] d = memoryview(buf).cast("B")  # IN
    cdef size_t n = <size_t> d.shape[0]
    cdef uint64_t x = 0
    if n:
        with nogil:
            x = lx_xor64_ref(&d[0], n) if ref else lx_xor64(&d[0], n, nth)
    return x


def xor64(buf, n_threads=None) -> int:
    """The XOR of the little-endian uint64 words of a C-contiguous buffer, zero-padded to a
    multiple of 8 bytes (the state format's data checksum)."""
    return _xor64(buf, resolve_n_threads(n_threads), False)


def xor64_ref(buf) -> int:
    """Oracle of xor64: byte by byte."""
    return _xor64(buf, 1, True)
