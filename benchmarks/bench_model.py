"""Prompt processing (pp512) and generation (tg128) of a registry model, llamax beside llama.cpp.

    python benchmarks/bench_model.py [--model smollm2-135m|gemma3-270m] [--threads 2] [--reps 3]
        [--llama-python /path/to/python-with-llama-cpp-python] [--llama-bench /path/to/llama-bench]

pp512: one decode of 512 tokens into an empty cache (logits for the last); tg128: 128 single-token
decodes from an empty cache, as llama-bench measures them. llama.cpp runs through llama-cpp-python in
a subprocess (its own interpreter, if given with --llama-python), and llama.cpp's own llama-bench
(--llama-bench, e.g. built by ../shared/tools/build-llama-cpp.sh), each alternating with llamax rep by
rep so all see the same machine load. Prints medians and the llamax / llama.cpp ratios.
"""
import argparse
import json
import statistics
import subprocess
import sys
import time

LLAMA_CPP_TG = r"""
import json, sys, time
import llama_cpp
path, threads, fa, n_tg = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4])
llm = llama_cpp.Llama(model_path=path, n_ctx=2048, n_threads=threads, n_threads_batch=threads, flash_attn=fa,
                      verbose=False)
bias = {t: -1e9 for t in (0, 1, 2, 106)}  # no end of generation (SmolLM2 and Gemma 3 ids): exactly n_tg decodes
t0 = time.perf_counter()
out = llm.create_completion(prompt=[504], max_tokens=n_tg, temperature=0.0, logit_bias=bias)
dt = time.perf_counter() - t0
print(json.dumps({"tg": out["usage"]["completion_tokens"] / dt}))
"""

LLAMA_CPP_PP = r"""
import json, sys, time
import llama_cpp
path, threads, fa, n_pp = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4])
llm = llama_cpp.Llama(model_path=path, n_ctx=2048, n_batch=512, n_ubatch=512, n_threads=threads,
                      n_threads_batch=threads, flash_attn=fa, verbose=False)
toks = [(i * 7919) % 40000 + 100 for i in range(n_pp)]
llm.eval(toks[:8])  # warm up (graph allocation), then an empty cache again
llm.reset()
t0 = time.perf_counter()
llm.eval(toks)
print(json.dumps({"pp": n_pp / (time.perf_counter() - t0)}))
"""



def bench_llamax(model, threads, fa, n_pp, n_tg):
    from llamax import Batch
    from llamax.context import Context

    ctx = Context(model, n_ctx=2048, n_batch=2048, n_ubatch=512, flash_attn=fa, n_threads=threads)
    toks = [(i * 7919) % 40000 + 100 for i in range(n_pp)]
    ctx.decode(Batch(toks[:8]))  # warm up, then an empty cache again
    ctx.memory.clear()
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
    """llama.cpp's figures through llama-cpp-python; None for a figure whose run crashed (0.3.36 segfaults
    on multi-token batches on this machine; 0.3.16 works)."""
    out = {}
    for key, code, n in (("tg", LLAMA_CPP_TG, n_tg), ("pp", LLAMA_CPP_PP, n_pp)):
        r = subprocess.run([python, "-c", code, str(path), str(threads), "1" if fa else "0", str(n)],
                           capture_output=True, text=True, timeout=900)
        out[key] = json.loads(r.stdout.strip().splitlines()[-1])[key] if r.returncode == 0 else None
    return out


def bench_llama_bench(binary, path, threads, fa, n_pp, n_tg):
    """pp and tg of one llama-bench run (-r 1: one repetition after its warm-up); None where it failed."""
    cmd = [binary, "-m", str(path), "-p", str(n_pp), "-n", str(n_tg), "-t", str(threads), "-fa", "1" if fa else "0",
           "-r", "1", "-o", "json"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    out = {"pp": None, "tg": None}
    if r.returncode == 0:
        for row in json.loads(r.stdout):
            out["pp" if row["n_prompt"] else "tg"] = row["avg_ts"]
    return out


def reference_speed(model_name, fa):
    """llama.cpp's pp512 / tg128 recorded on this kind of machine (shared/reference/*/speed.json)."""
    import os
    from pathlib import Path

    folder = {"smollm2-135m": "smollm2-135m-instruct-q4_1", "gemma3-270m": "gemma-3-270m-q4_k_m"}.get(model_name)
    root = Path(os.environ.get("LLAMAX_REFERENCE_DIR", Path(__file__).resolve().parents[2] / "shared" / "reference"))
    path = root / str(folder) / "speed.json"
    if folder is None or not path.exists():
        return None
    d = json.loads(path.read_text())
    rows = d.get("single") or d.get("result", {}).get("single") or []
    for r in rows:
        if r.get("type_k") == "f16" and r.get("fa_resolved") == ("enabled" if fa else "disabled"):
            return {"pp": r["pp_tok_s"], "tg": r["tg_tok_s"]}
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--pp", type=int, default=512)
    ap.add_argument("--tg", type=int, default=128)
    ap.add_argument("--fa", choices=["on", "off"], default="on")
    ap.add_argument("--llama-python", default=None, help="interpreter with llama-cpp-python (skip llama.cpp if absent)")
    ap.add_argument("--llama-bench", default=None, help="llama.cpp's llama-bench binary, run alternating too")
    a = ap.parse_args()

    from llamax import models
    from llamax.model import Model

    path = models.path(a.model) if a.model in models.available() else a.model
    model = Model.load(path, n_threads=a.threads)
    fa = a.fa == "on"
    res = {"llamax": [], "llama.cpp": [], "llama-bench": []}
    for _ in range(a.reps):
        res["llamax"].append(bench_llamax(model, a.threads, fa, a.pp, a.tg))
        if a.llama_python:
            res["llama.cpp"].append(bench_llama_cpp(a.llama_python, path, a.threads, fa, a.pp, a.tg))
        if a.llama_bench:
            res["llama-bench"].append(bench_llama_bench(a.llama_bench, path, a.threads, fa, a.pp, a.tg))
    print(f"{a.model}, {a.threads} threads, flash attention {a.fa}, f16 cache, median of {a.reps} alternating runs")

    def med(rows, m):
        vals = [r[m] for r in rows if r.get(m) is not None]
        return statistics.median(vals) if vals else None

    ours = {m: med(res["llamax"], m) for m in ("pp", "tg")}
    theirs = {m: med(res["llama.cpp"], m) for m in ("pp", "tg")}
    ref = reference_speed(a.model, fa) or {}
    source = {}
    for m in ("pp", "tg"):
        source[m] = "same run"
        if theirs[m] is None:
            theirs[m] = ref.get(m)
            source[m] = "speed.json (not measurable in this run)" if theirs[m] is not None else "n/a"
    print(f"  llamax     pp{a.pp} {ours['pp']:8.1f} t/s   tg{a.tg} {ours['tg']:8.1f} t/s")
    for m, n in (("pp", a.pp), ("tg", a.tg)):
        if theirs[m] is not None:
            print(f"  llama.cpp  {m}{n} {theirs[m]:8.1f} t/s  [{source[m]}]   llamax / llama.cpp = "
                  f"{ours[m] / theirs[m]:.2f}x")
    bench = {m: med(res["llama-bench"], m) for m in ("pp", "tg")}
    for m, n in (("pp", a.pp), ("tg", a.tg)):
        if bench[m] is not None:
            print(f"  llama-bench {m}{n} {bench[m]:7.1f} t/s  [same run]   llamax / llama-bench = {ours[m] / bench[m]:.2f}x")
    if a.reps > 1:
        for who, rows in res.items():
            for m in ("pp", "tg"):
                vals = sorted(r[m] for r in rows if r.get(m) is not None)
                if vals:
                    print(f"    {who:11s} {m}: min {vals[0]:.1f}  max {vals[-1]:.1f}")


if __name__ == "__main__":
    sys.exit(main())
