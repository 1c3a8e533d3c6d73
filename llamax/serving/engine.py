"""llamax.Engine: many requests served by one context (llama-server's slots and update_slots).

Each step is one decode of at most n_batch tokens (update_slots):

    cancelled requests      finished, their slots freed
    admission               suspended requests first, then the FIFO queue, while slots are free:
                            the prefix cache gives the longest cached prefix of the prompt by
                            seq_cp (its cells' sequence sets are shared, nothing is copied or
                            recomputed); a request that shares more with a prompt still being
                            prefilled waits one step for it to be cached instead of computing it
                            twice; a request is admitted when its uncomputed prompt fits the free
                            cells (after evicting cached prefixes), or when nothing else runs
    the batch               one token of every generating slot (a slot at its context shifts
                            itself first, or stops with "length"), then prompt chunks of the
                            slots still prefilling (chunked prefill), logits on each sequence's
                            last token
    decode                  when the batch does not fit: evict cached prefixes (least recently
                            used, tail first; their states kept in the host-RAM tier) and retry; then suspend the youngest running request
                            (its sequence saved to RAM by state_seq_get_data within a byte budget,
                            else its tokens kept to be computed again) and retry
    sampling                each request's own seeded Sampler on its logits row: the kernels are
                            batch-invariant, so a request's tokens do not depend on what runs beside it
    finished requests       their cells go to the prefix cache (prompt and generated tokens), the
                            slot is free at once

Speculative decoding (Engine(speculative=...) for every request, submit(speculative=...) per request):
a generating slot's token is followed in the batch by the tokens its drafter proposes, as many as the
policy finds worth their cost (llamax.speculative.SpecPolicy: each request's acceptance rate against a
cost model of the step fitted to the steps seen, so that with many busy slots, where the decode is
compute-bound, little or nothing is drafted); its logits rows are sampled in order by the request's
own decoder (sample-and-accept), and the rejected drafts leave the memory by seq_rm before anything
else runs. Drafts never suspend or evict anything: a batch that does not fit drops them first.

Sequence ids: slot i decodes on sequence i. How prefixes are reused is the reuse's (reuse.py: one
protocol, the Engine never asks which): with kv_unified and prefix_cache the ids from n_parallel up
to 256 belong to the prefix cache's leaves (one cached prompt each). With one stream per slot
(kv_unified=False) cells cannot be shared between streams: each slot keeps its last request's cells
(llama-server's cache_prompt) and a request goes to the free slot whose cache shares the longest
prefix with its prompt; that prefix is reused in place, nothing is copied between streams.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import pathlib
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Mapping, Sequence

import numpy as np

from llamax import checks
from llamax import state as _state
from llamax.batch import Batch
from llamax.context import Context
from llamax.dtypes import LLAMA_MAX_SEQ
from llamax.errors import BatchError, EngineFullError, LlamaxError, NoKVSlotError, StateError
from llamax.grammar import Grammar
from llamax.params import ContextParams
from llamax.sampling import Sampler, rows_logprobs
from llamax.sequence import (N_KEEP_MARGIN, SeqDecoder, TokenLogprob, bos_offset, context_shift, keep_length,
                             needs_room, prompt_tokens, shift_discard)
from llamax.serving.request import GENERATING, PREFILL, SUSPENDED, Request, Result
from llamax.serving.host_tier import HostTier, budget_bytes
from llamax.serving.reuse import PrefixReuse, PrefixState, StateIO, reuse_class
from llamax.speculative import Speculative, Speculator, cut_tail, equal_drafts, equalize, resolve, verify

log = logging.getLogger("llamax")

GROWTH = 16                 # free cells per running request (and the new one) a request needs to join:
                            # without that headroom the youngest would be suspended again at once
SUSPEND_BYTES = 1 << 30     # RAM for the states of suspended requests
LOGPROB_CHUNK = 64          # prompt tokens per step of a request that wants every prompt token's logprobs
                            # (each one's logits row is kept: 64 MiB for Gemma 3's 262k vocabulary)


@dataclasses.dataclass
class SeqState:
    """What a slot holds of its request's sequence: saved whole when the request is suspended."""
    tokens: list[int] = dataclasses.field(default_factory=list)  # the sequence, in position order (n_past = len)
    feed: list[int] = dataclasses.field(default_factory=list)    # tokens to prefill
    fed: int = 0                     # how many of feed are in the cache
    pending: int | None = None       # the sampled token decoded next
    draft: list[int] = dataclasses.field(default_factory=list)  # drafted tokens decoded after it this step
    shifted: bool = False            # a context shift moved it (its tokens are no longer a prefix)


@dataclasses.dataclass
class Suspended:
    """A suspended request: its sequence's state blob (None: compute it again) and its slot's state."""
    blob: bytes | None
    state: SeqState


class Slot:
    """One sequence of the context and the request decoding on it."""

    def __init__(self, i: int) -> None:
        self.id = self.seq = i
        self.req: Request | None = None
        self.seq_state = SeqState()      # what the sequence holds while a request runs on it

    @property
    def state(self) -> str:
        return "idle" if self.req is None else self.req.state

    @property
    def running(self) -> Request:
        """The request on the slot; note: only for a busy slot."""
        assert self.req is not None, f"slot {self.id} is idle"
        return self.req

    def take(self) -> SeqState:
        """The slot's sequence state, leaving the slot's empty."""
        out, self.seq_state = self.seq_state, SeqState()
        return out

    def put(self, st: SeqState) -> None:
        self.seq_state = st


class Engine:
    """Serve many requests from one model (see the module docstring for one step).

    Args:
        model: a llamax.Model, or a registry name / GGUF path to load.
        n_ctx: cells of the cache (0: the model's training context); with kv_unified each request
            may use all of them (n_ctx_seq = n_ctx), else n_ctx / n_parallel each.
        n_parallel: slots (requests decoding at once).
        n_batch, n_ubatch, type_k, type_v, flash_attn, kv_unified, swa_full, n_threads: the
            context's (ContextParams).
        prefix_cache: keep finished requests' cells and reuse prefixes (a radix tree over the cells
            with kv_unified, the slots' own caches without).
        max_queue: requests that may wait for a slot; submit raises EngineFullError beyond.
        slot_save_path: the directory slot_save / slot_restore use (None: refused). A save writes
            a temporary file there and renames it over the name (see llamax.state.save_file): a
            full disk or a killed process leaves the previous file whole; the temporary files a
            killed process left behind are removed when an Engine starts on the directory.
        n_ctx_slot: the context of one request (0: n_ctx_seq, all of a unified cache); a request
            that reaches it shifts or stops, however much of the cache is free.
        context_shift: a request at its context shifts (keeping its n_keep tokens) instead of
            stopping with "length"; a prompt longer than the context is then truncated as
            llama-server does.
        suspend_bytes: RAM for suspended requests' saved states; beyond it a suspended request's
            tokens are computed again when it resumes.
        speculative: speculative decoding for every request (None: off unless a request asks for
            "ngram"; True / "ngram" / a llamax.Speculative; kind "draft" loads its draft model here and
            checks its vocabulary: ModelError). Output is the same with and without it.
        cache_ram: MiB of host RAM for sequence states (llama-server's --cache-ram; None: its default,
            8192 MiB; 0: off; -1: no limit): the prefixes the prefix cache evicts from the cells, and a
            recurrent or hybrid model's state checkpoints (its only prefix reuse). A hit is restored
            when that is cheaper than computing its tokens (measured restore and prefill speeds);
            least recently used states go first. Not used by the slots' own caches (kv_unified=False).

    Models with recurrent layers (Mamba, Jamba, ...) run the same way: every request has one state
    (n_seq_max = n_parallel, so cells never run out for a pure recurrent model), batches are split
    equally, the prefix reuse keeps state checkpoints in the host-RAM tier (reuse.CheckpointReuse),
    speculative decoding rolls states back by the memory's per-token rows, and a context shift
    renumbers the state's positions (it keeps what it folded in; a hybrid's attention cells of the
    discarded positions go, and positions there only mask).

    `with Engine(...) as engine:` runs the steps in a background thread; without it the caller
    drives them with step() (or by waiting on a request, which steps for it).
    """

    def __init__(self, model, *, n_ctx: int = 0, n_parallel: int = 4, n_batch: int = 2048, n_ubatch: int = 512,
                 type_k: str = "f16", type_v: str = "f16", flash_attn: bool = True, kv_unified: bool = True,
                 swa_full: bool = False, prefix_cache: bool = True, max_queue: int = 256,
                 n_threads: int | None = None, slot_save_path: str | os.PathLike | None = None,
                 context_shift: bool = True, n_ctx_slot: int = 0, suspend_bytes: int = SUSPEND_BYTES,
                 speculative: Speculative | bool | str | None = None, cache_ram: int | None = None) -> None:
        from llamax.model import Model

        if isinstance(model, (str, os.PathLike)):
            model = Model.load(model, n_threads=n_threads)
        n_parallel = checks.in_range(n_parallel, "n_parallel", 1, LLAMA_MAX_SEQ + 1)
        self.max_queue = checks.in_range(max_queue, "max_queue", 0, 2**31)
        self.suspend_bytes = checks.in_range(suspend_bytes, "suspend_bytes", 0, 2**62)
        self.model = model
        self.n_parallel = n_parallel
        self.tier = HostTier(budget_bytes(cache_ram))
        reuse = reuse_class(bool(prefix_cache), bool(kv_unified), n_parallel, bool(model.hparams.recurrent_layers))
        n_seq_max = reuse.n_seq_max(n_parallel)
        params = ContextParams(n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_ubatch, n_seq_max=n_seq_max,
                               kv_unified=kv_unified, type_k=type_k, type_v=type_v, flash_attn=flash_attn,
                               swa_full=swa_full, n_threads=n_threads)
        self.ctx = Context(model, params)
        self.params = self.ctx.params
        self.memory = self.ctx.memory
        n_ctx_slot = checks.in_range(n_ctx_slot, "n_ctx_slot", 0, 2**31)
        self.n_ctx_seq = min(self.params.n_ctx_seq, n_ctx_slot) if n_ctx_slot else self.params.n_ctx_seq
        if self.n_ctx_seq < 2 * N_KEEP_MARGIN:
            raise ValueError(f"n_ctx_slot = {n_ctx_slot}: a slot needs at least {2 * N_KEEP_MARGIN} cells")
        self.n_batch = self.params.n_batch
        self.context_shift = bool(context_shift) and self.memory.can_shift
        self.reuse: PrefixReuse = reuse(self.memory, n_parallel, tier=self.tier,
                                        state=StateIO(self.ctx.state_seq_get_data, self.ctx.state_seq_set_data))
        self.slot_save_path = None if slot_save_path is None else pathlib.Path(slot_save_path).resolve()
        if self.slot_save_path is not None and self.slot_save_path.is_dir():
            stale = _state.remove_stale_tmp(self.slot_save_path)  # a save killed midway left these
            if stale:
                log.warning("llamax engine: removed %d unfinished slot save(s) from %s: %s", len(stale),
                            self.slot_save_path, ", ".join(stale))
        self._slots = [Slot(i) for i in range(n_parallel)]
        self._queue: deque[Request] = deque()
        self._resume: list[Request] = []   # suspended requests, oldest first
        self._saved: dict[Request, Suspended] = {}  # their saved states
        self._suspended_bytes = 0
        self._lock = threading.RLock()     # the engine's state and the context: one step at a time
        self._qlock = threading.Lock()     # the queue, for submit from any thread
        self._wake = threading.Condition(self._qlock)
        self._next_id = 0
        self._thread: threading.Thread | None = None
        self._closing = False
        self._error: BaseException | None = None
        self._m = dict(prompt_tokens=0, gen_tokens=0, requests_finished=0, requests_cancelled=0, requests_failed=0,
                       requests_suspended=0, steps=0, busy_s=0.0, spec_drafted=0, spec_accepted=0)
        self.speculative = resolve(speculative)
        self._spec: dict[str, Speculator] = {}   # one per kind in use, created on first use
        if self.speculative is not None:
            self._speculator(self.speculative)

    def __repr__(self) -> str:
        return (f"Engine(n_parallel={self.n_parallel}, n_ctx={self.params.n_ctx}, n_ctx_seq={self.n_ctx_seq}, "
                f"prefix_cache={self.reuse.name})")

    def _speculator(self, spec: Speculative) -> Speculator:
        """The engine's speculator of spec's kind (made on first use; the draft model's only with the
        engine's own Speculative), the memory asked to keep spec's rollback window (between steps).

        Raises:
            ValueError: kind "draft" when the engine has no draft model."""
        with self._lock:
            sp = self._spec.get(spec.kind)
            if sp is None:
                own = spec if spec.kind == "ngram" else self.speculative  # a draft model only as the engine's
                if own is None or own.kind != spec.kind:
                    raise ValueError("speculative kind 'draft' per request needs the engine's draft model: "
                                     "Engine(speculative=Speculative(kind='draft', model=...))")
                sp = self._spec[spec.kind] = Speculator(own, self.model,
                                                        n_seq_max=self.n_parallel, n_ctx=self.params.n_ctx,
                                                        n_threads=self.params.n_threads)
            self.memory.reserve_rollback(spec.n_max + 1)
            return sp

    # ---- the background loop ---------------------------------------------------------------------
    def __enter__(self) -> Engine:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close(cancel=True)

    def start(self) -> None:
        """Run the steps in a background thread until close()."""
        with self._qlock:
            if self._thread is not None:
                return
            self._closing = False
            self._thread = threading.Thread(target=self._loop, name="llamax-engine", daemon=True)
            self._thread.start()

    def close(self, cancel: bool = True) -> None:
        """Stop the background loop: cancel=True cancels every request first, else waits for them."""
        t = self._thread
        if cancel:
            with self._qlock:
                waiting = list(self._queue) + list(self._resume)
            for r in waiting + [s.req for s in self._slots if s.req is not None]:
                r.cancel()
        with self._qlock:
            self._closing = True
            self._wake.notify_all()
        if t is not None:
            t.join()
            self._thread = None
        if cancel:
            with self._lock:
                self._reap_cancelled()

    @property
    def failed(self) -> BaseException | None:
        """The error that stopped the background loop, or None. A failed forward pass does not stop
        it: the requests whose own forward pass fails end with stop "error" (result() raises
        RequestError) and the others go on. Any other error in a step (a bug, KeyboardInterrupt)
        stops the loop: every request it held fails the same way; submit raises LlamaxError from
        then on."""
        return self._error

    def _has_work(self) -> bool:
        return bool(self._queue or self._resume or any(s.req is not None for s in self._slots))

    def _loop(self) -> None:
        while True:
            with self._qlock:
                while not self._has_work() and not self._closing:
                    self._wake.wait()
                if self._closing and (not self._has_work() or all(
                        r.cancelled for r in list(self._queue) + self._resume +
                        [s.req for s in self._slots if s.req is not None])):
                    return
            try:
                self.step()
            except BaseException as e:  # outside a forward pass (those fail their requests): the loop stops
                log.exception("llamax engine: step failed")
                self._error = e
                with self._lock:
                    self._fail_all(e)
                return

    # ---- the Driver of its requests (llamax.serving.request.Driver) --------------------------------
    def drive(self, req: Request) -> bool:
        """Step for a caller waiting on req when no background loop runs; False if one does.

        Raises:
            LlamaxError: the background loop stopped after an error."""
        if self._thread is not None and self._thread.is_alive():
            return False
        if self._error is not None:
            raise LlamaxError("the engine stopped after an error") from self._error
        if req.done:
            return True
        self.step()
        return True

    def _notify(self) -> None:
        with self._qlock:
            self._wake.notify_all()

    # ---- submitting ------------------------------------------------------------------------------
    def _tokens(self, prompt) -> list[int]:
        return prompt_tokens(self.model, prompt)

    def submit(self, prompt, *, max_tokens: int = 128, temperature: float = 0.8, top_k: int = 40,
               top_p: float = 0.95, min_p: float = 0.05, repeat_penalty: float = 1.0,
               presence_penalty: float = 0.0, frequency_penalty: float = 0.0, repeat_last_n: int = 64,
               logit_bias: Mapping[int, float] | None = None, grammar: Grammar | None = None,
               seed: int | None = None, stop: str | Sequence[str] | None = None, n_keep: int = 0,
               ignore_eos: bool = False, logprobs: int | None = None, prompt_logprobs: bool = False,
               tools: Sequence[Mapping] | None = None, tool_choice: str | Mapping = "auto",
               parallel_tool_calls: bool = True, cache_prompt: bool = True, slot: int = -1,
               speculative: Speculative | bool | str | None = None) -> Request:
        """Queue a request; returns its Request at once. Thread-safe.

        prompt: a str (tokenized with special tokens), a list of token ids, or chat messages
        ([{"role": ..., "content": ...}], the model's template applied). max_tokens: -1 for no limit.
        temperature <= 0 is greedy. The sampler's settings are llamax.Sampler's (penalties over the
        last repeat_last_n tokens, logit_bias: token id -> bias, float("-inf") bans; grammar: a
        llamax.Grammar the output follows, compiled here for the model's vocabulary). stop: strings
        that end the text (not included). n_keep: prompt tokens a context shift keeps (-1: the whole
        prompt). ignore_eos: never sample an end-of-generation token (llama-server's ignore_eos; for
        benchmarks). logprobs: record every generated token's log-probability and its top k
        alternatives (0..20; Result.logprobs). prompt_logprobs: the prompt tokens' too
        (Result.prompt_logprobs; the prompt is then computed whole, with no cached prefix, in chunks
        of LOGPROB_CHUNK tokens). tools / tool_choice / parallel_tool_calls: OpenAI's tools (chat
        messages only): the prompt is rendered with them (the model's own tool syntax, else
        llama.cpp's generic JSON format), the output is constrained to the choice (a grammar: a tool
        call for "required" or a named function) and parsed into Result.tool_calls; earlier tool calls
        and results in the messages render through the same layer, with or without tools. cache_prompt:
        False computes the whole prompt and keeps nothing of it for later requests. slot: run on
        this slot (-1: any; the request waits for it). speculative: None (the engine's setting), False
        (off), True (the engine's, else "ngram"), "ngram" or a llamax.Speculative (its n_max / n_min;
        kind "draft" uses the engine's draft model): Result.n_drafted / n_accepted count the drafts;
        the output is the same.

        Raises:
            BatchError: an empty prompt, a token outside the vocabulary, or a prompt that does not
                fit a slot's context when context shift is off.
            EngineFullError: max_queue requests are already waiting.
            TypeError, ValueError: bad sampling settings or arguments (an invalid grammar, a bad
                tool or tool_choice, logprobs outside 0..20).
        """
        plan = None
        is_chat = isinstance(prompt, Sequence) and bool(prompt) and all(isinstance(m, Mapping) for m in prompt)
        if tools is None and is_chat and any(m.get("tool_calls") or m.get("role") == "tool" for m in prompt):
            tools, tool_choice = [], "none"  # earlier tool turns, no tools now: rendered by the tool layer
        if tools is not None:
            if not is_chat:
                raise TypeError("tools need the prompt as chat messages ([{'role': ..., 'content': ...}])")
            from llamax.tools import prepare
            plan = prepare(self.model, list(prompt), list(tools), tool_choice, bool(parallel_tool_calls))
            if plan.schema is not None or plan.lark is not None:
                if grammar is not None:
                    raise ValueError("tools constrain the output to their format already: no grammar (or "
                                     "response_format) beside them")
                grammar = Grammar.json_schema(plan.schema) if plan.schema is not None else Grammar.lark(str(plan.lark))
        toks = self._tokens(plan.prompt if plan is not None else prompt)
        max_tokens = checks.integer(max_tokens, "max_tokens")
        if max_tokens < -1:
            raise ValueError(f"max_tokens = {max_tokens}: >= 0, or -1 for no limit")
        n_keep = checks.integer(n_keep, "n_keep")
        if n_keep < -1:
            raise ValueError(f"n_keep = {n_keep}: >= 0, or -1 for the whole prompt")
        slot = checks.integer(slot, "slot")
        if not -1 <= slot < self.n_parallel:
            raise ValueError(f"slot = {slot}: -1 (any) or a slot in [0, {self.n_parallel})")
        spec = self.speculative if speculative is None else resolve(speculative, self.speculative)
        if spec is not None:
            self._speculator(spec)  # ValueError for a draft model the engine lacks
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if not all(isinstance(s, str) for s in stops):
            raise TypeError("stop: a string or a list of strings")
        sampler = Sampler(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                          repeat_penalty=repeat_penalty, seed=seed, presence_penalty=presence_penalty,
                          frequency_penalty=frequency_penalty, repeat_last_n=repeat_last_n,
                          logit_bias=logit_bias, grammar=grammar)
        keep = keep_length(n_keep, len(toks), bos_offset(self.model, prompt), self.n_ctx_seq)
        n_trunc = 0
        if len(toks) + 1 >= self.n_ctx_seq:
            if not self.context_shift:
                raise BatchError(f"a prompt of {len(toks)} tokens does not fit a slot's context of {self.n_ctx_seq} "
                                 "cells (one more is needed for the next token) and context shift is off")
            toks, n_trunc = self._truncate(toks, keep)
        decoder = SeqDecoder(self.model, sampler, max_tokens=max_tokens, stop=stops, ignore_eos=bool(ignore_eos),
                             logprobs=logprobs,  # compiles the grammar for the vocabulary (ValueError)
                             special=plan is not None and plan.format == "hermes")  # <tool_call> shown
        with self._qlock:
            if self._error is not None:
                raise LlamaxError("the engine stopped after an error") from self._error
            if self._closing and self._thread is not None:
                raise LlamaxError("the engine is closing")
            if len(self._queue) >= self.max_queue:
                raise EngineFullError(f"the queue is full: {len(self._queue)} requests wait for "
                                      f"{self.n_parallel} slots (max_queue={self.max_queue})")
            req = Request(self, self._next_id, toks, decoder=decoder, n_keep=keep, n_truncated=n_trunc,
                          tools=plan, prompt_logprobs=bool(prompt_logprobs), cache_prompt=bool(cache_prompt),
                          slot=slot, speculative=spec)
            self._next_id += 1
            self._queue.append(req)
            self._wake.notify_all()
        return req

    async def asubmit(self, prompt, **kw) -> Request:
        """submit() from asyncio: tokenizing and templating a long prompt run in a worker thread,
        not on the event loop."""
        return await asyncio.to_thread(self.submit, prompt, **kw)

    def _truncate(self, toks: list[int], keep: int) -> tuple[list[int], int]:
        """llama-server's prompt truncation: keep the first `keep` tokens, drop whole blocks of half
        the rest of the context after them, so the prompt leaves room for generation."""
        n_left = self.n_ctx_seq - keep
        block = max(n_left // 2, 1)
        erased = (len(toks) - keep - block + block - 1) // block
        out = toks[:keep] + toks[keep + erased * block:]
        while len(out) + 1 >= self.n_ctx_seq:  # a keep close to the context: drop more of the middle
            out = out[:keep] + out[keep + 1:] if len(out) > keep + 1 else out[:self.n_ctx_seq - 2]
        return out, len(toks) - len(out)

    def generate(self, prompt, **kw) -> Result:
        """submit(prompt, **kw).result()."""
        return self.submit(prompt, **kw).result()

    async def stream(self, prompt, **kw) -> AsyncIterator[str]:
        """Submit and yield the text pieces as they come (asyncio); leaving the loop early cancels."""
        async for piece in self.submit(prompt, **kw):
            yield piece

    async def agenerate(self, prompt, **kw) -> Result:
        """Submit and wait for the Result without blocking the event loop."""
        req = self.submit(prompt, **kw)
        async for _ in req:
            pass
        return req.result()

    # ---- cancelling ------------------------------------------------------------------------------
    def cancel(self, req: Request, wait: bool = True) -> None:
        """End req, whose cancel() was called: at once (wait=True, no background loop), else before
        the next step."""
        if req.done:
            return
        if not wait or self._thread is not None and self._thread.is_alive():
            self._notify()  # the loop (or the next step) ends it
            return
        with self._lock:
            self._reap_cancelled()

    def _reap_cancelled(self) -> None:
        with self._qlock:
            gone = [r for r in self._queue if r.cancelled]
            for r in gone:
                self._queue.remove(r)
        for r in gone:
            self._end(r, "cancelled")
        for r in [r for r in self._resume if r.cancelled]:
            self._resume.remove(r)
            self._drop_suspended(r)
            self._end(r, "cancelled")
        for s in self._slots:
            if s.req is not None and s.req.cancelled:
                self._finish(s, "cancelled")

    def _end(self, req: Request, stop: str, error: BaseException | None = None) -> None:
        req.complete(stop, req.decoder.finish(stop), error=error)
        self._count(stop)

    def _fail_all(self, error: BaseException) -> None:
        """The loop stopped on an error it cannot pin on one request: every request fails with it."""
        for s in self._slots:
            if s.req is not None:
                self._finish(s, "error", cache=False, error=error)
        with self._qlock:
            waiting, self._queue = list(self._queue), deque()
        for r in waiting + self._resume:
            if r in self._saved:
                self._drop_suspended(r)
            self._end(r, "error", error)
        self._resume = []

    # ---- one step (update_slots) -----------------------------------------------------------------
    def step(self) -> int:
        """One scheduling step: admit, build one batch of <= n_batch tokens, decode it, sample.
        Returns the number of tokens decoded (0 when there was nothing to do)."""
        with self._lock:
            t0 = time.perf_counter()
            self._reap_cancelled()
            self._admit()
            batch = self._build()
            n = self._decode(batch)
            if n:
                self._m["steps"] += 1
                self._m["busy_s"] += time.perf_counter() - t0
            return n

    def _free_cells(self) -> int:
        return self.memory.token_room

    def _busy(self) -> list[Slot]:
        return [s for s in self._slots if s.req is not None]

    def _admit(self) -> None:
        free = [s for s in self._slots if s.req is None]
        while free and self._resume:
            req = self._resume[0]
            if not self._resume_into(req, free[0]):
                return  # wait for room; new requests do not overtake a suspended one
            self._resume.pop(0)
            free.pop(0)
        i = 0
        while free:
            with self._qlock:
                if i >= len(self._queue):
                    return
                req = self._queue[i]
            slot = self._choose(req, free)
            if slot is None:
                i += 1
                continue
            if not self._start(req, slot):
                return  # no room yet: later requests wait behind it
            with self._qlock:
                self._queue.remove(req)
            free.remove(slot)

    def _choose(self, req: Request, free: list[Slot]) -> Slot | None:
        """The slot for req, or None to let it wait a step for a prompt being prefilled that shares
        more with it than the cache holds now."""
        if req.slot >= 0:  # pinned: its slot or nothing
            free = [s for s in free if s.id == req.slot]
            if not free:
                return None
        prefilling = [s.seq_state.feed for s in self._slots if s.req is not None and s.req.state == PREFILL]
        seq = self.reuse.pick(req.prompt, [s.seq for s in free], prefilling)
        return None if seq is None else self._slots[seq]

    def _start(self, req: Request, slot: Slot) -> bool:
        """Put req on slot with the cached prefix of its prompt; False if its prompt does not fit
        the free cells (after evicting cached prefixes) while other requests run. The lookup has
        no side effect: a request turned away leaves the cache and its counters as they were
        (but for the room made), and is looked up again at a later step."""
        prompt = req.prompt
        # the last prompt token is always computed (its logits are needed); all of them for the
        # prompt's logprobs, or when the request keeps nothing of the cache
        limit = len(prompt) - 1 if req.cache_prompt and req.prompt_logprobs is None else 0
        hit = self.reuse.lookup(slot.seq, prompt, limit)
        need = len(prompt) - hit.n + hit.cells + GROWTH * (len(self._busy()) + 1)
        self.reuse.lock(slot.seq, hit)  # evicting for room must not take the prefix
        if need > self._free_cells():
            self.reuse.evict(need - self._free_cells())
        if need > self._free_cells() and self._busy():
            self.reuse.unlock(slot.seq)
            return False
        n = self.reuse.attach(slot.seq, hit)  # seq_cp the prefix, count the lookup
        slot.seq_state.tokens = list(prompt[:n])
        slot.req, slot.seq_state.shifted = req, False
        slot.seq_state.feed, slot.seq_state.fed, slot.seq_state.pending = prompt, n, None
        req.n_cached = n
        req.state = PREFILL
        return True

    def _build(self) -> list[tuple[Slot, list[int], bool]]:
        """(slot, tokens, wants logits) of the step's batch: generating slots first, then prefill chunks."""
        out: list[tuple[Slot, list[int], bool]] = []
        budget = self.n_batch
        for s in self._slots:
            if s.req is None or s.req.state != GENERATING or budget == 0:
                continue
            if needs_room(len(s.seq_state.tokens), self.n_ctx_seq) and not self._shift(s):
                self._finish(s, "length")
                continue
            tok = s.seq_state.pending
            assert tok is not None  # a generating slot holds its next token
            out.append((s, [tok], True))
            budget -= 1
        budget -= self._draft(out, budget)
        for s in self._slots:
            if s.req is None or s.req.state != PREFILL or budget == 0:
                continue
            st = s.seq_state
            end = st.fed + (min(budget, LOGPROB_CHUNK) if self._all_rows(s) else budget)
            if not st.shifted:  # a state the reuse keeps is taken where a chunk ends
                end = min(end, self.reuse.boundary(s.seq, st.fed, len(st.feed)))
            chunk = st.feed[st.fed:end]
            out.append((s, chunk, st.fed + len(chunk) == len(st.feed)))
            budget -= len(chunk)
        return out

    def _draft(self, gen: list[tuple[Slot, list[int], bool]], budget: int) -> int:
        """Append the drafted tokens to the generating slots' entries of the batch (in place), within
        the batch's budget, the first ubatch (every verification in one ubatch, so that an SWA cache
        only reuses cells masked before the drafts) and the free cells; returns how many."""
        groups: dict[str, list[int]] = {}
        for i, (s, _, _) in enumerate(gen):
            s.seq_state.draft = []
            spec = s.running.speculative
            if spec is not None:
                groups.setdefault(spec.kind, []).append(i)
        if not groups:
            return 0
        room = min(budget, self.params.n_ubatch - len(gen), self._free_cells() - len(gen) - GROWTH)
        equal = equal_drafts(self.memory, self.params.kv_unified)
        if equal and any(s.req is not None and s.req.state == PREFILL for s in self._slots):
            return 0  # see llamax.speculative.equal_drafts
        got: dict[int, list[int]] = {}
        for kind, idx in groups.items():
            asks, specs = [], []
            for i in idx:
                s, _, _ = gen[i]
                req, st = s.running, s.seq_state
                assert req.speculative is not None
                cap = self.n_ctx_seq - 2 - len(st.tokens)
                if req.max_tokens >= 0:
                    cap = min(cap, req.max_tokens - len(req.generated) - 1)
                if equal:
                    cap = min(cap, self.params.n_ubatch // len(gen) - 1)
                asks.append((s.seq, cap))
                specs.append(req.speculative)

            def tokens(j: int, idx=idx) -> list[int]:  # the slot's sequence and its next token
                s, chunk, _ = gen[idx[j]]
                return s.seq_state.tokens + chunk

            got.update(zip(idx, self._spec[kind].plan(asks, tokens, n_fixed=len(gen), specs=specs)))
        if equal:
            got = dict(zip(got, equalize(list(got.values()))))
            if sum(map(len, got.values())) > room:  # cut unequally they would spread over ubatches
                return 0
        n = 0
        for i, d in got.items():
            d = d[:max(room - n, 0)]
            if d:
                s, chunk, want = gen[i]
                s.seq_state.draft = d
                gen[i] = (s, chunk + d, want)
                n += len(d)
        return n

    @staticmethod
    def _undraft(batch: list[tuple[Slot, list[int], bool]]) -> list[tuple[Slot, list[int], bool]]:
        """The batch without its drafted tokens."""
        out = []
        for s, chunk, want in batch:
            n = len(s.seq_state.draft)
            s.seq_state.draft = []
            out.append((s, chunk[:len(chunk) - n], want))
        return out

    def _decode(self, batch: list[tuple[Slot, list[int], bool]]) -> int:
        while batch:
            toks, seqs, logits = [], [], []
            for s, chunk, want in batch:
                toks += chunk
                seqs += [s.seq] * len(chunk)
                all_rows = self._all_rows(s) or bool(s.seq_state.draft)
                logits += [True] * len(chunk) if all_rows else [False] * (len(chunk) - 1) + [want]
            try:
                t0 = time.perf_counter()
                self.ctx.decode(Batch(toks, seq_ids=seqs, logits=logits))
            except NoKVSlotError:
                if any(s.seq_state.draft for s, _, _ in batch):  # drafts never make room: drop them first
                    batch = self._undraft(batch)
                    continue
                batch = self._make_room(batch, len(toks))
                continue
            except Exception as e:  # a failed forward pass: the context took the batch's tokens back out
                return self._isolate(self._undraft(batch), e)
            dt = time.perf_counter() - t0
            if self._spec and all(s.req is not None and s.req.state == GENERATING for s, _, _ in batch):
                for sp in self._spec.values():
                    sp.observe(len(toks), dt)
            if all(s.req is not None and s.req.state == PREFILL for s, _, _ in batch):
                self.tier.cost.saw_prefill(len(toks), dt)  # what a restored state saves per token
            self._after(batch)
            return len(toks)
        return 0

    def _isolate(self, batch, error: Exception) -> int:
        """The forward pass of batch raised, and the cache holds none of its tokens (Context.decode
        removed them; every slot's state is as before the step). One request alone: it fails with
        the error (RequestError from its result()), its cells go back. Several: each is decoded
        alone, so only those whose own forward pass fails again end; the others go on with the same
        tokens (the kernels are batch-invariant). Returns the tokens decoded."""
        if len(batch) == 1:
            s = batch[0][0]
            log.error("llamax engine: request %d failed: %s: %s", s.running.id, type(error).__name__, error)
            self._finish(s, "error", cache=False, error=error)
            return 0
        reqs = [s.req for s, _, _ in batch]
        return sum(self._decode([part]) for part, req in zip(batch, reqs)
                   if part[0].req is req)  # not suspended or ended by an earlier part's retry

    def _make_room(self, batch, n_tokens: int):
        """The batch did not fit: evict cached prefixes, else suspend the youngest request, else
        (one request alone) halve its prompt chunk or shift it; returns the batch to retry."""
        if self.reuse.evict(n_tokens) > 0:
            return batch
        busy = self._busy()
        if len(busy) > 1:
            victim = max(busy, key=lambda s: s.running.id)
            self._suspend(victim)
            return [b for b in batch if b[0] is not victim]
        s, chunk, want = batch[0]
        if len(chunk) > 1:
            half = chunk[:len(chunk) // 2]
            return [(s, half, False)]
        if s.req.state == GENERATING and self._shift(s):
            return batch
        self._finish(s, "length")
        return []

    def _after(self, batch) -> None:
        """Take the decoded tokens into the slots and sample the next token where logits came."""
        j = 0
        for s, chunk, want in batch:
            j += len(chunk)
            req, st = s.running, s.seq_state
            if self._all_rows(s):
                self._prompt_logprobs(req, st.fed, j - len(chunk), len(chunk))
            st.tokens += chunk
            if req.state == GENERATING:
                self._verify(s, j - len(chunk))
                continue
            if req.state == PREFILL:
                st.fed += len(chunk)
                req.n_fed = st.fed
                self._m["prompt_tokens"] += len(chunk)
                if not st.shifted and req.cache_prompt:
                    self.reuse.note_chunk(s.seq, st.tokens, len(st.feed))
                if st.fed < len(st.feed):
                    continue
                if st.pending is not None:  # a suspended request computed again: go on generating
                    req.state = GENERATING
                    continue
                if not st.shifted and req.cache_prompt:
                    self.reuse.note_prefilled(s.seq, st.tokens)
                req.decoder.accept_prompt(req.prompt)
                req.state = GENERATING
                if req.decoder.exhausted:
                    self._finish(s, "length")
                    continue
            if want:
                self._sample(s, self.ctx.get_logits_ith(j - 1))

    @staticmethod
    def _all_rows(s: Slot) -> bool:
        """The slot prefills a request that wants every prompt token's logprobs (all rows out)."""
        return s.req is not None and s.req.state == PREFILL and s.req.prompt_logprobs is not None

    def _prompt_logprobs(self, req: Request, start: int, first: int, n: int) -> None:
        """Prompt positions start + 1 .. start + n from the rows of batch tokens first .. first + n - 1
        (row i predicts position i + 1), computed in C. A request computed again after a suspension
        does not record them twice."""
        out = req.prompt_logprobs
        assert out is not None
        prompt, k = req.prompt, req.decoder.n_logprobs or 0
        idx = [i for i in range(n) if len(out) <= start + i + 1 < len(prompt)]
        if not idx:
            return
        rows = np.stack([self.ctx.get_logits_ith(first + i) for i in idx])
        nxt = np.array([prompt[start + i + 1] for i in idx], dtype=np.int32)
        lp, ids, lps = rows_logprobs(rows, nxt, k)
        piece = self.model.token_to_piece
        for r, t in enumerate(nxt.tolist()):
            out.append(TokenLogprob(t, piece(t).decode("utf-8", "replace"), float(lp[r]),
                                    list(zip(ids[r].tolist(), lps[r].tolist()))))

    def _verify(self, s: Slot, row0: int) -> None:
        """A generating slot after its decode (batch rows row0 ..: its token, then its drafts): the
        request's sampling steps on the rows (sample-and-accept, llamax.speculative.verify), the
        rejected drafts cut from the memory, the pieces delivered, then its next token or its end."""
        req, st = s.running, s.seq_state
        draft, st.draft = st.draft, []
        outs, n_acc = verify(req.decoder, lambda i: self.ctx.get_logits_ith(row0 + i), draft)
        n_rej = len(draft) + 1 - len(outs)
        if n_rej:
            del st.tokens[len(st.tokens) - n_rej:]
            cut_tail(self.memory, s.seq, len(st.tokens))
        self._m["gen_tokens"] += len(outs)
        if req.speculative is not None:
            self._spec[req.speculative.kind].outcome(s.seq, len(draft), n_acc)
            req.n_drafted += len(draft)
            req.n_accepted += n_acc
            self._m["spec_drafted"] += len(draft)
            self._m["spec_accepted"] += n_acc
        for out in outs[:-1]:
            self._deliver(req, out.text)
        self._sample(s, None, outs[-1])

    def _deliver(self, req: Request, text: str) -> None:
        now = time.perf_counter()
        if req.t_first is None:
            req.t_first = now
        req.t_last = now
        req.deliver(text)

    def _sample(self, s: Slot, row, out=None) -> None:
        """The request's sampling step (SeqDecoder.step) on its logits row (or its result `out`): its
        piece to the caller, then its token decoded next or its end."""
        req = s.running
        if out is None:
            out = req.decoder.step(row)
        self._deliver(req, out.text)
        if out.stop is not None:
            self._finish(s, out.stop)
            return
        s.seq_state.pending = out.token

    def _finish(self, s: Slot, stop: str, *, cache: bool = True, error: BaseException | None = None) -> None:
        """End the slot's request: its cells go to the prefix cache (cache=False: are removed), the
        slot is free. error: the request failed (stop "error"; its result() raises RequestError)."""
        req = s.req
        assert req is not None
        self._forget_drafts(s)
        self.reuse.release(s.seq, s.seq_state.tokens, cache=cache and req.cache_prompt, shifted=s.seq_state.shifted)  # the cells are the reuse's now
        s.seq_state.tokens = []
        s.req, s.seq_state.pending, s.seq_state.feed, s.seq_state.fed = None, None, [], 0
        self._end(req, stop, error)

    def _forget_drafts(self, s: Slot) -> None:
        """The slot's sequence ends or changes other than by growing: its drafters forget it."""
        for sp in self._spec.values():
            sp.release(s.seq)

    def _count(self, stop: str) -> None:
        self._m[{"cancelled": "requests_cancelled", "error": "requests_failed"}.get(stop, "requests_finished")] += 1

    # ---- overflow: context shift and suspension --------------------------------------------------
    def _shift(self, s: Slot) -> bool:
        """Context shift of one slot (its n_keep kept, half the rest discarded); the cells it shares
        with the prefix cache or other requests that would move are copied first, so their positions
        do not move for the others. False when shifting is off or impossible."""
        if not self.context_shift:
            return False
        mem, req, st = self.memory, s.running, s.seq_state
        keep = min(req.n_keep, len(st.tokens))
        n_past = len(st.tokens)
        n, _ = shift_discard(mem, s.seq, keep)
        if n <= 0:
            return False
        self.reuse.unlock(s.seq)
        for _ in range(3):
            try:
                mem.seq_unshare(s.seq, keep + n, -1)
                break
            except NoKVSlotError:  # no room for the copies: the cache lets go of its claims first
                if not self.reuse.evict(n_past) and not self.reuse.n_prompts:
                    return False
        else:
            return False
        done, _ = context_shift(mem, s.seq, keep, n)
        self._forget_drafts(s)
        del st.tokens[keep:keep + done]
        st.shifted = True
        req.n_shift += 1
        return done > 0

    def _suspend(self, s: Slot) -> None:
        """Save the slot's sequence to RAM (or keep only its tokens beyond the byte budget), free the
        slot and put its request first in line to resume."""
        req = s.running
        self._forget_drafts(s)
        blob = None
        if s.seq_state.tokens:
            blob = self.ctx.state_seq_get_data(s.seq)
            if self._suspended_bytes + len(blob) > self.suspend_bytes:
                blob = None
        self.reuse.unlock(s.seq)
        self.memory.seq_rm(s.seq, -1, -1)
        self._saved[req] = Suspended(blob, s.take())
        if blob is not None:
            self._suspended_bytes += len(blob)
        req.state = SUSPENDED
        s.req = None
        self._resume.append(req)
        self._resume.sort(key=lambda r: r.id)
        self._m["requests_suspended"] += 1
        log.info("llamax engine: suspended request %d (%s)", req.id,
                 f"{len(blob)} bytes saved" if blob is not None else "tokens kept, to be computed again")

    def _drop_suspended(self, req: Request) -> None:
        blob = self._saved.pop(req).blob
        if blob is not None:
            self._suspended_bytes -= len(blob)

    def _resume_into(self, req: Request, slot: Slot) -> bool:
        """Put a suspended request back on a slot: its saved state restored, or its tokens queued
        to be computed again. False while there is no room for it."""
        sv = self._saved[req]
        busy = len(self._busy())
        need = len(sv.state.tokens) + (GROWTH * (busy + 1) if busy else 0)
        if need > self._free_cells():
            self.reuse.evict(need - self._free_cells())
        if busy and need > self._free_cells():
            return False
        self.reuse.take(slot.seq)  # the slot's own cache goes: the request brings its cells
        if sv.blob is not None:
            try:
                self.ctx.state_seq_set_data(sv.blob, slot.seq)
            except StateError:  # no room for its cells as they were placed
                if busy:
                    return False
                self._suspended_bytes -= len(sv.blob)  # alone: compute it again instead
                sv.blob = None
        st = sv.state
        if sv.blob is None:  # compute what it held again, then go on where it stopped
            self.memory.seq_rm(slot.seq, -1, -1)
            st = dataclasses.replace(st, tokens=[], feed=st.tokens + st.feed[st.fed:], fed=0)
        req.state = PREFILL if st.fed < len(st.feed) else GENERATING
        self._drop_suspended(req)
        slot.put(st)
        slot.req = req
        return True

    # ---- slots -----------------------------------------------------------------------------------
    def slots(self) -> list[dict]:
        """llama-server's /slots: one dict per slot."""
        with self._lock:
            out = []
            for s in self._slots:
                r = s.req
                out.append(dict(id=s.id, state=s.state, is_processing=r is not None, request=None if r is None else r.id,
                                n_ctx=self.n_ctx_seq, n_past=len(s.seq_state.tokens) if r is not None else 0,
                                n_prompt=0 if r is None else len(r.prompt), n_cached=0 if r is None else r.n_cached,
                                n_generated=0 if r is None else len(r.generated),
                                cached_tokens=len(s.seq_state.tokens) if r is not None else len(self.reuse.kept(s.seq))))
            return out

    def _slot(self, i) -> Slot:
        i = checks.integer(i, "slot")
        if not 0 <= i < self.n_parallel:
            raise ValueError(f"slot {i} outside [0, {self.n_parallel})")
        return self._slots[i]

    def _slot_file(self, filename) -> pathlib.Path:
        if self.slot_save_path is None:
            raise LlamaxError("slot save / restore is off: give the Engine a slot_save_path")
        name = os.fspath(filename)
        if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name \
                or name.startswith(".") or "\0" in name:
            raise ValueError(f"slot file name {filename!r}: a plain file name inside slot_save_path")
        if _state.is_tmp_name(name):
            raise ValueError(f"slot file name {filename!r}: the name of a temporary file (NAME.HEX16.tmp), "
                             "removed when an Engine starts")
        return self.slot_save_path / name

    def slot_save(self, i: int, filename) -> dict:
        """Save slot i's sequence (a running request's cells, or an idle slot's last request as far
        as the cache still holds it) to filename inside slot_save_path; returns n_saved (tokens) and
        n_written (bytes).

        Raises:
            OSError: the file cannot be written (a full disk): filename keeps its previous content
                (or stays absent), the cache is as it was."""
        path = self._slot_file(filename)
        with self._lock:
            s = self._slot(i)
            self.memory.update()
            if s.req is not None:
                toks = list(s.seq_state.tokens)
                self.ctx.state_seq_save_file(path, s.seq, toks)
            else:
                with self.reuse.save(s.seq) as toks:  # the slot's cache, placed on its sequence
                    self.ctx.state_seq_save_file(path, s.seq, toks)
            return dict(id_slot=s.id, filename=path.name, n_saved=len(toks), n_written=path.stat().st_size)

    def slot_restore(self, i: int, filename) -> dict:
        """Load a slot_save file into idle slot i: with the prefix cache its tokens become a cached
        prefix any request reuses, else the slot's own cache. Returns n_restored (tokens).

        Raises:
            LlamaxError: the slot is busy. StateError, OSError: as Context.state_seq_load_file."""
        path = self._slot_file(filename)
        with self._lock:
            s = self._slot(i)
            if s.req is not None:
                raise LlamaxError(f"slot {i} is processing request {s.req.id}: restore into an idle slot")
            self.reuse.take(s.seq)  # the load replaces what the slot kept
            toks = self.ctx.state_seq_load_file(path, s.seq)
            self.reuse.restore(s.seq, toks)
            return dict(id_slot=s.id, filename=path.name, n_restored=len(toks))

    def slot_erase(self, i: int) -> dict:
        """Forget idle slot i's cache (its sequence and last tokens; cached prefixes stay)."""
        with self._lock:
            s = self._slot(i)
            if s.req is not None:
                raise LlamaxError(f"slot {i} is processing request {s.req.id}")
            n = self.reuse.erase(s.seq)
            return dict(id_slot=s.id, n_erased=n)

    def clear_cache(self) -> None:
        """Drop every cached prefix (cells running requests hold stay theirs)."""
        with self._lock:
            self.reuse.clear()

    # ---- handing a cached prefix to another engine -----------------------------------------------
    def export_prefix(self, tokens: Sequence[int], min_tokens: int = 1) -> PrefixState | None:
        """The longest prefix of tokens that the prefix cache holds, as a PrefixState: its tokens and
        the state_seq_get_data blob of their cells (versioned, with the model's fingerprint), for
        import_prefix on another Engine of the same model and cache configuration, so that a
        conversation moved there does not compute its prompt again. None when the cache holds fewer
        than min_tokens of them. The cache is left as it was (the lookup is not counted)."""
        toks = self._tokens(list(tokens))
        with self._lock:
            self.memory.update()
            return self.reuse.export(toks, min_tokens, self.ctx.state_seq_get_data)

    def import_prefix(self, prefix: PrefixState) -> int:
        """Put another engine's export_prefix into this one's prefix cache (least recently used
        prefixes are evicted for room, as for a request); returns the tokens it did not hold yet
        (0 when it held them all already).

        Raises:
            StateError: a blob of another model or cache configuration, a corrupt one, or one whose
                cells are not positions [0, len(tokens)); the cache keeps every prefix it had
                unless room had to be made first, and holds nothing of the blob.
        """
        if not isinstance(prefix, PrefixState):
            raise TypeError(f"import_prefix takes a PrefixState, not {type(prefix).__name__}")
        toks = self._tokens(list(prefix.tokens))

        def check(data: bytes) -> None:  # the header, both checksums, the kind and the model
            _state.StateReader(data, kind=_state.KIND_SEQ, fingerprint=self.ctx.fingerprint, exact=True)

        with self._lock:
            self.memory.update()
            return self.reuse.import_(toks, prefix.data, check, self.ctx.state_seq_set_data)

    # ---- metrics ---------------------------------------------------------------------------------
    def metrics(self) -> dict:
        """Counters and gauges of the engine (llama-server's /metrics)."""
        with self._lock:
            m, mem, r, t = self._m, self.memory, self.reuse.stats(), self.tier.stats()
            busy = m["busy_s"]
            with self._qlock:
                qlen = len(self._queue)
            return dict(
                slots_busy=len(self._busy()), slots_total=self.n_parallel, queue_len=qlen,
                requests_waiting=qlen + len(self._resume), cells_used=mem.n_used, cells_total=mem.n_cells,
                cells_cached=r.cells_cached, bytes_cached=r.bytes_cached, cached_prompts=r.cached_prompts,
                prefix_lookups=r.lookups, prefix_hits=r.hits, tokens_reused=r.tokens_reused,
                prompt_tokens=m["prompt_tokens"], gen_tokens=m["gen_tokens"],
                prompt_tokens_per_s=m["prompt_tokens"] / busy if busy else 0.0,
                gen_tokens_per_s=m["gen_tokens"] / busy if busy else 0.0, busy_s=busy, steps=m["steps"],
                requests_finished=m["requests_finished"], requests_cancelled=m["requests_cancelled"],
                requests_failed=m["requests_failed"],
                requests_suspended=m["requests_suspended"], suspended_bytes=self._suspended_bytes,
                spec_drafted=m["spec_drafted"], spec_accepted=m["spec_accepted"],
                cache_ram_entries=t.entries, cache_ram_bytes=t.bytes, cache_ram_budget=t.budget,
                cache_ram_stored=t.stored, cache_ram_evicted=t.evicted, cache_ram_restores=t.restores,
                cache_ram_tokens_restored=t.tokens_restored)

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes the engine holds, by buffer: the memory's (memory.breakdown(): K, V, the recurrent
        states, ...), the suspended requests' saved states and the host-RAM tier's states."""
        with self._lock:
            return self.memory.breakdown() | {"suspended": self._suspended_bytes, "cache_ram": self.tier.nbytes}

    # ---- embeddings ------------------------------------------------------------------------------
    def embed(self, inputs, *, pooling: str | None = None, normalize: bool = True):
        """llamax.embed(self.model, inputs, pooling=pooling, normalize=normalize) run between two
        generation steps: the inputs are checked and tokenized first, then decoded under the engine's
        step lock in a context of their own (never the engine's KV cache, slots or prefix cache).
        Thread-safe; generation waits while the embeddings are computed.

        Returns:
            float32 np.ndarray [n_inputs, n_embd].

        Raises:
            BatchError / ValueError / TypeError / ModelError: as llamax.embed, before the lock is taken.
        """
        from llamax.embed import embed_tokens, prepare

        tokens, how = prepare(self.model, inputs, pooling=pooling, normalize=normalize)
        with self._lock:
            return embed_tokens(self.model, tokens, how, normalize)
