"""The `llamax` command line: run (generate text), pull (fetch a registry model), demo."""
from __future__ import annotations

import argparse
import logging
import sys

from llamax.errors import LlamaxError

DEFAULT_PROMPT = "Once upon a time"


def _run_parser(sub) -> None:
    p = sub.add_parser("run", help="generate text with a model (default: smollm2-135m, fetched on first use)")
    p.add_argument("-m", "--model", default=None, help="GGUF path or registry name (default smollm2-135m)")
    p.add_argument("-p", "--prompt", action="append", default=None,
                   help="prompt text; repeat with --parallel to give each sequence its own")
    p.add_argument("-n", "--n-predict", type=int, default=128, help="tokens to generate (default 128)")
    p.add_argument("-c", "--ctx-size", type=int, default=4096, help="context size in cells (0: the model's)")
    p.add_argument("-b", "--batch-size", type=int, default=2048)
    p.add_argument("-ub", "--ubatch-size", type=int, default=512)
    p.add_argument("-ctk", "--cache-type-k", default="f16", help="f32 or f16")
    p.add_argument("-ctv", "--cache-type-v", default="f16", help="f32 or f16")
    p.add_argument("-fa", "--flash-attn", choices=["on", "off"], default="on")
    p.add_argument("-t", "--threads", type=int, default=None)
    p.add_argument("--temp", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--repeat-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--parallel", type=int, default=1, help="run N prompts as N sequences of one context")
    p.add_argument("--no-kv-unified", action="store_true", help="one KV stream per sequence")
    p.add_argument("-v", "--verbose", action="store_true", help="log what llama.cpp would log")


def cmd_run(a) -> int:
    from llamax import models
    from llamax.context import Context
    from llamax.generate import generate
    from llamax.model import Model
    from llamax.sampling import Sampler

    for t in (a.cache_type_k, a.cache_type_v):
        if t in ("q8_0", "q4_0"):
            print(f"llamax run: cache type {t} is not available yet (the quantized KV cache arrives in a later "
                  "release); use f32 or f16", file=sys.stderr)
            return 2
    if a.parallel < 1:
        print("llamax run: --parallel must be >= 1", file=sys.stderr)
        return 2
    model = Model.load(a.model or models.DEFAULT, n_threads=a.threads)
    prompts = a.prompt or [DEFAULT_PROMPT]
    prompts = [prompts[i % len(prompts)] for i in range(a.parallel)]
    if a.chat:
        prompts = [model.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    ctx = Context(model, n_ctx=a.ctx_size, n_batch=a.batch_size, n_ubatch=a.ubatch_size, n_seq_max=a.parallel,
                  kv_unified=not a.no_kv_unified, type_k=a.cache_type_k, type_v=a.cache_type_v,
                  flash_attn=a.flash_attn == "on", n_threads=a.threads)
    mem = ctx.memory
    for c in ([mem] if not hasattr(mem, "swa") else [mem.base, mem.swa]):
        print(f"llama_kv_cache: {c.summary()}", file=sys.stderr)

    def sampler(i: int) -> Sampler:
        seed = None if a.seed is None else a.seed + i
        return Sampler(a.temp, a.top_k, a.top_p, a.min_p, a.repeat_penalty, seed)

    if a.parallel == 1:
        gen = generate(ctx, prompts[0], max_tokens=a.n_predict, sampler=sampler(0))
        for piece in gen:
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        print(f"llamax: {gen.stats}", file=sys.stderr)
        return 0
    return _run_parallel(ctx, model, prompts, a, sampler)


def _run_parallel(ctx, model, prompts, a, sampler) -> int:
    """N sequences decoded together: one batch per step holds the next token of every live sequence."""
    import time

    from llamax.batch import Batch
    from llamax.generate import decode_prompt
    from llamax.model.tokenizer import TextStream

    n = len(prompts)
    toks = [model.tokenize(p, add_special=True, parse_special=True) for p in prompts]
    t0 = time.perf_counter()
    first = []
    for s in range(n):
        decode_prompt(ctx, toks[s], seq_id=s)
        first.append(ctx.get_logits_ith(-1).copy())
    t_prompt = time.perf_counter() - t0
    samplers = [sampler(s) for s in range(n)]
    streams = [TextStream(model.tokenizer) for _ in range(n)]
    texts = [""] * n
    nxt = [samplers[s].sample_logits(first[s]) for s in range(n)]
    live = list(range(n))
    n_gen = 0
    t0 = time.perf_counter()
    for _ in range(a.n_predict):
        live = [s for s in live if not model.is_eog(nxt[s])
                and ctx.memory.seq_pos_max(s) + 1 < ctx.params.n_ctx_seq]
        if not live:
            break
        for s in live:
            samplers[s].accept(nxt[s])
            texts[s] += streams[s].push(nxt[s])
        n_gen += len(live)
        ctx.decode(Batch([nxt[s] for s in live], seq_ids=live, logits=[True] * len(live)))
        for j, s in enumerate(live):
            nxt[s] = samplers[s].sample_logits(ctx.get_logits_ith(j))
    dt = time.perf_counter() - t0
    for s in range(n):
        texts[s] += streams[s].flush()
        sys.stdout.write(f"[sequence {s}] {texts[s]}\n")
    sys.stdout.flush()
    n_p = sum(len(t) for t in toks)
    print(f"llamax: prompts: {n_p} tokens in {t_prompt:.3f} s ({n_p / max(t_prompt, 1e-9):.1f} t/s), "
          f"generation: {n_gen} tokens over {n} sequences in {dt:.3f} s ({n_gen / max(dt, 1e-9):.1f} t/s)",
          file=sys.stderr)
    return 0


def cmd_pull(a) -> int:
    from llamax import models

    print(models.pull(a.name))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="llamax", description="llama.cpp's KV-cache runtime for Python")
    sub = parser.add_subparsers(dest="cmd", required=True)
    _run_parser(sub)
    pp = sub.add_parser("pull", help="fetch a registry model into the cache and print its path")
    pp.add_argument("name", nargs="?", default="smollm2-135m")
    sub.add_parser("demo", help="a short tour of the KV cache with a tiny random model")
    args = parser.parse_args(argv)
    verbose = getattr(args, "verbose", False) or args.cmd == "demo"
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(name)s: %(message)s",
                        stream=sys.stderr)
    try:
        if args.cmd == "run":
            return cmd_run(args)
        if args.cmd == "pull":
            return cmd_pull(args)
        from llamax.demo import run

        run()
        return 0
    except LlamaxError as e:
        print(f"llamax {args.cmd}: {e}", file=sys.stderr)
        return 1
    except ValueError as e:
        print(f"llamax {args.cmd}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
