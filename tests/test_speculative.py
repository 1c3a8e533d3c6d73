"""Speculative decoding (llamax.speculative): the n-gram drafter, the policy, sample-and-accept, and
exactness: greedy and seeded output are the same token for token with and without drafts, on every
memory type, alone and beside other sequences, and the rejected drafts leave nothing in the cache."""
from __future__ import annotations

import math

import numpy as np
import pytest

import llamax
from llamax import Context, Sampler
from llamax.errors import LlamaxError
from llamax.generate import generate, generate_parallel
from llamax.sequence import SeqDecoder
from llamax.speculative import DecodeCost, NgramDrafter, SpecPolicy, Speculative, resolve, verify

CODE = '''def area(width, height):
    """The area of a rectangle."""
    return width * height


def perimeter(width, height):
    """The perimeter of a rectangle."""
    return 2 * (width + height)


def diagonal(width, height):
    """The diagonal of a rectangle."""
    return (width ** 2 + height ** 2) ** 0.5
'''


def rewrite_prompt(model, code: str = CODE) -> list[int]:
    msg = ("Rewrite this Python code, renaming the parameter `width` to `w` everywhere and changing nothing "
           "else. Output the whole code.\n\n```python\n" + code + "```")
    return model.tokenize(model.apply_chat_template([{"role": "user", "content": msg}]), add_special=True,
                          parse_special=True)


def run(model, prompt, n, spec, *, sampler=None, **ctx_kw):
    ctx = Context(model, **{"n_ctx": 1024, **ctx_kw})
    g = generate(ctx, prompt, max_tokens=n, sampler=sampler or Sampler(temperature=0.0), speculative=spec)
    text = "".join(g)
    return g, text, ctx


# ---- the drafter and the policy ---------------------------------------------------------------------

def test_ngram_drafter_proposes_what_followed_the_latest_earlier_occurrence():
    d = NgramDrafter(ngram_max=3, ngram_min=1)
    seq = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3]
    assert d.draft([(0, seq, 4)]) == [[4, 5, 9, 9]]
    assert d.draft([(0, seq, 2)]) == [[4, 5]]
    # the sequence grows: 1 2 3 4 occurred once, then "7" follows it this time
    seq2 = seq + [4, 7, 1, 2, 3, 4]
    assert d.draft([(0, seq2, 3)]) == [[7, 1, 2]]      # the latest occurrence of (2, 3, 4) wins
    # the longest lookup first: (8, 3) never occurred, (3,) did
    assert d.draft([(1, [3, 6, 8, 3], 2)]) == [[6, 8]]
    assert d.draft([(2, [5, 6, 7], 4)]) == [[]]           # nothing repeats
    assert d.draft([(0, seq2, 0)]) == [[]]


def test_ngram_drafter_reindexes_a_sequence_that_changed():
    d = NgramDrafter(ngram_max=2, ngram_min=2)
    assert d.draft([(0, [1, 2, 3, 1, 2], 2)]) == [[3, 1]]
    # a context shift removed the middle: the drafter sees other tokens at the same indices
    assert d.draft([(0, [1, 2, 8, 8, 1, 2], 2)]) == [[8, 8]]
    d.release(0)
    assert d.draft([(0, [5, 1, 2], 2)]) == [[]]


def test_decode_cost_fits_a_line_and_keeps_a_prior_without_spread():
    c = DecodeCost(decay=1.0)
    assert c.stale(1)
    a, b = c.coef()
    assert b / a == pytest.approx(1 / DecodeCost.PRIOR_TOKENS)
    for _ in range(3):
        c.observe(1, 0.010)          # one batch size only: the prior shapes b
    a, b = c.coef()
    assert a + b == pytest.approx(0.010) and b == pytest.approx(0.010 / 17)
    c = DecodeCost()
    for n in (1, 5, 9, 17, 33) * 20:
        c.observe(n, 0.004 + 0.001 * n)
    a, b = c.coef()
    assert a == pytest.approx(0.004, rel=0.05) and b == pytest.approx(0.001, rel=0.05)


def test_policy_drafts_while_it_pays():
    p = SpecPolicy()
    for n in (1, 2, 5, 9, 17) * 10:                       # memory-bound: 16 tokens cost 0.25 of a read
        p.cost.observe(n, 0.010 + 0.00015 * n)
    for _ in range(20):
        p.outcome(0, 16, 16)                              # key 0 accepts everything
        p.outcome(1, 4, 0)                                # key 1 nothing
    k = p.budget([0, 1], [16, 16])
    assert k[0] == 16 and k[1] == 0
    assert p.budget([0], [5]) == [5]                      # caps hold
    # compute-bound with 8 busy slots: a drafted token costs as much as a sequence's step
    q = SpecPolicy()
    assert q.budget([0], [4]) == [0]                      # nothing measured yet: a step without drafts first
    for n in (8, 16, 24, 40) * 10:
        q.cost.observe(n, 0.002 * n)
    for key in range(8):
        for _ in range(20):
            q.outcome(key, 4, 2)                          # half of the drafts accepted
    assert q.budget(list(range(8)), [16] * 8) == [0] * 8
    # a step in the cost (another kernel beyond 8 tokens): a long draft is never worth crossing it
    r = SpecPolicy()
    for n in list(range(1, 20)) * 8:
        r.cost.observe(n, 0.010 + 0.0005 * n if n <= 8 else 0.040)
    assert r.cost.stale(30) and not r.cost.stale(1)
    for _ in range(20):
        r.outcome(0, 16, 16)
    assert r.budget([0], [16]) == [7]
    assert r.cost.time(30) > r.cost.time(19) and r.cost.time(5) == pytest.approx(0.0125)
    # an idle sequence's rate drifts back to the prior, so it drafts again later
    for _ in range(200):
        p.outcome(1, 0, 0)
    assert p.rate(1) == pytest.approx(0.5, abs=0.05)


def test_one_slow_step_does_not_stop_drafting_for_good():
    """A step's time holds whatever else the host did meanwhile: one stalled 2-token step (5x the
    1-token one) must not close drafting for the rest of the server's life (it did: the size's mean
    was never measured again, as no later step drafted)."""
    p = SpecPolicy()
    for _ in range(20):
        p.cost.observe(1, 0.003)
    expected = p.cost.time(2)
    p.cost.observe(2, 0.0156)
    assert p.cost.time(2) == pytest.approx(DecodeCost.CLIP * expected)   # counted as at most 2x the expected
    assert p.budget([0], [4]) == [0]
    waits = []
    for _ in range(3):                     # the size slow each time it is tried: tried again later and later
        steps = 0
        while p.budget([0], [4]) == [0]:
            p.cost.observe(1, 0.003)
            steps += 1
            assert steps <= p.cost.horizon
        waits.append(steps)
        p.cost.observe(2, 0.0156)
    assert waits == [DecodeCost.TRUST, 2 * DecodeCost.TRUST, 3 * DecodeCost.TRUST]
    # a size seen often is kept for the whole horizon, then expires to the line's estimate
    c = DecodeCost()
    for _ in range(10):
        c.observe(1, 0.003)
        c.observe(9, 0.020)
    kept = c.time(9)
    for _ in range(c.horizon - 1):
        c.observe(1, 0.003)
    assert c.time(9) == kept and not c.stale(1)
    c.observe(1, 0.003)
    assert c.time(9) < kept


def test_speculative_settings_are_checked():
    assert resolve(None) is None and resolve(False) is None and resolve("none") is None
    assert resolve(True) == Speculative() and resolve("ngram").kind == "ngram"
    with pytest.raises(ValueError, match="kind"):
        Speculative(kind="eagle")
    with pytest.raises(ValueError, match="n_min"):
        Speculative(n_max=4, n_min=5)
    with pytest.raises(ValueError, match="n_max"):
        Speculative(n_max=0)
    with pytest.raises(ValueError, match="draft model"):
        Speculative(kind="draft")
    with pytest.raises(ValueError, match="no model"):
        Speculative(kind="ngram", model="x.gguf")
    with pytest.raises(ValueError, match="draft model"):
        resolve("draft")
    with pytest.raises(TypeError):
        resolve(3)
    assert llamax.Speculative is Speculative


# ---- sample-and-accept ------------------------------------------------------------------------------

def rows_for(model, wanted: list[int], scale: float = 30.0) -> list[np.ndarray]:
    rows = []
    for t in wanted:
        r = np.zeros(model.n_vocab, np.float32)
        r[t] = scale
        rows.append(r)
    return rows


def test_verify_accepts_up_to_the_first_difference_and_adds_the_target_token(model):
    a, b, c, d = (model.tokenize(w, add_special=False)[0] for w in (" apple", " banana", " cherry", " date"))
    dec = SeqDecoder(model, Sampler(temperature=0.0), max_tokens=-1)
    rows = rows_for(model, [a, b, d, c])
    outs, n_acc = verify(dec, lambda i: rows[i], [a, b, c])     # a, b accepted; the target says d, not c
    assert [o.token for o in outs] == [a, b, d] and n_acc == 2
    assert dec.generated == [a, b, d]
    dec2 = SeqDecoder(model, Sampler(temperature=0.0), max_tokens=-1)
    outs, n_acc = verify(dec2, lambda i: rows[i], [a, b])       # everything accepted: the bonus token
    assert [o.token for o in outs] == [a, b, d] and n_acc == 2
    dec3 = SeqDecoder(model, Sampler(temperature=0.0), max_tokens=2)
    outs, n_acc = verify(dec3, lambda i: rows[i], [a, b, d])    # max_tokens ends it inside the draft
    assert [o.token for o in outs] == [a, b] and outs[-1].stop == "length"
    dec4 = SeqDecoder(model, Sampler(temperature=0.0), max_tokens=-1, stop=[" banana"])
    outs, _ = verify(dec4, lambda i: rows[i], [a, b, d])        # a stop string inside the draft
    assert outs[-1].stop == "stop" and len(outs) == 2


def test_sample_and_accept_keeps_the_target_distribution(model):
    """A small-vocabulary case: the target's rows allow four tokens; the draft always proposes the
    same two. Over many seeds the first token follows softmax(row 0), and the second, given the first
    was the drafted one, follows softmax(row 1): the drafts do not bias what is sampled (chi-square)."""
    ids = [model.tokenize(w, add_special=False)[0] for w in (" apple", " banana", " cherry", " date")]
    rng = np.random.default_rng(7)
    rows = []
    for _ in range(3):
        r = np.full(model.n_vocab, -np.inf, np.float32)
        r[ids] = rng.normal(0, 1, 4).astype(np.float32)
        rows.append(r)
    p0 = np.exp(rows[0][ids] - rows[0][ids].max())
    p0 /= p0.sum()
    p1 = np.exp(rows[1][ids] - rows[1][ids].max())
    p1 /= p1.sum()
    draft = [ids[int(np.argmax(p0))], ids[0]]
    n = 3000
    first = np.zeros(4)
    second = np.zeros(4)
    for seed in range(n):
        dec = SeqDecoder(model, Sampler(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed), max_tokens=-1)
        outs, _ = verify(dec, lambda i: rows[i], draft)
        first[ids.index(outs[0].token)] += 1
        if outs[0].token == draft[0]:
            second[ids.index(outs[1].token)] += 1

    def chi2(obs, p):
        exp = p * obs.sum()
        return float(((obs - exp) ** 2 / exp).sum())

    crit = 16.27  # chi-square, 3 degrees of freedom, p = 0.001
    assert chi2(first, p0) < crit, (first, p0)
    assert chi2(second, p1) < crit, (second, p1)


# ---- exactness on the registry models ---------------------------------------------------------------

@pytest.mark.parametrize("type_k,type_v", [("f16", "f16"), ("q8_0", "q8_0"), ("q4_0", "q4_0")])
def test_greedy_output_is_identical_with_ngram_drafts(model, type_k, type_v):
    prompt = rewrite_prompt(model)
    g0, t0, _ = run(model, prompt, 96, None, type_k=type_k, type_v=type_v)
    g1, t1, ctx = run(model, prompt, 96, Speculative(n_max=8), type_k=type_k, type_v=type_v)
    assert g1.generated == g0.generated and t1 == t0
    assert g1.stats.n_drafted > 0 and g1.stats.n_accepted > 0
    # nothing of the rejected drafts is left: the sequence holds exactly prompt + generated (the token
    # sampled last is never decoded; an end-of-generation token is not among the generated)
    held = len(prompt) + len(g1.generated) - (g1.stats.stop == "length")
    assert ctx.memory.seq_pos_max(0) + 1 == held and ctx.memory.n_used == held


def test_greedy_output_is_identical_on_gemma3_iswa(gemma):
    prompt = rewrite_prompt(gemma)
    g0, t0, _ = run(gemma, prompt, 64, None)
    g1, t1, ctx = run(gemma, prompt, 64, True)
    assert g1.generated == g0.generated and t1 == t0
    assert g1.stats.n_accepted > 0
    mem = ctx.memory
    held = len(prompt) + len(g1.generated) - (g1.stats.stop == "length")
    assert mem.base.seq_pos_max(0) + 1 == mem.swa.seq_pos_max(0) + 1 == held


def test_gemma3_one_stream_per_slot_drafts_in_one_ubatch(gemma):
    """Sliding-window layers with one KV stream per slot (split_equal): every drafting slot drafts the
    same number of tokens, so the drafts sit in one ubatch after the slots' next tokens (see
    llamax.speculative.equal_drafts), and the output is the same as without drafts."""
    from llamax.speculative import equal_drafts, equalize

    prompts = [rewrite_prompt(gemma), rewrite_prompt(gemma, CODE.replace("width", "x"))]
    with llamax.Engine(gemma, n_ctx=2048, n_parallel=2, kv_unified=False) as eng:
        assert equal_drafts(eng.memory, False) and not equal_drafts(eng.memory, True)
        ref = engine_results(eng, prompts, max_tokens=40, speculative=False)
        got = engine_results(eng, prompts, max_tokens=40, speculative=True)
    assert [r.tokens for r in got] == [r.tokens for r in ref]
    assert sum(r.n_accepted for r in got) > 0
    assert equalize([[1, 2, 3], [], [4, 5]]) == [[1, 2], [], [4, 5]]


def test_seeded_sampling_is_identical_with_drafts(model):
    prompt = rewrite_prompt(model)
    g0, _, _ = run(model, prompt, 80, None, sampler=Sampler(temperature=0.7, seed=11))
    g1, _, _ = run(model, prompt, 80, True, sampler=Sampler(temperature=0.7, seed=11))
    assert g1.generated == g0.generated and g1.stats.n_accepted > 0


def test_parallel_sequences_with_drafts_match_each_alone(model):
    prompts = [rewrite_prompt(model), model.tokenize("Once upon a time", add_special=True),
               rewrite_prompt(model, CODE.replace("rectangle", "box"))]
    ref = []
    for p in prompts:
        g, _, _ = run(model, p, 48, None)
        ref.append(g.generated)
    ctx = Context(model, n_ctx=2048, n_seq_max=3)
    pg = generate_parallel(ctx, prompts, max_tokens=48, samplers=[Sampler(temperature=0.0) for _ in prompts],
                           speculative=True)
    for _ in pg:
        pass
    assert pg.generated == ref
    assert pg.stats.n_drafted > 0


def test_drafts_across_context_shifts_give_the_same_output(model):
    prompt = model.tokenize(CODE, add_special=True)   # the model goes on writing code: shifts of 256 cells
    g0, _, _ = run(model, prompt, 300, None, n_ctx=256)
    g1, _, _ = run(model, prompt, 300, True, n_ctx=256)
    assert g0.stats.n_shift > 0
    assert g1.generated == g0.generated and g1.stats.n_shift == g0.stats.n_shift



# ---- a draft model ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_draft(tmp_path_factory, smollm2_gguf):
    """SmolLM2 cut to its first 10 layers: the same vocabulary, drafts that agree only in part."""
    from tests.synthetic import write_truncated

    return llamax.Model.load(write_truncated(tmp_path_factory.mktemp("draft") / "smollm2-10.gguf", smollm2_gguf, 10))


def test_a_draft_model_gives_the_same_greedy_output(model, small_draft):
    prompt = model.tokenize("The history of the printing press begins", add_special=True)
    g0, t0, _ = run(model, prompt, 40, None)
    g1, t1, ctx = run(model, prompt, 40, Speculative(kind="draft", model=small_draft, n_max=6, p_min=0.0, adaptive=False))
    assert g1.generated == g0.generated and t1 == t0
    assert 0 < g1.stats.n_accepted < g1.stats.n_drafted   # a weaker model: partial acceptance
    held = len(prompt) + len(g1.generated) - (g1.stats.stop == "length")
    assert ctx.memory.seq_pos_max(0) + 1 == held
    # the registry model as its own draft: every greedy draft is accepted
    g2, _, _ = run(model, prompt, 24, Speculative(kind="draft", model=model, n_max=4, p_min=0.0))
    assert g2.generated == g0.generated[:24] and g2.stats.n_accepted == g2.stats.n_drafted > 0


def test_a_draft_model_of_another_vocabulary_is_refused(model, gemma):
    with pytest.raises(llamax.ModelError, match="vocabulary|token"):
        run(model, [1, 2, 3], 4, Speculative(kind="draft", model=gemma))


# ---- the Engine -------------------------------------------------------------------------------------

def engine_results(eng, prompts, **kw):
    reqs = [eng.submit(p, max_tokens=kw.pop("max_tokens", 48), temperature=0.0, **kw) for p in prompts]
    return [r.result() for r in reqs]


def test_engine_requests_are_identical_with_drafts_beside_each_other(model):
    code = [{"role": "user", "content": "Rewrite this Python code, renaming `height` to `h`. Output the whole "
                                        "code.\n\n```python\n" + CODE + "```"}]
    story = [{"role": "user", "content": "Tell me a story about a cat."}]
    prompts = [code, story, code, story]
    with llamax.Engine(model, n_ctx=4096, n_parallel=4) as eng:
        ref = engine_results(eng, prompts)
        used0 = eng.memory.n_used
        eng.clear_cache()
        fixed = Speculative(n_max=4, adaptive=False)   # drafts every step, whatever the policy measured
        got = engine_results(eng, prompts, speculative=fixed)
        m = eng.metrics()
        assert [r.tokens for r in got] == [r.tokens for r in ref]
        assert [r.text for r in got] == [r.text for r in ref]
        assert sum(r.n_drafted for r in got) == m["spec_drafted"] > 0
        assert sum(r.n_accepted for r in got) == m["spec_accepted"] > 0
        assert all(r.n_drafted == 0 for r in ref)
        # the prefix cache holds the same cells as without drafts: no rejected draft was left behind
        assert eng.memory.n_used == used0
        # a request beside others, some with drafts and some without, with stops and logprobs
        mixed = [eng.submit(code, max_tokens=64, temperature=0.0, speculative=s, logprobs=2, stop=["perimeter"])
                 for s in (fixed, False, Speculative(n_max=3, adaptive=False), None)]
        res = [r.result() for r in mixed]
        assert len({tuple(r.tokens) for r in res}) == 1 and res[0].stop == res[1].stop
        assert res[0].logprobs == res[1].logprobs
        assert res[0].n_drafted > 0 and res[1].n_drafted == 0 and res[3].n_drafted == 0


def test_engine_wide_setting_and_per_request_override(model):
    prompt = rewrite_prompt(model)
    with llamax.Engine(model, n_ctx=2048, n_parallel=2, speculative=Speculative(n_max=4)) as eng:
        on = eng.generate(prompt, max_tokens=48, temperature=0.0)
        off = eng.generate(prompt, max_tokens=48, temperature=0.0, speculative=False)
        assert on.tokens == off.tokens and on.n_drafted > 0 and off.n_drafted == 0
        with pytest.raises(ValueError, match="draft model"):
            eng.submit(prompt, speculative=Speculative(kind="draft", model=model))
        with pytest.raises(TypeError):
            eng.submit(prompt, speculative=5)


def test_engine_with_a_draft_model(model, small_draft):
    prompt = model.tokenize("The history of the printing press begins", add_special=True)
    with llamax.Engine(model, n_ctx=2048, n_parallel=2) as eng:
        ref = engine_results(eng, [prompt, prompt[:-1]], max_tokens=24)
    spec = Speculative(kind="draft", model=small_draft, n_max=4, p_min=0.0, adaptive=False)
    with llamax.Engine(model, n_ctx=2048, n_parallel=2, speculative=spec) as eng:
        got = engine_results(eng, [prompt, prompt[:-1]], max_tokens=24)
        assert [r.tokens for r in got] == [r.tokens for r in ref]
        assert eng.metrics()["spec_accepted"] > 0


# ---- the command line and the server ----------------------------------------------------------------

def test_cli_run_with_ngram_drafts_prints_the_same_text(model):
    import subprocess
    import sys

    def run_cli(*extra):
        p = subprocess.run([sys.executable, "-m", "llamax", "run", "-n", "48", "--temp", "0", "-t", "2", "-p",
                            CODE, *extra], capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
        return p.stdout, p.stderr

    out0, _ = run_cli()
    out1, err1 = run_cli("--spec-type", "ngram", "--spec-n-max", "8")
    assert out1 == out0 and "accepted" in err1
    p = subprocess.run([sys.executable, "-m", "llamax", "run", "--spec-type", "draft"], capture_output=True, text=True)
    assert p.returncode == 2 and "-md" in p.stderr


def test_cli_bench_reports_tg_with_and_without_drafts(tmp_path, smollm2_gguf):
    import json
    import subprocess
    import sys

    from tests.synthetic import write_truncated

    small = write_truncated(tmp_path / "smollm2-2.gguf", smollm2_gguf, 2)   # the same flow, 15x less work
    p = subprocess.run([sys.executable, "-m", "llamax", "bench", "--spec-type", "ngram", "-n", "32", "-r", "1",
                        "-t", "2", "-m", str(small), "--json"], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    rows = json.loads(p.stdout)
    assert [r["task"] for r in rows] == ["rewrite", "free"]
    assert all(r["same"] and r["tg_ts"] > 0 and r["tg_spec_ts"] > 0 for r in rows)


def test_server_with_spec_type_ngram_answers_the_same(chat_server):
    from openai import OpenAI

    from tests.test_server import LiveServer

    msgs = [{"role": "user", "content": "Rewrite this Python code, renaming `height` to `h`. Output the whole "
                                        "code.\n\n```python\n" + CODE + "```"}]
    plain = OpenAI(base_url=chat_server.url + "/v1", api_key="x").chat.completions.create(
        model="m", messages=msgs, temperature=0, max_tokens=64)
    srv = LiveServer("-np", "2", "-c", "2048", "--spec-type", "ngram", "--spec-n-max", "8")
    try:
        client = OpenAI(base_url=srv.url + "/v1", api_key="x")
        fast = client.chat.completions.create(model="m", messages=msgs, temperature=0, max_tokens=64)
        assert fast.choices[0].message.content == plain.choices[0].message.content
        m = srv.metrics()
        assert m["llamax_spec_accepted_total"] > 0 and m["llamax_spec_drafted_total"] >= m["llamax_spec_accepted_total"]
        # llama-server's per-request knobs and its timings' draft counts
        r = srv.post("/v1/completions", json={"prompt": CODE, "max_tokens": 32, "temperature": 0, "speculative.n_max": 4})
        assert r.status_code == 200, r.text
        t = r.json()["timings"]
        assert t["draft_n"] > 0 and 0 <= t["draft_n_accepted"] <= t["draft_n"]
        bad = srv.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "speculative.n_max": 0})
        assert bad.status_code == 400 and "n_max" in bad.text
    finally:
        srv.stop()


# ---- recurrent and hybrid memories ------------------------------------------------------------------

@pytest.fixture(scope="module")
def recurrent_models(tmp_path_factory, smollm2_gguf):
    """Synthetic Mamba and Jamba models, each with a draft: itself cut to its first 3 of 4 layers."""
    from tests.synthetic import write_jamba, write_mamba, write_truncated

    d = tmp_path_factory.mktemp("spec-recurrent")
    out = {}
    for arch, write in (("mamba", write_mamba), ("jamba", write_jamba)):
        path = write(d / f"{arch}.gguf", smollm2_gguf)
        out[arch] = (llamax.Model.load(path, n_threads=2),
                     llamax.Model.load(write_truncated(d / f"{arch}-3.gguf", path, 3), n_threads=2))
    return out


@pytest.mark.parametrize("arch", ["mamba", "jamba"])
def test_recurrent_and_hybrid_memories_roll_back_the_rejected_drafts(recurrent_models, arch):
    """A weaker draft's tokens are accepted only in part; the state after the last kept token is put
    back from the per-token states (and the KV cells of a hybrid cut), and the output is the same as
    without drafts, alone and beside another sequence."""
    m, draft = recurrent_models[arch]
    prompts = [m.tokenize("one two three one two three one two", add_special=True),
               m.tokenize("the cat sat on the mat", add_special=True)]
    ref = []
    for p in prompts:
        g, _, _ = run(m, p, 48, None, n_ctx=256)
        ref.append(g.generated)
    spec = Speculative(kind="draft", model=draft, n_max=4, p_min=0.0, adaptive=False)
    g, _, ctx = run(m, prompts[0], 48, spec, n_ctx=256)
    assert g.generated == ref[0]
    assert 0 < g.stats.n_accepted < g.stats.n_drafted
    held = len(prompts[0]) + len(g.generated) - (g.stats.stop == "length")
    assert ctx.memory.seq_pos_max(0) + 1 == held
    ctx2 = Context(m, n_ctx=512, n_seq_max=2)
    pg = generate_parallel(ctx2, prompts, max_tokens=48, samplers=[Sampler(temperature=0.0) for _ in prompts],
                           speculative=spec)
    for _ in pg:
        pass
    assert pg.generated == ref and pg.stats.n_accepted > 0


def test_a_recurrent_memory_without_its_rollback_window_refuses_to_cut(recurrent_models):
    from llamax.batch import Batch
    from llamax.speculative import cut_tail

    ctx = Context(recurrent_models["mamba"][0], n_ctx=256)
    ctx.decode(Batch([5, 6, 7, 8]))
    with pytest.raises(LlamaxError, match="rollback window"):
        cut_tail(ctx.memory, 0, 2)
    assert ctx.memory.seq_pos_max(0) == 3          # nothing changed
    ctx.memory.reserve_rollback(4)
    ctx.decode(Batch([9, 10, 11], pos=[4, 5, 6]))
    cut_tail(ctx.memory, 0, 5)
    assert ctx.memory.seq_pos_max(0) == 4
