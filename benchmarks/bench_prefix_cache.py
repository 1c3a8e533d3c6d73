"""Prefix cache benchmark: eviction time per step, and the Python time of an Engine step.

1. Eviction, the tree alone (PrefixCache over a standalone unified KVCache of 8192 cells and 256
   sequences: ids 0..7 are the slots, 8..255 the tree's): N = 10, 100 or 248 cached prompts (248 is
   every id the tree has), each one of 4 shared 64-token system prompts and 24 tokens of its own; 8
   of them locked as running requests hold them (2 when N = 10). One step is evict(24): the least
   recently used unlocked leaf goes. Each build of the tree gives its first 10 steps; the median
   over 100 steps.
2. An Engine step (SmolLM2-135M, n_ctx 8192, 8 slots): 200 prompts cached first (the same shape,
   32 tokens of their own), then requests that keep the 8 slots busy and 8 more queued, each
   48..79 greedy tokens, so that steps admit, finish and evict. Python time of a step = its wall
   time minus the time inside Context.decode; the median over the measured steps.

It measures the llamax of the current directory, so it runs against the old tree and the new one:

    git worktree add ../llamax-old OLD_COMMIT && (cd ../llamax-old && python setup.py -q build_ext --inplace)
    python benchmarks/bench_prefix_cache.py --against ../llamax-old   # both trees in one run, one table
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.getcwd())  # the llamax of the tree we are run in (old or new), not the installed one

import numpy as np  # noqa: E402

import llamax  # noqa: E402
from llamax import Batch, KVCache  # noqa: E402
from llamax.serving.prefix_cache import PrefixCache  # noqa: E402

N_SLOTS = 8
SYSTEM = [list(range(1000 + 64 * k, 1064 + 64 * k)) for k in range(4)]


def api(engine) -> str:
    """Which serving API the tree we run in has: the old Engine.tree, or the reuse protocol."""
    return "tree (old)" if hasattr(engine, "tree") else "reuse (new)"


# ---- 1. eviction ----------------------------------------------------------------------------------------
def place(mem, tokens, seq, start, rng):
    for ub in mem.plan(Batch(tokens, pos=list(range(start, start + len(tokens))), seq_ids=seq)):
        n = ub.n_tokens
        mem.store(0, ub, rng.standard_normal((n, 1, 8)).astype(np.float32),
                  rng.standard_normal((n, 1, 8)).astype(np.float32))


def build(n_prompts: int, n_locked: int, rng) -> tuple[PrefixCache, list[list[int]]]:
    """A tree holding n_prompts prompts, the last n_locked of them locked; as the Engine builds it,
    each request copies the cached prefix of its prompt and computes the rest."""
    mem = KVCache(1, 1, 8, 8192, n_seq_max=256)
    tree = PrefixCache(mem, range(N_SLOTS, 256))
    prompts = [SYSTEM[i % 4] + list(range(20000 + 24 * i, 20024 + 24 * i)) for i in range(n_prompts)]
    for p in prompts:
        n, src = tree.lookup(p, len(p) - 1)
        if n:
            mem.seq_cp(src, 0, 0, n)
        place(mem, p[n:], 0, n, rng)
        tree.insert(p, 0, len(p))
        mem.seq_rm(0, -1, -1)
    for p in prompts[len(prompts) - n_locked:]:
        tree.lock(p, len(p))
    return tree, prompts


def bench_evict(n_prompts: int, steps: int = 100, per_build: int = 10) -> float:
    """Median seconds of one eviction step (evict(24)) with n_prompts cached."""
    rng = np.random.default_rng(0)
    n_locked = 8 if n_prompts > 10 else 2
    ts: list[float] = []
    while len(ts) < steps:
        tree, _ = build(n_prompts, n_locked, rng)
        for _ in range(min(per_build, n_prompts - n_locked, steps - len(ts))):
            t0 = time.perf_counter()
            freed = tree.evict(24)
            ts.append(time.perf_counter() - t0)
            assert freed == 24, freed
    return statistics.median(ts)


# ---- 2. an Engine step ------------------------------------------------------------------------------------
def bench_step(model_name: str, n_cached: int = 200, measured: int = 60) -> dict:
    model = llamax.Model.load(model_name)
    eng = llamax.Engine(model, n_ctx=8192, n_parallel=N_SLOTS, n_batch=512, max_queue=1024)
    prompt = lambda i: SYSTEM[i % 4] + list(range(2000 + 32 * i, 2032 + 32 * i))  # noqa: E731
    first = [eng.submit(prompt(i), max_tokens=1, temperature=0) for i in range(n_cached)]
    while not all(r.done for r in first):
        eng.step()
    cached = eng.metrics()["cached_prompts"]
    inside = [0.0]
    decode = eng.ctx.decode

    def timed(batch):
        t0 = time.perf_counter()
        try:
            return decode(batch)
        finally:
            inside[0] += time.perf_counter() - t0

    eng.ctx.decode = timed
    nxt = n_cached

    def top_up():
        nonlocal nxt
        while eng.metrics()["queue_len"] < N_SLOTS:
            eng.submit(prompt(nxt), max_tokens=48 + (nxt * 7) % 32, temperature=0, ignore_eos=True)
            nxt += 1

    while eng.metrics()["slots_busy"] < N_SLOTS:
        top_up()
        eng.step()
    m0 = eng.metrics()
    py, wall = [], []
    for _ in range(measured):
        top_up()
        inside[0] = 0.0
        t0 = time.perf_counter()
        eng.step()
        w = time.perf_counter() - t0
        wall.append(w)
        py.append(w - inside[0])
    m1 = eng.metrics()
    return dict(api=api(eng), cached_prompts_before=cached, python_ms=1e3 * statistics.median(py),
                python_ms_mean=1e3 * statistics.mean(py), wall_ms=1e3 * statistics.median(wall),
                finished=m1["requests_finished"] - m0["requests_finished"],
                cached_prompts_after=m1["cached_prompts"])


def run(a) -> dict:
    out = dict(llamax=os.path.dirname(llamax.__file__))
    out["evict_us"] = {str(n): 1e6 * bench_evict(n) for n in a.prompts}
    if not a.no_engine:
        out["step"] = bench_step(a.model)
    return out


def table(results: dict[str, dict]) -> str:
    names = list(results)
    rows = [["", *names]]
    for n in next(iter(results.values()))["evict_us"]:
        rows.append([f"evict step, {n} cached prompts (us)", *(f"{r['evict_us'][n]:.1f}" for r in results.values())])
    if all("step" in r for r in results.values()):
        for k, label in (("python_ms", "Engine step Python time, median (ms)"),
                         ("python_ms_mean", "Engine step Python time, mean (ms)"),
                         ("wall_ms", "Engine step wall time, median (ms)"),
                         ("finished", "requests finished while measured"),
                         ("cached_prompts_after", "cached prompts after")):
            rows.append([label, *(f"{r['step'][k]:.2f}" if isinstance(r["step"][k], float) else str(r["step"][k])
                                  for r in results.values())])
        rows.append(["API", *(r["step"]["api"] for r in results.values())])
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w[i]) for i, c in enumerate(r)) for r in rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompts", type=int, nargs="+", default=[10, 100, 248])
    p.add_argument("--no-engine", action="store_true", help="the tree alone (no model)")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON line")
    p.add_argument("--against", help="another llamax tree (e.g. a worktree of an older commit, built in place): run there too, one table")
    a = p.parse_args()
    results = {}
    if a.against:
        cmd = [sys.executable, os.path.abspath(__file__), "--json", "--model", a.model,
               "--prompts", *map(str, a.prompts)] + (["--no-engine"] if a.no_engine else [])
        res = subprocess.run(cmd, cwd=a.against, check=True, capture_output=True, text=True)
        results[f"old: {a.against}"] = json.loads(res.stdout.strip().splitlines()[-1])
    mine = run(a)
    if a.json:
        print(json.dumps(mine))
        return 0
    results[f"this: {os.getcwd()}"] = mine
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
