/* quants.c: f16 rows (scalar reference + F16C fast path chosen at run time).
 * See quants.h for the rounding contract. */
#include "quants.h"

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

int lx_quants_have_f16c(void) {
#ifdef LX_X86_DISPATCH
    static int cached = -1;     /* every thread computes the same value */
    int have = __atomic_load_n(&cached, __ATOMIC_RELAXED);
    if (have < 0) {
        __builtin_cpu_init();
        have = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
        __atomic_store_n(&cached, have, __ATOMIC_RELAXED);
    }
    return have;
#else
    return 0;
#endif
}

/* ---- dispatch -------------------------------------------------------------- */

void lx_fp32_to_fp16_row(const float *x, uint16_t *y, int64_t n) {
#ifdef LX_X86_DISPATCH
    if (lx_quants_have_f16c()) { fp32_to_fp16_row_f16c(x, y, n); return; }
#endif
    lx_fp32_to_fp16_row_ref(x, y, n);
}

void lx_fp16_to_fp32_row(const uint16_t *x, float *y, int64_t n) {
#ifdef LX_X86_DISPATCH
    if (lx_quants_have_f16c()) { fp16_to_fp32_row_f16c(x, y, n); return; }
#endif
    lx_fp16_to_fp32_row_ref(x, y, n);
}
