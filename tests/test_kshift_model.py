"""K-shift on the real SmolLM2: seq_rm of an early range and seq_add of the rest, the K of the moved
cells rotated by RoPE at the next decode (in place for f32 / f16 K), against contexts that never moved.

Comparisons that are exact up to rounding (RoPE attention depends on relative positions only):
  * fresh context: the early range is decoded on another sequence, so the tokens that stay never attend
    to it; the rest starts on its own sequence right after it (an empty sequence may start at any
    position). seq_rm(-1, 0, d) + seq_add(0, d, -1, -d), then one more token, against a fresh context
    fed the same remaining tokens at positions 0.. and the same token.
  * unshifted cache: llama.cpp's context shift with n_keep = 0 (one sequence, the rest did attend to the
    early range), against the same cache where seq_rm alone forgot the range and the next token sits
    at its unshifted position.

Tolerance, measured: llamax's quantized-activation matmuls (as llama.cpp's) turn any rounding
difference (here: RoPE angles at other absolute positions, f16 rounding of the rotated K) into logit
noise like llama.cpp's own flash-attention on/off spread (0.77 max, 0.22 RMS; summary.json). Measured
for these checks on f32 / f16 caches, fa on / off: up to 0.83 max, 0.33 RMS against the fresh context,
0.51 / 0.17 against the unshifted cache; the same tokens merely placed at other absolute positions, no
K-shift at all, already differ from the fresh context by up to 0.69 / 0.28. The bound is 2x llama.cpp's
spread, as in test_llama_vs_llamacpp (1.54 max, 0.44 RMS), or 2x that no-K-shift noise of the same
configuration when it is larger (measured in the test; it matters for quantized K caches). A wrong rotation
fails it: a K-shift short by one position moves these logits by 4.4 max / 0.83 RMS, none by 11-15 / 2.8-5.7.
Top-1 must agree wherever the reference's top-1 / top-2 gap exceeds 0.60, scaled like the bound when the
configuration's own noise sets it (a q4_0 K cache without flash attention: 1.44 max no-K-shift noise, so a
0.77 gap is not clear of it; the native layer step's ggml rms_norm moved that case's top-1, not the others).

can_shift False: llama.cpp aborts the next decode (GGML_ABORT "does not support K-shift") after a
shift it cannot apply; llamax refuses the seq_add / seq_div itself with LlamaxError, the memory unchanged.
"""
import numpy as np
import pytest

from llamax import Batch, KVCache, LlamaxError
from llamax.context import Context
from llamax.generate import context_shift

CACHE_TYPES = ["f32", "f16", "q8_0", "q4_0"]  # K cache types whose K-shift runs in a Context
ROW_MAX, ROW_RMS, TOP1_GAP = 1.54, 0.44, 0.60
D, M = 37, 120  # early range, tokens that stay

TEXT = ("The old lighthouse stood at the edge of the cliff, its white paint worn thin by a century of salt and wind. "
        "Every evening the keeper climbed the spiral stairs, one hundred and twelve steps, to light the great lamp "
        "that warned the fishing boats away from the rocks below. In winter the storms came in from the north, and "
        "the waves broke so high that spray reached the gallery windows. The keeper kept a logbook in which he wrote "
        "the weather, the ships he saw and the names of the birds that rested on the railing. His daughter, who "
        "lived in the village, visited on Sundays with bread, apples and news from the harbour. She told him about "
        "the new school, the market prices and the sailors who argued about the best routes to the southern islands. "
        "One autumn a small boat with a torn sail drifted towards the rocks in the fog, and the keeper rang the bell "
        "until his arms ached. The boat turned in time, and the next morning a young fisherman climbed the hill to "
        "thank him. They drank tea in the kitchen while the kettle sang on the stove, and the fisherman promised to "
        "bring fresh fish every week. Years later, when the lighthouse was replaced by an automatic beacon, the keeper "
        "moved to the village, but he still walked to the cliff each evening to watch the light turn over the sea.")


@pytest.fixture(scope="module")
def toks(model):
    t = model.tokenize(TEXT)
    assert len(t) > D + M
    return t


def cache_kw(type_k, fa):
    return dict(type_k=type_k, type_v=type_k if type_k in ("f32", "f16") else "f16", flash_attn=fa)


def unshiftable_context(model, **kw):
    """A Context whose memory cannot shift (can_shift False, as llama.cpp's iSWA caches with a smaller
    SWA cache or M-RoPE models): the same KV cache as the model's, built without a RoPE."""
    ctx = Context(model, **kw)
    hp, p = model.hparams, ctx.params
    ctx.memory = KVCache(hp.n_layer, hp.n_head_kv, hp.n_embd_head_k, p.n_ctx_seq, head_dim_v=hp.n_embd_head_v,
                         n_seq_max=p.n_seq_max, unified=p.kv_unified, type_k=p.type_k, type_v=p.type_v,
                         v_trans=not p.flash_attn, n_threads=p.n_threads, rope=None)
    return ctx


def diff(a, b):
    d = np.asarray(a, np.float64) - np.asarray(b, np.float64)
    return float(np.abs(d).max()), float(np.sqrt(np.mean(d * d)))


def check(got, ref, floor=(0.0, 0.0)):
    mx, rms = diff(got, ref)
    tmax, trms = max(ROW_MAX, 2 * floor[0]), max(ROW_RMS, 2 * floor[1])
    assert mx < tmax and rms < trms, (mx, rms, tmax, trms)
    top = np.sort(ref)[::-1]
    if top[0] - top[1] > TOP1_GAP * max(1.0, 2 * floor[0] / ROW_MAX):   # the gap scales with the bound
        assert int(np.argmax(got)) == int(np.argmax(ref))


@pytest.mark.parametrize("fa", [True, False], ids=["fa_on", "fa_off"])
@pytest.mark.parametrize("type_k", CACHE_TYPES)
def test_shifted_cache_matches_a_fresh_context(model, toks, type_k, fa):
    kw = cache_kw(type_k, fa)
    early, rest, nxt = toks[:D], toks[D:D + M], toks[D + M]

    ctx = Context(model, n_ctx=256, n_seq_max=2, **kw)
    mem = ctx.memory
    ctx.decode(Batch(early, seq_ids=[1] * D))
    ctx.decode(Batch(rest, pos=list(range(D, D + M)), seq_ids=[0] * M))
    assert mem.seq_rm(-1, 0, D)
    assert mem.seq_pos_min(1) == -1 and mem.n_used == M
    mem.seq_add(0, D, -1, -D)
    assert (mem.seq_pos_min(0), mem.seq_pos_max(0)) == (0, M - 1)
    assert sorted(p for p, s in mem.cells() if 0 in s) == list(range(M))
    ctx.decode(Batch([nxt]))  # the K-shift runs first
    assert mem.seq_pos_max(0) == M
    shifted = ctx.get_logits_ith(-1).copy()

    fresh = Context(model, n_ctx=256, **kw)
    fresh.decode(Batch(rest))
    fresh.decode(Batch([nxt]))
    ref = fresh.get_logits_ith(-1).copy()

    # the noise of the same tokens at positions [D, D + M] with no K-shift at all
    moved = Context(model, n_ctx=256, **kw)
    moved.decode(Batch(rest, pos=list(range(D, D + M))))
    moved.decode(Batch([nxt]))
    check(shifted, ref, diff(moved.get_logits_ith(-1), ref))


@pytest.mark.parametrize("type_k", CACHE_TYPES)
def test_context_shift_matches_the_unshifted_cache(model, toks, type_k):
    kw = cache_kw(type_k, True)
    seq, nxt = toks[:D + M], toks[D + M]

    ctx = Context(model, n_ctx=256, **kw)
    ctx.decode(Batch(seq))
    assert context_shift(ctx.memory, 0, 0, D) == (D, D + M)
    assert (ctx.memory.seq_pos_min(0), ctx.memory.seq_pos_max(0)) == (0, M - 1)
    ctx.decode(Batch([nxt]))
    shifted = ctx.get_logits_ith(-1).copy()

    def unshifted(off):  # seq_rm alone, the tokens at positions off.., no K-shift
        ref = Context(model, n_ctx=256, **kw)
        ref.decode(Batch(seq, pos=list(range(off, off + D + M))))
        ref.memory.seq_rm(0, off, off + D)
        ref.decode(Batch([nxt]))
        assert ref.memory.seq_pos_max(0) == off + D + M
        return ref.get_logits_ith(-1).copy()

    ref = unshifted(0)
    check(shifted, ref, diff(unshifted(D), ref))


def test_memory_that_cannot_shift_refuses_shifts_and_stays_usable(model, toks):
    ctx = unshiftable_context(model, n_ctx=256)
    mem = ctx.memory
    assert not mem.can_shift
    ctx.decode(Batch(toks[:40]))
    cells = mem.cells()
    for call in (lambda: mem.seq_add(0, 10, -1, -5), lambda: mem.seq_div(0, 0, -1, 2),
                 lambda: context_shift(mem, 0, 4)):
        with pytest.raises(LlamaxError, match="can_shift is False"):
            call()
        assert mem.cells() == cells and mem.seq_pos_max(0) == 39
    mem.seq_add(0, 10, -1, 0)  # no shift: allowed
    mem.seq_div(0, 0, -1, 1)
    assert mem.cells() == cells
    ctx.decode(Batch([toks[40]]))
    ref = Context(model, n_ctx=256)
    ref.decode(Batch(toks[:40]))
    ref.decode(Batch([toks[40]]))
    np.testing.assert_array_equal(ctx.get_logits_ith(-1), ref.get_logits_ith(-1))
