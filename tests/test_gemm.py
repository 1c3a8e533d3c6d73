"""Tests of the bit-identical quantized GEMM (csrc/gemm via llamax._native.gemm), llamax's one
integer product, and of product.h's rule (gemm.product).

  (a) every SIMD level of this CPU and n_threads 1 / 2 give the bits of the scalar reference
      (gemm.h's canonical loop), for every n_tok;
  (b) batch invariance: row t of a product over n_tok tokens is the product of token t alone;
  (c) the reference is within LX_GEMM_ERR(n_terms) * sum|terms| of the float64 product of the
      dequantized W and ggml's quantized activations (the q8 oracle below);
  (d) against plain x @ W.T (W dequantized) it is off by the activation rounding only:
      |W| @ |x - x^| (+ the s rounding) + the accumulation bound, llama.cpp's own error.
Weights are random ggml blocks (finite f16 scales), as in test_matmul.

The q8 oracle, in float64 numpy: the activations are quantized exactly as ggml does (the numpy
quantizers of test_quants_blocks), then y_emul = x^ @ W.T with W dequantized by numpy, plus the one
place ggml does not use x^ itself: the q8_1 block sum s = f16(d * sum q) of the q4_1 / q5_1 min
term; sum|terms| <= (|a| + |b|) @ |x^|, a / b the scaled-quant / offset parts of W.
"""
from __future__ import annotations

import numpy as np
import pytest
from test_matmul import check_close, w_parts, weights
from test_quants_blocks import gguf, gguf_dequantize, np_dequantize, np_quantize_q8_0, np_quantize_q8_K

from llamax._native import cpu
from llamax._native import gemm as G
from llamax._native import matmul as M
from llamax._native import quants as Q

K_TYPES = [Q.TYPE_Q4_K, Q.TYPE_Q5_K, Q.TYPE_Q6_K]
TYPES = [Q.TYPE_Q4_0, Q.TYPE_Q4_1, Q.TYPE_Q5_0, Q.TYPE_Q5_1, Q.TYPE_Q8_0] + K_TYPES
FLOAT_TYPES = [Q.TYPE_F32, Q.TYPE_F16, Q.TYPE_BF16, Q.TYPE_Q2_K, Q.TYPE_Q3_K]   # product.h: the float product
LEVELS = [lv for lv in cpu.levels() if lv != cpu.AVX512]  # AVX512 without VNNI runs AVX2
N_TOKS = [1, 2, 3, 5, 8, 13, 64, 130, 512]
U = 2.0 ** -24


def name(t: int) -> str:
    return Q.TYPE_NAMES[t]


@pytest.fixture(autouse=True)
def _reset_level():
    yield
    cpu.set_simd_level(-1)


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
    """(y_emul, mag, act_err) float64 [n_tok, n_out] (see the module docstring)."""
    n_out, n_in = raw.shape[0], x.shape[1]
    w, wmag = w_parts(t, raw, n_out, n_in)
    dt = G.dot_type(t)
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


def tol(t: int, n_in: int, mag: np.ndarray) -> np.ndarray:
    """LX_GEMM_ERR(n_terms) * sum|terms|, plus 2u for W's own rounding in the numpy oracle."""
    return (G.err_factor(t, n_in) + 2 * U) * mag + 1e-30


def kin(t: int, n_in: int) -> int:
    """n_in for type t: the K-quants need multiples of 256 (576 -> 512, 640 -> 768, ...)."""
    return max(256, n_in // 256 * 256 + (256 if n_in % 256 >= 128 else 0)) if t in K_TYPES else n_in


def case(t: int, n_in: int, n_out: int, n_tok: int, seed: int):
    rng = np.random.default_rng(seed)
    raw = weights(t, n_out, n_in, rng)
    x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
    x[:, :32] *= 50                                  # an outlier block
    x[n_tok // 2, 32:64] = 0                         # an all-zero block (d = 0)
    if n_in >= 512:
        x[n_tok // 2, 256:512] = 0                   # an all-zero super-block (q8_K's d = 0)
    return raw, x


@pytest.mark.parametrize("t", TYPES, ids=name)
@pytest.mark.parametrize("n_in", [256, 576, 1536])
def test_every_path_is_the_reference_bit_for_bit(t, n_in):
    n_in = {576: 1024, 1536: 2048}.get(n_in, n_in) if t in K_TYPES else n_in
    n_out = 37 if n_in in (1536, 2048) else 45                # not a multiple of the tile rows
    raw, x = case(t, n_in, n_out, max(N_TOKS), 10 * t + n_in)
    for n_tok in (N_TOKS if n_in not in (1536, 2048) else [1, 3, 8, 13, 130, 512]):
        xs = x[:n_tok]
        ref = G.mul_mat_ref(raw, t, xs)
        for level in LEVELS:
            cpu.set_simd_level(level)
            for nth in (1, 2):
                got = G.mul_mat(raw, t, xs, n_threads=nth)
                assert np.array_equal(got, ref), (f"{name(t)} n_in {n_in} n_tok {n_tok} simd{level} "
                                                  f"threads {nth}: max diff {np.abs(got - ref).max()}")


@pytest.mark.parametrize("t", [Q.TYPE_Q4_0, Q.TYPE_Q4_1, Q.TYPE_Q8_0, Q.TYPE_Q4_K, Q.TYPE_Q6_K], ids=name)
def test_tiles_kept_across_chunks(t):
    """Prompts of several token chunks keep each thread's first W tiles unpacked from one chunk to the
    next (gemm.c LX_GEMM_KEEP_BYTES, 1 MB a thread) and unpack the rest per chunk: 1200 rows of 1536
    (2048) are more tiles than one thread keeps, and 130 tokens two chunks at every level. GGUF rows
    and the r8 layout, 1 and 2 threads (both of their shares overflow), the reference's bits."""
    n_in, n_out = kin(t, 1536), 1200
    raw, x = case(t, n_in, n_out, 130, 5 + t)
    ref = G.mul_mat_ref(raw, t, x)
    packed = G.pack_r8(raw, t)
    for level in LEVELS:
        cpu.set_simd_level(level)
        for nth in (1, 2):
            np.testing.assert_array_equal(G.mul_mat(raw, t, x, n_threads=nth), ref)
            np.testing.assert_array_equal(G.mul_mat_r8(packed, t, n_out, x, n_threads=nth), ref)


@pytest.mark.parametrize("t", TYPES, ids=name)
def test_batch_invariance(t):
    n_in, n_out = kin(t, 576), 29
    raw, x = case(t, n_in, n_out, 130, 7 + t)
    for level in LEVELS:
        cpu.set_simd_level(level)
        full = G.mul_mat(raw, t, x, n_threads=2)
        for n_tok in (2, 9, 17, 64):
            np.testing.assert_array_equal(G.mul_mat(raw, t, x[:n_tok], n_threads=2), full[:n_tok])
        for i in (0, 1, 7, 8, 15, 16, 63, 129):
            np.testing.assert_array_equal(G.mul_mat(raw, t, x[i:i + 1], n_threads=1), full[i:i + 1])


@pytest.mark.parametrize("t", TYPES, ids=name)
@pytest.mark.parametrize("n_in", [256, 1536])
def test_reference_within_bound_of_float64(t, n_in):
    n_in = kin(t, n_in)
    raw, x = case(t, n_in, 23, 13, 300 + t)
    y, mag, _ = q8_oracle(t, raw, x)
    ref = G.mul_mat_ref(raw, t, x)
    check_close(ref, y, tol(t, n_in, mag), f"{name(t)} ref vs float64")


@pytest.mark.parametrize("t", TYPES, ids=name)
def test_vs_exact_product(t):
    """Plain x @ W.T (W dequantized): off by the activation rounding only (llama.cpp's own error)."""
    rng = np.random.default_rng(300 + t)
    n_in = 1024
    raw = weights(t, 19, n_in, rng)
    x = rng.standard_normal((3, n_in)).astype(np.float32)
    w = np_dequantize(t, raw, (19, n_in)).astype(np.float64)
    _, mag, act_err = q8_oracle(t, raw, x)
    got = G.mul_mat(raw, t, x)
    check_close(got, x.astype(np.float64) @ w.T, act_err + tol(t, n_in, mag), name(t))


def test_dot_types_follow_ggml():
    assert {t: G.dot_type(t) for t in TYPES} == {
        Q.TYPE_Q4_0: Q.TYPE_Q8_0, Q.TYPE_Q5_0: Q.TYPE_Q8_0, Q.TYPE_Q8_0: Q.TYPE_Q8_0,
        Q.TYPE_Q4_1: Q.TYPE_Q8_1, Q.TYPE_Q5_1: Q.TYPE_Q8_1,
        Q.TYPE_Q4_K: Q.TYPE_Q8_K, Q.TYPE_Q5_K: Q.TYPE_Q8_K, Q.TYPE_Q6_K: Q.TYPE_Q8_K}


def test_empty_and_out():
    raw, x = case(Q.TYPE_Q4_0, 64, 5, 3, 1)
    assert G.mul_mat(raw, Q.TYPE_Q4_0, x[:0]).shape == (0, 5)
    out = np.full((3, 5), np.nan, np.float32)
    assert G.mul_mat(raw, Q.TYPE_Q4_0, x, out=out) is out
    np.testing.assert_array_equal(out, G.mul_mat_ref(raw, Q.TYPE_Q4_0, x))


def test_errors():
    raw, x = case(Q.TYPE_Q4_1, 64, 5, 3, 2)
    t = Q.TYPE_Q4_1
    with pytest.raises(TypeError):
        G.mul_mat(raw, 3.0, x)
    with pytest.raises(TypeError):
        G.mul_mat(raw.tolist(), t, x)
    with pytest.raises(TypeError):
        G.mul_mat(raw, t, x.tolist())
    with pytest.raises(ValueError, match="not a gemm weight type"):
        G.mul_mat(raw, Q.TYPE_Q3_K, x)
    with pytest.raises(ValueError, match="float32"):
        G.mul_mat(raw, t, x.astype(np.float64))
    with pytest.raises(ValueError, match="bytes"):
        G.mul_mat(raw[:, :-1].copy(), t, x)
    with pytest.raises(ValueError, match="multiple"):
        G.mul_mat(raw, t, np.zeros((3, 48), np.float32))
    with pytest.raises(ValueError, match="shape"):
        G.mul_mat(raw, t, x, out=np.empty((3, 4), np.float32))
    with pytest.raises(ValueError, match="overlap"):
        G.mul_mat(raw, t, x, out=x.reshape(-1)[:15].reshape(3, 5))
    with pytest.raises(ValueError):
        G.mul_mat(raw, t, x, n_threads=0)


# ---- the row-interleaved layout (r8) ----------------------------------------------------------

@pytest.mark.parametrize("t", sorted(G.R8_TYPES), ids=name)
@pytest.mark.parametrize("n_out", [8, 13, 100])
def test_r8_gives_the_gemm_bits(t, n_out):
    """pack_r8 + mul_mat_r8 equals the reference bit for bit for any n_tok (the rows-in-lanes kernel
    up to 8, tokens in lanes past it) and at every level; a ragged last group is padded and its rows
    dropped."""
    n_in = (768 if n_out == 100 else 256) if t in K_TYPES else (576 if n_out == 100 else 96)
    raw, x = case(t, n_in, n_out, 130, n_out + t)
    packed = G.pack_r8(raw, t)
    assert packed.shape == ((n_out + 7) // 8 * 8, raw.shape[1])
    for n_tok in (1, 3, 8, 9, 20, 130):
        ref = G.mul_mat_ref(raw, t, x[:n_tok])
        for level in LEVELS:
            cpu.set_simd_level(level)
            for nt in (1, 2):
                np.testing.assert_array_equal(G.mul_mat_r8(packed, t, n_out, x[:n_tok], n_threads=nt), ref)


@pytest.mark.parametrize("t", [t for t in TYPES if t not in K_TYPES], ids=name)
@pytest.mark.parametrize("n_tok", [3, 20])
def test_extreme_quants(t, n_tok):
    """The largest integer sums the kernels form (every quant at its top, every activation at 127 or
    -127): the int16 pair sums added before each madd stay exact, on GGUF rows (the rows-in-lanes
    kernel for n_tok <= 8, tokens in lanes past it) and in the r8 layout where the type has it."""
    n_in, n_out = 256, 16
    raw = weights(t, n_out, n_in, np.random.default_rng(1))
    bb, rb = Q.block_bytes(t), raw.shape[1]
    blocks = raw.reshape(n_out, rb // bb, bb)
    head = {Q.TYPE_Q4_0: 2, Q.TYPE_Q4_1: 4, Q.TYPE_Q5_0: 2, Q.TYPE_Q5_1: 4, Q.TYPE_Q8_0: 2}[t]
    blocks[:, :, head:] = 0x81 if t == Q.TYPE_Q8_0 else 0xFF       # q8_0: -127; nibbles 15 (q5_*: qh all set)
    blocks[8:, :, head:] = 0x7F if t == Q.TYPE_Q8_0 else 0xFF
    packed = G.pack_r8(raw, t) if t in G.R8_TYPES else None
    for sign in (1, -1):
        x = np.full((n_tok, n_in), sign, np.float32)
        x[1] = -x[1]
        ref = G.mul_mat_ref(raw, t, x)
        assert np.all(np.isfinite(ref))
        for level in LEVELS:
            cpu.set_simd_level(level)
            if packed is not None:
                np.testing.assert_array_equal(G.mul_mat_r8(packed, t, n_out, x, n_threads=2), ref)
            np.testing.assert_array_equal(G.mul_mat(raw, t, x, n_threads=2), ref)


def test_r8_layout_and_rows():
    """Per 8-row group and block (272 bytes): the 8 rows' d, then chunk c = quants [4c, 4c + 4) of
    rows 0..7; rows_r8 gives the GGUF rows back."""
    rng = np.random.default_rng(5)
    raw = weights(8, 20, 64, rng)
    packed = G.pack_r8(raw, 8)
    flat, nb = packed.reshape(-1), 2
    for o in (0, 7, 8, 19):
        for b in range(nb):
            g = ((o // 8) * nb + b) * 272
            blk = raw[o, b * 34:(b + 1) * 34]
            np.testing.assert_array_equal(flat[g + 2 * (o % 8):][:2], blk[:2])
            for c in range(8):
                np.testing.assert_array_equal(flat[g + 16 + 32 * c + 4 * (o % 8):][:4], blk[2 + 4 * c:6 + 4 * c])
    assert not flat[(2 * nb) * 272:].reshape(nb, 272)[:, 2 * 4:16].any()   # rows 20..23: zero padding
    np.testing.assert_array_equal(G.rows_r8(packed, 8, [19, 0, 8, 8]), raw[[19, 0, 8, 8]])
    with pytest.raises(ValueError, match="rows"):
        G.rows_r8(packed, 8, [24])
    with pytest.raises(ValueError, match="n_out"):
        G.mul_mat_r8(packed, 8, 30, np.zeros((1, 64), np.float32))
    with pytest.raises(ValueError, match="r8"):
        G.pack_r8(weights(Q.TYPE_Q5_1, 8, 64, rng), Q.TYPE_Q5_1)


@pytest.mark.parametrize("t", [Q.TYPE_Q4_0, Q.TYPE_Q4_1, Q.TYPE_Q5_0, 8, *K_TYPES], ids=name)
def test_rows_r8_f32_is_the_dequantized_rows_times_the_scale(t):
    """rows_r8_f32 (a decode step's embedding lookup in one call): the bits of dequantizing rows_r8's
    GGUF rows, then a float32 product by the scale; an index outside the rows is refused."""
    rng = np.random.default_rng(40 + t)
    n_in = 512
    raw = weights(t, 20, n_in, rng)
    packed = G.pack_r8(raw, t)
    rows = [19, 0, 8, 8, 3]
    want = Q.dequantize(t, raw[rows], (len(rows), n_in), 1)
    np.testing.assert_array_equal(G.rows_r8_f32(packed, t, rows).view(np.uint32), want.view(np.uint32))
    scale = np.float32(25.298222)
    got = G.rows_r8_f32(packed, t, np.array(rows, np.int32), float(scale))
    np.testing.assert_array_equal(got.view(np.uint32), (want * scale).view(np.uint32))
    assert G.rows_r8_f32(packed, t, []).shape == (0, n_in)
    for bad in ([24], [-1]):
        with pytest.raises(ValueError, match="rows"):
            G.rows_r8_f32(packed, t, bad)


@pytest.mark.parametrize("t,head", [(Q.TYPE_Q4_0, "d"), (Q.TYPE_Q4_1, "dm"), (Q.TYPE_Q5_0, "dqh")],
                         ids=["q4_0", "q4_1", "q5_0"])
def test_r8_layout_of_the_nibble_types(t, head):
    """A group-block: the 8 d, then q4_1's 8 m or q5_0's 8 qh, then 4 chunks of 32 bytes, chunk c
    holding qs bytes [4c, 4c + 4) of rows 0..7; rows_r8 gives the GGUF rows back."""
    rng = np.random.default_rng(t)
    raw = weights(t, 20, 64, rng)
    bb = Q.block_bytes(t)
    packed = G.pack_r8(raw, t)
    flat, nb, gbb = packed.reshape(-1), 2, 8 * bb
    hb = {"d": 16, "dm": 32, "dqh": 48}[head]
    for o in (0, 5, 8, 19):
        r = o % 8
        for b in range(nb):
            g = ((o // 8) * nb + b) * gbb
            blk = raw[o, b * bb:(b + 1) * bb]
            np.testing.assert_array_equal(flat[g + 2 * r:][:2], blk[:2])
            if head == "dm":
                np.testing.assert_array_equal(flat[g + 16 + 2 * r:][:2], blk[2:4])
            if head == "dqh":
                np.testing.assert_array_equal(flat[g + 16 + 4 * r:][:4], blk[2:6])
            qs = blk[bb - 16:]
            for c in range(4):
                np.testing.assert_array_equal(flat[g + hb + 32 * c + 4 * r:][:4], qs[4 * c:4 * c + 4])
    np.testing.assert_array_equal(G.rows_r8(packed, t, [19, 0, 8, 8, 3]), raw[[19, 0, 8, 8, 3]])


@pytest.mark.parametrize("t", K_TYPES, ids=name)
def test_r8_layout_of_the_k_types(t):
    """A K group-block (8 super-blocks' bytes), each field's dword c of rows 0..7 side by side at
    32 c: q4_K the 8 d, the 8 dmin, the 12 scale bytes (3 dwords), the 128 qs bytes (32); q5_K the
    same with its 32 qh bytes (8) before qs; q6_K the 8 d, the 16 scales (4 dwords), ql (32), qh
    (16); rows_r8 gives the GGUF rows back."""
    rng = np.random.default_rng(t)
    raw = weights(t, 20, 512, rng)
    bb = Q.block_bytes(t)
    packed = G.pack_r8(raw, t)
    flat, nb, gbb = packed.reshape(-1), 2, 8 * bb
    # (offset of the field in a GGUF block, its bytes, its place in the group-block)
    fields = {Q.TYPE_Q4_K: [(0, 2, 0), (2, 2, 16), (4, 12, 32), (16, 128, 128)],
              Q.TYPE_Q5_K: [(0, 2, 0), (2, 2, 16), (4, 12, 32), (16, 32, 128), (48, 128, 384)],
              Q.TYPE_Q6_K: [(208, 2, 0), (192, 16, 16), (0, 128, 144), (128, 64, 144 + 1024)]}[t]
    for o in (0, 5, 8, 19):
        r = o % 8
        for b in range(nb):
            g = ((o // 8) * nb + b) * gbb
            blk = raw[o, b * bb:(b + 1) * bb]
            for off, n, at in fields:
                if n == 2:
                    np.testing.assert_array_equal(flat[g + at + 2 * r:][:2], blk[off:off + 2])
                    continue
                for c in range(n // 4):
                    np.testing.assert_array_equal(flat[g + at + 32 * c + 4 * r:][:4], blk[off + 4 * c:off + 4 * c + 4])
    assert not flat[2 * nb * gbb:].reshape(nb, gbb)[:, 2 * 4:16].any()   # rows 20..23: zero padding
    np.testing.assert_array_equal(G.rows_r8(packed, t, [19, 0, 8, 8, 3]), raw[[19, 0, 8, 8, 3]])


@pytest.mark.parametrize("t", K_TYPES, ids=name)
@pytest.mark.parametrize("n_tok", [1, 2, 5, 20])
def test_extreme_k_quants_in_r8(t, n_tok):
    """The largest integer sums of the K r8 kernels (the int16 sums of a q4_K sub-block's 8 chunks, a
    q5_K one's 4, two chunks of a q6_K group, every quant at an end and every activation at 127 or -127, scales and
    mins at their top) stay exact: r8 gives the GGUF rows' bits and the reference's."""
    n_in, n_out = 512, 16
    raw = weights(t, n_out, n_in, np.random.default_rng(2))
    bb = Q.block_bytes(t)
    blocks = raw.reshape(n_out, n_in // 256, bb)
    if t != Q.TYPE_Q6_K:
        blocks[:, :, 4:16] = 0xFF           # every 6-bit scale and min 63
        blocks[:, :, 16:] = 0xFF            # nibbles 15 (q5_K: qh all set, 31)
        blocks[8:, :, 16:] = 0x00           # 0 (only the min term)
    else:
        blocks[:, :, :192] = 0x00           # q = -32 (ql 0, qh 0)
        blocks[8:, :, :192] = 0xFF          # q = 31
        blocks[:, :, 192:208] = 0x80        # scales -128
        blocks[8:, :, 192:208] = 0x7F       # scales 127
    packed = G.pack_r8(raw, t)
    for sign in (1, -1):
        x = np.full((n_tok, n_in), sign, np.float32)
        x[n_tok // 2] = -x[n_tok // 2]
        ref = G.mul_mat_ref(raw, t, x)
        assert np.all(np.isfinite(ref))
        for level in LEVELS:
            cpu.set_simd_level(level)
            np.testing.assert_array_equal(G.mul_mat_r8(packed, t, n_out, x, n_threads=2), ref)
            np.testing.assert_array_equal(G.mul_mat(raw, t, x, n_threads=2), ref)


# ---- real tensors ----------------------------------------------------------------------------------

def test_smollm2_tensors(smollm2_gguf):
    """Real Q4_1 / Q8_0 rows: within the q8 oracle's bound, and off plain x @ W.T by the activation
    rounding only."""
    r = gguf.GGUFReader(str(smollm2_gguf))
    tensors = {t.name: t for t in r.tensors}
    rng = np.random.default_rng(9)
    for nm, rows in [("blk.0.attn_q.weight", None), ("blk.0.ffn_down.weight", None),
                     ("blk.3.attn_k.weight", None), ("token_embd.weight", 300)]:
        t = tensors[nm]
        ty = int(t.tensor_type)
        raw = np.ascontiguousarray(np.asarray(t.data))
        raw = raw if rows is None else raw[:rows]
        n_out, n_in = raw.shape[0], int(t.shape[0])
        w = gguf_dequantize(ty, raw, (n_out, n_in)).astype(np.float64)
        for n_tok in (1, 4, 20):
            x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
            y, mag, act_err = q8_oracle(ty, raw, x)
            got = G.mul_mat(raw, ty, x)
            check_close(got, y, tol(ty, n_in, mag), nm)
            check_close(got, x.astype(np.float64) @ w.T, act_err + tol(ty, n_in, mag), nm)


# ---- product.h: the one rule of which product a weight takes ------------------------------------

def test_product_rule():
    """Every weight type has exactly one engine per layout: the GEMM for its types (r8 only where the
    layout exists), the float product for the others; activation formats and unknown numbers none."""
    for t in TYPES:
        assert G.product_kind(t) == "gemm"
        assert G.product_kind(t, r8=True) == ("gemm_r8" if t in G.R8_TYPES else "none")
    for t in FLOAT_TYPES:
        assert G.product_kind(t) == "float" and G.product_kind(t, r8=True) == "none"
    for t in (Q.TYPE_Q8_1, Q.TYPE_Q8_K, 4, 63, 64, -1):
        assert G.product_kind(t) == "none"
    assert set(G.R8_TYPES) <= set(G.W_TYPES) and {t for t in G.W_TYPES} == set(TYPES)
    with pytest.raises(TypeError):
        G.product_kind(2.0)


@pytest.mark.parametrize("t", TYPES + FLOAT_TYPES, ids=name)
def test_product_is_its_engines_bits(t):
    """gemm.product gives the bits of the engine product_kind names, in either layout."""
    rng = np.random.default_rng(700 + t)
    n_in, n_out = 512, 21
    raw = weights(t, n_out, n_in, rng)
    for n_tok in (1, 5, 17):
        x = rng.standard_normal((n_tok, n_in)).astype(np.float32)
        got = G.product(raw, t, x, n_threads=2)
        want = G.mul_mat(raw, t, x, n_threads=1) if t in TYPES else M.mul_mat(raw, t, x, n_threads=1)
        np.testing.assert_array_equal(got, want)
        if t in G.R8_TYPES:
            np.testing.assert_array_equal(G.product(G.pack_r8(raw, t), t, x, r8=True, n_out=n_out), want)


def test_product_errors():
    raw = weights(Q.TYPE_Q5_1, 5, 64, np.random.default_rng(3))
    x = np.zeros((2, 64), np.float32)
    assert G.product(raw, Q.TYPE_Q5_1, x[:0]).shape == (0, 5)
    with pytest.raises(ValueError, match="no weight product"):
        G.product(raw, Q.TYPE_Q8_1, x)
    with pytest.raises(ValueError, match="r8"):
        G.product(raw, Q.TYPE_Q5_1, x, r8=True)
    with pytest.raises(TypeError):
        G.product(raw, "q5_1", x)
    with pytest.raises(ValueError, match="bytes"):
        G.product(raw[:, :-1].copy(), Q.TYPE_Q5_1, x)
    with pytest.raises(ValueError, match="multiple"):
        G.product(raw, Q.TYPE_Q5_1, np.zeros((2, 48), np.float32))
    with pytest.raises(ValueError, match="x must be"):
        G.product(raw, Q.TYPE_Q5_1, x.astype(np.float64))
    with pytest.raises(ValueError, match="n_out"):
        G.product(raw, Q.TYPE_Q5_1, x, n_out=4)
    with pytest.raises(ValueError, match="n_out"):
        G.product(G.pack_r8(weights(Q.TYPE_Q4_0, 8, 64, np.random.default_rng(4)), Q.TYPE_Q4_0), Q.TYPE_Q4_0, x,
                  r8=True, n_out=9)
    with pytest.raises(ValueError):
        G.product(raw, Q.TYPE_Q5_1, x, n_threads=0)
