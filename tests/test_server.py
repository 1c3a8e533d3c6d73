"""`llamax serve` as users reach it: a live server process on a free loopback port, driven by the
official openai client and by raw HTTP requests (httpx), then stopped.

The main server runs SmolLM2 with 8 slots, an API key, a slot directory and no context shift; a
second one with one slot and a queue of one shows the 503 of a full queue."""
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import llamax

KEY = "test-key-123"
SYSTEM = ("You are a careful assistant for a small library. You answer questions about books, opening hours, "
          "membership cards, late fees and the reading room. Keep every answer short, friendly and exact.")


class LiveServer:
    """`python -m llamax serve --port 0 ...` in a subprocess; its stderr is kept line by line."""

    def __init__(self, *args, key=None, start_timeout=180, **popen):
        cmd = [sys.executable, "-m", "llamax", "serve", "--port", "0", "-t", "2", *args]
        if key:
            cmd += ["--api-key", key]
        self.key = key
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                                     env={**os.environ, "LLAMAX_API_KEY": ""}, **popen)
        self.lines: list[str] = []
        self._ready = threading.Event()
        self.url = None
        threading.Thread(target=self._read, daemon=True).start()
        if not self._ready.wait(start_timeout) or self.url is None:
            self.stop()
            raise RuntimeError("llamax serve did not start:\n" + "".join(self.lines))

    def _read(self):
        for line in self.proc.stderr:
            self.lines.append(line)
            m = re.search(r"listening on (http://\S+)", line)
            if m:
                self.url = m.group(1)
                self._ready.set()
        self._ready.set()

    def headers(self):
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}

    def get(self, path, **kw):
        return httpx.get(self.url + path, headers=self.headers(), timeout=60, **kw)

    def post(self, path, **kw):
        kw.setdefault("headers", self.headers())
        kw.setdefault("timeout", 60)
        return httpx.post(self.url + path, **kw)

    def metrics(self):
        text = self.get("/metrics").text
        return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
                if not s.labels}

    def wait_idle(self, timeout=30):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = self.metrics()
            if m["llamax_slots_busy"] == 0 and m["llamax_requests_waiting"] == 0:
                return m
            time.sleep(0.05)
        raise AssertionError(f"server still busy after {timeout} s: {m}")

    def stop(self, timeout=20):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    slots = tmp_path_factory.mktemp("slots")
    srv = LiveServer("-np", "8", "-c", "4096", "--no-context-shift", "--slot-save-path", str(slots),
                     "--max-tokens", "512", key=KEY)
    srv.slot_dir = slots
    yield srv
    assert srv.stop() == 0, "".join(srv.lines[-20:])


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def aclient(server):
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def solo_text(model, prompt, n):
    """Greedy text of prompt alone in a fresh Context of this process (the reference)."""
    ctx = llamax.Context(model, n_ctx=1024)
    g = llamax.generate(ctx, prompt, max_tokens=n, sampler=llamax.Sampler.greedy())
    return "".join(g)


# ---- the openai client ---------------------------------------------------------------------------------
def test_completion_is_the_greedy_text(client, model):
    r = client.completions.create(model="smollm2-135m", prompt="The capital of France is", max_tokens=12,
                                  temperature=0)
    assert r.object == "text_completion" and len(r.choices) == 1
    assert r.choices[0].text == solo_text(model, "The capital of France is", 12)
    assert r.choices[0].finish_reason == "length"
    n_prompt = len(model.tokenize("The capital of France is", add_special=True, parse_special=True))
    assert r.usage.prompt_tokens == n_prompt and r.usage.completion_tokens == 12
    assert r.usage.total_tokens == n_prompt + 12
    models = client.models.list()
    assert [m.id for m in models.data] == ["smollm2-135m"]


def test_chat_stream_equals_chat_and_reports_cached_tokens(client):
    msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "When do you open on Sunday?"}]
    whole = client.chat.completions.create(model="x", messages=msgs, max_tokens=24, temperature=0)
    assert whole.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model="x", messages=msgs, max_tokens=24, temperature=0,
                                                 stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    usage = chunks[-1].usage  # llama-server's way: usage on the last chunk
    assert usage.completion_tokens == whole.usage.completion_tokens
    # the second run of the same prompt took it from the prefix cache (all but the last token)
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 1
    # OpenAI's way: include_usage adds a last chunk with no choices
    chunks = list(client.chat.completions.create(model="x", messages=msgs, max_tokens=4, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert all(c.usage is None for c in chunks[:-1])


def test_stop_strings(client):
    prompt = "The numbers from one to ten are: one, two,"
    full = client.completions.create(model="x", prompt=prompt, max_tokens=24, temperature=0).choices[0]
    assert "four" in full.text
    cut = client.completions.create(model="x", prompt=prompt, max_tokens=24, temperature=0, stop=["four"])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == full.text[:full.text.index("four")]
    streamed = client.completions.create(model="x", prompt=prompt, max_tokens=24, temperature=0, stop="four",
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut.choices[0].text


def test_seeds_and_n_choices(client):
    kw = dict(model="x", prompt="Once upon a time", max_tokens=16, temperature=1.0)
    a = client.completions.create(seed=7, **kw).choices[0].text
    b = client.completions.create(seed=7, **kw).choices[0].text
    assert a == b
    two = client.completions.create(seed=7, n=2, **kw)
    assert [c.index for c in two.choices] == [0, 1]
    assert two.choices[0].text == a
    assert two.choices[1].text == client.completions.create(seed=8, **kw).choices[0].text
    streamed = {0: "", 1: ""}
    ends = {}
    for c in client.completions.create(seed=7, n=2, stream=True, **kw):
        for ch in c.choices:
            streamed[ch.index] += ch.text
            if ch.finish_reason:
                ends[ch.index] = ch.finish_reason
    assert streamed == {0: two.choices[0].text, 1: two.choices[1].text} and ends == {0: "length", 1: "length"}
    assert c.usage.completion_tokens == two.usage.completion_tokens == 32
    both = client.completions.create(model="x", prompt=["Once upon a time", "The capital of France is"],
                                     max_tokens=6, temperature=0)
    assert [c.text for c in both.choices] == [
        client.completions.create(model="x", prompt=p, max_tokens=6, temperature=0).choices[0].text
        for p in ("Once upon a time", "The capital of France is")]


def test_token_prompts_and_tokenize_round_trip(client, server, model):
    toks = server.post("/tokenize", json={"content": "The capital of France is", "add_special": True}).json()
    assert toks["tokens"] == model.tokenize("The capital of France is", add_special=True, parse_special=True)
    by_ids = client.completions.create(model="x", prompt=toks["tokens"], max_tokens=8, temperature=0)
    by_text = client.completions.create(model="x", prompt="The capital of France is", max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    pieces = server.post("/tokenize", json={"content": "hello world", "with_pieces": True}).json()["tokens"]
    assert "".join(p["piece"] for p in pieces) == "hello world"
    back = server.post("/detokenize", json={"tokens": [p["id"] for p in pieces]}).json()
    assert back == {"content": "hello world"}


@pytest.mark.parametrize("kw,param", [
    (dict(temperature=5.0), "temperature"),
    (dict(max_tokens=100000), "max_tokens"),
    (dict(top_p=0.0), "top_p"),
    (dict(n=0), "n"),
    (dict(logprobs=21), "logprobs"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(logit_bias={"15": 150}), "logit_bias"),
    (dict(stop=["x"] * 40), "stop"),
    (dict(extra_body={"seed": "7"}), "seed"),
])
def test_bad_parameters_are_400(client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="x", prompt="hi", **kw)
    err = e.value.body
    assert e.value.status_code == 400 and err["type"] == "invalid_request_error", err
    assert param in err["message"]


def test_bad_prompts_are_400(client, model):
    for prompt in ([], [model.n_vocab + 5], "x " * 5000):  # empty, outside the vocabulary, too long
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="x", prompt=prompt, max_tokens=4)
        assert e.value.body["code"] == 400, prompt
    assert "context" in e.value.body["message"]  # the long one: no context shift on this server
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="x", messages=[{"role": "wizard", "content": "hi"}])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="x", messages=[])


def test_api_key(server):
    url = server.url
    assert httpx.get(url + "/health").status_code == 200  # the one open route
    for path in ("/v1/models", "/metrics", "/slots"):
        r = httpx.get(url + path)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", path
        assert httpx.get(url + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
    r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 401
    bad = openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="x", prompt="hi", max_tokens=2)
    assert server.get("/v1/models").status_code == 200


# ---- raw requests: llama-server's endpoints --------------------------------------------------------------
def test_health_metrics_slots(server):
    assert server.get("/health").json() == {"status": "ok"}
    m = server.metrics()
    for name in ("llamax_slots_busy", "llamax_cells_total", "llamax_cells_cached", "llamax_prompt_tokens_total",
                 "llamax_gen_tokens_total", "llamax_prefix_hits_total", "llamax_requests_finished_total"):
        assert name in m, name
    assert m["llamax_cells_total"] == 4096 and m["llamax_slots_total"] == 8
    slots = server.get("/slots").json()
    assert [s["id"] for s in slots] == list(range(8))
    assert all(s["n_ctx"] == 4096 and s["is_processing"] is False and s["n_past"] == 0 for s in slots)
    r = server.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    assert 'llamax_http_requests_total{code="200",route="/slots"}' in r.text


def test_slot_save_restore_erase(server, client):
    client.completions.create(model="x", prompt="Slot files hold a conversation: " * 4, max_tokens=4,
                              temperature=0)
    r = server.post("/slots/0?action=save", json={"filename": "a.bin"})
    assert r.status_code == 200, r.text
    saved = r.json()
    assert saved["filename"] == "a.bin" and (server.slot_dir / "a.bin").stat().st_size == saved["n_written"]
    r = server.post("/slots/1?action=restore", json={"filename": "a.bin"})
    assert r.status_code == 200 and r.json()["n_restored"] == saved["n_saved"]
    assert server.post("/slots/1?action=erase").json()["n_erased"] >= 0
    for path, body in (("/slots/0?action=save", {"filename": "../escape.bin"}),
                       ("/slots/0?action=save", {"filename": "/tmp/x.bin"}),
                       ("/slots/0?action=restore", {"filename": "missing.bin"}),
                       ("/slots/0?action=save", {}),
                       ("/slots/99?action=save", {"filename": "b.bin"}),
                       ("/slots/0?action=fly", {"filename": "b.bin"})):
        r = server.post(path, json=body)
        assert r.status_code == 400 and r.json()["error"]["code"] == 400, (path, body, r.text)
    assert not (server.slot_dir.parent / "escape.bin").exists()
    assert sorted(p.name for p in server.slot_dir.iterdir()) == ["a.bin"]


def test_bad_bodies_answer_400_and_disturb_nothing(server, model):
    """A stream runs while malformed bodies arrive: each gets a 4xx OpenAI error, the stream's text
    is what it is alone, the server stays up."""
    prompt = "The numbers from one to ten are: one, two,"
    ref = solo_text(model, prompt, 40)
    bodies = [b"", b"{", b"null", b"[]", b'"text"', b"\xff\xfe\x00", b'{"prompt": 5}', b'{"prompt": {"a": 1}}',
              b'{"prompt": "hi", "max_tokens": -5}', b'{"prompt": "hi", "max_tokens": 1e400}',
              b'{"prompt": "hi", "temperature": "hot"}', b'{"prompt": "hi", "n_keep": -9}',
              b'{"prompt": [[1, 2], "a"]}', b'{"prompt": [1, -1]}', b'{"prompt": "hi", "stop": [1]}',
              b'{"prompt": "hi", "stream": "yes"}', b'{"prompt": "hi", "seed": 99999999999999999999999}',
              b'{"messages": "hi"}', b'{"prompt": "' + b"[" * 10000 + b'"}', b'{"a":' * 2000 + b"1" + b"}" * 2000]
    with httpx.stream("POST", server.url + "/v1/completions", headers=server.headers(), timeout=60,
                      json={"prompt": prompt, "max_tokens": 40, "temperature": 0, "stream": True}) as s:
        lines = s.iter_lines()
        for body in bodies:
            for path in ("/v1/completions", "/v1/chat/completions"):
                r = server.post(path, content=body, headers={**server.headers(), "Content-Type": "application/json"})
                assert r.status_code == 400, (path, body[:40], r.status_code, r.text[:200])
                assert r.json()["error"]["type"] in ("invalid_request_error", "exceed_context_size_error")
        big = b'{"prompt": "' + b"a" * (9 << 20) + b'"}'
        r = server.post("/v1/completions", content=big)
        assert r.status_code == 413
        text = ""
        for line in lines:
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
    assert text == ref
    assert server.get("/health").status_code == 200


# ---- load and disconnects -----------------------------------------------------------------------------------
def test_64_concurrent_streams(server, aclient):
    questions = [f"Question {i}: how long may I keep book number {i}?" for i in range(64)]

    async def one(q):
        stream = await aclient.chat.completions.create(
            model="x", messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
            max_tokens=12, temperature=0, stream=True)
        text, finish, usage = "", None, None
        async for c in stream:
            if c.choices:
                text += c.choices[0].delta.content or ""
                finish = c.choices[0].finish_reason or finish
            usage = c.usage or usage
        return text, finish, usage

    async def all_of_them():
        return await asyncio.wait_for(asyncio.gather(*(one(q) for q in questions)), timeout=600)

    before = server.metrics()
    out = asyncio.run(all_of_them())
    assert all(f in ("stop", "length") and u is not None and u.completion_tokens >= 1 for _, f, u in out)
    assert all(t for t, f, u in out if f == "length")
    # the shared system prompt was computed once or a few times, not 64 times
    assert sum(u.prompt_tokens_details.cached_tokens for _, _, u in out) > 0.5 * sum(u.prompt_tokens for _, _, u in out)
    m = server.wait_idle()
    assert m["llamax_requests_finished_total"] - before["llamax_requests_finished_total"] == 64
    assert m["llamax_cells_used"] == m["llamax_cells_cached"]  # every cell is the prefix cache's again


def test_disconnect_mid_stream_frees_the_slot(server):
    before = server.metrics()
    with httpx.stream("POST", server.url + "/v1/completions", headers=server.headers(), timeout=60,
                      json={"prompt": "Write a long story about a lighthouse.", "max_tokens": 500,
                            "temperature": 0.8, "seed": 1, "stream": True, "ignore_eos": True}) as s:
        got = 0
        for line in s.iter_lines():
            got += line.startswith("data: {")
            if got == 3:
                break
        at_close = server.metrics()
    m = server.wait_idle(timeout=10)
    assert m["llamax_requests_cancelled_total"] == before["llamax_requests_cancelled_total"] + 1
    assert m["llamax_steps_total"] - at_close["llamax_steps_total"] <= 2  # freed within a step or so
    assert m["llamax_gen_tokens_total"] - before["llamax_gen_tokens_total"] < 100
    assert m["llamax_cells_used"] == m["llamax_cells_cached"]


def test_disconnect_while_waiting_cancels(server):
    before = server.metrics()
    with pytest.raises(httpx.ReadTimeout):
        server.post("/v1/completions", json={"prompt": "Write a long story.", "max_tokens": 500, "ignore_eos": True},
                    timeout=httpx.Timeout(60, read=0.5))
    m = server.wait_idle(timeout=10)
    assert m["llamax_requests_cancelled_total"] == before["llamax_requests_cancelled_total"] + 1
    assert m["llamax_gen_tokens_total"] - before["llamax_gen_tokens_total"] < 400


def test_one_log_line_per_request(server):
    # A request's line is written after its response is sent, so an earlier test's last line may still be on
    # its way: a marker request whose own line has arrived puts every earlier line behind us.
    start = len(server.lines)
    server.get("/v1/models")
    deadline = time.monotonic() + 5
    while not any("GET /v1/models 200" in line for line in server.lines[start:]) and time.monotonic() < deadline:
        time.sleep(0.02)
    n = max(i for i in range(start, len(server.lines)) if "GET /v1/models 200" in server.lines[i]) + 1
    server.get("/slots")
    server.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "temperature": 0})
    deadline = time.monotonic() + 5
    while len(server.lines) < n + 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    new = server.lines[n:]
    assert len(new) == 2, new
    assert "GET /slots 200" in new[0]
    assert re.search(r"POST /v1/completions 200 [\d.]+s prompt=\d+ cached=\d+ gen=3 ttft=[\d.]+s stop=length", new[1])


def test_full_queue_is_503():
    srv = LiveServer("-np", "1", "-c", "512", "--max-queue", "1")
    try:
        body = {"prompt": "Tell me a story.", "max_tokens": 200, "ignore_eos": True}
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            async def burst():
                async with httpx.AsyncClient(base_url=srv.url, timeout=60) as ac:
                    return await asyncio.gather(*(ac.post("/v1/completions", json=body) for _ in range(4)))
            out = asyncio.run(burst())
            codes = sorted(r.status_code for r in out)
            assert codes.count(200) >= 1 and 503 in codes, codes
            r = [r for r in out if r.status_code == 503][0]
            assert r.json()["error"]["type"] == "unavailable_error" and "queue is full" in r.json()["error"]["message"]
            assert c.get("/health").json() == {"status": "ok"}
            assert c.get("/v1/models").status_code == 200  # no key on this one
    finally:
        assert srv.stop() == 0


EMBEDDED = """
import logging, sys
import llamax
from llamax.server import serve
logging.basicConfig(level=logging.INFO, format="REC %(name)s %(message)s", stream=sys.stdout, force=True)
engine = llamax.Engine(llamax.Model.load("smollm2-135m"), n_ctx=256, n_parallel=1)
sys.exit(serve(engine, port=0))
"""


def test_embedded_serve_reports_through_logging_only():
    """serve() from an application of one's own: the listening URL is a logging record on
    llamax.server (here routed to stdout), and nothing is written to stderr by llamax."""
    proc = subprocess.Popen([sys.executable, "-c", EMBEDDED], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "LLAMAX_API_KEY": "", "PYTHONFAULTHANDLER": "1"})
    try:
        url = None
        for line in proc.stdout:
            m = re.match(r"REC llamax\.server listening on (http://\S+)$", line.strip())
            if m:
                url = m.group(1)
                break
        assert url, proc.stderr.read()
        assert httpx.get(url + "/health", timeout=30).json() == {"status": "ok"}
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err   # a crash at exit shows its threads' stacks (faulthandler)
        assert err == "", err
        assert "REC llamax.server" in out  # the request's line and the shutdown's, through logging too
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
