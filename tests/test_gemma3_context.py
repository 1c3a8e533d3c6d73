"""Gemma 3 270M through a Context: the interleaved sliding-window cache (KVCacheISWA) sized and used as
llama.cpp does, batches that fit both caches or neither, the SWA layers' state holding only the window,
and context shift with the small SWA cache (llama.cpp refuses it) against the same shift in a swa_full
context."""
import json

import numpy as np
import pytest
from helpers import reference_dir

from llamax import Batch, Context, NoKVSlotError
from llamax.generate import context_shift

MiB = 1024 * 1024


@pytest.fixture(scope="module")
def text(gemma):
    """About 1340 tokens of prose (llama.cpp's long reference prompt), repeated as needed."""
    meta = json.loads((reference_dir("gemma-3-270m-q4_k_m") / "ref_logits.json").read_text())
    toks = next(p for p in meta["prompts"] if p["name"] == "long_1k3")["tokens"]
    return toks + toks[1:]


def memory_bytes(mem):
    """Every cell (pos, sequences), head and K/V byte of both caches."""
    out = []
    for c in (mem.base, mem.swa):
        out += [s.snapshot(range(s.size)).tobytes() for s in c.meta.streams]
        out.append(c.meta.heads.tobytes())
        out += [a.tobytes() for a in c.k + c.v]
    return out


def greedy(ctx, n):
    toks = [int(np.argmax(ctx.get_logits_ith(-1)))]
    for _ in range(n - 1):
        ctx.decode(Batch([toks[-1]]))
        toks.append(int(np.argmax(ctx.get_logits_ith(-1))))
    return toks


def test_iswa_cache_sizes_and_layers(gemma):
    hp = gemma.hparams
    assert hp.n_swa == 512 and hp.swa_layers == tuple(i for i in range(18) if (i + 1) % 6)
    mem = Context(gemma, n_ctx=4096).memory
    assert (mem.base.kv_size, mem.swa.kv_size) == (4096, 1024)          # pad256(512 + 512)
    assert mem.base.layer_ids == [5, 11, 17] and len(mem.swa.layer_ids) == 15
    assert mem.swa.n_swa == 512 and mem.base.n_swa == 0
    assert Context(gemma, n_ctx=4096, swa_full=True).memory.swa.kv_size == 4096
    assert Context(gemma, n_ctx=4096, n_ubatch=128).memory.swa.kv_size == 768
    # both caches rotate K with their own RoPE: 1e6 for the global layers, 10000 for the sliding ones
    assert mem.base.rope.freq_base == 1e6 and mem.swa.rope.freq_base == 10000.0
    assert mem.can_shift


def test_a_batch_fits_both_caches_or_neither(gemma, text):
    """seq_cp makes every SWA cell shared, so none can be reused: a 256-token batch fits the base cache
    (4096 cells) but not the SWA cache (1280 cells, 1100 used): NoKVSlotError, both caches unchanged."""
    ctx = Context(gemma, n_ctx=4096, n_ubatch=256, n_seq_max=2)
    mem = ctx.memory
    assert mem.swa.kv_size == 1280
    ctx.decode(Batch(text[:1100]))
    mem.seq_cp(0, 1)
    before = memory_bytes(mem)
    with pytest.raises(NoKVSlotError, match="swa"):
        ctx.decode(Batch(text[1100:1356]))
    assert memory_bytes(mem) == before
    ctx.decode(Batch(text[1100:1280], seq_ids=[1] * 180))  # what fits still goes in
    assert mem.seq_pos_max(1) == 1279 and mem.seq_pos_max(0) == 1099


def test_swa_state_holds_only_the_window(gemma, text):
    """llama.cpp writes 10.7 MB for a 908-token Gemma prompt: 908 cells of the 3 global layers and
    only the 512 cells the window still shows of the 15 sliding ones (1 KiB per cell and layer)."""
    ctx = Context(gemma, n_ctx=2048)
    ctx.decode(Batch(text[:908]))
    blob = ctx.state_seq_get_data(0)
    kv = (3 * 908 + 15 * 512) * 2 * 256 * 2
    assert kv == 10_653_696
    cells = (908 + 512) * 48  # each saved cell's position, ext fields and sequence set
    assert kv + cells <= len(blob) < kv + cells + 4096, len(blob)  # 10.72 MB
    full = Context(gemma, n_ctx=2048, swa_full=True)
    full.decode(Batch(text[:908]))
    assert len(full.state_seq_get_data(0)) == len(blob)  # a full-size SWA cache saves no more
    # a whole restore puts the cells back where they were: the next decode is bit-identical
    whole = ctx.state_get_data()
    other = Context(gemma, n_ctx=2048)
    other.state_set_data(whole)
    ctx.decode(Batch([text[908]]))
    other.decode(Batch([text[908]]))
    assert np.array_equal(ctx.get_logits(), other.get_logits())


def shifted(gemma, text, kind, n_past, keep, n):
    """n_past tokens, then discard n after keep and move the rest down, then one more token; returns
    (logits of that token, the next 16 greedy tokens). kind: "small" (768-cell SWA cache beside the
    1024-cell base, n_ubatch 128), "full" (swa_full), or "perm": swa_full with the same cells at other
    indices (another sequence took the first 300 cells, then left), which measures how much the order
    of the cells alone moves Gemma's logits."""
    if kind == "perm":
        ctx = Context(gemma, n_ctx=1280, n_ubatch=128, swa_full=True, n_seq_max=2)
        ctx.decode(Batch(text[:300], seq_ids=[1] * 300))
    else:
        ctx = Context(gemma, n_ctx=1024, n_ubatch=128, swa_full=kind == "full")
    ctx.decode(Batch(text[:700]))
    ctx.memory.seq_rm(1) if kind == "perm" else None
    ctx.decode(Batch(text[700:n_past]))
    if kind == "small":
        assert ctx.memory.swa.kv_size == 768 and ctx.memory.swa.seq_pos_min(0) > keep  # the ring wrapped
        assert context_shift(ctx.memory, 0, keep) == (n, n_past - keep)  # the default discard, clamped
    else:
        ctx.memory.seq_rm(0, keep, keep + n)
        ctx.memory.seq_add(0, keep + n, n_past, -n)
    ctx.decode(Batch([text[n_past]]))
    logits = ctx.get_logits_ith(-1).copy()
    return logits, greedy(ctx, 16)


def test_context_shift_with_the_small_swa_cache_matches_swa_full(gemma, text):
    """1000 tokens, keep 4, then context_shift's discard: llama.cpp's half of the rest (498) would bring
    kept positions back into the window that the small cache has overwritten, so it is clamped to
    exact_shift_limit (485) and the sliding layers see exactly the cells a swa_full cache shows. The
    cells sit at other indices, and that alone moves Gemma's logits (measured here: up to ~1-1.9 on
    this text, as large as llama.cpp's own fa on/off spread), so the logits are held to 2x what the
    same shift gives on a swa_full cache whose cells were merely permuted, and the next 16 greedy
    tokens must be identical."""
    small, full, perm = (shifted(gemma, text, k, 1000, 4, 485) for k in ("small", "full", "perm"))
    noise = np.abs(perm[0] - full[0]).max()
    d = np.abs(small[0] - full[0]).max()
    assert d <= 2 * noise, (d, noise)
    assert small[1] == full[1] == perm[1]


def test_generation_past_the_context_with_the_small_swa_cache(gemma, text):
    """llamax.generate keeps going past n_ctx on the small SWA cache (llama.cpp would stop: can_shift
    false) and gives the tokens a swa_full context gives with the same discard."""
    from llamax import Sampler, generate

    out = []
    for swa_full in (False, True):
        ctx = Context(gemma, n_ctx=1024, n_ubatch=128, swa_full=swa_full)
        gen = generate(ctx, text[:1000], max_tokens=40, sampler=Sampler.greedy(), n_keep=4, n_discard=485)
        list(gen)
        assert gen.stats.n_shift == 1 and gen.stats.n_discarded == 485 and gen.stats.gen_tokens == 40
        out.append(gen.generated)
    assert out[0] == out[1]


def test_cli_runs_gemma_with_its_sliding_window_cache():
    """The real entry point: a sensible greedy completion, the two caches' size lines, --swa-full."""
    import subprocess
    import sys

    def run(*extra):
        r = subprocess.run([sys.executable, "-m", "llamax", "run", "-m", "gemma3-270m", "-p",
                            "Water boils at a temperature of", "-n", "6", "--temp", "0", "-c", "2048", *extra],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        return r.stdout, [ln for ln in r.stderr.splitlines() if "size =" in ln]

    out, sizes = run()
    assert out.startswith(" 100 degrees"), out
    assert "2048 cells,   3 layers" in sizes[0] and "1024 cells,  15 layers" in sizes[1], sizes
    out_full, sizes = run("--swa-full")
    assert "2048 cells,  15 layers" in sizes[1] and out_full == out
