"""The synthetic Mamba and Jamba models against llama.cpp's own outputs on them (tests/data/recurrent/, made
by its record.py with llama-cpp-python 0.3.36).

Tolerances come from llama.cpp's spread against itself on the same model (one batch vs one token at a time,
chunks of 7, one thread; recorded in the json): logits within twice its largest difference, top-1 equal
where llama.cpp's top-1 / top-2 gap is clear of that tolerance, greedy tokens identical up to llama.cpp's
first near-tie."""
import json
from pathlib import Path

import numpy as np
import pytest

from llamax import Batch, Context, Model
from helpers import check_greedy_up_to_near_tie, check_prompt_logits, spread_tolerance
from synthetic import content_hash, write_jamba, write_mamba

DATA = Path(__file__).parent / "data" / "recurrent"
WRITERS = {"mamba": write_mamba, "jamba": write_jamba}


@pytest.fixture(scope="module", params=sorted(WRITERS))
def case(request, tmp_path_factory, smollm2_gguf):
    name = request.param
    meta = json.loads((DATA / f"{name}.json").read_text())
    path = WRITERS[name](tmp_path_factory.mktemp(name) / f"{name}.gguf", smollm2_gguf)
    assert content_hash(path) == meta["model"]["content_hash"], "the writer no longer gives the recorded model"
    assert path.stat().st_size < 5 << 20
    return name, Model.load(path, n_threads=2), meta, np.load(DATA / f"{name}.npz"), spread_tolerance(meta)


def test_tokens_match_llama_cpp(case):
    _, model, meta, ref, _ = case
    for p, info in meta["prompts"].items():
        assert model.tokenize(info["text"]) == ref[f"{p}__tokens"].tolist(), p


def test_prompt_logits_within_llama_cpp_spread(case):
    check_prompt_logits(*case)


def test_greedy_continuation_identical_up_to_the_first_near_tie(case):
    """Free-running greedy tokens equal llama.cpp's up to its first step whose top-1 / top-2 gap is within
    twice the tolerance (a near-tie)."""
    check_greedy_up_to_near_tie(*case)


def test_every_greedy_step_within_tolerance_on_llama_cpp_tokens(case):
    """Fed llama.cpp's greedy tokens, each step's top-5 logits are within the tolerance of llama.cpp's, and
    the top-1 is llama.cpp's wherever its gap exceeds twice the difference actually seen at that step."""
    name, model, meta, ref, tol = case
    for p in meta["prompts"]:
        want = ref[f"{p}__greedy_tokens"].tolist()
        ids, vals = ref[f"{p}__greedy_top5_ids"], ref[f"{p}__greedy_top5_vals"]
        ctx = Context(model, n_ctx=512, n_threads=2)
        ctx.decode(Batch(ref[f"{p}__tokens"].tolist()))
        for i, t in enumerate(want):
            row = ctx.get_logits()[-1]
            err = float(np.abs(row[ids[i]] - vals[i]).max())
            assert err <= tol, (name, p, i, err)
            if vals[i, 0] - vals[i, 1] > 2 * err:
                assert int(row.argmax()) == t, (name, p, i)
            ctx.decode(Batch([t]))
