"""Mamba-2 (arch "mamba2") and the hybrids built on it: Granite 4.0-H (arch "granitehybrid", dense and with experts)
and Nemotron-H (arch "nemotron_h").

The Mamba-2 scan kernel (llamax._native.ssd, csrc/ssd.h) against a numpy reference, its AVX2 step against the
scalar twin (the same bits), the same bits for any thread count and any split of a sequence into calls, and its
rollback rows; the synthetic models (tests/synthetic.py) against llama.cpp's outputs on them (tests/data/recurrent/,
recorded by its record.py with llama-cpp-python 0.3.36) with the tolerances of the Mamba tests (twice llama.cpp's
spread against itself); the memory's shapes; the same logits in one batch, in chunks, token by token and on any
thread count; a rollback (seq_rm inside the window) continuing with the bits of a decode that never had the rolled
back tokens; the loader's refusals."""
import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

import llamax
from helpers import check_greedy_up_to_near_tie, check_prompt_logits, prompt_logits, spread_tolerance
from llamax import Batch, Context, Model
from llamax._native import cpu
from llamax._native import ssd
from synthetic import (content_hash, write_granitehybrid, write_granitehybrid_moe, write_mamba2, write_nemotron_h,
                       write_truncated)

DATA = Path(__file__).parent / "data" / "recurrent"
WRITERS = {"mamba2": write_mamba2, "granitehybrid": write_granitehybrid, "granitehybrid_moe": write_granitehybrid_moe,
           "nemotron_h": write_nemotron_h}
TEXT = "The quick brown fox jumps over the lazy dog. A state folds every token"
DRAFT = [42, 7, 1999, 300, 11]


# ---- the scan kernel ---------------------------------------------------------------------------------------------
def _softplus(v):
    return np.where(v <= 20.0, np.log1p(np.exp(v)), v)


def scan_ref(state, cells, x, dt, A, B, C, D, z, n_t, n_group):
    """The Mamba-2 scan in float64 numpy (ggml_ssm_scan's Mamba-2 branch, + x * D, * silu(z)); updates state."""
    n_cells, nh, hd, ds = state.shape
    y = np.zeros(x.shape, np.float64)
    for s, c in enumerate(cells):
        S = state[c].astype(np.float64)
        for t in range(n_t):
            r = s * n_t + t
            for h in range(nh):
                g = h // (nh // n_group)
                d = _softplus(np.float64(dt[r, h]))
                xh = x[r, h * hd:(h + 1) * hd].astype(np.float64)
                S[h] = S[h] * np.exp(d * A[h]) + np.outer(xh * d, B[r, g * ds:(g + 1) * ds])
                yh = S[h] @ C[r, g * ds:(g + 1) * ds] + xh * D[h]
                zh = z[r, h * hd:(h + 1) * hd].astype(np.float64)
                y[r, h * hd:(h + 1) * hd] = yh * zh / (1 + np.exp(-zh))
        state[c] = S
    return y


def scan_inputs(rng, n, nh=4, hd=8, ds=12, ng=2):
    """Random inputs of one call: x and z, dt, A, D, B and C as column slices of wider rows (as the model passes)."""
    xbc = rng.standard_normal((n, nh * hd + 2 * ng * ds + 3)).astype(np.float32)
    zdt = rng.standard_normal((n, nh * hd + nh)).astype(np.float32)
    A = -rng.uniform(1, 8, nh).astype(np.float32)
    D = rng.standard_normal(nh).astype(np.float32)
    di = nh * hd
    return dict(x=xbc[:, :di], B=xbc[:, di:di + ng * ds], C=xbc[:, di + ng * ds:di + 2 * ng * ds], z=zdt[:, :di],
                dt=zdt[:, di:], A=A, D=D)


SHAPES = [dict(nh=4, hd=8, ds=12, ng=2), dict(nh=8, hd=16, ds=16, ng=1), dict(nh=6, hd=4, ds=24, ng=3)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_the_scan_matches_a_numpy_reference_and_its_scalar_twin_bit_for_bit(shape):
    rng = np.random.default_rng(1)
    n_seqs, n_t = 3, 5
    inp = scan_inputs(rng, n_seqs * n_t, **shape)
    cells = np.array([2, 0, 3], np.int32)
    state0 = rng.standard_normal((4, shape["nh"], shape["hd"], shape["ds"])).astype(np.float32)
    outs = []
    for level in cpu.levels():
        cpu.set_simd_level(level)
        try:
            st = state0.copy()
            outs.append((ssd.scan(st, cells, n_t=n_t, n_group=shape["ng"], n_threads=2, **inp), st))
        finally:
            cpu.set_simd_level(-1)
    ref_state = state0.copy()
    want = scan_ref(ref_state, cells, n_t=n_t, n_group=shape["ng"], **inp)
    y, st = outs[0]
    np.testing.assert_allclose(y, want, rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(st, ref_state, rtol=2e-4, atol=2e-4)
    assert np.array_equal(st[1], state0[1])                       # a cell of no sequence is left alone
    for y2, st2 in outs[1:]:                                      # every SIMD level: the scalar twin's bits
        assert np.array_equal(y2, y) and np.array_equal(st2, st)


def test_the_scan_gives_the_same_bits_for_any_thread_count_and_any_split_of_the_tokens():
    rng = np.random.default_rng(2)
    shape = dict(nh=8, hd=16, ds=16, ng=2)
    n_t = 12
    inp = scan_inputs(rng, n_t, **shape)
    cells = np.array([0], np.int32)
    state0 = np.zeros((1, 8, 16, 16), np.float32)
    st = state0.copy()
    want = ssd.scan(st, cells, n_t=n_t, n_group=2, n_threads=1, **inp)
    for n_threads in (2, 3):
        st2 = state0.copy()
        assert np.array_equal(ssd.scan(st2, cells, n_t=n_t, n_group=2, n_threads=n_threads, **inp), want)
        assert np.array_equal(st2, st)
    for split in ([1] * n_t, [5, 7], [3, 4, 5]):
        st3, ys, r0 = state0.copy(), [], 0
        for k in split:
            part = {key: (v[r0:r0 + k] if v.ndim == 2 else v) for key, v in inp.items()}
            ys.append(ssd.scan(st3, cells, n_t=k, n_group=2, n_threads=2, **part))
            r0 += k
        assert np.array_equal(np.concatenate(ys), want) and np.array_equal(st3, st), split


def test_the_history_rows_are_the_states_after_the_last_tokens_in_a_ring():
    rng = np.random.default_rng(3)
    n_t, n_hist = 5, 3
    inp = scan_inputs(rng, 2 * n_t)
    cells = np.array([1, 0], np.int32)
    st = np.zeros((2, 4, 8, 12), np.float32)
    hist = np.full((2, n_hist, 4, 8, 12), -1.0, np.float32)
    ssd.scan(st, cells, n_t=n_t, n_group=2, hist=hist, hist_row=np.array([2, 0], np.int32), **inp)
    for s, (c, r0) in enumerate(((1, 2), (0, 0))):
        for j in range(n_hist):   # row (r0 + j) % n_hist: the state after token n_t - n_hist + j
            t = n_t - n_hist + j
            part = {k: (v[s * n_t:s * n_t + t + 1] if v.ndim == 2 else v) for k, v in inp.items()}
            one = np.zeros((1, 4, 8, 12), np.float32)
            ssd.scan(one, np.array([0], np.int32), n_t=t + 1, n_group=2, **part)
            assert np.array_equal(hist[c, (r0 + j) % n_hist], one[0]), (s, j)
        assert np.array_equal(hist[c, (r0 + n_hist - 1) % n_hist], st[c])   # the last row is the state


def test_one_group_norms_in_one_step_with_the_grouped_norms_bits():
    """The native mixer (csrc/mamba2_layer.c) norms a one-group model's y with its weights in one rms_norm,
    its reference (mamba2_mixer) with weights of ones and then times the group's weights: the same bits, as
    rms_norm computes (x * scale) * w."""
    from llamax.model.linear import rms_norm
    rng = np.random.default_rng(3)
    y = rng.standard_normal((5, 256)).astype(np.float32) * 3
    w = rng.standard_normal(256).astype(np.float32)
    grouped = rms_norm(y, np.ones(256, np.float32), 1e-5) * w
    assert np.array_equal(rms_norm(y, w, 1e-5), grouped)


@pytest.mark.parametrize("bad,match", [
    (dict(n_group=3), "n_group"), (dict(A=np.zeros(5, np.float32)), "A must have shape"),
    (dict(cells=np.array([0, 0], np.int32)), "distinct"), (dict(cells=np.array([7], np.int32)), "cells must lie"),
    (dict(B="b"), "B must be a float32"), (dict(hist_row=np.array([0], np.int32)), "hist_row without hist"),
])
def test_bad_scan_arguments_raise_with_the_state_unchanged(bad, match):
    rng = np.random.default_rng(4)
    inp = scan_inputs(rng, 3)
    st = rng.standard_normal((2, 4, 8, 12)).astype(np.float32)
    before = st.copy()
    args = dict(state=st, cells=np.array([1], np.int32), n_t=3, n_group=2, **inp)
    if "cells" in bad:
        args["n_t"] = 3 // len(bad["cells"]) if len(bad["cells"]) < 3 else 1
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        ssd.scan(**args)
    assert np.array_equal(st, before)


# ---- the models against llama.cpp ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def paths(tmp_path_factory, smollm2_gguf):
    d = tmp_path_factory.mktemp("mamba2")
    return {n: w(d / f"{n}.gguf", smollm2_gguf) for n, w in WRITERS.items()}


@pytest.fixture(scope="module")
def models(paths):
    return {n: Model.load(p, n_threads=2) for n, p in paths.items()}


@pytest.fixture(scope="module", params=sorted(WRITERS))
def case(request, paths, models):
    name = request.param
    meta = json.loads((DATA / f"{name}.json").read_text())
    assert content_hash(paths[name]) == meta["model"]["content_hash"], "the writer no longer gives the recorded model"
    return name, models[name], meta, np.load(DATA / f"{name}.npz"), tolerance(meta)


def tolerance(meta: dict) -> float:
    """The Mamba tests' tolerance (twice llama.cpp's spread against itself, helpers.spread_tolerance), at least the
    Mamba-1 model's: llama.cpp's runs on the Mamba-2 model happen to agree bit for bit with each other, but its few
    differing rows come from the same place as Mamba-1's spread (the output head's Q8_0 quantization of the final
    hidden state: float noise moves an element across a rounding step, tests/data/recurrent/README.md), on the same
    vocabulary and head."""
    return max(spread_tolerance(meta), spread_tolerance(json.loads((DATA / "mamba.json").read_text())))


def test_prompt_logits_within_llama_cpp_spread(case):
    check_prompt_logits(*case)


def test_greedy_continuation_identical_up_to_the_first_near_tie(case):
    check_greedy_up_to_near_tie(*case)


def test_the_memories_have_llama_cpps_shapes(models):
    """conv: d_inner + 2 * n_group * d_state = 128 + 2 * 2 * 16 channels of d_conv - 1; ssm: [n_head, head_dim,
    d_state] = [8, 16, 16] (llama.cpp's n_embd_r, n_embd_s)."""
    mem = Context(models["mamba2"], n_ctx=256, n_seq_max=2).memory
    assert isinstance(mem, llamax.RecurrentMemory) and mem.layer_ids == [0, 1, 2, 3]
    assert mem.conv[0].shape == (2, 192, 3) and mem.ssm[0].shape == (2, 8, 16, 16)
    hyb = Context(models["granitehybrid"], n_ctx=256).memory
    assert isinstance(hyb, llamax.HybridMemory)
    assert hyb.recr.layer_ids == [0, 2] and hyb.attn.layer_ids == [1, 3]
    assert hyb.recr.conv[0].shape == (1, 192, 3) and hyb.recr.ssm[0].shape == (1, 8, 16, 16)
    nem = Context(models["nemotron_h"], n_ctx=256).memory   # "M*-M": the FFN layer 2 keeps nothing, as in llama.cpp
    assert isinstance(nem, llamax.HybridMemory) and nem.recr.layer_ids == [0, 3] and nem.attn.layer_ids == [1]
    assert hyb.can_shift and nem.can_shift   # a K-shift (granitehybrid's RoPE), or positions that only mask (nemotron_h)


def test_a_granitehybrid_sequence_shifted_by_seq_add_continues_as_one_decoded_at_the_shifted_positions(models):
    """seq_add rotates the cached K by the shift and moves the recurrent states' positions: the next token's
    logits are those of a context that decoded the prompt at the shifted positions (within the tolerance: the
    rotation of the f16 cache rounds)."""
    m = models["granitehybrid"]
    prompt, shift = m.tokenize(TEXT), 7
    n = len(prompt)
    a = Context(m, n_ctx=256, n_threads=2)
    a.decode(Batch(prompt))
    a.memory.seq_add(0, 0, n, shift)
    assert a.memory.seq_pos_max(0) == n - 1 + shift
    b = Context(m, n_ctx=256, n_threads=2)
    b.decode(Batch(prompt, pos=list(range(shift, n + shift))))
    for c in (a, b):
        c.decode(Batch([5], pos=[n + shift], logits=[True]))
    tol = tolerance(json.loads((DATA / "granitehybrid.json").read_text()))
    assert np.abs(a.get_logits() - b.get_logits()).max() <= tol


@pytest.mark.parametrize("name", sorted(WRITERS))
def test_a_prompt_gives_the_same_bits_in_one_batch_in_chunks_token_by_token_and_on_any_thread_count(models, name):
    m = models[name]
    toks = m.tokenize(TEXT)
    want = prompt_logits(m, toks)
    for kw in (dict(n_ubatch=1), dict(chunks=[7, 3, len(toks) - 10]), dict(n_threads=1)):
        assert np.array_equal(prompt_logits(m, toks, **kw), want), kw


def _rows(mem):
    r = mem.recr if isinstance(mem, llamax.HybridMemory) else mem
    return [a[0].copy() for a in r.conv + r.ssm]


@pytest.mark.parametrize("name", sorted(WRITERS))
@pytest.mark.parametrize("kept", [1, 3])
def test_a_rolled_back_tail_continues_with_the_bits_of_a_decode_without_it(models, name, kept):
    """reserve_rollback, a verification batch of 5 tokens, seq_rm of its rejected tail: the states and the next
    logits are those of a context that decoded only the kept tokens."""
    m = models[name]
    prompt = m.tokenize(TEXT)
    ctx = Context(m, n_ctx=256, n_threads=2)
    ctx.memory.reserve_rollback(len(DRAFT))
    ctx.decode(Batch(prompt))
    ctx.decode(Batch(DRAFT, logits=[True] * len(DRAFT)))
    assert ctx.memory.seq_rm(0, len(prompt) + kept, -1)
    ref = Context(m, n_ctx=256, n_threads=2)
    ref.decode(Batch(prompt))
    ref.decode(Batch(DRAFT[:kept]))
    assert all(np.array_equal(a, b) for a, b in zip(_rows(ctx.memory), _rows(ref.memory)))
    for c in (ctx, ref):
        c.decode(Batch([5], pos=[len(prompt) + kept], logits=[True]))
    assert np.array_equal(ctx.get_logits(), ref.get_logits())


# ---- loading -------------------------------------------------------------------------------------------------------
U32, ARR = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.ARRAY


@pytest.mark.parametrize("name,key,entry,match", [
    ("mamba2", "mamba2.ssm.group_count", (U32, None, 3), "group_count 3 must divide"),
    ("mamba2", "mamba2.ssm.group_count", None, "group_count"),
    ("granitehybrid_moe", "granitehybrid.expert_used_count", (U32, None, 5), "expert_used_count 5 exceeds"),
    ("granitehybrid", "granitehybrid.expert_count", (U32, None, 4), "expert_used_count' is missing"),
    ("nemotron_h", "nemotron_h.feed_forward_length", (ARR, U32, [0, 0, 128, 64]), "differs between the layers"),
    ("nemotron_h", "nemotron_h.attention.layer_norm_epsilon", None, "layer_norm_epsilon"),
])
def test_bad_hyperparameters_are_model_errors_naming_them(tmp_path, paths, name, key, entry, match):
    """A model's file with one key changed (entry: type, array element type, value) or dropped (None)."""
    path = write_truncated(tmp_path / "bad.gguf", paths[name], 4, metadata={key: entry})
    with pytest.raises(llamax.ModelError, match=match):
        Model.load(path)


def test_llamax_run_picks_mamba2(paths):
    r = subprocess.run([sys.executable, "-m", "llamax", "run", "-m", str(paths["mamba2"]), "-p", TEXT, "-n", "4",
                        "--temp", "0", "-c", "128", "-t", "2"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "llama_memory_recurrent: size =" in r.stderr


@pytest.mark.parametrize("name", ["mamba2", "granitehybrid"])
def test_a_sequence_state_round_trip_continues_bit_for_bit(models, name):
    """The [n_head, head_dim, d_state] states (and the hybrid's K/V) saved for one sequence and set into another
    context's other sequence continue with the same bits."""
    m = models[name]
    toks = m.tokenize(TEXT)
    ctx = Context(m, n_ctx=256, n_seq_max=2, n_threads=2)
    ctx.decode(Batch(toks, seq_ids=0))
    blob = ctx.state_seq_get_data(0)
    ctx.decode(Batch([5, 6], seq_ids=0, logits=[True, True]))
    want = ctx.get_logits().copy()
    other = Context(m, n_ctx=256, n_seq_max=2, n_threads=2)
    other.decode(Batch([9, 9, 9], seq_ids=0))
    other.state_seq_set_data(blob, 1)
    other.decode(Batch([5, 6], seq_ids=1, logits=[True, True]))
    assert np.array_equal(other.get_logits(), want)
