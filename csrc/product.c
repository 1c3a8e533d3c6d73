/* product.c: the engine of a weight product (see product.h). */
#include "product.h"

#include "gemm.h"
#include "matmul.h"

#include <assert.h>

lx_product_kind lx_product_kind_of(lx_type w_type, int r8) {
    if (r8) return lx_gemm_r8_supported(w_type) ? LX_PRODUCT_GEMM_R8 : LX_PRODUCT_NONE;
    if (lx_gemm_supported(w_type)) return LX_PRODUCT_GEMM;
    if (lx_mm_supported(w_type)) return LX_PRODUCT_FLOAT;
    return LX_PRODUCT_NONE;
}

size_t lx_product_work_size(lx_type w_type, int r8, int64_t n_tok, int64_t n_in, int n_threads) {
    switch (lx_product_kind_of(w_type, r8)) {
    case LX_PRODUCT_GEMM: return lx_gemm_work_size(w_type, n_tok, n_in, n_threads);
    case LX_PRODUCT_GEMM_R8: return lx_gemm_r8_work_size(w_type, n_tok, n_in, n_threads);
    default: return 0;
    }
}

void lx_product(const void *w, lx_type w_type, int r8, const float *x, float *y, int64_t n_tok, int64_t n_in,
                int64_t n_out, void *work, int n_threads) {
    switch (lx_product_kind_of(w_type, r8)) {
    case LX_PRODUCT_GEMM: lx_gemm(w, w_type, x, y, n_tok, n_in, n_out, work, n_threads); break;
    case LX_PRODUCT_GEMM_R8: lx_gemm_r8(w, w_type, x, y, n_tok, n_in, n_out, work, n_threads); break;
    case LX_PRODUCT_FLOAT: lx_mul_mat(w, w_type, x, y, n_tok, n_in, n_out, n_threads); break;
    default: assert(0 && "lx_product: no product for this weight type and layout");
    }
}
