"""Sampling (llama.cpp's common sampler chain): [grammar mask] -> logit bias -> penalties ->
top-k -> top-p -> min-p -> temperature -> a seeded draw; temperature <= 0 is greedy. And the
logprobs of raw logits rows (the model's distribution before any sampler stage).

The chain runs in C over the logits row without sorting the vocabulary (csrc/sampling.h);
Sampler._sample_reference is its numpy oracle. A grammar is anything following the small
GrammarLike protocol below (llamax.Grammar over llguidance is one): the sampler asks its matcher for
the allowed-token bitmask before each sample and advances it with each accepted token."""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from llamax import checks
from llamax._native import sampling as _native
from llamax.errors import LlamaxError

if TYPE_CHECKING:
    from llamax.context import Context

PENALTY_LAST_N = 64  # llama.cpp's default penalty window (repeat_last_n)
LOGPROBS_MAX_K: int = _native.LOGPROBS_MAX_K  # the most alternatives a logprobs call returns (20)
_F32_MAX = float(np.finfo(np.float32).max)


class GrammarMatcher(Protocol):
    """One sequence's progress through a grammar."""

    def fill_mask(self, buf: np.ndarray) -> None:
        """Write the allowed tokens into buf, uint32 [(n_vocab + 31) // 32]: bit (t & 31) of word
        t >> 5 set = token t allowed."""

    def accept(self, token: int) -> bool:
        """Advance past token; False if the grammar did not allow it."""


class GrammarLike(Protocol):
    """A constraint on generated tokens (llamax.Grammar is one)."""

    def matcher(self, model: Any) -> GrammarMatcher:
        """A fresh matcher over this model's vocabulary."""


class Sampler:
    """Chooses the next token from a context's logits; remembers the tokens it saw (for the
    penalties) and follows its grammar.

    Args:
        temperature: <= 0 picks the most likely token.
        top_k: keep the k most likely tokens (0: all).
        top_p: keep the smallest set whose probability reaches p (1.0: all).
        min_p: drop tokens below min_p times the most likely token's probability (0: none).
        repeat_penalty: divide positive / multiply negative logits of the tokens in the penalty
            window (1.0: off).
        seed: seed of the draw (None or -1, llama.cpp's default seed: fresh entropy).
        presence_penalty: subtracted once from the logit of every token in the window (0: off).
        frequency_penalty: subtracted from a token's logit once per occurrence in the window (0: off).
        repeat_last_n: the penalty window, the last n accepted tokens (0: no penalties; -1: every
            accepted token, llama.cpp's -1 = the context size).
        logit_bias: token id -> value added to its logit (float("-inf") bans it); ids beyond the
            row are ignored, as llama.cpp.
        grammar: a GrammarLike (llamax.Grammar); the sampler samples only tokens it allows
            (bind(model) first, or sample(ctx), which binds to ctx.model).

    Raises:
        TypeError: a setting of the wrong type. ValueError: a setting out of range, or not finite.
    """

    def __init__(self, temperature: float = 0.8, top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05,
                 repeat_penalty: float = 1.0, seed: int | None = None, *, presence_penalty: float = 0.0,
                 frequency_penalty: float = 0.0, repeat_last_n: int = PENALTY_LAST_N,
                 logit_bias: Mapping[int, float] | None = None, grammar: GrammarLike | None = None) -> None:
        temperature, top_p, min_p, repeat_penalty, presence_penalty, frequency_penalty = (checks.real(v, w) for v, w in (
            (temperature, "temperature"), (top_p, "top_p"), (min_p, "min_p"), (repeat_penalty, "repeat_penalty"),
            (presence_penalty, "presence_penalty"), (frequency_penalty, "frequency_penalty")))
        top_k = checks.integer(top_k, "top_k")
        repeat_last_n = checks.integer(repeat_last_n, "repeat_last_n")
        if top_k < 0 or not 0.0 < top_p <= 1.0 or not 0.0 <= min_p <= 1.0 or repeat_penalty <= 0:
            raise ValueError(f"invalid sampler settings: top_k={top_k} top_p={top_p} min_p={min_p} "
                             f"repeat_penalty={repeat_penalty}")
        if max(abs(presence_penalty), abs(frequency_penalty), repeat_penalty) > _F32_MAX:
            raise ValueError(f"a penalty beyond float32: presence_penalty={presence_penalty} "
                             f"frequency_penalty={frequency_penalty} repeat_penalty={repeat_penalty}")
        if repeat_last_n < -1:
            raise ValueError(f"repeat_last_n = {repeat_last_n}: >= 0 tokens, or -1 for the whole history")
        if seed is not None:
            seed = checks.integer(seed, "seed")
            if seed < -1:
                raise ValueError(f"seed = {seed}: a seed is >= 0, or -1 (or None) for fresh entropy")
        bias = self._check_bias(logit_bias)
        if grammar is not None and not callable(getattr(grammar, "matcher", None)):
            raise TypeError(f"grammar must have a matcher(model) method, got {type(grammar).__name__}")
        self.temperature, self.top_k, self.top_p, self.min_p = temperature, top_k, top_p, min_p
        self.repeat_penalty, self.presence_penalty, self.frequency_penalty = (
            repeat_penalty, presence_penalty, frequency_penalty)
        self.repeat_last_n = repeat_last_n
        self.logit_bias: dict[int, float] = bias
        self.grammar = grammar
        self.rng = np.random.default_rng(None if seed == -1 else seed)
        self.history: deque[int] = deque(maxlen=None if repeat_last_n == -1 else repeat_last_n)
        self._bias_ids = np.fromiter(bias.keys(), dtype=np.int32, count=len(bias))
        self._bias_values = np.fromiter(bias.values(), dtype=np.float32, count=len(bias))
        self._chain: _native.Chain | None = None  # the C scratch, sized to the widest row seen
        self._matcher: GrammarMatcher | None = None  # the grammar's matcher, made by bind()
        self._mask: np.ndarray | None = None  # its allowed-token bits, filled before each sample
        self._lock = threading.Lock()

    @staticmethod
    def _check_bias(logit_bias: Mapping[int, float] | None) -> dict[int, float]:
        if logit_bias is None:
            return {}
        if not isinstance(logit_bias, Mapping):
            raise TypeError(f"logit_bias must be a dict of token id -> bias, got {type(logit_bias).__name__}")
        out: dict[int, float] = {}
        for t, b in logit_bias.items():
            t = checks.integer(t, "a logit_bias token id")
            if not 0 <= t < 2**31:
                raise ValueError(f"logit_bias token id {t} is outside [0, 2^31)")
            if isinstance(b, (float, np.floating)) and b == -np.inf:
                out[t] = float("-inf")
                continue
            b = checks.real(b, f"logit_bias[{t}]")  # +inf and nan are errors; -inf bans (above)
            if abs(b) > _F32_MAX:
                raise ValueError(f"logit_bias[{t}] = {b} is beyond float32")
            out[t] = b
        return out

    def ban(self, tokens) -> None:
        """Never sample these token ids (a -inf logit_bias for each, in the C chain: no row is copied)."""
        with self._lock:
            bias = {**self.logit_bias, **{int(t): float("-inf") for t in tokens}}
            self.logit_bias = self._check_bias(bias)
            self._bias_ids = np.fromiter(bias.keys(), dtype=np.int32, count=len(bias))
            self._bias_values = np.fromiter(bias.values(), dtype=np.float32, count=len(bias))

    @classmethod
    def greedy(cls) -> "Sampler":
        return cls(temperature=0.0, top_k=1, top_p=1.0, min_p=0.0)

    @property
    def penalizing(self) -> bool:
        """Some penalty is on (its window may still be empty)."""
        return self.repeat_last_n != 0 and (
            self.repeat_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0)

    def bind(self, model: Any) -> None:
        """Make the grammar's matcher for model's vocabulary (n_vocab), and its mask buffer; the
        grammar starts over. Nothing to do without a grammar."""
        if self.grammar is None:
            return
        n_vocab = checks.positive(model.n_vocab, "model.n_vocab", _native.MAX_VOCAB + 1)
        matcher = self.grammar.matcher(model)
        with self._lock:
            self._matcher, self._mask = matcher, np.zeros((n_vocab + 31) // 32, dtype=np.uint32)

    def accept(self, token: int, accept_grammar: bool = True) -> None:
        """Record a token of the sequence in the penalty window and, with accept_grammar, advance the
        grammar past it (prompt tokens go in with accept_grammar=False, as llama.cpp's
        common_sampler_accept).

        Raises:
            ValueError: token is outside the int32 range. LlamaxError: the grammar is not bound, or
                it refused the token (then the history is unchanged; the matcher is as the grammar
                leaves it after a refusal).
        """
        token = checks.in_range(token, "token", -2**31, 2**31)
        if accept_grammar and self.grammar is not None:
            if self._matcher is None:
                raise LlamaxError("the sampler's grammar is not bound to a model: call bind(model) first")
            if not self._matcher.accept(token):
                raise LlamaxError(f"token {token} is not allowed by the sampler's grammar")
        self.history.append(token)

    def sample(self, ctx: Context, i: int = -1) -> int:
        """The next token from the logits of batch token i of the context's last decode, accepted
        into the history and the grammar (bound to ctx.model on first use); -1 (nothing accepted)
        when the grammar and the bias allow no token."""
        if self.grammar is not None and self._matcher is None:
            self.bind(ctx.model)
        tok = self.sample_logits(ctx.get_logits_ith(i))
        if tok >= 0:
            self.accept(tok)
        return tok

    def sample_logits(self, logits: np.ndarray) -> int:
        """The token the chain chooses from one logits row (float32 [n_vocab]; not modified), or -1
        when the grammar's mask and the bias leave no token above -inf (never a banned token).

        The chain runs in C without the GIL (csrc/sampling.h): greedy is one pass over the row, with
        or without a mask, bias and penalties; the draw takes one rng.random() per sample and picks
        by the cumulative distribution of the sorted candidates. Nothing vocab-sized is allocated per
        call: the edited copy, the candidate buffers and the grammar's mask are this sampler's, grown
        to the widest row seen. Costs for n tokens: the grammar's fill_mask, then top_k = k < n:
        O(n + k log(n/k) log k) for a row in random order (O(n log k) at worst); top_k = 0: O(n)
        passes plus a sort of the tokens above max + log(min_p) (min_p > 0), or of the smallest
        threshold set holding top_p (or the draw's point) of the mass: O(n log n) only for nearly
        flat rows, as llama.cpp.

        Raises:
            ValueError: logits is not a non-empty 1-D row (or is wider than the bound model's
                vocabulary). LlamaxError: a grammar not bound yet (bind(model) first).
        """
        x = self._row(logits)
        n = x.shape[0]
        with self._lock:  # one call at a time per sampler: its scratch, rng, mask and history
            allowed = None
            if self.grammar is not None:
                if self._matcher is None or self._mask is None:
                    raise LlamaxError("the sampler's grammar is not bound to a model: call bind(model) first")
                self._matcher.fill_mask(self._mask)
                allowed = self._mask
            hist = self.history if self.penalizing else ()
            bias = len(self._bias_ids) > 0
            if self.temperature <= 0.0 and allowed is None and not bias and not hist:
                return _native.argmax(x)
            u = self.rng.random() if self.temperature > 0.0 else 0.0
            if self._chain is None or self._chain.cap < n:
                self._chain = _native.Chain(n)
            return self._chain.sample(x, hist, self.repeat_penalty, min(self.top_k, n), self.top_p, self.min_p,
                                      self.temperature, u, frequency_penalty=self.frequency_penalty,
                                      presence_penalty=self.presence_penalty, allowed=allowed,
                                      bias_ids=self._bias_ids if bias else None,
                                      bias_values=self._bias_values if bias else None)

    @staticmethod
    def _row(logits: np.ndarray) -> np.ndarray:
        x = np.asarray(logits, dtype=np.float32)
        if x.ndim != 1 or x.shape[0] == 0:
            raise ValueError(f"logits must be a non-empty 1-D row, got shape {x.shape}")
        if x.shape[0] > _native.MAX_VOCAB:
            raise ValueError(f"a row of {x.shape[0]} logits: at most {_native.MAX_VOCAB}")
        return np.ascontiguousarray(x)

    def _sample_reference(self, logits: np.ndarray, u: float, allowed: np.ndarray | None = None) -> int:
        """The numpy oracle of the C chain (csrc/sampling.h) for the uniform draw u: a full sort, O(n log n).

        allowed: the grammar's bitmask (uint32 words; None: every token, or the bound matcher's
        current mask if the sampler has a grammar). Order: logit descending, then token id
        ascending; NaN counts as -inf. Touches neither the rng, the history nor the matcher.
        """
        x = self._row(logits).copy()
        n = x.shape[0]
        if allowed is None and self._matcher is not None and self._mask is not None:
            allowed = np.zeros_like(self._mask)
            self._matcher.fill_mask(allowed)
        if allowed is not None:
            bits = np.unpackbits(np.asarray(allowed, dtype="<u4").view(np.uint8), bitorder="little")[:n]
            x[bits == 0] = -np.inf
        with np.errstate(invalid="ignore"):  # +inf - inf: NaN, then -inf below
            for t, b in self.logit_bias.items():
                if t < n:
                    x[t] += np.float32(b)
        hist = [t for t in self.history if 0 <= t < n] if self.penalizing else []
        if hist:
            idx, cnt = np.unique(np.array(hist, dtype=np.int64), return_counts=True)
            v = x[idx]
            v = np.where(v > 0, v / np.float32(self.repeat_penalty), v * np.float32(self.repeat_penalty))
            x[idx] = v - (cnt.astype(np.float32) * np.float32(self.frequency_penalty)
                          + np.float32(self.presence_penalty))
        x[np.isnan(x)] = -np.inf
        if (allowed is not None or self.logit_bias) and not (x > -np.inf).any():
            return -1
        if self.temperature <= 0.0:
            return int(np.argmax(x))
        k = self.top_k if 0 < self.top_k < n else n
        cand = np.lexsort((np.arange(n), -x))[:k]
        lv = x[cand].astype(np.float64)
        if not np.isfinite(lv[0]):
            return int(cand[0])
        p = np.exp(lv - lv[0])
        p /= p.sum()
        if self.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(p), self.top_p) + 1)
            cand, lv, p = cand[:keep], lv[:keep], p[:keep]
        if self.min_p > 0.0:  # p >= min_p * p[0], as exp(lv - lv[0]) >= min_p
            keep = max(1, int(np.count_nonzero(np.exp(lv - lv[0]) >= self.min_p)))
            cand, lv = cand[:keep], lv[:keep]
        cw = np.cumsum(np.exp((lv - lv[0]) / self.temperature))
        return int(cand[min(int(np.searchsorted(cw, u * cw[-1], side="right")), len(cand) - 1)])

    def __getstate__(self) -> dict:
        """Settings, rng, history and grammar; not the scratch, nor the grammar's matcher (native
        state): an unpickled sampler with a grammar must be bound again, and its grammar starts over."""
        state = self.__dict__.copy()
        del state["_lock"], state["_chain"], state["_matcher"], state["_mask"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock, self._chain, self._matcher, self._mask = threading.Lock(), None, None, None


# ---- logprobs of raw rows ------------------------------------------------------------------------

def _check_k(k: int) -> int:
    k = checks.integer(k, "k")
    if not 0 <= k <= LOGPROBS_MAX_K:
        raise ValueError(f"k = {k}: logprobs return 0 to {LOGPROBS_MAX_K} alternatives")
    return k


def token_logprobs(row: np.ndarray, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """The logprob of token under one raw logits row (log_softmax, NaN as -inf) and the k most likely
    tokens with theirs, descending (ties: lower id first): llama-server's n_probs, from the model's
    distribution before any sampler stage. O(n_vocab) in C (csrc/sampling.h lx_logprobs).

    Raises:
        ValueError: row not a non-empty 1-D row, token outside [0, n_vocab), k outside [0, 20] or
            above n_vocab. TypeError: token or k not an integer.
    """
    x = Sampler._row(row)
    token = checks.in_range(token, "token", 0, x.shape[0])
    lp, ids, lps = _native.logprobs(x, token, _check_k(k))
    return float(lp), list(zip(ids.tolist(), lps.tolist()))


def rows_logprobs(rows: np.ndarray, tokens: Any, k: int, *, n_threads: int | None = None
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """token_logprobs over rows [m, n_vocab] and tokens [m] (echo's prompt logprobs: row i and the
    token that follows it): (logprobs float32 [m], top ids int32 [m, k], top logprobs float32 [m, k]).
    Rows run in parallel in C without the GIL (n_threads: None / -1 = all cores); the result does
    not depend on n_threads.

    Raises:
        ValueError: rows not 2-D, tokens not m ids in [0, n_vocab), k outside [0, 20].
    """
    x = np.ascontiguousarray(np.asarray(rows, dtype=np.float32))
    if x.ndim != 2:
        raise ValueError(f"rows must be 2-D [m, n_vocab], got shape {x.shape}")
    t = np.asarray(tokens)
    if t.ndim != 1 or (t.size and not np.issubdtype(t.dtype, np.integer)):
        raise ValueError(f"tokens must be a 1-D array of token ids, got shape {t.shape} dtype {t.dtype}")
    if t.size and (t.min() < 0 or t.max() >= x.shape[1]):
        raise ValueError(f"a token outside [0, {x.shape[1]}): {int(t.min())} .. {int(t.max())}")
    return _native.logprobs_rows(x, np.ascontiguousarray(t, dtype=np.int32), _check_k(k), n_threads)
