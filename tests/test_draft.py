"""llamax.draft: the vocabulary check and the draft-model drafter (greedy drafts, cache alignment with
the target, several keys in one call, p_min, room, bad input). SmolLM2 drafts for itself (its drafts are
then exactly the target's greedy tokens); SmolLM2 cut to its first layers (tests/synthetic.py's
write_truncated) is a draft model that agrees with the target only in part."""
import numpy as np
import pytest

import llamax
from llamax.draft import DraftModel, check_vocab
from llamax.errors import ModelError
from llamax.model import ModelInfo

from synthetic import write_mamba, write_truncated

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a"]
N_CTX = 512
#: layers kept in the truncated draft (of SmolLM2's 30): a weak drafter that still agrees at times
TRUNCATED_LAYERS = 10


@pytest.fixture(scope="module")
def truncated_gguf(tmp_path_factory, smollm2_gguf):
    return write_truncated(tmp_path_factory.mktemp("draft") / "smollm2-trunc.gguf", smollm2_gguf, TRUNCATED_LAYERS)


@pytest.fixture(scope="module")
def greedy(model):
    """prompt -> (prompt tokens, the target's next 12 greedy tokens)."""
    out = {}
    for p in PROMPTS:
        toks = model.tokenize(p)
        g = llamax.generate(llamax.Context(model, n_ctx=N_CTX), list(toks), max_tokens=12,
                            sampler=llamax.Sampler(temperature=0.0))
        for _ in g:
            pass
        assert len(g.generated) == 12
        out[p] = (toks, g.generated)
    return out


def drafter(model, **kw):
    kw.setdefault("n_ctx", N_CTX)
    kw.setdefault("p_min", 0.0)
    return DraftModel(kw.pop("draft", model), model, **kw)


# ---- check_vocab -------------------------------------------------------------------------------

def test_check_vocab_same_model(model):
    check_vocab(model, model)
    check_vocab(model, ModelInfo.read(model.path))


def test_check_vocab_other_family(model):
    gemma = ModelInfo.read("gemma3-270m")  # no weights needed
    with pytest.raises(ModelError, match="vocabulary type: 'bpe' in the target, 'spm' in the draft"):
        check_vocab(model, gemma)
    with pytest.raises(ModelError, match="vocabulary type: 'spm' in the target, 'bpe' in the draft"):
        check_vocab(gemma, model)
    with pytest.raises(ModelError, match="vocabulary type"):
        DraftModel("gemma3-270m", model)
    with pytest.raises(TypeError):
        check_vocab(model, "smollm2-135m")


def test_check_vocab_names_the_changed_token(model, smollm2_gguf, tmp_path):
    text = model.tokenizer.token_text(1234)
    bad = write_truncated(tmp_path / "one-token.gguf", smollm2_gguf, 1, token_texts={1234: "llamax-changed"})
    with pytest.raises(ModelError, match=f"token 1234: {text!r} in the target, 'llamax-changed' in the draft"):
        check_vocab(model, ModelInfo.read(bad))
    with pytest.raises(ModelError, match="token 1234"):
        DraftModel(bad, model)
    # as llama.cpp, ids below 5 (the special tokens' usual place) are not compared
    low = write_truncated(tmp_path / "low-token.gguf", smollm2_gguf, 1, token_texts={4: "llamax-changed"})
    check_vocab(model, ModelInfo.read(low))


# ---- drafts ------------------------------------------------------------------------------------

def test_self_draft_is_the_greedy_continuation(model, greedy):
    dm = drafter(model)
    for p in PROMPTS:
        toks, gen = greedy[p]
        assert dm.draft([(0, toks, 8)]) == [gen[:8]]
        # the drafts stay in the cache (all but the last, which nothing needed to decode)
        assert dm.held(0) == list(toks) + gen[:7]
        assert dm.ctx.memory.seq_pos_max(0) == len(toks) + 6
        dm.release(0)
    assert dm.stats.n_drafted == 8 * len(PROMPTS) and dm.stats.n_calls == len(PROMPTS)
    # one sync decode and 7 rounds per call
    assert dm.stats.n_decode == 8 * len(PROMPTS)


def test_alignment_after_partial_acceptance(model, greedy):
    toks, gen = greedy[PROMPTS[0]]
    dm = drafter(model)
    d = dm.draft([(0, toks, 6)])[0]
    assert d == gen[:6]
    steps = [
        list(toks) + d[:2] + [13],              # the target took 2 drafts and sampled another token
        list(toks) + d[:2] + [13, 17, 19],      # it went on from there (held extends)
        list(toks) + d[:1],                     # a shorter sequence (e.g. replaced)
        list(toks[:2]) + list(toks[3:]) + d,    # a context shift: a token gone in the middle
    ]
    for i, tokens in enumerate(steps):
        for n_max in (1, 5):
            got = dm.draft([(0, tokens, n_max)])[0]
            fresh_dm = drafter(model)
            fresh = fresh_dm.draft([(0, tokens, n_max)])[0]
            assert got == fresh, (i, n_max)
            # the last decodes (of the same position) gave the same logits, bit for bit
            assert np.array_equal(dm.ctx.get_logits(), fresh_dm.ctx.get_logits()), (i, n_max)
            assert 1 <= len(got) <= n_max
            assert dm.held(0) == tokens + got[:-1]
            # the draft cache holds exactly held's positions: the target's up to len(tokens) - 1, then
            # the decoded drafts
            assert dm.ctx.memory.seq_pos_min(0) == 0
            assert dm.ctx.memory.seq_pos_max(0) == len(tokens) - 1 + len(got) - 1
    # accepting everything costs one token of sync per accepted draft plus the target's own token
    dm2 = drafter(model)
    d = dm2.draft([(0, toks, 4)])[0]
    synced = dm2.stats.n_synced
    dm2.draft([(0, list(toks) + d + [gen[4]], 4)])
    assert dm2.stats.n_synced - synced == 2  # the last draft (never decoded) and gen[4]


def test_several_keys_in_one_call(model, greedy):
    alone = {}
    for p in PROMPTS:
        toks, _ = greedy[p]
        alone[p] = drafter(model).draft([(0, toks, 6)])[0]
    dm = drafter(model, n_seq_max=4)
    got = dm.draft([(k, greedy[p][0], 6) for k, p in zip((3, 0, 1), PROMPTS)])
    assert got == [alone[p] for p in PROMPTS]
    assert dm.stats.n_decode == 6  # one sync decode and 5 rounds, for all three
    # next call: one key accepted part, one all, one is not asked; a new key comes
    t0 = list(greedy[PROMPTS[0]][0]) + alone[PROMPTS[0]][:3] + [11]
    t1 = list(greedy[PROMPTS[1]][0]) + alone[PROMPTS[1]]
    t2 = list(greedy[PROMPTS[2]][0])[:4]
    got = dm.draft([(3, t0, 4), (0, t1, 3), (2, t2, 5)])
    assert got == [drafter(model).draft([(0, t, n)])[0] for t, n in ((t0, 4), (t1, 3), (t2, 5))]
    assert dm.held(1) == list(greedy[PROMPTS[2]][0]) + alone[PROMPTS[2]][:5]  # untouched


def test_truncated_draft_agrees_in_part(model, greedy, truncated_gguf):
    dm = DraftModel(truncated_gguf, model, n_ctx=N_CTX, p_min=0.0)  # loads through check_vocab
    assert dm.model.hparams.n_layer == TRUNCATED_LAYERS
    hits = total = 0
    for p in PROMPTS:
        toks, gen = greedy[p]
        for i in range(len(gen)):  # the target's tokens so far, the draft's guess of the next
            (d,) = dm.draft([(0, list(toks) + gen[:i], 1)])
            hits += d == [gen[i]]
            total += 1
    assert 0 < hits < total
    # drafting from a longer run agrees with the truncated model's own greedy generation
    toks, _ = greedy[PROMPTS[0]]
    g = llamax.generate(llamax.Context(dm.model, n_ctx=N_CTX), list(toks), max_tokens=6,
                        sampler=llamax.Sampler(temperature=0.0))
    for _ in g:
        pass
    assert dm.draft([(0, toks, 6)]) == [g.generated]


def test_recurrent_draft_starts_over(tmp_path, smollm2_gguf):
    """A recurrent draft model cannot drop a rejected tail (seq_rm returns False): the sequence is
    decoded again from position 0, and the drafts stay those of a fresh drafter."""
    mamba = llamax.Model.load(write_mamba(tmp_path / "mamba.gguf", smollm2_gguf))
    toks = mamba.tokenize("Once upon a time")
    dm = drafter(mamba, n_ctx=256)
    d = dm.draft([(0, toks, 5)])[0]
    assert len(d) == 5
    tokens = list(toks) + d[:2] + [42]
    synced = dm.stats.n_synced
    got = dm.draft([(0, tokens, 4)])[0]
    assert dm.stats.n_synced - synced == len(tokens)  # started over
    assert got == drafter(mamba, n_ctx=256).draft([(0, tokens, 4)])[0]
    assert dm.held(0) == tokens + got[:-1]


def test_p_min(model, greedy):
    toks, gen = greedy[PROMPTS[0]]
    none = drafter(model, p_min=1.01)
    assert none.draft([(0, toks, 8)]) == [[]]
    assert none.held(0) == list(toks) and none.stats.n_drafted == 0
    full = drafter(model).draft([(0, toks, 8)])[0]
    some = drafter(model, p_min=0.5).draft([(0, toks, 8)])[0]
    assert some == full[:len(some)]
    # every proposed token is at least p_min likely under the draft model, the first refused one is not
    ctx = llamax.Context(model, n_ctx=N_CTX)
    probs = []
    for i, t in enumerate(full):
        ctx.memory.seq_rm(0, -1, -1)
        seq = list(toks) + full[:i]
        ctx.decode(llamax.Batch(seq))
        lp, _ = llamax.sampling.token_logprobs(ctx.get_logits_ith(-1), t, 0)
        probs.append(np.exp(lp))
    assert all(p >= 0.5 for p in probs[:len(some)])
    if len(some) < len(full):
        assert probs[len(some)] < 0.5
    assert 0 < len(some) < len(full)  # this prompt's draft has an unsure token within 8


# ---- room ---------------------------------------------------------------------------------------

def test_drafts_stop_at_the_context_end(model):
    dm = drafter(model, n_ctx=256)
    assert dm.n_ctx_seq == 256
    tokens = (model.tokenize("one two three four five six seven eight nine ten " * 30))[:250]
    d = dm.draft([(0, tokens, 16)])[0]
    assert len(d) == 6  # positions 250 .. 255
    assert dm.ctx.memory.seq_pos_max(0) == 254
    assert dm.draft([(0, tokens + d, 4)]) == [[]]  # the sequence fills the context: nothing to draft
    assert dm.draft([(0, (tokens + d)[:255], 4)]) == [d[5:]]  # one position left


def test_no_cell_left_stops_that_request(model):
    """Two sequences of 200 tokens do not both fit in 256 shared cells: the batch fails, the requests
    go one by one; the first drafts as alone, the second gets [] and holds what fit (nothing)."""
    a = model.tokenize("alpha beta gamma delta " * 60)[:200]
    b = model.tokenize("red green blue yellow " * 60)[:200]
    dm = drafter(model, n_ctx=256, n_seq_max=2)
    got = dm.draft([(0, a, 4), (1, b, 4)])
    assert got == [drafter(model, n_ctx=256).draft([(0, a, 4)])[0], []]
    assert dm.held(1) == [] and dm.ctx.memory.seq_pos_max(1) == -1
    dm.release(0)  # room again
    assert dm.draft([(1, b, 4)]) == [drafter(model, n_ctx=256).draft([(0, b, 4)])[0]]


# ---- protocol and errors ----------------------------------------------------------------------

def test_release_and_close(model, greedy):
    toks, _ = greedy[PROMPTS[1]]
    dm = drafter(model, n_seq_max=2)
    dm.draft([(1, toks, 3)])
    assert dm.ctx.memory.seq_pos_max(1) >= 0
    dm.release(1)
    assert dm.held(1) == [] and dm.ctx.memory.seq_pos_max(1) == -1
    assert dm.draft([(1, toks, 0)]) == [[]] and dm.held(1) == []  # n_max 0: no work
    dm.close()
    assert dm.closed
    dm.release(0)
    with pytest.raises(RuntimeError, match="closed"):
        dm.draft([(0, toks, 3)])
    with pytest.raises(RuntimeError, match="closed"):
        dm.ctx


def test_bad_arguments(model, greedy):
    for kw, err in ((dict(n_seq_max=0), ValueError), (dict(n_seq_max=1.5), TypeError), (dict(n_ctx=-1), ValueError),
                    (dict(p_min=-0.1), ValueError), (dict(p_min=float("nan")), ValueError), (dict(p_min="0.5"), TypeError),
                    (dict(type_k="q9_9"), ValueError), (dict(n_threads=0), ValueError)):
        with pytest.raises(err):
            drafter(model, **kw)
    with pytest.raises(TypeError):
        DraftModel(123, model)
    with pytest.raises(TypeError):
        DraftModel(model, "smollm2-135m")
    toks, _ = greedy[PROMPTS[0]]
    dm = drafter(model, n_seq_max=2)
    d = dm.draft([(0, toks, 3)])
    before = (dm.held(0), dm.held(1), dm.ctx.memory.seq_pos_max(0), dm.stats.n_calls)
    for seqs, err in (([(2, toks, 3)], ValueError), ([(-1, toks, 3)], ValueError), ([(0, toks, -1)], ValueError),
                      ([(1, toks, 2), (0, [], 3)], ValueError), ([(1, toks, 2), (0, [model.n_vocab], 3)], ValueError),
                      ([(1, toks, 2), (1, toks, 2)], ValueError), ([(0, "text", 3)], TypeError),
                      ([(0, toks)], TypeError), ([(0, toks, 2.0)], TypeError), ((0, toks, 3), TypeError),
                      ("abc", TypeError), ([(0, [[1, 2]], 3)], ValueError), ([(0, [1.5], 3)], ValueError)):
        with pytest.raises(err):
            dm.draft(seqs)
        assert (dm.held(0), dm.held(1), dm.ctx.memory.seq_pos_max(0), dm.stats.n_calls) == before
    with pytest.raises(ValueError):
        dm.release(2)
    assert dm.draft([(0, toks, 3)]) == d


def test_sliding_window_draft_restarts_without_its_window(gemma):
    """Gemma 3 (sliding window 512; SWA cache of 1024 cells) drafting for itself after 1060 tokens: the SWA
    cache lost the oldest positions, so when the target's sequence changes at position 100 (as after a
    context shift) position 100's window is gone and the sequence is decoded again from 0: the draft
    context ends exactly as a fresh one (the logits bit for bit)."""
    toks = gemma.tokenize("The quick brown fox jumps over the lazy dog. " * 120)[:1060]
    dm = DraftModel(gemma, gemma, n_ctx=2048, p_min=0.0)
    dm.draft([(0, toks, 1)])
    assert dm.ctx.memory.seq_pos_min(0) > 0  # the window slid on
    tokens = toks[:100] + toks[101:]
    fresh = DraftModel(gemma, gemma, n_ctx=2048, p_min=0.0)
    assert dm.draft([(0, tokens, 1)]) == fresh.draft([(0, tokens, 1)])
    assert np.array_equal(dm.ctx.get_logits(), fresh.ctx.get_logits())
    assert dm.ctx.memory.seq_pos_min(0) == fresh.ctx.memory.seq_pos_min(0)


def test_default_context_size(model, truncated_gguf):
    """n_ctx=0: the draft model's training context capped at DRAFT_N_CTX_MAX, per sequence."""
    from llamax.draft import DRAFT_N_CTX_MAX
    dm = DraftModel(truncated_gguf, model)
    assert dm.n_ctx_seq == min(dm.model.hparams.n_ctx_train, DRAFT_N_CTX_MAX)
    assert dm.ctx.params.kv_unified and dm.ctx.params.n_seq_max == 1
    dm.close()
    dm = DraftModel(model, model, n_seq_max=2, n_ctx=300, type_k="q8_0", type_v="q8_0")
    assert dm.n_ctx_seq == 512 and dm.ctx.params.type_k == "q8_0"  # padded to 256, shared by both keys
