# cython: language_level=3
"""A model's Mamba-2 mixers, each run by one native call (csrc/mamba2_layer.h): the in-projection, the
causal convolution of x, B and C, dt's bias, the selective scan with its skip and gate, the grouped RMS
norm and the out-projection, over the recurrent states of the cells the memory chose, with the GIL
released.

Mamba2Layers(layers) takes, per layer, its sizes and weights (float32 vectors; each product as a float32
[n_out, n_in] matrix for the ordered float product, or as parts, as llamax._native.mamba_layer.MambaStack
takes them). Mamba2Layers.forward(x, views, n_t) runs every layer with its pre-norm and residual (the
mamba2 architecture: x += mixer(rms_norm(x, norm))) in one call; Mamba2Layers.mixer(il, h, view, n_t)
runs layer il's mixer alone on normed hidden states (the hybrids, whose other blocks sit between the
mixers). views[il] / view: the memory's RecurrentView of the layer (llamax.memory.recurrent).
"""
import threading

import numpy as np

cimport numpy as cnp
from libc.stdint cimport int64_t
from libc.stdlib cimport calloc, free

from llamax._native.layer cimport LX_OK
from llamax._native.mamba_layer cimport f32_data, lx_mamba_state, set_product, set_state
from llamax._native.ssm cimport LX_SSM_MAX_CONV

cnp.import_array()

from llamax.threads import resolve_n_threads


cdef class Mamba2Layers:
    """A model's Mamba-2 mixers for the native step (GIL released)."""

    cdef lx_mamba2_params *params
    cdef lx_mamba2_weights *weights
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
            n_embd, d_inner, d_state, n_group, n_head, d_conv, eps;
            norm [n_embd] or None (then forward refuses: only mixer runs the layer);
            conv_w [conv_dim, d_conv], conv_b [conv_dim] (conv_dim = d_inner + 2 n_group d_state),
            dt_b, A, D [n_head], ssm_norm [n_group, d_inner / n_group]: float32;
            ssm_in [d_inner + conv_dim + n_head, n_embd], ssm_out [n_embd, d_inner]: each a float32 matrix
                (the ordered float product) or a list of parts (MambaStack's).
        Raises:
            ValueError: a size, shape or type does not fit."""
        self.n_layer = len(layers)
        if self.n_layer < 1:
            raise ValueError("Mamba2Layers needs at least one layer")
        self.params = <lx_mamba2_params *> calloc(self.n_layer, sizeof(lx_mamba2_params))
        self.weights = <lx_mamba2_weights *> calloc(self.n_layer, sizeof(lx_mamba2_weights))
        if self.params == NULL or self.weights == NULL:
            raise MemoryError()
        self._keep = []
        self._work = threading.local()
        cdef lx_mamba2_params *p
        cdef lx_mamba2_weights *w
        cdef int64_t E, di, ds, ng, nh, cd
        for il, d in enumerate(layers):
            p, w = &self.params[il], &self.weights[il]
            E, di, ds, ng, nh = d["n_embd"], d["d_inner"], d["d_state"], d["n_group"], d["n_head"]
            if min(E, di, ds, ng, nh) < 1 or nh % ng or di % nh:
                raise ValueError(f"layer {il}: sizes must be positive, n_group dividing n_head dividing d_inner")
            if not 1 <= d["d_conv"] <= LX_SSM_MAX_CONV:
                raise ValueError(f"layer {il}: d_conv must be in [1, {LX_SSM_MAX_CONV}], got {d['d_conv']}")
            for name in ("conv_w", "conv_b", "dt_b", "A", "D", "ssm_norm"):
                if d[name] is None:
                    raise ValueError(f"layer {il}: {name} is required")
            cd = di + 2 * ng * ds
            p.n_embd, p.d_inner, p.d_state, p.n_group, p.n_head = E, di, ds, ng, nh
            p.d_conv, p.eps = d["d_conv"], d["eps"]
            w.norm = f32_data(d.get("norm"), (E,), "norm", self._keep)
            w.conv_w = f32_data(d["conv_w"], (cd, p.d_conv), "conv_w", self._keep)
            w.conv_b = f32_data(d["conv_b"], (cd,), "conv_b", self._keep)
            w.dt_b = f32_data(d["dt_b"], (nh,), "dt_b", self._keep)
            w.A = f32_data(d["A"], (nh,), "A", self._keep)
            w.D = f32_data(d["D"], (nh,), "D", self._keep)
            w.ssm_norm = f32_data(d["ssm_norm"], (ng, di // ng), "ssm_norm", self._keep)
            set_product(&w.ssm_in, d["ssm_in"], E, di + cd + nh, "ssm_in", self._keep)
            set_product(&w.ssm_out, d["ssm_out"], di, E, "ssm_out", self._keep)
            if il and E != self.params[0].n_embd:
                raise ValueError(f"layer {il}: n_embd {E}, layer 0's is {self.params[0].n_embd}")
        self.n_embd = self.params[0].n_embd

    cdef void *_buffer(self, size_t need):
        """the calling thread's work buffer of at least need bytes (kept: a decode step allocates nothing)"""
        work = getattr(self._work, "buf", None)
        if work is None or work.size < need:
            work = self._work.buf = np.empty(need, dtype=np.uint8)
        return cnp.PyArray_DATA(<cnp.ndarray> work)

    cdef int _rows(self, object a, str what) except -1:
        if not isinstance(a, np.ndarray) or a.dtype != np.float32 or a.ndim != 2 or not a.flags.c_contiguous \
                or a.shape[1] != self.n_embd:
            raise ValueError(f"{what} must be C-contiguous float32 [n, {self.n_embd}]")
        return 0

    cdef int _state(self, lx_mamba_state *st, int il, object view, int64_t n_seqs, int64_t n_t) except -1:
        cdef lx_mamba2_params *p = &self.params[il]
        set_state(st, view, n_seqs, (p.d_inner + 2 * p.n_group * p.d_state, p.d_conv - 1),
                  (p.n_head, p.d_inner // p.n_head, p.d_state), il)
        if not lx_mamba2_layer_valid(p, &self.weights[il], st, n_seqs, n_t):
            raise ValueError(f"layer {il}: a cell out of range or repeated, or a history row out of range (cells "
                             f"{view.cells.tolist()}, hist_row "
                             f"{None if view.hist_row is None else view.hist_row.tolist()})")
        return 0

    def forward(self, x, list views, int64_t n_t, n_threads=None):
        """x += mixer(rms_norm(x, norm)) for every layer in turn, over one equally split ubatch.

        Args:
            x: float32 [n_seqs * n_t, n_embd], C-contiguous: the embeddings; overwritten with the hidden
                states after the last layer.  # IN/OUT
            views: [n_layer] RecurrentView of each layer for this ubatch: conv float32 [n_cells, conv_dim,
                d_conv - 1] and ssm [n_cells, n_head, head_dim, d_state], updated in place; cells int32
                [n_seqs]; conv_hist / ssm_hist None or the rollback rows (written), hist_row None or int32
                [n_seqs].  # IN/OUT
            n_t: tokens per sequence.
        Returns:
            x.
        Raises:
            ValueError: a layer without its norm; a shape, type or view that does not fit, a cell out of
                range or repeated, a history row out of range (every layer checked before any runs:
                nothing written then).
        """
        cdef int nt = resolve_n_threads(n_threads)
        self._rows(x, "x")
        if not x.flags.writeable:
            raise ValueError("x must be writeable")
        cdef int64_t n = x.shape[0]
        if n_t < 1 or n % n_t:
            raise ValueError(f"n_t = {n_t} must be positive and divide the {n} rows of x")
        if len(views) != self.n_layer:
            raise ValueError(f"{len(views)} views for {self.n_layer} layers")
        cdef int64_t n_seqs = n // n_t
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
                if self.weights[il].norm == NULL:
                    raise ValueError(f"layer {il} has no norm: run it with mixer")
                self._state(&sts[il], il, views[il], n_seqs, n_t)
                s = lx_mamba2_layer_work_size(&self.params[il], &self.weights[il], n_seqs, n_t, nt)
                need = s if s > need else need
            wp = self._buffer(need)
            with nogil:
                st = lx_mamba2_stack_forward(self.params, self.weights, sts, self.n_layer, xp, n_seqs, n_t, wp, nt)
        finally:
            free(sts)
        if st != LX_OK:   # not reached: every layer was checked above
            raise ValueError("the native step refused its arguments")
        return x

    def mixer(self, int il, h, view, int64_t n_t, n_threads=None):
        """Layer il's mixer on the normed hidden states h [n_seqs * n_t, n_embd] of one equally split
        ubatch, its states read and updated in view (see forward); returns a new float32 [n, n_embd]
        (before the residual).

        Raises:
            ValueError: il out of range, or h or view does not fit (nothing written then).
        """
        if not 0 <= il < self.n_layer:
            raise ValueError(f"layer {il} out of [0, {self.n_layer})")
        cdef int nt = resolve_n_threads(n_threads)
        self._rows(h, "h")
        cdef int64_t n = h.shape[0]
        if n_t < 1 or n % n_t:
            raise ValueError(f"n_t = {n_t} must be positive and divide the {n} rows of h")
        cdef int64_t n_seqs = n // n_t
        cdef lx_mamba_state sts
        self._state(&sts, il, view, n_seqs, n_t)
        out = np.empty((n, self.n_embd), dtype=np.float32)
        cdef void *wp = self._buffer(lx_mamba2_layer_work_size(&self.params[il], &self.weights[il], n_seqs, n_t, nt))
        cdef const float *hp = <const float *> cnp.PyArray_DATA(<cnp.ndarray> h)
        cdef float *op = <float *> cnp.PyArray_DATA(<cnp.ndarray> out)
        cdef lx_status st
        with nogil:
            st = lx_mamba2_mixer_forward(&self.params[il], &self.weights[il], &sts, hp, op, n_seqs, n_t, wp, nt)
        if st != LX_OK:   # not reached: checked above
            raise ValueError("the native step refused its arguments")
        return out
