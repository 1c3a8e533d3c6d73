"""Tests of y = x @ W.T over ggml weight rows (csrc/matmul via llamax._native.matmul).

Oracles, in float64 numpy:
  - act="q8" (ggml's product): the activations are quantized exactly as ggml does (the numpy
    quantizers of test_quants_blocks), then y_emul = x^ @ W.T with W dequantized by numpy, plus
    the one place ggml does not use x^ itself: the q8_1 block sum s = f16(d * sum q) of the
    q4_1 / q5_1 min term. The C reference must match y_emul, and the fast kernels the reference,
    within LX_MM_ERR(n_terms) * sum|terms| (err_factor; see matmul.h), where sum|terms| <=
    (|a| + |b|) @ |x^|, a / b the scaled-quant / offset parts of W.
  - act="f32": y = x @ W.T (x as is) within the same bound with sum|terms| = |W| @ |x|.
  - against plain x @ W.T, act="q8" is within the activation-rounding bound
    |W| @ |x - x^| (+ the s rounding) + the accumulation bound.
Every SIMD level of this CPU, n_threads 1 vs 2 bit-identical, odd shapes, errors, and real
SmolLM2 tensors when the GGUF is on this machine.
"""
from __future__ import annotations

import numpy as np
import pytest
from test_quants_blocks import (
    gguf,
    gguf_dequantize,
    np_dequantize,
    np_dequantize_parts,
    np_quantize_q8_0,
    np_quantize_q8_K,
    random_blocks,
)

from llamax._native import cpu
from llamax._native import matmul as M
from llamax._native import quants as Q

INT_TYPES = [Q.TYPE_Q4_0, Q.TYPE_Q4_1, Q.TYPE_Q5_0, Q.TYPE_Q5_1, Q.TYPE_Q8_0, Q.TYPE_Q4_K, Q.TYPE_Q5_K,
             Q.TYPE_Q6_K]
FLOAT_ONLY = [Q.TYPE_F32, Q.TYPE_F16, Q.TYPE_BF16, Q.TYPE_Q2_K, Q.TYPE_Q3_K]
ALL_TYPES = INT_TYPES + FLOAT_ONLY
LEVELS = [lv for lv in cpu.levels() if lv != cpu.AVX512]  # AVX512 without VNNI runs AVX2
U = 2.0 ** -24


def name(t: int) -> str:
    return Q.TYPE_NAMES[t]


@pytest.fixture(params=LEVELS, ids=lambda lv: cpu.LEVEL_NAMES[lv])
def level(request):
    cpu.set_simd_level(request.param)
    yield request.param
    cpu.set_simd_level(-1)


def weights(t: int, n_out: int, n_in: int, rng: np.random.Generator) -> np.ndarray:
    """uint8 [n_out, row_bytes]: random blocks (finite f16 scales)."""
    bs = Q.block_size(t)
    return random_blocks(t, n_out * n_in // bs, rng).reshape(n_out, -1)


def w_parts(t: int, raw: np.ndarray, n_out: int, n_in: int) -> tuple[np.ndarray, np.ndarray]:
    """(W, |a| + |b|) float64 [n_out, n_in]: the dequantized weight and its magnitude bound."""
    a, b = np_dequantize_parts(t, raw.reshape(-1).view(np.uint8).reshape(-1, Q.block_bytes(t)))
    w = a if b is None else a + b
    mag = np.abs(a.astype(np.float64)) + (0 if b is None else np.abs(b.astype(np.float64)))
    return w.astype(np.float64).reshape(n_out, n_in), mag.reshape(n_out, n_in)


def x_hat(dt: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """ggml's quantized activations as float64 [n_tok, n_in], and for q8_1 the per-block
    (s - d * sum q) [n_tok, n_in/32] that its min term uses instead of sum x^."""
    rows, corr = [], []
    for r in x:
        if dt == Q.TYPE_Q8_K:
            d, qs, _ = np_quantize_q8_K(r)
            rows.append((d.astype(np.float64)[:, None] * qs).reshape(-1))
        else:
            d16, qs, s16 = np_quantize_q8_0(r)
            d = d16.astype(np.float64)[:, None]
            rows.append((d * qs).reshape(-1))
            corr.append(s16.astype(np.float64) - d[:, 0] * qs.astype(np.int64).sum(axis=1))
    return np.array(rows), (np.array(corr) if dt == Q.TYPE_Q8_1 else None)


def q8_oracle(t: int, raw: np.ndarray, x: np.ndarray):
    """(y_emul, mag, act_err) float64 [n_tok, n_out] for act="q8" (see the module docstring)."""
    n_out, n_in = raw.shape[0], x.shape[1]
    w, wmag = w_parts(t, raw, n_out, n_in)
    dt = M.dot_type(t, "q8")
    xh, corr = x_hat(dt, x)
    y = xh @ w.T
    mag = np.abs(xh) @ wmag.T
    act_err = np.abs(x.astype(np.float64) - xh) @ np.abs(w).T
    if corr is not None:                       # m_w * (s - d sum q) per block
        m = np.ascontiguousarray(raw).view(np.uint8).reshape(n_out, -1, Q.block_bytes(t))[:, :, 2:4]
        m = np.ascontiguousarray(m).view(np.float16)[..., 0].astype(np.float64)   # [n_out, nb]
        y += corr @ m.T
        mag += np.abs(corr) @ np.abs(m).T
        act_err += np.abs(corr) @ np.abs(m).T
    return y, mag, act_err


def tol(t: int, n_in: int, mag: np.ndarray, act: str = "q8") -> np.ndarray:
    """LX_MM_ERR(n_terms) * sum|terms|, plus u for W's own rounding in the numpy oracle."""
    return (M.err_factor(t, n_in, act) + 2 * U) * mag + 1e-30


def check_close(got, want, bound, what=""):
    err = np.abs(got.astype(np.float64) - want)
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert np.all(err <= bound), f"{what}: |err| {err[worst]:.3g} > bound {bound[worst]:.3g} at {worst}"


# ---- integer path (act="q8") -------------------------------------------------------------------

@pytest.mark.parametrize("t", INT_TYPES, ids=name)
def test_ref_matches_q8_oracle(t):
    rng = np.random.default_rng(100 + t)
    n_in = 512
    raw = weights(t, 21, n_in, rng)
    x = (rng.standard_normal((5, n_in)) * rng.uniform(0.1, 10)).astype(np.float32)
    y, mag, _ = q8_oracle(t, raw, x)
    ref = M.mul_mat_ref(raw, t, x)
    check_close(ref, y, tol(t, n_in, mag), f"{name(t)} ref")


@pytest.mark.parametrize("t", INT_TYPES, ids=name)
@pytest.mark.parametrize("n_tok", [1, 2, 3, 4, 5, 9, 16])
def test_fast_matches_ref(t, n_tok, level):
    rng = np.random.default_rng(200 + 31 * t + n_tok)
    n_in, n_out = 768, 37
    raw = weights(t, n_out, n_in, rng)
    x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
    x[:, :32] *= 50                             # an outlier block
    ref = M.mul_mat_ref(raw, t, x)
    got = M.mul_mat(raw, t, x, n_threads=2)
    _, mag, _ = q8_oracle(t, raw, x)
    check_close(got, ref.astype(np.float64), tol(t, n_in, mag), f"{name(t)} simd{level}")
    if level == 0:                              # the portable path is the reference's order
        np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("t", INT_TYPES, ids=name)
def test_q8_vs_exact_product(t):
    """Plain x @ W.T: off by the activation rounding only (llama.cpp's own error)."""
    rng = np.random.default_rng(300 + t)
    n_in = 1024
    raw = weights(t, 19, n_in, rng)
    x = rng.standard_normal((3, n_in)).astype(np.float32)
    w = np_dequantize(t, raw, (19, n_in)).astype(np.float64)
    _, mag, act_err = q8_oracle(t, raw, x)
    got = M.mul_mat(raw, t, x)
    check_close(got, x.astype(np.float64) @ w.T, act_err + tol(t, n_in, mag), name(t))


# ---- float path (act="f32" and the types without an integer dot) --------------------------------

@pytest.mark.parametrize("t", ALL_TYPES, ids=name)
@pytest.mark.parametrize("n_tok", [1, 3, 4, 6])
def test_f32_path(t, n_tok, level):
    rng = np.random.default_rng(400 + 7 * t + n_tok)
    n_in, n_out = 3 * 256 + (0 if Q.block_size(t) > 1 else 5), 23   # f32/f16/bf16: n_in % 8 != 0
    n_in = n_in if Q.block_size(t) == 1 else n_in - n_in % Q.block_size(t)
    raw = weights(t, n_out, n_in, rng)
    x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
    w, _ = w_parts(t, raw, n_out, n_in)
    want = x.astype(np.float64) @ w.T
    bound = tol(t, n_in, np.abs(x.astype(np.float64)) @ np.abs(w).T, "f32")
    got = M.mul_mat(raw, t, x, act="f32", n_threads=2)
    check_close(got, want, bound, f"{name(t)} f32 simd{level}")
    check_close(M.mul_mat_ref(raw, t, x, act="f32"), want, bound, f"{name(t)} f32 ref")
    if t in FLOAT_ONLY:                          # act is moot: always the float path
        np.testing.assert_array_equal(M.mul_mat(raw, t, x, act="q8", n_threads=2), got)
        assert M.dot_type(t, "q8") == 0


def test_f32_tiles_span_long_rows():
    """n_in over several LX_MM_TILE tiles, with a partial last tile."""
    rng = np.random.default_rng(5)
    t, n_in = Q.TYPE_Q4_K, 3 * M.TILE + 256
    raw = weights(t, 9, n_in, rng)
    x = rng.standard_normal((5, n_in)).astype(np.float32)
    w, _ = w_parts(t, raw, 9, n_in)
    got = M.mul_mat(raw, t, x, act="f32")
    check_close(got, x.astype(np.float64) @ w.T, tol(t, n_in, np.abs(x.astype(np.float64)) @ np.abs(w).T, "f32"))


def test_plain_weight_arrays():
    """F32 / F16 weights given as float arrays [n_out, n_in] or as their bytes."""
    rng = np.random.default_rng(6)
    w = rng.standard_normal((13, 40)).astype(np.float32)
    x = rng.standard_normal((2, 40)).astype(np.float32)
    want = x.astype(np.float64) @ w.astype(np.float64).T
    for arr, t in [(w, Q.TYPE_F32), (w.view(np.uint8), Q.TYPE_F32)]:
        check_close(M.mul_mat(arr, t, x), want, tol(t, 40, np.abs(x) @ np.abs(w).T, "f32"))
    h = w.astype(np.float16)
    want16 = x.astype(np.float64) @ h.astype(np.float64).T
    for arr in (h, h.view(np.uint16), h.view(np.uint8)):
        check_close(M.mul_mat(arr, Q.TYPE_F16, x), want16, tol(1, 40, np.abs(x) @ np.abs(h.astype(np.float64)).T, "f32"))


# ---- threads, shapes ------------------------------------------------------------------------------

@pytest.mark.parametrize("t", ALL_TYPES, ids=name)
@pytest.mark.parametrize("act", ["q8", "f32"])
def test_threads_give_identical_bits(t, act):
    rng = np.random.default_rng(600 + t)
    n_in = 512
    raw = weights(t, 67, n_in, rng)
    x = rng.standard_normal((6, n_in)).astype(np.float32)
    one = M.mul_mat(raw, t, x, n_threads=1, act=act)
    for nth in (2, 3, 5, None, -1):
        np.testing.assert_array_equal(M.mul_mat(raw, t, x, n_threads=nth, act=act), one)


@pytest.mark.parametrize("n_out", [1, 15, 16, 17, 33])
@pytest.mark.parametrize("n_tok", [1, 5, 8, 17])
def test_odd_shapes(n_out, n_tok):
    rng = np.random.default_rng(n_out * 100 + n_tok)
    for t in (Q.TYPE_Q4_1, Q.TYPE_Q6_K):
        n_in = 256
        raw = weights(t, n_out, n_in, rng)
        x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
        ref = M.mul_mat_ref(raw, t, x)
        out = np.full((n_tok, n_out), np.nan, np.float32)
        got = M.mul_mat(raw, t, x, out=out, n_threads=2)
        assert got is out
        _, mag, _ = q8_oracle(t, raw, x)
        check_close(got, ref.astype(np.float64), tol(t, n_in, mag), f"{name(t)} {n_tok}x{n_out}")


def test_empty_shapes():
    raw = np.zeros((3, 20), np.uint8)
    assert M.mul_mat(raw, Q.TYPE_Q4_1, np.zeros((0, 32), np.float32)).shape == (0, 3)
    assert M.mul_mat(np.zeros((0, 20), np.uint8), Q.TYPE_Q4_1, np.ones((2, 32), np.float32)).shape == (2, 0)
    np.testing.assert_array_equal(M.mul_mat(np.zeros((3, 0), np.uint8), Q.TYPE_Q4_1,
                                            np.zeros((2, 0), np.float32)), np.zeros((2, 3), np.float32))


def test_errors():
    raw = np.zeros((4, 20), np.uint8)
    x = np.zeros((2, 32), np.float32)
    with pytest.raises(ValueError, match="not a weight type"):
        M.mul_mat(raw, Q.TYPE_Q8_1, x)
    with pytest.raises(ValueError, match="not a weight type"):
        M.mul_mat(raw, 4, x)
    with pytest.raises(ValueError, match="takes 20 bytes, w rows hold 18"):
        M.mul_mat(np.zeros((4, 18), np.uint8), Q.TYPE_Q4_1, x)
    with pytest.raises(ValueError, match="multiple of Q4_1's block size 32"):
        M.mul_mat(raw, Q.TYPE_Q4_1, np.zeros((2, 40), np.float32))
    with pytest.raises(ValueError, match="x must be"):
        M.mul_mat(raw, Q.TYPE_Q4_1, x.astype(np.float64))
    with pytest.raises(ValueError, match="x must be"):
        M.mul_mat(raw, Q.TYPE_Q4_1, np.zeros(32, np.float32))
    with pytest.raises(ValueError, match="x must be"):
        M.mul_mat(raw, Q.TYPE_Q4_1, np.zeros((2, 64), np.float32)[:, ::2])
    with pytest.raises(ValueError, match="w must be uint8"):
        M.mul_mat(raw.astype(np.int8), Q.TYPE_Q4_1, x)
    with pytest.raises(ValueError, match="w must be a C-contiguous"):
        M.mul_mat(np.zeros((4, 40), np.uint8)[:, ::2], Q.TYPE_Q4_1, x)
    with pytest.raises(ValueError, match=r"shape \(2, 4\)"):
        M.mul_mat(raw, Q.TYPE_Q4_1, x, out=np.zeros((4, 2), np.float32))
    with pytest.raises(ValueError, match="must not overlap"):
        xx = np.zeros((2, 32), np.float32)
        M.mul_mat(np.zeros((32, 20), np.uint8), Q.TYPE_Q4_1, xx, out=xx[:, :32])
    with pytest.raises(ValueError, match="act must be"):
        M.mul_mat(raw, Q.TYPE_Q4_1, x, act="f16")
    with pytest.raises(ValueError):
        M.mul_mat(raw, Q.TYPE_Q4_1, x, n_threads=0)


def test_dot_types_follow_ggml():
    assert {t: M.dot_type(t) for t in INT_TYPES} == {
        Q.TYPE_Q4_0: Q.TYPE_Q8_0, Q.TYPE_Q5_0: Q.TYPE_Q8_0, Q.TYPE_Q8_0: Q.TYPE_Q8_0,
        Q.TYPE_Q4_1: Q.TYPE_Q8_1, Q.TYPE_Q5_1: Q.TYPE_Q8_1,
        Q.TYPE_Q4_K: Q.TYPE_Q8_K, Q.TYPE_Q5_K: Q.TYPE_Q8_K, Q.TYPE_Q6_K: Q.TYPE_Q8_K}
    assert all(M.dot_type(t, "f32") == 0 for t in ALL_TYPES)


# ---- real tensors ----------------------------------------------------------------------------------

def test_smollm2_tensors(smollm2_gguf):
    r = gguf.GGUFReader(str(smollm2_gguf))
    tensors = {t.name: t for t in r.tensors}
    rng = np.random.default_rng(9)
    for nm, rows in [("blk.0.attn_q.weight", None), ("blk.0.ffn_down.weight", None),
                     ("blk.3.attn_k.weight", None), ("token_embd.weight", 300)]:
        t = tensors[nm]
        ty = int(t.tensor_type)
        raw = np.asarray(t.data)
        raw = raw if rows is None else raw[:rows]
        n_out, n_in = raw.shape[0], int(t.shape[0])
        w = gguf_dequantize(ty, raw, (n_out, n_in)).astype(np.float64)
        for n_tok in (1, 4):
            x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
            y, mag, act_err = q8_oracle(ty, raw, x)
            got = M.mul_mat(raw, ty, x)
            check_close(got, y, tol(ty, n_in, mag), nm)
            check_close(got, x.astype(np.float64) @ w.T, act_err + tol(ty, n_in, mag), nm)
            f = M.mul_mat(raw, ty, x, act="f32")
            check_close(f, x.astype(np.float64) @ w.T,
                        tol(ty, n_in, np.abs(x.astype(np.float64)) @ np.abs(w).T, "f32"), nm)


@pytest.mark.parametrize("n_in", [1, 7, 8, 64, 131])
def test_ordered_f32_product_is_exact_enough_and_the_same_bits_for_any_batch_and_threads(n_in):
    """mul_mat_f32_ordered: within float rounding of the float64 product; a row's bits do not depend on
    the other rows or on n_threads."""
    rng = np.random.default_rng(n_in)
    w = rng.standard_normal((37, n_in)).astype(np.float32)
    x = rng.standard_normal((9, n_in)).astype(np.float32)
    y = M.mul_mat_f32_ordered(w, x, n_threads=2)
    ref = x.astype(np.float64) @ w.T.astype(np.float64)
    assert np.abs(y - ref).max() <= 4 * (n_in + 8) * 2.0**-24 * (np.abs(x) @ np.abs(w).T).max()
    for rows, nt in (([3], 1), ([0, 5, 8], 3), (list(range(9)), 1)):
        assert np.array_equal(M.mul_mat_f32_ordered(w, x[rows], n_threads=nt), y[rows])
