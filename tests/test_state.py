"""State save/load (llama_state_*): round trips of standalone caches (whole and one sequence, into
another sequence id, fragmented, SWA windows, iSWA, pending K-shifts, quantized rows), every
compatibility check, Hypothesis-driven corruption (truncation, bit flips, splices, foreign blobs:
StateError and an empty destination, never another exception), files with their tokens, and the
real SmolLM2: logits after a restore equal those before the save, bit for bit."""
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from llamax import Batch, KVCache, KVCacheISWA, RoPE, StateError, state
from llamax.context import Context

from helpers import without

SMALL = dict(n_layer=2, n_head_kv=2, head_dim=8, kv_size=32, n_seq_max=3)


def make(**kw) -> KVCache:
    a = dict(SMALL, **kw)
    return KVCache(a.pop("n_layer"), a.pop("n_head_kv"), a.pop("head_dim"), a.pop("kv_size"), **a)


def make_iswa(**kw) -> KVCacheISWA:
    a = dict(n_layer=3, n_head_kv=2, head_dim=8, kv_size=512, swa_layers=[1], n_swa=4, n_ubatch=8, n_seq_max=3)
    a.update(kw)
    return KVCacheISWA(a.pop("n_layer"), a.pop("n_head_kv"), a.pop("head_dim"), a.pop("kv_size"), **a)


def fill(mem, batch: Batch, seed: int = 0, n_ubatch: int = 8) -> None:
    """Place a batch and store deterministic random K/V for every layer."""
    rng = np.random.default_rng(seed)
    sub = mem if isinstance(mem, KVCache) else mem.base
    for ub in mem.plan(batch, n_ubatch=n_ubatch):
        n = ub.n_tokens
        for il in range(mem.n_layer):
            mem.store(il, ub, rng.standard_normal((n, sub.n_head_kv, sub.head_dim)).astype(np.float32),
                      rng.standard_normal((n, sub.n_head_kv, sub.head_dim_v)).astype(np.float32))


def rows_of(kv: KVCache, seq: int) -> dict:
    """pos -> (K bytes, V bytes) over every layer for the cells of seq (a cache-layout-free view)."""
    out = {}
    for s, cells in enumerate(kv.meta.streams):
        for i, (p, seqs) in enumerate(cells.cells()):
            if seq in seqs:
                k = b"".join(a[s, i].tobytes() for a in kv.k)
                v = b"".join((a[s, ..., i] if kv.v_trans else a[s, i]).tobytes() for a in kv.v)
                out[p] = (k, v)
    return out


def two_seqs(**kw) -> KVCache:
    kv = make(**kw)
    fill(kv, Batch(list(range(10)), seq_ids=[0] * 6 + [2] * 4), seed=1)
    fill(kv, Batch([1, 2, 3, 4], seq_ids=[0, 1, 2, 1], logits=[True] * 4), seed=2)
    return kv


# ---- round trips --------------------------------------------------------------------------------
@pytest.mark.parametrize("unified", [True, False])
@pytest.mark.parametrize("v_trans", [False, True])
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_whole_round_trip_is_exact_and_saves_the_same_bytes(unified, v_trans, dtype):
    kv = two_seqs(unified=unified, v_trans=v_trans, type_k=dtype, type_v=dtype)
    kv.seq_rm(0, 2, 4)  # a hole: several runs
    blob = state.get_data(kv)
    dst = make(unified=unified, v_trans=v_trans, type_k=dtype, type_v=dtype)
    fill(dst, Batch([7] * 5, seq_ids=[1] * 5), seed=9)  # replaced entirely
    assert state.set_data(dst, blob) == len(blob)
    assert dst.cells() == kv.cells()
    assert np.array_equal(dst.meta.heads, kv.meta.heads)
    for st_, cells in enumerate(kv.meta.streams):
        used = np.flatnonzero(cells.pos_view() >= 0)
        for a, b in zip(kv.k, dst.k):
            assert np.array_equal(a[st_, used], b[st_, used])
        for a, b in zip(kv.v, dst.v):
            assert np.array_equal(a[st_, ..., used] if v_trans else a[st_, used],
                                  b[st_, ..., used] if v_trans else b[st_, used])
    for s in range(3):
        assert dst.seq_pos_min(s) == kv.seq_pos_min(s) and dst.seq_pos_max(s) == kv.seq_pos_max(s)
    assert state.get_data(dst) == blob
    # a cache with more cells takes it too, at the same indices
    big = make(unified=unified, v_trans=v_trans, type_k=dtype, type_v=dtype, kv_size=64)
    state.set_data(big, blob)
    assert big.cells()[:32] == kv.cells()[:32]


@pytest.mark.parametrize("unified", [True, False])
@pytest.mark.parametrize("v_trans", [False, True])
def test_sequence_restores_into_another_sequence(unified, v_trans):
    kv = two_seqs(unified=unified, v_trans=v_trans)
    blob = state.get_data(kv, 0)
    want = rows_of(kv, 0)
    dst = make(unified=unified, v_trans=v_trans)
    fill(dst, Batch([3] * 5, seq_ids=[1] * 5), seed=5)
    fill(dst, Batch([3] * 3, seq_ids=[2] * 3), seed=6)
    others = {s: rows_of(dst, s) for s in (1,)}
    cells1 = [c for c in dst.cells() if 1 in c[1]]
    assert state.set_data(dst, blob, 2) == len(blob)  # replaces sequence 2
    assert rows_of(dst, 2) == want
    assert dst.seq_pos_min(2) == kv.seq_pos_min(0) and dst.seq_pos_max(2) == kv.seq_pos_max(0)
    assert rows_of(dst, 1) == others[1] and [c for c in dst.cells() if 1 in c[1]] == cells1
    assert dst.seq_pos_max(0) == -1
    # the sequence state of the restored copy is the same bytes, under the new id's bitset
    again = state.get_data(dst, 2)
    kv2 = make(unified=unified, v_trans=v_trans)
    state.set_data(kv2, again, 0)
    assert rows_of(kv2, 0) == want


def test_fragmented_sequence_and_fragmented_destination():
    # seq 0 interleaved with seq 1: every other cell -> many runs
    kv = make(kv_size=64, n_seq_max=2)
    fill(kv, Batch([1] * 24, pos=[i // 2 for i in range(24)], seq_ids=[0, 1] * 12))
    blob = state.get_data(kv, 0)
    want = rows_of(kv, 0)
    # destination: no 12 consecutive free cells, 12 free ones in all -> the non-contiguous fallback
    dst = make(kv_size=32, n_seq_max=2)
    fill(dst, Batch([1] * 32, pos=[i // 2 for i in range(32)], seq_ids=[0, 1] * 16))
    dst.seq_rm(0, 0, 12)  # frees 12 cells, one in two
    state.set_data(dst, blob, 0)
    assert rows_of(dst, 0) == want
    # not enough room at all: StateError, the destination sequence empty, the other untouched
    dst.seq_rm(0)
    fill(dst, Batch([1] * 8, seq_ids=[0] * 8))
    fill(dst, Batch([1] * 5, seq_ids=[1] * 5))  # 32 - 8 - (16 + 5) ... the cache is nearly full
    before1 = rows_of(dst, 1)
    k_before = [a.copy() for a in dst.k + dst.v]
    assert dst.n_cells - dst.n_used + 8 < 12
    with pytest.raises(StateError, match="no room"):
        state.set_data(dst, blob, 0)
    assert dst.seq_pos_max(0) == -1 and rows_of(dst, 1) == before1
    assert all(np.array_equal(a, b) for a, b in zip(k_before, dst.k + dst.v))


def test_empty_states():
    kv = make()
    blob = state.get_data(kv)
    dst = two_seqs()
    state.set_data(dst, blob)
    assert dst.n_used == 0
    dst = two_seqs()
    state.set_data(dst, state.get_data(kv, 1), 0)  # an empty sequence empties the destination
    assert dst.seq_pos_max(0) == -1 and dst.seq_pos_max(2) == 4


@pytest.mark.parametrize("v_trans", [False, True])
def test_every_way_of_writing_gives_the_same_blob(v_trans):
    """getvalue (a new bytes object), write_into (a caller's buffer) and parts (a file) write the
    same bytes: chunks padded with zeros (f16 rows of 6 bytes, runs of odd lengths), the data
    checksum the XOR of the data region's little-endian words as numpy counts it."""
    kv = make(n_head_kv=1, head_dim=3, type_k="f16", type_v="f16", v_trans=v_trans)
    fill(kv, Batch(list(range(9)), seq_ids=[0, 1, 0, 0, 2, 0, 1, 0, 0]))
    kv.seq_rm(0, 3, 4)  # a hole: runs of 1, 2 and 3 cells
    for seq_id, kind in ((-1, state.KIND_MEMORY), (0, state.KIND_SEQ)):
        w = state.writer(kv, seq_id)
        blob = w.getvalue(kind, state.NO_FINGERPRINT)
        assert len(blob) == w.size
        parts = w.parts(kind, state.NO_FINGERPRINT)
        assert b"".join(p.tobytes() if isinstance(p, np.ndarray) else p for p in parts) == blob
        buf = bytearray(b"\xee" * (w.size + 5))
        assert w.write_into(buf, kind, state.NO_FINGERPRINT) == w.size
        assert bytes(buf[:w.size]) == blob and buf[w.size:] == b"\xee" * 5  # nothing past the blob
        meta_len, data_len, data_xor = np.frombuffer(blob, "<u8", count=3, offset=32)
        data = np.frombuffer(blob, "<u8", offset=64 + int(meta_len) + (-int(meta_len) % 8))
        assert data.size * 8 == data_len and int(np.bitwise_xor.reduce(data)) == data_xor
        small = bytearray(w.size - 1)
        with pytest.raises(ValueError, match="holds"):
            w.write_into(small, kind, state.NO_FINGERPRINT)
        assert small == bytearray(w.size - 1)  # nothing written
        with pytest.raises(ValueError, match="read-only"):
            w.write_into(bytes(w.size), kind, state.NO_FINGERPRINT)
        dst = make(n_head_kv=1, head_dim=3, type_k="f16", type_v="f16", v_trans=v_trans)
        assert state.set_data(dst, buf, seq_id) == len(blob)
        assert all(rows_of(dst, s) == rows_of(kv, s) for s in ((0, 1, 2) if seq_id < 0 else (0,)))


@pytest.mark.parametrize("swa_type", ["standard", "chunked"])
def test_only_cells_inside_the_window_are_written(swa_type):
    kv = make(kv_size=64, n_swa=4, swa_type=swa_type, n_seq_max=2)
    fill(kv, Batch(list(range(10)), seq_ids=[0] * 10))
    kv.seq_cp(0, 1, 0, 3)  # positions 0..2 also in seq 1, whose last position is 2: still visible to it
    seq_blob = state.get_data(kv, 0)
    dst = make(kv_size=64, n_swa=4, swa_type=swa_type, n_seq_max=2)
    state.set_data(dst, seq_blob, 0)
    visible = {p for p, s in kv.cells() if 0 in s and not kv.meta.is_masked_swa(p, 9)}
    assert {p for p, s in dst.cells() if s} == visible and len(visible) < 10
    assert rows_of(dst, 0) == {p: r for p, r in rows_of(kv, 0).items() if p in visible}
    whole = state.get_data(kv)
    state.set_data(dst, whole)
    assert {p for p, s in dst.cells() if s} == visible | {0, 1, 2}
    assert state.get_data(dst) == whole


def test_iswa_round_trip_and_failure_in_the_swa_cache():
    mem = make_iswa()
    fill(mem, Batch(list(range(12)), seq_ids=[0] * 12))
    fill(mem, Batch(list(range(5)), seq_ids=[1] * 5), seed=3)
    blob = state.get_data(mem)
    dst = make_iswa()
    state.set_data(dst, blob)
    assert dst.base.cells() == mem.base.cells()
    # the SWA cache keeps what the window (4) still shows: seq 0 from position 8, seq 1 from 1
    assert sorted((p, min(s)) for p, s in dst.swa.cells() if s) == sorted([(p, 0) for p in range(8, 12)]
                                                                         + [(p, 1) for p in range(1, 5)])
    assert state.get_data(dst) == blob
    # one sequence: the base keeps every position, the SWA cache only its window
    seq = state.get_data(mem, 0)
    dst = make_iswa()
    state.set_data(dst, seq, 2)
    assert rows_of(dst.base, 2) == rows_of(mem.base, 0)
    assert set(rows_of(dst.swa, 2)) == {p for p in rows_of(mem.swa, 0) if p > 11 - 4}
    assert rows_of(dst.swa, 2) == {p: r for p, r in rows_of(mem.swa, 0).items() if p > 7}
    # room in the base cache but not in the SWA cache: the sequence is gone from both, nothing else moves
    dst = make_iswa()
    fill(dst, Batch([1] * 254, seq_ids=[1] * 254), n_ubatch=64)
    dst.seq_cp(1, 2)  # cells held by two sequences cannot be reused: 2 free SWA cells for 4
    fill(dst, Batch([1, 1], seq_ids=[0, 0]))
    rows = [rows_of(c, 1) for c in (dst.base, dst.swa)]
    with pytest.raises(StateError, match="no room"):
        state.set_data(dst, seq, 0)
    assert dst.seq_pos_max(0) == -1 and dst.base.seq_pos_max(0) == -1
    assert [rows_of(c, 1) for c in (dst.base, dst.swa)] == rows
    ref = make_iswa()
    fill(ref, Batch([1] * 254, seq_ids=[1] * 254), n_ubatch=64)
    ref.seq_cp(1, 2)
    assert dst.base.cells() == ref.base.cells() and dst.swa.cells() == ref.swa.cells()
    # a KVCache section is not an iSWA one, and the other way round
    with pytest.raises(StateError, match="kv_cache"):
        state.set_data(make(), blob)
    with pytest.raises(StateError, match="kv_cache"):
        state.set_data(make_iswa(), state.get_data(two_seqs()))


def test_pending_shift_is_applied_before_saving():
    rope = RoPE(8)
    kv = make(rope=rope)
    fill(kv, Batch(list(range(6)), seq_ids=[0] * 6))
    kv.seq_add(0, 0, -1, 5)
    blob = state.get_data(kv)
    assert not kv.meta.get_has_shift()  # saving applied the K-shift, as the next decode would
    dst = make(rope=rope)
    state.set_data(dst, blob)
    assert dst.cells() == kv.cells() and not dst.meta.get_has_shift()
    assert all(np.array_equal(a, b) for a, b in zip(kv.k, dst.k))


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0"])
def test_quantized_rows(qtype):
    try:
        kv = make(head_dim=32, type_k=qtype, type_v=qtype)
    except ValueError as e:
        pytest.skip(f"no quantized KV cache here: {e}")
    fill(kv, Batch(list(range(7)), seq_ids=[0] * 5 + [1] * 2))
    dst = make(head_dim=32, type_k=qtype, type_v=qtype)
    blob = state.get_data(kv)
    state.set_data(dst, blob)
    assert state.get_data(dst) == blob
    dst = make(head_dim=32, type_k=qtype, type_v=qtype)
    state.set_data(dst, state.get_data(kv, 0), 1)
    assert rows_of(dst, 1) == rows_of(kv, 0)
    with pytest.raises(StateError, match="type_k"):
        state.set_data(make(head_dim=32), blob)


# ---- compatibility checks -------------------------------------------------------------------------
FOREIGN = {
    "type_k": dict(type_k="f32"),
    "type_v": dict(type_v="f32"),
    "v_trans": dict(v_trans=True),
    "n_layer": dict(n_layer=3),
    "n_stream": dict(unified=False),
    "head_dim": dict(head_dim=16),
    "n_head_kv": dict(n_head_kv=1),
    "swa_type": dict(n_swa=4, swa_type="standard"),
}


@pytest.mark.parametrize("field", sorted(FOREIGN))
def test_incompatible_configuration_is_refused_and_leaves_the_destination_empty(field):
    src = two_seqs(**FOREIGN[field])
    whole, seq = state.get_data(src), state.get_data(src, 0)
    dst = two_seqs()
    with pytest.raises(StateError, match=field):
        state.set_data(dst, whole)
    assert dst.n_used == 0
    dst = two_seqs()
    cells = dst.cells()
    with pytest.raises(StateError, match=field):
        state.set_data(dst, seq, 1)
    assert dst.cells() == without(cells, 1)


def test_rotation_fields_are_checked():
    src = two_seqs()
    blob = state.get_data(src)
    dst = two_seqs()
    dst.rot_k = 64  # what a Hadamard-rotated quantized K would record
    with pytest.raises(StateError, match="rot_k"):
        state.set_data(dst, blob)
    assert dst.n_used == 0


def test_kind_fingerprint_version_and_sizes():
    src = two_seqs()
    whole, seq = state.get_data(src, fingerprint="model A"), state.get_data(src, 1, fingerprint="model A")
    for blob, dest in ((whole, 0), (seq, -1)):
        with pytest.raises(StateError, match="state, expected"):
            state.set_data(two_seqs(), blob, dest, fingerprint="model A")
    with pytest.raises(StateError, match="another model"):
        state.set_data(two_seqs(), whole, fingerprint="model B")
    with pytest.raises(StateError, match="another model"):
        state.set_data(two_seqs(), whole)
    state.set_data(two_seqs(), whole, fingerprint="model A")
    # an unknown version is refused before anything else is read
    v2 = bytearray(whole)
    v2[8] = 2
    with pytest.raises(StateError, match="version 2"):
        state.set_data(two_seqs(), bytes(v2), fingerprint="model A")
    with pytest.raises(StateError, match="magic"):
        state.set_data(two_seqs(), b"GGSN" + whole[4:], fingerprint="model A")
    # cells beyond a smaller cache: refused for a whole restore
    big = make(kv_size=64)
    fill(big, Batch(list(range(40)), seq_ids=[0] * 40))
    with pytest.raises(StateError, match="cells"):
        state.set_data(make(), state.get_data(big))
    with pytest.raises(StateError, match="cells"):
        state.set_data(make(), state.get_data(big, 0), 0)
    # a whole state with a sequence id this cache does not have
    many = make(n_seq_max=8)
    fill(many, Batch([1, 2], seq_ids=[0, 7]))
    with pytest.raises(StateError, match="n_seq_max"):
        state.set_data(make(), state.get_data(many))
    # bytes after the blob are not read, and the count says so
    assert state.set_data(two_seqs(), whole + b"more", fingerprint="model A") == len(whole)
    with pytest.raises(ValueError):
        state.get_data(src, 3)
    with pytest.raises(ValueError):
        state.set_data(src, seq, 5)


# ---- corruption (Hypothesis) ------------------------------------------------------------------------
def _configs():
    src = two_seqs()
    whole, seq = state.get_data(src), state.get_data(src, 0)
    foreign = []
    for kw in FOREIGN.values():
        f = two_seqs(**kw)
        foreign += [state.get_data(f), state.get_data(f, 0)]
    return whole, seq, foreign


WHOLE, SEQ, FOREIGN_BLOBS = _configs()
HYP = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def check_refused(blob: bytes, dest: int) -> None:
    """blob must raise StateError (and nothing else) and leave the destination empty."""
    dst = two_seqs()
    before = dst.cells()
    rows = {s: rows_of(dst, s) for s in range(3)}
    with pytest.raises(StateError):
        state.set_data(dst, blob, dest)
    if dest < 0:
        assert dst.n_used == 0
    else:
        assert dst.cells() == without(before, dest) and dst.seq_pos_max(dest) == -1
        assert all(rows_of(dst, s) == rows[s] for s in range(3) if s != dest)


@HYP
@given(data=st.data())
def test_truncated_blob(data):
    blob, dest = data.draw(st.sampled_from([(WHOLE, -1), (SEQ, 1)]))
    n = data.draw(st.integers(0, len(blob) - 1))
    check_refused(blob[:n], dest)


@HYP
@given(data=st.data())
def test_bit_flip_anywhere(data):
    blob, dest = data.draw(st.sampled_from([(WHOLE, -1), (SEQ, 1)]))
    bit = data.draw(st.integers(0, 8 * len(blob) - 1))
    b = bytearray(blob)
    b[bit // 8] ^= 1 << (bit % 8)
    check_refused(bytes(b), dest)


@HYP
@given(data=st.data())
def test_foreign_and_spliced_blobs(data):
    other = data.draw(st.sampled_from(FOREIGN_BLOBS))
    mine, dest = data.draw(st.sampled_from([(WHOLE, -1), (SEQ, 1)]))
    if data.draw(st.booleans()):
        check_refused(other, dest)
    else:  # the head of another configuration's blob spliced onto a good one
        k = data.draw(st.integers(1, min(len(other), len(mine)) - 1))
        assume(other[:k] != mine[:k])
        check_refused(other[:k] + mine[k:], dest)


def test_every_single_bit_flip_and_every_truncation_of_a_small_blob():
    kv = make(n_layer=1, n_head_kv=1, kv_size=16)
    fill(kv, Batch([1, 2, 3], seq_ids=[0, 0, 1]))
    blob = state.get_data(kv)
    dst = make(n_layer=1, n_head_kv=1, kv_size=16)
    for n in range(len(blob)):
        with pytest.raises(StateError):
            state.set_data(dst, blob[:n])
    b = bytearray(blob)
    for bit in range(8 * len(blob)):
        b[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(StateError):
            state.set_data(dst, b)
        b[bit // 8] ^= 1 << (bit % 8)
    assert state.set_data(dst, b) == len(blob) and dst.cells() == kv.cells()


# ---- the real model ---------------------------------------------------------------------------------
def test_context_round_trip_gives_the_same_logits(model, tmp_path):
    ctx = Context(model, n_ctx=256)
    prompt = model.tokenize("The capital of France is")
    ctx.decode(Batch(prompt, logits=[True, False, True, False, True]))
    logits = ctx.get_logits().copy()
    blob = ctx.state_get_data()
    fresh = Context(model, n_ctx=256)
    assert fresh.state_set_data(blob) == len(blob)
    assert np.array_equal(fresh.get_logits(), logits)
    assert np.array_equal(fresh.get_logits_ith(2), ctx.get_logits_ith(2))
    assert fresh.state_get_data() == blob  # saved again: the same bytes
    buf = np.zeros(fresh.state_get_size() + 3, np.uint8)  # into a caller's buffer: the same bytes
    assert fresh.state_get_size() == len(blob) == fresh.state_get_data_into(buf)
    assert buf[:len(blob)].tobytes() == blob and not buf[len(blob):].any()
    ctx.decode(Batch([5085]))
    fresh.decode(Batch([5085]))
    assert np.array_equal(fresh.get_logits(), ctx.get_logits())  # bit for bit: same cells, same kernels
    # files keep the tokens
    path = tmp_path / "ctx.state"
    ctx.state_save_file(path, prompt + [5085])
    other = Context(model, n_ctx=256)
    assert other.state_load_file(path) == prompt + [5085]
    assert np.array_equal(other.get_logits(), ctx.get_logits())
    other.decode(Batch([29]))
    ctx.decode(Batch([29]))
    assert np.array_equal(other.get_logits(), ctx.get_logits())


def test_context_sequence_into_another_context(model, tmp_path):
    src = Context(model, n_ctx=256)
    src.decode(Batch(model.tokenize("Once upon a time")))
    seq = src.state_seq_get_data(0)
    dst = Context(model, n_ctx=256, n_seq_max=4)
    assert dst.state_seq_set_data(seq, 3) == len(seq)
    buf = bytearray(dst.state_seq_get_size(3))
    assert dst.state_seq_get_data_into(buf, 3) == len(seq) == len(buf)
    assert dst.state_seq_get_data(3) == buf  # written as sequence 3: the same bytes as the seq_get_data
    assert dst.memory.seq_pos_max(3) == src.memory.seq_pos_max(0)
    src.decode(Batch([11]))
    dst.decode(Batch([11], seq_ids=[3]))
    assert np.array_equal(dst.get_logits(), src.get_logits())  # the same cells: bit for bit
    # next to another sequence, through a file, in a non-unified context
    path = tmp_path / "seq.state"
    src.state_seq_save_file(path, 0, [1, 2, 3])
    dst = Context(model, n_ctx=1024, n_seq_max=4, kv_unified=False)
    with pytest.raises(StateError, match="n_stream"):
        dst.state_seq_load_file(path, 3)
    src2 = Context(model, n_ctx=1024, n_seq_max=4, kv_unified=False)
    src2.decode(Batch.one(model.tokenize("Once upon a time"), seq_id=2))
    src2.state_seq_save_file(path, 2, [1, 2, 3])
    dst.decode(Batch.one(model.tokenize("Hello there my friend"), seq_id=0))
    assert dst.state_seq_load_file(path, 3) == [1, 2, 3]
    src2.decode(Batch([11], seq_ids=[2]))
    dst.decode(Batch([11], seq_ids=[3]))
    np.testing.assert_allclose(dst.get_logits(), src2.get_logits(), rtol=1e-4, atol=1e-4)


def test_context_refusals_leave_the_destination_empty(model, tmp_path):
    ctx = Context(model, n_ctx=256, n_seq_max=2)
    ctx.decode(Batch.one(model.tokenize("The capital of France is"), seq_id=0))
    ctx.decode(Batch.one(model.tokenize("Hi"), seq_id=1))
    blob = ctx.state_get_data()
    seq = ctx.state_seq_get_data(0)
    # another cache configuration (flash attention off: V transposed)
    other = Context(model, n_ctx=256, n_seq_max=2, flash_attn=False)
    other.decode(Batch.one(model.tokenize("Hi"), seq_id=1))
    with pytest.raises(StateError, match="v_trans"):
        other.state_set_data(blob)
    assert other.memory.n_used == 0 and other.get_logits().shape == (0, model.n_vocab)
    # a foreign fingerprint
    w, kind = ctx._writer(-1)
    with pytest.raises(StateError, match="another model"):
        Context(model, n_ctx=256, n_seq_max=2).state_set_data(w.getvalue(kind, bytes(16)))
    # a corrupt sequence: only the destination goes, sequence 1 stays as it was
    dst = Context(model, n_ctx=256, n_seq_max=2)
    dst.state_set_data(blob)
    cells = dst.memory.cells()
    bad = bytearray(seq)
    bad[-3] ^= 0x10
    with pytest.raises(StateError, match="checksum"):
        dst.state_seq_set_data(bytes(bad), 0)
    assert dst.memory.cells() == without(cells, 0)
    # files: trailing bytes and a corrupt token list are refused
    path = tmp_path / "s.state"
    ctx.state_save_file(path, [1, 2])
    path.write_bytes(path.read_bytes() + b"x")
    with pytest.raises(StateError, match="unexpected bytes"):
        dst.state_load_file(path)
    assert dst.memory.n_used == 0
    ctx.state_save_file(path, [1, 2])
    raw = bytearray(path.read_bytes())
    raw[17] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(StateError, match="checksum"):
        dst.state_load_file(path)
    with pytest.raises(ValueError):
        ctx.state_save_file(path, [-1])
    with pytest.raises(ValueError):
        dst.state_seq_set_data(seq, 2)
