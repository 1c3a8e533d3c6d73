"""The decode step's logits product of a registry model's tied Q8_0 output, n_tok 1: the GEMM on the
GGUF rows, the GEMM on the r8 layout the model keeps (csrc/gemm.h), and the float product
(csrc/matmul.h: W dequantized), alternating.

    python benchmarks/bench_output.py [--model gemma3-270m] [--threads 2] [--reps 9]

Prints the median ms and GB/s of weights read for each (the same bits for the two GEMM paths; the
float product takes x unquantized).
"""
import argparse
import time

import numpy as np

import llamax  # noqa: F401  (sets the OpenMP environment before numpy's threads start)
from llamax import models
from llamax._native import gemm, matmul
from llamax.model.gguf import GGUFFile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=9)
    a = ap.parse_args()
    g = GGUFFile(models.path(a.model))
    name = "token_embd.weight"
    raw, t = np.ascontiguousarray(g.raw(name)), g.ggml_type(name)
    n_out, n_in = g.shape(name)
    packed = gemm.pack_r8(raw, t)
    x = np.random.default_rng(0).standard_normal((1, n_in)).astype(np.float32)
    runs = {"gemm (GGUF rows)": lambda: gemm.mul_mat(raw, t, x, n_threads=a.threads),
            "gemm (r8)": lambda: gemm.mul_mat_r8(packed, t, n_out, x, n_threads=a.threads),
            "float product": lambda: matmul.mul_mat(raw, t, x, n_threads=a.threads)}
    times = {k: [] for k in runs}
    for _ in range(a.reps):
        for k, f in runs.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    print(f"{a.model}: {name} {raw.nbytes / 1e6:.0f} MB, n_tok 1, {a.threads} threads, median of {a.reps}")
    for k, v in times.items():
        m = float(np.median(v))
        print(f"  {k:18s} {m * 1e3:7.2f} ms  {raw.nbytes / m / 1e9:5.1f} GB/s")


if __name__ == "__main__":
    main()
