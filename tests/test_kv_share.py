"""Sharing cells between sequences (for a prefix cache): KVCache.seq_unshare, reusable_prefix and
held_only_by, and the same three on KVCacheISWA. Every result is checked against what the cell
table and the K/V buffers held before (copies bit-identical, the other sequences untouched)."""
import itertools
import random

import numpy as np
import pytest

from llamax import Batch, KVCache, KVCacheISWA, NoKVSlotError, RoPE

# (type_k / type_v, v_trans): a quantized V cannot be stored transposed
CONFIGS = [("f16", True), ("f16", False), ("q8_0", False), ("q4_0", False)]
IDS = [f"{t}-{'vtrans' if vt else 'rows'}" for t, vt in CONFIGS]
N_LAYER, N_HEAD_KV, HEAD_DIM = 2, 2, 64


def make(t="f16", v_trans=False, kv_size=64, n_seq_max=4, **kw):
    return KVCache(N_LAYER, N_HEAD_KV, HEAD_DIM, kv_size, n_seq_max=n_seq_max, type_k=t, type_v=t,
                   v_trans=v_trans, rope=RoPE(HEAD_DIM), **kw)


def decode(mem, tokens, seq, rng, pos=None):
    """Place tokens on seq (every layer gets random K/V): what a model's decode does to the cache."""
    for ub in mem.plan(Batch(list(tokens), pos=pos, seq_ids=seq)):
        for il in range(mem.n_layer):
            n = ub.n_tokens
            k = rng.standard_normal((n, N_HEAD_KV, HEAD_DIM)).astype(np.float32)
            v = rng.standard_normal((n, N_HEAD_KV, HEAD_DIM)).astype(np.float32)
            mem.store(il, ub, k, v)


def cells_of(mem, seq):
    """{pos: cell index} of seq (unified cache, stream 0)."""
    return {p: i for i, (p, s) in enumerate(mem.cells()) if seq in s}


def toks(mem, idx):
    return mem.meta.streams[0].snapshot(np.asarray(idx, dtype=np.int64))["tok"].tolist()


def k_row(mem, il, cell):
    return mem.k[il][0, cell]


def v_row(mem, il, cell):
    return mem.v[il][0, :, :, cell] if mem.v_trans else mem.v[il][0, cell]


def buffers(mem):
    return [a.tobytes() for a in mem.k + mem.v]


def state(mem):
    return mem.cells(), buffers(mem), [s.snapshot(range(s.size)).tobytes() for s in mem.meta.streams]


def attend_one(mem, token, seq, *, seed, n_head):
    """Every layer's attention output for one new token on seq, with random q / k / v from seed."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, n_head, HEAD_DIM)).astype(np.float32)
    k = rng.standard_normal((1, N_HEAD_KV, HEAD_DIM)).astype(np.float32)
    v = rng.standard_normal((1, N_HEAD_KV, HEAD_DIM)).astype(np.float32)
    out = []
    for ub in mem.plan(Batch([token], seq_ids=seq)):
        for il in range(N_LAYER):
            mem.store(il, ub, k, v)
            out.append(mem.attend(il, ub, q))
    return np.stack(out)


def build_shared(t, v_trans, rng):
    """seq 0: tokens 100..109 at 0..9; seq 1: seq 0's cells 0..5 (seq_cp) then its own 6..8;
    seq 2: seq 0's cells 0..3."""
    mem = make(t, v_trans)
    decode(mem, range(100, 110), 0, rng)
    mem.seq_cp(0, 1, 0, 6)
    decode(mem, [200, 201, 202], 1, rng)
    mem.seq_cp(0, 2, 0, 4)
    return mem


# ---- seq_unshare ------------------------------------------------------------------------------
@pytest.mark.parametrize("t,v_trans", CONFIGS, ids=IDS)
def test_unshare_copies_exactly_the_shared_cells_in_range(t, v_trans):
    rng = np.random.default_rng(1)
    mem = build_shared(t, v_trans, rng)
    before = mem.cells()
    c0, c1, c2 = cells_of(mem, 0), cells_of(mem, 1), cells_of(mem, 2)
    assert sorted(c1) == list(range(9)) and all(c1[p] == c0[p] for p in range(6))
    k0 = {(il, p): k_row(mem, il, c).copy() for il in range(N_LAYER) for p, c in c0.items()}
    v0 = {(il, p): v_row(mem, il, c).copy() for il in range(N_LAYER) for p, c in c0.items()}
    used = mem.n_used

    assert mem.seq_unshare(1, 2, -1) == 4          # positions 2..5 are shared; 6..8 are seq 1's own
    assert mem.n_used == used + 4
    after1 = cells_of(mem, 1)
    assert sorted(after1) == list(range(9))
    assert after1[0] == c0[0] and after1[1] == c0[1]  # outside the range: still shared
    for p in range(6, 9):
        assert after1[p] == c1[p]                    # not shared: not copied
    for p in range(2, 6):
        c = after1[p]
        assert c not in c0.values() and mem.cells()[c] == (p, frozenset({1}))
        assert toks(mem, [c]) == [100 + p]
        for il in range(N_LAYER):
            np.testing.assert_array_equal(k_row(mem, il, c), k0[il, p])
            np.testing.assert_array_equal(v_row(mem, il, c), v0[il, p])
    # seq 0 and seq 2 keep their cells, positions, tokens and rows
    assert cells_of(mem, 0) == c0 and cells_of(mem, 2) == c2
    assert toks(mem, [c0[p] for p in range(10)]) == list(range(100, 110))
    for (il, p), row in k0.items():
        np.testing.assert_array_equal(k_row(mem, il, c0[p]), row)
        np.testing.assert_array_equal(v_row(mem, il, c0[p]), v0[il, p])
    for i, (p, s) in enumerate(before):  # the old cells only lost seq 1 (for positions 2..5)
        if p < 0:
            continue
        now = mem.cells()[i]
        assert now[0] == p and now[1] == (s - {1} if 2 <= p < 6 else s)
    assert mem.seq_unshare(1, 2, -1) == 0           # nothing left to copy
    assert mem.seq_unshare(1, 0, 2) == 2            # the rest: positions 0, 1
    assert mem.seq_unshare(1) == 0


@pytest.mark.parametrize("t,v_trans", CONFIGS, ids=IDS)
def test_shift_after_unshare_moves_only_the_unshared_sequence(t, v_trans):
    rng = np.random.default_rng(2)
    mem = build_shared(t, v_trans, rng)
    c0, c2 = cells_of(mem, 0), cells_of(mem, 2)
    k0 = [a[0].copy() for a in mem.k]
    assert mem.seq_unshare(1, 0, -1) == 6
    mem.seq_add(1, 2, -1, 7)
    assert cells_of(mem, 0) == c0 and cells_of(mem, 2) == c2  # positions of the others unchanged
    assert sorted(cells_of(mem, 1)) == [0, 1] + list(range(9, 16))
    mem.update()  # the K-shift rotates seq 1's rows only
    for il in range(N_LAYER):
        for p, c in c0.items():
            np.testing.assert_array_equal(mem.k[il][0, c], k0[il][c])
    # without unshare, a shift of shared cells moves them for every sequence (llama.cpp's cell model)
    rng = np.random.default_rng(2)
    ref = build_shared(t, v_trans, rng)
    ref.seq_add(1, 2, -1, 7)
    assert sorted(cells_of(ref, 0)) != list(range(10))


@pytest.mark.parametrize("t,v_trans", CONFIGS, ids=IDS)
def test_unshare_between_three_sequences(t, v_trans):
    rng = np.random.default_rng(3)
    mem = make(t, v_trans)
    decode(mem, range(8), 0, rng)
    mem.seq_cp(0, 1)
    mem.seq_cp(0, 2)
    assert mem.seq_unshare(1) == 8
    c0 = cells_of(mem, 0)
    assert cells_of(mem, 2) == c0                           # 0 and 2 still share every cell
    assert all(mem.cells()[c][1] == {0, 2} for c in c0.values())
    assert set(cells_of(mem, 1).values()).isdisjoint(c0.values())
    assert mem.seq_unshare(0) == 8 and mem.seq_unshare(2) == 0
    assert mem.n_used == 24


@pytest.mark.parametrize("t,v_trans", CONFIGS, ids=IDS)
def test_unshare_without_room_raises_and_changes_nothing(t, v_trans):
    rng = np.random.default_rng(4)
    mem = make(t, v_trans, kv_size=16)
    decode(mem, range(12), 0, rng)
    mem.seq_cp(0, 1)
    decode(mem, [50, 51, 52], 1, rng)   # 15 of 16 cells used, 12 shared
    before = state(mem)
    with pytest.raises(NoKVSlotError):
        mem.seq_unshare(1)
    assert state(mem) == before
    with pytest.raises(NoKVSlotError):
        mem.seq_unshare(1, 5, 7)         # 2 copies, 1 free cell
    assert state(mem) == before
    assert mem.seq_unshare(1, 11, 12) == 1   # 1 copy fits
    assert mem.n_used == 16


@pytest.mark.parametrize("t,v_trans", CONFIGS, ids=IDS)
def test_attention_of_the_other_sequence_is_unchanged_by_unshare(t, v_trans):
    """Two caches built the same way; one unshares (and shifts) seq 1. seq 0's next token gets the
    bit-identical attention output from both (the copies are masked out for seq 0)."""
    outs = []
    for unshare in (False, True):
        rng = np.random.default_rng(5)
        mem = make(t, v_trans)
        decode(mem, range(10), 0, rng)
        mem.seq_cp(0, 1, 0, 6)
        if unshare:
            assert mem.seq_unshare(1) == 6
            mem.seq_add(1, 0, -1, 3)
            mem.update()
        outs.append(attend_one(mem, 7, 0, seed=6, n_head=4))
    np.testing.assert_array_equal(outs[1], outs[0])


@pytest.mark.parametrize("t,v_trans", CONFIGS, ids=IDS)
def test_unshared_then_shifted_sequence_attends_as_a_fresh_copy(t, v_trans):
    """seq 1 = seq 0's prefix through seq_cp + unshare + shift, against seq 1 decoded with its own
    cells holding the same K/V rows and shifted the same way: the same attention (up to order)."""
    outs = []
    for via_share in (True, False):
        rng = np.random.default_rng(7)
        mem = make(t, v_trans)
        ks = rng.standard_normal((N_LAYER, 8, N_HEAD_KV, HEAD_DIM)).astype(np.float32)
        vs = rng.standard_normal((N_LAYER, 8, N_HEAD_KV, HEAD_DIM)).astype(np.float32)
        seqs = [0] if via_share else [0, 1]
        for s in seqs:
            for ub in mem.plan(Batch(list(range(8)), seq_ids=s)):
                for il in range(N_LAYER):
                    mem.store(il, ub, ks[il], vs[il])
        if via_share:
            mem.seq_cp(0, 1)
            assert mem.seq_unshare(1) == 8
        mem.seq_rm(1, 2, 4)
        mem.seq_add(1, 4, -1, -2)
        mem.update()
        assert sorted(cells_of(mem, 1)) == list(range(6))
        outs.append(attend_one(mem, 9, 1, seed=8, n_head=2))
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-6)


def test_unshare_on_a_sliding_window_drops_the_hidden_cells():
    rng = np.random.default_rng(9)
    mem = make(kv_size=32, n_swa=4, swa_type="standard")
    decode(mem, range(100, 110), 0, rng)
    mem.seq_cp(0, 1)
    c0 = cells_of(mem, 0)
    # the next token of seq 1 (position 10) sees 7, 8, 9: those are copied, 0..6 just leave seq 1
    assert mem.seq_unshare(1) == 3
    c1 = cells_of(mem, 1)
    assert sorted(c1) == [7, 8, 9]
    assert set(c1.values()).isdisjoint(c0.values())
    assert toks(mem, [c1[p] for p in (7, 8, 9)]) == [107, 108, 109]
    assert cells_of(mem, 0) == c0 and all(mem.cells()[c][1] == {0} for c in c0.values())
    for il in range(N_LAYER):
        for p in (7, 8, 9):
            np.testing.assert_array_equal(mem.k[il][0, c1[p]], mem.k[il][0, c0[p]])
            np.testing.assert_array_equal(mem.v[il][0, c1[p]], mem.v[il][0, c0[p]])
    assert mem.seq_pos_min(1) == 7 and mem.seq_pos_max(1) == 9
    assert mem.seq_unshare(1) == 0


def test_unshare_on_a_sliding_window_with_every_cell_hidden_copies_nothing():
    rng = np.random.default_rng(10)
    mem = make(kv_size=32, n_swa=4, swa_type="standard")
    decode(mem, range(10), 0, rng)
    mem.seq_cp(0, 1, 0, 3)   # seq 1 holds 0..2; at position 3 its window shows 0..2: all copied
    assert mem.seq_unshare(1) == 3
    mem.seq_cp(0, 2)         # seq 2 holds 0..9
    used = mem.n_used
    assert mem.seq_unshare(2, 0, 6) == 0  # 0..5 are hidden from seq 2 (next position 10): dropped
    assert sorted(cells_of(mem, 2)) == [6, 7, 8, 9] and mem.n_used == used


def test_unshare_on_a_sliding_window_without_room_changes_nothing():
    """Cells 0..6 are hidden from seq 1 but seq 2 still sees them, so none is reusable; the three
    copies of 7..9 find no room and seq_unshare raises: the cells must be as they were."""
    rng = np.random.default_rng(11)
    mem = make(kv_size=10, n_swa=4, swa_type="standard")
    decode(mem, range(10), 0, rng)
    mem.seq_cp(0, 1)
    mem.seq_cp(0, 2, 0, 7)
    before = state(mem)
    with pytest.raises(NoKVSlotError):
        mem.seq_unshare(1)
    assert state(mem) == before


# ---- reusable_prefix ----------------------------------------------------------------------------
def oracle_prefix(held: set, n: int, n_swa: int) -> int:
    """The largest m <= n whose token sees only held positions below it."""
    if n <= 0:
        return 0
    for m in range(n, -1, -1):
        lo = max(0, m - n_swa + 1) if n_swa else 0
        if all(p in held for p in range(lo, m)):
            return m
    return 0


def test_reusable_prefix_without_a_window():
    rng = np.random.default_rng(12)
    mem = make(kv_size=32)
    decode(mem, range(10), 0, rng)
    for n, want in ((0, 0), (-3, 0), (1, 1), (5, 5), (10, 10), (11, 10), (100, 10)):
        assert mem.reusable_prefix(0, n) == want
    assert mem.reusable_prefix(1, 5) == 0  # an empty sequence
    mem.seq_rm(0, 4, 5)                    # a hole at 4
    for n, want in ((3, 3), (4, 4), (5, 4), (10, 4), (50, 4)):
        assert mem.reusable_prefix(0, n) == want
    mem.seq_rm(0, 0, 1)
    assert mem.reusable_prefix(0, 10) == 0
    mem.seq_cp(0, 1)                       # a copy has the same holes
    assert mem.reusable_prefix(1, 10) == 0
    with pytest.raises(ValueError):
        mem.reusable_prefix(9, 3)


def test_reusable_prefix_with_a_standard_window():
    W = 4
    rng = np.random.default_rng(13)
    mem = make(kv_size=64, n_swa=W, swa_type="standard")
    decode(mem, range(20), 0, rng)
    assert mem.reusable_prefix(0, 20) == 20
    mem.seq_rm(0, 2, 3)                   # position 2 missing
    assert mem.reusable_prefix(0, 2) == 2
    assert mem.reusable_prefix(0, 5) == 2   # m = 3, 4, 5 see position 2
    assert mem.reusable_prefix(0, 6) == 6   # m = 6 sees 3, 4, 5 only
    assert mem.reusable_prefix(0, 20) == 20
    mem.seq_rm(0, 0, 10)                  # everything below 10 missing
    assert mem.reusable_prefix(0, 13) == 13  # sees 10, 11, 12 (the last W - 1)
    assert mem.reusable_prefix(0, 12) == 0   # sees 9, which is missing
    mem.seq_rm(0, 17, 18)                 # one of the last W - 1 below 20 missing
    assert mem.reusable_prefix(0, 20) == 17
    assert mem.reusable_prefix(0, 19) == 17
    assert mem.reusable_prefix(0, 30) == 17  # 20..29 are not held
    mem.seq_rm(0, 15, 16)                    # 10..14 held but 15 missing: m = 17 sees 14, 15, 16
    assert mem.reusable_prefix(0, 20) == 15  # m = 15 sees 12, 13, 14


@pytest.mark.parametrize("swa", [("none", 0), ("standard", 3), ("standard", 6)])
def test_reusable_prefix_matches_an_oracle_on_random_holes(swa):
    swa_type, W = swa
    r = random.Random(14 + W)
    rng = np.random.default_rng(14)
    mem = make(kv_size=64, n_seq_max=1, n_swa=W, swa_type=swa_type)
    for _ in range(40):
        mem.clear()
        n_tok = r.randint(0, 30)
        if n_tok:
            decode(mem, range(n_tok), 0, rng)
        for _ in range(r.randint(0, 4)):
            p = r.randrange(0, 32)
            mem.seq_rm(0, p, p + r.randint(1, 3))
        held = set(cells_of(mem, 0))
        for n in (r.randint(-1, 35), len(held), n_tok, n_tok + 1):
            assert mem.reusable_prefix(0, n) == oracle_prefix(held, n, W), (sorted(held), n)


# ---- held_only_by -------------------------------------------------------------------------------
def per_cell_bytes(t, n_layer=N_LAYER):
    vals = N_HEAD_KV * HEAD_DIM
    row = {"f16": 2 * vals, "f32": 4 * vals, "q8_0": vals // 32 * 34, "q4_0": vals // 32 * 18}[t]
    return 2 * n_layer * row


def oracle_held(mem, seq_ids):
    return sum(1 for p, s in mem.cells() if p >= 0 and s <= set(seq_ids))


@pytest.mark.parametrize("t,v_trans", CONFIGS, ids=IDS)
def test_held_only_by(t, v_trans):
    rng = np.random.default_rng(15)
    mem = make(t, v_trans)
    assert mem.held_only_by([0, 1]) == (0, 0)
    decode(mem, range(10), 0, rng)
    mem.seq_cp(0, 1, 0, 5)
    decode(mem, [1, 2, 3], 1, rng)
    decode(mem, [4, 5, 6, 7], 2, rng)
    per = per_cell_bytes(t)
    assert (mem.breakdown()["k"] + mem.breakdown()["v"]) == per * mem.kv_size
    want = {(): 0, (0,): 5, (1,): 3, (2,): 4, (0, 1): 13, (0, 2): 9, (1, 2): 7, (0, 1, 2): 17, (3,): 0}
    for ids, n in want.items():
        assert mem.held_only_by(ids) == (n, n * per)
        assert oracle_held(mem, ids) == n
    assert mem.held_only_by(range(4))[0] == mem.n_used
    with pytest.raises(ValueError):
        mem.held_only_by([7])


def test_held_only_by_with_one_stream_per_sequence():
    rng = np.random.default_rng(16)
    mem = make(kv_size=16, n_seq_max=3, unified=False)
    decode(mem, range(5), 0, rng)
    decode(mem, range(3), 2, rng)
    per = per_cell_bytes("f16")
    assert mem.held_only_by([0]) == (5, 5 * per)
    assert mem.held_only_by([2]) == (3, 3 * per)
    assert mem.held_only_by([0, 1, 2]) == (8, 8 * per)
    assert mem.held_only_by([1]) == (0, 0)


def test_held_only_by_matches_an_oracle_on_random_sharing():
    r = random.Random(17)
    rng = np.random.default_rng(17)
    mem = make(kv_size=64, n_seq_max=4)
    per = per_cell_bytes("f16")
    for _ in range(30):
        op = r.random()
        s = r.randrange(4)
        if op < 0.4:
            try:
                decode(mem, range(r.randint(1, 5)), s, rng)
            except NoKVSlotError:
                pass
        elif op < 0.7:
            mem.seq_cp(s, r.randrange(4), r.randint(-1, 10), r.randint(-1, 20))
        elif op < 0.9:
            mem.seq_rm(s, r.randint(-1, 10), r.randint(-1, 20))
        else:
            try:
                mem.seq_unshare(s, r.randint(-1, 10), -1)
            except NoKVSlotError:
                pass
        for k in range(5):
            for ids in itertools.combinations(range(4), k):
                n = oracle_held(mem, ids)
                assert mem.held_only_by(ids) == (n, n * per)


# ---- KVCacheISWA ---------------------------------------------------------------------------------
def make_iswa():
    return KVCacheISWA(n_layer=4, n_head_kv=2, head_dim=64, kv_size=256, swa_layers=[0, 2], n_swa=8,
                       n_seq_max=4, rope=RoPE(64))


def decode_iswa(mem, tokens, seq, rng):
    for ub in mem.plan(Batch(list(tokens), seq_ids=seq)):
        for il in range(mem.n_layer):
            n = ub.n_tokens
            mem.store(il, ub, rng.standard_normal((n, 2, 64)).astype(np.float32),
                      rng.standard_normal((n, 2, 64)).astype(np.float32))


def test_iswa_unshare_copies_in_both_caches():
    rng = np.random.default_rng(18)
    mem = make_iswa()
    decode_iswa(mem, range(100, 120), 0, rng)
    mem.seq_cp(0, 1)
    b0, s0 = cells_of(mem.base, 0), cells_of(mem.swa, 0)
    assert sorted(s0) == list(range(20))
    # base: all 20 copied; SWA: position 20 sees 13..19 (7 cells), 0..12 just leave seq 1
    assert mem.seq_unshare(1) == 27
    b1, s1 = cells_of(mem.base, 1), cells_of(mem.swa, 1)
    assert sorted(b1) == list(range(20)) and sorted(s1) == list(range(13, 20))
    assert set(b1.values()).isdisjoint(b0.values()) and set(s1.values()).isdisjoint(s0.values())
    assert cells_of(mem.base, 0) == b0 and cells_of(mem.swa, 0) == s0
    assert toks(mem.base, [b1[p] for p in range(20)]) == list(range(100, 120))
    assert toks(mem.swa, [s1[p] for p in range(13, 20)]) == list(range(113, 120))
    for sub, c0, c1 in ((mem.base, b0, b1), (mem.swa, s0, s1)):
        for li in range(sub.n_layer):
            for p, c in c1.items():
                np.testing.assert_array_equal(sub.k[li][0, c], sub.k[li][0, c0[p]])
                np.testing.assert_array_equal(sub.v[li][0, c], sub.v[li][0, c0[p]])
    assert mem.seq_unshare(1) == 0
    mem.seq_add(1, 0, -1, 5)
    assert cells_of(mem.base, 0) == b0 and cells_of(mem.swa, 0) == s0
    assert mem.seq_pos_min(1) == 18 and mem.seq_pos_max(1) == 24


def test_iswa_reusable_prefix_takes_the_smaller_of_both_caches():
    rng = np.random.default_rng(19)
    mem = make_iswa()
    decode_iswa(mem, range(20), 0, rng)
    assert mem.reusable_prefix(0, 20) == 20 and mem.reusable_prefix(0, 30) == 20
    mem.swa.seq_rm(0, 3, 4)              # the SWA cache lost position 3: its window at 20 does not care
    assert mem.reusable_prefix(0, 20) == 20
    assert mem.reusable_prefix(0, 9) == 3  # m = 4..10 see position 3 through the window of 8
    mem.swa.seq_rm(0, 15, 16)
    assert mem.reusable_prefix(0, 20) == 15  # m = 15 sees 8..14
    mem.base.seq_rm(0, 12, 13)
    assert mem.reusable_prefix(0, 20) == 12  # the base cache needs every position; the SWA cache at 12 sees 5..11
    mem.base.seq_rm(0, 10, 11)
    assert mem.reusable_prefix(0, 20) == 3   # base: 10; the SWA cache at 10 sees 3 (missing), so 3
    mem.seq_rm(0, 0, 1)
    assert mem.reusable_prefix(0, 20) == 0


def test_iswa_held_only_by_sums_both_caches():
    rng = np.random.default_rng(20)
    mem = make_iswa()
    decode_iswa(mem, range(20), 0, rng)
    mem.seq_cp(0, 1, 0, 5)
    decode_iswa(mem, range(3), 2, rng)
    per = per_cell_bytes("f16", n_layer=2)  # each sub-cache holds 2 of the 4 layers
    assert mem.held_only_by([0]) == (30, 30 * per)
    assert mem.held_only_by([0, 1]) == (40, 40 * per)
    assert mem.held_only_by([2]) == (6, 6 * per)
    assert mem.held_only_by([1]) == (0, 0)
    assert mem.held_only_by([0, 1, 2])[0] == mem.n_used == 46
