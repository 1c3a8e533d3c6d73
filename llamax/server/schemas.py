"""The request bodies of the HTTP server (pydantic models), checked before anything reaches the Engine.

Field names and meanings are OpenAI's (/v1/completions, /v1/chat/completions) with llama-server's
extensions (top_k, min_p, repeat_penalty, n_keep, ignore_eos; /tokenize, /detokenize, /slots).
Unknown fields are ignored, as OpenAI-compatible servers do, so clients that send more than we use
still work; a field we know but cannot honour (logprobs, echo, tools, ...) set to anything but its
no-op value is refused with 400 rather than silently dropped.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

MAX_STOPS = 16          # stop strings per request
MAX_STOP_CHARS = 256    # characters per stop string
MAX_CHOICES = 16        # n, and prompts per /v1/completions body
MAX_SEED = 2**63 - 1

TokenList = list[Annotated[int, Field(ge=0)]]


class _Body(BaseModel):
    # strict: no "1" for 1 or 1.5 for an int (a float field still takes an int); unknown keys ignored
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


class Sampling(_Body):
    """What /v1/completions and /v1/chat/completions share."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=-1)
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
    # OpenAI fields with no effect here unless left at their no-op values (checked in unsupported())
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logprobs: Any = None
    top_logprobs: int | None = None
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None

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
        if self.frequency_penalty not in (None, 0, 0.0):
            return "frequency_penalty"
        if self.presence_penalty not in (None, 0, 0.0):
            return "presence_penalty"
        if self.logprobs not in (None, False, 0):
            return "logprobs"
        if self.top_logprobs not in (None, 0):
            return "top_logprobs"
        if self.logit_bias:
            return "logit_bias"
        if self.best_of not in (None, 1):
            return "best_of"
        return None

    def engine_kwargs(self, max_tokens: int) -> dict:
        """Engine.submit's sampling keywords."""
        return dict(max_tokens=max_tokens, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                    min_p=self.min_p, repeat_penalty=self.repeat_penalty, stop=self.stop or None,
                    n_keep=self.n_keep, ignore_eos=self.ignore_eos)


Prompt = Union[str, list[str], TokenList, list[TokenList]]


class CompletionRequest(Sampling):
    prompt: Prompt
    echo: bool = False
    suffix: str | None = None

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
        if self.echo:
            return "echo"
        if self.suffix:
            return "suffix"
        return super().unsupported()


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template(self) -> dict:
        c = self.content
        text = c if isinstance(c, str) else "".join(p.text for p in c or [])
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=-1)
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    def unsupported(self) -> str | None:
        if self.tools:
            return "tools"
        if self.tool_choice not in (None, "none", "auto"):
            return "tool_choice"
        if self.response_format and self.response_format.get("type", "text") != "text":
            return "response_format"
        return super().unsupported()


class TokenizeRequest(_Body):
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(_Body):
    tokens: TokenList


class SlotAction(_Body):
    filename: str | None = None
