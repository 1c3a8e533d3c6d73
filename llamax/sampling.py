"""Sampling (llama.cpp's common sampler chain): repeat penalty -> top-k -> top-p -> min-p ->
temperature -> a seeded draw; temperature <= 0 is greedy."""
from __future__ import annotations

from collections import deque

import numpy as np

from llamax import checks

PENALTY_LAST_N = 64  # llama.cpp's default penalty window


def _real(value, what: str) -> float:
    """A finite real number (ints and numpy scalars too)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise TypeError(f"{what} must be a number, got {type(value).__name__} {value!r}")
    v = float(value)
    if not np.isfinite(v):
        raise ValueError(f"{what} = {v} is not finite")
    return v


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
        temperature, top_p, min_p, repeat_penalty = (_real(v, w) for v, w in (
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

    @classmethod
    def greedy(cls) -> "Sampler":
        return cls(temperature=0.0, top_k=1, top_p=1.0, min_p=0.0)

    def accept(self, token: int) -> None:
        """Record a token of the sequence (prompt tokens too, if the penalty should see them)."""
        self.history.append(int(token))

    def sample(self, ctx, i: int = -1) -> int:
        """The next token from the logits of batch token i of the context's last decode."""
        tok = self.sample_logits(ctx.get_logits_ith(i))
        self.accept(tok)
        return tok

    def sample_logits(self, logits: np.ndarray) -> int:
        logits = np.asarray(logits, dtype=np.float32)
        if self.repeat_penalty != 1.0 and self.history:
            logits = logits.copy()
            idx = np.unique(np.fromiter(self.history, dtype=np.int64))
            v = logits[idx]
            logits[idx] = np.where(v > 0, v / self.repeat_penalty, v * self.repeat_penalty)
        if self.temperature <= 0.0:
            return int(np.argmax(logits))
        n = logits.shape[0]
        k = self.top_k if 0 < self.top_k < n else n
        cand = np.argpartition(-logits, k - 1)[:k] if k < n else np.arange(n)
        cand = cand[np.argsort(-logits[cand], kind="stable")]
        lv = logits[cand].astype(np.float64)
        p = np.exp(lv - lv[0])
        p /= p.sum()
        if self.top_p < 1.0:
            keep = int(np.searchsorted(np.cumsum(p), self.top_p) + 1)
            cand, lv, p = cand[:keep], lv[:keep], p[:keep]
        if self.min_p > 0.0:
            keep = max(1, int(np.count_nonzero(p >= self.min_p * p[0])))
            cand, lv = cand[:keep], lv[:keep]
        w = np.exp((lv - lv[0]) / self.temperature)
        return int(cand[self.rng.choice(len(cand), p=w / w.sum())])
