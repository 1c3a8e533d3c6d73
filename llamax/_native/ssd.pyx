# cython: language_level=3
"""The selective scan of a Mamba-2 layer (csrc/ssd.h): heads of head_dim channels, a scalar A and D per
head, B and C shared by the heads of a group; reads and updates the per-sequence states of a recurrent
memory in place.

A ubatch is n_seqs sequences of n_t tokens (llama.cpp's equal split); cells[s] is the state row of
sequence s. The scan can also write the state after each of a sequence's last min(n_t, n_hist) tokens into
a history buffer [n_cells, n_hist, *state row], a ring per cell starting at hist_row[s], as the Mamba-1
kernels do (csrc/ssm.h): what a recurrent memory restores to remove a rejected draft's tokens. A thin
wrapper: validate with the GIL, run the C kernel with the GIL released.
"""
import numpy as np

cimport numpy as cnp
from libc.stdint cimport int32_t, int64_t

from llamax._native.ssm cimport undo_rows

# the declarations of csrc/ssd.h come from ssd.pxd (same module name)

cnp.import_array()

from llamax._native.recurrent_checks import cells as _cells, f32 as _f32, hist as _check_hist, shape as _shape
from llamax.threads import resolve_n_threads  # the one place n_threads is resolved


cdef int64_t _ld(a, int64_t n, int64_t width):
    """a 2-D array's row stride in floats (width when it has one row)."""
    return a.strides[0] // 4 if n > 1 else width


def scan(state, cells, x, dt, A, B, C, D, z, int64_t n_t, int64_t n_group, n_threads=None, hist=None,
         hist_row=None, undo=None, undo_slot=None):
    """The selective scan of one Mamba-2 layer with its skip (x * D) and gate (silu(z)) (lx_ssd_scan).

    Args:
        state: float32 [n_cells, n_head, head_dim, d_state], the layer's SSM states, updated in place.  # IN/OUT
        cells: int32 [n_seqs], each sequence's state row (distinct).
        x, z: float32 [n_seqs * n_t, n_head * head_dim] with contiguous rows (column slices of the
            convolution's and the in-projection's outputs).
        dt: float32 [n_seqs * n_t, n_head] with contiguous rows (before its softplus, after the bias).
        A, D: float32 [n_head] (A = -exp(A_log)).
        B, C: float32 [n_seqs * n_t, n_group * d_state] with contiguous rows and one row stride.
        n_t: tokens per sequence; n_group: the groups of B and C (dividing n_head).
        hist: float32 [n_cells, n_hist, n_head, head_dim, d_state] or None, a ring per cell: row
            (r0 + j) % n_hist of cells[s] gets the state after token n_t - m + j of sequence s,
            m = min(n_t, n_hist), r0 = hist_row[s] (the other rows are left).  # OUT
        hist_row: int32 [n_seqs] in [0, n_hist), or None (every r0 = 0).
        undo: float32 [k, n_head, head_dim, d_state] or None: sequence s's state before the call goes to row
            undo_slot[s] (int32 [n_seqs] in [-1, k), -1: none), which is -1 after (csrc/ssm.h's Undo).  # OUT

    Returns:
        float32 [n_seqs * n_t, n_head * head_dim]: (y + x * D) * silu(z).

    Raises:
        ValueError: a shape, dtype, layout or index out of the above (nothing is changed).
    """
    _f32(state, "state", 4, writeable=True)
    _cells(cells, state.shape[0])
    cdef int64_t n_seqs = cells.shape[0], n_head = state.shape[1], head_dim = state.shape[2]
    cdef int64_t d_state = state.shape[3], d_inner = n_head * head_dim
    if n_t < 0:
        raise ValueError(f"n_t must be >= 0, got {n_t}")
    if n_group < 1 or n_head % n_group:
        raise ValueError(f"n_group must be a positive divisor of n_head {n_head}, got {n_group}")
    cdef int64_t n = n_seqs * n_t
    for name, a, w in (("x", x, d_inner), ("z", z, d_inner), ("dt", dt, n_head), ("B", B, n_group * d_state),
                       ("C", C, n_group * d_state)):
        _f32(a, name, 2, rows_only=True)
        _shape(a, (n, w), name)
    if n > 1 and B.strides[0] != C.strides[0]:
        raise ValueError("B and C must have the same row stride")
    for name, a in (("A", A), ("D", D)):
        _f32(a, name, 1)
        _shape(a, (n_head,), name)
    cdef int64_t n_hist = _check_hist(hist, hist_row, state, n_seqs)
    cdef const int32_t *hr = NULL
    cdef float *hp = NULL
    if hist_row is not None and n_seqs:
        hr = <const int32_t *> cnp.PyArray_DATA(<cnp.ndarray> hist_row)
    if hist is not None and hist.size:
        hp = <float *> cnp.PyArray_DATA(<cnp.ndarray> hist)
    cdef int32_t *us
    cdef float *up = undo_rows(undo, undo_slot, state, n_seqs, &us)
    cdef int nt = resolve_n_threads(n_threads)
    out = np.empty((n, d_inner), dtype=np.float32)
    if n == 0 or d_inner == 0 or state.size == 0:
        return out
    cdef int64_t ldx = _ld(x, n, d_inner), ldz = _ld(z, n, d_inner), lddt = _ld(dt, n, n_head)
    cdef int64_t ldbc = _ld(B, n, n_group * d_state)
    cdef float *sp = <float *> cnp.PyArray_DATA(<cnp.ndarray> state)
    cdef int32_t *cp = <int32_t *> cnp.PyArray_DATA(<cnp.ndarray> cells)
    cdef const float *xp = <const float *> cnp.PyArray_DATA(<cnp.ndarray> x)
    cdef const float *dtp = <const float *> cnp.PyArray_DATA(<cnp.ndarray> dt)
    cdef const float *ap = <const float *> cnp.PyArray_DATA(<cnp.ndarray> A)
    cdef const float *bp = <const float *> cnp.PyArray_DATA(<cnp.ndarray> B)
    cdef const float *ccp = <const float *> cnp.PyArray_DATA(<cnp.ndarray> C)
    cdef const float *dp = <const float *> cnp.PyArray_DATA(<cnp.ndarray> D)
    cdef const float *zp = <const float *> cnp.PyArray_DATA(<cnp.ndarray> z)
    cdef float[:, ::1] ov = out  # OUT
    with nogil:
        lx_ssd_scan(sp, cp, n_seqs, n_t, n_head, head_dim, d_state, n_group, xp, ldx, dtp, lddt, ap, bp, ccp, ldbc,
                    dp, zp, ldz, &ov[0, 0], hp, n_hist, hr, up, us, nt)
    return out
