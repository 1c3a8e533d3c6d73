"""Batch invariance of attention (issue 10, item 4; csrc/attention.h, LX_ATTN_CHUNK).

A token's output must be bit-identical whatever else is in the cache or the call: the chunks are
cut on the token's visible cells (chunk c = visible cells number [c*256, (c+1)*256) of its mask
row, in cell order), so only the sequence of visible cells (their K/V and mask values in order)
may matter -- not hidden cells, not where the cells sit, not n_kv, not the other query tokens of
the call, not n_threads, not whether a scratch is passed. Checked at every SIMD level of this CPU:

  (a) the sequence's cells contiguous from cell 0 (the reference placement),
  (b) interleaved with another sequence's cells (hidden from it by the mask),
  (c) with holes (empty cells of garbage / NaN, also above the last used cell, inside n_kv),
  (d) after a wrap: stored from cell 0 again while the previous lap's cells of another sequence
      fill the rest of the ring (n_kv = kv_size), and placed mid-cache after another sequence,

each with 1 query token, or the same token among 7 tokens of another sequence in one call (the
decode split with its scratch, the per-item path without), for n_threads 1 and 2. Then the same
through KVCache (the scenario that found the bug: one sequence stored alone or beside another).
"""
import numpy as np
import pytest

from llamax import Batch, KVCache
from llamax._native import attention as A
from llamax._native import cpu
from llamax._native import quants as Q

LEVELS = cpu.levels()
L = 700            # the sequence's cells: three chunks, the last one partial
KV_SIZE = 2048
D = 64             # head size (a multiple of 32, for the quantized types)
FLASH_TYPES = [("f32", "f32"), ("f16", "f16"), ("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q8_0", "f16"),
               ("f16", "q4_0")]
VTRANS_TYPES = [("f32", "f32"), ("f16", "f16"), ("q8_0", "f16"), ("q4_0", "f32")]
LAYOUTS = ["interleaved", "holes", "after_wrap", "offset"]


@pytest.fixture(autouse=True)
def every_thread_works():
    """Small problems would otherwise stay on one thread (the kernels' work threshold)."""
    A._set_min_work(1)
    yield
    A._set_min_work(-1)
    cpu.set_simd_level(-1)


# ---- building caches ------------------------------------------------------------------------------

def cache_rows(t, x):
    """float32 [N, Hkv, D] -> N cache rows of type t (quantized: uint8 [N, row_bytes])."""
    if t == "f32":
        return x.astype(np.float32)
    if t == "f16":
        return x.astype(np.float16)
    return Q.quantize(t, np.ascontiguousarray(x.reshape(x.shape[0], -1)))


def garbage_cache(t, shape_rows, n_head_kv, d):
    """kv_size rows that must never be read: NaN (float types) or all-ones bytes (a NaN scale)."""
    n = shape_rows
    if t in ("f32", "f16"):
        return np.full((n, n_head_kv, d), np.nan, dtype=np.float32 if t == "f32" else np.float16)
    return np.full((n, Q.row_bytes(t, n_head_kv * d)), 0xFF, dtype=np.uint8)


def placement(layout, rng):
    """(cells of the sequence's L cells in order, cells of the other sequence, n_kv)."""
    if layout == "contiguous":
        return np.arange(L), np.arange(0), L
    if layout == "interleaved":         # blocks of 1..16 cells of each sequence, alternating
        ours, other, i = [], [], 0
        while len(ours) < L:
            n = int(rng.integers(1, 17))
            ours += list(range(i, i + min(n, L - len(ours))))
            i = ours[-1] + 1
            m = int(rng.integers(1, 17))
            other += list(range(i, i + m))
            i += m
        return np.array(ours), np.array(other), i
    if layout == "holes":               # empty cells between and above (n_kv padded past the last)
        gaps = rng.integers(0, 3, L) * (rng.random(L) < 0.3)
        ours = np.cumsum(gaps + 1) - 1
        return ours, np.arange(0), int(ours[-1]) + 1 + 37
    if layout == "after_wrap":          # from cell 0 again; the previous lap's cells above, up to kv_size
        return np.arange(L), np.arange(L + 50, KV_SIZE), KV_SIZE
    if layout == "offset":              # after another sequence's cells, mid-cache
        return np.arange(900, 900 + L), np.arange(0, 900), 900 + L + 5
    raise AssertionError(layout)


def seq_mask_values(mode, rng):
    """Mask values of the sequence's L cells for its query at position L - 1."""
    pos = np.arange(L)
    if mode == "causal":
        return np.zeros(L, np.float32)
    if mode == "alibi":
        return (-0.01 * (L - 1 - pos)).astype(np.float32)
    if mode == "swa":                   # a window of 300 positions: older cells are hidden
        return np.where(pos > L - 1 - 300, 0.0, -np.inf).astype(np.float32)
    raise AssertionError(mode)


class Case:
    """One sequence's data (K, V rows of each type, its query, its mask values) and another's."""

    def __init__(self, rng, n_head, n_head_kv, mode):
        self.n_head, self.n_head_kv = n_head, n_head_kv
        self.k = rng.uniform(-1, 1, (L, n_head_kv, D)).astype(np.float32)
        self.v = rng.uniform(-1, 1, (L, n_head_kv, D)).astype(np.float32)
        self.k[:, :, 3] *= 6.0
        self.ko = rng.uniform(-1, 1, (KV_SIZE, n_head_kv, D)).astype(np.float32)
        self.vo = rng.uniform(-1, 1, (KV_SIZE, n_head_kv, D)).astype(np.float32)
        self.q = rng.uniform(-1, 1, (n_head, D)).astype(np.float32)
        self.qo = rng.uniform(-1, 1, (8, n_head, D)).astype(np.float32)
        self.mv = seq_mask_values(mode, rng)

    def build(self, layout, tk, tv, v_trans, rng, n_stream=1, stream=0):
        """k, v caches [n_stream, KV_SIZE, ...] with the sequence placed by layout in `stream`; the
        other sequence's rows in its cells, garbage elsewhere. Returns k, v, ours, other, n_kv."""
        ours, other, n_kv = placement(layout, rng)
        k = np.stack([garbage_cache(tk, KV_SIZE, self.n_head_kv, D) for _ in range(n_stream)])
        v = np.stack([garbage_cache(tv, KV_SIZE, self.n_head_kv, D) for _ in range(n_stream)])
        k[stream, ours] = cache_rows(tk, self.k)
        v[stream, ours] = cache_rows(tv, self.v)
        if len(other):
            k[stream, other] = cache_rows(tk, self.ko[:len(other)])
            v[stream, other] = cache_rows(tv, self.vo[:len(other)])
        if v_trans:                     # V^T [n_stream, n_head_kv, d_v, kv_size]
            v = np.ascontiguousarray(v.transpose(0, 2, 3, 1))
        return k, v, ours, other, n_kv

    def mask_row(self, ours, n_kv):
        m = np.full(n_kv, -np.inf, np.float32)
        m[ours] = self.mv
        return m


def attend(case, built, tk, tv, v_trans, softcap, *, batch, n_threads, use_scratch):
    """Our token's output [n_head, D] over built = case.build(...): alone (n_tps 1) or as token 3
    of 8 (the others see the other sequence's cells, or nothing), one mask padding row."""
    k, v, ours, other, n_kv = built
    kw = dict(n_kv=n_kv, scale=0.125, softcap=softcap, v_trans=v_trans, type_k=tk, type_v=tv,
              n_threads=n_threads, use_scratch=use_scratch)
    if not batch:
        mask = case.mask_row(ours, n_kv)[None, None]
        return A.attn(case.q[None], k, v, mask, **kw)[0]
    mask = np.full((1, 9, n_kv), -np.inf, np.float32)
    om = np.full(n_kv, -np.inf, np.float32)
    om[other] = 0.0
    for t in range(8):
        mask[0, t] = om
    mask[0, 3] = case.mask_row(ours, n_kv)
    q = case.qo.copy()
    q[3] = case.q
    return A.attn(q, k, v, mask, **kw)[3]


def check_invariant(case, tk, tv, v_trans, softcap, level):
    cpu.set_simd_level(level)
    builds = {layout: case.build(layout, tk, tv, v_trans, np.random.default_rng(i))
              for i, layout in enumerate(["contiguous"] + LAYOUTS)}
    want = attend(case, builds["contiguous"], tk, tv, v_trans, softcap, batch=False, n_threads=1, use_scratch=True)
    # the reference placement is within the error budget of the oracle
    k, v, ours, _, n_kv = builds["contiguous"]
    ref = A.attn_ref(case.q[None], k, v, case.mask_row(ours, n_kv)[None, None], n_kv=n_kv, scale=0.125,
                     softcap=softcap, v_trans=v_trans, type_k=tk, type_v=tv)[0]
    assert np.abs(want - ref).max() <= A.MAX_ERR * max(1.0, float(np.abs(case.v).max()))
    assert np.isfinite(want).all()
    for layout, built in builds.items():
        for batch in (False, True):
            for nt in (1, 2):
                for use_scratch in (True, False):
                    got = attend(case, built, tk, tv, v_trans, softcap, batch=batch, n_threads=nt,
                                 use_scratch=use_scratch)
                    assert np.array_equal(got, want), (layout, batch, nt, use_scratch,
                                                       float(np.abs(got - want).max()))


MODES = [("causal", 0.0), ("alibi", 1.5), ("swa", 0.0), ("swa", 1.5)]


@pytest.mark.parametrize("level", LEVELS, ids=lambda lv: cpu.LEVEL_NAMES[lv])
@pytest.mark.parametrize("mode,softcap", MODES, ids=lambda x: str(x))
@pytest.mark.parametrize("n_head,n_head_kv", [(6, 2), (12, 1)], ids=["gqa3", "gqa12"])
@pytest.mark.parametrize("tk,tv", FLASH_TYPES, ids=lambda t: str(t))
def test_flash_placement_invariant(level, mode, softcap, n_head, n_head_kv, tk, tv):
    case = Case(np.random.default_rng(hash((mode, n_head, tk, tv)) & 0xFFFF), n_head, n_head_kv, mode)
    check_invariant(case, tk, tv, False, softcap, level)


@pytest.mark.parametrize("level", LEVELS, ids=lambda lv: cpu.LEVEL_NAMES[lv])
@pytest.mark.parametrize("mode,softcap", MODES, ids=lambda x: str(x))
@pytest.mark.parametrize("n_head,n_head_kv", [(6, 2), (12, 1)], ids=["gqa3", "gqa12"])
@pytest.mark.parametrize("tk,tv", VTRANS_TYPES, ids=lambda t: str(t))
def test_vtrans_placement_invariant(level, mode, softcap, n_head, n_head_kv, tk, tv):
    case = Case(np.random.default_rng(hash((mode, n_head, tk, tv, 1)) & 0xFFFF), n_head, n_head_kv, mode)
    check_invariant(case, tk, tv, True, softcap, level)


@pytest.mark.parametrize("level", LEVELS, ids=lambda lv: cpu.LEVEL_NAMES[lv])
@pytest.mark.parametrize("v_trans", [False, True], ids=["flash", "vtrans"])
def test_stream_and_other_streams_do_not_matter(level, v_trans):
    """The sequence in stream 1 of 2 (the other stream full of another sequence's tokens and cells)
    gives the bits of the single-stream call."""
    cpu.set_simd_level(level)
    rng = np.random.default_rng(21)
    case = Case(rng, 6, 2, "causal")
    built = case.build("contiguous", "f16", "f16", v_trans, np.random.default_rng(0))
    want = attend(case, built, "f16", "f16", v_trans, 0.0, batch=False, n_threads=1, use_scratch=True)
    for layout in ["contiguous", "interleaved"]:
        k, v, ours, other, n_kv = case.build(layout, "f16", "f16", v_trans, np.random.default_rng(5),
                                             n_stream=2, stream=1)
        k0, v0, *_ = case.build("offset", "f16", "f16", v_trans, np.random.default_rng(5))
        k[0] = k0[0]
        v[0] = v0[0]
        mask = np.full((2, 3, n_kv), -np.inf, np.float32)
        mask[0, :, :min(n_kv, 900)] = 0.0
        mask[1, 0] = case.mask_row(ours, n_kv)
        mask[1, 1, other] = 0.0
        q = np.stack([case.qo[0], case.qo[1], case.q, case.qo[2]])
        for nt in (1, 2):
            for use_scratch in (True, False):
                got = A.attn(q, k, v, mask, n_kv=n_kv, scale=0.125, v_trans=v_trans, n_threads=nt,
                             use_scratch=use_scratch)
                assert np.array_equal(got[2], want), (layout, nt, use_scratch)


def test_empty_chunks_are_skipped():
    """A row whose 700 visible cells are the last of 5000: its cells fill chunks 0-2 of the 20 the
    call allows, the other 17 are empty (not computed by the split, never merged)."""
    rng = np.random.default_rng(8)
    case = Case(rng, 6, 2, "causal")
    built = case.build("contiguous", "f16", "f16", False, np.random.default_rng(0))
    want = attend(case, built, "f16", "f16", False, 0.0, batch=False, n_threads=1, use_scratch=True)
    k = np.full((1, 5000, 2, D), np.nan, np.float16)
    v = k.copy()
    k[0, 4300:] = case.k.astype(np.float16)
    v[0, 4300:] = case.v.astype(np.float16)
    mask = np.full((1, 1, 5000), -np.inf, np.float32)
    mask[0, 0, 4300:] = 0.0
    for nt in (1, 2):
        for use_scratch in (True, False):
            got = A.attn(case.q[None], k, v, mask, n_kv=5000, scale=0.125, n_threads=nt, use_scratch=use_scratch)
            assert np.array_equal(got[0], want)


# ---- through KVCache ---------------------------------------------------------------------------

def kv_scenario(interleave, chunk, *, type_k="f16", type_v="f16", v_trans=False, n_swa=0, with_other_query=False):
    """One sequence's N rows stored alone or beside another sequence's rows (same relative order),
    in ubatches of `chunk` tokens; then the output of its query at position N (alone, or in one
    ubatch with the other sequence's query)."""
    rng = np.random.default_rng(0)
    n = 700
    K = rng.standard_normal((n + 1, 2, 64)).astype(np.float32)
    V = rng.standard_normal((n + 1, 2, 64)).astype(np.float32)
    Qr = rng.standard_normal((2, 6, 64)).astype(np.float32)
    swa = dict(n_swa=n_swa, swa_type="standard") if n_swa else {}
    kv = KVCache(1, 2, 64, 2048, n_seq_max=2, type_k=type_k, type_v=type_v, v_trans=v_trans, **swa)
    p = 0
    while p < n:
        m = min(chunk, n - p)
        toks, seqs, pos = list(range(m)), [0] * m, list(range(p, p + m))
        if interleave:
            toks, seqs, pos = toks + toks, seqs + [1] * m, pos + pos
        for ub in kv.plan(Batch(toks, pos=pos, seq_ids=seqs, logits=[False] * len(toks))):
            ours = ub.seq_id == 0
            k = np.where(ours[:, None, None], K[ub.pos], 0.5 * K[ub.pos]).astype(np.float32)
            v = np.where(ours[:, None, None], V[ub.pos], 0.5 * V[ub.pos]).astype(np.float32)
            kv.store(0, ub, k, v)
        p += m
    if with_other_query:
        b = Batch([0, 0], pos=[n, n], seq_ids=[1, 0])
    else:
        b = Batch([0], pos=[n], seq_ids=[0])
    for ub in kv.plan(b):
        ours = ub.seq_id == 0
        kv.store(0, ub, np.where(ours[:, None, None], K[n], 0.5 * K[n]).astype(np.float32),
                 np.where(ours[:, None, None], V[n], 0.5 * V[n]).astype(np.float32))
        q = np.where(ours[:, None, None], Qr[0], Qr[1]).astype(np.float32)
        return kv.attend(0, ub, q)[int(np.nonzero(ours)[0][0])]


@pytest.mark.parametrize("types", [("f16", "f16", False), ("f16", "f16", True), ("q8_0", "q4_0", False),
                                   ("q4_0", "f32", True)], ids=lambda t: "-".join(map(str, t)))
@pytest.mark.parametrize("n_swa", [0, 300], ids=["full", "swa"])
def test_kv_cache_sequence_alone_or_beside_another(types, n_swa):
    tk, tv, vt = types
    kw = dict(type_k=tk, type_v=tv, v_trans=vt, n_swa=n_swa)
    want = kv_scenario(False, 700, **kw)
    for interleave, chunk, other_q in ((True, 700, False), (False, 7, False), (True, 7, False), (True, 7, True),
                                       (True, 64, True)):
        got = kv_scenario(interleave, chunk, with_other_query=other_q, **kw)
        assert np.array_equal(got, want), (interleave, chunk, other_q, float(np.abs(got - want).max()))


# ---- a column order (perm): cells out of position order ------------------------------------------

def shuffled(case, tk, tv, v_trans, rng):
    """The sequence's L cells in random cell order (position i at cell ours[i]), the other
    sequence after them; perm lists the mask's columns: ours in position order, then the rest."""
    ours = rng.permutation(L)
    other = np.arange(L, L + 60)
    n_kv = L + 60
    k = garbage_cache(tk, KV_SIZE, case.n_head_kv, D)[None].copy()
    v = garbage_cache(tv, KV_SIZE, case.n_head_kv, D)[None].copy()
    k[0, ours] = cache_rows(tk, case.k)
    v[0, ours] = cache_rows(tv, case.v)
    k[0, other] = cache_rows(tk, case.ko[:60])
    v[0, other] = cache_rows(tv, case.vo[:60])
    if v_trans:
        v = np.ascontiguousarray(v.transpose(0, 2, 3, 1))
    perm = np.concatenate([ours, other]).astype(np.int32)[None]
    return k, v, perm, n_kv


@pytest.mark.parametrize("level", LEVELS, ids=lambda lv: cpu.LEVEL_NAMES[lv])
@pytest.mark.parametrize("v_trans", [False, True], ids=["flash", "vtrans"])
@pytest.mark.parametrize("tk,tv", [("f16", "f16"), ("q8_0", "f16"), ("q4_0", "f32")], ids=lambda t: str(t))
def test_column_order_gives_the_bits_of_position_order(level, v_trans, tk, tv):
    """With perm, a row takes its visible cells in column order: cells in any order in the cache
    give the bits of the same cells stored contiguously in position order (what a sequence decoded
    alone has), in the fast kernels and the oracle."""
    case = Case(np.random.default_rng(7), 6, 2, "causal")
    cpu.set_simd_level(level)
    contiguous = case.build("contiguous", tk, tv, v_trans, np.random.default_rng(0))
    want = attend(case, contiguous, tk, tv, v_trans, 0.0, batch=False, n_threads=1, use_scratch=True)
    k0, v0, ours0, _, n0 = contiguous
    ref_want = A.attn_ref(case.q[None], k0, v0, case.mask_row(ours0, n0)[None, None], n_kv=n0, scale=0.125,
                          v_trans=v_trans, type_k=tk, type_v=tv)
    k, v, perm, n_kv = shuffled(case, tk, tv, v_trans, np.random.default_rng(1))
    cols = np.full(n_kv, -np.inf, np.float32)
    cols[:L] = case.mv                    # column j < L is our position j
    other_cols = np.full(n_kv, -np.inf, np.float32)
    other_cols[L:] = 0.0
    kw = dict(n_kv=n_kv, scale=0.125, v_trans=v_trans, type_k=tk, type_v=tv, perm=perm)
    for nt in (1, 2):
        for use_scratch in (True, False):
            got = A.attn(case.q[None], k, v, cols[None, None], n_threads=nt, use_scratch=use_scratch, **kw)[0]
            assert np.array_equal(got, want), (nt, use_scratch)
            mask = np.stack([other_cols] * 3 + [cols] + [other_cols] * 4)[None]
            q = case.qo.copy()
            q[3] = case.q
            got = A.attn(q, k, v, mask, n_threads=nt, use_scratch=use_scratch, **kw)[3]
            assert np.array_equal(got, want), (nt, use_scratch, "batch")
    assert np.array_equal(A.attn_ref(case.q[None], k, v, cols[None, None], **kw), ref_want)
    with pytest.raises(ValueError, match="perm"):
        A.attn(case.q[None], k, v, cols[None, None], **dict(kw, perm=perm[:, :-1]))
    with pytest.raises(ValueError, match="outside"):
        A.attn(case.q[None], k, v, cols[None, None], **dict(kw, perm=np.full_like(perm, KV_SIZE)))


def test_kv_cache_orders_columns_only_when_a_sequence_is_out_of_order():
    """KVCache builds its mask over the cells sorted by position only when some sequence of the
    ubatch holds its cells out of position order; then attend gives the in-order bits."""
    rng = np.random.default_rng(3)

    def run(cells_first):
        mem = KVCache(1, 2, D, 64, n_seq_max=2)
        if cells_first:  # positions 0..4 of seq 0 go to cells 8..12, after 8 cells of seq 1
            for ub in mem.plan(Batch(list(range(8)), seq_ids=[1] * 8)):
                mem.store(0, ub, rng.standard_normal((8, 2, D)).astype(np.float32),
                          rng.standard_normal((8, 2, D)).astype(np.float32))
        kv = np.random.default_rng(5)
        k5, v5 = kv.standard_normal((5, 2, D)).astype(np.float32), kv.standard_normal((5, 2, D)).astype(np.float32)
        for ub in mem.plan(Batch(list(range(5)), seq_ids=[0] * 5)):
            mem.store(0, ub, k5, v5)
        if cells_first:
            mem.seq_rm(1, -1, -1)  # cells 0..7 free again: the next tokens of seq 0 land before its first
        k3, v3 = kv.standard_normal((3, 2, D)).astype(np.float32), kv.standard_normal((3, 2, D)).astype(np.float32)
        q = kv.standard_normal((3, 6, D)).astype(np.float32)
        plan = mem.plan(Batch([1, 2, 3], seq_ids=[0] * 3, logits=[True] * 3))
        for ub in plan:
            mem.store(0, ub, k3, v3)
            out = mem.attend(0, ub, q)
            perm = mem._active.perm
        return out, perm

    want, p0 = run(False)
    got, p1 = run(True)
    assert p0 is None and p1 is not None
    assert np.array_equal(got, want)
