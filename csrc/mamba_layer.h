/* mamba_layer.h: one Mamba-1 layer in one native call (llama.cpp's llm_build_mamba / llm_build_jamba
 * layer body with build_mamba_layer), over the recurrent states of the cells the memory chose.
 *
 *   x ──┬─ rms_norm(norm) ─ W_in ─┬─ x ─ conv (+ b, SiLU; conv state) ─ W_x ─┬─ dt ─ [norm] ─ W_dt + dt_b ─┐
 *       │                         │                                       ├─ B ── [norm] ────────────────┤
 *       │                         │                                       └─ C ── [norm] ────────────────┤
 *       │                         └─ z ─────────────── scan (+ x D, * SiLU(z); ssm state) ───────────────┘
 *       └─ + W_out ─────────┬─ [rms_norm(ffn_norm) ─ W_gate_up ─ silu(gate) * up ─ W_down] = x'
 *                           └─ + ────────────────────────────────────────────────┘
 *
 * [..] only where the layer has them: the RMS norms of dt, B and C (Jamba's weighted ones;
 * Falcon-Mamba's unweighted ones are the same norms with weights of ones), and Jamba's dense SwiGLU
 * FFN after the mixer (n_ff > 0). The steps are the kernels the Python composition of the layer
 * calls (llamax/model/mamba.py, its reference), in the same order on the same operands, so the
 * results are the same bits: lx_rms_norm and lx_gated (layer.h), the weight products (lx_product of
 * product.h for a weight kept in GGUF blocks, lx_mul_mat_f32_ordered of matmul.h for a float32 one:
 * either gives a row the same bits whatever the other rows and n_threads), lx_ssm_conv and
 * lx_ssm_scan (ssm.h, with their rollback history rows), and float additions of the biases and
 * residuals. The generation step (one token per sequence) on several threads runs in one parallel
 * region (one for all the layers of lx_mamba_stack_forward), each thread on a block of the channels
 * and columns (mamba_layer.c): the same bits. Holds no
 * policy: the memory chose the cells and the history rows.
 *
 * A ubatch of a recurrent memory is split equally: n_seqs sequences of n_t tokens, token j of
 * sequence s at row s * n_t + j, its state in cell cells[s] (ssm.h).
 */
#ifndef LX_MAMBA_LAYER_H
#define LX_MAMBA_LAYER_H

#include <stddef.h>
#include <stdint.h>

#include "common.h"
#include "layer.h"

/* y = x W^T for W [n_out, n_in]: through product.h's engines (lin, f32 NULL) or, for a float32 weight
 * the model keeps unquantized (a Mamba's ssm_x and ssm_dt), the ordered float product over f32
 * [n_out][n_in] (lx_mul_mat_f32_ordered; lin.n_in / lin.n_out still give the shape, lin.n_parts 0) */
typedef struct {
    lx_linear lin;
    const float *f32;
} lx_mamba_product;

typedef struct {
    int64_t n_embd, d_inner, d_state, dt_rank;
    int d_conv;               /* 1 <= d_conv <= LX_SSM_MAX_CONV */
    int64_t n_ff;             /* 0: no FFN block (Mamba); else Jamba's SwiGLU FFN of n_ff after the mixer */
    float eps;
} lx_mamba_params;

typedef struct {
    const float *norm;                      /* [n_embd]: the pre-norm (attn_norm) */
    lx_mamba_product ssm_in;                /* [2 d_inner, n_embd]: x rows, then z rows */
    const float *conv_w, *conv_b;           /* [d_inner][d_conv], [d_inner] */
    lx_mamba_product ssm_x;                 /* [dt_rank + 2 d_state, d_inner]: dt, B, C */
    const float *dt_norm, *b_norm, *c_norm; /* [dt_rank], [d_state], [d_state]: all three or none (NULL) */
    lx_mamba_product ssm_dt;                /* [d_inner, dt_rank] */
    const float *dt_b;                      /* [d_inner] */
    const float *A;                         /* [d_inner][d_state]: -exp(A_log) */
    const float *D;                         /* [d_inner] */
    lx_mamba_product ssm_out;               /* [n_embd, d_inner] */
    const float *ffn_norm;                  /* [n_embd] (n_ff > 0) */
    lx_mamba_product w_gate_up;             /* [2 n_ff, n_embd]: gate rows, then up rows (n_ff > 0) */
    lx_mamba_product w_down;                /* [n_embd, n_ff] (n_ff > 0) */
} lx_mamba_weights;

/* the layer's states for the ubatch being applied, as the memory decided them (ssm.h's layouts) */
typedef struct {
    float *conv;               /* [n_cells][d_inner][d_conv - 1] */
    float *ssm;                /* [n_cells][d_inner][d_state] */
    int64_t n_cells;
    const int32_t *cells;      /* [n_seqs]: distinct, < n_cells */
    float *conv_hist;          /* [n_cells][n_hist][d_inner][d_conv - 1], or NULL: no conv rollback rows */
    float *ssm_hist;           /* [n_cells][n_hist][d_inner][d_state], or NULL: no ssm rollback rows */
    int64_t n_hist;            /* >= 1 with either history buffer, else 0 */
    const int32_t *hist_row;   /* [n_seqs] in [0, n_hist) (n_hist >= 1), or NULL: row 0 */
    float *ssm_undo;           /* [n_undo][one ssm state], or NULL: no undo copies (ssm.h's Undo) */
    int64_t n_undo;
    int32_t *undo_slot;        /* [n_seqs] in [-1, n_undo), the rows >= 0 distinct (with ssm_undo); -1 after */
} lx_mamba_state;

/* the products (shared with mamba2_layer.h): 1 if m is a product [n_out, n_in] (a float32 one or valid
 * layer.h parts), else 0; the bytes of work it needs for n rows on nt threads (*widest: layer.h's widest
 * part, for the caller's tmp of n * widest floats); y [n][n_out] = x [n][n_in] W^T, the ordered float
 * product or layer.h's, as the Python Linear / OrderedProduct compute it (a row's bits do not depend
 * on the other rows or nt) */
int lx_mamba_product_valid(const lx_mamba_product *m, int64_t n_in, int64_t n_out);
size_t lx_mamba_product_work_size(const lx_mamba_product *m, int64_t n, int nt, int64_t *widest);
void lx_mamba_product_run(const lx_mamba_product *m, const float *x, float *y, int64_t n, float *tmp, void *work,
                          int nt);

/* 1 if st fits n_seqs sequences: states present, n_seqs distinct cells in range, history rows as
 * ssm.h asks (shared with mamba2_layer.h), else 0 */
int lx_mamba_state_valid(const lx_mamba_state *st, int64_t n_seqs);

/* 1 if the parameters, weights and states fit one another for n_seqs sequences of n_t tokens (the
 * checks lx_mamba_layer_forward makes before it writes anything), else 0 */
int lx_mamba_layer_valid(const lx_mamba_params *p, const lx_mamba_weights *w, const lx_mamba_state *st,
                         int64_t n_seqs, int64_t n_t);

/* bytes of work lx_mamba_layer_forward needs for n_seqs sequences of n_t tokens on n_threads */
size_t lx_mamba_layer_work_size(const lx_mamba_params *p, const lx_mamba_weights *w, int64_t n_seqs, int64_t n_t,
                                int n_threads);

/* Run the layer on x [n_seqs * n_t][n_embd] in place, reading and updating the states of st (and
 * writing its history rows when it has them). work: lx_mamba_layer_work_size bytes. Returns LX_OK,
 * or LX_ERR_INVALID when lx_mamba_layer_valid fails (nothing written then). */
lx_status lx_mamba_layer_forward(const lx_mamba_params *p, const lx_mamba_weights *w, const lx_mamba_state *st,
                                 float *x, int64_t n_seqs, int64_t n_t, void *work, int n_threads);

/* Run n_layer layers in turn on x (p, w, st: [n_layer] each, one n_embd), as lx_mamba_layer_forward
 * each; the generation step on several threads runs them all in one parallel region, a barrier between
 * layers. work: the largest lx_mamba_layer_work_size of the layers. Returns LX_OK, or LX_ERR_INVALID
 * when a layer fails lx_mamba_layer_valid or the n_embd differ (every layer checked first: nothing
 * written then). */
lx_status lx_mamba_stack_forward(const lx_mamba_params *p, const lx_mamba_weights *w, const lx_mamba_state *st,
                                 int n_layer, float *x, int64_t n_seqs, int64_t n_t, void *work, int n_threads);

#endif /* LX_MAMBA_LAYER_H */
