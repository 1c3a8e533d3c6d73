"""Tests of ggml's block formats in csrc/quants (via llamax._native.quants).

Three oracles for dequantization, all required to agree bit for bit:
  - `np_dequantize` below: a numpy re-implementation of ggml's dequantize_row_* (ggml-quants.c),
    float32 arithmetic in ggml's order (d*sc rounded first, then * q, then - min);
  - the scalar C references (dequantize_ref);
  - the `gguf` package's own numpy dequantizer (gguf.quants.dequantize).
Data: random blocks (random bytes, finite f16 scales), blocks quantized by gguf, and real tensors of
the SmolLM2 GGUF when it is on this machine. The activation quantizers (q8_0 / q8_1 / q8_K, and
q4_0) must match numpy re-implementations of ggml's quantize_row_*_ref, fast and _ref alike.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llamax._native import quants as Q

gguf = pytest.importorskip("gguf")
from gguf import quants as gq  # noqa: E402

# every fast path against its scalar reference, at each SIMD level of this CPU
pytestmark = pytest.mark.usefixtures("every_simd_level")

QK, QK_K = 32, 256
WEIGHT_TYPES = [Q.TYPE_Q4_0, Q.TYPE_Q4_1, Q.TYPE_Q5_0, Q.TYPE_Q5_1, Q.TYPE_Q8_0, Q.TYPE_Q2_K,
                Q.TYPE_Q3_K, Q.TYPE_Q4_K, Q.TYPE_Q5_K, Q.TYPE_Q6_K]
PLAIN_TYPES = [Q.TYPE_F32, Q.TYPE_F16, Q.TYPE_BF16]
# byte offsets of the f16 scales inside each block (ggml-common.h)
F16_FIELDS = {Q.TYPE_Q4_0: [0], Q.TYPE_Q4_1: [0, 2], Q.TYPE_Q5_0: [0], Q.TYPE_Q5_1: [0, 2],
              Q.TYPE_Q8_0: [0], Q.TYPE_Q2_K: [80, 82], Q.TYPE_Q3_K: [108], Q.TYPE_Q4_K: [0, 2],
              Q.TYPE_Q5_K: [0, 2], Q.TYPE_Q6_K: [208]}
NAMES = Q.TYPE_NAMES


def name(t: int) -> str:
    return NAMES[t]


# ---- data ------------------------------------------------------------------------------------

def random_blocks(t: int, n_blocks: int, rng: np.random.Generator, scale: float = 0.02) -> np.ndarray:
    """uint8 [n_blocks, block_bytes]: random bytes with finite f16 scales of magnitude ~scale
    (both signs; the K formats' d/dmin also take zeros now and then)."""
    if t in PLAIN_TYPES:
        v = rng.standard_normal(n_blocks).astype(np.float32)
        if t == Q.TYPE_F32:
            return v.view(np.uint8).reshape(n_blocks, 4)
        if t == Q.TYPE_F16:
            return v.astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
        return (v.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8).reshape(n_blocks, 2)
    raw = rng.integers(0, 256, size=(n_blocks, Q.block_bytes(t)), dtype=np.uint8)
    for off in F16_FIELDS[t]:
        d = (rng.standard_normal(n_blocks) * scale).astype(np.float16)
        d[rng.random(n_blocks) < 0.05] = 0
        raw[:, off:off + 2] = d.view(np.uint8).reshape(n_blocks, 2)
    return raw


def f16(b: np.ndarray) -> np.ndarray:
    """[..., 2] uint8 -> float32 (exact)."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


# ---- numpy re-implementation of ggml's dequantize_row_* -----------------------------------------

def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[nb, 16] bytes -> [nb, 32]: low nibbles (values 0..15) then high nibbles (16..31)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.int32)


def _qh_bits(qh: np.ndarray) -> np.ndarray:
    """[nb, 4] bytes (a little-endian uint32) -> [nb, 32]: bit j of qh for value j."""
    u = np.ascontiguousarray(qh).view("<u4")[:, 0].astype(np.int64)
    return ((u[:, None] >> np.arange(32)) & 1).astype(np.int32)


def k_scale_min(s12: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's get_scale_min_k4 for j = 0..7: [nb, 12] -> sc [nb, 8], mn [nb, 8] (ints)."""
    q = s12.astype(np.int32)
    sc = np.empty((len(q), 8), np.int32)
    mn = np.empty((len(q), 8), np.int32)
    sc[:, :4] = q[:, 0:4] & 63
    mn[:, :4] = q[:, 4:8] & 63
    sc[:, 4:] = (q[:, 8:12] & 0xF) | ((q[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (q[:, 8:12] >> 4) | ((q[:, 4:8] >> 6) << 4)
    return sc, mn


def np_dequantize_parts(t: int, raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(a, b) float32 [nb, block_size] with value = a + b evaluated in float32 as ggml does:
    a = the scaled quant (d*q, or (d*sc)*q), b = the offset (m, -(dmin*mn)), or None for the
    formats without one (then the value is a itself: a -0.0 must stay -0.0)."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    nb = raw.shape[0]
    if t == Q.TYPE_F32:
        return raw.view(np.float32).reshape(nb, 1), None
    if t == Q.TYPE_F16:
        return raw.view(np.float16).astype(np.float32).reshape(nb, 1), None
    if t == Q.TYPE_BF16:
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(nb, 1), None
    if t in (Q.TYPE_Q4_0, Q.TYPE_Q4_1, Q.TYPE_Q5_0, Q.TYPE_Q5_1, Q.TYPE_Q8_0):
        d = f16(raw[:, 0:2])[:, None]
        if t == Q.TYPE_Q4_0:
            q, m = _nibbles(raw[:, 2:18]) - 8, None
        elif t == Q.TYPE_Q4_1:
            q, m = _nibbles(raw[:, 4:20]), f16(raw[:, 2:4])[:, None]
        elif t == Q.TYPE_Q5_0:
            q, m = (_nibbles(raw[:, 6:22]) | (_qh_bits(raw[:, 2:6]) << 4)) - 16, None
        elif t == Q.TYPE_Q5_1:
            q, m = _nibbles(raw[:, 8:24]) | (_qh_bits(raw[:, 4:8]) << 4), f16(raw[:, 2:4])[:, None]
        else:
            q, m = raw[:, 2:34].view(np.int8).astype(np.int32), None
        a = q.astype(np.float32) * d
        return a, (np.broadcast_to(m, a.shape).astype(np.float32) if m is not None else None)
    if t == Q.TYPE_Q2_K:
        scales, qs = raw[:, 0:16].astype(np.int32), raw[:, 16:80]
        d, dmin = f16(raw[:, 80:82])[:, None], f16(raw[:, 82:84])[:, None]
        # value 128h + 32*(shift/2) + 16k + l  <-  (qs[32h + 16k + l] >> shift) & 3, group 8h + 2*(shift/2) + k
        q = np.empty((nb, 256), np.int32)
        for h in range(2):
            for s in range(4):
                for k in range(2):
                    q[:, 128 * h + 32 * s + 16 * k:128 * h + 32 * s + 16 * k + 16] = \
                        (qs[:, 32 * h + 16 * k:32 * h + 16 * k + 16] >> (2 * s)) & 3
        dl = (d * (scales & 0xF).astype(np.float32)).repeat(16, axis=1)
        ml = (dmin * (scales >> 4).astype(np.float32)).repeat(16, axis=1)
        return dl * q.astype(np.float32), -ml
    if t == Q.TYPE_Q3_K:
        hmask, qs, s12 = raw[:, 0:32], raw[:, 32:96], raw[:, 96:108].astype(np.int32)
        d = f16(raw[:, 108:110])[:, None]
        sc = np.empty((nb, 16), np.int32)
        for j in range(16):
            lo = (s12[:, j] & 0xF) if j < 8 else (s12[:, j - 8] >> 4)
            hi = (s12[:, 8 + j % 4] >> (2 * (j // 4))) & 3
            sc[:, j] = (lo | (hi << 4)) - 32
        q = np.empty((nb, 256), np.int32)
        for h in range(2):
            for s in range(4):
                m = 1 << (4 * h + s)
                for k in range(2):
                    sl = slice(16 * k, 16 * k + 16)
                    lo = (qs[:, 32 * h:32 * h + 32][:, sl] >> (2 * s)) & 3
                    hb = (hmask[:, sl] & m) != 0
                    q[:, 128 * h + 32 * s + 16 * k:128 * h + 32 * s + 16 * k + 16] = lo - np.where(hb, 0, 4)
        dl = (d * sc.astype(np.float32)).repeat(16, axis=1)
        return dl * q.astype(np.float32), None
    if t in (Q.TYPE_Q4_K, Q.TYPE_Q5_K):
        d, dmin = f16(raw[:, 0:2])[:, None], f16(raw[:, 2:4])[:, None]
        sc, mn = k_scale_min(raw[:, 4:16])
        qs = raw[:, 16:144] if t == Q.TYPE_Q4_K else raw[:, 48:176]
        q = np.empty((nb, 256), np.int32)
        for p in range(4):
            q[:, 64 * p:64 * p + 32] = qs[:, 32 * p:32 * p + 32] & 0xF
            q[:, 64 * p + 32:64 * p + 64] = qs[:, 32 * p:32 * p + 32] >> 4
        if t == Q.TYPE_Q5_K:
            qh = raw[:, 16:48].astype(np.int32)
            for p in range(4):
                q[:, 64 * p:64 * p + 32] += ((qh >> (2 * p)) & 1) * 16
                q[:, 64 * p + 32:64 * p + 64] += ((qh >> (2 * p + 1)) & 1) * 16
        dl = (d * sc.astype(np.float32)).repeat(32, axis=1)
        ml = (dmin * mn.astype(np.float32)).repeat(32, axis=1)
        return dl * q.astype(np.float32), -ml
    if t == Q.TYPE_Q6_K:
        ql, qh, sc = raw[:, 0:128].astype(np.int32), raw[:, 128:192].astype(np.int32), raw[:, 192:208].view(np.int8)
        d = f16(raw[:, 208:210])[:, None]
        q = np.empty((nb, 256), np.int32)
        for h in range(2):
            l0, l1, hh = ql[:, 64 * h:64 * h + 32], ql[:, 64 * h + 32:64 * h + 64], qh[:, 32 * h:32 * h + 32]
            q[:, 128 * h + 0:128 * h + 32] = ((l0 & 0xF) | (((hh >> 0) & 3) << 4)) - 32
            q[:, 128 * h + 32:128 * h + 64] = ((l1 & 0xF) | (((hh >> 2) & 3) << 4)) - 32
            q[:, 128 * h + 64:128 * h + 96] = ((l0 >> 4) | (((hh >> 4) & 3) << 4)) - 32
            q[:, 128 * h + 96:128 * h + 128] = ((l1 >> 4) | (((hh >> 6) & 3) << 4)) - 32
        dl = (d * sc.astype(np.float32)).repeat(16, axis=1)
        return dl * q.astype(np.float32), None
    raise ValueError(t)


def np_dequantize(t: int, raw: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """float32 array of `shape` from raw bytes: ggml's dequantize_row_* in numpy."""
    bb = Q.block_bytes(t)
    a, b = np_dequantize_parts(t, np.ascontiguousarray(raw).reshape(-1).view(np.uint8).reshape(-1, bb))
    with np.errstate(invalid="ignore", over="ignore"):
        return (a if b is None else a + b).reshape(shape)


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)


def gguf_dequantize(t: int, raw: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    out = gq.dequantize(np.ascontiguousarray(raw).reshape(-1).view(np.uint8).reshape(rows, -1),
                        gguf.GGMLQuantizationType(t))
    return np.asarray(out, dtype=np.float32).reshape(shape)


# ---- sizes ------------------------------------------------------------------------------------

@pytest.mark.parametrize("t", WEIGHT_TYPES + PLAIN_TYPES + [Q.TYPE_Q8_1, Q.TYPE_Q8_K], ids=name)
def test_block_sizes_match_ggml(t):
    bs, bb = gguf.constants.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(t)]
    if t == Q.TYPE_Q8_1:
        bb = 2 + 2 + 32   # ggml-common.h (f16 d, s); gguf's table keeps an old float layout (40)
    assert Q.block_size(t) == bs
    assert Q.block_bytes(t) == bb
    assert Q.row_bytes(t, 4 * bs) == 4 * bb
    assert Q.can_dequantize(t) == (t not in (Q.TYPE_Q8_1, Q.TYPE_Q8_K))


def test_sizes_of_the_named_formats():
    assert [Q.block_bytes(t) for t in (Q.TYPE_Q4_0, Q.TYPE_Q4_1, Q.TYPE_Q5_0, Q.TYPE_Q8_0)] == [18, 20, 22, 34]
    assert [Q.block_bytes(t) for t in (Q.TYPE_Q4_K, Q.TYPE_Q6_K)] == [144, 210]
    assert (Q.TYPE_Q4_0, Q.TYPE_Q4_1, Q.TYPE_Q5_0, Q.TYPE_Q5_1, Q.TYPE_Q8_0, Q.TYPE_Q8_1, Q.TYPE_Q2_K,
            Q.TYPE_Q3_K, Q.TYPE_Q4_K, Q.TYPE_Q5_K, Q.TYPE_Q6_K, Q.TYPE_BF16) == (2, 3, 6, 7, 8, 9, 10, 11, 12, 13, 14, 30)


def test_row_bytes_rejects_partial_blocks():
    with pytest.raises(ValueError, match="multiple of 32"):
        Q.row_bytes(Q.TYPE_Q4_0, 48)
    with pytest.raises(ValueError, match="multiple of 256"):
        Q.row_bytes(Q.TYPE_Q6_K, 512 + 32)
    with pytest.raises(ValueError, match="unknown ggml type"):
        Q.row_bytes(4, 32)


# ---- dequantization -----------------------------------------------------------------------------

@pytest.mark.parametrize("t", WEIGHT_TYPES + PLAIN_TYPES, ids=name)
def test_dequantize_random_blocks_bit_exact(t):
    rng = np.random.default_rng(1000 + t)
    bs = Q.block_size(t)
    n_rows, n_cols = 7, 4 * 256
    raw = random_blocks(t, n_rows * n_cols // bs, rng).reshape(n_rows, -1)
    want = np_dequantize(t, raw, (n_rows, n_cols))
    fast = Q.dequantize(t, raw, (n_rows, n_cols))
    ref = Q.dequantize_ref(t, raw, (n_rows, n_cols))
    assert fast.dtype == np.float32 and fast.shape == (n_rows, n_cols) and fast.flags.c_contiguous
    np.testing.assert_array_equal(bits(ref), bits(want))
    np.testing.assert_array_equal(bits(fast), bits(want))
    np.testing.assert_array_equal(bits(gguf_dequantize(t, raw, (n_rows, n_cols))), bits(want))


@pytest.mark.parametrize("t", [Q.TYPE_Q4_0, Q.TYPE_Q4_1, Q.TYPE_Q5_0, Q.TYPE_Q5_1, Q.TYPE_Q8_0, Q.TYPE_BF16, Q.TYPE_F16],
                         ids=name)
def test_dequantize_gguf_quantized_data(t):
    """Blocks made by gguf's own quantizer from smooth data (the realistic range of q and scales)."""
    x = np.cos(np.arange(16 * 512, dtype=np.float32) * 0.37).reshape(16, 512) * 3
    raw = gq.quantize(x, gguf.GGMLQuantizationType(t))
    got = Q.dequantize(t, raw, x.shape)
    np.testing.assert_array_equal(bits(got), bits(gguf_dequantize(t, raw, x.shape)))
    np.testing.assert_array_equal(bits(got), bits(np_dequantize(t, raw, x.shape)))
    # and the round trip is close: half a quantization step per value
    step = {Q.TYPE_Q4_0: 6 / 8, Q.TYPE_Q4_1: 6 / 15, Q.TYPE_Q5_0: 6 / 16, Q.TYPE_Q5_1: 6 / 31,
            Q.TYPE_Q8_0: 6 / 127, Q.TYPE_BF16: 6 / 256, Q.TYPE_F16: 6 / 2048}[t]
    assert np.abs(got - x).max() <= 0.51 * step + 1e-3


def test_dequantize_every_half_as_scale():
    """Each finite f16 (denormals included) as the q8_0 scale with q = 1: y is that half exactly;
    NaN and inf scales as well (fast path and reference give the same bits)."""
    halves = np.arange(0x10000, dtype=np.uint32).astype(np.uint16)
    raw = np.zeros((len(halves), 34), np.uint8)
    raw[:, 0:2] = halves.view(np.uint8).reshape(-1, 2)
    raw[:, 2:34] = 1
    got = Q.dequantize(Q.TYPE_Q8_0, raw, (len(halves), 32))
    ref = Q.dequantize_ref(Q.TYPE_Q8_0, raw, (len(halves), 32))
    np.testing.assert_array_equal(bits(got), bits(ref))
    finite = (halves & 0x7C00) != 0x7C00
    with np.errstate(invalid="ignore"):
        np.testing.assert_array_equal(got[finite, 0], halves[finite].view(np.float16).astype(np.float32))


@pytest.mark.parametrize("t", [Q.TYPE_Q4_1, Q.TYPE_Q4_K, Q.TYPE_Q6_K, Q.TYPE_F16], ids=name)
def test_dequantize_threads_and_shapes(t):
    rng = np.random.default_rng(7)
    bs = Q.block_size(t)
    n = 3 * 5 * 512
    raw = random_blocks(t, n // bs, rng)
    flat = Q.dequantize(t, raw, (n,), n_threads=1)
    for shape in [(15, 512), (3, 5, 512), (1, 15, 512)]:
        for nth in (1, 2, 3, None, -1):
            got = Q.dequantize(t, raw, shape, n_threads=nth)
            assert got.shape == shape
            np.testing.assert_array_equal(bits(got.reshape(-1)), bits(flat))
    # raw of any uint8 shape: only the byte count matters
    np.testing.assert_array_equal(bits(Q.dequantize(t, raw.reshape(-1), (15, 512))), bits(flat.reshape(15, 512)))


def test_dequantize_plain_dtypes_and_readonly():
    x = np.random.default_rng(3).standard_normal((4, 8)).astype(np.float32)
    np.testing.assert_array_equal(Q.dequantize(Q.TYPE_F32, x, x.shape), x)
    h = x.astype(np.float16)
    np.testing.assert_array_equal(Q.dequantize(Q.TYPE_F16, h, x.shape), h.astype(np.float32))
    np.testing.assert_array_equal(Q.dequantize(Q.TYPE_F16, h.view(np.uint16), x.shape), h.astype(np.float32))
    ro = h.view(np.uint8).copy()
    ro.flags.writeable = False
    np.testing.assert_array_equal(Q.dequantize(Q.TYPE_F16, ro, x.shape), h.astype(np.float32))
    assert Q.dequantize(Q.TYPE_Q4_0, np.zeros(0, np.uint8), (0, 64)).shape == (0, 64)


def test_dequantize_errors():
    raw = np.zeros((2, 18), np.uint8)
    with pytest.raises(ValueError, match="takes 72 bytes"):
        Q.dequantize(Q.TYPE_Q4_0, raw, (2, 64))
    with pytest.raises(ValueError, match="multiple of Q4_0's block size 32"):
        Q.dequantize(Q.TYPE_Q4_0, raw, (3, 24))
    with pytest.raises(ValueError, match="unknown ggml type"):
        Q.dequantize(5, raw, (2, 32))
    with pytest.raises(ValueError, match="activation format"):
        Q.dequantize(Q.TYPE_Q8_1, np.zeros(36, np.uint8), (32,))
    with pytest.raises(ValueError, match="must be uint8"):
        Q.dequantize(Q.TYPE_Q4_0, raw.astype(np.int16), (2, 32))
    with pytest.raises(ValueError, match="C-contiguous"):
        Q.dequantize(Q.TYPE_Q4_0, np.zeros((2, 36), np.uint8)[:, ::2], (2, 32))
    with pytest.raises(ValueError):
        Q.dequantize(Q.TYPE_Q4_0, raw, (2, 32), n_threads=0)


# ---- real tensors -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2(smollm2_gguf):
    return gguf.GGUFReader(str(smollm2_gguf))


def test_smollm2_tensors(smollm2):
    """Every quantized tensor of block 0 and 200 rows of the tied Q8_0 embedding, against gguf."""
    seen = set()
    for t in smollm2.tensors:
        if not (t.name.startswith("blk.0.") or t.name == "token_embd.weight"):
            continue
        ty = int(t.tensor_type)
        shape = tuple(int(s) for s in reversed(t.shape))
        raw = np.asarray(t.data)
        if t.name == "token_embd.weight":
            raw, shape = raw[:200], (200,) + shape[1:]
        want = gguf_dequantize(ty, raw, shape)
        got = Q.dequantize(ty, raw, shape)
        np.testing.assert_array_equal(bits(got), bits(want), err_msg=t.name)
        seen.add(ty)
    assert {Q.TYPE_Q4_1, Q.TYPE_Q8_0} <= seen


# ---- quantization (activations) -----------------------------------------------------------------

def np_roundf(v: np.ndarray) -> np.ndarray:
    """C roundf on float32 values: ties away from zero (exact in float64)."""
    v = v.astype(np.float64)
    return np.sign(v) * np.floor(np.abs(v) + 0.5)


def clamp_q(v: np.ndarray, lim: float) -> np.ndarray:
    """quants.c's clamp_q: NaN -> 0, then clip to [-lim, lim] (a no-op on finite blocks; it
    defines the results where 1/d overflows)."""
    return np.clip(np.where(np.isnan(v), np.float32(0), v), -lim, lim).astype(np.float32)


def np_quantize_q8_0(x: np.ndarray, with_sum: bool = False):
    """ggml's quantize_row_q8_0_ref / q8_1_ref on [nb*32] -> (d_f16 [nb], qs [nb, 32], s_f16 [nb])."""
    xb = x.reshape(-1, QK).astype(np.float32)
    amax = np.abs(xb).max(axis=1)
    d = (amax / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore", over="ignore"):
        idv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        qs = np_roundf(clamp_q((xb * idv[:, None]).astype(np.float32), 127)).astype(np.int8)
    with np.errstate(over="ignore"):   # beyond 65504: inf, as the C conversion
        s = (qs.astype(np.int32).sum(axis=1).astype(np.float32) * d).astype(np.float16)
    return d.astype(np.float16), qs, s


def np_quantize_q8_K(x: np.ndarray):
    """ggml's quantize_row_q8_K_ref: (d float32 [nb], qs [nb, 256], bsums [nb, 16])."""
    xb = x.reshape(-1, QK_K).astype(np.float32)
    imax = np.abs(xb).argmax(axis=1)              # first of the largest magnitudes
    mx = xb[np.arange(len(xb)), imax]
    ok = mx != 0
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        iscale = np.where(ok, np.float32(-127) / mx, np.float32(0)).astype(np.float32)
        v = np.rint(clamp_q((iscale[:, None] * xb).astype(np.float32), 127))   # nearest, ties to even
        qs = np.minimum(127, v).astype(np.int8)
        d = np.where(ok, np.float32(1) / iscale, np.float32(0)).astype(np.float32)
    qs[~ok] = 0
    bsums = qs.reshape(len(xb), 16, 16).astype(np.int32).sum(axis=2).astype(np.int16)
    return d, qs, bsums


def np_quantize_q4_0(x: np.ndarray) -> np.ndarray:
    """ggml's quantize_row_q4_0_ref -> raw uint8 [nb, 18]."""
    xb = x.reshape(-1, QK).astype(np.float32)
    imax = np.abs(xb).argmax(axis=1)
    mx = xb[np.arange(len(xb)), imax]
    d = (mx / np.float32(-8)).astype(np.float32)
    with np.errstate(divide="ignore", over="ignore"):
        idv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        v = (clamp_q((xb * idv[:, None]).astype(np.float32), 8) + np.float32(8.5)).astype(np.float32)
    q = np.minimum(15, np.trunc(v).astype(np.int8)).astype(np.uint8)
    out = np.zeros((len(xb), 18), np.uint8)
    out[:, 0:2] = d.astype(np.float16).view(np.uint8).reshape(-1, 2)
    out[:, 2:] = q[:, :16] | (q[:, 16:] << 4)
    return out


def pack_q8(t: int, x: np.ndarray) -> np.ndarray:
    """numpy ggml quantization of one row x as raw blocks of type t."""
    if t == Q.TYPE_Q8_K:
        d, qs, bs = np_quantize_q8_K(x)
        out = np.zeros((len(d), 292), np.uint8)
        out[:, 0:4] = d.view(np.uint8).reshape(-1, 4)
        out[:, 4:260] = qs.view(np.uint8)
        out[:, 260:292] = bs.view(np.uint8).reshape(-1, 32)
        return out.reshape(-1)
    if t == Q.TYPE_Q4_0:
        return np_quantize_q4_0(x).reshape(-1)
    d, qs, s = np_quantize_q8_0(x)
    if t == Q.TYPE_Q8_0:
        out = np.zeros((len(d), 34), np.uint8)
        out[:, 0:2] = d.view(np.uint8).reshape(-1, 2)
        out[:, 2:] = qs.view(np.uint8)
    else:
        out = np.zeros((len(d), 36), np.uint8)
        out[:, 0:2] = d.view(np.uint8).reshape(-1, 2)
        out[:, 2:4] = s.view(np.uint8).reshape(-1, 2)
        out[:, 4:] = qs.view(np.uint8)
    return out.reshape(-1)


def activations(rng: np.random.Generator, n: int) -> np.ndarray:
    """Activation-like rows: gaussian, a few outliers, exact ties at .5 steps, zero blocks,
    and blocks whose largest magnitude appears with both signs."""
    x = rng.standard_normal(n).astype(np.float32)
    x[rng.random(n) < 0.01] *= 40
    x[64:96] = 0
    x[96:128] = np.arange(32, dtype=np.float32) - 15.5     # x / d = +-0.5, +-1.5, ...: exact ties
    x[127] = 127.0                                          # (d = 1 for q8_0, iscale = -1 for q8_K)
    x[160:192] = 1.0
    x[164] = -3.0
    x[174] = 3.0
    if n >= 1024:
        x[512:768] = 0
    return x


@pytest.mark.parametrize("t", [Q.TYPE_Q8_0, Q.TYPE_Q8_1, Q.TYPE_Q8_K, Q.TYPE_Q4_0], ids=name)
def test_quantize_matches_ggml_reference(t):
    rng = np.random.default_rng(11)
    for n in (256, 1024, 4096):
        x = activations(rng, n)
        want = pack_q8(t, x)
        got = Q.quantize(t, x)
        ref = Q.quantize_ref(t, x)
        np.testing.assert_array_equal(ref, want)
        np.testing.assert_array_equal(got, want)
    x2 = np.stack([activations(rng, 512) for _ in range(3)])
    np.testing.assert_array_equal(Q.quantize(t, x2).reshape(3, -1),
                                  np.stack([pack_q8(t, r) for r in x2]))


@pytest.mark.parametrize("t", [Q.TYPE_Q8_0, Q.TYPE_Q4_0], ids=name)
def test_quantize_vs_gguf(t):
    """gguf's quantizer rounds like ggml's except at exact ties (np.round vs roundf): compare on
    smooth data without ties, and dequantized values everywhere."""
    x = np.cos(np.arange(8 * 256, dtype=np.float32) * 0.731).reshape(8, 256) * 2.5
    ours = Q.quantize(t, x)
    theirs = gq.quantize(x, gguf.GGMLQuantizationType(t))
    np.testing.assert_array_equal(ours, theirs)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.floats(-1e4, 1e4, width=32, allow_subnormal=True), min_size=256, max_size=256),
       st.sampled_from([Q.TYPE_Q8_0, Q.TYPE_Q8_1, Q.TYPE_Q8_K, Q.TYPE_Q4_0]))
def test_quantize_fast_equals_ref_property(vals, t):
    x = np.asarray(vals, dtype=np.float32)
    np.testing.assert_array_equal(Q.quantize(t, x), Q.quantize_ref(t, x))
    np.testing.assert_array_equal(Q.quantize(t, x), pack_q8(t, x))


@pytest.mark.parametrize("first", [13, 8, 200, 255])
def test_q8_K_scale_from_the_first_largest(first, every_simd_level):
    """q8_K's scale takes the sign of the first value of largest magnitude (-127 / max): +-v placed at
    two indices, the first anywhere in the super-block (the scan goes 8 values at a time), at every level."""
    rng = np.random.default_rng(first)
    x = rng.uniform(-1, 1, 512).astype(np.float32)
    for base, sgn in ((0, -1.0), (256, 1.0)):
        x[base + first] = sgn * 4.0
        x[base + (first + 37) % 256] = -sgn * 4.0
    np.testing.assert_array_equal(Q.quantize(Q.TYPE_Q8_K, x), pack_q8(Q.TYPE_Q8_K, x))


@pytest.mark.parametrize("t", [Q.TYPE_Q8_0, Q.TYPE_Q8_1, Q.TYPE_Q8_K, Q.TYPE_Q4_0], ids=name)
def test_quantize_denormal_blocks(t):
    """Blocks so small that 1/d overflows: NaN products give 0, infinite ones +-127 (ggml's
    reference is undefined there), fast and reference alike."""
    x = np.zeros(256, np.float32)
    x[31] = 8.9e-39
    x[40] = -1e-40
    x[41] = 3e-41
    x[255] = np.float32(1e-45)
    np.testing.assert_array_equal(Q.quantize(t, x), Q.quantize_ref(t, x))
    np.testing.assert_array_equal(Q.quantize(t, x), pack_q8(t, x))


def _split_of_blocks(t: int, x: np.ndarray):
    """(qs, d, s, sum) of x taken from the ggml blocks pack_q8 builds."""
    bb = 34 if t == Q.TYPE_Q8_0 else 36
    raw = pack_q8(t, x).reshape(-1, bb)
    qs = raw[:, bb - 32:].copy().view(np.int8)
    d = raw[:, 0:2].copy().view(np.float16).astype(np.float32).ravel()
    s = (raw[:, 2:4].copy().view(np.float16).astype(np.float32).ravel() if t == Q.TYPE_Q8_1
         else np.zeros(len(raw), np.float32))
    return qs.ravel(), d, s, qs.astype(np.int32).sum(axis=1)


@pytest.mark.parametrize("t", [Q.TYPE_Q8_0, Q.TYPE_Q8_1], ids=name)
@pytest.mark.parametrize("n", [32, 224, 256, 288, 544, 1536])
def test_quantize_split_is_the_blocks(t, n, every_simd_level):
    """The split rows the integer products read (8 blocks at a time in lanes at AVX2, 16 from AVX-512):
    the blocks' values, f16 scales and sums, fast and reference alike; ties, zero and denormal blocks
    included."""
    rng = np.random.default_rng(n)
    x = activations(rng, max(n, 256))[:n].copy()
    if n >= 256:
        x[200:232] = 0
        x[232:256] = 1e-40
    want = _split_of_blocks(t, x)
    for ref in (False, True):
        got = Q.quantize_split(t, x, ref=ref)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype or g.dtype.kind == w.dtype.kind
            np.testing.assert_array_equal(g, w)
    with pytest.raises(ValueError):
        Q.quantize_split(Q.TYPE_Q8_K, np.zeros(256, np.float32))
    with pytest.raises(ValueError):
        Q.quantize_split(t, np.zeros(33, np.float32))


def test_q8_0_round_trip_error():
    """|x - d*q| <= d/2 + |d - f16(d)| * 127 for every value (the bound matmul.h states)."""
    rng = np.random.default_rng(5)
    x = activations(rng, 4096)
    raw = Q.quantize(Q.TYPE_Q8_0, x)
    y = Q.dequantize(Q.TYPE_Q8_0, raw, x.shape)
    d = (np.abs(x.reshape(-1, 32)).max(axis=1) / 127).astype(np.float64)
    bound = (d * (0.5 + 127 * 2.0 ** -11)).repeat(32) + 1e-30
    assert np.all(np.abs(y.astype(np.float64) - x) <= bound)


def test_quantize_errors():
    with pytest.raises(ValueError, match="handles Q4_0, Q8_0, Q8_1, Q8_K"):
        Q.quantize(Q.TYPE_Q4_1, np.zeros(32, np.float32))
    with pytest.raises(ValueError, match="multiple of 256"):
        Q.quantize(Q.TYPE_Q8_K, np.zeros(32, np.float32))
    with pytest.raises(ValueError, match="float32"):
        Q.quantize(Q.TYPE_Q8_0, np.zeros(32, np.float64))
    with pytest.raises(ValueError, match="finite"):
        Q.quantize(Q.TYPE_Q8_0, np.full(32, np.inf, np.float32))
