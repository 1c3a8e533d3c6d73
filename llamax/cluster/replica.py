"""One Engine replica of `llamax serve --replicas N`: the body of the Ray Serve deployment.

Each replica loads the model and runs its own llamax.Engine (its background loop, its slots, its
prefix cache) with its own threads: the deployment asks Ray for as many CPUs as it runs threads,
so replicas sharing a machine share its cores without oversubscribing them.

generate() is a stream of messages to the front end (front.py):
    ("accepted", replica, n_handed_over)   the Engine took the request
    ("text", str)                          generated text (pieces that came together, joined)
    ("result", dict)                       the Result's fields; the stream ends
    ("error", kind, message)               the request was refused or failed (kind: the exception's
                                           class name); the stream ends
Refusals travel as messages, not exceptions, so the front end gets llamax's own error classes back
whatever Ray wraps around a raised one. A call that names a handover source first fetches the
cached prefix of the prompt from that replica (Engine.export_prefix there, import_prefix here), so
a conversation moved off a draining or overloaded replica does not compute its prompt again.
"""
from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator, Sequence
from typing import Any

from llamax.errors import LlamaxError

log = logging.getLogger("llamax.cluster")

HANDOVER_TIMEOUT_S = 60.0


class EngineReplica:
    """A Ray Serve deployment class (llamax.cluster.front.build_app applies serve.deployment).

    Args:
        model: registry name or GGUF path (each replica loads it; on another node the registry
            fetches it there).
        engine_kw: llamax.Engine's keyword arguments (n_ctx, n_parallel, ...).
        n_threads: the replica's threads.
        deployment, app: this deployment's name and application, for the handle to its peers.
    """

    def __init__(self, model: str, engine_kw: dict[str, Any], n_threads: int, deployment: str, app: str) -> None:
        from ray import serve

        from llamax.model import Model
        from llamax.serving import Engine

        self.engine = Engine(Model.load(model, n_threads=n_threads), n_threads=n_threads, **engine_kw)
        self.engine.start()
        self.id = serve.get_replica_context().replica_id.unique_id
        self._deployment, self._app = deployment, app
        self._peers: Any = None
        self.handed_over = {"in": 0, "tokens_in": 0, "out": 0, "tokens_out": 0, "failed": 0}

    # ---- generation ------------------------------------------------------------------------------
    async def generate(self, tokens: list[int], kw: dict[str, Any], *, hashes: Sequence[str] = (),
                       key: str | None = None, handover: str | None = None,
                       messages: list[dict] | None = None) -> AsyncIterator[tuple]:
        """Run one request: tokens (the prompt's ids), or messages when tools render the prompt here
        (tokens are then what the front computed of them, for the handover)."""
        took = await self._take_over(tokens, handover) if handover and handover != self.id else 0
        try:
            req = await asyncio.to_thread(self.engine.submit, tokens if messages is None else messages, **kw)
        except Exception as e:  # noqa: BLE001 - a refusal: sent back by name
            yield ("error", type(e).__name__, str(e))
            return
        yield ("accepted", self.id, took)
        try:
            async for text in _coalesced(req):
                yield ("text", text)
            yield ("result", req.result())  # pickled whole: its logprobs and tool calls keep their types
        except LlamaxError as e:
            yield ("error", type(e).__name__, str(e))
        finally:
            req.cancel()  # the client went away (Ray cancels this generator): the slot is freed at once

    async def _take_over(self, tokens: list[int], source: str) -> int:
        """Fetch the cached prefix of tokens from replica source into this engine's prefix cache;
        the tokens it added (0 when the fetch failed: the prompt is then computed here)."""
        from ray import serve

        try:
            if self._peers is None:
                self._peers = serve.get_deployment_handle(self._deployment, self._app)
            prefix = await asyncio.wait_for(self._peers.export_prefix.remote(tokens, replica=source),
                                            HANDOVER_TIMEOUT_S)
            if prefix is None:
                return 0
            n = await asyncio.to_thread(self.engine.import_prefix, prefix)
        except Exception as e:  # noqa: BLE001 - a handover is an optimisation: compute instead
            self.handed_over["failed"] += 1
            log.warning("replica %s: no handover from %s (%s: %s); computing the prompt", self.id, source,
                        type(e).__name__, e)
            return 0
        self.handed_over["in"] += 1
        self.handed_over["tokens_in"] += n
        return n

    async def embed(self, tokens: list[list[int]], pooling: str, normalize: bool = True, replica: str | None = None):
        """Engine.embed of inputs the front tokenized (float32 [n, n_embd])."""
        return await asyncio.to_thread(self.engine.embed, tokens, pooling=pooling, normalize=normalize)

    async def export_prefix(self, tokens: list[int], replica: str | None = None):
        prefix = await asyncio.to_thread(self.engine.export_prefix, tokens)
        if prefix is not None:
            self.handed_over["out"] += 1
            self.handed_over["tokens_out"] += len(prefix.tokens)
        return prefix

    # ---- the replica's state ---------------------------------------------------------------------
    async def info(self, replica: str | None = None) -> dict[str, Any]:
        e = self.engine
        return dict(replica=self.id, pid=os.getpid(), n_parallel=e.n_parallel, n_ctx=e.params.n_ctx,
                    n_ctx_seq=e.n_ctx_seq, slot_save_path=None if e.slot_save_path is None else str(e.slot_save_path))

    async def metrics(self, replica: str | None = None) -> dict[str, Any]:
        m = await asyncio.to_thread(self.engine.metrics)
        m.update({f"handovers_{k}": v for k, v in self.handed_over.items()})
        return m

    async def slots(self, replica: str | None = None) -> list[dict]:
        return await asyncio.to_thread(self.engine.slots)

    async def slot_action(self, action: str, i: int, filename: str | None = None, replica: str | None = None):
        """slot_save / slot_restore / slot_erase of slot i; an error comes back as ("error", kind, message)."""
        fn = {"save": self.engine.slot_save, "restore": self.engine.slot_restore}.get(action)
        try:
            if fn is None:
                return await asyncio.to_thread(self.engine.slot_erase, i)
            return await asyncio.to_thread(fn, i, filename)
        except Exception as e:  # noqa: BLE001 - sent back by name
            return ("error", type(e).__name__, str(e))

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose Engine loop stopped is restarted."""
        if self.engine.failed is not None:
            raise RuntimeError(f"the engine stopped after an error: {self.engine.failed}")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close(cancel=True)


async def _coalesced(req) -> AsyncIterator[str]:
    """The request's text pieces, those that arrive while the previous message is on its way joined
    into one (fewer messages through Ray under load, the same text)."""
    buf: list[str] = []
    wake = asyncio.Event()
    done = False
    error: BaseException | None = None

    async def pump() -> None:
        nonlocal done, error
        try:
            async for piece in req:
                buf.append(piece)
                wake.set()
        except BaseException as e:  # noqa: BLE001 - re-raised by the consumer
            error = e
        finally:
            done = True
            wake.set()

    task = asyncio.ensure_future(pump())
    try:
        while True:
            await wake.wait()
            wake.clear()
            if buf:
                text = "".join(buf)
                buf.clear()
                yield text
            if done and not buf:
                break
        if error is not None:
            raise error
    finally:
        task.cancel()
