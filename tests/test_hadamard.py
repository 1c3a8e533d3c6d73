"""Tests of llama.cpp's Walsh-Hadamard rotation (csrc/hadamard.c via llamax._native.hadamard).

Oracles: ggml_gen_hadamard restated in numpy (Sylvester doubling from 1.0 / sqrtf(n), the same
float32 entries), the closed form H[i][j] = s * (-1)^popcount(i & j), and float64 matrix products.
The fast transform (FWHT) must agree with the _ref (explicit matrix, double sums) within
max_err(block) * s * sum_j |x_j| per element (hadamard.h derives the bound).
"""
import numpy as np
import pytest

from llamax._native import hadamard as H

# every fast path against its scalar reference, at each SIMD level of this CPU
pytestmark = pytest.mark.usefixtures("every_simd_level")


def ggml_gen_hadamard(n: int) -> np.ndarray:
    """src/llama-kv-cache.cpp's ggml_gen_hadamard, step by step."""
    h = np.zeros((n, n), np.float32)
    h[0, 0] = np.float32(1.0 / float(np.sqrt(np.float32(n))))   # 1.0 / sqrtf(n), stored as float
    s = 1
    while s < n:
        for i in range(s):
            for j in range(s):
                val = h[i, j]
                h[i + s, j] = val
                h[i, j + s] = val
                h[i + s, j + s] = -val
        s *= 2
    return h


@pytest.mark.parametrize("n", [1, 2, 4, 8, 16, 64, 128])
def test_matrix_is_ggml_gen_hadamard(n):
    m = H.matrix(n)
    assert m.dtype == np.float32 and m.shape == (n, n)
    want = ggml_gen_hadamard(n)
    assert m.tobytes() == want.tobytes()
    i, j = np.indices((n, n))
    parity = np.vectorize(lambda a: bin(a).count("1") & 1)(i & j)
    np.testing.assert_array_equal(m, np.where(parity, -want[0, 0], want[0, 0]))


def test_small_matrix_signs():
    s = np.float32(0.5)
    np.testing.assert_array_equal(H.matrix(4), s * np.array([[1, 1, 1, 1], [1, -1, 1, -1],
                                                             [1, 1, -1, -1], [1, -1, -1, 1]], np.float32))


@pytest.mark.parametrize("n", [64, 128, 256])
def test_orthonormal_symmetric_self_inverse(n):
    m = H.matrix(n).astype(np.float64)
    np.testing.assert_array_equal(m, m.T)
    np.testing.assert_allclose(m @ m, np.eye(n), atol=1e-6)


def _rows(seed, n_rows, n):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n_rows, n)).astype(np.float32)
    x[0, :7] *= 300.0                                    # outliers, the reason for the rotation
    return x


def _bound(x, block):
    """max_err(block) * s * sum_j |x_j| of each element's block (float64)."""
    s = float(H.matrix(block)[0, 0])
    sums = np.abs(x.astype(np.float64)).reshape(x.shape[0], -1, block).sum(axis=2)
    return np.repeat(sums, block, axis=1) * s * H.max_err(block) + 1e-30


@pytest.mark.parametrize("block", [1, 2, 4, 8, 16, 32, 64, 128, 256])
def test_fast_matches_ref_and_matrix(block):
    x = _rows(block, 9, 512)
    fast = H.hadamard_rows(x.copy(), block)
    ref = H.hadamard_rows_ref(x.copy(), block)
    assert np.all(np.abs(fast.astype(np.float64) - ref) <= _bound(x, block))
    want = (x.astype(np.float64).reshape(-1, block) @ H.matrix(block).astype(np.float64).T).reshape(x.shape)
    assert np.all(np.abs(ref - want) <= np.abs(want) * 2.0 ** -24 + 1e-30)   # rounded once


@pytest.mark.parametrize("block", [64, 128])
def test_twice_is_identity_and_norm_kept(block):
    x = _rows(3, 5, 4 * block)
    y = H.hadamard_rows(x.copy(), block)
    np.testing.assert_allclose(np.linalg.norm(y.reshape(-1, block), axis=1),
                               np.linalg.norm(x.reshape(-1, block), axis=1), rtol=1e-5)
    z = H.hadamard_rows(y.copy(), block)
    np.testing.assert_allclose(z, x, atol=1e-5 * float(np.abs(x).max()))


def test_rotation_spreads_an_outlier():
    """The point of it: one large channel becomes a flat block (1/sqrt(n) of it everywhere)."""
    x = np.zeros((1, 64), np.float32)
    x[0, 5] = 8.0
    y = H.hadamard_rows(x, 64)
    np.testing.assert_allclose(np.abs(y), 1.0, rtol=1e-6)


def test_dot_products_kept():
    """(H q) . (H k) = q . k: why rotating q and K together leaves the scores unchanged."""
    q, k = _rows(4, 3, 128), _rows(5, 3, 128)
    hq, hk = H.hadamard_rows(q.copy(), 64), H.hadamard_rows(k.copy(), 64)
    np.testing.assert_allclose((hq * hk).sum(axis=1), (q * k).sum(axis=1), rtol=1e-5, atol=1e-3)


def test_threads_and_layout_give_the_same_bits():
    x = _rows(6, 600, 192)                      # enough values for the threaded loop
    a = H.hadamard_rows(x.copy(), 64, n_threads=1)
    b = H.hadamard_rows(x.copy(), 64, n_threads=2)
    c = H.hadamard_rows(x.copy().reshape(-1, 64), 64, n_threads=3).reshape(x.shape)
    assert a.tobytes() == b.tobytes() == c.tobytes()


def test_in_place_and_views():
    x = _rows(7, 4, 128)
    assert H.hadamard_rows(x, 64) is x
    q = _rows(8, 6, 64).reshape(2, 3, 64)
    flat = q.reshape(2, -1)                     # a view: rotated in place through it
    H.hadamard_rows(flat, 64)
    np.testing.assert_array_equal(q.reshape(2, -1), flat)
    assert H.hadamard_rows(np.zeros((0, 64), np.float32), 64).shape == (0, 64)


def test_rot_blocks_as_llama_cpp():
    """K: the largest power of two >= 64 dividing head_dim; V: 64; 0 when head_dim % 64 != 0."""
    assert [H.rot_block(d) for d in (64, 128, 192, 256, 320, 576, 96, 80, 32, 0)] == \
        [64, 128, 64, 256, 64, 64, 0, 0, 0, 0]
    assert [H.rot_block_v(d) for d in (64, 128, 192, 96, 32)] == [64, 64, 64, 0, 0]
    assert H.MIN_ROT == 64


@pytest.mark.parametrize("call,exc", [
    (lambda: H.hadamard_rows(np.zeros((2, 64), np.float64), 64), ValueError),
    (lambda: H.hadamard_rows(np.zeros(64, np.float32), 64), ValueError),
    (lambda: H.hadamard_rows(np.zeros((2, 96), np.float32), 64), ValueError),
    (lambda: H.hadamard_rows(np.zeros((2, 128), np.float32)[:, ::2], 64), ValueError),
    (lambda: H.hadamard_rows(np.zeros((2, 96), np.float32), 48), ValueError),
    (lambda: H.hadamard_rows(np.zeros((2, 64), np.float32), 0), ValueError),
    (lambda: H.hadamard_rows(np.zeros((2, 64), np.float32), 64.0), TypeError),
    (lambda: H.hadamard_rows(np.zeros((2, 64), np.float32), 64, n_threads=0), ValueError),
    (lambda: H.hadamard_rows_ref(np.zeros((2, 64), np.float32), 3), ValueError),
    (lambda: H.matrix(12), ValueError),
])
def test_errors(call, exc):
    with pytest.raises(exc):
        call()


def test_read_only_raises():
    x = np.zeros((2, 64), np.float32)
    x.flags.writeable = False
    with pytest.raises(ValueError, match="writeable"):
        H.hadamard_rows(x, 64)
