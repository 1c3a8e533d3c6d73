# cython: language_level=3
"""The Mamba-1 layers of a model, each run by one native call (csrc/mamba_layer.h): the RMSNorm, the
in-projection, the causal convolution, the x-projection, the optional RMS norms of dt, B and C, the
dt-projection and its bias, the selective scan, the out-projection and the residual (and Jamba's
dense SwiGLU FFN after the mixer), over the recurrent states of the cells the memory chose, with the
GIL released for the whole stack.

MambaStack(layers) takes, per layer, its sizes and its weights (float32 vectors; each product as a
float32 [n_out, n_in] matrix for the ordered float product, or as parts like
llamax._native.layer.Stack's: (uint8 [rows, row_bytes] GGUF rows, ggml type), or (uint8 packed,
ggml type, rows, True) for gemm.pack_r8's layout); MambaStack.forward(x, views, n_t) runs every
layer over one equally split ubatch, views[il] being the memory's RecurrentView of layer il
(llamax.memory.recurrent: its conv and ssm states, the cell of each sequence, and the rollback rows
when the memory keeps them).
"""
import threading

import numpy as np

cimport numpy as cnp
from libc.stdint cimport int32_t, int64_t
from libc.stdlib cimport calloc, free

from llamax._native.layer cimport LX_LINEAR_MAX_PARTS, LX_OK, set_linear
from llamax._native.ssm cimport LX_SSM_MAX_CONV

cnp.import_array()

from llamax._native.recurrent_checks import undo as _check_undo
from llamax.threads import resolve_n_threads

cdef const float *f32_data(object a, tuple shape, str what, list keep) except? NULL:
    """a's data as float32 of this shape (C-contiguous; a copy kept when it is not), NULL for None."""
    if a is None:
        return NULL
    a = np.ascontiguousarray(a, dtype=np.float32)
    if a.shape != shape:
        raise ValueError(f"{what}: expected float32 {list(shape)}, got shape {a.shape}")
    keep.append(a)
    return <const float *> cnp.PyArray_DATA(<cnp.ndarray> a)


cdef int set_product(lx_mamba_product *m, object spec, int64_t n_in, int64_t n_out, str what, list keep) except -1:
    """m <- a float32 matrix [n_out, n_in] (the ordered float product) or a list of parts."""
    m.lin.n_in, m.lin.n_out, m.lin.n_parts, m.f32 = n_in, n_out, 0, NULL
    if isinstance(spec, np.ndarray):
        m.f32 = f32_data(spec, (n_out, n_in), what, keep)
        return 0
    if not isinstance(spec, (list, tuple)):
        raise ValueError(f"{what}: a float32 matrix or 1 to {LX_LINEAR_MAX_PARTS} parts expected")
    set_linear(&m.lin, spec, n_in, n_out, what, keep)
    return 0


cdef class MambaStack:
    """A model's Mamba-1 layers for the native step (one C call for all of them, GIL released)."""

    cdef lx_mamba_params *params
    cdef lx_mamba_weights *weights
    cdef readonly int n_layer
    cdef readonly int64_t n_embd
    cdef list _keep
    cdef object _work     # threading.local: .buf, the calling thread's work buffer, kept between calls

    def __cinit__(self):
        self.params = NULL
        self.weights = NULL

    def __dealloc__(self):
        free(self.params)
        free(self.weights)

    def __init__(self, list layers):
        """layers: one dict per layer with
            n_embd, d_inner, d_state, dt_rank, d_conv, eps, n_ff (0 or absent: no FFN block),
            norm [n_embd], conv_w [d_inner, d_conv], conv_b [d_inner], dt_b [d_inner],
            A [d_inner, d_state], D [d_inner]: float32;
            dt_norm [dt_rank], b_norm, c_norm [d_state]: float32, all three or none (None);
            ffn_norm [n_embd] (with n_ff);
            ssm_in [2 d_inner, n_embd], ssm_x [dt_rank + 2 d_state, d_inner], ssm_dt [d_inner, dt_rank],
            ssm_out [n_embd, d_inner], w_gate_up [2 n_ff, n_embd], w_down [n_embd, n_ff]: each a float32
                matrix (the ordered float product) or a list of parts, (raw uint8 [rows, row_bytes], ggml
                type) or (packed r8 uint8, ggml type, rows, True).
        Raises:
            ValueError: a size, shape or type does not fit."""
        self.n_layer = len(layers)
        if self.n_layer < 1:
            raise ValueError("a stack needs at least one layer")
        self.params = <lx_mamba_params *> calloc(self.n_layer, sizeof(lx_mamba_params))
        self.weights = <lx_mamba_weights *> calloc(self.n_layer, sizeof(lx_mamba_weights))
        if self.params == NULL or self.weights == NULL:
            raise MemoryError()
        self._keep = []
        self._work = threading.local()
        cdef lx_mamba_params *p
        cdef lx_mamba_weights *w
        cdef int64_t E, di, ds, dr, f
        for il, d in enumerate(layers):
            p, w = &self.params[il], &self.weights[il]
            E, di, ds, dr, f = d["n_embd"], d["d_inner"], d["d_state"], d["dt_rank"], d.get("n_ff", 0) or 0
            if min(E, di, ds, dr) < 1 or f < 0:
                raise ValueError(f"layer {il}: sizes must be positive (n_ff >= 0)")
            if not 1 <= d["d_conv"] <= LX_SSM_MAX_CONV:
                raise ValueError(f"layer {il}: d_conv must be in [1, {LX_SSM_MAX_CONV}], got {d['d_conv']}")
            p.n_embd, p.d_inner, p.d_state, p.dt_rank, p.n_ff = E, di, ds, dr, f
            p.d_conv, p.eps = d["d_conv"], d["eps"]
            norms = [d.get(k) is None for k in ("dt_norm", "b_norm", "c_norm")]
            if any(norms) and not all(norms):
                raise ValueError(f"layer {il}: dt_norm, b_norm and c_norm go together")
            for name in ("norm", "conv_w", "conv_b", "dt_b", "A", "D"):
                if d[name] is None:
                    raise ValueError(f"layer {il}: {name} is required")
            w.norm = f32_data(d["norm"], (E,), "norm", self._keep)
            w.conv_w = f32_data(d["conv_w"], (di, p.d_conv), "conv_w", self._keep)
            w.conv_b = f32_data(d["conv_b"], (di,), "conv_b", self._keep)
            w.dt_norm = f32_data(d.get("dt_norm"), (dr,), "dt_norm", self._keep)
            w.b_norm = f32_data(d.get("b_norm"), (ds,), "b_norm", self._keep)
            w.c_norm = f32_data(d.get("c_norm"), (ds,), "c_norm", self._keep)
            w.dt_b = f32_data(d["dt_b"], (di,), "dt_b", self._keep)
            w.A = f32_data(d["A"], (di, ds), "A", self._keep)
            w.D = f32_data(d["D"], (di,), "D", self._keep)
            set_product(&w.ssm_in, d["ssm_in"], E, 2 * di, "ssm_in", self._keep)
            set_product(&w.ssm_x, d["ssm_x"], di, dr + 2 * ds, "ssm_x", self._keep)
            set_product(&w.ssm_dt, d["ssm_dt"], dr, di, "ssm_dt", self._keep)
            set_product(&w.ssm_out, d["ssm_out"], di, E, "ssm_out", self._keep)
            if f > 0:
                if d.get("ffn_norm") is None:
                    raise ValueError(f"layer {il}: an FFN block needs ffn_norm")
                w.ffn_norm = f32_data(d["ffn_norm"], (E,), "ffn_norm", self._keep)
                set_product(&w.w_gate_up, d["w_gate_up"], E, 2 * f, "w_gate_up", self._keep)
                set_product(&w.w_down, d["w_down"], f, E, "w_down", self._keep)
            if il and E != self.params[0].n_embd:
                raise ValueError(f"layer {il}: n_embd {E}, layer 0's is {self.params[0].n_embd}")
        self.n_embd = self.params[0].n_embd

    def forward(self, x, list views, int64_t n_t, n_threads=None):
        """Run every layer over one equally split ubatch.

        Args:
            x: float32 [n_seqs * n_t, n_embd], C-contiguous: the embeddings; overwritten with the
                hidden states after the last layer.  # IN/OUT
            views: [n_layer] RecurrentView of each layer (llamax.memory.recurrent), for this ubatch:
                conv float32 [n_cells, d_inner, d_conv - 1] and ssm [n_cells, d_inner, d_state], updated
                in place; cells int32 [n_seqs]; conv_hist / ssm_hist None or float32 [n_cells, n_hist,
                ...] (the rollback rows, written) with hist_row None or int32 [n_seqs].  # IN/OUT
            n_t: tokens per sequence.
        Returns:
            x.
        Raises:
            ValueError: a shape, type or view does not fit, a cell out of range or repeated, a history
                row out of range (checked for every layer before any is run: nothing written then).
        """
        cdef int nt = resolve_n_threads(n_threads)
        if not isinstance(x, np.ndarray) or x.dtype != np.float32 or x.ndim != 2 or not x.flags.c_contiguous \
                or not x.flags.writeable or x.shape[1] != self.n_embd:
            raise ValueError(f"x must be writeable C-contiguous float32 [n, {self.n_embd}]")
        cdef int64_t n = x.shape[0]
        if n_t < 1 or n % n_t:
            raise ValueError(f"n_t = {n_t} must be positive and divide the {n} rows of x")
        cdef int64_t n_seqs = n // n_t
        if len(views) != self.n_layer:
            raise ValueError(f"{len(views)} views for {self.n_layer} layers")
        cdef lx_mamba_state *sts = <lx_mamba_state *> calloc(self.n_layer, sizeof(lx_mamba_state))
        if sts == NULL:
            raise MemoryError()
        cdef size_t need = 0, s
        cdef int il
        cdef lx_status st = LX_OK
        cdef float *xp = <float *> cnp.PyArray_DATA(<cnp.ndarray> x)
        cdef void *wp
        try:
            for il in range(self.n_layer):
                set_state(&sts[il], views[il], n_seqs, (self.params[il].d_inner, self.params[il].d_conv - 1),
                          (self.params[il].d_inner, self.params[il].d_state), il)
                if not lx_mamba_layer_valid(&self.params[il], &self.weights[il], &sts[il], n_seqs, n_t):
                    raise ValueError(f"layer {il}: a cell out of range or repeated, or a history row out of "
                                     f"range (cells {views[il].cells.tolist()}, hist_row "
                                     f"{None if views[il].hist_row is None else views[il].hist_row.tolist()})")
                s = lx_mamba_layer_work_size(&self.params[il], &self.weights[il], n_seqs, n_t, nt)
                need = s if s > need else need
            # one buffer per calling thread, grown as needed: a decode step allocates nothing
            work = getattr(self._work, "buf", None)
            if work is None or work.size < need:
                work = self._work.buf = np.empty(need, dtype=np.uint8)
            wp = cnp.PyArray_DATA(<cnp.ndarray> work)
            with nogil:   # every layer in one call (one parallel region for a generation step)
                st = lx_mamba_stack_forward(self.params, self.weights, sts, self.n_layer, xp, n_seqs, n_t, wp, nt)
        finally:
            free(sts)
        if st != LX_OK:   # not reached: every layer was checked above
            raise ValueError("the native step refused its arguments")
        return x


cdef inline bint _is_f32(object a, int ndim):
    return (isinstance(a, np.ndarray) and a.dtype == np.float32 and a.ndim == ndim and a.flags.c_contiguous
            and a.flags.writeable)


cdef int set_state(lx_mamba_state *st, object v, int64_t n_seqs, tuple conv_row, tuple ssm_row, int il) except -1:
    """st <- a RecurrentView (conv, ssm, cells, conv_hist, ssm_hist, hist_row), its shapes checked against
    the layer's: conv [n_cells, *conv_row], ssm [n_cells, *ssm_row] (the ranges of cells and hist_row are
    lx_mamba_state_valid's)."""
    conv, ssm, cells = v.conv, v.ssm, v.cells
    if not _is_f32(conv, 1 + len(conv_row)) or not _is_f32(ssm, 1 + len(ssm_row)):
        raise ValueError(f"layer {il}: the view's conv / ssm must be writeable C-contiguous float32 arrays of "
                         f"{1 + len(conv_row)} and {1 + len(ssm_row)} dimensions")
    cdef int64_t n_cells = conv.shape[0]
    if conv.shape[1:] != conv_row:
        raise ValueError(f"layer {il}: conv states of shape {conv.shape}, expected [n_cells, "
                         f"{', '.join(map(str, conv_row))}]")
    if ssm.shape != (n_cells,) + ssm_row:
        raise ValueError(f"layer {il}: ssm states of shape {ssm.shape}, expected [{n_cells}, "
                         f"{', '.join(map(str, ssm_row))}]")
    if not isinstance(cells, np.ndarray) or cells.dtype != np.int32 or cells.ndim != 1 \
            or not cells.flags.c_contiguous or cells.shape[0] != n_seqs:
        raise ValueError(f"layer {il}: cells must be a C-contiguous int32 array [n_seqs = {n_seqs}]")
    st.conv = <float *> cnp.PyArray_DATA(<cnp.ndarray> conv)
    st.ssm = <float *> cnp.PyArray_DATA(<cnp.ndarray> ssm)
    st.n_cells = n_cells
    st.cells = <const int32_t *> cnp.PyArray_DATA(<cnp.ndarray> cells)
    st.conv_hist, st.ssm_hist, st.n_hist, st.hist_row = NULL, NULL, 0, NULL
    st.ssm_undo, st.n_undo, st.undo_slot = NULL, 0, NULL
    _check_undo(v.ssm_undo, v.undo_slot, ssm, n_seqs)   # the ranges and distinct rows are lx_mamba_state_valid's too
    if v.ssm_undo is not None and v.ssm_undo.size:
        st.ssm_undo = <float *> cnp.PyArray_DATA(<cnp.ndarray> v.ssm_undo)
        st.n_undo = v.ssm_undo.shape[0]
        st.undo_slot = <int32_t *> cnp.PyArray_DATA(<cnp.ndarray> v.undo_slot)
    ch, sh, hr = v.conv_hist, v.ssm_hist, v.hist_row
    if ch is None and sh is None:
        if hr is not None:
            raise ValueError(f"layer {il}: hist_row without the history rows")
        return 0
    if not _is_f32(ch, conv.ndim + 1) or not _is_f32(sh, ssm.ndim + 1):
        raise ValueError(f"layer {il}: conv_hist / ssm_hist must be writeable C-contiguous float32 arrays of one "
                         f"more dimension than the states")
    cdef int64_t n_hist = ch.shape[1]
    if ch.shape != (n_cells, n_hist) + conv.shape[1:] or sh.shape != (n_cells, n_hist) + ssm.shape[1:]:
        raise ValueError(f"layer {il}: history rows of shapes {ch.shape} and {sh.shape} do not fit the states "
                         f"{conv.shape} and {ssm.shape}")
    if np.may_share_memory(ch, conv) or np.may_share_memory(sh, ssm):
        raise ValueError(f"layer {il}: the history rows must not overlap the states")
    if hr is not None:
        if not isinstance(hr, np.ndarray) or hr.dtype != np.int32 or hr.ndim != 1 or not hr.flags.c_contiguous \
                or hr.shape[0] != n_seqs:
            raise ValueError(f"layer {il}: hist_row must be a C-contiguous int32 array [n_seqs = {n_seqs}]")
        if n_hist == 0:
            raise ValueError(f"layer {il}: hist_row with no history rows (n_hist 0)")
    if n_hist == 0:
        return 0   # no rows to write
    # an empty buffer (d_conv 1: no conv state) is none (ssm.h: hist NULL), as the ssm module passes it
    st.conv_hist = <float *> cnp.PyArray_DATA(<cnp.ndarray> ch) if ch.size else NULL
    st.ssm_hist = <float *> cnp.PyArray_DATA(<cnp.ndarray> sh) if sh.size else NULL
    st.n_hist = n_hist
    if hr is not None:
        st.hist_row = <const int32_t *> cnp.PyArray_DATA(<cnp.ndarray> hr)
    return 0
