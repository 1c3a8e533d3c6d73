"""llamax beside llama.cpp's own llama-bench, in one run on one machine.

`compare` runs llamax.bench's tests and, after every timed llamax rep, one rep of the same test by a
llama-bench binary (`-r 1`: its own warm-up, then one timed run) with the same model file, threads,
cache types, flash attention and batch sizes. Both see the same machine load, rep by rep; a row gets
the medians of both and their ratio. `machine` names the CPU and the SIMD level llamax's kernels run
at, and `markdown` prints both with the rows:

    CPU: AMD EPYC (2 cores), SIMD level portable (the CPU's: avx2); medians of 3 alternating reps

    | model | threads | cache | fa | test | llamax t/s | llama-bench t/s | llamax / llama-bench |

(the CPU's own level is named only when LLAMAX_SIMD set a lower one).

batched-bench's shared-prefix tests have no llama-bench counterpart and are refused.
"""
from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from llamax import bench

__all__ = ["cpu_name", "machine", "machine_line", "llama_bench_command", "run_llama_bench", "compare", "markdown"]

#: seconds one llama-bench rep may take (a depth-8192 prefill of a small model on two cores is ~1 min)
TIMEOUT_S = 1800


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo's "model name" on Linux, else the platform's processor)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def machine() -> dict:
    """cpu (its model name), cores (os.cpu_count), simd (the level llamax's kernels run at now: the
    CPU's, or LLAMAX_SIMD's) and cpu_simd (the highest level the CPU has)."""
    from llamax._native import cpu

    return {"cpu": cpu_name(), "cores": os.cpu_count() or 1, "simd": cpu.LEVEL_NAMES[cpu.simd_level()],
            "cpu_simd": cpu.LEVEL_NAMES[cpu.cpu_level()]}


def machine_line(where: dict | None = None) -> str:
    """"CPU: name (N cores), SIMD level L" of machine() (or where), with the CPU's own level when lower."""
    m = where or machine()
    simd = m["simd"] + ("" if m["simd"] == m["cpu_simd"] else f" (the CPU's: {m['cpu_simd']})")
    return f"CPU: {m['cpu']} ({m['cores']} cores), SIMD level {simd}"


def _comparable(test: bench.BenchTest) -> None:
    """ValueError for a shared-prefix test (batched-bench's, not llama-bench's)."""
    if test.n_parallel:
        raise ValueError(f"{test.name}: a shared-prefix test has no llama-bench counterpart")


def llama_bench_command(binary: str | os.PathLike, model_path: str | os.PathLike, test: bench.BenchTest,
                        cfg: dict) -> list[str]:
    """The llama-bench command of one rep of test with a run_bench configuration (n_threads, type_k,
    type_v, flash_attn, n_batch, n_ubatch).

    Raises:
        ValueError: a shared-prefix test (batched-bench's, not llama-bench's).
    """
    _comparable(test)
    if test.n_prompt and test.n_gen:
        shape = ["-p", "0", "-n", "0", "-pg", f"{test.n_prompt},{test.n_gen}"]
    else:
        shape = ["-p", str(test.n_prompt), "-n", str(test.n_gen)]
    return [str(binary), "-m", str(model_path), *shape, "-d", str(test.n_depth), "-t", str(cfg["n_threads"]),
            "-ctk", cfg["type_k"], "-ctv", cfg["type_v"], "-fa", "1" if cfg["flash_attn"] else "0",
            "-b", str(cfg["n_batch"]), "-ub", str(cfg["n_ubatch"]), "-r", "1", "-o", "json"]


def run_llama_bench(binary: str | os.PathLike, model_path: str | os.PathLike, test: bench.BenchTest,
                    cfg: dict) -> float:
    """The t/s of one llama-bench rep of test (llama_bench_command).

    Raises:
        RuntimeError: llama-bench failed or printed no row of this test (its last stderr line is in
            the message).
    """
    cmd = llama_bench_command(binary, model_path, test, cfg)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
    tail = (r.stderr.strip().splitlines() or [""])[-1]
    if r.returncode != 0:
        raise RuntimeError(f"llama-bench exited with {r.returncode} on {test.name}: {tail}")
    try:
        rows = json.loads(r.stdout)
    except json.JSONDecodeError as e:
        raise RuntimeError(f"llama-bench printed no JSON on {test.name} ({e}): {tail}") from None
    for row in rows:
        if (row.get("n_prompt"), row.get("n_gen"), row.get("n_depth", 0)) == (test.n_prompt, test.n_gen,
                                                                            test.n_depth):
            return float(row["avg_ts"])
    raise RuntimeError(f"llama-bench printed no row of {test.name}: {tail}")


def compare(models: Sequence[str], tests: Sequence[bench.BenchTest], reps: int, llama_bench: str | os.PathLike,
            **options: Any) -> list[dict]:
    """bench.run_matrix(models, tests, reps, **options) with one llama-bench rep after every timed
    llamax rep. Each row gains llama_bench_samples_ts, llama_bench_median_ts and ratio (llamax's
    median_ts over llama-bench's median).

    Raises:
        FileNotFoundError: llama_bench is not a file.
        ValueError: a shared-prefix test, or what run_matrix raises for bad options (before any run).
        RuntimeError: a llama-bench rep failed (run_llama_bench).
    """
    if not Path(llama_bench).is_file():
        raise FileNotFoundError(f"llama-bench: {llama_bench} is not a file")
    for t in tests:  # a shared-prefix test fails before any run
        _comparable(t)
    samples: dict[tuple, list[float]] = {}

    def after_rep(model, test: bench.BenchTest, cfg: dict) -> None:
        key = (str(model.gguf.path), test, tuple(sorted(cfg.items())))
        samples.setdefault(key, []).append(run_llama_bench(llama_bench, model.gguf.path, test, cfg))

    rows = bench.run_matrix(models, tests, reps, after_rep=after_rep, **options)
    for row in rows:
        test = bench.BenchTest(n_prompt=row["n_prompt"], n_gen=row["n_gen"], n_depth=row["n_depth"])
        cfg = {k: row[k] for k in bench.CONFIG_FIELDS}
        theirs = samples[(row["model_filename"], test, tuple(sorted(cfg.items())))]
        row["llama_bench_samples_ts"] = theirs
        row["llama_bench_median_ts"] = statistics.median(theirs)
        row["ratio"] = row["median_ts"] / row["llama_bench_median_ts"]
    return rows


def markdown(rows: Sequence[dict], where: dict | None = None) -> str:
    """The machine line (machine(), or where), a blank line, then one table row per compare row: model,
    threads, type_k / type_v, fa, n_batch / n_ubatch (when a row differs from 2048 / 512), test, the
    median t/s of llamax and of llama-bench over the reps, and their ratio."""
    reps = {len(r["samples_ts"]) for r in rows}
    head = f"{machine_line(where)}; medians of {'/'.join(str(n) for n in sorted(reps))} alternating reps"
    cols: list[tuple[str, bool, Any]] = [
        ("model", False, lambda r: r["model_type"]),
        ("threads", True, lambda r: str(r["n_threads"])),
        ("cache", False, lambda r: f"{r['type_k']}/{r['type_v']}"),
        ("fa", True, lambda r: "on" if r["flash_attn"] else "off"),
    ]
    if any(r["n_batch"] != bench.DEFAULT_N_BATCH or r["n_ubatch"] != bench.DEFAULT_N_UBATCH for r in rows):
        cols.append(("b/ub", True, lambda r: f"{r['n_batch']}/{r['n_ubatch']}"))
    cols += [("test", True, lambda r: r["test"]),
             ("llamax t/s", True, lambda r: f"{r['median_ts']:.2f}"),
             ("llama-bench t/s", True, lambda r: f"{r['llama_bench_median_ts']:.2f}"),
             ("llamax / llama-bench", True, lambda r: f"{r['ratio']:.2f}x")]
    return head + "\n\n" + bench.table(cols, rows)
