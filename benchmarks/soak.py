"""Soak: many short Engine requests with mixed cancels in one process, watching for leaks.

Each request is a short prompt (a few sentences from a fixed pool, so prompts share prefixes and the
prefix cache both hits and evicts) and 1-4 generated tokens; about one in five is cancelled, either
while it waits in the queue or after its first piece. After the warm-up (the first --warmup
requests) the process's RSS, its count of live GC-tracked objects and tracemalloc's traced bytes are
measured, then again after each tenth of the remaining requests: a leak shows as a steady climb.

    python benchmarks/soak.py --requests 10000 --n-parallel 4 --threads 1

prints RSS at warm-up and at the end and their ratio, the table of measures, tracemalloc's top growth, the cells in use
against the cells the prefix cache holds at the end, requests/s and the wall time, and exits 1 when
RSS grew by more than --max-rss-growth, cells are held by anything but the prefix cache, or the
traced Python memory grew by more than --max-traced-growth bytes, or the live objects by more than
--max-objects-per-request per measured request.
"""
from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time
import tracemalloc
from typing import NamedTuple

import llamax

SENTENCES = [
    "The library opens at nine.", "Late fees are ten cents a day.", "Members may borrow six books.",
    "The reading room is quiet.", "Cards are renewed every year.", "Children's books are upstairs.",
    "Return books at the front desk.", "Printing costs five cents a page.", "The cafe closes at four.",
    "Ask the librarian for help.", "New arrivals are shown by the door.", "Maps are in the basement.",
]


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc; elsewhere the peak from getrusage)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Point(NamedTuple):
    """One measure: after how many requests, RSS, live GC-tracked objects, traced Python bytes."""
    requests: int
    rss: int
    objects: int
    traced: int


def measure(requests: int, no_tracemalloc: bool) -> Point:
    gc.collect()
    traced = 0 if no_tracemalloc else tracemalloc.get_traced_memory()[0]
    return Point(requests, rss_bytes(), len(gc.get_objects()), traced)


def prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(SENTENCES) for _ in range(rng.randint(1, 4)))


def run_batch(engine: llamax.Engine, rng: random.Random, n: int, *, cancel_rate: float, max_tokens: int) -> dict:
    """Submit n requests (a few at a time), cancelling some; wait for all. Returns stop counts."""
    stops: dict[str, int] = {}
    done = 0
    while done < n:
        k = min(n - done, 2 * engine.n_parallel)
        reqs = []
        for _ in range(k):
            r = engine.submit(prompt(rng), max_tokens=rng.randint(1, max_tokens), temperature=0.0)
            reqs.append(r)
            if rng.random() < cancel_rate / 2:
                r.cancel()  # most likely still queued
        for r in reqs:
            if not r.done and rng.random() < cancel_rate / 2:
                for _ in r:  # the first piece, then cancel mid-generation
                    break
                r.cancel()
        for r in reqs:
            res = r.result(timeout=120)
            stops[res.stop] = stops.get(res.stop, 0) + 1
        done += k
    return stops


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--requests", type=int, default=10000)
    p.add_argument("--warmup", type=int, default=None, help="requests before the first measure (default 10%%, >= 200)")
    p.add_argument("--n-parallel", type=int, default=4)
    p.add_argument("--n-ctx", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--cancel-rate", type=float, default=0.2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-rss-growth", type=float, default=0.05)
    p.add_argument("--max-traced-growth", type=int, default=1 << 20)
    p.add_argument("--max-objects-per-request", type=float, default=0.1,
                   help="GC-tracked objects the measured part may add, per request (a leak adds >= 1)")
    p.add_argument("--no-tracemalloc", action="store_true", help="skip tracemalloc (it slows Python down)")
    a = p.parse_args(argv)
    warmup = a.warmup if a.warmup is not None else max(200, a.requests // 10)
    warmup = min(warmup, a.requests)

    rng = random.Random(a.seed)
    model = llamax.Model.load(a.model, n_threads=a.threads)
    n_meas = a.requests - warmup
    n_points = min(10, max(1, n_meas))
    t0 = time.perf_counter()
    if not a.no_tracemalloc:
        tracemalloc.start(8)  # from before the warm-up, so that its measure holds every live allocation
    with llamax.Engine(model, n_ctx=a.n_ctx, n_parallel=a.n_parallel, n_threads=a.threads) as engine:
        stops = run_batch(engine, rng, warmup, cancel_rate=a.cancel_rate, max_tokens=a.max_tokens)
        points = [measure(warmup, a.no_tracemalloc)]
        if not a.no_tracemalloc:
            snap0 = tracemalloc.take_snapshot()
        t1 = time.perf_counter()
        done = warmup
        for k in range(n_points):  # the measured part in n_points pieces, a measure after each
            n = (n_meas * (k + 1)) // n_points - (done - warmup)
            for key, v in run_batch(engine, rng, n, cancel_rate=a.cancel_rate, max_tokens=a.max_tokens).items():
                stops[key] = stops.get(key, 0) + v
            done += n
            points.append(measure(done, a.no_tracemalloc))
        t2 = time.perf_counter()
        growth = []
        if not a.no_tracemalloc:
            growth = tracemalloc.take_snapshot().compare_to(snap0, "lineno")[:10]
            tracemalloc.stop()
        m = engine.metrics()
        slot_seqs = set(range(engine.n_parallel))
        held_by_slots = sum(1 for _, seqs in engine.memory.cells() if seqs & slot_seqs)
    wall = time.perf_counter() - t0

    first, last = points[0], points[-1]
    print(f"requests        {a.requests} ({warmup} warm-up), stops {dict(sorted(stops.items()))}")
    print(f"wall time       {wall:.1f} s; measured part {t2 - t1:.1f} s, {n_meas / (t2 - t1) if n_meas else 0:.1f} requests/s")
    print(f"RSS             warm-up {first.rss / 2**20:.1f} MiB, end {last.rss / 2**20:.1f} MiB, "
          f"ratio {last.rss / first.rss:.4f}")
    print("after requests  RSS MiB   GC objects  traced Python bytes")
    for pt in points:
        print(f"    {pt.requests:>8}  {pt.rss / 2**20:8.1f}  {pt.objects:>10}  "
              f"{pt.traced if not a.no_tracemalloc else '-':>10}")
    if not a.no_tracemalloc:
        print(f"traced Python   {last.traced - first.traced:+d} bytes over the measured part; top growth:")
        for st in growth:
            print(f"    {st}")
    print(f"cells           used {m['cells_used']}, cached {m['cells_cached']}, held by slots {held_by_slots}, "
          f"total {m['cells_total']}; cached prompts {m['cached_prompts']}")
    print(f"engine          finished {m['requests_finished']}, cancelled {m['requests_cancelled']}, "
          f"prefix hits {m['prefix_hits']}/{m['prefix_lookups']}, tokens reused {m['tokens_reused']}")
    ok = True
    if last.rss > first.rss * (1 + a.max_rss_growth):
        print(f"FAIL: RSS grew by more than {a.max_rss_growth:.0%}")
        ok = False
    if m["cells_used"] != m["cells_cached"] or held_by_slots:
        print("FAIL: cells are held by something other than the prefix cache")
        ok = False
    if not a.no_tracemalloc and last.traced - first.traced > a.max_traced_growth:
        print(f"FAIL: traced Python memory grew by {last.traced - first.traced} bytes (> {a.max_traced_growth})")
        ok = False
    if last.objects - first.objects > n_meas * a.max_objects_per_request:
        print(f"FAIL: {last.objects - first.objects} more GC objects after {n_meas} requests "
              f"(> {a.max_objects_per_request} per request)")
        ok = False
    if sum(stops.values()) != a.requests:
        print("FAIL: not every request ended")
        ok = False
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
