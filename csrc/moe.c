/* moe.c: the mixture-of-experts feed-forward (see moe.h). Composes product.c (every weight
 * product) and layer.c's gated activation; holds no policy.
 *
 *   work = | logits | ids | wts | off | cur | slot | tok | units | d | scratch |
 *
 *   logits [n][n_expert]  router output, then the gating probabilities in place
 *   ids, wts [n][n_used]  the routing
 *   off [n_expert + 1]    expert e's rows of d are [off[e], off[e + 1]) (cur: the fill cursor)
 *   slot [n][n_used]      the row of d of token t's slot k;  tok [n n_used]: the token of a row of d
 *   units [n_units][2]    (expert, first row of d): a routed expert's rows in runs of at most
 *                         LX_MOE_CHUNK, experts ascending
 *   d [n n_used][n_embd]  the down products, grouped by expert, ascending token order within one
 *   scratch               the router's product work; then one expert's scratch (n rows, the
 *                         products over n_threads) or n_threads of them (LX_MOE_CHUNK rows each,
 *                         one thread per unit): | xg | g | u | gu | product work |
 */
#include "moe.h"

#include "gemm.h"
#include "layer.h"
#include "product.h"
#include "vexp.h"

#include <math.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#define ALIGN(n) (((size_t) (n) + 63) & ~(size_t) 63)

/* where e^-l is taken as +inf in the sigmoid (vexp.h clamps above 88.38) */
#define MOE_EXP_INF 88.0f
/* ggml_clamp's floor of the norm_w sum: the smallest normal f16, 2^-14 */
#define MOE_SUM_MIN 6.103515625e-5f

/* ---- shapes ------------------------------------------------------------------------------- */

static int experts_ok(const lx_experts *x, int64_t rows, int64_t n_in) {
    if (!x->w || x->rows != rows) return 0;
    if (lx_product_kind_of(x->type, x->r8) == LX_PRODUCT_NONE) return 0;
    if (n_in % lx_type_block_size(x->type)) return 0;
    const size_t need = x->r8 ? lx_gemm_r8_bytes(x->type, n_in, rows) : (size_t) rows * lx_row_bytes(x->type, n_in);
    return x->expert_bytes >= need;
}

int lx_moe_valid(const lx_moe_params *p, const lx_moe_weights *w) {
    if (!p || !w) return 0;
    if (p->n_embd < 1 || p->n_ff_exp < 1 || p->n_expert < 1 || p->n_used < 1 || p->n_used > p->n_expert) return 0;
    if (p->gating != LX_MOE_SOFTMAX && p->gating != LX_MOE_SIGMOID) return 0;
    if (p->act == LX_ACT_GELU_TABLE ? !p->gelu_table : p->act != LX_ACT_SILU) return 0;
    if (!w->router || lx_product_kind_of(w->router_type, w->router_r8) == LX_PRODUCT_NONE) return 0;
    if (p->n_embd % lx_type_block_size(w->router_type)) return 0;
    return experts_ok(&w->gate, p->n_ff_exp, p->n_embd) && experts_ok(&w->up, p->n_ff_exp, p->n_embd) &&
           experts_ok(&w->down, p->n_embd, p->n_ff_exp);
}

typedef struct {
    size_t logits, ids, wts, off, cur, slot, tok, units, d, scratch, total;
} layout;

/* the scratch of one expert's rows (rows at most r, products over nt threads) */
typedef struct {
    size_t xg, g, u, gu, pw, total;
} scratch_layout;

static size_t max_sz(size_t a, size_t b) { return a > b ? a : b; }

static scratch_layout scratch_plan(const lx_moe_params *p, const lx_moe_weights *w, int64_t r, int nt) {
    const int64_t E = p->n_embd, F = p->n_ff_exp;
    scratch_layout s;
    size_t at = 0;
    s.xg = at; at += ALIGN((size_t) (r * E) * sizeof(float));
    s.g = at; at += ALIGN((size_t) (r * F) * sizeof(float));
    s.u = at; at += ALIGN((size_t) (r * F) * sizeof(float));
    s.gu = at; at += ALIGN((size_t) (r * 2 * F) * sizeof(float));
    s.pw = at;
    size_t pw = lx_product_work_size(w->gate.type, w->gate.r8, r, E, nt);
    pw = max_sz(pw, lx_product_work_size(w->up.type, w->up.r8, r, E, nt));
    pw = max_sz(pw, lx_product_work_size(w->down.type, w->down.r8, r, F, nt));
    pw = max_sz(pw, lx_product_work_size(w->router_type, w->router_r8, r, E, nt));   /* the reference's router */
    at += ALIGN(pw);
    s.total = at;
    return s;
}

static int64_t chunk_rows(int64_t n) { return n < LX_MOE_CHUNK ? n : LX_MOE_CHUNK; }

/* most units: one per routed expert, plus one per LX_MOE_CHUNK rows of d */
static int64_t max_units(const lx_moe_params *p, int64_t n) {
    const int64_t N = n * p->n_used, X = p->n_expert;
    return (N < X ? N : X) + N / LX_MOE_CHUNK;
}

static layout plan(const lx_moe_params *p, const lx_moe_weights *w, int64_t n, int nt) {
    const int64_t N = n * p->n_used, X = p->n_expert;
    layout L;
    size_t at = 0;
    L.logits = at; at += ALIGN((size_t) (n * X) * sizeof(float));
    L.ids = at; at += ALIGN((size_t) N * sizeof(int32_t));
    L.wts = at; at += ALIGN((size_t) N * sizeof(float));
    L.off = at; at += ALIGN((size_t) (X + 1) * sizeof(int64_t));
    L.cur = at; at += ALIGN((size_t) X * sizeof(int64_t));
    L.slot = at; at += ALIGN((size_t) N * sizeof(int32_t));
    L.tok = at; at += ALIGN((size_t) N * sizeof(int32_t));
    L.units = at; at += ALIGN((size_t) (2 * max_units(p, n)) * sizeof(int32_t));
    L.d = at; at += ALIGN((size_t) (N * p->n_embd) * sizeof(float));
    L.scratch = at;
    /* the router's work over n tokens, then the experts' scratch: one of n rows (sequential
     * experts), n_threads of LX_MOE_CHUNK rows (parallel units), or one row single-threaded
     * (the reference, whose router product runs in it) */
    size_t s = lx_product_work_size(w->router_type, w->router_r8, n, p->n_embd, nt);
    s = max_sz(s, scratch_plan(p, w, n, nt).total);
    if (nt > 1) s = max_sz(s, (size_t) nt * scratch_plan(p, w, chunk_rows(n), 1).total);
    s = max_sz(s, scratch_plan(p, w, 1, 1).total);
    at += ALIGN(s);
    L.total = at;
    return L;
}

size_t lx_moe_work_size(const lx_moe_params *p, const lx_moe_weights *w, int64_t n, int nt) {
    if (n < 1) n = 1;
    if (nt < 1) nt = 1;
    return plan(p, w, n, nt).total + 64;   /* + 64: the base is aligned up */
}

static uint8_t *aligned(void *work) { return (uint8_t *) (((uintptr_t) work + 63) & ~(uintptr_t) 63); }

/* ---- routing ------------------------------------------------------------------------------ */

/* p [n_expert]: the logits in, the gating probabilities out; ids, wts [n_used]: the top-k */
static void route_row(const lx_moe_params *p, float *l, int32_t *ids, float *wts) {
    const int64_t X = p->n_expert, K = p->n_used;
    if (p->gating == LX_MOE_SOFTMAX) {
        float mx = -INFINITY;
        for (int64_t e = 0; e < X; ++e) mx = l[e] > mx ? l[e] : mx;   /* ggml_vec_max_f32 */
        double sum = 0.0;
        for (int64_t e = 0; e < X; ++e) {
            l[e] = lx_exp_ref(l[e] - mx);
            sum += (double) l[e];
        }
        const float inv = (float) (1.0 / sum);
        for (int64_t e = 0; e < X; ++e) l[e] *= inv;
    } else {
        for (int64_t e = 0; e < X; ++e) {
            const float ex = -l[e] > MOE_EXP_INF ? INFINITY : lx_exp_ref(-l[e]);
            l[e] = 1.0f / (1.0f + ex);
        }
    }
    /* top-k by insertion: descending, an equal value stays behind the lower id already placed */
    int64_t have = 0;
    for (int64_t e = 0; e < X; ++e) {
        const float v = l[e];
        int64_t at = have;
        while (at > 0 && v > wts[at - 1]) --at;
        if (at == K) continue;
        const int64_t last = have < K ? have : K - 1;
        for (int64_t j = last; j > at; --j) {
            ids[j] = ids[j - 1];
            wts[j] = wts[j - 1];
        }
        ids[at] = (int32_t) e;
        wts[at] = v;
        if (have < K) ++have;
    }
    if (p->norm_w) {
        double s = 0.0;
        for (int64_t k = 0; k < K; ++k) s += (double) wts[k];   /* ggml_sum_rows */
        float sf = (float) s;
        sf = sf < MOE_SUM_MIN ? MOE_SUM_MIN : sf;
        for (int64_t k = 0; k < K; ++k) wts[k] = wts[k] / sf;
    }
    if (p->w_scale != 0.0f && p->w_scale != 1.0f)
        for (int64_t k = 0; k < K; ++k) wts[k] *= p->w_scale;
}

/* logits of every token (one product over n tokens), then each token's routing */
static void route(const lx_moe_params *p, const lx_moe_weights *w, const float *x, int64_t n, float *logits,
                  int32_t *ids, float *wts, void *pw, int nt) {
    lx_product(w->router, w->router_type, w->router_r8, x, logits, n, p->n_embd, p->n_expert, pw, nt);
    const int64_t X = p->n_expert, K = p->n_used;
#ifdef _OPENMP
    if (nt > 1 && n * X >= 65536) {   /* (an if clause would open a one-thread team: ~0.65 us) */
#pragma omp parallel for num_threads(nt) schedule(static)
        for (int64_t t = 0; t < n; ++t) route_row(p, logits + t * X, ids + t * K, wts + t * K);
        return;
    }
#endif
    for (int64_t t = 0; t < n; ++t) route_row(p, logits + t * X, ids + t * K, wts + t * K);
}

/* ---- the experts -------------------------------------------------------------------------- */

static const void *expert_w(const lx_experts *x, int64_t e) {
    return (const uint8_t *) x->w + (size_t) e * x->expert_bytes;
}

/* d [c][n_embd] = down_e(act(gate_e(xg)) * up_e(xg)) for xg [c][n_embd] (in the scratch at base) */
static void run_expert(const lx_moe_params *p, const lx_moe_weights *w, int64_t e, int64_t c, uint8_t *base,
                       const scratch_layout *S, float *d, int nt, int ref) {
    const int64_t E = p->n_embd, F = p->n_ff_exp;
    const float *xg = (const float *) (base + S->xg);
    float *g = (float *) (base + S->g), *u = (float *) (base + S->u), *gu = (float *) (base + S->gu);
    void *pw = base + S->pw;
    lx_product(expert_w(&w->gate, e), w->gate.type, w->gate.r8, xg, g, c, E, F, pw, nt);
    lx_product(expert_w(&w->up, e), w->up.type, w->up.r8, xg, u, c, E, F, pw, nt);
    for (int64_t i = 0; i < c; ++i) {
        memcpy(gu + i * 2 * F, g + i * F, (size_t) F * sizeof(float));
        memcpy(gu + i * 2 * F + F, u + i * F, (size_t) F * sizeof(float));
    }
    if (ref) lx_gated_ref((lx_layer_act) p->act, p->gelu_table, gu, g, c, F);
    else lx_gated((lx_layer_act) p->act, p->gelu_table, gu, g, c, F, nt);
    lx_product(expert_w(&w->down, e), w->down.type, w->down.r8, g, d, c, F, E, pw, nt);
}

/* y[t] = ((d_0 w_0 + d_1 w_1) + d_2 w_2) + ...: one float multiply per term, added in slot order */
static void reduce_row(float *y, const float *d, const int32_t *slot, const float *wts, int64_t K, int64_t E) {
    const float *d0 = d + (size_t) slot[0] * E;
    for (int64_t i = 0; i < E; ++i) y[i] = d0[i] * wts[0];
    for (int64_t k = 1; k < K; ++k) {
        const float *dk = d + (size_t) slot[k] * E;
        const float wk = wts[k];
        for (int64_t i = 0; i < E; ++i) y[i] = y[i] + dk[i] * wk;
    }
}

static int args_ok(const lx_moe_params *p, const lx_moe_weights *w, const float *x, const void *out, int64_t n,
                   const void *work, int nt) {
    return lx_moe_valid(p, w) && x && out && work && n >= 0 && nt >= 1;
}

lx_status lx_moe_route(const lx_moe_params *p, const lx_moe_weights *w, const float *x, int64_t n, int32_t *ids,
                       float *wts, void *work, int nt) {
    if (!args_ok(p, w, x, ids, n, work, nt) || !wts) return LX_ERR_INVALID;
    if (n == 0) return LX_OK;
    const layout L = plan(p, w, n, nt);
    uint8_t *base = aligned(work);
    route(p, w, x, n, (float *) (base + L.logits), ids, wts, base + L.scratch, nt);
    return LX_OK;
}

lx_status lx_moe_ffn(const lx_moe_params *p, const lx_moe_weights *w, const float *x, float *y, int64_t n,
                     void *work, int nt) {
    if (!args_ok(p, w, x, y, n, work, nt)) return LX_ERR_INVALID;
    if (n == 0) return LX_OK;
    const int64_t E = p->n_embd, X = p->n_expert, K = p->n_used;
    const layout L = plan(p, w, n, nt);
    uint8_t *base = aligned(work);
    int32_t *ids = (int32_t *) (base + L.ids), *slot = (int32_t *) (base + L.slot), *tok = (int32_t *) (base + L.tok);
    int32_t *units = (int32_t *) (base + L.units);
    int64_t *off = (int64_t *) (base + L.off), *cur = (int64_t *) (base + L.cur);
    float *wts = (float *) (base + L.wts), *d = (float *) (base + L.d);
    uint8_t *scratch = base + L.scratch;

    route(p, w, x, n, (float *) (base + L.logits), ids, wts, scratch, nt);

    /* group the (token, slot) pairs by expert, tokens ascending within an expert */
    memset(off, 0, (size_t) (X + 1) * sizeof(int64_t));
    for (int64_t i = 0; i < n * K; ++i) off[ids[i] + 1]++;
    for (int64_t e = 0; e < X; ++e) {
        off[e + 1] += off[e];
        cur[e] = off[e];
    }
    for (int64_t t = 0; t < n; ++t)
        for (int64_t k = 0; k < K; ++k) {
            const int64_t r = cur[ids[t * K + k]]++;
            slot[t * K + k] = (int32_t) r;
            tok[r] = (int32_t) t;
        }
    int64_t n_units = 0;
    for (int64_t e = 0; e < X; ++e)
        for (int64_t r0 = off[e]; r0 < off[e + 1]; r0 += LX_MOE_CHUNK) {
            units[2 * n_units] = (int32_t) e;
            units[2 * n_units + 1] = (int32_t) r0;
            ++n_units;
        }

    if (nt > 1 && n_units >= nt) {
        /* enough units for every thread: one thread per unit (products single-threaded), one
         * parallel region for all of them */
        const scratch_layout S = scratch_plan(p, w, chunk_rows(n), 1);
#ifdef _OPENMP
#pragma omp parallel for num_threads(nt) schedule(static)
#endif
        for (int64_t i = 0; i < n_units; ++i) {
#ifdef _OPENMP
            uint8_t *mine = scratch + (size_t) omp_get_thread_num() * S.total;
#else
            uint8_t *mine = scratch;
#endif
            const int64_t e = units[2 * i], r0 = units[2 * i + 1];
            const int64_t c = off[e + 1] - r0 < LX_MOE_CHUNK ? off[e + 1] - r0 : LX_MOE_CHUNK;
            float *xg = (float *) (mine + S.xg);
            for (int64_t j = 0; j < c; ++j) memcpy(xg + j * E, x + (size_t) tok[r0 + j] * E, (size_t) E * sizeof(float));
            run_expert(p, w, e, c, mine, &S, d + (size_t) r0 * E, 1, 0);
        }
    } else {
        /* one expert after the other, all its rows in one product over the threads */
        const scratch_layout S = scratch_plan(p, w, n, nt);
        float *xg = (float *) (scratch + S.xg);
        for (int64_t e = 0; e < X; ++e) {
            const int64_t r0 = off[e], c = off[e + 1] - r0;
            if (!c) continue;
            for (int64_t j = 0; j < c; ++j) memcpy(xg + j * E, x + (size_t) tok[r0 + j] * E, (size_t) E * sizeof(float));
            run_expert(p, w, e, c, scratch, &S, d + (size_t) r0 * E, nt, 0);
        }
    }

    /* x is read: y (possibly x itself) takes the weighted sums */
#ifdef _OPENMP
    if (nt > 1 && n * K * E >= 65536) {
#pragma omp parallel for num_threads(nt) schedule(static)
        for (int64_t t = 0; t < n; ++t) reduce_row(y + t * E, d, slot + t * K, wts + t * K, K, E);
        return LX_OK;
    }
#endif
    for (int64_t t = 0; t < n; ++t) reduce_row(y + t * E, d, slot + t * K, wts + t * K, K, E);
    return LX_OK;
}

lx_status lx_moe_ffn_ref(const lx_moe_params *p, const lx_moe_weights *w, const float *x, float *y, int64_t n,
                         void *work) {
    if (!args_ok(p, w, x, y, n, work, 1)) return LX_ERR_INVALID;
    if (n == 0) return LX_OK;
    const int64_t E = p->n_embd, K = p->n_used;
    const layout L = plan(p, w, n, 1);
    uint8_t *base = aligned(work);
    float *logits = (float *) (base + L.logits), *wts = (float *) (base + L.wts), *d = (float *) (base + L.d);
    int32_t *ids = (int32_t *) (base + L.ids), *slot = (int32_t *) (base + L.slot);
    uint8_t *scratch = base + L.scratch;
    const scratch_layout S = scratch_plan(p, w, 1, 1);
    float *xg = (float *) (scratch + S.xg);
    for (int64_t k = 0; k < K; ++k) slot[k] = (int32_t) k;
    for (int64_t t = 0; t < n; ++t) {
        memcpy(xg, x + t * E, (size_t) E * sizeof(float));
        lx_product(w->router, w->router_type, w->router_r8, xg, logits, 1, E, p->n_expert, scratch + S.pw, 1);
        route_row(p, logits, ids, wts);
        for (int64_t k = 0; k < K; ++k) run_expert(p, w, ids[k], 1, scratch, &S, d + k * E, 1, 1);
        reduce_row(y + t * E, d, slot, wts, K, E);
    }
    return LX_OK;
}
