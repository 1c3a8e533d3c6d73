"""The front end of `llamax serve --replicas N`: the HTTP app of `llamax serve` over a set of Engine
replicas instead of one Engine.

The front end is one Ray Serve ingress replica (no CPU of its own reserved) behind Ray Serve's HTTP
proxy. It reads the model's vocabulary and template only (ModelInfo: no weights), so a request is
validated, templated and tokenized here, once; its block hashes go with it to the router
(router.py, policy in routing.py), which picks the replica; the replica streams the text back.
The routes, bodies, errors, API key and log lines are llamax.server's own: ReplicaSet stands for
the Engine there.

Faults: a replica that dies fails only its own in-flight requests. A request that has not yet
sent any text to its client is run again on another replica; one that has gets a clear error
(a 500, or an error event in its stream). Ray Serve starts a new replica in its place.
"""
from __future__ import annotations

import asyncio
import logging
import types
import uuid
import weakref
from collections.abc import AsyncIterator
from typing import Any

from llamax.errors import BatchError, EngineFullError, LlamaxError, NoKVSlotError, RequestError, StateError
from llamax.sequence import bos_offset, prompt_tokens
from llamax.serving.request import Result
from llamax.tools import ToolPlan
from llamax.cluster import routing

log = logging.getLogger("llamax.cluster")

APP = "llamax"
ENGINE = "llamax-engine"
FRONT = "llamax-front"
CALL_TIMEOUT_S = 30.0

# the error classes a replica names in its ("error", kind, message) messages
ERRORS: dict[str, type[Exception]] = {c.__name__: c for c in (
    EngineFullError, BatchError, NoKVSlotError, RequestError, StateError, LlamaxError, ValueError, TypeError,
    FileNotFoundError, OSError)}


def _raise(kind: str, message: str) -> None:
    raise ERRORS.get(kind, LlamaxError)(message)


def _deaths() -> tuple[type[BaseException], ...]:
    """The exceptions by which Ray says a replica is gone."""
    from ray import exceptions as rx

    return (rx.RayActorError, rx.ActorUnavailableError)


class RemoteRequest:
    """A request running on a replica: the face of llamax.serving.Request the HTTP app uses
    (`async for piece in r`, r.result(), r.cancel())."""

    def __init__(self, replicas: ReplicaSet, tokens: list[int], kw: dict[str, Any], *,
                 messages: list[dict] | None = None, tools: ToolPlan | None = None) -> None:
        self._set = replicas
        self.tokens = tokens
        self.kw = kw
        self.messages = messages  # sent instead of the tokens when the replica renders tools
        self.tools = tools        # the tool plan, for the stream's tool-call deltas
        self.hashes = routing.block_hashes(tokens)
        self.key = uuid.uuid4().hex
        self.replica: str | None = None   # where it runs
        self.handed_over = 0              # prompt tokens fetched from another replica's cache
        self.attempts = 0
        self._gen: Any = None
        self._result: Result | None = None
        self._streamed = False
        self._cancelled = False

    async def start(self) -> RemoteRequest:
        """Submit to a replica and wait until its Engine took the request (its refusal raises
        here: EngineFullError, BatchError, ...). A replica that dies first: the next one."""
        deaths = _deaths()
        while True:
            self.attempts += 1
            self._gen = self._set.handle.options(stream=True).generate.remote(
                self.tokens, self.kw, hashes=self.hashes, key=self.key, messages=self.messages)
            try:
                msg = await self._gen.__anext__()
            except deaths as e:
                if self.attempts > self._set.retries or self._cancelled:
                    raise RequestError(f"no replica could take the request: {type(e).__name__}: {e}") from e
                log.warning("a replica died before taking a request; trying another")
                continue
            except StopAsyncIteration:
                raise RequestError("the replica ended the request without an answer") from None
            if msg[0] == "error":
                _raise(msg[1], msg[2])
            _, self.replica, self.handed_over = msg
            return self

    @property
    def done(self) -> bool:
        return self._result is not None

    @property
    def prompt(self) -> list[int]:
        """The prompt's token ids (Request.prompt's)."""
        return self.tokens

    def result(self) -> Result:
        """The Result, once the pieces are all read."""
        if self._result is None:
            raise LlamaxError("the request has not finished")
        return self._result

    def cancel(self) -> None:
        """Stop the request (its replica frees the slot at once)."""
        self._cancelled = True
        if self._gen is not None and self._result is None:
            self._gen.cancel()

    def __aiter__(self) -> AsyncIterator[str]:
        return self._pieces()

    async def _pieces(self) -> AsyncIterator[str]:
        deaths = _deaths()
        while True:
            try:
                async for msg in self._gen:
                    if msg[0] == "text":
                        self._streamed = True
                        yield msg[1]
                    elif msg[0] == "result":
                        self._result = msg[1]
                        return
                    elif msg[0] == "error":
                        _raise(msg[1], msg[2])
                raise RequestError(f"replica {self.replica} ended the stream without a result")
            except deaths as e:
                if self._streamed or self._cancelled:
                    raise RequestError(f"replica {self.replica} died in the middle of the request "
                                       f"({type(e).__name__})") from e
                log.warning("replica %s died before sending any text; running the request again", self.replica)
                await self.start()  # nothing was sent yet: once more, elsewhere

    def __repr__(self) -> str:
        return f"RemoteRequest(replica={self.replica}, prompt={len(self.tokens)}, done={self.done})"


class ReplicaSet:
    """The Engine replicas of a deployment, as the HTTP app sees an Engine.

    Args:
        model: the model's ModelInfo (vocabulary, template, hyperparameters).
        handle: the Ray Serve DeploymentHandle of the engine deployment.
        policy: the routing Policy its router shares in this process.
        info: one replica's info() (its n_parallel, n_ctx, n_ctx_seq, slot_save_path).
        retries: how many more replicas a request is tried on when one dies before sending text.
    """

    def __init__(self, model, handle, policy: routing.Policy, info: dict[str, Any], retries: int = 2) -> None:
        self.model = model
        self.handle = handle
        self.policy = policy
        self.retries = retries
        self.n_parallel = int(info["n_parallel"])
        self.n_ctx_seq = int(info["n_ctx_seq"])
        self.params = types.SimpleNamespace(n_ctx=int(info["n_ctx"]))
        self.slot_save_path = info["slot_save_path"]
        self._live: weakref.WeakSet[RemoteRequest] = weakref.WeakSet()  # for close(cancel=True)
        self._turn = -1  # the replica the last embed call went to

    # ---- the Engine's face ---------------------------------------------------------------------
    @property
    def failed(self) -> BaseException | None:
        return None if self.policy.replicas() else LlamaxError("no engine replica is running")

    def start(self) -> None:
        """Nothing to start: Ray Serve runs the replicas."""

    def close(self, cancel: bool = True) -> None:
        if cancel:
            for r in list(self._live):
                r.cancel()

    async def asubmit(self, prompt, *, n_keep: int = 0, **kw) -> RemoteRequest:
        """Engine.submit's arguments; the prompt is tokenized here and runs on the replica the
        router picks."""
        plan, messages = None, None
        turns = isinstance(prompt, list) and any(isinstance(m, dict) and (m.get("tool_calls") or m.get("role") == "tool")
                                                 for m in prompt)
        if kw.get("tools") is not None or turns:  # rendered by the replica's Engine; planned here for the stream
            from llamax.tools import prepare

            tools = kw.get("tools")
            choice = kw.get("tool_choice", "auto") if tools is not None else "none"
            plan = await asyncio.to_thread(prepare, self.model, list(prompt), list(tools or []), choice,
                                           bool(kw.get("parallel_tool_calls", True)))
            messages = list(prompt)
        toks = await asyncio.to_thread(prompt_tokens, self.model, plan.prompt if plan is not None else prompt)
        if isinstance(n_keep, int) and not isinstance(n_keep, bool) and n_keep >= 0 and messages is None:
            n_keep += bos_offset(self.model, prompt)  # the replica gets token ids: count the BOS here
        req = RemoteRequest(self, toks, {**kw, "n_keep": n_keep}, messages=messages, tools=plan)
        await req.start()
        self._live.add(req)
        return req

    def embed(self, inputs, *, pooling: str | None = None, normalize: bool = True):
        """Engine.embed on a replica (they take turns); the inputs are checked and tokenized here.

        Raises:
            LlamaxError: no replica is running. BatchError / ValueError / TypeError: as llamax.embed."""
        from llamax.embed import prepare

        tokens, how = prepare(self.model, inputs, pooling=pooling, normalize=normalize)
        running = sorted(self.policy.replicas())
        if not running:
            raise LlamaxError("no engine replica is running")
        self._turn = (self._turn + 1) % len(running)
        return self._call("embed", running[self._turn], tokens, how, normalize)

    def _call(self, method: str, replica: str, *args) -> Any:
        """A method of one replica, from a worker thread (the HTTP app calls these in one)."""
        return getattr(self.handle, method).remote(*args, replica=replica).result(timeout_s=CALL_TIMEOUT_S)

    def metrics_by_replica(self) -> dict[str, dict]:
        """Each running replica's Engine.metrics(), by replica id."""
        out = {}
        for rid in self.policy.replicas():
            try:
                out[rid] = self._call("metrics", rid)
            except Exception as e:  # noqa: BLE001 - a replica going away between the list and the call
                log.warning("no metrics from replica %s: %s", rid, e)
        return out

    def metrics(self) -> dict:
        from llamax.server.prometheus import sum_metrics

        return sum_metrics(self.metrics_by_replica().values())

    def slots(self) -> list[dict]:
        """Every replica's slots, numbered on: replica k's slot j is id k * n_parallel + j."""
        out = []
        for k, rid in enumerate(self.policy.replicas()):
            for s in self._call("slots", rid):
                out.append({**s, "id": k * self.n_parallel + s["id"], "replica": rid})
        return out

    def _slot_call(self, action: str, i: int, filename: str | None = None) -> dict:
        if isinstance(i, bool) or not isinstance(i, int):
            raise TypeError(f"slot {i!r}: an int")
        reps = self.policy.replicas()
        k, j = divmod(i, self.n_parallel)
        if not 0 <= k < len(reps):
            raise ValueError(f"slot {i} outside [0, {len(reps) * self.n_parallel})")
        out = self._call("slot_action", reps[k], action, j, filename)
        if isinstance(out, tuple) and out and out[0] == "error":
            _raise(out[1], out[2])
        return {**out, "id_slot": i, "replica": reps[k]}

    def slot_save(self, i: int, filename) -> dict:
        return self._slot_call("save", i, filename)

    def slot_restore(self, i: int, filename) -> dict:
        return self._slot_call("restore", i, filename)

    def slot_erase(self, i: int) -> dict:
        return self._slot_call("erase", i)

    # ---- the replicas ----------------------------------------------------------------------------
    def replicas(self) -> list[dict]:
        """Each running replica: its id, pid, in-flight requests, whether it drains."""
        draining = self.policy.draining()
        out = []
        for rid in self.policy.replicas():
            info = self._call("info", rid)
            out.append({**info, "inflight": self.policy.load(rid), "draining": rid in draining})
        return out

    def drain(self, replica: str, on: bool = True) -> None:
        """Send no new request to a replica; its cached conversations move on their next turn."""
        if replica not in self.policy.replicas():
            raise ValueError(f"no running replica {replica!r}")
        self.policy.drain(replica, on)


def _routes(rs: ReplicaSet) -> list:
    """GET /replicas; POST /replicas/{id}?action=drain|undrain."""
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from llamax.server.errors import APIError

    async def replicas(request: Request) -> JSONResponse:
        return JSONResponse(await asyncio.to_thread(rs.replicas))

    async def replica_action(request: Request) -> JSONResponse:
        rid, action = request.path_params["id"], request.query_params.get("action")
        if action not in ("drain", "undrain"):
            raise APIError(400, f"action={action!r}: drain or undrain", "action")
        try:
            rs.drain(rid, action == "drain")
        except ValueError as e:
            raise APIError(404, str(e)) from None
        return JSONResponse({"replica": rid, "draining": action == "drain"})

    return [Route("/replicas", replicas, methods=["GET"]),
            Route("/replicas/{id}", replica_action, methods=["POST"])]


class Front:
    """The ingress deployment's class (build_app wraps it with serve.ingress and serve.deployment):
    the HTTP app over the replica set, made once the engine replicas answer."""

    async def __init__(self, engines, model: str, server_kw: dict[str, Any],  # type: ignore[misc]  # Ray awaits it
                       routing_kw: dict[str, Any]) -> None:
        from llamax.model import ModelInfo

        lg = logging.getLogger("llamax.server")
        if not lg.handlers:  # the request lines on this worker's stderr (Ray forwards them to the driver)
            h = logging.StreamHandler()
            h.setFormatter(logging.Formatter("llamax.server: %(message)s"))
            lg.addHandler(h)
            lg.setLevel(logging.INFO)
            lg.propagate = False
        self.policy = routing.policy(ENGINE, **routing_kw)
        info = await engines.info.remote()  # the first call makes this process's router
        self.replicas = ReplicaSet(await asyncio.to_thread(ModelInfo.read, model), engines, self.policy, info)
        self.server_kw = server_kw

    def __serve_build_asgi_app__(self):
        from llamax.server.app import create_app

        return create_app(self.replicas, own_engine=False, routes=_routes(self.replicas), **self.server_kw)


def build_app(model: str, *, replicas: int, threads: int, routing_kw: dict[str, Any], engine_kw: dict[str, Any],
              server_kw: dict[str, Any], health_check_period_s: float = 2.0):
    """The Ray Serve application: `replicas` engine replicas (threads CPUs each) behind the front end."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    from llamax.cluster.replica import EngineReplica

    n_parallel = int(engine_kw.get("n_parallel", 4))
    max_queue = int(engine_kw.get("max_queue", 256))
    router: dict[str, Any] = dict(request_router_class="llamax.cluster.router.PrefixRouter",
                                  request_router_kwargs={"deployment": ENGINE, **routing_kw})
    engine = serve.deployment(
        name=ENGINE, num_replicas=replicas, ray_actor_options={"num_cpus": threads},
        # the Engine queues and batches; Ray only caps what a replica holds at its queue's size
        max_ongoing_requests=n_parallel + max_queue + 16, health_check_period_s=health_check_period_s,
        request_router_config=RequestRouterConfig(**router))(EngineReplica)
    front = serve.deployment(name=FRONT, num_replicas=1, ray_actor_options={"num_cpus": 0},
                             max_ongoing_requests=4096)(serve.ingress()(Front))
    return front.bind(engine.bind(model, engine_kw, threads, ENGINE, APP), model, server_kw, routing_kw)
