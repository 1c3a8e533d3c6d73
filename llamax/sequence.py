"""One sequence's decode step: the rules `llamax run` (llamax.generate) and `llamax serve`
(llamax.Engine) share, so that the two cannot drift apart.

    prompt_tokens / bos_offset   a prompt as token ids (str, chat messages or ids) and its BOS
    keep_length                  the positions a context shift keeps (n_keep + BOS, llama.cpp's margin)
    needs_room                   llama.cpp's "n_past + 1 >= n_ctx": the next token would fill the context
    shift_discard / context_shift
                                 the discard of one shift (half of what follows the kept positions,
                                 clamped to the memory's exact_shift_limit) and the shift itself
    SeqDecoder                   one sampling step: sample (the grammar's mask, bias and penalties in
                                 the C chain) -> accept into the sampler -> end of generation -> the
                                 token's logprobs -> stop strings -> max_tokens
    TokenLogprob                 one token's log-probability and its top alternatives
    StopMatcher                  stop strings over streamed text in linear time

The callers keep what is theirs: how a batch is built, which sequence makes room when a cache is
full, and what a sequence at its context is called ("context" in generate, "length" in the Engine).
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from llamax.errors import BatchError, LlamaxError
from llamax.model.tokenizer import TextStream
from llamax.sampling import Sampler, token_logprobs

if TYPE_CHECKING:
    from llamax.memory import Memory

__all__ = ["N_KEEP_MARGIN", "MAX_LOGPROBS", "Sampled", "SeqDecoder", "StopMatcher", "TokenLogprob", "bos_offset", "context_shift",
           "keep_length", "needs_room", "prompt_tokens", "shift_discard"]

log = logging.getLogger("llamax")

N_KEEP_MARGIN = 4  # llama.cpp keeps n_keep <= n_ctx - 4, so every shift discards at least one token
MAX_LOGPROBS = 20  # alternatives per token (OpenAI's top_logprobs limit)


# ---- the prompt ------------------------------------------------------------------------------------

def prompt_tokens(model: Any, prompt: Any) -> list[int]:
    """The token ids of a prompt: a str tokenized with special tokens (BOS as the model wants),
    chat messages ([{"role": ..., "content": ...}]) through the model's template, token ids checked
    against the vocabulary. O(len(prompt)).

    Raises:
        BatchError: an empty prompt, a token id outside the vocabulary or not an integer.
        TypeError: anything else.
    """
    m = model
    if isinstance(prompt, str):
        toks = m.tokenize(prompt, add_special=True, parse_special=True)
    elif isinstance(prompt, Sequence) and prompt and all(isinstance(x, dict) for x in prompt):
        toks = m.tokenize(m.apply_chat_template(list(prompt)), add_special=True, parse_special=True)
    elif isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray)):
        toks = []
        for i, t in enumerate(prompt):
            if isinstance(t, bool) or not isinstance(t, int) and not hasattr(t, "__index__"):
                raise BatchError(f"prompt token {i}: {t!r} is not a token id")
            t = int(t)
            if not 0 <= t < m.n_vocab:
                raise BatchError(f"prompt token {i}: id {t} outside the vocabulary [0, {m.n_vocab})")
            toks.append(t)
    else:
        raise TypeError(f"prompt: a str, a list of token ids or a list of chat messages, not {type(prompt).__name__}")
    if not toks:
        raise BatchError("empty prompt")
    return toks


def bos_offset(model: Any, prompt: Any) -> int:
    """1 when tokenizing prompt adds a BOS token before the text (a str prompt, a model that adds
    one): n_keep counts the prompt's tokens after it."""
    return int(isinstance(prompt, str) and bool(getattr(model.tokenizer, "add_bos", False)))


def keep_length(n_keep: int, n_held: int, n_bos: int, n_ctx_seq: int) -> int:
    """The positions at the start of a sequence that a context shift keeps (llama.cpp's n_keep).

    Args:
        n_keep: the caller's n_keep; < 0 keeps all n_held.
        n_held: positions the sequence holds once its prompt is in.
        n_bos: 1 when the tokenizer put a BOS token first (bos_offset), which is kept as well.
        n_ctx_seq: the sequence's context.

    Returns:
        min(n_keep + n_bos, n_held) (n_held for n_keep < 0), at most n_ctx_seq - N_KEEP_MARGIN.
    """
    keep = n_held if n_keep < 0 else min(n_keep + n_bos, n_held)
    return min(keep, n_ctx_seq - N_KEEP_MARGIN)


# ---- context shift ---------------------------------------------------------------------------------

def needs_room(n_past: int, n_ctx_seq: int) -> bool:
    """True when a sequence of n_past positions must shift before its next token (llama.cpp's
    n_past + 1 >= n_ctx test, so the last position is never used)."""
    return n_past + 1 >= n_ctx_seq


def shift_discard(memory: Memory, seq_id: int, keep_end: int, n_discard: int = 0) -> tuple[int, int]:
    """What a context shift of seq_id would discard after keep_end, without changing anything.

    n_discard 0 means half of the positions after keep_end (llama.cpp); it is clamped to them and
    to memory.exact_shift_limit when that is >= 1 (a sliding-window cache smaller than the
    context: the shift then gives what a full-size one gives). O(1).

    Returns:
        (n, n_left): the positions to discard (0: nothing can be) and how many follow keep_end.
    """
    n_past = memory.seq_pos_max(seq_id) + 1
    n_left = n_past - keep_end
    if n_left <= 0:
        return 0, max(n_left, 0)
    n = min(n_discard, n_left) if n_discard > 0 else n_left // 2
    limit = memory.exact_shift_limit(seq_id, keep_end)
    if limit is not None and limit >= 1:  # a small SWA cache: discard less, so the window does not reach lost prefix cells
        n = min(n, limit)
    return max(n, 0), n_left


def context_shift(memory: Memory, seq_id: int, keep_end: int, n_discard: int = 0) -> tuple[int, int]:
    """llama.cpp's context shift of one sequence: forget positions [keep_end, keep_end + n) and move
    the later ones down by n (seq_rm then seq_add; the K-shift runs at the next decode), n as
    shift_discard gives it.

    Args:
        memory: the context's memory (KVCache, KVCacheISWA, ...).
        seq_id: the sequence; no other sequence's cells change (except cells it shares with it).
        keep_end: first position that may be discarded (the sequence's start + n_keep).
        n_discard: positions to forget; 0 means half of those after keep_end (n_left // 2);
            clamped to n_left, and to memory.exact_shift_limit (see shift_discard).

    Returns:
        (n_discard, n_left): what was discarded (0 when nothing could be) and how many positions
        followed keep_end before the shift.

    Raises:
        LlamaxError: the memory cannot shift positions (can_shift is False); nothing changed.
        ValueError: negative n_discard or keep_end.
    """
    if n_discard < 0 or keep_end < 0:
        raise ValueError(f"context_shift: keep_end = {keep_end} and n_discard = {n_discard} must be >= 0")
    if not memory.can_shift:
        raise LlamaxError(f"context shift of sequence {seq_id}: this memory cannot shift positions "
                          "(can_shift is False)")
    n, n_left = shift_discard(memory, seq_id, keep_end, n_discard)
    if n <= 0:
        return 0, n_left
    limit = memory.exact_shift_limit(seq_id, keep_end)
    if limit is not None and limit < 1:
        log.warning("context shift: seq %d keeps %d positions, but the SWA cache no longer holds all of "
                    "them: its layers miss the oldest kept cells while the window covers them "
                    "(swa_full=True keeps them)", seq_id, keep_end)
    n_past = keep_end + n_left
    if not memory.seq_forget(seq_id, keep_end, keep_end + n):
        log.info("context shift: seq %d has a recurrent state, which cannot forget part of itself: it stays "
                 "whole and its positions move down by %d", seq_id, n)
    memory.seq_add(seq_id, keep_end + n, n_past, -n)
    log.info("context shift: seq %d, n_keep = %d, n_left = %d, n_discard = %d", seq_id, keep_end, n_left, n)
    return n, n_left


# ---- stop strings ----------------------------------------------------------------------------------

class StopMatcher:
    """Finds stop strings in streamed text and holds back a tail that may begin one.

    Linear in the text: a push looks only at a window of the last max(len(stop)) - 1 characters
    handed out, the held-back tail (shorter than the longest stop) and the new piece, so a
    generation of n characters costs O(n * n_stops * max(len(stop))) in all. The text handed out
    is kept as a list of its pieces, joined only when `text` is read.

    Invariant: a stop string that may still complete starts inside the held-back tail (a suffix
    of the text that is a proper prefix of a stop string is held back whole).
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self._span = max((len(s) for s in self.stops), default=1) - 1  # the longest partial match
        self._out: list[str] = []  # the pieces handed out
        self._tail = ""            # the last _span characters handed out
        self.held = ""             # text not handed out yet: it may begin a stop string
        self.hit = False           # a stop string was completed (the text ends before it)

    @property
    def text(self) -> str:
        """All the text so far (handed out and held back); up to the stop string after a hit. O(n)."""
        return "".join(self._out) + self.held

    @property
    def window(self) -> int:
        """Characters the next push looks at besides its piece (<= 2 * (max(len(stop)) - 1))."""
        return len(self._tail) + len(self.held)

    def push(self, piece: str) -> tuple[str, bool]:
        """(text that can be handed out now, True if a stop string was completed). After a hit the
        text ends where the stop string began and later pushes give nothing."""
        if self.hit:
            return "", True
        if not self.stops:
            if piece:
                self._out.append(piece)
            return piece, False
        lo = len(self._tail)  # window[lo:] is not handed out yet
        window = self._tail + self.held + piece
        hits = [i for i in (window.find(s) for s in self.stops) if i >= 0]
        if hits:
            cut = max(min(hits), lo)  # a stop beginning in text already handed out ends it there
            out, self.held, self.hit = window[lo:cut], "", True
            self._hand_out(out)
            return out, True
        hold = 0  # the longest tail of the window that a stop string starts with, not handed out yet
        for s in self.stops:
            for k in range(min(len(s) - 1, len(window) - lo), hold, -1):
                if window.endswith(s[:k]):
                    hold = k
                    break
        end = len(window) - hold
        out, self.held = window[lo:end], window[end:]
        self._hand_out(out)
        return out, False

    def _hand_out(self, out: str) -> None:
        if out:
            self._out.append(out)
            self._tail = (self._tail + out)[-self._span:] if self._span else ""

    def flush(self) -> str:
        """The held-back text (the generation ended without completing a stop string)."""
        out, self.held = self.held, ""
        self._hand_out(out)
        return out


# ---- one sampling step -----------------------------------------------------------------------------

@dataclass(frozen=True)
class TokenLogprob:
    """One token of a sequence and how likely the model found it, from its distribution before any
    sampler stage (llama.cpp's default): logprob = log_softmax(logits)[token]; top: the k most likely
    tokens as (id, logprob), most likely first (ties: lower id first)."""

    token: int
    piece: str
    logprob: float
    top: list[tuple[int, float]]


def check_logprobs(k: Any) -> int | None:
    """A logprobs setting: None (off) or an int in 0..MAX_LOGPROBS.

    Raises:
        TypeError: not an int. ValueError: outside 0..MAX_LOGPROBS."""
    if k is None:
        return None
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"logprobs: an int in 0..{MAX_LOGPROBS} or None, not {type(k).__name__}")
    if not 0 <= k <= MAX_LOGPROBS:
        raise ValueError(f"logprobs = {k}: 0..{MAX_LOGPROBS} alternatives per token")
    return k


@dataclass(frozen=True)
class Sampled:
    """What one sampling step gave: the token, the text to hand out now (a tail that may begin a
    stop string is held back), and why the sequence ends ("eog", "stop", "length", "grammar": the
    grammar allowed no token, then token is -1), or None when the token is to be decoded next."""

    token: int
    text: str
    stop: str | None


class SeqDecoder:
    """One sequence's sampling: its sampler, detokenizer, stop strings and token budget.

    Args:
        model: the model (its tokenizer and end-of-generation tokens).
        sampler: the sequence's own Sampler (its history is the penalty's window).
        max_tokens: most tokens to generate; < 0: no limit.
        stop: strings that end the text (not included).
        ignore_eos: never sample an end-of-generation token (banned in the sampler's C chain).
        logprobs: record each generated token's TokenLogprob with this many alternatives (None: off).
        special: the text shows control tokens by their text (a tool format's markers, e.g. <tool_call>).

    Attributes:
        generated: the sampled tokens (an end-of-generation one excluded).
        logprobs: their TokenLogprobs (logprobs set), else None.
    """

    def __init__(self, model: Any, sampler: Sampler, *, max_tokens: int = -1, stop: Sequence[str] = (),
                 ignore_eos: bool = False, logprobs: int | None = None, special: bool = False) -> None:
        self.model, self.sampler, self.max_tokens = model, sampler, max_tokens
        self.ignore_eos = ignore_eos
        self.n_logprobs = check_logprobs(logprobs)
        self.logprobs: list[TokenLogprob] | None = None if logprobs is None else []
        sampler.bind(model)
        if ignore_eos:
            sampler.ban(model.tokenizer.eog_ids)
        self.stream = TextStream(model.tokenizer, special=special)
        self.stops = StopMatcher(stop)
        self.generated: list[int] = []

    @property
    def text(self) -> str:
        """The text so far (up to a stop string)."""
        return self.stops.text

    @property
    def exhausted(self) -> bool:
        """max_tokens are generated (at once for max_tokens 0: nothing is sampled)."""
        return 0 <= self.max_tokens <= len(self.generated)

    def accept_prompt(self, tokens: Sequence[int]) -> None:
        """The prompt's tokens into the sampler's history (its penalty window), not its grammar, as
        llama.cpp's main and server do before the first sample."""
        window = self.sampler.history.maxlen  # None: the whole history (repeat_last_n = -1)
        for t in tokens if window is None else tokens[max(0, len(tokens) - window):] if window else ():
            self.sampler.accept(t, accept_grammar=False)

    def step(self, logits: np.ndarray) -> Sampled:
        """Sample from one logits row (the sampler's grammar mask, bias and penalties applied in its
        C chain), accept the token into the sampler, then end the sequence when the grammar allowed
        no token ("grammar"), on an end-of-generation token ("eog"), a completed stop string
        ("stop") or max_tokens ("length"), in that order. O(n_vocab) plus the stop matching of its
        piece (and the top-k of the logprobs, in C)."""
        tok = self.sampler.sample_logits(logits)
        if tok < 0:
            return Sampled(tok, "", "grammar")
        self.sampler.accept(tok)
        if self.model.is_eog(tok):
            return Sampled(tok, "", "eog")
        self.generated.append(tok)
        if self.logprobs is not None:
            self.logprobs.append(self.logprob(logits, tok))
        out, hit = self.stops.push(self.stream.push(tok))
        if hit:
            return Sampled(tok, out, "stop")
        return Sampled(tok, out, "length" if self.exhausted else None)

    def logprob(self, logits: np.ndarray, tok: int) -> TokenLogprob:
        """tok's TokenLogprob in one logits row (the model's own distribution), in C."""
        lp, top = token_logprobs(logits, tok, self.n_logprobs or 0)
        return TokenLogprob(tok, self.model.token_to_piece(tok).decode("utf-8", "replace"), lp, top)

    def finish(self, stop: str) -> str:
        """The text still held back when the sequence ends with `stop` (none after a stop string);
        the stop strings are checked on the detokenizer's last bytes too."""
        tail = self.stream.flush()
        if stop == "stop" or self.stops.hit:
            return ""
        out, _ = self.stops.push(tail)
        return out + self.stops.flush()

