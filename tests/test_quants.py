"""Tests of csrc/quants (f16 rows), via the helpers in llamax._native.attention.

numpy's float16 casts are the oracle: the scalar references and the fast (F16C) rows must give
numpy's bits exactly, for every half and for float32 inputs chosen on every rounding boundary
(ties to even, denormals, the overflow threshold, infinities, NaNs with payloads).
"""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llamax._native import attention as A

# every fast path against its scalar reference, at each SIMD level of this CPU
pytestmark = pytest.mark.usefixtures("every_simd_level")

TO_HALF = [A.fp32_to_fp16, A.fp32_to_fp16_ref]
TO_FLOAT = [A.fp16_to_fp32, A.fp16_to_fp32_ref]


def np_half_bits(x32: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        return x32.astype(np.float16).view(np.uint16)


def float_bits(u32) -> np.ndarray:
    return np.asarray(u32, dtype=np.uint32).view(np.float32)


def boundary_floats() -> np.ndarray:
    """float32 values on and next to every kind of f16 rounding boundary, both signs."""
    halves = np.arange(0x7C00, dtype=np.uint32)           # every finite positive half
    exact = halves.astype(np.uint16).view(np.float16).astype(np.float32)
    eb = exact.view(np.uint32)
    nxt = np.append(exact[1:], np.float32(65536.0))       # the next half up (inf for the last)
    mid = ((exact.astype(np.float64) + nxt.astype(np.float64)) / 2).astype(np.float32)  # exact ties
    mb = mid.view(np.uint32)
    parts = [eb, eb + 1, eb - 1, mb, mb + 1, mb - 1,
             np.arange(0, 0x00800000, 4099, dtype=np.uint32),        # float denormals
             np.arange(0x33000000 - 64, 0x33000000 + 64, dtype=np.uint32),  # around 2^-25
             np.arange(0x477FE000 - 64, 0x47800000 + 64, dtype=np.uint32),  # 65504 .. 65536
             np.array([0x7F800000, 0x7F7FFFFF, 0x7FC00000, 0x7FC00001, 0x7F800001, 0x7F802000,
                       0x7FBFFFFF, 0x7FFFFFFF, 0x7FA00000, 0x7F801FFF], dtype=np.uint32)]
    u = np.concatenate(parts)
    u = u[(u & 0x7FFFFFFF) == u]                          # drop wrapped values of eb - 1 at 0
    return float_bits(np.concatenate([u, u | 0x80000000]))


@pytest.mark.parametrize("fn", TO_FLOAT, ids=["fast", "ref"])
def test_every_half_to_float(fn):
    h = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16)
    got = fn(h)
    assert got.dtype == np.float32 and got.shape == h.shape
    assert np.array_equal(got.view(np.uint32), h.astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("fn", TO_HALF, ids=["fast", "ref"])
def test_boundaries_to_half(fn):
    x = boundary_floats()
    got = fn(x)
    assert got.dtype == np.float16 and got.shape == x.shape
    want = np_half_bits(x)
    bad = np.nonzero(got.view(np.uint16) != want)[0]
    assert bad.size == 0, [(hex(x.view(np.uint32)[i]), hex(got.view(np.uint16)[i]), hex(want[i])) for i in bad[:5]]


@pytest.mark.parametrize("fn", TO_HALF, ids=["fast", "ref"])
def test_strided_sweep_of_all_floats(fn):
    u = np.arange(0, 2**32, 65537, dtype=np.uint64).astype(np.uint32)
    x = float_bits(u)
    assert np.array_equal(fn(x).view(np.uint16), np_half_bits(x))


def test_ties_round_to_even():
    # 1 + 2^-11 lies halfway between 1 and 1 + 2^-10: even mantissa 0 wins; 1 + 3*2^-11 -> 1 + 2^-9
    x = np.array([1 + 2**-11, 1 + 3 * 2**-11, 2**-25, 3 * 2**-25, 65520.0, 65519.996], dtype=np.float32)
    want = np.array([0x3C00, 0x3C02, 0x0000, 0x0002, 0x7C00, 0x7BFF], dtype=np.uint16)
    for fn in TO_HALF:
        assert np.array_equal(fn(x).view(np.uint16), want)


def test_nan_payloads_and_signs():
    """numpy keeps a NaN's sign and top payload bits, and never turns a NaN into inf."""
    u = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FA5A000, 0x7F802000], dtype=np.uint32)
    x = float_bits(u)
    for fn in TO_HALF:
        got = fn(x).view(np.uint16)
        assert np.array_equal(got, np_half_bits(x))
        assert all((g & 0x7C00) == 0x7C00 and (g & 0x3FF) for g in got)
    h = np.array([0x7C01, 0xFE00, 0x7D55, 0xFDFF], dtype=np.uint16).view(np.float16)
    for fn in TO_FLOAT:
        assert np.array_equal(fn(h).view(np.uint32), h.astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 15, 16, 17, 33, 1000])
def test_lengths_and_shapes(n):
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * 1000).astype(np.float32)
    if n > 3:
        x[n // 2] = np.nan  # a NaN inside a vector group sends that group to the scalar code
    for fn in TO_HALF:
        assert np.array_equal(fn(x).view(np.uint16), np_half_bits(x))
    x2 = rng.standard_normal((3, 5, 7)).astype(np.float32)
    assert A.fp32_to_fp16(x2).shape == (3, 5, 7)
    assert np.array_equal(A.fp16_to_fp32(A.fp32_to_fp16(x2)), x2.astype(np.float16).astype(np.float32))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=64))
def test_random_bits_fast_equals_ref_equals_numpy(bits):
    x = float_bits(bits)
    want = np_half_bits(x)
    assert np.array_equal(A.fp32_to_fp16(x).view(np.uint16), want)
    assert np.array_equal(A.fp32_to_fp16_ref(x).view(np.uint16), want)
    h = np.asarray([b & 0xFFFF for b in bits], dtype=np.uint16).view(np.float16)
    assert np.array_equal(A.fp16_to_fp32(h).view(np.uint32), A.fp16_to_fp32_ref(h).view(np.uint32))


def test_argument_errors():
    with pytest.raises(ValueError, match="float32"):
        A.fp32_to_fp16(np.zeros(4, np.float64))
    with pytest.raises(ValueError, match="float16"):
        A.fp16_to_fp32(np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="C-contiguous"):
        A.fp32_to_fp16(np.zeros((4, 4), np.float32).T)
    with pytest.raises(TypeError, match="numpy array"):
        A.fp32_to_fp16([1.0, 2.0])
