"""The C cell table (csrc/kv_cells) through its wrapper: per-sequence multisets, seq_* ranges,
heads, snapshots."""
import pytest
from helpers import ubatch
from llamax._native.cells import CELL_STATE_DTYPE, Cells, KVCells


def cells_of(kv, stream=0):
    return [(p, sorted(s)) for p, s in kv.cells(stream) if p >= 0]


def fill(kv, seq, positions, cont=False):
    ub = ubatch(positions, [[seq]] * len(positions))
    slot = kv.find_slot(ub, cont)
    assert slot is not None
    kv.apply_ubatch(ub, *slot)
    return slot


def test_new_table_is_empty():
    c = Cells(16)
    assert c.size == 16 and c.used == 0 and c.used_min == 0 and c.used_max_p1 == 0
    assert (c.pos_view() == -1).all() and not c.has_shift
    assert c.seq_pos_min(0) == -1 and c.seq_pos_max(255) == -1
    with pytest.raises(ValueError):
        c.pos_view()[0] = 3  # read-only view


def test_fill_positions_and_used_range():
    kv = KVCells(64, 1, 2)
    fill(kv, 0, range(10))
    c = kv.streams[0]
    assert c.used == 10 and c.used_min == 0 and c.used_max_p1 == 10
    assert kv.seq_pos_min(0) == 0 and kv.seq_pos_max(0) == 9
    assert int(kv.heads[0]) == 10
    assert c.ext_get(3) == (0, 0, 3)  # ubatch() stores the position as a fake token


def test_seq_rm_moves_head_back():
    kv = KVCells(64, 1, 2)
    fill(kv, 0, range(20))
    assert kv.seq_rm(0, 5, 8) is True
    assert kv.seq_pos_min(0) == 0 and kv.seq_pos_max(0) == 19
    assert int(kv.heads[0]) == 5
    assert kv.streams[0].used == 17
    kv.seq_rm(0, 15, -1)
    assert kv.seq_pos_max(0) == 14
    kv.seq_rm(-1)
    assert kv.streams[0].used == 0 and kv.seq_pos_max(0) == -1


def test_seq_cp_shares_cells_and_never_double_counts():
    kv = KVCells(32, 1, 4)
    fill(kv, 0, range(8))
    kv.seq_cp(0, 1, 2, 6)
    kv.seq_cp(0, 1, -1, -1)  # cells 2..5 already hold 1: must not be counted twice
    assert kv.streams[0].seq_n_cells(1) == 8
    kv.seq_rm(1, 0, 8)
    assert kv.seq_pos_max(1) == -1 and kv.seq_pos_max(0) == 7


def test_seq_keep():
    kv = KVCells(32, 1, 4)
    fill(kv, 0, range(4))
    fill(kv, 1, range(4))
    kv.seq_cp(0, 2)
    kv.seq_keep(2)
    assert cells_of(kv) == [(p, [2]) for p in range(4)]
    assert kv.seq_pos_max(0) == -1 and kv.seq_pos_max(1) == -1
    assert int(kv.heads[0]) == 4  # the first freed cell (4) lies below the head (8)


def test_seq_add_frees_cells_pushed_below_zero_and_accumulates_shift():
    kv = KVCells(32, 1, 1)
    fill(kv, 0, range(10))
    kv.seq_add(0, 0, -1, -3)
    c = kv.streams[0]
    assert c.used == 7 and kv.seq_pos_min(0) == 0 and kv.seq_pos_max(0) == 6
    assert int(kv.heads[0]) == 0
    kv.seq_add(0, 2, 5, 10)
    sh = c.shift_view()
    assert sh[3] == -3 and sh[5] == 7 and c.has_shift  # -3 then +10 on pos 2 (cell 5)
    c.reset_shift()
    assert not c.has_shift and not c.shift_view().any()


def test_seq_div_records_the_change_of_position():
    kv = KVCells(32, 1, 1)
    fill(kv, 0, range(10))
    kv.seq_div(0, 4, 10, 2)
    c = kv.streams[0]
    pos = c.pos_view()[:10].tolist()
    assert pos == [0, 1, 2, 3, 2, 2, 3, 3, 4, 4]
    assert c.shift_view()[:10].tolist() == [0, 0, 0, 0, -2, -3, -3, -4, -4, -5]
    assert kv.seq_pos_max(0) == 4
    with pytest.raises(ValueError):
        kv.seq_div(0, 0, 4, 0)


def test_multiset_counts_repeated_positions():
    kv = KVCells(16, 1, 1)
    fill(kv, 0, [0, 1, 1, 1, 2])
    kv.seq_rm(0, 2, 3)
    assert kv.seq_pos_max(0) == 1
    # remove one of the three cells at pos 1 by emptying it through a snapshot restore
    c = kv.streams[0]
    st = c.snapshot([1])
    st["pos"] = -1
    st["seq"] = 0
    c.restore([1], st)
    assert kv.seq_pos_max(0) == 1 and c.used == 3
    kv.seq_rm(0, 1, 2)
    assert kv.seq_pos_max(0) == 0


def test_snapshot_restore_roundtrip():
    kv = KVCells(16, 1, 3)
    fill(kv, 0, range(6))
    kv.seq_cp(0, 2, 1, 4)
    c = kv.streams[0]
    before = c.cells()
    snap = c.snapshot(range(16))
    assert snap.dtype == CELL_STATE_DTYPE
    kv.seq_rm(-1)
    fill(kv, 1, range(9))
    c.restore(range(16), snap)
    assert c.cells() == before
    assert kv.seq_pos_max(2) == 3 and kv.seq_pos_max(1) == -1 and kv.seq_pos_max(0) == 5


def test_errors():
    kv = KVCells(8, 1, 2)
    with pytest.raises(ValueError):
        kv.seq_rm(2)
    with pytest.raises(ValueError):
        kv.seq_cp(0, 5)
    with pytest.raises(ValueError):
        KVCells(8, 3, 2)  # streams must be 1 or n_seq_max
    with pytest.raises(ValueError):
        KVCells(8, 1, 1, 0, "standard")
    with pytest.raises(IndexError):
        kv.streams[0].pos_get(8)


def test_cross_stream_seq_cp_copies_cells_and_head():
    kv = KVCells(16, 2, 2)
    fill(kv, 0, range(5))
    assert kv.seq_cp(0, 1) == (0, 1)
    assert cells_of(kv, 1) == [(p, [1]) for p in range(5)]
    assert int(kv.heads[1]) == int(kv.heads[0])
    with pytest.raises(ValueError):
        kv.seq_cp(0, 1, 2, 4)


def test_dump_shows_the_cell_map():
    kv = KVCells(8, 1, 2)
    fill(kv, 0, range(3))
    kv.seq_cp(0, 1, 0, 1)
    assert kv.dump().splitlines()[1] == "M00....."


@pytest.mark.parametrize("swa_type", ["none", "standard", "chunked", "symmetric"])
def test_masked_swa_of_many_keys_is_is_masked_swa_of_each(swa_type):
    import numpy as np

    kv = KVCells(16, 1, 1, 0 if swa_type == "none" else 6, swa_type)
    p0 = np.arange(0, 40, dtype=np.int32).reshape(5, 8)
    for p1 in (0, 5, 13, 39):
        got = kv.masked_swa(p0, p1)
        assert got.shape == p0.shape and got.dtype == np.bool_
        assert got.tolist() == [[kv.is_masked_swa(int(p), p1) for p in row] for row in p0]
