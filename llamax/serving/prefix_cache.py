"""The prefix cache: a radix tree over token ids whose nodes stand for cells of a unified cache.

Every leaf owns one of the cache's sequence ids and that sequence holds exactly the positions
[0, leaf.end) of the leaf's path, the path's tokens in its cells. An inner node has no sequence
of its own: its cells are those every leaf below it holds (the cells' sequence sets are shared,
as seq_cp shares them, so a prefix is stored once however many prompts start with it).

    match(tokens, limit) the longest cached prefix and a leaf sequence holding it, with no side
                         effect; the caller seq_cp's [0, n) of that sequence into its own (nothing
                         copied or recomputed), then commit(match) counts it and marks its use
    insert(tokens, src)  src holds [0, n) with tokens[:n]; the new part becomes a leaf (seq_cp
                         into a free tree sequence, or the extended leaf's own one)
    evict(n)             unlocked leaves, least recently used first, are trimmed from their tail
                         until n cells are free or nothing is left to trim (on_evict, when set,
                         sees each leaf's path and sequence before it is trimmed: the host-RAM tier)
    lock / unlock        a running request's prefix: the nodes on its path are not trimmed while
                         it runs
    borrow / give_back   a free tree sequence as scratch space (a prefix exported or imported whole)

Locks and eviction are kept as SGLang's radix cache keeps them, with llamax's sequences:

    node.lock            how many locks hold the node. A lock on the path of tokens[:n] adds one to
                         the deepest node holding a token of it and to every node above it; its
                         handle names that node, and unlock walks the same way up. A split copies
                         the count to the new upper half, and the handle's node stays the lower one,
                         so the unlock walks both.
    evictable            the leaves that no lock holds (each owns a sequence), updated in O(1) when a
                         lock count crosses zero or a leaf appears, goes or moves up to its parent
    heap                 (last use, node) of the evictable leaves; an entry is stale once its node
                         left the set or was used again (a new entry is pushed then), and stale
                         entries are dropped when they reach the top: the least recently used
                         evictable leaf in O(log n) amortized

    node tokens          token ids as int64 arrays: a match compares one run per node, vectorised

Costs (d: the depth of a path, n: cached leaves): match, insert, lock, unlock O(d) node steps plus
the token comparisons; evicting k leaves O(k log n) plus the memory's seq_rm of each.

On a cache with a sliding window (Gemma 3's iSWA without swa_full), a leaf's old SWA cells are
reused by the slot finder once the window hides them from their only sequence; match then reuses
a prefix only as far as memory.reusable_prefix says the leaf still holds what the next token sees.
"""
from __future__ import annotations

import dataclasses
import heapq
import itertools
from collections.abc import Callable, Iterator, Sequence

import numpy as np


def tokens_array(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """tokens as an int64 array (no copy when they are one already)."""
    return np.asarray(tokens, dtype=np.int64)


class Node:
    """A run of tokens at positions [start, start + len(tokens)) below its parent.

    seq: a leaf's sequence id (None for the root and inner nodes); lock: how many locks hold it;
    last_use: the tree's clock at its last use; entry: its current heap entry while evictable."""

    __slots__ = ("tokens", "start", "parent", "children", "seq", "last_use", "lock", "entry")

    def __init__(self, tokens: np.ndarray, start: int, parent: Node | None) -> None:
        self.tokens = tokens
        self.start = start
        self.parent = parent
        self.children: dict[int, Node] = {}
        self.seq: int | None = None
        self.last_use = 0
        self.lock = 0
        self.entry: tuple[int, int, Node] | None = None

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def key(self) -> int:
        """Its first token: the key of it in its parent's children."""
        return int(self.tokens[0])


def common_prefix(a: Sequence[int] | np.ndarray, b: Sequence[int] | np.ndarray, i: int = 0) -> int:
    """Length of the common prefix of a and b[i:] (one vectorised comparison, no per-token loop)."""
    n = min(len(a), len(b) - i)
    if n <= 0:
        return 0
    diff = np.flatnonzero(tokens_array(a[:n]) != tokens_array(b[i:i + n]))
    return int(diff[0]) if diff.size else n


@dataclasses.dataclass(frozen=True)
class Match:
    """What match() found: n tokens the cache can give, a leaf sequence seq holding positions
    [0, n) (None when n == 0), the nodes walked (the last one maybe only partly) and the leaf."""
    n: int
    seq: int | None
    path: tuple[Node, ...] = ()
    leaf: Node | None = None

    @property
    def node(self) -> Node | None:
        """The deepest node holding a token of [0, n) (None when n == 0): the one a lock names."""
        for node in reversed(self.path):
            if node.start < self.n:
                return node
        return None


NO_MATCH = Match(0, None)


class PrefixCache:
    """The radix tree of one unified memory and the sequence ids it may give its leaves.

    Args:
        memory: the context's memory (KVCache or KVCacheISWA, one stream).
        seq_ids: the sequence ids reserved for the tree's leaves (one cached prompt each).
    """

    def __init__(self, memory, seq_ids: Sequence[int]) -> None:
        self.mem = memory
        self.seq_ids = tuple(seq_ids)
        self.lookups = self.hits = self.tokens_reused = 0
        self.on_evict: Callable[[list[int], int], None] | None = None  # (path tokens, seq) before a leaf is trimmed
        self._clock = 0
        self._handles = itertools.count(1)
        self._pushes = itertools.count()
        self._reset()

    def _reset(self) -> None:
        self._free = list(reversed(self.seq_ids))
        self.root = Node(tokens_array([]), 0, None)
        self._owner: dict[int, Node] = {}          # sequence id -> the leaf owning it
        self._locks: dict[int, Node] = {}          # lock handle -> the node it names
        self._evictable: set[Node] = set()
        self._heap: list[tuple[int, int, Node]] = []

    # ---- views ---------------------------------------------------------------------------------
    def leaves(self) -> Iterator[tuple[int, list[int]]]:
        """(sequence id, path tokens) of every leaf."""
        stack: list[tuple[Node, list[int]]] = [(self.root, [])]
        while stack:
            node, path = stack.pop()
            path = path + node.tokens.tolist()
            if node.seq is not None:
                yield node.seq, path
            stack.extend((c, path) for c in node.children.values())

    def nodes(self) -> Iterator[Node]:
        """Every node below the root."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def evictable(self) -> frozenset[Node]:
        """The leaves no lock holds (what evict may trim)."""
        return frozenset(self._evictable)

    @property
    def n_prompts(self) -> int:
        """Cached prompts (leaves)."""
        return len(self.seq_ids) - len(self._free)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    # ---- the evictable set and its heap --------------------------------------------------------
    def _push(self, node: Node) -> None:
        entry = (node.last_use, next(self._pushes), node)
        node.entry = entry
        heapq.heappush(self._heap, entry)
        if len(self._heap) > 2 * len(self._evictable) + 64:  # mostly stale: rebuild, O(1) amortized
            self._heap = [e for e in self._heap if e[2].entry is e and e[2] in self._evictable]
            heapq.heapify(self._heap)

    def _update(self, node: Node) -> None:
        """Put node in or out of the evictable set after its sequence or lock count changed."""
        if node.seq is not None and node.lock == 0:
            if node not in self._evictable:
                self._evictable.add(node)
                self._push(node)
        elif node in self._evictable:
            self._evictable.discard(node)
            node.entry = None

    def _touch(self, node: Node, now: int) -> None:
        node.last_use = now
        if node in self._evictable:
            self._push(node)

    def _lru(self) -> Node | None:
        """The least recently used evictable leaf (None when there is none); stale entries go."""
        heap = self._heap
        while heap:
            entry = heap[0]
            node = entry[2]
            if node.entry is entry and node in self._evictable:
                return node
            heapq.heappop(heap)
        return None

    # ---- lookup --------------------------------------------------------------------------------
    def _walk(self, tokens: np.ndarray, n: int) -> Iterator[tuple[Node, int]]:
        """(node, matched tokens of it) along the path of tokens[:n], while they match."""
        node, i, n = self.root, 0, min(n, len(tokens))
        while i < n:
            child = node.children.get(int(tokens[i]))
            if child is None:
                return
            j = common_prefix(child.tokens, tokens[:n], i)
            yield child, j
            if j < len(child.tokens):
                return
            node, i = child, i + j

    def match(self, tokens: Sequence[int] | np.ndarray, limit: int) -> Match:
        """The longest prefix of tokens[:limit] the cache can give and a leaf sequence holding
        positions [0, n): the most recently used leaf below the last node matched, and n no more
        than memory.reusable_prefix allows it. No side effect (commit counts and marks it)."""
        q = tokens_array(tokens)
        path, n = [], 0
        for node, j in self._walk(q, limit):
            path.append(node)
            n = node.start + j
        if not path:
            return NO_MATCH
        leaf = path[-1]
        while leaf.seq is None:  # the most recently used way down to a leaf
            leaf = max(leaf.children.values(), key=lambda c: c.last_use)
        assert leaf.seq is not None
        n = max(self.mem.reusable_prefix(leaf.seq, n), 0)
        return Match(n, leaf.seq if n else None, tuple(path), leaf)

    def source(self, m: Match) -> Match:
        """m again after the tree changed while m's path was locked (room made by evict, a borrow):
        the same when its leaf's sequence still holds the prefix (the leaf is there, trimmed from
        its tail or moved up into a locked parent), else another leaf below m's node."""
        if not m.n or (m.seq is not None and m.seq in self._owner):
            return m
        node = m.node
        assert node is not None and node.lock > 0, "source() of a match whose path is not locked"
        leaf = node
        while leaf.seq is None:
            leaf = max(leaf.children.values(), key=lambda c: c.last_use)
        assert leaf.seq is not None
        n = max(self.mem.reusable_prefix(leaf.seq, m.n), 0)
        return Match(n, leaf.seq if n else None, m.path, leaf)

    def commit(self, m: Match) -> None:
        """Count m as a lookup (and a hit, of m.n reused tokens, when it gives any) and mark its
        nodes and leaf used now."""
        self.lookups += 1
        now = self._tick()
        for node in m.path:
            self._touch(node, now)
        if m.leaf is not None:
            self._touch(m.leaf, now)
        if m.n:
            self.hits += 1
            self.tokens_reused += m.n

    def lookup(self, tokens: Sequence[int], limit: int) -> tuple[int, int | None]:
        """match() and commit() at once: (n, seq), counted as a lookup (and a hit)."""
        m = self.match(tokens, limit)
        self.commit(m)
        return m.n, m.seq

    def match_len(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of tokens the tree holds (no counts, no use times)."""
        n = 0
        for node, j in self._walk(tokens_array(tokens), len(tokens)):
            n = node.start + j
        return n

    # ---- locks ---------------------------------------------------------------------------------
    def _lock_node(self, node: Node | None) -> int:
        handle = next(self._handles)
        node = node or self.root
        self._locks[handle] = node
        while node.parent is not None:  # up to the root, which holds no cells
            node.lock += 1
            if node.lock == 1:
                self._update(node)
            node = node.parent
        return handle

    def lock(self, tokens: Sequence[int], n: int) -> int:
        """Keep the nodes holding tokens[:n] (as far as the tree holds them now) from being
        trimmed, whole; returns the handle for unlock. O(depth)."""
        last = None
        for node, _ in self._walk(tokens_array(tokens), n):
            last = node
        return self._lock_node(last)

    def lock_match(self, m: Match) -> int:
        """lock(tokens, m.n) for the tokens m was matched with (no walk)."""
        return self._lock_node(m.node)

    def unlock(self, handle: int) -> None:
        """Release a lock (a handle from before a clear() is forgotten already). O(depth)."""
        node = self._locks.pop(handle, None)
        while node is not None and node.parent is not None:
            node.lock -= 1
            assert node.lock >= 0, "a lock count below zero"
            if node.lock == 0:
                self._update(node)
            node = node.parent

    # ---- insert --------------------------------------------------------------------------------
    def _split(self, node: Node, j: int) -> Node:
        """Cut node after its first j tokens: a new node takes them in its place above it, with its
        lock count and use time; node keeps the rest, its children and its sequence (so a lock
        naming node still covers both halves). Returns the new upper node."""
        parent = node.parent
        assert parent is not None and 0 < j < len(node.tokens)
        head = Node(node.tokens[:j], node.start, parent)
        head.lock, head.last_use = node.lock, node.last_use
        parent.children[head.key] = head
        node.tokens, node.start, node.parent = node.tokens[j:], node.start + j, head
        head.children = {node.key: node}
        return head

    def _own(self, node: Node, seq: int) -> None:
        node.seq = seq
        self._owner[seq] = node
        self._update(node)

    def _disown(self, node: Node) -> int:
        seq = node.seq
        assert seq is not None
        node.seq = None
        del self._owner[seq]
        self._update(node)
        return seq

    def insert(self, tokens: Sequence[int], src: int, n: int) -> int:
        """Cache tokens[:n], whose cells sequence src holds at positions [0, n). Returns the tokens
        that were new to the tree (0 when it already held them or has no sequence id left)."""
        toks = tokens_array(tokens[:n]).copy()
        n = len(toks)
        if not n:
            return 0
        while not self._free and self._needs_seq(toks) and self._evict_one():
            pass
        now = self._tick()
        node, i = self.root, 0
        while i < n:
            self._touch(node, now)
            child = node.children.get(int(toks[i]))
            if child is None:
                break
            j = common_prefix(child.tokens, toks, i)
            if j == len(child.tokens):
                node, i = child, i + j
                continue
            if i + j == n:  # tokens end inside the child's run: nothing new
                self._touch(child, now)
                return 0
            node, i = self._split(child, j), i + j
            break
        if i == n:
            self._touch(node, now)
            return 0
        if node.seq is not None:  # extend a leaf: its sequence takes the new positions and moves down
            seq = self._disown(node)
            self.mem.seq_cp(src, seq, i, n)
        elif self._free:
            seq = self._free.pop()
            below = self._leaf_below(node) if i else None
            if below is not None and self.mem.reusable_prefix(below, i) == i:
                self.mem.seq_cp(below, seq, 0, i)  # the prefix the tree holds, not src's own copy of it
                self.mem.seq_cp(src, seq, i, n)
            else:
                self.mem.seq_cp(src, seq, 0, n)
        else:
            return 0
        leaf = Node(toks[i:], i, node)
        leaf.last_use = now
        node.children[leaf.key] = leaf
        self._own(leaf, seq)
        return n - i

    def _needs_seq(self, tokens: np.ndarray) -> bool:
        """True if inserting tokens would add a leaf that needs a sequence id of its own (not
        already held, not the extension of a leaf)."""
        node, i, n = self.root, 0, len(tokens)
        for child, j in self._walk(tokens, n):
            node, i = child, child.start + j
            if j < len(child.tokens):
                return i < n  # a split: a new branch, unless the tokens end inside the run
        return i < n and node.seq is None

    @staticmethod
    def _leaf_below(node: Node) -> int | None:
        """The sequence of some leaf below node (None for a childless root)."""
        while node.seq is None:
            if not node.children:
                return None
            node = next(iter(node.children.values()))
        return node.seq

    # ---- a scratch sequence ----------------------------------------------------------------------
    def borrow(self) -> int | None:
        """A free sequence id of the tree's, held out of use until give_back (a leaf is evicted
        for it when none is free); None when every id belongs to a locked leaf."""
        while not self._free and self._evict_one():
            pass
        return self._free.pop() if self._free else None

    def give_back(self, seq: int) -> None:
        """Return a borrowed id, its cells removed."""
        self.mem.seq_rm(seq, -1, -1)
        self._free.append(seq)

    # ---- eviction ------------------------------------------------------------------------------
    def _trim(self, leaf: Node, k: int) -> None:
        """Forget the last k tokens of an evictable leaf (all of them: the leaf goes, and its parent
        becomes a leaf with the same sequence when it has no other child)."""
        parent = leaf.parent
        assert leaf.seq is not None and leaf.lock == 0 and parent is not None, "only an unlocked leaf is trimmed"
        k = min(k, len(leaf.tokens))
        if self.on_evict is not None:
            self.on_evict(self._path(leaf), leaf.seq)
        self.mem.seq_rm(leaf.seq, leaf.end - k, -1)
        if k < len(leaf.tokens):
            leaf.tokens = leaf.tokens[:len(leaf.tokens) - k]
            return
        del parent.children[leaf.key]
        seq = self._disown(leaf)
        leaf.parent = None
        if parent is not self.root and not parent.children:
            self._own(parent, seq)  # seq still holds exactly [0, parent.end)
        else:
            self.mem.seq_rm(seq, -1, -1)
            self._free.append(seq)

    @staticmethod
    def _path(node: Node) -> list[int]:
        """The tokens of positions [0, node.end)."""
        runs = []
        while node.parent is not None:
            runs.append(node.tokens)
            node = node.parent
        return np.concatenate(runs[::-1]).tolist() if runs else []

    def _evict_one(self) -> bool:
        """Drop the least recently used evictable leaf, and the parents it leaves as unlocked
        leaves, until its sequence id is free or a locked node stops it."""
        leaf = self._lru()
        if leaf is None:
            return False
        while leaf.seq is not None:
            parent = leaf.parent
            assert parent is not None, "the root holds no sequence"
            self._trim(leaf, len(leaf.tokens))
            if parent.seq is None or parent.lock > 0:
                break
            leaf = parent  # the parent became a leaf holding the same sequence: keep going
        return True

    def evict(self, n_cells: int) -> int:
        """Trim evictable leaves, least recently used first and tail first, until n_cells cells
        are free that were not, or nothing is left to trim. Returns the cells freed (trimmed
        cells that a running request's sequence still holds are not freed). O(k log n) for k
        leaves trimmed, plus the memory's seq_rm."""
        used0 = self.mem.n_used
        freed = 0
        while freed < n_cells:
            leaf = self._lru()
            if leaf is None:
                break
            self._trim(leaf, n_cells - freed)
            freed = used0 - self.mem.n_used
        return max(freed, 0)

    def clear(self) -> None:
        """Forget every cached prefix and every lock (their cells are freed unless a request holds
        them; a handle from before is a no-op to unlock)."""
        for s in self.seq_ids:
            self.mem.seq_rm(s, -1, -1)
        self._reset()
