/* hadamard.c: see hadamard.h.
 *
 * Fast path: the in-place fast Walsh-Hadamard transform of each block,
 *
 *   for h = 1, 2, 4, ..., n/2:  for each pair (i, i + h) with i & h == 0:
 *       (x_i, x_{i+h}) <- (x_i + x_{i+h}, x_i - x_{i+h})
 *
 * then every value times s. In natural order this is H x (H[i][j] = s (-1)^popcount(i & j)).
 * The AVX2 version does stages h = 1, 2, 4 inside 8-float registers (a permute and a blend per
 * stage) and h >= 8 between registers; each output is the same single add or subtract of the
 * same two operands as in the portable loops, so both give the same bits.
 */
#include "hadamard.h"

#include <assert.h>
#include <math.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "cpu.h"

#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif

#define HADAMARD_PAR_MIN_VALUES (1 << 15)   /* fewer values than this: the caller's thread only */

int lx_hadamard_block_ok(int64_t n) {
    return n >= 1 && n <= LX_HADAMARD_MAX_BLOCK && (n & (n - 1)) == 0;
}

int lx_hadamard_block_k(int64_t head_dim) {
    if (head_dim <= 0 || head_dim % LX_HADAMARD_MIN_ROT != 0) return 0;
    int64_t n = LX_HADAMARD_MIN_ROT;
    while (n * 2 <= LX_HADAMARD_MAX_BLOCK && head_dim % (n * 2) == 0) n *= 2;
    return (int) n;
}

int lx_hadamard_block_v(int64_t head_dim) {
    return head_dim > 0 && head_dim % LX_HADAMARD_MIN_ROT == 0 ? LX_HADAMARD_MIN_ROT : 0;
}

float lx_hadamard_scale(int n) {
    assert(lx_hadamard_block_ok(n));
    return (float) (1.0 / sqrtf((float) n));     /* ggml_gen_hadamard: data[0] = 1.0 / sqrtf(n) */
}

void lx_hadamard_matrix(int n, float *h) {
    assert(lx_hadamard_block_ok(n));
    h[0] = lx_hadamard_scale(n);
    for (int s = 1; s < n; s *= 2) {
        for (int i = 0; i < s; ++i) {
            for (int j = 0; j < s; ++j) {
                const float val = h[i * n + j];
                h[(i + s) * n + j]       = val;
                h[i * n + (j + s)]       = val;
                h[(i + s) * n + (j + s)] = -val;
            }
        }
    }
}

/* ---- reference ---------------------------------------------------------------------------- */

void lx_hadamard_rows_ref(float *x, int64_t n_rows, int64_t n_per_row, int block) {
    assert(lx_hadamard_block_ok(block) && n_per_row % block == 0);
    const double s = (double) lx_hadamard_scale(block);
    float y[LX_HADAMARD_MAX_BLOCK];
    for (int64_t r = 0; r < n_rows; ++r) {
        for (int64_t b0 = 0; b0 < n_per_row; b0 += block) {
            float *xb = x + r * n_per_row + b0;
            for (int i = 0; i < block; ++i) {
                double acc = 0.0;
                for (int j = 0; j < block; ++j) {
                    const double hij = (__builtin_popcount((unsigned) (i & j)) & 1) ? -s : s;
                    acc += hij * (double) xb[j];
                }
                y[i] = (float) acc;
            }
            memcpy(xb, y, (size_t) block * sizeof(float));
        }
    }
}

/* ---- fast ---------------------------------------------------------------------------------- */

/* one block of n values, portable */
static void fwht_block_c(float *x, int n, float s) {
    for (int h = 1; h < n; h *= 2) {
        for (int i = 0; i < n; i += 2 * h) {
            for (int j = i; j < i + h; ++j) {
                const float a = x[j], b = x[j + h];
                x[j]     = a + b;
                x[j + h] = a - b;
            }
        }
    }
    for (int i = 0; i < n; ++i) x[i] *= s;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define LX_AVX2 __attribute__((target("avx2,fma,f16c")))

/* stages h = 1, 2, 4 of 8 consecutive values: lanes i with i & h == 0 get v_i + v_{i+h},
 * the others v_{i-h} - v_i (the partner's value first, as the scalar a - b) */
static inline __attribute__((always_inline)) LX_AVX2 __m256 fwht8(__m256 v) {
    __m256 sw = _mm256_permute_ps(v, 0xB1);                         /* 1 0 3 2 5 4 7 6 */
    v = _mm256_blend_ps(_mm256_add_ps(v, sw), _mm256_sub_ps(sw, v), 0xAA);
    sw = _mm256_permute_ps(v, 0x4E);                                /* 2 3 0 1 6 7 4 5 */
    v = _mm256_blend_ps(_mm256_add_ps(v, sw), _mm256_sub_ps(sw, v), 0xCC);
    sw = _mm256_permute2f128_ps(v, v, 0x01);                        /* 4..7 0..3       */
    return _mm256_blend_ps(_mm256_add_ps(v, sw), _mm256_sub_ps(sw, v), 0xF0);
}

/* one block of n >= 8 values */
static LX_AVX2 void fwht_block_avx2(float *x, int n, float s) {
    const __m256 vs = _mm256_set1_ps(s);
    if (n == 8) {
        _mm256_storeu_ps(x, _mm256_mul_ps(fwht8(_mm256_loadu_ps(x)), vs));
        return;
    }
    for (int j = 0; j < n; j += 8) _mm256_storeu_ps(x + j, fwht8(_mm256_loadu_ps(x + j)));
    for (int h = 8; h < n; h *= 2) {
        const bool last = 2 * h == n;
        for (int i = 0; i < n; i += 2 * h) {
            for (int j = i; j < i + h; j += 8) {
                const __m256 a = _mm256_loadu_ps(x + j), b = _mm256_loadu_ps(x + j + h);
                __m256 u = _mm256_add_ps(a, b), w = _mm256_sub_ps(a, b);
                if (last) { u = _mm256_mul_ps(u, vs); w = _mm256_mul_ps(w, vs); }
                _mm256_storeu_ps(x + j, u);
                _mm256_storeu_ps(x + j + h, w);
            }
        }
    }
}
#endif

typedef void (*fwht_fn)(float *, int, float);

static fwht_fn pick_fwht(int block) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    if (block >= 8 && lx_simd_level() >= LX_SIMD_AVX2) return fwht_block_avx2;
#endif
    (void) block;
    return fwht_block_c;
}

void lx_hadamard_row(float *x, int64_t n, int block) {
    assert(lx_hadamard_block_ok(block) && n % block == 0);
    const float s = lx_hadamard_scale(block);
    const fwht_fn fn = pick_fwht(block);
    for (int64_t b0 = 0; b0 < n; b0 += block) fn(x + b0, block, s);
}

void lx_hadamard_rows(float *x, int64_t n_rows, int64_t n_per_row, int block, int n_threads) {
    assert(lx_hadamard_block_ok(block) && n_per_row % block == 0);
    assert(n_threads >= 1);
    (void) n_threads;
    const float s = lx_hadamard_scale(block);
    const fwht_fn fn = pick_fwht(block);
#ifdef _OPENMP
    if (n_threads > 1 && n_rows > 1 && n_rows * n_per_row >= HADAMARD_PAR_MIN_VALUES) {   /* (not an if clause: it opens a team) */
        #pragma omp parallel for schedule(static) num_threads(n_threads)
        for (int64_t r = 0; r < n_rows; ++r)
            for (int64_t b0 = 0; b0 < n_per_row; b0 += block) fn(x + r * n_per_row + b0, block, s);
        return;
    }
#endif
    for (int64_t r = 0; r < n_rows; ++r)
        for (int64_t b0 = 0; b0 < n_per_row; b0 += block) fn(x + r * n_per_row + b0, block, s);
}
