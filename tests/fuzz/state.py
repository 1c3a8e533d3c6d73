"""Fuzz target (a): the state reader, on bytes and on files.

A case takes one valid blob of a real context (the tiny llama model: whole state or one sequence,
f16 cache or v_trans with an f32 K) or of a standalone KVCacheISWA, or the fuzzer's bytes as they
are, mutates it (metadata words set to boundary values, blind byte edits, cuts, splices), and in
most cases recomputes the CRC and the data XOR afterwards so that the parser behind the checksums
is reached. Then it restores the bytes (state_set_data / state_seq_set_data / state.set_data) or a
state file holding them (state_load_file / state_seq_load_file).

Contract checked (API.md, StateError): the restore succeeds or raises StateError, nothing else; after
a StateError the destination is empty (a whole restore: no used cell and no logits; a sequence
restore: the destination sequence has no cell and every other sequence's cells are as before);
after a success the context still decodes.
"""
from __future__ import annotations

import functools
import struct
import zlib

import numpy as np

from llamax import state as S
from llamax.batch import Batch
from llamax.context import Context
from llamax.errors import BatchError, NoKVSlotError, StateError
from llamax.memory import KVCacheISWA
from tests.helpers import without
from tests.fuzz.common import Draw, Finding, mutate_bytes, overwrite, peek, scratch, tiny_model

N_SEQ = 3


def _fill(ctx: Context) -> None:
    ctx.decode(Batch.one(list(range(3, 40)), seq_id=0))
    ctx.memory.seq_cp(0, 1, 0, 20)
    ctx.decode(Batch.one([270, 280, 290, 300], seq_id=1))
    ctx.decode(Batch(list(range(50, 60)), seq_ids=[2] * 10, logits=[True, False] * 5))


class _Ctx:
    def __init__(self, **kw) -> None:
        self.ctx = Context(tiny_model(), n_ctx=256, n_seq_max=N_SEQ, n_threads=1, **kw)
        _fill(self.ctx)
        self.whole = self.ctx.state_get_data()
        self.seqs = [self.ctx.state_seq_get_data(s) for s in range(N_SEQ)]
        self.cells = self.ctx.memory.cells()


class _Iswa:
    def __init__(self) -> None:
        mem = KVCacheISWA(3, 2, 8, 64, swa_layers=[0, 2], n_swa=8, n_seq_max=2, n_ubatch=16, n_threads=1)
        rng = np.random.default_rng(1)
        for batch in (Batch.one(list(range(30)), seq_id=0), Batch.one(list(range(12)), seq_id=1)):
            for ub in mem.plan(batch, n_ubatch=16):
                for il in range(3):
                    k = rng.standard_normal((ub.n_tokens, 2, 8)).astype(np.float32)
                    mem.store(il, ub, k, -k)
        self.mem = mem
        self.whole = S.get_data(mem, fingerprint="iswa")
        self.seqs = [S.get_data(mem, s, fingerprint="iswa") for s in range(2)]
        self.cells = mem.cells()


@functools.lru_cache(maxsize=None)
def setup():
    return {"f16": _Ctx(), "vtrans": _Ctx(flash_attn=False, type_k="f32"), "iswa": _Iswa()}


def fix_checksums(buf: bytearray) -> None:
    """Recompute the CRC and the data XOR of the blob at the start of buf from its own header."""
    if len(buf) < 64 or buf[:8] != S.MAGIC:
        return
    meta_len, data_len = struct.unpack_from("<QQ", buf, 32)
    data_at = 64 + meta_len + (-meta_len % 8)
    if data_at + data_len > len(buf):
        return
    x = S._xor64(np.frombuffer(bytes(buf[data_at:data_at + data_len]), np.uint8))
    struct.pack_into("<Q", buf, 48, x)
    mv = memoryview(buf)
    c = zlib.crc32(mv[64:data_at], zlib.crc32(mv[60:64], zlib.crc32(mv[:56])))
    mv.release()
    struct.pack_into("<I", buf, 56, c)


def file_bytes(blob: bytes, tokens: list[int]) -> bytearray:
    """A state file holding blob (the format of state.save_file)."""
    head = S._FILE_HEAD.pack(S.FILE_MAGIC, S.VERSION, len(tokens)) + np.asarray(tokens, "<i4").tobytes()
    return bytearray(head + struct.pack("<I", zlib.crc32(head)) + blob)


def fix_file_crc(buf: bytearray) -> None:
    if len(buf) < 16 or buf[:8] != S.FILE_MAGIC:
        return
    (n,) = struct.unpack_from("<I", buf, 12)
    end = 16 + 4 * n
    if end + 4 <= len(buf):
        struct.pack_into("<I", buf, end, zlib.crc32(bytes(buf[:end])))


def mutate_blob(d: Draw, buf: bytearray) -> None:
    """Mutations aimed at the blob's header, metadata and data; checksums fixed in 3 cases of 4."""
    meta_len = struct.unpack_from("<Q", buf, 32)[0] if len(buf) >= 64 else 0
    data_at = 64 + meta_len + (-meta_len % 8)
    for _ in range(1 + d.below(3)):
        op = d.below(8)
        if op <= 3 and data_at > 64:       # a metadata word: a count, a type, a position, a seq bitset
            at = 64 + 4 * d.below((data_at - 64) // 4)
            if d.chance(1, 3):
                overwrite(buf, at & ~7, "<Q", d.u64_value(peek(buf, at & ~7, "<Q")))
            else:
                overwrite(buf, at, "<I", d.u32_value(peek(buf, at, "<I")))
        elif op == 4:                      # a header field
            at = d.pick((8, 12, 16, 32, 40, 48, 56, 60))
            fmt = "<Q" if at in (32, 40, 48) else "<I"
            overwrite(buf, at, fmt, d.u64_value(peek(buf, at, fmt)) % (1 << (8 * struct.calcsize(fmt))))
        elif op == 5:                      # a cut
            del buf[d.below(len(buf) + 1):]
        elif op == 6:                      # bytes after the blob
            buf += d.bytes(d.below(32)) or b"\0" * 8
        else:
            mutate_bytes(d, buf, 0, len(buf), max_ops=3)
    if d.below(4):
        fix_checksums(buf)


def _check_empty(mem, dest: int, before) -> None:
    if dest < 0:
        if mem.n_used != 0:
            raise Finding(f"a failed whole restore left {mem.n_used} cells used")
        return
    if mem.seq_pos_max(dest) != -1:
        raise Finding(f"a failed restore left sequence {dest} with cells (max pos {mem.seq_pos_max(dest)})")
    if without(mem.cells(), dest) != without(before, dest):  # the cells as the other sequences see them
        raise Finding(f"a failed restore of sequence {dest} changed the other sequences' cells")


def one_input(data: bytes) -> None:
    d = Draw(data)
    targets = setup()
    name = d.pick(("f16", "vtrans", "iswa"))
    t = targets[name]
    mem = t.mem if name == "iswa" else t.ctx.memory
    n_seq = 2 if name == "iswa" else N_SEQ
    dest = d.below(n_seq + 1) - 1              # -1: whole restore
    src = d.below(n_seq)
    how = d.below(8)
    if how == 7:                               # the fuzzer's own bytes
        buf = bytearray(d.rest())
        if d.chance(1, 2):
            fix_checksums(buf)
    else:
        buf = bytearray(t.whole if dest < 0 else t.seqs[src])
        if d.chance(1, 2) and dest >= 0 and name != "iswa":     # another sequence's blob, or the whole one
            buf = bytearray(d.pick((t.whole, *t.seqs)))
        mutate_blob(d, buf)
    as_file = name != "iswa" and d.chance(1, 3)
    if as_file:
        fbuf = file_bytes(bytes(buf), [d.uint(2) for _ in range(d.below(5))]) if how != 7 else buf
        if how != 7 and d.chance(1, 3):
            mutate_bytes(d, fbuf, 0, min(len(fbuf), 40), max_ops=2)
            if d.chance(1, 2):
                fix_file_crc(fbuf)
        path = scratch() / f"state-{name}.bin"
        path.write_bytes(bytes(fbuf))

    before = mem.cells()
    try:
        if name == "iswa":
            n = S.set_data(mem, bytes(buf), dest, fingerprint="iswa")
        elif as_file:
            toks = t.ctx.state_load_file(path) if dest < 0 else t.ctx.state_seq_load_file(path, dest)
            if not isinstance(toks, list) or not all(isinstance(x, int) and 0 <= x < 2**31 for x in toks):
                raise Finding(f"state_load_file returned {toks!r}")
            n = len(fbuf)
        elif dest < 0:
            n = t.ctx.state_set_data(bytes(buf))
        else:
            n = t.ctx.state_seq_set_data(bytes(buf), dest)
    except StateError:
        _check_empty(mem, dest, before)
        if dest < 0 and name != "iswa" and t.ctx.get_logits().shape[0] != 0:
            raise Finding("a failed whole restore left logits")
    else:
        if not 0 < n <= len(buf if not as_file else fbuf):
            raise Finding(f"restore returned {n} bytes read for a blob of {len(buf)}")
        if mem.n_used > mem.n_cells:
            raise Finding(f"{mem.n_used} cells used of {mem.n_cells}")
        if name != "iswa" and d.chance(1, 4):   # the restored cache still works
            try:
                t.ctx.decode(Batch.one([5, 6], seq_id=max(dest, 0)))
            except (BatchError, NoKVSlotError):
                pass
    finally:
        # back to the seed state for the next case
        if name == "iswa":
            S.set_data(mem, t.whole, fingerprint="iswa")
        else:
            t.ctx.state_set_data(t.whole)
