"""The long fuzz runs: one harness of tests/fuzz/ under atheris (libFuzzer, coverage-guided over the
instrumented llamax package and the harness), in a child process so that a crash, a hang or an
out-of-memory is counted and reported, not fatal to the report.

    python benchmarks/fuzz.py --target state --cases 10000
    python benchmarks/fuzz.py --target all --cases 10000 --timeout 30

Per target it prints the cases run, the crashes (an uncaught exception: a broken contract or a leaked
exception type, or a fatal signal), the hangs (a case over --timeout seconds), out-of-memory
(RSS over --rss-mb), the wall time and the command. libFuzzer stops at the first finding and
writes the input to the artifact directory (replay it with `--replay FILE`). The seeds are copied
from tests/fuzz/corpus/<target>/ into a scratch corpus (new coverage is not written back into tests/).
--engine random runs the same harness on random bytes without atheris.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGETS = ("state", "gguf", "batch", "tokenizer", "server")


def _child(target: str, argv: list[str]) -> None:
    import atheris

    with atheris.instrument_imports(include=["llamax", "tests.fuzz"]):
        import importlib

        h = importlib.import_module(f"tests.fuzz.{target}")
    h.one_input(b"")          # load the models and the caches once, outside the per-case timeout
    atheris.Setup([sys.argv[0]] + argv, h.one_input)
    atheris.Fuzz()


def _random(target: str, cases: int, timeout: float) -> dict:
    import importlib
    import traceback

    from tests.fuzz.common import Hang, time_limit

    h = importlib.import_module(f"tests.fuzz.{target}")
    h.one_input(b"")
    crashes = hangs = 0
    t0 = time.perf_counter()
    for i in range(cases):
        data = os.urandom(1 + (i * 7919) % 512)
        try:
            with time_limit(timeout):
                h.one_input(data)
        except Hang:
            hangs += 1
        except Exception:
            crashes += 1
            if crashes <= 3:
                traceback.print_exc()
                print(f"input: {data.hex()}", file=sys.stderr)
    return {"cases": cases, "crashes": crashes, "hangs": hangs, "oom": 0, "wall_s": time.perf_counter() - t0}


def run(target: str, cases: int, timeout: float, rss_mb: int, work: Path, seed: int) -> dict:
    corpus = work / f"corpus-{target}"
    artifacts = work / f"artifacts-{target}"
    shutil.rmtree(corpus, ignore_errors=True)
    shutil.copytree(ROOT / "tests" / "fuzz" / "corpus" / target, corpus)
    artifacts.mkdir(parents=True, exist_ok=True)
    args = [f"-runs={cases}", f"-timeout={int(timeout)}", f"-rss_limit_mb={rss_mb}", "-max_len=16384",
            f"-seed={seed}", "-print_final_stats=1", f"-artifact_prefix={artifacts}/", str(corpus)]
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", target, "--", *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.setdefault("OMP_NUM_THREADS", "1")
    env["LLAMAX_FUZZ_SCRATCH"] = str(work)   # libFuzzer's child exits without atexit: keep its files here
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       errors="replace")
    wall = time.perf_counter() - t0
    out = p.stdout
    m = re.search(r"stat::number_of_executed_units:\s*(\d+)", out) or re.search(r"Done (\d+) runs", out)
    executed = int(m.group(1)) if m else 0
    hang = "ALARM: working on the last Unit" in out or "libFuzzer: timeout" in out
    oom = "out-of-memory" in out
    crashed = p.returncode != 0 and not hang and not oom
    res = {"cases": executed, "crashes": int(crashed), "hangs": int(hang), "oom": int(oom), "wall_s": wall,
           "returncode": p.returncode, "artifacts": sorted(str(a) for a in artifacts.iterdir())}
    if p.returncode != 0:
        tail = "\n".join(out.splitlines()[-60:])
        print(f"---- {target}: libFuzzer output (last lines) ----\n{tail}", file=sys.stderr)
    return res


def main() -> int:
    if "--child" in sys.argv:
        i = sys.argv.index("--child")
        target = sys.argv[i + 1]
        rest = sys.argv[sys.argv.index("--") + 1:] if "--" in sys.argv else []
        sys.path.insert(0, str(ROOT))
        _child(target, rest)
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="all", choices=TARGETS + ("all",))
    ap.add_argument("--cases", type=int, default=10000)
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds per case before it counts as a hang")
    ap.add_argument("--rss-mb", type=int, default=3072, help="resident memory limit of the fuzzing process")
    ap.add_argument("--engine", default="atheris", choices=("atheris", "random"))
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workdir", default=None, help="scratch corpus and artifacts (default: a new temp dir)")
    ap.add_argument("--replay", default=None, help="run one input file through --target and show the error")
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    if a.replay:
        import importlib

        importlib.import_module(f"tests.fuzz.{a.target}").one_input(Path(a.replay).read_bytes())
        print("no finding")
        return 0
    work = Path(a.workdir or tempfile.mkdtemp(prefix="llamax-fuzz-run-"))
    targets = TARGETS if a.target == "all" else (a.target,)
    bad = 0
    print(f"{'target':10} {'cases':>7} {'crashes':>7} {'hangs':>5} {'oom':>3} {'wall s':>8}")
    for t in targets:
        if a.engine == "random":
            r = _random(t, a.cases, a.timeout)
        else:
            r = run(t, a.cases, a.timeout, a.rss_mb, work, a.seed)
        bad += r["crashes"] + r["hangs"] + r["oom"] + (r["cases"] < a.cases)
        print(f"{t:10} {r['cases']:7d} {r['crashes']:7d} {r['hangs']:5d} {r['oom']:3d} {r['wall_s']:8.1f}"
              + (f"  artifacts: {r['artifacts']}" if r.get("artifacts") else ""), flush=True)
    print(f"command: {' '.join([Path(sys.executable).name, 'benchmarks/fuzz.py', *sys.argv[1:]])}")
    print(f"scratch corpus and artifacts: {work}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
