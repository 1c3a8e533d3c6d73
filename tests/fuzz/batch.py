"""Fuzz target (c): batch validation (Batch, the context's BatchAllocator, the memory's reservation).

A case builds a Batch from fuzzed tokens, positions, sequence ids and logits flags, each of any
shape and type (lists with ids outside the vocabulary or int32, negative or duplicated sequence ids,
ragged lists, numpy arrays of every dtype, 2-D arrays, scalars, strings, None), and decodes it in a
context of the tiny llama model (unified cache, or one stream per sequence) whose cache holds some
sequences already, or plans it on a standalone KVCache.

Contract checked (API.md, BatchError / NoKVSlotError): Batch(...) succeeds or raises BatchError;
decode / plan succeeds or raises BatchError or NoKVSlotError, and then the cache is unchanged (its
cells and the bytes of its state, K/V included, as before). A decode that succeeds gives one finite
row of logits per token that asked for one.
"""
from __future__ import annotations

import functools

import numpy as np

from llamax import state as S
from llamax.batch import Batch
from llamax.context import Context
from llamax.errors import BatchError, NoKVSlotError
from llamax.memory import KVCache
from tests.fuzz.common import Draw, Finding, tiny_model

N_SEQ = 4
DTYPES = (np.int8, np.uint8, np.int16, np.int32, np.uint32, np.int64, np.uint64, np.float32, np.float64,
          np.bool_, object)


@functools.lru_cache(maxsize=None)
def setup():
    m = tiny_model()
    return {"unified": Context(m, n_ctx=256, n_seq_max=N_SEQ, n_batch=64, n_ubatch=16, n_threads=1),
            "streams": Context(m, n_ctx=256, n_seq_max=N_SEQ, n_batch=64, n_ubatch=16, kv_unified=False,
                               n_threads=1),
            "kv": KVCache(1, 1, 8, 48, n_seq_max=N_SEQ, n_threads=1)}


EDGES = (-1, -2, N_SEQ, 255, 256, 2**31 - 1, 2**31, -(2**31), 2**63, 2**64, -(2**70), 2**30)


def _int(d: Draw, n_vocab: int, kind: str) -> int:
    return d.below(n_vocab if kind == "token" else 40 if kind == "pos" else N_SEQ)


def _ints(d: Draw, n: int, n_vocab: int, kind: str) -> list:
    """n valid values, then (half the time) one of them made a boundary value."""
    vals = [_int(d, n_vocab, kind) for _ in range(n)]
    if n and d.chance(1, 2):
        vals[d.below(n)] = d.pick(EDGES + (n_vocab, n_vocab - 1, 0))
    return vals


def _value(d: Draw, n: int, n_vocab: int, kind: str):
    """A fuzzed per-token argument: mostly a list of n, sometimes anything."""
    k = d.below(16)
    if k < 9:
        return _ints(d, n, n_vocab, kind)
    if k == 9:
        return _ints(d, d.below(n + 3), n_vocab, kind)                           # another length
    if k == 10:
        dt = d.pick(DTYPES)
        vals = _ints(d, n, n_vocab, kind)
        try:
            return np.array(vals, dtype=dt)
        except (OverflowError, ValueError):
            return np.array(vals, dtype=object)
    if k == 11:
        return np.zeros((n, 1 + d.below(3)), dtype=d.pick((np.int32, np.int64, np.float32)))
    if k == 12:
        return d.pick(EDGES + (0, 1))                                            # a scalar
    if k == 13:                                                                  # ragged / nested
        return [_ints(d, d.below(3), n_vocab, kind) for _ in range(n)]
    if k == 14:
        return d.pick(("abc", b"\x00\x01", 1.5, float("nan"), [1.5] * n, [None] * n, [True] * n, {}, {1: 2},
                       [[1, 2], 3], [], (), [str(i) for i in range(n)], [2**64] * n, np.float64(2.0)))
    if kind == "seq":
        return [d.pick(([0], [1, 2], [], [0, 0], [3, 1], [N_SEQ], [-1], [0, 255], [2], [1, 3])) for _ in range(n)]
    return None


def _positions(d: Draw, mem, n: int, seq_ids):
    """Positions near the valid ones: each sequence continuing where the memory ends (or not)."""
    seqs = [s[0] if isinstance(s, list) and s else s for s in seq_ids] if isinstance(seq_ids, list) else [0] * n
    nxt, out = {}, []
    shift = d.pick((0, 0, 0, 1, -1, 2, -5, 100))
    for s in seqs:
        s = s if type(s) is int and 0 <= s < N_SEQ else 0
        p = nxt.get(s, mem.seq_pos_max(s) + 1 + shift)
        out.append(p)
        nxt[s] = p + 1
    if out and d.chance(1, 3):
        out[d.below(len(out))] += d.pick((-1, 1, -(2**31), 2**31 - 1, -3, 7))
    return out


def make_batch(d: Draw, n_vocab: int, mem):
    n = d.below(70)
    tokens = _value(d, n, n_vocab, "token") if d.chance(1, 2) else [d.below(n_vocab) for _ in range(n)]
    if tokens is None:
        tokens = [d.below(n_vocab) for _ in range(n)]
    seq_ids = _value(d, n, n_vocab, "seq") if d.chance(2, 3) else None
    k = d.below(4)
    pos = None if k < 2 else _positions(d, mem, n, seq_ids) if k == 2 else _value(d, n, n_vocab, "pos")
    logits = None
    if d.chance(1, 2):
        logits = [bool(d.below(2)) for _ in range(n)] if d.below(3) else _value(d, n, n_vocab, "logit")
    return Batch(tokens, pos=pos, seq_ids=seq_ids, logits=logits)


def _prefill(d: Draw, ctx: Context) -> None:
    mem = ctx.memory
    if mem.n_used > 160 or d.chance(1, 4):
        mem.clear()
    for s in range(N_SEQ):
        if d.chance(1, 3):
            try:
                ctx.decode(Batch.one([d.below(300) for _ in range(1 + d.below(20))], seq_id=s))
            except NoKVSlotError:
                pass
    if d.chance(1, 6) and mem.seq_pos_max(0) > 4:
        mem.seq_rm(0, 1, 3)                    # a hole in a sequence's positions


def _snapshot(mem):
    return mem.cells(), S.get_data(mem)


def one_input(data: bytes) -> None:
    d = Draw(data)
    targets = setup()
    name = d.pick(("unified", "unified", "streams", "kv"))
    n_vocab = tiny_model().n_vocab
    if name == "kv":
        mem = targets["kv"]
        if mem.n_used > 32 or d.chance(1, 4):
            mem.clear()
    else:
        ctx = targets[name]
        mem = ctx.memory
        _prefill(d, ctx)
    try:
        batch = make_batch(d, n_vocab, mem)
    except BatchError:
        return
    before = _snapshot(mem)
    try:
        if name == "kv":
            plan = mem.plan(batch, n_ubatch=1 + d.below(16))
            for ub in plan:
                z = np.zeros((ub.n_tokens, 1, 8), np.float32)
                mem.store(0, ub, z, z)
        else:
            ctx.decode(batch)
    except (BatchError, NoKVSlotError) as e:
        after = _snapshot(mem)
        if after[0] != before[0]:
            raise Finding(f"{type(e).__name__} ({e}) changed the cache's cells") from None
        if after[1] != before[1]:
            raise Finding(f"{type(e).__name__} ({e}) changed the cache's state bytes") from None
        return
    if name != "kv":
        want = int(np.count_nonzero(batch.logits)) if batch.logits is not None else 1
        got = ctx.get_logits()
        if got.shape != (want, n_vocab) or not np.isfinite(got).all():
            raise Finding(f"decode of {len(batch)} tokens ({want} outputs) gave logits {got.shape}")
