"""A reader of the GGUF container (ggml's docs/gguf.md), in bulk: no Python object per array element.

Layout (little-endian, versions 2 and 3)::

    "GGUF"  u32 version  u64 n_tensors  u64 n_kv
    n_kv times:       string key, u32 value type, value
    n_tensors times:  string name, u32 n_dims, u64 ne[n_dims], u32 ggml type, u64 offset
    padding to general.alignment (32 by default), then the data section; a tensor's data starts
    at data_offset + its offset

    string = u64 length + that many bytes (UTF-8, not NUL-terminated)
    value  = a scalar (u8 i8 u16 i16 u32 i32 u64 i64 f32 f64 bool), a string, or an array:
             u32 element type, u64 count, the elements (scalars or strings, not arrays)

The file is memory-mapped once. Numeric arrays are read with one ``np.frombuffer`` each; an array
of strings takes one Python loop over its length prefixes (the offsets form a chain: each depends
on the previous length; about 0.15 us a string) and one decode per string, so Gemma 3's GGUF
(262144-token vocabulary) opens in about 0.14 s where gguf.GGUFReader (one numpy view per part)
takes about 13 s. Tensor data are zero-copy uint8 views of the mapping.

Every malformed input raises `ModelError` naming the offending key, tensor or offset: a truncated
file, a length or count beyond the file, an unknown value or ggml type, tensor data past the end of
the file, a duplicate key or tensor name. Nothing is allocated for a claimed size before it is
checked against the file's size. The checks on tensor infos are llama.cpp's (gguf.cpp): at most 4
dimensions, names shorter than 64 bytes, rows a whole number of blocks, offsets aligned.

Strings (keys, values, tensor names) are decoded as UTF-8 with ``errors="surrogateescape"``: valid
UTF-8 gives the usual text, and an invalid byte becomes a lone surrogate, so nothing is lost
(``s.encode("utf-8", "surrogateescape")`` gives the file's bytes back). `GGUFReader.string_array_bytes`
gives an array's raw bytes directly.
"""
from __future__ import annotations

import enum
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Union

import numpy as np

from llamax._native import quants
from llamax.errors import ModelError

__all__ = ["GGUFValueType", "GGUFReader", "TensorInfo", "FieldValue", "DEFAULT_ALIGNMENT"]

GGUF_MAGIC = b"GGUF"
#: the data section's alignment when general.alignment is absent (GGUF_DEFAULT_ALIGNMENT)
DEFAULT_ALIGNMENT = 32
#: llama.cpp's limits on tensor infos (GGML_MAX_DIMS, GGML_MAX_NAME)
MAX_DIMS = 4
MAX_NAME = 64
SUPPORTED_VERSIONS = (2, 3)


class GGUFValueType(enum.IntEnum):
    """The type of a metadata value (gguf_type); the numbers are the file's."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


_T = GGUFValueType
#: scalar type -> (struct format, little-endian numpy dtype of an array of them)
_SCALARS: dict[int, tuple[struct.Struct, np.dtype]] = {
    t: (struct.Struct("<" + fmt), np.dtype(dt)) for t, fmt, dt in (
        (_T.UINT8, "B", "<u1"), (_T.INT8, "b", "<i1"), (_T.UINT16, "H", "<u2"), (_T.INT16, "h", "<i2"),
        (_T.UINT32, "I", "<u4"), (_T.INT32, "i", "<i4"), (_T.FLOAT32, "f", "<f4"), (_T.BOOL, "B", "<u1"),
        (_T.UINT64, "Q", "<u8"), (_T.INT64, "q", "<i8"), (_T.FLOAT64, "d", "<f8"))
}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_I64_MAX = 2**63 - 1
# the fewest bytes a key/value pair and a tensor info can take (to check the counts up front)
_MIN_KV_BYTES = 8 + 4 + 1
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8

#: what `GGUFReader.fields` holds: a scalar, a numeric array (its GGUF element dtype) or a list of strings
FieldValue = Union[int, float, bool, str, np.ndarray, list]


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """One tensor's entry in the GGUF header.

    Attributes:
        name: the tensor's name.
        ggml_type: its ggml type number (0 F32, 1 F16, 2 Q4_0, 12 Q4_K, ...).
        shape: its dimensions in ggml's order (ne[0], the row length, first).
        n_elements: the product of `shape`.
        n_bytes: the size of its data (whole blocks of its type).
        offset: where its data start, from the beginning of the file.
    """

    name: str
    ggml_type: int
    shape: tuple[int, ...]
    n_elements: int
    n_bytes: int
    offset: int

    @property
    def np_shape(self) -> tuple[int, ...]:
        """The shape in numpy's order (ggml's ne reversed: rows last)."""
        return self.shape[::-1]

    @property
    def type_name(self) -> str:
        """llama.cpp's lower-case name of the ggml type ("q4_k", "f32", ...)."""
        return quants.type_name(self.ggml_type)


class GGUFReader:
    """A GGUF file's metadata and tensor infos, and zero-copy views of its tensor data.

    Attributes:
        path: the file.
        version: the GGUF version (2 or 3).
        alignment: the data section's alignment (general.alignment, default 32).
        data_offset: where the data section starts in the file.
        file_size: the file's size in bytes.
        fields: every metadata key -> its value, in file order: a Python int / float / bool / str
            for a scalar, a numpy array of the element's dtype for a numeric array (bool arrays
            as np.bool_), a list[str] for an array of strings.
        tensors: every tensor's `TensorInfo`, in file order.

    The file stays mapped while the reader or any array from `tensor_data` is alive.

    Raises:
        ModelError: the file cannot be opened or mapped, or is not a well-formed GGUF (see the
            module's docstring); the message names the field, tensor or offset.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                self.file_size = os.fstat(f.fileno()).st_size
                if self.file_size < 24:
                    raise ModelError(f"{self.path}: truncated GGUF header: the file has {self.file_size} "
                                     "bytes, the header alone takes 24")
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:          # ValueError: a file mmap refuses
            raise ModelError(f"cannot open GGUF {self.path}: {e}") from e
        self._buf = np.frombuffer(self._mm, dtype=np.uint8)
        self.fields: dict[str, FieldValue] = {}
        self._types: dict[str, tuple[GGUFValueType, GGUFValueType | None]] = {}
        self._string_arrays: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self.tensors: list[TensorInfo] = []
        self._tensor_index: dict[str, TensorInfo] = {}
        self._parse()

    # ---- public API ----------------------------------------------------------------------------
    def field_type(self, key: str) -> tuple[GGUFValueType, GGUFValueType | None]:
        """(value type, element type) of a metadata key; the element type is None unless an ARRAY.

        Raises:
            KeyError: no such key.
        """
        return self._types[key]

    def string_array_bytes(self, key: str) -> list[bytes]:
        """The raw bytes of every string of an array-of-strings field (e.g. tokenizer.ggml.tokens).

        Raises:
            KeyError: no such key.
            ModelError: the field is not an array of strings.
        """
        if key not in self._string_arrays:
            if key not in self._types:
                raise KeyError(key)
            raise self._error(f"{key!r} is not an array of strings (it is {self._describe_type(key)})")
        starts, lens = self._string_arrays[key]
        mm = self._mm
        return [mm[a:a + n] for a, n in zip(starts.tolist(), lens.tolist())]

    def tensor(self, name: str) -> TensorInfo:
        """The info of the tensor called name.

        Raises:
            KeyError: no such tensor.
        """
        return self._tensor_index[name]

    def tensor_data(self, name: str) -> np.ndarray:
        """The tensor's bytes: a read-only uint8 view [n_bytes] of the mapped file (no copy).

        Raises:
            KeyError: no such tensor.
        """
        t = self._tensor_index[name]
        return self._buf[t.offset:t.offset + t.n_bytes]

    def release(self, name: str) -> None:
        """Tell the kernel the tensor's pages are not needed (a copy of them is kept elsewhere): the
        whole pages inside its bytes leave the resident set (MADV_DONTNEED on the read-only file
        mapping; a later read maps them in again from the file, so nothing can break).

        Raises:
            KeyError: no such tensor.
        """
        t = self._tensor_index[name]
        if not hasattr(self._mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
            return
        page = mmap.PAGESIZE
        a = -(-t.offset // page) * page
        b = (t.offset + t.n_bytes) // page * page
        if b > a:
            self._mm.madvise(mmap.MADV_DONTNEED, a, b - a)

    def __contains__(self, key: object) -> bool:
        return key in self.fields

    def __repr__(self) -> str:
        return (f"GGUFReader({str(self.path)!r}, version={self.version}, {len(self.fields)} fields, "
                f"{len(self.tensors)} tensors)")

    # ---- parsing -------------------------------------------------------------------------------
    def _error(self, msg: str) -> ModelError:
        return ModelError(f"{self.path}: {msg}")

    def _need(self, off: int, n: int, what: str) -> None:
        if n > self.file_size - off:
            raise self._error(f"truncated file: {what} at offset {off} needs {n} bytes, "
                              f"only {max(self.file_size - off, 0)} remain (file size {self.file_size})")

    def _u32(self, off: int, what: str) -> int:
        self._need(off, 4, what)
        return _U32.unpack_from(self._mm, off)[0]

    def _u64(self, off: int, what: str) -> int:
        self._need(off, 8, what)
        return _U64.unpack_from(self._mm, off)[0]

    def _str(self, off: int, what: str) -> tuple[str, int]:
        n = self._u64(off, f"the length of {what}")
        self._need(off + 8, n, f"{what} (a string of {n} bytes)")
        return self._mm[off + 8:off + 8 + n].decode("utf-8", "surrogateescape"), off + 8 + n

    def _parse(self) -> None:
        mm = self._mm
        if mm[:4] != GGUF_MAGIC:
            raise self._error(f"not a GGUF file (magic {bytes(mm[:4])!r}, expected {GGUF_MAGIC!r})")
        version = _U32.unpack_from(mm, 4)[0]
        if version & 0xFFFF == 0 and version != 0:
            raise self._error(f"GGUF version field {version:#010x}: a big-endian GGUF, "
                              "only little-endian files are supported")
        if version == 1:
            raise self._error("GGUF version 1 is no longer supported (supported: 2, 3)")
        if version not in SUPPORTED_VERSIONS:
            raise self._error(f"GGUF version {version} is not supported (supported: 2, 3)")
        self.version = version
        n_tensors, n_kv = struct.unpack_from("<QQ", mm, 8)
        room = self.file_size - 24
        if n_kv > room // _MIN_KV_BYTES or n_tensors > room // _MIN_TENSOR_INFO_BYTES \
                or n_kv * _MIN_KV_BYTES + n_tensors * _MIN_TENSOR_INFO_BYTES > room:
            raise self._error(f"{n_kv} key/value pairs and {n_tensors} tensor infos (header at offset 8) "
                              f"cannot fit in a file of {self.file_size} bytes")

        off = 24
        for i in range(n_kv):
            key_off = off
            key, off = self._str(off, f"the key of key/value pair {i}")
            if key in self._types:
                raise self._error(f"duplicate key {key!r} (key/value pair {i}, at offset {key_off})")
            vtype = self._u32(off, f"the value type of {key!r}")
            off += 4
            off = self._read_value(key, vtype, off)

        self.alignment = DEFAULT_ALIGNMENT
        if "general.alignment" in self._types:
            if self._types["general.alignment"] != (_T.UINT32, None):
                raise self._error(f"general.alignment has type {self._describe_type('general.alignment')}, "
                                  "expected UINT32")
            a = self.fields["general.alignment"]
            assert isinstance(a, int)  # a UINT32 scalar, checked above
            if a == 0 or a & (a - 1):
                raise self._error(f"general.alignment {a} is not a power of 2")
            self.alignment = int(a)

        infos = []
        names: dict[str, int] = {}
        for i in range(n_tensors):
            info_off = off
            name, off = self._str(off, f"the name of tensor {i}")
            if len(name.encode("utf-8", "surrogateescape")) >= MAX_NAME:
                raise self._error(f"tensor {i} at offset {info_off}: name {name[:80]!r} is too long "
                                  f"({len(name)} >= {MAX_NAME} bytes)")
            if name in names:
                raise self._error(f"duplicate tensor name {name!r} (tensors {names[name]} and {i}, "
                                  f"at offset {info_off})")
            names[name] = i
            n_dims = self._u32(off, f"n_dims of tensor {name!r}")
            if n_dims > MAX_DIMS:
                raise self._error(f"tensor {name!r} at offset {info_off} has {n_dims} dimensions "
                                  f"(at most {MAX_DIMS})")
            off += 4
            self._need(off, 8 * n_dims, f"the dimensions of tensor {name!r}")
            ne = struct.unpack_from(f"<{n_dims}Q", mm, off)
            off += 8 * n_dims
            for j, d in enumerate(ne):
                if d > _I64_MAX:
                    raise self._error(f"tensor {name!r}: dimension {j} is {d} (negative as int64)")
            ggml_type = self._u32(off, f"the ggml type of tensor {name!r}")
            rel = self._u64(off + 4, f"the data offset of tensor {name!r}")
            off += 12
            infos.append((name, ne, ggml_type, rel, info_off))

        self.data_offset = -(-off // self.alignment) * self.alignment
        for name, ne, ggml_type, rel, info_off in infos:
            self._add_tensor(name, ne, ggml_type, rel, info_off)

    def _read_value(self, key: str, vtype: int, off: int) -> int:
        """Read the value of key (type vtype) at off into the tables; the offset past it."""
        if vtype in _SCALARS:
            st, _ = _SCALARS[vtype]
            self._need(off, st.size, f"the value of {key!r}")
            v = st.unpack_from(self._mm, off)[0]
            self.fields[key] = v != 0 if vtype == _T.BOOL else v
            self._types[key] = (_T(vtype), None)
            return off + st.size
        if vtype == _T.STRING:
            self.fields[key], off = self._str(off, f"the value of {key!r}")
            self._types[key] = (_T.STRING, None)
            return off
        if vtype != _T.ARRAY:
            raise self._error(f"key {key!r}: unknown value type {vtype} at offset {off - 4}")
        etype = self._u32(off, f"the element type of array {key!r}")
        n = self._u64(off + 4, f"the length of array {key!r}")
        off += 12
        if etype in _SCALARS:
            _, dt = _SCALARS[etype]
            self._need(off, n * dt.itemsize, f"array {key!r} ({n} elements of {_T(etype).name})")
            raw = self._buf[off:off + n * dt.itemsize].view(dt)
            self.fields[key] = raw != 0 if etype == _T.BOOL else raw.astype(dt.newbyteorder("="))
            self._types[key] = (_T.ARRAY, _T(etype))
            return off + n * dt.itemsize
        if etype == _T.STRING:
            return self._read_string_array(key, n, off)
        if etype == _T.ARRAY:
            raise self._error(f"key {key!r} at offset {off - 12}: arrays of arrays are not supported")
        raise self._error(f"array {key!r}: unknown element type {etype} at offset {off - 12}")

    def _read_string_array(self, key: str, n: int, off: int) -> int:
        """An array of n strings at off: its (starts, lengths), decoded list; the offset past it."""
        if n > (self.file_size - off) // 8:
            raise self._error(f"array {key!r} at offset {off - 12}: {n} strings cannot fit in the "
                              f"{self.file_size - off} bytes left (each takes at least 8)")
        # Each offset depends on the previous length, so this walk is sequential; it touches only
        # the length prefixes (the bytes are sliced and decoded below).
        mm, unpack, size = self._mm, _U64.unpack_from, self.file_size
        heads: list[int] = []
        push = heads.append
        p = off
        try:
            for _ in range(n):
                push(p)
                p += 8 + unpack(mm, p)[0]
        except (struct.error, OverflowError):
            p = size + 1                       # a length prefix lies past the end: reported below
        if p > size:
            self._string_array_error(key, heads, n)
        pos = np.array(heads, dtype=np.int64)
        starts = pos + 8
        lens = np.diff(pos, append=p) - 8
        self._string_arrays[key] = (starts, lens)
        self.fields[key] = [mm[a:b].decode("utf-8", "surrogateescape")
                            for a, b in zip(starts.tolist(), (starts + lens).tolist())]
        self._types[key] = (_T.ARRAY, _T.STRING)
        return p

    def _string_array_error(self, key: str, heads: list[int], n: int) -> None:
        # heads[-1] is where the last length prefix was (or was to be) read
        size = self.file_size
        i, p = len(heads) - 1, heads[-1]
        if p > size:                            # the previous string's length overran the file
            i, p = i - 1, heads[-2]
        elif p + 8 > size:
            raise self._error(f"truncated file: the length of string {i} of {n} in array {key!r} "
                              f"at offset {p} runs past the end of the file ({size} bytes)")
        length = _U64.unpack_from(self._mm, p)[0]
        raise self._error(f"string {i} of {n} in array {key!r} at offset {p}: its {length} bytes "
                          f"run past the end of the file ({size} bytes)")

    def _add_tensor(self, name: str, ne: tuple[int, ...], ggml_type: int, rel: int, info_off: int) -> None:
        try:
            bs, bb = quants.block_size(ggml_type), quants.block_bytes(ggml_type)
        except ValueError:
            raise self._error(f"tensor {name!r} (info at offset {info_off}) has unknown ggml type {ggml_type}, "
                              f"known: {sorted(quants.TYPE_NAMES)}") from None
        n_elements = 1
        for d in ne:
            n_elements *= d
        row = ne[0] if ne else 1
        if row % bs:
            raise self._error(f"tensor {name!r} of type {quants.type_name(ggml_type)} has {row} elements per "
                              f"row, not a multiple of the block size {bs}")
        n_bytes = n_elements // bs * bb
        if rel % self.alignment:
            raise self._error(f"tensor {name!r}: data offset {rel} is not a multiple of the alignment "
                              f"{self.alignment}")
        start = self.data_offset + rel
        if start > self.file_size or n_bytes > self.file_size - start:
            raise self._error(f"tensor {name!r}: its data ({n_bytes} bytes at offset {start}) lie beyond the "
                              f"end of the file ({self.file_size} bytes)")
        info = TensorInfo(name, int(ggml_type), tuple(int(d) for d in ne), n_elements, n_bytes, start)
        self.tensors.append(info)
        self._tensor_index[name] = info

    def _describe_type(self, key: str) -> str:
        t, e = self._types[key]
        return f"ARRAY of {e.name}" if e is not None else t.name
