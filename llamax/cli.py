"""The `llamax` command line: run (generate text), serve (an OpenAI-compatible HTTP server), bench (throughput
tables), pull (fetch a registry model), demo."""
from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import re
import sys
from collections.abc import Iterator

from llamax.dtypes import CACHE_TYPES
from llamax.errors import LlamaxError

DEFAULT_PROMPT = "Once upon a time"


def _spec_args(p, bench: bool = False) -> None:
    """llama.cpp's speculative decoding flags (llama-server / llama-cli)."""
    p.add_argument("--spec-type", choices=["none", "ngram", "draft"], default="none",
                   help="speculative decoding: ngram (drafts from the prompt and output), draft (a draft model, -md)"
                   + ("; bench reports tg with and without it" if bench else ""))
    p.add_argument("-md", "--model-draft", default=None, help="the draft model (GGUF path or registry name)")
    p.add_argument("--spec-n-max", "--draft-max", type=int, default=16, help="most drafted tokens per step (default 16)")
    p.add_argument("--spec-n-min", "--draft-min", type=int, default=0, help="shorter drafts are not verified (default 0)")
    p.add_argument("--spec-p-min", "--draft-p-min", type=float, default=0.75,
                   help="draft model: stop drafting below this probability (default 0.75)")


def _speculative(a):
    """The Speculative of the flags, or None. Raises ValueError for inconsistent flags."""
    from llamax.speculative import Speculative

    if a.spec_type == "none":
        if a.model_draft is not None:
            raise ValueError("-md needs --spec-type draft")
        return None
    if a.spec_type == "draft" and a.model_draft is None:
        raise ValueError("--spec-type draft needs a draft model: -md MODEL")
    if a.spec_type == "ngram" and a.model_draft is not None:
        raise ValueError("-md goes with --spec-type draft, not ngram")
    return Speculative(kind=a.spec_type, n_max=a.spec_n_max, n_min=a.spec_n_min, model=a.model_draft,
                       p_min=a.spec_p_min)


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
    _spec_args(p)
    p.add_argument("-v", "--verbose", action="store_true", help="log what llama.cpp would log")


def cmd_run(a) -> int:
    from llamax import models
    from llamax.context import Context
    from llamax.generate import generate, generate_parallel
    from llamax.memory import HybridMemory, KVCache, KVCacheISWA, RecurrentMemory
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
    try:
        spec = _speculative(a)
    except ValueError as e:
        print(f"llamax run: {e}", file=sys.stderr)
        return 2
    model = Model.load(a.model or models.DEFAULT, n_threads=a.threads)
    if spec is not None and spec.kind == "draft":
        from dataclasses import replace

        spec = replace(spec, model=Model.load(spec.model, n_threads=a.threads))
    prompts = a.prompt or [DEFAULT_PROMPT]
    prompts = [prompts[i % len(prompts)] for i in range(a.parallel)]
    if a.chat:
        prompts = [model.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    ctx = Context(model, n_ctx=a.ctx_size, n_batch=a.batch_size, n_ubatch=a.ubatch_size, n_seq_max=a.parallel,
                  kv_unified=not a.no_kv_unified, type_k=a.cache_type_k, type_v=a.cache_type_v,
                  flash_attn=a.flash_attn == "on", swa_full=a.swa_full, n_threads=a.threads)
    mem = ctx.memory
    parts = [mem.attn, mem.recr] if isinstance(mem, HybridMemory) else [mem.base, mem.swa] \
        if isinstance(mem, KVCacheISWA) else [mem]
    for c in parts:
        assert isinstance(c, (KVCache, RecurrentMemory))
        kind = "llama_memory_recurrent" if isinstance(c, RecurrentMemory) else "llama_kv_cache"
        print(f"{kind}: {c.summary()}", file=sys.stderr)
    if not mem.can_shift and not a.no_context_shift:
        print("llamax run: this KV cache cannot shift positions; context shift is off", file=sys.stderr)


    opts = dict(n_keep=a.keep, context_shift=not a.no_context_shift, speculative=spec)
    if a.parallel == 1:
        gen = generate(ctx, prompts[0], max_tokens=a.n_predict, sampler=sampler(0), **opts)
        for piece in gen:
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        print(f"llamax: {gen.stats}", file=sys.stderr)
        return 0
    pgen = generate_parallel(ctx, prompts, max_tokens=a.n_predict, samplers=[sampler(i) for i in range(a.parallel)],
                             **opts)
    texts = [""] * a.parallel
    for i, piece in pgen:
        texts[i] += piece
    for i, text in enumerate(texts):
        sys.stdout.write(f"[sequence {i}] {text}\n")
    sys.stdout.flush()
    st = pgen.stats
    print(f"llamax: prompts: {st.prompt_tokens} tokens in {st.prompt_s:.3f} s ({st.prompt_tps:.1f} t/s), "
          f"generation: {st.gen_tokens} tokens over {a.parallel} sequences in {st.gen_s:.3f} s "
          f"({st.gen_tps:.1f} t/s), stop: {st.stop}, context shifts: {st.n_shift}"
          + (f", drafts: {st.n_accepted}/{st.n_drafted} accepted" if st.n_drafted else ""), file=sys.stderr)
    return 0


# ---- bench: llama-bench's flags (list-valued options take comma lists and repeat) --------------------

def _int_list(lo: int, what: str):
    """argparse type: a comma list of ints >= lo, each an int or llama-bench's range first-last[+step|*mult]."""
    def parse(text: str) -> list[int]:
        out: list[int] = []
        for item in text.split(","):
            try:
                out += _int_range(item.strip())
            except ValueError:
                raise argparse.ArgumentTypeError(f"{what}: {item.strip()!r} is not an integer or a range "
                                                 "first-last[+step|*mult]") from None
        bad = [v for v in out if v < lo]
        if bad:
            raise argparse.ArgumentTypeError(f"{what}: {bad[0]} must be >= {lo}")
        return out
    return parse


def _int_range(item: str) -> list[int]:
    """llama-bench's parse_int_range item: N, first-last (step 1), first-last+step, first-last*mult."""
    m = re.fullmatch(r"(\d+)(?:-(\d+)(?:([+*])(\d+))?)?", item)
    if m is None:
        return [int(item)]  # a plain (maybe negative) int, or ValueError
    first, last, op, k = m.group(1), m.group(2), m.group(3), m.group(4)
    if last is None:
        return [int(first)]
    a, b, k = int(first), int(last), int(k) if k else 1
    if b < a or k < 1 or (op == "*" and (k < 2 or a < 1)):
        raise ValueError(item)
    out = []
    while a <= b:
        out.append(a)
        a = a * k if op == "*" else a + k
    return out


def _choice_list(choices, what: str):
    def parse(text: str) -> list[str]:
        out = [v.strip() for v in text.split(",")]
        for v in out:
            if v not in choices:
                raise argparse.ArgumentTypeError(f"{what}: {v!r} is not one of {', '.join(choices)}")
        return out
    return parse


def _fa_list(text: str) -> list[bool]:
    on = {"on": True, "1": True, "true": True, "off": False, "0": False, "false": False}
    out = []
    for v in text.split(","):
        if v.strip().lower() not in on:
            raise argparse.ArgumentTypeError(f"-fa: {v.strip()!r} is not on, off, 1 or 0")
        out.append(on[v.strip().lower()])
    return out


def _pg_list(text: str) -> list[tuple[int, int]]:
    try:
        p, n = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"-pg: {text!r} is not pp,tg (two integers)") from None
    if p < 1 or n < 1:
        raise argparse.ArgumentTypeError(f"-pg: {text!r}: both counts must be >= 1")
    return [(p, n)]


def _bench_parser(sub) -> None:
    p = sub.add_parser("bench", help="pp/tg/batched throughput in a table, like llama-bench and batched-bench",
                       description="Measure prompt processing (pp), generation (tg), both at a depth, and N "
                       "sequences sharing a prefix (batched-bench), on random token ids. Every combination of "
                       "the list-valued options (comma lists, or repeat the flag) is measured: each test gets "
                       "a warm-up, then -r reps, reported as mean ± stddev t/s. Only the table (markdown) or "
                       "the JSON goes to stdout; progress goes to stderr.")
    p.add_argument("-m", "--model", action="append", type=lambda s: [v for v in s.split(",") if v],
                   help="GGUF paths or registry names (default smollm2-135m)")
    p.add_argument("-p", "--n-prompt", action="append", type=_int_list(0, "-p"),
                   help="prompt tokens of the pp tests (default 512; 0: none)")
    p.add_argument("-n", "--n-gen", action="append", type=_int_list(0, "-n"),
                   help="generated tokens of the tg tests (default 128; 0: none)")
    p.add_argument("-pg", action="append", type=_pg_list, help="pp,tg: a test of both (repeatable)")
    p.add_argument("-d", "--n-depth", action="append", type=_int_list(0, "-d"),
                   help="tokens already in the cache before each pp/tg test (default 0)")
    p.add_argument("-r", "--repetitions", type=int, default=5, help="timed reps per test (default 5)")
    p.add_argument("-t", "--threads", action="append", type=_int_list(1, "-t"),
                   help="thread counts (default: every core)")
    p.add_argument("-ctk", "--cache-type-k", action="append", type=_choice_list(CACHE_TYPES, "-ctk"),
                   help="K cache types (default f16)")
    p.add_argument("-ctv", "--cache-type-v", action="append", type=_choice_list(CACHE_TYPES, "-ctv"),
                   help="V cache types (default f16; a quantized V needs -fa on, other pairs are skipped)")
    p.add_argument("-fa", "--flash-attn", action="append", type=_fa_list, help="on, off or on,off (default on)")
    p.add_argument("-b", "--batch-size", action="append", type=_int_list(1, "-b"), help="n_batch (default 2048)")
    p.add_argument("-ub", "--ubatch-size", action="append", type=_int_list(1, "-ub"), help="n_ubatch (default 512)")
    p.add_argument("--parallel", "-npl", action="append", type=_int_list(1, "--parallel"),
                   help="N sequences sharing a prefix (batched-bench): the prefix is decoded once for sequence "
                   "0 and copied to the others, then -ntg steps decode one token per sequence")
    p.add_argument("-npp", action="append", type=_int_list(1, "-npp"),
                   help="prefix tokens of the --parallel tests (default 128)")
    p.add_argument("-ntg", action="append", type=_int_list(1, "-ntg"),
                   help="steps of the --parallel tests (default 128)")
    p.add_argument("--serving", action="store_true",
                   help="the serving test instead: --requests requests (system prompt of -npp tokens, default "
                   "256, plus a distinct --question-token question) on --parallel slots (default 8) of an "
                   "Engine with the prefix cache, -ntg tokens each (default 64); aggregate t/s, time to first "
                   "token, prompt tokens computed vs submitted")
    p.add_argument("--grammar", metavar="SPEC",
                   help="the constrained-decoding test instead: greedy tg of -n tokens (default 128) with and "
                   "without a grammar, alternating, on each -m model; SPEC: 'schema' (a list-of-records JSON "
                   "schema), 'json' (any JSON), or a file: .json (a JSON schema), .gbnf, .lark")
    _spec_args(p, bench=True)
    p.add_argument("--requests", type=int, default=32, help="requests of the --serving test (default 32)")
    p.add_argument("--question", type=int, default=32, help="question tokens of the --serving test (default 32)")
    p.add_argument("-c", "--ctx-size", type=int, default=4096, help="n_ctx of the --serving test (default 4096)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random token ids (default 0)")
    p.add_argument("--llama-bench", metavar="PATH",
                   help="llama.cpp's llama-bench binary: one rep of each pp/tg test by it after every llamax "
                   "rep (same file, threads, cache types, fa, batch sizes); the table gives the CPU, the SIMD "
                   "level and both medians with their ratio")
    p.add_argument("-o", "--output", choices=["md", "json"], default="md", help="md (default) or json")
    p.add_argument("--json", action="store_const", const="json", dest="output", help="same as -o json")
    p.add_argument("-v", "--verbose", action="store_true", help="log what llama.cpp would log")


def cmd_bench(a) -> int:
    import json

    from llamax import bench, models

    def flat(values, default):
        return [v for vs in values for v in vs] if values else list(default)

    if a.repetitions < 1:
        print(f"llamax bench: -r {a.repetitions}: the number of reps must be >= 1", file=sys.stderr)
        return 2
    if a.llama_bench and (a.serving or a.grammar is not None or a.spec_type != "none" or a.parallel):
        print("llamax bench: --llama-bench compares the pp/tg tests only (not --serving, --grammar, --spec-type "
              "or --parallel)", file=sys.stderr)
        return 2
    if a.serving:
        return _bench_serving(a, flat)
    if a.grammar is not None:
        return _bench_grammar(a, flat)
    if a.spec_type != "none":
        return _bench_spec(a, flat)
    tests = bench.make_tests(flat(a.n_prompt, [512]), flat(a.n_gen, [128]), flat(a.n_depth, [0]), flat(a.pg, []),
                             flat(a.parallel, []), flat(a.npp, [128]), flat(a.ntg, [128]))
    if (a.npp or a.ntg) and not a.parallel:
        print("llamax bench: -npp and -ntg size the --parallel tests; give --parallel N", file=sys.stderr)
        return 2

    def progress(line: str) -> None:
        print(f"llamax bench: {line}", file=sys.stderr, flush=True)

    options = dict(threads=flat(a.threads, [None]), type_k=flat(a.cache_type_k, ["f16"]),
                   type_v=flat(a.cache_type_v, ["f16"]), flash_attn=flat(a.flash_attn, [True]),
                   n_batch=flat(a.batch_size, [2048]), n_ubatch=flat(a.ubatch_size, [512]), seed=a.seed,
                   progress=progress)
    names = flat(a.model, [models.DEFAULT])
    if a.llama_bench:
        return _bench_beside_llama(a, names, tests, options)
    rows = bench.run_matrix(names, tests, a.repetitions, **options)
    if a.output == "json":
        print(json.dumps(rows, indent=2))
    else:
        print(bench.markdown(rows))
    return 0


def _bench_beside_llama(a, names: list[str], tests: list, options: dict) -> int:
    """`llamax bench --llama-bench PATH`: bench_llama.compare's table (JSON: its rows, each with the machine's
    fields)."""
    import json

    from llamax import bench_llama

    try:
        rows = bench_llama.compare(names, tests, a.repetitions, a.llama_bench, **options)
    except RuntimeError as e:
        print(f"llamax bench: {e}", file=sys.stderr)
        return 1
    where = bench_llama.machine()
    if a.output == "json":
        print(json.dumps([{**where, **r} for r in rows], indent=2))
    else:
        print(bench_llama.markdown(rows, where))
    return 0


def _table(a, rows: list[dict], head: str, rule: str, line) -> int:
    """A bench's rows on stdout: JSON with --json, else a markdown table (head, rule, line(row) each)."""
    import json

    if a.output == "json":
        print(json.dumps(rows, indent=2))
        return 0
    print(head)
    print(rule)
    for r in rows:
        print(line(r))
    return 0


def _grammar_of_spec(spec: str):
    import json
    import pathlib

    from llamax import Grammar, bench

    if spec == "schema":
        return Grammar.json_schema(bench.BENCH_SCHEMA)
    if spec == "json":
        return Grammar.json()
    path = pathlib.Path(spec)
    text = path.read_text()
    kinds = {".json": lambda t: Grammar.json_schema(json.loads(t)), ".gbnf": Grammar.gbnf, ".lark": Grammar.lark}
    if path.suffix not in kinds:
        raise ValueError(f"--grammar {spec}: 'schema', 'json', or a .json / .gbnf / .lark file")
    return kinds[path.suffix](text)


def _bench_grammar(a, flat) -> int:
    from llamax import Model, bench, models

    try:
        grammar = _grammar_of_spec(a.grammar)
    except (OSError, ValueError) as e:
        print(f"llamax bench: {e}", file=sys.stderr)
        return 2
    rows = []
    for name in flat(a.model, [models.DEFAULT]):
        model = Model.load(name, n_threads=flat(a.threads, [None])[0])
        rows.append(bench.run_constrained(model, grammar, flat(a.n_gen, [128])[0], a.repetitions,
                                          progress=lambda line: print(f"llamax bench: {line}", file=sys.stderr,
                                                                      flush=True)))
    return _table(a, rows, "| model | n_vocab | grammar | tg t/s | tg t/s with the grammar | ratio | tokens |",
                  "| --- | ---: | --- | ---: | ---: | ---: | ---: |",
                  lambda r: f"| {r['model']} | {r['n_vocab']} | {a.grammar} | {r['tg_free_ts']:.1f} | "
                            f"{r['tg_grammar_ts']:.1f} | {r['ratio']:.3f} | {r['grammar_tokens']} |")


def _bench_spec(a, flat) -> int:
    from llamax import Model, bench, models

    try:
        spec = _speculative(a)
    except ValueError as e:
        print(f"llamax bench: {e}", file=sys.stderr)
        return 2
    rows = []
    for name in flat(a.model, [models.DEFAULT]):
        model = Model.load(name, n_threads=flat(a.threads, [None])[0])
        rows += bench.run_speculative(model, spec, flat(a.n_gen, [256])[0], a.repetitions,
                                      progress=lambda line: print(f"llamax bench: {line}", file=sys.stderr, flush=True))
    return _table(a, rows, "| model | task | spec | tg t/s | tg t/s with drafts | ratio | accepted / drafted | same output |",
                  "| --- | --- | --- | ---: | ---: | ---: | ---: | --- |",
                  lambda r: f"| {r['model']} | {r['task']} | {r['spec']} | {r['tg_ts']:.1f} | {r['tg_spec_ts']:.1f} | "
                            f"{r['ratio']:.2f} | {r['n_accepted']} / {r['n_drafted']} ({100 * r['acceptance']:.1f}%) | "
                            f"{r['same']} |")


def _bench_serving(a, flat) -> int:
    import statistics

    from llamax import Model, bench, models

    runs = []
    for name in flat(a.model, [models.DEFAULT]):
        model = Model.load(name)
        system, questions = bench.serving_workload(model, a.requests, flat(a.npp, [256])[0], a.question)
        reps = [bench.run_serving(model, system, questions, n_parallel=flat(a.parallel, [8])[0], n_ctx=a.ctx_size,
                                  max_tokens=flat(a.ntg, [64])[0], n_threads=flat(a.threads, [None])[0],
                                  type_k=flat(a.cache_type_k, ["f16"])[0], type_v=flat(a.cache_type_v, ["f16"])[0],
                                  flash_attn=flat(a.flash_attn, [True])[0]) for _ in range(a.repetitions)]
        row = {k: statistics.median(r[k] for r in reps) for k in reps[0] if k != "engine"}
        runs.append(dict(model=name, reps=a.repetitions, **row))
    return _table(a, runs, "| model | requests | gen t/s | TTFT p50 s | TTFT p95 s | prompt computed / submitted | prefix hit |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
                  lambda r: f"| {r['model']} | {a.requests} | {r['gen_tps']:.1f} | {r['ttft_p50_s']:.3f} | "
                            f"{r['ttft_p95_s']:.3f} | {r['prompt_computed']:.0f} / {r['prompt_submitted']:.0f} | "
                            f"{100 * r['prefix_hit_rate']:.1f}% |")


def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server over the Engine (llama-server's endpoints too)",
                       description="Serve a model over HTTP: /v1/completions, /v1/chat/completions (streamed or not), "
                       "/v1/models, /v1/embeddings (each also without /v1), and llama-server's /health, /metrics, /slots, /props, "
                       "/tokenize, /detokenize, /apply-template. Requests run through continuous batching and the "
                       "prefix cache. One log line per request on stderr.")
    p.add_argument("-m", "--model", default=None, help="GGUF path or registry name (default smollm2-135m)")
    p.add_argument("-a", "--alias", default=None, help="the model id clients see (default: the registry name or "
                   "file name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8080, help="port (default 8080; 0: any free port, printed)")
    p.add_argument("-np", "--parallel", type=int, default=4, help="slots: requests decoded at once (default 4)")
    p.add_argument("-c", "--ctx-size", type=int, default=4096,
                   help="KV cells in all (default 4096; 0: the model's); with the unified cache every request may "
                   "use all of them")
    p.add_argument("-b", "--batch-size", type=int, default=2048)
    p.add_argument("-ub", "--ubatch-size", type=int, default=512)
    p.add_argument("-t", "--threads", type=int, default=None)
    p.add_argument("-ctk", "--cache-type-k", default="f16", choices=CACHE_TYPES)
    p.add_argument("-ctv", "--cache-type-v", default="f16", choices=CACHE_TYPES)
    p.add_argument("-fa", "--flash-attn", choices=["on", "off"], default="on")
    p.add_argument("--swa-full", action="store_true", help="full-size cache for sliding-window layers")
    p.add_argument("--no-kv-unified", action="store_true", help="one KV stream per slot (no cross-slot prefix cache)")
    p.add_argument("--no-prefix-cache", action="store_true", help="compute every prompt in full")
    p.add_argument("--cache-ram", type=int, default=None, metavar="MiB",
                   help="host RAM for sequence states: prefixes evicted from the cells, and a recurrent model's "
                   "state checkpoints (default 8192 as llama-server; 0: off; -1: no limit)")
    p.add_argument("--no-context-shift", action="store_true",
                   help="a prompt longer than a slot's context gets 400, and generation stops at the context's end "
                   "(default: shift it, as llama-server --context-shift)")
    p.add_argument("--ctx-slot", type=int, default=0, help="one request's context (default 0: all of -c)")
    p.add_argument("--max-queue", type=int, default=256, help="requests that may wait for a slot; beyond: 503")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="the most tokens one request may generate (default: a slot's context)")
    p.add_argument("--max-body-bytes", type=int, default=8 << 20, help="larger request bodies get 413 (default 8 MiB)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health (default: $LLAMAX_API_KEY)")
    p.add_argument("--slot-save-path", default=None, help="the directory for POST /slots/{id}?action=save|restore")
    p.add_argument("--cors-origin", action="append", default=None, metavar="ORIGIN",
                   help="a browser origin allowed to call the server, e.g. https://app.example.org (repeatable; "
                   "default: any origin, as llama-server)")
    p.add_argument("--pooling", choices=["mean", "last", "cls"], default=None,
                   help="pooling of POST /v1/embeddings (default: the model's own, else mean)")
    p.add_argument("--replicas", type=int, default=None,
                   help="run N Engine replicas as a Ray Serve deployment behind the one endpoint "
                   "(pip install 'llamax[ray]'); -t is then each replica's threads")
    p.add_argument("--ray-address", default=None,
                   help="with --replicas: a Ray cluster to deploy on (auto, or HEAD:PORT); default: a local Ray "
                   "instance on loopback, stopped on exit")
    p.add_argument("--routing", choices=["prefix", "round_robin"], default="prefix",
                   help="with --replicas: send a request to the replica holding the longest prefix of its prompt "
                   "(within a load bound; default), or take the replicas in turn")
    _spec_args(p)
    p.add_argument("-v", "--verbose", action="store_true", help="log the engine's decisions too")


def cmd_serve(a) -> int:
    import os

    from llamax import models
    from llamax.model import Model

    try:
        for dep in ("uvicorn", "starlette", "pydantic", "prometheus_client"):
            importlib.import_module(dep)
        from llamax.server.run import serve
    except ImportError as e:
        print(f"llamax serve: the server needs its extra packages ({e.name} is missing): "
              "pip install 'llamax[server]'", file=sys.stderr)
        return 1
    from llamax.serving import Engine

    if not 0 <= a.port < 65536:
        print(f"llamax serve: --port {a.port}: 0..65535", file=sys.stderr)
        return 2
    logging.getLogger("llamax.server").setLevel(logging.INFO)
    try:
        spec = _speculative(a)
    except ValueError as e:
        print(f"llamax serve: {e}", file=sys.stderr)
        return 2
    name = a.model or models.DEFAULT
    if a.replicas is not None:
        return _serve_replicas(a, name, spec)
    if a.ray_address is not None or a.routing != "prefix":
        print("llamax serve: --ray-address and --routing need --replicas N", file=sys.stderr)
        return 2
    model = Model.load(name, n_threads=a.threads)
    engine = Engine(model, n_ctx=a.ctx_size, n_parallel=a.parallel, n_batch=a.batch_size, n_ubatch=a.ubatch_size,
                    type_k=a.cache_type_k, type_v=a.cache_type_v, flash_attn=a.flash_attn == "on",
                    kv_unified=not a.no_kv_unified, swa_full=a.swa_full, prefix_cache=not a.no_prefix_cache,
                    max_queue=a.max_queue, n_threads=a.threads, slot_save_path=a.slot_save_path,
                    context_shift=not a.no_context_shift, n_ctx_slot=a.ctx_slot, speculative=spec,
                    cache_ram=a.cache_ram)
    if a.slot_save_path is not None:
        os.makedirs(a.slot_save_path, exist_ok=True)
    alias = a.alias or (name if name in models.available() else model.path.name)
    print(f"llamax serve: {alias}: {engine.n_parallel} slots, {engine.params.n_ctx} cells "
          f"({engine.n_ctx_seq} per request), K {a.cache_type_k} / V {a.cache_type_v}", file=sys.stderr)
    return serve(engine, host=a.host, port=a.port, model_name=alias,
                 api_key=a.api_key if a.api_key is not None else os.environ.get("LLAMAX_API_KEY") or None,
                 max_body_bytes=a.max_body_bytes, max_tokens=a.max_tokens, cors_origins=a.cors_origin,
                 pooling=a.pooling,
                 ready=lambda url: print(f"llamax serve: listening on {url}", file=sys.stderr, flush=True))


def _serve_replicas(a, name: str, spec=None) -> int:
    """`llamax serve --replicas N`: the same endpoint over N Engine replicas on Ray Serve."""
    import os

    from llamax import models
    from llamax.model import ModelInfo

    try:
        importlib.import_module("ray.serve")
    except ImportError:
        print("llamax serve --replicas: needs Ray Serve: pip install 'llamax[ray]'", file=sys.stderr)
        return 1
    from llamax.cluster.run import serve_replicas

    if a.replicas < 1:
        print(f"llamax serve: --replicas {a.replicas}: at least 1", file=sys.stderr)
        return 2
    threads = a.threads or max(1, (os.cpu_count() or 1) // a.replicas)
    path = models.path(name) if name in models.available() else name
    info = ModelInfo.read(path)  # a bad model file fails here, before Ray starts
    slot_dir = None if a.slot_save_path is None else os.path.abspath(a.slot_save_path)
    if slot_dir is not None:
        os.makedirs(slot_dir, exist_ok=True)
    alias = a.alias or (name if name in models.available() else info.path.name)
    engine_kw = dict(n_ctx=a.ctx_size, n_parallel=a.parallel, n_batch=a.batch_size, n_ubatch=a.ubatch_size,
                     type_k=a.cache_type_k, type_v=a.cache_type_v, flash_attn=a.flash_attn == "on",
                     kv_unified=not a.no_kv_unified, swa_full=a.swa_full, prefix_cache=not a.no_prefix_cache,
                     max_queue=a.max_queue, slot_save_path=slot_dir, context_shift=not a.no_context_shift,
                     n_ctx_slot=a.ctx_slot, speculative=spec, cache_ram=a.cache_ram)
    server_kw = dict(model_name=alias, max_body_bytes=a.max_body_bytes, max_tokens=a.max_tokens,
                     cors_origins=a.cors_origin,
                     api_key=a.api_key if a.api_key is not None else os.environ.get("LLAMAX_API_KEY") or None)
    print(f"llamax serve: {alias}: {a.replicas} replicas x {threads} threads on "
          f"{a.ray_address or 'a local Ray instance'}, routing {a.routing}", file=sys.stderr)
    # a registry name travels as a name: each replica's machine fetches the model into its own cache
    return serve_replicas(name if name in models.available() else str(path), replicas=a.replicas, threads=threads, ray_address=a.ray_address,
                          routing=a.routing, host=a.host, port=a.port, engine_kw=engine_kw, server_kw=server_kw,
                          ready=lambda url: print(f"llamax serve: listening on {url}", file=sys.stderr, flush=True))


def cmd_pull(a) -> int:
    from llamax import models

    print(models.pull(a.name))
    return 0


class _FetchHandler(logging.Handler):
    """The model registry's records (llamax.models, see its docstring) on stderr as a CLI shows
    them: "llamax: <message>", pip's lines (llamax.models.pip) as pip printed them, and on a
    terminal the extraction's progress redrawn in place (\\r) until its last record."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self._open = False  # a progress line is on the terminal without its newline

    @staticmethod
    def tty() -> bool:
        try:
            return sys.stderr.isatty()
        except (AttributeError, ValueError):
            return False

    def emit(self, record: logging.LogRecord) -> None:
        try:
            msg = record.getMessage()
            line = msg if record.name == "llamax.models.pip" else f"llamax: {msg}"
            progress = getattr(record, "llamax_progress", None)
            err = sys.stderr  # looked up each time: the stream of the moment (tests swap it)
            if progress is not None and self.tty():
                last = bool(progress[2])
                err.write("\r" + line + "\x1b[K" + ("\n" if last else ""))
                self._open = not last
            elif record.levelno >= logging.INFO:  # DEBUG progress updates: only on a terminal
                err.write(("\n" if self._open else "") + line + "\n")
                self._open = False
            err.flush()
        except Exception:
            self.handleError(record)


@contextlib.contextmanager
def _show_fetches() -> Iterator[None]:
    """While a command runs, a model fetch shows on stderr as `llamax pull` shows it (the library
    only logs); the logger is put back as it was after (main() may run in-process, as in tests)."""
    lg = logging.getLogger("llamax.models")
    h = _FetchHandler()
    saved = lg.level, lg.propagate
    lg.addHandler(h)
    lg.setLevel(logging.DEBUG if h.tty() else logging.INFO)
    lg.propagate = False  # not again through the root handler
    try:
        yield
    finally:
        lg.removeHandler(h)
        lg.setLevel(saved[0])
        lg.propagate = saved[1]


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block): every input error is one line and exit 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} -h)\n")


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="llamax", description="llama.cpp's KV-cache runtime for Python")
    sub = parser.add_subparsers(dest="cmd", required=True)
    _run_parser(sub)
    _serve_parser(sub)
    _bench_parser(sub)
    pp = sub.add_parser("pull", help="fetch a registry model into the cache and print its path")
    pp.add_argument("name", nargs="?", default="smollm2-135m")
    sub.add_parser("demo", help="a short tour of the KV cache with a tiny random model")
    args = parser.parse_args(argv)
    verbose = getattr(args, "verbose", False) or args.cmd == "demo"
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(name)s: %(message)s",
                        stream=sys.stderr)
    try:
        with _show_fetches():
            if args.cmd == "run":
                return cmd_run(args)
            if args.cmd == "serve":
                return cmd_serve(args)
            if args.cmd == "bench":
                return cmd_bench(args)
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
