"""Speculative decoding: tokens drafted cheaply, verified by the target model in one decode.

A generated token costs one read of every weight; a decode of [last, d1 .. dk] costs about the same
read plus k tokens of arithmetic, and gives the target's logits after each of them. Sampling those
rows in order with the sequence's own sampler (llama.cpp's sample-and-accept) and stopping at the
first sampled token that differs from the draft gives exactly the tokens decoding one at a time would
have given: the kernels are batch-invariant (a row's logits do not depend on the rows beside it) and
the sampler draws once per produced token, as without drafts. So greedy output is bit-identical with
and without speculation, and seeded sampling too; the drafts only change the speed.

    Speculative     the settings: kind "ngram" (drafts from the sequence itself) or "draft" (a second
                    model), n_max / n_min drafted tokens
    Drafter         what proposes tokens: NgramDrafter here, llamax.draft.DraftModel
    DecodeCost      the step time t(n) = a + b * n of a decode of n tokens, fitted to the decodes seen
    SpecPolicy      how many drafted tokens each sequence verifies in a step: the expected tokens per
                    second, from each sequence's acceptance rate and the fitted cost
    Speculator      a drafter and the policy, for one context (used by llamax.generate and the Engine)
    verify          sample-and-accept over the verification rows

The rejected tail of a verification leaves the memory with seq_rm(seq, p, -1): a KV cache and iSWA
drop the cells; a recurrent or hybrid memory puts back the state after the last kept token, from the
per-token states it keeps for the window (Memory.reserve_rollback). Nothing else in the cache moves.
"""
from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from llamax import checks
from llamax.errors import LlamaxError

if TYPE_CHECKING:
    from llamax.memory.base import Memory
    from llamax.sequence import Sampled, SeqDecoder

__all__ = ["DecodeCost", "Drafter", "NgramDrafter", "SpecPolicy", "Speculative", "Speculator", "cut_tail", "equal_drafts",
           "equalize", "resolve", "verify"]

KINDS = ("ngram", "draft")
N_MAX_LIMIT = 64            # drafted tokens per sequence and step, at most


@dataclass(frozen=True)
class Speculative:
    """Speculative decoding settings (llama.cpp's --spec-type, --draft-max, --draft-min, -md).

    Args:
        kind: "ngram": drafts looked up in the sequence's own prompt and output (the last ngram_max ..
            ngram_min tokens found earlier, the tokens that followed them proposed); costs microseconds,
            pays on input-grounded text (rewrites, quotes, summaries of a given text). "draft": a second
            model sharing the target's vocabulary drafts greedily in its own context.
        n_max: most tokens drafted per sequence and step (1..64); the policy drafts fewer while the
            sequence's drafts are rarely accepted or the decode is compute-bound (many busy sequences).
        n_min: a draft shorter than this is not verified (0: any).
        model: the draft model (kind "draft"): a llamax.Model, a registry name or a GGUF path.
        p_min: kind "draft": stop drafting at a token whose draft probability is below this (llama.cpp's
            --draft-p-min).
        ngram_max, ngram_min: kind "ngram": the lookup lengths tried, longest first.
        adaptive: True: the policy (SpecPolicy) decides how many tokens each step drafts, up to n_max;
            False: every step drafts up to n_max whatever it costs (llama.cpp's behaviour).

    Raises:
        ValueError: an unknown kind, n_min > n_max, bounds outside their ranges, "draft" without a
            model or a model with "ngram".
    """

    kind: str = "ngram"
    n_max: int = 16
    n_min: int = 0
    model: Any = None
    p_min: float = 0.75
    ngram_max: int = 4
    ngram_min: int = 2
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"speculative kind {self.kind!r}: one of {', '.join(KINDS)}")
        checks.in_range(self.n_max, "n_max", 1, N_MAX_LIMIT + 1)
        checks.in_range(self.n_min, "n_min", 0, self.n_max + 1)
        if not 0.0 <= float(self.p_min) <= 1.0:
            raise ValueError(f"p_min = {self.p_min}: a probability in [0, 1]")
        checks.in_range(self.ngram_min, "ngram_min", 1, 65)
        checks.in_range(self.ngram_max, "ngram_max", self.ngram_min, 65)
        if self.kind == "draft" and self.model is None:
            raise ValueError("speculative kind 'draft' needs a draft model (model=Model, registry name or path)")
        if self.kind == "ngram" and self.model is not None:
            raise ValueError("speculative kind 'ngram' drafts from the sequence itself: no model")


def resolve(spec: Speculative | bool | str | None, default: Speculative | None = None) -> Speculative | None:
    """A speculative setting as callers give it: None / False (off), True (default, else ngram),
    "ngram" / "none", or a Speculative.

    Raises:
        TypeError: anything else. ValueError: an unknown kind name."""
    if spec is None or spec is False or spec == "none":
        return None
    if spec is True:
        return default if default is not None else Speculative()
    if isinstance(spec, str):
        if spec == "draft":
            if default is not None and default.kind == "draft":
                return default
            raise ValueError("speculative 'draft' needs a draft model: pass Speculative(kind='draft', model=...)")
        return Speculative(kind=spec)
    if isinstance(spec, Speculative):
        return spec
    raise TypeError(f"speculative: None, a bool, 'ngram' or a llamax.Speculative, not {type(spec).__name__}")


class Drafter(Protocol):
    """What proposes tokens for sequences (keys are the caller's: a sequence id or slot)."""

    def draft(self, seqs: Sequence[tuple[int, Sequence[int], int]]) -> list[list[int]]:
        """For each (key, tokens, n_max): up to n_max tokens proposed to follow tokens (the sequence in
        position order; its last token is the one the target decodes next). Never raises for lack of
        room: a sequence it cannot draft for gets []."""

    def release(self, key: int) -> None:
        """Forget what is held for key (its sequence ended, or changed other than by growing)."""

    def close(self) -> None:
        """Free what the drafter holds."""


# ---- n-gram drafts ---------------------------------------------------------------------------------

class _NgramIndex:
    """One sequence's tokens and, per lookup length n, where each n-gram last occurred: the index of
    the token that followed it. The sequence's final n-gram is entered only once a token follows it,
    so a lookup of the sequence's end finds an earlier occurrence. O(n_sizes) per token."""

    __slots__ = ("sizes", "toks", "maps")

    def __init__(self, sizes: Sequence[int]) -> None:
        self.sizes = tuple(sizes)
        self.toks: list[int] = []
        self.maps: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}

    def extends(self, tokens: Sequence[int]) -> bool:
        """tokens begin with what is indexed (checked at its first, middle and last token)."""
        h = len(self.toks)
        if len(tokens) < h:
            return False
        return h == 0 or tokens[0] == self.toks[0] and tokens[h // 2] == self.toks[h // 2] and tokens[h - 1] == self.toks[-1]

    def extend(self, tokens: Sequence[int]) -> None:
        toks, maps = self.toks, self.maps
        for i in range(len(toks), len(tokens)):
            toks.append(int(tokens[i]))
            for n in self.sizes:
                if i >= n:
                    maps[n][tuple(toks[i - n:i])] = i

    def propose(self, n_max: int) -> list[int]:
        """The tokens that followed the latest earlier occurrence of the sequence's last n tokens (the
        longest n that occurred), at most n_max."""
        toks = self.toks
        for n in self.sizes:
            if len(toks) > n:
                at = self.maps[n].get(tuple(toks[-n:]))
                if at is not None:
                    return toks[at:at + n_max]
        return []


class NgramDrafter:
    """Drafts from each sequence's own tokens (prompt lookup; llama.cpp's ngram-simple): the latest
    earlier occurrence of its last ngram_max .. ngram_min tokens, and what followed it. The index
    grows with the sequence (O(1) per token); a sequence whose tokens no longer extend what was indexed
    (a context shift) is indexed again."""

    def __init__(self, ngram_max: int = 4, ngram_min: int = 2) -> None:
        self.sizes = tuple(range(ngram_max, ngram_min - 1, -1))
        self._seqs: dict[int, _NgramIndex] = {}

    def draft(self, seqs: Sequence[tuple[int, Sequence[int], int]]) -> list[list[int]]:
        out = []
        for key, tokens, n_max in seqs:
            ix = self._seqs.get(key)
            if ix is None or not ix.extends(tokens):
                ix = self._seqs[key] = _NgramIndex(self.sizes)
            ix.extend(tokens)
            out.append(ix.propose(n_max) if n_max > 0 else [])
        return out

    def release(self, key: int) -> None:
        self._seqs.pop(key, None)

    def close(self) -> None:
        self._seqs.clear()


# ---- the policy ------------------------------------------------------------------------------------

class DecodeCost:
    """The time t(n) of a decode of n tokens, learnt from the decodes observed.

    A CPU's decode time is not linear in n: the weight products change kernels with the batch
    (gemm.h: up to 8 tokens the rows go in the vector lanes, beyond that the tokens), so a 9th
    token can cost far more than the 8th. Each batch size seen keeps its own running mean
    (`alpha` weight for the newest); a size not seen yet is interpolated between its nearest seen
    neighbours, or extrapolated from the nearest one with the slope of a least-squares line over
    all observations (each older one weighing `decay` times less, the slope pulled towards
    t / 16 per token, the premise of speculation, until the data spans several sizes). So an
    unseen size may look cheap once, is tried, and is then known; sizes are explored by doubling
    (explore_limit), so one wrong guess costs at most one step of twice the largest size seen.

    A step's time also holds what the host did meanwhile (another process, a page fault, the
    collector), which only ever adds. So one slow step must not close a size for good: an
    observation is taken as at most CLIP times what was expected of its size, and a size's mean
    expires once the size was not seen for TRUST observations per time it was seen (at most
    `horizon`): a size seen once and found slow is tried again soon, one seen often only rarely.
    O(sizes seen) per observation, O(log sizes) per query."""

    PRIOR_TOKENS = 16.0    # the slope's prior: (a + b n) / (PRIOR_TOKENS + n)
    RIDGE = 4.0            # the prior's weight, as a spread of n
    CLIP = 2.0             # an observation counts as at most CLIP x the time expected of its size
    TRUST = 8              # observations a size's mean is kept per time the size was seen

    def __init__(self, decay: float = 0.97, alpha: float = 0.3, horizon: int = 64) -> None:
        self.decay, self.alpha, self.horizon = decay, alpha, horizon
        self._s = np.zeros(5)  # weighted sums: w, w n, w t, w n^2, w n t
        self._t: dict[int, float] = {}   # batch size -> running mean time (the sizes not expired)
        self._sizes: list[int] = []      # the sizes of _t, sorted
        self._when: dict[int, int] = {}  # batch size -> the observation that last updated it
        self._seen: dict[int, int] = {}  # batch size -> its observations so far
        self._count = 0

    def observe(self, n_tokens: int, seconds: float) -> None:
        k = int(n_tokens)
        n, t = float(k), float(seconds)
        if self.known:
            t = min(t, self.CLIP * self.time(k))
        self._s *= self.decay
        self._s += (1.0, n, t, n * n, n * t)
        self._count += 1
        self._when[k] = self._count
        self._seen[k] = self._seen.get(k, 0) + 1
        if k in self._t:
            self._t[k] += self.alpha * (t - self._t[k])
        else:
            self._t[k] = t
            bisect.insort(self._sizes, k)
        for j in [j for j in self._sizes if self._expired(j)]:
            del self._t[j]
            self._sizes.remove(j)

    def _expired(self, n: int) -> bool:
        """Size n's mean is past trusting: not seen for TRUST observations per time it was seen (at
        most `horizon`)."""
        return self._count - self._when[n] >= min(self.horizon, self.TRUST * self._seen[n])

    @property
    def known(self) -> bool:
        return self._s[0] > 0

    def coef(self) -> tuple[float, float]:
        """(a, b) of the least-squares line, in seconds; (1, 1 / PRIOR_TOKENS) before any
        observation (only their ratio matters then)."""
        w, sn, st, snn, snt = self._s
        if w <= 0:
            return 1.0, 1.0 / self.PRIOR_TOKENS
        n_bar, t_bar = sn / w, st / w
        s_nn, s_nt = snn - w * n_bar * n_bar, snt - w * n_bar * t_bar
        b0 = t_bar / (self.PRIOR_TOKENS + n_bar)
        b = max((s_nt + self.RIDGE * b0) / (max(s_nn, 0.0) + self.RIDGE), 0.0)
        a = max(t_bar - b * n_bar, 0.05 * t_bar)
        return a, b

    def stale(self, n: int) -> bool:
        """Size n was not seen in the last `horizon` observations (or never): a step without drafts
        measures it, so the cost of drafting is always weighed against a measured step without."""
        return self._count - self._when.get(n, -self.horizon) >= self.horizon

    def explore_limit(self, n0: int) -> int:
        """The largest batch a step may try: twice the largest size seen (at least n0 + 1), so the
        sizes are explored by doubling and one step's wrong guess costs at most one such step."""
        return max(2 * max(self._sizes[-1] if self._sizes else n0, n0), n0 + 1)

    def time(self, n: int) -> float:
        """t(n): the running mean of size n, else interpolated or extrapolated (see the class)."""
        t = self._t.get(n)
        if t is not None:
            return t
        a, b = self.coef()
        sizes = self._sizes
        i = bisect.bisect_left(sizes, n)
        lo = sizes[i - 1] if i > 0 else None
        hi = sizes[i] if i < len(sizes) else None
        if lo is not None and hi is not None:
            f = (n - lo) / (hi - lo)
            return self._t[lo] + f * (self._t[hi] - self._t[lo])
        if lo is not None:
            return self._t[lo] + b * (n - lo)
        if hi is not None:
            return max(self._t[hi] - b * (hi - n), 0.0)
        return a + b * n


class _Acceptance:
    """A sequence's rate of accepted draft tokens (successes / (successes + first failures), the
    geometric model's estimate), forgetting old outcomes; between verifications it drifts back to
    the prior, so a sequence that stopped drafting tries again later."""

    __slots__ = ("succ", "fail")
    PRIOR = (1.0, 1.0)

    def __init__(self) -> None:
        self.succ, self.fail = 0.0, 0.0

    @property
    def rate(self) -> float:
        s, f = self.succ + self.PRIOR[0], self.fail + self.PRIOR[1]
        return s / (s + f)

    def update(self, n_drafted: int, n_accepted: int, decay: float = 0.9) -> None:
        self.succ = self.succ * decay + n_accepted
        self.fail = self.fail * decay + (1.0 if n_accepted < n_drafted else 0.0)

    def idle(self, decay: float = 0.97) -> None:
        self.succ *= decay
        self.fail *= decay


class SpecPolicy:
    """How many drafted tokens each sequence verifies in a step, chosen for the most expected tokens
    per second.

    With acceptance rate r, a sequence's j-th drafted token adds r^j expected tokens (it counts only
    if the j - 1 before it were accepted) and costs b (+ the drafter's time per token) of step time.
    Starting from the step without drafts (P = n_seqs tokens in T = t(n_seqs)), drafted tokens are
    taken in decreasing r^j while r^j > cost * P / T, the point where one more lowers P / T. With many
    busy sequences P / T is high and b large (a compute-bound decode), so few or no tokens are
    drafted: speculation runs only while it pays. O(n_tokens log n_seqs) per step."""

    def __init__(self) -> None:
        self.cost = DecodeCost()
        self.draft_s_per_token = 0.0       # the drafter's time per drafted token (EMA)
        self._acc: dict[int, _Acceptance] = {}

    def rate(self, key: int) -> float:
        return self._acc.setdefault(key, _Acceptance()).rate

    def budget(self, keys: Sequence[int], caps: Sequence[int], n_fixed: int | None = None) -> list[int]:
        """Drafted tokens per sequence (at most caps[i]) for a step decoding one token for each of
        keys (n_fixed: the step's tokens without drafts, default len(keys)): the drafted tokens in
        decreasing expected yield r^j, as many of them as give the most expected tokens per second
        P(m) / (t(n_fixed + m) + m * the drafter's time per token). None while the step without
        drafts has no recent measurement."""
        n0 = len(keys) if n_fixed is None else n_fixed
        out = [0] * len(keys)
        if self.cost.stale(n0):  # measure the step without drafts first (see DecodeCost.stale)
            return out
        heap = [(-self.rate(k), i, self.rate(k)) for i, k in enumerate(keys) if caps[i] > 0]
        heapq.heapify(heap)
        order: list[int] = []          # the sequence of each drafted token, in decreasing yield
        taken = [0] * len(keys)
        P = float(len(keys))
        best, best_m = P / max(self.cost.time(n0), 1e-12), 0
        limit = self.cost.explore_limit(n0) - n0
        while heap and len(order) < limit:
            neg_g, i, r = heapq.heappop(heap)
            order.append(i)
            taken[i] += 1
            P -= neg_g
            m = len(order)
            rate = P / max(self.cost.time(n0 + m) + m * self.draft_s_per_token, 1e-12)
            if rate > best:
                best, best_m = rate, m
            if taken[i] < caps[i]:
                heapq.heappush(heap, (neg_g * r, i, r))
        for i in order[:best_m]:
            out[i] += 1
        return out

    def outcome(self, key: int, n_drafted: int, n_accepted: int) -> None:
        acc = self._acc.setdefault(key, _Acceptance())
        if n_drafted:
            acc.update(n_drafted, n_accepted)
        else:
            acc.idle()

    def forget(self, key: int) -> None:
        self._acc.pop(key, None)


# ---- verification ----------------------------------------------------------------------------------

def verify(decoder: SeqDecoder, row: Callable[[int], np.ndarray], draft: Sequence[int]) -> tuple[list[Sampled], int]:
    """llama.cpp's sample-and-accept: the decoder steps on row(0), row(1), ... (row i: the target's
    logits after the sequence's next token and draft[:i]) until a step ends the sequence, samples a
    token other than draft[i], or passes the draft (the bonus token). Every step is the decoder's own
    (sampler, stop strings, max_tokens), in order, as without drafts.

    Returns:
        (the steps, n_accepted): len(steps) rows stay in the sequence (its next token and the first
        len(steps) - 1 drafted tokens); the last step's token (unless it ended the sequence) is the
        next one to decode. n_accepted: the drafted tokens the target sampled too.
    """
    outs = []
    n_acc = 0
    for i in range(len(draft) + 1):
        out = decoder.step(row(i))
        outs.append(out)
        if i < len(draft) and out.token == draft[i]:
            n_acc += 1
            if out.stop is None:
                continue
        break
    return outs, n_acc


class Speculator:
    """Speculative decoding over one context: a drafter, the policy and the counts.

    Args:
        spec: the settings.
        model: the target model.
        n_seq_max: sequences (keys 0 .. n_seq_max - 1) that may draft.
        n_ctx: the draft model's context (kind "draft"; 0: its default).
        n_threads: the draft model's threads.
    """

    def __init__(self, spec: Speculative, model: Any, *, n_seq_max: int = 1, n_ctx: int = 0,
                 n_threads: int | None = None) -> None:
        self.spec = spec
        self.drafter: Drafter
        if spec.kind == "ngram":
            self.drafter = NgramDrafter(spec.ngram_max, spec.ngram_min)
        else:
            from llamax.draft import DraftModel

            self.drafter = DraftModel(spec.model, model, n_seq_max=n_seq_max, n_ctx=n_ctx, n_threads=n_threads,
                                      p_min=spec.p_min)
        self.policy = SpecPolicy()
        self.n_drafted = 0
        self.n_accepted = 0

    def plan(self, seqs: Sequence[tuple[int, int]], tokens: Callable[[int], Sequence[int]],
             n_fixed: int | None = None, specs: Sequence[Speculative] | None = None) -> list[list[int]]:
        """Drafts for (key, cap) (cap: most drafted tokens the caller has room for) under the policy.
        tokens(i): sequence i's tokens in position order, its next token last (asked only of the
        sequences the policy lets draft: with many busy slots, none). n_fixed: the step's tokens
        without drafts. specs: per sequence settings (n_max, n_min), else this one's."""
        if not seqs:
            return []
        specs = specs if specs is not None else [self.spec] * len(seqs)
        caps = [max(0, min(int(c), sp.n_max)) for (_, c), sp in zip(seqs, specs)]
        want = self.policy.budget([k for k, _ in seqs], caps, n_fixed)
        want = [w if sp.adaptive else c for w, c, sp in zip(want, caps, specs)]
        live = [i for i, w in enumerate(want) if w > 0]
        asks = {i: (seqs[i][0], tokens(i), want[i]) for i in live}
        drafts: list[list[int]] = [[] for _ in seqs]
        if live:
            st = getattr(self.drafter, "stats", None)  # a draft model's: the time of its drafting rounds
            before = (st.rounds_s, st.n_drafted) if st is not None else None
            got = self.drafter.draft([asks[i] for i in live])
            for i, d in zip(live, got):
                d = [int(t) for t in d[:want[i]]]
                drafts[i] = d if len(d) >= max(specs[i].n_min, 1) else []
            if st is not None and before is not None and st.n_drafted > before[1]:
                per = (st.rounds_s - before[0]) / (st.n_drafted - before[1])
                p = self.policy  # the n-gram lookup's time is noise next to a decode: only a model's counts
                p.draft_s_per_token = per if p.draft_s_per_token == 0 else 0.8 * p.draft_s_per_token + 0.2 * per
        return drafts

    def observe(self, n_tokens: int, seconds: float) -> None:
        """A generation step's decode of n_tokens took seconds."""
        self.policy.cost.observe(n_tokens, seconds)

    def outcome(self, key: int, n_drafted: int, n_accepted: int) -> None:
        self.policy.outcome(key, n_drafted, n_accepted)
        self.n_drafted += n_drafted
        self.n_accepted += n_accepted

    def release(self, key: int) -> None:
        """key's sequence ended or changed other than by growing (a context shift)."""
        self.drafter.release(key)
        self.policy.forget(key)

    def close(self) -> None:
        self.drafter.close()


def equal_drafts(memory: Memory, unified: bool) -> bool:
    """True when a step's drafts must all have one length and share the batch with no prompt chunk:
    a sliding-window cache split with split_equal (one stream per sequence). A sliding-window cache
    reuses a cell once the window of its sequence's last position before the ubatch has passed it;
    drafts of one sequence spread over two ubatches would let the second reuse cells that the window
    of a draft position (later rejected) has passed but the kept position's window still covers. One
    ubatch for every sequence's next token, then one for all the drafts (equal lengths), keeps every
    reuse decided by kept positions. A unified cache puts the whole verification in its first ubatch
    (the Engine and generate keep it within n_ubatch)."""
    return not unified and getattr(memory, "swa", None) is not None


def equalize(drafts: list[list[int]]) -> list[list[int]]:
    """The drafts cut to the shortest non-empty one (see equal_drafts)."""
    n = min((len(d) for d in drafts if d), default=0)
    return [d[:n] for d in drafts]


def cut_tail(memory: Memory, seq_id: int, p0: int) -> None:
    """Remove the rejected drafts (positions >= p0) of seq_id from the memory.

    Raises:
        LlamaxError: the memory cannot cut them (a recurrent state outside its rollback window;
            Memory.reserve_rollback was not given the draft window)."""
    if not memory.seq_rm(seq_id, p0, -1):
        raise LlamaxError(f"speculative decoding: the memory cannot remove positions >= {p0} of sequence "
                          f"{seq_id} (a recurrent state outside its rollback window)")

