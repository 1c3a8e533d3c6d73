"""The scans' undo rows (csrc/ssm.h's Undo) and the memory that relies on them (RecurrentMemory(kernel_undo=True),
as every model creates it): a scan copies each sequence's state as it first reads it into the undo row its
undo_slot names and sets the slot back to -1, with the same outputs and states as without; a batch that fails
anywhere (between two ubatches, or between two layers of one) leaves every sequence's state as it was, on the
synthetic Mamba, Mamba-2, Granite 4.0-H, Jamba and Qwen3.5 models."""
import numpy as np
import pytest

from llamax import Batch, Context, Model
from llamax._native import delta_net, ssd, ssm
from synthetic import write_granitehybrid, write_jamba, write_mamba, write_mamba2
from synthetic_qwen35 import write_qwen35

TEXT = "The quick brown fox jumps over the lazy dog. A state folds every token"


def _rng_f32(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def _scan_args(kind, rng, n_cells=4, n_seqs=3, n_t=2):
    """(function, kwargs without undo) of one scan over n_seqs sequences in cells [2, 0, 3]."""
    n = n_seqs * n_t
    cells = np.array([2, 0, 3], np.int32)[:n_seqs]
    if kind == "ssm":
        d, ds = 16, 8
        return ssm.scan, dict(state=_rng_f32(rng, n_cells, d, ds), cells=cells, x=_rng_f32(rng, n, d),
                              dt=_rng_f32(rng, n, d), A=-np.abs(_rng_f32(rng, d, ds)), B=_rng_f32(rng, n, ds),
                              C=_rng_f32(rng, n, ds), D=_rng_f32(rng, d), z=_rng_f32(rng, n, d), n_t=n_t)
    if kind == "ssd":
        nh, hd, ds, ng = 4, 8, 16, 2
        return ssd.scan, dict(state=_rng_f32(rng, n_cells, nh, hd, ds), cells=cells, x=_rng_f32(rng, n, nh * hd),
                              dt=_rng_f32(rng, n, nh), A=-np.abs(_rng_f32(rng, nh)), B=_rng_f32(rng, n, ng * ds),
                              C=_rng_f32(rng, n, ng * ds), D=_rng_f32(rng, nh), z=_rng_f32(rng, n, nh * hd), n_t=n_t,
                              n_group=ng)
    nh, d = 2, 32   # the delta net: heads of d x d (64 KB and more take the streamed copy)
    q, k = _rng_f32(rng, n, nh * d), _rng_f32(rng, n, nh * d)
    q /= np.linalg.norm(q.reshape(n, nh, d), axis=2).repeat(d, axis=1)
    k /= np.linalg.norm(k.reshape(n, nh, d), axis=2).repeat(d, axis=1)
    return delta_net.rule, dict(state=_rng_f32(rng, n_cells, nh, d, d, scale=0.1), cells=cells, q=q, k=k,
                                v=_rng_f32(rng, n, nh * d), g=-np.abs(_rng_f32(rng, n, nh)),
                                beta=np.abs(_rng_f32(rng, n, nh)) % 1, n_t=n_t)


@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("kind", ["ssm", "ssd", "delta_net"])
def test_a_scan_copies_the_states_it_first_reads_into_their_undo_rows(kind, n_threads):
    fn, args = _scan_args(kind, np.random.default_rng(1))
    before = args["state"].copy()
    plain = {**args, "state": before.copy()}
    want = fn(**plain, n_threads=n_threads)
    undo = np.full((4,) + before.shape[1:], 7.0, np.float32)
    slot = np.array([1, -1, 3], np.int32)    # the second sequence's state is not copied
    got = fn(**args, n_threads=n_threads, undo=undo, undo_slot=slot)
    np.testing.assert_array_equal(got, want)                 # the same outputs and states as without
    np.testing.assert_array_equal(args["state"], plain["state"])
    np.testing.assert_array_equal(undo[1], before[2])        # cell 2's state before the call
    np.testing.assert_array_equal(undo[3], before[3])
    assert np.all(undo[[0, 2]] == 7.0)                       # rows no slot named are left
    assert slot.tolist() == [-1, -1, -1]                     # done: back at -1


@pytest.mark.parametrize("kind", ["ssm", "ssd", "delta_net"])
@pytest.mark.parametrize("bad,match", [
    (dict(undo_slot=np.array([0, 1, 2], np.int32)), "undo_slot without undo"),
    (dict(undo=np.zeros((2, 1), np.float32), undo_slot=np.array([0, 1, -1], np.int32)), "undo"),
    (dict(undo="state", undo_slot=np.array([0, 1, -1], np.int32)), "overlap"),
    (dict(undo=4, undo_slot=np.array([0, 4, -1], np.int32)), r"\[-1, 4\)"),
    (dict(undo=4, undo_slot=np.array([1, 1, -1], np.int32)), "distinct"),
    (dict(undo=4, undo_slot=np.array([0, 1], np.int32)), "undo_slot must be"),
    (dict(undo=4, undo_slot=np.array([0, 1, -2], np.int32)), r"\[-1, 4\)"),
])
def test_bad_undo_arguments_are_refused_with_nothing_written(kind, bad, match):
    fn, args = _scan_args(kind, np.random.default_rng(2))
    before = args["state"].copy()
    bad = dict(bad)
    if isinstance(bad.get("undo"), int):
        bad["undo"] = np.zeros((bad["undo"],) + before.shape[1:], np.float32)
    elif isinstance(bad.get("undo"), str):
        bad["undo"] = args["state"]
    with pytest.raises(ValueError, match=match):
        fn(**args, **bad)
    np.testing.assert_array_equal(args["state"], before)


# ---- the memory on the models -------------------------------------------------------------------------------------
WRITERS = {"mamba": write_mamba, "mamba2": write_mamba2, "granitehybrid": write_granitehybrid, "jamba": write_jamba,
           "qwen35": write_qwen35}


@pytest.fixture(scope="module")
def models(tmp_path_factory, smollm2_gguf):
    d = tmp_path_factory.mktemp("kernel_undo")
    return {n: Model.load(w(d / f"{n}.gguf", smollm2_gguf), n_threads=2) for n, w in WRITERS.items()}


def _fail_at_mixer(monkeypatch, kind, model, n, before):
    """The n-th mixer call from now on raises, before it runs (its view handed out, its states unchanged) or
    after (its states changed, the later layers' not)."""
    import llamax.model.jamba as jamba_mod
    import llamax.model.mamba as mamba_mod
    import llamax.model.mamba2 as mamba2_mod
    import llamax.model.qwen35 as qwen35_mod

    calls = [0]

    def wrap(real):
        def flaky(*a, **k):
            calls[0] += 1
            if before and calls[0] == n:
                raise RuntimeError("a layer failed")
            out = real(*a, **k)
            if calls[0] == n:
                raise RuntimeError("a layer failed")
            return out
        return flaky

    if kind in ("mamba", "mamba2", "jamba"):   # their Python composition runs one mixer call per layer
        monkeypatch.setattr(type(model), "forward", type(model).forward_reference)
    if kind == "mamba":
        monkeypatch.setattr(mamba_mod, "mamba_mixer", wrap(mamba_mod.mamba_mixer))
    elif kind == "jamba":
        monkeypatch.setattr(jamba_mod, "mamba_mixer", wrap(jamba_mod.mamba_mixer))
    elif kind == "mamba2":
        monkeypatch.setattr(mamba2_mod, "mamba2_mixer", wrap(mamba2_mod.mamba2_mixer))
    elif kind == "granitehybrid":
        monkeypatch.setattr(mamba2_mod.Mamba2Mixer, "__call__", wrap(mamba2_mod.Mamba2Mixer.__call__))
    else:
        monkeypatch.setattr(qwen35_mod, "delta_net_mixer", wrap(qwen35_mod.delta_net_mixer))
    return calls


@pytest.mark.parametrize("kind", sorted(WRITERS))
@pytest.mark.parametrize("fail_at", [3, 4])
@pytest.mark.parametrize("before", [False, True], ids=["after-a-mixer", "in-a-mixer-before-its-scan"])
def test_a_batch_failing_anywhere_leaves_every_state_as_it_was(models, kind, fail_at, before, monkeypatch):
    """Two sequences with states and a new one, in ubatches of 4 tokens; the batch fails at the fail_at-th
    mixer call, after the mixer ran or inside it before its scan (its view, with its undo rows, handed out and
    not used). Every model here has 2 or 4 recurrent layers, so the failure ends a ubatch or falls between two
    layers of one. Every sequence's state is then byte for byte what it was, and decoding goes on as if the
    batch had never been."""
    model = models[kind]
    toks = model.tokenize(TEXT + " " + TEXT)
    ctx = Context(model, n_ctx=256, n_seq_max=3, n_ubatch=4, n_threads=2)
    ctx.decode(Batch(toks[:6] + toks[:9], seq_ids=[0] * 6 + [1] * 9))
    ctx.decode(Batch([5, 6], seq_ids=[0, 1]))
    before = [ctx.state_seq_get_data(s) for s in range(3)]
    n_layers = len(ctx.memory.recr.layer_ids) if hasattr(ctx.memory, "recr") else len(ctx.memory.layer_ids)
    calls = _fail_at_mixer(monkeypatch, kind, model, fail_at if n_layers == 4 else fail_at - 1, before)
    with pytest.raises(RuntimeError, match="a layer failed"):
        ctx.decode(Batch(toks[6:14] + toks[9:17] + toks[:8], seq_ids=[0] * 8 + [1] * 8 + [2] * 8))
    monkeypatch.undo()
    assert calls[0] >= 2
    assert [ctx.state_seq_get_data(s) for s in range(3)] == before
    ctx.decode(Batch([7, 8], seq_ids=[0, 1], logits=[True, True]))
    ref = Context(model, n_ctx=256, n_seq_max=3, n_threads=2)
    for s in range(2):
        ref.state_seq_set_data(before[s], s)
    ref.decode(Batch([7, 8], seq_ids=[0, 1], logits=[True, True]))
    np.testing.assert_array_equal(ctx.get_logits(), ref.get_logits())


@pytest.mark.parametrize("kind", ["mamba", "mamba2", "jamba"])
def test_the_native_stacks_generation_step_keeps_its_undo_rows(models, kind, monkeypatch):
    """The native steps' generation path (one token per sequence: Mamba-1's one parallel region on the models'
    2 threads, its channel blocks copying their own undo rows) under a batch that fails after two of its
    ubatches."""
    from helpers import fail_forward_at

    model = models[kind]
    toks = model.tokenize(TEXT)
    ctx = Context(model, n_ctx=256, n_seq_max=2, n_ubatch=2, n_threads=2)
    ctx.decode(Batch(toks[:5] + toks[:7], seq_ids=[0] * 5 + [1] * 7))
    before = [ctx.state_seq_get_data(s) for s in range(2)]
    calls: list = []
    fail_forward_at(monkeypatch, model, 3, calls)
    with pytest.raises(RuntimeError):   # ubatches of one token of each sequence: two run, the third fails
        ctx.decode(Batch([5, 6, 7, 8, 9, 10], seq_ids=[0, 1] * 3))
    monkeypatch.undo()
    assert calls == [2, 2, 2]
    assert [ctx.state_seq_get_data(s) for s in range(2)] == before


def test_the_undo_rows_are_counted_in_the_memory_breakdown(models):
    """breakdown()["undo"]: a state's bytes per cell of the most cells one batch changed (here two), in every
    layer; nothing before the first batch."""
    ctx = Context(models["mamba2"], n_ctx=256, n_seq_max=3, n_threads=2)
    mem = ctx.memory
    assert mem.breakdown()["undo"] == 0
    ctx.decode(Batch([5, 6, 7, 8], seq_ids=[0, 0, 1, 1]))
    per_cell = (mem.breakdown()["r"] + mem.breakdown()["s"]) // mem.mem_size
    assert mem.breakdown()["undo"] == 2 * per_cell
    ctx.decode(Batch([9], seq_ids=[0]))
    assert mem.breakdown()["undo"] == 2 * per_cell   # kept from batch to batch
