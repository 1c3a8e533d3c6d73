"""llamax.model.gguf_reader: the GGUF container, against the gguf package's reader and on broken files.

Oracles: gguf.GGUFReader on the SmolLM2 registry file (every field, type, tensor info, some tensor
bytes) and on small files written here with gguf.GGUFWriter; a deliberately plain reading (struct,
one element at a time) of the Gemma 3 file, whose 262144-token vocabulary takes gguf.GGUFReader
about 12 s (LLAMAX_GGUF_FULL=1 compares it against gguf.GGUFReader too). Malformed files (truncated
at every offset, huge counts and lengths, unknown types, duplicates, bad tensor infos, random
corruption) must raise ModelError, never anything else.
"""
from __future__ import annotations

import re
import struct
from pathlib import Path

import numpy as np
import pytest

from llamax import models
from llamax.errors import ModelError
from llamax.model.gguf_reader import GGUFReader, GGUFValueType, TensorInfo
from llamax.model.tokenizer import Tokenizer, read_gguf_metadata

gguf = pytest.importorskip("gguf")

T = GGUFValueType


@pytest.fixture(scope="module")
def smollm2_path() -> Path:
    return models.path("smollm2-135m")


@pytest.fixture(scope="module")
def gemma_path() -> Path:
    return models.path("gemma3-270m")


@pytest.fixture(scope="module")
def smollm2_gguf_reader(smollm2_path):
    """The gguf package's reader of SmolLM2 (about 2 s), once per module."""
    return gguf.GGUFReader(str(smollm2_path))


@pytest.fixture(scope="module")
def readers(smollm2_path, gemma_path) -> dict[str, GGUFReader]:
    return {"smollm2-135m": GGUFReader(smollm2_path), "gemma3-270m": GGUFReader(gemma_path)}


# ---- comparison with gguf.GGUFReader -----------------------------------------------------------

def _gguf_value(field):
    """(value type, element type, value) of a gguf ReaderField: bytes for strings, numpy for numbers."""
    types = list(field.types)
    if types[0] == gguf.GGUFValueType.ARRAY:
        sub = types[1] if len(types) > 1 else None
        if sub == gguf.GGUFValueType.STRING:
            return T.ARRAY, T.STRING, [bytes(field.parts[i]) for i in field.data]
        parts = [np.asarray(field.parts[i]).reshape(-1) for i in field.data]
        return T.ARRAY, sub, np.concatenate(parts) if parts else np.zeros(0)
    if types[0] == gguf.GGUFValueType.STRING:
        return T.STRING, None, bytes(field.parts[-1])
    return T(int(types[0])), None, field.parts[-1][0]


def assert_same_as_gguf(ours: GGUFReader, theirs, data_of: tuple[str, ...] = ()) -> None:
    """Every field (value and type), tensor info and the bytes of the tensors in data_of agree."""
    keys = [k for k in theirs.fields if not k.startswith("GGUF.")]
    assert list(ours.fields) == keys
    assert ours.version == int(theirs.fields["GGUF.version"].parts[0][0])
    for key in keys:
        vtype, etype, want = _gguf_value(theirs.fields[key])
        got = ours.fields[key]
        assert ours.field_type(key) == (vtype, etype), key
        if etype == T.STRING:
            assert ours.string_array_bytes(key) == want, key
            assert got == [b.decode("utf-8", "surrogateescape") for b in want], key
        elif vtype == T.ARRAY:
            assert isinstance(got, np.ndarray) and got.dtype == want.dtype, (key, got.dtype, want.dtype)
            np.testing.assert_array_equal(got, want, err_msg=key)
        elif vtype == T.STRING:
            assert got == want.decode("utf-8", "surrogateescape"), key
        else:
            assert type(got) is type(want.item()) and got == want.item(), (key, got, want)
    assert ours.alignment == theirs.alignment
    assert ours.data_offset == theirs.data_offset
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a == TensorInfo(b.name, int(b.tensor_type), tuple(int(x) for x in b.shape), int(b.n_elements),
                               int(b.n_bytes), int(b.data_offset)), b.name
        assert a.np_shape == tuple(int(x) for x in reversed(b.shape))
    by_name = {t.name: t for t in theirs.tensors}
    for name in data_of:
        got = ours.tensor_data(name)
        assert got.dtype == np.uint8 and got.shape == (ours.tensor(name).n_bytes,)
        np.testing.assert_array_equal(got, np.asarray(by_name[name].data).view(np.uint8).reshape(-1), err_msg=name)


def test_smollm2_matches_gguf_reader(readers, smollm2_gguf_reader):
    ours = readers["smollm2-135m"]
    names = [t.name for t in ours.tensors]
    assert_same_as_gguf(ours, smollm2_gguf_reader, data_of=(names[0], names[1], names[2], names[-1]))
    assert len(ours.fields["tokenizer.ggml.tokens"]) == 49152
    assert ours.fields["llama.attention.head_count"] == 9
    assert ours.fields["tokenizer.ggml.add_bos_token"] is False
    assert ours.fields["tokenizer.ggml.token_type"].dtype == np.int32
    assert not ours.tensor_data(names[0]).flags.writeable    # a view of the read-only mapping


def test_gemma_matches_gguf_reader(gemma_path):
    """Every field and tensor of Gemma 3 as the gguf package reads it (its reader takes ~12 s here)."""
    ours = GGUFReader(gemma_path)
    names = [t.name for t in ours.tensors]
    assert_same_as_gguf(ours, gguf.GGUFReader(str(gemma_path)), data_of=(names[0], names[2], names[-1]))


# ---- Gemma 3 against a plain reading --------------------------------------------------------------

_PLAIN_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B", 10: "<Q", 11: "<q",
                  12: "<d"}


def _plain_parse(buf) -> tuple[int, dict, list, int]:
    """(version, {key: (type, value)}, [(name, ne, type, offset)], data offset) of the header's bytes,
    read one element at a time."""
    off = 0

    def take(fmt: str):
        nonlocal off
        v = struct.unpack_from(fmt, buf, off)[0]
        off += struct.calcsize(fmt)
        return v

    def string() -> bytes:
        nonlocal off
        n = take("<Q")
        off += n
        return buf[off - n:off]

    def value(t: int):
        if t == 8:
            return string()
        if t == 9:
            et, n = take("<I"), take("<Q")
            return et, [value(et) for _ in range(n)]
        return take(_PLAIN_FORMATS[t])

    assert buf[:4] == b"GGUF"
    off = 4
    version, n_tensors, n_kv = take("<I"), take("<Q"), take("<Q")
    fields = {}
    for _ in range(n_kv):
        key = string().decode()
        t = take("<I")
        fields[key] = (t, value(t))
    tensors = []
    for _ in range(n_tensors):
        name = string().decode()
        ne = [take("<Q") for _ in range(take("<I"))]
        tensors.append((name, ne, take("<I"), take("<Q")))
    align = fields.get("general.alignment", (4, 32))[1]
    return version, fields, tensors, (off + align - 1) // align * align


def test_gemma_matches_plain_reading(readers, gemma_path):
    import mmap

    ours = readers["gemma3-270m"]
    with open(gemma_path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        version, fields, tensors, data_offset = _plain_parse(mm[:ours.data_offset])
        assert ours.version == version and ours.data_offset == data_offset
        assert list(ours.fields) == list(fields)
        for key, (t, v) in fields.items():
            got = ours.fields[key]
            if t == 9:
                et, items = v
                assert ours.field_type(key) == (T.ARRAY, T(et)), key
                if et == 8:
                    assert ours.string_array_bytes(key) == items, key
                    assert got == [b.decode("utf-8", "surrogateescape") for b in items], key
                else:
                    assert got.dtype == np.dtype(_PLAIN_FORMATS[et]) or et == 7, key
                    assert got.tolist() == ([bool(x) for x in items] if et == 7 else items), key
            else:
                assert ours.field_type(key) == (T(t), None), key
                assert got == (v.decode() if t == 8 else bool(v) if t == 7 else v), key
        assert len(ours.tensors) == len(tensors)
        for info, (name, ne, ty, rel) in zip(ours.tensors, tensors):
            block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ty)]
            n = int(np.prod(ne))
            assert info == TensorInfo(name, ty, tuple(ne), n, n // block * size, data_offset + rel), name
        for info in (ours.tensors[0], ours.tensors[1], ours.tensors[-1]):
            assert ours.tensor_data(info.name).tobytes() == mm[info.offset:info.offset + info.n_bytes]
    assert len(ours.fields["tokenizer.ggml.tokens"]) == 262144
    assert {t.ggml_type for t in ours.tensors} >= {0, 12}        # F32 and Q4_K at least


# ---- the tokenizer from this reader -----------------------------------------------------------------

_TOKENIZER_TABLES = ("_texts", "_t2i", "_scores", "_attrs", "_ids", "_eog", "_specials_all", "_specials_plain",
                     "_ranks", "n_unused", "nl", "add_bos", "add_eos", "add_space_prefix")


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_tokenizer_from_reader(name, readers, smollm2_gguf_reader):
    """The tokenizer built from GGUFReader.fields equals the one built from raw bytes (and from gguf's reader)."""
    path = models.path(name)
    ours = Tokenizer.from_gguf(readers[name])
    others = [Tokenizer.from_gguf(read_gguf_metadata(path))]
    if name == "smollm2-135m":
        others += [Tokenizer.from_gguf(path), Tokenizer.from_gguf(smollm2_gguf_reader)]
    text = "Hello, world! 123 <|im_start|> ünïcödé  \n\t 東京 🙂"
    for other in others:
        for attr in _TOKENIZER_TABLES:
            assert getattr(ours, attr) == getattr(other, attr), attr
        assert ours.tokenize(text, parse_special=True) == other.tokenize(text, parse_special=True)
    assert type(ours._scores[0]) is float and type(ours._attrs[0]) is int


# ---- small files written with gguf.GGUFWriter ---------------------------------------------------

_SCALARS = [("t.u8", T.UINT8, 200), ("t.i8", T.INT8, -100), ("t.u16", T.UINT16, 60000), ("t.i16", T.INT16, -30000),
            ("t.u32", T.UINT32, 4_000_000_000), ("t.i32", T.INT32, -2_000_000_000), ("t.f32", T.FLOAT32, 0.1),
            ("t.bool", T.BOOL, True), ("t.u64", T.UINT64, 2**64 - 1), ("t.i64", T.INT64, -2**63),
            ("t.f64", T.FLOAT64, 0.1), ("t.str", T.STRING, "héllo wörld ✓")]
_ARRAYS = [("a.u8", T.UINT8, [0, 1, 255]), ("a.i8", T.INT8, [-128, 127]), ("a.u16", T.UINT16, [1, 65535]),
           ("a.i16", T.INT16, [-5, 5]), ("a.u32", T.UINT32, [7]), ("a.i32", T.INT32, [-1, 0, 1, 2]),
           ("a.f32", T.FLOAT32, [0.5, -1.25, 3e38]), ("a.bool", T.BOOL, [True, False, True]),
           ("a.u64", T.UINT64, [2**64 - 1, 0]), ("a.i64", T.INT64, [-2**63, 2**63 - 1]),
           ("a.f64", T.FLOAT64, [1e300, -0.0]),
           ("a.str", T.STRING, ["a", "", "ünï", "東京", "🙂", b"\xff\xfe bad utf-8", "x" * 300])]


def _write_small(path: Path, alignment: int | None = None) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    for key, t, v in _SCALARS:
        w.add_key_value(key, v, gguf.GGUFValueType(int(t)))
    for key, t, v in _ARRAYS:
        w.add_key_value(key, v, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType(int(t)))
    if alignment is not None:
        w.add_custom_alignment(alignment)
    rng = np.random.default_rng(0)
    w.add_tensor("f32.2d", rng.standard_normal((3, 5)).astype(np.float32))
    w.add_tensor("f16.1d", rng.standard_normal(7).astype(np.float16))
    w.add_tensor("q8_0", rng.integers(0, 256, (2, 2 * 34), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("f32.3d", rng.standard_normal((2, 3, 4)).astype(np.float32))
    w.add_tensor("q4_k", rng.integers(0, 256, (1, 144), dtype=np.uint8), raw_dtype=gguf.GGMLQuantizationType.Q4_K)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module", params=[None, 64], ids=["align32", "align64"])
def small(request, tmp_path_factory) -> Path:
    return _write_small(tmp_path_factory.mktemp("gguf") / "small.gguf", request.param)


def test_small_file(small):
    ours = GGUFReader(small)
    assert_same_as_gguf(ours, gguf.GGUFReader(str(small)), data_of=tuple(t.name for t in ours.tensors))
    for key, t, v in _SCALARS:
        assert ours.field_type(key) == (t, None)
        got = ours.fields[key]
        want = float(np.float32(v)) if t == T.FLOAT32 else v
        assert got == want and type(got) is type(want), key
    for key, t, v in _ARRAYS:
        assert ours.field_type(key) == (T.ARRAY, t)
        if t == T.STRING:
            raw = [s if isinstance(s, bytes) else s.encode() for s in v]
            assert ours.string_array_bytes(key) == raw
            assert ours.fields[key] == [s.decode("utf-8", "surrogateescape") for s in raw]
        else:
            got = ours.fields[key]
            assert got.dtype == {T.BOOL: np.bool_}.get(t, np.dtype(_PLAIN_FORMATS[int(t)]).newbyteorder("="))
            np.testing.assert_array_equal(got, np.array(v, dtype=got.dtype))
    assert ours.fields["a.str"][5] == "\udcff\udcfe bad utf-8"          # invalid bytes kept as surrogates
    info = ours.tensor("q8_0")
    assert (info.ggml_type, info.shape, info.n_elements, info.n_bytes) == (8, (64, 2), 128, 2 * 2 * 34)
    assert ours.tensor("f32.3d").shape == (4, 3, 2) and ours.tensor("f32.3d").np_shape == (2, 3, 4)
    assert ours.tensor("q4_k").type_name == "q4_k"
    assert ours.alignment == ours.fields.get("general.alignment", 32)
    assert all(t.offset % ours.alignment == 0 for t in ours.tensors)
    with pytest.raises(ModelError, match="not an array of strings"):
        ours.string_array_bytes("a.f32")
    with pytest.raises(KeyError):
        ours.string_array_bytes("no.such.key")
    with pytest.raises(KeyError):
        ours.tensor_data("no.such.tensor")


def test_truncation_at_every_offset(tmp_path):
    """Every prefix shorter than the end of the last tensor's data is refused, the longer ones are read:
    cut at every offset of the header and around every tensor's start and end."""
    small = _write_small(tmp_path / "small.gguf")
    data = small.read_bytes()
    full = GGUFReader(small)
    end = max(t.offset + t.n_bytes for t in full.tensors)
    cuts = set(range(full.data_offset + 1))
    for t in full.tensors:
        cuts.update(x + d for x in (t.offset, t.offset + t.n_bytes) for d in (-1, 0, 1))
    p = tmp_path / "cut.gguf"
    for cut in sorted(c for c in cuts if c < end):
        p.write_bytes(data[:cut])
        with pytest.raises(ModelError, match=r"truncated|past the end|beyond|cannot fit") as e:
            GGUFReader(p)
        assert str(p) in str(e.value)
    for cut in range(end, len(data) + 1):
        p.write_bytes(data[:cut])
        assert GGUFReader(p).tensors == full.tensors


def test_random_corruption_raises_only_model_error(small, tmp_path):
    """Random bytes written over the header: the file is read or refused with ModelError, nothing else."""
    import random

    data = bytearray(small.read_bytes())
    header_end = GGUFReader(small).data_offset
    rng = random.Random(1234)
    p = tmp_path / "bad.gguf"
    n_read, n = 0, 800
    for _ in range(n):
        bad = bytearray(data)
        at = rng.randrange(4, header_end)
        width = rng.choice([1, 1, 2, 4, 8])
        bad[at:at + width] = rng.randbytes(width)
        if rng.random() < 0.3:          # a length or count made huge
            bad[at:at + 8] = struct.pack("<Q", rng.choice([2**63, 2**64 - 1, 2**32, len(data)]))
        p.write_bytes(bytes(bad[:len(data)]))
        try:
            r = GGUFReader(p)
        except ModelError:
            continue
        n_read += 1
        for t in r.tensors:
            assert r.tensor_data(t.name).shape == (t.n_bytes,)
            assert t.offset + t.n_bytes <= len(data)
    assert 0 < n_read < n


# ---- malformed files built byte by byte ------------------------------------------------------------

def _u32(v: int) -> bytes:
    return struct.pack("<I", v)


def _u64(v: int) -> bytes:
    return struct.pack("<Q", v)


def _s(v: str | bytes) -> bytes:
    b = v.encode() if isinstance(v, str) else v
    return _u64(len(b)) + b


def _kv(key: str, vtype: int, payload: bytes) -> bytes:
    return _s(key) + _u32(vtype) + payload


def _ti(name: str, ne: tuple[int, ...], ggml_type: int = 0, offset: int = 0) -> bytes:
    return _s(name) + _u32(len(ne)) + b"".join(_u64(d) for d in ne) + _u32(ggml_type) + _u64(offset)


def _file(kvs=(), tis=(), data=b"", version=3, magic=b"GGUF", n_kv=None, n_tensors=None, align=32) -> bytes:
    head = magic + _u32(version) + _u64(len(tis) if n_tensors is None else n_tensors)
    head += _u64(len(kvs) if n_kv is None else n_kv) + b"".join(kvs) + b"".join(tis)
    return head + b"\0" * (-len(head) % align) + data


def _read(tmp_path: Path, content: bytes) -> GGUFReader:
    p = tmp_path / "x.gguf"
    p.write_bytes(content)
    return GGUFReader(p)


def test_built_files_read(tmp_path):
    """The builder's valid files: v2 and v3, empty arrays, no tensors, 0-d and empty tensors, bool 2."""
    kvs = [_kv("e.f32", 9, _u32(6) + _u64(0)), _kv("e.str", 9, _u32(8) + _u64(0)), _kv("b", 7, b"\x02"),
           _kv("s", 8, _s(b"\xe2\x82")), _kv("strs", 9, _u32(8) + _u64(3) + _s("") + _s("ab") + _s(""))]
    tis = [_ti("scalar", (), 0, 0), _ti("empty", (0, 3), 12, 32), _ti("v", (8,), 0, 32)]
    for version in (2, 3):
        r = _read(tmp_path, _file(kvs, tis, data=bytes(64), version=version))
        assert r.version == version
        assert r.fields["e.f32"].dtype == np.float32 and r.fields["e.f32"].shape == (0,)
        assert r.fields["e.str"] == [] and r.string_array_bytes("e.str") == []
        assert r.fields["b"] is True
        assert r.fields["s"] == "\udce2\udc82"
        assert r.fields["strs"] == ["", "ab", ""] and r.string_array_bytes("strs") == [b"", b"ab", b""]
        assert [(t.shape, t.n_elements, t.n_bytes) for t in r.tensors] == [((), 1, 4), ((0, 3), 0, 0), ((8,), 8, 32)]
        assert r.tensor_data("v").shape == (32,)
    r = _read(tmp_path, _file())
    assert (r.fields, r.tensors, r.data_offset) == ({}, [], 32)


_BIG = 2**64 - 1
_F32_ARRAY = _u32(6) + _u64(2) + struct.pack("<2f", 1, 2)
_MALFORMED = {
    "bad magic": (dict(magic=b"GGML"), "not a GGUF file"),
    "version 1": (dict(version=1), "version 1 is no longer supported"),
    "version 0": (dict(version=0), "version 0 is not supported"),
    "version 4": (dict(version=4), "version 4 is not supported"),
    "big-endian": (dict(version=3 << 24), "big-endian"),
    "huge kv count": (dict(n_kv=_BIG), "cannot fit"),
    "huge tensor count": (dict(n_tensors=2**63), "cannot fit"),
    "kv count past the file": (dict(kvs=[_kv("a", 4, _u32(1))], n_kv=2, align=1), "cannot fit"),
    "huge key length": (dict(kvs=[_u64(_BIG) + b"abc"]), "the key of key/value pair 0"),
    "key length past the end": (dict(kvs=[_u64(1000) + b"abc"]), "truncated"),
    "huge string value": (dict(kvs=[_kv("s", 8, _u64(2**62) + b"x")]), "the value of 's'"),
    "unknown value type": (dict(kvs=[_kv("k", 13, _u32(0))]), "key 'k': unknown value type 13"),
    "unknown value type 2^32-1": (dict(kvs=[_kv("k", 2**32 - 1, _u32(0))]), "unknown value type 4294967295"),
    "unknown element type": (dict(kvs=[_kv("k", 9, _u32(13) + _u64(1) + _u32(0))]), "unknown element type 13"),
    "array of arrays": (dict(kvs=[_kv("k", 9, _u32(9) + _u64(1) + _u32(4) + _u64(0))]), "arrays of arrays"),
    "huge numeric array": (dict(kvs=[_kv("k", 9, _u32(6) + _u64(2**61) + b"1234")]), "array 'k'"),
    "huge numeric array 2^64-1": (dict(kvs=[_kv("k", 9, _u32(11) + _u64(_BIG))]), "array 'k'"),
    "numeric array past the end": (dict(kvs=[_kv("k", 9, _u32(4) + _u64(100) + _u32(1))]), "truncated"),
    "huge string array": (dict(kvs=[_kv("k", 9, _u32(8) + _u64(2**60) + _s("a"))]), "strings cannot fit"),
    "huge string in an array": (dict(kvs=[_kv("k", 9, _u32(8) + _u64(3) + _s("a") + _u64(_BIG) + b"b" * 40)]),
                                "string 1 of 3 in array 'k'"),
    "string in an array past the end": (dict(kvs=[_kv("k", 9, _u32(8) + _u64(2) + _s("a") + _u64(50))]),
                                        "string 1 of 2 in array 'k'"),
    "string array cut in a length": (dict(kvs=[_kv("k", 9, _u32(8) + _u64(2) + _s("abcdefghij") + b"12345")],
                                          align=1), "truncated file: the length of string 1 of 2 in array 'k'"),
    "duplicate key": (dict(kvs=[_kv("k", 4, _u32(1)), _kv("k", 4, _u32(2))]), "duplicate key 'k'"),
    "alignment 48": (dict(kvs=[_kv("general.alignment", 4, _u32(48))]), "not a power of 2"),
    "alignment 0": (dict(kvs=[_kv("general.alignment", 4, _u32(0))]), "not a power of 2"),
    "alignment u64": (dict(kvs=[_kv("general.alignment", 10, _u64(32))]), "expected UINT32"),
    "duplicate tensor": (dict(tis=[_ti("w", (4,)), _ti("w", (4,), 0, 32)], data=bytes(64)), "duplicate tensor name 'w'"),
    "5 dimensions": (dict(tis=[_ti("w", (1, 1, 1, 1, 1))], data=bytes(32)), "5 dimensions"),
    "huge n_dims": (dict(tis=[_s("w") + _u32(2**32 - 1) + _u64(1)]), "dimensions"),
    "negative dimension": (dict(tis=[_ti("w", (2**63, 1))], data=bytes(32)), "negative"),
    "unknown ggml type 4": (dict(tis=[_ti("w", (32,), 4)], data=bytes(32)), "unknown ggml type 4"),
    "ggml type IQ2_XXS": (dict(tis=[_ti("w", (256,), 16)], data=bytes(256)), "unknown ggml type 16"),
    "ggml type 2^32-1": (dict(tis=[_ti("w", (32,), 2**32 - 1)], data=bytes(32)), "unknown ggml type"),
    "partial block": (dict(tis=[_ti("w", (33, 2), 8)], data=bytes(96)), "not a multiple of the block size 32"),
    "unaligned offset": (dict(tis=[_ti("w", (4,), 0, 4)], data=bytes(64)), "not a multiple of the alignment"),
    "data past the end": (dict(tis=[_ti("w", (4, 4), 0, 0)], data=bytes(32)), "beyond the end of the file"),
    "huge offset": (dict(tis=[_ti("w", (4,), 0, 2**64 - 32)], data=bytes(32)), "beyond the end of the file"),
    "huge tensor": (dict(tis=[_ti("w", (2**40, 2**40, 2**40, 2**40), 0)], data=bytes(32)), "beyond the end"),
    "tensor name too long": (dict(tis=[_ti("w" * 64, (4,))], data=bytes(32)), "too long"),
    "tensor info cut": (dict(tis=[_s("w") + _u32(2) + _u64(4)]), "truncated"),
    "tensor data missing": (dict(kvs=[_kv("a", 9, _F32_ARRAY)], tis=[_ti("w", (4,), 0, 32)]), "beyond the end"),
}


@pytest.mark.parametrize("case", list(_MALFORMED))
def test_malformed(case, tmp_path):
    kwargs, message = _MALFORMED[case]
    with pytest.raises(ModelError, match=re.escape(message)):
        _read(tmp_path, _file(**kwargs))


@pytest.mark.parametrize("content", [b"", b"GGU", b"GGUF" + _u32(3) + _u64(0)], ids=["empty", "3 bytes", "20 bytes"])
def test_tiny_files(content, tmp_path):
    with pytest.raises(ModelError, match="truncated GGUF header"):
        _read(tmp_path, content)


def test_unopenable(tmp_path):
    with pytest.raises(ModelError, match="cannot open"):
        GGUFReader(tmp_path / "missing.gguf")
    with pytest.raises(ModelError, match="cannot open"):
        GGUFReader(tmp_path)
