"""Every transformer family (tests/synthetic_families.py) through what a user runs: `llamax run -m FILE`, the
Engine (continuous batching: requests decoded together give their solo runs' tokens), the batch-invariance
llamax promises (the same logits for a prompt in one batch, token by token, or beside other sequences), and
`llamax serve -m FILE` over loopback with the official openai client."""
import subprocess
import sys

import numpy as np
import openai
import pytest

import llamax
from llamax import Batch, Context, Model
from synthetic_families import FAMILIES

NAMES = sorted(FAMILIES)
PROMPTS = ["Once upon a time, there was a", "The old lighthouse keeper climbed the stairs",
           "Bread is one of the oldest prepared foods. To make a simple loaf,"]


@pytest.fixture(scope="module")
def paths(family_paths):
    return family_paths


@pytest.fixture(scope="module")
def models(paths):
    return {n: Model.load(p, n_threads=2) for n, p in paths.items()}


@pytest.mark.parametrize("name", NAMES)
def test_logits_do_not_depend_on_the_batch(models, name):
    """A prompt's logits are the same bits decoded in one batch, one token at a time, and beside another
    sequence, for 1 and 2 threads (the native step's products and attention are batch-invariant)."""
    model = models[name]
    toks = model.tokenize(PROMPTS[2])
    ctx = Context(model, n_ctx=512, n_threads=2)
    ctx.decode(Batch(toks, logits=[True] * len(toks)))
    whole = ctx.get_logits().copy()
    one = Context(model, n_ctx=512, n_threads=1)
    rows = []
    for i, t in enumerate(toks):
        one.decode(Batch([t], pos=[i]))
        rows.append(one.get_logits()[-1].copy())
    assert np.array_equal(np.stack(rows), whole), name
    other = model.tokenize(PROMPTS[0])
    two = Context(model, n_ctx=512, n_seq_max=2, n_threads=2)
    b = Batch(toks + other, pos=list(range(len(toks))) + list(range(len(other))),
              seq_ids=[[0]] * len(toks) + [[1]] * len(other), logits=[True] * len(toks) + [False] * len(other))
    two.decode(b)
    assert np.array_equal(two.get_logits(), whole), name


@pytest.mark.parametrize("name", NAMES)
def test_engine_batches_requests_with_their_solo_tokens(models, name):
    model = models[name]
    with llamax.Engine(model, n_ctx=1024, n_parallel=1, n_threads=2) as eng:
        solo = [eng.submit(p, max_tokens=10, temperature=0.0).result().tokens for p in PROMPTS]
    with llamax.Engine(model, n_ctx=1024, n_parallel=3, n_threads=2) as eng:
        reqs = [eng.submit(p, max_tokens=10, temperature=0.0) for p in PROMPTS]
        assert [r.result().tokens for r in reqs] == solo, name


@pytest.mark.parametrize("name", ["qwen3moe", "phi3", "gemma2", "granite"])
def test_cli_run_on_the_file(paths, models, name):
    """`llamax run -m FILE` generates the greedy continuation a Context gives."""
    model = models[name]
    toks = model.tokenize(PROMPTS[0])
    ctx = Context(model, n_ctx=512, n_threads=2)
    ctx.decode(Batch(toks))
    want = []
    for _ in range(6):
        want.append(int(ctx.get_logits()[-1].argmax()))
        ctx.decode(Batch([want[-1]]))
    r = subprocess.run([sys.executable, "-m", "llamax", "run", "-m", str(paths[name]), "-p", PROMPTS[0], "-n", "6",
                        "--temp", "0", "-c", "512", "-t", "2"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip("\n") == model.detokenize(want), (r.stdout, model.detokenize(want))


def test_serve_a_mixture_of_experts_over_loopback(paths, models):
    """`llamax serve -m FILE` on the MoE family, driven by the openai client: the completion is the Engine's."""
    from test_server import LiveServer

    with llamax.Engine(models["qwen3moe"], n_ctx=1024, n_parallel=1, n_threads=2) as eng:
        want = eng.submit(PROMPTS[1], max_tokens=8, temperature=0.0).result().text
    srv = LiveServer("-m", str(paths["qwen3moe"]), "-np", "2", "-c", "1024")
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
        out = client.completions.create(model="x", prompt=PROMPTS[1], max_tokens=8, temperature=0.0)
        assert out.choices[0].text == want
        chat = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Hi"}],
                                              max_tokens=4, temperature=0.0)
        assert chat.usage.completion_tokens == 4
    finally:
        assert srv.stop() == 0, "".join(srv.lines[-20:])


def test_longrope_takes_its_factors_by_the_context_size(models):
    """Phi-3's LongRoPE (llama.cpp's get_rope_factors): the long factors when a sequence's context exceeds
    the original one (256 in the synthetic model), else the short ones, in the forward pass and in the
    cache's K-shift alike."""
    model = models["phi3"]
    toks = model.tokenize(PROMPTS[2])
    out = {}
    for n_ctx in (256, 512):
        ctx = Context(model, n_ctx=n_ctx, n_threads=2)
        ctx.decode(Batch(toks))
        out[n_ctx] = ctx.get_logits()[-1].copy()
        want = model.factors["long" if n_ctx > 256 else "short"]
        assert np.array_equal(ctx.memory.rope.factors, want), n_ctx
    assert not np.array_equal(out[256], out[512])
    again = Context(model, n_ctx=256, n_threads=2)   # the short stack again, after the long one was built
    again.decode(Batch(toks))
    assert np.array_equal(again.get_logits()[-1], out[256])
