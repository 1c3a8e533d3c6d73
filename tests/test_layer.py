"""The native layer step (issue 10, item 2; csrc/layer.h): one C call per layer runs norms,
projections, RoPE, the K/V stores into the cells the memory chose, attention, the FFN and the
residuals. Its reference is the model's forward composed in Python (forward_reference: the
memory's store / attend and numpy steps over the same products): the two give the same bits, for
every cache layout the memory has, and leave the same K/V in the cache."""
import os

import numpy as np
import pytest

from llamax import Batch, Context
from llamax._native import cpu
from llamax._native import layer as _layer
from llamax._native.layer import Stack
from llamax.memory import LayerView

# every fast path against its scalar reference, at each SIMD level of this CPU
pytestmark = pytest.mark.usefixtures("every_simd_level")

TEXT = "The capital of France is Paris, and the capital of Germany is Berlin. Water boils at"

CONFIGS = [
    dict(flash_attn=True),                                    # f16 K/V rows
    dict(flash_attn=False),                                   # V stored transposed
    dict(flash_attn=True, type_k="q8_0", type_v="q8_0"),      # quantized rows, Hadamard-rotated
    dict(flash_attn=True, type_k="q4_0", type_v="f16"),
    dict(flash_attn=True, type_k="f32", type_v="f32"),
    dict(flash_attn=False, n_seq_max=2, kv_unified=False),    # two streams in one ubatch
]


def _run(model, fwd, toks, chunk=5, last_only=False, **params):
    """Prompt (chunks of `chunk` with logits for all, or for each chunk's last token when last_only,
    then sequence 1 beside 0 when there are two) and 4 greedy steps through model.<fwd>, driving the
    memory by its Plan; the logits and the cache."""
    ctx = Context(model, n_ctx=512, n_threads=2, **params)
    mem, f = ctx.memory, getattr(model, fwd)
    n_seq = params.get("n_seq_max", 1)
    out = []
    for i in range(0, len(toks), chunk):
        ch = toks[i:i + chunk]
        b = Batch(ch * n_seq, pos=list(range(i, i + len(ch))) * n_seq,
                  seq_ids=[s for s in range(n_seq) for _ in ch],
                  logits=([False] * (len(ch) - 1) + [True] if last_only else [True] * len(ch)) * n_seq)
        for ub in mem.plan(b, n_ubatch=max(64, chunk)):
            out.append(f(mem, ub))
    t, pos = int(np.argmax(out[-1][-1])), len(toks)
    for _ in range(4):
        for ub in mem.plan(Batch([t], pos=[pos])):
            out.append(f(mem, ub))
        t, pos = int(np.argmax(out[-1][-1])), pos + 1
    caches = [mem] if not hasattr(mem, "base") else [mem.base, mem.swa]
    kv = [np.concatenate([a.reshape(-1).view(np.uint8) for a in c.k + c.v]) for c in caches]
    return np.concatenate(out), np.concatenate(kv)


@pytest.mark.parametrize("params", CONFIGS, ids=lambda p: "-".join(f"{k}={v}" for k, v in p.items()))
def test_native_step_is_the_python_composition_bit_for_bit(model, params):
    toks = model.tokenize(TEXT)
    logits, kv = _run(model, "forward", toks, **params)
    ref_logits, ref_kv = _run(model, "forward_reference", toks, **params)
    np.testing.assert_array_equal(logits, ref_logits)
    np.testing.assert_array_equal(kv, ref_kv)


@pytest.mark.parametrize("params", [dict(flash_attn=True), dict(flash_attn=False, type_k="q8_0")],
                         ids=["flash", "vtrans-q8_0"])
def test_gemma_native_step_is_the_python_composition(gemma, params):
    """Gemma 3: Q/K norms, NEOX RoPE with two bases, the q scale, post norms, the GELU table, the
    sliding-window and global caches of the iSWA memory; only the rows with logits after the last
    layer's attention."""
    toks = gemma.tokenize(TEXT)
    logits, kv = _run(gemma, "forward", toks, **params)
    ref_logits, ref_kv = _run(gemma, "forward_reference", toks, **params)
    np.testing.assert_array_equal(logits, ref_logits)
    np.testing.assert_array_equal(kv, ref_kv)


@pytest.mark.parametrize("which", ["smollm2", "gemma"])
def test_prompt_rows_over_threads_are_the_python_composition(model, gemma, which):
    """A prompt's ubatch of 64 rows: the row steps that only move memory (the q / k / v split of the
    fused product, the residual sums, Gemma 3's q scale) run over the threads from 64 rows (layer.c
    LX_ROWS_PARALLEL): the same cache bytes and logits as the composition."""
    m = model if which == "smollm2" else gemma
    toks = (m.tokenize(TEXT) * 8)[:64]
    logits, kv = _run(m, "forward", toks, chunk=64, last_only=True)
    ref_logits, ref_kv = _run(m, "forward_reference", toks, chunk=64, last_only=True)
    np.testing.assert_array_equal(logits, ref_logits)
    np.testing.assert_array_equal(kv, ref_kv)


def test_only_the_rows_with_logits_go_past_the_last_attention(model):
    """A ubatch asking for its last token's logits gets exactly that row, the same bits as when
    every row asks."""
    toks = model.tokenize(TEXT)
    rows = []
    for logits in ([False] * (len(toks) - 1) + [True], [True] * len(toks)):
        ctx = Context(model, n_ctx=512, n_threads=2)
        ctx.decode(Batch(toks, logits=logits))
        rows.append(ctx.get_logits_ith(-1).copy())
    np.testing.assert_array_equal(rows[0], rows[1])


def _team_decode(model, team):
    """A 300-token prompt, 3 single-token steps over more than one chunk of cells (the attention's
    split path) and an 8-token batch, with lx_layers_forward's team path allowed or not: the logits
    of every step, the cache bytes, and whether a stack call ran as a team."""
    rng = np.random.default_rng(7)
    prompt, steps = rng.integers(0, model.n_vocab, 300).tolist(), rng.integers(0, model.n_vocab, 11).tolist()
    runs = _layer._team_runs()
    _layer._set_team(team)
    try:
        ctx = Context(model, n_ctx=1024, n_threads=2)
        ctx.decode(Batch(prompt))
        out = [ctx.get_logits_ith(-1).copy()]
        for t in steps[:3]:
            ctx.decode(Batch([t]))
            out.append(ctx.get_logits_ith(-1).copy())
        ctx.decode(Batch(steps[3:], logits=[True] * 8))
        out += [ctx.get_logits_ith(i).copy() for i in range(8)]
    finally:
        _layer._set_team(True)
    mem = ctx.memory
    caches = [mem] if not hasattr(mem, "base") else [mem.base, mem.swa]
    kv = np.concatenate([a.reshape(-1).view(np.uint8) for c in caches for a in c.k + c.v])
    return np.array(out), kv, _layer._team_runs() > runs


@pytest.mark.parametrize("which", ["model", "gemma"])
def test_a_decode_step_as_one_team_is_the_region_per_product_bit_for_bit(which, request, every_simd_level):
    """With two cores and the few-token products of AVX2 and up, a decode step's layers run in one
    OpenMP region whose threads share each product's tiles and attention's chunks between spin
    barriers (csrc/team.h); the logits and the cache are those of a region per product."""
    model = request.getfixturevalue(which)
    logits, kv, ran = _team_decode(model, True)
    ref_logits, ref_kv, ran_ref = _team_decode(model, False)
    np.testing.assert_array_equal(logits, ref_logits)
    np.testing.assert_array_equal(kv, ref_kv)
    assert not ran_ref
    assert ran == (every_simd_level >= cpu.AVX2 and len(os.sched_getaffinity(0)) >= 2)


def _view_of(model, **change):
    ctx = Context(model, n_ctx=256, n_threads=1)
    mem = ctx.memory
    ub = mem.plan(Batch(model.tokenize("Hello there"))).apply(0)
    views = [mem.layer_view(il, ub) for il in range(model.hparams.n_layer)]
    if change:
        views[3] = views[3]._replace(**change)
    return mem, ub, views


@pytest.mark.parametrize("change,msg", [
    (dict(idxs=np.zeros(1, np.uint32)), "idxs"),
    (dict(mask=np.zeros((1, 4, 256), np.float64)), "mask"),
    (dict(k=np.zeros((1, 256, 100), np.float16)), "LayerView.k"),
    (dict(type_v=8), "LayerView.v"),
])
def test_a_view_that_does_not_fit_is_refused_before_any_layer_runs(model, change, msg):
    mem, ub, views = _view_of(model, **change)
    before = [a.copy() for a in mem.k + mem.v]
    x = model.tok_embd.rows(ub.token)
    with pytest.raises(ValueError, match=msg):
        model.stack.forward(x, ub.pos, views, n_threads=1)
    for a, b in zip(before, mem.k + mem.v):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("il", [0, 5])
@pytest.mark.parametrize("n_threads", [1, 2])
def test_a_cell_outside_the_cache_is_refused_by_the_layer(model, il, n_threads):
    """Every layer is checked before the first runs: the refusal names the layer, and neither the
    cache nor the hidden states have changed."""
    mem, ub, views = _view_of(model)
    bad = views[il].idxs.copy()
    bad[0] = 1 << 20
    views[il] = views[il]._replace(idxs=bad)
    before = [a.copy() for a in mem.k + mem.v]
    x = model.tok_embd.rows(ub.token)
    x0 = x.copy()
    with pytest.raises(ValueError, match=f"layer {il}"):
        model.stack.forward(x, ub.pos, views, n_threads=n_threads)
    np.testing.assert_array_equal(x, x0)
    for a, b in zip(before, mem.k + mem.v):
        np.testing.assert_array_equal(a, b)


def test_stack_checks_its_weights(model):
    L = model.layers[0]
    hp = model.hparams
    good = dict(n_embd=hp.n_embd, n_head=hp.n_head, n_head_kv=hp.n_head_kv, d_k=hp.n_embd_head_k,
                d_v=hp.n_embd_head_v, n_ff=hp.n_ff, eps=hp.rms_eps, rope=(hp.n_rot, 1e4, 1.0, 0), q_scale=1.0,
                kq_scale=0.125, softcap=0.0, act="silu", attn_norm=L.attn_norm, ffn_norm=L.ffn_norm,
                wqkv=L.wqkv.parts, wo=L.wo.parts, w_gate_up=L.w_gate_up.parts, w_down=L.w_down.parts)
    assert Stack([good]).n_layer == 1
    for bad, msg in ((dict(wo=L.wqkv.parts), "wo"), (dict(act="relu"), "activation"),
                     (dict(act="gelu_table"), "table"), (dict(attn_norm=L.attn_norm[:10]), "attn_norm"),
                     (dict(rope=(hp.n_rot, 1e4, 1.0, 1)), "RoPE kind"),
                     (dict(w_down=[(L.w_down.parts[0][0], 16)]), "no native product"),
                     (dict(w_down=[(L.w_down.parts[0][0], 8)]), "rows of")):
        with pytest.raises(ValueError, match=msg):
            Stack([{**good, **bad}])


def _ulps(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64))


def test_rms_norm_is_ggmls():
    """float squares summed in double, the mean rounded to float, 1 / sqrtf(mean + eps), (x * s) * w:
    against that in numpy (a pairwise double sum instead of a sequential one: at most 1 ulp)."""
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((64, 576)) * rng.uniform(0.01, 30, (64, 1))).astype(np.float32)
    w = rng.standard_normal(576).astype(np.float32)
    mean = (np.square(x).sum(axis=-1, dtype=np.float64) / 576).astype(np.float32)
    ref = (x * (np.float32(1) / np.sqrt(mean + np.float32(1e-5)))[:, None]) * w
    got = _layer.rms_norm(x, w, 1e-5)
    assert _ulps(got, ref).max() <= 1
    np.testing.assert_array_equal(_layer.rms_norm(x, w, 1e-5, n_threads=2), got)
    np.testing.assert_array_equal(_layer.rms_norm(x[:1], w, 1e-5), got[:1])   # per row


def _order_sensitive_rows(n_rows):
    """Rows of 64 whose norm scale depends on the summation order: after 9.9145^2 + (2^-9)^2 each of
    the 62 squares (2^-26)^2 is below half an ulp of the double sum and drops, while summed apart
    they tip the float mean, and 1 / sqrtf of it, by one ulp (found by search)."""
    x = np.full((n_rows, 64), 2.0 ** -26, np.float32)
    x[:, 0], x[:, 1] = np.float32(9.9145), 2.0 ** -9
    return x


@pytest.mark.parametrize("n_rows", [1, 2, 3, 4, 8, 9, 17, 64])
@pytest.mark.parametrize("n", [64, 256, 576, 100, 7])
def test_rms_norm_lanes_are_the_scalar_order(n_rows, n):
    """The rows in lanes (8 at a time) give the bits of the scalar reference, row by row: random rows of
    any width and count, and rows built so that another summation order moves the result."""
    rng = np.random.default_rng(n_rows * 1000 + n)
    x = (rng.standard_normal((n_rows, n)) * rng.uniform(0.01, 30, (n_rows, 1))).astype(np.float32)
    w = rng.standard_normal(n).astype(np.float32)
    want = _layer.rms_norm(x, w, 1e-6, ref=True)
    np.testing.assert_array_equal(_layer.rms_norm(x, w, 1e-6), want)
    np.testing.assert_array_equal(_layer.rms_norm(x, w, 1e-6, n_threads=2), want)
    if n == 64:
        xt, one = _order_sensitive_rows(n_rows), np.ones(64, np.float32)
        got = _layer.rms_norm(xt, one, 0.0)
        np.testing.assert_array_equal(got, _layer.rms_norm(xt, one, 0.0, ref=True))
        sq = np.square(xt[0]).astype(np.float64)
        for order, same in ((sq, True), (np.concatenate([sq[2:], sq[:2]]), False)):   # in order; tiny ones first
            s = 0.0
            for v in order:
                s += v
            scale = np.float32(1) / np.sqrt(np.float32(s / 64))
            assert np.array_equal(got[0], xt[0] * scale) == same


def test_gated_activations():
    rng = np.random.default_rng(2)
    n_ff = 1536
    gu = (rng.standard_normal((16, 2 * n_ff)) * 6).astype(np.float32)
    g, u = gu[:, :n_ff].astype(np.float64), gu[:, n_ff:].astype(np.float64)
    gu[0, :12] = [0.0, -0.0, 86.9, 87.5, -87.5, -88.5, -100.0, 100.0, 1e-40, -1e-40, 1e30, -3e38]
    g = gu[:, :n_ff].astype(np.float64)
    silu = _layer.gated(gu, n_ff, "silu")
    with np.errstate(over="ignore"):
        want = g / (1 + np.exp(-g)) * u
    np.testing.assert_allclose(silu[:, 12:], want[:, 12:], rtol=1e-6, atol=1e-30)
    np.testing.assert_allclose(silu[0, :12], want[0, :12], rtol=1e-6, atol=1e-35)   # beyond -88: -0
    for n_threads in (1, 2):   # the SIMD lanes and the scalar reference: the same bits, any n_ff
        for f in (n_ff, 13):
            x = np.ascontiguousarray(np.concatenate([gu[:, :f], gu[:, n_ff:n_ff + f]], axis=1))
            np.testing.assert_array_equal(_layer.gated(x, f, "silu", n_threads=n_threads),
                                          _layer.gated(x, f, "silu", ref=True))
    from llamax.model.decoder import gelu_table
    t = gelu_table()
    gelu = _layer.gated(gu, n_ff, "gelu_table", t)
    for n_threads in (1, 2):   # the gathered lanes and the scalar reference: the same bits
        np.testing.assert_array_equal(_layer.gated(gu, n_ff, "gelu_table", t, n_threads=n_threads),
                                      _layer.gated(gu, n_ff, "gelu_table", t, ref=True))
    g32 = gu[:, :n_ff]
    with np.errstate(over="ignore"):   # the extreme gates of row 0 (the table is not read there)
        a = np.where(g32 >= 10, g32, np.where(g32 <= -10, 0, t[g32.astype(np.float16).view(np.uint16)]))
    np.testing.assert_array_equal(gelu, (a * gu[:, n_ff:]).astype(np.float32))
    with pytest.raises(ValueError, match="table"):
        _layer.gated(gu, n_ff, "gelu_table")
    with pytest.raises(ValueError, match="gu must be"):
        _layer.gated(gu, n_ff + 1)


def test_the_embedding_is_kept_block_interleaved(model):
    """The Q8_0 embedding / tied output lives in the GEMM's r8 layout (one contiguous stream per 8
    rows for the decode step's logits): its rows and its logits are those of the GGUF's own rows."""
    from llamax._native import gemm, quants
    E = model.tok_embd
    assert E.r8 and E.raw.shape[0] % 8 == 0
    raw = np.ascontiguousarray(model.gguf.raw("token_embd.weight"))
    toks = np.array([0, 5, 1234, E.n_vocab - 1], np.int64)
    np.testing.assert_array_equal(E.rows(toks), quants.dequantize(E.type, raw[toks], (4, E.n_embd)))
    rng = np.random.default_rng(3)
    for n in (1, 12):
        x = rng.standard_normal((n, E.n_embd)).astype(np.float32)
        np.testing.assert_array_equal(E.logits(x), gemm.mul_mat(raw, E.type, x))


@pytest.mark.parametrize("which", ["model", "gemma"])
def test_layer_views_are_the_layer_views(which, request):
    """memory.layer_views (one check and one mask per ubatch, what the decode step uses) gives every
    layer the view layer_view gives it, for the KV cache and the iSWA cache; both refuse a stale plan."""
    from llamax import StalePlanError
    m = request.getfixturevalue(which)
    ctx = Context(m, n_ctx=512, n_threads=2)
    mem = ctx.memory
    ub = mem.plan(Batch(m.tokenize(TEXT))).apply(0)
    views = mem.layer_views(ub)
    assert sorted(views) == list(range(m.hparams.n_layer))
    for il, v in views.items():
        one = mem.layer_view(il, ub)
        assert isinstance(v, LayerView) and v._fields == one._fields
        for a, b in zip(v, one):
            if isinstance(a, np.ndarray):
                assert a.shape == b.shape and np.shares_memory(a, b) and np.array_equal(a, b)
            else:
                assert a == b
    mem.seq_rm(0, -1, -1)
    with pytest.raises(StalePlanError):
        mem.layer_views(ub)
