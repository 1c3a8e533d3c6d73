/* layer.h: one decoder layer of a dense transformer in one native call (llama.cpp's
 * llm_build_llama / llm_build_gemma3 layer body), over the KV cache cells the memory chose.
 *
 *   x ──┬─ rms_norm(attn_norm) ─ W_qkv ─┬─ q ─ [q_norm] ─ RoPE ─ [× q_scale] ─────┐
 *       │                               ├─ k ─ [k_norm] ─ RoPE ─ store K cells ─┐ │
 *       │                               └─ v ─────────────────── store V cells ─┤ │
 *       │                                               attention over the cache ┘─┘
 *       │   (last layer: only the rows that want logits go on: llama.cpp's inp_out_ids)
 *       └─ + [post_attn_norm] W_o ──┬─ rms_norm(ffn_norm) ─ W_gate_up ─ act(gate) * up ─ W_down
 *                                   └─ + [post_ffw_norm] ───────────────────────────────┘ = x'
 *
 * [..] only where the layer has the weight (Gemma 3: q_norm, k_norm, post norms; GELU gate from
 * ggml's f16 table); llama: SiLU gate. The families of llamax/model/family.py add: a Q/K/V bias after
 * W_qkv (Qwen 2), Q/K norms over the whole projection (OLMo 2), no pre-norms (OLMo 2: attn_norm and
 * ffn_norm NULL), no RoPE in a layer (SmolLM3's NoPE layers: rope.n_rot 0), RoPE frequency factors and
 * YaRN (rope.h), each block's output scaled before its residual add (Granite), and a mixture of
 * experts in place of the gated FFN (moe.h, qwen3moe). Every weight product is lx_product (product.h): the GEMM
 * (gemm.h) for the integer types, so a row's result does not depend on the other rows, the number
 * of rows or n_threads; the float product (matmul.h) for f32, f16, bf16, q2_K and q3_K weights,
 * whose rows do not depend on those either but whose sums differ between SIMD levels. Every
 * other step is per row in a fixed order. Numerics follow ggml's CPU ops: rms_norm sums x*x in
 * double (ggml_float), scale = 1/sqrtf(mean + eps), then times the weight; silu = x / (1 + exp(-x))
 * (vexp.h's exp, within 2 ulp of expf); geglu looks the gate's f16 rounding up in the table (0 at
 * or below -10, the gate itself at or above 10).
 *
 * The memory owns the cells: the caller passes the layer's K/V buffers from the first stream the
 * ubatch touches, the cell index of every token (its part p lives in stream s0 + p), and the KQ
 * mask it built for the ubatch (kq_mask.h). Stores follow lx_set_rows (quants.h) for a row
 * cache, and V^T [n_head_kv][d_v][kv_size] columns for a transposed V; a quantized cache with a
 * Hadamard block (hadamard.h) stores rotated rows and attention runs in the rotated frame.
 */
#ifndef LX_LAYER_H
#define LX_LAYER_H

#include <stddef.h>
#include <stdint.h>

#include "common.h"
#include "moe.h"
#include "quants.h"
#include "rope.h"

#define LX_LINEAR_MAX_PARTS 4

/* W [n_out, n_in] as runs of one ggml type stacked along n_out (each a type with a product.h
 * product); a part is GGUF rows, or gemm.h's r8 layout (r8 1: a lx_gemm_r8_supported type, rows
 * padded to 8) */
typedef struct {
    int n_parts;
    const void *w[LX_LINEAR_MAX_PARTS];
    lx_type type[LX_LINEAR_MAX_PARTS];
    int64_t rows[LX_LINEAR_MAX_PARTS];
    int r8[LX_LINEAR_MAX_PARTS];
    int64_t n_in, n_out;
} lx_linear;

/* 1 when l is n_out rows of n_in (every part a product.h product, n_in a multiple of its blocks) */
int lx_linear_valid(const lx_linear *l, int64_t n_in, int64_t n_out);
/* the product.h work bytes of y = x W^T for n rows on n_threads; *widest raised to the widest part's
 * rows when there are several (lx_linear_product's tmp holds n of those rows) */
size_t lx_linear_work_size(const lx_linear *l, int64_t n, int n_threads, int64_t *widest);
/* y [n][n_out] = x [n][n_in] W^T over W's parts (joined by columns through tmp when there are several;
 * work: lx_linear_work_size bytes) */
void lx_linear_product(const lx_linear *l, const float *x, float *y, int64_t n, float *tmp, void *work,
                       int n_threads);

typedef enum { LX_ACT_SILU = 0, LX_ACT_GELU_TABLE = 1 } lx_layer_act;

typedef struct {
    int64_t n_embd, n_head, n_head_kv, d_k, d_v, n_ff;
    float eps;
    lx_rope_params rope;      /* rope.n_rot 0: the layer applies no RoPE (a NoPE layer) */
    float q_scale;            /* q times this after RoPE (1: nothing) */
    float kq_scale;           /* attention score scale */
    float softcap;            /* attention logit softcap, 0 = off */
    lx_layer_act act;
    const float *gelu_table;  /* LX_ACT_GELU_TABLE: [65536] float, by f16 bits */
    int qk_norm_full;         /* q_norm / k_norm over each token's whole Q / K row (OLMo 2), not per head */
    float residual_scale;     /* each block's output times this before the residual add (1: nothing) */
    lx_moe_params moe;        /* the mixture of experts when the weights have one (moe.h; n_embd = n_embd) */
} lx_layer_params;

typedef struct {
    const float *attn_norm, *ffn_norm;                                /* [n_embd], or NULL: no pre-norm */
    const float *q_norm, *k_norm;                                     /* [d_k] ([n_head d_k], [n_head_kv d_k]
                                                                         when qk_norm_full) or NULL */
    const float *post_attn_norm, *post_ffw_norm;                      /* [n_embd] or NULL */
    const float *bqkv;     /* [n_out of wqkv] added after the product, or NULL */
    lx_linear wqkv;        /* n_out = n_head d_k + n_head_kv (d_k + d_v) */
    lx_linear wo;          /* [n_embd, n_head d_v] */
    lx_linear w_gate_up;   /* [2 n_ff, n_embd]: gate rows, then up rows (unused with moe) */
    lx_linear w_down;      /* [n_embd, n_ff] (unused with moe) */
    const lx_moe_weights *moe;   /* NULL: the dense gated FFN above; else the FFN is lx_moe_ffn (moe.h) */
} lx_layer_weights;

/* the layer's cache for the ubatch being applied, as the memory decided it */
typedef struct {
    void *k, *v;              /* from stream s0: K rows [n_stream][kv_size][row_k]; V rows likewise,
                                 or V^T [n_stream][n_head_kv][d_v][kv_size] when v_trans */
    lx_type type_k, type_v;   /* f32, f16, q8_0, q4_0 */
    int v_trans;
    int64_t kv_size;          /* cells per stream */
    int64_t n_stream;         /* streams (= parts) the ubatch spans, consecutive from s0 */
    int64_t n_kv;             /* mask columns: cells that take part */
    int64_t n_tps_pad;        /* mask rows per stream */
    const float *mask;        /* [n_stream][n_tps_pad][n_kv] */
    const uint32_t *idxs;     /* [n_tokens]: cell of token t (part t / (n_tokens / n_stream)) */
    int rot_k, rot_v;         /* Hadamard block of the stored K / V rows, 0 = none */
    const int32_t *perm;      /* NULL, or [n_stream][n_kv]: the cell of each mask column (lx_attn_params) */
} lx_kv_layer;

/* the per-row steps, also used by the Python composition of the layer (its reference):
 * y[r] = (x[r] * scale_r) * g, scale_r = 1 / sqrtf(mean_r + eps) with mean_r = (float) (sum of the
 * float squares in double / n), rows of n (y may be x); */
void lx_rms_norm(const float *x, const float *g, float *y, int64_t n_rows, int64_t n, float eps, int n_threads);
/* the scalar reference of lx_rms_norm (one row after the other): the same bits */
void lx_rms_norm_ref(const float *x, const float *g, float *y, int64_t n_rows, int64_t n, float eps);
/* lx_rms_norm over groups: each row of n values is n_group groups of n / n_group, each normed as a row
 * of its own with its weights g[group * n / n_group ...] (a Mamba-2 layer's grouped ssm_norm); n_group 1
 * is lx_rms_norm, with the same bits. note: n_group >= 1 divides n. */
void lx_rms_norm_grouped(const float *x, const float *g, float *y, int64_t n_rows, int64_t n, int64_t n_group,
                         float eps, int n_threads);

/* act[r] = f(gate[r]) * up[r] for gu rows [gate (n_ff) | up (n_ff)]: silu(g) = g / (1 + e^-g), e^-g
 * from vexp.h (within 2 ulp of expf; the AVX2 lanes and the scalar twin give the same bits), or the
 * f16 GELU table (0 at or below -10, g at or above 10) */
void lx_gated(lx_layer_act kind, const float *gelu_table, const float *gu, float *act, int64_t n_rows,
              int64_t n_ff, int n_threads);
/* the scalar reference of lx_gated (single-threaded): the same bits */
void lx_gated_ref(lx_layer_act kind, const float *gelu_table, const float *gu, float *act, int64_t n_rows,
                  int64_t n_ff);

/* bytes of work lx_layer_forward needs for n_tokens rows */
size_t lx_layer_work_size(const lx_layer_params *p, const lx_layer_weights *w, const lx_kv_layer *kv,
                          int64_t n_tokens, int n_threads);

/* Run the layer on x [n_tokens][n_embd] in place. out_rows (NULL: all rows) lists, ascending,
 * the rows that go on after attention; then x holds n_out_rows rows on return. pos [n_tokens].
 * work: lx_layer_work_size bytes. Returns LX_OK or LX_ERR_INVALID (shapes, types; nothing
 * written then). */
lx_status lx_layer_forward(const lx_layer_params *p, const lx_layer_weights *w, const lx_kv_layer *kv,
                           float *x, int64_t n_tokens, const lx_pos *pos, const int64_t *out_rows,
                           int64_t n_out_rows, void *work, int n_threads);

/* lx_layer_forward of layers 0 .. n_layer - 1 in turn (p, w, kv: one each), out_rows applying to the
 * last; work: the largest of their lx_layer_work_size. With n_threads > 1 cores and a few tokens
 * (every product with gemm.h's few-token halves, no MoE, Hadamard rows or V^T), the layers run in one
 * OpenMP region, a team (team.h) whose members share each product's tiles and attention's chunks and
 * meet at a spin barrier between steps, instead of a region per product; the same bits either way.
 * Every layer is checked before any runs: LX_ERR_INVALID with *failed the first refused layer (the
 * last for bad x, pos, work or out_rows), nothing written; LX_OK with *failed = -1. */
lx_status lx_layers_forward(const lx_layer_params *p, const lx_layer_weights *w, const lx_kv_layer *kv,
                            int n_layer, float *x, int64_t n_tokens, const lx_pos *pos, const int64_t *out_rows,
                            int64_t n_out_rows, void *work, int n_threads, int *failed);

/* testing aids: lx_layer_set_team(0) keeps lx_layers_forward off the team path (a region per
 * product), 1 (the default) lets it take it, the results the same bits; lx_layer_team_runs counts
 * the calls that ran as a team */
void lx_layer_set_team(int on);
int64_t lx_layer_team_runs(void);

#endif /* LX_LAYER_H */
