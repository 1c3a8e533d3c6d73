"""The request bodies of the HTTP server (pydantic models), checked before anything reaches the Engine.

Field names and meanings are OpenAI's (/v1/completions, /v1/chat/completions) with llama-server's
extensions (top_k, min_p, repeat_penalty, repeat_last_n, n_keep, n_predict, n_probs, ignore_eos,
id_slot, cache_prompt, grammar, json_schema, timings_per_token, return_progress; /tokenize,
/detokenize, /slots, /apply-template).
Unknown fields are ignored, as OpenAI-compatible servers do, so clients that send more than we use
still work; a field OpenAI or llama-server knows but this server cannot honour (suffix, best_of,
mirostat, ...: NOOP below) set to anything but its no-op value is refused with 400 naming it rather
than silently dropped.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

MAX_STOPS = 16          # stop strings per request
MAX_STOP_CHARS = 256    # characters per stop string
MAX_CHOICES = 16        # n, and prompts per /v1/completions body
MAX_SEED = 2**63 - 1
MAX_LOGPROBS = 20       # alternatives per token (OpenAI's top_logprobs limit)
BIAS_BAN = -100.0       # OpenAI's logit_bias: -100 bans the token

TokenList = list[Annotated[int, Field(ge=0)]]


class _Body(BaseModel):
    # strict: no "1" for 1 or 1.5 for an int (a float field still takes an int); unknown keys ignored
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


# llama-server's default sampler chain (its `samplers` field), as names or as its letters: with the
# samplers this server lacks at their no-op values it is the chain the Engine runs
DEFAULT_SAMPLERS = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
DEFAULT_SAMPLER_CHARS = "edskypmxt"


def _off(*noop) -> Callable[[Any, Any], bool]:
    """A no-op check: the value is absent or one of noop (a bool only as itself: false is not 0)."""
    return lambda v, body: v is None or any(v == x and type(v) is not bool or v is x for x in noop)


def _falsy(v, body) -> bool:
    """A no-op check: absent, empty or false."""
    return not v


def _le0(v, body) -> bool:
    """A no-op check: absent or a number <= 0 (llama-server's "off")."""
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and v <= 0)


def _any(v, body) -> bool:
    """Always a no-op: it tunes a sampler that is off unless another field turns it on (that field is checked)."""
    return True


# Fields of llama-server's /completion and /v1/chat/completions (server-task.cpp's params_from_json_cmpl,
# utils' oaicompat_chat_params_parse) and of OpenAI's API that this server does not implement: each with
# what makes its value a no-op (None: absent). Any other value answers 400 naming the field. Not here:
# speculative.n_min / n_max / p_min, which tune the server's speculative decoding (--spec-type; ignored
# without it, as llama-server does), and OpenAI's hints (user, store, metadata, service_tier, prediction).
NOOP: dict[str, Callable[[Any, Any], bool]] = {
    # constrained output and probabilities
    "grammar_lazy": _off(False), "grammar_triggers": _falsy, "preserved_tokens": _falsy,
    "post_sampling_probs": _off(False),
    # samplers
    "mirostat": _off(0), "mirostat_tau": _any, "mirostat_eta": _any,
    "typical_p": _off(1, 1.0), "top_n_sigma": _le0, "xtc_probability": _off(0, 0.0), "xtc_threshold": _any,
    "dynatemp_range": _off(0, 0.0), "dynatemp_exponent": _any,
    "dry_multiplier": _off(0, 0.0), "dry_base": _any, "dry_allowed_length": _any, "dry_penalty_last_n": _any,
    "dry_sequence_breakers": _any,
    "penalize_nl": _off(False), "min_keep": _off(0),
    "samplers": lambda v, body: v is None or v == DEFAULT_SAMPLER_CHARS or (
        isinstance(v, list) and tuple(v) == DEFAULT_SAMPLERS),
    # generation control and response shape
    "n_indent": _off(0), "n_discard": _off(0), "t_max_predict_ms": _le0, "t_max_prompt_ms": _le0,
    "return_tokens": _off(False), "response_fields": _falsy, "verbose": _off(False), "n_cmpl": _off(1),
    "lora": _falsy, "multimodal_data": _falsy,
    # chat parsing and templating
    "chat_template_kwargs": _falsy, "add_generation_prompt": _off(True), "reasoning_format": _off("none"),
    "chat_format": _off(), "reasoning_in_content": _off(False), "thinking_forced_open": _off(False),
    "parse_tool_calls": _off(False),
    # OpenAI's
    "functions": _falsy, "function_call": _off("none", "auto"), "modalities": _off(["text"]), "audio": _off(),
    "web_search_options": _off(),
}


class Sampling(_Body):
    """What /v1/completions and /v1/chat/completions share."""

    model_config = ConfigDict(extra="allow")  # kept (model_extra) to find the NOOP fields set; else unused

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=-1)
    n_predict: int | None = Field(default=None, ge=-1)  # llama-server's max_tokens (wins over it)
    # llama-server's sampling defaults (a client that sends nothing gets what llama-server gives)
    temperature: float = Field(default=0.8, ge=0.0, le=2.0)
    top_p: float = Field(default=0.95, gt=0.0, le=1.0)
    top_k: int = Field(default=40, ge=0)                 # 0: off
    min_p: float = Field(default=0.05, ge=0.0, le=1.0)
    repeat_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    seed: int | None = Field(default=None, ge=-1, le=MAX_SEED)  # -1 or absent: fresh entropy
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    n_keep: int = Field(default=0, ge=-1)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    # llama-server's
    id_slot: int = Field(default=-1, ge=-1)           # -1: any slot
    cache_prompt: bool = True
    timings_per_token: bool = False
    return_progress: bool = False
    # penalties over the last repeat_last_n tokens (-1: all; 0: off) and biases, in the C sampler chain
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repeat_last_n: int = Field(default=64, ge=-1)
    logit_bias: dict[str, float] | None = None     # token id (as a string) -> bias in [-100, 100]; -100 bans
    # what the output must follow (one of them): an OpenAI response_format, llama-server's json_schema or GBNF
    response_format: dict[str, Any] | None = None
    json_schema: dict[str, Any] | bool | None = None
    grammar: str | None = None
    n_probs: int = Field(default=0, ge=0, le=MAX_LOGPROBS)  # llama-server's: alternatives per token
    # OpenAI fields with no effect here unless left at their no-op values (checked in unsupported())
    best_of: int | None = None

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        for key, bias in (v or {}).items():
            if not (key.isascii() and key.isdigit()):  # "²" is a digit to str.isdigit, not to int()
                raise ValueError(f"{key!r}: the keys are token ids (as strings, e.g. \"50256\")")
            if not BIAS_BAN <= bias <= 100.0:
                raise ValueError(f"token {key}: a bias in [-100, 100], not {bias}")
        return v

    def bias(self) -> dict[int, float] | None:
        """logit_bias as the Sampler takes it: int ids, -100 as -inf (a ban)."""
        if not self.logit_bias:
            return None
        return {int(k): float("-inf") if b <= BIAS_BAN else b for k, b in self.logit_bias.items()}

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOPS:
            raise ValueError(f"at most {MAX_STOPS} stop strings")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop string has at most {MAX_STOP_CHARS} characters")
        return stops

    def unsupported(self) -> str | None:
        """The first field set to something this server cannot do, or None."""
        if self.best_of not in (None, 1):
            return "best_of"
        for name, value in (self.model_extra or {}).items():
            noop = NOOP.get(name)
            if noop is not None and not noop(value, self):
                return name
        return None

    def asked_tokens(self) -> tuple[int | None, str]:
        """The most tokens asked for, and the field that asked (n_predict wins over max_tokens)."""
        if self.n_predict is not None:
            return self.n_predict, "n_predict"
        return self.max_tokens, "max_tokens"

    def engine_kwargs(self, max_tokens: int) -> dict:
        """Engine.submit's sampling keywords."""
        return dict(max_tokens=max_tokens, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                    min_p=self.min_p, repeat_penalty=self.repeat_penalty, presence_penalty=self.presence_penalty,
                    frequency_penalty=self.frequency_penalty, repeat_last_n=self.repeat_last_n,
                    logit_bias=self.bias(), stop=self.stop or None, n_keep=self.n_keep, ignore_eos=self.ignore_eos,
                    logprobs=self.n_logprobs(), cache_prompt=self.cache_prompt, slot=self.id_slot)

    def n_logprobs(self) -> int | None:
        """Alternatives per token when logprobs are asked for (None: not asked)."""
        return self.n_probs or None



Prompt = Union[str, list[str], TokenList, list[TokenList]]


class CompletionRequest(Sampling):
    prompt: Prompt
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # legacy: alternatives per token

    def n_logprobs(self) -> int | None:
        return self.logprobs if self.logprobs is not None else super().n_logprobs()

    def prompts(self) -> list:
        """One entry per prompt of the body: a str or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, list) for x in p):
            return list(p)
        if p and all(isinstance(x, str) for x in p):
            return list(p)
        return [p]  # one prompt of token ids (possibly empty: the Engine refuses it)

    def unsupported(self) -> str | None:
        if self.suffix:
            return "suffix"
        return super().unsupported()


class Part(_Body):
    """A part of a message's content: only text parts are taken (image_url, input_audio, file: 400)."""

    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self):
        if self.type != "text":
            raise ValueError(f"a content part of type {self.type!r}: this server takes text parts only")
        if self.text is None:
            raise ValueError("a text part needs its text")
        return self


class FunctionCall(_Body):
    name: str
    arguments: str


class ToolCallItem(_Body):
    """A tool call of an earlier assistant turn, as OpenAI's messages carry it."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[Part] | None = None
    name: str | None = None
    tool_calls: list[ToolCallItem] | None = None   # an assistant turn that called tools
    tool_call_id: str | None = None                 # a tool's result: the call it answers

    def as_template(self) -> dict:
        """The message as the chat template takes it: text parts joined by newlines (as llama-server);
        an assistant's tool calls and a tool result's call id kept for the template."""
        c = self.content
        text = c if isinstance(c, str) or c is None else "\n".join(p.text or "" for p in c)
        out: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role,
                               "content": "" if text is None and not self.tool_calls else text}
        if self.tool_calls:
            out["tool_calls"] = [{"id": t.id, "type": "function", "function": {
                "name": t.function.name, "arguments": t.function.arguments}} for t in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=-1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v, info: ValidationInfo):
        if v and not info.data.get("logprobs"):  # logprobs is validated first (declared before)
            raise ValueError("only with logprobs: true")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _choice_needs_tools(cls, v, info: ValidationInfo):
        if v not in (None, "auto", "none") and not info.data.get("tools"):  # tools is validated first
            raise ValueError(f"{v!r} asks for a tool call: only with tools")
        return v

    def n_logprobs(self) -> int | None:
        if self.logprobs:
            return self.top_logprobs or 0
        return super().n_logprobs()

    def tool_kwargs(self) -> dict:
        """Engine.submit's tool keywords (none without tools: tool_choice "auto" or "none" alone is a
        no-op; one that asks for a call was refused above; a history with tool calls or results
        and no tools is the Engine's to render)."""
        if not self.tools:
            return {}
        return dict(tools=self.tools, tool_choice=self.tool_choice if self.tool_choice is not None else "auto",
                    parallel_tool_calls=self.parallel_tool_calls)


class ApplyTemplateRequest(_Body):
    """POST /apply-template: the messages to render with the model's template."""

    messages: list[Message] = Field(min_length=1)


class TokenizeRequest(_Body):
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(_Body):
    tokens: TokenList


class SlotAction(_Body):
    filename: str | None = None
