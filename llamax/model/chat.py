"""Chat templates: the GGUF's Jinja template, or one of llama.cpp's built-in ones by name.

`apply_chat_template(template, messages)` renders

  * a Jinja template (tokenizer.chat_template) the way Hugging Face's `apply_chat_template`
    does, and llama.cpp's `--jinja` path after it: a sandboxed, immutable jinja2 environment with
    trim_blocks and lstrip_blocks, the variables messages / add_generation_prompt / bos_token /
    eos_token (and any extra keyword), and the helpers templates expect: raise_exception(msg),
    strftime_now(fmt), and a tojson filter that keeps non-ASCII text;
  * a built-in template when `template` is one of `BUILTIN_TEMPLATES` (llama.cpp's
    llm_chat_apply_template, e.g. "chatml", "gemma"), or when there is no template at all: then
    the model's architecture picks one ("gemma" for Gemma models, otherwise "chatml", llama.cpp's
    fallback).

`detect_builtin(template)` is llama.cpp's heuristic (llm_chat_detect_template) restricted to the
built-ins implemented here.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

__all__ = [
    "BUILTIN_TEMPLATES",
    "ChatTemplateError",
    "apply_chat_template",
    "builtin_for_arch",
    "detect_builtin",
    "render_builtin",
]


class ChatTemplateError(ValueError):
    """The template does not parse, raises (raise_exception), or the messages are malformed."""


_C_SPACE = " \t\n\v\f\r"


def _trim(s: str) -> str:
    """llama-chat.cpp's trim(): C isspace() from both ends (ASCII whitespace only)."""
    return s.strip(_C_SPACE)


Message = Mapping[str, Any]


def _chatml(msgs: Sequence[Message], add_ass: bool) -> str:
    out = [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in msgs]
    if add_ass:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


def _gemma(msgs: Sequence[Message], add_ass: bool) -> str:
    # no system role in Gemma: the system text is merged into the next user turn
    out: list[str] = []
    system = ""
    for m in msgs:
        role = m["role"]
        if role == "system":
            system += _trim(m["content"])
            continue
        role = "model" if role == "assistant" else role
        out.append(f"<start_of_turn>{role}\n")
        if system and role != "model":
            out.append(system + "\n\n")
            system = ""
        out.append(_trim(m["content"]) + "<end_of_turn>\n")
    if add_ass:
        out.append("<start_of_turn>model\n")
    return "".join(out)


def _llama3(msgs: Sequence[Message], add_ass: bool) -> str:
    out = [f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{_trim(m['content'])}<|eot_id|>" for m in msgs]
    if add_ass:
        out.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
    return "".join(out)


def _phi3(msgs: Sequence[Message], add_ass: bool) -> str:
    out = [f"<|{m['role']}|>\n{m['content']}<|end|>\n" for m in msgs]
    if add_ass:
        out.append("<|assistant|>\n")
    return "".join(out)


def _zephyr(msgs: Sequence[Message], add_ass: bool) -> str:
    out = [f"<|{m['role']}|>\n{m['content']}<|endoftext|>\n" for m in msgs]
    if add_ass:
        out.append("<|assistant|>\n")
    return "".join(out)


#: llama.cpp's built-in templates implemented here, by llama.cpp's name.
BUILTIN_TEMPLATES: dict[str, Callable[[Sequence[Message], bool], str]] = {
    "chatml": _chatml,
    "gemma": _gemma,
    "llama3": _llama3,
    "phi3": _phi3,
    "zephyr": _zephyr,
}


def detect_builtin(template: str) -> str | None:
    """llm_chat_detect_template for the built-ins above: a name, or None if none fits.

    A template that is itself a built-in name is that template; otherwise marker strings decide,
    in llama.cpp's order (so e.g. a ChatML template that also mentions <|im_sep|> or
    <end_of_utterance>, which llama.cpp maps to phi4 / smolvlm, is not taken for "chatml").
    """
    if template in BUILTIN_TEMPLATES:
        return template
    has = template.__contains__
    if has("<|im_start|>"):
        return None if has("<|im_sep|>") or has("<end_of_utterance>") else "chatml"
    if template.startswith("mistral") or has("[INST]"):
        return None
    if has("<|assistant|>") and has("<|end|>"):
        return "phi3"
    if has("[gMASK]<sop>") or (has("<|assistant|>") and has("<|user|>")):
        return None
    if has("<|{{ item['role'] }}|>") and has("<|begin_of_image|>"):
        return None
    if has("<|user|>") and has("<|endoftext|>"):
        return "zephyr"
    if has("bos_token + message['role']"):
        return None
    if has("<start_of_turn>"):
        return "gemma"
    if (has("'\\n\\nAssistant: ' + eos_token") or has("GPT4 Correct ") or (has("USER: ") and has("ASSISTANT: "))
            or (has("### Instruction:") and has("<|EOT|>"))
            or (has("<|START_OF_TURN_TOKEN|>") and has("<|USER_TOKEN|>"))):
        return None
    if has("<|start_header_id|>") and has("<|end_header_id|>"):
        return "llama3"
    return None


def builtin_for_arch(arch: str | None) -> str:
    """The built-in used when a GGUF has no template: "gemma" for Gemma models, else "chatml"."""
    return "gemma" if arch and arch.startswith("gemma") else "chatml"


def _check_messages(messages: Any) -> list[dict[str, Any]]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ChatTemplateError(f"messages must be a list of {{'role': ..., 'content': ...}} dicts, "
                                f"not {type(messages).__name__}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise ChatTemplateError(f"message {i} must be a mapping with 'role' and 'content', got {m!r}")
        out.append(dict(m))
    return out


def render_builtin(name: str, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
    """llm_chat_apply_template with a built-in template (contents must be strings).

    Raises:
        ChatTemplateError: unknown name or malformed messages.
    """
    fn = BUILTIN_TEMPLATES.get(name)
    if fn is None:
        raise ChatTemplateError(f"no built-in chat template {name!r} (available: {', '.join(BUILTIN_TEMPLATES)})")
    msgs = _check_messages(messages)
    for i, m in enumerate(msgs):
        if not isinstance(m["content"], str) or not isinstance(m["role"], str):
            raise ChatTemplateError(f"message {i}: the built-in template {name!r} needs string role and content")
    return fn(msgs, add_generation_prompt)


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def _compile(template: str) -> Any:
    try:
        from jinja2 import TemplateError
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as e:  # pragma: no cover - jinja2 is a dependency
        raise ChatTemplateError("rendering a Jinja chat template needs the jinja2 package (pip install jinja2)") from e
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except TemplateError as e:
        raise ChatTemplateError(f"cannot parse the chat template: {e}") from e


def apply_chat_template(template: str | None, messages: Sequence[Message], add_generation_prompt: bool = True,
                        bos_token: str = "", eos_token: str = "", arch: str | None = None,
                        **kwargs: Any) -> str:
    """The prompt text of a conversation.

    Args:
        template: the GGUF's tokenizer.chat_template (Jinja), a built-in name, or None/"" (then
            the built-in `builtin_for_arch(arch)`).
        messages: [{"role": "system" | "user" | "assistant" | ..., "content": str}, ...].
        add_generation_prompt: end with the opening of an assistant turn.
        bos_token, eos_token: the texts the Jinja template may insert (the tokenizer's).
        arch: the model architecture, to pick a built-in when there is no template.
        **kwargs: more variables for a Jinja template (tools, documents, ...).
    Returns:
        The rendered text; tokenize it with parse_special=True.
    Raises:
        ChatTemplateError: the template does not parse or raises, or malformed messages.
    """
    if not template:
        return render_builtin(builtin_for_arch(arch), messages, add_generation_prompt)
    if template in BUILTIN_TEMPLATES:
        return render_builtin(template, messages, add_generation_prompt)
    msgs = _check_messages(messages)
    compiled = _compile(template)
    from jinja2 import TemplateError

    try:
        return compiled.render(messages=msgs, add_generation_prompt=add_generation_prompt,
                               bos_token=bos_token, eos_token=eos_token, **kwargs)
    except TemplateError as e:
        raise ChatTemplateError(f"chat template error: {e}") from e
