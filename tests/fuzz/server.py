"""Fuzz target (e): the HTTP server's request bodies (llamax/server/app.py, schemas.py), in process:
the Starlette app over a real Engine on the tiny llama model (requests generate at most 4 tokens).

A case POSTs to /v1/completions or /v1/chat/completions (sometimes /tokenize or /detokenize) one of:
a valid body with fields replaced, added or dropped (every known field, values of every JSON type,
numbers beyond int64 and float64, long strings, nested junk), a random JSON value, non-JSON bytes
(invalid UTF-8, truncated JSON, 2 000-deep nesting), streamed or not.

Contract checked: the answer is a 200 or a 4xx, never a 5xx; a 4xx has OpenAI's error body
{"error": {"message": str, "type": str, "param": str | None, "code": the status}}; a 200 is a
completion (JSON with choices) or an event stream ending with [DONE] and no error event.
"""
from __future__ import annotations

import atexit
import functools
import json

from tests.fuzz.common import Draw, Finding, tiny_model

PATHS = ("/v1/completions", "/v1/chat/completions")
FIELDS = ("model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "repeat_penalty", "seed", "stop", "n",
          "n_keep", "ignore_eos", "stream", "stream_options", "frequency_penalty", "presence_penalty", "logprobs",
          "top_logprobs", "logit_bias", "best_of", "prompt", "echo", "suffix", "messages", "max_completion_tokens",
          "tools", "tool_choice", "response_format", "content", "tokens", "add_special", "with_pieces")


@functools.lru_cache(maxsize=None)
def client():
    from starlette.testclient import TestClient

    from llamax.server.app import create_app
    from llamax.serving.engine import Engine

    engine = Engine(tiny_model(), n_ctx=256, n_parallel=2, n_threads=1)
    app = create_app(engine, max_tokens=4, own_engine=False)
    c = TestClient(app, raise_server_exceptions=False)
    c.__enter__()

    def close() -> None:
        c.__exit__(None, None, None)
        engine.close(cancel=True)

    atexit.register(close)
    return c


def _json_value(d: Draw, depth: int = 0):
    k = d.below(14 if depth < 3 else 9)
    if k == 0:
        return None
    if k == 1:
        return bool(d.below(2))
    if k == 2:
        return d.pick((0, 1, -1, 2, 4, 5, 16, 17, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30))
    if k == 3:
        return d.pick((0.0, -0.0, 0.5, 1.0, 1.5, 2.0, 2.5, -1.0, 1e-300, 1e300, 0.95))
    if k in (4, 5):
        return d.bytes(d.below(16)).decode("utf-8", "replace")
    if k == 6:
        return d.pick(("", "user", "assistant", "system", "text", "none", "auto", "json_object", "a" * 300,
                       "<|im_start|>", "\x00", "\ud800"))
    if k == 7:
        return d.uint(2)
    if k == 8:
        return "x" * d.below(3000)
    if k in (9, 10):
        return [_json_value(d, depth + 1) for _ in range(d.below(5))]
    if k == 11:
        return {d.pick(FIELDS + ("role", "content", "type", "text", "")): _json_value(d, depth + 1)
                for _ in range(d.below(4))}
    if k == 12:
        return [{"role": d.pick(("user", "system", "assistant", "tool", "developer", "bot")),
                 "content": _json_value(d, depth + 1)} for _ in range(d.below(3))]
    return [[d.below(400) for _ in range(d.below(5))] for _ in range(d.below(3))]


def _base(path: str, d: Draw) -> dict:
    if path == "/v1/chat/completions":
        return {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 1 + d.below(4)}
    if path == "/tokenize":
        return {"content": "hello world"}
    if path == "/detokenize":
        return {"tokens": [1, 2, 3]}
    return {"prompt": d.pick(("hello", [5, 6, 7], ["a", "b"], [[1, 2], [3]])), "max_tokens": 1 + d.below(4)}


def _dumps(body) -> bytes:
    return json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")


def make_request(d: Draw) -> tuple[str, bytes]:
    path = d.pick(PATHS + PATHS + PATHS + ("/tokenize", "/detokenize"))
    k = d.below(10)
    if k < 6:
        body = _base(path, d)
        for _ in range(1 + d.below(3)):
            op = d.below(4)
            if op == 0 and body:
                del body[d.pick(sorted(body))]
            else:
                body[d.pick(FIELDS)] = _json_value(d)
        return path, _dumps(body)
    if k == 6:
        return path, _dumps(_json_value(d))
    if k == 7:
        return path, d.pick((b"", b"{", b"[", b"{\"prompt\": ", b"null", b"nan", b"{\"prompt\": NaN}",
                             b"{\"prompt\": \"a\", \"max_tokens\": 1e999}", b"{\"prompt\": \"a\", \"n\": 1" + b"0" * 400 + b"}",
                             b"[" * 2000 + b"]" * 2000, b"{\"a\":" * 2000 + b"1" + b"}" * 2000,
                             b"\xff\xfe{}", b"{\"prompt\": \"\xff\"}", b"{\"prompt\": \"\\ud800\"}"))
    return path, d.bytes(d.below(200))


def _check_error(r, what: str) -> None:
    try:
        body = r.json()
    except ValueError:
        raise Finding(f"{what}: {r.status_code} with a non-JSON body {r.content[:200]!r}") from None
    err = body.get("error") if isinstance(body, dict) else None
    if not (isinstance(err, dict) and isinstance(err.get("message"), str) and isinstance(err.get("type"), str)
            and (err.get("param") is None or isinstance(err.get("param"), str)) and err.get("code") == r.status_code):
        raise Finding(f"{what}: {r.status_code} without an OpenAI error body: {body!r:.300}")


def one_input(data: bytes) -> None:
    d = Draw(data)
    path, body = make_request(d)
    what = f"POST {path} {body[:200]!r}"
    r = client().post(path, content=body, headers={"content-type": d.pick(("application/json", "text/plain", ""))})
    if r.status_code >= 500 or not (r.status_code == 200 or 400 <= r.status_code < 500):
        raise Finding(f"{what}: status {r.status_code}: {r.content[:300]!r}")
    if r.status_code != 200:
        _check_error(r, what)
        return
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        events = [ln[6:] for ln in r.text.split("\n") if ln.startswith("data: ")]
        if not events or events[-1] != "[DONE]":
            raise Finding(f"{what}: a stream without [DONE]: {r.text[-300:]!r}")
        for e in events[:-1]:
            ev = json.loads(e)
            if "error" in ev:
                raise Finding(f"{what}: an error event in the stream: {ev!r:.300}")
        return
    out = r.json()
    if path in PATHS and not (isinstance(out, dict) and isinstance(out.get("choices"), list) and out["choices"]):
        raise Finding(f"{what}: 200 without choices: {out!r:.300}")
