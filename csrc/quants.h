/* quants.h: element formats of the KV cache rows.
 *
 * This unit owns the conversions between float32 and the cache's storage
 * formats. Today: IEEE 754 binary16 ("f16", stored as uint16_t bits).
 * A later issue adds the q8_0 / q4_0 blocks (block_q8_0, block_q4_0 with
 * their _Static_asserts, quantize/dequantize rows and dots) in the section
 * marked below; nothing here depends on them.
 *
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

#include <stdint.h>
#include <string.h>

#include "common.h"

/* Storage type of a cache tensor. Values follow ggml_type so that a file or
 * a log line can name them alike; LX_TYPE_Q4_0 = 2 and LX_TYPE_Q8_0 = 8 come
 * with the blocks. */
typedef enum {
    LX_TYPE_F32 = 0,   /* float                        */
    LX_TYPE_F16 = 1,   /* IEEE half, as uint16_t bits  */
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

/* 1 if the fast f16 rows use F16C on this CPU, 0 for the portable path */
int lx_quants_have_f16c(void);

/* ---- q8_0 / q4_0 blocks: added by a later issue ------------------------- */

#endif /* LX_QUANTS_H */
