"""Benchmark of the attention kernels over f16 and quantized KV caches (llamax._native.attention).

Decode: one query token over 8192 cached rows, where the kernel must stream the whole cache:
reported as GB/s of cache read (K + V bytes of the rows / median time) for 1 and 2 threads,
next to numpy baselines measured in the same run:
  - "numpy f16": the same attention from the f16 cache (K and V converted to float32 head-major
    [Hkv, N, D] in one astype pass, then matmul / softmax / matmul through BLAS), i.e. what a
    numpy user pays with an f16 cache;
  - "numpy f32": the same over a cache converted to float32 head-major beforehand (conversion
    not timed; note it reads twice the bytes, and the layout is the one BLAS likes best).
Prefill: 512 query tokens over 512 and 1024 rows with a causal mask (f16 cache), against numpy
over the pre-converted f32 cache (OpenBLAS matmul, its own threads).

Quantized caches (q8_0, q4_0: llama.cpp's -ctk / -ctv; K and V of the same type): decode of one
token over 2048 and 8192 cached rows for SmolLM2's shape (9 heads / 3 kv heads / d 64) and an
8B-class shape (32 / 8 / 128), for f32, f16, q8_0 and q4_0 from the same float data, with 1 and 2
threads. The types run round-robin inside each repetition (every type sees the same machine load)
and the table gives, per type, the median time, GB/s of cache read (K + V bytes of the rows /
time), the speed-up over llamax's own f16 cache in the same run (> 1: faster; the quantized rows
are 34/64 (q8_0) and 18/64 (q4_0) of the f16 bytes), and the speed-up over a numpy baseline of
the same type measured in the same run (dequantize the cache in numpy -- astype for f16, block
scales times quants for q8_0 / q4_0 -- then the BLAS attention of numpy_attention). Prefill: 512
tokens over 512 / 1024 rows (causal), per type, vs f16 and vs numpy over a pre-converted f32
cache.

Every figure is the median of >= 5 runs (after a warm-up). For scale, a plain memory copy
(np.copyto of 256 MiB) is timed too; it counts read + write bytes.

    python benchmarks/bench_attention.py [--quick] [--only-quant]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
from timing import median_time

from llamax._native import attention as A
from llamax._native import cpu
from llamax._native import quants as Q


def numpy_attention(q, k32, v32, mask, scale):
    """softmax(q k^T * scale + mask) v for one stream, the way numpy does it best.

    q [T, H, D]; k32 / v32 float32 [Hkv, N, D] (head-major, contiguous: BLAS-friendly);
    mask [T, N]. Returns [T, H, Dv].
    """
    n_tok, n_head, d = q.shape
    n_head_kv, n_kv, dv = v32.shape
    g = n_head // n_head_kv
    qg = q.reshape(n_tok, n_head_kv, g, d).transpose(1, 0, 2, 3).reshape(n_head_kv, n_tok * g, d)
    s = np.matmul(qg, k32.transpose(0, 2, 1))       # [Hkv, T*g, N]
    s *= scale
    s = s.reshape(n_head_kv, n_tok, g, n_kv)
    s += mask[None, :, None, :]
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    o = np.matmul(s.reshape(n_head_kv, n_tok * g, n_kv), v32)  # [Hkv, T*g, Dv]
    return o.reshape(n_head_kv, n_tok, g, dv).transpose(1, 0, 2, 3).reshape(n_tok, n_head, dv)


def to_head_major_f32(c16):
    """[1, N, Hkv, D] f16 cache -> float32 [Hkv, N, D] (one conversion + transpose pass)."""
    return np.ascontiguousarray(c16[0].transpose(1, 0, 2), dtype=np.float32)


def bench_copy(repeat: int) -> float:
    src = np.ones(256 * 2**20 // 4, dtype=np.float32)
    dst = np.empty_like(src)
    t = median_time(lambda: np.copyto(dst, src), repeat)
    return 2 * src.nbytes / t / 1e9


def bench_decode(name, n_head, n_head_kv, d, n_rows, repeat, rng):
    kv_size = n_rows
    scale = 1.0 / np.sqrt(d)
    q = rng.standard_normal((1, n_head, d)).astype(np.float32)
    k16 = rng.standard_normal((1, kv_size, n_head_kv, d)).astype(np.float16)
    v16 = rng.standard_normal((1, kv_size, n_head_kv, d)).astype(np.float16)
    vt16 = np.ascontiguousarray(v16.transpose(0, 2, 3, 1))
    mask = np.zeros((1, 1, n_rows), dtype=np.float32)
    k32, v32 = to_head_major_f32(k16), to_head_major_f32(v16)
    nbytes16 = k16.nbytes + v16.nbytes
    nbytes32 = k32.nbytes + v32.nbytes
    out = np.empty((1, n_head, d), dtype=np.float32)

    ref = numpy_attention(q, k32, v32, mask[0], scale)
    got = A.attn(q, k16, v16, mask, n_kv=n_rows, scale=scale, n_threads=1)
    assert np.abs(got - ref).max() < 1e-4, np.abs(got - ref).max()

    print(f"\ndecode  {name}: 1 token, {n_rows} rows, n_head {n_head}, n_head_kv {n_head_kv}, d {d}, "
          f"f16 cache = {nbytes16 / 2**20:.1f} MiB")
    t_np16 = median_time(lambda: numpy_attention(q, to_head_major_f32(k16), to_head_major_f32(v16),
                                                 mask[0], scale), repeat)
    t_np32 = median_time(lambda: numpy_attention(q, k32, v32, mask[0], scale), repeat)
    rows = [("numpy f16 (convert + matmul)", t_np16, nbytes16), ("numpy f32 (pre-converted)", t_np32, nbytes32)]
    for nt in (1, 2):
        t = median_time(lambda: A.attn(q, k16, v16, mask, out, n_kv=n_rows, scale=scale, n_threads=nt), repeat)
        rows.append((f"llamax flash, {nt} thread{'s' if nt > 1 else ''}", t, nbytes16))
    for nt in (1, 2):
        t = median_time(lambda: A.attn(q, k16, vt16, mask, out, n_kv=n_rows, scale=scale, v_trans=True,
                                       n_threads=nt), repeat)
        rows.append((f"llamax v_trans, {nt} thread{'s' if nt > 1 else ''}", t, nbytes16))
    print(f"  {'path':34s} {'median':>10s} {'GB/s':>7s} {'vs numpy f16':>13s} {'vs numpy f32':>13s}")
    for label, t, nb in rows:
        print(f"  {label:34s} {t * 1e6:8.1f}us {nb / t / 1e9:7.2f} {t_np16 / t:12.2f}x {t_np32 / t:12.2f}x")


def bench_prefill(name, n_head, n_head_kv, d, n_tok, n_kv, repeat, rng):
    scale = 1.0 / np.sqrt(d)
    q = rng.standard_normal((n_tok, n_head, d)).astype(np.float32)
    k16 = rng.standard_normal((1, n_kv, n_head_kv, d)).astype(np.float16)
    v16 = rng.standard_normal((1, n_kv, n_head_kv, d)).astype(np.float16)
    # causal: the batch holds positions n_kv - n_tok .. n_kv - 1, cell i holds position i
    pos = np.arange(n_kv - n_tok, n_kv)
    mask = np.where(np.arange(n_kv)[None, :] <= pos[:, None], 0.0, -np.inf).astype(np.float32)[None]
    k32, v32 = to_head_major_f32(k16), to_head_major_f32(v16)
    out = np.empty((n_tok, n_head, d), dtype=np.float32)

    ref = numpy_attention(q, k32, v32, mask[0], scale)
    got = A.attn(q, k16, v16, mask, n_kv=n_kv, scale=scale, n_threads=2)
    assert np.abs(got - ref).max() < 1e-4, np.abs(got - ref).max()

    visible = int(np.isfinite(mask).sum())
    flops = 2.0 * visible * n_head * (d + d)
    print(f"\nprefill {name}: {n_tok} tokens over {n_kv} rows (causal), n_head {n_head}, n_head_kv {n_head_kv}, d {d}")
    t_np32 = median_time(lambda: numpy_attention(q, k32, v32, mask[0], scale), repeat)
    rows = [("numpy f32 (pre-converted, BLAS)", t_np32)]
    for nt in (1, 2):
        t = median_time(lambda: A.attn(q, k16, v16, mask, out, n_kv=n_kv, scale=scale, n_threads=nt), repeat)
        rows.append((f"llamax flash, {nt} thread{'s' if nt > 1 else ''}", t))
    print(f"  {'path':34s} {'median':>10s} {'GFLOP/s':>8s} {'vs numpy f32':>13s}")
    for label, t in rows:
        print(f"  {label:34s} {t * 1e3:8.2f}ms {flops / t / 1e9:8.2f} {t_np32 / t:12.2f}x")


# ---- quantized caches ---------------------------------------------------------------------------

TYPES = ("f32", "f16", "q8_0", "q4_0")


def to_cache(t: str, x: np.ndarray) -> np.ndarray:
    """float32 [1, N, Hkv, D] -> the cache tensor of type t (quantized: uint8 [1, N, row_bytes])."""
    if t == "f32":
        return x.astype(np.float32)
    if t == "f16":
        return x.astype(np.float16)
    return Q.quantize(t, np.ascontiguousarray(x.reshape(x.shape[0], x.shape[1], -1)))


def numpy_dequantize_head_major(t: str, c: np.ndarray, n_head_kv: int, d: int) -> np.ndarray:
    """A numpy user's read of a cache of type t: float32 head-major [Hkv, N, D]."""
    if t in ("f32", "f16"):
        return to_head_major_f32(c)
    n = c.shape[1]
    blocks = c.reshape(n, -1, Q.block_bytes(t))
    scale = blocks[:, :, :2].copy().view(np.float16).astype(np.float32)          # [N, nb, 1]
    if t == "q8_0":
        qs = blocks[:, :, 2:].view(np.int8).astype(np.float32)
    else:
        nib = blocks[:, :, 2:]
        qs = np.concatenate([nib & 15, nib >> 4], axis=2).astype(np.float32) - 8.0
    vals = (qs * scale).reshape(n, n_head_kv, d)
    return np.ascontiguousarray(vals.transpose(1, 0, 2))


def interleaved_medians(fns: dict, repeat: int) -> dict:
    """Median time of each callable, all of them run once per repetition (same load for all)."""
    for fn in fns.values():
        fn()
    ts = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            ts[name].append(time.perf_counter() - t0)
    return {name: statistics.median(v) for name, v in ts.items()}


def bench_decode_types(name, n_head, n_head_kv, d, n_rows, repeat, rng):
    scale = 1.0 / np.sqrt(d)
    q = rng.standard_normal((1, n_head, d)).astype(np.float32)
    kf = rng.standard_normal((1, n_rows, n_head_kv, d)).astype(np.float32)
    vf = rng.standard_normal((1, n_rows, n_head_kv, d)).astype(np.float32)
    mask = np.zeros((1, 1, n_rows), dtype=np.float32)
    out = np.empty((1, n_head, d), dtype=np.float32)
    caches = {t: (to_cache(t, kf), to_cache(t, vf)) for t in TYPES}
    for t, (k, v) in caches.items():       # the kernel against numpy on the same (dequantized) cache
        got = A.attn(q, k, v, mask, n_kv=n_rows, scale=scale, type_k=t, type_v=t)
        ref = numpy_attention(q, numpy_dequantize_head_major(t, k, n_head_kv, d),
                              numpy_dequantize_head_major(t, v, n_head_kv, d), mask[0], scale)
        tol = 1e-4 if t in ("f32", "f16") else 0.05    # quantized K: llamax quantizes q to q8_0 too
        assert np.abs(got - ref).max() < tol, (t, np.abs(got - ref).max())

    print(f"\ndecode  {name}: 1 token over {n_rows} rows, n_head {n_head}, n_head_kv {n_head_kv}, d {d}; "
          f"K and V of one type")
    fns = {}
    for t, (k, v) in caches.items():
        fns[("np", t)] = (lambda k=k, v=v, t=t: numpy_attention(
            q, numpy_dequantize_head_major(t, k, n_head_kv, d), numpy_dequantize_head_major(t, v, n_head_kv, d),
            mask[0], scale))
        for nt in (1, 2):
            fns[(nt, t)] = (lambda k=k, v=v, t=t, nt=nt: A.attn(q, k, v, mask, out, n_kv=n_rows, scale=scale,
                                                                n_threads=nt, type_k=t, type_v=t))
    med = interleaved_medians(fns, repeat)
    print(f"  {'type':6s} {'threads':>7s} {'cache MiB':>9s} {'median':>10s} {'GB/s':>7s} {'vs f16':>7s} "
          f"{'vs numpy':>9s}")
    for nt in (1, 2):
        for t, (k, v) in caches.items():
            nb = k.nbytes + v.nbytes
            tm = med[(nt, t)]
            print(f"  {t:6s} {nt:7d} {nb / 2**20:9.2f} {tm * 1e6:8.1f}us {nb / tm / 1e9:7.2f} "
                  f"{med[(nt, 'f16')] / tm:6.2f}x {med[('np', t)] / tm:8.1f}x")


def bench_prefill_types(name, n_head, n_head_kv, d, n_tok, n_kv, repeat, rng):
    scale = 1.0 / np.sqrt(d)
    q = rng.standard_normal((n_tok, n_head, d)).astype(np.float32)
    kf = rng.standard_normal((1, n_kv, n_head_kv, d)).astype(np.float32)
    vf = rng.standard_normal((1, n_kv, n_head_kv, d)).astype(np.float32)
    pos = np.arange(n_kv - n_tok, n_kv)
    mask = np.where(np.arange(n_kv)[None, :] <= pos[:, None], 0.0, -np.inf).astype(np.float32)[None]
    out = np.empty((n_tok, n_head, d), dtype=np.float32)
    caches = {t: (to_cache(t, kf), to_cache(t, vf)) for t in TYPES}
    k32, v32 = to_head_major_f32(kf), to_head_major_f32(vf)
    fns = {"np": lambda: numpy_attention(q, k32, v32, mask[0], scale)}
    for t, (k, v) in caches.items():
        fns[t] = (lambda k=k, v=v, t=t: A.attn(q, k, v, mask, out, n_kv=n_kv, scale=scale, n_threads=2,
                                               type_k=t, type_v=t))
    med = interleaved_medians(fns, repeat)
    visible = int(np.isfinite(mask).sum())
    flops = 2.0 * visible * n_head * (d + d)
    print(f"\nprefill {name}: {n_tok} tokens over {n_kv} rows (causal), 2 threads, K and V of one type")
    print(f"  {'type':6s} {'median':>10s} {'GFLOP/s':>8s} {'vs f16':>7s} {'vs numpy f32':>13s}")
    for t in TYPES:
        print(f"  {t:6s} {med[t] * 1e3:8.2f}ms {flops / med[t] / 1e9:8.2f} {med['f16'] / med[t]:6.2f}x "
              f"{med['np'] / med[t]:12.2f}x")
    print(f"  {'numpy f32 (pre-converted, BLAS)':34s} {med['np'] * 1e3:8.2f}ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats (still >= 5)")
    ap.add_argument("--only-quant", action="store_true", help="only the per-type (quantized cache) tables")
    args = ap.parse_args()
    rep_fast, rep_slow = (5, 5) if args.quick else (31, 9)
    rng = np.random.default_rng(0)
    print(f"llamax attention benchmark: SIMD level {cpu.LEVEL_NAMES[cpu.simd_level()]}, LX_ATTN_CHUNK {A.CHUNK}; "
          f"medians of {rep_fast} (decode) / {rep_slow} (prefill) runs")
    print(f"load average before the run: {' '.join(f'{x:.2f}' for x in os.getloadavg())} "
          f"(other processes on these {os.cpu_count()} cores slow the 2-thread figures most)")
    print(f"memory copy (np.copyto 256 MiB, read + write): {bench_copy(5):.1f} GB/s")
    if not args.only_quant:
        bench_decode("SmolLM2-135M", 9, 3, 64, 8192, rep_fast, rng)
        bench_decode("8B-class", 32, 8, 128, 8192, rep_fast, rng)
        for n_kv in (512, 1024):
            bench_prefill("SmolLM2-135M", 9, 3, 64, 512, n_kv, rep_slow, rng)
    for shape in (("SmolLM2-135M", 9, 3, 64), ("8B-class", 32, 8, 128)):
        for n_rows in (2048, 8192):
            bench_decode_types(*shape, n_rows, rep_fast, rng)
    for n_kv in (512, 1024):
        bench_prefill_types("SmolLM2-135M", 9, 3, 64, 512, n_kv, rep_slow, rng)


if __name__ == "__main__":
    main()
