"""The prefix cache: a radix tree over token ids whose nodes stand for cells of a unified cache.

Every leaf owns one of the cache's sequence ids and that sequence holds exactly the positions
[0, leaf.end) of the leaf's path, the path's tokens in its cells. An inner node has no sequence
of its own: its cells are those every leaf below it holds (the cells' sequence sets are shared,
as seq_cp shares them, so a prefix is stored once however many prompts start with it).

    lookup(tokens)       the longest cached prefix and a leaf sequence holding it; the caller
                         seq_cp's [0, n) of that sequence into its own: nothing copied or recomputed
    insert(tokens, src)  src holds [0, n) with tokens[:n]; the new part becomes a leaf (seq_cp
                         into a free tree sequence, or the extended leaf's own one)
    evict(n)             unreferenced leaves, least recently used first, are trimmed from their
                         tail until n cells are free or nothing is left to trim
    lock / unlock        a running request's prefix: the nodes on its path are not trimmed while
                         it runs (the locks are token paths, walked on the tree as it is when
                         evicting, so splits and inserts never leave a count behind)
    borrow / give_back   a free tree sequence as scratch space (a prefix exported or imported whole)

On a cache with a sliding window (Gemma 3's iSWA without swa_full), a leaf's old SWA cells are
reused by the slot finder once the window hides them from their only sequence; lookup then reuses
a prefix only as far as memory.reusable_prefix says the leaf still holds what the next token sees.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np


class Node:
    """A run of tokens at positions [start, start + len(tokens)) below its parent."""

    __slots__ = ("tokens", "start", "parent", "children", "seq", "last_use")

    def __init__(self, tokens: list[int], start: int, parent: Node | None) -> None:
        self.tokens = tokens
        self.start = start
        self.parent = parent
        self.children: dict[int, Node] = {}
        self.seq: int | None = None  # a leaf's sequence id (None for the root and inner nodes)
        self.last_use = 0

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    def split(self, j: int) -> Node:
        """Keep tokens[:j] here; the rest, with the children and the sequence, goes to a new child."""
        tail = Node(self.tokens[j:], self.start + j, self)
        tail.children, tail.seq, tail.last_use = self.children, self.seq, self.last_use
        for c in tail.children.values():
            c.parent = tail
        self.tokens = self.tokens[:j]
        self.children = {tail.tokens[0]: tail}
        self.seq = None
        return tail


def common_prefix(a: Sequence[int], b: Sequence[int], i: int = 0) -> int:
    """Length of the common prefix of a and b[i:] (one vectorised comparison, no per-token loop)."""
    n = min(len(a), len(b) - i)
    if n <= 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n], dtype=np.int64) != np.asarray(b[i:i + n], dtype=np.int64))
    return int(diff[0]) if diff.size else n


class PrefixCache:
    """The radix tree of one unified memory and the sequence ids it may give its leaves.

    Args:
        memory: the context's memory (KVCache or KVCacheISWA, one stream).
        seq_ids: the sequence ids reserved for the tree's leaves (one cached prompt each).
    """

    def __init__(self, memory, seq_ids: Sequence[int]) -> None:
        self.mem = memory
        self.seq_ids = tuple(seq_ids)
        self._free = list(reversed(self.seq_ids))
        self.root = Node([], 0, None)
        self._clock = 0
        self._locks: dict[int, tuple[list[int], int]] = {}
        self._next_lock = 0
        self.lookups = self.hits = self.tokens_reused = 0

    # ---- views ---------------------------------------------------------------------------------
    def leaves(self) -> Iterator[tuple[int, list[int]]]:
        """(sequence id, path tokens) of every leaf."""
        stack: list[tuple[Node, list[int]]] = [(self.root, [])]
        while stack:
            node, path = stack.pop()
            path = path + node.tokens
            if node.seq is not None:
                yield node.seq, path
            stack.extend((c, path) for c in node.children.values())

    @property
    def n_prompts(self) -> int:
        """Cached prompts (leaves)."""
        return len(self.seq_ids) - len(self._free)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    # ---- lookup --------------------------------------------------------------------------------
    def _walk(self, tokens: Sequence[int], n: int) -> Iterator[tuple[Node, int]]:
        """(node, matched tokens of it) along the path of tokens[:n], while they match."""
        node, i, n = self.root, 0, min(n, len(tokens))
        while i < n:
            child = node.children.get(tokens[i])
            if child is None:
                return
            j = common_prefix(child.tokens, tokens[:n], i)
            yield child, j
            if j < len(child.tokens):
                return
            node, i = child, i + j

    def lookup(self, tokens: Sequence[int], limit: int) -> tuple[int, int | None]:
        """(n, seq): the longest prefix of tokens[:limit] the cache can give, and a leaf sequence
        holding positions [0, n) (None when n == 0). Counts a lookup (and a hit)."""
        self.lookups += 1
        now = self._tick()
        last, n = None, 0
        for node, j in self._walk(tokens, limit):
            node.last_use = now
            last, n = node, node.start + j
        if last is None:
            return 0, None
        leaf = last
        while leaf.seq is None:  # the most recently used way down to a leaf
            leaf = max(leaf.children.values(), key=lambda c: c.last_use)
        leaf.last_use = now
        n = self.mem.reusable_prefix(leaf.seq, n)
        if n <= 0:
            return 0, None
        self.hits += 1
        self.tokens_reused += n
        return n, leaf.seq

    def match_len(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of tokens the tree holds (no counts, no use times)."""
        n = 0
        for node, j in self._walk(tokens, len(tokens)):
            n = node.start + j
        return n

    def lock(self, tokens: Sequence[int], n: int) -> int:
        """Keep the nodes holding tokens[:n] from being trimmed (a running request's prefix);
        returns the handle for unlock."""
        self._next_lock += 1
        self._locks[self._next_lock] = (list(tokens[:n]), n)
        return self._next_lock

    def unlock(self, handle: int) -> None:
        self._locks.pop(handle, None)

    def _locked(self) -> set[int]:
        """ids of the nodes on a locked path."""
        out: set[int] = set()
        for tokens, n in self._locks.values():
            out.update(id(node) for node, _ in self._walk(tokens, n))
        return out

    # ---- insert --------------------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], src: int, n: int) -> int:
        """Cache tokens[:n], whose cells sequence src holds at positions [0, n). Returns the tokens
        that were new to the tree (0 when it already held them or has no sequence id left)."""
        tokens = list(tokens[:n])
        if not tokens:
            return 0
        while not self._free and self._needs_seq(tokens) and self._evict_one():
            pass
        now = self._tick()
        node, i = self.root, 0
        while i < n:
            node.last_use = now
            child = node.children.get(tokens[i])
            if child is None:
                break
            j = common_prefix(child.tokens, tokens, i)
            if j == len(child.tokens):
                node, i = child, i + j
                continue
            if i + j == n:  # tokens end inside the child's run: nothing new
                child.last_use = now
                return 0
            child.split(j)
            node, i = child, i + j
            break
        if i == n:
            node.last_use = now
            return 0
        leaf = Node(tokens[i:], i, node)
        leaf.last_use = now
        if node.seq is not None:  # extend a leaf: its sequence takes the new positions and moves down
            seq, node.seq = node.seq, None
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
        leaf.seq = seq
        node.children[tokens[i]] = leaf
        return n - i

    def _needs_seq(self, tokens: list[int]) -> bool:
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
    def _evictable(self) -> list[Node]:
        locked = self._locked()
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if node.seq is not None and id(node) not in locked:
                out.append(node)
            stack.extend(node.children.values())
        return out

    def _trim(self, leaf: Node, k: int) -> None:
        """Forget the last k tokens of a leaf (all of them: the leaf goes, its parent may become one)."""
        seq, parent = leaf.seq, leaf.parent
        assert seq is not None and parent is not None, "only a leaf below the root is trimmed"
        k = min(k, len(leaf.tokens))
        self.mem.seq_rm(seq, leaf.end - k, -1)
        if k < len(leaf.tokens):
            leaf.tokens = leaf.tokens[:len(leaf.tokens) - k]
            return
        del parent.children[leaf.tokens[0]]
        leaf.seq = None
        if parent is not self.root and not parent.children:
            parent.seq = seq  # seq still holds exactly [0, parent.end)
        else:
            self.mem.seq_rm(seq, -1, -1)
            self._free.append(seq)

    def _evict_one(self) -> bool:
        """Drop the least recently used unreferenced leaf, freeing its sequence id."""
        cand = self._evictable()
        if not cand:
            return False
        leaf = min(cand, key=lambda c: c.last_use)
        locked = self._locked()
        while leaf.seq is not None:
            parent = leaf.parent
            assert parent is not None, "the root holds no sequence"
            self._trim(leaf, len(leaf.tokens))
            if parent.seq is None or id(parent) in locked:
                break
            leaf = parent  # the parent became a leaf holding the same sequence: keep going
        return True

    def evict(self, n_cells: int) -> int:
        """Trim unreferenced leaves, least recently used first and tail first, until n_cells cells
        are free that were not, or nothing is left to trim. Returns the cells freed."""
        used0 = self.mem.n_used
        freed = 0
        while freed < n_cells:
            cand = self._evictable()
            if not cand:
                break
            leaf = min(cand, key=lambda c: c.last_use)
            self._trim(leaf, n_cells - freed)
            freed = used0 - self.mem.n_used
        return max(freed, 0)

    def clear(self) -> None:
        """Forget every cached prefix (their cells are freed unless a request holds them)."""
        for s in self.seq_ids:
            self.mem.seq_rm(s, -1, -1)
        self._free = list(reversed(self.seq_ids))
        self.root = Node([], 0, None)
