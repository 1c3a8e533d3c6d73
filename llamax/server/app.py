"""The HTTP face of an Engine: OpenAI's /v1 routes and llama-server's own, as a Starlette app.

Stack: Starlette (routing, streaming responses, the ASGI plumbing FastAPI itself sits on) with
pydantic models for the bodies (schemas.py) and uvicorn as the server (run.py). Bodies are read and
validated here from the raw bytes, so every malformed input, from invalid JSON to a wrong type or a
value out of range, gets the same OpenAI-style 400 body; FastAPI's dependency injection and
generated docs would add a layer without changing what a client sees.

One request's path: the body is read (bounded by max_body_bytes) and validated -> Engine.asubmit
(submit in a worker thread: tokenizing and templating a long prompt does not stall the event loop) -> the
Engine's background loop batches it with every other request -> the text pieces come back through
`async for piece in req` as Server-Sent Events, or gathered into one JSON response. A client that
goes away cancels its requests at once (the Engine frees the slot before its next step): streams
watch the connection beside the writes, non-streamed requests wait on the connection too.

What llama-server's clients rely on is kept: every /v1 route answers without the prefix too
(/chat/completions, /models, ...); answers carry llama-server's `timings` (every stream chunk with
timings_per_token); return_progress streams prompt_progress events while the prompt is processed; a
prompt over the context answers exceed_context_size_error; GET /props and POST /apply-template; CORS
for browser apps (cors.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import anyio
from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

import llamax
from llamax.errors import BatchError, EngineFullError, LlamaxError, RequestError, StateError
from llamax.grammar import Grammar
from llamax.model.chat import ChatTemplateError
from llamax.sequence import prompt_tokens
from llamax.server import logprobs as _logprobs
from llamax.server import prometheus
from llamax.server.constraints import FieldError, check_tools, grammar_of
from llamax.server.embeddings import Embeddings
from llamax.server.cors import CORS
from llamax.server.errors import APIError
from llamax.server.schemas import (DEFAULT_SAMPLERS, ApplyTemplateRequest, ChatRequest, CompletionRequest,
                                   DetokenizeRequest, Sampling, SlotAction, TokenizeRequest)
from llamax.serving import Result
from llamax.serving.request import PREFILL, QUEUED

log = logging.getLogger("llamax.server")

MAX_BODY_BYTES = 8 << 20
OPEN_PATHS = ("/health", "/v1/health")  # no API key needed
FINISH = {"eog": "stop", "stop": "stop", "length": "length", "cancelled": "stop", "grammar": "stop",
          "tool_calls": "tool_calls"}
PROGRESS_POLL_S = 0.02  # how often a return_progress stream looks at its prompt's progress


def _validation_message(e: ValidationError) -> tuple[str, str | None]:
    """One readable line for a pydantic error (the first field at fault), and that field."""
    errs = e.errors(include_url=False)
    # a check of ours (value_error) says more than the other branches of a union failing
    first = next((x for x in errs if x["type"] == "value_error"), errs[0])
    if first["type"] == "json_invalid":
        return f"invalid JSON body: {first['msg'].removeprefix('Invalid JSON: ')}", None
    loc = [str(x) for x in first["loc"]]
    field = loc[0] if loc else None
    same = [x for x in errs if x["loc"][:1] == first["loc"][:1]]
    if field == "prompt" and len(same) > 1:
        return "prompt: a string, a list of strings, a list of token ids (>= 0) or a list of such lists", field
    if first["type"] == "missing":
        return f"{'.'.join(loc)}: required", field
    where = ".".join(x for x in loc if x != "str" and "[" not in x)  # not the union's branch names
    return f"{where or 'body'}: {first['msg'].removeprefix('Value error, ')}", field


class Server:
    """The routes over one Engine (see create_app)."""

    def __init__(self, engine, *, model_name: str, api_key: str | None, max_body_bytes: int,
                 max_tokens: int | None) -> None:
        self.engine = engine
        self.model_name = model_name
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.max_tokens = max_tokens if max_tokens is not None else engine.n_ctx_seq
        self.created = int(time.time())
        self.http = prometheus.HTTPCounts()
        self.registry = prometheus.registry(engine, self.http)

    # ---- reading a body ------------------------------------------------------------------------
    async def body(self, request: Request, model: type[BaseModel]):
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > self.max_body_bytes:
            raise APIError(413, f"the body is {size} bytes, more than the server takes ({self.max_body_bytes})")
        chunks, n = [], 0
        async for chunk in request.stream():
            n += len(chunk)
            if n > self.max_body_bytes:
                raise APIError(413, f"the body is more than the server takes ({self.max_body_bytes} bytes)")
            chunks.append(chunk)
        try:
            return model.model_validate_json(b"".join(chunks) or b"null")
        except ValidationError as e:
            raise APIError(400, *_validation_message(e)) from None

    # ---- submitting --------------------------------------------------------------------------------
    def _max_tokens(self, asked: int | None, field: str = "max_tokens") -> int:
        if asked is None or asked == -1:
            return self.max_tokens
        if asked > self.max_tokens:
            raise APIError(400, f"{field} = {asked}: this server generates at most {self.max_tokens} tokens "
                           "per request", field)
        return asked

    def _refuse(self, body: Sampling) -> None:
        """400 naming the first field set to what this server cannot do."""
        bad = body.unsupported()
        if bad is not None:
            raise APIError(400, f"{bad}: not supported by this server", bad)
        if body.id_slot >= self.engine.n_parallel:
            raise APIError(400, f"id_slot = {body.id_slot}: this server has slots 0..{self.engine.n_parallel - 1} "
                           "(-1: any)", "id_slot")
        n_vocab = self.engine.model.n_vocab
        beyond = [k for k in body.logit_bias or {} if int(k) >= n_vocab]
        if beyond:  # OpenAI refuses them (llama.cpp would drop them silently)
            raise APIError(400, f"logit_bias: token {beyond[0]} outside the vocabulary [0, {n_vocab})", "logit_bias")

    async def _submit(self, prompts: list, body: Sampling, max_tokens: int | None,
                      field: str = "max_tokens", **extra) -> list:
        """One Engine request per (prompt, choice): len(prompts) * body.n of them, in that order.
        extra: more Engine.submit keywords (the endpoint's own)."""
        self._refuse(body)
        try:
            grammar = grammar_of(body.response_format, body.json_schema, body.grammar)
        except FieldError as e:
            raise APIError(400, str(e), e.field) from None
        if grammar is not None and extra.get("tools"):
            raise APIError(400, "response_format (json_schema, grammar) with tools: the tools' own format constrains "
                           "the output; give one of them", "response_format")
        kw = {**body.engine_kwargs(self._max_tokens(max_tokens, field)), "grammar": grammar, **extra}
        spec = self._speculative(body)
        if spec is not None:
            kw["speculative"] = spec
        reqs = []
        try:
            for prompt in prompts:
                for i in range(body.n):
                    seed = None if body.seed in (None, -1) else body.seed + i
                    reqs.append(await self.engine.asubmit(prompt, seed=seed, **kw))
        except BaseException as e:
            for r in reqs:
                r.cancel()
            if isinstance(e, BatchError):
                await self._exceeds(prompt)
            raise self._engine_error(e, body) from None
        return reqs

    def _speculative(self, body: Sampling):
        """llama-server's per-request speculative.n_max / n_min / p_min over the server's --spec-type
        setting (None: the server's as it is; ignored without one, as llama-server does)."""
        base = getattr(self.engine, "speculative", None)
        extra = body.model_extra or {}
        vals = {k: extra[f"speculative.{k}"] for k in ("n_max", "n_min", "p_min") if extra.get(f"speculative.{k}") is not None}
        if base is None or not vals:
            return None
        for k, v in vals.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or k != "p_min" and not isinstance(v, int):
                raise APIError(400, f"speculative.{k}: a number, not {v!r}", f"speculative.{k}")
        try:
            return dataclasses.replace(base, **vals)
        except (ValueError, TypeError) as e:
            raise APIError(400, f"speculative: {e}", "speculative.n_max") from None

    async def _exceeds(self, prompt) -> None:
        """Raise llama-server's exceed_context_size_error when prompt does not fit a slot (the Engine
        refused it: its context shift is off); return otherwise (another BatchError)."""
        try:
            n = len(await asyncio.to_thread(prompt_tokens, self.engine.model, prompt))
        except (BatchError, ChatTemplateError, ValueError, TypeError):
            return
        n_ctx = self.engine.n_ctx_seq
        if n + 1 >= n_ctx:  # one more cell is needed for the first generated token
            raise APIError(400, f"request ({n} tokens) exceeds the available context size ({n_ctx} tokens), "
                           "try increasing it", kind="exceed_context_size_error", n_prompt_tokens=n, n_ctx=n_ctx)

    def _engine_error(self, e: BaseException, body: Sampling | None = None) -> BaseException:
        """The APIError of an Engine error; a refused request (400) names the body's field its
        message starts with (the Engine's checks of tools, tool_choice, ... name the argument first)."""
        if isinstance(e, EngineFullError):
            return APIError(503, str(e))
        if isinstance(e, (BatchError, ChatTemplateError, ValueError, TypeError)):
            head = re.match(r"[a-z_]+", str(e))
            field = head.group() if head is not None else None
            return APIError(400, str(e), field if body is not None and field in type(body).model_fields else None)
        if isinstance(e, RequestError):
            return APIError(500, str(e))
        if isinstance(e, LlamaxError):
            return APIError(500 if self.engine.failed is not None else 503, str(e))
        return e

    # ---- answering ---------------------------------------------------------------------------------
    def _usage(self, results, n: int) -> dict:
        firsts = results[::n]  # the n choices of one prompt share it: counted once
        prompt = sum(r.n_prompt for r in firsts)
        gen = sum(r.n_generated for r in results)
        return {"prompt_tokens": prompt, "completion_tokens": gen, "total_tokens": prompt + gen,
                "prompt_tokens_details": {"cached_tokens": sum(r.n_cached for r in firsts)}}

    @staticmethod
    def _timings(req) -> dict | None:
        """llama-server's timings of one request so far: prompt processing from its admission to a
        slot to its first token, generation from its first token to its last one. A request run
        elsewhere (a replica's) has its Result's figures only, once done (its queue wait counted in
        prompt_ms); before: None."""
        if hasattr(req, "t_first"):  # a llamax.serving.Request: its clock readings
            n_prompt, n_cached, n_gen = len(req.prompt), req.n_cached, len(req.generated)
            drafts = req.n_drafted, req.n_accepted
            t_start = req.t_start if req.t_start is not None else req.t_submit
            t_first, t_last = req.t_first, req.t_last
            prompt_ms = (t_first - t_start) * 1e3 if t_first is not None else 0.0
            predicted_ms = (t_last - t_first) * 1e3 if t_first is not None and t_last is not None else 0.0
            ttft_ms = ((t_first if t_first is not None else t_start) - req.t_submit) * 1e3
        elif req.done:
            r = req.result()
            n_prompt, n_cached, n_gen = r.n_prompt, r.n_cached, r.n_generated
            drafts = r.n_drafted, r.n_accepted
            prompt_ms = ttft_ms = r.ttft_s * 1e3
            predicted_ms = (n_gen - 1) / r.gen_tps * 1e3 if r.gen_tps > 0 else 0.0
        else:
            return None
        prompt_n = n_prompt - n_cached
        spec = {"draft_n": drafts[0], "draft_n_accepted": drafts[1]} if drafts[0] else {}
        return {**spec, "cache_n": n_cached, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
                "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else 0.0,
                "prompt_per_second": 1e3 * prompt_n / prompt_ms if prompt_ms > 0 else 0.0,
                "predicted_n": n_gen, "predicted_ms": predicted_ms,
                "predicted_per_token_ms": predicted_ms / n_gen if n_gen else 0.0,
                "predicted_per_second": 1e3 * n_gen / predicted_ms if predicted_ms > 0 else 0.0,
                "ttft_ms": ttft_ms}

    @staticmethod
    def _progress(req) -> dict:
        """llama-server's prompt_progress of a request: its prompt's tokens, those taken from the
        cache, those in its slot so far (the cached ones included), and the time since its admission."""
        t0 = req.t_start if req.t_start is not None else time.perf_counter()
        return {"total": len(req.prompt), "cache": req.n_cached, "processed": max(req.n_fed, req.n_cached),
                "time_ms": (time.perf_counter() - t0) * 1e3}

    def _note(self, request: Request, results) -> None:
        """What the request's log line says about its generation."""
        r = results[0]
        more = f" x{len(results)}" if len(results) > 1 else ""
        request.state.llamax = (f"prompt={r.n_prompt} cached={r.n_cached} gen={r.n_generated} "
                                f"ttft={r.ttft_s:.3f}s stop={r.stop}{more}")

    async def _gather(self, request: Request, reqs) -> list | None:
        """Every request's Result; None when the client went away first (the requests are cancelled)."""
        async def collect(r):
            async for _ in r:
                pass
            return r.result()

        work = asyncio.ensure_future(asyncio.gather(*(collect(r) for r in reqs)))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            if work.done():
                return work.result()
            return None  # the client went away first
        finally:
            gone.cancel()
            if not work.done():
                for r in reqs:
                    r.cancel()
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await work

    def _generate(self, request: Request, reqs, choices: _Choices, body: Sampling, *, chat: bool) -> Response:
        """A Server-Sent Events response of the requests' pieces: the chunks choices.piece(index,
        text) makes of each piece, then choices.end(index, result) (the usage and timings on the
        last one) when a choice ends. Before them choices.opening(index) opens each chat choice (its
        role), and carries the prompt's progress while it is processed (return_progress)."""
        head = self._head(request)
        n, every = body.n, body.timings_per_token
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def events() -> AsyncIterator[bytes]:
            results: list[Result | None] = [None] * len(reqs)
            try:
                if body.return_progress:
                    async for i, progress in _prompt_progress(reqs, self._progress):
                        yield _sse({**head, **choices.opening(i), "prompt_progress": progress})
                if chat:  # llama-server and OpenAI open a choice with its role alone
                    for i in range(len(reqs)):
                        yield _sse({**head, **choices.opening(i)})
                async for i, piece in _merged(reqs):
                    if piece is not None:
                        for part in choices.piece(i, piece):
                            chunk = {**head, **part}
                            if every:
                                _add_timings(chunk, self._timings(reqs[i]))
                            yield _sse(chunk)
                        continue
                    res = results[i] = reqs[i].result()
                    last = all(x is not None for x in results)
                    parts = choices.end(i, res)
                    for part in parts[:-1]:
                        yield _sse({**head, **part})
                    end = {**head, **parts[-1]}
                    if last and not include_usage:
                        end["usage"] = self._usage(results, n)
                    if last or every:
                        _add_timings(end, self._timings(reqs[i] if every else reqs[0]))
                    yield _sse(end)
                    if last:
                        self._note(request, results)
                        if include_usage:
                            yield _sse({**head, "choices": [], "usage": self._usage(results, n)})
            except Exception as e:  # the engine failed mid-stream: the client gets an error event
                log.exception("a stream failed")
                err = self._engine_error(e)
                yield _sse(err.body() if isinstance(err, APIError) else APIError(500, str(e)).body())
            finally:
                if not all(x is not None for x in results):
                    request.state.llamax = "cancelled: the client went away mid-stream"
                for r in reqs:
                    r.cancel()
            yield b"data: [DONE]\n\n"

        return _EventStream(events())

    def _head(self, request: Request) -> dict:
        return {"id": request.state.rid, "created": int(time.time()), "model": self.model_name,
                "system_fingerprint": "llamax"}

    # ---- routes --------------------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        body = await self.body(request, CompletionRequest)
        request.state.rid = f"cmpl-{uuid.uuid4().hex}"
        prompts = body.prompts()
        reqs = await self._submit(prompts, body, *body.asked_tokens(),
                                  prompt_logprobs=body.echo and body.n_logprobs() is not None)
        echoed = [p for p in prompts for _ in range(body.n)] if body.echo else None
        return await self._respond(request, body, reqs, chat=False, echoed=echoed)

    async def chat(self, request: Request) -> Response:
        body = await self.body(request, ChatRequest)
        request.state.rid = f"chatcmpl-{uuid.uuid4().hex}"
        messages = [m.as_template() for m in body.messages]
        asked, field = body.asked_tokens()
        if body.n_predict is None and body.max_completion_tokens is not None:
            asked, field = body.max_completion_tokens, "max_completion_tokens"
        tools = body.tool_kwargs()
        if tools.get("tools"):
            try:
                check_tools(tools["tools"])
            except FieldError as e:
                raise APIError(400, str(e), e.field) from None
        reqs = await self._submit([messages], body, asked, field, **tools)
        return await self._respond(request, body, reqs, chat=True)

    def _echo_text(self, prompt) -> str:
        """The text of a prompt echoed back (a str as given, token ids detokenized)."""
        return prompt if isinstance(prompt, str) else self.engine.model.detokenize(list(prompt))

    def _choice(self, i: int, r: Result, req, *, chat: bool, echoed: str | None) -> dict:
        """One choice of a non-streamed answer."""
        piece = self.engine.model.token_to_piece
        lp: dict | None = None
        if chat:
            msg: dict[str, Any] = {"role": "assistant", "content": r.text if r.text or not r.tool_calls else None}
            if r.tool_calls:
                msg["tool_calls"] = [_tool_call(c) for c in r.tool_calls]
            if r.logprobs is not None:
                lp = _logprobs.chat(r.logprobs, piece)
            return {"index": i, "message": msg, "logprobs": lp, "finish_reason": FINISH[r.stop]}
        text = r.text if echoed is None else echoed + r.text
        if r.logprobs is not None:
            if r.prompt_logprobs is not None:  # echo: the prompt's tokens first
                toks = _prompt_tokens(req.prompt, r.prompt_logprobs)
                lp = _logprobs.completion(toks + r.tokens, [*r.prompt_logprobs, *r.logprobs], piece)
            else:
                lp = _logprobs.completion(r.tokens, r.logprobs, piece, len(text) - len(r.text))
        return {"index": i, "text": text, "logprobs": lp, "finish_reason": FINISH[r.stop]}

    async def _respond(self, request: Request, body: Sampling, reqs, *, chat: bool,
                       echoed: list | None = None) -> Response:
        """The requests' answer: an event stream, or one JSON body once all are done. echoed: the
        prompt of each request, for completions' echo."""
        texts = None if echoed is None else [self._echo_text(p) for p in echoed]
        if body.stream:
            return self._generate(request, reqs, _Choices(self, reqs, body, chat=chat, echoed=texts), body, chat=chat)
        try:
            results = await self._gather(request, reqs)
        except LlamaxError as e:  # a request failed (RequestError) or the engine stopped
            raise self._engine_error(e) from None
        if results is None:
            return Response(status_code=499)  # nobody to answer: the client went away
        self._note(request, results)
        return JSONResponse({
            **self._head(request), "object": "chat.completion" if chat else "text_completion",
            "choices": [self._choice(i, r, reqs[i], chat=chat, echoed=None if texts is None else texts[i])
                        for i, r in enumerate(results)],
            "usage": self._usage(results, body.n), "timings": self._timings(reqs[0])})

    async def models(self, request: Request) -> Response:
        m = self.engine.model
        return JSONResponse({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created, "owned_by": "llamax",
            "meta": {"arch": m.arch, "n_vocab": m.n_vocab, "n_ctx_train": m.hparams.n_ctx_train,
                     "n_ctx": self.engine.params.n_ctx, "n_ctx_slot": self.engine.n_ctx_seq,
                     "n_parallel": self.engine.n_parallel}}]})

    async def props(self, request: Request) -> Response:
        """llama-server's GET /props: the server's generation defaults, slots, model and template."""
        m, d = self.engine.model, Sampling()
        params = {  # what a request that sets nothing gets (the samplers this server lacks: off)
            "n_predict": -1, "max_tokens": self.max_tokens, "seed": -1, "temperature": d.temperature,
            "dynatemp_range": 0.0, "dynatemp_exponent": 1.0, "top_k": d.top_k, "top_p": d.top_p, "min_p": d.min_p,
            "top_n_sigma": -1.0, "xtc_probability": 0.0, "xtc_threshold": 0.1, "typical_p": 1.0,
            "repeat_last_n": 64, "repeat_penalty": d.repeat_penalty, "presence_penalty": 0.0,
            "frequency_penalty": 0.0, "dry_multiplier": 0.0, "dry_base": 1.75, "dry_allowed_length": 2,
            "dry_penalty_last_n": -1, "mirostat": 0, "mirostat_tau": 5.0, "mirostat_eta": 0.1, "stop": [],
            "n_keep": d.n_keep, "n_discard": 0, "ignore_eos": d.ignore_eos, "stream": d.stream, "logit_bias": [],
            "n_probs": 0, "min_keep": 0, "grammar": "", "samplers": list(DEFAULT_SAMPLERS),
            "timings_per_token": d.timings_per_token, "post_sampling_probs": False, "cache_prompt": d.cache_prompt,
            "id_slot": d.id_slot, "return_progress": d.return_progress}

        def piece(tok: int) -> str:
            return m.token_to_piece(tok).decode("utf-8", errors="replace")

        return JSONResponse({
            "default_generation_settings": {"id": 0, "n_ctx": self.engine.n_ctx_seq, "is_processing": False,
                                            "params": params},
            "total_slots": self.engine.n_parallel, "model_alias": self.model_name, "model_path": str(m.path),
            "modalities": {"vision": False, "audio": False}, "chat_template": m.chat_template or "",
            "bos_token": piece(m.bos), "eos_token": piece(m.eos), "build_info": f"llamax {llamax.__version__}",
            "endpoint_slots": True, "endpoint_props": False, "endpoint_metrics": True})

    async def apply_template(self, request: Request) -> Response:
        """llama-server's POST /apply-template: the prompt the model's template makes of the messages,
        ending with the opening of the assistant's turn."""
        body = await self.body(request, ApplyTemplateRequest)
        messages = [msg.as_template() for msg in body.messages]
        try:
            prompt = await asyncio.to_thread(self.engine.model.apply_chat_template, messages)
        except ChatTemplateError as e:
            raise APIError(400, str(e), "messages") from None
        return JSONResponse({"prompt": prompt})

    async def health(self, request: Request) -> Response:
        if self.engine.failed is not None:
            return APIError(500, f"the engine stopped after an error: {self.engine.failed}").response()
        return JSONResponse({"status": "ok"})

    async def metrics(self, request: Request) -> Response:
        data = await asyncio.to_thread(prometheus.render, self.registry)
        return Response(data, media_type=prometheus.CONTENT_TYPE)

    async def slots(self, request: Request) -> Response:
        slots = await asyncio.to_thread(self.engine.slots)
        if request.query_params.get("fail_on_no_slot") in ("1", "true") and all(s["is_processing"] for s in slots):
            raise APIError(503, "no slot available")
        return JSONResponse(slots)

    async def slot_action(self, request: Request) -> Response:
        sid = request.path_params["id"]
        action = request.query_params.get("action")
        if action not in ("save", "restore", "erase"):
            raise APIError(400, f"action={action!r}: one of save, restore, erase", "action")
        if self.engine.slot_save_path is None and action != "erase":
            raise APIError(501, "slot save / restore is off: start the server with --slot-save-path DIR")
        body = await self.body(request, SlotAction) if action != "erase" else None
        if body is not None and not body.filename:
            raise APIError(400, f"action={action} needs a filename", "filename")
        t0 = time.perf_counter()
        try:
            if action == "erase":
                out = await asyncio.to_thread(self.engine.slot_erase, sid)
            else:
                assert body is not None  # save / restore read their body above
                fn = self.engine.slot_save if action == "save" else self.engine.slot_restore
                out = await asyncio.to_thread(fn, sid, body.filename)
        except (ValueError, StateError, LlamaxError, FileNotFoundError) as e:
            raise APIError(400, f"slot {action}: {e}") from None
        except OSError as e:  # the server's disk (full, read-only): the previous file is left whole
            raise APIError(500, f"slot {action}: {e}") from None
        ms = (time.perf_counter() - t0) * 1e3
        if action != "erase":
            out["timings"] = {f"{action}_ms": ms}
        return JSONResponse(out)

    async def tokenize(self, request: Request) -> Response:
        body = await self.body(request, TokenizeRequest)
        m = self.engine.model
        toks = await asyncio.to_thread(m.tokenize, body.content, body.add_special, body.parse_special)
        if not body.with_pieces:
            return JSONResponse({"tokens": toks})
        out = []
        for t in toks:
            raw = m.token_to_piece(t)
            try:
                piece = raw.decode("utf-8")
            except UnicodeDecodeError:
                piece = list(raw)
            out.append({"id": t, "piece": piece})
        return JSONResponse({"tokens": out})

    async def detokenize(self, request: Request) -> Response:
        body = await self.body(request, DetokenizeRequest)
        m = self.engine.model
        bad = [t for t in body.tokens if t >= m.n_vocab]
        if bad:
            raise APIError(400, f"token {bad[0]} outside the vocabulary [0, {m.n_vocab})", "tokens")
        return JSONResponse({"content": m.detokenize(body.tokens)})


def _prompt_tokens(prompt: Sequence[int], items: Sequence) -> list[int]:
    """The prompt's token ids for its logprobs (items[0] is None: the first token's are)."""
    return [prompt[0]] + [t.token for t in items[1:] if t is not None]


def _tool_call(c) -> dict:
    """A llamax.tools.ToolCall as OpenAI's message.tool_calls item."""
    return {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}


class _Choices:
    """The stream chunks of each choice (OpenAI's shapes): text deltas, or with tools the deltas of
    the tool-call reader (llamax.tools.ToolStream: content, then each call's name and its arguments
    in pieces); each chunk carries the logprobs of the tokens generated since the choice's last
    chunk (all of them by its end, from the Result). A completion's chunks concatenate to the
    non-streamed logprobs: with echo the prompt's come first, and text offsets count from the start
    of the choice's text."""

    def __init__(self, server: Server, reqs, body: Sampling, *, chat: bool, echoed: list[str] | None) -> None:
        self.chat, self.reqs, self.echoed = chat, reqs, echoed
        self.obj = "chat.completion.chunk" if chat else "text_completion"
        self.piece_of = server.engine.model.token_to_piece
        self.sent = [0] * len(reqs)  # logprobs sent per choice
        self.offset = [0] * len(reqs)  # completions: the text offset of the choice's next token
        self.readers = [r.tools.stream() if chat and getattr(r, "tools", None) is not None else None for r in reqs]
        self.started = [False] * len(reqs)

    def _wrap(self, i: int, c: dict, lp: dict | None, reason: str | None) -> dict:
        return {"object": self.obj, "choices": [{"index": i, **c, "logprobs": lp, "finish_reason": reason}]}

    def _new_logprobs(self, i: int, items: list | None, prompt: list | None = None) -> dict | None:
        """The logprobs of the tokens generated since the choice's last chunk; prompt (completions'
        echo, in the choice's first chunk): the prompt tokens' logprobs, put first. Text offsets
        count from the start of the choice's text, as the non-streamed answer's."""
        if items is not None and len(items) > self.sent[i]:
            new, self.sent[i] = items[self.sent[i]:], len(items)
        elif prompt is None:
            return None
        else:
            new = []
        if self.chat:
            return {"content": _logprobs.chat_content(new, self.piece_of), "refusal": None}
        toks = [t.token for t in new]
        if prompt is not None:
            toks, new = _prompt_tokens(self.reqs[i].prompt, prompt) + toks, [*prompt, *new]
        out = _logprobs.completion(toks, new, self.piece_of, self.offset[i])
        self.offset[i] += sum(len(s) for s in out["tokens"])
        return out

    def _echoed_logprobs(self, i: int, prompt: list | None) -> list | None:
        """The prompt's logprobs to put in the choice's first chunk (completions with echo), or None."""
        return prompt if not self.chat and not self.started[i] and self.echoed is not None else None

    def opening(self, i: int) -> dict:
        """A chat choice's first chunk: the role alone (llama-server's content null)."""
        if self.chat:
            return self._wrap(i, {"delta": {"role": "assistant", "content": None}}, None, None)
        return self._wrap(i, {"text": ""}, None, None)

    def piece(self, i: int, text: str) -> list[dict]:
        decoder = getattr(self.reqs[i], "decoder", None)
        lp = self._new_logprobs(i, None if decoder is None else decoder.logprobs,
                                self._echoed_logprobs(i, getattr(self.reqs[i], "prompt_logprobs", None)))
        if not self.chat:
            if not self.started[i] and self.echoed is not None:
                text = self.echoed[i] + text
            self.started[i] = True
            return [self._wrap(i, {"text": text}, lp, None)]
        reader = self.readers[i]
        deltas = [{"content": text}] if reader is None else reader.push(text)
        if not deltas:
            return [self._wrap(i, {"delta": {}}, lp, None)] if lp is not None else []
        return [self._wrap(i, {"delta": d}, lp if k == 0 else None, None) for k, d in enumerate(deltas)]

    def end(self, i: int, res: Result) -> list[dict]:
        """The choice's last chunks: what its tool-call reader still held, then the finish reason
        (with the logprobs not sent yet)."""
        out: list[dict] = []
        if not self.chat and not self.started[i] and self.echoed is not None:
            lp = self._new_logprobs(i, None, self._echoed_logprobs(i, res.prompt_logprobs))
            out.append(self._wrap(i, {"text": self.echoed[i]}, lp, None))
            self.started[i] = True
        reader = self.readers[i]
        if reader is not None:
            out += [self._wrap(i, {"delta": d}, None, None) for d in reader.finish()]
        lp = self._new_logprobs(i, res.logprobs)
        out.append(self._wrap(i, {"delta": {}} if self.chat else {"text": ""}, lp, FINISH[res.stop]))
        return out


class _EventStream(StreamingResponse):
    """text/event-stream that watches the connection beside the writes: a client that goes away
    cancels the generator (and with it the Engine requests) at once, not at the next write."""

    def __init__(self, content) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope, receive, send) -> None:
        async with anyio.create_task_group() as tg:
            async def stream() -> None:
                with contextlib.suppress(OSError, ClientDisconnect):
                    await self.stream_response(send)
                tg.cancel_scope.cancel()

            tg.start_soon(stream)
            await self.listen_for_disconnect(receive)
            tg.cancel_scope.cancel()


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone away."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def _add_timings(chunk: dict, timings: dict | None) -> None:
    if timings is not None:
        chunk["timings"] = timings


async def _prompt_progress(reqs, progress) -> AsyncIterator[tuple[int, dict]]:
    """(index, progress(request)) each time a request's prompt processing moves on, until every
    request has its prompt in (the last event of each says processed == total). Requests run
    elsewhere (no prefill counter) report nothing."""
    seen: list[int | None] = [None] * len(reqs)
    watched = [i for i, r in enumerate(reqs) if hasattr(r, "n_fed")]
    while watched:
        for i in list(watched):
            r = reqs[i]
            waiting = r.state in (QUEUED, PREFILL) and not r.done
            if r.t_start is not None and r.n_fed != seen[i]:  # admitted (ended in the queue: no event)
                seen[i] = r.n_fed
                p = progress(r)
                if not waiting:  # its prompt is in: the last event says so
                    p["processed"] = p["total"]
                yield i, p
            if not waiting:
                watched.remove(i)
        if watched:
            await asyncio.sleep(PROGRESS_POLL_S)


async def _merged(reqs) -> AsyncIterator[tuple[int, str | None]]:
    """(index, piece) of every request as they come, then (index, None) when one ends."""
    if len(reqs) == 1:
        async for piece in reqs[0]:
            yield 0, piece
        yield 0, None
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, r) -> None:
        try:
            async for piece in r:
                queue.put_nowait((i, piece))
        except Exception as e:
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(reqs)]
    try:
        left = len(reqs)
        while left:
            i, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            left -= item is None
            yield i, item
    finally:
        for t in tasks:
            t.cancel()


class _Gate:
    """ASGI middleware: the API key, errors as OpenAI bodies, and one log line per request."""

    def __init__(self, app, server: Server) -> None:
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = [0]
        scope.setdefault("state", {})

        async def sending(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        path = scope["path"]
        try:
            key = self.server.api_key
            if key is not None and path not in OPEN_PATHS and not _authorized(scope, key):
                await APIError(401, "invalid or missing API key (Authorization: Bearer KEY)")\
                    .response()(scope, receive, sending)
            else:
                await self.app(scope, receive, sending)
        except ClientDisconnect:
            status[0] = status[0] or 499
        except Exception:
            status[0] = status[0] or 500
            raise
        finally:
            route = _route_name(scope)
            self.server.http.add(route, status[0])
            note = scope["state"].get("llamax")
            client = scope.get("client") or ("-", 0)
            log.info("%s %s %s %d %.3fs%s", client[0], scope["method"], path, status[0],
                     time.perf_counter() - t0, f" {note}" if note else "")


def _authorized(scope, key: str) -> bool:
    headers = dict(scope["headers"])
    auth = headers.get(b"authorization", b"").decode("latin-1")
    given = auth[7:].strip() if auth[:7].lower() == "bearer " else headers.get(b"x-api-key", b"").decode("latin-1")
    return hmac.compare_digest(given.encode(), key.encode())


def _route_name(scope) -> str:
    route = scope.get("route")
    return getattr(route, "path", None) or "other"


def _unprefixed(routes: Sequence[Route]) -> list[Route]:
    """routes and, for each /v1/X among them, /X to the same endpoint (unless a route has that path)."""
    paths = {r.path for r in routes}
    out = list(routes)
    for r in routes:
        alias = r.path.removeprefix("/v1")
        if r.path.startswith("/v1/") and alias not in paths:
            out.append(Route(alias, r.endpoint, methods=list(r.methods or ()), name=f"{r.name}_unprefixed"))
            paths.add(alias)
    return out


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)  # registered for APIError only (Starlette types handlers over Exception)
    return exc.response()


async def _not_found(request: Request, exc) -> Response:
    code = getattr(exc, "status_code", 404)
    return APIError(code, f"{request.method} {request.url.path}: {getattr(exc, 'detail', 'not found')}").response()


async def _server_error(request: Request, exc) -> Response:
    log.exception("%s %s failed", request.method, request.url.path, exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}").response()


def create_app(engine, *, model_name: str = "llamax", api_key: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES, max_tokens: int | None = None,
               own_engine: bool = True, routes: Sequence[Route] = (),
               cors_origins: Sequence[str] | None = None, pooling: str | None = None) -> Starlette:
    """The ASGI app serving engine.

    Args:
        engine: a llamax.Engine (or what stands for one: llamax.cluster's replica set); its
            background loop is started with the app (and closed with it when own_engine).
        model_name: the id /v1/models gives and the responses carry.
        api_key: when set, every route but /health needs `Authorization: Bearer KEY` (or X-Api-Key).
        max_body_bytes: larger request bodies get 413.
        max_tokens: the most tokens one request may ask for (default: a slot's context); a request
            without max_tokens (or with -1) generates until its end, at most this many.
        routes: more routes, behind the same API key, errors and log lines.
        cors_origins: the browser origins (scheme://host[:port]) allowed to call the server; None:
            any origin, as llama-server (see cors.py).
        pooling: the pooling of /v1/embeddings ("mean", "last", "cls"; None: the GGUF's own, else mean).

    Every route under /v1/ answers without the prefix too (/chat/completions, /models, ...), as
    llama-server's do.
    """
    srv = Server(engine, model_name=model_name, api_key=api_key, max_body_bytes=max_body_bytes,
                 max_tokens=max_tokens)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        model = getattr(engine, "model", None)
        if model is not None:  # the vocabulary's grammar tables (seconds for a 262k vocabulary), off the first request
            threading.Thread(target=Grammar.json().matcher, args=(model,), name="llamax-grammar-warm",
                             daemon=True).start()
        try:
            yield
        finally:
            if own_engine:
                await asyncio.to_thread(engine.close, True)

    routes = [
        Route("/v1/completions", srv.completions, methods=["POST"]),
        Route("/v1/chat/completions", srv.chat, methods=["POST"]),
        Route("/v1/models", srv.models, methods=["GET"]),
        Route("/props", srv.props, methods=["GET"]),
        Route("/apply-template", srv.apply_template, methods=["POST"]),
        Route("/health", srv.health, methods=["GET"]),
        Route("/v1/health", srv.health, methods=["GET"]),
        Route("/metrics", srv.metrics, methods=["GET"]),
        Route("/slots", srv.slots, methods=["GET"]),
        Route("/slots/{id:int}", srv.slot_action, methods=["POST"]),
        Route("/tokenize", srv.tokenize, methods=["POST"]),
        Route("/detokenize", srv.detokenize, methods=["POST"]),
        Route("/v1/embeddings", Embeddings(srv, pooling).handle, methods=["POST"]),
        *routes,
    ]
    routes = _unprefixed(routes)
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={APIError: _api_error, 404: _not_found, 405: _not_found,
                                        Exception: _server_error})
    app.add_middleware(_Gate, server=srv)
    app.add_middleware(CORS, origins=cors_origins)  # outermost: preflights need no API key, a 401 is readable
    app.state.server = srv
    return app
