"""Benchmark of state save/load (llamax/state.py) against raw copies of the same bytes.

Scenario (llama.cpp's llama_state_seq_get_data / set_data on one long sequence): SmolLM2-135M, f16
cache, flash attention (V not transposed), one sequence of --n-tokens (2048) random tokens
prefilled; 30 layers x (K + V) x 2048 cells x 384 bytes = 47 MB of K/V. Measured, median of --runs:

    seq get     ctx.state_seq_get_data(0)            -> bytes
    seq set     ctx2.state_seq_set_data(blob, 0)       into a second context (seq_rm, find_slot, copy)
    seq save    ctx.state_seq_save_file(path, 0, tokens)   (page cache, no fsync)
    seq load    ctx2.state_seq_load_file(path, 0)
    ctx get     ctx.state_get_data()                   whole context (memory + logits)
    ctx set     ctx2.state_set_data(blob)
and, in the same run, the baselines over the same number of bytes:
    np.copyto   a preallocated copy (memcpy speed: what a restore into the cache costs at best)
    tobytes     a copy into a new bytes object (what any get_data must pay: fresh pages)
    xor64       the data checksum (np.bitwise_xor.reduce over uint64 words); crc32 for reference
    raw file    the same bytes written to a new file / read from the page cache into a new buffer

Prints MB, median ms, GB/s and the ratio to np.copyto.

    PYTHONPATH=. python benchmarks/bench_state.py [--runs 7] [--n-tokens 2048]
"""
import argparse
import os
import tempfile
import time
import zlib

import numpy as np
from timing import median_time

from llamax import Batch, Context, Model


def raw_write(path: str, buf: np.ndarray) -> None:
    """The same bytes to a new file (as save_file does: a temporary file renamed over the old one)."""
    with open(path + ".tmp", "wb") as f:
        f.write(buf)
    os.replace(path + ".tmp", path)


def raw_read(path: str, n: int) -> np.ndarray:
    """The same bytes from the page cache into a new buffer (as load_file does)."""
    out = np.empty(n, np.uint8)
    with open(path, "rb") as f:
        f.readinto(memoryview(out))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--n-tokens", type=int, default=2048)
    ap.add_argument("--model", default="smollm2-135m")
    a = ap.parse_args()
    runs = max(5, a.runs)

    model = Model.load(a.model)
    n = a.n_tokens
    kw = dict(n_ctx=n, n_batch=n, n_ubatch=512, type_k="f16", type_v="f16", flash_attn=True)
    ctx, ctx2 = Context(model, **kw), Context(model, **kw)
    rng = np.random.default_rng(0)
    tokens = rng.integers(100, model.n_vocab, size=n).tolist()
    t0 = time.perf_counter()
    ctx.decode(Batch(tokens))
    print(f"prefill of {n} tokens: {time.perf_counter() - t0:.1f} s; cache: {ctx.memory.summary()}")

    seq_blob = ctx.state_seq_get_data(0)
    ctx_blob = ctx.state_get_data()
    kv_bytes = sum(a.nbytes // a.shape[1] * n for a in ctx.memory.k + ctx.memory.v)
    mb = len(seq_blob) / 1e6
    src = np.frombuffer(seq_blob, np.uint8).copy()
    dst = np.empty_like(src)
    words = src[: src.size - src.size % 8].view(np.uint64)

    tmp = tempfile.mkdtemp(prefix="llamax-bench-state-")
    seq_path = os.path.join(tmp, "seq.state")
    ctx.state_seq_save_file(seq_path, 0, tokens)
    raw_path = os.path.join(tmp, "raw.bin")

    rows = [
        ("np.copyto (baseline)", len(seq_blob), lambda: np.copyto(dst, src)),
        ("tobytes (new bytes)", len(seq_blob), lambda: src.tobytes()),
        ("xor64 checksum", len(seq_blob), lambda: np.bitwise_xor.reduce(words)),
        ("crc32 (reference)", len(seq_blob), lambda: zlib.crc32(src)),
        ("raw file write", len(seq_blob), lambda: raw_write(raw_path, src)),
        ("raw file read", len(seq_blob), lambda: raw_read(raw_path, src.size)),
        ("seq get_data", len(seq_blob), lambda: ctx.state_seq_get_data(0)),
        ("seq set_data", len(seq_blob), lambda: ctx2.state_seq_set_data(seq_blob, 0)),
        ("seq save_file", len(seq_blob), lambda: ctx.state_seq_save_file(seq_path, 0, tokens)),
        ("seq load_file", len(seq_blob), lambda: ctx2.state_seq_load_file(seq_path, 0)),
        ("ctx get_data", len(ctx_blob), lambda: ctx.state_get_data()),
        ("ctx set_data", len(ctx_blob), lambda: ctx2.state_set_data(ctx_blob)),
    ]
    print(f"one sequence of {n} tokens: {mb:.1f} MB of state ({kv_bytes / 1e6:.1f} MB of K/V), "
          f"whole context {len(ctx_blob) / 1e6:.1f} MB; median of {runs} runs")
    base = None
    print(f"{'':24s} {'MB':>7s} {'ms':>8s} {'GB/s':>7s} {'x copyto':>9s}")
    for name, nbytes, fn in rows:
        ms = median_time(fn, runs) * 1e3
        if base is None:
            base = ms
        print(f"{name:24s} {nbytes / 1e6:7.1f} {ms:8.2f} {nbytes / ms / 1e6:7.2f} {ms / base:9.2f}")
    # the restored sequence is the saved one
    assert ctx2.state_seq_get_data(0) == seq_blob
    for f in os.listdir(tmp):
        os.remove(os.path.join(tmp, f))
    os.rmdir(tmp)


if __name__ == "__main__":
    main()
