"""Generation with llama.cpp's context shift on the real SmolLM2 (llamax.generate, generate_parallel, the CLI).

A sequence whose next token would fill its context (n_past + 1 >= n_ctx_seq, as llama.cpp's main and
server test it), or that holds the most positions when a unified cache has no free cell for a step,
keeps its first n_keep positions, forgets n_discard after them (half of the rest by default) and moves
the rest down: seq_rm + seq_add on that sequence only, the K-shift at the next decode.

Logits after a shift are compared with a context that holds the same cache without the move (the same
tokens decoded the same way, the discarded range removed by seq_rm alone, the following tokens at
their unshifted positions): with n_keep = 0 every relative position is the same, so the two differ only
by rounding. (A fresh context fed the kept tokens differs for another reason: the kept tokens' K/V were
computed while the discarded ones were still in the context, in llama.cpp too; measured 7.8-12 max /
1.8-4.6 RMS on this model. test_kshift_model.py compares with fresh contexts where the history allows it.)
Tolerance: 2x llama.cpp's own flash-attention on/off spread, as in test_llama_vs_llamacpp (1.54 max,
0.44 RMS); measured here 0.69 max, 0.26 RMS, while a K-shift that rotates by one position too few
already moves the logits by 4.4 max / 0.83 RMS.
"""
import importlib
import subprocess
import sys

import numpy as np
import pytest
from test_kshift_model import TEXT, unshiftable_context

from llamax import Batch, LlamaxError
from llamax.context import Context
from llamax.generate import ParallelGeneration, context_shift, generate, generate_parallel
from llamax.sampling import Sampler

G = importlib.import_module("llamax.generate")  # the module (llamax.generate is also the function)
ROW_MAX, ROW_RMS, TOP1_GAP = 1.54, 0.44, 0.60


@pytest.fixture(scope="module")
def text_tokens(model):
    toks = model.tokenize(TEXT)
    assert len(toks) > 260
    return toks


class NoEOG(Sampler):
    """A sampler that never picks an end-of-generation token (llama.cpp's --ignore-eos), so a test
    generation runs as long as it is asked to."""

    def __init__(self, model, **kw):
        super().__init__(**kw)
        self.eog = np.array([t for t in range(model.n_vocab) if model.is_eog(t)])

    @classmethod
    def greedy_for(cls, model):
        return cls(model, temperature=0.0, top_k=1, top_p=1.0, min_p=0.0)

    def sample_logits(self, logits):
        logits = np.array(logits, dtype=np.float32)
        logits[self.eog] = -np.inf
        return super().sample_logits(logits)


def seq_cells(mem, seq):
    """{cell index: position} of the cells holding seq."""
    return {i: p for i, (p, s) in enumerate(mem.cells()) if seq in s}


def rows(mem, idx):
    """K and V of the given cells in every layer (one stream)."""
    idx = sorted(idx)
    return np.concatenate([np.stack([k[0, idx] for k in mem.k]).ravel().view(np.uint8),
                           np.stack([v[0, idx] for v in mem.v]).ravel().view(np.uint8)])


def compare(a, b):
    d = np.asarray(a, np.float64) - np.asarray(b, np.float64)
    mx, rms = float(np.abs(d).max()), float(np.sqrt(np.mean(d * d)))
    assert mx < ROW_MAX and rms < ROW_RMS, (mx, rms)
    top = np.sort(b)[::-1]
    if top[0] - top[1] > TOP1_GAP:
        assert int(np.argmax(a)) == int(np.argmax(b))
    return mx, rms


# ---- context shift in generation ------------------------------------------------------------------------

def test_two_sequences_generate_three_times_n_ctx(model, monkeypatch):
    """2 sequences of a unified 256-cell cache generate 384 tokens each (3 x n_ctx in all). Every shift
    (a full cache: the sequence holding the most positions) discards half of what follows n_keep, leaves
    the kept prompt cells and the other sequence's cells, positions and K/V bits as they were, and moves
    the rest by -n_discard with their K rotated."""
    ctx = Context(model, n_ctx=256, n_seq_max=2, kv_unified=True)
    mem = ctx.memory
    prompts = ["Once upon a time, in a quiet village,", "The best way to learn a new language is"]
    n_gen = 384
    shifts = []
    kept_rows = {}
    real = G.context_shift

    def checked(memory, seq_id, keep_end, n_discard=0):
        other = 1 - seq_id
        before, other_before = seq_cells(memory, seq_id), seq_cells(memory, other)
        other_pos = (memory.seq_pos_min(other), memory.seq_pos_max(other))
        memory.update()  # pending rotations first, so the K/V compared below are final
        other_rows = rows(memory, other_before) if other_before else None
        kept = {i for i, p in before.items() if p < keep_end}
        if seq_id not in kept_rows:
            kept_rows[seq_id] = (kept, rows(memory, kept))
        n_past = memory.seq_pos_max(seq_id) + 1
        n, n_left = real(memory, seq_id, keep_end, n_discard)
        assert n_left == n_past - keep_end and n == n_left // 2 > 0
        memory.update()  # the K-shift the next decode would run
        after = seq_cells(memory, seq_id)
        expect = {i: (p if p < keep_end else p - n) for i, p in before.items() if not keep_end <= p < keep_end + n}
        assert after == expect
        assert memory.seq_pos_max(seq_id) == n_past - 1 - n < ctx.params.n_ctx_seq
        assert seq_cells(memory, other) == other_before
        assert (memory.seq_pos_min(other), memory.seq_pos_max(other)) == other_pos
        if other_rows is not None:
            assert np.array_equal(rows(memory, other_before), other_rows)
        k0, r0 = kept_rows[seq_id]
        assert k0 <= set(after) and np.array_equal(rows(memory, k0), r0)
        shifts.append((seq_id, n))
        return n, n_left

    monkeypatch.setattr(G, "context_shift", checked)
    samplers = [NoEOG(model, seed=1), NoEOG(model, seed=2)]
    gen = generate_parallel(ctx, prompts, max_tokens=n_gen, samplers=samplers, n_keep=-1)
    texts = ["", ""]
    for i, piece in gen:
        texts[i] += piece
    assert [s.stop for s in gen.seq_stats] == ["length", "length"]
    assert [s.gen_tokens for s in gen.seq_stats] == [n_gen, n_gen] and all(texts)
    for s in (0, 1):
        st = gen.seq_stats[s]
        mine = [n for q, n in shifts if q == s]
        assert st.n_shift == len(mine) >= 1 and st.n_discarded == sum(mine)
        assert mem.seq_pos_min(s) == 0 and mem.seq_pos_max(s) < ctx.params.n_ctx_seq
        # the tokens the generation says are in the cache: one per position, the prompt first
        assert len(gen.tokens[s]) == mem.seq_pos_max(s) + 1 == len(seq_cells(mem, s))
        assert gen.tokens[s][:len(gen.seqs[s].prompt)] == gen.seqs[s].prompt
        k0, r0 = kept_rows[s]
        assert np.array_equal(rows(mem, k0), r0)
    assert gen.stats.n_shift == len(shifts) and gen.stats.gen_tokens == 2 * n_gen
    print(f"shifts (sequence, discarded): {shifts}")


def test_a_sequence_beside_another_is_exactly_as_alone(model, text_tokens):
    """One stream per sequence: sequence 0 decoded beside sequence 1 (each shifting at its own step)
    generates the same tokens, shifts the same way and ends with the same cells and logits as alone."""
    p0, p1 = text_tokens[:240], text_tokens[10:255]
    kw = dict(n_ctx=512, n_seq_max=2, kv_unified=False)
    n = 24
    ctx = Context(model, **kw)
    alone = generate(ctx, p0, max_tokens=n, sampler=NoEOG.greedy_for(model), n_keep=8)
    list(alone)
    logits_alone = ctx.get_logits_ith(-1).copy()
    cells_alone = ctx.memory.cells()[:256]
    assert alone.stats.n_shift == 1 and alone.stats.stop == "length"

    ctx = Context(model, **kw)
    both = generate_parallel(ctx, [p0, p1], max_tokens=n, samplers=[NoEOG.greedy_for(model), NoEOG.greedy_for(model)],
                             n_keep=8)
    list(both)
    assert [s.n_shift for s in both.seq_stats] == [1, 1]
    assert both.generated[0] == alone.generated and both.tokens[0] == alone.cache_tokens
    assert both.seq_stats[0].n_discarded == alone.stats.n_discarded
    assert ctx.memory.cells()[:256] == cells_alone
    np.testing.assert_array_equal(ctx.get_logits_ith(0), logits_alone)


def test_logits_after_a_shift_match_the_unshifted_cache(model, text_tokens, monkeypatch):
    """A generation shifts once (n_keep 0: positions [0, n) forgotten, the rest moved down by n); a second
    context decodes the same tokens the same way, forgets the same positions by seq_rm alone and keeps the
    later tokens at their unshifted positions. The final logits agree up to rounding."""
    prompt = text_tokens[:250]
    at = []
    real = G.context_shift

    def spy(memory, seq_id, keep_end, n_discard=0):
        n_past = memory.seq_pos_max(seq_id) + 1
        n, n_left = real(memory, seq_id, keep_end, n_discard)
        at.append((n_past, keep_end, n))
        return n, n_left

    monkeypatch.setattr(G, "context_shift", spy)
    ctx = Context(model, n_ctx=256)
    gen = generate(ctx, prompt, max_tokens=16, sampler=NoEOG.greedy_for(model))
    list(gen)
    assert len(at) == 1 and gen.stats.n_shift == 1
    n_past, keep_end, n = at[0]
    assert (n_past, keep_end, n) == (255, 0, 127)
    shifted = ctx.get_logits_ith(-1).copy()
    assert ctx.memory.seq_pos_max(0) + 1 == len(gen.cache_tokens) == 250 + 15 - n

    ref = Context(model, n_ctx=256)
    ref.decode(Batch(prompt))
    for tok in gen.generated[:-1]:  # the last sampled token is never decoded
        if ref.memory.seq_pos_max(0) + 1 == n_past:
            ref.memory.seq_rm(0, keep_end, keep_end + n)
        ref.decode(Batch([tok]))
    assert ref.memory.seq_pos_max(0) == 250 + 15 - 1  # unshifted positions
    mx, rms = compare(shifted, ref.get_logits_ith(-1))
    print(f"after a context shift vs the unshifted cache: max {mx:.3f}, RMS {rms:.3f}")


def test_without_context_shift_generation_stops_at_the_context(model, text_tokens):
    prompt = text_tokens[:250]
    for kw in (dict(max_tokens=100, context_shift=False), dict(max_tokens=-2)):
        ctx = Context(model, n_ctx=256)
        gen = generate(ctx, prompt, sampler=NoEOG.greedy_for(model), **kw)
        list(gen)
        # llama.cpp stops once n_past + 1 >= n_ctx: the 6th token is sampled but not decoded
        assert gen.stats.stop == "context" and gen.stats.gen_tokens == 6 and gen.stats.n_shift == 0
        assert ctx.memory.seq_pos_min(0) == 0 and ctx.memory.seq_pos_max(0) == 254
        assert gen.cache_tokens == prompt + gen.generated[:-1]


def test_memory_that_cannot_shift_stops_cleanly(model, text_tokens):
    ctx = unshiftable_context(model, n_ctx=256)
    assert not ctx.memory.can_shift
    gen = generate(ctx, text_tokens[:250], max_tokens=100, sampler=NoEOG.greedy_for(model))
    list(gen)
    assert gen.stats.stop == "context" and gen.stats.n_shift == 0 and ctx.memory.seq_pos_max(0) == 254
    with pytest.raises(LlamaxError, match="can_shift"):
        context_shift(ctx.memory, 0, 0)
    assert ctx.memory.seq_pos_min(0) == 0 and ctx.memory.seq_pos_max(0) == 254


def test_n_discard(model, text_tokens):
    """n_discard = 10: every shift forgets exactly 10 positions after the n_keep kept ones."""
    ctx = Context(model, n_ctx=256)
    gen = generate(ctx, text_tokens[:250], max_tokens=20, sampler=NoEOG.greedy_for(model), n_keep=5, n_discard=10)
    list(gen)
    st = gen.stats
    assert st.stop == "length" and st.n_shift == 2 and st.n_discarded == 20
    assert ctx.memory.seq_pos_max(0) < 255 and gen.cache_tokens[:5] == text_tokens[:5]
    assert gen.cache_tokens == text_tokens[:5] + (text_tokens[:250] + gen.generated[:-1])[25:]


def test_n_keep_resolution_and_argument_errors(model, text_tokens, monkeypatch):
    ctx = Context(model, n_ctx=256, n_seq_max=2)
    p = text_tokens[:20]
    assert generate(ctx, p).keep_end == 0
    assert generate(ctx, p, n_keep=-1).keep_end == 20
    assert generate(ctx, p, n_keep=7).keep_end == 7
    assert generate(ctx, p, n_keep=500).keep_end == 20
    assert generate(ctx, text_tokens[:254], n_keep=-1).keep_end == 252  # at most n_ctx_seq - 4
    monkeypatch.setattr(model.tokenizer, "add_bos", True)  # a model that adds BOS keeps it as well
    assert generate(ctx, "Hello there", n_keep=2).keep_end == 3
    monkeypatch.undo()
    generate(ctx, text_tokens[:255])  # one cell left for the next token
    with pytest.raises(ValueError, match="does not fit"):
        generate(ctx, text_tokens[:256])
    with pytest.raises(ValueError, match="n_discard"):
        generate(ctx, p, n_discard=-1)
    with pytest.raises(ValueError, match="max_tokens"):
        generate(ctx, p, max_tokens=-3)
    with pytest.raises(ValueError, match="empty"):
        generate(ctx, [])
    with pytest.raises(ValueError, match="seq_ids"):
        generate_parallel(ctx, [p, p], seq_ids=[1, 1])
    with pytest.raises(ValueError, match="seq_ids"):
        generate_parallel(ctx, [p, p, p])  # n_seq_max is 2
    with pytest.raises(ValueError, match="one Sampler per prompt"):
        generate_parallel(ctx, [p, p], samplers=Sampler())
    assert isinstance(generate_parallel(ctx, [p]), ParallelGeneration)
    # context_shift on its own: nothing to discard after keep_end
    ctx.decode(Batch(p))
    assert context_shift(ctx.memory, 0, 20) == (0, 0)
    assert context_shift(ctx.memory, 0, 19) == (0, 1)
    assert context_shift(ctx.memory, 0, 10, 100) == (10, 10) and ctx.memory.seq_pos_max(0) == 9


# ---- the command line ------------------------------------------------------------------------------------

@pytest.fixture
def cli(model, monkeypatch, capsys):
    """llamax's CLI in this process, on the already loaded model."""
    from llamax import cli as cli_mod
    from llamax.model import Model as M

    monkeypatch.setattr(M, "load", lambda *a, **k: model)

    def run(*argv):
        rc = cli_mod.main(["run", *argv])
        out, err = capsys.readouterr()
        return rc, out, err

    return run


def test_cli_run_writes_only_the_generated_text():
    """The real entry point, in its own process: only the generated text on stdout."""
    r = subprocess.run([sys.executable, "-m", "llamax", "run", "-p", "The capital of France is", "-n", "6",
                        "--temp", "0", "-c", "512"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(" Paris") and "capital" not in r.stdout
    assert "size =" in r.stderr and "t/s" in r.stderr


def test_cli_parallel_sequences(cli):
    rc, out, err = cli("-p", "The capital of France is", "-p", "1, 2, 3,", "-n", "6", "--temp", "0", "-c", "512",
                       "--parallel", "2")
    assert rc == 0, err
    assert "[sequence 0]  Paris" in out and "[sequence 1]" in out
    assert "generation: 12 tokens over 2 sequences" in err


def test_cli_parallel_sequences_shift_their_context(cli, text_tokens, model):
    a, b = model.detokenize(text_tokens[:115]), model.detokenize(text_tokens[115:230])
    rc, out, err = cli("-p", a, "-p", b, "--parallel", "2", "-n", "16", "-c", "256", "--temp", "0", "--keep", "-1")
    assert rc == 0, err
    assert out.count("[sequence ") == 2 and "[sequence 0]" in out and "[sequence 1]" in out
    shifts = int(err.split("context shifts: ")[1].split()[0])
    assert shifts >= 1


def test_cli_context_shift_off_and_until_eog(cli, capsys, text_tokens, model):
    long = model.detokenize(text_tokens[:250])
    rc, out, err = cli("-p", long, "-n", "100", "-c", "256", "--temp", "0", "--no-context-shift")
    assert rc == 0 and "stop: context" in err and "context shifts" not in err
    rc, out, err = cli("-p", "Say yes.", "--chat", "-n", "-1", "-c", "256", "--temp", "0")
    assert rc == 0 and "stop: eog" in err and out.strip()
    rc, out, err = cli("-n", "-3")
    assert rc == 2 and "-n must be" in err
    with pytest.raises(SystemExit) as e:  # argparse: not a cache type
        cli("-ctk", "q5_9")
    assert e.value.code == 2 and "invalid choice" in capsys.readouterr().err


@pytest.mark.parametrize("t", ["q8_0", "q4_0"])
def test_cli_quantized_cache_generates_and_shifts(cli, text_tokens, model, t):
    rc, out, err = cli("-p", "The capital of France is", "-n", "6", "--temp", "0", "-c", "2048", "-ctk", t, "-ctv", t)
    assert rc == 0, err
    assert out.startswith(" Paris")
    mib = {"q8_0": "23.91", "q4_0": "12.66"}[t]  # llama.cpp's own line for this cache (kv_log.txt)
    assert f"size =   {mib} MiB (  2048 cells,  30 layers,  1/1 seqs), K ({t})" in err
    long = model.detokenize(text_tokens[:240])  # past n_ctx: the quantized K is shifted
    rc, out, err = cli("-p", long, "-n", "40", "-c", "256", "--temp", "0", "-ctk", t, "-ctv", t)
    assert rc == 0, err
    assert int(err.split("context shifts: ")[1].split()[0]) >= 1 and out.strip()


def test_cli_quantized_v_needs_flash_attention(cli):
    rc, out, err = cli("-p", "Hi", "-n", "2", "-ctv", "q8_0", "-fa", "off")
    assert rc != 0 and "flash_attn" in err and not out
