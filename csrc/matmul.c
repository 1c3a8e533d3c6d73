/* matmul.c: y = x W^T in float32 over dequantized W, and the ordered float32 product (see matmul.h).
 *
 *   lx_mul_mat:  for each block of LX_MM_ROWS W rows              omp for, schedule(static)
 *                  for each tile of LX_MM_TILE values of a row: dequantized once (stack buffer),
 *                  dotted with every token's slice, LX_MM_NT tokens at a time
 */
#include "matmul.h"
#include "cpu.h"
#include "simd.h"

#include <assert.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define LX_MM_X86 1
#include <immintrin.h>
#endif

#define LX_INLINE inline __attribute__((always_inline))

int lx_mm_supported(lx_type w_type) { return lx_type_can_dequantize(w_type); }

/* ---- scalar reference -------------------------------------------------------------------- */

void lx_mul_mat_ref(const void *w, lx_type w_type, const float *x, float *y, int64_t n_tok,
                    int64_t n_in, int64_t n_out) {
    assert(lx_mm_supported(w_type));
    const size_t wrb = lx_row_bytes(w_type, n_in);
    float tile[LX_MM_TILE];
    for (int64_t o = 0; o < n_out; ++o) {
        const uint8_t *row = (const uint8_t *) w + (size_t) o * wrb;
        for (int64_t t = 0; t < n_tok; ++t) {
            const float *xt = x + t * n_in;
            float s = 0.0f;
            for (int64_t c0 = 0; c0 < n_in; c0 += LX_MM_TILE) {
                const int64_t len = n_in - c0 < LX_MM_TILE ? n_in - c0 : LX_MM_TILE;
                lx_dequantize_row_ref(w_type, row + lx_row_bytes(w_type, c0), tile, len);
                for (int64_t i = 0; i < len; ++i) s += tile[i] * xt[c0 + i];
            }
            y[t * n_out + o] = s;
        }
    }
}

/* ---- dots of a dequantized tile with nt <= LX_MM_NT x rows ------------------------------- */

/* out[k] = sum_i w[i] * x[k*xs + i] for i < len, k < nt */
typedef void (*f32_dots_fn)(const float *w, const float *x, int64_t xs, int64_t len, int nt, float *out);

static void f32_dots_portable(const float *w, const float *x, int64_t xs, int64_t len, int nt, float *out) {
    for (int k = 0; k < nt; ++k) {
        float s[8] = {0};
        int64_t i = 0;
        for (; i + 8 <= len; i += 8)
            for (int l = 0; l < 8; ++l) s[l] += w[i + l] * x[k * xs + i + l];
        for (; i < len; ++i) s[0] += w[i] * x[k * xs + i];
        out[k] = ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
    }
}

#ifdef LX_MM_X86
#define LX_TGT __attribute__((target("avx2,fma,f16c")))

/* AVX2+FMA (every level from LX_SIMD_AVX2): two 8-lane accumulators per token, then a horizontal sum */
static LX_INLINE LX_TGT void f32_dots_impl(const float *w, const float *x, int64_t xs, int64_t len, float *out,
                                           const int NT) {
    __m256 a0[LX_MM_NT], a1[LX_MM_NT];
    for (int k = 0; k < NT; ++k) a0[k] = _mm256_setzero_ps(), a1[k] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= len; i += 16) {
        const __m256 w0 = _mm256_loadu_ps(w + i), w1 = _mm256_loadu_ps(w + i + 8);
        for (int k = 0; k < NT; ++k) {
            a0[k] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + k * xs + i), a0[k]);
            a1[k] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + k * xs + i + 8), a1[k]);
        }
    }
    for (; i + 8 <= len; i += 8) {
        const __m256 w0 = _mm256_loadu_ps(w + i);
        for (int k = 0; k < NT; ++k) a0[k] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + k * xs + i), a0[k]);
    }
    for (int k = 0; k < NT; ++k) {
        float s = lx_hsum8_avx2(_mm256_add_ps(a0[k], a1[k]));
        for (int64_t j = i; j < len; ++j) s += w[j] * x[k * xs + j];
        out[k] = s;
    }
}

/* one instantiation per token count, so that NT is a constant */
static LX_TGT void f32_dots_avx2(const float *w, const float *x, int64_t xs, int64_t len, int nt, float *out) {
    switch (nt) {
    case 1: f32_dots_impl(w, x, xs, len, out, 1); break;
    case 2: f32_dots_impl(w, x, xs, len, out, 2); break;
    case 3: f32_dots_impl(w, x, xs, len, out, 3); break;
    default: f32_dots_impl(w, x, xs, len, out, 4); break;
    }
}
#undef LX_TGT
#endif /* LX_MM_X86 */

static f32_dots_fn pick_f32(int level) {
#ifdef LX_MM_X86
    if (level >= LX_SIMD_AVX2) return f32_dots_avx2;
#endif
    (void) level;
    return f32_dots_portable;
}

/* ---- driver ----------------------------------------------------------------------------- */

/* Software prefetch of W (LX_MM_PREFETCH bytes ahead): the hardware prefetchers
 * alone left a single thread at ~1/2 of the memory bandwidth here, the dot
 * kernels keeping too few loads in flight to cover the latency. */

/* prefetch [p, p + bytes) into L1 */
static LX_INLINE void prefetch_range(const uint8_t *p, size_t bytes) {
#if defined(__GNUC__) || defined(__clang__)
    for (size_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i, 0, 3);
#else
    (void) p, (void) bytes;
#endif
}

/* before reading W row o: its bytes LX_MM_PREFETCH ahead, and at the start of a
 * slice of rows the first LX_MM_PREFETCH bytes as well */
static LX_INLINE void prefetch_ahead(const uint8_t *row, size_t bytes, int first) {
    if (first) prefetch_range(row, LX_MM_PREFETCH);
    prefetch_range(row + LX_MM_PREFETCH, bytes);
}

/* rows [o0, o1): each tile of a W row dequantized once for all tokens */
static void rows_f32(const uint8_t *w, lx_type wt, size_t wrb, const float *x, float *y, int64_t n_tok,
                     int64_t n_in, int64_t n_out, f32_dots_fn dots, int64_t o0, int64_t o1) {
    float tile[LX_MM_TILE] __attribute__((aligned(64)));
    float r[LX_MM_NT];
    for (int64_t o = o0; o < o1; ++o) {
        const uint8_t *row = w + (size_t) o * wrb;
        prefetch_ahead(row, wrb, o == o0);
        for (int64_t c0 = 0; c0 < n_in; c0 += LX_MM_TILE) {
            const int64_t len = n_in - c0 < LX_MM_TILE ? n_in - c0 : LX_MM_TILE;
            const float *wv;
            if (wt == LX_TYPE_F32) {
                wv = (const float *) row + c0;
            } else {
                lx_dequantize_row(wt, row + lx_row_bytes(wt, c0), tile, len);
                wv = tile;
            }
            for (int64_t t0 = 0; t0 < n_tok; t0 += LX_MM_NT) {
                const int nt = (int) (n_tok - t0 < LX_MM_NT ? n_tok - t0 : LX_MM_NT);
                dots(wv, x + t0 * n_in + c0, n_in, len, nt, r);
                for (int k = 0; k < nt; ++k) {
                    float *yo = &y[(t0 + k) * n_out + o];
                    *yo = c0 == 0 ? r[k] : *yo + r[k];
                }
            }
        }
    }
}

void lx_mul_mat(const void *w, lx_type w_type, const float *x, float *y, int64_t n_tok,
                int64_t n_in, int64_t n_out, int n_threads) {
    assert(lx_mm_supported(w_type) && n_threads >= 1);
    if (n_tok <= 0 || n_out <= 0) return;
    if (n_in == 0) {
        memset(y, 0, (size_t) (n_tok * n_out) * sizeof(float));
        return;
    }
    const f32_dots_fn dots = pick_f32(lx_simd_level());
    const size_t wrb = lx_row_bytes(w_type, n_in);
    const int64_t n_blk = (n_out + LX_MM_ROWS - 1) / LX_MM_ROWS;
    const int nth = n_threads < n_blk ? n_threads : (int) n_blk;
    (void) nth;
#ifdef _OPENMP
#pragma omp parallel for num_threads(nth) schedule(static) if (nth > 1)
#endif
    for (int64_t blk = 0; blk < n_blk; ++blk) {
        const int64_t o0 = blk * LX_MM_ROWS;
        const int64_t o1 = o0 + LX_MM_ROWS < n_out ? o0 + LX_MM_ROWS : n_out;
        rows_f32((const uint8_t *) w, w_type, wrb, x, y, n_tok, n_in, n_out, dots, o0, o1);
    }
}

/* ---- float weights, fixed-order sums (see matmul.h) ---------------------------------------- */

static float dot_f32_ordered(const float *x, const float *w, int64_t n) {
    float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    const int64_t n8 = n - n % 8;
    for (int64_t k = 0; k < n8; k += 8) {
        for (int j = 0; j < 8; ++j) acc[j] += x[k + j] * w[k + j];
    }
    float sum = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
    for (int64_t k = n8; k < n; ++k) sum += x[k] * w[k];
    return sum;
}

#ifdef LX_MM_X86
/* the dots of x with 4 rows of w (w, w + ld, ...) into y[0..3]: dot_f32_ordered's lanes, products and
 * sums (a product rounded, then added: no fused steps), the lanes reduced in its tree (lx_hsum8_avx2), the
 * tail in order after them: the same bits, four rows sharing each load of x */
__attribute__((target("avx2,fma,f16c"))) static void dot4_f32_ordered_avx2(const float *x, const float *w, int64_t ld, int64_t n, float *y) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    const int64_t n8 = n - n % 8;
    for (int64_t k = 0; k < n8; k += 8) {
        const __m256 xv = _mm256_loadu_ps(x + k);
        a0 = _mm256_add_ps(a0, _mm256_mul_ps(xv, _mm256_loadu_ps(w + k)));
        a1 = _mm256_add_ps(a1, _mm256_mul_ps(xv, _mm256_loadu_ps(w + ld + k)));
        a2 = _mm256_add_ps(a2, _mm256_mul_ps(xv, _mm256_loadu_ps(w + 2 * ld + k)));
        a3 = _mm256_add_ps(a3, _mm256_mul_ps(xv, _mm256_loadu_ps(w + 3 * ld + k)));
    }
    const __m256 acc[4] = {a0, a1, a2, a3};
    for (int r = 0; r < 4; ++r) {
        float sum = lx_hsum8_avx2(acc[r]);
        for (int64_t k = n8; k < n; ++k) sum += x[k] * w[r * ld + k];
        y[r] = sum;
    }
}

__attribute__((target("avx2,fma,f16c"))) static float dot_f32_ordered_avx2(const float *x, const float *w, int64_t n) {
    __m256 a = _mm256_setzero_ps();
    const int64_t n8 = n - n % 8;
    for (int64_t k = 0; k < n8; k += 8) a = _mm256_add_ps(a, _mm256_mul_ps(_mm256_loadu_ps(x + k), _mm256_loadu_ps(w + k)));
    float sum = lx_hsum8_avx2(a);
    for (int64_t k = n8; k < n; ++k) sum += x[k] * w[k];
    return sum;
}
#endif

void lx_mul_mat_f32_ordered(const float *w, const float *x, float *y, int64_t n_tok, int64_t n_in, int64_t n_out,
                            int n_threads) {
    const int64_t n_blocks = (n_out + LX_MM_ROWS - 1) / LX_MM_ROWS;
#ifdef LX_MM_X86
    const int avx2 = lx_simd_level() >= LX_SIMD_AVX2;
#endif
    (void) n_threads;
#pragma omp parallel for num_threads(n_threads) schedule(static) if (n_tok * n_in * n_out >= 65536)
    for (int64_t b = 0; b < n_blocks; ++b) {
        const int64_t o0 = b * LX_MM_ROWS, o1 = (b + 1) * LX_MM_ROWS < n_out ? (b + 1) * LX_MM_ROWS : n_out;
        for (int64_t t = 0; t < n_tok; ++t) {
            const float *xt = x + t * n_in;
            float *yt = y + t * n_out;
            int64_t o = o0;
#ifdef LX_MM_X86
            if (avx2) {
                for (; o + 4 <= o1; o += 4) dot4_f32_ordered_avx2(xt, w + o * n_in, n_in, n_in, yt + o);
                for (; o < o1; ++o) yt[o] = dot_f32_ordered_avx2(xt, w + o * n_in, n_in);
            }
#endif
            for (; o < o1; ++o) yt[o] = dot_f32_ordered(xt, w + o * n_in, n_in);
        }
    }
}
