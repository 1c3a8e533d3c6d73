"""SmolLM2-135M through llamax against llama.cpp's own outputs
(shared/reference/smollm2-135m-instruct-q4_1/ref_logits.*), flash attention on (fa_auto) and off.

Tolerances, from the reference itself: llama.cpp's two attention paths (fa on / off) move the
last-row logits by up to 0.77 (RMS up to 0.22) and disagree on the top-1 token at 15 of 1397 prompt
positions, always where its own top-1 / top-2 gap is small (at most 0.30). llamax rounds differently from both
(float32 attention, its own summation orders), so it may sit as far from each llama.cpp path as the
two are from each other in each direction: the last row must stay within 2x llama.cpp's own spread
(LAST_ROW_MAX, LAST_ROW_RMS), and llamax's top-1 must equal llama.cpp's wherever llama.cpp's gap
exceeds TOP1_GAP, 2x the largest gap llama.cpp flips between its own paths; at the other positions
llama.cpp must rate llamax's choice within TOP1_GAP of its own best.

A prompt may be more sensitive to rounding than llama.cpp's one fa on / off sample shows: the same
tokens at positions shifted by 37 or 101 (a rounding-only change: RoPE attention depends on relative
positions) move llamax's last row of the 5-token short_prose by up to 1.88 max / 0.67 RMS (0.55-0.80 /
0.10-0.19 on the others), and a 3e-7 relative change of one rms_norm scale moves its distance to
llama.cpp between 0.61 and 1.74. So, as in test_kshift_model, the last-row bound is 2x the larger of
llama.cpp's spread and llamax's own shifted-positions spread on that prompt.
"""
import json

import numpy as np
import pytest
from helpers import check_top1_against, reference_dir

from llamax import Batch
from llamax.context import Context
from llamax.sampling import Sampler

TOP1_GAP = 0.60       # 2 x the largest top-1/top-2 gap llama.cpp flips between its own paths (0.30)
LAST_ROW_MAX = 1.54   # 2 x llama.cpp vs itself (fa on vs off): max |diff| 0.77
LAST_ROW_RMS = 0.44   # 2 x llama.cpp vs itself: RMS 0.22
CONFIGS = {"fa_auto": True, "fa_off": False}
# flash attention off (V transposed) on the shorter prompts; the 1.3k-token prompt with it on only (the
# suite's time: the long prompt's two configurations differ in nothing the short ones do not cover)
CASES = [(c, n) for c in CONFIGS for n in ("short_prose", "chat", "code", "long_1k3") if (c, n) != ("fa_off", "long_1k3")]
NEAR_TIE = 0.2       # a top-1/top-2 gap that another summation order may flip


@pytest.fixture(scope="module")
def ref():
    folder = reference_dir("smollm2-135m-instruct-q4_1")
    meta = json.loads((folder / "ref_logits.json").read_text())
    return meta, np.load(folder / "ref_logits.npz")


def prompt(meta, name):
    return next(p for p in meta["prompts"] if p["name"] == name)


def context(model, fa, **kw):
    kw = {"n_ctx": 2048, "n_seq_max": 1, "kv_unified": False, "flash_attn": fa, **kw}
    return Context(model, **kw)


def own_spread(model, toks, fa, last):
    """llamax's rounding-only spread of the last row: max |d| and RMS against the same tokens decoded
    at positions shifted by 37 and by 101 (the larger of the two)."""
    mx = rms = 0.0
    for off in (37, 101):
        ctx = context(model, fa)
        ctx.decode(Batch(toks, pos=list(range(off, off + len(toks))), logits=[False] * (len(toks) - 1) + [True]))
        d = ctx.get_logits_ith(-1).astype(np.float64) - last
        mx, rms = max(mx, float(np.abs(d).max())), max(rms, float(np.sqrt(np.mean(d * d))))
    return mx, rms


@pytest.mark.parametrize("cfg, name", CASES)
def test_prompt_logits_match_llamacpp(model, ref, cfg, name):
    meta, z = ref
    toks = prompt(meta, name)["tokens"]
    ctx = context(model, CONFIGS[cfg])
    ctx.decode(Batch(toks, logits=[True] * len(toks)))
    logits = ctx.get_logits()
    assert logits.shape == (len(toks), model.n_vocab)
    check_top1_against(logits, z[f"{cfg}__{name}__top_ids"], z[f"{cfg}__{name}__top_vals"], TOP1_GAP)
    d = logits[-1] - z[f"{cfg}__{name}__last_logits"]
    floor_max, floor_rms = own_spread(model, toks, CONFIGS[cfg], logits[-1])
    tmax, trms = max(LAST_ROW_MAX, 2 * floor_max), max(LAST_ROW_RMS, 2 * floor_rms)
    assert np.abs(d).max() < tmax and np.sqrt(np.mean(d * d)) < trms, (np.abs(d).max(), d.std(), tmax, trms)
    # and the same at the last row through get_logits_ith
    np.testing.assert_array_equal(ctx.get_logits_ith(-1), logits[-1])


@pytest.mark.parametrize("cfg, name", CASES)
def test_greedy_continuation_matches_llamacpp(model, ref, cfg, name):
    """llama.cpp's 32-token greedy continuation, fed back token by token: at each step llamax's top-1 must
    be llama.cpp's wherever llama.cpp's own gap is decided, and free-running greedy decoding must give
    the same tokens up to the first near-tie of llama.cpp's (8 tokens where there is none before)."""
    meta, z = ref
    toks = prompt(meta, name)["tokens"]
    gen = z[f"{cfg}__{name}__gen_tokens"].tolist()
    top_ids = np.concatenate([z[f"{cfg}__{name}__top_ids"][-1:], z[f"{cfg}__{name}__gen_top_ids"][:-1]])
    top_vals = np.concatenate([z[f"{cfg}__{name}__top_vals"][-1:], z[f"{cfg}__{name}__gen_top_vals"][:-1]])
    decided = top_vals[:, 0] - top_vals[:, 1] > TOP1_GAP
    ctx = context(model, CONFIGS[cfg])
    ctx.decode(Batch(toks))
    ours = []
    for t in gen:  # teacher forcing: logits before each of llama.cpp's tokens
        ours.append(int(np.argmax(ctx.get_logits_ith(-1))))
        ctx.decode(Batch([t]))
    ours = np.array(ours)
    bad = np.flatnonzero(decided & (ours != top_ids[:, 0]))
    assert bad.size == 0, f"top-1 differs at generated steps {bad.tolist()}"
    n_free = min(8, int(np.argmin(decided)) if not decided.all() else len(gen))
    ctx = context(model, CONFIGS[cfg])
    ctx.decode(Batch(toks))
    s = Sampler.greedy()
    free = []
    for _ in range(n_free):
        free.append(s.sample(ctx))
        ctx.decode(Batch([free[-1]]))
    assert free == gen[:n_free]


@pytest.mark.parametrize("unified", [True, False])
def test_four_sequences_in_one_batch_match_each_alone(model, ref, unified):
    meta, _ = ref
    prompts = [prompt(meta, n)["tokens"] for n in ("short_prose", "chat", "code")]
    prompts.append(prompt(meta, "long_1k3")["tokens"][:60])

    def greedy(ctx, seqs, firsts):
        nxt = [int(np.argmax(f)) for f in firsts]
        outs = [[t] for t in nxt]
        gaps = [[gap(f)] for f in firsts]
        for _ in range(15):
            ctx.decode(Batch(nxt, seq_ids=seqs, logits=[True] * len(seqs)))
            rows = [ctx.get_logits_ith(j) for j in range(len(seqs))]
            nxt = [int(np.argmax(r)) for r in rows]
            for o, g, t, r in zip(outs, gaps, nxt, rows):
                o.append(t)
                g.append(gap(r))
        return outs, gaps

    def gap(row):
        top2 = np.partition(row, -2)[-2:]
        return float(top2[1] - top2[0])

    alone, alone_gaps = [], []
    for p in prompts:
        ctx = context(model, True, n_ctx=512)
        ctx.decode(Batch(p))
        o, g = greedy(ctx, [0], [ctx.get_logits_ith(-1)])
        alone += o
        alone_gaps += g
    ctx = context(model, True, n_ctx=2048 if not unified else 1024, n_seq_max=4, kv_unified=unified)
    toks = [t for p in prompts for t in p]
    seqs = [s for s, p in enumerate(prompts) for _ in p]
    last = np.cumsum([len(p) for p in prompts]) - 1
    logits = np.zeros(len(toks), bool)
    logits[last] = True
    ctx.decode(Batch(toks, seq_ids=seqs, logits=logits.tolist()))
    together, _ = greedy(ctx, [0, 1, 2, 3], [ctx.get_logits_ith(int(i)).copy() for i in last])
    # the kernels are not batch-invariant yet (BLAS and the quantized product round per batch shape):
    # the same tokens up to the first step where the lone run's own top-1/top-2 gap is a near tie
    for a, b, g in zip(alone, together, alone_gaps):
        n = next((i for i, x in enumerate(g) if x < NEAR_TIE), len(g))
        assert a[:n] == b[:n], (n, a, b)
