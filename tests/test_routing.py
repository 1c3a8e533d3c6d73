"""llamax.cluster.routing: the block hashes and the routing Policy (pure Python, no Ray)."""
import pytest

from llamax.cluster.routing import BLOCK, Policy, block_hashes, policy

A, B, C = "a", "b", "c"


def prompt(group, n_blocks=4, tail=0):
    """Tokens of n_blocks full blocks that depend on group only, then tail tokens of their own."""
    return [1000 * (group + 1) + i for i in range(n_blocks * BLOCK)] + [7 + i for i in range(tail)]


def test_block_hashes_chain_over_full_blocks():
    t = prompt(0, 3, tail=BLOCK - 1)
    h = block_hashes(t)
    assert len(h) == 3 and len(set(h)) == 3
    assert block_hashes(t[:2 * BLOCK]) == h[:2]          # a prefix's hashes are the prefix of the hashes
    other = list(t)
    other[0] += 1
    assert not set(block_hashes(other)) & set(h)         # chained: one early token changes every hash
    late = list(t)
    late[2 * BLOCK] += 1
    assert block_hashes(late)[:2] == h[:2] and block_hashes(late)[2] != h[2]
    assert block_hashes(t[:BLOCK - 1]) == []
    assert block_hashes(prompt(0, 40), max_blocks=5) == block_hashes(prompt(0, 5))


def test_the_same_prefix_goes_where_it_went():
    p = Policy()
    first = p.choose([A, B], block_hashes(prompt(0)))
    again = p.choose([A, B], block_hashes(prompt(0, tail=9)))
    assert again.replica == first.replica and again.matched == 4 and again.handover is None
    other = p.choose([A, B], block_hashes(prompt(1)))
    assert other.replica != first.replica and other.matched == 0  # nothing cached: the idle one (in turn)


def test_groups_stay_apart_under_load_within_the_bound():
    p = Policy(load_bound=4)
    where = {}
    for i in range(16):
        g = i % 4
        c = p.choose([A, B], block_hashes(prompt(g, tail=i)))
        p.started(None, c.replica)
        assert where.setdefault(g, c.replica) == c.replica
    assert sorted(where.values()) == [A, A, B, B]


def test_a_hot_prefix_spills_over_the_load_bound_with_a_handover():
    p = Policy(load_bound=2)
    h = block_hashes(prompt(0))
    picks = []
    for _ in range(6):
        c = p.choose([A, B], h)
        p.started(None, c.replica)
        picks.append(c)
    home = picks[0].replica
    spilled = [c for c in picks if c.replica != home]
    assert spilled, "one hot prefix must not take every request"
    assert spilled[0].handover == home and spilled[0].handover_matched == 4
    assert max(p.load(A), p.load(B)) - min(p.load(A), p.load(B)) <= 2 + 1
    for c in picks:
        p.ended(c.replica)
    assert p.load(A) == p.load(B) == 0


def test_draining_and_dead_replicas():
    p = Policy()
    p.set_replicas([A, B, C])
    h = block_hashes(prompt(0))
    home = p.choose([A, B, C], h).replica
    p.drain(home)
    c = p.choose([A, B, C], h)
    assert c.replica != home and c.handover == home            # the conversation moves with its cache
    assert p.choose([A, B, C], h).replica == c.replica          # and stays where it moved
    p.drain(home, False)
    p.dead(c.replica)
    assert c.replica not in p.replicas()
    assert all(p.choose([A, B, C], h).replica != c.replica for _ in range(5))
    p.set_replicas([A, B])                                      # Ray's list: the dead one may linger
    assert p.replicas() == [r for r in (A, B) if r != c.replica]
    assert p.choose([c.replica], h) is None and p.choose([], h) is None


def test_round_robin_ignores_prefixes():
    p = Policy("round_robin")
    h = block_hashes(prompt(0))
    assert [p.choose([A, B], h).replica for _ in range(4)] == [A, B, A, B]
    p.drain(A)
    assert {p.choose([A, B], h).replica for _ in range(3)} == {B}


def test_the_table_is_bounded():
    p = Policy(table_size=8)
    for g in range(10):
        p.choose([A, B], block_hashes(prompt(g)))
    assert len(p._table) == 8
    assert p.choose([A, B], block_hashes(prompt(0))).matched == 0  # the oldest is forgotten


def test_bad_settings_and_the_registry():
    with pytest.raises(ValueError, match="routing"):
        Policy("random")
    with pytest.raises(ValueError, match="load_bound"):
        Policy(load_bound=-1)
    assert policy("t-deploy") is policy("t-deploy", "round_robin")
    assert policy("t-deploy").routing == "round_robin"
    with pytest.raises(ValueError):
        policy("t-deploy", "nope")
