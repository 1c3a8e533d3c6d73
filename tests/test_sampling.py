"""The sampler chain in C (csrc/sampling.h) against its numpy oracle (Sampler._sample_reference),
greedy against np.argmax, and the old numpy sampler's seeded outputs; the row's edits (grammar mask,
logit bias, llama.cpp's penalties) and the Sampler's grammar protocol."""
import math
import pickle
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llamax._native import sampling as native
import llamax
from llamax.context import Context
from llamax.errors import LlamaxError
from llamax.sampling import PENALTY_LAST_N, Sampler

# every fast path against its scalar reference, at each SIMD level of this CPU
pytestmark = pytest.mark.usefixtures("every_simd_level")



def old_numpy_sample(s: Sampler, logits: np.ndarray) -> int:
    """The numpy sampler before the C chain (llamax/sampling.py at 39296ed), for seeded outputs."""
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


def row(kind: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """A logits row of one of the shapes the chain must handle."""
    if kind == "normal":
        return (rng.standard_normal(n) * 3).astype(np.float32)
    if kind == "peaked":  # an LLM-like row: a few tokens far above a long tail
        x = rng.standard_normal(n).astype(np.float32) * 2
        x[rng.integers(0, n, 5)] += 15
        return x
    if kind == "ties":  # few distinct values, -0.0 among them
        return rng.choice(np.float32([-1.0, -0.0, 0.0, 0.5, 2.0]), n)
    if kind == "equal":
        return np.full(n, 1.25, dtype=np.float32)
    if kind == "neginf":
        x = rng.standard_normal(n).astype(np.float32)
        x[rng.random(n) < 0.7] = -np.inf
        return x
    if kind == "allneginf":
        return np.full(n, -np.inf, dtype=np.float32)
    if kind == "nan":
        x = rng.standard_normal(n).astype(np.float32)
        x[rng.random(n) < 0.2] = np.nan
        return x
    if kind == "wide":  # a spread beyond the threshold stages (8, 32, 128, 512 below the max)
        return (rng.standard_normal(n) * 300).astype(np.float32)
    if kind == "posinf":
        x = rng.standard_normal(n).astype(np.float32)
        x[rng.integers(0, n, 2)] = np.inf
        return x
    raise AssertionError(kind)


KINDS = ("normal", "peaked", "ties", "equal", "neginf", "allneginf", "nan", "wide", "posinf")
SETTINGS = [
    dict(),                                                        # the defaults: 0.8, 40, 0.95, 0.05
    dict(top_k=0),
    dict(top_k=0, min_p=0.0),                                      # top-p stages over the whole row
    dict(top_k=0, min_p=0.0, top_p=1.0),                           # temperature only: draw stages
    dict(top_k=0, min_p=0.3, top_p=1.0),
    dict(top_k=0, min_p=0.0, top_p=1 - 1e-12),                     # no stage holds enough: every token
    dict(top_k=1),
    dict(top_k=7, top_p=1.0, min_p=0.0),
    dict(top_k=10**9),                                             # k > n_vocab
    dict(top_k=3000, top_p=0.5, min_p=0.0),
    dict(temperature=1e-6),
    dict(temperature=1e-300, top_k=0),
    dict(temperature=1e6, top_k=0, min_p=0.0, top_p=1.0),
    dict(temperature=50.0, top_k=100, top_p=0.99, min_p=0.0),
    dict(min_p=1.0, top_k=0),
    dict(top_p=1e-9, top_k=0, min_p=0.0),
    dict(repeat_penalty=1.3),
    dict(repeat_penalty=0.7, top_k=0, min_p=0.0),
    dict(temperature=0.0),
    dict(temperature=-1.0, repeat_penalty=1.5),
]


def with_history(s: Sampler, n: int, rng: np.random.Generator) -> Sampler:
    for t in rng.integers(-3, n + 3, 80):  # repeats, and ids outside the row (ignored)
        s.accept(int(t))
    s.accept(0)
    s.accept(0)
    return s


@pytest.mark.parametrize("kw", SETTINGS, ids=[",".join(f"{k}={v}" for k, v in kw.items()) or "defaults" for kw in SETTINGS])
@pytest.mark.parametrize("n", [1, 2, 7, 300, 5000])
def test_chain_matches_the_reference(kw, n):
    """Same token as the numpy oracle for the same uniform draw, over many rows of every kind."""
    rng = np.random.default_rng(n * 1000 + len(str(kw)))
    for kind in KINDS:
        for rep in range(12 if n < 5000 else 3):
            x = row(kind, n, rng)
            seed = int(rng.integers(0, 2**32))
            s = with_history(Sampler(seed=seed, **kw), n, rng)
            ref = Sampler(seed=seed, **kw)
            ref.history.extend(s.history)
            before = x.copy()
            u = np.random.default_rng(seed).random() if s.temperature > 0 else 0.0
            got = s.sample_logits(x)
            assert got == ref._sample_reference(x, u), (kind, rep, kw, n)
            np.testing.assert_array_equal(x, before)  # the row is never modified
            for u in (0.0, rng.random(), rng.random()):  # u exactly on a boundary is a matter of rounding
                chain = native.Chain(n)
                c = chain.sample(x, s.history, s.repeat_penalty, min(s.top_k, n), s.top_p, s.min_p, s.temperature, u)
                assert c == s._sample_reference(x, u), (kind, rep, kw, n, u)


@pytest.mark.parametrize("n", [49152 + 77, 262144])
@pytest.mark.parametrize("kind", ["normal", "peaked", "ties", "equal", "wide"])
def test_wide_vocabularies(n, kind):
    """Gemma-wide rows: each of the chain's paths (heap, min-p threshold, top-p and draw stages)."""
    rng = np.random.default_rng(n + len(kind))
    x = row(kind, n, rng)
    for kw in (dict(), dict(top_k=0), dict(top_k=0, min_p=0.0), dict(top_k=0, min_p=0.0, top_p=1.0),
               dict(top_k=0, min_p=0.0, top_p=1.0, temperature=1e4), dict(top_k=0, min_p=0.0, top_p=1 - 1e-12),
               dict(top_k=20000), dict(repeat_penalty=1.2)):
        s = Sampler(seed=5, **kw)
        s.history.extend(np.argsort(-x)[:10].tolist())
        ref = Sampler(seed=5, **kw)
        ref.history.extend(s.history)
        for _ in range(3):
            u = ref.rng.random()
            assert s.sample_logits(x) == ref._sample_reference(x, u), kw


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from([-np.inf, -3.0, -0.5, 0.0, 0.5, 1.0, 1.0 + 2**-20, 7.0]), min_size=1, max_size=200),
       st.integers(0, 250), st.sampled_from([0.05, 0.5, 0.95, 1.0]), st.sampled_from([0.0, 0.05, 0.9]),
       st.sampled_from([1e-3, 0.8, 3.0]), st.floats(0.0, 1.0, exclude_max=True))
def test_chain_matches_the_reference_on_ties(values, top_k, top_p, min_p, temperature, u):
    x = np.array(values, dtype=np.float32)
    s = Sampler(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    chain = native.Chain(len(x))
    assert chain.sample(x, (), 1.0, min(top_k, len(x)), top_p, min_p, temperature, u) == s._sample_reference(x, u)


@pytest.mark.parametrize("n", [1, 3, 64, 65, 1000, 262144, 262145])
def test_greedy_is_argmax(n):
    rng = np.random.default_rng(n)
    for kind in ("normal", "ties", "equal", "neginf", "allneginf", "posinf"):
        x = row(kind, n, rng)
        assert Sampler.greedy().sample_logits(x) == int(np.argmax(x)) == native.argmax(x), kind
        assert Sampler(temperature=0.0).sample_logits(x) == int(np.argmax(x))
    x = np.zeros(n, dtype=np.float32)
    x[n // 2:] = 1.0
    assert native.argmax(x) == n // 2  # the first of the largest
    x = np.float32([np.nan, 1.0, np.nan, 2.0, 2.0])
    assert native.argmax(x) == 3  # NaN is never chosen


def test_greedy_with_penalty():
    x = np.float32([1.0, 3.0, 2.9, -1.0])
    s = Sampler(temperature=0.0, repeat_penalty=1.1)
    assert s.sample_logits(x) == 1
    s.accept(1)
    assert s.sample_logits(x) == 2  # 3.0 / 1.1 < 2.9
    assert x[1] == 3.0


def test_seeded_outputs_are_the_old_numpy_samplers():
    """For rows without ties the C chain draws what the numpy sampler drew with the same seed (numpy's
    choice() takes one rng.random() and searches the cumulative distribution, as the chain does)."""
    rng = np.random.default_rng(0)
    for kw in (dict(), dict(top_k=0), dict(top_k=0, min_p=0.0), dict(top_k=0, min_p=0.0, top_p=1.0),
               dict(temperature=1.5, top_k=200), dict(repeat_penalty=1.2), dict(temperature=0.0)):
        for n in (50, 49152):
            x = row("normal", n, rng)
            new, old = Sampler(seed=11, **kw), Sampler(seed=11, **kw)
            for _ in range(20):
                t = new.sample_logits(x)
                assert t == old_numpy_sample(old, x), kw
                new.accept(t)
                old.accept(t)


def test_row_checks_and_conversions():
    s = Sampler(seed=1)
    with pytest.raises(ValueError, match="1-D"):
        s.sample_logits(np.zeros((2, 3), dtype=np.float32))
    with pytest.raises(ValueError, match="1-D"):
        s.sample_logits(np.zeros(0, dtype=np.float32))
    x = np.random.default_rng(1).standard_normal(400)
    a = Sampler(seed=3).sample_logits(x[::2])           # float64, strided: converted
    b = Sampler(seed=3).sample_logits(np.ascontiguousarray(x[::2], dtype=np.float32))
    assert a == b
    ro = np.float32(x)
    ro.flags.writeable = False
    assert Sampler.greedy().sample_logits(ro) == int(np.argmax(ro))
    with pytest.raises(ValueError):
        native.Chain(0)


def test_scratch_grows_and_is_reused():
    s = Sampler(seed=2)
    s.sample_logits(np.zeros(10, dtype=np.float32))
    chain = s._chain
    s.sample_logits(np.zeros(5, dtype=np.float32))
    assert s._chain is chain
    s.sample_logits(np.zeros(1000, dtype=np.float32))
    assert s._chain.cap == 1000


def test_pickle_keeps_the_settings_the_rng_and_the_history():
    s = Sampler(seed=4, top_k=5, repeat_penalty=1.1)
    x = np.random.default_rng(0).standard_normal(100).astype(np.float32)
    s.accept(3)
    s.sample_logits(x)
    t = pickle.loads(pickle.dumps(s))
    assert list(t.history) == list(s.history) and t.top_k == 5
    assert t.sample_logits(x) == s.sample_logits(x)


def test_one_sampler_from_many_threads():
    """Calls on one sampler from several threads are serialised (its scratch is not shared at once)."""
    s = Sampler(seed=9, top_k=0, min_p=0.0)
    x = np.random.default_rng(0).standard_normal(262144).astype(np.float32)
    out, errors = [], []

    def work():
        try:
            for _ in range(8):
                out.append(s.sample_logits(x))
        except Exception as e:  # pragma: no cover - a failure is reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(out) == 32
    ref, rng = Sampler(top_k=0, min_p=0.0), np.random.default_rng(9)
    assert sorted(out) == sorted(ref._sample_reference(x, rng.random()) for _ in range(32))


# ---- the row's edits: mask, bias, penalties ---------------------------------------------------------

def bitmask(allowed: np.ndarray, n: int) -> np.ndarray:
    """The uint32 bitmask [(n + 31) // 32] of a bool row (llguidance's layout: bit t & 31 of word t >> 5)."""
    bits = np.zeros(((n + 31) // 32) * 32, dtype=np.uint8)
    bits[:n] = allowed
    return np.packbits(bits, bitorder="little").view("<u4").copy()


def random_mask(n: int, frac: float, rng: np.random.Generator) -> np.ndarray:
    m = bitmask(rng.random(n) < frac, n)
    if n % 32:
        m[-1] |= np.uint32(0xFFFFFFFF) << np.uint32(n % 32)  # padding bits beyond the row are ignored
    return m


EDITS = [
    dict(presence_penalty=0.7),
    dict(frequency_penalty=0.4),
    dict(frequency_penalty=-0.3, presence_penalty=1.5, repeat_penalty=1.2),
    dict(logit_bias={0: 5.0, 3: -2.5, 6: float("-inf"), 10**6: 3.0}),
    dict(logit_bias={1: 30.0}, presence_penalty=0.5, repeat_penalty=0.8, frequency_penalty=0.2),
    dict(repeat_last_n=0, repeat_penalty=1.5, presence_penalty=1.0),   # no window: no penalties
    dict(repeat_last_n=8, frequency_penalty=1.0),
    dict(repeat_last_n=-1, frequency_penalty=0.1),
]
CHAINS = [dict(), dict(top_k=0), dict(top_k=0, min_p=0.0, top_p=1.0), dict(top_k=5, top_p=0.9, min_p=0.0),
          dict(temperature=0.0), dict(temperature=0.0, top_k=0)]


@pytest.mark.parametrize("edits", EDITS, ids=[",".join(f"{k}" for k in e) for e in EDITS])
@pytest.mark.parametrize("chain", CHAINS, ids=[",".join(f"{k}={v}" for k, v in c.items()) or "defaults" for c in CHAINS])
@pytest.mark.parametrize("mask", [None, 1.0, 0.5, 0.02, 0.0])
@pytest.mark.parametrize("n", [1, 7, 33, 300, 4099])
def test_edited_chain_matches_the_reference(edits, chain, mask, n):
    """Mask, bias and penalties: the C chain (greedy and sampled) gives the oracle's token, or both -1."""
    rng = np.random.default_rng(n * 7 + len(str(edits)) + len(str(chain)) + int((mask or 0) * 100))
    for kind in ("normal", "peaked", "ties", "neginf", "nan", "posinf", "allneginf"):
        x = row(kind, n, rng)
        allowed = None if mask is None else random_mask(n, mask, rng)
        s = with_history(Sampler(seed=1, **chain, **edits), n, rng)
        before = x.copy()
        if allowed is None:  # through Sampler.sample_logits and its seeded draw
            u0 = np.random.default_rng(1).random() if s.temperature > 0 else 0.0
            s.rng = np.random.default_rng(1)
            assert s.sample_logits(x) == s._sample_reference(x, u0), kind
        for u in (0.0, rng.random(), rng.random()):
            c = native.Chain(n).sample(
                x, s.history if s.penalizing else (), s.repeat_penalty, min(s.top_k, n), s.top_p, s.min_p,
                s.temperature, u, frequency_penalty=s.frequency_penalty, presence_penalty=s.presence_penalty,
                allowed=allowed, bias_ids=s._bias_ids if s.logit_bias else None,
                bias_values=s._bias_values if s.logit_bias else None)
            ref = s._sample_reference(x, u, allowed)
            assert c == ref, (kind, u)
            if c >= 0 and allowed is not None:
                assert allowed[c >> 5] >> (c & 31) & 1, "a banned token"
            if c >= 0 and s.logit_bias.get(c) == float("-inf"):
                raise AssertionError("a token banned by the bias")
        np.testing.assert_array_equal(x, before)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from([-np.inf, -3.0, -0.5, -0.0, 0.0, 0.5, 1.0, 1.0 + 2**-20, 7.0]), min_size=1, max_size=100),
       st.lists(st.integers(-2, 110), max_size=80), st.lists(st.booleans(), min_size=100, max_size=100),
       st.dictionaries(st.integers(0, 120), st.sampled_from([-np.inf, -1.0, 0.5, 2.0]), max_size=6),
       st.sampled_from([1.0, 0.9, 1.3]), st.sampled_from([0.0, 0.5, -0.25]), st.sampled_from([0.0, 1.0, 0.3]),
       st.sampled_from([0, 3, 100]), st.sampled_from([0.0, 0.7]), st.booleans(), st.floats(0.0, 1.0, exclude_max=True))
def test_edited_chain_matches_the_reference_on_ties(values, hist, allowed, bias, rp, fp, pp, top_k, temperature,
                                                    use_mask, u):
    x = np.array(values, dtype=np.float32)
    n = len(x)
    mask = bitmask(np.array(allowed[:n]), n) if use_mask else None
    s = Sampler(temperature=temperature, top_k=top_k, repeat_penalty=rp, frequency_penalty=fp, presence_penalty=pp,
                logit_bias=bias, repeat_last_n=-1)
    for t in hist:
        s.accept(t)
    got = native.Chain(n).sample(x, s.history if s.penalizing else (), rp, min(top_k, n), s.top_p, s.min_p,
                                 temperature, u, frequency_penalty=fp, presence_penalty=pp, allowed=mask,
                                 bias_ids=s._bias_ids if bias else None, bias_values=s._bias_values if bias else None)
    assert got == s._sample_reference(x, u, mask)


def test_penalties_are_llama_cpps():
    """llama_sampler_penalties on a hand-computed row: count c over the window, then
    l = l > 0 ? l / repeat : l * repeat; l -= c * frequency + presence (float32)."""
    x = np.float32([2.0, -1.0, 0.5, 3.0, 1.0])
    s = Sampler(temperature=0.0, repeat_penalty=2.0, frequency_penalty=0.25, presence_penalty=1.0)
    for t in (3, 3, 3, 1, 7):  # 7 is outside the row
        s.accept(t)
    want = x.copy()
    want[3] = np.float32(3.0 / 2.0) - np.float32(3 * 0.25 + 1.0)   # -0.25
    want[1] = np.float32(-1.0 * 2.0) - np.float32(1 * 0.25 + 1.0)  # -3.25
    assert s.sample_logits(x) == int(np.argmax(want)) == 0
    s2 = Sampler(temperature=0.0, frequency_penalty=0.5)
    for t in (0, 0, 0, 0, 0):  # token 0: 2.0 - 2.5 = -0.5
        s2.accept(t)
    assert s2.sample_logits(x) == 3
    s2.accept(3)
    s2.accept(3)  # 3 - 1.0 = 2.0: still above token 4 (1.0)
    assert s2.sample_logits(x) == 3
    s2.accept(3)
    s2.accept(3)  # 3 - 2.0 = 1.0 ties token 4 (1.0): the lower id
    assert s2.sample_logits(x) == 3
    s2.accept(3)  # 0.5 < 1.0
    assert s2.sample_logits(x) == 4


def test_repeat_last_n_is_the_window():
    assert Sampler().history.maxlen == PENALTY_LAST_N == 64
    assert Sampler(repeat_last_n=3).history.maxlen == 3
    assert Sampler(repeat_last_n=-1).history.maxlen is None
    s = Sampler(temperature=0.0, repeat_last_n=2, presence_penalty=10.0)
    x = np.float32([3.0, 2.0, 1.0, 0.0])
    for t in (0, 1, 2):
        s.accept(t)
    assert list(s.history) == [1, 2] and s.sample_logits(x) == 0  # 0 fell out of the window
    s0 = Sampler(temperature=0.0, repeat_last_n=0, presence_penalty=10.0)
    s0.accept(0)
    assert not s0.penalizing and list(s0.history) == [] and s0.sample_logits(x) == 0


def test_no_allowed_token_gives_minus_one():
    n = 100
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    chain = native.Chain(n)
    none = np.zeros(4, dtype=np.uint32)
    for temp in (0.0, 0.8):
        for k in (0, 40):
            assert chain.sample(x, (), 1.0, k, 0.95, 0.05, temp, 0.5, allowed=none) == -1
            one = bitmask(np.arange(n) == 17, n)
            assert chain.sample(x, (), 1.0, k, 0.95, 0.05, temp, 0.5, allowed=one) == 17
            # the only allowed token banned by the bias
            ban = dict(bias_ids=np.int32([17]), bias_values=np.float32([-np.inf]))
            assert chain.sample(x, (), 1.0, k, 0.95, 0.05, temp, 0.5, allowed=one, **ban) == -1
            # allowed tokens whose logits are -inf: nothing to draw
            y = x.copy()
            y[17] = -np.inf
            assert chain.sample(y, (), 1.0, k, 0.95, 0.05, temp, 0.5, allowed=one) == -1
    s = Sampler(logit_bias={t: float("-inf") for t in range(n)})
    assert s.sample_logits(x) == -1 and Sampler(temperature=0, logit_bias=s.logit_bias).sample_logits(x) == -1
    # unconstrained (no mask, no bias): the old first-token rule
    assert Sampler(temperature=0.0, presence_penalty=1.0).sample_logits(np.full(5, -np.inf, np.float32)) == 0


@pytest.mark.parametrize("n", [49152, 262144, 262144 + 77])
def test_wide_masked_rows(n):
    """Gemma-wide rows through a 1% and a 50% mask with a bias and penalties: greedy and sampled."""
    rng = np.random.default_rng(n)
    x = row("peaked", n, rng)
    for frac in (0.01, 0.5, 1.0):
        mask = random_mask(n, frac, rng)
        top = np.argsort(-x)[:20].tolist()
        for kw in (dict(temperature=0.0), dict(), dict(top_k=0), dict(top_k=0, min_p=0.0, top_p=1.0)):
            s = Sampler(seed=3, presence_penalty=0.5, frequency_penalty=0.1, repeat_penalty=1.1,
                        logit_bias={t: float(b) for t, b in zip(top[::2], rng.uniform(-20, 5, 10))} | {top[1]: -np.inf},
                        **kw)
            s.history.extend(top[:12] + top[:3])
            ref = Sampler(seed=3, **kw)
            for _ in range(2):
                u = ref.rng.random() if s.temperature > 0 else 0.0
                c = native.Chain(n).sample(x, s.history, 1.1, min(s.top_k, n), s.top_p, s.min_p, s.temperature, u,
                                           frequency_penalty=0.1, presence_penalty=0.5, allowed=mask,
                                           bias_ids=s._bias_ids, bias_values=s._bias_values)
                assert c == s._sample_reference(x, u, mask) and c != top[1], (frac, kw)


def test_chain_checks_its_edits():
    chain = native.Chain(100)
    x = np.zeros(100, dtype=np.float32)
    with pytest.raises(ValueError, match="mask"):
        chain.sample(x, (), 1.0, 0, 1.0, 0.0, 0.0, 0.0, allowed=np.zeros(3, dtype=np.uint32))  # 4 words needed
    with pytest.raises(ValueError, match="bias"):
        chain.sample(x, (), 1.0, 0, 1.0, 0.0, 0.0, 0.0, bias_ids=np.int32([1, 2]), bias_values=np.float32([1.0]))
    with pytest.raises(ValueError, match="bias"):
        chain.sample(x, (), 1.0, 0, 1.0, 0.0, 0.0, 0.0, bias_ids=np.int32([1]))


@pytest.mark.parametrize("bad, err", [
    (dict(logit_bias={-1: 1.0}), ValueError), (dict(logit_bias={2**31: 1.0}), ValueError),
    (dict(logit_bias={1: float("inf")}), ValueError), (dict(logit_bias={1: float("nan")}), ValueError),
    (dict(logit_bias={1: 1e39}), ValueError), (dict(logit_bias={1.0: 1.0}), TypeError),
    (dict(logit_bias={True: 1.0}), TypeError), (dict(logit_bias={1: "x"}), TypeError),
    (dict(logit_bias=[(1, 1.0)]), TypeError), (dict(presence_penalty=float("nan")), ValueError),
    (dict(frequency_penalty=1e39), ValueError), (dict(frequency_penalty="1"), TypeError),
    (dict(repeat_last_n=-2), ValueError), (dict(repeat_last_n=2.0), TypeError),
    (dict(grammar=object()), TypeError),
])
def test_settings_are_checked(bad, err):
    with pytest.raises(err):
        Sampler(**bad)


def test_logit_bias_values():
    s = Sampler(logit_bias={np.int64(3): np.float32(-np.inf), 5: 2})
    assert s.logit_bias == {3: float("-inf"), 5: 2.0}
    x = np.zeros(10, dtype=np.float32)
    assert Sampler(temperature=0.0, logit_bias={7: 0.5}).sample_logits(x) == 7
    assert Sampler(temperature=0.0, logit_bias={0: -0.5}).sample_logits(x) == 1
    assert Sampler(temperature=0.0, logit_bias={50: 9.0}).sample_logits(x) == 0  # beyond the row: ignored
    with pytest.raises(ValueError):
        Sampler().accept(2**31)


# ---- the grammar protocol ----------------------------------------------------------------------------

class TableGrammar:
    """A test fixture of the Grammar protocol: step i allows the tokens of table[i] (then nothing)."""

    def __init__(self, table):
        self.table = [frozenset(t) for t in table]

    def matcher(self, model):
        return TableMatcher(self.table, model.n_vocab)


class TableMatcher:
    def __init__(self, table, n_vocab):
        self.table, self.n_vocab, self.step = table, n_vocab, 0

    def allowed(self):
        return self.table[self.step] if self.step < len(self.table) else frozenset()

    def fill_mask(self, buf):
        bits = np.zeros(self.n_vocab, dtype=bool)
        bits[list(self.allowed())] = True
        buf[:] = bitmask(bits, self.n_vocab)

    def accept(self, token):
        if token not in self.allowed():
            return False
        self.step += 1
        return True


TABLE = [{5, 900, 12000}, {49151}, {7}, {1, 2, 3, 4}, set(range(100, 40000))]


@pytest.mark.parametrize("kw", [dict(temperature=0.0), dict(seed=1), dict(seed=2, top_k=0, min_p=0.0)])
def test_grammar_steers_the_sampler(model, kw):
    """sample(ctx) binds the grammar to ctx.model, samples only allowed tokens and advances the matcher;
    a finished grammar (nothing allowed) gives -1 and accepts nothing."""
    ctx = Context(model, n_ctx=256)
    toks = model.tokenize("The capital of France is")
    ctx.decode(llamax.Batch(toks))
    s = Sampler(grammar=TableGrammar(TABLE), **kw)
    for t in toks:
        s.accept(t, accept_grammar=False)  # the prompt: history only
    assert s._matcher is None
    for step, allowed in enumerate(TABLE):
        logits = ctx.get_logits_ith(-1)
        ref = s._sample_reference(logits, 0.0) if s.temperature <= 0 and s._matcher is not None else None
        tok = s.sample(ctx)
        assert (ref is None) == (step == 0 or s.temperature > 0)
        assert tok in allowed and s._matcher.step == step + 1 and s.history[-1] == tok
        assert ref is None or ref == tok
        ctx.decode(llamax.Batch([tok], pos=[len(toks) + step]))
    n_hist = len(s.history)
    assert s.sample(ctx) == -1 and len(s.history) == n_hist


def test_grammar_must_be_bound_and_refusals_raise(model):
    g = TableGrammar(TABLE)
    s = Sampler(grammar=g)
    x = np.zeros(model.n_vocab, dtype=np.float32)
    with pytest.raises(LlamaxError, match="bind"):
        s.sample_logits(x)
    with pytest.raises(LlamaxError, match="bind"):
        s.accept(5)
    s.accept(5, accept_grammar=False)  # history only: no matcher needed
    s.bind(model)
    assert s.sample_logits(x) in TABLE[0]
    with pytest.raises(LlamaxError, match="not allowed"):
        s.accept(6)
    assert list(s.history) == [5] and s._matcher.step == 0  # unchanged
    s.accept(900)
    assert s._matcher.step == 1 and Sampler(temperature=0.0, grammar=g)._matcher is None
    s.bind(model)  # a fresh matcher: the grammar starts over
    assert s._matcher.step == 0
    with pytest.raises(ValueError, match="mask"):
        s.sample_logits(np.zeros(model.n_vocab + 40, dtype=np.float32))  # wider than the bound vocabulary
    Sampler().bind(model)  # no grammar: nothing to bind


def test_pickle_drops_the_matcher(model):
    s = Sampler(seed=4, grammar=TableGrammar(TABLE), logit_bias={5: -np.inf}, presence_penalty=0.5)
    s.bind(model)
    s.accept(900)
    t = pickle.loads(pickle.dumps(s))
    assert t._matcher is None and t._mask is None and t.logit_bias == {5: float("-inf")}
    assert list(t.history) == [900] and t.presence_penalty == 0.5
    with pytest.raises(LlamaxError, match="bind"):
        t.sample_logits(np.zeros(model.n_vocab, dtype=np.float32))
    t.bind(model)
    x = np.random.default_rng(0).standard_normal(model.n_vocab).astype(np.float32)
    assert t.sample_logits(x) in TABLE[0] - {5}


def test_ban_adds_minus_inf_biases_to_the_chain():
    """Sampler.ban (ignore_eos's path): the banned ids are never chosen, the other biases stay."""
    row = np.zeros(64, np.float32)
    row[[3, 7]] = 10.0
    s = Sampler(temperature=0.0, top_k=1, top_p=1.0, min_p=0.0, logit_bias={5: 1.0})
    assert s.sample_logits(row) == 3
    s.ban([3])
    assert s.sample_logits(row) == 7 and s.logit_bias == {5: 1.0, 3: float("-inf")}
    s.ban([7])
    assert s.sample_logits(row) == 5  # the biased one, now the largest
