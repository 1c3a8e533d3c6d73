/* simd.h: the SIMD helpers shared by the kernels of every unit (quants, matmul, gemm, attention):
 * ggml block unpacking and horizontal sums. x86-64 only; each helper carries its own target
 * attribute and is always inlined, so callers compiled for a wider target (the AVX-512 passes)
 * inline it too. Each is written once here; a unit keeps only the helpers no other unit needs.
 */
#ifndef LX_SIMD_H
#define LX_SIMD_H

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

#define LX_SIMD_AVX2_FN static inline __attribute__((always_inline, target("avx2,fma,f16c")))
#define LX_SIMD_AVX512_FN static inline __attribute__((always_inline, target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))

/* ---- block unpacking ---- */

/* 32 x 4-bit values of 16 bytes b (q4_0 / q4_1 / q5_* qs) as bytes: values 0..15 from the low
 * nibbles, 16..31 from the high */
LX_SIMD_AVX2_FN __m256i lx_nib32_reg_avx2(__m128i b) {
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), _mm256_set1_epi8(0x0F));
}

/* the same from the 16 bytes at qs */
LX_SIMD_AVX2_FN __m256i lx_nib32_avx2(const uint8_t *qs) {
    return lx_nib32_reg_avx2(_mm_loadu_si128((const __m128i *) qs));
}

/* byte j = 0xFF if bit j of the 32 bits at p (q5_0 / q5_1 qh) is set, else 0 */
LX_SIMD_AVX2_FN __m256i lx_bits32_avx2(const uint8_t *p) {
    uint32_t u;
    memcpy(&u, p, sizeof u);
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202,
                                           0x0101010101010101, 0x0000000000000000);
    __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32((int) u), shuf);
    b = _mm256_or_si256(b, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
    return _mm256_cmpeq_epi8(b, _mm256_set1_epi64x(-1));
}

/* the 6-bit quants of one 128-value half of a q6_K block, unsigned [0, 63] (ggml subtracts 32):
 * q[k] holds values 32k .. 32k+31 of the half. ql [64] low nibbles, qh [32] high bit pairs. */
LX_SIMD_AVX2_FN void lx_q6_K_half_avx2(const uint8_t *ql, const uint8_t *qh, __m256i q[4]) {
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

/* ---- horizontal sums (fixed orders: each is part of some kernel's bits) ---- */

/* the sum of the 8 lanes: (lo + hi) halves, then pairs */
LX_SIMD_AVX2_FN float lx_hsum8_avx2(__m256 a) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
}

/* [sum a, sum b, sum c, sum d] (hadd tree: adjacent pairs first) */
LX_SIMD_AVX2_FN __m128 lx_hsum8x4_avx2(__m256 a, __m256 b, __m256 c, __m256 d) {
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

/* [sum a, sum b, ., .] (the order of lx_hsum8x4_avx2) */
LX_SIMD_AVX2_FN __m128 lx_hsum8x2_avx2(__m256 a, __m256 b) {
    __m256 t = _mm256_hadd_ps(a, b);
    t = _mm256_hadd_ps(t, t);
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

/* the 16 lanes of a folded to 8: a_lo + a_hi */
LX_SIMD_AVX512_FN __m256 lx_fold16_avx512(__m512 a) {
    return _mm256_add_ps(_mm512_castps512_ps256(a), _mm512_extractf32x8_ps(a, 1));
}

/* the sum of the 16 lanes: folded, then lx_hsum8_avx2 */
LX_SIMD_AVX512_FN float lx_hsum16_avx512(__m512 a) { return lx_hsum8_avx2(lx_fold16_avx512(a)); }

#endif /* x86-64 */

#endif /* LX_SIMD_H */
