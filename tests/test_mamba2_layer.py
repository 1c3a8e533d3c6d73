"""The native Mamba-2 mixer (csrc/mamba2_layer.h): one C call runs the in-projection, the convolution of x, B
and C, dt's bias, the scan with its skip and gate, the grouped RMS norm and the out-projection; the mamba2
architecture runs every layer (with its norm and residual) in one call. Its reference is the Python
composition of the same kernels (llamax/model/mamba2.py's mamba2_mixer): the two give the same logits and
leave the same states, rollback rows and K/V on the synthetic Mamba-2, Granite 4.0-H and Nemotron-H of
tests/synthetic.py, for 1 and 2 threads and two chunkings; the mixer alone gives the reference's bits for
1, 2 and 4 groups and quantized products; a view that does not fit is refused before any layer writes."""
from types import SimpleNamespace

import gguf
import numpy as np
import pytest

import llamax
from helpers import run_recurrent_script
from llamax import Batch, Model
from llamax._native.mamba2_layer import Mamba2Layers
from llamax.model.linear import Linear, Part
from llamax.model.mamba import OrderedProduct
from llamax.model.mamba2 import Mamba2Mixer, mamba2_mixer, native_layer
from synthetic import write_granitehybrid, write_mamba2, write_nemotron_h

WRITERS = {"mamba2": write_mamba2, "granitehybrid": write_granitehybrid, "nemotron_h": write_nemotron_h}


@pytest.fixture(scope="module")
def paths(tmp_path_factory, smollm2_gguf):
    d = tmp_path_factory.mktemp("mamba2_layer")
    return {n: w(d / f"{n}.gguf", smollm2_gguf) for n, w in WRITERS.items()}


CASES = [(kind, nt) for kind in sorted(WRITERS) for nt in (1, 2)]


@pytest.mark.parametrize("kind,n_threads", CASES, ids=[f"{k}-{t}threads" for k, t in CASES])
@pytest.mark.parametrize("chunk,n_ubatch", [(64, 512), (5, 3)], ids=["one-batch", "chunks-of-5"])
def test_native_step_is_the_python_composition_bit_for_bit(paths, kind, n_threads, chunk, n_ubatch, monkeypatch):
    model = Model.load(paths[kind], n_threads=n_threads)
    logits, bufs = run_recurrent_script(model, chunk, n_ubatch)
    if kind == "mamba2":
        monkeypatch.setattr(type(model), "forward", type(model).forward_reference)
    monkeypatch.setattr(Mamba2Mixer, "__call__", mamba2_mixer)   # the hybrids' mixers
    ref_logits, ref_bufs = run_recurrent_script(model, chunk, n_ubatch)
    assert len(logits) == len(ref_logits) and len(bufs) == len(ref_bufs)
    for got, want in zip(logits + bufs, ref_logits + ref_bufs):
        np.testing.assert_array_equal(got, want)


def _linear(w, t, n_threads, r8=False):
    from llamax._native import gemm

    w = np.asarray(w, np.float32)
    raw = np.ascontiguousarray(gguf.quants.quantize(w, t))
    if r8:
        raw = gemm.pack_r8(raw, int(t))
    return Linear([Part(raw, int(t), w.shape[0], r8)], w.shape[1], n_threads)


def _mixer(n_group, n_threads, quantized, seed=0):
    """A mixer of random weights (n_embd 64, 8 heads of 8, d_state 16, d_conv 4) and its hparams."""
    rng = np.random.default_rng(seed)
    E, di, ds, nh, dc = 64, 64, 16, 8, 4
    cd = di + 2 * n_group * ds
    hp = SimpleNamespace(n_embd=E, ssm_d_inner=di, ssm_d_state=ds, ssm_n_group=n_group, ssm_conv_dim=cd,
                         ssm_dt_rank=nh, rms_eps=1e-5)
    w_in = rng.standard_normal((di + cd + nh, E)).astype(np.float32) * 0.2
    w_out = rng.standard_normal((E, di)).astype(np.float32) * 0.1
    T = gguf.GGMLQuantizationType
    L = SimpleNamespace(
        ssm_in=_linear(w_in, T.Q8_0, n_threads, r8=True) if quantized else OrderedProduct(w_in, n_threads),
        ssm_out=_linear(w_out, T.Q4_0, n_threads) if quantized else OrderedProduct(w_out, n_threads),
        conv_w=rng.standard_normal((cd, dc)).astype(np.float32) * 0.5,
        conv_b=rng.standard_normal(cd).astype(np.float32) * 0.1,
        dt_b=rng.uniform(-4, -1, nh).astype(np.float32), A=-rng.uniform(1, 16, nh).astype(np.float32),
        D=np.ones(nh, np.float32), norm=rng.uniform(0.5, 1.5, (n_group, di // n_group)).astype(np.float32))
    return L, hp


@pytest.mark.parametrize("quantized", [False, True], ids=["f32", "q8_0-r8-q4_0"])
@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("n_group", [1, 2, 4])
def test_the_mixer_alone_gives_the_references_bits_for_any_group_count(n_group, n_threads, quantized):
    """Two sequences through a prompt of 5 tokens each, then two single-token steps, with rollback rows: the
    native mixer's outputs, states and rows are the Python composition's, bit for bit."""
    L, hp = _mixer(n_group, n_threads, quantized)
    native = Mamba2Layers([native_layer(L, None, hp)])
    hd = hp.ssm_d_inner // hp.ssm_dt_rank
    mems = [llamax.RecurrentMemory(1, (hp.ssm_conv_dim, 3), (hp.ssm_dt_rank, hd, hp.ssm_d_state), n_seq_max=3)
            for _ in range(2)]
    for m in mems:
        m.reserve_rollback(2)
    rng = np.random.default_rng(7)
    for toks, seqs in (([1, 2, 3, 4, 5] * 2, [1] * 5 + [2] * 5), ([6, 7], [1, 2]), ([8, 9], [1, 2])):
        h = rng.standard_normal((len(toks), hp.n_embd)).astype(np.float32)
        outs = []
        for m, run in zip(mems, (lambda v, n_t: native.mixer(0, h, v, n_t, n_threads),
                                 lambda v, n_t: mamba2_mixer(L, h, v, n_t, hp, n_threads))):
            plan = m.plan(Batch(toks, seq_ids=seqs))
            for i in range(len(plan)):
                ub = plan.apply(i)
                outs.append(run(m.recurrent_view(0, ub), ub.n_seq_tokens))
        np.testing.assert_array_equal(outs[0], outs[1])
        assert np.all(np.isfinite(outs[0]))
    for a, b in zip(mems[0].conv + mems[0].ssm + mems[0].conv_hist + mems[0].ssm_hist,
                    mems[1].conv + mems[1].ssm + mems[1].conv_hist + mems[1].ssm_hist):
        np.testing.assert_array_equal(a, b)
    assert any(np.any(a) for a in mems[0].ssm_hist)


def _stack_and_views(paths):
    model = Model.load(paths["mamba2"], n_threads=2)
    hp = model.hp
    mem = llamax.RecurrentMemory(hp.n_layer, hp.r_shape, hp.s_shape, n_seq_max=2)
    mem.reserve_rollback(3)
    ub = mem.plan(Batch([5, 6, 7], seq_ids=1)).apply(0)
    views = [mem.recurrent_view(il, ub) for il in range(hp.n_layer)]
    return model, mem, views, model.tok_embd.rows(np.array([5, 6, 7]))


@pytest.mark.parametrize("change,match", [
    (dict(cells=np.array([7], np.int32)), "cell out of range"),
    (dict(cells=np.array([0, 1], np.int32)), "cells must be"),
    (dict(hist_row=np.array([3], np.int32)), "history row out of range"),
    (dict(conv=np.zeros((2, 128, 3), np.float32)), "conv states of shape"),
    (dict(ssm=np.zeros((2, 8, 16, 8), np.float32)), "ssm states of shape"),
    (dict(ssm=np.zeros((2, 128, 16), np.float32)), "conv / ssm must be"),
    (dict(ssm_hist=np.zeros((2, 3, 8, 16, 8), np.float32)), "history rows of shapes"),
])
def test_a_view_that_does_not_fit_is_refused_before_any_layer_writes(paths, change, match):
    model, mem, views, x = _stack_and_views(paths)
    before = [a.copy() for a in mem.conv + mem.ssm + mem.conv_hist + mem.ssm_hist]
    x0 = x.copy()
    views[3] = views[3]._replace(**change)   # the last layer: the first three must not have run
    with pytest.raises(ValueError, match=match):
        model.stack.forward(x, views, 3)
    for a, b in zip(mem.conv + mem.ssm + mem.conv_hist + mem.ssm_hist, before):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(x, x0)


def test_bad_arguments_are_refused(paths):
    model, mem, views, x = _stack_and_views(paths)
    with pytest.raises(ValueError, match="n_t"):
        model.stack.forward(x, views, 2)
    with pytest.raises(ValueError, match="views for"):
        model.stack.forward(x, views[:3], 3)
    with pytest.raises(ValueError, match="x must be"):
        model.stack.forward(x.astype(np.float64), views, 3)
    alone = Mamba2Layers([native_layer(model.layers[0], None, model.hp)])   # a hybrid's: mixers without norms
    with pytest.raises(ValueError, match="has no norm"):   # a mixer alone runs only through mixer()
        alone.forward(x, views[:1], 3)
    with pytest.raises(ValueError, match="out of"):
        alone.mixer(1, x, views[0], 3)
    assert all(L.native is model.stack and L.index == il for il, L in enumerate(model.layers))   # one object
    d = native_layer(model.layers[0], model.norms[0], model.hp)
    for change, match in ((dict(d_conv=0), "d_conv"), (dict(n_group=3), "dividing"),
                          (dict(A=np.zeros(4, np.float32)), "A: expected"),
                          (dict(ssm_norm=np.ones((1, 128), np.float32)), "ssm_norm: expected"),
                          (dict(ssm_in=np.zeros((100, 64), np.float32)), "ssm_in: expected"),
                          (dict(ssm_out=[(np.zeros((64, 3), np.uint8), 99)]), "no native product")):
        with pytest.raises(ValueError, match=match):
            Mamba2Layers([{**d, **change}])
    with pytest.raises(ValueError, match="at least one layer"):
        Mamba2Layers([])
