/* matmul.h: y = x W^T in float32, W dequantized: the weight products of the types the GEMM
 * (gemm.h) has no integer dot for, and the ordered product of float32 weights.
 *
 *   x  float [n_tok][n_in]             activations, row-major
 *   W  rows  [n_out] of lx_row_bytes(w_type, n_in) bytes (a GGUF tensor of
 *            numpy shape [n_out, n_in], ggml ne = {n_in, n_out}, as stored)
 *   y  float [n_tok][n_out]            y[t][o] = sum_i x[t][i] * W[o][i]
 *
 * lx_mul_mat takes x as is; W is dequantized (bit-exactly, lx_dequantize_row) LX_MM_TILE values
 * at a time into a stack buffer and dotted with x in float32: the product of x with the
 * dequantized W up to float rounding (what BLAS on the dequantized W gives). It takes every
 * dequantizable type; product.h sends it the weights gemm.h lacks (f32, f16, bf16, q2_K, q3_K).
 *
 * Work: OpenMP over blocks of LX_MM_ROWS output rows, schedule(static) (each thread reads a
 * contiguous slice of W once, prefetching LX_MM_PREFETCH bytes ahead); each dequantized tile of
 * a W row is dotted with up to LX_MM_NT tokens at a time (more tokens take more passes over the
 * tile while it is in cache). Paths by lx_simd_level() (cpu.h): AVX2+FMA (every level from
 * LX_SIMD_AVX2: two 8-lane accumulators per token), portable C (eight lanes). A token's sums do
 * not depend on the other tokens or n_threads; they do depend on the SIMD level.
 *
 * Tolerance vs the _ref (LX_MM_ERR): the _ref adds the n_in products one by one; the fast paths
 * in 8 or 16 lanes of fused multiply-adds added at the end. No product goes through more than
 * n_in + 8 roundings in either, so each is within gamma(n_in + 8) * sum|terms| of the exact sum
 * (Higham's bound for summation), and
 *   |y_fast - y_ref| <= LX_MM_ERR(n_in) * sum_i |W[o][i]| |x[t][i]|,
 *   LX_MM_ERR(n) = 2 * (n + 8) * 2^-24
 * a worst-case bound; the observed differences are ~1% of it.
 */
#ifndef LX_MATMUL_H
#define LX_MATMUL_H

#include <stddef.h>
#include <stdint.h>

#include "common.h"
#include "quants.h"

#define LX_MM_TILE 512   /* values of a W row dequantized at a time; a multiple of 256 */
#define LX_MM_ROWS 16    /* output rows per OpenMP work unit */
#define LX_MM_NT   4     /* most tokens that go through a dequantized tile together */
#ifndef LX_MM_PREFETCH
#define LX_MM_PREFETCH 2048  /* bytes of W prefetched ahead of the row being read */
#endif

/* the accumulation-error factor of the header comment, for n float terms (n = n_in) */
#define LX_MM_ERR(n) (2.0 * ((double) (n) + 8.0) * 5.9604644775390625e-08)

/* 1 if w_type can be a weight of lx_mul_mat (every dequantizable type) */
int lx_mm_supported(lx_type w_type);

/* y = x W^T (see the header comment).
 * w: [n_out] rows of lx_row_bytes(w_type, n_in) bytes, x: [n_tok][n_in] float32,
 * y: [n_tok][n_out] float32 (written, not read).
 * note: lx_mm_supported(w_type), n_in a multiple of the block size, n_threads >= 1.
 * Results do not depend on n_threads. */
void lx_mul_mat(const void *w, lx_type w_type, const float *x, float *y, int64_t n_tok,
                int64_t n_in, int64_t n_out, int n_threads);

/* the scalar reference: same arguments, single-threaded, products added one by one */
void lx_mul_mat_ref(const void *w, lx_type w_type, const float *x, float *y, int64_t n_tok,
                    int64_t n_in, int64_t n_out);

/* y = x W^T for float32 W [n_out][n_in], every output one fixed-order sum, so a row's result is the
 * same bits whatever n_tok, n_threads and the SIMD level (the products of float weights kept
 * unquantized, e.g. a Mamba's ssm_x and ssm_dt):
 *
 *   acc[j] = sum over k = j, j + 8, j + 16, ... < n_in - n_in % 8 of x[k] * w[k], in k order (j < 8)
 *   y = ((acc0 + acc4) + (acc2 + acc6)) + ((acc1 + acc5) + (acc3 + acc7)), then + x[k] * w[k] for
 *       the last n_in % 8 terms in order
 *
 * (eight independent chains, each product rounded and then added: AVX2 runs them as the lanes of one
 * vector, four rows at a time, and the scalar twin one by one, with the same bits). OpenMP over blocks
 * of outputs. note: n_threads >= 1. */
void lx_mul_mat_f32_ordered(const float *w, const float *x, float *y, int64_t n_tok, int64_t n_in, int64_t n_out,
                            int n_threads);

#endif /* LX_MATMUL_H */
