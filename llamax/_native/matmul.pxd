# matmul.pxd: mirrors csrc/matmul.h (declarations only).
from libc.stdint cimport int64_t

from llamax._native.quants cimport lx_type


cdef extern from "matmul.h" nogil:
    ctypedef enum lx_mm_act:
        LX_MM_ACT_Q8
        LX_MM_ACT_F32

    int LX_MM_TILE
    int LX_MM_ROWS
    int LX_MM_NT
    double LX_MM_ERR(double n)

    lx_type lx_mm_dot_type(lx_type w_type, lx_mm_act act)
    int lx_mm_supported(lx_type w_type)
    int64_t lx_mm_n_terms(lx_type w_type, int64_t n_in, lx_mm_act act)
    size_t lx_mm_work_size(lx_type w_type, int64_t n_tok, int64_t n_in, lx_mm_act act)

    # w: [n_out] rows of lx_row_bytes(w_type, n_in) bytes, x: [n_tok][n_in], y: [n_tok][n_out],
    # work: lx_mm_work_size(...) bytes or NULL
    void lx_mul_mat(const void *w, lx_type w_type, const float *x, float *y, int64_t n_tok,
                    int64_t n_in, int64_t n_out, lx_mm_act act, void *work, int n_threads)
    void lx_mul_mat_ref(const void *w, lx_type w_type, const float *x, float *y, int64_t n_tok,
                        int64_t n_in, int64_t n_out, lx_mm_act act, void *work)
    # w: float32 [n_out][n_in], x: [n_tok][n_in], y: [n_tok][n_out]; fixed-order sums
    void lx_mul_mat_f32_ordered(const float *w, const float *x, float *y, int64_t n_tok, int64_t n_in,
                                int64_t n_out, int n_threads)
