/* product.h: y = x W^T for a weight of any ggml type: the one rule of which engine takes it.
 *
 *   x  float [n_tok][n_in]   activations, row-major
 *   W  [n_out] rows of a GGUF tensor as stored, or (r8) gemm.h's row-interleaved layout of them
 *   y  float [n_tok][n_out]  y[t][o] = sum_i x[t][i] * W[o][i]
 *
 *   type                        stored as    engine (lx_product_kind)      x taken as
 *   q4_0, q4_1, q5_0, q8_0      r8           lx_gemm_r8 (GEMM_R8)          q8_0 / q8_1 (ggml's)
 *                               GGUF rows    lx_gemm (GEMM)                q8_0 / q8_1
 *   q5_1, q4_K, q5_K, q6_K      GGUF rows    lx_gemm (GEMM)                q8_1 / q8_K
 *   f32, f16, bf16, q2_K, q3_K  GGUF rows    lx_mul_mat (FLOAT)            float32 (W dequantized)
 *
 * The GEMM (gemm.h) is the integer product, bit-identical for any batch, thread count and SIMD
 * level; matmul.h's float product serves the types without an integer dot. The layer step
 * (layer.c) and the Python Linear (llamax/model/linear.py, through gemm.pyx) both call lx_product,
 * so a weight takes the same product in either. Which layout a loader stores is its choice
 * (lx_gemm_r8_supported: r8 streams best in decode); both give the same bits.
 */
#ifndef LX_PRODUCT_H
#define LX_PRODUCT_H

#include <stddef.h>
#include <stdint.h>

#include "common.h"
#include "quants.h"

typedef enum {
    LX_PRODUCT_NONE    = 0,   /* no product: not a weight type, or r8 asked of a type without it */
    LX_PRODUCT_GEMM    = 1,   /* lx_gemm over GGUF rows */
    LX_PRODUCT_GEMM_R8 = 2,   /* lx_gemm_r8 over the r8 layout */
    LX_PRODUCT_FLOAT   = 3,   /* lx_mul_mat over GGUF rows */
} lx_product_kind;

/* the engine of W of type w_type stored as GGUF rows (r8 0) or in the r8 layout (r8 1): the rule */
lx_product_kind lx_product_kind_of(lx_type w_type, int r8);

/* bytes of the work buffer lx_product needs (0 for LX_PRODUCT_FLOAT).
 * note: lx_product_kind_of(w_type, r8) != LX_PRODUCT_NONE. */
size_t lx_product_work_size(lx_type w_type, int r8, int64_t n_tok, int64_t n_in, int n_threads);

/* y = x W^T through the engine lx_product_kind_of(w_type, r8) names.
 * w: [n_out] GGUF rows (r8 0) or lx_gemm_pack_r8's layout of them (r8 1), x: [n_tok][n_in] float32
 * (finite), y: [n_tok][n_out] float32 (written, not read), work: lx_product_work_size bytes of scratch
 * (NULL if 0). note: lx_product_kind_of(w_type, r8) != LX_PRODUCT_NONE, n_in a positive multiple of
 * the block size, n_threads >= 1. Bits do not depend on n_threads. */
void lx_product(const void *w, lx_type w_type, int r8, const float *x, float *y, int64_t n_tok, int64_t n_in,
                int64_t n_out, void *work, int n_threads);

#endif /* LX_PRODUCT_H */
