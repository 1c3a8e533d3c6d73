"""Small builders shared by the tests."""
from types import SimpleNamespace

import numpy as np


def seq_bits(seq_lists) -> np.ndarray:
    """uint64 [n, 4] bitsets of the given per-token sequence lists."""
    bits = np.zeros((len(seq_lists), 4), dtype=np.uint64)
    for i, seqs in enumerate(seq_lists):
        for s in seqs:
            bits[i, s // 64] |= np.uint64(1) << np.uint64(s % 64)
    return bits


def ubatch(positions, seq_lists, tokens=None):
    """A minimal ubatch for the slot finder: positions, every sequence of each token, the
    distinct sequences. Tokens default to the positions (so cells' ext.tok can be checked)."""
    positions = list(positions)
    seq_lists = [list(s) for s in seq_lists]
    unq = sorted({s for ss in seq_lists for s in ss})
    return SimpleNamespace(
        n_tokens=len(positions),
        pos=np.asarray(positions, dtype=np.int32),
        seq_bits=seq_bits(seq_lists),
        seq_id=np.asarray([ss[0] for ss in seq_lists], dtype=np.int32),
        seq_id_unq=np.asarray(unq, dtype=np.int32),
        token=np.asarray(positions if tokens is None else tokens, dtype=np.int32),
    )


def reference_dir(model: str):
    """The folder of llama.cpp's reference outputs for a model (shared/reference/<model>).

    It sits beside the checkout (../shared/reference) or in $LLAMAX_REFERENCE_DIR. Missing data fails the
    test, except where LLAMAX_NO_REFERENCE=1 says it cannot be there (wheel tests in cibuildwheel's
    containers), where the test is skipped.
    """
    import os
    from pathlib import Path

    import pytest

    root = Path(os.environ.get("LLAMAX_REFERENCE_DIR", Path(__file__).resolve().parents[2] / "shared" / "reference"))
    path = root / model
    if not path.is_dir():
        if os.environ.get("LLAMAX_NO_REFERENCE") == "1":
            pytest.skip(f"llama.cpp's reference data is not available here ({path})")
        pytest.fail(f"llama.cpp's reference data is missing: {path} (set LLAMAX_REFERENCE_DIR)")
    return path


def load_memory_ops(model: str) -> dict:
    """llama.cpp's recorded memory operations for a model (reference_dir(model)/memory_ops.json)."""
    import json

    return json.loads((reference_dir(model) / "memory_ops.json").read_text())


def check_top1_against(logits, top_ids, top_vals, gap):
    """llamax's top-1 per row against llama.cpp's top-k (ids, values) of the same rows: equal wherever
    llama.cpp's top-1/top-2 gap exceeds `gap`; elsewhere llama.cpp must rate llamax's choice within
    `gap` of its own best (among its top-k)."""
    import numpy as np

    top_ids, top_vals = np.asarray(top_ids), np.asarray(top_vals, np.float32)
    decided = top_vals[:, 0] - top_vals[:, 1] > gap
    ours = np.asarray(logits).argmax(axis=1)
    bad = np.flatnonzero(decided & (ours != top_ids[:, 0]))
    assert bad.size == 0, f"top-1 differs at rows {bad.tolist()}"
    for i in np.flatnonzero(~decided):
        hit = np.flatnonzero(top_ids[i] == ours[i])
        assert hit.size and top_vals[i, 0] - top_vals[i, hit[0]] <= gap, (i, ours[i], top_ids[i], top_vals[i])


def check_top5(logits, tops, where, logit_tol, gap):
    """A decode's logits against llama.cpp's recorded top-5 per output (memory_ops.json): values at its
    ids within logit_tol, top-1 by check_top1_against's rule. Returns the largest difference."""
    import numpy as np

    assert logits.shape[0] == len(tops), where
    ids = np.asarray([t["ids"] for t in tops])
    vals = np.asarray([t["vals"] for t in tops], np.float32)
    d = np.abs(np.take_along_axis(np.asarray(logits), ids, axis=1) - vals)
    assert d.max() <= logit_tol, (where, d.max(axis=1).tolist())
    check_top1_against(logits, ids, vals, gap)
    return float(d.max())


def without(cells, seq: int):
    """The cell list after seq_rm(seq) (unified cache: cells left with no sequence are empty)."""
    out = []
    for p, s in cells:
        s = s - {seq}
        out.append((p, s) if s else (-1, frozenset()))
    return out


# ---- a serving workload: conversations in groups sharing a system prompt --------------------------
_ORGS = ["a small public library", "a mountain railway", "a city bicycle-hire scheme", "a seaside aquarium",
         "a night school for adults", "a community orchestra", "a repair cafe", "a harbour ferry line"]
_RULES = ["Answer in at most two short sentences.", "Be friendly, exact and brief.",
          "If you do not know, say so plainly.", "Never invent prices, dates or names.",
          "Use plain words a child would understand.", "Do not repeat the question back.",
          "Mention opening hours only when asked.", "Refer complaints to the front desk.",
          "Keep a calm and polite tone at all times.", "Prefer metric units.",
          "Give one example when it helps.", "Do not give legal or medical advice."]
_QUESTIONS = ["When do you open on Sundays?", "How much does it cost for a child?", "Can I bring my dog?",
              "Is there parking nearby?", "Do you have a lost property office?", "Can I pay by card?",
              "Is the building accessible by wheelchair?", "What should I bring on my first visit?",
              "Are there discounts for students?", "How do I book for a group of ten?"]


def system_prompt(group: int) -> str:
    """A system prompt of its own for each group (~200 tokens), the same in every run."""
    org = _ORGS[group % len(_ORGS)]
    rules = " ".join(_RULES[(group * 5 + k) % len(_RULES)] for k in range(8))
    return (f"You are the help desk assistant of {org} (desk number {group + 1}). You answer visitors' questions "
            f"about {org}: its services, its prices, its rules and its opening hours. {rules} "
            f"Every answer you give is about {org} and nothing else. {rules}")


def grouped_chats(n_groups: int = 4, per_group: int = 8, seed: int = 0) -> list[tuple[int, list[dict]]]:
    """(group, chat messages) for n_groups * per_group requests, shuffled with seed: requests of one
    group share its system prompt and differ in the question."""
    import random

    out = [(g, [{"role": "system", "content": system_prompt(g)},
                {"role": "user", "content": _QUESTIONS[(g + 3 * i) % len(_QUESTIONS)] + f" (ticket {g}-{i})"}])
           for g in range(n_groups) for i in range(per_group)]
    random.Random(seed).shuffle(out)
    return out


def run_chat_workload(url: str, chats, *, model: str = "smollm2-135m", max_tokens: int = 16,
                      api_key: str = "none", timeout: float = 600, concurrency: int | None = None) -> dict:
    """Send the chats (streamed, greedy) through the openai client, all at once or at most
    `concurrency` at a time (clients arriving as others leave); returns per-request {group, text,
    prompt, cached, completion, ttft (from its own sending)} in order, and the wall time."""
    import asyncio
    import time

    from openai import AsyncOpenAI

    async def one(client, gate, group, messages):
        async with gate:
            t0 = time.perf_counter()
            stream = await client.chat.completions.create(
                model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True})
            text, ttft, usage = [], None, None
            async for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    ttft = ttft if ttft is not None else time.perf_counter() - t0
                    text.append(chunk.choices[0].delta.content)
                if chunk.usage is not None:
                    usage = chunk.usage
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        return dict(group=group, text="".join(text), prompt=usage.prompt_tokens, cached=cached or 0,
                    completion=usage.completion_tokens, ttft=ttft)

    async def run():
        async with AsyncOpenAI(base_url=url + "/v1", api_key=api_key, timeout=timeout, max_retries=0) as client:
            gate = asyncio.Semaphore(concurrency or len(chats))
            t0 = time.perf_counter()
            out = await asyncio.gather(*(one(client, gate, g, m) for g, m in chats))
            return {"requests": out, "wall": time.perf_counter() - t0}

    return asyncio.run(run())


def prompt_logits(model, toks, *, n_ubatch=512, chunks=None, n_threads=2, n_ctx=512):
    """float32 [len(toks), n_vocab]: every row's logits of a prompt decoded for sequence 0 of a new
    Context, in one batch (split into ubatches of n_ubatch) or in the given chunks, one decode each."""
    from llamax import Batch, Context

    ctx = Context(model, n_ctx=n_ctx, n_ubatch=n_ubatch, n_batch=512, n_threads=n_threads)
    rows, i = [], 0
    for n in chunks or [len(toks)]:
        ctx.decode(Batch(toks[i:i + n], logits=[True] * n))
        rows.append(ctx.get_logits().copy())
        i += n
    return np.concatenate(rows)


def fail_forward_at(monkeypatch, model, call: int, log: list):
    """Make model's forward pass raise RuntimeError at its call-th ubatch from now on (1-based); log
    gets one entry per ubatch."""
    real = type(model).forward

    def flaky(self, mem, ub):
        log.append(ub.n_tokens)
        if len(log) == call:
            raise RuntimeError("forward failed")
        return real(self, mem, ub)

    monkeypatch.setattr(type(model), "forward", flaky)


def place(mem, tokens, seq, start=0, *, rng):
    """Place tokens on seq of a standalone one-layer KVCache (1 head of 8) at positions start,
    start + 1, ..., with random K/V from rng."""
    from llamax import Batch

    tokens = list(tokens)
    if not tokens:
        return
    for ub in mem.plan(Batch(tokens, pos=list(range(start, start + len(tokens))), seq_ids=seq)):
        n = ub.n_tokens
        mem.store(0, ub, rng.standard_normal((n, 1, 8)).astype(np.float32),
                  rng.standard_normal((n, 1, 8)).astype(np.float32))


def held(mem, seq):
    """{pos: token} of seq's cells (stream 0), checking that no two of them share a position."""
    idx = [i for i, (p, s) in enumerate(mem.cells()) if seq in s]
    snap = mem.meta.streams[0].snapshot(np.asarray(idx, dtype=np.int64))
    out = dict(zip(snap["pos"].tolist(), snap["tok"].tolist()))
    assert len(out) == len(idx), f"seq {seq} has two cells at one position"
    return out


# ---- synthetic models against llama.cpp's recorded outputs (tests/data/recurrent, tests/data/families) -----------
def spread_tolerance(meta: dict) -> float:
    """Twice llama.cpp's largest difference against itself on the model (the recorded variants), at least 1e-3."""
    spread = max(v["all_rows_max_abs_diff"] for p in meta["prompts"].values() for v in p["spread"].values())
    return max(2 * spread, 1e-3)


def check_prompt_logits(name: str, model, meta: dict, ref, tol: float) -> None:
    """Every recorded prompt decoded in one batch: the last row's logits and every row's top 5 within tol of
    llama.cpp's, the top-1 equal where llama.cpp's top-1 / top-2 gap is clear of 2 tol, and most rows clear."""
    from llamax import Batch, Context

    n_clear = n_rows = 0
    for p in meta["prompts"]:
        toks = ref[f"{p}__tokens"].tolist()
        ctx = Context(model, n_ctx=512, n_threads=2)
        ctx.decode(Batch(toks, logits=[True] * len(toks)))
        out = ctx.get_logits()
        last = ref[f"{p}__last_logits"]
        assert np.abs(out[-1] - last).max() <= tol, (name, p, float(np.abs(out[-1] - last).max()), tol)
        ids, vals = ref[f"{p}__top5_ids"], ref[f"{p}__top5_vals"]
        ours = np.take_along_axis(out, ids.astype(np.int64), axis=1)
        assert np.abs(ours - vals).max() <= tol, (name, p, float(np.abs(ours - vals).max()), tol)
        clear = vals[:, 0] - vals[:, 1] > 2 * tol
        assert np.array_equal(out[clear].argmax(axis=1), ids[clear, 0]), (name, p)
        n_clear, n_rows = n_clear + int(clear.sum()), n_rows + len(toks)
    assert n_clear > 0.6 * n_rows          # most rows are checked for their top-1


def check_greedy_up_to_near_tie(name: str, model, meta: dict, ref, tol: float) -> None:
    """Free-running greedy tokens equal llama.cpp's up to its first step whose top-1 / top-2 gap is within
    twice the tolerance (a near-tie)."""
    from llamax import Batch, Context

    for p, info in meta["prompts"].items():
        want = ref[f"{p}__greedy_tokens"].tolist()
        n_sure = next((i for i, g in enumerate(info["greedy_gaps"]) if g <= 2 * tol), len(want))
        ctx = Context(model, n_ctx=512, n_threads=2)
        ctx.decode(Batch(ref[f"{p}__tokens"].tolist()))
        got = []
        for _ in range(n_sure):
            got.append(int(ctx.get_logits()[-1].argmax()))
            ctx.decode(Batch([got[-1]]))
        assert got == want[:n_sure], (name, p)


RECURRENT_TEXTS = ("The quick brown fox jumps over the lazy dog. Mamba folds every token into a state",
                   "Once upon a time there was a snake in the grass")


def _decode_side_by_side(ctx, seqs, logits):
    """One decode of each sequence's tokens side by side; its logits appended."""
    from llamax import Batch

    toks = [t for s in seqs for t in s]
    ctx.decode(Batch(toks, seq_ids=[i for i, s in enumerate(seqs) for _ in s], logits=[True] * len(toks)))
    logits.append(ctx.get_logits().copy())


def run_recurrent_script(model, chunk, n_ubatch):
    """Two prompts fed side by side in chunks of `chunk` tokens (ubatches of n_ubatch), with rollback rows
    reserved; three greedy steps of both; a verification batch of sequence 0 whose tail is rolled back;
    two more steps. The logits of every decode, and every state, rollback row and K/V buffer after."""
    import llamax
    from llamax import Context

    ctx = Context(model, n_ctx=256, n_seq_max=2, n_ubatch=n_ubatch, n_batch=256, n_threads=2)
    mem = ctx.memory
    mem.reserve_rollback(4)
    a, b = model.tokenize(RECURRENT_TEXTS[0]), model.tokenize(RECURRENT_TEXTS[1])
    out: list = []
    for i in range(0, max(len(a), len(b)), chunk):
        seqs = [a[i:i + chunk], b[i:i + chunk]]
        if not seqs[1]:
            seqs = seqs[:1]
        _decode_side_by_side(ctx, seqs, out)
    for _ in range(3):
        _decode_side_by_side(ctx, [[int(np.argmax(out[-1][0]))], [int(np.argmax(out[-1][-1]))]], out)
    _decode_side_by_side(ctx, [[42, 7, 1999, 300]], out)
    assert mem.seq_rm(0, mem.seq_pos_max(0) - 1, -1)     # keep 42, 7
    for _ in range(2):
        _decode_side_by_side(ctx, [[int(np.argmax(out[-1][0]))], [5]], out)
    recr = mem.recr if isinstance(mem, llamax.HybridMemory) else mem
    assert any(np.any(h) for h in recr.conv_hist + recr.ssm_hist)   # the rollback rows were written
    bufs = recr.conv + recr.ssm + recr.conv_hist + recr.ssm_hist
    if isinstance(mem, llamax.HybridMemory):
        bufs += mem.attn.k + mem.attn.v
    return out, [x.copy() for x in bufs]
