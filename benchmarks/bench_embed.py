"""Embeddings throughput: llamax.embed against llama.cpp's (llama-cpp-python's Llama.embed) on the same
inputs, alternating, and the agreement of the vectors.

Workload: --inputs texts of 40-120 tokens (library help-desk sentences, each distinct), mean pooling,
L2-normalized, n_threads 2, one call with every input (llamax decodes them together in one context,
each its own sequence; llama-cpp-python with n_seq_max = inputs and n_batch = n_ubatch = 2048 does the
same). Each round times one call on each side, the model already loaded (llama.cpp's side runs in the
interpreter given by --llama-python, its clock around the call alone). Prints the median tokens per
second of each, their ratio, and the smallest cosine between the two sides' vectors.

    PYTHONPATH=. python benchmarks/bench_embed.py --llama-python /path/to/python-with-llama-cpp-python \\
        [--model smollm2-135m] [--inputs 32] [--rounds 5]
"""
import argparse
import json
import statistics
import subprocess
import time

import numpy as np

import llamax
from llamax import models

LLAMA_CPP_SIDE = r"""
import json, sys, time
import numpy as np
from llama_cpp import Llama, LLAMA_POOLING_TYPE_MEAN
a = json.loads(sys.stdin.read())
llm = Llama(a["path"], embedding=True, pooling_type=LLAMA_POOLING_TYPE_MEAN, n_ctx=a["n_ctx"], n_batch=2048,
            n_ubatch=2048, n_seq_max=len(a["inputs"]), n_threads=2, verbose=False)
llm.embed(a["inputs"][:2], normalize=True)  # warm-up
times = []
for _ in range(a["reps"]):
    t0 = time.perf_counter()
    v = llm.embed(a["inputs"], normalize=True)
    times.append(time.perf_counter() - t0)
np.save(a["out"], np.asarray(v, np.float32))
print(json.dumps(times))
"""


def texts(n: int) -> list[str]:
    base = ("Members may borrow up to {k} books for {d} days; a renewal adds {r} more days unless someone has "
            "reserved the item, and the reading room on floor {f} stays open until {h} in the evening.")
    return [" ".join([base.format(k=i + 2, d=7 + i, r=3 + i % 5, f=1 + i % 4, h=6 + i % 4)] * (1 + i % 3))
            for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=models.DEFAULT)
    ap.add_argument("--inputs", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--llama-python", help="an interpreter with llama-cpp-python: time llama.cpp's side too")
    a = ap.parse_args()
    model = llamax.Model.load(a.model, n_threads=2)
    inputs = texts(a.inputs)
    n_tok = sum(len(model.tokenize(t, add_special=True, parse_special=False)) for t in inputs)
    llamax.embed(model, inputs[:2])  # warm-up
    ours, theirs, vec = [], [], None
    for _ in range(a.rounds):
        t0 = time.perf_counter()
        vec = llamax.embed(model, inputs, pooling="mean")
        ours.append(time.perf_counter() - t0)
        if a.llama_python:
            out = "/tmp/llamax_bench_embed.npy"
            job = dict(path=str(model.path), inputs=inputs, n_ctx=max(2048, n_tok + 64), reps=1, out=out)
            run = subprocess.run([a.llama_python, "-c", LLAMA_CPP_SIDE], input=json.dumps(job), text=True,
                                 capture_output=True, check=True)
            theirs += json.loads(run.stdout.strip().splitlines()[-1])
            ref = np.load(out)
    print(f"{a.model}: {a.inputs} inputs, {n_tok} tokens, mean pooling, 2 threads, median of {a.rounds}")
    ts = statistics.median(ours)
    print(f"  llamax     {ts * 1e3:9.1f} ms  {n_tok / ts:8.1f} tokens/s")
    if theirs:
        tl = statistics.median(theirs)
        cos = float(np.min(np.sum(vec * ref, axis=1)))
        print(f"  llama.cpp  {tl * 1e3:9.1f} ms  {n_tok / tl:8.1f} tokens/s   ratio {tl / ts:.2f}x   min cosine {cos:.5f}")


if __name__ == "__main__":
    main()
