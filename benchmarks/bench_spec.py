"""Speculative decoding over HTTP: `llamax serve` with and without n-gram drafts, beside llama.cpp's llama-server.

The requests are spec_prompts.py's: input-grounded ones (rewrite a file with one change, summarize quoting
the text, answer from a document quoting it), where a draft copied from the sequence's own tokens is often
right, and free text (a story, an essay), where it rarely is; all greedy (temperature 0), streamed over
loopback. Each configuration is a server started as a subprocess with the same model file, -c, -np, -t
and -fa:

    llamax               python -m llamax serve (no speculation)
    llamax ngram         the same with --spec-type ngram (run when this llamax serve has the flag)
    llama-server         no speculation
    llama-server TYPE    --spec-type TYPE, for each n-gram type (--spec-types; default: every ngram-* type
                         the binary's --help lists)

A configuration's turn: start the server, wait for /health, one short warm-up request, the SEQUENTIAL
requests one at a time, then the CONCURRENT round (8 distinct requests at once, -np 8), stop the server
(by the pid started, always). The configurations take turns within each round (the order rotates by
one each round) and the table gives medians over the rounds.

Figures, per model x kind x configuration:
  gen t/s      client side: (tokens - 1) / (time of the last content chunk - time of the first one) of each
               request, the median over the kind's requests; for "concurrent", the round's aggregate:
               all its generated tokens over the span from the first token of any request to the last one.
  server t/s   the server's own timings.predicted_per_second (median; concurrent: their sum).
  vs llamax    median over rounds of this configuration's figure / llamax's (no speculation) in the same round.
  vs ls-best   the same against llama-server's best n-gram type (best median gen t/s of that model x kind).
  accepted     accepted / drafted tokens, summed over the rounds: llama-server's timings draft_n_accepted /
               draft_n; llamax's from its timings when they carry them, else the spec_accepted / spec_drafted
               deltas of GET /metrics around each request (around the whole round for "concurrent").
Greedy output of llamax with and without speculation must be the same text: every difference is printed
as a MISMATCH (a bug). llama-server's spec types are checked against its own plain run the same way
(printed as a note). The targets of the issue (on input-grounded kinds llamax ngram >= 2.5x llamax and
>= 3x llama-server's best n-gram type; free text and concurrent >= 0.95x llamax) are checked at the end.

    python benchmarks/bench_spec.py --models smollm2-135m,gemma3-270m --rounds 3 \\
        --llama-server "$(bash ../shared/tools/build-llama-cpp.sh)/llama-server" --json spec.json
    python benchmarks/bench_spec.py --models smollm2-135m --rounds 1 --max-tokens 48   # a quick check
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench_server import Proc, free_port
from spec_prompts import CONCURRENT, GROUNDED, KINDS, SEQUENTIAL, SpecRequest
from llamax import Model, models
from llamax.model.chat import builtin_for_arch

BUILD_SCRIPT = Path(__file__).resolve().parents[2] / "shared" / "tools" / "build-llama-cpp.sh"
LLAMAX = "llamax"  # the baseline configuration's name
TARGETS = {"grounded_vs_llamax": 2.5, "grounded_vs_llama_server": 3.0, "free_vs_llamax": 0.95,
           "concurrent_vs_llamax": 0.95}


@dataclass(frozen=True)
class Config:
    """A server configuration: `name` (as the table shows it), `server` ("llamax" or "llama-server"),
    `spec` (the --spec-type value, None: no speculation) and the command without its port."""

    name: str
    server: str
    spec: str | None
    cmd: tuple[str, ...]

    def start(self) -> Proc:
        """Start the server on a free loopback port (llamax picks it and prints it); return once /health
        answers 200."""
        if self.server == "llamax":
            return Proc([*self.cmd, "--port", "0"], None)
        port = free_port()
        return Proc([*self.cmd, "--host", "127.0.0.1", "--port", str(port)], port)


# ---- the servers' flags -------------------------------------------------------------------------------
def help_text(cmd: list[str]) -> str:
    out = subprocess.run([*cmd, "--help"], capture_output=True, text=True, timeout=120)
    return out.stdout + out.stderr


def llamax_has_spec() -> bool:
    """True when this llamax serve takes --spec-type."""
    return "--spec-type" in help_text([sys.executable, "-m", "llamax", "serve"])


def llama_server_ngram_types(binary: str) -> list[str]:
    """The n-gram spec types llama-server's --help lists under --spec-type (e.g. ngram-simple, ngram-mod)."""
    text = help_text([binary])
    m = re.search(r"--spec-type\b(.*?)(?:\n\s*-{1,2}[a-z]|\Z)", text, re.S)
    if m is None:
        return []
    return list(dict.fromkeys(re.findall(r"\bngram-[a-z0-9-]*[a-z0-9]", m.group(1))))


def configs(a, name: str, gguf: Path, template: list[str], llamax_specs: list[str],
            ls_types: list[str]) -> list[Config]:
    common = ["-np", str(a.concurrent), "-c", str(a.ctx_size), "-t", str(a.threads), "-fa", a.fa]
    lx = [sys.executable, "-m", "llamax", "serve", "-m", name, *common]
    out = [Config(LLAMAX, "llamax", None, tuple(lx))]
    knobs = []
    if a.spec_n_max is not None:
        knobs += ["--spec-n-max", str(a.spec_n_max)]
    if a.spec_n_min is not None:
        knobs += ["--spec-n-min", str(a.spec_n_min)]
    for spec in llamax_specs:
        draft = ["-md", a.model_draft] if spec == "draft" else []
        out.append(Config(f"llamax {spec}", "llamax", spec, (*lx, "--spec-type", spec, *knobs, *draft)))
    if a.llama_server:
        for spec in [None, *ls_types]:
            cmd = [a.llama_server, "-m", str(gguf), *common, "-cb",
                   "--cache-prompt", *template, *shlex.split(a.llama_server_args)]
            if spec is not None:
                cmd += ["--spec-type", spec]
            out.append(Config("llama-server" + (f" {spec}" if spec else ""), "llama-server", spec, tuple(cmd)))
    return out


# ---- one request, one turn ----------------------------------------------------------------------------
def spec_counters(client: httpx.Client, url: str) -> tuple[float, float] | None:
    """llamax's (spec_drafted, spec_accepted) counters from GET /metrics; None when it has none."""
    text = client.get(url + "/metrics").text
    vals = {m.group(1): float(m.group(2)) for m in
            re.finditer(r"^llamax_(spec_drafted|spec_accepted)(?:_total)?\s+(\S+)\s*$", text, re.M)}
    return (vals["spec_drafted"], vals["spec_accepted"]) if len(vals) == 2 else None


def stream(client: httpx.Client, url: str, req: SpecRequest, cap: int | None) -> dict:
    """Send one streamed chat request (its max_tokens lowered to `cap` if given); its text, token count,
    client-side clock readings and the server's timings (draft counts included when it gives them)."""
    body = req.body()
    if cap is not None:
        body["max_tokens"] = min(body["max_tokens"], cap)
    pieces: list[str] = []
    t_first = t_last = None
    usage = timings = finish = None
    t_send = time.perf_counter()
    with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"{req.name}: HTTP {r.status_code}: {r.text[:500]}")
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            for choice in chunk.get("choices") or ():
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    t_last = time.perf_counter()
                    t_first = t_last if t_first is None else t_first
                    pieces.append(piece)
                finish = choice.get("finish_reason") or finish
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings
    timings = timings or {}
    n_gen = (usage or {}).get("completion_tokens") or timings.get("predicted_n") or len(pieces)
    span = (t_last - t_first) if t_first is not None else 0.0
    return {"name": req.name, "kind": req.kind, "n_gen": n_gen, "finish": finish, "text": "".join(pieces),
            "t_send": t_send, "t_first": t_first, "t_last": t_last,
            "gen_tps": (n_gen - 1) / span if n_gen > 1 and span > 0 else math.nan,
            "server_tps": timings.get("predicted_per_second", math.nan),
            "drafted": timings.get("draft_n"), "accepted": timings.get("draft_n_accepted")}


def turn(cfg: Config, url: str, n_concurrent: int, cap: int | None) -> tuple[list[dict], dict]:
    """The configuration's requests on a running server: the sequential ones, then the concurrent round.
    Returns the per-request records and the concurrent round's aggregate."""
    with httpx.Client(timeout=900, limits=httpx.Limits(max_connections=n_concurrent + 2)) as client:
        warm = client.post(url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, "temperature": 0})
        warm.raise_for_status()
        use_metrics = cfg.server == "llamax" and cfg.spec is not None

        def metrics_delta(before: tuple[float, float] | None) -> tuple[float, float] | None:
            after = spec_counters(client, url) if before is not None else None
            return (after[0] - before[0], after[1] - before[1]) if after is not None else None

        records = []
        for req in SEQUENTIAL:
            before = spec_counters(client, url) if use_metrics else None
            rec = stream(client, url, req, cap)
            delta = metrics_delta(before)
            if rec["drafted"] is None and delta is not None:
                rec["drafted"], rec["accepted"] = delta
            records.append(rec | {"phase": "sequential"})
        conc = CONCURRENT[:n_concurrent]
        before = spec_counters(client, url) if use_metrics else None
        with concurrent.futures.ThreadPoolExecutor(len(conc)) as pool:
            crecs = list(pool.map(lambda rq: stream(client, url, rq, cap), conc))
        delta = metrics_delta(before)
    if cfg.server == "llama-server" and cfg.spec is not None:  # its timings name the draft counts once there are some
        for r in records + crecs:
            r["drafted"], r["accepted"] = r["drafted"] or 0, r["accepted"] or 0
    if any(r["drafted"] is not None for r in crecs):  # the responses' own counts win over /metrics
        delta = (sum(r["drafted"] or 0 for r in crecs), sum(r["accepted"] or 0 for r in crecs))
    firsts = [r["t_first"] for r in crecs if r["t_first"] is not None]
    lasts = [r["t_last"] for r in crecs if r["t_last"] is not None]
    span = max(lasts) - min(firsts) if firsts else 0.0
    n_gen = sum(r["n_gen"] for r in crecs)
    agg = {"name": "concurrent", "kind": "concurrent", "phase": "concurrent-round", "n_gen": n_gen,
           "gen_tps": n_gen / span if span > 0 else math.nan,
           "server_tps": math.fsum(r["server_tps"] for r in crecs),
           "drafted": delta[0] if delta else None, "accepted": delta[1] if delta else None}
    return records + [r | {"phase": "concurrent"} for r in crecs], agg


# ---- the report ---------------------------------------------------------------------------------------
def nanmedian(xs) -> float:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return statistics.median(xs) if xs else math.nan


def figures(records: list[dict], rounds: int) -> dict:
    """(model, kind, config) -> per-round client and server t/s and summed draft counts."""
    out: dict[tuple, dict] = {}
    for r in records:
        if r["phase"] == "concurrent":  # counted through the round's aggregate
            continue
        key = (r["model"], r["kind"], r["config"])
        f = out.setdefault(key, {"gen": [[] for _ in range(rounds)], "server": [[] for _ in range(rounds)],
                                 "drafted": 0.0, "accepted": 0.0, "has_drafts": False})
        f["gen"][r["round"]].append(r["gen_tps"])
        f["server"][r["round"]].append(r["server_tps"])
        if r["drafted"] is not None:
            f["has_drafts"] = True
            f["drafted"] += r["drafted"]
            f["accepted"] += r["accepted"] or 0
    for f in out.values():
        f["gen_round"] = [nanmedian(x) for x in f["gen"]]
        f["server_round"] = [nanmedian(x) for x in f["server"]]
    return out


def round_ratio(a: dict, b: dict) -> float:
    return nanmedian([x / y for x, y in zip(a["gen_round"], b["gen_round"]) if y and not math.isnan(y)])


def report(records: list[dict], rounds: int, model_names: list[str], cfg_names: dict[str, list[str]],
           ls_spec_names: dict[str, list[str]]) -> tuple[list[dict], list[str]]:
    """The table rows (also returned for --json) and the target checks."""
    figs = figures(records, rounds)
    rows, checks = [], []
    for model in model_names:
        for kind in (*KINDS, "concurrent"):
            base = figs.get((model, kind, LLAMAX))
            ls = [n for n in ls_spec_names[model] if (model, kind, n) in figs]
            best = max(ls, key=lambda n: nanmedian(figs[(model, kind, n)]["gen_round"])) if ls else None
            for name in cfg_names[model]:
                f = figs.get((model, kind, name))
                if f is None:
                    continue
                row = {"model": model, "kind": kind, "config": name,
                       "gen_tps": nanmedian(x for per in f["gen"] for x in per) if kind != "concurrent"
                       else nanmedian(f["gen_round"]),
                       "server_tps": nanmedian(x for per in f["server"] for x in per) if kind != "concurrent"
                       else nanmedian(f["server_round"]),
                       "vs_llamax": round_ratio(f, base) if base else math.nan,
                       "vs_llama_server_best": round_ratio(f, figs[(model, kind, best)]) if best else math.nan,
                       "llama_server_best": best,
                       "drafted": f["drafted"] if f["has_drafts"] else None,
                       "accepted": f["accepted"] if f["has_drafts"] else None}
                rows.append(row)
    for model in model_names:
        for row in rows:
            if row["model"] != model or row["config"] != f"{LLAMAX} ngram":
                continue
            kind = row["kind"]
            if kind in GROUNDED:
                checks.append(_check(model, kind, "vs llamax", row["vs_llamax"], TARGETS["grounded_vs_llamax"]))
                checks.append(_check(model, kind, f"vs {row['llama_server_best']}", row["vs_llama_server_best"],
                                     TARGETS["grounded_vs_llama_server"]))
            else:
                key = "free_vs_llamax" if kind == "free" else "concurrent_vs_llamax"
                checks.append(_check(model, kind, "vs llamax", row["vs_llamax"], TARGETS[key]))
    return rows, checks


def _check(model: str, kind: str, what: str, value: float, target: float) -> str:
    verdict = "n/a" if math.isnan(value) else ("met" if value >= target else "NOT MET")
    return f"{model} {kind}: llamax ngram {what} = {value:.3f}x (target >= {target}x): {verdict}"


def fmt(x, spec=".1f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def print_table(rows: list[dict]) -> None:
    print("| model | kind | config | gen t/s | server t/s | vs llamax | vs llama-server best ngram "
          "| accepted / drafted |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        acc = "-"
        if r["drafted"] is not None:
            acc = f"{r['accepted']:.0f}/{r['drafted']:.0f}"
            if r["drafted"]:
                acc = f"{100 * r['accepted'] / r['drafted']:.0f}% ({acc})"
        print(f"| {r['model']} | {r['kind']} | {r['config']} | {fmt(r['gen_tps'])} | {fmt(r['server_tps'])} "
              f"| {fmt(r['vs_llamax'], '.2f')} | {fmt(r['vs_llama_server_best'], '.2f')} | {acc} |")


def compare_texts(records: list[dict]) -> list[dict]:
    """Greedy outputs that differ: llamax with speculation against llamax without (a bug: printed as
    MISMATCH) and llama-server's spec types against its plain run (printed as a note)."""
    texts = {(r["model"], r["config"], r["round"], r["phase"], r["name"]): r["text"] for r in records
             if "text" in r}
    found = []
    for (model, cfg, rnd, phase, name), text in texts.items():
        if cfg in (LLAMAX, "llama-server"):
            continue
        ref_cfg = LLAMAX if cfg.startswith(LLAMAX) else "llama-server"
        ref = texts.get((model, ref_cfg, rnd, phase, name))
        if ref is None or ref == text:
            continue
        at = next((i for i, (x, y) in enumerate(zip(ref, text)) if x != y), min(len(ref), len(text)))
        found.append({"model": model, "config": cfg, "reference": ref_cfg, "round": rnd, "phase": phase,
                      "name": name, "at": at, "reference_text": ref[max(0, at - 40):at + 40],
                      "text": text[max(0, at - 40):at + 40], "bug": ref_cfg == LLAMAX})
    for m in found:
        where = f"{m['model']} {m['config']} vs {m['reference']}, round {m['round']} {m['phase']} {m['name']}"
        if m["bug"]:
            print(f"MISMATCH (speculation changed llamax's greedy output): {where}, first difference at char "
                  f"{m['at']}:\n    {m['reference']}: {m['reference_text']!r}\n    {m['config']}: {m['text']!r}",
                  flush=True)
        else:
            print(f"note: llama-server's greedy output differs: {where}, at char {m['at']}", file=sys.stderr)
    return found


# ---- main ---------------------------------------------------------------------------------------------
def default_llama_server() -> str | None:
    """llama-server in the folder the llama.cpp build script prints (the script builds it the first time:
    minutes; its progress goes to stderr); None without the script or on a failed build."""
    if not BUILD_SCRIPT.is_file():
        return None
    out = subprocess.run(["bash", str(BUILD_SCRIPT)], stdout=subprocess.PIPE, text=True)
    path = Path(out.stdout.strip().splitlines()[-1]) / "llama-server" if out.returncode == 0 and out.stdout.strip() else None
    return str(path) if path is not None and path.is_file() else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="smollm2-135m,gemma3-270m", help="registry names, comma-separated")
    p.add_argument("--llama-server", default="auto",
                   help="llama-server binary (default: the llama.cpp build script's folder; 'none': llamax only)")
    p.add_argument("--spec-types", default=None,
                   help="llama-server's --spec-type values, comma-separated (default: every ngram-* type it has)")
    p.add_argument("--llama-server-args", default="", help="more llama-server arguments (one string, e.g. its "
                   "--spec-ngram-* knobs)")
    p.add_argument("--llamax-spec-types", default="ngram", help="llamax's --spec-type values beside none "
                   "(default ngram; 'draft' needs --model-draft)")
    p.add_argument("-md", "--model-draft", default=None, help="llamax's draft model for --llamax-spec-types draft")
    p.add_argument("--spec-n-max", type=int, default=None, help="llamax --spec-n-max (default: llamax's)")
    p.add_argument("--spec-n-min", type=int, default=None, help="llamax --spec-n-min (default: llamax's)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--concurrent", type=int, default=8, help="-np of every server and the size of the "
                   f"concurrent round (at most {len(CONCURRENT)})")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="lower every request's max_tokens to this (a quick check; default: the requests' own)")
    p.add_argument("-c", "--ctx-size", type=int, default=16384, help="-c of every server (default 16384)")
    p.add_argument("-t", "--threads", type=int, default=os.cpu_count() or 2)
    p.add_argument("-fa", "--fa", choices=["on", "off"], default="on", help="flash attention for both (default on)")
    p.add_argument("--json", metavar="OUT", default=None, help="write every request's record and the table to OUT")
    a = p.parse_args()
    if a.rounds < 1:
        p.error(f"--rounds {a.rounds}: at least 1")
    if a.max_tokens is not None and a.max_tokens < 2:
        p.error(f"--max-tokens {a.max_tokens}: at least 2 (the rate is over tokens after the first)")
    if not 1 <= a.concurrent <= len(CONCURRENT):
        p.error(f"--concurrent {a.concurrent}: between 1 and {len(CONCURRENT)}")
    model_names = [m for m in a.models.split(",") if m]
    for m in model_names:
        try:
            models.spec(m)
        except models.UnknownModelError as e:
            p.error(str(e))
    llamax_specs = [s for s in a.llamax_spec_types.split(",") if s and s != "none"]
    if "draft" in llamax_specs and not a.model_draft:
        p.error("--llamax-spec-types draft needs --model-draft")
    if llamax_specs and not llamax_has_spec():
        print(f"llamax serve has no --spec-type yet: running llamax without speculation only "
              f"(not {', '.join(llamax_specs)})", file=sys.stderr)
        llamax_specs = []
    if a.llama_server == "auto":
        a.llama_server = default_llama_server()
        if a.llama_server is None:
            print("no llama-server found (build it with the llama.cpp build script, or pass --llama-server): "
                  "llamax only", file=sys.stderr)
    elif a.llama_server == "none":
        a.llama_server = None
    ls_types = []
    if a.llama_server:
        ls_types = ([s for s in a.spec_types.split(",") if s] if a.spec_types is not None
                    else llama_server_ngram_types(a.llama_server))

    records: list[dict] = []
    cfg_names: dict[str, list[str]] = {}
    ls_spec_names: dict[str, list[str]] = {}
    for model_name in model_names:
        gguf = models.path(model_name)
        model = Model.load(model_name)
        # a GGUF without a chat template: llama-server would fall back to chatml, llamax to the
        # architecture's own format; give llama-server llamax's, so both compute the same prompts
        template = [] if model.chat_template else ["--no-jinja", "--chat-template", builtin_for_arch(model.arch)]
        del model
        cfgs = configs(a, model_name, gguf, template, llamax_specs, ls_types)
        cfg_names[model_name] = [c.name for c in cfgs]
        ls_spec_names[model_name] = [c.name for c in cfgs if c.server == "llama-server" and c.spec]
        for rnd in range(a.rounds):
            shift = rnd % len(cfgs)
            for cfg in cfgs[shift:] + cfgs[:shift]:
                srv = cfg.start()
                try:
                    recs, agg = turn(cfg, srv.url, a.concurrent, a.max_tokens)
                finally:
                    srv.stop()
                tag = {"model": model_name, "config": cfg.name, "round": rnd}
                records += [r | tag for r in recs] + [agg | tag]
                seq = {k: nanmedian(r["gen_tps"] for r in recs if r["kind"] == k and r["phase"] == "sequential")
                       for k in KINDS}
                print(f"{model_name} round {rnd} {cfg.name}: " + ", ".join(f"{k} {fmt(v)}" for k, v in seq.items())
                      + f", concurrent {fmt(agg['gen_tps'])} t/s", file=sys.stderr, flush=True)

    mismatches = compare_texts(records)
    rows, checks = report(records, a.rounds, model_names, cfg_names, ls_spec_names)
    print(f"\nspeculative decoding over HTTP: {', '.join(model_names)}; greedy, streamed; -np {a.concurrent} "
          f"-c {a.ctx_size} -t {a.threads} -fa {a.fa}; medians of {a.rounds} round(s); gen t/s client side "
          f"(first to last token; concurrent: the round's aggregate)")
    print_table(rows)
    bugs = [m for m in mismatches if m["bug"]]
    if llamax_specs:
        print(f"\nllamax greedy outputs with and without speculation: "
              f"{f'{len(bugs)} MISMATCH(ES)' if bugs else 'identical'}")
    else:
        print("\n(llamax ran without speculation only: its --spec-type is missing)")
    for c in checks:
        print(c)
    if a.json:
        Path(a.json).write_text(json.dumps({
            "args": vars(a), "rows": rows, "checks": checks, "mismatches": mismatches,
            "records": records}, indent=1, default=str))
    return 1 if bugs else 0


if __name__ == "__main__":
    sys.exit(main())
