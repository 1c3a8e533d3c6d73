"""Tests of the mixture-of-experts feed-forward (csrc/moe.h via llamax._native.moe).

  (a) routing: ids and weights bit for bit against a numpy oracle of csrc/moe.h's gating (softmax:
      max subtracted, vexp.h's exp, sum in double, times (float) (1 / sum); sigmoid), top-k
      (descending, ties to the lower id), norm_w (double sum clamped at 2^-14) and w_scale, from the
      engine's router logits (gemm.product: the router's product is tested in test_gemm / test_matmul);
  (b) the composition, bit for bit: per routed expert, the product.h products of its tokens' rows
      (gemm.product), layer.gated, then the slot-order weighted sum in float32 numpy;
  (c) against float64 numpy with the experts dequantized: within the error of the products
      (float rounding for F32 experts; ggml's q8_0 activation rounding for Q8_0 / Q4_0 experts);
  (d) batch invariance (a token alone, in a batch of 7, in a batch of 64: the same bits), n_threads
      1 vs 2 (both schedules: experts in parallel and one after the other), the reference, both
      weight layouts (GGUF rows / r8) and the SIMD levels give the same bits;
  (e) bad shapes, types and arguments raise, and leave the output untouched.

The exp of the oracle is vexp.h's lx_exp_ref in numpy float32, its fused multiply-adds emulated
exactly (float64 sum rounded to odd, then to float32).
"""
from __future__ import annotations

import numpy as np
import pytest
from test_quants_blocks import random_blocks

from llamax._native import cpu
from llamax._native import gemm as G
from llamax._native import layer as L
from llamax._native import moe as M
from llamax._native import quants as Q

F32, F16, Q4_0, Q4_1, Q8_0, Q4_K = Q.TYPE_F32, Q.TYPE_F16, Q.TYPE_Q4_0, Q.TYPE_Q4_1, Q.TYPE_Q8_0, Q.TYPE_Q4_K
f32 = np.float32


@pytest.fixture(autouse=True)
def _reset_level():
    yield
    cpu.set_simd_level(-1)


# ---- the oracle of the routing ------------------------------------------------------------------

def fmaf(a, b, c):
    """float32 fmaf(a, b, c), exactly: a * b is exact in float64, the float64 sum is rounded to odd
    (TwoSum gives the exact error), which then rounds to float32 as the single rounding would."""
    a, b, c = (np.asarray(v, np.float32).astype(np.float64) for v in (a, b, c))
    p = a * b
    s = p + c
    bb = s - p
    err = (p - (s - bb)) + (c - bb)
    even = (s.view(np.int64) & 1) == 0
    fix = (err != 0) & even
    s = np.where(fix, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
    return s.astype(np.float32)


def exp_ref(x):
    """vexp.h's lx_exp_ref in float32 numpy, operation for operation."""
    x = np.asarray(x, np.float32)
    under = x < f32(-87.33654)
    x = np.clip(x, f32(-87.33654), f32(88.3762626647949))
    n = np.rint(x * f32(1.44269504088896341))
    r = fmaf(-n, f32(0.693359375), x)
    r = fmaf(-n, f32(-2.12194440e-4), r)
    y = np.full_like(x, f32(1.9875691500e-4))
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        y = fmaf(y, r, f32(c))
    y = fmaf(y, r * r, r + f32(1))
    p2 = ((n.astype(np.int32) + 127) << 23).astype(np.uint32).view(np.float32)
    return np.where(under, f32(0), y * p2).astype(np.float32)


def seq_sum(v):
    """float64 sum of float32 values added one by one, in order (ggml_float accumulators)."""
    return np.add.accumulate(np.asarray(v, np.float64), axis=-1)[..., -1]


def np_route(logits, n_used, gating="softmax", norm_w=False, w_scale=0.0):
    """(ids [n, n_used], weights [n, n_used]) of csrc/moe.h's routing, from float32 logits [n, n_expert]."""
    lg = np.asarray(logits, np.float32)
    if gating == "softmax":
        e = exp_ref(lg - lg.max(axis=1, keepdims=True))
        p = e * (1.0 / seq_sum(e)).astype(np.float32)[:, None]
    else:
        with np.errstate(over="ignore"):
            ex = np.where(-lg > f32(88), f32(np.inf), exp_ref(-lg))
            p = f32(1) / (f32(1) + ex)
    ids = np.argsort(-p, axis=1, kind="stable")[:, :n_used].astype(np.int32)
    w = np.take_along_axis(p, ids, axis=1)
    if norm_w:
        s = np.maximum(seq_sum(w).astype(np.float32), f32(6.103515625e-5))
        w = w / s[:, None]
    if w_scale not in (0.0, 1.0):
        w = w * f32(w_scale)
    return ids, w.astype(np.float32)


# ---- weights ------------------------------------------------------------------------------------

def rows(t, n_rows, n_in, rng, scale):
    """uint8 [n_rows, row_bytes] of type t: normal floats quantized as ggml does (f32 / f16 / q4_0 /
    q8_0), else random blocks."""
    if t in (F32, F16, Q4_0, Q8_0):
        return Q.quantize(t, (rng.standard_normal((n_rows, n_in)) * scale).astype(np.float32))
    return random_blocks(t, n_rows * n_in // Q.block_size(t), rng).reshape(n_rows, -1)


class Weights:
    """A random MoE: the router and the experts as GGUF bytes, with their types."""

    def __init__(self, t, n_embd=64, n_ff=96, n_expert=8, seed=0, router_type=F32, router_scale=0.3, down_type=None):
        rng = np.random.default_rng(seed)
        self.t, self.rt, self.E, self.F, self.X = t, router_type, n_embd, n_ff, n_expert
        self.td = t if down_type is None else down_type
        self.router = rows(router_type, n_expert, n_embd, rng, router_scale)
        s_in, s_out = 1 / np.sqrt(n_embd), 1 / np.sqrt(n_ff)
        self.gate = np.stack([rows(t, n_ff, n_embd, rng, s_in) for _ in range(n_expert)])
        self.up = np.stack([rows(t, n_ff, n_embd, rng, s_in) for _ in range(n_expert)])
        self.down = np.stack([rows(self.td, n_embd, n_ff, rng, s_out) for _ in range(n_expert)])

    def moe(self, n_used, **kw):
        return M.MoE((self.router, self.rt), (self.gate, self.t), (self.up, self.t), (self.down, self.td), n_used,
                     **kw)

    def logits(self, x):
        return G.product(self.router, self.rt, x, n_threads=1)

    def oracle(self, x, ids, wts, act="silu", table=None):
        """(b): every routed expert over its tokens (ascending) through the engine's products and
        layer.gated, then y = ((d0 w0 + d1 w1) + d2 w2) + ... in float32."""
        n, K = ids.shape
        d = np.zeros((n, K, self.E), np.float32)
        for e in range(self.X):
            ts, ks = np.nonzero(ids == e)
            if not len(ts):
                continue
            xs = np.ascontiguousarray(x[ts])
            g = G.product(self.gate[e], self.t, xs, n_threads=1)
            u = G.product(self.up[e], self.t, xs, n_threads=1)
            a = L.gated(np.concatenate([g, u], axis=1), self.F, act, table)
            d[ts, ks] = G.product(self.down[e], self.td, a, n_threads=1)
        y = d[:, 0] * wts[:, :1]
        for k in range(1, K):
            y = y + d[:, k] * wts[:, k:k + 1]
        return y

    def float64(self, x, ids, wts, blocks):
        """(c): y in float64 with the experts dequantized and SiLU exact, and the magnitude the products'
        errors scale with: |w_k| |W_d| (1.1 |dg| |u| + |g| |du| + |a|~), dg = |W_g| |x|~, du = |W_u| |x|~,
        v~ = |v| (float experts) or its 32-block's max |v| broadcast (blocks: ggml's q8_0 activations
        round each value to a step of the block's amax / 127); 1.1 bounds SiLU's slope."""
        deq = lambda raw, r, c: Q.dequantize(self.t, raw, (r, c)).astype(np.float64)   # noqa: E731

        def amax(v):
            v = np.abs(v)
            return np.repeat(v.reshape(-1, 32).max(axis=1), 32) if blocks else v

        y = np.zeros((len(x), self.E))
        mag = np.zeros((len(x), self.E))
        x64 = x.astype(np.float64)
        for t in range(len(x)):
            for k, e in enumerate(ids[t]):
                wg, wu, wd = deq(self.gate[e], self.F, self.E), deq(self.up[e], self.F, self.E), \
                    deq(self.down[e], self.E, self.F)
                g, u = wg @ x64[t], wu @ x64[t]
                a = g / (1 + np.exp(-g)) * u
                y[t] += wts[t, k] * (wd @ a)
                dg, du = np.abs(wg) @ amax(x64[t]), np.abs(wu) @ amax(x64[t])
                mag[t] += abs(wts[t, k]) * (np.abs(wd) @ (1.1 * dg * np.abs(u) + np.abs(g) * du + amax(a)))
        return y, mag


def inputs(n, n_embd, seed, scale=1.0):
    return (np.random.default_rng(1000 + seed).standard_normal((n, n_embd)) * scale).astype(np.float32)


# ---- (a) routing --------------------------------------------------------------------------------

@pytest.mark.parametrize("gating", ["softmax", "sigmoid"])
@pytest.mark.parametrize("norm_w, w_scale", [(False, 0.0), (True, 0.0), (False, 2.5), (True, 0.75), (False, 1.0)])
def test_routing_is_numpy_softmax_topk_bit_for_bit(gating, norm_w, w_scale):
    w = Weights(Q8_0, n_embd=64, n_expert=16, seed=1)
    m = w.moe(4, gating=gating, norm_w=norm_w, w_scale=w_scale)
    for scale in (1.0, 40.0):   # 40: logits over +-100 (exps that vanish, sigmoids at 0 and 1)
        x = inputs(37, 64, 2, scale)
        ids, wts = m.route(x, n_threads=2)
        want_ids, want_w = np_route(w.logits(x), 4, gating, norm_w, w_scale)
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_array_equal(wts.view(np.uint32), want_w.view(np.uint32))
        assert ids.dtype == np.int32 and wts.dtype == np.float32


def test_the_exp_oracle_is_vexp():
    """The oracle's exp is the kernel's: the SiLU of layer.gated (vexp.h's exp) through it, bit for bit."""
    g = np.linspace(-87, 87, 20001, dtype=np.float32)
    gu = np.concatenate([g, np.ones_like(g)])[None, :]
    want = g / (f32(1) + exp_ref(-g))
    np.testing.assert_array_equal(L.gated(gu, len(g), "silu", ref=True)[0], want)


@pytest.mark.parametrize("gating", ["softmax", "sigmoid"])
def test_ties_go_to_the_lower_expert(gating):
    """Zero router rows give equal logits (0): the lower ids win, in id order."""
    w = Weights(F32, n_embd=32, n_expert=8, seed=3)
    r = -np.abs(np.random.default_rng(4).standard_normal((8, 32))).astype(np.float32)
    r[[1, 3, 4, 6]] = 0
    w.router = r.view(np.uint8)
    x = np.abs(inputs(5, 32, 5)) + f32(0.1)       # positive x: the other logits are negative
    for k, want in [(2, [1, 3]), (4, [1, 3, 4, 6])]:
        ids, wts = w.moe(k, gating=gating).route(x)
        np.testing.assert_array_equal(ids, np.tile(np.array(want, np.int32), (5, 1)))
        assert (wts == wts[:, :1]).all()
    ids, _ = w.moe(5, gating=gating).route(x)
    np.testing.assert_array_equal(ids, np_route(w.logits(x), 5, gating)[0])
    # an all-zero router: every expert ties, ids 0..k-1, weights 1 / n_expert (1 / k when normalized)
    w.router = np.zeros((8, 32 * 4), np.uint8)
    ids, wts = w.moe(3, norm_w=True).route(x)
    np.testing.assert_array_equal(ids, np.tile(np.arange(3, dtype=np.int32), (5, 1)))
    np.testing.assert_array_equal(wts, np_route(np.zeros((5, 8), np.float32), 3, norm_w=True)[1])


def test_integer_router():
    """A Q8_0 router takes the GEMM (activations rounded to q8_0): routing follows its logits."""
    w = Weights(Q4_0, n_embd=64, n_expert=8, seed=6, router_type=Q8_0)
    x = inputs(20, 64, 7)
    ids, wts = w.moe(3, norm_w=True).route(x)
    want_ids, want_w = np_route(w.logits(x), 3, norm_w=True)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(wts, want_w)


# ---- (b) the composition ------------------------------------------------------------------------

@pytest.mark.parametrize("t", [F32, F16, Q8_0, Q4_0, Q4_1, Q4_K], ids=lambda t: Q.TYPE_NAMES[t])
@pytest.mark.parametrize("r8", [True, False])
def test_forward_is_the_composition_bit_for_bit(t, r8):
    n_embd, n_ff = (256, 256) if t == Q4_K else (64, 96)
    w = Weights(t, n_embd=n_embd, n_ff=n_ff, n_expert=8, seed=10 + t)
    m = w.moe(2, norm_w=True, r8=r8)
    x = inputs(23, n_embd, 11)
    ids, wts = m.route(x)
    want = w.oracle(x, ids, wts)
    for nt in (1, 2):
        np.testing.assert_array_equal(m.forward(x, n_threads=nt), want)
    np.testing.assert_array_equal(m.forward(x, ref=True), want)


@pytest.mark.parametrize("t, td", [(Q4_K, Q.TYPE_Q6_K), (Q8_0, F32), (Q4_0, Q8_0)],
                         ids=lambda t: Q.TYPE_NAMES[t])
def test_mixed_expert_types(t, td):
    """A Q4_K_M file's experts: gate / up Q4_K, down Q6_K (each matrix its own type and layout)."""
    n = 256 if t == Q4_K else 64
    w = Weights(t, n_embd=n, n_ff=n, n_expert=6, seed=15 + t, down_type=td)
    m = w.moe(2, norm_w=True)
    x = inputs(12, n, 16)
    ids, wts = m.route(x)
    want = w.oracle(x, ids, wts)
    np.testing.assert_array_equal(m.forward(x, n_threads=2), want)
    np.testing.assert_array_equal(m.forward(x[3:4].copy(), n_threads=1), want[3:4])


@pytest.mark.parametrize("gating, norm_w, w_scale", [("sigmoid", False, 2.0), ("softmax", False, 0.0)])
def test_gating_variants_and_the_gelu_table(gating, norm_w, w_scale):
    from llamax.model.decoder import gelu_table
    table = gelu_table()
    w = Weights(Q8_0, n_embd=64, n_ff=64, n_expert=6, seed=12)
    for act, tab in (("silu", None), ("gelu_table", table)):
        m = w.moe(3, gating=gating, norm_w=norm_w, w_scale=w_scale, act=act, gelu_table=tab)
        x = inputs(9, 64, 13, 3.0)
        ids, wts = m.route(x)
        want = w.oracle(x, ids, wts, act, tab)
        np.testing.assert_array_equal(m.forward(x, n_threads=2), want)
        np.testing.assert_array_equal(m.forward(x, ref=True), want)


def test_one_expert_per_token_and_all_experts():
    w = Weights(Q8_0, n_embd=64, n_ff=64, n_expert=4, seed=14)
    x = inputs(11, 64, 15)
    for k in (1, 4):
        m = w.moe(k)
        ids, wts = m.route(x)
        if k == 4:
            assert (np.sort(ids, axis=1) == np.arange(4)).all()
        np.testing.assert_array_equal(m.forward(x, n_threads=2), w.oracle(x, ids, wts))


# ---- (c) against float64 ------------------------------------------------------------------------

@pytest.mark.parametrize("t", [F32, Q8_0, Q4_0], ids=lambda t: Q.TYPE_NAMES[t])
def test_forward_against_float64(t):
    """F32 experts: float rounding only (n-term sums within 2 (n + 8) 2^-24 |terms| (matmul.h), a
    few ulps of SiLU; a factor 4 of room). Q8_0 / Q4_0 experts: each product takes its activations
    (x, then act) rounded to q8_0 as ggml does, every value within (1/254 + 2^-11) of its block's
    amax (half a step of amax / 127, and the f16 scale), carried to y through the magnitudes of
    Weights.float64 (first order; 5% of room for the rest)."""
    w = Weights(t, n_embd=128, n_ff=64, n_expert=8, seed=20 + t)
    m = w.moe(3, norm_w=True)
    x = inputs(16, 128, 21)
    ids, wts = m.route(x)
    y = m.forward(x, n_threads=2)
    y64, mag = w.float64(x, ids, wts, blocks=t != F32)
    rel = 4 * 2 * (128 + 8) * 2.0 ** -24 if t == F32 else 1.05 * (1 / 254 + 2.0 ** -11)
    err = np.abs(y - y64)
    assert (err <= rel * mag + 1e-30).all(), f"worst {np.max(err / (mag + 1e-30)):.3g} of the magnitude > {rel:.3g}"
    if t != F32:   # the activation rounding shows, well inside its bound
        assert 0 < np.median(err / mag) < rel / 4


# ---- (d) invariance -----------------------------------------------------------------------------

@pytest.mark.parametrize("t", [F32, Q8_0, Q4_0], ids=lambda t: Q.TYPE_NAMES[t])
def test_batch_invariance_threads_and_reference(t):
    """Token t alone, in a batch of 7 and in a batch of 64: the same bits, for 1 thread (experts one
    after the other) and 2 (units in parallel), and the reference's."""
    w = Weights(t, n_embd=64, n_ff=96, n_expert=8, seed=30 + t)
    m = w.moe(2, norm_w=True)
    x = inputs(64, 64, 31)
    ref = m.forward(x, ref=True)
    for nt in (1, 2):
        np.testing.assert_array_equal(m.forward(x, n_threads=nt), ref)
        np.testing.assert_array_equal(m.forward(x[20:27].copy(), n_threads=nt), ref[20:27])
        for i in (0, 23, 63):
            np.testing.assert_array_equal(m.forward(x[i:i + 1].copy(), n_threads=nt), ref[i:i + 1])
    ids, wts = m.route(x)
    for i in (0, 23, 63):
        a_ids, a_wts = m.route(x[i:i + 1].copy())
        np.testing.assert_array_equal(a_ids[0], ids[i])
        np.testing.assert_array_equal(a_wts[0], wts[i])


def test_decode_shape_many_experts():
    """A decode step of a qwen3moe-like layer (64 experts, 8 used): one token, both schedules."""
    w = Weights(Q8_0, n_embd=128, n_ff=64, n_expert=64, seed=40)
    m = w.moe(8, norm_w=True)
    x = inputs(3, 128, 41)
    want = m.forward(x, ref=True)
    for nt in (1, 2, 3):
        np.testing.assert_array_equal(m.forward(x[1:2].copy(), n_threads=nt), want[1:2])
        np.testing.assert_array_equal(m.forward(x, n_threads=nt), want)


def test_schedules_and_units_of_many_rows():
    """All tokens on one expert (a zero router: every expert ties, the lowest wins): 50 rows are one
    unit (with 2 threads: the expert's products over both threads), 130 rows three units of at most
    64 (2 threads: the units in parallel); 1 to 3 threads, the reference and the composition agree."""
    w = Weights(Q4_0, n_embd=64, n_ff=64, n_expert=3, seed=45)
    w.router = np.zeros((3, 64 * 4), np.uint8)
    m = w.moe(1)
    for n in (50, 130):
        x = inputs(n, 64, 46)
        ids, wts = m.route(x)
        assert (ids == 0).all() and (wts == 1 / np.float32(3)).all()
        want = w.oracle(x, ids, wts)
        np.testing.assert_array_equal(m.forward(x, ref=True), want)
        for nt in (1, 2, 3):
            np.testing.assert_array_equal(m.forward(x, n_threads=nt), want)


@pytest.mark.parametrize("t", [Q8_0, Q4_0], ids=lambda t: Q.TYPE_NAMES[t])
def test_layouts_and_simd_levels_give_the_same_bits(t):
    """With integer weights throughout (a Q8_0 router: the float product's sums differ between
    levels) every level gives the bits of the GGUF-rows layout."""
    w = Weights(t, n_embd=64, n_ff=96, n_expert=8, seed=50 + t, router_type=Q8_0)
    x = inputs(30, 64, 51)
    want = w.moe(2, r8=False).forward(x, n_threads=1)
    packed = w.moe(2)
    assert packed.gate.shape == (8, 96, w.gate.shape[2]) and packed.down.shape == (8, 64, w.down.shape[2])
    for lv in cpu.levels():
        cpu.set_simd_level(lv)
        np.testing.assert_array_equal(packed.forward(x, n_threads=2), want)
        np.testing.assert_array_equal(packed.forward(x[5:6].copy(), n_threads=2), want[5:6])


def test_in_place():
    w = Weights(Q8_0, seed=60)
    m = w.moe(2)
    x = inputs(10, 64, 61)
    want = m.forward(x)
    for nt, ref in ((1, False), (2, False), (1, True)):
        y = x.copy()
        assert m.forward(y, n_threads=nt, ref=ref, out=y) is y
        np.testing.assert_array_equal(y, want)
    out = np.empty_like(x)
    assert m.forward(x, out=out) is out
    np.testing.assert_array_equal(out, want)


def test_pack_experts_is_pack_r8_per_expert():
    rng = np.random.default_rng(70)
    raw = np.stack([Q.quantize(Q4_0, rng.standard_normal((20, 64)).astype(np.float32)) for _ in range(3)])
    packed = M.pack_experts(raw, Q4_0)          # 20 rows: each expert padded to 24 on its own
    assert packed.shape == (3, 24, raw.shape[2])
    for e in range(3):
        np.testing.assert_array_equal(packed[e], G.pack_r8(np.ascontiguousarray(raw[e]), Q4_0))
    out = np.empty_like(packed)
    assert M.pack_experts(raw, Q4_0, out=out) is out
    np.testing.assert_array_equal(out, packed)


def test_empty_batch():
    m = Weights(Q8_0, seed=80).moe(2)
    x = np.zeros((0, 64), np.float32)
    assert m.forward(x).shape == (0, 64)
    ids, wts = m.route(x)
    assert ids.shape == (0, 2) and wts.shape == (0, 2)
    assert (m.n_embd, m.n_ff_exp, m.n_expert, m.n_used) == (64, 96, 8, 2)


# ---- (e) errors ---------------------------------------------------------------------------------

def test_bad_weights_raise():
    w = Weights(Q8_0, seed=90)
    R, Gt, U, D = (w.router, F32), (w.gate, Q8_0), (w.up, Q8_0), (w.down, Q8_0)
    with pytest.raises(TypeError, match="pair"):
        M.MoE(w.router, Gt, U, D, 2)
    with pytest.raises(TypeError, match="int"):
        M.MoE(R, (w.gate, "q8_0"), U, D, 2)
    with pytest.raises(ValueError, match="no weight product"):
        M.MoE(R, (w.gate, 40), U, D, 2)
    with pytest.raises(ValueError, match="uint8"):
        M.MoE(R, (w.gate.view(np.int8), Q8_0), U, D, 2)
    with pytest.raises(ValueError, match="uint8"):
        M.MoE(R, (w.gate[0], Q8_0), U, D, 2)
    with pytest.raises(ValueError, match="disagree"):
        M.MoE(R, Gt, (w.up[:, :50].copy(), Q8_0), D, 2)
    with pytest.raises(ValueError, match="disagree"):
        M.MoE(R, Gt, U, (w.down[:7].copy(), Q8_0), 2)
    with pytest.raises(ValueError, match="bytes"):
        M.MoE(R, (w.gate, Q4_0), U, D, 2)         # q8_0 bytes called q4_0
    with pytest.raises(ValueError, match="bytes"):
        M.MoE((w.router[:, :128].copy(), F32), Gt, U, D, 2)
    with pytest.raises(ValueError, match="whole blocks"):   # n_embd 48: not whole q8_0 blocks
        M.MoE((np.zeros((8, 48 * 4), np.uint8), F32), Gt, U, (np.zeros((8, 48, 102), np.uint8), Q8_0), 2)
    for k in (0, 9, -1):
        with pytest.raises(ValueError, match="n_used"):
            M.MoE(R, Gt, U, D, k)
    with pytest.raises(ValueError, match="gating"):
        M.MoE(R, Gt, U, D, 2, gating="relu")
    with pytest.raises(ValueError, match="activation"):
        M.MoE(R, Gt, U, D, 2, act="gelu")
    with pytest.raises(ValueError, match="table"):
        M.MoE(R, Gt, U, D, 2, act="gelu_table")
    with pytest.raises(ValueError, match="65536"):
        M.MoE(R, Gt, U, D, 2, act="gelu_table", gelu_table=np.zeros(100, np.float32))
    with pytest.raises(ValueError, match="r8"):
        M.pack_experts(w.gate, F32)
    with pytest.raises(ValueError, match="shape"):
        M.pack_experts(w.gate, Q8_0, out=np.empty((8, 90, 68), np.uint8))


def test_bad_inputs_raise_and_leave_out_untouched():
    m = Weights(Q8_0, seed=91).moe(2)
    x = inputs(4, 64, 92)
    with pytest.raises(TypeError):
        m.forward(x.tolist())
    for bad in (x.astype(np.float64), x[:, :32].copy(), x[None], np.asfortranarray(x)):
        with pytest.raises(ValueError):
            m.forward(bad)
    nan = x.copy()
    nan[2, 5] = np.nan
    with pytest.raises(ValueError, match="finite"):
        m.forward(nan)
    with pytest.raises(ValueError, match="finite"):
        m.route(nan)
    with pytest.raises(ValueError):
        m.forward(x, n_threads=0)
    out = np.full_like(x, 7.0)
    with pytest.raises(ValueError, match="out"):
        m.forward(x, out=out[:3])
    with pytest.raises(ValueError, match="out"):
        m.forward(x, out=out.astype(np.float64))
    big = np.zeros((5, 64), np.float32)
    big[:4] = x
    with pytest.raises(ValueError, match="overlap"):
        m.forward(big[:4], out=big[1:])
    assert (out == 7.0).all()
    np.testing.assert_array_equal(big[:4], x)
