"""Benchmark of gemm.mul_mat (csrc/gemm.h: bit-identical quantized GEMM, any batch size) against
matmul.mul_mat (the float product: x times W dequantized tile by tile) and numpy BLAS on a float32
copy of W, on real SmolLM2-135M and Gemma-3-270M tensors (the registry's GGUFs, pulled on first use).

Prints, per tensor and n_tok, the median time (ms) and GF = 2 n_tok n_out n_in / time / 1e9 of
each. Run: python benchmarks/bench_gemm.py [--threads 2] [--runs 15] [--ntok 1,4,16,64,512]
[--only smollm2-135m:blk.0.ffn_down,gemma3-270m:blk.0.ffn_down]
"""
from __future__ import annotations

import argparse
import os

import numpy as np
from timing import median_time

from llamax._native import cpu, gemm, matmul
from llamax.model import Model

TENSORS = {
    "smollm2-135m": ["blk.0.ffn_down.weight", "blk.0.ffn_up.weight", "blk.0.attn_q.weight"],
    "gemma3-270m": ["blk.0.ffn_up.weight", "blk.0.attn_q.weight", "blk.0.attn_v.weight",
                    "blk.0.attn_output.weight", "blk.0.ffn_down.weight", "blk.2.ffn_down.weight"],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--ntok", default="1,4,16,64,512")
    ap.add_argument("--only", default="", help="comma-separated substrings of model:tensor to run")
    args = ap.parse_args()
    nth = args.threads
    os.environ.setdefault("OMP_NUM_THREADS", str(nth))
    ntoks = [int(v) for v in args.ntok.split(",")]
    rng = np.random.default_rng(0)
    print(f"threads {nth}, gemm simd level {cpu.LEVEL_NAMES[cpu.simd_level()]}, median of {args.runs} runs")
    print(f"{'tensor':34s} {'type':5s} {'n_tok':>5s} | {'gemm ms':>8s} {'GF':>6s} | "
          f"{'float ms':>10s} {'GF':>6s} | {'BLAS ms':>8s} {'GF':>6s}")
    for model, names in TENSORS.items():
        g = Model.load(model).gguf
        for name in names:
            if args.only and not any(k in f"{model}:{name}" for k in args.only.split(",")):
                continue
            t = int(g.ggml_type(name))
            raw = np.ascontiguousarray(g.raw(name))
            wf = np.ascontiguousarray(g.f32(name, nth))
            n_out, n_in = wf.shape
            tname = gemm.W_TYPES.get(t, str(t))
            for n_tok in ntoks:
                x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
                flops = 2.0 * n_tok * n_out * n_in
                runs = args.runs if n_tok < 256 else max(5, args.runs // 2)
                if gemm.supported(t):
                    yg = np.empty((n_tok, n_out), np.float32)
                    tg = median_time(lambda: gemm.mul_mat(raw, t, x, out=yg, n_threads=nth), runs)
                    gcol = f"{tg * 1e3:8.3f} {flops / tg / 1e9:6.1f}"
                else:
                    gcol = f"{'-':>8s} {'-':>6s}"
                ym = np.empty((n_tok, n_out), np.float32)
                tm = median_time(lambda: matmul.mul_mat(raw, t, x, out=ym, n_threads=nth), runs)
                tb = median_time(lambda: x @ wf.T, runs)
                print(f"{model + ':' + name:34s} {tname:5s} {n_tok:5d} | {gcol} | "
                      f"{tm * 1e3:10.3f} {flops / tm / 1e9:6.1f} | {tb * 1e3:8.3f} {flops / tb / 1e9:6.1f}",
                      flush=True)


if __name__ == "__main__":
    main()
