"""Which replica a request goes to: prefix-aware routing with a load bound, or round robin.

Pure policy, no Ray: the Ray Serve request router (router.py) asks it, and tests drive it directly.

A prompt is summarised by the chained hashes of its leading token blocks (BLOCK tokens each, at most
MAX_BLOCKS): hash k stands for the whole prefix tokens[:(k + 1) * BLOCK], so two prompts share
their first k hashes exactly when they share their first k blocks. The policy remembers, for each
hash, the replicas it sent that prefix to (an LRU table of bounded size): its picture of which
replica's prefix cache holds what, as SGLang's cache-aware router keeps an approximate radix tree
per worker instead of asking the workers.

choose(), prefix mode:
    eligible     the live replicas that are not draining and whose in-flight requests exceed the
                 least loaded one's by at most load_bound (one hot prefix must not pile every
                 request on one replica while the others idle)
    pick         the eligible replica holding the longest prefix of the prompt; when none holds a
                 block of it, the least loaded (ties taken in turn)
    handover     when a replica outside the eligible set (draining, or over the bound) holds a
                 longer prefix than the pick, it is named as the source: the pick fetches the
                 cached prefix from it (Engine.export_prefix / import_prefix) instead of
                 computing it again
round_robin: the live, not draining replicas in turn.
"""
from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

BLOCK = 16            # tokens per hashed block
MAX_BLOCKS = 256      # prefixes are told apart on at most their first BLOCK * MAX_BLOCKS tokens
TABLE_SIZE = 1 << 16  # hashes remembered (least recently used forgotten first)
ROUTINGS = ("prefix", "round_robin")


def block_hashes(tokens: Sequence[int], block: int = BLOCK, max_blocks: int = MAX_BLOCKS) -> list[str]:
    """The chained hashes of the full leading blocks of tokens (hex strings, stable across
    processes and machines): hash k covers tokens[:(k + 1) * block]."""
    n = min(len(tokens) // block, max_blocks)
    if n == 0:
        return []
    raw = np.asarray(tokens[:n * block], dtype="<i4").tobytes()
    out, prev, step = [], b"", 4 * block
    for k in range(n):
        prev = hashlib.blake2b(prev + raw[k * step:(k + 1) * step], digest_size=8).digest()
        out.append(prev.hex())
    return out


@dataclass(frozen=True)
class Choice:
    """A routing decision: the replica, the blocks of the prompt it is believed to hold, and the
    replica to fetch a longer cached prefix from (None: no handover)."""
    replica: str
    matched: int
    handover: str | None = None
    handover_matched: int = 0


class Policy:
    """The routing state of one deployment's router (thread-safe).

    Args:
        routing: "prefix" or "round_robin".
        load_bound: how many more in-flight requests than the least loaded replica a replica may
            have and still take a request for its cached prefix.
        table_size: prefix hashes remembered.
    """

    def __init__(self, routing: str = "prefix", load_bound: int = 4, table_size: int = TABLE_SIZE) -> None:
        if routing not in ROUTINGS:
            raise ValueError(f"routing = {routing!r}: one of {', '.join(ROUTINGS)}")
        if load_bound < 0:
            raise ValueError(f"load_bound = {load_bound}: >= 0")
        self.routing = routing
        self.load_bound = load_bound
        self.table_size = table_size
        self._table: OrderedDict[str, dict[str, None]] = OrderedDict()  # hash -> replicas (insertion = recency)
        self._inflight: dict[str, int] = {}
        self._replicas: list[str] = []
        self._draining: set[str] = set()
        self._dead: set[str] = set()
        self._turn = 0
        self._lock = threading.Lock()
        self.routed: dict[str, str] = {}        # request key -> replica, until the request ends
        self.counts = {"requests": 0, "prefix_matched": 0, "handovers": 0}

    # ---- the replicas' state -------------------------------------------------------------------
    def set_replicas(self, replicas: Sequence[str]) -> None:
        """The replicas Ray runs now (the router calls this on every change)."""
        with self._lock:
            self._replicas = sorted(replicas)
            self._draining &= set(replicas)

    def replicas(self) -> list[str]:
        """The running replicas, not seen to die."""
        with self._lock:
            return [r for r in self._replicas if r not in self._dead]

    def drain(self, replica: str, on: bool = True) -> None:
        """A draining replica takes no new request (its cached prefixes are handed over)."""
        with self._lock:
            (self._draining.add if on else self._draining.discard)(replica)

    def draining(self) -> set[str]:
        with self._lock:
            return set(self._draining)

    def dead(self, replica: str) -> None:
        """A replica seen to die: never chosen again (Ray gives a restarted replica a new id)."""
        with self._lock:
            self._dead.add(replica)
            self._inflight.pop(replica, None)

    def started(self, key: str | None, replica: str) -> None:
        with self._lock:
            self._inflight[replica] = self._inflight.get(replica, 0) + 1
            if key is not None:
                self.routed[key] = replica

    def ended(self, replica: str, key: str | None = None) -> None:
        with self._lock:
            if replica in self._inflight:
                self._inflight[replica] = max(0, self._inflight[replica] - 1)
            if key is not None:
                self.routed.pop(key, None)

    def load(self, replica: str) -> int:
        with self._lock:
            return self._inflight.get(replica, 0)

    # ---- the decision ----------------------------------------------------------------------------
    def _matched(self, hashes: Sequence[str], replica: str) -> int:
        """Leading blocks of the prompt the table places on replica (longest first: chained hashes)."""
        for k in range(len(hashes), 0, -1):
            holders = self._table.get(hashes[k - 1])
            if holders is not None and replica in holders:
                return k
        return 0

    def choose(self, replicas: Sequence[str], hashes: Sequence[str] = ()) -> Choice | None:
        """The replica for a prompt with these block hashes among the live ones (None if none is
        left to take it); the choice is remembered as holding the prompt's blocks."""
        with self._lock:
            live = sorted(r for r in replicas if r not in self._dead)
            if not live:
                return None
            open_ = [r for r in live if r not in self._draining] or live
            self.counts["requests"] += 1
            if self.routing == "round_robin" or not hashes:
                pick = open_[self._turn % len(open_)]
                self._turn += 1
                if self.routing == "prefix":
                    self._remember(hashes, pick)
                return Choice(pick, 0)
            loads = {r: self._inflight.get(r, 0) for r in live}
            least = min(loads[r] for r in open_)
            eligible = [r for r in open_ if loads[r] <= least + self.load_bound]
            matched = {r: self._matched(hashes, r) for r in live}
            best = max(matched[r] for r in eligible)
            if best > 0:
                pick = min((r for r in eligible if matched[r] == best), key=lambda r: (loads[r], r))
            else:
                lowest = [r for r in eligible if loads[r] == least] or eligible
                pick = lowest[self._turn % len(lowest)]
                self._turn += 1
            source = max(live, key=lambda r: (matched[r], -loads[r]))
            handover = None
            if source != pick and matched[source] > matched[pick]:
                handover = source
                self.counts["handovers"] += 1
            self.counts["prefix_matched"] += matched[pick] > 0
            self._remember(hashes, pick)
            return Choice(pick, matched[pick], handover, matched[source] if handover else 0)

    def _remember(self, hashes: Sequence[str], replica: str) -> None:
        for h in hashes:
            holders = self._table.pop(h, None) or {}
            holders[replica] = None
            self._table[h] = holders
        while len(self._table) > self.table_size:
            self._table.popitem(last=False)


_POLICIES: dict[str, Policy] = {}
_POLICIES_LOCK = threading.Lock()


def policy(deployment: str, routing: str | None = None, load_bound: int | None = None) -> Policy:
    """The process's Policy for a deployment (made on first use; routing and load_bound, when
    given, set): the Ray request router of the deployment's handles in this process and the front
    end that owns those handles share it."""
    with _POLICIES_LOCK:
        p = _POLICIES.get(deployment)
        if p is None:
            p = _POLICIES[deployment] = Policy()
        if routing is not None:
            if routing not in ROUTINGS:
                raise ValueError(f"routing = {routing!r}: one of {', '.join(ROUTINGS)}")
            p.routing = routing
        if load_bound is not None:
            p.load_bound = load_bound
        return p
