"""Benchmark of the quantized weight products of a decode step (gemm.product: csrc/product.h's
engine for the type, the GEMM for every integer type).

y = x @ W.T with W in its GGUF blocks, at SmolLM2-135M's shapes (Q4_1 layers, the tied Q8_0
output 576 -> 49152), for n_tok = 1 and 4 tokens, 1 and 2 threads. Reported: the median time and
the GB/s of weight bytes read (W's stored bytes / time), next to the numpy baseline measured in the
same run: x @ W_f32.T on weights dequantized to float32 beforehand (OpenBLAS sgemm with the same
thread count; it reads 4 / 0.625 = 6.4x the bytes of Q4_1). "float" is matmul.mul_mat (float x,
W dequantized tile by tile: the engine of the types without an integer product) on the same W.
--type NAME (e.g. q5_1) gives the hot shapes random blocks of that type instead of the file's.

Two settings:
  - hot: one weight matrix multiplied again and again (it stays in cache: compute-bound figures);
  - sweep: the weights of all 30 layers (7 products each) and the output, each product once in
    turn, as a decode step reads them (W from the GGUF's file mapping: memory-bound figures).
For scale: a plain memory copy (np.copyto of 256 MiB; read + write bytes counted).

Weights are the real SmolLM2 tensors (the registry's GGUF, pulled on first use, or --gguf PATH);
a hot shape the file lacks gets random blocks of its type.

    python benchmarks/bench_matmul.py [--quick] [--gguf PATH] [--type q5_1]
"""
from __future__ import annotations

import argparse
import ctypes
import glob
import os
from pathlib import Path

import numpy as np
from timing import median_time

from llamax._native import cpu, gemm
from llamax._native import matmul as M
from llamax._native import quants as Q

SHAPES = [  # (what, tensor of block 0, n_in, n_out, type)
    ("attn_q / attn_output", "blk.0.attn_q.weight", 576, 576, Q.TYPE_Q4_1),
    ("attn_k / attn_v", "blk.0.attn_k.weight", 576, 192, Q.TYPE_Q4_1),
    ("ffn_gate / ffn_up", "blk.0.ffn_up.weight", 576, 1536, Q.TYPE_Q4_1),
    ("ffn_down", "blk.0.ffn_down.weight", 1536, 576, Q.TYPE_Q4_1),
    ("output (tied embd)", "token_embd.weight", 576, 49152, Q.TYPE_Q8_0),
]
LAYER_TENSORS = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]


# ---- OpenBLAS threads (numpy's bundled scipy-openblas), so the baseline uses the same count ----

def _openblas_setter():
    import numpy

    libs = glob.glob(os.path.join(os.path.dirname(numpy.__file__), "..", "numpy.libs", "*openblas*"))
    for lib in libs:
        try:
            h = ctypes.CDLL(lib)
        except OSError:
            continue
        for sym in ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_", "openblas_set_num_threads"):
            fn = getattr(h, sym, None)
            if fn is not None:
                fn.argtypes = [ctypes.c_int]
                return fn
    return None


SET_BLAS_THREADS = _openblas_setter()


def blas_threads(n: int) -> None:
    if SET_BLAS_THREADS is not None:
        SET_BLAS_THREADS(n)


# ---- helpers --------------------------------------------------------------------------------------

def find_gguf(arg: str | None) -> Path:
    """--gguf, else SmolLM2-135M from the model registry (pulled on first use)."""
    from llamax import models

    return Path(arg) if arg else models.path("smollm2-135m")


def random_weight(t: int, n_out: int, n_in: int, rng: np.random.Generator) -> np.ndarray:
    """Blocks quantized by gguf from gaussian weights (so scales and quants are realistic)."""
    import gguf
    from gguf import quants as gq

    w = (rng.standard_normal((n_out, n_in)) * 0.05).astype(np.float32)
    return gq.quantize(w, gguf.GGMLQuantizationType(t))


def memcpy_gbs() -> float:
    a = np.ones(256 << 20, np.uint8)
    b = np.empty_like(a)
    t = median_time(lambda: np.copyto(b, a), 5)
    return 2 * a.nbytes / t / 1e9


# ---- benchmarks -------------------------------------------------------------------------------------

def bench_hot(tensors: dict, quick: bool, w_type: int | None = None) -> None:
    rng = np.random.default_rng(0)
    print("hot (one W, in cache):   ours = gemm.product | float = matmul.mul_mat | numpy x @ W_f32.T (OpenBLAS)")
    print(f"{'product':20s} {'n_in->n_out':>12s} {'type':>5s} {'tok':>3s} {'thr':>3s} "
          f"{'ours ms':>8s} {'GB/s':>6s} {'float ms':>9s} {'numpy ms':>9s} {'GB/s':>6s} {'numpy/ours':>10s}")
    for what, tname, n_in, n_out, t in SHAPES:
        t = t if w_type is None else w_type
        raw = tensors.get(tname) if w_type is None else None
        if raw is None:
            raw = random_weight(t, n_out, n_in, rng)
        raw = np.ascontiguousarray(raw)
        w32 = Q.dequantize(t, raw, (n_out, n_in))
        for n_tok in (1, 4):
            x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
            out = np.empty((n_tok, n_out), np.float32)
            for nth in (1, 2):
                rep = 20 if quick else (60 if raw.nbytes > 4e6 else 400)
                ours = median_time(lambda: gemm.product(raw, t, x, n_threads=nth), rep)
                f32a = median_time(lambda: M.mul_mat(raw, t, x, out=out, n_threads=nth), rep)
                blas_threads(nth)
                npy = median_time(lambda: np.matmul(x, w32.T, out=out), rep)
                print(f"{what:20s} {f'{n_in}->{n_out}':>12s} {Q.TYPE_NAMES[t]:>5s} {n_tok:3d} {nth:3d} "
                      f"{ours * 1e3:8.4f} {raw.nbytes / ours / 1e9:6.1f} {f32a * 1e3:9.4f} "
                      f"{npy * 1e3:9.4f} {w32.nbytes / npy / 1e9:6.1f} {npy / ours:10.2f}")
    blas_threads(2)


def bench_sweep(reader, quick: bool) -> None:
    """Every weight product of one decode step, each W read once, from the file mapping."""
    tensors = {t.name: t for t in reader.tensors}
    n_layer = sum(1 for n in tensors if n.endswith(".attn_q.weight"))
    prods = []
    for i in range(n_layer):
        for nm in LAYER_TENSORS:
            t = tensors[f"blk.{i}.{nm}.weight"]
            prods.append((np.asarray(t.data), int(t.tensor_type), int(t.shape[0])))
    emb = tensors["token_embd.weight"]
    prods.append((np.asarray(emb.data), int(emb.tensor_type), int(emb.shape[0])))
    total = sum(p[0].nbytes for p in prods)
    print(f"\nsweep: {len(prods)} products ({n_layer} layers x 7 + output), {total / 1e6:.1f} MB of weights "
          f"per step, W read from the GGUF mapping")
    w32s = [Q.dequantize(ty, raw, (raw.shape[0], n_in)) for raw, ty, n_in in prods]
    total32 = sum(w.nbytes for w in w32s)
    rng = np.random.default_rng(1)
    print(f"{'tok':>3s} {'thr':>3s} {'ours ms':>8s} {'GB/s':>6s} {'float ms':>9s} "
          f"{'numpy ms':>9s} {'GB/s':>6s} {'numpy/ours':>10s}")
    for n_tok in (1, 4):
        xs = {n_in: rng.standard_normal((n_tok, n_in)).astype(np.float32) for n_in in (576, 1536)}
        for nth in (1, 2):
            def ours(float_product=False):
                for raw, ty, n_in in prods:
                    if float_product:
                        M.mul_mat(raw, ty, xs[n_in], n_threads=nth)
                    else:
                        gemm.product(raw, ty, xs[n_in], n_threads=nth)

            def npy():
                for (raw, ty, n_in), w in zip(prods, w32s):
                    xs[n_in] @ w.T

            rep = 3 if quick else 9
            a = median_time(ours, rep)
            b = median_time(lambda: ours(True), rep)
            blas_threads(nth)
            c = median_time(npy, max(3, rep // 3))
            print(f"{n_tok:3d} {nth:3d} {a * 1e3:8.2f} {total / a / 1e9:6.1f} {b * 1e3:9.2f} "
                  f"{c * 1e3:9.2f} {total32 / c / 1e9:6.1f} {c / a:10.2f}")
    blas_threads(2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--gguf", help="path of SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--type", help="a weight type name (q5_1, q4_K, ...) for the hot shapes' random blocks")
    args = ap.parse_args()
    print(f"simd level {cpu.LEVEL_NAMES[cpu.simd_level()]}; "
          f"OpenBLAS threads {'set per row' if SET_BLAS_THREADS else 'not settable (its default)'}")
    print(f"memory copy (np.copyto 256 MiB, read + write): {memcpy_gbs():.1f} GB/s\n")
    import gguf

    path = find_gguf(args.gguf)
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: np.asarray(t.data) for t in reader.tensors}
    print(f"weights: {path}")
    bench_hot(tensors, args.quick, Q.type_id(args.type) if args.type else None)
    bench_sweep(reader, args.quick)


if __name__ == "__main__":
    main()
