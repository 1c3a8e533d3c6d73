"""The native Mamba-1 layer step (csrc/mamba_layer.h): one C call per layer runs the RMSNorm, the
in-projection, the convolution, the x-projection, the dt/B/C norms, the dt-projection and its bias,
the scan, the out-projection and the residual (and Jamba's FFN after the mixer). Its reference is the
model's forward composed in Python (forward_reference): the two give the same logits and leave the
same states, rollback rows and K/V, on the synthetic Mamba, Falcon-Mamba (unweighted dt/B/C norms) and
Jamba of tests/synthetic.py, for 1 and 2 threads and two chunkings of the same tokens. A view that does
not fit is refused before any layer writes."""
import gguf
import numpy as np
import pytest

import llamax
from llamax import Batch, Context, Model
from llamax._native.mamba_layer import MambaStack
from llamax.model.mamba import native_layer
from helpers import run_recurrent_script
from synthetic import write_jamba, write_mamba

@pytest.fixture(scope="module")
def paths(tmp_path_factory, smollm2_gguf):
    d = tmp_path_factory.mktemp("mamba_layer")
    return {
        "mamba": write_mamba(d / "mamba.gguf", smollm2_gguf),
        "falcon": write_mamba(d / "falcon.gguf", smollm2_gguf, seed=1,
                              overrides={"mamba.ssm.dt_b_c_rms": (True, gguf.GGUFValueType.BOOL)}),
        "jamba": write_jamba(d / "jamba.gguf", smollm2_gguf),
    }


_models: dict = {}


def _model(paths, kind, n_threads):
    key = (kind, n_threads)
    if key not in _models:
        _models[key] = Model.load(paths[kind], n_threads=n_threads)
    return _models[key]


CASES = [(kind, nt) for kind in ("mamba", "falcon", "jamba") for nt in (1, 2)]


@pytest.mark.parametrize("kind,n_threads", CASES, ids=[f"{k}-{t}threads" for k, t in CASES])
@pytest.mark.parametrize("chunk,n_ubatch", [(64, 512), (5, 3)], ids=["one-batch", "chunks-of-5"])
def test_native_step_is_the_python_composition_bit_for_bit(paths, kind, n_threads, chunk, n_ubatch, monkeypatch):
    model = _model(paths, kind, n_threads)
    logits, bufs = run_recurrent_script(model, chunk, n_ubatch)
    monkeypatch.setattr(type(model), "forward", type(model).forward_reference)
    ref_logits, ref_bufs = run_recurrent_script(model, chunk, n_ubatch)
    assert len(logits) == len(ref_logits) and len(bufs) == len(ref_bufs)
    for got, want in zip(logits, ref_logits):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(bufs, ref_bufs):
        np.testing.assert_array_equal(got, want)


def test_the_chunkings_and_thread_counts_agree(paths):
    """The native step's logits do not depend on the split of the tokens or the thread count."""
    for kind in ("mamba", "jamba"):
        first = [np.concatenate(run_recurrent_script(_model(paths, kind, nt), chunk, ub)[0][:1])
                 for nt in (1, 2) for chunk, ub in ((64, 512), (64, 7))]
        for f in first[1:]:
            np.testing.assert_array_equal(f, first[0])


def _stack_and_views(paths):
    model = _model(paths, "mamba", 2)
    stack = MambaStack([native_layer(L, norm, model.hp) for norm, L in zip(model.norms, model.layers)])
    mem = llamax.RecurrentMemory(model.hp.n_layer, (128, 3), (128, 16), n_seq_max=2)
    mem.reserve_rollback(3)
    ub = mem.plan(Batch([5, 6, 7], seq_ids=1)).apply(0)
    views = [mem.recurrent_view(il, ub) for il in range(model.hp.n_layer)]
    x = model.tok_embd.rows(np.array([5, 6, 7]))
    return model, stack, mem, views, x


@pytest.mark.parametrize("change,match", [
    (dict(cells=np.array([7], np.int32)), "cell out of range"),
    (dict(cells=np.array([0, 1], np.int32)), "cells must be"),
    (dict(cells=np.array([0], np.int64)), "cells must be"),
    (dict(hist_row=np.array([3], np.int32)), "history row out of range"),
    (dict(hist_row=np.array([-1], np.int32)), "history row out of range"),
    (dict(conv=np.zeros((2, 128, 2), np.float32)), "conv states of shape"),
    (dict(ssm=np.zeros((2, 64, 16), np.float32)), "ssm states of shape"),
    (dict(conv_hist=None), "conv_hist / ssm_hist"),
    (dict(conv_hist=None, ssm_hist=None), "hist_row without"),
    (dict(ssm_hist=np.zeros((2, 3, 128, 8), np.float32)), "history rows of shapes"),
])
def test_a_view_that_does_not_fit_is_refused_before_any_layer_writes(paths, change, match):
    model, stack, mem, views, x = _stack_and_views(paths)
    before = [a.copy() for a in mem.conv + mem.ssm + mem.conv_hist + mem.ssm_hist]
    x0 = x.copy()
    views[3] = views[3]._replace(**change)   # the last layer: the first three must not have run
    with pytest.raises(ValueError, match=match):
        stack.forward(x, views, 3)
    for a, b in zip(mem.conv + mem.ssm + mem.conv_hist + mem.ssm_hist, before):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(x, x0)


def test_bad_arguments_are_refused(paths):
    model, stack, mem, views, x = _stack_and_views(paths)
    with pytest.raises(ValueError, match="n_t"):
        stack.forward(x, views, 2)
    with pytest.raises(ValueError, match="views for"):
        stack.forward(x, views[:3], 3)
    with pytest.raises(ValueError, match="x must be"):
        stack.forward(x.astype(np.float64), views, 3)
    d = native_layer(model.layers[0], model.norms[0], model.hp)
    for change, match in ((dict(d_conv=0), "d_conv"), (dict(A=np.zeros((128, 8), np.float32)), "A: expected"),
                          (dict(dt_norm=np.ones(4, np.float32)), "go together"),
                          (dict(ssm_x=np.zeros((36, 64), np.float32)), "ssm_x: expected"),
                          (dict(ssm_in=[(np.zeros((256, 3), np.uint8), 99)]), "no native product"),
                          (dict(n_ff=8), "ffn_norm")):
        with pytest.raises(ValueError, match=match):
            MambaStack([{**d, **change}])
    with pytest.raises(ValueError, match="at least one layer"):
        MambaStack([])


def test_the_stack_alone_equals_the_model_step(paths):
    """MambaStack.forward on the embeddings gives the hidden states the model's forward normalizes."""
    model, stack, mem, views, x = _stack_and_views(paths)
    h = stack.forward(x, views, 3, n_threads=1)
    assert h is x and h.shape == (3, 64) and np.all(np.isfinite(h))
    ctx = Context(model, n_ctx=64, n_seq_max=2, n_threads=2)
    ctx.decode(Batch([5, 6, 7], seq_ids=1, logits=[True] * 3))
    want = model._out(h, embd=False)
    np.testing.assert_array_equal(ctx.get_logits(), want)


def _quantized(path, n_threads):
    """The synthetic Mamba with its products in the other engines of product.h: ssm_in Q8_0 in the r8
    layout (the GEMM over interleaved rows), ssm_out Q5_1 GGUF rows (the GEMM), ssm_x and ssm_dt f16
    parts (the float product), and Q4_0 r8 for ssm_out of the last layer (a group straddling nothing)."""
    from llamax._native import gemm
    from llamax.model.linear import Linear, Part

    model = Model.load(path, n_threads=n_threads)

    def linear(w, t, r8=False):
        w = np.asarray(w, np.float32)
        if t == gguf.GGMLQuantizationType.F16:
            raw = np.ascontiguousarray(w.astype(np.float16).view(np.uint8))
        else:
            raw = np.ascontiguousarray(gguf.quants.quantize(w, t))
        if r8:
            raw = gemm.pack_r8(raw, int(t))
        return Linear([Part(raw, int(t), w.shape[0], r8)], w.shape[1], n_threads)

    T = gguf.GGMLQuantizationType
    rng = np.random.default_rng(3)
    for il, L in enumerate(model.layers):
        di, E = model.hp.ssm_d_inner, model.hp.n_embd
        L.ssm_in = linear(rng.standard_normal((2 * di, E)) * 0.2, T.Q8_0, r8=True)
        L.ssm_out = linear(rng.standard_normal((E, di)) * 0.1, T.Q4_0 if il == 3 else T.Q5_1, r8=il == 3)
        L.ssm_x = linear(L.ssm_x.w, T.F16)
        L.ssm_dt = linear(L.ssm_dt.w, T.F16)
    model.stack = MambaStack([native_layer(L, norm, model.hp) for norm, L in zip(model.norms, model.layers)])
    return model


@pytest.mark.parametrize("n_threads", [1, 2])
def test_quantized_products_give_the_python_composition_bits(paths, n_threads, monkeypatch):
    """The GEMM (GGUF rows and r8) and the float product of f16 parts, split by rows over the threads in
    the generation step: the same bits as the Python composition's whole products."""
    model = _quantized(paths["mamba"], n_threads)
    for chunk, ub in ((64, 512), (5, 3)):
        logits, bufs = run_recurrent_script(model, chunk, ub)
        with monkeypatch.context() as m:
            m.setattr(type(model), "forward", type(model).forward_reference)
            ref_logits, ref_bufs = run_recurrent_script(model, chunk, ub)
        for got, want in zip(logits + bufs, ref_logits + ref_bufs):
            np.testing.assert_array_equal(got, want)
