"""llama.cpp side of the serving benchmark (continuous batching, shared system prompt).

Runs under llama-cpp-python's interpreter (only the standard library, ``llama_cpp``
and ``numpy`` are imported) and is meant to be launched as a subprocess by the
llamax serving benchmark, which parses the single JSON line printed on stdout.

The workload mirrors what llama.cpp users do with the low-level batch API (see
llama.cpp's ``examples/parallel``):

* one context with ``n_seq_max = n_parallel + 1`` and a unified KV cache;
* the shared system prompt is decoded once, on the dedicated sequence
  ``n_parallel``, so that it survives every slot being recycled;
* ``n_parallel`` slots (sequence ids ``0 .. n_parallel-1``) serve the requests.
  Admitting a request on slot ``s`` is ``seq_rm(s)`` + ``seq_cp(n_parallel, s)``,
  then its question tokens go into the next batch at positions
  ``len(system)..``;
* every step is ONE ``llama_decode`` of at most ``n_batch`` tokens: one token per
  generating slot plus the question tokens of newly admitted slots, with logits
  only on each sequence's last token;
* greedy sampling (argmax); each request generates exactly ``max_tokens`` tokens
  (end-of-generation is ignored) and then frees its slot.

All requests are considered submitted at t=0 (the start of the run, just before
the system prompt decode), so TTFT includes queueing.  An untimed warm-up decode
(as llama.cpp's ``common_init`` does) precedes the run.

Usage (``--dump-tokens FILE`` also saves every request's generated ids)::

    serving_llama_cpp.py --model PATH.gguf --requests-json FILE --n-parallel 8 \\
        --n-ctx 4096 --n-batch 2048 --n-threads 2 --max-tokens 64 [--flash-attn on|off]

``FILE`` is ``{"system": [ids...], "questions": [[ids...], ...]}``.
"""

import argparse
import ctypes
import json
import sys
import time

import llama_cpp
import numpy as np


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--requests-json", required=True)
    p.add_argument("--n-parallel", type=int, default=8)
    p.add_argument("--n-ctx", type=int, default=4096)
    p.add_argument("--n-batch", type=int, default=2048)
    p.add_argument("--n-ubatch", type=int, default=512)
    p.add_argument("--n-threads", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--flash-attn", choices=["on", "off"], default="off")
    p.add_argument("--verbose", action="store_true", help="keep llama.cpp logs (stderr)")
    p.add_argument("--dump-tokens", metavar="FILE",
                   help="write the generated token ids of every request (JSON list) to FILE")
    return p.parse_args()


@llama_cpp.llama_log_callback
def _silent_log(level, text, user_data):
    pass


def make_context(model, args):
    """Create the context; report the settings that depend on the binding version."""
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch = args.n_ctx, args.n_batch, args.n_ubatch
    cp.n_seq_max = args.n_parallel + 1  # + the sequence holding the system prompt
    cp.n_threads = cp.n_threads_batch = args.n_threads
    fields = {name for name, _ in type(cp)._fields_}
    config = {"n_seq_max": cp.n_seq_max, "n_ubatch": cp.n_ubatch}
    if "kv_unified" in fields:
        cp.kv_unified = True
        config["kv_unified"] = True
    else:
        config["kv_unified"] = "n/a"
    on = args.flash_attn == "on"
    if "flash_attn_type" in fields:  # newer llama.cpp: enum (-1 auto, 0 off, 1 on)
        cp.flash_attn_type = 1 if on else 0
        config["flash_attn_type"] = cp.flash_attn_type
    else:
        cp.flash_attn = on
        config["flash_attn"] = on
    ctx = llama_cpp.llama_init_from_model(model, cp)
    if not ctx:
        sys.exit("llama_init_from_model failed")
    print(f"[serving_llama_cpp] context params: {config}", file=sys.stderr)
    return ctx, config


class Batch:
    """Thin wrapper over a llama_batch with one sequence id per token."""

    def __init__(self, capacity):
        self.capacity = capacity
        self.raw = llama_cpp.llama_batch_init(capacity, 0, 1)

    def clear(self):
        self.raw.n_tokens = 0

    def add(self, token, pos, seq, logits):
        b, i = self.raw, self.raw.n_tokens
        b.token[i], b.pos[i], b.n_seq_id[i] = token, pos, 1
        b.seq_id[i][0] = seq
        b.logits[i] = logits
        b.n_tokens = i + 1
        return i

    def __len__(self):
        return self.raw.n_tokens


def decode(ctx, batch):
    rc = llama_cpp.llama_decode(ctx, batch.raw)
    if rc != 0:
        sys.exit(f"llama_decode failed with code {rc} (n_tokens={len(batch)})")


def main():
    args = parse_args()
    with open(args.requests_json) as f:
        req = json.load(f)
    system, questions = list(req["system"]), [list(q) for q in req["questions"]]
    if not args.verbose:
        llama_cpp.llama_log_set(_silent_log, ctypes.c_void_p())
    llama_cpp.llama_backend_init()

    model = llama_cpp.llama_model_load_from_file(
        args.model.encode(), llama_cpp.llama_model_default_params())
    if not model:
        sys.exit(f"cannot load {args.model}")
    n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    ctx, config = make_context(model, args)
    mem = llama_cpp.llama_get_memory(ctx)
    batch = Batch(args.n_batch)
    n_par, sys_seq, n_sys = args.n_parallel, args.n_parallel, len(system)

    def argmax(i):
        ptr = llama_cpp.llama_get_logits_ith(ctx, i)
        return int(np.ctypeslib.as_array(ptr, shape=(n_vocab,)).argmax())

    # Untimed warm-up (touches the weights, builds the graph), then a clean cache.
    batch.clear()
    batch.add(system[0] if system else 0, 0, 0, True)
    decode(ctx, batch)
    llama_cpp.llama_memory_clear(mem, True)

    t0 = time.perf_counter()
    n_steps = 0
    # 1. The shared system prompt, once, on its own sequence (chunked by n_batch).
    for start in range(0, n_sys, args.n_batch):
        batch.clear()
        for j, tok in enumerate(system[start:start + args.n_batch]):
            batch.add(tok, start + j, sys_seq, False)
        decode(ctx, batch)
        n_steps += 1

    # 2. Continuous batching.  Slot state: request index, next position, number of
    #    generated tokens, last sampled token, and its logits row in the current batch.
    slots = [None] * n_par
    next_req, done = 0, 0
    ttft = [None] * len(questions)
    outputs = [[] for _ in questions]
    gen_tokens = 0
    while done < len(questions):
        batch.clear()
        for s in slots:  # one token per generating slot
            if s is not None and s["n_gen"] > 0:
                s["i"] = batch.add(s["last"], s["pos"], s["seq"], True)
                s["pos"] += 1
        for seq in range(n_par):  # admit new requests into free slots
            if next_req >= len(questions):
                break
            q = questions[next_req]
            if slots[seq] is not None or len(batch) + len(q) > batch.capacity:
                continue
            llama_cpp.llama_memory_seq_rm(mem, seq, -1, -1)
            llama_cpp.llama_memory_seq_cp(mem, sys_seq, seq, -1, -1)
            for j, tok in enumerate(q):
                i = batch.add(tok, n_sys + j, seq, j == len(q) - 1)
            slots[seq] = {"req": next_req, "seq": seq, "pos": n_sys + len(q),
                          "n_gen": 0, "last": None, "i": i}
            next_req += 1
        if len(batch) == 0:
            sys.exit("no progress possible: a question does not fit in n_batch")
        decode(ctx, batch)
        n_steps += 1
        now = time.perf_counter()
        for seq, s in enumerate(slots):
            if s is None:
                continue
            s["last"] = argmax(s["i"])
            outputs[s["req"]].append(s["last"])
            s["n_gen"] += 1
            gen_tokens += 1
            if s["n_gen"] == 1:
                ttft[s["req"]] = now - t0
            if s["n_gen"] >= args.max_tokens:  # fixed length: EOG is ignored
                slots[seq] = None
                done += 1
    wall = time.perf_counter() - t0

    result = {
        "engine": "llama.cpp",
        "version": llama_cpp.__version__,
        "wall_s": round(wall, 4),
        "gen_tokens": gen_tokens,
        "gen_tps": round(gen_tokens / wall, 2),
        "ttft_p50_s": round(float(np.percentile(ttft, 50)), 4),
        "ttft_p95_s": round(float(np.percentile(ttft, 95)), 4),
        "prompt_computed": n_sys + sum(len(q) for q in questions),
        "prompt_submitted": sum(n_sys + len(q) for q in questions),
        "n_steps": n_steps,
        "config": dict(config, n_parallel=n_par, n_ctx=args.n_ctx, n_batch=args.n_batch,
                       n_threads=args.n_threads, max_tokens=args.max_tokens,
                       n_requests=len(questions)),
    }
    llama_cpp.llama_batch_free(batch.raw)
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)
    if args.dump_tokens:
        with open(args.dump_tokens, "w") as f:
            json.dump(outputs, f)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
