/* ssd.c: the selective scan of a Mamba-2 layer (see ssd.h).
 *
 * The loop runs over (sequence, head) pairs in parallel; a pair runs its tokens in order on one
 * thread, so no sum depends on the thread count. The inner step over the d_state terms of one channel
 * runs in AVX2 lanes when the CPU has them, or through its scalar twin (the same fused steps and lane
 * sums: the same bits), so the results do not depend on the SIMD level either. The per-head decay
 * dA and softplus use libm's expf / log1pf, as ggml's CPU path; the SiLU gate is vexp.h's (8 lanes over a
 * head's channels or the scalar twin, the same bits). The history rows are memcpy's
 * of a head's state after a token, made by the thread that computed it.
 */
#include "ssd.h"

#include "buffers.h"
#include "cpu.h"
#include "simd.h"
#include "ssm.h"
#include "vexp.h"

#include <math.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define LX_SSD_X86 1
#endif

/* ggml_softplus: log(1 + e^v), v itself above 20 where e^v would swamp the 1 */
static inline float softplus(float v) { return v <= 20.0f ? log1pf(expf(v)) : v; }

/* One token of one channel through its state s [d_state]: s <- s * dA + B x dt', returning
 * sum_n s[n] C[n]. The n terms run in 8 lanes (n mod 8) reduced as lx_hsum8_avx2 reduces, the last
 * d_state % 8 in order after: the scalar twin of step_avx2, the same bits. */
static float step_ref(float *s, const float *bt, const float *ct, int64_t d_state, float dA, float x_dt) {
    float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    const int64_t n8 = d_state - d_state % 8;
    for (int64_t n = 0; n < n8; n += 8) {
        for (int j = 0; j < 8; ++j) {
            const float sn = fmaf(s[n + j], dA, bt[n + j] * x_dt);
            acc[j] = fmaf(sn, ct[n + j], acc[j]);
            s[n + j] = sn;
        }
    }
    float sum = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
    for (int64_t n = n8; n < d_state; ++n) {
        const float sn = fmaf(s[n], dA, bt[n] * x_dt);
        sum = fmaf(sn, ct[n], sum);
        s[n] = sn;
    }
    return sum;
}

#ifdef LX_SSD_X86
__attribute__((target("avx2,fma,f16c"))) static float step_avx2(float *s, const float *bt, const float *ct,
                                                                int64_t d_state, float dA, float x_dt) {
    const int64_t n8 = d_state - d_state % 8;
    const __m256 vda = _mm256_set1_ps(dA), vxdt = _mm256_set1_ps(x_dt);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t n = 0; n < n8; n += 8) {
        const __m256 sn = _mm256_fmadd_ps(_mm256_loadu_ps(s + n), vda, _mm256_mul_ps(_mm256_loadu_ps(bt + n), vxdt));
        acc = _mm256_fmadd_ps(sn, _mm256_loadu_ps(ct + n), acc);
        _mm256_storeu_ps(s + n, sn);
    }
    float sum = lx_hsum8_avx2(acc);
    for (int64_t n = n8; n < d_state; ++n) {
        const float sn = fmaf(s[n], dA, bt[n] * x_dt);
        sum = fmaf(sn, ct[n], sum);
        s[n] = sn;
    }
    return sum;
}
#endif

void lx_ssd_scan(float *state, const int32_t *cells, int64_t n_seqs, int64_t n_t, int64_t n_head, int64_t head_dim,
                 int64_t d_state, int64_t n_group, const float *x, int64_t ldx, const float *dt, int64_t lddt,
                 const float *A, const float *B, const float *C, int64_t ldbc, const float *D, const float *z,
                 int64_t ldz, float *y, float *hist, int64_t n_hist, const int32_t *hist_row, float *undo,
                 int32_t *undo_slot, int n_threads) {
    const int64_t pairs = n_seqs * n_head, d_inner = n_head * head_dim, head_size = head_dim * d_state;
    const int64_t heads_per_group = n_head / n_group;
    const int64_t m = hist ? (n_t < n_hist ? n_t : n_hist) : 0;   /* history rows per sequence */
#ifdef LX_SSD_X86
    const int simd = lx_simd_level() >= LX_SIMD_AVX2;
#else
    const int simd = 0;
#endif
    (void) n_threads;
#pragma omp parallel for num_threads(n_threads) schedule(static) if (pairs * n_t * head_size >= 32768)
    for (int64_t p = 0; p < pairs; ++p) {
        const int64_t s = p / n_head, h = p % n_head, g = h / heads_per_group;
        float *st = state + ((int64_t) cells[s] * n_head + h) * head_size;
        if (undo && undo_slot[s] >= 0)
            lx_stream_copy(undo + ((int64_t) undo_slot[s] * n_head + h) * head_size, st,
                           (size_t) head_size * sizeof(float));
        /* row j of the cell's history, head h: hh + j * n_head * head_size */
        float *hh = m ? hist + ((int64_t) cells[s] * n_hist * n_head + h) * head_size : NULL;
        const int64_t r0 = hist_row ? hist_row[s] : 0;   /* the row of token n_t - m */
        for (int64_t t = 0; t < n_t; ++t) {
            const int64_t row = s * n_t + t;
            const float dts = softplus(dt[row * lddt + h]);
            const float dA = expf(dts * A[h]);
            const float *bt = B + row * ldbc + g * d_state, *ct = C + row * ldbc + g * d_state;
            const float *xt = x + row * ldx + h * head_dim, *zt = z + row * ldz + h * head_dim;
            float *yt = y + row * d_inner + h * head_dim;
            for (int64_t i = 0; i < head_dim; ++i) {
                const float x_dt = xt[i] * dts;
                float sum;
#ifdef LX_SSD_X86
                if (simd) sum = step_avx2(st + i * d_state, bt, ct, d_state, dA, x_dt);
                else
#endif
                    sum = step_ref(st + i * d_state, bt, ct, d_state, dA, x_dt);
                yt[i] = sum + xt[i] * D[h];
            }
            lx_silu_mul(zt, yt, yt, head_dim, simd);   /* y * silu(z), vexp.h's lanes or twin */
            if (t >= n_t - m)
                memcpy(hh + ((r0 + t - (n_t - m)) % n_hist) * n_head * head_size, st, (size_t) head_size * sizeof(float));
        }
    }
    if (undo) lx_undo_done(undo_slot, n_seqs);
}
