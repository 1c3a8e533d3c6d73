"""Tests of the float product y = x @ W.T over dequantized ggml weight rows (csrc/matmul via
llamax._native.matmul): the product of the weight types the GEMM lacks (the integer products are
test_gemm's), and the ordered float32 product.

Oracle, in float64 numpy: y = x @ W.T with W dequantized by numpy; the C reference and the fast
kernels are within LX_MM_ERR(n_in) * |x| @ |W|.T of it (err_factor; see matmul.h). Every SIMD level
of this CPU, n_threads 1 vs 2 bit-identical, a row's bits independent of the other rows, odd shapes,
and errors.
"""
from __future__ import annotations

import numpy as np
import pytest
from test_quants_blocks import np_dequantize_parts, random_blocks

from llamax._native import cpu
from llamax._native import matmul as M
from llamax._native import quants as Q

INT_TYPES = [Q.TYPE_Q4_0, Q.TYPE_Q4_1, Q.TYPE_Q5_0, Q.TYPE_Q5_1, Q.TYPE_Q8_0, Q.TYPE_Q4_K, Q.TYPE_Q5_K,
             Q.TYPE_Q6_K]                 # the GEMM's; this product takes them too (W dequantized)
FLOAT_ONLY = [Q.TYPE_F32, Q.TYPE_F16, Q.TYPE_BF16, Q.TYPE_Q2_K, Q.TYPE_Q3_K]   # product.h sends these here
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


def tol(n_in: int, mag: np.ndarray) -> np.ndarray:
    """LX_MM_ERR(n_in) * sum|terms|, plus u for W's own rounding in the numpy oracle."""
    return (M.err_factor(n_in) + 2 * U) * mag + 1e-30


def check_close(got, want, bound, what=""):
    err = np.abs(got.astype(np.float64) - want)
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    assert np.all(err <= bound), f"{what}: |err| {err[worst]:.3g} > bound {bound[worst]:.3g} at {worst}"


# ---- the float product -----------------------------------------------------------------------------

@pytest.mark.parametrize("t", ALL_TYPES, ids=name)
@pytest.mark.parametrize("n_tok", [1, 3, 4, 6])
def test_float_product(t, n_tok, level):
    rng = np.random.default_rng(400 + 7 * t + n_tok)
    n_in, n_out = 3 * 256 + (0 if Q.block_size(t) > 1 else 5), 23   # f32/f16/bf16: n_in % 8 != 0
    n_in = n_in if Q.block_size(t) == 1 else n_in - n_in % Q.block_size(t)
    raw = weights(t, n_out, n_in, rng)
    x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
    w, _ = w_parts(t, raw, n_out, n_in)
    want = x.astype(np.float64) @ w.T
    bound = tol(n_in, np.abs(x.astype(np.float64)) @ np.abs(w).T)
    got = M.mul_mat(raw, t, x, n_threads=2)
    check_close(got, want, bound, f"{name(t)} simd{level}")
    check_close(M.mul_mat_ref(raw, t, x), want, bound, f"{name(t)} ref")


@pytest.mark.parametrize("t", [Q.TYPE_F16, Q.TYPE_Q3_K, Q.TYPE_Q5_1], ids=name)
def test_rows_do_not_depend_on_the_batch(t, level):
    """A token's row is the same bits alone, in any batch (tiles of LX_MM_NT tokens) and on any
    n_threads, at this level (matmul.h)."""
    rng = np.random.default_rng(450 + t)
    n_in, n_out = 1280, 37                       # three dequantized tiles, the last partial
    raw = weights(t, n_out, n_in, rng)
    x = rng.standard_normal((11, n_in)).astype(np.float32)
    full = M.mul_mat(raw, t, x, n_threads=2)
    for i in range(11):
        np.testing.assert_array_equal(M.mul_mat(raw, t, x[i:i + 1], n_threads=1), full[i:i + 1])
    np.testing.assert_array_equal(M.mul_mat(raw, t, x[3:9], n_threads=3), full[3:9])


def test_f32_tiles_span_long_rows():
    """n_in over several LX_MM_TILE tiles, with a partial last tile."""
    rng = np.random.default_rng(5)
    t, n_in = Q.TYPE_Q4_K, 3 * M.TILE + 256
    raw = weights(t, 9, n_in, rng)
    x = rng.standard_normal((5, n_in)).astype(np.float32)
    w, _ = w_parts(t, raw, 9, n_in)
    got = M.mul_mat(raw, t, x)
    check_close(got, x.astype(np.float64) @ w.T, tol(n_in, np.abs(x.astype(np.float64)) @ np.abs(w).T))


def test_plain_weight_arrays():
    """F32 / F16 weights given as float arrays [n_out, n_in] or as their bytes."""
    rng = np.random.default_rng(6)
    w = rng.standard_normal((13, 40)).astype(np.float32)
    x = rng.standard_normal((2, 40)).astype(np.float32)
    want = x.astype(np.float64) @ w.astype(np.float64).T
    for arr, t in [(w, Q.TYPE_F32), (w.view(np.uint8), Q.TYPE_F32)]:
        check_close(M.mul_mat(arr, t, x), want, tol(40, np.abs(x) @ np.abs(w).T))
    h = w.astype(np.float16)
    want16 = x.astype(np.float64) @ h.astype(np.float64).T
    for arr in (h, h.view(np.uint16), h.view(np.uint8)):
        check_close(M.mul_mat(arr, Q.TYPE_F16, x), want16, tol(40, np.abs(x) @ np.abs(h.astype(np.float64)).T))


# ---- threads, shapes ------------------------------------------------------------------------------

@pytest.mark.parametrize("t", ALL_TYPES, ids=name)
def test_threads_give_identical_bits(t):
    rng = np.random.default_rng(600 + t)
    n_in = 512
    raw = weights(t, 67, n_in, rng)
    x = rng.standard_normal((6, n_in)).astype(np.float32)
    one = M.mul_mat(raw, t, x, n_threads=1)
    for nth in (2, 3, 5, None, -1):
        np.testing.assert_array_equal(M.mul_mat(raw, t, x, n_threads=nth), one)


@pytest.mark.parametrize("n_out", [1, 15, 16, 17, 33])
@pytest.mark.parametrize("n_tok", [1, 5, 8, 17])
def test_odd_shapes(n_out, n_tok):
    rng = np.random.default_rng(n_out * 100 + n_tok)
    for t in (Q.TYPE_F16, Q.TYPE_Q3_K):
        n_in = 256
        raw = weights(t, n_out, n_in, rng)
        x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
        ref = M.mul_mat_ref(raw, t, x)
        out = np.full((n_tok, n_out), np.nan, np.float32)
        got = M.mul_mat(raw, t, x, out=out, n_threads=2)
        assert got is out
        w, _ = w_parts(t, raw, n_out, n_in)
        check_close(got, ref.astype(np.float64), tol(n_in, np.abs(x.astype(np.float64)) @ np.abs(w).T),
                    f"{name(t)} {n_tok}x{n_out}")


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
    with pytest.raises(ValueError):
        M.mul_mat(raw, Q.TYPE_Q4_1, x, n_threads=0)


# ---- the ordered float32 product ----------------------------------------------------------------

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


@pytest.mark.parametrize("n_in", [1, 7, 8, 64, 131])
def test_ordered_f32_product_gives_the_same_bits_at_every_simd_level(n_in):
    """The AVX2 lanes (four rows at a time, then one by one) and the scalar twin: the same bits, for row
    counts that leave 1 to 3 rows after the groups of four and for any thread count."""
    from llamax._native import cpu

    rng = np.random.default_rng(100 + n_in)
    w = rng.standard_normal((39, n_in)).astype(np.float32)
    x = rng.standard_normal((5, n_in)).astype(np.float32)
    try:
        got = []
        for level in cpu.levels():
            cpu.set_simd_level(level)
            got += [M.mul_mat_f32_ordered(w, x, n_threads=nt) for nt in (1, 2)]
    finally:
        cpu.set_simd_level(-1)
    assert len(got) >= 2
    for y in got[1:]:
        assert np.array_equal(y, got[0])
