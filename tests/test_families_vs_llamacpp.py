"""The synthetic models of every transformer family (tests/synthetic_families.py) against llama.cpp's own
outputs on them (tests/data/families/, made by its record.py with llama-cpp-python 0.3.36).

Tolerances come from llama.cpp's spread against itself on the same model (one batch vs one token at a time,
chunks of 7, one thread; recorded in the json): logits within twice its largest difference, top-1 equal
where llama.cpp's top-1 / top-2 gap is clear of that tolerance, greedy tokens identical up to llama.cpp's
first near-tie."""
import json
from pathlib import Path

import numpy as np
import pytest

from llamax import Batch, Context, Model
from synthetic import content_hash
from synthetic_families import FAMILIES

DATA = Path(__file__).parent / "data" / "families"


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def case(request, family_paths):
    name = request.param
    meta = json.loads((DATA / f"{name}.json").read_text())
    path = family_paths[name]
    assert content_hash(path) == meta["model"]["content_hash"], "the writer no longer gives the recorded model"
    spread = max(v["all_rows_max_abs_diff"] for p in meta["prompts"].values() for v in p["spread"].values())
    tol = max(2 * spread, 1e-3)
    return name, Model.load(path, n_threads=2), meta, np.load(DATA / f"{name}.npz"), tol


def test_the_family_loads_as_its_architecture(case):
    name, model, meta, _, _ = case
    assert model.arch == FAMILIES[name][0] == meta["model"]["arch"]


def test_prompt_logits_within_llama_cpp_spread(case):
    name, model, meta, ref, tol = case
    n_clear = n_rows = 0
    for p in meta["prompts"]:
        toks = ref[f"{p}__tokens"].tolist()
        assert model.tokenize(meta["prompts"][p]["text"]) == toks, (name, p)
        ctx = Context(model, n_ctx=512, n_threads=2)
        ctx.decode(Batch(toks, logits=[True] * len(toks)))
        out = ctx.get_logits()
        last = ref[f"{p}__last_logits"]
        assert np.abs(out[-1] - last).max() <= tol, (name, p, float(np.abs(out[-1] - last).max()), tol)
        ids, vals = ref[f"{p}__top5_ids"], ref[f"{p}__top5_vals"]
        ours = np.take_along_axis(out, ids.astype(np.int64), axis=1)
        assert np.abs(ours - vals).max() <= tol, (name, p, float(np.abs(ours - vals).max()), tol)
        clear = vals[:, 0] - vals[:, 1] > 2 * tol
        assert np.array_equal(out[clear].argmax(axis=1), ids[clear, 0]), (name, p)
        n_clear, n_rows = n_clear + int(clear.sum()), n_rows + len(toks)
    assert n_clear > 0.6 * n_rows          # most rows are checked for their top-1


def test_greedy_continuation_identical_up_to_the_first_near_tie(case):
    """Free-running greedy tokens equal llama.cpp's up to its first step whose top-1 / top-2 gap is within
    twice the tolerance (a near-tie)."""
    name, model, meta, ref, tol = case
    for p, info in meta["prompts"].items():
        want = ref[f"{p}__greedy_tokens"].tolist()
        n_sure = next((i for i, g in enumerate(info["greedy_gaps"]) if g <= 2 * tol), len(want))
        ctx = Context(model, n_ctx=512, n_threads=2)
        ctx.decode(Batch(ref[f"{p}__tokens"].tolist()))
        got = []
        for _ in range(n_sure):
            got.append(int(ctx.get_logits()[-1].argmax()))
            ctx.decode(Batch([got[-1]]))
        assert got == want[:n_sure], (name, p)
