# moe.pxd: mirrors csrc/moe.h (declarations only).
from libc.stdint cimport int32_t, int64_t

from llamax._native.kv_cells cimport lx_status
from llamax._native.quants cimport lx_type


cdef extern from "moe.h" nogil:
    int LX_MOE_CHUNK

    # w: [n_expert] blocks of expert_bytes, each rows of the type (GGUF rows, or r8 packed on its own)
    ctypedef struct lx_experts:
        const void *w
        lx_type type
        int r8
        int64_t rows
        size_t expert_bytes

    ctypedef enum lx_moe_gating:
        LX_MOE_SOFTMAX
        LX_MOE_SIGMOID

    ctypedef struct lx_moe_params:
        int64_t n_embd
        int64_t n_ff_exp
        int64_t n_expert
        int64_t n_used
        lx_moe_gating gating
        int norm_w
        float w_scale
        int act
        const float *gelu_table

    ctypedef struct lx_moe_weights:
        const void *router
        lx_type router_type
        int router_r8
        lx_experts gate
        lx_experts up
        lx_experts down

    int lx_moe_valid(const lx_moe_params *p, const lx_moe_weights *w)
    size_t lx_moe_work_size(const lx_moe_params *p, const lx_moe_weights *w, int64_t n, int n_threads)
    # x: [n][n_embd], ids: [n][n_used], wts: [n][n_used]
    lx_status lx_moe_route(const lx_moe_params *p, const lx_moe_weights *w, const float *x, int64_t n, int32_t *ids,
                           float *wts, void *work, int n_threads)
    # x, y: [n][n_embd] (y may be x)
    lx_status lx_moe_ffn(const lx_moe_params *p, const lx_moe_weights *w, const float *x, float *y, int64_t n,
                         void *work, int n_threads)
    lx_status lx_moe_ffn_ref(const lx_moe_params *p, const lx_moe_weights *w, const float *x, float *y, int64_t n,
                             void *work)


cdef class MoE:
    cdef lx_moe_params p
    cdef lx_moe_weights w
    cdef readonly object router, gate, up, down   # the weight arrays the native call reads
    cdef object _table

    cdef object _x(self, object x)
