"""llamax.sequence: the one decode step of a sequence that `llamax run` (llamax.generate) and
`llamax serve` (llamax.Engine) share, its linear stop matching, the n_keep rule and the shift's
discard; and the import structure of the serving layer (no module imports one that imports it back).

The Engine and generate are held to the same output for the same prompt and sampler settings:
greedy, seeded, with the repeat penalty (both put the prompt in its window), with stop strings,
and across a context shift with n_keep (the Engine without a prefix cache, so both caches hold
the same cells in the same order and the shifted logits are the same bits)."""
import ast
import pathlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from reference.stop_matcher_ref import RefStopMatcher

from llamax import Context, Engine, KVCacheISWA, RoPE, Sampler, generate
from llamax.sequence import (N_KEEP_MARGIN, SeqDecoder, StopMatcher, context_shift, keep_length, needs_room,
                             prompt_tokens, shift_discard)

ROOT = pathlib.Path(__file__).resolve().parents[1] / "llamax"
LONG = " ".join(f"item {k} is red," for k in range(36))  # ~240 tokens: a 256-cell context shifts soon


# ---- the stop matcher -----------------------------------------------------------------------------------

@settings(max_examples=400, deadline=None)
@given(pieces=st.lists(st.text(alphabet="ab.", max_size=6), max_size=40),
       stops=st.lists(st.text(alphabet="ab.", max_size=5), max_size=3))
def test_stop_matcher_streams_as_the_reference(pieces, stops):
    """Piece by piece: the same text handed out, the same hit, the same held-back tail and text."""
    m, ref = StopMatcher(stops), RefStopMatcher(stops)
    out = []
    for p in pieces:
        got = m.push(p)
        assert got == ref.push(p), (p, m.text, ref.text)
        assert m.text == ref.text and m.held == ref.text[ref.sent:]
        out.append(got[0])
        if got[1]:
            break
    out.append(m.flush())
    assert out[-1] == ref.flush()
    assert "".join(out) == m.text == ref.text


def test_a_stop_string_split_across_pieces_is_held_back_then_cut():
    m = StopMatcher(["four", "END"])
    assert m.push("one two fo") == ("one two ", False) and m.held == "fo"
    assert m.push("u") == ("", False) and m.held == "fou"
    assert m.push("r five") == ("", True)
    assert m.text == "one two " and m.push("more") == ("", True)
    m = StopMatcher(["four"])
    assert m.push("fo") == ("", False)
    assert m.push("x") == ("fox", False) and m.held == ""
    m = StopMatcher(["ab", "b"])       # the stop that completes first ends the text, where it begins
    assert m.push("a") == ("", False) and m.push("b") == ("", True) and m.text == ""
    m = StopMatcher([])
    assert m.push("anything") == ("anything", False) and m.flush() == ""


def test_a_100k_character_generation_looks_at_a_bounded_window():
    """Text full of partial matches (every piece may begin a stop string): each push looks at no
    more than 2 * (longest stop - 1) characters besides its piece, so the matching is linear."""
    stops = ["<|end|>", "aaaab"]
    span = max(map(len, stops)) - 1
    m = StopMatcher(stops)
    pieces = ["aaaa", "<|en", "d", "x"] * 10_000  # 100 000 characters
    n_out = 0
    for p in pieces:
        out, hit = m.push(p)
        assert not hit and m.window <= 2 * span and len(m.held) <= span
        n_out += len(out)
    assert n_out + len(m.held) == sum(map(len, pieces)) == 100_000
    assert len(m.text) == 100_000


# ---- keep, room, discard ----------------------------------------------------------------------------------

def test_keep_length_is_n_keep_plus_bos_within_the_sequence_and_the_margin():
    assert keep_length(-1, 20, 1, 256) == 20          # everything the prompt left
    assert keep_length(7, 20, 0, 256) == 7
    assert keep_length(2, 20, 1, 256) == 3            # the BOS is kept too
    assert keep_length(500, 20, 1, 256) == 20         # at most what the sequence holds
    assert keep_length(-1, 254, 0, 256) == 256 - N_KEEP_MARGIN
    assert not needs_room(254, 256) and needs_room(255, 256)   # llama.cpp: n_past + 1 >= n_ctx


def test_shift_discard_is_what_context_shift_discards():
    """Half of what follows keep_end, clamped to an iSWA cache's exact_shift_limit; shift_discard
    changes nothing, context_shift then discards exactly that."""
    from test_iswa_shift import fill, iswa
    for n_swa in (64, 200):
        mem = iswa(False, n_swa, 1)
        fill(mem, 350)
        cells = mem.cells()
        n, n_left = shift_discard(mem, 0, 8)
        limit = mem.exact_shift_limit(0, 8)
        assert n_left == 342 and n == (min(171, limit) if limit is not None and limit >= 1 else 171)
        assert mem.cells() == cells
        assert context_shift(mem, 0, 8) == (n, n_left)
    mem = KVCacheISWA(2, 1, 8, 256, swa_layers=[1], n_swa=4, n_ubatch=8, rope=RoPE(8))
    assert shift_discard(mem, 0, 0) == (0, 0)     # an empty sequence: nothing to discard


def test_decoder_step_order_and_prompt_tokens(model):
    """eog before stop strings before max_tokens; the prompt's tail goes into the penalty window."""
    smp = Sampler.greedy()
    dec = SeqDecoder(model, smp, max_tokens=1, stop=["zz"])
    dec.accept_prompt(list(range(100)))
    assert list(smp.history) == list(range(36, 100))  # the last 64 (PENALTY_LAST_N)
    row = [0.0] * model.n_vocab
    row[model.eos] = 1.0
    out = dec.step(__import__("numpy").array(row, dtype="float32"))
    assert out.stop == "eog" and dec.generated == [] and not dec.exhausted
    dec = SeqDecoder(model, Sampler.greedy(), max_tokens=1, ignore_eos=True)
    out = dec.step(__import__("numpy").array(row, dtype="float32"))
    assert out.token != model.eos and out.stop == "length" and dec.exhausted
    assert SeqDecoder(model, Sampler(), max_tokens=0).exhausted
    assert prompt_tokens(model, "Hello") == model.tokenize("Hello", add_special=True, parse_special=True)


# ---- run and serve take the same step ---------------------------------------------------------------------

CASES = {
    "greedy": dict(temperature=0.0),
    "seeded": dict(seed=11),
    "penalty": dict(seed=3, repeat_penalty=1.3),
    "stop": dict(temperature=0.0, stop=[" the", "."]),
    "seeded-stop": dict(seed=5, stop=["ing", ","]),
}


def _both(model, prompt, max_tokens, kw, n_keep=0):
    """(generate's text, tokens, stop, shifts) and the Engine's, for the same prompt and settings."""
    smp_kw = {k: v for k, v in kw.items() if k != "stop"}
    ctx = Context(model, n_ctx=256)
    g = generate(ctx, prompt, max_tokens=max_tokens, sampler=Sampler(**smp_kw), n_keep=n_keep,
                 stop=kw.get("stop", ()))
    text = "".join(g)
    eng = Engine(model, n_ctx=256, n_parallel=1, prefix_cache=False)
    req = eng.submit(prompt, max_tokens=max_tokens, n_keep=n_keep, **kw)
    pieces = list(req)
    res = req.result()
    assert "".join(pieces) == res.text
    return (text, g.generated, g.stats.stop, g.stats.n_shift), (res.text, res.tokens, res.stop, res.n_shift)


@pytest.mark.parametrize("case", list(CASES))
def test_generate_and_the_engine_give_the_same_output(model, case):
    kw = CASES[case]
    for prompt in ("Once upon a time, in a quiet village,", "The best way to learn a new language is"):
        ours, served = _both(model, prompt, 40, kw)
        assert ours == served, (prompt, ours, served)
        if "stop" in kw:
            assert all(s not in ours[0] for s in kw["stop"])


@pytest.mark.parametrize("case", ["greedy", "seeded"])
def test_generate_and_the_engine_shift_the_same_way(model, case):
    """A prompt near the 256-cell context, n_keep 4: both shift at the same token, keep the same
    positions, discard the same half, and go on to the same tokens."""
    ours, served = _both(model, LONG, 40, CASES[case], n_keep=4)
    assert ours == served
    assert ours[3] >= 1 or ours[2] == "eog"


# ---- the import structure ---------------------------------------------------------------------------------

def _module_graph():
    """{module: llamax modules it imports anywhere (top level, TYPE_CHECKING, inside functions)},
    package __init__ files left out as targets (they only re-export)."""
    mods = {}
    for p in ROOT.rglob("*.py"):
        name = ".".join(p.relative_to(ROOT.parent).with_suffix("").parts)
        mods[name.removesuffix(".__init__")] = p
    graph = {}
    for name, p in mods.items():
        pkg = name if p.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = pkg.split(".")[:len(pkg.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                found |= {base} | {f"{base}.{a.name}" for a in node.names}
        graph[name] = {m for m in found if m in mods and m != name and mods[m].name != "__init__.py"}
    return graph


def test_no_module_imports_one_that_imports_it_back():
    graph = _module_graph()
    assert "llamax.serving.engine" not in graph["llamax.serving.request"]
    assert graph["llamax.serving.request"] <= {"llamax.errors", "llamax.sampling", "llamax.sequence", "llamax.speculative",
                                               "llamax.tools"}
    assert "llamax.serving.engine" not in graph["llamax.cluster.front"]
    # no cycle anywhere: every module reaches only modules that do not reach it
    reach: dict[str, set[str]] = {}

    def reachable(m, path):
        if m in reach:
            return reach[m]
        assert m not in path, f"import cycle: {' -> '.join(path[path.index(m):] + [m])}"
        out = set()
        for w in graph[m]:
            out |= {w} | reachable(w, path + [m])
        reach[m] = out
        return out

    for m in graph:
        reachable(m, [])
