# cython: language_level=3
"""The recurrent steps of a Mamba layer (csrc/ssm.h): the causal convolution and the selective scan,
each reading and updating the per-sequence states of a recurrent memory in place.

A ubatch is n_seqs sequences of n_t tokens (llama.cpp's equal split); cells[s] is the state row of
sequence s. Either step can also write the state after each of a sequence's last min(n_t, n_hist)
tokens into a history buffer [n_cells, n_hist, *state row], a ring per cell starting at hist_row[s]
(csrc/ssm.h), what a recurrent memory restores to remove a rejected draft's tokens. Thin wrappers: validate with the GIL, run the C kernel with the GIL released.
"""
import numpy as np

cimport numpy as cnp
from libc.stdint cimport int32_t, int64_t

# the declarations of csrc/ssm.h come from ssm.pxd (same module name)

cnp.import_array()

from llamax._native.recurrent_checks import cells as _cells, f32 as _f32, hist as _check_hist, shape as _shape
from llamax._native.recurrent_checks import undo as _check_undo
from llamax.threads import resolve_n_threads  # the one place n_threads is resolved

MAX_CONV = LX_SSM_MAX_CONV


cdef float *_hist(hist, hist_row, state, Py_ssize_t n_seqs, int64_t *n_hist, const int32_t **row) except? NULL:
    """The history buffer's data (NULL for None or an empty one) after recurrent_checks.hist; n_hist set (0 for
    None); row set to the data of hist_row or NULL."""
    n_hist[0] = _check_hist(hist, hist_row, state, n_seqs)
    row[0] = NULL
    if hist_row is not None and n_seqs:
        row[0] = <const int32_t *> cnp.PyArray_DATA(<cnp.ndarray> hist_row)
    if hist is None or hist.size == 0:
        return NULL
    return <float *> cnp.PyArray_DATA(<cnp.ndarray> hist)


cdef float *undo_rows(object undo, object undo_slot, object state, Py_ssize_t n_seqs, int32_t **slot) except? NULL:
    _check_undo(undo, undo_slot, state, n_seqs)
    slot[0] = NULL
    if undo is None or undo.size == 0 or n_seqs == 0:
        return NULL
    slot[0] = <int32_t *> cnp.PyArray_DATA(<cnp.ndarray> undo_slot)
    return <float *> cnp.PyArray_DATA(<cnp.ndarray> undo)


def conv(state, cells, x, w, b, int64_t n_t, n_threads=None, hist=None, hist_row=None):
    """The causal depthwise convolution of one Mamba layer with its bias and SiLU (lx_ssm_conv).

    Args:
        state: float32 [n_cells, d, d_conv - 1], the layer's conv states, updated in place.  # IN/OUT
        cells: int32 [n_seqs], each sequence's state row (distinct).
        x: float32 [n_seqs * n_t, d] with contiguous rows (a column slice of the in-projection).
        w: float32 [d, d_conv]; b: float32 [d] or None.
        n_t: tokens per sequence.
        hist: float32 [n_cells, n_hist, d, d_conv - 1] or None, a ring per cell: row (r0 + j) % n_hist of
            cells[s] gets the state after token n_t - m + j of sequence s, m = min(n_t, n_hist), r0 =
            hist_row[s] (the other rows are left).  # OUT
        hist_row: int32 [n_seqs] in [0, n_hist), or None (every r0 = 0).

    Returns:
        float32 [n_seqs * n_t, d].
    """
    _f32(state, "state", 3, writeable=True)
    _cells(cells, state.shape[0])
    _f32(x, "x", 2, rows_only=True)
    _f32(w, "w", 2)
    cdef int64_t n_seqs = cells.shape[0], d = state.shape[1]
    cdef int d_conv = <int> w.shape[1]
    if not 1 <= d_conv <= LX_SSM_MAX_CONV:
        raise ValueError(f"d_conv must be in [1, {LX_SSM_MAX_CONV}], got {d_conv}")
    if n_t < 0:
        raise ValueError(f"n_t must be >= 0, got {n_t}")
    _shape(state, (state.shape[0], d, d_conv - 1), "state")
    _shape(w, (d, d_conv), "w")
    _shape(x, (n_seqs * n_t, d), "x")
    if b is not None:
        _f32(b, "b", 1)
        _shape(b, (d,), "b")
    cdef int64_t n_hist
    cdef const int32_t *hr
    cdef float *hp = _hist(hist, hist_row, state, n_seqs, &n_hist, &hr)
    cdef int nt = resolve_n_threads(n_threads)
    out = np.empty((n_seqs * n_t, d), dtype=np.float32)
    if out.size == 0:
        return out
    cdef float[:, :, ::1] sv = state
    cdef int32_t[::1] cv = cells
    cdef const float[:, ::1] wv = w
    cdef const float[::1] bv
    cdef const float *bp = NULL
    if b is not None:
        bv = b
        bp = &bv[0]
    cdef float[:, ::1] ov = out  # OUT
    cdef cnp.ndarray xa = x
    cdef const float *xp = <const float *> cnp.PyArray_DATA(xa)
    cdef int64_t ldx = x.strides[0] // 4 if x.shape[0] > 1 else d
    cdef float *sp = &sv[0, 0, 0] if d_conv > 1 else <float *> cnp.PyArray_DATA(<cnp.ndarray> state)
    with nogil:
        lx_ssm_conv(sp, &cv[0], n_seqs, n_t, d, d_conv, xp, ldx, &wv[0, 0], bp, &ov[0, 0], hp, n_hist, hr, nt)
    return out


def scan(state, cells, x, dt, A, B, C, D, z, int64_t n_t, n_threads=None, hist=None, hist_row=None, undo=None,
         undo_slot=None):
    """The selective scan of one Mamba-1 layer with its skip (x * D) and gate (silu(z)) (lx_ssm_scan).

    Args:
        state: float32 [n_cells, d, d_state], the layer's SSM states, updated in place.  # IN/OUT
        cells: int32 [n_seqs], each sequence's state row (distinct).
        x, dt: float32 [n_seqs * n_t, d], C-contiguous (dt before its softplus).
        A: float32 [d, d_state]; D: float32 [d].
        B, C: float32 [n_seqs * n_t, d_state] with contiguous rows and one row stride.
        z: float32 [n_seqs * n_t, d] with contiguous rows.
        n_t: tokens per sequence.
        hist: float32 [n_cells, n_hist, d, d_state] or None, a ring per cell: row (r0 + j) % n_hist of
            cells[s] gets h after token n_t - m + j of sequence s, m = min(n_t, n_hist), r0 = hist_row[s]
            (the other rows are left).  # OUT
        hist_row: int32 [n_seqs] in [0, n_hist), or None (every r0 = 0).
        undo: float32 [k, d, d_state] or None: sequence s's state before the call goes to row undo_slot[s]
            (int32 [n_seqs] in [-1, k), -1: none), which is -1 after (csrc/ssm.h's Undo).  # OUT

    Returns:
        float32 [n_seqs * n_t, d]: (y + x * D) * silu(z).
    """
    _f32(state, "state", 3, writeable=True)
    _cells(cells, state.shape[0])
    cdef int64_t n_seqs = cells.shape[0], d = state.shape[1], d_state = state.shape[2]
    if n_t < 0:
        raise ValueError(f"n_t must be >= 0, got {n_t}")
    cdef int64_t n = n_seqs * n_t
    for name, a in (("x", x), ("dt", dt)):
        _f32(a, name, 2)
        _shape(a, (n, d), name)
    for name, a in (("B", B), ("C", C), ("z", z)):
        _f32(a, name, 2, rows_only=True)
    _shape(B, (n, d_state), "B")
    _shape(C, (n, d_state), "C")
    _shape(z, (n, d), "z")
    if n > 1 and B.strides[0] != C.strides[0]:
        raise ValueError("B and C must have the same row stride")
    _f32(A, "A", 2)
    _shape(A, (d, d_state), "A")
    _f32(D, "D", 1)
    _shape(D, (d,), "D")
    cdef int64_t n_hist
    cdef const int32_t *hr
    cdef float *hp = _hist(hist, hist_row, state, n_seqs, &n_hist, &hr)
    cdef int32_t *us
    cdef float *up = undo_rows(undo, undo_slot, state, n_seqs, &us)
    cdef int nt = resolve_n_threads(n_threads)
    out = np.empty((n, d), dtype=np.float32)
    if n == 0 or d == 0:
        return out
    cdef int64_t ldbc = B.strides[0] // 4 if n > 1 else d_state
    cdef int64_t ldz = z.strides[0] // 4 if n > 1 else d
    cdef float[:, :, ::1] sv = state
    cdef int32_t[::1] cv = cells
    cdef const float[:, ::1] xv = x
    cdef const float[:, ::1] dtv = dt
    cdef const float[:, ::1] av = A
    cdef const float[::1] dv = D
    cdef const float *bp = <const float *> cnp.PyArray_DATA(<cnp.ndarray> B)
    cdef const float *cp = <const float *> cnp.PyArray_DATA(<cnp.ndarray> C)
    cdef const float *zp = <const float *> cnp.PyArray_DATA(<cnp.ndarray> z)
    cdef float[:, ::1] ov = out  # OUT
    with nogil:
        lx_ssm_scan(&sv[0, 0, 0], &cv[0], n_seqs, n_t, d, d_state, &xv[0, 0], &dtv[0, 0], &av[0, 0],
                    bp, cp, ldbc, &dv[0], zp, ldz, &ov[0, 0], hp, n_hist, hr, up, us, nt)
    return out
