"""The `llamax` command line: run (generate text), pull (fetch a registry model), demo."""
from __future__ import annotations

import argparse
import logging
import sys

from llamax.dtypes import CACHE_TYPES
from llamax.errors import LlamaxError

DEFAULT_PROMPT = "Once upon a time"


def _run_parser(sub) -> None:
    p = sub.add_parser("run", help="generate text with a model (default: smollm2-135m, fetched on first use)",
                       description="Generate text after a prompt. Only the generated text goes to stdout; the KV "
                       "size and the speed go to stderr. When a sequence's context is full, llama.cpp's context "
                       "shift keeps its first --keep tokens, drops half of the rest and goes on.")
    p.add_argument("-m", "--model", default=None, help="GGUF path or registry name (default smollm2-135m)")
    p.add_argument("-p", "--prompt", action="append", default=None,
                   help="prompt text; repeat with --parallel to give each sequence its own")
    p.add_argument("-n", "--n-predict", type=int, default=128,
                   help="tokens to generate per sequence (default 128; -1: until end of generation, shifting the "
                   "context as needed; -2: until the context is full)")
    p.add_argument("-c", "--ctx-size", type=int, default=4096, help="context size in cells (0: the model's)")
    p.add_argument("-b", "--batch-size", type=int, default=2048)
    p.add_argument("-ub", "--ubatch-size", type=int, default=512)
    p.add_argument("-k", "--keep", type=int, default=0,
                   help="tokens of the prompt a context shift keeps (default 0, -1: the whole prompt; the BOS "
                   "token is kept too)")
    p.add_argument("--no-context-shift", action="store_true",
                   help="stop a sequence when its context is full instead of shifting it")
    p.add_argument("-ctk", "--cache-type-k", default="f16", choices=CACHE_TYPES, help="K cache type (default f16)")
    p.add_argument("-ctv", "--cache-type-v", default="f16", choices=CACHE_TYPES,
                   help="V cache type (default f16; a quantized V needs flash attention)")
    p.add_argument("-fa", "--flash-attn", choices=["on", "off"], default="on")
    p.add_argument("-t", "--threads", type=int, default=None)
    p.add_argument("--temp", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--repeat-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None,
                   help="sampling seed (sequence i uses seed + i; default or -1: fresh entropy)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--parallel", type=int, default=1,
                   help="run N prompts as N sequences of one context, decoded together")
    p.add_argument("--no-kv-unified", action="store_true", help="one KV stream per sequence")
    p.add_argument("--swa-full", action="store_true",
                   help="full-size cache for sliding-window layers (default: the window plus one ubatch)")
    p.add_argument("-v", "--verbose", action="store_true", help="log what llama.cpp would log")


def cmd_run(a) -> int:
    from llamax import models
    from llamax.context import Context
    from llamax.generate import generate, generate_parallel
    from llamax.model import Model
    from llamax.sampling import Sampler

    if a.parallel < 1:
        print("llamax run: --parallel must be >= 1", file=sys.stderr)
        return 2
    if a.n_predict < -2:
        print("llamax run: -n must be >= 0, -1 (until end of generation) or -2 (until the context is full)",
              file=sys.stderr)
        return 2
    def sampler(i: int) -> Sampler:
        seed = None if a.seed in (None, -1) else a.seed + i
        return Sampler(a.temp, a.top_k, a.top_p, a.min_p, a.repeat_penalty, seed)

    sampler(0)  # bad sampler settings fail before the model loads
    model = Model.load(a.model or models.DEFAULT, n_threads=a.threads)
    prompts = a.prompt or [DEFAULT_PROMPT]
    prompts = [prompts[i % len(prompts)] for i in range(a.parallel)]
    if a.chat:
        prompts = [model.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    ctx = Context(model, n_ctx=a.ctx_size, n_batch=a.batch_size, n_ubatch=a.ubatch_size, n_seq_max=a.parallel,
                  kv_unified=not a.no_kv_unified, type_k=a.cache_type_k, type_v=a.cache_type_v,
                  flash_attn=a.flash_attn == "on", swa_full=a.swa_full, n_threads=a.threads)
    mem = ctx.memory
    for c in ([mem] if not hasattr(mem, "swa") else [mem.base, mem.swa]):
        print(f"llama_kv_cache: {c.summary()}", file=sys.stderr)
    if not mem.can_shift and not a.no_context_shift:
        print("llamax run: this KV cache cannot shift positions; context shift is off", file=sys.stderr)


    opts = dict(n_keep=a.keep, context_shift=not a.no_context_shift)
    if a.parallel == 1:
        gen = generate(ctx, prompts[0], max_tokens=a.n_predict, sampler=sampler(0), **opts)
        for piece in gen:
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        print(f"llamax: {gen.stats}", file=sys.stderr)
        return 0
    gen = generate_parallel(ctx, prompts, max_tokens=a.n_predict, samplers=[sampler(i) for i in range(a.parallel)],
                            **opts)
    texts = [""] * a.parallel
    for i, piece in gen:
        texts[i] += piece
    for i, text in enumerate(texts):
        sys.stdout.write(f"[sequence {i}] {text}\n")
    sys.stdout.flush()
    st = gen.stats
    print(f"llamax: prompts: {st.prompt_tokens} tokens in {st.prompt_s:.3f} s ({st.prompt_tps:.1f} t/s), "
          f"generation: {st.gen_tokens} tokens over {a.parallel} sequences in {st.gen_s:.3f} s "
          f"({st.gen_tps:.1f} t/s), stop: {st.stop}, context shifts: {st.n_shift}", file=sys.stderr)
    return 0


def cmd_pull(a) -> int:
    from llamax import models

    print(models.pull(a.name))
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block): every input error is one line and exit 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} -h)\n")


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="llamax", description="llama.cpp's KV-cache runtime for Python")
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
    except (ValueError, TypeError) as e:
        print(f"llamax {args.cmd}: {e}", file=sys.stderr)
        return 2
    except MemoryError as e:
        print(f"llamax {args.cmd}: out of memory: {e or 'an allocation failed'} (try a smaller -c)", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"llamax {args.cmd}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
