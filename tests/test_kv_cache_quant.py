"""The KV cache with quantized blocks (q8_0, q4_0) as a user drives it: sizes, the rows written,
attention over quantized K/V against float attention on what the cache holds, the Hadamard
rotation, K-shift of quantized K, and the configurations llama.cpp refuses."""
import logging
import math

import numpy as np
import pytest
from helpers import reference_dir

from llamax import Batch, KVCache, RoPE
from llamax._native import hadamard as native_had
from llamax._native import quants as native_quants
from llamax._native import rope as native_rope
from llamax.params import ContextParams

QTYPES = ["q8_0", "q4_0"]
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18}
# Largest |attend - float attention on the dequantized cache| / max|v|: the kernel rounds q to q8_0
# for the integer dots with a quantized K (relative error <= 1/254 per value, ~1e-3 on a score of
# d = 64 random terms, times the 1/8 scale); 1e-2 leaves margin while a wrong row or block shows as ~1.
ATTN_TOL = 1e-2


def plan_store(kv, batch, rng):
    """Plan and store random K/V in every layer; returns [(ubatch, k, v)] of layer 0 per ubatch."""
    out = []
    for ub in kv.plan(batch, n_ubatch=64):
        for il in range(kv.n_layer):
            k = rng.standard_normal((ub.n_tokens, kv.n_head_kv, kv.head_dim)).astype(np.float32)
            v = rng.standard_normal((ub.n_tokens, kv.n_head_kv, kv.head_dim_v)).astype(np.float32)
            kv.store(il, ub, k, v)
            if il == 0:
                out.append((ub, k, v))
    return out


def cached_rows(kv, il, which, cells, stream=0):
    """What the cache holds for `cells`, dequantized and rotated back: [n, n_head_kv, d]."""
    buf, t, rot, d = ((kv.k[il], kv.type_k, kv.rot_k, kv.head_dim) if which == "k"
                      else (kv.v[il], kv.type_v, kv.rot_v, kv.head_dim_v))
    rows = buf[stream][cells]
    if t in QTYPES:
        x = native_quants.dequantize(t, np.ascontiguousarray(rows), (len(cells), kv.n_head_kv * d))
    else:
        x = rows.reshape(len(cells), -1).astype(np.float32)
    x = np.ascontiguousarray(x, dtype=np.float32)
    if rot:
        native_had.hadamard_rows(x, rot)
    return x.reshape(len(cells), kv.n_head_kv, d)


def float_attention(q, k, v, scale):
    """Causal attention of q [n, n_head, d] over k/v [n, n_head_kv, d] of the same n tokens."""
    n, n_head, _ = q.shape
    g = n_head // k.shape[1]
    out = np.empty((n, n_head, v.shape[2]), np.float32)
    for t in range(n):
        for h in range(n_head):
            s = k[:t + 1, h // g] @ q[t, h] * scale
            w = np.exp(s - s.max())
            out[t, h] = (w / w.sum()) @ v[:t + 1, h // g]
    return out


@pytest.mark.parametrize("t", QTYPES)
def test_bytes_per_value_and_summary_line(t, caplog):
    with caplog.at_level(logging.INFO, logger="llamax"):
        kv = KVCache(2, 3, 64, 512, type_k=t, type_v=t)
    per_layer = 512 * 3 * 64 // 32 * BLOCK_BYTES[t]
    assert kv.breakdown() == {"k": 2 * per_layer, "v": 2 * per_layer}
    assert f"K ({t}):" in caplog.text and f"V ({t}):" in caplog.text
    assert kv.k[0].dtype == np.uint8 and kv.k[0].shape == (1, 512, 3 * 64 // 32 * BLOCK_BYTES[t])
    mixed = KVCache(1, 1, 64, 256, type_k=t, type_v="f16")
    assert mixed.breakdown() == {"k": 256 * 2 * BLOCK_BYTES[t], "v": 256 * 64 * 2}


@pytest.mark.parametrize("t", QTYPES)
def test_summary_line_is_llama_cpps_for_smollm2(t):
    """SmolLM2-135M's cache (30 layers, 3 kv heads of 64) at 2048 cells, as llama.cpp logged it."""
    logged = [ln.split("llama_kv_cache: ", 1)[1] for ln in
              (reference_dir("smollm2-135m-instruct-q4_1") / "kv_log.txt").read_text().splitlines()
              if f"K ({t})" in ln]
    assert logged, f"no {t} line in kv_log.txt"
    assert KVCache(30, 3, 64, 2048, type_k=t, type_v=t).summary() == logged[0].rstrip()


def test_llama_cpp_refusals_are_clear_errors():
    with pytest.raises(ValueError, match="requires flash attention"):
        KVCache(1, 1, 64, 16, type_v="q8_0", v_trans=True)
    with pytest.raises(ValueError, match="multiple of 32"):
        KVCache(1, 1, 48, 16, type_k="q4_0")
    with pytest.raises(ValueError, match="not in"):
        KVCache(1, 1, 64, 16, type_k="q5_1")
    with pytest.raises(ValueError, match="flash_attn"):
        ContextParams(type_v="q4_0", flash_attn=False)
    KVCache(1, 1, 64, 16, type_k="q8_0", v_trans=True)  # quantized K without flash attention is fine


def test_rotation_follows_llama_cpp(monkeypatch):
    assert KVCache(1, 1, 64, 16, type_k="q8_0", type_v="q4_0").rot_k == 64
    assert KVCache(1, 1, 64, 16, type_k="q8_0", type_v="q4_0").rot_v == 64
    assert KVCache(1, 1, 128, 16, type_k="q8_0", type_v="q8_0").rot_k == 128
    assert KVCache(1, 1, 128, 16, type_k="q8_0", type_v="q8_0").rot_v == 64
    assert KVCache(1, 1, 96, 16, type_k="q8_0", type_v="q8_0").rot_k == 0   # 96 % 64 != 0
    assert KVCache(1, 1, 64, 16).rot_k == 0                                  # f16: no rotation
    assert KVCache(1, 1, 64, 16, type_k="q8_0", type_v="f16").rot_v == 0
    assert KVCache(1, 1, 64, 16, type_k="q8_0", rotate=False).rot_k == 0
    monkeypatch.setenv("LLAMA_ATTN_ROT_DISABLE", "1")
    assert KVCache(1, 1, 64, 16, type_k="q8_0", type_v="q8_0").rot_k == 0


@pytest.mark.parametrize("rotate", [True, False])
@pytest.mark.parametrize("tk,tv", [("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q8_0", "f16"), ("f16", "q4_0")])
def test_rows_written_are_the_quantized_rotated_k_and_v(tk, tv, rotate):
    rng = np.random.default_rng(3)
    kv = KVCache(2, 2, 64, 64, type_k=tk, type_v=tv, rotate=rotate)
    (ub, k, v), = plan_store(kv, Batch.one(list(range(20))), rng)
    for t, buf, x, rot in ((tk, kv.k[0], k, kv.rot_k), (tv, kv.v[0], v, kv.rot_v)):
        if t not in QTYPES:
            continue
        rows = np.ascontiguousarray(x.reshape(20, -1))
        if rot:
            native_had.hadamard_rows(rows, rot)
        expect = native_quants.quantize(t, rows)
        np.testing.assert_array_equal(buf[0][:20], np.asarray(expect).reshape(20, -1))
        assert not buf[0][20:].any()


@pytest.mark.parametrize("rotate", [True, False])
@pytest.mark.parametrize("tk,tv", [("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q8_0", "f16"), ("f16", "q8_0"),
                                   ("q4_0", "f32")])
def test_attention_over_quantized_cells_matches_float_attention_on_their_values(tk, tv, rotate):
    rng = np.random.default_rng(4)
    n = 24
    k = rng.standard_normal((n, 2, 64)).astype(np.float32)
    v = rng.standard_normal((n, 2, 64)).astype(np.float32)
    q = rng.standard_normal((n, 6, 64)).astype(np.float32)
    kv = KVCache(1, 2, 64, 64, type_k=tk, type_v=tv, rotate=rotate)
    for ub in kv.plan(Batch.one(list(range(n))), n_ubatch=64):
        kv.store(0, ub, k, v)
        out = kv.attend(0, ub, q)
    kd, vd = cached_rows(kv, 0, "k", np.arange(n)), cached_rows(kv, 0, "v", np.arange(n))
    ref = float_attention(q, kd, vd, 1 / math.sqrt(64))
    assert np.abs(out - ref).max() <= ATTN_TOL * np.abs(vd).max()
    exact = float_attention(q, k, v, 1 / math.sqrt(64))  # and near the unquantized result
    assert np.abs(out - exact).max() <= (0.1 if "q4_0" in (tk, tv) else 0.03) * np.abs(v).max()


def test_rotation_lowers_q4_0_error_on_outlier_channels():
    """What llama.cpp rotates for: K with a few large channels quantizes badly block-wise."""
    rng = np.random.default_rng(6)
    n, errs = 32, {}
    k = rng.standard_normal((n, 1, 64)).astype(np.float32)
    k[:, :, 5] *= 30.0
    k[:, :, 40] *= 20.0
    v = rng.standard_normal((n, 1, 64)).astype(np.float32)
    q = rng.standard_normal((n, 2, 64)).astype(np.float32)
    exact = float_attention(q, k, v, 1 / 8)
    for rotate in (True, False):
        kv = KVCache(1, 1, 64, 64, type_k="q4_0", type_v="f32", rotate=rotate)
        for ub in kv.plan(Batch.one(list(range(n))), n_ubatch=64):
            kv.store(0, ub, k, v)
            out = kv.attend(0, ub, q)
        errs[rotate] = float(np.abs(out - exact).mean())
    assert errs[True] < 0.7 * errs[False], errs


@pytest.mark.parametrize("rotate", [True, False])
@pytest.mark.parametrize("t", QTYPES)
def test_k_shift_of_quantized_k_matches_quantizing_k_at_the_new_positions(t, rotate):
    rope = RoPE(64, freq_base=10000.0, kind="norm")
    rng = np.random.default_rng(7)
    raw = rng.standard_normal((12, 2, 64)).astype(np.float32)
    kv = KVCache(1, 2, 64, 32, type_k=t, type_v="f16", rope=rope, rotate=rotate)
    for ub in kv.plan(Batch.one(list(range(12)))):
        k = raw.copy()
        native_rope.rope_f32(k, ub.pos, 64, 10000.0, 1.0, 0, 1)
        kv.store(0, ub, k, k)
    before = cached_rows(kv, 0, "k", np.arange(12))
    kv.seq_rm(0, 0, 4)
    kv.seq_add(0, 4, -1, -4)  # positions 4..11 -> 0..7
    assert kv.update()
    pos = kv.meta.streams[0].pos_view()[4:12].astype(np.int32)
    expect = raw[4:12].copy()
    native_rope.rope_f32(expect, pos, 64, 10000.0, 1.0, 0, 1)
    got = cached_rows(kv, 0, "k", np.arange(4, 12))
    # one more quantization round trip than a fresh store: within the type's block error
    tol = {"q8_0": 0.03, "q4_0": 0.5}[t] * np.abs(expect).max()
    assert np.abs(got - expect).max() <= tol
    assert np.abs(got - expect).max() < np.abs(before[4:12] - expect).max()  # it really moved
