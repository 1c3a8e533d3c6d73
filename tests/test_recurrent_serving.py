"""The Engine on recurrent and hybrid models (the synthetic Mamba, Jamba, Mamba-2, granitehybrid, nemotron_h
of tests/synthetic.py and the qwen35 of tests/synthetic_qwen35.py):
continuous batching, exact prefix reuse from state checkpoints, speculative decoding, cancellation,
suspension, slot files, context shift and prefix handover. A request's tokens equal its solo run's,
greedy, bit for bit, whatever ran beside it and whatever it restored."""
import pytest

from llamax import Engine, LlamaxError, Model, Speculative, StateError
from llamax.serving.reuse import CHECKPOINT_EVERY, CheckpointReuse
from synthetic import write_granitehybrid, write_jamba, write_mamba, write_mamba2, write_nemotron_h
from synthetic_qwen35 import write_qwen35

WRITERS = {"mamba": write_mamba, "jamba": write_jamba, "mamba2": write_mamba2, "granitehybrid": write_granitehybrid,
           "nemotron_h": write_nemotron_h, "qwen35": write_qwen35}
GREEDY = dict(temperature=0, ignore_eos=True)


FEW = ("mamba", "granitehybrid")   # the engine's own logic (not the model's): a pure and a hybrid model


@pytest.fixture(scope="module")
def written(tmp_path_factory, smollm2_gguf):
    """name -> the synthetic model, written and loaded on first use."""
    out = {}

    def get(name):
        if name not in out:
            d = tmp_path_factory.mktemp(name)
            out[name] = Model.load(WRITERS[name](d / f"{name}.gguf", smollm2_gguf), n_threads=2)
        return out[name]
    return get


@pytest.fixture(scope="module", params=sorted(WRITERS))
def rmodel(request, written):
    return written(request.param)


@pytest.fixture(scope="module", params=FEW)
def rmodel_few(request, written):
    return written(request.param)


_SOLO: dict = {}


def solo_run(model, prompt, max_tokens=16):
    """prompt's solo run on model: one slot, nothing reused (memoised)."""
    key = (id(model), tuple(prompt), max_tokens)
    if key not in _SOLO:
        eng = Engine(model, n_ctx=2048, n_parallel=1, prefix_cache=False)
        _SOLO[key] = eng.generate(list(prompt), max_tokens=max_tokens, **GREEDY).tokens
    return _SOLO[key]


@pytest.fixture(scope="module")
def solo(rmodel):
    return lambda prompt, max_tokens=16: solo_run(rmodel, prompt, max_tokens)


@pytest.fixture(scope="module")
def solo_few(rmodel_few):
    return lambda prompt, max_tokens=16: solo_run(rmodel_few, prompt, max_tokens)


def doc(n, seed=0):
    return [(seed * 977 + j * 31) % 30000 + 300 for j in range(n)]


def test_the_engine_takes_recurrent_models_with_state_checkpoints(rmodel_few):
    eng = Engine(rmodel_few, n_ctx=1024, n_parallel=3)
    assert isinstance(eng.reuse, CheckpointReuse) and eng.params.n_seq_max == 3
    assert eng.context_shift and "checkpoints" in repr(eng)


def test_concurrent_requests_equal_their_solo_runs_and_reuse_shared_prefixes(rmodel, solo):
    eng = Engine(rmodel, n_ctx=2048, n_parallel=3, n_batch=256)
    system = doc(CHECKPOINT_EVERY + 40)
    prompts = [system + doc(10 + 5 * i, seed=i + 1) for i in range(5)]
    reqs = [eng.submit(p, max_tokens=12, **GREEDY) for p in prompts]
    out = [r.result() for r in reqs]
    assert [o.tokens for o in out] == [solo(p, 12) for p in prompts]
    # the first computes it all; the others wait for its checkpoint at CHECKPOINT_EVERY and restore it
    assert out[0].n_cached == 0 and all(o.n_cached == CHECKPOINT_EVERY for o in out[1:])
    m = eng.metrics()
    assert m["prefix_hits"] == 4 and m["cache_ram_restores"] == 4 and m["tokens_reused"] == 4 * CHECKPOINT_EVERY
    assert m["prompt_tokens"] == sum(len(p) for p in prompts) - 4 * CHECKPOINT_EVERY


def test_the_same_prompt_again_and_a_second_chat_turn_reuse_the_first(rmodel, solo):
    eng = Engine(rmodel, n_ctx=2048, n_parallel=2)
    p1 = doc(300)
    r1 = eng.generate(p1, max_tokens=16, **GREEDY)
    again = eng.generate(p1, max_tokens=16, **GREEDY)
    assert again.tokens == r1.tokens == solo(p1) and again.n_cached == len(p1) - 1   # its last token is computed
    p2 = p1 + r1.tokens + doc(20, seed=7)                  # the answer, then the next user turn
    r2 = eng.generate(p2, max_tokens=16, **GREEDY)
    assert r2.n_cached == len(p1) + len(r1.tokens) - 1     # the whole first turn: its state at release
    assert r2.tokens == solo(p2)


def test_without_cache_ram_nothing_is_reused(rmodel_few, solo_few):
    eng = Engine(rmodel_few, n_ctx=1024, n_parallel=1, cache_ram=0)
    p = doc(100)
    assert [eng.generate(p, max_tokens=8, **GREEDY).n_cached for _ in range(2)] == [0, 0]
    assert eng.generate(p, max_tokens=8, **GREEDY).tokens == solo_few(p, 8)
    assert eng.metrics()["cache_ram_entries"] == 0


def test_speculative_decoding_rolls_states_back_exactly(rmodel, solo):
    spec = Speculative(kind="ngram", n_max=6, ngram_min=1, adaptive=False)   # drafts at every chance
    eng = Engine(rmodel, n_ctx=1024, n_parallel=2, speculative=spec)
    p0 = doc(40)
    p = p0 + solo(p0, 32) + doc(7, seed=9) + p0          # what follows p0 once: drafted after it again
    reqs = [eng.submit(p, max_tokens=32, **GREEDY), eng.submit(p0 * 3, max_tokens=32, **GREEDY)]
    out = [r.result() for r in reqs]
    assert out[0].tokens == solo(p, 32) and out[1].tokens == solo(p0 * 3, 32)
    assert sum(o.n_drafted for o in out) > 0 and sum(o.n_accepted for o in out) < sum(o.n_drafted for o in out)


def test_a_cancelled_request_frees_its_state(rmodel_few, solo_few):
    eng = Engine(rmodel_few, n_ctx=1024, n_parallel=1)
    r = eng.submit(doc(200), max_tokens=500, **GREEDY)
    for _ in range(3):
        eng.step()
    r.cancel()
    eng.step()
    assert r.result().stop == "cancelled" and eng.memory.n_used == 0
    p = doc(60, seed=3)
    assert eng.generate(p, max_tokens=8, **GREEDY).tokens == solo_few(p, 8)


def test_slot_files_carry_a_state_to_another_engine(rmodel_few, solo_few, tmp_path):
    a = Engine(rmodel_few, n_ctx=1024, n_parallel=1, slot_save_path=tmp_path)
    p = doc(120)
    r = a.generate(p, max_tokens=8, **GREEDY)
    saved = a.slot_save(0, "conv.bin")
    assert saved["n_saved"] == len(p) + len(r.tokens) - 1
    b = Engine(rmodel_few, n_ctx=1024, n_parallel=1, slot_save_path=tmp_path)
    assert b.slot_restore(0, "conv.bin")["n_restored"] == saved["n_saved"]
    nxt = p + r.tokens + doc(10, seed=5)
    got = b.generate(nxt, max_tokens=8, **GREEDY)
    assert got.n_cached == saved["n_saved"] and got.tokens == solo_few(nxt, 8)
    (tmp_path / "bad.bin").write_bytes((tmp_path / "conv.bin").read_bytes()[:-10])
    before = b.tier.stats()
    with pytest.raises(StateError):
        b.slot_restore(0, "bad.bin")
    assert b.tier.stats() == before and b.memory.n_used == 0   # nothing kept of it, nothing lost


def test_a_prefix_moves_between_engines(rmodel_few, solo_few):
    a, b = (Engine(rmodel_few, n_ctx=1024, n_parallel=1) for _ in range(2))
    p = doc(200)
    a.generate(p, max_tokens=4, **GREEDY)
    state = a.export_prefix(p)
    assert state is not None and len(state.tokens) == len(p) - 1
    assert b.import_prefix(state) == len(p) - 1 and b.import_prefix(state) == 0
    got = b.generate(p, max_tokens=8, **GREEDY)
    assert got.n_cached == len(p) - 1 and got.tokens == solo_few(p, 8)
    with pytest.raises(LlamaxError, match="keeps no states"):
        Engine(rmodel_few, n_ctx=1024, n_parallel=1, cache_ram=0).import_prefix(state)


def test_context_shift_renumbers_the_state_and_goes_on(rmodel):
    def run(n_parallel):
        eng = Engine(rmodel, n_ctx=128 * n_parallel, n_parallel=n_parallel, n_ctx_slot=128)
        reqs = [eng.submit(doc(80, seed=s), max_tokens=100, n_keep=8, **GREEDY) for s in range(n_parallel)]
        return [r.result() for r in reqs]
    alone, together = run(1), run(2)
    assert alone[0].n_generated == 100 and alone[0].stop == "length" and alone[0].n_shift >= 1
    assert together[0].tokens == alone[0].tokens     # a shifted request is batch-invariant too


def test_a_hybrid_suspends_and_resumes_with_the_same_tokens(tmp_path, smollm2_gguf):
    jamba = Model.load(write_jamba(tmp_path / "j.gguf", smollm2_gguf), n_threads=2)
    prompts = [doc(100, seed=s) for s in range(2)]
    want = [Engine(jamba, n_ctx=1024, n_parallel=1, prefix_cache=False).generate(p, max_tokens=100, **GREEDY).tokens
            for p in prompts]
    eng = Engine(jamba, n_ctx=256, n_parallel=2, prefix_cache=False)   # both do not fit to the end
    reqs = [eng.submit(p, max_tokens=100, **GREEDY) for p in prompts]
    out = [r.result() for r in reqs]
    assert [o.tokens for o in out] == want and eng.metrics()["requests_suspended"] >= 1


def test_llamax_serve_runs_a_mamba_with_the_openai_client(tmp_path, smollm2_gguf):
    import openai
    from test_server import LiveServer

    path = write_mamba(tmp_path / "mamba.gguf", smollm2_gguf)
    srv = LiveServer("-m", str(path), "-np", "2", "-c", "1024", "--cache-ram", "64")
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
        prompt = " ".join(f"word{i}" for i in range(120))
        first, again = (client.completions.create(model="m", prompt=prompt, max_tokens=8, temperature=0)
                        for _ in range(2))
        assert again.choices[0].text == first.choices[0].text
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        assert again.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens - 1
        m = srv.metrics()
        assert m["llamax_cache_ram_restores_total"] == 1 and m["llamax_cache_ram_budget"] == 64 << 20
    finally:
        assert srv.stop() == 0, "".join(srv.lines[-20:])


def test_an_imported_state_that_is_not_its_tokens_is_dropped_at_its_first_use(rmodel_few, solo_few):
    """A PrefixState whose tokens were cut after export: its state ends later than they do. The request
    that would restore it computes its prompt instead (the same tokens as its solo run) and the state is
    forgotten."""
    a, b = (Engine(rmodel_few, n_ctx=1024, n_parallel=1) for _ in range(2))
    p = doc(200)
    a.generate(p, max_tokens=4, **GREEDY)
    state = a.export_prefix(p)
    bad = type(state)(state.tokens[:120], state.data)
    assert b.import_prefix(bad) == 120 and b.tier.stats().entries == 1
    got = b.generate(p[:150], max_tokens=8, **GREEDY)
    assert got.n_cached == 0 and got.tokens == solo_few(p[:150], 8)
    assert b.metrics()["cache_ram_restores"] == 0 and not b.tier.has(p[:120])
