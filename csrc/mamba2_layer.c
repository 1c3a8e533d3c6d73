/* mamba2_layer.c: one Mamba-2 mixer in one call, and a stack of them with their pre-norms and
 * residuals (see mamba2_layer.h). Composes layer.c's lx_rms_norm, mamba_layer.c's products, ssm.c's
 * convolution and ssd.c's scan, each over all rows with its own threads (they split the work
 * themselves, by rows, channels or (sequence, head) pairs, with the same bits for any thread count);
 * holds no policy.
 *
 *   work = | zxbcdt | xbc | dt | y | h | o | tmp | product work |
 */
#include "mamba2_layer.h"

#include "layer.h"
#include "ssd.h"
#include "ssm.h"

#define ALIGN(n) (((size_t) (n) + 63) & ~(size_t) 63)

enum { B_ZX, B_XBC, B_DT, B_Y, B_H, B_O, B_TMP, B_PROD, B_N };

typedef struct {
    size_t off[B_N];
    size_t total;
} layout;

static int64_t conv_dim(const lx_mamba2_params *p) { return p->d_inner + 2 * p->n_group * p->d_state; }

int lx_mamba2_layer_valid(const lx_mamba2_params *p, const lx_mamba2_weights *w, const lx_mamba_state *st,
                          int64_t n_seqs, int64_t n_t) {
    if (!p || !w || !st) return 0;
    if (p->n_embd < 1 || p->d_inner < 1 || p->d_state < 1 || p->n_group < 1 || p->n_head < 1 ||
        p->n_head % p->n_group || p->d_inner % p->n_head || p->d_conv < 1 || p->d_conv > LX_SSM_MAX_CONV ||
        !(p->eps >= 0.0f))
        return 0;
    const int64_t E = p->n_embd, di = p->d_inner, cd = conv_dim(p);
    if (!w->conv_w || !w->conv_b || !w->dt_b || !w->A || !w->D || !w->ssm_norm) return 0;
    if (!lx_mamba_product_valid(&w->ssm_in, E, di + cd + p->n_head) || !lx_mamba_product_valid(&w->ssm_out, di, E))
        return 0;
    return n_t >= 1 && lx_mamba_state_valid(st, n_seqs);
}

static layout plan(const lx_mamba2_params *p, const lx_mamba2_weights *w, int64_t n, int nt) {
    layout L;
    const int64_t E = p->n_embd, di = p->d_inner, cd = conv_dim(p), nh = p->n_head;
    int64_t widest = 0;
    size_t g = lx_mamba_product_work_size(&w->ssm_in, n, nt, &widest);
    const size_t g2 = lx_mamba_product_work_size(&w->ssm_out, n, nt, &widest);
    if (g2 > g) g = g2;
    const size_t fl = sizeof(float);
    const size_t bytes[B_N] = {
        (size_t) (n * (di + cd + nh)) * fl, (size_t) (n * cd) * fl, (size_t) (n * nh) * fl, (size_t) (n * di) * fl,
        (size_t) (n * E) * fl, (size_t) (n * E) * fl, (size_t) (n * widest) * fl, g,
    };
    size_t o = 0;
    for (int i = 0; i < B_N; ++i) {
        L.off[i] = o;
        o += ALIGN(bytes[i]);
    }
    L.total = o + 64;   /* + room to align the caller's buffer */
    return L;
}

size_t lx_mamba2_layer_work_size(const lx_mamba2_params *p, const lx_mamba2_weights *w, int64_t n_seqs, int64_t n_t,
                                 int n_threads) {
    return plan(p, w, n_seqs * n_t, n_threads).total;
}

/* the mixer of h into out (checked by the caller), in the work areas of L */
static void mixer(const lx_mamba2_params *p, const lx_mamba2_weights *w, const lx_mamba_state *st, const float *h,
                  float *out, int64_t n_seqs, int64_t n_t, const layout *L, uint8_t *base, int nt) {
#define BUF(i) ((float *) (base + L->off[i]))
    float *zx = BUF(B_ZX), *xbc = BUF(B_XBC), *dt = BUF(B_DT), *y = BUF(B_Y), *tmp = BUF(B_TMP);
#undef BUF
    void *pw = base + L->off[B_PROD];
    const int64_t n = n_seqs * n_t, di = p->d_inner, ds = p->d_state, ng = p->n_group, nh = p->n_head;
    const int64_t cd = conv_dim(p), W = di + cd + nh;

    lx_mamba_product_run(&w->ssm_in, h, zx, n, tmp, pw, nt);                       /* [n][z | x B C | dt] */
    lx_ssm_conv(st->conv, st->cells, n_seqs, n_t, cd, p->d_conv, zx + di, W, w->conv_w, w->conv_b, xbc,
                st->conv_hist, st->n_hist, st->hist_row, nt);                      /* [n][x | B | C] */
    for (int64_t t = 0; t < n; ++t)
        for (int64_t j = 0; j < nh; ++j) dt[t * nh + j] = zx[t * W + di + cd + j] + w->dt_b[j];
    lx_ssd_scan(st->ssm, st->cells, n_seqs, n_t, nh, di / nh, ds, ng, xbc, cd, dt, nh, w->A, xbc + di,
                xbc + di + ng * ds, cd, w->D, zx, W, y, st->ssm_hist, st->n_hist, st->hist_row, st->ssm_undo,
                st->undo_slot, nt);
    lx_rms_norm_grouped(y, w->ssm_norm, y, n, di, ng, p->eps, nt);   /* each group with its own weights */
    lx_mamba_product_run(&w->ssm_out, y, out, n, tmp, pw, nt);
}

lx_status lx_mamba2_mixer_forward(const lx_mamba2_params *p, const lx_mamba2_weights *w, const lx_mamba_state *st,
                                  const float *h, float *out, int64_t n_seqs, int64_t n_t, void *work, int nt) {
    if (!h || !out || !work || nt < 1 || !lx_mamba2_layer_valid(p, w, st, n_seqs, n_t)) return LX_ERR_INVALID;
    uint8_t *base = (uint8_t *) (((uintptr_t) work + 63) & ~(uintptr_t) 63);
    const layout L = plan(p, w, n_seqs * n_t, nt);
    mixer(p, w, st, h, out, n_seqs, n_t, &L, base, nt);
    return LX_OK;
}

lx_status lx_mamba2_stack_forward(const lx_mamba2_params *p, const lx_mamba2_weights *w, const lx_mamba_state *st,
                                  int n_layer, float *x, int64_t n_seqs, int64_t n_t, void *work, int nt) {
    if (n_layer < 1 || !x || !work || nt < 1) return LX_ERR_INVALID;
    for (int il = 0; il < n_layer; ++il)
        if (!lx_mamba2_layer_valid(&p[il], &w[il], &st[il], n_seqs, n_t) || !w[il].norm ||
            p[il].n_embd != p[0].n_embd)
            return LX_ERR_INVALID;
    uint8_t *base = (uint8_t *) (((uintptr_t) work + 63) & ~(uintptr_t) 63);
    const int64_t n = n_seqs * n_t, E = p[0].n_embd;
    for (int il = 0; il < n_layer; ++il) {
        const layout L = plan(&p[il], &w[il], n, nt);
        float *h = (float *) (base + L.off[B_H]), *o = (float *) (base + L.off[B_O]);
        lx_rms_norm(x, w[il].norm, h, n, E, p[il].eps, nt);
        mixer(&p[il], &w[il], &st[il], h, o, n_seqs, n_t, &L, base, nt);
        for (int64_t i = 0; i < n * E; ++i) x[i] += o[i];
    }
    return LX_OK;
}
