"""The sampler chain in C (csrc/sampling.h) against its numpy oracle (Sampler._sample_reference),
greedy against np.argmax, and the old numpy sampler's seeded outputs."""
import pickle
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llamax._native import sampling as native
from llamax.sampling import Sampler

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


@pytest.mark.parametrize("n", [49152, 262144, 262144 + 77])
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
            for _ in range(20):
                out.append(s.sample_logits(x))
        except Exception as e:  # pragma: no cover - a failure is reported below
            errors.append(e)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(out) == 80
    ref, rng = Sampler(top_k=0, min_p=0.0), np.random.default_rng(9)
    assert sorted(out) == sorted(ref._sample_reference(x, rng.random()) for _ in range(80))
