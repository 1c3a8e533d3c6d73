/* moe.h: the mixture-of-experts feed-forward of a layer in one native call (llama.cpp's
 * build_moe_ffn as qwen3moe calls it: softmax gating, top-k, SwiGLU experts, weighted sum).
 *
 *   x [n][n_embd] (already ffn-normed)
 *     │ router: logits = x W_gate_inp^T                       [n][n_expert]   (lx_product)
 *     │ gating: p = softmax(logits) or sigmoid(logits)        per token
 *     │ top-k : ids = the n_used largest p, descending, ties to the lower expert id
 *     │         w_k = p[ids_k]; norm_w: w_k /= max(sum_k w_k, 2^-14); w_scale (not 0 / 1): w_k *= w_scale
 *     │ experts, grouped (a routed expert's weights read once per LX_MOE_CHUNK of its rows):
 *     │   for expert e, its tokens T_e in ascending order:  xe = x[T_e]                 [c_e][n_embd]
 *     │     act = act(xe W_gate[e]^T) * (xe W_up[e]^T)                                   [c_e][n_ff_exp]
 *     │     d   = act W_down[e]^T, one row per (token, slot) routed to e                [c_e][n_embd]
 *     └ y[t] = ((d_0 w_0 + d_1 w_1) + d_2 w_2) + ... over the token's slots in rank order
 *
 * Numerics follow ggml's CPU ops: softmax subtracts the row max, adds the exps in double in
 * expert order and multiplies by (float) (1 / sum); sigmoid is 1 / (1 + e^-l); the exps are
 * vexp.h's (lx_exp_ref; e^-l taken as +inf where -l > 88, so sigmoid is 0 there); the weight sum
 * of norm_w is added in double in slot order, then clamped (ggml_clamp at 2^-14) and divided;
 * act is layer.h's lx_gated (SiLU, or the f16 GELU table); each term d_k * w_k is one float
 * multiply and the terms are added one by one in slot order (ggml_mul, then ggml_add chained).
 * Every weight product is product.h's lx_product: for the integer types the activations are
 * quantized per row as ggml does, so a row's result does not depend on the other rows.
 *
 * Batch invariance: token t's y is the same bits whatever else is in the call and for any
 * n_threads (its logits, routing, expert products and reduction depend on x[t] only). The weights
 * stay in their GGUF blocks (or gemm.h's r8 layout): no float copy of any expert.
 *
 * Threads: the routed rows are cut into units, a routed expert's rows in runs of at most
 * LX_MOE_CHUNK. With at least n_threads units (a decode step's n_used experts, a prompt's), one
 * OpenMP region over the units, schedule(static), each unit's products on one thread: a region per
 * product would cost a decode step 3 n_used barriers, and a prompt 3 per expert. With fewer units
 * (one thread, or n_threads above the units), one expert after the other, all its rows in one
 * product over n_threads. Every way gives the same bits (a product's rows do not depend on the other
 * rows or the threads).
 */
#ifndef LX_MOE_H
#define LX_MOE_H

#include <stddef.h>
#include <stdint.h>

#include "common.h"
#include "quants.h"

#define LX_MOE_CHUNK 64   /* most rows of one expert in one unit of the parallel schedule */

/* W_e [rows][n_in] of every expert e < n_expert, stacked:
 *
 *   w ─┬─ expert 0: rows as GGUF rows (r8 0), or lx_gemm_pack_r8 of them (r8 1: rows padded to 8)
 *      ├─ expert 1 at w + expert_bytes
 *      └─ ...
 *
 * A GGUF's ffn_{gate,up,down}_exps tensor [n_expert][rows][row bytes] is this layout with r8 0 and
 * expert_bytes = rows * lx_row_bytes(type, n_in). */
typedef struct {
    const void *w;
    lx_type type;          /* a type with a product.h product in this layout */
    int r8;                /* each expert packed on its own (lx_gemm_r8_supported(type)) */
    int64_t rows;          /* rows of each expert (its product's n_out) */
    size_t expert_bytes;   /* from one expert's rows to the next; at least their bytes */
} lx_experts;

typedef enum { LX_MOE_SOFTMAX = 0, LX_MOE_SIGMOID = 1 } lx_moe_gating;

typedef struct {
    int64_t n_embd, n_ff_exp;
    int64_t n_expert, n_used;  /* 1 <= n_used <= n_expert */
    lx_moe_gating gating;
    int norm_w;                /* divide the top-k weights by their sum */
    float w_scale;             /* 0 or 1: none; else the weights times this */
    int act;                   /* lx_layer_act (layer.h): LX_ACT_SILU or LX_ACT_GELU_TABLE */
    const float *gelu_table;   /* LX_ACT_GELU_TABLE: [65536] float, by f16 bits; else unused */
} lx_moe_params;

typedef struct {
    const void *router;        /* W_gate_inp [n_expert] rows of n_embd: GGUF rows, or r8 (router_r8) */
    lx_type router_type;
    int router_r8;
    lx_experts gate, up;       /* rows n_ff_exp of n_embd */
    lx_experts down;           /* rows n_embd of n_ff_exp */
} lx_moe_weights;

/* 1 if p and w describe a MoE lx_moe_ffn runs (shapes, types with a product, layouts, act);
 * a NULL argument is not valid */
int lx_moe_valid(const lx_moe_params *p, const lx_moe_weights *w);

/* bytes of work lx_moe_ffn, lx_moe_ffn_ref and lx_moe_route need for n tokens and n_threads; it
 * also serves every call of fewer tokens or threads (the reference: any n_threads).
 * note: lx_moe_valid(p, w). */
size_t lx_moe_work_size(const lx_moe_params *p, const lx_moe_weights *w, int64_t n, int n_threads);

/* The routing of x [n][n_embd]: ids [n][n_used] (int32 expert ids, by rank) and wts [n][n_used]
 * (their weights after norm_w and w_scale). work: lx_moe_work_size bytes. Returns LX_OK, or
 * LX_ERR_INVALID (invalid p / w, a NULL buffer, n < 0, n_threads < 1; nothing written then). */
lx_status lx_moe_route(const lx_moe_params *p, const lx_moe_weights *w, const float *x, int64_t n, int32_t *ids,
                       float *wts, void *work, int n_threads);

/* y [n][n_embd] = the MoE feed-forward of x [n][n_embd] (the steps above). y may be x (in place);
 * otherwise they must not overlap. x finite. work: lx_moe_work_size bytes (overwritten). Returns
 * LX_OK, or LX_ERR_INVALID as lx_moe_route (nothing written then). Bits do not depend on n_threads
 * or on the other tokens. */
lx_status lx_moe_ffn(const lx_moe_params *p, const lx_moe_weights *w, const float *x, float *y, int64_t n,
                     void *work, int n_threads);

/* the reference: the same steps one token at a time, single-threaded (a product per token and
 * routed expert, lx_gated_ref): the same bits as lx_moe_ffn. Same arguments and returns. */
lx_status lx_moe_ffn_ref(const lx_moe_params *p, const lx_moe_weights *w, const float *x, float *y, int64_t n,
                         void *work);

#endif /* LX_MOE_H */
