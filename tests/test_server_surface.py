"""The server details llama-server's clients rely on, over loopback with the openai client and httpx:
GET /props and POST /apply-template, no field silently ignored (llama-server's and OpenAI's fields
honoured or refused by name), multi-part text content, the role-only first chunk of a chat stream,
exceed_context_size_error, routes without /v1, CORS, `timings`, and return_progress events.

The main server runs SmolLM2 with 2 slots, a slot context of 1024, no context shift, an API key and
a batch of 32 tokens (so that a prompt of a few hundred tokens is processed in several steps); a
second one restricts CORS to two origins."""
import json

import httpx
import openai
import pytest
from starlette.responses import JSONResponse
from starlette.routing import Route
from test_server import LiveServer

import llamax
from llamax.server.app import create_app

KEY = "surface-key"
N_CTX = 1024
GOOD = ("http://good.example", "https://app.example.org:8443")


@pytest.fixture(scope="module")
def server():
    srv = LiveServer("-np", "2", "-c", str(N_CTX), "--no-context-shift", "-b", "32", "-ub", "32", key=KEY)
    yield srv
    assert srv.stop() == 0, "".join(srv.lines[-20:])


@pytest.fixture(scope="module")
def plain():
    """One slot, no prefix cache, no API key, CORS for the GOOD origins only."""
    srv = LiveServer("-np", "1", "-c", "256", "--no-prefix-cache", *[x for o in GOOD for x in ("--cors-origin", o)])
    yield srv
    assert srv.stop() == 0, "".join(srv.lines[-20:])


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def events(server, path, body):
    """The JSON events of a streamed answer (the [DONE] line checked and left out)."""
    out = []
    with httpx.stream("POST", server.url + path, headers=server.headers(), json={**body, "stream": True},
                      timeout=120) as s:
        assert s.status_code == 200, s.read()
        lines = [x for x in s.iter_lines() if x]
    assert lines[-1] == "data: [DONE]"
    for line in lines[:-1]:
        assert line.startswith("data: ")
        out.append(json.loads(line[6:]))
    return out


def counters(server):
    m = server.wait_idle()
    return (m["llamax_prompt_tokens_total"], m["llamax_requests_finished_total"], m["llamax_prefix_lookups_total"])


# ---- /props and /apply-template --------------------------------------------------------------------------
def test_props(server, model):
    r = server.get("/props")
    assert r.status_code == 200
    p = r.json()
    settings = p["default_generation_settings"]
    assert settings["n_ctx"] == N_CTX and p["total_slots"] == 2
    params = settings["params"]
    assert (params["temperature"], params["top_k"], params["top_p"], params["min_p"]) == (0.8, 40, 0.95, 0.05)
    assert params["n_predict"] == -1 and params["max_tokens"] == N_CTX and params["repeat_penalty"] == 1.0
    assert params["mirostat"] == 0 and params["typical_p"] == 1.0 and params["grammar"] == ""
    assert params["samplers"][3:] == ["top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"]
    assert p["chat_template"] == model.chat_template and p["chat_template"]
    assert p["bos_token"] == model.token_to_piece(model.bos).decode()
    assert p["eos_token"] == model.token_to_piece(model.eos).decode()
    assert p["modalities"] == {"vision": False, "audio": False}
    assert p["model_alias"] == "smollm2-135m" and p["model_path"].endswith(".gguf")
    assert p["build_info"] == f"llamax {llamax.__version__}"
    assert httpx.get(server.url + "/props").status_code == 401  # behind the key like the other routes


def test_apply_template(server, model):
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "What is"},
                                         {"type": "text", "text": "the best book"}]}]
    r = server.post("/apply-template", json={"messages": msgs})
    assert r.status_code == 200
    want = model.apply_chat_template([msgs[0], {"role": "user", "content": "What is\nthe best book"}])
    assert r.json() == {"prompt": want}
    assert want.endswith("<|im_start|>assistant\n")  # the assistant's turn opens (SmolLM2's ChatML)
    for bad in ({}, {"messages": []}, {"messages": "hi"}, {"messages": [{"role": "wizard", "content": "x"}]}):
        r = server.post("/apply-template", json=bad)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", (bad, r.text)


# ---- multi-part content ------------------------------------------------------------------------------------
def test_text_parts_are_joined_by_newlines(client):
    parts = [{"type": "text", "text": "What is"}, {"type": "text", "text": "the best book"}]
    a = client.chat.completions.create(model="x", messages=[{"role": "user", "content": parts}], max_tokens=8,
                                       temperature=0)
    b = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "What is\nthe best book"}],
                                       max_tokens=8, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
    {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
    {"type": "file", "file": {"file_id": "f"}},
])
def test_media_parts_are_400_naming_their_type(server, part):
    before = counters(server)
    msgs = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}]
    for path in ("/v1/chat/completions", "/apply-template"):
        r = server.post(path, json={"messages": msgs, "max_tokens": 4})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "messages" and repr(part["type"]) in err["message"], err
        assert err["message"].startswith("messages.0.content.1: a content part of type"), err
    assert counters(server) == before


# ---- no field silently ignored ---------------------------------------------------------------------------
REFUSED = [
    ("mirostat", 2), ("typical_p", 0.5), ("top_n_sigma", 1.5), ("xtc_probability", 0.5), ("dynatemp_range", 0.5),
    ("dry_multiplier", 0.8), ("penalize_nl", True), ("min_keep", 5),
    ("samplers", ["top_k", "temperature"]), ("samplers", "kt"), ("post_sampling_probs", True),
    ("return_tokens", True), ("t_max_predict_ms", 500), ("n_indent", 4), ("n_discard", 8), ("lora", [{"id": 0}]),
    ("response_fields", ["content"]), ("n_cmpl", 2), ("grammar_lazy", True),
    ("reasoning_format", "deepseek"), ("chat_template_kwargs", {"enable_thinking": True}),
    ("functions", [{"name": "f"}]), ("modalities", ["text", "audio"]), ("chat_format", "Hermes 2 Pro"),
    ("add_generation_prompt", False), ("parse_tool_calls", True), ("verbose", True),
]


@pytest.mark.parametrize("field,value", REFUSED, ids=[f"{f}={v}" for f, v in REFUSED])
def test_fields_we_cannot_honour_are_400_naming_them(server, field, value):
    before = counters(server)
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        r = server.post(path, json={**body, "max_tokens": 4, field: value})
        assert r.status_code == 400, (path, r.text)
        err = r.json()["error"]
        assert err["param"] == field and err["message"].startswith(field), err
        assert err["type"] == "invalid_request_error"
    assert counters(server) == before  # nothing reached the Engine


def test_cache_prompt_false_is_honoured_without_a_prefix_cache(plain):
    body = {"prompt": "The same prompt twice, computed twice:", "max_tokens": 3, "temperature": 0,
            "cache_prompt": False}
    a, b = (plain.post("/v1/completions", json=body) for _ in range(2))
    assert a.status_code == b.status_code == 200, a.text
    assert b.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0 and b.json()["timings"]["cache_n"] == 0
    assert a.json()["choices"] == b.json()["choices"]


def test_no_op_values_and_unknown_fields_are_taken(client):
    """Every refused field at its no-op value (what llama-server's clients send by default), and fields
    neither llama-server nor OpenAI knows, change nothing."""
    noop = {"grammar": "", "json_schema": None, "n_probs": 0, "mirostat": 0, "mirostat_tau": 4.0, "mirostat_eta": 0.2,
            "typical_p": 1.0, "top_n_sigma": -1.0, "xtc_probability": 0.0, "xtc_threshold": 0.3,
            "dynatemp_range": 0.0, "dynatemp_exponent": 2.0, "dry_multiplier": 0.0, "dry_base": 2.0,
            "dry_allowed_length": 3, "dry_penalty_last_n": 64, "dry_sequence_breakers": ["\n"], "repeat_last_n": 64,
            "penalize_nl": False, "min_keep": 0, "post_sampling_probs": False, "return_tokens": False,
            "samplers": ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"],
            "t_max_predict_ms": -1, "n_indent": 0, "n_discard": 0, "lora": [], "id_slot": -1, "cache_prompt": True,
            "timings_per_token": False, "return_progress": False, "reasoning_format": "none",
            "add_generation_prompt": True, "logit_bias": {}, "presence_penalty": 0.0,
            "speculative.n_max": 16, "user": "u-1", "store": False, "metadata": {"a": "b"}, "some_future_field": 3}
    msgs = [{"role": "user", "content": "Name a color."}]
    plain = client.chat.completions.create(model="x", messages=msgs, max_tokens=8, temperature=0)
    full = client.chat.completions.create(model="x", messages=msgs, max_tokens=8, temperature=0, extra_body=noop)
    assert full.choices[0].message.content == plain.choices[0].message.content
    c = client.completions.create(model="x", prompt="Colors: red,", max_tokens=6, temperature=0,
                                  extra_body={**noop, "samplers": "edskypmxt"})
    assert c.choices[0].text == client.completions.create(model="x", prompt="Colors: red,", max_tokens=6,
                                                          temperature=0).choices[0].text


def test_n_predict_is_max_tokens(client, server):
    r = client.completions.create(model="x", prompt="One, two, three,", temperature=0, extra_body={"n_predict": 5})
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    r = client.completions.create(model="x", prompt="One, two, three,", temperature=0, max_tokens=9,
                                  extra_body={"n_predict": 3})  # llama-server's field wins
    assert r.usage.completion_tokens == 3
    r = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Count to ten."}],
                                       temperature=0, max_completion_tokens=9, extra_body={"n_predict": 2})
    assert r.usage.completion_tokens == 2
    r = server.post("/v1/completions", json={"prompt": "hi", "n_predict": N_CTX + 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n_predict"
    r = server.post("/v1/completions", json={"prompt": "hi", "n_predict": -2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n_predict"


# ---- streams ------------------------------------------------------------------------------------------------
def test_chat_stream_opens_with_the_role_alone(server, client):
    body = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 6, "temperature": 0}
    ev = events(server, "/v1/chat/completions", body)
    first, middle, last = ev[0], ev[1:-1], ev[-1]
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": None}  # llama-server's first chunk
    assert first["choices"][0]["finish_reason"] is None and first["object"] == "chat.completion.chunk"
    assert middle and all(set(e["choices"][0]["delta"]) == {"content"} for e in middle)
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["finish_reason"] == "length"
    assert "timings" in last and "usage" in last and all("timings" not in e for e in ev[:-1])
    whole = client.chat.completions.create(model="x", **body)
    assert "".join(e["choices"][0]["delta"]["content"] for e in middle) == whole.choices[0].message.content
    chunks = list(client.chat.completions.create(model="x", stream=True, **body))  # the openai client takes it
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content is None


def _check_timings(t, prompt_tokens, cached, generated):
    assert set(t) >= {"prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_n",
                      "predicted_ms", "predicted_per_token_ms", "predicted_per_second", "cache_n"}
    assert t["cache_n"] == cached and t["prompt_n"] == prompt_tokens - cached and t["predicted_n"] == generated
    assert t["prompt_ms"] > 0 and t["prompt_per_token_ms"] == pytest.approx(t["prompt_ms"] / t["prompt_n"])
    assert t["prompt_per_second"] == pytest.approx(1e3 * t["prompt_n"] / t["prompt_ms"])
    if generated > 1:
        assert t["predicted_ms"] > 0
        assert t["predicted_per_token_ms"] == pytest.approx(t["predicted_ms"] / generated)
        assert t["predicted_per_second"] == pytest.approx(1e3 * generated / t["predicted_ms"])


def test_timings(server):
    body = {"prompt": "The timings of a request: the prompt first, then", "max_tokens": 6, "temperature": 0}
    r = server.post("/v1/completions", json=body).json()
    u = r["usage"]
    _check_timings(r["timings"], u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"], 6)
    ev = events(server, "/v1/completions", body)
    assert all("timings" not in e for e in ev[:-1])
    u = ev[-1]["usage"]
    _check_timings(ev[-1]["timings"], u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"], 6)
    # timings_per_token: every chunk has them, counting the tokens so far
    ev = events(server, "/v1/completions", {**body, "timings_per_token": True})
    assert all("timings" in e for e in ev)
    counts = [e["timings"]["predicted_n"] for e in ev]
    assert counts == sorted(counts) and counts[-1] == 6 and counts[0] >= 1
    ev = events(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                                 "timings_per_token": True})
    assert all("timings" in e for e in ev[1:])  # the role's chunk comes before any token


def test_return_progress(server, model):
    """A prompt of ~300 tokens in steps of 32: prompt_progress events with processed growing to the
    total, before the first token; the cached part is counted as processed from the start."""
    prompt = " ".join(f"item{i}" for i in range(150)) + " The last item is"
    n = len(model.tokenize(prompt, add_special=True, parse_special=True))
    assert n > 200
    ev = events(server, "/v1/completions", {"prompt": prompt, "max_tokens": 2, "temperature": 0,
                                            "return_progress": True})
    prog = [e for e in ev if "prompt_progress" in e]
    k = len(prog)
    assert k >= 3 and all("prompt_progress" not in e for e in ev[k:])  # all before the text
    assert all(e["choices"][0]["text"] == "" for e in prog)
    done = [p["prompt_progress"]["processed"] for p in prog]
    assert done == sorted(done) and done[-1] == n and done[0] < n
    assert all(p["prompt_progress"]["total"] == n and p["prompt_progress"]["cache"] == 0 for p in prog)
    times = [p["prompt_progress"]["time_ms"] for p in prog]
    assert times == sorted(times) and times[0] >= 0
    # the same prompt again: all but its last token from the cache, one event, in a chat stream as well
    ev = events(server, "/v1/completions", {"prompt": prompt, "max_tokens": 2, "return_progress": True})
    p = [e["prompt_progress"] for e in ev if "prompt_progress" in e]
    assert p[-1] == {**p[-1], "total": n, "cache": n - 1, "processed": n}
    ev = events(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}], "max_tokens": 2,
                                                 "return_progress": True})
    prog = [e for e in ev if "prompt_progress" in e]
    assert prog and all(e["choices"][0]["delta"] == {"role": "assistant", "content": None} for e in prog)
    assert prog[-1]["prompt_progress"]["processed"] == prog[-1]["prompt_progress"]["total"]
    assert "prompt_progress" not in ev[-1] and ev[-1]["usage"]["prompt_tokens"] == prog[-1]["prompt_progress"]["total"]


def test_request_records_its_admission_and_prefill(model):
    """Request.t_start (admission to a slot) and Request.n_fed (prompt tokens in the slot), which
    the timings and progress events read."""
    with llamax.Engine(model, n_ctx=512, n_parallel=1, n_batch=16, n_ubatch=16) as eng:
        req = eng.submit(" ".join(f"number {i}," for i in range(20)), max_tokens=2, temperature=0)
        res = req.result()
    assert req.n_fed == res.n_prompt > 16 and req.t_submit <= req.t_start <= req.t_first <= req.t_last


# ---- the context ----------------------------------------------------------------------------------------------
def test_a_prompt_over_the_context_is_exceed_context_size_error(server, client, model):
    prompt = "word " * 1100
    n = len(model.tokenize(prompt, add_special=True, parse_special=True))
    before = counters(server)
    r = server.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4})
    assert r.status_code == 400
    assert r.json() == {"error": {
        "code": 400, "type": "exceed_context_size_error", "param": None, "n_prompt_tokens": n, "n_ctx": N_CTX,
        "message": f"request ({n} tokens) exceeds the available context size ({N_CTX} tokens), try increasing it"}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="x", messages=[{"role": "user", "content": prompt}], max_tokens=4)
    err = e.value.body
    assert err["type"] == "exceed_context_size_error" and err["n_ctx"] == N_CTX and err["n_prompt_tokens"] > n
    word = model.tokenize(" word", add_special=False)[0]
    r = server.post("/v1/completions", json={"prompt": [word] * (N_CTX - 1), "max_tokens": 4})
    assert r.json()["error"]["n_prompt_tokens"] == N_CTX - 1  # no cell left for the first token
    r = server.post("/v1/completions", json={"prompt": [word] * (N_CTX - 2), "max_tokens": 4})  # one cell left
    assert r.status_code == 200, r.text
    assert server.post("/v1/completions", json={"prompt": [], "max_tokens": 4}).json()["error"]["type"] == \
        "invalid_request_error"  # another BatchError stays what it is
    assert counters(server)[1] == before[1] + 1


# ---- routes without /v1 ----------------------------------------------------------------------------------------
def test_routes_without_the_v1_prefix(server):
    body = {"prompt": "The sky is", "max_tokens": 5, "temperature": 0}
    a, b = server.post("/v1/completions", json=body).json(), server.post("/completions", json=body).json()
    assert a["choices"][0]["text"] == b["choices"][0]["text"] and b["object"] == "text_completion"
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    a, b = server.post("/v1/chat/completions", json=chat).json(), server.post("/chat/completions", json=chat).json()
    assert a["choices"][0]["message"] == b["choices"][0]["message"]
    assert server.get("/models").json()["data"][0]["id"] == server.get("/v1/models").json()["data"][0]["id"]
    assert httpx.post(server.url + "/chat/completions", json=chat).status_code == 401  # the key still applies
    assert server.get("/chat/completions").status_code == 405


def test_every_v1_route_is_aliased(model):
    """The aliasing covers routes added by others (as /v1/embeddings): in-process, the engine not started."""
    async def echo(request):
        return JSONResponse({"path": request.url.path})

    async def mine(request):
        return JSONResponse({"mine": True})

    eng = llamax.Engine(model, n_ctx=256, n_parallel=1)
    try:
        app = create_app(eng, routes=[Route("/v1/echo", echo, methods=["POST"]), Route("/echo2", mine),
                                      Route("/v1/echo2", echo)])

        async def run():
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
                return [await c.post("/echo"), await c.post("/v1/echo"), await c.get("/echo2"), await c.get("/echo")]

        import asyncio
        r = asyncio.run(run())
    finally:
        eng.close()
    assert [x.status_code for x in r] == [200, 200, 200, 405]
    assert r[0].json() == {"path": "/echo"} and r[2].json() == {"mine": True}  # a route of that path wins


# ---- CORS -------------------------------------------------------------------------------------------------------
def test_cors_any_origin_by_default(server):
    pre = httpx.options(server.url + "/v1/chat/completions", headers={
        "Origin": "http://anywhere.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert pre.status_code == 204 and pre.content == b""  # no API key asked of a preflight
    h = pre.headers
    assert h["access-control-allow-origin"] == "*" and "POST" in h["access-control-allow-methods"]
    assert h["access-control-allow-headers"] == "authorization, content-type"
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = httpx.post(server.url + "/v1/chat/completions", json=chat, headers={"Origin": "http://anywhere.example"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"  # the key is still asked
    assert r.headers["access-control-allow-origin"] == "*"  # and the page can read why
    r = server.post("/v1/chat/completions", json=chat, headers={**server.headers(), "Origin": "http://x.example"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    with httpx.stream("POST", server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": True},
                      headers={**server.headers(), "Origin": "http://x.example"}) as s:
        assert s.headers["access-control-allow-origin"] == "*"
        s.read()
    assert "access-control-allow-origin" not in server.get("/health").headers  # no Origin: no CORS headers


def test_cors_origins_restricted(plain):
    for origin in GOOD:
        pre = httpx.options(plain.url + "/v1/completions", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST"})
        assert pre.status_code == 204
        assert pre.headers["access-control-allow-origin"] == origin and pre.headers["vary"] == "Origin"
        r = httpx.get(plain.url + "/v1/models", headers={"Origin": origin})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
    pre = httpx.options(plain.url + "/v1/completions", headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
    assert pre.status_code == 403 and pre.json()["error"]["code"] == 403
    assert "access-control-allow-origin" not in pre.headers
    r = httpx.get(plain.url + "/v1/models", headers={"Origin": "http://evil.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers  # the browser withholds it
    r = httpx.options(plain.url + "/v1/models")  # not a preflight: the route's own 405
    assert r.status_code == 405
