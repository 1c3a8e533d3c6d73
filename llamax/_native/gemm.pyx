# cython: language_level=3
"""y = x @ W.T with W in its GGUF blocks, for any batch size, bit-identical on every path
(csrc/gemm.h): the result of a token does not depend on n_tok, n_threads or the SIMD level.

W uint8 [n_out, row_bytes] (a GGUF tensor's bytes), x float32 [n_tok, n_in]. x is quantized per
block as ggml does (q8_0, q8_1 for Q4_1 / Q5_1, q8_K for the K-quants) and the exact integer block
dots are summed in one fixed float chain per output (gemm.h's canonical arithmetic). `product` is
the weight product of any type (csrc/product.h: this GEMM where it has the type, else matmul.h's
float product), the one rule the native layer step follows too. Thin wrappers: validate with the
GIL, run the C kernel with the GIL released.
"""
import numpy as np

cimport numpy as cnp
from cpython.mem cimport PyMem_RawFree, PyMem_RawMalloc
from libc.stdint cimport int32_t, int64_t

from llamax._native.product cimport lx_product, lx_product_kind_of, lx_product_work_size
from llamax._native.quants cimport lx_dequantize_row
from llamax._native.quants cimport (LX_TYPE_Q4_1, LX_TYPE_Q4_K, LX_TYPE_Q5_1, LX_TYPE_Q5_K, LX_TYPE_Q6_K, lx_row_bytes,
                                    lx_type, lx_type_block_bytes, lx_type_block_size)

# the declarations of csrc/gemm.h come from gemm.pxd (same module name)

cnp.import_array()

from llamax.threads import resolve_n_threads  # the one place n_threads is resolved

# ggml type numbers this module takes as weights, and their names (for messages)
W_TYPES = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}


def supported(w_type) -> bool:
    """True if mul_mat takes w_type (a ggml type number) as a weight type."""
    return not isinstance(w_type, bool) and isinstance(w_type, (int, np.integer)) and int(w_type) in W_TYPES


def dot_type(w_type) -> int:
    """ggml type the x rows take (8 Q8_0, 9 Q8_1, 15 Q8_K)."""
    return <int> lx_gemm_dot_type(_w_type(w_type))


def err_factor(w_type, int64_t n_in) -> float:
    """LX_GEMM_ERR(n_terms), n_terms = n_in / 32 blocks (twice that for Q4_1 / Q5_1's min terms), or
    n_in / 256 super-blocks for Q6_K (twice that for Q4_K / Q5_K's min terms): the bound factor vs
    the float64 product of the dequantized operands (see gemm.h)."""
    cdef lx_type wt = _w_type(w_type)
    if wt == LX_TYPE_Q6_K:
        return LX_GEMM_ERR(<double> (n_in // 256))
    if wt == LX_TYPE_Q4_K or wt == LX_TYPE_Q5_K:
        return LX_GEMM_ERR(<double> (2 * (n_in // 256)))
    return LX_GEMM_ERR(<double> ((n_in // 32) * (2 if wt == LX_TYPE_Q4_1 or wt == LX_TYPE_Q5_1 else 1)))


cdef lx_type _w_type(object t) except *:
    if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
        raise TypeError(f"ggml_type must be an int, got {type(t).__name__}")
    if int(t) not in W_TYPES:
        raise ValueError(f"ggml_type {int(t)} is not a gemm weight type; known: {W_TYPES}")
    cdef int v = int(t)
    return <lx_type> v


cdef tuple _check(object w, lx_type wt, object x, object out):
    """(n_tok, n_in, n_out, out) after validating the operands."""
    if not isinstance(x, np.ndarray):
        raise TypeError(f"x must be a numpy array, got {type(x).__name__}")
    if x.dtype != np.float32 or x.ndim != 2 or not x.flags.c_contiguous:
        raise ValueError(f"x must be a C-contiguous float32 array [n_tok, n_in], got {x.dtype} "
                         f"shape {x.shape}")
    cdef int64_t n_tok = x.shape[0], n_in = x.shape[1]
    if not isinstance(w, np.ndarray):
        raise TypeError(f"raw must be a numpy array, got {type(w).__name__}")
    if w.dtype != np.uint8 or w.ndim != 2 or not w.flags.c_contiguous:
        raise ValueError(f"raw must be a C-contiguous uint8 array [n_out, row_bytes], got {w.dtype} "
                         f"shape {w.shape}")
    cdef int t = <int> wt
    cdef int64_t bs = lx_type_block_size(wt)
    if n_in <= 0 or n_in % bs != 0:
        raise ValueError(f"n_in = {n_in} must be a positive multiple of {W_TYPES[t]}'s block size {bs}")
    cdef int64_t n_out = w.shape[0]
    if <size_t> w.shape[1] != lx_row_bytes(wt, n_in):
        raise ValueError(f"a {W_TYPES[t]} row of n_in = {n_in} values takes {lx_row_bytes(wt, n_in)} "
                         f"bytes, raw rows hold {w.shape[1]}")
    if out is None:
        out = np.empty((n_tok, n_out), dtype=np.float32)
    else:
        if not isinstance(out, np.ndarray):
            raise TypeError(f"out must be a numpy array, got {type(out).__name__}")
        if (out.dtype != np.float32 or out.shape != (n_tok, n_out) or not out.flags.c_contiguous
                or not out.flags.writeable):
            raise ValueError(f"out must be a writeable C-contiguous float32 array of shape "
                             f"({n_tok}, {n_out}), got {out.dtype} {out.shape}")
        if np.may_share_memory(out, x) or np.may_share_memory(out, w):
            raise ValueError("out must not overlap x or raw")
    return n_tok, n_in, n_out, out


def mul_mat(raw, ggml_type, x, out=None, n_threads=None):
    """y = x @ W.T, W given by its stored rows; bit-identical for every n_tok / n_threads / level.

    Args:
        raw: uint8 [n_out, row_bytes(ggml_type, n_in)], C-contiguous (a GGUF tensor's bytes;
            read-only is fine).  # IN
        ggml_type: ggml type number of W: Q4_0 (2), Q4_1 (3), Q5_0 (6), Q5_1 (7), Q8_0 (8), Q4_K (12),
            Q5_K (13), Q6_K (14).
        x: float32 [n_tok, n_in], C-contiguous, finite (else unspecified values).  # IN
        out: float32 [n_tok, n_out], C-contiguous, or None for a new array.  # OUT
        n_threads: threads over output rows (None or -1 = all cores); the bits do not depend on it.

    Returns:
        out. Row t depends only on x[t] and W. Cost: reads W once; O(n_tok * n_out * n_in).

    Raises:
        TypeError: a non-array operand or a non-int type.
        ValueError: unknown type, shape / dtype / byte-count mismatch, n_in not a multiple of the block size (32, 256 for K),
            bad n_threads, out overlapping an input.
    """
    cdef lx_type wt = _w_type(ggml_type)
    cdef int nth = resolve_n_threads(n_threads)
    n_tok, n_in, n_out, out = _check(raw, wt, x, out)
    return _run(raw, wt, x, out, n_tok, n_in, n_out, nth, _FAST)


def mul_mat_ref(raw, ggml_type, x):
    """mul_mat through the scalar reference (single-threaded, gemm.h's loop literally)."""
    cdef lx_type wt = _w_type(ggml_type)
    n_tok, n_in, n_out, out = _check(raw, wt, x, None)
    return _run(raw, wt, x, out, n_tok, n_in, n_out, 1, _REF)


cdef enum:   # _run's paths
    _FAST = 0
    _REF = 1
    _R8 = 2
    _PRODUCT = 3      # lx_product over GGUF rows
    _PRODUCT_R8 = 4   # lx_product over the r8 layout


cdef object _run(object w, lx_type wt, object x, object out, int64_t n_tok, int64_t n_in,
                 int64_t n_out, int nth, int path):
    """Call the C product (path: _FAST, _REF, _R8 over a packed W, or product.h's _PRODUCT /
    _PRODUCT_R8) on validated operands (the work buffer lives for the call only)."""
    if n_tok == 0 or n_out == 0:
        return out
    cdef int r8 = 1 if path == _PRODUCT_R8 else 0
    cdef size_t ws
    if path >= _PRODUCT:
        ws = lx_product_work_size(wt, r8, n_tok, n_in, nth)
    elif path == _R8:
        ws = lx_gemm_r8_work_size(wt, n_tok, n_in, nth)
    else:
        ws = lx_gemm_work_size(wt, n_tok, n_in, nth)
    cdef void *work = NULL
    if ws > 0:
        work = PyMem_RawMalloc(ws)
        if work == NULL:
            raise MemoryError(f"gemm: cannot allocate {ws} bytes of work")
    cdef const void *wp = cnp.PyArray_DATA(<cnp.ndarray> w)
    cdef const float *xp = <const float *> cnp.PyArray_DATA(<cnp.ndarray> x)
    cdef float *yp = <float *> cnp.PyArray_DATA(<cnp.ndarray> out)
    try:
        with nogil:
            if path == _REF:
                lx_gemm_ref(wp, wt, xp, yp, n_tok, n_in, n_out, work)
            elif path == _R8:
                lx_gemm_r8(wp, wt, xp, yp, n_tok, n_in, n_out, work, nth)
            elif path >= _PRODUCT:
                lx_product(wp, wt, r8, xp, yp, n_tok, n_in, n_out, work, nth)
            else:
                lx_gemm(wp, wt, xp, yp, n_tok, n_in, n_out, work, nth)
    finally:
        PyMem_RawFree(work)
    return out


# ---- the row-interleaved layout (gemm.h's r8: q4_0, q4_1, q5_0, q8_0 and the K types): one contiguous stream per 8 rows for decode ----

R8_TYPES = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}


cdef lx_type _r8_type(object t) except *:
    cdef lx_type wt = _w_type(t)
    if not lx_gemm_r8_supported(wt):
        raise ValueError(f"ggml_type {int(t)} has no r8 layout; known: {R8_TYPES}")
    return wt


def pack_r8(raw, ggml_type, out=None):
    """W's GGUF rows uint8 [n_out, row_bytes] in the r8 layout: uint8 [ceil(n_out / 8) * 8, row_bytes]
    (per 8-row group and block: the 8 d, q4_1's 8 m or q5_0's 8 qh, then the rows' qs interleaved
    4 bytes at a time; the K types' fields likewise, see gemm.c: r8_move_k; zero rows pad the last
    group). See gemm.h. out: a C-contiguous uint8 array of
    that shape to pack into (returned), else a new one."""
    cdef lx_type wt = _r8_type(ggml_type)
    if not isinstance(raw, np.ndarray) or raw.dtype != np.uint8 or raw.ndim != 2 or not raw.flags.c_contiguous:
        raise ValueError("raw must be a C-contiguous uint8 array [n_out, row_bytes]")
    cdef int64_t bs = lx_type_block_size(wt), bb = lx_type_block_bytes(wt)
    if raw.shape[1] == 0 or raw.shape[1] % bb:
        raise ValueError(f"rows of {raw.shape[1]} bytes are not whole {R8_TYPES[<int> wt]} blocks")
    cdef int64_t n_out = raw.shape[0], n_in = raw.shape[1] // bb * bs
    shape = ((n_out + 7) // 8 * 8, raw.shape[1])
    if out is None:
        out = np.empty(shape, dtype=np.uint8)
    elif not isinstance(out, np.ndarray) or out.dtype != np.uint8 or out.shape != shape \
            or not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"out must be a writeable C-contiguous uint8 array of shape {shape}")
    cdef const void *wp = cnp.PyArray_DATA(<cnp.ndarray> raw)
    cdef void *op = cnp.PyArray_DATA(<cnp.ndarray> out)
    with nogil:
        lx_gemm_pack_r8(wt, wp, op, n_in, n_out)
    return out


cdef int64_t _r8_n_in(object packed, lx_type wt) except -1:
    if not isinstance(packed, np.ndarray) or packed.dtype != np.uint8 or packed.ndim != 2 \
            or not packed.flags.c_contiguous or packed.shape[0] % 8:
        raise ValueError("packed must be pack_r8's C-contiguous uint8 [8k, row_bytes]")
    cdef int64_t bb = lx_type_block_bytes(wt)
    if packed.shape[1] == 0 or packed.shape[1] % bb:
        raise ValueError("packed rows are not whole blocks of this type")
    return packed.shape[1] // bb * lx_type_block_size(wt)


def mul_mat_r8(packed, ggml_type, int64_t n_out, x, n_threads=None):
    """mul_mat over pack_r8's layout: the same bits as mul_mat(raw, ...) for the first n_out rows.
    W is read once per 8 tokens (a decode-step kernel)."""
    cdef lx_type wt = _r8_type(ggml_type)
    cdef int nth = resolve_n_threads(n_threads)
    cdef int64_t n_in = _r8_n_in(packed, wt)
    if not packed.shape[0] - 8 < n_out <= packed.shape[0]:
        raise ValueError(f"n_out {n_out} does not fit {packed.shape[0]} packed rows")
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 2 or not x.flags.c_contiguous \
            or x.shape[1] != n_in:
        raise ValueError(f"x must be a C-contiguous float32 array [n_tok, {n_in}]")
    out = np.empty((x.shape[0], n_out), dtype=np.float32)
    return _run(packed, wt, x, out, x.shape[0], n_in, n_out, nth, _R8)


cdef object _row_ids(object rows, int64_t n_rows):
    """rows as a C-contiguous int32 vector whose every index is in [0, n_rows); else ValueError."""
    ids = np.ascontiguousarray(rows, dtype=np.int32)
    if ids.ndim != 1:
        raise ValueError(f"rows must be a vector of indices in [0, {n_rows})")
    cdef const int32_t *ip = <const int32_t *> cnp.PyArray_DATA(<cnp.ndarray> ids)
    cdef int64_t i
    for i in range(ids.shape[0]):
        if ip[i] < 0 or ip[i] >= n_rows:
            raise ValueError(f"rows must be indices in [0, {n_rows}): {ip[i]} is not")
    return ids


def rows_r8(packed, ggml_type, rows):
    """GGUF rows uint8 [len(rows), row_bytes] of the r8-packed W (rows in [0, packed rows))."""
    cdef lx_type wt = _r8_type(ggml_type)
    cdef int64_t n_in = _r8_n_in(packed, wt)
    ids = _row_ids(rows, packed.shape[0])
    out = np.empty((ids.shape[0], packed.shape[1]), dtype=np.uint8)
    cdef const void *wp = cnp.PyArray_DATA(<cnp.ndarray> packed)
    cdef const int32_t *ip = <const int32_t *> cnp.PyArray_DATA(<cnp.ndarray> ids)
    cdef void *op = cnp.PyArray_DATA(<cnp.ndarray> out)
    cdef int64_t n = ids.shape[0]
    with nogil:
        lx_gemm_unpack_r8_rows(wt, wp, ip, n, op, n_in)
    return out


def rows_r8_f32(packed, ggml_type, rows, scale=None):
    """float32 [len(rows), n_in]: the rows of the r8-packed W dequantized, the bits of dequantizing
    rows_r8's bytes (ggml_get_rows), each value then times the float32 scale when one is given (an
    embedding scale: numpy's float32 product): a decode step's embedding lookup in one call."""
    cdef lx_type wt = _r8_type(ggml_type)
    cdef int64_t n_in = _r8_n_in(packed, wt)
    ids = _row_ids(rows, packed.shape[0])
    cdef int64_t n = ids.shape[0], i, j
    cdef const int32_t *ip = <const int32_t *> cnp.PyArray_DATA(<cnp.ndarray> ids)
    out = np.empty((n, n_in), dtype=np.float32)
    cdef const void *wp = cnp.PyArray_DATA(<cnp.ndarray> packed)
    cdef float *op = <float *> cnp.PyArray_DATA(<cnp.ndarray> out)
    cdef bint scaled = scale is not None
    cdef float s = <float> scale if scaled else 1.0
    cdef void *tmp = PyMem_RawMalloc(<size_t> packed.shape[1])
    if tmp == NULL:
        raise MemoryError()
    with nogil:
        for i in range(n):
            lx_gemm_unpack_r8_rows(wt, wp, ip + i, 1, tmp, n_in)
            lx_dequantize_row(wt, tmp, op + i * n_in, n_in)
            if scaled:
                for j in range(n_in):
                    op[i * n_in + j] *= s
    PyMem_RawFree(tmp)
    return out


# ---- the weight product of any type (csrc/product.h) ----------------------------------------

PRODUCT_KINDS = {0: "none", 1: "gemm", 2: "gemm_r8", 3: "float"}


def product_kind(ggml_type, r8=False) -> str:
    """The engine product.h gives W of this ggml type stored as GGUF rows (r8 False) or in pack_r8's
    layout: "gemm", "gemm_r8", "float" (matmul.h: x times the dequantized W) or "none"."""
    if isinstance(ggml_type, bool) or not isinstance(ggml_type, (int, np.integer)):
        raise TypeError(f"ggml_type must be an int, got {type(ggml_type).__name__}")
    if not 0 <= int(ggml_type) < 64:
        return "none"
    return PRODUCT_KINDS[<int> lx_product_kind_of(<lx_type> <int> int(ggml_type), 1 if r8 else 0)]


def product(raw, ggml_type, x, r8=False, n_out=None, n_threads=None):
    """y = x @ W.T through product.h's engine for W's type and layout (lx_product): the GEMM above
    (the same bits for any batch, thread count and level) for its types, else the float product.

    Args:
        raw: uint8 C-contiguous: W's GGUF rows [n_out, row_bytes], or (r8) pack_r8's layout of them
            [ceil(n_out / 8) * 8, row_bytes].  # IN
        ggml_type: ggml type number of W (product_kind(ggml_type, r8) != "none").
        x: float32 [n_tok, n_in], C-contiguous, finite.  # IN
        r8: raw is pack_r8's layout.
        n_out: W's rows; None: raw.shape[0] (GGUF rows only).
        n_threads: threads (None or -1 = all cores); the bits do not depend on it.

    Returns:
        float32 [n_tok, n_out] (new). Cost: reads W once per call (the GEMM: per 8 tokens when
        n_tok <= 8); O(n_tok * n_out * n_in).

    Raises:
        TypeError: a non-int type.
        ValueError: a type without a product (in this layout), shape / dtype / byte-count mismatch,
            n_in not a positive multiple of the block size, n_out not fitting raw, bad n_threads.
    """
    if product_kind(ggml_type, r8) == "none":
        raise ValueError(f"ggml_type {int(ggml_type)} has no weight product{' in the r8 layout' if r8 else ''}")
    cdef lx_type wt = <lx_type> <int> int(ggml_type)
    cdef int nth = resolve_n_threads(n_threads)
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 2 or not x.flags.c_contiguous:
        raise ValueError("x must be a C-contiguous float32 array [n_tok, n_in]")
    if not isinstance(raw, np.ndarray) or raw.dtype != np.uint8 or raw.ndim != 2 or not raw.flags.c_contiguous:
        raise ValueError("raw must be a C-contiguous uint8 array [rows, row_bytes]")
    cdef int64_t n_tok = x.shape[0], n_in = x.shape[1], bs = lx_type_block_size(wt)
    if n_in <= 0 or n_in % bs:
        raise ValueError(f"n_in = {n_in} must be a positive multiple of the block size {bs}")
    if <size_t> raw.shape[1] != lx_row_bytes(wt, n_in):
        raise ValueError(f"a row of n_in = {n_in} values of type {int(ggml_type)} takes {lx_row_bytes(wt, n_in)} "
                         f"bytes, raw rows hold {raw.shape[1]}")
    cdef int64_t rows = raw.shape[0] if n_out is None else n_out
    if r8 and (raw.shape[0] % 8 or not raw.shape[0] - 8 < rows <= raw.shape[0]):
        raise ValueError(f"n_out {rows} does not fit {raw.shape[0]} packed rows")
    if not r8 and rows != raw.shape[0]:
        raise ValueError(f"n_out {rows} given for {raw.shape[0]} GGUF rows")
    out = np.empty((n_tok, rows), dtype=np.float32)
    return _run(raw, wt, x, out, n_tok, n_in, rows, nth, _PRODUCT_R8 if r8 else _PRODUCT)
