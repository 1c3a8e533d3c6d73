"""qwen35 (Qwen3.5's gated delta nets and gated attention): the delta-rule kernel (csrc/delta_net.h) against its
scalar twin and a numpy reference, and the synthetic model of tests/synthetic_qwen35.py against llama.cpp's own
outputs on it (tests/data/qwen35/, made by its record.py with llama-cpp-python 0.3.36), its bits across thread
counts and prompt chunkings, its rollback, and the loader's refusals.

Tolerances as tests/test_recurrent_vs_llamacpp.py: twice llama.cpp's spread against itself on the model."""
import json
from pathlib import Path

import gguf
import numpy as np
import pytest

from llamax import Batch, Context, Model
from llamax._native import cpu
from llamax._native import delta_net as dn
from llamax.errors import ModelError
from helpers import check_greedy_up_to_near_tie, check_prompt_logits, prompt_logits, spread_tolerance
from synthetic import content_hash
from synthetic_qwen35 import Q8_0_WEIGHTS, write_qwen35

DATA = Path(__file__).parent / "data" / "qwen35"


# ---- the kernel ---------------------------------------------------------------------------------------------
def rule_reference(state, cells, q, k, v, g, beta, n_t):
    """The gated delta rule in float64 numpy, token by token (ggml_gated_delta_net's definition); state
    [n_cells, H, d, d] (row j: S[:, j]) updated in place; returns [n, H, d]."""
    n_cells, H, d, _ = state.shape
    Hk = q.shape[1] // d
    out = np.zeros((len(cells) * n_t, H, d))
    for s, c in enumerate(cells):
        for h in range(H):
            M = state[c, h].astype(np.float64)                       # M[j, i] = S[i, j]
            for t in range(n_t):
                r = s * n_t + t
                qv, kv = q[r, (h % Hk) * d:(h % Hk + 1) * d], k[r, (h % Hk) * d:(h % Hk + 1) * d]
                M *= np.exp(float(g[r, h]))
                delta = (v[r, h * d:(h + 1) * d] - M @ kv) * beta[r, h]
                M += np.outer(delta, kv)
                out[r, h] = M @ qv / np.sqrt(d)
            state[c, h] = M
    return out


def _inputs(rng, n, Hk, H, d, ld_extra=3):
    """q, k as column slices of one wider array (one row stride), v likewise; g < 0, beta in (0, 1)."""
    big = rng.standard_normal((n, 2 * Hk * d + H * d + ld_extra)).astype(np.float32)
    q, k = big[:, :Hk * d], big[:, Hk * d:2 * Hk * d]
    q /= np.linalg.norm(q.reshape(n, Hk, d), axis=-1).repeat(d, axis=1)
    k /= np.linalg.norm(k.reshape(n, Hk, d), axis=-1).repeat(d, axis=1)
    v = big[:, 2 * Hk * d:2 * Hk * d + H * d]
    g = -rng.uniform(0.01, 2.0, (n, H)).astype(np.float32)
    beta = rng.uniform(0.05, 0.95, (n, H)).astype(np.float32)
    return q, k, v, g, beta


@pytest.mark.parametrize("d", [16, 12])          # 12: the lanes' tail
def test_the_kernel_follows_the_numpy_reference(d):
    rng = np.random.default_rng(1)
    n_seqs, n_t, Hk, H = 2, 5, 2, 4
    state = rng.standard_normal((3, H, d, d)).astype(np.float32) * 0.1
    cells = np.array([2, 0], np.int32)
    q, k, v, g, beta = _inputs(rng, n_seqs * n_t, Hk, H, d)
    want_state = state.astype(np.float64)
    want = rule_reference(want_state, cells, q, k, v, g, beta, n_t)
    got = dn.rule(state, cells, q, k, v, g, beta, n_t, 2)
    assert np.abs(got - want).max() < 2e-5
    assert np.abs(state - want_state).max() < 2e-5


@pytest.mark.parametrize("d", [16, 20])
def test_the_kernel_gives_the_same_bits_at_every_simd_level_thread_count_and_split(d):
    """The AVX2 passes and their scalar twin agree bit for bit; so do 1 and 2 threads, and a sequence run as
    one ubatch or token by token; the history rows are the states after each of the last tokens."""
    rng = np.random.default_rng(2)
    n_t, Hk, H, n_hist = 7, 1, 2, 3
    q, k, v, g, beta = _inputs(rng, n_t, Hk, H, d)
    state0 = rng.standard_normal((2, H, d, d)).astype(np.float32) * 0.1
    cells = np.array([1], np.int32)
    runs = []
    try:
        for level in cpu.levels():
            cpu.set_simd_level(level)
            for nt in (1, 2):
                st, hist = state0.copy(), np.zeros((2, n_hist, H, d, d), np.float32)
                out = dn.rule(st, cells, q, k, v, g, beta, n_t, nt, hist=hist, hist_row=np.array([1], np.int32))
                runs.append((out, st, hist))
            st, steps, outs = state0.copy(), [], []
            for t in range(n_t):   # token by token
                outs.append(dn.rule(st, cells, q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], 1, 2))
                steps.append(st[1].copy())
            for a, b in ((runs[-1][0], np.concatenate(outs)), (runs[-1][1], st)):
                assert np.array_equal(a, b)
            hist = runs[-1][2]
            for j in range(n_hist):   # row (1 + j) % n_hist: the state after token n_t - n_hist + j
                assert np.array_equal(hist[1, (1 + j) % n_hist], steps[n_t - n_hist + j])
            assert not hist[0].any()
    finally:
        cpu.set_simd_level(-1)
    for r in runs[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(r, runs[0]))


def test_the_kernel_refuses_bad_input_and_changes_nothing():
    rng = np.random.default_rng(3)
    d, H, Hk, n = 8, 2, 1, 3
    q, k, v, g, beta = _inputs(rng, n, Hk, H, d)
    state = rng.standard_normal((2, H, d, d)).astype(np.float32)
    before = state.copy()
    cells = np.array([0], np.int32)
    bad = [
        dict(state=state[..., :4]),                                     # not square
        dict(cells=np.array([2], np.int32)),                            # outside the state's rows
        dict(cells=np.array([0], np.int64)),
        dict(v=np.ascontiguousarray(v[:, :d])),                         # not n_head * d columns
        dict(g=g[:, :1].copy()),
        dict(beta=beta.astype(np.float64)),
        dict(q=np.ascontiguousarray(q[:, :5])),                         # not a multiple of d
        dict(hist=np.zeros((2, 2, H, d, d), np.float32), hist_row=np.array([2], np.int32)),
        dict(hist_row=np.array([0], np.int32)),                         # without hist
        dict(hist=np.zeros((1, 2, H, d, d), np.float32)),               # not one ring per cell
    ]
    for kw in bad:
        args = dict(state=state, cells=cells, q=q, k=k, v=v, g=g, beta=beta, n_t=n)
        args.update(kw)
        with pytest.raises(ValueError):
            dn.rule(**args)
        assert np.array_equal(state, before)


# ---- the model against llama.cpp ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def path(tmp_path_factory, smollm2_gguf):
    return write_qwen35(tmp_path_factory.mktemp("qwen35") / "qwen35.gguf", smollm2_gguf)


@pytest.fixture(scope="module")
def case(path):
    meta = json.loads((DATA / "qwen35.json").read_text())
    assert content_hash(path) == meta["model"]["content_hash"], "the writer no longer gives the recorded model"
    assert path.stat().st_size < 5 << 20
    return "qwen35", Model.load(path, n_threads=2), meta, np.load(DATA / "qwen35.npz"), spread_tolerance(meta)


def test_the_model_loads_as_qwen35_with_its_layers(case):
    model = case[1]
    hp = model.hparams
    assert type(model).__name__ == "Qwen35" and hp.recurrent_layers == (0, 2)
    assert (hp.n_rot, hp.rope_kind, hp.ssm_n_group, hp.ssm_dt_rank) == (8, "neox", 2, 4)
    ctx = Context(model, n_ctx=64, n_threads=2)
    recr = ctx.memory.recr
    assert recr.r_shape == (128, 3) and recr.s_shape == (4, 16, 16)
    assert ctx.memory.attn.layer_ids == [1, 3]


def test_tokens_match_llama_cpp(case):
    _, model, meta, ref, _ = case
    for p, info in meta["prompts"].items():
        assert model.tokenize(info["text"]) == ref[f"{p}__tokens"].tolist(), p


def test_prompt_logits_within_llama_cpp_spread(case):
    check_prompt_logits(*case)


def test_greedy_continuation_identical_up_to_the_first_near_tie(case):
    check_greedy_up_to_near_tie(*case)


def test_greedy_text_identical_to_llama_cpp(case):
    """All 32 free-running greedy tokens of every prompt are llama.cpp's, and so is their text: one token at a
    time llama.cpp's delta net runs the same rule as csrc/delta_net.h (most steps' top-5 logits agree to the
    bit), so even its near-ties (a gap of 0.0002 on the long prompt) are decided alike."""
    _, model, meta, ref, _ = case
    for p, info in meta["prompts"].items():
        ctx = Context(model, n_ctx=512, n_threads=2)
        ctx.decode(Batch(ref[f"{p}__tokens"].tolist()))
        got = []
        for _ in range(len(info["greedy_tokens"])):
            got.append(int(ctx.get_logits()[-1].argmax()))
            ctx.decode(Batch([got[-1]]))
        assert got == info["greedy_tokens"], p
        assert model.detokenize(got) == info["greedy_text"], p


# ---- bits -----------------------------------------------------------------------------------------------
def test_logits_are_the_same_bits_for_any_thread_count_and_chunking(path, case):
    model, ref = case[1], case[3]
    toks = ref["medium__tokens"].tolist()
    want = prompt_logits(model, toks)
    for chunks in ([1] * 12 + [len(toks) - 12], [7, 7, 7, 7, 7, len(toks) - 35], [len(toks) - 1, 1]):
        assert np.array_equal(prompt_logits(model, toks, chunks=chunks), want), chunks
    assert np.array_equal(prompt_logits(model, toks, n_ubatch=5), want)
    one = Model.load(path, n_threads=1)
    assert np.array_equal(prompt_logits(one, toks, n_threads=1), want)


def test_quantized_weights_take_the_gemm_beside_the_float_ones_with_the_same_bits_for_any_chunking(tmp_path,
                                                                                                   smollm2_gguf, case):
    """With Q8_0 matrices (the delta nets' beta / alpha left float32) a layer's one in-projection runs the GEMM
    and the ordered float product side by side, the columns in the file's order: the logits are the same bits
    in one batch, in chunks and on one thread, and pick the float32 model's tokens on its clear rows."""
    model, ref, tol = case[1], case[3], case[4]
    path = write_qwen35(tmp_path / "q8.gguf", smollm2_gguf, q8_0=Q8_0_WEIGHTS)
    q8 = Model.load(path, n_threads=2)
    assert [type(f).__name__ for f in q8.layers[0].mixer.w_in.parts] == ["Linear", "OrderedProduct"]
    toks = ref["medium__tokens"].tolist()
    want = prompt_logits(q8, toks)
    assert np.array_equal(prompt_logits(q8, toks, chunks=[1] * 9 + [len(toks) - 9]), want)
    assert np.array_equal(prompt_logits(Model.load(path, n_threads=1), toks, n_threads=1), want)
    f32 = prompt_logits(model, toks)
    top2 = np.sort(f32, axis=1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 10 * tol        # Q8_0's own error is well below this
    assert clear.sum() > len(toks) // 2
    assert np.array_equal(want[clear].argmax(axis=1), f32[clear].argmax(axis=1))


def test_a_sequence_cut_back_inside_the_window_continues_with_the_same_bits(case):
    """After reserve_rollback, a verification batch's rejected tail removed with seq_rm leaves the states and
    next logits of a context that decoded only the kept tokens, bit for bit."""
    model, ref = case[1], case[3]
    prompt = ref["short__tokens"].tolist()
    draft = [42, 7, 1999, 300, 11]
    n = len(prompt)

    def states(ctx):
        r = ctx.memory.recr
        cell = next(i for i, (_, s) in enumerate(r.cells()) if 0 in s)
        return [a[cell].copy() for a in r.conv + r.ssm]

    for kept in (1, 3):
        ctx = Context(model, n_ctx=128, n_threads=2)
        ctx.memory.reserve_rollback(len(draft))
        ctx.decode(Batch(prompt))
        ctx.decode(Batch(draft, logits=[True] * len(draft)))
        assert ctx.memory.recr.rollback_window(0) == (n, n + len(draft) - 2)
        assert ctx.memory.seq_rm(0, n + kept, -1) is True
        plain = Context(model, n_ctx=128, n_threads=2)
        plain.decode(Batch(prompt))
        plain.decode(Batch(draft[:kept]))
        assert all(np.array_equal(a, b) for a, b in zip(states(ctx), states(plain)))
        for c in (ctx, plain):
            c.decode(Batch([5, 99], logits=[True, True]))
        assert np.array_equal(ctx.get_logits(), plain.get_logits())


def test_sequences_side_by_side_give_each_the_bits_it_gets_alone(case):
    """Two sequences in one batch (split equally, both in one ubatch, then the longer one's rest) give each
    the logits it gets decoded alone: each reads and writes only its own cell and K/V cells."""
    model, ref = case[1], case[3]
    a, b = ref["short__tokens"].tolist(), ref["medium__tokens"].tolist()[:13]
    alone = [prompt_logits(model, t)[-1] for t in (a, b)]
    ctx = Context(model, n_ctx=256, n_seq_max=2, n_threads=2)
    ctx.decode(Batch(a + b, seq_ids=[0] * len(a) + [1] * len(b),
                     logits=[False] * (len(a) - 1) + [True] + [False] * (len(b) - 1) + [True]))
    both = ctx.get_logits()
    assert np.array_equal(both[0], alone[0]) and np.array_equal(both[1], alone[1])


def test_a_saved_state_continues_with_the_same_bits(case):
    """state_get_data / state_set_data carry the delta nets' conv and rule states and the attention layers'
    K/V: a restored context's next logits are the original's."""
    model, ref = case[1], case[3]
    ctx = Context(model, n_ctx=128, n_threads=2)
    ctx.decode(Batch(ref["short__tokens"].tolist()))
    data = ctx.state_get_data()
    ctx.decode(Batch([5], logits=[True]))
    want = ctx.get_logits().copy()
    other = Context(model, n_ctx=128, n_threads=2)
    other.state_set_data(data)
    other.decode(Batch([5], logits=[True]))
    assert np.array_equal(other.get_logits(), want)


# ---- the loader's refusals ------------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, extra, match", [
    ({"qwen35.expert_count": (4, gguf.GGUFValueType.UINT32)}, None, "mixture of experts"),
    ({"qwen35.rope.dimension_sections": ([1, 0, 0, 1], gguf.GGUFValueType.ARRAY)}, None, "4th position"),
    ({"qwen35.ssm.inner_size": (48, gguf.GGUFValueType.UINT32)}, None, "time_step_rank"),
    ({"qwen35.ssm.group_count": (3, gguf.GGUFValueType.UINT32)}, None, "group_count"),
    ({"qwen35.full_attention_interval": (1, gguf.GGUFValueType.UINT32)}, None, "all attention"),
    ({"qwen35.ssm.group_count": (None, None)}, None, "group_count"),
    ({}, {"blk.1.ffn_gate_inp.weight": np.zeros((4, 64), np.float32)}, "unexpected tensor"),
])
def test_the_loader_refuses_what_llamax_does_not_run(tmp_path, smollm2_gguf, overrides, extra, match):
    p = write_qwen35(tmp_path / "bad.gguf", smollm2_gguf, overrides=overrides, extra_tensors=extra)
    with pytest.raises(ModelError, match=match):
        Model.load(p)
