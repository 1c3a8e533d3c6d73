/* quants.c: f16 rows (scalar reference + F16C fast path chosen at run time).
 * See quants.h for the rounding contract. */
#include "quants.h"
#include "simd.h"
#include "cpu.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define LX_X86_DISPATCH 1
#include <immintrin.h>
#endif

/* ---- scalar reference -------------------------------------------------- */

void lx_fp32_to_fp16_row_ref(const float *x, uint16_t *y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] = lx_fp32_to_fp16(x[i]);
}

void lx_fp16_to_fp32_row_ref(const uint16_t *x, float *y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] = lx_fp16_to_fp32(x[i]);
}

/* ---- F16C ---------------------------------------------------------------- */

#ifdef LX_X86_DISPATCH
/* vcvtps2ph with imm 0 = round to nearest even, ignoring MXCSR.RC; it never
 * flushes half denormals (MXCSR.FTZ does not apply). Float denormal inputs
 * (below any half) round to +-0 either way. vcvtph2ps is exact. The only
 * difference from the scalar definition is NaN payloads (the hardware sets
 * the quiet bit), so a group of 8 that holds a NaN is converted by the scalar
 * code. */
__attribute__((target("avx,f16c")))
static void fp32_to_fp16_row_f16c(const float *x, uint16_t *y, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        if (_mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q))) {
            for (int j = 0; j < 8; ++j) y[i + j] = lx_fp32_to_fp16(x[i + j]);
            continue;
        }
        _mm_storeu_si128((__m128i *) (y + i), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    }
    for (; i < n; ++i) y[i] = lx_fp32_to_fp16(x[i]);
}

__attribute__((target("avx,f16c")))
static void fp16_to_fp32_row_f16c(const uint16_t *x, float *y, int64_t n) {
    const __m128i abs_mask = _mm_set1_epi16(0x7fff);
    const __m128i inf_bits = _mm_set1_epi16(0x7c00);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m128i h = _mm_loadu_si128((const __m128i *) (x + i));
        /* |h| > inf as signed 16-bit: a NaN lane */
        if (_mm_movemask_epi8(_mm_cmpgt_epi16(_mm_and_si128(h, abs_mask), inf_bits))) {
            for (int j = 0; j < 8; ++j) y[i + j] = lx_fp16_to_fp32(x[i + j]);
            continue;
        }
        _mm256_storeu_ps(y + i, _mm256_cvtph_ps(h));
    }
    for (; i < n; ++i) y[i] = lx_fp16_to_fp32(x[i]);
}
#endif

/* ---- dispatch -------------------------------------------------------------- */

void lx_fp32_to_fp16_row(const float *x, uint16_t *y, int64_t n) {
#ifdef LX_X86_DISPATCH
    if (lx_simd_level() >= LX_SIMD_AVX2) { fp32_to_fp16_row_f16c(x, y, n); return; }
#endif
    lx_fp32_to_fp16_row_ref(x, y, n);
}

void lx_fp16_to_fp32_row(const uint16_t *x, float *y, int64_t n) {
#ifdef LX_X86_DISPATCH
    if (lx_simd_level() >= LX_SIMD_AVX2) { fp16_to_fp32_row_f16c(x, y, n); return; }
#endif
    lx_fp16_to_fp32_row_ref(x, y, n);
}

/* ========================================================================== *
 * ggml blocks: sizes, dequantize rows, quantize rows (see quants.h)
 * ========================================================================== */

#include <assert.h>
#include <math.h>

#ifdef _OPENMP
#include <omp.h>
#endif

/* Bit-exactness with ggml needs every float expression evaluated as written:
 * no a*b+c contraction into an FMA. GCC in ISO C mode (-std=c11, as setup.py
 * builds) does not contract; this pragma says the same to clang. */
#pragma STDC FP_CONTRACT OFF

/* ---- type sizes ------------------------------------------------------------ */

int64_t lx_type_block_size(lx_type t) {
    switch (t) {
    case LX_TYPE_F32: case LX_TYPE_F16: case LX_TYPE_BF16: return 1;
    case LX_TYPE_Q4_0: case LX_TYPE_Q4_1: case LX_TYPE_Q5_0: case LX_TYPE_Q5_1:
    case LX_TYPE_Q8_0: case LX_TYPE_Q8_1: return LX_QK;
    case LX_TYPE_Q2_K: case LX_TYPE_Q3_K: case LX_TYPE_Q4_K: case LX_TYPE_Q5_K:
    case LX_TYPE_Q6_K: case LX_TYPE_Q8_K: return LX_QK_K;
    }
    return 0;
}

size_t lx_type_block_bytes(lx_type t) {
    switch (t) {
    case LX_TYPE_F32:  return 4;
    case LX_TYPE_F16:  return 2;
    case LX_TYPE_BF16: return 2;
    case LX_TYPE_Q4_0: return sizeof(lx_block_q4_0);
    case LX_TYPE_Q4_1: return sizeof(lx_block_q4_1);
    case LX_TYPE_Q5_0: return sizeof(lx_block_q5_0);
    case LX_TYPE_Q5_1: return sizeof(lx_block_q5_1);
    case LX_TYPE_Q8_0: return sizeof(lx_block_q8_0);
    case LX_TYPE_Q8_1: return sizeof(lx_block_q8_1);
    case LX_TYPE_Q2_K: return sizeof(lx_block_q2_K);
    case LX_TYPE_Q3_K: return sizeof(lx_block_q3_K);
    case LX_TYPE_Q4_K: return sizeof(lx_block_q4_K);
    case LX_TYPE_Q5_K: return sizeof(lx_block_q5_K);
    case LX_TYPE_Q6_K: return sizeof(lx_block_q6_K);
    case LX_TYPE_Q8_K: return sizeof(lx_block_q8_K);
    }
    return 0;
}

size_t lx_row_bytes(lx_type t, int64_t n) {
    const int64_t bs = lx_type_block_size(t);
    assert(bs > 0 && n % bs == 0);
    return (size_t) (n / bs) * lx_type_block_bytes(t);
}

int lx_type_can_dequantize(lx_type t) {
    return lx_type_block_size(t) > 0 && t != LX_TYPE_Q8_1 && t != LX_TYPE_Q8_K;
}

/* ---- scalar references: dequantize ------------------------------------------ */

void lx_dequantize_row_q4_0_ref(const lx_block_q4_0 *x, float *y, int64_t n) {
    assert(n % LX_QK == 0);
    for (int64_t i = 0; i < n / LX_QK; ++i, y += LX_QK) {
        const float d = lx_fp16_to_fp32(x[i].d);
        for (int j = 0; j < LX_QK / 2; ++j) {
            const int x0 = (x[i].qs[j] & 0x0F) - 8;
            const int x1 = (x[i].qs[j] >> 4) - 8;
            y[j]             = x0 * d;
            y[j + LX_QK / 2] = x1 * d;
        }
    }
}

void lx_dequantize_row_q4_1_ref(const lx_block_q4_1 *x, float *y, int64_t n) {
    assert(n % LX_QK == 0);
    for (int64_t i = 0; i < n / LX_QK; ++i, y += LX_QK) {
        const float d = lx_fp16_to_fp32(x[i].d);
        const float m = lx_fp16_to_fp32(x[i].m);
        for (int j = 0; j < LX_QK / 2; ++j) {
            const int x0 = x[i].qs[j] & 0x0F;
            const int x1 = x[i].qs[j] >> 4;
            y[j]             = x0 * d + m;
            y[j + LX_QK / 2] = x1 * d + m;
        }
    }
}

void lx_dequantize_row_q5_0_ref(const lx_block_q5_0 *x, float *y, int64_t n) {
    assert(n % LX_QK == 0);
    for (int64_t i = 0; i < n / LX_QK; ++i, y += LX_QK) {
        const float d = lx_fp16_to_fp32(x[i].d);
        uint32_t qh;
        memcpy(&qh, x[i].qh, sizeof qh);
        for (int j = 0; j < LX_QK / 2; ++j) {
            const int h0 = (int) ((qh >> j) & 1u) << 4;          /* bit j: value j       */
            const int h1 = (int) ((qh >> (j + 16)) & 1u) << 4;  /* bit j+16: value j+16 */
            const int x0 = ((x[i].qs[j] & 0x0F) | h0) - 16;
            const int x1 = ((x[i].qs[j] >> 4) | h1) - 16;
            y[j]             = x0 * d;
            y[j + LX_QK / 2] = x1 * d;
        }
    }
}

void lx_dequantize_row_q5_1_ref(const lx_block_q5_1 *x, float *y, int64_t n) {
    assert(n % LX_QK == 0);
    for (int64_t i = 0; i < n / LX_QK; ++i, y += LX_QK) {
        const float d = lx_fp16_to_fp32(x[i].d);
        const float m = lx_fp16_to_fp32(x[i].m);
        uint32_t qh;
        memcpy(&qh, x[i].qh, sizeof qh);
        for (int j = 0; j < LX_QK / 2; ++j) {
            const int h0 = (int) ((qh >> j) & 1u) << 4;
            const int h1 = (int) ((qh >> (j + 16)) & 1u) << 4;
            const int x0 = (x[i].qs[j] & 0x0F) | h0;
            const int x1 = (x[i].qs[j] >> 4) | h1;
            y[j]             = x0 * d + m;
            y[j + LX_QK / 2] = x1 * d + m;
        }
    }
}

void lx_dequantize_row_q8_0_ref(const lx_block_q8_0 *x, float *y, int64_t n) {
    assert(n % LX_QK == 0);
    for (int64_t i = 0; i < n / LX_QK; ++i, y += LX_QK) {
        const float d = lx_fp16_to_fp32(x[i].d);
        for (int j = 0; j < LX_QK; ++j) y[j] = x[i].qs[j] * d;
    }
}

void lx_dequantize_row_q2_K_ref(const lx_block_q2_K *x, float *y, int64_t n) {
    assert(n % LX_QK_K == 0);
    for (int64_t i = 0; i < n / LX_QK_K; ++i) {
        const float d = lx_fp16_to_fp32(x[i].d);
        const float dmin = lx_fp16_to_fp32(x[i].dmin);
        const uint8_t *q = x[i].qs;
        int is = 0;
        for (int half = 0; half < 2; ++half, q += 32) {        /* 128 values from 32 bytes */
            for (int shift = 0; shift < 8; shift += 2) {
                for (int k = 0; k < 2; ++k) {                 /* bytes [16k, 16k+16) */
                    const uint8_t sc = x[i].scales[is++];
                    const float dl = d * (sc & 0xF), ml = dmin * (sc >> 4);
                    for (int l = 0; l < 16; ++l) *y++ = dl * ((q[16 * k + l] >> shift) & 3) - ml;
                }
            }
        }
    }
}

/* the 16 6-bit signed-by-32 scales of a q3_K super-block (ggml's kmask unpacking) */
static inline void q3_K_scales(const uint8_t *s12, int8_t *sc) {
    for (int j = 0; j < 16; ++j) {
        const int lo = j < 8 ? (s12[j] & 0xF) : (s12[j - 8] >> 4);
        const int hi = (s12[8 + j % 4] >> (2 * (j / 4))) & 3;
        sc[j] = (int8_t) ((lo | (hi << 4)) - 32);
    }
}

void lx_dequantize_row_q3_K_ref(const lx_block_q3_K *x, float *y, int64_t n) {
    assert(n % LX_QK_K == 0);
    for (int64_t i = 0; i < n / LX_QK_K; ++i) {
        const float d_all = lx_fp16_to_fp32(x[i].d);
        int8_t sc[16];
        q3_K_scales(x[i].scales, sc);
        const uint8_t *q = x[i].qs, *hm = x[i].hmask;
        uint8_t m = 1;
        int is = 0;
        for (int half = 0; half < 2; ++half, q += 32) {
            for (int shift = 0; shift < 8; shift += 2, m <<= 1) {
                for (int k = 0; k < 2; ++k) {
                    const float dl = d_all * sc[is++];
                    for (int l = 0; l < 16; ++l) {
                        const int v = ((q[16 * k + l] >> shift) & 3) - ((hm[16 * k + l] & m) ? 0 : 4);
                        *y++ = dl * v;
                    }
                }
            }
        }
    }
}

void lx_dequantize_row_q4_K_ref(const lx_block_q4_K *x, float *y, int64_t n) {
    assert(n % LX_QK_K == 0);
    for (int64_t i = 0; i < n / LX_QK_K; ++i) {
        const float d = lx_fp16_to_fp32(x[i].d);
        const float dmin = lx_fp16_to_fp32(x[i].dmin);
        const uint8_t *q = x[i].qs;
        for (int j = 0; j < 8; j += 2, q += 32) {             /* 64 values from 32 bytes */
            uint8_t sc, mn;
            lx_k_scale_min(j, x[i].scales, &sc, &mn);
            const float d1 = d * sc, m1 = dmin * mn;
            lx_k_scale_min(j + 1, x[i].scales, &sc, &mn);
            const float d2 = d * sc, m2 = dmin * mn;
            for (int l = 0; l < 32; ++l) *y++ = d1 * (q[l] & 0xF) - m1;
            for (int l = 0; l < 32; ++l) *y++ = d2 * (q[l] >> 4) - m2;
        }
    }
}

void lx_dequantize_row_q5_K_ref(const lx_block_q5_K *x, float *y, int64_t n) {
    assert(n % LX_QK_K == 0);
    for (int64_t i = 0; i < n / LX_QK_K; ++i) {
        const float d = lx_fp16_to_fp32(x[i].d);
        const float dmin = lx_fp16_to_fp32(x[i].dmin);
        const uint8_t *ql = x[i].qs, *qh = x[i].qh;
        uint8_t u1 = 1, u2 = 2;
        for (int j = 0; j < 8; j += 2, ql += 32, u1 <<= 2, u2 <<= 2) {
            uint8_t sc, mn;
            lx_k_scale_min(j, x[i].scales, &sc, &mn);
            const float d1 = d * sc, m1 = dmin * mn;
            lx_k_scale_min(j + 1, x[i].scales, &sc, &mn);
            const float d2 = d * sc, m2 = dmin * mn;
            for (int l = 0; l < 32; ++l) *y++ = d1 * ((ql[l] & 0xF) + ((qh[l] & u1) ? 16 : 0)) - m1;
            for (int l = 0; l < 32; ++l) *y++ = d2 * ((ql[l] >> 4) + ((qh[l] & u2) ? 16 : 0)) - m2;
        }
    }
}

void lx_dequantize_row_q6_K_ref(const lx_block_q6_K *x, float *y, int64_t n) {
    assert(n % LX_QK_K == 0);
    for (int64_t i = 0; i < n / LX_QK_K; ++i) {
        const float d = lx_fp16_to_fp32(x[i].d);
        const uint8_t *ql = x[i].ql, *qh = x[i].qh;
        const int8_t *sc = x[i].scales;
        for (int half = 0; half < 2; ++half, y += 128, ql += 64, qh += 32, sc += 8) {
            for (int l = 0; l < 32; ++l) {
                const int is = l / 16;
                const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
                const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
                const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                y[l]      = d * sc[is + 0] * q1;
                y[l + 32] = d * sc[is + 2] * q2;
                y[l + 64] = d * sc[is + 4] * q3;
                y[l + 96] = d * sc[is + 6] * q4;
            }
        }
    }
}

void lx_bf16_to_fp32_row(const uint16_t *x, float *y, int64_t n) {
    for (int64_t i = 0; i < n; ++i) y[i] = lx_bits_f32_((uint32_t) x[i] << 16);
}

void lx_dequantize_row_ref(lx_type t, const void *x, float *y, int64_t n) {
    switch (t) {
    case LX_TYPE_F32:  memcpy(y, x, (size_t) n * sizeof(float)); return;
    case LX_TYPE_F16:  lx_fp16_to_fp32_row_ref(x, y, n); return;
    case LX_TYPE_BF16: lx_bf16_to_fp32_row(x, y, n); return;
    case LX_TYPE_Q4_0: lx_dequantize_row_q4_0_ref(x, y, n); return;
    case LX_TYPE_Q4_1: lx_dequantize_row_q4_1_ref(x, y, n); return;
    case LX_TYPE_Q5_0: lx_dequantize_row_q5_0_ref(x, y, n); return;
    case LX_TYPE_Q5_1: lx_dequantize_row_q5_1_ref(x, y, n); return;
    case LX_TYPE_Q8_0: lx_dequantize_row_q8_0_ref(x, y, n); return;
    case LX_TYPE_Q2_K: lx_dequantize_row_q2_K_ref(x, y, n); return;
    case LX_TYPE_Q3_K: lx_dequantize_row_q3_K_ref(x, y, n); return;
    case LX_TYPE_Q4_K: lx_dequantize_row_q4_K_ref(x, y, n); return;
    case LX_TYPE_Q5_K: lx_dequantize_row_q5_K_ref(x, y, n); return;
    case LX_TYPE_Q6_K: lx_dequantize_row_q6_K_ref(x, y, n); return;
    case LX_TYPE_Q8_1: case LX_TYPE_Q8_K: break;
    }
    assert(0 && "lx_dequantize_row_ref: type without dequantization");
}

/* ---- scalar references: quantize -------------------------------------------- */

/* v clamped to [-lim, lim], a NaN to 0. A no-op on every finite block (there
 * |x / d| <= lim up to one rounding); it only defines the results of ggml's
 * reference where that has none: a block whose largest magnitude is so small
 * (< ~lim / FLT_MAX) that 1/d overflows, giving 0 * inf = NaN and +-inf.
 * The fast rows clamp alike, so they stay bit-exact there too. */
static inline float clamp_q(float v, float lim) {
    if (v != v) return 0.0f;
    return v > lim ? lim : (v < -lim ? -lim : v);
}

/* round to nearest, ties to even, for |f| <= 2^22 (ggml's nearest_int) */
static inline int nearest_int(float f) {
    const float v = f + 12582912.f;     /* 1.5 * 2^23: the integer lands in the low mantissa bits */
    int32_t i;
    memcpy(&i, &v, sizeof i);
    return (i & 0x007fffff) - 0x00400000;
}

void lx_quantize_row_q8_0_ref(const float *x, lx_block_q8_0 *y, int64_t n) {
    assert(n % LX_QK == 0);
    for (int64_t i = 0; i < n / LX_QK; ++i, x += LX_QK) {
        float amax = 0.0f;
        for (int j = 0; j < LX_QK; ++j) amax = fmaxf(amax, fabsf(x[j]));
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        y[i].d = lx_fp32_to_fp16(d);
        for (int j = 0; j < LX_QK; ++j) y[i].qs[j] = (int8_t) roundf(clamp_q(x[j] * id, 127.0f));
    }
}

void lx_quantize_row_q8_1_ref(const float *x, lx_block_q8_1 *y, int64_t n) {
    assert(n % LX_QK == 0);
    for (int64_t i = 0; i < n / LX_QK; ++i, x += LX_QK) {
        float amax = 0.0f;
        for (int j = 0; j < LX_QK; ++j) amax = fmaxf(amax, fabsf(x[j]));
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        y[i].d = lx_fp32_to_fp16(d);
        int sum = 0;
        for (int j = 0; j < LX_QK; ++j) {
            y[i].qs[j] = (int8_t) roundf(clamp_q(x[j] * id, 127.0f));
            sum += y[i].qs[j];
        }
        y[i].s = lx_fp32_to_fp16((float) sum * d);
    }
}

void lx_quantize_row_q8_K_ref(const float *x, lx_block_q8_K *y, int64_t n) {
    assert(n % LX_QK_K == 0);
    for (int64_t i = 0; i < n / LX_QK_K; ++i, x += LX_QK_K) {
        float max = 0.0f, amax = 0.0f;
        for (int j = 0; j < LX_QK_K; ++j) {
            const float ax = fabsf(x[j]);
            if (ax > amax) { amax = ax; max = x[j]; }
        }
        if (amax == 0.0f) {
            y[i].d = 0.0f;
            memset(y[i].qs, 0, sizeof y[i].qs);
            memset(y[i].bsums, 0, sizeof y[i].bsums);
            continue;
        }
        const float iscale = -127.0f / max;
        for (int j = 0; j < LX_QK_K; ++j) {
            const int v = nearest_int(clamp_q(iscale * x[j], 127.0f));
            y[i].qs[j] = (int8_t) (v < 127 ? v : 127);
        }
        for (int g = 0; g < LX_QK_K / 16; ++g) {
            int sum = 0;
            for (int l = 0; l < 16; ++l) sum += y[i].qs[16 * g + l];
            y[i].bsums[g] = (int16_t) sum;
        }
        y[i].d = 1.0f / iscale;
    }
}

void lx_quantize_row_q4_0_ref(const float *x, lx_block_q4_0 *y, int64_t n) {
    assert(n % LX_QK == 0);
    for (int64_t i = 0; i < n / LX_QK; ++i, x += LX_QK) {
        float amax = 0.0f, max = 0.0f;
        for (int j = 0; j < LX_QK; ++j) {
            if (amax < fabsf(x[j])) { amax = fabsf(x[j]); max = x[j]; }
        }
        const float d = max / -8;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        y[i].d = lx_fp32_to_fp16(d);
        for (int j = 0; j < LX_QK / 2; ++j) {
            const int8_t q0 = (int8_t) (clamp_q(x[j] * id, 8.0f) + 8.5f);
            const int8_t q1 = (int8_t) (clamp_q(x[j + LX_QK / 2] * id, 8.0f) + 8.5f);
            const uint8_t u0 = (uint8_t) (q0 < 15 ? q0 : 15), u1 = (uint8_t) (q1 < 15 ? q1 : 15);
            y[i].qs[j] = (uint8_t) (u0 | (u1 << 4));
        }
    }
}

/* ---- AVX2 rows --------------------------------------------------------------- */

#ifdef LX_X86_DISPATCH
#define LX_AVX2 __attribute__((target("avx2,fma,f16c")))
#define LX_INLINE inline __attribute__((always_inline))

/* half -> float, exact for every input (a NaN keeps its payload as in the
 * scalar definition; F16C alone would set the quiet bit) */
static LX_INLINE LX_AVX2 float f16_exact(uint16_t h) {
    return (h & 0x7fffu) > 0x7c00u ? lx_fp16_to_fp32(h) : _cvtsh_ss(h);
}

/* y[0..32) = float(int8 lanes of q) * d (+ m when add_m), mul then add: ggml's rounding */
static LX_INLINE LX_AVX2 void store32_i8(__m256i q, float d, float m, int add_m, int sub_m, float *y) {
    const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int k = 0; k < 4; ++k) {
        __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(parts[k])), vd);
        if (add_m) v = _mm256_add_ps(v, vm);
        if (sub_m) v = _mm256_sub_ps(v, vm);
        _mm256_storeu_ps(y + 8 * k, v);
    }
}

static LX_AVX2 void dequantize_row_q4_0_avx2(const lx_block_q4_0 *x, float *y, int64_t n) {
    const __m256i off = _mm256_set1_epi8(8);
    for (int64_t i = 0; i < n / LX_QK; ++i, y += LX_QK)
        store32_i8(_mm256_sub_epi8(lx_nib32_avx2(x[i].qs), off), f16_exact(x[i].d), 0, 0, 0, y);
}

static LX_AVX2 void dequantize_row_q4_1_avx2(const lx_block_q4_1 *x, float *y, int64_t n) {
    for (int64_t i = 0; i < n / LX_QK; ++i, y += LX_QK)
        store32_i8(lx_nib32_avx2(x[i].qs), f16_exact(x[i].d), f16_exact(x[i].m), 1, 0, y);
}

static LX_AVX2 void dequantize_row_q5_0_avx2(const lx_block_q5_0 *x, float *y, int64_t n) {
    const __m256i b4 = _mm256_set1_epi8(0x10), off = _mm256_set1_epi8(16);
    for (int64_t i = 0; i < n / LX_QK; ++i, y += LX_QK) {
        const __m256i q = _mm256_or_si256(lx_nib32_avx2(x[i].qs), _mm256_and_si256(lx_bits32_avx2(x[i].qh), b4));
        store32_i8(_mm256_sub_epi8(q, off), f16_exact(x[i].d), 0, 0, 0, y);
    }
}

static LX_AVX2 void dequantize_row_q5_1_avx2(const lx_block_q5_1 *x, float *y, int64_t n) {
    const __m256i b4 = _mm256_set1_epi8(0x10);
    for (int64_t i = 0; i < n / LX_QK; ++i, y += LX_QK) {
        const __m256i q = _mm256_or_si256(lx_nib32_avx2(x[i].qs), _mm256_and_si256(lx_bits32_avx2(x[i].qh), b4));
        store32_i8(q, f16_exact(x[i].d), f16_exact(x[i].m), 1, 0, y);
    }
}

static LX_AVX2 void dequantize_row_q8_0_avx2(const lx_block_q8_0 *x, float *y, int64_t n) {
    for (int64_t i = 0; i < n / LX_QK; ++i, y += LX_QK)
        store32_i8(_mm256_loadu_si256((const __m256i *) x[i].qs), f16_exact(x[i].d), 0, 0, 0, y);
}

/* 16 int8 lanes * (scale) -> y[0..16): float(q) * dl (a float computed by the caller) */
static LX_INLINE LX_AVX2 void store16_i8(__m128i q, float dl, float *y) {
    const __m256 vd = _mm256_set1_ps(dl);
    _mm256_storeu_ps(y, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), vd));
    _mm256_storeu_ps(y + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8))), vd));
}

static LX_AVX2 void dequantize_row_q4_K_avx2(const lx_block_q4_K *x, float *y, int64_t n) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int64_t i = 0; i < n / LX_QK_K; ++i) {
        const float d = f16_exact(x[i].d), dmin = f16_exact(x[i].dmin);
        const uint8_t *q = x[i].qs;
        for (int j = 0; j < 8; j += 2, q += 32, y += 64) {
            uint8_t sc, mn;
            lx_k_scale_min(j, x[i].scales, &sc, &mn);
            const float d1 = d * sc, m1 = dmin * mn;
            lx_k_scale_min(j + 1, x[i].scales, &sc, &mn);
            const float d2 = d * sc, m2 = dmin * mn;
            const __m256i b = _mm256_loadu_si256((const __m256i *) q);
            store32_i8(_mm256_and_si256(b, m4), d1, m1, 0, 1, y);
            store32_i8(_mm256_and_si256(_mm256_srli_epi16(b, 4), m4), d2, m2, 0, 1, y + 32);
        }
    }
}

static LX_AVX2 void dequantize_row_q5_K_avx2(const lx_block_q5_K *x, float *y, int64_t n) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    for (int64_t i = 0; i < n / LX_QK_K; ++i) {
        const float d = f16_exact(x[i].d), dmin = f16_exact(x[i].dmin);
        const uint8_t *ql = x[i].qs;
        const __m256i hb = _mm256_loadu_si256((const __m256i *) x[i].qh);
        for (int j = 0; j < 8; j += 2, ql += 32, y += 64) {
            uint8_t sc, mn;
            lx_k_scale_min(j, x[i].scales, &sc, &mn);
            const float d1 = d * sc, m1 = dmin * mn;
            lx_k_scale_min(j + 1, x[i].scales, &sc, &mn);
            const float d2 = d * sc, m2 = dmin * mn;
            const __m256i b = _mm256_loadu_si256((const __m256i *) ql);
            /* bit j of qh[l] -> 16 for value l of the first 32, bit j+1 for the second 32 */
            const __m256i h1 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, j), one), 4);
            const __m256i h2 = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, j + 1), one), 4);
            store32_i8(_mm256_or_si256(_mm256_and_si256(b, m4), h1), d1, m1, 0, 1, y);
            store32_i8(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b, 4), m4), h2), d2, m2, 0, 1, y + 32);
        }
    }
}

static LX_AVX2 void dequantize_row_q6_K_avx2(const lx_block_q6_K *x, float *y, int64_t n) {
    const __m256i off = _mm256_set1_epi8(32);
    for (int64_t i = 0; i < n / LX_QK_K; ++i) {
        const float d = f16_exact(x[i].d);
        const uint8_t *ql = x[i].ql, *qh = x[i].qh;
        const int8_t *sc = x[i].scales;
        for (int half = 0; half < 2; ++half, y += 128, ql += 64, qh += 32, sc += 8) {
            __m256i q[4];
            lx_q6_K_half_avx2(ql, qh, q);
            for (int k = 0; k < 4; ++k) {
                const __m256i v = _mm256_sub_epi8(q[k], off);
                store16_i8(_mm256_castsi256_si128(v), d * sc[2 * k], y + 32 * k);
                store16_i8(_mm256_extracti128_si256(v, 1), d * sc[2 * k + 1], y + 32 * k + 16);
            }
        }
    }
}

static LX_AVX2 void bf16_to_fp32_row_avx2(const uint16_t *x, float *y, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *) (x + i)));
        _mm256_storeu_ps(y + i, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
    }
    for (; i < n; ++i) y[i] = lx_bits_f32_((uint32_t) x[i] << 16);
}

/* ---- AVX2 quantize ---- */

/* the largest |x[j]| of 32 floats */
static LX_INLINE LX_AVX2 float amax32(const float *x) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 m = _mm256_andnot_ps(sign, _mm256_loadu_ps(x));
    for (int k = 8; k < 32; k += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + k)));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

/* int8 roundf(x[j] * id) for 32 floats; the 32 int32 sums' total in *sum.
 * roundf (ties away from zero) as trunc(v + copysign(0.5 - 2^-25, v)): for
 * |v| < 2^22 the sum rounds (to nearest even) to v + 1/2 exactly when
 * v + 1/2 is an integer or lies above one, so truncation gives roundf(v);
 * tested exhaustively on |v| <= 128 (the range here is |v| <= 127). */
static LX_INLINE LX_AVX2 __m256i round32_i8(const float *x, float id, int *sum) {
    const __m256 vid = _mm256_set1_ps(id), sign = _mm256_set1_ps(-0.0f);
    const __m256 half = _mm256_set1_ps(0.49999997f);
    const __m256 lim = _mm256_set1_ps(127.0f), nlim = _mm256_set1_ps(-127.0f);
    __m256i q[4];
    for (int k = 0; k < 4; ++k) {
        __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + 8 * k), vid);
        v = _mm256_and_ps(v, _mm256_cmp_ps(v, v, _CMP_ORD_Q));        /* clamp_q: NaN -> 0 */
        v = _mm256_max_ps(_mm256_min_ps(v, lim), nlim);
        const __m256 h = _mm256_or_ps(half, _mm256_and_ps(v, sign));
        q[k] = _mm256_cvttps_epi32(_mm256_add_ps(v, h));
    }
    if (sum) {
        __m256i s = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
        *sum = _mm_cvtsi128_si32(s4);
    }
    /* int32 -> int16 -> int8 (saturating; values are in [-127, 127]); packs work
     * within 128-bit lanes, the permute restores the order */
    const __m256i p01 = _mm256_packs_epi32(q[0], q[1]);
    const __m256i p23 = _mm256_packs_epi32(q[2], q[3]);
    const __m256i p = _mm256_packs_epi16(p01, p23);
    return _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

static LX_AVX2 void quantize_row_q8_0_avx2(const float *x, lx_block_q8_0 *y, int64_t n) {
    for (int64_t i = 0; i < n / LX_QK; ++i, x += LX_QK) {
        const float d = amax32(x) / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        y[i].d = lx_fp32_to_fp16(d);
        _mm256_storeu_si256((__m256i *) y[i].qs, round32_i8(x, id, NULL));
    }
}

/* lx_quantize_row_q8_split: the scalar steps of 8 blocks at a time in lanes (their d, 1/d and f16
 * roundings; IEEE division and F16C's nearest-even conversion, as the scalar steps) */
static LX_AVX2 void quantize_row_q8_split_avx2(int with_s, const float *x, int8_t *qs, float *d, float *s,
                                               int32_t *sum, int64_t n) {
    const int64_t nb = n / LX_QK;
    const __m256 zero = _mm256_setzero_ps();
    for (int64_t b0 = 0; b0 < nb; b0 += 8) {
        const int m = nb - b0 < 8 ? (int) (nb - b0) : 8;
        float am[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f}, id[8], dd[8], ss[8];
        int32_t sm[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int k = 0; k < m; ++k) am[k] = amax32(x + (b0 + k) * LX_QK);
        const __m256 dv = _mm256_div_ps(_mm256_loadu_ps(am), _mm256_set1_ps(127.0f));
        _mm256_storeu_ps(id, _mm256_and_ps(_mm256_div_ps(_mm256_set1_ps(1.0f), dv), _mm256_cmp_ps(dv, zero, _CMP_NEQ_UQ)));
        for (int k = 0; k < m; ++k)
            _mm256_storeu_si256((__m256i *) (qs + (b0 + k) * LX_QK), round32_i8(x + (b0 + k) * LX_QK, id[k], sm + k));
        const __m256 sv = with_s ? _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *) sm)), dv) : zero;
        _mm256_storeu_ps(dd, _mm256_cvtph_ps(_mm256_cvtps_ph(dv, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
        _mm256_storeu_ps(ss, _mm256_cvtph_ps(_mm256_cvtps_ph(sv, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
        memcpy(d + b0, dd, (size_t) m * sizeof(float));
        memcpy(s + b0, ss, (size_t) m * sizeof(float));
        memcpy(sum + b0, sm, (size_t) m * sizeof(int32_t));
    }
}

#define LX_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))

/* lane k = the max (op 0) or int32 sum (op 1) of the 16 lanes of v[k], k < 16: a transposing tree
 * (lanes paired within 128-bit quarters, then quarters), each step order-free (max, integer add) */
static LX_INLINE LX_AVX512 __m512i reduce16x16(__m512i *v, int op) {
#define LX_R16(a, b) (op ? _mm512_add_epi32((a), (b)) : _mm512_castps_si512(_mm512_max_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(b))))
    __m512i a[8], b[4], c[2];
    for (int i = 0; i < 8; ++i)   /* per quarter: [v2i, v2i+1, v2i, v2i+1] partials */
        a[i] = LX_R16(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
    for (int j = 0; j < 4; ++j) {   /* per quarter: [v4j .. v4j+3] partials */
        const __m512 p = _mm512_castsi512_ps(a[2 * j]), q = _mm512_castsi512_ps(a[2 * j + 1]);
        b[j] = LX_R16(_mm512_castps_si512(_mm512_shuffle_ps(p, q, 0x44)), _mm512_castps_si512(_mm512_shuffle_ps(p, q, 0xEE)));
    }
    for (int k = 0; k < 2; ++k)   /* quarters: [b2k's two halves | b2k+1's] */
        c[k] = LX_R16(_mm512_shuffle_i32x4(b[2 * k], b[2 * k + 1], 0x44), _mm512_shuffle_i32x4(b[2 * k], b[2 * k + 1], 0xEE));
    return LX_R16(_mm512_shuffle_i32x4(c[0], c[1], 0x88), _mm512_shuffle_i32x4(c[0], c[1], 0xDD));
#undef LX_R16
}

/* quantize_row_q8_split_avx2 on 16 blocks at a time (the same IEEE steps lane for lane: amax, d =
 * amax / 127, 1 / d, the rounding of round32_i8, F16C's nearest-even d and s) */
static LX_AVX512 void quantize_row_q8_split_avx512(int with_s, const float *x, int8_t *qs, float *d, float *s,
                                                   int32_t *sum, int64_t n) {
    const int64_t nb = n / LX_QK;
    const __m512 sign = _mm512_set1_ps(-0.0f), half = _mm512_set1_ps(0.49999997f);
    const __m512 lim = _mm512_set1_ps(127.0f), nlim = _mm512_set1_ps(-127.0f);
    for (int64_t b0 = 0; b0 < nb; b0 += 16) {
        const int m = nb - b0 < 16 ? (int) (nb - b0) : 16;
        const __mmask16 lanes = (__mmask16) ((1u << m) - 1);
        const float *xb = x + b0 * LX_QK;
        __m512i v[16];
        for (int k = 0; k < 16; ++k)
            v[k] = k < m ? _mm512_castps_si512(_mm512_max_ps(_mm512_andnot_ps(sign, _mm512_loadu_ps(xb + 32 * k)),
                                                             _mm512_andnot_ps(sign, _mm512_loadu_ps(xb + 32 * k + 16))))
                         : _mm512_setzero_si512();
        const __m512 dv = _mm512_div_ps(_mm512_castsi512_ps(reduce16x16(v, 0)), lim);
        const __m512 idv = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(dv, _mm512_setzero_ps(), _CMP_NEQ_UQ),
                                               _mm512_set1_ps(1.0f), dv);
        float id[16];
        _mm512_storeu_ps(id, idv);
        for (int k = 0; k < m; ++k) {   /* v[k] past m stay 0 */
            const __m512 vid = _mm512_set1_ps(id[k]);
            __m512i q[2];
            for (int h = 0; h < 2; ++h) {
                __m512 u = _mm512_mul_ps(_mm512_loadu_ps(xb + 32 * k + 16 * h), vid);
                u = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(u, u, _CMP_ORD_Q), u);   /* clamp_q: NaN -> 0 */
                u = _mm512_max_ps(_mm512_min_ps(u, lim), nlim);
                q[h] = _mm512_cvttps_epi32(_mm512_add_ps(u, _mm512_or_ps(half, _mm512_and_ps(u, sign))));
                _mm_storeu_si128((__m128i *) (qs + (b0 + k) * LX_QK + 16 * h), _mm512_cvtsepi32_epi8(q[h]));
            }
            v[k] = _mm512_add_epi32(q[0], q[1]);
        }
        const __m512i sm = reduce16x16(v, 1);
        const __m512 sv = with_s ? _mm512_mul_ps(_mm512_cvtepi32_ps(sm), dv) : _mm512_setzero_ps();
        _mm512_mask_storeu_ps(d + b0, lanes, _mm512_cvtph_ps(_mm512_cvtps_ph(dv, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
        _mm512_mask_storeu_ps(s + b0, lanes, _mm512_cvtph_ps(_mm512_cvtps_ph(sv, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
        _mm512_mask_storeu_epi32(sum + b0, lanes, sm);
    }
}

static LX_AVX2 void quantize_row_q8_1_avx2(const float *x, lx_block_q8_1 *y, int64_t n) {
    for (int64_t i = 0; i < n / LX_QK; ++i, x += LX_QK) {
        const float d = amax32(x) / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        int sum;
        y[i].d = lx_fp32_to_fp16(d);
        _mm256_storeu_si256((__m256i *) y[i].qs, round32_i8(x, id, &sum));
        y[i].s = lx_fp32_to_fp16((float) sum * d);
    }
}

/* q4_0 with the reference's rounding: the same IEEE mul, clamp and add, then truncation
 * (cvttps, as the C cast) and min(15); the block's max is the first value of largest magnitude. */
static LX_AVX2 void quantize_row_q4_0_avx2(const float *x, lx_block_q4_0 *y, int64_t n) {
    const __m256 lim = _mm256_set1_ps(8.0f), nlim = _mm256_set1_ps(-8.0f), off = _mm256_set1_ps(8.5f);
    const __m256i top = _mm256_set1_epi32(15);
    for (int64_t i = 0; i < n / LX_QK; ++i, x += LX_QK) {
        const float amax = amax32(x);
        float max = 0.0f;
        if (amax != 0.0f) {
            for (int j = 0; j < LX_QK; ++j) {
                if (fabsf(x[j]) == amax) { max = x[j]; break; }
            }
        }
        const float d = max / -8;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        y[i].d = lx_fp32_to_fp16(d);
        const __m256 vid = _mm256_set1_ps(id);
        __m256i q[4];
        for (int k = 0; k < 4; ++k) {
            __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + 8 * k), vid);
            v = _mm256_and_ps(v, _mm256_cmp_ps(v, v, _CMP_ORD_Q));        /* clamp_q: NaN -> 0 */
            v = _mm256_max_ps(_mm256_min_ps(v, lim), nlim);
            q[k] = _mm256_min_epi32(_mm256_cvttps_epi32(_mm256_add_ps(v, off)), top);
        }
        /* values 0..15 and 16..31 as int16 in order (packs works within 128-bit lanes) */
        const __m256i lo = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xD8);
        const __m256i hi = _mm256_permute4x64_epi64(_mm256_packs_epi32(q[2], q[3]), 0xD8);
        const __m256i b = _mm256_or_si256(lo, _mm256_slli_epi16(hi, 4));   /* 16 bytes in int16 lanes */
        const __m128i packed = _mm_packus_epi16(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
        _mm_storeu_si128((__m128i *) y[i].qs, packed);
    }
}

static LX_AVX2 void quantize_row_q8_K_avx2(const float *x, lx_block_q8_K *y, int64_t n) {
    for (int64_t i = 0; i < n / LX_QK_K; ++i, x += LX_QK_K) {
        float amax = 0.0f;
        for (int k = 0; k < LX_QK_K; k += 32) amax = fmaxf(amax, amax32(x + k));
        if (amax == 0.0f) {
            y[i].d = 0.0f;
            memset(y[i].qs, 0, sizeof y[i].qs);
            memset(y[i].bsums, 0, sizeof y[i].bsums);
            continue;
        }
        float max = 0.0f;           /* the first value of largest magnitude, as the ref's scan */
        const __m256 va = _mm256_set1_ps(amax), sign = _mm256_set1_ps(-0.0f);
        for (int j = 0; j < LX_QK_K; j += 8) {
            const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + j)), va, _CMP_EQ_OQ));
            if (hit) { max = x[j + __builtin_ctz((unsigned) hit)]; break; }
        }
        const float iscale = -127.0f / max;
        const __m256 vis = _mm256_set1_ps(iscale);
        const __m256 lim = _mm256_set1_ps(127.0f), nlim = _mm256_set1_ps(-127.0f);
        for (int k = 0; k < LX_QK_K; k += 32) {
            __m256i q[4];
            for (int u = 0; u < 4; ++u) {
                __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + k + 8 * u), vis);
                v = _mm256_and_ps(v, _mm256_cmp_ps(v, v, _CMP_ORD_Q));    /* clamp_q */
                v = _mm256_max_ps(_mm256_min_ps(v, lim), nlim);
                /* cvtps rounds to nearest even (MXCSR default), as nearest_int */
                q[u] = _mm256_cvtps_epi32(v);
            }
            const __m256i s01 = _mm256_add_epi32(q[0], q[1]), s23 = _mm256_add_epi32(q[2], q[3]);
            /* bsums of the two groups of 16: lanes of s01 and of s23 */
            __m256i hs = _mm256_hadd_epi32(s01, s23);       /* [a01 a23 b01 b23 | a45 a67 b45 b67] */
            hs = _mm256_hadd_epi32(hs, hs);                  /* [a0-3 b0-3 .. | a4-7 b4-7 ..] */
            const __m128i t = _mm_add_epi32(_mm256_castsi256_si128(hs), _mm256_extracti128_si256(hs, 1));
            y[i].bsums[k / 16]     = (int16_t) _mm_cvtsi128_si32(t);
            y[i].bsums[k / 16 + 1] = (int16_t) _mm_extract_epi32(t, 1);
            const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
            _mm256_storeu_si256((__m256i *) (y[i].qs + k),
                                _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        }
        y[i].d = 1.0f / iscale;
    }
}
#endif /* LX_X86_DISPATCH */

/* ---- dispatch ------------------------------------------------------------------ */

void lx_dequantize_row(lx_type t, const void *x, float *y, int64_t n) {
#ifdef LX_X86_DISPATCH
    if (lx_simd_level() >= LX_SIMD_AVX2) {
        switch (t) {
        case LX_TYPE_Q4_0: dequantize_row_q4_0_avx2(x, y, n); return;
        case LX_TYPE_Q4_1: dequantize_row_q4_1_avx2(x, y, n); return;
        case LX_TYPE_Q5_0: dequantize_row_q5_0_avx2(x, y, n); return;
        case LX_TYPE_Q5_1: dequantize_row_q5_1_avx2(x, y, n); return;
        case LX_TYPE_Q8_0: dequantize_row_q8_0_avx2(x, y, n); return;
        case LX_TYPE_Q4_K: dequantize_row_q4_K_avx2(x, y, n); return;
        case LX_TYPE_Q5_K: dequantize_row_q5_K_avx2(x, y, n); return;
        case LX_TYPE_Q6_K: dequantize_row_q6_K_avx2(x, y, n); return;
        case LX_TYPE_BF16: bf16_to_fp32_row_avx2(x, y, n); return;
        default: break;
        }
    }
#endif
    if (t == LX_TYPE_F16) { lx_fp16_to_fp32_row(x, y, n); return; }
    lx_dequantize_row_ref(t, x, y, n);
}

void lx_dequantize_rows(lx_type t, const void *x, float *y, int64_t n_rows, int64_t n_cols,
                        int n_threads) {
    const size_t rb = lx_row_bytes(t, n_cols);
    (void) n_threads;
#ifdef _OPENMP
#pragma omp parallel for schedule(static) num_threads(n_threads) if (n_threads > 1 && n_rows > 1)
#endif
    for (int64_t r = 0; r < n_rows; ++r)
        lx_dequantize_row(t, (const uint8_t *) x + (size_t) r * rb, y + r * n_cols, n_cols);
}

void lx_quantize_row_q8_0(const float *x, lx_block_q8_0 *y, int64_t n) {
#ifdef LX_X86_DISPATCH
    if (lx_simd_level() >= LX_SIMD_AVX2) { quantize_row_q8_0_avx2(x, y, n); return; }
#endif
    lx_quantize_row_q8_0_ref(x, y, n);
}

void lx_quantize_row_q8_1(const float *x, lx_block_q8_1 *y, int64_t n) {
#ifdef LX_X86_DISPATCH
    if (lx_simd_level() >= LX_SIMD_AVX2) { quantize_row_q8_1_avx2(x, y, n); return; }
#endif
    lx_quantize_row_q8_1_ref(x, y, n);
}

void lx_quantize_row_q8_split_ref(lx_type dt, const float *x, int8_t *qs, float *d, float *s, int32_t *sum,
                                  int64_t n) {
    assert(n % LX_QK == 0 && (dt == LX_TYPE_Q8_0 || dt == LX_TYPE_Q8_1));
    for (int64_t b = 0; b < n / LX_QK; ++b) {
        if (dt == LX_TYPE_Q8_1) {
            lx_block_q8_1 blk;
            lx_quantize_row_q8_1_ref(x + b * LX_QK, &blk, LX_QK);
            memcpy(qs + b * LX_QK, blk.qs, LX_QK);
            d[b] = lx_fp16_to_fp32(blk.d), s[b] = lx_fp16_to_fp32(blk.s);
        } else {
            lx_block_q8_0 blk;
            lx_quantize_row_q8_0_ref(x + b * LX_QK, &blk, LX_QK);
            memcpy(qs + b * LX_QK, blk.qs, LX_QK);
            d[b] = lx_fp16_to_fp32(blk.d), s[b] = 0.0f;
        }
        int32_t t = 0;
        for (int j = 0; j < LX_QK; ++j) t += qs[b * LX_QK + j];
        sum[b] = t;
    }
}

void lx_quantize_row_q8_split(lx_type dt, const float *x, int8_t *qs, float *d, float *s, int32_t *sum, int64_t n) {
#ifdef LX_X86_DISPATCH
    if (lx_simd_level() >= LX_SIMD_AVX512) {
        quantize_row_q8_split_avx512(dt == LX_TYPE_Q8_1, x, qs, d, s, sum, n);
        return;
    }
    if (lx_simd_level() >= LX_SIMD_AVX2) {
        quantize_row_q8_split_avx2(dt == LX_TYPE_Q8_1, x, qs, d, s, sum, n);
        return;
    }
#endif
    lx_quantize_row_q8_split_ref(dt, x, qs, d, s, sum, n);
}

void lx_quantize_row_q8_K(const float *x, lx_block_q8_K *y, int64_t n) {
#ifdef LX_X86_DISPATCH
    if (lx_simd_level() >= LX_SIMD_AVX2) { quantize_row_q8_K_avx2(x, y, n); return; }
#endif
    lx_quantize_row_q8_K_ref(x, y, n);
}

void lx_quantize_row_q4_0(const float *x, lx_block_q4_0 *y, int64_t n) {
#ifdef LX_X86_DISPATCH
    if (lx_simd_level() >= LX_SIMD_AVX2) { quantize_row_q4_0_avx2(x, y, n); return; }
#endif
    lx_quantize_row_q4_0_ref(x, y, n);
}

/* n fits type t's blocks, and t is one lx_quantize_row writes */
static int quantize_ok(lx_type t, int64_t n) {
    switch (t) {
    case LX_TYPE_F32: case LX_TYPE_F16: case LX_TYPE_Q4_0: case LX_TYPE_Q8_0:
    case LX_TYPE_Q8_1: case LX_TYPE_Q8_K:
        return n >= 0 && n % lx_type_block_size(t) == 0;
    default:
        return 0;
    }
}

lx_status lx_quantize_row(lx_type t, const float *x, void *y, int64_t n) {
    if (!quantize_ok(t, n)) return LX_ERR_INVALID;
    switch (t) {
    case LX_TYPE_F32:  memcpy(y, x, (size_t) n * sizeof(float)); break;
    case LX_TYPE_F16:  lx_fp32_to_fp16_row(x, y, n); break;
    case LX_TYPE_Q4_0: lx_quantize_row_q4_0(x, y, n); break;
    case LX_TYPE_Q8_0: lx_quantize_row_q8_0(x, y, n); break;
    case LX_TYPE_Q8_1: lx_quantize_row_q8_1(x, y, n); break;
    case LX_TYPE_Q8_K: lx_quantize_row_q8_K(x, y, n); break;
    default: return LX_ERR_INVALID;
    }
    return LX_OK;
}

lx_status lx_quantize_row_ref(lx_type t, const float *x, void *y, int64_t n) {
    if (!quantize_ok(t, n)) return LX_ERR_INVALID;
    switch (t) {
    case LX_TYPE_F32:  memcpy(y, x, (size_t) n * sizeof(float)); break;
    case LX_TYPE_F16:  lx_fp32_to_fp16_row_ref(x, y, n); break;
    case LX_TYPE_Q4_0: lx_quantize_row_q4_0_ref(x, y, n); break;
    case LX_TYPE_Q8_0: lx_quantize_row_q8_0_ref(x, y, n); break;
    case LX_TYPE_Q8_1: lx_quantize_row_q8_1_ref(x, y, n); break;
    case LX_TYPE_Q8_K: lx_quantize_row_q8_K_ref(x, y, n); break;
    default: return LX_ERR_INVALID;
    }
    return LX_OK;
}

/* ---- set_rows ------------------------------------------------------------------------------ */

int lx_type_is_cache(lx_type t) {
    return t == LX_TYPE_F32 || t == LX_TYPE_F16 || t == LX_TYPE_Q8_0 || t == LX_TYPE_Q4_0;
}

/* values below which set_rows stays on the caller's thread (waking threads costs microseconds) */
#define SET_ROWS_PAR_MIN_VALUES (1 << 14)

lx_status lx_set_rows(lx_type t, const float *src, void *dst, const uint32_t *idxs, int64_t n,
                      int64_t n_per_row, int n_threads) {
    if (!lx_type_is_cache(t) || !quantize_ok(t, n_per_row) || n < 0) return LX_ERR_INVALID;
    const size_t rb = lx_row_bytes(t, n_per_row);
    (void) n_threads;
#ifdef _OPENMP
    if (n_threads > 1 && n > 1 && n * n_per_row >= SET_ROWS_PAR_MIN_VALUES) {   /* (not an if clause: it opens a team) */
#pragma omp parallel for schedule(static) num_threads(n_threads)
        for (int64_t i = 0; i < n; ++i)
            lx_quantize_row(t, src + i * n_per_row, (uint8_t *) dst + (size_t) idxs[i] * rb, n_per_row);
        return LX_OK;
    }
#endif
    for (int64_t i = 0; i < n; ++i)
        lx_quantize_row(t, src + i * n_per_row, (uint8_t *) dst + (size_t) idxs[i] * rb, n_per_row);
    return LX_OK;
}

lx_status lx_set_rows_ref(lx_type t, const float *src, void *dst, const uint32_t *idxs, int64_t n,
                          int64_t n_per_row) {
    if (!lx_type_is_cache(t) || !quantize_ok(t, n_per_row) || n < 0) return LX_ERR_INVALID;
    const size_t rb = lx_row_bytes(t, n_per_row);
    for (int64_t i = 0; i < n; ++i)
        lx_quantize_row_ref(t, src + i * n_per_row, (uint8_t *) dst + (size_t) idxs[i] * rb, n_per_row);
    return LX_OK;
}
