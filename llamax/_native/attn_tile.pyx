# cython: language_level=3
"""The attention kernels of a tile of query tokens sharing a chunk (csrc/attn_tile.h), for the tests:
each fast kernel beside its scalar twin. attention.c runs them inside lx_attn_flash / lx_attn_vtrans.
Thin wrappers: validate with the GIL, run the C kernel with the GIL released.
"""
import numpy as np

cimport numpy as cnp
from libc.stdint cimport int64_t

# the declarations of csrc/attn_tile.h come from attn_tile.pxd (same module name)

cnp.import_array()


cdef object _rows(object x, str name):
    """x as a C-contiguous float32 or float16 2-D array, and its row count and width (a multiple of 8)."""
    if not isinstance(x, np.ndarray) or x.dtype not in (np.float32, np.float16) or x.ndim != 2:
        raise TypeError(f"{name} must be a 2-D float32 or float16 array")
    if x.shape[1] % 8 or x.shape[1] == 0:
        raise ValueError(f"{name}'s rows must have a multiple of 8 values, got {x.shape[1]}")
    return np.ascontiguousarray(x)


def kt(rows, *, bint ref=False):
    """float32 [d, ld]: rows [n, d] (float32 or float16) transposed, ld = n rounded up to 8, the padding
    columns zero (lx_attn_tile_kt; ref: lx_attn_tile_kt_ref)."""
    rows = _rows(rows, "rows")
    cdef int n = rows.shape[0]
    cdef int64_t d = rows.shape[1], ld = (n + 7) // 8 * 8
    out = np.full((d, max(ld, 1)), np.nan, dtype=np.float32)
    offs = np.arange(n, dtype=np.int64) * d
    cdef const int64_t[::1] ov = offs                          # IN
    cdef float[:, ::1] kv = out                                # OUT
    cdef const void *base = cnp.PyArray_DATA(<cnp.ndarray> rows)   # IN
    cdef int f16 = rows.dtype == np.float16
    with nogil:
        if ref:
            lx_attn_tile_kt_ref(base, f16, &ov[0] if n else NULL, n, d, &kv[0, 0], ld)
        else:
            lx_attn_tile_kt(base, f16, &ov[0] if n else NULL, n, d, &kv[0, 0], ld)
    return out[:, :ld]


def vf(rows):
    """float32 [n, dv]: rows [n, dv] (float32 or float16) as floats (lx_attn_tile_vf)."""
    rows = _rows(rows, "rows")
    cdef int n = rows.shape[0]
    cdef int64_t dv = rows.shape[1]
    out = np.empty((n, dv), dtype=np.float32)
    offs = np.arange(n, dtype=np.int64) * dv
    cdef const int64_t[::1] ov = offs
    cdef float[:, ::1] vv = out
    cdef const void *base = cnp.PyArray_DATA(<cnp.ndarray> rows)
    cdef int f16 = rows.dtype == np.float16
    if n:
        with nogil:
            lx_attn_tile_vf(base, f16, &ov[0], n, dv, &vv[0, 0])
    return out


cdef object _row_addresses(object a):
    """uintp [max(rows, 1)]: the address of each row of the C-contiguous 2-D array a, what the kernels
    take as a float ** (a stays alive with the caller's reference)."""
    return np.ascontiguousarray(a.ctypes.data + np.arange(max(a.shape[0], 1), dtype=np.uintp) * a.strides[0],
                                dtype=np.uintp)


def dots(kt_, int n, q, *, int lanes=8, bint ref=False):
    """float32 [nq, n]: the scores of query rows q [nq, d] against the first n columns of kt_ [d, ld], in
    the order of the per-token kernels of `lanes` chains, 8 (AVX2) or 16 (AVX-512)
    (lx_attn_tile_dots; ref: lx_attn_tile_dots_ref)."""
    if lanes not in (8, 16):
        raise ValueError(f"lanes must be 8 or 16, not {lanes}")
    kt_ = np.ascontiguousarray(kt_, dtype=np.float32)
    q = _rows(np.asarray(q, dtype=np.float32), "q")
    if kt_.ndim != 2 or kt_.shape[0] != q.shape[1] or not 0 <= n <= kt_.shape[1] or kt_.shape[1] % 8:
        raise ValueError(f"kt [d, ld] with d = {q.shape[1]}, ld a multiple of 8 >= n = {n}; got {kt_.shape}")
    cdef int nq = q.shape[0]
    out = np.empty((nq, kt_.shape[1]), dtype=np.float32)
    cdef const float[:, ::1] kv = kt_
    cdef const size_t[::1] qa = _row_addresses(q)     # IN: the rows of q
    cdef const size_t[::1] sa = _row_addresses(out)   # OUT: the rows of out
    cdef int64_t d = q.shape[1], ld = kt_.shape[1]
    with nogil:
        if ref:
            lx_attn_tile_dots_ref(&kv[0, 0], ld, n, d, <const float **> &qa[0], <float **> &sa[0], nq, lanes)
        else:
            lx_attn_tile_dots(&kv[0, 0], ld, n, d, <const float **> &qa[0], <float **> &sa[0], nq, lanes)
    return out[:, :n]


def vacc(vf_, P, *, bint ref=False):
    """float32 [nq, dv]: P [nq, n] times vf_ [n, dv], one fma chain per output over the cells in order
    (lx_attn_tile_vacc; ref: lx_attn_tile_vacc_ref)."""
    vf_ = _rows(np.asarray(vf_, dtype=np.float32), "vf")
    P = np.ascontiguousarray(P, dtype=np.float32)
    if P.ndim != 2 or P.shape[1] != vf_.shape[0]:
        raise ValueError(f"P must be [nq, {vf_.shape[0]}], got {P.shape}")
    cdef int nq = P.shape[0], n = vf_.shape[0]
    cdef int64_t dv = vf_.shape[1]
    out = np.empty((nq, dv), dtype=np.float32)
    cdef const float[:, ::1] vv = vf_
    cdef const size_t[::1] pa = _row_addresses(P)     # IN: the rows of P
    cdef const size_t[::1] aa = _row_addresses(out)   # OUT: the rows of out
    cdef const float *vp = &vv[0, 0] if n else NULL
    with nogil:
        if ref:
            lx_attn_tile_vacc_ref(vp, n, dv, <const float **> &pa[0], <float **> &aa[0], nq)
        else:
            lx_attn_tile_vacc(vp, n, dv, <const float **> &pa[0], <float **> &aa[0], nq)
    return out
