"""Tests of the KQ mask (csrc/kq_mask.c via llamax._native.kq_mask).

The oracle is a plain-Python construction of llama.cpp's set_input_kq_mask (loops over tokens x
cells). The scalar C reference must equal it, and the fast fill must equal the reference bit for
bit (same bytes: 0.0 vs -0.0 would count), for 1 and 2 threads, with and without the scratch buffer (row reuse, compact columns).
"""
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llamax._native import kq_mask as km
from llamax.dtypes import SEQ_WORDS

# every fast path against its scalar reference, at each SIMD level of this CPU
pytestmark = pytest.mark.usefixtures("every_simd_level")

SEQ_IDS = [0, 1, 2, 63, 64, 100, 255]  # ids in every word of the 256-bit set, and its edges


# ---- plain-Python oracle ---------------------------------------------------------------------

def masked_swa(n_swa: int, swa_type: int, p0: int, p1: int) -> bool:
    """llama_hparams::is_masked_swa."""
    if swa_type == km.SWA_NONE:
        return False
    if swa_type == km.SWA_STANDARD:
        return p1 - p0 >= n_swa
    if swa_type == km.SWA_CHUNKED:
        return p0 < (p1 // n_swa) * n_swa  # positions are >= 0 here, so // is C's /
    if swa_type == km.SWA_SYMMETRIC:
        half = n_swa // 2
        return p1 - p0 < -half or p1 - p0 > half
    raise AssertionError(swa_type)


def oracle(cells, tokens, n_stream, causal, n_swa, swa_type, alibi, n_tps_pad=None):
    """cells: per stream a list of (pos, set of seq ids); tokens: list of (pos, seq) stream-major."""
    n_kv = len(cells[0])
    n_tps = len(tokens) // n_stream
    n_tps_pad = n_tps if n_tps_pad is None else n_tps_pad
    out = np.full((n_stream, n_tps_pad, n_kv), -np.inf, dtype=np.float32)
    for s in range(n_stream):
        for i in range(n_tps):
            p1, q = tokens[s * n_tps + i]
            for j, (p0, seqs) in enumerate(cells[s]):
                if p0 < 0 or q not in seqs:
                    continue
                if causal and p0 > p1:
                    continue
                if masked_swa(n_swa, swa_type, p0, p1):
                    continue
                out[s, i, j] = float(-abs(p0 - p1)) if alibi else 0.0
    return out


def to_arrays(cells, tokens):
    cell_pos, cell_seq = [], []
    for stream in cells:
        pos = np.array([p for p, _ in stream], dtype=np.int32)
        seq = np.zeros((len(stream), 4), dtype=np.uint64)
        for j, (_, seqs) in enumerate(stream):
            for q in seqs:
                seq[j, q // 64] |= np.uint64(1 << (q % 64))
        cell_pos.append(pos)
        cell_seq.append(seq)
    tok_pos = np.array([p for p, _ in tokens], dtype=np.int32)
    tok_seq = np.array([q for _, q in tokens], dtype=np.int32)
    return cell_pos, cell_seq, tok_pos, tok_seq


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def check_all(cells, tokens, n_stream, causal, n_swa, swa_type, alibi):
    args = to_arrays(cells, tokens)
    want = oracle(cells, tokens, n_stream, causal, n_swa, swa_type, alibi)
    ref = km.kq_mask_fill_ref(*args, causal=causal, n_swa=n_swa, swa_type=swa_type, alibi=alibi)
    assert same_bytes(ref, want)
    for n_threads in (1, 2):
        for scratch in (True, False):
            got = km.kq_mask_fill(*args, causal=causal, n_swa=n_swa, swa_type=swa_type, alibi=alibi,
                                  n_threads=n_threads, scratch=scratch)
            assert same_bytes(got, ref), (n_threads, scratch)
    return ref


# ---- strategies ------------------------------------------------------------------------------

cell_st = st.one_of(
    st.just((-1, frozenset())),                                             # empty cell
    st.tuples(st.integers(0, 40), st.frozensets(st.sampled_from(SEQ_IDS), min_size=1, max_size=3)),
)


@st.composite
def ubatches(draw):
    n_stream = draw(st.integers(1, 3))
    n_kv = draw(st.integers(0, 48))
    n_tps = draw(st.integers(1, 8))
    cells = [draw(st.lists(cell_st, min_size=n_kv, max_size=n_kv)) for _ in range(n_stream)]
    # tokens: a few sequences, positions often repeated / consecutive as in real ubatches
    tokens = draw(st.lists(st.tuples(st.integers(0, 48), st.sampled_from(SEQ_IDS)),
                           min_size=n_stream * n_tps, max_size=n_stream * n_tps))
    return cells, tokens, n_stream


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ub=ubatches(), causal=st.booleans(), swa_type=st.integers(0, 3), n_swa=st.integers(1, 20),
       alibi=st.booleans())
def test_matches_python_oracle(ub, causal, swa_type, n_swa, alibi):
    cells, tokens, n_stream = ub
    check_all(cells, tokens, n_stream, causal, n_swa, swa_type, alibi)


@pytest.mark.parametrize("swa_type", [0, 1, 2, 3])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("alibi", [False, True])
@pytest.mark.parametrize("n_stream", [1, 2, 3])
def test_seeded_realistic(swa_type, causal, alibi, n_stream):
    """Cells laid out as a cache would be: per stream a few sequences holding runs of positions,
    shared prefixes (multi-seq cells), holes, and a ubatch whose tokens are already in the cells."""
    rng = np.random.default_rng(1000 * swa_type + 100 * causal + 10 * alibi + n_stream)
    n_kv, n_tps = 96, 12
    cells, tokens = [], []
    for s in range(n_stream):
        stream = [(-1, frozenset())] * n_kv
        seqs = [int(q) for q in rng.choice(SEQ_IDS, size=2, replace=False)]
        prefix = 10
        for j in range(prefix):                       # a prefix shared by both sequences
            stream[j] = (j, frozenset(seqs))
        j = prefix
        for q in seqs:
            for p in range(prefix, prefix + 30):
                if rng.random() < 0.1:
                    j += 1                            # a hole
                stream[j] = (p, frozenset([q]))
                j += 1
        cells.append(stream)
        for i in range(n_tps):                        # the last positions of each sequence
            q = seqs[i % 2]
            tokens.append((prefix + 30 - n_tps // 2 + i // 2, q))
    check_all(cells, tokens, n_stream, causal, 8, swa_type, alibi)


def test_llama_cpp_comment_example():
    """The example in llama.cpp's set_input_kq_mask: 10 cells, 2 in cache, 3 in the batch."""
    cells = [[(p, frozenset([0])) for p in range(5)] + [(-1, frozenset())] * 5]
    tokens = [(2, 0), (3, 0), (4, 0)]
    causal = check_all(cells, tokens, 1, True, 0, 0, False)[0]
    assert [''.join('x' if v == 0 else '-' for v in row) for row in causal] == [
        "xxx-------", "xxxx------", "xxxxx-----"]
    non_causal = check_all(cells, tokens, 1, False, 0, 0, False)[0]
    assert [''.join('x' if v == 0 else '-' for v in row) for row in non_causal] == ["xxxxx-----"] * 3


def test_alibi_values_and_zero_sign():
    cells = [[(p, frozenset([3])) for p in range(6)]]
    tokens = [(5, 3), (2, 3)]
    m = check_all(cells, tokens, 1, True, 0, 0, True)[0]
    assert m[0].tolist() == [-5.0, -4.0, -3.0, -2.0, -1.0, 0.0]
    assert m[1].tolist()[:3] == [-2.0, -1.0, 0.0] and all(math.isinf(v) for v in m[1, 3:])
    assert not np.signbit(m[0, 5]) and not np.signbit(m[1, 2])  # -|0| is +0.0, as in llama.cpp


def test_padding_rows_and_out():
    cells = [[(p, frozenset([0])) for p in range(8)] for _ in range(2)]
    tokens = [(7, 0), (7, 0), (3, 0), (7, 0)]
    args = to_arrays(cells, tokens)
    want = oracle(cells, tokens, 2, True, 0, 0, False, n_tps_pad=5)
    for fill in (km.kq_mask_fill, km.kq_mask_fill_ref):
        out = np.full((2, 5, 8), np.nan, dtype=np.float32)   # 3 padding rows per stream
        res = fill(*args, causal=True, out=out)
        assert res is out
        assert same_bytes(out, want)
        assert np.all(np.isneginf(out[:, 2:]))


def test_pad_function():
    assert km.KQ_MASK_PAD == 1  # newest llama.cpp: GGML_KQ_MASK_PAD removed, no padding
    for n in range(0, 70):
        p = km.kq_mask_n_tps_pad(n)
        assert p >= n and p % km.KQ_MASK_PAD == 0 and p - n < km.KQ_MASK_PAD
    with pytest.raises(ValueError):
        km.kq_mask_n_tps_pad(-1)


def big_case(rng, n_kv, n_tps, n_seq):
    """Arrays of a large cache (vectorised construction, no oracle): n_seq sequences in runs."""
    pos = np.full(n_kv, -1, dtype=np.int32)
    seq = np.zeros((n_kv, 4), dtype=np.uint64)
    used = rng.random(n_kv) < 0.7
    owner = rng.integers(0, n_seq, n_kv)
    pos[used] = rng.integers(0, 3 * n_kv // 4, int(used.sum()))
    for q in range(n_seq):
        sel = used & (owner == q)
        seq[sel, q // 64] |= np.uint64(1 << (q % 64))
    shared = used & (rng.random(n_kv) < 0.1)                 # multi-sequence cells
    seq[shared, 0] |= np.uint64(1)
    tok_seq = np.repeat(np.arange(n_seq, dtype=np.int32), -(-n_tps // n_seq))[:n_tps]
    tok_pos = (3 * n_kv // 4 - n_tps + np.arange(n_tps)).astype(np.int32)
    tok_pos[::7] = tok_pos[::7] - 3                           # repeated / out-of-order positions
    return [pos], [seq], tok_pos, tok_seq


@pytest.mark.parametrize("alibi,swa_type", [(False, 0), (False, 1), (False, 2), (False, 3), (True, 0)])
def test_large_fast_equals_ref_threads(alibi, swa_type):
    """Large enough for OpenMP and for the non-temporal stores (>= 16 MiB), n_kv not a multiple
    of 8 and an output misaligned by 4 bytes, to cover the vector tails."""
    rng = np.random.default_rng(7 + swa_type)
    n_kv, n_tps = 32771, 130
    args = big_case(rng, n_kv, n_tps, 3)
    kw = dict(causal=swa_type != 3, n_swa=512, swa_type=swa_type, alibi=alibi)
    ref = km.kq_mask_fill_ref(*args, **kw)
    assert ref.nbytes >= 16 << 20
    buf = np.empty(ref.size + 1, dtype=np.float32)
    out = buf[1:].reshape(ref.shape)                          # C-contiguous, 4-byte aligned only
    results = []
    for n_threads in (1, 2):
        for scratch in (True, False):
            out.fill(np.nan)
            km.kq_mask_fill(*args, n_threads=n_threads, scratch=scratch, out=out, **kw)
            assert same_bytes(out, ref), (n_threads, scratch)
            results.append(out.tobytes())
    assert len(set(results)) == 1


# ---- errors ----------------------------------------------------------------------------------

def good_args():
    return to_arrays([[(0, frozenset([0])), (1, frozenset([0])), (-1, frozenset())]] * 2,
                     [(1, 0), (0, 0), (1, 0), (1, 0)])


@pytest.mark.parametrize("mutate", [
    lambda a: ([a[0][0].astype(np.int64), a[0][1]], a[1], a[2], a[3]),        # cell_pos dtype
    lambda a: ([a[0][0], a[0][1][:2]], a[1], a[2], a[3]),                     # n_kv differs
    lambda a: ([np.repeat(a[0][0], 2)[::2], a[0][1]], a[1], a[2], a[3]),      # not contiguous
    lambda a: (a[0], [a[1][0][:, :3].copy(), a[1][1]], a[2], a[3]),           # cell_seq shape
    lambda a: (a[0], [a[1][0].astype(np.int64), a[1][1]], a[2], a[3]),        # cell_seq dtype
    lambda a: (a[0], a[1][:1], a[2], a[3]),                                   # stream count mismatch
    lambda a: ([], [], a[2], a[3]),                                           # no stream
    lambda a: (a[0], a[1], a[2][:3], a[3][:3]),                               # n_tokens % n_stream
    lambda a: (a[0], a[1], a[2], a[3][:3]),                                   # tok_seq length
    lambda a: (a[0], a[1], a[2].astype(np.int64), a[3]),                      # tok_pos dtype
    lambda a: (a[0], a[1], a[2], np.array([0, 0, 256, 0], dtype=np.int32)),   # seq id range
    lambda a: (a[0], a[1], np.array([0, -1, 0, 0], dtype=np.int32), a[3]),    # negative position
    lambda a: (a[0], a[1], a[2][:0], a[3][:0]),                               # empty ubatch
])
@pytest.mark.parametrize("fill", [km.kq_mask_fill, km.kq_mask_fill_ref])
def test_bad_inputs_raise(mutate, fill):
    with pytest.raises(ValueError):
        fill(*mutate(good_args()))


@pytest.mark.parametrize("kw", [
    dict(swa_type=1, n_swa=0),
    dict(swa_type=4, n_swa=4),
    dict(out=np.empty((2, 2, 4), np.float32)),           # n_kv mismatch
    dict(out=np.empty((2, 1, 3), np.float32)),           # fewer rows than tokens
    dict(out=np.empty((1, 2, 3), np.float32)),           # stream count
    dict(out=np.empty((2, 2, 3), np.float64)),           # dtype
    dict(out=np.empty((2, 3, 2), np.float32).transpose(0, 2, 1)),  # not contiguous
])
def test_bad_options_raise(kw):
    with pytest.raises(ValueError):
        km.kq_mask_fill(*good_args(), **kw)


def test_bad_n_threads_raise():
    with pytest.raises(ValueError):
        km.kq_mask_fill(*good_args(), n_threads=0)


def test_n_kv_zero():
    args = to_arrays([[]], [(0, 0), (3, 1)])
    for fill in (km.kq_mask_fill, km.kq_mask_fill_ref):
        m = fill(*args)
        assert m.shape == (1, 2, 0) and m.dtype == np.float32


# ---- the column order's question (kv_cache.py's _column_order) --------------------------------

def _in_order_oracle(pos, bits, seqs):
    for s in seqs:
        has = ((bits[:, s >> 6] >> np.uint64(s & 63)) & np.uint64(1)).astype(bool)
        p = pos[has]
        if p.size > 1 and np.any(p[1:] <= p[:-1]):
            return False
    return True


@pytest.mark.parametrize("seed", range(40))
def test_cells_in_order_matches_its_definition(seed):
    """Per sequence, the positions of its cells strictly increase in cell order: a sequence's cells
    as decoding leaves them (in order), shared prefix cells, a swapped pair, a repeated position,
    empty cells between, several words of sequence bits (ids past 63)."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 300))
    ids = [0, 1, 70, 200][: int(rng.integers(1, 5))]
    pos = np.full(n, -1, np.int32)
    bits = np.zeros((n, SEQ_WORDS), np.uint64)
    nxt = {s: 0 for s in ids}
    for j in range(n):
        if rng.random() < 0.2:
            continue                                   # an empty cell
        holders = [s for s in ids if rng.random() < 0.6] or [ids[0]]
        p = max(nxt[s] for s in holders)
        pos[j] = p
        for s in holders:
            bits[j, s >> 6] |= np.uint64(1) << np.uint64(s & 63)
            nxt[s] = p + 1
    if seed % 3 == 1:                                  # two cells swap places
        used = np.flatnonzero(pos >= 0)
        if used.size >= 2:
            a, b = rng.choice(used, 2, replace=False)
            pos[[a, b]], bits[[a, b]] = pos[[b, a]], bits[[b, a]]
    if seed % 3 == 2:                                  # a position repeated
        used = np.flatnonzero(pos >= 0)
        if used.size >= 2:
            pos[used[-1]] = pos[used[-2]]
    seqs = np.array(sorted(ids), np.int32)
    assert km.cells_in_order(pos, bits, seqs) == _in_order_oracle(pos, bits, seqs)
    for s in ids:
        one = np.array([s], np.int32)
        assert km.cells_in_order(pos, bits, one) == _in_order_oracle(pos, bits, one)


def test_cells_in_order_cases_and_refusals():
    bits = np.zeros((4, SEQ_WORDS), np.uint64)
    bits[:, 0] = 1                                     # sequence 0 in every cell
    seq0 = np.array([0], np.int32)
    assert km.cells_in_order(np.array([0, 1, 2, 3], np.int32), bits, seq0)
    assert not km.cells_in_order(np.array([0, 2, 1, 3], np.int32), bits, seq0)
    assert not km.cells_in_order(np.array([0, 1, 1, 3], np.int32), bits, seq0)
    assert km.cells_in_order(np.array([0, 2, 1, 3], np.int32), bits, np.array([5], np.int32))   # not held
    with pytest.raises(ValueError, match="cell_seq"):
        km.cells_in_order(np.zeros(4, np.int32), bits[:3], seq0)
    with pytest.raises(ValueError, match="cell_pos"):
        km.cells_in_order(np.zeros(4, np.int64), bits, seq0)
    with pytest.raises(ValueError, match="sequence ids"):
        km.cells_in_order(np.zeros(4, np.int32), bits, np.array([256], np.int32))
