/* ssm.c: the causal convolution and the selective scan of a Mamba layer (see ssm.h).
 *
 * Both loop over (sequence, channel) pairs in parallel; a pair runs its tokens in order on one
 * thread, so no sum ever depends on the thread count. libm's expf / log1pf, as ggml's CPU path.
 */
#include "ssm.h"

#include <math.h>
#include <string.h>

static inline float silu(float v) { return v / (1.0f + expf(-v)); }

/* ggml_softplus: log(1 + e^v), v itself above 20 where e^v would swamp the 1 */
static inline float softplus(float v) { return v <= 20.0f ? log1pf(expf(v)) : v; }

void lx_ssm_conv(float *state, const int32_t *cells, int64_t n_seqs, int64_t n_t, int64_t d, int d_conv,
                 const float *x, int64_t ldx, const float *w, const float *b, float *out, int n_threads) {
    const int64_t nw = d_conv - 1, pairs = n_seqs * d;
    (void) n_threads;
#pragma omp parallel for num_threads(n_threads) schedule(static) if (pairs * n_t * d_conv >= 32768)
    for (int64_t p = 0; p < pairs; ++p) {
        const int64_t s = p / d, c = p % d;
        float *st = state + ((int64_t) cells[s] * d + c) * nw;
        const float *wc = w + c * d_conv;
        const float bc = b ? b[c] : 0.0f;
        float win[LX_SSM_MAX_CONV];                    /* the last d_conv inputs of channel c */
        memcpy(win, st, (size_t) nw * sizeof(float));
        for (int64_t t = 0; t < n_t; ++t) {
            const int64_t row = s * n_t + t;
            win[nw] = x[row * ldx + c];
            float sum = 0.0f;
            for (int k = 0; k < d_conv; ++k) sum += win[k] * wc[k];
            out[row * d + c] = silu(sum + bc);
            memmove(win, win + 1, (size_t) nw * sizeof(float));
        }
        memcpy(st, win, (size_t) nw * sizeof(float));
    }
}

void lx_ssm_scan(float *state, const int32_t *cells, int64_t n_seqs, int64_t n_t, int64_t d, int64_t d_state,
                 const float *x, const float *dt, const float *A, const float *B, const float *C, int64_t ldbc,
                 const float *D, const float *z, int64_t ldz, float *y, int n_threads) {
    const int64_t pairs = n_seqs * d;
    (void) n_threads;
#pragma omp parallel for num_threads(n_threads) schedule(static) if (pairs * n_t * d_state >= 32768)
    for (int64_t p = 0; p < pairs; ++p) {
        const int64_t s = p / d, c = p % d;
        float *h = state + ((int64_t) cells[s] * d + c) * d_state;
        const float *a = A + c * d_state;
        for (int64_t t = 0; t < n_t; ++t) {
            const int64_t row = s * n_t + t;
            const float xv = x[row * d + c];
            const float dts = softplus(dt[row * d + c]);
            const float x_dt = xv * dts;
            const float *bt = B + row * ldbc, *ct = C + row * ldbc;
            float sum = 0.0f;
            for (int64_t n = 0; n < d_state; ++n) {
                const float hn = h[n] * expf(dts * a[n]) + bt[n] * x_dt;
                sum += hn * ct[n];
                h[n] = hn;
            }
            y[row * d + c] = (sum + xv * D[c]) * silu(z[row * ldz + c]);
        }
    }
}
