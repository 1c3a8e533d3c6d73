"""The host-RAM tier under the prefix cache (llama-server's --cache-ram): sequence states kept in RAM.

An entry is the state of one sequence holding exactly the positions [0, n) of some tokens: the
versioned, fingerprinted blob of Context.state_seq_get_data (a KV cache's cells, a recurrent
memory's state, or both for a hybrid). Entries come from two places:

    the cells       a prefix the radix tree evicts from the cells is kept here first (KV models)
    checkpoints     a recurrent or hybrid model's state at chosen positions of a prompt (a state
                    cannot be cut back, so only a state saved at exactly a position gives that
                    position again)

and go back on a hit, restored into a sequence by state_seq_set_data when that is cheaper than
computing its tokens (RestoreCost): a recurrent state only at exactly its position (match: the
deepest entry at or below a new prompt's shared prefix), a KV cache's cells cut back to any
shorter prefix (longest: the entry sharing most with the prompt, its tail then removed).

The entries are nodes of a token trie: a lookup walks the prompt once, comparing one vectorised run
per node, and keeps the deepest node with an entry. Within the byte budget, the least recently used
entries are dropped first.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from llamax.serving.prefix_cache import common_prefix, tokens_array

MIB = 1 << 20
DEFAULT_MIB = 8192    # llama-server's --cache-ram default


def budget_bytes(cache_ram: int | None) -> int:
    """The tier's byte budget from a cache_ram in MiB: None is llama-server's default (8192 MiB),
    0 turns the tier off, -1 is no limit.

    Raises:
        ValueError: cache_ram < -1. TypeError: not an integer."""
    if cache_ram is None:
        return DEFAULT_MIB * MIB
    if isinstance(cache_ram, bool) or not isinstance(cache_ram, (int, np.integer)):
        raise TypeError(f"cache_ram = {cache_ram!r}: MiB as an int (0: off, -1: no limit)")
    if cache_ram < -1:
        raise ValueError(f"cache_ram = {cache_ram}: MiB >= 0, or -1 for no limit")
    return 1 << 62 if cache_ram == -1 else int(cache_ram) * MIB


@dataclasses.dataclass(eq=False)
class Entry:
    """One kept state: its n tokens' blob and the node it hangs on."""
    n: int
    data: bytes
    node: _Node


class _Node:
    __slots__ = ("tokens", "start", "parent", "children", "entry")

    def __init__(self, tokens: np.ndarray, start: int, parent: _Node | None) -> None:
        self.tokens = tokens
        self.start = start
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.entry: Entry | None = None

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@dataclasses.dataclass(frozen=True)
class TierStats:
    """entries / bytes held, the budget, and the counters: states stored, dropped for room, the
    restores and the prompt tokens they gave."""
    entries: int
    bytes: int
    budget: int
    stored: int
    evicted: int
    restores: int
    tokens_restored: int


class HostTier:
    """Sequence states in RAM, keyed by their tokens, within a byte budget (LRU).

    Args:
        budget: bytes (budget_bytes(cache_ram)); 0 keeps nothing.
    """

    def __init__(self, budget: int) -> None:
        self.budget = int(budget)
        self.cost = RestoreCost()
        self.nbytes = 0
        self.stored = self.evicted = self.restores = self.tokens_restored = 0
        self._root = _Node(tokens_array([]), 0, None)
        self._lru: OrderedDict[Entry, None] = OrderedDict()   # least recently used first

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def enabled(self) -> bool:
        return self.budget > 0

    def stats(self) -> TierStats:
        return TierStats(len(self._lru), self.nbytes, self.budget, self.stored, self.evicted, self.restores,
                         self.tokens_restored)

    # ---- the trie -------------------------------------------------------------------------------
    def _split(self, node: _Node, j: int) -> _Node:
        """Cut node after its j-th token; returns the upper half (which takes node's place)."""
        upper = _Node(node.tokens[:j], node.start, node.parent)
        assert node.parent is not None
        node.parent.children[int(upper.tokens[0])] = upper
        node.tokens, node.start, node.parent = node.tokens[j:], node.start + j, upper
        upper.children[int(node.tokens[0])] = node
        return upper

    def _node_at(self, toks: np.ndarray) -> _Node:
        """The node ending exactly at len(toks) on toks' path, made (by splits and a new leaf) if absent."""
        node, i, n = self._root, 0, len(toks)
        while i < n:
            child = node.children.get(int(toks[i]))
            if child is None:
                leaf = _Node(toks[i:].copy(), i, node)
                node.children[int(toks[i])] = leaf
                return leaf
            k = common_prefix(child.tokens, toks, i)
            if k < len(child.tokens):
                child = self._split(child, k)
                if i + k == n:
                    return child
                leaf = _Node(toks[i + k:].copy(), i + k, child)
                child.children[int(toks[i + k])] = leaf
                return leaf
            node, i = child, i + k
        return node

    def _prune(self, node: _Node) -> None:
        """Drop node and its empty ancestors once they hold no entry and no child."""
        while node.parent is not None and node.entry is None and not node.children:
            parent = node.parent
            del parent.children[int(node.tokens[0])]
            node = parent

    # ---- lookups --------------------------------------------------------------------------------
    def covers(self, tokens: Sequence[int] | np.ndarray) -> bool:
        """Whether an entry holds these tokens or more (their state, or a longer one starting with them)."""
        toks = tokens_array(tokens)
        node, i = self._root, 0
        while i < len(toks):
            child = node.children.get(int(toks[i]))
            if child is None:
                return False
            k = common_prefix(child.tokens, toks, i)
            if i + k == len(toks):
                return True   # every node has an entry at or below it
            if k < len(child.tokens):
                return False
            node, i = child, i + k
        return node.entry is not None or bool(node.children)

    def has(self, tokens: Sequence[int] | np.ndarray) -> bool:
        """Whether an entry holds exactly these tokens."""
        e = self.match(tokens, len(tokens))
        return e is not None and e.n == len(tokens)

    def match(self, tokens: Sequence[int] | np.ndarray, limit: int) -> Entry | None:
        """The deepest entry whose tokens are a prefix of tokens[:limit] (None: none); no side effect."""
        toks = tokens_array(tokens)[:max(limit, 0)]
        node, i, best = self._root, 0, None
        while i < len(toks):
            child = node.children.get(int(toks[i]))
            if child is None:
                break
            k = common_prefix(child.tokens, toks, i)
            if k < len(child.tokens):
                break
            node, i = child, i + k
            if node.entry is not None:
                best = node.entry
        return best

    def longest(self, tokens: Sequence[int] | np.ndarray, limit: int) -> tuple[Entry | None, int]:
        """The entry sharing the longest prefix with tokens[:limit], and that length: for a state
        that can be cut back (a KV cache's cells), any entry below the deepest point the walk reaches
        gives it; the shortest such entry is chosen (the fewest bytes to restore). (None, 0): none."""
        toks = tokens_array(tokens)[:max(limit, 0)]
        node, i = self._root, 0
        while i < len(toks):
            child = node.children.get(int(toks[i]))
            if child is None:
                break
            k = common_prefix(child.tokens, toks, i)
            node, i = child, i + k
            if k < len(child.tokens):
                break
        if node is self._root:
            return None, 0
        best, stack = None, [node]
        while stack:
            nd = stack.pop()
            if nd.entry is not None and (best is None or nd.entry.n < best.n):
                best = nd.entry
            stack.extend(nd.children.values())
        return best, i

    def touch(self, e: Entry) -> None:
        """e was used: the last to be dropped."""
        if e in self._lru:
            self._lru.move_to_end(e)

    def restored(self, e: Entry, n: int) -> None:
        """Count a restore of e giving a request n tokens, and mark its use."""
        self.restores += 1
        self.tokens_restored += n
        self.touch(e)

    # ---- storing --------------------------------------------------------------------------------
    def put(self, tokens: Sequence[int] | np.ndarray, data: bytes) -> bool:
        """Keep data as the state of tokens (an entry for the same tokens is replaced), dropping the
        least recently used entries for room; False (nothing kept) when the budget cannot hold it."""
        if len(tokens) == 0 or len(data) > self.budget:
            return False
        toks = tokens_array(tokens).copy()
        node = self._node_at(toks)
        if node.entry is not None:
            self._drop(node.entry, prune=False)
        e = Entry(len(toks), bytes(data), node)
        node.entry = e
        self._lru[e] = None
        self.nbytes += len(e.data)
        self.stored += 1
        while self.nbytes > self.budget:
            self._drop(next(iter(self._lru)))
            self.evicted += 1
        return True

    def drop(self, e: Entry) -> None:
        """Forget e (a state found not to be what its tokens say); nothing when it is gone already."""
        if e in self._lru:
            self._drop(e)

    def _drop(self, e: Entry, prune: bool = True) -> None:
        del self._lru[e]
        self.nbytes -= len(e.data)
        e.node.entry = None
        if prune:
            self._prune(e.node)

    def clear(self) -> None:
        self._root = _Node(tokens_array([]), 0, None)
        self._lru.clear()
        self.nbytes = 0


class RestoreCost:
    """Whether restoring n tokens' state beats computing m tokens: the seconds per token of each,
    measured as they happen (exponential averages), restore assumed cheaper until both are seen.

    A KV blob is a copy of the cells (a memcpy per token), a recurrent state a fixed copy whatever
    its length: both are far below a forward pass per token on a CPU, but a tiny model with a long
    blob or a slow RAM may not be, so the engine decides by the figures it measured."""

    ALPHA = 0.25

    def __init__(self) -> None:
        self.restore_s_per_byte: float | None = None
        self.prefill_s_per_token: float | None = None

    @staticmethod
    def _avg(old: float | None, new: float, alpha: float) -> float:
        return new if old is None else old + alpha * (new - old)

    def saw_restore(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0:
            self.restore_s_per_byte = self._avg(self.restore_s_per_byte, seconds / nbytes, self.ALPHA)

    def saw_prefill(self, n_tokens: int, seconds: float) -> None:
        if n_tokens > 0:
            self.prefill_s_per_token = self._avg(self.prefill_s_per_token, seconds / n_tokens, self.ALPHA)

    def worth(self, nbytes: int, n_tokens_saved: int) -> bool:
        """Restoring a blob of nbytes saves computing n_tokens_saved tokens: is it cheaper?"""
        if n_tokens_saved <= 0:
            return False
        if self.restore_s_per_byte is None or self.prefill_s_per_token is None:
            return True
        return self.restore_s_per_byte * nbytes < self.prefill_s_per_token * n_tokens_saved

