"""Quality and speed of the quantized KV caches (q8_0, q4_0) against llamax's own f16 cache.

    python benchmarks/bench_kv_quant.py [--model smollm2-135m] [--threads 2] [--reps 3]
        [--depths 2048,8192] [--tg 32] [--no-quality] [--no-speed]
        [--llama-python /path/to/python-with-llama-cpp-python]

Quality: each of llama.cpp's reference prompts (shared/reference/<model>/ref_logits.json) is decoded
with logits at every position, once per cache type; against the f16 cache: the share of positions whose
top-1 token agrees, and the mean KL divergence KL(p_f16 || p_quant) over positions (nats). Quantized
types run with and without the Hadamard rotation (llama.cpp's attn_rot_k / attn_rot_v).

Speed: generation tokens/s with `depth` tokens already cached (the cache is filled by one prefill,
then --tg single-token decodes are timed), per type, reps alternating between types so all see the
same machine load; medians and the ratio to f16 in the same run. With --llama-python, llama.cpp's
tg at the same depths (llama-cpp-python's type_k / type_v) runs beside it.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

TYPES = ("f16", "q8_0", "q4_0")
GGML_TYPE = {"f16": 1, "q8_0": 8, "q4_0": 2}

LLAMA_CPP_TG = r"""
import json, sys, time
import llama_cpp
path, threads, depth, n_tg, t = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
llm = llama_cpp.Llama(model_path=path, n_ctx=depth + n_tg + 256, n_batch=512, n_ubatch=512, n_threads=threads,
                      n_threads_batch=threads, flash_attn=True, type_k=t, type_v=t, verbose=False)
toks = [(i * 7919) % 40000 + 100 for i in range(depth)]
llm.eval(toks)
nxt = [(i * 104729) % 40000 + 100 for i in range(n_tg)]
t0 = time.perf_counter()
for tok in nxt:
    llm.eval([tok])
print(json.dumps({"tg": n_tg / (time.perf_counter() - t0)}))
"""


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def quality(model, threads: int) -> None:
    from llamax import Batch
    from llamax.context import Context

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from helpers import reference_dir

    meta = json.loads((reference_dir("smollm2-135m-instruct-q4_1") / "ref_logits.json").read_text())
    configs = [("f16", None)] + [(t, rot) for t in TYPES[1:] for rot in (True, False)]
    print(f"{'prompt':12s} {'cache':16s} {'top-1 agree':>12s} {'mean KL':>10s} {'max KL':>10s}")
    totals = {}
    for p in meta["prompts"]:
        toks = p["tokens"]
        base = None
        for t, rot in configs:
            os.environ["LLAMAX_ATTN_ROT_DISABLE"] = "1" if rot is False else "0"
            try:
                ctx = Context(model, n_ctx=2048, flash_attn=True, type_k=t, type_v=t, n_threads=threads)
            finally:
                os.environ.pop("LLAMAX_ATTN_ROT_DISABLE", None)
            ctx.decode(Batch(toks, logits=[True] * len(toks)))
            lp = log_softmax(ctx.get_logits())
            if base is None:
                base = lp
                continue
            kl = (np.exp(base) * (base - lp)).sum(axis=-1)
            agree = float((lp.argmax(1) == base.argmax(1)).mean())
            label = f"{t}{' rot' if rot else ' no-rot'}"
            tot = totals.setdefault(label, [0, 0, 0.0])
            tot[0] += int((lp.argmax(1) == base.argmax(1)).sum())
            tot[1] += len(toks)
            tot[2] += float(kl.sum())
            print(f"{p['name']:12s} {label:16s} {agree:12.4f} {kl.mean():10.5f} {kl.max():10.5f}", flush=True)
    for label, (a, n, k) in totals.items():
        print(f"{'all':12s} {label:16s} {a / n:12.4f} {k / n:10.5f}   ({n} positions)")


def tg_llamax(model, t: str, depth: int, n_tg: int, threads: int) -> float:
    from llamax import Batch
    from llamax.context import Context

    ctx = Context(model, n_ctx=depth + n_tg + 256, n_batch=512, n_ubatch=512, flash_attn=True, type_k=t, type_v=t,
                  n_threads=threads)
    toks = [(i * 7919) % 40000 + 100 for i in range(depth)]
    for s in range(0, depth, 512):
        ctx.decode(Batch(toks[s:s + 512]))
    nxt = [(i * 104729) % 40000 + 100 for i in range(n_tg)]
    t0 = time.perf_counter()
    for tok in nxt:
        ctx.decode(Batch([tok]))
    return n_tg / (time.perf_counter() - t0)


def tg_llama_cpp(python: str, path: str, t: str, depth: int, n_tg: int, threads: int) -> float | None:
    r = subprocess.run([python, "-c", LLAMA_CPP_TG, str(path), str(threads), str(depth), str(n_tg),
                        str(GGML_TYPE[t])], capture_output=True, text=True)
    if r.returncode != 0:
        print(f"  llama.cpp {t} at {depth}: failed ({r.stderr.strip().splitlines()[-1:]})", file=sys.stderr)
        return None
    return json.loads(r.stdout.strip().splitlines()[-1])["tg"]


def speed(model, path, threads: int, reps: int, depths: list[int], n_tg: int, llama_python: str | None) -> None:
    for depth in depths:
        res: dict[str, list[float]] = {}
        for _ in range(reps):
            for t in TYPES:
                res.setdefault(f"llamax {t}", []).append(tg_llamax(model, t, depth, n_tg, threads))
                if llama_python:
                    v = tg_llama_cpp(llama_python, path, t, depth, n_tg, threads)
                    if v is not None:
                        res.setdefault(f"llama.cpp {t}", []).append(v)
        print(f"\ntg{n_tg} at {depth} cached tokens, {threads} threads, medians of {reps}:")
        for who in ("llamax", "llama.cpp"):
            f16 = res.get(f"{who} f16")
            for t in TYPES:
                v = res.get(f"{who} {t}")
                if v:
                    m = statistics.median(v)
                    ratio = f"  {m / statistics.median(f16):.2f}x of f16" if f16 else ""
                    print(f"  {who:9s} {t:5s} {m:7.1f} t/s{ratio}")
        for t in TYPES:
            a, b = res.get(f"llamax {t}"), res.get(f"llama.cpp {t}")
            if a and b:
                print(f"  llamax / llama.cpp {t}: {statistics.median(a) / statistics.median(b):.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--depths", default="2048,8192")
    ap.add_argument("--tg", type=int, default=32)
    ap.add_argument("--no-quality", action="store_true")
    ap.add_argument("--no-speed", action="store_true")
    ap.add_argument("--llama-python", default=None)
    a = ap.parse_args()
    from llamax import models
    from llamax.model import Model

    path = models.path(a.model) if a.model in models.available() else a.model
    model = Model.load(path, n_threads=a.threads)
    if not a.no_quality:
        quality(model, a.threads)
    if not a.no_speed:
        speed(model, path, a.threads, a.reps, [int(d) for d in a.depths.split(",")], a.tg, a.llama_python)


if __name__ == "__main__":
    main()
