/* sampling.c: the sampler chain over one logits row (the contract is in sampling.h). */
#include "sampling.h"

#include "cpu.h"

#include <assert.h>
#include <float.h>
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 64  /* logits tested at once (vectorised) before a block is looked at one by one */

struct lx_sampler_scratch {
    int64_t   cap;
    float    *row;    /* [cap] the edited copy of the logits (greedy: only at the edited tokens) */
    uint64_t *keys;   /* [cap] candidate keys (heap, gathered set, sorted)                       */
    double   *e;      /* [cap] exp(l_i - l_0), then the draw's weights                           */
    int32_t  *count;  /* [cap] occurrences of each penalty token; all 0 between calls             */
    uint32_t *mask;   /* [(cap + 31) / 32] greedy: the allowed tokens the edits did not touch     */
};

lx_sampler_scratch *lx_sampler_scratch_new(int64_t cap) {
    assert(cap >= 1);
    lx_sampler_scratch *s = calloc(1, sizeof *s);
    if (s == NULL) {
        return NULL;
    }
    s->cap  = cap;
    s->row  = malloc((size_t)cap * sizeof *s->row);
    s->keys = malloc((size_t)cap * sizeof *s->keys);
    s->e    = malloc((size_t)cap * sizeof *s->e);
    s->count = calloc((size_t)cap, sizeof *s->count);
    s->mask = malloc((size_t)((cap + 31) / 32) * sizeof *s->mask);
    if (s->row == NULL || s->keys == NULL || s->e == NULL || s->count == NULL || s->mask == NULL) {
        lx_sampler_scratch_free(s);
        return NULL;
    }
    return s;
}

void lx_sampler_scratch_free(lx_sampler_scratch *s) {
    if (s == NULL) {
        return;
    }
    free(s->row);
    free(s->keys);
    free(s->e);
    free(s->count);
    free(s->mask);
    free(s);
}

int64_t lx_sampler_scratch_cap(const lx_sampler_scratch *s) { return s->cap; }

/* ---- keys: (logit descending, token ascending) as one unsigned integer order ---------------- */

static inline uint32_t ordered_bits(float v) {
    v = v + 0.0f;  /* -0 -> +0 */
    if (v != v) {
        v = -INFINITY;
    }
    uint32_t b;
    memcpy(&b, &v, sizeof b);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

static inline uint64_t key_of(float v, int64_t tok) {
    return ((uint64_t)ordered_bits(v) << 32) | (uint64_t)(UINT32_MAX - (uint32_t)tok);
}

static inline double key_logit(uint64_t k) {
    uint32_t o = (uint32_t)(k >> 32);
    uint32_t b = (o & 0x80000000u) ? (o & 0x7fffffffu) : ~o;
    float v;
    memcpy(&v, &b, sizeof v);
    return (double)v;
}

static inline lx_token key_token(uint64_t k) { return (lx_token)(UINT32_MAX - (uint32_t)k); }

/* ---- a min-heap of keys (its root is the worst candidate kept) ------------------------------ */

static void sift_down(uint64_t *h, int64_t n, int64_t i) {
    const uint64_t v = h[i];
    for (;;) {
        int64_t c = 2 * i + 1;
        if (c >= n) {
            break;
        }
        if (c + 1 < n && h[c + 1] < h[c]) {
            c++;
        }
        if (h[c] >= v) {
            break;
        }
        h[i] = h[c];
        i = c;
    }
    h[i] = v;
}

static void heapify(uint64_t *h, int64_t n) {
    for (int64_t i = n / 2 - 1; i >= 0; i--) {
        sift_down(h, n, i);
    }
}

/* h [n], a min-heap -> sorted descending (the popped minimum goes to the end) */
static void heap_sort_desc(uint64_t *h, int64_t n) {
    for (int64_t end = n - 1; end > 0; end--) {
        const uint64_t t = h[0];
        h[0] = h[end];
        h[end] = t;
        sift_down(h, end, 0);
    }
}

/* a [n] sorted descending: introsort (keys are distinct) */
static void sort_desc(uint64_t *a, int64_t n, int depth) {
    while (n > 16) {
        if (depth-- == 0) {
            heapify(a, n);
            heap_sort_desc(a, n);
            return;
        }
        uint64_t x = a[0], y = a[n / 2], z = a[n - 1];  /* median of three */
        uint64_t piv = x < y ? (y < z ? y : (x < z ? z : x)) : (x < z ? x : (y < z ? z : y));
        int64_t i = 0, j = n - 1;
        for (;;) {
            while (a[i] > piv) i++;
            while (a[j] < piv) j--;
            if (i >= j) {
                break;
            }
            const uint64_t t = a[i];
            a[i] = a[j];
            a[j] = t;
            i++;
            j--;
        }
        /* [0, j] >= piv >= [j + 1, n): recurse into the smaller side */
        if (j + 1 < n - j - 1) {
            sort_desc(a, j + 1, depth);
            a += j + 1;
            n -= j + 1;
        } else {
            sort_desc(a + j + 1, n - j - 1, depth);
            n = j + 1;
        }
    }
    for (int64_t i = 1; i < n; i++) {  /* insertion sort */
        const uint64_t v = a[i];
        int64_t j = i;
        for (; j > 0 && a[j - 1] < v; j--) {
            a[j] = a[j - 1];
        }
        a[j] = v;
    }
}

static void sort_keys(uint64_t *a, int64_t n) {
    int depth = 0;
    for (int64_t m = n; m > 1; m >>= 1) {
        depth += 2;
    }
    sort_desc(a, n, depth);
}

/* ---- passes over the row -------------------------------------------------------------------- */

/* The start of the first whole block [j, j + BLOCK) from i on that holds an x > t, or of the tail
 * (shorter than a block) when none does: the hot loop of every pass, vectorised by the compiler
 * (SSE2 baseline; an AVX2 build of the same body when the CPU has it). NaN is never > t. */
#if defined(__GNUC__) || defined(__clang__)
#define LX_ALWAYS_INLINE static inline __attribute__((always_inline))
#else
#define LX_ALWAYS_INLINE static __forceinline
#endif

LX_ALWAYS_INLINE int64_t scan_gt_body(const float *x, int64_t i, int64_t n, float t) {
    for (; i + BLOCK <= n; i += BLOCK) {
        int any = 0;
        for (int j = 0; j < BLOCK; j++) {
            any |= x[i + j] > t;
        }
        if (any) {
            break;
        }
    }
    return i;
}

typedef int64_t (*scan_fn)(const float *x, int64_t i, int64_t n, float t);

static int64_t scan_gt_base(const float *x, int64_t i, int64_t n, float t) { return scan_gt_body(x, i, n, t); }

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
__attribute__((target("avx2"))) static int64_t scan_gt_avx2(const float *x, int64_t i, int64_t n, float t) {
    return scan_gt_body(x, i, n, t);
}
static scan_fn scan_gt(void) { return lx_simd_level() >= LX_SIMD_AVX2 ? scan_gt_avx2 : scan_gt_base; }
#else
static scan_fn scan_gt(void) { return scan_gt_base; }
#endif

int64_t lx_argmax(const float *x, int64_t n) {
    assert(n >= 1);
    const scan_fn scan = scan_gt();
    float best = -INFINITY;
    int64_t arg = 0;
    for (int64_t i = scan(x, 0, n, best); i < n; i = scan(x, i, n, best)) {
        const int64_t end = n - i < BLOCK ? n : i + BLOCK;
        for (; i < end; i++) {
            if (x[i] > best) {
                best = x[i];
                arg = i;
            }
        }
    }
    return arg;
}

/* top-k keys of x [n] into h [k], sorted descending; 1 <= k < n */
static void top_k_keys(const float *x, int64_t n, int64_t k, uint64_t *h) {
    for (int64_t i = 0; i < k; i++) {
        h[i] = key_of(x[i], i);
    }
    heapify(h, k);
    /* a later token with the root's logit has a larger id, so it is worse: strict > is exact */
    float worst = (float)key_logit(h[0]);
    const scan_fn scan = scan_gt();
    for (int64_t i = scan(x, k, n, worst); i < n; i = scan(x, i, n, worst)) {
        const int64_t end = n - i < BLOCK ? n : i + BLOCK;
        for (; i < end; i++) {
            if (x[i] > worst) {
                h[0] = key_of(x[i], i);
                sift_down(h, k, 0);
                worst = (float)key_logit(h[0]);
            }
        }
    }
    heap_sort_desc(h, k);
}

/* keys of the tokens with logit >= t (every token if t is -inf: NaN too) into keys; their count */
static int64_t gather(const float *x, int64_t n, double t, uint64_t *keys) {
    int64_t m = 0;
    if (t == -INFINITY) {
        for (int64_t i = 0; i < n; i++) {
            keys[i] = key_of(x[i], i);
        }
        return n;
    }
    float tf = t < -FLT_MAX ? -FLT_MAX : (float)t;
    if ((double)tf > t) {
        tf = nextafterf(tf, -INFINITY);  /* round down: a superset of {x >= t} */
    }
    const float below = nextafterf(tf, -INFINITY);  /* x >= tf <=> x > below */
    const scan_fn scan = scan_gt();
    for (int64_t i = scan(x, 0, n, below); i < n; i = scan(x, i, n, below)) {
        const int64_t end = n - i < BLOCK ? n : i + BLOCK;
        for (; i < end; i++) {
            if (x[i] > below) {
                keys[m++] = key_of(x[i], i);
            }
        }
    }
    return m;
}

/* sum of exp((x_i - mx) / temp) over x [n]; NaN and underflowing terms skipped */
static double sum_exp(const float *x, int64_t n, double mx, double temp) {
    const double lo = -746.0 * temp;
    double s = 0.0;
    for (int64_t i = 0; i < n; i++) {
        const double d = (double)x[i] - mx;
        if (d > lo) {
            s += exp(d / temp);
        }
    }
    return s;
}

static double keys_mass(const uint64_t *keys, int64_t m, double mx, double temp) {
    double s = 0.0;
    for (int64_t i = 0; i < m; i++) {
        s += exp((key_logit(keys[i]) - mx) / temp);
    }
    return s;
}

/* ---- the rule over sorted candidates c [m] (sampling.h) --------------------------------------
 * S: the sum of exp(l - l_0) over the top-k set, < 0: over c. W_all: the draw's total weight
 * when the kept set is the whole row beyond c (no cut), < 0: over the kept candidates. */
static lx_token choose(const uint64_t *c, int64_t m, double S, double W_all, const lx_sampling_params *p,
                       double u, double *e) {
    const double l0 = key_logit(c[0]);
    if (!isfinite(l0)) {
        return key_token(c[0]);
    }
    int64_t keep = m;
    if (p->top_p < 1.0 || p->min_p > 0.0) {
        for (int64_t i = 0; i < m; i++) {
            e[i] = exp(key_logit(c[i]) - l0);
        }
        if (S < 0.0 && p->top_p < 1.0) {
            S = 0.0;
            for (int64_t i = 0; i < m; i++) {
                S += e[i];
            }
        }
        if (p->top_p < 1.0) {
            double cum = 0.0;
            for (int64_t i = 0; i < m; i++) {
                cum += e[i] / S;
                if (cum >= p->top_p) {
                    keep = i + 1;
                    break;
                }
            }
        }
        if (p->min_p > 0.0) {  /* p_i >= min_p p_0 <=> e_i >= min_p (e_0 = 1) */
            int64_t cnt = 0;
            for (int64_t i = 0; i < keep; i++) {
                cnt += e[i] >= p->min_p;
            }
            keep = cnt > 1 ? cnt : 1;
        }
    }
    double W = 0.0;
    for (int64_t i = 0; i < keep; i++) {
        e[i] = exp((key_logit(c[i]) - l0) / p->temperature);
        W += e[i];
    }
    if (W_all >= 0.0) {
        W = W_all;
    }
    const double target = u * W;
    double cum = 0.0;
    int64_t last = 0;
    for (int64_t i = 0; i < keep; i++) {
        if (e[i] > 0.0) {
            last = i;
        }
        cum += e[i];
        if (cum > target) {
            return key_token(c[i]);
        }
    }
    return key_token(c[last]);  /* u * W rounded up to W */
}

/* every token is a candidate (top_k = 0 or >= n): gather only what the cuts or the draw can reach */
static lx_token sample_all(lx_sampler_scratch *s, const float *x, int64_t n, const lx_sampling_params *p,
                           double u) {
    const int64_t top = lx_argmax(x, n);
    const double mx = (double)x[top];
    if (!isfinite(mx)) {
        return (lx_token)top;  /* all -inf (or NaN), or a +inf: the first of the largest */
    }
    const bool cut_p = p->top_p < 1.0, cut_min = p->min_p > 0.0;
    const double S = cut_p ? sum_exp(x, n, mx, 1.0) : -1.0;
    const double W_all = !cut_p && !cut_min ? sum_exp(x, n, mx, p->temperature) : -1.0;
    int64_t m;
    if (cut_min) {
        /* p_i >= min_p p_0 <=> l_i - l_0 >= log(min_p); the slack covers the rounding */
        m = gather(x, n, mx + log(p->min_p) - 1e-4, s->keys);
    } else {
        static const double depth[] = {8.0, 32.0, 128.0, 512.0};
        const double scale = cut_p ? 1.0 : p->temperature;
        const double need = cut_p ? p->top_p * S * (1.0 + 1e-9) : u * W_all * (1.0 + 1e-9);
        m = -1;
        for (size_t j = 0; j < sizeof depth / sizeof depth[0]; j++) {
            m = gather(x, n, mx - depth[j] * scale, s->keys);
            if (keys_mass(s->keys, m, mx, scale) > need) {
                break;
            }
            m = -1;
        }
        if (m < 0) {
            m = gather(x, n, -INFINITY, s->keys);
        }
    }
    sort_keys(s->keys, m);
    return choose(s->keys, m, S, W_all, p, u, s->e);
}

/* ---- the edits (sampling.h): mask, bias, penalties ------------------------------------------ */

static inline bool allowed_bit(const uint32_t *m, int64_t t) { return (m[t >> 5] >> (t & 31)) & 1u; }

static inline bool penalizing(const lx_logit_edits *e, const lx_sampling_params *p) {
    return e->n_penalty > 0 &&
           (p->repeat_penalty != 1.0f || p->frequency_penalty != 0.0f || p->presence_penalty != 0.0f);
}

/* bias then penalties on row [n] at the edited tokens only (row[t] holds the masked logit of each);
 * count [n] is all 0 before and after */
static void apply_edits(float *row, int64_t n, const lx_logit_edits *e, const lx_sampling_params *p,
                        int32_t *count) {
    for (int64_t j = 0; j < e->n_bias; j++) {
        const lx_token t = e->bias_ids[j];
        if (t >= 0 && t < n) {
            row[t] += e->bias_values[j];
        }
    }
    if (!penalizing(e, p)) {
        return;
    }
    for (int64_t j = 0; j < e->n_penalty; j++) {
        const lx_token t = e->penalty_tokens[j];
        if (t >= 0 && t < n) {
            count[t]++;
        }
    }
    for (int64_t j = 0; j < e->n_penalty; j++) {
        const lx_token t = e->penalty_tokens[j];
        if (t < 0 || t >= n || count[t] == 0) {
            continue;  /* outside the row, or a repeat already applied */
        }
        const int32_t c = count[t];
        count[t] = 0;
        float v = row[t];
        v = v > 0.0f ? v / p->repeat_penalty : v * p->repeat_penalty;
        const float sub = (float)c * p->frequency_penalty + p->presence_penalty;
        row[t] = v - sub;
    }
}

/* row [n] = logits where allowed (NULL: all), -inf elsewhere: a select per token without a branch
 * (vectorised in the AVX2 build: a variable shift gives each lane its bit) */
LX_ALWAYS_INLINE void masked_copy_body(float *row, const float *x, int64_t n, const uint32_t *allowed) {
    for (int64_t w = 0; w * 32 < n; w++) {
        const uint32_t b = allowed[w];
        const int64_t i0 = w * 32;
        if (n - i0 < 32) {
            for (int64_t j = 0; j < n - i0; j++) {
                row[i0 + j] = (b >> j) & 1u ? x[i0 + j] : -INFINITY;
            }
            break;
        }
        for (int j = 0; j < 32; j++) {
            const float v = x[i0 + j];  /* read unconditionally: a select, not a masked load */
            row[i0 + j] = (b >> j) & 1u ? v : -INFINITY;
        }
    }
}

typedef void (*masked_copy_fn)(float *row, const float *x, int64_t n, const uint32_t *allowed);

static void masked_copy_base(float *row, const float *x, int64_t n, const uint32_t *allowed) {
    masked_copy_body(row, x, n, allowed);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
__attribute__((target("avx2"))) static void masked_copy_avx2(float *row, const float *x, int64_t n,
                                                             const uint32_t *allowed) {
    masked_copy_body(row, x, n, allowed);
}
static masked_copy_fn masked_copy_impl(void) {
    return lx_simd_level() >= LX_SIMD_AVX2 ? masked_copy_avx2 : masked_copy_base;
}
#else
static masked_copy_fn masked_copy_impl(void) { return masked_copy_base; }
#endif

static void masked_copy(float *row, const float *x, int64_t n, const uint32_t *allowed) {
    if (allowed == NULL) {
        memcpy(row, x, (size_t)n * sizeof *row);
    } else {
        masked_copy_impl()(row, x, n, allowed);
    }
}

/* The first index of the largest x [n] > -inf among the tokens set in m [(n + 31) / 32] (bits at
 * n and beyond clear), -1 if none: lx_argmax through a mask (whole words tested 32 at once). */
LX_ALWAYS_INLINE int64_t masked_argmax_body(const float *x, int64_t n, const uint32_t *m) {
    float best = -INFINITY;
    int64_t arg = -1;
    for (int64_t w = 0; w * 32 < n; w++) {
        uint32_t b = m[w];
        const float *xw = x + w * 32;
        if (b != 0 && w * 32 + 32 <= n) {  /* nothing in the word above the best: skip its bits */
            int any = 0;
            for (int j = 0; j < 32; j++) {
                any |= xw[j] > best;
            }
            if (!any) {
                continue;
            }
        }
        while (b != 0) {
#if defined(__GNUC__) || defined(__clang__)
            const int j = __builtin_ctz(b);
#else
            int j = 0;
            while (!((b >> j) & 1u)) j++;
#endif
            b &= b - 1;
            if (xw[j] > best) {
                best = xw[j];
                arg = w * 32 + j;
            }
        }
    }
    return arg;
}

typedef int64_t (*masked_argmax_fn)(const float *x, int64_t n, const uint32_t *m);

static int64_t masked_argmax_base(const float *x, int64_t n, const uint32_t *m) { return masked_argmax_body(x, n, m); }

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
__attribute__((target("avx2"))) static int64_t masked_argmax_avx2(const float *x, int64_t n, const uint32_t *m) {
    return masked_argmax_body(x, n, m);
}
static masked_argmax_fn masked_argmax(void) {
    return lx_simd_level() >= LX_SIMD_AVX2 ? masked_argmax_avx2 : masked_argmax_base;
}
#else
static masked_argmax_fn masked_argmax(void) { return masked_argmax_base; }
#endif

/* greedy over the edited row, without copying it: the untouched allowed tokens are scanned through
 * s->mask, the edited ones (a few) compared after their edits. -1: nothing above -inf. */
static lx_token greedy_edited(lx_sampler_scratch *s, const float *x, int64_t n, const lx_logit_edits *e,
                              const lx_sampling_params *p) {
    const int64_t nw = (n + 31) / 32;
    uint32_t *m = s->mask;
    if (e->allowed != NULL) {
        memcpy(m, e->allowed, (size_t)nw * sizeof *m);
    } else {
        memset(m, 0xff, (size_t)nw * sizeof *m);
    }
    if (n % 32 != 0) {
        m[nw - 1] &= (1u << (n % 32)) - 1u;
    }
    const bool pen = penalizing(e, p);
    const int64_t n_pen = pen ? e->n_penalty : 0;
    /* the edited tokens' masked logits (while every mask bit is still the caller's), then their bits off */
    for (int pass = 0; pass < 2; pass++) {
        for (int64_t j = 0; j < e->n_bias + n_pen; j++) {
            const lx_token t = j < e->n_bias ? e->bias_ids[j] : e->penalty_tokens[j - e->n_bias];
            if (t < 0 || t >= n) {
                continue;
            }
            if (pass == 0) {
                s->row[t] = allowed_bit(m, t) ? x[t] : -INFINITY;
            } else {
                m[t >> 5] &= ~(1u << (t & 31));
            }
        }
    }
    apply_edits(s->row, n, e, p, s->count);
    const int64_t arg = masked_argmax()(x, n, m);
    uint64_t best = arg >= 0 ? key_of(x[arg], arg) : 0;  /* 0: below every key */
    for (int64_t j = 0; j < e->n_bias + n_pen; j++) {
        const lx_token t = j < e->n_bias ? e->bias_ids[j] : e->penalty_tokens[j - e->n_bias];
        if (t >= 0 && t < n && s->row[t] > -INFINITY) {
            const uint64_t k = key_of(s->row[t], t);
            best = k > best ? k : best;
        }
    }
    return best == 0 ? -1 : key_token(best);
}

lx_token lx_sampler_sample(lx_sampler_scratch *s, const float *logits, int64_t n_vocab,
                           const lx_logit_edits *edits, const lx_sampling_params *p, double u) {
    assert(n_vocab >= 1 && n_vocab <= s->cap && n_vocab < (int64_t)UINT32_MAX);
    static const lx_logit_edits none = {NULL, NULL, NULL, 0, NULL, 0};
    const lx_logit_edits *e = edits != NULL ? edits : &none;
    const bool constrained = e->allowed != NULL || e->n_bias > 0;
    const bool edited = constrained || penalizing(e, p);
    if (p->temperature <= 0.0) {
        if (!edited) {
            return (lx_token)lx_argmax(logits, n_vocab);
        }
        const lx_token r = greedy_edited(s, logits, n_vocab, e, p);
        return r >= 0 || constrained ? r : 0;  /* unconstrained: lx_argmax's first token */
    }
    const float *x = logits;
    if (edited) {
        masked_copy(s->row, logits, n_vocab, e->allowed);
        apply_edits(s->row, n_vocab, e, p, s->count);
        x = s->row;
    }
    lx_token r;
    if (p->top_k > 0 && p->top_k < n_vocab) {
        top_k_keys(x, n_vocab, p->top_k, s->keys);
        r = choose(s->keys, p->top_k, -1.0, -1.0, p, u, s->e);
    } else {
        r = sample_all(s, x, n_vocab, p, u);
    }
    /* the chosen token is above -inf unless every token is (sampling.h's l_0 rule) */
    return constrained && !(x[r] > -INFINITY) ? -1 : r;
}

/* ---- logprobs -------------------------------------------------------------------------------- */

float lx_logprobs(const float *row, int64_t n, lx_token token, int k, lx_token *top_ids, float *top_lp) {
    assert(n >= 1 && token >= 0 && token < n && k >= 0 && k <= LX_LOGPROBS_MAX_K && k <= n);
    const double mx = (double)row[lx_argmax(row, n)];
    const double lse = isfinite(mx) ? mx + log(sum_exp(row, n, mx, 1.0)) : NAN;
    uint64_t h[LX_LOGPROBS_MAX_K];
    if (k > 0 && k < n) {
        top_k_keys(row, n, k, h);
    } else if (k == n) {
        for (int64_t i = 0; i < n; i++) {
            h[i] = key_of(row[i], i);
        }
        sort_keys(h, n);
    }
    for (int i = 0; i < k; i++) {
        top_ids[i] = key_token(h[i]);
        top_lp[i] = (float)(key_logit(h[i]) - lse);  /* key_logit: NaN -> -inf */
    }
    const float v = row[token];
    return v != v ? (isfinite(lse) ? -INFINITY : NAN) : (float)((double)v - lse);
}

void lx_logprobs_rows(const float *rows, int64_t m, int64_t n, const lx_token *tokens, int k,
                      float *lp, lx_token *top_ids, float *top_lp, int n_threads) {
    assert(n_threads >= 1);
    (void) n_threads;
#ifdef _OPENMP
#pragma omp parallel for num_threads(n_threads) schedule(static) if (n_threads > 1 && m > 1)
#endif
    for (int64_t i = 0; i < m; i++) {
        lp[i] = lx_logprobs(rows + i * n, n, tokens[i], k, top_ids + i * k, top_lp + i * k);
    }
}
