# cython: language_level=3
"""y = x @ W.T in float32 with W dequantized (csrc/matmul.h): the weight products of the types the
GEMM (gemm.pyx) has no integer dot for, and the ordered product of float32 weights.

W [n_out, n_in] stays as stored (uint8 [n_out, row_bytes], a GGUF tensor's bytes; or float32 /
float16 [n_out, n_in] for F32 / F16); x float32 [n_tok, n_in] is used as is and W is dequantized
tile by tile (the result of BLAS on the dequantized W, up to float rounding). Thin wrappers:
validate with the GIL, run the C kernel with the GIL released.
"""
import numpy as np

cimport numpy as cnp
from libc.stdint cimport int64_t

from llamax._native.quants cimport lx_row_bytes, lx_type, lx_type_block_size

# the declarations of csrc/matmul.h come from matmul.pxd (same module name)

cnp.import_array()

from llamax.threads import resolve_n_threads  # the one place n_threads is resolved

TILE = LX_MM_TILE
ROWS = LX_MM_ROWS
NT = LX_MM_NT

# ggml type numbers this module accepts as weights, and their names (for messages)
_W_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0",
            10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 30: "BF16"}
# element dtypes accepted besides uint8 (then w is [n_out, n_in])
_PLAIN = {0: (np.dtype(np.float32),), 1: (np.dtype(np.float16), np.dtype(np.uint16)),
          30: (np.dtype(np.uint16),)}


cdef lx_type _w_type(object t) except *:
    if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or int(t) not in _W_TYPES:
        raise ValueError(f"w_type {t!r} is not a weight type; known: {sorted(_W_TYPES)} (ggml numbers)")
    cdef int v = int(t)
    return <lx_type> v


def err_factor(int64_t n_in) -> float:
    """LX_MM_ERR(n_in): |mul_mat - mul_mat_ref| <= err_factor * sum_i |W[o][i]| |x[t][i]| (see matmul.h)."""
    return LX_MM_ERR(<double> n_in)


cdef tuple _check(object w, lx_type wt, object x, object out):
    """(n_tok, n_in, n_out, out) after validating the operands."""
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 2 or not x.flags.c_contiguous:
        raise ValueError("x must be a C-contiguous float32 array [n_tok, n_in]")
    cdef int64_t n_tok = x.shape[0], n_in = x.shape[1]
    if not isinstance(w, np.ndarray) or w.ndim != 2 or not w.flags.c_contiguous:
        raise ValueError("w must be a C-contiguous 2-D array [n_out, row_bytes] (uint8) or [n_out, n_in]")
    cdef int t = <int> wt
    if w.dtype != np.uint8 and w.dtype not in _PLAIN.get(t, ()):
        raise ValueError(f"w must be uint8 (the tensor's bytes) for {_W_TYPES[t]}, got {w.dtype}")
    cdef int64_t bs = lx_type_block_size(wt)
    if n_in % bs != 0:
        raise ValueError(f"n_in = {n_in} must be a multiple of {_W_TYPES[t]}'s block size {bs}")
    cdef int64_t n_out = w.shape[0]
    if <size_t> (w.shape[1] * w.itemsize) != lx_row_bytes(wt, n_in):
        raise ValueError(f"a {_W_TYPES[t]} row of n_in = {n_in} values takes {lx_row_bytes(wt, n_in)} bytes, "
                         f"w rows hold {w.shape[1] * w.itemsize}")
    if out is None:
        out = np.empty((n_tok, n_out), dtype=np.float32)
    else:
        if (not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.shape != (n_tok, n_out)
                or not out.flags.c_contiguous or not out.flags.writeable):
            raise ValueError(f"out must be a writeable C-contiguous float32 array of shape ({n_tok}, {n_out})")
        if np.may_share_memory(out, x) or np.may_share_memory(out, w):
            raise ValueError("out must not overlap x or w")
    return n_tok, n_in, n_out, out


def mul_mat(w, w_type, x, out=None, n_threads=None):
    """y = x @ W.T in float32, W given by its stored rows and dequantized.

    Args:
        w: uint8 [n_out, row_bytes(w_type, n_in)], C-contiguous (a GGUF tensor's bytes, read-only
            is fine); or float32 [n_out, n_in] for F32, float16 / uint16 for F16, uint16 for BF16.  # IN
        w_type: ggml type number of W (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K).
        x: float32 [n_tok, n_in], C-contiguous.  # IN
        out: float32 [n_tok, n_out], C-contiguous, or None for a new array.  # OUT
        n_threads: threads over output rows (None or -1 = all cores); the result does not depend
            on it.

    Returns:
        out. Cost: reads W once (plus n_tok * n_in floats); O(n_tok * n_out * n_in).

    Raises:
        ValueError: unknown type, shape / dtype / byte-count mismatch, n_in not a multiple of the
            block size, bad n_threads, out overlapping an input.
    """
    cdef lx_type wt = _w_type(w_type)
    cdef int nth = resolve_n_threads(n_threads)
    n_tok, n_in, n_out, out = _check(w, wt, x, out)
    return _run(w, wt, x, out, n_tok, n_in, n_out, nth, False)


def mul_mat_ref(w, w_type, x):
    """mul_mat through the scalar reference (single-threaded, products added one by one)."""
    cdef lx_type wt = _w_type(w_type)
    n_tok, n_in, n_out, out = _check(w, wt, x, None)
    return _run(w, wt, x, out, n_tok, n_in, n_out, 1, True)


cdef object _run(object w, lx_type wt, object x, object out, int64_t n_tok, int64_t n_in,
                 int64_t n_out, int nth, bint ref):
    """Call the C product on validated operands (raw pointers: the arrays are C-contiguous
    and of the checked dtypes)."""
    if n_tok == 0 or n_out == 0:
        return out
    if n_in == 0:
        out[...] = 0
        return out
    cdef const void *wp = cnp.PyArray_DATA(<cnp.ndarray> w)
    cdef const float *xp = <const float *> cnp.PyArray_DATA(<cnp.ndarray> x)
    cdef float *yp = <float *> cnp.PyArray_DATA(<cnp.ndarray> out)
    with nogil:
        if ref:
            lx_mul_mat_ref(wp, wt, xp, yp, n_tok, n_in, n_out)
        else:
            lx_mul_mat(wp, wt, xp, yp, n_tok, n_in, n_out, nth)
    return out


def mul_mat_f32_ordered(w, x, n_threads=None):
    """y = x @ W.T for float32 W, every output one fixed-order sum (lx_mul_mat_f32_ordered): a row's
    result is the same bits whatever else is in x and whatever n_threads.

    Args:
        w: float32 [n_out, n_in], C-contiguous.  # IN
        x: float32 [n_tok, n_in], C-contiguous.  # IN

    Returns:
        float32 [n_tok, n_out].

    Raises:
        ValueError: dtype, layout or shape mismatch; bad n_threads.
    """
    for name, a in (("w", w), ("x", x)):
        if not isinstance(a, np.ndarray) or a.dtype != np.float32 or a.ndim != 2 or not a.flags.c_contiguous:
            raise ValueError(f"{name} must be a C-contiguous 2-D float32 array")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"x has {x.shape[1]} columns, w {w.shape[1]}")
    cdef int nth = resolve_n_threads(n_threads)
    cdef int64_t n_tok = x.shape[0], n_in = x.shape[1], n_out = w.shape[0]
    out = np.zeros((n_tok, n_out), dtype=np.float32)
    if n_tok == 0 or n_out == 0 or n_in == 0:
        return out
    cdef const float *wp = <const float *> cnp.PyArray_DATA(<cnp.ndarray> w)
    cdef const float *xp = <const float *> cnp.PyArray_DATA(<cnp.ndarray> x)
    cdef float *yp = <float *> cnp.PyArray_DATA(<cnp.ndarray> out)
    with nogil:
        lx_mul_mat_f32_ordered(wp, xp, yp, n_tok, n_in, n_out, nth)
    return out
