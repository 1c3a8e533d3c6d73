"""RecurrentMemory (llama.cpp's llama_memory_recurrent) on its own: one state per sequence, the
sequence operations llama.cpp allows on it (and the partial removals it refuses), equal splits,
state save/restore, and a failed batch undone."""
import numpy as np
import pytest

from llamax import Batch, BatchError, RecurrentMemory, StateError
from llamax import state as lstate

R, S = (6, 3), (6, 4)


def _mem(n_seq_max=4, layers=2):
    return RecurrentMemory(layers, R, S, n_seq_max=n_seq_max)


def _feed(mem, batch, n_ubatch=512, fill=None):
    """Apply a batch's ubatches as a model would, writing into each sequence's state a value that
    depends on the state before and the tokens (so states differ and copies can be told apart)."""
    plan = mem.plan(batch, n_ubatch)
    for ub in plan:
        for il in mem.layer_ids:
            v = mem.recurrent_view(il, ub)
            for s, c in enumerate(v.cells):
                toks = ub.token[s * ub.n_seq_tokens:(s + 1) * ub.n_seq_tokens].astype(np.float32)
                v.conv[c] = v.conv[c] * 0.5 + toks.sum() + il
                v.ssm[c] = v.ssm[c] * 0.25 + toks[-1] + (fill or 0)
    return plan


def _snapshot(mem):
    return mem.cells(), [a.copy() for a in mem.conv + mem.ssm]


def _same(mem, snap):
    cells, arrays = snap
    return mem.cells() == cells and all(np.array_equal(a, b) for a, b in zip(mem.conv + mem.ssm, arrays))


def test_one_state_per_sequence_holds_the_last_position():
    mem = _mem()
    _feed(mem, Batch([5, 6, 7, 8], seq_ids=0))
    _feed(mem, Batch([1, 2], seq_ids=2))
    assert mem.n_used == 2 and mem.n_cells == 4
    assert (mem.seq_pos_min(0), mem.seq_pos_max(0)) == (3, 3)
    assert (mem.seq_pos_min(2), mem.seq_pos_max(2)) == (1, 1)
    assert mem.seq_pos_max(1) == -1
    _feed(mem, Batch([9], seq_ids=0))                      # continues at position 4, same cell
    assert mem.seq_pos_max(0) == 4 and mem.n_used == 2
    with pytest.raises(BatchError, match="Y = X \\+ 1|consecutive"):
        mem.plan(Batch([1], pos=[7], seq_ids=0))


@pytest.mark.parametrize("p0,p1", [(2, -1), (1, 3), (0, 3), (4, -1), (0, 4), (3, 5)])
def test_partial_removal_is_refused_and_changes_nothing(p0, p1):
    """A state holds positions 0..4 at once: a range that cuts it returns False, as in llama.cpp."""
    mem = _mem()
    _feed(mem, Batch([5, 6, 7, 8, 9], seq_ids=0))
    snap = _snapshot(mem)
    assert mem.seq_rm(0, p0, p1) is False
    assert _same(mem, snap)


@pytest.mark.parametrize("p0,p1", [(5, -1), (9, 20), (-1, -1), (0, 5), (0, -1)])
def test_removal_of_all_or_nothing_succeeds(p0, p1):
    mem = _mem()
    _feed(mem, Batch([5, 6, 7, 8, 9], seq_ids=0))
    _feed(mem, Batch([1, 2], seq_ids=1))
    assert mem.seq_rm(0, p0, p1) is True
    gone = p0 <= 0 and (p1 < 0 or p1 > 4)
    assert mem.seq_pos_max(0) == (-1 if gone else 4)
    assert mem.seq_pos_max(1) == 1


def test_every_sequence_removal_takes_everything_or_nothing():
    mem = _mem()
    _feed(mem, Batch([5, 6, 7], seq_ids=0))
    _feed(mem, Batch([1, 2], seq_ids=1))
    snap = _snapshot(mem)
    assert mem.seq_rm(-1, 1, 5) is False and _same(mem, snap)
    assert mem.seq_rm(-1, 3, 3) is True and _same(mem, snap)
    assert mem.seq_rm(-1, -1, -1) is True and mem.n_used == 0


def test_seq_cp_copies_the_state_and_the_copies_diverge():
    mem = _mem()
    _feed(mem, Batch([5, 6, 7], seq_ids=0))
    mem.seq_cp(0, 3)
    c0, c3 = (next(i for i, (_, s) in enumerate(mem.cells()) if s == {q}) for q in (0, 3))
    assert c0 != c3 and mem.seq_pos_max(3) == 2
    for a in mem.conv + mem.ssm:
        assert np.array_equal(a[c0], a[c3])
    before = [a[c0].copy() for a in mem.conv + mem.ssm]
    _feed(mem, Batch([11], seq_ids=3), fill=100)
    assert all(np.array_equal(a[c0], b) for a, b in zip(mem.conv + mem.ssm, before))
    assert not np.array_equal(mem.ssm[0][c3], before[len(mem.conv)])
    mem.seq_cp(1, 3)                                       # an empty source empties the destination
    assert mem.seq_pos_max(3) == -1 and mem.n_used == 1


def test_two_sequences_after_seq_cp_continue_identically():
    a = _mem()
    _feed(a, Batch([5, 6, 7], seq_ids=0))
    a.seq_cp(0, 1)
    _feed(a, Batch([8, 9, 8, 9], seq_ids=[0, 0, 1, 1]))     # one equal ubatch of both sequences
    (c0, c1) = (a.cells().index((4, frozenset({q}))) for q in (0, 1))
    for arr in a.conv + a.ssm:
        assert np.array_equal(arr[c0], arr[c1])


def test_seq_keep_add_div():
    mem = _mem()
    for s, toks in enumerate([[1, 2, 3], [4, 5], [6, 7, 8, 9]]):
        _feed(mem, Batch(toks, seq_ids=s))
    mem.seq_add(2, 0, -1, 10)
    assert mem.seq_pos_max(2) == 13
    mem.seq_add(2, 0, 5, 10)                               # pos 13 is outside [0, 5): unchanged
    assert mem.seq_pos_max(2) == 13
    mem.seq_div(2, 0, -1, 2)
    assert mem.seq_pos_max(2) == 6
    mem.seq_add(1, 0, -1, -5)                              # moved before 0: the state is dropped
    assert mem.seq_pos_max(1) == -1
    mem.seq_keep(2)
    assert mem.n_used == 1 and mem.seq_pos_max(0) == -1 and mem.seq_pos_max(2) == 6
    assert mem.can_shift and mem.seq_unshare(2) == 0


def test_batches_split_into_equal_sequences():
    mem = _mem()
    plan = _feed(mem, Batch([1, 2, 3, 4, 5, 6, 7, 8], seq_ids=[0, 0, 0, 1, 1, 1, 1, 1]), n_ubatch=8)
    for ub in plan.ubatches:
        assert ub.equal_seqs and ub.n_tokens == ub.n_seqs * ub.n_seq_tokens
    assert sum(ub.n_tokens for ub in plan.ubatches) == 8
    assert (mem.seq_pos_max(0), mem.seq_pos_max(1)) == (2, 4)


def test_a_token_of_several_sequences_is_refused_unchanged():
    mem = _mem()
    _feed(mem, Batch([5], seq_ids=2))
    snap = _snapshot(mem)
    with pytest.raises(BatchError, match="one state per sequence"):
        mem.plan(Batch([1, 2], seq_ids=[[0, 1], [0, 1]]))
    assert _same(mem, snap)


def test_state_round_trip_whole_and_per_sequence_bit_for_bit():
    mem = _mem()
    _feed(mem, Batch([5, 6, 7], seq_ids=0))
    _feed(mem, Batch([1, 2], seq_ids=2))
    blob = lstate.get_data(mem)
    snap = _snapshot(mem)
    other = _mem()
    lstate.set_data(other, blob)
    assert _same(other, snap)
    assert lstate.get_data(other) == blob
    seq = lstate.get_data(mem, 2)
    fresh = _mem()
    _feed(fresh, Batch([9, 9, 9, 9], seq_ids=1))
    lstate.set_data(fresh, seq, 3)
    c2, c3 = mem.cells().index((1, frozenset({2}))), fresh.cells().index((1, frozenset({3})))
    for a, b in zip(mem.conv + mem.ssm, fresh.conv + fresh.ssm):
        assert np.array_equal(a[c2], b[c3])
    assert fresh.seq_pos_max(1) == 3


def test_a_state_of_another_shape_or_memory_is_refused():
    mem = _mem()
    _feed(mem, Batch([5, 6, 7], seq_ids=0))
    blob = lstate.get_data(mem)
    for other, what in [(RecurrentMemory(2, (6, 2), S, n_seq_max=4), "shapes"),
                        (RecurrentMemory(3, R, S, n_seq_max=4), "recurrent layers"),
                        (RecurrentMemory(3, R, S, n_seq_max=4, layer_ids=[0, 2]), "layers")]:
        with pytest.raises(StateError, match=what):
            lstate.set_data(other, blob)
    from llamax import KVCache
    with pytest.raises(StateError, match="memory_recurrent"):
        lstate.set_data(KVCache(2, 1, 8, 16), blob)
    small = RecurrentMemory(2, R, S, n_seq_max=1)
    _feed(mem, Batch([1], seq_ids=3))
    with pytest.raises(StateError):
        lstate.set_data(small, lstate.get_data(mem))


@pytest.mark.parametrize("gap", [False, True])
def test_a_failed_batch_is_undone(gap):
    """forget_batch after some ubatches were applied puts back every cell and state as before, whether the
    batch's cells are consecutive (saved as one slice) or not (gathered)."""
    mem = _mem()
    _feed(mem, Batch([5, 6, 7, 8, 9, 10], seq_ids=[0, 0, 1, 1, 2, 2]))
    if gap:
        mem.seq_rm(1)          # frees cell 1: the batch below writes cells 0 and 2
    other = 2 if gap else 1
    snap = _snapshot(mem)
    plan = mem.plan(Batch([1, 2, 3, 4, 5, 6], seq_ids=[0, 0, 0, other, other, other]), 2)
    touched = set()
    for i in range(len(plan) - 1):   # not the last: the batch fails before it ends
        ub = plan.apply(i)
        for il in mem.layer_ids:
            v = mem.recurrent_view(il, ub)
            v.ssm[v.cells] += 1.0
            v.conv[v.cells] -= 1.0
            touched.update(v.cells.tolist())
    assert touched == ({0, 2} if gap else {0, 1}) and mem._undo.touched.tolist() == sorted(touched)
    assert not _same(mem, snap)
    mem.forget_batch(plan.balloc)
    assert _same(mem, snap)


@pytest.mark.parametrize("n_ubatch", [1, 3, 7, 64])
def test_a_one_sequence_batch_splits_as_split_equal_would(n_ubatch):
    """split_equal's shortcut for one sequence (its tokens in order, without grouping the batch) gives the
    ubatches split_equal's rule gives: consecutive runs of min(n_ubatch, left) tokens, one sequence each."""
    from llamax.batch import BatchAllocator
    from llamax.memory.base import split_batch

    mem = _mem()
    _feed(mem, Batch([5, 6], seq_ids=2))
    b = Batch(list(range(10, 30)), seq_ids=2, logits=[i % 3 == 0 for i in range(20)])
    fast, slow = BatchAllocator(n_seq_max=4), BatchAllocator(n_seq_max=4)
    fast.init(b, mem)
    slow.init(b, mem)
    got = split_batch(fast, n_ubatch, equal=True, sequential=True)
    slow.split_reset()
    want = []
    while (ub := slow.split_equal(n_ubatch, True)) is not None and ub.n_tokens:
        want.append(ub)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (g.n_tokens, g.n_seqs, g.n_seq_tokens, g.equal_seqs) == (w.n_tokens, w.n_seqs, w.n_seq_tokens, True)
        for f in ("token", "pos", "seq_id", "output"):
            assert np.array_equal(getattr(g, f), getattr(w, f)), f
    assert np.array_equal(fast.output_ids(), slow.output_ids())
    runs = [list(range(10, 30))[i:i + n_ubatch] for i in range(0, 20, n_ubatch)]
    assert [g.token.tolist() for g in got] == runs
    assert [int(g.pos[0]) for g in got] == [2 + i for i in range(0, 20, n_ubatch)]
