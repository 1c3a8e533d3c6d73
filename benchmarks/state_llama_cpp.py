"""llama.cpp side of the state benchmark (bench_state.py --llama-python): llama_state_seq_get_data /
set_data and llama_state_get_data / set_data through llama-cpp-python's low-level API.

Runs under llama-cpp-python's interpreter (only the standard library, ``llama_cpp`` and ``numpy``
are imported), launched by bench_state.py as a subprocess. It builds the same scenario as the llamax
side: the model, two contexts (n_ctx = n_batch = --n-ctx, n_ubatch 512, f16 K and V, flash
attention on, --n-threads), the tokens of --tokens-json decoded into sequence 0 of the first. Then
it serves timing requests, one per line on stdin, so that the parent can alternate them with its own:

    OP RUNS          ->  one JSON line: {"op": OP, "ms": [RUNS wall times of the call, ms]}

OPs (each call is what a llama.cpp caller pays; dst buffers are ctypes arrays, as llama-cpp-python's
Llama.save_state makes them):
    seq_get          llama_state_seq_get_size + llama_state_seq_get_data into a new buffer
    seq_get_into     the same into one buffer kept across calls (no fresh pages)
    seq_set          llama_state_seq_set_data(ctx2, blob, seq 0)
    ctx_get / ctx_get_into / ctx_set      the same for the whole context (llama_state_*)
An empty line or EOF ends it. The first line printed is {"ready": ..., "seq_bytes": ..., ...}.

    state_llama_cpp.py --model PATH.gguf --tokens-json FILE [--n-ctx 2048] [--n-threads 2]
"""

import argparse
import ctypes
import json
import sys
import time

import llama_cpp


@llama_cpp.llama_log_callback
def _silent_log(level, text, user_data):
    pass


def make_context(model, args):
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch = args.n_ctx, args.n_ctx, 512
    cp.n_seq_max = 1
    cp.n_threads = cp.n_threads_batch = args.n_threads
    cp.type_k = cp.type_v = 1  # GGML_TYPE_F16
    fields = {name for name, _ in type(cp)._fields_}
    if "flash_attn_type" in fields:  # newer llama.cpp: enum (-1 auto, 0 off, 1 on)
        cp.flash_attn_type = 1
    else:
        cp.flash_attn = True
    ctx = llama_cpp.llama_init_from_model(model, cp)
    if not ctx:
        sys.exit("llama_init_from_model failed")
    return ctx


def prefill(ctx, tokens, n_batch):
    """tokens into sequence 0, n_batch at a time, logits on the last one only."""
    batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
    try:
        for start in range(0, len(tokens), n_batch):
            chunk = tokens[start:start + n_batch]
            batch.n_tokens = len(chunk)
            for j, tok in enumerate(chunk):
                batch.token[j], batch.pos[j], batch.n_seq_id[j] = tok, start + j, 1
                batch.seq_id[j][0] = 0
                batch.logits[j] = start + j == len(tokens) - 1
            rc = llama_cpp.llama_decode(ctx, batch)
            if rc != 0:
                sys.exit(f"llama_decode failed with code {rc}")
    finally:
        llama_cpp.llama_batch_free(batch)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens-json", required=True)
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--n-threads", type=int, default=2)
    ap.add_argument("--decode-batch", type=int, default=512, help="tokens per llama_decode of the prefill")
    ap.add_argument("--verbose", action="store_true", help="keep llama.cpp logs (stderr)")
    args = ap.parse_args()
    with open(args.tokens_json) as f:
        tokens = [int(t) for t in json.load(f)]
    if not args.verbose:
        llama_cpp.llama_log_set(_silent_log, ctypes.c_void_p())
    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(args.model.encode(), llama_cpp.llama_model_default_params())
    if not model:
        sys.exit(f"cannot load {args.model}")
    ctx, ctx2 = make_context(model, args), make_context(model, args)
    t0 = time.perf_counter()
    prefill(ctx, tokens, args.decode_batch)
    prefill_s = time.perf_counter() - t0

    def new_buffer(n):
        return (ctypes.c_uint8 * n)()

    seq_n = llama_cpp.llama_state_seq_get_size(ctx, 0)
    ctx_n = llama_cpp.llama_state_get_size(ctx)
    seq_blob, ctx_blob = new_buffer(seq_n), new_buffer(ctx_n)
    if llama_cpp.llama_state_seq_get_data(ctx, seq_blob, seq_n, 0) != seq_n:
        sys.exit("llama_state_seq_get_data wrote another size")
    if llama_cpp.llama_state_get_data(ctx, ctx_blob, ctx_n) != ctx_n:
        sys.exit("llama_state_get_data wrote another size")
    seq_out, ctx_out = new_buffer(seq_n), new_buffer(ctx_n)

    def seq_get():
        n = llama_cpp.llama_state_seq_get_size(ctx, 0)
        buf = new_buffer(n)
        assert llama_cpp.llama_state_seq_get_data(ctx, buf, n, 0) == n
        return buf

    def seq_get_into():
        n = llama_cpp.llama_state_seq_get_size(ctx, 0)
        assert llama_cpp.llama_state_seq_get_data(ctx, seq_out, n, 0) == n

    def seq_set():
        assert llama_cpp.llama_state_seq_set_data(ctx2, seq_blob, seq_n, 0) == seq_n

    def ctx_get():
        n = llama_cpp.llama_state_get_size(ctx)
        buf = new_buffer(n)
        assert llama_cpp.llama_state_get_data(ctx, buf, n) == n
        return buf

    def ctx_get_into():
        n = llama_cpp.llama_state_get_size(ctx)
        assert llama_cpp.llama_state_get_data(ctx, ctx_out, n) == n

    def ctx_set():
        assert llama_cpp.llama_state_set_data(ctx2, ctx_blob, ctx_n) == ctx_n

    ops = {"seq_get": seq_get, "seq_get_into": seq_get_into, "seq_set": seq_set,
           "ctx_get": ctx_get, "ctx_get_into": ctx_get_into, "ctx_set": ctx_set}
    print(json.dumps({"ready": True, "version": llama_cpp.__version__, "seq_bytes": seq_n, "ctx_bytes": ctx_n,
                      "prefill_s": round(prefill_s, 2)}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            break
        op, runs = line.split()
        fn = ops[op]
        ms = []
        for _ in range(int(runs)):
            t = time.perf_counter()
            out = fn()
            ms.append((time.perf_counter() - t) * 1e3)
            del out  # a new buffer is freed outside the timed call, as llamax's bytes are
        print(json.dumps({"op": op, "ms": ms}), flush=True)
    llama_cpp.llama_free(ctx2)
    llama_cpp.llama_free(ctx)
    llama_cpp.llama_model_free(model)


if __name__ == "__main__":
    main()
