"""Prompt processing (pp512) and generation (tg128) of a registry model, llamax beside llama.cpp.

    python benchmarks/bench_model.py [--model smollm2-135m|gemma3-270m] [--threads 2] [--reps 3]
        [--llama-python /path/to/python-with-llama-cpp-python] [--llama-bench /path/to/llama-bench]

pp512: one decode of 512 tokens into an empty cache (logits for the last); tg128: 128 single-token
decodes from an empty cache, as llama-bench measures them. llama.cpp runs through llama-cpp-python in
a subprocess (its own interpreter, if given with --llama-python), and llama.cpp's own llama-bench
(--llama-bench, e.g. built by ../shared/tools/build-llama-cpp.sh), each alternating with llamax rep by
rep so all see the same machine load. Prints the CPU and SIMD level, then one table: the medians and
the llamax / llama.cpp ratios (llama-cpp-python's figure from shared/reference's speed.json when it
cannot run here).
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
    """pp and tg of one llama-bench rep each (bench_llama.run_llama_bench: -r 1 after its warm-up)."""
    from llamax.bench import BenchTest
    from llamax.bench_llama import run_llama_bench

    cfg = dict(n_threads=threads, type_k="f16", type_v="f16", flash_attn=fa, n_batch=2048, n_ubatch=512)
    return {"pp": run_llama_bench(binary, path, BenchTest(n_prompt=n_pp), cfg),
            "tg": run_llama_bench(binary, path, BenchTest(n_gen=n_tg), cfg)}


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
    from llamax.bench import table
    from llamax.bench_llama import machine_line

    def med(rows, m):
        vals = [r[m] for r in rows if r.get(m) is not None]
        return statistics.median(vals) if vals else None

    print(f"{machine_line()}; {a.model}, {a.threads} threads, flash attention {a.fa}, f16 cache, medians of "
          f"{a.reps} alternating reps\n")
    ref = reference_speed(a.model, fa) or {}
    rows = []
    for m, n in (("pp", a.pp), ("tg", a.tg)):
        ours = med(res["llamax"], m)
        row = {"test": f"{m}{n}", "llamax": ours, "bench": med(res["llama-bench"], m),
               "cpp": med(res["llama.cpp"], m), "cpp_src": "same run"}
        if row["cpp"] is None and ref.get(m) is not None and n == (512 if m == "pp" else 128):
            row["cpp"], row["cpp_src"] = ref[m], "speed.json"
        vals = sorted(r[m] for r in res["llamax"])
        row["range"] = f"{vals[0]:.1f}-{vals[-1]:.1f}"
        rows.append(row)

    def num(v):
        return "-" if v is None else f"{v:.1f}"

    def ratio(r, k):
        return "-" if r[k] is None else f"{r['llamax'] / r[k]:.2f}x"

    cols = [("test", False, lambda r: r["test"]), ("llamax t/s", True, lambda r: num(r["llamax"])),
            ("llamax min-max", True, lambda r: r["range"]),
            ("llama-bench t/s", True, lambda r: num(r["bench"])),
            ("llamax / llama-bench", True, lambda r: ratio(r, "bench")),
            ("llama-cpp-python t/s", True, lambda r: num(r["cpp"]) + ("" if r["cpp"] is None or r["cpp_src"] ==
                                                                         "same run" else " (speed.json)")),
            ("llamax / llama-cpp-python", True, lambda r: ratio(r, "cpp"))]
    print(table(cols, rows))

if __name__ == "__main__":
    sys.exit(main())
