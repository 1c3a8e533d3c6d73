# cython: language_level=3
"""The attention mask of one ubatch over the KV cache cells (csrc/kq_mask.h).

Thin wrappers: validate shapes and dtypes with the GIL, then fill the mask in C with the GIL
released. The mask is float32 [n_stream, n_tps_pad, n_kv]: 0 where query token i of stream s may
attend cell j of stream s, -inf elsewhere (-|p_cell - p_tok| instead of 0 with ALiBi), padding
rows all -inf. n_tps_pad = kq_mask_n_tps_pad(n_tokens // n_stream) unless `out` says otherwise.
"""
import os

import numpy as np

cimport numpy as cnp
from libc.stdint cimport int32_t, int64_t, uint64_t

# the declarations of csrc/kq_mask.h come from kq_mask.pxd (same module name)

cnp.import_array()

from llamax.threads import resolve_n_threads  # the one place n_threads is resolved

KQ_MASK_PAD = LX_KQ_MASK_PAD
SWA_NONE, SWA_STANDARD, SWA_CHUNKED, SWA_SYMMETRIC = 0, 1, 2, 3


def kq_mask_n_tps_pad(int64_t n_tps) -> int:
    """Rows per stream of the mask for n_tps query tokens per stream (llama.cpp's padding)."""
    if n_tps < 0:
        raise ValueError(f"n_tps must be >= 0, got {n_tps}")
    return lx_kq_mask_n_tps_pad(n_tps)


cdef object _check_1d(object a, str name, object dtype, Py_ssize_t n):
    if not isinstance(a, np.ndarray):
        raise ValueError(f"{name} must be a numpy array, got {type(a).__name__}")
    if a.dtype != dtype:
        raise ValueError(f"{name} must have dtype {np.dtype(dtype).name}, got {a.dtype}")
    if a.ndim != 1 or (n >= 0 and a.shape[0] != n):
        raise ValueError(f"{name} must have shape ({n if n >= 0 else 'n'},), got {a.shape}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")
    return a


cdef tuple _prepare(lx_kq_mask_args *a, const lx_pos **pos_ptrs, const lx_seq_bits **seq_ptrs,
                    object cell_pos, object cell_seq, object tok_pos, object tok_seq,
                    bint causal, int n_swa, int swa_type, bint alibi, object out):
    """Validate every argument and fill *a; returns (out, keep-alive arrays)."""
    cell_pos = list(cell_pos)
    cell_seq = list(cell_seq)
    cdef Py_ssize_t n_stream = len(cell_pos)
    if n_stream < 1 or n_stream > LX_MAX_SEQ:
        raise ValueError(f"need 1 to {LX_MAX_SEQ} streams, got {n_stream}")
    if len(cell_seq) != n_stream:
        raise ValueError(f"cell_pos has {n_stream} streams but cell_seq has {len(cell_seq)}")
    _check_1d(cell_pos[0], "cell_pos[0]", np.int32, -1)
    cdef Py_ssize_t n_kv = cell_pos[0].shape[0]
    for s in range(n_stream):
        _check_1d(cell_pos[s], f"cell_pos[{s}]", np.int32, n_kv)
        cs = cell_seq[s]
        if not isinstance(cs, np.ndarray) or cs.dtype != np.uint64:
            raise ValueError(f"cell_seq[{s}] must be a uint64 numpy array")
        if cs.ndim != 2 or cs.shape[0] != n_kv or cs.shape[1] != LX_SEQ_WORDS:
            raise ValueError(f"cell_seq[{s}] must have shape ({n_kv}, {LX_SEQ_WORDS}), got {cs.shape}")
        if not cs.flags.c_contiguous:
            raise ValueError(f"cell_seq[{s}] must be C-contiguous")
        pos_ptrs[s] = <const lx_pos *> cnp.PyArray_DATA(cell_pos[s])
        seq_ptrs[s] = <const lx_seq_bits *> cnp.PyArray_DATA(cs)

    _check_1d(tok_pos, "tok_pos", np.int32, -1)
    cdef Py_ssize_t n_tokens = tok_pos.shape[0]
    _check_1d(tok_seq, "tok_seq", np.int32, n_tokens)
    if n_tokens == 0 or n_tokens % n_stream != 0:
        raise ValueError(f"n_tokens ({n_tokens}) must be a positive multiple of n_stream ({n_stream})")
    if tok_pos.min() < 0:
        raise ValueError(f"token positions must be >= 0, got {int(tok_pos.min())}")
    if tok_seq.min() < 0 or tok_seq.max() >= LX_MAX_SEQ:
        raise ValueError(f"token sequence ids must be in [0, {LX_MAX_SEQ})")
    if swa_type < 0 or swa_type > 3:
        raise ValueError(f"swa_type must be 0 (none), 1 (standard), 2 (chunked) or 3 (symmetric), got {swa_type}")
    if swa_type != 0 and n_swa <= 0:
        raise ValueError(f"n_swa must be > 0 with swa_type {swa_type}, got {n_swa}")

    cdef int64_t n_tps = n_tokens // n_stream
    cdef int64_t n_tps_pad = lx_kq_mask_n_tps_pad(n_tps)
    if out is None:
        out = np.empty((n_stream, n_tps_pad, n_kv), dtype=np.float32)
    else:
        if not isinstance(out, np.ndarray) or out.dtype != np.float32:
            raise ValueError("out must be a float32 numpy array")
        if out.ndim != 3 or out.shape[0] != n_stream or out.shape[2] != n_kv or out.shape[1] < n_tps:
            raise ValueError(f"out must have shape ({n_stream}, >= {n_tps}, {n_kv}), got {out.shape}")
        if not out.flags.c_contiguous or not out.flags.writeable:
            raise ValueError("out must be C-contiguous and writeable")
        n_tps_pad = out.shape[1]

    a.n_stream = n_stream
    a.n_tps = n_tps
    a.n_tps_pad = n_tps_pad
    a.n_kv = n_kv
    a.cell_pos = pos_ptrs
    a.cell_seq = seq_ptrs
    a.tok_pos = <const lx_pos *> cnp.PyArray_DATA(tok_pos)
    a.tok_seq = <const lx_seq_id *> cnp.PyArray_DATA(tok_seq)
    a.causal = causal
    a.n_swa = n_swa if swa_type != 0 else 0
    a.swa_type = <lx_swa_type> swa_type
    a.alibi = alibi
    return out, (cell_pos, cell_seq)


def kq_mask_fill(cell_pos, cell_seq, tok_pos, tok_seq, bint causal=True, int n_swa=0,
                 int swa_type=0, bint alibi=False, n_threads=None, out=None, bint scratch=True):
    """The KQ mask of one ubatch (llama_kv_cache::set_input_kq_mask).

    Args:
        cell_pos: per stream, int32 [n_kv] C-contiguous cell positions (-1 = empty).   # IN
        cell_seq: per stream, uint64 [n_kv, 4] C-contiguous sequence bitsets.          # IN
        tok_pos: int32 [n_tokens] query positions (>= 0), stream-major.               # IN
        tok_seq: int32 [n_tokens] primary sequence id of each query token.            # IN
        causal: mask cells after the token's position.
        n_swa, swa_type: sliding window (0 none, 1 standard, 2 chunked, 3 symmetric).
        alibi: -|p_cell - p_tok| instead of 0 for visible cells.
        n_threads: None/-1 = all cores, 0 invalid.
        out: optional float32 [n_stream, n_tps_pad >= n_tps, n_kv] C-contiguous.       # OUT
        scratch: give the kernel its scratch buffer, which enables llama.cpp's row reuse (later
            rows of a sequence derived from its first row) and compact sequence columns; False
            computes every row by the direct scan (same result, for tests and benchmarks).

    Returns:
        The mask, float32 [n_stream, n_tps_pad, n_kv] (out if given). O(n_tokens * n_kv).

    Raises:
        ValueError: a shape, dtype or value is out of range.
    """
    cdef lx_kq_mask_args a
    cdef const lx_pos *pos_ptrs[256]
    cdef const lx_seq_bits *seq_ptrs[256]
    cdef int nt = resolve_n_threads(n_threads)
    out, keep = _prepare(&a, pos_ptrs, seq_ptrs, cell_pos, cell_seq, tok_pos, tok_seq,
                         causal, n_swa, swa_type, alibi, out)
    cdef float *mask = <float *> cnp.PyArray_DATA(out)
    cdef cnp.ndarray work = None
    cdef void *wp = NULL
    if scratch:
        work = np.empty(lx_kq_mask_work_size(a.n_stream, a.n_tps, a.n_kv) // 8 + 1, dtype=np.uint64)
        wp = cnp.PyArray_DATA(work)
    with nogil:
        lx_kq_mask_fill(&a, mask, wp, nt)
    return out


def kq_mask_fill_ref(cell_pos, cell_seq, tok_pos, tok_seq, bint causal=True, int n_swa=0,
                     int swa_type=0, bint alibi=False, out=None):
    """Scalar oracle of kq_mask_fill (same arguments, one thread)."""
    cdef lx_kq_mask_args a
    cdef const lx_pos *pos_ptrs[256]
    cdef const lx_seq_bits *seq_ptrs[256]
    out, keep = _prepare(&a, pos_ptrs, seq_ptrs, cell_pos, cell_seq, tok_pos, tok_seq,
                         causal, n_swa, swa_type, alibi, out)
    cdef float *mask = <float *> cnp.PyArray_DATA(out)
    with nogil:
        lx_kq_mask_fill_ref(&a, mask)
    return out


def cells_in_order(cell_pos, cell_seq, seqs) -> bool:
    """True if, for each sequence of seqs, the cells holding it (cell_seq's bits) have strictly
    increasing positions (cell_pos) in cell order, as a sequence decoded alone leaves them
    (lx_kq_cells_in_order; the mask's column order is the cells' own order then).

    cell_pos: int32 [n_kv]; cell_seq: uint64 [n_kv, SEQ_WORDS]; seqs: int32 [k] in [0, MAX_SEQ).
    Raises ValueError on another dtype, shape or layout, or a sequence id out of range."""
    _check_1d(cell_pos, "cell_pos", np.int32, -1)
    cdef Py_ssize_t n_kv = cell_pos.shape[0]
    if not isinstance(cell_seq, np.ndarray) or cell_seq.dtype != np.uint64 or cell_seq.ndim != 2 \
            or cell_seq.shape[0] != n_kv or cell_seq.shape[1] != LX_SEQ_WORDS or not cell_seq.flags.c_contiguous:
        raise ValueError(f"cell_seq must be a C-contiguous uint64 array ({n_kv}, {LX_SEQ_WORDS})")
    _check_1d(seqs, "seqs", np.int32, -1)
    if seqs.shape[0] and (seqs.min() < 0 or seqs.max() >= LX_MAX_SEQ):
        raise ValueError(f"sequence ids must be in [0, {LX_MAX_SEQ})")
    cdef const lx_pos *pp = <const lx_pos *> cnp.PyArray_DATA(cell_pos)
    cdef const lx_seq_bits *bp = <const lx_seq_bits *> cnp.PyArray_DATA(cell_seq)
    cdef const lx_seq_id *sp = <const lx_seq_id *> cnp.PyArray_DATA(seqs)
    cdef int n_seqs = seqs.shape[0]
    cdef int r
    with nogil:
        r = lx_kq_cells_in_order(pp, bp, n_kv, sp, n_seqs)
    return r != 0
