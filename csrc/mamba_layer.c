/* mamba_layer.c: one Mamba-1 layer in one call (see mamba_layer.h). Composes the kernels of layer.c
 * (lx_rms_norm, lx_gated), product.c, matmul.c (the ordered float product) and ssm.c; holds no policy
 * (the cells and the history rows come from the memory).
 *
 * Two paths, the same bits:
 *  - a ubatch of several tokens per sequence (a prompt): each step in turn over all rows, each kernel
 *    with its own threads (they split a prompt's work themselves);
 *  - one token per sequence (the generation step) with n_threads > 1: one parallel region in which
 *    each thread owns a block of the channels (multiples of 8) and of the embedding's columns. A
 *    thread computes its channels' rows of the in-projection, their convolution, their rows of the
 *    dt-projection and their scan (ssm.h's kernels called on that block of channels: every channel
 *    is independent, see ssm.h), each thread computes the small x-projection and the dt/B/C norms
 *    whole for itself, and its columns of the out-projection and of the residual; a barrier before
 *    the x-projection and one before the out-projection (Jamba's FFN: thread 0 runs the
 *    out-projection, the residual and the FFN whole, so no more). Every output of a product is one row of W
 *    against one row of x whatever rows are computed with it (product.h, matmul.h), and every other
 *    step is per element or per row, so the bits are the first path's.
 *
 *   work = | h | xz | xc | xdb | dt_in | bn | cn | dt | y | o | gu | act | tmp | product work |
 *          | per thread (the second path): h | xdb | dt_in | bn | cn | t1 | t2 | gu | act | product work |
 */
#include "mamba_layer.h"

#include "matmul.h"
#include "product.h"
#include "ssm.h"

#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#define ALIGN(n) (((size_t) (n) + 63) & ~(size_t) 63)

enum { B_H, B_XZ, B_XC, B_XDB, B_DTIN, B_BN, B_CN, B_DT, B_Y, B_O, B_GU, B_ACT, B_TMP, B_PROD, B_N };
enum { T_H, T_XDB, T_DTIN, T_BN, T_CN, T_T1, T_T2, T_GU, T_ACT, T_PROD, T_N };   /* per thread */

typedef struct {
    size_t off[B_N];
    size_t t_base, t_off[T_N], t_size;   /* the per-thread areas (the second path): thread i's at
                                            t_base + i t_size */
    size_t total;
} layout;

/* ---- the products ------------------------------------------------------------------------- */

int lx_mamba_product_valid(const lx_mamba_product *m, int64_t n_in, int64_t n_out) {
    const lx_linear *l = &m->lin;
    if (m->f32) return l->n_in == n_in && l->n_out == n_out && n_in >= 1 && n_out >= 1 && l->n_parts == 0;
    return n_in >= 1 && n_out >= 1 && lx_linear_valid(l, n_in, n_out);
}

size_t lx_mamba_product_work_size(const lx_mamba_product *m, int64_t n, int nt, int64_t *widest) {
    return m->f32 ? 0 : lx_linear_work_size(&m->lin, n, nt, widest);
}

void lx_mamba_product_run(const lx_mamba_product *m, const float *x, float *y, int64_t n, float *tmp, void *pw,
                          int nt) {
    if (m->f32)
        lx_mul_mat_f32_ordered(m->f32, x, y, n, m->lin.n_in, m->lin.n_out, nt);
    else
        lx_linear_product(&m->lin, x, y, n, tmp, pw, nt);
}

/* ---- shapes ------------------------------------------------------------------------------- */

int lx_mamba_state_valid(const lx_mamba_state *st, int64_t n_seqs) {
    if (!st || n_seqs < 1 || !st->conv || !st->ssm || !st->cells || st->n_cells < n_seqs) return 0;
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
    if (st->ssm_undo) {
        if (!st->undo_slot) return 0;
        for (int64_t s = 0; s < n_seqs; ++s) {
            if (st->undo_slot[s] < -1 || st->undo_slot[s] >= st->n_undo) return 0;
            for (int64_t r = 0; r < s; ++r)
                if (st->undo_slot[s] >= 0 && st->undo_slot[r] == st->undo_slot[s]) return 0;
        }
    }
    return 1;
}

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
    if (!lx_mamba_product_valid(&w->ssm_in, E, 2 * di) || !lx_mamba_product_valid(&w->ssm_x, di, dr + 2 * ds) ||
        !lx_mamba_product_valid(&w->ssm_dt, dr, di) || !lx_mamba_product_valid(&w->ssm_out, di, E))
        return 0;
    if (p->n_ff > 0 && (!w->ffn_norm || !lx_mamba_product_valid(&w->w_gate_up, E, 2 * p->n_ff) ||
                        !lx_mamba_product_valid(&w->w_down, p->n_ff, E)))
        return 0;
    return n_t >= 1 && lx_mamba_state_valid(st, n_seqs);
}

static layout plan(const lx_mamba_params *p, const lx_mamba_weights *w, int64_t n, int nt, int par) {
    layout L;
    const int64_t E = p->n_embd, di = p->d_inner, ds = p->d_state, dr = p->dt_rank, f = p->n_ff;
    int64_t widest = 0;
    size_t g = 0;
    const lx_mamba_product *all[6] = {&w->ssm_in, &w->ssm_x, &w->ssm_dt, &w->ssm_out, &w->w_gate_up, &w->w_down};
    for (int i = 0; i < (f > 0 ? 6 : 4); ++i) {
        const size_t s = lx_mamba_product_work_size(all[i], n, nt, &widest);
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
    L.t_base = o, L.t_size = 0;
    if (par) {   /* n rows of one token each, one thread's share */
        int64_t wmax = di > E ? di : E;
        if (f > wmax) wmax = f;
        if (dr + 2 * ds > wmax) wmax = dr + 2 * ds;
        size_t g1 = 0;
        for (int i = 0; i < (f > 0 ? 6 : 4); ++i) {
            const lx_mamba_product *m = all[i];
            if (m->f32 || m->lin.n_parts != 1) continue;
            const size_t s = lx_product_work_size(m->lin.type[0], m->lin.r8[0], n, m->lin.n_in, 1);
            if (s > g1) g1 = s;
        }
        const size_t tb[T_N] = {
            (size_t) (n * E) * fl, (size_t) (n * (dr + 2 * ds)) * fl, (size_t) (n * dr) * fl, (size_t) (n * ds) * fl,
            (size_t) (n * ds) * fl, (size_t) (n * wmax) * fl, (size_t) (n * wmax) * fl, (size_t) (n * 2 * wmax) * fl,
            (size_t) (n * wmax) * fl, g1,
        };
        size_t t = 0;
        for (int i = 0; i < T_N; ++i) {
            L.t_off[i] = t;
            t += ALIGN(tb[i]);
        }
        L.t_size = t;
    }
    L.total = o + (size_t) (par ? nt : 0) * L.t_size + 64;   /* + room to align the caller's buffer */
    return L;
}

/* the second path (mamba_layer.c's head): one token per sequence, several threads, and every product
 * splittable by rows (the ordered float product, or one part; channel and column blocks are multiples
 * of 8, so they start on an r8 group) */
static int parallel_path(const lx_mamba_params *p, const lx_mamba_weights *w, int64_t n_t, int nt) {
    if (nt < 2 || n_t != 1 || p->d_inner % 8 || p->n_ff % 8) return 0;
    const lx_mamba_product *all[6] = {&w->ssm_in, &w->ssm_x, &w->ssm_dt, &w->ssm_out, &w->w_gate_up, &w->w_down};
    for (int i = 0; i < (p->n_ff > 0 ? 6 : 4); ++i)
        if (!all[i]->f32 && all[i]->lin.n_parts != 1) return 0;
    return 1;
}

size_t lx_mamba_layer_work_size(const lx_mamba_params *p, const lx_mamba_weights *w, int64_t n_seqs, int64_t n_t,
                                int n_threads) {
    return plan(p, w, n_seqs * n_t, n_threads, parallel_path(p, w, n_t, n_threads)).total;
}

/* ---- the layer ---------------------------------------------------------------------------- */

static void add_rows(float *x, const float *d, int64_t count) {
    for (int64_t i = 0; i < count; ++i) x[i] += d[i];
}

/* the columns [c0, c0 + cols) of src rows (stride ld) into dense rows dst [n][cols] */
static void take_cols(const float *src, int64_t ld, int64_t c0, int64_t cols, float *dst, int64_t n) {
    for (int64_t t = 0; t < n; ++t) memcpy(dst + t * cols, src + t * ld + c0, (size_t) cols * sizeof(float));
}

/* ---- the generation step over threads (the second path) ---------------------------------- */

/* thread tid's block [b0, b1) of [0, total): nth blocks of a multiple of 8 (the last ones shorter or empty) */
static void block(int64_t total, int nth, int tid, int64_t *b0, int64_t *b1) {
    const int64_t chunk = ((total + nth - 1) / nth + 7) / 8 * 8;
    *b0 = (int64_t) tid * chunk < total ? (int64_t) tid * chunk : total;
    *b1 = *b0 + chunk < total ? *b0 + chunk : total;
}

/* rows [o0, o1) of W times x [n][n_in] into out [n][o1 - o0], on this thread (a float32 or one-part
 * product; o0 a multiple of 8, so an r8 part's group starts there) */
static void product_rows(const lx_mamba_product *m, const float *x, int64_t n, int64_t o0, int64_t o1, float *out,
                         void *pw) {
    const lx_linear *l = &m->lin;
    if (o1 <= o0) return;
    if (m->f32) {
        lx_mul_mat_f32_ordered(m->f32 + o0 * l->n_in, x, out, n, l->n_in, o1 - o0, 1);
        return;
    }
    const size_t rb = lx_row_bytes(l->type[0], l->n_in);
    lx_product((const uint8_t *) l->w[0] + (size_t) o0 * rb, l->type[0], l->r8[0], x, out, n, l->n_in, o1 - o0, pw,
               1);
}

/* src [n][cols] into the columns [c0, c0 + cols) of dst rows of stride ld */
static void put_cols(const float *src, int64_t cols, float *dst, int64_t ld, int64_t c0, int64_t n) {
    for (int64_t t = 0; t < n; ++t) memcpy(dst + t * ld + c0, src + t * cols, (size_t) cols * sizeof(float));
}

/* x's columns [e0, e1) += o [n][e1 - e0] */
static void add_cols(float *x, int64_t E, const float *o, int64_t e0, int64_t e1, int64_t n) {
    for (int64_t t = 0; t < n; ++t) add_rows(x + t * E + e0, o + t * (e1 - e0), e1 - e0);
}

/* thread tid's share (of nth) of one layer's generation step, inside the caller's parallel region
 * (the barriers below bind to it) */
static void layer_share(const lx_mamba_params *p, const lx_mamba_weights *w, const lx_mamba_state *st, float *x,
                        int64_t n, const layout *L, uint8_t *base, int tid, int nth) {
    const int64_t E = p->n_embd, di = p->d_inner, ds = p->d_state, dr = p->dt_rank, ldb = dr + 2 * ds, f = p->n_ff;
    const int64_t nw = p->d_conv - 1;
    float *xz = (float *) (base + L->off[B_XZ]), *xc = (float *) (base + L->off[B_XC]);
    float *dt = (float *) (base + L->off[B_DT]), *y = (float *) (base + L->off[B_Y]);
    {
        uint8_t *tb = base + L->t_base + (size_t) tid * L->t_size;
#define TBUF(i) ((float *) (tb + L->t_off[i]))
        float *h = TBUF(T_H), *xdb = TBUF(T_XDB), *dt_in = TBUF(T_DTIN), *bn = TBUF(T_BN), *cn = TBUF(T_CN);
        float *t1 = TBUF(T_T1), *t2 = TBUF(T_T2), *gu = TBUF(T_GU), *at = TBUF(T_ACT);
#undef TBUF
        void *pw = tb + L->t_off[T_PROD];
        const int32_t zero = 0;   /* the one cell of a kernel called on a channel block of one sequence */
        int64_t c0, c1, e0, e1;
        block(di, nth, tid, &c0, &c1);
        block(E, nth, tid, &e0, &e1);
        const int64_t cw = c1 - c0;

        /* this thread's channels: their in-projection rows (x and z), their convolution */
        lx_rms_norm(x, w->norm, h, n, E, p->eps, 1);
        if (cw > 0) {
            product_rows(&w->ssm_in, h, n, c0, c1, t1, pw);
            product_rows(&w->ssm_in, h, n, di + c0, di + c1, t2, pw);
            put_cols(t1, cw, xz, 2 * di, c0, n);
            put_cols(t2, cw, xz, 2 * di, di + c0, n);
            for (int64_t s = 0; s < n; ++s) {
                const int64_t cell = st->cells[s], r0 = st->hist_row ? st->hist_row[s] : 0;
                float *hist = st->conv_hist ? st->conv_hist + ((cell * st->n_hist + r0) * di + c0) * nw : NULL;
                lx_ssm_conv(st->conv + (cell * di + c0) * nw, &zero, 1, 1, cw, p->d_conv, xz + s * 2 * di + c0, 2 * di,
                            w->conv_w + c0 * p->d_conv, w->conv_b + c0, xc + s * di + c0, hist, hist ? 1 : 0, NULL, 1);
            }
        }
#ifdef _OPENMP
#pragma omp barrier
#endif
        /* the x-projection and the dt/B/C norms whole (small), then this thread's dt rows and scan */
        product_rows(&w->ssm_x, xc, n, 0, ldb, xdb, pw);
        take_cols(xdb, ldb, 0, dr, dt_in, n);
        const float *B = xdb + dr, *C = xdb + dr + ds;
        int64_t ldbc = ldb;
        if (w->dt_norm) {
            take_cols(xdb, ldb, dr, ds, bn, n);
            take_cols(xdb, ldb, dr + ds, ds, cn, n);
            lx_rms_norm(dt_in, w->dt_norm, dt_in, n, dr, p->eps, 1);
            lx_rms_norm(bn, w->b_norm, bn, n, ds, p->eps, 1);
            lx_rms_norm(cn, w->c_norm, cn, n, ds, p->eps, 1);
            B = bn, C = cn, ldbc = ds;
        }
        if (cw > 0) {
            product_rows(&w->ssm_dt, dt_in, n, c0, c1, t1, pw);
            for (int64_t s = 0; s < n; ++s) add_rows(t1 + s * cw, w->dt_b + c0, cw);
            put_cols(t1, cw, dt, di, c0, n);
            for (int64_t s = 0; s < n; ++s) {
                const int64_t cell = st->cells[s], r0 = st->hist_row ? st->hist_row[s] : 0;
                float *hist = st->ssm_hist ? st->ssm_hist + ((cell * st->n_hist + r0) * di + c0) * ds : NULL;
                /* this block's undo copy (the slots are marked done after the region) */
                const int64_t u = st->ssm_undo ? st->undo_slot[s] : -1;
                float *undo = u >= 0 ? st->ssm_undo + (u * di + c0) * ds : NULL;
                int32_t slot = 0;
                lx_ssm_scan(st->ssm + (cell * di + c0) * ds, &zero, 1, 1, cw, ds, xc + s * di + c0, dt + s * di + c0,
                            w->A + c0 * ds, B + s * ldbc, C + s * ldbc, ldbc, w->D + c0, xz + s * 2 * di + di + c0,
                            2 * di, y + s * di + c0, hist, hist ? 1 : 0, NULL, undo, &slot, 1);
            }
        }
#ifdef _OPENMP
#pragma omp barrier
#endif
        /* this thread's columns of the out-projection and the residual; with Jamba's FFN after them,
         * thread 0 runs both whole (its small products split would need two more barriers) */
        if (f > 0) e0 = tid == 0 ? 0 : E, e1 = E;
        product_rows(&w->ssm_out, y, n, e0, e1, t1, pw);
        if (e1 > e0) add_cols(x, E, t1, e0, e1, n);
        if (f > 0 && tid == 0) {
            lx_rms_norm(x, w->ffn_norm, h, n, E, p->eps, 1);
            product_rows(&w->w_gate_up, h, n, 0, f, t1, pw);
            product_rows(&w->w_gate_up, h, n, f, 2 * f, t2, pw);
            for (int64_t s = 0; s < n; ++s) {
                memcpy(gu + s * 2 * f, t1 + s * f, (size_t) f * sizeof(float));
                memcpy(gu + s * 2 * f + f, t2 + s * f, (size_t) f * sizeof(float));
            }
            lx_gated(LX_ACT_SILU, NULL, gu, at, n, f, 1);
            product_rows(&w->w_down, at, n, 0, E, t1, pw);
            add_cols(x, E, t1, 0, E, n);
        }
    }
}

/* every layer's generation step in one parallel region, a barrier between layers */
static void forward_parallel(const lx_mamba_params *p, const lx_mamba_weights *w, const lx_mamba_state *st,
                             int n_layer, float *x, int64_t n, uint8_t *base, int nt) {
    (void) nt;
#ifdef _OPENMP
#pragma omp parallel num_threads(nt)
#endif
    {
#ifdef _OPENMP
        const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
#else
        const int tid = 0, nth = 1;
#endif
        for (int il = 0; il < n_layer; ++il) {
            const layout L = plan(&p[il], &w[il], n, nt, 1);
            if (il) {
#ifdef _OPENMP
#pragma omp barrier
#endif
            }
            layer_share(&p[il], &w[il], &st[il], x, n, &L, base, tid, nth);
        }
    }
    for (int il = 0; il < n_layer; ++il)
        if (st[il].ssm_undo) lx_undo_done(st[il].undo_slot, n);
}

/* ---- the entry ---------------------------------------------------------------------------- */

/* one layer, each step over all rows in turn (the first path) */
static void forward_serial(const lx_mamba_params *p, const lx_mamba_weights *w, const lx_mamba_state *st, float *x,
                           int64_t n_seqs, int64_t n_t, uint8_t *base, int nt) {
    const int64_t n = n_seqs * n_t;
    const layout L = plan(p, w, n, nt, 0);
#define BUF(i) ((float *) (base + L.off[i]))
    float *h = BUF(B_H), *xz = BUF(B_XZ), *xc = BUF(B_XC), *xdb = BUF(B_XDB), *dt_in = BUF(B_DTIN);
    float *bn = BUF(B_BN), *cn = BUF(B_CN), *dt = BUF(B_DT), *y = BUF(B_Y), *o = BUF(B_O);
    float *gu = BUF(B_GU), *act = BUF(B_ACT), *tmp = BUF(B_TMP);
#undef BUF
    void *pw = base + L.off[B_PROD];
    const int64_t E = p->n_embd, di = p->d_inner, ds = p->d_state, dr = p->dt_rank, ldb = dr + 2 * ds;

    /* the mixer */
    lx_rms_norm(x, w->norm, h, n, E, p->eps, nt);
    lx_mamba_product_run(&w->ssm_in, h, xz, n, tmp, pw, nt);                              /* [n][x | z] */
    lx_ssm_conv(st->conv, st->cells, n_seqs, n_t, di, p->d_conv, xz, 2 * di, w->conv_w, w->conv_b, xc, st->conv_hist,
                st->n_hist, st->hist_row, nt);
    lx_mamba_product_run(&w->ssm_x, xc, xdb, n, tmp, pw, nt);                             /* [n][dt | B | C] */
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
    lx_mamba_product_run(&w->ssm_dt, dt_in, dt, n, tmp, pw, nt);
    for (int64_t t = 0; t < n; ++t) add_rows(dt + t * di, w->dt_b, di);
    lx_ssm_scan(st->ssm, st->cells, n_seqs, n_t, di, ds, xc, dt, w->A, B, C, ldbc, w->D, xz + di, 2 * di, y, st->ssm_hist,
                st->n_hist, st->hist_row, st->ssm_undo, st->undo_slot, nt);
    lx_mamba_product_run(&w->ssm_out, y, o, n, tmp, pw, nt);
    add_rows(x, o, n * E);

    /* Jamba's feed-forward block */
    if (p->n_ff > 0) {
        lx_rms_norm(x, w->ffn_norm, h, n, E, p->eps, nt);
        lx_mamba_product_run(&w->w_gate_up, h, gu, n, tmp, pw, nt);
        lx_gated(LX_ACT_SILU, NULL, gu, act, n, p->n_ff, nt);
        lx_mamba_product_run(&w->w_down, act, o, n, tmp, pw, nt);
        add_rows(x, o, n * E);
    }
}

lx_status lx_mamba_stack_forward(const lx_mamba_params *p, const lx_mamba_weights *w, const lx_mamba_state *st,
                                 int n_layer, float *x, int64_t n_seqs, int64_t n_t, void *work, int nt) {
    if (n_layer < 1 || !x || !work || nt < 1) return LX_ERR_INVALID;
    int par = 1;
    for (int il = 0; il < n_layer; ++il) {
        if (!lx_mamba_layer_valid(&p[il], &w[il], &st[il], n_seqs, n_t) || p[il].n_embd != p[0].n_embd)
            return LX_ERR_INVALID;
        par = par && parallel_path(&p[il], &w[il], n_t, nt);
    }
    uint8_t *base = (uint8_t *) (((uintptr_t) work + 63) & ~(uintptr_t) 63);
    if (par) forward_parallel(p, w, st, n_layer, x, n_seqs * n_t, base, nt);
    else
        for (int il = 0; il < n_layer; ++il) forward_serial(&p[il], &w[il], &st[il], x, n_seqs, n_t, base, nt);
    return LX_OK;
}

lx_status lx_mamba_layer_forward(const lx_mamba_params *p, const lx_mamba_weights *w, const lx_mamba_state *st,
                                 float *x, int64_t n_seqs, int64_t n_t, void *work, int nt) {
    return lx_mamba_stack_forward(p, w, st, 1, x, n_seqs, n_t, work, nt);
}
