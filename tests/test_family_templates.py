"""The model families' real chat templates rendered by llamax.model.chat, held against llama-cpp-python.

The templates (tests/data/families_tok/templates/, copied from llama.cpp's models/templates) are the ones
the families' GGUFs carry: Qwen2.5, Qwen3, DeepSeek-R1-Distill-Qwen, Llama 3.1 / 3.2, Phi-3.5, Gemma 2,
SmolLM3, Granite 3.3. chat.json (made by record.py there) holds what llama-cpp-python's Jinja2ChatFormatter
rendered for each conversation (system+user+assistant+user, without a system turn, with tools and a tool
call / tool result, with enable_thinking=False), with and without add_generation_prompt, the clock fixed
at the recorded date; a template that raises (Gemma 2 has no system role) is recorded with its message.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest

from llamax.model.chat import ChatTemplateError, apply_chat_template

DATA = Path(__file__).parent / "data" / "families_tok"
REF = json.loads((DATA / "chat.json").read_text())
DATE = datetime.fromisoformat(REF["date"])

FAMILIES = ["Qwen-Qwen2.5-7B-Instruct", "Qwen-Qwen3-0.6B", "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
            "meta-llama-Llama-3.1-8B-Instruct", "meta-llama-Llama-3.2-3B-Instruct", "microsoft-Phi-3.5-mini-instruct",
            "google-gemma-2-2b-it", "HuggingFaceTB-SmolLM3-3B", "ibm-granite-granite-3.3-2B-Instruct"]
TOOL_TEMPLATES = ["Qwen-Qwen2.5-7B-Instruct", "Qwen-Qwen3-0.6B", "meta-llama-Llama-3.1-8B-Instruct",
                  "meta-llama-Llama-3.2-3B-Instruct", "ibm-granite-granite-3.3-2B-Instruct"]


def _template(name: str) -> str:
    return (DATA / "templates" / f"{name}.jinja").read_text()


def _fixed_clock(fmt: str) -> str:
    return DATE.strftime(fmt)


def _render(name: str, conversation: str, add_generation_prompt: bool, **extra) -> str:
    rec = REF["templates"][name]
    kwargs = dict(REF["conversations"][conversation])
    messages = kwargs.pop("messages")
    return apply_chat_template(_template(name), messages, add_generation_prompt=add_generation_prompt,
                               bos_token=rec["bos_token"], eos_token=rec["eos_token"], **kwargs, **extra)


def _cases():
    for name in FAMILIES:
        for key in REF["templates"][name]["rendered"]:
            yield pytest.param(name, key, id=f"{name}-{key}")


def test_the_recording_covers_every_family_and_conversation():
    assert sorted(REF["templates"]) == sorted(FAMILIES)
    for name in FAMILIES:
        assert (DATA / "templates" / f"{name}.jinja").is_file()
        keys = REF["templates"][name]["rendered"]
        assert {f"{c}/{g}" for c in REF["conversations"] for g in ("gen", "nogen")} == set(keys)


@pytest.mark.parametrize("name,key", list(_cases()))
def test_template_renders_as_llama_cpp_python(name, key):
    conversation, gen = key.split("/")
    want = REF["templates"][name]["rendered"][key]
    if "error" in want:
        with pytest.raises(ChatTemplateError, match=want["error"]):
            _render(name, conversation, gen == "gen", strftime_now=_fixed_clock)
    else:
        assert _render(name, conversation, gen == "gen", strftime_now=_fixed_clock) == want["prompt"]


@pytest.mark.parametrize("name", TOOL_TEMPLATES)
def test_tools_reach_the_prompt(name):
    """The tool-aware templates put the tool's schema and the call's arguments in the prompt."""
    prompt = REF["templates"][name]["rendered"]["tools/gen"]["prompt"]
    assert "get_weather" in prompt and "Get the current weather in a city" in prompt
    assert _render(name, "tools", True, strftime_now=_fixed_clock) == prompt


@pytest.mark.parametrize("name,fmt", [("meta-llama-Llama-3.2-3B-Instruct", "%d %b %Y"),
                                      ("ibm-granite-granite-3.3-2B-Instruct", "%B %d, %Y")])
def test_strftime_now_is_todays_date_by_default(name, fmt):
    """Without a clock passed in, the templates that ask strftime_now get today's date."""
    before = datetime.now().strftime(fmt)
    prompt = _render(name, "user_assistant_user", True)
    after = datetime.now().strftime(fmt)
    assert before in prompt or after in prompt


def test_bad_messages_are_a_chat_template_error():
    with pytest.raises(ChatTemplateError):
        apply_chat_template(_template("Qwen-Qwen3-0.6B"), [{"role": "user"}])
    with pytest.raises(ChatTemplateError, match="alternate"):
        apply_chat_template(_template("google-gemma-2-2b-it"),
                            [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
