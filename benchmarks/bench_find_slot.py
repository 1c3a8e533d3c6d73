"""find_slot + apply_ubatch per token on a 32768-cell cache, half full with 4 sequences.

Measures, per single-token ubatch (4 sequences round robin), in one run:
  native       KVCells.find_slot + apply_ubatch (C slot finder through its thin wrapper)
  native+plan  KVCache.plan + apply (batch allocator, validation, prepare/rollback, apply)
  numpy        the same search and bookkeeping written with numpy (first usable cell from the
               head, position/sequence arrays updated, per-sequence min/max by scanning)
Prints medians (of --runs repetitions of --steps tokens) in microseconds per token.
"""
import argparse
import statistics
import time
from types import SimpleNamespace

import numpy as np
from llamax._native.cells import KVCells

from llamax import Batch, KVCache

N_CELLS, N_SEQ = 32768, 4


def ub_of(pos, seq):
    bits = np.zeros((1, 4), np.uint64)
    bits[0, 0] = np.uint64(1) << np.uint64(seq)
    return SimpleNamespace(pos=np.array([pos], np.int32), seq_bits=bits, seq_id_unq=np.array([seq], np.int32),
                           token=np.array([1], np.int32), seq_id=np.array([seq], np.int32), n_tokens=1)


def half_fill_native(kv: KVCells):
    per = N_CELLS // 2 // N_SEQ
    for s in range(N_SEQ):
        for p0 in range(0, per, 512):
            n = min(512, per - p0)
            bits = np.zeros((n, 4), np.uint64)
            bits[:, 0] = np.uint64(1) << np.uint64(s)
            ub = SimpleNamespace(pos=np.arange(p0, p0 + n, dtype=np.int32), seq_bits=bits,
                                 seq_id_unq=np.array([s], np.int32), token=None)
            kv.apply_ubatch(ub, *kv.find_slot(ub, False))


def bench_native(steps):
    kv = KVCells(N_CELLS, 1, N_SEQ)
    half_fill_native(kv)
    nxt = [kv.seq_pos_max(s) + 1 for s in range(N_SEQ)]
    ubs = [ub_of(nxt[i % N_SEQ] + i // N_SEQ, i % N_SEQ) for i in range(steps)]
    t0 = time.perf_counter()
    for ub in ubs:
        strm, idxs = kv.find_slot(ub, False)
        kv.apply_ubatch(ub, strm, idxs)
    return (time.perf_counter() - t0) / steps


def bench_plan(steps):
    kv = KVCache(1, 1, 8, N_CELLS, n_seq_max=N_SEQ, type_k="f16")
    half_fill_native(kv.meta)
    t0 = time.perf_counter()
    for i in range(steps):
        for ub in kv.plan(Batch([1], seq_ids=[i % N_SEQ])):
            pass
    return (time.perf_counter() - t0) / steps


class NumpyCells:
    """The baseline: the same bookkeeping with numpy arrays."""

    def __init__(self):
        self.pos = np.full(N_CELLS, -1, np.int32)
        self.seq = np.zeros(N_CELLS, np.uint64)
        self.head = 0

    def find_slot(self, n):
        used = int(np.count_nonzero(self.pos >= 0))
        head = 0 if self.head > used + 2 * n else self.head
        free = np.flatnonzero(self.pos[head:] < 0)
        if free.size == 0:
            free = np.flatnonzero(self.pos[:head] < 0) - head
        return head + int(free[0])

    def apply(self, idx, pos, seq):
        self.pos[idx] = pos
        self.seq[idx] = np.uint64(1) << np.uint64(seq)
        self.head = idx + 1
        mine = self.pos[(self.seq >> np.uint64(seq)) & np.uint64(1) == 1]
        return int(mine.min()), int(mine.max())  # seq_pos_min/max, as the cache keeps them


def bench_numpy(steps):
    c = NumpyCells()
    per = N_CELLS // 2 // N_SEQ
    for s in range(N_SEQ):
        c.pos[s * per:(s + 1) * per] = np.arange(per)
        c.seq[s * per:(s + 1) * per] = np.uint64(1) << np.uint64(s)
    c.head = N_SEQ * per
    t0 = time.perf_counter()
    for i in range(steps):
        idx = c.find_slot(1)
        c.apply(idx, per + i // N_SEQ, i % N_SEQ)
    return (time.perf_counter() - t0) / steps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--runs", type=int, default=7)
    a = ap.parse_args()
    res = {"native": [], "native+plan": [], "numpy": []}
    for _ in range(a.runs):
        res["native"].append(bench_native(a.steps))
        res["native+plan"].append(bench_plan(a.steps))
        res["numpy"].append(bench_numpy(a.steps // 4))
    base = statistics.median(res["numpy"])
    print(f"find_slot + apply per token, {N_CELLS} cells half full, {N_SEQ} sequences, median of {a.runs}")
    for k, v in res.items():
        m = statistics.median(v)
        print(f"  {k:12s} {m * 1e6:9.2f} us/token   {base / m:7.1f}x numpy")


if __name__ == "__main__":
    main()
