# attention.pxd: mirrors csrc/attention.h (declarations only).
from libc.stdint cimport int32_t, int64_t

from llamax._native.quants cimport lx_type


cdef extern from "attention.h" nogil:
    int LX_ATTN_MAX_D
    int LX_ATTN_CHUNK
    int LX_ATTN_MAX_GROUP
    float LX_ATTN_MAX_ERR

    ctypedef struct lx_attn_params:
        int64_t n_stream
        int64_t n_tps
        int64_t n_tps_pad
        int64_t n_head
        int64_t n_head_kv
        int64_t d_k
        int64_t d_v
        int64_t kv_size
        int64_t n_kv
        lx_type type_k
        lx_type type_v
        float scale
        float softcap
        const int32_t *perm

    bint lx_attn_params_valid(const lx_attn_params *p)
    bint lx_attn_params_valid_vtrans(const lx_attn_params *p)
    int64_t lx_attn_k_row_bytes(const lx_attn_params *p)
    int64_t lx_attn_v_row_bytes(const lx_attn_params *p)
    int64_t lx_attn_scratch_size(const lx_attn_params *p, int n_threads)

    # q [n_tokens][n_head][d_k], k [n_stream][kv_size][n_head_kv][d_k] (quantized: [n_stream][kv_size]
    # rows of lx_attn_k_row_bytes), v [n_stream][kv_size][n_head_kv][d_v] (likewise),
    # mask [n_stream][n_tps_pad][n_kv],
    # out [n_tokens][n_head][d_v], scratch [n_scratch] or NULL
    void lx_attn_flash(const lx_attn_params *p, const float *q, const void *k, const void *v,
                       const float *mask, float *out, float *scratch, int64_t n_scratch,
                       int n_threads)
    void lx_attn_flash_ref(const lx_attn_params *p, const float *q, const void *k, const void *v,
                           const float *mask, float *out)
    # as lx_attn_flash with v = V^T [n_stream][n_head_kv][d_v][kv_size]
    void lx_attn_vtrans(const lx_attn_params *p, const float *q, const void *k, const void *v,
                        const float *mask, float *out, float *scratch, int64_t n_scratch,
                        int n_threads)
    void lx_attn_vtrans_ref(const lx_attn_params *p, const float *q, const void *k, const void *v,
                            const float *mask, float *out)

    void lx_attn_set_min_work(int64_t macs)

    # row [n] (scores in, logits out), mv [n] mask values; returns the logits' maximum
    float lx_attn_logits(float *row, int n, float scale, const float *mv)
    float lx_attn_logits_ref(float *row, int n, float scale, const float *mv)

    # q [nh][d_k], k [n][row bytes of d_k values of type_k], S [nh][n], isum [nh][n][d_k / 32] or NULL
    void lx_attn_dots_q(lx_type type_k, int64_t d_k, const float *q, int nh, const void *k, int64_t n,
                        float *S)
    void lx_attn_dots_q_ref(lx_type type_k, int64_t d_k, const float *q, int nh, const void *k, int64_t n,
                            float *S, int32_t *isum)
    void lx_attn_dots_q_vnni_emul(lx_type type_k, int64_t d_k, const float *q, int nh, const void *k,
                                  int64_t n, float *S, int32_t *isum)
