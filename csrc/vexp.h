/* vexp.h: the exp of the SIMD kernels (Cephes expf: Cody-Waite reduction, degree-5 polynomial),
 * within 2 ulp of expf for x in [-87.3, 88.3]; 0 below (and at -inf), x clamped to 88.376 above.
 * lx_exp8_avx2 takes 8 lanes (lx_exp16_avx512 16); lx_exp_ref is its scalar twin, the same float operations in the same
 * order (fmaf for each fused step), so the two give the same bits: a kernel may run its tail
 * elements through the twin. Used by attention's softmax and the layer's SiLU. */
#ifndef LX_VEXP_H
#define LX_VEXP_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#define LX_EXP_LO -87.33654f
#define LX_EXP_HI 88.3762626647949f
#define LX_EXP_LOG2E 1.44269504088896341f
#define LX_EXP_C1 0.693359375f       /* ln 2 = C1 + C2 (Cody-Waite) */
#define LX_EXP_C2 -2.12194440e-4f
#define LX_EXP_P0 1.9875691500e-4f
#define LX_EXP_P1 1.3981999507e-3f
#define LX_EXP_P2 8.3334519073e-3f
#define LX_EXP_P3 4.1665795894e-2f
#define LX_EXP_P4 1.6666665459e-1f
#define LX_EXP_P5 5.0000001201e-1f

static inline float lx_exp_ref(float x) {
    const int under = x < LX_EXP_LO;
    x = x < LX_EXP_LO ? LX_EXP_LO : x;
    x = x > LX_EXP_HI ? LX_EXP_HI : x;
    const float n = nearbyintf(x * LX_EXP_LOG2E);
    float r = fmaf(-n, LX_EXP_C1, x);
    r = fmaf(-n, LX_EXP_C2, r);
    float y = LX_EXP_P0;
    y = fmaf(y, r, LX_EXP_P1);
    y = fmaf(y, r, LX_EXP_P2);
    y = fmaf(y, r, LX_EXP_P3);
    y = fmaf(y, r, LX_EXP_P4);
    y = fmaf(y, r, LX_EXP_P5);
    y = fmaf(y, r * r, r + 1.0f);
    const uint32_t bits = (uint32_t) ((int32_t) n + 127) << 23;
    float p2;
    memcpy(&p2, &bits, sizeof p2);
    return under ? 0.0f : y * p2;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>

/* the lane steps after the clamp, on P = _mm256 or _mm512 vectors (the twin's operations in order):
 * n = round(x log2 e), r = x - n ln 2 (two fused steps), y = e^r by the polynomial, y 2^n */
#define LX_EXP_LANES(P, x, y)                                                                           \
    do {                                                                                                \
        const __typeof__(x) n_ = LX_EXP_ROUND(P##_mul_ps(x, P##_set1_ps(LX_EXP_LOG2E)));                \
        __typeof__(x) r_ = P##_fnmadd_ps(n_, P##_set1_ps(LX_EXP_C1), x);                                \
        r_ = P##_fnmadd_ps(n_, P##_set1_ps(LX_EXP_C2), r_);                                             \
        y = P##_set1_ps(LX_EXP_P0);                                                                     \
        y = P##_fmadd_ps(y, r_, P##_set1_ps(LX_EXP_P1));                                                \
        y = P##_fmadd_ps(y, r_, P##_set1_ps(LX_EXP_P2));                                                \
        y = P##_fmadd_ps(y, r_, P##_set1_ps(LX_EXP_P3));                                                \
        y = P##_fmadd_ps(y, r_, P##_set1_ps(LX_EXP_P4));                                                \
        y = P##_fmadd_ps(y, r_, P##_set1_ps(LX_EXP_P5));                                                \
        y = P##_fmadd_ps(y, P##_mul_ps(r_, r_), P##_add_ps(r_, P##_set1_ps(1.0f)));                     \
        y = P##_mul_ps(y, LX_EXP_CAST(P##_slli_epi32(P##_add_epi32(P##_cvtps_epi32(n_), P##_set1_epi32(127)), 23))); \
    } while (0)

static inline __attribute__((always_inline, target("avx2,fma"))) __m256 lx_exp8_avx2(__m256 x) {
    const __m256 lo = _mm256_set1_ps(LX_EXP_LO);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(LX_EXP_HI));
    __m256 y;
#define LX_EXP_ROUND(v) _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define LX_EXP_CAST(v) _mm256_castsi256_ps(v)
    LX_EXP_LANES(_mm256, x, y);
#undef LX_EXP_ROUND
#undef LX_EXP_CAST
    return _mm256_andnot_ps(under, y);
}

/* the same on 16 lanes */
static inline __attribute__((always_inline, target("avx512f,avx2,fma"))) __m512 lx_exp16_avx512(__m512 x) {
    const __m512 lo = _mm512_set1_ps(LX_EXP_LO);
    const __mmask16 ok = _mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ);
    x = _mm512_min_ps(_mm512_max_ps(x, lo), _mm512_set1_ps(LX_EXP_HI));
    __m512 y;
#define LX_EXP_ROUND(v) _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)
#define LX_EXP_CAST(v) _mm512_castsi512_ps(v)
    LX_EXP_LANES(_mm512, x, y);
#undef LX_EXP_ROUND
#undef LX_EXP_CAST
    return _mm512_maskz_mov_ps(ok, y);
}
#endif


/* ---- SiLU on this exp ---------------------------------------------------------------------------
 * silu(g) = g / (1 + e^-g), e^-g by lx_exp_ref / lx_exp8_avx2 (the same bits); where -g passes
 * LX_SILU_INF, e^-g is taken as +inf (the exp clamps there), so silu is -0 */
#define LX_SILU_INF 88.0f

static inline float lx_silu_ref(float g) {
    const float e = -g > LX_SILU_INF ? INFINITY : lx_exp_ref(-g);
    return g / (1.0f + e);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
static inline __attribute__((always_inline, target("avx2,fma"))) __m256 lx_silu8_avx2(__m256 g) {
    const __m256 t = _mm256_xor_ps(g, _mm256_set1_ps(-0.0f));   /* -g */
    const __m256 e = _mm256_blendv_ps(lx_exp8_avx2(t), _mm256_set1_ps(INFINITY),
                                      _mm256_cmp_ps(t, _mm256_set1_ps(LX_SILU_INF), _CMP_GT_OQ));
    return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
}

static __attribute__((target("avx2,fma"), unused)) void lx_silu_mul_avx2(const float *g, const float *u, float *y,
                                                                          int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 a = lx_silu8_avx2(_mm256_loadu_ps(g + i));
        _mm256_storeu_ps(y + i, u ? _mm256_mul_ps(a, _mm256_loadu_ps(u + i)) : a);
    }
    for (; i < n; ++i) y[i] = u ? lx_silu_ref(g[i]) * u[i] : lx_silu_ref(g[i]);
}
#endif

/* y[i] = silu(g[i]) * u[i] (u NULL: silu(g[i])), i < n, in 8 lanes when simd (lx_silu8_avx2) else by the
 * scalar twin: the same bits; y may be g or u */
static inline void lx_silu_mul(const float *g, const float *u, float *y, int64_t n, int simd) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    if (simd) {
        lx_silu_mul_avx2(g, u, y, n);
        return;
    }
#else
    (void) simd;
#endif
    for (int64_t i = 0; i < n; ++i) y[i] = u ? lx_silu_ref(g[i]) * u[i] : lx_silu_ref(g[i]);
}

#endif /* LX_VEXP_H */
