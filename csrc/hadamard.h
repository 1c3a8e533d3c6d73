/* hadamard.h: llama.cpp's Walsh-Hadamard rotation of quantized KV cache rows.
 *
 * Why: a quantized block shares one scale between 32 values, so one outlier channel costs the
 * whole block its precision. An orthonormal rotation spreads outliers over the block (QuaRot);
 * because H is orthonormal and symmetric, (H q) . (H k) = q . k, and the rotation of a weighted
 * sum of rotated V rows is the weighted sum of the V rows (H H = I).
 *
 * The matrix (ggml_gen_hadamard, src/llama-kv-cache.cpp), Sylvester's construction in natural
 * order, every entry +-s with s = (float) (1.0 / sqrtf(n)):
 *
 *   H_1 = [s]      H_2m = [ H_m   H_m ]      i.e.  H[i][j] = s * (-1)^popcount(i & j)
 *                         [ H_m  -H_m ]
 *
 *   n = 4:  s * [ +  +  +  + ]
 *               [ +  -  +  - ]        H is symmetric and H H = I (up to rounding of s).
 *               [ +  +  -  - ]
 *               [ +  -  -  + ]
 *
 * Applied to a row as llama.cpp's ggml_mul_mat_aux does: the row is cut into consecutive blocks
 * of n values and each block x becomes H x:
 *
 *   row [n_head * head_dim]:  | H x0 | H x1 | H x2 | ...   (blocks of n, n divides head_dim)
 *
 * When llama.cpp rotates (llama_kv_cache constructor, build_input_k_rot / build_input_v_rot):
 *   - attn_rot_k: type_k is quantized (q8_0, q4_0, ...), every layer has the same K head size,
 *     and head_dim_k % 64 == 0 (LLAMA_ATTN_ROT_DISABLE=1 turns it off). Block: the largest power
 *     of two >= 64 that divides head_dim_k (64 -> 64, 128 -> 128, 192 -> 64, 256 -> 256).
 *     llama_kv_cache.build_attn: q and k_cur are rotated before K is stored, so the scores need
 *     nothing else; the K-shift of a quantized K un-rotates, ropes and re-rotates (rope.h).
 *   - attn_rot_v: type_v is quantized and head_dim_v % 64 == 0. Block: always 64 (smaller
 *     blocks measured better for V, llama.cpp PR 21038). v_cur is rotated before it is stored and
 *     the attention output (a weighted sum of rotated V rows) is rotated back.
 *   Quantized V needs flash attention, so V rotation only occurs with flash attention.
 * lx_hadamard_block_k / lx_hadamard_block_v give these blocks (0: no rotation possible).
 */
#ifndef LX_HADAMARD_H
#define LX_HADAMARD_H

#include <stdint.h>

#include "common.h"

#define LX_HADAMARD_MIN_ROT   64     /* llama.cpp's smallest rotation block                  */
#define LX_HADAMARD_MAX_BLOCK 4096   /* largest block the kernels take (a stack buffer in _ref) */

/* llama.cpp's K rotation block for head size head_dim: the largest power of two >= 64 dividing
 * it, or 0 if head_dim % 64 != 0 (no rotation). Capped at LX_HADAMARD_MAX_BLOCK. */
int lx_hadamard_block_k(int64_t head_dim);

/* llama.cpp's V rotation block: 64 if head_dim % 64 == 0, else 0 (no rotation). */
int lx_hadamard_block_v(int64_t head_dim);

/* 1 if n is a power of two in [1, LX_HADAMARD_MAX_BLOCK] (a block the kernels accept) */
int lx_hadamard_block_ok(int64_t n);

/* s = (float) (1.0 / sqrtf(n)): the magnitude of every entry of H (ggml's rounding).
 * note: lx_hadamard_block_ok(n). */
float lx_hadamard_scale(int n);

/* h [n][n] <- H, built as ggml_gen_hadamard builds it. note: lx_hadamard_block_ok(n). */
void lx_hadamard_matrix(int n, float *h);

/* Largest |fast - ref| of an element y_i of one block, relative to s * sum_j |x_j| (the block's
 * input): the fast kernel is a fast Walsh-Hadamard transform (log2(n) stages of exact-order
 * float butterflies, then one product by s), each stage adding at most 2^-24 of the partial
 * sums' magnitudes, which are bounded by sum_j |x_j|; the _ref is rounded once from a double
 * sum. Bound: (log2(n) + 2) * 2^-24; LX_HADAMARD_MAX_ERR(n) states it. */
#define LX_HADAMARD_MAX_ERR(log2n) (((float) (log2n) + 2.0f) * 5.9604645e-08f)

/* x [n_rows][n_per_row] <- each consecutive block of `block` values of each row multiplied by H,
 * in place (its own inverse: applying it twice gives x back up to rounding). Fast Walsh-Hadamard
 * transform (AVX2 when the CPU has it; every path does the same float operations in the same
 * order, so the bits do not depend on the CPU or on n_threads). OpenMP over rows.
 * note: lx_hadamard_block_ok(block), n_per_row % block == 0, n_threads >= 1. */
void lx_hadamard_rows(float *x, int64_t n_rows, int64_t n_per_row, int block, int n_threads);

/* lx_hadamard_rows on one row x [n] on the caller's thread (for kernels that run their own
 * OpenMP loop). note: lx_hadamard_block_ok(block), n % block == 0. */
void lx_hadamard_row(float *x, int64_t n, int block);

/* Oracle of lx_hadamard_rows: y_i = sum_j H[i][j] x_j with the entries of lx_hadamard_matrix,
 * products and sum in double, rounded once. Single-threaded; same shapes. */
void lx_hadamard_rows_ref(float *x, int64_t n_rows, int64_t n_per_row, int block);

#endif /* LX_HADAMARD_H */
