"""Tests of the KV cache block formats of csrc/quants (q8_0, q4_0) and set_rows.

Oracles: blocks computed by hand from ggml's rules (quantize_row_q8_0_ref / quantize_row_q4_0_ref
in ggml-quants.c), numpy re-statements of those rules, and the scalar _ref rows (the fast rows must
give the same bytes). Round-trip bounds on deterministic cos-based data:
  q8_0: |x - q*d16| <= d/2 + 127*|d - d16|      (d = amax/127, d16 its f16 rounding)
  q4_0: |x - (q-8)*d16| <= |d|/2 + 8*|d - d16|  (d = max/-8; the value at max lands on q = 0 exactly)
"""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llamax._native import quants as Q

# every fast path against its scalar reference, at each SIMD level of this CPU
pytestmark = pytest.mark.usefixtures("every_simd_level")

QK = 32


def f16(x) -> np.float32:
    return np.float32(np.float16(x))


def block_q8_0(d: float, qs) -> bytes:
    return np.float16(d).tobytes() + np.asarray(qs, np.int8).tobytes()


def block_q4_0(d: float, q) -> bytes:
    q = np.asarray(q, np.uint8)
    return np.float16(d).tobytes() + (q[:16] | (q[16:] << 4)).astype(np.uint8).tobytes()


def cos_data(n_rows: int, n: int, scale: float = 3.0) -> np.ndarray:
    i = np.arange(n_rows * n, dtype=np.float64)
    return (scale * np.cos(0.37 * i) * (1 + 0.5 * np.cos(0.011 * i))).astype(np.float32).reshape(n_rows, n)


# ---- layouts and names ------------------------------------------------------------------------------

def test_block_sizes_per_value():
    """q8_0: 34 bytes per 32 values; q4_0: 18 bytes per 32 (llama.cpp's block_q8_0 / block_q4_0)."""
    assert Q.block_size("q8_0") == Q.block_size("q4_0") == 32
    assert Q.block_bytes("q8_0") == 34 and Q.block_bytes("q4_0") == 18
    for n in (32, 64, 4096):
        assert Q.row_bytes("q8_0", n) == n * 34 // 32
        assert Q.row_bytes("q4_0", n) == n * 18 // 32
        assert Q.row_bytes("f16", n) == 2 * n and Q.row_bytes("f32", n) == 4 * n


def test_type_names():
    assert Q.type_id("q8_0") == Q.TYPE_Q8_0 == Q.type_id("Q8_0") == Q.type_id(Q.TYPE_Q8_0)
    assert Q.type_id("q4_0") == Q.TYPE_Q4_0 and Q.type_id("f16") == Q.TYPE_F16 and Q.type_id("f32") == 0
    assert Q.type_name(Q.TYPE_Q4_0) == "q4_0"
    assert Q.CACHE_TYPE_NAMES == ("f32", "f16", "q8_0", "q4_0")
    for bad in ("q3_0", "", 99, True, 1.0):
        with pytest.raises(ValueError, match="unknown ggml type"):
            Q.type_id(bad)


# ---- hand-computed blocks -------------------------------------------------------------------------

def test_q4_0_hand_block():
    """max = -4 (largest magnitude, negative): d = -4/-8 = 0.5, id = 2, q = min(15, int(x*2 + 8.5))."""
    x = np.zeros(32, np.float32)
    x[:8] = [-4.0, 1.0, 0.25, -0.25, 3.9, -1.2, 0.74, 0.76]
    x[16] = 3.99                       # 3.99*2 + 8.5 = 16.48 -> 16 -> clamped to 15
    x[31] = -3.0
    q = np.full(32, 8)                 # zeros: int(8.5) = 8
    q[:8] = [0, 10, 9, 8, 15, 6, 9, 10]
    q[16], q[31] = 15, 2
    want = block_q4_0(0.5, q)
    assert Q.quantize("q4_0", x).tobytes() == want
    assert Q.quantize_ref("q4_0", x).tobytes() == want
    y = Q.dequantize("q4_0", np.frombuffer(want, np.uint8), 32)
    np.testing.assert_array_equal(y, (q - 8) * np.float32(0.5))


def test_q4_0_positive_max_and_first_of_ties():
    """max = +6 gives a negative scale d = -0.75; with +-6 both present the first one wins."""
    x = np.zeros(32, np.float32)
    x[3], x[9] = 6.0, -6.0
    x[20] = 1.5
    got = Q.quantize("q4_0", x)
    d = np.frombuffer(got[:2].tobytes(), np.float16)[0]
    assert d == np.float16(-0.75)
    y = Q.dequantize("q4_0", got, 32)
    assert y[3] == 6.0 and y[9] == -6.0 + 0.75 and y[20] == 1.5  # 6 / -0.75 = -8 -> q 0; -6 -> q 16 -> 15
    x[3], x[9] = -6.0, 6.0
    d2 = np.frombuffer(Q.quantize("q4_0", x)[:2].tobytes(), np.float16)[0]
    assert d2 == np.float16(0.75)
    np.testing.assert_array_equal(Q.quantize("q4_0", x), Q.quantize_ref("q4_0", x))


def test_q4_0_zero_block_scale_is_negative_zero():
    """All zeros: max = +0, d = 0/-8 = -0 (ggml's bits), every q = 8."""
    got = Q.quantize("q4_0", np.zeros(64, np.float32))
    assert got.tobytes() == block_q4_0(-0.0, np.full(32, 8)) * 2
    assert np.frombuffer(got[:2].tobytes(), np.uint16)[0] == 0x8000


def test_q8_0_hand_block():
    """amax = 127 * 0.5: d = 0.5, qs = roundf(x / 0.5) (ties away from zero)."""
    x = np.zeros(32, np.float32)
    x[:6] = [63.5, -63.5, 0.25, -0.25, 0.75, 10.0]
    qs = np.zeros(32, np.int8)
    qs[:6] = [127, -127, 1, -1, 2, 20]      # 0.5 -> 1 and 1.5 -> 2: away from zero
    want = block_q8_0(0.5, qs)
    assert Q.quantize("q8_0", x).tobytes() == want == Q.quantize_ref("q8_0", x).tobytes()


# ---- fast == ref, numpy restatement, round trip ---------------------------------------------------

def np_q4_0(x: np.ndarray) -> bytes:
    """quantize_row_q4_0_ref in numpy (first index of the largest magnitude)."""
    out = b""
    for b in x.reshape(-1, QK):
        mx = b[int(np.argmax(np.abs(b)))] if np.abs(b).max() > 0 else np.float32(0)
        d = np.float32(mx) / np.float32(-8)
        idv = np.float32(1) / d if d != 0 else np.float32(0)
        with np.errstate(invalid="ignore", over="ignore"):
            v = (b * idv).astype(np.float32)
        v = np.where(np.isnan(v), np.float32(0), v)        # clamp_q: a NaN (0 * inf) gives 0
        v = np.clip(v, -8, 8).astype(np.float32) + np.float32(8.5)
        q = np.minimum(15, np.trunc(v)).astype(np.uint8)
        out += block_q4_0(d, q)
    return out


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-1e3, 1e3, width=32), min_size=128, max_size=128),
       st.sampled_from(["q8_0", "q4_0"]))
def test_fast_equals_ref_property(vals, t):
    x = np.asarray(vals, np.float32)
    np.testing.assert_array_equal(Q.quantize(t, x), Q.quantize_ref(t, x))
    if t == "q4_0":
        assert Q.quantize(t, x).tobytes() == np_q4_0(x)


@pytest.mark.parametrize("t", ["q8_0", "q4_0"])
def test_fast_equals_ref_cos_rows(t):
    x = cos_data(64, 256)
    x[3, :32] = 0.0
    x[5, 40] = 1e4                      # an outlier block
    np.testing.assert_array_equal(Q.quantize(t, x), Q.quantize_ref(t, x))
    if t == "q4_0":
        assert Q.quantize(t, x[:4]).tobytes() == np_q4_0(x[:4])


@pytest.mark.parametrize("t", ["q8_0", "q4_0"])
def test_round_trip_error_bounds(t):
    x = cos_data(32, 512).astype(np.float64)
    raw = Q.quantize(t, x.astype(np.float32))
    y = Q.dequantize(t, raw, x.shape).astype(np.float64)
    xb = x.reshape(-1, QK)
    if t == "q8_0":
        d = (np.abs(xb).max(axis=1) / 127).astype(np.float32).astype(np.float64)[:, None]
        bound = d / 2 + 127 * np.abs(d - d.astype(np.float16))
    else:
        # d = max / -8: x / d lies in [-8, 8]; q = trunc(x/d + 8.5) is x/d rounded, except that
        # x/d in (7.5, 8] (the opposite sign of max) is clamped to q = 15, one step off
        mx = xb[np.arange(len(xb)), np.abs(xb).argmax(axis=1)]
        d = (mx / np.float32(-8)).astype(np.float32).astype(np.float64)[:, None]
        steps = np.where(xb / d > 7.5, 1.0, 0.5)
        bound = steps * np.abs(d) + 8 * np.abs(d - d.astype(np.float16))
    err = np.abs(y - x).reshape(-1, QK)
    assert np.all(err <= bound * (1 + 1e-6) + 1e-30)
    # and the bounds are what they claim: relative rms of order 1/254 (q8_0), 1/16 (q4_0)
    rel = np.sqrt(np.mean((y - x) ** 2) / np.mean(x ** 2))
    assert rel < (0.006 if t == "q8_0" else 0.09)


def test_quantize_f32_f16_bytes():
    x = cos_data(3, 64)
    assert Q.quantize("f32", x).tobytes() == x.tobytes()
    assert Q.quantize("f16", x).tobytes() == x.astype(np.float16).tobytes()
    assert Q.quantize_ref("f16", x).tobytes() == x.astype(np.float16).tobytes()


# ---- set_rows ---------------------------------------------------------------------------------------

def _dst(t, n_rows, n_per_row):
    if t == "f32":
        return np.zeros((n_rows, n_per_row), np.float32)
    if t == "f16":
        return np.zeros((n_rows, n_per_row), np.float16)
    return np.zeros((n_rows, Q.row_bytes(t, n_per_row)), np.uint8)


@pytest.mark.parametrize("t", ["f32", "f16", "q8_0", "q4_0"])
@pytest.mark.parametrize("n_threads", [1, 2, None])
def test_set_rows_writes_the_named_rows(t, n_threads):
    n_rows, n_per_row = 50, 3 * 64
    src = cos_data(7, n_per_row)
    idxs = np.array([40, 3, 17, 0, 49, 8, 25], np.uint32)
    dst = _dst(t, n_rows, n_per_row)
    before = dst.copy()
    assert Q.set_rows(t, src, dst, idxs, n_threads) is dst
    want = Q.quantize(t, src).view(dst.dtype).reshape(7, -1)
    for i, r in enumerate(idxs):
        np.testing.assert_array_equal(dst[r], want[i])
    untouched = np.setdiff1d(np.arange(n_rows), idxs)
    np.testing.assert_array_equal(dst[untouched], before[untouched])
    ref = _dst(t, n_rows, n_per_row)
    Q.set_rows_ref(t, src, ref, idxs)
    np.testing.assert_array_equal(dst, ref)


@pytest.mark.parametrize("t", ["q8_0", "q4_0", "f16"])
def test_set_rows_many_rows_threads_identical(t):
    """Enough values to run in parallel; int64 / int32 indices are accepted."""
    src = cos_data(300, 256)
    idxs = np.random.default_rng(1).permutation(400)[:300]
    outs = []
    for nt, ix in ((1, idxs.astype(np.int64)), (2, idxs.astype(np.int32)), (3, idxs.astype(np.uint32))):
        dst = _dst(t, 400, 256)
        Q.set_rows(t, src, dst, ix, nt)
        outs.append(dst)
    assert all(np.array_equal(outs[0], o) for o in outs[1:])


def test_set_rows_repeated_index_last_wins():
    src = cos_data(3, 64)
    dst = _dst("q8_0", 4, 64)
    Q.set_rows("q8_0", src, dst, np.array([2, 1, 2]), n_threads=2)
    np.testing.assert_array_equal(dst[2], Q.quantize("q8_0", src[2]))
    np.testing.assert_array_equal(dst[1], Q.quantize("q8_0", src[1]))


def test_set_rows_uint8_dst_for_plain_types_and_empty():
    src = cos_data(2, 32)
    dst = np.zeros((3, 64), np.uint8)              # f16 rows as bytes
    Q.set_rows(Q.TYPE_F16, src, dst, np.array([2, 0]))
    assert dst[2].tobytes() == src[0].astype(np.float16).tobytes()
    assert not dst[1].any()
    Q.set_rows("q4_0", np.zeros((0, 32), np.float32), _dst("q4_0", 2, 32), np.zeros(0, np.uint32))


@pytest.mark.parametrize("kw,err", [
    (dict(t="q4_1"), "f32, f16, q8_0 or q4_0"),
    (dict(src=np.zeros((2, 48), np.float32)), "multiple of"),
    (dict(src=np.zeros((2, 64), np.float64)), "float32"),
    (dict(src=np.zeros(64, np.float32)), "float32"),
    (dict(src=np.full((2, 64), np.nan, np.float32)), "finite"),
    (dict(dst=np.zeros((4, 35), np.uint8)), "68 bytes"),
    (dict(dst=np.zeros((4, 68), np.int8)), "uint8"),
    (dict(dst=np.zeros((4, 2, 68), np.uint8)), "2-D"),
    (dict(dst=np.zeros((4, 136), np.uint8)[:, ::2]), "C-contiguous"),
    (dict(idxs=np.array([0, 4])), "in \\[0, 4\\)"),
    (dict(idxs=np.array([-1, 0])), "in \\[0, 4\\)"),
    (dict(idxs=np.array([0])), "1 entries for 2 rows"),
    (dict(idxs=np.array([0.0, 1.0])), "integer"),
])
def test_set_rows_errors_leave_dst_untouched(kw, err):
    args = dict(t="q8_0", src=cos_data(2, 64), dst=np.full((4, 68), 7, np.uint8), idxs=np.array([0, 1]))
    args.update(kw)
    before = args["dst"].copy()
    with pytest.raises(ValueError, match=err):
        Q.set_rows(args["t"], args["src"], args["dst"], args["idxs"])
    np.testing.assert_array_equal(args["dst"], before)


def test_set_rows_read_only_and_threads():
    dst = _dst("q8_0", 2, 32)
    dst.flags.writeable = False
    with pytest.raises(ValueError, match="writeable"):
        Q.set_rows("q8_0", cos_data(1, 32), dst, np.array([0]))
    with pytest.raises(ValueError, match="n_threads"):
        Q.set_rows("q8_0", cos_data(1, 32), _dst("q8_0", 2, 32), np.array([0]), n_threads=0)
