"""Tests of llamax.batch: Batch, BatchAllocator (llama_batch_allocr) and UBatch.

The expected ubatches are those of llama.cpp's src/llama-batch.cpp. `RefAllocr` below is a literal,
token-by-token port of llama_batch_allocr's init (position filling, checks) and of split_simple /
split_equal / split_seq / ubatch_add, kept deliberately slow and obvious; the vectorized allocator
must agree with it on every Hypothesis-generated batch. The hand-made cases spell out what the C++
does on small batches.
"""
from __future__ import annotations

import logging

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from llamax.batch import Batch, BatchAllocator, UBatch
from llamax.errors import BatchError, LlamaxError

# ----------------------------------------------------------------------------------------------
# helpers


class FakeMemory:
    """Duck-typed memory: per sequence a (pos_min, pos_max) range; records every call."""

    def __init__(self, ranges: dict[int, tuple[int, int]] | None = None) -> None:
        self.ranges = dict(ranges or {})
        self.calls: list[tuple[str, int]] = []

    def seq_pos_min(self, s: int) -> int:
        self.calls.append(("min", s))
        return self.ranges.get(s, (-1, -1))[0]

    def seq_pos_max(self, s: int) -> int:
        self.calls.append(("max", s))
        return self.ranges.get(s, (-1, -1))[1]


def drain(alloc: BatchAllocator, kind: str, n_ubatch: int, sequential: bool = False) -> list[UBatch]:
    alloc.split_reset()
    out = []
    while True:
        if kind == "simple":
            u = alloc.split_simple(n_ubatch)
        elif kind == "equal":
            u = alloc.split_equal(n_ubatch, sequential)
        else:
            u = alloc.split_seq(n_ubatch)
        if u is None:
            return out
        out.append(u)


def idxs(ubs: list[UBatch]) -> list[list[int]]:
    return [u.idx.tolist() for u in ubs]


def shape(ubs: list[UBatch]) -> list[tuple[int, int, int, bool]]:
    return [(u.n_tokens, u.n_seq_tokens, u.n_seqs, u.equal_seqs) for u in ubs]


def snapshot(alloc: BatchAllocator) -> tuple:
    return (
        alloc.batch,
        alloc.n_tokens,
        alloc.n_used,
        alloc.n_outputs,
        alloc.pos.tolist(),
        alloc.output.tolist(),
        alloc.seq_id_unq.tolist(),
        [(alloc.seq_pos_min(s), alloc.seq_pos_max(s)) for s in range(8)],
        alloc.out_ids.tolist(),
    )


# ----------------------------------------------------------------------------------------------
# literal port of llama_batch_allocr (the oracle)


class RefError(Exception):
    pass


class RefAllocr:
    """llama_batch_allocr, statement by statement, on Python lists.

    Differences with the C++ are the two rules llamax enforces on purpose (see llamax.batch):
    negative positions and positions decreasing inside a sequence are refused (the C++'s
    cur_seq_pos is never updated, so its check is dead).
    """

    def __init__(self, tokens, pos, seq_lists, logits, memory, n_seq_max, output_all=False):
        n = len(tokens)
        if n == 0:
            raise RefError("empty")
        self.n = n
        self.token = list(tokens)
        self.seq = [list(s) for s in seq_lists]
        if pos is None:
            p0 = [memory.seq_pos_max(s) + 1 if memory else 0 for s in range(n_seq_max)]
            pos = []
            for i in range(n):
                pos.append(p0[self.seq[i][0]])
                for s in self.seq[i]:
                    p0[s] = pos[i] + 1
        self.pos = list(pos)
        if logits is None:
            out = [output_all] * n
            out[-1] = True
        else:
            out = list(logits)
            if output_all and not all(out):
                out = [True] * n
        self.output = [bool(o) for o in out]

        seq_pos = {s: set() for s in range(n_seq_max)}
        seq_cpl = set()
        for i in range(n):
            s0 = self.seq[i][0]
            for k, s1 in enumerate(self.seq[i]):
                seq_pos[s1].add(self.pos[i])
                if k > 0:
                    seq_cpl.add((s1, s0))
        self.has_cpl = bool(seq_cpl)
        self.seq_set = [frozenset(s) for s in self.seq]
        self.seq_set_map: dict[frozenset, list[int]] = {}
        for i in range(n):
            self.seq_set_map.setdefault(self.seq_set[i], []).append(i)

        if any(p < 0 for p in self.pos):
            raise RefError("negative")
        for s in range(n_seq_max):
            if not seq_pos[s]:
                continue
            x = memory.seq_pos_max(s) if memory else -1
            if x >= 0 and min(seq_pos[s]) != x + 1:
                raise RefError("Y = X + 1")
            if max(seq_pos[s]) - min(seq_pos[s]) + 1 > len(seq_pos[s]):
                raise RefError("continuous")
        if memory:
            for s0 in range(n_seq_max):
                for s1 in range(n_seq_max):
                    if (s0, s1) in seq_cpl:
                        if (memory.seq_pos_min(s0), memory.seq_pos_max(s0)) != (
                            memory.seq_pos_min(s1),
                            memory.seq_pos_max(s1),
                        ):
                            raise RefError("coupled")
        last = {}
        for i in range(n):
            for s in self.seq[i]:
                if self.pos[i] < last.get(s, -1):
                    raise RefError("decreasing")
                last[s] = self.pos[i]
        self.seq_pos = seq_pos
        self.split_reset()

    def split_reset(self):
        self.out_ids = []
        self.n_used = 0
        self.used = [False] * self.n

    def split_simple(self, n_ubatch):
        cur = 0
        while cur < len(self.used) and self.used[cur]:
            cur += 1
        if cur >= len(self.used):
            return None
        idxs = []
        while True:
            idxs.append(cur)
            self.used[cur] = True
            self.n_used += 1
            cur += 1
            if cur >= len(self.used):
                break
            if len(idxs) >= n_ubatch:
                break
        return self.ubatch_add(idxs, len(idxs), False)

    def split_equal(self, n_ubatch, sequential):
        if sequential and self.has_cpl:
            return None
        cur_seq_set = []
        last_seq_id = -1
        for i in range(self.n):
            if self.used[i]:
                continue
            add = all(not (c & self.seq_set[i]) for c in cur_seq_set)
            if sequential:
                add = add and (not cur_seq_set or self.seq[i][0] == last_seq_id + 1)
            if add:
                cur_seq_set.append(self.seq_set[i])
                last_seq_id = self.seq[i][0]
                if len(cur_seq_set) > n_ubatch:
                    break
        n_seqs = len(cur_seq_set)
        if n_seqs == 0:
            return None
        cur_idx = [0] * n_seqs
        for s in range(n_seqs):
            while self.used[self.seq_set_map[cur_seq_set[s]][cur_idx[s]]]:
                cur_idx[s] += 1
        per = [[] for _ in range(n_seqs)]
        while True:
            if any(cur_idx[s] >= len(self.seq_set_map[cur_seq_set[s]]) for s in range(n_seqs)):
                break
            for s in range(n_seqs):
                idx = self.seq_set_map[cur_seq_set[s]][cur_idx[s]]
                per[s].append(idx)
                self.used[idx] = True
                self.n_used += 1
                cur_idx[s] += 1
            if (len(per[0]) + 1) * n_seqs > n_ubatch:
                break
        return self.ubatch_add([i for p in per for i in p], n_seqs, True)

    def split_seq(self, n_ubatch):
        cur = 0
        while cur < len(self.used) and self.used[cur]:
            cur += 1
        if cur >= len(self.used):
            return None
        cur_seq_set = self.seq_set[cur]
        idxs = []
        while True:
            idxs.append(cur)
            self.used[cur] = True
            self.n_used += 1
            if len(idxs) >= n_ubatch:
                break
            cur += 1
            while cur < self.n and (self.used[cur] or not (self.seq_set[cur] <= cur_seq_set)):
                cur += 1
            if cur == self.n:
                break
            cur_seq_set = self.seq_set[cur]
        return self.ubatch_add(idxs, 1, True)

    def ubatch_add(self, idxs, n_seqs, equal_seqs):
        n_tokens = len(idxs)
        assert n_tokens % n_seqs == 0
        unq = sorted(set().union(*(self.seq_set[i] for i in idxs)))
        for i in idxs:
            if self.output[i]:
                self.out_ids.append(i)
        return dict(
            idx=list(idxs),
            n_tokens=n_tokens,
            n_seq_tokens=n_tokens // n_seqs,
            n_seqs=n_seqs,
            equal_seqs=equal_seqs,
            seq_id_unq=unq,
            token=[self.token[i] for i in idxs],
            pos=[self.pos[i] for i in idxs],
            seq_id=[self.seq[i][0] for i in idxs],
            n_seq_id=[len(self.seq[i]) for i in idxs],
            output=[self.output[i] for i in idxs],
        )


def ref_drain(ref: RefAllocr, kind: str, n_ubatch: int, sequential: bool = False) -> list[dict]:
    ref.split_reset()
    out = []
    while True:
        if kind == "simple":
            u = ref.split_simple(n_ubatch)
        elif kind == "equal":
            u = ref.split_equal(n_ubatch, sequential)
        else:
            u = ref.split_seq(n_ubatch)
        if u is None:
            return out
        out.append(u)


def check_ubatch_fields(alloc: BatchAllocator, u: UBatch) -> None:
    """Every UBatch invariant that does not depend on the split strategy."""
    idx = u.idx
    assert idx.dtype == np.int32 and idx.shape == (u.n_tokens,)
    assert u.n_tokens == u.n_seq_tokens * u.n_seqs
    for name, dt in (("token", np.int32), ("pos", np.int32), ("n_seq_id", np.int32), ("seq_id", np.int32)):
        arr = getattr(u, name)
        assert arr.dtype == dt and arr.shape == (u.n_tokens,), name
    assert u.output.dtype == np.bool_ and u.output.shape == (u.n_tokens,)
    assert u.seq_bits.dtype == np.uint64 and u.seq_bits.shape == (u.n_tokens, 4)
    assert u.seq_bits.flags.c_contiguous
    assert u.seq_idx.dtype == np.int32 and u.seq_idx.shape == (256,)
    assert u.seq_id_unq.dtype == np.int32 and u.n_seqs_unq == u.seq_id_unq.size
    assert np.array_equal(u.token, alloc.token[idx])
    assert np.array_equal(u.pos, alloc.pos[idx])
    assert np.array_equal(u.output, alloc.output[idx])
    b = alloc.batch
    assert np.array_equal(u.seq_id, b.seq_id[idx])
    assert np.array_equal(u.n_seq_id, b.n_seq_id[idx])
    assert np.array_equal(u.seq_bits, b.seq_bits[idx])
    union = sorted({s for i in idx.tolist() for s in b.seq_ids_of(i)})
    assert u.seq_id_unq.tolist() == union
    expect_idx = np.full(256, -1)
    expect_idx[union] = np.arange(len(union))
    assert np.array_equal(u.seq_idx, expect_idx)
    # the primary sequence is one of the token's sequences; n_seq_id counts the bits
    for k, i in enumerate(idx.tolist()):
        assert u.seq_id[k] in b.seq_ids_of(i)
        assert u.n_seq_id[k] == len(b.seq_ids_of(i))


# ----------------------------------------------------------------------------------------------
# Batch construction


def test_batch_defaults_and_dtypes():
    b = Batch([3, 4, 5])
    assert b.n_tokens == len(b) == 3
    assert b.token.dtype == np.int32 and b.token.tolist() == [3, 4, 5]
    assert b.pos is None and b.logits is None
    assert b.seq_id.tolist() == [0, 0, 0] and b.n_seq_id.tolist() == [1, 1, 1]
    assert b.seq_bits.dtype == np.uint64 and b.seq_bits.shape == (3, 4)
    assert b.seq_bits[:, 0].tolist() == [1, 1, 1] and not b.seq_bits[:, 1:].any()
    assert not b.multi_seq


def test_batch_arrays_are_read_only():
    b = Batch([1, 2], pos=[0, 1], logits=[True, True])
    for arr in (b.token, b.pos, b.seq_id, b.n_seq_id, b.seq_bits, b.logits):
        with pytest.raises(ValueError):
            arr[0] = 0


def test_batch_accepts_numpy_and_copies():
    toks = np.array([1, 2, 3], dtype=np.int64)
    pos = np.array([0, 1, 2], dtype=np.uint8)
    b = Batch(toks, pos=pos, seq_ids=np.array([1, 2, 1]), logits=np.array([0, 1, 1]))
    toks[0] = 99
    assert b.token.tolist() == [1, 2, 3] and b.pos.dtype == np.int32
    assert b.seq_id.tolist() == [1, 2, 1]
    assert b.logits.dtype == np.bool_ and b.logits.tolist() == [False, True, True]
    assert b.seq_ids_of(1) == [2]


def test_batch_multi_sequence_forms():
    b = Batch([1, 2, 3], seq_ids=[[2, 0], 1, (1, 200)])
    assert b.seq_id.tolist() == [2, 1, 1]  # the first listed is the primary
    assert b.n_seq_id.tolist() == [2, 1, 2]
    assert b.seq_ids_of(0) == [0, 2] and b.seq_ids_of(2) == [1, 200]
    assert b.multi_seq
    assert int(b.seq_bits[2, 3]) == 1 << (200 - 192)
    b2 = Batch([1, 2], seq_ids=np.array([[0, 1], [1, 0]]))
    assert b2.seq_id.tolist() == [0, 1] and b2.n_seq_id.tolist() == [2, 2] and b2.multi_seq
    assert np.array_equal(b2.seq_bits[0], b2.seq_bits[1])


def test_batch_one():
    b = Batch.one([7, 8, 9], seq_id=3)
    assert b.seq_id.tolist() == [3, 3, 3] and b.pos is None and b.logits is None
    assert Batch.one(5).token.tolist() == [5]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(tokens=[[1, 2], [3]]), "tokens"),
        (dict(tokens=[[1, 2], [3, 4]]), "1-D"),
        (dict(tokens=[1.5, 2.0]), "integers"),
        (dict(tokens=[1, 2**40]), "int32"),
        (dict(tokens=[1, 2], pos=[0]), "pos has 1 entries for 2 tokens"),
        (dict(tokens=[1, 2], logits=[True]), "logits"),
        (dict(tokens=[1, 2], logits=[0.5, 1.0]), "bools"),
        (dict(tokens=[1, 2], seq_ids=[0]), "seq_ids has 1 entries for 2 tokens"),
        (dict(tokens=[1, 2], seq_ids=[0, 256]), "token 1: seq_id 256 is outside"),
        (dict(tokens=[1, 2], seq_ids=[0, -1]), "token 1: seq_id -1"),
        (dict(tokens=[1, 2], seq_ids=[0, [1, 1]]), "token 1: .* twice"),
        (dict(tokens=[1, 2], seq_ids=[[], 0]), "token 0 has no sequence"),
        (dict(tokens=[1, 2], seq_ids=[0, [1, 2.5]]), "token 1"),
        (dict(tokens=[1, 2], seq_ids=np.array([[0, 0], [1, 2]])), "token 0: .* twice"),
        (dict(tokens=[1, 2], seq_ids=[0.0, 1.0]), "integers"),
    ],
)
def test_batch_rejects_bad_input(kwargs, match):
    with pytest.raises(BatchError, match=match):
        Batch(**kwargs)


def test_batch_error_is_a_value_error():
    with pytest.raises(ValueError):
        Batch([1, 2], pos=[0])
    assert issubclass(BatchError, LlamaxError)


# ----------------------------------------------------------------------------------------------
# init: validation rules


def test_empty_batch():
    a = BatchAllocator()
    with pytest.raises(BatchError, match="empty batch"):
        a.init(Batch([]))


def test_more_than_n_batch():
    a = BatchAllocator(n_batch=4)
    a.init(Batch([1, 2, 3, 4]))
    with pytest.raises(BatchError, match="5 tokens, more than n_batch = 4"):
        a.init(Batch([1, 2, 3, 4, 5]))


@pytest.mark.parametrize("tokens, bad_i, bad_v", [([1, 2, 100], 2, 100), ([-1, 2], 0, -1), ([5], 0, 100)])
def test_token_outside_vocab(tokens, bad_i, bad_v):
    a = BatchAllocator(n_vocab=100)
    toks = list(tokens)
    toks[bad_i] = bad_v
    with pytest.raises(BatchError, match=rf"invalid token\[{bad_i}\] = {bad_v}: token ids must be in \[0, 100\)"):
        a.init(Batch(toks))


def test_negative_token_without_vocab():
    with pytest.raises(BatchError, match=r"invalid token\[1\] = -3"):
        BatchAllocator().init(Batch([0, -3]))


def test_seq_id_outside_n_seq_max():
    a = BatchAllocator(n_seq_max=2)
    with pytest.raises(BatchError, match=r"invalid seq_id\[1\] = 3: seq ids must be in \[0, n_seq_max = 2\)"):
        a.init(Batch([1, 2, 3], seq_ids=[0, 3, 1]))
    with pytest.raises(BatchError, match=r"invalid seq_id\[0\] = 2"):
        a.init(Batch([1], seq_ids=2))
    with pytest.raises(BatchError, match=r"invalid seq_id\[1\] = 7"):
        a.init(Batch([1, 2], seq_ids=[0, [1, 7]]))
    # the per-call override (a unified context passes 256, as llama.cpp does)
    a.init(Batch([1, 2, 3], seq_ids=[0, 3, 1]), n_seq_max=256)
    assert a.seq_id_unq.tolist() == [0, 1, 3]


def test_y_equals_x_plus_one():
    mem = FakeMemory({0: (0, 9)})
    a = BatchAllocator(n_seq_max=2)
    with pytest.raises(BatchError, match=r"token 0: .*sequence 0 start at position Y = 5.* X = 9.*Y = X \+ 1"):
        a.init(Batch([1, 2], pos=[5, 6]), mem)
    with pytest.raises(BatchError, match=r"token 1: .*sequence 0 .*Y = 11"):
        a.init(Batch([1, 2, 3], pos=[13, 11, 12]), mem)  # Y is the smallest position of the sequence
    with pytest.raises(BatchError, match=r"Y = 7"):
        a.init(Batch([1], pos=[7]), mem)  # the 1-token path says the same
    a.init(Batch([1, 2], pos=[10, 11]), mem)
    # a sequence the memory does not hold may start anywhere
    a.init(Batch([1, 2], pos=[50, 51], seq_ids=1), mem)


def test_positions_not_continuous():
    a = BatchAllocator(n_seq_max=2)
    with pytest.raises(BatchError, match=r"token 2: sequence 0 positions are not continuous .*position 2 is missing"):
        a.init(Batch([1, 2, 3], pos=[0, 1, 3]))
    with pytest.raises(BatchError, match=r"token 3: sequence 1 positions are not continuous"):
        a.init(Batch([1, 2, 3, 4], pos=[0, 0, 1, 2], seq_ids=[0, 1, 0, 1]))
    # repeated positions are allowed by llama.cpp's set-based rule
    a.init(Batch([1, 2, 3], pos=[0, 0, 1]))


def test_positions_decreasing():
    a = BatchAllocator(n_seq_max=2)
    with pytest.raises(BatchError, match=r"token 1: sequence 0 positions are decreasing .*\(1 then 0"):
        a.init(Batch([1, 2], pos=[1, 0]))
    # llama.cpp's own example: pos 4 5 0 1 6 2 3 / seq 0 0 1 1 0 1 0 -> token 6
    with pytest.raises(BatchError, match=r"token 6: sequence 0 positions are decreasing"):
        a.init(Batch(list(range(7)), pos=[4, 5, 0, 1, 6, 2, 3], seq_ids=[0, 0, 1, 1, 0, 1, 0]))
    a.init(Batch(list(range(6)), pos=[4, 5, 0, 1, 6, 2], seq_ids=[0, 0, 1, 1, 0, 1]))


def test_negative_position():
    a = BatchAllocator()
    with pytest.raises(BatchError, match=r"token 0: position -1 is negative"):
        a.init(Batch([1], pos=[-1]))
    with pytest.raises(BatchError, match=r"token 1: position -4 is negative"):
        a.init(Batch([1, 2], pos=[0, -4]))


def test_coupled_sequences_diverged():
    # same max (so Y = X + 1 holds for both), different min
    mem = FakeMemory({0: (0, 4), 1: (2, 4)})
    a = BatchAllocator(n_seq_max=2)
    with pytest.raises(BatchError, match=r"token 0: sequence 1 is coupled to 0 in the input batch, but they have diverged"):
        a.init(Batch([1, 2], pos=[5, 6], seq_ids=[[0, 1], 0]), mem)
    mem.ranges[1] = (0, 4)
    a.init(Batch([1, 2], pos=[5, 6], seq_ids=[[0, 1], 0]), mem)
    assert a.has_cpl
    # without a memory there is nothing to diverge from
    a.init(Batch([1, 2], seq_ids=[[0, 1], 1]))


def test_failed_init_changes_nothing():
    mem = FakeMemory({0: (0, 9), 1: (0, 3)})
    before_mem = dict(mem.ranges)
    a = BatchAllocator(n_seq_max=2, n_vocab=50, n_batch=8)
    a.init(Batch([1, 2, 3], seq_ids=[0, 1, 0], logits=[True, False, True]), mem)
    a.split_reset()
    first = a.split_simple(2)
    snap = snapshot(a)
    bad = [
        Batch([]),
        Batch(list(range(9))),
        Batch([1, 99]),
        Batch([1, 2], seq_ids=[0, 5]),
        Batch([1, 2], pos=[3, 4]),  # Y != X + 1
        Batch([1, 2], pos=[10, 12]),  # not continuous
        Batch([1, 2], pos=[11, 10]),  # decreasing
        Batch([1], pos=[-2], seq_ids=1),
        Batch([1], pos=[4], seq_ids=[[0, 1]]),  # Y != X + 1 for sequence 0
    ]
    for b in bad:
        with pytest.raises(BatchError):
            a.init(b, mem)
        assert snapshot(a) == snap
    assert mem.ranges == before_mem
    assert {c[0] for c in mem.calls} <= {"min", "max"}
    # and the allocator goes on splitting the batch it had
    rest = a.split_simple(2)
    assert first.idx.tolist() == [0, 1] and rest.idx.tolist() == [2]
    assert a.split_simple(2) is None
    assert a.out_ids.tolist() == [0, 2]


# ----------------------------------------------------------------------------------------------
# init: positions and outputs


def test_positions_filled_from_memory():
    mem = FakeMemory({0: (3, 9), 2: (0, 0)})
    a = BatchAllocator(n_seq_max=4)
    a.init(Batch([1, 2, 3]), mem)
    assert a.pos.tolist() == [10, 11, 12]
    assert (a.seq_pos_min(0), a.seq_pos_max(0)) == (10, 12)
    a.init(Batch([1, 2, 3, 4, 5, 6], seq_ids=[0, 1, 2, 0, 2, 1]), mem)
    assert a.pos.tolist() == [10, 0, 1, 11, 2, 1]
    assert [(a.seq_pos_min(s), a.seq_pos_max(s)) for s in range(4)] == [(10, 11), (0, 1), (1, 2), (-1, -1)]
    a.init(Batch([5]), mem)
    assert a.pos.tolist() == [10]
    a.init(Batch([5], seq_ids=3), mem)
    assert a.pos.tolist() == [0]
    # no memory: every sequence starts at 0
    a.init(Batch([1, 2, 3], seq_ids=[1, 1, 3]))
    assert a.pos.tolist() == [0, 1, 0]


def test_positions_filled_for_shared_tokens():
    # llama.cpp: pos[i] = p0[primary]; every sequence of the token then continues at pos[i] + 1
    mem = FakeMemory({0: (0, 4), 1: (0, 4)})
    a = BatchAllocator(n_seq_max=3)
    a.init(Batch([1, 2, 3, 4], seq_ids=[[0, 1], [0, 1], 0, 1]), mem)
    assert a.pos.tolist() == [5, 6, 7, 7]
    a.init(Batch([1, 2, 3], seq_ids=[[0, 1, 2], 2, [1, 2]]))
    assert a.pos.tolist() == [0, 1, 1]  # token 2's primary is 1, which continues at 1


def test_explicit_positions_kept():
    a = BatchAllocator()
    a.init(Batch([1, 2, 3], pos=[7, 8, 9]))
    assert a.pos.tolist() == [7, 8, 9]


def test_default_outputs():
    a = BatchAllocator()
    a.init(Batch([1, 2, 3]))
    assert a.output.tolist() == [False, False, True] and a.n_outputs == 1
    a.init(Batch([1, 2, 3]), output_all=True)
    assert a.output.tolist() == [True, True, True] and a.n_outputs == 3
    a.init(Batch([1, 2, 3], logits=[True, False, True]))
    assert a.output.tolist() == [True, False, True] and a.n_outputs == 2
    a.init(Batch([1, 2, 3], logits=[0, 0, 0]))
    assert a.n_outputs == 0
    a.init(Batch([4]))
    assert a.output.tolist() == [True] and a.n_outputs == 1
    a.init(Batch([4], logits=[False]))
    assert a.n_outputs == 0


def test_output_all_overrides_with_warning(caplog):
    a = BatchAllocator()
    with caplog.at_level(logging.WARNING, logger="llamax"):
        a.init(Batch([1, 2], logits=[False, True]), output_all=True)
    assert a.output.tolist() == [True, True]
    assert "embeddings required but some input tokens were not marked as outputs -> overriding" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="llamax"):
        a.init(Batch([1], logits=[False]), output_all=True)
    assert a.output.tolist() == [True] and "overriding" in caplog.text


# ----------------------------------------------------------------------------------------------
# splits on hand-made batches (expected values read off llama-batch.cpp)


def test_split_simple_consecutive_chunks():
    a = BatchAllocator(n_seq_max=2)
    a.init(Batch(list(range(10)), seq_ids=[0, 1] * 5))
    ubs = drain(a, "simple", 4)
    assert idxs(ubs) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    # split_simple: one "virtual sequence" per token
    assert shape(ubs) == [(4, 1, 4, False), (4, 1, 4, False), (2, 1, 2, False)]
    assert ubs[0].seq_id_unq.tolist() == [0, 1] and ubs[0].seq_idx[:3].tolist() == [0, 1, -1]
    assert a.n_used == 10
    for u in ubs:
        check_ubatch_fields(a, u)


def test_split_equal_sequential_groups_by_sequence():
    # seq: 0 1 0 1 0 1 0 2 2 (tokens 0..8)
    a = BatchAllocator(n_seq_max=3)
    a.init(Batch(list(range(9)), seq_ids=[0, 1, 0, 1, 0, 1, 0, 2, 2]))
    ubs = drain(a, "equal", 6, sequential=True)
    # 1st: sets {0},{1},{2} (ids 0,1,2 consecutive); k = min(6 // 3, 2) = 2 -> 0 2 | 1 3 | 7 8
    # 2nd: {0},{1}; k = min(3, 1) = 1 -> 4 | 5;   3rd: {0} -> 6
    assert idxs(ubs) == [[0, 2, 1, 3, 7, 8], [4, 5], [6]]
    assert shape(ubs) == [(6, 2, 3, True), (2, 1, 2, True), (1, 1, 1, True)]
    u = ubs[0]
    assert u.seq_id_unq.tolist() == [0, 1, 2]
    for s in range(u.n_seqs):  # tokens [s*n_seq_tokens, (s+1)*n_seq_tokens) belong to seq_id_unq[s]
        blk = u.seq_id[s * u.n_seq_tokens : (s + 1) * u.n_seq_tokens]
        assert (blk == u.seq_id_unq[s]).all()
    for u in ubs:
        check_ubatch_fields(a, u)


def test_split_equal_sequential_needs_consecutive_ids():
    # seq 1 0 2: the first token's sequence (1) opens the ubatch, 2 follows it, 0 waits
    a = BatchAllocator(n_seq_max=3)
    a.init(Batch([5, 6, 7], seq_ids=[1, 0, 2]))
    assert idxs(drain(a, "equal", 8, sequential=True)) == [[0, 2], [1]]
    # seq 0 2: 1 is missing, so 2 cannot join
    a.init(Batch([5, 6], seq_ids=[0, 2]))
    assert idxs(drain(a, "equal", 8, sequential=True)) == [[0], [1]]
    # non-sequential takes both
    assert idxs(drain(a, "equal", 8, sequential=False)) == [[0, 1]]


def test_split_equal_lockstep_and_ubatch_bound():
    # 2 sequences of 5 tokens, n_ubatch 4 -> k = 2 per sequence
    a = BatchAllocator(n_seq_max=2)
    a.init(Batch(list(range(10)), seq_ids=[0] * 5 + [1] * 5))
    ubs = drain(a, "equal", 4, sequential=True)
    assert idxs(ubs) == [[0, 1, 5, 6], [2, 3, 7, 8], [4, 9]]
    assert shape(ubs) == [(4, 2, 2, True), (4, 2, 2, True), (2, 1, 2, True)]
    # llama.cpp stops picking sets only after n_ubatch + 1 of them: 3 one-token sequences and
    # n_ubatch 2 give one ubatch of 3 tokens
    a = BatchAllocator(n_seq_max=3)
    a.init(Batch([1, 2, 3], seq_ids=[0, 1, 2]))
    ubs = drain(a, "equal", 2, sequential=True)
    assert idxs(ubs) == [[0, 1, 2]] and shape(ubs) == [(3, 1, 3, True)]


def test_split_equal_shared_prompt_alone():
    # a shared prompt {0,1} overlaps both sequences, so it goes in its own ubatch
    a = BatchAllocator(n_seq_max=2)
    a.init(Batch([1, 2, 3, 4, 5], seq_ids=[[0, 1], [0, 1], 0, 1, 1]))
    ubs = drain(a, "equal", 4, sequential=False)
    assert idxs(ubs) == [[0, 1], [2, 3], [4]]
    assert shape(ubs) == [(2, 2, 1, True), (2, 1, 2, True), (1, 1, 1, True)]
    assert ubs[0].seq_id_unq.tolist() == [0, 1] and ubs[0].n_seq_id.tolist() == [2, 2]
    for u in ubs:
        check_ubatch_fields(a, u)
    # a sequential split refuses coupled sequences (llama.cpp logs an error, returns nothing)
    a.split_reset()
    assert a.split_equal(4, sequential=True) is None and a.n_used == 0


def test_split_seq_nested_sets():
    # sets: {0,1} {0,1} {0} {1} {1}: the chain {0,1} -> {0,1} -> {0}; then {1} {1}
    a = BatchAllocator(n_seq_max=2)
    a.init(Batch([1, 2, 3, 4, 5], seq_ids=[[0, 1], [0, 1], 0, 1, 1]))
    ubs = drain(a, "seq", 8)
    assert idxs(ubs) == [[0, 1, 2], [3, 4]]
    assert shape(ubs) == [(3, 3, 1, True), (2, 2, 1, True)]
    # each ubatch starts at the first unused token and is cut every n_ubatch tokens
    a.init(Batch(list(range(5)), seq_ids=[0, 1, 0, 1, 0]))
    assert idxs(drain(a, "seq", 2)) == [[0, 2], [1, 3], [4]]


def test_out_ids_and_reorder():
    # equal split reorders tokens: the outputs come back in ubatch order
    a = BatchAllocator(n_seq_max=2)
    a.init(Batch(list(range(6)), seq_ids=[0, 1, 0, 1, 0, 1], logits=[1, 1, 0, 1, 1, 0]))
    ubs = drain(a, "equal", 4, sequential=True)
    assert idxs(ubs) == [[0, 2, 1, 3], [4, 5]]
    assert a.out_ids.tolist() == [0, 1, 3, 4]
    assert a.n_outputs == 4
    assert a.output_ids().tolist() == [0, 1, -1, 2, 3, -1]
    a.init(Batch(list(range(4)), seq_ids=[1, 0, 1, 0], logits=[1, 1, 1, 1]))
    ubs = drain(a, "equal", 4, sequential=False)
    assert idxs(ubs) == [[0, 2, 1, 3]]
    out = a.out_ids
    assert out.tolist() == [0, 2, 1, 3]
    rows = np.arange(4) * 10  # row r of the ubatch-ordered outputs belongs to token out[r]
    assert (rows[a.output_reorder()] == np.array([0, 20, 10, 30])).all()
    assert (out[a.output_reorder()] == np.arange(4)).all()
    a.split_reset()
    assert a.out_ids.size == 0


def test_one_token_paths_agree():
    mem = FakeMemory({0: (0, 41)})
    a = BatchAllocator(n_seq_max=1, n_vocab=10)
    a.init(Batch([3]), mem)
    u = a.split_simple(512)
    assert (u.n_tokens, u.n_seq_tokens, u.n_seqs, u.equal_seqs) == (1, 1, 1, False)
    assert u.pos.tolist() == [42] and u.output.tolist() == [True] and u.seq_id_unq.tolist() == [0]
    assert a.split_simple(512) is None and a.out_ids.tolist() == [0]
    check_ubatch_fields(a, u)
    for kind in ("equal", "seq"):
        ubs = drain(a, kind, 4, sequential=True)
        assert idxs(ubs) == [[0]]


def test_ubatch_reserve():
    u = UBatch.reserve(3, 2)
    assert (u.n_tokens, u.n_seq_tokens, u.n_seqs, u.n_seqs_unq, u.equal_seqs) == (6, 3, 2, 2, True)
    assert u.seq_id_unq.tolist() == [0, 1] and u.seq_idx[:3].tolist() == [0, 1, -1]
    assert u.token.shape == u.pos.shape == (6,) and u.seq_bits.shape == (6, 4)
    assert u.n_outputs == 0


def test_split_n_ubatch_must_be_positive():
    a = BatchAllocator()
    a.init(Batch([1]))
    for f in (a.split_simple, a.split_seq, lambda n: a.split_equal(n, False)):
        with pytest.raises(ValueError):
            f(0)


# ----------------------------------------------------------------------------------------------
# property: the vectorized allocator is llama.cpp's allocator


@st.composite
def batches(draw):
    n_seq = draw(st.integers(1, 5))
    n = draw(st.integers(1, 40))
    multi = draw(st.booleans())
    seq_lists = []
    for _ in range(n):
        if multi and draw(st.integers(0, 3)) == 0:
            k = draw(st.integers(2, n_seq)) if n_seq >= 2 else 1
            lst = draw(st.permutations(list(range(n_seq))))[:k]
        else:
            lst = [draw(st.integers(0, n_seq - 1))]
        seq_lists.append(list(lst))
    mem_ranges = {}
    for s in range(n_seq):
        if draw(st.booleans()):
            lo = draw(st.integers(0, 5))
            mem_ranges[s] = (lo, lo + draw(st.integers(0, 5)))
    use_mem = draw(st.booleans())
    pos = None
    if draw(st.integers(0, 3)) == 0:
        pos = [draw(st.integers(0, 12)) for _ in range(n)]
    logits = None
    if draw(st.booleans()):
        logits = [draw(st.booleans()) for _ in range(n)]
    tokens = [draw(st.integers(0, 31)) for _ in range(n)]
    return tokens, pos, seq_lists, logits, (FakeMemory(mem_ranges) if use_mem else None), n_seq


@st.composite
def tree_batches(draw):
    """Valid multi-sequence batches: a shared prompt that forks into disjoint groups of sequences
    (recursively), the groups' tokens interleaved in the batch (llama.cpp's parallel decoding)."""
    n_seq = draw(st.integers(2, 5))

    def node(seqs: list[int]) -> list[list[int]]:
        own = [draw(st.permutations(seqs)) for _ in range(draw(st.integers(1, 4)))]
        if len(seqs) == 1 or not draw(st.booleans()):
            return [list(x) for x in own]
        cut = draw(st.integers(1, len(seqs) - 1))
        parts = [seqs[:cut], seqs[cut:]]
        kids = [node(p) for p in parts]
        merged: list[list[int]] = []
        while any(kids):  # interleave the children, each in its own order
            k = draw(st.sampled_from([j for j, kid in enumerate(kids) if kid]))
            merged.append(kids[k].pop(0))
        return [list(x) for x in own] + merged

    roots = list(range(n_seq))
    seq_lists = node(draw(st.permutations(roots)))
    n = len(seq_lists)
    mem = None
    if draw(st.booleans()):
        lo = draw(st.integers(0, 3))
        hi = lo + draw(st.integers(0, 3))
        mem = FakeMemory({s: (lo, hi) for s in range(n_seq)})
    logits = [draw(st.booleans()) for _ in range(n)] if draw(st.booleans()) else None
    tokens = [draw(st.integers(0, 31)) for _ in range(n)]
    return tokens, None, seq_lists, logits, mem, n_seq


any_batch = st.one_of(batches(), tree_batches())


def _ubatch_as_dict(u: UBatch) -> dict:
    return dict(
        idx=u.idx.tolist(),
        n_tokens=u.n_tokens,
        n_seq_tokens=u.n_seq_tokens,
        n_seqs=u.n_seqs,
        equal_seqs=u.equal_seqs,
        seq_id_unq=u.seq_id_unq.tolist(),
        token=u.token.tolist(),
        pos=u.pos.tolist(),
        seq_id=u.seq_id.tolist(),
        n_seq_id=u.n_seq_id.tolist(),
        output=u.output.tolist(),
    )


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(any_batch, st.integers(1, 9), st.booleans())
def test_matches_llama_cpp_reference(data, n_ubatch, output_all):
    tokens, pos, seq_lists, logits, mem, n_seq = data
    b = Batch(tokens, pos=pos, seq_ids=seq_lists, logits=logits)
    a = BatchAllocator(n_seq_max=n_seq, n_vocab=32)
    try:
        ref = RefAllocr(tokens, pos, seq_lists, logits, mem, n_seq, output_all)
    except RefError:
        with pytest.raises(BatchError):
            a.init(b, mem, output_all=output_all)
        return
    a.init(b, mem, output_all=output_all)
    assert a.pos.tolist() == ref.pos
    assert a.output.tolist() == ref.output
    assert a.n_outputs == sum(ref.output)
    assert a.has_cpl == ref.has_cpl
    for s in range(n_seq):
        ps = ref.seq_pos[s]
        assert (a.seq_pos_min(s), a.seq_pos_max(s)) == ((min(ps), max(ps)) if ps else (-1, -1))
    assert a.seq_id_unq.tolist() == sorted(s for s in range(n_seq) if ref.seq_pos[s])

    for kind, sequential in (("simple", False), ("equal", False), ("equal", True), ("seq", False)):
        got = drain(a, kind, n_ubatch, sequential)
        want = ref_drain(ref, kind, n_ubatch, sequential)
        assert [_ubatch_as_dict(u) for u in got] == want, (kind, sequential)
        assert a.n_used == ref.n_used
        assert a.out_ids.tolist() == ref.out_ids
        for u in got:
            check_ubatch_fields(a, u)


@settings(max_examples=200, deadline=None)
@given(any_batch, st.integers(1, 9))
def test_split_properties(data, n_ubatch):
    tokens, pos, seq_lists, logits, mem, n_seq = data
    b = Batch(tokens, pos=pos, seq_ids=seq_lists, logits=logits)
    a = BatchAllocator(n_seq_max=n_seq)
    try:
        a.init(b, mem)
    except BatchError:
        assume(False)
    n = len(tokens)
    sets = [frozenset(b.seq_ids_of(i)) for i in range(n)]
    for kind, sequential in (("simple", False), ("equal", False), ("equal", True), ("seq", False)):
        ubs = drain(a, kind, n_ubatch, sequential)
        if kind == "equal" and sequential and a.has_cpl:
            assert ubs == [] and a.n_used == 0
            continue
        # every token in exactly one ubatch
        all_idx = np.concatenate([u.idx for u in ubs])
        assert sorted(all_idx.tolist()) == list(range(n))
        assert a.n_used == n
        # outputs come back as a permutation of the batch's outputs
        assert sorted(a.out_ids.tolist()) == np.flatnonzero(a.output).tolist()
        for u in ubs:
            ix = u.idx.tolist()
            assert u.n_tokens == u.n_seq_tokens * u.n_seqs
            if kind == "simple":
                assert u.n_tokens <= n_ubatch and ix == list(range(ix[0], ix[0] + len(ix)))
                assert not u.equal_seqs and u.n_seqs == u.n_tokens
            elif kind == "seq":
                assert u.n_tokens <= n_ubatch and u.n_seqs == 1 and ix == sorted(ix)
                for i, j in zip(ix, ix[1:]):  # each set is a subset of the previous one
                    assert sets[j] <= sets[i]
            else:
                # at most n_ubatch tokens, except llama.cpp's n_ubatch + 1 single-token sets
                assert u.n_tokens <= n_ubatch or (u.n_seqs == n_ubatch + 1 and u.n_seq_tokens == 1)
                runs = [ix[s * u.n_seq_tokens : (s + 1) * u.n_seq_tokens] for s in range(u.n_seqs)]
                run_sets = []
                for r in runs:
                    assert r == sorted(r) and len({sets[i] for i in r}) == 1
                    run_sets.append(sets[r[0]])
                for x in range(len(run_sets)):  # the sets of a ubatch do not overlap
                    for y in range(x + 1, len(run_sets)):
                        assert not (run_sets[x] & run_sets[y])
                if sequential:
                    firsts = [min(s) for s in run_sets]
                    assert all(len(s) == 1 for s in run_sets)
                    assert firsts == list(range(firsts[0], firsts[0] + len(firsts)))
                    assert u.seq_id_unq.tolist() == firsts
