"""HTTP serving benchmark: `llamax serve` against llama.cpp's llama-server, one client script for both.

The workload of the Engine benchmark, as chat requests: 32 requests, each the same system prompt
(about 256 tokens of library help-desk text) and a distinct question, 64 greedy tokens each with
end-of-generation ignored, all sent at once to a server with 8 slots and 4096 cells. The client is
the openai package's AsyncOpenAI, streaming over loopback; a request's TTFT is from its send to its
first chunk with text; aggregate t/s is all generated tokens over the wall time of the whole burst.
Each server is started, warmed with one short request, measured, and stopped before the next one
starts, so the two never share the cores; they alternate rep by rep. llama-server runs with -np 8
-cb --cache-prompt (its unified KV cache is the default), with flash attention on and off since its
faster setting differs by model; the ratio is against its best median. For a GGUF without a chat
template, llama-server is given llamax's built-in choice (--no-jinja --chat-template gemma for Gemma 3), so
both compute the same prompts.

    python benchmarks/bench_server.py --model smollm2-135m --reps 3 \\
        --llama-server "$(bash ../shared/tools/build-llama-cpp.sh)/llama-server"
"""
from __future__ import annotations

import argparse
import asyncio
import os
import re
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx
import openai

from llamax import Model, bench, models
from llamax.model.chat import builtin_for_arch


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A server process; ready when /health answers 200."""

    def __init__(self, cmd: list[str], port: int | None) -> None:
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self.url = f"http://127.0.0.1:{port}" if port else None
        self._seen = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and self.proc.poll() is None:
            if self.url is None:
                self._seen.wait(0.2)
                continue
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"{cmd[0]} did not start:\n" + "".join(self.lines[-30:]))

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            m = re.search(r"llamax serve: listening on (http://\S+)", line)
            if m:
                self.url = m.group(1)
                self._seen.set()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def workload(n_requests: int, n_system_words: int) -> tuple[str, list[str]]:
    system = bench.SERVING_SYSTEM_TEXT
    while len(system.split()) < n_system_words:
        system += bench.SERVING_SYSTEM_TEXT
    questions = [f"Question {i}: may I borrow {i + 2} books for {3 * i + 7} days, and what does a late return of "
                 f"item number {1000 + 37 * i} cost?" for i in range(n_requests)]
    return system, questions


async def burst(url: str, system: str, questions: list[str], max_tokens: int) -> dict:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=900)
    warm = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hello"}],
                                                max_tokens=4, temperature=0)
    assert warm.choices

    async def one(q: str) -> tuple[float, int, int, int]:
        t0 = time.perf_counter()
        stream = await client.chat.completions.create(
            model="m", messages=[{"role": "system", "content": system}, {"role": "user", "content": q}],
            max_tokens=max_tokens, temperature=0, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        ttft, pieces, usage = None, 0, None
        async for c in stream:
            if c.choices and c.choices[0].delta.content:
                pieces += 1
                if ttft is None:
                    ttft = time.perf_counter() - t0
            usage = c.usage or usage
        n_gen = usage.completion_tokens if usage else pieces
        cached = (usage.prompt_tokens_details.cached_tokens or 0) if usage and usage.prompt_tokens_details else 0
        return ttft if ttft is not None else time.perf_counter() - t0, n_gen, usage.prompt_tokens if usage else 0, cached

    t0 = time.perf_counter()
    out = await asyncio.gather(*(one(q) for q in questions))
    wall = time.perf_counter() - t0
    await client.close()
    ttfts = sorted(x[0] for x in out)
    gen = sum(x[1] for x in out)
    return dict(gen_tps=gen / wall, wall_s=wall, gen=gen, ttft_p50_s=statistics.median(ttfts),
                ttft_p95_s=ttfts[min(len(ttfts) - 1, int(round(0.95 * (len(ttfts) - 1))))],
                prompt=sum(x[2] for x in out), cached=sum(x[3] for x in out))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--n-parallel", type=int, default=8)
    p.add_argument("--n-ctx", type=int, default=4096)
    p.add_argument("--system-words", type=int, default=190, help="system prompt length (about 256 tokens)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--llama-server", help="llama.cpp's llama-server binary (omit: llamax only)")
    p.add_argument("--llama-fa", default="on,off", help="llama-server's -fa settings to run (default on,off)")
    p.add_argument("--llama-swa-full", action="store_true",
                   help="also run llama-server with --swa-full (a sliding-window model: its prompt cache needs it)")
    a = p.parse_args()

    gguf = models.path(a.model)
    model = Model.load(a.model)
    # a GGUF without a chat template: llama-server falls back to chatml, llamax to the architecture's
    # own format (gemma for Gemma); give llama-server the same one so both compute the same prompts
    template = [] if model.chat_template else ["--no-jinja", "--chat-template", builtin_for_arch(model.arch)]
    del model
    system, questions = workload(a.requests, a.system_words)
    common = ["-np", str(a.n_parallel), "-c", str(a.n_ctx), "-t", str(a.threads)]
    servers = {"llamax": lambda: Proc([sys.executable, "-m", "llamax", "serve", "-m", a.model, "--port", "0",
                                       "-fa", "on", *common], None)}
    if a.llama_server:
        for fa in a.llama_fa.split(","):
            for swa in ([], ["--swa-full"]) if a.llama_swa_full else ([],):
                def start(fa=fa, swa=swa):
                    port = free_port()
                    return Proc([a.llama_server, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
                                 *common, "-cb", "--cache-prompt", "-fa", fa, *swa, *template], port)
                servers[f"llama-server fa {fa}{' ' + swa[0] if swa else ''}"] = start
    runs: dict[str, list[dict]] = {k: [] for k in servers}
    for rep in range(a.reps):
        for name, start in servers.items():
            srv = start()
            try:
                r = asyncio.run(burst(srv.url, system, questions, a.max_tokens))
            finally:
                srv.stop()
            runs[name].append(r)
            print(f"rep {rep} {name}: {r['gen_tps']:.1f} t/s, TTFT p50 {r['ttft_p50_s']:.2f} s p95 "
                  f"{r['ttft_p95_s']:.2f} s, cached {r['cached']}/{r['prompt']}", file=sys.stderr, flush=True)

    def med(name, key):
        return statistics.median(r[key] for r in runs[name])

    print(f"{a.model}: {a.requests} chat requests over HTTP (openai client, streaming), {a.n_parallel} slots, "
          f"{a.n_ctx} cells, {a.max_tokens} tokens each, {a.threads} threads, medians of {a.reps}")
    print("| server | gen t/s | TTFT p50 s | TTFT p95 s | cached / prompt tokens |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name in runs:
        print(f"| {name} | {med(name, 'gen_tps'):.1f} | {med(name, 'ttft_p50_s'):.2f} | {med(name, 'ttft_p95_s'):.2f} "
              f"| {med(name, 'cached'):.0f} / {med(name, 'prompt'):.0f} |")
    others = [n for n in runs if n != "llamax"]
    if others:
        best = max(others, key=lambda n: med(n, "gen_tps"))
        ratios = [x["gen_tps"] / y["gen_tps"] for x, y in zip(runs["llamax"], runs[best])]
        print(f"aggregate: llamax / {best} (its best) = {statistics.median(ratios):.2f}x "
              f"(pairs: {', '.join(f'{x:.2f}' for x in ratios)}); TTFT p95 {med('llamax', 'ttft_p95_s'):.2f} s "
              f"vs {med(best, 'ttft_p95_s'):.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
