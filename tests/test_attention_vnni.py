"""The quantized-K dots of attention's AVX-512 VNNI kernel, checked on any CPU through their portable
emulation (attention.dots_q_vnni_emul: the kernel's steps on arrays of lanes, its bits).

Issue 26: on a Sapphire Rapids the q4_0 K cache after a K-shift drifted at the VNNI level only
(test_kshift_model: 2.23 max / 1.07 RMS against bounds 3.24 / 0.79). The VNNI kernel's integer lanes
were exact (vpdpbusd on k + 128 or the raw nibble, corrected by -128 or -8 times each lane's sum of
q; these checks pass on the old arithmetic too), but its float steps were its own: two blocks side by
side in 16 float lanes, folded and summed in other orders, cells 8 at a time. So its scores differed
in their last bits (~1e-6 relative) from the AVX2 dots that the AVX-512 level runs, and the q4_0
model amplifies such differences into the logits (1.03 max / 0.22 RMS between the two levels on a
fresh context, 2.95 / 1.44 after the K-shift). Now the VNNI kernel takes the AVX2 kernel's float
steps after its own integer lanes: the same scores bit for bit, which the kernel check below asserts
(with the old float steps emulated, 93 of these 97 cases fail it).

Checked on K blocks of three origins, q8_0 and q4_0, d_k with an even and an odd number of blocks,
1 to 8 query heads (every tile width), against
  * the oracle's exact integer block dots (dots_q_ref's isum): every emulated block sum, exactly;
  * the AVX2 kernel's scores (dots_q at the AVX2 / AVX-512 level): bit for bit, and on a CPU with
    VNNI the real kernel's too (the emulation is its oracle);
  * the oracle's scores: within the rounding of nb + 16 float steps, ~(nb + 16) 2^-24 sum |k_i q_i|.
Origins: rows stored as the cache stores them (Hadamard-rotated, set_rows' quantizer) and moved by
rope.k_shift (dequantize -> un-rotate -> RoPE -> rotate -> quantize, the K-shift of KVCache.update),
unrotated ones shifted too, and adversarial blocks (q8_0 -128 and 127 everywhere, every q4_0 byte,
extreme and negative scales, queries saturating at +-127).
"""
import numpy as np
import pytest

from llamax._native import attention as A
from llamax._native import cpu
from llamax._native import hadamard as H
from llamax._native import quants as Q
from llamax._native import rope as R

QTYPES = ["q8_0", "q4_0"]
X86_LEVELS = [lv for lv in cpu.levels() if lv >= cpu.AVX2]  # AVX2, AVX-512: the AVX2 dots; VNNI: its own


@pytest.fixture(autouse=True)
def restore_level():
    yield
    cpu.set_simd_level(-1)


def cache_rows(t, x, rot):
    """float32 [n, d] K rows as the cache stores them: Hadamard-rotated (rot > 0), then quantized."""
    x = np.ascontiguousarray(x, np.float32)
    if rot:
        H.hadamard_rows(x, rot)
    return Q.quantize(t, x)


def shifted_rows(t, n, n_head_kv, d, rot, seed):
    """K rows [n, row_bytes] of a cache whose cells were moved by the real K-shift (each cell by its
    own delta, some twice), from smooth cos-based values with a few outlier channels, as K has."""
    rng = np.random.default_rng(seed)
    i = np.arange(n)[:, None]
    c = np.arange(n_head_kv * d)[None, :]
    x = (np.cos(0.37 * i + 0.11 * c) + 0.3 * np.cos(1.7 * i * c % 11)).astype(np.float32)
    x[:, c[0] % 29 == 3] *= 6.0                                      # outlier channels
    k = cache_rows(t, x, rot)
    rb = k.shape[1]
    for _ in range(2):
        shift = rng.integers(-300, 300, size=n).astype(np.int32)
        shift[::7] = 0                                               # cells that stay put
        R.k_shift(k, shift, n_head_kv, d, d, 10000.0, 1.0, R.ROPE_NEOX, 1, type=t, rot_block=rot)
    return np.ascontiguousarray(k.reshape(n * n_head_kv, rb // n_head_kv))


def adversarial_rows(t, n, d, seed):
    """K rows [n, row_bytes] of extreme blocks: every q8_0 byte from -128 (its u is 0) to 127, rows
    of all -128 / all 127, every q4_0 byte (nibbles 0 and 15 together), scales from the smallest
    half to 65504, negative and zero."""
    rng = np.random.default_rng(seed)
    bb, nb = Q.block_bytes(t), d // 32
    blk = np.zeros((n, nb, bb), np.uint8)
    qs = blk[:, :, 2:]
    qs[:] = rng.integers(0, 256, size=qs.shape)
    if t == "q8_0":
        qs[0::5] = 0x80                                              # -128 everywhere
        qs[1::5] = 0x7F
        qs[2::5] = np.where(np.arange(32) % 2, 0x80, 0x7F)
    else:
        qs[0::5] = 0x00                                              # nibbles 0: k = -8
        qs[1::5] = 0xFF                                              # nibbles 15: k = 7
        qs[2::5] = np.arange(16) * 17                                # every nibble value
    scales = np.array([1.0, -1.0, 0.5, 2.0 ** -24, -(2.0 ** -14), 65504.0, -65504.0, 0.0, 3e-3, -7.25],
                      np.float16)
    blk[:, :, :2] = scales[rng.integers(0, len(scales), size=(n, nb))].view(np.uint8).reshape(n, nb, 2)
    return np.ascontiguousarray(blk.reshape(n, nb * bb))


def queries(nh, d, seed):
    """float32 [nh, d] query rows: smooth ones, and blocks that quantize to +-127 throughout."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((nh, d)).astype(np.float32)
    q[0, :32] = 3.0                                                  # every quant 127
    if nh > 1:
        q[1, :32] = np.where(np.arange(32) % 2, -5.0, 5.0)           # +-127 alternating
    if nh > 2:
        q[2, 32:64] = 0.0                                            # a zero block (scale 0)
    return q


def check_rows(t, k, q):
    """The emulation against the oracle's integer and float dots and the AVX2 / VNNI kernels' bits."""
    S_ref, isum_ref = A.dots_q_ref(q, k, type_k=t)
    S_emu, isum_emu = A.dots_q_vnni_emul(q, k, type_k=t)
    np.testing.assert_array_equal(isum_emu, isum_ref)               # exact integer block dots

    # the oracle's scores within the float steps' rounding: nb + 16 roundings of terms bounded by
    # sum_i |k_i q_i| (the lanes' partial sums), relative 2^-24 each
    nh, d = q.shape
    qd = Q.dequantize("q8_0", Q.quantize("q8_0", q), (nh, d)).astype(np.float64)
    kd = Q.dequantize(t, k, (k.shape[0], d)).astype(np.float64)
    mag = np.abs(qd) @ np.abs(kd).T
    tol = (d // 32 + 16) * 2.0 ** -24 * mag
    finite = np.isfinite(S_ref)
    assert np.array_equal(finite, np.isfinite(S_emu))
    assert np.all(np.abs(S_emu[finite].astype(np.float64) - S_ref[finite]) <= tol[finite])

    for lv in X86_LEVELS:                                           # the kernels: the same bits
        cpu.set_simd_level(lv)
        np.testing.assert_array_equal(A.dots_q(q, k, type_k=t), S_emu, err_msg=cpu.LEVEL_NAMES[lv])
    cpu.set_simd_level(-1)


@pytest.mark.parametrize("nh", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("d", [64, 96, 128])
@pytest.mark.parametrize("rot", [True, False], ids=["rotated", "unrotated"])
@pytest.mark.parametrize("t", QTYPES)
def test_shifted_blocks(t, rot, d, nh):
    """K rows after the real K-shift (rotated as the cache stores a quantized K, or not)."""
    rb = H.rot_block(d) if rot else 0
    k = shifted_rows(t, 37, 3, d, rb, seed=d + nh)                 # 111 cells: every tile and tail
    check_rows(t, k, queries(nh, d, seed=nh))


@pytest.mark.parametrize("nh", [1, 3, 6, 8])
@pytest.mark.parametrize("d", [32, 64, 160])
@pytest.mark.parametrize("t", QTYPES)
def test_adversarial_blocks(t, d, nh):
    k = adversarial_rows(t, 75, d, seed=d * nh)
    check_rows(t, k, queries(nh, d, seed=nh + 100))


def test_long_rows_cross_chunks():
    """More cells than one chunk (LX_ATTN_CHUNK): every cell's score and block sums."""
    for t in QTYPES:
        k = shifted_rows(t, 100, 3, 64, H.rot_block(64), seed=7)  # 300 cells
        check_rows(t, k, queries(3, 64, seed=3))


def test_argument_errors():
    q = np.zeros((2, 64), np.float32)
    k = np.zeros((5, Q.row_bytes("q8_0", 64)), np.uint8)
    for fn in (A.dots_q, A.dots_q_ref, A.dots_q_vnni_emul):
        with pytest.raises(ValueError, match="q8_0 or q4_0"):
            fn(q, k, type_k="f16")
        with pytest.raises(ValueError, match="k must be uint8"):
            fn(q, k, type_k="q4_0")
        with pytest.raises(ValueError, match="heads"):
            fn(np.zeros((9, 64), np.float32), k, type_k="q8_0")
        with pytest.raises(ValueError, match="d_k"):
            fn(np.zeros((2, 48), np.float32), k, type_k="q8_0")
