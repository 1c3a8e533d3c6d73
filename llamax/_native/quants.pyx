# cython: language_level=3
"""ggml's weight formats (csrc/quants.h): block sizes, dequantization, activation quantization.

Types are ggml_type numbers (TYPE_Q4_0 = 2, ...), as in a GGUF file. A tensor of numpy shape
(..., n_cols) of type t is stored as prod(shape[:-1]) rows of row_bytes(t, n_cols) bytes
(a GGUF tensor's `data` is those bytes as a uint8 array for the quantized types; its `shape` is
ggml's ne order, the reverse of numpy's). Thin wrappers: validate with the GIL, run the C kernel
with the GIL released.
"""
import numpy as np

cimport numpy as cnp
from libc.stdint cimport int64_t, uint8_t, uint32_t

from llamax._native.kv_cells cimport LX_OK

# the declarations of csrc/quants.h come from quants.pxd (same module name)

cnp.import_array()

from llamax.threads import resolve_n_threads  # the one place n_threads is resolved

TYPE_F32 = LX_TYPE_F32
TYPE_F16 = LX_TYPE_F16
TYPE_Q4_0 = LX_TYPE_Q4_0
TYPE_Q4_1 = LX_TYPE_Q4_1
TYPE_Q5_0 = LX_TYPE_Q5_0
TYPE_Q5_1 = LX_TYPE_Q5_1
TYPE_Q8_0 = LX_TYPE_Q8_0
TYPE_Q8_1 = LX_TYPE_Q8_1
TYPE_Q2_K = LX_TYPE_Q2_K
TYPE_Q3_K = LX_TYPE_Q3_K
TYPE_Q4_K = LX_TYPE_Q4_K
TYPE_Q5_K = LX_TYPE_Q5_K
TYPE_Q6_K = LX_TYPE_Q6_K
TYPE_Q8_K = LX_TYPE_Q8_K
TYPE_BF16 = LX_TYPE_BF16

TYPE_NAMES = {
    LX_TYPE_F32: "F32", LX_TYPE_F16: "F16", LX_TYPE_Q4_0: "Q4_0", LX_TYPE_Q4_1: "Q4_1",
    LX_TYPE_Q5_0: "Q5_0", LX_TYPE_Q5_1: "Q5_1", LX_TYPE_Q8_0: "Q8_0", LX_TYPE_Q8_1: "Q8_1",
    LX_TYPE_Q2_K: "Q2_K", LX_TYPE_Q3_K: "Q3_K", LX_TYPE_Q4_K: "Q4_K", LX_TYPE_Q5_K: "Q5_K",
    LX_TYPE_Q6_K: "Q6_K", LX_TYPE_Q8_K: "Q8_K", LX_TYPE_BF16: "BF16",
}

# element dtypes accepted besides uint8 for the unquantized types
_PLAIN_DTYPES = {
    LX_TYPE_F32: (np.dtype(np.float32),),
    LX_TYPE_F16: (np.dtype(np.float16), np.dtype(np.uint16)),
    LX_TYPE_BF16: (np.dtype(np.uint16),),
}


# lower-case names ("f32", "f16", "q8_0", "q4_0", ...) as llama.cpp's -ctk / -ctv spell them
_TYPE_BY_NAME = {name.lower(): t for t, name in TYPE_NAMES.items()}

# the types a KV cache row may have (lx_type_is_cache)
CACHE_TYPE_NAMES = ("f32", "f16", "q8_0", "q4_0")


def type_id(t) -> int:
    """The ggml type number of t: an int (TYPE_Q4_0, ...) or a name ("q4_0", "Q4_0", "f16", ...).

    Raises:
        ValueError: t names no known type.
    """
    if isinstance(t, str):
        v = _TYPE_BY_NAME.get(t.lower())
        if v is None:
            raise ValueError(f"unknown ggml type {t!r}; known: {sorted(_TYPE_BY_NAME)}")
        return v
    if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or int(t) not in TYPE_NAMES:
        raise ValueError(f"unknown ggml type {t!r}; known: {sorted(TYPE_NAMES)} or {sorted(_TYPE_BY_NAME)}")
    return int(t)


def type_name(t) -> str:
    """llama.cpp's lower-case name of type t ("q8_0", "f16", ...)."""
    return TYPE_NAMES[type_id(t)].lower()


cdef lx_type _check_type(object t) except *:
    cdef int v = type_id(t)
    return <lx_type> v


def block_size(t) -> int:
    """Values per block of type t (1 for F32/F16/BF16, 32 for Q*_0/Q*_1, 256 for Q*_K)."""
    return lx_type_block_size(_check_type(t))


def block_bytes(t) -> int:
    """Bytes per block of type t (18 for Q4_0, 144 for Q4_K, ...)."""
    return lx_type_block_bytes(_check_type(t))


def row_bytes(t, int64_t n) -> int:
    """Bytes of a row of n values of type t.

    Raises:
        ValueError: n < 0 or not a multiple of block_size(t).
    """
    cdef lx_type tt = _check_type(t)
    cdef int64_t bs = lx_type_block_size(tt)
    if n < 0 or n % bs != 0:
        raise ValueError(f"a row of {TYPE_NAMES[tt]} holds a multiple of {bs} values, got {n}")
    return lx_row_bytes(tt, n)


def can_dequantize(t) -> bool:
    """True for every known type but Q8_1 / Q8_K (activation-only formats)."""
    return bool(lx_type_can_dequantize(_check_type(t)))


cdef tuple _rows_of(lx_type t, object raw, object shape):
    """(n_rows, n_cols, bytes as a 1-D uint8 array) of a tensor of `shape` stored in raw."""
    if not isinstance(raw, np.ndarray):
        raise ValueError("raw must be a numpy array of the tensor's bytes")
    if raw.dtype != np.uint8 and raw.dtype not in _PLAIN_DTYPES.get(t, ()):
        raise ValueError(f"raw must be uint8 (the tensor's bytes) for {TYPE_NAMES[t]}, got {raw.dtype}")
    if not raw.flags.c_contiguous:
        raise ValueError("raw must be C-contiguous")
    try:
        shape = tuple(int(s) for s in shape)
    except TypeError:
        shape = (int(shape),)
    if len(shape) == 0 or any(s < 0 for s in shape):
        raise ValueError(f"shape must have at least one dimension, none negative, got {shape}")
    cdef int64_t n_cols = shape[len(shape) - 1]
    cdef int64_t n_rows = int(np.prod(shape[:len(shape) - 1], dtype=np.int64)) if len(shape) > 1 else 1
    cdef int64_t bs = lx_type_block_size(t)
    if n_cols % bs != 0:
        raise ValueError(f"the last dimension ({n_cols}) must be a multiple of {TYPE_NAMES[t]}'s block "
                         f"size {bs}")
    need = n_rows * lx_row_bytes(t, n_cols)
    if raw.nbytes != need:
        raise ValueError(f"{TYPE_NAMES[t]} {shape} takes {need} bytes, raw holds {raw.nbytes}")
    return n_rows, n_cols, shape, raw.reshape(-1).view(np.uint8)


def dequantize(t, raw, shape, n_threads=None):
    """float32 array of `shape` (numpy order) from the bytes of a tensor of type t.

    Args:
        t: ggml type number; every type but Q8_1 / Q8_K.
        raw: the tensor's bytes, C-contiguous: uint8 of any shape (e.g. gguf's [rows, row_bytes]
            memmap; read-only is fine), or float32 / float16 for F32 / F16.   # IN
        shape: numpy shape; shape[-1] (n_cols) a multiple of block_size(t).
        n_threads: threads over rows (None or -1 = all cores).

    Returns:
        float32 C-contiguous array of `shape`, bit-exact with ggml's dequantize_row_*.

    Raises:
        ValueError: unknown type, byte count not matching shape, bad n_threads.
    """
    cdef lx_type tt = _check_type(t)
    if not lx_type_can_dequantize(tt):
        raise ValueError(f"{TYPE_NAMES[tt]} is an activation format without dequantization")
    cdef int nth = resolve_n_threads(n_threads)
    n_rows, n_cols, shape, flat = _rows_of(tt, raw, shape)
    out = np.empty(shape, dtype=np.float32)
    if out.size == 0:
        return out
    cdef const uint8_t[::1] x = flat  # IN
    cdef float[::1] y = out.reshape(-1)  # OUT
    cdef int64_t nr = n_rows, nc = n_cols
    with nogil:
        lx_dequantize_rows(tt, &x[0], &y[0], nr, nc, nth)
    return out


def dequantize_ref(t, raw, shape):
    """dequantize() through the scalar reference rows (single-threaded; the test oracle)."""
    cdef lx_type tt = _check_type(t)
    if not lx_type_can_dequantize(tt):
        raise ValueError(f"{TYPE_NAMES[tt]} is an activation format without dequantization")
    n_rows, n_cols, shape, flat = _rows_of(tt, raw, shape)
    out = np.empty(shape, dtype=np.float32)
    if out.size == 0:
        return out
    cdef const uint8_t[::1] x = flat  # IN
    cdef float[::1] y = out.reshape(-1)  # OUT
    cdef int64_t r, nr = n_rows, nc = n_cols
    cdef size_t rb = lx_row_bytes(tt, n_cols)
    with nogil:
        for r in range(nr):
            lx_dequantize_row_ref(tt, &x[r * rb], &y[r * nc], nc)
    return out


cdef object _quantize(object t, object x, bint ref):
    cdef lx_type tt = _check_type(t)
    if tt not in (LX_TYPE_Q4_0, LX_TYPE_Q8_0, LX_TYPE_Q8_1, LX_TYPE_Q8_K, LX_TYPE_F32, LX_TYPE_F16):
        raise ValueError(f"quantize handles Q4_0, Q8_0, Q8_1, Q8_K (and F32, F16); got {TYPE_NAMES[tt]}")
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or not x.flags.c_contiguous:
        raise ValueError("x must be a C-contiguous float32 numpy array")
    if x.ndim == 0:
        raise ValueError("x must have at least one dimension")
    cdef int64_t n = x.shape[x.ndim - 1]
    cdef int64_t bs = lx_type_block_size(tt)
    if n % bs != 0:
        raise ValueError(f"the last dimension ({n}) must be a multiple of {bs}")
    if not np.isfinite(x).all():
        raise ValueError("x must be finite")
    cdef int64_t n_rows = x.size // n if n > 0 else 0
    cdef size_t rb = lx_row_bytes(tt, n)
    out = np.zeros(x.shape[:x.ndim - 1] + (rb,), dtype=np.uint8)
    if out.size == 0 or n_rows == 0:
        return out
    cdef const float[::1] xv = x.reshape(-1)  # IN
    cdef uint8_t[::1] yv = out.reshape(-1)  # OUT
    cdef int64_t r
    with nogil:
        for r in range(n_rows):
            if ref:
                lx_quantize_row_ref(tt, &xv[r * n], &yv[r * rb], n)
            else:
                lx_quantize_row(tt, &xv[r * n], &yv[r * rb], n)
    return out


def quantize(t, x):
    """Rows of x quantized with ggml's reference rounding (the cache types Q4_0 / Q8_0, the
    activation formats Q8_1 / Q8_K of the quantized matrix products, or F32 / F16 bytes).

    Args:
        t: a type number or name: q4_0, q8_0, q8_1, q8_K, f32, f16.
        x: float32 C-contiguous [..., n], finite, n a multiple of block_size(t).   # IN

    Returns:
        uint8 [..., row_bytes(t, n)]: the blocks (bit-exact with the _ref rows).
        O(x.size).
    """
    return _quantize(t, x, False)


def quantize_ref(t, x):
    """quantize() through the scalar reference rows."""
    return _quantize(t, x, True)


def quantize_split(t, x, ref=False):
    """A row x as q8_0 or q8_1 blocks taken apart (csrc/quants.h lx_quantize_row_q8_split, what the
    integer products read): (qs int8 [n], d float32 [n/32], s float32 [n/32], sum int32 [n/32]), d and s
    the floats of the blocks' f16 scales (s 0 for q8_0), sum the sums of their qs. ref: the scalar twin."""
    cdef lx_type tt = _check_type(t)
    if tt != LX_TYPE_Q8_0 and tt != LX_TYPE_Q8_1:
        raise ValueError(f"quantize_split takes q8_0 or q8_1, not {TYPE_NAMES[tt]}")
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 1 or x.shape[0] % LX_QK:
        raise ValueError(f"x must be 1-D with a multiple of {LX_QK} values, got shape {x.shape}")
    cdef int64_t n = x.shape[0], nb = n // LX_QK
    qs = np.empty(n, np.int8)
    d, s = np.empty(nb, np.float32), np.empty(nb, np.float32)
    sums = np.empty(nb, np.int32)
    cdef const float *xp = <const float *> cnp.PyArray_DATA(<cnp.ndarray> x)
    cdef int8_t *qp = <int8_t *> cnp.PyArray_DATA(<cnp.ndarray> qs)
    cdef float *dp = <float *> cnp.PyArray_DATA(<cnp.ndarray> d)
    cdef float *sp = <float *> cnp.PyArray_DATA(<cnp.ndarray> s)
    cdef int32_t *mp = <int32_t *> cnp.PyArray_DATA(<cnp.ndarray> sums)
    cdef bint use_ref = ref
    with nogil:
        if use_ref:
            lx_quantize_row_q8_split_ref(tt, xp, qp, dp, sp, mp, n)
        else:
            lx_quantize_row_q8_split(tt, xp, qp, dp, sp, mp, n)
    return qs, d, s, sums


# ---- set_rows (the cache write) ------------------------------------------------------------------

cdef tuple _set_rows_args(object t, object src, object dst, object idxs):
    """(type, n, n_per_row, idxs as uint32) after checking every argument."""
    cdef lx_type tt = _check_type(t)
    if not lx_type_is_cache(tt):
        raise ValueError(f"set_rows writes cache rows of f32, f16, q8_0 or q4_0; got {TYPE_NAMES[tt]}")
    if not isinstance(src, np.ndarray) or src.dtype != np.float32 or src.ndim != 2 or not src.flags.c_contiguous:
        raise ValueError("src must be a C-contiguous float32 array [n, n_per_row]")
    n, n_per_row = src.shape
    cdef int64_t bs = lx_type_block_size(tt)
    if n_per_row % bs != 0:
        raise ValueError(f"n_per_row = {n_per_row} must be a multiple of {TYPE_NAMES[tt]}'s block size {bs}")
    if not isinstance(dst, np.ndarray) or dst.ndim != 2 or not dst.flags.c_contiguous or not dst.flags.writeable:
        raise ValueError("dst must be a writeable C-contiguous 2-D array [n_rows, row_bytes or n_per_row]")
    rb = lx_row_bytes(tt, n_per_row)
    if dst.dtype == np.uint8:
        if dst.shape[1] != rb:
            raise ValueError(f"dst rows of {TYPE_NAMES[tt]} x {n_per_row} hold {rb} bytes, dst has {dst.shape[1]}")
    elif dst.dtype in _PLAIN_DTYPES.get(tt, ()):
        if dst.shape[1] != n_per_row:
            raise ValueError(f"dst must have {n_per_row} columns, got {dst.shape[1]}")
    else:
        raise ValueError(f"dst must be uint8 (the row bytes) for {TYPE_NAMES[tt]}, got {dst.dtype}")
    if not isinstance(idxs, np.ndarray) or idxs.ndim != 1 or idxs.dtype.kind not in "iu":
        raise ValueError("idxs must be a 1-D integer numpy array")
    if idxs.shape[0] != n:
        raise ValueError(f"idxs has {idxs.shape[0]} entries for {n} rows")
    if n and (int(idxs.min()) < 0 or int(idxs.max()) >= dst.shape[0]):
        raise ValueError(f"idxs must be in [0, {dst.shape[0]}), got [{int(idxs.min())}, {int(idxs.max())}]")
    if n and not np.isfinite(src).all():
        raise ValueError("src must be finite")
    return tt, n, n_per_row, np.ascontiguousarray(idxs, dtype=np.uint32)


def set_rows(t, src, dst, idxs, n_threads=None):
    """llama.cpp's set_rows: row i of src stored as type t into row idxs[i] of dst, in place.

    Args:
        t: "f32", "f16", "q8_0" or "q4_0" (or the type number).
        src: float32 [n, n_per_row], C-contiguous, finite; n_per_row a multiple of the block
            size (32 for q8_0 / q4_0).                                              # IN
        dst: the cache rows, C-contiguous and writeable: uint8 [n_rows, row_bytes(t, n_per_row)],
            or float32 / float16 [n_rows, n_per_row] for f32 / f16.                # OUT
        idxs: integer [n], each in [0, n_rows) (converted to uint32). With a repeated index
            the last row wins (such a call runs on one thread).                    # IN
        n_threads: None / -1 = all cores, else >= 1; the result does not depend on it.

    Returns:
        dst. Quantized rows are bit-exact with quantize(). O(n * n_per_row).

    Raises:
        ValueError: a type, shape, dtype or index is out of range (dst is then untouched).
    """
    cdef int nt = resolve_n_threads(n_threads)
    tt, n, n_per_row, ix = _set_rows_args(t, src, dst, idxs)
    if n == 0:
        return dst
    if nt > 1 and np.unique(ix).shape[0] != n:
        nt = 1                               # a repeated index: serial, so the last row wins
    cdef lx_type ct = tt
    cdef const float[:, ::1] sv = src        # IN
    cdef const uint32_t[::1] iv = ix         # IN
    cdef void *dp = cnp.PyArray_DATA(<cnp.ndarray> dst)   # OUT
    cdef int64_t nn = n, npr = n_per_row
    cdef lx_status st
    with nogil:
        st = lx_set_rows(ct, &sv[0, 0], dp, &iv[0], nn, npr, nt)
    assert st == LX_OK
    return dst


def set_rows_ref(t, src, dst, idxs):
    """set_rows through the scalar reference quantizers (single-threaded; the test oracle)."""
    tt, n, n_per_row, ix = _set_rows_args(t, src, dst, idxs)
    if n == 0:
        return dst
    cdef lx_type ct = tt
    cdef const float[:, ::1] sv = src        # IN
    cdef const uint32_t[::1] iv = ix         # IN
    cdef void *dp = cnp.PyArray_DATA(<cnp.ndarray> dst)   # OUT
    cdef int64_t nn = n, npr = n_per_row
    cdef lx_status st
    with nogil:
        st = lx_set_rows_ref(ct, &sv[0, 0], dp, &iv[0], nn, npr)
    assert st == LX_OK
    return dst
