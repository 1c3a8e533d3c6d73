"""Serving benchmark: llamax.Engine against llama.cpp on the same continuous-batching workload.

32 requests (a shared 256-token system prompt, a distinct 32-token question each, 64 greedy tokens
each, end-of-generation ignored) on 8 slots. llamax serves them through its Engine with the prefix
cache; llama.cpp (llama-cpp-python's low-level batch API, benchmarks/serving_llama_cpp.py, run in
llama-cpp-python's interpreter) decodes the system prompt once and seq_cp's it into each slot, as
examples/parallel does. The two alternate, rep by rep; the table gives medians and the ratio.

    python benchmarks/bench_serving.py --model smollm2-135m --reps 3 \\
        --llama-python PY
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

import llamax
from llamax import bench, models

HERE = pathlib.Path(__file__).resolve().parent


def llama_cpp_run(py: str, gguf: pathlib.Path, req_file: str, a) -> dict:
    cmd = [py, str(HERE / "serving_llama_cpp.py"), "--model", str(gguf), "--requests-json", req_file,
           "--n-parallel", str(a.n_parallel), "--n-ctx", str(a.n_ctx), "--n-batch", "2048",
           "--n-threads", str(a.threads), "--max-tokens", str(a.max_tokens), "--flash-attn", "on"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--n-parallel", type=int, default=8)
    p.add_argument("--n-system", type=int, default=256)
    p.add_argument("--n-question", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--n-ctx", type=int, default=4096)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("--llama-python", help="llama-cpp-python's interpreter (omit: llamax only)")
    a = p.parse_args()

    model = llamax.Model.load(a.model, n_threads=a.threads)
    system, questions = bench.serving_workload(model, a.requests, a.n_system, a.n_question)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"system": system, "questions": questions}, f)
    runs = {"llamax": [], "llama.cpp": []}
    try:
        for rep in range(a.reps):
            r = bench.run_serving(model, system, questions, n_parallel=a.n_parallel, n_ctx=a.n_ctx,
                                  max_tokens=a.max_tokens, n_threads=a.threads)
            runs["llamax"].append(r)
            print(f"rep {rep} llamax: {r['gen_tps']:.1f} t/s", file=sys.stderr, flush=True)
            if a.llama_python:
                r = llama_cpp_run(a.llama_python, models.path(a.model), f.name, a)
                runs["llama.cpp"].append(r)
                print(f"rep {rep} llama.cpp: {r['gen_tps']:.1f} t/s", file=sys.stderr, flush=True)
    finally:
        os.unlink(f.name)

    def med(name, key):
        return statistics.median(r[key] for r in runs[name])

    print(f"{a.model}: {a.requests} requests, {a.n_parallel} slots, system {a.n_system} + question "
          f"{a.n_question} tokens, {a.max_tokens} generated each, {a.threads} threads, medians of {a.reps}")
    print("| engine | gen t/s | TTFT p50 s | TTFT p95 s | prompt computed / submitted | prefix hit |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, rs in runs.items():
        if not rs:
            continue
        hit = f"{100 * med(name, 'prefix_hit_rate'):.1f}%" if "prefix_hit_rate" in rs[0] else "(seq_cp)"
        print(f"| {name} | {med(name, 'gen_tps'):.1f} | {med(name, 'ttft_p50_s'):.3f} | {med(name, 'ttft_p95_s'):.3f} "
              f"| {med(name, 'prompt_computed'):.0f} / {med(name, 'prompt_submitted'):.0f} | {hit} |")
    if runs["llama.cpp"]:
        ratios = [x["gen_tps"] / y["gen_tps"] for x, y in zip(runs["llamax"], runs["llama.cpp"])]
        print(f"aggregate generation: llamax / llama.cpp = {statistics.median(ratios):.2f}x "
              f"(pairs: {', '.join(f'{x:.2f}' for x in ratios)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
