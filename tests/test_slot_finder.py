"""The C slot finder (csrc/slot_finder): find_slot, apply_ubatch with its purge, prepare's rollback."""
import numpy as np
import pytest
from helpers import ubatch
from llamax._native.cells import KVCells


def place(kv, ub, cont=False):
    slot = kv.find_slot(ub, cont)
    assert slot is not None
    kv.apply_ubatch(ub, *slot)
    return slot[1].tolist()


def state(kv):
    return [c.snapshot(range(c.size)).tobytes() for c in kv.streams], kv.heads.tobytes()


def test_sequential_fill_from_head():
    kv = KVCells(16, 1, 1)
    assert place(kv, ubatch(range(4), [[0]] * 4)) == [0, 1, 2, 3]
    assert place(kv, ubatch(range(4, 6), [[0]] * 2)) == [4, 5]
    assert int(kv.heads[0]) == 6


def test_head_heuristic_restarts_from_zero():
    kv = KVCells(32, 1, 2)
    place(kv, ubatch(range(20), [[0]] * 20))
    kv.seq_rm(0, 0, 18)            # head moves back to 0 through seq_rm
    kv.heads[0] = 20               # as after other traffic: head far ahead of the 2 used cells
    # head 20 > used 2 + 2*3: the search starts at cell 0
    assert place(kv, ubatch([20, 21, 22], [[0]] * 3)) == [0, 1, 2]


def test_ring_wraps_and_gives_up():
    kv = KVCells(8, 1, 2)
    place(kv, ubatch(range(6), [[0]] * 6))
    kv.seq_rm(0, 0, 2)             # cells 0, 1 free; head back to 0
    kv.heads[0] = 6
    assert place(kv, ubatch([0, 1, 2, 3], [[1]] * 4)) == [6, 7, 0, 1]
    assert kv.find_slot(ubatch([9], [[1]]), False) is None  # full: every cell tested once


def test_continuous_mode_needs_consecutive_cells():
    kv = KVCells(12, 1, 2)
    place(kv, ubatch(range(12), [[0]] * 12))
    kv.seq_rm(0, 2, 4)             # free 2, 3
    kv.seq_rm(0, 6, 9)             # free 6, 7, 8
    assert kv.find_slot(ubatch(range(3), [[1]] * 3), True)[1].tolist() == [6, 7, 8]
    assert kv.find_slot(ubatch(range(3), [[1]] * 3), False)[1].tolist() == [2, 3, 6]
    assert kv.find_slot(ubatch(range(4), [[1]] * 4), True) is None
    assert KVCells.is_contiguous(np.array([0]), np.array([6, 7, 8]))
    assert not KVCells.is_contiguous(np.array([0]), np.array([2, 3, 6]))


def test_swa_reuse_of_masked_cells_and_purge():
    kv = KVCells(8, 1, 1, 4, "standard")
    place(kv, ubatch(range(8), [[0]] * 8))
    # pos 8 comes: cells with pos <= 8 - 4 = 4 are hidden from sequence 0 -> reusable
    assert place(kv, ubatch([8, 9], [[0]] * 2)) == [0, 1]
    assert kv.seq_pos_min(0) == 2 and kv.seq_pos_max(0) == 9
    # overwrite cell 3 (pos 3) while cell 2 (pos 2) stays: the purge removes pos 2 too
    kv.heads[0] = 3
    assert place(kv, ubatch([10], [[0]])) == [3]
    assert kv.seq_pos_min(0) == 4
    assert kv.streams[0].is_empty(2)


def test_swa_never_reuses_shared_cells():
    kv = KVCells(4, 1, 2, 2, "standard")
    place(kv, ubatch(range(4), [[0, 1]] * 4))
    assert kv.find_slot(ubatch([4], [[0]]), False) is None


def test_streams_place_each_sequence_in_its_own_stream():
    kv = KVCells(8, 3, 3)
    ub = ubatch([0, 1, 0, 1], [[0], [0], [2], [2]])
    strm, idxs = kv.find_slot(ub, False)
    assert strm.tolist() == [0, 2] and idxs.tolist() == [0, 1, 0, 1]
    kv.apply_ubatch(ub, strm, idxs)
    assert [int(h) for h in kv.heads] == [2, 0, 2]
    assert kv.seq_pos_max(2) == 1 and kv.streams[1].used == 0


def test_prepare_places_all_then_rolls_back_exactly():
    kv = KVCells(16, 1, 2, 4, "standard")
    place(kv, ubatch(range(12), [[0]] * 12))
    kv.seq_rm(0, 10, -1)
    before = state(kv)
    ubs = [ubatch(range(10, 14), [[0]] * 4), ubatch(range(14, 18), [[0]] * 4), ubatch([0, 1], [[1]] * 2)]
    slots = kv.prepare(ubs)
    assert slots is not None and len(slots) == 3
    assert state(kv) == before
    # applying the prepared slots in order gives the same cells as placing them one by one
    for ub, (strm, idxs) in zip(ubs, slots):
        kv.apply_ubatch(ub, strm, idxs)
    after_plan = state(kv)
    kv2 = KVCells(16, 1, 2, 4, "standard")
    place(kv2, ubatch(range(12), [[0]] * 12))
    kv2.seq_rm(0, 10, -1)
    for ub in ubs:
        place(kv2, ub)
    assert state(kv2) == after_plan


def test_failed_prepare_leaves_cells_byte_identical():
    kv = KVCells(8, 1, 2)
    place(kv, ubatch(range(5), [[0]] * 5))
    before = state(kv)
    assert kv.prepare([ubatch([0, 1], [[1]] * 2), ubatch(range(2, 6), [[1]] * 4)]) is None
    assert state(kv) == before


def test_apply_rejects_a_foreign_slot():
    kv = KVCells(8, 1, 1)
    with pytest.raises(ValueError):
        kv.apply_ubatch(ubatch([0, 1], [[0]] * 2), np.array([0]), np.array([0]))
    with pytest.raises(ValueError):
        kv.apply_ubatch(ubatch([0], [[0]]), np.array([0]), np.array([9]))
