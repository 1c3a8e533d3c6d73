"""The host-RAM tier (llamax/serving/host_tier.py): its trie, lookups, byte budget and cost model, and
the radix prefix cache keeping what it evicts there (a real model: SmolLM2)."""
import pytest

from llamax import Engine, StateError
from llamax.serving.host_tier import MIB, HostTier, RestoreCost, budget_bytes
from llamax.serving.prefix_cache import PrefixCache


def test_budget_from_cache_ram():
    assert budget_bytes(None) == 8192 * MIB   # llama-server's default
    assert budget_bytes(0) == 0 and budget_bytes(3) == 3 * MIB and budget_bytes(-1) >= 1 << 60
    with pytest.raises(ValueError, match="cache_ram"):
        budget_bytes(-2)
    with pytest.raises(TypeError, match="cache_ram"):
        budget_bytes(1.5)
    assert not HostTier(0).enabled and not HostTier(0).put([1, 2], b"x")


def test_match_longest_covers_and_has():
    t = HostTier(1000)
    for toks, data in (([1, 2, 3, 4], b"a" * 10), ([1, 2], b"b" * 10), ([1, 2, 5], b"c" * 5), ([9], b"d")):
        assert t.put(toks, data)
    # match: the deepest entry whose tokens are a prefix of tokens[:limit]
    assert t.match([1, 2, 3, 4, 7], 5).n == 4 and t.match([1, 2, 3, 4, 7], 3).n == 2
    assert t.match([1, 2, 5, 6], 4).data == b"c" * 5 and t.match([1], 1) is None and t.match([7, 1], 2) is None
    # longest: the entry sharing the most with the prompt (cut back later), the shortest of those
    e, k = t.longest([1, 2, 3, 9], 4)
    assert (e.n, k) == (4, 3)
    e, k = t.longest([1, 2, 8], 3)
    assert (e.n, k) == (2, 2)                     # [1, 2] itself, not the longer [1, 2, 3, 4] or [1, 2, 5]
    assert t.longest([4], 1) == (None, 0)
    assert t.covers([1, 2, 3]) and t.covers([1, 2, 3, 4]) and not t.covers([1, 2, 3, 4, 5]) and not t.covers([2])
    assert t.has([1, 2]) and not t.has([1, 2, 3])
    assert t.put([1, 2], b"e" * 3) and t.match([1, 2], 2).data == b"e" * 3 and len(t) == 4  # replaced


def test_least_recently_used_go_first_within_the_budget():
    t = HostTier(30)
    for i in range(3):
        t.put([i, i], bytes(10))
    t.touch(t.match([0, 0], 2))                   # 0 used: 1 is now the oldest
    assert t.put([7], bytes(10))
    assert t.match([1, 1], 2) is None and t.match([0, 0], 2) is not None and len(t) == 3 and t.nbytes == 30
    assert t.stats().evicted == 1 and t.stats().stored == 4
    assert not t.put([8], bytes(31)) and len(t) == 3   # larger than the whole budget: nothing dropped
    t.restored(t.match([7], 1), 1)
    assert t.stats().restores == 1 and t.stats().tokens_restored == 1
    t.clear()
    assert len(t) == 0 and t.nbytes == 0 and not t.covers([0])


def test_a_dropped_entry_leaves_no_empty_branch():
    t = HostTier(20)
    t.put([1, 2, 3], bytes(10))
    t.put([1, 5], bytes(10))
    t.put([6], bytes(10))                         # drops [1, 2, 3]
    assert not t.covers([1, 2]) and t.covers([1, 5]) and t.longest([1, 2, 3], 3) == (t.match([1, 5], 2), 1)


def test_restore_cost_decides_by_the_measured_speeds():
    c = RestoreCost()
    assert c.worth(10**9, 1) and not c.worth(10, 0)   # nothing measured yet: a restore is assumed cheaper
    c.saw_restore(1000, 1e-3)                       # 1 us per byte
    c.saw_prefill(10, 1e-2)                         # 1 ms per token
    assert c.worth(999, 1) and not c.worth(2000, 1) and c.worth(2000, 3)


def test_the_prefix_cache_tells_the_tier_what_it_trims(model):
    from llamax import Context
    ctx = Context(model, n_ctx=256, n_seq_max=4)
    tree, seen = PrefixCache(ctx.memory, [2, 3]), []
    tree.on_evict = lambda toks, seq: seen.append((list(toks), ctx.memory.seq_pos_max(seq)))
    from llamax import Batch
    toks = list(range(100, 140))
    ctx.decode(Batch(toks, seq_ids=0))
    tree.insert(toks, 0, len(toks))
    ctx.memory.seq_rm(0, -1, -1)                  # only the tree holds the cells now
    assert tree.evict(10) == 10
    assert seen == [(toks, len(toks) - 1)]       # the whole path, before the cells went


def _prompts(n, length):
    return [[1] + [(i * 131 + j * 7) % 40000 + 200 for j in range(length)] for i in range(n)]


def test_more_system_prompts_than_cells_come_back_from_ram_with_the_same_tokens(model):
    """Four 200-token system prompts, two rounds, a cache of 512 cells (two of them fit): without
    the tier every prompt is computed twice; with it the second round restores each from RAM."""
    prompts = _prompts(4, 200)

    def run(cache_ram):
        eng = Engine(model, n_ctx=512, n_parallel=1, cache_ram=cache_ram)
        out = [eng.generate(p + [300 + r, 301 + i], max_tokens=4, temperature=0)
               for r in range(2) for i, p in enumerate(prompts)]
        return out, eng

    off, _ = run(0)
    on, eng = run(None)
    assert [r.tokens for r in on] == [r.tokens for r in off]
    cached_off, cached_on = sum(r.n_cached for r in off), sum(r.n_cached for r in on)
    assert cached_on >= 2 * max(cached_off, 1) and all(r.n_cached == 201 for r in on[4:])
    m = eng.metrics()
    assert m["cache_ram_restores"] == 4 and m["cache_ram_tokens_restored"] == 4 * 201
    assert m["cache_ram_entries"] >= 2 and m["cache_ram_bytes"] == eng.memory_breakdown()["cache_ram"] > 0
    eng.clear_cache()
    assert eng.metrics()["cache_ram_entries"] == 0


def test_a_small_budget_keeps_the_most_recent_and_counts_what_it_drops(model):
    prompts = _prompts(6, 200)
    probe = Engine(model, n_ctx=512, n_parallel=1)
    probe.generate(prompts[0], max_tokens=1, temperature=0)
    one = len(probe.export_prefix(prompts[0]).data)          # one kept prompt's state
    eng = Engine(model, n_ctx=512, n_parallel=1, cache_ram=(2 * one + one // 2) // MIB)
    assert 2 * one < eng.tier.budget < 3 * one
    for p in prompts:
        eng.generate(p, max_tokens=1, temperature=0)
    m = eng.metrics()
    assert m["cache_ram_bytes"] <= m["cache_ram_budget"] and m["cache_ram_evicted"] >= 1
    assert eng.tier.covers(prompts[3]) and not eng.tier.covers(prompts[0])
    # restored only when cheaper than computing: a (measured) slow restore is not used
    eng.tier.cost.restore_s_per_byte, eng.tier.cost.prefill_s_per_token = 1.0, 1e-3
    r0 = eng.metrics()["cache_ram_restores"]
    assert eng.generate(prompts[3], max_tokens=1, temperature=0).n_cached < 200   # (a head the cells kept)
    assert eng.metrics()["cache_ram_restores"] == r0
    eng.tier.cost.restore_s_per_byte = 1e-12
    assert eng.generate(prompts[4], max_tokens=1, temperature=0).n_cached == 200   # evicted by the one before
    assert eng.metrics()["cache_ram_restores"] == r0 + 1


def test_a_sliding_window_cache_gets_its_kept_states_back_whole_with_the_same_tokens(gemma):
    """Gemma 3's sliding layers reuse cells their window hid, so a kept state cannot be cut back (exact_cut
    False): it comes back whole, for a prompt holding all of its tokens, as a chat's next turn does. Four
    chats of a 600-token first prompt (past the 512-token window), 1536 cells (two fit): every chat's second
    turn (its first prompt, the reply, a new question) restores the first turn from RAM and generates the
    tokens of the run without the tier. A prompt sharing only part of a kept state computes it (no cut-back
    restore)."""
    firsts = [[2] + [(i * 131 + j * 7) % 40000 + 200 for j in range(600)] for i in range(4)]

    def run(cache_ram):
        eng = Engine(gemma, n_ctx=1536, n_parallel=1, cache_ram=cache_ram)
        assert eng.reuse.whole_only
        turn1 = [eng.generate(p, max_tokens=6, temperature=0, ignore_eos=True) for p in firsts]
        turn2 = [eng.generate(p + r.tokens + [300 + i, 301], max_tokens=6, temperature=0, ignore_eos=True)
                 for i, (p, r) in enumerate(zip(firsts, turn1))]
        return turn1 + turn2, eng

    off, _ = run(0)
    on, eng = run(None)
    assert [r.tokens for r in on] == [r.tokens for r in off]
    assert all(r.n_cached >= 601 for r in on[4:]) and all(r.n_cached < 100 for r in off[4:6]), \
        ([r.n_cached for r in on], [r.n_cached for r in off])
    m = eng.metrics()
    assert m["cache_ram_restores"] >= 2
    # part of a kept state only (its first 400 tokens): computed, nothing restored
    part = firsts[3][:400] + [7, 8, 9]
    want = Engine(gemma, n_ctx=1536, n_parallel=1, cache_ram=0).generate(part, max_tokens=6, temperature=0,
                                                                         ignore_eos=True).tokens
    r0 = eng.metrics()["cache_ram_restores"]
    got = eng.generate(part, max_tokens=6, temperature=0, ignore_eos=True)
    assert got.tokens == want and eng.metrics()["cache_ram_restores"] == r0
    assert not Engine(gemma, n_ctx=1024, n_parallel=1, swa_full=True).reuse.whole_only


def test_a_corrupt_import_changes_nothing(model):
    eng = Engine(model, n_ctx=1024, n_parallel=1)
    want = eng.generate(_prompts(1, 100)[0], max_tokens=2, temperature=0)
    state = eng.export_prefix(_prompts(1, 100)[0])
    other = Engine(model, n_ctx=1024, n_parallel=1)
    bad = type(state)(state.tokens, state.data[:-7] + b"garbage")
    with pytest.raises(StateError):
        other.import_prefix(bad)
    assert other.metrics()["cached_prompts"] == 0 and len(other.tier) == 0
    got = other.generate(_prompts(1, 100)[0], max_tokens=2, temperature=0)
    assert got.tokens == want.tokens and got.n_cached == 0
