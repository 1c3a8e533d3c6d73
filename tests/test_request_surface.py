"""The request surface of apps through `llamax serve`, driven over loopback by the official openai client
(raw HTTP where the body is the point): structured output (response_format, llama-server's json_schema
and grammar), tool calling (tool_choice, streamed calls, the tool result round trip), logprobs (chat,
completions with echo, streamed, against the in-process Engine's own), penalties and logit_bias (against
the in-process Engine), id_slot and cache_prompt; every bad input answers 400 naming its field with
nothing reaching the Engine.

One server runs SmolLM2 with 2 slots of 2048 cells (unified cache, prefix cache on); the in-process
Engine is the reference for the values."""
import json
from pathlib import Path

import jsonschema
import numpy as np
import openai
import pytest
from test_server_surface import counters, events

import llamax
from llamax.server.constraints import closed

PERSON = {  # nested objects, an array, enums, required keys; strings bounded so that an answer fits
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"type": "string", "enum": ["admin", "user"]},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "blue"]}, "maxItems": 2},
        "home": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]},
    },
    "required": ["name", "age", "role", "home"],
}
PROMPTS = ["Describe a person as JSON.", "Who is the librarian? Answer in JSON.", "Make up a user record."]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": ADD}}]
PARAMS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
LLAMA_CPP = Path(__file__).resolve().parent / "data" / "logprobs"  # llama.cpp's logprobs, recorded there


@pytest.fixture(scope="module")
def server(chat_server):
    return chat_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def engine(model):
    """The in-process reference: an Engine on the same model."""
    with llamax.Engine(model, n_ctx=1024, n_parallel=1) as eng:
        yield eng


def chat(client, **kw):
    kw.setdefault("messages", ASK)
    return client.chat.completions.create(model="x", **kw)


def refused(server, path, body, param):
    """body answers 400 with OpenAI's error body naming param, and nothing reached the Engine."""
    before = counters(server)
    r = server.post(path, json=body)
    assert r.status_code == 400, (body, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == 400, err
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"], (body, err)
    assert counters(server) == before
    return err["message"]


# ---- structured output ----------------------------------------------------------------------------------
@pytest.mark.parametrize("strict,prompts", [(True, PROMPTS[:2]), (False, PROMPTS[2:])])
def test_response_format_json_schema(client, strict, prompts):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": strict}}
    for i, prompt in enumerate(prompts):
        r = chat(client, messages=[{"role": "user", "content": prompt}], response_format=fmt, max_tokens=80,
                 temperature=0.9, seed=11 + i)
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


def test_response_format_json_object(client):
    system = {"role": "system", "content": 'You answer with one small JSON object, such as {"answer": "yes"}.'}
    for i, prompt in enumerate(["Is the sky blue?", "Is water wet?"]):
        r = chat(client, messages=[system, {"role": "user", "content": prompt}], max_tokens=40, temperature=0.7,
                 seed=3 + i, response_format={"type": "json_object"})
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_llama_server_json_schema_and_grammar(client):
    r = client.completions.create(model="x", prompt="A person record: ", max_tokens=80, temperature=0.8, seed=1,
                                  extra_body={"json_schema": PERSON})
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)
    r = chat(client, max_tokens=80, temperature=0.8, seed=2, extra_body={"json_schema": PERSON})
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    gbnf = 'root ::= "[" item ("," item)? "]"\nitem ::= "\\"" ("yes" | "no") "\\""'
    for seed in (1, 2, 3):
        r = chat(client, max_tokens=20, temperature=1.0, seed=seed, extra_body={"grammar": gbnf})
        out = json.loads(r.choices[0].message.content)
        assert r.choices[0].finish_reason == "stop" and 1 <= len(out) <= 2 and set(out) <= {"yes", "no"}


def test_streamed_schema_output(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    kw = dict(messages=[{"role": "user", "content": PROMPTS[0]}], response_format=fmt, max_tokens=80,
              temperature=0.9, seed=7)
    chunks = list(chat(client, stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), PERSON)
    assert text == chat(client, **kw).choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_schemas_are_closed_where_they_hold_objects():
    """Every object schema that lists properties gets additionalProperties false (llama.cpp's reading),
    wherever schemas nest; property names and literal values are data, left alone."""
    obj = {"type": "object", "properties": {"a": {"type": "integer"}}}
    shut = {**obj, "additionalProperties": False}
    schema = {"type": "object", "properties": {"enum": obj, "properties": obj, "const": obj},
              "$defs": {"D": obj}, "anyOf": [obj], "items": obj, "prefixItems": [obj], "not": obj,
              "enum": [obj], "const": obj, "default": obj, "additionalProperties": obj}
    got = closed(schema)
    assert got["properties"] == {"enum": shut, "properties": shut, "const": shut}
    assert got["$defs"] == {"D": shut} and got["anyOf"] == [shut] and got["items"] == shut
    assert got["prefixItems"] == [shut] and got["not"] == shut and got["additionalProperties"] == shut
    assert got["enum"] == [obj] and got["const"] == obj and got["default"] == obj
    assert closed({**obj, "additionalProperties": True})["additionalProperties"] is True
    assert schema["properties"]["enum"] == obj  # the input is left as it was


@pytest.mark.parametrize("extra,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"strict": True}}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"json_schema": {"type": "object", "properties": {"a": {"type": "bogus"}}}}, "json_schema"),
    ({"json_schema": "an object"}, "json_schema"),
    ({"json_schema": False}, "json_schema"),
    ({"grammar": "root ::= missing"}, "grammar"),
    ({"grammar": "root ::= \"a"}, "grammar"),
    ({"grammar": "root ::= \"a\"", "json_schema": {"type": "object"}}, "grammar"),
    ({"response_format": {"type": "json_object"}, "grammar": "root ::= \"a\""}, "grammar"),
    ({"response_format": {"type": "json_object"}, "tools": TOOLS}, "response_format"),
], ids=["bad-schema", "json_schema-without-schema", "unknown-type", "llama-schema", "schema-not-object",
        "schema-false", "gbnf-undefined-rule", "gbnf-unterminated", "schema+grammar", "format+grammar", "format+tools"])
def test_bad_constraints_are_400_naming_the_field(server, extra, param):
    refused(server, "/v1/chat/completions", {"messages": ASK, "max_tokens": 4, **extra}, param)


# ---- tools ----------------------------------------------------------------------------------------------
def check_calls(msg, name=None):
    assert msg.tool_calls, msg
    for c in msg.tool_calls:
        assert c.type == "function" and c.id.startswith("call_") and c.function.name in PARAMS
        assert name is None or c.function.name == name
        args = json.loads(c.function.arguments)
        jsonschema.validate(args, PARAMS[c.function.name])
        assert set(args) <= set(PARAMS[c.function.name]["properties"]), args  # closed, as llama.cpp's
    assert len({c.id for c in msg.tool_calls}) == len(msg.tool_calls)


@pytest.mark.parametrize("choice,name", [
    ("auto", None), ("required", None), ({"type": "function", "function": {"name": "add"}}, "add"),
], ids=["auto", "required", "named"])
def test_tool_choice_calls(client, choice, name):
    r = chat(client, tools=TOOLS, tool_choice=choice, max_tokens=64, temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    check_calls(ch.message, name)


def test_tool_choice_none_answers_text(client):
    r = chat(client, tools=TOOLS, tool_choice="none", max_tokens=12, temperature=0)
    ch = r.choices[0]
    assert ch.message.tool_calls is None and ch.message.content and ch.finish_reason == "length"
    assert ch.message.content == chat(client, max_tokens=12, temperature=0).choices[0].message.content
    for choice in ("auto", "none"):  # without tools: no call asked, nothing changes
        assert chat(client, max_tokens=12, temperature=0, extra_body={"tool_choice": choice}).choices[0]\
            .message.content == ch.message.content


def test_streamed_tool_calls_equal_the_non_streamed(client):
    msgs = [{"role": "user", "content": "What is the weather in Rome, and what is 2 + 3?"}]
    kw = dict(messages=msgs, tools=TOOLS, tool_choice="required", max_tokens=96, temperature=0.7, seed=5,
              logprobs=True, top_logprobs=2)
    whole = chat(client, **kw).choices[0]
    check_calls(whole.message)
    want = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    # a manual accumulator over the raw deltas, as OpenAI documents them
    calls: dict[int, dict] = {}
    finish, logprobs = None, []
    for chunk in chat(client, stream=True, **kw):
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            logprobs += ch.logprobs.content if ch.logprobs else []
            assert not ch.delta.content
            for d in ch.delta.tool_calls or ():
                c = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                if d.id:
                    assert c["id"] is None and d.type == "function"
                    c["id"] = d.id
                c["name"] += d.function.name or ""
                c["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls" and all(c["id"].startswith("call_") for c in calls.values())
    assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == want
    assert [t.model_dump() for t in logprobs] == [t.model_dump() for t in whole.logprobs.content]  # every token's
    # the SDK's stream helper assembles the same
    with client.chat.completions.stream(model="x", **kw) as s:
        final = s.get_final_completion()
    assert [(c.function.name, c.function.arguments) for c in final.choices[0].message.tool_calls] == want
    assert final.choices[0].finish_reason == "tool_calls"


def test_parallel_tool_calls_false_makes_one_call(client):
    msgs = [{"role": "user", "content": "Weather in Paris, London and Rome?"}]
    for seed in (1, 2):
        r = chat(client, messages=msgs, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                 max_tokens=64, temperature=0.8, seed=seed)
        assert len(r.choices[0].message.tool_calls) == 1
        check_calls(r.choices[0].message)


def test_tool_result_round_trip(client):
    first = chat(client, tools=TOOLS, tool_choice="required", max_tokens=64, temperature=0).choices[0].message
    check_calls(first)
    call = first.tool_calls[0]
    msgs = [*ASK, first.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "sunny"})}]
    r = chat(client, messages=msgs, tools=TOOLS, max_tokens=60, temperature=0)
    ch = r.choices[0]
    if ch.finish_reason == "tool_calls":
        check_calls(ch.message)
    else:
        assert ch.finish_reason in ("stop", "length") and isinstance(ch.message.content, str)
        assert not ch.message.tool_calls
    # the same history, tools not offered: its call and result rendered all the same (llama.cpp's polyfills)
    r = chat(client, messages=msgs, max_tokens=12, temperature=0)
    assert r.choices[0].message.content and r.choices[0].message.tool_calls is None
    assert r.usage.prompt_tokens > 30  # the call and its result are in the prompt


def test_a_tool_call_cut_by_max_tokens_finishes_with_length(client):
    """OpenAI and llama-server say "length" when max_tokens cut the output, inside a call included."""
    whole = chat(client, tools=TOOLS, tool_choice="required", max_tokens=64, temperature=0, logprobs=True).choices[0]
    assert whole.finish_reason == "tool_calls"
    pieces = [t.token for t in whole.logprobs.content]
    cut = next(i for i in range(len(pieces)) if '"arguments"' in "".join(pieces[:i])) + 2  # inside the arguments
    r = chat(client, tools=TOOLS, tool_choice="required", max_tokens=cut, temperature=0)
    assert r.usage.completion_tokens == cut
    assert r.choices[0].finish_reason == "length", r.choices[0].message


@pytest.mark.parametrize("extra,param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "add"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": 5}, "tool_choice"),
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls"),
], ids=["unknown-name", "unknown-choice", "bad-name", "not-function", "parameters-not-object", "bad-parameters",
        "required-without-tools", "named-without-tools", "named-without-name", "choice-not-str", "tools-not-list",
        "parallel-not-bool"])
def test_bad_tools_are_400_naming_the_field(server, extra, param):
    refused(server, "/v1/chat/completions", {"messages": ASK, "max_tokens": 4, **extra}, param)


# ---- logprobs -------------------------------------------------------------------------------------------
MSGS = [{"role": "user", "content": "Name three fruits."}]


@pytest.mark.parametrize("top", [0, 5, 20])
def test_chat_logprobs_equal_the_engines(client, engine, top):
    r = chat(client, messages=MSGS, max_tokens=6, temperature=0, logprobs=True, top_logprobs=top)
    content = r.choices[0].logprobs.content
    want = engine.submit(MSGS, max_tokens=6, temperature=0, logprobs=top).result()
    assert "".join(t.token for t in content) == r.choices[0].message.content == want.text
    assert len(content) == len(want.logprobs) == 6
    for got, ref in zip(content, want.logprobs):
        assert got.logprob <= 0 and got.logprob == pytest.approx(ref.logprob, abs=1e-6)
        assert bytes(got.bytes) == engine.model.token_to_piece(ref.token)
        assert len(got.top_logprobs) == top == len(ref.top)
        values = [x.logprob for x in got.top_logprobs]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        assert values == pytest.approx([lp for _, lp in ref.top], abs=1e-6)
        if top:
            assert got.token in [x.token for x in got.top_logprobs]
            assert got.logprob == values[0]  # greedy: the chosen one is the most likely


def test_chat_logprobs_bad_input(server):
    refused(server, "/v1/chat/completions", {"messages": MSGS, "logprobs": True, "top_logprobs": 21},
            "top_logprobs")
    refused(server, "/v1/chat/completions", {"messages": MSGS, "top_logprobs": 3}, "top_logprobs")
    refused(server, "/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs")


def test_streamed_chat_logprobs_equal_the_non_streamed(client):
    kw = dict(messages=MSGS, max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    whole = chat(client, **kw).choices[0].logprobs.content
    got = [t for c in chat(client, stream=True, **kw) for ch in c.choices if ch.logprobs
           for t in ch.logprobs.content]
    assert [t.model_dump() for t in got] == [t.model_dump() for t in whole]


def test_completion_logprobs_with_echo(client, engine, model):
    prompt = "The capital of France is"
    r = client.completions.create(model="x", prompt=prompt, max_tokens=4, temperature=0, logprobs=2, echo=True)
    ch = r.choices[0]
    lp = ch.logprobs
    ptoks = model.tokenize(prompt, add_special=True, parse_special=True)
    gen = engine.submit(prompt, max_tokens=4, temperature=0, logprobs=2).result()
    assert ch.text == prompt + gen.text
    n = len(ptoks)
    assert len(lp.tokens) == n + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing precedes the first
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert lp.tokens == [model.token_to_piece(t).decode() for t in ptoks + gen.tokens]
    assert lp.token_logprobs[n:] == pytest.approx([t.logprob for t in gen.logprobs], abs=1e-6)
    assert all(len(t) == 2 for t in lp.top_logprobs[1:])
    # text offsets: each token's place in the choice's text
    assert lp.text_offset[0] == 0
    for tok, off in zip(lp.tokens, lp.text_offset):
        assert ch.text[off:off + len(tok)] == tok
    # without echo: the generated tokens only, offsets from the start of the text
    r = client.completions.create(model="x", prompt=prompt, max_tokens=4, temperature=0, logprobs=2)
    assert r.choices[0].logprobs.tokens == lp.tokens[n:]
    assert r.choices[0].logprobs.text_offset == [x - len(prompt) for x in lp.text_offset[n:]]
    assert r.choices[0].logprobs.token_logprobs == lp.token_logprobs[n:]
    # llama-server's n_probs asks for the same
    c = client.completions.create(model="x", prompt=prompt, max_tokens=4, temperature=0, extra_body={"n_probs": 2})
    assert c.choices[0].logprobs.model_dump() == r.choices[0].logprobs.model_dump()


def test_echoed_logprobs_agree_with_llama_cpp(client, model):
    """The recorded sequences (prompt and llama.cpp's greedy continuation) sent as token ids with echo:
    each token's logprob within 2x llama.cpp's own flash-attention on/off spread of it, and the same
    most likely next token wherever llama.cpp's top-1/top-2 gap is clear (test_logprobs' criteria)."""
    meta = json.loads((LLAMA_CPP / "smollm2-135m.json").read_text())
    ref = np.load(LLAMA_CPP / "smollm2-135m.npz")
    tol = 2 * meta["fa_spread"]["chosen"]
    for name in meta["n_prompt"]:
        toks = ref[f"{name}__tokens"].tolist()
        r = client.completions.create(model="x", prompt=toks, max_tokens=1, temperature=0, logprobs=5, echo=True)
        lp = r.choices[0].logprobs
        assert lp.tokens[:len(toks)] == [model.token_to_piece(t).decode("utf-8", "replace") for t in toks]
        got = np.array(lp.token_logprobs[1:len(toks)])
        assert np.abs(got - ref[f"{name}__fa_off__lp"]).max() <= tol, name
        r_ids, r_lps = ref[f"{name}__fa_off__top_ids"], ref[f"{name}__fa_off__top_lp"]
        clear = (r_lps[:, 0] - r_lps[:, 1]) > tol
        assert clear.sum() >= len(clear) // 3
        # position i's top list is the distribution that predicted token i: llama.cpp's row i - 1
        for i in np.nonzero(clear[:-1])[0]:
            top = lp.top_logprobs[i + 1]
            assert max(top, key=top.get) == model.token_to_piece(int(r_ids[i, 0])).decode("utf-8", "replace")


@pytest.mark.parametrize("echo", [False, True])
def test_streamed_completion_logprobs_equal_the_non_streamed(server, echo):
    body = {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "logprobs": 3, "echo": echo}
    whole = server.post("/v1/completions", json=body).json()["choices"][0]
    got: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    text = ""
    for e in events(server, "/v1/completions", body):
        ch = e["choices"][0]
        text += ch["text"]
        for k in got:
            got[k] += (ch["logprobs"] or {}).get(k, [])
    assert text == whole["text"]
    assert got == whole["logprobs"]


# ---- penalties and bias ---------------------------------------------------------------------------------
REPEAT = "Repeat after me: apple apple apple apple apple apple apple"


def greedy(client, prompt, n, **kw):
    r = client.completions.create(model="x", prompt=prompt, max_tokens=n, temperature=0, logprobs=0, **kw)
    return r.choices[0].text, r.choices[0].logprobs.tokens


def test_logit_bias_bans_and_forces(client, model):
    prompt = "The capital of France is"
    text, toks = greedy(client, prompt, 6)
    first = model.tokenize(toks[0], add_special=False)
    assert len(first) == 1 and model.token_to_piece(first[0]).decode() == toks[0]
    banned_text, banned = greedy(client, prompt, 6, logit_bias={str(first[0]): -100})
    assert toks[0] not in banned and banned_text != text
    banana = model.tokenize(" banana", add_special=False)
    assert len(banana) == 1
    _, forced = greedy(client, prompt, 4, logit_bias={str(banana[0]): 100})
    assert forced == [" banana"] * 4


def test_penalties_equal_the_engines(client, engine):
    plain, _ = greedy(client, REPEAT, 12)
    outs = {}
    for kw in ({"presence_penalty": 1.5}, {"frequency_penalty": 1.0}, {"frequency_penalty": 1.0, "repeat_last_n": 4},
               {"presence_penalty": 1.5, "repeat_last_n": 0}):
        extra = {"repeat_last_n": kw["repeat_last_n"]} if "repeat_last_n" in kw else {}
        sent = {k: v for k, v in kw.items() if k != "repeat_last_n"}
        text, _ = greedy(client, REPEAT, 12, extra_body=extra, **sent)
        assert text == engine.submit(REPEAT, max_tokens=12, temperature=0, **kw).result().text, kw
        outs[tuple(kw.items())] = text
    assert outs[(("presence_penalty", 1.5),)] != plain  # the penalty changes the greedy output
    assert outs[(("presence_penalty", 1.5), ("repeat_last_n", 0))] == plain  # a window of 0: no penalty


@pytest.mark.parametrize("bias", [{"abc": 5}, {"-1": 5}, {"²": 5}, {"1": 101}, {"1": -100.5}, {"49152": 1},
                                  {"1": "x"}, [5]],
                         ids=["not-a-number", "negative", "superscript-digit", "over-100", "under-100", "outside-vocab",
                              "not-a-float", "not-an-object"])
def test_bad_logit_bias_is_400(server, bias):
    refused(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "logit_bias": bias}, "logit_bias")


# ---- slots and the prefix cache -------------------------------------------------------------------------
def test_id_slot_runs_on_that_slot(server):
    for s in (0, 1):
        assert server.post(f"/slots/{s}?action=erase").status_code == 200
    prompt = "A prompt for the second slot only, with a few words."
    r = server.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0, "id_slot": 1})
    assert r.status_code == 200, r.text
    n = r.json()["usage"]["prompt_tokens"]
    slots = server.get("/slots").json()
    assert slots[1]["cached_tokens"] >= n and slots[0]["cached_tokens"] == 0
    r = server.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0, "id_slot": 0})
    assert server.get("/slots").json()[0]["cached_tokens"] >= n
    refused(server, "/v1/completions", {"prompt": "hi", "id_slot": 2}, "id_slot")


def test_cache_prompt_false_computes_the_whole_prompt(server):
    body = {"prompt": "Computed in full each time it is asked for with cache_prompt off:", "max_tokens": 2,
            "temperature": 0}
    warm = server.post("/v1/completions", json=body).json()
    again = server.post("/v1/completions", json=body).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the prefix cache is on
    cold = server.post("/v1/completions", json={**body, "cache_prompt": False}).json()
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 and cold["timings"]["cache_n"] == 0
    assert cold["timings"]["prompt_n"] == cold["usage"]["prompt_tokens"]
    assert cold["choices"][0]["text"] == warm["choices"][0]["text"]
