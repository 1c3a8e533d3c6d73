"""What constrains a request's output, from the fields clients send (-> a llamax.Grammar).

    response_format {"type": "text"}                          nothing
    response_format {"type": "json_object"}                   a JSON object ("schema" inside: that
                                                              schema, as llama-server takes it)
    response_format {"type": "json_schema", "json_schema":    the schema (strict or not: the grammar
                     {"name", "schema", "strict"}}            enforces it either way)
    json_schema (llama-server)                                the schema
    grammar (llama-server)                                    GBNF, llama.cpp's grammar format ("": none)

A schema's objects with `properties` and no `additionalProperties` are closed (no other keys), as
llama.cpp's json-schema-to-grammar makes them: llama-server's clients get the same outputs here. The
same holds for the `parameters` of tools (llamax.tools closes them; `check_tools` refuses one that does
not compile): a call's arguments have the tool's keys only.
At most one of them may be given. Each is compiled once per model vocabulary (llamax.grammar's
cache), when the request is submitted; one that does not compile is the client's error.
"""
from __future__ import annotations

from typing import Any

from llamax.grammar import Grammar, closed


class FieldError(ValueError):
    """A request field that cannot be honoured as given; the message names the problem."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def _schema(field: str, schema: Any) -> Grammar:
    if not isinstance(schema, (dict, bool)):
        raise FieldError(field, f"{field}: a JSON schema is an object, not {type(schema).__name__}")
    if schema is False:
        raise FieldError(field, f"{field}: the schema false accepts no output")
    try:
        return Grammar.json_schema(closed(schema) if isinstance(schema, dict) else {})
    except ValueError as e:
        raise FieldError(field, f"{field}: invalid JSON schema: {e}") from None


def grammar_of(response_format: dict | None, json_schema: Any = None, grammar: str | None = None) -> Grammar | None:
    """The Grammar the fields ask for, or None.

    Raises:
        FieldError: an unknown response_format type, a schema or grammar that does not compile, or
            two of the fields at once."""
    grammar = grammar or None  # llama-server's clients send "" for none
    given = [n for n, v in (("response_format", response_format and response_format.get("type", "text") != "text"),
                            ("json_schema", json_schema is not None), ("grammar", grammar is not None)) if v]
    if len(given) > 1:
        raise FieldError(given[1], f"{given[0]} and {given[1]}: give one constraint on the output, not both")
    if grammar is not None:
        try:
            return Grammar.gbnf(grammar)
        except ValueError as e:
            raise FieldError("grammar", f"grammar: invalid GBNF: {e}") from None
    if json_schema is not None:
        return _schema("json_schema", json_schema)
    if not response_format:
        return None
    kind = response_format.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        schema = response_format.get("schema")
        return _schema("response_format", schema) if schema is not None else Grammar.json_schema({"type": "object"})
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec and "name" not in spec:
            raise FieldError("response_format", 'response_format: json_schema needs {"json_schema": {"name": ..., '
                             '"schema": {...}}}')
        return _schema("response_format", spec.get("schema", {}))
    raise FieldError("response_format", f'response_format: type {kind!r}: one of "text", "json_object", "json_schema"')


def check_tools(tools: list) -> None:
    """Each function's `parameters` must compile as the constraint of its arguments (closed, as the
    tool layer uses them). Entries of other shapes are left to the Engine's tool checks, which name them.

    Raises:
        FieldError: a tool's parameters are not a JSON schema llguidance takes (field "tools")."""
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        params = fn.get("parameters") if isinstance(fn, dict) else None
        if not isinstance(params, dict):
            continue
        try:
            Grammar.json_schema(closed(params))
        except (ValueError, TypeError) as e:
            raise FieldError("tools", f"tools[{i}].function.parameters: invalid JSON schema: {e}") from None
