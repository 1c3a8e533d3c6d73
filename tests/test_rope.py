"""Tests of RoPE and the K-shift (csrc/rope.c via llamax._native.rope).

Oracles:
  * np_rope: numpy, emulating ggml's float32 steps (theta_scale = powf(base, -2/n_rot) rounded to
    float32, theta multiplied by it once per pair in float32, cos/sin rounded to float32, the
    rotation in float32). It agrees with the C code to a couple of ulps of the trig values.
  * np_rope_exact: float64 angles p * scale * base^(-2i/n_rot), to bound the float32 drift.
  * the scalar C _ref twins: the fast kernels must match them bit for bit (finite inputs).

Tolerances (stated once, used below):
  * vs np_rope: ATOL_EMU = 4e-6 * max|x| (one or two ulps of cos/sin times |x|, plus the rounding
    of the two products and the sum).
  * composition (rotate by a then b vs by a+b; rope at p then shift d vs rope at p+d): ggml
    computes each angle in float32 by repeated multiplication, so angle i of position p carries a
    relative error of about (i + 2) * 2^-24; the two sides differ by at most
    drift(a, b) = (|a| + |b| + |a+b|) * (n_rot/2 + 2) * 2^-24 radians, hence
    atol = max|x| * (drift + 1e-5).
"""
import numpy as np
import pytest

from llamax._native import rope as R

# every fast path against its scalar reference, at each SIMD level of this CPU
pytestmark = pytest.mark.usefixtures("every_simd_level")

KINDS = [R.ROPE_NORM, R.ROPE_NEOX]


# ---- numpy oracles -----------------------------------------------------------------------------

def np_trig(pos, n_rot, base, scale):
    """float32 cos, sin [len(pos), n_rot/2] computed with ggml's float32 steps."""
    theta_scale = np.float32(np.float64(np.float32(base)) ** (np.float64(np.float32(-2.0) / np.float32(n_rot))))
    theta = np.asarray(pos).astype(np.float32)
    cs, sn = [], []
    for _ in range(n_rot // 2):
        t = np.float32(scale) * theta
        cs.append(np.cos(t.astype(np.float64)).astype(np.float32))
        sn.append(np.sin(t.astype(np.float64)).astype(np.float32))
        theta = theta * theta_scale
    return np.stack(cs, axis=-1), np.stack(sn, axis=-1)


def rotate(x, c, s, n_rot, kind):
    """x [..., n_head, head_dim] float32 or float64; c, s [..., n_rot/2] broadcast over heads."""
    x = x.copy()
    c, s = c[..., None, :], s[..., None, :]
    if kind == R.ROPE_NORM:
        a, b = x[..., 0:n_rot:2].copy(), x[..., 1:n_rot:2].copy()
        x[..., 0:n_rot:2] = a * c - b * s
        x[..., 1:n_rot:2] = a * s + b * c
    else:
        h = n_rot // 2
        a, b = x[..., :h].copy(), x[..., h:n_rot].copy()
        x[..., :h] = a * c - b * s
        x[..., h:n_rot] = a * s + b * c
    return x


def np_rope(x, pos, n_rot, base=10000.0, scale=1.0, kind=R.ROPE_NORM):
    c, s = np_trig(pos, n_rot, base, scale)
    return rotate(x.astype(np.float32), c, s, n_rot, kind)


def np_rope_exact(x, pos, n_rot, base=10000.0, scale=1.0, kind=R.ROPE_NORM):
    i = np.arange(n_rot // 2)
    theta = np.asarray(pos, dtype=np.float64)[:, None] * scale * float(base) ** (-2.0 * i / n_rot)
    return rotate(x.astype(np.float64), np.cos(theta), np.sin(theta), n_rot, kind)


def atol_emu(x):
    return 4e-6 * float(np.abs(x).max())


def atol_compose(x, a, b, n_rot):
    drift = (np.abs(a) + np.abs(b) + np.abs(np.asarray(a) + np.asarray(b))).max() * (n_rot / 2 + 2) * 2.0 ** -24
    return float(np.abs(x).max()) * (float(drift) + 1e-5)


def data(rng, *shape):
    return rng.standard_normal(shape).astype(np.float32)


# ---- rope_cache / rope_f32 ---------------------------------------------------------------------

@pytest.mark.parametrize("n_rot,base,scale", [(64, 10000.0, 1.0), (128, 500000.0, 1.0), (32, 1e6, 0.25),
                                              (2, 10000.0, 1.0)])
def test_rope_cache_matches_numpy(n_rot, base, scale):
    for p in [0, 1, 7, 100, 4095, 30000]:
        got = R.rope_cache(p, n_rot, base, scale)
        c, s = np_trig(np.array([p]), n_rot, base, scale)
        want = np.stack([c[0], s[0]], axis=-1).reshape(-1)
        np.testing.assert_array_max_ulp(got, want, maxulp=2)
    assert R.rope_cache(0, n_rot, base, scale).tolist() == [1.0, 0.0] * (n_rot // 2)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n_rot,head_dim", [(64, 64), (32, 64), (2, 6), (128, 128), (16, 80)])
@pytest.mark.parametrize("base,scale", [(10000.0, 1.0), (1e6, 0.5)])
def test_rope_f32_matches_numpy(kind, n_rot, head_dim, base, scale):
    rng = np.random.default_rng(n_rot * 7 + head_dim + kind)
    x = data(rng, 37, 5, head_dim)
    pos = rng.integers(0, 5000, 37).astype(np.int32)
    pos[3] = 0
    fast = R.rope_f32(x.copy(), pos, n_rot, base, scale, kind, n_threads=2)
    ref = R.rope_f32_ref(x.copy(), pos, n_rot, base, scale, kind)
    assert fast.tobytes() == ref.tobytes()
    np.testing.assert_allclose(ref, np_rope(x, pos, n_rot, base, scale, kind), rtol=0, atol=atol_emu(x))
    # float32 angle drift against exact float64 angles stays within the stated bound
    drift_atol = atol_compose(x, pos, 0 * pos, n_rot)
    np.testing.assert_allclose(ref, np_rope_exact(x, pos, n_rot, base, scale, kind), rtol=0, atol=drift_atol)
    assert np.array_equal(ref[..., n_rot:], x[..., n_rot:])  # pass-through dims untouched
    assert np.array_equal(ref[3], x[3])                        # position 0 is the identity here


@pytest.mark.parametrize("kind", KINDS)
def test_rope_norm_pairs_layout(kind):
    """The unit vector of dim 0 at position 1 becomes (cos 1, sin 1) on the pair the kind
    defines: (0, 1) for norm, (0, n_rot/2) for neox; the other dims stay 0."""
    n_rot = 4
    x = np.zeros((1, 1, 4), np.float32)
    x[0, 0, 0] = 1.0
    y = R.rope_f32_ref(x.copy(), np.array([1], np.int32), n_rot, 10000.0, 1.0, kind)[0, 0]
    partner = 1 if kind == R.ROPE_NORM else 2
    c, s = R.rope_cache(1, n_rot)[:2]
    assert abs(c - np.cos(1.0)) < 1e-7 and abs(s - np.sin(1.0)) < 1e-7
    assert y[0] == c and y[partner] == s
    assert np.count_nonzero(y) == 2


@pytest.mark.parametrize("kind", KINDS)
def test_rotate_a_then_b_is_a_plus_b(kind):
    rng = np.random.default_rng(11 + kind)
    n, n_head, head_dim, n_rot = 64, 4, 64, 64
    x = data(rng, n, n_head, head_dim)
    a = rng.integers(0, 2048, n).astype(np.int32)
    b = rng.integers(-1024, 2048, n).astype(np.int32)
    twice = R.rope_f32(R.rope_f32(x.copy(), a, n_rot, kind=kind), b, n_rot, kind=kind)
    once = R.rope_f32(x.copy(), (a + b).astype(np.int32), n_rot, kind=kind)
    np.testing.assert_allclose(twice, once, rtol=0, atol=atol_compose(x, a, b, n_rot))


# ---- K-shift -----------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n_rot", [64, 32])
def test_k_shift_equals_rope_at_shifted_position(kind, n_rot):
    """rope(K at p) then k_shift(d) ~= rope(K at p + d), with the cache layout [cell, head*dim]."""
    rng = np.random.default_rng(5 + n_rot + kind)
    kv_size, n_head_kv, head_dim = 300, 4, 64
    k = data(rng, kv_size, n_head_kv, head_dim)
    p = rng.integers(0, 3000, kv_size).astype(np.int32)
    d = np.repeat(rng.integers(-500, 500, 10), 30).astype(np.int32)   # runs of one shift, as seq_add makes
    d[::17] = 0
    k_rows = R.rope_f32(k.copy(), p, n_rot, kind=kind).reshape(kv_size, -1)
    R.k_shift(k_rows, d, n_head_kv, head_dim, n_rot, kind=kind, n_threads=2)
    want = R.rope_f32(k.copy(), (p + d).astype(np.int32), n_rot, kind=kind).reshape(kv_size, -1)
    np.testing.assert_allclose(k_rows, want, rtol=0, atol=atol_compose(k, p, d, n_rot))


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n_rot,head_dim", [(64, 64), (32, 48), (8, 8)])
def test_k_shift_fast_equals_ref_and_numpy(dtype, kind, n_rot, head_dim):
    rng = np.random.default_rng(n_rot + head_dim + kind + (dtype == np.float16))
    kv_size, n_head_kv = 513, 8   # enough work for OpenMP (kv_size * n_head_kv * n_rot >= 2^15)
    k = (rng.standard_normal((kv_size, n_head_kv * head_dim)) * 4).astype(dtype)
    shift = rng.integers(-3000, 3000, kv_size).astype(np.int32)
    shift[rng.random(kv_size) < 0.3] = 0
    shift[100:160] = 77                                               # a run of equal shifts
    ref = R.k_shift_ref(k.copy(), shift, n_head_kv, head_dim, n_rot, 10000.0, 1.0, kind)
    for n_threads in (1, 2):
        fast = R.k_shift(k.copy(), shift, n_head_kv, head_dim, n_rot, 10000.0, 1.0, kind, n_threads=n_threads)
        assert fast.dtype == dtype and fast.tobytes() == ref.tobytes(), n_threads
    if dtype == np.float16:
        # f16: read as float, rotate in float32, round to nearest even: the f32 kernel then a cast
        via_f32 = R.k_shift_ref(k.astype(np.float32), shift, n_head_kv, head_dim, n_rot, 10000.0, 1.0, kind)
        assert ref.tobytes() == via_f32.astype(np.float16).tobytes()
    else:
        x = k.reshape(kv_size, n_head_kv, head_dim)
        want = np.where((shift != 0)[:, None, None],
                        np_rope(x, shift, n_rot, kind=kind), x).reshape(kv_size, -1)
        np.testing.assert_allclose(ref, want, rtol=0, atol=atol_emu(k))


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_zero_shift_cells_are_bit_identical(dtype):
    """Cells with shift 0 are not rotated by angle 0 (which would turn -0.0 into +0.0 or a
    signalling pattern into another NaN): their bytes do not change; nor do pass-through dims."""
    rng = np.random.default_rng(3)
    kv_size, n_head_kv, head_dim, n_rot = 64, 2, 16, 8
    k = rng.standard_normal((kv_size, n_head_kv * head_dim)).astype(dtype)
    k[::2, 0] = -0.0
    k[::2, 1] = np.nan
    k[::4, 3] = np.inf
    shift = np.zeros(kv_size, np.int32)
    shift[1::2] = rng.integers(1, 100, kv_size // 2)
    for fn in (R.k_shift, R.k_shift_ref):
        out = fn(k.copy(), shift, n_head_kv, head_dim, n_rot)
        assert out[::2].tobytes() == k[::2].tobytes()
        heads_out = out.reshape(kv_size, n_head_kv, head_dim)
        heads_in = k.reshape(kv_size, n_head_kv, head_dim)
        assert heads_out[..., n_rot:].tobytes() == heads_in[..., n_rot:].tobytes()
        assert not np.array_equal(out[1::2], k[1::2])


def test_rope_f32_threads_identical():
    rng = np.random.default_rng(9)
    x = data(rng, 512, 8, 128)
    pos = rng.integers(0, 100000, 512).astype(np.int32)
    outs = [R.rope_f32(x.copy(), pos, 128, 10000.0, 1.0, R.ROPE_NEOX, n_threads=n).tobytes() for n in (1, 2, None)]
    assert outs[0] == outs[1] == outs[2]


def test_returns_same_array_in_place():
    x = np.ones((2, 1, 4), np.float32)
    assert R.rope_f32(x, np.array([1, 2], np.int32), 4) is x
    k = np.ones((2, 4), np.float16)
    assert R.k_shift(k, np.array([0, 3], np.int32), 1, 4, 4) is k
    assert np.all(k[0] == 1) and not np.all(k[1] == 1)


# ---- errors ------------------------------------------------------------------------------------

POS2 = np.array([0, 1], np.int32)


@pytest.mark.parametrize("call", [
    lambda: R.rope_f32(np.zeros((2, 1, 4), np.float64), POS2, 4),                  # dtype
    lambda: R.rope_f32(np.zeros((2, 4), np.float32), POS2, 4),                     # not 3-D
    lambda: R.rope_f32(np.zeros((2, 1, 8), np.float32)[:, :, ::2], POS2, 4),       # not contiguous
    lambda: R.rope_f32(np.zeros((2, 1, 4), np.float32), POS2[:1], 4),              # pos length
    lambda: R.rope_f32(np.zeros((2, 1, 4), np.float32), POS2.astype(np.int64), 4), # pos dtype
    lambda: R.rope_f32(np.zeros((2, 1, 4), np.float32), POS2, 3),                  # odd n_rot
    lambda: R.rope_f32(np.zeros((2, 1, 4), np.float32), POS2, 6),                  # n_rot > head_dim
    lambda: R.rope_f32(np.zeros((2, 1, 4), np.float32), POS2, 0),                  # n_rot 0
    lambda: R.rope_f32(np.zeros((2, 1, 4), np.float32), POS2, 4, kind=1),          # kind
    lambda: R.rope_f32(np.zeros((2, 1, 4), np.float32), POS2, 4, freq_base=0.0),   # base
    lambda: R.rope_f32(np.zeros((2, 1, 4), np.float32), POS2, 4, n_threads=0),     # threads
    lambda: R.rope_f32(np.zeros((1, 1, 2048), np.float32), POS2[:1], 2048),        # > LX_ROPE_MAX_ROT
    lambda: R.rope_f32_ref(np.zeros((2, 1, 4), np.float32), POS2, 5),
    lambda: R.k_shift(np.zeros((2, 8), np.float64), POS2, 2, 4, 4),                # dtype
    lambda: R.k_shift(np.zeros((2, 8), np.float32), POS2, 2, 3, 2),                # row width
    lambda: R.k_shift(np.zeros((2, 2, 4), np.float32), POS2, 2, 4, 4),             # not 2-D
    lambda: R.k_shift(np.zeros((2, 16), np.float16)[:, ::2], POS2, 2, 4, 4),       # not contiguous
    lambda: R.k_shift(np.zeros((3, 8), np.float32), POS2, 2, 4, 4),                # shift length
    lambda: R.k_shift(np.zeros((2, 8), np.float32), POS2, 2, 4, 6),                # n_rot > head_dim
    lambda: R.k_shift(np.zeros((2, 8), np.float32), POS2, 0, 4, 4),                # n_head_kv
    lambda: R.k_shift(np.zeros((2, 8), np.float32), POS2, 2, 4, 4, kind=3),        # kind
    lambda: R.k_shift(np.zeros((2, 8), np.float32), POS2, 2, 4, 4, n_threads=0),   # threads
    lambda: R.k_shift_ref(np.zeros((2, 8), np.float32), POS2.astype(np.uint32), 2, 4, 4),
])
def test_bad_inputs_raise(call):
    with pytest.raises(ValueError):
        call()


def test_read_only_raises():
    x = np.zeros((2, 1, 4), np.float32)
    x.flags.writeable = False
    with pytest.raises(ValueError):
        R.rope_f32(x, POS2, 4)
    k = np.zeros((2, 8), np.float16)
    k.flags.writeable = False
    with pytest.raises(ValueError):
        R.k_shift(k, POS2, 2, 4, 4)


# ---- K-shift of a quantized K, and of a rotated K (llama.cpp's attn_rot_k) --------------------------
#
# Oracle: numpy doing what llama.cpp's build_rope_shift does for a quantized K: dequantize
# (quants.dequantize, bit-exact with ggml) -> un-rotate each head by H (hadamard.hadamard_rows_ref)
# -> RoPE (np_rope, float32 steps) -> rotate -> quantize back (quants.quantize, ggml's reference
# rounding). The kernels do the same in C; compared on the dequantized values, they agree within
# one quantization step d of a block wherever the float paths differ by rounding (the rounding
# of a value sitting on a step boundary can go either way), and exactly elsewhere.

from llamax._native import hadamard as H  # noqa: E402
from llamax._native import quants as Q  # noqa: E402


def _deq(t, k, n):
    if t in ("f32", "f16"):
        return k.astype(np.float32)
    return Q.dequantize(t, k, (k.shape[0], n))


def _enc(t, x):
    if t == "f32":
        return x.astype(np.float32)
    if t == "f16":
        return x.astype(np.float16)
    return Q.quantize(t, np.ascontiguousarray(x, np.float32))


def np_k_shift(t, k, shift, n_head_kv, head_dim, n_rot, base, scale, kind, rot_block):
    kv_size = k.shape[0]
    x = _deq(t, k, n_head_kv * head_dim).reshape(kv_size * n_head_kv, head_dim).copy()
    if rot_block:
        H.hadamard_rows_ref(x, rot_block)
    x = np_rope(x.reshape(kv_size, n_head_kv, head_dim), shift, n_rot, base, scale, kind)
    x = np.ascontiguousarray(x, np.float32).reshape(kv_size * n_head_kv, head_dim)
    if rot_block:
        H.hadamard_rows_ref(x, rot_block)
    out = _enc(t, x.reshape(kv_size, -1))
    out[shift == 0] = k[shift == 0]
    return out


def _step(t, k, n):
    """Per value, the size of one quantization step of its block (0 for f32 / f16 handled apart)."""
    if t in ("f32", "f16"):
        return np.zeros((k.shape[0], n))
    d = k.reshape(k.shape[0], -1, Q.block_bytes(t))[:, :, :2].copy().view(np.float16)[..., 0]
    return np.repeat(np.abs(d.astype(np.float64)), 32, axis=1)


@pytest.mark.parametrize("t", ["q8_0", "q4_0"])
@pytest.mark.parametrize("rot", [False, True], ids=["plain", "rotated"])
@pytest.mark.parametrize("kind", KINDS)
def test_k_shift_quantized_vs_numpy(t, rot, kind):
    rng = np.random.default_rng(hash((t, rot, kind)) & 0xFFFF)
    kv_size, n_head_kv, head_dim, n_rot = 48, 3, 128, 128
    rot_block = H.rot_block(head_dim) if rot else 0
    x = data(rng, kv_size, n_head_kv * head_dim)
    x[:, 5] *= 20.0                                          # an outlier channel
    k = _enc(t, x)
    shift = rng.integers(-300, 300, kv_size).astype(np.int32)
    shift[::4] = 0
    args = (n_head_kv, head_dim, n_rot, 10000.0, 1.0, kind)
    fast = R.k_shift(k.copy(), shift, *args, n_threads=2, type=t, rot_block=rot_block)
    ref = R.k_shift_ref(k.copy(), shift, *args, type=t, rot_block=rot_block)
    want = np_k_shift(t, k, shift, *args, rot_block)
    assert fast[shift == 0].tobytes() == k[shift == 0].tobytes()     # untouched cells keep their bytes
    n = n_head_kv * head_dim
    step = _step(t, want, n)
    for got in (fast, ref):
        diff = np.abs(_deq(t, got, n).astype(np.float64) - _deq(t, want, n))
        assert np.all(diff <= 1.01 * step + 1e-6 * np.abs(x).max())
        assert np.mean(got == want) > 0.98                    # almost every byte identical
    if not rot:
        assert fast.tobytes() == ref.tobytes()               # every step bit-exact without rotation
    # the shift is the rotation it claims: rope then shift == rope at the sum, up to quantization
    back = R.k_shift(fast.copy(), -shift, *args, type=t, rot_block=rot_block)
    err = np.abs(_deq(t, back, n) - _deq(t, k, n))
    assert err.max() <= 3.0 * _step(t, k, n).max() + 1e-3


@pytest.mark.parametrize("t", ["f32", "f16"])
def test_k_shift_rotated_float_cache(t):
    """A rotated f32 / f16 K is un-rotated, roped and re-rotated too (every value changes)."""
    rng = np.random.default_rng(5)
    kv_size, n_head_kv, head_dim, n_rot = 20, 2, 64, 32
    x = data(rng, kv_size, n_head_kv * head_dim)
    k = _enc(t, x)
    shift = rng.integers(1, 100, kv_size).astype(np.int32)
    shift[3] = 0
    args = (n_head_kv, head_dim, n_rot, 10000.0, 1.0, R.ROPE_NEOX)
    fast = R.k_shift(k.copy(), shift, *args, type=t, rot_block=64)
    ref = R.k_shift_ref(k.copy(), shift, *args, rot_block=64)
    want = np_k_shift(t, k, shift, *args, 64)
    tol = (1e-6 if t == "f32" else 2e-3) * float(np.abs(x).max())
    np.testing.assert_allclose(fast.astype(np.float32), want.astype(np.float32), atol=tol)
    np.testing.assert_allclose(ref.astype(np.float32), want.astype(np.float32), atol=tol)
    assert fast[3].tobytes() == k[3].tobytes()
    # without rotation the type argument changes nothing
    plain = R.k_shift(k.copy(), shift, *args)
    assert plain.tobytes() == R.k_shift(k.copy(), shift, *args, type=t, rot_block=0).tobytes()


@pytest.mark.parametrize("t", ["q8_0", "q4_0"])
def test_k_shift_quantized_threads_identical(t):
    rng = np.random.default_rng(8)
    k = _enc(t, data(rng, 400, 2 * 64))
    shift = rng.integers(-9, 9, 400).astype(np.int32)
    outs = [R.k_shift(k.copy(), shift, 2, 64, 64, 10000.0, 1.0, R.ROPE_NORM, n, type=t, rot_block=64).tobytes()
            for n in (1, 2, 3)]
    assert outs[0] == outs[1] == outs[2]


KQ = np.zeros((2, 2 * 68), np.uint8)


@pytest.mark.parametrize("call", [
    lambda: R.k_shift(KQ.copy(), POS2, 2, 64, 64),                                   # uint8 without type
    lambda: R.k_shift(KQ.copy(), POS2, 2, 64, 64, type="q4_0"),                      # q4_0 rows are 72 B
    lambda: R.k_shift(KQ.copy(), POS2, 2, 64, 64, type="q4_1"),                      # not a cache type
    lambda: R.k_shift(np.zeros((2, 2 * 51), np.uint8), POS2, 2, 48, 48, type="q8_0"),  # head_dim % 32
    lambda: R.k_shift(KQ.copy(), POS2, 2, 64, 64, type="q8_0", rot_block=48),        # not a power of two
    lambda: R.k_shift(KQ.copy(), POS2, 2, 64, 64, type="q8_0", rot_block=128),       # > head_dim
    lambda: R.k_shift(np.zeros((2, 128), np.float32), POS2, 2, 64, 64, type="f16"),  # dtype vs type
    lambda: R.k_shift_ref(KQ.copy(), POS2, 2, 64, 64, type="q8_0", rot_block=3),
])
def test_k_shift_quantized_bad_inputs_raise(call):
    with pytest.raises(ValueError):
        call()


# ---- scaling kinds: frequency factors, YaRN, attn_factor (ggml_rope_ext) ----------------------------
#
# Oracle: np_trig_scaled, a numpy transcription of ggml_rope_cache_init / rope_yarn in float32, the same
# operation order: theta_extrap = theta / ff, theta_interp = freq_scale * theta_extrap, YaRN's ramp mix,
# magnitude m = attn_factor (* (1 + 0.1 logf(1 / freq_scale)) with YaRN), cos / sin of the float32 angle
# (in float64, rounded) times m. The angles are the same float32 operations as the C code's, so the
# difference is the trig rounding (as np_rope above) plus one rounding of the product by m (the
# logarithm in m may differ by an ulp from logf): 4 ulps of the cache, ATOL_EMU * m on the rotation.

from llamax.rope import RoPE, yarn_attn_factor  # noqa: E402

F32 = np.float32


def np_yarn_corr_dims(n_dims, n_ctx_orig, base, beta_fast=32.0, beta_slow=1.0):
    """ggml_rope_yarn_corr_dims in float32 steps (logs in float64, rounded)."""
    def dim(beta):
        num = F32(n_dims) * F32(np.log(np.float64(F32(n_ctx_orig) / (F32(beta) * F32(2) * F32(np.pi)))))
        return num / (F32(2) * F32(np.log(np.float64(F32(base)))))
    return max(0.0, float(np.floor(dim(beta_fast)))), min(float(n_dims - 1), float(np.ceil(dim(beta_slow))))


def magnitude(scale, ext_factor=0.0, attn_factor=1.0):
    m = F32(attn_factor)
    if ext_factor != 0:
        m = m * (F32(1) + F32(0.1) * F32(np.log(np.float64(F32(1) / F32(scale)))))
    return m


def np_trig_scaled(pos, n_rot, base, scale, freq_factors=None, ext_factor=0.0, attn_factor=1.0,
                   corr_dims=(0.0, 0.0)):
    """float32 cos * m, sin * m [len(pos), n_rot/2], ggml's float32 steps."""
    theta_scale = F32(np.float64(F32(base)) ** (np.float64(F32(-2.0) / F32(n_rot))))
    theta = np.asarray(pos).astype(F32)
    m = magnitude(scale, ext_factor, attn_factor)
    lo, hi = F32(corr_dims[0]), F32(corr_dims[1])
    cs, sn = [], []
    for i in range(n_rot // 2):
        ff = F32(1) if freq_factors is None else F32(freq_factors[i])
        extrap = theta / ff
        interp = F32(scale) * extrap
        t = interp
        if ext_factor != 0:
            y = (F32(i) - lo) / max(F32(0.001), hi - lo)
            mix = (F32(1) - min(F32(1), max(F32(0), y))) * F32(ext_factor)
            t = interp * (F32(1) - mix) + extrap * mix
        cs.append(np.cos(t.astype(np.float64)).astype(F32) * m)
        sn.append(np.sin(t.astype(np.float64)).astype(F32) * m)
        theta = theta * theta_scale
    return np.stack(cs, axis=-1), np.stack(sn, axis=-1)


def llama3_factors(n_rot=128, base=500000.0, factor=8.0, low=1.0, high=4.0, old_ctx=8192):
    """Llama 3.1's rope_freqs.weight as the GGUF converter computes it."""
    freqs = 1.0 / base ** (np.arange(0, n_rot, 2) / n_rot)
    wavelen = 2 * np.pi / freqs
    lo_wl, hi_wl = old_ctx / low, old_ctx / high
    smooth = (old_ctx / wavelen - low) / (high - low)
    out = np.where(wavelen < hi_wl, 1.0, np.where(wavelen > lo_wl, factor, 1.0 / ((1 - smooth) / factor + smooth)))
    return out.astype(F32)


def longrope_factors(n_rot):
    """Phi-3.5-like long factors: rising from about 1 to about 50 over the pairs."""
    return (1.0 + 49.0 * (np.arange(n_rot // 2) / (n_rot // 2 - 1)) ** 2).astype(F32)


def scaled_rope(name, n_rot, base=10000.0, kind="norm"):
    """The RoPEs of the families issue 29 adds (a RoPE gives the kernels' keywords)."""
    if name == "llama3":
        return RoPE(n_rot, 500000.0, 1.0, kind, freq_factors=llama3_factors(n_rot))
    if name == "longrope":   # Phi-3.5-mini: 131072 / 4096 -> sqrt(1 + ln 32 / ln 4096)
        return RoPE(n_rot, base, 1.0, kind, freq_factors=longrope_factors(n_rot),
                    attn_factor=float(np.sqrt(1 + np.log(32.0) / np.log(4096.0))))
    if name == "yarn":       # Qwen2.5: factor 4 over 32768, llama.cpp's attn_factor rule
        return RoPE(n_rot, 1e6, 0.25, kind, ext_factor=1.0, attn_factor=yarn_attn_factor(0.25), n_ctx_orig=32768)
    if name == "yarn_factors":  # YaRN and factors together, attn_factor != 1
        return RoPE(n_rot, base, 0.125, kind, freq_factors=longrope_factors(n_rot), ext_factor=0.5,
                    attn_factor=0.8, n_ctx_orig=4096, beta_fast=16.0, beta_slow=2.0)
    if name == "attn":
        return RoPE(n_rot, base, 0.5, kind, attn_factor=1.25)
    raise KeyError(name)


SCALED = ["llama3", "longrope", "yarn", "yarn_factors", "attn"]


def np_rope_scaled(x, pos, r):
    c, s = np_trig_scaled(pos, r.n_rot, r.freq_base, r.freq_scale, r.factors, r.ext_factor, r.attn_factor,
                          r.corr_dims)
    return rotate(x.astype(F32), c, s, r.n_rot, r.mode)


def test_plain_bits_are_the_recorded_ones():
    """No factors, ext_factor 0, attn_factor 1: every output is bit for bit what the kernels gave before
    the scaling kinds existed (tests/data/rope/plain.npz, recorded then), for the defaults and for the
    scaling keywords given explicitly with their neutral values (factors of 1 divide exactly)."""
    from pathlib import Path
    d = np.load(Path(__file__).parent / "data" / "rope" / "plain.npz")
    for i in range(4):
        p, n_rot, base, scale = d[f"cache{i}_args"]
        ones = np.ones(int(n_rot) // 2, F32)
        assert R.rope_cache(int(p), int(n_rot), base, scale).tobytes() == d[f"cache{i}_out"].tobytes()
        assert R.rope_cache(int(p), int(n_rot), base, scale, freq_factors=ones, attn_factor=1.0,
                            ext_factor=0.0, corr_dims=(3.0, 9.0)).tobytes() == d[f"cache{i}_out"].tobytes()
    for i in range(4):
        kind, n_rot, head_dim, base, scale = d[f"rope{i}_args"]
        args = (d[f"rope{i}_pos"], int(n_rot), base, scale, int(kind))
        want = d[f"rope{i}_out"].tobytes()
        ones = np.ones(int(n_rot) // 2, F32)
        assert R.rope_f32(d[f"rope{i}_x"].copy(), *args, n_threads=2).tobytes() == want
        assert R.rope_f32_ref(d[f"rope{i}_x"].copy(), *args).tobytes() == want
        assert R.rope_f32(d[f"rope{i}_x"].copy(), *args, freq_factors=ones, attn_factor=1.0).tobytes() == want
    for i in range(4):
        kind, n_rot, head_dim, rot = (int(v) for v in d[f"shift{i}_args"])
        t = str(d[f"shift{i}_type"])
        k, shift, want = d[f"shift{i}_k"], d[f"shift{i}_shift"], d[f"shift{i}_out"].tobytes()
        args = (shift, 2, head_dim, n_rot, 10000.0, 1.0, kind)
        assert R.k_shift_ref(k.copy(), *args, type=t, rot_block=rot).tobytes() == want
        assert R.k_shift_ref(k.copy(), *args, type=t, rot_block=rot,
                             freq_factors=np.ones(n_rot // 2, F32)).tobytes() == want
        if rot == 0:   # the fast Hadamard transform rounds differently (hadamard.h); without it, the same bits
            assert R.k_shift(k.copy(), *args, type=t, rot_block=rot, n_threads=2).tobytes() == want


@pytest.mark.parametrize("n_dims,n_ctx_orig,base,fast,slow", [(128, 32768, 1e6, 32.0, 1.0),
                                                               (64, 4096, 10000.0, 32.0, 1.0),
                                                               (128, 8192, 500000.0, 16.0, 2.0),
                                                               (32, 2048, 10000.0, 32.0, 1.0)])
def test_yarn_corr_dims_is_ggmls(n_dims, n_ctx_orig, base, fast, slow):
    got = R.yarn_corr_dims(n_dims, n_ctx_orig, base, fast, slow)
    assert got == np_yarn_corr_dims(n_dims, n_ctx_orig, base, fast, slow)
    assert RoPE(n_dims, base, n_ctx_orig=n_ctx_orig, beta_fast=fast, beta_slow=slow).corr_dims == got
    assert R.yarn_corr_dims(128, 32768, 1e6) == (23.0, 40.0)   # Qwen2.5's YaRN: pairs 23 .. 40 are blended


@pytest.mark.parametrize("name", SCALED)
@pytest.mark.parametrize("n_rot", [128, 64, 8])
def test_rope_cache_scaled_matches_numpy(name, n_rot):
    r = scaled_rope(name, n_rot)
    for p in [0, 1, 7, 100, 4095, 30000, 131000]:
        got = R.rope_cache(p, n_rot, r.freq_base, r.freq_scale, **r.scaling_kwargs)
        c, s = np_trig_scaled(np.array([p]), n_rot, r.freq_base, r.freq_scale, r.factors, r.ext_factor,
                              r.attn_factor, r.corr_dims)
        want = np.stack([c[0], s[0]], axis=-1).reshape(-1)
        np.testing.assert_array_max_ulp(got, want, maxulp=4)
    m = magnitude(r.freq_scale, r.ext_factor, r.attn_factor)
    assert R.rope_cache(0, n_rot, r.freq_base, r.freq_scale, **r.scaling_kwargs).tolist() == [float(m), 0.0] * (n_rot // 2)


def test_scaling_kinds_change_the_angles_they_should():
    """Factors divide pair i's angle; YaRN keeps the fast pairs (below corr_dims[0]) unscaled and the
    slow ones (above corr_dims[1]) scaled by freq_scale; attn_factor scales the magnitude only."""
    n_rot, p = 128, 1000
    plain = R.rope_cache(p, n_rot, 1e6, 1.0).reshape(-1, 2)
    ang = np.arctan2(plain[:, 1].astype(np.float64), plain[:, 0])
    ff = np.full(n_rot // 2, 1.0, F32)
    ff[40:] = 4.0                                      # slow pairs only: angle / 4 stays < pi
    got = R.rope_cache(p, n_rot, 1e6, 1.0, freq_factors=ff).reshape(-1, 2)
    np.testing.assert_array_equal(got[:40], plain[:40])
    np.testing.assert_allclose(np.arctan2(got[40:, 1], got[40:, 0]), ang[40:] / 4, rtol=1e-5, atol=1e-7)
    r = scaled_rope("yarn", n_rot)
    lo, hi = r.corr_dims
    y = R.rope_cache(p, n_rot, r.freq_base, r.freq_scale, **r.scaling_kwargs).reshape(-1, 2)
    lin = R.rope_cache(p, n_rot, r.freq_base, r.freq_scale).reshape(-1, 2)
    m = float(magnitude(r.freq_scale, 1.0, r.attn_factor))
    assert 1.13 < m < 1.14                             # 1 + 0.1 ln 4 (the attn_factor rule cancels to ~1)
    np.testing.assert_allclose(y[:int(lo)], plain[:int(lo)] * m, rtol=2e-6, atol=2e-7)
    np.testing.assert_allclose(y[int(hi) + 1:], lin[int(hi) + 1:] * m, rtol=2e-6, atol=2e-7)
    a = R.rope_cache(p, n_rot, 1e6, 1.0, attn_factor=0.5)
    assert a.tobytes() == (plain.reshape(-1) * F32(0.5)).tobytes()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", SCALED)
@pytest.mark.parametrize("n_rot,head_dim", [(64, 64), (32, 96), (8, 12)])
def test_rope_f32_scaled_matches_numpy(kind, name, n_rot, head_dim):
    r = scaled_rope(name, n_rot, kind="neox" if kind == R.ROPE_NEOX else "norm")
    rng = np.random.default_rng(n_rot + head_dim + kind + SCALED.index(name))
    x = data(rng, 64, 8, head_dim)   # 64 * 8 * n_rot >= 2^15 for n_rot 64: OpenMP splits the tokens
    pos = rng.integers(0, 100000, 64).astype(np.int32)
    args = (pos, n_rot, r.freq_base, r.freq_scale, r.mode)
    ref = R.rope_f32_ref(x.copy(), *args, **r.scaling_kwargs)
    for nt in (1, 2):
        assert R.rope_f32(x.copy(), *args, nt, **r.scaling_kwargs).tobytes() == ref.tobytes()
    m = float(magnitude(r.freq_scale, r.ext_factor, r.attn_factor))
    np.testing.assert_allclose(ref, np_rope_scaled(x, pos, r), rtol=0, atol=atol_emu(x) * m)
    assert np.array_equal(ref[..., n_rot:], x[..., n_rot:])          # pass-through dims untouched
    if name != "attn":                                              # the scaling changed the result
        assert not np.allclose(ref, R.rope_f32_ref(x.copy(), *args), atol=1e-3)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", SCALED)
def test_k_shift_scaled_fast_equals_ref_and_numpy(dtype, kind, name):
    n_rot, head_dim, kv_size, n_head_kv = 64, 80, 257, 8
    r = scaled_rope(name, n_rot, kind="neox" if kind == R.ROPE_NEOX else "norm")
    rng = np.random.default_rng(SCALED.index(name) * 4 + kind + (dtype == np.float16))
    k = (rng.standard_normal((kv_size, n_head_kv * head_dim)) * 4).astype(dtype)
    shift = rng.integers(-3000, 3000, kv_size).astype(np.int32)
    shift[rng.random(kv_size) < 0.3] = 0
    shift[100:160] = 77
    args = (shift, n_head_kv, head_dim, n_rot, r.freq_base, r.freq_scale, r.mode)
    ref = R.k_shift_ref(k.copy(), *args, **r.scaling_kwargs)
    for nt in (1, 2):
        assert R.k_shift(k.copy(), *args, nt, **r.scaling_kwargs).tobytes() == ref.tobytes()
    assert ref[shift == 0].tobytes() == k[shift == 0].tobytes()
    if dtype == np.float16:
        via_f32 = R.k_shift_ref(k.astype(np.float32), *args, **r.scaling_kwargs)
        assert ref.tobytes() == via_f32.astype(np.float16).tobytes()
    else:
        x = k.reshape(kv_size, n_head_kv, head_dim)
        want = np.where((shift != 0)[:, None, None], np_rope_scaled(x, shift, r), x).reshape(kv_size, -1)
        m = float(magnitude(r.freq_scale, r.ext_factor, r.attn_factor))
        np.testing.assert_allclose(ref, want, rtol=0, atol=atol_emu(k) * m)


@pytest.mark.parametrize("t", ["q8_0", "q4_0"])
@pytest.mark.parametrize("name", ["llama3", "yarn"])
def test_k_shift_scaled_quantized_vs_numpy(t, name):
    """A quantized K shifted with factors / YaRN: as the dequantize -> RoPE -> quantize oracle, within
    one quantization step (the plain case's test above, with the layer's scaling)."""
    n_rot = head_dim = 64
    r = scaled_rope(name, n_rot, kind="neox")
    rng = np.random.default_rng(17)
    kv_size, n_head_kv = 40, 2
    k = _enc(t, data(rng, kv_size, n_head_kv * head_dim))
    shift = rng.integers(-3000, 3000, kv_size).astype(np.int32)
    shift[::5] = 0
    args = (shift, n_head_kv, head_dim, n_rot, r.freq_base, r.freq_scale, r.mode)
    fast = R.k_shift(k.copy(), *args, 2, type=t, **r.scaling_kwargs)
    assert fast.tobytes() == R.k_shift_ref(k.copy(), *args, type=t, **r.scaling_kwargs).tobytes()
    n = n_head_kv * head_dim
    x = _deq(t, k, n).reshape(kv_size, n_head_kv, head_dim)
    want = _enc(t, np.ascontiguousarray(np_rope_scaled(x, shift, r).reshape(kv_size, -1)))
    want[shift == 0] = k[shift == 0]
    diff = np.abs(_deq(t, fast, n).astype(np.float64) - _deq(t, want, n))
    assert np.all(diff <= 1.01 * _step(t, want, n) + 1e-5)
    assert np.mean(fast == want) > 0.98


def atol_compose_scaled(x, a, b, n_rot, m):
    """atol_compose with three more roundings per angle (the division by the factor, YaRN's blend of
    two products), on values of magnitude m^2 (the shift multiplies by m once more)."""
    drift = (np.abs(a) + np.abs(b) + np.abs(np.asarray(a) + np.asarray(b))).max() * (n_rot / 2 + 5) * 2.0 ** -24
    return float(np.abs(x).max()) * m * m * (float(drift) + 1e-5)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", SCALED)
@pytest.mark.parametrize("n_rot", [64, 32])
def test_k_shift_scaled_equals_rope_at_shifted_position(kind, name, n_rot):
    """rope(K at p) then k_shift(d), both with the layer's factors / YaRN, == rope(K at p + d) times the
    magnitude m (llama.cpp's build_rope_shift applies attn_factor and YaRN's magnitude again; with
    frequency factors alone m = 1 and this is rope at p + d). Angles add: each is linear in p."""
    r = scaled_rope(name, n_rot, kind="neox" if kind == R.ROPE_NEOX else "norm")
    rng = np.random.default_rng(5 + n_rot + kind + SCALED.index(name))
    kv_size, n_head_kv, head_dim = 300, 4, 64
    k = data(rng, kv_size, n_head_kv, head_dim)
    p = rng.integers(0, 3000, kv_size).astype(np.int32)
    d = np.repeat(rng.integers(-500, 500, 10), 30).astype(np.int32)
    d[::17] = 0
    kw = r.scaling_kwargs
    k_rows = R.rope_f32(k.copy(), p, n_rot, r.freq_base, r.freq_scale, r.mode, **kw).reshape(kv_size, -1)
    R.k_shift(k_rows, d, n_head_kv, head_dim, n_rot, r.freq_base, r.freq_scale, r.mode, 2, **kw)
    m = float(magnitude(r.freq_scale, r.ext_factor, r.attn_factor))
    want = R.rope_f32(k.copy(), (p + d).astype(np.int32), n_rot, r.freq_base, r.freq_scale, r.mode, **kw)
    want[d != 0, :, :n_rot] *= F32(m)                  # the rotated dims only: the others pass through
    want = want.reshape(kv_size, -1)
    np.testing.assert_allclose(k_rows, want, rtol=0, atol=atol_compose_scaled(k, p, d, n_rot, m))


BAD_SCALING = [
    dict(freq_factors=np.ones(3, F32)),                         # length != n_rot/2
    dict(freq_factors=np.ones(2, np.float64)),                  # dtype
    dict(freq_factors=np.ones((2, 1), F32)),                    # shape
    dict(freq_factors=np.array([1.0, 0.0], F32)),               # 0
    dict(freq_factors=np.array([1.0, -2.0], F32)),              # < 0
    dict(freq_factors=np.array([1.0, np.nan], F32)),            # not finite
    dict(freq_factors=np.array([1.0, np.inf], F32)),
    dict(freq_factors=[1.0, 2.0]),                              # not an array
    dict(ext_factor=np.nan),
    dict(attn_factor=np.inf),
    dict(ext_factor=1.0, corr_dims=(0.0, -np.inf)),             # YaRN needs finite bounds
    dict(corr_dims=(1.0,)),                                     # not two bounds
]


@pytest.mark.parametrize("kw", BAD_SCALING)
def test_bad_scaling_raises_and_leaves_data_unchanged(kw):
    x = np.ones((2, 1, 4), F32)
    k = np.ones((2, 8), F32)
    for call in (lambda: R.rope_f32(x, POS2, 4, **kw), lambda: R.rope_f32_ref(x, POS2, 4, **kw),
                 lambda: R.k_shift(k, POS2 + 1, 2, 4, 4, **kw), lambda: R.k_shift_ref(k, POS2 + 1, 2, 4, 4, **kw),
                 lambda: R.rope_cache(3, 4, **kw)):
        with pytest.raises(ValueError):
            call()
    assert np.all(x == 1) and np.all(k == 1)
    with pytest.raises(ValueError):
        R.rope_f32(x, POS2, 4, freq_scale=0.0, ext_factor=1.0, corr_dims=(0.0, 1.0))   # log(1 / 0)
    with pytest.raises(ValueError):
        R.yarn_corr_dims(1, 4096, 10000.0)


# ---- llamax.RoPE ------------------------------------------------------------------------------------

def test_rope_dataclass_defaults_are_plain_and_hashable():
    r = RoPE(64)
    assert (r.freq_factors, r.ext_factor, r.attn_factor, r.n_ctx_orig) == (None, 0.0, 1.0, 0)
    assert r.factors is None and r.corr_dims == (0.0, 0.0)
    assert r.scaling_kwargs == dict(freq_factors=None, ext_factor=0.0, attn_factor=1.0, corr_dims=(0.0, 0.0))
    a = RoPE(8, freq_factors=np.array([1, 2, 3, 4], np.float32), attn_factor=1.5)
    b = RoPE(8, freq_factors=[1.0, 2.0, 3.0, 4.0], attn_factor=1.5)
    assert a == b and hash(a) == hash(b) and len({a, b, RoPE(8)}) == 2
    assert isinstance(a.freq_factors, tuple) and a.factors.dtype == np.float32 and a.factors.shape == (4,)
    assert a.factors is a.factors                       # cached
    with pytest.raises(ValueError):
        a.factors[0] = 9.0                              # read-only: the RoPE stays what its hash says
    y = RoPE(128, 1e6, 0.25, "neox", ext_factor=1.0, n_ctx_orig=32768)
    assert y.corr_dims == (23.0, 40.0)


@pytest.mark.parametrize("kw", [
    dict(freq_factors=[1.0, 2.0, 3.0]), dict(freq_factors=[1.0, 2.0, 3.0, 0.0]),
    dict(freq_factors=[1.0, 2.0, 3.0, -1.0]), dict(freq_factors=[1.0, 2.0, 3.0, float("nan")]),
    dict(freq_factors=[[1.0, 2.0], [3.0, 4.0]]), dict(ext_factor=-1.0), dict(ext_factor=float("inf")),
    dict(ext_factor=1.0), dict(ext_factor=1.0, n_ctx_orig=-5), dict(attn_factor=0.0),
    dict(attn_factor=float("nan")), dict(beta_fast=0.0), dict(beta_slow=float("inf")), dict(n_ctx_orig=1.5),
])
def test_rope_dataclass_validates(kw):
    with pytest.raises(ValueError):
        RoPE(8, **kw)


def test_yarn_attn_factor_is_llamacpps_rule():
    """llama_context: get_mscale(1 / freq_scale) / (1 + 0.1 ln(1 / freq_scale)) (times the GGUF's
    attn_factor), ~1 without a log multiplier; with one, get_mscale(f, 1) / get_mscale(f, log_mul)."""
    assert abs(yarn_attn_factor(0.25) - 1.0) <= 2 ** -23
    f = 4.0
    want = (0.1 * np.log(f) + 1) / (0.1 * 0.707 * np.log(f) + 1) / (1 + 0.1 * np.log(f))
    assert abs(yarn_attn_factor(0.25, log_mul=0.707) - want) < 1e-6
    assert abs(yarn_attn_factor(0.25, rope_attn_factor=0.5) - 0.5) <= 2 ** -24
    assert yarn_attn_factor(1.0) == 1.0
    with pytest.raises(ValueError):
        yarn_attn_factor(0.0)


def test_llama3_freq_factors():
    """Llama 3.1's factors (head 128, base 500000): short wavelengths kept, long ones divided by 8, a blend
    between that rises monotonically; bad sizes refused."""
    from llamax.rope import llama3_freq_factors

    f = llama3_freq_factors(128, 500000.0)
    assert len(f) == 64 and f[0] == 1.0 and f[-1] == 8.0
    assert all(a <= b for a, b in zip(f, f[1:])) and any(1.0 < x < 8.0 for x in f)
    RoPE(128, 500000.0, freq_factors=f)   # a RoPE takes them as they are
    for bad in ((0, 1e4), (7, 1e4), (128, 0.0)):
        with pytest.raises(ValueError):
            llama3_freq_factors(*bad)
