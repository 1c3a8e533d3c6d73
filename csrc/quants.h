/* quants.h: element formats of cache rows and model weights.
 *
 * This unit owns the conversions between float32 and the storage formats of
 * the cache and of model weights: IEEE 754 binary16 ("f16", stored as
 * uint16_t bits), and ggml's quantized blocks (section "ggml blocks" below:
 * layouts with their _Static_asserts, dequantize rows, quantize rows for the
 * activations of quantized dot products). Matrix products over these blocks
 * live in product.h (gemm.h, matmul.h).
 *
 * f16:
 * Conventions (same as ggml's fp16 helpers, bit-exact with numpy.float16):
 *   - f32 -> f16 rounds to nearest, ties to even; overflow gives +-inf;
 *     results below the smallest normal half are rounded to half denormals
 *     (or to +-0), never flushed;
 *   - NaNs as numpy's npy_floatbits_to_halfbits: a NaN keeps its sign and the
 *     top 10 bits of its payload (its quiet bit is not forced; a payload that
 *     would vanish becomes 1, so a NaN never turns into an inf);
 *   - f16 -> f32 is exact (every half, denormals included, is a float) and a
 *     NaN keeps its payload (numpy again; F16C would set the quiet bit).
 * Each row function has a scalar `_ref` twin; the fast versions (F16C on
 * x86-64, chosen at run time; vectors holding a NaN take the scalar path)
 * give bit-identical results.
 */
#ifndef LX_QUANTS_H
#define LX_QUANTS_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "common.h"

/* Storage type of a tensor (cache rows, model weights). Values are ggml_type's
 * numbers, so a GGUF file's tensor type or a log line names them alike. The
 * block formats are described in the "ggml blocks" section below. */
typedef enum {
    LX_TYPE_F32  = 0,   /* float                                  */
    LX_TYPE_F16  = 1,   /* IEEE half, as uint16_t bits            */
    LX_TYPE_Q4_0 = 2,   /* 32 x 4 bit, scale                18 B  */
    LX_TYPE_Q4_1 = 3,   /* 32 x 4 bit, scale + min          20 B  */
    LX_TYPE_Q5_0 = 6,   /* 32 x 5 bit, scale                22 B  */
    LX_TYPE_Q5_1 = 7,   /* 32 x 5 bit, scale + min          24 B  */
    LX_TYPE_Q8_0 = 8,   /* 32 x 8 bit, scale                34 B  */
    LX_TYPE_Q8_1 = 9,   /* 32 x 8 bit, scale + d*sum (activations) 36 B */
    LX_TYPE_Q2_K = 10,  /* 256 x 2 bit, 16 sub-blocks       84 B  */
    LX_TYPE_Q3_K = 11,  /* 256 x 3 bit, 16 sub-blocks      110 B  */
    LX_TYPE_Q4_K = 12,  /* 256 x 4 bit, 8 sub-blocks       144 B  */
    LX_TYPE_Q5_K = 13,  /* 256 x 5 bit, 8 sub-blocks       176 B  */
    LX_TYPE_Q6_K = 14,  /* 256 x 6 bit, 16 sub-blocks      210 B  */
    LX_TYPE_Q8_K = 15,  /* 256 x 8 bit, f32 scale + sums (activations only) 292 B */
    LX_TYPE_BF16 = 30,  /* bfloat16, as uint16_t bits             */
} lx_type;

/* ---- f16 scalars ------------------------------------------------------ */

static inline uint32_t lx_f32_bits_(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float lx_bits_f32_(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

/* the float value of half bits h (exact) */
static inline float lx_fp16_to_fp32(uint16_t h) {
    const uint32_t sign = (uint32_t) (h & 0x8000u) << 16;
    const uint32_t exp  = (h >> 10) & 0x1fu;
    uint32_t mant       = h & 0x3ffu;
    if (exp == 0x1f) {                       /* inf / nan: keep the payload */
        return lx_bits_f32_(sign | 0x7f800000u | (mant << 13));
    }
    if (exp != 0) {                          /* normal: rebias 15 -> 127 */
        return lx_bits_f32_(sign | ((exp + 112u) << 23) | (mant << 13));
    }
    if (mant == 0) return lx_bits_f32_(sign); /* +-0 */
    /* denormal: mant * 2^-24, exact in float */
    const float v = (float) mant * 5.9604644775390625e-08f;
    return lx_bits_f32_(sign | lx_f32_bits_(v));
}

/* the half nearest to f (ties to even), as bits */
static inline uint16_t lx_fp32_to_fp16(float f) {
    const uint32_t x    = lx_f32_bits_(f);
    const uint16_t sign = (uint16_t) ((x >> 16) & 0x8000u);
    const uint32_t ax   = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) {                 /* inf or nan */
        if (ax == 0x7f800000u) return sign | 0x7c00u;
        const uint16_t payload = (uint16_t) ((ax >> 13) & 0x3ffu);
        return sign | 0x7c00u | (payload ? payload : 1u);
    }
    if (ax >= 0x477ff000u) return sign | 0x7c00u;   /* >= 65520: rounds to inf */
    if (ax >= 0x38800000u) {                 /* normal half (>= 2^-14) */
        /* rebias the exponent and round the 13 dropped bits to nearest even;
         * a carry out of the mantissa correctly bumps the exponent */
        const uint32_t r = ax - 0x38000000u;                 /* exp - 112 */
        const uint32_t lsb = (r >> 13) & 1u;
        return sign | (uint16_t) ((r + 0x0fffu + lsb) >> 13);
    }
    if (ax < 0x33000000u) return sign;       /* < 2^-25: rounds to +-0 */
    {                                        /* denormal half */
        const uint32_t e     = ax >> 23;                     /* 102..112 */
        const uint32_t m     = (ax & 0x7fffffu) | 0x800000u; /* 24-bit significand */
        const uint32_t shift = 126u - e;                     /* 14..24 */
        const uint32_t q     = m >> shift;
        const uint32_t rem   = m & ((1u << shift) - 1u);
        const uint32_t half  = 1u << (shift - 1u);
        const uint32_t up    = rem > half || (rem == half && (q & 1u));
        return sign | (uint16_t) (q + up);                   /* may carry into the min normal */
    }
}

/* ---- f16 rows ----------------------------------------------------------- */

/* y[i] = half(x[i]) for i in [0, n).  x: [n] float32, y: [n] half bits. */
void lx_fp32_to_fp16_row(const float *x, uint16_t *y, int64_t n);
void lx_fp32_to_fp16_row_ref(const float *x, uint16_t *y, int64_t n);

/* y[i] = float(x[i]) for i in [0, n).  x: [n] half bits, y: [n] float32. */
void lx_fp16_to_fp32_row(const uint16_t *x, float *y, int64_t n);
void lx_fp16_to_fp32_row_ref(const uint16_t *x, float *y, int64_t n);

/* ---- ggml blocks --------------------------------------------------------- *
 *
 * The byte layouts of ggml's quantized types (ggml-common.h), so that a GGUF
 * tensor's bytes can be read in place: a row of n values of type t is
 * n / lx_type_block_size(t) consecutive blocks (lx_row_bytes(t, n) bytes).
 * Scales are f16 bits (lx_fp16_to_fp32) except q8_K's float. Value i of a
 * block ("q" an unsigned field, d/m/dmin the block's f16 scales as floats):
 *
 *   q4_0  d,  qs[16]          q = i < 16 ? qs[i] & 15 : qs[i-16] >> 4      v = (q - 8) * d
 *   q4_1  d, m, qs[16]        q as q4_0                                   v = q * d + m
 *   q5_0  d, qh[4], qs[16]    q = nibble as q4_0 | bit i of qh << 4       v = (q - 16) * d
 *   q5_1  d, m, qh[4], qs[16] q as q5_0                                   v = q * d + m
 *   q8_0  d, qs[32] (int8)                                                v = qs[i] * d
 *   q8_1  d, s, qs[32]        s = d * sum(qs) (activations of q4_1/q5_1 dots)
 *   q2_K  scales[16], qs[64], d, dmin: 16 groups of 16, 2-bit q; group g has
 *         sc = scales[g] & 15, mn = scales[g] >> 4   v = (d*sc) * q - (dmin*mn)
 *   q3_K  hmask[32], qs[64], scales[12], d: 16 groups of 16, q in [-4, 3],
 *         6-bit scales minus 32                      v = (d*(sc-32)) * q
 *   q4_K  d, dmin, scales[12], qs[128]: 8 groups of 32, 6-bit sc and mn
 *         packed in 12 bytes (lx_k_scale_min)        v = (d*sc) * q - (dmin*mn)
 *   q5_K  d, dmin, scales[12], qh[32], qs[128]: q4_K with a 5th bit in qh
 *   q6_K  ql[128], qh[64], scales[16] (int8), d: 16 groups of 16, 6-bit q
 *                                                    v = (d*sc) * (q - 32)
 *   q8_K  d (float), qs[256], bsums[16]: activations of the K-quant dots
 *
 * Within 256: values run in halves / quarters of the super-block exactly as
 * ggml's dequantize_row_*; the _ref functions below are that definition, and
 * evaluate the float expressions in ggml's order, so they are bit-exact with
 * ggml's reference dequantization (and with gguf.quants.dequantize). The
 * fast (AVX2) rows give the same bits (no FMA contraction: mul then add).
 */

#define LX_QK     32    /* values per block of the _0/_1 formats */
#define LX_QK_K  256    /* values per super-block of the K formats */

typedef struct { uint16_t d; uint8_t qs[LX_QK / 2]; } lx_block_q4_0;
typedef struct { uint16_t d, m; uint8_t qs[LX_QK / 2]; } lx_block_q4_1;
typedef struct { uint16_t d; uint8_t qh[4]; uint8_t qs[LX_QK / 2]; } lx_block_q5_0;
typedef struct { uint16_t d, m; uint8_t qh[4]; uint8_t qs[LX_QK / 2]; } lx_block_q5_1;
typedef struct { uint16_t d; int8_t qs[LX_QK]; } lx_block_q8_0;
typedef struct { uint16_t d, s; int8_t qs[LX_QK]; } lx_block_q8_1;
typedef struct {
    uint8_t  scales[LX_QK_K / 16];  /* low nibble: scale, high: min */
    uint8_t  qs[LX_QK_K / 4];
    uint16_t d, dmin;
} lx_block_q2_K;
typedef struct {
    uint8_t  hmask[LX_QK_K / 8];    /* high bit set: q >= 0 */
    uint8_t  qs[LX_QK_K / 4];
    uint8_t  scales[12];
    uint16_t d;
} lx_block_q3_K;
typedef struct {
    uint16_t d, dmin;
    uint8_t  scales[12];
    uint8_t  qs[LX_QK_K / 2];
} lx_block_q4_K;
typedef struct {
    uint16_t d, dmin;
    uint8_t  scales[12];
    uint8_t  qh[LX_QK_K / 8];
    uint8_t  qs[LX_QK_K / 2];
} lx_block_q5_K;
typedef struct {
    uint8_t  ql[LX_QK_K / 2];
    uint8_t  qh[LX_QK_K / 4];
    int8_t   scales[LX_QK_K / 16];
    uint16_t d;
} lx_block_q6_K;
typedef struct {
    float    d;
    int8_t   qs[LX_QK_K];
    int16_t  bsums[LX_QK_K / 16];   /* sums of qs in groups of 16 */
} lx_block_q8_K;

_Static_assert(sizeof(lx_block_q4_0) == 2 + 16, "q4_0 block is 18 bytes");
_Static_assert(sizeof(lx_block_q4_1) == 4 + 16, "q4_1 block is 20 bytes");
_Static_assert(sizeof(lx_block_q5_0) == 2 + 4 + 16, "q5_0 block is 22 bytes");
_Static_assert(sizeof(lx_block_q5_1) == 4 + 4 + 16, "q5_1 block is 24 bytes");
_Static_assert(sizeof(lx_block_q8_0) == 2 + 32, "q8_0 block is 34 bytes");
_Static_assert(sizeof(lx_block_q8_1) == 4 + 32, "q8_1 block is 36 bytes");
_Static_assert(sizeof(lx_block_q2_K) == 16 + 64 + 4, "q2_K block is 84 bytes");
_Static_assert(sizeof(lx_block_q3_K) == 32 + 64 + 12 + 2, "q3_K block is 110 bytes");
_Static_assert(sizeof(lx_block_q4_K) == 4 + 12 + 128, "q4_K block is 144 bytes");
_Static_assert(sizeof(lx_block_q5_K) == 4 + 12 + 32 + 128, "q5_K block is 176 bytes");
_Static_assert(sizeof(lx_block_q6_K) == 128 + 64 + 16 + 2, "q6_K block is 210 bytes");
_Static_assert(sizeof(lx_block_q8_K) == 4 + 256 + 32, "q8_K block is 292 bytes");

/* ---- type sizes ------------------------------------------------------------ */

/* values per block of type t (1 for f32/f16/bf16); 0 if t is not a type above */
int64_t lx_type_block_size(lx_type t);

/* bytes per block of type t; 0 if t is not a type above */
size_t lx_type_block_bytes(lx_type t);

/* bytes of a row of n values of type t.
 * note: n must be a multiple of lx_type_block_size(t). */
size_t lx_row_bytes(lx_type t, int64_t n);

/* 1 if lx_dequantize_row handles t (every type above but q8_1 and q8_K,
 * which ggml only uses as dot-product activations), else 0 */
int lx_type_can_dequantize(lx_type t);

/* the 6-bit scale *sc and min *mn of group j in [0, 8) of a q4_K / q5_K
 * super-block (ggml's get_scale_min_k4). scales: [12] */
static inline void lx_k_scale_min(int j, const uint8_t *scales, uint8_t *sc, uint8_t *mn) {
    if (j < 4) {
        *sc = scales[j] & 63;
        *mn = scales[j + 4] & 63;
    } else {
        *sc = (uint8_t) ((scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4));
        *mn = (uint8_t) ((scales[j + 4] >> 4) | ((scales[j] >> 6) << 4));
    }
}

/* ---- dequantization ------------------------------------------------------ */

/* y[i] = value i of the row x, for i in [0, n).
 * x: lx_row_bytes(t, n) bytes, y: [n] float32. note: lx_type_can_dequantize(t)
 * and n a multiple of the block size. Single-threaded (call it per row); the
 * fast path (AVX2, chosen at run time) is bit-exact with the _ref. */
void lx_dequantize_row(lx_type t, const void *x, float *y, int64_t n);
void lx_dequantize_row_ref(lx_type t, const void *x, float *y, int64_t n);

/* lx_dequantize_row on each of n_rows rows, OpenMP over rows.
 * x: [n_rows] rows of lx_row_bytes(t, n_cols) bytes, y: [n_rows][n_cols] float32. */
void lx_dequantize_rows(lx_type t, const void *x, float *y, int64_t n_rows, int64_t n_cols,
                        int n_threads);

/* per-format scalar references (the definitions; n a multiple of the block size) */
void lx_dequantize_row_q4_0_ref(const lx_block_q4_0 *x, float *y, int64_t n);
void lx_dequantize_row_q4_1_ref(const lx_block_q4_1 *x, float *y, int64_t n);
void lx_dequantize_row_q5_0_ref(const lx_block_q5_0 *x, float *y, int64_t n);
void lx_dequantize_row_q5_1_ref(const lx_block_q5_1 *x, float *y, int64_t n);
void lx_dequantize_row_q8_0_ref(const lx_block_q8_0 *x, float *y, int64_t n);
void lx_dequantize_row_q2_K_ref(const lx_block_q2_K *x, float *y, int64_t n);
void lx_dequantize_row_q3_K_ref(const lx_block_q3_K *x, float *y, int64_t n);
void lx_dequantize_row_q4_K_ref(const lx_block_q4_K *x, float *y, int64_t n);
void lx_dequantize_row_q5_K_ref(const lx_block_q5_K *x, float *y, int64_t n);
void lx_dequantize_row_q6_K_ref(const lx_block_q6_K *x, float *y, int64_t n);
void lx_bf16_to_fp32_row(const uint16_t *x, float *y, int64_t n);

/* ---- quantization (ggml's reference rounding) ------------------------------- */

/* q8_0: d = amax/127 (stored as f16), qs[i] = roundf(x[i] * (1/d)) (ties away
 * from 0). x: [n] float32 (finite), y: [n/32] blocks. The fast path is
 * bit-exact. Where 1/d overflows (a block with amax below ~127/FLT_MAX), the
 * products x[i] * (1/d) that are NaN give 0 and the infinite ones +-127 (ggml's
 * reference leaves this undefined; the same for q8_1, q8_K, q4_0 below). */
void lx_quantize_row_q8_0(const float *x, lx_block_q8_0 *y, int64_t n);
void lx_quantize_row_q8_0_ref(const float *x, lx_block_q8_0 *y, int64_t n);

/* q8_1: as q8_0, plus s = f16(d * sum(qs)) with d the unrounded float scale. */
void lx_quantize_row_q8_1(const float *x, lx_block_q8_1 *y, int64_t n);
void lx_quantize_row_q8_1_ref(const float *x, lx_block_q8_1 *y, int64_t n);

/* x [n] as q8_0 (dt LX_TYPE_Q8_0) or q8_1 (LX_TYPE_Q8_1) blocks taken apart, for the products that
 * read the values and the scales separately: qs [n] the blocks' values, d [n/32] and s [n/32] the
 * floats of their f16 d and s (s 0 for q8_0), sum [n/32] the sums of their qs; the same values as
 * lx_quantize_row_q8_0 / _q8_1 (a NaN scale may differ in payload between the paths). */
void lx_quantize_row_q8_split(lx_type dt, const float *x, int8_t *qs, float *d, float *s, int32_t *sum, int64_t n);
void lx_quantize_row_q8_split_ref(lx_type dt, const float *x, int8_t *qs, float *d, float *s, int32_t *sum, int64_t n);

/* q8_K: iscale = -127/max (max: the value of largest magnitude), qs[i] =
 * min(127, nearest_even(iscale * x[i])), d = 1/iscale, bsums; all-zero
 * super-blocks get d = 0, qs = 0. x: [n] (n a multiple of 256), y: [n/256]. */
void lx_quantize_row_q8_K(const float *x, lx_block_q8_K *y, int64_t n);
void lx_quantize_row_q8_K_ref(const float *x, lx_block_q8_K *y, int64_t n);

/* q4_0 (a KV cache type): d = max/-8 with max the value of largest magnitude
 * (the first one in the block; +0 when the block is all zeros), id = 1/d (0 if
 * d == 0), q = min(15, (int8)(clamp(x*id, 8) + 8.5)), stored as nibbles: value
 * j in the low nibble of qs[j], value j+16 in the high one. x: [n] float32, y:
 * [n/32] blocks. The fast row (AVX2, chosen at run time) is bit-exact. */
void lx_quantize_row_q4_0(const float *x, lx_block_q4_0 *y, int64_t n);
void lx_quantize_row_q4_0_ref(const float *x, lx_block_q4_0 *y, int64_t n);

/* y = x stored as type t: t in {f32 (a copy), f16 (lx_fp32_to_fp16_row), q4_0,
 * q8_0, q8_1, q8_K} (the fast row where there is one). x: [n] float32, y:
 * lx_row_bytes(t, n) bytes. Returns LX_OK, or LX_ERR_INVALID for another type
 * or an n that is not a multiple of the block size (y untouched). */
lx_status lx_quantize_row(lx_type t, const float *x, void *y, int64_t n);
lx_status lx_quantize_row_ref(lx_type t, const float *x, void *y, int64_t n);

/* 1 if t is a type a KV cache row may have: f32, f16, q8_0 or q4_0 */
int lx_type_is_cache(lx_type t);

/* llama.cpp's set_rows (ggml_set_rows into the K / V cache): row i of src is
 * stored as type t into row idxs[i] of dst, for i in [0, n):
 *
 *   src  float [n][n_per_row]                          (token i's K or V)
 *   dst  [n_dst_rows] rows of lx_row_bytes(t, n_per_row) bytes   (cache rows)
 *   idxs uint32 [n]                                    (the cell of token i)
 *
 * t in {f32, f16, q8_0, q4_0}; quantized rows are bit-exact with the _ref
 * quantizers. Mutates only the dst rows named in idxs. note: every idxs[i] <
 * n_dst_rows (the caller checks; n_dst_rows is not passed) and the idxs are
 * distinct when n_threads > 1 (with a repeated index the last row wins only on
 * one thread). OpenMP over rows. Returns LX_OK, or LX_ERR_INVALID (bad type /
 * n_per_row, dst untouched). */
lx_status lx_set_rows(lx_type t, const float *src, void *dst, const uint32_t *idxs, int64_t n,
                      int64_t n_per_row, int n_threads);
lx_status lx_set_rows_ref(lx_type t, const float *src, void *dst, const uint32_t *idxs, int64_t n,
                          int64_t n_per_row);

#endif /* LX_QUANTS_H */
