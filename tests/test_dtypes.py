"""llamax.dtypes' sequence bitset (csrc/common.h's lx_seq_bits): seq_mask and has_seq against a Python
reference (a set of ids as one int), and the same layout as the batch's seq_bits and the cells' seq field."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llamax import Batch, KVCache
from llamax.batch import UBatch
from llamax.dtypes import LLAMA_MAX_SEQ, SEQ_WORDS, has_seq, seq_mask

ids = st.integers(0, LLAMA_MAX_SEQ - 1)


def ref_mask(seq_ids) -> list[int]:
    """The reference: the ids as one Python int (bit s = sequence s), cut into 64-bit words."""
    v = 0
    for s in seq_ids:
        v |= 1 << s
    return [(v >> (64 * w)) & (2**64 - 1) for w in range(SEQ_WORDS)]


@settings(max_examples=300, deadline=None)
@given(st.lists(ids, max_size=40), st.sampled_from([list, tuple, set, np.array, iter]))
def test_seq_mask_matches_the_reference(seq_ids, kind):
    m = seq_mask(kind(seq_ids))
    assert m.dtype == np.uint64 and m.shape == (SEQ_WORDS,)
    assert m.tolist() == ref_mask(seq_ids)


@given(ids)
def test_seq_mask_of_one_id(s):
    assert seq_mask(s).tolist() == ref_mask([s]) == seq_mask(np.int32(s)).tolist() == seq_mask([s]).tolist()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.frozensets(ids, max_size=6), min_size=1, max_size=12), ids)
def test_has_seq_matches_the_reference(rows, s):
    bits = np.stack([seq_mask(r) for r in rows])
    assert has_seq(bits, s).tolist() == [s in r for r in rows]


@pytest.mark.parametrize("bad", [-1, LLAMA_MAX_SEQ, [0, LLAMA_MAX_SEQ], range(-1, 2)])
def test_seq_mask_refuses_ids_outside_the_range(bad):
    with pytest.raises(ValueError, match="outside"):
        seq_mask(bad)


def test_seq_mask_of_nothing_is_empty():
    assert seq_mask([]).tolist() == [0] * SEQ_WORDS and seq_mask(range(0)).tolist() == [0] * SEQ_WORDS


@settings(max_examples=100, deadline=None)
@given(st.lists(st.lists(ids, min_size=1, max_size=4, unique=True), min_size=1, max_size=8))
def test_the_layout_of_batch_ubatch_and_cells(seqs):
    """seq_mask is the row Batch.seq_bits holds for a token, UBatch.of_sequence writes, and the
    native cells store (their seq field)."""
    b = Batch(list(range(len(seqs))), seq_ids=seqs)
    for i, r in enumerate(seqs):
        assert b.seq_bits[i].tolist() == seq_mask(r).tolist()
    s = seqs[0][0]
    ub = UBatch.of_sequence(s, np.arange(3, dtype=np.int32), np.zeros(3, np.int32))
    assert (ub.seq_bits == seq_mask(s)).all()
    kv = KVCache(1, 1, 8, 16, n_seq_max=LLAMA_MAX_SEQ)
    for _ in kv.plan(Batch([1, 2], pos=[0, 1], seq_ids=[seqs[0], seqs[0]])):
        pass
    bits = kv.meta.streams[0].seq_view()
    assert bits[:2].tolist() == [seq_mask(seqs[0]).tolist()] * 2
    assert has_seq(bits, s)[:3].tolist() == [True, True, False]
