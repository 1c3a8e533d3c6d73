"""Batch invariance (issue 10, item 4): a token's logits are the same bits whatever else is in its
batch (its neighbours, how many tokens, which ubatch split) and for any n_threads. Every kernel
on the decode path computes a row and a column one fixed way: the weight products in the GEMM
(csrc/gemm.h), attention chunked on each query's visible cells (csrc/attention.h), and the
per-row numpy steps (norms, RoPE, activations)."""
import numpy as np
import pytest

from llamax import Batch, Context, Model

PROMPTS = ["The quick brown fox jumps over the lazy dog, and then it runs into the forest to hide.",
           "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
           "Water boils at a temperature of", "Once upon a time, in a land far away, there lived a king",
           "1, 2, 3, 5, 8, 13, 21,", "The capital of France is", "In 1492, Columbus sailed", "Roses are red,"]


def _prompt_logits(ctx, toks, chunk, seq_id=0):
    rows = []
    for i in range(0, len(toks), chunk):
        ch = toks[i:i + chunk]
        ctx.decode(Batch(ch, seq_ids=[seq_id] * len(ch), logits=[True] * len(ch)))
        rows.append(ctx.get_logits().copy())
    return np.concatenate(rows)


@pytest.fixture(scope="module")
def alone(model):
    """Sequence 0's prompt (over 256 tokens: several attention chunks) decoded alone in one batch,
    and its greedy continuation of 8 tokens."""
    toks = model.tokenize(" ".join(PROMPTS) * 3)
    assert len(toks) > 300
    ctx = Context(model, n_ctx=2048, n_seq_max=8)
    logits = _prompt_logits(ctx, toks, len(toks))
    steps = []
    t = int(np.argmax(logits[-1]))
    for _ in range(8):
        ctx.decode(Batch([t], seq_ids=[0]))
        steps.append(ctx.get_logits_ith(-1).copy())
        t = int(np.argmax(steps[-1]))
    return toks, logits, np.stack(steps)


@pytest.mark.parametrize("chunk,n", [(1, 24), (3, 60), (7, 150), (8, 100), (9, 100), (16, None)])
def test_chunked_prompt_gives_the_same_bits(model, alone, chunk, n):
    """The prompt (or its first n tokens: a token's logits depend on the tokens before it only) fed
    in chunks: ubatches of 1..16 tokens take the GEMM's rows-in-lanes kernel, larger ones its
    tokens-in-lanes kernel; both compute every output the same way."""
    toks, logits, _ = alone
    n = len(toks) if n is None else n
    ctx = Context(model, n_ctx=2048, n_seq_max=8)
    np.testing.assert_array_equal(_prompt_logits(ctx, toks[:n], chunk), logits[:n])


@pytest.mark.parametrize("n_ubatch", [5, 16])
def test_ubatch_split_gives_the_same_bits(model, alone, n_ubatch):
    toks, logits, _ = alone
    ctx = Context(model, n_ctx=2048, n_seq_max=8, n_ubatch=n_ubatch)
    np.testing.assert_array_equal(_prompt_logits(ctx, toks[:120], 120), logits[:120])


def test_beside_seven_other_sequences(model, alone):
    """Sequence 0's prompt in one batch with seven other prompts whose tokens alternate with its own
    (so its cells are interleaved with theirs in the cache), then its greedy steps decoded in
    batches with one token of each other sequence: the same bits as alone."""
    toks, logits, steps = alone
    ctx = Context(model, n_ctx=2048, n_seq_max=8)
    others = [model.tokenize(p) for p in PROMPTS[1:]]
    tok, seq, out, n_of = [], [], [], [0] * 8
    for i, t in enumerate(toks):
        s = 1 + i % 7
        o = others[s - 1]
        tok += [t, o[n_of[s] % len(o)]]
        seq += [0, s]
        out += [True, False]
        n_of[s] += 1
    ctx.decode(Batch(tok, seq_ids=seq, logits=out))
    np.testing.assert_array_equal(ctx.get_logits(), logits)
    t = int(np.argmax(logits[-1]))
    nxt = {s: others[s - 1][0] for s in range(1, 8)}
    for i in range(8):
        ctx.decode(Batch([t] + [nxt[s] for s in range(1, 8)], seq_ids=list(range(8)), logits=[True] * 8))
        got = ctx.get_logits_ith(0)
        np.testing.assert_array_equal(got, steps[i])
        t = int(np.argmax(got))
        nxt = {s: int(np.argmax(ctx.get_logits_ith(s))) for s in range(1, 8)}


def test_thread_count_gives_the_same_bits(alone, smollm2_gguf):
    toks, logits, _ = alone
    one = Model.load(smollm2_gguf, n_threads=1)
    ctx = Context(one, n_ctx=2048, n_seq_max=8, n_threads=1)
    np.testing.assert_array_equal(_prompt_logits(ctx, toks, len(toks)), logits)


def test_gemma_chunks_neighbours_and_threads(gemma):
    """Gemma 3 (Q4_K / Q6_K / Q5_0 / Q8_0 products, the sliding-window cache): a prompt alone, in
    chunks of 1 and 7, beside three other sequences and on one thread give the same bits."""
    toks = gemma.tokenize(PROMPTS[0])
    out_rows = lambda ctx, chunk: _prompt_logits(ctx, toks, chunk)  # noqa: E731
    ref = out_rows(Context(gemma, n_ctx=1024, n_seq_max=4), len(toks))
    for chunk in (1, 7):
        np.testing.assert_array_equal(out_rows(Context(gemma, n_ctx=1024, n_seq_max=4), chunk), ref)
    ctx = Context(gemma, n_ctx=1024, n_seq_max=4)
    others = [gemma.tokenize(p) for p in PROMPTS[1:4]]
    tok, seq, out = [], [], []
    for i, t in enumerate(toks):
        s = 1 + i % 3
        tok += [t, others[s - 1][i % len(others[s - 1])]]
        seq += [0, s]
        out += [True, False]
    ctx.decode(Batch(tok, seq_ids=seq, logits=out))
    np.testing.assert_array_equal(ctx.get_logits(), ref)
    one = Model.load(gemma.path, n_threads=1)
    np.testing.assert_array_equal(out_rows(Context(one, n_ctx=1024, n_seq_max=4, n_threads=1), len(toks)), ref)
