# matmul.pxd: mirrors csrc/matmul.h (declarations only).
from libc.stdint cimport int64_t

from llamax._native.quants cimport lx_type


cdef extern from "matmul.h" nogil:
    int LX_MM_TILE
    int LX_MM_ROWS
    int LX_MM_NT
    double LX_MM_ERR(double n)

    int lx_mm_supported(lx_type w_type)

    # w: [n_out] rows of lx_row_bytes(w_type, n_in) bytes, x: [n_tok][n_in], y: [n_tok][n_out]
    void lx_mul_mat(const void *w, lx_type w_type, const float *x, float *y, int64_t n_tok,
                    int64_t n_in, int64_t n_out, int n_threads)
    void lx_mul_mat_ref(const void *w, lx_type w_type, const float *x, float *y, int64_t n_tok,
                        int64_t n_in, int64_t n_out)
    # w: float32 [n_out][n_in], x: [n_tok][n_in], y: [n_tok][n_out]; fixed-order sums
    void lx_mul_mat_f32_ordered(const float *w, const float *x, float *y, int64_t n_tok, int64_t n_in,
                                int64_t n_out, int n_threads)
