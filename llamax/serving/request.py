"""A request to the Engine and its result (llama-server's task and its final response).

A Request is the caller's handle: iterate it for the text pieces as they are generated, call
result() for the Result, cancel() to stop it. The engine's loop fills it from its own thread;
every method here is safe from any thread. Without a background loop (no `with engine:`),
iterating or waiting drives the engine's steps itself.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from llamax.errors import RequestError
from llamax.sampling import Sampler

QUEUED, PREFILL, GENERATING, SUSPENDED, DONE = "queued", "prefill", "generating", "suspended", "done"

if TYPE_CHECKING:
    from llamax.serving.engine import Slot, Suspended


@dataclass(frozen=True)
class Result:
    """What a finished request gave.

    text: the generated text (up to a stop string, which is not included); tokens: the generated
    ids (an end-of-generation token excluded); stop: "eog", "length", "stop", "cancelled" or
    "error" (its forward pass failed: Request.result() raises RequestError instead of returning it);
    n_prompt: prompt tokens (after truncation, see Engine); n_cached: prompt tokens taken from the
    prefix cache, not computed; n_generated: len(tokens); ttft_s: submit to first token;
    gen_tps: generated tokens per second after the first; n_shift: context shifts.
    """

    text: str
    tokens: list[int]
    stop: str
    n_prompt: int
    n_cached: int
    n_generated: int
    ttft_s: float
    gen_tps: float
    n_shift: int = 0


class StopMatcher:
    """Finds stop strings in streamed text and holds back a tail that may begin one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self.text = ""
        self.sent = 0  # characters of text handed out

    def push(self, piece: str) -> tuple[str, bool]:
        """(text that can be handed out now, True if a stop string was completed)."""
        self.text += piece
        if not self.stops:
            out, self.sent = self.text[self.sent:], len(self.text)
            return out, False
        lo = max(0, self.sent - max(len(s) for s in self.stops) + 1)
        hits = [i for i in (self.text.find(s, lo) for s in self.stops) if i >= 0]
        if hits:
            cut = min(hits)
            out = self.text[self.sent:cut] if cut > self.sent else ""
            self.text, self.sent = self.text[:max(cut, self.sent)], max(cut, self.sent)
            return out, True
        hold = 0  # the longest tail of text that a stop string starts with
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.text) - self.sent), 0, -1):
                if self.text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        end = len(self.text) - hold
        out = self.text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return out, False

    def flush(self) -> str:
        out, self.sent = self.text[self.sent:], len(self.text)
        return out


class Request:
    """One submitted request (see Engine.submit). Iterate for text pieces; result() waits."""

    def __init__(self, engine, rid: int, prompt: list[int], *, max_tokens: int, sampler: Sampler,
                 stop: Sequence[str], n_keep: int, n_truncated: int = 0) -> None:
        self._engine = engine
        self.id = rid
        self.prompt = prompt            # the tokens the request runs (after truncation)
        self.n_truncated = n_truncated  # prompt tokens dropped to fit the context
        self.max_tokens = max_tokens
        self.sampler = sampler
        self.n_keep = n_keep
        self.state = QUEUED
        self.t_submit = time.perf_counter()
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.generated: list[int] = []  # sampled tokens (end-of-generation excluded)
        self.n_cached = 0
        self.n_shift = 0
        self._stop = StopMatcher(stop)
        self._pieces: deque[str] = deque()
        self._cond = threading.Condition()
        self._result: Result | None = None
        self._cancel = False
        self.error: BaseException | None = None  # why it failed (stop "error")
        self.ignore_eos = False
        self._listeners: list = []      # called (from the engine's thread) when a piece or the result comes
        self._saved: Suspended | None = None  # a suspended request's state
        self._slot: Slot | None = None

    # ---- the caller's side ---------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self._result is not None

    def cancel(self) -> None:
        """Stop the request; its slot is freed at once (after the step running now, if any)."""
        self._engine._cancel(self)

    def result(self, timeout: float | None = None) -> Result:
        """Wait for the request to finish and return its Result.

        Raises:
            TimeoutError: not finished within timeout seconds.
            RequestError: the request failed (its forward pass raised; the cause is chained).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._result is None:
            if not self._engine._drive(self):
                with self._cond:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise TimeoutError(f"request {self.id} not finished after {timeout} s")
                    if self._result is None:
                        self._cond.wait(left if left is not None else 0.5)
            elif deadline is not None and time.monotonic() >= deadline and self._result is None:
                raise TimeoutError(f"request {self.id} not finished after {timeout} s")
        self._raise_error()
        return self._result

    def _raise_error(self) -> None:
        if self.error is not None:
            raise RequestError(f"request {self.id} failed: {type(self.error).__name__}: {self.error}") from self.error

    def __iter__(self) -> Iterator[str]:
        while True:
            with self._cond:
                if self._pieces:
                    yield self._pieces.popleft()
                    continue
                if self._result is not None:
                    break
            if not self._engine._drive(self):
                with self._cond:
                    if not self._pieces and self._result is None:
                        self._cond.wait(0.5)
        self._raise_error()

    def __aiter__(self) -> AsyncIterator[str]:
        """`async for piece in req`: the pieces without blocking the event loop; leaving the loop
        before the request is done cancels it."""
        return self._engine._pieces(self)

    def __repr__(self) -> str:
        return f"Request(id={self.id}, state={self.state}, prompt={len(self.prompt)}, generated={len(self.generated)})"

    def _take(self) -> tuple[str | None, bool]:
        """(the next piece or None, finished): for the asyncio face."""
        with self._cond:
            if self._pieces:
                return self._pieces.popleft(), False
            return None, self._result is not None

    # ---- the engine's side ---------------------------------------------------------------------
    def _changed(self) -> None:
        for f in self._listeners:
            f()
    @property
    def text(self) -> str:
        return self._stop.text

    def _emit(self, piece: str) -> bool:
        """Hand out a decoded piece; True when it completed a stop string."""
        out, hit = self._stop.push(piece)
        if out:
            with self._cond:
                self._pieces.append(out)
                self._cond.notify_all()
            self._changed()
        return hit

    def _finish(self, stop: str, tail: str = "", error: BaseException | None = None) -> Result:
        if tail and stop != "stop":
            self._emit(tail)
        rest = self._stop.flush() if stop != "stop" else ""
        now = time.perf_counter()
        ttft = (self.t_first if self.t_first is not None else now) - self.t_submit
        n = len(self.generated)
        span = (self.t_last - self.t_first) if self.t_first is not None and self.t_last is not None else 0.0
        res = Result(text=self._stop.text, tokens=list(self.generated), stop=stop, n_prompt=len(self.prompt),
                     n_cached=self.n_cached, n_generated=n, ttft_s=ttft,
                     gen_tps=(n - 1) / span if n > 1 and span > 0 else 0.0, n_shift=self.n_shift)
        with self._cond:
            if rest:
                self._pieces.append(rest)
            self.error = error
            self.state = DONE
            self._result = res
            self._cond.notify_all()
        self._changed()
        return res
