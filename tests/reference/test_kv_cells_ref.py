"""Tests of the pure-Python KV-cell reference itself.

Hand-checked scenarios (each expected value worked out from llama.cpp's rules), small
property checks, and replays of llama.cpp's own recorded runs in
../shared/reference/*/memory_ops.json: every recorded step must match.
"""

from __future__ import annotations

import pytest
from helpers import load_memory_ops
from hypothesis import given, settings
from hypothesis import strategies as st

from .kv_cells_ref import (
    EXT_NONE,
    POS_MAX,
    RefCells,
    RefISWACells,
    RefKVCells,
    RefSlotInfo,
    RefUBatch,
    decode,
    is_masked_swa,
    split_equal,
    split_simple,
)


def ub(pos, seqs=0, **kw) -> RefUBatch:
    """A one-part ubatch: positions and one seq id (or list) for every token."""
    return RefUBatch(pos=list(pos), seq_ids=[seqs] * len(pos), **kw)


def fill(m: RefKVCells, layout: list[tuple[int, int, set[int]]], stream: int = 0) -> None:
    """Place cells by hand: (cell index, pos, seqs)."""
    c = m.v_cells[stream]
    for idx, p, seqs in layout:
        c.pos_set(idx, p)
        for s in sorted(seqs):
            c.seq_add(idx, s)


def used_cells(m, stream: int = 0) -> list[tuple[int, int, list[int]]]:
    return [(i, p, sorted(s)) for i, (p, s) in enumerate(m.cells(stream)) if p != -1]


# ---------------------------------------------------------------------------------------
# RefCells
# ---------------------------------------------------------------------------------------


def test_cells_seq_bookkeeping_and_multiset():
    c = RefCells(4)
    c.pos_set(1, 5)
    c.seq_add(1, 0)
    c.seq_add(1, 2)
    assert (c.get_used(), c.used_min(), c.used_max_p1()) == (1, 1, 2)
    c.pos_set(3, 5)  # the same position twice for seq 0 (cache reuse / images do this)
    c.seq_add(3, 0)
    assert c.seq_pos[0] == {5: 2}
    assert (c.seq_count(1), c.seq_has(1, 2), c.seq_has(1, 1)) == (2, True, False)
    assert c.seq_rm(3, 0) is True  # last sequence gone -> the cell is empty
    assert c.is_empty(3) and c.seq_pos_min(0) == 5 and c.used_max_p1() == 2
    assert c.seq_rm(1, 0) is False  # seq 2 still holds cell 1
    assert (c.seq_pos_max(0), c.seq_pos_min(2), c.seq_get(1)) == (-1, 5, 2)
    assert c.seq_keep(1, 3) is True  # cell 1 had only seq 2 -> emptied
    assert c.get_used() == 0 and c.used_min() == 0 and c.used_max_p1() == 0
    assert c.seq_keep(0, 3) is False  # empty cell stays empty
    c.check()


def test_cells_seq_keep_keeps_only_that_sequence():
    c = RefCells(2)
    c.pos_set(0, 7)
    for s in (0, 1, 3):
        c.seq_add(0, s)
    assert c.seq_keep(0, 1) is False
    assert c.seq[0] == {1} and c.seq_pos[0] == {} and c.seq_pos[1] == {7: 1} and c.seq_pos[3] == {}
    c.check()


def test_cells_pos_add_and_pos_div_shift():
    c = RefCells(3)
    for i, p in enumerate((2, 7, 9)):
        c.pos_set(i, p)
        c.seq_add(i, 0)
    c.ext_set(0, (1, 2, 42))
    assert c.pos_add(0, -3) is True  # 2 - 3 < 0 -> emptied
    assert c.is_empty(0) and c.shift[0] == 0 and c.ext[0] == EXT_NONE and c.get_has_shift()
    c.pos_div(1, 2)  # 7 // 2 = 3: decision (a) shift = new - old = -4
    assert (c.pos_get(1), c.get_shift(1)) == (3, -4)
    assert c.pos_add(1, 1) is False
    assert (c.pos_get(1), c.get_shift(1)) == (4, -3)
    assert sorted(c.seq_pos[0]) == [4, 9]
    c.reset_shift()
    assert not c.has_shift() and c.shift == [0, 0, 0]
    c.check()


def test_cells_cp_set_roundtrip():
    c = RefCells(4)
    for i, (p, seqs) in enumerate([(0, {0}), (1, {0, 1})]):
        c.pos_set(i, p)
        for s in seqs:
            c.seq_add(i, s)
    before = c.snapshot()
    saved = c.cp([1, 2, 0])
    c.rm(1)
    c.pos_set(2, 9)
    c.seq_add(2, 3)
    c.seq_rm(0, 0)
    c.set([1, 2, 0], saved)
    assert c.snapshot() == before
    c.check()


def test_cells_reset():
    c = RefCells(2)
    c.pos_set(0, 3)
    c.seq_add(0, 1)
    c.pos_add(0, 1)
    c.reset()
    assert c.snapshot() == RefCells(2).snapshot()


# ---------------------------------------------------------------------------------------
# is_masked_swa, slot info, splits
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("swa_type,n_swa,p0,p1,masked", [
    ("none", 4, 0, 1000, False),
    ("standard", 4, 0, 4, True),
    ("standard", 4, 1, 4, False),
    ("chunked", 4, 3, 5, True),      # chunk of p1=5 starts at 4
    ("chunked", 4, 4, 5, False),
    ("chunked", 4, 0, 3, False),
    ("symmetric", 4, 5, 3, False),   # diff -2 within +-2
    ("symmetric", 4, 6, 3, True),    # diff -3
    ("symmetric", 4, 0, 3, True),    # diff 3
    ("symmetric", 4, 1, 3, False),
])
def test_is_masked_swa(swa_type, n_swa, p0, p1, masked):
    assert is_masked_swa(n_swa, swa_type, p0, p1) is masked


def test_slot_info_is_contiguous():
    assert RefSlotInfo(0, 0, [0], [[3, 4, 5]]).is_contiguous()
    assert not RefSlotInfo(0, 0, [0], [[3, 5]]).is_contiguous()
    assert RefSlotInfo(0, 0, [0], [[]]).is_contiguous()
    two = RefSlotInfo(0, 1, [0, 1], [[0, 1], [4, 5]])
    assert not two.is_contiguous()  # llama.cpp: more than one part is never contiguous
    assert two.parts_contiguous()
    assert (two.n_stream(), two.size()) == (2, 2)


def test_split_simple():
    ubs = split_simple([0, 1, 2, 3, 4], 0, 2, tokens=[9, 8, 7, 6, 5])
    assert [u.pos for u in ubs] == [[0, 1], [2, 3], [4]]
    assert [u.tokens for u in ubs] == [[9, 8], [7, 6], [5]]
    assert all(u.n_seqs == u.n_tokens and u.n_seq_tokens == 1 for u in ubs)
    assert split_simple([0, 0], [[0, 1], 2], 8)[0].seq_id_unq == [0, 1, 2]


def test_split_equal_sequential():
    ubs = split_equal([0, 0, 1, 1, 2, 2], [0, 1, 0, 1, 0, 1], 4)
    assert [(u.pos, u.seq_ids, u.n_seqs, u.seq_id_unq) for u in ubs] == [
        ([0, 1, 0, 1], [[0], [0], [1], [1]], 2, [0, 1]),
        ([2, 2], [[0], [1]], 2, [0, 1]),
    ]
    # sequential: only consecutive ids join the first sequence of the ubatch
    ubs = split_equal([0, 0, 0], [2, 0, 1], 8)
    assert [u.seq_ids for u in ubs] == [[[2]], [[0], [1]]]
    # unequal lengths: the ubatch stops when one sequence runs out
    ubs = split_equal([0, 1, 2, 0], [0, 0, 0, 1], 8)
    assert [u.seq_ids for u in ubs] == [[[0], [1]], [[0], [0]]]
    with pytest.raises(ValueError):
        split_equal([0, 0], [[0, 1], 2], 4)


def test_split_equal_non_sequential_coupled():
    ubs = split_equal([0, 1, 0], [[0, 1], [0, 1], 2], 4, sequential=False)
    assert [(u.seq_ids, u.n_seqs) for u in ubs] == [([[0, 1], [2]], 2), ([[0, 1]], 1)]


def test_ubatch_validation():
    with pytest.raises(ValueError):
        RefUBatch(pos=[], seq_ids=[])
    with pytest.raises(ValueError):
        RefUBatch(pos=[0], seq_ids=[[1, 1]])
    with pytest.raises(ValueError):
        RefUBatch(pos=[0, 1, 2], seq_ids=[0, 0, 0], n_seqs=2)


# ---------------------------------------------------------------------------------------
# find_slot
# ---------------------------------------------------------------------------------------


def test_find_slot_head_heuristic():
    m = RefKVCells(16)
    fill(m, [(2, 2, {0}), (3, 3, {0})])
    m.heads[0] = 10  # 10 > used 2 + 2*1 -> restart at 0
    assert m.find_slot(ub([4]), False).idxs == [[0]]
    m.heads[0] = 3  # 3 > 2 + 2? no -> start at 3, cell 3 busy
    assert m.find_slot(ub([4]), False).idxs == [[4]]
    m.heads[0] = 4  # 4 > 2 + 6? no
    assert m.find_slot(ub([4, 5, 6]), False).idxs == [[4, 5, 6]]
    m.heads[0] = 9  # 9 > 2 + 6 -> restart at 0
    assert m.find_slot(ub([4, 5, 6]), False).idxs == [[0, 1, 4]]


def test_find_slot_ring_wrap_cont_and_non_cont():
    m = RefKVCells(8)
    fill(m, [(i, i, {0}) for i in range(2, 6)])
    m.heads[0] = 6
    si = m.find_slot(ub([6, 7, 8, 9]), False)
    assert si.idxs == [[6, 7, 0, 1]] and not si.is_contiguous()
    assert m.find_slot(ub([6, 7]), True).idxs == [[6, 7]]
    # cont: 4 consecutive free cells do not exist; the scan gives up after a full turn
    assert m.find_slot(ub([6, 7, 8, 9]), True) is None
    m.heads[0] = 7  # cont, 2 tokens: 7+2 > 8 wraps to 0 -> cells 0, 1
    assert m.find_slot(ub([6, 7]), True).idxs == [[0, 1]]


def test_find_slot_full_cache_and_too_many_tokens():
    m = RefKVCells(4)
    assert decode(m, [0, 1, 2, 3], 0, 8) is not None
    assert m.find_slot(ub([4]), False) is None  # no SWA: occupied cells are never reused
    assert RefKVCells(4).find_slot(ub(range(5)), False) is None


def test_find_slot_swa_reuse_standard():
    m = RefKVCells(8, n_swa=4, swa_type="standard")
    assert decode(m, range(8), 0, 8)[0].idxs == [list(range(8))]
    assert m.heads == [8]
    # head 8 wraps; pos 0 and 1 are out of the window of the next query (8)
    assert decode(m, [8, 9], 0, 8)[0].idxs == [[0, 1]]
    assert used_cells(m)[:3] == [(0, 8, [0]), (1, 9, [0]), (2, 2, [0])]
    assert (m.seq_pos_min(0), m.seq_pos_max(0), m.heads[0]) == (2, 9, 2)
    # max 9 -> positions <= 6 are masked for query 10: cells 2..6 are reusable, 7 is not
    si = m.find_slot(ub(range(10, 16)), False)
    assert si is None
    assert m.find_slot(ub(range(10, 15)), False).idxs == [[2, 3, 4, 5, 6]]
    m.check()


def test_find_slot_cell_of_two_sequences_is_not_reused():
    m = RefKVCells(4, n_seq_max=2, n_swa=1, swa_type="standard")
    assert decode(m, range(4), [[0, 1]] * 4, 8) is not None
    assert m.find_slot(ub([4], 0), False) is None
    m.seq_rm(1)  # now every cell holds seq 0 alone, and pos < 4 is masked for query 4
    assert m.heads == [4]
    assert m.find_slot(ub([4], 0), False).idxs == [[0]]


def test_find_slot_chunked():
    m = RefKVCells(4, n_swa=2, swa_type="chunked")
    decode(m, range(4), 0, 8)
    # query 4 (max 3 + 1): chunk [4, 6) -> every position < 4 is masked
    assert m.find_slot(ub([4, 5, 6, 7]), False).idxs == [[0, 1, 2, 3]]
    m2 = RefKVCells(4, n_swa=4, swa_type="chunked")
    decode(m2, range(4), 0, 8)
    assert m2.find_slot(ub([4]), False).idxs == [[0]]  # chunk of 4 starts at 4
    m3 = RefKVCells(4, n_swa=8, swa_type="chunked")
    decode(m3, range(4), 0, 8)
    assert m3.find_slot(ub([4]), False) is None  # still in chunk [0, 8)


# ---------------------------------------------------------------------------------------
# apply_ubatch and prepare
# ---------------------------------------------------------------------------------------


def _purge_case() -> RefKVCells:
    # cells hold seq 0 out of cell order: 0:pos2 1:pos0 2:pos1 3:pos3, head 0; window 2
    m = RefKVCells(4, n_swa=2, swa_type="standard")
    fill(m, [(0, 2, {0}), (1, 0, {0}), (2, 1, {0}), (3, 3, {0})])
    return m


def test_apply_ubatch_purges_below_overwritten_position():
    m = _purge_case()
    si = m.find_slot(ub([4]), False)
    assert si.idxs == [[0]]  # pos 2 is masked for query 4 and comes first from the head
    m.apply_ubatch(si, ub([4]))
    # overwriting pos 2 purges seq 0's positions [0, 3): pos 0 (cell 1) and pos 1 (cell 2)
    assert used_cells(m) == [(0, 4, [0]), (3, 3, [0])]
    assert (m.seq_pos_min(0), m.seq_pos_max(0), m.heads) == (3, 4, [1])
    m.check()


def test_prepare_restores_everything_even_purged_cells():
    m = _purge_case()
    before = m.snapshot()
    sinfos = m.prepare([ub([4])])
    assert [s.idxs for s in sinfos] == [[[0]]]
    assert m.snapshot() == before  # cells 1 and 2, purged outside the slot, are back too


def test_prepare_later_ubatches_see_earlier_ones():
    m = RefKVCells(4, n_swa=2, swa_type="standard")
    before = m.snapshot()
    plan = m.init_batch(range(6), 0, 3)
    assert [si.idxs for _, si in plan] == [[[0, 1, 2]], [[3, 0, 1]]]
    assert m.snapshot() == before
    for u, si in plan:
        m.apply_ubatch(si, u)
    assert used_cells(m) == [(0, 4, [0]), (1, 5, [0]), (2, 2, [0]), (3, 3, [0])]
    assert m.heads == [2]
    m.check()


def test_prepare_failure_leaves_cells_unchanged():
    m = RefKVCells(4)
    decode(m, [0], 0, 8)
    before = m.snapshot()
    assert m.init_batch(range(1, 6), 0, 2) is None  # 5 more tokens in 3 free cells
    assert m.snapshot() == before
    assert decode(m, range(1, 6), 0, 2) is None
    assert m.snapshot() == before


def test_apply_ubatch_stores_ext():
    m = RefKVCells(4)
    plan = m.init_batch([0, 1], 0, 4, tokens=[11, 12])
    m.apply_ubatch(plan[0][1], plan[0][0])
    assert m.v_cells[0].ext[:3] == [(0, 0, 11), (0, 0, 12), EXT_NONE]
    u = RefUBatch(pos=[2], seq_ids=[[0]], xy=[(5, 6)])
    m.apply_ubatch(m.find_slot(u), u)
    assert m.v_cells[0].ext_get(2) == (5, 6, -1)


# ---------------------------------------------------------------------------------------
# seq_* operations
# ---------------------------------------------------------------------------------------


def test_seq_rm_and_head():
    m = RefKVCells(8, n_seq_max=2)
    decode(m, range(6), 0, 8)
    assert m.heads == [6]
    assert m.seq_rm(0, 2, 4) is True
    assert m.heads == [2] and [p for p, _ in m.cells()] == [0, 1, -1, -1, 4, 5, -1, -1]
    m.seq_rm(0, 5, -1)  # frees cell 5, not before the head
    assert m.heads == [2]
    m.seq_rm(1, 0, -1)  # seq 1 is nowhere: nothing changes
    assert m.heads == [2]
    m.seq_rm(-1, 0, 1)  # every sequence, positions [0, 1)
    assert m.heads == [0] and [p for p, _ in m.cells()][:2] == [-1, 1]
    m.check()


def test_seq_rm_shared_cells_stay():
    m = RefKVCells(4, n_seq_max=2)
    decode(m, range(3), [[0, 1]] * 3, 8)
    m.seq_rm(1, 1, -1)
    assert used_cells(m) == [(0, 0, [0, 1]), (1, 1, [0]), (2, 2, [0])]
    assert m.heads == [3]  # nothing freed
    assert (m.seq_pos_min(1), m.seq_pos_max(1)) == (0, 0)


def test_seq_add_head_rules():
    m = RefKVCells(8)
    decode(m, range(6), 0, 8)
    m.heads[0] = 5
    m.seq_add(0, 0, -1, 0)  # shift 0: early return, head untouched
    m.seq_add(0, 3, 3, 7)   # empty range: early return
    assert m.heads == [5] and not m.get_has_shift()
    m.seq_add(0, 0, -1, 2)  # nothing freed -> head 0
    assert m.heads == [0] and [p for p, _ in m.cells()][:6] == [2, 3, 4, 5, 6, 7]
    assert m.v_cells[0].shift[:6] == [2] * 6 and m.get_has_shift()
    m.heads[0] = 6
    m.seq_add(0, 3, 5, -10)  # pos 3, 4 (cells 1, 2) go negative -> freed, head 1
    assert m.heads == [1] and [p for p, _ in m.cells()][:6] == [2, -1, -1, 5, 6, 7]
    m.heads[0] = 6
    m.seq_add(0, 5, 3, 1)    # p0 > p1: no cell, but head still becomes 0
    assert m.heads == [0]
    assert m.update() == (True, []) and not m.get_has_shift()
    m.check()


def test_seq_add_moves_shared_cells_for_everyone():
    m = RefKVCells(4, n_seq_max=2)
    decode(m, range(2), [[0, 1]] * 2, 8)
    m.seq_add(1, 0, -1, 3)
    assert (m.seq_pos_min(0), m.seq_pos_max(0)) == (3, 4)


def test_seq_div():
    m = RefKVCells(8, n_seq_max=2)
    decode(m, range(5), 0, 8)
    m.seq_div(0, 1, 4, 2)  # 1, 2, 3 -> 0, 1, 1
    assert [p for p, _ in m.cells()][:5] == [0, 0, 1, 1, 4]
    assert m.v_cells[0].shift[:5] == [0, -1, -1, -2, 0]  # decision (a): new - old
    assert m.v_cells[0].seq_pos[0] == {0: 2, 1: 2, 4: 1}
    m.seq_div(0, 0, -1, 1)  # d == 1: no-op
    assert m.v_cells[0].shift[:5] == [0, -1, -1, -2, 0]
    with pytest.raises(ValueError):
        m.seq_div(0, 0, -1, 0)
    with pytest.raises(ValueError):
        m.seq_div(0, 0, -1, -2)
    m.check()


def test_seq_keep_head():
    m = RefKVCells(8, n_seq_max=2)
    decode(m, range(3), 0, 8)
    decode(m, range(2), 1, 8)
    assert m.heads == [5]
    m.seq_keep(1)
    assert used_cells(m) == [(3, 0, [1]), (4, 1, [1])] and m.heads == [0]
    assert m.seq_pos_max(0) == -1


def test_seq_cp_same_stream_adds_only_missing():
    m = RefKVCells(8, n_seq_max=3)
    decode(m, range(4), 0, 8)
    m.seq_cp(0, 1, 1, 3)
    assert [sorted(s) for _, s in m.cells()][:4] == [[0], [0, 1], [0, 1], [0]]
    m.seq_cp(0, 1)  # decision (b): cells 1 and 2 already hold 1 -> skipped, no corruption
    assert [sorted(s) for _, s in m.cells()][:4] == [[0, 1]] * 4
    assert m.v_cells[0].seq_pos[1] == {0: 1, 1: 1, 2: 1, 3: 1}
    m.seq_cp(2, 2)
    m.seq_cp(1, 1)  # src == dst: no-op
    assert m.pending_copies == []
    m.check()


def test_seq_cp_across_streams():
    m = RefKVCells(8, n_seq_max=2, unified=False)
    decode(m, range(4), 0, 8)
    decode(m, [0, 1], 1, 8)  # will be replaced by the copy
    assert m.heads == [4, 2]
    m.seq_add(0, 0, -1, 3)  # stream 0 cells now at 3..6 with shift 3, head 0
    m.v_cells[0].ext_set(1, (0, 0, 77))
    m.seq_cp(0, 1)
    dst = m.v_cells[1]
    assert used_cells(m, 1) == [(0, 3, [1]), (1, 4, [1]), (2, 5, [1]), (3, 6, [1])]
    assert dst.shift[:4] == [3] * 4 and dst.get_has_shift()
    assert dst.ext[1] == (0, 0, 77)
    assert m.heads == [0, 0] and m.pending_copies == [(0, 1)]
    assert (m.seq_pos_min(1), m.seq_pos_max(1)) == (3, 6)
    for p0, p1 in [(2, 5), (0, 5), (3, -1)]:
        with pytest.raises(ValueError):
            m.seq_cp(0, 1, p0, p1)
    m.seq_cp(1, 0, 0, -1)  # p0 = 0 passes llama.cpp's is_full test
    m.seq_cp(1, 0, 7, 8)   # so do p0 + 1 >= size and p1 + 1 >= size
    assert m.pending_copies == [(0, 1), (1, 0), (1, 0)]
    assert used_cells(m, 0) == [(0, 3, [0]), (1, 4, [0]), (2, 5, [0]), (3, 6, [0])]
    assert m.update() == (True, [(0, 1), (1, 0), (1, 0)])
    assert m.pending_copies == [] and not m.get_has_shift()
    m.check()


def test_sequence_id_validation():
    m = RefKVCells(8, n_seq_max=4)
    for call in (lambda: m.seq_rm(4), lambda: m.seq_rm(-2), lambda: m.seq_cp(-1, 0),
                 lambda: m.seq_cp(0, 4), lambda: m.seq_keep(-1), lambda: m.seq_add(7, 0, -1, 1),
                 lambda: m.seq_div(4, 0, -1, 2), lambda: m.seq_pos_min(4), lambda: m.seq_pos_max(-1),
                 lambda: m.find_slot(ub([0], 4))):
        with pytest.raises(ValueError):
            call()
    assert m.seq_rm(-1) is True
    with pytest.raises(ValueError):
        RefKVCells(8, n_swa=0, swa_type="standard")
    with pytest.raises(ValueError):
        RefKVCells(8, swa_type="sliding")


def test_clear():
    m = RefKVCells(4, n_seq_max=2, unified=False)
    decode(m, [0, 1], 0, 8)
    decode(m, [0], 1, 8)
    m.clear()
    assert m.heads == [0, 0] and m.n_used() == 0
    assert m.snapshot() == RefKVCells(4, n_seq_max=2, unified=False).snapshot()


# ---------------------------------------------------------------------------------------
# several streams
# ---------------------------------------------------------------------------------------


def test_streams_split_and_place_per_sequence():
    m = RefKVCells(8, n_seq_max=2, unified=False)
    sinfos = decode(m, [0, 0, 1, 1, 2, 2], [0, 1, 0, 1, 0, 1], 4)
    assert sinfos == [RefSlotInfo(0, 1, [0, 1], [[0, 1], [0, 1]]), RefSlotInfo(0, 1, [0, 1], [[2], [2]])]
    assert m.heads == [3, 3]
    assert used_cells(m, 0) == [(0, 0, [0]), (1, 1, [0]), (2, 2, [0])]
    assert used_cells(m, 1) == [(0, 0, [1]), (1, 1, [1]), (2, 2, [1])]
    assert m.seq_pos_max(1) == 2
    # a ubatch of seq 1 alone: one part, stream 1; prepare restores every head
    m.heads[:] = [6, 1]
    plan = m.init_batch([3], 1, 4)
    assert plan[0][1] == RefSlotInfo(1, 1, [1], [[3]])
    assert m.heads == [6, 1]  # llama.cpp would restore heads[1] = v_heads_old[0] = 6
    m.seq_rm(0)
    assert m.heads == [0, 1] and m.n_used() == 3
    m.check()


def test_streams_ubatch_must_be_grouped_by_sequence():
    m = RefKVCells(8, n_seq_max=2, unified=False)
    bad = RefUBatch(pos=[0, 0], seq_ids=[[1], [0]], n_seqs=2)
    with pytest.raises(ValueError):
        m.find_slot(bad)
    with pytest.raises(ValueError):
        m.find_slot(RefUBatch(pos=[0, 0, 1], seq_ids=[0, 1, 0]))


# ---------------------------------------------------------------------------------------
# property checks
# ---------------------------------------------------------------------------------------

_ops = st.lists(st.tuples(
    st.sampled_from(["decode", "rm", "cp", "keep", "add", "div"]),
    st.integers(0, 2), st.integers(0, 2),
    st.integers(-1, 12), st.integers(-1, 14), st.integers(-4, 4), st.integers(1, 6),
), max_size=25)


@settings(max_examples=60, deadline=None)
@given(ops=_ops, swa=st.sampled_from([("none", 0), ("standard", 3), ("chunked", 4), ("symmetric", 4)]),
       unified=st.booleans())
def test_random_ops_keep_invariants_and_prepare_is_pure(ops, swa, unified):
    m = RefKVCells(12, n_seq_max=3, unified=unified, n_swa=swa[1], swa_type=swa[0])
    for op, s, t, p0, p1, delta, n in ops:
        if op == "decode":
            start = m.seq_pos_max(s) + 1
            before = m.snapshot()
            plan = m.init_batch(range(start, start + n), s, 4)
            assert m.snapshot() == before
            if plan is not None:
                for u, si in plan:
                    m.apply_ubatch(si, u)
                assert m.seq_pos_max(s) == start + n - 1
        elif op == "rm":
            m.seq_rm(s if t else -1, p0, p1)
        elif op == "cp":
            if unified or s == t:
                m.seq_cp(s, t, p0, p1)
            else:
                m.seq_cp(s, t)
        elif op == "keep":
            m.seq_keep(s)
        elif op == "add":
            m.seq_add(s, p0, p1, delta)
        elif op == "div":
            m.seq_div(s, p0, p1, abs(delta) + 1)
        m.check()
        for st_ in range(m.n_stream):
            assert 0 <= m.heads[st_] <= 12
        m.update()


# ---------------------------------------------------------------------------------------
# replays of llama.cpp's recorded runs
# ---------------------------------------------------------------------------------------


def _load(model: str) -> dict:
    return load_memory_ops(model)


def _section(cells) -> list[list]:
    return [[p, sorted(s)] for p, s in cells if p != -1]


def _replay_ops(run: dict, mem, sections, n_ubatch: int) -> list[str]:
    """Apply every op of a recorded run; return the mismatches (empty when all match)."""
    bad = []
    for k, step in enumerate(run["steps"]):
        op = step["op"]
        kind = op["op"]
        where = f"step {k} ({kind})"
        if "skipped" in step:
            pass
        elif kind == "decode":
            seqs = op["seq_ids"]
            p0 = op["pos0"]
            if isinstance(p0, str):
                assert p0 == f"seq_pos_max({seqs[0]})+1", p0
                p0 = mem.seq_pos_max(seqs[0]) + 1
            positions = list(range(p0, p0 + op["n_tokens"]))
            if "resolved" in step and positions != step["resolved"]["positions"]:
                bad.append(f"{where}: positions {positions} != {step['resolved']['positions']}")
            rc = step.get("rc", step.get("resolved", {}).get("rc"))
            ok = decode(mem, positions, [seqs] * len(positions), n_ubatch) is not None
            if ok != (rc == 0):
                bad.append(f"{where}: decode ok={ok}, llama.cpp rc={rc}")
        elif kind == "seq_cp":
            mem.seq_cp(op["src"], op["dst"], op["p0"], op["p1"])
        elif kind == "seq_rm":
            ret = mem.seq_rm(op["seq"], op["p0"], op["p1"])
            if ret != step["ret"]:
                bad.append(f"{where}: returned {ret}, llama.cpp {step['ret']}")
        elif kind == "seq_add":
            mem.seq_add(op["seq"], op["p0"], op["p1"], op["delta"])
        elif kind == "seq_div":
            mem.seq_div(op["seq"], op["p0"], op["p1"], op["d"])
        elif kind == "seq_keep":
            mem.seq_keep(op["seq"])
        else:
            raise AssertionError(f"unknown op {kind}")

        got_pos = {s: [mem.seq_pos_min(int(s)), mem.seq_pos_max(int(s))] for s in step["pos"]}
        if got_pos != step["pos"]:
            bad.append(f"{where}: pos {got_pos} != {step['pos']}")
        if "cells_all_seq" in step:
            for j, (got, want) in enumerate(zip(sections(), step["cells_all_seq"])):
                if _section(got) != want:
                    bad.append(f"{where}: section {j} cells differ")
        if "sections_seq-1" in step:
            for j, (got, want) in enumerate(zip(sections(), step["sections_seq-1"])):
                ps = sorted(p for p, _ in got if p != -1)
                summary = {
                    "n_cells": len(ps),
                    "pos_min": ps[0] if ps else -1,
                    "pos_max": ps[-1] if ps else -1,
                    "contiguous": ps == list(range(ps[0], ps[-1] + 1)) if ps else True,
                }
                if summary != want:
                    bad.append(f"{where}: section {j} {summary} != {want}")
    return bad


def test_replay_smollm2_default():
    run = _load("smollm2-135m-instruct-q4_1")["default"]
    cp = run["ctx_params"]
    assert (cp["n_ctx_actual"], cp["n_seq_max"], cp["kv_unified"]) == (256, 4, True)
    mem = RefKVCells(cp["n_ctx_actual"], cp["n_seq_max"], unified=True)
    assert _replay_ops(run, mem, lambda: [mem.cells()], cp["n_ubatch"]) == []
    mem.check()


def _gemma_iswa(cp: dict) -> RefISWACells:
    return RefISWACells(cp["n_ctx_actual"], cp["n_seq_max"], unified=cp["kv_unified"], n_swa=512,
                        swa_type="standard", swa_full=cp["swa_full"], n_ubatch=cp["n_ubatch"])


def test_replay_gemma_iswa_full_default():
    run = _load("gemma-3-270m-q4_k_m")["default"]
    mem = _gemma_iswa(run["ctx_params"])
    assert (mem.base.get_size(), mem.swa.get_size(), mem.can_shift) == (256, 256, True)
    bad = _replay_ops(run, mem, lambda: [mem.base.cells(), mem.swa.cells()], run["ctx_params"]["n_ubatch"])
    assert bad == []


def test_replay_gemma_iswa_swa_full_false():
    run = _load("gemma-3-270m-q4_k_m")["swa_full_false_nctx4096"]
    mem = _gemma_iswa(run["ctx_params"])
    assert (mem.base.get_size(), mem.swa.get_size(), mem.can_shift) == (4096, 2304, False)
    skipped = [s["op"]["op"] for s in run["steps"] if "skipped" in s]
    assert skipped == ["seq_add", "seq_div"]
    bad = _replay_ops(run, mem, lambda: [mem.base.cells(), mem.swa.cells()], run["ctx_params"]["n_ubatch"])
    assert bad == []


def test_replay_gemma_swa_window():
    run = _load("gemma-3-270m-q4_k_m")["swa_window"]
    cp = run["ctx_params"]
    assert (cp["kv_unified"], cp["n_seq_max"], cp["swa_full"]) == (False, 1, False)
    mem = _gemma_iswa(cp)
    assert (mem.base.get_size(), mem.swa.get_size()) == (4096, 768)
    bad = _replay_ops(run, mem, lambda: [mem.base.cells(), mem.swa.cells()], cp["n_ubatch"])
    assert bad == []
    mem.base.check()
    mem.swa.check()
    assert mem.seq_pos_min(0) == 332 and mem.base.seq_pos_min(0) == 0


def test_pos_max_constant():
    assert POS_MAX == 2**31 - 1
