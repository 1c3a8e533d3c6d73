# Mirrors csrc/rope.h (declarations only).
from libc.stdint cimport int32_t, int64_t, uint16_t

from llamax._native.quants cimport lx_type

cdef extern from "common.h" nogil:
    ctypedef int32_t lx_pos

cdef extern from "rope.h" nogil:
    int LX_ROPE_MAX_ROT

    ctypedef enum lx_rope_kind:
        LX_ROPE_NORM
        LX_ROPE_NEOX

    ctypedef struct lx_rope_params:
        int32_t n_rot
        float freq_base
        float freq_scale
        lx_rope_kind kind
        const float * freq_factors   # [n_rot/2] or NULL
        float ext_factor
        float attn_factor
        float corr_dims[2]

    void lx_rope_yarn_corr_dims(int n_dims, int n_ctx_orig, float freq_base, float beta_fast, float beta_slow,
                                float * dims)
    void lx_rope_cache(const lx_rope_params * rp, lx_pos p, float * cache)

    void lx_rope_f32(const lx_rope_params * rp, float * x, const lx_pos * pos,
                     int64_t n_tokens, int64_t n_head, int64_t head_dim, int n_threads)
    void lx_rope_f32_ref(const lx_rope_params * rp, float * x, const lx_pos * pos,
                         int64_t n_tokens, int64_t n_head, int64_t head_dim)

    void lx_rope_k_shift_f32(const lx_rope_params * rp, float * k, const lx_pos * shift,
                             int64_t kv_size, int64_t n_head_kv, int64_t head_dim, int n_threads)
    void lx_rope_k_shift_f32_ref(const lx_rope_params * rp, float * k, const lx_pos * shift,
                                 int64_t kv_size, int64_t n_head_kv, int64_t head_dim)
    void lx_rope_k_shift_f16(const lx_rope_params * rp, uint16_t * k, const lx_pos * shift,
                             int64_t kv_size, int64_t n_head_kv, int64_t head_dim, int n_threads)
    void lx_rope_k_shift_f16_ref(const lx_rope_params * rp, uint16_t * k, const lx_pos * shift,
                                 int64_t kv_size, int64_t n_head_kv, int64_t head_dim)

    int LX_ROPE_MAX_HEAD
    # k [kv_size] rows of lx_row_bytes(t, n_head_kv*head_dim) bytes, shift [kv_size]
    void lx_rope_k_shift(const lx_rope_params * rp, lx_type t, void * k, const lx_pos * shift,
                         int64_t kv_size, int64_t n_head_kv, int64_t head_dim, int rot_block, int n_threads)
    void lx_rope_k_shift_ref(const lx_rope_params * rp, lx_type t, void * k, const lx_pos * shift,
                             int64_t kv_size, int64_t n_head_kv, int64_t head_dim, int rot_block)
