/* kq_mask.c: see kq_mask.h.
 *
 * The fast fill differs from the reference in four ways, none of which changes a bit:
 *
 * 1. The per-cell tests of llama.cpp (causal, then is_masked_swa) are folded, once per row, into
 *    one window of visible positions [lo, hi]:
 *        empty cells        p0 < 0                          -> lo >= 0
 *        causal             p0 > p1 masked                  -> hi = p1
 *        SWA standard       p1 - p0 >= n_swa masked         -> lo = p1 - n_swa + 1
 *        SWA chunked        p0 < (p1 / n_swa) * n_swa masked -> lo = (p1 / n_swa) * n_swa
 *        SWA symmetric      |p1 - p0| > n_swa / 2 masked    -> lo = p1 - n_swa/2, hi = p1 + n_swa/2
 *    so a cell is visible iff lo <= p0 <= hi and it holds the token's sequence. The inner loop is
 *    then the same branch-free loop for every causal x swa_type combination (llama.cpp templates
 *    on them); ALiBi, which changes the value written, is the one compile-time specialisation.
 *
 * 2. Row reuse (llama.cpp PR 18842; not with ALiBi): the first token of each sequence in a
 *    stream gets a full row; every later token of that sequence copies it and recomputes only the
 *    candidate cells whose value can depend on the token: cells with p0 + n_swa + 32 >= pmin, pmin
 *    being the smallest query position of the stream (llama.cpp keeps one list per sequence with
 *    its own pmin; one list per stream with the stream's pmin is a superset, hence as exact).
 *    Cells below that bound are visible to every token (causal: p0 < pmin <= p1) or masked for
 *    every token (each SWA window starts after them). Without causal and SWA, all rows of a
 *    sequence are equal and the list is empty.
 *
 * 3. Full rows read one 32-bit half-word of each cell's sequence set; when two or more full rows
 *    of a stream need the same half-word, it is first gathered into a compact column (4 bytes a
 *    cell instead of one 32-byte lx_seq_bits), which the row loops then stream through.
 *
 * 4. Rows are spread over OpenMP threads (columns, then full rows, then derived rows); x86-64 CPUs
 *    with AVX2 run the same loops compiled for AVX2, and masks of KQ_STREAM_MIN_BYTES or more are
 *    written with non-temporal stores.
 */
#include "kq_mask.h"
#include "cpu.h"

#include <assert.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

_Static_assert(sizeof(lx_seq_bits) == 8 * LX_SEQ_WORDS, "lx_seq_bits must be a plain array of words");

#define KQ_REUSE_MARGIN 32          /* llama.cpp: cells with p0 + n_swa + 32 >= pmin may change   */
#define KQ_PAR_MIN_ELEMS (1 << 16)  /* masks smaller than this are filled by the calling thread  */
/* masks at least this large are written with non-temporal stores: they do not fit in the caches
 * that the attention would read them from, and streaming halves the write traffic */
#define KQ_STREAM_MIN_BYTES ((size_t) 16 << 20)

#define KQ_NEG_INF_BITS 0xff800000u /* -INFINITY as float bits */

int64_t lx_kq_mask_n_tps_pad(int64_t n_tps) {
    assert(n_tps >= 0);
    return (n_tps + LX_KQ_MASK_PAD - 1) / LX_KQ_MASK_PAD * LX_KQ_MASK_PAD;
}

static void kq_check_args(const lx_kq_mask_args *a) {
    (void) a;
    assert(a->n_stream >= 1 && a->n_stream <= LX_MAX_SEQ);
    assert(a->n_tps >= 1 && a->n_tps_pad >= a->n_tps);
    assert(a->n_kv >= 0);
    assert(a->swa_type == LX_SWA_NONE || a->n_swa > 0);
}

/* the value of cell (p0, holds q) for a token at p1: the definition, step by step as llama.cpp */
static inline float kq_value_ref(const lx_kq_mask_args *a, lx_pos p0, bool has_seq, lx_pos p1) {
    if (p0 < 0) return -INFINITY;                                  /* empty cell      */
    if (!has_seq) return -INFINITY;                                /* other sequence  */
    if (a->causal && p0 > p1) return -INFINITY;                    /* future token    */
    if (lx_is_masked_swa(a->n_swa, a->swa_type, p0, p1)) return -INFINITY;
    if (a->alibi) {
        const int64_t d = (int64_t) p0 - (int64_t) p1;
        return (float) -(d < 0 ? -d : d);
    }
    return 0.0f;
}

void lx_kq_mask_fill_ref(const lx_kq_mask_args *a, float *mask) {
    kq_check_args(a);
    const int64_t n_kv = a->n_kv;
    for (int64_t s = 0; s < a->n_stream; ++s) {
        const lx_pos      *pos = a->cell_pos[s];
        const lx_seq_bits *seq = a->cell_seq[s];
        for (int64_t i = 0; i < a->n_tps_pad; ++i) {
            float *row = mask + (s * a->n_tps_pad + i) * n_kv;
            if (i >= a->n_tps) {                                   /* padding row */
                for (int64_t j = 0; j < n_kv; ++j) row[j] = -INFINITY;
                continue;
            }
            const int64_t   t  = s * a->n_tps + i;
            const lx_pos    p1 = a->tok_pos[t];
            const lx_seq_id q  = a->tok_seq[t];
            assert(q >= 0 && q < LX_MAX_SEQ);
            for (int64_t j = 0; j < n_kv; ++j) {
                row[j] = kq_value_ref(a, pos[j], lx_seq_bits_test(&seq[j], q), p1);
            }
        }
    }
}

/* ---- fast fill ----------------------------------------------------------------------------- */

/* the window [lo, hi] of positions a token at p1 may see (before the sequence test) */
typedef struct { int32_t lo, hi; } kq_window;

static inline kq_window kq_window_of(const lx_kq_mask_args *a, lx_pos p1) {
    int64_t lo = 0, hi = INT32_MAX;
    if (a->causal) hi = p1;
    switch (a->swa_type) {
        case LX_SWA_NONE:
            break;
        case LX_SWA_STANDARD: {
            const int64_t l = (int64_t) p1 - a->n_swa + 1;
            if (l > lo) lo = l;
        } break;
        case LX_SWA_CHUNKED: {
            const int64_t l = (int64_t) (p1 / a->n_swa) * a->n_swa;
            if (l > lo) lo = l;
        } break;
        case LX_SWA_SYMMETRIC: {
            const int64_t half = a->n_swa / 2;
            if ((int64_t) p1 - half > lo) lo = (int64_t) p1 - half;
            if ((int64_t) p1 + half < hi) hi = (int64_t) p1 + half;
        } break;
    }
    kq_window w;
    w.lo = (int32_t) lo;   /* lo in [0, INT32_MAX] since p1 <= INT32_MAX and n_swa >= 1 */
    w.hi = (int32_t) hi;   /* hi in [INT32_MIN, INT32_MAX]; hi < lo: nothing visible     */
    return w;
}

/* ---- one cell, one row ------------------------------------------------------------------------
 *
 * The sequence test reads one 32-bit half-word per cell: the half of the cell's lx_seq_bits that
 * holds the token's sequence q, at bit q & 31. It is read either in place (stride 32 bytes, one
 * cache line per two cells) or from a compact column of that half-word for every cell of the
 * stream (stride 4 bytes), built once per stream when two or more full rows need it. */

#define KQ_HALVES (2 * LX_SEQ_WORDS)   /* 32-bit half-words in an lx_seq_bits */

/* index in [0, KQ_HALVES) of the half-word of an lx_seq_bits that holds sequence q */
static inline int kq_half_index(lx_seq_id q) {
    return q >> 5;
}

/* byte offset of half-word h inside an lx_seq_bits (its uint64 words are in native order) */
static inline size_t kq_half_offset(int h) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    return (size_t) (h >> 1) * sizeof(uint64_t) + (size_t) ((h & 1) ^ 1) * sizeof(uint32_t);
#else
    return (size_t) h * sizeof(uint32_t);
#endif
}

/* float bits of the value of one cell; branch-free so that the loops vectorise.
 * alibi is a compile-time constant after inlining. */
static inline __attribute__((always_inline))
uint32_t kq_cell_bits(lx_pos p0, uint32_t half, int bit, kq_window w, lx_pos p1, const bool alibi) {
    const uint32_t vis = (uint32_t) (p0 >= w.lo) & (uint32_t) (p0 <= w.hi) & ((half >> bit) & 1u);
    const uint32_t m   = 0u - vis;                     /* all ones where visible */
    if (alibi) {
        /* visible cells have p0 >= 0 and p1 >= 0, so |p0 - p1| < 2^31; the wrap-around of the
         * unsigned arithmetic only touches cells that are masked anyway */
        const uint32_t d   = (uint32_t) p0 - (uint32_t) p1;
        const uint32_t sgn = 0u - (d >> 31);
        const uint32_t ad  = (d ^ sgn) - sgn;
        const float    v   = (float) (int32_t) (0u - ad);   /* as llama.cpp: int negation, 0 -> +0.0f */
        uint32_t vb;
        memcpy(&vb, &v, sizeof vb);
        return (vb & m) | (KQ_NEG_INF_BITS & ~m);
    }
    return KQ_NEG_INF_BITS & ~m;                       /* visible: 0.0f, else -inf */
}

/* the half-word of cell j: hw points at the half-word of cell 0, cells are `stride` bytes apart */
static inline __attribute__((always_inline))
uint32_t kq_half_at(const char *hw, size_t stride, int64_t j) {
    uint32_t h;
    memcpy(&h, hw + (size_t) j * stride, sizeof h);
    return h;
}

/* row [n] <- the values of cells [0, n) (stride: a compile-time constant after inlining) */
static inline __attribute__((always_inline))
void kq_row_full_body(uint32_t *restrict row, const lx_pos *restrict pos, const char *restrict hw,
                      const size_t stride, int64_t n, int bit, kq_window w, lx_pos p1, const bool alibi) {
    for (int64_t j = 0; j < n; ++j) {
        row[j] = kq_cell_bits(pos[j], kq_half_at(hw, stride, j), bit, w, p1, alibi);
    }
}

/* row[j] <- the value of cell j for the cells j listed in idx [n_idx] only (in place seq bits) */
static inline void kq_row_list(uint32_t *restrict row, const lx_pos *restrict pos,
                               const lx_seq_bits *restrict seq, const uint32_t *restrict idx,
                               int64_t n_idx, lx_seq_id q, kq_window w, lx_pos p1) {
    const char *hw = (const char *) seq + kq_half_offset(kq_half_index(q));
    const int bit = q & 31;
    for (int64_t jj = 0; jj < n_idx; ++jj) {
        const uint32_t j = idx[jj];
        row[j] = kq_cell_bits(pos[j], kq_half_at(hw, sizeof(lx_seq_bits), j), bit, w, p1, false);
    }
}

/* ---- row writers: one per (alibi, layout of the half-words, CPU, store kind) ------------------- */

/* full row writer: row [n_kv] <- the values of every cell for one token */
typedef void (*kq_row_full_fn)(uint32_t *row, const lx_pos *pos, const char *hw, int64_t n_kv,
                               int bit, kq_window w, lx_pos p1);
/* row copier: dst [n] <- src [n]; the rows never overlap */
typedef void (*kq_row_copy_fn)(uint32_t *dst, const uint32_t *src, int64_t n);

#define KQ_DEFINE_FULL(name, attr, alibi, stride)                                                \
    attr static void name(uint32_t *row, const lx_pos *pos, const char *hw, int64_t n_kv,       \
                          int bit, kq_window w, lx_pos p1) {                                    \
        kq_row_full_body(row, pos, hw, stride, n_kv, bit, w, p1, alibi);                         \
    }

KQ_DEFINE_FULL(kq_full_plain_seq, , false, sizeof(lx_seq_bits))
KQ_DEFINE_FULL(kq_full_plain_col, , false, sizeof(uint32_t))
KQ_DEFINE_FULL(kq_full_alibi_seq, , true, sizeof(lx_seq_bits))
KQ_DEFINE_FULL(kq_full_alibi_col, , true, sizeof(uint32_t))

static void kq_copy_plain(uint32_t *dst, const uint32_t *src, int64_t n) {
    memcpy(dst, src, (size_t) n * sizeof(uint32_t));
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#define KQ_AVX2 __attribute__((target("avx2")))
#define KQ_CHUNK 1024   /* cells computed into an L1 buffer before they are streamed out */

KQ_DEFINE_FULL(kq_full_plain_seq_avx2, KQ_AVX2, false, sizeof(lx_seq_bits))
KQ_DEFINE_FULL(kq_full_plain_col_avx2, KQ_AVX2, false, sizeof(uint32_t))
KQ_DEFINE_FULL(kq_full_alibi_seq_avx2, KQ_AVX2, true, sizeof(lx_seq_bits))
KQ_DEFINE_FULL(kq_full_alibi_col_avx2, KQ_AVX2, true, sizeof(uint32_t))

/* dst [n] <- src [n] with non-temporal stores (no read-for-ownership of dst, no cache pollution);
 * ends with an sfence so that later plain stores and other threads see the data */
KQ_AVX2 static void kq_copy_stream(uint32_t *dst, const uint32_t *src, int64_t n) {
    int64_t j = 0;
    for (; j < n && ((uintptr_t) (dst + j) & 31u); ++j) dst[j] = src[j];
    for (; j + 8 <= n; j += 8) {
        _mm256_stream_si256((__m256i *) (dst + j), _mm256_loadu_si256((const __m256i *) (src + j)));
    }
    for (; j < n; ++j) dst[j] = src[j];
    _mm_sfence();
}

/* a full row computed KQ_CHUNK cells at a time into an L1 buffer, then streamed out */
#define KQ_DEFINE_FULL_STREAM(name, alibi, stride)                                               \
    KQ_AVX2 static void name(uint32_t *row, const lx_pos *pos, const char *hw, int64_t n_kv,    \
                             int bit, kq_window w, lx_pos p1) {                                 \
        uint32_t buf[KQ_CHUNK] __attribute__((aligned(32)));                                     \
        for (int64_t j0 = 0; j0 < n_kv; j0 += KQ_CHUNK) {                                        \
            const int64_t n = n_kv - j0 < KQ_CHUNK ? n_kv - j0 : KQ_CHUNK;                       \
            kq_row_full_body(buf, pos + j0, hw + (size_t) j0 * (stride), stride, n, bit, w, p1,  \
                             alibi);                                                             \
            kq_copy_stream(row + j0, buf, n);                                                    \
        }                                                                                        \
    }

KQ_DEFINE_FULL_STREAM(kq_full_plain_seq_stream, false, sizeof(lx_seq_bits))
KQ_DEFINE_FULL_STREAM(kq_full_plain_col_stream, false, sizeof(uint32_t))
KQ_DEFINE_FULL_STREAM(kq_full_alibi_seq_stream, true, sizeof(lx_seq_bits))
KQ_DEFINE_FULL_STREAM(kq_full_alibi_col_stream, true, sizeof(uint32_t))
#endif

typedef struct {
    kq_row_full_fn full_seq;   /* half-words read in place from the lx_seq_bits */
    kq_row_full_fn full_col;   /* half-words read from a compact column         */
    kq_row_copy_fn copy;
} kq_kernels;

/* the row writers for this CPU; stream: the mask is large enough for non-temporal stores */
static kq_kernels kq_pick(bool alibi, bool stream) {
    kq_kernels k;
    k.full_seq = alibi ? kq_full_alibi_seq : kq_full_plain_seq;
    k.full_col = alibi ? kq_full_alibi_col : kq_full_plain_col;
    k.copy     = kq_copy_plain;
#if defined(__x86_64__) && defined(__GNUC__)
    if (lx_simd_level() >= LX_SIMD_AVX2) {
        if (stream) {
            k.full_seq = alibi ? kq_full_alibi_seq_stream : kq_full_plain_seq_stream;
            k.full_col = alibi ? kq_full_alibi_col_stream : kq_full_plain_col_stream;
            k.copy     = kq_copy_stream;
        } else {
            k.full_seq = alibi ? kq_full_alibi_seq_avx2 : kq_full_plain_seq_avx2;
            k.full_col = alibi ? kq_full_alibi_col_avx2 : kq_full_plain_col_avx2;
        }
    }
#else
    (void) stream;
#endif
    return k;
}

/* ---- scratch: row reuse and compact columns ---------------------------------------------------
 *
 *   int64  n_cand [n_stream]                   candidate cells per stream
 *   int32  src    [n_stream*n_tps]             row (in its stream) this token's row derives from
 *   int32  col_of [n_stream][KQ_HALVES]        column of (stream, half-word), -1 = none
 *   uint32 cand   [n_stream][n_kv]             candidate cells
 *   uint32 cols   [n_stream*n_col_max][n_kv]   compact half-word columns (n_col_max: kq_n_col_max)
 */

/* columns per stream at most: each needs two full rows, and there are KQ_HALVES half-words */
static int64_t kq_n_col_max(int64_t n_tps) {
    return n_tps / 2 < KQ_HALVES ? n_tps / 2 : KQ_HALVES;
}

size_t lx_kq_mask_work_size(int64_t n_stream, int64_t n_tps, int64_t n_kv) {
    return (size_t) n_stream * sizeof(int64_t)
         + (size_t) (n_stream * n_tps) * sizeof(int32_t)
         + (size_t) (n_stream * KQ_HALVES) * sizeof(int32_t)
         + (size_t) (n_stream * n_kv) * sizeof(uint32_t)
         + (size_t) (n_stream * kq_n_col_max(n_tps) * n_kv) * sizeof(uint32_t);
}

typedef struct {
    int64_t  *n_cand;
    int32_t  *src;
    int32_t  *col_of;
    uint32_t *cand;
    uint32_t *cols;
} kq_work;

static kq_work kq_work_view(const lx_kq_mask_args *a, void *work) {
    kq_work wk;
    wk.n_cand = (int64_t *) work;
    wk.src    = (int32_t *) (wk.n_cand + a->n_stream);
    wk.col_of = wk.src + a->n_stream * a->n_tps;
    wk.cand   = (uint32_t *) (wk.col_of + a->n_stream * KQ_HALVES);
    wk.cols   = wk.cand + a->n_stream * a->n_kv;
    return wk;
}

/* Sequential bookkeeping, O(n_tokens + n_kv * n_stream): per token the first row of its sequence
 * in its stream (reuse) or itself, per stream the candidate cells (reuse), and which (stream,
 * half-word) pairs get a column (two or more full rows read them). Columns are filled later. */
static void kq_prepare(const lx_kq_mask_args *a, const kq_work *wk, bool reuse) {
    const int64_t n_tps = a->n_tps, n_kv = a->n_kv;
    const bool fixed_rows = !a->causal && a->swa_type == LX_SWA_NONE;  /* rows depend on q only */
    const int64_t margin = KQ_REUSE_MARGIN + (a->swa_type != LX_SWA_NONE ? a->n_swa : 0);
    int32_t n_cols = 0;
    for (int64_t s = 0; s < a->n_stream; ++s) {
        int32_t first[LX_MAX_SEQ];
        int32_t n_full[KQ_HALVES] = {0};
        for (int q = 0; q < LX_MAX_SEQ; ++q) first[q] = -1;
        int64_t pmin = INT64_MAX;
        for (int64_t i = 0; i < n_tps; ++i) {
            const int64_t t = s * n_tps + i;
            const lx_seq_id q = a->tok_seq[t];
            assert(q >= 0 && q < LX_MAX_SEQ);
            if (!reuse || first[q] < 0) {
                first[q] = (int32_t) i;
                n_full[kq_half_index(q)] += 1;
            }
            wk->src[t] = reuse ? first[q] : (int32_t) i;
            if (a->tok_pos[t] < pmin) pmin = a->tok_pos[t];
        }
        for (int h = 0; h < KQ_HALVES; ++h) {
            wk->col_of[s * KQ_HALVES + h] = n_full[h] >= 2 ? n_cols++ : -1;
        }
        int64_t n = 0;
        if (reuse && !fixed_rows) {
            const lx_pos *pos = a->cell_pos[s];
            uint32_t *c = wk->cand + s * n_kv;
            for (int64_t j = 0; j < n_kv; ++j) {
                c[n] = (uint32_t) j;
                n += (pos[j] >= 0) & ((int64_t) pos[j] + margin >= pmin);
            }
        }
        wk->n_cand[s] = n;
    }
    assert(n_cols <= a->n_stream * kq_n_col_max(n_tps));
}

/* col [n_kv] <- half-word h of every cell's sequence set */
static void kq_fill_column(uint32_t *restrict col, const lx_seq_bits *restrict seq, int64_t n_kv, int h) {
    const char *hw = (const char *) seq + kq_half_offset(h);
    for (int64_t j = 0; j < n_kv; ++j) col[j] = kq_half_at(hw, sizeof(lx_seq_bits), j);
}

/* ---- the fast fill ----------------------------------------------------------------------------- */

void lx_kq_mask_fill(const lx_kq_mask_args *a, float *mask, void *work, int n_threads) {
    kq_check_args(a);
    assert(n_threads >= 1);
    (void) n_threads;

    const int64_t n_kv = a->n_kv, n_tps = a->n_tps, n_tps_pad = a->n_tps_pad;
    const int64_t n_rows = a->n_stream * n_tps_pad;
    const bool reuse = work != NULL && !a->alibi;   /* llama.cpp: no row reuse with ALiBi */

    kq_work wk = {0};
    if (work != NULL) {
        wk = kq_work_view(a, work);
        kq_prepare(a, &wk, reuse);
    }
    const kq_kernels kk = kq_pick(a->alibi, (size_t) (n_rows * n_kv) * sizeof(float) >= KQ_STREAM_MIN_BYTES);
    uint32_t *const out = (uint32_t *) mask;

#ifdef _OPENMP
    const int par = n_threads > 1 && n_rows > 1 && n_rows * n_kv >= KQ_PAR_MIN_ELEMS;
    #pragma omp parallel num_threads(n_threads) if (par)
#endif
    {
        /* phase 0: the compact columns */
        if (work != NULL) {
#ifdef _OPENMP
            #pragma omp for schedule(static)
#endif
            for (int64_t sh = 0; sh < a->n_stream * KQ_HALVES; ++sh) {
                const int32_t c = wk.col_of[sh];
                if (c >= 0) kq_fill_column(wk.cols + c * n_kv, a->cell_seq[sh / KQ_HALVES], n_kv, (int) (sh % KQ_HALVES));
            }
        }
        /* (barrier) phase 1: padding rows and full rows (every row without reuse) */
#ifdef _OPENMP
        #pragma omp for schedule(static)
#endif
        for (int64_t r = 0; r < n_rows; ++r) {
            const int64_t s = r / n_tps_pad, i = r % n_tps_pad;
            uint32_t *row = out + r * n_kv;
            if (i >= n_tps) {
                for (int64_t j = 0; j < n_kv; ++j) row[j] = KQ_NEG_INF_BITS;
                continue;
            }
            const int64_t t = s * n_tps + i;
            if (reuse && wk.src[t] != i) continue;                 /* derived in phase 2 */
            const lx_seq_id q  = a->tok_seq[t];
            const lx_pos    p1 = a->tok_pos[t];
            const int       h  = kq_half_index(q);
            const int32_t   c  = work != NULL ? wk.col_of[s * KQ_HALVES + h] : -1;
            if (c >= 0) {
                kk.full_col(row, a->cell_pos[s], (const char *) (wk.cols + c * n_kv), n_kv, q & 31,
                            kq_window_of(a, p1), p1);
            } else {
                kk.full_seq(row, a->cell_pos[s], (const char *) a->cell_seq[s] + kq_half_offset(h), n_kv,
                            q & 31, kq_window_of(a, p1), p1);
            }
        }
        /* (barrier) phase 2: copy the sequence's first row, redo the candidate cells */
        if (reuse) {
#ifdef _OPENMP
            #pragma omp for schedule(static)
#endif
            for (int64_t r = 0; r < n_rows; ++r) {
                const int64_t s = r / n_tps_pad, i = r % n_tps_pad;
                if (i >= n_tps) continue;
                const int64_t t = s * n_tps + i;
                if (wk.src[t] == i) continue;
                uint32_t *row = out + r * n_kv;
                kk.copy(row, out + (s * n_tps_pad + wk.src[t]) * n_kv, n_kv);
                const lx_pos p1 = a->tok_pos[t];
                kq_row_list(row, a->cell_pos[s], a->cell_seq[s], wk.cand + s * n_kv, wk.n_cand[s],
                            a->tok_seq[t], kq_window_of(a, p1), p1);
            }
        }
    }
}

int lx_kq_cells_in_order(const lx_pos *pos, const lx_seq_bits *bits, int64_t n_kv, const lx_seq_id *seqs,
                         int n_seqs) {
    lx_pos last[LX_MAX_SEQ];   /* the position of the sequence's latest cell so far */
    for (int i = 0; i < n_seqs; ++i) last[i] = -1;
    for (int64_t j = 0; j < n_kv; ++j) {
        if (lx_seq_bits_none(&bits[j])) continue;
        for (int i = 0; i < n_seqs; ++i) {
            if (!lx_seq_bits_test(&bits[j], seqs[i])) continue;
            if (pos[j] <= last[i]) return 0;
            last[i] = pos[j];
        }
    }
    return 1;
}
