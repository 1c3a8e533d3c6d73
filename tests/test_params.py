"""Tests of llamax.params: ContextParams validation and llama_context's derivations."""
from __future__ import annotations

import dataclasses
import logging
import os

import pytest

from llamax.dtypes import CACHE_TYPES
from llamax.params import ContextParams, resolve_n_threads


def cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


# ----------------------------------------------------------------------------------------------
# construction and validation


def test_defaults():
    p = ContextParams()
    assert (p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max) == (0, 2048, 512, 1)
    assert p.kv_unified and p.flash_attn and not p.swa_full
    assert (p.type_k, p.type_v, p.n_threads) == ("f16", "f16", None)
    assert p.n_ctx_seq == 0 and not p.is_derived
    assert p.n_stream == 1


def test_frozen():
    p = ContextParams()
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.n_ctx = 5  # type: ignore[misc]


@pytest.mark.parametrize("t", CACHE_TYPES)
def test_cache_types(t):
    p = ContextParams(type_k=t, type_v=t)
    assert p.type_k == p.type_v == t


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(type_k="q5_0"), ValueError, "type_k = 'q5_0'"),
        (dict(type_v="bf16"), ValueError, "type_v = 'bf16'"),
        (dict(n_seq_max=0), ValueError, r"n_seq_max = 0 is outside \[1, 256\]"),
        (dict(n_seq_max=257), ValueError, "n_seq_max = 257"),
        (dict(n_ctx=-1), ValueError, "n_ctx = -1"),
        (dict(n_batch=0), ValueError, "n_batch = 0"),
        (dict(n_ubatch=-1), ValueError, "n_ubatch = -1"),
        (dict(n_threads=0), ValueError, "n_threads = 0"),
        (dict(n_threads=-2), ValueError, "n_threads = -2"),
        (dict(n_threads=True), TypeError, "n_threads"),
        (dict(n_threads=2.0), TypeError, "n_threads"),
        (dict(n_ctx=1.5), TypeError, "n_ctx"),
        (dict(n_batch=True), TypeError, "n_batch"),
        (dict(kv_unified=1), TypeError, "kv_unified"),
        (dict(type_v="q8_0", flash_attn=False), ValueError, "quantized V cache requires flash_attn"),
        (dict(type_v="q4_0", flash_attn=False), ValueError, "quantized V cache requires flash_attn"),
    ],
)
def test_invalid(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        ContextParams(**kwargs)


def test_quantized_k_without_flash_attn_is_allowed():
    # llama.cpp only refuses a quantized V cache without flash attention
    p = ContextParams(type_k="q8_0", type_v="f16", flash_attn=False)
    assert p.type_k == "q8_0"
    ContextParams(type_k="q4_0", type_v="f32", flash_attn=False)


def test_n_seq_max_bounds_accepted():
    assert ContextParams(n_seq_max=1).n_seq_max == 1
    assert ContextParams(n_seq_max=256, kv_unified=False).n_stream == 256


# ----------------------------------------------------------------------------------------------
# n_threads (scikit-learn semantics)


def test_resolve_n_threads():
    assert resolve_n_threads(None) == cores()
    assert resolve_n_threads(-1) == cores()
    assert resolve_n_threads(1) == 1
    assert resolve_n_threads(3 * cores()) == 3 * cores()  # oversubscription is the caller's choice
    for bad in (0, -2, -100):
        with pytest.raises(ValueError):
            resolve_n_threads(bad)
    for bad in (1.0, "2", False):
        with pytest.raises(TypeError):
            resolve_n_threads(bad)  # type: ignore[arg-type]
    assert ContextParams(n_threads=None).n_threads_resolved == cores()
    assert ContextParams(n_threads=-1).n_threads_resolved == cores()
    assert ContextParams(n_threads=2).n_threads_resolved == 2


# ----------------------------------------------------------------------------------------------
# derivations (llama_context's constructor)


def test_n_ctx_zero_takes_n_ctx_train():
    d = ContextParams().derive(n_ctx_train=8192)
    assert (d.n_ctx, d.n_ctx_seq, d.n_batch, d.n_ubatch) == (8192, 8192, 2048, 512)
    assert d.is_derived and d.n_stream == 1
    # padded too
    d = ContextParams().derive(n_ctx_train=1000)
    assert d.n_ctx == 1024


@pytest.mark.parametrize("n_ctx, want", [(1, 256), (256, 256), (257, 512), (1000, 1024), (4096, 4096), (4097, 4352)])
def test_n_ctx_padded_to_256(n_ctx, want):
    d = ContextParams(n_ctx=n_ctx).derive(n_ctx_train=100000)
    assert d.n_ctx == want and d.n_ctx_seq == want


def test_both_zero_is_an_error():
    with pytest.raises(ValueError, match="n_ctx and n_ctx_train cannot both be zero"):
        ContextParams().derive(n_ctx_train=0)
    with pytest.raises(ValueError):
        ContextParams().derive(n_ctx_train=-1)


@pytest.mark.parametrize(
    "n_ctx, n_seq_max, n_ctx_seq, n_ctx_out, warned",
    [
        (4096, 8, 512, 4096, False),  # divides evenly
        (3000, 8, 512, 4096, True),  # pad 3072 -> 384 per seq -> pad 512 -> 4096
        (32768, 10, 3328, 33280, True),  # 3276 -> 3328 (llama.cpp's "rounding down to 33280")
        (1000, 3, 512, 1536, True),  # pad 1024 -> 341 -> 512
        (256, 256, 256, 65536, True),  # 1 cell per seq -> pad 256
        (2048, 1, 2048, 2048, False),
    ],
)
def test_non_unified_rounding(caplog, n_ctx, n_seq_max, n_ctx_seq, n_ctx_out, warned):
    p = ContextParams(n_ctx=n_ctx, n_seq_max=n_seq_max, kv_unified=False)
    with caplog.at_level(logging.WARNING, logger="llamax"):
        d = p.derive(n_ctx_train=1 << 20)
    assert (d.n_ctx_seq, d.n_ctx, d.n_stream) == (n_ctx_seq, n_ctx_out, n_seq_max)
    assert d.n_ctx == d.n_ctx_seq * d.n_seq_max
    msg = f"n_ctx is not divisible by n_seq_max - rounding down to {n_ctx_out}"
    assert (msg in caplog.text) == warned
    if warned:
        rec = [r for r in caplog.records if "not divisible" in r.getMessage()][0]
        assert rec.levelno == logging.WARNING and rec.name == "llamax"


def test_unified_keeps_n_ctx_for_every_sequence():
    d = ContextParams(n_ctx=3000, n_seq_max=8, kv_unified=True).derive(n_ctx_train=4096)
    assert (d.n_ctx, d.n_ctx_seq, d.n_stream) == (3072, 3072, 1)


def test_n_batch_clamped_with_causal_attention():
    d = ContextParams(n_ctx=100).derive(n_ctx_train=4096)
    # clamped to the n_ctx asked for (llama.cpp clamps before padding), then n_ubatch follows
    assert (d.n_ctx, d.n_batch, d.n_ubatch) == (256, 100, 100)
    d = ContextParams(n_ctx=1024).derive(n_ctx_train=4096)
    assert (d.n_batch, d.n_ubatch) == (1024, 512)
    d = ContextParams(n_ctx=100).derive(n_ctx_train=4096, causal_attn=False)
    assert (d.n_batch, d.n_ubatch) == (2048, 512)


@pytest.mark.parametrize(
    "n_batch, n_ubatch, want_b, want_ub",
    [(2048, 512, 2048, 512), (512, 0, 512, 512), (256, 512, 256, 256), (64, 64, 64, 64), (8192, 0, 4096, 4096)],
)
def test_n_ubatch(n_batch, n_ubatch, want_b, want_ub):
    d = ContextParams(n_ctx=4096, n_batch=n_batch, n_ubatch=n_ubatch).derive(n_ctx_train=4096)
    assert (d.n_batch, d.n_ubatch) == (want_b, want_ub)


def test_capacity_messages(caplog):
    with caplog.at_level(logging.INFO, logger="llamax"):
        ContextParams(n_ctx=2048).derive(n_ctx_train=8192)
    recs = [r for r in caplog.records if "full capacity" in r.getMessage()]
    assert len(recs) == 1
    assert (
        recs[0].getMessage()
        == "llama_context: n_ctx_seq (2048) < n_ctx_train (8192) -- the full capacity of the model will not be utilized"
    )
    assert recs[0].levelno == logging.INFO  # llama.cpp logs this one at INFO
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="llamax"):
        ContextParams(n_ctx=9000).derive(n_ctx_train=8192)
    recs = [r for r in caplog.records if "overflow" in r.getMessage()]
    assert len(recs) == 1 and recs[0].levelno == logging.WARNING
    assert "n_ctx_seq (9216) > n_ctx_train (8192) -- possible training context overflow" in recs[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="llamax"):
        ContextParams().derive(n_ctx_train=8192)
    assert "full capacity" not in caplog.text and "overflow" not in caplog.text
    # non-unified: compares the per-sequence size
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="llamax"):
        ContextParams(n_ctx=8192, n_seq_max=4, kv_unified=False).derive(n_ctx_train=8192)
    assert "n_ctx_seq (2048) < n_ctx_train (8192)" in caplog.text


def test_derived_values_logged_at_info(caplog):
    with caplog.at_level(logging.INFO, logger="llamax"):
        ContextParams(n_ctx=512).derive(n_ctx_train=512)
    for key in ("n_seq_max", "n_ctx ", "n_ctx_seq", "n_batch", "n_ubatch", "kv_unified"):
        assert key in caplog.text


def test_derive_is_idempotent_and_keeps_other_fields():
    p = ContextParams(n_ctx=3000, n_seq_max=8, kv_unified=False, type_k="q8_0", type_v="q4_0", n_threads=2)
    d = p.derive(n_ctx_train=4096)
    assert d.derive(n_ctx_train=4096) == d
    assert (d.type_k, d.type_v, d.flash_attn, d.n_threads, d.n_seq_max) == ("q8_0", "q4_0", True, 2, 8)
    assert p.n_ctx == 3000 and p.n_ctx_seq == 0  # the original is untouched


def test_replace_on_derived_drops_derivation():
    d = ContextParams(n_ctx=512).derive(n_ctx_train=512)
    r = dataclasses.replace(d, n_threads=1)
    assert r.n_ctx_seq == 0 and not r.is_derived and r.n_ctx == 512
