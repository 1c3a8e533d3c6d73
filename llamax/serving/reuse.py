"""Prefix reuse: how the Engine's slots get cells computed before, behind one small protocol.

The Engine calls a PrefixReuse and never asks which one it has (as vLLM's scheduler does not know
whether caching is on):

    pick(prompt, free, prefilling)   the free slot for a request, or None to let it wait a step
    lookup(seq, prompt, limit)       the cached prefix of prompt[:limit] for slot seq: a Hit, no
                                     side effect (nothing counted, copied, locked or marked used)
    lock(seq, hit) / unlock(seq)     hold the hit's cells for seq's request while room is made
                                     (and while it runs); a request that does not fit is unlocked
    attach(seq, hit)                 seq_cp the prefix into seq (the rest of seq dropped) and count
                                     the lookup, a hit when it gives tokens; returns the tokens
    take(seq)                        seq goes to a request bringing its own cells (a resumed one)
    note_prefilled(seq, tokens)      seq's prompt is in the cache: keep it for others now
    release(seq, tokens, cache=...)  seq's request ended: keep its cells (cache) or drop them
    evict(n_cells)                   free up to n_cells cells only the reuse holds; the cells freed
    stats()                          lookups, hits, tokens reused, cached cells / bytes / prompts
    kept(seq), save(seq), restore(seq, tokens), erase(seq)
                                     an idle slot's cache for /slots and slot save / restore / erase
    clear()                          drop every cached prefix
    export(...), import_(...)        a cached prefix as a state blob, to and from another Engine

The Engine admits a request as: lookup -> does it fit? -> lock -> evict for room -> attach (copy,
commit). Three implementations:

    RadixReuse   the radix tree over a unified cache (PrefixCache): finished prompts are leaves on
                 sequence ids of their own (n_parallel .. 255), shared by seq_cp with no copy
    SlotReuse    llama-server's cache_prompt: each slot keeps its last request's cells, a request
                 goes to the free slot whose cache shares the longest prefix with its prompt and
                 reuses it in place (one stream per slot, or 256 slots leaving no id for a tree)
    NoReuse      nothing is kept (prefix_cache=False): every prompt is computed
"""
from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from llamax.dtypes import LLAMA_MAX_SEQ
from llamax.errors import LlamaxError, StateError
from llamax.serving.prefix_cache import Match, PrefixCache, common_prefix

DEFER_MIN = 16  # wait for an in-flight prefill that would give this many more cached tokens


@dataclasses.dataclass(frozen=True)
class PrefixState:
    """A cached prefix handed from one Engine to another (export_prefix / import_prefix): its
    tokens and the versioned, fingerprinted state_seq_get_data blob of their cells."""
    tokens: list[int]
    data: bytes


@dataclasses.dataclass(frozen=True)
class Hit:
    """What lookup found for a slot: n prompt tokens the cache gives (0: none) and, for the tree,
    the match they come from."""
    n: int
    match: Match | None = None


@dataclasses.dataclass(frozen=True)
class ReuseStats:
    """The reuse's counters (engine.metrics()): lookups of admitted requests, hits among them and
    the prompt tokens they took from the cache; the cells (and K/V bytes) only the cache holds, and
    the cached prompts of a tree."""
    lookups: int
    hits: int
    tokens_reused: int
    cells_cached: int
    bytes_cached: int
    cached_prompts: int


class PrefixReuse(Protocol):
    """The prefix reuse the Engine calls (see the module docstring). Sequence ids are the slots'."""

    name: str                     # "tree", "slots" or "off" (Engine's repr)
    seq_ids: tuple[int, ...]      # the sequence ids it holds cells on besides the slots'

    @property
    def n_prompts(self) -> int: ...
    def pick(self, prompt: Sequence[int], free: Sequence[int], prefilling: Sequence[Sequence[int]]) -> int | None: ...
    def lookup(self, seq: int, prompt: Sequence[int], limit: int) -> Hit: ...
    def lock(self, seq: int, hit: Hit) -> None: ...
    def unlock(self, seq: int) -> None: ...
    def attach(self, seq: int, hit: Hit) -> int: ...
    def take(self, seq: int) -> None: ...
    def note_prefilled(self, seq: int, tokens: Sequence[int]) -> None: ...
    def release(self, seq: int, tokens: Sequence[int], *, cache: bool, shifted: bool) -> None: ...
    def evict(self, n_cells: int) -> int: ...
    def stats(self) -> ReuseStats: ...
    def kept(self, seq: int) -> list[int]: ...
    def save(self, seq: int) -> contextlib.AbstractContextManager[list[int]]: ...
    def restore(self, seq: int, tokens: Sequence[int]) -> None: ...
    def erase(self, seq: int) -> int: ...
    def clear(self) -> None: ...
    def export(self, tokens: list[int], min_tokens: int, read: Callable[[int], bytes]) -> PrefixState | None: ...
    def import_(self, tokens: list[int], data: bytes, check: Callable[[bytes], object],
                write: Callable[[bytes, int], object]) -> int: ...


def reuse_class(prefix_cache: bool, kv_unified: bool, n_parallel: int) -> type[RadixReuse] | type[SlotReuse]:
    """The reuse an Engine gets: the tree over a unified cache with a sequence id to spare, the
    slots' own caches otherwise, none without prefix_cache."""
    if not prefix_cache:
        return NoReuse
    if kv_unified and n_parallel < LLAMA_MAX_SEQ:
        return RadixReuse
    return SlotReuse


def _no_tree(what: str) -> LlamaxError:
    return LlamaxError(f"{what} needs the prefix cache over a unified cache (prefix_cache=True, kv_unified=True)")


class RadixReuse:
    """The radix tree (PrefixCache) on the sequence ids the slots leave: a slot's request copies its
    prefix from a leaf, its prompt becomes a leaf once prefilled (locked while it runs) and its
    whole sequence when it ends. An idle slot remembers its last request's tokens (slot_save saves
    them as far as the tree still holds them).

    Args:
        memory: the context's memory (unified, n_seq_max 256).
        n_parallel: the slots (sequence ids 0 .. n_parallel - 1).
    """

    name = "tree"

    @staticmethod
    def n_seq_max(n_parallel: int) -> int:
        return LLAMA_MAX_SEQ

    def __init__(self, memory, n_parallel: int) -> None:
        self.mem = memory
        self.tree = PrefixCache(memory, range(n_parallel, LLAMA_MAX_SEQ))
        self.seq_ids = self.tree.seq_ids
        self._locks: dict[int, int] = {}       # slot seq -> the tree's lock handle of its prefix
        self._last: dict[int, list[int]] = {}  # slot seq -> the tokens of its last finished request

    @property
    def n_prompts(self) -> int:
        return self.tree.n_prompts

    def pick(self, prompt: Sequence[int], free: Sequence[int], prefilling: Sequence[Sequence[int]]) -> int | None:
        """The first free slot, or None while a prompt being prefilled shares DEFER_MIN more tokens
        with this one than the tree holds: it is cached when its prefill ends, and taken then."""
        have = self.tree.match_len(prompt)
        if any(common_prefix(feed, prompt) >= have + DEFER_MIN for feed in prefilling):
            return None
        return free[0]

    def lookup(self, seq: int, prompt: Sequence[int], limit: int) -> Hit:
        m = self.tree.match(prompt, limit)
        return Hit(m.n, m)

    def lock(self, seq: int, hit: Hit) -> None:
        assert seq not in self._locks, f"slot {seq} holds a lock already"
        if hit.n:
            assert hit.match is not None
            self._locks[seq] = self.tree.lock_match(hit.match)

    def unlock(self, seq: int) -> None:
        handle = self._locks.pop(seq, None)
        if handle is not None:
            self.tree.unlock(handle)

    def attach(self, seq: int, hit: Hit) -> int:
        """Copy the hit's prefix into seq from the leaf that holds it now (evicting for room may have
        moved it to another leaf) and commit the lookup. Returns the tokens copied."""
        assert hit.match is not None, "a hit of the tree's own lookup"
        m = self.tree.source(hit.match)
        self.mem.seq_rm(seq, -1, -1)
        if m.n:
            assert m.seq is not None
            self.mem.seq_cp(m.seq, seq, 0, m.n)
        if m.n != hit.n:  # another leaf's window gave less: lock what is used
            self.unlock(seq)
            if m.n:
                self._locks[seq] = self.tree.lock_match(m)
        self.tree.commit(m)
        return m.n

    def take(self, seq: int) -> None:
        pass

    def note_prefilled(self, seq: int, tokens: Sequence[int]) -> None:
        """The prompt seq holds goes to the tree and stays locked for the request."""
        toks = list(tokens)
        self.tree.insert(toks, seq, len(toks))
        self.unlock(seq)
        self._locks[seq] = self.tree.lock(toks, len(toks))

    def release(self, seq: int, tokens: Sequence[int], *, cache: bool, shifted: bool) -> None:
        """The tokens seq holds go to the tree (unless cache is False, or a shift moved them: they
        are no longer a prompt's cells), seq is emptied."""
        self.unlock(seq)
        if cache and not shifted and tokens:
            self.tree.insert(tokens, seq, len(tokens))
        self.mem.seq_rm(seq, -1, -1)
        self._last[seq] = list(tokens)

    def evict(self, n_cells: int) -> int:
        return self.tree.evict(n_cells)

    def stats(self) -> ReuseStats:
        t = self.tree
        cells, nbytes = self.mem.held_only_by(self.seq_ids)
        return ReuseStats(t.lookups, t.hits, t.tokens_reused, cells, nbytes, t.n_prompts)

    def kept(self, seq: int) -> list[int]:
        return self._last.get(seq, [])

    @contextlib.contextmanager
    def save(self, seq: int) -> Iterator[list[int]]:
        """seq holds the idle slot's last tokens as far as the tree holds them, while saving."""
        last = self._last.get(seq, [])
        m = self.tree.match(last, len(last))
        try:
            if m.n:
                assert m.seq is not None
                self.mem.seq_cp(m.seq, seq, 0, m.n)
            yield last[:m.n]
        finally:
            self.mem.seq_rm(seq, -1, -1)

    def restore(self, seq: int, tokens: Sequence[int]) -> None:
        """seq's restored cells become a cached prefix (any slot reuses them)."""
        self.tree.insert(tokens, seq, len(tokens))
        self.mem.seq_rm(seq, -1, -1)
        self._last[seq] = list(tokens)

    def erase(self, seq: int) -> int:
        n = len(self._last.pop(seq, []))
        self.mem.seq_rm(seq, -1, -1)
        return n

    def clear(self) -> None:
        self.tree.clear()
        self._locks.clear()

    def export(self, tokens: list[int], min_tokens: int, read: Callable[[int], bytes]) -> PrefixState | None:
        """The longest cached prefix of tokens (at least min_tokens of them) as a PrefixState; the
        tree is left as it was, the lookup not counted (a scratch id may evict a leaf)."""
        tree = self.tree
        m = tree.match(tokens, len(tokens))
        if m.n < max(1, min_tokens):
            return None
        handle = tree.lock_match(m)  # a leaf evicted for the scratch id must not take the prefix
        try:
            scratch = tree.borrow()
            if scratch is None:
                return None
            try:
                m = tree.source(m)
                if m.n < max(1, min_tokens):
                    return None
                assert m.seq is not None
                self.mem.seq_cp(m.seq, scratch, 0, m.n)
                data = read(scratch)
            finally:
                tree.give_back(scratch)
        finally:
            tree.unlock(handle)
        return PrefixState(tokens[:m.n], data)

    def import_(self, tokens: list[int], data: bytes, check: Callable[[bytes], object],
                write: Callable[[bytes, int], object]) -> int:
        """Put a PrefixState's blob into the tree (least recently used prefixes evicted for room);
        returns the tokens the tree did not hold yet. check(data) vets the blob before anything is
        evicted; write(data, seq) restores it as sequence seq.

        Raises:
            StateError: from check or write, or a blob whose cells are not positions
                [0, len(tokens)); the tree holds nothing of it.
            LlamaxError: every sequence id of the tree is in use."""
        tree = self.tree
        check(data)
        if tree.match_len(tokens) >= len(tokens):
            return 0
        scratch = tree.borrow()
        if scratch is None:
            raise LlamaxError("import_prefix: every sequence of the prefix cache is in use")
        try:
            short = len(tokens) - self.mem.n_free
            if short > 0:
                tree.evict(short)
            write(data, scratch)
            lo, hi = self.mem.seq_pos_min(scratch), self.mem.seq_pos_max(scratch)
            if (lo, hi) != (0, len(tokens) - 1):
                raise StateError(f"import_prefix: the blob holds positions [{lo}, {hi}], its "
                                 f"{len(tokens)} tokens need [0, {len(tokens) - 1}]")
            return tree.insert(tokens, scratch, len(tokens))
        finally:
            tree.give_back(scratch)


class SlotReuse:
    """llama-server's cache_prompt: an idle slot keeps its last request's cells on its own sequence;
    a request goes to the free slot whose kept tokens share the longest prefix with its prompt and
    keeps that prefix in place (nothing copied, nothing evicted: the cells are the slot's).

    Args:
        memory: the context's memory (n_seq_max = n_parallel).
        n_parallel: the slots.
    """

    name = "slots"
    seq_ids: tuple[int, ...] = ()
    n_prompts = 0

    @staticmethod
    def n_seq_max(n_parallel: int) -> int:
        return n_parallel

    def __init__(self, memory, n_parallel: int) -> None:
        self.mem = memory
        self._kept: dict[int, list[int]] = {}  # idle slot seq -> the tokens its cells hold, [0, len)
        self.lookups = self.hits = self.tokens_reused = 0

    def pick(self, prompt: Sequence[int], free: Sequence[int], prefilling: Sequence[Sequence[int]]) -> int | None:
        return max(free, key=lambda s: common_prefix(self._kept.get(s, []), prompt))

    def lookup(self, seq: int, prompt: Sequence[int], limit: int) -> Hit:
        return Hit(min(common_prefix(self._kept.get(seq, []), prompt), limit))

    def lock(self, seq: int, hit: Hit) -> None:
        pass

    def unlock(self, seq: int) -> None:
        pass

    def attach(self, seq: int, hit: Hit) -> int:
        """seq keeps its first hit.n cells, drops the rest."""
        self._kept.pop(seq, None)
        self.mem.seq_rm(seq, hit.n, -1)
        self.lookups += 1
        if hit.n:
            self.hits += 1
            self.tokens_reused += hit.n
        return hit.n

    def take(self, seq: int) -> None:
        self._kept.pop(seq, None)

    def note_prefilled(self, seq: int, tokens: Sequence[int]) -> None:
        pass

    def release(self, seq: int, tokens: Sequence[int], *, cache: bool, shifted: bool) -> None:
        """seq keeps its cells (cache), shifted ones too (their positions are still [0, len)), or
        drops them."""
        if cache:
            self._kept[seq] = list(tokens)
        else:
            self._kept.pop(seq, None)
            self.mem.seq_rm(seq, -1, -1)

    def evict(self, n_cells: int) -> int:
        return 0

    def stats(self) -> ReuseStats:
        idle = list(self._kept)
        cells, nbytes = self.mem.held_only_by(idle) if idle else (0, 0)
        return ReuseStats(self.lookups, self.hits, self.tokens_reused, cells, nbytes, 0)

    def kept(self, seq: int) -> list[int]:
        return self._kept.get(seq, [])

    @contextlib.contextmanager
    def save(self, seq: int) -> Iterator[list[int]]:
        yield list(self._kept.get(seq, []))

    def restore(self, seq: int, tokens: Sequence[int]) -> None:
        self._kept[seq] = list(tokens)

    def erase(self, seq: int) -> int:
        n = len(self._kept.pop(seq, []))
        self.mem.seq_rm(seq, -1, -1)
        return n

    def clear(self) -> None:
        for seq in self._kept:
            self.mem.seq_rm(seq, -1, -1)
        self._kept.clear()

    def export(self, tokens: list[int], min_tokens: int, read: Callable[[int], bytes]) -> PrefixState | None:
        raise _no_tree("export_prefix")

    def import_(self, tokens: list[int], data: bytes, check: Callable[[bytes], object],
                write: Callable[[bytes, int], object]) -> int:
        raise _no_tree("import_prefix")


class NoReuse(SlotReuse):
    """No prefix reuse: every prompt is computed and a finished request's cells are dropped. A slot
    restored from a file keeps its cells (for slot_save) until its next request, which drops them."""

    name = "off"

    def pick(self, prompt: Sequence[int], free: Sequence[int], prefilling: Sequence[Sequence[int]]) -> int | None:
        return free[0]

    def lookup(self, seq: int, prompt: Sequence[int], limit: int) -> Hit:
        return Hit(0)

    def release(self, seq: int, tokens: Sequence[int], *, cache: bool, shifted: bool) -> None:
        super().release(seq, tokens, cache=False, shifted=shifted)
