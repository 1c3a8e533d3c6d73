/* rope.h: rotary position embedding as ggml's CPU backend computes it (ggml_rope_ext: frequency
 * factors, YaRN and the attention factor included), and llama.cpp's K-shift
 * (llama_kv_cache::build_graph_shift / build_rope_shift) over the K rows of the cache.
 *
 * One head of head_dim values; only the first n_rot rotate, the rest pass through untouched:
 *
 *   norm (GGML_ROPE_TYPE_NORM = 0):  pairs (2i, 2i+1)          x: [a0 b0 a1 b1 ... | pass ...]
 *   neox (GGML_ROPE_TYPE_NEOX = 2):  pairs (i, i + n_rot/2)     x: [a0 a1 ... b0 b1 ... | pass ...]
 *
 *   pair i, position p:  a' = m (a cos(theta_i) - b sin(theta_i))
 *                        b' = m (a sin(theta_i) + b cos(theta_i))
 *
 * The angles and the magnitude m, as ggml_rope_cache_init / rope_yarn compute them, in float:
 *
 *   theta_scale = powf(freq_base, -2.0f/n_rot);  theta = (float) p, times theta_scale once per pair
 *   pair i:  extrap = theta / ff_i                ff_i = freq_factors[i], 1 without factors
 *            interp = freq_scale * extrap
 *            ext_factor == 0:  theta_i = interp,  m = attn_factor
 *            ext_factor != 0:  r = ramp(i) * ext_factor,  theta_i = interp * (1 - r) + extrap * r,
 *                              m = attn_factor * (1 + 0.1 logf(1 / freq_scale))
 *            ramp(i) = 1 - clamp((i - corr_dims[0]) / max(0.001, corr_dims[1] - corr_dims[0]), 0, 1)
 *            cache: cosf(theta_i) * m, sinf(theta_i) * m
 *
 * Frequency factors divide each pair's angle (Llama 3's rope_freqs, LongRoPE's long / short factors);
 * YaRN (ext_factor != 0) blends, per pair, the interpolated angle (scaled by freq_scale) with the
 * extrapolated one (not scaled) along a ramp over pairs [corr_dims[0], corr_dims[1]], and scales the
 * magnitude. Without factors, with ext_factor 0 and attn_factor 1 this is plain RoPE, bit for bit
 * (a division by 1 and a product by 1 are exact). The fast kernels give the same bits as their _ref
 * twins for finite inputs (no FMA contraction).
 *
 * The K-shift rotates by the angles of the shift with the same m, as llama.cpp's build_rope_shift
 * passes the layer's factors and the context's YaRN parameters to ggml_rope_ext: with m != 1 every
 * shift scales the shifted K by m once more, as llama.cpp does.
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

/* Every field is read: build it whole (a designated initializer or every field set); plain RoPE is
 * freq_factors NULL, ext_factor 0, attn_factor 1 (corr_dims then unused). */
typedef struct {
    int32_t      n_rot;         /* rotated dims per head: even, in [2, min(head_dim, LX_ROPE_MAX_ROT)] */
    float        freq_base;     /* > 0 */
    float        freq_scale;    /* > 0 when ext_factor != 0 (its log scales m) */
    lx_rope_kind kind;
    const float *freq_factors;  /* [n_rot/2] divisors of each pair's angle, or NULL */
    float        ext_factor;    /* YaRN mix, 0 = off */
    float        attn_factor;   /* cos and sin times this (mscale); 1 = plain */
    float        corr_dims[2];  /* YaRN ramp bounds (lx_rope_yarn_corr_dims) */
} lx_rope_params;

/* dims [2] <- the YaRN correction range of ggml_rope_yarn_corr_dims: the pairs whose wavelength
 * turns beta_fast (dims[0], floored, >= 0) and beta_slow (dims[1], ceiled, <= n_dims - 1) times
 * over n_ctx_orig positions, dims = n_dims * logf(n_ctx_orig / (beta * 2 pi)) / (2 logf(freq_base)).
 * n_ctx_orig 0 gives dims[1] = -inf (as ggml; only used with ext_factor != 0). */
void lx_rope_yarn_corr_dims(int n_dims, int n_ctx_orig, float freq_base, float beta_fast, float beta_slow,
                            float dims[2]);

/* cache [n_rot] <- interleaved cos/sin of the angles of position p, times m: cache[2i] =
 * cos(theta_i) m, cache[2i+1] = sin(theta_i) m, i in [0, n_rot/2) (ggml_rope_cache_init) */
void lx_rope_cache(const lx_rope_params *rp, lx_pos p, float *cache);

/* Rotate x [n_tokens][n_head][head_dim] in place, token t by position pos[t] [n_tokens]
 * (the model's Q/K RoPE). n_threads >= 1 (OpenMP over tokens). */
void lx_rope_f32(const lx_rope_params *rp, float *x, const lx_pos *pos,
                 int64_t n_tokens, int64_t n_head, int64_t head_dim, int n_threads);
void lx_rope_f32_ref(const lx_rope_params *rp, float *x, const lx_pos *pos,
                     int64_t n_tokens, int64_t n_head, int64_t head_dim);

/* K-shift of one layer and stream, in place: k [kv_size][n_head_kv*head_dim] (row i = cell i);
 * every cell i with shift[i] != 0 [kv_size] is rotated by the angles of position shift[i] (rp's
 * factors, YaRN and magnitude m included, as for a token at that position); cells
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
