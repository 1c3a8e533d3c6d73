"""Engine.export_prefix / import_prefix: a cached conversation handed to another engine of the same
model and configuration continues without computing its prompt again, with the same tokens; a blob of
another model or configuration, or a corrupt one, is refused and changes nothing."""
import dataclasses

import pytest

from llamax import Engine, LlamaxError, StateError
from llamax.serving import PrefixState

SYSTEM = ("You are a careful assistant for a small library. You answer questions about books, opening hours, "
          "membership cards, late fees and the reading room. Keep every answer short, friendly and exact.")


def turn(engine, prompt, n=12):
    return engine.generate(prompt, max_tokens=n, temperature=0)


def conversation(model):
    return model.tokenize(SYSTEM + " Question: when do you open on Sundays?", add_special=True)


@pytest.mark.parametrize("which", ["model", "gemma"])
def test_a_conversation_moved_to_another_engine_continues_from_its_cache(which, request):
    model = request.getfixturevalue(which)
    a = Engine(model, n_ctx=2048, n_parallel=2)
    b = Engine(model, n_ctx=2048, n_parallel=2)
    first = conversation(model)
    r1 = turn(a, first)
    second = first + r1.tokens + model.tokenize(" And on Mondays?", add_special=False)

    cells_a = a.memory.cells()
    prefix = a.export_prefix(second)
    assert isinstance(prefix, PrefixState)
    assert prefix.tokens == second[:len(prefix.tokens)] and len(prefix.tokens) >= len(first)
    assert a.memory.cells() == cells_a and a.metrics()["prefix_lookups"] == 1  # export counts no lookup

    assert b.import_prefix(prefix) == len(prefix.tokens)
    assert b.import_prefix(prefix) == 0  # held already
    assert b.metrics()["cells_cached"] == len(prefix.tokens) or which == "gemma"
    moved = turn(b, second)
    stayed = turn(a, second)
    assert moved.tokens == stayed.tokens
    assert moved.n_cached == stayed.n_cached == min(len(prefix.tokens), len(second) - 1)


def test_refused_blobs_change_nothing(model, gemma):
    a = Engine(model, n_ctx=1024, n_parallel=2)
    first = conversation(model)
    turn(a, first)
    good = a.export_prefix(first)
    assert good is not None

    b = Engine(model, n_ctx=1024, n_parallel=2)
    turn(b, model.tokenize("Something else entirely.", add_special=True))
    before = b.memory.cells(), b.reuse.n_prompts

    g = Engine(gemma, n_ctx=1024, n_parallel=2)
    gf = gemma.tokenize(SYSTEM, add_special=True)
    turn(g, gf)
    other_model = g.export_prefix(gf)
    q8 = Engine(model, n_ctx=1024, n_parallel=2, type_k="q8_0", type_v="q8_0")
    turn(q8, first)
    other_config = q8.export_prefix(first)
    flipped = bytearray(good.data)
    flipped[len(flipped) // 2] ^= 0x40
    bad = {
        "another model": dataclasses.replace(other_model, tokens=good.tokens),
        "another configuration": other_config,
        "a corrupt blob": PrefixState(good.tokens, bytes(flipped)),
        "a truncated blob": PrefixState(good.tokens, good.data[:-8]),
        "tokens of another length": PrefixState(good.tokens[:-3], good.data),
    }
    for what, p in bad.items():
        with pytest.raises(StateError):
            b.import_prefix(p)
        assert (b.memory.cells(), b.reuse.n_prompts) == before, what
    with pytest.raises(TypeError):
        b.import_prefix((good.tokens, good.data))
    assert b.import_prefix(good) == len(good.tokens)  # b still works


def test_export_of_what_the_cache_lacks_and_without_a_tree(model):
    a = Engine(model, n_ctx=1024, n_parallel=2)
    assert a.export_prefix(model.tokenize("Nothing cached yet", add_special=True)) is None
    first = conversation(model)
    turn(a, first)
    assert a.export_prefix(first, min_tokens=len(first) + 100) is None
    slots = Engine(model, n_ctx=1024, n_parallel=2, kv_unified=False)
    with pytest.raises(LlamaxError, match="prefix cache"):
        slots.export_prefix(first)
    with pytest.raises(LlamaxError, match="prefix cache"):
        slots.import_prefix(a.export_prefix(first))
