/* rope.h: rotary position embedding as ggml's CPU backend computes it (ggml_rope_ext with
 * ext_factor 0, attn_factor 1, no frequency factors), and llama.cpp's K-shift
 * (llama_kv_cache::build_graph_shift / build_rope_shift) over the K rows of the cache.
 *
 * One head of head_dim values; only the first n_rot rotate, the rest pass through untouched:
 *
 *   norm (GGML_ROPE_TYPE_NORM = 0):  pairs (2i, 2i+1)          x: [a0 b0 a1 b1 ... | pass ...]
 *   neox (GGML_ROPE_TYPE_NEOX = 2):  pairs (i, i + n_rot/2)     x: [a0 a1 ... b0 b1 ... | pass ...]
 *
 *   pair i, position p:  theta_i = freq_scale * (p * theta_scale^i),  theta_scale = freq_base^(-2/n_rot)
 *       a' = a cos(theta_i) - b sin(theta_i)
 *       b' = a sin(theta_i) + b cos(theta_i)
 *
 * Computed as ggml does, in float: theta_scale = powf(freq_base, -2.0f/n_rot); theta starts at
 * (float) p and is multiplied by theta_scale once per pair; cosf / sinf of freq_scale * theta.
 * The fast kernels give the same bits as their _ref twins for finite inputs (no FMA contraction).
 */
#ifndef LX_ROPE_H
#define LX_ROPE_H

#include <stdint.h>

#include "common.h"
#include "quants.h"

#define LX_ROPE_MAX_ROT 1024   /* largest n_rot (the per-position cos/sin cache lives on the stack) */

typedef enum {
    LX_ROPE_NORM = 0,   /* GGML_ROPE_TYPE_NORM: adjacent pairs (llama, ...)  */
    LX_ROPE_NEOX = 2,   /* GGML_ROPE_TYPE_NEOX: split halves (gemma, qwen, ...) */
} lx_rope_kind;

typedef struct {
    int32_t      n_rot;       /* rotated dims per head: even, in [2, min(head_dim, LX_ROPE_MAX_ROT)] */
    float        freq_base;   /* > 0 */
    float        freq_scale;
    lx_rope_kind kind;
} lx_rope_params;

/* cache [n_rot] <- interleaved cos/sin of the angles of position p: cache[2i] = cos(theta_i),
 * cache[2i+1] = sin(theta_i), i in [0, n_rot/2) (ggml_rope_cache_init) */
void lx_rope_cache(const lx_rope_params *rp, lx_pos p, float *cache);

/* Rotate x [n_tokens][n_head][head_dim] in place, token t by position pos[t] [n_tokens]
 * (the model's Q/K RoPE). n_threads >= 1 (OpenMP over tokens). */
void lx_rope_f32(const lx_rope_params *rp, float *x, const lx_pos *pos,
                 int64_t n_tokens, int64_t n_head, int64_t head_dim, int n_threads);
void lx_rope_f32_ref(const lx_rope_params *rp, float *x, const lx_pos *pos,
                     int64_t n_tokens, int64_t n_head, int64_t head_dim);

/* K-shift of one layer and stream, in place: k [kv_size][n_head_kv*head_dim] (row i = cell i);
 * every cell i with shift[i] != 0 [kv_size] is rotated by the angles of position shift[i]; cells
 * with shift 0 are not touched (llama.cpp's set_input_k_shift gives 0 to empty cells: do the same).
 * n_threads >= 1 (OpenMP over cells). */
void lx_rope_k_shift_f32(const lx_rope_params *rp, float *k, const lx_pos *shift,
                         int64_t kv_size, int64_t n_head_kv, int64_t head_dim, int n_threads);
void lx_rope_k_shift_f32_ref(const lx_rope_params *rp, float *k, const lx_pos *shift,
                             int64_t kv_size, int64_t n_head_kv, int64_t head_dim);

/* The same over an f16 cache (IEEE half bits): each rotated value is read as float, rotated in
 * float and rounded back to half (nearest even), as ggml's rope on an f16 tensor does; the
 * pass-through dims keep their bits. */
void lx_rope_k_shift_f16(const lx_rope_params *rp, uint16_t *k, const lx_pos *shift,
                         int64_t kv_size, int64_t n_head_kv, int64_t head_dim, int n_threads);
void lx_rope_k_shift_f16_ref(const lx_rope_params *rp, uint16_t *k, const lx_pos *shift,
                             int64_t kv_size, int64_t n_head_kv, int64_t head_dim);

/* ---- K-shift of any cache type, with llama.cpp's Hadamard rotation ----------------------------
 *
 * llama_kv_cache::build_rope_shift for a quantized K: dequantize to f32 -> rotate back (the K
 * rows are stored rotated by H, hadamard.h) -> RoPE -> rotate forward -> quantize back. Per cell i
 * with shift[i] != 0 and per head h of its row:
 *
 *   x = row i, head h as floats (f32 as is, f16 exact, q8_0 / q4_0 dequantized)   [head_dim]
 *   if rot_block > 0: x = H x per block of rot_block        (un-rotate: H H = I)
 *   x[0 .. n_rot) = RoPE(x, shift[i])                        (the rotation above, rp)
 *   if rot_block > 0: x = H x per block                      (re-rotate)
 *   row i, head h = x stored as type t   (f32 copy, f16 round to nearest even, q8_0 / q4_0
 *                                         quantized with the reference rounding, quants.h)
 *
 * A head's values are whole blocks of its row (quantized t needs head_dim % 32 == 0, as llama.cpp
 * requires of a quantized K), so working head by head gives the blocks a whole row would. With
 * rot_block == 0 and t f32 / f16 this is lx_rope_k_shift_f32 / _f16 (pass-through dims keep their
 * bits); with a rotation every value of the head changes. Where llama.cpp rotates only a view of
 * the first n_rot dims (its K-shift view), this un-rotates the whole head, which is the same when
 * n_rot == head_dim (every model llama.cpp rotates) and correct otherwise. Cells with shift 0 are
 * not touched. OpenMP over cells (n_threads >= 1).
 *
 *   k  [kv_size] rows of lx_row_bytes(t, n_head_kv * head_dim) bytes     shift [kv_size]
 *
 * note: t in {f32, f16, q8_0, q4_0}; rot_block 0 or a power of two (<= LX_HADAMARD_MAX_BLOCK)
 * dividing head_dim; head_dim <= LX_ROPE_MAX_HEAD. The fast version uses the fast dequantize /
 * Hadamard / quantize rows; without rotation its bytes equal the _ref twin's (every step is
 * bit-exact), with rotation the Hadamard transforms differ by rounding (hadamard.h), which can
 * move a quantized value by one step. */
#define LX_ROPE_MAX_HEAD 4096   /* largest head_dim of lx_rope_k_shift (one head in float on the stack) */

void lx_rope_k_shift(const lx_rope_params *rp, lx_type t, void *k, const lx_pos *shift,
                     int64_t kv_size, int64_t n_head_kv, int64_t head_dim, int rot_block, int n_threads);
void lx_rope_k_shift_ref(const lx_rope_params *rp, lx_type t, void *k, const lx_pos *shift,
                         int64_t kv_size, int64_t n_head_kv, int64_t head_dim, int rot_block);

#endif /* LX_ROPE_H */
