/* gemm.h: y = x W^T over ggml weight rows for any batch size, bit-identical on every path.
 *
 *   x  float [n_tok][n_in]             activations, row-major
 *   W  rows  [n_out] of lx_row_bytes(w_type, n_in) bytes (a GGUF tensor as stored)
 *   y  float [n_tok][n_out]            y[t][o] = sum_i x[t][i] * W[o][i]
 *
 * What it is for: the weight products of prefill (n_tok up to the ubatch) and of decode, from the
 * stored blocks (no float32 copies of W), with results that do not depend on the batch: token t's
 * row of y is the same bits whatever the other rows of x, the thread count and the SIMD level.
 * It is llamax's one integer product: the weight types it lacks take matmul.h's float product
 * (product.h holds the rule).
 *
 * ---- the canonical arithmetic (every path computes exactly these float operations) ----------
 *
 * x row t is quantized per block exactly as ggml does, to the weight's dot type
 * (lx_gemm_dot_type: q8_0 for q4_0 / q5_0 / q8_0, q8_1 for q4_1 / q5_1, q8_K for the K-quants
 * (below); quants.h's rounding), giving
 * int8 y_i, the block scale dx_b (f16 -> float, exact) and, for q8_1, sx_b (f16 -> float). W's
 * block b of row o has integer quants q_i (the stored field as in quants.h, before any offset: the
 * nibble, or for q5_0 / q5_1 the nibble | qh bit << 4), the offset c (8 for q4_0, 16 for q5_0, 0 for
 * q4_1, q5_1 and q8_0, whose q_i are signed), the scale dw_b and, for q4_1 / q5_1, the min mw_b
 * (f16 -> float). Then, in float32 with round-to-nearest:
 *
 *     acc = +0.0f
 *     for b = 0, 1, ..., nb - 1:                          (blocks in order, no other split)
 *         isum = sum_{i in b} (q_i - c) * y_i             exact integer (|isum| < 2^21)
 *         s    = dw_b * dx_b                              one rounded multiply
 *         acc  = fmaf(s, (float) isum, acc)               one fused multiply-add (exact cvt)
 *         acc  = fmaf(mw_b, sx_b, acc)                    q4_1 / q5_1 only: the min term
 *     y[t][o] = acc
 *
 * One sequential chain per output: no partial accumulators, no reduction tree, so there is nothing
 * whose order could depend on n_tok, n_threads or the vector width. Integer sums are exact in any
 * order, so the SIMD kernels are free to form isum however they like (vpdpbusd, maddubs + madd).
 * The scalar reference (lx_gemm_ref) is this loop, literally; the C code is compiled in ISO C mode
 * (-std=c11: GCC does not contract a * b + c into an FMA there) and without -ffast-math (no
 * reassociation), and the tests compare every path bit for bit.
 *
 * Why one chain per output is fast: the SIMD kernels put *tokens* in the vector lanes (16 per
 * zmm, 8 per ymm), so every lane runs its own output's chain and the chains of a tile of
 * R rows x T lane-groups are independent (enough to hide the FMA latency):
 *
 *   activations (once per call, OpenMP over tokens), per group of L tokens and block b:
 *       qs   int8 [8 steps][L lanes][4 values]      value 4s+j of token lane l's block
 *       corr int32 [L]                              -c * sum_i y_i (the offset, folded in)
 *       dx, sx float [L]
 *   weights: each thread unpacks R rows of its slice once into an L1 buffer of bytes (q_i as
 *       unsigned bytes: the nibble / 5-bit value, q8_0 + 128 with c = 128; on AVX2 q8_0 stays
 *       signed, c = 0, and uses the sign trick), then runs every token group against them:
 *
 *       for step s in 0..7:  a[g] = load(qs[g][b][s])            T vectors of L tokens
 *                            for r < R: w = broadcast(4 bytes 4s.. of row r, block b)
 *                                       isum[r][g] = vpdpbusd(isum[r][g], w, a[g])
 *       (isum[r][g] starts at corr[g][b]; then s, fmadd, [min fmadd] lane-wise as above)
 *
 *   Per R x T tile and block: 8 R T dot instructions and 3 R T float ones (cvt, mul, fma); W is
 *   read from memory once per call and each activation vector serves R rows. On AVX2 the
 *   maddubs int16 pair sums are added over 8 steps (nibbles: |sum| <= 8 * 2 * 15 * 127 = 30480)
 *   or 4 (q5_0 / q5_1: <= 31496) before one madd, exactly.
 *
 *   n_tok <= 8 (AVX2 and up): tokens in lanes would waste lanes and the per-call unpack would
 *   cost as much as the dots, so 8 W *rows* go in the lanes instead: each block is unpacked in
 *   registers once, dotted with every token's 32 bytes, and the 8 rows' int32 partials reduced
 *   exactly (hadd tree) to the 8 isums; then the same chain, lane-wise over rows. The bits are
 *   the same as the token-lane kernels' (test (b): a token alone vs in a batch of 130).
 *
 * Paths (lx_simd_level, cpu.h): at AMX, for n_tok > 8 and the non-K types, the tile path (gemm.c, gemm_amx):
 * one tdpbssd forms the exact block sums of 16 tokens x 16 W rows (the tokens' int8 block against the rows'
 * q - c bytes in the tile's VNNI order), stored, then the chain above with the W rows in the lanes; at
 * VNNI512 the 16-lane zmm kernel (vpdpbusd); at AVX2 and AVX512
 * AVX2+FMA+F16C (8 lanes, maddubs + madd; q8_0 keeps signed bytes and uses the sign trick,
 * |q| <= 128); at PORTABLE the C (the reference loop per output, OpenMP over rows; fmaf is the C library's,
 * correctly rounded like the hardware FMA). F16C converts the W scales: a NaN scale keeps its
 * payload but may get the quiet bit, so NaN outputs may differ in payload between paths.
 *
 * Error vs exact arithmetic (test (c)): against the float64 product of the dequantized W and the
 * dequantized quantized x, |y - y64| <= LX_GEMM_ERR(nb) * sum_b |dw_b dx_b isum_b| (+ |mw_b sx_b|),
 * LX_GEMM_ERR(n) = (2 n + 2) 2^-24: each term has one rounding from s and the chain at most n
 * roundings (Higham) (n the chain's terms: nb, 2 nb for q4_1 / q5_1; K-quants: 2 nbk, nbk for q6_K,
 * where the rounding of (float) isum is one more per term, within the bound), plus the rounding
 * of sx_b in q8_1 (ggml's) for q4_1 / q5_1, which the test models.
 *
 * ---- the K-quants (q4_K, q5_K, q6_K: super-blocks of 256, q8_K activations) ------------------
 *
 * x row t is quantized per super-block exactly as ggml's quantize_row_q8_K (int8 y_i, float d_x,
 * int16 bsums of 16). W's super-block b has the stored values u_i (q4_K 0..15, q5_K 0..31, q6_K
 * 0..63 with q_i = u_i - 32), the 6-bit sub-block scales sc_j and mins mn_j (q4_K / q5_K: 8
 * sub-blocks of 32; ggml's get_scale_min_k4) or the int8 scales sc_j (q6_K: 16 of 16), and the
 * f16 scales d_w, dmin_w. Per output, in float32 with round-to-nearest (what ggml's AVX2 dots
 * compute per super-block, up to their lane-parallel sums):
 *
 *     acc = +0.0f
 *     for b = 0, 1, ..., nbk - 1:
 *         isum = sum_j sc_j * (sum_{i in j} u_i y_i)       q4_K / q5_K, exact int32
 *         isum = sum_j sc_j * (sum_{i in j} q_i y_i)       q6_K, exact int32 (|isum| < 2^27)
 *         msum = sum_j mn_j * (bsums_2j + bsums_2j+1)      q4_K / q5_K, exact (|msum| < 2^21)
 *         s    = d_w * d_x
 *         acc  = fmaf(s, (float) isum, acc)
 *         m    = dmin_w * d_x                              q4_K / q5_K only
 *         acc  = fmaf(-m, (float) msum, acc)               q4_K / q5_K only
 *     y[t][o] = acc
 *
 * |isum| can exceed 2^24 (q4_K: up to 8 * 63 * 32 * 15 * 127), so (float) isum may round: it is
 * the one round-to-nearest-even int32 -> float conversion (C's cast, cvtdq2ps), a function of the
 * exact integer, hence the same on every path. fmaf(-m, v, acc) is vfnmadd(m, v, acc) bit for bit.
 *
 * At AMX, more than 8 tokens take the tile path: each sub-block scale written in digits (q4_K base 8,
 * q5_K base 4, q6_K's |scale| base 4, its sign on the values) so every value times a digit is an int8,
 * one tile product of the super-block per digit, isum = sum_k 2^(bits k) C_k exactly (gemm.c amx_rows_k_of).
 * At VNNI512 more than 8 tokens take the K tile on 16 zmm lanes (gemm.c tile_k, its VNNI512 pass: q4_K /
 * q5_K by vpdpbusd per sub-block and vpmulld by its scale, exact in int32; q6_K the pair sums below). AVX2
 * kernels (AVX512 without VNNI runs these too, and every level's few-token K products): token lanes for
 * n_tok > 8 (R = 4 rows x 8 tokens per tile), 8 rows in lanes for n_tok <= 8, as above. The
 * sub-block scale costs nothing: the maddubs int16 pair sums of a sub-block (q4_K: 8 steps,
 * <= 30480; q5_K: 4 steps, <= 31496) go through one madd against sc_j broadcast as int16, which
 * gives sc_j * (pair + pair') in int32 exactly. q6_K's -32 offset: the pair sums of u y over the
 * group's 4 steps wrap in int16, then the activations' 32 * (pair sums of y) is subtracted, which
 * leaves the pair sums of (u - 32) y, |.| <= 8 * 32 * 127 = 32512, exact (int16 arithmetic is
 * modular); then the madd with sc_j. The min sum is a madd of the (bs_2e, bs_2e+1) pairs against
 * the (mn_2e, mn_2e+1) pairs.
 *
 * L2 blocking (n_tok > 8): the token groups are processed in chunks of about 256 KB of activations
 * (LX_GEMM_CHUNK_BYTES; ~120 tokens for n_in 1536 q4_1); each chunk runs over all row tiles. Each
 * thread takes the same contiguous share of tiles in every chunk (no barrier between chunks) and keeps
 * the first of them unpacked from chunk to chunk (LX_GEMM_KEEP_BYTES, 1 MB a thread: the whole share
 * of a 135M-270M model's products), the rest re-unpacked per chunk. Each output's chain is untouched,
 * so the bits are the same.
 *
 * Types: q4_0, q4_1, q5_0, q5_1, q8_0, q4_K, q5_K, q6_K (lx_gemm_supported); n_in must be a
 * multiple of the block size (32, or 256 for the K-quants). Others are refused (matmul.h's float
 * product serves them: product.h).
 * Next: VNNI few-token kernels (decode runs AVX2's there; it is bound by W's stream), f32 / f16 weights,
 * q2_K / q3_K.
 */
#ifndef LX_GEMM_H
#define LX_GEMM_H

#include <stddef.h>
#include <stdint.h>

#include "common.h"
#include "quants.h"

#define LX_GEMM_ERR(n) ((2.0 * (double) (n) + 2.0) * 5.9604644775390625e-08)

/* 1 if lx_gemm takes w_type as a weight type */
int lx_gemm_supported(lx_type w_type);

/* the activation format of a product with W of type w_type (LX_TYPE_Q8_0, _Q8_1 or _Q8_K) */
lx_type lx_gemm_dot_type(lx_type w_type);

/* bytes of the work buffer lx_gemm needs (activations + n_threads unpack buffers, and for n_tok > 8
 * each thread's kept tiles); lx_gemm_ref needs no more. note: lx_gemm_supported(w_type). */
size_t lx_gemm_work_size(lx_type w_type, int64_t n_tok, int64_t n_in, int n_threads);

/* y = x W^T, the canonical arithmetic above.
 * w: [n_out] rows of lx_row_bytes(w_type, n_in) bytes, x: [n_tok][n_in] float32 (finite),
 * y: [n_tok][n_out] float32 (written, not read), work: lx_gemm_work_size(w_type, n_tok, n_in,
 * n_threads) bytes of scratch (overwritten). note: lx_gemm_supported(w_type), n_in a positive
 * multiple of 32 (256 for the K-quants), n_threads >= 1. Bits do not depend on n_threads, n_tok
 * or the SIMD level. */
void lx_gemm(const void *w, lx_type w_type, const float *x, float *y, int64_t n_tok, int64_t n_in,
             int64_t n_out, void *work, int n_threads);

/* The few-token product (n_tok <= 8) in two halves, for threads already running as a team (layer.c's
 * decode step): lx_gemm_small_prepare (one thread) writes the tokens' activations into work, then the
 * members split the lx_gemm_small_tiles(n_out) output tiles between them and each calls
 * lx_gemm_small_run on its range [i0, i1); W is GGUF rows (r8 0) or the r8 layout (r8 1). Every tile
 * is lx_gemm's (lx_gemm_r8's) bits for its 8 rows, whichever thread runs it. Available where
 * lx_gemm_small_ok(w_type, n_tok) (AVX2 and up); work as lx_gemm's (lx_gemm_r8's). */
int lx_gemm_small_ok(lx_type w_type, int64_t n_tok);
int64_t lx_gemm_small_tiles(int64_t n_out);
void lx_gemm_small_prepare(lx_type w_type, const float *x, int64_t n_tok, int64_t n_in, void *work);
void lx_gemm_small_run(const void *w, lx_type w_type, int r8, float *y, int64_t n_tok, int64_t n_in,
                       int64_t n_out, const void *work, int64_t i0, int64_t i1);

/* the scalar reference: the canonical loop per output, single-threaded; same arguments */
void lx_gemm_ref(const void *w, lx_type w_type, const float *x, float *y, int64_t n_tok,
                 int64_t n_in, int64_t n_out, void *work);

/* The row-interleaved layout ("r8") of a q4_0 / q4_1 / q5_0 / q8_0 / q4_K / q5_K / q6_K W, for decode:
 * rows in groups of 8; per group and block b (8 blocks' bytes) first a head, the 8 rows' d (f16), then
 * q4_1's 8 m (f16) or q5_0's 8 qh (u32), then chunks of 32 bytes (8 for q8_0, 4 for the nibble types), chunk c
 * holding qs bytes [4c, 4c + 4) of row 0, of row 1, ... of row 7 (ik_llama.cpp's _R8 idea). The K
 * types' super-blocks likewise, every field (d, dmin, the scale bytes, qs / ql / qh) as dwords of the
 * 8 rows side by side (gemm.c: R8K_Q4_SC). n_out is rounded up to a multiple of 8 with zero rows.
 * The few-token kernel then reads one contiguous stream and each SIMD lane is one row throughout (a
 * token's 4 bytes broadcast), so it needs no reduction across lanes; on GGUF rows it had 8 row
 * streams and a per-block hadd tree (and, for the K types, each row's scales unpacked alone). The
 * tokens-in-lanes path unpacks each row tile from the group-blocks directly (the K types and the
 * portable build gather it back to GGUF rows first). lx_gemm_r8 gives lx_gemm's bits for any n_tok
 * at every level. */
int lx_gemm_r8_supported(lx_type w_type);
size_t lx_gemm_r8_bytes(lx_type w_type, int64_t n_in, int64_t n_out);
void lx_gemm_pack_r8(lx_type w_type, const void *w, void *dst, int64_t n_in, int64_t n_out);
/* rows[i] of r8 W back as GGUF rows into dst [n_rows][lx_row_bytes] (the embedding's get_rows) */
void lx_gemm_unpack_r8_rows(lx_type w_type, const void *w, const int32_t *rows, int64_t n_rows, void *dst,
                            int64_t n_in);
size_t lx_gemm_r8_work_size(lx_type w_type, int64_t n_tok, int64_t n_in, int n_threads);
void lx_gemm_r8(const void *w, lx_type w_type, const float *x, float *y, int64_t n_tok, int64_t n_in,
                int64_t n_out, void *work, int n_threads);


#endif /* LX_GEMM_H */
