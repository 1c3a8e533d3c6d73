"""A request to the Engine and its result (llama-server's task and its final response).

A Request is the caller's handle: iterate it for the text pieces as they are generated, call
result() for the Result, cancel() to stop it. It is data plus the Driver it was given: whoever runs
it (the Engine) delivers its pieces with deliver() and ends it with complete(), and the Request
asks its driver to step (drive) or to stop it (cancel). This module knows nothing of the Engine.
Every method here is safe from any thread. Without a background loop (no `with engine:`),
iterating or waiting drives the steps itself.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from llamax.errors import RequestError
from llamax.sampling import Sampler
from llamax.sequence import SeqDecoder, TokenLogprob

if TYPE_CHECKING:
    from llamax.speculative import Speculative
    from llamax.tools import ToolCall, ToolPlan

QUEUED, PREFILL, GENERATING, SUSPENDED, DONE = "queued", "prefill", "generating", "suspended", "done"

POLL_S = 0.5  # a waiting caller looks again after this long (a driver that stopped stepping)


@dataclass(frozen=True)
class Result:
    """What a finished request gave.

    text: the generated text (up to a stop string, which is not included); tokens: the generated
    ids (an end-of-generation token excluded); stop: "eog", "length", "stop", "tool_calls" (the
    output was tool calls), "grammar" (the grammar allowed no token), "cancelled" or "error" (its
    forward pass failed: Request.result() raises RequestError instead of returning it);
    n_prompt: prompt tokens (after truncation, see Engine); n_cached: prompt tokens taken from the
    prefix cache, not computed; n_generated: len(tokens); ttft_s: submit to first token;
    gen_tps: generated tokens per second after the first; n_shift: context shifts;
    logprobs: each generated token's TokenLogprob (submit's logprobs=k), else None;
    prompt_logprobs: each prompt token's (the first is None: nothing precedes it), with
    submit(prompt_logprobs=True), else None; tool_calls: the tool calls the output made (submit's
    tools), else None (text is then the output's reply part, often empty; calls cut by max_tokens
    come with stop "length" and their arguments as far as they got); n_drafted / n_accepted:
    speculative decoding's drafted tokens verified, and of them the tokens the target sampled too.
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
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    tool_calls: list[ToolCall] | None = None
    n_drafted: int = 0
    n_accepted: int = 0


class Driver(Protocol):
    """What runs a Request (the Engine): the two things a Request asks of it."""

    def drive(self, req: Request) -> bool:
        """Run one step for a caller waiting on req; False when a background loop runs the steps
        (the caller then waits for req to change)."""

    def cancel(self, req: Request, wait: bool = True) -> None:
        """End req (req.cancelled is set). wait=True: before returning (after the step running now,
        if any); wait=False: at the next step, without blocking."""


class Request:
    """One submitted request (see Engine.submit). Iterate for text pieces; result() waits.

    Args:
        driver: what runs it (Driver).
        rid: its id (submission order).
        prompt: the tokens it runs (after truncation).
        decoder: its sampling step (sampler, stop strings, max_tokens, ignore_eos).
        n_keep: positions a context shift keeps.
        n_truncated: prompt tokens dropped to fit the context.
        tools: the tool plan whose format the output follows (llamax.tools.prepare), or None.
        prompt_logprobs: the driver records the prompt tokens' TokenLogprobs (decoder.n_logprobs
            alternatives each) in prompt_logprobs as it computes them.
        cache_prompt: False: reuse no cached prefix and leave nothing cached.
        slot: the slot it must run on (-1: any).
        speculative: its speculative decoding settings (llamax.Speculative), or None.
    """

    def __init__(self, driver: Driver, rid: int, prompt: list[int], *, decoder: SeqDecoder, n_keep: int,
                 n_truncated: int = 0, tools: ToolPlan | None = None, prompt_logprobs: bool = False,
                 cache_prompt: bool = True, slot: int = -1, speculative: Speculative | None = None) -> None:
        self._driver = driver
        self.id = rid
        self.prompt = prompt
        self.n_truncated = n_truncated
        self.decoder = decoder
        self.n_keep = n_keep
        self._state = QUEUED
        self.t_submit = time.perf_counter()
        self.t_start: float | None = None  # first admitted to a slot (its prompt processing began)
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.n_cached = 0
        self.n_fed = 0  # prompt tokens in its slot after its last prefill step, the cached ones included (0 before)
        self.n_shift = 0
        self.tools = tools
        self.cache_prompt, self.slot = cache_prompt, slot
        self.speculative = speculative
        self.n_drafted = self.n_accepted = 0
        # position i's TokenLogprob (None for position 0), filled by the driver during prefill
        self.prompt_logprobs: list[TokenLogprob | None] | None = [None] if prompt_logprobs else None
        self.error: BaseException | None = None  # why it failed (stop "error")
        self._cancelled = False
        self._pieces: deque[str] = deque()
        self._cond = threading.Condition()
        self._result: Result | None = None
        self._listeners: list[Callable[[], None]] = []  # called (from the driver's thread) on a piece or the result

    # ---- what it holds -------------------------------------------------------------------------
    @property
    def state(self) -> str:
        """QUEUED, PREFILL, GENERATING, SUSPENDED or DONE (set by the driver)."""
        return self._state

    @state.setter
    def state(self, value: str) -> None:
        if value == PREFILL and self.t_start is None:
            self.t_start = time.perf_counter()
        self._state = value

    @property
    def sampler(self) -> Sampler:
        return self.decoder.sampler

    @property
    def max_tokens(self) -> int:
        return self.decoder.max_tokens

    @property
    def ignore_eos(self) -> bool:
        return self.decoder.ignore_eos

    @property
    def generated(self) -> list[int]:
        """The sampled tokens so far (end-of-generation excluded)."""
        return self.decoder.generated

    @property
    def text(self) -> str:
        """The text so far (up to a stop string)."""
        return self.decoder.text

    @property
    def done(self) -> bool:
        return self._result is not None

    @property
    def cancelled(self) -> bool:
        """cancel() was called (the request ends at once, or at the driver's next step)."""
        return self._cancelled

    # ---- the caller's side ---------------------------------------------------------------------
    def cancel(self) -> None:
        """Stop the request; its slot is freed at once (after the step running now, if any)."""
        if self.done:
            return
        self._cancelled = True
        self._driver.cancel(self)

    def result(self, timeout: float | None = None) -> Result:
        """Wait for the request to finish and return its Result.

        Raises:
            TimeoutError: not finished within timeout seconds.
            RequestError: the request failed (its forward pass raised; the cause is chained).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._result is None:
            if not self._driver.drive(self):
                with self._cond:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise TimeoutError(f"request {self.id} not finished after {timeout} s")
                    if self._result is None:
                        self._cond.wait(left if left is not None else POLL_S)
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
            if not self._driver.drive(self):
                with self._cond:
                    if not self._pieces and self._result is None:
                        self._cond.wait(POLL_S)
        self._raise_error()

    def __aiter__(self) -> AsyncIterator[str]:
        """`async for piece in req`: the pieces without blocking the event loop; leaving the loop
        before the request is done cancels it."""
        return self._apieces()

    async def _apieces(self) -> AsyncIterator[str]:
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()

        def listener() -> None:
            loop.call_soon_threadsafe(wake.set)

        self._listeners.append(listener)
        stepping = True  # no background loop known: step in a worker thread
        try:
            while True:
                wake.clear()
                piece, finished = self._take()
                if piece is not None:
                    yield piece
                elif finished:
                    self._raise_error()
                    return
                elif stepping:
                    stepping = await asyncio.to_thread(self._driver.drive, self)
                else:  # a background loop fills it; look again now and then in case it stopped
                    try:
                        await asyncio.wait_for(wake.wait(), POLL_S)
                    except asyncio.TimeoutError:
                        stepping = True
        finally:
            self._listeners.remove(listener)
            if not self.done:
                self._cancelled = True
                self._driver.cancel(self, wait=False)

    def _take(self) -> tuple[str | None, bool]:
        """(the next piece or None, finished)."""
        with self._cond:
            if self._pieces:
                return self._pieces.popleft(), False
            return None, self._result is not None

    def __repr__(self) -> str:
        return f"Request(id={self.id}, state={self.state}, prompt={len(self.prompt)}, generated={len(self.generated)})"

    # ---- the driver's side ---------------------------------------------------------------------
    def _changed(self) -> None:
        for f in list(self._listeners):
            f()

    def deliver(self, piece: str) -> None:
        """Hand out a text piece (already clear of stop strings) to the caller."""
        if not piece:
            return
        with self._cond:
            self._pieces.append(piece)
            self._cond.notify_all()
        self._changed()

    def complete(self, stop: str, tail: str = "", error: BaseException | None = None) -> Result:
        """End the request: tail is its last piece; error: it failed (stop "error", result() raises
        RequestError). Returns its Result."""
        now = time.perf_counter()
        ttft = (self.t_first if self.t_first is not None else now) - self.t_submit
        n = len(self.generated)
        span = (self.t_last - self.t_first) if self.t_first is not None and self.t_last is not None else 0.0
        text, calls = self.text, None  # the tail is in it already (decoder.finish)
        if self.tools is not None and stop not in ("cancelled", "error"):
            content, found = self.tools.parse(text)  # the reply part of the output, and its calls
            text = content if content is not None else "" if found else text
            if found:  # cut by max_tokens: the calls so far, stop "length" (OpenAI's finish_reason)
                calls, stop = list(found), "tool_calls" if stop != "length" else stop
        res = Result(text=text, tokens=list(self.generated), stop=stop, n_prompt=len(self.prompt),
                     n_cached=self.n_cached, n_generated=n, ttft_s=ttft,
                     gen_tps=(n - 1) / span if n > 1 and span > 0 else 0.0, n_shift=self.n_shift,
                     logprobs=None if self.decoder.logprobs is None else list(self.decoder.logprobs),
                     prompt_logprobs=None if self.prompt_logprobs is None else list(self.prompt_logprobs),
                     tool_calls=calls, n_drafted=self.n_drafted, n_accepted=self.n_accepted)
        with self._cond:
            if tail:
                self._pieces.append(tail)
            self.error = error
            self._state = DONE
            self._result = res
            self._cond.notify_all()
        self._changed()
        return res
