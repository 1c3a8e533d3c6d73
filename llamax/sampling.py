"""Sampling (llama.cpp's common sampler chain): repeat penalty -> top-k -> top-p -> min-p ->
temperature -> a seeded draw; temperature <= 0 is greedy.

The chain runs in C over the logits row without sorting the vocabulary (csrc/sampling.h);
Sampler._sample_reference is its numpy oracle."""
from __future__ import annotations

import threading
from collections import deque
from typing import TYPE_CHECKING

import numpy as np

from llamax import checks
from llamax._native import sampling as _native

if TYPE_CHECKING:
    from llamax.context import Context

PENALTY_LAST_N = 64  # llama.cpp's default penalty window


class Sampler:
    """Chooses the next token from a context's logits; remembers the tokens it chose (for the penalty).

    Args:
        temperature: <= 0 picks the most likely token.
        top_k: keep the k most likely tokens (0: all).
        top_p: keep the smallest set whose probability reaches p (1.0: all).
        min_p: drop tokens below min_p times the most likely token's probability (0: none).
        repeat_penalty: divide positive / multiply negative logits of the last 64 tokens (1.0: off).
        seed: seed of the draw (None or -1, llama.cpp's default seed: fresh entropy).

    Raises:
        TypeError: a setting of the wrong type. ValueError: a setting out of range, or not finite.
    """

    def __init__(self, temperature: float = 0.8, top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05,
                 repeat_penalty: float = 1.0, seed: int | None = None) -> None:
        temperature, top_p, min_p, repeat_penalty = (checks.real(v, w) for v, w in (
            (temperature, "temperature"), (top_p, "top_p"), (min_p, "min_p"), (repeat_penalty, "repeat_penalty")))
        top_k = checks.integer(top_k, "top_k")
        if top_k < 0 or not 0.0 < top_p <= 1.0 or not 0.0 <= min_p <= 1.0 or repeat_penalty <= 0:
            raise ValueError(f"invalid sampler settings: top_k={top_k} top_p={top_p} min_p={min_p} "
                             f"repeat_penalty={repeat_penalty}")
        if seed is not None:
            seed = checks.integer(seed, "seed")
            if seed < -1:
                raise ValueError(f"seed = {seed}: a seed is >= 0, or -1 (or None) for fresh entropy")
        self.temperature, self.top_k, self.top_p, self.min_p = temperature, top_k, top_p, min_p
        self.repeat_penalty = repeat_penalty
        self.rng = np.random.default_rng(None if seed == -1 else seed)
        self.history: deque[int] = deque(maxlen=PENALTY_LAST_N)
        self._chain: _native.Chain | None = None  # the C scratch, sized to the widest row seen
        self._lock = threading.Lock()

    @classmethod
    def greedy(cls) -> "Sampler":
        return cls(temperature=0.0, top_k=1, top_p=1.0, min_p=0.0)

    def accept(self, token: int) -> None:
        """Record a token of the sequence (prompt tokens too, if the penalty should see them)."""
        self.history.append(int(token))

    def sample(self, ctx: Context, i: int = -1) -> int:
        """The next token from the logits of batch token i of the context's last decode."""
        tok = self.sample_logits(ctx.get_logits_ith(i))
        self.accept(tok)
        return tok

    def sample_logits(self, logits: np.ndarray) -> int:
        """The token the chain chooses from one logits row (float32 [n_vocab]; not modified).

        The chain runs in C without the GIL (csrc/sampling.h): greedy is one pass over the row; the
        draw takes one rng.random() per sample and picks by the cumulative distribution of the
        sorted candidates. Nothing vocab-sized is allocated per call: the penalised copy and the
        candidate buffers are this sampler's, grown to the widest row seen. Costs for n tokens:
        top_k = k < n: O(n + k log(n/k) log k) for a row in random order (O(n log k) at worst);
        top_k = 0: O(n) passes plus a sort of the tokens above max + log(min_p) (min_p > 0), or of
        the smallest threshold set holding top_p (or the draw's point) of the mass: O(n log n)
        only for nearly flat rows, as llama.cpp.

        Raises:
            ValueError: logits is not a non-empty 1-D row.
        """
        x = self._row(logits)
        n = x.shape[0]
        with self._lock:  # one call at a time per sampler: its scratch, rng and history
            penalise = self.repeat_penalty != 1.0 and len(self.history) > 0
            if self.temperature <= 0.0 and not penalise:
                return _native.argmax(x)
            u = self.rng.random() if self.temperature > 0.0 else 0.0
            if self._chain is None or self._chain.cap < n:
                self._chain = _native.Chain(n)
            return self._chain.sample(x, self.history if penalise else (), self.repeat_penalty, min(self.top_k, n),
                                      self.top_p, self.min_p, self.temperature, u)

    @staticmethod
    def _row(logits: np.ndarray) -> np.ndarray:
        x = np.asarray(logits, dtype=np.float32)
        if x.ndim != 1 or x.shape[0] == 0:
            raise ValueError(f"logits must be a non-empty 1-D row, got shape {x.shape}")
        if x.shape[0] > _native.MAX_VOCAB:
            raise ValueError(f"a row of {x.shape[0]} logits: at most {_native.MAX_VOCAB}")
        return np.ascontiguousarray(x)

    def _sample_reference(self, logits: np.ndarray, u: float) -> int:
        """The numpy oracle of the C chain (csrc/sampling.h) for the uniform draw u: a full sort, O(n log n).

        Order: logit descending, then token id ascending; NaN counts as -inf. Touches neither the
        rng nor the history.
        """
        x = self._row(logits).copy()
        n = x.shape[0]
        if self.repeat_penalty != 1.0 and self.history:
            idx = np.unique([t for t in self.history if 0 <= t < n]).astype(np.int64)
            v = x[idx]
            x[idx] = np.where(v > 0, v / np.float32(self.repeat_penalty), v * np.float32(self.repeat_penalty))
        x[np.isnan(x)] = -np.inf
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
        state = self.__dict__.copy()
        del state["_lock"], state["_chain"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock, self._chain = threading.Lock(), None
