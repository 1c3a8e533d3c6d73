"""Embeddings (llamax/embed.py, Engine.embed, POST /v1/embeddings) against llama.cpp's own.

tests/data/embeddings/<model>.npz holds what llama.cpp (llama-cpp-python 0.3.36, `Llama(embedding=True,
pooling_type=...)`, `.embed(s, normalize=True)`) gave for a few inputs (short, ~200 tokens, unicode), with
flash attention off (the reference) and on (llama.cpp's own spread). llamax must be as close to the
reference as cosine 0.999, or, where llama.cpp's two runs are themselves further apart than that
(Gemma 3), within twice llama.cpp's own worst distance."""
import base64
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import openai
import pytest

import llamax
from llamax import BatchError, Context, ContextParams, Engine, Model
from llamax.embed import MAX_BATCH_TOKENS, embed_tokens, groups, pooling_of, tokens_of

DATA = Path(__file__).parent / "data" / "embeddings"
POOLINGS = ("mean", "last", "cls")
MODELS = ("smollm2-135m", "gemma3-270m")


def _cos(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


@pytest.fixture(scope="module")
def models(model, gemma):
    return {"smollm2-135m": model, "gemma3-270m": gemma}


@pytest.fixture(scope="module", params=MODELS)
def recorded(request):
    name = request.param
    return name, np.load(DATA / f"{name}.npz"), json.loads((DATA / f"{name}.json").read_text())


def _bound(z) -> float:
    """Cosine llamax must reach: 0.999, or 1 - 2 x llama.cpp's own worst 1 - cos (flash attention on
    against off, over every input and pooling) when that is looser."""
    own = min(float(_cos(z[p], z[f"{p}_fa"]).min()) for p in POOLINGS)
    return min(0.999, 1.0 - 2.0 * (1.0 - own))


def test_tokens_as_llamacpp_embeds_them(models, recorded):
    name, z, meta = recorded
    toks = tokens_of(models[name], meta["inputs"])
    assert [len(t) for t in toks] == z["lengths"].tolist()
    assert np.concatenate(toks).tolist() == z["tokens"].tolist()


@pytest.mark.parametrize("pooling", POOLINGS)
def test_agrees_with_llamacpp(models, recorded, pooling):
    name, z, meta = recorded
    e = llamax.embed(models[name], meta["inputs"], pooling=pooling)
    assert e.dtype == np.float32 and e.shape == z[pooling].shape
    np.testing.assert_allclose(np.linalg.norm(e, axis=1), 1.0, rtol=1e-5)
    cos = _cos(e, z[pooling])
    bound = _bound(z)
    if name == "smollm2-135m":
        assert bound == 0.999   # llama.cpp's own spread is well inside it
    print(f"{name} {pooling}: min cos {cos.min():.5f} (bound {bound:.5f})")
    assert cos.min() >= bound, (name, pooling, cos, bound)


def test_gemma_bound_is_llamacpp_own_spread():
    """The looser bound holds only where llama.cpp's two runs differ by more than 0.999 themselves."""
    z = np.load(DATA / "gemma3-270m.npz")
    own = min(float(_cos(z[p], z[f"{p}_fa"]).min()) for p in POOLINGS)
    assert own < 0.999 and _bound(z) == pytest.approx(0.9965, abs=5e-4)


def test_pooling_definitions(model):
    """mean / last / cls are the mean, the last and the first of the raw final hidden states (after
    the output norm) of an embeddings context; normalize=False returns them as they are."""
    toks = model.tokenize("Pooling reads the rows of one sequence only.")
    ctx = Context(model, n_ctx=256, embeddings=True, n_threads=model.n_threads)
    ctx.decode(llamax.Batch(toks, logits=[True] * len(toks)))
    rows = ctx.get_embeddings()
    assert rows.shape == (len(toks), model.hparams.n_embd)
    assert ctx.get_logits().shape == (0, model.n_vocab)
    raw = {p: llamax.embed(model, [toks], pooling=p, normalize=False)[0] for p in POOLINGS}
    assert np.array_equal(raw["last"], rows[-1]) and np.array_equal(raw["cls"], rows[0])
    np.testing.assert_allclose(raw["mean"], rows.mean(axis=0, dtype=np.float64), rtol=1e-6, atol=1e-6)
    unit = llamax.embed(model, [toks], pooling="mean")[0]
    np.testing.assert_allclose(unit, raw["mean"] / np.linalg.norm(raw["mean"]), rtol=1e-6, atol=1e-7)


def test_embeddings_context_rows_are_the_logits_input(model):
    """The rows are what the output head reads: the head over them gives the logits context's logits."""
    toks = model.tokenize("The capital of France is")
    ectx = Context(model, n_ctx=256, embeddings=True)
    ectx.decode(llamax.Batch(toks, logits=[True] * len(toks)))
    lctx = Context(model, n_ctx=256)
    lctx.decode(llamax.Batch(toks, logits=[True] * len(toks)))
    assert np.array_equal(model._logits(ectx.get_embeddings()), lctx.get_logits())


@pytest.mark.parametrize("name", MODELS)
def test_batch_composition_does_not_change_bits(models, name):
    """An input alone, among others, first or last, in one decode or split over several: the same bits."""
    m = models[name]
    texts = ["a short one", "Zürich — 東京 🎉", "The old lighthouse keeper climbed the spiral stairs every evening " * 8,
             "x", "Numbers: 1, 2, 3, 5, 8, 13"]
    together = llamax.embed(m, texts, pooling="mean")
    reversed_ = llamax.embed(m, texts[::-1], pooling="mean")[::-1]
    alone = np.stack([llamax.embed(m, t, pooling="mean")[0] for t in texts])
    assert np.array_equal(together, alone) and np.array_equal(together, reversed_)
    last = llamax.embed(m, texts, pooling="last")
    assert np.array_equal(last[2], llamax.embed(m, texts[2], pooling="last")[0])


def test_groups():
    """Consecutive inputs per decode: at most max_tokens tokens (a longer input alone), LLAMA_MAX_SEQ inputs."""
    assert groups([3, 4, 5], 8) == [range(0, 2), range(2, 3)]
    assert groups([10, 2, 2, 9], 8) == [range(0, 1), range(1, 3), range(3, 4)]
    assert groups([1] * 600) == [range(0, 256), range(256, 512), range(512, 600)]
    assert MAX_BATCH_TOKENS == 2048


def test_split_decodes_give_the_same_bits(model):
    """Inputs spread over several decodes (a Context each) give what one decode of them all gives."""
    toks = [model.tokenize(f"input number {i}: " + "word " * (40 + i)) for i in range(12)]
    assert len(groups([len(t) for t in toks], 150)) > 3
    assert np.array_equal(embed_tokens(model, toks, "mean"), embed_tokens(model, toks, "mean", max_batch_tokens=150))


def test_inputs_forms(model):
    toks = model.tokenize("hello world")
    a = llamax.embed(model, "hello world")
    assert a.shape == (1, model.hparams.n_embd)
    assert np.array_equal(llamax.embed(model, toks), a)                  # one list of ids: one input
    assert np.array_equal(llamax.embed(model, [toks]), a)
    assert np.array_equal(llamax.embed(model, np.array(toks)), a)
    both = llamax.embed(model, ["hello world", toks])
    assert both.shape == (2, model.hparams.n_embd) and np.array_equal(both[0], both[1])


@pytest.mark.parametrize("bad, err, words", [
    ([], BatchError, "no input"),
    ("", BatchError, "input 0 is an empty string"),
    (["fine", ""], BatchError, "input 1 is an empty string"),
    ([[1, 2], []], BatchError, "input 1 is empty"),
    ([[5, 49152]], BatchError, "token 49152 at index 1 is outside the vocabulary"),
    ([[5, -1]], BatchError, "token -1"),
    ([[1.5, 2]], TypeError, "integers"),
    ([3, "a"], TypeError, "input 0"),
    (7, TypeError, "inputs"),
])
def test_bad_inputs(model, bad, err, words):
    with pytest.raises(err, match=re.escape(words)):
        llamax.embed(model, bad)


def test_too_long_and_bad_options(model):
    n = model.hparams.n_ctx_train
    with pytest.raises(BatchError, match=f"has {n + 1} tokens, more than the model's training context"):
        llamax.embed(model, [[1] * (n + 1)])
    with pytest.raises(ValueError, match="pooling = 'max'"):
        llamax.embed(model, "x", pooling="max")
    with pytest.raises(TypeError, match="normalize"):
        llamax.embed(model, "x", normalize=1)
    with pytest.raises(TypeError, match="embeddings"):
        ContextParams(embeddings=1)


def test_pooling_from_the_gguf(model, monkeypatch):
    """The GGUF's {arch}.pooling_type when the caller gives none; the caller's wins (llama.cpp's rule)."""
    assert pooling_of(model) == "mean"   # SmolLM2's GGUF names none
    fields = dict(model.gguf.reader.fields)
    monkeypatch.setattr(model.gguf.reader, "fields", {**fields, "llama.pooling_type": 3})
    assert pooling_of(model) == "last" and pooling_of(model, "cls") == "cls"
    toks = model.tokenize("which pooling?")
    assert np.array_equal(llamax.embed(model, [toks]), llamax.embed(model, [toks], pooling="last"))
    monkeypatch.setattr(model.gguf.reader, "fields", {**fields, "llama.pooling_type": 4})
    with pytest.raises(llamax.ModelError, match="rank"):
        pooling_of(model)


def test_recurrent_model(tmp_path, smollm2_gguf):
    """A Mamba embeds too (every token's normed state is an output); the bits do not depend on the batch."""
    import synthetic
    path = tmp_path / "mamba.gguf"
    synthetic.write_mamba(path, smollm2_gguf, seed=0)
    m = Model.load(path, n_threads=2)
    texts = ["a recurrent model", "its last state", "and the mean of its rows " * 4]
    for p in POOLINGS:
        e = llamax.embed(m, texts, pooling=p)
        assert e.shape == (3, m.hparams.n_embd) and np.isfinite(e).all()
        assert np.array_equal(e[1], llamax.embed(m, texts[1], pooling=p)[0])


# ---- the engine ---------------------------------------------------------------------------------
def test_engine_embed_between_steps(model):
    """engine.embed runs beside generation: the engine's cells, slots and output are untouched."""
    texts = ["alpha beta", "gamma delta epsilon"]
    want = llamax.embed(model, texts, pooling="last")
    greedy = dict(max_tokens=12, temperature=0.0)
    with Engine(model, n_ctx=512, n_parallel=2, n_threads=2) as eng:
        base = eng.generate("Once upon a time", **greedy)
    with Engine(model, n_ctx=512, n_parallel=2, n_threads=2) as eng:
        req = eng.submit("Once upon a time", **greedy)
        got = [eng.embed(texts, pooling="last") for _ in range(3)]
        res = req.result(timeout=120)
        used = eng.metrics()["cells_used"]
        assert eng.embed(texts[0]).shape == (1, model.hparams.n_embd)
        assert eng.metrics()["cells_used"] == used
        with pytest.raises(BatchError, match="empty"):
            eng.embed([])
        with pytest.raises(TypeError):
            eng.embed("x", dims=3)
    assert all(np.array_equal(g, want) for g in got)
    assert res.tokens == base.tokens


# ---- the server ---------------------------------------------------------------------------------
class _Server:
    """`python -m llamax serve --port 0 ...` on loopback; stopped by stop()."""

    def __init__(self, *args):
        cmd = [sys.executable, "-m", "llamax", "serve", "--port", "0", "-t", "2", "-np", "2", "-c", "1024", *args]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                                     env={**os.environ, "LLAMAX_API_KEY": ""})
        self.url, self.lines, ready = None, [], threading.Event()

        def read():
            for line in self.proc.stderr:
                self.lines.append(line)
                m = re.search(r"listening on (http://\S+)", line)
                if m:
                    self.url = m.group(1)
                    ready.set()
            ready.set()
        threading.Thread(target=read, daemon=True).start()
        if not ready.wait(180) or self.url is None:
            self.stop()
            raise RuntimeError("llamax serve did not start:\n" + "".join(self.lines))

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="module")
def server():
    s = _Server("--pooling", "last")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_openai_client_embeddings(model, server, client):
    texts = ["The capital of France is Paris.", "Zürich, 東京 🎉"]
    want = llamax.embed(model, texts, pooling="last")
    r = client.embeddings.create(model="smollm2-135m", input=texts)
    assert r.object == "list" and [d.index for d in r.data] == [0, 1]
    assert all(d.object == "embedding" for d in r.data)
    got = np.array([d.embedding for d in r.data], np.float32)
    assert np.array_equal(got, want)
    n = sum(len(t) for t in tokens_of(model, texts))
    assert r.usage.prompt_tokens == n and r.usage.total_tokens == n
    # the call above: the client asked for base64 and decoded it; asked for explicitly, it is left as sent
    b = client.embeddings.create(model="x", input=texts[0], encoding_format="base64")
    assert np.array_equal(np.frombuffer(base64.b64decode(b.data[0].embedding), "<f4"), want[0])
    one = client.embeddings.create(model="x", input=texts[0], encoding_format="float")
    assert np.array_equal(np.array(one.data[0].embedding, np.float32), want[0])
    toks = model.tokenize(texts[1])
    for inp in (toks, [toks, toks]):
        t = client.embeddings.create(model="x", input=inp, dimensions=model.hparams.n_embd)
        assert all(np.array_equal(np.array(d.embedding, np.float32), want[1]) for d in t.data)


def test_raw_base64_and_llamaserver_path(model, server):
    import httpx
    r = httpx.post(server.url + "/embeddings", json={"input": "hello", "encoding_format": "base64"}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["usage"] == {"prompt_tokens": 1, "total_tokens": 1}
    v = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    assert np.array_equal(v, llamax.embed(model, "hello", pooling="last")[0])


@pytest.mark.parametrize("body, param, words", [
    ({"input": "x", "dimensions": 64}, "dimensions", "dimensions = 64"),
    ({"input": ""}, "input", "empty string"),
    ({"input": []}, "input", "input"),
    ({"input": [[1, 2], []]}, "input", "input"),
    ({"input": [5, 10**6]}, "input", "outside the vocabulary"),
    ({"input": [[1] * 9000]}, "input", "training context"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format", "encoding_format"),
    ({}, "input", "input: required"),
])
def test_errors_are_openai_400(server, client, body, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.post("/embeddings", body=body, cast_to=object)
    err = e.value.body
    assert e.value.status_code == 400 and err["param"] == param and words in err["message"], err
