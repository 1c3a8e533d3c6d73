# cython: language_level=3
"""The mixture-of-experts feed-forward of a layer (csrc/moe.h: llama.cpp's build_moe_ffn as qwen3moe
calls it) in one native call, GIL released: the router product, softmax or sigmoid gating, the top-k
experts of every token and their weights, each routed expert's SwiGLU (or GEGLU) product over only the
tokens routed to it, and the weighted sum in slot order.

MoE(router, gate, up, down, n_used, ...) takes the weights as stored in a GGUF: each a pair (uint8
bytes, ggml type number): the router W_gate_inp [n_expert, row_bytes] (GGUF rows), the experts
[n_expert, rows, row_bytes] (ffn_gate_exps / ffn_up_exps: n_ff_exp rows of n_embd; ffn_down_exps:
n_embd rows of n_ff_exp). An expert of a type with gemm.h's r8 layout (gemm.R8_TYPES) is repacked to it
once, each expert on its own (pack_experts), unless r8=False; every product is csrc/product.h's for
its type and layout, so the results do not depend on the layout, the batch or n_threads.
"""
import numpy as np

cimport numpy as cnp
from cpython.mem cimport PyMem_RawFree, PyMem_RawMalloc
from libc.stdint cimport int32_t, int64_t

from llamax._native.gemm cimport lx_gemm_pack_r8, lx_gemm_r8_supported
from llamax._native.layer cimport LX_ACT_GELU_TABLE, LX_ACT_SILU
from llamax._native.product cimport LX_PRODUCT_NONE, lx_product_kind_of
from llamax._native.quants cimport lx_row_bytes, lx_type, lx_type_block_size

# the declarations of csrc/moe.h come from moe.pxd (same module name)

cnp.import_array()

from llamax.threads import resolve_n_threads

#: router gating functions (llama_expert_gating_func_type's softmax and sigmoid)
GATINGS = {"softmax": <int> LX_MOE_SOFTMAX, "sigmoid": <int> LX_MOE_SIGMOID}
#: expert activations: "silu" (SwiGLU: qwen3moe), "gelu_table" (GEGLU from ggml's f16 table)
ACTS = {"silu": <int> LX_ACT_SILU, "gelu_table": <int> LX_ACT_GELU_TABLE}


cdef lx_type _type(object t, str what) except *:
    """a ggml type number with a weight product (product.h) over GGUF rows"""
    if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
        raise TypeError(f"{what}: the ggml type must be an int, got {type(t).__name__}")
    if not 0 <= int(t) < 64 or lx_product_kind_of(<lx_type> <int> int(t), 0) == LX_PRODUCT_NONE:
        raise ValueError(f"{what}: ggml type {int(t)} has no weight product")
    return <lx_type> <int> int(t)


cdef object _raw(object spec, int ndim, str what):
    """(raw, type) of a weight, raw a C-contiguous uint8 array of ndim dimensions"""
    if not isinstance(spec, tuple) or len(spec) != 2:
        raise TypeError(f"{what}: expected a pair (raw uint8 array, ggml type), got {type(spec).__name__}")
    raw, t = spec
    if not isinstance(raw, np.ndarray):
        raise TypeError(f"{what}: raw must be a numpy array, got {type(raw).__name__}")
    if raw.dtype != np.uint8 or raw.ndim != ndim or not raw.flags.c_contiguous:
        dims = "[n_expert, row_bytes]" if ndim == 2 else "[n_expert, rows, row_bytes]"
        raise ValueError(f"{what}: raw must be a C-contiguous uint8 array {dims}, got {raw.dtype} shape {raw.shape}")
    return raw


cdef void _check_rows(object raw, lx_type t, int64_t n_in, str what) except *:
    cdef int64_t bs = lx_type_block_size(t)
    if n_in % bs:
        raise ValueError(f"{what}: rows of {n_in} values are not whole blocks of ggml type {<int> t} ({bs})")
    if <size_t> raw.shape[raw.ndim - 1] != lx_row_bytes(t, n_in):
        raise ValueError(f"{what}: a row of {n_in} values of ggml type {<int> t} takes {lx_row_bytes(t, n_in)} bytes, "
                         f"the rows hold {raw.shape[raw.ndim - 1]}")


def pack_experts(raw, ggml_type, out=None):
    """Every expert of raw uint8 [n_expert, rows, row_bytes] in gemm.h's r8 layout, each packed on its
    own (gemm.pack_r8): uint8 [n_expert, ceil(rows / 8) * 8, row_bytes]. out: a writeable C-contiguous
    uint8 array of that shape to pack into (returned), else a new one. ggml_type in gemm.R8_TYPES."""
    cdef lx_type t = _type(ggml_type, "pack_experts")
    if not lx_gemm_r8_supported(t):
        raise ValueError(f"pack_experts: ggml type {<int> t} has no r8 layout")
    raw = _raw((raw, ggml_type), 3, "pack_experts")
    cdef int64_t bb = lx_row_bytes(t, lx_type_block_size(t))
    if raw.shape[2] == 0 or raw.shape[2] % bb:
        raise ValueError(f"pack_experts: rows of {raw.shape[2]} bytes are not whole blocks of ggml type {<int> t}")
    cdef int64_t n_expert = raw.shape[0], rows = raw.shape[1], rb = raw.shape[2]
    cdef int64_t n_in = rb // bb * lx_type_block_size(t), rows8 = (rows + 7) // 8 * 8
    shape = (n_expert, rows8, rb)
    if out is None:
        out = np.empty(shape, dtype=np.uint8)
    elif not isinstance(out, np.ndarray) or out.dtype != np.uint8 or out.shape != shape \
            or not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"pack_experts: out must be a writeable C-contiguous uint8 array of shape {shape}")
    cdef const unsigned char *src = <const unsigned char *> cnp.PyArray_DATA(<cnp.ndarray> raw)
    cdef unsigned char *dst = <unsigned char *> cnp.PyArray_DATA(<cnp.ndarray> out)
    cdef int64_t e
    if rows:
        with nogil:
            for e in range(n_expert):
                lx_gemm_pack_r8(t, src + e * rows * rb, dst + e * rows8 * rb, n_in, rows)
    return out


cdef void _experts(lx_experts *e, object raw, lx_type t, int64_t rows, bint packed) except *:
    e.w = cnp.PyArray_DATA(<cnp.ndarray> raw)
    e.type = t
    e.r8 = 1 if packed else 0
    e.rows = rows
    e.expert_bytes = <size_t> raw.shape[1] * <size_t> raw.shape[2]


cdef class MoE:
    """The MoE feed-forward y = moe(x) of x [n, n_embd] (already ffn-normed), as csrc/moe.h computes it.

    Holds its weights (the arrays given, or their r8 packing) and the constants; forward and route
    may be called from several threads at once (each call has its own work buffer).
    """
    # attributes in moe.pxd (the layer step reads p and w)

    def __init__(self, router, gate, up, down, int64_t n_used, *, str gating="softmax", bint norm_w=False,
                 float w_scale=0.0, str act="silu", gelu_table=None, bint r8=True):
        """Args:
            router: (uint8 [n_expert, row_bytes], ggml type): W_gate_inp as GGUF rows.  # IN
            gate, up: (uint8 [n_expert, n_ff_exp, row_bytes], ggml type): the experts' gate / up rows
                of n_embd values.  # IN
            down: (uint8 [n_expert, n_embd, row_bytes], ggml type): the experts' down rows of n_ff_exp
                values.  # IN
            n_used: experts per token, 1 <= n_used <= n_expert.
            gating: "softmax" or "sigmoid".
            norm_w: divide each token's top-k weights by their sum (clamped at 2^-14, as llama.cpp).
            w_scale: the weights times this (0 or 1: unscaled).
            act: "silu" or "gelu_table" (then gelu_table: float32 [65536], by f16 bits).
            r8: repack the experts of the gemm.R8_TYPES types to gemm.h's r8 layout (each on its own).

        Raises:
            TypeError: a weight not given as (numpy array, int type).
            ValueError: a type without a product, shapes or row bytes that disagree, n_used out of
                range, an unknown gating or activation, a missing or mis-shaped GELU table.
        """
        r_raw, g_raw = _raw(router, 2, "router"), _raw(gate, 3, "gate")
        u_raw, d_raw = _raw(up, 3, "up"), _raw(down, 3, "down")
        cdef lx_type rt = _type(router[1], "router"), gt = _type(gate[1], "gate")
        cdef lx_type ut = _type(up[1], "up"), dt = _type(down[1], "down")
        cdef int64_t n_expert = r_raw.shape[0], n_ff = g_raw.shape[1], n_embd = d_raw.shape[1]
        if n_expert < 1 or n_ff < 1 or n_embd < 1:
            raise ValueError(f"empty MoE: n_expert {n_expert}, n_ff_exp {n_ff}, n_embd {n_embd}")
        if g_raw.shape[0] != n_expert or u_raw.shape[:2] != g_raw.shape[:2] or d_raw.shape[0] != n_expert:
            raise ValueError(f"the experts disagree: router {r_raw.shape[0]} experts, gate {g_raw.shape[:2]}, "
                             f"up {u_raw.shape[:2]}, down {d_raw.shape[:2]} (want [n_expert, n_ff_exp] for gate "
                             f"and up, [n_expert, n_embd] for down)")
        _check_rows(r_raw, rt, n_embd, "router")
        _check_rows(g_raw, gt, n_embd, "gate")
        _check_rows(u_raw, ut, n_embd, "up")
        _check_rows(d_raw, dt, n_ff, "down")
        if not 1 <= n_used <= n_expert:
            raise ValueError(f"n_used = {n_used} must be in [1, n_expert = {n_expert}]")
        if gating not in GATINGS:
            raise ValueError(f"gating {gating!r}, known: {sorted(GATINGS)}")
        if act not in ACTS:
            raise ValueError(f"activation {act!r}, known: {sorted(ACTS)}")
        self._table = None
        if act == "gelu_table":
            if gelu_table is None:
                raise ValueError("the gelu_table activation needs its table")
            table = np.ascontiguousarray(gelu_table, dtype=np.float32)
            if table.ndim != 1 or table.shape[0] != 65536:
                raise ValueError(f"gelu_table: expected float32 [65536], got shape {table.shape}")
            self._table = table

        self.router = r_raw
        self.gate = pack_experts(g_raw, gt) if r8 and lx_gemm_r8_supported(gt) else g_raw
        self.up = pack_experts(u_raw, ut) if r8 and lx_gemm_r8_supported(ut) else u_raw
        self.down = pack_experts(d_raw, dt) if r8 and lx_gemm_r8_supported(dt) else d_raw

        self.p.n_embd, self.p.n_ff_exp, self.p.n_expert, self.p.n_used = n_embd, n_ff, n_expert, n_used
        self.p.gating = <lx_moe_gating> <int> GATINGS[gating]
        self.p.norm_w = 1 if norm_w else 0
        self.p.w_scale = w_scale
        self.p.act = ACTS[act]
        self.p.gelu_table = <const float *> cnp.PyArray_DATA(<cnp.ndarray> self._table) if self._table is not None \
            else NULL
        self.w.router = cnp.PyArray_DATA(<cnp.ndarray> r_raw)
        self.w.router_type, self.w.router_r8 = rt, 0
        _experts(&self.w.gate, self.gate, gt, n_ff, self.gate is not g_raw)
        _experts(&self.w.up, self.up, ut, n_ff, self.up is not u_raw)
        _experts(&self.w.down, self.down, dt, n_embd, self.down is not d_raw)
        if not lx_moe_valid(&self.p, &self.w):
            raise ValueError("the MoE's shapes and types are inconsistent")

    @property
    def n_embd(self) -> int:
        return self.p.n_embd

    @property
    def n_ff_exp(self) -> int:
        return self.p.n_ff_exp

    @property
    def n_expert(self) -> int:
        return self.p.n_expert

    @property
    def n_used(self) -> int:
        return self.p.n_used

    cdef object _x(self, object x):
        if not isinstance(x, np.ndarray):
            raise TypeError(f"x must be a numpy array, got {type(x).__name__}")
        if x.dtype != np.float32 or x.ndim != 2 or not x.flags.c_contiguous or x.shape[1] != self.p.n_embd:
            raise ValueError(f"x must be a C-contiguous float32 array [n, {self.p.n_embd}], got {x.dtype} "
                             f"shape {x.shape}")
        if not np.isfinite(x).all():
            raise ValueError("x must be finite")
        return x

    def forward(self, x, n_threads=None, bint ref=False, out=None):
        """y = moe(x) (csrc/moe.h's steps).

        Args:
            x: float32 [n, n_embd], C-contiguous, finite.  # IN
            n_threads: threads (None or -1 = all cores); the bits do not depend on it.
            ref: run the reference (one token at a time, single-threaded): the same bits.
            out: float32 [n, n_embd], C-contiguous, writeable: where y goes (x's memory: in place), or
                None for a new array.  # OUT

        Returns:
            y (out when given). Row t depends on x[t] only (the same bits in any batch). Cost: each routed expert's
            weights are read once per 64 of its rows (csrc/moe.h's units), O(n n_used n_embd n_ff_exp).

        Raises:
            TypeError / ValueError: x not such an array or not finite; out of another shape or
                overlapping x without being x; bad n_threads.
        """
        cdef int nt = resolve_n_threads(n_threads)
        x = self._x(x)
        cdef int64_t n = x.shape[0]
        if out is None:
            y = np.empty((n, self.p.n_embd), dtype=np.float32)
        elif not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.shape != x.shape \
                or not out.flags.c_contiguous or not out.flags.writeable:
            raise ValueError(f"out must be a writeable C-contiguous float32 array of shape {x.shape}")
        elif cnp.PyArray_DATA(<cnp.ndarray> out) != cnp.PyArray_DATA(<cnp.ndarray> x) and np.may_share_memory(out, x):
            raise ValueError("out must be x itself or not overlap it")
        else:
            y = out
        if n == 0:
            return y
        cdef size_t ws = lx_moe_work_size(&self.p, &self.w, n, 1 if ref else nt)
        cdef void *work = PyMem_RawMalloc(ws)
        if work == NULL:
            raise MemoryError(f"moe: cannot allocate {ws} bytes of work")
        cdef const float *xp = <const float *> cnp.PyArray_DATA(<cnp.ndarray> x)
        cdef float *yp = <float *> cnp.PyArray_DATA(<cnp.ndarray> y)
        cdef lx_status st
        try:
            with nogil:
                if ref:
                    st = lx_moe_ffn_ref(&self.p, &self.w, xp, yp, n, work)
                else:
                    st = lx_moe_ffn(&self.p, &self.w, xp, yp, n, work, nt)
        finally:
            PyMem_RawFree(work)
        if st != 0:
            raise ValueError(f"moe: the native call refused its arguments (status {<int> st})")
        return y

    def route(self, x, n_threads=None):
        """The routing of x [n, n_embd]: (ids int32 [n, n_used], weights float32 [n, n_used]): each
        token's experts by rank (descending probability, ties to the lower id) and their weights
        (after norm_w and w_scale), as forward uses them."""
        cdef int nt = resolve_n_threads(n_threads)
        x = self._x(x)
        cdef int64_t n = x.shape[0]
        ids = np.empty((n, self.p.n_used), dtype=np.int32)
        wts = np.empty((n, self.p.n_used), dtype=np.float32)
        if n == 0:
            return ids, wts
        cdef size_t ws = lx_moe_work_size(&self.p, &self.w, n, nt)
        cdef void *work = PyMem_RawMalloc(ws)
        if work == NULL:
            raise MemoryError(f"moe: cannot allocate {ws} bytes of work")
        cdef const float *xp = <const float *> cnp.PyArray_DATA(<cnp.ndarray> x)
        cdef int32_t *ip = <int32_t *> cnp.PyArray_DATA(<cnp.ndarray> ids)
        cdef float *wp = <float *> cnp.PyArray_DATA(<cnp.ndarray> wts)
        cdef lx_status st
        try:
            with nogil:
                st = lx_moe_route(&self.p, &self.w, xp, n, ip, wp, work, nt)
        finally:
            PyMem_RawFree(work)
        if st != 0:
            raise ValueError(f"moe: the native call refused its arguments (status {<int> st})")
        return ids, wts
