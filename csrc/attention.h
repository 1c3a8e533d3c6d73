/* attention.h: attention of a ubatch's queries over one layer's KV cache.
 *
 * llama.cpp computes this in build_attn_mha either with ggml_flash_attn_ext
 * (flash attention on: V stored like K, one row per cell) or with
 * mul_mat(k, q) -> soft_max_ext(kq, mask, scale) -> mul_mat(v^T, kq) over a
 * transposed V cache (flash attention off, "v_trans"). Both are here:
 *
 *   lx_attn_flash   V rows [n_stream][kv_size][n_head_kv][d_v]
 *   lx_attn_vtrans  V^T    [n_stream][n_head_kv][d_v][kv_size]
 *
 * Layouts (row-major, innermost last; n_tokens = n_stream * n_tps; query
 * tokens [s*n_tps, (s+1)*n_tps) belong to stream s and see only its cells):
 *
 *   q    float [n_tokens][n_head][d_k]
 *   k    K     [n_stream][kv_size][n_head_kv][d_k]        (type_k: f32, f16 bits, q8_0, q4_0)
 *   v    V     [n_stream][kv_size][n_head_kv][d_v]        (flash; type_v: any of type_k's)
 *        V^T   [n_stream][n_head_kv][d_v][kv_size]        (vtrans: cell i, channel c
 *                                                          at c*kv_size + i in its head;
 *                                                          type_v f32 or f16 only)
 *   mask float [n_stream][n_tps_pad][n_kv]                 row t of stream s for token
 *                                                          s*n_tps + t (kq_mask.h)
 *   out  float [n_tokens][n_head][d_v]
 *
 *              cell i ->  0    1    2  ...  n_kv-1 | n_kv ... kv_size-1
 *   token t   mask      [ 0  -inf   0  ...    0    ]  (cells >= n_kv never take part)
 *             score      s0   --   s2  ...  s_n-1
 *
 * Only the first n_kv <= kv_size cells of each stream take part. Query head h
 * reads kv head h / (n_head / n_head_kv) (GQA). With mask value m_i of cell i
 * and d_i = q . k_i:
 *
 *   flash:   s_i = c * tanh(d_i * scale / c) + m_i      (c = softcap; no tanh when c == 0)
 *   vtrans:  s_i = c * tanh(d_i * (1/c)) * scale + m_i  (soft_max_ext after the kq softcap)
 *   out     = sum_i softmax(s)_i * v_i
 *
 * The two softcaps differ exactly as llama.cpp's two paths do (flash_attn_ext
 * caps the scaled score, the mul_mat path caps the raw kq and scales after).
 * A cell whose mask value is -INFINITY is skipped: neither its K row nor its V
 * row (flash) or V^T column (vtrans) is read, so stale or non-finite values in
 * hidden cells cannot leak into the result. A token whose mask row is all
 * -INFINITY (a padding token, or n_kv == 0) gets an output row of zeros (ggml's
 * flash path does the same; its soft_max path would give NaN).
 * ALiBi: the mask carries the bias itself (slope 1, ggml's max_bias = 0).
 * Precision: q, scores, softmax and accumulators are float32; f16 cache
 * values are converted exactly. (ggml's CPU flash kernel rounds q to f16 for
 * an f16 K and accumulates V in f16; we do not, so we are closer to exact.)
 *
 * Quantized cache (q8_0, q4_0: llama.cpp's -ctk / -ctv). A cell's K (or V) is
 * one row of n_head_kv * d values quantized as ggml blocks of 32 (quants.h),
 * as llama.cpp stores it, so head g's values are blocks [g*d/32, (g+1)*d/32)
 * of the row (d % 32 == 0 is required):
 *
 *   k  uint8 [n_stream][kv_size][lx_row_bytes(type_k, n_head_kv*d_k)]
 *        row = | head 0: d_k/32 blocks | head 1 | ... | head n_head_kv-1 |
 *   v  uint8 [n_stream][kv_size][lx_row_bytes(type_v, n_head_kv*d_v)]   (flash only)
 *
 * The kernels read the blocks in place (no dequantized copy of the cache):
 *   - quantized K, as ggml's flash_attn_ext does: each query row is quantized
 *     once to q8_0 (lx_quantize_row_q8_0: ggml's reference rounding), and
 *     q . k = sum over blocks b of (float) sumi_b * (d_k,b * d_q,b), where
 *     sumi_b = sum_i qq_i * kq_i is an exact integer dot (q4_0: kq_i = nibble - 8);
 *   - quantized V: each block is dequantized on the fly (v_i = (float) q_i * d,
 *     ggml's dequantize_row_*) into the float32 accumulation.
 * Quantized V exists only with flash attention (llama.cpp refuses a quantized
 * V without it: the transposed V^T layout would cut blocks across cells), so
 * lx_attn_params_valid_vtrans rejects it. The scores of a quantized K are q8_0
 * dot products, not float ones: they differ from attention over the
 * dequantized cache by q's quantization (relative ~ 1/254 per block of q); the
 * oracles do the same integer arithmetic, so LX_ATTN_MAX_ERR holds as stated.
 */
#ifndef LX_ATTENTION_H
#define LX_ATTENTION_H

#include <stdint.h>

#include "common.h"
#include "quants.h"
#include "team.h"

/* largest head size of V (and of K) the kernels accept */
#define LX_ATTN_MAX_D 512

/* Visible cells per chunk. The visible cells of a (stream, token) mask row
 * (mask value != -inf among its first n_kv cells, in cell order) are cut
 * into chunks of LX_ATTN_CHUNK: chunk c holds visible cells number
 * [c*LX_ATTN_CHUNK, (c+1)*LX_ATTN_CHUNK) of the row, wherever they sit:
 *
 *   cell     0  1  2  3  4  5  6  7  8 ...        (x = hidden, another sequence's or a hole)
 *   mask     0  x  0  0  x  x  0  0  x ...
 *   visible  0  .  1  2  .  .  3  4  .  ...        chunk c = visible numbers [256c, 256c+256)
 *
 * Each chunk gives a partial softmax state (max, sum, acc), the non-empty
 * states are merged left to right, and every SIMD lane inside a chunk is
 * assigned by visible number, never by cell index. So the result for a
 * token depends only on its row's sequence of visible cells (their K/V and
 * mask values in order): not on hidden cells, on where the visible ones sit in
 * the cache, on n_kv, on the other tokens of the call (batch invariance), on
 * n_threads, or on whether a scratch buffer is passed. It does depend on the
 * SIMD level: the AVX2, AVX-512 and portable paths round differently, each
 * within LX_ATTN_MAX_ERR of the oracle. A row with fewer visible cells simply
 * has fewer non-empty chunks (at most ceil(n_kv / LX_ATTN_CHUNK)). Finding
 * where chunk c starts costs one O(n_kv) pass per row: with the scratch it is
 * done once per row (lx_attn_scratch_size), without it each item walks its
 * chunks in order with a running cursor. */
#define LX_ATTN_CHUNK 256

/* query heads processed together per pass over a kv head's rows: a GQA group
 * (n_head / n_head_kv heads) larger than this is done in several passes */
#define LX_ATTN_MAX_GROUP 8

/* Largest |fast - ref| the tests accept, relative to max|v| (elementwise over
 * out), for scores with sum_i |q_i k_i| * |scale| <= 16, d <= LX_ATTN_MAX_D and
 * n_kv <= 65536. Justification (u = 2^-24 = 6e-8, float32 throughout, errors
 * are rounding only, estimated as random walks sqrt(n)*u as for any
 * reordered float sum):
 *   - a score is a dot of d terms summed in another order (8 or 16 lanes and
 *     a tree in fast, sequential in ref): |ds| <~ 2 sqrt(d) u * 16 = 4.4e-5
 *     for d = 512; a score error ds scales a weight by exp(ds) and so moves
 *     the output by at most ~2 |ds| max|v| through the numerator and the sum;
 *   - exp: the vector exp is within 2 ulp of expf (relative 2.4e-7);
 *   - the sum of n_kv weights and the V accumulation in another order
 *     (chunked, lane-split): relative <~ 2 sqrt(n_kv) u = 3e-5 for 65536.
 * Together about 1.2e-4 in the worst corner of that range; typical cases
 * (d = 64..128, n_kv of a few thousand) sit near 1e-6. 2e-4 leaves margin
 * while any indexing or masking bug shows up as an error of order 1e-2.
 * Quantized caches change nothing in this budget: the block dots of a
 * quantized K are exact integers in both (the oracle quantizes q the same
 * way), their per-block scaling adds one rounding per block (d / 32 terms
 * instead of d), and the fast V path weights a block as (P * d) * q where the
 * oracle takes P * (q * d): one more rounding (2^-24) per term. */
#define LX_ATTN_MAX_ERR 2e-4f

/* the shapes and constants of one attention call */
typedef struct {
    int64_t n_stream;   /* streams, >= 1                                      */
    int64_t n_tps;      /* query tokens per stream, >= 1                      */
    int64_t n_tps_pad;  /* mask rows per stream, >= n_tps                     */
    int64_t n_head;     /* query heads, a multiple of n_head_kv               */
    int64_t n_head_kv;  /* kv heads, >= 1                                     */
    int64_t d_k;        /* head size of q and K, in [1, LX_ATTN_MAX_D]        */
    int64_t d_v;        /* head size of V and out, in [1, LX_ATTN_MAX_D]      */
    int64_t kv_size;    /* cells per stream in the cache, >= 1                */
    int64_t n_kv;       /* cells that take part, in [0, kv_size]              */
    lx_type type_k;     /* LX_TYPE_F32, _F16, _Q8_0 or _Q4_0 (quantized: d_k % 32 == 0) */
    lx_type type_v;     /* the same set (quantized: d_v % 32 == 0, flash only)          */
    float   scale;      /* applied to q.k, usually 1/sqrt(d_k)                */
    float   softcap;    /* logit softcap c, 0 = off                           */
    const int32_t *perm; /* NULL: mask column j is cell j; else [n_stream][n_kv]: column j of
                          * stream s is cell perm[s][j] (< kv_size). The cells a row sees are
                          * taken in column order, so a mask whose columns are sorted by
                          * position gives a result that does not depend on where the cells sit */
} lx_attn_params;

/* true if p describes shapes the kernels accept (lx_attn_flash's asserts' condition) */
bool lx_attn_params_valid(const lx_attn_params *p);

/* lx_attn_params_valid(p) and V not quantized: lx_attn_vtrans's condition (a quantized V needs
 * flash attention, as in llama.cpp) */
bool lx_attn_params_valid_vtrans(const lx_attn_params *p);

/* bytes of one cell's K row (type_k, n_head_kv * d_k values) / V row (flash layout) */
int64_t lx_attn_k_row_bytes(const lx_attn_params *p);
int64_t lx_attn_v_row_bytes(const lx_attn_params *p);

/* Floats of scratch with which lx_attn_flash / lx_attn_vtrans handle few
 * work items (decode: at most 64 (token, kv head, head pass) items, more than
 * one chunk). First one pass over each of the n_stream * n_tps mask rows
 * records where each of its chunks starts (n_chunks = ceil(n_kv /
 * LX_ATTN_CHUNK) int32 per row; a chunk past the row's visible cells is
 * empty), and the non-empty (item, chunk) pairs are listed chunk-major (one
 * int32 each). Then their states are computed (each chunk's cache pages are
 * read once, for all kv heads in turn), shared evenly between threads however
 * few the items or visible cells, and parked in the scratch (hp * (d_v + 2)
 * floats each, hp = query heads per pass); then each item's states are folded:
 *   n_items * n_chunks * hp * (d_v + 2) + (n_stream * n_tps + n_items) * n_chunks
 * floats (the int32s take one float slot each). Many items at the AVX2 level
 * with a float cache (a prefill: attention.c's tiles of query tokens) take
 * n_threads slices of tile buffers instead: the tokens' chunk lists, scores and
 * states for up to 64 tokens, and one chunk's K transposed and V rows as floats
 * (about 680 KB a thread for 3 query heads per kv head of 64 values, 1.6 MB
 * for 4 of 256).
 * 0 when the kernel would not use it. Passing less (or NULL) is allowed: each
 * thread then takes whole items, walking each item's chunks in order with a
 * running cursor; the result is the same bit for bit. */
int64_t lx_attn_scratch_size(const lx_attn_params *p, int n_threads);

/* Flash-layout attention (one pass over the visible cells; per chunk of
 * LX_ATTN_CHUNK visible cells a softmax state, merged online). Writes every element of out; allocates
 * nothing (fixed stack buffers, d <= LX_ATTN_MAX_D, and the caller's scratch).
 * OpenMP (n_threads >= 1) over work items, or over (item, chunk) pairs with
 * the scratch. Speed: K and V rows are read once per GQA group, prefetched,
 * and dotted / accumulated with AVX2+FMA+F16C or AVX-512 when the CPU has them.
 *   q [n_tokens][n_head][d_k], k [n_stream][kv_size][n_head_kv][d_k],
 *   v [n_stream][kv_size][n_head_kv][d_v], mask [n_stream][n_tps_pad][n_kv],
 *   out [n_tokens][n_head][d_v], scratch [n_scratch] floats or NULL. */
void lx_attn_flash(const lx_attn_params *p, const float *q, const void *k, const void *v,
                   const float *mask, float *out, float *scratch, int64_t n_scratch,
                   int n_threads);

/* lx_attn_flash run by every member of a crew together (team.h: layer.c's decode step), each
 * taking its share of the (item, chunk) pairs and of the folds, or of the items, with a barrier
 * between the phases and one after (the members are awake: no work threshold as lx_attn_flash's
 * for waking threads). The same bits as lx_attn_flash; n_scratch as for crew->n threads. */
void lx_attn_flash_crew(const lx_attn_params *p, const float *q, const void *k, const void *v,
                        const float *mask, float *out, float *scratch, int64_t n_scratch, lx_crew *crew);

/* Scalar oracle of lx_attn_flash: per query head, cell by cell, ggml's online
 * softmax (running max M, sum S, acc; expf). Single-threaded. Same shapes.
 * Quantized K: the query row is quantized with lx_quantize_row_q8_0_ref and
 * each score summed block by block in order; quantized V: values q * d. */
void lx_attn_flash_ref(const lx_attn_params *p, const float *q, const void *k, const void *v,
                       const float *mask, float *out);

/* Transposed-V attention (scores, softmax over the row, weighted sum reading
 * V^T). Same contract as lx_attn_flash with v = V^T
 * [n_stream][n_head_kv][d_v][kv_size]. note: lx_attn_params_valid_vtrans(p)
 * (K may be quantized, V not). */
void lx_attn_vtrans(const lx_attn_params *p, const float *q, const void *k, const void *v,
                    const float *mask, float *out, float *scratch, int64_t n_scratch,
                    int n_threads);

/* Scalar oracle of lx_attn_vtrans: per query head, the row maximum of the
 * scores, then exp, sum and the V^T-weighted sum in one pass; out = acc / sum. */
void lx_attn_vtrans_ref(const lx_attn_params *p, const float *q, const void *k, const void *v,
                        const float *mask, float *out);

/* Paths by lx_simd_level() (cpu.h): portable C, AVX2+FMA+F16C, AVX-512 (F+BW+VL+DQ), and AVX-512
 * with VNNI, which differs from AVX-512 only in how the quantized-K dots form their exact int32
 * lanes (AVX2 and AVX-512: maddubs + madd on |k| and sign-adjusted q; VNNI: vpdpbusd over two
 * blocks at once on k + 128 or the raw nibble, with a -128 or -8 * sum(q) correction). The float
 * steps after the lanes are one arithmetic, so the scores of a quantized K are the same bits at
 * AVX2, AVX-512 and VNNI. Every level is within LX_ATTN_MAX_ERR of the oracle and bit-stable over
 * n_threads. */

/* Testing: the scores of a quantized K alone. S [nh][n], S[h][j] = q_h . K row j as attention forms
 * it (q_h quantized to q8_0, integer block dots scaled per block), for q [nh][d_k] (1 <= nh <=
 * LX_ATTN_MAX_GROUP query heads of one kv head) and k [n][lx_row_bytes(type_k, d_k)] (n >= 1 cells
 * of one kv head, taken as one mask row's visible cells in order; type_k LX_TYPE_Q8_0 or _Q4_0,
 * d_k % 32 == 0, d_k <= LX_ATTN_MAX_D):
 *   lx_attn_dots_q            the dots of lx_simd_level()'s kernels
 *   lx_attn_dots_q_ref        the oracle's (lx_attn_flash_ref's scores)
 *   lx_attn_dots_q_vnni_emul  the VNNI kernel's arithmetic in portable C, step for step: the VNNI
 *                             level's bits on any CPU (equal to the AVX2 kernel's)
 * isum [nh][n][d_k / 32] or NULL: the exact integer block dots sum_i k_i q_i the oracle (block by
 * block) or the emulation (the sum of each block's 8 int32 lanes) formed. Writes S and isum only. */
void lx_attn_dots_q(lx_type type_k, int64_t d_k, const float *q, int nh, const void *k, int64_t n, float *S);
void lx_attn_dots_q_ref(lx_type type_k, int64_t d_k, const float *q, int nh, const void *k, int64_t n, float *S,
                        int32_t *isum);
void lx_attn_dots_q_vnni_emul(lx_type type_k, int64_t d_k, const float *q, int nh, const void *k, int64_t n,
                              float *S, int32_t *isum);

/* Testing: a chunk's logits alone. row[j] <- row[j] * scale + mv[j] for j < n (1 <= n <=
 * LX_ATTN_CHUNK), the step from raw scores to logits without a softcap; returns their maximum (the
 * chunk's m). lx_attn_logits runs lx_simd_level()'s kernel, lx_attn_logits_ref the scalar twin: the
 * same bits. */
float lx_attn_logits(float *row, int n, float scale, const float *mv);
float lx_attn_logits_ref(float *row, int n, float scale, const float *mv);

/* Testing hook: the kernels wake no more threads than 1 + (n_tokens * n_head *
 * n_kv * (d_k + d_v)) / macs (default 2^18 multiply-adds per thread, so a tiny
 * call stays on the caller's thread); macs = 1 lets every thread work, -1
 * restores the default. The result never depends on it. Process-wide. */
void lx_attn_set_min_work(int64_t macs);

#endif /* LX_ATTENTION_H */
