"""The attention of a tile of query tokens sharing a chunk (csrc/attn_tile.h, attention.c's run_tile).

(a) Each kernel against its scalar twin, bit for bit, at every SIMD level of this CPU: the transposed K,
    the scores (register tiles of 6 (AVX2) or 8 (AVX-512) rows, remainders of rows and cells), the V
    accumulation (3 or 6 rows x 4 vectors of lanes, carried over blocks of 64 cells), the V rows.
(b) A prefill's tokens, run together in tiles, give each token the bits it gets alone: a causal prompt
    at depth (every chunk shared; the last, the diagonal, as one list of cells and its prefixes; tiles of
    up to 64 tokens there, 32 otherwise) and
    from an empty cache (diagonal chunks only), with hidden cells, a sliding window and masks whose
    lists are no prefixes of each other, per-token mask values (the cells
    shared, each token's softmax its own), a column order (perm), softcap, two streams, GQA groups of 3, 4 and 10 heads (two passes),
    f16 / f32 / mixed caches and the transposed V, for 1 and 2 threads, at every level; and the same bits
    without a scratch (no tile buffers: the items one by one).
"""
import numpy as np
import pytest

from llamax._native import attention as A
from llamax._native import attn_tile as T
from llamax._native import cpu

LEVELS = cpu.levels()


@pytest.fixture(autouse=True)
def restore():
    A._set_min_work(1)   # small problems use every thread too
    yield
    A._set_min_work(-1)
    cpu.set_simd_level(-1)


def same(a, b):
    return np.array_equal(a.view(np.uint32), b.view(np.uint32))


# ---- (a) the kernels and their twins -------------------------------------------------------------

@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
@pytest.mark.parametrize("n, d", [(1, 8), (7, 64), (8, 64), (13, 256), (100, 72), (256, 64)])
def test_kt_is_the_transpose(level, dtype, n, d):
    cpu.set_simd_level(level)
    rows = np.random.default_rng(n * d).standard_normal((n, d)).astype(dtype)
    kt = T.kt(rows)
    assert kt.shape == (d, (n + 7) // 8 * 8)
    assert same(kt, T.kt(rows, ref=True))
    assert same(kt[:, :n], np.ascontiguousarray(rows.astype(np.float32).T)) and not kt[:, n:].any()
    assert same(T.vf(rows), rows.astype(np.float32))


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("lanes", [8, 16])
@pytest.mark.parametrize("n, d, nq", [(1, 8, 1), (9, 64, 5), (16, 64, 6), (37, 64, 13), (256, 64, 48),
                                      (200, 256, 8), (24, 136, 7), (200, 256, 17)])
def test_dots_match_their_twin(level, lanes, n, d, nq):
    cpu.set_simd_level(level)
    rng = np.random.default_rng(n + d + nq)
    kt = T.kt(rng.standard_normal((n, d)).astype(np.float16))
    q = rng.standard_normal((nq, d)).astype(np.float32)
    S = T.dots(kt, n, q, lanes=lanes)
    assert same(S, T.dots(kt, n, q, lanes=lanes, ref=True))
    exact = (q.astype(np.float64) @ kt[:, :n].astype(np.float64))
    assert np.allclose(S, exact, rtol=1e-5, atol=1e-4)
    # the order of the twin: `lanes` chains over e = l, l + lanes, ..., 16 folded to 8 (lane l + lane l + 8),
    # then ((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7)): the per-token kernels' (AVX2's, AVX-512's)
    p = np.zeros((lanes,), np.float32)
    for l in range(lanes):
        acc = np.float32(0)
        for e in range(l, d, lanes):
            acc = np.float32(np.float64(kt[e, 0]) * np.float64(q[0, e]) + np.float64(acc))   # an exact fma of f32
        p[l] = acc
    if lanes == 16:
        p = p[:8] + p[8:]
    tree = ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]))
    assert S[0, 0] == tree


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("n, dv, nq", [(1, 8, 1), (63, 64, 2), (64, 64, 3), (65, 64, 4), (256, 64, 48),
                                       (130, 256, 7), (70, 40, 5), (5, 264, 3), (64, 256, 11)])
def test_vacc_matches_its_twin(level, n, dv, nq):
    cpu.set_simd_level(level)
    rng = np.random.default_rng(n + dv + nq)
    vf = rng.standard_normal((n, dv)).astype(np.float32)
    P = rng.random((nq, n)).astype(np.float32)
    acc = T.vacc(vf, P)
    assert same(acc, T.vacc(vf, P, ref=True))
    assert np.allclose(acc, P.astype(np.float64) @ vf.astype(np.float64), rtol=1e-5, atol=1e-5)


def test_kernels_refuse_bad_shapes():
    with pytest.raises(ValueError, match="multiple of 8"):
        T.kt(np.zeros((4, 12), np.float32))
    with pytest.raises(TypeError):
        T.kt(np.zeros((4, 16), np.float64))
    with pytest.raises(ValueError, match="kt"):
        T.dots(np.zeros((16, 8), np.float32), 9, np.zeros((1, 16), np.float32))
    with pytest.raises(ValueError, match="lanes"):
        T.dots(np.zeros((16, 8), np.float32), 8, np.zeros((1, 16), np.float32), lanes=4)
    with pytest.raises(ValueError, match="P must be"):
        T.vacc(np.zeros((4, 8), np.float32), np.zeros((2, 5), np.float32))


# ---- (b) a token's bits in a tile and alone --------------------------------------------------------

def cache(rng, t, n_stream, kv_size, n_head_kv, d):
    x = rng.standard_normal((n_stream, kv_size, n_head_kv, d)).astype(np.float32)
    return x.astype(np.float16) if t == "f16" else x


def causal_mask(n_stream, n_tps, n_kv, depth, holes=(), per_token=False, window=0, skip_prev=False):
    """Token t of a stream sees cells [0, depth + t] but the holes; per_token: each token's visible
    cells get a value of its own (ALiBi-like); window: only the last `window` of them (a sliding
    window: lists of one length, shifted); skip_prev: not the cell of the token before it (each
    token's cells are no prefix of the next one's)."""
    m = np.full((n_stream, n_tps, n_kv), -np.inf, np.float32)
    for t in range(n_tps):
        seen = np.arange(depth + t + 1, dtype=np.float32)[::-1]
        m[:, t, :depth + t + 1] = -np.float32(t) * seen / 64 if per_token else 0
        if window:
            m[:, t, :max(0, depth + t + 1 - window)] = -np.inf
        if skip_prev and depth + t >= 1:
            m[:, t, depth + t - 1] = -np.inf
    for h in holes:
        m[:, :, h] = -np.inf
    return m


CASES = {   # n_head, n_head_kv, d, type_k, type_v, v_trans, n_stream, depth, n_tps, extra
    "smollm2 f16": (9, 3, 64, "f16", "f16", False, 1, 600, 37, {}),
    "gemma d256": (4, 1, 256, "f16", "f16", False, 1, 300, 20, {}),
    "tiles of 64 at depth": (9, 3, 64, "f16", "f16", False, 1, 500, 200, {}),
    "two passes": (20, 2, 64, "f16", "f32", False, 1, 520, 17, {}),
    "f32 cache": (8, 2, 32, "f32", "f32", False, 1, 700, 33, {}),
    "vtrans": (9, 3, 64, "f16", "f16", True, 1, 600, 19, {}),
    "two streams": (6, 2, 64, "f16", "f16", False, 2, 400, 18, {}),
    "holes": (9, 3, 64, "f16", "f16", False, 1, 600, 21, {"holes": (3, 100, 101, 257, 511)}),
    "per-token mask": (9, 3, 64, "f16", "f16", False, 1, 300, 17, {"per_token": True}),
    "softcap": (4, 1, 64, "f16", "f16", False, 1, 300, 16, {"softcap": 30.0}),
    "perm": (9, 3, 64, "f16", "f16", False, 1, 600, 18, {"perm": True}),
    "from empty": (9, 3, 64, "f16", "f16", False, 1, 0, 45, {}),
    "from empty, gemma": (4, 1, 256, "f16", "f16", False, 1, 0, 40, {}),
    "past a chunk": (9, 3, 64, "f16", "f16", False, 1, 0, 300, {}),
    "from empty, holes": (9, 3, 64, "f16", "f16", False, 1, 0, 40, {"holes": (0, 7, 8, 30)}),
    "from empty, vtrans": (9, 3, 64, "f16", "f16", True, 1, 0, 40, {}),
    "sliding window": (4, 1, 64, "f16", "f16", False, 1, 0, 70, {"window": 24}),
    "no prefixes": (9, 3, 64, "f16", "f16", False, 1, 0, 40, {"skip_prev": True}),
}


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_a_token_in_a_tile_gets_its_bits_alone(level, n_threads, case):
    cpu.set_simd_level(level)
    nh, nkv, d, tk, tv, v_trans, ns, depth, n_tps, extra = CASES[case]
    rng = np.random.default_rng(len(case))
    n_kv = depth + n_tps + 5           # cells past every token's row: hidden from all
    kv_size = n_kv + 3
    k = cache(rng, tk, ns, kv_size, nkv, d)
    v = cache(rng, tv, ns, kv_size, nkv, d)
    if v_trans:
        v = np.ascontiguousarray(v.transpose(0, 2, 3, 1))
    q = rng.standard_normal((ns * n_tps, nh, d)).astype(np.float32)
    mask = causal_mask(ns, n_tps, n_kv, depth, extra.get("holes", ()), extra.get("per_token", False),
                       extra.get("window", 0), extra.get("skip_prev", False))
    kw = dict(n_kv=n_kv, scale=0.125, softcap=extra.get("softcap", 0.0), v_trans=v_trans, n_threads=n_threads)
    if extra.get("perm"):
        kw["perm"] = np.stack([rng.permutation(n_kv).astype(np.int32) for _ in range(ns)])
    out = A.attn(q, k, v, mask, **kw).reshape(ns, n_tps, nh, d)
    assert np.isfinite(out).all()
    assert same(out, A.attn(q, k, v, mask, use_scratch=False, **kw).reshape(ns, n_tps, nh, d))   # item by item
    for t in range(n_tps):
        qt = np.ascontiguousarray(q.reshape(ns, n_tps, nh, d)[:, t].reshape(ns, nh, d))
        alone = A.attn(qt, k, v, np.ascontiguousarray(mask[:, t:t + 1]), **kw).reshape(ns, nh, d)
        assert same(out[:, t], alone), f"token {t}"
    ref = A.attn_ref(q, k, v, mask, **kw).reshape(ns, n_tps, nh, d)
    assert np.abs(out - ref).max() <= A.MAX_ERR * max(1.0, float(np.abs(v).max()))
