"""llamax.bench_llama and `llamax bench --llama-bench`: llama-bench's command per test, one llama-bench rep
after every llamax rep, the medians and ratios, the machine line, failures as one-line errors.

llama-bench itself is not part of the tests (its figures are recorded by hand); a small stand-in
program with llama-bench's command line and JSON output takes its place: it logs its arguments and
answers 100, 200, 300, ... t/s call after call, so the medians and ratios are known exactly."""
import json
import stat
import sys

import pytest

from llamax import bench, bench_llama, cli
from llamax._native import cpu
from llamax.bench import BenchTest

CFG = dict(n_threads=2, type_k="q8_0", type_v="f16", flash_attn=True, n_batch=1024, n_ubatch=256)

STAND_IN = r"""#!{python}
import json, sys
args = sys.argv[1:]
log = {log!r}
with open(log, "a") as f:
    f.write(json.dumps(args) + "\n")
n_calls = sum(1 for _ in open(log))
if {fail!r}:
    print("loading model: boom", file=sys.stderr)
    sys.exit(3)
opt = lambda k: args[args.index(k) + 1]
p, n, d = int(opt("-p")), int(opt("-n")), int(opt("-d"))
if "-pg" in args:
    p, n = (int(v) for v in opt("-pg").split(","))
print(json.dumps([{{"n_prompt": p, "n_gen": n, "n_depth": d, "avg_ts": 100.0 * n_calls}}]))
"""


def stand_in(tmp_path, fail=False):
    log = tmp_path / "calls.jsonl"
    exe = tmp_path / "llama-bench"
    exe.write_text(STAND_IN.format(python=sys.executable, log=str(log), fail=fail))
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    return exe, log


def calls(log):
    return [json.loads(ln) for ln in log.read_text().splitlines()]


def test_command_of_each_test_shape():
    cmd = bench_llama.llama_bench_command("lb", "m.gguf", BenchTest(n_prompt=512, n_depth=8192), CFG)
    assert cmd == ["lb", "-m", "m.gguf", "-p", "512", "-n", "0", "-d", "8192", "-t", "2", "-ctk", "q8_0", "-ctv",
                   "f16", "-fa", "1", "-b", "1024", "-ub", "256", "-r", "1", "-o", "json"]
    tg = bench_llama.llama_bench_command("lb", "m.gguf", BenchTest(n_gen=128), {**CFG, "flash_attn": False})
    assert tg[3:8] == ["-p", "0", "-n", "128", "-d"] and tg[tg.index("-fa") + 1] == "0"
    both = bench_llama.llama_bench_command("lb", "m.gguf", BenchTest(n_prompt=64, n_gen=16), CFG)
    assert both[3:9] == ["-p", "0", "-n", "0", "-pg", "64,16"]
    with pytest.raises(ValueError, match="shared-prefix"):
        bench_llama.llama_bench_command("lb", "m.gguf", BenchTest(n_prompt=8, n_gen=2, n_parallel=2), CFG)


def test_one_llama_bench_rep_after_every_llamax_rep(tmp_path, smollm2_gguf):
    exe, log = stand_in(tmp_path)
    tests = [BenchTest(n_prompt=8), BenchTest(n_gen=2, n_depth=4)]
    rows = bench_llama.compare([str(smollm2_gguf)], tests, 3, exe, threads=[1])
    got = calls(log)
    assert len(got) == 6   # 3 reps x 2 tests, in test order
    assert [(c[c.index("-p") + 1], c[c.index("-n") + 1], c[c.index("-d") + 1]) for c in got] == \
        [("8", "0", "0")] * 3 + [("0", "2", "4")] * 3
    for c in got:
        assert c[c.index("-m") + 1] == str(smollm2_gguf) and c[c.index("-t") + 1] == "1"
        assert c[c.index("-r") + 1] == "1" and c[c.index("-ctk") + 1] == "f16" and c[c.index("-fa") + 1] == "1"
    assert [r["test"] for r in rows] == ["pp8", "tg2 @ d4"]
    for r, answers in zip(rows, ([100.0, 200.0, 300.0], [400.0, 500.0, 600.0])):
        assert r["llama_bench_samples_ts"] == answers and r["llama_bench_median_ts"] == answers[1]
        assert len(r["samples_ts"]) == 3 and r["ratio"] == pytest.approx(r["median_ts"] / answers[1])


def test_after_rep_runs_between_the_timed_reps(model):
    order = []
    rows = bench.run_bench(model, [BenchTest(n_gen=2)], reps=3,
                           after_rep=lambda m, t, cfg: order.append((m is model, t.name, cfg["n_threads"])))
    assert order == [(True, "tg2", model.n_threads)] * 3 and len(rows[0]["samples_ns"]) == 3


def test_machine_line_names_cpu_and_level(tmp_path, smollm2_gguf):
    where = bench_llama.machine()
    assert where["cpu"] == bench_llama.cpu_name() and where["cpu"]
    assert where["simd"] == cpu.LEVEL_NAMES[cpu.simd_level()] and where["cpu_simd"] == cpu.LEVEL_NAMES[cpu.cpu_level()]
    exe, _ = stand_in(tmp_path)
    rows = bench_llama.compare([str(smollm2_gguf)], [BenchTest(n_prompt=8)], 1, exe, threads=[1])
    text = bench_llama.markdown(rows, {"cpu": "Test CPU 9000", "cores": 2, "simd": "portable", "cpu_simd": "avx2"})
    head, blank, *table = text.splitlines()
    assert head == "CPU: Test CPU 9000 (2 cores), SIMD level portable (the CPU's: avx2); medians of 1 alternating reps"
    assert blank == ""
    cells = [c.strip() for c in table[2].strip("|").split("|")]
    assert cells[-3:] == [f"{rows[0]['median_ts']:.2f}", "100.00", f"{rows[0]['median_ts'] / 100:.2f}x"]


def test_cli_table_and_json(tmp_path, capsys, smollm2_gguf):
    exe, log = stand_in(tmp_path)
    rc = cli.main(["bench", "-m", str(smollm2_gguf), "-p", "8", "-n", "2", "-r", "2", "-t", "1",
                   "--llama-bench", str(exe)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    lines = out.strip().splitlines()
    assert lines[0].startswith(f"CPU: {bench_llama.cpu_name()} (") and "SIMD level" in lines[0]
    header = [c.strip() for c in lines[2].strip("|").split("|")]
    assert header == ["model", "threads", "cache", "fa", "test", "llamax t/s", "llama-bench t/s",
                      "llamax / llama-bench"]
    assert [c.strip() for c in lines[4].strip("|").split("|")][4:7:2] == ["pp8", "150.00"]
    assert [c.strip() for c in lines[5].strip("|").split("|")][4:7:2] == ["tg2", "350.00"]
    assert len(calls(log)) == 4
    rc = cli.main(["bench", "-m", str(smollm2_gguf), "-p", "8", "-n", "0", "-r", "1", "-t", "1",
                   "--llama-bench", str(exe), "--json"])
    out, err = capsys.readouterr()
    rows = json.loads(out)
    assert rc == 0 and len(rows) == 1 and rows[0]["cpu"] == bench_llama.cpu_name()
    assert rows[0]["llama_bench_samples_ts"] == [500.0] and rows[0]["ratio"] > 0


@pytest.mark.parametrize("extra", [["--parallel", "2"], ["--serving"]])
def test_cli_refuses_what_llama_bench_does_not_measure(capsys, tmp_path, extra):
    exe, log = stand_in(tmp_path)
    rc = cli.main(["bench", "-r", "1", "--llama-bench", str(exe), *extra])
    out, err = capsys.readouterr()
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1 and "--llama-bench" in err
    assert not log.exists()


def test_failures_are_one_line(capsys, tmp_path, smollm2_gguf):
    exe, _ = stand_in(tmp_path, fail=True)
    with pytest.raises(RuntimeError, match="exited with 3 on pp8: loading model: boom"):
        bench_llama.compare([str(smollm2_gguf)], [BenchTest(n_prompt=8)], 1, exe, threads=[1])
    rc = cli.main(["bench", "-m", str(smollm2_gguf), "-p", "8", "-n", "0", "-r", "1", "-t", "1",
                   "--llama-bench", str(exe)])
    out, err = capsys.readouterr()
    assert rc == 1 and out == "" and err.strip().splitlines()[-1] == \
        "llamax bench: llama-bench exited with 3 on pp8: loading model: boom"
    rc = cli.main(["bench", "-p", "8", "-n", "0", "-r", "1", "--llama-bench", str(tmp_path / "none")])
    out, err = capsys.readouterr()
    assert rc == 1 and "is not a file" in err
