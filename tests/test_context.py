"""Context.decode on the real SmolLM2: errors leave the cache unchanged, logits accessors, generation;
Model.load's errors on bad files. (The CLI's tests are in test_generate.py.)"""
import gguf
import numpy as np
import pytest

import llamax
from llamax import Batch, BatchError, ModelError, NoKVSlotError
from llamax.context import Context
from llamax.generate import generate
from llamax.model import Model
from llamax.sampling import Sampler


def snapshot(mem):
    out = [a.tobytes() for a in mem.k + mem.v]
    out += [c.snapshot(range(c.size)).tobytes() for c in mem.meta.streams]
    return out + [mem.meta.heads.tobytes()]


def test_model_basics(model):
    assert model.arch == "llama" and model.n_vocab == 49152 and model.hparams.n_layer == 30
    assert model.tokenize("Hello world") == [19556, 905]
    assert model.detokenize(model.tokenize("Hello world")) == "Hello world"
    assert model.is_eog(model.eos)
    assert "<|im_start|>assistant" in model.apply_chat_template([{"role": "user", "content": "hi"}])


def test_invalid_batches_and_overflow_leave_the_cache_unchanged(model):
    ctx = Context(model, n_ctx=256, n_seq_max=2)
    ctx.decode(Batch(model.tokenize("The capital of France is")))
    before = snapshot(ctx.memory)
    logits = ctx.get_logits().copy()
    for bad in (Batch([model.n_vocab + 5]),                         # token outside the vocabulary
                Batch([1, 2], seq_ids=[0, 7]),                         # sequence outside n_seq_max
                Batch([1, 2], pos=[0, 1]),                             # does not continue sequence 0
                Batch([1] * 300)):                                     # more than n_batch (256)
        with pytest.raises(BatchError):
            ctx.decode(bad)
        assert snapshot(ctx.memory) == before
    with pytest.raises(NoKVSlotError):
        ctx.decode(Batch([1] * 252, seq_ids=[1] * 252))               # 5 + 252 > 256 cells
    assert snapshot(ctx.memory) == before
    np.testing.assert_array_equal(ctx.get_logits(), logits)
    with pytest.raises(TypeError):
        ctx.decode([1, 2, 3])


def test_logits_accessors(model):
    ctx = Context(model, n_ctx=256)
    toks = model.tokenize("one two three four")
    ctx.decode(Batch(toks, logits=[True, False, True, True]))
    all_ = ctx.get_logits()
    assert all_.shape == (3, model.n_vocab)
    np.testing.assert_array_equal(ctx.get_logits_ith(0), all_[0])
    np.testing.assert_array_equal(ctx.get_logits_ith(2), all_[1])
    np.testing.assert_array_equal(ctx.get_logits_ith(-1), all_[2])
    with pytest.raises(IndexError):
        ctx.get_logits_ith(1)  # did not ask for logits
    with pytest.raises(IndexError):
        ctx.get_logits_ith(4)


def test_params_are_derived(model):
    ctx = Context(model, n_ctx=300, n_batch=4096)
    assert ctx.params.n_ctx == 512 and ctx.params.n_batch == 300 and ctx.memory.kv_size == 512
    ctx = Context(model, n_ctx=1000, n_seq_max=3, kv_unified=False)
    assert ctx.params.n_ctx_seq == 512 and ctx.memory.n_stream == 3 and ctx.memory.kv_size == 512


def test_generate_streams_text_and_reports_speed(model):
    ctx = Context(model, n_ctx=512)
    gen = generate(ctx, "The capital of France is", max_tokens=12, sampler=Sampler.greedy())
    text = "".join(gen)
    assert text.startswith(" Paris")
    st = gen.stats
    assert st.prompt_tokens == 5 and st.gen_tokens == 12 and st.stop == "length" and st.gen_tps > 0
    # seeded sampling is reproducible
    a = "".join(generate(Context(model, n_ctx=512), "Once upon a time", 16, Sampler(seed=7)))
    b = "".join(generate(Context(model, n_ctx=512), "Once upon a time", 16, Sampler(seed=7)))
    assert a == b


def test_generation_stops_at_end_of_generation(model):
    ctx = Context(model, n_ctx=512)
    prompt = model.apply_chat_template([{"role": "user", "content": "Say yes."}])
    gen = generate(ctx, prompt, max_tokens=200, sampler=Sampler.greedy())
    text = "".join(gen)
    assert gen.stats.stop == "eog" and "<|im_end|>" not in text and text.strip()


def test_model_load_errors(tmp_path):
    with pytest.raises(ModelError):
        Model.load(tmp_path / "missing.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(ModelError):
        Model.load(bad)
    trunc = tmp_path / "trunc.gguf"
    trunc.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 10)
    with pytest.raises(ModelError):
        Model.load(trunc)
    with pytest.raises(ModelError):
        Model.load("no-such-model")
    # a well-formed GGUF of an unknown architecture, and a llama one lacking its tensors
    for arch, err in (("mamba9", "not supported"), ("llama", "missing")):
        p = tmp_path / f"{arch}.gguf"
        w = gguf.GGUFWriter(str(p), arch)
        w.add_block_count(1)
        w.add_embedding_length(8)
        w.add_feed_forward_length(16)
        w.add_head_count(2)
        w.add_context_length(64)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_tokenizer_model("gpt2")
        w.add_token_list(["a", "b", "ab"])
        w.add_token_types([1, 1, 1])
        w.add_token_merges(["a b"])
        w.add_tensor("output_norm.weight", np.ones(8, np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        with pytest.raises(ModelError, match=err):
            Model.load(p)
    assert isinstance(llamax.errors.ModelError("x"), llamax.LlamaxError)


def test_the_public_fingerprint_is_what_state_files_carry_and_check(model, tmp_path):
    """ctx.fingerprint is the 16 bytes every state of the context names its model by (header offset
    16), and the ones set_data / load_file check (a blob naming another model is refused)."""
    from llamax import StateError
    from llamax import state as lstate

    ctx = Context(model, n_ctx=256)
    toks = model.tokenize("Hello there")
    ctx.decode(Batch.one(toks))
    assert ctx.fingerprint == lstate.fingerprint_bytes(model.fingerprint) and len(ctx.fingerprint) == 16
    for blob in (ctx.state_get_data(), ctx.state_seq_get_data(0)):
        assert blob[16:32] == ctx.fingerprint
    ctx.state_seq_save_file(tmp_path / "s.bin", 0, toks)
    assert ctx.fingerprint in (tmp_path / "s.bin").read_bytes()
    blob = ctx.state_seq_get_data(0)
    lstate.StateReader(blob, kind=lstate.KIND_SEQ, fingerprint=ctx.fingerprint, exact=True)
    other = bytes(b ^ 1 for b in ctx.fingerprint)
    with pytest.raises(StateError, match="another model"):
        lstate.StateReader(blob, kind=lstate.KIND_SEQ, fingerprint=other, exact=True)
    forged = blob[:16] + other + blob[32:]  # the header's CRC covers it: refused either way
    with pytest.raises(StateError):
        ctx.state_seq_set_data(forged, 0)
