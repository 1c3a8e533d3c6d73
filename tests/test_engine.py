"""llamax.Engine on real models: continuous batching, the prefix cache, overflow, slots, metrics."""
import asyncio
import threading

import pytest

import llamax
from llamax import BatchError, Engine, EngineFullError, LlamaxError

SYSTEM = ("You are a careful assistant for a small library. You answer questions about books, opening hours, "
          "membership cards, late fees and the reading room. Keep every answer short, friendly and exact. ") * 3


def solo(model, prompt_tokens, max_tokens, n_ctx=1024, **ctx_kw):
    """The greedy tokens of one request run alone in a fresh Context (the reference)."""
    ctx = llamax.Context(model, n_ctx=n_ctx, **ctx_kw)
    g = llamax.generate(ctx, list(prompt_tokens), max_tokens=max_tokens, sampler=llamax.Sampler.greedy())
    for _ in g:
        pass
    return g.generated


def prompts_mixed(model, n):
    """n prompts of mixed lengths; some share the system prompt, some share nothing."""
    out = []
    for i in range(n):
        q = f"Question {i}: " + " ".join(["how long may I keep a book"] * (1 + i % 5)) + "?"
        text = (SYSTEM + q) if i % 3 else q
        out.append(model.tokenize(text, add_special=True, parse_special=True))
    return out


def used_cells_owned(engine):
    """Every used cell belongs to a running request's sequence or to the prefix cache."""
    mem = engine.memory
    live = {s.seq for s in engine._slots if s.req is not None}
    tree = set(engine.reuse.seq_ids)
    for pos, seqs in mem.cells():
        if pos >= 0:
            assert seqs and seqs <= live | tree, (pos, seqs)


def test_32_requests_on_8_slots_match_solo(model):
    prompts = prompts_mixed(model, 32)
    max_toks = [8 + (i * 7) % 25 for i in range(32)]
    eng = Engine(model, n_ctx=4096, n_parallel=8, n_batch=512)
    reqs = [eng.submit(p, max_tokens=n, temperature=0) for p, n in zip(prompts, max_toks)]
    busy = []
    while any(not r.done for r in reqs):
        assert eng.step() <= 512  # one decode of at most n_batch tokens
        busy.append(eng.metrics()["slots_busy"])
        used_cells_owned(eng)
    assert max(busy) == 8
    for p, n, r in zip(prompts, max_toks, reqs):
        res = r.result()
        assert res.tokens == solo(model, p, n), f"request {r.id}"
        assert res.n_generated == len(res.tokens) and res.n_prompt == len(p)
        assert res.stop in ("eog", "length")
    m = eng.metrics()
    assert m["requests_finished"] == 32 and m["slots_busy"] == 0 and m["queue_len"] == 0
    assert m["prefix_hits"] >= 15 and m["tokens_reused"] > 0
    assert m["cells_used"] == m["cells_cached"] > 0


def test_shared_system_prompt_prefills_only_the_suffix(model):
    sys_toks = model.tokenize(SYSTEM, add_special=True, parse_special=True)
    sys_toks = (sys_toks * 3)[:256]
    a = sys_toks + model.tokenize(" Where is the reading room?", add_special=False)
    b = sys_toks + model.tokenize(" When do you open on Sunday?", add_special=False)
    eng = Engine(model, n_ctx=2048, n_parallel=2)
    ra = eng.generate(a, max_tokens=12, temperature=0)
    before = eng.metrics()["prompt_tokens"]
    rb = eng.generate(b, max_tokens=12, temperature=0)
    computed = eng.metrics()["prompt_tokens"] - before
    assert rb.n_cached >= 256 and computed == len(b) - rb.n_cached
    assert computed <= len(b) - 256
    off = Engine(model, n_ctx=2048, n_parallel=2, prefix_cache=False)
    assert off.generate(b, max_tokens=12, temperature=0).tokens == rb.tokens
    assert off.generate(a, max_tokens=12, temperature=0).tokens == ra.tokens
    assert off.metrics()["tokens_reused"] == 0 and off.metrics()["cells_used"] == 0


def test_eviction_under_pressure_and_clear_cache(model):
    eng = Engine(model, n_ctx=512, n_parallel=4)
    prompts = [model.tokenize(f"Story {i}: " + "once upon a time " * (20 + i % 7), add_special=True) for i in range(16)]
    assert sum(map(len, prompts)) > 3 * eng.memory.n_cells
    reqs = [eng.submit(p, max_tokens=6, temperature=0) for p in prompts]
    while any(not r.done for r in reqs):
        eng.step()
        used_cells_owned(eng)
    for p, r in zip(prompts, reqs):
        assert r.result().tokens == solo(model, p, 6)
    m = eng.metrics()
    assert m["requests_finished"] == 16 and m["cells_used"] == m["cells_cached"] > 0
    assert m["requests_suspended"] == 0  # eviction was enough: nothing was suspended
    eng.clear_cache()
    assert eng.memory.n_used == 0 and eng.metrics()["cells_cached"] == 0 and eng.reuse.n_prompts == 0


def test_cancel_while_prefilling_and_generating(model):
    eng = Engine(model, n_ctx=2048, n_parallel=2, n_batch=64)
    long = model.tokenize("tell me " * 150, add_special=True)
    r1 = eng.submit(long, max_tokens=50, temperature=0)
    r2 = eng.submit("Hello there, how are you?", max_tokens=200, temperature=0)
    eng.step()
    s = eng.slots()
    assert s[0]["state"] == "prefill" and s[0]["n_past"] < len(long)
    r1.cancel()
    assert r1.done and r1.result().stop == "cancelled" and r1.result().n_generated == 0
    assert eng.slots()[0]["is_processing"] is False  # freed at once
    while len(r2.generated) < 3:
        eng.step()
    r2.cancel()
    res = r2.result()
    assert res.stop == "cancelled" and res.n_generated >= 3
    assert not any(x["is_processing"] for x in eng.slots())
    m = eng.metrics()
    assert m["requests_cancelled"] == 2 and m["cells_used"] == m["cells_cached"]
    queued = eng.submit("never runs", max_tokens=4)
    queued.cancel()
    assert queued.result().stop == "cancelled" and eng.metrics()["queue_len"] == 0


def test_one_request_overflowing_leaves_the_others_unchanged(model):
    """A request shifts its own context (llama.cpp #23652: one sequence overflowing aborted the
    batch); the prefix cells it shares with the cache and other requests are copied, not moved."""
    sys_toks = (model.tokenize(SYSTEM, add_special=True) * 4)[:400]
    others = [sys_toks + model.tokenize(f" Question {i}: are you open today?", add_special=False) for i in range(3)]
    eng = Engine(model, n_ctx=1024, n_parallel=4, n_ctx_slot=512)
    long = eng.submit(sys_toks, max_tokens=200, temperature=0, n_keep=10)
    first = eng.submit(others[0], max_tokens=10, temperature=0)
    while long.n_shift == 0:
        assert eng.step()
    reqs = [first] + [eng.submit(p, max_tokens=10, temperature=0) for p in others[1:]]
    while any(not r.done for r in reqs + [long]):
        eng.step()
        used_cells_owned(eng)
    for p, r in zip(others, reqs):
        res = r.result()
        assert res.n_cached >= 400
        assert res.tokens == solo(model, p, 10, n_ctx=512)
    lr = long.result()
    assert lr.n_generated == 200 and lr.stop == "length" and lr.n_shift >= 1
    ctx = llamax.Context(model, n_ctx=512)
    g = llamax.generate(ctx, sys_toks, max_tokens=200, sampler=llamax.Sampler.greedy(), n_keep=10)
    for _ in g:
        pass
    assert g.stats.n_shift == lr.n_shift and g.generated == lr.tokens
    off = Engine(model, n_ctx=512, n_parallel=2, context_shift=False)
    r = off.generate(sys_toks, max_tokens=300, temperature=0)
    assert r.stop == "length" and r.n_generated == 512 - len(sys_toks)  # the last one is sampled, never decoded
    with pytest.raises(BatchError, match="context shift is off"):
        off.submit(sys_toks * 2, max_tokens=4)


@pytest.mark.parametrize("budget", [1 << 30, 0], ids=["saved", "recomputed"])
def test_full_cache_suspends_the_youngest(model, budget):
    prompts = [model.tokenize(f"Count from {i}: {i}, {i + 1}, {i + 2},", add_special=True) for i in range(4)]
    eng = Engine(model, n_ctx=256, n_parallel=4, suspend_bytes=budget, context_shift=False)
    reqs = [eng.submit(p, max_tokens=100, temperature=0) for p in prompts]
    while any(not r.done for r in reqs):
        eng.step()
        used_cells_owned(eng)
    m = eng.metrics()
    assert m["requests_suspended"] > 0 and m["requests_finished"] == 4 and m["suspended_bytes"] == 0
    for p, r in zip(prompts, reqs):
        res = r.result()
        want = solo(model, p, 100, n_ctx=256)
        assert res.tokens == want, f"request {r.id}"


def test_same_seed_same_text_whatever_runs_beside(model):
    p = "Once upon a time"
    eng = Engine(model, n_ctx=2048, n_parallel=4)
    alone = eng.generate(p, max_tokens=24, temperature=0.9, seed=1234)
    eng.clear_cache()
    noise = [eng.submit(f"Noise {i}: " + "blah " * (i * 9), max_tokens=30, temperature=1.0, seed=i) for i in range(5)]
    beside = eng.submit(p, max_tokens=24, temperature=0.9, seed=1234)
    noise += [eng.submit("more noise", max_tokens=10, temperature=1.0, seed=7)]
    assert beside.result().tokens == alone.tokens
    assert [n.result() for n in noise]


def test_stop_strings_and_chat_messages(model):
    eng = Engine(model, n_ctx=2048, n_parallel=2)
    full = eng.generate("The numbers from one to ten are: one, two,", max_tokens=24, temperature=0)
    assert "four" in full.text
    cut = eng.generate("The numbers from one to ten are: one, two,", max_tokens=24, temperature=0, stop=["four"])
    assert cut.stop == "stop" and cut.text == full.text[:full.text.index("four")]
    pieces = list(eng.submit("The numbers from one to ten are: one, two,", max_tokens=24, temperature=0, stop="four"))
    assert "".join(pieces) == cut.text
    chat = eng.generate([{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0)
    text = model.apply_chat_template([{"role": "user", "content": "Say hello."}])
    assert chat.n_prompt == len(model.tokenize(text, add_special=True, parse_special=True))


def test_ignore_eos_generates_past_the_end(model):
    eng = Engine(model, n_ctx=2048, n_parallel=2)
    chat = [{"role": "user", "content": "Say hello."}]
    ended = eng.generate(chat, max_tokens=64, temperature=0)
    assert ended.stop == "eog" and ended.n_generated < 64
    both = [eng.submit(chat, max_tokens=ended.n_generated + 8, temperature=0, ignore_eos=True),
            eng.submit(chat, max_tokens=64, temperature=0)]  # the other request still stops at its end
    on, off = (r.result() for r in both)
    assert on.stop == "length" and on.n_generated == ended.n_generated + 8
    assert on.tokens[:ended.n_generated] == ended.tokens
    assert not any(model.is_eog(t) for t in on.tokens)
    assert off.tokens == ended.tokens and off.stop == "eog"


def test_background_loop_threads_and_asyncio(model):
    prompts = [f"Tell me about the color number {i}." for i in range(6)]
    ref = Engine(model, n_ctx=2048, n_parallel=3)
    want = [ref.generate(p, max_tokens=10, temperature=0).tokens for p in prompts]
    got = {}
    with Engine(model, n_ctx=2048, n_parallel=3) as eng:
        def client(i):
            r = eng.submit(prompts[i], max_tokens=10, temperature=0)
            text = "".join(r)
            got[i] = (text, r.result())
        ts = [threading.Thread(target=client, args=(i,)) for i in range(6)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()

        async def main():
            pieces = [p async for p in eng.stream(prompts[0], max_tokens=10, temperature=0)]
            res = await eng.agenerate(prompts[1], max_tokens=10, temperature=0)
            return "".join(pieces), res
        text0, res1 = asyncio.run(main())
        slow = eng.submit("a long one " * 10, max_tokens=500, temperature=0)
    assert slow.result().stop == "cancelled"  # leaving `with` cancels what still runs
    for i in range(6):
        text, res = got[i]
        assert res.tokens == want[i] and text == res.text
    assert text0 == got[0][1].text and res1.tokens == want[1]


def test_async_without_background_loop(model):
    eng = Engine(model, n_ctx=2048, n_parallel=2)

    async def main():
        return await asyncio.gather(eng.agenerate("Hello", max_tokens=5, temperature=0),
                                    eng.agenerate("Good morning", max_tokens=5, temperature=0))
    a, b = asyncio.run(main())
    assert a.n_generated == 5 and b.n_generated == 5


def test_a_failed_forward_pass_fails_its_request_and_the_engine_goes_on(model):
    eng = Engine(model, n_ctx=2048, n_parallel=2)
    with eng:
        assert eng.generate("Hello", max_tokens=3, temperature=0).n_generated == 3
        assert eng.failed is None
        real = eng.ctx.decode

        def broken(*a, **kw):
            raise RuntimeError("forward pass failed")
        eng.ctx.decode = broken
        with pytest.raises(llamax.RequestError, match="forward pass failed") as e:
            eng.submit("Hello", max_tokens=3).result(timeout=60)
        assert isinstance(e.value.__cause__, RuntimeError)
        assert eng.failed is None and eng.metrics()["requests_failed"] == 1
        eng.ctx.decode = real
        assert eng.generate("Hello again", max_tokens=3, temperature=0).n_generated == 3


def test_an_error_outside_a_forward_pass_stops_the_loop_and_says_so(model):
    eng = Engine(model, n_ctx=2048, n_parallel=2)
    with eng:
        assert eng.generate("Hello", max_tokens=3, temperature=0).n_generated == 3

        def broken(*a, **kw):
            raise RuntimeError("scheduler bug")
        eng._build = broken
        with pytest.raises(llamax.RequestError, match="scheduler bug"):
            eng.submit("Hello", max_tokens=3).result(timeout=60)
        assert isinstance(eng.failed, RuntimeError)
        with pytest.raises(LlamaxError, match="stopped after an error"):
            eng.submit("Hello again", max_tokens=3)


def test_errors(model):
    eng = Engine(model, n_ctx=512, n_parallel=1, max_queue=2)
    with pytest.raises(BatchError, match="empty"):
        eng.submit("")
    with pytest.raises(BatchError, match="outside the vocabulary"):
        eng.submit([1, 2, model.n_vocab])
    with pytest.raises(ValueError):
        eng.submit("x", top_p=0)
    eng.submit("a", max_tokens=1)
    eng.submit("b", max_tokens=1)
    with pytest.raises(EngineFullError, match="queue is full"):
        eng.submit("c")
    assert issubclass(EngineFullError, LlamaxError)
    while eng.step():
        pass
    r = Engine(model, n_ctx=256, n_parallel=1).submit(list(range(5, 600)), max_tokens=3, temperature=0)
    assert r.n_truncated > 0 and len(r.prompt) + 1 < 256 and r.prompt == list(range(5, 600))[r.n_truncated:]
    assert r.result().n_generated == 3


def test_slots_save_restore_erase(model, tmp_path):
    eng = Engine(model, n_ctx=2048, n_parallel=2, slot_save_path=tmp_path)
    p = model.tokenize(SYSTEM + " Count from 1: 1, 2, 3,", add_special=True)
    r = eng.submit(p, max_tokens=8, temperature=0)
    eng.step()
    s = eng.slots()
    assert [x["id"] for x in s] == [0, 1]
    assert s[0]["is_processing"] and s[0]["n_past"] == len(p) and s[0]["n_ctx"] == 2048
    assert s[1] == dict(s[1], is_processing=False, state="idle", n_past=0)
    busy = eng.slot_save(0, "busy.bin")
    assert busy["n_saved"] == len(p) and (tmp_path / "busy.bin").stat().st_size == busy["n_written"]
    res = r.result()
    done = eng.slot_save(0, "done.bin")
    assert done["n_saved"] == len(p) + res.n_generated - 1  # the last sampled token was never decoded
    for bad in ("../x.bin", "a/b.bin", "", ".hidden"):
        with pytest.raises(ValueError):
            eng.slot_save(0, bad)
    with pytest.raises(LlamaxError, match="slot_save_path"):
        Engine(model, n_ctx=512, n_parallel=1).slot_save(0, "x.bin")
    eng2 = Engine(model, n_ctx=2048, n_parallel=2, slot_save_path=tmp_path)
    assert eng2.slot_restore(1, "done.bin")["n_restored"] == done["n_saved"]
    assert eng2.metrics()["cells_cached"] == done["n_saved"]
    again = eng2.generate(p, max_tokens=8, temperature=0)
    assert again.n_cached == len(p) - 1 and again.tokens == res.tokens
    assert eng2.slot_erase(1)["n_erased"] == done["n_saved"]
    busy_req = eng2.submit(p, max_tokens=30, temperature=0)
    eng2.step()
    with pytest.raises(LlamaxError, match="processing"):
        eng2.slot_restore(0, "done.bin")
    busy_req.cancel()
    with pytest.raises(llamax.StateError):
        (tmp_path / "junk.bin").write_bytes(b"not a state")
        eng2.slot_restore(0, "junk.bin")


@pytest.mark.parametrize("type_kv", ["f16", "q8_0", "q4_0"])
def test_holds_128_cached_prompts(model, type_kv):
    eng = Engine(model, n_ctx=4096, n_parallel=8, type_k=type_kv, type_v=type_kv)
    prompts = [model.tokenize(f"Item {i} of the catalogue:", add_special=True) for i in range(136)]
    reqs = [eng.submit(p, max_tokens=1, temperature=0) for p in prompts]
    while any(not r.done for r in reqs):
        eng.step()
    m = eng.metrics()
    assert m["cached_prompts"] >= 128 and m["bytes_cached"] > 0
    lookups = m["prefix_lookups"]
    again = [eng.submit(p, max_tokens=1, temperature=0) for p in prompts[-128:]]
    for p, r, first in zip(prompts[-128:], again, reqs[-128:]):
        res = r.result()
        assert res.n_cached == len(p) - 1 and res.tokens == first.result().tokens
    assert eng.metrics()["prefix_hits"] - m["prefix_hits"] == 128 == eng.metrics()["prefix_lookups"] - lookups


def test_a_request_turned_away_leaves_the_cache_and_its_counters_as_they_were(model):
    """The prefix lookup has no side effect: a request that does not fit beside a running one is
    looked up and turned away at every step, and until it is admitted the prefix cache's nodes
    (runs, use times, lock counts) and the lookup / hit counters stay as they were; it is counted
    once, when it is admitted."""
    eng = Engine(model, n_ctx=256, n_parallel=2)
    c = list(range(3000, 3040))
    eng.generate(c, max_tokens=1, temperature=0)            # a cached prompt for b to hit
    a = eng.submit(list(range(1000, 1130)), max_tokens=60, temperature=0, ignore_eos=True)
    while a.state != "generating":
        eng.step()

    def snapshot():
        m = eng.metrics()
        nodes = sorted((n.start, n.tokens.tolist(), n.last_use, n.lock) for n in eng.reuse.tree.nodes())
        return m["prefix_lookups"], m["prefix_hits"], m["tokens_reused"], m["cached_prompts"], nodes

    before = snapshot()
    b = eng.submit(c[:30] + list(range(2000, 2100)), max_tokens=4, temperature=0)
    steps = 0
    while not a.done:
        eng.step()
        steps += 1
        if not a.done:
            assert b.state == "queued" and snapshot() == before, steps
    assert steps > 10
    b_res = b.result()
    m = eng.metrics()
    assert b_res.n_cached == 30
    assert (m["prefix_lookups"], m["prefix_hits"], m["tokens_reused"]) == (before[0] + 1, before[1] + 1, before[2] + 30)


def test_one_stream_per_slot_reuses_the_slots_own_cache(model):
    eng = Engine(model, n_ctx=2048, n_parallel=2, kv_unified=False)
    assert eng.reuse.name == "slots" and eng.n_ctx_seq == 1024
    p1 = model.tokenize(SYSTEM + " First question?", add_special=True)
    p2 = model.tokenize(SYSTEM + " Second question?", add_special=True)
    r1 = eng.generate(p1, max_tokens=6, temperature=0)
    r2 = eng.generate(p2, max_tokens=6, temperature=0)
    assert r2.n_cached > 100 and r2.tokens == solo(model, p2, 6)
    assert eng.metrics()["cells_cached"] > 0 and r1.n_cached == 0


def test_gemma3_chat_turn_reuses_the_conversation(gemma):
    eng = Engine(gemma, n_ctx=2048, n_parallel=2)
    conv = [{"role": "user", "content": "Name a fruit."}]
    r1 = eng.generate(conv, max_tokens=12, temperature=0)
    conv += [{"role": "assistant", "content": r1.text}, {"role": "user", "content": "And a vegetable?"}]
    r2 = eng.generate(conv, max_tokens=12, temperature=0)
    first = len(gemma.tokenize(gemma.apply_chat_template(conv[:1]), add_special=True, parse_special=True))
    assert r2.n_cached >= first
    toks = gemma.tokenize(gemma.apply_chat_template(conv), add_special=True, parse_special=True)
    assert r2.tokens == solo(gemma, toks, 12)
    prompts = [gemma.tokenize(f"Fact {i}: the sky is", add_special=True) for i in range(6)]
    reqs = [eng.submit(p, max_tokens=8, temperature=0) for p in prompts]
    for p, r in zip(prompts, reqs):
        assert r.result().tokens == solo(gemma, p, 8)
