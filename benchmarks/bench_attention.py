"""Benchmark of the attention kernels over an f16 KV cache (llamax._native.attention).

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

Every figure is the median of >= 5 runs (after a warm-up). For scale, a plain memory copy
(np.copyto of 256 MiB) is timed too; it counts read + write bytes.

    python benchmarks/bench_attention.py [--quick]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from llamax._native import attention as A


def median_time(fn, repeat: int) -> float:
    fn()  # warm-up
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats (still >= 5)")
    args = ap.parse_args()
    rep_fast, rep_slow = (5, 5) if args.quick else (31, 9)
    rng = np.random.default_rng(0)
    print(f"llamax attention benchmark: SIMD level {A.simd_level()}, LX_ATTN_CHUNK {A.CHUNK}; "
          f"medians of {rep_fast} (decode) / {rep_slow} (prefill) runs")
    print(f"load average before the run: {' '.join(f'{x:.2f}' for x in os.getloadavg())} "
          f"(other processes on these {os.cpu_count()} cores slow the 2-thread figures most)")
    print(f"memory copy (np.copyto 256 MiB, read + write): {bench_copy(5):.1f} GB/s")
    bench_decode("SmolLM2-135M", 9, 3, 64, 8192, rep_fast, rng)
    bench_decode("8B-class", 32, 8, 128, 8192, rep_fast, rng)
    for n_kv in (512, 1024):
        bench_prefill("SmolLM2-135M", 9, 3, 64, 512, n_kv, rep_slow, rng)


if __name__ == "__main__":
    main()
