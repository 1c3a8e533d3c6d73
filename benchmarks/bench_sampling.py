"""Benchmark of the sampler chain (csrc/sampling.c) against the numpy sampler it replaced.

Scenario: one logits row per sample, LLM-like (a few tokens far above a normal tail), for the
vocabularies of SmolLM2 (49152) and Gemma 3 (262144); greedy, the default settings (top_k 40,
top_p 0.95, min_p 0.05, temperature 0.8), top_k = 0 with the other defaults, and the defaults with
a repeat penalty over 64 recent tokens. Prints the median µs per sample over --runs samples of the
old numpy path (llamax/sampling.py at 39296ed, copied below) and of Sampler.sample_logits, measured
in the same run, and their ratio.

Then the row's edits, which the numpy path never had (C µs only): a grammar mask allowing 50% and 1%
of the tokens (a fixed bitmask handed out by a minimal grammar, so its fill_mask is a 4-byte-per-32-
tokens copy), a 16-entry logit bias, and presence + frequency + repeat penalties over 64 tokens, each
with the default settings and greedy.

    PYTHONPATH=. python benchmarks/bench_sampling.py [--runs 200]
"""
import argparse

import numpy as np
from timing import median_time

from llamax.sampling import Sampler


def old_sample_logits(s: Sampler, logits: np.ndarray) -> int:
    """The numpy sampler before the C chain."""
    logits = np.asarray(logits, dtype=np.float32)
    if s.repeat_penalty != 1.0 and s.history:
        logits = logits.copy()
        idx = np.unique(np.fromiter(s.history, dtype=np.int64))
        v = logits[idx]
        logits[idx] = np.where(v > 0, v / s.repeat_penalty, v * s.repeat_penalty)
    if s.temperature <= 0.0:
        return int(np.argmax(logits))
    n = logits.shape[0]
    k = s.top_k if 0 < s.top_k < n else n
    cand = np.argpartition(-logits, k - 1)[:k] if k < n else np.arange(n)
    cand = cand[np.argsort(-logits[cand], kind="stable")]
    lv = logits[cand].astype(np.float64)
    p = np.exp(lv - lv[0])
    p /= p.sum()
    if s.top_p < 1.0:
        keep = int(np.searchsorted(np.cumsum(p), s.top_p) + 1)
        cand, lv, p = cand[:keep], lv[:keep], p[:keep]
    if s.min_p > 0.0:
        keep = max(1, int(np.count_nonzero(p >= s.min_p * p[0])))
        cand, lv = cand[:keep], lv[:keep]
    w = np.exp((lv - lv[0]) / s.temperature)
    return int(cand[s.rng.choice(len(cand), p=w / w.sum())])


def llm_row(n: int, rng: np.random.Generator) -> np.ndarray:
    x = (rng.standard_normal(n) * 2.0).astype(np.float32)
    x[rng.integers(0, n, 8)] += rng.uniform(8, 14, 8).astype(np.float32)
    return x


CASES = {
    "greedy": dict(temperature=0.0, top_k=1, top_p=1.0, min_p=0.0),
    "default": dict(),
    "top_k=0": dict(top_k=0),
    "penalty": dict(repeat_penalty=1.1),
}
GREEDY = CASES["greedy"]


class FixedMask:
    """A grammar whose matcher always allows the same tokens (the Sampler's grammar protocol)."""

    def __init__(self, mask: np.ndarray) -> None:
        self.mask = mask

    def matcher(self, model: object) -> "FixedMask":
        return self

    def fill_mask(self, buf: np.ndarray) -> None:
        buf[:] = self.mask

    def accept(self, token: int) -> bool:
        return True


class Vocab:
    def __init__(self, n_vocab: int) -> None:
        self.n_vocab = n_vocab


def edit_cases(n: int, rng: np.random.Generator) -> dict[str, dict]:
    def mask(frac: float) -> FixedMask:
        bits = np.zeros(((n + 31) // 32) * 32, dtype=np.uint8)
        bits[:n] = rng.random(n) < frac
        return FixedMask(np.packbits(bits, bitorder="little").view("<u4").copy())

    bias = {int(t): float(b) for t, b in zip(rng.integers(0, n, 16), rng.uniform(-5, 5, 16))}
    pen = dict(repeat_penalty=1.1, presence_penalty=0.5, frequency_penalty=0.5)
    cases = {}
    for frac in (0.5, 0.01):
        g = mask(frac)
        cases[f"mask {frac:.0%}"] = dict(grammar=g)
        cases[f"mask {frac:.0%} greedy"] = dict(grammar=g, **GREEDY)
    cases["bias16"] = dict(logit_bias=bias)
    cases["bias16 greedy"] = dict(logit_bias=bias, **GREEDY)
    cases["pen+freq+pres"] = dict(pen)
    cases["pen+freq+pres greedy"] = dict(pen, **GREEDY)
    cases["all greedy"] = dict(pen, logit_bias=bias, grammar=mask(0.5), **GREEDY)
    return cases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=200)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    print(f"{'n_vocab':>8} {'case':>22} {'numpy µs':>10} {'C µs':>8} {'speed-up':>9}")
    for n in (49152, 262144):
        rows = [llm_row(n, rng) for _ in range(16)]
        hist = rng.integers(0, n, 64).tolist()
        for name, kw in CASES.items():
            res = []
            for fn in (old_sample_logits, Sampler.sample_logits):
                s = Sampler(seed=1, **kw)
                s.history.extend(hist)
                i = iter(range(10**9))
                res.append(median_time(lambda: fn(s, rows[next(i) % len(rows)]), a.runs, warmup=3) * 1e6)
            print(f"{n:>8} {name:>22} {res[0]:>10.1f} {res[1]:>8.1f} {res[0] / res[1]:>8.1f}x")
        for name, kw in edit_cases(n, rng).items():
            s = Sampler(seed=1, **kw)
            s.bind(Vocab(n))
            s.history.extend(hist)
            i = iter(range(10**9))
            us = median_time(lambda: s.sample_logits(rows[next(i) % len(rows)]), a.runs, warmup=3) * 1e6
            print(f"{n:>8} {name:>22} {'-':>10} {us:>8.1f}")


if __name__ == "__main__":
    main()
