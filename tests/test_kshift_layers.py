"""Per-layer RoPE in the KV cache's K-shift (llama.cpp's build_graph_shift: each layer shifted with its
own n_rot, base, scale, frequency factors and YaRN parameters; layers without RoPE skipped).

KVCache(rope=[...]) takes one entry per stored layer, a RoPE or None (NoPE: SmolLM3's every fourth
layer); KVCacheISWA takes such a sequence for each of its caches (rope for the base layers, rope_swa
for the SWA layers). Checks: the cache's K-shift equals llamax._native.rope.k_shift of each layer with
its RoPE, bit for bit; a NoPE layer's bytes never change; a K stored roped at p and shifted by d is
the K roped at p + d (times the magnitude the shift applies once more, as llama.cpp), within the
float32 angle drift of test_rope.py's composition tests.
"""
import numpy as np
import pytest

from llamax import Batch, KVCache, KVCacheISWA, RoPE
from llamax._native import rope as native_rope

N_HEAD_KV, HEAD_DIM, KV_SIZE = 2, 64, 64
F32 = np.float32


def llama3_like(n_rot=64):
    ff = np.ones(n_rot // 2, F32)
    ff[n_rot // 4:] = np.linspace(1.5, 8.0, n_rot // 2 - n_rot // 4)
    return RoPE(n_rot, 500000.0, 1.0, "norm", freq_factors=ff)


def yarn(n_rot=64):
    return RoPE(n_rot, 1e6, 0.25, "neox", ext_factor=1.0, attn_factor=0.9, n_ctx_orig=4096)


def longrope(n_rot=32):
    return RoPE(n_rot, 10000.0, 1.0, "neox", freq_factors=np.linspace(1.0, 40.0, n_rot // 2), attn_factor=1.19)


def magnitude(r):
    m = F32(r.attn_factor)
    if r.ext_factor:
        m = m * (F32(1) + F32(0.1) * F32(np.log(np.float64(F32(1) / F32(r.freq_scale)))))
    return float(m)


def fill_random(kv, rng, layer_ids):
    """Seq 0 at positions 0..19, seq 1 at 0..9, each layer's K and V random."""
    for seq, n in ((0, 20), (1, 10)):
        for ub in kv.plan(Batch.one(list(range(n)), seq_id=seq)):
            for il in layer_ids:
                k = rng.standard_normal((ub.n_tokens, N_HEAD_KV, HEAD_DIM)).astype(F32)
                kv.store(il, ub, k, k)


def shift_some(kv, div=True):
    kv.seq_rm(0, 0, 5)
    kv.seq_add(0, 5, -1, -5)      # seq 0: 5..19 -> 0..14
    kv.seq_add(1, 0, -1, 300)     # seq 1: 0..9 -> 300..309
    if div:
        kv.seq_div(1, 300, -1, 2)  # then 150, 150, 151, 151, ..., 154


def expected_after_update(cache):
    """What update() must leave in each of cache's layers: k_shift with that layer's RoPE, or the same bytes."""
    out = []
    for k, r in zip(cache.k, cache.layer_ropes):
        k = k.copy()
        if r is not None:
            for st, cells in enumerate(cache.meta.streams):
                shift = cells.shift_view().copy()
                native_rope.k_shift(k[st].reshape(cache.kv_size, -1), shift, cache.n_head_kv, cache.head_dim,
                                    r.n_rot, r.freq_base, r.freq_scale, r.mode, 1, type=cache.type_k,
                                    rot_block=cache.rot_k, **r.scaling_kwargs)
        out.append(k)
    return out


@pytest.mark.parametrize("type_k", ["f32", "f16", "q8_0"])
def test_per_layer_k_shift_is_each_layers_own(type_k):
    ropes = [llama3_like(), None, yarn(), longrope()]
    kv = KVCache(4, N_HEAD_KV, HEAD_DIM, KV_SIZE, n_seq_max=2, type_k=type_k, rope=ropes)
    assert kv.can_shift and kv.layer_ropes == tuple(ropes)
    fill_random(kv, np.random.default_rng(1), range(4))
    shift_some(kv)
    before = [k.copy() for k in kv.k]
    want = expected_after_update(kv)
    assert kv.update()
    for il in range(4):
        assert kv.k[il].tobytes() == want[il].tobytes(), il
    assert kv.k[1].tobytes() == before[1].tobytes()                 # NoPE: untouched
    for il in (0, 2, 3):
        assert kv.k[il].tobytes() != before[il].tobytes()           # the others did rotate
    pos = kv.meta.streams[0].pos_view()
    assert sorted(pos[pos >= 0].tolist()) == list(range(15)) + [150 + q // 2 for q in range(10)]


def test_one_rope_equals_the_same_rope_for_every_layer():
    r = yarn()
    caches = [KVCache(3, N_HEAD_KV, HEAD_DIM, KV_SIZE, n_seq_max=2, type_k="f16", rope=rope) for rope in (r, [r] * 3)]
    for kv in caches:
        fill_random(kv, np.random.default_rng(2), range(3))
        shift_some(kv)
        kv.update()
    assert caches[0].rope is r and caches[0].layer_ropes == (r, r, r)
    assert [k.tobytes() for k in caches[0].k] == [k.tobytes() for k in caches[1].k]


@pytest.mark.parametrize("kv_kind", ["kv", "iswa"])
def test_shifted_k_is_rope_at_the_new_position(kv_kind):
    """K stored roped at p with the layer's RoPE, shifted to p': the layer's RoPE at p' (times its
    magnitude m once more); the NoPE layer's raw K unchanged."""
    rng = np.random.default_rng(3)
    ropes = {0: llama3_like(), 1: None, 2: yarn(), 3: longrope()}
    if kv_kind == "kv":
        kv = KVCache(4, N_HEAD_KV, HEAD_DIM, KV_SIZE, n_seq_max=2, type_k="f32", rope=[ropes[i] for i in range(4)])
        cache_of = {il: kv for il in range(4)}
    else:
        kv = KVCacheISWA(4, N_HEAD_KV, HEAD_DIM, KV_SIZE, swa_layers=[2, 3], n_swa=8, swa_full=True, n_ubatch=32,
                         n_seq_max=2, type_k="f32", rope=[ropes[0], ropes[1]], rope_swa=[ropes[2], ropes[3]])
        cache_of = {il: kv.cache_of(il) for il in range(4)}
        assert kv.base.layer_ropes == (ropes[0], None) and kv.swa.layer_ropes == (ropes[2], ropes[3])
    raw = {il: {} for il in range(4)}   # (seq, pos) -> raw K of the token, per layer
    for seq, n in ((0, 20), (1, 10)):
        for ub in kv.plan(Batch.one(list(range(n)), seq_id=seq)):
            for il in range(4):
                k = rng.standard_normal((ub.n_tokens, N_HEAD_KV, HEAD_DIM)).astype(F32)
                for t, p in enumerate(ub.pos):
                    raw[il][seq, int(p)] = k[t]
                stored, r = k.copy(), ropes[il]
                if r is not None:
                    native_rope.rope_f32(stored, ub.pos, r.n_rot, r.freq_base, r.freq_scale, r.mode, 1,
                                         **r.scaling_kwargs)
                kv.store(il, ub, stored, k)
    nope_before = cache_of[1].k[cache_of[1].layer_ids.index(1)].copy()
    shift_some(kv, div=False)     # every new position comes from one old one: p + 5 (seq 0), p - 300 (seq 1)
    kv.update()
    for il in range(4):
        c = cache_of[il]
        k = c.k[c.layer_ids.index(il)][0]
        r = ropes[il]
        if r is None:
            assert k.tobytes() == nope_before[0].tobytes()
            continue
        m = magnitude(r)
        cells = c.meta.streams[0]
        pos, seqs = cells.pos_view(), cells.seq_view()
        for cell in np.flatnonzero(pos >= 0):
            p_new = int(pos[cell])
            seq = 0 if seqs[cell, 0] & 1 else 1
            p_old = p_new + 5 if seq == 0 else p_new - 300
            want = raw[il][seq, p_old][None].copy()
            native_rope.rope_f32(want, np.array([p_new], np.int32), r.n_rot, r.freq_base, r.freq_scale, r.mode, 1,
                                 **r.scaling_kwargs)
            want[0, :, :r.n_rot] *= F32(m)
            d = abs(p_new - p_old)
            drift = (p_old + d + p_new) * (r.n_rot / 2 + 5) * 2.0 ** -24
            atol = float(np.abs(raw[il][seq, p_old]).max()) * m * m * (drift + 1e-5)
            np.testing.assert_allclose(k[cell], want[0], rtol=0, atol=atol, err_msg=f"layer {il} cell {cell}")


def test_all_nope_layers_shift_positions_only():
    kv = KVCache(2, N_HEAD_KV, HEAD_DIM, KV_SIZE, n_seq_max=2, type_k="f32", rope=[None, None])
    assert kv.can_shift
    fill_random(kv, np.random.default_rng(4), range(2))
    before = [k.tobytes() for k in kv.k]
    shift_some(kv)
    kv.update()
    assert [k.tobytes() for k in kv.k] == before
    assert kv.seq_pos_max(0) == 14 and kv.seq_pos_min(1) == 150
    assert not KVCache(2, N_HEAD_KV, HEAD_DIM, KV_SIZE).can_shift   # no rope at all: still no shifting


@pytest.mark.parametrize("rope,err", [
    ([llama3_like()], ValueError),                                  # one entry for two layers
    ([llama3_like(), None, None], ValueError),
    ([llama3_like(), "neox"], TypeError),
    ([RoPE(128), None], ValueError),                                # n_rot > head_dim
    ("norm", TypeError),
    (RoPE(128), ValueError),
])
def test_bad_per_layer_rope_raises(rope, err):
    with pytest.raises(err):
        KVCache(2, N_HEAD_KV, HEAD_DIM, KV_SIZE, rope=rope)


def test_iswa_per_layer_rope_needs_both_lists():
    with pytest.raises(ValueError, match="rope_swa"):
        KVCacheISWA(4, N_HEAD_KV, HEAD_DIM, KV_SIZE, swa_layers=[2, 3], n_swa=8, rope=[yarn(), None])
    with pytest.raises(ValueError):
        KVCacheISWA(4, N_HEAD_KV, HEAD_DIM, KV_SIZE, swa_layers=[2, 3], n_swa=8, rope=[yarn(), None],
                    rope_swa=[yarn()])
    kv = KVCacheISWA(4, N_HEAD_KV, HEAD_DIM, KV_SIZE, swa_layers=[2, 3], n_swa=8, rope=yarn(),
                     rope_swa=[None, longrope()])
    assert kv.base.layer_ropes == (yarn(), yarn()) and kv.swa.layer_ropes == (None, longrope())
