# cython: language_level=3
"""Attention over one layer's KV cache (csrc/attention.h) and the f16 rows of csrc/quants.h.

Thin wrappers: shapes and dtypes are checked with the GIL held, then the C kernels run with the
GIL released. Layouts (C-contiguous, n_tokens = n_stream * n_tps):

    q     float32            [n_tokens, n_head, d_k]
    k     float32 | float16  [n_stream, kv_size, n_head_kv, d_k]
          uint8 (q8_0, q4_0) [n_stream, kv_size, row_bytes(type_k, n_head_kv * d_k)]
    v     float32 | float16  [n_stream, kv_size, n_head_kv, d_v]      (v_trans=False, flash layout)
          uint8 (q8_0, q4_0) [n_stream, kv_size, row_bytes(type_v, n_head_kv * d_v)]  (flash only)
                             [n_stream, n_head_kv, d_v, kv_size]      (v_trans=True, V transposed)
    mask  float32            [n_stream, n_tps_pad, n_kv]              (0 / bias visible, -inf hidden)
    out   float32            [n_tokens, n_head, d_v]

v_trans=False runs llama.cpp's flash-attention semantics (softcap on the scaled score),
v_trans=True its mul_mat + soft_max_ext path (softcap on the raw kq, scale after).
"""
import numpy as np

cimport numpy as cnp
from libc.stdint cimport int32_t, int64_t, uint16_t

from llamax._native.quants cimport (
    LX_QK,
    LX_TYPE_F16,
    LX_TYPE_F32,
    LX_TYPE_Q4_0,
    LX_TYPE_Q8_0,
    lx_fp16_to_fp32_row,
    lx_fp16_to_fp32_row_ref,
    lx_fp32_to_fp16_row,
    lx_fp32_to_fp16_row_ref,
    lx_row_bytes,
    lx_type,
    lx_type_block_bytes,
)
from llamax._native import quants as _quants
from llamax.threads import resolve_n_threads

# the declarations of csrc/attention.h come from attention.pxd (same module name)

cnp.import_array()

MAX_D = LX_ATTN_MAX_D
CHUNK = LX_ATTN_CHUNK
MAX_GROUP = LX_ATTN_MAX_GROUP
MAX_ERR = float(LX_ATTN_MAX_ERR)


def _set_min_work(int64_t macs) -> None:
    """Testing hook: multiply-adds per woken thread (1 = use every thread, -1 = default)."""
    lx_attn_set_min_work(macs)


# ---- f16 rows --------------------------------------------------------------------------------

cdef object _check_array(object a, str name, object dtype):
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{name} must be a numpy array, got {type(a).__name__}")
    if a.dtype != dtype:
        raise ValueError(f"{name} must be {np.dtype(dtype).name}, got {a.dtype}")
    if not a.flags.c_contiguous or not a.flags.aligned:
        raise ValueError(f"{name} must be C-contiguous and aligned")
    return a


def fp32_to_fp16(x):
    """float32 array -> float16 array of the same shape (round to nearest even, numpy's NaNs)."""
    _check_array(x, "x", np.float32)
    y = np.empty(x.shape, dtype=np.float16)
    cdef const float[::1] xs = x.reshape(-1)      # IN
    cdef uint16_t[::1] ys = y.view(np.uint16).reshape(-1)  # OUT
    cdef int64_t n = xs.shape[0]
    if n:
        with nogil:
            lx_fp32_to_fp16_row(&xs[0], &ys[0], n)
    return y


def fp32_to_fp16_ref(x):
    """Scalar twin of fp32_to_fp16."""
    _check_array(x, "x", np.float32)
    y = np.empty(x.shape, dtype=np.float16)
    cdef const float[::1] xs = x.reshape(-1)      # IN
    cdef uint16_t[::1] ys = y.view(np.uint16).reshape(-1)  # OUT
    cdef int64_t n = xs.shape[0]
    if n:
        with nogil:
            lx_fp32_to_fp16_row_ref(&xs[0], &ys[0], n)
    return y


def fp16_to_fp32(x):
    """float16 array -> float32 array of the same shape (exact)."""
    _check_array(x, "x", np.float16)
    y = np.empty(x.shape, dtype=np.float32)
    cdef const uint16_t[::1] xs = x.view(np.uint16).reshape(-1)  # IN
    cdef float[::1] ys = y.reshape(-1)            # OUT
    cdef int64_t n = xs.shape[0]
    if n:
        with nogil:
            lx_fp16_to_fp32_row(&xs[0], &ys[0], n)
    return y


def fp16_to_fp32_ref(x):
    """Scalar twin of fp16_to_fp32."""
    _check_array(x, "x", np.float16)
    y = np.empty(x.shape, dtype=np.float32)
    cdef const uint16_t[::1] xs = x.view(np.uint16).reshape(-1)  # IN
    cdef float[::1] ys = y.reshape(-1)            # OUT
    cdef int64_t n = xs.shape[0]
    if n:
        with nogil:
            lx_fp16_to_fp32_row_ref(&xs[0], &ys[0], n)
    return y


# ---- attention ---------------------------------------------------------------------------------

cdef int _type_from(object t, object a, str name) except -1:
    """The lx_type of cache tensor a (type t, or None: from a's dtype); a's dtype and layout checked."""
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{name} must be a numpy array, got {type(a).__name__}")
    cdef int tt
    if t is None:
        if a.dtype == np.float32:
            tt = LX_TYPE_F32
        elif a.dtype == np.float16:
            tt = LX_TYPE_F16
        else:
            raise ValueError(f"{name} must be float32 or float16 (or uint8 rows with type_{name} "
                             f"'q8_0' / 'q4_0'), got {a.dtype}")
    else:
        tt = _quants.type_id(t)
        if tt not in (LX_TYPE_F32, LX_TYPE_F16, LX_TYPE_Q8_0, LX_TYPE_Q4_0):
            raise ValueError(f"type_{name} must be f32, f16, q8_0 or q4_0, got {_quants.type_name(tt)}")
        want = {LX_TYPE_F32: np.float32, LX_TYPE_F16: np.float16}.get(tt, np.uint8)
        if a.dtype != want:
            raise ValueError(f"{name} of type_{name} {_quants.type_name(tt)} must be {np.dtype(want).name}, "
                             f"got {a.dtype}")
    if not a.flags.c_contiguous or not a.flags.aligned:
        raise ValueError(f"{name} must be C-contiguous and aligned")
    return tt


cdef bint _quantized(int t):
    return t == LX_TYPE_Q8_0 or t == LX_TYPE_Q4_0


cdef int64_t _row_values(int t, int64_t row_bytes, str name) except -1:
    """Values in a quantized row of row_bytes bytes (whole blocks only)."""
    cdef int64_t bb = lx_type_block_bytes(<lx_type> t)
    if row_bytes < 1 or row_bytes % bb != 0:
        raise ValueError(f"{name} rows of {_quants.type_name(t)} are whole blocks of {bb} bytes, got {row_bytes}")
    return row_bytes // bb * LX_QK


cdef lx_attn_params _attn_params(object q, object k, object v, object mask, object out,
                                 object n_kv, double scale, double softcap, bint v_trans,
                                 object type_k, object type_v) except *:
    """Validate every array against the layouts of the module docstring; the C shape record."""
    cdef lx_attn_params p
    cdef int tk = _type_from(type_k, k, "k")
    cdef int tv = _type_from(type_v, v, "v")
    p.type_k = <lx_type> tk
    p.type_v = <lx_type> tv
    _check_array(q, "q", np.float32)
    _check_array(mask, "mask", np.float32)
    if q.ndim != 3:
        raise ValueError(f"q must be 3-D [n_tokens, n_head, d_k], got shape {q.shape}")
    if mask.ndim != 3:
        raise ValueError(f"mask must be 3-D [n_stream, n_tps_pad, n_kv], got shape {mask.shape}")
    n_tokens, n_head, d_kq = q.shape

    if _quantized(tk):
        if k.ndim != 3:
            raise ValueError(f"k of type_k {_quants.type_name(tk)} must be 3-D uint8 [n_stream, kv_size, "
                             f"row_bytes], got shape {k.shape}")
        if d_kq < 1 or d_kq % LX_QK != 0:
            raise ValueError(f"a {_quants.type_name(tk)} K cache needs a head size that is a multiple of "
                             f"{LX_QK}, got d_k = {d_kq}")
        n_stream, kv_size, k_row = k.shape
        if n_stream < 1 or kv_size < 1:
            raise ValueError(f"k shape {k.shape}: every dimension must be >= 1")
        k_vals = _row_values(tk, k_row, "k")
        if k_vals % d_kq != 0:
            raise ValueError(f"k rows hold {k_vals} values, not a multiple of the head size d_k = {d_kq}")
        n_head_kv, d_k = k_vals // d_kq, d_kq
    else:
        if k.ndim != 4:
            raise ValueError(f"k must be 4-D, got shape {k.shape}")
        n_stream, kv_size, n_head_kv, d_k = k.shape
    if n_stream < 1 or kv_size < 1 or n_head_kv < 1 or d_k < 1:
        raise ValueError(f"k shape {k.shape}: every dimension must be >= 1")
    if kv_size > 2**31 - 1:
        raise ValueError(f"kv_size = {kv_size} exceeds 2^31 - 1")
    if d_kq != d_k:
        raise ValueError(f"q head size {d_kq} != k head size {d_k}")
    if d_k > LX_ATTN_MAX_D:
        raise ValueError(f"d_k = {d_k} exceeds {LX_ATTN_MAX_D}")
    if n_head < 1 or n_head % n_head_kv != 0:
        raise ValueError(f"n_head = {n_head} must be a positive multiple of n_head_kv = {n_head_kv}")
    if n_tokens < 1 or n_tokens % n_stream != 0:
        raise ValueError(f"n_tokens = {n_tokens} must be a positive multiple of n_stream = {n_stream}")
    n_tps = n_tokens // n_stream

    if _quantized(tv):
        if v_trans:
            raise ValueError(f"a quantized V cache (type_v {_quants.type_name(tv)}) needs flash attention "
                             f"(v_trans=False), as in llama.cpp: V^T would cut blocks across cells")
        if v.ndim != 3 or v.shape[0] != n_stream or v.shape[1] != kv_size:
            raise ValueError(f"v of type_v {_quants.type_name(tv)} must be 3-D uint8 [n_stream={n_stream}, "
                             f"kv_size={kv_size}, row_bytes], got shape {v.shape}")
        v_vals = _row_values(tv, v.shape[2], "v")
        if v_vals % n_head_kv != 0 or (v_vals // n_head_kv) % LX_QK != 0:
            raise ValueError(f"v rows hold {v_vals} values: not n_head_kv = {n_head_kv} heads of a multiple "
                             f"of {LX_QK}")
        d_v = v_vals // n_head_kv
    elif v_trans:
        if v.ndim != 4:
            raise ValueError(f"v must be 4-D, got shape {v.shape}")
        vs, vh, d_v, vsize = v.shape
        if (vs, vh, vsize) != (n_stream, n_head_kv, kv_size):
            raise ValueError(f"v (transposed) must be [n_stream={n_stream}, n_head_kv={n_head_kv}, d_v, "
                             f"kv_size={kv_size}], got shape {v.shape}")
    else:
        if v.ndim != 4:
            raise ValueError(f"v must be 4-D, got shape {v.shape}")
        vs, vsize, vh, d_v = v.shape
        if (vs, vsize, vh) != (n_stream, kv_size, n_head_kv):
            raise ValueError(f"v must be [n_stream={n_stream}, kv_size={kv_size}, n_head_kv={n_head_kv}, d_v], "
                             f"got shape {v.shape}")
    if d_v < 1 or d_v > LX_ATTN_MAX_D:
        raise ValueError(f"d_v = {d_v} must be in [1, {LX_ATTN_MAX_D}]")

    if isinstance(n_kv, bool) or not isinstance(n_kv, (int, np.integer)):
        raise TypeError(f"n_kv must be an int, got {type(n_kv).__name__}")
    if n_kv < 0 or n_kv > kv_size:
        raise ValueError(f"n_kv = {n_kv} must be in [0, kv_size = {kv_size}]")
    ms, n_tps_pad, mkv = mask.shape
    if ms != n_stream or mkv != n_kv or n_tps_pad < n_tps:
        raise ValueError(f"mask must be [n_stream={n_stream}, n_tps_pad>={n_tps}, n_kv={n_kv}], "
                         f"got shape {mask.shape}")
    if not np.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    if not np.isfinite(softcap) or softcap < 0:
        raise ValueError(f"softcap must be finite and >= 0 (0 = off), got {softcap}")

    if out is not None:
        _check_array(out, "out", np.float32)
        if out.shape != (n_tokens, n_head, d_v):
            raise ValueError(f"out must be [{n_tokens}, {n_head}, {d_v}], got shape {out.shape}")
        for name, a in (("q", q), ("k", k), ("v", v), ("mask", mask)):
            if np.may_share_memory(out, a):
                raise ValueError(f"out must not overlap {name}")

    p.n_stream = n_stream
    p.n_tps = n_tps
    p.n_tps_pad = n_tps_pad
    p.n_head = n_head
    p.n_head_kv = n_head_kv
    p.d_k = d_k
    p.d_v = d_v
    p.kv_size = kv_size
    p.n_kv = n_kv
    p.scale = <float> scale
    p.softcap = <float> softcap
    p.perm = NULL
    assert lx_attn_params_valid_vtrans(&p) if v_trans else lx_attn_params_valid(&p)
    return p


cdef object _set_perm(lx_attn_params *p, object perm):
    """p.perm <- perm (None, or int32 [n_stream, n_kv] of cells < kv_size); returns the array to keep."""
    if perm is None:
        return None
    a = np.ascontiguousarray(perm, dtype=np.int32)
    if a.shape != (p.n_stream, p.n_kv):
        raise ValueError(f"perm must be [n_stream, n_kv] = [{p.n_stream}, {p.n_kv}], got shape {a.shape}")
    if a.size and (a.min() < 0 or a.max() >= p.kv_size):
        raise ValueError(f"perm holds a cell outside [0, {p.kv_size})")
    p.perm = <const int32_t *> cnp.PyArray_DATA(<cnp.ndarray> a)
    return a


def attn(q, k, v, mask, out=None, *, n_kv, scale, softcap=0.0, v_trans=False, n_threads=None,
         use_scratch=True, type_k=None, type_v=None, perm=None):
    """Attention of q over the first n_kv cells of each stream of the cache (fast kernels).

    Args:
        q, k, v, mask, out: arrays of the layouts in the module docstring (out allocated if None).
        n_kv: cells per stream that take part, in [0, kv_size]; mask has n_kv columns.
        scale: multiplies q.k (usually 1/sqrt(d_k)).
        softcap: logit softcap (0 = off), applied as llama.cpp's path for the layout does.
        v_trans: v is the transposed V cache (llama.cpp without flash attention).
        n_threads: None / -1 = all cores, else >= 1; the result does not depend on it.
        use_scratch: pass the kernel the scratch that lets it split the KV range of few work
            items (decode) across threads and walk the cache chunk-major; False gives the same
            result bit for bit (a testing aid), only more slowly.
        perm: None, or int32 [n_stream, n_kv]: mask column j of stream s is cell perm[s, j]. A row
            sees its visible cells in column order, so a mask built over the cells sorted by
            position gives the same bits wherever the cells sit in the cache.
        type_k, type_v: the cache types, "f32" / "f16" / "q8_0" / "q4_0" (or ggml type numbers);
            None takes f32 / f16 from the dtype. A quantized k (or v) is uint8 [n_stream, kv_size,
            row_bytes] holding each cell's n_head_kv * d values as one row of blocks (n_head_kv is
            derived from the row size and q's head size, which must be a multiple of 32). A
            quantized V needs v_trans=False. Quantized K: q is quantized to q8_0 and the scores
            are integer block dots, as llama.cpp's flash attention computes them.

    Returns:
        out, float32 [n_tokens, n_head, d_v]. A token whose mask row is all -inf gets zeros.
        Hidden cells (mask -inf) are never read. Cost O(n_tokens * n_head * n_visible * (d_k + d_v)).

    Raises:
        ValueError / TypeError: a shape, dtype, layout or argument does not fit (message says which).
    """
    cdef lx_attn_params p = _attn_params(q, k, v, mask, out, n_kv, scale, softcap, v_trans, type_k, type_v)
    keep = _set_perm(&p, perm)
    cdef int nt = resolve_n_threads(n_threads)
    if out is None:
        out = np.empty((p.n_stream * p.n_tps, p.n_head, p.d_v), dtype=np.float32)
    cdef int64_t n_scratch = lx_attn_scratch_size(&p, nt) if use_scratch else 0
    scratch = np.empty(max(n_scratch, 1), dtype=np.float32)
    cdef const float[:, :, ::1] qv = q        # IN
    cdef const float[:, :, ::1] mv = mask     # IN
    cdef float[:, :, ::1] ov = out            # OUT
    cdef float[::1] sv = scratch              # scratch, [n_scratch]
    cdef const void *kp = cnp.PyArray_DATA(<cnp.ndarray> k)   # IN
    cdef const void *vp = cnp.PyArray_DATA(<cnp.ndarray> v)   # IN
    cdef bint vt = v_trans
    with nogil:
        if vt:
            lx_attn_vtrans(&p, &qv[0, 0, 0], kp, vp, &mv[0, 0, 0] if p.n_kv else NULL, &ov[0, 0, 0],
                           &sv[0] if n_scratch else NULL, n_scratch, nt)
        else:
            lx_attn_flash(&p, &qv[0, 0, 0], kp, vp, &mv[0, 0, 0] if p.n_kv else NULL, &ov[0, 0, 0],
                          &sv[0] if n_scratch else NULL, n_scratch, nt)
    return out


def attn_ref(q, k, v, mask, out=None, *, n_kv, scale, softcap=0.0, v_trans=False, n_threads=None,
             type_k=None, type_v=None, perm=None):
    """attn computed by the scalar oracles (lx_attn_flash_ref / lx_attn_vtrans_ref).

    Same arguments and checks as attn; n_threads is validated and ignored (single-threaded).
    """
    cdef lx_attn_params p = _attn_params(q, k, v, mask, out, n_kv, scale, softcap, v_trans, type_k, type_v)
    keep = _set_perm(&p, perm)
    resolve_n_threads(n_threads)
    if out is None:
        out = np.empty((p.n_stream * p.n_tps, p.n_head, p.d_v), dtype=np.float32)
    cdef const float[:, :, ::1] qv = q        # IN
    cdef const float[:, :, ::1] mv = mask     # IN
    cdef float[:, :, ::1] ov = out            # OUT
    cdef const void *kp = cnp.PyArray_DATA(<cnp.ndarray> k)   # IN
    cdef const void *vp = cnp.PyArray_DATA(<cnp.ndarray> v)   # IN
    cdef bint vt = v_trans
    with nogil:
        if vt:
            lx_attn_vtrans_ref(&p, &qv[0, 0, 0], kp, vp, &mv[0, 0, 0] if p.n_kv else NULL, &ov[0, 0, 0])
        else:
            lx_attn_flash_ref(&p, &qv[0, 0, 0], kp, vp, &mv[0, 0, 0] if p.n_kv else NULL, &ov[0, 0, 0])
    return out


# ---- the scores of a quantized K alone (testing the integer dots) ---------------------------------

cdef tuple _dots_q_check(object q, object k, object type_k):
    """(type, nh, d_k, n) of a dots_q* call, after checking q, k and type_k."""
    _check_array(q, "q", np.float32)
    if q.ndim != 2 or not q.flags.c_contiguous:
        raise ValueError(f"q must be C-contiguous float32 [nh, d_k], got shape {q.shape}")
    if type_k is None or not _quantized(_quants.type_id(type_k)):
        raise ValueError(f"type_k must be q8_0 or q4_0, got {type_k!r}")
    cdef int t = _type_from(type_k, k, "k")
    nh, d_k = q.shape
    if not 1 <= nh <= LX_ATTN_MAX_GROUP:
        raise ValueError(f"q has {nh} heads, must be in [1, {LX_ATTN_MAX_GROUP}]")
    if d_k < LX_QK or d_k % LX_QK != 0 or d_k > LX_ATTN_MAX_D:
        raise ValueError(f"d_k must be a multiple of {LX_QK} in [{LX_QK}, {LX_ATTN_MAX_D}], got {d_k}")
    rb = lx_row_bytes(<lx_type> t, d_k)
    if k.ndim != 2 or k.shape[0] < 1 or k.shape[1] != rb:
        raise ValueError(f"k must be uint8 [n >= 1, {rb}] ({_quants.type_name(t)} rows of d_k = {d_k}), "
                         f"got shape {k.shape}")
    return t, nh, d_k, k.shape[0]


cdef object _logits(scores, mask_values, float scale, bint ref):
    row = np.array(_check_array(scores, "scores", np.float32), copy=True)
    mv = _check_array(mask_values, "mask_values", np.float32)
    if row.ndim != 1 or mv.shape != row.shape or not 1 <= row.shape[0] <= LX_ATTN_CHUNK:
        raise ValueError(f"scores and mask_values must be float32 [n], 1 <= n <= {LX_ATTN_CHUNK}, "
                         f"got {row.shape} and {mv.shape}")
    cdef float[::1] rv = row              # IN / OUT
    cdef const float[::1] mvv = mv        # IN
    cdef int n = row.shape[0]
    cdef float m
    with nogil:
        m = lx_attn_logits_ref(&rv[0], n, scale, &mvv[0]) if ref else lx_attn_logits(&rv[0], n, scale, &mvv[0])
    return row, m


def logits(scores, mask_values, scale):
    """A chunk's logits as the attention kernels of the current SIMD level form them (no softcap).

    Args:
        scores: float32 [n], 1 <= n <= CHUNK, the raw scores q . k of one head.   # IN
        mask_values: float32 [n], the mask values of those cells.                  # IN
        scale: the attention scale.

    Returns:
        (logits float32 [n] = scores * scale + mask_values, their maximum as a float), lx_attn_logits.
    """
    return _logits(scores, mask_values, scale, False)


def logits_ref(scores, mask_values, scale):
    """logits by the scalar twin (lx_attn_logits_ref): the same bits at every level."""
    return _logits(scores, mask_values, scale, True)


def dots_q(q, k, *, type_k):
    """The scores of a quantized K as the attention kernels of the current SIMD level form them.

    Args:
        q: float32 [nh, d_k], 1 <= nh <= MAX_GROUP query heads of one kv head, d_k % 32 == 0.  # IN
        k: uint8 [n, row_bytes(type_k, d_k)], the K rows of n cells of that kv head, taken as one
            mask row's visible cells in order.                                                  # IN
        type_k: "q8_0" or "q4_0" (or the ggml type number).

    Returns:
        S, float32 [nh, n]: q_h quantized to q8_0, dotted block by block with K row j and scaled
        (lx_attn_dots_q). O(nh * n * d_k).

    Raises:
        ValueError / TypeError: a shape, dtype or type does not fit.
    """
    t, nh, d_k, n = _dots_q_check(q, k, type_k)
    S = np.empty((nh, n), dtype=np.float32)
    cdef const float[:, ::1] qv = q           # IN
    cdef float[:, ::1] sv = S                 # OUT
    cdef const void *kp = cnp.PyArray_DATA(<cnp.ndarray> k)   # IN
    cdef lx_type tt = <lx_type> t
    cdef int64_t dk = d_k, nn = n
    cdef int hh = nh
    with nogil:
        lx_attn_dots_q(tt, dk, &qv[0, 0], hh, kp, nn, &sv[0, 0])
    return S


def dots_q_ref(q, k, *, type_k):
    """dots_q by the oracle's arithmetic (lx_attn_dots_q_ref), with its integer block dots.

    Same arguments as dots_q. Returns (S float32 [nh, n], isum int32 [nh, n, d_k // 32]): isum[h, j, b]
    is the exact integer dot of q_h's quants with K row j's block b (q4_0: nibble - 8).
    """
    t, nh, d_k, n = _dots_q_check(q, k, type_k)
    S = np.empty((nh, n), dtype=np.float32)
    isum = np.empty((nh, n, d_k // LX_QK), dtype=np.int32)
    cdef const float[:, ::1] qv = q           # IN
    cdef float[:, ::1] sv = S                 # OUT
    cdef int32_t[:, :, ::1] iv = isum         # OUT
    cdef const void *kp = cnp.PyArray_DATA(<cnp.ndarray> k)   # IN
    cdef lx_type tt = <lx_type> t
    cdef int64_t dk = d_k, nn = n
    cdef int hh = nh
    with nogil:
        lx_attn_dots_q_ref(tt, dk, &qv[0, 0], hh, kp, nn, &sv[0, 0], &iv[0, 0, 0])
    return S, isum


def dots_q_vnni_emul(q, k, *, type_k):
    """dots_q with the AVX-512 VNNI kernel's arithmetic emulated in portable C (any CPU), step for
    step: its scores bit for bit (lx_attn_dots_q_vnni_emul).

    Same arguments as dots_q. Returns (S float32 [nh, n], isum int32 [nh, n, d_k // 32]): isum[h, j, b]
    is the sum of the emulated vpdpbusd int32 lanes of block b (with their -128 / -8 * sum(q) corrections).
    """
    t, nh, d_k, n = _dots_q_check(q, k, type_k)
    S = np.empty((nh, n), dtype=np.float32)
    isum = np.empty((nh, n, d_k // LX_QK), dtype=np.int32)
    cdef const float[:, ::1] qv = q           # IN
    cdef float[:, ::1] sv = S                 # OUT
    cdef int32_t[:, :, ::1] iv = isum         # OUT
    cdef const void *kp = cnp.PyArray_DATA(<cnp.ndarray> k)   # IN
    cdef lx_type tt = <lx_type> t
    cdef int64_t dk = d_k, nn = n
    cdef int hh = nh
    with nogil:
        lx_attn_dots_q_vnni_emul(tt, dk, &qv[0, 0], hh, kp, nn, &sv[0, 0], &iv[0, 0, 0])
    return S, isum
