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
    boundary(seq, start, end)        where a prefill chunk of seq from position start (its feed end
                                     tokens long) must stop, so that a state can be kept there
    note_chunk(seq, tokens, end)     a prefill chunk of seq ended: seq holds tokens
    note_prefilled(seq, tokens)      seq's prompt is in the cache: keep it for others now
    release(seq, tokens, cache=...)  seq's request ended: keep its cells (cache) or drop them
    evict(n_cells)                   free up to n_cells cells only the reuse holds; the cells freed
    stats()                          lookups, hits, tokens reused, cached cells / bytes / prompts
    kept(seq), save(seq), restore(seq, tokens), erase(seq)
                                     an idle slot's cache for /slots and slot save / restore / erase
    clear()                          drop every cached prefix
    export(...), import_(...)        a cached prefix as a state blob, to and from another Engine

The Engine admits a request as: lookup -> does it fit? -> lock -> evict for room -> attach (copy,
commit). Four implementations:

    RadixReuse   the radix tree over a unified cache (PrefixCache): finished prompts are leaves on
                 sequence ids of their own (n_parallel .. 255), shared by seq_cp with no copy; a
                 prefix it evicts from the cells goes to the host-RAM tier (HostTier) and comes back
                 into the tree on a hit when restoring it is cheaper than computing it
    CheckpointReuse
                 a recurrent or hybrid model's: a state cannot be cut back to a shorter prefix, so
                 whole sequence states are kept in the host-RAM tier at chosen positions (multiples
                 of CHECKPOINT_EVERY, a prompt's last position but one, a finished request's end);
                 a request restores the deepest one at or below its shared prefix
    SlotReuse    llama-server's cache_prompt: each slot keeps its last request's cells, a request
                 goes to the free slot whose cache shares the longest prefix with its prompt and
                 reuses it in place (one stream per slot, or 256 slots leaving no id for a tree)
    NoReuse      nothing is kept (prefix_cache=False): every prompt is computed
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from llamax.dtypes import LLAMA_MAX_SEQ
from llamax.errors import LlamaxError, StateError
from llamax.serving.host_tier import Entry, HostTier
from llamax.serving.prefix_cache import Match, PrefixCache, common_prefix

log = logging.getLogger("llamax")

DEFER_MIN = 16        # wait for an in-flight prefill that would give this many more cached tokens
TIER_MIN_TOKENS = 32  # a prefix shorter than this is not kept in the host-RAM tier (computing it is cheap)
CHECKPOINT_EVERY = 512  # a recurrent model's prompt states are kept at multiples of this many positions


@dataclasses.dataclass(frozen=True)
class PrefixState:
    """A cached prefix handed from one Engine to another (export_prefix / import_prefix): its
    tokens and the versioned, fingerprinted state_seq_get_data blob of their cells."""
    tokens: list[int]
    data: bytes


@dataclasses.dataclass(frozen=True)
class Hit:
    """What lookup found for a slot: n prompt tokens the cache gives (0: none); for the tree, the
    match they come from; for a state restored from the host-RAM tier, its entry, its tokens and
    the cells its restore takes besides the prompt's uncomputed tokens (cells)."""
    n: int
    match: Match | None = None
    entry: Entry | None = None
    tokens: tuple[int, ...] = ()
    cells: int = 0


@dataclasses.dataclass(frozen=True)
class StateIO:
    """A context's sequence-state calls, for the reuses that keep states in the host-RAM tier:
    read(seq) -> blob (Context.state_seq_get_data), write(blob, seq) (state_seq_set_data)."""
    read: Callable[[int], bytes]
    write: Callable[[bytes, int], object]


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
    def boundary(self, seq: int, start: int, end: int) -> int: ...
    def note_chunk(self, seq: int, tokens: Sequence[int], end: int) -> None: ...
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


def reuse_class(prefix_cache: bool, kv_unified: bool, n_parallel: int,
                recurrent: bool = False) -> type[RadixReuse] | type[CheckpointReuse] | type[SlotReuse]:
    """The reuse an Engine gets: state checkpoints for a model with recurrent layers, the tree over
    a unified cache with a sequence id to spare, the slots' own caches otherwise, none without
    prefix_cache."""
    if not prefix_cache:
        return NoReuse
    if recurrent:
        return CheckpointReuse
    if kv_unified and n_parallel < LLAMA_MAX_SEQ:
        return RadixReuse
    return SlotReuse


def _no_tree(what: str) -> LlamaxError:
    return LlamaxError(f"{what} needs the prefix cache over a unified cache (prefix_cache=True, kv_unified=True)")


class _LastRequest:
    """What an idle slot remembers when its cells are not its own (the tree's, the checkpoints'): its last
    request's tokens, for /slots and slot_save."""

    def __init__(self, memory) -> None:
        self.mem = memory
        self._last: dict[int, list[int]] = {}  # slot seq -> the tokens of its last finished request

    def kept(self, seq: int) -> list[int]:
        return self._last.get(seq, [])

    def erase(self, seq: int) -> int:
        n = len(self._last.pop(seq, []))
        self.mem.seq_rm(seq, -1, -1)
        return n


class RadixReuse(_LastRequest):
    """The radix tree (PrefixCache) on the sequence ids the slots leave: a slot's request copies its
    prefix from a leaf, its prompt becomes a leaf once prefilled (locked while it runs) and its
    whole sequence when it ends. An idle slot remembers its last request's tokens (slot_save saves
    them as far as the tree still holds them).

    With a host-RAM tier, a leaf the tree trims is kept there first (its whole path, the state of
    its sequence; TIER_MIN_TOKENS or more), and a lookup whose prompt shares more with a kept state
    than with the tree restores that state into a scratch sequence of the tree, cut back to the
    shared prefix, when the tier's cost model finds it cheaper than computing the difference; the
    tree then holds it like any prefix. Over a memory whose states do not cut back exactly (not
    memory.exact_cut: Gemma 3's sliding-window cache without swa_full, whose window before a cut is
    gone) a kept state comes back only whole, for a prompt holding all of its tokens (llama.cpp's
    restores of SWA checkpoints, at their own positions only).

    Args:
        memory: the context's memory (unified, n_seq_max 256).
        n_parallel: the slots (sequence ids 0 .. n_parallel - 1).
        tier: the host-RAM tier (None, or a zero budget: evicted prefixes are lost).
        state: the context's sequence-state calls (needed with a tier).
    """

    name = "tree"

    @staticmethod
    def n_seq_max(n_parallel: int) -> int:
        return LLAMA_MAX_SEQ

    def __init__(self, memory, n_parallel: int, *, tier: HostTier | None = None, state: StateIO | None = None) -> None:
        super().__init__(memory)
        self.tree = PrefixCache(memory, range(n_parallel, LLAMA_MAX_SEQ))
        self.seq_ids = self.tree.seq_ids
        self._locks: dict[int, int] = {}       # slot seq -> the tree's lock handle of its prefix
        self.tier = tier if tier is not None and tier.enabled and state is not None else None
        # a sliding window's cells do not cut back (the window before the cut is gone): such a state
        # comes back whole, for a prompt that holds all of its tokens
        self.whole_only = not memory.exact_cut
        self.state = state
        if self.tier is not None:
            self.tree.on_evict = self._keep

    def _keep(self, tokens: list[int], seq: int) -> None:
        """The tree is about to trim the leaf on seq (holding tokens): its state goes to the tier,
        unless the tier holds these tokens (or more) already."""
        assert self.tier is not None and self.state is not None
        held = self.tier.has(tokens) if self.whole_only else self.tier.covers(tokens)
        if len(tokens) >= TIER_MIN_TOKENS and not held:
            self.tier.put(tokens, self.state.read(seq))

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
        if self.tier is not None:
            if self.whole_only:
                e = self.tier.match(prompt, limit)
                k = e.n if e is not None else 0
            else:
                e, k = self.tier.longest(prompt, limit)
            if e is not None and k > m.n and self.tier.cost.worth(len(e.data), k - m.n):
                return Hit(k, m, e, tuple(prompt[:k]), cells=e.n)
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

    def _from_tier(self, hit: Hit) -> Hit | None:
        """Restore the hit's tier entry into a scratch sequence and insert it into the tree; the
        tree's hit on it, locked for the slot in place of the old one (None: the restore failed,
        the tree is as it was)."""
        assert hit.entry is not None and self.tier is not None and self.state is not None
        tree = self.tree
        scratch = tree.borrow()
        if scratch is None:
            return None
        try:
            short = hit.entry.n - self.mem.n_free   # room for its cells: the least recently used leaves go
            if short > 0:
                tree.evict(short)
            t0 = time.perf_counter()
            self.state.write(hit.entry.data, scratch)
            self.tier.cost.saw_restore(len(hit.entry.data), time.perf_counter() - t0)
            # what of [0, hit.n) the restored cells give a next token (a sliding window's cells may cover
            # only the entry's own end: cut back, the window before the cut would be missing)
            n = self.mem.reusable_prefix(scratch, hit.n)
            if n <= (hit.match.n if hit.match is not None else 0):   # nothing more than the tree gives
                return None
            self.mem.seq_rm(scratch, n, -1)   # the entry's tail past the shared prefix
            tree.insert(list(hit.tokens[:n]), scratch, n)
        except StateError as e:  # no room for its cells as they were placed
            log.info("llamax prefix cache: a state of %d tokens from RAM did not fit the cells: %s", hit.n, e)
            return None
        finally:
            tree.give_back(scratch)
        self.tier.restored(hit.entry, n)
        m = tree.match(list(hit.tokens), n)
        return Hit(m.n, m)

    def attach(self, seq: int, hit: Hit) -> int:
        """Copy the hit's prefix into seq from the leaf that holds it now (evicting for room may have
        moved it to another leaf; a hit of the host-RAM tier is restored into the tree first) and
        commit the lookup. Returns the tokens copied."""
        if hit.entry is not None:
            restored = self._from_tier(hit)
            if restored is not None:
                self.unlock(seq)
                assert restored.match is not None
                if restored.n:
                    self._locks[seq] = self.tree.lock_match(restored.match)
                hit = restored
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

    def boundary(self, seq: int, start: int, end: int) -> int:
        return end

    def note_chunk(self, seq: int, tokens: Sequence[int], end: int) -> None:
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

    def clear(self) -> None:
        self.tree.clear()
        self._locks.clear()
        if self.tier is not None:
            self.tier.clear()

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


class CheckpointReuse(_LastRequest):
    """Prefix reuse for a model with recurrent layers (Mamba, Jamba, the Mamba-2 hybrids): a state
    holds every token folded into it and cannot be cut back to a shorter prefix, so whole sequence
    states are kept in the host-RAM tier at chosen positions (llama-server's context checkpoints):

        every CHECKPOINT_EVERY positions of a prompt   (the engine stops its prefill chunks there)
        the prompt's last position but one             (its last token is always computed: a
                                                        request for the same prompt starts here)
        the end of a finished request                  (prompt and generated tokens: the next
                                                        chat turn starts here)

    A request restores the deepest state at or below its shared prefix into its own sequence
    (state_seq_set_data: a hybrid's KV cells come with it) and computes only the rest: its tokens
    are those of its solo run, bit for bit (the kernels give a sequence the same bits whatever its
    chunking). Nothing stays in the cells between requests: each slot's sequence is its request's.

    Args:
        memory: the context's memory (RecurrentMemory or HybridMemory, n_seq_max = n_parallel).
        n_parallel: the slots.
        tier: the host-RAM tier the checkpoints live in (None or a zero budget: nothing is reused).
        state: the context's sequence-state calls.
        every: positions between two prompt checkpoints.
    """

    name = "checkpoints"
    seq_ids: tuple[int, ...] = ()

    @staticmethod
    def n_seq_max(n_parallel: int) -> int:
        return n_parallel

    def __init__(self, memory, n_parallel: int, *, tier: HostTier | None = None, state: StateIO | None = None,
                 every: int = CHECKPOINT_EVERY) -> None:
        super().__init__(memory)
        self.tier = tier if tier is not None and tier.enabled and state is not None else None
        self.state = state
        self.every = max(int(every), 1)
        self.lookups = self.hits = self.tokens_reused = 0

    @property
    def n_prompts(self) -> int:
        return len(self.tier) if self.tier is not None else 0

    def _match(self, prompt: Sequence[int], limit: int) -> Entry | None:
        return self.tier.match(prompt, limit) if self.tier is not None else None

    def pick(self, prompt: Sequence[int], free: Sequence[int], prefilling: Sequence[Sequence[int]]) -> int | None:
        """The first free slot, or None while a prompt being prefilled shares DEFER_MIN more tokens
        with this one than the kept states give (its checkpoints are kept as it goes)."""
        e = self._match(prompt, len(prompt))
        have = 0 if e is None else e.n
        if self.tier is not None and any(common_prefix(feed, prompt) >= have + DEFER_MIN for feed in prefilling):
            return None
        return free[0]

    def lookup(self, seq: int, prompt: Sequence[int], limit: int) -> Hit:
        e = self._match(prompt, limit)
        if e is None or self.tier is None or not self.tier.cost.worth(len(e.data), e.n):
            return Hit(0)
        return Hit(e.n, None, e, tuple(prompt[:e.n]), cells=e.n)

    def lock(self, seq: int, hit: Hit) -> None:
        pass

    def unlock(self, seq: int) -> None:
        pass

    def attach(self, seq: int, hit: Hit) -> int:
        """seq gets the hit's state (its old content dropped) and the lookup is counted; returns the
        tokens restored (0 when the restore fails: the request computes its whole prompt)."""
        self._last.pop(seq, None)
        self.mem.seq_rm(seq, -1, -1)
        self.lookups += 1
        if hit.entry is None:
            return 0
        assert self.tier is not None and self.state is not None
        try:
            t0 = time.perf_counter()
            self.state.write(hit.entry.data, seq)
            self.tier.cost.saw_restore(len(hit.entry.data), time.perf_counter() - t0)
        except StateError as e:  # no room for a hybrid's KV cells as they were placed
            log.info("llamax prefix cache: a state of %d tokens did not fit the cells: %s", hit.n, e)
            self.mem.seq_rm(seq, -1, -1)
            return 0
        if self.mem.seq_pos_max(seq) != hit.n - 1:   # an imported state whose tokens are not its own
            log.warning("llamax prefix cache: a kept state of %d tokens ends at position %d; dropped", hit.n,
                        self.mem.seq_pos_max(seq))
            self.mem.seq_rm(seq, -1, -1)
            self.tier.drop(hit.entry)
            return 0
        self.tier.restored(hit.entry, hit.n)
        self.hits += 1
        self.tokens_reused += hit.n
        return hit.n

    def take(self, seq: int) -> None:
        self._last.pop(seq, None)

    def _checkpoint(self, n: int, end: int) -> bool:
        return n >= TIER_MIN_TOKENS and (n % self.every == 0 or n == end - 1)

    def boundary(self, seq: int, start: int, end: int) -> int:
        """The first checkpoint position after start (a multiple of every, or end - 1), else end."""
        if self.tier is None:
            return end
        stop = (start // self.every + 1) * self.every
        if start < end - 1 < stop and end - 1 >= TIER_MIN_TOKENS:
            stop = end - 1
        return min(stop, end)

    def _keep(self, seq: int, tokens: Sequence[int]) -> None:
        assert self.tier is not None and self.state is not None
        if not self.tier.has(tokens):
            self.tier.put(tokens, self.state.read(seq))

    def note_chunk(self, seq: int, tokens: Sequence[int], end: int) -> None:
        """A prefill chunk ended: at a checkpoint position, seq's state is kept."""
        if self.tier is not None and self._checkpoint(len(tokens), end):
            self._keep(seq, tokens)

    def note_prefilled(self, seq: int, tokens: Sequence[int]) -> None:
        pass

    def release(self, seq: int, tokens: Sequence[int], *, cache: bool, shifted: bool) -> None:
        """seq's whole state is kept (unless cache is False, or a shift moved it), seq is emptied."""
        if cache and not shifted and self.tier is not None and len(tokens) >= TIER_MIN_TOKENS:
            self._keep(seq, tokens)
        self.mem.seq_rm(seq, -1, -1)
        self._last[seq] = list(tokens)

    def evict(self, n_cells: int) -> int:
        return 0

    def stats(self) -> ReuseStats:
        return ReuseStats(self.lookups, self.hits, self.tokens_reused, 0, 0, self.n_prompts)

    @contextlib.contextmanager
    def save(self, seq: int) -> Iterator[list[int]]:
        """seq holds the idle slot's last request as far as a kept state gives it, while saving."""
        last = self._last.get(seq, [])
        e = self._match(last, len(last))
        try:
            if e is not None:
                assert self.state is not None
                self.state.write(e.data, seq)
            yield last[:e.n] if e is not None else []
        finally:
            self.mem.seq_rm(seq, -1, -1)

    def restore(self, seq: int, tokens: Sequence[int]) -> None:
        """seq's restored state becomes a kept state any request restores."""
        if self.tier is not None and len(tokens):
            self._keep(seq, tokens)
        self.mem.seq_rm(seq, -1, -1)
        self._last[seq] = list(tokens)

    def clear(self) -> None:
        if self.tier is not None:
            self.tier.clear()

    def export(self, tokens: list[int], min_tokens: int, read: Callable[[int], bytes]) -> PrefixState | None:
        """The deepest kept state at or below tokens (at least min_tokens of them); not counted."""
        e = self._match(tokens, len(tokens))
        if e is None or e.n < max(1, min_tokens):
            return None
        return PrefixState(list(tokens[:e.n]), e.data)

    def import_(self, tokens: list[int], data: bytes, check: Callable[[bytes], object],
                write: Callable[[bytes, int], object]) -> int:
        """Keep a PrefixState's blob as the state of its tokens; returns the tokens no kept state
        gave yet. check(data) vets the blob first (StateError). A blob whose state does not end at the
        last of its tokens is dropped at its first restore, and that request computes its prompt.

        Raises:
            LlamaxError: the engine keeps no states (cache_ram 0)."""
        if self.tier is None:
            raise LlamaxError("import_prefix: this engine keeps no states (cache_ram = 0)")
        check(data)
        e = self._match(tokens, len(tokens))
        have = 0 if e is None else e.n
        if have >= len(tokens):
            return 0
        if not self.tier.put(tokens, data):
            raise LlamaxError(f"import_prefix: a state of {len(data)} bytes does not fit cache_ram "
                              f"({self.tier.budget} bytes)")
        return len(tokens) - have


class SlotReuse:
    """llama-server's cache_prompt: an idle slot keeps its last request's cells on its own sequence;
    a request goes to the free slot whose kept tokens share the longest prefix with its prompt and
    keeps that prefix in place (nothing copied, nothing evicted: the cells are the slot's).

    Args:
        memory: the context's memory (n_seq_max = n_parallel).
        n_parallel: the slots.
        tier, state: not used (a slot's cells are its own; llama-server's --cache-ram covers them,
            llamax's tier only the tree's and the checkpoints').
    """

    name = "slots"
    seq_ids: tuple[int, ...] = ()
    n_prompts = 0

    @staticmethod
    def n_seq_max(n_parallel: int) -> int:
        return n_parallel

    def __init__(self, memory, n_parallel: int, *, tier: HostTier | None = None, state: StateIO | None = None) -> None:
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

    def boundary(self, seq: int, start: int, end: int) -> int:
        return end

    def note_chunk(self, seq: int, tokens: Sequence[int], end: int) -> None:
        pass

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
