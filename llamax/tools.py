"""Tool calling: the prompt that offers tools, the constraint on the answer, and the answer read back.

`prepare(model, messages, tools, tool_choice, parallel_tool_calls)` returns a `ToolPlan`: the prompt
text, the constraint (`schema`, a JSON schema, or `lark`, an llguidance grammar, or neither), and the
readers of the output: `parse(text)` for a finished output and `stream()` for one arriving in pieces.
It follows llama.cpp's common/chat.cpp (common_chat_templates_apply_jinja) and minja's polyfills.

Formats (picked from the chat template's source, as llama.cpp does):

  * "hermes" (Hermes 2 Pro, Qwen 2.5: the template mentions ``<tool_call>``): the template renders the
    tools itself; the model answers free text and/or calls, each
    ``<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>``.
  * "generic" (every other template): llama.cpp's generic JSON format. A system message asks for JSON
    ("Respond in JSON format, either with `tool_call` ... or with `response` ..."); a template that
    does not describe tools itself gets minja's polyfill: the tools as indented JSON in the system
    message, with an example call inferred from the template. The answer is one JSON object:
    ``{"response": "text"}``, ``{"tool_calls": [{"name": N, "arguments": {...}, "id": "..."}]}``
    (parallel calls allowed) or ``{"tool_call": {"name": N, "arguments": {...}}}`` (not). As in
    llama.cpp, parallel calls are offered only when the template can render a turn with two calls.
    A template with another native tool syntax (Llama 3.x, Mistral, ...) also gets this format, with
    a log line saying so.
  * "content": tool_choice "none" (or no tools): the conversation is rendered without tools, the
    output is plain content.

Earlier turns render natively when the template supports them (probed as minja does, by rendering
needles), else with minja's polyfills: an assistant message's `tool_calls` become the JSON text
``{"tool_calls": [{"name", "arguments", "id"}], "content"?}`` as its content; a ``tool`` message
becomes a user message ``{"tool_response": {"tool": name, "content": ..., "tool_call_id": ...}}``;
a template that needs arguments as objects gets them parsed; a template without a system role gets
the system text merged into the next user message.

How tool_choice maps to a constraint:

  ==========  ==============================================  ===========================================
  choice      generic                                         hermes
  ==========  ==============================================  ===========================================
  auto        schema: anyOf [calls object, response object]   none (llama.cpp's grammar is lazy, started
                                                              by ``<tool_call>``: not expressible as one
                                                              eager constraint; the output is parsed)
  required    schema: the calls object only                   lark: ``<tool_call>`` blocks only
  named       schema: the calls object of that one tool       lark: blocks of that one tool
  none        none ("content" format)                         none ("content" format)
  ==========  ==============================================  ===========================================

In a call, "name" is a const of the tool and "arguments" follows the tool's "parameters" schema.

Reading the output (parse and stream share one reader, so they always agree):

  * content: the generic "response" string, decoded (JSON escapes, surrogate pairs) as its characters
    arrive; in hermes the text outside ``<tool_call>`` blocks, whitespace next to a block dropped,
    sent once it cannot be the start of a block.
  * a call: first ``{"index": i, "id": "call_...", "type": "function", "function": {"name": N,
    "arguments": ""}}`` once the name is complete, then ``{"index": i, "function": {"arguments": P}}``
    pieces whose concatenation is the arguments JSON text compacted (whitespace outside strings
    removed, strings kept as written). A call without "arguments" gets "{}". Ids are ours
    ("call_" + 24 letters/digits, one list per plan, so stream and parse agree), not the model's.
  * a truncated output (max tokens) gives what was certain: a call cut inside its arguments keeps
    the cut text. Text after the generic JSON object is ignored; output that breaks the format is
    logged and read as content from that point.

Deltas are OpenAI's ``choices[].delta`` dicts: ``{"content": str}`` or ``{"tool_calls": [entry]}``.
The text given to the readers must show the format's markers (``<tool_call>`` detokenized as text).
"""
from __future__ import annotations

import json
import logging
import re
import secrets
import string
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from llamax.grammar import closed
from llamax.model.chat import apply_chat_template

if TYPE_CHECKING:
    from llamax.model.model import ModelInfo

__all__ = ["Delta", "ToolCall", "ToolPlan", "ToolStream", "prepare", "prepare_template"]

log = logging.getLogger("llamax")

Delta = dict[str, Any]

#: llama.cpp's generic format: the system instruction (common_chat_params_init_generic).
GENERIC_SYSTEM = ("Respond in JSON format, either with `tool_call` (a request to call tools) or with `response` "
                  "reply to the user's request")
#: minja's tools polyfill (chat_template::apply, polyfill_tools).
TOOLS_POLYFILL = "You can call any of the following tools to satisfy the user's requests: "
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"  # the Hermes format's markers


@dataclass(frozen=True)
class ToolCall:
    """A call the model asked for: `arguments` is a JSON text (OpenAI's shape)."""
    id: str
    name: str
    arguments: str


# --------------------------------------------------------------------------------------- validation

_NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
_CHOICES = ("auto", "none", "required")


def _check_tools(tools: Any) -> list[dict[str, Any]]:
    """OpenAI's tools list -> [{"name", "description"?, "parameters"}]; ValueError naming the problem."""
    if tools is None:
        return []
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise ValueError(f"tools must be a list of {{'type': 'function', 'function': {{...}}}}, "
                         f"not {type(tools).__name__}")
    out: list[dict[str, Any]] = []
    seen: set[str] = set()
    for i, t in enumerate(tools):
        if not isinstance(t, Mapping):
            raise ValueError(f"tools[{i}] must be an object, not {type(t).__name__}")
        if t.get("type") != "function":
            raise ValueError(f"tools[{i}].type must be 'function', got {t.get('type')!r}")
        f = t.get("function")
        if not isinstance(f, Mapping):
            raise ValueError(f"tools[{i}].function must be an object with a 'name', got {f!r}")
        name = f.get("name")
        if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
            raise ValueError(f"tools[{i}].function.name must be 1-64 letters, digits, '_' or '-', got {name!r}")
        if name in seen:
            raise ValueError(f"tools[{i}].function.name {name!r} is given twice")
        seen.add(name)
        desc = f.get("description")
        if desc is not None and not isinstance(desc, str):
            raise ValueError(f"tools[{i}].function.description must be a string, not {type(desc).__name__}")
        params = f.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, Mapping):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object, "
                             f"not {type(params).__name__}")
        tool: dict[str, Any] = {"name": name, "parameters": dict(params)}
        if desc is not None:
            tool["description"] = desc
        out.append(tool)
    return out


def _check_choice(tool_choice: Any, names: Sequence[str]) -> tuple[str, str | None]:
    """-> (mode, name): mode "auto" | "none" | "required" | "named"."""
    if isinstance(tool_choice, str):
        if tool_choice not in _CHOICES:
            raise ValueError(f"tool_choice must be 'auto', 'none', 'required' or "
                             f"{{'type': 'function', 'function': {{'name': ...}}}}, got {tool_choice!r}")
        if tool_choice == "required" and not names:
            raise ValueError("tool_choice 'required' needs tools")
        return tool_choice, None
    if isinstance(tool_choice, Mapping) and tool_choice.get("type") == "function" \
            and isinstance(tool_choice.get("function"), Mapping):
        name = tool_choice["function"].get("name")
        if name not in names:
            raise ValueError(f"tool_choice names the function {name!r}, which is not among the tools "
                             f"({', '.join(names) or 'none given'})")
        return "named", name
    raise ValueError(f"tool_choice must be 'auto', 'none', 'required' or "
                     f"{{'type': 'function', 'function': {{'name': ...}}}}, got {tool_choice!r}")


def _check_messages(messages: Any) -> list[dict[str, Any]]:
    """Copies of the messages; tool-call fields checked; a missing content of a tool-call turn is None."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of message objects, not {type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}] must be an object with a 'role', got {m!r}")
        m = dict(m)
        calls = m.get("tool_calls")
        if calls is not None:
            if m["role"] != "assistant" or isinstance(calls, (str, Mapping)) or not isinstance(calls, Sequence):
                raise ValueError(f"messages[{i}].tool_calls must be a list on an assistant message")
            for j, c in enumerate(calls):
                f = c.get("function") if isinstance(c, Mapping) else None
                if not isinstance(f, Mapping) or not isinstance(f.get("name"), str) \
                        or not isinstance(f.get("arguments"), (str, Mapping)):
                    raise ValueError(f"messages[{i}].tool_calls[{j}] must be {{'type': 'function', 'function': "
                                     f"{{'name': str, 'arguments': str}}}}, got {c!r}")
            m.setdefault("content", None)
        elif "content" not in m:
            raise ValueError(f"messages[{i}] has no 'content'")
        if m["role"] == "tool" and not isinstance(m["content"], str):
            raise ValueError(f"messages[{i}]: a tool message's content must be a string")
        out.append(m)
    return out


# ------------------------------------------------------------------- template capabilities (minja)

@dataclass(frozen=True)
class _Caps:
    """What a template renders by itself (minja's chat_template_caps), found by rendering needles."""
    system_role: bool
    tools: bool
    tool_calls: bool
    object_arguments: bool
    parallel_tool_calls: bool
    tool_responses: bool
    tool_call_example: str


def _raw_render(template: str | None, messages: list[dict[str, Any]], tools: Any, add_generation_prompt: bool,
                bos: str, eos: str, arch: str | None) -> str:
    """minja's try_raw_render: the template as is, "" when it fails (any error: templates raise freely)."""
    try:
        kw = {"tools": tools} if tools else {}
        return apply_chat_template(template, messages, add_generation_prompt, bos_token=bos, eos_token=eos,
                                   arch=arch, **kw)
    except Exception:  # noqa: BLE001 - a probe: failing to render is the answer
        return ""


@lru_cache(maxsize=16)
def _caps(template: str | None, bos: str, eos: str, arch: str | None) -> _Caps:
    user_needle, sys_needle = "<User Needle>", "<System Needle>"
    user = {"role": "user", "content": user_needle}

    def render(msgs: list[dict[str, Any]], tools: Any = None) -> str:
        return _raw_render(template, msgs, tools, False, bos, eos, arch)

    system_role = sys_needle in render([{"role": "system", "content": sys_needle}, user])
    some_tool = [{"name": "some_tool", "type": "function", "function": {
        "name": "some_tool", "description": "Some tool.", "parameters": {
            "type": "object", "properties": {"arg": {"type": "string", "description": "Some argument."}},
            "required": ["arg"]}}}]
    tools = "some_tool" in render([user], some_tool)

    def calls_msg(*calls: dict[str, Any]) -> dict[str, Any]:
        return {"role": "assistant", "content": None, "tool_calls": list(calls)}

    def call(name: str, arguments: Any) -> dict[str, Any]:
        return {"id": "call_1___", "type": "function", "function": {"arguments": arguments, "name": name}}

    args = {"argument_needle": "print('Hello, World!')"}

    def shows_args(out: str) -> bool:
        return '"argument_needle":' in out or "'argument_needle':" in out

    str_args = shows_args(render([user, calls_msg(call("ipython", json.dumps(args)))]))
    obj_args = shows_args(render([user, calls_msg(call("ipython", args))]))
    tool_calls = str_args or obj_args
    object_arguments = not str_args and obj_args
    parallel = tool_responses = False
    if tool_calls:
        tc = call("test_tool1", args if object_arguments else json.dumps(args))
        out = render([user, calls_msg(tc, call("test_tool2", tc["function"]["arguments"]))])
        parallel = "test_tool1" in out and "test_tool2" in out
        tool_responses = "Some response!" in render([user, calls_msg(tc), {
            "role": "tool", "name": "test_tool1", "content": "Some response!", "tool_call_id": "call_911_"}])
    caps = _Caps(system_role, tools, tool_calls, object_arguments, parallel, tool_responses, "")
    example = ""
    if not tools:
        # minja: the example call is what the template adds after the generation prompt for a call
        hey = {"role": "user", "content": "Hey"}
        tc = call("tool_name", {"arg1": "some_value"} if object_arguments else json.dumps({"arg1": "some_value"}))
        try:
            prefix = _render(template, [hey], None, caps, bos, eos, arch, True)
            full = _render(template, [hey, calls_msg(tc)], None, caps, bos, eos, arch, False)
        except Exception:  # noqa: BLE001 - no example then, as minja
            prefix = full = ""
        if eos and full:
            last = full.rfind(eos)
            if last == len(prefix) - len(eos) or (full.endswith("\n") and last == len(full) - len(eos) - 1):
                full = full[:last]
        common = 0
        for i in range(min(len(prefix), len(full))):
            if prefix[i] != full[i]:
                break
            if prefix[i] == "<":
                continue
            common = i + 1
        tail = full[common:]
        if "tool_name" in tail or "some_value" in tail:
            example = tail
    return _Caps(system_role, tools, tool_calls, object_arguments, parallel, tool_responses, example)


def _add_system(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """minja's add_system: appended to a leading system message, else a new one in front."""
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _dump2(x: Any) -> str:
    return json.dumps(x, indent=2, ensure_ascii=False)


def _render(template: str | None, messages: list[dict[str, Any]], tools: list[Any] | None, caps: _Caps,
            bos: str, eos: str, arch: str | None, add_generation_prompt: bool = True) -> str:
    """minja's chat_template::apply: the polyfills this template needs, then the template."""
    has_calls = any(m.get("tool_calls") for m in messages)
    poly_tools = bool(tools) and not caps.tools
    poly_calls = has_calls and not caps.tool_calls
    poly_responses = any(m["role"] == "tool" for m in messages) and not caps.tool_responses
    poly_objects = has_calls and caps.object_arguments
    poly_system = not caps.system_role
    if poly_tools:
        extra = f"\n\nExample tool call syntax:\n\n{caps.tool_call_example}\n\n" if caps.tool_call_example else ""
        messages = _add_system(messages, TOOLS_POLYFILL + _dump2(tools) + extra)
    out: list[dict[str, Any]] = []
    pending_system: list[str] = []
    for m in messages:
        m = dict(m)
        role = m["role"]
        if m.get("tool_calls") and (poly_objects or poly_calls):
            calls = []
            for c in m["tool_calls"]:
                f = dict(c["function"])
                if isinstance(f["arguments"], str):
                    try:
                        f["arguments"] = json.loads(f["arguments"])
                    except ValueError:
                        log.warning("tool call arguments are not JSON: %r", f["arguments"])
                calls.append({**c, "function": f})
            m["tool_calls"] = calls
            if poly_calls:
                obj: dict[str, Any] = {"tool_calls": [
                    {"name": c["function"]["name"], "arguments": c["function"]["arguments"],
                     **({"id": c["id"]} if "id" in c else {})}
                    for c in calls if c.get("type", "function") == "function"]}
                if m.get("content"):
                    obj["content"] = m["content"]
                m["content"] = _dump2(obj)
                del m["tool_calls"]
        if poly_responses and role == "tool":
            resp: dict[str, Any] = {}
            if "name" in m:
                resp["tool"] = m.pop("name")
            resp["content"] = m["content"]
            if "tool_call_id" in m:
                resp["tool_call_id"] = m["tool_call_id"]
            m["role"] = role = "user"
            m["content"] = _dump2({"tool_response": resp})
        if poly_system and m["content"] is not None:
            if role == "system":
                pending_system.append(m["content"])
                continue
            if role == "user" and pending_system:
                m["content"] = "\n".join(pending_system) + ("\n" + m["content"] if m["content"] else "")
                pending_system = []
            elif pending_system:
                out.append({"role": "user", "content": "\n".join(pending_system)})
                pending_system = []
        out.append(m)
    if pending_system:
        out.append({"role": "user", "content": "\n".join(pending_system)})
    kw = {"tools": tools} if tools else {}
    return apply_chat_template(template, out, add_generation_prompt, bos_token=bos, eos_token=eos, arch=arch, **kw)


# ------------------------------------------------------------------------------------- constraints

def _call_schema(tool: Mapping[str, Any]) -> dict[str, Any]:
    """One call of the tool; its arguments follow its parameters, objects closed as llama.cpp's grammar."""
    return {"type": "object",
            "properties": {"name": {"type": "string", "const": tool["name"]},
                           "arguments": closed(tool["parameters"])},
            "required": ["name", "arguments"], "additionalProperties": False}


def _one_of(schemas: list[dict[str, Any]]) -> dict[str, Any]:
    return schemas[0] if len(schemas) == 1 else {"anyOf": schemas}


def _generic_schema(tools: list[dict[str, Any]], mode: str, parallel: bool) -> dict[str, Any]:
    """common_chat_params_init_generic's schema (objects closed, as llama.cpp's grammar makes them)."""
    calls = []
    for t in tools:
        s = _call_schema(t)
        if "description" in t:
            s["description"] = t["description"]
        if parallel:
            s["properties"]["id"] = {"type": "string", "minLength": 4}
            s["required"].append("id")
        calls.append(s)
    if parallel:
        call = {"type": "object",
                "properties": {"tool_calls": {"type": "array", "items": _one_of(calls), "minItems": 1}},
                "required": ["tool_calls"], "additionalProperties": False}
    else:
        call = {"type": "object", "properties": {"tool_call": _one_of(calls)}, "required": ["tool_call"],
                "additionalProperties": False}
    if mode in ("required", "named"):
        return call
    return {"anyOf": [call, {"type": "object", "properties": {"response": {"type": "string"}},
                             "required": ["response"], "additionalProperties": False}]}


def _hermes_lark(tools: list[dict[str, Any]], parallel: bool, special: Collection[str]) -> str:
    """Only tool calls: ``<tool_call>\\n{json}\\n</tool_call>`` blocks (one, or several joined by a newline).

    A marker in `special` is a control token of the vocabulary: the grammar names the token
    (llguidance's ``<tool_call>``), as text would never match it.
    """
    def marker(m: str) -> str:
        return m if m in special else json.dumps(m)

    body = json.dumps(_one_of([_call_schema(t) for t in tools]), separators=(",", ":"))
    start = 'start: tool_call ("\\n" tool_call)*' if parallel else "start: tool_call"
    return (f"{start}\n"
            f'tool_call: {marker(_OPEN)} "\\n" tool_json "\\n" {marker(_CLOSE)}\n'
            f"tool_json: %json {body}\n")


# ----------------------------------------------------------------------------------- the JSON reader

_WS = " \t\n\r"
_LITERAL = frozenset("-+.0123456789eEtrufalsn")
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}


class _JsonError(ValueError):
    """Text that is not JSON; `at` is the index of the offending character in the text fed."""
    at = 0


class _JsonReader:
    """An incremental JSON reader: `feed(text)` reports to a sink, character by character.

    sink.start(path, kind)   a value begins ("obj" | "arr" | "str" | "lit") at path (keys / indices)
    sink.chars(path, text)   decoded characters of a string value
    sink.raw(path, text)     the value's text, whitespace outside strings dropped; structural
                             characters and keys belong to their container's path
    sink.end(path)           the value at path is complete
    `done` once the top value is complete; `feed` returns the index after it (the rest is not read).
    Raises _JsonError on text that is not JSON.
    """

    def __init__(self, sink: Any) -> None:
        self.sink = sink
        self.frames: list[list[Any]] = []  # [kind "{" | "[", path, key or index]
        self.mode = "value"
        self.done = False
        self.key: list[str] | None = None   # the key being read, or None in a string value
        self.esc: str | None = None         # None, "" after a backslash, or "u" + hex digits
        self.high: str | None = None        # a high surrogate waiting for its pair
        self.lit: list[str] = []
        self._at = 0

    def _value_path(self) -> tuple[Any, ...]:
        if not self.frames:
            return ()
        _, path, key = self.frames[-1]
        return (*path, key)

    def _container_path(self) -> tuple[Any, ...]:
        return self.frames[-1][1] if self.frames else ()

    def _end_value(self, path: tuple[Any, ...]) -> None:
        self.sink.end(path)
        if not self.frames:
            self.done = True
            self.mode = "done"
        else:
            self.mode = "comma"

    def _begin(self, ch: str) -> None:
        path = self._value_path()
        if ch == "{":
            self.sink.start(path, "obj")
            self.sink.raw(path, ch)
            self.frames.append(["{", path, None])
            self.mode = "key_or_end"
        elif ch == "[":
            self.sink.start(path, "arr")
            self.sink.raw(path, ch)
            self.frames.append(["[", path, 0])
            self.mode = "value_or_end"
        elif ch == '"':
            self.sink.start(path, "str")
            self.sink.raw(path, ch)
            self.key = None
            self.mode = "string"
        elif ch in _LITERAL:
            self.sink.start(path, "lit")
            self.lit = [ch]
            self.mode = "literal"
        else:
            raise _JsonError(f"unexpected {ch!r} where a JSON value starts")

    def _string_char(self, ch: str) -> None:
        """One character inside a string (key or value)."""
        if self.esc is None:
            if ch == "\\":
                self.esc = ""
                self._raw_in_string(ch)
                return
            if ch == '"':
                self._close_string()
                return
            if ch < " ":
                raise _JsonError(f"control character {ch!r} in a JSON string")
            self._raw_in_string(ch)
            self._decoded(ch)
            return
        self._raw_in_string(ch)
        if self.esc == "":
            if ch == "u":
                self.esc = "u"
                return
            if ch not in _ESCAPES:
                raise _JsonError(f"bad escape \\{ch} in a JSON string")
            self.esc = None
            self._decoded(_ESCAPES[ch])
            return
        if ch not in string.hexdigits:
            raise _JsonError(f"bad \\u escape in a JSON string: {ch!r}")
        self.esc += ch
        if len(self.esc) == 5:
            self._decoded(chr(int(self.esc[1:], 16)))
            self.esc = None

    def _decoded(self, c: str) -> None:
        if self.high is not None:
            high, self.high = self.high, None
            if "\udc00" <= c <= "\udfff":
                c = chr(0x10000 + ((ord(high) - 0xD800) << 10) + (ord(c) - 0xDC00))
            else:
                self._out("\ufffd")
        if "\ud800" <= c <= "\udbff":
            self.high = c
            return
        if "\udc00" <= c <= "\udfff":
            c = "\ufffd"
        self._out(c)

    def _out(self, c: str) -> None:
        if self.key is not None:
            self.key.append(c)
        else:
            self.sink.chars(self._value_path(), c)

    def _raw_in_string(self, ch: str) -> None:
        self.sink.raw(self._container_path() if self.key is not None else self._value_path(), ch)

    def _close_string(self) -> None:
        if self.high is not None:
            self.high = None
            self._out("\ufffd")
        if self.key is not None:
            self.sink.raw(self._container_path(), '"')
            self.frames[-1][2] = "".join(self.key)
            self.key = None
            self.mode = "colon"
            return
        path = self._value_path()
        self.sink.raw(path, '"')
        self._end_value(path)

    def _close_literal(self) -> None:
        text = "".join(self.lit)
        try:
            json.loads(text)
        except ValueError:
            raise _JsonError(f"bad JSON literal {text!r}") from None
        path = self._value_path()
        self.sink.raw(path, text)
        self._end_value(path)

    def feed(self, text: str) -> int:
        """Read `text`; return how much of it belongs to the JSON value (all of it until it is done)."""
        try:
            return self._feed(text)
        except _JsonError as e:
            e.at = self._at
            raise

    def _feed(self, text: str) -> int:
        for i, ch in enumerate(text):
            self._at = i
            mode = self.mode
            if mode == "string":
                self._string_char(ch)
                continue
            if mode == "literal":
                if ch in _LITERAL:
                    self.lit.append(ch)
                    continue
                self._close_literal()
                mode = self.mode
            if mode == "done":
                return i
            if ch in _WS:
                continue
            if mode == "value":
                self._begin(ch)
            elif mode in ("key_or_end", "key"):
                if ch == "}" and mode == "key_or_end":
                    self._close_container("{")
                elif ch == '"':
                    self.sink.raw(self._container_path(), ch)
                    self.key = []
                    self.mode = "string"
                else:
                    raise _JsonError(f"unexpected {ch!r} where a key is expected")
            elif mode == "colon":
                if ch != ":":
                    raise _JsonError(f"unexpected {ch!r} where ':' is expected")
                self.sink.raw(self._container_path(), ch)
                self.mode = "value"
            elif mode == "value_or_end":
                if ch == "]":
                    self._close_container("[")
                else:
                    self._begin(ch)
            elif mode == "comma":
                kind = self.frames[-1][0]
                if ch == ",":
                    self.sink.raw(self._container_path(), ch)
                    if kind == "[":
                        self.frames[-1][2] += 1
                        self.mode = "value"
                    else:
                        self.mode = "key"
                elif ch == ("}" if kind == "{" else "]"):
                    self._close_container(kind)
                else:
                    raise _JsonError(f"unexpected {ch!r} after a value")
        return len(text)

    def _close_container(self, kind: str) -> None:
        frame = self.frames.pop()
        assert frame[0] == kind
        self.sink.raw(frame[1], "}" if kind == "{" else "]")
        self._end_value(frame[1])

    def finish(self) -> None:
        """The text ended: a top-level number or literal is complete now."""
        if self.mode == "literal":
            self._close_literal()


# ------------------------------------------------------------------------------------------ streams

class _Out:
    """The deltas of one push: consecutive content, and argument pieces of one call, are merged."""

    def __init__(self) -> None:
        self.items: list[list[Any]] = []  # ["content", [pieces]] | ["head", entry] | ["args", index, [pieces]]

    def content(self, text: str) -> None:
        if not text:
            return
        if self.items and self.items[-1][0] == "content":
            self.items[-1][1].append(text)
        else:
            self.items.append(["content", [text]])

    def head(self, index: int, id_: str, name: str) -> None:
        self.items.append(["head", {"index": index, "id": id_, "type": "function",
                                    "function": {"name": name, "arguments": ""}}])

    def args(self, index: int, text: str) -> None:
        if not text:
            return
        if self.items and self.items[-1][0] == "args" and self.items[-1][1] == index:
            self.items[-1][2].append(text)
        else:
            self.items.append(["args", index, [text]])

    def take(self) -> list[Delta]:
        out: list[Delta] = []
        for item in self.items:
            if item[0] == "content":
                out.append({"content": "".join(item[1])})
            elif item[0] == "head":
                out.append({"tool_calls": [item[1]]})
            else:
                out.append({"tool_calls": [{"index": item[1], "function": {"arguments": "".join(item[2])}}]})
        self.items = []
        return out


class _Call:
    """One call object being read: the name first, then the arguments (held until the name is known)."""

    def __init__(self, stream: ToolStream) -> None:
        self.stream = stream
        self.index: int | None = None
        self.name: list[str] = []
        self.held: list[str] = []
        self.has_args = False

    def start(self, rel: tuple[Any, ...]) -> None:
        if rel == ("arguments",):
            self.has_args = True

    def chars(self, rel: tuple[Any, ...], text: str) -> None:
        if rel == ("name",) and self.index is None:
            self.name.append(text)

    def raw(self, rel: tuple[Any, ...], text: str) -> None:
        if rel[:1] == ("arguments",):
            if self.index is None:
                self.held.append(text)
            else:
                self.stream._out.args(self.index, text)

    def end(self, rel: tuple[Any, ...]) -> None:
        if rel == ("name",) and self.index is None:
            self.index = self.stream._open_call("".join(self.name))
            self.stream._out.args(self.index, "".join(self.held))
            self.held = []
        elif rel == () and self.index is not None and not self.has_args:
            self.stream._out.args(self.index, "{}")


class ToolStream:
    """Reads a tool-calling output in pieces: `push(piece)` and `finish()` return OpenAI deltas.

    One stream per output; `ToolPlan.parse` is this reader run over the whole text.
    """

    def __init__(self, plan: ToolPlan) -> None:
        self._plan = plan
        self._out = _Out()
        self._n_calls = 0
        self._finished = False

    def _open_call(self, name: str) -> int:
        index = self._n_calls
        self._n_calls += 1
        self._out.head(index, self._plan._call_id(index), name)
        return index

    def push(self, piece: str) -> list[Delta]:
        """The deltas made certain by `piece` (possibly none)."""
        if self._finished:
            raise ValueError("push() after finish() on a ToolStream")
        if piece:
            self._read(piece)
        return self._out.take()

    def finish(self) -> list[Delta]:
        """The output ended: the deltas still held back."""
        if self._finished:
            raise ValueError("finish() called twice on a ToolStream")
        self._finished = True
        self._end()
        return self._out.take()

    def _read(self, piece: str) -> None:
        self._out.content(piece)

    def _end(self) -> None:
        pass


class _GenericStream(ToolStream):
    """llama.cpp's generic JSON answer: "response" decoded as content, "tool_call(s)" as calls."""

    def __init__(self, plan: ToolPlan) -> None:
        super().__init__(plan)
        self._json: _JsonReader | None = None
        self._plain = False       # not JSON: everything is content
        self._lead: list[str] = []  # whitespace before the first character
        self._calls: dict[tuple[Any, ...], _Call] = {}

    def _read(self, piece: str) -> None:
        if self._plain:
            self._out.content(piece)
            return
        if self._json is None:
            body = piece.lstrip(_WS)
            if not body:
                self._lead.append(piece)
                return
            if body[0] != "{":
                self._plain = True
                self._out.content("".join(self._lead) + piece)
                self._lead = []
                return
            self._json = _JsonReader(self)
            piece = body
        if self._json.done:
            return
        try:
            self._json.feed(piece)
        except _JsonError as e:
            log.warning("tool calling: the output is not the generic JSON format (%s); the rest is content", e)
            self._plain = True
            self._out.content(piece[e.at:])

    def _end(self) -> None:
        if self._json is None:
            self._out.content("".join(self._lead))
            return
        if not self._plain and not self._json.done:
            try:
                self._json.finish()
            except _JsonError:
                pass

    def _route(self, path: tuple[Any, ...]) -> tuple[_Call | None, tuple[Any, ...]]:
        if len(path) >= 2 and path[0] == "tool_calls" and isinstance(path[1], int):
            head, rel = path[:2], path[2:]
        elif path[:1] == ("tool_call",):
            head, rel = path[:1], path[1:]
        else:
            return None, ()
        call = self._calls.get(head)
        if call is None:
            call = self._calls[head] = _Call(self)
        return call, rel

    # the JSON reader's sink
    def start(self, path: tuple[Any, ...], kind: str) -> None:
        call, rel = self._route(path)
        if call is not None:
            call.start(rel)

    def chars(self, path: tuple[Any, ...], text: str) -> None:
        if path == ("response",):
            self._out.content(text)
            return
        call, rel = self._route(path)
        if call is not None:
            call.chars(rel, text)

    def raw(self, path: tuple[Any, ...], text: str) -> None:
        call, rel = self._route(path)
        if call is not None:
            call.raw(rel, text)

    def end(self, path: tuple[Any, ...]) -> None:
        call, rel = self._route(path)
        if call is not None:
            call.end(rel)


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that is a proper start of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class _HermesStream(ToolStream):
    """Text with ``<tool_call>\\n{"name", "arguments"}\\n</tool_call>`` blocks (Hermes 2 Pro, Qwen 2.5)."""

    def __init__(self, plan: ToolPlan) -> None:
        super().__init__(plan)
        self._state = "text"          # "text" | "json" | "close" | "plain"
        self._held: list[str] = []    # text not yet certain
        self._after_block = False     # whitespace here touches a block: dropped
        self._json: _JsonReader | None = None
        self._call: _Call | None = None

    def _read(self, piece: str) -> None:
        while piece:
            if self._state == "plain":
                self._out.content(piece)
                return
            if self._state == "text":
                piece = self._text(piece)
            elif self._state == "json":
                piece = self._block(piece)
            else:
                piece = self._closing(piece)

    def _text(self, piece: str) -> str:
        buf = "".join(self._held) + piece
        self._held = []
        if self._after_block:
            buf = buf.lstrip(_WS)
            if not buf:
                return ""
            self._after_block = False
        at = buf.find(_OPEN)
        if at >= 0:
            self._out.content(buf[:at].rstrip(_WS))
            self._state = "json"
            self._json = _JsonReader(self)
            self._call = _Call(self)
            return buf[at + len(_OPEN):]
        keep = _partial_suffix(buf, _OPEN)
        sure = buf[:len(buf) - keep]
        body = sure.rstrip(_WS)
        self._out.content(body)
        self._held = [sure[len(body):], buf[len(buf) - keep:]]
        return ""

    def _block(self, piece: str) -> str:
        assert self._json is not None
        try:
            used = self._json.feed(piece)
        except _JsonError as e:
            log.warning("tool calling: a <tool_call> block is not JSON (%s); the rest is content", e)
            self._state = "plain"
            return piece[e.at:]
        if self._json.done:
            self._state = "close"
            return piece[used:]
        return ""

    def _closing(self, piece: str) -> str:
        buf = ("".join(self._held) + piece).lstrip(_WS)
        self._held = []
        if buf.startswith(_CLOSE):
            self._state = "text"
            self._after_block = True
            return buf[len(_CLOSE):]
        if _CLOSE.startswith(buf):
            self._held = [buf]
            return ""
        log.warning("tool calling: a tool call is not closed by %s; the rest is content", _CLOSE)
        self._state = "text"
        return buf

    def _end(self) -> None:
        if self._state == "text":
            rest = "".join(self._held)
            self._out.content(rest.lstrip(_WS) if self._after_block else rest)
        elif self._state == "json" and self._json is not None:
            try:
                self._json.finish()
            except _JsonError:
                pass
        self._held = []

    # the JSON reader's sink: a block holds one call object
    def start(self, path: tuple[Any, ...], kind: str) -> None:
        assert self._call is not None
        if path == () and kind != "obj":
            raise _JsonError("a tool call must be a JSON object")
        self._call.start(path)

    def chars(self, path: tuple[Any, ...], text: str) -> None:
        assert self._call is not None
        self._call.chars(path, text)

    def raw(self, path: tuple[Any, ...], text: str) -> None:
        assert self._call is not None
        self._call.raw(path, text)

    def end(self, path: tuple[Any, ...]) -> None:
        assert self._call is not None
        self._call.end(path)


_STREAMS: dict[str, type[ToolStream]] = {"content": ToolStream, "generic": _GenericStream, "hermes": _HermesStream}

_ID_ALPHABET = string.ascii_letters + string.digits


# --------------------------------------------------------------------------------------------- plan

@dataclass(frozen=True)
class ToolPlan:
    """A tool-calling request, ready: the prompt, the constraint, and the readers of the output.

    Attributes:
        format: "generic" | "hermes" | "content" (see the module docstring).
        prompt: the text to tokenize (with parse_special=True).
        schema: the JSON schema the output must follow, or None.
        lark: an llguidance lark grammar the output must follow, or None (never both).
        tools: the validated tools, as [{"name", "description"?, "parameters"}].
        tool_choice: "auto" | "none" | "required" | "named".
        tool_name: the function of a named tool_choice, else None.
        parallel_tool_calls: several calls allowed in one answer (False when asked for but the
            template cannot render two calls in one turn, as llama.cpp decides).
    """
    format: str
    prompt: str
    schema: dict[str, Any] | None
    lark: str | None
    tools: tuple[dict[str, Any], ...]
    tool_choice: str
    tool_name: str | None
    parallel_tool_calls: bool
    _ids: list[str] = field(default_factory=list, repr=False, compare=False)

    def _call_id(self, index: int) -> str:
        while len(self._ids) <= index:
            self._ids.append("call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24)))
        return self._ids[index]

    def stream(self) -> ToolStream:
        """A reader for one output arriving in pieces."""
        return _STREAMS[self.format](self)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, tool_calls) of a finished output; content is None when it is empty and calls were made.

        The same reader as `stream()`, so the two always agree (ids included).
        """
        s = self.stream()
        deltas = s.push(text) + s.finish()
        content: list[str] = []
        calls: list[list[Any]] = []
        for d in deltas:
            if "content" in d:
                content.append(d["content"])
                continue
            for e in d["tool_calls"]:
                if "id" in e:
                    calls.append([e["id"], e["function"]["name"], []])
                calls[e["index"]][2].append(e["function"]["arguments"])
        tool_calls = [ToolCall(id_, name, "".join(args)) for id_, name, args in calls]
        text_out = "".join(content)
        return (None if not text_out and tool_calls else text_out), tool_calls


def prepare_template(template: str | None, messages: Sequence[Mapping[str, Any]], tools: Any,
                     tool_choice: Any = "auto", parallel_tool_calls: bool = True, *, bos_token: str = "",
                     eos_token: str = "", arch: str | None = None, special_tokens: Collection[str] = ()
                     ) -> ToolPlan:
    """`prepare` for a chat template given as text (a Jinja template, a built-in name, or None).

    Args:
        template: as `apply_chat_template`'s; the format is picked from its source.
        messages: OpenAI chat messages; assistant turns may carry `tool_calls` (content None), and
            `role: "tool"` turns `tool_call_id` / `name`.
        tools: OpenAI's [{"type": "function", "function": {"name", "description"?, "parameters"?}}].
        tool_choice: "auto" | "none" | "required" | {"type": "function", "function": {"name": N}}.
        parallel_tool_calls: allow several calls in one answer; as in llama.cpp, only when the
            template can render an assistant turn with two calls (else the plan's is False).
        bos_token, eos_token, arch: as `apply_chat_template`'s.
        special_tokens: format markers (``<tool_call>``, ``</tool_call>``) that are control tokens
            of the vocabulary: a lark grammar names them as tokens.
    Returns:
        The ToolPlan.
    Raises:
        ValueError: malformed tools, tool_choice (an unknown function is named) or messages; a
            template that fails to render (ChatTemplateError).
    """
    checked = _check_tools(tools)
    names = [t["name"] for t in checked]
    mode, name = _check_choice(tool_choice, names)
    if not isinstance(parallel_tool_calls, bool):
        raise ValueError(f"parallel_tool_calls must be a bool, not {type(parallel_tool_calls).__name__}")
    msgs = _check_messages(messages)
    caps = _caps(template, bos_token, eos_token, arch)
    if parallel_tool_calls and not caps.parallel_tool_calls:
        log.debug("tool calling: the chat template cannot show parallel tool calls: one call per answer")
        parallel_tool_calls = False
    schema = lark = None
    if mode == "none" or not checked:
        fmt = "content"
        prompt = _render(template, msgs, None, caps, bos_token, eos_token, arch)
    elif template and "<tool_call>" in template:
        fmt = "hermes"
        prompt = _render(template, msgs, list(tools), caps, bos_token, eos_token, arch)
        if mode != "auto":
            lark = _hermes_lark([t for t in checked if name is None or t["name"] == name], parallel_tool_calls,
                                special_tokens)
    else:
        fmt = "generic"
        if caps.tools or caps.tool_calls:
            log.info("tool calling: this chat template has its own tool-call syntax, not implemented here; "
                     "using llama.cpp's generic JSON format")
        prompt = _render(template, _add_system(msgs, GENERIC_SYSTEM), list(tools), caps, bos_token, eos_token,
                         arch)
        schema = _generic_schema([t for t in checked if name is None or t["name"] == name], mode,
                                 parallel_tool_calls)
    return ToolPlan(fmt, prompt, schema, lark, tuple(checked), mode, name, parallel_tool_calls)


def prepare(model: ModelInfo, messages: Sequence[Mapping[str, Any]], tools: Any, tool_choice: Any = "auto",
            parallel_tool_calls: bool = True) -> ToolPlan:
    """The tool-calling plan of a conversation for `model` (its GGUF chat template, or its built-in one).

    See `prepare_template` for the arguments and errors.
    """
    tok = model.tokenizer
    bos = tok.token_text(model.bos) if model.bos is not None and model.bos >= 0 else ""
    eos = tok.token_text(model.eos) if model.eos is not None and model.eos >= 0 else ""
    special = []
    for marker in (_OPEN, _CLOSE):
        ids = model.tokenize(marker, add_special=False, parse_special=True)
        if len(ids) == 1 and tok.is_control(ids[0]):
            special.append(marker)
    return prepare_template(model.chat_template, messages, tools, tool_choice, parallel_tool_calls,
                            bos_token=bos, eos_token=eos, arch=model.arch, special_tokens=special)
