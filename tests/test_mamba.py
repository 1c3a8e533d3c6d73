"""The mamba architecture over a RecurrentMemory, on the synthetic Mamba-1 GGUF of tests/synthetic.py:
the same bits whatever the batch split and thread count, sequences copied and continued, per-sequence
state round trips, partial removals refused, a failed forward pass undone, `llamax run -m`, and the
Engine's refusal."""
import subprocess
import sys

import numpy as np
import pytest

import llamax
from llamax import Batch, Context, Model
from helpers import fail_forward_at, prompt_logits
from synthetic import write_mamba

TEXT = "The quick brown fox jumps over the lazy dog. Mamba folds every token into a state"


@pytest.fixture(scope="module")
def mamba_gguf(tmp_path_factory, smollm2_gguf):
    return write_mamba(tmp_path_factory.mktemp("mamba") / "mamba.gguf", smollm2_gguf)


@pytest.fixture(scope="module")
def mamba(mamba_gguf):
    return Model.load(mamba_gguf, n_threads=2)


def test_the_memory_is_recurrent_and_sized_per_sequence(mamba):
    ctx = Context(mamba, n_ctx=512, n_seq_max=3)
    mem = ctx.memory
    assert isinstance(mem, llamax.RecurrentMemory)
    assert mem.n_cells == 3 and mem.layer_ids == [0, 1, 2, 3]
    assert mem.conv[0].shape == (3, 128, 3) and mem.ssm[0].shape == (3, 128, 16)
    assert "3 cells,   4 layers" in mem.summary()


def test_a_prompt_gives_the_same_bits_in_one_batch_token_by_token_in_chunks_and_on_any_thread_count(mamba):
    toks = mamba.tokenize(TEXT)
    want = prompt_logits(mamba, toks)
    for kw in (dict(n_ubatch=1), dict(n_ubatch=5), dict(chunks=[1] * len(toks)), dict(chunks=[7, 3, len(toks) - 10]),
               dict(n_threads=1)):
        assert np.array_equal(prompt_logits(mamba, toks, **kw), want), kw


def test_two_sequences_in_one_batch_give_each_alone_bits(mamba):
    a, b = mamba.tokenize(TEXT), mamba.tokenize("Once upon a time there was a snake")
    la, lb = prompt_logits(mamba, a), prompt_logits(mamba, b)
    ctx = Context(mamba, n_ctx=512, n_seq_max=2, n_threads=2)
    ctx.decode(Batch(a + b, seq_ids=[0] * len(a) + [1] * len(b), logits=[True] * (len(a) + len(b))))
    both = ctx.get_logits()
    assert np.array_equal(both[:len(a)], la) and np.array_equal(both[len(a):], lb)


def test_sequences_after_seq_cp_continue_identically(mamba):
    toks = mamba.tokenize(TEXT)
    ctx = Context(mamba, n_ctx=512, n_seq_max=3, n_threads=2)
    ctx.decode(Batch(toks, seq_ids=0))
    ctx.memory.seq_cp(0, 1)
    ctx.memory.seq_cp(0, 2)
    nxt = [42, 7, 1999]
    ctx.decode(Batch(nxt * 3, seq_ids=[0] * 3 + [1] * 3 + [2] * 3, logits=[True] * 9))
    out = ctx.get_logits()
    assert np.array_equal(out[0:3], out[3:6]) and np.array_equal(out[0:3], out[6:9])
    alone = prompt_logits(mamba, toks + nxt)
    assert np.array_equal(out[0:3], alone[len(toks):])


def test_a_sequence_state_round_trip_continues_bit_for_bit(mamba, tmp_path):
    toks = mamba.tokenize(TEXT)
    ctx = Context(mamba, n_ctx=512, n_seq_max=2, n_threads=2)
    ctx.decode(Batch(toks, seq_ids=0))
    blob = ctx.state_seq_get_data(0)
    ctx.state_seq_save_file(tmp_path / "seq.bin", 0, toks)
    ctx.decode(Batch([5, 6], seq_ids=0, logits=[True, True]))
    want = ctx.get_logits().copy()

    other = Context(mamba, n_ctx=512, n_seq_max=2, n_threads=2)
    other.decode(Batch([9, 9, 9], seq_ids=0))
    other.state_seq_set_data(blob, 1)
    other.decode(Batch([5, 6], seq_ids=1, logits=[True, True]))
    assert np.array_equal(other.get_logits(), want)
    third = Context(mamba, n_ctx=512, n_threads=2)
    assert third.state_seq_load_file(tmp_path / "seq.bin", 0) == toks
    third.decode(Batch([5, 6], seq_ids=0, logits=[True, True]))
    assert np.array_equal(third.get_logits(), want)
    whole = ctx.state_get_data()
    fourth = Context(mamba, n_ctx=512, n_seq_max=2, n_threads=2)
    fourth.state_set_data(whole)
    assert np.array_equal(fourth.get_logits(), want) and fourth.state_get_data() == whole


def test_a_state_of_another_model_is_refused(mamba, model):
    ctx = Context(mamba, n_ctx=512, n_threads=2)
    ctx.decode(Batch(mamba.tokenize(TEXT)))
    kv = Context(model, n_ctx=512)
    with pytest.raises(llamax.StateError):
        kv.state_seq_set_data(ctx.state_seq_get_data(0), 0)
    with pytest.raises(llamax.StateError):
        ctx.state_seq_set_data(kv.state_seq_get_data(0), 0)


def test_partial_seq_rm_is_refused_with_the_memory_unchanged(mamba):
    toks = mamba.tokenize(TEXT)
    ctx = Context(mamba, n_ctx=512, n_threads=2)
    ctx.decode(Batch(toks))
    before = ctx.state_get_data()
    assert ctx.memory.seq_rm(0, 5, -1) is False
    assert ctx.memory.seq_rm(0, 0, 5) is False
    assert ctx.state_get_data() == before
    assert ctx.memory.seq_rm(0, -1, -1) is True and ctx.memory.seq_pos_max(0) == -1


def test_a_forward_pass_failing_midway_leaves_every_state_as_before(mamba, monkeypatch):
    toks = mamba.tokenize(TEXT)
    ctx = Context(mamba, n_ctx=512, n_seq_max=2, n_ubatch=4, n_threads=2)
    ctx.decode(Batch(toks[:6], seq_ids=0))
    before = ctx.state_get_data()
    calls: list = []
    fail_forward_at(monkeypatch, mamba, 3, calls)
    with pytest.raises(RuntimeError):
        ctx.decode(Batch(toks[6:] + toks, seq_ids=[0] * (len(toks) - 6) + [1] * len(toks)))
    monkeypatch.undo()
    assert len(calls) == 3
    ctx.decode(Batch([1]))            # the outputs of the failed decode are gone; the states are intact:
    after = Context(mamba, n_ctx=512, n_seq_max=2, n_threads=2)
    after.state_set_data(before)
    after.decode(Batch([1]))
    assert np.array_equal(ctx.get_logits(), after.get_logits())
    assert ctx.memory.seq_pos_max(1) == -1


def test_llamax_run_on_a_mamba_gguf(mamba_gguf):
    r = subprocess.run([sys.executable, "-m", "llamax", "run", "-m", str(mamba_gguf), "-p", TEXT, "-n", "8",
                        "--temp", "0", "-c", "256"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "llama_memory_recurrent: size =" in r.stderr and "t/s" in r.stderr
    toks = Model.load(mamba_gguf).tokenize(TEXT)
    ctx = Context(Model.load(mamba_gguf), n_ctx=256)
    text = "".join(llamax.generate(ctx, toks, max_tokens=8, sampler=llamax.Sampler(0.0)))
    assert r.stdout.rstrip("\n") == text


@pytest.mark.parametrize("key,value", [
    ("mamba.ssm.conv_kernel", (0, "UINT32")), ("mamba.ssm.conv_kernel", (1000, "UINT32")),
    ("mamba.ssm.inner_size", (2**40, "UINT64")), ("mamba.ssm.state_size", ("16", "STRING")),
    ("mamba.ssm.time_step_rank", (None, None)), ("mamba.ssm.group_count", (8, "UINT32")),
    ("mamba.ssm.dt_b_c_rms", (3, "UINT32")), ("mamba.ssm.state_size", (17, "UINT32")),
])
def test_bad_ssm_hyperparameters_are_model_errors(tmp_path, smollm2_gguf, key, value):
    """A missing, mistyped, out-of-range or inconsistent SSM size is a ModelError naming it, before any
    weight or state is allocated."""
    import gguf

    v, t = value
    path = write_mamba(tmp_path / "bad.gguf", smollm2_gguf,
                       overrides={key: (v, None if t is None else getattr(gguf.GGUFValueType, t))})
    with pytest.raises(llamax.ModelError, match="ssm|state|Mamba-2"):
        Model.load(path)
