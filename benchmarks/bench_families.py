"""Speed of every family at real dimensions (transformers and Mamba-2 ones): `llamax bench` beside llama-bench.

For each family and qtype given, the synthetic model of family_models.py is written (or found in its cache
directory), then the two programs alternate rep by rep, each run as a subprocess on the same file with the same
settings and one timed rep per run (both warm up first):

    llamax bench -m FILE -p P -n N -r 1 -t T -fa on  -b 2048 -ub 512 -ctk f16 -ctv f16 -o json
    llama-bench  -m FILE -p P -n N -r 1 -t T -fa 1   -b 2048 -ub 512 -ctk f16 -ctv f16 -o json

(--fa off runs both without flash attention; the K/V options apply to the attention layers only, so a pure
Mamba-2 model runs the same either way). The table gives, per model, the file size, the median pp and tg
t/s of each side over --reps rounds and llamax's ratio to llama.cpp; --json prints every sample instead.
A side that fails (e.g. an architecture it cannot load) shows its error in the table, and the other
models still run.

    python benchmarks/bench_families.py qwen3 llama gemma2 --qtype q8_0,q4_0 --reps 5 \\
        --llama-bench "$(bash ../shared/tools/build-llama-cpp.sh)/llama-bench"
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

import family_models as fm

from llamax.bench_llama import cpu_name


def _common(a: argparse.Namespace, model: Path) -> list[str]:
    return ["-m", str(model), "-p", str(a.n_prompt), "-n", str(a.n_gen), "-r", "1", "-t", str(a.threads),
            "-b", "2048", "-ub", "512", "-ctk", "f16", "-ctv", "f16", "-o", "json"]


def llamax_cmd(a: argparse.Namespace, model: Path) -> list[str]:
    return [*shlex.split(a.llamax), "bench", *_common(a, model), "-fa", a.fa, *shlex.split(a.llamax_args)]


def llama_bench_cmd(a: argparse.Namespace, model: Path) -> list[str]:
    return [a.llama_bench, *_common(a, model), "-fa", "1" if a.fa == "on" else "0", *shlex.split(a.llama_bench_args)]


def run_one(cmd: list[str], timeout: float) -> dict:
    """One bench run: {"pp": t/s, "tg": t/s} from its JSON (the tests with n_prompt > 0 and n_gen == 0 are pp,
    the reverse tg), or {"error": the last line of its stderr}."""
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"error": str(e)}
    if r.returncode != 0:
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        return {"error": f"exit {r.returncode}: {lines[-1] if lines else ''}"}
    out: dict = {}
    for test in json.loads(r.stdout):
        if test["n_prompt"] > 0 and test["n_gen"] == 0:
            out["pp"] = test["avg_ts"]
        elif test["n_gen"] > 0 and test["n_prompt"] == 0:
            out["tg"] = test["avg_ts"]
        out.setdefault("model_type", test.get("model_type"))
    return out


def _median(samples: list[dict], key: str) -> float | None:
    xs = [s[key] for s in samples if key in s]
    return statistics.median(xs) if xs else None


def bench_model(a: argparse.Namespace, family: str, qtype: str) -> dict:
    """Write (or find) the model, then --reps rounds of llamax and llama-bench alternating."""
    path = a.dir / fm.default_path(family, qtype).name
    t0 = time.perf_counter()
    fm.write(path, family, qtype)
    prep = time.perf_counter() - t0
    side = json.loads(fm.sidecar_path(path).read_text())
    row = {"family": family, "qtype": qtype, "source": fm.FAMILIES[family].source, "file": str(path),
           "file_size": path.stat().st_size, "n_params": fm.n_params(family),
           "write_seconds": side.get("write_seconds"), "prepare_seconds": round(prep, 1),
           "llamax": [], "llama.cpp": []}
    failed: set[str] = set()       # a side that failed is not run again for this model
    for rep in range(a.reps):
        for name, cmd in (("llamax", llamax_cmd(a, path)), ("llama.cpp", llama_bench_cmd(a, path))):
            if name in failed:
                continue
            res = run_one(cmd, a.timeout)
            row[name].append(res)
            what = res.get("error") or " ".join(f"{t} {res[t]:.2f}" for t in ("pp", "tg") if t in res) + " t/s"
            print(f"bench_families: {family} {qtype} rep {rep + 1}/{a.reps} {name}: {what}", file=sys.stderr,
                  flush=True)
            if "error" in res:
                failed.add(name)
    for name in ("llamax", "llama.cpp"):
        row[name + "_pp"] = _median(row[name], "pp")
        row[name + "_tg"] = _median(row[name], "tg")
        errors = [s["error"] for s in row[name] if "error" in s]
        row[name + "_error"] = errors[0] if errors else None
    for t in ("pp", "tg"):
        x, y = row["llamax_" + t], row["llama.cpp_" + t]
        row[t + "_ratio"] = x / y if x and y else None
    return row


def table(rows: list[dict], a: argparse.Namespace) -> str:
    pp, tg = f"pp{a.n_prompt}", f"tg{a.n_gen}"

    def num(v: float | None) -> str:
        return "" if v is None else f"{v:.2f}"

    def ratio(v: float | None) -> str:
        return "" if v is None else f"{v:.2f}x"

    fa = f"llamax -fa {a.fa}, llama-bench -fa {1 if a.fa == 'on' else 0}"
    out = [f"CPU: {cpu_name()}; {a.threads} threads on both sides, flash attention {a.fa} ({fa}), f16 K/V, "
           f"n_batch 2048, n_ubatch 512; medians of {a.reps} alternating rep(s) of one timed run each.", "",
           f"| family | model | qtype | file MiB | llamax {pp} | llamax {tg} | llama.cpp {pp} | llama.cpp {tg} "
           f"| {pp} ratio | {tg} ratio |",
           "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        cells = [r["family"], r["source"], r["qtype"], f"{r['file_size'] / 2**20:.0f}"]
        for name in ("llamax", "llama.cpp"):
            if r[name + "_error"] and r[name + "_pp"] is None and r[name + "_tg"] is None:
                cells += [f"error: {r[name + '_error']}".replace("|", "/"), ""]
            else:
                cells += [num(r[name + "_pp"]), num(r[name + "_tg"])]
        cells += [ratio(r["pp_ratio"]), ratio(r["tg_ratio"])]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("families", nargs="+", choices=list(fm.FAMILIES), metavar="FAMILY",
                   help=f"one or more of: {', '.join(fm.FAMILIES)}")
    p.add_argument("--qtype", default="q8_0", help="comma list of q8_0, q4_0 (default q8_0)")
    p.add_argument("--reps", type=int, default=3, help="alternating rounds (default 3)")
    p.add_argument("-p", "--n-prompt", type=int, default=512, help="pp test tokens (default 512)")
    p.add_argument("-n", "--n-gen", type=int, default=128, help="tg test tokens (default 128)")
    p.add_argument("-t", "--threads", type=int, default=2, help="threads of both sides (default 2)")
    p.add_argument("--fa", choices=("on", "off"), default="on", help="flash attention on both sides (default on)")
    p.add_argument("--llama-bench", default=os.environ.get("LLAMA_BENCH"),
                   help="llama.cpp's llama-bench binary (default: $LLAMA_BENCH)")
    p.add_argument("--llamax", default=f"{shlex.quote(sys.executable)} -m llamax",
                   help="the command that runs llamax's CLI (default: this Python's `-m llamax`)")
    p.add_argument("--llamax-args", default="", help="more options for llamax bench (one string)")
    p.add_argument("--llama-bench-args", default="", help="more options for llama-bench (one string), e.g. '--poll 0'")
    p.add_argument("--dir", type=Path, default=fm.DEFAULT_DIR, help=f"the models' directory (default {fm.DEFAULT_DIR})")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per bench run (default 1800)")
    p.add_argument("--json", action="store_true", help="print every row and sample as JSON instead of the table")
    a = p.parse_args(argv)
    qtypes = [q.strip() for q in a.qtype.split(",") if q.strip()]
    bad = [q for q in qtypes if q not in fm.QTYPES]
    if bad or not qtypes:
        p.error(f"--qtype: {', '.join(bad) or 'none given'}: expected a comma list of {', '.join(fm.QTYPES)}")
    if a.reps < 1 or a.n_prompt < 0 or a.n_gen < 0 or a.n_prompt + a.n_gen == 0 or a.threads < 1:
        p.error(f"need --reps >= 1 (got {a.reps}), -t >= 1 (got {a.threads}) and -p, -n >= 0 not both 0 "
                f"(got {a.n_prompt}, {a.n_gen})")
    if not a.llama_bench or not os.access(a.llama_bench, os.X_OK):
        p.error(f"--llama-bench: no executable at {a.llama_bench!r} (give the path, or set LLAMA_BENCH)")
    rows = [bench_model(a, fam, q) for fam in a.families for q in qtypes]
    if a.json:
        print(json.dumps({"cpu": cpu_name(), "threads": a.threads, "flash_attn": a.fa, "n_prompt": a.n_prompt,
                          "n_gen": a.n_gen, "reps": a.reps, "rows": rows}, indent=1))
    else:
        print(table(rows, a))
    return 0


if __name__ == "__main__":
    sys.exit(main())
