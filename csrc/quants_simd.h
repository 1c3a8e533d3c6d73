/* quants_simd.h: SIMD unpacking of ggml blocks shared by dequantization (quants.c) and the
 * quantized products (matmul.c). x86-64 only; each helper carries its own target attribute, so the
 * callers' wider targets (AVX2, AVX-512) may inline it.
 */
#ifndef LX_QUANTS_SIMD_H
#define LX_QUANTS_SIMD_H

#include "quants.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

/* the 6-bit quants of one 128-value half of a q6_K block, unsigned [0, 63] (ggml subtracts 32):
 * q[k] holds values 32k .. 32k+31 of the half. ql [64] low nibbles, qh [32] high bit pairs. */
static inline __attribute__((always_inline, target("avx2")))
void lx_q6_K_half_avx2(const uint8_t *ql, const uint8_t *qh, __m256i q[4]) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(3);
    const __m256i l0 = _mm256_loadu_si256((const __m256i *) ql);
    const __m256i l1 = _mm256_loadu_si256((const __m256i *) (ql + 32));
    const __m256i h = _mm256_loadu_si256((const __m256i *) qh);
    q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_slli_epi16(_mm256_and_si256(h, m3), 4));
    q[1] = _mm256_or_si256(_mm256_and_si256(l1, m4),
                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), m3), 4));
    q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), m3), 4));
    q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), m3), 4));
}
#endif

#endif /* LX_QUANTS_SIMD_H */
