/* rope.c: see rope.h.
 *
 * The reference follows ggml's rotate_pairs literally (one pair at a time, interleaved cos/sin
 * cache). The fast path splits the cache into cos[] and sin[] arrays so that the pair loops
 * vectorise (neox: two contiguous halves; norm: even/odd lanes), compiles them for AVX2 as well
 * (chosen at run time), keeps the cache of the last position per thread (K-shift: consecutive
 * cells usually share one shift), and spreads tokens / cells over OpenMP threads. Every product
 * and sum is the same IEEE operation in both, and the translation unit is built without FMA
 * contraction (ISO C mode for GCC; the pragma below for clang), so the bits agree. Both take
 * their cos/sin from lx_rope_cache, the one place that knows frequency factors, YaRN and the
 * attention factor: the scaling kinds change the cache, never the rotation loops.
 */
#include "rope.h"
#include "team.h"
#include "cpu.h"

#include <assert.h>
#include <math.h>
#include <stdbool.h>
#include <string.h>

#include "hadamard.h"
#include "quants.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#endif

#define ROPE_PAR_MIN_VALUES (1 << 15)   /* fewer rotated values than this: one thread */

static void rope_check(const lx_rope_params *rp, int64_t n_head, int64_t head_dim) {
    (void) rp; (void) n_head; (void) head_dim;
    assert(rp->n_rot >= 2 && rp->n_rot % 2 == 0);
    assert(rp->n_rot <= head_dim && rp->n_rot <= LX_ROPE_MAX_ROT);
    assert(rp->kind == LX_ROPE_NORM || rp->kind == LX_ROPE_NEOX);
    assert(rp->ext_factor == 0.0f || rp->freq_scale > 0.0f);
    assert(n_head >= 0);
}

/* ggml's MAX / MIN, NaN and all (the ramp below must round as ggml's does) */
#define ROPE_MAX(a, b) ((a) > (b) ? (a) : (b))
#define ROPE_MIN(a, b) ((a) < (b) ? (a) : (b))

#define ROPE_PI 3.14159265358979323846   /* M_PI, which ISO C leaves undefined */

/* the dim whose pair turns n_rot times over n_ctx_orig positions (ggml_rope_yarn_corr_dim) */
static float rope_yarn_corr_dim(int n_dims, int n_ctx_orig, float n_rot, float base) {
    return n_dims * logf(n_ctx_orig / (n_rot * 2 * (float) ROPE_PI)) / (2 * logf(base));
}

void lx_rope_yarn_corr_dims(int n_dims, int n_ctx_orig, float freq_base, float beta_fast, float beta_slow,
                            float dims[2]) {
    const float start = floorf(rope_yarn_corr_dim(n_dims, n_ctx_orig, beta_fast, freq_base));
    const float end   =  ceilf(rope_yarn_corr_dim(n_dims, n_ctx_orig, beta_slow, freq_base));
    dims[0] = ROPE_MAX(0, start);
    dims[1] = ROPE_MIN(n_dims - 1, end);
}

/* YaRN's share of the extrapolated angle for the pair starting at dim i0: 1 below low, 0 above high */
static float rope_yarn_ramp(const float low, const float high, const int32_t i0) {
    const float y = (i0 / 2 - low) / ROPE_MAX(0.001f, high - low);
    return 1 - ROPE_MIN(1, ROPE_MAX(0, y));
}

void lx_rope_cache(const lx_rope_params *rp, lx_pos p, float *cache) {
    const float theta_scale = powf(rp->freq_base, -2.0f / (float) rp->n_rot);
    const bool  yarn = rp->ext_factor != 0.0f;
    /* rope_yarn's mscale, the same float steps (the same for every pair) */
    const float m = yarn ? rp->attn_factor * (1.0f + 0.1f * logf(1.0f / rp->freq_scale)) : rp->attn_factor;
    float theta = (float) p;
    for (int32_t i0 = 0; i0 < rp->n_rot; i0 += 2) {
        const float ff = rp->freq_factors ? rp->freq_factors[i0 / 2] : 1.0f;
        const float theta_extrap = theta / ff;
        const float theta_interp = rp->freq_scale * theta_extrap;
        float t = theta_interp;
        if (yarn) {
            const float ramp_mix = rope_yarn_ramp(rp->corr_dims[0], rp->corr_dims[1], i0) * rp->ext_factor;
            t = theta_interp * (1 - ramp_mix) + theta_extrap * ramp_mix;
        }
        cache[i0 + 0] = cosf(t) * m;
        cache[i0 + 1] = sinf(t) * m;
        theta *= theta_scale;
    }
}

/* ---- reference: ggml's rotate_pairs, one pair at a time ------------------------------------- */

/* x [n_rot] (the rotated part of one head) by the interleaved cache [n_rot] */
static void rope_rotate_ref(float *x, const float *cache, int32_t n_rot, lx_rope_kind kind) {
    const int64_t off = kind == LX_ROPE_NEOX ? n_rot / 2 : 1;
    for (int32_t i0 = 0; i0 < n_rot; i0 += 2) {
        const int64_t ic = kind == LX_ROPE_NEOX ? i0 / 2 : i0;
        const float c = cache[i0 + 0], s = cache[i0 + 1];
        const float x0 = x[ic], x1 = x[ic + off];
        x[ic]       = x0 * c - x1 * s;
        x[ic + off] = x0 * s + x1 * c;
    }
}

/* the same on half bits: each value read as float, rotated, rounded back */
static void rope_rotate_f16_ref(uint16_t *x, const float *cache, int32_t n_rot, lx_rope_kind kind) {
    const int64_t off = kind == LX_ROPE_NEOX ? n_rot / 2 : 1;
    for (int32_t i0 = 0; i0 < n_rot; i0 += 2) {
        const int64_t ic = kind == LX_ROPE_NEOX ? i0 / 2 : i0;
        const float c = cache[i0 + 0], s = cache[i0 + 1];
        const float x0 = lx_fp16_to_fp32(x[ic]), x1 = lx_fp16_to_fp32(x[ic + off]);
        x[ic]       = lx_fp32_to_fp16(x0 * c - x1 * s);
        x[ic + off] = lx_fp32_to_fp16(x0 * s + x1 * c);
    }
}

void lx_rope_f32_ref(const lx_rope_params *rp, float *x, const lx_pos *pos,
                     int64_t n_tokens, int64_t n_head, int64_t head_dim) {
    rope_check(rp, n_head, head_dim);
    float cache[LX_ROPE_MAX_ROT];
    for (int64_t t = 0; t < n_tokens; ++t) {
        lx_rope_cache(rp, pos[t], cache);
        for (int64_t h = 0; h < n_head; ++h) {
            rope_rotate_ref(x + (t * n_head + h) * head_dim, cache, rp->n_rot, rp->kind);
        }
    }
}

void lx_rope_k_shift_f32_ref(const lx_rope_params *rp, float *k, const lx_pos *shift,
                             int64_t kv_size, int64_t n_head_kv, int64_t head_dim) {
    rope_check(rp, n_head_kv, head_dim);
    float cache[LX_ROPE_MAX_ROT];
    for (int64_t i = 0; i < kv_size; ++i) {
        if (shift[i] == 0) continue;
        lx_rope_cache(rp, shift[i], cache);
        for (int64_t h = 0; h < n_head_kv; ++h) {
            rope_rotate_ref(k + (i * n_head_kv + h) * head_dim, cache, rp->n_rot, rp->kind);
        }
    }
}

void lx_rope_k_shift_f16_ref(const lx_rope_params *rp, uint16_t *k, const lx_pos *shift,
                             int64_t kv_size, int64_t n_head_kv, int64_t head_dim) {
    rope_check(rp, n_head_kv, head_dim);
    float cache[LX_ROPE_MAX_ROT];
    for (int64_t i = 0; i < kv_size; ++i) {
        if (shift[i] == 0) continue;
        lx_rope_cache(rp, shift[i], cache);
        for (int64_t h = 0; h < n_head_kv; ++h) {
            rope_rotate_f16_ref(k + (i * n_head_kv + h) * head_dim, cache, rp->n_rot, rp->kind);
        }
    }
}

/* ---- fast ------------------------------------------------------------------------------------ */

/* the angles of one position, split: c [n_rot/2] cosines, s [n_rot/2] sines */
typedef struct {
    float c[LX_ROPE_MAX_ROT / 2];
    float s[LX_ROPE_MAX_ROT / 2];
} rope_trig;

static void rope_trig_of(const lx_rope_params *rp, lx_pos p, rope_trig *tr) {
    float cache[LX_ROPE_MAX_ROT];
    lx_rope_cache(rp, p, cache);
    for (int32_t i = 0; i < rp->n_rot / 2; ++i) {
        tr->c[i] = cache[2 * i + 0];
        tr->s[i] = cache[2 * i + 1];
    }
}

/* rotate the first n_rot values of each of n_head heads of row [n_head*head_dim] */
static inline __attribute__((always_inline))
void rope_row_body(float *restrict row, const float *restrict c, const float *restrict s,
                   int64_t n_head, int64_t head_dim, int32_t n_rot, const bool neox) {
    const int32_t half = n_rot / 2;
    for (int64_t h = 0; h < n_head; ++h) {
        float *restrict x = row + h * head_dim;
        if (neox) {
            float *restrict xa = x;
            float *restrict xb = x + half;
            for (int32_t i = 0; i < half; ++i) {
                const float x0 = xa[i], x1 = xb[i];
                xa[i] = x0 * c[i] - x1 * s[i];
                xb[i] = x0 * s[i] + x1 * c[i];
            }
        } else {
            for (int32_t i = 0; i < half; ++i) {
                const float x0 = x[2 * i], x1 = x[2 * i + 1];
                x[2 * i]     = x0 * c[i] - x1 * s[i];
                x[2 * i + 1] = x0 * s[i] + x1 * c[i];
            }
        }
    }
}

typedef void (*rope_row_fn)(float *, const float *, const float *, int64_t, int64_t, int32_t);

static void rope_row_norm(float *row, const float *c, const float *s, int64_t n_head, int64_t head_dim,
                          int32_t n_rot) {
    rope_row_body(row, c, s, n_head, head_dim, n_rot, false);
}

static void rope_row_neox(float *row, const float *c, const float *s, int64_t n_head, int64_t head_dim,
                          int32_t n_rot) {
    rope_row_body(row, c, s, n_head, head_dim, n_rot, true);
}

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx2")))
static void rope_row_norm_avx2(float *row, const float *c, const float *s, int64_t n_head, int64_t head_dim,
                               int32_t n_rot) {
    rope_row_body(row, c, s, n_head, head_dim, n_rot, false);
}

__attribute__((target("avx2")))
static void rope_row_neox_avx2(float *row, const float *c, const float *s, int64_t n_head, int64_t head_dim,
                               int32_t n_rot) {
    rope_row_body(row, c, s, n_head, head_dim, n_rot, true);
}
#endif

static rope_row_fn rope_pick_row(lx_rope_kind kind) {
    const bool neox = kind == LX_ROPE_NEOX;
#if defined(__x86_64__) && defined(__GNUC__)
    if (lx_simd_level() >= LX_SIMD_AVX2) return neox ? rope_row_neox_avx2 : rope_row_norm_avx2;
#endif
    return neox ? rope_row_neox : rope_row_norm;
}

/* rows [i0, i1) of x [n][n_head][head_dim], row i by position pos[i] (skip_zero: rows at 0 left as
 * they are, the K-shift's unshifted cells) */
static void rope_rows(const lx_rope_params *rp, rope_row_fn row_fn, float *x, const lx_pos *pos, int64_t i0,
                      int64_t i1, int64_t n_head, int64_t head_dim, bool skip_zero) {
    rope_trig tr;
    bool   have = false;
    lx_pos last = 0;
    for (int64_t i = i0; i < i1; ++i) {
        if (skip_zero && pos[i] == 0) continue;
        if (!have || pos[i] != last) {
            rope_trig_of(rp, pos[i], &tr);
            have = true;
            last = pos[i];
        }
        row_fn(x + i * n_head * head_dim, tr.c, tr.s, n_head, head_dim, rp->n_rot);
    }
}

/* rope_rows of all n rows over a team of n_threads when it pays (even an if clause opens one: ~0.65 us
 * a call), each thread a contiguous share; no work-sharing construct, so a thread of an enclosing
 * team (layer.c's) may call it alone */
static void rope_rows_par(const lx_rope_params *rp, float *x, const lx_pos *pos, int64_t n, int64_t n_head,
                          int64_t head_dim, bool skip_zero, int n_threads) {
    rope_check(rp, n_head, head_dim);
    assert(n_threads >= 1);
    (void) n_threads;
    const rope_row_fn row_fn = rope_pick_row(rp->kind);
#ifdef _OPENMP
    if (n_threads > 1 && n > 1 && n * n_head * rp->n_rot >= ROPE_PAR_MIN_VALUES) {
        #pragma omp parallel num_threads(n_threads)
        {
            int64_t i0, i1;
            lx_share(n, omp_get_thread_num(), omp_get_num_threads(), &i0, &i1);
            rope_rows(rp, row_fn, x, pos, i0, i1, n_head, head_dim, skip_zero);
        }
        return;
    }
#endif
    rope_rows(rp, row_fn, x, pos, 0, n, n_head, head_dim, skip_zero);
}

void lx_rope_f32(const lx_rope_params *rp, float *x, const lx_pos *pos,
                 int64_t n_tokens, int64_t n_head, int64_t head_dim, int n_threads) {
    rope_rows_par(rp, x, pos, n_tokens, n_head, head_dim, false, n_threads);
}

void lx_rope_k_shift_f32(const lx_rope_params *rp, float *k, const lx_pos *shift,
                         int64_t kv_size, int64_t n_head_kv, int64_t head_dim, int n_threads) {
    rope_rows_par(rp, k, shift, kv_size, n_head_kv, head_dim, true, n_threads);
}

void lx_rope_k_shift_f16(const lx_rope_params *rp, uint16_t *k, const lx_pos *shift,
                         int64_t kv_size, int64_t n_head_kv, int64_t head_dim, int n_threads) {
    rope_check(rp, n_head_kv, head_dim);
    assert(n_threads >= 1);
    (void) n_threads;
    const rope_row_fn row_fn = rope_pick_row(rp->kind);
    const int64_t n_embd = n_head_kv * head_dim;
    const int32_t n_rot = rp->n_rot;
#ifdef _OPENMP
    const int par = n_threads > 1 && kv_size > 1 && kv_size * n_head_kv * n_rot >= ROPE_PAR_MIN_VALUES;
    #pragma omp parallel num_threads(n_threads) if (par)
#endif
    {
        rope_trig tr;
        bool   have = false;
        lx_pos last = 0;
        float  buf[LX_ROPE_MAX_ROT];   /* the rotated part of one head, in float */
#ifdef _OPENMP
        #pragma omp for schedule(static)
#endif
        for (int64_t i = 0; i < kv_size; ++i) {
            const lx_pos d = shift[i];
            if (d == 0) continue;
            if (!have || d != last) {
                rope_trig_of(rp, d, &tr);
                have = true;
                last = d;
            }
            for (int64_t h = 0; h < n_head_kv; ++h) {
                uint16_t *x = k + i * n_embd + h * head_dim;
                lx_fp16_to_fp32_row(x, buf, n_rot);
                row_fn(buf, tr.c, tr.s, 1, n_rot, n_rot);
                lx_fp32_to_fp16_row(buf, x, n_rot);
            }
        }
    }
}

/* ---- K-shift of any cache type, with rotation -------------------------------------------------- */

static void k_shift_check(lx_type t, int64_t head_dim, int rot_block) {
    (void) t; (void) head_dim; (void) rot_block;
    assert(t == LX_TYPE_F32 || t == LX_TYPE_F16 || t == LX_TYPE_Q8_0 || t == LX_TYPE_Q4_0);
    assert(head_dim <= LX_ROPE_MAX_HEAD && head_dim % lx_type_block_size(t) == 0);
    assert(rot_block == 0 || (lx_hadamard_block_ok(rot_block) && head_dim % rot_block == 0));
}

void lx_rope_k_shift_ref(const lx_rope_params *rp, lx_type t, void *k, const lx_pos *shift,
                         int64_t kv_size, int64_t n_head_kv, int64_t head_dim, int rot_block) {
    rope_check(rp, n_head_kv, head_dim);
    k_shift_check(t, head_dim, rot_block);
    if (rot_block == 0 && t == LX_TYPE_F32) {
        lx_rope_k_shift_f32_ref(rp, k, shift, kv_size, n_head_kv, head_dim);
        return;
    }
    if (rot_block == 0 && t == LX_TYPE_F16) {
        lx_rope_k_shift_f16_ref(rp, k, shift, kv_size, n_head_kv, head_dim);
        return;
    }
    const size_t hb = lx_row_bytes(t, head_dim);             /* bytes of one head's values */
    float cache[LX_ROPE_MAX_ROT];
    float x[LX_ROPE_MAX_HEAD];
    for (int64_t i = 0; i < kv_size; ++i) {
        if (shift[i] == 0) continue;
        lx_rope_cache(rp, shift[i], cache);
        for (int64_t h = 0; h < n_head_kv; ++h) {
            uint8_t *head = (uint8_t *) k + (size_t) (i * n_head_kv + h) * hb;
            lx_dequantize_row_ref(t, head, x, head_dim);
            if (rot_block) lx_hadamard_rows_ref(x, 1, head_dim, rot_block);
            rope_rotate_ref(x, cache, rp->n_rot, rp->kind);
            if (rot_block) lx_hadamard_rows_ref(x, 1, head_dim, rot_block);
            lx_quantize_row_ref(t, x, head, head_dim);
        }
    }
}

void lx_rope_k_shift(const lx_rope_params *rp, lx_type t, void *k, const lx_pos *shift,
                     int64_t kv_size, int64_t n_head_kv, int64_t head_dim, int rot_block, int n_threads) {
    rope_check(rp, n_head_kv, head_dim);
    k_shift_check(t, head_dim, rot_block);
    assert(n_threads >= 1);
    if (rot_block == 0 && t == LX_TYPE_F32) {
        lx_rope_k_shift_f32(rp, k, shift, kv_size, n_head_kv, head_dim, n_threads);
        return;
    }
    if (rot_block == 0 && t == LX_TYPE_F16) {
        lx_rope_k_shift_f16(rp, k, shift, kv_size, n_head_kv, head_dim, n_threads);
        return;
    }
    (void) n_threads;
    const rope_row_fn row_fn = rope_pick_row(rp->kind);
    const size_t hb = lx_row_bytes(t, head_dim);
#ifdef _OPENMP
    const int par = n_threads > 1 && kv_size > 1 && kv_size * n_head_kv * head_dim >= ROPE_PAR_MIN_VALUES / 4;
    #pragma omp parallel num_threads(n_threads) if (par)
#endif
    {
        rope_trig tr;
        bool   have = false;
        lx_pos last = 0;
        float  x[LX_ROPE_MAX_HEAD];
#ifdef _OPENMP
        #pragma omp for schedule(static)
#endif
        for (int64_t i = 0; i < kv_size; ++i) {
            const lx_pos d = shift[i];
            if (d == 0) continue;
            if (!have || d != last) {
                rope_trig_of(rp, d, &tr);
                have = true;
                last = d;
            }
            for (int64_t h = 0; h < n_head_kv; ++h) {
                uint8_t *head = (uint8_t *) k + (size_t) (i * n_head_kv + h) * hb;
                lx_dequantize_row(t, head, x, head_dim);
                if (rot_block) lx_hadamard_row(x, head_dim, rot_block);
                row_fn(x, tr.c, tr.s, 1, head_dim, rp->n_rot);
                if (rot_block) lx_hadamard_row(x, head_dim, rot_block);
                lx_quantize_row(t, x, head, head_dim);
            }
        }
    }
}
