/* mamba2_layer.h: one Mamba-2 mixer in one native call (llama.cpp's build_mamba2_layer), over the
 * recurrent states of the cells the memory chose; shared by the mamba2, granitehybrid and nemotron_h
 * architectures.
 *
 *   h ─ W_in ─┬─ z ──────────────────────────────────────────────┐
 *             ├─ x, B, C ─ conv (+ b, SiLU; conv state) ─ x, B, C ─ scan (+ x D, * SiLU(z); ssm state)
 *             └─ dt + dt_b ─────────────────────────────────────┘   │
 *                                                      grouped RMS norm (ssm_norm) ─ W_out = out
 *
 * The steps are the kernels the Python composition (llamax/model/mamba2.py's mamba2_mixer, the
 * reference) calls, in the same order on the same operands, so the results are the same bits: the
 * products of mamba_layer.h (lx_mamba_product: GGUF blocks or the ordered float product), lx_ssm_conv
 * (ssm.h) over the x, B and C channels, the float addition of dt's bias, lx_ssd_scan (ssd.h) and
 * lx_rms_norm_grouped (layer.h: each group of d_inner / n_group channels normed with that group's
 * weights, as (x * scale) * w: the bits of a norm with unit weights then a product by the weights). The states and history rows are ssm.h's and ssd.h's layouts:
 *
 *   conv  [n_cells][d_inner + 2 n_group d_state][d_conv - 1]   ssm  [n_cells][n_head][head_dim][d_state]
 *
 * A stack (lx_mamba2_stack_forward, the mamba2 architecture) adds the pre-norm and the residual:
 * x += mixer(rms_norm(x, norm)) per layer. Holds no policy: the memory chose the cells and the
 * history rows.
 */
#ifndef LX_MAMBA2_LAYER_H
#define LX_MAMBA2_LAYER_H

#include <stddef.h>
#include <stdint.h>

#include "common.h"
#include "mamba_layer.h"

typedef struct {
    int64_t n_embd, d_inner, d_state, n_group, n_head;   /* n_group divides n_head; n_head divides d_inner */
    int d_conv;                                          /* 1 <= d_conv <= LX_SSM_MAX_CONV */
    float eps;
} lx_mamba2_params;

typedef struct {
    const float *norm;              /* [n_embd]: the pre-norm (a stack's; NULL for lx_mamba2_mixer_forward) */
    lx_mamba_product ssm_in;        /* [d_inner + conv_dim + n_head, n_embd]: z, x|B|C, dt */
    const float *conv_w, *conv_b;   /* [conv_dim][d_conv], [conv_dim]; conv_dim = d_inner + 2 n_group d_state */
    const float *dt_b, *A, *D;      /* [n_head] each (A = -exp(A_log)) */
    const float *ssm_norm;          /* [n_group][d_inner / n_group] */
    lx_mamba_product ssm_out;       /* [n_embd, d_inner] */
} lx_mamba2_weights;

/* 1 if the parameters, weights and states fit one another for n_seqs sequences of n_t tokens (the
 * checks the forward calls make before they write anything), else 0. st: mamba_layer.h's state, its
 * conv rows of conv_dim channels and its ssm rows of n_head * head_dim * d_state values. */
int lx_mamba2_layer_valid(const lx_mamba2_params *p, const lx_mamba2_weights *w, const lx_mamba_state *st,
                          int64_t n_seqs, int64_t n_t);

/* bytes of work the forward calls need for n_seqs sequences of n_t tokens on n_threads */
size_t lx_mamba2_layer_work_size(const lx_mamba2_params *p, const lx_mamba2_weights *w, int64_t n_seqs, int64_t n_t,
                                 int n_threads);

/* out [n][n_embd] = the mixer of h [n][n_embd] (n = n_seqs * n_t, the normed hidden states), reading
 * and updating the states of st (and writing its history rows when it has them). work:
 * lx_mamba2_layer_work_size bytes. Returns LX_OK, or LX_ERR_INVALID when lx_mamba2_layer_valid fails
 * (nothing written then). */
lx_status lx_mamba2_mixer_forward(const lx_mamba2_params *p, const lx_mamba2_weights *w, const lx_mamba_state *st,
                                  const float *h, float *out, int64_t n_seqs, int64_t n_t, void *work, int n_threads);

/* x += mixer(rms_norm(x, w[il].norm)) for il = 0 .. n_layer - 1 in turn, on x [n][n_embd] in place.
 * work: the largest lx_mamba2_layer_work_size of the layers. Returns LX_OK, or LX_ERR_INVALID when a
 * layer fails lx_mamba2_layer_valid, lacks its norm or the n_embd differ (every layer checked first:
 * nothing written then). */
lx_status lx_mamba2_stack_forward(const lx_mamba2_params *p, const lx_mamba2_weights *w, const lx_mamba_state *st,
                                  int n_layer, float *x, int64_t n_seqs, int64_t n_t, void *work, int n_threads);

#endif /* LX_MAMBA2_LAYER_H */
