# product.pxd: mirrors csrc/product.h (declarations only).
from libc.stdint cimport int64_t

from llamax._native.quants cimport lx_type


cdef extern from "product.h" nogil:
    ctypedef enum lx_product_kind:
        LX_PRODUCT_NONE
        LX_PRODUCT_GEMM
        LX_PRODUCT_GEMM_R8
        LX_PRODUCT_FLOAT

    lx_product_kind lx_product_kind_of(lx_type w_type, int r8)
    size_t lx_product_work_size(lx_type w_type, int r8, int64_t n_tok, int64_t n_in, int n_threads)
    # w: [n_out] GGUF rows (r8 0) or the r8 layout (r8 1), x: [n_tok][n_in], y: [n_tok][n_out],
    # work: lx_product_work_size(...) bytes or NULL
    void lx_product(const void *w, lx_type w_type, int r8, const float *x, float *y, int64_t n_tok, int64_t n_in,
                    int64_t n_out, void *work, int n_threads)
