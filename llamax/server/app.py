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
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Sequence

import anyio
from pydantic import BaseModel, ValidationError
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from llamax.errors import BatchError, EngineFullError, LlamaxError, RequestError, StateError
from llamax.model.chat import ChatTemplateError
from llamax.server import prometheus
from llamax.server.schemas import (ChatRequest, CompletionRequest, DetokenizeRequest, Sampling, SlotAction,
                                   TokenizeRequest)
from llamax.serving import Result

log = logging.getLogger("llamax.server")

MAX_BODY_BYTES = 8 << 20
OPEN_PATHS = ("/health", "/v1/health")  # no API key needed
FINISH = {"eog": "stop", "stop": "stop", "length": "length", "cancelled": "stop"}


class APIError(Exception):
    """An error answered with an OpenAI-style body: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             405: "invalid_request_error", 413: "invalid_request_error", 500: "server_error",
             501: "not_supported_error", 503: "unavailable_error"}

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "server_error"),
                          "param": self.param, "code": self.status}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def _validation_message(e: ValidationError) -> tuple[str, str | None]:
    """One readable line for a pydantic error (the first field at fault), and that field."""
    errs = e.errors(include_url=False)
    first = errs[0]
    if first["type"] == "json_invalid":
        return f"invalid JSON body: {first['msg'].removeprefix('Invalid JSON: ')}", None
    loc = [str(x) for x in first["loc"]]
    field = loc[0] if loc else None
    same = [x for x in errs if x["loc"][:1] == first["loc"][:1]]
    if field == "prompt" and len(same) > 1:
        return "prompt: a string, a list of strings, a list of token ids (>= 0) or a list of such lists", field
    if first["type"] == "missing":
        return f"{'.'.join(loc)}: required", field
    where = ".".join(x for x in loc if x not in ("str", "list[str]", "list[int]", "list[TextPart]"))
    return f"{where or 'body'}: {first['msg']}", field


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
    def _max_tokens(self, asked: int | None) -> int:
        if asked is None or asked == -1:
            return self.max_tokens
        if asked > self.max_tokens:
            raise APIError(400, f"max_tokens = {asked}: this server generates at most {self.max_tokens} tokens "
                           "per request", "max_tokens")
        return asked

    async def _submit(self, prompts: list, body: Sampling, max_tokens: int | None) -> list:
        """One Engine request per (prompt, choice): len(prompts) * body.n of them, in that order."""
        bad = body.unsupported()
        if bad is not None:
            raise APIError(400, f"{bad}: not supported by this server", bad)
        kw = body.engine_kwargs(self._max_tokens(max_tokens))
        reqs = []
        try:
            for prompt in prompts:
                for i in range(body.n):
                    seed = None if body.seed in (None, -1) else body.seed + i
                    reqs.append(await self.engine.asubmit(prompt, seed=seed, **kw))
        except BaseException as e:
            for r in reqs:
                r.cancel()
            raise self._engine_error(e) from None
        return reqs

    def _engine_error(self, e: BaseException) -> BaseException:
        if isinstance(e, EngineFullError):
            return APIError(503, str(e))
        if isinstance(e, (BatchError, ChatTemplateError, ValueError, TypeError)):
            return APIError(400, str(e))
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
    def _timings(results) -> dict:
        r = results[0]
        return {"cache_n": r.n_cached, "prompt_n": r.n_prompt - r.n_cached, "predicted_n": r.n_generated,
                "ttft_ms": r.ttft_s * 1e3, "predicted_per_second": r.gen_tps}

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

    def _generate(self, request: Request, reqs, part, n: int, include_usage: bool) -> Response:
        """A Server-Sent Events response of the requests' pieces: part(index, text, None) for each
        piece, part(index, "", finish_reason) (with the usage on the last one) when a choice ends."""
        head = self._head(request)

        async def events() -> AsyncIterator[bytes]:
            results: list[Result | None] = [None] * len(reqs)
            try:
                async for i, piece in _merged(reqs):
                    if piece is not None:
                        yield _sse({**head, **part(i, piece, None)})
                        continue
                    res = results[i] = reqs[i].result()
                    last = all(x is not None for x in results)
                    end = {**head, **part(i, "", FINISH[res.stop])}
                    if last and not include_usage:
                        end["usage"] = self._usage(results, n)
                    yield _sse(end)
                    if last:
                        self._note(request, results)
                        if include_usage:
                            yield _sse({**head, "choices": [], "usage": self._usage(results, n)})
            except Exception as e:  # the engine failed mid-stream: the client gets an error event
                log.exception("a stream failed")
                err = self._engine_error(e)
                body = err.body() if isinstance(err, APIError) else APIError(500, str(e)).body()
                yield _sse(body)
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
        reqs = await self._submit(body.prompts(), body, body.max_tokens)
        return await self._respond(request, body, reqs, chat=False)

    async def chat(self, request: Request) -> Response:
        body = await self.body(request, ChatRequest)
        request.state.rid = f"chatcmpl-{uuid.uuid4().hex}"
        messages = [m.as_template() for m in body.messages]
        asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        reqs = await self._submit([messages], body, asked)
        return await self._respond(request, body, reqs, chat=True)

    async def _respond(self, request: Request, body: Sampling, reqs, *, chat: bool) -> Response:
        """The requests' answer: an event stream, or one JSON body once all are done."""
        if body.stream:
            include = bool(body.stream_options and body.stream_options.include_usage)
            obj, started = ("chat.completion.chunk" if chat else "text_completion"), set()

            def part(i: int, text: str, reason: str | None) -> dict:
                if chat:  # a choice's first chunk names the role; its last has an empty delta
                    delta = {"role": "assistant", "content": text} if i not in started else \
                        {"content": text} if reason is None else {}
                    started.add(i)
                    c = {"index": i, "delta": delta}
                else:
                    c = {"index": i, "text": text}
                return {"object": obj, "choices": [{**c, "logprobs": None, "finish_reason": reason}]}

            return self._generate(request, reqs, part, body.n, include)
        try:
            results = await self._gather(request, reqs)
        except LlamaxError as e:  # a request failed (RequestError) or the engine stopped
            raise self._engine_error(e) from None
        if results is None:
            return Response(status_code=499)  # nobody to answer: the client went away
        self._note(request, results)
        return JSONResponse({
            **self._head(request), "object": "chat.completion" if chat else "text_completion",
            "choices": [{"index": i, **({"message": {"role": "assistant", "content": r.text}} if chat else
                                        {"text": r.text}), "logprobs": None, "finish_reason": FINISH[r.stop]}
                        for i, r in enumerate(results)],
            "usage": self._usage(results, body.n), "timings": self._timings(results)})

    async def models(self, request: Request) -> Response:
        m = self.engine.model
        return JSONResponse({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created, "owned_by": "llamax",
            "meta": {"arch": m.arch, "n_vocab": m.n_vocab, "n_ctx_train": m.hparams.n_ctx_train,
                     "n_ctx": self.engine.params.n_ctx, "n_ctx_slot": self.engine.n_ctx_seq,
                     "n_parallel": self.engine.n_parallel}}]})

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
               own_engine: bool = True, routes: Sequence[Route] = (), pooling: str | None = None) -> Starlette:
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
        pooling: the pooling of /v1/embeddings ("mean", "last", "cls"; None: the GGUF's own, else mean).
    """
    from llamax.server.embeddings import Embeddings  # it builds on this module's Server and APIError

    srv = Server(engine, model_name=model_name, api_key=api_key, max_body_bytes=max_body_bytes,
                 max_tokens=max_tokens)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        try:
            yield
        finally:
            if own_engine:
                await asyncio.to_thread(engine.close, True)

    routes = [
        Route("/v1/completions", srv.completions, methods=["POST"]),
        Route("/v1/chat/completions", srv.chat, methods=["POST"]),
        Route("/v1/models", srv.models, methods=["GET"]),
        Route("/health", srv.health, methods=["GET"]),
        Route("/v1/health", srv.health, methods=["GET"]),
        Route("/metrics", srv.metrics, methods=["GET"]),
        Route("/slots", srv.slots, methods=["GET"]),
        Route("/slots/{id:int}", srv.slot_action, methods=["POST"]),
        Route("/tokenize", srv.tokenize, methods=["POST"]),
        Route("/detokenize", srv.detokenize, methods=["POST"]),
        Route("/v1/embeddings", Embeddings(srv, pooling).handle, methods=["POST"]),
        Route("/embeddings", Embeddings(srv, pooling).handle, methods=["POST"]),
        *routes,
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={APIError: _api_error, 404: _not_found, 405: _not_found,
                                        Exception: _server_error})
    app.add_middleware(_Gate, server=srv)
    app.state.server = srv
    return app
