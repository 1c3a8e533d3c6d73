"""Prefix reuse beyond the cells: the host-RAM tier (cache_ram) on a KV model, state checkpoints on a
recurrent one, each beside the same workload without it.

    python benchmarks/bench_prefix_tiers.py [--model smollm2-135m] [--prompts 6] [--len 700] [--n-ctx 2048]
        [--recurrent PATH ...] [--chat MODEL ...] [--turns 3] [--reps 3]

KV model: --prompts distinct system prompts of --len tokens, more than --n-ctx cells hold, each asked
two questions in two rounds (one slot): without the tier the second round computes every prompt again;
with it the states evicted from the cells come back from RAM. Recurrent models (GGUF paths, e.g. the
synthetic Mamba / Jamba of tests/synthetic.py): four conversations of --turns turns each (a 600-token
document, then each turn appends the answer and a 40-token question), two slots, with and without
checkpoints (cache_ram 0). --chat runs that chat workload on KV models (registry names or paths) with and
without the host-RAM tier: over Gemma 3's sliding-window cache a kept state comes back whole, for a
conversation's next turn. Prints prompt tokens computed and reused, the wall time (medians of --reps
runs, alternating on and off) and whether the generated tokens are identical.
"""
import argparse
import statistics
import sys
import time

from llamax import Engine, Model

GREEDY = dict(temperature=0, ignore_eos=True)


def prompts(n, length, seed=0):
    return [[1] + [(seed * 7919 + i * 131 + j * 7) % 30000 + 300 for j in range(length)] for i in range(n)]


def kv_workload(model, n_prompts, length, n_ctx, cache_ram):
    eng = Engine(model, n_ctx=n_ctx, n_parallel=1, cache_ram=cache_ram)
    ps = prompts(n_prompts, length)
    t0 = time.perf_counter()
    out = [eng.generate(p + [20 + r, 40 + i], max_tokens=8, **GREEDY) for r in range(2) for i, p in enumerate(ps)]
    dt = time.perf_counter() - t0
    return dt, [o.tokens for o in out], eng.metrics()


def chat_workload(model, turns, cache_ram):
    eng = Engine(model, n_ctx=2048, n_parallel=2, cache_ram=cache_ram)
    convs = [prompts(1, 600, seed=c)[0] for c in range(4)]
    toks = []
    t0 = time.perf_counter()
    for t in range(turns):
        reqs = [eng.submit(c, max_tokens=16, **GREEDY) for c in convs]
        res = [r.result() for r in reqs]
        toks += [r.tokens for r in res]
        convs = [c + r.tokens + prompts(1, 40, seed=100 + 10 * t + i)[0][1:] for i, (c, r) in enumerate(zip(convs, res))]
    return time.perf_counter() - t0, toks, eng.metrics()


def compare(name, run, reps):
    """run(cache_ram) -> (seconds, tokens, metrics); on (default budget) and off alternating."""
    times = {"on": [], "off": []}
    for _ in range(reps):
        for tag, ram in (("off", 0), ("on", None)):
            dt, toks, m = run(ram)
            times[tag].append(dt)
            if tag == "on":
                on_toks, on_m = toks, m
            else:
                off_toks, off_m = toks, m
    on_s, off_s = statistics.median(times["on"]), statistics.median(times["off"])
    print(f"| {name} | {off_m['prompt_tokens']} / {off_m['tokens_reused']} | {on_m['prompt_tokens']} / "
          f"{on_m['tokens_reused']} | {on_m['cache_ram_restores']} | {off_s:.2f} | {on_s:.2f} | {off_s / on_s:.2f}x | "
          f"{'yes' if on_toks == off_toks else 'NO'} |")
    sys.stdout.flush()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--len", type=int, default=700)
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--recurrent", nargs="*", default=[])
    ap.add_argument("--chat", nargs="*", default=[])
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    print("| workload | without: computed / reused | with: computed / reused | restores | without s | with s | "
          "speedup | same tokens |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    if a.model and a.model != "none":
        m = Model.load(a.model, n_threads=a.threads)
        compare(f"{a.model}: {a.prompts} x {a.len}-token prompts, {a.n_ctx} cells, 2 rounds",
                lambda ram: kv_workload(m, a.prompts, a.len, a.n_ctx, ram), a.reps)
    for path in a.recurrent + a.chat:
        m = Model.load(path, n_threads=a.threads)
        compare(f"{m.arch}: 4 chats x {a.turns} turns, 2 slots", lambda ram: chat_workload(m, a.turns, ram), a.reps)


if __name__ == "__main__":
    main()
