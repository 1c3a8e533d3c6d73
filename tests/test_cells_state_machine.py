"""Random batches and seq_* operations through the native cells (C) and the pure-Python reference
(tests/reference) side by side: unified and split streams, every SWA type. After every step the
positions, sequence sets, shifts, heads, slot choices and seq_pos_min/max must agree.

Two drivers share one `Pair`: a Hypothesis state machine (shrinks failures) and a seeded random
walk of thousands of steps per configuration (reaches full caches, wraps and SWA reuse)."""
import random

import numpy as np
import pytest
from helpers import ubatch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from llamax._native.cells import KVCells
from reference.kv_cells_ref import RefKVCells, split_equal, split_simple

SWA_CONFIGS = [("none", 0), ("standard", 4), ("standard", 9), ("chunked", 8), ("symmetric", 6)]


class Pair:
    """The same KV-cache metadata in C and in the Python reference."""

    def __init__(self, kv_size, n_seq_max, unified, swa_type, n_swa):
        self.n_seq_max, self.unified = n_seq_max, unified
        self.nat = KVCells(kv_size, 1 if unified else n_seq_max, n_seq_max, n_swa, swa_type)
        self.ref = RefKVCells(kv_size, n_seq_max, unified, n_swa, swa_type)
        self.n_placed = 0

    def update(self):
        self.ref.update()
        for c in self.nat.streams:
            c.reset_shift()

    def decode(self, groups, n_per_group, coupled, n_ubatch):
        """groups: sequences starting a run; coupled: an extra sequence per group or None."""
        self.update()
        positions, seq_ids = [], []
        for s, n, other in zip(groups, n_per_group, coupled):
            sset = [s] if other is None or other == s or not self.unified else [s, other]
            p0 = max(self.ref.seq_pos_max(x) for x in sset) + 1
            positions += list(range(p0, p0 + n))
            seq_ids += [sset] * n
        tokens = [(7 * p + 3) % 1000 for p in positions]
        if self.unified:
            rubs = split_simple(positions, seq_ids, n_ubatch, tokens)
        else:
            order = np.argsort([s[0] for s in seq_ids], kind="stable")
            positions = [positions[i] for i in order]
            seq_ids = [seq_ids[i] for i in order]
            tokens = [tokens[i] for i in order]
            rubs = split_equal(positions, seq_ids, n_ubatch, tokens, sequential=True)
        ref_slots = self.ref.prepare(rubs)
        nubs = [ubatch(u.pos, u.seq_ids, u.tokens) for u in rubs]
        nat_slots = self.nat.prepare(nubs)
        assert (ref_slots is None) == (nat_slots is None)
        self.check()  # prepare changed nothing
        if ref_slots is None:
            return
        for rs, (strm, idxs) in zip(ref_slots, nat_slots):
            assert list(rs.strm) == strm.tolist()
            assert [i for part in rs.idxs for i in part] == idxs.tolist()
        for rub, nub, rs, (strm, idxs) in zip(rubs, nubs, ref_slots, nat_slots):
            self.ref.apply_ubatch(rs, rub)
            self.nat.apply_ubatch(nub, strm, idxs)
            self.n_placed += rub.n_tokens

    def find_slot(self, s, n, cont):
        self.update()
        p0 = self.ref.seq_pos_max(s) + 1
        rub = split_simple(list(range(p0, p0 + n)), [[s]] * n, n)[0]
        r = self.ref.find_slot(rub, cont)
        m = self.nat.find_slot(ubatch(rub.pos, rub.seq_ids), cont)
        assert (r is None) == (m is None)
        if r is not None:
            assert [i for part in r.idxs for i in part] == m[1].tolist()

    def seq_cp(self, src, dst, p0, p1):
        errs = []
        for f in (self.ref.seq_cp, self.nat.seq_cp):
            try:
                f(src, dst, p0, p1)
                errs.append(None)
            except ValueError:
                errs.append(ValueError)
        assert errs[0] == errs[1]

    def both(self, name, *args):
        a = getattr(self.ref, name)(*args)
        b = getattr(self.nat, name)(*args)
        if name == "seq_rm":
            assert a == b

    def check(self):
        for stream, c in enumerate(self.nat.streams):
            assert c.cells() == self.ref.cells(stream)
            rc = self.ref.v_cells[stream]
            assert c.shift_view().tolist() == [rc.shift[i] if rc.pos[i] >= 0 else 0 for i in range(c.size)]
            assert c.used == rc.get_used() and c.used_max_p1 == rc.used_max_p1()
            assert int(self.nat.heads[stream]) == self.ref.heads[stream]
        for s in range(self.n_seq_max):
            assert self.nat.seq_pos_min(s) == self.ref.seq_pos_min(s)
            assert self.nat.seq_pos_max(s) == self.ref.seq_pos_max(s)


def random_step(pair: Pair, rng: random.Random) -> None:
    n = pair.n_seq_max
    op = rng.choices(["decode", "find", "rm", "cp", "keep", "add", "div", "clear"],
                     weights=[10, 2, 3, 2, 1, 2, 1, 0.2])[0]
    if op == "decode":
        groups = rng.sample(range(n), rng.randint(1, min(3, n)))
        pair.decode(groups, [rng.randint(1, 12) for _ in groups],
                    [rng.randrange(n) if rng.random() < 0.3 else None for _ in groups], rng.randint(1, 16))
    elif op == "find":
        pair.find_slot(rng.randrange(n), rng.randint(1, 10), rng.random() < 0.5)
    elif op == "rm":
        pair.both("seq_rm", rng.randint(-1, n - 1), rng.randint(-2, 60), rng.randint(-2, 80))
    elif op == "cp":
        full = rng.random() < 0.5
        pair.seq_cp(rng.randrange(n), rng.randrange(n), -1 if full else rng.randint(0, 40),
                    -1 if full else rng.randint(0, 60))
    elif op == "keep":
        pair.both("seq_keep", rng.randrange(n))
    elif op == "add":
        pair.both("seq_add", rng.randrange(n), rng.randint(-1, 40), rng.randint(-1, 60), rng.randint(-20, 20))
    elif op == "div":
        pair.both("seq_div", rng.randrange(n), rng.randint(-1, 40), rng.randint(-1, 60), rng.randint(1, 4))
    else:
        pair.both("clear")
    pair.check()


@pytest.mark.parametrize("unified", [True, False])
@pytest.mark.parametrize("swa", SWA_CONFIGS, ids=[f"{t}{n}" for t, n in SWA_CONFIGS])
def test_random_walk_matches_reference(unified, swa):
    rng = random.Random(hash((unified, swa)) & 0xFFFF)
    placed = 0
    for kv_size, n_seq_max in ((16, 1), (32, 3), (64, 4)):
        pair = Pair(kv_size, n_seq_max, unified, *swa)
        for _ in range(400):
            random_step(pair, rng)
        placed += pair.n_placed
    assert placed > 1000  # the walk really placed tokens (full caches, wraps, reuse)


class CellsMachine(RuleBasedStateMachine):
    @initialize(kv_size=st.sampled_from([8, 16, 33, 64]), n_seq_max=st.integers(1, 4),
                unified=st.booleans(), swa=st.sampled_from(SWA_CONFIGS))
    def setup(self, kv_size, n_seq_max, unified, swa):
        self.pair = Pair(kv_size, n_seq_max, unified, *swa)

    @rule(data=st.data(), n_ubatch=st.integers(1, 16))
    def decode(self, data, n_ubatch):
        n = self.pair.n_seq_max
        groups = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=min(3, n), unique=True))
        sizes = data.draw(st.lists(st.integers(1, 12), min_size=len(groups), max_size=len(groups)))
        coupled = data.draw(st.lists(st.none() | st.integers(0, n - 1), min_size=len(groups), max_size=len(groups)))
        self.pair.decode(groups, sizes, coupled, n_ubatch)

    @rule(data=st.data(), n=st.integers(1, 10), cont=st.booleans())
    def find_slot(self, data, n, cont):
        self.pair.find_slot(data.draw(st.integers(0, self.pair.n_seq_max - 1)), n, cont)

    @rule(data=st.data(), p0=st.integers(-2, 40), p1=st.integers(-2, 60))
    def seq_rm(self, data, p0, p1):
        self.pair.both("seq_rm", data.draw(st.integers(-1, self.pair.n_seq_max - 1)), p0, p1)

    @rule(data=st.data(), p0=st.integers(-1, 30), p1=st.integers(-1, 50))
    def seq_cp(self, data, p0, p1):
        s = st.integers(0, self.pair.n_seq_max - 1)
        self.pair.seq_cp(data.draw(s), data.draw(s), p0, p1)

    @rule(data=st.data())
    def seq_keep(self, data):
        self.pair.both("seq_keep", data.draw(st.integers(0, self.pair.n_seq_max - 1)))

    @rule(data=st.data(), p0=st.integers(-1, 30), p1=st.integers(-1, 50), shift=st.integers(-20, 20))
    def seq_add(self, data, p0, p1, shift):
        self.pair.both("seq_add", data.draw(st.integers(0, self.pair.n_seq_max - 1)), p0, p1, shift)

    @rule(data=st.data(), p0=st.integers(-1, 30), p1=st.integers(-1, 50), d=st.integers(1, 4))
    def seq_div(self, data, p0, p1, d):
        self.pair.both("seq_div", data.draw(st.integers(0, self.pair.n_seq_max - 1)), p0, p1, d)

    @rule()
    def clear(self):
        self.pair.both("clear")

    @invariant()
    def check(self):
        if hasattr(self, "pair"):
            self.pair.check()


TestCellsMachine = CellsMachine.TestCase
TestCellsMachine.settings = settings(max_examples=100, stateful_step_count=50, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
