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
from libc.stdint cimport int64_t, uint8_t

# the declarations of csrc/quants.h come from quants.pxd (same module name)

cnp.import_array()

from llamax.params import resolve_n_threads  # the one place n_threads is resolved

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


cdef lx_type _check_type(object t) except *:
    if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or int(t) not in TYPE_NAMES:
        raise ValueError(f"unknown ggml type {t!r}; known: {sorted(TYPE_NAMES)}")
    cdef int v = int(t)
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


def have_avx2() -> bool:
    """True if the fast block rows use AVX2 on this CPU."""
    return bool(lx_quants_have_avx2())


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
    if tt not in (LX_TYPE_Q4_0, LX_TYPE_Q8_0, LX_TYPE_Q8_1, LX_TYPE_Q8_K):
        raise ValueError(f"quantize handles Q4_0, Q8_0, Q8_1, Q8_K; got {TYPE_NAMES[tt]}")
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
    """Rows of x quantized with ggml's reference rounding (Q4_0, or the activation formats
    Q8_0 / Q8_1 / Q8_K that the quantized matrix products use).

    Args:
        t: TYPE_Q4_0, TYPE_Q8_0, TYPE_Q8_1 or TYPE_Q8_K.
        x: float32 C-contiguous [..., n], finite, n a multiple of block_size(t).   # IN

    Returns:
        uint8 [..., row_bytes(t, n)]: the blocks (bit-exact with the _ref rows).
    """
    return _quantize(t, x, False)


def quantize_ref(t, x):
    """quantize() through the scalar reference rows."""
    return _quantize(t, x, True)
