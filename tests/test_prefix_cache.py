"""The prefix cache (llamax.serving.PrefixCache) over a standalone unified KVCache, no model: a
"decode" places tokens on a sequence with random K/V, since the tree only cares about cells.

Deterministic tests of lookup / insert / lock / evict / clear, then a Hypothesis state machine of
requests that look their prompt up, copy the prefix into their own sequence, decode the rest, give
it back to the tree and are evicted or cleared, with the tree's invariants checked after each step."""
import functools

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from helpers import held, place
from llamax import KVCache, NoKVSlotError
from llamax.serving.prefix_cache import PrefixCache, common_prefix

TREE = (4, 5, 6, 7)  # the tree's sequence ids; 0..3 are requests


def make(kv_size=64, seq_ids=TREE):
    mem = KVCache(1, 1, 8, kv_size, n_seq_max=8)
    return mem, PrefixCache(mem, seq_ids)


_rng = np.random.default_rng(0)
decode = functools.partial(place, rng=_rng)  # random K/V from this module's generator


@given(st.lists(st.integers(0, 3), max_size=12), st.lists(st.integers(0, 3), max_size=12), st.integers(0, 13))
def test_common_prefix_is_the_first_mismatch(a, b, i):
    n = 0
    while n < len(a) and i + n < len(b) and a[n] == b[i + n]:
        n += 1
    assert common_prefix(a, b, i) == n
    assert common_prefix(b, b) == len(b)


def holds_path(mem, seq, path):
    return held(mem, seq) == dict(enumerate(path))


def request(mem, pc, seq, prompt, limit=None):
    """What a server does: look the prompt up, copy the prefix into seq, compute the rest."""
    mem.seq_rm(seq, -1, -1)
    n, src = pc.lookup(prompt, len(prompt) if limit is None else limit)
    if n:
        mem.seq_cp(src, seq, 0, n)
    decode(mem, prompt[n:], seq, n)
    return n


def leaves(pc):
    return dict(pc.leaves())


def check_leaves(mem, pc):
    lv = list(pc.leaves())
    assert len({s for s, _ in lv}) == len(lv) == pc.n_prompts
    for s, path in lv:
        assert s in pc.seq_ids and holds_path(mem, s, path), (s, path, held(mem, s))


A = list(range(1, 11))          # 1..10
B = A[:5] + [20, 21, 22]        # branches off A after 5 tokens


# ---- lookup / insert ------------------------------------------------------------------------
def test_insert_then_lookup_gives_the_longest_prefix():
    mem, pc = make()
    assert pc.lookup(A, 10) == (0, None)
    decode(mem, A, 0)
    assert pc.insert(A, 0, 10) == 10
    mem.seq_rm(0, -1, -1)
    assert mem.n_used == 10 and pc.n_prompts == 1
    n, s = pc.lookup(A + [99], 11)
    assert n == 10 and s in TREE and mem.seq_pos_max(s) == 9 and holds_path(mem, s, A)
    assert pc.lookup(A[:5] + [77, 78], 7) == (5, s)
    assert pc.lookup(A, 4) == (4, s)            # the limit
    assert pc.lookup(A, 0) == (0, None)
    assert pc.lookup([5, 1, 2], 3) == (0, None)  # no cached prompt starts with 5
    assert (pc.lookups, pc.hits, pc.tokens_reused) == (6, 3, 19)
    # the request's copy reuses the cells: nothing new is placed for the prefix
    mem.seq_cp(s, 0, 0, 10)
    assert mem.n_used == 10 and held(mem, 0) == dict(enumerate(A))


def test_lookup_with_a_limit_beyond_the_tokens():
    """limit is a bound on tokens[:limit]: a limit past the end must act as len(tokens)."""
    mem, pc = make()
    decode(mem, A, 0)
    pc.insert(A, 0, 10)
    n, s = pc.lookup(A, 20)
    assert n == 10 and holds_path(mem, s, A)
    assert pc.lookup(A[:5], 20)[0] == 5


def test_a_branch_inside_an_edge_splits_it():
    mem, pc = make()
    decode(mem, A, 0)
    pc.insert(A, 0, 10)
    mem.seq_rm(0, -1, -1)
    assert request(mem, pc, 1, B) == 5
    assert pc.insert(B, 1, 8) == 3
    mem.seq_rm(1, -1, -1)
    lv = leaves(pc)
    assert sorted(lv.values()) == sorted([A, B]) and pc.n_prompts == 2
    check_leaves(mem, pc)
    assert mem.n_used == 13                      # the 5 shared tokens are stored once
    assert [n.tokens.tolist() for n in pc.root.children.values()] == [A[:5]]
    head = pc.root.children[1]
    assert sorted(c.tokens.tolist() for c in head.children.values()) == [A[5:], B[5:]] and head.seq is None
    for prompt, want in ((A, 10), (B, 8), (A[:3], 3), (A[:5] + [20, 99], 6), (A[:6] + [0], 6)):
        n, s = pc.lookup(prompt, len(prompt))
        assert n == want and held(mem, s).items() >= dict(enumerate(prompt[:n])).items()
    # a branch at a node boundary adds a child without a split
    assert request(mem, pc, 2, A[:5] + [40]) == 5
    assert pc.insert(A[:5] + [40], 2, 6) == 1
    mem.seq_rm(2, -1, -1)
    assert len(head.children) == 3 and mem.n_used == 14
    check_leaves(mem, pc)


def test_a_prefix_computed_by_two_requests_is_stored_once():
    """Two requests computed the same 4-token prefix (neither found it in the tree): once both are
    cached, the inner node's cells should be shared by the two leaves, as the module says."""
    mem, pc = make()
    X, Y = [1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 9, 9]
    decode(mem, X, 0)
    decode(mem, Y, 1)
    assert pc.insert(X, 0, 6) == 6 and pc.insert(Y, 1, 6) == 2
    mem.seq_rm(0, -1, -1)
    mem.seq_rm(1, -1, -1)
    check_leaves(mem, pc)
    assert mem.n_used == 8


def test_extending_a_leaf_reuses_its_sequence():
    mem, pc = make()
    decode(mem, A, 0)
    pc.insert(A, 0, 10)
    mem.seq_rm(0, -1, -1)
    (s0,) = leaves(pc)
    longer = A + [11, 12]
    assert request(mem, pc, 1, longer) == 10
    assert pc.insert(longer, 1, 12) == 2
    mem.seq_rm(1, -1, -1)
    assert leaves(pc) == {s0: longer} and pc.n_prompts == 1 and mem.n_used == 12
    check_leaves(mem, pc)
    # what the tree already holds is not new
    assert pc.insert(longer, s0, 12) == 0 and pc.insert(A[:4], s0, 4) == 0 and pc.insert(A, s0, 10) == 0
    assert leaves(pc) == {s0: longer} and mem.n_used == 12
    assert pc.insert([], s0, 0) == 0


# ---- lock / evict -------------------------------------------------------------------------------
def two_branches():
    mem, pc = make()
    decode(mem, A, 0)
    pc.insert(A, 0, 10)
    mem.seq_rm(0, -1, -1)
    request(mem, pc, 1, B)
    pc.insert(B, 1, 8)
    mem.seq_rm(1, -1, -1)
    return mem, pc


def test_locked_paths_are_not_evicted():
    mem, pc = two_branches()
    pc.lookup(B, 8)                     # B is the most recent: A would go first
    h = pc.lock(A, 10)
    assert pc.evict(1000) == 3          # B's own tokens alone
    assert list(leaves(pc).values()) == [A] and mem.n_used == 10
    check_leaves(mem, pc)
    assert pc.evict(5) == 0
    pc.unlock(h)
    assert pc.evict(1000) == 10
    assert mem.n_used == 0 and pc.n_prompts == 0 and not leaves(pc)


def test_a_lock_of_a_prefix_keeps_that_prefix():
    mem, pc = two_branches()
    h = pc.lock(A, 3)                   # inside the shared head [1..5]
    freed = pc.evict(1000)
    assert freed == 8                   # A's 5 and B's 3 own tokens; the head holding [0, 3) stays
    lv = leaves(pc)
    assert list(lv.values()) == [A[:5]] and mem.n_used == 5
    check_leaves(mem, pc)
    assert pc.lookup(A, 10)[0] == 5
    pc.unlock(h)
    assert pc.evict(1000) == 5 and mem.n_used == 0


def test_a_lock_released_after_its_node_was_split_releases_everything():
    """The server's order: lookup, lock the prefix, compute the rest, insert (which splits the node
    the lock ends in), unlock. Afterwards no request holds anything, so evict frees the whole tree."""
    mem, pc = make()
    decode(mem, A, 0)
    pc.insert(A, 0, 10)
    mem.seq_rm(0, -1, -1)
    n, src = pc.lookup(B, 7)
    assert n == 5
    mem.seq_cp(src, 1, 0, n)
    h = pc.lock(B, n)
    decode(mem, B[n:], 1, n)
    pc.insert(B, 1, 8)                  # splits A's edge after 5 tokens
    pc.unlock(h)
    mem.seq_rm(1, -1, -1)
    assert pc.evict(1000) == 13
    assert mem.n_used == 0 and not leaves(pc)


def test_a_lock_taken_before_its_path_was_inserted_still_holds():
    """The server's _cache with no sequence id free: insert gives up, the request locks its tokens
    anyway. Once its next _cache inserts them (unlock the old lock, lock the longer path), evict
    must not trim the path the request has locked."""
    mem, pc = make(seq_ids=(4,))
    X, Y = [1, 1, 1], [2, 2]
    decode(mem, X, 0)
    pc.insert(X, 0, 3)
    hx = pc.lock(X, 3)                  # request 0 runs on X
    decode(mem, Y, 1)
    assert pc.insert(Y, 1, 2) == 0      # request 1: no sequence id free, X is locked
    hy = pc.lock(Y, 2)
    pc.unlock(hx)                       # request 0 ends
    mem.seq_rm(0, -1, -1)
    decode(mem, [3], 1, 2)
    assert pc.insert(Y + [3], 1, 3) == 3  # request 1 caches again: X is evicted for it
    pc.unlock(hy)
    hy = pc.lock(Y + [3], 3)
    mem.seq_rm(1, -1, -1)               # (the request's own cells do not matter to the lock)
    pc.evict(100)
    assert list(leaves(pc).values()) == [Y + [3]]
    pc.unlock(hy)
    assert pc.evict(100) == 3 and mem.n_used == 0


def test_evict_trims_the_least_recently_used_leaf_from_its_tail():
    mem, pc = make()
    X, Y, Z = [1] * 6, [2] * 6, [3] * 6
    for prompt in (X, Y, Z):
        decode(mem, prompt, 0)
        pc.insert(prompt, 0, 6)
        mem.seq_rm(0, -1, -1)
    pc.lookup(X, 6)                     # LRU order now Y, Z, X
    sx, sy, sz = (next(s for s, p in pc.leaves() if p == q) for q in (X, Y, Z))
    assert pc.evict(4) == 4
    assert leaves(pc) == {sx: X, sy: Y[:2], sz: Z} and mem.n_used == 14
    check_leaves(mem, pc)
    assert pc.evict(3) == 3             # Y's last 2 (its sequence id is free again), then Z's tail
    assert leaves(pc) == {sx: X, sz: Z[:5]} and pc.n_prompts == 2 and mem.n_used == 11
    check_leaves(mem, pc)
    assert pc.evict(0) == 0
    assert pc.evict(100) == 11 and mem.n_used == 0 and pc.n_prompts == 0


def test_evict_counts_only_cells_it_frees():
    mem, pc = make()
    X, Y = [1] * 6, [2] * 4
    for prompt in (X, Y):
        decode(mem, prompt, 0)
        pc.insert(prompt, 0, len(prompt))
        mem.seq_rm(0, -1, -1)
    request(mem, pc, 1, X)              # a request still holds X's cells (it did not lock them)
    assert mem.n_used == 10
    assert pc.evict(100) == 4           # X's cells stay the request's
    assert not leaves(pc) and mem.n_used == 6 and holds_path(mem, 1, X)


def test_an_evicted_branch_leaves_its_parent_a_leaf():
    mem, pc = two_branches()
    pc.lookup(B, 8)
    assert pc.evict(5) == 5             # A's edge (the LRU leaf)
    assert list(leaves(pc).values()) == [B] and mem.n_used == 8
    check_leaves(mem, pc)
    assert pc.evict(4) == 4             # B's edge, then one token of the head, which is a leaf now
    assert list(leaves(pc).values()) == [A[:4]] and mem.n_used == 4
    check_leaves(mem, pc)


def test_insert_without_a_free_sequence_evicts_the_lru_leaf():
    mem, pc = make(seq_ids=(4, 5))
    X, Y, Z = [1] * 5, [2] * 5, [3] * 5
    for prompt in (X, Y):
        decode(mem, prompt, 0)
        pc.insert(prompt, 0, 5)
        mem.seq_rm(0, -1, -1)
    pc.lookup(X, 5)
    decode(mem, Z, 0)
    assert pc.insert(Z, 0, 5) == 5
    mem.seq_rm(0, -1, -1)
    assert sorted(leaves(pc).values()) == [X, Z] and pc.n_prompts == 2 and mem.n_used == 10
    check_leaves(mem, pc)
    # every leaf locked: nothing to evict, the insert gives up
    pc.lock(X, 5)
    pc.lock(Z, 5)
    decode(mem, Y, 0)
    assert pc.insert(Y, 0, 5) == 0
    mem.seq_rm(0, -1, -1)
    assert sorted(leaves(pc).values()) == [X, Z] and mem.n_used == 10
    check_leaves(mem, pc)


def test_clear_empties_every_tree_sequence():
    mem, pc = two_branches()
    request(mem, pc, 2, A + [50])       # a request holds A's cells and one of its own
    pc.lock(A, 10)
    pc.clear()
    assert not leaves(pc) and pc.n_prompts == 0
    for s in TREE:
        assert mem.seq_pos_max(s) == -1
    assert mem.n_used == 11 and holds_path(mem, 2, A + [50])
    assert pc.lookup(A, 10) == (0, None)
    mem.seq_rm(2, -1, -1)
    assert mem.n_used == 0
    # the tree works again after a clear
    decode(mem, B, 0)
    assert pc.insert(B, 0, 8) == 8
    mem.seq_rm(0, -1, -1)
    check_leaves(mem, pc)


# ---- state machine ---------------------------------------------------------------------------------
REQS = (0, 1)
# prompts start with a piece of one of these (so they share prefixes and branch inside edges)
BASES = ([0, 1, 2, 0, 1, 2, 0, 1], [0, 1, 1, 0, 2, 2, 1, 0], [2, 2, 2, 1, 1, 1, 0, 0])
PROMPTS = st.builds(lambda b, k, tail: b[:k] + tail, st.sampled_from(BASES), st.integers(0, 8),
                    st.lists(st.integers(0, 2), max_size=3)).filter(len)


def in_tree(pc, tokens):
    """How many leading tokens of tokens the tree holds (the longest common prefix with a leaf path)."""
    best = 0
    for _, path in pc.leaves():
        n = 0
        while n < min(len(path), len(tokens)) and path[n] == tokens[n]:
            n += 1
        best = max(best, n)
    return best


class PrefixMachine(RuleBasedStateMachine):
    """Requests on seqs 0 and 1 over a tree with 2..4 of seqs 4..7 in a small cache (so that
    insert runs out of sequence ids and decodes run out of cells), driven as the server does."""

    @initialize(kv_size=st.sampled_from([24, 40]), n_tree=st.integers(2, 4))
    def setup(self, kv_size, n_tree):
        self.mem, self.pc = make(kv_size, TREE[:n_tree])
        self.req = {}   # seq -> [tokens it holds at [0, len), lock handle (None: no lock), tokens the lock keeps]

    def idle(self):
        return len(self.req) < len(REQS)

    def busy(self):
        return bool(self.req)

    def _lock(self, r, tokens, n):
        """Lock tokens[:n]; the part of it the tree holds now must stay while the lock is held."""
        handle = self.pc.lock(tokens, n)
        assert isinstance(handle, int) and all(handle != h for _, h, _ in self.req.values())
        self.req[r][1:] = [handle, list(tokens[:min(n, in_tree(self.pc, tokens))])]

    def _finish(self, r, cache):
        toks, handle, _ = self.req.pop(r)
        if handle is not None:
            self.pc.unlock(handle)
        if cache and toks:
            new = self.pc.insert(toks, r, len(toks))
            assert 0 <= new <= len(toks)
            if new:
                assert in_tree(self.pc, toks) == len(toks)
        self.mem.seq_rm(r, -1, -1)

    def _compute(self, r, more):
        toks = self.req[r][0]
        try:
            decode(self.mem, more, r, len(toks))
        except NoKVSlotError:
            self.pc.evict(len(more))
            try:
                decode(self.mem, more, r, len(toks))
            except NoKVSlotError:
                self._finish(r, cache=False)  # no room: the request gives up
                return
        self.req[r][0] = toks + list(more)

    @precondition(idle)
    @rule(prompt=PROMPTS)
    def start(self, prompt):
        r = min(set(REQS) - set(self.req))
        mem, pc = self.mem, self.pc
        n, src = pc.lookup(prompt, len(prompt) - 1)   # the last prompt token is always computed
        assert 0 <= n <= len(prompt) - 1
        assert n == in_tree(pc, prompt[:len(prompt) - 1])  # no window: everything cached is reusable
        self.req[r] = [list(prompt[:n]), None, []]
        if n:
            assert src in pc.seq_ids and held(mem, src).items() >= dict(enumerate(prompt[:n])).items()
            mem.seq_cp(src, r, 0, n)
            self._lock(r, prompt, n)
        self._compute(r, prompt[n:])

    @precondition(busy)
    @rule(data=st.data(), more=st.lists(st.integers(0, 2), min_size=1, max_size=3))
    def generate(self, data, more):
        self._compute(data.draw(st.sampled_from(sorted(self.req))), more)

    @precondition(busy)
    @rule(data=st.data())
    def cache_and_relock(self, data):
        """The server's _cache: the request's tokens so far go to the tree and stay locked."""
        r = data.draw(st.sampled_from(sorted(self.req)))
        toks, handle, _ = self.req[r]
        self.pc.insert(toks, r, len(toks))
        if handle is not None:
            self.pc.unlock(handle)
        self._lock(r, toks, len(toks))

    @precondition(busy)
    @rule(data=st.data(), cache=st.sampled_from([True, True, True, False]))
    def finish(self, data, cache):
        self._finish(data.draw(st.sampled_from(sorted(self.req))), cache)

    @rule(n=st.integers(1, 30))
    def evict(self, n):
        used = self.mem.n_used
        freed = self.pc.evict(n)
        assert freed == used - self.mem.n_used and freed >= 0
        if freed < n:  # everything unlocked was trimmed: another evict finds nothing to trim
            lv = leaves(self.pc)
            assert self.pc.evict(1) == 0 and leaves(self.pc) == lv
        for _, _, kept in self.req.values():  # what a lock keeps is still in the tree
            assert in_tree(self.pc, kept) == len(kept)

    @rule(kind=st.sampled_from(range(12)))
    def wipe(self, kind):
        """Rarely: clear the tree (kind 0), or end every request and clear (kind 1)."""
        if kind == 1:
            for r in list(self.req):
                self._finish(r, cache=False)
        if kind > 1:
            return
        self.pc.clear()
        assert not leaves(self.pc) and self.pc.n_prompts == 0
        for r in self.req:  # the locked nodes went with the tree (the handle stays the request's, as in the engine)
            self.req[r][2] = []
        assert self.mem.n_used == sum(1 for p, s in self.mem.cells() if p >= 0 and s & set(REQS))
        if kind == 1:
            assert self.mem.n_used == 0

    @invariant()
    def tree_and_requests(self):
        if not hasattr(self, "pc"):
            return
        mem, pc = self.mem, self.pc
        check_leaves(mem, pc)  # each leaf holds exactly [0, len(path)) with the path's tokens
        for r, (toks, _, _) in self.req.items():
            assert holds_path(mem, r, toks)
        for r in set(REQS) - set(self.req):
            assert mem.seq_pos_max(r) == -1
        cells = [(p, s) for p, s in mem.cells() if p >= 0]
        assert mem.n_used == len(cells)
        assert all(s for _, s in cells)                                      # no cell used by no-one
        assert set().union(*(s for _, s in cells)) <= set(REQS) | set(pc.seq_ids)
        tree = set(pc.seq_ids)
        only = sum(1 for _, s in cells if s <= tree)
        n, b = mem.held_only_by(pc.seq_ids)
        assert n == only and b == n * (sum(mem.breakdown().values()) // mem.kv_size)
        # every token of every node is in a cell of the tree's sequences (at least once)
        node_tokens, stack = 0, [pc.root]
        while stack:
            node = stack.pop()
            node_tokens += len(node.tokens)
            stack.extend(node.children.values())
        assert sum(1 for _, s in cells if s & tree) >= node_tokens

    def teardown(self):
        if hasattr(self, "pc"):
            self.wipe(1)


TestPrefixMachine = PrefixMachine.TestCase
TestPrefixMachine.settings = settings(max_examples=50, stateful_step_count=30, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


# ---- match / commit: a lookup has no side effect, a hit counts when it commits ------------------
def snapshot(pc):
    """Everything a lookup could change: the leaves, every node's run, use time and lock count,
    the evictable set and the counters."""
    nodes = sorted((n.start, n.tokens.tolist(), n.last_use, n.lock, n.seq) for n in pc.nodes())
    return (sorted(pc.leaves()), nodes, sorted(n.start for n in pc.evictable()),
            (pc.lookups, pc.hits, pc.tokens_reused), pc.n_prompts)


def test_match_has_no_side_effects_and_commit_counts_it():
    mem, pc = two_branches()
    before, cells = snapshot(pc), mem.cells()
    for prompt in (A + [99], B, A[:3], [7, 7], []):
        pc.match(prompt, len(prompt))
    assert snapshot(pc) == before and mem.cells() == cells
    m = pc.match(B + [1], 9)
    assert m.n == 8 and holds_path(mem, m.seq, B) and m.leaf.seq == m.seq and m.node is m.path[-1]
    pc.commit(m)
    assert (pc.lookups, pc.hits, pc.tokens_reused) == (before[3][0] + 1, before[3][1] + 1, before[3][2] + 8)
    assert all(n.last_use == pc._clock for n in m.path + (m.leaf,))
    miss = pc.match([5, 5], 2)
    assert miss.n == 0 and miss.seq is None and miss.node is None
    pc.commit(miss)                      # a miss is a lookup, not a hit
    assert (pc.lookups, pc.hits) == (before[3][0] + 2, before[3][1] + 1)
    assert pc.lookup(A, 10) == (10, next(s for s, p in pc.leaves() if p == A))  # match + commit at once
    assert pc.lookups == before[3][0] + 3


# ---- lock counts -------------------------------------------------------------------------------------
def test_lock_counts_are_copied_on_split_and_released_through_both_halves():
    mem, pc = make()
    decode(mem, A, 0)
    pc.insert(A, 0, 10)
    mem.seq_rm(0, -1, -1)
    (node,) = pc.root.children.values()
    h1, h2 = pc.lock(A, 3), pc.lock(A, 10)  # both name A's one node, whole
    assert node.lock == 2 and not pc.evictable()
    decode(mem, B, 1)
    pc.insert(B, 1, 8)                   # splits A's node after 5 tokens
    mem.seq_rm(1, -1, -1)
    head = pc.root.children[1]
    tail, branch = head.children[6], head.children[20]
    assert tail is node and tail.parent is head
    assert (head.lock, tail.lock, branch.lock) == (2, 2, 0)
    assert pc.evictable() == {branch}
    pc.unlock(h1)
    assert (head.lock, tail.lock) == (1, 1) and pc.evictable() == {branch}
    pc.unlock(h1)                        # twice: a no-op
    pc.unlock(h2)
    assert (head.lock, tail.lock) == (0, 0) and pc.evictable() == {tail, branch}
    h3 = pc.lock(B + [1], 9)             # the lock of a longer path than the tree holds: B's nodes
    assert (head.lock, tail.lock, branch.lock) == (1, 0, 1) and pc.evictable() == {tail}
    pc.clear()                           # the locks go with the tree; the handle is a no-op after
    pc.unlock(h3)
    assert not pc.evictable() and pc.n_prompts == 0


# ---- eviction order and trimming -----------------------------------------------------------------------
def test_eviction_follows_last_use():
    mem, pc = make(kv_size=64)
    prompts = [[k] * 4 for k in (1, 2, 3, 4)]
    for p in prompts:
        decode(mem, p, 0)
        pc.insert(p, 0, 4)
        mem.seq_rm(0, -1, -1)
    for k in (3, 1, 4, 2):               # use order: 3 is the least recent, 2 the most
        pc.lookup([k] * 4, 4)
    gone = []
    for _ in range(4):
        before = {p[0] for _, p in pc.leaves()}
        assert pc.evict(4) == 4
        gone += sorted(before - {p[0] for _, p in pc.leaves()})
    assert gone == [3, 1, 4, 2] and mem.n_used == 0


def test_evict_trims_tail_first_and_stays_on_the_leaf_it_began():
    mem, pc = make()
    X, Y = list(range(1, 9)), [50] * 5
    for p in (X, Y):
        decode(mem, p, 0)
        pc.insert(p, 0, len(p))
        mem.seq_rm(0, -1, -1)
    pc.lookup(Y, 5)                      # X is the least recently used
    sx = next(s for s, p in pc.leaves() if p == X)
    for k, left in ((3, 5), (1, 4), (2, 2)):
        assert pc.evict(k) == k
        assert dict(pc.leaves())[sx] == X[:left] and holds_path(mem, sx, X[:left])
    assert pc.evict(3) == 3              # X's last 2, then Y's last one
    assert leaves(pc) == {next(iter(leaves(pc))): Y[:4]} and mem.n_used == 4


def test_source_finds_another_leaf_when_the_matched_one_was_evicted():
    """A match ending on an inner node takes the most recently used way down to a leaf; evicting
    for room (the match's path locked) may take that leaf whole and free its sequence: source()
    then names another leaf below the locked node, which holds the same prefix."""
    mem, pc = make(kv_size=64, seq_ids=(4, 5, 6, 7))
    C = A[:7] + [30]
    for p, seq in ((A, 0), (B, 1), (C, 2)):
        decode(mem, p, seq)
    pc.insert(A, 0, 10)
    pc.insert(B, 1, 8)                   # [1..5] -> [6..10] | [20, 21, 22]
    pc.insert(C, 2, 8)                   # [1..5] -> [6, 7] -> [8, 9, 10] | [30];  [20, 21, 22]
    for s in (0, 1, 2):
        mem.seq_rm(s, -1, -1)
    hc = pc.lock(C, 8)                   # a request runs on C
    pc.lookup(A, 10)
    pc.lookup(B, 8)
    pc.insert(A[:6], 3, 6)               # ends inside [6, 7]: marks it used, not [8, 9, 10]
    m = pc.match(A[:5] + [99], 6)
    sa = next(s for s, p in pc.leaves() if p == A)
    assert m.n == 5 and m.seq == sa      # via [6, 7] (the most recent) to [8, 9, 10]
    h = pc.lock_match(m)
    assert pc.evict(3) == 3 and sa not in dict(pc.leaves())  # A's leaf was the least recently used
    m2 = pc.source(m)
    assert m2.n == 5 and m2.seq == next(s for s, p in pc.leaves() if p == C)
    assert holds_path(mem, m2.seq, C)
    assert pc.source(m2) is m2           # its sequence still holds the prefix: the same match
    pc.unlock(h)
    pc.unlock(hc)


# ---- the evictable set against a brute-force recomputation ----------------------------------------------
def path_of(node):
    out = []
    while node.parent is not None:
        out[:0] = node.tokens.tolist()
        node = node.parent
    return out


class LockMachine(RuleBasedStateMachine):
    """Inserts, lookups, locks, unlocks, evictions and clears in any order. After each step the lock
    count of every node is recomputed from the live locks' token paths (a lock holds every node
    whose whole path is a prefix of the path it locked), the evictable set from those counts, and
    both must equal what the tree keeps up to date; every evictable leaf has its entry on the heap;
    every cached token is one used cell. An eviction takes the least recently used leaves first."""

    @initialize(n_tree=st.integers(2, 4))
    def setup(self, n_tree):
        self.mem, self.pc = make(48, TREE[:n_tree])
        self.live = {}   # handle -> the token path it locked
        self.dead = []   # handles from before a clear, and released ones

    def _walk_end(self, tokens, n):
        last = None
        for node, _ in self.pc._walk(np.asarray(tokens, dtype=np.int64), n):
            last = node
        return [] if last is None else path_of(last)

    @rule(prompt=PROMPTS)
    def insert(self, prompt):
        try:
            decode(self.mem, prompt, 0)
        except NoKVSlotError:
            self.pc.evict(len(prompt))
            try:
                decode(self.mem, prompt, 0)
            except NoKVSlotError:
                return
        new = self.pc.insert(prompt, 0, len(prompt))
        assert 0 <= new <= len(prompt)
        self.mem.seq_rm(0, -1, -1)

    @rule(prompt=PROMPTS, commit=st.booleans())
    def lookup(self, prompt, commit):
        before, cells = snapshot(self.pc), self.mem.cells()
        m = self.pc.match(prompt, len(prompt))
        assert snapshot(self.pc) == before and self.mem.cells() == cells
        assert m.n == in_tree(self.pc, prompt)
        if commit:
            self.pc.commit(m)

    @rule(prompt=PROMPTS, data=st.data())
    def lock(self, prompt, data):
        n = data.draw(st.integers(0, len(prompt)))
        locked = self._walk_end(prompt, n)
        h = self.pc.lock(prompt, n)
        assert h not in self.live and h not in self.dead
        self.live[h] = locked

    @precondition(lambda self: self.live or self.dead)
    @rule(data=st.data())
    def unlock(self, data):
        h = data.draw(st.sampled_from(sorted(self.live) + self.dead))
        self.pc.unlock(h)
        if h in self.live:
            del self.live[h]
            self.dead.append(h)

    @rule(k=st.integers(0, 20))
    def evict(self, k):
        pc, mem = self.pc, self.mem
        before = {n.seq: (path_of(n), n.last_use) for n in pc.evictable()}
        tokens0 = sum(len(n.tokens) for n in pc.nodes())
        freed = pc.evict(k)
        assert freed == tokens0 - sum(len(n.tokens) for n in pc.nodes())  # a trimmed token is a freed cell
        assert freed <= k and (freed == k or not pc.evictable())
        after = dict(pc.leaves())
        trimmed = {s for s, (p, _) in before.items() if after.get(s) != p}
        kept = set(before) - trimmed
        if trimmed and kept:  # least recently used first
            assert max(before[s][1] for s in trimmed) <= min(before[s][1] for s in kept)

    @rule(kind=st.sampled_from(range(10)))
    def clear(self, kind):
        if kind:
            return
        self.pc.clear()
        self.dead += list(self.live)
        self.live = {}

    @invariant()
    def counts_and_evictable_set(self):
        if not hasattr(self, "pc"):
            return
        pc, mem = self.pc, self.mem
        nodes = list(pc.nodes())
        for node in nodes:
            p = path_of(node)
            want = sum(1 for L in self.live.values() if len(p) <= len(L) and L[:len(p)] == p)
            assert node.lock == want, (p, node.lock, want)
        brute = {n for n in nodes if n.seq is not None and not any(
            L[:len(path_of(n))] == path_of(n) for L in self.live.values())}
        assert pc.evictable() == brute
        heap = set(map(id, pc._heap))
        for n in brute:
            assert n.entry is not None and id(n.entry) in heap and n.entry[0] == n.last_use
        assert {n.seq: n for n in nodes if n.seq is not None} == pc._owner
        for L in self.live.values():   # what a lock holds stays cached
            assert in_tree(pc, L) == len(L)
        check_leaves(mem, pc)
        assert mem.n_used == sum(len(n.tokens) for n in nodes)  # a shared prefix is stored once


TestLockMachine = LockMachine.TestCase
TestLockMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
