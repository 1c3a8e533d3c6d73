# cython: language_level=3
"""RoPE and the K-shift (csrc/rope.h): ggml's CPU rope (ggml_rope_ext), in place.

kind: 0 = norm (GGML_ROPE_TYPE_NORM, pairs (2i, 2i+1)), 2 = neox (GGML_ROPE_TYPE_NEOX, pairs
(i, i + n_rot/2)). Only the first n_rot values of each head rotate. The scaling kinds are keyword
arguments of every function, their defaults plain RoPE:
    freq_factors: float32 [n_rot/2], divisors of each pair's angle (> 0, finite), or None
    ext_factor: YaRN mix (0 = off); attn_factor: the magnitude of cos and sin (mscale)
    corr_dims: YaRN's ramp bounds (yarn_corr_dims), read only when ext_factor != 0
Thin wrappers: validate with the GIL, run the C kernel with the GIL released.
"""
import math

import numpy as np

cimport numpy as cnp
from libc.stdint cimport int32_t, int64_t, uint16_t

# the declarations of csrc/rope.h come from rope.pxd (same module name)
from llamax._native.hadamard cimport lx_hadamard_block_ok
from llamax._native.quants cimport LX_TYPE_F16, LX_TYPE_F32, LX_TYPE_Q4_0, LX_TYPE_Q8_0, lx_type

cnp.import_array()

from llamax._native import quants as _quants

from llamax.threads import resolve_n_threads  # the one place n_threads is resolved

ROPE_NORM = 0
ROPE_NEOX = 2
ROPE_MAX_ROT = LX_ROPE_MAX_ROT


def yarn_corr_dims(int n_dims, int n_ctx_orig, double freq_base, double beta_fast=32.0, double beta_slow=1.0):
    """YaRN's ramp bounds (lo, hi) over the pairs of n_dims rotated dims (ggml_rope_yarn_corr_dims).

    lo = max(0, floor(c(beta_fast))), hi = min(n_dims - 1, ceil(c(beta_slow))) with
    c(b) = n_dims * log(n_ctx_orig / (2 pi b)) / (2 log(freq_base)), in float as ggml computes it.
    n_ctx_orig 0 gives hi = -inf (as ggml).

    Raises:
        ValueError: n_dims < 2, n_ctx_orig < 0, or freq_base <= 0.
    """
    if n_dims < 2 or n_ctx_orig < 0 or not freq_base > 0:
        raise ValueError(f"yarn_corr_dims: n_dims {n_dims} must be >= 2, n_ctx_orig {n_ctx_orig} >= 0 and "
                         f"freq_base {freq_base} > 0")
    cdef float dims[2]
    lx_rope_yarn_corr_dims(n_dims, n_ctx_orig, <float> freq_base, <float> beta_fast, <float> beta_slow, dims)
    return (float(dims[0]), float(dims[1]))


cdef object _check_factors(object freq_factors, int n_rot):
    """freq_factors checked: None, or a float32 C-contiguous [n_rot/2] array of finite values > 0."""
    if freq_factors is None:
        return None
    if not isinstance(freq_factors, np.ndarray) or freq_factors.dtype != np.float32:
        raise ValueError("freq_factors must be a float32 numpy array [n_rot/2] or None")
    if freq_factors.ndim != 1 or freq_factors.shape[0] != n_rot // 2 or not freq_factors.flags.c_contiguous:
        raise ValueError(f"freq_factors must be C-contiguous with shape ({n_rot // 2},) (n_rot/2), "
                         f"got {freq_factors.shape}")
    if not (np.all(np.isfinite(freq_factors)) and np.all(freq_factors > 0)):
        raise ValueError(f"freq_factors must be finite and > 0, got min {freq_factors.min()}, "
                         f"max {freq_factors.max()}")
    return freq_factors


cdef lx_rope_params _params(int n_rot, double freq_base, double freq_scale, int kind, int64_t head_dim,
                            object factors, double ext_factor, double attn_factor, object corr_dims) except *:
    """Every field of lx_rope_params, checked; factors (from _check_factors) must outlive the call
    that uses the result (its data is pointed to, not copied)."""
    cdef lx_rope_params rp
    if kind != 0 and kind != 2:
        raise ValueError(f"kind must be 0 (norm) or 2 (neox), got {kind}")
    if n_rot < 2 or n_rot % 2 != 0 or n_rot > head_dim or n_rot > LX_ROPE_MAX_ROT:
        raise ValueError(f"n_rot must be even and in [2, min(head_dim={head_dim}, {LX_ROPE_MAX_ROT})], "
                         f"got {n_rot}")
    if not freq_base > 0:
        raise ValueError(f"freq_base must be > 0, got {freq_base}")
    if not (math.isfinite(ext_factor) and math.isfinite(attn_factor)):
        raise ValueError(f"ext_factor {ext_factor} and attn_factor {attn_factor} must be finite")
    lo, hi = corr_dims
    lo, hi = float(lo), float(hi)
    if ext_factor != 0 and not (freq_scale > 0 and math.isfinite(lo) and math.isfinite(hi)):
        raise ValueError(f"YaRN (ext_factor {ext_factor}) needs freq_scale > 0 (got {freq_scale}) and finite "
                         f"corr_dims (got {(lo, hi)})")
    rp.n_rot = n_rot
    rp.freq_base = <float> freq_base
    rp.freq_scale = <float> freq_scale
    rp.kind = <lx_rope_kind> kind
    rp.freq_factors = NULL
    if factors is not None:
        rp.freq_factors = <const float *> cnp.PyArray_DATA(factors)
    rp.ext_factor = <float> ext_factor
    rp.attn_factor = <float> attn_factor
    rp.corr_dims[0] = <float> lo
    rp.corr_dims[1] = <float> hi
    return rp


cdef object _check_pos(object pos, str name, Py_ssize_t n):
    if not isinstance(pos, np.ndarray) or pos.dtype != np.int32:
        raise ValueError(f"{name} must be an int32 numpy array")
    if pos.ndim != 1 or pos.shape[0] != n:
        raise ValueError(f"{name} must have shape ({n},), got {pos.shape}")
    if not pos.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")
    return pos


def rope_cache(int p, int n_rot, double freq_base=10000.0, double freq_scale=1.0, *, freq_factors=None,
               double ext_factor=0.0, double attn_factor=1.0, corr_dims=(0.0, 0.0)):
    """float32 [n_rot]: cos and sin of the angles of position p times the magnitude, interleaved
    (ggml's rope cache); the keywords as the module docstring says."""
    ff = _check_factors(freq_factors, n_rot)
    cdef lx_rope_params rp = _params(n_rot, freq_base, freq_scale, 0, n_rot, ff, ext_factor, attn_factor, corr_dims)
    out = np.empty(n_rot, dtype=np.float32)
    cdef float[::1] o = out  # OUT
    with nogil:
        lx_rope_cache(&rp, p, &o[0])
    return out


cdef tuple _check_x(object x):
    if not isinstance(x, np.ndarray) or x.dtype != np.float32:
        raise ValueError("x must be a float32 numpy array [n_tokens, n_head, head_dim]")
    if x.ndim != 3:
        raise ValueError(f"x must be 3-D [n_tokens, n_head, head_dim], got shape {x.shape}")
    if not x.flags.c_contiguous or not x.flags.writeable:
        raise ValueError("x must be C-contiguous and writeable (it is rotated in place)")
    return x.shape[0], x.shape[1], x.shape[2]


def rope_f32(x, pos, int n_rot, double freq_base=10000.0, double freq_scale=1.0, int kind=0,
             n_threads=None, *, freq_factors=None, double ext_factor=0.0, double attn_factor=1.0,
             corr_dims=(0.0, 0.0)):
    """Rotate x in place, token t by position pos[t] (ggml_rope_ext on Q or K).

    Args:
        x: float32 [n_tokens, n_head, head_dim], C-contiguous.   # IN/OUT
        pos: int32 [n_tokens].                                   # IN
        n_rot: rotated dims per head (even, <= head_dim).
        freq_base, freq_scale: theta_i = p * freq_scale * freq_base^(-2i/n_rot) (plain RoPE).
        kind: 0 norm, 2 neox.
        n_threads: None/-1 = all cores, 0 invalid.
        freq_factors, ext_factor, attn_factor, corr_dims: the scaling kinds (module docstring);
            the defaults give plain RoPE bit for bit.

    Returns:
        x. O(n_tokens * (n_rot trig + n_head * n_rot)).

    Raises:
        ValueError: a shape, dtype or parameter is out of range.
    """
    cdef int nt = resolve_n_threads(n_threads)
    n_tokens, n_head, head_dim = _check_x(x)
    ff = _check_factors(freq_factors, n_rot)
    cdef lx_rope_params rp = _params(n_rot, freq_base, freq_scale, kind, head_dim, ff, ext_factor, attn_factor,
                                     corr_dims)
    _check_pos(pos, "pos", n_tokens)
    cdef float *xp = <float *> cnp.PyArray_DATA(x)
    cdef const lx_pos *pp = <const lx_pos *> cnp.PyArray_DATA(pos)
    cdef int64_t a = n_tokens, b = n_head, c = head_dim
    with nogil:
        lx_rope_f32(&rp, xp, pp, a, b, c, nt)
    return x


def rope_f32_ref(x, pos, int n_rot, double freq_base=10000.0, double freq_scale=1.0, int kind=0, *,
                 freq_factors=None, double ext_factor=0.0, double attn_factor=1.0, corr_dims=(0.0, 0.0)):
    """Scalar oracle of rope_f32 (same arguments, one thread)."""
    n_tokens, n_head, head_dim = _check_x(x)
    ff = _check_factors(freq_factors, n_rot)
    cdef lx_rope_params rp = _params(n_rot, freq_base, freq_scale, kind, head_dim, ff, ext_factor, attn_factor,
                                     corr_dims)
    _check_pos(pos, "pos", n_tokens)
    cdef float *xp = <float *> cnp.PyArray_DATA(x)
    cdef const lx_pos *pp = <const lx_pos *> cnp.PyArray_DATA(pos)
    cdef int64_t a = n_tokens, b = n_head, c = head_dim
    with nogil:
        lx_rope_f32_ref(&rp, xp, pp, a, b, c)
    return x


cdef int _check_k(object k_rows, object shift, int64_t n_head_kv, int64_t head_dim, object type,
                  int rot_block) except -1:
    """The lx_type of the K rows (type, or None: f32 / f16 from the dtype), every argument checked."""
    if n_head_kv < 1 or head_dim < 1:
        raise ValueError(f"n_head_kv and head_dim must be >= 1, got {n_head_kv}, {head_dim}")
    if not isinstance(k_rows, np.ndarray):
        raise ValueError("k_rows must be a numpy array [kv_size, n_head_kv*head_dim] (uint8 row bytes when quantized)")
    cdef int t
    if type is None:
        if k_rows.dtype not in (np.float32, np.float16):
            raise ValueError("k_rows must be a float32 or float16 numpy array [kv_size, n_head_kv*head_dim] "
                             "(or uint8 rows with type='q8_0' / 'q4_0')")
        t = LX_TYPE_F32 if k_rows.dtype == np.float32 else LX_TYPE_F16
    else:
        t = _quants.type_id(type)
        if t not in (LX_TYPE_F32, LX_TYPE_F16, LX_TYPE_Q8_0, LX_TYPE_Q4_0):
            raise ValueError(f"type must be f32, f16, q8_0 or q4_0, got {_quants.type_name(t)}")
        want = {LX_TYPE_F32: np.float32, LX_TYPE_F16: np.float16}.get(t, np.uint8)
        if k_rows.dtype != want:
            raise ValueError(f"k_rows of type {_quants.type_name(t)} must be {np.dtype(want).name}, got {k_rows.dtype}")
    if t == LX_TYPE_Q8_0 or t == LX_TYPE_Q4_0:
        if head_dim % 32 != 0:
            raise ValueError(f"a {_quants.type_name(t)} K cache needs head_dim % 32 == 0, got {head_dim}")
        cols = _quants.row_bytes(t, n_head_kv * head_dim)
    else:
        cols = n_head_kv * head_dim
    if k_rows.ndim != 2 or k_rows.shape[1] != cols:
        raise ValueError(f"k_rows must have shape (kv_size, {cols}), got {k_rows.shape}")
    if not k_rows.flags.c_contiguous or not k_rows.flags.writeable:
        raise ValueError("k_rows must be C-contiguous and writeable (it is rotated in place)")
    if rot_block != 0 and (not lx_hadamard_block_ok(rot_block) or head_dim % rot_block != 0):
        raise ValueError(f"rot_block must be 0 or a power of two dividing head_dim = {head_dim}, got {rot_block}")
    if head_dim > LX_ROPE_MAX_HEAD and (rot_block or t not in (LX_TYPE_F32, LX_TYPE_F16)):
        raise ValueError(f"head_dim = {head_dim} exceeds {LX_ROPE_MAX_HEAD}")
    _check_pos(shift, "shift", k_rows.shape[0])
    return t


def k_shift(k_rows, shift, int64_t n_head_kv, int64_t head_dim, int n_rot, double freq_base=10000.0,
            double freq_scale=1.0, int kind=0, n_threads=None, *, type=None, int rot_block=0,
            freq_factors=None, double ext_factor=0.0, double attn_factor=1.0, corr_dims=(0.0, 0.0)):
    """llama.cpp's K-shift of one layer's K rows of one stream, in place.

    Every cell i with shift[i] != 0 is rotated by the angles of position shift[i]; cells with
    shift 0 keep their bits. float16 rows are rotated in float and rounded back (as ggml does).
    A quantized K (type "q8_0" / "q4_0") is dequantized, roped and quantized back, head by head,
    as llama.cpp's build_rope_shift does; with rot_block > 0 the rows are stored rotated by the
    Hadamard matrix (hadamard.pyx) and each head is un-rotated before RoPE and rotated after.

    Args:
        k_rows: [kv_size, n_head_kv*head_dim] float32 / float16, or uint8 [kv_size,
            row_bytes(type, n_head_kv*head_dim)] for a quantized type; C-contiguous.   # IN/OUT
        shift: int32 [kv_size] (0 for empty cells).                                   # IN
        n_head_kv, head_dim, n_rot, freq_base, freq_scale, kind: as rope_f32.
        n_threads: None/-1 = all cores, 0 invalid; the result does not depend on it.
        type: "f32", "f16", "q8_0", "q4_0" (or the type number); None: from the dtype.
        rot_block: 0 (no rotation) or llama.cpp's K rotation block (hadamard.rot_block(head_dim)).
        freq_factors, ext_factor, attn_factor, corr_dims: the layer's scaling (module docstring), as
            llama.cpp's build_rope_shift passes them: a magnitude m != 1 scales the shifted K by m.

    Returns:
        k_rows. O(cells shifted * n_head_kv * head_dim (* log2(rot_block))), trig once per run
        of equal shifts.

    Raises:
        ValueError: a shape, dtype or parameter is out of range (head_dim % 32 for quantized K).
    """
    cdef int nt = resolve_n_threads(n_threads)
    cdef int t = _check_k(k_rows, shift, n_head_kv, head_dim, type, rot_block)
    ff = _check_factors(freq_factors, n_rot)
    cdef lx_rope_params rp = _params(n_rot, freq_base, freq_scale, kind, head_dim, ff, ext_factor, attn_factor,
                                     corr_dims)
    cdef void *kp = cnp.PyArray_DATA(k_rows)
    cdef const lx_pos *sp = <const lx_pos *> cnp.PyArray_DATA(shift)
    cdef int64_t kv_size = k_rows.shape[0]
    with nogil:
        lx_rope_k_shift(&rp, <lx_type> t, kp, sp, kv_size, n_head_kv, head_dim, rot_block, nt)
    return k_rows


def k_shift_ref(k_rows, shift, int64_t n_head_kv, int64_t head_dim, int n_rot, double freq_base=10000.0,
                double freq_scale=1.0, int kind=0, *, type=None, int rot_block=0, freq_factors=None,
                double ext_factor=0.0, double attn_factor=1.0, corr_dims=(0.0, 0.0)):
    """Scalar oracle of k_shift (same arguments, one thread)."""
    cdef int t = _check_k(k_rows, shift, n_head_kv, head_dim, type, rot_block)
    ff = _check_factors(freq_factors, n_rot)
    cdef lx_rope_params rp = _params(n_rot, freq_base, freq_scale, kind, head_dim, ff, ext_factor, attn_factor,
                                     corr_dims)
    cdef void *kp = cnp.PyArray_DATA(k_rows)
    cdef const lx_pos *sp = <const lx_pos *> cnp.PyArray_DATA(shift)
    cdef int64_t kv_size = k_rows.shape[0]
    with nogil:
        lx_rope_k_shift_ref(&rp, <lx_type> t, kp, sp, kv_size, n_head_kv, head_dim, rot_block)
    return k_rows
