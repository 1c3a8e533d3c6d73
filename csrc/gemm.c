/* gemm.c: y = x W^T, bit-identical on every path (see gemm.h for the contract).
 *
 *   lx_gemm:  quantize x rows into token groups of L lanes       omp for over tokens
 *             for each tile of LX_GEMM_R W rows                  omp for, schedule(static)
 *               unpack the rows once into this thread's buffer (bytes, float scales)
 *               for each run of up to T groups of L tokens: one register tile R x T
 *
 * The SIMD kernels are written once and compiled three times by including this file into itself
 * (LX_GEMM_PASS): 1 AVX2+FMA (8 lanes, maddubs + madd), 2 AVX-512 VNNI on ymm (8 lanes,
 * vpdpbusd; LX_SIMD_VNNI512 for n_tok <= 8), 3 AVX-512 VNNI on zmm (16 lanes). Each pass computes the
 * canonical arithmetic of gemm.h; they differ only in how the exact integer sums are formed.
 */
#ifndef LX_GEMM_PASS

#include "gemm.h"
#include "cpu.h"
#include "simd.h"
#include "team.h"

#include <assert.h>
#include <math.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define LX_GEMM_X86 1
#include <immintrin.h>
/* the AMX path needs a compiler with the tile intrinsics (GCC 11, clang 12); without them the AMX level
 * runs the VNNI kernels */
#if (defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && __GNUC__ >= 11)
#define LX_GEMM_AMX 1
#endif
#endif

#define LX_INLINE inline __attribute__((always_inline))
/* v as the result of an opaque step: keeps an integer add chain a chain (GCC's reassociation would
 * otherwise rebuild p += m0; p += m1; ... as a tree of all the products, keeping every one live:
 * 20 ymm spilled per block in the 4-row tile) */
#define LX_CHAIN(v) __asm__("" : "+x"(v))
#define LX_GEMM_R 4        /* W rows per tile (every pass) */
#define LX_GEMM_LMAX 16    /* most token lanes of a group (zmm) */
#define LX_GEMM_PREFETCH 4096  /* bytes of W prefetched ahead of what the few-token kernels read (n_tok <= 8, GGUF rows) */
#define LX_GEMM_PREFETCH_R8 8192  /* the same over the r8 layout's one stream, into L2 (prefetch_group) */
#define LX_GEMM_SMALL 8    /* n_tok up to which the rows-in-lanes kernel runs (AVX2 and up) */
#define LX_GEMM_R8_NT 4    /* tokens per pass of the r8 few-token tile (16 ymm) */
#define LX_GEMM_AMX_R 16   /* W rows per tile of the AMX path (an int32 tile's 16 rows) */

/* ---- types ----------------------------------------------------------------------------- */

/* the K-quants (super-blocks of 256, q8_K activations) */
static int is_k(lx_type wt) {
    return wt == LX_TYPE_Q4_K || wt == LX_TYPE_Q5_K || wt == LX_TYPE_Q6_K;
}

/* the types with a min term (q8_1 activations): q4_1, q5_1 */
static int has_min(lx_type wt) {
    return wt == LX_TYPE_Q4_1 || wt == LX_TYPE_Q5_1;
}

/* the 5-bit types (the AVX2 int16 pair sums go 4 steps, not 8, before a madd) */
static int is_5bit(lx_type wt) {
    return wt == LX_TYPE_Q5_0 || wt == LX_TYPE_Q5_1;
}

int lx_gemm_supported(lx_type w_type) {
    return w_type == LX_TYPE_Q4_0 || w_type == LX_TYPE_Q4_1 || w_type == LX_TYPE_Q5_0 ||
           w_type == LX_TYPE_Q5_1 || w_type == LX_TYPE_Q8_0 || is_k(w_type);
}

lx_type lx_gemm_dot_type(lx_type w_type) {
    return is_k(w_type) ? LX_TYPE_Q8_K : has_min(w_type) ? LX_TYPE_Q8_1 : LX_TYPE_Q8_0;
}

/* r8 layout: a group-block's head, the 8 d (f16), then q4_1's 8 m (f16) or q5_0's 8 qh (u32) */
static int r8_head(lx_type wt) {
    return wt == LX_TYPE_Q4_1 ? 32 : wt == LX_TYPE_Q5_0 ? 48 : 16;
}

/* The K types' group-block (8 super-blocks' bytes), every field a byte permutation of the rows':
 * q4_K: the 8 d (f16), the 8 dmin, the 12 scale bytes as 3 dwords, dword k of the 8 rows at 32 + 32 k,
 * then chunk c of 32 (qs bytes [4c, 4c + 4) of the 8 rows) at 128 + 32 c; q5_K: the same head, qh
 * chunk c of 8 at 128 + 32 c, qs chunk c at 384 + 32 c;
 * q6_K: the 8 d, the 16 scales as 4 dwords at 16 + 32 k, ql chunk c of 32 at 144 + 32 c, then qh
 * chunk c of 16 at 1168 + 32 c. Lane r of a 32-byte load is row r throughout. */
enum { R8K_Q4_SC = 32, R8K_Q4_QS = 128, R8K_Q5_QH = 128, R8K_Q5_QS = 384, R8K_Q6_SC = 16, R8K_Q6_QL = 144,
       R8K_Q6_QH = 144 + 1024 };

/* group-block (o / 8, b) of 8 blocks' bytes: the head, then chunk c (of 8 for q8_0, 4 for the
 * nibble types) at r8_head + 32 c holding bytes [4c, 4c + 4) of the 8 rows' qs, row after row
 * (the K types: r8_move_k); nb = blocks per row */
static uint8_t *r8_block(const void *w, lx_type wt, int64_t nb, int64_t o, int64_t b) {
    return (uint8_t *) w + (size_t) ((o / 8) * nb + b) * 8 * lx_type_block_bytes(wt);
}

/* gemm.h's offset c of the stored quants (the canonical one) */
static int canon_offset(lx_type wt) {
    return wt == LX_TYPE_Q4_0 ? 8 : wt == LX_TYPE_Q5_0 ? 16 : 0;
}

/* ---- the canonical loop (reference and portable path) ---------------------------------- */

/* q_i - c of block b of a W row, in value order */
static void unpack_signed(lx_type wt, const uint8_t *w, int64_t b, int *q, float *dw, float *mw) {
    *mw = 0.0f;
    switch (wt) {
    case LX_TYPE_Q4_0: {
        const lx_block_q4_0 *x = (const lx_block_q4_0 *) w + b;
        for (int j = 0; j < 16; ++j) q[j] = (x->qs[j] & 0xF) - 8, q[j + 16] = (x->qs[j] >> 4) - 8;
        *dw = lx_fp16_to_fp32(x->d);
        break;
    }
    case LX_TYPE_Q4_1: {
        const lx_block_q4_1 *x = (const lx_block_q4_1 *) w + b;
        for (int j = 0; j < 16; ++j) q[j] = x->qs[j] & 0xF, q[j + 16] = x->qs[j] >> 4;
        *dw = lx_fp16_to_fp32(x->d);
        *mw = lx_fp16_to_fp32(x->m);
        break;
    }
    case LX_TYPE_Q5_0: {
        const lx_block_q5_0 *x = (const lx_block_q5_0 *) w + b;
        uint32_t qh;
        memcpy(&qh, x->qh, 4);
        for (int j = 0; j < 16; ++j) {
            q[j] = ((x->qs[j] & 0xF) | (((qh >> j) & 1u) << 4)) - 16;
            q[j + 16] = ((x->qs[j] >> 4) | (((qh >> (j + 16)) & 1u) << 4)) - 16;
        }
        *dw = lx_fp16_to_fp32(x->d);
        break;
    }
    case LX_TYPE_Q5_1: {
        const lx_block_q5_1 *x = (const lx_block_q5_1 *) w + b;
        uint32_t qh;
        memcpy(&qh, x->qh, 4);
        for (int j = 0; j < 16; ++j) {
            q[j] = (x->qs[j] & 0xF) | (((qh >> j) & 1u) << 4);
            q[j + 16] = (x->qs[j] >> 4) | (((qh >> (j + 16)) & 1u) << 4);
        }
        *dw = lx_fp16_to_fp32(x->d);
        *mw = lx_fp16_to_fp32(x->m);
        break;
    }
    default: {
        const lx_block_q8_0 *x = (const lx_block_q8_0 *) w + b;
        for (int j = 0; j < 32; ++j) q[j] = x->qs[j];
        *dw = lx_fp16_to_fp32(x->d);
        break;
    }
    }
}

/* one output: W row . quantized x row (ggml blocks of the dot type), gemm.h's loop literally */
static float dot_canon(lx_type wt, const uint8_t *w, const void *xq, int64_t nb) {
    float acc = 0.0f;
    for (int64_t b = 0; b < nb; ++b) {
        int q[LX_QK];
        float dw, mw;
        unpack_signed(wt, w, b, q, &dw, &mw);
        const int8_t *y;
        float dx, sx = 0.0f;
        if (has_min(wt)) {
            const lx_block_q8_1 *yb = (const lx_block_q8_1 *) xq + b;
            y = yb->qs, dx = lx_fp16_to_fp32(yb->d), sx = lx_fp16_to_fp32(yb->s);
        } else {
            const lx_block_q8_0 *yb = (const lx_block_q8_0 *) xq + b;
            y = yb->qs, dx = lx_fp16_to_fp32(yb->d);
        }
        int isum = 0;
        for (int i = 0; i < LX_QK; ++i) isum += q[i] * y[i];
        const float s = dw * dx;
        acc = fmaf(s, (float) isum, acc);
        if (has_min(wt)) acc = fmaf(mw, sx, acc);
    }
    return acc;
}

/* super-block b of a K-quant W row: the stored values u_i (q4_K 0..15, q5_K 0..31, q6_K 0..63,
 * whose q_i = u_i - 32), the sub-block scales sc[] (q4_K / q5_K: 8 of 32 values, 6-bit; q6_K: 16
 * of 16 values, int8) and mins mn[8] (q4_K / q5_K), the scales d and dmin (f16 -> float) */
static void unpack_k(lx_type wt, const uint8_t *w, int64_t b, uint8_t *u, int *sc, int *mn,
                     float *d, float *dmin) {
    if (wt == LX_TYPE_Q6_K) {
        const lx_block_q6_K *x = (const lx_block_q6_K *) w + b;
        for (int h = 0; h < 2; ++h) {
            const uint8_t *ql = x->ql + 64 * h, *qh = x->qh + 32 * h;
            uint8_t *o = u + 128 * h;
            for (int l = 0; l < 32; ++l) {
                o[l] = (uint8_t) ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4));
                o[l + 32] = (uint8_t) ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4));
                o[l + 64] = (uint8_t) ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
                o[l + 96] = (uint8_t) ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
            }
        }
        for (int g = 0; g < 16; ++g) sc[g] = x->scales[g];
        *d = lx_fp16_to_fp32(x->d), *dmin = 0.0f;
        return;
    }
    /* q4_K and q5_K share the head (d, dmin, scales) and qs; q5_K adds qh */
    const lx_block_q4_K *x4 = (const lx_block_q4_K *) w + b;
    const lx_block_q5_K *x5 = (const lx_block_q5_K *) w + b;
    const uint8_t *scales = wt == LX_TYPE_Q4_K ? x4->scales : x5->scales;
    const uint8_t *qs = wt == LX_TYPE_Q4_K ? x4->qs : x5->qs;
    for (int j = 0; j < 8; ++j) {
        uint8_t s, m;
        lx_k_scale_min(j, scales, &s, &m);
        sc[j] = s, mn[j] = m;
    }
    for (int p = 0; p < 4; ++p)
        for (int l = 0; l < 32; ++l) {
            int lo = qs[32 * p + l] & 0xF, hi = qs[32 * p + l] >> 4;
            if (wt == LX_TYPE_Q5_K) {
                lo |= ((x5->qh[l] >> (2 * p)) & 1) << 4;
                hi |= ((x5->qh[l] >> (2 * p + 1)) & 1) << 4;
            }
            u[64 * p + l] = (uint8_t) lo, u[64 * p + 32 + l] = (uint8_t) hi;
        }
    *d = lx_fp16_to_fp32(wt == LX_TYPE_Q4_K ? x4->d : x5->d);
    *dmin = lx_fp16_to_fp32(wt == LX_TYPE_Q4_K ? x4->dmin : x5->dmin);
}

/* one output of a K-quant W row against q8_K blocks: gemm.h's K loop literally */
static float dot_canon_k(lx_type wt, const uint8_t *w, const void *xq, int64_t nbk) {
    float acc = 0.0f;
    for (int64_t b = 0; b < nbk; ++b) {
        uint8_t u[LX_QK_K];
        int sc[16], mn[8];
        float d, dmin;
        unpack_k(wt, w, b, u, sc, mn, &d, &dmin);
        const lx_block_q8_K *yb = (const lx_block_q8_K *) xq + b;
        int32_t isum = 0, msum = 0;
        if (wt == LX_TYPE_Q6_K) {
            for (int g = 0; g < 16; ++g) {
                int32_t dot = 0;
                for (int i = 16 * g; i < 16 * g + 16; ++i) dot += (u[i] - 32) * yb->qs[i];
                isum += sc[g] * dot;
            }
        } else {
            for (int j = 0; j < 8; ++j) {
                int32_t dot = 0;
                for (int i = 32 * j; i < 32 * j + 32; ++i) dot += u[i] * yb->qs[i];
                isum += sc[j] * dot;
                msum += mn[j] * (yb->bsums[2 * j] + yb->bsums[2 * j + 1]);
            }
        }
        const float s = d * yb->d;
        acc = fmaf(s, (float) isum, acc);
        if (wt != LX_TYPE_Q6_K) {
            const float m = dmin * yb->d;
            acc = fmaf(-m, (float) msum, acc);
        }
    }
    return acc;
}

/* one output, any supported type (x row quantized to lx_gemm_dot_type) */
static float dot_any(lx_type wt, const uint8_t *w, const void *xq, int64_t n_in) {
    return is_k(wt) ? dot_canon_k(wt, w, xq, n_in / LX_QK_K) : dot_canon(wt, w, xq, n_in / LX_QK);
}

void lx_gemm_ref(const void *w, lx_type w_type, const float *x, float *y, int64_t n_tok,
                 int64_t n_in, int64_t n_out, void *work) {
    assert(lx_gemm_supported(w_type) && n_in % (is_k(w_type) ? LX_QK_K : LX_QK) == 0);
    const lx_type dt = lx_gemm_dot_type(w_type);
    const size_t wrb = lx_row_bytes(w_type, n_in), xrb = lx_row_bytes(dt, n_in);
    uint8_t *xq = work;
    for (int64_t t = 0; t < n_tok; ++t) lx_quantize_row_ref(dt, x + t * n_in, xq + t * xrb, n_in);
    for (int64_t o = 0; o < n_out; ++o)
        for (int64_t t = 0; t < n_tok; ++t)
            y[t * n_out + o] = dot_any(w_type, (const uint8_t *) w + o * wrb, xq + t * xrb, n_in);
}

/* ---- token groups (the SIMD paths' activations) -------------------------------------------- *
 *
 * Group g of L tokens, block b: one record of rec_bytes(L) bytes at act + (g nb + b) rec_bytes:
 *   int8  qs[8][L][4]   step s, lane l: values 4s..4s+3 of token gL+l's block b
 *   int32 corr[L]       -c * sum(qs of the block), c the pass's offset of the unpacked W bytes
 *   float dx[L], sx[L]  the block's scales (sx: q8_1's s; 0 for q8_0)
 * Lanes past n_tok are zero (their outputs are computed and dropped).
 */
static size_t rec_bytes(int L) { return (size_t) 44 * L; }

static size_t act_bytes(int64_t n_tok, int64_t nb) {
    const int64_t n16 = (n_tok + LX_GEMM_LMAX - 1) / LX_GEMM_LMAX * LX_GEMM_LMAX;
    return ((size_t) n16 * nb * 44 + 63) & ~(size_t) 63;
}

/* one thread's unpacked W tile of rt rows: bytes [rt][n_in], dw [rt][nb], mw [rt][nb]; sized for the largest,
 * LX_GEMM_AMX_R rows (a K tile of as many rows, with its int16 scales, takes less) */
static size_t tile_bytes(int64_t n_in) {
    const int64_t nb = n_in / LX_QK;
    return ((size_t) LX_GEMM_AMX_R * (n_in + 8 * nb) + 63) & ~(size_t) 63;
}

/* the AMX path's K digits: q4_K's scales (0..63) in base 8 (2 digits), q5_K's in base 4 (3), q6_K's |scale|
 * (0..128) in base 4 (4), so that every stored value times a digit is an int8 (amx_order_k) */
static int amx_digits(lx_type wt) { return wt == LX_TYPE_Q4_K ? 2 : wt == LX_TYPE_Q5_K ? 3 : 4; }
static int amx_digit_bits(lx_type wt) { return wt == LX_TYPE_Q4_K ? 3 : 2; }

/* one thread's W in the AMX tile order (amx_order: 640 bytes a block; amx_order_k: per super-block the
 * digits' 4 KB each, dw, dmin and the mins' pairs) */
static size_t amx_ord_bytes(lx_type wt, int64_t n_in) {
    if (is_k(wt)) return (size_t) (n_in / LX_QK_K) * ((size_t) amx_digits(wt) * 4096 + 384) + 64;
    return (size_t) (n_in / LX_QK) * 640 + 64;
}

/* the unpacked 4-row tiles a thread keeps between token chunks (gemm_main): as many of its share as fit */
#define LX_GEMM_KEEP_BYTES (1024 * 1024)

static size_t keep_slot_bytes(int64_t n_in) {
    return ((size_t) LX_GEMM_R * (n_in + 8 * (n_in / LX_QK)) + 63) & ~(size_t) 63;
}

size_t lx_gemm_work_size(lx_type w_type, int64_t n_tok, int64_t n_in, int n_threads) {
    const int64_t nb = n_in / LX_QK;
    const size_t nt = (size_t) (n_threads > 0 ? n_threads : 1);
    const size_t keep = n_tok > LX_GEMM_SMALL ? nt * LX_GEMM_KEEP_BYTES : 0;
    return act_bytes(n_tok, nb) + nt * (tile_bytes(n_in) + amx_ord_bytes(w_type, n_in)) + keep + 128;
}

#define LX_Q8_CHUNK 32   /* blocks quantized per call of lx_quantize_row_q8_split (q8_chunk) */

/* blocks [b0, b0 + n) of row x (n returned: up to LX_Q8_CHUNK, nb in all) into qs, d, s, sum; x NULL: none */
static int64_t q8_chunk(lx_type dt, const float *x, int64_t nb, int64_t b0, int8_t *qs, float *d, float *s,
                        int32_t *sum) {
    const int64_t n = nb - b0 < LX_Q8_CHUNK ? nb - b0 : LX_Q8_CHUNK;
    if (x) lx_quantize_row_q8_split(dt, x + b0 * LX_QK, qs, d, s, sum, n * LX_QK);
    return n;
}

static void quantize_token(lx_type dt, int c, const float *x, int64_t n_in, int L, int64_t t,
                           uint8_t *act) {
    const int64_t nb = n_in / LX_QK, g = t / L;
    const int l = (int) (t % L);
    int8_t qs[LX_Q8_CHUNK * LX_QK];
    float d[LX_Q8_CHUNK], s[LX_Q8_CHUNK];
    int32_t sum[LX_Q8_CHUNK];
    for (int64_t b0 = 0; b0 < nb; b0 += LX_Q8_CHUNK) {
        const int64_t n = q8_chunk(dt, x, nb, b0, qs, d, s, sum);
        for (int64_t i = 0; i < n; ++i) {
            uint8_t *rec = act + ((size_t) g * nb + b0 + i) * rec_bytes(L);
            int32_t *corr = (int32_t *) (rec + 32 * L);
            float *dx = (float *) (rec + 36 * L), *sx = (float *) (rec + 40 * L);
            if (!x) {
                for (int k = 0; k < 8; ++k) memset(rec + (k * L + l) * 4, 0, 4);
                corr[l] = 0, dx[l] = 0.0f, sx[l] = 0.0f;
                continue;
            }
            corr[l] = -c * sum[i], dx[l] = d[i], sx[l] = s[i];
            for (int k = 0; k < 8; ++k) memcpy(rec + (k * L + l) * 4, qs + i * LX_QK + 4 * k, 4);
        }
    }
}

/* K-quant token groups: group g, super-block b: one record of rec_bytes_k(L) bytes at
 * act + (g nbk + b) rec_bytes_k(L):
 *   int8  qs[64][L][4]    step s, lane l: values 4s..4s+3 of the token's q8_K super-block
 *   int16 ext[16][L][2]   q4_K / q5_K, e < 4: the 32-value sums (bs_{2e}, bs_{2e+1}), 0 after;
 *                         q6_K, e < 16: 32 (y_{4s} + y_{4s+1}) and 32 (y_{4s+2} + y_{4s+3})
 *                         summed over the 4 steps s of group e (the -32 offset, pair-wise)
 *   float dx[L]           q8_K's d
 * Lanes past n_tok are zero. */
static size_t rec_bytes_k(int L) { return (size_t) 324 * L; }

static void quantize_token_k(lx_type wt, const float *x, int64_t n_in, int L, int64_t t, uint8_t *act) {
    const int64_t nbk = n_in / LX_QK_K, g = t / L;
    const int l = (int) (t % L);
    for (int64_t b = 0; b < nbk; ++b) {
        uint8_t *rec = act + ((size_t) g * nbk + b) * rec_bytes_k(L);
        int16_t *ext = (int16_t *) (rec + 256 * L);
        float *dx = (float *) (rec + 320 * L);
        lx_block_q8_K q;
        if (x) lx_quantize_row_q8_K(x + b * LX_QK_K, &q, LX_QK_K);
        else memset(&q, 0, sizeof q);
        for (int s = 0; s < 64; ++s) memcpy(rec + (s * L + l) * 4, q.qs + 4 * s, 4);
        for (int e = 0; e < 16; ++e) {
            int a = 0, c = 0;
            if (wt == LX_TYPE_Q6_K) {
                for (int s = 4 * e; s < 4 * e + 4; ++s)
                    a += q.qs[4 * s] + q.qs[4 * s + 1], c += q.qs[4 * s + 2] + q.qs[4 * s + 3];
                a *= 32, c *= 32;
            } else if (e < 4) {
                a = q.bsums[4 * e] + q.bsums[4 * e + 1], c = q.bsums[4 * e + 2] + q.bsums[4 * e + 3];
            }
            ext[(e * L + l) * 2] = (int16_t) a, ext[(e * L + l) * 2 + 1] = (int16_t) c;
        }
        dx[l] = q.d;
    }
}

/* K-quant planar token (n_tok <= LX_GEMM_SMALL), stride LX_K_TS = n_in + 52 nbk: int8 qs[n_in],
 * float dx[nbk], int32 bsp[nbk][4] (q4_K / q5_K: the pairs (bs_{2e}, bs_{2e+1}) of the sums of 32
 * as int16 lo/hi), int16 bs16[nbk][16] (q8_K's sums of 16: the r8 q6_K kernel's -32 term) */
#define LX_K_TS(nbk) ((size_t) (nbk) * (LX_QK_K + 52))

/* the fields of the planar K token at tk (the one place their offsets are computed) */
typedef struct {
    const float *dx;     /* [nbk] */
    const int32_t *bsp;  /* [nbk][4] */
    const int16_t *bs16; /* [nbk][16] */
} planar_k;

static inline planar_k planar_k_of(const uint8_t *tk, int64_t nbk) {
    planar_k f;
    f.dx = (const float *) (tk + nbk * LX_QK_K);
    f.bsp = (const int32_t *) (f.dx + nbk);
    f.bs16 = (const int16_t *) (f.bsp + 4 * nbk);
    return f;
}

/* a loop with constant bounds unrolled whole (its shuffle patterns and register indices constants) */
#if defined(__GNUC__) && !defined(__clang__)
#define LX_UNROLL _Pragma("GCC unroll 16")
#elif defined(__clang__)
#define LX_UNROLL _Pragma("unroll")
#else
#define LX_UNROLL
#endif

static void quantize_planar_k(const float *x, int64_t n_in, uint8_t *tk) {
    const int64_t nbk = n_in / LX_QK_K;
    const planar_k f = planar_k_of(tk, nbk);
    float *dx = (float *) f.dx;
    int32_t *bsp = (int32_t *) f.bsp;
    int16_t *bs16 = (int16_t *) f.bs16;
    for (int64_t b = 0; b < nbk; ++b) {
        lx_block_q8_K q;
        lx_quantize_row_q8_K(x + b * LX_QK_K, &q, LX_QK_K);
        memcpy(tk + b * LX_QK_K, q.qs, LX_QK_K);
        memcpy(bs16 + 16 * b, q.bsums, sizeof q.bsums);
        dx[b] = q.d;
        for (int e = 0; e < 4; ++e) {
            const int a = q.bsums[4 * e] + q.bsums[4 * e + 1], c = q.bsums[4 * e + 2] + q.bsums[4 * e + 3];
            bsp[4 * b + e] = (int32_t) ((uint32_t) (uint16_t) a | ((uint32_t) (uint16_t) c << 16));
        }
    }
}

/* W rows o0 .. o0+nr-1 as unsigned bytes u = q (+128 for q8_0 when u128, else q8_0 signed),
 * with their scales; rows nr..R-1 of the tile are left as they are (their outputs are dropped) */
static void unpack_tile(lx_type wt, const uint8_t *w, size_t wrb, int64_t o0, int nr, int64_t n_in,
                        int u128, uint8_t *tile) {
    const int64_t nb = n_in / LX_QK;
    float *dw = (float *) (tile + LX_GEMM_R * n_in), *mw = dw + LX_GEMM_R * nb;
    for (int r = 0; r < nr; ++r) {
        const uint8_t *row = w + (size_t) (o0 + r) * wrb;
        uint8_t *u = tile + r * n_in;
        for (int64_t b = 0; b < nb; ++b, u += LX_QK) {
            switch (wt) {
            case LX_TYPE_Q4_0: {
                const lx_block_q4_0 *x = (const lx_block_q4_0 *) row + b;
                for (int j = 0; j < 16; ++j) u[j] = x->qs[j] & 0xF, u[j + 16] = x->qs[j] >> 4;
                dw[r * nb + b] = lx_fp16_to_fp32(x->d);
                break;
            }
            case LX_TYPE_Q4_1: {
                const lx_block_q4_1 *x = (const lx_block_q4_1 *) row + b;
                for (int j = 0; j < 16; ++j) u[j] = x->qs[j] & 0xF, u[j + 16] = x->qs[j] >> 4;
                dw[r * nb + b] = lx_fp16_to_fp32(x->d);
                mw[r * nb + b] = lx_fp16_to_fp32(x->m);
                break;
            }
            case LX_TYPE_Q5_0: case LX_TYPE_Q5_1: {
                int q[LX_QK];
                float d, m;
                unpack_signed(wt, row, b, q, &d, &m);   /* q5_0: q - 16, so + 16 gives the 5-bit value */
                for (int j = 0; j < LX_QK; ++j) u[j] = (uint8_t) (q[j] + (wt == LX_TYPE_Q5_0 ? 16 : 0));
                dw[r * nb + b] = d, mw[r * nb + b] = m;
                break;
            }
            default: {
                const lx_block_q8_0 *x = (const lx_block_q8_0 *) row + b;
                const uint8_t flip = u128 ? 0x80 : 0;
                for (int j = 0; j < 32; ++j) u[j] = (uint8_t) x->qs[j] ^ flip;
                dw[r * nb + b] = lx_fp16_to_fp32(x->d);
                break;
            }
            }
        }
    }
}

/* 4 bytes as an int32 (a broadcast operand) */
static LX_INLINE int32_t ld32(const uint8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* a run of token groups against an unpacked tile: y[t][o0 + r] for r < nr, every t of the groups */
typedef void (*run_fn)(lx_type wt, const uint8_t *tile, int64_t n_in, int nr, const uint8_t *act,
                       int64_t n_groups, float *y, int64_t n_tok, int64_t n_out, int64_t o0);

/* ---- SIMD passes --------------------------------------------------------------------------- */

#ifdef LX_GEMM_X86
#define LX_GEMM_PASS 1
#define SFX(f) f##_avx2
#define LX_TGT __attribute__((target("avx2,fma,f16c")))
#include "gemm.c"
#undef LX_GEMM_PASS
#undef SFX
#undef LX_TGT

#define LX_GEMM_PASS 2
#define SFX(f) f##_vnni256
#define LX_TGT __attribute__((target("avx2,fma,avx512f,avx512vl,avx512bw,avx512vnni")))
#include "gemm.c"
#undef LX_GEMM_PASS
#undef SFX
#undef LX_TGT

#define LX_GEMM_PASS 3
#define SFX(f) f##_vnni512
#define LX_TGT __attribute__((target("avx2,fma,avx512f,avx512vl,avx512bw,avx512dq,avx512vnni")))
#include "gemm.c"
#undef LX_GEMM_PASS
#undef SFX
#undef LX_TGT
#endif

/* ---- dispatch ------------------------------------------------------------------------------- */

static void gemm_portable(const void *w, lx_type wt, const float *x, float *y, int64_t n_tok,
                          int64_t n_in, int64_t n_out, void *work, int n_threads) {
    const lx_type dt = lx_gemm_dot_type(wt);
    const size_t wrb = lx_row_bytes(wt, n_in), xrb = lx_row_bytes(dt, n_in);
    uint8_t *xq = work;
    (void) n_threads;
#ifdef _OPENMP
#pragma omp parallel num_threads(n_threads)
#endif
    {
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t t = 0; t < n_tok; ++t) lx_quantize_row(dt, x + t * n_in, xq + t * xrb, n_in);
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t o = 0; o < n_out; ++o)
            for (int64_t t = 0; t < n_tok; ++t)
                y[t * n_out + o] = dot_any(wt, (const uint8_t *) w + o * wrb, xq + t * xrb, n_in);
    }
}

/* Before reading W rows [o0, o0 + nr): their bytes LX_GEMM_PREFETCH ahead (the hardware prefetchers
 * alone leave the few-token kernels at ~1/2 of the bandwidth: 8 row streams, short rows) */
static void prefetch_tile(const void *w, size_t wrb, int64_t o0, int nr, int64_t n_out) {
#if defined(__GNUC__) || defined(__clang__)
    const uint8_t *t0 = (const uint8_t *) w + (size_t) o0 * wrb, *end = (const uint8_t *) w + (size_t) n_out * wrb;
    for (size_t off = LX_GEMM_PREFETCH; off < (size_t) nr * wrb + LX_GEMM_PREFETCH && t0 + off < end; off += 64)
        __builtin_prefetch(t0 + off, 0, 3);
#else
    (void) w, (void) wrb, (void) o0, (void) nr, (void) n_out;
#endif
}

/* The few-token path (n_tok <= LX_GEMM_SMALL, AVX2 and up: rows in lanes) in its two halves, which
 * a team of threads already running may also call itself (lx_gemm_small_*, gemm.h): the tokens'
 * activations once, then output tiles of 8 rows in any split, each tile the same bits. */
int lx_gemm_small_ok(lx_type w_type, int64_t n_tok) {
#ifdef LX_GEMM_X86
    return lx_gemm_supported(w_type) && n_tok >= 1 && n_tok <= LX_GEMM_SMALL && lx_simd_level() >= LX_SIMD_AVX2;
#else
    (void) w_type, (void) n_tok;
    return 0;
#endif
}

int64_t lx_gemm_small_tiles(int64_t n_out) { return (n_out + 7) / 8; }

#ifdef LX_GEMM_X86
void lx_gemm_small_prepare(lx_type wt, const float *x, int64_t n_tok, int64_t n_in, void *work) {
    uint8_t *act = (uint8_t *) (((uintptr_t) work + 63) & ~(uintptr_t) 63);
    if (is_k(wt)) {
        const size_t ts = LX_K_TS(n_in / LX_QK_K);
        for (int64_t t = 0; t < n_tok; ++t) quantize_planar_k(x + t * n_in, n_in, act + t * ts);
        return;
    }
    const lx_type dt = lx_gemm_dot_type(wt);
    const int c = wt == LX_TYPE_Q8_0 ? 0 : canon_offset(wt);  /* q8_0 stays signed (sign trick) */
    const int64_t nb = n_in / LX_QK;
    const size_t ts = (size_t) nb * (LX_QK + 12);
    for (int64_t t = 0; t < n_tok; ++t) {
        uint8_t *tk = act + t * ts;
        int32_t *corr = (int32_t *) (tk + n_in);
        float *dx = (float *) (corr + nb), *sx = dx + nb;
        lx_quantize_row_q8_split(dt, x + t * n_in, (int8_t *) tk, dx, sx, corr, n_in);   /* corr <- the sums */
        for (int64_t b = 0; b < nb; ++b) corr[b] *= -c;
    }
}

/* output tile i (rows 8i .. 8i + 7); wrb: W's row bytes */
static LX_INLINE void small_out_tile(const void *w, lx_type wt, int r8, size_t wrb, float *y, int64_t n_tok,
                                     int64_t n_in, int64_t n_out, const uint8_t *act, int64_t i) {
    const int nr = n_out - 8 * i < 8 ? (int) (n_out - 8 * i) : 8;
    if (is_k(wt)) {
        const int64_t nbk = n_in / LX_QK_K;
        if (r8) {
            small_run_k_r8_avx2(wt, (const uint8_t *) w, wrb, 8 * i, nr, act, n_tok, nbk, y, n_out);
        } else {
            prefetch_tile(w, wrb, 8 * i, nr, n_out);
            small_run_k_avx2(wt, (const uint8_t *) w, wrb, 8 * i, nr, act, n_tok, nbk, y, n_out);
        }
        return;
    }
    if (!r8) prefetch_tile(w, wrb, 8 * i, nr, n_out);   /* r8: one stream, prefetched in the kernel */
    small_run_avx2(wt, (const uint8_t *) w, wrb, 8 * i, nr, act, n_tok, n_in / LX_QK, y, n_out, r8);
}

void lx_gemm_small_run(const void *w, lx_type wt, int r8, float *y, int64_t n_tok, int64_t n_in, int64_t n_out,
                       const void *work, int64_t i0, int64_t i1) {
    const uint8_t *act = (const uint8_t *) (((uintptr_t) work + 63) & ~(uintptr_t) 63);
    const size_t wrb = lx_row_bytes(wt, n_in);
    for (int64_t i = i0; i < i1; ++i) small_out_tile(w, wt, r8, wrb, y, n_tok, n_in, n_out, act, i);
}

static void gemm_small(const void *w, lx_type wt, const float *x, float *y, int64_t n_tok,
                       int64_t n_in, int64_t n_out, void *work, int n_threads, int r8) {
    lx_gemm_small_prepare(wt, x, n_tok, n_in, work);
    const uint8_t *act = (const uint8_t *) (((uintptr_t) work + 63) & ~(uintptr_t) 63);
    const size_t wrb = lx_row_bytes(wt, n_in);
    LX_FOR_THREADS(i, lx_gemm_small_tiles(n_out), n_threads, 1, small_out_tile(w, wt, r8, wrb, y, n_tok, n_in, n_out, act, i));
}
#else
void lx_gemm_small_prepare(lx_type wt, const float *x, int64_t n_tok, int64_t n_in, void *work) {
    (void) wt, (void) x, (void) n_tok, (void) n_in, (void) work;
    assert(0 && "lx_gemm_small_prepare: lx_gemm_small_ok is 0 here");
}

void lx_gemm_small_run(const void *w, lx_type wt, int r8, float *y, int64_t n_tok, int64_t n_in, int64_t n_out,
                       const void *work, int64_t i0, int64_t i1) {
    (void) w, (void) wt, (void) r8, (void) y, (void) n_tok, (void) n_in, (void) n_out, (void) work, (void) i0, (void) i1;
    assert(0 && "lx_gemm_small_run: lx_gemm_small_ok is 0 here");
}
#endif

/* activations of a token chunk (L2 blocking): about this many bytes of token groups per pass
 * over W's row tiles (W is re-unpacked per chunk; the arithmetic per output is unchanged) */
#define LX_GEMM_CHUNK_BYTES (256 * 1024)

static void r8_tile_rows(lx_type wt, const void *w, int64_t o0, int nr, int64_t n_in, uint8_t *dst);
static void gemm_r8_portable(const void *w, lx_type wt, const float *x, float *y, int64_t n_tok,
                             int64_t n_in, int64_t n_out, void *work, int n_threads);

/* lx_gemm over GGUF rows (r8 0) or the r8 layout (r8 1: lx_gemm_r8's work size) */
static void gemm_main(const void *w, lx_type w_type, int r8, const float *x, float *y, int64_t n_tok,
                      int64_t n_in, int64_t n_out, void *work, int n_threads) {
    const int kq = is_k(w_type);
    const int level = lx_simd_level();
    run_fn run = NULL;
    int L = 8, u128 = 1, tmax = 1;
#ifdef LX_GEMM_X86
#ifdef LX_GEMM_AMX
    if (level >= LX_SIMD_AMX && n_tok > LX_GEMM_SMALL) {
        gemm_amx(w, w_type, r8, x, y, n_tok, n_in, n_out, work, n_threads);
        return;
    }
#endif
    if (kq) {
        if (level >= LX_SIMD_VNNI512 && n_tok > LX_GEMM_SMALL) run = run_k_vnni512, L = 16, u128 = 0;
        else if (level >= LX_SIMD_AVX2) run = run_k_avx2, u128 = 0;
    } else if (level >= LX_SIMD_VNNI512 && n_tok > 8) run = run_vnni512, L = 16, tmax = 3;
    else if (level >= LX_SIMD_VNNI512) run = run_vnni256;
    else if (level >= LX_SIMD_AVX2) run = run_avx2, u128 = 0;
#endif
    if (!run) {
        if (r8) gemm_r8_portable(w, w_type, x, y, n_tok, n_in, n_out, work, n_threads);
        else gemm_portable(w, w_type, x, y, n_tok, n_in, n_out, work, n_threads);
        return;
    }
    const lx_type dt = lx_gemm_dot_type(w_type);
#ifdef LX_GEMM_X86
    if (n_tok <= LX_GEMM_SMALL) {
        gemm_small(w, w_type, x, y, n_tok, n_in, n_out, work, n_threads, r8);
        return;
    }
#endif
    const int c = w_type == LX_TYPE_Q8_0 ? (u128 ? 128 : 0) : canon_offset(w_type);
    const int64_t nb = n_in / LX_QK, n_groups = (n_tok + L - 1) / L;
    const size_t wrb = lx_row_bytes(w_type, n_in);
    const size_t gs = kq ? (size_t) (n_in / LX_QK_K) * rec_bytes_k(L) : (size_t) nb * rec_bytes(L);
    int64_t gc = (int64_t) (LX_GEMM_CHUNK_BYTES / gs);
    if (gc >= tmax) gc -= gc % tmax;
    if (gc < 1) gc = 1;
    uint8_t *base = (uint8_t *) (((uintptr_t) work + 63) & ~(uintptr_t) 63);
    uint8_t *act = base, *tiles = base + act_bytes(n_tok, nb);
    uint8_t *keep = tiles + (size_t) n_threads * (tile_bytes(n_in) + amx_ord_bytes(w_type, n_in));
    uint8_t *rows = keep + (size_t) n_threads * LX_GEMM_KEEP_BYTES;   /* r8: each thread's R GGUF rows */
    const int64_t n_tiles = (n_out + LX_GEMM_R - 1) / LX_GEMM_R;
    const size_t slot = keep_slot_bytes(n_in);
    /* tiles kept unpacked across the chunks when there are several */
    const int64_t n_keep = n_groups > gc ? (int64_t) (LX_GEMM_KEEP_BYTES / slot) : 0;
    (void) n_threads;
    (void) dt;
#ifdef _OPENMP
#pragma omp parallel num_threads(n_threads)
#endif
    {
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t t = 0; t < n_groups * L; ++t) {
            if (kq) quantize_token_k(w_type, t < n_tok ? x + t * n_in : NULL, n_in, L, t, act);
            else quantize_token(dt, c, t < n_tok ? x + t * n_in : NULL, n_in, L, t, act);
        }
#ifdef _OPENMP
        const int me = omp_get_thread_num(), nth = omp_get_num_threads();
#else
        const int me = 0, nth = 1;
#endif
        /* this thread's tiles [i0, i1), the same for every chunk, with no barrier between chunks */
        const int64_t q = n_tiles / nth, rem = n_tiles % nth;
        const int64_t i0 = me * q + (me < rem ? me : rem), i1 = i0 + q + (me < rem);
        uint8_t *tile = tiles + (size_t) me * tile_bytes(n_in), *mine = rows + (size_t) me * LX_GEMM_R * wrb;
        uint8_t *kept = keep + (size_t) me * LX_GEMM_KEEP_BYTES;
        for (int64_t g0 = 0; g0 < n_groups; g0 += gc) {
            const int64_t ng = n_groups - g0 < gc ? n_groups - g0 : gc;
            for (int64_t i = i0; i < i1; ++i) {
                const int64_t o0 = i * LX_GEMM_R;
                const int nr = n_out - o0 < LX_GEMM_R ? (int) (n_out - o0) : LX_GEMM_R;
                const int kept_tile = i - i0 < n_keep;
                uint8_t *t = kept_tile ? kept + (size_t) (i - i0) * slot : tile;
                if (g0 == 0 || !kept_tile) {
                    const uint8_t *src = (const uint8_t *) w;
                    int64_t so = o0;
#ifdef LX_GEMM_X86
                    (void) mine;   /* the r8 tile is unpacked from the layout itself */
                    unpack_rows_avx2(w_type, src, r8, wrb, so, nr, n_in, u128, t, LX_GEMM_R);
#else
                    if (r8) r8_tile_rows(w_type, w, o0, nr, n_in, mine), src = mine, so = 0;
                    unpack_tile(w_type, src, wrb, so, nr, n_in, u128, t);
#endif
                }
                run(w_type, t, n_in, nr, act + g0 * gs, ng, y + g0 * L * n_out, n_tok - g0 * L, n_out, o0);
            }
        }
    }
}

void lx_gemm(const void *w, lx_type w_type, const float *x, float *y, int64_t n_tok, int64_t n_in,
             int64_t n_out, void *work, int n_threads) {
    assert(lx_gemm_supported(w_type) && n_in > 0 && n_in % (is_k(w_type) ? LX_QK_K : LX_QK) == 0 && n_threads >= 1);
    if (n_tok <= 0 || n_out <= 0) return;
    gemm_main(w, w_type, 0, x, y, n_tok, n_in, n_out, work, n_threads);
}

/* ---- the row-interleaved layout (r8) -------------------------------------------------------- */

int lx_gemm_r8_supported(lx_type w_type) {
    return w_type == LX_TYPE_Q4_0 || w_type == LX_TYPE_Q4_1 || w_type == LX_TYPE_Q5_0 || w_type == LX_TYPE_Q8_0 ||
           is_k(w_type);
}

size_t lx_gemm_r8_bytes(lx_type w_type, int64_t n_in, int64_t n_out) {
    return (size_t) ((n_out + 7) / 8 * 8) * lx_row_bytes(w_type, n_in);
}


/* one GGUF block's fields: d, m (q4_1), qh (q5_0), qs and its byte count */
typedef struct { uint8_t *d, *m, *qh, *qs; int nqs; } block_fields;

static block_fields fields(lx_type wt, uint8_t *blk) {
    block_fields f = {blk, NULL, NULL, NULL, 16};
    switch (wt) {
    case LX_TYPE_Q4_0: f.qs = ((lx_block_q4_0 *) blk)->qs; break;
    case LX_TYPE_Q4_1: f.m = (uint8_t *) &((lx_block_q4_1 *) blk)->m, f.qs = ((lx_block_q4_1 *) blk)->qs; break;
    case LX_TYPE_Q5_0: f.qh = ((lx_block_q5_0 *) blk)->qh, f.qs = ((lx_block_q5_0 *) blk)->qs; break;
    default: f.qs = (uint8_t *) ((lx_block_q8_0 *) blk)->qs, f.nqs = 32; break;
    }
    return f;
}

/* block <-> its place in group-block g, as row r (to_r8: block into g; else g into block) */
static void r8_move(lx_type wt, uint8_t *blk, uint8_t *g, int r, int to_r8) {
    const block_fields f = fields(wt, blk);
#define MOVE(a, b, n) (to_r8 ? memcpy(b, a, n) : memcpy(a, b, n))
    MOVE(f.d, g + 2 * r, 2);
    if (f.m) MOVE(f.m, g + 16 + 2 * r, 2);
    if (f.qh) MOVE(f.qh, g + 16 + 4 * r, 4);
    for (int c = 0; c < f.nqs / 4; ++c) MOVE(f.qs + 4 * c, g + r8_head(wt) + 32 * c + 4 * r, 4);
#undef MOVE
}

/* The K types' group-block: see R8K_Q4_SC */
static void r8_move_k(lx_type wt, uint8_t *blk, uint8_t *g, int r, int to_r8) {
#define MOVE(a, b, n) (to_r8 ? memcpy(b, a, n) : memcpy(a, b, n))
    if (wt == LX_TYPE_Q4_K) {
        lx_block_q4_K *x = (lx_block_q4_K *) blk;
        MOVE(&x->d, g + 2 * r, 2);
        MOVE(&x->dmin, g + 16 + 2 * r, 2);
        for (int k = 0; k < 3; ++k) MOVE(x->scales + 4 * k, g + R8K_Q4_SC + 32 * k + 4 * r, 4);
        for (int c = 0; c < 32; ++c) MOVE(x->qs + 4 * c, g + R8K_Q4_QS + 32 * c + 4 * r, 4);
    } else if (wt == LX_TYPE_Q5_K) {
        lx_block_q5_K *x = (lx_block_q5_K *) blk;
        MOVE(&x->d, g + 2 * r, 2);
        MOVE(&x->dmin, g + 16 + 2 * r, 2);
        for (int k = 0; k < 3; ++k) MOVE(x->scales + 4 * k, g + R8K_Q4_SC + 32 * k + 4 * r, 4);
        for (int c = 0; c < 8; ++c) MOVE(x->qh + 4 * c, g + R8K_Q5_QH + 32 * c + 4 * r, 4);
        for (int c = 0; c < 32; ++c) MOVE(x->qs + 4 * c, g + R8K_Q5_QS + 32 * c + 4 * r, 4);
    } else {
        lx_block_q6_K *x = (lx_block_q6_K *) blk;
        MOVE(&x->d, g + 2 * r, 2);
        for (int k = 0; k < 4; ++k) MOVE((uint8_t *) x->scales + 4 * k, g + R8K_Q6_SC + 32 * k + 4 * r, 4);
        for (int c = 0; c < 32; ++c) MOVE(x->ql + 4 * c, g + R8K_Q6_QL + 32 * c + 4 * r, 4);
        for (int c = 0; c < 16; ++c) MOVE(x->qh + 4 * c, g + R8K_Q6_QH + 32 * c + 4 * r, 4);
    }
#undef MOVE
}

/* a block into (to_r8) or out of its place in the group-block g, as row r */
static void r8_place(lx_type wt, uint8_t *blk, uint8_t *g, int r, int to_r8) {
    if (is_k(wt)) r8_move_k(wt, blk, g, r, to_r8);
    else r8_move(wt, blk, g, r, to_r8);
}

void lx_gemm_pack_r8(lx_type w_type, const void *w, void *dst, int64_t n_in, int64_t n_out) {
    const size_t wrb = lx_row_bytes(w_type, n_in), bb = lx_type_block_bytes(w_type);
    const int64_t nb = n_in / lx_type_block_size(w_type), n_pad = (n_out + 7) / 8 * 8;
    uint8_t zero[256] = {0};
    for (int64_t o = 0; o < n_pad; ++o)
        for (int64_t b = 0; b < nb; ++b) {
            uint8_t blk[256];
            memcpy(blk, o < n_out ? (const uint8_t *) w + (size_t) o * wrb + b * bb : zero, bb);
            r8_place(w_type, blk, r8_block(dst, w_type, nb, o, b), (int) (o % 8), 1);
        }
}

void lx_gemm_unpack_r8_rows(lx_type w_type, const void *w, const int32_t *rows, int64_t n_rows, void *dst,
                            int64_t n_in) {
    const size_t wrb = lx_row_bytes(w_type, n_in), bb = lx_type_block_bytes(w_type);
    const int64_t nb = n_in / lx_type_block_size(w_type);
    for (int64_t i = 0; i < n_rows; ++i)
        for (int64_t b = 0; b < nb; ++b)
            r8_place(w_type, (uint8_t *) dst + (size_t) i * wrb + b * bb, r8_block(w, w_type, nb, rows[i], b),
                     (int) (rows[i] % 8), 0);
}

/* rows [o0, o0 + nr) of r8 W as GGUF rows into dst (a row tile of the tokens-in-lanes path) */
static void r8_tile_rows(lx_type wt, const void *w, int64_t o0, int nr, int64_t n_in, uint8_t *dst) {
    int32_t ids[LX_GEMM_R];
    for (int r = 0; r < nr; ++r) ids[r] = (int32_t) (o0 + r);
    lx_gemm_unpack_r8_rows(wt, w, ids, nr, dst, n_in);
}

size_t lx_gemm_r8_work_size(lx_type w_type, int64_t n_tok, int64_t n_in, int n_threads) {
    const size_t nt = (size_t) (n_threads > 0 ? n_threads : 1), wrb = lx_row_bytes(w_type, n_in);
    const size_t g = lx_gemm_work_size(w_type, n_tok, n_in, n_threads) + nt * LX_GEMM_R * wrb;
    const size_t p = (size_t) n_tok * lx_row_bytes(lx_gemm_dot_type(w_type), n_in) + nt * 8 * wrb + 128;
    return g > p ? g : p;
}

/* portable: each group's 8 rows gathered back into GGUF rows, then the canonical dots */
static void gemm_r8_portable(const void *w, lx_type wt, const float *x, float *y, int64_t n_tok,
                             int64_t n_in, int64_t n_out, void *work, int n_threads) {
    const lx_type dt = lx_gemm_dot_type(wt);
    const size_t xrb = lx_row_bytes(dt, n_in), wrb = lx_row_bytes(wt, n_in);
    uint8_t *xq = (uint8_t *) (((uintptr_t) work + 63) & ~(uintptr_t) 63);
    uint8_t *rows = xq + (size_t) n_tok * xrb;
    const int64_t n_groups = (n_out + 7) / 8;
    (void) n_threads;
    for (int64_t t = 0; t < n_tok; ++t) lx_quantize_row(dt, x + t * n_in, xq + t * xrb, n_in);
#ifdef _OPENMP
#pragma omp parallel for num_threads(n_threads) schedule(static)
#endif
    for (int64_t g = 0; g < n_groups; ++g) {
#ifdef _OPENMP
        uint8_t *mine = rows + (size_t) omp_get_thread_num() * 8 * wrb;
#else
        uint8_t *mine = rows;
#endif
        int32_t ids[8];
        for (int r = 0; r < 8; ++r) ids[r] = (int32_t) (8 * g + r);
        lx_gemm_unpack_r8_rows(wt, w, ids, 8, mine, n_in);
        for (int r = 0; r < 8 && 8 * g + r < n_out; ++r)
            for (int64_t t = 0; t < n_tok; ++t)
                y[t * n_out + 8 * g + r] = dot_any(wt, mine + (size_t) r * wrb, xq + t * xrb, n_in);
    }
}

void lx_gemm_r8(const void *w, lx_type w_type, const float *x, float *y, int64_t n_tok, int64_t n_in,
                int64_t n_out, void *work, int n_threads) {
    assert(lx_gemm_r8_supported(w_type) && n_in > 0 && n_in % lx_type_block_size(w_type) == 0 && n_threads >= 1);
    if (n_tok <= 0 || n_out <= 0) return;
    gemm_main(w, w_type, 1, x, y, n_tok, n_in, n_out, work, n_threads);
}

#else /* LX_GEMM_PASS: the kernel section, compiled once per pass ----------------------------- */

#if LX_GEMM_PASS == 3
#define L 16
#define TMAX 3
/* LX_CHAIN on any of the 32 zmm: "x" (xmm0-15) made GCC move each accumulator kept in zmm16-31 into a low
 * register and back around every chain step (two vector moves per vpdpbusd) */
#define CHAIN(v) __asm__("" : "+v"(v))
#define VI __m512i
#define VF __m512
#define LDI(p) _mm512_loadu_si512((const void *) (p))
#define BCI(p) _mm512_set1_epi32(ld32(p))
#define DP(acc, u, s) _mm512_dpbusd_epi32(acc, u, s)
#define CVT(v) _mm512_cvtepi32_ps(v)
#define LDF(p) _mm512_loadu_ps(p)
#define BCF(p) _mm512_set1_ps(*(p))
#define MULF(a, b) _mm512_mul_ps(a, b)
#define FMAF(a, b, c) _mm512_fmadd_ps(a, b, c)
#define STF(p, v) _mm512_storeu_ps(p, v)
#define ZEROF() _mm512_setzero_ps()
#define FNMAF(a, b, c) _mm512_fnmadd_ps(a, b, c)
#define ZEROI() _mm512_setzero_si512()
#define SET16(x) _mm512_set1_epi16(x)
#define SET32(x) _mm512_set1_epi32(x)
#define ADD16(a, b) _mm512_add_epi16(a, b)
#define SUB16(a, b) _mm512_sub_epi16(a, b)
#define ADD32(a, b) _mm512_add_epi32(a, b)
#define MADDUBS(u, a) _mm512_maddubs_epi16(u, a)
#define MADD(a, b) _mm512_madd_epi16(a, b)
#else
#define L 8
#define TMAX 1
#define CHAIN(v) LX_CHAIN(v)
#define VI __m256i
#define VF __m256
#define LDI(p) _mm256_loadu_si256((const __m256i *) (p))
#define BCI(p) _mm256_set1_epi32(ld32(p))
#if LX_GEMM_PASS == 2
#define DP(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#else
/* u <= 31 here (nibbles, 5-bit values): the int16 pair sums cannot saturate */
#define DP(acc, u, s) _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)))
#endif
#define CVT(v) _mm256_cvtepi32_ps(v)
#define LDF(p) _mm256_loadu_ps(p)
#define BCF(p) _mm256_set1_ps(*(p))
#define MULF(a, b) _mm256_mul_ps(a, b)
#define FMAF(a, b, c) _mm256_fmadd_ps(a, b, c)
#define STF(p, v) _mm256_storeu_ps(p, v)
#define ZEROF() _mm256_setzero_ps()
#define FNMAF(a, b, c) _mm256_fnmadd_ps(a, b, c)
#define ZEROI() _mm256_setzero_si256()
#define SET16(x) _mm256_set1_epi16(x)
#define SET32(x) _mm256_set1_epi32(x)
#define ADD16(a, b) _mm256_add_epi16(a, b)
#define SUB16(a, b) _mm256_sub_epi16(a, b)
#define ADD32(a, b) _mm256_add_epi32(a, b)
#define MADDUBS(u, a) _mm256_maddubs_epi16(u, a)
#define MADD(a, b) _mm256_madd_epi16(a, b)
#endif

/* the integer dot of a step for weight bytes u (broadcast) and activations a */
static LX_INLINE LX_TGT VI SFX(dot_step)(lx_type wt, VI acc, VI u, VI a) {
#if LX_GEMM_PASS == 1
    if (wt == LX_TYPE_Q8_0) {   /* signed W bytes: |q| <= 128 against sign-moved a (sign trick) */
        const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(u), _mm256_sign_epi8(a, u));
        return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
    }
#else
    (void) wt;
#endif
    return DP(acc, u, a);
}

/* a tile's outputs out[(r nt + g) lanes + l] (W row r < nr, token group g < nt) into y[t][o0 + r] for the
 * tokens t = t0 + g lanes + l < n_tok. Whole pieces of 4 rows x 8 tokens go as a 4 x 8 transpose and 8
 * stores of 4 floats (one scalar store per output, each to another token's row of y, cost about a sixth
 * of the tile's time); the rest one float at a time. Moves bits only. */
static LX_INLINE LX_TGT void SFX(put_tile)(const float *out, int nr, int nt, int lanes, float *y, int64_t t0,
                                           int64_t n_tok, int64_t n_out, int64_t o0) {
    const int64_t rs = (int64_t) nt * lanes;   /* out's stride between rows */
    for (int g = 0; g < nt; ++g)
        for (int h = 0; h < lanes; h += 8) {
            const float *p = out + g * lanes + h;
            const int64_t t = t0 + g * lanes + h;
            float *q = y + t * n_out + o0;
            if (nr == 4 && t + 8 <= n_tok) {
                const __m256 a0 = _mm256_loadu_ps(p), a1 = _mm256_loadu_ps(p + rs);
                const __m256 a2 = _mm256_loadu_ps(p + 2 * rs), a3 = _mm256_loadu_ps(p + 3 * rs);
                const __m256 t01l = _mm256_unpacklo_ps(a0, a1), t01h = _mm256_unpackhi_ps(a0, a1);
                const __m256 t23l = _mm256_unpacklo_ps(a2, a3), t23h = _mm256_unpackhi_ps(a2, a3);
                const __m256 c0 = _mm256_shuffle_ps(t01l, t23l, 0x44), c1 = _mm256_shuffle_ps(t01l, t23l, 0xEE);
                const __m256 c2 = _mm256_shuffle_ps(t01h, t23h, 0x44), c3 = _mm256_shuffle_ps(t01h, t23h, 0xEE);
                _mm_storeu_ps(q, _mm256_castps256_ps128(c0));   /* token lane l: c[l % 4], half l / 4 */
                _mm_storeu_ps(q + n_out, _mm256_castps256_ps128(c1));
                _mm_storeu_ps(q + 2 * n_out, _mm256_castps256_ps128(c2));
                _mm_storeu_ps(q + 3 * n_out, _mm256_castps256_ps128(c3));
                _mm_storeu_ps(q + 4 * n_out, _mm256_extractf128_ps(c0, 1));
                _mm_storeu_ps(q + 5 * n_out, _mm256_extractf128_ps(c1, 1));
                _mm_storeu_ps(q + 6 * n_out, _mm256_extractf128_ps(c2, 1));
                _mm_storeu_ps(q + 7 * n_out, _mm256_extractf128_ps(c3, 1));
                continue;
            }
            for (int r = 0; r < nr; ++r)
                for (int l = 0; l < 8 && t + l < n_tok; ++l) q[l * n_out + r] = p[r * rs + l];
        }
}

#if LX_GEMM_PASS == 1
/* p[r T + g] = the int16 pair sums u*a + u'*a' of steps [s0, s1) of block b, W row r against token
 * group g (AVX2; the caller bounds the steps so the sums stay exact) */
static LX_INLINE LX_TGT void SFX(pair_sums)(const uint8_t *tile, int64_t n_in, int64_t b, const uint8_t *const *rec,
                                            int s0, int s1, __m256i *p, const int R, const int T) {
    for (int i = 0; i < R * T; ++i) p[i] = _mm256_setzero_si256();
    for (int s = s0; s < s1; ++s) {
        VI a[TMAX];
        for (int g = 0; g < T; ++g) a[g] = LDI(rec[g] + 4 * L * s);
        for (int r = 0; r < R; ++r) {
            const VI u = BCI(tile + r * n_in + LX_QK * b + 4 * s);
            for (int g = 0; g < T; ++g) {
                p[r * T + g] = _mm256_add_epi16(p[r * T + g], _mm256_maddubs_epi16(u, a[g]));
                CHAIN(p[r * T + g]);
            }
        }
    }
}
#endif

/* out[(r T + g) L + l] = output of W row r and token lane l of group g, for r < R, g < T */
static LX_INLINE LX_TGT void SFX(tile)(lx_type wt, const uint8_t *tile, int64_t n_in, const uint8_t *act,
                                       int64_t nb, float *out, const int R, const int T) {
    const float *dw = (const float *) (tile + LX_GEMM_R * n_in), *mw = dw + LX_GEMM_R * nb;
    const size_t rb = rec_bytes(L), gs = (size_t) nb * rb;
    VF acc[LX_GEMM_R * TMAX];
    for (int i = 0; i < R * T; ++i) acc[i] = ZEROF();
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *rec[TMAX];
        VI is[LX_GEMM_R * TMAX];
        for (int g = 0; g < T; ++g) rec[g] = act + g * gs + b * rb;
        if (LX_GEMM_PASS != 1 || (wt != LX_TYPE_Q4_0 && wt != LX_TYPE_Q4_1))
            for (int g = 0; g < T; ++g) {
                const VI c = LDI(rec[g] + 32 * L);
                for (int r = 0; r < R; ++r) is[r * T + g] = c;
            }
#if LX_GEMM_PASS == 1
        if (wt == LX_TYPE_Q4_0 || wt == LX_TYPE_Q4_1) {
            /* nibbles: the int16 pair sums u*a + u'*a' of all 8 steps (|pair| <= 2 * 15 * 127, the
             * sum <= 30480: exact), then one madd per output; the block's int32 sums are formed
             * after the steps, so only the pair sums, a and u are live in them (no spills) */
            __m256i p[LX_GEMM_R * TMAX];
            SFX(pair_sums)(tile, n_in, b, rec, 0, 8, p, R, T);
            for (int i = 0; i < R * T; ++i)   /* + the offset term c of token group i % T */
                is[i] = _mm256_add_epi32(LDI(rec[i % T] + 32 * L), _mm256_madd_epi16(p[i], _mm256_set1_epi16(1)));
        } else if (wt != LX_TYPE_Q8_0) {
            /* q5_0 / q5_1: |pair| <= 2 * 31 * 127, so 4 steps at a time (<= 31496) before a madd */
            for (int h = 0; h < 8; h += 4) {
                __m256i p[LX_GEMM_R * TMAX];
                SFX(pair_sums)(tile, n_in, b, rec, h, h + 4, p, R, T);
                for (int i = 0; i < R * T; ++i)
                    is[i] = _mm256_add_epi32(is[i], _mm256_madd_epi16(p[i], _mm256_set1_epi16(1)));
            }
        } else
#endif
        for (int s = 0; s < 8; ++s) {
            VI a[TMAX];
            for (int g = 0; g < T; ++g) a[g] = LDI(rec[g] + 4 * L * s);
            for (int r = 0; r < R; ++r) {
                const VI u = BCI(tile + r * n_in + LX_QK * b + 4 * s);
                for (int g = 0; g < T; ++g) {
                    is[r * T + g] = SFX(dot_step)(wt, is[r * T + g], u, a[g]);
                    CHAIN(is[r * T + g]);
                }
            }
        }
        for (int g = 0; g < T; ++g) {
            const VF dx = LDF((const float *) (rec[g] + 36 * L));
            for (int r = 0; r < R; ++r) {
                const VF s = MULF(BCF(dw + r * nb + b), dx);
                acc[r * T + g] = FMAF(s, CVT(is[r * T + g]), acc[r * T + g]);
            }
            if (has_min(wt)) {
                const VF sx = LDF((const float *) (rec[g] + 40 * L));
                for (int r = 0; r < R; ++r) acc[r * T + g] = FMAF(BCF(mw + r * nb + b), sx, acc[r * T + g]);
            }
        }
    }
    for (int i = 0; i < R * T; ++i) STF(out + i * L, acc[i]);
}

#if LX_GEMM_PASS == 1
/* the 32 unsigned (or, for q8_0, signed) W bytes of block b of a row, with its scales */
static LX_INLINE LX_TGT __m256i SFX(block_u)(lx_type wt, const uint8_t *row, int64_t b, uint16_t *dh, uint16_t *mh) {
    if (wt == LX_TYPE_Q8_0) {
        const lx_block_q8_0 *x = (const lx_block_q8_0 *) row + b;
        *dh = x->d;
        return _mm256_loadu_si256((const __m256i *) x->qs);
    }
    const uint8_t *qs, *qh = NULL;
    if (wt == LX_TYPE_Q4_0) {
        const lx_block_q4_0 *x = (const lx_block_q4_0 *) row + b;
        qs = x->qs, *dh = x->d;
    } else if (wt == LX_TYPE_Q4_1) {
        const lx_block_q4_1 *x = (const lx_block_q4_1 *) row + b;
        qs = x->qs, *dh = x->d, *mh = x->m;
    } else if (wt == LX_TYPE_Q5_0) {
        const lx_block_q5_0 *x = (const lx_block_q5_0 *) row + b;
        qs = x->qs, qh = x->qh, *dh = x->d;
    } else {
        const lx_block_q5_1 *x = (const lx_block_q5_1 *) row + b;
        qs = x->qs, qh = x->qh, *dh = x->d, *mh = x->m;
    }
    const __m256i v = lx_nib32_avx2(qs);   /* low nibbles in the low half, high ones in the high half */
    if (!qh) return v;
    return _mm256_or_si256(v, _mm256_and_si256(lx_bits32_avx2(qh), _mm256_set1_epi8(0x10)));
}

/* unpack_tile with the shared block unpacking (simd.h) and F16C (the same bytes and scales; a NaN scale keeps
 * its payload but gets the quiet bit, so NaN outputs may differ in payload between paths) */
static LX_TGT void SFX(unpack_tile)(lx_type wt, const uint8_t *w, size_t wrb, int64_t o0, int nr, int64_t n_in,
                                    int u128, uint8_t *tile, int rt) {
    const int64_t nb = n_in / LX_QK;
    float *dw = (float *) (tile + rt * n_in), *mw = dw + rt * nb;
    for (int r = 0; r < nr; ++r) {
        const uint8_t *row = w + (size_t) (o0 + r) * wrb;
        uint8_t *u = tile + r * n_in;
        for (int64_t b = 0; b < nb; ++b, u += LX_QK) {
            if (wt == LX_TYPE_Q8_0) {
                const lx_block_q8_0 *x = (const lx_block_q8_0 *) row + b;
                __m256i v = _mm256_loadu_si256((const __m256i *) x->qs);
                if (u128) v = _mm256_xor_si256(v, _mm256_set1_epi8((char) 0x80));
                _mm256_storeu_si256((__m256i *) u, v);
                dw[r * nb + b] = _cvtsh_ss(x->d);
                continue;
            }
            uint16_t dh, mh = 0;
            _mm256_storeu_si256((__m256i *) u, SFX(block_u)(wt, row, b, &dh, &mh));
            dw[r * nb + b] = _cvtsh_ss(dh);
            if (has_min(wt)) mw[r * nb + b] = _cvtsh_ss(mh);
        }
    }
}
#endif

#if LX_GEMM_PASS == 1
/* the next group-blocks' bytes LX_GEMM_PREFETCH_R8 ahead of gb into L2 (prefetcht1), a line at a time beside
 * the work (a prefetch never faults, so the last group's run past the end is harmless). Into L1 4 KB ahead
 * (prefetcht0) the stream ran at 23 GB/s on a 2-core Sapphire Rapids whose plain read reaches 27-30; into L2
 * 8-16 KB ahead, 26.5-27 (benchmarks/bench_output.py), while none at all loses 10-50% of a decode step. */
static LX_INLINE void prefetch_group(const uint8_t *gb, size_t gbb) {
    for (size_t off = 0; off < gbb; off += 64)
        __builtin_prefetch((const void *) ((uintptr_t) gb + LX_GEMM_PREFETCH_R8 + off), 0, 2);
}

/* rows 4 hi .. 4 hi + 3 of the 4 r8 chunks at c (bytes [4c', 4c' + 4) of the 8 rows' qs, c' = 0..3): each
 * row's 16 bytes, a 4 x 8 transpose of dwords */
static LX_INLINE LX_TGT void SFX(r8_rows4)(const uint8_t *c, int hi, __m128i *q) {
    const __m256i c0 = _mm256_loadu_si256((const __m256i *) c), c1 = _mm256_loadu_si256((const __m256i *) (c + 32));
    const __m256i c2 = _mm256_loadu_si256((const __m256i *) (c + 64)), c3 = _mm256_loadu_si256((const __m256i *) (c + 96));
    const __m256i t0 = _mm256_unpacklo_epi32(c0, c1), t1 = _mm256_unpackhi_epi32(c0, c1);
    const __m256i t2 = _mm256_unpacklo_epi32(c2, c3), t3 = _mm256_unpackhi_epi32(c2, c3);
    const __m256i r[4] = {_mm256_unpacklo_epi64(t0, t2), _mm256_unpackhi_epi64(t0, t2),   /* rows k | k + 4 */
                          _mm256_unpacklo_epi64(t1, t3), _mm256_unpackhi_epi64(t1, t3)};
    for (int k = 0; k < 4; ++k) q[k] = hi ? _mm256_extracti128_si256(r[k], 1) : _mm256_castsi256_si128(r[k]);
}

/* unpack_tile straight from the r8 layout (lx_gemm_pack_r8): rows [o0, o0 + nr) lie in one group of 8
 * (o0 % 4 == 0, nr <= 4), so each group-block gives the tile's rows' qs by one transpose of its chunks
 * (r8_rows4); unpacked as block_u does (the same bytes and scales as unpack_tile over the GGUF rows),
 * into rows r0 .. r0 + nr - 1 of a tile of rt rows */
static LX_TGT void SFX(unpack_tile_r8)(lx_type wt, const uint8_t *w, int64_t o0, int nr, int64_t n_in, int u128,
                                       uint8_t *tile, int rt, int r0) {
    const int64_t nb = n_in / LX_QK;
    const int head = r8_head(wt), hi = (int) (o0 % 8) / 4, rr0 = 4 * hi;
    float *dw = (float *) (tile + rt * n_in) + r0 * nb, *mw = dw + rt * nb;
    const size_t gbb = 8 * lx_type_block_bytes(wt);
    const uint8_t *g0 = r8_block(w, wt, nb, o0, 0);
    tile += (size_t) r0 * n_in;
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *gb = g0 + b * gbb;
        prefetch_group(gb, gbb);
        __m128i lo[4], up[4];
        SFX(r8_rows4)(gb + head, hi, lo);
        if (wt == LX_TYPE_Q8_0) SFX(r8_rows4)(gb + head + 128, hi, up);
        for (int r = 0; r < nr; ++r) {
            const int rr = rr0 + r;
            uint16_t dh, mh;
            memcpy(&dh, gb + 2 * rr, 2);
            dw[r * nb + b] = _cvtsh_ss(dh);
            __m256i v;
            if (wt == LX_TYPE_Q8_0) {
                v = _mm256_set_m128i(up[r], lo[r]);
                if (u128) v = _mm256_xor_si256(v, _mm256_set1_epi8((char) 0x80));
            } else {
                v = lx_nib32_reg_avx2(lo[r]);
                if (wt == LX_TYPE_Q5_0)
                    v = _mm256_or_si256(v, _mm256_and_si256(lx_bits32_avx2(gb + 16 + 4 * rr), _mm256_set1_epi8(0x10)));
                if (wt == LX_TYPE_Q4_1) {
                    memcpy(&mh, gb + 16 + 2 * rr, 2);
                    mw[r * nb + b] = _cvtsh_ss(mh);
                }
            }
            _mm256_storeu_si256((__m256i *) (tile + r * n_in + LX_QK * b), v);
        }
    }
}

/* ---- few tokens (n_tok <= LX_GEMM_SMALL): 8 W rows in the lanes --------------------------------
 *
 * Each W block is unpacked in registers once per call and dotted with the few tokens' blocks
 * (32 bytes each, the planar rows below); the 8 rows' int32 partial sums are reduced exactly
 * (hadd tree) to one vector of 8 isums, then the same chain as gemm.h lane-wise over rows.
 * Planar activations, token stride n_in + 12 nb: int8 qs[n_in], int32 corr[nb], float dx[nb],
 * float sx[nb]. */

/* lane r = sum of the 8 int32 lanes of v[r] (exact) */
static LX_INLINE LX_TGT __m256i SFX(hsum8x8)(const __m256i *v) {
    const __m256i a0 = _mm256_hadd_epi32(v[0], v[1]), a1 = _mm256_hadd_epi32(v[2], v[3]);
    const __m256i a2 = _mm256_hadd_epi32(v[4], v[5]), a3 = _mm256_hadd_epi32(v[6], v[7]);
    const __m256i b0 = _mm256_hadd_epi32(a0, a1), b1 = _mm256_hadd_epi32(a2, a3);
    return _mm256_add_epi32(_mm256_permute2x128_si256(b0, b1, 0x20), _mm256_permute2x128_si256(b0, b1, 0x31));
}

/* lane r = sum of the 4 int32 lanes of m[r] (exact) */
static LX_INLINE LX_TGT __m256i SFX(hsum4x8)(const __m128i *m) {
    const __m256i a0 = _mm256_hadd_epi32(_mm256_set_m128i(m[4], m[0]), _mm256_set_m128i(m[5], m[1]));
    const __m256i a1 = _mm256_hadd_epi32(_mm256_set_m128i(m[6], m[2]), _mm256_set_m128i(m[7], m[3]));
    return _mm256_hadd_epi32(a0, a1);
}

/* each row's dword of v (one row per 32-bit lane) rearranged by pat: byte k of the result is
 * byte pat_k (0..3) of the same dword, or 0 where pat_k has bit 7 set */
static LX_INLINE LX_TGT __m256i SFX(lane_bytes)(__m256i v, uint32_t pat) {
    const __m256i lane = _mm256_set_epi32(0x0c0c0c0c, 0x08080808, 0x04040404, 0, 0x0c0c0c0c, 0x08080808, 0x04040404, 0);
    return _mm256_shuffle_epi8(v, _mm256_add_epi8(lane, _mm256_set1_epi32((int) pat)));
}

/* gemm.h's chain, lane-wise over 8 rows, for block b of planar token tk: acc += (dw dx_b) isum
 * (isum = is + corr_b), then q4_1's / q5_1's acc += mw sx_b */
static LX_INLINE LX_TGT __m256 SFX(chain_step)(lx_type wt, __m256 acc, __m256i is, __m256 dw, __m256 mw,
                                               const uint8_t *tk, int64_t nb, int64_t b) {
    const int32_t *corr = (const int32_t *) (tk + nb * LX_QK);
    const float *dx = (const float *) (corr + nb), *sx = dx + nb;
    const __m256i isv = _mm256_add_epi32(is, _mm256_set1_epi32(corr[b]));
    acc = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(dx[b])), _mm256_cvtepi32_ps(isv), acc);
    return has_min(wt) ? _mm256_fmadd_ps(mw, _mm256_set1_ps(sx[b]), acc) : acc;
}

/* the NT tokens' lanes 0..nr-1 into y[k][o0 + r] */
static LX_INLINE LX_TGT void SFX(store_tile)(const __m256 *acc, int NT, int nr, float *y, int64_t n_out,
                                             int64_t o0) {
    for (int k = 0; k < NT; ++k) {
        if (nr == 8) {   /* (the partial tile's copy loop is a memcpy call: 1% of a decode step) */
            _mm256_storeu_ps(y + k * n_out + o0, acc[k]);
            continue;
        }
        float out[8];
        _mm256_storeu_ps(out, acc[k]);
        for (int r = 0; r < nr; ++r) y[k * n_out + o0 + r] = out[r];
    }
}

static LX_INLINE LX_TGT void SFX(small_tile)(lx_type wt, const uint8_t *w, size_t wrb, int64_t o0, int nr,
                                             const uint8_t *act, size_t ts, int64_t nb, float *y,
                                             int64_t n_out, const int NT) {
    const uint8_t *rows[8];
    for (int r = 0; r < 8; ++r) rows[r] = w + (size_t) (o0 + (r < nr ? r : nr - 1)) * wrb;
    __m256 acc[8];
    for (int k = 0; k < NT; ++k) acc[k] = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < nb; ++b) {
        __m256i u[8];
        uint16_t dh[8], mh[8] = {0};
        for (int r = 0; r < 8; ++r) u[r] = SFX(block_u)(wt, rows[r], b, dh + r, mh + r);
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) dh));
        const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) mh));
        for (int k = 0; k < NT; ++k) {
            const uint8_t *tk = act + k * ts;
            const __m256i yv = _mm256_loadu_si256((const __m256i *) (tk + LX_QK * b));
            __m256i v[8];
            for (int r = 0; r < 8; ++r) {
                const __m256i p = wt == LX_TYPE_Q8_0
                    ? _mm256_maddubs_epi16(_mm256_abs_epi8(u[r]), _mm256_sign_epi8(yv, u[r]))
                    : _mm256_maddubs_epi16(u[r], yv);
                v[r] = _mm256_madd_epi16(p, ones);
            }
            acc[k] = SFX(chain_step)(wt, acc[k], SFX(hsum8x8)(v), dw, mw, tk, nb, b);
        }
    }
    SFX(store_tile)(acc, NT, nr, y, n_out, o0);
}

/* W in the r8 layout (lx_gemm_pack_r8): per group-block the head (8 d; q4_1's 8 m; q5_0's 8 qh),
 * then chunks of 32 bytes, chunk c holding bytes [4c, 4c + 4) of each row's qs, row after row.
 * Each lane is one row from the start: the token's 4 bytes are broadcast (for the nibble types the
 * low nibbles meet values 4c.., the high ones 16 + 4c..), and lane r ends with row r's exact block
 * sum (no reduction across lanes); then gemm.h's one fma per block (and q4_1's min term). int16
 * pair sums are added before one madd where they cannot overflow: 8 maddubs of nibbles
 * (<= 8 * 2 * 15 * 127), 4 of q5_0's 5-bit values (<= 4 * 2 * 31 * 127); q8_0 takes one each. */
static LX_INLINE LX_TGT void SFX(small_tile_r8)(lx_type wt, const uint8_t *w, size_t wrb, int64_t o0, int nr,
                                                const uint8_t *act, size_t ts, int64_t nb, float *y,
                                                int64_t n_out, const int NT) {
    const uint8_t *grp = w + (size_t) o0 * wrb;
    const size_t gbb = wrb / (size_t) nb * 8;   /* a group-block: 8 blocks' bytes */
    const int head = r8_head(wt);
    __m256 acc[8];
    for (int k = 0; k < NT; ++k) acc[k] = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1), m4 = _mm256_set1_epi8(0x0F), h5 = _mm256_set1_epi8(0x10);
    /* q5_0: byte k of lane r <- byte j of row r's qh (shuffle index 4 r + j), tested against bit
     * 4 (c % 2) + k; chunk c's low nibbles take qh byte c / 2, its high ones byte 2 + c / 2 (the
     * patterns are lane_bytes', built once outside the loop) */
    const __m256i lane_idx = _mm256_set_epi32(0x0c0c0c0c, 0x08080808, 0x04040404, 0,
                                              0x0c0c0c0c, 0x08080808, 0x04040404, 0);
    const __m256i bit_lo = _mm256_set1_epi32(0x08040201), bit_hi = _mm256_set1_epi32((int) 0x80402010);
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *gb = grp + (size_t) b * gbb;
        prefetch_group(gb, gbb);
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) gb));
        __m256i is[8];
        for (int k = 0; k < NT; ++k) is[k] = _mm256_setzero_si256();
        if (wt == LX_TYPE_Q8_0) {
            for (int c = 0; c < 8; ++c) {
                const __m256i wv = _mm256_loadu_si256((const __m256i *) (gb + head + 32 * c));
                const __m256i aw = _mm256_abs_epi8(wv);
                for (int k = 0; k < NT; ++k) {
                    const __m256i xb = _mm256_set1_epi32(ld32(act + k * ts + LX_QK * b + 4 * c));
                    is[k] = _mm256_add_epi32(is[k], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xb, wv)), ones));
                }
            }
        } else {
            __m256i p16[8];
            for (int k = 0; k < NT; ++k) p16[k] = _mm256_setzero_si256();
            const __m256i qh = wt == LX_TYPE_Q5_0 ? _mm256_loadu_si256((const __m256i *) (gb + 16))
                                                  : _mm256_setzero_si256();
            for (int c = 0; c < 4; ++c) {
                const __m256i wv = _mm256_loadu_si256((const __m256i *) (gb + head + 32 * c));
                __m256i lo = _mm256_and_si256(wv, m4), hi = _mm256_and_si256(_mm256_srli_epi16(wv, 4), m4);
                if (wt == LX_TYPE_Q5_0) {
                    const __m256i bit = c & 1 ? bit_hi : bit_lo;
                    const __m256i sl = _mm256_add_epi8(lane_idx, _mm256_set1_epi8((char) (c / 2)));
                    const __m256i sh = _mm256_add_epi8(lane_idx, _mm256_set1_epi8((char) (2 + c / 2)));
                    const __m256i bl = _mm256_and_si256(_mm256_shuffle_epi8(qh, sl), bit);
                    const __m256i bh = _mm256_and_si256(_mm256_shuffle_epi8(qh, sh), bit);
                    lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(bl, bit), h5));
                    hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_cmpeq_epi8(bh, bit), h5));
                }
                for (int k = 0; k < NT; ++k) {
                    const uint8_t *xk = act + k * ts + LX_QK * b + 4 * c;
                    const __m256i xl = _mm256_set1_epi32(ld32(xk)), xh = _mm256_set1_epi32(ld32(xk + 16));
                    p16[k] = _mm256_add_epi16(p16[k], _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl),
                                                                       _mm256_maddubs_epi16(hi, xh)));
                }
                if (wt == LX_TYPE_Q5_0 && (c & 1)) {
                    for (int k = 0; k < NT; ++k) {
                        is[k] = _mm256_add_epi32(is[k], _mm256_madd_epi16(p16[k], ones));
                        p16[k] = _mm256_setzero_si256();
                    }
                }
            }
            if (wt != LX_TYPE_Q5_0)
                for (int k = 0; k < NT; ++k) is[k] = _mm256_madd_epi16(p16[k], ones);
        }
        const __m256 mw = wt == LX_TYPE_Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (gb + 16)))
                                             : _mm256_setzero_ps();
        for (int k = 0; k < NT; ++k) acc[k] = SFX(chain_step)(wt, acc[k], is[k], dw, mw, act + k * ts, nb, b);
    }
    SFX(store_tile)(acc, NT, nr, y, n_out, o0);
}

/* F(args..., NT) with NT = n_tok as a constant, 1..8 (each count gets its own unrolled tile) */
#define LX_GEMM_BY_NT(F, ...)                                                                 \
    switch (n_tok) {                                                                          \
    case 1: F(__VA_ARGS__, 1); break;                                                         \
    case 2: F(__VA_ARGS__, 2); break;                                                         \
    case 3: F(__VA_ARGS__, 3); break;                                                         \
    case 4: F(__VA_ARGS__, 4); break;                                                         \
    case 5: F(__VA_ARGS__, 5); break;                                                         \
    case 6: F(__VA_ARGS__, 6); break;                                                         \
    case 7: F(__VA_ARGS__, 7); break;                                                         \
    default: F(__VA_ARGS__, 8); break;                                                        \
    }
#define LX_GEMM_SMALL_NT(WT) LX_GEMM_BY_NT(SFX(small_tile), WT, w, wrb, o0, nr, act, ts, nb, y, n_out)
#define LX_GEMM_SMALL_R8_NT(WT) LX_GEMM_BY_NT(SFX(small_tile_r8), WT, w, wrb, o0, nr, act_t, ts, nb, y_t, n_out)

/* rows [o0, o0 + nr) (nr <= 8) for the n_tok <= 8 planar tokens at act */
static LX_TGT void SFX(small_run)(lx_type wt, const uint8_t *w, size_t wrb, int64_t o0, int nr,
                                  const uint8_t *act, int64_t n_tok, int64_t nb, float *y, int64_t n_out,
                                  int r8) {
    const size_t ts = (size_t) nb * (LX_QK + 12);
    if (r8) {
        /* at most LX_GEMM_R8_NT tokens per pass over the tile (their accumulators and int16 sums
         * stay in registers; the group's bytes come from L1 the second time); a token's arithmetic
         * does not depend on its pass */
        const int64_t n_all = n_tok;
        for (int64_t t0 = 0; t0 < n_all; t0 += LX_GEMM_R8_NT) {
            const int64_t n_tok = n_all - t0 < LX_GEMM_R8_NT ? n_all - t0 : LX_GEMM_R8_NT;
            const uint8_t *act_t = act + (size_t) t0 * ts;
            float *y_t = y + t0 * n_out;
            switch (wt) {
            case LX_TYPE_Q4_0: LX_GEMM_SMALL_R8_NT(LX_TYPE_Q4_0) break;
            case LX_TYPE_Q4_1: LX_GEMM_SMALL_R8_NT(LX_TYPE_Q4_1) break;
            case LX_TYPE_Q5_0: LX_GEMM_SMALL_R8_NT(LX_TYPE_Q5_0) break;
            default: LX_GEMM_SMALL_R8_NT(LX_TYPE_Q8_0) break;
            }
        }
        return;
    }
    switch (wt) {
    case LX_TYPE_Q4_0: LX_GEMM_SMALL_NT(LX_TYPE_Q4_0) break;
    case LX_TYPE_Q4_1: LX_GEMM_SMALL_NT(LX_TYPE_Q4_1) break;
    case LX_TYPE_Q5_0: LX_GEMM_SMALL_NT(LX_TYPE_Q5_0) break;
    case LX_TYPE_Q5_1: LX_GEMM_SMALL_NT(LX_TYPE_Q5_1) break;
    default: LX_GEMM_SMALL_NT(LX_TYPE_Q8_0) break;
    }
}
#undef LX_GEMM_SMALL_NT
#undef LX_GEMM_SMALL_R8_NT

/* ---- K-quants (q4_K, q5_K, q6_K; AVX2 kernels: the few-token ones at every level, the token-lane ones below VNNI512) --
 *
 * Integer sums per super-block, all exact: the maddubs int16 pair sums of a sub-block are taken
 * by one madd against its scale broadcast as int16 (sc * (pair + pair') in int32), so the scale
 * costs nothing over the ones-madd; q6_K's -32 is subtracted pair-wise in int16 (ext's 32 y
 * pair sums, from the activations) before its madd; the mins' sum m_j * bs_j is a madd of the
 * (bs_2e, bs_2e+1) pairs against the (m_2e, m_2e+1) pairs. */

/* super-block b of a K row: the 256 stored values u into o (as unpack_k), the scales into sc16
 * (q4_K / q5_K: sc[0..7] then mn[0..7]; q6_K: sc[0..15]), d and dmin (F16C) */
static LX_INLINE LX_TGT void SFX(unpack_k)(lx_type wt, const uint8_t *row, int64_t b, uint8_t *o,
                                           int16_t *sc16, float *d, float *dmin) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    if (wt == LX_TYPE_Q6_K) {
        const lx_block_q6_K *x = (const lx_block_q6_K *) row + b;
        const __m256i m30 = _mm256_set1_epi8(0x30);
        for (int h = 0; h < 2; ++h) {
            const __m256i a = _mm256_loadu_si256((const __m256i *) (x->ql + 64 * h));
            const __m256i c = _mm256_loadu_si256((const __m256i *) (x->ql + 64 * h + 32));
            const __m256i hv = _mm256_loadu_si256((const __m256i *) (x->qh + 32 * h));
            __m256i *out = (__m256i *) (o + 128 * h);
            _mm256_storeu_si256(out, _mm256_or_si256(_mm256_and_si256(a, m4), _mm256_and_si256(_mm256_slli_epi16(hv, 4), m30)));
            _mm256_storeu_si256(out + 1, _mm256_or_si256(_mm256_and_si256(c, m4), _mm256_and_si256(_mm256_slli_epi16(hv, 2), m30)));
            _mm256_storeu_si256(out + 2, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), m4), _mm256_and_si256(hv, m30)));
            _mm256_storeu_si256(out + 3, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(c, 4), m4), _mm256_and_si256(_mm256_srli_epi16(hv, 2), m30)));
        }
        for (int g = 0; g < 16; ++g) sc16[g] = x->scales[g];
        *d = _cvtsh_ss(x->d), *dmin = 0.0f;
        return;
    }
    const lx_block_q4_K *x4 = (const lx_block_q4_K *) row + b;
    const lx_block_q5_K *x5 = (const lx_block_q5_K *) row + b;
    const int q5 = wt == LX_TYPE_Q5_K;
    const uint8_t *qs = q5 ? x5->qs : x4->qs, *scales = q5 ? x5->scales : x4->scales;
    const __m256i hv = q5 ? _mm256_loadu_si256((const __m256i *) x5->qh) : _mm256_setzero_si256();
    const __m256i one = _mm256_set1_epi8(1);
    for (int p = 0; p < 4; ++p) {
        const __m256i v = _mm256_loadu_si256((const __m256i *) (qs + 32 * p));
        __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        if (q5) {
            /* bit 2p (2p + 1) of each qh byte, moved to bit 4 of the byte */
            const __m128i c0 = _mm_cvtsi32_si128(2 * p), c1 = _mm_cvtsi32_si128(2 * p + 1);
            lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(hv, c0), one), 4));
            hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(hv, c1), one), 4));
        }
        _mm256_storeu_si256((__m256i *) (o + 64 * p), lo);
        _mm256_storeu_si256((__m256i *) (o + 64 * p + 32), hi);
    }
    /* the 12 scale bytes -> 8 scales then 8 mins (lx_k_scale_min's values, ggml's word masks: words
     * 0-1 the 6-bit scales, 2-3 the mins), widened to int16 in one store */
    uint32_t u[4];
    memcpy(u, scales, 12);
    const uint32_t m6 = 0x3f3f3f3fu, m4w = 0x0f0f0f0fu, m2 = 0x03030303u;
    u[3] = ((u[2] >> 4) & m4w) | (((u[1] >> 6) & m2) << 4);
    const uint32_t mn_lo = u[1] & m6;
    u[1] = (u[2] & m4w) | (((u[0] >> 6) & m2) << 4);
    u[2] = mn_lo;
    u[0] &= m6;
    _mm256_storeu_si256((__m256i *) sc16, _mm256_cvtepu8_epi16(_mm_set_epi32((int) u[3], (int) u[2], (int) u[1], (int) u[0])));
    *d = _cvtsh_ss(q5 ? x5->d : x4->d), *dmin = _cvtsh_ss(q5 ? x5->dmin : x4->dmin);
}

/* K tile of rt rows: bytes [rt][n_in], then float dw[rt][nbk], dm[rt][nbk], int16 sc[rt][nbk][16] */
static LX_TGT void SFX(unpack_tile_k)(lx_type wt, const uint8_t *w, size_t wrb, int64_t o0, int nr,
                                      int64_t n_in, uint8_t *tile, int rt) {
    const int64_t nbk = n_in / LX_QK_K;
    float *dw = (float *) (tile + rt * n_in), *dm = dw + rt * nbk;
    int16_t *sc = (int16_t *) (dm + rt * nbk);
    for (int r = 0; r < nr; ++r) {
        const uint8_t *row = w + (size_t) (o0 + r) * wrb;
        for (int64_t b = 0; b < nbk; ++b)
            SFX(unpack_k)(wt, row, b, tile + r * n_in + LX_QK_K * b, sc + (r * nbk + b) * 16,
                          dw + r * nbk + b, dm + r * nbk + b);
    }
}

/* unpack_tile_k straight from the r8 layout (r8_move_k), into rows r0 .. r0 + nr - 1 of a tile of rt rows:
 * rows [o0, o0 + nr) lie in one group of 8 (o0 % 4 == 0, nr <= 4); each super-block's 4 GGUF blocks are gathered by transposes of the
 * group-block's chunks (r8_rows4, 16 bytes of each row a call; a field of 3 chunks reads the next
 * field's first, whose own gather comes after), then unpacked as unpack_tile_k does */
static LX_TGT void SFX(unpack_tile_k_r8)(lx_type wt, const uint8_t *w, int64_t o0, int nr, int64_t n_in,
                                         uint8_t *tile, int rt, int r0) {
    const int64_t nbk = n_in / LX_QK_K;
    const int hi = (int) (o0 % 8) / 4, rr0 = 4 * hi;
    float *dw = (float *) (tile + rt * n_in) + r0 * nbk, *dm = dw + rt * nbk;
    int16_t *sc = (int16_t *) ((float *) (tile + rt * n_in) + 2 * rt * nbk) + r0 * nbk * 16;
    tile += (size_t) r0 * n_in;
    /* (offset in the group-block, chunks, offset in the GGUF block), in gather order */
    static const int q4[2][3] = {{R8K_Q4_SC, 3, 4}, {R8K_Q4_QS, 32, 16}};
    static const int q5[3][3] = {{R8K_Q4_SC, 3, 4}, {R8K_Q5_QH, 8, 16}, {R8K_Q5_QS, 32, 48}};
    static const int q6[3][3] = {{R8K_Q6_QL, 32, 0}, {R8K_Q6_QH, 16, 128}, {R8K_Q6_SC, 4, 192}};
    const int (*fl)[3] = wt == LX_TYPE_Q4_K ? q4 : wt == LX_TYPE_Q5_K ? q5 : q6;
    const int n_fl = wt == LX_TYPE_Q4_K ? 2 : 3;
    uint8_t blk[4][256] __attribute__((aligned(32)));
    const size_t gbb = 8 * lx_type_block_bytes(wt);
    const uint8_t *g0 = r8_block(w, wt, nbk, o0, 0);
    for (int64_t b = 0; b < nbk; ++b) {
        const uint8_t *gb = g0 + b * gbb;
        prefetch_group(gb, gbb);
        for (int f = 0; f < n_fl; ++f)
            for (int c = 0; c < fl[f][1]; c += 4) {
                __m128i q[4];
                SFX(r8_rows4)(gb + fl[f][0] + 32 * c, hi, q);
                for (int r = 0; r < 4; ++r) _mm_storeu_si128((__m128i *) (blk[r] + fl[f][2] + 4 * c), q[r]);
            }
        for (int r = 0; r < nr; ++r) {
            if (wt == LX_TYPE_Q6_K) {
                memcpy(blk[r] + 208, gb + 2 * (rr0 + r), 2);
            } else {
                memcpy(blk[r], gb + 2 * (rr0 + r), 2);
                memcpy(blk[r] + 2, gb + 16 + 2 * (rr0 + r), 2);
            }
            SFX(unpack_k)(wt, blk[r], 0, tile + r * n_in + LX_QK_K * b, sc + (r * nbk + b) * 16, dw + r * nbk + b,
                          dm + r * nbk + b);
        }
    }
}

/* W rows [o0, o0 + nr) unpacked into a tile of rt rows, from the r8 layout (4 rows of one group of 8 at a
 * time; o0 % 4 == 0) or from GGUF rows of wrb bytes, by the type's unpacker (u128: q8_0 as unsigned) */
static LX_TGT void SFX(unpack_rows)(lx_type wt, const uint8_t *w, int r8, size_t wrb, int64_t o0, int nr,
                                    int64_t n_in, int u128, uint8_t *tile, int rt) {
    if (!r8) {
        if (is_k(wt)) SFX(unpack_tile_k)(wt, w, wrb, o0, nr, n_in, tile, rt);
        else SFX(unpack_tile)(wt, w, wrb, o0, nr, n_in, u128, tile, rt);
        return;
    }
    for (int r0 = 0; r0 < nr; r0 += 4) {
        const int n4 = nr - r0 < 4 ? nr - r0 : 4;
        if (is_k(wt)) SFX(unpack_tile_k_r8)(wt, w, o0 + r0, n4, n_in, tile, rt, r0);
        else SFX(unpack_tile_r8)(wt, w, o0 + r0, n4, n_in, u128, tile, rt, r0);
    }
}

/* n_tok <= 8: 8 W rows in the lanes; each row's super-block is unpacked once (registers, its
 * int16 scale vectors) and dotted with every token's; the 8 rows' int32 sums (scales applied by
 * the madd) are reduced by hsum8x8, then the chain lane-wise over rows */
static LX_INLINE LX_TGT void SFX(small_tile_k)(lx_type wt, const uint8_t *w, size_t wrb, int64_t o0, int nr,
                                               const uint8_t *act, size_t ts, int64_t nbk, float *y,
                                               int64_t n_out, const int NT) {
    const uint8_t *rows[8];
    for (int r = 0; r < 8; ++r) rows[r] = w + (size_t) (o0 + (r < nr ? r : nr - 1)) * wrb;
    __m256 acc[8];
    for (int k = 0; k < NT; ++k) acc[k] = _mm256_setzero_ps();
    uint8_t ub[LX_QK_K] __attribute__((aligned(32)));
    __m256i vbuf[8][8];                 /* [token][row]: the rows' int32 partial sums */
    __m128i mn16[8];                    /* [row]: q4_K / q5_K's 8 mins as int16 */
    for (int64_t b = 0; b < nbk; ++b) {
        float dwa[8], dma[8];
        for (int r = 0; r < 8; ++r) {
            int16_t sc16[16];
            SFX(unpack_k)(wt, rows[r], b, ub, sc16, dwa + r, dma + r);
            __m256i u[8], scv[8];
            for (int j = 0; j < 8; ++j) u[j] = _mm256_load_si256((const __m256i *) (ub + 32 * j));
            if (wt == LX_TYPE_Q6_K) {
                /* 32 values = groups 2j (low lane) and 2j + 1: bytes 2j x 8, 2j + 1 x 8, widened */
                const __m128i s8 = _mm_loadu_si128((const __m128i *) ((const lx_block_q6_K *) rows[r] + b)->scales);
                for (int j = 0; j < 8; ++j) {
                    const __m128i m = _mm_set_epi64x((long long) (0x0101010101010101ULL * (uint64_t) (2 * j + 1)),
                                                     (long long) (0x0101010101010101ULL * (uint64_t) (2 * j)));
                    scv[j] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(s8, m));
                }
            } else {
                /* scale j into every int16 of scv[j]: bytes (2j, 2j + 1) of the 8 scales, shuffled */
                const __m256i scb = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *) sc16));
                for (int j = 0; j < 8; ++j)
                    scv[j] = _mm256_shuffle_epi8(scb, _mm256_set1_epi16((short) (0x0100 + 0x0202 * j)));
                mn16[r] = _mm_loadu_si128((const __m128i *) (sc16 + 8));
            }
            for (int k = 0; k < NT; ++k) {
                const uint8_t *yq = act + k * ts + LX_QK_K * b;
                __m256i vi = _mm256_setzero_si256();
                for (int j = 0; j < 8; ++j) {
                    const __m256i yv = _mm256_loadu_si256((const __m256i *) (yq + 32 * j));
                    __m256i p = _mm256_maddubs_epi16(u[j], yv);
                    if (wt == LX_TYPE_Q6_K)   /* minus 32 y pair-wise: |pair| <= 8128 */
                        p = _mm256_sub_epi16(p, _mm256_maddubs_epi16(_mm256_set1_epi8(32), yv));
                    vi = _mm256_add_epi32(vi, _mm256_madd_epi16(p, scv[j]));
                    CHAIN(vi);
                }
                vbuf[k][r] = vi;
            }
        }
        const __m256 dw = _mm256_loadu_ps(dwa), dm = _mm256_loadu_ps(dma);
        for (int k = 0; k < NT; ++k) {
            const planar_k f = planar_k_of(act + k * ts, nbk);
            const __m256i is = SFX(hsum8x8)(vbuf[k]);
            const __m256 dx = _mm256_set1_ps(f.dx[b]);
            acc[k] = _mm256_fmadd_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(is), acc[k]);
            if (wt != LX_TYPE_Q6_K) {
                /* lane r: sum_j m_rj bs_j (the 8 (bs_2e, bs_2e+1) int16 pairs of this super-block) */
                const __m128i bs16 = _mm_loadu_si128((const __m128i *) (f.bsp + 4 * b));
                __m128i mr[8];
                for (int r = 0; r < 8; ++r) mr[r] = _mm_madd_epi16(mn16[r], bs16);
                const __m256i ms = SFX(hsum4x8)(mr);
                acc[k] = _mm256_fnmadd_ps(_mm256_mul_ps(dm, dx), _mm256_cvtepi32_ps(ms), acc[k]);
            }
        }
    }
    SFX(store_tile)(acc, NT, nr, y, n_out, o0);
}

#define LX_GEMM_SMALL_NT(WT) LX_GEMM_BY_NT(SFX(small_tile_k), WT, w, wrb, o0, nr, act, ts, nbk, y, n_out)

/* rows [o0, o0 + nr) (nr <= 8) for the n_tok <= 8 planar K tokens at act */
static LX_TGT void SFX(small_run_k)(lx_type wt, const uint8_t *w, size_t wrb, int64_t o0, int nr,
                                    const uint8_t *act, int64_t n_tok, int64_t nbk, float *y, int64_t n_out) {
    const size_t ts = LX_K_TS(nbk);
    switch (wt) {
    case LX_TYPE_Q4_K: LX_GEMM_SMALL_NT(LX_TYPE_Q4_K) break;
    case LX_TYPE_Q5_K: LX_GEMM_SMALL_NT(LX_TYPE_Q5_K) break;
    default: LX_GEMM_SMALL_NT(LX_TYPE_Q6_K) break;
    }
}
#undef LX_GEMM_SMALL_NT

/* q4_K / q5_K / q6_K in the r8 layout (r8_move_k), n_tok <= 8, NT tokens a pass: lane r is row r
 * throughout, so the integer sums are small_tile_k's (each super-block's sum_j sc_j (q_j . y_j) and
 * q4_K's sum_j m_j bs_j, exact) without its per-row unpack and reduction, and the float chain is
 * small_tile_k's lane for lane. Each chunk's int16 pair sums are added before the madd that applies
 * the sub-block's scale where they cannot overflow: a q4_K sub-block's 8 chunks (<= 8 * 2 * 15 * 127),
 * half of a q5_K one's (<= 4 * 2 * 31 * 127),
 * two of a q6_K group's four (u y pairs of the stored u = q + 32, <= 2 * 2 * 63 * 127), its -32 y
 * taken once a super-block from q8_K's sums of 16. */
static LX_INLINE LX_TGT void SFX(small_tile_k_r8)(lx_type wt, const uint8_t *w, size_t wrb, int64_t o0, int nr,
                                                  const uint8_t *act, size_t ts, int64_t nbk, float *y,
                                                  int64_t n_out, const int NT) {
    const uint8_t *grp = w + (size_t) o0 * wrb;
    const size_t gbb = 8 * lx_type_block_bytes(wt);   /* a group-block: 8 super-blocks' bytes */
    __m256 acc[2];
    for (int k = 0; k < NT; ++k) acc[k] = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    for (int64_t b = 0; b < nbk; ++b) {
        const uint8_t *gb = grp + (size_t) b * gbb;
        prefetch_group(gb, gbb);
        const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) gb));
        __m256i is[2];
        for (int k = 0; k < NT; ++k) is[k] = _mm256_setzero_si256();
        if (wt != LX_TYPE_Q6_K) {
            /* unpack_k's word masks, lane-wise: sc 0-3, sc 4-7, mins 0-3, mins 4-7 as bytes */
            const __m256i u0 = _mm256_loadu_si256((const __m256i *) (gb + R8K_Q4_SC));
            const __m256i u1 = _mm256_loadu_si256((const __m256i *) (gb + R8K_Q4_SC + 32));
            const __m256i u2 = _mm256_loadu_si256((const __m256i *) (gb + R8K_Q4_SC + 64));
            const __m256i m6 = _mm256_set1_epi32(0x3f3f3f3f), m4w = _mm256_set1_epi32(0x0f0f0f0f), m2 = _mm256_set1_epi32(0x03030303);
            const __m256i one = _mm256_set1_epi8(1);
            const int q5 = wt == LX_TYPE_Q5_K;
            const __m256i sc[2] = {_mm256_and_si256(u0, m6),
                                   _mm256_or_si256(_mm256_and_si256(u2, m4w), _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u0, 6), m2), 4))};
            const __m256i mn[2] = {_mm256_and_si256(u1, m6),
                                   _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi32(u2, 4), m4w), _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(u1, 6), m2), 4))};
            LX_UNROLL
            for (int p = 0; p < 4; ++p) {
                __m256i lo16[2], hi16[2];
                for (int k = 0; k < NT; ++k) lo16[k] = hi16[k] = _mm256_setzero_si256();
                /* sub-blocks 2p and 2p + 1: byte (2p) % 4, (2p + 1) % 4 of sc[p / 2], zero-extended */
                const uint32_t jl = (uint32_t) (2 * p) % 4, jh = (uint32_t) (2 * p + 1) % 4;
                const __m256i sl = SFX(lane_bytes)(sc[p / 2], 0x80008000u | jl << 16 | jl);
                const __m256i sh = SFX(lane_bytes)(sc[p / 2], 0x80008000u | jh << 16 | jh);
                LX_UNROLL
                for (int i = 0; i < 8; ++i) {
                    const __m256i wv = _mm256_loadu_si256((const __m256i *) (gb + (q5 ? R8K_Q5_QS : R8K_Q4_QS) + 32 * (8 * p + i)));
                    __m256i lo = _mm256_and_si256(wv, m4), hi = _mm256_and_si256(_mm256_srli_epi16(wv, 4), m4);
                    if (q5) {   /* bits 2p, 2p + 1 of qh bytes [4i, 4i + 4): bit 4 of lo, hi */
                        const __m256i hv = _mm256_loadu_si256((const __m256i *) (gb + R8K_Q5_QH + 32 * i));
                        lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hv, 2 * p), one), 4));
                        hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hv, 2 * p + 1), one), 4));
                    }
                    for (int k = 0; k < NT; ++k) {
                        const uint8_t *yk = act + k * ts + LX_QK_K * b + 64 * p + 4 * i;
                        lo16[k] = _mm256_add_epi16(lo16[k], _mm256_maddubs_epi16(lo, _mm256_set1_epi32(ld32(yk))));
                        hi16[k] = _mm256_add_epi16(hi16[k], _mm256_maddubs_epi16(hi, _mm256_set1_epi32(ld32(yk + 32))));
                    }
                    if (i == 7 || (q5 && i == 3)) {   /* q5_K: 4 chunks of 5-bit values, then the madd */
                        for (int k = 0; k < NT; ++k) {
                            is[k] = _mm256_add_epi32(is[k], _mm256_add_epi32(_mm256_madd_epi16(lo16[k], sl), _mm256_madd_epi16(hi16[k], sh)));
                            lo16[k] = hi16[k] = _mm256_setzero_si256();
                        }
                    }
                }
            }
            const __m256 dm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) (gb + 16)));
            for (int k = 0; k < NT; ++k) {
                const planar_k f = planar_k_of(act + k * ts, nbk);
                const __m256 dx = _mm256_set1_ps(f.dx[b]);
                acc[k] = _mm256_fmadd_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(is[k]), acc[k]);
                /* lane r: sum_e (m_2e, m_2e+1) . (bs_2e, bs_2e+1): mins pair e = bytes 2 (e % 2), +1 of mn[e / 2] */
                __m256i ms = _mm256_setzero_si256();
                for (int e = 0; e < 4; ++e) {
                    const uint32_t e0 = 2 * (uint32_t) (e % 2);
                    const __m256i mp = SFX(lane_bytes)(mn[e / 2], 0x80008000u | (e0 + 1) << 16 | e0);
                    ms = _mm256_add_epi32(ms, _mm256_madd_epi16(mp, _mm256_set1_epi32(f.bsp[4 * b + e])));
                }
                acc[k] = _mm256_fnmadd_ps(_mm256_mul_ps(dm, dx), _mm256_cvtepi32_ps(ms), acc[k]);
            }
        } else {
            __m256i s8[4];   /* the 16 scales: dword k = scales 4k .. 4k + 3 */
            for (int q = 0; q < 4; ++q) s8[q] = _mm256_loadu_si256((const __m256i *) (gb + R8K_Q6_SC + 32 * q));
            LX_UNROLL
            for (int h = 0; h < 2; ++h) {
                LX_UNROLL
                for (int i2 = 0; i2 < 4; ++i2) {
                    __m256i a16[2][4];
                    for (int k = 0; k < NT; ++k)
                        for (int sx = 0; sx < 4; ++sx) a16[k][sx] = _mm256_setzero_si256();
                    LX_UNROLL
                    for (int i = 2 * i2; i < 2 * i2 + 2; ++i) {
                        const __m256i hv = _mm256_loadu_si256((const __m256i *) (gb + R8K_Q6_QH + 32 * (8 * h + i)));
                        const __m256i a = _mm256_loadu_si256((const __m256i *) (gb + R8K_Q6_QL + 32 * (16 * h + i)));
                        const __m256i c = _mm256_loadu_si256((const __m256i *) (gb + R8K_Q6_QL + 32 * (16 * h + 8 + i)));
                        __m256i v[4];
                        v[0] = _mm256_or_si256(_mm256_and_si256(a, m4), _mm256_and_si256(_mm256_slli_epi16(hv, 4), m30));
                        v[1] = _mm256_or_si256(_mm256_and_si256(c, m4), _mm256_and_si256(_mm256_slli_epi16(hv, 2), m30));
                        v[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), m4), _mm256_and_si256(hv, m30));
                        v[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(c, 4), m4), _mm256_and_si256(_mm256_srli_epi16(hv, 2), m30));
                        for (int k = 0; k < NT; ++k)
                            for (int sx = 0; sx < 4; ++sx) {   /* values 128 h + 32 sx + 4 i .. + 4 */
                                const __m256i yb = _mm256_set1_epi32(ld32(act + k * ts + LX_QK_K * b + 128 * h + 32 * sx + 4 * i));
                                a16[k][sx] = _mm256_add_epi16(a16[k][sx], _mm256_maddubs_epi16(v[sx], yb));
                            }
                    }
                    LX_UNROLL
                    for (int sx = 0; sx < 4; ++sx) {
                        /* group 8 h + 2 sx + i2 / 2: its int8 scale into the high byte of both int16, then >> 8 */
                        const int g = 8 * h + 2 * sx + i2 / 2;
                        const uint32_t j = (uint32_t) g % 4;
                        const __m256i scv = _mm256_srai_epi16(SFX(lane_bytes)(s8[g / 4], 0x00800080u | j << 24 | j << 8), 8);
                        for (int k = 0; k < NT; ++k) is[k] = _mm256_add_epi32(is[k], _mm256_madd_epi16(a16[k][sx], scv));
                    }
                }
            }
            /* the stored u = q + 32: minus 32 sum_g sc_g bs16_g, lane-wise over the (g, g + 1) pairs */
            __m256i sp[8];
            LX_UNROLL
            for (int e = 0; e < 8; ++e) {
                const uint32_t e0 = 2 * (uint32_t) (e % 2);
                sp[e] = _mm256_srai_epi16(SFX(lane_bytes)(s8[e / 2], 0x00800080u | (e0 + 1) << 24 | e0 << 8), 8);
            }
            for (int k = 0; k < NT; ++k) {
                const planar_k f = planar_k_of(act + k * ts, nbk);
                const uint8_t *bs = (const uint8_t *) (f.bs16 + 16 * b);   /* the (g, g + 1) pairs, a dword each */
                __m256i cr = _mm256_setzero_si256();
                for (int e = 0; e < 8; ++e) cr = _mm256_add_epi32(cr, _mm256_madd_epi16(sp[e], _mm256_set1_epi32(ld32(bs + 4 * e))));
                is[k] = _mm256_sub_epi32(is[k], _mm256_slli_epi32(cr, 5));
                acc[k] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_set1_ps(f.dx[b])), _mm256_cvtepi32_ps(is[k]), acc[k]);
            }
        }
    }
    SFX(store_tile)(acc, NT, nr, y, n_out, o0);
}

/* rows [o0, o0 + nr) of r8 W (o0 % 8 == 0) for the n_tok <= 8 planar K tokens at act, two a pass */
static LX_TGT void SFX(small_run_k_r8)(lx_type wt, const uint8_t *w, size_t wrb, int64_t o0, int nr,
                                       const uint8_t *act, int64_t n_tok, int64_t nbk, float *y, int64_t n_out) {
    const size_t ts = LX_K_TS(nbk);
#define LX_GEMM_K_R8(WT)                                                                           \
    (n_tok - t0 >= 2 ? SFX(small_tile_k_r8)(WT, w, wrb, o0, nr, a, ts, nbk, yt, n_out, 2)            \
                     : SFX(small_tile_k_r8)(WT, w, wrb, o0, nr, a, ts, nbk, yt, n_out, 1))
    for (int64_t t0 = 0; t0 < n_tok; t0 += 2) {
        const uint8_t *a = act + (size_t) t0 * ts;
        float *yt = y + t0 * n_out;
        switch (wt) {
        case LX_TYPE_Q4_K: LX_GEMM_K_R8(LX_TYPE_Q4_K); break;
        case LX_TYPE_Q5_K: LX_GEMM_K_R8(LX_TYPE_Q5_K); break;
        default: LX_GEMM_K_R8(LX_TYPE_Q6_K); break;
        }
    }
#undef LX_GEMM_K_R8
}
#endif

#if LX_GEMM_PASS == 1 || LX_GEMM_PASS == 3
/* ---- K-quants, token lanes: L tokens a group (AVX2 8, VNNI512 16: zmm) ----------------------------------
 *
 * q6_K, both passes: a group's int16 pair sums of u y over its 4 steps (maddubs), the activations' 32 (pair
 * sums) subtracted (|pair sums of (u - 32) y| <= 32512), one madd with the group's scale. q4_K / q5_K: AVX2
 * adds maddubs pair sums over 8 steps (q5_K 4) and takes sc_j by one madd; VNNI512 puts a sub-block's 32
 * values through vpdpbusd straight into int32 (|sum u y| <= 32 * 31 * 127; two chains, even and odd steps),
 * then multiplies by its scale (vpmulld): isum = sum_j sc_j p_j exactly (|isum| < 2^31, gemm.h). On zmm,
 * vpdpbusd + vpmulld beat the pair sums for q4_K (300 vs 275 GOP/s a core, the AVX2 kernel 205) but not for
 * q6_K's 16 scales a super-block (225 vs 240, AVX2 187). The mins' sum is a madd of (bs_2e, bs_2e+1) pairs
 * against (mn_2e, mn_2e+1) pairs; each lane's chain is gemm.h's, so both passes give the same bits. */

/* out[r L + l] = output of tile row r and token lane l of the group at rec0 */
static LX_INLINE LX_TGT void SFX(tile_k)(lx_type wt, const uint8_t *tile, int64_t n_in, const uint8_t *rec0,
                                         int64_t nbk, float *out, const int R) {
    const float *dw = (const float *) (tile + LX_GEMM_R * n_in), *dm = dw + LX_GEMM_R * nbk;
    const int16_t *sc = (const int16_t *) (dm + LX_GEMM_R * nbk);
    const size_t rb = rec_bytes_k(L);
    const int q6 = wt == LX_TYPE_Q6_K;
    VF acc[LX_GEMM_R];
    for (int r = 0; r < R; ++r) acc[r] = ZEROF();
    for (int64_t b = 0; b < nbk; ++b) {
        const uint8_t *rec = rec0 + b * rb, *ext = rec + 256 * L;
        const uint8_t *wb[LX_GEMM_R];
        const int16_t *sb[LX_GEMM_R];
        VI is[LX_GEMM_R], ms[LX_GEMM_R];
        for (int r = 0; r < R; ++r) {
            wb[r] = tile + r * n_in + LX_QK_K * b, sb[r] = sc + (r * nbk + b) * 16;
            is[r] = ZEROI(), ms[r] = ZEROI();
        }
        if (q6) {
            for (int e = 0; e < 16; ++e) {
                VI p[LX_GEMM_R];
                for (int r = 0; r < R; ++r) p[r] = ZEROI();
                for (int s = 0; s < 4; ++s) {
                    const VI a = LDI(rec + 4 * L * (4 * e + s));
                    for (int r = 0; r < R; ++r) {
                        p[r] = ADD16(p[r], MADDUBS(BCI(wb[r] + 16 * e + 4 * s), a));
                        CHAIN(p[r]);
                    }
                }
                const VI q = LDI(ext + 4 * L * e);
                for (int r = 0; r < R; ++r) {
                    is[r] = ADD32(is[r], MADD(SUB16(p[r], q), SET16(sb[r][e])));
                    CHAIN(is[r]);
                }
            }
        } else {
#if LX_GEMM_PASS == 3
            for (int j = 0; j < 8; ++j) {
                VI p[LX_GEMM_R][2];
                for (int r = 0; r < R; ++r) p[r][0] = p[r][1] = ZEROI();
                for (int s = 0; s < 8; ++s) {
                    const VI a = LDI(rec + 4 * L * (8 * j + s));
                    for (int r = 0; r < R; ++r) {
                        p[r][s & 1] = _mm512_dpbusd_epi32(p[r][s & 1], BCI(wb[r] + 32 * j + 4 * s), a);
                        CHAIN(p[r][s & 1]);
                    }
                }
                for (int r = 0; r < R; ++r)
                    is[r] = ADD32(is[r], _mm512_mullo_epi32(ADD32(p[r][0], p[r][1]), SET32(sb[r][j])));
            }
#else
            const int per = wt == LX_TYPE_Q5_K ? 4 : 8;   /* steps whose pair sums stay exact in int16 */
            for (int j = 0; j < 8; ++j)
                for (int h = 0; h < 8; h += per) {
                    VI p[LX_GEMM_R];
                    for (int r = 0; r < R; ++r) p[r] = ZEROI();
                    for (int s = h; s < h + per; ++s) {
                        const VI a = LDI(rec + 4 * L * (8 * j + s));
                        for (int r = 0; r < R; ++r) {
                            p[r] = ADD16(p[r], MADDUBS(BCI(wb[r] + 32 * j + 4 * s), a));
                            CHAIN(p[r]);
                        }
                    }
                    for (int r = 0; r < R; ++r) {
                        is[r] = ADD32(is[r], MADD(p[r], SET16(sb[r][j])));
                        CHAIN(is[r]);
                    }
                }
#endif
            for (int e = 0; e < 4; ++e) {
                const VI bs = LDI(ext + 4 * L * e);
                for (int r = 0; r < R; ++r) ms[r] = ADD32(ms[r], MADD(bs, BCI((const uint8_t *) (sb[r] + 8 + 2 * e))));
            }
        }
        const VF dx = LDF((const float *) (rec + 320 * L));
        for (int r = 0; r < R; ++r) {
            acc[r] = FMAF(MULF(BCF(dw + r * nbk + b), dx), CVT(is[r]), acc[r]);
            if (!q6)   /* fnmadd(m, ms, acc) = fmaf(-m, ms, acc), one rounding */
                acc[r] = FNMAF(MULF(BCF(dm + r * nbk + b), dx), CVT(ms[r]), acc[r]);
        }
    }
    for (int r = 0; r < R; ++r) STF(out + L * r, acc[r]);
}

#define LX_GEMM_KR(WT)                                               \
    switch (nr) {                                                    \
    case 1: SFX(tile_k)(WT, tile, n_in, a, nbk, out, 1); break;      \
    case 2: SFX(tile_k)(WT, tile, n_in, a, nbk, out, 2); break;      \
    case 3: SFX(tile_k)(WT, tile, n_in, a, nbk, out, 3); break;      \
    default: SFX(tile_k)(WT, tile, n_in, a, nbk, out, 4); break;     \
    }

/* run_fn for the K-quants (groups of L tokens) */
static LX_TGT void SFX(run_k)(lx_type wt, const uint8_t *tile, int64_t n_in, int nr, const uint8_t *act,
                              int64_t n_groups, float *y, int64_t n_tok, int64_t n_out, int64_t o0) {
    const int64_t nbk = n_in / LX_QK_K;
    const size_t gs = (size_t) nbk * rec_bytes_k(L);
    float out[LX_GEMM_R * L];
    for (int64_t g = 0; g < n_groups; ++g) {
        const uint8_t *a = act + g * gs;
        switch (wt) {
        case LX_TYPE_Q4_K: LX_GEMM_KR(LX_TYPE_Q4_K) break;
        case LX_TYPE_Q5_K: LX_GEMM_KR(LX_TYPE_Q5_K) break;
        default: LX_GEMM_KR(LX_TYPE_Q6_K) break;
        }
        SFX(put_tile)(out, nr, 1, L, y, g * L, n_tok, n_out, o0);
    }
}
#undef LX_GEMM_KR
#endif

#if LX_GEMM_PASS == 3 && defined(LX_GEMM_AMX)
/* ---- AMX (LX_SIMD_AMX, n_tok > LX_GEMM_SMALL; q4_0, q4_1, q5_0, q5_1, q8_0) --------------------------
 *
 * One tile product forms the exact block sums of 16 tokens x 16 W rows: C = A B (tdpbssd), A the tokens'
 * int8 block b (16 rows of 32 bytes: the planar activations of the few-token path, stride ts), B the 16
 * W rows' signed values q - c of the block in the tile's VNNI order (amx_order: 8 rows of 64 bytes, value
 * 4s + j of W row r at s 64 + 4 r), so C[t][r] is isum exactly, offset included. Then gemm.h's chain with
 * the W rows in the lanes (acc[t] = fma(dw dx_t, isum, acc[t]), dw dx_t the same rounded product as
 * dx_t dw; q4_1 / q5_1: fma(mw, sx_t, acc)), each token's 16 outputs one store: the bits of every other path.
 * Two sets of tile registers (C, A, B in tmm0-2 for even blocks, tmm3-5 for odd): the next block's tile
 * product is issued before the chain of this one reads its stored sums. */
#define LX_TGT_AMX __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq,avx512vnni,amx-tile,amx-int8")))

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_config;

/* this thread's tile shapes (they stay until the thread loads another configuration): the blocks' (kq 0)
 * C, A, B in tmm0-2 and tmm3-5; the K types' (kq 1) C of each digit in tmm0-3, A in tmm4, B in tmm5-7 */
static LX_TGT_AMX void amx_configure(int kq) {
    _Alignas(64) amx_config c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int k = 0; k < 8; ++k) c.rows[k] = 16, c.colsb[k] = 64;   /* C: int32 [16 tokens][16 rows]; K: all */
    if (!kq) {
        for (int k = 0; k < 6; k += 3) {
            c.colsb[k + 1] = 32;   /* A: 16 tokens x 32 bytes */
            c.rows[k + 2] = 8;     /* B: 8 steps x 16 rows x 4 bytes */
        }
        c.rows[6] = c.rows[7] = 0, c.colsb[6] = c.colsb[7] = 0;
    }
    /* ldtilecfg with the whole struct as its operand: GCC's _tile_loadconfig (12 at least) declares only
     * its first 8 bytes read, so the shapes' stores above are dead to the optimizer; where it drops them
     * (seen with this function not inlined) the tiles stay unconfigured and the first tile
     * instruction faults (SIGILL) */
    __asm__ volatile("ldtilecfg %0" : : "m"(c));
}

/* the 16 tokens' outputs from t0 (those below n_tok), the rows of keep, into y[t][o0 ..] */
static LX_INLINE LX_TGT_AMX void amx_store(const __m512 *acc, float *y, int64_t t0, int64_t n_tok, int64_t n_out,
                                           int64_t o0, __mmask16 keep) {
    const int nt = n_tok - t0 < 16 ? (int) (n_tok - t0) : 16;
    LX_UNROLL for (int t = 0; t < 16; ++t)
        if (t < nt) _mm512_mask_storeu_ps(y + (t0 + t) * n_out + o0, keep, acc[t]);
}

/* W's unpacked rows (unpack_tile's layout for 16 rows, q8_0 signed) in the tile order: per block b,
 * bytes [8][16][4] (value 4s + j of row r at 64 s + 4 r, minus the offset c: signed), then the
 * blocks' float dw [nb][16], mw [nb][16] */
static LX_TGT_AMX void amx_order(lx_type wt, const uint8_t *rows, int64_t n_in, uint8_t *ord) {
    const int64_t nb = n_in / LX_QK;
    const float *dw = (const float *) (rows + LX_GEMM_AMX_R * n_in), *mw = dw + LX_GEMM_AMX_R * nb;
    float *odw = (float *) (ord + (size_t) nb * 512), *omw = odw + 16 * nb;
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i by_row = _mm512_mullo_epi32(lane, _mm512_set1_epi32((int) n_in));
    const __m512i by_blk = _mm512_mullo_epi32(lane, _mm512_set1_epi32((int) nb));
    const __m512i c = _mm512_set1_epi8((char) canon_offset(wt));
    for (int64_t b = 0; b < nb; ++b) {
        for (int s = 0; s < 8; ++s) {
            const __m512i v = _mm512_i32gather_epi32(by_row, (const void *) (rows + LX_QK * b + 4 * s), 1);
            _mm512_store_si512((void *) (ord + 512 * b + 64 * s), _mm512_sub_epi8(v, c));
        }
        _mm512_store_ps(odw + 16 * b, _mm512_i32gather_ps(by_blk, dw + b, 4));
        if (has_min(wt)) _mm512_store_ps(omw + 16 * b, _mm512_i32gather_ps(by_blk, mw + b, 4));
    }
}

#define LX_AMX_REC 640  /* a record of 16 tokens' block: int8 qs [16][32], float dx [16], sx [16] */

/* token t's row x into its records (act + (t / 16 nb + b) LX_AMX_REC, row t % 16); x NULL: zeros */
static void amx_quantize(lx_type dt, const float *x, int64_t n_in, int64_t t, uint8_t *act) {
    const int64_t nb = n_in / LX_QK;
    const int l = (int) (t % 16);
    int8_t qs[LX_Q8_CHUNK * LX_QK];
    float d[LX_Q8_CHUNK], s[LX_Q8_CHUNK];
    int32_t sum[LX_Q8_CHUNK];
    for (int64_t b0 = 0; b0 < nb; b0 += LX_Q8_CHUNK) {
        const int64_t n = q8_chunk(dt, x, nb, b0, qs, d, s, sum);
        for (int64_t i = 0; i < n; ++i) {
            uint8_t *rec = act + (size_t) ((t / 16) * nb + b0 + i) * LX_AMX_REC;
            float *dx = (float *) (rec + 512), *sx = dx + 16;
            if (x) memcpy(rec + 32 * l, qs + LX_QK * i, LX_QK), dx[l] = d[i], sx[l] = s[i];
            else memset(rec + 32 * l, 0, LX_QK), dx[l] = 0.0f, sx[l] = 0.0f;
        }
    }
}

/* the tile product of block b into tile registers C, A, B (literal numbers), its sums stored to cs */
#define LX_AMX_BLOCK(TC, TA, TB, b, cs)                                                 \
    do {                                                                                \
        _tile_zero(TC);                                                                 \
        _tile_loadd(TA, a + (b) * LX_AMX_REC, 32);                                      \
        _tile_loadd(TB, ord + 512 * (b), 64);                                           \
        _tile_dpbssd(TC, TA, TB);                                                       \
        _tile_stored(TC, cs, 64);                                                       \
    } while (0)

/* gemm.h's chain step of block b for the 16 tokens of the record rec (amx_quantize), their sums at cs */
static LX_INLINE LX_TGT_AMX void amx_chain(lx_type wt, const int32_t *cs, const uint8_t *rec, const float *odw,
                                           const float *omw, int64_t b, __m512 *acc) {
    const __m512 dw = _mm512_load_ps(odw + 16 * b);
    const float *dx = (const float *) (rec + 512), *sx = dx + 16;
    LX_UNROLL for (int t = 0; t < 16; ++t) {
        const __m512 sc = _mm512_mul_ps(dw, _mm512_set1_ps(dx[t]));
        acc[t] = _mm512_fmadd_ps(sc, _mm512_cvtepi32_ps(_mm512_load_si512((const void *) (cs + 16 * t))), acc[t]);
    }
    if (has_min(wt)) {
        const __m512 mw = _mm512_load_ps(omw + 16 * b);
        LX_UNROLL for (int t = 0; t < 16; ++t) acc[t] = _mm512_fmadd_ps(mw, _mm512_set1_ps(sx[t]), acc[t]);
    }
}

/* y[t][o0 + r] (r < nr <= 16) for every token, W's 16 rows in the tile order at ord (wt a constant: amx_rows) */
static LX_INLINE LX_TGT_AMX void amx_rows_of(lx_type wt, const uint8_t *ord, const uint8_t *act, int64_t n_in, int64_t n_tok,
                                float *y, int64_t n_out, int64_t o0, int nr) {
    const int64_t nb = n_in / LX_QK;
    const float *odw = (const float *) (ord + (size_t) nb * 512), *omw = odw + 16 * nb;
    const __mmask16 keep = (__mmask16) (nr >= 16 ? 0xFFFF : (1u << nr) - 1);
    _Alignas(64) int32_t cs[2][256];
    for (int64_t t0 = 0; t0 < n_tok; t0 += 16) {
        const uint8_t *a = act + (size_t) (t0 / 16) * nb * LX_AMX_REC;
        __m512 acc[16];   /* registers throughout: every index a constant (else tilestored's memory clobber spills them) */
        LX_UNROLL for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
        LX_AMX_BLOCK(0, 1, 2, 0, cs[0]);
        for (int64_t b = 0; b < nb; b += 2) {   /* block b + 1's tile product issued before block b's chain */
            if (b + 1 < nb) LX_AMX_BLOCK(3, 4, 5, b + 1, cs[1]);
            amx_chain(wt, cs[0], a + b * LX_AMX_REC, odw, omw, b, acc);
            if (b + 1 < nb) {
                if (b + 2 < nb) LX_AMX_BLOCK(0, 1, 2, b + 2, cs[0]);
                amx_chain(wt, cs[1], a + (b + 1) * LX_AMX_REC, odw, omw, b + 1, acc);
            }
        }
        amx_store(acc, y, t0, n_tok, n_out, o0, keep);
    }
}
#undef LX_AMX_BLOCK

/* ---- AMX for the K types: the sub-block scales inside the tile products ------------------------------
 *
 * gemm.h's isum = sum_j sc_j (sum_{i in j} u_i y_i) with each scale written in digits (amx_digits:
 * sc = sum_k dig_k 2^(bits k)) is sum_k 2^(bits k) C_k, C_k = sum_i (dig_k(sc_j(i)) u_i) y_i: one tile
 * product of the whole super-block per digit, its W bytes dig u (q6_K: sign(sc) (u - 32) |sc|'s digits),
 * all int8. The sums C_k are exact int32 and so is the shifted sum: isum bit for bit. The mins' sum is
 * vpdpwssd of the (mn_2e, mn_2e+1) pairs against the token's (bs_2e, bs_2e+1) pairs, as the AVX2 kernels
 * form it. Then gemm.h's K chain with the W rows in the lanes. */
#define LX_AMX_KREC (4096 + 64 + 256)   /* 16 tokens' super-block: int8 qs [16][256], dx [16], int32 bsp [16][4] */

/* token t's row x into its K records (act + (t / 16 nbk + b) LX_AMX_KREC, row t % 16); x NULL: zeros */
static void amx_quantize_k(const float *x, int64_t n_in, int64_t t, uint8_t *act) {
    const int64_t nbk = n_in / LX_QK_K;
    const int l = (int) (t % 16);
    for (int64_t b = 0; b < nbk; ++b) {
        uint8_t *rec = act + (size_t) ((t / 16) * nbk + b) * LX_AMX_KREC;
        float *dx = (float *) (rec + 4096);
        int32_t *bsp = (int32_t *) (dx + 16) + 4 * l;
        lx_block_q8_K q;
        if (x) lx_quantize_row_q8_K(x + b * LX_QK_K, &q, LX_QK_K);
        else memset(&q, 0, sizeof q);
        memcpy(rec + LX_QK_K * l, q.qs, LX_QK_K);
        dx[l] = q.d;
        for (int e = 0; e < 4; ++e) {
            const int a = q.bsums[4 * e] + q.bsums[4 * e + 1], c = q.bsums[4 * e + 2] + q.bsums[4 * e + 3];
            bsp[e] = (int32_t) ((uint32_t) (uint16_t) a | ((uint32_t) (uint16_t) c << 16));
        }
    }
}

/* the K tile of 16 rows (unpack_tile_k's layout) in the tile order, per super-block b at ord + b kob:
 * digit k's bytes [64][16][4] (value 4s + j of row r at k 4096 + 64 s + 4 r), then float dw [16], dmin [16],
 * int32 mins' pairs [4][16] */
static LX_TGT_AMX void amx_order_k(lx_type wt, const uint8_t *rows, int64_t n_in, uint8_t *ord) {
    const int64_t nbk = n_in / LX_QK_K;
    const int nd = amx_digits(wt), bits = amx_digit_bits(wt), q6 = wt == LX_TYPE_Q6_K;
    const size_t kob = (size_t) nd * 4096 + 384;
    const float *dw = (const float *) (rows + LX_GEMM_AMX_R * n_in), *dm = dw + LX_GEMM_AMX_R * nbk;
    const int16_t *sc = (const int16_t *) (dm + LX_GEMM_AMX_R * nbk);
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i by_row = _mm512_mullo_epi32(lane, _mm512_set1_epi32(LX_QK_K));
    _Alignas(64) uint8_t plane[4][LX_GEMM_AMX_R][LX_QK_K];
    for (int64_t b = 0; b < nbk; ++b) {
        uint8_t *o = ord + b * kob;
        float *odw = (float *) (o + (size_t) nd * 4096), *odm = odw + 16;
        int32_t *omn = (int32_t *) (odm + 16);
        for (int r = 0; r < LX_GEMM_AMX_R; ++r) {
            const int16_t *scr = sc + (r * nbk + b) * 16;
            const uint8_t *u = rows + r * n_in + LX_QK_K * b;
            odw[r] = dw[r * nbk + b], odm[r] = dm[r * nbk + b];
            for (int e = 0; e < 4; ++e)
                omn[16 * e + r] = q6 ? 0 : (int32_t) ((uint32_t) (uint16_t) scr[8 + 2 * e] | ((uint32_t) (uint16_t) scr[9 + 2 * e] << 16));
            for (int h = 0; h < 8; ++h) {   /* 32 values: q4_K / q5_K sub-block h, q6_K sub-blocks 2h, 2h + 1 */
                __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *) (u + 32 * h)));
                int s0 = q6 ? scr[2 * h] : scr[h], s1 = q6 ? scr[2 * h + 1] : scr[h];
                if (q6) v = _mm512_sub_epi16(v, _mm512_set1_epi16(32));
                const int g0 = s0 < 0 ? -1 : 1, g1 = s1 < 0 ? -1 : 1;
                s0 *= g0, s1 *= g1;
                for (int k = 0; k < nd; ++k) {
                    const int d0 = (s0 >> (bits * k)) & ((1 << bits) - 1), d1 = (s1 >> (bits * k)) & ((1 << bits) - 1);
                    const __m512i m = _mm512_inserti64x4(_mm512_set1_epi16((short) (g0 * d0)), _mm256_set1_epi16((short) (g1 * d1)), 1);
                    _mm256_store_si256((__m256i *) (plane[k][r] + 32 * h), _mm512_cvtepi16_epi8(_mm512_mullo_epi16(v, m)));
                }
            }
        }
        for (int k = 0; k < nd; ++k)
            for (int q = 0; q < 64; ++q)
                _mm512_store_si512((void *) (o + 4096 * k + 64 * q),
                                   _mm512_i32gather_epi32(by_row, (const void *) (plane[k][0] + 4 * q), 1));
    }
}

/* the K chain of super-block b for the 16 tokens of rec, digit sums at cs [nd][256] */
static LX_INLINE LX_TGT_AMX void amx_chain_k(lx_type wt, const int32_t *cs, const uint8_t *rec, const uint8_t *o,
                                             __m512 *acc) {
    const int nd = amx_digits(wt), bits = amx_digit_bits(wt);
    const float *odw = (const float *) (o + (size_t) nd * 4096), *odm = odw + 16;
    const __m512i *omn = (const __m512i *) (odm + 16);
    const float *dx = (const float *) (rec + 4096);
    const int32_t *bsp = (const int32_t *) (dx + 16);
    const __m512 dw = _mm512_load_ps(odw), dm = _mm512_load_ps(odm);
    LX_UNROLL for (int t = 0; t < 16; ++t) {
        __m512i is = _mm512_load_si512((const void *) (cs + 16 * t));
        for (int k = 1; k < nd; ++k)
            is = _mm512_add_epi32(is, _mm512_slli_epi32(_mm512_load_si512((const void *) (cs + 256 * k + 16 * t)), bits * k));
        const __m512 x = _mm512_set1_ps(dx[t]);
        acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(dw, x), _mm512_cvtepi32_ps(is), acc[t]);
        if (wt != LX_TYPE_Q6_K) {
            __m512i ms = _mm512_setzero_si512();
            for (int e = 0; e < 4; ++e) ms = _mm512_dpwssd_epi32(ms, _mm512_load_si512(omn + e), _mm512_set1_epi32(bsp[4 * t + e]));
            acc[t] = _mm512_fnmadd_ps(_mm512_mul_ps(dm, x), _mm512_cvtepi32_ps(ms), acc[t]);
        }
    }
}

/* step m of 64 values: the tokens' bytes into tmm4, each digit's W bytes into tmm5-7 (5 again for the 4th) */
#define LX_AMX_KSTEP(m)                                                                          \
    do {                                                                                         \
        _tile_loadd(4, rec + 64 * (m), LX_QK_K);                                                 \
        _tile_loadd(5, o + 1024 * (m), 64);                                                      \
        _tile_dpbssd(0, 4, 5);                                                                   \
        _tile_loadd(6, o + 4096 + 1024 * (m), 64);                                               \
        _tile_dpbssd(1, 4, 6);                                                                   \
        if (nd > 2) {                                                                            \
            _tile_loadd(7, o + 8192 + 1024 * (m), 64);                                           \
            _tile_dpbssd(2, 4, 7);                                                               \
        }                                                                                        \
        if (nd > 3) {                                                                            \
            _tile_loadd(5, o + 12288 + 1024 * (m), 64);                                          \
            _tile_dpbssd(3, 4, 5);                                                               \
        }                                                                                        \
    } while (0)

/* amx_rows_of for the K types (wt a constant: amx_rows) */
static LX_INLINE LX_TGT_AMX void amx_rows_k_of(lx_type wt, const uint8_t *ord, const uint8_t *act, int64_t n_in, int64_t n_tok,
                                  float *y, int64_t n_out, int64_t o0, int nr) {
    const int64_t nbk = n_in / LX_QK_K;
    const int nd = amx_digits(wt);
    const size_t kob = (size_t) nd * 4096 + 384;
    const __mmask16 keep = (__mmask16) (nr >= 16 ? 0xFFFF : (1u << nr) - 1);
    _Alignas(64) int32_t cs[4][256];
    for (int64_t t0 = 0; t0 < n_tok; t0 += 16) {
        const uint8_t *a = act + (size_t) (t0 / 16) * nbk * LX_AMX_KREC;
        __m512 acc[16];
        LX_UNROLL for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nbk; ++b) {
            const uint8_t *rec = a + b * LX_AMX_KREC, *o = ord + b * kob;
            _tile_zero(0);
            _tile_zero(1);
            if (nd > 2) _tile_zero(2);
            if (nd > 3) _tile_zero(3);
            LX_AMX_KSTEP(0);
            LX_AMX_KSTEP(1);
            LX_AMX_KSTEP(2);
            LX_AMX_KSTEP(3);
            _tile_stored(0, cs[0], 64);
            _tile_stored(1, cs[1], 64);
            if (nd > 2) _tile_stored(2, cs[2], 64);
            if (nd > 3) _tile_stored(3, cs[3], 64);
            amx_chain_k(wt, cs[0], rec, o, acc);
        }
        amx_store(acc, y, t0, n_tok, n_out, o0, keep);
    }
}
#undef LX_AMX_KSTEP

/* y's rows [o0, o0 + nr) for every token from W's 16 rows in the tile order (amx_order / amx_order_k), the
 * kernel's type a constant (the blocks' chain differs only by the min term) */
static LX_TGT_AMX void amx_rows(lx_type wt, const uint8_t *ord, const uint8_t *act, int64_t n_in, int64_t n_tok,
                                float *y, int64_t n_out, int64_t o0, int nr) {
    switch (wt) {
    case LX_TYPE_Q4_K: amx_rows_k_of(LX_TYPE_Q4_K, ord, act, n_in, n_tok, y, n_out, o0, nr); break;
    case LX_TYPE_Q5_K: amx_rows_k_of(LX_TYPE_Q5_K, ord, act, n_in, n_tok, y, n_out, o0, nr); break;
    case LX_TYPE_Q6_K: amx_rows_k_of(LX_TYPE_Q6_K, ord, act, n_in, n_tok, y, n_out, o0, nr); break;
    case LX_TYPE_Q4_1: case LX_TYPE_Q5_1: amx_rows_of(LX_TYPE_Q4_1, ord, act, n_in, n_tok, y, n_out, o0, nr); break;
    default: amx_rows_of(LX_TYPE_Q4_0, ord, act, n_in, n_tok, y, n_out, o0, nr); break;
    }
}

/* lx_gemm at LX_SIMD_AMX for n_tok > LX_GEMM_SMALL: the tokens quantized into records of 16 (OpenMP over
 * tokens), then each thread's 16-row tiles: unpacked once (4 rows of r8 at a time, or GGUF rows), put in the
 * tile order, run against every 16 tokens */
static LX_TGT_AMX void gemm_amx(const void *w, lx_type wt, int r8, const float *x, float *y, int64_t n_tok,
                                int64_t n_in, int64_t n_out, void *work, int n_threads) {
    const int kq = is_k(wt);
    const lx_type dt = lx_gemm_dot_type(wt);
    const int64_t nb = n_in / LX_QK, n_tiles = (n_out + LX_GEMM_AMX_R - 1) / LX_GEMM_AMX_R;
    const size_t wrb = lx_row_bytes(wt, n_in), per_thread = tile_bytes(n_in) + amx_ord_bytes(wt, n_in);
    uint8_t *base = (uint8_t *) (((uintptr_t) work + 63) & ~(uintptr_t) 63);
    uint8_t *act = base, *tiles = base + act_bytes(n_tok, nb);
    (void) n_threads;
#ifdef _OPENMP
#pragma omp parallel num_threads(n_threads)
#endif
    {
#ifdef _OPENMP
        const int me = omp_get_thread_num();
#pragma omp for schedule(static)
#else
        const int me = 0;
#endif
        for (int64_t t = 0; t < (n_tok + 15) / 16 * 16; ++t) {
            const float *xt = t < n_tok ? x + t * n_in : NULL;
            if (kq) amx_quantize_k(xt, n_in, t, act);
            else amx_quantize(dt, xt, n_in, t, act);
        }
        uint8_t *rows = tiles + (size_t) me * per_thread, *ord = rows + tile_bytes(n_in);
        ord = (uint8_t *) (((uintptr_t) ord + 63) & ~(uintptr_t) 63);
        amx_configure(kq);
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t i = 0; i < n_tiles; ++i) {
            const int64_t o0 = i * LX_GEMM_AMX_R;
            const int nr = n_out - o0 < LX_GEMM_AMX_R ? (int) (n_out - o0) : LX_GEMM_AMX_R;
            unpack_rows_avx2(wt, (const uint8_t *) w, r8, wrb, o0, nr, n_in, 0, rows, LX_GEMM_AMX_R);
            if (kq) amx_order_k(wt, rows, n_in, ord);
            else amx_order(wt, rows, n_in, ord);
            __asm__ volatile("" ::: "memory");   /* ord written before the tile loads read it (they declare no memory) */
            amx_rows(wt, ord, act, n_in, n_tok, y, n_out, o0, nr);
        }
        _tile_release();
    }
}
#endif


#define LX_GEMM_T_CASES(WT, R)                                                   \
    switch (nt) {                                                                \
    case 1: SFX(tile)(WT, tile, n_in, a, nb, out, R, 1); break;                  \
    case 2: if (TMAX >= 2) SFX(tile)(WT, tile, n_in, a, nb, out, R, TMAX >= 2 ? 2 : 1); break; \
    default: if (TMAX >= 3) SFX(tile)(WT, tile, n_in, a, nb, out, R, TMAX >= 3 ? 3 : 1); break; \
    }
#define LX_GEMM_R_CASES(WT)                           \
    switch (nr) {                                     \
    case 1: LX_GEMM_T_CASES(WT, 1) break;             \
    case 2: LX_GEMM_T_CASES(WT, 2) break;             \
    case 3: LX_GEMM_T_CASES(WT, 3) break;             \
    default: LX_GEMM_T_CASES(WT, 4) break;            \
    }

static LX_TGT void SFX(run)(lx_type wt, const uint8_t *tile, int64_t n_in, int nr, const uint8_t *act,
                            int64_t n_groups, float *y, int64_t n_tok, int64_t n_out, int64_t o0) {
    const int64_t nb = n_in / LX_QK;
    const size_t gs = (size_t) nb * rec_bytes(L);
    float out[LX_GEMM_R * TMAX * L];
    for (int64_t g0 = 0; g0 < n_groups; g0 += TMAX) {
        const int nt = n_groups - g0 < TMAX ? (int) (n_groups - g0) : TMAX;
        const uint8_t *a = act + g0 * gs;
        switch (wt) {
        case LX_TYPE_Q4_0: LX_GEMM_R_CASES(LX_TYPE_Q4_0) break;
        case LX_TYPE_Q4_1: LX_GEMM_R_CASES(LX_TYPE_Q4_1) break;
        case LX_TYPE_Q5_0: LX_GEMM_R_CASES(LX_TYPE_Q5_0) break;
        case LX_TYPE_Q5_1: LX_GEMM_R_CASES(LX_TYPE_Q5_1) break;
        default: LX_GEMM_R_CASES(LX_TYPE_Q8_0) break;
        }
        SFX(put_tile)(out, nr, nt, L, y, g0 * L, n_tok, n_out, o0);
    }
}

#undef LX_GEMM_T_CASES
#undef LX_GEMM_R_CASES
#undef CHAIN
#undef L
#undef TMAX
#undef VI
#undef VF
#undef LDI
#undef BCI
#undef DP
#undef CVT
#undef LDF
#undef BCF
#undef MULF
#undef FMAF
#undef STF
#undef ZEROF
#undef FNMAF
#undef ZEROI
#undef SET16
#undef SET32
#undef ADD16
#undef SUB16
#undef ADD32
#undef MADDUBS
#undef MADD

#endif /* LX_GEMM_PASS */
