"""Replay llama.cpp's recorded memory operations (shared/reference/*/memory_ops.json) through
KVCache / KVCacheISWA with the real batch allocator, and compare seq_pos_min/max and the cell
tables with llama.cpp's after every step."""
import numpy as np
from helpers import load_memory_ops

from llamax import Batch, KVCache, KVCacheISWA, RoPE


def load(model):
    return load_memory_ops(model)


def sections(mem):
    caches = [mem] if isinstance(mem, KVCache) else [mem.base, mem.swa]
    return [[[p, sorted(s)] for p, s in c.cells() if p >= 0] for c in caches]


def decode(mem, tokens, op):
    seq = op["seq_ids"][0]
    toks = tokens[op["token_slice"][0]:op["token_slice"][1]] if "token_slice" in op else [1] * op["n_tokens"]
    pos = None if isinstance(op["pos0"], str) else list(range(op["pos0"], op["pos0"] + op["n_tokens"]))
    for ub in mem.plan(Batch(toks, pos=pos, seq_ids=[seq] * len(toks)), n_ubatch=256):
        n = ub.n_tokens
        for il in range(mem.n_layer):
            mem.store(il, ub, np.zeros((n, 1, 8), np.float32), np.zeros((n, 1, 8), np.float32))


def replay(mem, run, compare):
    for step in run["steps"]:
        op = step["op"]
        kind = op["op"]
        if kind == "decode":
            decode(mem, run.get("tokens", []), op)
        elif kind == "seq_cp":
            mem.seq_cp(op["src"], op["dst"], op["p0"], op["p1"])
        elif kind == "seq_rm":
            assert mem.seq_rm(op["seq"], op["p0"], op["p1"]) == step.get("ret", True)
        elif kind == "seq_keep":
            mem.seq_keep(op["seq"])
        elif kind in ("seq_add", "seq_div"):
            args = (op["seq"], op["p0"], op["p1"], op["delta"] if kind == "seq_add" else op["d"])
            if step.get("skipped"):
                # llama.cpp refused the shift (can_shift false with a small SWA cache); llamax shifts
                # there too (KVCacheISWA.exact_shift_limit), but replays what llama.cpp recorded
                assert mem.can_shift and mem.swa.kv_size < mem.base.kv_size
            else:
                getattr(mem, kind)(*args)
        else:
            raise AssertionError(f"unknown op {kind}")
        pos = {str(s): [mem.seq_pos_min(s), mem.seq_pos_max(s)] for s in range(len(step["pos"]))}
        assert pos == step["pos"], f"after {op}"
        compare(mem, step)


def compare_cells(mem, step):
    assert sections(mem) == step["cells_all_seq"], f"after {step['op']}"


def test_smollm2_default_unified_four_sequences():
    run = load("smollm2-135m-instruct-q4_1")["default"]
    assert run["ctx_params"]["n_ctx"] == 256 and run["ctx_params"]["kv_unified"]
    mem = KVCache(1, 1, 8, 256, n_seq_max=4, rope=RoPE(8))
    replay(mem, run, compare_cells)


def test_gemma_default_full_size_swa_cache():
    run = load("gemma-3-270m-q4_k_m")["default"]
    mem = KVCacheISWA(2, 1, 8, 256, swa_layers=[1], n_swa=512, swa_full=True, n_ubatch=256, n_seq_max=4,
                      rope=RoPE(8))
    assert mem.can_shift
    replay(mem, run, compare_cells)


def test_gemma_iswa_small_swa_cache_refuses_shifts():
    run = load("gemma-3-270m-q4_k_m")["swa_full_false_nctx4096"]
    mem = KVCacheISWA(2, 1, 8, 4096, swa_layers=[1], n_swa=512, n_ubatch=256, n_seq_max=4, rope=RoPE(8))
    assert mem.swa.kv_size == 2304
    replay(mem, run, compare_cells)


def test_gemma_sliding_window_of_one_sequence():
    run = load("gemma-3-270m-q4_k_m")["swa_window"]
    mem = KVCacheISWA(2, 1, 8, 4096, swa_layers=[1], n_swa=512, n_ubatch=256, n_seq_max=1, unified=False)
    assert mem.swa.kv_size == 768

    def compare(mem, step):
        got = []
        for c in (mem.base, mem.swa):
            pos = sorted(p for p, s in c.cells() if p >= 0)
            got.append({"n_cells": len(pos), "pos_min": pos[0], "pos_max": pos[-1],
                        "contiguous": pos == list(range(pos[0], pos[-1] + 1))})
        assert got == step["sections_seq-1"], f"after {step['op']}"

    replay(mem, run, compare)
