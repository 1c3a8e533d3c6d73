"""Short in-suite runs of the fuzz harnesses of tests/fuzz/ (the long runs: benchmarks/fuzz.py).

Per target: every seed of tests/fuzz/corpus/<target>/, then Hypothesis' bytes through the same
one_input the long run feeds with atheris; each case within a time limit. Then the checks that
the harnesses can fail (a planted bug of each kind is reported) and the allocation bound of the
GGUF loader on files that claim 2**40-byte strings and arrays.
"""
from __future__ import annotations

import importlib
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llamax.errors import BatchError, ModelError, StateError
from tests.fuzz.common import CORPUS, Finding, Hang, time_limit

TARGETS = {"state": 300, "gguf": 200, "batch": 300, "tokenizer": 250, "server": 200}  # Hypothesis examples
CASE_SECONDS = 20


def harness(name: str):
    return importlib.import_module(f"tests.fuzz.{name}")


@pytest.mark.parametrize("name", TARGETS)
def test_corpus(name):
    seeds = sorted((CORPUS / name).iterdir())
    assert seeds, f"no seeds in {CORPUS / name}"
    h = harness(name)
    for p in seeds:
        with time_limit(CASE_SECONDS):
            h.one_input(p.read_bytes())


@pytest.mark.parametrize("name", TARGETS)
def test_fuzz(name):
    h = harness(name)

    @settings(max_examples=TARGETS[name], deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(st.binary(min_size=0, max_size=256))
    def run(data):
        with time_limit(CASE_SECONDS):
            h.one_input(data)

    run()


# ---- the harnesses can fail --------------------------------------------------------------------------
def test_state_harness_reports_a_leaked_exception(monkeypatch):
    from llamax import state

    def broken(*a, **k):
        raise IndexError("planted")

    monkeypatch.setattr(state, "read_outputs", broken)
    with pytest.raises(IndexError, match="planted"):
        for i in range(200):
            harness("state").one_input(bytes([0, 255, 0, i]) + bytes(32))


def test_state_harness_reports_a_half_written_destination(monkeypatch):
    from llamax import state

    monkeypatch.setattr(state, "empty", lambda memory, seq_id: None)   # a failed restore no longer empties
    with pytest.raises(Finding, match="left"):
        for i in range(300):
            harness("state").one_input(struct.pack("<I", i * 2654435761 % 2**32) * 8)


def test_gguf_harness_reports_a_leaked_exception_and_a_big_allocation(monkeypatch):
    from llamax.model import model as G     # Model.__init__'s check_tensors

    h = harness("gguf")
    buf = h.seed()[0]
    h.load(buf)                                        # the seed loads
    monkeypatch.setattr(G, "check_tensors", lambda *a: (_ for _ in ()).throw(TypeError("planted")))
    with pytest.raises(TypeError, match="planted"):
        h.load(buf)
    monkeypatch.setattr(G, "check_tensors", lambda *a: bytearray(64 << 20))
    with pytest.raises(Finding, match="allocated"):
        h.load(buf)


def test_batch_harness_reports_a_changed_cache(monkeypatch):
    from llamax.batch import BatchAllocator

    h = harness("batch")
    ctx = h.setup()["unified"]
    real = BatchAllocator.init

    def init(self, batch, memory, *a, **k):
        memory.seq_rm(-1)                              # a failing validation that drops the cache
        return real(self, batch, memory, *a, **k)

    monkeypatch.setattr(BatchAllocator, "init", init)
    with pytest.raises(Finding, match="changed the cache"):
        for i in range(300):
            h.one_input(bytes([0, 0, 1, 0, 0, 0, 0, 0, 5, 7, 0, 0, 0, 0, 0, 0]) + bytes([i]) * 16)
    assert isinstance(ctx.memory.n_used, int)


def test_tokenizer_harness_reports_a_broken_round_trip(monkeypatch):
    from llamax.model.tokenizer import Tokenizer

    h = harness("tokenizer")
    tok = h.tokenizers()["smollm2"]
    monkeypatch.setattr(tok, "detokenize", lambda ids, *a, **k: Tokenizer.detokenize(tok, ids, *a, **k) + "!")
    with pytest.raises(Finding, match="round trip"):
        for i in range(300):
            h.one_input(bytes([0, 0, 0, 1, 0]) + bytes([i % 256]) * 40)


def test_server_harness_reports_a_500(monkeypatch):
    from llamax.server.schemas import CompletionRequest

    h = harness("server")
    h.client()
    monkeypatch.setattr(CompletionRequest, "prompts", lambda self: 1 / 0)
    with pytest.raises(Finding, match="status 500"):
        h.one_input(b"")                                # the valid base body of /v1/completions


def test_time_limit_reports_a_hang():
    import time

    with pytest.raises(Hang):
        with time_limit(0.2):
            time.sleep(2)


# ---- the GGUF loader allocates nothing of a claimed size ------------------------------------------------
def _gguf(kvs: bytes, n_kv: int, n_tensors: int = 0) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv) + kvs


def _s(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


@pytest.mark.parametrize("raw", [
    _gguf(struct.pack("<Q", 2**40) + b"general.architecture", 1),                          # a key of 2**40 bytes
    _gguf(_s(b"general.name") + struct.pack("<IQ", 8, 2**40) + b"x" * 64, 1),              # a string value
    _gguf(_s(b"tokenizer.ggml.tokens") + struct.pack("<IIQ", 9, 8, 2**40) + _s(b"a") * 8, 1),  # 2**40 strings
    _gguf(_s(b"tokenizer.ggml.scores") + struct.pack("<IIQ", 9, 6, 2**40) + bytes(64), 1),  # 2**40 floats
    _gguf(_s(b"tokenizer.ggml.scores") + struct.pack("<IIQ", 9, 6, 2**63) + bytes(64), 1),
    _gguf(_s(b"a") + struct.pack("<II", 4, 1), 2**40),                                     # 2**40 key/values
    _gguf(_s(b"a") + struct.pack("<II", 4, 1), 1, 2**63),                                  # 2**63 tensors
    _gguf(_s(b"a") + struct.pack("<II", 4, 1) + _s(b"t") + struct.pack("<I4Q", 4, 2**40, 2**40, 1, 1)
          + struct.pack("<IQ", 0, 0), 1, 1),                                               # a 2**80-element tensor
], ids=["key", "string", "string_array", "f32_array", "array_2_63", "n_kv", "n_tensors", "dims"])
def test_gguf_claims_are_not_allocated(raw):
    h = harness("gguf")
    with pytest.raises(ModelError):
        from llamax.model import Model

        p = h.scratch() / "claim.gguf"
        p.write_bytes(raw)
        Model.load(p)
    h.load(raw)   # again under tracemalloc: at most MAX_ALLOC traced


def test_documented_errors_are_the_library_classes():
    # the harnesses accept exactly these classes: they must be what API.md says
    assert issubclass(StateError, ValueError) and issubclass(BatchError, ValueError)
