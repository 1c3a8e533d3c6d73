# layer.pxd: mirrors csrc/layer.h (declarations only).
from libc.stdint cimport int32_t, int64_t, uint32_t

from llamax._native.moe cimport lx_moe_params, lx_moe_weights
from llamax._native.quants cimport lx_type
from llamax._native.rope cimport lx_pos, lx_rope_params


cdef extern from "common.h" nogil:
    ctypedef enum lx_status:
        LX_OK
        LX_ERR_INVALID


cdef extern from "layer.h" nogil:
    int LX_LINEAR_MAX_PARTS

    ctypedef struct lx_linear:
        int n_parts
        const void *w[4]
        lx_type type[4]
        int64_t rows[4]
        int r8[4]
        int64_t n_in
        int64_t n_out

    ctypedef enum lx_layer_act:
        LX_ACT_SILU
        LX_ACT_GELU_TABLE

    ctypedef struct lx_layer_params:
        int64_t n_embd, n_head, n_head_kv, d_k, d_v, n_ff
        float eps
        lx_rope_params rope
        float q_scale
        float kq_scale
        float softcap
        lx_layer_act act
        const float *gelu_table
        int qk_norm_full
        float residual_scale
        lx_moe_params moe

    ctypedef struct lx_layer_weights:
        const float *attn_norm
        const float *ffn_norm
        const float *q_norm
        const float *k_norm
        const float *post_attn_norm
        const float *post_ffw_norm
        const float *bqkv
        lx_linear wqkv
        lx_linear wo
        lx_linear w_gate_up
        lx_linear w_down
        const lx_moe_weights *moe

    ctypedef struct lx_kv_layer:
        void *k
        void *v
        lx_type type_k
        lx_type type_v
        int v_trans
        int64_t kv_size
        int64_t n_stream
        int64_t n_kv
        int64_t n_tps_pad
        const float *mask
        const uint32_t *idxs
        int rot_k
        int rot_v
        const int32_t *perm

    size_t lx_layer_work_size(const lx_layer_params *p, const lx_layer_weights *w, const lx_kv_layer *kv,
                              int64_t n_tokens, int n_threads)
    lx_status lx_layer_forward(const lx_layer_params *p, const lx_layer_weights *w, const lx_kv_layer *kv,
                               float *x, int64_t n_tokens, const lx_pos *pos, const int64_t *out_rows,
                               int64_t n_out_rows, void *work, int n_threads)
    lx_status lx_layers_forward(const lx_layer_params *p, const lx_layer_weights *w, const lx_kv_layer *kv,
                                int n_layer, float *x, int64_t n_tokens, const lx_pos *pos, const int64_t *out_rows,
                                int64_t n_out_rows, void *work, int n_threads, int *failed)
    void lx_layer_set_team(int on)
    int64_t lx_layer_team_runs()

    void lx_rms_norm(const float *x, const float *g, float *y, int64_t n_rows, int64_t n, float eps, int n_threads)
    void lx_rms_norm_ref(const float *x, const float *g, float *y, int64_t n_rows, int64_t n, float eps)
    void lx_gated(lx_layer_act kind, const float *gelu_table, const float *gu, float *act, int64_t n_rows,
                  int64_t n_ff, int n_threads)
    void lx_gated_ref(lx_layer_act kind, const float *gelu_table, const float *gu, float *act, int64_t n_rows,
                      int64_t n_ff)


# l <- a weight's parts ((raw, type) or (packed, type, rows, r8), n_out rows in all), checked (ValueError);
# the arrays are appended to keep (they must outlive l)
cdef int set_linear(lx_linear *l, object parts, int64_t n_in, int64_t n_out, str what, list keep) except -1
