# cython: language_level=3
"""llama.cpp's Walsh-Hadamard rotation of quantized KV cache rows (csrc/hadamard.h).

H is ggml_gen_hadamard's matrix (Sylvester order, entries +-1/sqrt(n), H H = I). A row is cut
into consecutive blocks of `block` values and each block x becomes H x, in place. llama.cpp
rotates q and K (block rot_block(head_dim)) when type_k is quantized, and V and the attention
output (block 64) when type_v is quantized, both only when the head size is a multiple of 64.
Thin wrappers: validate with the GIL, run the C kernel with the GIL released.
"""
import numpy as np

cimport numpy as cnp
from libc.stdint cimport int64_t

# the declarations of csrc/hadamard.h come from hadamard.pxd (same module name)

cnp.import_array()

from llamax.threads import resolve_n_threads  # the one place n_threads is resolved

MIN_ROT = LX_HADAMARD_MIN_ROT
MAX_BLOCK = LX_HADAMARD_MAX_BLOCK


def rot_block(int64_t head_dim) -> int:
    """llama.cpp's K rotation block for head size head_dim: the largest power of two >= 64
    dividing it (64 -> 64, 128 -> 128, 192 -> 64), or 0 when head_dim % 64 != 0 (no rotation)."""
    return lx_hadamard_block_k(head_dim)


def rot_block_v(int64_t head_dim) -> int:
    """llama.cpp's V rotation block: 64 when head_dim % 64 == 0, else 0 (no rotation)."""
    return lx_hadamard_block_v(head_dim)


def max_err(int block) -> float:
    """Largest |hadamard_rows - hadamard_rows_ref| of an element, relative to
    s * sum_j |x_j| over its block (s = 1/sqrt(block)): (log2(block) + 2) * 2^-24."""
    _check_block(block)
    return float(LX_HADAMARD_MAX_ERR(int(block).bit_length() - 1))


cdef int _check_block(object block) except -1:
    if isinstance(block, bool) or not isinstance(block, (int, np.integer)):
        raise TypeError(f"block must be an int, got {type(block).__name__}")
    if not lx_hadamard_block_ok(block):
        raise ValueError(f"block must be a power of two in [1, {LX_HADAMARD_MAX_BLOCK}], got {block}")
    return 0


def matrix(int n):
    """float32 [n, n]: H as ggml_gen_hadamard builds it (n a power of two)."""
    _check_block(n)
    h = np.empty((n, n), dtype=np.float32)
    cdef float[:, ::1] hv = h  # OUT
    with nogil:
        lx_hadamard_matrix(n, &hv[0, 0])
    return h


cdef tuple _check_x(object x, object block):
    _check_block(block)
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 2:
        raise ValueError("x must be a float32 numpy array [n_rows, n_per_row]")
    if not x.flags.c_contiguous or not x.flags.writeable:
        raise ValueError("x must be C-contiguous and writeable (it is rotated in place)")
    if x.shape[1] % block != 0:
        raise ValueError(f"n_per_row = {x.shape[1]} must be a multiple of block = {block}")
    return x.shape[0], x.shape[1]


def hadamard_rows(x, block, n_threads=None):
    """Rotate each consecutive block of `block` values of each row of x by H, in place.

    Args:
        x: float32 [n_rows, n_per_row], C-contiguous, writeable; n_per_row % block == 0.  # IN/OUT
        block: a power of two (llama.cpp: rot_block(head_dim) for q/K, 64 for V).
        n_threads: None / -1 = all cores, else >= 1; the result does not depend on it.

    Returns:
        x. Applying it twice gives x back up to rounding. O(x.size * log2(block)).

    Raises:
        ValueError / TypeError: bad block, dtype, shape or layout.
    """
    cdef int nt = resolve_n_threads(n_threads)
    n_rows, n_per_row = _check_x(x, block)
    if x.size == 0:
        return x
    cdef float *xp = <float *> cnp.PyArray_DATA(<cnp.ndarray> x)
    cdef int64_t r = n_rows, c = n_per_row
    cdef int b = block
    with nogil:
        lx_hadamard_rows(xp, r, c, b, nt)
    return x


def hadamard_rows_ref(x, block):
    """Oracle of hadamard_rows: the explicit product by matrix(block) (double sums), in place."""
    n_rows, n_per_row = _check_x(x, block)
    if x.size == 0:
        return x
    cdef float *xp = <float *> cnp.PyArray_DATA(<cnp.ndarray> x)
    cdef int64_t r = n_rows, c = n_per_row
    cdef int b = block
    with nogil:
        lx_hadamard_rows_ref(xp, r, c, b)
    return x
