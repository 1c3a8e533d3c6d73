"""Throughput of a model's decode loop, measured as llama.cpp's llama-bench and batched-bench do.

A `BenchTest` is one measurement on a fresh context; `run_bench` runs a list of them for one model
and one context configuration, `run_matrix` every combination of models, thread counts and
configurations, and `markdown` prints the rows as llama-bench's table. Every test decodes random
token ids drawn with a fixed seed (not text), so runs are repeatable and need no tokenizer:

    test            what is timed (the cache is cleared before each rep)          t/s counts
    pp{p}           p prompt tokens, split into n_batch decodes (logits: last)    p
    tg{n}           n single-token decodes                                        n
    pp{p}+tg{n}     both, one after the other                                     p + n
    ... @ d{d}      any of the above after an untimed prefill of d tokens
    pp{p}+tg{n}x{N} batched-bench's shared prefix: p tokens for sequence 0, seq_cp   p + N * n
                    to sequences 1..N-1 (untimed), then n decodes of N tokens, one
                    per sequence, each with logits

Each test gets one warm-up (llama-bench's: the prompt, then one generated token; for the shared
prefix, the prefix and one N-token step), then `reps` timed repetitions; a row reports the mean
and the sample standard deviation of the per-rep t/s (llama-bench's avg_ts / stddev_ts) and their
median. A context is sized to its test (n_ctx = depth + prompt + generated tokens, padded as every
context is), as llama-bench sizes its own.
"""
from __future__ import annotations

import datetime
import itertools
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from llamax import checks
from llamax.batch import Batch
from llamax.context import Context
from llamax.generate import decode_prompt
from llamax.params import ContextParams

__all__ = ["BenchTest", "make_tests", "model_info", "run_bench", "run_matrix", "run_speculative", "markdown", "table",
           "BACKEND", "CONFIG_FIELDS"]

#: the only backend llamax has (llama-bench's `backend` column)
BACKEND = "CPU"
#: llama-bench's default n_batch / n_ubatch: the table shows these columns only when a row differs
DEFAULT_N_BATCH, DEFAULT_N_UBATCH = 2048, 512

# llama.cpp's llama_ftype names (llama_model_ftype_name) for general.file_type
_FTYPE_NAMES = {0: "all F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K - Medium",
                11: "Q3_K - Small", 12: "Q3_K - Medium", 13: "Q3_K - Large", 14: "Q4_K - Small", 15: "Q4_K - Medium",
                16: "Q5_K - Small", 17: "Q5_K - Medium", 18: "Q6_K", 32: "BF16"}

Progress = Callable[[str], None]
#: called after every timed rep with the model, the test and the configuration (CONFIG_FIELDS)
AfterRep = Callable[[Any, "BenchTest", dict], None]
#: a row's context configuration (run_bench's cfg)
CONFIG_FIELDS = ("type_k", "type_v", "flash_attn", "n_batch", "n_ubatch", "n_threads")


@dataclass(frozen=True)
class BenchTest:
    """One measurement (see the module docstring for what each shape times).

    Attributes:
        n_prompt: prompt tokens decoded in one go (n_batch chunks); the shared prefix when n_parallel > 0.
        n_gen: generated tokens (single-token decodes); steps of N tokens when n_parallel > 0.
        n_depth: tokens already in the cache (an untimed prefill) before the timed part; 0 with n_parallel.
        n_parallel: 0 for a llama-bench test, N >= 1 for batched-bench's N sequences sharing the prefix.

    Raises (on creation):
        ValueError: a negative count, nothing to time, or a shared-prefix test without a prefix and
            steps or with a depth.
        TypeError: a count that is not an int.
    """

    n_prompt: int = 0
    n_gen: int = 0
    n_depth: int = 0
    n_parallel: int = 0

    def __post_init__(self) -> None:
        for name in ("n_prompt", "n_gen", "n_depth", "n_parallel"):
            v = checks.integer(getattr(self, name), name)
            if v < 0:
                raise ValueError(f"{name} = {v} must be >= 0")
            object.__setattr__(self, name, v)
        if self.n_prompt == 0 and self.n_gen == 0:
            raise ValueError("a test needs n_prompt > 0 or n_gen > 0")
        if self.n_parallel and (self.n_prompt == 0 or self.n_gen == 0 or self.n_depth):
            raise ValueError(f"a shared-prefix test needs a prefix and steps and no depth (n_prompt = "
                             f"{self.n_prompt}, n_gen = {self.n_gen}, n_depth = {self.n_depth})")

    @property
    def name(self) -> str:
        """llama-bench's test name (pp512, tg128, pp512+tg128, pp512 @ d1024), batched-bench's pp256+tg64x8."""
        if self.n_parallel:
            return f"pp{self.n_prompt}+tg{self.n_gen}x{self.n_parallel}"
        parts = ([f"pp{self.n_prompt}"] if self.n_prompt else []) + ([f"tg{self.n_gen}"] if self.n_gen else [])
        return "+".join(parts) + (f" @ d{self.n_depth}" if self.n_depth else "")

    @property
    def n_tokens(self) -> int:
        """The tokens one rep's t/s counts (batched-bench counts the shared prefix once)."""
        return self.n_prompt + max(self.n_parallel, 1) * self.n_gen

    @property
    def n_ctx(self) -> int:
        """Cells the test's context needs (one unified stream)."""
        return self.n_depth + self.n_tokens

    @property
    def n_seq(self) -> int:
        return max(self.n_parallel, 1)


def make_tests(n_prompt: Iterable[int] = (512,), n_gen: Iterable[int] = (128,), n_depth: Iterable[int] = (0,),
               prompt_gen: Iterable[tuple[int, int]] = (), n_parallel: Iterable[int] = (),
               n_prefix: Iterable[int] = (128,), n_steps: Iterable[int] = (128,)) -> list[BenchTest]:
    """llama-bench's test list: for each depth, a pp test per n_prompt > 0, a tg test per n_gen > 0, a
    pp+tg test per (p, n) of prompt_gen; then batched-bench's shared-prefix tests, one per
    (n_prefix, n_steps, n_parallel) (the depth does not apply to them). Zero counts are skipped,
    as llama-bench skips `-p 0`.

    Raises:
        ValueError: a negative count, or n_parallel < 1.
    """
    tests = []
    n_prompt, n_gen, prompt_gen = list(n_prompt), list(n_gen), list(prompt_gen)
    for d in n_depth:
        tests += [BenchTest(n_prompt=p, n_depth=d) for p in n_prompt if p != 0]
        tests += [BenchTest(n_gen=n, n_depth=d) for n in n_gen if n != 0]
        tests += [BenchTest(n_prompt=p, n_gen=n, n_depth=d) for p, n in prompt_gen]
    for npp, ntg, npl in itertools.product(n_prefix, n_steps, n_parallel):
        if npl < 1:
            raise ValueError(f"--parallel {npl}: the number of sequences must be >= 1")
        tests.append(BenchTest(n_prompt=npp, n_gen=ntg, n_parallel=npl))
    return tests


def model_info(model) -> dict:
    """llama-bench's model fields: model_filename, model_type ("{arch} {size label} {file type}"),
    model_size (bytes of every tensor, llama_model_size), model_file_size, model_n_params (elements of
    every tensor, llama_model_n_params). Reads tensor infos only."""
    g = model.gguf
    tensors = g.tensors.values()
    n_params = sum(t.n_elements for t in tensors)
    label = g.get("general.size_label", None) or _params_label(n_params)
    ftype = g.get("general.file_type", None)
    ftype_name = _FTYPE_NAMES.get(ftype, f"ftype {ftype}") if ftype is not None else _dominant_type(tensors)
    return {"model_filename": str(g.path), "model_type": f"{model.arch} {label} {ftype_name}",
            "model_size": sum(t.n_bytes for t in tensors), "model_file_size": g.path.stat().st_size,
            "model_n_params": n_params}


def _params_label(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.0f}M"


def _dominant_type(tensors) -> str:
    by_type: dict[str, int] = {}
    for t in tensors:
        by_type[t.type_name] = by_type.get(t.type_name, 0) + t.n_bytes
    return max(by_type, key=by_type.__getitem__).upper() if by_type else "?"


class _Tokens:
    """Random valid token ids from a fixed seed (llama-bench draws std::rand() % n_vocab); the first
    token of an empty cache is BOS when the vocabulary adds one, as llama-bench's."""

    def __init__(self, model, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.n_vocab = model.n_vocab
        self.bos = model.bos if model.tokenizer.add_bos else None

    def draw(self, n: int, first: bool = False) -> list[int]:
        toks = self.rng.integers(0, self.n_vocab, n).tolist()
        if first and self.bos is not None and toks:
            toks[0] = self.bos
        return toks


def _run_once(ctx: Context, test: BenchTest, tok: _Tokens, n_prompt: int, n_gen: int, timed: bool) -> dict:
    """One rep (or, with timed=False and shorter counts, the warm-up) on a cleared cache; returns the
    timed nanoseconds, in total and for the prompt (pp_ns) and the generation (tg_ns)."""
    ctx.memory.clear(data=False)
    empty = True
    if test.n_depth and timed:
        decode_prompt(ctx, tok.draw(test.n_depth, first=True))
        empty = False
    prompt = tok.draw(n_prompt, first=empty)
    n_seq = test.n_seq
    gen = tok.draw(n_gen * n_seq, first=empty and not n_prompt)
    t0 = time.perf_counter_ns()
    if prompt:
        decode_prompt(ctx, prompt)
    t1 = time.perf_counter_ns()
    if test.n_parallel:
        for s in range(1, n_seq):  # batched-bench copies the prefix outside its timers
            ctx.memory.seq_cp(0, s, -1, -1)
        t1 = time.perf_counter_ns()
        seqs, outs = list(range(n_seq)), [True] * n_seq
        for i in range(n_gen):
            ctx.decode(Batch(gen[i * n_seq:(i + 1) * n_seq], seq_ids=seqs, logits=outs))
    else:
        for t in gen:
            ctx.decode(Batch([t]))
    t2 = time.perf_counter_ns()
    return {"pp_ns": t1 - t0, "tg_ns": t2 - t1}


def _summary(samples_ns: list[int], n_tokens: int) -> dict:
    ts = [n_tokens * 1e9 / ns for ns in samples_ns]
    sd = statistics.stdev if len(ts) > 1 else (lambda _: 0.0)
    return {"avg_ns": statistics.fmean(samples_ns), "stddev_ns": sd(samples_ns), "avg_ts": statistics.fmean(ts),
            "stddev_ts": sd(ts), "median_ts": statistics.median(ts), "samples_ns": samples_ns, "samples_ts": ts}


def run_bench(model, tests: Sequence[BenchTest], reps: int = 5, *, type_k: str = "f16", type_v: str = "f16",
              flash_attn: bool = True, n_batch: int = DEFAULT_N_BATCH, n_ubatch: int = DEFAULT_N_UBATCH,
              seed: int = 0, progress: Progress | None = None, after_rep: AfterRep | None = None) -> list[dict]:
    """Run each test on a fresh context of one configuration: a warm-up, then `reps` timed reps.

    Args:
        model: a loaded llamax.Model; its n_threads is the thread count measured (the contexts use it too).
        tests: BenchTests, run in order.
        reps: timed repetitions per test, >= 1.
        type_k, type_v, flash_attn, n_batch, n_ubatch: the contexts' parameters (ContextParams').
        seed: seed of the random token ids.
        progress: called with one line per finished test (e.g. to print to stderr).
        after_rep: called after each timed rep, outside the timers, with (model, test, configuration:
            the CONFIG_FIELDS as in the row); e.g. another program's rep of the same test
            (llamax.bench_llama), so the two alternate.

    Returns:
        One dict per test, llama-bench's JSON fields: the model fields of model_info, backends,
        n_threads, type_k, type_v, flash_attn, n_batch, n_ubatch, n_prompt, n_gen, n_depth, n_parallel,
        test, test_time, avg_ns, stddev_ns, avg_ts, stddev_ts, median_ts, samples_ns, samples_ts;
        a shared-prefix test adds pp_avg_ts and tg_avg_ts (batched-bench's S_PP, prefix tokens per
        second, and S_TG, N * n_gen tokens per second of the steps).

    Raises:
        ValueError, TypeError: bad parameters (before any test runs).
        BatchError, NoKVSlotError: a test's batch does not fit its context (a parallel N above n_batch).
    """
    reps = checks.integer(reps, "reps")
    if reps < 1:
        raise ValueError(f"reps = {reps} must be >= 1")
    tests = list(tests)
    for t in tests:
        if not isinstance(t, BenchTest):
            raise TypeError(f"tests must be BenchTests, got {type(t).__name__}")
    info = model_info(model)
    cfg = dict(type_k=type_k, type_v=type_v, flash_attn=flash_attn, n_batch=n_batch, n_ubatch=n_ubatch,
               n_threads=model.n_threads)
    ContextParams(**cfg)  # bad parameters fail before the first test
    tok = _Tokens(model, seed)
    rows = []
    for test in tests:
        ctx = Context(model, n_ctx=test.n_ctx, n_seq_max=test.n_seq, **cfg)
        when = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        _run_once(ctx, test, tok, test.n_prompt, min(test.n_gen, 1), timed=False)
        runs = []
        for _ in range(reps):
            runs.append(_run_once(ctx, test, tok, test.n_prompt, test.n_gen, timed=True))
            if after_rep is not None:
                after_rep(model, test, cfg)
        row = {**info, "backends": BACKEND, **cfg, "n_prompt": test.n_prompt, "n_gen": test.n_gen,
               "n_depth": test.n_depth, "n_parallel": test.n_parallel, "test": test.name, "test_time": when,
               **_summary([r["pp_ns"] + r["tg_ns"] for r in runs], test.n_tokens)}
        if test.n_parallel:
            row["pp_avg_ts"] = statistics.fmean(test.n_prompt * 1e9 / r["pp_ns"] for r in runs)
            row["tg_avg_ts"] = statistics.fmean(test.n_seq * test.n_gen * 1e9 / r["tg_ns"] for r in runs)
        rows.append(row)
        if progress is not None:
            progress(f"{info['model_type']}, {model.n_threads} threads, {type_k}/{type_v}, fa "
                     f"{'on' if flash_attn else 'off'}: {test.name}: {row['avg_ts']:.2f} ± {row['stddev_ts']:.2f} t/s")
    return rows


def run_matrix(models: Sequence[str], tests: Sequence[BenchTest], reps: int = 5, *,
               threads: Sequence[int | None] = (None,), type_k: Sequence[str] = ("f16",),
               type_v: Sequence[str] = ("f16",), flash_attn: Sequence[bool] = (True,),
               n_batch: Sequence[int] = (DEFAULT_N_BATCH,), n_ubatch: Sequence[int] = (DEFAULT_N_UBATCH,),
               seed: int = 0, progress: Progress | None = None, after_rep: AfterRep | None = None) -> list[dict]:
    """run_bench over every combination of the list-valued options (llama-bench's instances): each
    model (a GGUF path or registry name) is loaded once per thread count. A quantized V cache without
    flash attention (which llama.cpp refuses) is skipped with a progress line.

    Raises:
        ValueError: no combination is valid, or a bad value (before any model loads).
        ModelError: a model cannot be loaded.
    """
    from llamax.model import Model

    configs: list[dict[str, Any]] = []
    for nb, nub, tk, tv, fa in itertools.product(n_batch, n_ubatch, type_k, type_v, flash_attn):
        try:
            ContextParams(n_batch=nb, n_ubatch=nub, type_k=tk, type_v=tv, flash_attn=fa)
        except ValueError as e:
            if "requires flash_attn" not in str(e):
                raise
            if progress is not None:
                progress(f"skipping type_v {tv} with fa off: a quantized V cache requires flash attention")
            continue
        configs.append(dict(n_batch=nb, n_ubatch=nub, type_k=tk, type_v=tv, flash_attn=fa))
    if not configs:
        raise ValueError("no valid combination to measure (a quantized V cache requires -fa on)")
    if not tests:
        raise ValueError("no test to run (every -p, -n and -pg is 0 and there is no --parallel)")
    for name in models:  # a bad name fails before the first model's tests, not after them
        _check_model_name(name)
    rows = []
    for name, nt in itertools.product(models, threads):
        if progress is not None:
            progress(f"loading {name}" + (f" ({nt} threads)" if nt is not None else ""))
        model = Model.load(name, n_threads=nt)
        for cfg in configs:
            rows += run_bench(model, tests, reps, seed=seed, progress=progress, after_rep=after_rep, **cfg)
    return rows


def _check_model_name(name: str) -> None:
    """ModelError unless name is a file or a registry name (Model.load's message)."""
    from pathlib import Path

    from llamax import models
    from llamax.errors import ModelError

    if not Path(name).is_file() and name not in models.available():
        raise ModelError(f"{name!r} is neither a file nor a registry name ({', '.join(models.available())})")


# ---- llama-bench's markdown table ----------------------------------------------------------------

def _size(n: int) -> str:
    return f"{n / 1024**3:.2f} GiB" if n >= 1024**3 else f"{n / 1024**2:.2f} MiB"


def _params(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def markdown(rows: Sequence[dict]) -> str:
    """llama-bench's markdown table of run_bench rows: model, size, params, backend, threads, type_k,
    type_v, fa, (n_batch and n_ubatch when a row differs from 2048 / 512), test, t/s (mean ± stddev).
    Text columns are left-aligned, numbers right-aligned."""
    cols: list[tuple[str, bool, Callable[[dict], str]]] = [
        ("model", False, lambda r: r["model_type"]),
        ("size", True, lambda r: _size(r["model_size"])),
        ("params", True, lambda r: _params(r["model_n_params"])),
        ("backend", False, lambda r: r["backends"]),
        ("threads", True, lambda r: str(r["n_threads"])),
        ("type_k", False, lambda r: r["type_k"]),
        ("type_v", False, lambda r: r["type_v"]),
        ("fa", True, lambda r: "on" if r["flash_attn"] else "off"),
    ]
    if any(r["n_batch"] != DEFAULT_N_BATCH for r in rows):
        cols.append(("n_batch", True, lambda r: str(r["n_batch"])))
    if any(r["n_ubatch"] != DEFAULT_N_UBATCH for r in rows):
        cols.append(("n_ubatch", True, lambda r: str(r["n_ubatch"])))
    cols += [("test", True, lambda r: r["test"]),
             ("t/s", True, lambda r: f"{r['avg_ts']:.2f} ± {r['stddev_ts']:.2f}")]
    return table(cols, rows)


def table(cols: Sequence[tuple[str, bool, Callable[[dict], str]]], rows: Sequence[dict]) -> str:
    """A markdown table of rows: cols are (name, right-aligned, cell of a row); each column as wide as
    its widest cell."""
    cells = [[f(r) for _, _, f in cols] for r in rows]
    widths = [max([len(name)] + [len(c[i]) for c in cells]) for i, (name, _, _) in enumerate(cols)]

    def line(values: Sequence[str]) -> str:
        return "| " + " | ".join(v.rjust(w) if right else v.ljust(w)
                                 for v, w, (_, right, _) in zip(values, widths, cols)) + " |"

    rule = "| " + " | ".join("-" * (w - 1) + ":" if right else "-" * w
                             for w, (_, right, _) in zip(widths, cols)) + " |"
    return "\n".join([line([c[0] for c in cols]), rule] + [line(c) for c in cells])


# ---- serving: the Engine on a shared system prompt -------------------------------------------------

SERVING_SYSTEM_TEXT = ("You are the help desk of a public library. You answer questions about opening hours, "
                       "membership cards, loans, renewals, late fees, the reading room, printing and events. "
                       "Keep every answer short, friendly and exact, and say so when you do not know. ")


def serving_workload(model, n_requests: int = 32, n_system: int = 256, n_question: int = 32) -> tuple[list, list]:
    """(system prompt tokens, questions): a shared system prompt of exactly n_system tokens (BOS as the
    model wants, then library help-desk text) and n_requests distinct questions of n_question tokens."""
    sys_toks = model.tokenize(SERVING_SYSTEM_TEXT, add_special=True)
    body = model.tokenize(SERVING_SYSTEM_TEXT, add_special=False)
    while len(sys_toks) < n_system:
        sys_toks += body
    questions = []
    for i in range(n_requests):
        q = model.tokenize(f" Question {i}: may I borrow {i + 2} books for {3 * i + 7} days, and what does a late "
                           f"return of item number {1000 + 37 * i} cost?", add_special=False)
        while len(q) < n_question:
            q += q
        questions.append(q[:n_question])
    return sys_toks[:n_system], questions


def run_serving(model, system: list[int], questions: list[list[int]], *, n_parallel: int = 8, n_ctx: int = 4096,
                max_tokens: int = 64, n_threads: int | None = None, type_k: str = "f16", type_v: str = "f16",
                flash_attn: bool = True, prefix_cache: bool = True) -> dict:
    """All requests (system + question, greedy, exactly max_tokens each) submitted at once to an Engine of
    n_parallel slots and served to the end. Returns wall time, aggregate generation t/s, time to first
    token p50 / p95, prompt tokens computed vs submitted and the prefix cache's hit rate on the system
    prompt's tokens."""
    from llamax.serving import Engine

    eng = Engine(model, n_ctx=n_ctx, n_parallel=n_parallel, n_threads=n_threads, type_k=type_k, type_v=type_v,
                 flash_attn=flash_attn, prefix_cache=prefix_cache, max_queue=len(questions))
    eng.generate([model.bos if model.bos is not None else 0, 1, 2, 3], max_tokens=2, temperature=0)  # warm-up
    eng.clear_cache()
    base = eng.metrics()
    t0 = time.perf_counter()
    reqs = [eng.submit(system + q, max_tokens=max_tokens, temperature=0, ignore_eos=True) for q in questions]
    while eng.step():
        pass
    wall = time.perf_counter() - t0
    res = [r.result() for r in reqs]
    m = eng.metrics()
    ttft = np.array([r.ttft_s for r in res])
    gen = sum(r.n_generated for r in res)
    return dict(engine="llamax", wall_s=wall, gen_tokens=gen, gen_tps=gen / wall,
                ttft_p50_s=float(np.percentile(ttft, 50)), ttft_p95_s=float(np.percentile(ttft, 95)),
                prompt_computed=m["prompt_tokens"] - base["prompt_tokens"],
                prompt_submitted=sum(len(system) + len(q) for q in questions),
                prefix_hit_rate=(m["tokens_reused"] - base["tokens_reused"]) / (len(system) * len(questions)),
                n_steps=m["steps"] - base["steps"])


#: the --grammar test's default schema: a list of records, so a constrained generation can run long
BENCH_SCHEMA = {"type": "array", "items": {"type": "object", "properties": {
    "id": {"type": "integer"}, "name": {"type": "string"}, "email": {"type": "string"},
    "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["id", "name", "email", "tags"]}}
BENCH_GRAMMAR_PROMPT = "Here is the list of our 100 newest library members as a JSON array:\n"


def run_constrained(model, grammar, n_gen: int = 128, reps: int = 5, *, prompt: str = BENCH_GRAMMAR_PROMPT,
                    progress: Progress | None = None) -> dict:
    """Greedy generation of up to n_gen tokens with and without the grammar (llamax.Grammar), the two
    alternating rep by rep on one context: the decode plus the sampling step (the grammar's mask and
    its accept, the C chain), timed per token. End-of-generation tokens are banned so both run their
    length; the constrained run ends early where its grammar allows nothing more (its t/s counts the
    tokens it made). Returns the median t/s of each, their ratio and the tokens generated."""
    from llamax.sampling import Sampler
    from llamax.sequence import SeqDecoder

    reps = checks.integer(reps, "reps")
    if reps < 1 or n_gen < 1:
        raise ValueError(f"reps = {reps} and n_gen = {n_gen} must be >= 1")
    toks = model.tokenize(prompt, add_special=True, parse_special=True)
    ctx = Context(model, n_ctx=len(toks) + n_gen + 1)

    def once(g) -> tuple[int, int]:
        ctx.memory.clear(data=False)
        dec = SeqDecoder(model, Sampler(temperature=0.0, top_k=1, top_p=1.0, min_p=0.0, grammar=g),
                         max_tokens=n_gen, ignore_eos=True)
        decode_prompt(ctx, toks)
        t0 = time.perf_counter_ns()
        out = dec.step(ctx.get_logits_ith(-1))
        while out.stop is None:
            ctx.decode(Batch([out.token]))
            out = dec.step(ctx.get_logits_ith(-1))
        return time.perf_counter_ns() - t0, len(dec.generated)

    once(None), once(grammar)  # warm-up: the grammar compiled, the caches touched
    free: list[float] = []
    bound: list[float] = []
    n_bound = 0
    for _ in range(reps):
        for g, acc in ((None, free), (grammar, bound)):
            ns, n = once(g)
            acc.append(n * 1e9 / ns)
            n_bound = n if g is not None else n_bound
        if progress is not None:
            progress(f"{model_info(model)['model_type']}: tg free {free[-1]:.1f} t/s, with the grammar "
                     f"{bound[-1]:.1f} t/s")
    med_free, med_bound = statistics.median(free), statistics.median(bound)
    return dict(model=model_info(model)["model_type"], n_vocab=model.n_vocab, n_gen=n_gen, reps=reps,
                tg_free_ts=med_free, tg_grammar_ts=med_bound, ratio=med_bound / med_free,
                grammar_tokens=n_bound, samples_free_ts=free, samples_grammar_ts=bound)


def _spec_tasks() -> dict[str, str]:
    """The speculative bench's requests: an input-grounded one (rewrite a piece of code shipped with
    llamax, one name changed) and free text."""
    import inspect

    from llamax import sequence

    code = inspect.getsource(sequence.StopMatcher)
    return {
        "rewrite": "Rewrite the following Python code, renaming the method `push` to `feed` everywhere. Change "
                   "nothing else and output the whole code.\n\n```python\n" + code + "```",
        "free": "Write a long story about a lighthouse keeper who finds a message in a bottle.",
    }


def run_speculative(model, spec, n_gen: int = 256, reps: int = 5, *, progress: Progress | None = None) -> list[dict]:
    """Greedy generation of up to n_gen tokens (llamax.generate) with and without speculative decoding
    (spec, a llamax.Speculative), alternating rep by rep, on an input-grounded request (a code rewrite)
    and free text, each through the model's chat template on a fresh context. Returns a row per task:
    the median generation t/s of each, their ratio, the drafted / accepted tokens of the last rep and
    whether the outputs were the same (they must be)."""
    from dataclasses import replace

    from llamax.generate import generate
    from llamax.sampling import Sampler

    reps = checks.integer(reps, "reps")
    if reps < 1 or n_gen < 1:
        raise ValueError(f"reps = {reps} and n_gen = {n_gen} must be >= 1")
    if spec.kind == "draft" and isinstance(spec.model, str):
        from llamax.model import Model

        spec = replace(spec, model=Model.load(spec.model))
    rows = []
    for task, text in _spec_tasks().items():
        toks = model.tokenize(model.apply_chat_template([{"role": "user", "content": text}]), add_special=True,
                              parse_special=True)
        ctx = Context(model, n_ctx=len(toks) + n_gen + 64)

        def once(sp):
            ctx.memory.clear(data=False)
            g = generate(ctx, toks, max_tokens=n_gen, sampler=Sampler(temperature=0.0), speculative=sp)
            for _ in g:
                pass
            return g.stats, list(g.generated)

        once(None), once(spec)  # warm-up
        plain: list[float] = []
        fast: list[float] = []
        same = True
        for _ in range(reps):
            st0, out0 = once(None)
            st1, out1 = once(spec)
            plain.append(st0.gen_tps)
            fast.append(st1.gen_tps)
            same = same and out0 == out1
            if progress is not None:
                progress(f"{model_info(model)['model_type']} {task}: tg {plain[-1]:.1f} t/s, with {spec.kind} "
                         f"{fast[-1]:.1f} t/s, {st1.n_accepted}/{st1.n_drafted} accepted")
        m0, m1 = statistics.median(plain), statistics.median(fast)
        rows.append(dict(model=model_info(model)["model_type"], task=task, spec=spec.kind, n_gen=len(out1), reps=reps,
                         tg_ts=m0, tg_spec_ts=m1, ratio=m1 / m0, n_drafted=st1.n_drafted, n_accepted=st1.n_accepted,
                         acceptance=st1.n_accepted / st1.n_drafted if st1.n_drafted else 0.0, same=same,
                         samples_ts=plain, samples_spec_ts=fast))
    return rows
