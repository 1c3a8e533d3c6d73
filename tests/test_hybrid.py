"""HybridMemory (llama.cpp's llama_memory_hybrid) under the jamba architecture, on the synthetic Jamba
GGUF of tests/synthetic.py: every operation reaches both memories or neither, one batch fits both or
neither changes, state round trips, a failed forward pass undone in both."""
import subprocess
import sys

import numpy as np
import pytest

import llamax
from llamax import Batch, Context, LlamaxError, Model, NoKVSlotError
from helpers import fail_forward_at, prompt_logits
from synthetic import write_jamba

TEXT = "The quick brown fox jumps over the lazy dog. Jamba mixes attention and state"


@pytest.fixture(scope="module")
def jamba_gguf(tmp_path_factory, smollm2_gguf):
    return write_jamba(tmp_path_factory.mktemp("jamba") / "jamba.gguf", smollm2_gguf)


@pytest.fixture(scope="module")
def jamba(jamba_gguf):
    return Model.load(jamba_gguf, n_threads=2)


def test_attention_layers_get_the_kv_cache_and_the_others_the_states(jamba):
    mem = Context(jamba, n_ctx=512, n_seq_max=2).memory
    assert isinstance(mem, llamax.HybridMemory)
    assert mem.attn.layer_ids == [1, 3] and mem.recr.layer_ids == [0, 2]
    assert mem.attn.n_cells == 512 and mem.recr.n_cells == 2
    assert mem.can_shift                          # NoPE: a shift only renumbers positions (they only mask)
    assert mem.attn.lock is mem.lock and mem.recr.lock is mem.lock


def test_the_same_bits_in_one_batch_token_by_token_in_chunks_and_on_any_thread_count(jamba):
    toks = jamba.tokenize(TEXT)
    want = prompt_logits(jamba, toks)
    for kw in (dict(n_ubatch=1), dict(n_ubatch=6), dict(chunks=[1] * len(toks)), dict(chunks=[9, len(toks) - 9]),
               dict(n_threads=1)):
        assert np.array_equal(prompt_logits(jamba, toks, **kw), want), kw


def test_partial_seq_rm_is_refused_by_both_and_full_removal_reaches_both(jamba):
    toks = jamba.tokenize(TEXT)
    ctx = Context(jamba, n_ctx=512, n_threads=2)
    ctx.decode(Batch(toks))
    before = ctx.state_get_data()
    n_attn = ctx.memory.attn.n_used
    assert n_attn == len(toks)
    assert ctx.memory.seq_rm(0, 4, -1) is False
    assert ctx.memory.attn.n_used == n_attn and ctx.state_get_data() == before
    assert ctx.memory.seq_rm(0, -1, -1) is True
    assert ctx.memory.attn.n_used == 0 and ctx.memory.recr.n_used == 0 and ctx.memory.seq_pos_max(0) == -1


def test_a_context_shift_drops_the_attention_cells_and_renumbers_the_state(jamba):
    from llamax.sequence import context_shift

    toks = jamba.tokenize(TEXT)
    ctx = Context(jamba, n_ctx=512, n_threads=2)
    ctx.decode(Batch(toks))
    mem, n = ctx.memory, len(toks)
    states = [a.copy() for a in mem.recr.conv + mem.recr.ssm]
    done, n_left = context_shift(mem, 0, 2, 4)
    assert (done, n_left) == (4, n - 2)
    # the attention layers forgot positions [2, 6) and moved the rest down; the state kept all it folded in
    assert sorted(p for p, seqs in mem.attn.cells() if seqs) == list(range(n - 4))
    assert mem.recr.seq_pos_max(0) == n - 5 and mem.seq_pos_max(0) == n - 5
    assert all(np.array_equal(a, b) for a, b in zip(states, mem.recr.conv + mem.recr.ssm))
    ctx.decode(Batch([42]))                       # goes on at position n - 4
    assert mem.seq_pos_max(0) == n - 4 and np.isfinite(ctx.get_logits()).all()


def test_sequences_after_seq_cp_continue_identically(jamba):
    toks = jamba.tokenize(TEXT)
    ctx = Context(jamba, n_ctx=512, n_seq_max=2, n_threads=2)
    ctx.decode(Batch(toks, seq_ids=0))
    ctx.memory.seq_cp(0, 1)
    assert ctx.memory.seq_pos_max(1) == len(toks) - 1
    ctx.decode(Batch([42, 7] * 2, seq_ids=[0, 0, 1, 1], logits=[True] * 4))
    out = ctx.get_logits()
    assert np.array_equal(out[0:2], out[2:4])
    assert np.array_equal(out[0:2], prompt_logits(jamba, toks + [42, 7])[len(toks):])


def test_state_round_trips_continue_bit_for_bit(jamba):
    toks = jamba.tokenize(TEXT)
    ctx = Context(jamba, n_ctx=512, n_seq_max=2, n_threads=2)
    ctx.decode(Batch(toks, seq_ids=0))
    blob, whole = ctx.state_seq_get_data(0), ctx.state_get_data()
    ctx.decode(Batch([5, 6], seq_ids=0, logits=[True, True]))
    want = ctx.get_logits().copy()
    other = Context(jamba, n_ctx=512, n_seq_max=2, n_threads=2)
    other.decode(Batch([9, 9, 9], seq_ids=0))
    other.state_seq_set_data(blob, 1)
    other.decode(Batch([5, 6], seq_ids=1, logits=[True, True]))
    assert np.array_equal(other.get_logits(), want)
    third = Context(jamba, n_ctx=512, n_seq_max=2, n_threads=2)
    third.state_set_data(whole)
    third.decode(Batch([5, 6], seq_ids=0, logits=[True, True]))
    assert np.array_equal(third.get_logits(), want)


def test_a_state_of_the_mamba_alone_is_refused(jamba, tmp_path, smollm2_gguf):
    from synthetic import write_mamba
    mamba = Model.load(write_mamba(tmp_path / "m.gguf", smollm2_gguf))
    src = Context(mamba, n_ctx=512)
    src.decode(Batch(mamba.tokenize(TEXT)))
    with pytest.raises(llamax.StateError):
        Context(jamba, n_ctx=512).state_seq_set_data(src.state_seq_get_data(0), 0)


def test_a_batch_that_does_not_fit_the_kv_cache_changes_neither(jamba):
    ctx = Context(jamba, n_ctx=256, n_seq_max=2, n_threads=2)
    toks = jamba.tokenize(TEXT)
    ctx.decode(Batch(toks, seq_ids=0))
    before = ctx.state_get_data()
    with pytest.raises(NoKVSlotError):
        ctx.decode(Batch([7] * 250, seq_ids=1))
    assert ctx.state_get_data() == before and ctx.memory.recr.n_used == 1


def test_a_forward_pass_failing_midway_is_undone_in_both(jamba, monkeypatch):
    toks = jamba.tokenize(TEXT)
    ctx = Context(jamba, n_ctx=512, n_seq_max=2, n_ubatch=4, n_threads=2)
    ctx.decode(Batch(toks[:6], seq_ids=0))
    before = ctx.state_get_data()
    fail_forward_at(monkeypatch, jamba, 3, [])
    with pytest.raises(RuntimeError):
        ctx.decode(Batch(toks[6:] + toks, seq_ids=[0] * (len(toks) - 6) + [1] * len(toks)))
    monkeypatch.undo()
    assert ctx.memory.attn.n_used == 6 and ctx.memory.seq_pos_max(0) == 5 and ctx.memory.seq_pos_max(1) == -1
    ctx.decode(Batch([1]))
    after = Context(jamba, n_ctx=512, n_seq_max=2, n_threads=2)
    after.state_set_data(before)
    after.decode(Batch([1]))
    assert np.array_equal(ctx.get_logits(), after.get_logits())


def test_llamax_run_on_a_jamba_gguf(jamba_gguf):
    r = subprocess.run([sys.executable, "-m", "llamax", "run", "-m", str(jamba_gguf), "-p", TEXT, "-n", "8",
                        "--temp", "0", "-c", "256"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "llama_memory_recurrent: size =" in r.stderr and "llama_kv_cache: size =" in r.stderr
