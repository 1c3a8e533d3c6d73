/* ssm.c: the causal convolution and the selective scan of a Mamba layer (see ssm.h).
 *
 * Both loop over (sequence, channel) pairs in parallel (the conv over blocks of 8 adjacent channels, a
 * lane each, where the CPU has AVX2, and its other channels one by one: each lane makes the scalar
 * channel's operations, the same bits); a pair runs its tokens in order on one thread, so no sum ever
 * depends on the thread count. The scan's inner step over the d_state terms runs in AVX2 lanes when
 * the CPU has them, or through its scalar twin (the same bits: vexp.h's exp, the same fused steps and
 * lane sums), so the results do not depend on the SIMD level either. softplus uses libm's expf /
 * log1pf, as ggml's CPU path; the SiLUs are vexp.h's (lanes and scalar twin, the same bits). The
 * history rows (ssm.h) are copies of the window / h after a token, made by the thread that computed
 * them.
 */
#include "ssm.h"

#include "buffers.h"

#include "cpu.h"
#include "simd.h"
#include "vexp.h"

#include <math.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define LX_SSM_X86 1
#endif

/* ggml_softplus: log(1 + e^v), v itself above 20 where e^v would swamp the 1 */
static inline float softplus(float v) { return v <= 20.0f ? log1pf(expf(v)) : v; }

/* one channel of one sequence through its n_t tokens (lx_ssm_conv's body, before the SiLU): the window of the last
 * d_conv inputs in registers, shifted by plain loops; inlined with d_conv a constant (4, every Mamba's)
 * the loops unroll, the same operations in the same order (-std=c11: no contraction), the same bits */
static inline void conv_channel(float *st, const float *xc, int64_t ldx, const float *wc, float bc, float *oc,
                                int64_t ldo, int64_t n_t, const int d_conv, float *hc, int64_t hstride,
                                int64_t n_hist, int64_t r0, int64_t m) {
    const int nw = d_conv - 1;
    float win[LX_SSM_MAX_CONV];                    /* the last d_conv inputs of the channel */
    for (int k = 0; k < nw; ++k) win[k] = st[k];
    for (int64_t t = 0; t < n_t; ++t) {
        win[nw] = xc[t * ldx];
        float sum = 0.0f;
        for (int k = 0; k < d_conv; ++k) sum += win[k] * wc[k];
        oc[t * ldo] = sum + bc;
        for (int k = 0; k < nw; ++k) win[k] = win[k + 1];
        if (t >= n_t - m) {
            float *h = hc + ((r0 + t - (n_t - m)) % n_hist) * hstride;
            for (int k = 0; k < nw; ++k) h[k] = win[k];
        }
    }
    for (int k = 0; k < nw; ++k) st[k] = win[k];
}

#ifdef LX_SSM_X86
/* conv_channel on 8 adjacent channels c0..c0+7 at once, a lane each: the same operations per lane in the same
 * order (a product, then an add; no fused step), so each lane's bits are conv_channel's. x and out rows give
 * the 8 channels' values side by side; the states and history rows ([c][d_conv - 1]) go through a transpose. */
static inline __attribute__((always_inline, target("avx2,fma"))) void
conv_block8(float *st, const float *xc, int64_t ldx, const float *wc, const float *bc, float *oc, int64_t ldo,
            int64_t n_t, const int d_conv, float *hc, int64_t hstride, int64_t n_hist, int64_t r0, int64_t m) {
    const int nw = d_conv - 1;
    float tmp[8];
    __m256 win[LX_SSM_MAX_CONV], wv[LX_SSM_MAX_CONV];
    for (int k = 0; k < d_conv; ++k) {
        for (int j = 0; j < 8; ++j) tmp[j] = wc[j * d_conv + k];
        wv[k] = _mm256_loadu_ps(tmp);
    }
    for (int k = 0; k < nw; ++k) {
        for (int j = 0; j < 8; ++j) tmp[j] = st[j * nw + k];
        win[k] = _mm256_loadu_ps(tmp);
    }
    const __m256 bv = bc ? _mm256_loadu_ps(bc) : _mm256_setzero_ps();
    for (int64_t t = 0; t < n_t; ++t) {
        win[nw] = _mm256_loadu_ps(xc + t * ldx);
        __m256 sum = _mm256_setzero_ps();
        for (int k = 0; k < d_conv; ++k) sum = _mm256_add_ps(sum, _mm256_mul_ps(win[k], wv[k]));
        _mm256_storeu_ps(oc + t * ldo, _mm256_add_ps(sum, bv));
        for (int k = 0; k < nw; ++k) win[k] = win[k + 1];
        if (t >= n_t - m) {
            float *h = hc + ((r0 + t - (n_t - m)) % n_hist) * hstride;
            for (int k = 0; k < nw; ++k) {
                _mm256_storeu_ps(tmp, win[k]);
                for (int j = 0; j < 8; ++j) h[j * nw + k] = tmp[j];
            }
        }
    }
    for (int k = 0; k < nw; ++k) {
        _mm256_storeu_ps(tmp, win[k]);
        for (int j = 0; j < 8; ++j) st[j * nw + k] = tmp[j];
    }
}

/* conv_block8 with d_conv a constant (4: the loops unroll) or not */
__attribute__((target("avx2,fma"))) static void conv_block8_avx2(float *st, const float *xc, int64_t ldx,
                                                                 const float *wc, const float *bc, float *oc,
                                                                 int64_t ldo, int64_t n_t, int d_conv, float *hc,
                                                                 int64_t hstride, int64_t n_hist, int64_t r0,
                                                                 int64_t m) {
    if (d_conv == 4) conv_block8(st, xc, ldx, wc, bc, oc, ldo, n_t, 4, hc, hstride, n_hist, r0, m);
    else conv_block8(st, xc, ldx, wc, bc, oc, ldo, n_t, d_conv, hc, hstride, n_hist, r0, m);
}
#endif

void lx_ssm_conv(float *state, const int32_t *cells, int64_t n_seqs, int64_t n_t, int64_t d, int d_conv,
                 const float *x, int64_t ldx, const float *w, const float *b, float *out, float *hist,
                 int64_t n_hist, const int32_t *hist_row, int n_threads) {
    const int64_t nw = d_conv - 1;
    const int64_t m = hist ? (n_t < n_hist ? n_t : n_hist) : 0;   /* history rows per sequence */
#ifdef LX_SSM_X86
    const int simd = lx_simd_level() >= LX_SIMD_AVX2;
#else
    const int simd = 0;
#endif
    /* a sequence's work: nb blocks of 8 channels (AVX2), then its other channels one by one */
    const int64_t nb = simd ? d / 8 : 0, per = nb + (d - 8 * nb), units = n_seqs * per;
    (void) n_threads;
#pragma omp parallel for num_threads(n_threads) schedule(static) if (n_seqs * d * n_t * d_conv >= 4096)
    for (int64_t p = 0; p < units; ++p) {
        const int64_t s = p / per, u = p % per, c = u < nb ? 8 * u : 8 * nb + (u - nb);
        float *st = state + ((int64_t) cells[s] * d + c) * nw;
        /* row j of the cell's history, channel c: hc + j * d * nw */
        float *hc = m ? hist + ((int64_t) cells[s] * n_hist * d + c) * nw : NULL;
        const int64_t r0 = hist_row ? hist_row[s] : 0;   /* the row of token n_t - m */
        const float *xc = x + s * n_t * ldx + c;
        float *oc = out + s * n_t * d + c;
#ifdef LX_SSM_X86
        if (u < nb) {
            conv_block8_avx2(st, xc, ldx, w + c * d_conv, b ? b + c : NULL, oc, d, n_t, d_conv, hc, d * nw, n_hist,
                             r0, m);
            continue;
        }
#endif
        const float bc = b ? b[c] : 0.0f;
        if (d_conv == 4)
            conv_channel(st, xc, ldx, w + c * 4, bc, oc, d, n_t, 4, hc, d * nw, n_hist, r0, m);
        else
            conv_channel(st, xc, ldx, w + c * d_conv, bc, oc, d, n_t, d_conv, hc, d * nw, n_hist, r0, m);
    }
    /* the SiLU over every output row (vexp.h: 8 lanes or the scalar twin, the same bits) */
    const int64_t rows = n_seqs * n_t;
#pragma omp parallel for num_threads(n_threads) schedule(static) if (rows * d >= 32768)
    for (int64_t r = 0; r < rows; ++r) lx_silu_mul(out + r * d, NULL, out + r * d, d, simd);
}

/* the terms n0 <= n < d_state of a scan step, one by one after the lanes' sum (both paths' tail) */
static inline float scan_tail(float *h, const float *a, const float *bt, const float *ct, int64_t n0, int64_t d_state,
                              float dts, float x_dt, float sum) {
    for (int64_t n = n0; n < d_state; ++n) {
        const float hn = fmaf(h[n], lx_exp_ref(dts * a[n]), bt[n] * x_dt);
        sum = fmaf(hn, ct[n], sum);
        h[n] = hn;
    }
    return sum;
}

/* One token of one channel through its state h [d_state] (the scan's inner step): h <- h * e^(dt' A) +
 * B x dt', returning sum_n h[n] C[n]. The n terms run in 8 lanes (n mod 8) reduced as lx_hsum8_avx2
 * reduces, the last d_state % 8 in order after, each product fused as the AVX2 twin fuses it, with
 * vexp.h's exp: the scalar twin of scan_step_avx2, the same bits. */
static float scan_step_ref(float *h, const float *a, const float *bt, const float *ct, int64_t d_state, float dts,
                           float x_dt) {
    float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    const int64_t n8 = d_state - d_state % 8;
    for (int64_t n = 0; n < n8; n += 8) {
        for (int j = 0; j < 8; ++j) {
            const float hn = fmaf(h[n + j], lx_exp_ref(dts * a[n + j]), bt[n + j] * x_dt);
            acc[j] = fmaf(hn, ct[n + j], acc[j]);
            h[n + j] = hn;
        }
    }
    float sum = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
    return scan_tail(h, a, bt, ct, n8, d_state, dts, x_dt, sum);
}

#ifdef LX_SSM_X86
__attribute__((target("avx2,fma,f16c"))) static float scan_step_avx2(float *h, const float *a, const float *bt, const float *ct, int64_t d_state,
                                                                     float dts, float x_dt) {
    const int64_t n8 = d_state - d_state % 8;
    const __m256 vdt = _mm256_set1_ps(dts), vxdt = _mm256_set1_ps(x_dt);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t n = 0; n < n8; n += 8) {
        const __m256 e = lx_exp8_avx2(_mm256_mul_ps(vdt, _mm256_loadu_ps(a + n)));
        const __m256 hn = _mm256_fmadd_ps(_mm256_loadu_ps(h + n), e, _mm256_mul_ps(_mm256_loadu_ps(bt + n), vxdt));
        acc = _mm256_fmadd_ps(hn, _mm256_loadu_ps(ct + n), acc);
        _mm256_storeu_ps(h + n, hn);
    }
    float sum = lx_hsum8_avx2(acc);
    return scan_tail(h, a, bt, ct, n8, d_state, dts, x_dt, sum);
}
#endif

void lx_ssm_scan(float *state, const int32_t *cells, int64_t n_seqs, int64_t n_t, int64_t d, int64_t d_state,
                 const float *x, const float *dt, const float *A, const float *B, const float *C, int64_t ldbc,
                 const float *D, const float *z, int64_t ldz, float *y, float *hist, int64_t n_hist,
                 const int32_t *hist_row, float *undo, int32_t *undo_slot, int n_threads) {
    const int64_t pairs = n_seqs * d;
    const int64_t m = hist ? (n_t < n_hist ? n_t : n_hist) : 0;   /* history rows per sequence */
#ifdef LX_SSM_X86
    const int simd = lx_simd_level() >= LX_SIMD_AVX2;
#endif
    (void) n_threads;
#pragma omp parallel for num_threads(n_threads) schedule(static) if (pairs * n_t * d_state >= 32768)
    for (int64_t p = 0; p < pairs; ++p) {
        const int64_t s = p / d, c = p % d;
        float *h = state + ((int64_t) cells[s] * d + c) * d_state;
        if (undo && undo_slot[s] >= 0)
            lx_stream_copy(undo + ((int64_t) undo_slot[s] * d + c) * d_state, h, (size_t) d_state * sizeof(float));
        const float *a = A + c * d_state;
        /* row j of the cell's history, channel c: hc + j * d * d_state */
        float *hc = m ? hist + ((int64_t) cells[s] * n_hist * d + c) * d_state : NULL;
        const int64_t r0 = hist_row ? hist_row[s] : 0;   /* the row of token n_t - m */
        for (int64_t t = 0; t < n_t; ++t) {
            const int64_t row = s * n_t + t;
            const float xv = x[row * d + c];
            const float dts = softplus(dt[row * d + c]);
            const float x_dt = xv * dts;
            const float *bt = B + row * ldbc, *ct = C + row * ldbc;
            float sum;
#ifdef LX_SSM_X86
            if (simd) sum = scan_step_avx2(h, a, bt, ct, d_state, dts, x_dt);
            else
#endif
                sum = scan_step_ref(h, a, bt, ct, d_state, dts, x_dt);
            y[row * d + c] = (sum + xv * D[c]) * lx_silu_ref(z[row * ldz + c]);
            if (t >= n_t - m)
                memcpy(hc + ((r0 + t - (n_t - m)) % n_hist) * d * d_state, h, (size_t) d_state * sizeof(float));
        }
    }
    if (undo) lx_undo_done(undo_slot, n_seqs);
}

void lx_undo_done(int32_t *undo_slot, int64_t n_seqs) {
    for (int64_t s = 0; s < n_seqs; ++s)
        if (undo_slot[s] >= 0) undo_slot[s] = -1;
}
