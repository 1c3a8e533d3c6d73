"""GET /metrics: the Engine's metrics and the server's request counts in Prometheus' text format.

A prometheus_client Collector reads Engine.metrics() at each scrape (nothing is copied between
scrapes; a replica set's metrics are summed, and given per replica too); the names are llamax_<key>, counters ending in _total as Prometheus asks. Each server has
its own registry, so two servers in one process (tests, embedding apps) do not mix their figures.
"""
from __future__ import annotations

import threading
from collections import Counter

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Engine.metrics() key -> help; counters only grow, gauges are the state at the scrape
COUNTERS = {
    "prompt_tokens": "prompt tokens computed (not taken from the prefix cache)",
    "gen_tokens": "tokens generated",
    "requests_finished": "requests that ended (end of generation, length or a stop string)",
    "requests_cancelled": "requests cancelled (a client gone, or the server stopping)",
    "requests_failed": "requests whose forward pass failed (the others went on)",
    "requests_suspended": "times a running request was suspended to make room",
    "prefix_lookups": "prefix-cache lookups",
    "prefix_hits": "prefix-cache lookups that reused at least one token",
    "tokens_reused": "prompt tokens taken from the prefix cache",
    "steps": "scheduler steps (one decode each)",
    "busy_s": "seconds spent in steps",
    "spec_drafted": "speculative decoding: drafted tokens verified",
    "spec_accepted": "speculative decoding: drafted tokens the model sampled too",
    "cache_ram_stored": "sequence states put in the host-RAM tier (evicted prefixes, state checkpoints)",
    "cache_ram_evicted": "sequence states dropped from the host-RAM tier for room",
    "cache_ram_restores": "sequence states restored from the host-RAM tier",
    "cache_ram_tokens_restored": "prompt tokens restored from the host-RAM tier",
    # llamax serve --replicas: conversations moved between replicas with their cached prefix
    "handovers_in": "cached prefixes fetched from another replica",
    "handovers_tokens_in": "prompt tokens fetched from another replica's cache",
    "handovers_out": "cached prefixes sent to another replica",
    "handovers_tokens_out": "prompt tokens sent to another replica",
    "handovers_failed": "handovers that failed (the prompt was computed instead)",
}
GAUGES = {
    "slots_busy": "slots decoding a request",
    "slots_total": "slots",
    "queue_len": "new requests waiting for a slot",
    "requests_waiting": "requests waiting for a slot (new and suspended)",
    "cells_used": "KV cells in use",
    "cells_total": "KV cells",
    "cells_cached": "KV cells held only by the prefix cache",
    "bytes_cached": "bytes of K/V held only by the prefix cache",
    "cached_prompts": "prompts in the prefix cache",
    "suspended_bytes": "bytes of suspended requests' saved states",
    "cache_ram_entries": "sequence states in the host-RAM tier",
    "cache_ram_bytes": "bytes of sequence states in the host-RAM tier",
    "cache_ram_budget": "the host-RAM tier's byte budget (--cache-ram)",
    "prompt_tokens_per_s": "prompt tokens computed per busy second",
    "gen_tokens_per_s": "tokens generated per busy second",
}


class HTTPCounts:
    """Requests served, by route and status code (thread-safe)."""

    def __init__(self) -> None:
        self._n: Counter[tuple[str, int]] = Counter()
        self._lock = threading.Lock()

    def add(self, route: str, status: int) -> None:
        with self._lock:
            self._n[(route, status)] += 1

    def items(self) -> list[tuple[tuple[str, int], int]]:
        with self._lock:
            return sorted(self._n.items())


class EngineCollector:
    """The engine's metrics as llamax_<key>; an engine of several replicas (llamax.cluster) has them
    summed there and also each replica's as llamax_replica_<key>{replica="ID"}."""

    def __init__(self, engine, http: HTTPCounts) -> None:
        self.engine, self.http = engine, http

    def collect(self):
        per = self.engine.metrics_by_replica() if hasattr(self.engine, "metrics_by_replica") else None
        m = self.engine.metrics() if per is None else sum_metrics(per.values())
        for key, doc in COUNTERS.items():
            if key in m:
                yield CounterMetricFamily(f"llamax_{key}", doc, value=m[key])
        for key, doc in GAUGES.items():
            if key in m:
                yield GaugeMetricFamily(f"llamax_{key}", doc, value=m[key])
        if per is not None:
            yield GaugeMetricFamily("llamax_replicas", "replicas running", value=len(per))
            for table, family in ((COUNTERS, CounterMetricFamily), (GAUGES, GaugeMetricFamily)):
                for key, doc in table.items():
                    f = family(f"llamax_replica_{key}", f"{doc}, per replica", labels=["replica"])
                    for rid, rm in sorted(per.items()):
                        if key in rm:
                            f.add_metric([rid], rm[key])
                    yield f
        http = CounterMetricFamily("llamax_http_requests", "HTTP requests answered", labels=["route", "code"])
        for (route, code), n in self.http.items():
            http.add_metric([route, str(code)], n)
        yield http


def sum_metrics(per_replica) -> dict:
    """Several engines' metrics as one: counters and gauges summed (rates too: the aggregate
    tokens per busy second of replicas working side by side)."""
    out: dict = {}
    for m in per_replica:
        for k, v in m.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[k] = out.get(k, 0) + v
    return out


def registry(engine, http: HTTPCounts) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(EngineCollector(engine, http))
    return reg


def render(reg: CollectorRegistry) -> bytes:
    return generate_latest(reg)
