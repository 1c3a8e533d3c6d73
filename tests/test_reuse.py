"""The prefix reuse protocol (llamax.serving.reuse) one implementation at a time over a standalone
KVCache, no model: each is driven as the Engine drives it (pick a slot, look up, lock, make room,
attach, note a prefilled prompt, release a finished slot; evict, stats, save / restore / erase,
clear, export / import) and the cells are checked after every call."""
import functools

import numpy as np
import pytest

from helpers import held, place
from llamax import KVCache, LlamaxError, StateError
from llamax.serving.reuse import DEFER_MIN, NoReuse, PrefixReuse, RadixReuse, SlotReuse, reuse_class

_rng = np.random.default_rng(1)
decode = functools.partial(place, rng=_rng)  # random K/V from this module's generator


def holds(mem, seq, tokens):
    return held(mem, seq) == dict(enumerate(tokens))


def counters(r):
    s = r.stats()
    return s.lookups, s.hits, s.tokens_reused


def admit(r, mem, seq, prompt, free_needed=0):
    """The Engine's admission: lookup (no side effect), lock, evict for room, attach; then the
    rest of the prompt is computed. Returns the tokens reused."""
    hit = r.lookup(seq, prompt, len(prompt) - 1)
    r.lock(seq, hit)
    if free_needed:
        r.evict(free_needed)
    n = r.attach(seq, hit)
    assert holds(mem, seq, prompt[:n])
    decode(mem, prompt[n:], seq, n)
    return n


SYS = list(range(100, 120))
P1, P2, P3 = SYS + [1, 2, 3], SYS + [7, 8], [50, 51, 52, 53]


def test_reuse_class_follows_the_engine_arguments():
    assert reuse_class(True, True, 4) is RadixReuse
    assert reuse_class(True, False, 4) is SlotReuse
    assert reuse_class(True, True, 256) is SlotReuse  # no sequence id left for a tree
    assert reuse_class(False, True, 4) is NoReuse and reuse_class(False, False, 4) is NoReuse
    assert RadixReuse.n_seq_max(4) == 256 and SlotReuse.n_seq_max(4) == NoReuse.n_seq_max(4) == 4
    for cls in (RadixReuse, SlotReuse, NoReuse):
        mem = KVCache(1, 1, 8, 64, n_seq_max=cls.n_seq_max(2))
        r: PrefixReuse = cls(mem, 2)
        assert r.name in ("tree", "slots", "off") and r.stats().lookups == 0


# ---- the radix tree ------------------------------------------------------------------------------
def radix(kv_size=128):
    mem = KVCache(1, 1, 8, kv_size, n_seq_max=256)
    return mem, RadixReuse(mem, 2)


def test_radix_reuse_request_lifecycle():
    mem, r = radix()
    assert r.pick(P1, [0, 1], []) == 0
    assert admit(r, mem, 0, P1) == 0
    assert counters(r) == (1, 0, 0)                  # a miss is counted when it is attached
    r.note_prefilled(0, P1)                          # the prompt is cached and locked for the request
    assert r.n_prompts == 1 and r.tree.match_len(P1) == len(P1)
    assert r.evict(100) == 0                         # locked, and its cells are the request's too
    decode(mem, [9, 9], 0, len(P1))
    r.release(0, P1 + [9, 9], cache=True, shifted=False)
    assert mem.seq_pos_max(0) == -1 and r.kept(0) == P1 + [9, 9]
    assert sorted(p for _, p in r.tree.leaves()) == [P1 + [9, 9]]
    st = r.stats()
    assert (st.cells_cached, st.cached_prompts) == (len(P1) + 2, 1) and st.bytes_cached > 0

    before = (counters(r), sorted(r.tree.leaves()), [n.last_use for n in r.tree.nodes()], mem.cells())
    hit = r.lookup(1, P2, len(P2) - 1)               # no side effect
    assert hit.n == len(SYS)
    assert (counters(r), sorted(r.tree.leaves()), [n.last_use for n in r.tree.nodes()], mem.cells()) == before
    r.lock(1, hit)
    r.unlock(1)                                      # a request turned away: nothing happened
    assert (counters(r), sorted(r.tree.leaves()), [n.last_use for n in r.tree.nodes()], mem.cells()) == before
    assert admit(r, mem, 1, P2) == len(SYS)
    assert counters(r) == (2, 1, len(SYS))
    assert mem.n_used == len(P1) + 2 + 2             # the shared prefix is not copied
    r.release(1, P2, cache=False, shifted=False)     # a failed request: nothing of it is cached
    assert mem.seq_pos_max(1) == -1 and r.tree.match_len(P2) == len(SYS)


def test_radix_reuse_keeps_the_prefix_of_an_admitted_request_while_making_room():
    mem, r = radix(kv_size=64)
    for seq, p in ((0, P1), (1, P3)):
        admit(r, mem, seq, p)
        r.release(seq, p, cache=True, shifted=False)
    hit = r.lookup(0, P2, len(P2) - 1)
    r.lock(0, hit)
    assert r.evict(1000) == len(P3)                  # P3 alone: the match ends inside P1's node, locked whole
    assert r.tree.match_len(P1) == len(P1)
    assert r.attach(0, hit) == len(SYS) and holds(mem, 0, SYS)
    r.unlock(0)


def test_radix_reuse_shifted_tokens_are_not_cached():
    mem, r = radix()
    admit(r, mem, 0, P3)
    r.release(0, P3, cache=True, shifted=True)
    assert r.n_prompts == 0 and mem.n_used == 0 and r.kept(0) == P3


def test_radix_reuse_defers_to_a_prompt_being_prefilled():
    mem, r = radix()
    long = SYS + list(range(DEFER_MIN))
    assert r.pick(long, [1], prefilling=[long + [5]]) is None
    assert r.pick(long, [1], prefilling=[long[:DEFER_MIN - 1]]) == 1
    admit(r, mem, 0, long + [5])
    r.note_prefilled(0, long + [5])                  # cached now: nothing left to wait for
    assert r.pick(long, [1], prefilling=[long + [5]]) == 1


def test_radix_reuse_save_restore_erase_clear():
    mem, r = radix()
    admit(r, mem, 0, P1)
    r.release(0, P1, cache=True, shifted=False)
    with r.save(0) as toks:                          # the idle slot's last tokens, placed on its sequence
        assert toks == P1 and holds(mem, 0, P1)
    assert mem.seq_pos_max(0) == -1 and counters(r) == (1, 0, 0)
    decode(mem, P3, 1)                               # as a slot file would load it
    r.restore(1, P3)
    assert mem.seq_pos_max(1) == -1 and r.kept(1) == P3 and r.tree.match_len(P3) == len(P3)
    assert r.erase(1) == len(P3) and r.kept(1) == [] and r.tree.match_len(P3) == len(P3)  # the tree keeps it
    r.evict(len(P1))                                 # the tree let go of P1: a save keeps what is left
    with r.save(0) as toks:
        assert len(toks) < len(P1) and holds(mem, 0, toks)
    r.clear()
    assert r.n_prompts == 0 and mem.n_used == 0


def test_radix_reuse_export_and_import():
    mem, r = radix()
    admit(r, mem, 0, P1)
    r.release(0, P1, cache=True, shifted=False)
    cells = mem.cells()
    blobs = {}

    def read(seq):
        blobs["held"] = held(mem, seq)
        return b"blob"

    state = r.export(P1 + [4], 1, read)
    assert state.tokens == P1 and state.data == b"blob" and blobs["held"] == dict(enumerate(P1))
    assert mem.cells() == cells and counters(r) == (1, 0, 0)  # the export is not a lookup
    assert r.export(P3, 1, read) is None and r.export(P1, len(P1) + 1, read) is None

    mem2, r2 = radix()
    checked = []

    def write(data, seq):
        decode(mem2, state.tokens, seq)

    assert r2.import_(state.tokens, state.data, checked.append, write) == len(P1)
    assert checked == [b"blob"] and r2.tree.match_len(P1) == len(P1) and mem2.n_used == len(P1)
    assert r2.import_(state.tokens, state.data, checked.append, write) == 0  # held already
    with pytest.raises(StateError, match="positions"):
        r2.import_(P3, b"x", checked.append, lambda data, seq: decode(mem2, P3[:2], seq))
    with pytest.raises(StateError):
        r2.import_(P3, b"x", lambda data: (_ for _ in ()).throw(StateError("bad")), write)
    assert r2.tree.match_len(P3) == 0 and mem2.n_used == len(P1)


# ---- llama-server's per-slot reuse ------------------------------------------------------------------
def slots(kv_size=64):
    mem = KVCache(1, 1, 8, kv_size, n_seq_max=2)
    return mem, SlotReuse(mem, 2)


def test_slot_reuse_picks_the_slot_sharing_the_most_and_reuses_in_place():
    mem, r = slots()
    assert r.pick(P1, [0, 1], []) == 0               # nothing kept: the first free slot
    assert admit(r, mem, 0, P1) == 0
    r.release(0, P1 + [9], cache=True, shifted=False)  # (the last token was decoded)
    decode(mem, [9], 0, len(P1))
    assert admit(r, mem, 1, P3) == 0
    r.release(1, P3, cache=True, shifted=False)
    assert r.kept(0) == P1 + [9] and r.kept(1) == P3
    assert r.stats().cells_cached == len(P1) + 1 + len(P3) and r.stats().cached_prompts == 0
    assert r.pick(P2, [0, 1], []) == 0 and r.pick(P3 + [1], [0, 1], []) == 1 and r.pick(P2, [1], []) == 1
    before = (counters(r), mem.cells())
    hit = r.lookup(0, P2, len(P2) - 1)
    assert hit.n == len(SYS) and (counters(r), mem.cells()) == before  # no side effect
    assert r.evict(100) == 0                         # nothing is the reuse's alone to evict
    r.lock(0, hit)
    assert r.attach(0, hit) == len(SYS) and holds(mem, 0, SYS)  # kept in place, the rest dropped
    assert counters(r) == (3, 1, len(SYS)) and r.kept(0) == []
    assert r.lookup(1, P3, 3).n == 3                 # the limit
    decode(mem, P2[len(SYS):], 0, len(SYS))
    r.release(0, P2, cache=False, shifted=False)
    assert mem.seq_pos_max(0) == -1 and r.kept(0) == []


def test_slot_reuse_save_restore_take_erase_clear():
    mem, r = slots()
    admit(r, mem, 0, P1)
    r.release(0, P1, cache=True, shifted=True)       # a shifted slot keeps its cells too
    with r.save(0) as toks:
        assert toks == P1 and holds(mem, 0, P1)
    assert holds(mem, 0, P1)                         # still the slot's
    r.take(0)                                        # a resumed request brings its own cells
    assert r.kept(0) == [] and r.pick(P1, [0, 1], []) == 0
    mem.seq_rm(0, -1, -1)
    decode(mem, P3, 1)
    r.restore(1, P3)
    assert r.kept(1) == P3 and r.stats().cells_cached == len(P3)
    assert r.erase(1) == len(P3) and mem.n_used == 0
    decode(mem, P3, 1)
    r.restore(1, P3)
    r.clear()
    assert mem.n_used == 0 and r.kept(1) == []
    with pytest.raises(LlamaxError, match="prefix cache"):
        r.export(P3, 1, lambda s: b"")
    with pytest.raises(LlamaxError, match="prefix cache"):
        r.import_(P3, b"", lambda d: None, lambda d, s: None)


# ---- no reuse ---------------------------------------------------------------------------------------
def test_no_reuse_computes_every_prompt():
    mem = KVCache(1, 1, 8, 64, n_seq_max=2)
    r = NoReuse(mem, 2)
    assert admit(r, mem, 0, P1) == 0
    r.release(0, P1, cache=True, shifted=False)
    assert mem.n_used == 0 and r.kept(0) == []
    assert r.pick(P1, [1, 0], []) == 1 and r.lookup(0, P1, len(P1) - 1).n == 0
    decode(mem, P3, 1)                               # a slot file: kept until the slot's next request
    r.restore(1, P3)
    assert r.stats().cells_cached == len(P3)
    with r.save(1) as toks:
        assert toks == P3
    assert admit(r, mem, 1, P3) == 0 and counters(r) == (2, 0, 0)
    assert mem.n_used == len(P3) and r.stats().cells_cached == 0
