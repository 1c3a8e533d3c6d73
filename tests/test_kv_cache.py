"""The KV cache as a user drives it: plan / store / attend against an independent numpy model of
attention over each sequence's history; the seq_* operations; K-shift; streams; failures that must
leave the cache byte-identical; the KV size line."""
import logging
import math

import numpy as np
import pytest

import llamax
from llamax import Batch, BatchError, KVCache, KVCacheISWA, LlamaxError, NoKVSlotError, RoPE
from llamax._native import rope as native_rope


class History:
    """Per sequence, every (pos, k, v) ever stored, per layer: the reference the cache must agree with."""

    def __init__(self, n_layer, dtype):
        self.rows = [dict() for _ in range(n_layer)]  # layer -> seq -> list of (pos, k, v)
        self.dtype = dtype

    def add(self, il, seqs, pos, k, v):
        k = k.astype(self.dtype).astype(np.float32)
        v = v.astype(self.dtype).astype(np.float32)
        for t in range(len(pos)):
            for s in seqs[t]:
                self.rows[il].setdefault(s, []).append((int(pos[t]), k[t], v[t]))

    def attend(self, il, seq, pos, q, scale, n_swa=0):
        """Causal attention of q [n_head, d] at pos over seq's history (a standard window if n_swa)."""
        rows = [r for r in self.rows[il].get(seq, []) if r[0] <= pos and (not n_swa or pos - r[0] < n_swa)]
        ks = np.stack([r[1] for r in rows])  # [n, n_head_kv, d]
        vs = np.stack([r[2] for r in rows])
        n_head, n_kv_head = q.shape[0], ks.shape[1]
        out = np.empty((n_head, vs.shape[2]), np.float32)
        for h in range(n_head):
            hk = h // (n_head // n_kv_head)
            s = ks[:, hk] @ q[h] * scale
            w = np.exp(s - s.max())
            out[h] = (w / w.sum()) @ vs[:, hk]
        return out


def run_batch(kv, hist, batch, rng, n_ubatch=4, n_head=4, n_swa_of=lambda il: 0):
    """Plan, store random K/V, attend; compare every token's output with the history model."""
    plan = kv.plan(batch, n_ubatch=n_ubatch)
    n_layer = len(hist.rows)
    for ub in plan:
        seqs = [[s for s in range(256) if (int(ub.seq_bits[t, s // 64]) >> (s % 64)) & 1] for t in range(ub.n_tokens)]
        for il in range(n_layer):
            k = rng.standard_normal((ub.n_tokens, kv_heads(kv), 8)).astype(np.float32)
            v = rng.standard_normal((ub.n_tokens, kv_heads(kv), 8)).astype(np.float32)
            q = rng.standard_normal((ub.n_tokens, n_head, 8)).astype(np.float32)
            kv.store(il, ub, k, v)
            hist.add(il, seqs, ub.pos, k, v)
            out = kv.attend(il, ub, q)
            for t in range(ub.n_tokens):
                ref = hist.attend(il, seqs[t][0], ub.pos[t], q[t], 1 / math.sqrt(8), n_swa_of(il))
                np.testing.assert_allclose(out[t], ref, rtol=2e-4, atol=2e-5)


def kv_heads(kv):
    return kv.n_head_kv if isinstance(kv, KVCache) else kv.base.n_head_kv


@pytest.mark.parametrize("unified", [True, False])
@pytest.mark.parametrize("v_trans", [False, True])
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_attention_over_the_cache_matches_each_sequence_history(unified, v_trans, dtype):
    rng = np.random.default_rng(1)
    kv = KVCache(2, 2, 8, 64, n_seq_max=3, unified=unified, type_k=dtype, type_v=dtype, v_trans=v_trans)
    hist = History(2, np.float16 if dtype == "f16" else np.float32)
    run_batch(kv, hist, Batch(list(range(10)), seq_ids=[0] * 6 + [2] * 4), rng)
    run_batch(kv, hist, Batch([5, 6, 7, 8, 9, 10], seq_ids=[0, 0, 1, 1, 2, 2]), rng)
    for step in range(3):  # single-token decodes of three sequences at once
        run_batch(kv, hist, Batch([1, 2, 3], seq_ids=[0, 1, 2], logits=[True] * 3), rng)
    assert kv.seq_pos_max(0) == 10 and kv.seq_pos_max(1) == 4 and kv.seq_pos_max(2) == 8


def test_shared_prefix_through_seq_cp():
    rng = np.random.default_rng(2)
    kv = KVCache(1, 1, 8, 32, n_seq_max=3)
    hist = History(1, np.float16)
    run_batch(kv, hist, Batch.one(list(range(8)), seq_id=0), rng, n_head=2)
    for s in (1, 2):
        kv.seq_cp(0, s)
        hist.rows[0][s] = list(hist.rows[0][0])
    assert kv.n_used == 8  # a unified cache shares the cells
    run_batch(kv, hist, Batch([1, 2, 3], seq_ids=[0, 1, 2], logits=[True] * 3), rng, n_head=2)
    assert kv.n_used == 11


def test_sliding_window_reuses_cells_and_attends_within_the_window():
    rng = np.random.default_rng(3)
    kv = KVCache(1, 1, 8, 16, n_swa=5, swa_type="standard")
    hist = History(1, np.float16)
    for start in range(0, 40, 4):
        run_batch(kv, hist, Batch.one(list(range(4)), seq_id=0), rng, n_head=1, n_swa_of=lambda il: 5)
    assert kv.n_used <= 16 and kv.seq_pos_max(0) == 39 and kv.seq_pos_min(0) >= 39 - 16


def test_iswa_attends_per_layer_kind():
    rng = np.random.default_rng(4)
    kv = KVCacheISWA(2, 1, 8, 256, swa_layers=[1], n_swa=6, n_ubatch=4, n_seq_max=2)
    assert kv.swa.kv_size == 256  # pad256(min(256, 6*2 + 4))
    hist = History(2, np.float16)
    for _ in range(5):
        run_batch(kv, hist, Batch([1, 2, 3, 4], seq_ids=[0, 0, 1, 1], logits=[True] * 4), rng, n_head=2,
                  n_swa_of=lambda il: 6 if il == 1 else 0)


def test_iswa_sizes_as_llama_cpp():
    assert llamax.memory.swa_cache_size(4096, 512, 4, True, 256, False) == 2304
    assert llamax.memory.swa_cache_size(4096, 512, 1, False, 256, False) == 768
    assert llamax.memory.swa_cache_size(256, 512, 4, True, 256, False) == 256
    assert llamax.memory.swa_cache_size(4096, 512, 4, True, 256, True) == 4096
    kv = KVCacheISWA(3, 1, 8, 4096, swa_layers=[0, 2], n_swa=512, n_ubatch=256, n_seq_max=4)
    assert (kv.base.kv_size, kv.swa.kv_size) == (4096, 2304)
    assert kv.base.layer_ids == [1] and kv.swa.layer_ids == [0, 2]
    assert not kv.can_shift


def snapshot(kv):
    caches = [kv] if isinstance(kv, KVCache) else [kv.base, kv.swa]
    out = []
    for c in caches:
        out += [a.tobytes() for a in c.k + c.v]
        out += [s.snapshot(range(s.size)).tobytes() for s in c.meta.streams]
        out.append(c.meta.heads.tobytes())
    return out


def fill(kv, batch, n_ubatch=512):
    for ub in kv.plan(batch, n_ubatch=n_ubatch):
        for il in range(kv.n_layer):
            n, h = ub.n_tokens, kv_heads(kv)
            kv.store(il, ub, np.full((n, h, 8), il + 1, np.float32), np.full((n, h, 8), -il, np.float32))


@pytest.mark.parametrize("make", [
    lambda: KVCache(2, 1, 8, 32, n_seq_max=2),
    lambda: KVCache(2, 1, 8, 32, n_seq_max=2, unified=False),
    lambda: KVCacheISWA(2, 1, 8, 32, swa_layers=[1], n_swa=4, n_ubatch=8, n_seq_max=2),
])
def test_failed_batches_leave_the_cache_byte_identical(make):
    kv = make()
    fill(kv, Batch([1] * 20, seq_ids=[0] * 10 + [1] * 10, logits=[False] * 19 + [True]))
    before = snapshot(kv)
    bad = [
        Batch([1, 2], seq_ids=[0, 5]),                 # seq id outside n_seq_max
        Batch([1, 2], pos=[3, 4], seq_ids=[0, 0]),     # does not continue sequence 0 (max 9)
        Batch([1, 2, 3], pos=[10, 12, 13]),            # gap inside the batch
    ]
    for b in bad:
        with pytest.raises(BatchError):
            kv.plan(b)
        assert snapshot(kv) == before
    with pytest.raises(NoKVSlotError):
        kv.plan(Batch([1] * 40, seq_ids=[1] * 40), n_ubatch=8)
    assert snapshot(kv) == before
    with pytest.raises(ValueError):
        kv.plan(Batch([1]), n_ubatch=0)
    assert snapshot(kv) == before


def test_store_and_attend_check_their_inputs():
    kv = KVCache(1, 2, 8, 16)
    plan = kv.plan(Batch.one([1, 2, 3]))
    stale = None
    for ub in plan:
        with pytest.raises(ValueError):
            kv.store(0, ub, np.zeros((3, 2, 7), np.float32), np.zeros((3, 2, 8), np.float32))
        with pytest.raises(ValueError):
            kv.store(0, ub, np.zeros((3, 2, 8), np.int32), np.zeros((3, 2, 8), np.float32))
        with pytest.raises(ValueError):
            kv.store(1, ub, np.zeros((3, 2, 8), np.float32), np.zeros((3, 2, 8), np.float32))
        with pytest.raises(ValueError):
            kv.attend(0, ub, np.zeros((3, 3, 8), np.float32))  # 3 heads over 2 kv heads
        stale = ub
    with pytest.raises(ValueError):
        kv.attend(0, stale, np.zeros((3, 2, 8), np.float32))  # the plan is over


def test_k_shift_rotates_cached_k_by_the_change_of_position():
    rope = RoPE(8, freq_base=10000.0, kind="neox")
    kv = KVCache(1, 2, 8, 32, type_k="f32", rope=rope)
    rng = np.random.default_rng(5)
    raw = rng.standard_normal((10, 2, 8)).astype(np.float32)
    for ub in kv.plan(Batch.one(list(range(10)))):
        k = raw.copy()
        native_rope.rope_f32(k, ub.pos, 8, 10000.0, 1.0, 2, 1)
        kv.store(0, ub, k, k)
    kv.seq_rm(0, 0, 3)
    kv.seq_add(0, 3, -1, -3)    # positions 3..9 -> 0..6
    kv.seq_div(0, 0, -1, 2)     # then halved: 0..3
    assert kv.meta.get_has_shift()
    assert kv.update() and not kv.meta.get_has_shift()
    pos = kv.meta.streams[0].pos_view()
    for cell in range(3, 10):
        expect = raw[cell:cell + 1].copy()
        native_rope.rope_f32(expect, np.array([pos[cell]], np.int32), 8, 10000.0, 1.0, 2, 1)
        np.testing.assert_allclose(kv.k[0][0, cell], expect[0], atol=2e-5)


def test_shift_without_rope_is_refused_cleanly():
    kv = KVCache(1, 1, 8, 16)
    fill(kv, Batch.one([1, 2, 3]))
    before = snapshot(kv)
    assert not kv.can_shift
    with pytest.raises(LlamaxError, match="can_shift"):
        kv.seq_add(0, 0, -1, 2)
    with pytest.raises(LlamaxError):
        kv.seq_div(0, 0, -1, 2)
    kv.seq_add(0, 0, -1, 0)  # no-ops are fine
    assert snapshot(kv) == before


def test_cross_stream_seq_cp_copies_rows_at_the_next_update():
    kv = KVCache(1, 1, 8, 16, n_seq_max=2, unified=False, type_k="f32", type_v="f32")
    fill(kv, Batch.one([1, 2, 3], seq_id=0))
    kv.seq_cp(0, 1)
    assert kv.seq_pos_max(1) == 2
    assert not kv.k[0][1].any()
    assert kv.update()
    np.testing.assert_array_equal(kv.k[0][1], kv.k[0][0])
    assert not kv.update()


def test_summary_line_and_breakdown(caplog):
    with caplog.at_level(logging.INFO, logger="llamax"):
        kv = KVCache(3, 1, 256, 4096, n_seq_max=4)
    line = "size =   12.00 MiB (  4096 cells,   3 layers,  4/1 seqs), K (f16):    6.00 MiB, V (f16):    6.00 MiB"
    assert line in caplog.text  # the line llama.cpp logs for Gemma 3's base cache (kv_log.txt)
    assert kv.breakdown() == {"k": 6 * 2**20, "v": 6 * 2**20}
    assert KVCache(1, 1, 8, 16, n_seq_max=3, unified=False).summary().startswith(
        "size =    0.00 MiB (    16 cells,   1 layers,  3/3 seqs)")


def test_clear_and_counts():
    kv = KVCache(1, 1, 8, 16, n_seq_max=2, unified=False)
    assert kv.n_cells == 32
    fill(kv, Batch([1, 2, 3], seq_ids=[0, 1, 1]))
    assert kv.n_used == 3 and kv.k[0].any()
    kv.clear(data=False)
    assert kv.n_used == 0 and kv.k[0].any()
    kv.clear()
    assert not kv.k[0].any() and kv.seq_pos_max(1) == -1


def test_bad_construction():
    with pytest.raises(ValueError):
        KVCache(1, 1, 8, 16, type_k="q8_1")
    with pytest.raises(ValueError):
        KVCache(0, 1, 8, 16)
    with pytest.raises(ValueError):
        KVCache(1, 1, 8, 16, n_seq_max=300)
    with pytest.raises(ValueError):
        KVCache(1, 1, 8, 16, swa_type="standard")
    with pytest.raises(ValueError):
        KVCacheISWA(2, 1, 8, 16, swa_layers=[0, 1], n_swa=4)
