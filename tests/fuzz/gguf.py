"""Fuzz target (b): the GGUF loader (GGUFReader, read_hparams, the tokenizer's metadata, the tensor
checks and the weights: all of Model.load).

The seed is the tiny llama model of tiny_gguf.py (37 KB, written with gguf.GGUFWriter); a case
mutates it in one of three ways:
  * a field: one of the header's counts, a string or array length, a value or element type, a
    tensor's n_dims, dimension, ggml type or offset set to a boundary value (2**63, 2**40, 2**64-1,
    one past the real value, ...);
  * the structure, rebuilt by a writer here: one metadata value replaced by a value of another type
    (a string for an int, a negative, an array, a huge array length), a key dropped or doubled, a
    tensor's shape, type, offset or name changed, a tensor dropped or doubled;
  * blind: byte edits, cuts and splices anywhere in the header and metadata, or the fuzzer's bytes
    as the whole file.
Then Model.load(file) must return a Model or raise ModelError, nothing else, and never allocate
much more than the file (Python's and numpy's allocations traced: a file claiming a 2**40-byte
string or array must be refused before anything of that size is allocated).
"""
from __future__ import annotations

import functools
import struct
import tracemalloc

from llamax.errors import ModelError
from tests.fuzz.common import Draw, Finding, mutate_bytes, overwrite, peek, scratch, tiny_model_path

#: the most a case may allocate (traced; the weight slab's block made 1 MB during the case): the
#: tiny model's load takes about 3 MB
MAX_ALLOC = 16 << 20

_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B", 10: "<Q", 11: "<q", 12: "<d"}


def _walk(buf: bytes):
    """The seed's layout: (fields, kvs, tensors, data_at). fields: (offset, struct format, kind) of
    every count, length and type; kvs: (key, vtype, value bytes); tensors: (name, dims, type, offset)."""
    fields = [(8, "<Q", "n_tensors"), (16, "<Q", "n_kv"), (4, "<I", "version")]
    n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
    off, kvs, tensors = 24, [], []

    def string(off, kind):
        fields.append((off, "<Q", kind))
        n = struct.unpack_from("<Q", buf, off)[0]
        return buf[off + 8:off + 8 + n], off + 8 + n

    def value(vt, off):
        if vt in _SCALAR:
            return off + struct.calcsize(_SCALAR[vt])
        if vt == 8:
            return string(off, "string length")[1]
        fields.append((off, "<I", "element type"))
        fields.append((off + 4, "<Q", "array length"))
        et, n = struct.unpack_from("<IQ", buf, off)
        off += 12
        for _ in range(n):
            off = value(et, off)
        return off

    for _ in range(n_kv):
        key, off = string(off, "key length")
        fields.append((off, "<I", "value type"))
        vt = struct.unpack_from("<I", buf, off)[0]
        start = off + 4
        off = value(vt, start)
        kvs.append((key, vt, buf[start:off]))
    for _ in range(n_tensors):
        name, off = string(off, "tensor name length")
        fields.append((off, "<I", "n_dims"))
        nd = struct.unpack_from("<I", buf, off)[0]
        dims = list(struct.unpack_from(f"<{nd}Q", buf, off + 4))
        for j in range(nd):
            fields.append((off + 4 + 8 * j, "<Q", "dimension"))
        off += 4 + 8 * nd
        fields.append((off, "<I", "ggml type"))
        fields.append((off + 4, "<Q", "tensor offset"))
        gt, rel = struct.unpack_from("<IQ", buf, off)
        off += 12
        tensors.append((name, dims, gt, rel))
    data_at = -(-off // 32) * 32
    return fields, kvs, tensors, data_at


@functools.lru_cache(maxsize=None)
def seed():
    buf = tiny_model_path().read_bytes()
    return (buf,) + _walk(buf)


def _s(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


def build(kvs, tensors, data: bytes, n_kv=None, n_tensors=None) -> bytes:
    """A GGUF v3 file of these parts (the counts can lie)."""
    out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(tensors) if n_tensors is None else n_tensors,
                                          len(kvs) if n_kv is None else n_kv))
    for key, vt, raw in kvs:
        out += _s(key) + struct.pack("<I", vt) + raw
    for name, dims, gt, rel in tensors:
        out += _s(name) + struct.pack("<I", len(dims) % 2**32) + struct.pack(f"<{len(dims)}Q", *(x % 2**64 for x in dims))
        out += struct.pack("<IQ", gt % 2**32, rel % 2**64)
    out += bytes(-len(out) % 32)
    return bytes(out + data)


def random_value(d: Draw) -> tuple[int, bytes]:
    """(value type, encoded value): any type, boundary numbers, odd strings, lying array lengths."""
    vt = d.pick((0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 9, 10, 11, 12, 13, 2**31))
    if vt in _SCALAR:
        fmt = _SCALAR[vt]
        n = struct.calcsize(fmt)
        if fmt in ("<f", "<d"):
            return vt, struct.pack(fmt, d.pick((0.0, -1.0, 1e-30, 1e30, float("inf"), float("nan"), 2.0**63)))
        return vt, d.bytes(n).ljust(n, b"\xff")
    if vt == 8:
        b = d.bytes(d.below(12))
        return vt, (_s(b) if d.below(4) else struct.pack("<Q", d.u64_value(len(b))) + b)
    if vt == 9:
        et = d.pick((0, 4, 5, 6, 7, 8, 9, 10, 12, 99))
        n = d.below(6)
        if et == 8:
            body = b"".join(_s(d.bytes(d.below(6))) for _ in range(n))
        elif et in _SCALAR:
            body = d.bytes(n * struct.calcsize(_SCALAR[et])).ljust(n * struct.calcsize(_SCALAR[et]), b"\1")
        else:
            body = b""
        claimed = n if d.below(3) else d.u64_value(n)
        return vt, struct.pack("<IQ", et, claimed) + body
    return vt, d.bytes(d.below(8))


def mutate_structure(d: Draw) -> bytes:
    buf, fields, kvs, tensors, data_at = seed()
    kvs, tensors, data = list(kvs), list(tensors), buf[data_at:]
    n_kv = n_tensors = None
    for _ in range(1 + d.below(3)):
        op = d.below(10)
        if op <= 3 and kvs:                       # a value of another type / another value
            i = d.below(len(kvs))
            key, _, _ = kvs[i]
            kvs[i] = (key, *random_value(d))
        elif op == 4 and kvs:                     # a key dropped, doubled, or renamed
            i = d.below(len(kvs))
            k = d.below(3)
            if k == 0:
                del kvs[i]
            elif k == 1:
                kvs.insert(d.below(len(kvs) + 1), kvs[i])
            else:
                kvs[i] = (kvs[i][0] + d.bytes(d.below(4)), kvs[i][1], kvs[i][2])
        elif op == 5:                             # a new key of the architecture
            key = d.pick((b"llama.block_count", b"llama.embedding_length", b"llama.attention.head_count",
                          b"llama.attention.head_count_kv", b"llama.rope.dimension_count",
                          b"llama.attention.key_length", b"llama.rope.scaling.type", b"general.alignment",
                          b"tokenizer.ggml.bos_token_id", b"tokenizer.ggml.add_bos_token", b"tokenizer.ggml.pre",
                          b"tokenizer.ggml.model", b"tokenizer.ggml.merges", b"general.architecture",
                          b"tokenizer.chat_template", b"llama.rope.scaling.factor"))
            kvs = [kv for kv in kvs if kv[0] != key] + [(key, *random_value(d))]
        elif op <= 7 and tensors:                 # a tensor's info
            i = d.below(len(tensors))
            name, dims, gt, rel = tensors[i]
            dims = list(dims)
            k = d.below(5)
            if k == 0 and dims:
                dims[d.below(len(dims))] = d.u64_value(dims[0])
            elif k == 1:
                dims = dims + [d.pick((1, 2, 2**32))] if d.below(2) else dims[:-1]
            elif k == 2:
                gt = d.u32_value(gt) if d.below(2) else d.pick((0, 1, 2, 3, 6, 7, 8, 10, 12, 14, 30, 39, 40))
            elif k == 3:
                rel = d.u64_value(rel) if d.below(2) else rel + 32 * (d.below(5) - 2)
            else:
                name = d.pick((name + b"x", b"blk.7.attn_q.weight", b"", b"x" * 70, b"\xff\xfe"))
            tensors[i] = (name, dims, gt, rel)
        elif op == 8 and tensors:                 # a tensor dropped or doubled
            i = d.below(len(tensors))
            if d.below(2):
                del tensors[i]
            else:
                tensors.append(tensors[i])
        else:                                     # lying counts
            if d.below(2):
                n_kv = d.u64_value(len(kvs))
            else:
                n_tensors = d.u64_value(len(tensors))
    if d.chance(1, 4):
        data = data[:d.below(len(data) + 1)]
    return build(kvs, tensors, data, n_kv, n_tensors)


def mutate_field(d: Draw) -> bytes:
    buf, fields, kvs, tensors, data_at = seed()
    b = bytearray(buf)
    for _ in range(1 + d.below(2)):
        at, fmt, kind = d.pick(fields)
        old = peek(b, at, fmt)
        v = d.u32_value(old) if fmt == "<I" else d.u64_value(old)
        overwrite(b, at, fmt, v % (1 << (8 * struct.calcsize(fmt))))
    if d.chance(1, 4):
        del b[d.below(len(b) + 1):]
    return bytes(b)


def make_file(d: Draw) -> bytes:
    how = d.below(8)
    if how <= 2:
        return mutate_field(d)
    if how <= 5:
        return mutate_structure(d)
    if how == 6:
        buf, _, _, _, data_at = seed()
        b = bytearray(buf)
        mutate_bytes(d, b, 0, data_at, max_ops=6)
        return bytes(b)
    return d.rest()


def load(raw: bytes) -> None:
    """Model.load of a file holding raw: a Model or ModelError, within MAX_ALLOC."""
    from llamax.model import Model
    from llamax.model.linear import WeightSlab

    path = scratch() / "case.gguf"
    path.write_bytes(raw)
    tracing = tracemalloc.is_tracing()
    if not tracing:
        tracemalloc.start()
    tracemalloc.reset_peak()
    block, WeightSlab.BLOCK = WeightSlab.BLOCK, 1 << 20   # a 64 MB block (untouched) per model otherwise
    try:
        Model.load(path, n_threads=1)
    except ModelError:
        pass
    finally:
        WeightSlab.BLOCK = block
        _, peak = tracemalloc.get_traced_memory()
        if not tracing:
            tracemalloc.stop()
    if peak > MAX_ALLOC:
        raise Finding(f"Model.load of a {len(raw)}-byte file allocated {peak} bytes")


def one_input(data: bytes) -> None:
    load(make_file(Draw(data)))
