"""Prompt processing (pp512) and generation (tg128) of a registry model, llamax beside llama.cpp.

    python benchmarks/bench_model.py [--model smollm2-135m] [--threads 2] [--reps 3]
        [--llama-python /path/to/python-with-llama-cpp-python]

pp512: one decode of 512 tokens into an empty cache (logits for the last); tg128: 128 single-token
decodes from an empty cache, as llama-bench measures them. llama.cpp runs through llama-cpp-python in
a subprocess (its own interpreter, if given with --llama-python), alternating with llamax rep by rep
so both see the same machine load. Prints medians and the llamax / llama.cpp ratios.
"""
import argparse
import json
import statistics
import subprocess
import sys
import time

LLAMA_CPP_SNIPPET = r"""
import json, sys, time
import llama_cpp
path, threads, fa, n_pp, n_tg = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4]), int(sys.argv[5])
llm = llama_cpp.Llama(model_path=path, n_ctx=2048, n_batch=512, n_ubatch=512, n_threads=threads,
                      n_threads_batch=threads, flash_attn=fa, verbose=False)
toks = [(i * 7919) % 40000 + 100 for i in range(n_pp)]
llm.reset(); llm._ctx.kv_cache_clear() if hasattr(llm._ctx, "kv_cache_clear") else None
t0 = time.perf_counter(); llm.eval(toks); pp = time.perf_counter() - t0
llm.reset(); llm._ctx.kv_cache_clear() if hasattr(llm._ctx, "kv_cache_clear") else None
t0 = time.perf_counter()
for i in range(n_tg):
    llm.eval([toks[i]])
tg = time.perf_counter() - t0
print(json.dumps({"pp": n_pp / pp, "tg": n_tg / tg}))
"""


def bench_llamax(model, threads, fa, n_pp, n_tg):
    from llamax import Batch
    from llamax.context import Context

    ctx = Context(model, n_ctx=2048, n_batch=2048, n_ubatch=512, flash_attn=fa, n_threads=threads)
    toks = [(i * 7919) % 40000 + 100 for i in range(n_pp)]
    t0 = time.perf_counter()
    ctx.decode(Batch(toks))
    pp = time.perf_counter() - t0
    ctx.memory.clear()
    t0 = time.perf_counter()
    for i in range(n_tg):
        ctx.decode(Batch([toks[i]]))
    tg = time.perf_counter() - t0
    return {"pp": n_pp / pp, "tg": n_tg / tg}


def bench_llama_cpp(python, path, threads, fa, n_pp, n_tg):
    r = subprocess.run([python, "-c", LLAMA_CPP_SNIPPET, str(path), str(threads), "1" if fa else "0", str(n_pp),
                        str(n_tg)], capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise RuntimeError(f"llama.cpp run failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--pp", type=int, default=512)
    ap.add_argument("--tg", type=int, default=128)
    ap.add_argument("--fa", choices=["on", "off"], default="on")
    ap.add_argument("--llama-python", default=None, help="interpreter with llama-cpp-python (skip llama.cpp if absent)")
    a = ap.parse_args()

    from llamax import models
    from llamax.model import Model

    path = models.path(a.model) if a.model in models.available() else a.model
    model = Model.load(path, n_threads=a.threads)
    fa = a.fa == "on"
    res = {"llamax": [], "llama.cpp": []}
    for _ in range(a.reps):
        res["llamax"].append(bench_llamax(model, a.threads, fa, a.pp, a.tg))
        if a.llama_python:
            res["llama.cpp"].append(bench_llama_cpp(a.llama_python, path, a.threads, fa, a.pp, a.tg))
    print(f"{a.model}, {a.threads} threads, flash attention {a.fa}, f16 cache, median of {a.reps} alternating runs")
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("pp", "tg")} for k, v in res.items() if v}
    for k, v in med.items():
        print(f"  {k:10s} pp{a.pp} {v['pp']:8.1f} t/s   tg{a.tg} {v['tg']:8.1f} t/s")
    if "llama.cpp" in med:
        print(f"  ratio      pp {med['llamax']['pp'] / med['llama.cpp']['pp']:.2f}x   "
              f"tg {med['llamax']['tg'] / med['llama.cpp']['tg']:.2f}x  (llamax / llama.cpp)")


if __name__ == "__main__":
    sys.exit(main())
