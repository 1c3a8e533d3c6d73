"""Logprobs of raw logits rows in C (csrc/sampling.h lx_logprobs / lx_logprobs_rows) against a numpy
log_softmax, and llamax's logprobs on the two registry models against llama.cpp's
(tests/data/logprobs: recorded by record.py there, flash attention off and on)."""
import json
from pathlib import Path

import numpy as np
import pytest

import llamax
from llamax.context import Context
from llamax.sampling import LOGPROBS_MAX_K, rows_logprobs, token_logprobs

# the kernels against their reference at every SIMD level of this CPU (the models at the default one)
every_simd_level = pytest.mark.usefixtures("every_simd_level")

DATA = Path(__file__).resolve().parent / "data" / "logprobs"
RTOL = 1e-6  # float32 results of a float64 computation


def reference(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """numpy log_softmax in float64 (NaN as -inf) and the top k (descending, ties by lower id)."""
    y = np.where(np.isnan(x), -np.inf, x).astype(np.float64)
    mx = y.max()
    with np.errstate(invalid="ignore", over="ignore"):
        lsm = y - (mx + np.log(np.exp(y - mx).sum())) if np.isfinite(mx) else np.full_like(y, np.nan)
    ids = np.lexsort((np.arange(len(x)), -y))[:k]
    return lsm, ids, lsm[ids]


def rows(kind: str, m: int, n: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "normal":
        return (rng.standard_normal((m, n)) * 4).astype(np.float32)
    if kind == "ties":
        return rng.choice(np.float32([-2.0, -0.0, 0.0, 1.5, 3.0]), (m, n))
    if kind == "neginf":
        x = rng.standard_normal((m, n)).astype(np.float32)
        x[rng.random((m, n)) < 0.6] = -np.inf
        x[:, 0] = 0.0
        return x
    if kind == "nan":
        x = rng.standard_normal((m, n)).astype(np.float32)
        x[rng.random((m, n)) < 0.2] = np.nan
        x[:, 0] = 0.0
        return x
    if kind == "wide":
        return (rng.standard_normal((m, n)) * 500).astype(np.float32)
    raise AssertionError(kind)


@every_simd_level
@pytest.mark.parametrize("kind", ["normal", "ties", "neginf", "nan", "wide"])
@pytest.mark.parametrize("n", [1, 5, 20, 21, 64, 1000, 49152])
def test_logprobs_match_the_reference(kind, n):
    rng = np.random.default_rng(n + len(kind))
    xs = rows(kind, 4, n, rng)
    toks = rng.integers(0, n, 4)
    for k in sorted({0, 1, 5, LOGPROBS_MAX_K, n} & set(range(min(n, LOGPROBS_MAX_K) + 1))):
        lp, ids, lps = rows_logprobs(xs, toks, k)
        assert lp.dtype == lps.dtype == np.float32 and ids.dtype == np.int32 and lps.shape == (4, k)
        for i, x in enumerate(xs):
            lsm, rids, rlps = reference(x, k)
            np.testing.assert_allclose(lp[i], lsm[toks[i]], rtol=RTOL, atol=1e-6)
            np.testing.assert_array_equal(ids[i], rids)
            np.testing.assert_allclose(lps[i], rlps, rtol=RTOL, atol=1e-6)
            one, top = token_logprobs(x, int(toks[i]), k)
            assert one == lp[i] and top == list(zip(ids[i].tolist(), lps[i].tolist()))


@every_simd_level
def test_known_values():
    x = np.float32([0.0, np.log(3.0), -np.inf, np.nan, 0.0])  # probabilities 1/5, 3/5, 0, 0, 1/5
    lp, top = token_logprobs(x, 0, 5)
    assert lp == pytest.approx(np.log(0.2), rel=1e-6)
    assert [t for t, _ in top] == [1, 0, 4, 2, 3]  # -inf and NaN last, by id
    assert [v for _, v in top][:3] == pytest.approx(np.log([0.6, 0.2, 0.2]).tolist(), rel=1e-6)
    assert top[3][1] == top[4][1] == -np.inf
    assert token_logprobs(x, 3, 0) == (-np.inf, [])
    for bad in (np.full(4, -np.inf, np.float32), np.float32([0.0, np.inf, 1.0])):  # no distribution
        lp, top = token_logprobs(bad, 0, 2)
        assert np.isnan(lp) and all(np.isnan(v) for _, v in top)


@every_simd_level
def test_threads_do_not_change_the_result():
    rng = np.random.default_rng(0)
    xs = (rng.standard_normal((37, 3000)) * 3).astype(np.float32)
    toks = rng.integers(0, 3000, 37)
    one = rows_logprobs(xs, toks, 20, n_threads=1)
    for nt in (2, 5, None):
        for a, b in zip(one, rows_logprobs(xs, toks, 20, n_threads=nt)):
            np.testing.assert_array_equal(a, b)
    lp, ids, lps = rows_logprobs(np.zeros((0, 10), np.float32), np.zeros(0, np.int64), 3)
    assert lp.shape == (0,) and ids.shape == lps.shape == (0, 3)


def test_arguments_are_checked():
    x = np.zeros(30, dtype=np.float32)
    for k in (-1, LOGPROBS_MAX_K + 1):
        with pytest.raises(ValueError, match="k ="):
            token_logprobs(x, 0, k)
        with pytest.raises(ValueError, match="k ="):
            rows_logprobs(x[None], [0], k)
    with pytest.raises(ValueError, match="k ="):
        token_logprobs(x[:3], 0, 4)  # more alternatives than tokens
    with pytest.raises(TypeError):
        token_logprobs(x, 0, 2.0)
    for t in (-1, 30):
        with pytest.raises(ValueError, match="token"):
            token_logprobs(x, t, 1)
        with pytest.raises(ValueError, match="token"):
            rows_logprobs(x[None], [t], 1)
    with pytest.raises(ValueError, match="2-D"):
        rows_logprobs(x, [0], 1)
    with pytest.raises(ValueError):
        rows_logprobs(x[None], [0, 1], 1)  # one token per row
    with pytest.raises(ValueError):
        rows_logprobs(x[None], [0.5], 1)
    with pytest.raises(ValueError, match="1-D"):
        token_logprobs(x[None], 0, 1)


# ---- agreement with llama.cpp ---------------------------------------------------------------------

@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_logprobs_agree_with_llama_cpp(name, request):
    """The same token ids decoded by llamax with logits at every position: each next token's logprob
    within 2x llama.cpp's own flash-attention on/off spread of it (measured by record.py on the same
    sequences), the logprobs of llama.cpp's top 5 within 2x their spread, and the same top-1 wherever
    llama.cpp's top-1/top-2 gap is clear (more than that tolerance)."""
    model = request.getfixturevalue("model" if name == "smollm2-135m" else "gemma")
    meta = json.loads((DATA / f"{name}.json").read_text())
    ref = np.load(DATA / f"{name}.npz")
    tol_chosen, tol_top = 2 * meta["fa_spread"]["chosen"], 2 * meta["fa_spread"]["top5"]
    worst = {}
    for prompt in meta["n_prompt"]:
        toks = ref[f"{prompt}__tokens"]
        ctx = Context(model, n_ctx=meta["n_ctx"])
        ctx.decode(llamax.Batch(toks.tolist(), logits=[True] * len(toks)))
        logits = ctx.get_logits()
        lp, ids, lps = rows_logprobs(logits[:-1], toks[1:], 5)
        for fa in ("fa_off", "fa_on"):
            d = np.abs(lp - ref[f"{prompt}__{fa}__lp"])
            worst[(prompt, fa)] = float(d.max())
            assert d.max() <= tol_chosen, (prompt, fa, d.max(), tol_chosen)
        # llamax's logprobs of llama.cpp's top 5, from llamax's whole rows
        r_ids, r_lps = ref[f"{prompt}__fa_off__top_ids"], ref[f"{prompt}__fa_off__top_lp"]
        mine = np.stack([rows_logprobs(logits, r_ids[:, j], 0)[0] for j in range(5)], axis=1)
        assert np.abs(mine - r_lps).max() <= tol_top, (prompt, np.abs(mine - r_lps).max(), tol_top)
        clear = (r_lps[:-1, 0] - r_lps[:-1, 1]) > tol_chosen
        assert clear.sum() >= len(clear) // 3  # the check is not vacuous
        np.testing.assert_array_equal(ids[clear, 0], r_ids[:-1][clear, 0])
    print(name, "max |dlogprob| vs llama.cpp:", {f"{p}/{fa}": round(v, 4) for (p, fa), v in worst.items()})
