"""Tests of attention over the KV cache (csrc/attention.c via llamax._native.attention).

The oracle is plain numpy in float64: softmax(q k^T * scale + mask) v per (token, head), with
llama.cpp's two softcap conventions (flash: c*tanh(s*scale/c) + mask; mul_mat path:
c*tanh(s/c)*scale + mask). The scalar C references must match it, the fast kernels must match
the references within LX_ATTN_MAX_ERR * max|v|, and the fast kernels must give the same bits for
every n_threads, with and without the scratch (decode split), at every SIMD level of this CPU.
"""
import numpy as np
import pytest

from llamax._native import attention as A
from llamax._native import cpu

MAX_ERR = A.MAX_ERR
# the references against float64 numpy: float32 rounding only, same budget
RTOL_REF = {np.float32: MAX_ERR, np.float16: MAX_ERR}
LEVELS = [lv for lv in cpu.levels() if lv <= cpu.AVX512]  # VNNI: the quantized-K lanes only (test_attention_vnni)


@pytest.fixture(autouse=True)
def every_thread_works():
    """Small test problems would otherwise stay on one thread (the kernels' work threshold)."""
    A._set_min_work(1)
    yield
    A._set_min_work(-1)


@pytest.fixture(params=LEVELS, ids=lambda lv: cpu.LEVEL_NAMES[lv])
def level(request):
    cpu.set_simd_level(request.param)
    yield request.param
    cpu.set_simd_level(-1)


# ---- numpy oracle ---------------------------------------------------------------------------

def np_attention(q, k, v, mask, n_kv, scale, softcap=0.0, v_trans=False):
    """float64 attention of the layouts in attention.h; all-hidden rows give zeros."""
    n_stream, kv_size, n_head_kv, d_k = k.shape
    n_tokens, n_head, _ = q.shape
    n_tps = n_tokens // n_stream
    g = n_head // n_head_kv
    k = k.astype(np.float64)
    v = v.astype(np.float64)
    if v_trans:
        v = v.transpose(0, 3, 1, 2)  # -> [n_stream, kv_size, n_head_kv, d_v]
    out = np.zeros((n_tokens, n_head, v.shape[-1]))
    for s in range(n_stream):
        for t in range(n_tps):
            m = mask[s, t, :n_kv].astype(np.float64)
            vis = ~np.isneginf(m)
            if not vis.any():
                continue
            for h in range(n_head):
                kk = k[s, :n_kv, h // g][vis]
                vv = v[s, :n_kv, h // g][vis]
                x = kk @ q[s * n_tps + t, h].astype(np.float64)
                if softcap and not v_trans:
                    x = softcap * np.tanh(x * scale / softcap)
                elif softcap:
                    x = softcap * np.tanh(x / softcap) * scale
                else:
                    x = x * scale
                x = x + m[vis]
                p = np.exp(x - x.max())
                out[s * n_tps + t, h] = (p / p.sum()) @ vv
    return out


def make_case(rng, *, n_stream=1, n_tps=1, pad=0, n_head=4, n_head_kv=2, d_k=16, d_v=16, kv_size=64,
              n_kv=None, dtype=np.float32, v_trans=False, p_hidden=0.3, hidden_rows=(), alibi=False):
    """Random q/k/v (entries in [-1, 1]) and a mask with hidden cells and padding rows."""
    n_kv = kv_size if n_kv is None else n_kv
    n_tps_pad = n_tps + pad
    q = rng.uniform(-1, 1, (n_stream * n_tps, n_head, d_k)).astype(np.float32)
    k = rng.uniform(-1, 1, (n_stream, kv_size, n_head_kv, d_k)).astype(dtype)
    vshape = (n_stream, n_head_kv, d_v, kv_size) if v_trans else (n_stream, kv_size, n_head_kv, d_v)
    v = rng.uniform(-1, 1, vshape).astype(dtype)
    if alibi:
        mask = -rng.integers(0, 50, (n_stream, n_tps_pad, n_kv)).astype(np.float32)
    else:
        mask = np.zeros((n_stream, n_tps_pad, n_kv), dtype=np.float32)
    mask[rng.random(mask.shape) < p_hidden] = -np.inf
    mask[:, n_tps:, :] = -np.inf  # padding rows
    for s, t in hidden_rows:
        mask[s, t, :] = -np.inf
    return q, k, v, mask, n_kv


def run_all(q, k, v, mask, n_kv, scale, softcap, v_trans):
    """ref, and fast for n_threads 1/2/3 with and without scratch: asserts they agree."""
    kw = dict(n_kv=n_kv, scale=scale, softcap=softcap, v_trans=v_trans)
    ref = A.attn_ref(q, k, v, mask, **kw)
    fast = A.attn(q, k, v, mask, n_threads=1, **kw)
    for nt in (1, 2, 3):
        for use_scratch in (True, False):
            other = A.attn(q, k, v, mask, n_threads=nt, use_scratch=use_scratch, **kw)
            assert np.array_equal(fast, other, equal_nan=True), (nt, use_scratch)
    vmax = max(1.0, float(np.abs(v.astype(np.float32)).max()))
    assert np.abs(fast - ref).max() <= MAX_ERR * vmax
    return ref, fast


# ---- agreement with numpy -----------------------------------------------------------------

@pytest.mark.parametrize("v_trans", [False, True], ids=["flash", "vtrans"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("n_stream,n_tps,pad", [(1, 1, 0), (1, 5, 3), (2, 3, 1), (3, 2, 0)])
@pytest.mark.parametrize("n_head,n_head_kv", [(4, 4), (6, 2), (8, 2)], ids=["gqa1", "gqa3", "gqa4"])
@pytest.mark.parametrize("softcap", [0.0, 1.5], ids=["nocap", "cap"])
def test_matches_numpy(level, v_trans, dtype, n_stream, n_tps, pad, n_head, n_head_kv, softcap):
    rng = np.random.default_rng(hash((v_trans, n_stream, n_tps, n_head, softcap)) & 0xFFFF)
    q, k, v, mask, n_kv = make_case(rng, n_stream=n_stream, n_tps=n_tps, pad=pad, n_head=n_head,
                                    n_head_kv=n_head_kv, d_k=24, d_v=16, kv_size=300, n_kv=290,
                                    dtype=dtype, v_trans=v_trans)
    scale = 1 / np.sqrt(24)
    ref, fast = run_all(q, k, v, mask, n_kv, scale, softcap, v_trans)
    want = np_attention(q, k, v, mask, n_kv, scale, softcap, v_trans)
    assert np.abs(ref - want).max() <= RTOL_REF[dtype]
    assert np.abs(fast - want).max() <= RTOL_REF[dtype]


@pytest.mark.parametrize("v_trans", [False, True], ids=["flash", "vtrans"])
@pytest.mark.parametrize("d_k,d_v", [(7, 13), (64, 32), (40, 80), (128, 128), (256, 96)])
def test_head_sizes(level, v_trans, d_k, d_v):
    """Tails of every vector width (d not a multiple of 8 / 16), d_k != d_v, big heads."""
    rng = np.random.default_rng(d_k * 1000 + d_v)
    q, k, v, mask, n_kv = make_case(rng, n_tps=2, n_head=6, n_head_kv=2, d_k=d_k, d_v=d_v,
                                    kv_size=333, dtype=np.float16, v_trans=v_trans)
    scale = 1 / np.sqrt(d_k)
    _, fast = run_all(q, k, v, mask, n_kv, scale, 0.0, v_trans)
    assert np.abs(fast - np_attention(q, k, v, mask, n_kv, scale, 0.0, v_trans)).max() <= MAX_ERR


@pytest.mark.parametrize("n_head,n_head_kv", [(12, 1), (9, 1), (16, 2), (5, 5)])
def test_large_groups(level, n_head, n_head_kv):
    """GQA groups above LX_ATTN_MAX_GROUP run in several passes (12 -> 6+6, 9 -> 5+4)."""
    rng = np.random.default_rng(n_head)
    for v_trans in (False, True):
        q, k, v, mask, n_kv = make_case(rng, n_tps=2, n_head=n_head, n_head_kv=n_head_kv, d_k=32,
                                        d_v=24, kv_size=600, dtype=np.float16, v_trans=v_trans)
        _, fast = run_all(q, k, v, mask, n_kv, 0.2, 0.0, v_trans)
        assert np.abs(fast - np_attention(q, k, v, mask, n_kv, 0.2, 0.0, v_trans)).max() <= MAX_ERR


@pytest.mark.parametrize("v_trans", [False, True], ids=["flash", "vtrans"])
def test_decode_long_cache(level, v_trans):
    """One token over many chunks (the split path), with LX_ATTN_CHUNK hidden cells in the middle
    and scattered hidden cells, n_kv < kv_size and not a multiple of the chunk (chunks are cut on
    the visible cells, so the row has fewer non-empty chunks than ceil(n_kv / LX_ATTN_CHUNK))."""
    rng = np.random.default_rng(7)
    q, k, v, mask, n_kv = make_case(rng, n_tps=1, n_head=9, n_head_kv=3, d_k=64, d_v=64,
                                    kv_size=2000, n_kv=1900, dtype=np.float16, v_trans=v_trans,
                                    p_hidden=0.1)
    mask[0, 0, A.CHUNK:2 * A.CHUNK] = -np.inf
    _, fast = run_all(q, k, v, mask, n_kv, 0.125, 0.0, v_trans)
    assert np.abs(fast - np_attention(q, k, v, mask, n_kv, 0.125, 0.0, v_trans)).max() <= MAX_ERR


@pytest.mark.parametrize("v_trans", [False, True], ids=["flash", "vtrans"])
def test_alibi_bias_and_large_scores(level, v_trans):
    """Finite mask values (an ALiBi bias) and scores of order 10 (softmax far from uniform)."""
    rng = np.random.default_rng(11)
    q, k, v, mask, n_kv = make_case(rng, n_tps=3, n_head=4, n_head_kv=1, d_k=32, d_v=32,
                                    kv_size=700, dtype=np.float32, v_trans=v_trans, alibi=True)
    q *= 3.0
    _, fast = run_all(q, k, v, mask, n_kv, 0.5, 0.0, v_trans)
    assert np.abs(fast - np_attention(q, k, v, mask, n_kv, 0.5, 0.0, v_trans)).max() <= MAX_ERR


def test_softcap_conventions_differ():
    """With softcap the two paths compute different functions, each llama.cpp's own."""
    rng = np.random.default_rng(3)
    q, k, v, mask, n_kv = make_case(rng, n_tps=2, d_k=16, d_v=16, kv_size=40)
    vt = np.ascontiguousarray(v.transpose(0, 2, 3, 1))
    a = A.attn(q, k, v, mask, n_kv=n_kv, scale=2.0, softcap=1.0)
    b = A.attn(q, k, vt, mask, n_kv=n_kv, scale=2.0, softcap=1.0, v_trans=True)
    assert np.abs(a - b).max() > 1e-2
    assert np.abs(a - np_attention(q, k, v, mask, n_kv, 2.0, 1.0, False)).max() <= MAX_ERR
    assert np.abs(b - np_attention(q, k, vt, mask, n_kv, 2.0, 1.0, True)).max() <= MAX_ERR
    # without softcap the layouts agree
    a = A.attn(q, k, v, mask, n_kv=n_kv, scale=2.0)
    b = A.attn(q, k, vt, mask, n_kv=n_kv, scale=2.0, v_trans=True)
    assert np.abs(a - b).max() <= MAX_ERR


# ---- hidden cells, empty rows -------------------------------------------------------------------

@pytest.mark.parametrize("v_trans", [False, True], ids=["flash", "vtrans"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
def test_hidden_cells_are_not_read(level, v_trans, dtype):
    """NaN in every hidden cell (and beyond n_kv) must not reach the output."""
    rng = np.random.default_rng(5)
    q, k, v, mask, n_kv = make_case(rng, n_stream=2, n_tps=2, n_head=6, n_head_kv=3, d_k=20,
                                    d_v=12, kv_size=600, n_kv=520, dtype=dtype, v_trans=v_trans)
    want = np_attention(q, k, v, mask, n_kv, 0.3, 0.0, v_trans)
    hidden = np.isneginf(mask).all(axis=1)  # [n_stream, n_kv]: hidden for every token
    for s in range(2):
        cells = np.concatenate([np.nonzero(hidden[s])[0], np.arange(n_kv, 600)])
        k[s, cells] = np.nan
        if v_trans:
            v[s, :, :, cells] = np.nan
        else:
            v[s, cells] = np.nan
    for fn in (A.attn, A.attn_ref):
        got = fn(q, k, v, mask, n_kv=n_kv, scale=0.3, v_trans=v_trans)
        assert np.isfinite(got).all()
        assert np.abs(got - want).max() <= MAX_ERR


@pytest.mark.parametrize("v_trans", [False, True], ids=["flash", "vtrans"])
def test_all_hidden_rows_give_zeros(level, v_trans):
    rng = np.random.default_rng(9)
    q, k, v, mask, n_kv = make_case(rng, n_stream=2, n_tps=3, pad=2, kv_size=300, v_trans=v_trans,
                                    hidden_rows=[(0, 1), (1, 0), (1, 2)])
    ref, fast = run_all(q, k, v, mask, n_kv, 0.25, 0.0, v_trans)
    for tok in (1, 3, 5):
        assert not fast[tok].any() and not ref[tok].any()
    assert fast[0].any() and fast[4].any()


@pytest.mark.parametrize("v_trans", [False, True], ids=["flash", "vtrans"])
def test_n_kv_zero(v_trans):
    rng = np.random.default_rng(1)
    q, k, v, mask, n_kv = make_case(rng, n_tps=2, kv_size=8, n_kv=0, v_trans=v_trans)
    out = np.full((2, 4, 16), 7.0, dtype=np.float32)
    assert A.attn(q, k, v, mask, out, n_kv=0, scale=1.0, v_trans=v_trans) is out
    assert not out.any()
    assert not A.attn_ref(q, k, v, mask, n_kv=0, scale=1.0, v_trans=v_trans).any()


def test_only_first_n_kv_cells_and_own_stream():
    """Cells >= n_kv and other streams' cells take no part."""
    rng = np.random.default_rng(4)
    q, k, v, mask, n_kv = make_case(rng, n_stream=2, n_tps=2, kv_size=50, n_kv=30, p_hidden=0.0)
    base = A.attn(q, k, v, mask, n_kv=n_kv, scale=0.5)
    k2, v2 = k.copy(), v.copy()
    k2[:, 30:] = 100.0
    v2[:, 30:] = 100.0
    assert np.array_equal(base, A.attn(q, k2, v2, mask, n_kv=n_kv, scale=0.5))
    k3, v3 = k.copy(), v.copy()
    k3[1], v3[1] = rng.uniform(-1, 1, k3[1].shape), rng.uniform(-1, 1, v3[1].shape)
    got = A.attn(q, k3, v3, mask, n_kv=n_kv, scale=0.5)
    assert np.array_equal(base[:2], got[:2]) and not np.array_equal(base[2:], got[2:])


def test_gqa_head_mapping():
    """Query head h reads kv head h // (n_head / n_head_kv)."""
    rng = np.random.default_rng(2)
    q, k, v, mask, n_kv = make_case(rng, n_tps=1, n_head=6, n_head_kv=2, kv_size=20, p_hidden=0.0)
    q[:] = 0.0  # uniform weights: out = mean of the visible V rows of the head's kv head
    out = A.attn(q, k, v, mask, n_kv=n_kv, scale=1.0)
    for h in range(6):
        assert np.allclose(out[0, h], v[0, :, h // 3].mean(axis=0), atol=1e-6)


def test_prefill_causal_threads_identical():
    """Many work items (prefill): the round-robin item split gives the same bits."""
    rng = np.random.default_rng(6)
    n_tok, n_kv = 96, 700
    q, k, v, _, _ = make_case(rng, n_tps=n_tok, n_head=6, n_head_kv=2, d_k=32, d_v=32,
                              kv_size=n_kv, dtype=np.float16)
    pos = np.arange(n_kv - n_tok, n_kv)
    mask = np.where(np.arange(n_kv)[None] <= pos[:, None], 0.0, -np.inf).astype(np.float32)[None]
    outs = [A.attn(q, k, v, mask, n_kv=n_kv, scale=0.2, n_threads=nt) for nt in (1, 2, 4)]
    assert all(np.array_equal(outs[0], o) for o in outs[1:])
    assert np.abs(outs[0] - np_attention(q, k, v, mask, n_kv, 0.2)).max() <= MAX_ERR


def test_out_argument_and_scratch_free_paths_agree():
    rng = np.random.default_rng(8)
    q, k, v, mask, n_kv = make_case(rng, n_tps=1, n_head=8, n_head_kv=2, kv_size=1500, dtype=np.float16)
    out = np.empty((1, 8, 16), dtype=np.float32)
    res = A.attn(q, k, v, mask, out, n_kv=n_kv, scale=0.25, n_threads=2)
    assert res is out
    assert np.array_equal(out, A.attn(q, k, v, mask, n_kv=n_kv, scale=0.25, n_threads=1, use_scratch=False))


# ---- argument checks ----------------------------------------------------------------------------

def _valid(v_trans=False):
    rng = np.random.default_rng(0)
    q, k, v, mask, n_kv = make_case(rng, n_stream=2, n_tps=2, n_head=4, n_head_kv=2, d_k=8, d_v=6,
                                    kv_size=10, n_kv=9, v_trans=v_trans)
    return dict(q=q, k=k, v=v, mask=mask), dict(n_kv=n_kv, scale=1.0, v_trans=v_trans)


@pytest.mark.parametrize("fn", [A.attn, A.attn_ref], ids=["fast", "ref"])
@pytest.mark.parametrize("field,bad,err", [
    ("q", np.zeros((4, 4, 7), np.float32), "head size"),            # d_k mismatch
    ("q", np.zeros((3, 4, 8), np.float32), "n_tokens"),             # not a multiple of n_stream
    ("q", np.zeros((4, 5, 8), np.float32), "n_head"),               # not a multiple of n_head_kv
    ("q", np.zeros((4, 4, 8), np.float64), "float32"),
    ("q", np.zeros((4, 4), np.float32), "3-D"),
    ("q", np.zeros((4, 8, 4), np.float32).transpose(0, 2, 1), "C-contiguous"),
    ("k", np.zeros((2, 10, 2, 8), np.int16), "float32 or float16"),
    ("k", np.zeros((2, 10, 16), np.float32), "4-D"),
    ("v", np.zeros((2, 10, 3, 6), np.float32), "v must be"),       # n_head_kv mismatch
    ("v", np.zeros((2, 11, 2, 6), np.float32), "v must be"),       # kv_size mismatch
    ("v", np.zeros((2, 10, 2, 513), np.float32), "d_v"),
    ("mask", np.zeros((2, 2, 10), np.float32), "mask must be"),    # n_kv columns
    ("mask", np.zeros((2, 1, 9), np.float32), "mask must be"),     # fewer rows than n_tps
    ("mask", np.zeros((1, 2, 9), np.float32), "mask must be"),     # n_stream
    ("mask", np.zeros((2, 2, 9), np.float16), "float32"),
])
def test_shape_errors(fn, field, bad, err):
    arrays, kw = _valid()
    arrays[field] = bad
    with pytest.raises(ValueError, match=err):
        fn(arrays["q"], arrays["k"], arrays["v"], arrays["mask"], **kw)


def test_vtrans_shape_error():
    arrays, kw = _valid(v_trans=True)
    A.attn(**arrays, **kw)
    with pytest.raises(ValueError, match="transposed"):
        A.attn(arrays["q"], arrays["k"], np.zeros((2, 10, 2, 6), np.float32), arrays["mask"], **kw)


def test_argument_errors():
    arrays, kw = _valid()
    with pytest.raises(ValueError, match="n_kv"):
        A.attn(**arrays, **{**kw, "n_kv": 11})
    with pytest.raises(ValueError, match="n_kv"):
        A.attn(**arrays, **{**kw, "n_kv": -1})
    with pytest.raises(TypeError, match="n_kv"):
        A.attn(**arrays, **{**kw, "n_kv": 9.0})
    with pytest.raises(ValueError, match="softcap"):
        A.attn(**arrays, **kw, softcap=-1.0)
    with pytest.raises(ValueError, match="scale"):
        A.attn(**arrays, **{**kw, "scale": float("nan")})
    with pytest.raises(ValueError, match="n_threads"):
        A.attn(**arrays, **kw, n_threads=0)
    with pytest.raises(ValueError, match="n_threads"):
        A.attn_ref(**arrays, **kw, n_threads=0)
    with pytest.raises(TypeError, match="numpy array"):
        A.attn(arrays["q"].tolist(), arrays["k"], arrays["v"], arrays["mask"], **kw)
    with pytest.raises(ValueError, match="out must be"):
        A.attn(**arrays, out=np.zeros((4, 4, 5), np.float32), **kw)
    with pytest.raises(ValueError, match="overlap"):
        A.attn(**arrays, out=arrays["k"].reshape(-1)[:96].reshape(4, 4, 6), **kw)


# ---- quantized K / V cache (q8_0, q4_0) -----------------------------------------------------------
#
# Layout: a quantized k (or v) is uint8 [n_stream, kv_size, row_bytes] holding each cell's
# n_head_kv * d values as one row of ggml blocks (llama.cpp's cache rows). Oracles:
#   - the C references (attn_ref): the same arithmetic in scalar code (q quantized to q8_0 with
#     ggml's reference rounding, integer block dots, V values q * d): fast within MAX_ERR;
#   - np_attention_q8: numpy in float64 with ggml's definition of the scores for a quantized K,
#     s = sum_b sumi_b * d_k,b * d_q,b with q quantized by quants.quantize("q8_0"): MAX_ERR too;
#   - float attention over the dequantized cache: differs only by q's quantization (quantized K),
#     bounded by (exp(2E) - 1) * max|v| with E the largest score error that rounding q can cause.

from llamax._native import quants as Q  # noqa: E402

QTYPES = ["f32", "f16", "q8_0", "q4_0"]
LEVELS_Q = cpu.levels()


@pytest.fixture(params=LEVELS_Q, ids=lambda lv: cpu.LEVEL_NAMES[lv])
def qlevel(request):
    cpu.set_simd_level(request.param)
    yield request.param
    cpu.set_simd_level(-1)


def encode(t, x):
    """float32 [n_stream, kv_size, n_head_kv, d] -> the cache tensor of type t."""
    if t == "f32":
        return x.astype(np.float32)
    if t == "f16":
        return x.astype(np.float16)
    return Q.quantize(t, np.ascontiguousarray(x.reshape(x.shape[0], x.shape[1], -1)))


def decode(t, c, shape):
    """The cache tensor of type t -> its float32 values [n_stream, kv_size, n_head_kv, d]."""
    if t in ("f32", "f16"):
        return c.astype(np.float32)
    return Q.dequantize(t, c, (shape[0], shape[1], shape[2] * shape[3])).reshape(shape)


def make_qcase(rng, *, n_stream=1, n_tps=2, pad=1, n_head=6, n_head_kv=2, d_k=64, d_v=64, kv_size=300,
               n_kv=None, p_hidden=0.25):
    n_kv = kv_size if n_kv is None else n_kv
    q = rng.uniform(-1, 1, (n_stream * n_tps, n_head, d_k)).astype(np.float32)
    k = rng.uniform(-1, 1, (n_stream, kv_size, n_head_kv, d_k)).astype(np.float32)
    v = rng.uniform(-1, 1, (n_stream, kv_size, n_head_kv, d_v)).astype(np.float32)
    k[:, :, :, 3] *= 8.0                            # an outlier channel, as real K caches have
    mask = np.zeros((n_stream, n_tps + pad, n_kv), np.float32)
    mask[rng.random(mask.shape) < p_hidden] = -np.inf
    mask[:, n_tps:, :] = -np.inf
    return q, k, v, mask, n_kv


def run_all_q(q, k, v, mask, n_kv, scale, softcap, tk, tv, v_trans=False):
    """ref, and fast for n_threads 1/2/3 with and without scratch (bit-identical to each other)."""
    kw = dict(n_kv=n_kv, scale=scale, softcap=softcap, v_trans=v_trans, type_k=tk, type_v=tv)
    ref = A.attn_ref(q, k, v, mask, **kw)
    fast = A.attn(q, k, v, mask, n_threads=1, **kw)
    for nt in (2, 3):
        for use_scratch in (True, False):
            other = A.attn(q, k, v, mask, n_threads=nt, use_scratch=use_scratch, **kw)
            assert np.array_equal(fast, other), (nt, use_scratch)
    return ref, fast


def np_attention_q8(q, k_deq, v_deq, mask, n_kv, scale, softcap=0.0):
    """float64 attention whose scores are ggml's q8_0 dots of q with the dequantized K blocks:
    q.k = sum_b d_q,b * (qs_b . k_b), q quantized by quants.quantize('q8_0')."""
    n_tok, n_head, d = q.shape
    qq = Q.quantize("q8_0", q).reshape(n_tok, n_head, d // 32, 34)
    dq = qq[..., :2].copy().view(np.float16)[..., 0].astype(np.float64)          # [T, H, nb]
    qs = qq[..., 2:].copy().view(np.int8).astype(np.float64)                      # [T, H, nb, 32]
    q_eff = (qs * dq[..., None]).reshape(n_tok, n_head, d)                       # d_q * qs, exact
    return np_attention(q_eff.astype(np.float64), k_deq, v_deq, mask, n_kv, scale, softcap)


@pytest.mark.parametrize("tk", QTYPES)
@pytest.mark.parametrize("tv", QTYPES)
def test_quantized_mix_vs_ref_and_numpy(qlevel, tk, tv):
    """Every K / V type mix: fast vs the C oracle (MAX_ERR), threads bit-identical, and the oracle
    vs numpy with ggml's scores."""
    rng = np.random.default_rng(QTYPES.index(tk) * 4 + QTYPES.index(tv))
    q, kf, vf, mask, n_kv = make_qcase(rng, n_stream=2, n_tps=3, n_head=6, n_head_kv=2, d_k=64, d_v=96,
                                       kv_size=600, n_kv=560)
    k, v = encode(tk, kf), encode(tv, vf)
    ref, fast = run_all_q(q, k, v, mask, n_kv, 0.125, 0.0, tk, tv)
    vmax = max(1.0, float(np.abs(vf).max()))
    assert np.abs(fast - ref).max() <= MAX_ERR * vmax
    kd, vd = decode(tk, k, kf.shape), decode(tv, v, vf.shape)
    want = np_attention_q8(q, kd, vd, mask, n_kv, 0.125) if tk in ("q8_0", "q4_0") else \
        np_attention(q, kd, vd, mask, n_kv, 0.125)
    assert np.abs(ref - want).max() <= MAX_ERR * vmax
    assert np.abs(fast - want).max() <= MAX_ERR * vmax


@pytest.mark.parametrize("tk", ["q8_0", "q4_0"])
@pytest.mark.parametrize("d_k,n_head,n_head_kv", [(32, 4, 4), (128, 8, 2), (96, 9, 3), (160, 12, 1)])
def test_quantized_k_head_sizes_and_groups(qlevel, tk, d_k, n_head, n_head_kv):
    """Odd block counts per head (96, 160: a lone block after the pairs), GQA up to 12 (two passes)."""
    rng = np.random.default_rng(d_k + n_head)
    q, kf, vf, mask, n_kv = make_qcase(rng, n_tps=2, n_head=n_head, n_head_kv=n_head_kv, d_k=d_k, d_v=32,
                                       kv_size=300)
    k = encode(tk, kf)
    ref, fast = run_all_q(q, k, vf, mask, n_kv, 1 / np.sqrt(d_k), 0.0, tk, "f32")
    assert np.abs(fast - ref).max() <= MAX_ERR
    want = np_attention_q8(q, decode(tk, k, kf.shape), vf, mask, n_kv, 1 / np.sqrt(d_k))
    assert np.abs(ref - want).max() <= MAX_ERR


def test_quantized_vs_float_attention_on_the_dequantized_cache():
    """Quantized V: the same function as float attention over the dequantized V (MAX_ERR).
    Quantized K: scores use q rounded to q8_0, so the result moves by at most (exp(2E) - 1) *
    max|v|, E = scale * max over cells of sum_b err_b * sum_{i in b} |k_i| with err_b the
    largest rounding of q in block b (d/2 + 127 |d - f16(d)|, the q8_0 round-trip bound)."""
    rng = np.random.default_rng(21)
    q, kf, vf, mask, n_kv = make_qcase(rng, n_tps=4, n_head=8, n_head_kv=2, d_k=128, d_v=64, kv_size=500)
    scale = 1 / np.sqrt(128)
    for tv in ("q8_0", "q4_0"):
        v = encode(tv, vf)
        got = A.attn(q, kf, v, mask, n_kv=n_kv, scale=scale, type_v=tv)
        want = A.attn(q, kf, decode(tv, v, vf.shape), mask, n_kv=n_kv, scale=scale)
        assert np.abs(got - want).max() <= MAX_ERR
    qb = q.reshape(q.shape[0], q.shape[1], -1, 32).astype(np.float64)
    d = (np.abs(qb).max(axis=-1) / 127).astype(np.float32).astype(np.float64)
    err_b = d / 2 + 127 * np.abs(d - d.astype(np.float16))                 # [T, H, nb]
    for tk in ("q8_0", "q4_0"):
        k = encode(tk, kf)
        kd = decode(tk, k, kf.shape)
        got = A.attn(q, k, vf, mask, n_kv=n_kv, scale=scale, type_k=tk)
        want = A.attn(q, kd, vf, mask, n_kv=n_kv, scale=scale)
        ksum = np.abs(kd[0]).reshape(kd.shape[1], kd.shape[2], -1, 32).sum(axis=-1)  # [N, Hkv, nb]
        g = q.shape[1] // kf.shape[2]
        E = scale * max(float((err_b[t, h] * ksum[:, h // g]).sum(axis=-1).max())
                        for t in range(q.shape[0]) for h in range(q.shape[1]))
        diff = np.abs(got - want).max()
        assert diff <= (np.exp(2 * E) - 1) * float(np.abs(vf).max()) + MAX_ERR
        assert diff > 0                                    # q really was quantized
    # and the whole pipeline stays close to exact float attention
    exact = np_attention(q, kf, vf, mask, n_kv, scale)
    got = A.attn(q, encode("q8_0", kf), encode("q8_0", vf), mask, n_kv=n_kv, scale=scale,
                 type_k="q8_0", type_v="q8_0")
    assert np.abs(got - exact).max() < 0.02


@pytest.mark.parametrize("tk", ["q8_0", "q4_0"])
def test_quantized_k_with_vtrans_and_softcap(qlevel, tk):
    """Quantized K works on the v_trans path (V f16, transposed), softcap both conventions."""
    rng = np.random.default_rng(31)
    q, kf, vf, mask, n_kv = make_qcase(rng, n_stream=2, n_tps=2, n_head=6, n_head_kv=3, kv_size=400)
    k = encode(tk, kf)
    vt = np.ascontiguousarray(vf.astype(np.float16).transpose(0, 2, 3, 1))
    for v_trans, v, tv in ((True, vt, "f16"), (False, encode("q8_0", vf), "q8_0")):
        ref, fast = run_all_q(q, k, v, mask, n_kv, 0.3, 2.0, tk, tv, v_trans=v_trans)
        assert np.abs(fast - ref).max() <= MAX_ERR
        want = np_attention_q8(q, decode(tk, k, kf.shape), vf.astype(np.float16).astype(np.float32) if v_trans
                               else decode("q8_0", v, vf.shape), mask, n_kv, 0.3, 0.0)
        assert want.shape == fast.shape


@pytest.mark.parametrize("tk,tv", [("q8_0", "q8_0"), ("q4_0", "q4_0"), ("f16", "q4_0"), ("q8_0", "f32")])
def test_quantized_decode_long_cache(qlevel, tk, tv):
    """One token over many chunks (the split path), a hidden chunk, SmolLM2's shape (9/3/64)."""
    rng = np.random.default_rng(41)
    q, kf, vf, mask, n_kv = make_qcase(rng, n_tps=1, pad=0, n_head=9, n_head_kv=3, kv_size=2100, n_kv=2000,
                                       p_hidden=0.1)
    mask[0, 0, A.CHUNK:2 * A.CHUNK] = -np.inf
    k, v = encode(tk, kf), encode(tv, vf)
    ref, fast = run_all_q(q, k, v, mask, n_kv, 0.125, 0.0, tk, tv)
    assert np.abs(fast - ref).max() <= MAX_ERR


def _poison_rows(t, c, s, cells):
    """Make the rows of `cells` of stream s non-finite: NaN values, or NaN block scales."""
    if t in ("f32", "f16"):
        c[s, cells] = np.nan
    else:
        rows = c[s, cells].reshape(len(cells), -1, Q.block_bytes(t))
        rows[:, :, 0:2] = np.frombuffer(np.float16(np.nan).tobytes(), np.uint8)
        c[s, cells] = rows.reshape(len(cells), -1)


@pytest.mark.parametrize("tk,tv", [("q8_0", "q4_0"), ("q4_0", "q8_0"), ("f16", "q8_0"), ("q8_0", "f16")])
def test_quantized_hidden_cells_are_not_read(qlevel, tk, tv):
    """NaN scales in every hidden cell's blocks (and beyond n_kv) must not reach the output."""
    rng = np.random.default_rng(51)
    q, kf, vf, mask, n_kv = make_qcase(rng, n_stream=2, n_tps=2, n_head=6, n_head_kv=3, d_k=32, d_v=64,
                                       kv_size=600, n_kv=520)
    k, v = encode(tk, kf), encode(tv, vf)
    clean = A.attn_ref(q, k, v, mask, n_kv=n_kv, scale=0.3, type_k=tk, type_v=tv)
    hidden = np.isneginf(mask).all(axis=1)
    for s in range(2):
        cells = np.concatenate([np.nonzero(hidden[s])[0], np.arange(n_kv, 600)])
        _poison_rows(tk, k, s, cells)
        _poison_rows(tv, v, s, cells)
    for fn in (A.attn, A.attn_ref):
        got = fn(q, k, v, mask, n_kv=n_kv, scale=0.3, type_k=tk, type_v=tv)
        assert np.isfinite(got).all()
        assert np.abs(got - clean).max() <= MAX_ERR


def test_quantized_v_needs_flash_attention():
    rng = np.random.default_rng(61)
    q, kf, vf, mask, n_kv = make_qcase(rng, kv_size=64)
    v = encode("q8_0", vf)
    for fn in (A.attn, A.attn_ref):
        with pytest.raises(ValueError, match="flash attention"):
            fn(q, kf, v, mask, n_kv=n_kv, scale=1.0, v_trans=True, type_v="q8_0")


def test_type_names_and_numbers_and_plain_types():
    """type_k / type_v by name or ggml number; "f32" / "f16" with float arrays run the float path."""
    rng = np.random.default_rng(71)
    q, kf, vf, mask, n_kv = make_qcase(rng, kv_size=64)
    k16 = kf.astype(np.float16)
    base = A.attn(q, k16, vf, mask, n_kv=n_kv, scale=0.5)
    assert np.array_equal(base, A.attn(q, k16, vf, mask, n_kv=n_kv, scale=0.5, type_k="f16", type_v="f32"))
    k8 = encode("q8_0", kf)
    a = A.attn(q, k8, vf, mask, n_kv=n_kv, scale=0.5, type_k="q8_0")
    assert np.array_equal(a, A.attn(q, k8, vf, mask, n_kv=n_kv, scale=0.5, type_k=Q.TYPE_Q8_0))
    assert np.array_equal(a, A.attn(q, k8, vf, mask, n_kv=n_kv, scale=0.5, type_k="Q8_0", type_v="f32"))


def _qvalid():
    rng = np.random.default_rng(0)
    q, kf, vf, mask, n_kv = make_qcase(rng, n_tps=2, pad=0, n_head=4, n_head_kv=2, d_k=64, d_v=32, kv_size=10)
    return dict(q=q, k=encode("q8_0", kf), v=encode("q4_0", vf), mask=mask), \
        dict(n_kv=n_kv, scale=1.0, type_k="q8_0", type_v="q4_0")


@pytest.mark.parametrize("fn", [A.attn, A.attn_ref], ids=["fast", "ref"])
@pytest.mark.parametrize("field,bad,kw,err", [
    ("q", np.zeros((2, 4, 48), np.float32), {}, "multiple of 32"),                 # d_k % 32
    ("q", np.zeros((2, 4, 96), np.float32), {}, "multiple of the head size"),      # 136 values / 96
    ("q", np.zeros((2, 3, 64), np.float32), {}, "n_head"),                          # 3 % n_head_kv 2
    ("k", np.zeros((1, 10, 2, 64), np.uint8), {}, "3-D uint8"),
    ("k", np.zeros((1, 10, 135), np.uint8), {}, "whole blocks of 34"),
    ("k", np.zeros((1, 10, 136), np.float32), {}, "must be uint8"),
    ("k", np.zeros((1, 10, 2, 64), np.float16), {"type_k": "q4_1"}, "f32, f16, q8_0 or q4_0"),
    ("k", np.zeros((1, 10, 2, 64), np.float32), {"type_k": "f16"}, "must be float16"),
    ("k", np.zeros((1, 10, 2, 64), np.uint8), {"type_k": None}, "float32 or float16"),
    ("v", np.zeros((1, 10, 54), np.uint8), {}, "not n_head_kv = 2 heads"),         # 96 values: 48 per head
    ("v", np.zeros((1, 11, 36), np.uint8), {}, "kv_size=10"),
    ("v", np.zeros((1, 10, 37), np.uint8), {}, "whole blocks of 18"),
])
def test_quantized_shape_errors(fn, field, bad, kw, err):
    arrays, base = _qvalid()
    arrays[field] = bad
    with pytest.raises(ValueError, match=err):
        fn(arrays["q"], arrays["k"], arrays["v"], arrays["mask"], **{**base, **kw})


# ---- a chunk's logits (the step before the softmax) ---------------------------------------------

@pytest.mark.parametrize("n", [1, 7, 8, 9, 64, 100, 255, A.CHUNK])
def test_logits_kernel_same_bits_as_scalar_twin(level, n):
    """Every level's logits kernel gives its scalar twin's bits, values and maximum: hidden cells
    (-inf), ties, the sign of a zero maximum (only a greater value replaces a lane's), a NaN score."""
    rng = np.random.default_rng(n)
    cases = []
    s = rng.standard_normal(n).astype(np.float32) * 8
    mv = np.where(rng.random(n) < 0.3, -np.inf, 0.0).astype(np.float32)
    mv[0] = 0.0
    cases.append((s, mv, 0.125))
    z = np.where(rng.random(n) < 0.5, -0.0, 0.0).astype(np.float32)       # zero maxima of both signs
    low = -rng.random(n).astype(np.float32)
    cases.append((np.where(rng.random(n) < 0.7, z, low), np.full(n, -0.0, np.float32), 1.0))
    cases.append((np.full(n, 3.0, np.float32), np.full(n, -np.inf, np.float32), 0.5))   # all hidden
    alibi = -np.abs(np.arange(n, dtype=np.float32) - n / 2)                              # ties of the max
    cases.append((np.zeros(n, np.float32), alibi, 1.0))
    nan = s.copy()
    nan[n // 2] = np.nan
    cases.append((nan, mv, 0.125))
    for scores, masks, scale in cases:
        want, m_want = A.logits_ref(scores, masks, scale)
        got, m_got = A.logits(scores, masks, scale)
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
        assert np.float32(m_got).view(np.uint32) == np.float32(m_want).view(np.uint32)
        with np.errstate(invalid="ignore"):
            ref = scores * np.float32(scale) + masks
        np.testing.assert_array_equal(want, ref)
        if not np.isnan(ref).any():
            assert m_want == ref.max()


def test_logits_bad_input():
    with pytest.raises(ValueError):
        A.logits(np.zeros(0, np.float32), np.zeros(0, np.float32), 1.0)
    with pytest.raises(ValueError):
        A.logits(np.zeros(A.CHUNK + 1, np.float32), np.zeros(A.CHUNK + 1, np.float32), 1.0)
    with pytest.raises(ValueError):
        A.logits(np.zeros(4, np.float32), np.zeros(5, np.float32), 1.0)
