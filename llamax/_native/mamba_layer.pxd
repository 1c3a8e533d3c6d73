# mamba_layer.pxd: mirrors csrc/mamba_layer.h (declarations only).
from libc.stdint cimport int32_t, int64_t

from llamax._native.layer cimport lx_linear, lx_status


cdef extern from "mamba_layer.h" nogil:
    ctypedef struct lx_mamba_product:
        lx_linear lin
        const float *f32

    ctypedef struct lx_mamba_params:
        int64_t n_embd, d_inner, d_state, dt_rank
        int d_conv
        int64_t n_ff
        float eps

    ctypedef struct lx_mamba_weights:
        const float *norm
        lx_mamba_product ssm_in
        const float *conv_w
        const float *conv_b
        lx_mamba_product ssm_x
        const float *dt_norm
        const float *b_norm
        const float *c_norm
        lx_mamba_product ssm_dt
        const float *dt_b
        const float *A
        const float *D
        lx_mamba_product ssm_out
        const float *ffn_norm
        lx_mamba_product w_gate_up
        lx_mamba_product w_down

    ctypedef struct lx_mamba_state:
        float *conv
        float *ssm
        int64_t n_cells
        const int32_t *cells
        float *conv_hist
        float *ssm_hist
        int64_t n_hist
        const int32_t *hist_row
        float *ssm_undo
        int64_t n_undo
        int32_t *undo_slot

    int lx_mamba_product_valid(const lx_mamba_product *m, int64_t n_in, int64_t n_out)
    int lx_mamba_state_valid(const lx_mamba_state *st, int64_t n_seqs)

    int lx_mamba_layer_valid(const lx_mamba_params *p, const lx_mamba_weights *w, const lx_mamba_state *st,
                             int64_t n_seqs, int64_t n_t)
    size_t lx_mamba_layer_work_size(const lx_mamba_params *p, const lx_mamba_weights *w, int64_t n_seqs, int64_t n_t,
                                    int n_threads)
    lx_status lx_mamba_layer_forward(const lx_mamba_params *p, const lx_mamba_weights *w, const lx_mamba_state *st,
                                     float *x, int64_t n_seqs, int64_t n_t, void *work, int n_threads)
    lx_status lx_mamba_stack_forward(const lx_mamba_params *p, const lx_mamba_weights *w, const lx_mamba_state *st,
                                     int n_layer, float *x, int64_t n_seqs, int64_t n_t, void *work, int n_threads)


# the helpers mamba_layer.pyx shares with mamba2_layer.pyx
cdef const float *f32_data(object a, tuple shape, str what, list keep) except? NULL
cdef int set_product(lx_mamba_product *m, object spec, int64_t n_in, int64_t n_out, str what, list keep) except -1
cdef int set_state(lx_mamba_state *st, object v, int64_t n_seqs, tuple conv_row, tuple ssm_row, int il) except -1
