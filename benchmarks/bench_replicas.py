"""`llamax serve --replicas N`: prefix-aware routing against round robin on one workload.

The workload (tests/helpers.grouped_chats): chat requests in groups, each group sharing a system
prompt of its own (~220 tokens), sent all at once through the openai client (streamed, greedy), in
a shuffled order. Each routing runs its own fresh server (the caches start empty); the two alternate
rep by rep. Per routing it reports the prompt tokens taken from the replicas' prefix caches
(usage.prompt_tokens_details.cached_tokens) and their share of the prompt, generated tokens per
second over the whole run, requests per second, and TTFT p50 / p95; then the ratios.

    python benchmarks/bench_replicas.py --replicas 2 --threads 1 --groups 4 --per-group 8 --reps 3

A replica's cache (-c) is kept small on purpose, as a busy server's is: it holds about two groups'
system prompts beside its running requests, so where a group's requests land decides what is reused.
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from helpers import grouped_chats, run_chat_workload  # noqa: E402


class Server:
    """`llamax serve --replicas ...` in a subprocess; its URL from the "listening on" line."""

    def __init__(self, args: list[str]) -> None:
        cmd = [sys.executable, "-m", "llamax", "serve", "--port", "0", *args]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                                     env={**os.environ, "LLAMAX_API_KEY": ""})
        self.url: str | None = None
        self.lines: list[str] = []
        ready = threading.Event()

        def read() -> None:
            assert self.proc.stderr is not None
            for line in self.proc.stderr:
                self.lines.append(line)
                m = re.search(r"llamax serve: listening on (http://\S+)", line)
                if m:
                    self.url = m.group(1)
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(300) or self.url is None:
            self.stop()
            raise RuntimeError("llamax serve did not start:\n" + "".join(self.lines[-30:]))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="threads per replica")
    ap.add_argument("-np", "--parallel", type=int, default=4, help="slots per replica")
    ap.add_argument("-c", "--ctx-size", type=int, default=768, help="KV cells per replica")
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--per-group", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=None,
                    help="requests in flight at once (clients arriving as others leave; default: all at once)")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)

    chats = grouped_chats(a.groups, a.per_group, a.seed)
    runs: dict[str, list[dict]] = {"prefix": [], "round_robin": []}
    for rep in range(a.reps):
        for routing in runs:
            srv = Server(["-m", a.model, "--replicas", str(a.replicas), "-t", str(a.threads), "-np", str(a.parallel),
                          "-c", str(a.ctx_size), "--routing", routing])
            try:
                out = run_chat_workload(srv.url, chats, model=a.model, max_tokens=a.max_tokens,
                                        concurrency=a.concurrency)
            finally:
                srv.stop()
            reqs = out["requests"]
            r = dict(cached=sum(x["cached"] for x in reqs), prompt=sum(x["prompt"] for x in reqs),
                     gen=sum(x["completion"] for x in reqs), wall=out["wall"],
                     ttft=[x["ttft"] for x in reqs if x["ttft"] is not None])
            runs[routing].append(r)
            print(f"rep {rep} {routing:<11} cached {r['cached']:>5} / {r['prompt']} prompt tokens, "
                  f"{r['gen'] / r['wall']:.1f} gen t/s, {len(reqs) / r['wall']:.2f} req/s, "
                  f"TTFT p50 {pct(r['ttft'], .5):.2f} s p95 {pct(r['ttft'], .95):.2f} s", file=sys.stderr, flush=True)

    def med(routing: str, f) -> float:
        return statistics.median(f(r) for r in runs[routing])

    print(f"\n{a.replicas} replicas x {a.threads} threads, {a.parallel} slots and {a.ctx_size} cells each; "
          f"{len(chats)} chat requests in {a.groups} groups, {a.max_tokens} tokens each, "
          f"{a.concurrency or len(chats)} at a time; medians of {a.reps}\n")
    print("| routing | cached prompt tokens | share of prompt | gen t/s | req/s | TTFT p50 | TTFT p95 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for routing in runs:
        print(f"| {routing} | {med(routing, lambda r: r['cached']):.0f} | "
              f"{med(routing, lambda r: r['cached'] / r['prompt']):.1%} | {med(routing, lambda r: r['gen'] / r['wall']):.1f} | "
              f"{med(routing, lambda r: len(chats) / r['wall']):.2f} | {med(routing, lambda r: pct(r['ttft'], .5)):.2f} s | "
              f"{med(routing, lambda r: pct(r['ttft'], .95)):.2f} s |")
    cached = [p["cached"] / max(1, q["cached"]) for p, q in zip(runs["prefix"], runs["round_robin"])]
    speed = [(p["gen"] / p["wall"]) / (q["gen"] / q["wall"]) for p, q in zip(runs["prefix"], runs["round_robin"])]
    print(f"\nprefix / round_robin: cached tokens {statistics.median(cached):.2f}x "
          f"({', '.join(f'{x:.2f}' for x in cached)}), throughput {statistics.median(speed):.2f}x "
          f"({', '.join(f'{x:.2f}' for x in speed)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
