/* layer.c: one decoder layer in one call (see layer.h). Composes the kernels of product.c (the
 * weight products), rope.c, attention.c, hadamard.c and quants.c; holds no policy (the cells come
 * from the memory).
 *
 *   work = | h | qkv | q | k | v | a | o | gu | act | tmp | product work | attention scratch |
 */
#include "layer.h"

#include "attention.h"
#include "cpu.h"
#include "hadamard.h"
#include "product.h"
#include "gemm.h"
#include "team.h"
#include "vexp.h"

#include <math.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define LX_LAYER_X86 1
#include <immintrin.h>
#endif

#define ALIGN(n) (((size_t) (n) + 63) & ~(size_t) 63)

/* a prompt's row steps of memory traffic only (copies, sums, scales) run over the threads from this many rows */
#define LX_ROWS_PARALLEL 64

/* ---- shapes ------------------------------------------------------------------------------- */

enum { B_H, B_QKV, B_Q, B_K, B_V, B_A, B_O, B_GU, B_ACT, B_TMP, B_GEMM, B_SCRATCH, B_MOE, B_N };

typedef struct {
    int64_t nq, nk, nv, nqkv;      /* columns of q, k, v and their sum */
    size_t off[B_N];               /* work offsets of the buffers */
    int64_t n_scratch;             /* attention scratch floats */
    size_t total;
} layout;

int lx_linear_valid(const lx_linear *l, int64_t n_in, int64_t n_out) {
    if (l->n_parts < 1 || l->n_parts > LX_LINEAR_MAX_PARTS || l->n_in != n_in || l->n_out != n_out) return 0;
    int64_t rows = 0;
    for (int i = 0; i < l->n_parts; ++i) {
        if (!l->w[i] || l->rows[i] < 1 || lx_product_kind_of(l->type[i], l->r8[i]) == LX_PRODUCT_NONE) return 0;
        if (n_in % lx_type_block_size(l->type[i])) return 0;
        rows += l->rows[i];
    }
    return rows == n_out;
}

size_t lx_linear_work_size(const lx_linear *l, int64_t n, int n_threads, int64_t *widest) {
    size_t b = 0;
    for (int i = 0; i < l->n_parts; ++i) {
        const size_t s = lx_product_work_size(l->type[i], l->r8[i], n, l->n_in, n_threads);
        if (s > b) b = s;
        if (l->n_parts > 1 && l->rows[i] > *widest) *widest = l->rows[i];
    }
    return b;
}

static lx_attn_params attn_params(const lx_layer_params *p, const lx_kv_layer *kv, int64_t n_tokens) {
    lx_attn_params a = {
        .n_stream = kv->n_stream, .n_tps = n_tokens / kv->n_stream, .n_tps_pad = kv->n_tps_pad,
        .n_head = p->n_head, .n_head_kv = p->n_head_kv, .d_k = p->d_k, .d_v = p->d_v,
        .kv_size = kv->kv_size, .n_kv = kv->n_kv, .type_k = kv->type_k, .type_v = kv->type_v,
        .scale = p->kq_scale, .softcap = p->softcap, .perm = kv->perm,
    };
    return a;
}

static int valid(const lx_layer_params *p, const lx_layer_weights *w, const lx_kv_layer *kv, int64_t n) {
    if (n < 1 || p->n_embd < 1 || p->n_head < 1 || p->n_head_kv < 1 || p->n_head % p->n_head_kv ||
        p->n_ff < 1 || p->d_k < 1 || p->d_v < 1 || !(p->eps >= 0.0f))
        return 0;
    if (p->rope.n_rot && (p->rope.n_rot < 2 || p->rope.n_rot % 2 || p->rope.n_rot > p->d_k ||
                          p->rope.n_rot > LX_ROPE_MAX_ROT))
        return 0;
    if (p->act == LX_ACT_GELU_TABLE ? !p->gelu_table : p->act != LX_ACT_SILU) return 0;
    if (!(p->residual_scale == p->residual_scale)) return 0;   /* NaN */
    const int64_t nqkv = p->n_head * p->d_k + p->n_head_kv * (p->d_k + p->d_v);
    if (!lx_linear_valid(&w->wqkv, p->n_embd, nqkv) || !lx_linear_valid(&w->wo, p->n_head * p->d_v, p->n_embd)) return 0;
    if (w->moe ? !lx_moe_valid(&p->moe, w->moe) || p->moe.n_embd != p->n_embd
               : !lx_linear_valid(&w->w_gate_up, p->n_embd, 2 * p->n_ff) || !lx_linear_valid(&w->w_down, p->n_ff, p->n_embd))
        return 0;
    if (!kv->k || !kv->v || !kv->idxs || kv->n_stream < 1 || n % kv->n_stream) return 0;
    if (kv->n_kv > 0 && !kv->mask) return 0;
    if (kv->n_tps_pad < n / kv->n_stream) return 0;
    for (int64_t t = 0; t < n; ++t)
        if ((int64_t) kv->idxs[t] >= kv->kv_size) return 0;
    const lx_attn_params a = attn_params(p, kv, n);
    return kv->v_trans ? lx_attn_params_valid_vtrans(&a) : lx_attn_params_valid(&a);
}

static layout plan(const lx_layer_params *p, const lx_layer_weights *w, const lx_kv_layer *kv, int64_t n,
                   int nt) {
    layout L;
    L.nq = p->n_head * p->d_k, L.nk = p->n_head_kv * p->d_k, L.nv = p->n_head_kv * p->d_v;
    L.nqkv = L.nq + L.nk + L.nv;
    int64_t widest = 0;   /* the widest part of a product of several parts (joined through tmp) */
    size_t g = 0;
    const lx_linear *all[4] = {&w->wqkv, &w->wo, &w->w_gate_up, &w->w_down};
    for (int i = 0; i < (w->moe ? 2 : 4); ++i) {
        const size_t s = lx_linear_work_size(all[i], n, nt, &widest);
        if (s > g) g = s;
    }
    const lx_attn_params a = attn_params(p, kv, n);
    L.n_scratch = lx_attn_scratch_size(&a, nt);
    const size_t fl = sizeof(float);
    const size_t bytes[B_N] = {
        (size_t) (n * p->n_embd) * fl, (size_t) (n * L.nqkv) * fl, (size_t) (n * L.nq) * fl,
        (size_t) (n * L.nk) * fl, (size_t) (n * L.nv) * fl, (size_t) (n * p->n_head * p->d_v) * fl,
        (size_t) (n * p->n_embd) * fl, (size_t) (n * 2 * p->n_ff) * fl, (size_t) (n * p->n_ff) * fl,
        (size_t) (n * widest) * fl, g, (size_t) L.n_scratch * fl,
        w->moe ? lx_moe_work_size(&p->moe, w->moe, n, nt) : 0,
    };
    size_t o = 0;
    for (int i = 0; i < B_N; ++i) {
        L.off[i] = o;
        o += ALIGN(bytes[i]);
    }
    L.total = o + 64;   /* room to align the caller's buffer */
    return L;
}

size_t lx_layer_work_size(const lx_layer_params *p, const lx_layer_weights *w, const lx_kv_layer *kv,
                          int64_t n_tokens, int n_threads) {
    return plan(p, w, kv, n_tokens, n_threads).total;
}

/* ---- row operations (fixed order per row) ------------------------------------------------- */

/* unit r of lx_rms_norm_grouped: one row of gs values with the weights of its group; its sum of
 * squares s (ggml's order: element after element, in double) */
static void norm_unit(const float *x, const float *g, float *y, int64_t r, int64_t gs, int64_t n_group, float eps,
                      double s) {
    const float *xr = x + r * gs, *gr = g + (r % n_group) * gs;
    float *yr = y + r * gs;
    const float scale = 1.0f / sqrtf((float) (s / (double) gs) + eps);
    for (int64_t i = 0; i < gs; ++i) yr[i] = (xr[i] * scale) * gr[i];
}

static double sq_sum(const float *xr, int64_t gs) {
    double s = 0.0;
    for (int64_t i = 0; i < gs; ++i) s += (double) (xr[i] * xr[i]);
    return s;
}

#ifdef LX_LAYER_X86
/* s[k] = sq_sum of the gs values at row[k], k < 8, the rows in the lanes (each lane's sum in sq_sum's order,
 * so the same bits; a row's chain of dependent double adds is the norm's cost, 8 chains at once here):
 * 8 values of each row, transposed so that vector j holds value i + j of the 8 rows */
__attribute__((target("avx2,fma"))) static void sq_sums8_avx2(const float *const *row, int64_t gs, double *s) {
    __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
    int64_t i = 0;
    for (; i + 8 <= gs; i += 8) {
        __m256 r[8], t[8];
        for (int k = 0; k < 8; ++k) r[k] = _mm256_loadu_ps(row[k] + i);
        for (int k = 0; k < 8; k += 2)
            t[k] = _mm256_unpacklo_ps(r[k], r[k + 1]), t[k + 1] = _mm256_unpackhi_ps(r[k], r[k + 1]);
        /* t[2 m] = values 0, 1 | 4, 5 of rows 2 m, 2 m + 1 interleaved; t[2 m + 1] values 2, 3 | 6, 7 */
        for (int k = 0; k < 8; k += 4)
            for (int h = 0; h < 2; ++h) {
                r[k + 2 * h] = _mm256_shuffle_ps(t[k + h], t[k + h + 2], 0x44);
                r[k + 2 * h + 1] = _mm256_shuffle_ps(t[k + h], t[k + h + 2], 0xEE);
            }
        /* r[4 q + j]: value j of rows 4 q .. 4 q + 3 in the low half, value 4 + j in the high (j < 4) */
        for (int j = 0; j < 8; ++j) {
            const int jj = j & 3, half = j >> 2;
            const __m256 v = half ? _mm256_permute2f128_ps(r[jj], r[4 + jj], 0x31)
                                  : _mm256_permute2f128_ps(r[jj], r[4 + jj], 0x20);
            const __m256 q = _mm256_mul_ps(v, v);
            lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(q)));
            hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(q, 1)));
        }
    }
    double a[8];
    _mm256_storeu_pd(a, lo);
    _mm256_storeu_pd(a + 4, hi);
    for (int k = 0; k < 8; ++k) {
        for (int64_t e = i; e < gs; ++e) a[k] += (double) (row[k][e] * row[k][e]);
        s[k] = a[k];
    }
}
#endif

/* units [8 c, 8 c + 8) of lx_rms_norm_grouped (fewer at the end) */
static void norm_units8(const float *x, const float *g, float *y, int64_t c, int64_t units, int64_t gs,
                        int64_t n_group, float eps) {
    const int64_t r0 = 8 * c, n = units - r0 < 8 ? units - r0 : 8;
    double s[8];
#ifdef LX_LAYER_X86
    if (n >= 2 && lx_simd_level() >= LX_SIMD_AVX2) {   /* (a decode step's per-head norms: 2-8 rows) */
        const float *row[8];
        for (int64_t k = 0; k < 8; ++k) row[k] = x + (r0 + (k < n ? k : n - 1)) * gs;   /* lanes past n: a copy */
        sq_sums8_avx2(row, gs, s);
    } else
#endif
        for (int64_t k = 0; k < n; ++k) s[k] = sq_sum(x + (r0 + k) * gs, gs);
    for (int64_t k = 0; k < n; ++k) norm_unit(x, g, y, r0 + k, gs, n_group, eps, s[k]);
}

void lx_rms_norm_grouped(const float *x, const float *g, float *y, int64_t n_rows, int64_t n, int64_t n_group,
                         float eps, int nt) {
    /* rows of gs values, their weights by group: the rows of lx_rms_norm */
    const int64_t gs = n / n_group, units = n_rows * n_group, n_c = (units + 7) / 8;
    LX_FOR_THREADS(c, n_c, nt, n_rows * n >= 65536, norm_units8(x, g, y, c, units, gs, n_group, eps));
}

void lx_rms_norm_ref(const float *x, const float *g, float *y, int64_t n_rows, int64_t n, float eps) {
    for (int64_t r = 0; r < n_rows; ++r) norm_unit(x, g, y, r, n, 1, eps, sq_sum(x + r * n, n));
}

void lx_rms_norm(const float *x, const float *g, float *y, int64_t n_rows, int64_t n, float eps, int nt) {
    lx_rms_norm_grouped(x, g, y, n_rows, n, 1, eps, nt);
}

static void add_rows(float *x, const float *d, int64_t count) {
    for (int64_t i = 0; i < count; ++i) x[i] += d[i];
}

/* y = rms_norm(x) * g, or a copy of x when the layer has no such norm (g NULL) */
static void norm_or_copy(const float *x, const float *g, float *y, int64_t n_rows, int64_t n, float eps, int nt) {
    if (g) lx_rms_norm(x, g, y, n_rows, n, eps, nt);
    else memcpy(y, x, (size_t) (n_rows * n) * sizeof(float));
}

/* x [n] times s (ggml_scale) */
static void scale_row(float *x, int64_t n, float s) {
    for (int64_t i = 0; i < n; ++i) x[i] *= s;
}

/* x [n_rows][n] times s */
static void scale_rows(float *x, int64_t n_rows, int64_t n, float s, int nt) {
    LX_FOR_THREADS(r, n_rows, nt, n_rows >= LX_ROWS_PARALLEL, scale_row(x + r * n, n, s));
}

/* a block's output o [n_rows][n] into the residual x: each row of o times the residual scale, then added
 * (one pass over the rows) */
static void add_block(float *x, float *o, int64_t n_rows, int64_t n, float scale, int nt) {
    LX_FOR_THREADS(r, n_rows, nt, n_rows >= LX_ROWS_PARALLEL, {
        if (scale != 1.0f) scale_row(o + r * n, n, scale);
        add_rows(x + r * n, o + r * n, n);
    });
}

/* the f16 GELU table at the gate's f16 rounding (0 at or below -10, g at or above 10) */
static float gelu_scalar(const float *table, float g) {
    return g <= -10.0f ? 0.0f : g >= 10.0f ? g : table[lx_fp32_to_fp16(g)];
}

#ifdef LX_LAYER_X86
/* the GELU table's lanes: the gate rounded to f16 (F16C, nearest even as lx_fp32_to_fp16), gathered */
__attribute__((target("avx2,fma,f16c"))) static void gelu_mul_avx2(const float *table, const float *g, const float *u,
                                                                     float *y, int64_t f) {
    const __m256 lo = _mm256_set1_ps(-10.0f), hi = _mm256_set1_ps(10.0f);
    int64_t i = 0;
    for (; i + 8 <= f; i += 8) {
        const __m256 gv = _mm256_loadu_ps(g + i);
        const __m256i idx = _mm256_cvtepu16_epi32(_mm256_cvtps_ph(gv, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        __m256 a = _mm256_i32gather_ps(table, idx, 4);
        a = _mm256_blendv_ps(a, gv, _mm256_cmp_ps(gv, hi, _CMP_GE_OQ));
        a = _mm256_andnot_ps(_mm256_cmp_ps(gv, lo, _CMP_LE_OQ), a);
        _mm256_storeu_ps(y + i, _mm256_mul_ps(a, _mm256_loadu_ps(u + i)));
    }
    for (; i < f; ++i) y[i] = gelu_scalar(table, g[i]) * u[i];
}
#endif

void lx_gated_ref(lx_layer_act kind, const float *gelu_table, const float *gu, float *act, int64_t n_rows,
                  int64_t f) {
    for (int64_t r = 0; r < n_rows; ++r) {
        const float *g = gu + r * 2 * f, *u = g + f;
        float *y = act + r * f;
        for (int64_t i = 0; i < f; ++i)
            y[i] = (kind == LX_ACT_SILU ? lx_silu_ref(g[i]) : gelu_scalar(gelu_table, g[i])) * u[i];
    }
}

/* columns [c0, c1) of row r of lx_gated (each value on its own: any split gives the same bits) */
static void gated_cols(lx_layer_act kind, const float *gelu_table, const float *gu, float *act, int64_t r, int64_t f,
                       int64_t c0, int64_t c1) {
    const float *g = gu + r * 2 * f + c0, *u = g + f;
    float *y = act + r * f + c0;
#ifdef LX_LAYER_X86
    if (lx_simd_level() >= LX_SIMD_AVX2) {
        if (kind == LX_ACT_SILU) lx_silu_mul_avx2(g, u, y, c1 - c0);
        else gelu_mul_avx2(gelu_table, g, u, y, c1 - c0);
        return;
    }
#endif
    for (int64_t i = 0; i < c1 - c0; ++i)
        y[i] = (kind == LX_ACT_SILU ? lx_silu_ref(g[i]) : gelu_scalar(gelu_table, g[i])) * u[i];
}

/* row r of lx_gated */
static void gated_row(lx_layer_act kind, const float *gelu_table, const float *gu, float *act, int64_t r, int64_t f) {
    gated_cols(kind, gelu_table, gu, act, r, f, 0, f);
}

void lx_gated(lx_layer_act kind, const float *gelu_table, const float *gu, float *act, int64_t n_rows,
              int64_t f, int nt) {
    LX_FOR_THREADS(r, n_rows, nt, n_rows * f >= 65536, gated_row(kind, gelu_table, gu, act, r, f));
}

/* one part: product.h's engine for its type and layout */
static void part_product(const lx_linear *l, int i, const float *x, float *y, int64_t n, int64_t n_out,
                         void *gw, int nt) {
    lx_product(l->w[i], l->type[i], l->r8[i], x, y, n, l->n_in, n_out, gw, nt);
}

/* y's columns [c0, c0 + r) of each of n rows <- the part's product tmp [n][r] */
static void put_part(const lx_linear *l, float *y, const float *tmp, int64_t n, int64_t c0, int64_t r) {
    for (int64_t t = 0; t < n; ++t) memcpy(y + t * l->n_out + c0, tmp + t * r, (size_t) r * sizeof(float));
}

void lx_linear_product(const lx_linear *l, const float *x, float *y, int64_t n, float *tmp, void *gw, int nt) {
    if (l->n_parts == 1) {
        part_product(l, 0, x, y, n, l->n_out, gw, nt);
        return;
    }
    int64_t c0 = 0;
    for (int i = 0; i < l->n_parts; ++i) {
        const int64_t r = l->rows[i];
        part_product(l, i, x, tmp, n, r, gw, nt);
        put_part(l, y, tmp, n, c0, r);
        c0 += r;
    }
}

/* qkv [n][cols] += b per row (ggml_add of the bias) */
static void add_bias(float *qkv, const float *b, int64_t n, int64_t cols) {
    for (int64_t t = 0; t < n; ++t)
        for (int64_t c = 0; c < cols; ++c) qkv[t * cols + c] += b[c];
}

/* the rows [n][nq + nk + nv] of qkv as dense q [n][nq], k [n][nk], v [n][nv] */
static void split_qkv(const float *qkv, int64_t nq, int64_t nk, int64_t nv, float *q, float *k, float *v, int64_t n,
                      int nt) {
    const int64_t ld = nq + nk + nv;
    LX_FOR_THREADS(t, n, nt, n >= LX_ROWS_PARALLEL, {
        memcpy(q + t * nq, qkv + t * ld, (size_t) nq * sizeof(float));
        memcpy(k + t * nk, qkv + t * ld + nq, (size_t) nk * sizeof(float));
        memcpy(v + t * nv, qkv + t * ld + nq + nk, (size_t) nv * sizeof(float));
    });
}

/* ---- the cache ---------------------------------------------------------------------------- */

/* rows src [n][n_head_kv * d] into the cells: part p (n / n_stream tokens) into stream p (the
 * memory gives every token its own cell, so the threads of lx_set_rows never meet) */
static void store_rows(lx_type t, const float *src, void *base, int64_t kv_size, int64_t row, const uint32_t *idxs,
                       int64_t n, int64_t n_stream, int nt) {
    const int64_t per = n / n_stream;
    const size_t rb = lx_row_bytes(t, row), sb = (size_t) kv_size * rb;
    for (int64_t s = 0; s < n_stream; ++s) {
        const uint32_t *ix = idxs + s * per;
        lx_set_rows(t, src + s * per * row, (uint8_t *) base + s * sb, ix, per, row, per > 64 ? nt : 1);
    }
}

/* v [n][n_head_kv][d_v] into V^T [n_stream][n_head_kv][d_v][kv_size] (f32 or f16) */
static void store_vtrans(lx_type t, const float *v, void *base, int64_t kv_size, int64_t nh, int64_t d,
                         const uint32_t *idxs, int64_t n, int64_t n_stream) {
    const int64_t per = n / n_stream;
    for (int64_t s = 0; s < n_stream; ++s)
        for (int64_t i = 0; i < per; ++i) {
            const int64_t tok = s * per + i, cell = idxs[tok];
            const float *src = v + tok * nh * d;
            for (int64_t c = 0; c < nh * d; ++c) {
                const size_t at = ((size_t) s * nh * d + (size_t) c) * (size_t) kv_size + (size_t) cell;
                if (t == LX_TYPE_F32) ((float *) base)[at] = src[c];
                else ((uint16_t *) base)[at] = lx_fp32_to_fp16(src[c]);
            }
        }
}

/* ---- the layer ---------------------------------------------------------------------------- */

/* ---- a crew's steps (team.h) ----------------------------------------------------------------- */

/* stmt by the crew's first member, then a barrier (a crew of one: stmt) */
#define SOLO(c, stmt) do { if ((c)->tid == 0) { stmt; } lx_crew_sync(c); } while (0)

/* y = x W^T over every part of l: a team prepares each part's activations on its first member and
 * shares its output tiles; a crew of one runs lx_linear_product over nt threads */
static void crew_linear(lx_crew *c, const lx_linear *l, const float *x, float *y, int64_t n, float *tmp, void *gw,
                        int nt) {
    if (!c->team) {
        lx_linear_product(l, x, y, n, tmp, gw, nt);
        return;
    }
    int64_t c0 = 0;
    for (int i = 0; i < l->n_parts; ++i) {
        const int64_t r = l->rows[i];
        float *dst = l->n_parts == 1 ? y : tmp;
        SOLO(c, lx_gemm_small_prepare(l->type[i], x, n, l->n_in, gw));
        int64_t i0, i1;
        lx_crew_share(c, lx_gemm_small_tiles(r), &i0, &i1);
        lx_gemm_small_run(l->w[i], l->type[i], l->r8[i], dst, n, l->n_in, r, gw, i0, i1);
        lx_crew_sync(c);
        if (l->n_parts > 1) SOLO(c, put_part(l, y, tmp, n, c0, r));
        c0 += r;
    }
}

/* 1 if a team may run this layer for n tokens: every product has the few-token halves (gemm.h) and
 * the layer takes none of the paths the team leaves to lx_layer_forward (MoE, Hadamard rows, V^T) */
static int team_takes(const lx_layer_weights *w, const lx_kv_layer *kv, int64_t n) {
    if (w->moe || kv->rot_k || kv->rot_v || kv->v_trans) return 0;
    const lx_linear *all[4] = {&w->wqkv, &w->wo, &w->w_gate_up, &w->w_down};
    for (int j = 0; j < 4; ++j)
        for (int i = 0; i < all[j]->n_parts; ++i)
            if (!lx_gemm_small_ok(all[j]->type[i], n)) return 0;   /* (0 for the float product's types) */
    return 1;
}

static int team_enabled = 1;
static int64_t team_runs;

void lx_layer_set_team(int on) { __atomic_store_n(&team_enabled, on != 0, __ATOMIC_RELAXED); }

int64_t lx_layer_team_runs(void) { return __atomic_load_n(&team_runs, __ATOMIC_RELAXED); }

/* ---- the layer ---------------------------------------------------------------------------- */

/* the layer, run by every member of crew c (checked arguments); nt: the threads of the caller
 * (the work layout's), each step of a crew of one runs over them */
static lx_status layer_body(lx_crew *c, const lx_layer_params *p, const lx_layer_weights *w,
                            const lx_kv_layer *kv, float *x, int64_t n, const lx_pos *pos,
                            const int64_t *out_rows, int64_t n_out_rows, void *work, int nt) {
    const layout L = plan(p, w, kv, n, nt);
    const int ns = c->team ? 1 : nt;     /* threads of a step run whole (by a team's first member) */
    uint8_t *base = (uint8_t *) (((uintptr_t) work + 63) & ~(uintptr_t) 63);
#define BUF(i) ((float *) (base + L.off[i]))
    float *h = BUF(B_H), *qkv = BUF(B_QKV), *q = BUF(B_Q), *k = BUF(B_K), *v = BUF(B_V), *a = BUF(B_A);
    float *o = BUF(B_O), *gu = BUF(B_GU), *act = BUF(B_ACT), *tmp = BUF(B_TMP), *scratch = BUF(B_SCRATCH);
#undef BUF
    void *gw = base + L.off[B_GEMM], *mw = base + L.off[B_MOE];
    const int64_t E = p->n_embd;

    /* attention block */
    SOLO(c, norm_or_copy(x, w->attn_norm, h, n, E, p->eps, ns));
    crew_linear(c, &w->wqkv, h, qkv, n, tmp, gw, nt);
    if (c->tid == 0) {
        if (w->bqkv) add_bias(qkv, w->bqkv, n, L.nqkv);
        split_qkv(qkv, L.nq, L.nk, L.nv, q, k, v, n, ns);
        if (p->qk_norm_full) {
            if (w->q_norm) lx_rms_norm(q, w->q_norm, q, n, L.nq, p->eps, ns);
            if (w->k_norm) lx_rms_norm(k, w->k_norm, k, n, L.nk, p->eps, ns);
        } else {
            if (w->q_norm) lx_rms_norm(q, w->q_norm, q, n * p->n_head, p->d_k, p->eps, ns);
            if (w->k_norm) lx_rms_norm(k, w->k_norm, k, n * p->n_head_kv, p->d_k, p->eps, ns);
        }
        if (p->rope.n_rot) {
            lx_rope_f32(&p->rope, q, pos, n, p->n_head, p->d_k, ns);
            lx_rope_f32(&p->rope, k, pos, n, p->n_head_kv, p->d_k, ns);
        }
        if (p->q_scale != 1.0f) scale_rows(q, n, L.nq, p->q_scale, ns);

        /* K/V into the cells (rotated rows for a quantized cache with a Hadamard block) */
        if (kv->rot_k) lx_hadamard_rows(k, n, L.nk, kv->rot_k, ns);
        if (kv->rot_v) lx_hadamard_rows(v, n, L.nv, kv->rot_v, ns);
        store_rows(kv->type_k, k, kv->k, kv->kv_size, L.nk, kv->idxs, n, kv->n_stream, ns);
        if (kv->v_trans) store_vtrans(kv->type_v, v, kv->v, kv->kv_size, p->n_head_kv, p->d_v, kv->idxs, n, kv->n_stream);
        else store_rows(kv->type_v, v, kv->v, kv->kv_size, L.nv, kv->idxs, n, kv->n_stream, ns);

        /* attention over the cache (in the rotated frame of K; V's rotation undone on the output) */
        if (kv->rot_k) lx_hadamard_rows(q, n, L.nq, kv->rot_k, ns);
    }
    lx_crew_sync(c);

    const lx_attn_params ap = attn_params(p, kv, n);
    const float *mask = kv->n_kv ? kv->mask : NULL;
    float *sp = L.n_scratch ? scratch : NULL;
    if (c->team) lx_attn_flash_crew(&ap, q, kv->k, kv->v, mask, a, sp, L.n_scratch, c);
    else if (kv->v_trans) lx_attn_vtrans(&ap, q, kv->k, kv->v, mask, a, sp, L.n_scratch, nt);
    else lx_attn_flash(&ap, q, kv->k, kv->v, mask, a, sp, L.n_scratch, nt);
    const int64_t nhv = p->n_head * p->d_v;
    if (kv->rot_v) lx_hadamard_rows(a, n, nhv, kv->rot_v, nt);   /* (not in a team: team_takes) */

    /* only the rows that go on (last layer) */
    int64_t m = n;
    if (out_rows) {
        if (c->tid == 0)
            for (int64_t i = 0; i < n_out_rows; ++i) {
                const int64_t r = out_rows[i];
                if (r != i) {
                    memmove(a + i * nhv, a + r * nhv, (size_t) nhv * sizeof(float));
                    memmove(x + i * E, x + r * E, (size_t) E * sizeof(float));
                }
            }
        lx_crew_sync(c);
        m = n_out_rows;
        if (m == 0) return LX_OK;
    }

    crew_linear(c, &w->wo, a, o, m, tmp, gw, nt);

    /* feed-forward block */
    SOLO(c, {
        if (w->post_attn_norm) lx_rms_norm(o, w->post_attn_norm, o, m, E, p->eps, ns);
        add_block(x, o, m, E, p->residual_scale, ns);
        norm_or_copy(x, w->ffn_norm, h, m, E, p->eps, ns);
    });
    if (w->moe) {
        const lx_status st = lx_moe_ffn(&p->moe, w->moe, h, o, m, mw, nt);   /* (not in a team: team_takes) */
        if (st != LX_OK) return st;   /* not reached: valid() checked the MoE */
    } else {
        crew_linear(c, &w->w_gate_up, h, gu, m, tmp, gw, nt);
        if (c->team) {                            /* each member a share of the columns (8 at a time) */
            int64_t j0, j1;
            lx_crew_share(c, (p->n_ff + 7) / 8, &j0, &j1);
            const int64_t c0 = 8 * j0, c1 = 8 * j1 < p->n_ff ? 8 * j1 : p->n_ff;
            if (c0 < c1)
                for (int64_t r = 0; r < m; ++r) gated_cols(p->act, p->gelu_table, gu, act, r, p->n_ff, c0, c1);
            lx_crew_sync(c);
        } else {
            lx_gated(p->act, p->gelu_table, gu, act, m, p->n_ff, nt);
        }
        crew_linear(c, &w->w_down, act, o, m, tmp, gw, nt);
    }
    SOLO(c, {
        if (w->post_ffw_norm) lx_rms_norm(o, w->post_ffw_norm, o, m, E, p->eps, ns);
        add_block(x, o, m, E, p->residual_scale, ns);
    });
    return LX_OK;
}

static int rows_valid(const int64_t *out_rows, int64_t n_out_rows, int64_t n) {
    if (!out_rows) return 1;
    if (n_out_rows < 0 || n_out_rows > n) return 0;
    for (int64_t i = 0; i < n_out_rows; ++i)
        if (out_rows[i] < 0 || out_rows[i] >= n || (i && out_rows[i] <= out_rows[i - 1])) return 0;
    return 1;
}

lx_status lx_layer_forward(const lx_layer_params *p, const lx_layer_weights *w, const lx_kv_layer *kv,
                           float *x, int64_t n, const lx_pos *pos, const int64_t *out_rows,
                           int64_t n_out_rows, void *work, int nt) {
    if (!valid(p, w, kv, n) || !x || !pos || !work || nt < 1 || !rows_valid(out_rows, n_out_rows, n))
        return LX_ERR_INVALID;
    lx_crew solo = lx_crew_solo();
    return layer_body(&solo, p, w, kv, x, n, pos, out_rows, n_out_rows, work, nt);
}

lx_status lx_layers_forward(const lx_layer_params *p, const lx_layer_weights *w, const lx_kv_layer *kv,
                            int n_layer, float *x, int64_t n, const lx_pos *pos, const int64_t *out_rows,
                            int64_t n_out_rows, void *work, int nt, int *failed) {
    *failed = -1;
    int team = __atomic_load_n(&team_enabled, __ATOMIC_RELAXED) && lx_team_fits(nt) && n_layer > 0;
    for (int il = 0; il < n_layer; ++il) {
        if (!valid(&p[il], &w[il], &kv[il], n)) {
            *failed = il;
            return LX_ERR_INVALID;
        }
        team = team && team_takes(&w[il], &kv[il], n);
    }
    if (!x || !pos || !work || nt < 1 || !rows_valid(out_rows, n_out_rows, n)) {
        *failed = n_layer - 1;
        return LX_ERR_INVALID;
    }
#ifdef _OPENMP
    if (team) {
        __atomic_add_fetch(&team_runs, 1, __ATOMIC_RELAXED);
        lx_team t;
        #pragma omp parallel num_threads(nt)
        {
            #pragma omp single
            lx_team_init(&t, omp_get_num_threads());   /* (the threads the region got; then a barrier) */
            lx_crew c = lx_crew_join(&t, omp_get_thread_num());
            for (int il = 0; il < n_layer; ++il) {
                const int last = il == n_layer - 1;
                layer_body(&c, &p[il], &w[il], &kv[il], x, n, pos, last ? out_rows : NULL, last ? n_out_rows : 0,
                           work, nt);
            }
        }
        return LX_OK;
    }
#endif
    lx_crew solo = lx_crew_solo();
    for (int il = 0; il < n_layer; ++il) {
        const int last = il == n_layer - 1;
        const lx_status st = layer_body(&solo, &p[il], &w[il], &kv[il], x, n, pos, last ? out_rows : NULL,
                                        last ? n_out_rows : 0, work, nt);
        if (st != LX_OK) {
            *failed = il;
            return st;
        }
    }
    return LX_OK;
}
