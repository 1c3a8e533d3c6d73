"""Tool calling (llamax.tools): prompts, constraints, parse and the streaming reader."""
from __future__ import annotations

import json
import logging
import re

import jsonschema
import llguidance
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llamax import tools as T
from llamax.model.model import ModelInfo

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["c", "f"]}},
                   "required": ["city"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "parameters": {"type": "object", "properties": {"query": {"type": "string"},
                                                                      "n": {"type": "integer"}},
                                     "required": ["query", "n"]}}}
TOOLS = [WEATHER, SEARCH]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]

# Qwen 2.5's tool template, shortened (the Hermes 2 Pro format)
QWEN = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are Qwen.' }}{%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\
\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}{{- '<|im_start|>system\\nYou are Qwen.<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or \
(message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}{{- tool_call.name }}{{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

# a template with its own tool syntax that is not Hermes (Llama 3.x-like): generic, with a log line;
# it renders parallel calls, so the generic format offers them
OWN_TOOLS = """{%- if tools %}Tools: {{ tools | tojson }}
{% endif %}{%- for m in messages %}<|{{ m.role }}|>{{ m.content or '' }}
{%- for c in m.tool_calls or [] %}[{{ c.function.name }} {{ c.function.arguments }}]{% endfor %}<|end|>
{% endfor %}{%- if add_generation_prompt %}<|assistant|>{%- endif %}"""


@pytest.fixture(scope="module")
def smollm() -> ModelInfo:
    return ModelInfo.read("smollm2-135m")


@pytest.fixture(scope="module")
def gemma() -> ModelInfo:
    return ModelInfo.read("gemma3-270m")


def compiles(kind: str, text: str) -> str:
    """llguidance's verdict on a grammar: "" when it compiles."""
    return llguidance.LLMatcher.validate_grammar(llguidance.grammar_from(kind, text))


def call_json(name: str, args: dict, **kw) -> dict:
    return {"name": name, "arguments": args, **kw}


def compact(x) -> str:
    return json.dumps(x, separators=(",", ":"), ensure_ascii=False)


# ------------------------------------------------------------------------------------------ prompts

def test_generic_prompt_chatml(smollm):
    plan = T.prepare(smollm, ASK, TOOLS)
    assert plan.format == "generic" and plan.lark is None
    # as in llama.cpp: a template that cannot show two calls in one turn is offered one call per answer
    assert plan.parallel_tool_calls is False and set(plan.schema["anyOf"][0]["properties"]) == {"tool_call"}
    p = plan.prompt
    assert p.startswith("<|im_start|>system\n" + T.GENERIC_SYSTEM + "\n\n" + T.TOOLS_POLYFILL + "[\n  {")
    assert json.dumps(TOOLS, indent=2) in p
    # minja's example call, inferred from the template: the polyfilled assistant tool_calls JSON
    assert "Example tool call syntax:\n\n{\n  \"tool_calls\": [\n" in p and '"tool_name"' in p
    assert p.endswith("<|im_start|>user\nWhat is the weather in Paris?<|im_end|>\n<|im_start|>assistant\n")
    assert "SmolLM" not in p  # the template's default system prompt gives way to ours


def test_generic_prompt_gemma_builtin(gemma):
    plan = T.prepare(gemma, [{"role": "system", "content": "Be brief."}, *ASK], TOOLS)
    p = plan.prompt
    assert plan.format == "generic"
    assert p.startswith("<start_of_turn>user\nBe brief.\n\n" + T.GENERIC_SYSTEM + "\n\n" + T.TOOLS_POLYFILL)
    assert '"name": "search"' in p
    assert p.endswith("What is the weather in Paris?<end_of_turn>\n<start_of_turn>model\n")


def test_hermes_prompt_native():
    plan = T.prepare_template(QWEN, ASK, TOOLS)
    assert plan.format == "hermes"
    assert plan.schema is None and plan.lark is None  # auto: unconstrained, parsed afterwards
    p = plan.prompt
    assert "<tools>\n" + json.dumps(WEATHER, ensure_ascii=False) + "\n" in p
    assert T.TOOLS_POLYFILL not in p and T.GENERIC_SYSTEM not in p
    assert p.endswith("<|im_start|>user\nWhat is the weather in Paris?<|im_end|>\n<|im_start|>assistant\n")


def test_tool_choice_none_renders_without_tools(smollm):
    plan = T.prepare(smollm, ASK, TOOLS, tool_choice="none")
    assert plan.format == "content" and plan.schema is None and plan.lark is None
    assert plan.prompt == smollm.apply_chat_template(ASK)
    assert plan.parse('{"response": "x"}') == ('{"response": "x"}', [])


def test_other_native_format_falls_back_to_generic(caplog):
    with caplog.at_level(logging.INFO, logger="llamax"):
        plan = T.prepare_template(OWN_TOOLS, ASK, TOOLS)
    assert plan.format == "generic"
    assert "generic JSON format" in caplog.text
    assert plan.prompt.startswith("Tools: ")  # the template describes the tools itself: no polyfill
    assert T.TOOLS_POLYFILL not in plan.prompt and T.GENERIC_SYSTEM in plan.prompt


NO_SYSTEM = """{%- for m in messages %}{%- if m.role == 'system' %}{{ raise_exception('System role not supported') }}
{%- endif %}<{{ m.role }}>{{ m.content }}</s>{%- endfor %}{%- if add_generation_prompt %}<assistant>{%- endif %}"""


def test_system_role_polyfilled():
    # a template that refuses system messages gets the system text merged into the first user turn
    plan = T.prepare_template(NO_SYSTEM, [{"role": "system", "content": "Be brief."}, *ASK], TOOLS)
    assert plan.prompt.startswith("<user>Be brief.\n\n" + T.GENERIC_SYSTEM + "\n\n" + T.TOOLS_POLYFILL)
    assert plan.prompt.endswith("\nWhat is the weather in Paris?</s><assistant>")
    assert "<system>" not in plan.prompt


# --------------------------------------------------------------------------------- second turn

def turn2(args) -> list[dict]:
    return [*ASK,
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_abc", "type": "function", "function": {"name": "get_weather", "arguments": args}}]},
            {"role": "tool", "tool_call_id": "call_abc", "name": "get_weather", "content": "21 C, sunny"}]


def test_second_turn_polyfilled_chatml(smollm):
    p = T.prepare(smollm, turn2('{"city": "Paris"}'), TOOLS).prompt
    call = {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "call_abc"}]}
    assert "<|im_start|>assistant\n" + json.dumps(call, indent=2) + "<|im_end|>\n" in p
    resp = {"tool_response": {"tool": "get_weather", "content": "21 C, sunny", "tool_call_id": "call_abc"}}
    assert "<|im_start|>user\n" + json.dumps(resp, indent=2) + "<|im_end|>\n" in p
    assert p.endswith("<|im_start|>assistant\n")


def test_second_turn_polyfilled_gemma(gemma):
    p = T.prepare(gemma, turn2('{"city": "Paris"}'), TOOLS).prompt
    assert '"tool_response": {\n    "tool": "get_weather",\n    "content": "21 C, sunny"' in p
    assert "<start_of_turn>model\n{\n  \"tool_calls\"" in p


@pytest.mark.parametrize("args", ['{"city": "Paris"}', {"city": "Paris"}])
def test_second_turn_native_hermes(args):
    p = T.prepare_template(QWEN, turn2(args), TOOLS).prompt
    # the template needs object arguments (tojson of a string would double-escape): they are parsed
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n' \
           "</tool_call><|im_end|>" in p
    assert "<|im_start|>user\n<tool_response>\n21 C, sunny\n</tool_response><|im_end|>\n" in p


def test_second_turn_without_tools_offered(smollm):
    plan = T.prepare(smollm, turn2('{"city": "Paris"}'), None)
    assert plan.format == "content" and '"tool_response"' in plan.prompt


# ------------------------------------------------------------------------------------- constraints

CHOICES = ["auto", "required", {"type": "function", "function": {"name": "search"}}]


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("choice", CHOICES, ids=["auto", "required", "named"])
def test_generic_schema_compiles_and_validates(choice, parallel):
    plan = T.prepare_template(OWN_TOOLS, ASK, TOOLS, tool_choice=choice, parallel_tool_calls=parallel)
    assert plan.format == "generic" and plan.parallel_tool_calls == parallel
    schema = plan.schema
    assert compiles("json_schema", json.dumps(schema)) == ""
    jsonschema.Draft202012Validator.check_schema(schema)
    v = jsonschema.Draft202012Validator(schema)
    search = call_json("search", {"query": "llama", "n": 3})
    weather = call_json("get_weather", {"city": "Paris"})
    key = "tool_calls" if parallel else "tool_call"

    def wrap(*calls):
        if parallel:
            return {"tool_calls": [{**c, "id": f"id_{i}x"} for i, c in enumerate(calls)]}
        return {"tool_call": calls[0]}

    assert v.is_valid(wrap(search))
    assert v.is_valid(wrap(weather)) == (choice != CHOICES[2])  # named: only that function
    assert v.is_valid({"response": "hi"}) == (choice == "auto")
    bad = [wrap(call_json("nope", {})),                               # unknown function
           wrap(call_json("search", {"query": "llama"})),             # a required argument missing
           wrap(call_json("search", {"query": "llama", "n": "3"})),   # wrong argument type
           wrap({"name": "search"}),                                  # no arguments
           {**wrap(search), "extra": 1},                              # not in the format
           {"response": 3},
           {}]
    if parallel:
        bad += [{"tool_calls": []}, {"tool_calls": [search]}]         # at least one; each with an id
    else:
        bad += [{"tool_calls": [search]}]
    for out in bad:
        assert not v.is_valid(out), out
    assert key in json.dumps(schema)


@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("choice", CHOICES[1:], ids=["required", "named"])
def test_hermes_lark_compiles(choice, parallel):
    plan = T.prepare_template(QWEN, ASK, TOOLS, tool_choice=choice, parallel_tool_calls=parallel)
    assert plan.schema is None and plan.lark is not None
    assert compiles("lark", plan.lark) == ""
    assert ('"const":"get_weather"' in plan.lark) == (choice == "required")
    assert '"const":"search"' in plan.lark
    assert ("tool_call)*" in plan.lark) == parallel
    # the JSON inside a block follows the same call schema as the generic format's
    body = json.loads(plan.lark.split("%json ", 1)[1])
    v = jsonschema.Draft202012Validator(body)
    assert v.is_valid(call_json("search", {"query": "q", "n": 1}))
    assert not v.is_valid(call_json("search", {"query": "q"}))


class _ByteTokenizer:
    """A 256-byte vocabulary (+ EOS) to run llguidance's matcher on hand-written outputs."""
    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"<eos>", b"<tool_call>", b"</tool_call>"]
    special_token_ids = [256, 257, 258]

    def __call__(self, s: bytes) -> list[int]:
        return list(s)


BYTES = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokenizer()))


def accepts(plan: T.ToolPlan, out: str | list[int]) -> bool:
    """llguidance, constrained by the plan, lets the model write exactly `out` (text, or token ids)."""
    grammar = llguidance.grammar_from("json_schema", json.dumps(plan.schema)) if plan.schema is not None \
        else llguidance.grammar_from("lark", plan.lark)
    m = llguidance.LLMatcher(BYTES, grammar, log_level=0)
    assert not m.is_error(), m.get_error()
    return m.consume_tokens(list(out.encode()) if isinstance(out, str) else out) and m.is_accepting()


def test_generic_schema_in_llguidance(smollm):
    auto = T.prepare_template(OWN_TOOLS, ASK, TOOLS)
    named = T.prepare(smollm, ASK, TOOLS, tool_choice=CHOICES[2])
    calls = '{"tool_calls": [{"name": "search", "arguments": {"query": "x", "n": 1}, "id": "abcd"}]}'
    assert accepts(auto, calls) and accepts(auto, '{"response": "Hi \\"there\\""}')
    assert not accepts(auto, '{"tool_calls": [{"name": "nope", "arguments": {}, "id": "abcd"}]}')
    assert not accepts(auto, "Hello")
    assert accepts(named, '{"tool_call": {"name": "search", "arguments": {"query": "x", "n": 1}}}')
    assert not accepts(named, '{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}')
    assert not accepts(named, '{"response": "Hi"}')


def test_hermes_lark_in_llguidance():
    required = T.prepare_template(QWEN, ASK, TOOLS, tool_choice="required")
    one = '<tool_call>\n{"name": "search", "arguments": {"query": "x", "n": 1}}\n</tool_call>'
    two = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert accepts(required, one) and accepts(required, one + "\n" + two)
    assert not accepts(required, "Sure. " + one) and not accepts(required, "Hello")
    single = T.prepare_template(QWEN, ASK, TOOLS, tool_choice=CHOICES[2], parallel_tool_calls=False)
    assert accepts(single, one) and not accepts(single, one + "\n" + one) and not accepts(single, two)


def test_hermes_lark_names_control_tokens():
    # when the vocabulary has <tool_call> as a control token, text cannot match it: the grammar names the token
    plan = T.prepare_template(QWEN, ASK, TOOLS, tool_choice="required", special_tokens=["<tool_call>", "</tool_call>"])
    assert "tool_call: <tool_call> " in plan.lark and compiles("lark", plan.lark) == ""
    body = list(b'\n{"name": "search", "arguments": {"query": "x", "n": 1}}\n')
    assert accepts(plan, [257, *body, 258])
    assert not accepts(plan, '<tool_call>\n{"name": "search", "arguments": {"query": "x", "n": 1}}\n</tool_call>')
    as_text = T.prepare_template(QWEN, ASK, TOOLS, tool_choice="required")
    assert accepts(as_text, [*b"<tool_call>", *body, *b"</tool_call>"]) and not accepts(as_text, [257, *body, 258])


# ------------------------------------------------------------------------------------------ parse

def test_parse_generic():
    plan = T.prepare_template(OWN_TOOLS, ASK, TOOLS)
    out = json.dumps({"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"},
                                      "id": "abcd"}]}, indent=2)
    content, calls = plan.parse(out)
    assert content is None and len(calls) == 1
    c = calls[0]
    assert c.name == "get_weather" and c.arguments == '{"city":"Paris","unit":"c"}'
    assert re.fullmatch(r"call_[A-Za-z0-9]{24}", c.id)
    assert plan.parse(out)[1] == calls  # ids are the plan's: stable


def test_parse_generic_parallel_and_single(smollm):
    plan = T.prepare_template(OWN_TOOLS, ASK, TOOLS)
    out = ('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "aaaa"}, '
           '{"arguments": {"query": "a \\"b\\"", "n": 2}, "name": "search", "id": "bbbb"}]}')
    content, calls = plan.parse(out)
    assert content is None
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city":"Paris"}'), ("search", '{"query":"a \\"b\\"","n":2}')]
    assert calls[0].id != calls[1].id
    single = T.prepare(smollm, ASK, TOOLS)
    _, calls = single.parse('{"tool_call": {"name": "search", "arguments": {"query": "x", "n": -1.5e3}}}')
    assert [(c.name, c.arguments) for c in calls] == [("search", '{"query":"x","n":-1.5e3}')]


def test_parse_generic_response():
    plan = T.prepare_template(OWN_TOOLS, ASK, TOOLS)
    text = 'It is "sunny"\n\\ in Paris \u00e9 \U0001F600'
    for ascii_ in (True, False):
        assert plan.parse(json.dumps({"response": text}, ensure_ascii=ascii_)) == (text, [])
    assert plan.parse('{"response": ""}') == ("", [])
    # not JSON at all (an unconstrained run): all content
    assert plan.parse("  Hello there") == ("  Hello there", [])


def test_parse_hermes():
    plan = T.prepare_template(QWEN, ASK, TOOLS)
    out = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
           '<tool_call>\n{"name": "search", "arguments": {"query": "<tool_call>", "n": 1}}\n</tool_call>')
    content, calls = plan.parse(out)
    assert content == "Let me check."
    assert [(c.name, c.arguments) for c in calls] == [
        ("get_weather", '{"city":"Paris"}'), ("search", '{"query":"<tool_call>","n":1}')]
    assert plan.parse("The weather is <b>fine</b> <tool") == ("The weather is <b>fine</b> <tool", [])
    assert plan.parse("Plain answer.\n") == ("Plain answer.\n", [])
    # arguments before the name, and no arguments at all
    _, calls = plan.parse('<tool_call>\n{"arguments": {"query": "x", "n": 1}, "name": "search"}\n</tool_call>'
                          '<tool_call>{"name": "get_weather"}</tool_call>')
    assert [(c.name, c.arguments) for c in calls] == [("search", '{"query":"x","n":1}'), ("get_weather", "{}")]


def test_parse_truncated_and_malformed():
    plan = T.prepare_template(OWN_TOOLS, ASK, TOOLS)
    content, calls = plan.parse('{"tool_calls": [{"name": "search", "arguments": {"query": "ll')
    assert content is None and calls[0].name == "search" and calls[0].arguments == '{"query":"ll'
    assert plan.parse('{"response": "Hel') == ("Hel", [])
    hermes = T.prepare_template(QWEN, ASK, TOOLS)
    content, calls = hermes.parse("Hi <tool_call>\n{not json} tail")  # read as content from the error on
    assert content == "Hinot json} tail" and calls == []
    assert plan.parse('{"response": "a"  oops') == ("aoops", [])


# -------------------------------------------------------------------------------------- streaming

def run_stream(plan: T.ToolPlan, text: str, cuts: list[int]) -> list[dict]:
    s = plan.stream()
    deltas = []
    prev = 0
    for c in sorted(set(cuts)) + [len(text)]:
        deltas += s.push(text[prev:c])
        prev = c
    return deltas + s.finish()


def check_deltas(plan: T.ToolPlan, text: str, deltas: list[dict]) -> None:
    content, calls = plan.parse(text)
    got_content = "".join(d["content"] for d in deltas if "content" in d)
    assert got_content == (content or "")
    heads: dict[int, dict] = {}
    args: dict[int, list[str]] = {}
    for d in deltas:
        assert set(d) in ({"content"}, {"tool_calls"})
        if "content" in d:
            assert d["content"]
            continue
        (e,) = d["tool_calls"]
        i = e["index"]
        if "id" in e:  # the head: once, first, with the name
            assert i not in heads and i == len(heads)
            assert e["type"] == "function" and e["function"]["arguments"] == ""
            heads[i] = e
            args[i] = []
        else:
            assert i in heads and set(e) == {"index", "function"} and set(e["function"]) == {"arguments"}
            args[i].append(e["function"]["arguments"])
    assert [(h["id"], h["function"]["name"], "".join(args[i])) for i, h in sorted(heads.items())] == \
           [(c.id, c.name, c.arguments) for c in calls]


ARG_TEXT = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=12)
ARGS = st.fixed_dictionaries({"query": ARG_TEXT, "n": st.integers(-10**6, 10**6)})


@st.composite
def generic_outputs(draw):
    calls = draw(st.lists(ARGS, min_size=0, max_size=3))
    indent = draw(st.sampled_from([None, 0, 2]))
    ascii_ = draw(st.booleans())
    if calls:
        obj = {"tool_calls": [{"name": "search", "arguments": a, "id": f"id{i:03d}"} for i, a in enumerate(calls)]}
    else:
        obj = {"response": draw(ARG_TEXT)}
    text = json.dumps(obj, indent=indent, ensure_ascii=ascii_)
    cuts = draw(st.lists(st.integers(0, len(text)), max_size=12))
    expected = [json.dumps(a, separators=(",", ":"), ensure_ascii=ascii_) for a in calls]
    return text, cuts, expected, obj.get("response")


@settings(max_examples=150, deadline=None)
@given(generic_outputs())
def test_stream_generic_any_split(case):
    text, cuts, expected, response = case
    plan = T.prepare_template(OWN_TOOLS, ASK, TOOLS)
    deltas = run_stream(plan, text, cuts)
    check_deltas(plan, text, deltas)
    content, calls = plan.parse(text)
    assert [c.arguments for c in calls] == expected
    assert content == response


@st.composite
def hermes_outputs(draw):
    pre = draw(st.sampled_from(["", "Sure.", "I'll look <tool it up", "a\n\n"]))
    calls = draw(st.lists(ARGS, min_size=0, max_size=3))
    ascii_ = draw(st.booleans())
    blocks = "\n".join("<tool_call>\n" + json.dumps({"name": "search", "arguments": a}, ensure_ascii=ascii_)
                       + "\n</tool_call>" for a in calls)
    post = draw(st.sampled_from(["", "\n", " Done."]))
    text = pre + ("\n" if pre and calls else "") + blocks + post
    cuts = draw(st.lists(st.integers(0, len(text)), max_size=12))
    return text, cuts, [json.dumps(a, separators=(",", ":"), ensure_ascii=ascii_) for a in calls]


@settings(max_examples=150, deadline=None)
@given(hermes_outputs())
def test_stream_hermes_any_split(case):
    text, cuts, expected = case
    plan = T.prepare_template(QWEN, ASK, TOOLS)
    deltas = run_stream(plan, text, cuts)
    check_deltas(plan, text, deltas)
    assert [c.arguments for c in plan.parse(text)[1]] == expected


JUNK = st.lists(st.sampled_from(list('{}[]:," \\nabu0123-e.') + ["<tool_call>", "</tool_call>", '"name"',
                                                                 '"arguments"', '"response"', '"search"']),
               max_size=40).map("".join)


@settings(max_examples=300, deadline=None)
@given(JUNK, st.lists(st.integers(0, 400), max_size=10), st.sampled_from(["generic", "hermes"]))
def test_stream_any_text_any_split(text, cuts, fmt):
    # whatever the model writes, the reader does not fail and the split does not matter
    plan = T.prepare_template(OWN_TOOLS if fmt == "generic" else QWEN, ASK, TOOLS)
    check_deltas(plan, text, run_stream(plan, text, [c for c in cuts if c <= len(text)]))


def test_stream_generic_response_decoded_incrementally():
    plan = T.prepare_template(OWN_TOOLS, ASK, TOOLS)
    s = plan.stream()
    assert s.push('{"response": "caf') == [{"content": "caf"}]
    assert s.push("\\u00") == []          # an escape is certain only when whole
    assert s.push('e9 \\ud83d') == [{"content": "\u00e9 "}]
    assert s.push('\\ude00"}') == [{"content": "\U0001F600"}]
    assert s.finish() == []


def test_stream_calls_as_openai():
    plan = T.prepare_template(OWN_TOOLS, ASK, TOOLS)
    s = plan.stream()
    assert s.push('{"tool_calls": [{"name": "sea') == []
    head, first = s.push('rch", "arguments": {"query"')
    (h,) = head["tool_calls"]
    assert h == {"index": 0, "id": h["id"], "type": "function", "function": {"name": "search", "arguments": ""}}
    assert first == {"tool_calls": [{"index": 0, "function": {"arguments": '{"query"'}}]}
    rest = s.push(': "x", "n": 1}, "id": "abcd"}]}') + s.finish()
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in [first, *rest]) == '{"query":"x","n":1}'
    assert plan.parse('{"tool_calls": [{"name": "search", "arguments": {}, "id": "abcd"}]}')[1][0].id == h["id"]
    with pytest.raises(ValueError, match="after finish"):
        s.push("x")


def test_stream_hermes_holds_a_possible_tag():
    plan = T.prepare_template(QWEN, ASK, TOOLS)
    s = plan.stream()
    assert s.push("Hello <tool") == [{"content": "Hello"}]
    assert s.push("box> ") == [{"content": " <toolbox>"}]
    deltas = s.push("\n<tool_call>\n{\"name\": \"get_weather\", ")
    assert [d["tool_calls"][0]["function"]["name"] for d in deltas] == ["get_weather"]
    assert s.push('"arguments": {"city": "Paris"}}\n</tool_') == [
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city":"Paris"}'}}]}]
    assert s.push("call>\n") == [] and s.finish() == []


def test_smollm_calls_a_tool_under_the_constraint():
    """End to end: SmolLM2's greedy answer, masked by llguidance with the plan's schema, read back."""
    import numpy as np

    from llamax.batch import Batch
    from llamax.context import Context
    from llamax.generate import decode_prompt
    from llamax.model.model import Model

    m = Model.load("smollm2-135m", n_threads=1)
    n = m.n_vocab

    class Vocab:
        eos_token_id, bos_token_id = m.eos, m.bos
        tokens = [m.token_to_piece(i) for i in range(n)]
        special_token_ids = [i for i in range(n) if m.is_eog(i)]

        def __call__(self, s: bytes) -> list[int]:
            return m.tokenize(s.decode("utf-8", "replace"), add_special=False)

    plan = T.prepare(m, ASK, [WEATHER])
    matcher = llguidance.LLMatcher(llguidance.LLTokenizer(llguidance.TokenizerWrapper(Vocab())),
                                   llguidance.grammar_from("json_schema", json.dumps(plan.schema)), log_level=0)
    ctx = Context(m, n_ctx=1024)
    decode_prompt(ctx, m.tokenize(plan.prompt, add_special=True, parse_special=True))
    stream, deltas, out = plan.stream(), [], []
    for _ in range(64):
        logits = ctx.get_logits_ith(-1).copy()
        allowed = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8), bitorder="little")[:n]
        logits[allowed == 0] = -np.inf
        t = int(np.argmax(logits))
        if m.is_eog(t):
            break
        assert matcher.consume_token(t)
        out.append(t)
        deltas += stream.push(m.detokenize([t]))
        ctx.decode(Batch.one([t]))
    deltas += stream.finish()
    text = m.detokenize(out)
    content, calls = plan.parse(text)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"})]
    check_deltas(plan, text, deltas)


# ----------------------------------------------------------------------------------------- errors

@pytest.mark.parametrize("tools, match", [
    ("get_weather", "tools must be a list"),
    ({"type": "function"}, "tools must be a list"),
    ([3], r"tools\[0\] must be an object"),
    ([{"function": WEATHER["function"]}], r"tools\[0\].type must be 'function'"),
    ([{"type": "function"}], r"tools\[0\].function must be an object"),
    ([{"type": "function", "function": {"name": "bad name"}}], r"tools\[0\].function.name"),
    ([{"type": "function", "function": {}}], r"tools\[0\].function.name"),
    ([WEATHER, WEATHER], "'get_weather' is given twice"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], r"tools\[0\].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "description": 3}}], r"tools\[0\].function.description"),
])
def test_bad_tools(smollm, tools, match):
    with pytest.raises(ValueError, match=match):
        T.prepare(smollm, ASK, tools)


@pytest.mark.parametrize("choice, match", [
    ({"type": "function", "function": {"name": "get_time"}}, "'get_time', which is not among the tools"),
    ("any", "tool_choice must be"),
    ({"type": "function"}, "tool_choice must be"),
    (None, "tool_choice must be"),
])
def test_bad_tool_choice(smollm, choice, match):
    with pytest.raises(ValueError, match=match):
        T.prepare(smollm, ASK, TOOLS, tool_choice=choice)


def test_bad_requests(smollm):
    with pytest.raises(ValueError, match="'required' needs tools"):
        T.prepare(smollm, ASK, [], tool_choice="required")
    with pytest.raises(ValueError, match="parallel_tool_calls must be a bool"):
        T.prepare(smollm, ASK, TOOLS, parallel_tool_calls="yes")
    bad_call = [*ASK, {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f"}}]}]
    with pytest.raises(ValueError, match=r"messages\[1\].tool_calls\[0\]"):
        T.prepare(smollm, bad_call, TOOLS)
    with pytest.raises(ValueError, match=r"messages\[1\]: a tool message's content"):
        T.prepare(smollm, [*ASK, {"role": "tool", "content": None}], TOOLS)
    with pytest.raises(ValueError, match=r"messages\[0\] has no 'content'"):
        T.prepare(smollm, [{"role": "user"}], TOOLS)
