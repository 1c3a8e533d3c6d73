"""Faults lose nothing: a failing forward pass, a cancelled request, a full disk while saving a state
or a slot, a server killed in the middle of a slot save. After each: no half-written file under
the final name, the cache as it was (cell tables and state bytes compared), the other requests'
tokens the same as when they run alone (greedy)."""
import errno
import fcntl
import hashlib
import json
import os
import resource
import signal
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import pytest

import llamax
from llamax import Engine, RequestError
from llamax import state as _state

SYSTEM = ("You are a careful assistant for a small library. You answer questions about books, opening hours, "
          "membership cards, late fees and the reading room. Keep every answer short, friendly and exact. ")
QUESTIONS = ["When does the library open?", "How much is a late fee?", "May I eat in the reading room?",
             "How many books can I borrow?"]


def alone(model, prompt, max_tokens):
    """The greedy tokens of one request on an Engine of its own."""
    return Engine(model, n_ctx=1024, n_parallel=1, n_threads=1).generate(
        prompt, max_tokens=max_tokens, temperature=0).tokens


def run(eng):
    while eng.step():
        pass


def slot_cells(eng):
    """Cells that a slot's sequence holds (every request done: there must be none)."""
    slots = set(range(eng.n_parallel))
    return [(i, pos, seqs) for i, (pos, seqs) in enumerate(eng.memory.cells()) if seqs & slots]


def cache_consistent(eng):
    """Every used cell is held by the prefix cache alone, and clearing it empties the cache."""
    m = eng.metrics()
    assert m["slots_busy"] == 0 and not slot_cells(eng)
    assert m["cells_used"] == m["cells_cached"], m
    eng.clear_cache()
    assert eng.memory.n_used == 0


def listing(d):
    return sorted(os.listdir(d))


def digest(path):
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


# ---- a failing forward pass --------------------------------------------------------------------------
def test_a_forward_pass_failing_in_a_later_ubatch_leaves_the_cache_as_it_was(model, monkeypatch):
    ctx = llamax.Context(model, n_ctx=512, n_batch=64, n_ubatch=16, n_seq_max=2, n_threads=1)
    ctx.decode(llamax.Batch.one(model.tokenize(SYSTEM)[:20], seq_id=0))
    ctx.decode(llamax.Batch.one(model.tokenize(QUESTIONS[0])[:10], seq_id=1))
    cells, seq0, seq1 = ctx.memory.cells(), ctx.state_seq_get_data(0), ctx.state_seq_get_data(1)
    real, calls = model.forward, []

    def forward(memory, ubatch):
        calls.append(1)
        if len(calls) == 3:  # two ubatches are in the cells already
            raise MemoryError("out of memory in the third ubatch")
        return real(memory, ubatch)
    monkeypatch.setattr(model, "forward", forward)
    toks = model.tokenize(QUESTIONS[1] + " " + QUESTIONS[2])
    batch = llamax.Batch(toks * 2 + toks[:10], seq_ids=[0] * (2 * len(toks)) + [1] * 10)
    with pytest.raises(MemoryError):
        ctx.decode(batch)
    assert len(calls) == 3
    assert ctx.memory.cells() == cells
    assert ctx.state_seq_get_data(0) == seq0 and ctx.state_seq_get_data(1) == seq1
    monkeypatch.setattr(model, "forward", real)
    ctx.decode(llamax.Batch.one(toks, seq_id=0))  # the positions go on where they were
    assert ctx.memory.seq_pos_max(0) == 19 + len(toks)


def test_a_failing_forward_pass_fails_only_its_request(model):
    prompts = [model.tokenize(SYSTEM + q) for q in QUESTIONS[:3]]
    want = [alone(model, p, 6) for p in prompts]
    poison = model.tokenize(" Tell me about the forbidden archive in the basement.", add_special=False)
    bad_prompt = model.tokenize(QUESTIONS[3]) + poison
    eng = Engine(model, n_ctx=1024, n_parallel=4, n_batch=64, n_threads=1)
    real = eng.ctx.decode
    failures = []

    def decode(batch):
        toks = batch.token.tolist()
        if any(toks[i:i + len(poison)] == poison for i in range(len(toks))):
            failures.append(len(toks))
            raise RuntimeError("the forward pass failed on this prompt")
        return real(batch)
    eng.ctx.decode = decode
    reqs = [eng.submit(p, max_tokens=6, temperature=0) for p in prompts[:2]]
    bad = eng.submit(bad_prompt, max_tokens=6, temperature=0)
    reqs.append(eng.submit(prompts[2], max_tokens=6, temperature=0))
    run(eng)
    with pytest.raises(RequestError, match="failed on this prompt") as e:
        bad.result()
    assert isinstance(e.value.__cause__, RuntimeError)
    assert len(failures) >= 2  # in a batch with the others, then alone
    assert [r.result().tokens for r in reqs] == want
    assert eng.failed is None and eng.metrics()["requests_failed"] == 1
    assert eng.reuse.tree.match_len(bad_prompt) < len(model.tokenize(QUESTIONS[3])) + 1  # nothing of it cached
    cache_consistent(eng)


def test_a_forward_pass_that_fails_for_everyone_fails_every_request_and_keeps_the_cache(model):
    eng = Engine(model, n_ctx=1024, n_parallel=2, n_threads=1)
    first = eng.generate(SYSTEM + QUESTIONS[0], max_tokens=3, temperature=0)
    cells = eng.memory.cells()
    real = eng.ctx.decode

    def broken(batch):
        raise RuntimeError("the device went away")
    eng.ctx.decode = broken
    reqs = [eng.submit(SYSTEM + q, max_tokens=3, temperature=0) for q in QUESTIONS]
    run(eng)
    for r in reqs:
        with pytest.raises(RequestError, match="device went away"):
            r.result()
        assert r.done and r.error is not None
    assert eng.memory.cells() == cells  # the cached prefix as it was, nothing else
    eng.ctx.decode = real
    again = eng.generate(SYSTEM + QUESTIONS[0], max_tokens=3, temperature=0)
    assert again.tokens == first.tokens and again.n_cached > 0
    cache_consistent(eng)


# ---- a cancelled request -----------------------------------------------------------------------------
@pytest.mark.parametrize("when", ["queued", "prefill", "generating"])
def test_a_cancelled_request_gives_its_cells_back_and_changes_no_one_else(model, when):
    prompts = [model.tokenize(q + " " + SYSTEM) for q in QUESTIONS]  # nothing shared: no one waits for another
    v = 3 if when == "queued" else 1
    want = {i: alone(model, prompts[i], 8) for i in range(4) if i != v}
    eng = Engine(model, n_ctx=1024, n_parallel=3 if when == "queued" else 4, n_batch=32, n_threads=1)
    reqs = [eng.submit(p, max_tokens=8, temperature=0) for p in prompts]
    victim = reqs[v]
    eng.step()
    if when == "queued":
        assert victim.state == "queued"
    elif when == "prefill":
        while eng._slots[1].seq_state.fed == 0:
            eng.step()
        assert victim.state == "prefill" and 0 < eng._slots[1].seq_state.fed < len(victim.prompt)
    else:
        while victim.state != "generating" or not victim.generated:
            eng.step()
    victim.cancel()
    run(eng)
    res = victim.result()
    assert res.stop == "cancelled" and (res.n_generated > 0) == (when == "generating")
    for i, w in want.items():
        assert reqs[i].result().tokens == w, i
    m = eng.metrics()
    assert m["requests_cancelled"] == 1 and m["requests_finished"] == 3
    assert eng.reuse.tree.match_len(victim.prompt) < len(victim.prompt) or when == "generating"
    cache_consistent(eng)


# ---- a full disk while saving a state or a slot --------------------------------------------------------
class FullDisk:
    """A file object whose disk fills up after `room` more bytes: the bytes that fit are written (a
    partial file on disk), then OSError(ENOSPC), as write(2) on a full file system."""

    def __init__(self, f, room):
        self.f, self.room = f, room

    def write(self, b):
        mv = memoryview(b).cast("B")
        if mv.nbytes > self.room:
            self.f.write(mv[:self.room])
            self.f.flush()
            self.room = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= mv.nbytes
        return self.f.write(mv)

    def writelines(self, parts):
        for p in parts:
            self.write(p)

    def flush(self):
        self.f.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def fill_disk_after(monkeypatch, room):
    seen = []

    def full_open(fd, mode, closefd=True):
        seen.append(fd)
        return FullDisk(open(fd, mode, closefd=closefd), room)
    monkeypatch.setattr(_state, "open", full_open, raising=False)
    return seen


def enospc_at_fsync(monkeypatch):
    real = os.fsync

    def fsync(fd):
        if os.path.isfile(f"/proc/self/fd/{fd}") and os.readlink(f"/proc/self/fd/{fd}").endswith(".tmp"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd)
    monkeypatch.setattr(os, "fsync", fsync)


def test_a_state_file_is_fsynced_before_the_rename_and_the_directory_after(model, tmp_path, monkeypatch):
    ctx = llamax.Context(model, n_ctx=256, n_threads=1)
    ctx.decode(llamax.Batch.one(model.tokenize(QUESTIONS[0])))
    events, real_fsync, real_replace = [], os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(a, b):
        events.append(("replace", os.fspath(b)))
        return real_replace(a, b)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    ctx.state_save_file(tmp_path / "s.bin", [1, 2])
    assert [e[0] for e in events] == ["fsync", "replace", "fsync"]
    assert events[0][1].endswith(".tmp") and events[2][1] == str(tmp_path)
    assert listing(tmp_path) == ["s.bin"]


@pytest.mark.parametrize("fault", ["write", "fsync"])
def test_a_full_disk_while_saving_a_state_keeps_the_previous_file(model, tmp_path, monkeypatch, fault):
    ctx = llamax.Context(model, n_ctx=256, n_seq_max=2, n_threads=1)
    toks = model.tokenize(SYSTEM)
    ctx.decode(llamax.Batch.one(toks[:8]))
    path, seq_path = tmp_path / "s.bin", tmp_path / "q.bin"
    ctx.state_save_file(path, toks[:8])
    ctx.state_seq_save_file(seq_path, 0, toks[:8])
    old, old_seq = digest(path), digest(seq_path)
    ctx.decode(llamax.Batch.one(toks[8:40]))
    before, cells = ctx.state_get_data(), ctx.memory.cells()
    with monkeypatch.context() as mp:
        if fault == "write":
            fill_disk_after(mp, 100_000)  # the tokens and part of the K rows fit
        else:
            enospc_at_fsync(mp)
        for save in (lambda: ctx.state_save_file(path, toks[:40]),
                     lambda: ctx.state_seq_save_file(seq_path, 0, toks[:40])):
            with pytest.raises(OSError) as e:
                save()
            assert e.value.errno == errno.ENOSPC
    assert listing(tmp_path) == ["q.bin", "s.bin"]  # no temporary file left
    assert digest(path) == old and digest(seq_path) == old_seq
    assert ctx.state_get_data() == before and ctx.memory.cells() == cells
    fresh = llamax.Context(model, n_ctx=256, n_seq_max=2, n_threads=1)
    assert fresh.state_load_file(path) == toks[:8] and fresh.memory.seq_pos_max(0) == 7
    assert fresh.state_seq_load_file(seq_path, 1) == toks[:8] and fresh.memory.seq_pos_max(1) == 7


FSIZE_SCRIPT = textwrap.dedent("""
    import errno, json, os, resource, signal, sys
    import llamax
    d = sys.argv[1]
    model = llamax.Model.load("smollm2-135m", n_threads=1)
    ctx = llamax.Context(model, n_ctx=256, n_threads=1)
    toks = model.tokenize("One two three four five six seven eight nine ten eleven twelve " * 4)
    ctx.decode(llamax.Batch.one(toks[:4]))
    ctx.state_seq_save_file(os.path.join(d, "s.bin"), 0, toks[:4])
    small = os.path.getsize(os.path.join(d, "s.bin"))
    ctx.decode(llamax.Batch.one(toks[4:48]))
    before = ctx.state_seq_get_data(0)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # then write(2) past the limit fails with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (4 * small, resource.RLIM_INFINITY))
    try:
        ctx.state_seq_save_file(os.path.join(d, "s.bin"), 0, toks[:48])
        err = None
    except OSError as e:
        err = e.errno
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    print(json.dumps({"errno": err, "small": small, "same": ctx.state_seq_get_data(0) == before,
                      "need": len(before)}))
""")


def test_a_file_size_limit_hit_mid_save_keeps_the_previous_file(tmp_path):
    """The kernel's own failure part-way through write(2): RLIMIT_FSIZE in a subprocess."""
    out = subprocess.run([sys.executable, "-c", FSIZE_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["need"] > 4 * r["small"] and r["errno"] == errno.EFBIG and r["same"]
    assert listing(tmp_path) == ["s.bin"] and os.path.getsize(tmp_path / "s.bin") == r["small"]
    model = llamax.Model.load("smollm2-135m", n_threads=1)
    ctx = llamax.Context(model, n_ctx=256, n_threads=1)
    assert len(ctx.state_seq_load_file(tmp_path / "s.bin", 0)) == 4 and ctx.memory.seq_pos_max(0) == 3


@pytest.mark.parametrize("fault", ["write", "fsync"])
def test_a_full_disk_while_saving_a_slot_keeps_the_file_the_cache_and_the_requests(model, tmp_path, monkeypatch,
                                                                                 fault):
    prompt = model.tokenize(SYSTEM + QUESTIONS[0])
    want = alone(model, prompt, 8)
    eng = Engine(model, n_ctx=1024, n_parallel=2, n_threads=1, slot_save_path=tmp_path)
    first = [eng.submit(QUESTIONS[i], max_tokens=4, temperature=0, ignore_eos=True) for i in (2, 3)]
    run(eng)
    saved = [eng.slot_save(i, f"{i}.bin")["n_saved"] for i in (0, 1)]
    assert saved == [r.result().n_prompt + 3 for r in first]
    files = {n: digest(tmp_path / n) for n in listing(tmp_path)}
    req = eng.submit(prompt, max_tokens=8, temperature=0)
    eng.step()
    eng.step()
    assert eng._slots[0].req is req and eng._slots[1].req is None  # slot 0 busy, slot 1 idle (its cache)
    idle_toks = list(eng.reuse.kept(1))
    cells, seqs = eng.memory.cells(), [eng.ctx.state_seq_get_data(s) for s in range(2)]
    metrics = {k: v for k, v in eng.metrics().items() if k != "busy_s"}
    with monkeypatch.context() as mp:
        if fault == "write":
            fill_disk_after(mp, 50_000)
        else:
            enospc_at_fsync(mp)
        for i in (0, 1):
            with pytest.raises(OSError) as e:
                eng.slot_save(i, f"{i}.bin")
            assert e.value.errno == errno.ENOSPC
    assert {n: digest(tmp_path / n) for n in listing(tmp_path)} == files
    assert eng.memory.cells() == cells and [eng.ctx.state_seq_get_data(s) for s in range(2)] == seqs
    assert {k: v for k, v in eng.metrics().items() if k != "busy_s"} == metrics
    assert eng.reuse.kept(1) == idle_toks
    run(eng)
    assert req.result().tokens == want
    fresh = Engine(model, n_ctx=1024, n_parallel=2, n_threads=1, slot_save_path=tmp_path)
    assert [fresh.slot_restore(i, f"{i}.bin")["n_restored"] for i in (0, 1)] == saved
    cache_consistent(eng)


def test_stale_temporary_files_are_removed_at_start_but_not_a_save_in_progress(model, tmp_path):
    (tmp_path / "a.bin").write_bytes(b"a slot file")
    (tmp_path / "a.bin.0123456789abcdef.tmp").write_bytes(b"half a save")
    (tmp_path / "notes.tmp").write_bytes(b"not ours")
    live = tmp_path / "b.bin.fedcba9876543210.tmp"
    fd = os.open(live, os.O_WRONLY | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a save in progress in another process
    try:
        eng = Engine(model, n_ctx=256, n_parallel=1, n_threads=1, slot_save_path=tmp_path)
        assert listing(tmp_path) == ["a.bin", live.name, "notes.tmp"]
    finally:
        os.close(fd)
    assert _state.remove_stale_tmp(tmp_path) == [live.name]
    assert listing(tmp_path) == ["a.bin", "notes.tmp"]
    with pytest.raises(ValueError, match="temporary file"):
        eng.slot_save(0, "x.bin.0123456789abcdef.tmp")


# ---- the HTTP server: a full disk, and a kill in the middle of a slot save ------------------------------
def _ignore_sigxfsz():
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past RLIMIT_FSIZE, write(2) fails with EFBIG


def _complete(server, prompt, n=4):
    r = server.post("/v1/completions", json={"prompt": prompt, "max_tokens": n, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_a_server_whose_disk_fills_up_keeps_the_slot_file_and_serves_on(tmp_path):
    from test_server import LiveServer
    server = LiveServer("-np", "2", "-c", "1024", "--slot-save-path", str(tmp_path), preexec_fn=_ignore_sigxfsz)
    try:
        text = _complete(server, SYSTEM + QUESTIONS[0])
        r = server.post("/slots/0?action=save", json={"filename": "a.bin"})
        assert r.status_code == 200, r.text
        old = digest(tmp_path / "a.bin")
        _complete(server, SYSTEM + QUESTIONS[1] + " " + QUESTIONS[2], 8)  # slot 0 now holds more
        resource.prlimit(server.proc.pid, resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
        r = server.post("/slots/0?action=save", json={"filename": "a.bin"})
        assert r.status_code == 500 and "File too large" in r.json()["error"]["message"], r.text
        resource.prlimit(server.proc.pid, resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        assert listing(tmp_path) == ["a.bin"] and digest(tmp_path / "a.bin") == old
        assert _complete(server, SYSTEM + QUESTIONS[0]) == text
        r = server.post("/slots/1?action=restore", json={"filename": "a.bin"})
        assert r.status_code == 200 and r.json()["n_restored"] > 0, r.text
    finally:
        assert server.stop() == 0


def test_a_server_killed_in_the_middle_of_a_slot_save_leaves_the_previous_file(tmp_path, model):
    from test_server import LiveServer
    args = ("-np", "1", "-c", "2048", "--slot-save-path", str(tmp_path))
    server = LiveServer(*args)
    try:
        _complete(server, SYSTEM + QUESTIONS[0])
        assert server.post("/slots/0?action=save", json={"filename": "a.bin"}).status_code == 200
        old = digest(tmp_path / "a.bin")
        big = model.tokenize((SYSTEM + " ".join(QUESTIONS)) * 8)[:1200]  # ~28 MB of K/V to write
        r = server.post("/v1/completions", json={"prompt": big, "max_tokens": 1, "temperature": 0}, timeout=600)
        assert r.status_code == 200, r.text
        saving = threading.Thread(target=lambda: pytest.raises(httpx.HTTPError, server.post, "/slots/0?action=save",
                                                               json={"filename": "a.bin"}, timeout=120))
        saving.start()
        deadline, seen = time.monotonic() + 120, None
        while seen is None and time.monotonic() < deadline:  # the save's temporary file: kill now
            seen = next((n for n in os.listdir(tmp_path) if n.endswith(".tmp")), None)
        assert seen is not None, "the save never started"
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(30)
        saving.join(60)
        assert server.proc.returncode == -signal.SIGKILL
        names = listing(tmp_path)
        assert names == sorted(["a.bin", seen]), names  # the temporary file, killed mid-save, not renamed
        assert digest(tmp_path / "a.bin") == old
    finally:
        server.stop()
    again = LiveServer(*args)
    try:
        assert listing(tmp_path) == ["a.bin"]  # the new server removed the killed save's temporary file
        r = again.post("/slots/0?action=restore", json={"filename": "a.bin"})
        assert r.status_code == 200 and r.json()["n_restored"] > 0, r.text
        assert again.metrics()["llamax_cells_cached"] == r.json()["n_restored"]
    finally:
        assert again.stop() == 0
