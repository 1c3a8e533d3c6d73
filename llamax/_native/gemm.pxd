# gemm.pxd: mirrors csrc/gemm.h (declarations only).
from libc.stdint cimport int32_t, int64_t

from llamax._native.quants cimport lx_type


cdef extern from "gemm.h" nogil:
    double LX_GEMM_ERR(double n)

    int lx_gemm_supported(lx_type w_type)
    lx_type lx_gemm_dot_type(lx_type w_type)
    size_t lx_gemm_work_size(lx_type w_type, int64_t n_tok, int64_t n_in, int n_threads)

    # w: [n_out] rows of lx_row_bytes(w_type, n_in) bytes, x: [n_tok][n_in], y: [n_tok][n_out],
    # work: lx_gemm_work_size(...) bytes
    void lx_gemm(const void *w, lx_type w_type, const float *x, float *y, int64_t n_tok,
                 int64_t n_in, int64_t n_out, void *work, int n_threads)
    void lx_gemm_ref(const void *w, lx_type w_type, const float *x, float *y, int64_t n_tok,
                     int64_t n_in, int64_t n_out, void *work)


    int lx_gemm_r8_supported(lx_type w_type)
    size_t lx_gemm_r8_bytes(lx_type w_type, int64_t n_in, int64_t n_out)
    void lx_gemm_pack_r8(lx_type w_type, const void *w, void *dst, int64_t n_in, int64_t n_out)
    void lx_gemm_unpack_r8_rows(lx_type w_type, const void *w, const int32_t *rows, int64_t n_rows, void *dst,
                                int64_t n_in)
    size_t lx_gemm_r8_work_size(lx_type w_type, int64_t n_tok, int64_t n_in, int n_threads)
    void lx_gemm_r8(const void *w, lx_type w_type, const float *x, float *y, int64_t n_tok, int64_t n_in,
                    int64_t n_out, void *work, int n_threads)
