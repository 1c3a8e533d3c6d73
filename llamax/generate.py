"""Text generation over a context, with llama.cpp's context shift.

    generate(ctx, prompt)              one sequence: an iterator of text pieces
    generate_parallel(ctx, prompts)    N sequences of one context, one batched decode per step:
                                       an iterator of (index, piece)

Each step runs every live sequence's sampling step (llamax.sequence.SeqDecoder, the Engine's own:
sample, end of generation, stop strings, max_tokens), makes room for the sequences that go on, and
decodes all of their new tokens in one batch. Prompts, n_keep, the shift's discard and
context_shift itself are llamax.sequence's too (context_shift is re-exported here), so `llamax run`
and `llamax serve` follow one set of rules. Making room is llama.cpp's context shift (tools/main and the
server's slots): when a sequence's next token would fill its context (n_past + 1 >= n_ctx_seq),
or a unified cache has no free cell left for the step's batch (then the sequence holding the most
positions), the sequence keeps its first n_keep positions, forgets the n_discard after them and
slides the rest down:

    positions   [0 .. n_keep) [n_keep .. n_keep+n_discard) [n_keep+n_discard .. n_past)
    seq_rm                     removed
    seq_add                                                 shifted by -n_discard

so its positions stay below n_ctx_seq and the next decode rotates the moved cells' K by RoPE
(the K-shift). Only that sequence's cells are touched; in a unified cache, cells another sequence
shares with it (after seq_cp) move for both, as in llama.cpp (generation itself never shares cells).
A sequence stops with "context" only when it cannot shift: context_shift=False, a memory whose
can_shift is False (llama.cpp then turns context shift off), or nothing left to discard.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from llamax import checks
from llamax.batch import Batch
from llamax.errors import NoKVSlotError
from llamax.sampling import Sampler
from llamax.sequence import N_KEEP_MARGIN, SeqDecoder, bos_offset, context_shift, keep_length, needs_room, prompt_tokens
from llamax.speculative import Speculative, Speculator, cut_tail, equal_drafts, equalize, resolve, verify

if TYPE_CHECKING:
    from llamax.context import Context

__all__ = [
    "N_KEEP_MARGIN",
    "Generation",
    "GenerationStats",
    "ParallelGeneration",
    "context_shift",
    "decode_prompt",
    "generate",
    "generate_parallel",
]

log = logging.getLogger("llamax")


@dataclass
class GenerationStats:
    """Counts and timings of a generation (of one sequence, or summed over several)."""

    prompt_tokens: int = 0
    prompt_s: float = 0.0
    gen_tokens: int = 0
    gen_s: float = 0.0
    stop: str = ""        # "eog", "stop", "length" or "context" ("" while running; several: comma-separated)
    n_shift: int = 0      # context shifts
    n_discarded: int = 0  # tokens those shifts discarded
    n_drafted: int = 0    # speculative decoding: drafted tokens verified
    n_accepted: int = 0   # of them, the tokens the target sampled too

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_s if self.prompt_s > 0 else 0.0

    @property
    def gen_tps(self) -> float:
        return self.gen_tokens / self.gen_s if self.gen_s > 0 else 0.0

    def __str__(self) -> str:
        s = (f"prompt: {self.prompt_tokens} tokens in {self.prompt_s:.3f} s ({self.prompt_tps:.1f} t/s), "
             f"generation: {self.gen_tokens} tokens in {self.gen_s:.3f} s ({self.gen_tps:.1f} t/s), "
             f"stop: {self.stop}")
        if self.n_shift:
            s += f", context shifts: {self.n_shift} ({self.n_discarded} tokens discarded)"
        if self.n_drafted:
            s += (f", drafts: {self.n_accepted}/{self.n_drafted} accepted "
                  f"({100.0 * self.n_accepted / self.n_drafted:.1f}%)")
        return s


def decode_prompt(ctx: Context, tokens: Sequence[int], seq_id: int = 0) -> None:
    """Feed a prompt to sequence seq_id in chunks of n_batch tokens; logits on its last token.

    Raises:
        BatchError, NoKVSlotError: from ctx.decode (a failing chunk leaves the memory as it was,
            the chunks before it stay).
    """
    n_batch = ctx.params.n_batch
    for s in range(0, len(tokens), n_batch):
        chunk = list(tokens[s:s + n_batch])
        last = s + n_batch >= len(tokens)
        ctx.decode(Batch(chunk, seq_ids=[seq_id] * len(chunk), logits=[False] * (len(chunk) - 1) + [last]))


class _Sequence:
    """One sequence being generated: its prompt, its sampling step (SeqDecoder: sampler, stop
    strings, max_tokens) and the tokens it holds."""

    def __init__(self, index: int, seq_id: int, tokens: list[int], decoder: SeqDecoder) -> None:
        self.index, self.seq_id = index, seq_id
        self.prompt = tokens
        self.decoder = decoder
        self.stats = GenerationStats()
        self.tokens: list[int] = []     # the tokens this generation has in the cache, in position order
        self.pos0 = 0                   # position of tokens[0]
        self.keep_end = 0               # positions below this are never discarded
        self.logits: np.ndarray | None = None  # logits row for the next sample (no draft)
        self.row0 = -1                  # after a verification decode: the batch row of its first token
        self.draft: list[int] = []      # the drafted tokens that decode verified
        self.done = False

    def row(self, i: int, ctx: Context) -> np.ndarray:
        """Logits row i of the last decode for this sequence (0: after its next token)."""
        if self.row0 < 0:
            assert i == 0 and self.logits is not None
            return self.logits
        return ctx.get_logits_ith(self.row0 + i)

    @property
    def sampler(self) -> Sampler:
        return self.decoder.sampler

    @property
    def generated(self) -> list[int]:
        """Every sampled token but an end-of-generation one."""
        return self.decoder.generated

    def discard(self, p0: int, p1: int) -> None:
        """Positions [p0, p1) were removed and the later ones moved down by p1 - p0."""
        a, b = max(p0 - self.pos0, 0), max(p1 - self.pos0, 0)
        del self.tokens[a:b]
        if p1 <= self.pos0:
            self.pos0 -= p1 - p0
        elif p0 < self.pos0:
            self.pos0 = p0


class ParallelGeneration:
    """N prompts generated as N sequences of one context; iterate for (index, text piece).

    Per step one batch holds the next token of every live sequence (llama.cpp's parallel / server
    slots). Each sequence has its own sampler, stop and context shift.

    Args:
        ctx: the context. Each sequence continues from what the memory holds for it.
        prompts: texts (tokenized with special tokens parsed, BOS as the model wants) or token lists.
        max_tokens: most tokens to generate per sequence; -1: no limit (until end-of-generation,
            shifting the context as needed); -2: until the context is full (no shift), as llama.cpp's
            -n -2.
        samplers: one per prompt (default: a fresh Sampler() each).
        seq_ids: the sequence of each prompt (default 0..N-1); distinct, < n_seq_max.
        n_keep: tokens at the start of each sequence a context shift keeps: -1 (or more than the
            sequence holds after its prompt) keeps everything up to the end of the prompt; else
            n_keep plus the BOS token when the model adds one. At most n_ctx_seq - 4, as llama.cpp
            (llamax.sequence.keep_length, as the Engine).
        n_discard: tokens each shift forgets after the kept ones; 0 = half of the rest (llama.cpp).
        context_shift: False stops a sequence with "context" when its context is full.
        stop: strings that end a sequence's text with "stop" (not included), as the Engine's.
        speculative: None (off), True / "ngram", or a llamax.Speculative: each step drafts tokens
            for the sequences (llamax.speculative) and verifies them in the same decode; the output
            is the same, token for token, as without. A recurrent or hybrid memory is asked to keep
            the per-token states of the draft window (Memory.reserve_rollback).

    Attributes (after or during iteration):
        stats: GenerationStats summed over the sequences (gen_s is the wall time of the steps).
        seq_stats: per prompt GenerationStats.
        generated: per prompt, the sampled tokens (end-of-generation excluded).
        tokens: per prompt, the tokens the generation put in the cache that are still there
            (prompt and generated, after the shifts), in position order.

    Raises (on creation):
        ValueError: empty or too long prompt, bad seq_ids / samplers / n_discard.
    """

    def __init__(self, ctx: Context, prompts: Sequence[str | Sequence[int]], max_tokens: int = 128, samplers: Sequence[Sampler] | None = None,
                 *, seq_ids: Sequence[int] | None = None, n_keep: int = 0, n_discard: int = 0,
                 context_shift: bool = True, stop: str | Sequence[str] = (),
                 speculative: Speculative | bool | str | None = None) -> None:
        self.ctx, self.model = ctx, ctx.model
        if isinstance(prompts, (str, bytes)) or not len(prompts):
            raise ValueError("prompts must be a non-empty list of prompts")
        n = len(prompts)
        seq_ids = list(range(n)) if seq_ids is None else [checks.integer(s, "seq_id") for s in seq_ids]
        n_seq_max = ctx.params.n_seq_max
        if len(seq_ids) != n or len(set(seq_ids)) != n or not all(0 <= s < n_seq_max for s in seq_ids):
            raise ValueError(f"seq_ids {seq_ids}: need {n} distinct ids in [0, n_seq_max = {n_seq_max})")
        if samplers is None:
            samplers = [Sampler() for _ in range(n)]
        elif isinstance(samplers, Sampler) or len(samplers) != n:
            raise ValueError(f"samplers: one Sampler per prompt ({n}), not shared")
        n_discard, n_keep = checks.integer(n_discard, "n_discard"), checks.integer(n_keep, "n_keep")
        if n_discard < 0:
            raise ValueError(f"n_discard = {n_discard} must be >= 0 (0: half of what is left)")
        max_tokens = checks.integer(max_tokens, "max_tokens")
        if max_tokens < -2:
            raise ValueError(f"max_tokens = {max_tokens}: use >= 0, -1 (no limit) or -2 (until the context is full)")
        stops = [stop] if isinstance(stop, str) else list(stop)
        if not all(isinstance(x, str) for x in stops):
            raise TypeError("stop: a string or a list of strings")
        self.max_tokens = max_tokens
        self.context_shift = bool(context_shift) and max_tokens != -2
        self.n_discard = int(n_discard)
        self.n_ctx_seq = ctx.params.n_ctx_seq
        mem = ctx.memory
        self.seqs: list[_Sequence] = []
        for i, (p, sid, smp) in enumerate(zip(prompts, seq_ids, samplers)):
            toks = prompt_tokens(self.model, p)
            s = _Sequence(i, sid, toks, SeqDecoder(self.model, smp, max_tokens=max_tokens, stop=stops))
            s.pos0 = mem.seq_pos_max(sid) + 1
            if s.pos0 + len(toks) >= self.n_ctx_seq:
                raise ValueError(f"prompt {i} of {len(toks)} tokens at position {s.pos0} does not fit in the "
                                 f"context of {self.n_ctx_seq} cells per sequence (one more is needed for the "
                                 "next token)")
            start = mem.seq_pos_min(sid) if s.pos0 > 0 else 0
            held = s.pos0 - start + len(toks)  # the sequence's positions once its prompt is in
            n_bos = bos_offset(self.model, p) if s.pos0 == 0 else 0  # a BOS that begins the sequence
            s.keep_end = start + keep_length(n_keep, held, n_bos, self.n_ctx_seq)
            self.seqs.append(s)
        self.stats = GenerationStats()
        spec = resolve(speculative)
        self.spec: Speculator | None = None
        if spec is not None:
            mem.reserve_rollback(spec.n_max + 1)
            self.spec = Speculator(spec, self.model, n_seq_max=n_seq_max, n_ctx=ctx.params.n_ctx,
                                   n_threads=ctx.params.n_threads)
        self._it = self._run()

    # ---- views ---------------------------------------------------------------------------------
    @property
    def seq_stats(self) -> list[GenerationStats]:
        return [s.stats for s in self.seqs]

    @property
    def generated(self) -> list[list[int]]:
        return [s.generated for s in self.seqs]

    @property
    def tokens(self) -> list[list[int]]:
        return [s.tokens for s in self.seqs]

    def __iter__(self) -> Iterator[tuple[int, str]]:
        return self

    def __next__(self) -> tuple[int, str]:
        return next(self._it)

    # ---- the loop ------------------------------------------------------------------------------
    def _run(self) -> Iterator[tuple[int, str]]:
        ctx, st = self.ctx, self.stats
        for s in self.seqs:
            t0 = time.perf_counter()
            decode_prompt(ctx, s.prompt, s.seq_id)
            s.logits = ctx.get_logits_ith(-1).copy()  # the next prompt's decode replaces the logits
            s.tokens = list(s.prompt)
            s.decoder.accept_prompt(s.prompt)
            s.stats.prompt_tokens, s.stats.prompt_s = len(s.prompt), time.perf_counter() - t0
        st.prompt_tokens = sum(s.stats.prompt_tokens for s in self.seqs)
        st.prompt_s = sum(s.stats.prompt_s for s in self.seqs)
        self._t0 = time.perf_counter()
        live = []
        for s in self.seqs:
            if s.decoder.exhausted:  # max_tokens 0: nothing is sampled
                yield from self._stop(s, "length")
            else:
                live.append(s)
        try:
            while live:
                step: list[tuple[_Sequence, int]] = []
                for s in live:
                    out = None
                    for out in self._sample(s):  # sample, accept, end of generation, stop strings, max_tokens
                        if out.stop != "eog":
                            s.stats.gen_tokens += 1
                        if out.text:
                            yield s.index, out.text
                    assert out is not None
                    if out.stop is not None:
                        yield from self._stop(s, out.stop)
                    elif not self._make_room(s):
                        yield from self._stop(s, "context")
                    else:
                        step.append((s, out.token))
                for s in self._decode(step, self._drafts(step)):
                    yield from self._stop(s, "context")
                live = [s for s, _ in step if not s.done]
        finally:
            if self.spec is not None:
                self.spec.close()
        st.gen_s = time.perf_counter() - self._t0
        st.gen_tokens = sum(s.stats.gen_tokens for s in self.seqs)
        st.n_shift = sum(s.stats.n_shift for s in self.seqs)
        st.n_discarded = sum(s.stats.n_discarded for s in self.seqs)
        st.n_drafted = sum(s.stats.n_drafted for s in self.seqs)
        st.n_accepted = sum(s.stats.n_accepted for s in self.seqs)
        st.stop = ",".join(s.stats.stop for s in self.seqs)

    def _sample(self, s: _Sequence) -> list:
        """The sequence's sampling steps on its last decode's rows: one without a draft; with one,
        sample-and-accept (llamax.speculative.verify), the rejected drafts cut from the memory."""
        draft, s.draft = s.draft, []
        outs, n_acc = verify(s.decoder, lambda i: s.row(i, self.ctx), draft)
        s.logits, s.row0 = None, -1
        if draft:
            n_rej = len(draft) + 1 - len(outs)
            if n_rej:
                cut_tail(self.ctx.memory, s.seq_id, self.ctx.memory.seq_pos_max(s.seq_id) + 1 - n_rej)
                del s.tokens[len(s.tokens) - n_rej:]
            s.stats.n_drafted += len(draft)
            s.stats.n_accepted += n_acc
            assert self.spec is not None
            self.spec.outcome(s.seq_id, len(draft), n_acc)
        elif self.spec is not None:
            self.spec.outcome(s.seq_id, 0, 0)
        return outs

    def _drafts(self, step: list[tuple[_Sequence, int]]) -> list[list[int]]:
        """Each stepping sequence's drafted tokens (none without speculation), within its room: the
        positions left below n_ctx_seq - 1 and the tokens left of max_tokens."""
        if self.spec is None or not step:
            return [[] for _ in step]
        mem, asks = self.ctx.memory, []
        n_ubatch = self.ctx.params.n_ubatch
        equal = equal_drafts(mem, self.ctx.params.kv_unified)
        for s, tok in step:
            n_past = mem.seq_pos_max(s.seq_id) + 1
            cap = min(self.n_ctx_seq - 2 - n_past, n_ubatch // len(step) - 1)  # one ubatch (equal_drafts)
            d = s.decoder
            if d.max_tokens >= 0:
                cap = min(cap, d.max_tokens - len(d.generated) - 1)
            asks.append((s.seq_id, cap))
        drafts = self.spec.plan(asks, lambda i: step[i][0].tokens + [step[i][1]])
        return equalize(drafts) if equal else drafts

    def _stop(self, s: _Sequence, why: str) -> Iterator[tuple[int, str]]:
        if self.spec is not None:
            self.spec.release(s.seq_id)
        s.done, s.stats.stop, s.logits = True, why, None
        s.stats.gen_s = time.perf_counter() - self._t0
        tail = s.decoder.finish(why)
        if tail:
            yield s.index, tail

    def _shift(self, s: _Sequence) -> bool:
        """One context shift of s; False when it is off, impossible or discards nothing."""
        mem = self.ctx.memory
        if not self.context_shift or not mem.can_shift:
            return False
        n, _ = context_shift(mem, s.seq_id, s.keep_end, self.n_discard)
        if n == 0:
            return False
        if self.spec is not None:
            self.spec.release(s.seq_id)  # its tokens no longer extend what the drafter holds
        s.discard(s.keep_end, s.keep_end + n)
        s.stats.n_shift += 1
        s.stats.n_discarded += n
        return True

    def _make_room(self, s: _Sequence) -> bool:
        """Room for one more token of s: below n_ctx_seq - 1 positions, else shift (llama.cpp's
        n_past + 1 >= n_ctx test, so the last position is never used)."""
        n_past = self.ctx.memory.seq_pos_max(s.seq_id) + 1
        return not needs_room(n_past, self.n_ctx_seq) or self._shift(s)

    def _decode(self, step: list[tuple[_Sequence, int]], drafts: list[list[int]]) -> list[_Sequence]:
        """Decode the step's tokens (each followed by its drafted tokens) in one batch, logits on every
        row. When the memory has no slot (a unified cache is full), the drafts are dropped first; then
        the sequence holding the most positions (else the next one that can) is shifted and the batch
        retried; when none can, the largest is stopped and left out. Returns the sequences stopped
        that way."""
        mem, stopped = self.ctx.memory, []
        work = [(s, [t] + d, d) for (s, t), d in zip(step, drafts)]
        while work:
            toks = [t for _, ts, _ in work for t in ts]
            try:
                t0 = time.perf_counter()
                self.ctx.decode(Batch(toks, seq_ids=[s.seq_id for s, ts, _ in work for _ in ts],
                                      logits=[True] * len(toks)))
                if self.spec is not None:
                    self.spec.observe(len(toks), time.perf_counter() - t0)
                break
            except NoKVSlotError:
                if any(d for _, _, d in work):
                    work = [(s, ts[:1], []) for s, ts, _ in work]
                    continue
                order = sorted((s for s, _, _ in work),  # most positions first
                               key=lambda s: mem.seq_pos_min(s.seq_id) - mem.seq_pos_max(s.seq_id))
                if not any(self._shift(s) for s in order):  # any() stops at the first shift
                    stopped.append(order[0])
                    work = [w for w in work if w[0] is not order[0]]
        j = 0
        for s, ts, d in work:
            s.row0, s.draft = j, d
            s.tokens += ts
            j += len(ts)
        return stopped


class Generation:
    """An iterator of the text pieces generated on one sequence; `stats` holds the counts and
    speeds once it has run. See ParallelGeneration for the arguments and the context shift.

    Attributes:
        tokens: the prompt tokens; generated: the sampled tokens (end-of-generation excluded);
        cache_tokens: the tokens of this generation still in the cache after the shifts, in
        position order; stats: GenerationStats.
    """

    def __init__(self, ctx: Context, prompt: str | Sequence[int], max_tokens: int = 128, sampler: Sampler | None = None, seq_id: int = 0, *,
                 n_keep: int = 0, n_discard: int = 0, context_shift: bool = True, stop: str | Sequence[str] = (),
                 speculative: Speculative | bool | str | None = None) -> None:
        prompts: list[str] | list[list[int]]
        if isinstance(prompt, str):
            prompts = [prompt]
        else:
            prompts = [[checks.integer(t, "prompt token") for t in prompt]]
        if not prompts[0]:
            raise ValueError("empty prompt")
        self.ctx, self.model, self.seq_id = ctx, ctx.model, seq_id
        self.max_tokens = checks.integer(max_tokens, "max_tokens")
        self.sampler = sampler if sampler is not None else Sampler()
        self._par = ParallelGeneration(ctx, prompts, max_tokens, [self.sampler], seq_ids=[seq_id], n_keep=n_keep,
                                       n_discard=n_discard, context_shift=context_shift, stop=stop,
                                       speculative=speculative)
        self._seq = self._par.seqs[0]

    @property
    def tokens(self) -> list[int]:
        return self._seq.prompt

    @property
    def generated(self) -> list[int]:
        return self._seq.generated

    @property
    def cache_tokens(self) -> list[int]:
        return self._seq.tokens

    @property
    def keep_end(self) -> int:
        """Positions below this are never discarded by a context shift."""
        return self._seq.keep_end

    @property
    def stats(self) -> GenerationStats:
        return self._seq.stats

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        return next(self._par)[1]


def generate(ctx: Context, prompt: str | Sequence[int], max_tokens: int = 128, sampler: Sampler | None = None, seq_id: int = 0, *,
             n_keep: int = 0, n_discard: int = 0, context_shift: bool = True, stop: str | Sequence[str] = (),
             speculative: Speculative | bool | str | None = None) -> Generation:
    """Stream the text generated after `prompt` on sequence seq_id, shifting the context when it is
    full (see ParallelGeneration for the options, speculative decoding among them)."""
    return Generation(ctx, prompt, max_tokens, sampler, seq_id, n_keep=n_keep, n_discard=n_discard,
                      context_shift=context_shift, stop=stop, speculative=speculative)


def generate_parallel(ctx: Context, prompts: Sequence[str | Sequence[int]], max_tokens: int = 128, samplers: Sequence[Sampler] | None = None, *,
                      seq_ids: Sequence[int] | None = None, n_keep: int = 0, n_discard: int = 0,
                      context_shift: bool = True, stop: str | Sequence[str] = (),
                      speculative: Speculative | bool | str | None = None) -> ParallelGeneration:
    """Generate after each prompt on its own sequence of ctx, all decoded together; iterate for
    (prompt index, text piece). See ParallelGeneration."""
    return ParallelGeneration(ctx, prompts, max_tokens, samplers, seq_ids=seq_ids, n_keep=n_keep,
                              n_discard=n_discard, context_shift=context_shift, stop=stop,
                              speculative=speculative)
