/* mamba_layer.c: one Mamba-1 layer in one call (see mamba_layer.h). Composes the kernels of layer.c
 * (lx_rms_norm, lx_gated), product.c, matmul.c (the ordered float product) and ssm.c; holds no policy
 * (the cells and the history rows come from the memory).
 *
 *   work = | h | xz | xc | xdb | dt_in | bn | cn | dt | y | o | gu | act | tmp | product work |
 */
#include "mamba_layer.h"

#include "matmul.h"
#include "product.h"
#include "ssm.h"

#include <string.h>

#define ALIGN(n) (((size_t) (n) + 63) & ~(size_t) 63)

enum { B_H, B_XZ, B_XC, B_XDB, B_DTIN, B_BN, B_CN, B_DT, B_Y, B_O, B_GU, B_ACT, B_TMP, B_PROD, B_N };

typedef struct {
    size_t off[B_N];
    size_t total;
} layout;

/* ---- the products ------------------------------------------------------------------------- */

static int product_ok(const lx_mamba_product *m, int64_t n_in, int64_t n_out) {
    const lx_linear *l = &m->lin;
    if (l->n_in != n_in || l->n_out != n_out || n_in < 1 || n_out < 1) return 0;
    if (m->f32) return l->n_parts == 0;
    if (l->n_parts < 1 || l->n_parts > LX_LINEAR_MAX_PARTS) return 0;
    int64_t rows = 0;
    for (int i = 0; i < l->n_parts; ++i) {
        if (!l->w[i] || l->rows[i] < 1 || lx_product_kind_of(l->type[i], l->r8[i]) == LX_PRODUCT_NONE) return 0;
        if (n_in % lx_type_block_size(l->type[i])) return 0;
        rows += l->rows[i];
    }
    return rows == n_out;
}

/* the product's work bytes for n rows; *widest: its widest part when it has several (joined
 * through tmp) */
static size_t product_work(const lx_mamba_product *m, int64_t n, int nt, int64_t *widest) {
    const lx_linear *l = &m->lin;
    size_t b = 0;
    if (m->f32) return 0;
    for (int i = 0; i < l->n_parts; ++i) {
        const size_t s = lx_product_work_size(l->type[i], l->r8[i], n, l->n_in, nt);
        if (s > b) b = s;
        if (l->n_parts > 1 && l->rows[i] > *widest) *widest = l->rows[i];
    }
    return b;
}

/* y [n][n_out] = x [n][n_in] W^T: the ordered float product, or each part's engine (parts joined by
 * columns through tmp), as the Python Linear / OrderedProduct compute it */
static void product(const lx_mamba_product *m, const float *x, float *y, int64_t n, float *tmp, void *pw, int nt) {
    const lx_linear *l = &m->lin;
    if (m->f32) {
        lx_mul_mat_f32_ordered(m->f32, x, y, n, l->n_in, l->n_out, nt);
        return;
    }
    if (l->n_parts == 1) {
        lx_product(l->w[0], l->type[0], l->r8[0], x, y, n, l->n_in, l->n_out, pw, nt);
        return;
    }
    int64_t c0 = 0;
    for (int i = 0; i < l->n_parts; ++i) {
        const int64_t r = l->rows[i];
        lx_product(l->w[i], l->type[i], l->r8[i], x, tmp, n, l->n_in, r, pw, nt);
        for (int64_t t = 0; t < n; ++t) memcpy(y + t * l->n_out + c0, tmp + t * r, (size_t) r * sizeof(float));
        c0 += r;
    }
}

/* ---- shapes ------------------------------------------------------------------------------- */

int lx_mamba_layer_valid(const lx_mamba_params *p, const lx_mamba_weights *w, const lx_mamba_state *st,
                         int64_t n_seqs, int64_t n_t) {
    if (!p || !w || !st) return 0;
    if (p->n_embd < 1 || p->d_inner < 1 || p->d_state < 1 || p->dt_rank < 1 || p->n_ff < 0 ||
        p->d_conv < 1 || p->d_conv > LX_SSM_MAX_CONV || !(p->eps >= 0.0f))
        return 0;
    const int64_t E = p->n_embd, di = p->d_inner, ds = p->d_state, dr = p->dt_rank;
    if (!w->norm || !w->conv_w || !w->conv_b || !w->dt_b || !w->A || !w->D) return 0;
    const int norms = (w->dt_norm != NULL) + (w->b_norm != NULL) + (w->c_norm != NULL);
    if (norms != 0 && norms != 3) return 0;
    if (!product_ok(&w->ssm_in, E, 2 * di) || !product_ok(&w->ssm_x, di, dr + 2 * ds) ||
        !product_ok(&w->ssm_dt, dr, di) || !product_ok(&w->ssm_out, di, E))
        return 0;
    if (p->n_ff > 0 && (!w->ffn_norm || !product_ok(&w->w_gate_up, E, 2 * p->n_ff) ||
                        !product_ok(&w->w_down, p->n_ff, E)))
        return 0;
    if (n_seqs < 1 || n_t < 1 || !st->conv || !st->ssm || !st->cells || st->n_cells < n_seqs) return 0;
    for (int64_t s = 0; s < n_seqs; ++s) {
        if (st->cells[s] < 0 || st->cells[s] >= st->n_cells) return 0;
        for (int64_t r = 0; r < s; ++r)
            if (st->cells[r] == st->cells[s]) return 0;
    }
    if (st->conv_hist || st->ssm_hist ? st->n_hist < 1 : st->n_hist != 0) return 0;
    if (st->hist_row) {
        if (st->n_hist < 1) return 0;
        for (int64_t s = 0; s < n_seqs; ++s)
            if (st->hist_row[s] < 0 || st->hist_row[s] >= st->n_hist) return 0;
    }
    return 1;
}

static layout plan(const lx_mamba_params *p, const lx_mamba_weights *w, int64_t n, int nt) {
    layout L;
    const int64_t E = p->n_embd, di = p->d_inner, ds = p->d_state, dr = p->dt_rank, f = p->n_ff;
    int64_t widest = 0;
    size_t g = 0;
    const lx_mamba_product *all[6] = {&w->ssm_in, &w->ssm_x, &w->ssm_dt, &w->ssm_out, &w->w_gate_up, &w->w_down};
    for (int i = 0; i < (f > 0 ? 6 : 4); ++i) {
        const size_t s = product_work(all[i], n, nt, &widest);
        if (s > g) g = s;
    }
    const size_t fl = sizeof(float);
    const size_t bytes[B_N] = {
        (size_t) (n * E) * fl, (size_t) (n * 2 * di) * fl, (size_t) (n * di) * fl, (size_t) (n * (dr + 2 * ds)) * fl,
        (size_t) (n * dr) * fl, (size_t) (n * ds) * fl, (size_t) (n * ds) * fl, (size_t) (n * di) * fl,
        (size_t) (n * di) * fl, (size_t) (n * E) * fl, (size_t) (n * 2 * f) * fl, (size_t) (n * f) * fl,
        (size_t) (n * widest) * fl, g,
    };
    size_t o = 0;
    for (int i = 0; i < B_N; ++i) {
        L.off[i] = o;
        o += ALIGN(bytes[i]);
    }
    L.total = o + 64;   /* room to align the caller's buffer */
    return L;
}

size_t lx_mamba_layer_work_size(const lx_mamba_params *p, const lx_mamba_weights *w, int64_t n_tokens,
                                int n_threads) {
    return plan(p, w, n_tokens, n_threads).total;
}

/* ---- the layer ---------------------------------------------------------------------------- */

static void add_rows(float *x, const float *d, int64_t count) {
    for (int64_t i = 0; i < count; ++i) x[i] += d[i];
}

/* the columns [c0, c0 + cols) of src rows (stride ld) into dense rows dst [n][cols] */
static void take_cols(const float *src, int64_t ld, int64_t c0, int64_t cols, float *dst, int64_t n) {
    for (int64_t t = 0; t < n; ++t) memcpy(dst + t * cols, src + t * ld + c0, (size_t) cols * sizeof(float));
}

lx_status lx_mamba_layer_forward(const lx_mamba_params *p, const lx_mamba_weights *w, const lx_mamba_state *st,
                                 float *x, int64_t n_seqs, int64_t n_t, void *work, int nt) {
    if (!lx_mamba_layer_valid(p, w, st, n_seqs, n_t) || !x || !work || nt < 1) return LX_ERR_INVALID;
    const int64_t n = n_seqs * n_t;
    const layout L = plan(p, w, n, nt);
    uint8_t *base = (uint8_t *) (((uintptr_t) work + 63) & ~(uintptr_t) 63);
#define BUF(i) ((float *) (base + L.off[i]))
    float *h = BUF(B_H), *xz = BUF(B_XZ), *xc = BUF(B_XC), *xdb = BUF(B_XDB), *dt_in = BUF(B_DTIN);
    float *bn = BUF(B_BN), *cn = BUF(B_CN), *dt = BUF(B_DT), *y = BUF(B_Y), *o = BUF(B_O);
    float *gu = BUF(B_GU), *act = BUF(B_ACT), *tmp = BUF(B_TMP);
#undef BUF
    void *pw = base + L.off[B_PROD];
    const int64_t E = p->n_embd, di = p->d_inner, ds = p->d_state, dr = p->dt_rank, ldb = dr + 2 * ds;

    /* the mixer */
    lx_rms_norm(x, w->norm, h, n, E, p->eps, nt);
    product(&w->ssm_in, h, xz, n, tmp, pw, nt);                              /* [n][x | z] */
    lx_ssm_conv(st->conv, st->cells, n_seqs, n_t, di, p->d_conv, xz, 2 * di, w->conv_w, w->conv_b, xc, st->conv_hist,
                st->n_hist, st->hist_row, nt);
    product(&w->ssm_x, xc, xdb, n, tmp, pw, nt);                             /* [n][dt | B | C] */
    take_cols(xdb, ldb, 0, dr, dt_in, n);
    const float *B = xdb + dr, *C = xdb + dr + ds;
    int64_t ldbc = ldb;
    if (w->dt_norm) {   /* Jamba's (Falcon-Mamba's with weights of ones): each row normed alone */
        take_cols(xdb, ldb, dr, ds, bn, n);
        take_cols(xdb, ldb, dr + ds, ds, cn, n);
        lx_rms_norm(dt_in, w->dt_norm, dt_in, n, dr, p->eps, nt);
        lx_rms_norm(bn, w->b_norm, bn, n, ds, p->eps, nt);
        lx_rms_norm(cn, w->c_norm, cn, n, ds, p->eps, nt);
        B = bn, C = cn, ldbc = ds;
    }
    product(&w->ssm_dt, dt_in, dt, n, tmp, pw, nt);
    for (int64_t t = 0; t < n; ++t) add_rows(dt + t * di, w->dt_b, di);
    lx_ssm_scan(st->ssm, st->cells, n_seqs, n_t, di, ds, xc, dt, w->A, B, C, ldbc, w->D, xz + di, 2 * di, y, st->ssm_hist,
                st->n_hist, st->hist_row, nt);
    product(&w->ssm_out, y, o, n, tmp, pw, nt);
    add_rows(x, o, n * E);

    /* Jamba's feed-forward block */
    if (p->n_ff > 0) {
        lx_rms_norm(x, w->ffn_norm, h, n, E, p->eps, nt);
        product(&w->w_gate_up, h, gu, n, tmp, pw, nt);
        lx_gated(LX_ACT_SILU, NULL, gu, act, n, p->n_ff, nt);
        product(&w->w_down, act, o, n, tmp, pw, nt);
        add_rows(x, o, n * E);
    }
    return LX_OK;
}
