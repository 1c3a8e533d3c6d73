"""A Hypothesis state machine of the Engine on a real model: submit / cancel / step / clear_cache /
slot erase in any order, on a small cache so that eviction and suspension happen. Invariants after
every rule: every used cell belongs to a live request's slot or to the prefix cache; every leaf of
the prefix cache holds exactly its path's positions, with the path's tokens in the cells; a running
request's sequence holds its tokens; once everything has finished and the cache is cleared, no
cell is used (nothing leaks)."""
import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import llamax

PREFIXES = [[], list(range(300, 340)), list(range(300, 320)) + list(range(500, 530))]


@pytest.fixture(scope="module")
def smollm2(model):
    return model


def seq_cells(mem, seq):
    """{pos: token} of seq's cells (one stream)."""
    c = mem.meta.streams[0]
    bits = c.seq_view()
    idx = np.flatnonzero(((bits[:, seq >> 6] >> np.uint64(seq & 63)) & np.uint64(1)).astype(bool))
    st_ = c.snapshot(idx)
    out = {}
    for p, t in zip(st_["pos"].tolist(), st_["tok"].tolist()):
        assert p not in out, f"seq {seq} holds position {p} twice"
        out[p] = t
    return out


def test_engine_state_machine(smollm2):
    class EngineMachine(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.eng = llamax.Engine(smollm2, n_ctx=256, n_parallel=3, n_batch=64, max_queue=4)
            self.reqs = []

        @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(1000, 1100), min_size=1, max_size=30),
              n=st.integers(0, 40))
        def submit(self, prefix, tail, n):
            try:
                self.reqs.append(self.eng.submit(prefix + tail, max_tokens=n, temperature=0))
            except llamax.EngineFullError:
                assert self.eng.metrics()["queue_len"] == 4

        @precondition(lambda self: self.reqs)
        @rule(i=st.integers(0, 1000))
        def cancel(self, i):
            r = self.reqs[i % len(self.reqs)]
            r.cancel()
            assert r.done

        @rule(k=st.integers(1, 6))
        def step(self, k):
            for _ in range(k):
                self.eng.step()

        @rule()
        def clear(self):
            self.eng.clear_cache()

        @invariant()
        def cells_are_owned(self):
            eng, mem = self.eng, self.eng.memory
            live = {s.seq: s for s in eng._slots if s.req is not None}
            tree = set(eng.reuse.seq_ids)
            for pos, seqs in mem.cells():
                if pos >= 0:
                    assert seqs and seqs <= set(live) | tree, (pos, seqs)
            for seq, path in eng.reuse.tree.leaves():
                assert seq_cells(mem, seq) == dict(enumerate(path))
            for seq, s in live.items():
                assert seq_cells(mem, seq) == dict(enumerate(s.seq_state.tokens))

        def teardown(self):
            for r in self.reqs:
                r.cancel()
            assert all(r.done for r in self.reqs)
            self.eng.clear_cache()
            assert self.eng.memory.n_used == 0, "cells leaked"

    EngineMachine.TestCase.settings = settings(max_examples=20, stateful_step_count=30, deadline=None,
                                               suppress_health_check=list(HealthCheck))
    EngineMachine.TestCase().runTest()
