"""The request surface of apps in the Engine (SmolLM2): grammars, logprobs (the generated tokens' and the
prompt's), penalties and logit_bias in the C chain, tools, cache_prompt and slot pinning; and bad input
refused before anything is queued."""
import json

import jsonschema
import numpy as np
import pytest

import llamax
from llamax import Engine, Grammar
from llamax.sampling import rows_logprobs, token_logprobs

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
    "required": ["name", "age", "tags"], "additionalProperties": False}
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather of a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The time in a time zone",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}]


@pytest.fixture(scope="module")
def engine(model):
    return Engine(model, n_ctx=2048, n_parallel=4, n_batch=256)


def chat(text):
    return [{"role": "user", "content": text}]


def untouched(engine):
    """What a refused request must not change."""
    m = engine.metrics()
    return (m["queue_len"], m["requests_finished"], m["cells_used"], m["cached_prompts"], engine._next_id)


# ---- grammars -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [1, 2, 3])
def test_json_schema_output_validates_when_sampled(engine, seed):
    g = Grammar.json_schema(PERSON)
    r = engine.generate(chat("Describe a library member as JSON."), grammar=g, max_tokens=96, temperature=1.0,
                        seed=seed)
    assert r.stop == "eog", r
    jsonschema.validate(json.loads(r.text), PERSON)


def test_grammar_that_allows_nothing_more_stops_with_grammar(engine):
    """Three digits, then only an end of generation would fit, which ignore_eos bans: stop "grammar"."""
    r = engine.generate("Pick a number:", grammar=Grammar.regex("[0-9]{3}"), ignore_eos=True, max_tokens=20,
                        temperature=0.7, seed=4)
    assert r.stop == "grammar" and len(r.text) == 3 and r.text.isdigit(), r
    r = engine.generate("Pick a number:", grammar=Grammar.regex("[0-9]{3}"), max_tokens=20, temperature=0)
    assert r.stop == "eog" and len(r.text) == 3 and r.text.isdigit(), r


def test_gbnf_and_lark(engine):
    r = engine.generate(chat("Is the sky blue?"), grammar=Grammar.gbnf('root ::= ("yes" | "no") "."'),
                        max_tokens=8, temperature=0)
    assert r.text in ("yes.", "no."), r
    r = engine.generate("Colors:", grammar=Grammar.lark('start: COLOR ("," COLOR)*\nCOLOR: "red" | "green"'),
                        max_tokens=12, temperature=0.9, seed=7)
    assert r.text and set(filter(None, r.text.split(","))) <= {"red", "green"}, r  # cut by max_tokens


def test_a_grammar_does_not_change_the_other_requests(engine, model):
    """The mask is per request: a free request beside constrained ones gives its solo tokens."""
    free = model.tokenize("The library opens at", add_special=True)
    alone = engine.generate(free, max_tokens=12, temperature=0).tokens
    reqs = [engine.submit(chat("A member as JSON."), grammar=Grammar.json_schema(PERSON), max_tokens=40,
                          temperature=0) for _ in range(2)]
    mixed = engine.submit(free, max_tokens=12, temperature=0)
    assert mixed.result().tokens == alone
    for r in reqs:
        r.result()


# ---- logprobs -----------------------------------------------------------------------------------------

def all_rows(model, tokens):
    """The logits of every position of tokens, one decode in a fresh context."""
    ctx = llamax.Context(model, n_ctx=512)
    ctx.decode(llamax.Batch(list(tokens), logits=[True] * len(tokens)))
    return ctx.get_logits().copy()


def test_logprobs_are_the_models_distribution(engine, model):
    prompt = model.tokenize("The capital of France is", add_special=True)
    r = engine.generate(prompt, max_tokens=8, temperature=0, logprobs=5)
    assert r.logprobs is not None and [t.token for t in r.logprobs] == r.tokens
    rows = all_rows(model, prompt + r.tokens)
    for i, t in enumerate(r.logprobs):
        lp, top = token_logprobs(rows[len(prompt) - 1 + i], t.token, 5)
        assert t.logprob == lp and t.top == top  # the same bits: the kernels are batch-invariant
        assert t.top[0][0] == t.token  # greedy: the chosen token is the most likely
        assert t.piece == model.token_to_piece(t.token).decode("utf-8", "replace")
    sampled = engine.generate(prompt, max_tokens=8, temperature=1.0, seed=3, logprobs=0)
    assert all(t.top == [] and t.logprob <= 0 for t in sampled.logprobs)
    assert engine.generate(prompt, max_tokens=4, temperature=0).logprobs is None


def test_prompt_logprobs_cover_the_prompt_without_a_cached_prefix(model):
    eng = Engine(model, n_ctx=2048, n_parallel=2, n_batch=256)
    text = "The library opens at nine and closes at five. " * 12  # > LOGPROB_CHUNK tokens: several steps
    prompt = model.tokenize(text, add_special=True)
    eng.generate(prompt, max_tokens=2, temperature=0)  # now cached
    r = eng.generate(prompt, max_tokens=3, temperature=0, logprobs=2, prompt_logprobs=True)
    assert r.n_cached == 0
    assert r.prompt_logprobs is not None and len(r.prompt_logprobs) == len(prompt) and r.prompt_logprobs[0] is None
    rows = all_rows(model, prompt)
    lp, ids, lps = rows_logprobs(rows[:-1], np.array(prompt[1:], np.int32), 2)
    for i, t in enumerate(r.prompt_logprobs[1:]):
        assert t.token == prompt[i + 1] and t.logprob == lp[i]
        assert t.top == list(zip(ids[i].tolist(), lps[i].tolist()))
    assert r.tokens == eng.generate(prompt, max_tokens=3, temperature=0).tokens


def test_logprobs_do_not_depend_on_the_batch(engine, model):
    p = model.tokenize("Water boils at", add_special=True)
    alone = engine.generate(p, max_tokens=10, temperature=0, logprobs=3).logprobs
    others = [engine.submit(chat(f"Question {i} about late fees?"), max_tokens=20, temperature=0)
              for i in range(3)]
    mixed = engine.submit(p, max_tokens=10, temperature=0, logprobs=3)
    assert mixed.result().logprobs == alone
    for r in others:
        r.result()


# ---- penalties and bias ---------------------------------------------------------------------------------

def test_logit_bias_bans_and_forces(engine, model):
    p = model.tokenize("One, two, three, four,", add_special=True)
    first = engine.generate(p, max_tokens=1, temperature=0).tokens[0]
    banned = engine.generate(p, max_tokens=6, temperature=0, logit_bias={first: float("-inf")})
    assert first not in banned.tokens
    forced = engine.generate(p, max_tokens=3, temperature=0, logit_bias={42: 100.0}, ignore_eos=True)
    assert forced.tokens == [42, 42, 42]


def test_penalties_follow_the_sampler(engine, model):
    """The Engine's penalties are the Sampler's (the C chain) over the prompt's last repeat_last_n
    tokens and the output: the same greedy tokens as llamax.generate with that Sampler."""
    p = model.tokenize("red red red red red red red red", add_special=True)
    plain = engine.generate(p, max_tokens=12, temperature=0).tokens
    for kw in (dict(presence_penalty=1.5), dict(frequency_penalty=1.0, repeat_last_n=16),
               dict(repeat_penalty=1.3, repeat_last_n=-1)):
        got = engine.generate(p, max_tokens=12, temperature=0, **kw).tokens
        ctx = llamax.Context(model, n_ctx=256)
        sampler = llamax.Sampler(temperature=0.0, top_k=40, top_p=0.95, min_p=0.05, **kw)
        g = llamax.generate(ctx, p, max_tokens=12, sampler=sampler)
        for _ in g:
            pass
        assert got == g.generated, kw
    assert engine.generate(p, max_tokens=12, temperature=0, presence_penalty=1.5).tokens != plain


# ---- tools ----------------------------------------------------------------------------------------------

def test_tool_choice_required_and_named(engine):
    r = engine.generate(chat("What is the weather in Paris?"), tools=WEATHER, tool_choice="required",
                        max_tokens=64, temperature=0)
    assert r.stop == "tool_calls" and r.tool_calls and r.text == ""
    call = r.tool_calls[0]
    assert call.name in ("get_weather", "get_time") and call.id.startswith("call_")
    json.loads(call.arguments)
    named = {"type": "function", "function": {"name": "get_time"}}
    r = engine.generate(chat("What is the weather in Paris?"), tools=WEATHER, tool_choice=named, max_tokens=64,
                        temperature=0.8, seed=5)
    assert r.stop == "tool_calls" and [c.name for c in r.tool_calls] == ["get_time"]
    assert "zone" in json.loads(r.tool_calls[0].arguments)


def test_tool_choice_none_is_plain_text(engine):
    r = engine.generate(chat("Say hello."), tools=WEATHER, tool_choice="none", max_tokens=16, temperature=0)
    assert r.tool_calls is None and r.stop in ("eog", "length") and r.text


def test_a_tool_result_goes_into_the_next_turn(engine):
    first = engine.generate(chat("What is the weather in Paris?"), tools=WEATHER, tool_choice="required",
                            max_tokens=64, temperature=0)
    c = first.tool_calls[0]
    msgs = chat("What is the weather in Paris?") + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}]},
        {"role": "tool", "tool_call_id": c.id, "content": "sunny, 21 C"}]
    r = engine.generate(msgs, tools=WEATHER, max_tokens=48, temperature=0)
    assert r.stop in ("eog", "tool_calls", "length")
    assert r.tool_calls is not None or r.text


# ---- cache_prompt, slots ----------------------------------------------------------------------------------

def test_cache_prompt_false_keeps_nothing(model):
    eng = Engine(model, n_ctx=1024, n_parallel=2)
    p = model.tokenize("A prompt computed in full, every time.", add_special=True)
    a = eng.generate(p, max_tokens=4, temperature=0, cache_prompt=False)
    assert eng.metrics()["cached_prompts"] == 0 and eng.metrics()["cells_used"] == 0
    b = eng.generate(p, max_tokens=4, temperature=0)
    c = eng.generate(p, max_tokens=4, temperature=0, cache_prompt=False)
    assert a.n_cached == b.n_cached == c.n_cached == 0 and a.tokens == b.tokens == c.tokens
    assert eng.generate(p, max_tokens=4, temperature=0).n_cached > 0


def test_a_pinned_request_runs_on_its_slot(model):
    eng = Engine(model, n_ctx=1024, n_parallel=3)
    busy = eng.submit(chat("Talk about the weather."), max_tokens=30, temperature=0, slot=2)
    pinned = eng.submit(chat("And the library?"), max_tokens=30, temperature=0, slot=2)
    eng.step()
    slots = eng.slots()
    assert slots[2]["request"] == busy.id and all(s["request"] != pinned.id for s in slots)
    while not busy.done:
        eng.step()
    eng.step()
    assert eng.slots()[2]["request"] == pinned.id
    pinned.result()


# ---- bad input: refused at submit, nothing queued --------------------------------------------------------

@pytest.mark.parametrize("kw,exc", [
    (dict(logprobs=21), ValueError), (dict(logprobs=True), TypeError),
    (dict(tools=WEATHER, tool_choice={"type": "function", "function": {"name": "nope"}}), ValueError),
    (dict(tools=[{"type": "function", "function": {"description": "no name"}}]), ValueError),
    (dict(tools=WEATHER, tool_choice="required", grammar=Grammar.json()), ValueError),
    (dict(logit_bias={-3: 1.0}), ValueError), (dict(logit_bias={5: float("nan")}), ValueError),
    (dict(presence_penalty=float("inf")), ValueError), (dict(slot=9), ValueError),
])
def test_bad_requests_change_nothing(engine, kw, exc):
    before = untouched(engine)
    with pytest.raises(exc):
        engine.submit(chat("hi"), max_tokens=4, **kw)
    assert untouched(engine) == before


def test_tools_need_chat_messages(engine):
    with pytest.raises(TypeError, match="chat messages"):
        engine.submit("a plain prompt", tools=WEATHER)


@pytest.mark.parametrize("make", [lambda: Grammar.json_schema({"type": "nonsense"}), lambda: Grammar.regex("("),
                                  lambda: Grammar.gbnf("root ::= missing"), lambda: Grammar.lark("start: ?")])
def test_invalid_grammars_are_value_errors(make):
    with pytest.raises(ValueError, match="invalid"):
        make()


def test_a_template_with_tool_syntax_renders_and_parses_its_own_format():
    """A model whose template has Hermes / Qwen tool syntax gets the tools in its own prompt and its
    <tool_call> blocks parsed; "required" holds it to them (SmolLM2 with a Qwen-like template)."""
    from test_tools import QWEN

    m = llamax.Model.load("smollm2-135m")
    m.chat_template = QWEN
    eng = Engine(m, n_ctx=2048, n_parallel=1)
    req = eng.submit(chat("What is the weather in Paris?"), tools=WEATHER, tool_choice="required", max_tokens=80,
                     temperature=0)
    assert req.tools.format == "hermes" and "<tools>" in m.detokenize(req.prompt)
    r = req.result()
    assert r.stop == "tool_calls" and r.tool_calls and r.tool_calls[0].name in ("get_weather", "get_time"), r
    json.loads(r.tool_calls[0].arguments)
    assert "<tool_call>" in req.text  # the raw output held the format's markers


def test_a_tool_history_renders_without_tools(engine):
    """Earlier tool calls and results in the messages, no tools offered now: plain text, no template error."""
    msgs = chat("What is the weather in Paris?") + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    r = engine.generate(msgs, max_tokens=16, temperature=0)
    assert r.tool_calls is None and r.stop in ("eog", "length")
