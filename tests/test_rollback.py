"""Per-token state rollback of the recurrent and hybrid memories (speculative decoding): after
reserve_rollback(n), a verification ubatch [last, d1..dk] of a sequence can lose its rejected tail with
seq_rm(seq, p, -1), leaving, bit for bit, the states (and the next logits) of a context that decoded
only the kept tokens; on the synthetic Mamba and Jamba GGUFs of tests/synthetic.py."""
import numpy as np
import pytest

import llamax
from llamax import Batch, Context, Model, StalePlanError
from llamax.memory import KVCache, RecurrentMemory
from helpers import fail_forward_at
from synthetic import write_jamba, write_mamba

TEXT = "The quick brown fox jumps over the lazy dog. A state folds every token"
OTHER = "Once upon a time there was a snake"
DRAFT = [42, 7, 1999, 300, 11]          # the verification batch: [last] + 4 drafts (k = 4)
K = len(DRAFT) - 1


@pytest.fixture(scope="module")
def mamba(tmp_path_factory, smollm2_gguf):
    return Model.load(write_mamba(tmp_path_factory.mktemp("mamba") / "mamba.gguf", smollm2_gguf), n_threads=2)


@pytest.fixture(scope="module")
def jamba(tmp_path_factory, smollm2_gguf):
    return Model.load(write_jamba(tmp_path_factory.mktemp("jamba") / "jamba.gguf", smollm2_gguf), n_threads=2)


def _recr(mem):
    return mem.recr if isinstance(mem, llamax.HybridMemory) else mem


def rows(mem, seq):
    """Every layer's conv and ssm rows of seq's cell (copies)."""
    r = _recr(mem)
    cell = [i for i, (_, s) in enumerate(r.cells()) if seq in s]
    assert len(cell) == 1
    return [a[cell[0]].copy() for a in r.conv + r.ssm]


def same(a, b):
    return len(a) == len(b) and all(np.array_equal(x, y) for x, y in zip(a, b))


def reference(model, prompts, kept, nxt=5, n_seq_max=1):
    """A context that decoded each sequence's prompt, then only its kept tokens (one batch each); its
    rows per sequence and the logits of the next token nxt of each."""
    ctx = Context(model, n_ctx=512, n_seq_max=n_seq_max, n_threads=2)
    for s, p in enumerate(prompts):
        ctx.decode(Batch(p, seq_ids=s))
    for s, k in enumerate(kept):
        if k:
            ctx.decode(Batch(k, seq_ids=s))
    want = [rows(ctx.memory, s) for s in range(len(prompts))]
    logits = []
    for s in range(len(prompts)):
        ctx.decode(Batch([nxt], seq_ids=s, logits=[True]))
        logits.append(ctx.get_logits().copy())
    return want, logits


def verified(model, prompts, drafts, n=len(DRAFT), n_seq_max=1):
    """A context with rollback reserved (n) that decoded the prompts, then every sequence's
    verification batch in one decode (the sequences side by side in one ubatch)."""
    ctx = Context(model, n_ctx=512, n_seq_max=n_seq_max, n_threads=2)
    ctx.memory.reserve_rollback(n)
    for s, p in enumerate(prompts):
        ctx.decode(Batch(p, seq_ids=s))
    toks = [t for d in drafts for t in d]
    ctx.decode(Batch(toks, seq_ids=[s for s, d in enumerate(drafts) for _ in d], logits=[True] * len(toks)))
    return ctx


@pytest.mark.parametrize("kept", range(1, len(DRAFT)))
def test_a_rejected_tail_rolls_back_to_the_states_and_logits_of_the_kept_tokens(mamba, kept):
    prompt = mamba.tokenize(TEXT)
    n = len(prompt)
    ctx = verified(mamba, [prompt], [DRAFT])
    assert ctx.memory.rollback_window(0) == (n, n + K - 1)
    assert ctx.memory.seq_rm(0, n + kept, -1) is True
    assert ctx.memory.seq_pos_max(0) == n + kept - 1
    want, logits = reference(mamba, [prompt], [DRAFT[:kept]])
    assert same(rows(ctx.memory, 0), want[0])
    ctx.decode(Batch([5], seq_ids=0, logits=[True]))
    assert np.array_equal(ctx.get_logits(), logits[0])


def test_a_second_seq_rm_goes_further_back_inside_the_window(mamba):
    prompt = mamba.tokenize(TEXT)
    n = len(prompt)
    ctx = verified(mamba, [prompt], [DRAFT])
    assert ctx.memory.seq_rm(0, n + 4, n + 100) is True          # p1 past pos: a tail too
    assert ctx.memory.rollback_window(0) == (n, n + 2)
    assert ctx.memory.seq_rm(0, n + 2, -1) is True
    assert ctx.memory.rollback_window(0) == (n, n)
    want, logits = reference(mamba, [prompt], [DRAFT[:2]])
    assert same(rows(ctx.memory, 0), want[0])
    assert ctx.memory.seq_rm(0, n + 1, -1) is True
    want, logits = reference(mamba, [prompt], [DRAFT[:1]])
    assert same(rows(ctx.memory, 0), want[0])
    assert ctx.memory.rollback_window(0) == (-1, -1)
    ctx.decode(Batch([5], seq_ids=0, logits=[True]))
    assert np.array_equal(ctx.get_logits(), logits[0])


def test_two_sequences_verified_side_by_side_roll_back_each_alone(mamba):
    a, b = mamba.tokenize(TEXT), mamba.tokenize(OTHER)
    db = [9, 8, 7, 6, 5]
    ctx = verified(mamba, [a, b], [DRAFT, db], n_seq_max=2)
    untouched = rows(ctx.memory, 1)
    assert ctx.memory.seq_rm(0, len(a) + 2, -1) is True
    assert same(rows(ctx.memory, 1), untouched)                   # the other sequence is left as it was
    assert ctx.memory.seq_rm(1, len(b) + 4, -1) is True
    want, logits = reference(mamba, [a, b], [DRAFT[:2], db[:4]], n_seq_max=2)
    assert same(rows(ctx.memory, 0), want[0]) and same(rows(ctx.memory, 1), want[1])
    for s in (0, 1):
        ctx.decode(Batch([5], seq_ids=s, logits=[True]))
        assert np.array_equal(ctx.get_logits(), logits[s])


def test_sequences_of_different_lengths_split_into_ubatches_keep_one_window_each(mamba):
    """[last] + 4 drafts for sequence 0 beside [last] + 2 for sequence 1: the equal split cuts sequence
    0 into two ubatches (3 + 2 tokens), and its window spans both."""
    a, b = mamba.tokenize(TEXT), mamba.tokenize(OTHER)
    db = [9, 8, 7]
    ctx = verified(mamba, [a, b], [DRAFT, db], n_seq_max=2)
    assert ctx.memory.rollback_window(0) == (len(a), len(a) + K - 1)
    assert ctx.memory.rollback_window(1) == (len(b) - 2, len(b) + 1)      # the prompt's last two too
    assert ctx.memory.seq_rm(0, len(a) + 1, -1) is True and ctx.memory.seq_rm(1, len(b) + 2, -1) is True
    want, logits = reference(mamba, [a, b], [DRAFT[:1], db[:2]], n_seq_max=2)
    assert same(rows(ctx.memory, 0), want[0]) and same(rows(ctx.memory, 1), want[1])
    for s in (0, 1):
        ctx.decode(Batch([5], seq_ids=s, logits=[True]))
        assert np.array_equal(ctx.get_logits(), logits[s])


def test_the_window_runs_across_decodes_up_to_n_positions(mamba):
    """Token-by-token decodes fill the ring: the last n - 1 of them can be taken back."""
    prompt = mamba.tokenize(TEXT)
    n = len(prompt)
    ctx = Context(mamba, n_ctx=512, n_threads=2)
    ctx.memory.reserve_rollback(4)
    ctx.decode(Batch(prompt[:1]))
    assert ctx.memory.rollback_window(0) == (-1, -1)
    for t in prompt[1:] + DRAFT:
        ctx.decode(Batch([t]))
    assert ctx.memory.rollback_window(0) == (n + K - 3, n + K - 1)
    assert ctx.memory.seq_rm(0, n + K - 2, -1) is True
    want, logits = reference(mamba, [prompt], [DRAFT[:K - 2]])
    assert same(rows(ctx.memory, 0), want[0])
    ctx.decode(Batch([5], logits=[True]))
    assert np.array_equal(ctx.get_logits(), logits[0])


def test_outside_the_window_or_without_reserve_seq_rm_refuses_with_nothing_changed(mamba):
    prompt = mamba.tokenize(TEXT)
    n = len(prompt)
    ctx = verified(mamba, [prompt], [DRAFT])
    before = ctx.state_get_data()
    assert ctx.memory.seq_rm(0, n, -1) is False                   # the state after n - 1 is not kept
    assert ctx.memory.seq_rm(0, 3, -1) is False
    assert ctx.memory.seq_rm(0, n + 2, n + 4) is False            # not a tail
    assert ctx.memory.seq_rm(-1, n + 2, -1) is False              # every sequence: unchanged rule
    assert ctx.state_get_data() == before and ctx.memory.rollback_window(0) == (n, n + K - 1)
    assert ctx.memory.seq_rm(0, n + K + 1, -1) is True and ctx.state_get_data() == before   # after pos: nothing

    plain = Context(mamba, n_ctx=512, n_threads=2)
    plain.decode(Batch(prompt))
    plain.decode(Batch(DRAFT))
    before = plain.state_get_data()
    assert plain.memory.breakdown()["rollback"] == 0
    assert plain.memory.seq_rm(0, n + 2, -1) is False and plain.state_get_data() == before


def test_reserve_rollback_sizes_grows_and_refuses_bad_n(mamba):
    ctx = Context(mamba, n_ctx=512, n_seq_max=3, n_threads=2)
    mem = ctx.memory
    per = 3 * 4 * 4 * (128 * 3 + 128 * 16)     # cells * layers * float32 * (r + s)
    mem.reserve_rollback(0)
    mem.reserve_rollback(1)                     # n - 1 = 0 positions to take back: nothing kept
    assert mem.breakdown()["rollback"] == 0 and mem.n_rollback == 0
    mem.reserve_rollback(4)
    assert mem.breakdown()["rollback"] == 4 * per and mem.conv_hist[0].shape == (3, 4, 128, 3)
    mem.reserve_rollback(2)
    mem.reserve_rollback(4)
    assert mem.breakdown()["rollback"] == 4 * per
    for bad, err in ((-1, ValueError), ("3", TypeError), (2.0, TypeError)):
        with pytest.raises(err):
            mem.reserve_rollback(bad)
    assert mem.n_rollback == 4
    prompt = mamba.tokenize(TEXT)
    n = len(prompt)
    ctx.decode(Batch(prompt))
    ctx.decode(Batch(DRAFT[:3]))                # the window n - 1 .. n + 2 wraps around the ring of 4
    assert mem.rollback_window(0) == (n - 1, n + 1)
    plan = mem.plan(Batch([5]))
    mem.reserve_rollback(6)                     # grows: the windows kept, a plan made before refuses
    assert mem.breakdown()["rollback"] == 6 * per and mem.rollback_window(0) == (n - 1, n + 1)
    with pytest.raises(StalePlanError):
        plan.apply(0)
    plan.close()
    assert mem.seq_rm(0, n + 1, -1) is True
    want, _ = reference(mamba, [prompt], [DRAFT[:1]])
    assert same(rows(mem, 0), want[0])
    assert mem.seq_rm(0, n, -1) is True         # back to the state after the prompt
    want, logits = reference(mamba, [prompt], [[]])
    assert same(rows(mem, 0), want[0])
    ctx.decode(Batch([5], logits=[True]))
    assert np.array_equal(ctx.get_logits(), logits[0])


def test_a_kv_cache_reserves_nothing_but_checks_n():
    kv = KVCache(1, 2, 8, 32)
    kv.reserve_rollback(5)
    assert set(kv.breakdown()) == {"k", "v"}
    with pytest.raises(ValueError):
        kv.reserve_rollback(-1)


def test_every_other_change_of_a_cell_keeps_its_window_consistent(mamba, monkeypatch):
    prompt = mamba.tokenize(TEXT)
    n = len(prompt)

    ctx = verified(mamba, [prompt], [DRAFT], n_seq_max=2)        # seq_cp: the copy has no window
    ctx.memory.seq_cp(0, 1)
    assert ctx.memory.rollback_window(1) == (-1, -1) and ctx.memory.seq_rm(1, n + 2, -1) is False
    assert ctx.memory.seq_rm(0, n + 2, -1) is True

    ctx = verified(mamba, [prompt], [DRAFT])                    # seq_add moves the window with the pos
    ctx.memory.seq_add(0, 0, -1, 10)
    assert ctx.memory.rollback_window(0) == (n + 10, n + 10 + K - 1)
    assert ctx.memory.seq_rm(0, n + 10 + 3, -1) is True and ctx.memory.seq_pos_max(0) == n + 12
    want, _ = reference(mamba, [prompt], [DRAFT[:3]])
    assert same(rows(ctx.memory, 0), want[0])
    ctx.memory.seq_add(0, n + 11, -1, -2)                       # a range that takes part of it: dropped
    assert ctx.memory.rollback_window(0) == (-1, -1) and ctx.memory.seq_pos_max(0) == n + 10

    ctx = verified(mamba, [prompt], [DRAFT])
    ctx.memory.seq_add(0, n + 100, -1, 3)                        # a range past it: kept
    assert ctx.memory.rollback_window(0) == (n, n + K - 1)
    ctx.memory.seq_div(0, 0, -1, 2)
    assert ctx.memory.rollback_window(0) == (-1, -1)

    for change in (lambda c: c.memory.clear(), lambda c: c.memory.clear(data=False),
                   lambda c: c.state_seq_set_data(c.state_seq_get_data(0), 0),
                   lambda c: c.state_set_data(c.state_get_data())):
        ctx = verified(mamba, [prompt], [DRAFT])
        change(ctx)
        assert ctx.memory.rollback_window(0) == (-1, -1)
        if ctx.memory.seq_pos_max(0) >= 0:
            assert ctx.memory.seq_rm(0, n + 2, -1) is False

    ctx = verified(mamba, [prompt], [DRAFT])                    # a new ubatch: the window goes on
    ctx.decode(Batch([5, 6]))
    assert ctx.memory.rollback_window(0) == (n + 2, n + K + 1)
    assert ctx.memory.seq_rm(0, n + 2, -1) is False

    ctx = verified(mamba, [prompt], [DRAFT], n_seq_max=2)        # a failed batch: its cells' windows dropped
    ctx.decode(Batch(DRAFT, seq_ids=1))
    before = ctx.memory.cells(), rows(ctx.memory, 0) + rows(ctx.memory, 1)
    calls: list = []
    fail_forward_at(monkeypatch, mamba, 1, calls)
    with pytest.raises(RuntimeError):
        ctx.decode(Batch([5, 6, 7], seq_ids=0))
    monkeypatch.undo()
    assert ctx.memory.cells() == before[0] and same(rows(ctx.memory, 0) + rows(ctx.memory, 1), before[1])
    assert ctx.memory.rollback_window(0) == (-1, -1) and ctx.memory.seq_rm(0, n + 2, -1) is False
    assert ctx.memory.rollback_window(1) == (0, K - 1)            # the other sequence kept its window


def test_a_longer_ubatch_keeps_its_last_n_positions(mamba):
    """A ubatch of more tokens than reserved keeps only the last n (n - 1 removable)."""
    prompt = mamba.tokenize(TEXT)
    n = len(prompt)
    ctx = Context(mamba, n_ctx=512, n_threads=2)
    ctx.memory.reserve_rollback(3)
    ctx.decode(Batch(prompt + DRAFT))
    assert ctx.memory.rollback_window(0) == (n + K - 2, n + K - 1)
    assert ctx.memory.seq_rm(0, n + K - 2, -1) is False
    assert ctx.memory.seq_rm(0, n + K - 1, -1) is True
    want, _ = reference(mamba, [prompt], [DRAFT[:K - 1]])
    assert same(rows(ctx.memory, 0), want[0])


@pytest.mark.parametrize("kept", [1, 3])
def test_jamba_cuts_the_kv_tail_and_rolls_the_state_back(jamba, kept):
    prompt = jamba.tokenize(TEXT)
    n = len(prompt)
    ctx = verified(jamba, [prompt], [DRAFT])
    mem = ctx.memory
    assert mem.breakdown()["rollback"] > 0
    before = ctx.state_get_data()
    assert mem.seq_rm(0, n - 1, -1) is False                     # outside the window: neither changes
    assert mem.attn.n_used == n + K + 1 and ctx.state_get_data() == before
    assert mem.seq_rm(0, n + kept, -1) is True
    assert mem.attn.seq_pos_max(0) == n + kept - 1 and mem.recr.seq_pos_max(0) == n + kept - 1
    assert mem.attn.n_used == n + kept
    want, logits = reference(jamba, [prompt], [DRAFT[:kept]])
    assert same(rows(mem, 0), want[0])
    ctx.decode(Batch([5], seq_ids=0, logits=[True]))
    assert np.array_equal(ctx.get_logits(), logits[0])


def test_jamba_two_sequences_side_by_side(jamba):
    a, b = jamba.tokenize(TEXT), jamba.tokenize(OTHER)
    db = [9, 8, 7, 6, 5]
    ctx = verified(jamba, [a, b], [DRAFT, db], n_seq_max=2)
    assert ctx.memory.seq_rm(1, len(b) + 1, -1) is True
    assert ctx.memory.seq_pos_max(0) == len(a) + K
    assert ctx.memory.seq_rm(0, len(a) + 3, -1) is True
    want, logits = reference(jamba, [a, b], [DRAFT[:3], db[:1]], n_seq_max=2)
    assert same(rows(ctx.memory, 0), want[0]) and same(rows(ctx.memory, 1), want[1])
    for s in (0, 1):
        ctx.decode(Batch([5], seq_ids=s, logits=[True]))
        assert np.array_equal(ctx.get_logits(), logits[s])


def test_a_standalone_recurrent_memory_forwards_its_windows_through_the_view():
    """The view carries the rollback rows only once reserved (the layers write them)."""
    mem = RecurrentMemory(2, (8, 3), (8, 16), n_seq_max=2)
    with mem.plan(Batch([1, 2, 3])) as plan:
        for ub in plan:
            v = mem.recurrent_view(0, ub)
            assert v.conv_hist is None and v.ssm_hist is None
    mem.reserve_rollback(2)
    with mem.plan(Batch([4, 5, 6])) as plan:
        for ub in plan:
            v = mem.recurrent_view(1, ub)
            assert v.conv_hist is mem.conv_hist[1] and v.ssm_hist.shape == (2, 2, 8, 16)
    assert mem.rollback_window(0) == (4, 4)


# ---- a state machine: the memory with the real kernels against replaying each sequence's tokens ----
from hypothesis import HealthCheck, event, settings                             # noqa: E402
from hypothesis import strategies as st                                         # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule          # noqa: E402

from llamax._native import ssm                                                  # noqa: E402

D, DS, DC, NH, NSEQ, NTOK = 8, 8, 4, 4, 3, 40
_rng = np.random.default_rng(11)
XZ = _rng.standard_normal((NTOK, 2 * D)).astype(np.float32)          # each token's inputs of the two steps
DT = _rng.standard_normal((NTOK, D)).astype(np.float32)
BC = _rng.standard_normal((NTOK, 2 * DS)).astype(np.float32)
W = (_rng.standard_normal((D, DC)) * 0.5).astype(np.float32)
A = -np.exp(_rng.standard_normal((D, DS))).astype(np.float32)
DD = _rng.standard_normal(D).astype(np.float32)


def _steps(conv, ssm_state, cells, toks, n_t, conv_hist=None, ssm_hist=None, hist_row=None):
    """A Mamba mixer's two native steps over tokens toks (sequence s at s * n_t), inputs from the tables."""
    toks = np.asarray(toks)
    o = ssm.conv(conv, cells, XZ[toks, :D], W, None, n_t, n_threads=1, hist=conv_hist, hist_row=hist_row)
    ssm.scan(ssm_state, cells, o, DT[toks], A, np.ascontiguousarray(BC[toks, :DS]),
             np.ascontiguousarray(BC[toks, DS:]), DD, np.ascontiguousarray(XZ[toks, D:]), n_t, n_threads=1,
             hist=ssm_hist, hist_row=hist_row)


def _replay(toks):
    """The states a fresh cell holds after toks (one ubatch: any split gives the same bits)."""
    conv, s = np.zeros((1, D, DC - 1), np.float32), np.zeros((1, D, DS), np.float32)
    _steps(conv, s, np.zeros(1, np.int32), toks, len(toks))
    return conv[0], s[0]


class RollbackMachine(RuleBasedStateMachine):
    """Each sequence: its tokens, the position of its first (off) and its rollback window (its first
    position, or None; it ends at the sequence's last); seq_rm's answer and the states after it
    predicted from them."""

    def __init__(self):
        super().__init__()
        self.mem = RecurrentMemory(1, (D, DC - 1), (D, DS), n_seq_max=NSEQ)
        self.nh = NH
        self.mem.reserve_rollback(NH)
        self.toks = {s: [] for s in range(NSEQ)}
        self.off = {s: 0 for s in range(NSEQ)}
        self.win: dict[int, int | None] = {s: None for s in range(NSEQ)}

    def _pos(self, s):
        return self.off[s] + len(self.toks[s]) - 1

    @rule(seqs=st.sets(st.integers(0, NSEQ - 1), min_size=1), n_t=st.integers(1, 6),
          data=st.data())
    def decode(self, seqs, n_t, data):
        seqs = sorted(seqs)
        new = {s: data.draw(st.lists(st.integers(0, NTOK - 1), min_size=n_t, max_size=n_t)) for s in seqs}
        plan = self.mem.plan(Batch([t for s in seqs for t in new[s]], seq_ids=[s for s in seqs for _ in new[s]]))
        for ub in plan:
            v = self.mem.recurrent_view(0, ub)
            _steps(v.conv, v.ssm, v.cells, ub.token, ub.n_seq_tokens, v.conv_hist, v.ssm_hist, v.hist_row)
        for s in seqs:
            if not self.toks[s]:
                self.off[s] = 0
            self.toks[s] += new[s]
            w = self.win[s]                                           # the window goes on, up to NH positions
            self.win[s] = self._pos(s) - min(n_t, self.nh) + 1 if w is None else max(w, self._pos(s) - self.nh + 1)

    @rule(s=st.integers(0, NSEQ - 1), p0=st.integers(-1, 30), p1=st.sampled_from([-1, 100, 5, 12]))
    def seq_rm(self, s, p0, p1):
        got = self.mem.seq_rm(s, p0, p1)
        if not self.toks[s]:
            assert got is True
            return
        pos, lo, hi = self._pos(s), max(p0, 0), (p1 if p1 >= 0 else 2**31)
        want = True
        if 0 < lo <= pos < hi and self.win[s] is not None and self.win[s] <= lo - 1:   # a tail inside the window
            event("rolled back")
            self.toks[s] = self.toks[s][:lo - self.off[s]]
        elif 0 < lo <= pos or 0 < hi <= pos:                      # a part of the state: refused
            event("refused")
            want = False
        elif lo <= pos < hi:                                      # all of it
            self.toks[s], self.win[s] = [], None
        assert got is want, (s, p0, p1, pos, self.win[s])

    @rule(n=st.integers(0, 9))
    def reserve_rollback(self, n):
        """A larger n grows the ring (the windows kept, unrolled), a smaller one changes nothing."""
        self.mem.reserve_rollback(n)
        self.nh = max(self.nh, n)

    @rule(s=st.integers(0, NSEQ - 1), back=st.integers(0, 10), p1=st.sampled_from([-1, 10**6]))
    def seq_rm_tail(self, s, back, p1):
        """A tail near the end of a sequence holding tokens: what a verification's rejected drafts remove."""
        held = [q for q in range(NSEQ) if self.toks[q]]
        if held:
            s = held[s % len(held)]
            self.seq_rm(s, self._pos(s) + 1 - back, p1)

    @rule(src=st.integers(0, NSEQ - 1), dst=st.integers(0, NSEQ - 1))
    def seq_cp(self, src, dst):
        self.mem.seq_cp(src, dst)
        if src != dst:
            self.toks[dst], self.off[dst], self.win[dst] = list(self.toks[src]), self.off[src], None

    @rule(s=st.integers(0, NSEQ - 1), shift=st.integers(-4, 6))
    def seq_add(self, s, shift):
        self.mem.seq_add(s, 0, -1, shift)
        if not self.toks[s] or not shift:
            return
        if self._pos(s) + shift < 0:
            self.toks[s], self.win[s] = [], None
            return
        self.off[s] += shift
        if self.win[s] is not None:
            self.win[s] = self.win[s] + shift if self.win[s] + shift >= 0 else None

    @rule()
    def clear(self):
        self.mem.clear()
        for s in range(NSEQ):
            self.toks[s], self.win[s] = [], None

    @invariant()
    def states_and_windows_match(self):
        cells = self.mem.cells()
        for s in range(NSEQ):
            if not self.toks[s]:
                assert self.mem.seq_pos_max(s) == -1
                continue
            pos = self._pos(s)
            assert self.mem.seq_pos_max(s) == pos
            w = self.win[s]
            assert self.mem.rollback_window(s) == ((w, pos - 1) if w is not None and w < pos else (-1, -1))
            c = [i for i, (_, ss) in enumerate(cells) if s in ss][0]
            conv, st_ = _replay(self.toks[s])
            assert np.array_equal(self.mem.conv[0][c], conv) and np.array_equal(self.mem.ssm[0][c], st_)


TestRollbackMachine = RollbackMachine.TestCase
TestRollbackMachine.settings = settings(max_examples=150, stateful_step_count=30, deadline=None,
                                        suppress_health_check=[HealthCheck.too_slow])
