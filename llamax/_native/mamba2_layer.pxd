# mamba2_layer.pxd: mirrors csrc/mamba2_layer.h (declarations only).
from libc.stdint cimport int64_t

from llamax._native.layer cimport lx_status
from llamax._native.mamba_layer cimport lx_mamba_product, lx_mamba_state


cdef extern from "mamba2_layer.h" nogil:
    ctypedef struct lx_mamba2_params:
        int64_t n_embd, d_inner, d_state, n_group, n_head
        int d_conv
        float eps

    ctypedef struct lx_mamba2_weights:
        const float *norm
        lx_mamba_product ssm_in
        const float *conv_w
        const float *conv_b
        const float *dt_b
        const float *A
        const float *D
        const float *ssm_norm
        lx_mamba_product ssm_out

    int lx_mamba2_layer_valid(const lx_mamba2_params *p, const lx_mamba2_weights *w, const lx_mamba_state *st,
                              int64_t n_seqs, int64_t n_t)
    size_t lx_mamba2_layer_work_size(const lx_mamba2_params *p, const lx_mamba2_weights *w, int64_t n_seqs,
                                     int64_t n_t, int n_threads)
    lx_status lx_mamba2_mixer_forward(const lx_mamba2_params *p, const lx_mamba2_weights *w, const lx_mamba_state *st,
                                      const float *h, float *out, int64_t n_seqs, int64_t n_t, void *work,
                                      int n_threads)
    lx_status lx_mamba2_stack_forward(const lx_mamba2_params *p, const lx_mamba2_weights *w, const lx_mamba_state *st,
                                      int n_layer, float *x, int64_t n_seqs, int64_t n_t, void *work, int n_threads)
