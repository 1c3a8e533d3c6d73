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

from llamax import Model
from helpers import check_greedy_up_to_near_tie, check_prompt_logits, spread_tolerance
from synthetic import content_hash
from synthetic_families import FAMILIES

DATA = Path(__file__).parent / "data" / "families"


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def case(request, family_paths):
    name = request.param
    meta = json.loads((DATA / f"{name}.json").read_text())
    path = family_paths[name]
    assert content_hash(path) == meta["model"]["content_hash"], "the writer no longer gives the recorded model"
    return name, Model.load(path, n_threads=2), meta, np.load(DATA / f"{name}.npz"), spread_tolerance(meta)


def test_the_family_loads_as_its_architecture(case):
    name, model, meta, _, _ = case
    assert model.arch == FAMILIES[name][0] == meta["model"]["arch"]


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
