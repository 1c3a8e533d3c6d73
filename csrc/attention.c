/* attention.c: attention over the KV cache (see attention.h for the contract).
 *
 * Fast kernels. Work item = (stream s, token t, kv head g, head pass): the
 * query heads of one GQA group (up to LX_ATTN_MAX_GROUP of them) are done
 * together, so each K/V row is read once per group. The item's VISIBLE cells
 * (mask value != -inf, in cell order) are cut into chunks of LX_ATTN_CHUNK:
 * chunk ch holds visible cells number [ch*LX_ATTN_CHUNK, (ch+1)*LX_ATTN_CHUNK)
 * of the item's mask row, wherever they sit in the cache. One chunk:
 *
 *   visible = the chunk's cells, as a compacted list (vis_list; hidden cells are never read)
 *   S[h][j] = q_h . k_visible[j]             (vectorised dots, K row loaded once for all h)
 *   S       = softcap / scale / + mask        (flash or vtrans convention)
 *   m[h]    = max_j S[h][j];  P = exp(S - m);  l[h] = sum_j P[h][j]
 *   acc[h]  = sum_j P[h][j] * v_visible[j]    (V row, or V^T columns, loaded once for all h)
 *
 * and the non-empty chunk states are merged left to right (m, l, acc rescaled
 * by exp(m_old - m_new)). Every lane assignment inside a chunk kernel is a
 * function of the visible index j (never of the cell index), so a chunk state,
 * and the result, depend only on the row's sequence of visible cells (their
 * K/V and mask values in order): not on hidden cells, on where the cells sit,
 * or on n_kv (batch invariance: a token's output is the same whatever else is
 * in the cache or the batch). Threads: many items -> OpenMP over items, each
 * walks its chunks in order with a running cursor; few items (decode) and a
 * scratch buffer -> one O(n_kv) pass per mask row finds where each chunk
 * starts (row_bounds, parked in the scratch), then OpenMP over (item, chunk)
 * pairs taken chunk-major, states parked in the scratch, then a fold per item.
 * Both fold the same states with the same code in the same order, so the
 * result does not depend on n_threads. At AVX2 and up with a float cache, a
 * prefill's items run in tiles of query tokens (run_tile): the chunks the tokens
 * share (their visible cells one list and its prefixes, as causal prefill's
 * diagonal) get their K and V converted once and attn_tile.h's kernels for all
 * the tokens' heads, with the per-token kernels' bits.
 *
 * Memory: decode streams the whole cache, so K/V rows of the next cells are
 * prefetched (rows of one kv head are n_head_kv * d apart, a stride hardware
 * prefetchers follow poorly), V is accumulated in tiles of rows (a row stride
 * that is a large power of two maps all rows to the same L1 sets), and the
 * chunk-major split reads each page of the cache once for all kv heads.
 * Kernel sets: portable C, AVX2+FMA+F16C, AVX-512, AVX-512 + VNNI; chosen once per call. The
 * float kernels of AVX2 and AVX-512 are one LX_W-lane text compiled twice (LX_ATTN_PASS).
 *
 * Quantized cache (attention.h): a chunk with a quantized K first quantizes its query heads to
 * q8_0 (q8_heads); the dots are then exact integer block dots (portable: the oracle's loop;
 * AVX2: maddubs on |k| and sign-adjusted q; VNNI: vpdpbusd on two blocks at once) scaled per
 * block by d_k * d_q, the AVX2 and VNNI ones with the same float steps (the same bits; the VNNI
 * arithmetic also runs in portable C, dots_q_vnni_emul, for the tests). A quantized V is read
 * block by block: per tile of rows the weights P * d of every block are formed once, then each
 * quant is converted and FMA'd as an f16 value would be. Rows are addressed in bytes (elt_ptr /
 * qrow): a head's row is d / 32 whole blocks.
 */
#ifndef LX_ATTN_PASS

#include "attention.h"
#include "attn_tile.h"
#include "cpu.h"
#include "simd.h"
#include "vexp.h"

#include <assert.h>
#include <math.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define LX_X86 1
#include <immintrin.h>
#define LX_ALWAYS_INLINE inline __attribute__((always_inline))
/* v is in a vector register here (an opaque step: the compiler cannot fold its load into the
 * instructions that use it) */
#define LX_IN_REG(v) __asm__("" : "+v"(v))
#endif


/* ---- shapes ------------------------------------------------------------------ */

static inline bool type_quant(lx_type t) { return t == LX_TYPE_Q8_0 || t == LX_TYPE_Q4_0; }

/* a cache type with head size d the kernels take */
static bool cache_type_ok(lx_type t, int64_t d) {
    if (t == LX_TYPE_F32 || t == LX_TYPE_F16) return true;
    return type_quant(t) && d % LX_QK == 0;
}

bool lx_attn_params_valid(const lx_attn_params *p) {
    if (!p) return false;
    if (p->n_stream < 1 || p->n_tps < 1 || p->n_tps_pad < p->n_tps) return false;
    if (p->n_head_kv < 1 || p->n_head < p->n_head_kv || p->n_head % p->n_head_kv != 0) return false;
    if (p->d_k < 1 || p->d_k > LX_ATTN_MAX_D || p->d_v < 1 || p->d_v > LX_ATTN_MAX_D) return false;
    if (p->kv_size < 1 || p->kv_size > INT32_MAX || p->n_kv < 0 || p->n_kv > p->kv_size) return false;
    if (!cache_type_ok(p->type_k, p->d_k) || !cache_type_ok(p->type_v, p->d_v)) return false;
    return true;
}

bool lx_attn_params_valid_vtrans(const lx_attn_params *p) {
    return lx_attn_params_valid(p) && !type_quant(p->type_v);
}

int64_t lx_attn_k_row_bytes(const lx_attn_params *p) {
    return (int64_t) lx_row_bytes(p->type_k, p->n_head_kv * p->d_k);
}

int64_t lx_attn_v_row_bytes(const lx_attn_params *p) {
    return (int64_t) lx_row_bytes(p->type_v, p->n_head_kv * p->d_v);
}

/* Kernel type codes (compile-time parameters of the SIMD kernels): f32 and f16 keep the 0 / 1
 * of the former f16 flag. */
enum { CT_F32 = 0, CT_F16 = 1, CT_Q8 = 2, CT_Q4 = 3 };

static inline int ctype(lx_type t) {
    return t == LX_TYPE_F16 ? CT_F16 : t == LX_TYPE_Q8_0 ? CT_Q8 : t == LX_TYPE_Q4_0 ? CT_Q4 : CT_F32;
}

/* the byte address of element off of a cache tensor of type t (off a multiple of 32 for the
 * block types: a block boundary) */
static inline const uint8_t *elt_ptr(const void *base, lx_type t, int64_t off) {
    const uint8_t *b = (const uint8_t *) base;
    switch (t) {
    case LX_TYPE_F16:  return b + off * 2;
    case LX_TYPE_Q8_0: return b + (off / LX_QK) * (int64_t) sizeof(lx_block_q8_0);
    case LX_TYPE_Q4_0: return b + (off / LX_QK) * (int64_t) sizeof(lx_block_q4_0);
    default:           return b + off * 4;
    }
}

/* element idx of a cache tensor of type t, as float (quantized: (float) q * d, as ggml's
 * dequantize_row_q8_0 / _q4_0) */
static inline float cache_at(const void *base, lx_type t, int64_t idx) {
    switch (t) {
    case LX_TYPE_F16:
        return lx_fp16_to_fp32(((const uint16_t *) base)[idx]);
    case LX_TYPE_Q8_0: {
        const lx_block_q8_0 *b = (const lx_block_q8_0 *) base + idx / LX_QK;
        return b->qs[idx % LX_QK] * lx_fp16_to_fp32(b->d);
    }
    case LX_TYPE_Q4_0: {
        const lx_block_q4_0 *b = (const lx_block_q4_0 *) base + idx / LX_QK;
        const int j = (int) (idx % LX_QK);
        const int q = j < LX_QK / 2 ? (b->qs[j] & 0x0F) : (b->qs[j - LX_QK / 2] >> 4);
        return (q - 8) * lx_fp16_to_fp32(b->d);
    }
    default:
        return ((const float *) base)[idx];
    }
}

/* the exact integer dot of the 32 values of K block kb (type t, at its first byte) with q8_0
 * quants qs [32] */
static inline int block_dot_i(const uint8_t *kb, lx_type t, const int8_t *qs) {
    int sumi = 0;
    if (t == LX_TYPE_Q8_0) {
        const lx_block_q8_0 *b = (const lx_block_q8_0 *) kb;
        for (int i = 0; i < LX_QK; ++i) sumi += b->qs[i] * qs[i];
    } else {
        const lx_block_q4_0 *b = (const lx_block_q4_0 *) kb;
        for (int i = 0; i < LX_QK / 2; ++i) {
            sumi += ((b->qs[i] & 0x0F) - 8) * qs[i];
            sumi += ((b->qs[i] >> 4) - 8) * qs[i + LX_QK / 2];
        }
    }
    return sumi;
}

/* the f16 scale of the K block at kb (both block types start with it) */
static inline float block_d(const uint8_t *kb) {
    uint16_t d;
    memcpy(&d, kb, sizeof d);
    return lx_fp16_to_fp32(d);
}

/* q . K(row at element krow) with d_k values: a float dot, or for a quantized K the q8_0 dot
 * of qq (q quantized) summed block by block in order, as ggml_vec_dot_q8_0_q8_0 /
 * ggml_vec_dot_q4_0_q8_0 define it: sum += (float) sumi * (d_k * d_q) */
static float dot_k_ref(const lx_attn_params *p, const float *qr, const lx_block_q8_0 *qq,
                       const void *k, int64_t krow) {
    if (!type_quant(p->type_k)) {
        float d = 0.0f;
        for (int64_t c = 0; c < p->d_k; ++c) d += qr[c] * cache_at(k, p->type_k, krow + c);
        return d;
    }
    float sum = 0.0f;
    for (int64_t b = 0; b < p->d_k / LX_QK; ++b) {
        const uint8_t *kb = elt_ptr(k, p->type_k, krow + b * LX_QK);
        const int sumi = block_dot_i(kb, p->type_k, qq[b].qs);
        sum += (float) sumi * (block_d(kb) * lx_fp16_to_fp32(qq[b].d));
    }
    return sum;
}

/* ---- scalar oracles ---------------------------------------------------------------- */

/* the cell of mask column i of stream s */
static inline int64_t col_cell(const lx_attn_params *p, int64_t s, int64_t i) {
    return p->perm ? p->perm[s * p->n_kv + i] : i;
}

void lx_attn_flash_ref(const lx_attn_params *p, const float *q, const void *k, const void *v,
                       const float *mask, float *out) {
    assert(lx_attn_params_valid(p));
    const int64_t gqa = p->n_head / p->n_head_kv;
    const float cap = p->softcap;
    const float scale = cap != 0.0f ? p->scale / cap : p->scale;   /* as ggml: scale /= softcap */
    float acc[LX_ATTN_MAX_D];
    lx_block_q8_0 qq[LX_ATTN_MAX_D / LX_QK];    /* the query row as q8_0 (quantized K) */

    for (int64_t s = 0; s < p->n_stream; ++s) {
        for (int64_t t = 0; t < p->n_tps; ++t) {
            const int64_t tok = s * p->n_tps + t;
            const float *mrow = mask + (s * p->n_tps_pad + t) * p->n_kv;
            for (int64_t h = 0; h < p->n_head; ++h) {
                const int64_t g = h / gqa;
                const float *qr = q + (tok * p->n_head + h) * p->d_k;
                if (type_quant(p->type_k)) lx_quantize_row_q8_0_ref(qr, qq, p->d_k);
                float M = -INFINITY, S = 0.0f;
                for (int64_t c = 0; c < p->d_v; ++c) acc[c] = 0.0f;

                for (int64_t i = 0; i < p->n_kv; ++i) {
                    const float mv = mrow[i];
                    if (mv == -INFINITY) continue;
                    const int64_t ci = col_cell(p, s, i);
                    const int64_t krow = ((s * p->kv_size + ci) * p->n_head_kv + g) * p->d_k;
                    const int64_t vrow = ((s * p->kv_size + ci) * p->n_head_kv + g) * p->d_v;
                    const float d = dot_k_ref(p, qr, qq, k, krow);
                    float sc = d * scale;
                    if (cap != 0.0f) sc = cap * tanhf(sc);
                    sc += mv;

                    float ms = 1.0f, vs = 1.0f;
                    if (sc > M) {                 /* new maximum: rescale what we have */
                        const float m_old = M;
                        M = sc;
                        ms = expf(m_old - M);
                        for (int64_t c = 0; c < p->d_v; ++c) acc[c] *= ms;
                    } else {
                        vs = expf(sc - M);
                    }
                    for (int64_t c = 0; c < p->d_v; ++c) acc[c] += vs * cache_at(v, p->type_v, vrow + c);
                    S = S * ms + vs;
                }
                const float inv = S == 0.0f ? 0.0f : 1.0f / S;
                float *o = out + (tok * p->n_head + h) * p->d_v;
                for (int64_t c = 0; c < p->d_v; ++c) o[c] = acc[c] * inv;
            }
        }
    }
}

/* the vtrans score of cell i: soft_max_ext(cap*tanh(kq/cap)) input, scaled, masked */
static float vtrans_score_ref(const lx_attn_params *p, const float *qr, const lx_block_q8_0 *qq,
                              const void *k, int64_t krow, float mv) {
    float d = dot_k_ref(p, qr, qq, k, krow);
    if (p->softcap != 0.0f) d = p->softcap * tanhf(d * (1.0f / p->softcap));
    return d * p->scale + mv;
}

void lx_attn_vtrans_ref(const lx_attn_params *p, const float *q, const void *k, const void *v,
                        const float *mask, float *out) {
    assert(lx_attn_params_valid_vtrans(p));
    const int64_t gqa = p->n_head / p->n_head_kv;
    float acc[LX_ATTN_MAX_D];
    lx_block_q8_0 qq[LX_ATTN_MAX_D / LX_QK];    /* the query row as q8_0 (quantized K) */

    for (int64_t s = 0; s < p->n_stream; ++s) {
        for (int64_t t = 0; t < p->n_tps; ++t) {
            const int64_t tok = s * p->n_tps + t;
            const float *mrow = mask + (s * p->n_tps_pad + t) * p->n_kv;
            for (int64_t h = 0; h < p->n_head; ++h) {
                const int64_t g = h / gqa;
                const float *qr = q + (tok * p->n_head + h) * p->d_k;
                float *o = out + (tok * p->n_head + h) * p->d_v;
                const int64_t vt = (s * p->n_head_kv + g) * p->d_v * p->kv_size;   /* V^T of head g */
                if (type_quant(p->type_k)) lx_quantize_row_q8_0_ref(qr, qq, p->d_k);

                float M = -INFINITY;
                bool any = false;
                for (int64_t i = 0; i < p->n_kv; ++i) {
                    if (mrow[i] == -INFINITY) continue;
                    const int64_t krow = ((s * p->kv_size + col_cell(p, s, i)) * p->n_head_kv + g) * p->d_k;
                    const float sc = vtrans_score_ref(p, qr, qq, k, krow, mrow[i]);
                    M = sc > M ? sc : M;
                    any = true;
                }
                if (!any) {
                    for (int64_t c = 0; c < p->d_v; ++c) o[c] = 0.0f;
                    continue;
                }
                float sum = 0.0f;
                for (int64_t c = 0; c < p->d_v; ++c) acc[c] = 0.0f;
                for (int64_t i = 0; i < p->n_kv; ++i) {
                    if (mrow[i] == -INFINITY) continue;
                    const int64_t ci = col_cell(p, s, i);
                    const int64_t krow = ((s * p->kv_size + ci) * p->n_head_kv + g) * p->d_k;
                    const float pr = expf(vtrans_score_ref(p, qr, qq, k, krow, mrow[i]) - M);
                    sum += pr;
                    for (int64_t c = 0; c < p->d_v; ++c) acc[c] += pr * cache_at(v, p->type_v, vt + c * p->kv_size + ci);
                }
                const float inv = sum == 0.0f ? 0.0f : 1.0f / sum;
                for (int64_t c = 0; c < p->d_v; ++c) o[c] = acc[c] * inv;
            }
        }
    }
}

/* ---- fast kernels: the pieces of a chunk ------------------------------------------ */

#define LDS LX_ATTN_CHUNK   /* row stride of the score / weight buffer S[h][j] */

/* one chunk's visible cells (at most LX_ATTN_CHUNK of them, in cell order), as maximal runs of
 * consecutive cells; offsets are from the cell i0 where the chunk's scan began */
typedef struct {
    int n;                      /* visible cells                           */
    int n_runs;
    int idx[LX_ATTN_CHUNK];     /* [n] visible cell offsets from i0 (from cell 0 through a perm) */
    float mv[LX_ATTN_CHUNK];    /* [n] their mask values                   */
    int run_j[LX_ATTN_CHUNK];   /* [n_runs] first visible index of the run */
    int run_len[LX_ATTN_CHUNK]; /* [n_runs] cells in the run               */
} vis_list;

/* Everything a chunk kernel needs, fixed for one call. */
typedef struct {
    const lx_attn_params *p;
    const float *q;
    const void  *k;
    const void  *v;
    const float *mask;
    float       *out;
    bool    vtrans;
    int64_t gqa;        /* query heads per kv head                  */
    int64_t hp;         /* heads per pass, <= LX_ATTN_MAX_GROUP      */
    int64_t n_pass;     /* passes per kv head                       */
    int64_t n_items;    /* n_stream * n_tps * n_head_kv * n_pass    */
    int64_t n_chunks;   /* ceil(n_kv / LX_ATTN_CHUNK): most chunks of a row */
    int64_t st_stride;  /* floats of one chunk state: hp * (d_v + 2) */
    int64_t kb_head;    /* bytes of one cell's K row of one head    */
    int64_t kb_cell;    /* bytes between consecutive cells' K rows  */
    int64_t vb_head;    /* the same for V (flash layout)            */
    int64_t vb_cell;
    int     level;      /* SIMD level of the chunk kernels          */
} attn_ctx;

/* The query heads of one pass quantized to q8_0 for a quantized K (ggml converts q to K's
 * vec_dot_type, q8_0 for both q8_0 and q4_0), laid out for the dot kernels: qs[h] holds the
 * d_k quants of head h in order (block b at 32b), d[h][b] the block scales as floats. */
typedef struct {
    _Alignas(64) int8_t qs[LX_ATTN_MAX_GROUP][LX_ATTN_MAX_D];
    float d[LX_ATTN_MAX_GROUP][LX_ATTN_MAX_D / LX_QK];
} q8_heads;

/* qh <- the nh rows q [nh][d] quantized with lx_quantize_row_q8_0 (bit-exact with the _ref the
 * oracle uses) */
static void quantize_heads(const float *q, int nh, int64_t d, q8_heads *qh) {
    lx_block_q8_0 blk[LX_ATTN_MAX_D / LX_QK];
    for (int h = 0; h < nh; ++h) {
        lx_quantize_row_q8_0(q + h * d, blk, d);
        for (int64_t b = 0; b < d / LX_QK; ++b) {
            memcpy(qh->qs[h] + b * LX_QK, blk[b].qs, LX_QK);
            qh->d[h][b] = lx_fp16_to_fp32(blk[b].d);
        }
    }
}

/* Kernel set of one SIMD level. Every kernel assigns lanes, groups and tiles by the visible index j
 * (0 .. n-1) only, never by the cell offsets idx[j]: so a chunk's results depend on its visible
 * cells' values in order, not on where they sit (batch invariance, attention.h).
 * dots: S[h*LDS + j] = q_h . K(cell i0 + idx[j]) for h < nh, j < n.
 *   q: [nh][d_k] (consecutive heads), k_base: element offset of (stream, cell i0, head g),
 *   k_stride: elements between consecutive cells.
 * logits: row[j] = row[j] * scale + mv[j] for j < n (n >= 1), returns their max as row_max finds it.
 * expsum: P = exp(S - m[h]) in place for j < n, l[h] = sum_j P; S rows hold n values.
 * vacc: acc[h*d_v + c] = sum_j P[h][j] * V(cell i0 + idx[j], c)   (flash layout)
 * vtacc: the same reading V^T: column of cell i at c*kv_size + i from vt_base.
 * dots_q: dots for a quantized K (element offsets as in dots, all multiples of 32), from the
 *   quantized query heads qh: S[h*LDS + j] = sum_b (float) sumi_b * (d_k,b * d_q,b).
 * lanes: the fma chains of a score in dots (8 or 16), whose order the prefill tiles' lx_attn_tile_dots
 *   reproduces (attn_tile.h); 0 for the C kernels, which no tile runs beside (tiles_apply: AVX2 and up). */
typedef struct {
    void (*dots)(const attn_ctx *c, const float *q, int64_t k_base, int64_t k_stride,
                 const vis_list *vl, int nh, float *S);
    void (*dots_q)(const attn_ctx *c, const q8_heads *qh, int64_t k_base, int64_t k_stride,
                   const vis_list *vl, int nh, float *S);
    float (*logits)(float *row, int n, float scale, const float *mv);
    void (*expsum)(float *S, int n, int nh, const float *m, float *l);
    void (*vacc)(const attn_ctx *c, const float *S, int64_t v_base, int64_t v_stride,
                 const vis_list *vl, int nh, float *acc);
    void (*vtacc)(const attn_ctx *c, const float *S, int64_t vt_base,
                  const vis_list *vl, int nh, float *acc);
    int lanes;
} kernel_set;

/* -- portable C (no intrinsics; loops written so compilers can vectorise them) -- */

/* row [n] of a cache tensor as floats (quantized: lx_dequantize_row, bit-exact with cache_at) */
static inline void cache_row(const void *base, lx_type t, int64_t off, int64_t n, float *dst) {
    if (t == LX_TYPE_F16) {
        lx_fp16_to_fp32_row((const uint16_t *) base + off, dst, n);
    } else if (type_quant(t)) {
        lx_dequantize_row(t, elt_ptr(base, t, off), dst, n);
    } else {
        memcpy(dst, (const float *) base + off, (size_t) n * sizeof(float));
    }
}

/* the oracle's arithmetic, cell by cell: the same scores bit for bit */
static void dots_q_c(const attn_ctx *c, const q8_heads *qh, int64_t k_base, int64_t k_stride,
                     const vis_list *vl, int nh, float *S) {
    const lx_type tk = c->p->type_k;
    const int64_t nb = c->p->d_k / LX_QK;
    for (int j = 0; j < vl->n; ++j) {
        const int64_t off = k_base + (int64_t) vl->idx[j] * k_stride;
        for (int h = 0; h < nh; ++h) {
            float sum = 0.0f;
            for (int64_t b = 0; b < nb; ++b) {
                const uint8_t *kb = elt_ptr(c->k, tk, off + b * LX_QK);
                const int sumi = block_dot_i(kb, tk, qh->qs[h] + b * LX_QK);
                sum += (float) sumi * (block_d(kb) * qh->d[h][b]);
            }
            S[h * LDS + j] = sum;
        }
    }
}

static void dots_c(const attn_ctx *c, const float *q, int64_t k_base, int64_t k_stride,
                   const vis_list *vl, int nh, float *S) {
    const int64_t d = c->p->d_k, d8 = d & ~(int64_t) 7;
    float kf[LX_ATTN_MAX_D];
    for (int j = 0; j < vl->n; ++j) {
        cache_row(c->k, c->p->type_k, k_base + (int64_t) vl->idx[j] * k_stride, d, kf);
        for (int h = 0; h < nh; ++h) {
            const float *qh = q + h * d;
            float lane[8] = {0};
            for (int64_t e = 0; e < d8; e += 8)
                for (int u = 0; u < 8; ++u) lane[u] += qh[e + u] * kf[e + u];
            float sum = ((lane[0] + lane[4]) + (lane[1] + lane[5])) + ((lane[2] + lane[6]) + (lane[3] + lane[7]));
            for (int64_t e = d8; e < d; ++e) sum += qh[e] * kf[e];
            S[h * LDS + j] = sum;
        }
    }
}

static float row_max(const float *row, int n);

static float logits_c(float *row, int n, float scale, const float *mv) {
    for (int j = 0; j < n; ++j) row[j] = row[j] * scale + mv[j];
    return row_max(row, n);
}

static void expsum_c(float *S, int n, int nh, const float *m, float *l) {
    for (int h = 0; h < nh; ++h) {
        float sum = 0.0f;
        for (int j = 0; j < n; ++j) {
            const float e = expf(S[h * LDS + j] - m[h]);
            S[h * LDS + j] = e;
            sum += e;
        }
        l[h] = sum;
    }
}

static void vacc_c(const attn_ctx *c, const float *S, int64_t v_base, int64_t v_stride,
                   const vis_list *vl, int nh, float *acc) {
    const int64_t dv = c->p->d_v;
    float vf[LX_ATTN_MAX_D];
    for (int64_t i = 0; i < nh * dv; ++i) acc[i] = 0.0f;
    for (int j = 0; j < vl->n; ++j) {
        cache_row(c->v, c->p->type_v, v_base + (int64_t) vl->idx[j] * v_stride, dv, vf);
        for (int h = 0; h < nh; ++h) {
            const float pj = S[h * LDS + j];
            float *a = acc + h * dv;
            for (int64_t e = 0; e < dv; ++e) a[e] += pj * vf[e];
        }
    }
}

static void vtacc_c(const attn_ctx *c, const float *S, int64_t vt_base,
                    const vis_list *vl, int nh, float *acc) {
    const int64_t dv = c->p->d_v, kv_size = c->p->kv_size;
    const lx_type tv = c->p->type_v;
    for (int64_t e = 0; e < dv; ++e) {
        float sum[LX_ATTN_MAX_GROUP] = {0};
        const int64_t row = vt_base + e * kv_size;
        for (int r = 0; r < vl->n_runs; ++r) {
            const int j0 = vl->run_j[r];
            const int64_t i0 = row + vl->idx[j0];
            for (int x = 0; x < vl->run_len[r]; ++x) {
                const float val = cache_at(c->v, tv, i0 + x);
                for (int h = 0; h < nh; ++h) sum[h] += S[h * LDS + j0 + x] * val;
            }
        }
        for (int h = 0; h < nh; ++h) acc[h * dv + e] = sum[h];
    }
}

static const kernel_set kernels_c = { dots_c, dots_q_c, logits_c, expsum_c, vacc_c, vtacc_c, 0 };

/* -- the VNNI kernel's arithmetic in portable C --
 *
 * dots_q_vnni (the x86 section below) step for step on arrays of lanes instead of registers:
 *   1. per head and pair of q blocks: the 64 quants and the lane corrections (qpairs_vnni)
 *   2. per cell and pair of K blocks: the 64 unsigned bytes u and the two scales (kpair_u, ld_d)
 *   3. vpdpbusd: 16 int32 lanes, lane l = corr_l + sum_{i<4} u[4l+i] * q[4l+i] (dpbusd_emul)
 *   4. lanes 0-7 (block 2pp), then lanes 8-15 (block 2pp + 1), into the cell's 8 float lanes:
 *      acc_l = fmaf((float) lane, d_q * d_k, acc_l) (fmaf is correctly rounded, as the FMA unit)
 *   5. the 8 lanes summed in the order of the cell's tile (dots_q_nc; dots_q_store's orders)
 * so it gives the VNNI kernel's scores bit for bit on any CPU, which are also the AVX2 kernel's
 * (the same lanes, the same float steps). It is the oracle of the VNNI arithmetic for machines
 * without VNNI (lx_attn_dots_q_vnni_emul); a change to one of the two is a change to both. */

/* cells per step of the quantized-K dots (AVX2 and VNNI alike): a register tile of NH x NC
 * accumulators; after the steps of NC cells the rest go 2 at a time (NC >= 2), then 1 at a time */
static inline int dots_q_nc(int NH) { return NH <= 2 ? 4 : NH <= 4 ? 2 : 1; }

/* step 3, vpdpbusd on 16 int32 lanes: lane l += sum_{i<4} a[4l+i] * b[4l+i], a unsigned and b
 * signed bytes; each product is formed in 16 bits (255 * -128 fits) and the sum wraps in 32 bits,
 * as the instruction does (it never wraps here: |lane| < 2^18) */
static void dpbusd_emul(int32_t lane[16], const uint8_t a[64], const int8_t b[64]) {
    for (int l = 0; l < 16; ++l) {
        uint32_t s = (uint32_t) lane[l];
        for (int i = 0; i < 4; ++i) s += (uint32_t) (int32_t) (int16_t) (a[4 * l + i] * b[4 * l + i]);
        lane[l] = (int32_t) s;
    }
}

/* step 1 (qpairs_vnni): per head and pair of blocks, the 64 quants (zeros above the last block
 * when d_k / 32 is odd) and the lane corrections -128 (q8_0) or -8 (q4_0) times each lane's sum */
typedef struct {
    int8_t  qv[LX_ATTN_MAX_GROUP][LX_ATTN_MAX_D / 64][64];
    int32_t corr[LX_ATTN_MAX_GROUP][LX_ATTN_MAX_D / 64][16];
} qpairs_emul;

static void qpairs_vnni_emul(const q8_heads *qh, int nh, int64_t nb, const int KT, qpairs_emul *qp) {
    const int64_t np = (nb + 1) / 2;
    uint8_t ones[64];
    memset(ones, 1, sizeof ones);
    for (int h = 0; h < nh; ++h) {
        for (int64_t pp = 0; pp < np; ++pp) {
            const bool two = 2 * pp + 1 < nb;
            int8_t *q = qp->qv[h][pp];
            memcpy(q, qh->qs[h] + 64 * pp, 32);
            if (two) memcpy(q + 32, qh->qs[h] + 64 * pp + 32, 32);
            else memset(q + 32, 0, 32);
            int32_t s4[16] = {0};
            dpbusd_emul(s4, ones, q);
            for (int l = 0; l < 16; ++l)
                qp->corr[h][pp][l] = (int32_t) (0u - ((uint32_t) s4[l] << (KT == CT_Q8 ? 7 : 3)));
        }
    }
}

/* step 2 (kpair_u): u of blocks kb, kb + bb (the second only if two; else zero bytes), in q's
 * value order: q8_0 k xor 0x80 = k + 128, q4_0 the nibbles (k + 8), low ones first */
static void kpair_u_emul(const uint8_t *kb, int64_t bb, const bool two, const int KT, uint8_t u[64]) {
    memset(u, 0, 64);
    for (int half = 0; half < (two ? 2 : 1); ++half) {
        const uint8_t *b = kb + half * bb + 2;
        uint8_t *o = u + 32 * half;
        if (KT == CT_Q8) {
            for (int i = 0; i < 32; ++i) o[i] = (uint8_t) (b[i] ^ 0x80);
        } else {
            for (int i = 0; i < 16; ++i) { o[i] = b[i] & 0x0F; o[16 + i] = b[i] >> 4; }
        }
    }
}

/* step 5: the sum of a cell's 8 float lanes done NC at a time (lx_hsum8x4_avx2 / lx_hsum8x2_avx2's
 * order for 4 or 2 cells, lx_hsum8_avx2's for one) */
static float dots_q_hsum_emul(const float a[8], const int NC) {
    if (NC >= 2) return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

/* S[h][j] of NH heads for the cell whose K row starts at kr, done in a tile of NC cells; with
 * isum != NULL, isum[h][b] <- the exact integer dot of block b (the sum of its 8 int32 lanes) */
static void dots_q_vnni_emul_cell(const attn_ctx *c, const q8_heads *qh, const qpairs_emul *qp, const uint8_t *kr,
                                  int j, float *S, const int NH, const int NC, const int KT, int32_t *isum) {
    const int64_t nb = c->p->d_k / LX_QK, np = (nb + 1) / 2;
    const int64_t bb = KT == CT_Q8 ? (int64_t) sizeof(lx_block_q8_0) : (int64_t) sizeof(lx_block_q4_0);
    float acc[LX_ATTN_MAX_GROUP][8] = {{0}};
    for (int64_t pp = 0; pp < np; ++pp) {
        const bool two = 2 * pp + 1 < nb;
        const uint8_t *kb = kr + 2 * pp * bb;                             /* step 2: K */
        uint8_t u[64];
        kpair_u_emul(kb, bb, two, KT, u);
        const float dk0 = block_d(kb), dk1 = two ? block_d(kb + bb) : 0.0f;
        for (int h = 0; h < NH; ++h) {
            const float dq0 = qh->d[h][2 * pp], dq1 = two ? qh->d[h][2 * pp + 1] : 0.0f;
            int32_t lane[16];                                             /* step 3: the exact int32 lanes */
            memcpy(lane, qp->corr[h][pp], sizeof lane);
            dpbusd_emul(lane, u, qp->qv[h][pp]);
            for (int l = 0; l < 8; ++l) acc[h][l] = fmaf((float) lane[l], dq0 * dk0, acc[h][l]);   /* step 4 */
            if (two) for (int l = 0; l < 8; ++l) acc[h][l] = fmaf((float) lane[8 + l], dq1 * dk1, acc[h][l]);
            if (isum) {
                int32_t s0 = 0, s1 = 0;
                for (int l = 0; l < 8; ++l) { s0 += lane[l]; s1 += lane[8 + l]; }
                isum[h * nb + 2 * pp] = s0;
                if (two) isum[h * nb + 2 * pp + 1] = s1;
            }
        }
    }
    for (int h = 0; h < NH; ++h) S[h * LDS + j] = dots_q_hsum_emul(acc[h], NC);   /* step 5 */
}

/* dots_q_vnni_impl's tiling: S[h*LDS + j] as any dots_q kernel; with isum != NULL also
 * isum[h * ld_isum + j * nb + b] <- the integer dot of block b of visible cell j */
static void dots_q_vnni_emul(const attn_ctx *c, const q8_heads *qh, int64_t k_base, const vis_list *vl,
                             int nh, float *S, int32_t *isum, int64_t ld_isum) {
    const int KT = c->p->type_k == LX_TYPE_Q4_0 ? CT_Q4 : CT_Q8;
    const int64_t nb = c->p->d_k / LX_QK;
    const int NC = dots_q_nc(nh);
    qpairs_emul qp;
    qpairs_vnni_emul(qh, nh, nb, KT, &qp);
    const uint8_t *k0 = elt_ptr(c->k, c->p->type_k, k_base);
    int32_t cell_isum[LX_ATTN_MAX_GROUP * LX_ATTN_MAX_D / LX_QK];
    int j = 0;
    for (int step = NC; step >= 1; step = step > 2 ? 2 : step - 1) {     /* NC, then 2 (NC >= 2), then 1 */
        for (; j + step <= vl->n; j += step) {
            for (int x = 0; x < step; ++x) {
                dots_q_vnni_emul_cell(c, qh, &qp, k0 + (int64_t) vl->idx[j + x] * c->kb_cell, j + x, S, nh, step,
                                      KT, isum ? cell_isum : NULL);
                if (isum)
                    for (int h = 0; h < nh; ++h)
                        memcpy(isum + h * ld_isum + (int64_t) (j + x) * nb, cell_isum + h * nb,
                               (size_t) nb * sizeof(int32_t));
            }
        }
    }
}

/* -- x86-64: AVX2 + FMA + F16C, AVX-512, AVX-512 + VNNI -- *
 *
 * The float kernels (dots, expsum, V and V^T accumulation) are written once over LX_W-lane
 * vectors at the end of this file and compiled twice by including the file into itself
 * (LX_ATTN_PASS): 8 lanes for AVX2, 16 for AVX-512, whose tails take masked loads where AVX2 adds
 * a scalar tail (LX_MASKED). The quantized-K dots have their own kernels: maddubs on one block per
 * ymm (AVX2, AVX-512) and vpdpbusd on two blocks per zmm (VNNI).
 */

#ifdef LX_X86
#define LX_AVX2 __attribute__((target("avx2,fma,f16c")))
#define LX_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
#define LX_AVX512_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))

/* the f16 scale at p as float (F16C; a NaN scale stays a NaN) */
static LX_ALWAYS_INLINE LX_AVX2 float ld_d(const uint8_t *p) {
    uint16_t d;
    memcpy(&d, p, sizeof d);
    return _cvtsh_ss(d);
}

/* bytes of n >= 0 values (a multiple of 32) of quantized kernel type VT */
static LX_ALWAYS_INLINE int64_t qbytes(const int VT, int64_t n) {
    const int64_t bb = VT == CT_Q8 ? (int64_t) sizeof(lx_block_q8_0) : (int64_t) sizeof(lx_block_q4_0);
    return (int64_t) ((uint64_t) n >> 5) * bb;
}

/* the first byte of the quantized row at element off (off >= 0, a multiple of 32) */
static LX_ALWAYS_INLINE const uint8_t *qrow(const void *base, const int VT, int64_t off) {
    return (const uint8_t *) base + qbytes(VT, off);
}

/* Software prefetch of the rows of visible cells [j, j + n), K's and V's into L2
 * (prefetch_rows), PF_AHEAD cells ahead of the dots. Rows of one kv head sit
 * n_head_kv * d * elt bytes apart, a stride the hardware prefetchers follow
 * poorly once it reaches a few hundred bytes. */
enum { PF_AHEAD = 16 };

/* the byte addresses of the K (and V) rows of a chunk's first cell for one kv head */
typedef struct {
    const char *k0, *v0;
} pf_rows;

static LX_ALWAYS_INLINE pf_rows pf_at(const attn_ctx *c, int64_t k_base, int64_t k_stride) {
    const lx_attn_params *p = c->p;
    pf_rows pf;
    pf.k0 = (const char *) elt_ptr(c->k, p->type_k, k_base);
    pf.v0 = NULL;
    if (!c->vtrans) {
        const int64_t v_base = k_base / k_stride * (p->n_head_kv * p->d_v) + (k_base % k_stride) / p->d_k * p->d_v;
        pf.v0 = (const char *) elt_ptr(c->v, p->type_v, v_base);
    }
    return pf;
}

/* the K and V rows of visible cells [j, j + n) into L2 (prefetcht1): into L1 (prefetcht0) K's rows left Gemma 3's
 * decode step at depth 8192 3-5% slower on a Sapphire Rapids (11.73-11.98 vs 11.35-11.38 ms, alternating) */
static LX_ALWAYS_INLINE void prefetch_rows(const attn_ctx *c, const pf_rows *pf, const vis_list *vl, int j, int n) {
    const int end = j + n < vl->n ? j + n : vl->n;
    for (; j < end; ++j) {
        const char *kr = pf->k0 + (int64_t) vl->idx[j] * c->kb_cell;
        for (int64_t b = 0; b < c->kb_head; b += 64) __builtin_prefetch(kr + b, 0, 2);
        if (!c->vtrans) {
            const char *vr = pf->v0 + (int64_t) vl->idx[j] * c->vb_cell;
            for (int64_t b = 0; b < c->vb_head; b += 64) __builtin_prefetch(vr + b, 0, 2);
        }
    }
}

/* Rows per tile of the V accumulation: the tile's rows are consumed whole before
 * the next tile, so they stay in L1 even when the row stride is a large power of
 * two (n_head_kv * d_v * 2 bytes) that maps every row to the same cache sets. */
enum { VACC_TILE = 16 };

/* rows per tile of the quantized V accumulation: its rows are not a power of two apart (the reason
 * for VACC_TILE), and a longer tile spreads the per-tile work (row addresses, scales, weights) */
enum { VQ_TILE = 64 };

/* -- quantized V: acc[h] += P[h][j] * d_jb * q_j (block b of row j). Per tile of rows the weights
 * W[h][b][j] = P[h][j] * d_jb are formed first (one vector product per head, block and 8 or 16
 * rows), so the inner loop only converts the quants and does one FMA per head and vector, as the
 * f16 loop does. (ggml multiplies (q * d) by P; the product is rounded once more here, well
 * inside LX_ATTN_MAX_ERR.) */

/* rowp[jj] <- the V row of visible cell j0 + jj (jj < nj; the rest repeat the first, so that
 * fixed-length loops read valid rows), D16[b][jj] <- the f16 scale of its block b */
static LX_ALWAYS_INLINE void qscales(const uint8_t *v0, int64_t vs, int64_t bb, int64_t nb,
                                     const vis_list *vl, int j0, int nj, const uint8_t *rowp[VQ_TILE],
                                     uint16_t D16[][VQ_TILE]) {
    for (int jj = 0; jj < nj; ++jj) rowp[jj] = v0 + (int64_t) vl->idx[j0 + jj] * vs;
    for (int jj = nj; jj < VQ_TILE; ++jj) rowp[jj] = rowp[0];
    for (int64_t b = 0; b < nb; ++b)
        for (int jj = 0; jj < VQ_TILE; ++jj) memcpy(&D16[b][jj], rowp[jj] + b * bb, sizeof(uint16_t));
}

/* prefetch V^T channel row `row` over the chunk's visible runs (into L1; each line once) */
enum { VT_PF_AHEAD = 4 };

static LX_ALWAYS_INLINE void prefetch_vt(const attn_ctx *c, int64_t row, const vis_list *vl) {
    const int64_t es = c->p->type_v == LX_TYPE_F16 ? 2 : 4;
    const uintptr_t base = (uintptr_t) c->v;
    uintptr_t next = 0;                                  /* first line not yet prefetched */
    for (int r = 0; r < vl->n_runs; ++r) {
        const int j0 = vl->run_j[r];
        uintptr_t lo = (base + (uintptr_t) ((row + vl->idx[j0]) * es)) & ~(uintptr_t) 63;
        const uintptr_t hi = base + (uintptr_t) ((row + vl->idx[j0 + vl->run_len[r] - 1]) * es);
        if (lo < next) lo = next;
        for (; lo <= hi; lo += 64) __builtin_prefetch((const void *) lo, 0, 3);
        next = lo;
    }
}

/* The V^T sums run over blocks of W visible cells (j in [W*b, W*b + W)), lane u of a block taking
 * cell j = W*b + u: the lanes are a function of j alone, so the sums do not depend on where the
 * visible cells sit. A block of W consecutive cells is one load (with masked_tail, the last,
 * partial block too), any other is gathered; consecutive loadable blocks that continue each other
 * form one segment (a run of the chunk, cut at multiples of W). */
typedef struct {
    int n;
    int j0[LX_ATTN_CHUNK / 8];      /* [n] first visible index of the segment (a multiple of W) */
    int len[LX_ATTN_CHUNK / 8];     /* [n] its visible cells                                    */
    bool dense[LX_ATTN_CHUNK / 8];  /* [n] consecutive cells (loads) or one gathered block      */
} vt_segs;

static LX_ALWAYS_INLINE void vt_segments(const vis_list *vl, const int W, const bool masked_tail, vt_segs *sg) {
    sg->n = 0;
    for (int j = 0; j < vl->n; j += W) {
        const int w = vl->n - j < W ? vl->n - j : W;
        bool dense = w == W || masked_tail;   /* (idx is not increasing through a perm) */
        for (int u = 1; dense && u < w; ++u) dense = vl->idx[j + u] == vl->idx[j] + u;
        const int k = sg->n - 1;
        if (dense && k >= 0 && sg->dense[k] && vl->idx[j] == vl->idx[sg->j0[k]] + sg->len[k]) {
            sg->len[k] += w;
            continue;
        }
        sg->j0[sg->n] = j;
        sg->len[sg->n] = w;
        sg->dense[sg->n] = dense;
        sg->n++;
    }
}

/* one function per (NH, type) so that the accumulators live in registers */
#define LX_NH_CASES(X) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8)

typedef void (*dots_nh_fn)(const attn_ctx *, const float *, int64_t, int64_t, const vis_list *, float *);
typedef void (*vacc_nh_fn)(const attn_ctx *, const float *, int64_t, int64_t, const vis_list *, float *);
typedef void (*vtacc_nh_fn)(const attn_ctx *, const float *, int64_t, const vis_list *, float *);
typedef void (*dots_q_nh_fn)(const attn_ctx *, const q8_heads *, int64_t, int64_t, const vis_list *, float *);

/* the float kernels, 8 lanes (AVX2) */
#define LX_ATTN_PASS 1
#define SFX(f) f##_avx2
#define LX_TGT LX_AVX2
#define LX_W 8
#define LX_MASKED 0
#define VF __m256
#define VZERO() _mm256_setzero_ps()
#define VSET1(x) _mm256_set1_ps(x)
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSTORE(p, v) _mm256_storeu_ps(p, v)
#define VSTOREA(p, v) _mm256_store_ps(p, v)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VADD(a, b) _mm256_add_ps(a, b)
#define VSUB(a, b) _mm256_sub_ps(a, b)
#define VMUL(a, b) _mm256_mul_ps(a, b)
#define VEXP(x) lx_exp8_avx2(x)
#define VFOLD8(v) (v)
#define VCVTPH(p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (p)))   /* 8 halves at p */
#define VQ8(p) _mm_loadl_epi64((const __m128i *) (p))                       /* 8 bytes at p  */
#define VI8TOF(q) _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q))
#include "attention.c"

/* the float kernels, 16 lanes (AVX-512: F + BW + VL + DQ, 32 registers, masked tails) */
#define LX_ATTN_PASS 2
#define SFX(f) f##_avx512
#define LX_TGT LX_AVX512
#define LX_W 16
#define LX_MASKED 1
#define VF __m512
#define VZERO() _mm512_setzero_ps()
#define VSET1(x) _mm512_set1_ps(x)
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSTORE(p, v) _mm512_storeu_ps(p, v)
#define VSTOREA(p, v) _mm512_store_ps(p, v)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VADD(a, b) _mm512_add_ps(a, b)
#define VSUB(a, b) _mm512_sub_ps(a, b)
#define VMUL(a, b) _mm512_mul_ps(a, b)
#define VEXP(x) lx_exp16_avx512(x)
#define VFOLD8(v) lx_fold16_avx512(v)
#define VCVTPH(p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *) (p)))  /* 16 halves at p */
#define VQ8(p) _mm_loadu_si128((const __m128i *) (p))                        /* 16 bytes at p */
#define VI8TOF(q) _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q))
/* the first n (1 .. 16) lanes, zeros above */
#define VLOADN(p, n) _mm512_maskz_loadu_ps((__mmask16) ((1u << (n)) - 1u), p)
#define VCVTPHN(p, n) _mm512_cvtph_ps(_mm256_maskz_loadu_epi16((__mmask16) ((1u << (n)) - 1u), p))
#define VSTOREN(p, v, n) _mm512_mask_storeu_ps(p, (__mmask16) ((1u << (n)) - 1u), v)
#include "attention.c"

/* -- quantized K (AVX2): integer block dots as ggml's mul_sum_i8_pairs: |k| (unsigned) times q
 * with k's sign, maddubs to int16 pairs (|k| <= 128, |q| <= 127: no saturation), madd to int32
 * lanes of 4 products, exact; then float lanes scaled by d_q * d_k accumulated with FMA.
 *
 * The float steps, which the VNNI kernel shares (so that AVX2, AVX-512 and VNNI give the same
 * scores bit for bit): int32 lane l (values 4l .. 4l+3 of block b) of cell x and head h goes into
 *     acc[h][x][l] = fmaf((float) lane, d_q,b * d_k,b, acc[h][x][l])      blocks b in order
 * and the score is the sum of the 8 lanes in lx_hsum8x4_avx2's order when the cell is done with
 * others (dots_q_nc cells per step, then 2 at a time), lx_hsum8_avx2's when it is done alone
 * (dots_q_store). */

/* S[h][j .. j + NC) <- the sums of the 8 lanes of acc[h][0 .. NC) (the order of NC: see above) */
static LX_ALWAYS_INLINE LX_AVX2 void dots_q_store(__m256 acc[][4], float *S, int j, const int NH, const int NC) {
    for (int h = 0; h < NH; ++h) {
        if (NC == 4) {
            _mm_storeu_ps(S + h * LDS + j, lx_hsum8x4_avx2(acc[h][0], acc[h][1], acc[h][2], acc[h][3]));
        } else if (NC == 2) {
            float r[4];
            _mm_storeu_ps(r, lx_hsum8x2_avx2(acc[h][0], acc[h][1]));
            S[h * LDS + j] = r[0];
            S[h * LDS + j + 1] = r[1];
        } else {
            S[h * LDS + j] = lx_hsum8_avx2(acc[h][0]);
        }
    }
}

/* the 32 values of the K block at kb as int8 (q4_0: nibble - 8) */
static LX_ALWAYS_INLINE LX_AVX2 __m256i kblock32(const uint8_t *kb, const int KT) {
    if (KT == CT_Q8) return _mm256_loadu_si256((const __m256i *) (kb + 2));
    return _mm256_sub_epi8(lx_nib32_avx2(kb + 2), _mm256_set1_epi8(8));
}

/* S[h][j .. j + NC) of NH heads from a quantized K */
static LX_ALWAYS_INLINE LX_AVX2 void dots_q_avx2_cells(const attn_ctx *c, const q8_heads *qh, const char *k0,
                                                       const vis_list *vl, int j, float *S,
                                                       const int NH, const int NC, const int KT) {
    const int64_t nb = c->p->d_k / LX_QK;
    const int64_t bb = KT == CT_Q8 ? (int64_t) sizeof(lx_block_q8_0) : (int64_t) sizeof(lx_block_q4_0);
    const uint8_t *kr[4];
    for (int x = 0; x < NC; ++x) kr[x] = (const uint8_t *) k0 + (int64_t) vl->idx[j + x] * c->kb_cell;
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc[LX_ATTN_MAX_GROUP][4];
    for (int h = 0; h < NH; ++h)
        for (int x = 0; x < NC; ++x) acc[h][x] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        __m256i kv[4], ax[4];
        __m256 dk[4];
        for (int x = 0; x < NC; ++x) {
            const uint8_t *kb = kr[x] + b * bb;
            kv[x] = kblock32(kb, KT);
            ax[x] = _mm256_sign_epi8(kv[x], kv[x]);
            dk[x] = _mm256_set1_ps(ld_d(kb));
        }
        for (int h = 0; h < NH; ++h) {
            const __m256i qv = _mm256_load_si256((const __m256i *) (qh->qs[h] + b * LX_QK));
            const __m256 dq = _mm256_set1_ps(qh->d[h][b]);
            for (int x = 0; x < NC; ++x) {
                const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(ax[x], _mm256_sign_epi8(qv, kv[x])), ones);
                acc[h][x] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(dq, dk[x]), acc[h][x]);
            }
        }
    }
    dots_q_store(acc, S, j, NH, NC);
}

static LX_ALWAYS_INLINE LX_AVX2 void dots_q_avx2_impl(const attn_ctx *c, const q8_heads *qh, int64_t k_base,
                                                      int64_t k_stride, const vis_list *vl, float *S,
                                                      const int NH, const int KT) {
    const int NC = dots_q_nc(NH);
    const pf_rows pf = pf_at(c, k_base, k_stride);
    prefetch_rows(c, &pf, vl, 0, PF_AHEAD);
    int j = 0;
    if (NC == 4) for (; j + 4 <= vl->n; j += 4) {
        prefetch_rows(c, &pf, vl, j + PF_AHEAD, 4);
        dots_q_avx2_cells(c, qh, pf.k0, vl, j, S, NH, 4, KT);
    }
    if (NC >= 2) for (; j + 2 <= vl->n; j += 2) {
        prefetch_rows(c, &pf, vl, j + PF_AHEAD, 2);
        dots_q_avx2_cells(c, qh, pf.k0, vl, j, S, NH, 2, KT);
    }
    for (; j < vl->n; ++j) {
        prefetch_rows(c, &pf, vl, j + PF_AHEAD, 1);
        dots_q_avx2_cells(c, qh, pf.k0, vl, j, S, NH, 1, KT);
    }
}

#define LX_DEF_DOTS_Q_AVX2(NH)                                                                              \
    static LX_AVX2 void dots_q_avx2_##NH##_q8(const attn_ctx *c, const q8_heads *qh, int64_t kb, int64_t ks, \
                                              const vis_list *vl, float *S) {                               \
        dots_q_avx2_impl(c, qh, kb, ks, vl, S, NH, CT_Q8);                                                  \
    }                                                                                                       \
    static LX_AVX2 void dots_q_avx2_##NH##_q4(const attn_ctx *c, const q8_heads *qh, int64_t kb, int64_t ks, \
                                              const vis_list *vl, float *S) {                               \
        dots_q_avx2_impl(c, qh, kb, ks, vl, S, NH, CT_Q4);                                                  \
    }
LX_NH_CASES(LX_DEF_DOTS_Q_AVX2)
#define LX_TAB_DOTS_Q_Q8(NH) dots_q_avx2_##NH##_q8,
#define LX_TAB_DOTS_Q_Q4(NH) dots_q_avx2_##NH##_q4,
static const dots_q_nh_fn dots_q_avx2_tab[2][LX_ATTN_MAX_GROUP] = {
    { LX_NH_CASES(LX_TAB_DOTS_Q_Q8) }, { LX_NH_CASES(LX_TAB_DOTS_Q_Q4) } };

static void dots_q_avx2(const attn_ctx *c, const q8_heads *qh, int64_t k_base, int64_t k_stride,
                        const vis_list *vl, int nh, float *S) {
    dots_q_avx2_tab[c->p->type_k == LX_TYPE_Q4_0][nh - 1](c, qh, k_base, k_stride, vl, S);
}

/* -- quantized K with AVX-512 VNNI: the integer lanes of two blocks (64 values) per vpdpbusd, the
 * float steps of the AVX2 kernel (above), so that the scores are the same bits as at AVX2 and
 * AVX-512. vpdpbusd multiplies unsigned bytes by signed ones, so K enters as u = k + 128 (q8_0:
 * k xor 0x80) or as the raw nibble u = k + 8 (q4_0), and the accumulator starts at -128 (or -8)
 * times the sum of the four q quants of each lane: every int32 lane is then the exact sum of its 4
 * products k_i q_i (|u q| <= 255 * 127 and the 4 products fit the instruction's 16-bit
 * intermediates; the lane sums are far from 2^31), the same lanes (4 consecutive values) as
 * maddubs + madd form. Lanes 0-7 hold block 2pp, lanes 8-15 block 2pp + 1; each half then takes
 * the AVX2 kernel's FMA into the cell's 8 float lanes, blocks in order, and the cells are tiled
 * and summed as there (dots_q_nc, dots_q_store).
 * dots_q_vnni_emul (portable C, further up) is this kernel step for step (steps 1-5 below) on
 * arrays of lanes: it gives its scores bit for bit on any CPU, and the tests check it against the
 * oracle's integer block dots and against the AVX2 kernel's scores. A change to one is a change
 * to both. */

#define LX_AVX512_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))

/* step 2, u of blocks kb, kb + bb (the second only if two; else zero bytes), in q's value order */
static LX_ALWAYS_INLINE LX_AVX512 __m512i kpair_u(const uint8_t *kb, int64_t bb, const bool two, const int KT) {
    if (KT == CT_Q8) {
        const __m256i lo = _mm256_loadu_si256((const __m256i *) (kb + 2));
        const __m256i hi = two ? _mm256_loadu_si256((const __m256i *) (kb + bb + 2)) : _mm256_set1_epi8((char) 0x80);
        return _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1), _mm512_set1_epi8((char) 0x80));
    }
    const __m128i b0 = _mm_loadu_si128((const __m128i *) (kb + 2));
    const __m128i b1 = two ? _mm_loadu_si128((const __m128i *) (kb + bb + 2)) : _mm_setzero_si128();
    const __m256i y0 = _mm256_set_m128i(_mm_srli_epi16(b0, 4), b0);
    const __m256i y1 = _mm256_set_m128i(_mm_srli_epi16(b1, 4), b1);
    return _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(y0), y1, 1), _mm512_set1_epi8(0x0F));
}

/* Step 1, the query side of one call: per head and pair of blocks, the 64 quants (zeros above the
 * last block when d_k / 32 is odd) and the lane corrections -128 (q8_0) or -8 (q4_0) times the
 * sum of each lane's 4 quants; the block scales stay in qh. */
typedef struct {
    __m512i qv[LX_ATTN_MAX_GROUP][LX_ATTN_MAX_D / 64];
    __m512i corr[LX_ATTN_MAX_GROUP][LX_ATTN_MAX_D / 64];
} qpairs512;

static LX_ALWAYS_INLINE LX_AVX512_VNNI void qpairs_vnni(const q8_heads *qh, int nh, int64_t nb, const int KT,
                                                        qpairs512 *qp) {
    const int64_t np = (nb + 1) / 2;
    for (int h = 0; h < nh; ++h) {
        for (int64_t pp = 0; pp < np; ++pp) {
            const bool two = 2 * pp + 1 < nb;
            const __m256i lo = _mm256_load_si256((const __m256i *) (qh->qs[h] + 64 * pp));
            const __m256i hi = two ? _mm256_load_si256((const __m256i *) (qh->qs[h] + 64 * pp + 32))
                                   : _mm256_setzero_si256();
            const __m512i q = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
            const __m512i s4 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1), q);
            qp->qv[h][pp] = q;
            qp->corr[h][pp] = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(s4, KT == CT_Q8 ? 7 : 3));
        }
    }
}

/* S[h][j .. j + NC) of NH heads from a quantized K */
static LX_ALWAYS_INLINE LX_AVX512_VNNI void dots_q_vnni_cells(const attn_ctx *c, const q8_heads *qh,
                                                              const qpairs512 *qp, const char *k0, const vis_list *vl,
                                                              int j, float *S, const int NH, const int NC,
                                                              const int KT) {
    const int64_t nb = c->p->d_k / LX_QK, np = (nb + 1) / 2;
    const int64_t bb = KT == CT_Q8 ? (int64_t) sizeof(lx_block_q8_0) : (int64_t) sizeof(lx_block_q4_0);
    const uint8_t *kr[4];
    for (int x = 0; x < NC; ++x) kr[x] = (const uint8_t *) k0 + (int64_t) vl->idx[j + x] * c->kb_cell;
    __m256 acc[LX_ATTN_MAX_GROUP][4];
    for (int h = 0; h < NH; ++h)
        for (int x = 0; x < NC; ++x) acc[h][x] = _mm256_setzero_ps();
    for (int64_t pp = 0; pp < np; ++pp) {
        const bool two = 2 * pp + 1 < nb;
        __m512i u[4];
        __m256 dk0[4], dk1[4];
        for (int x = 0; x < NC; ++x) {                                   /* step 2: K */
            const uint8_t *kb = kr[x] + 2 * pp * bb;
            u[x] = kpair_u(kb, bb, two, KT);
            dk0[x] = _mm256_set1_ps(ld_d(kb));
            dk1[x] = two ? _mm256_set1_ps(ld_d(kb + bb)) : _mm256_setzero_ps();
        }
        for (int h = 0; h < NH; ++h) {
            const __m256 dq0 = _mm256_set1_ps(qh->d[h][2 * pp]);
            const __m256 dq1 = two ? _mm256_set1_ps(qh->d[h][2 * pp + 1]) : _mm256_setzero_ps();
            for (int x = 0; x < NC; ++x) {
                /* step 3: the exact int32 lanes; step 4: block 2pp's into the float lanes, then 2pp + 1's */
                const __m512 pf = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(qp->corr[h][pp], u[x], qp->qv[h][pp]));
                acc[h][x] = _mm256_fmadd_ps(_mm512_castps512_ps256(pf), _mm256_mul_ps(dq0, dk0[x]), acc[h][x]);
                if (two)
                    acc[h][x] = _mm256_fmadd_ps(_mm512_extractf32x8_ps(pf, 1), _mm256_mul_ps(dq1, dk1[x]), acc[h][x]);
            }
        }
    }
    dots_q_store(acc, S, j, NH, NC);                                      /* step 5 */
}

static LX_ALWAYS_INLINE LX_AVX512_VNNI void dots_q_vnni_impl(const attn_ctx *c, const q8_heads *qh, int64_t k_base,
                                                             int64_t k_stride, const vis_list *vl, float *S,
                                                             const int NH, const int KT) {
    const int NC = dots_q_nc(NH);
    qpairs512 qp;
    qpairs_vnni(qh, NH, c->p->d_k / LX_QK, KT, &qp);
    const pf_rows pf = pf_at(c, k_base, k_stride);
    prefetch_rows(c, &pf, vl, 0, PF_AHEAD);
    int j = 0;
    if (NC == 4) for (; j + 4 <= vl->n; j += 4) {
        prefetch_rows(c, &pf, vl, j + PF_AHEAD, 4);
        dots_q_vnni_cells(c, qh, &qp, pf.k0, vl, j, S, NH, 4, KT);
    }
    if (NC >= 2) for (; j + 2 <= vl->n; j += 2) {
        prefetch_rows(c, &pf, vl, j + PF_AHEAD, 2);
        dots_q_vnni_cells(c, qh, &qp, pf.k0, vl, j, S, NH, 2, KT);
    }
    for (; j < vl->n; ++j) {
        prefetch_rows(c, &pf, vl, j + PF_AHEAD, 1);
        dots_q_vnni_cells(c, qh, &qp, pf.k0, vl, j, S, NH, 1, KT);
    }
}

#define LX_DEF_DOTS_Q_VNNI(NH)                                                                              \
    static LX_AVX512_VNNI void dots_q_vnni_##NH##_q8(const attn_ctx *c, const q8_heads *qh, int64_t kb,     \
                                                     int64_t ks, const vis_list *vl, float *S) {            \
        dots_q_vnni_impl(c, qh, kb, ks, vl, S, NH, CT_Q8);                                                  \
    }                                                                                                       \
    static LX_AVX512_VNNI void dots_q_vnni_##NH##_q4(const attn_ctx *c, const q8_heads *qh, int64_t kb,     \
                                                     int64_t ks, const vis_list *vl, float *S) {            \
        dots_q_vnni_impl(c, qh, kb, ks, vl, S, NH, CT_Q4);                                                  \
    }
LX_NH_CASES(LX_DEF_DOTS_Q_VNNI)
#define LX_TABV_Q8(NH) dots_q_vnni_##NH##_q8,
#define LX_TABV_Q4(NH) dots_q_vnni_##NH##_q4,
static const dots_q_nh_fn dots_q_vnni_tab[2][LX_ATTN_MAX_GROUP] = {
    { LX_NH_CASES(LX_TABV_Q8) }, { LX_NH_CASES(LX_TABV_Q4) } };

static void dots_q_vnni(const attn_ctx *c, const q8_heads *qh, int64_t k_base, int64_t k_stride,
                        const vis_list *vl, int nh, float *S) {
    dots_q_vnni_tab[c->p->type_k == LX_TYPE_Q4_0][nh - 1](c, qh, k_base, k_stride, vl, S);
}

/* logits_c in 8 lanes: the same multiply and add per value, and row_max's lanes (lane u takes the
 * values j = u mod 8, a value replaces the lane's only when greater: _mm256_max_ps(v, lane)), tail
 * and fold, so the same bits (signed zeros and NaNs included) */
static LX_AVX2 float logits_avx2(float *row, int n, float scale, const float *mv) {
    const __m256 s = _mm256_set1_ps(scale);
    __m256 lane = _mm256_set1_ps(row[0] * scale + mv[0]);
    int j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 x = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(row + j), s), _mm256_loadu_ps(mv + j));
        _mm256_storeu_ps(row + j, x);
        lane = _mm256_max_ps(x, lane);
    }
    float l[8];
    _mm256_storeu_ps(l, lane);
    for (; j < n; ++j) {
        row[j] = row[j] * scale + mv[j];
        l[0] = row[j] > l[0] ? row[j] : l[0];
    }
    float m = l[0];
    for (int u = 1; u < 8; ++u) m = l[u] > m ? l[u] : m;
    return m;
}

static const kernel_set kernels_avx2 = { dots_avx2, dots_q_avx2, logits_avx2, expsum_avx2, vacc_avx2, vtacc_avx2, 8 };
/* LX_SIMD_AVX512: a quantized K takes the AVX2 integer dots (maddubs); LX_SIMD_VNNI512 the VNNI ones */
static const kernel_set kernels_avx512 = { dots_avx512, dots_q_avx2, logits_avx2, expsum_avx512, vacc_avx512,
                                           vtacc_avx512, 16 };
static const kernel_set kernels_avx512_vnni = { dots_avx512, dots_q_vnni, logits_avx2, expsum_avx512, vacc_avx512,
                                                vtacc_avx512, 16 };
#endif /* LX_X86 */


/* ---- dispatch ---------------------------------------------------------------------- */

static const kernel_set *kernels_for(int level) {
#ifdef LX_X86
    if (level >= LX_SIMD_VNNI512) return &kernels_avx512_vnni;
    if (level >= LX_SIMD_AVX512) return &kernels_avx512;
    if (level >= LX_SIMD_AVX2) return &kernels_avx2;
#endif
    (void) level;
    return &kernels_c;
}

/* ---- chunk states and their merge ---------------------------------------------------- */

/* A softmax state of nh heads: m [nh] running max (-inf = empty), l [nh] sum of
 * exp(s - m), acc [nh][d_v] sum of exp(s - m) * v. */
typedef struct {
    float *m, *l, *acc;
} attn_state;

static inline attn_state state_at(float *base, int64_t hp) {
    attn_state st = { base, base + hp, base + 2 * hp };
    return st;
}

/* item w -> (stream, token, kv head, first query head, heads in this pass) */
typedef struct {
    int64_t s, t, g, h0;
    int nh;
} item_pos;

static item_pos item_at(const attn_ctx *c, int64_t w) {
    const lx_attn_params *p = c->p;
    item_pos it;
    const int64_t pass = w % c->n_pass;
    int64_t r = w / c->n_pass;
    it.g = r % p->n_head_kv;
    r /= p->n_head_kv;
    it.t = r % p->n_tps;
    it.s = r / p->n_tps;
    const int64_t first = pass * c->hp;
    const int64_t left = c->gqa - first;
    it.h0 = it.g * c->gqa + first;
    it.nh = (int) (left < c->hp ? left : c->hp);
    return it;
}

/* max of row[0 .. n), n >= 1, in 8 independent lanes (vectorisable; NaNs are skipped
 * unless the first value is one) */
static float row_max(const float *row, int n) {
    float lane[8];
    for (int u = 0; u < 8; ++u) lane[u] = row[0];
    int j = 0;
    for (; j + 8 <= n; j += 8)
        for (int u = 0; u < 8; ++u) lane[u] = row[j + u] > lane[u] ? row[j + u] : lane[u];
    for (; j < n; ++j) lane[0] = row[j] > lane[0] ? row[j] : lane[0];
    float m = lane[0];
    for (int u = 1; u < 8; ++u) m = lane[u] > m ? lane[u] : m;
    return m;
}

/* cells per step of the scans of a mask row: a step with no visible cell (or only visible ones)
 * is taken whole */
enum { SCAN_STEP = 64 };
_Static_assert(SCAN_STEP < LX_ATTN_CHUNK, "a scan step holds at most one chunk start");

/* visible cells (mask value != -inf) of mask row [x0, x0 + w) (a vectorisable count; a whole
 * step has a fixed trip count) */
static inline int count_visible(const float *mrow, int64_t x0, int w) {
    const float *m = mrow + x0;
    int n = 0;
    if (w == SCAN_STEP) {
        for (int x = 0; x < SCAN_STEP; ++x) n += m[x] != -INFINITY;
        return n;
    }
    for (int x = 0; x < w; ++x) n += m[x] != -INFINITY;
    return n;
}

/* vl <- the visible cells of mask row mrow from cell i0 on, in cell order, until LX_ATTN_CHUNK of
 * them are taken or cell i_end is reached (offsets from i0). Returns the cell after the last one
 * looked at: the next chunk's scan may start there. O(cells scanned). */
static int64_t gather_visible(const float *mrow, int64_t i0, int64_t i_end, vis_list *vl) {
    vl->n = 0;
    vl->n_runs = 0;
    const int w0 = (int) (i_end - i0 < LX_ATTN_CHUNK ? i_end - i0 : LX_ATTN_CHUNK);
    if (w0 > 0 && count_visible(mrow, i0, w0) == w0) {     /* the common case: all visible */
        for (int x = 0; x < w0; ++x) vl->idx[x] = x;
        memcpy(vl->mv, mrow + i0, (size_t) w0 * sizeof(float));
        vl->n = w0;
        vl->n_runs = 1;
        vl->run_j[0] = 0;
        vl->run_len[0] = w0;
        return i0 + w0;
    }
    int64_t i = i0;
    while (i < i_end && vl->n < LX_ATTN_CHUNK) {
        const int w = (int) (i_end - i < SCAN_STEP ? i_end - i : SCAN_STEP);
        const int nv = count_visible(mrow, i, w);
        if (nv == 0) { i += w; continue; }
        if (nv == w && vl->n + w <= LX_ATTN_CHUNK) {              /* all visible: one run */
            const int x0 = (int) (i - i0);
            if (vl->n > 0 && vl->idx[vl->n - 1] == x0 - 1) {
                vl->run_len[vl->n_runs - 1] += w;
            } else {
                vl->run_j[vl->n_runs] = vl->n;
                vl->run_len[vl->n_runs] = w;
                vl->n_runs++;
            }
            for (int x = 0; x < w; ++x) vl->idx[vl->n + x] = x0 + x;
            memcpy(vl->mv + vl->n, mrow + i, (size_t) w * sizeof(float));
            vl->n += w;
            i += w;
            continue;
        }
        const int64_t end = i + w;
        for (; i < end && vl->n < LX_ATTN_CHUNK; ++i) {
            const float mv = mrow[i];
            if (mv == -INFINITY) continue;
            const int x = (int) (i - i0);
            if (vl->n == 0 || vl->idx[vl->n - 1] != x - 1) {
                vl->run_j[vl->n_runs] = vl->n;
                vl->run_len[vl->n_runs] = 0;
                vl->n_runs++;
            }
            vl->run_len[vl->n_runs - 1]++;
            vl->idx[vl->n] = x;
            vl->mv[vl->n] = mv;
            vl->n++;
        }
    }
    return i;
}

/* b[ch] <- the cell of visible cell number ch * LX_ATTN_CHUNK of mask row mrow [n_kv], i.e. where
 * chunk ch starts (n_kv for a chunk past the row's visible cells), ch < n_chunks. One pass. */
static void row_bounds(const float *mrow, int64_t n_kv, int64_t n_chunks, int32_t *b) {
    int64_t seen = 0, ch = 0;           /* visible cells before cell i; the next chunk to place */
    for (int64_t i = 0; i < n_kv && ch < n_chunks; ) {
        const int w = (int) (n_kv - i < SCAN_STEP ? n_kv - i : SCAN_STEP);
        const int nv = count_visible(mrow, i, w);
        if (seen + nv <= ch * LX_ATTN_CHUNK) {       /* chunk ch does not start in this step */
            seen += nv;
            i += w;
            continue;
        }
        if (nv == w) {                               /* all visible: it starts at a known offset */
            b[ch] = (int32_t) (i + (ch * LX_ATTN_CHUNK - seen));      /* (SCAN_STEP < LX_ATTN_CHUNK: */
            ch++;                                                     /* one start per step at most) */
            seen += nv;
            i += w;
            continue;
        }
        for (const int64_t end = i + w; i < end; ++i) {
            if (mrow[i] == -INFINITY) continue;
            if (ch < n_chunks && seen == ch * LX_ATTN_CHUNK) b[ch++] = (int32_t) i;
            seen++;
        }
    }
    for (; ch < n_chunks; ++ch) b[ch] = (int32_t) n_kv;
}

/* vl's column offsets from column i0 -> the cells of those columns (perm: the stream's column ->
 * cell map), counted from cell 0; the runs become runs of consecutive cells */
static void remap_visible(vis_list *vl, const int32_t *perm, int64_t i0) {
    int prev = -2;
    vl->n_runs = 0;
    for (int j = 0; j < vl->n; ++j) {
        const int x = (int) perm[i0 + vl->idx[j]];
        if (x != prev + 1) {
            vl->run_j[vl->n_runs] = j;
            vl->run_len[vl->n_runs] = 0;
            vl->n_runs++;
        }
        vl->run_len[vl->n_runs - 1]++;
        vl->idx[j] = x;
        prev = x;
    }
}

/* item it's mask row [n_kv] */
static const float *mask_row(const attn_ctx *c, const item_pos *it) {
    return c->mask + (it->s * c->p->n_tps_pad + it->t) * c->p->n_kv;
}

/* The visible cells of item it's chunk whose scan runs from cell i0 to i_end (at most
 * LX_ATTN_CHUNK of them, gather_visible) into vl, their offsets counted from cell *c0 (0 through
 * a perm). Returns where the next chunk's scan may start. */
static int64_t chunk_gather(const attn_ctx *c, const item_pos *it, int64_t i0, int64_t i_end, vis_list *vl,
                            int64_t *c0) {
    const lx_attn_params *p = c->p;
    const int64_t next = gather_visible(mask_row(c, it), i0, i_end, vl);
    *c0 = i0;
    if (p->perm && vl->n) {
        remap_visible(vl, p->perm + it->s * p->n_kv, i0);
        *c0 = 0;
    }
    return next;
}

/* element offsets of item it's K row (of its kv head) of cell c0 and the stride between cells */
static int64_t k_base_of(const attn_ctx *c, const item_pos *it, int64_t c0, int64_t *stride) {
    const lx_attn_params *p = c->p;
    *stride = p->n_head_kv * p->d_k;
    return (it->s * p->kv_size + c0) * *stride + it->g * p->d_k;
}

/* the same for V (flash layout) */
static int64_t v_base_of(const attn_ctx *c, const item_pos *it, int64_t c0, int64_t *stride) {
    const lx_attn_params *p = c->p;
    *stride = p->n_head_kv * p->d_v;
    return (it->s * p->kv_size + c0) * *stride + it->g * p->d_v;
}

/* S [nh][LDS] <- the raw scores q . k of item it's heads over vl's cells */
static void chunk_dots(const attn_ctx *c, const kernel_set *ks, const item_pos *it, const vis_list *vl,
                       int64_t c0, float *S) {
    const lx_attn_params *p = c->p;
    const float *qh = c->q + ((it->s * p->n_tps + it->t) * p->n_head + it->h0) * p->d_k;
    int64_t k_stride;
    const int64_t k_base = k_base_of(c, it, c0, &k_stride);
    if (type_quant(p->type_k)) {
        /* the pass's query heads as q8_0, once per chunk (nh * d_k values against the chunk's
         * up to 256 * nh * d_k multiply-adds) */
        q8_heads qq;
        quantize_heads(qh, it->nh, p->d_k, &qq);
        ks->dots_q(c, &qq, k_base, k_stride, vl, it->nh, S);
    } else {
        ks->dots(c, qh, k_base, k_stride, vl, it->nh, S);
    }
}

/* st's m and l (and S's rows the weights P) of a non-empty chunk from its raw scores S
 * (chunk_dots): the logits, their max, the exp and its sum */
static void chunk_probs(const attn_ctx *c, const kernel_set *ks, const item_pos *it, const vis_list *vl, float *S,
                        attn_state st) {
    const lx_attn_params *p = c->p;
    const int nh = it->nh;

    /* scores -> logits, as llama.cpp's two paths define them */
    const float cap = p->softcap;
    for (int h = 0; h < nh; ++h) {
        float *row = S + h * LDS;
        if (cap == 0.0f) {                        /* both paths: score * scale + mask */
            st.m[h] = ks->logits(row, vl->n, p->scale, vl->mv);
            continue;
        }
        if (!c->vtrans) {
            const float scale = p->scale / cap;
            for (int j = 0; j < vl->n; ++j) row[j] = cap * tanhf(row[j] * scale) + vl->mv[j];
        } else {
            const float inv_cap = 1.0f / cap;
            for (int j = 0; j < vl->n; ++j) row[j] = cap * tanhf(row[j] * inv_cap) * p->scale + vl->mv[j];
        }
        st.m[h] = row_max(row, vl->n);
    }

    /* a head whose scores are all -inf (possible only with infinite inputs) takes no part */
    float m_safe[LX_ATTN_MAX_GROUP] = {0.0f};
    for (int h = 0; h < nh; ++h) m_safe[h] = st.m[h] == -INFINITY ? 0.0f : st.m[h];
    ks->expsum(S, vl->n, nh, m_safe, st.l);
    for (int h = 0; h < nh; ++h) if (st.m[h] == -INFINITY) st.l[h] = 0.0f;
}

/* st <- the state of a non-empty chunk from its raw scores S: chunk_probs, then the V
 * accumulation from the cache */
static void chunk_finish(const attn_ctx *c, const kernel_set *ks, const item_pos *it, const vis_list *vl,
                         int64_t c0, float *S, attn_state st) {
    const lx_attn_params *p = c->p;
    chunk_probs(c, ks, it, vl, S, st);
    if (!c->vtrans) {
        int64_t v_stride;
        const int64_t v_base = v_base_of(c, it, c0, &v_stride);
        ks->vacc(c, S, v_base, v_stride, vl, it->nh, st.acc);
    } else {
        const int64_t vt_base = (it->s * p->n_head_kv + it->g) * p->d_v * p->kv_size + c0;
        ks->vtacc(c, S, vt_base, vl, it->nh, st.acc);
    }
}

/* st <- the empty state of nh heads (m = -inf) */
static void state_clear(attn_state st, int nh) {
    for (int h = 0; h < nh; ++h) { st.m[h] = -INFINITY; st.l[h] = 0.0f; }
}

/* The state of the chunk whose scan runs from cell i0 to i_end (at most LX_ATTN_CHUNK visible
 * cells, gather_visible), computed from scratch into st; an empty chunk gives an empty state
 * (m = -inf). Reads only the K/V rows (or V^T columns) of visible cells. Returns where the
 * next chunk's scan may start. */
static int64_t chunk_state(const attn_ctx *c, const kernel_set *ks, const item_pos *it, int64_t i0,
                           int64_t i_end, attn_state st) {
    vis_list vl;
    int64_t c0;
    const int64_t next = chunk_gather(c, it, i0, i_end, &vl, &c0);
    if (vl.n == 0) {
        state_clear(st, it->nh);
        return next;
    }
    _Alignas(32) float S[LX_ATTN_MAX_GROUP * LDS];
    chunk_dots(c, ks, it, &vl, c0, S);
    chunk_finish(c, ks, it, &vl, c0, S, st);
    return next;
}

/* run <- run (+) x, where (+) merges two softmax states; an empty x changes
 * nothing and an empty run becomes a copy of x. The only combiner of chunk
 * states, for every threading mode. */
static void state_merge(attn_state run, attn_state x, int nh, int64_t dv) {
    for (int h = 0; h < nh; ++h) {
        if (x.m[h] == -INFINITY) continue;
        float *ra = run.acc + h * dv;
        const float *xa = x.acc + h * dv;
        if (run.m[h] == -INFINITY) {
            run.m[h] = x.m[h];
            run.l[h] = x.l[h];
            memcpy(ra, xa, (size_t) dv * sizeof(float));
            continue;
        }
        const float m = run.m[h] > x.m[h] ? run.m[h] : x.m[h];
        const float a = expf(run.m[h] - m), b = expf(x.m[h] - m);
        run.m[h] = m;
        run.l[h] = run.l[h] * a + x.l[h] * b;
        for (int64_t e = 0; e < dv; ++e) ra[e] = ra[e] * a + xa[e] * b;
    }
}

/* out rows of item it <- run normalised (zeros for a head that saw no cell) */
static void state_store(const attn_ctx *c, const item_pos *it, attn_state run) {
    const lx_attn_params *p = c->p;
    const int64_t dv = p->d_v;
    float *o = c->out + ((it->s * p->n_tps + it->t) * p->n_head + it->h0) * dv;
    for (int h = 0; h < it->nh; ++h) {
        const bool seen = run.m[h] != -INFINITY && run.l[h] != 0.0f;
        const float inv = seen ? 1.0f / run.l[h] : 0.0f;
        for (int64_t e = 0; e < dv; ++e) o[h * dv + e] = seen ? run.acc[h * dv + e] * inv : 0.0f;
    }
}

/* every chunk of item w, in order, folded on this thread: a running cursor walks the mask row
 * once (each chunk's scan starts where the previous one stopped) */
static void run_item(const attn_ctx *c, const kernel_set *ks, int64_t w) {
    const item_pos it = item_at(c, w);
    const int64_t dv = c->p->d_v, n_kv = c->p->n_kv;
    _Alignas(32) float run_buf[LX_ATTN_MAX_GROUP * (LX_ATTN_MAX_D + 2)];
    _Alignas(32) float tmp_buf[LX_ATTN_MAX_GROUP * (LX_ATTN_MAX_D + 2)];
    const attn_state run = state_at(run_buf, c->hp), tmp = state_at(tmp_buf, c->hp);
    state_clear(run, it.nh);
    for (int64_t i = 0; i < n_kv; ) {
        i = chunk_state(c, ks, &it, i, n_kv, tmp);
        state_merge(run, tmp, it.nh, dv);
    }
    state_store(c, &it, run);
}

/* ---- drivers -------------------------------------------------------------------------- */

static attn_ctx make_ctx(const lx_attn_params *p, const float *q, const void *k, const void *v,
                         const float *mask, float *out, bool vtrans) {
    attn_ctx c;
    c.p = p; c.q = q; c.k = k; c.v = v; c.mask = mask; c.out = out; c.vtrans = vtrans;
    c.gqa = p->n_head / p->n_head_kv;
    c.n_pass = (c.gqa + LX_ATTN_MAX_GROUP - 1) / LX_ATTN_MAX_GROUP;
    c.hp = (c.gqa + c.n_pass - 1) / c.n_pass;                  /* balanced passes */
    c.n_items = p->n_stream * p->n_tps * p->n_head_kv * c.n_pass;
    c.n_chunks = (p->n_kv + LX_ATTN_CHUNK - 1) / LX_ATTN_CHUNK;
    c.st_stride = c.hp * (p->d_v + 2);
    c.kb_head = (int64_t) lx_row_bytes(p->type_k, p->d_k);
    c.kb_cell = c.kb_head * p->n_head_kv;
    c.vb_head = (int64_t) lx_row_bytes(p->type_v, p->d_v);
    c.vb_cell = c.vb_head * p->n_head_kv;
    c.level = lx_simd_level();
    return c;
}

/* Items up to which the chunk states are parked in the caller's scratch and
 * computed chunk-major: for each chunk, every kv head (and token) in turn.
 * Decode touches every cache page once that way (all heads of a cell are
 * adjacent), instead of once per kv head, and the (item, chunk) pairs share
 * out evenly between threads however few items there are. */
enum { SPLIT_ITEMS = 64 };

/* multiply-adds (upper bound: every cell visible) below which a thread is not worth waking;
 * lx_attn_set_min_work overrides it (tests) */
#define MIN_WORK_PER_THREAD ((int64_t) 1 << 18)

static int64_t min_work_override = -1;

void lx_attn_set_min_work(int64_t macs) {
    __atomic_store_n(&min_work_override, macs, __ATOMIC_RELAXED);
}

/* The scratch of the split (lx_attn_scratch_size), in float slots:
 *   states [n_items][n_chunks][st_stride]  floats: chunk state (w, ch) at (w * n_chunks + ch) * st_stride
 *   starts [n_rows][n_chunks]              int32: where chunk ch of mask row r starts (row_bounds)
 *   pairs  [n_items * n_chunks]            int32: the non-empty (item, chunk) pairs, ch * n_items + w,
 *                                          chunk-major (the threads share out only real work)
 * with n_rows = n_stream * n_tps; a chunk is empty iff it starts at n_kv, and only a row's last
 * chunks are. */
_Static_assert(sizeof(int32_t) == sizeof(float), "an int32 takes one float slot");

static int64_t split_states_size(const attn_ctx *c) { return c->n_items * c->n_chunks * c->st_stride; }

/* float slots of the split's scratch; 0 when the call does not split (many items, or one chunk) */
static int64_t split_size(const attn_ctx *c) {
    if (c->n_chunks <= 1 || c->n_items > SPLIT_ITEMS) return 0;
    return split_states_size(c) + (c->p->n_stream * c->p->n_tps + c->n_items) * c->n_chunks;
}

/* the chunk starts of item w's mask row (row s * n_tps + t = w / (n_head_kv * n_pass)) */
static const int32_t *split_starts(const attn_ctx *c, const float *scratch, int64_t w) {
    const int64_t r = w / (c->p->n_head_kv * c->n_pass);
    return (const int32_t *) (scratch + split_states_size(c)) + r * c->n_chunks;
}

static int32_t *split_pairs(const attn_ctx *c, float *scratch) {
    return (int32_t *) (scratch + split_states_size(c)) + c->p->n_stream * c->p->n_tps * c->n_chunks;
}

/* every row's chunk starts, then the list of non-empty pairs; returns its length. One pass over
 * each mask row (a few cycles per cell, against d_k + d_v multiply-adds per cell and item). */
static int64_t split_plan(const attn_ctx *c, float *scratch) {
    const lx_attn_params *p = c->p;
    int32_t *starts = (int32_t *) (scratch + split_states_size(c));
    for (int64_t s = 0; s < p->n_stream; ++s)
        for (int64_t t = 0; t < p->n_tps; ++t)
            row_bounds(c->mask + (s * p->n_tps_pad + t) * p->n_kv, p->n_kv, c->n_chunks,
                       starts + (s * p->n_tps + t) * c->n_chunks);
    int32_t *pairs = split_pairs(c, scratch);
    int64_t n = 0;
    for (int64_t ch = 0; ch < c->n_chunks; ++ch)
        for (int64_t w = 0; w < c->n_items; ++w)
            if (split_starts(c, scratch, w)[ch] < p->n_kv) pairs[n++] = (int32_t) (ch * c->n_items + w);
    return n;
}

/* chunk state of pair x = ch * n_items + w into its scratch slot: its scan runs from the chunk's
 * start to the next chunk's */
/* the pairs split_plan listed, counted again from the chunk starts it parked in the scratch */
static int64_t split_pair_count(const attn_ctx *c, const float *scratch) {
    int64_t n = 0;
    for (int64_t w = 0; w < c->n_items; ++w) {
        const int32_t *b = split_starts(c, scratch, w);
        for (int64_t ch = 0; ch < c->n_chunks; ++ch) n += b[ch] < c->p->n_kv;
    }
    return n;
}

static void split_pair(const attn_ctx *c, const kernel_set *ks, int64_t x, float *scratch) {
    const int64_t ch = x / c->n_items, w = x % c->n_items;
    const item_pos it = item_at(c, w);
    const int32_t *b = split_starts(c, scratch, w);
    const int64_t i_end = ch + 1 < c->n_chunks ? b[ch + 1] : c->p->n_kv;
    chunk_state(c, ks, &it, b[ch], i_end, state_at(scratch + (w * c->n_chunks + ch) * c->st_stride, c->hp));
}

/* fold item w's non-empty chunk states parked in the scratch, in chunk order */
static void fold_item(const attn_ctx *c, int64_t w, float *scratch) {
    const item_pos it = item_at(c, w);
    const int64_t dv = c->p->d_v;
    const int32_t *b = split_starts(c, scratch, w);
    _Alignas(32) float run_buf[LX_ATTN_MAX_GROUP * (LX_ATTN_MAX_D + 2)];
    const attn_state run = state_at(run_buf, c->hp);
    state_clear(run, it.nh);
    for (int64_t ch = 0; ch < c->n_chunks && b[ch] < c->p->n_kv; ++ch) {
        state_merge(run, state_at(scratch + (w * c->n_chunks + ch) * c->st_stride, c->hp), it.nh, dv);
    }
    state_store(c, &it, run);
}

/* ---- tiles of query tokens (prefill, AVX2 and up: attn_tile.h) ------------------------------
 *
 * Tile u = (stream, up to TILE_TOKENS consecutive tokens (tile_tokens), kv head, head pass). Its
 * tokens walk their chunks together: each round takes the first unfinished token's next chunk and
 * every token whose next chunk is the same (the same scan start, visible cells, mask values and
 * end); their K rows are converted and transposed once, their V rows converted once, and the
 * attn_tile kernels run every query head of them. A token whose chunk differs (a causal row's last
 * chunk) runs it alone with the per-token kernels. Each token's chunks and merges are those of
 * run_item, with the same bits (attn_tile.h). The buffers are each thread's slice of the caller's
 * scratch (lx_attn_scratch_size); without it the items run one by one (run_item). */
#define TILE_TOKENS 64

/* kt's row pitch for n cells: n rounded up to 16 floats, plus 16 when that is an even number of
 * 64-byte lines. The dots walk kt's rows e = l, l + 8, ... for a block of 16 columns; with a pitch
 * of 2^k lines (256 cells: 16 lines) those rows fall into 64 / 2^k of L1's 64 sets and evict each
 * other (the dots alone, d_k 64: ~12% slower at a tile's 96 query rows, 1.4x at 480). An odd number
 * of lines spreads them. */
static int64_t kt_pitch(int64_t n) {
    const int64_t ld = (n + 15) & ~(int64_t) 15;
    return (ld / 16) % 2 ? ld : ld + 16;
}

static bool tiles_apply(const attn_ctx *c) {
    const lx_attn_params *p = c->p;
    return c->level >= LX_SIMD_AVX2 && p->n_tps > 1 && !type_quant(p->type_k) && !type_quant(p->type_v) &&
           p->d_k % 8 == 0 && p->d_v % 8 == 0;
}

static int64_t n_tiles_of(const attn_ctx *c, int64_t tt) {
    const lx_attn_params *p = c->p;
    return p->n_stream * ((p->n_tps + tt - 1) / tt) * p->n_head_kv * c->n_pass;
}

/* tokens per tile: TILE_TOKENS when most of the cells lie before the ubatch (a prefill at depth: each
 * shared chunk's K and V converted once for more tokens, and the dots over more rows; SmolLM2 pp512 at
 * depth 8192 +18% over 32), else half (from an empty cache the diagonal chunks dominate and smaller
 * tiles share them better between threads); halved while that leaves fewer than 4 tiles per thread (a
 * decode batch of many sequences shares no chunk and needs its items spread). The size changes no bits. */
static int64_t tile_tokens(const attn_ctx *c, int n_threads) {
    int64_t tt = c->p->n_kv > 2 * c->p->n_tps ? TILE_TOKENS : TILE_TOKENS / 2;
    while (tt > 1 && n_tiles_of(c, tt) < 4 * (int64_t) n_threads) tt /= 2;
    return tt;
}

/* one thread's buffers of run_tile, in its slice of the scratch (tile_carve) */
typedef struct {
    vis_list *vl;     /* [TILE_TOKENS] */
    int64_t *off;     /* [LX_ATTN_CHUNK] */
    float *S;         /* [TILE_TOKENS][hp * LDS] */
    float *run;       /* [TILE_TOKENS][hp * (d_v + 2)] */
    float *tmp;       /* [TILE_TOKENS][hp * (d_v + 2)] */
    float *kt;        /* [d_k][kt_pitch(LX_ATTN_CHUNK)]: K transposed */
    float *vf;        /* [LX_ATTN_CHUNK][d_v]: V rows */
} tile_buf;

enum { TILE_PARTS = 7 };

/* the bytes of tile_buf's parts for a call of c */
static void tile_part_bytes(const attn_ctx *c, size_t bytes[TILE_PARTS]) {
    const int64_t st = c->hp * (c->p->d_v + 2);
    const size_t sizes[TILE_PARTS] = {
        TILE_TOKENS * sizeof(vis_list), LX_ATTN_CHUNK * sizeof(int64_t),
        (size_t) (TILE_TOKENS * c->hp * LDS) * sizeof(float), (size_t) (TILE_TOKENS * st) * sizeof(float),
        (size_t) (TILE_TOKENS * st) * sizeof(float), (size_t) (c->p->d_k * kt_pitch(LX_ATTN_CHUNK)) * sizeof(float),
        (size_t) (LX_ATTN_CHUNK * c->p->d_v) * sizeof(float)};
    for (int i = 0; i < TILE_PARTS; ++i) bytes[i] = (sizes[i] + 63) & ~(size_t) 63;
}

/* float slots of one thread's slice (its parts, 64-byte aligned from anywhere in the slice) */
static int64_t tile_floats(const attn_ctx *c) {
    size_t bytes[TILE_PARTS], total = 64;
    tile_part_bytes(c, bytes);
    for (int i = 0; i < TILE_PARTS; ++i) total += bytes[i];
    return (int64_t) ((total + sizeof(float) - 1) / sizeof(float));
}

/* tb's buffers in the slice at base (tile_floats slots) */
static void tile_carve(const attn_ctx *c, float *base, tile_buf *tb) {
    size_t bytes[TILE_PARTS];
    tile_part_bytes(c, bytes);
    uint8_t *m = (uint8_t *) (((uintptr_t) base + 63) & ~(uintptr_t) 63);
    void *part[TILE_PARTS];
    for (int i = 0; i < TILE_PARTS; ++i) part[i] = m, m += bytes[i];
    *tb = (tile_buf) {part[0], part[1], part[2], part[3], part[4], part[5], part[6]};
}

/* a's visible cells are the first a->n of b's (the same cells in the same order) */
static bool is_prefix(const vis_list *a, const vis_list *b) {
    return a == b || (a->n <= b->n && memcmp(a->idx, b->idx, (size_t) a->n * sizeof a->idx[0]) == 0);
}

/* The tile's tokens walk their chunks together: at each step the tokens whose scan starts at the
 * lead's cell i0 gather their chunks; those whose visible cells are a prefix of the longest such
 * chunk's (the base) share it: K transposed and V converted once for the base's cells, the dots of
 * every query head over them, then each token's own softmax over its own cells (its list: count and
 * mask values) and its V sum over those cells alone. A token's scores and sums are the per-token
 * kernels' bits: a score depends on its query row and cell only, and the V chain of a row runs over
 * the row's own cells in order (the cells past a token's count are never read for it). Causal
 * prefill is why: a token sees its predecessors' cells plus its own, so the diagonal chunk of the
 * tile's tokens is one list and its prefixes. The others run their chunk alone. */
static void run_tile(const attn_ctx *c, const kernel_set *ks, int64_t u, int64_t tt, tile_buf *tb) {
    const lx_attn_params *p = c->p;
    const int64_t dv = p->d_v, n_kv = p->n_kv, n_tt = (p->n_tps + tt - 1) / tt;
    const int64_t pass = u % c->n_pass;
    int64_t r = u / c->n_pass;
    const int64_t g = r % p->n_head_kv;
    r /= p->n_head_kv;
    const int64_t t0 = (r % n_tt) * tt, s = r / n_tt;
    const int nt = (int) (p->n_tps - t0 < tt ? p->n_tps - t0 : tt);
    item_pos its[TILE_TOKENS];
    attn_state run[TILE_TOKENS];
    attn_state tmp[TILE_TOKENS];   /* token k's state of the chunk at hand */
    float *S[TILE_TOKENS];         /* token k's scores [hp][LDS] */
    int64_t cur[TILE_TOKENS], next[TILE_TOKENS], c0[TILE_TOKENS];
    for (int k = 0; k < nt; ++k) {
        S[k] = tb->S + k * c->hp * LDS;
        its[k] = item_at(c, ((s * p->n_tps + t0 + k) * p->n_head_kv + g) * c->n_pass + pass);
        run[k] = state_at(tb->run + k * c->hp * (dv + 2), c->hp);
        tmp[k] = state_at(tb->tmp + k * c->hp * (dv + 2), c->hp);
        state_clear(run[k], its[k].nh);
        cur[k] = 0;
    }
    const int kf16 = p->type_k == LX_TYPE_F16, vf16 = p->type_v == LX_TYPE_F16;
    for (;;) {
        int lead = 0;
        while (lead < nt && cur[lead] >= n_kv) ++lead;
        if (lead == nt) break;
        const int64_t i0 = cur[lead];
        const vis_list *lst[TILE_TOKENS];   /* token k's chunk (k with cur[k] == i0) */
        next[lead] = chunk_gather(c, &its[lead], i0, n_kv, &tb->vl[lead], &c0[lead]);
        lst[lead] = &tb->vl[lead];
        const float *lead_mask = mask_row(c, &its[lead]) + i0;
        const size_t scanned = (size_t) (next[lead] - i0) * sizeof(float);
        int base = lead;
        for (int k = lead + 1; k < nt; ++k) {
            if (cur[k] != i0) continue;
            if (memcmp(mask_row(c, &its[k]) + i0, lead_mask, scanned) == 0) {
                /* the mask values lead's scan read: the same visible cells, c0 and end (its
                 * tokens share a stream); no gather of its own */
                next[k] = next[lead], c0[k] = c0[lead], lst[k] = lst[lead];
            } else {
                next[k] = chunk_gather(c, &its[k], i0, n_kv, &tb->vl[k], &c0[k]);
                lst[k] = &tb->vl[k];
            }
            if (lst[k]->n > lst[base]->n) base = k;
        }
        bool with[TILE_TOKENS] = {false};
        int n_with = 0;
        for (int k = lead; k < nt; ++k) {   /* c0 is i0 (or 0 through a perm) for them all */
            with[k] = cur[k] == i0 && lst[k]->n > 0 && is_prefix(lst[k], lst[base]);
            n_with += with[k];
        }
        if (n_with > 1) {
            /* the shared chunk: K and V once, every query head of the tokens with it */
            const vis_list *vl = lst[base];
            int64_t k_stride;
            const int64_t k_base = k_base_of(c, &its[base], c0[base], &k_stride);
            for (int j = 0; j < vl->n; ++j) tb->off[j] = k_base + (int64_t) vl->idx[j] * k_stride;
            const int64_t ld = kt_pitch(vl->n);
            lx_attn_tile_kt(c->k, kf16, tb->off, vl->n, p->d_k, tb->kt, ld);
            const float *qs[TILE_TOKENS * LX_ATTN_MAX_GROUP];   /* the query rows, then the weights P */
            float *Ss[TILE_TOKENS * LX_ATTN_MAX_GROUP];         /* their scores, then their acc rows */
            int nq = 0;
            for (int k = lead; k < nt; ++k) {
                if (!with[k]) continue;
                const float *qk = c->q + ((its[k].s * p->n_tps + its[k].t) * p->n_head + its[k].h0) * p->d_k;
                for (int h = 0; h < its[k].nh; ++h, ++nq) qs[nq] = qk + h * p->d_k, Ss[nq] = S[k] + h * LDS;
            }
            lx_attn_tile_dots(tb->kt, ld, vl->n, p->d_k, qs, Ss, nq, ks->lanes);
            if (c->vtrans) {
                for (int k = lead; k < nt; ++k)
                    if (with[k]) chunk_finish(c, ks, &its[k], lst[k], c0[k], S[k], tmp[k]);
            } else {
                int64_t v_stride;
                const int64_t v_base = v_base_of(c, &its[base], c0[base], &v_stride);
                for (int j = 0; j < vl->n; ++j) tb->off[j] = v_base + (int64_t) vl->idx[j] * v_stride;
                lx_attn_tile_vf(c->v, vf16, tb->off, vl->n, dv, tb->vf);
                for (int k = lead; k < nt;) {   /* runs of tokens with the same count: one V sum each */
                    if (!with[k]) { ++k; continue; }
                    const int n = lst[k]->n;
                    int nv = 0;
                    for (; k < nt && (!with[k] || lst[k]->n == n); ++k) {
                        if (!with[k]) continue;
                        chunk_probs(c, ks, &its[k], lst[k], S[k], tmp[k]);
                        for (int h = 0; h < its[k].nh; ++h, ++nv) qs[nv] = S[k] + h * LDS, Ss[nv] = tmp[k].acc + h * dv;
                    }
                    lx_attn_tile_vacc(tb->vf, n, dv, qs, Ss, nv);
                }
            }
            for (int k = lead; k < nt; ++k)
                if (with[k]) state_merge(run[k], tmp[k], its[k].nh, dv);
        }
        for (int k = lead; k < nt; ++k) {   /* the others whose chunk starts here, alone (an empty one adds nothing) */
            if (cur[k] != i0) continue;
            if ((!with[k] || n_with == 1) && lst[k]->n > 0) {
                chunk_dots(c, ks, &its[k], lst[k], c0[k], S[k]);
                chunk_finish(c, ks, &its[k], lst[k], c0[k], S[k], tmp[k]);
                state_merge(run[k], tmp[k], its[k].nh, dv);
            }
            cur[k] = next[k];
        }
    }
    for (int k = 0; k < nt; ++k) state_store(c, &its[k], run[k]);
}

int64_t lx_attn_scratch_size(const lx_attn_params *p, int n_threads) {
    assert(lx_attn_params_valid(p) && n_threads >= 1);
    const attn_ctx c = make_ctx(p, NULL, NULL, NULL, NULL, NULL, false);
    const int64_t split = split_size(&c);
    return split ? split : tiles_apply(&c) ? n_threads * tile_floats(&c) : 0;
}

/* no more threads than the work pays for (waking a thread costs microseconds, far more under
 * oversubscription); results do not depend on the thread count */
static int threads_for(const attn_ctx *c, int n_threads) {
    const lx_attn_params *p = c->p;
    const int64_t work = p->n_stream * p->n_tps * p->n_head * p->n_kv * (p->d_k + p->d_v);
    const int64_t ovr = __atomic_load_n(&min_work_override, __ATOMIC_RELAXED);
    const int64_t per_thread = ovr >= 1 ? ovr : MIN_WORK_PER_THREAD;
    return (int64_t) n_threads > 1 + work / per_thread ? (int) (1 + work / per_thread) : n_threads;
}

static void attn_run(const attn_ctx *c, float *scratch, int64_t n_scratch, int n_threads) {
    const lx_attn_params *p = c->p;
    const kernel_set *ks = kernels_for(c->level);
    if (c->n_chunks == 0) {                       /* n_kv == 0: nothing is visible */
        memset(c->out, 0, (size_t) (p->n_stream * p->n_tps * p->n_head * p->d_v) * sizeof(float));
        return;
    }
    n_threads = threads_for(c, n_threads);
    const int64_t need = split_size(c), per_tile_buf = tile_floats(c);
    const bool split = need > 0 && scratch != NULL && n_scratch >= need;
    const bool tiles = !split && tiles_apply(c) && scratch != NULL && n_scratch >= n_threads * per_tile_buf;
    const int64_t n_pairs = split ? split_plan(c, scratch) : 0;
    const int32_t *pairs = split ? split_pairs(c, scratch) : NULL;
#ifdef _OPENMP
    if (n_threads > 1) {
        if (split) {
            #pragma omp parallel num_threads(n_threads)
            {
                #pragma omp for schedule(static)
                for (int64_t x = 0; x < n_pairs; ++x) split_pair(c, ks, pairs[x], scratch);
                #pragma omp for schedule(static)
                for (int64_t w = 0; w < c->n_items; ++w) fold_item(c, w, scratch);
            }
        } else {
            /* chunk size 1: causal prefill rows grow with the token, so deal them round-robin */
            if (tiles) {
                const int64_t tt = tile_tokens(c, n_threads), n_tiles = n_tiles_of(c, tt);
                #pragma omp parallel num_threads(n_threads)
                {
                    tile_buf tb;
                    tile_carve(c, scratch + omp_get_thread_num() * per_tile_buf, &tb);
                    #pragma omp for schedule(static, 1)
                    for (int64_t u = 0; u < n_tiles; ++u) run_tile(c, ks, u, tt, &tb);
                }
            } else {
                #pragma omp parallel for schedule(static, 1) num_threads(n_threads)
                for (int64_t w = 0; w < c->n_items; ++w) run_item(c, ks, w);
            }
        }
        return;
    }
#endif
    (void) n_threads;
    if (split) {
        for (int64_t x = 0; x < n_pairs; ++x) split_pair(c, ks, pairs[x], scratch);
        for (int64_t w = 0; w < c->n_items; ++w) fold_item(c, w, scratch);
    } else if (tiles) {
        tile_buf tb;
        tile_carve(c, scratch, &tb);
        const int64_t tt = tile_tokens(c, 1);
        for (int64_t u = 0, n_tiles = n_tiles_of(c, tt); u < n_tiles; ++u) run_tile(c, ks, u, tt, &tb);
    } else {
        for (int64_t w = 0; w < c->n_items; ++w) run_item(c, ks, w);
    }
}

void lx_attn_flash_crew(const lx_attn_params *p, const float *q, const void *k, const void *v,
                        const float *mask, float *out, float *scratch, int64_t n_scratch, lx_crew *crew) {
    assert(lx_attn_params_valid(p));
    const attn_ctx c = make_ctx(p, q, k, v, mask, out, false);
    if (c.n_chunks == 0) {                   /* (a team is awake already: no work threshold) */
        if (crew->tid == 0) attn_run(&c, scratch, n_scratch, 1);
        lx_crew_sync(crew);
        return;
    }
    const kernel_set *ks = kernels_for(c.level);
    int64_t i0, i1;
    if (split_size(&c) > 0 && scratch != NULL && n_scratch >= split_size(&c)) {
        if (crew->tid == 0) split_plan(&c, scratch);      /* the pairs' list, in the scratch */
        lx_crew_sync(crew);
        const int32_t *pairs = split_pairs(&c, scratch);
        lx_crew_share(crew, split_pair_count(&c, scratch), &i0, &i1);
        for (int64_t x = i0; x < i1; ++x) split_pair(&c, ks, pairs[x], scratch);
        lx_crew_sync(crew);
        lx_crew_share(crew, c.n_items, &i0, &i1);
        for (int64_t w = i0; w < i1; ++w) fold_item(&c, w, scratch);
    } else {
        lx_crew_share(crew, c.n_items, &i0, &i1);
        for (int64_t w = i0; w < i1; ++w) run_item(&c, ks, w);
    }
    lx_crew_sync(crew);
}

void lx_attn_flash(const lx_attn_params *p, const float *q, const void *k, const void *v,
                   const float *mask, float *out, float *scratch, int64_t n_scratch, int n_threads) {
    assert(lx_attn_params_valid(p));
    assert(n_threads >= 1);
    const attn_ctx c = make_ctx(p, q, k, v, mask, out, false);
    attn_run(&c, scratch, n_scratch, n_threads);
}

void lx_attn_vtrans(const lx_attn_params *p, const float *q, const void *k, const void *v,
                    const float *mask, float *out, float *scratch, int64_t n_scratch, int n_threads) {
    assert(lx_attn_params_valid_vtrans(p));
    assert(n_threads >= 1);
    const attn_ctx c = make_ctx(p, q, k, v, mask, out, true);
    attn_run(&c, scratch, n_scratch, n_threads);
}

/* ---- a chunk's logits alone (tests) ------------------------------------------------------ */

float lx_attn_logits(float *row, int n, float scale, const float *mv) {
    assert(n >= 1 && n <= LX_ATTN_CHUNK);
    return kernels_for(lx_simd_level())->logits(row, n, scale, mv);
}

float lx_attn_logits_ref(float *row, int n, float scale, const float *mv) {
    assert(n >= 1 && n <= LX_ATTN_CHUNK);
    return logits_c(row, n, scale, mv);
}

/* ---- the quantized-K scores alone (tests) ------------------------------------------------ */

enum { DOTS_Q_LEVEL, DOTS_Q_REF, DOTS_Q_VNNI_EMUL };

/* lx_attn_dots_q* (attention.h): the n rows as one stream's cells, all visible, of a call with one
 * kv head and nh query heads, fed to the chosen dots in chunks of LX_ATTN_CHUNK */
static void dots_q_rows(int which, lx_type type_k, int64_t d_k, const float *q, int nh, const void *k,
                        int64_t n, float *S, int32_t *isum) {
    lx_attn_params p;
    memset(&p, 0, sizeof p);
    p.n_stream = p.n_tps = p.n_tps_pad = 1;
    p.n_head = nh;
    p.n_head_kv = 1;
    p.d_k = d_k;
    p.d_v = LX_QK;
    p.kv_size = p.n_kv = n;
    p.type_k = type_k;
    p.type_v = LX_TYPE_F32;
    p.scale = 1.0f;
    assert(type_quant(type_k) && nh >= 1 && nh <= LX_ATTN_MAX_GROUP && n >= 1 && lx_attn_params_valid(&p));
    const attn_ctx c = make_ctx(&p, q, k, NULL, NULL, NULL, true);
    const int64_t nb = d_k / LX_QK;
    q8_heads qh;
    quantize_heads(q, nh, d_k, &qh);
    vis_list vl;
    _Alignas(32) float Sc[LX_ATTN_MAX_GROUP * LDS];
    for (int64_t i0 = 0; i0 < n; i0 += LX_ATTN_CHUNK) {
        vl.n = (int) (n - i0 < LX_ATTN_CHUNK ? n - i0 : LX_ATTN_CHUNK);
        vl.n_runs = 1;
        vl.run_j[0] = 0;
        vl.run_len[0] = vl.n;
        for (int x = 0; x < vl.n; ++x) { vl.idx[x] = x; vl.mv[x] = 0.0f; }
        const int64_t k_base = i0 * d_k;
        if (which == DOTS_Q_LEVEL) {
            kernels_for(c.level)->dots_q(&c, &qh, k_base, d_k, &vl, nh, Sc);
        } else if (which == DOTS_Q_REF) {
            dots_q_c(&c, &qh, k_base, d_k, &vl, nh, Sc);
            for (int h = 0; isum && h < nh; ++h)
                for (int j = 0; j < vl.n; ++j)
                    for (int64_t b = 0; b < nb; ++b)
                        isum[(h * n + i0 + j) * nb + b] =
                            block_dot_i(elt_ptr(k, type_k, k_base + j * d_k + b * LX_QK), type_k, qh.qs[h] + b * LX_QK);
        } else {
            dots_q_vnni_emul(&c, &qh, k_base, &vl, nh, Sc, isum ? isum + i0 * nb : NULL, n * nb);
        }
        for (int h = 0; h < nh; ++h) memcpy(S + h * n + i0, Sc + h * LDS, (size_t) vl.n * sizeof(float));
    }
}

void lx_attn_dots_q(lx_type type_k, int64_t d_k, const float *q, int nh, const void *k, int64_t n, float *S) {
    dots_q_rows(DOTS_Q_LEVEL, type_k, d_k, q, nh, k, n, S, NULL);
}

void lx_attn_dots_q_ref(lx_type type_k, int64_t d_k, const float *q, int nh, const void *k, int64_t n, float *S,
                        int32_t *isum) {
    dots_q_rows(DOTS_Q_REF, type_k, d_k, q, nh, k, n, S, isum);
}

void lx_attn_dots_q_vnni_emul(lx_type type_k, int64_t d_k, const float *q, int nh, const void *k, int64_t n,
                              float *S, int32_t *isum) {
    dots_q_rows(DOTS_Q_VNNI_EMUL, type_k, d_k, q, nh, k, n, S, isum);
}

#else /* LX_ATTN_PASS ======================================================================== *
 *
 * The float kernels over LX_W-lane vectors VF (8: AVX2, 16: AVX-512), compiled once per pass with
 * SFX naming the pass's functions. LX_MASKED: a head row's last partial vector is a masked load
 * (AVX-512); without it (AVX2) the dots add a scalar tail and the V sums finish with scalar columns.
 * Horizontal sums reduce through 8 lanes (VFOLD8) in lx_hsum8x4_avx2's order for every tile
 * width, so a score's bits do not depend on the tile that computed it.
 */

/* LX_W quants of values e .. e + LX_W - 1 (e % LX_W == 0) of the quantized row at row, as floats
 * (q4_0: nibble - 8), without the block scale */
static LX_ALWAYS_INLINE LX_TGT VF SFX(qvals)(const uint8_t *row, int64_t e, const int VT) {
    const int w = (int) (e & (LX_QK - 1));
    const uint8_t *b = qrow(row, VT, e - w);
    __m128i q;
    if (VT == CT_Q8) {
        q = VQ8(b + 2 + w);
    } else {
        q = VQ8(b + 2 + (w & 15));
        if (w & 16) q = _mm_srli_epi16(q, 4);
        q = _mm_sub_epi8(_mm_and_si128(q, _mm_set1_epi8(0x0F)), _mm_set1_epi8(8));
    }
    return VI8TOF(q);
}

/* LX_W values of an f32 / f16 cache tensor (kernel type VT) from element off; with LX_MASKED the
 * first n of them (n in [1, LX_W]) and zeros above */
static LX_ALWAYS_INLINE LX_TGT VF SFX(ld)(const void *base, const int VT, int64_t off, int n) {
#if LX_MASKED
    if (n < LX_W) {
        return VT == CT_F16 ? VCVTPHN((const uint16_t *) base + off, n) : VLOADN((const float *) base + off, n);
    }
#endif
    (void) n;
    return VT == CT_F16 ? VCVTPH((const uint16_t *) base + off) : VLOAD((const float *) base + off);
}

/* acc[h][e .. e + LX_W) <- v, the first n lanes with LX_MASKED */
static LX_ALWAYS_INLINE LX_TGT void SFX(st)(float *p, VF v, int n) {
#if LX_MASKED
    if (n < LX_W) {
        VSTOREN(p, v, n);
        return;
    }
#endif
    (void) n;
    VSTORE(p, v);
}

/* the lanes of d-element rows that vectors cover: all of them with LX_MASKED, else whole vectors */
static LX_ALWAYS_INLINE int64_t SFX(vec_span)(int64_t d) { return LX_MASKED ? d : d & ~(int64_t) (LX_W - 1); }

/* lanes of the vector at e of a d-element row */
static LX_ALWAYS_INLINE int SFX(lanes)(int64_t d, int64_t e) { return LX_MASKED && d - e < LX_W ? (int) (d - e) : LX_W; }

static LX_TGT void SFX(expsum)(float *S, int n, int nh, const float *m, float *l) {
    const int nw = (n + LX_W - 1) & ~(LX_W - 1);
    for (int h = 0; h < nh; ++h) {
        float *row = S + h * LDS;
        for (int j = n; j < nw; ++j) row[j] = -INFINITY;   /* pad: exp gives 0 */
        const VF mv = VSET1(m[h]);
        VF sum = VZERO();
        for (int j = 0; j < nw; j += LX_W) {
            const VF e = VEXP(VSUB(VLOAD(row + j), mv));
            VSTORE(row + j, e);
            sum = VADD(sum, e);
        }
        l[h] = lx_hsum8_avx2(VFOLD8(sum));
    }
}

/* S[h][j .. j + NC) for NC cells (1, 2, 4 or 8) and NH heads: NH NC accumulators, then the NH
 * query vectors and one K vector at a time (AVX2 at NH 3, NC 4: 16 ymm) */
static LX_ALWAYS_INLINE LX_TGT void SFX(dots_cells)(const attn_ctx *c, const float *q, int64_t k_base,
                                                    int64_t k_stride, const vis_list *vl, int j, float *S,
                                                    const int NH, const int NC, const int KF16) {
    const int64_t d = c->p->d_k, dv = SFX(vec_span)(d);
    const void *k = c->k;
    int64_t off[8];
    for (int x = 0; x < NC; ++x) off[x] = k_base + (int64_t) vl->idx[j + x] * k_stride;
    VF acc[LX_ATTN_MAX_GROUP][8];
    for (int h = 0; h < NH; ++h)
        for (int x = 0; x < NC; ++x) acc[h][x] = VZERO();
    for (int64_t e = 0; e < dv; e += LX_W) {
        const int w = SFX(lanes)(d, e);
        VF qv[LX_ATTN_MAX_GROUP];
        for (int h = 0; h < NH; ++h) {
            qv[h] = SFX(ld)(q + h * d, CT_F32, e, w);
            /* loaded once a step: folded into each FMA (GCC's choice), the query loads would be
             * NH a cell, beside the FMAs' K loads the ports' bottleneck */
            if (NH * (NC + 1) + 1 < (LX_W == 8 ? 16 : 32)) LX_IN_REG(qv[h]);   /* (one register spare: at 16 GCC spills accumulators) */
        }
        for (int x = 0; x < NC; ++x) {
            const VF kv = SFX(ld)(k, KF16, off[x] + e, w);
            for (int h = 0; h < NH; ++h) acc[h][x] = VFMA(kv, qv[h], acc[h][x]);
        }
    }
    int h = 0;
    if (dv == d) for (; h + 4 <= NH; h += 4) {    /* a cell's 4 heads in one sum (each in its own order) */
        for (int x = 0; x < NC; ++x) {
            const __m128 r = lx_hsum8x4_avx2(VFOLD8(acc[h][x]), VFOLD8(acc[h + 1][x]), VFOLD8(acc[h + 2][x]),
                                             VFOLD8(acc[h + 3][x]));
            _mm_store_ss(S + h * LDS + j + x, r);
            _mm_store_ss(S + (h + 1) * LDS + j + x, _mm_movehdup_ps(r));
            _mm_store_ss(S + (h + 2) * LDS + j + x, _mm_movehl_ps(r, r));
            _mm_store_ss(S + (h + 3) * LDS + j + x, _mm_shuffle_ps(r, r, 3));
        }
    }
    for (; h < NH; ++h) {
        float r[8];
        for (int x = 0; x < NC; x += 4) {
            const __m256 a0 = VFOLD8(acc[h][x]);
            const __m256 a1 = NC > 1 ? VFOLD8(acc[h][x + 1]) : a0;
            const __m256 a2 = NC > 2 ? VFOLD8(acc[h][x + 2]) : a0;
            const __m256 a3 = NC > 2 ? VFOLD8(acc[h][x + 3]) : a0;
            _mm_storeu_ps(r + x, lx_hsum8x4_avx2(a0, a1, a2, a3));
        }
        for (int x = 0; x < NC; ++x) {
            float sum = r[x];
            if (dv < d) {
                float tail = 0.0f;
                for (int64_t e = dv; e < d; ++e) tail += q[h * d + e] * cache_at(k, c->p->type_k, off[x] + e);
                sum += tail;
            }
            S[h * LDS + j + x] = sum;
        }
    }
}

static LX_ALWAYS_INLINE LX_TGT void SFX(dots_impl)(const attn_ctx *c, const float *q, int64_t k_base,
                                                   int64_t k_stride, const vis_list *vl, float *S,
                                                   const int NH, const int KF16) {
    const int NC = (NH <= 3 ? 4 : NH <= 6 ? 2 : 1) * (LX_W / 8);
    const pf_rows pf = pf_at(c, k_base, k_stride);
    prefetch_rows(c, &pf, vl, 0, PF_AHEAD);
    int j = 0;
    if (NC >= 8) for (; j + 8 <= vl->n; j += 8) {
        prefetch_rows(c, &pf, vl, j + PF_AHEAD, 8);
        SFX(dots_cells)(c, q, k_base, k_stride, vl, j, S, NH, 8, KF16);
    }
    if (NC >= 4) for (; j + 4 <= vl->n; j += 4) {
        prefetch_rows(c, &pf, vl, j + PF_AHEAD, 4);
        SFX(dots_cells)(c, q, k_base, k_stride, vl, j, S, NH, 4, KF16);
    }
    if (NC >= 2) for (; j + 2 <= vl->n; j += 2) {
        prefetch_rows(c, &pf, vl, j + PF_AHEAD, 2);
        SFX(dots_cells)(c, q, k_base, k_stride, vl, j, S, NH, 2, KF16);
    }
    for (; j < vl->n; ++j) {
        prefetch_rows(c, &pf, vl, j + PF_AHEAD, 1);
        SFX(dots_cells)(c, q, k_base, k_stride, vl, j, S, NH, 1, KF16);
    }
}

/* acc[h][e0 .. e0 + R LX_W) += sum_{j in [j0, j1)} P[h][j] * V(j)[e0 ..]  (= when first); the last
 * vector holds wl lanes (LX_W but at a masked tail) */
static LX_ALWAYS_INLINE LX_TGT void SFX(vacc_tile)(const void *v, const float *S, int64_t v_base,
                                                   int64_t v_stride, const vis_list *vl, int j0, int j1,
                                                   int64_t dv, float *acc, int64_t e0, const bool first,
                                                   const int NH, const int R, const int VF16, int wl) {
    VF a[LX_ATTN_MAX_GROUP][4];
    int w[4];
    for (int r = 0; r < R; ++r) w[r] = r == R - 1 ? wl : LX_W;
    for (int h = 0; h < NH; ++h)
        for (int r = 0; r < R; ++r)
            a[h][r] = first ? VZERO() : SFX(ld)(acc + h * dv, CT_F32, e0 + LX_W * r, w[r]);
    for (int j = j0; j < j1; ++j) {
        const int64_t off = v_base + (int64_t) vl->idx[j] * v_stride + e0;
        VF vv[4];
        for (int r = 0; r < R; ++r) vv[r] = SFX(ld)(v, VF16, off + LX_W * r, w[r]);
        for (int h = 0; h < NH; ++h) {
            const VF pj = VSET1(S[h * LDS + j]);
            for (int r = 0; r < R; ++r) a[h][r] = VFMA(pj, vv[r], a[h][r]);
        }
    }
    for (int h = 0; h < NH; ++h)
        for (int r = 0; r < R; ++r) SFX(st)(acc + h * dv + e0 + LX_W * r, a[h][r], w[r]);
}

static LX_ALWAYS_INLINE LX_TGT void SFX(vacc_impl)(const attn_ctx *c, const float *S, int64_t v_base,
                                                   int64_t v_stride, const vis_list *vl, float *acc,
                                                   const int NH, const int VF16) {
    const int R = LX_W == 8 ? (NH <= 2 ? 4 : NH <= 4 ? 2 : 1) : (NH <= 4 ? 4 : 2);
    const int64_t dv = c->p->d_v, span = SFX(vec_span)(dv);
    for (int j0 = 0; j0 < vl->n; j0 += VACC_TILE) {
        const int j1 = j0 + VACC_TILE < vl->n ? j0 + VACC_TILE : vl->n;
        const bool first = j0 == 0;
        int64_t e = 0;
        if (R == 4) for (; e + 4 * LX_W <= dv; e += 4 * LX_W)
            SFX(vacc_tile)(c->v, S, v_base, v_stride, vl, j0, j1, dv, acc, e, first, NH, 4, VF16, LX_W);
        if (R >= 2) for (; e + 2 * LX_W <= dv; e += 2 * LX_W)
            SFX(vacc_tile)(c->v, S, v_base, v_stride, vl, j0, j1, dv, acc, e, first, NH, 2, VF16, LX_W);
        for (; e < span; e += LX_W)
            SFX(vacc_tile)(c->v, S, v_base, v_stride, vl, j0, j1, dv, acc, e, first, NH, 1, VF16, SFX(lanes)(dv, e));
        for (; e < dv; ++e) {
            for (int h = 0; h < NH; ++h) {
                float sum = first ? 0.0f : acc[h * dv + e];
                for (int j = j0; j < j1; ++j)
                    sum += S[h * LDS + j] * cache_at(c->v, c->p->type_v, v_base + (int64_t) vl->idx[j] * v_stride + e);
                acc[h * dv + e] = sum;
            }
        }
    }
}

/* acc[h][e0 .. e0 + R LX_W) over the tile's rows, weights W: vectors r .. r + VPB - 1 share the
 * block (e0 + LX_W r) / 32 */
static LX_ALWAYS_INLINE LX_TGT void SFX(vacc_q_pass)(const uint8_t *const *rowp,
                                                     int nj, const float W[][LX_ATTN_MAX_D / LX_QK][VQ_TILE],
                                                     int64_t dv, float *acc, int64_t e0, const bool first,
                                                     const int NH, const int R, const int VT) {
    enum { VPB = LX_QK / LX_W };
    VF a[LX_ATTN_MAX_GROUP][4];
    for (int h = 0; h < NH; ++h)
        for (int r = 0; r < R; ++r)
            a[h][r] = first ? VZERO() : VLOAD(acc + h * dv + e0 + LX_W * r);
    const int64_t b0 = e0 / LX_QK;
    for (int jj = 0; jj < nj; ++jj) {
        const uint8_t *row = rowp[jj];
        VF vv[4];
        for (int r = 0; r < R; ++r) vv[r] = SFX(qvals)(row, e0 + LX_W * r, VT);
        for (int h = 0; h < NH; ++h) {
            for (int r = 0; r < R; r += VPB) {
                const VF w = VSET1(W[h][b0 + r / VPB][jj]);
                for (int rr = r; rr < r + VPB && rr < R; ++rr) a[h][rr] = VFMA(w, vv[rr], a[h][rr]);
            }
        }
    }
    for (int h = 0; h < NH; ++h)
        for (int r = 0; r < R; ++r) VSTORE(acc + h * dv + e0 + LX_W * r, a[h][r]);
}

static LX_ALWAYS_INLINE LX_TGT void SFX(vacc_q_impl)(const attn_ctx *c, const float *S, int64_t v_base,
                                                     int64_t v_stride, const vis_list *vl, float *acc,
                                                     const int NH, const int VT) {
    enum { VPB = LX_QK / LX_W };
    const int64_t dv = c->p->d_v, nb = dv / LX_QK;
    const int64_t bb = VT == CT_Q8 ? (int64_t) sizeof(lx_block_q8_0) : (int64_t) sizeof(lx_block_q4_0);
    const uint8_t *v0 = qrow(c->v, VT, v_base);
    const int64_t vs = qbytes(VT, v_stride);
    /* vectors per pass: RQ while they fit, then RB (within one block) */
    const int RQ = LX_W == 8 ? (NH <= 2 ? 4 : 2) : (NH <= 3 ? 4 : 2);
    const int RB = RQ < VPB ? RQ : VPB;
    _Alignas(64) uint16_t D16[LX_ATTN_MAX_D / LX_QK][VQ_TILE];
    const uint8_t *rowp[VQ_TILE];
    _Alignas(64) float W[LX_ATTN_MAX_GROUP][LX_ATTN_MAX_D / LX_QK][VQ_TILE];
    for (int j0 = 0; j0 < vl->n; j0 += VQ_TILE) {
        const int nj = j0 + VQ_TILE < vl->n ? VQ_TILE : vl->n - j0;
        const bool first = j0 == 0;
        qscales(v0, vs, bb, nb, vl, j0, nj, rowp, D16);
        for (int64_t b = 0; b < nb; ++b) {
            for (int jj = 0; jj < nj; jj += LX_W) {
                const VF d = VCVTPH(&D16[b][jj]);
                for (int h = 0; h < NH; ++h) VSTOREA(&W[h][b][jj], VMUL(VLOAD(S + h * LDS + j0 + jj), d));
            }
        }
        int64_t e0 = 0;
        if (RQ > RB) for (; e0 + LX_W * RQ <= dv; e0 += LX_W * RQ)
            SFX(vacc_q_pass)(rowp, nj, W, dv, acc, e0, first, NH, RQ, VT);
        for (; e0 < dv; e0 += LX_W * RB) SFX(vacc_q_pass)(rowp, nj, W, dv, acc, e0, first, NH, RB, VT);
    }
}

/* values of visible cells j .. j + w - 1 of V^T row `row` (f32 / f16) as the lanes of a vector,
 * zeros above w (converted as SFX(ld) converts them) */
static LX_ALWAYS_INLINE LX_TGT VF SFX(vt_gather)(const void *v, const int VF16, int64_t row,
                                                 const vis_list *vl, int j, int w) {
    if (VF16) {
        uint16_t t[LX_W] = {0};
        for (int u = 0; u < w; ++u) t[u] = ((const uint16_t *) v)[row + vl->idx[j + u]];
        return VCVTPH(t);
    }
    float t[LX_W] = {0};
    for (int u = 0; u < w; ++u) t[u] = ((const float *) v)[row + vl->idx[j + u]];
    return VLOAD(t);
}

static LX_ALWAYS_INLINE LX_TGT void SFX(vtacc_impl)(const attn_ctx *c, const float *S, int64_t vt_base,
                                                    const vis_list *vl, float *acc, const int NH,
                                                    const int VF16) {
    const int64_t dv = c->p->d_v, kv_size = c->p->kv_size;
    vt_segs sg;
    vt_segments(vl, LX_W, LX_MASKED, &sg);
    for (int64_t e = 0; e < VT_PF_AHEAD && e < dv; ++e) prefetch_vt(c, vt_base + e * kv_size, vl);
    for (int64_t e = 0; e < dv; ++e) {
        const int64_t row = vt_base + e * kv_size;
        if (e + VT_PF_AHEAD < dv) prefetch_vt(c, row + VT_PF_AHEAD * kv_size, vl);
        VF a[LX_ATTN_MAX_GROUP];
        for (int h = 0; h < NH; ++h) a[h] = VZERO();
        /* S is zero above n up to a multiple of LX_W (expsum's padding): its vectors load whole */
        for (int k = 0; k < sg.n; ++k) {
            const int j0 = sg.j0[k], len = sg.len[k];
            if (sg.dense[k]) {                  /* len a multiple of LX_W, but at a masked tail */
                const int64_t i0 = row + vl->idx[j0];
                for (int x = 0; x < len; x += LX_W) {
                    const VF vv = SFX(ld)(c->v, VF16, i0 + x, len - x < LX_W ? len - x : LX_W);
                    for (int h = 0; h < NH; ++h) a[h] = VFMA(VLOAD(S + h * LDS + j0 + x), vv, a[h]);
                }
            } else {
                const VF vv = SFX(vt_gather)(c->v, VF16, row, vl, j0, len);
                for (int h = 0; h < NH; ++h) a[h] = VFMA(VLOAD(S + h * LDS + j0), vv, a[h]);
            }
        }
        for (int h = 0; h < NH; ++h) acc[h * dv + e] = lx_hsum8_avx2(VFOLD8(a[h]));
    }
}

/* one instance per (NH, type): the impl with NH and the kernel type as constants */
#define LX_DOTS_FN(NH, t, CT)                                                                              \
    static LX_TGT void SFX(dots_##NH##_##t)(const attn_ctx *c, const float *q, int64_t kb, int64_t ks,     \
                                            const vis_list *vl, float *S) {                                \
        SFX(dots_impl)(c, q, kb, ks, vl, S, NH, CT);                                                       \
    }
#define LX_VACC_FN(NH, t, impl, CT)                                                                        \
    static LX_TGT void SFX(vacc_##NH##_##t)(const attn_ctx *c, const float *S, int64_t vb, int64_t vs,     \
                                            const vis_list *vl, float *acc) {                              \
        SFX(impl)(c, S, vb, vs, vl, acc, NH, CT);                                                          \
    }
#define LX_VTACC_FN(NH, t, CT)                                                                             \
    static LX_TGT void SFX(vtacc_##NH##_##t)(const attn_ctx *c, const float *S, int64_t vb,                \
                                             const vis_list *vl, float *acc) {                             \
        SFX(vtacc_impl)(c, S, vb, vl, acc, NH, CT);                                                        \
    }
#define LX_DEF_PASS(NH)                                                                                    \
    LX_DOTS_FN(NH, f32, CT_F32) LX_DOTS_FN(NH, f16, CT_F16)                                                \
    LX_VACC_FN(NH, f32, vacc_impl, CT_F32) LX_VACC_FN(NH, f16, vacc_impl, CT_F16)                          \
    LX_VACC_FN(NH, q8, vacc_q_impl, CT_Q8) LX_VACC_FN(NH, q4, vacc_q_impl, CT_Q4)                          \
    LX_VTACC_FN(NH, f32, CT_F32) LX_VTACC_FN(NH, f16, CT_F16)
LX_NH_CASES(LX_DEF_PASS)
#undef LX_DEF_PASS
#undef LX_DOTS_FN
#undef LX_VACC_FN
#undef LX_VTACC_FN

#define LX_TAB_DOTS_F32(NH) SFX(dots_##NH##_f32),
#define LX_TAB_DOTS_F16(NH) SFX(dots_##NH##_f16),
#define LX_TAB_VACC_F32(NH) SFX(vacc_##NH##_f32),
#define LX_TAB_VACC_F16(NH) SFX(vacc_##NH##_f16),
#define LX_TAB_VACC_Q8(NH) SFX(vacc_##NH##_q8),
#define LX_TAB_VACC_Q4(NH) SFX(vacc_##NH##_q4),
#define LX_TAB_VTACC_F32(NH) SFX(vtacc_##NH##_f32),
#define LX_TAB_VTACC_F16(NH) SFX(vtacc_##NH##_f16),
static const dots_nh_fn SFX(dots_tab)[2][LX_ATTN_MAX_GROUP] = {
    { LX_NH_CASES(LX_TAB_DOTS_F32) }, { LX_NH_CASES(LX_TAB_DOTS_F16) } };
static const vacc_nh_fn SFX(vacc_tab)[4][LX_ATTN_MAX_GROUP] = {          /* [CT_*] */
    { LX_NH_CASES(LX_TAB_VACC_F32) }, { LX_NH_CASES(LX_TAB_VACC_F16) },
    { LX_NH_CASES(LX_TAB_VACC_Q8) }, { LX_NH_CASES(LX_TAB_VACC_Q4) } };
static const vtacc_nh_fn SFX(vtacc_tab)[2][LX_ATTN_MAX_GROUP] = {
    { LX_NH_CASES(LX_TAB_VTACC_F32) }, { LX_NH_CASES(LX_TAB_VTACC_F16) } };
#undef LX_TAB_DOTS_F32
#undef LX_TAB_DOTS_F16
#undef LX_TAB_VACC_F32
#undef LX_TAB_VACC_F16
#undef LX_TAB_VACC_Q8
#undef LX_TAB_VACC_Q4
#undef LX_TAB_VTACC_F32
#undef LX_TAB_VTACC_F16

static void SFX(dots)(const attn_ctx *c, const float *q, int64_t k_base, int64_t k_stride,
                      const vis_list *vl, int nh, float *S) {
    SFX(dots_tab)[c->p->type_k == LX_TYPE_F16][nh - 1](c, q, k_base, k_stride, vl, S);
}

static void SFX(vacc)(const attn_ctx *c, const float *S, int64_t v_base, int64_t v_stride,
                      const vis_list *vl, int nh, float *acc) {
    SFX(vacc_tab)[ctype(c->p->type_v)][nh - 1](c, S, v_base, v_stride, vl, acc);
}

static void SFX(vtacc)(const attn_ctx *c, const float *S, int64_t vt_base, const vis_list *vl, int nh,
                       float *acc) {
    SFX(vtacc_tab)[c->p->type_v == LX_TYPE_F16][nh - 1](c, S, vt_base, vl, acc);
}

/* the pass's parameters, undefined for the next pass */
#undef LX_ATTN_PASS
#undef SFX
#undef LX_TGT
#undef LX_W
#undef LX_MASKED
#undef VF
#undef VZERO
#undef VSET1
#undef VLOAD
#undef VSTORE
#undef VSTOREA
#undef VFMA
#undef VADD
#undef VSUB
#undef VMUL
#undef VEXP
#undef VFOLD8
#undef VCVTPH
#undef VQ8
#undef VI8TOF
#ifdef VLOADN
#undef VLOADN
#undef VCVTPHN
#undef VSTOREN
#endif

#endif /* LX_ATTN_PASS */
