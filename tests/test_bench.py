"""llamax.bench and `llamax bench`: the test shapes, what one rep leaves in the cache, the table and
the JSON, list-valued options, one-line errors. Tiny sizes: the figures are only checked to be > 0."""
import json
import subprocess
import sys

import pytest

from llamax import bench, cli
from llamax.bench import BenchTest
from llamax.context import Context

COLUMNS = ["model", "size", "params", "backend", "threads", "type_k", "type_v", "fa", "test", "t/s"]
FIELDS = ["model_filename", "model_type", "model_size", "model_file_size", "model_n_params", "backends", "n_threads",
          "type_k", "type_v", "flash_attn", "n_batch", "n_ubatch", "n_prompt", "n_gen", "n_depth", "n_parallel",
          "test", "test_time", "avg_ns", "stddev_ns", "avg_ts", "stddev_ts", "median_ts", "samples_ns", "samples_ts"]


def run_cli(capsys, *args):
    rc = cli.main(["bench", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def parse_table(text: str) -> list[dict]:
    """The markdown table as dicts by column name; checks the header rule and the row widths."""
    lines = text.strip().splitlines()
    split = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in lines]
    header, rule, body = split[0], split[1], split[2:]
    assert all(set(c) <= set("-:") and c for c in rule), lines[1]
    assert len({len(ln) for ln in lines}) == 1, "rows of one width"
    assert all(len(r) == len(header) for r in body)
    return [dict(zip(header, r)) for r in body]


def ts(cell: str) -> float:
    mean, sd = cell.split(" ± ")
    assert float(sd) >= 0
    return float(mean)


# ---- the test shapes -------------------------------------------------------------------------------

def test_names_and_token_counts():
    assert BenchTest(n_prompt=512).name == "pp512"
    assert BenchTest(n_gen=128).name == "tg128"
    assert BenchTest(n_prompt=512, n_gen=128).name == "pp512+tg128"
    assert BenchTest(n_prompt=512, n_depth=1024).name == "pp512 @ d1024"
    t = BenchTest(n_prompt=256, n_gen=64, n_parallel=8)
    assert (t.name, t.n_tokens, t.n_ctx, t.n_seq) == ("pp256+tg64x8", 256 + 8 * 64, 256 + 8 * 64, 8)
    assert BenchTest(n_gen=4, n_depth=10).n_ctx == 14


@pytest.mark.parametrize("kw", [dict(), dict(n_prompt=-1), dict(n_prompt=4, n_parallel=2),
                                dict(n_prompt=4, n_gen=2, n_depth=8, n_parallel=2)])
def test_bad_tests_raise(kw):
    with pytest.raises(ValueError):
        BenchTest(**kw)


def test_make_tests_order_is_llama_bench():
    names = [t.name for t in bench.make_tests([8, 0], [2], [0, 4], [(3, 1)], [2], [5], [1])]
    assert names == ["pp8", "tg2", "pp3+tg1", "pp8 @ d4", "tg2 @ d4", "pp3+tg1 @ d4", "pp5+tg1x2"]


def test_int_ranges():
    assert cli._int_range("512") == [512]
    assert cli._int_range("1-4") == [1, 2, 3, 4]
    assert cli._int_range("0-64+32") == [0, 32, 64]
    assert cli._int_range("1-16*2") == [1, 2, 4, 8, 16]
    with pytest.raises(ValueError):
        cli._int_range("4-1")


def test_model_info(model):
    info = bench.model_info(model)
    assert info["model_n_params"] == 134515008  # llama.cpp's "model params = 134.52 M"
    assert info["model_size"] == sum(t.n_bytes for t in model.gguf.tensors.values())
    assert info["model_size"] <= info["model_file_size"]
    assert info["model_type"] == "llama 135M Q4_1"


# ---- what one rep does -----------------------------------------------------------------------------

def test_shared_prefix_rep_fills_every_sequence(model):
    t = BenchTest(n_prompt=6, n_gen=3, n_parallel=4)
    ctx = Context(model, n_ctx=t.n_ctx, n_seq_max=t.n_seq, n_threads=model.n_threads)
    ns = bench._run_once(ctx, t, bench._Tokens(model, 0), t.n_prompt, t.n_gen, timed=True)
    assert ns["pp_ns"] > 0 and ns["tg_ns"] > 0
    mem = ctx.memory
    assert [(mem.seq_pos_min(s), mem.seq_pos_max(s)) for s in range(4)] == [(0, 8)] * 4
    assert ctx.get_logits().shape == (4, model.n_vocab)  # the last step: logits for every sequence


def test_depth_rep_prefills_untimed(model):
    t = BenchTest(n_gen=2, n_depth=5)
    ctx = Context(model, n_ctx=t.n_ctx, n_threads=model.n_threads)
    bench._run_once(ctx, t, bench._Tokens(model, 0), t.n_prompt, t.n_gen, timed=True)
    assert ctx.memory.seq_pos_max(0) == 6


def test_run_bench_depth_and_parallel(model):
    tests = [BenchTest(n_prompt=8, n_depth=8), BenchTest(n_gen=2, n_depth=8),
             BenchTest(n_prompt=8, n_gen=2, n_parallel=3)]
    lines = []
    rows = bench.run_bench(model, tests, reps=2, progress=lines.append)
    assert [r["test"] for r in rows] == ["pp8 @ d8", "tg2 @ d8", "pp8+tg2x3"]
    assert len(lines) == 3 and "pp8+tg2x3" in lines[2]
    for r in rows:
        assert set(FIELDS) <= set(r)
        assert len(r["samples_ns"]) == len(r["samples_ts"]) == 2
        assert r["avg_ts"] > 0 and r["median_ts"] > 0 and r["stddev_ts"] >= 0
        assert r["n_threads"] == model.n_threads and r["backends"] == "CPU"
    par = rows[2]
    assert par["n_parallel"] == 3 and par["pp_avg_ts"] > 0 and par["tg_avg_ts"] > 0
    assert par["avg_ts"] == pytest.approx(sum((8 + 3 * 2) * 1e9 / ns for ns in par["samples_ns"]) / 2)
    table = parse_table(bench.markdown(rows))
    assert [r["test"] for r in table] == ["pp8 @ d8", "tg2 @ d8", "pp8+tg2x3"]


def test_run_bench_rejects_bad_parameters(model):
    with pytest.raises(ValueError):
        bench.run_bench(model, [BenchTest(n_gen=1)], reps=0)
    with pytest.raises(ValueError):
        bench.run_bench(model, [BenchTest(n_gen=1)], reps=1, type_k="q9")


# ---- the command -----------------------------------------------------------------------------------

def test_cli_table(capsys):
    rc, out, err = run_cli(capsys, "-m", "smollm2-135m", "-p", "16", "-n", "4", "-r", "1")
    assert rc == 0, err
    rows = parse_table(out)
    assert list(rows[0]) == COLUMNS
    assert [r["test"] for r in rows] == ["pp16", "tg4"]
    for r in rows:
        assert r["model"] == "llama 135M Q4_1" and r["size"] == "92.10 MiB" and r["params"] == "134.52 M"
        assert (r["backend"], r["type_k"], r["type_v"], r["fa"]) == ("CPU", "f16", "f16", "on")
        assert int(r["threads"]) >= 1 and ts(r["t/s"]) > 0
    progress = err.strip().splitlines()
    assert all(ln.startswith("llamax bench: ") for ln in progress) and any("pp16" in ln for ln in progress)


def test_cli_json_list_option(capsys):
    rc, out, err = run_cli(capsys, "-p", "8", "-n", "0", "-r", "1", "-ctk", "f16,q8_0", "-t", "1", "--json")
    assert rc == 0, err
    rows = json.loads(out)
    assert [(r["type_k"], r["test"]) for r in rows] == [("f16", "pp8"), ("q8_0", "pp8")]
    for r in rows:
        assert set(FIELDS) <= set(r) and r["avg_ts"] > 0 and r["n_threads"] == 1 and r["flash_attn"] is True


def test_cli_depth_parallel_and_repeated_flags(capsys):
    rc, out, err = run_cli(capsys, "-p", "4", "-n", "2", "-d", "4", "-r", "1", "--parallel", "2", "-npp", "4",
                           "-ntg", "2", "-ub", "4", "-ub", "8")
    assert rc == 0, err
    rows = parse_table(out)
    assert [(r["n_ubatch"], r["test"]) for r in rows] == [
        (ub, t) for ub in ("4", "8") for t in ("pp4 @ d4", "tg2 @ d4", "pp4+tg2x2")]
    assert all(ts(r["t/s"]) > 0 for r in rows)


def test_cli_subprocess():
    r = subprocess.run([sys.executable, "-m", "llamax", "bench", "-p", "8", "-n", "2", "-r", "1", "-o", "md"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rows = parse_table(r.stdout)  # stdout is the table and nothing else
    assert [row["test"] for row in rows] == ["pp8", "tg2"] and all(ts(row["t/s"]) > 0 for row in rows)
    assert "llamax bench:" in r.stderr


@pytest.mark.parametrize("args, rc", [
    (["-ctk", "q9"], 2), (["-p", "x"], 2), (["-t", "0"], 2), (["-fa", "maybe"], 2), (["-o", "csv"], 2),
    (["-r", "0"], 2), (["-npp", "4"], 2), (["-ctv", "q8_0", "-fa", "off"], 2), (["-m", "no-such-model"], 1),
    (["-m", "smollm2-135m,/no/such.gguf", "-r", "1"], 1),
])
def test_cli_errors_are_one_line(capsys, args, rc):
    try:
        got = cli.main(["bench", *args])
    except SystemExit as e:  # argparse
        got = e.code
    out, err = capsys.readouterr()
    assert got == rc and out == ""
    errors = [ln for ln in err.strip().splitlines() if not ln.startswith("llamax bench: skipping")]
    assert len(errors) == 1 and errors[0].startswith("llamax bench:"), err


def test_run_constrained_measures_both(model):
    """`llamax bench --grammar`: the same greedy loop with and without the grammar, and what each made."""
    from llamax import Grammar

    row = bench.run_constrained(model, Grammar.regex("[0-9]{2}"), n_gen=6, reps=1)
    assert row["n_vocab"] == model.n_vocab and row["grammar_tokens"] <= 2  # two digits, then the grammar ends
    assert row["tg_free_ts"] > 0 and row["tg_grammar_ts"] > 0 and len(row["samples_free_ts"]) == 1
    with pytest.raises(ValueError):
        bench.run_constrained(model, Grammar.json(), n_gen=0)


def test_cli_grammar_table(capsys, tmp_path):
    from llamax import cli

    spec = tmp_path / "digits.gbnf"
    spec.write_text('root ::= [0-9] [0-9] [0-9]\n')
    assert cli.main(["bench", "--grammar", str(spec), "-n", "4", "-r", "1"]) == 0
    out = capsys.readouterr().out
    assert "| tg t/s with the grammar |" in out and str(spec) in out
    assert cli.main(["bench", "--grammar", str(tmp_path / "x.txt"), "-n", "4", "-r", "1"]) == 2
