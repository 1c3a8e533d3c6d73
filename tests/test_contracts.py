"""The API contract under adversarial input (API.md): threads, stale plans, position bounds, types,
destination ids and command-line errors. Every failure is a documented error, leaves the memory as
it was, and never crashes the interpreter."""
import inspect
import math
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

import llamax
from llamax import (Batch, BatchError, Context, ContextParams, HybridMemory, KVCache, KVCacheISWA, RecurrentMemory, RoPE, Sampler,
                    StalePlanError)
from llamax import state
from llamax.dtypes import POS_MAX
from llamax.generate import Generation


def kv_cache(**kw):
    args = dict(n_seq_max=4, rope=RoPE(8))
    args.update(kw)
    return KVCache(2, 1, 8, 64, **args)


def iswa_cache(**kw):
    return KVCacheISWA(2, 1, 8, 256, swa_layers=[1], n_swa=4, n_ubatch=8, n_seq_max=4, rope=RoPE(8), **kw)


def run(mem, batch, n_ubatch=512, seed=0):
    """Plan, apply, store random K/V and attend for every layer of every ubatch."""
    rng = np.random.default_rng(seed)
    for ub in mem.plan(batch, n_ubatch=n_ubatch):
        for il in range(2):
            k = rng.standard_normal((ub.n_tokens, 1, 8)).astype(np.float32)
            mem.store(il, ub, k, k)
            mem.attend(il, ub, rng.standard_normal((ub.n_tokens, 2, 8)).astype(np.float32))


def snapshot(mem):
    caches = [mem.base, mem.swa] if isinstance(mem, KVCacheISWA) else [mem]
    return mem.cells(), [[a.copy() for a in c.k + c.v] for c in caches]


def assert_same(mem, snap):
    cells, data = snapshot(mem)
    assert cells == snap[0]
    for a, b in zip(data, snap[1]):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y)


# ---- 1. threads ----------------------------------------------------------------------------------
RACE = r"""
import sys, threading, time
from llamax import Batch, KVCache, KVCacheISWA, RoPE
kind = sys.argv[1]
if kind == "kv":
    mem = KVCache(2, 2, 32, 1024, n_seq_max=64)
else:
    mem = KVCacheISWA(2, 2, 32, 1024, swa_layers=[1], n_swa=64, n_ubatch=512, n_seq_max=64)
for ub in mem.plan(Batch(list(range(100)))):
    pass
used = mem.n_used
stop = threading.Event()
planned = [0]
def planner():
    b = Batch(list(range(512)), seq_ids=[list(range(40, 64))] * 512)
    while not stop.is_set():
        mem.plan(b)
        planned[0] += 1
t = threading.Thread(target=planner)
t.start()
n = 0
t0 = time.time()
while time.time() - t0 < 2.0 or planned[0] < 3:
    for k in range(1, 40):
        mem.seq_cp(0, k)
        mem.seq_rm(k)
        n += 1
        assert mem.n_used == used, ("a reader saw plan()'s temporary cells", mem.n_used, used)
stop.set()
t.join()
assert mem.seq_pos_max(0) == 99 and all(mem.seq_pos_max(k) == -1 for k in range(1, 64))
print("ok", planned[0], n)
"""


@pytest.mark.parametrize("kind", ["kv", "iswa"])
def test_plan_and_seq_ops_from_two_threads(kind):
    """The issue's reproducer: one thread plans (the native prepare runs without the GIL and rolls
    cells back) while another copies and removes sequences. Before the locks: SIGSEGV, SIGABRT or a
    hang, and readers saw temporary cells. In a child process so a crash or a hang fails cleanly."""
    r = subprocess.run([sys.executable, "-c", RACE, kind], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert r.stdout.startswith("ok")


NOT_LOCKED = {"summary", "breakdown", "cache_of", "can_shift", "exact_cut", "n_cells", "n_seq_max", "generation",
              "lock", "n_threads_resolved", "fingerprint"}  # constants of the object (fingerprint: the context's model)


def _public_methods(cls):
    for name, attr in inspect.getmembers(cls):
        if name.startswith("_") or name in NOT_LOCKED:
            continue
        fn = attr.fget if isinstance(attr, property) else attr
        if callable(fn):
            yield name, fn


@pytest.mark.parametrize("cls", [KVCache, KVCacheISWA, RecurrentMemory, HybridMemory, Context])
def test_every_public_operation_is_serialized(cls):
    """Every public method (and live property) of a memory or context runs under its lock."""
    unlocked = [name for name, fn in _public_methods(cls) if not getattr(fn, "locked", False)]
    assert unlocked == []


def test_n_free_is_what_a_batch_can_still_take():
    """n_free under the lock, per memory: the empty cells of the cache that holds one per position
    (n_cells - n_used of a KV cache, of an iSWA cache's base, of a hybrid's attention cache; the
    free states of a recurrent memory)."""
    R, S = (6, 3), (6, 4)
    kv, sw = kv_cache(), iswa_cache()
    recr = RecurrentMemory(2, R, S, n_seq_max=4)
    hyb = HybridMemory(KVCache(2, 1, 8, 64, n_seq_max=4, rope=RoPE(8)), RecurrentMemory(4, R, S, n_seq_max=4, layer_ids=[2, 3]))
    free = {"kv": lambda: kv.n_cells - kv.n_used, "iswa": lambda: sw.base.n_cells - sw.base.n_used,
            "recr": lambda: recr.n_cells - recr.n_used, "hyb": lambda: hyb.attn.n_cells - hyb.attn.n_used}
    mems = {"kv": kv, "iswa": sw, "recr": recr, "hyb": hyb}
    assert (kv.n_free, sw.n_free, recr.n_free, hyb.n_free) == (64, 256, 4, 64)
    for step, (seq, n) in enumerate([(0, 10), (1, 7), (0, 3)]):
        for name, mem in mems.items():
            for _ in mem.plan(Batch(list(range(1, n + 1)), seq_ids=[seq] * n)):
                pass
            assert mem.n_free == free[name](), (name, step)
    assert kv.n_free == 64 - 20 and recr.n_free == 2 and hyb.n_free == 64 - 20
    for mem in mems.values():
        mem.seq_rm(0)
        assert mem.n_free == free[[k for k, v in mems.items() if v is mem][0]]()
    assert kv.n_free == 64 - 7 and recr.n_free == 3


def test_lock_is_held_during_native_work():
    """Another thread's seq_rm waits while a plan runs: the lock is held across the whole call."""
    kv = kv_cache()
    entered = threading.Event()
    done = []

    def other():
        entered.wait()
        kv.seq_rm(-1)
        done.append(True)

    t = threading.Thread(target=other)
    t.start()
    with kv.lock:              # what plan() holds for its whole duration
        run(kv, Batch([1, 2, 3]))
        entered.set()
        t.join(timeout=0.3)
        assert t.is_alive() and not done   # seq_rm is waiting for the lock
        assert kv.seq_pos_max(0) == 2
    t.join(timeout=30)
    assert done and kv.n_used == 0


def test_context_decodes_from_several_threads(model):
    """Threads decoding their own sequences of one context while another reads and trims: every
    sequence ends with exactly its tokens, no exception."""
    ctx = Context(model, n_ctx=1024, n_seq_max=3, n_batch=64)
    errors = []

    def worker(s):
        try:
            toks = model.tokenize(f"Sequence {s} says hello", add_special=True)
            ctx.decode(Batch(toks, seq_ids=[s] * len(toks)))
            for t in range(12):
                with ctx.lock:  # a decode and its logits together
                    ctx.decode(Batch([100 + t], seq_ids=[s]))
                    assert np.isfinite(ctx.get_logits_ith(-1)).all()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def reader():
        try:
            for _ in range(200):
                ctx.memory.seq_pos_max(2)
                ctx.memory.cells()
                ctx.memory.seq_rm(2, 1000, -1)  # removes nothing, but changes the generation
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=worker, args=(s,)) for s in range(2)] + [threading.Thread(target=reader)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=300)
    assert not errors, errors
    for s in range(2):
        n = len(model.tokenize(f"Sequence {s} says hello", add_special=True)) + 12
        assert ctx.memory.seq_pos_min(s) == 0 and ctx.memory.seq_pos_max(s) == n - 1


def test_two_contexts_on_two_threads_give_each_alone_tokens_and_logits(model, gemma):
    """Two Contexts (SmolLM2 and Gemma 3, each with two threads) generating at the same time from two
    Python threads: the same tokens and the same logits bits as each run alone. The kernels release the
    GIL and share the OpenMP runtime, so nothing of one context may leak into the other's buffers."""
    jobs = [(model, "The capital of France is", 2), (gemma, "Water boils at a temperature of", 1)]

    def run(job):
        m, text, seed = job
        ctx = Context(m, n_ctx=256, n_threads=2)
        g = Generation(ctx, text, max_tokens=24, sampler=Sampler(temperature=0.8, seed=seed))
        rows = []
        for _ in g:
            rows.append(ctx.get_logits_ith(-1).copy())
        return g.generated, np.stack(rows)

    alone = [run(j) for j in jobs]
    for _ in range(2):
        out: list = [None, None]
        errors: list = []

        def worker(i):
            try:
                out[i] = run(jobs[i])
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        ts = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(timeout=300)
        assert not errors, errors
        for (tok_a, log_a), (tok_b, log_b) in zip(alone, out):
            assert tok_b == tok_a
            np.testing.assert_array_equal(log_b, log_a)


# ---- 2. destination -1 ------------------------------------------------------------------------
def test_destination_minus_one_is_refused(model, tmp_path):
    ctx = Context(model, n_ctx=256, n_seq_max=2)
    toks = model.tokenize("The cat sat on the mat")
    ctx.decode(Batch.one(toks, 0))
    ctx.decode(Batch.one(toks[:3], 1))
    seq_blob = ctx.state_seq_get_data(0)
    whole = ctx.state_get_data()
    ctx.state_seq_save_file(tmp_path / "s.bin", 0, toks)
    before = ctx.memory.cells()
    for bad in (-1, 2, 10**30):
        for call in (lambda: ctx.state_seq_set_data(seq_blob, bad), lambda: ctx.state_seq_set_data(whole, bad),
                     lambda: ctx.state_seq_load_file(tmp_path / "s.bin", bad)):
            with pytest.raises(ValueError, match="dest_seq_id"):
                call()
            assert ctx.memory.cells() == before
    with pytest.raises(TypeError):
        ctx.state_seq_set_data(seq_blob, 0.0)
    assert ctx.memory.cells() == before


# ---- 3. position bounds -----------------------------------------------------------------------
@pytest.mark.parametrize("make", [kv_cache, iswa_cache])
def test_positions_stay_below_pos_max(make):
    mem = make()
    for b in (Batch([1], pos=[POS_MAX]), Batch([1, 2], pos=[POS_MAX - 1, POS_MAX]),
              Batch([1, 2], pos=[POS_MAX - 1, POS_MAX], seq_ids=[[0, 1], [0, 1]])):
        with pytest.raises(BatchError, match="largest position"):
            mem.plan(b)
    run(mem, Batch([1, 2], pos=[POS_MAX - 2, POS_MAX - 1]))   # the largest position there is
    assert mem.seq_pos_max(0) == POS_MAX - 1
    snap = snapshot(mem)
    for b in (Batch([1]), Batch([1, 2], seq_ids=[0, 0]), Batch([1, 2], seq_ids=[[0, 1], [0, 1]])):
        with pytest.raises(BatchError, match="largest position"):   # filled from the memory: POS_MAX on
            mem.plan(b)
    assert_same(mem, snap)
    # the largest state the cache can hold saves and restores
    blob = state.get_data(mem)
    other = make()
    state.set_data(other, blob)
    assert other.cells() == mem.cells()
    seq = state.get_data(mem, 0)
    state.set_data(other, seq, 3)
    assert other.seq_pos_max(3) == POS_MAX - 1


@pytest.mark.parametrize("make", [kv_cache, iswa_cache])
def test_seq_add_cannot_overflow(make):
    mem = make()
    run(mem, Batch(list(range(10))))
    snap = snapshot(mem)
    for shift in (POS_MAX, POS_MAX - 9, 2**40):
        with pytest.raises(ValueError, match="largest position"):
            mem.seq_add(0, 0, -1, shift)
        assert_same(mem, snap)
    for p0, p1 in ((POS_MAX + 1, -1), (0, 2**40)):
        with pytest.raises(ValueError, match="position bound"):
            mem.seq_add(0, p0, p1, 1)
        with pytest.raises(ValueError, match="position bound"):
            mem.seq_rm(0, p0, p1)
        assert_same(mem, snap)
    mem.seq_add(0, 5, -1, POS_MAX - 10)   # positions 5..9 move to POS_MAX - 5 .. POS_MAX - 1
    assert mem.seq_pos_max(0) == POS_MAX - 1
    mem.seq_add(0, 0, 5, -2**40)          # far below 0: the cells are removed, as llama.cpp does
    assert mem.seq_pos_min(0) == POS_MAX - 5
    mem.seq_div(0, 0, -1, 2**40)          # any divisor beyond the positions gives 0
    assert mem.seq_pos_max(0) == 0


# ---- 4. stale plans ---------------------------------------------------------------------------
@pytest.mark.parametrize("make", [kv_cache, iswa_cache])
def test_two_plans_made_before_either_is_applied(make):
    mem = make()
    run(mem, Batch([1, 2, 3, 4]))
    pa = mem.plan(Batch([5, 6]))
    pb = mem.plan(Batch([7, 8], seq_ids=[1, 1]))
    for _ in pa:
        pass
    snap = snapshot(mem)
    with pytest.raises(StalePlanError):
        for _ in pb:
            pass
    assert_same(mem, snap)
    assert mem.seq_pos_max(0) == 5 and mem.seq_pos_max(1) == -1
    pb = mem.plan(Batch([7, 8], seq_ids=[1, 1]))  # planned again, it fits next to sequence 0
    for _ in pb:
        pass
    assert mem.seq_pos_max(0) == 5 and mem.seq_pos_max(1) == 1


@pytest.mark.parametrize("make", [kv_cache, iswa_cache])
@pytest.mark.parametrize("change", ["seq_rm", "seq_cp", "seq_add", "clear", "restore", "decode"])
def test_plan_after_a_change_is_stale(make, change):
    mem = make()
    run(mem, Batch([1, 2, 3, 4, 5, 6]))
    blob = state.get_data(mem)
    p = mem.plan(Batch([7, 8]))
    {"seq_rm": lambda: mem.seq_rm(0, 2, 4), "seq_cp": lambda: mem.seq_cp(0, 1),
     "seq_add": lambda: mem.seq_add(0, 0, -1, 3), "clear": lambda: mem.clear(),
     "restore": lambda: state.set_data(mem, blob), "decode": lambda: run(mem, Batch([9], seq_ids=[2]))}[change]()
    snap = snapshot(mem)
    with pytest.raises(StalePlanError, match="changed"):
        next(iter(p))
    assert_same(mem, snap)


def test_store_and_attend_refuse_after_a_change():
    kv = kv_cache()
    it = iter(kv.plan(Batch([1, 2, 3])))
    ub = next(it)
    k = np.ones((3, 1, 8), np.float32)
    kv.store(0, ub, k, k)
    kv.seq_rm(0, 1, 2)  # the ubatch's own cell 1 is gone
    for call in (lambda: kv.store(1, ub, k, k), lambda: kv.attend(0, ub, np.ones((3, 2, 8), np.float32))):
        with pytest.raises(StalePlanError):
            call()


def test_a_plan_of_many_ubatches_applies_in_turn():
    """A plan's own applies do not make it stale."""
    kv = kv_cache()
    run(kv, Batch(list(range(20)), seq_ids=[s % 3 for s in range(20)]), n_ubatch=3)
    assert [kv.seq_pos_max(s) for s in range(3)] == [6, 6, 5]


# ---- 5. the plan protocol: apply(i) / close, a context manager, iteration closed however it ends --
R_SHAPE, S_SHAPE = (6, 3), (6, 4)


def recurrent_memory():
    return RecurrentMemory(2, R_SHAPE, S_SHAPE, n_seq_max=4)


def hybrid_memory():
    return HybridMemory(KVCache(1, 1, 8, 64, n_seq_max=4, layer_ids=[1]),
                        RecurrentMemory(2, R_SHAPE, S_SHAPE, n_seq_max=4, layer_ids=[0]))


PLAN_MEMORIES = [kv_cache, iswa_cache, recurrent_memory, hybrid_memory]


def _users(mem):
    """What a model reaches between two applies: [(KV memory, layers)], [(recurrent memory, layers)]."""
    if isinstance(mem, HybridMemory):
        return [(mem.attn, [1])], [(mem.recr, [0])]
    if isinstance(mem, RecurrentMemory):
        return [], [(mem, [0, 1])]
    return [(mem, [0, 1])], []


def compute(mem, ub):
    """What a model does between two applies: store K/V and attend, or update the recurrent states."""
    kv, recr = _users(mem)
    for m, layers in kv:
        for il in layers:
            k = np.full((ub.n_tokens, 1, 8), float(ub.pos[0]), np.float32)
            m.store(il, ub, k, k)
            m.attend(il, ub, np.ones((ub.n_tokens, 2, 8), np.float32))
    for m, layers in recr:
        for il in layers:
            v = m.recurrent_view(il, ub)
            v.ssm[v.cells] += 1.0


def assert_released(mem, ub):
    """The plan is over: the memory holds no applied ubatch (no scratch state), and no lock."""
    kv, recr = _users(mem)
    zeros = np.zeros((ub.n_tokens, 1, 8), np.float32)
    for m, layers in kv:
        for il in layers:
            with pytest.raises(ValueError, match="not the one being applied"):
                m.store(il, ub, zeros, zeros)
    for m, layers in recr:
        for il in layers:
            with pytest.raises(ValueError, match="not the one being applied"):
                m.recurrent_view(il, ub)
    parts = [mem.attn, mem.recr] if isinstance(mem, HybridMemory) else [mem.base, mem.swa] \
        if isinstance(mem, KVCacheISWA) else [mem]
    assert all(p._active is None and getattr(p, "_undo", None) is None for p in parts)
    got = []
    t = threading.Thread(target=lambda: got.append(mem.lock.acquire(timeout=5) and mem.lock.release() is None))
    t.start()
    t.join()
    assert got == [True]


def fed(make, batches, n_ubatch=2):
    """A fresh memory that ran the batches: what the cells should hold."""
    mem = make()
    for b in batches:
        for ub in mem.plan(b, n_ubatch=n_ubatch):
            compute(mem, ub)
    return mem


@pytest.mark.parametrize("make", PLAN_MEMORIES)
def test_plan_apply_and_close_explicitly(make):
    mem = make()
    plan = mem.plan(Batch([1, 2, 3, 4, 5]), n_ubatch=2)
    assert len(plan) == 3 and plan.n_applied == 0 and not plan.closed
    with pytest.raises(ValueError, match="out of order"):
        plan.apply(1)
    assert mem.n_used == 0
    ubs = []
    for i in range(len(plan)):
        ub = plan.apply(i)
        assert ub is plan.ubatches[i] and plan.n_applied == i + 1
        compute(mem, ub)
        ubs.append(ub)
    with pytest.raises(ValueError, match="out of order"):
        plan.apply(0)
    compute(mem, ubs[-1])  # the last ubatch stays the memory's until the plan is closed
    plan.close()
    assert plan.closed
    assert_released(mem, ubs[-1])
    with pytest.raises(ValueError, match="closed"):
        plan.apply(3)
    plan.close()  # idempotent
    assert mem.cells() == fed(make, [Batch([1, 2, 3, 4, 5])]).cells()


@pytest.mark.parametrize("make", PLAN_MEMORIES)
def test_plan_as_a_context_manager(make):
    mem = make()
    with mem.plan(Batch([1, 2, 3]), n_ubatch=2) as plan:
        compute(mem, plan.apply(0))
        ub = plan.apply(1)
        compute(mem, ub)
    assert plan.closed
    assert_released(mem, ub)
    snap = mem.cells()
    with pytest.raises(KeyError):
        with mem.plan(Batch([4, 5, 6]), n_ubatch=2) as plan:
            ub = plan.apply(0)
            raise KeyError("the model failed")
    assert plan.closed
    assert_released(mem, ub)
    with mem.plan(Batch([7])) as unused:   # closed without an apply: nothing changes
        pass
    assert unused.closed and mem.seq_pos_max(0) == 4 and mem.cells() != snap
    for ub in mem.plan(Batch([8])):         # the memory goes on from where the applies left it
        compute(mem, ub)
    assert mem.seq_pos_max(0) == 5


@pytest.mark.parametrize("make", PLAN_MEMORIES)
def test_a_loop_that_breaks_closes_the_plan(make):
    mem = make()
    plan = mem.plan(Batch([1, 2, 3, 4, 5]), n_ubatch=2)
    for ub in plan:
        compute(mem, ub)
        break
    assert plan.closed and plan.n_applied == 1
    assert_released(mem, ub)
    assert mem.seq_pos_max(0) == 1
    with pytest.raises(ValueError, match="closed"):
        plan.apply(1)
    for ub in mem.plan(Batch([3, 4, 5]), n_ubatch=2):  # a new plan for the rest works
        compute(mem, ub)
    assert mem.cells() == fed(make, [Batch([1, 2, 3, 4, 5])]).cells()


@pytest.mark.parametrize("make", PLAN_MEMORIES)
def test_an_error_in_the_loop_closes_the_plan(make):
    mem = make()
    plan = mem.plan(Batch([1, 2, 3, 4, 5]), n_ubatch=2)
    with pytest.raises(ZeroDivisionError):
        for ub in plan:
            compute(mem, ub)
            if plan.n_applied == 2:
                1 / 0
    assert plan.closed and plan.n_applied == 2
    assert_released(mem, ub)
    mem.seq_rm(0, -1, -1)
    for ub in mem.plan(Batch([1, 2, 3]), n_ubatch=2):
        compute(mem, ub)
    assert mem.cells() == fed(make, [Batch([1, 2, 3])]).cells()


@pytest.mark.parametrize("make", [kv_cache, recurrent_memory])
def test_closing_an_unapplied_plan_leaves_the_applied_ubatch_alone(make):
    """Another plan made and closed while a loop runs does not take the loop's ubatch away."""
    mem = make()
    for ub in mem.plan(Batch([1, 2])):
        with mem.plan(Batch([9], seq_ids=1)):
            pass
        compute(mem, ub)


# ---- 7. types ---------------------------------------------------------------------------------
def test_non_integers_are_type_errors():
    kv = kv_cache()
    run(kv, Batch([1, 2, 3], seq_ids=[1, 1, 1]))
    snap = snapshot(kv)
    for call in (lambda: kv.seq_rm(1.9), lambda: kv.seq_rm(True), lambda: kv.seq_rm("1"),
                 lambda: kv.seq_rm(1, 0.5), lambda: kv.seq_cp(1, 2.0), lambda: kv.seq_keep(1.0),
                 lambda: kv.seq_add(1, 0, -1, 1.5), lambda: kv.seq_div(1, 0, -1, 2.0),
                 lambda: kv.seq_pos_max(1.0), lambda: kv.seq_pos_min(None),
                 lambda: kv.plan(Batch([1]), n_ubatch=2.5)):
        with pytest.raises(TypeError, match="integer"):
            call()
        assert_same(kv, snap)
    assert kv.seq_pos_max(np.int64(1)) == 2          # numpy integers are welcome
    kv.seq_cp(np.int32(1), np.uint8(2))
    assert kv.seq_pos_max(2) == 2
    with pytest.raises(TypeError):
        KVCache(2.0, 1, 8, 64)
    with pytest.raises(TypeError):
        KVCacheISWA(2, 1, 8, 256, swa_layers=[1.0], n_swa=4)
    with pytest.raises(TypeError):
        ContextParams(n_ctx=512.0)
    with pytest.raises(TypeError):
        Sampler(top_k=1.5)
    assert ContextParams(n_ctx=np.int64(512)).n_ctx == 512


def test_ints_beyond_the_c_range_are_value_errors():
    kv = kv_cache()
    run(kv, Batch([1, 2, 3]))
    snap = snapshot(kv)
    for call in (lambda: kv.seq_rm(2**70), lambda: kv.seq_rm(-2), lambda: kv.seq_cp(0, 2**40),
                 lambda: kv.seq_keep(-1), lambda: kv.seq_pos_max(2**64), lambda: kv.seq_div(0, 0, -1, 0),
                 lambda: kv.plan(Batch([1]), n_ubatch=2**40)):
        with pytest.raises(ValueError):
            call()
        assert_same(kv, snap)
    for kw in (dict(n_ctx=2**32), dict(n_ctx=10**12), dict(n_batch=2**31), dict(n_ubatch=-1), dict(n_seq_max=257)):
        with pytest.raises(ValueError, match="outside"):
            ContextParams(**kw)
    for kw in (dict(temperature=math.nan), dict(top_p=math.inf), dict(seed=-2)):
        with pytest.raises(ValueError):
            Sampler(**kw)


def test_context_and_generate_take_integers(model):
    ctx = Context(model, n_ctx=256, n_seq_max=2)
    ctx.decode(Batch.one(model.tokenize("Hello")))
    with pytest.raises(TypeError):
        ctx.get_logits_ith(1.5)
    assert ctx.get_logits_ith(np.int64(-1)).shape == (model.n_vocab,)
    before = ctx.memory.cells()
    for kw in (dict(max_tokens=1.5), dict(seq_id=1.0), dict(n_keep=0.5), dict(n_discard="2")):
        with pytest.raises(TypeError):
            list(llamax.generate(ctx, "Hi", **({"max_tokens": 2} | kw)))
        assert ctx.memory.cells() == before
    with pytest.raises(TypeError):
        list(llamax.generate(ctx, [1, 2.5], max_tokens=2, seq_id=1))
    assert ctx.memory.cells() == before


@pytest.mark.parametrize("args", [["-c", "4294967296"], ["-c", str(10**12)], ["--parallel", "1000"],
                                  ["-b", "0"], ["--temp", "nan"], ["--seed", "-5"], ["-ctk", "q9"],
                                  ["-m", "/nonexistent/model.gguf"]])
def test_cli_input_errors_are_one_line(args):
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    r = subprocess.run([sys.executable, "-m", "llamax.cli", "run", "-n", "1", *args], capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("llamax") or "error" in ln]
    assert lines and len(r.stderr.strip().splitlines()) <= 3, r.stderr  # argparse prints usage + one line


def test_exports():
    assert issubclass(StalePlanError, llamax.LlamaxError) and issubclass(StalePlanError, RuntimeError)
    assert "StalePlanError" in llamax.__all__
