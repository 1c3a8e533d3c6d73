# cython: language_level=3
"""The gated delta rule of a linear-attention layer (csrc/delta_net.h: llama.cpp's ggml_gated_delta_net),
reading and updating the per-sequence states of a recurrent memory in place.

A ubatch is n_seqs sequences of n_t tokens (llama.cpp's equal split); cells[s] is the state row of sequence
s. The step can also write the state after each of a sequence's last min(n_t, n_hist) tokens into a history
buffer [n_cells, n_hist, *state row], a ring per cell starting at hist_row[s], as csrc/ssm.h's kernels do
(what a recurrent memory restores to remove a rejected draft's tokens). A thin wrapper: validate with the
GIL, run the C kernel with the GIL released.
"""
import numpy as np

cimport numpy as cnp
from libc.stdint cimport int32_t, int64_t

from llamax._native.ssm cimport undo_rows

# the declarations of csrc/delta_net.h come from delta_net.pxd (same module name)

cnp.import_array()

from llamax._native.recurrent_checks import cells as _cells, f32 as _f32, hist as _check_hist, shape as _shape
from llamax.threads import resolve_n_threads  # the one place n_threads is resolved


def rule(state, cells, q, k, v, g, beta, int64_t n_t, n_threads=None, hist=None, hist_row=None, undo=None,
         undo_slot=None):
    """The gated delta rule of one layer over an equally split ubatch (lx_delta_net).

    Args:
        state: float32 [n_cells, n_head, d, d] (row j of a head: S[:, j], as llama.cpp stores it), updated
            in place.  # IN/OUT
        cells: int32 [n_seqs], each sequence's state row (distinct).
        q, k: float32 [n_seqs * n_t, n_head_k * d] with contiguous rows and one row stride (L2-normed).
        v: float32 [n_seqs * n_t, n_head * d] with contiguous rows; n_head a multiple of n_head_k (value
            head h reads key head h % n_head_k).
        g: float32 [n_seqs * n_t, n_head], C-contiguous: the log decay (the state is multiplied by exp(g)).
        beta: float32 [n_seqs * n_t, n_head], C-contiguous: the write strength.
        n_t: tokens per sequence.
        hist: float32 [n_cells, n_hist, n_head, d, d] or None, a ring per cell: row (r0 + j) % n_hist of
            cells[s] gets the state after token n_t - m + j of sequence s, m = min(n_t, n_hist), r0 =
            hist_row[s] (the other rows are left).  # OUT
        hist_row: int32 [n_seqs] in [0, n_hist), or None (every r0 = 0).
        undo: float32 [k, n_head, d, d] or None: sequence s's state before the call goes to row undo_slot[s]
            (int32 [n_seqs] in [-1, k), -1: none), which is -1 after (csrc/ssm.h's Undo).  # OUT

    Returns:
        float32 [n_seqs * n_t, n_head, d]: each head's output, (S^T q) / sqrt(d) after the token's update.
    """
    _f32(state, "state", 4, writeable=True)
    if state.shape[2] != state.shape[3]:
        raise ValueError(f"state must be [n_cells, n_head, d, d], got shape {tuple(state.shape)}")
    _cells(cells, state.shape[0])
    cdef int64_t n_cells = state.shape[0], n_head = state.shape[1], d = state.shape[2]
    cdef int64_t n_seqs = cells.shape[0]
    if n_t < 0:
        raise ValueError(f"n_t must be >= 0, got {n_t}")
    cdef int64_t n = n_seqs * n_t
    for name, a in (("q", q), ("k", k), ("v", v)):
        _f32(a, name, 2, rows_only=True)
    if d == 0 or q.shape[1] % d or q.shape[1] == 0:
        raise ValueError(f"q must have n_head_k * d columns (d = {d}), got {q.shape[1]}")
    cdef int64_t n_head_k = q.shape[1] // d
    if n_head % n_head_k:
        raise ValueError(f"the state's {n_head} heads must be a multiple of q's {n_head_k}")
    _shape(q, (n, n_head_k * d), "q")
    _shape(k, (n, n_head_k * d), "k")
    _shape(v, (n, n_head * d), "v")
    if n > 1 and q.strides[0] != k.strides[0]:
        raise ValueError("q and k must have the same row stride")
    for name, a in (("g", g), ("beta", beta)):
        _f32(a, name, 2)
        _shape(a, (n, n_head), name)
    cdef int64_t n_hist = _check_hist(hist, hist_row, state, n_seqs)
    cdef float *hp = NULL
    cdef const int32_t *hr = NULL
    if hist_row is not None and n_seqs:
        hr = <const int32_t *> cnp.PyArray_DATA(<cnp.ndarray> hist_row)
    if hist is not None and hist.size:
        hp = <float *> cnp.PyArray_DATA(<cnp.ndarray> hist)
    cdef int32_t *us
    cdef float *up = undo_rows(undo, undo_slot, state, n_seqs, &us)
    cdef int nt = resolve_n_threads(n_threads)
    out = np.empty((n, n_head, d), dtype=np.float32)
    if n == 0 or out.size == 0:
        return out
    cdef int64_t ldqk = q.strides[0] // 4 if n > 1 else n_head_k * d
    cdef int64_t ldv = v.strides[0] // 4 if n > 1 else n_head * d
    cdef float *sp = <float *> cnp.PyArray_DATA(<cnp.ndarray> state)
    cdef const int32_t *cp = <const int32_t *> cnp.PyArray_DATA(<cnp.ndarray> cells)
    cdef const float *qp = <const float *> cnp.PyArray_DATA(<cnp.ndarray> q)
    cdef const float *kp = <const float *> cnp.PyArray_DATA(<cnp.ndarray> k)
    cdef const float *vp = <const float *> cnp.PyArray_DATA(<cnp.ndarray> v)
    cdef const float *gp = <const float *> cnp.PyArray_DATA(<cnp.ndarray> g)
    cdef const float *bp = <const float *> cnp.PyArray_DATA(<cnp.ndarray> beta)
    cdef float *op = <float *> cnp.PyArray_DATA(<cnp.ndarray> out)
    with nogil:
        lx_delta_net(sp, cp, n_seqs, n_t, n_head, n_head_k, d, qp, kp, ldqk, vp, ldv, gp, bp, op, hp, n_hist, hr, up,
                     us, nt)
    return out
