/* matmul.h: y = x W^T with W in a ggml weight format (quants.h), for decoding.
 *
 * The weight products of a transformer layer when few tokens come at once
 * (a decode step: n_tok 1..~16). Then the cost is reading W once, so W stays
 * in its stored blocks and every x row is used against a W row while that
 * row is in cache:
 *
 *   x  float [n_tok][n_in]             activations, row-major
 *   W  rows  [n_out] of lx_row_bytes(w_type, n_in) bytes (a GGUF tensor of
 *            numpy shape [n_out, n_in], ggml ne = {n_in, n_out}, as stored)
 *   y  float [n_tok][n_out]            y[t][o] = sum_i x[t][i] * W[o][i]
 *
 * Two ways to take the product (lx_mm_act):
 *
 *   LX_MM_ACT_Q8   (the default) ggml's CPU mul_mat: each x row is first
 *                  quantized to the weight's "vec_dot type" (q8_0 for
 *                  q4_0/q5_0/q8_0, q8_1 for q4_1/q5_1, q8_K for
 *                  q4_K/q5_K/q6_K, with ggml's reference rounding), then
 *                  every block pair is an exact integer dot scaled by the
 *                  two block scales. The result is that of x^
 *                  (x rounded to 8 bits per block), as llama.cpp computes it:
 *                  |y - x W^T| <= sum_i |W[o][i]| * |x[t][i] - x^[t][i]|, where
 *                  |x - x^| <= ~0.56 * amax(block of x) / 127 per value.
 *   LX_MM_ACT_F32  x as is; W is dequantized (bit-exactly, lx_dequantize_row)
 *                  LX_MM_TILE values at a time into a stack buffer and dotted
 *                  with x in float32: the product of x with the dequantized W
 *                  up to float rounding (what BLAS on dequantized W gives).
 *
 * Weight types without an integer dot (f32, f16, bf16, q2_K, q3_K) always take
 * the float path; q8_1 / q8_K weights are refused (activation formats).
 *
 * Work: OpenMP over blocks of LX_MM_ROWS output rows, schedule(static) (each
 * thread reads a contiguous slice of W once, prefetching LX_MM_PREFETCH bytes
 * ahead); x is quantized first (OpenMP over tokens, into the caller's work
 * buffer). The dots run in tiles of R W rows x NT tokens (4x1, 2x2, 1x3, 1x4:
 * up to LX_MM_NT tokens at a time, more tokens take more passes over the
 * row block while it is in cache): each W block is unpacked once per tile and
 * each x block is shared by its R rows. Fast paths, chosen at run time: AVX2
 * (+FMA, F16C; 256-bit), AVX-512 (F, BW, VL, DQ, VNNI; 512-bit vectors, two
 * 32-blocks per vector, vpdpbusd / vpdpwssd). The scalar _ref twin is the
 * oracle; the portable C path (other CPUs) sums in the _ref's order.
 *
 * Tolerance vs the _ref (LX_MM_ERR): both compute the same exact integer block
 * dots; they differ only in how the float scale products and sums are rounded
 * and ordered (the _ref: (d_w d_x) * isum per block, added one by one; the fast
 * paths: 8 or 16 lanes of fused multiply-adds of the lane partial sums, added
 * at the end). With u = 2^-24 and n_terms float terms per output (one per
 * block, one more per min term for q4_1/q5_1/q4_K/q5_K; n_in products on the
 * float path), no term goes through more than n_terms + 8 roundings in either,
 * so each is within gamma(n_terms + 8) * sum|terms| of the exact sum of its
 * terms (Higham's bound for summation), and
 *   |y_fast - y_ref| <= LX_MM_ERR(n_terms) * sum|terms|,
 *   LX_MM_ERR(n) = 2 * (n + 8) * 2^-24
 * where sum|terms| <= sum_i (|scaled quant_i| + |min_i|) * |x^_i| (the same with
 * x and the dequantized W on the float path). This is a worst-case bound; the
 * observed differences are ~1% of it.
 */
#ifndef LX_MATMUL_H
#define LX_MATMUL_H

#include <stddef.h>
#include <stdint.h>

#include "common.h"
#include "quants.h"

typedef enum {
    LX_MM_ACT_Q8  = 0,   /* ggml's integer block dots on quantized activations */
    LX_MM_ACT_F32 = 1,   /* float activations, W dequantized in tiles           */
} lx_mm_act;

#define LX_MM_TILE 512   /* values of a W row dequantized at a time (float path); a multiple of 256 */
#define LX_MM_ROWS 16    /* output rows per OpenMP work unit */
#define LX_MM_NT   4     /* most tokens that go through a W row together (a tile's R * NT <= 4) */
#ifndef LX_MM_PREFETCH
#define LX_MM_PREFETCH 2048  /* bytes of W prefetched ahead of the row being read */
#endif

/* the accumulation-error factor of the header comment, for n float terms */
#define LX_MM_ERR(n) (2.0 * ((double) (n) + 8.0) * 5.9604644775390625e-08)

/* the format x rows take for a product with W of type w_type: LX_TYPE_Q8_0,
 * LX_TYPE_Q8_1 or LX_TYPE_Q8_K on the integer path, LX_TYPE_F32 on the float path */
lx_type lx_mm_dot_type(lx_type w_type, lx_mm_act act);

/* 1 if w_type can be a weight of lx_mul_mat (every dequantizable type) */
int lx_mm_supported(lx_type w_type);

/* float terms of one output value (the n of LX_MM_ERR) */
int64_t lx_mm_n_terms(lx_type w_type, int64_t n_in, lx_mm_act act);

/* bytes of the work buffer lx_mul_mat / _ref need: the quantized x rows,
 * n_tok * lx_row_bytes(dot type, n_in); 0 on the float path. */
size_t lx_mm_work_size(lx_type w_type, int64_t n_tok, int64_t n_in, lx_mm_act act);

/* y = x W^T (see the header comment).
 * w: [n_out] rows of lx_row_bytes(w_type, n_in) bytes, x: [n_tok][n_in] float32
 * (finite on the integer path), y: [n_tok][n_out] float32 (written, not read),
 * work: lx_mm_work_size(...) bytes (NULL if 0), scratch that is overwritten.
 * note: lx_mm_supported(w_type), n_in a multiple of the block size, n_threads >= 1.
 * Results do not depend on n_threads. */
void lx_mul_mat(const void *w, lx_type w_type, const float *x, float *y, int64_t n_tok,
                int64_t n_in, int64_t n_out, lx_mm_act act, void *work, int n_threads);

/* the scalar reference: same arguments, single-threaded, terms summed one by one */
void lx_mul_mat_ref(const void *w, lx_type w_type, const float *x, float *y, int64_t n_tok,
                    int64_t n_in, int64_t n_out, lx_mm_act act, void *work);

/* paths by lx_simd_level() (cpu.h): portable C, AVX2+FMA+F16C (at AVX512 too), VNNI512 */

/* y = x W^T for float32 W [n_out][n_in], every output one fixed-order sum, so a row's result is the
 * same bits whatever n_tok and n_threads (the products of float weights kept unquantized, e.g. a Mamba's
 * ssm_x and ssm_dt, where lx_mul_mat's tiles would sum in an order that depends on n_tok):
 *
 *   acc[j] = sum over k = j, j + 8, j + 16, ... < n_in - n_in % 8 of x[k] * w[k], in k order (j < 8)
 *   y = ((acc0 + acc4) + (acc2 + acc6)) + ((acc1 + acc5) + (acc3 + acc7)), then + x[k] * w[k] for
 *       the last n_in % 8 terms in order
 *
 * (eight independent chains the compiler may run as vector lanes: no reassociation is needed).
 * OpenMP over blocks of outputs. note: n_threads >= 1. */
void lx_mul_mat_f32_ordered(const float *w, const float *x, float *y, int64_t n_tok, int64_t n_in, int64_t n_out,
                            int n_threads);

#endif /* LX_MATMUL_H */
