"""Benchmark of state save/load (llamax/state.py) against raw copies of the same bytes and, with
--llama-python, against llama.cpp's llama_state_seq_* / llama_state_* in the same run.

Scenario (llama.cpp's llama_state_seq_get_data / set_data on one long sequence): SmolLM2-135M, f16
cache, flash attention (V not transposed), one sequence of --n-tokens (2048) random tokens
prefilled; 30 layers x (K + V) x 2048 cells x 384 bytes = 47 MB of K/V. Measured, median of --runs
(a returned blob is freed after the clock stops, on both sides):

    seq get     ctx.state_seq_get_data(0)            -> bytes (a new object: fresh pages)
    seq get into ctx.state_seq_get_data_into(buf, 0)   into one buffer kept across calls
    seq set     ctx2.state_seq_set_data(blob, 0)       into a second context (seq_rm, find_slot, copy)
    seq save    ctx.state_seq_save_file(path, 0, tokens)   (page cache, no fsync)
    seq load    ctx2.state_seq_load_file(path, 0)
    ctx get     ctx.state_get_data()                   whole context (memory + logits); ctx get into
    ctx set     ctx2.state_set_data(blob)
and, in the same run, the baselines over the same number of bytes:
    np.copyto   a preallocated copy (memcpy speed: what a restore into the cache costs at best)
    tobytes     a copy into a new bytes object (what any get_data must pay: fresh pages)
    xor64       the data checksum (llamax._native.buffers.xor64); crc32 for reference
    raw file    the same bytes written to a new file / read from the page cache into a new buffer

Prints MB, median ms, GB/s and the ratio to np.copyto.

With --llama-python PYTHON (an interpreter with llama-cpp-python), benchmarks/state_llama_cpp.py
builds the same scenario in llama.cpp (same GGUF, n_ctx, f16 cache, flash attention, the same
tokens) and the two sides are timed in alternation, --rounds rounds of --runs calls per operation,
so that both see the same machine load: seq get (a new buffer per call, as llama-cpp-python's
Llama.save_state makes it) / get into (one buffer kept) / set, and the same for the whole context.
Prints both medians and their ratio.

    PYTHONPATH=. python benchmarks/bench_state.py [--runs 7] [--n-tokens 2048] \
        [--llama-python /path/to/python-with-llama-cpp-python] [--rounds 5]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import zlib

import numpy as np

from llamax import Batch, Context, Model, models
from llamax._native import buffers


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


def timed(fn, runs: int) -> list[float]:
    """Wall times (ms) of runs calls of fn; what fn returns is freed after the clock stops."""
    ms = []
    for _ in range(runs):
        t = time.perf_counter()
        out = fn()
        ms.append((time.perf_counter() - t) * 1e3)
        del out
    return ms


def median_ms(fn, runs: int) -> float:
    fn()  # warm-up
    return statistics.median(timed(fn, runs))


class LlamaCpp:
    """benchmarks/state_llama_cpp.py in another interpreter: the same scenario, timed on request."""

    def __init__(self, python: str, model_path: str, tokens: list[int], n_ctx: int, n_threads: int, tmp: str):
        path = os.path.join(tmp, "tokens.json")
        with open(path, "w") as f:
            json.dump(tokens, f)
        helper = os.path.join(os.path.dirname(os.path.abspath(__file__)), "state_llama_cpp.py")
        self.p = subprocess.Popen([python, helper, "--model", model_path, "--tokens-json", path, "--n-ctx", str(n_ctx),
                                   "--n-threads", str(n_threads)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True)
        line = self.p.stdout.readline()
        if not line:
            sys.exit(f"state_llama_cpp.py ended without a word (exit code {self.p.wait()})")
        self.info = json.loads(line)

    def timed(self, op: str, runs: int) -> list[float]:
        self.p.stdin.write(f"{op} {runs}\n")
        self.p.stdin.flush()
        r = json.loads(self.p.stdout.readline())
        assert r["op"] == op
        return r["ms"]

    def close(self) -> None:
        self.p.stdin.write("\n")
        self.p.stdin.flush()
        self.p.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--n-tokens", type=int, default=2048)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n-threads", type=int, default=2, help="threads of both sides")
    ap.add_argument("--llama-python", default=None, help="an interpreter with llama-cpp-python: llama.cpp beside")
    ap.add_argument("--rounds", type=int, default=5, help="alternations with llama.cpp (each --runs calls per op)")
    a = ap.parse_args()
    runs = max(5, a.runs)

    model = Model.load(a.model)
    n = a.n_tokens
    kw = dict(n_ctx=n, n_batch=n, n_ubatch=512, type_k="f16", type_v="f16", flash_attn=True, n_threads=a.n_threads)
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
    seq_out, ctx_out = bytearray(len(seq_blob)), bytearray(len(ctx_blob))

    tmp = tempfile.mkdtemp(prefix="llamax-bench-state-")
    seq_path = os.path.join(tmp, "seq.state")
    ctx.state_seq_save_file(seq_path, 0, tokens)
    raw_path = os.path.join(tmp, "raw.bin")

    rows = [
        ("np.copyto (baseline)", len(seq_blob), lambda: np.copyto(dst, src)),
        ("tobytes (new bytes)", len(seq_blob), lambda: src.tobytes()),
        ("xor64 checksum", len(seq_blob), lambda: buffers.xor64(src)),
        ("crc32 (reference)", len(seq_blob), lambda: zlib.crc32(src)),
        ("raw file write", len(seq_blob), lambda: raw_write(raw_path, src)),
        ("raw file read", len(seq_blob), lambda: raw_read(raw_path, src.size)),
        ("seq get_data", len(seq_blob), lambda: ctx.state_seq_get_data(0)),
        ("seq get_data_into", len(seq_blob), lambda: ctx.state_seq_get_data_into(seq_out, 0)),
        ("seq set_data", len(seq_blob), lambda: ctx2.state_seq_set_data(seq_blob, 0)),
        ("seq save_file", len(seq_blob), lambda: ctx.state_seq_save_file(seq_path, 0, tokens)),
        ("seq load_file", len(seq_blob), lambda: ctx2.state_seq_load_file(seq_path, 0)),
        ("ctx get_data", len(ctx_blob), lambda: ctx.state_get_data()),
        ("ctx get_data_into", len(ctx_blob), lambda: ctx.state_get_data_into(ctx_out)),
        ("ctx set_data", len(ctx_blob), lambda: ctx2.state_set_data(ctx_blob)),
    ]
    print(f"one sequence of {n} tokens: {mb:.1f} MB of state ({kv_bytes / 1e6:.1f} MB of K/V), "
          f"whole context {len(ctx_blob) / 1e6:.1f} MB; median of {runs} runs")
    base = None
    print(f"{'':24s} {'MB':>7s} {'ms':>8s} {'GB/s':>7s} {'x copyto':>9s}")
    for name, nbytes, fn in rows:
        ms = median_ms(fn, runs)
        if base is None:
            base = ms
        print(f"{name:24s} {nbytes / 1e6:7.1f} {ms:8.2f} {nbytes / ms / 1e6:7.2f} {ms / base:9.2f}")
    # the restored sequence is the saved one, and the buffers got the same bytes
    assert ctx2.state_seq_get_data(0) == seq_blob == seq_out
    assert ctx.state_get_data() == ctx_out

    if a.llama_python:
        compare(a, model, tokens, tmp, ctx, ctx2, seq_blob, ctx_blob, seq_out, ctx_out)
    for f in os.listdir(tmp):
        os.remove(os.path.join(tmp, f))
    os.rmdir(tmp)


def compare(a, model, tokens, tmp, ctx, ctx2, seq_blob, ctx_blob, seq_out, ctx_out) -> None:
    """llamax and llama.cpp timed in alternation on the same scenario; medians and ratios."""
    path = a.model if os.path.isfile(a.model) else str(models.path(a.model))
    lc = LlamaCpp(a.llama_python, path, tokens, a.n_tokens, a.n_threads, tmp)
    print(f"\nllama.cpp (llama-cpp-python {lc.info['version']}): prefill {lc.info['prefill_s']} s; "
          f"seq state {lc.info['seq_bytes'] / 1e6:.1f} MB, whole {lc.info['ctx_bytes'] / 1e6:.1f} MB")
    ops = {
        "seq_get": lambda: ctx.state_seq_get_data(0),
        "seq_get_into": lambda: ctx.state_seq_get_data_into(seq_out, 0),
        "seq_set": lambda: ctx2.state_seq_set_data(seq_blob, 0),
        "ctx_get": lambda: ctx.state_get_data(),
        "ctx_get_into": lambda: ctx.state_get_data_into(ctx_out),
        "ctx_set": lambda: ctx2.state_set_data(ctx_blob),
    }
    mine: dict[str, list[float]] = {op: [] for op in ops}
    theirs: dict[str, list[float]] = {op: [] for op in ops}
    for op, fn in ops.items():  # warm-up, both sides
        fn()
        lc.timed(op, 1)
    for _ in range(max(1, a.rounds)):
        for op, fn in ops.items():
            mine[op] += timed(fn, a.runs)
            theirs[op] += lc.timed(op, a.runs)
    lc.close()
    n = len(mine["seq_get"])
    print(f"alternating, {max(1, a.rounds)} rounds x {a.runs} calls per op; median of {n} calls each")
    print(f"{'':14s} {'llamax ms':>10s} {'llama.cpp ms':>13s} {'ratio':>7s}")
    for op in ops:
        m, t = statistics.median(mine[op]), statistics.median(theirs[op])
        print(f"{op:14s} {m:10.2f} {t:13.2f} {m / t:7.2f}")

if __name__ == "__main__":
    main()
