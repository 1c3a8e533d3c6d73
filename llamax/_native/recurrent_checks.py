"""The argument checks the recurrent kernels' wrappers share (ssm, ssd, delta_net): a bad array raises
ValueError before any state is touched."""
from __future__ import annotations

import numpy as np


def f32(a, name: str, ndim: int, rows_only: bool = False, writeable: bool = False):
    """a, checked: a float32 array of ndim dimensions, C-contiguous (rows_only: its last axis contiguous
    and its rows one stride apart, as a column slice of a 2-D array is); writeable when updated in place."""
    if not isinstance(a, np.ndarray) or a.dtype != np.float32:
        raise ValueError(f"{name} must be a float32 numpy array")
    if a.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {a.shape}")
    if rows_only:
        if a.strides[ndim - 1] != 4 or (ndim == 2 and a.shape[0] > 1 and a.strides[0] % 4):
            raise ValueError(f"{name} must have contiguous rows")
    elif not a.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")
    if writeable and not a.flags.writeable:
        raise ValueError(f"{name} must be writeable (it is updated in place)")
    return a


def shape(a, want: tuple, name: str) -> None:
    if tuple(a.shape) != want:
        raise ValueError(f"{name} must have shape {want}, got {tuple(a.shape)}")


def int32(a, name: str, n: int):
    """a, checked: a C-contiguous int32 array [n]."""
    if not isinstance(a, np.ndarray) or a.dtype != np.int32 or a.ndim != 1 or not a.flags.c_contiguous \
            or a.shape[0] != n:
        raise ValueError(f"{name} must be a C-contiguous int32 numpy array [{n}]")
    return a


def _bounds(a) -> tuple[int, int]:
    n = a.shape[0]
    if n == 1:   # the generation step: no numpy reductions
        return int(a[0]), int(a[0])
    return (int(a.min()), int(a.max())) if n else (0, 0)


def cells(c, n_rows: int):
    """c, checked: the distinct state rows of the ubatch's sequences, int32 [n_seqs] in [0, n_rows)."""
    if not isinstance(c, np.ndarray) or c.dtype != np.int32 or c.ndim != 1 or not c.flags.c_contiguous:
        raise ValueError("cells must be a C-contiguous int32 numpy array [n_seqs]")
    lo, hi = _bounds(c)
    if lo < 0 or hi >= n_rows:
        raise ValueError(f"cells must lie in [0, {n_rows}), got {c.tolist()}")
    if c.shape[0] > 1 and np.unique(c).shape[0] != c.shape[0]:
        raise ValueError(f"cells must be distinct, got {c.tolist()}")
    return c


def hist(h, hist_row, state, n_seqs: int) -> int:
    """The rollback rows' checks (csrc/ssm.h): h None (then no hist_row), or float32 [n_cells, n_hist,
    *state row], C-contiguous, writeable, not overlapping the state; hist_row None or int32 [n_seqs] in
    [0, n_hist). Returns n_hist (0 for None)."""
    if h is None:
        if hist_row is not None:
            raise ValueError("hist_row without hist")
        return 0
    f32(h, "hist", state.ndim + 1, writeable=True)
    shape(h, (state.shape[0], h.shape[1]) + tuple(state.shape[1:]), "hist")
    if np.may_share_memory(h, state):
        raise ValueError("hist must not overlap the state")
    n_hist = h.shape[1]
    if hist_row is not None:
        if not isinstance(hist_row, np.ndarray) or hist_row.dtype != np.int32 or hist_row.ndim != 1 \
                or not hist_row.flags.c_contiguous or hist_row.shape[0] != n_seqs:
            raise ValueError(f"hist_row must be a C-contiguous int32 numpy array [n_seqs = {n_seqs}]")
        lo, hi = _bounds(hist_row)
        if lo < 0 or hi >= max(n_hist, 1):
            raise ValueError(f"hist_row must lie in [0, n_hist = {n_hist}), got {hist_row.tolist()}")
    return n_hist


def undo(u, undo_slot, state, n_seqs: int) -> None:
    """The undo rows' checks (csrc/ssm.h's Undo): u None (then no undo_slot), or float32 [k, *state row],
    C-contiguous, writeable, not overlapping the state, with undo_slot int32 [n_seqs], writeable, in
    [-1, k), its rows >= 0 distinct."""
    if u is None:
        if undo_slot is not None:
            raise ValueError("undo_slot without undo")
        return
    f32(u, "undo", state.ndim, writeable=True)
    shape(u, (u.shape[0],) + tuple(state.shape[1:]), "undo")
    if np.may_share_memory(u, state):
        raise ValueError("undo must not overlap the state")
    if not isinstance(undo_slot, np.ndarray) or undo_slot.dtype != np.int32 or undo_slot.ndim != 1 \
            or not undo_slot.flags.c_contiguous or not undo_slot.flags.writeable or undo_slot.shape[0] != n_seqs:
        raise ValueError(f"undo_slot must be a writeable C-contiguous int32 numpy array [n_seqs = {n_seqs}]")
    lo, hi = _bounds(undo_slot)
    if lo < -1 or hi >= u.shape[0]:
        raise ValueError(f"undo_slot must lie in [-1, {u.shape[0]}), got {undo_slot.tolist()}")
    if n_seqs > 1:   # (one sequence, the generation step: nothing to compare)
        used = undo_slot[undo_slot >= 0]
        if np.unique(used).size != used.size:
            raise ValueError(f"undo_slot's rows must be distinct, got {undo_slot.tolist()}")
