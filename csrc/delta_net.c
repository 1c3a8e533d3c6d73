/* delta_net.c: the gated delta rule of a linear-attention layer (see delta_net.h).
 *
 * The (sequence, head) pairs run in parallel; a pair runs its tokens in order on one thread, so no sum
 * depends on the thread count. Per token, each state row j takes two passes, back to back (a row
 * needs no other row): the decay and the dot with k (giving delta[j]), then the rank-one update and the
 * dot with q. The passes run in AVX2 lanes when the CPU has them, or through their scalar twins (the
 * same fused steps, the same lane sums: the same bits); exp is libm's expf, as ggml's CPU path. The
 * state streams through the cache once per token (d * d floats per head): that, not the arithmetic,
 * bounds the kernel.
 */
#include "delta_net.h"

#include "buffers.h"
#include "cpu.h"
#include "simd.h"
#include "ssm.h"

#include <math.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define LX_DN_X86 1
#endif

/* the 8 lanes' sum, in lx_hsum8_avx2's tree */
static inline float hsum8_ref(const float acc[8]) {
    return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
}

/* row <- row * e; returns sum_i row[i] * k[i] (after the decay) */
static float decay_dot_ref(float *row, const float *k, int64_t d, float e) {
    float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    const int64_t n8 = d - d % 8;
    for (int64_t i = 0; i < n8; i += 8)
        for (int l = 0; l < 8; ++l) {
            const float s = row[i + l] * e;
            acc[l] = fmaf(s, k[i + l], acc[l]);
            row[i + l] = s;
        }
    float sum = hsum8_ref(acc);
    for (int64_t i = n8; i < d; ++i) {
        row[i] *= e;
        sum = fmaf(row[i], k[i], sum);
    }
    return sum;
}

/* row <- row + k * dj; returns sum_i row[i] * q[i] (after the update) */
static float update_dot_ref(float *row, const float *k, const float *q, int64_t d, float dj) {
    float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    const int64_t n8 = d - d % 8;
    for (int64_t i = 0; i < n8; i += 8)
        for (int l = 0; l < 8; ++l) {
            const float s = fmaf(k[i + l], dj, row[i + l]);
            acc[l] = fmaf(s, q[i + l], acc[l]);
            row[i + l] = s;
        }
    float sum = hsum8_ref(acc);
    for (int64_t i = n8; i < d; ++i) {
        row[i] = fmaf(k[i], dj, row[i]);
        sum = fmaf(row[i], q[i], sum);
    }
    return sum;
}

#ifdef LX_DN_X86
__attribute__((target("avx2,fma,f16c"))) static float decay_dot_avx2(float *row, const float *k, int64_t d, float e) {
    const int64_t n8 = d - d % 8;
    const __m256 ve = _mm256_set1_ps(e);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n8; i += 8) {
        const __m256 s = _mm256_mul_ps(_mm256_loadu_ps(row + i), ve);
        acc = _mm256_fmadd_ps(s, _mm256_loadu_ps(k + i), acc);
        _mm256_storeu_ps(row + i, s);
    }
    float sum = lx_hsum8_avx2(acc);
    for (int64_t i = n8; i < d; ++i) {
        row[i] *= e;
        sum = fmaf(row[i], k[i], sum);
    }
    return sum;
}

__attribute__((target("avx2,fma,f16c"))) static float update_dot_avx2(float *row, const float *k, const float *q,
                                                                      int64_t d, float dj) {
    const int64_t n8 = d - d % 8;
    const __m256 vd = _mm256_set1_ps(dj);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n8; i += 8) {
        const __m256 s = _mm256_fmadd_ps(_mm256_loadu_ps(k + i), vd, _mm256_loadu_ps(row + i));
        acc = _mm256_fmadd_ps(s, _mm256_loadu_ps(q + i), acc);
        _mm256_storeu_ps(row + i, s);
    }
    float sum = lx_hsum8_avx2(acc);
    for (int64_t i = n8; i < d; ++i) {
        row[i] = fmaf(k[i], dj, row[i]);
        sum = fmaf(row[i], q[i], sum);
    }
    return sum;
}
#endif

void lx_delta_net(float *state, const int32_t *cells, int64_t n_seqs, int64_t n_t, int64_t n_head,
                  int64_t n_head_k, int64_t d, const float *q, const float *k, int64_t ldqk, const float *v,
                  int64_t ldv, const float *g, const float *beta, float *out, float *hist, int64_t n_hist,
                  const int32_t *hist_row, float *undo, int32_t *undo_slot, int n_threads) {
    const int64_t pairs = n_seqs * n_head, dd = d * d;
    const int64_t m = hist ? (n_t < n_hist ? n_t : n_hist) : 0;   /* history rows per sequence */
    const float scale = 1.0f / sqrtf((float) d);
#ifdef LX_DN_X86
    const int simd = lx_simd_level() >= LX_SIMD_AVX2;
#endif
    (void) n_threads;
#pragma omp parallel for num_threads(n_threads) schedule(static) if (pairs * n_t * dd >= 32768)
    for (int64_t p = 0; p < pairs; ++p) {
        const int64_t s = p / n_head, h = p % n_head, hk = h % n_head_k;
        float *S = state + ((int64_t) cells[s] * n_head + h) * dd;
        if (undo && undo_slot[s] >= 0)
            lx_stream_copy(undo + ((int64_t) undo_slot[s] * n_head + h) * dd, S, (size_t) dd * sizeof(float));
        /* row r of the cell's history, head h: hh + r * n_head * dd */
        float *hh = m ? hist + ((int64_t) cells[s] * n_hist * n_head + h) * dd : NULL;
        const int64_t r0 = hist_row ? hist_row[s] : 0;   /* the row of token n_t - m */
        for (int64_t t = 0; t < n_t; ++t) {
            const int64_t row = s * n_t + t;
            const float *qt = q + row * ldqk + hk * d, *kt = k + row * ldqk + hk * d, *vt = v + row * ldv + h * d;
            const float e = expf(g[row * n_head + h]), b = beta[row * n_head + h];
            float *o = out + (row * n_head + h) * d;
            for (int64_t j = 0; j < d; ++j) {   /* a row's delta and update need that row alone */
                float *Sj = S + j * d, dj, oj;
#ifdef LX_DN_X86
                if (simd) {
                    dj = (vt[j] - decay_dot_avx2(Sj, kt, d, e)) * b;
                    oj = update_dot_avx2(Sj, kt, qt, d, dj);
                } else
#endif
                {
                    dj = (vt[j] - decay_dot_ref(Sj, kt, d, e)) * b;
                    oj = update_dot_ref(Sj, kt, qt, d, dj);
                }
                o[j] = oj * scale;
            }
            if (t >= n_t - m)
                memcpy(hh + ((r0 + t - (n_t - m)) % n_hist) * n_head * dd, S, (size_t) dd * sizeof(float));
        }
    }
    if (undo) lx_undo_done(undo_slot, n_seqs);
}
