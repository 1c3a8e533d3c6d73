/* matmul.c: y = x W^T over ggml weight rows (see matmul.h for the contract).
 *
 *   lx_mul_mat:  quantize x rows (integer path)          omp for over tokens
 *                for each block of LX_MM_ROWS W rows      omp for, schedule(static)
 *                  for each group of <= 4 tokens (nt)
 *                    for each tile of 4/nt W rows: one pass over the tile's
 *                    rows, each W block unpacked once for the nt tokens, each
 *                    x block loaded once for the rows
 *
 * The integer dots follow ggml's x86 kernels in spirit (unsigned x signed byte
 * products, the sign trick for signed weights, per-group sums of the q8_K
 * activations for the K-format mins and offsets); the code is ours. On the
 * fast paths the quantized x rows are "planar" (all int8 quants of a row
 * contiguous, then the block scales as floats): the same numbers as ggml's
 * q8_0 / q8_1 / q8_K blocks (their f16 scales converted exactly), in a layout
 * the kernels read without conversions and that puts consecutive blocks'
 * quants side by side (one 64-byte load for two 32-blocks).
 *
 * The 256-bit kernels are written once and compiled twice by including this
 * file into itself (LX_MM_KERNEL_PASS): for AVX2+FMA+F16C (LX_SIMD_AVX2), and with
 * AVX-512 VNNI (vpdpbusd / vpdpwssd in place of maddubs + madd + add), whose
 * functions serve the 512-bit kernels of LX_SIMD_VNNI512 (their odd last block, the
 * horizontal sums, the float path).
 */
#ifndef LX_MM_KERNEL_PASS

#include "matmul.h"
#include "cpu.h"
#include "simd.h"

#include <assert.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define LX_MM_X86 1
#include <immintrin.h>
#endif

#define LX_INLINE inline __attribute__((always_inline))

/* ---- types ------------------------------------------------------------------- */

lx_type lx_mm_dot_type(lx_type w_type, lx_mm_act act) {
    if (act == LX_MM_ACT_Q8) {
        switch (w_type) {
        case LX_TYPE_Q4_0: case LX_TYPE_Q5_0: case LX_TYPE_Q8_0: return LX_TYPE_Q8_0;
        case LX_TYPE_Q4_1: case LX_TYPE_Q5_1: return LX_TYPE_Q8_1;
        case LX_TYPE_Q4_K: case LX_TYPE_Q5_K: case LX_TYPE_Q6_K: return LX_TYPE_Q8_K;
        default: break;
        }
    }
    return LX_TYPE_F32;
}

int lx_mm_supported(lx_type w_type) { return lx_type_can_dequantize(w_type); }

int64_t lx_mm_n_terms(lx_type w_type, int64_t n_in, lx_mm_act act) {
    const lx_type dt = lx_mm_dot_type(w_type, act);
    if (dt == LX_TYPE_F32) return n_in;
    const int64_t nb = n_in / lx_type_block_size(w_type);
    const int has_min = w_type == LX_TYPE_Q4_1 || w_type == LX_TYPE_Q5_1 ||
                        w_type == LX_TYPE_Q4_K || w_type == LX_TYPE_Q5_K;
    return has_min ? 2 * nb : nb;
}


/* ---- scalar reference ------------------------------------------------------------ */

/* The integer q of each value of a block (v = d*q [+ m] for the 32-blocks; for
 * the K formats, per group: v = (d*sc)*q - (dmin*mn), v = (d*sc)*q for q6_K),
 * in value order. */
static void unpack_4bit(const uint8_t *qs, int off, int8_t *q) {
    for (int j = 0; j < 16; ++j) {
        q[j] = (int8_t) ((qs[j] & 0xF) - off);
        q[j + 16] = (int8_t) ((qs[j] >> 4) - off);
    }
}

static void unpack_5bit(const uint8_t *qs, const uint8_t *qh4, int off, int8_t *q) {
    uint32_t qh;
    memcpy(&qh, qh4, sizeof qh);
    for (int j = 0; j < 16; ++j) {
        q[j] = (int8_t) (((qs[j] & 0xF) | (((qh >> j) & 1u) << 4)) - off);
        q[j + 16] = (int8_t) (((qs[j] >> 4) | (((qh >> (j + 16)) & 1u) << 4)) - off);
    }
}

static void unpack_q4_K(const lx_block_q4_K *b, int8_t *q, int *sc, int *mn) {
    for (int j = 0; j < 8; ++j) {
        uint8_t s, m;
        lx_k_scale_min(j, b->scales, &s, &m);
        sc[j] = s;
        mn[j] = m;
    }
    for (int p = 0; p < 4; ++p) {
        for (int l = 0; l < 32; ++l) {
            q[64 * p + l] = (int8_t) (b->qs[32 * p + l] & 0xF);
            q[64 * p + 32 + l] = (int8_t) (b->qs[32 * p + l] >> 4);
        }
    }
}

static void unpack_q5_K(const lx_block_q5_K *b, int8_t *q, int *sc, int *mn) {
    for (int j = 0; j < 8; ++j) {
        uint8_t s, m;
        lx_k_scale_min(j, b->scales, &s, &m);
        sc[j] = s;
        mn[j] = m;
    }
    for (int p = 0; p < 4; ++p) {
        for (int l = 0; l < 32; ++l) {
            q[64 * p + l] = (int8_t) ((b->qs[32 * p + l] & 0xF) | (((b->qh[l] >> (2 * p)) & 1) << 4));
            q[64 * p + 32 + l] = (int8_t) ((b->qs[32 * p + l] >> 4) | (((b->qh[l] >> (2 * p + 1)) & 1) << 4));
        }
    }
}

static void unpack_q6_K(const lx_block_q6_K *b, int8_t *q) {
    for (int h = 0; h < 2; ++h) {
        const uint8_t *ql = b->ql + 64 * h, *qh = b->qh + 32 * h;
        int8_t *o = q + 128 * h;
        for (int l = 0; l < 32; ++l) {
            o[l]      = (int8_t) (((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32);
            o[l + 32] = (int8_t) (((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32);
            o[l + 64] = (int8_t) (((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
            o[l + 96] = (int8_t) (((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
        }
    }
}

static int idot(const int8_t *a, const int8_t *b, int n) {
    int s = 0;
    for (int i = 0; i < n; ++i) s += a[i] * b[i];
    return s;
}

/* one W row . one quantized x row (n values), terms added one by one */
static float dot_ref(lx_type wt, const void *w, const void *xq, int64_t n) {
    float sumf = 0.0f;
    int8_t q[LX_QK_K];
    switch (wt) {
    case LX_TYPE_Q4_0: case LX_TYPE_Q5_0: case LX_TYPE_Q8_0: {
        const lx_block_q8_0 *y = xq;
        for (int64_t b = 0; b < n / LX_QK; ++b) {
            uint16_t dw;
            if (wt == LX_TYPE_Q4_0) {
                const lx_block_q4_0 *x = (const lx_block_q4_0 *) w + b;
                unpack_4bit(x->qs, 8, q);
                dw = x->d;
            } else if (wt == LX_TYPE_Q5_0) {
                const lx_block_q5_0 *x = (const lx_block_q5_0 *) w + b;
                unpack_5bit(x->qs, x->qh, 16, q);
                dw = x->d;
            } else {
                const lx_block_q8_0 *x = (const lx_block_q8_0 *) w + b;
                memcpy(q, x->qs, LX_QK);
                dw = x->d;
            }
            const int isum = idot(q, y[b].qs, LX_QK);
            sumf += (lx_fp16_to_fp32(dw) * lx_fp16_to_fp32(y[b].d)) * (float) isum;
        }
        return sumf;
    }
    case LX_TYPE_Q4_1: case LX_TYPE_Q5_1: {
        const lx_block_q8_1 *y = xq;
        for (int64_t b = 0; b < n / LX_QK; ++b) {
            uint16_t dw, mw;
            if (wt == LX_TYPE_Q4_1) {
                const lx_block_q4_1 *x = (const lx_block_q4_1 *) w + b;
                unpack_4bit(x->qs, 0, q);
                dw = x->d, mw = x->m;
            } else {
                const lx_block_q5_1 *x = (const lx_block_q5_1 *) w + b;
                unpack_5bit(x->qs, x->qh, 0, q);
                dw = x->d, mw = x->m;
            }
            const int isum = idot(q, y[b].qs, LX_QK);
            sumf += (lx_fp16_to_fp32(dw) * lx_fp16_to_fp32(y[b].d)) * (float) isum;
            sumf += lx_fp16_to_fp32(mw) * lx_fp16_to_fp32(y[b].s);
        }
        return sumf;
    }
    case LX_TYPE_Q4_K: case LX_TYPE_Q5_K: {
        const lx_block_q8_K *y = xq;
        for (int64_t b = 0; b < n / LX_QK_K; ++b) {
            int sc[8], mn[8];
            uint16_t dw, dmw;
            if (wt == LX_TYPE_Q4_K) {
                const lx_block_q4_K *x = (const lx_block_q4_K *) w + b;
                unpack_q4_K(x, q, sc, mn);
                dw = x->d, dmw = x->dmin;
            } else {
                const lx_block_q5_K *x = (const lx_block_q5_K *) w + b;
                unpack_q5_K(x, q, sc, mn);
                dw = x->d, dmw = x->dmin;
            }
            int isum = 0, msum = 0;
            for (int j = 0; j < 8; ++j) {
                isum += sc[j] * idot(q + 32 * j, y[b].qs + 32 * j, 32);
                msum += mn[j] * (y[b].bsums[2 * j] + y[b].bsums[2 * j + 1]);
            }
            sumf += (lx_fp16_to_fp32(dw) * y[b].d) * (float) isum;
            sumf -= (lx_fp16_to_fp32(dmw) * y[b].d) * (float) msum;
        }
        return sumf;
    }
    case LX_TYPE_Q6_K: {
        const lx_block_q8_K *y = xq;
        for (int64_t b = 0; b < n / LX_QK_K; ++b) {
            const lx_block_q6_K *x = (const lx_block_q6_K *) w + b;
            unpack_q6_K(x, q);
            int isum = 0;
            for (int g = 0; g < 16; ++g) isum += x->scales[g] * idot(q + 16 * g, y[b].qs + 16 * g, 16);
            sumf += (lx_fp16_to_fp32(x->d) * y[b].d) * (float) isum;
        }
        return sumf;
    }
    default:
        assert(0 && "dot_ref: no integer dot for this type");
        return 0.0f;
    }
}

void lx_mul_mat_ref(const void *w, lx_type w_type, const float *x, float *y, int64_t n_tok,
                    int64_t n_in, int64_t n_out, lx_mm_act act, void *work) {
    assert(lx_mm_supported(w_type));
    const lx_type dt = lx_mm_dot_type(w_type, act);
    const size_t wrb = lx_row_bytes(w_type, n_in);
    if (dt == LX_TYPE_F32) {
        float tile[LX_MM_TILE];
        for (int64_t o = 0; o < n_out; ++o) {
            const uint8_t *row = (const uint8_t *) w + (size_t) o * wrb;
            for (int64_t t = 0; t < n_tok; ++t) {
                const float *xt = x + t * n_in;
                float s = 0.0f;
                for (int64_t c0 = 0; c0 < n_in; c0 += LX_MM_TILE) {
                    const int64_t len = n_in - c0 < LX_MM_TILE ? n_in - c0 : LX_MM_TILE;
                    lx_dequantize_row_ref(w_type, row + lx_row_bytes(w_type, c0), tile, len);
                    for (int64_t i = 0; i < len; ++i) s += tile[i] * xt[c0 + i];
                }
                y[t * n_out + o] = s;
            }
        }
        return;
    }
    const size_t xrb = lx_row_bytes(dt, n_in);
    for (int64_t t = 0; t < n_tok; ++t) lx_quantize_row_ref(dt, x + t * n_in, (uint8_t *) work + t * xrb, n_in);
    for (int64_t o = 0; o < n_out; ++o)
        for (int64_t t = 0; t < n_tok; ++t)
            y[t * n_out + o] = dot_ref(w_type, (const uint8_t *) w + (size_t) o * wrb,
                                       (const uint8_t *) work + t * xrb, n_in);
}

/* ---- planar activation rows (fast integer paths) ---------------------------------- *
 *
 * One row per token, xs = act_row_bytes(dt, n) bytes apart:
 *   int8  qs[n]             padded to a multiple of 64 bytes (act_qs_bytes)
 *   float d[nb]             q8_0, q8_K: the block scale
 *   float ds[2 nb]          q8_1: (d, s) pairs
 *   int16 bsums[16 nb]      q8_K: sums of qs in groups of 16
 */
static size_t act_qs_bytes(int64_t n) { return ((size_t) n + 63) & ~(size_t) 63; }

static size_t act_row_bytes(lx_type dt, int64_t n) {
    const int64_t nb = n / lx_type_block_size(dt);
    size_t sz = act_qs_bytes(n) + (dt == LX_TYPE_Q8_1 ? 8 : 4) * (size_t) nb;
    if (dt == LX_TYPE_Q8_K) sz += 32 * (size_t) nb;
    return (sz + 63) & ~(size_t) 63;
}

/* x [n] -> the planar row at r (the values of lx_quantize_row(dt), bit for bit) */
static void quantize_planar(lx_type dt, const float *x, uint8_t *r, int64_t n) {
    int8_t *qs = (int8_t *) r;
    float *d = (float *) (r + act_qs_bytes(n));
    if (dt == LX_TYPE_Q8_0) {
        for (int64_t b = 0; b < n / LX_QK; ++b) {
            lx_block_q8_0 blk;
            lx_quantize_row_q8_0(x + b * LX_QK, &blk, LX_QK);
            memcpy(qs + b * LX_QK, blk.qs, LX_QK);
            d[b] = lx_fp16_to_fp32(blk.d);
        }
    } else if (dt == LX_TYPE_Q8_1) {
        for (int64_t b = 0; b < n / LX_QK; ++b) {
            lx_block_q8_1 blk;
            lx_quantize_row_q8_1(x + b * LX_QK, &blk, LX_QK);
            memcpy(qs + b * LX_QK, blk.qs, LX_QK);
            d[2 * b] = lx_fp16_to_fp32(blk.d);
            d[2 * b + 1] = lx_fp16_to_fp32(blk.s);
        }
    } else {
        const int64_t nb = n / LX_QK_K;
        int16_t *bs = (int16_t *) (d + nb);
        for (int64_t b = 0; b < nb; ++b) {
            lx_block_q8_K blk;
            lx_quantize_row_q8_K(x + b * LX_QK_K, &blk, LX_QK_K);
            memcpy(qs + b * LX_QK_K, blk.qs, LX_QK_K);
            d[b] = blk.d;
            memcpy(bs + 16 * b, blk.bsums, sizeof blk.bsums);
        }
    }
}

/* sc[0..8) and mn[0..8) of a q4_K / q5_K super-block from its 12 packed bytes
 * (the same values as lx_k_scale_min, by 32-bit masks and shifts) */
static LX_INLINE void k4_scales(const uint8_t *s12, uint8_t *scmn /* [16]: sc then mn */) {
    const uint32_t km1 = 0x3f3f3f3f, km2 = 0x0f0f0f0f, km3 = 0x03030303;
    uint32_t u[4];
    memcpy(u, s12, 12);
    u[3] = ((u[2] >> 4) & km2) | (((u[1] >> 6) & km3) << 4);   /* mn 4..7 */
    const uint32_t m03 = u[1] & km1;                              /* mn 0..3 */
    u[1] = (u[2] & km2) | (((u[0] >> 6) & km3) << 4);            /* sc 4..7 */
    u[2] = m03;
    u[0] &= km1;                                                  /* sc 0..3 */
    memcpy(scmn, u, 16);
}

/* ---- kernel signatures --------------------------------------------------------------- */

/* A tile: out[r * LX_MM_NT + k] = W row r . x row k for r < nr, k < nt, where nr * nt <= 4
 * (shapes 4x1, 3x1, 2x1, 2x2, 1x2, 1x3, 1x4, 1x1); W row r at w + r*wrb, x row k (planar)
 * at xq + k*xs, n values each. */
typedef void (*q8_tile_fn)(const uint8_t *w, size_t wrb, int nr, const uint8_t *xq, size_t xs, int nt,
                           int64_t n, float *out);

/* the W rows of a tile for nt tokens: as many as keep nr * nt <= 4 */
static int tile_rows(int nt) { return nt == 1 ? 4 : nt == 2 ? 2 : 1; }

/* one instantiation per tile shape, so that R and NT are constants */
#define LX_MM_TILE_SWITCH(call)                 \
    switch (nr * 8 + nt) {                      \
    case 4 * 8 + 1: call(4, 1); break;          \
    case 3 * 8 + 1: call(3, 1); break;          \
    case 2 * 8 + 1: call(2, 1); break;          \
    case 2 * 8 + 2: call(2, 2); break;          \
    case 1 * 8 + 2: call(1, 2); break;          \
    case 1 * 8 + 3: call(1, 3); break;          \
    case 1 * 8 + 4: call(1, 4); break;          \
    default: call(1, 1); break;                 \
    }

/* out[k] = sum_i w[i] * x[k*xs + i] for i < len, k < nt <= LX_MM_NT */
typedef void (*f32_dots_fn)(const float *w, const float *x, int64_t xs, int64_t len, int nt, float *out);

/* ---- portable C ---------------------------------------------------------------------- */

/* x rows as ggml blocks (the _ref's layout), one dot at a time */
static void q8_tile_portable(lx_type wt, const uint8_t *w, size_t wrb, int nr, const uint8_t *xq, size_t xs,
                             int nt, int64_t n, float *out) {
    for (int r = 0; r < nr; ++r)
        for (int k = 0; k < nt; ++k) out[r * LX_MM_NT + k] = dot_ref(wt, w + r * wrb, xq + k * xs, n);
}

static void f32_dots_portable(const float *w, const float *x, int64_t xs, int64_t len, int nt, float *out) {
    for (int k = 0; k < nt; ++k) {
        float s[8] = {0};
        int64_t i = 0;
        for (; i + 8 <= len; i += 8)
            for (int l = 0; l < 8; ++l) s[l] += w[i + l] * x[k * xs + i + l];
        for (; i < len; ++i) s[0] += w[i] * x[k * xs + i];
        out[k] = ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
    }
}

/* ---- SIMD kernels: two passes over the kernel section at the end of this file ---------- */

#ifdef LX_MM_X86
#define LX_MM_KERNEL_PASS 1
#define SFX(f) f##_avx2
#define LX_TGT __attribute__((target("avx2,fma,f16c")))
/* 8 int32 lanes, each the sum of 4 products u8 * s8 (the int16 pairs cannot
 * saturate here: |u| <= 128 with |s| <= 127, or u <= 63) */
#define LX_DOT_US8(u, s) _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
/* acc + pairwise int16 products summed into int32 lanes */
#define LX_DPWSSD(acc, a, b) _mm256_add_epi32(acc, _mm256_madd_epi16(a, b))
#include "matmul.c"
#undef LX_MM_KERNEL_PASS
#undef SFX
#undef LX_TGT
#undef LX_DOT_US8
#undef LX_DPWSSD

#define LX_MM_KERNEL_PASS 2
#define SFX(f) f##_vnni
#define LX_TGT __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni")))
#define LX_DOT_US8(u, s) _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s)
#define LX_DPWSSD(acc, a, b) _mm256_dpwssd_epi32(acc, a, b)
#include "matmul.c"
#undef LX_MM_KERNEL_PASS
#undef SFX
#undef LX_TGT
#undef LX_DOT_US8
#undef LX_DPWSSD
#endif /* LX_MM_X86 */

/* ---- AVX-512 kernels (512-bit vectors) ----------------------------------------------------- *
 *
 * Two 32-blocks (or 64 values of a K super-block) per vector: the planar x row holds the quants
 * of consecutive blocks contiguously, so one 64-byte load feeds both. Per token and block pair:
 * one vpdpbusd (or vpmaddubsw + vpdpwssd for the K formats), one scale permute, one FMA. Tiles
 * as in the kernel section (R rows x NT tokens); a last odd 32-block goes through the 256-bit
 * VNNI code of that section.
 */
#ifdef LX_MM_X86
#define LX_AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq,avx512vnni")))

/* 16-bit words: a in the low 256 bits, b in the high */
#define LX_W16(a, b) _mm512_inserti64x4(_mm512_set1_epi16(a), _mm256_set1_epi16(b), 1)

/* the 32 + 32 nibbles of two blocks, as bytes in the planar x order:
 * [qs0 low nibbles | qs0 high | qs1 low | qs1 high] */
static LX_INLINE LX_AVX512 __m512i nib64(const uint8_t *qs0, const uint8_t *qs1) {
    const __m512i t = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *) qs0))),
        _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *) qs1)), 1);
    const __m512i sh = _mm512_set_epi64(0x0004000400040004, 0x0004000400040004, 0, 0,
                                        0x0004000400040004, 0x0004000400040004, 0, 0);
    return _mm512_and_si512(_mm512_srlv_epi16(t, sh), _mm512_set1_epi8(0x0F));
}

/* bit j of the 64 bits (qh of block b, then of block b+1) */
static LX_INLINE __mmask64 qh64(const uint8_t *qh0, const uint8_t *qh1) {
    uint32_t a, b;
    memcpy(&a, qh0, 4);
    memcpy(&b, qh1, 4);
    return (__mmask64) a | ((__mmask64) b << 32);
}

/* f16 values as floats: (p0[0], p1[0], 0, 0), or (p0[0], p0[1], p1[0], p1[1]) when pair */
static LX_INLINE LX_AVX512 __m128 halves2(const void *p0, const void *p1, int pair) {
    if (pair) {
        uint32_t a, b;
        memcpy(&a, p0, 4);
        memcpy(&b, p1, 4);
        return _mm_cvtph_ps(_mm_insert_epi32(_mm_cvtsi32_si128((int) a), (int) b, 1));
    }
    uint16_t a, b;
    memcpy(&a, p0, 2);
    memcpy(&b, p1, 2);
    return _mm_cvtph_ps(_mm_cvtsi32_si128((int) ((uint32_t) a | ((uint32_t) b << 16))));
}

/* q4_0 / q5_0 / q8_0: blocks b, b+1 of R rows */
static LX_INLINE LX_AVX512 void sym2_512(lx_type wt, const uint8_t *w, size_t wrb, const uint8_t *xq,
                                         size_t xs, size_t qsb, int64_t b, __m512 *acc, const int R,
                                         const int NT) {
    const __m512i idx = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    for (int r = 0; r < R; ++r) {
        const uint8_t *wr = w + r * wrb;
        __m512i qw;
        const void *h0, *h1;
        if (wt == LX_TYPE_Q4_0) {
            const lx_block_q4_0 *x = (const lx_block_q4_0 *) wr + b;
            qw = _mm512_sub_epi8(nib64(x[0].qs, x[1].qs), _mm512_set1_epi8(8));
            h0 = &x[0].d, h1 = &x[1].d;
        } else if (wt == LX_TYPE_Q5_0) {
            const lx_block_q5_0 *x = (const lx_block_q5_0 *) wr + b;
            const __m512i nb4 = nib64(x[0].qs, x[1].qs);
            /* bit set: q - 16 = nibble; clear: nibble - 16 = nibble | 0xF0 */
            qw = _mm512_mask_mov_epi8(_mm512_or_si512(nb4, _mm512_set1_epi8((char) 0xF0)), qh64(x[0].qh, x[1].qh), nb4);
            h0 = &x[0].d, h1 = &x[1].d;
        } else {
            const lx_block_q8_0 *x = (const lx_block_q8_0 *) wr + b;
            qw = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *) x[0].qs)),
                                    _mm256_loadu_si256((const __m256i *) x[1].qs), 1);
            h0 = &x[0].d, h1 = &x[1].d;
        }
        const __m512i aw = _mm512_abs_epi8(qw);
        const __mmask64 neg = _mm512_movepi8_mask(qw);
        const __m128 dw = halves2(h0, h1, 0);                               /* (d0, d1, 0, 0) */
        for (int k = 0; k < NT; ++k) {
            const uint8_t *y = xq + k * xs;
            const __m512i yv = _mm512_loadu_si512((const void *) (y + 32 * b));
            const __m512i sy = _mm512_mask_sub_epi8(yv, neg, _mm512_setzero_si512(), yv);
            const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), aw, sy);
            const __m128 dx = _mm_castpd_ps(_mm_load_sd((const double *) ((const float *) (y + qsb) + b)));
            const __m512 s = _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_mul_ps(dw, dx)));
            acc[r * NT + k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), s, acc[r * NT + k]);
        }
    }
}

static LX_INLINE LX_AVX512 void tile_sym_512(lx_type wt, const uint8_t *w, size_t wrb, const uint8_t *xq,
                                             size_t xs, int64_t n, float *out, const int R, const int NT) {
    const size_t qsb = act_qs_bytes(n);
    const int64_t nb = n / LX_QK;
    __m512 acc[4];
    __m256 t[4];
    for (int i = 0; i < R * NT; ++i) acc[i] = _mm512_setzero_ps(), t[i] = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) sym2_512(wt, w, wrb, xq, xs, qsb, b, acc, R, NT);
    if (b < nb) sym_block_vnni(wt, w, wrb, xq, xs, qsb, b, t, R, NT);
    for (int i = 0; i < R * NT; ++i) t[i] = _mm256_add_ps(t[i], lx_fold16_avx512(acc[i]));
    store_tile_vnni(t, NULL, out, R, NT);
}

/* q4_1 / q5_1: blocks b, b+1 of R rows */
static LX_INLINE LX_AVX512 void min2_512(lx_type wt, const uint8_t *w, size_t wrb, const uint8_t *xq,
                                         size_t xs, size_t qsb, int64_t b, __m512 *acc, __m128 *summ,
                                         const int R, const int NT) {
    const __m512i idx = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
    for (int r = 0; r < R; ++r) {
        const uint8_t *wr = w + r * wrb;
        __m512i qw;
        __m128 dm;
        if (wt == LX_TYPE_Q4_1) {
            const lx_block_q4_1 *x = (const lx_block_q4_1 *) wr + b;
            qw = nib64(x[0].qs, x[1].qs);
            dm = halves2(&x[0], &x[1], 1);
        } else {
            const lx_block_q5_1 *x = (const lx_block_q5_1 *) wr + b;
            qw = _mm512_or_si512(nib64(x[0].qs, x[1].qs),
                                 _mm512_maskz_mov_epi8(qh64(x[0].qh, x[1].qh), _mm512_set1_epi8(0x10)));
            dm = halves2(&x[0], &x[1], 1);
        }
        /* dm = (d0, m0, d1, m1); x's (d, s) pairs of the two blocks are adjacent too */
        for (int k = 0; k < NT; ++k) {
            const uint8_t *y = xq + k * xs;
            const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), qw,
                                                  _mm512_loadu_si512((const void *) (y + 32 * b)));
            const __m128 prod = _mm_mul_ps(dm, _mm_loadu_ps((const float *) (y + qsb) + 2 * b));
            summ[r * NT + k] = _mm_add_ps(summ[r * NT + k], prod);        /* lanes 1, 3: m_w s_x */
            acc[r * NT + k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p),
                                              _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(prod)),
                                              acc[r * NT + k]);
        }
    }
}

static LX_INLINE LX_AVX512 void tile_min_512(lx_type wt, const uint8_t *w, size_t wrb, const uint8_t *xq,
                                             size_t xs, int64_t n, float *out, const int R, const int NT) {
    const size_t qsb = act_qs_bytes(n);
    const int64_t nb = n / LX_QK;
    __m512 acc[4];
    __m256 t[4];
    __m128 summ[4], ts[4];
    for (int i = 0; i < R * NT; ++i) {
        acc[i] = _mm512_setzero_ps();
        t[i] = _mm256_setzero_ps();
        summ[i] = ts[i] = _mm_setzero_ps();
    }
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) min2_512(wt, w, wrb, xq, xs, qsb, b, acc, summ, R, NT);
    if (b < nb) min_block_vnni(wt, w, wrb, xq, xs, qsb, b, t, ts, R, NT);
    float m[4];
    for (int i = 0; i < R * NT; ++i) {
        t[i] = _mm256_add_ps(t[i], lx_fold16_avx512(acc[i]));
        const __m128 s = _mm_add_ps(summ[i], _mm_movehl_ps(summ[i], summ[i]));   /* lane 1: m0 + m1 */
        m[i] = _mm_cvtss_f32(_mm_movehdup_ps(s)) + _mm_cvtss_f32(_mm_movehdup_ps(ts[i]));
    }
    store_tile_vnni(t, m, out, R, NT);
}

/* q4_K / q5_K */
static LX_INLINE LX_AVX512 void tile_k45_512(lx_type wt, const uint8_t *w, size_t wrb, const uint8_t *xq,
                                             size_t xs, int64_t n, float *out, const int R, const int NT) {
    const size_t qsb = act_qs_bytes(n);
    const int64_t nb = n / LX_QK_K;
    const __m512i m4 = _mm512_set1_epi8(0x0F), one = _mm512_set1_epi8(1);
    __m512 acc[4];
    __m256 macc[4];
    for (int i = 0; i < R * NT; ++i) acc[i] = _mm512_setzero_ps(), macc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        for (int r = 0; r < R; ++r) {
            const uint8_t *wr = w + r * wrb;
            const uint8_t *qs, *scales, *qh = NULL;
            uint16_t dh, dmh;
            if (wt == LX_TYPE_Q4_K) {
                const lx_block_q4_K *x = (const lx_block_q4_K *) wr + b;
                qs = x->qs, scales = x->scales, dh = x->d, dmh = x->dmin;
            } else {
                const lx_block_q5_K *x = (const lx_block_q5_K *) wr + b;
                qs = x->qs, scales = x->scales, qh = x->qh, dh = x->d, dmh = x->dmin;
            }
            uint8_t scmn[16];
            k4_scales(scales, scmn);
            const __m512i sc = _mm512_castsi128_si512(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *) scmn)));
            const __m128i mn8 = _mm_loadl_epi64((const __m128i *) (scmn + 8));
            const __m256i mins = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mn8, mn8));
            const __m512i hb = qh ? _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *) qh)) : _mm512_setzero_si512();
            __m512i i0[LX_MM_NT], i1[LX_MM_NT];
            for (int k = 0; k < NT; ++k) i0[k] = i1[k] = _mm512_setzero_si512();
            for (int p = 0; p < 4; ++p) {
                /* [32 low nibbles | 32 high nibbles] of qs[32p..32p+32): values 64p .. 64p+63 */
                const __m512i bq = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *) (qs + 32 * p)));
                __m512i v = _mm512_and_si512(_mm512_srlv_epi16(bq, LX_W16(0, 4)), m4);
                if (qh)
                    v = _mm512_or_si512(v, _mm512_slli_epi16(
                            _mm512_and_si512(_mm512_srlv_epi16(hb, LX_W16(2 * p, 2 * p + 1)), one), 4));
                const __m512i scv = _mm512_permutexvar_epi16(LX_W16(2 * p, 2 * p + 1), sc);
                for (int k = 0; k < NT; ++k) {
                    const int8_t *y = (const int8_t *) (xq + k * xs) + b * LX_QK_K + 64 * p;
                    const __m512i pr = _mm512_maddubs_epi16(v, _mm512_loadu_si512((const void *) y));
                    if (p & 1) i1[k] = _mm512_dpwssd_epi32(i1[k], pr, scv);
                    else i0[k] = _mm512_dpwssd_epi32(i0[k], pr, scv);
                }
            }
            const float dw = _cvtsh_ss(dh), dmw = _cvtsh_ss(dmh);
            for (int k = 0; k < NT; ++k) {
                const float *dx = (const float *) (xq + k * xs + qsb);
                const int16_t *bs = (const int16_t *) (dx + nb) + 16 * b;
                const float dy = dx[b];
                const __m256i ms = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *) bs), mins);
                acc[r * NT + k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(i0[k], i1[k])),
                                                  _mm512_set1_ps(dw * dy), acc[r * NT + k]);
                macc[r * NT + k] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(ms), _mm256_set1_ps(dmw * dy), macc[r * NT + k]);
            }
        }
    }
    for (int i = 0; i < R * NT; ++i) macc[i] = _mm256_add_ps(macc[i], lx_fold16_avx512(acc[i]));
    store_tile_vnni(macc, NULL, out, R, NT);
}

/* q6_K */
static LX_INLINE LX_AVX512 void tile_q6_K_512(const uint8_t *w, size_t wrb, const uint8_t *xq, size_t xs,
                                              int64_t n, float *out, const int R, const int NT) {
    const size_t qsb = act_qs_bytes(n);
    const int64_t nb = n / LX_QK_K;
    const __m512i m4 = _mm512_set1_epi8(0x0F), m3 = _mm512_set1_epi8(3);
    /* word indices of the scales of the 4 groups of 16 in a 64-value vector */
    const __m512i g4[4] = {
        _mm512_set_epi16(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
        _mm512_set_epi16(7, 7, 7, 7, 7, 7, 7, 7, 6, 6, 6, 6, 6, 6, 6, 6, 5, 5, 5, 5, 5, 5, 5, 5, 4, 4, 4, 4, 4, 4, 4, 4),
        _mm512_set_epi16(11, 11, 11, 11, 11, 11, 11, 11, 10, 10, 10, 10, 10, 10, 10, 10,
                         9, 9, 9, 9, 9, 9, 9, 9, 8, 8, 8, 8, 8, 8, 8, 8),
        _mm512_set_epi16(15, 15, 15, 15, 15, 15, 15, 15, 14, 14, 14, 14, 14, 14, 14, 14,
                         13, 13, 13, 13, 13, 13, 13, 13, 12, 12, 12, 12, 12, 12, 12, 12),
    };
    __m512 acc[4];
    for (int i = 0; i < R * NT; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        for (int r = 0; r < R; ++r) {
            const lx_block_q6_K *x = (const lx_block_q6_K *) (w + r * wrb) + b;
            const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *) x->scales));
            const __m512i sc = _mm512_castsi256_si512(sc16);
            __m512i i0[LX_MM_NT], i1[LX_MM_NT];
            for (int k = 0; k < NT; ++k) {
                const float *dx = (const float *) (xq + k * xs + qsb);
                const int16_t *bs = (const int16_t *) (dx + nb) + 16 * b;
                /* the offset: -32 sum_g sc_g bsums_g */
                const __m256i off = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *) bs), sc16);
                i0[k] = _mm512_zextsi256_si512(_mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(off, 5)));
                i1[k] = _mm512_setzero_si512();
            }
            for (int h = 0; h < 2; ++h) {
                const __m512i l = _mm512_loadu_si512((const void *) (x->ql + 64 * h));          /* [l0 | l1] */
                const __m512i hq = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *) (x->qh + 32 * h)));
                /* values 128h + 0..63 and 128h + 64..127 */
                const __m512i qa = _mm512_or_si512(_mm512_and_si512(l, m4), _mm512_slli_epi16(
                    _mm512_and_si512(_mm512_srlv_epi16(hq, LX_W16(0, 2)), m3), 4));
                const __m512i qb = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), m4), _mm512_slli_epi16(
                    _mm512_and_si512(_mm512_srlv_epi16(hq, LX_W16(4, 6)), m3), 4));
                const __m512i sa = _mm512_permutexvar_epi16(g4[2 * h], sc);
                const __m512i sb = _mm512_permutexvar_epi16(g4[2 * h + 1], sc);
                for (int k = 0; k < NT; ++k) {
                    const int8_t *y = (const int8_t *) (xq + k * xs) + b * LX_QK_K + 128 * h;
                    i0[k] = _mm512_dpwssd_epi32(i0[k], _mm512_maddubs_epi16(qa, _mm512_loadu_si512((const void *) y)), sa);
                    i1[k] = _mm512_dpwssd_epi32(i1[k], _mm512_maddubs_epi16(qb, _mm512_loadu_si512((const void *) (y + 64))), sb);
                }
            }
            const float dw = _cvtsh_ss(x->d);
            for (int k = 0; k < NT; ++k) {
                const float *dx = (const float *) (xq + k * xs + qsb);
                acc[r * NT + k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(i0[k], i1[k])),
                                                  _mm512_set1_ps(dw * dx[b]), acc[r * NT + k]);
            }
        }
    }
    __m256 t[4];
    for (int i = 0; i < R * NT; ++i) t[i] = lx_fold16_avx512(acc[i]);
    store_tile_vnni(t, NULL, out, R, NT);
}

#define LX_MM_ENTRY512(name, call)                                                                 \
    static LX_AVX512 void name(const uint8_t *w, size_t wrb, int nr, const uint8_t *xq, size_t xs, \
                               int nt, int64_t n, float *out) {                                    \
        LX_MM_TILE_SWITCH(call)                                                                    \
    }
#define LX_Z_Q4_0(R, NT) tile_sym_512(LX_TYPE_Q4_0, w, wrb, xq, xs, n, out, R, NT)
#define LX_Z_Q5_0(R, NT) tile_sym_512(LX_TYPE_Q5_0, w, wrb, xq, xs, n, out, R, NT)
#define LX_Z_Q8_0(R, NT) tile_sym_512(LX_TYPE_Q8_0, w, wrb, xq, xs, n, out, R, NT)
#define LX_Z_Q4_1(R, NT) tile_min_512(LX_TYPE_Q4_1, w, wrb, xq, xs, n, out, R, NT)
#define LX_Z_Q5_1(R, NT) tile_min_512(LX_TYPE_Q5_1, w, wrb, xq, xs, n, out, R, NT)
#define LX_Z_Q4_K(R, NT) tile_k45_512(LX_TYPE_Q4_K, w, wrb, xq, xs, n, out, R, NT)
#define LX_Z_Q5_K(R, NT) tile_k45_512(LX_TYPE_Q5_K, w, wrb, xq, xs, n, out, R, NT)
#define LX_Z_Q6_K(R, NT) tile_q6_K_512(w, wrb, xq, xs, n, out, R, NT)
LX_MM_ENTRY512(q4_0_512, LX_Z_Q4_0)
LX_MM_ENTRY512(q5_0_512, LX_Z_Q5_0)
LX_MM_ENTRY512(q8_0_512, LX_Z_Q8_0)
LX_MM_ENTRY512(q4_1_512, LX_Z_Q4_1)
LX_MM_ENTRY512(q5_1_512, LX_Z_Q5_1)
LX_MM_ENTRY512(q4_K_512, LX_Z_Q4_K)
LX_MM_ENTRY512(q5_K_512, LX_Z_Q5_K)
LX_MM_ENTRY512(q6_K_512, LX_Z_Q6_K)
#endif /* LX_MM_X86 */

/* ---- run-time dispatch --------------------------------------------------------------- */

static q8_tile_fn pick_q8(lx_type wt, int level) {
#ifdef LX_MM_X86
    if (level >= LX_SIMD_VNNI512) {
        switch (wt) {
        case LX_TYPE_Q4_0: return q4_0_512;
        case LX_TYPE_Q5_0: return q5_0_512;
        case LX_TYPE_Q8_0: return q8_0_512;
        case LX_TYPE_Q4_1: return q4_1_512;
        case LX_TYPE_Q5_1: return q5_1_512;
        case LX_TYPE_Q4_K: return q4_K_512;
        case LX_TYPE_Q5_K: return q5_K_512;
        case LX_TYPE_Q6_K: return q6_K_512;
        default: break;
        }
    }
    if (level >= LX_SIMD_AVX2) {
        switch (wt) {
        case LX_TYPE_Q4_0: return q4_0_avx2;
        case LX_TYPE_Q5_0: return q5_0_avx2;
        case LX_TYPE_Q8_0: return q8_0_avx2;
        case LX_TYPE_Q4_1: return q4_1_avx2;
        case LX_TYPE_Q5_1: return q5_1_avx2;
        case LX_TYPE_Q4_K: return q4_K_avx2;
        case LX_TYPE_Q5_K: return q5_K_avx2;
        case LX_TYPE_Q6_K: return q6_K_avx2;
        default: break;
        }
    }
#endif
    (void) wt, (void) level;
    return NULL;
}

static f32_dots_fn pick_f32(int level) {
#ifdef LX_MM_X86
    if (level >= LX_SIMD_VNNI512) return f32_dots_vnni;
    if (level >= LX_SIMD_AVX2) return f32_dots_avx2;
#endif
    (void) level;
    return f32_dots_portable;
}

/* ---- driver ----------------------------------------------------------------------------- */

typedef struct {
    const uint8_t *w;
    lx_type wt;
    size_t wrb;          /* bytes per W row */
    const float *x;
    lx_type dt;          /* x's dot type */
    uint8_t *xq;         /* quantized x rows (integer path): planar, or ggml blocks if !q8 */
    size_t xrb;          /* bytes per quantized x row */
    float *y;
    int64_t n_tok, n_in, n_out;
    q8_tile_fn q8;       /* NULL: portable integer dots on ggml blocks */
    f32_dots_fn f32;
} mm_ctx;

/* Software prefetch of W (LX_MM_PREFETCH bytes ahead): the hardware prefetchers
 * alone left a single thread at ~1/2 of the memory bandwidth here, the dot
 * kernels keeping too few loads in flight to cover the latency. */

/* prefetch [p, p + bytes) into L1 */
static LX_INLINE void prefetch_range(const uint8_t *p, size_t bytes) {
#if defined(__GNUC__) || defined(__clang__)
    for (size_t i = 0; i < bytes; i += 64) __builtin_prefetch(p + i, 0, 3);
#else
    (void) p, (void) bytes;
#endif
}

/* before reading W row o: its bytes LX_MM_PREFETCH ahead, and at the start of a
 * slice of rows the first LX_MM_PREFETCH bytes as well */
static LX_INLINE void prefetch_ahead(const uint8_t *row, size_t bytes, int first) {
    if (first) prefetch_range(row, LX_MM_PREFETCH);
    prefetch_range(row + LX_MM_PREFETCH, bytes);
}

/* rows [o0, o1) on the integer path, in tiles of tile_rows(nt) rows x nt tokens */
static void rows_q8(const mm_ctx *c, int64_t o0, int64_t o1) {
    float r[4 * LX_MM_NT];
    for (int64_t t0 = 0; t0 < c->n_tok; t0 += LX_MM_NT) {
        const int nt = (int) (c->n_tok - t0 < LX_MM_NT ? c->n_tok - t0 : LX_MM_NT);
        const int rows = tile_rows(nt);
        const uint8_t *xq = c->xq + (size_t) t0 * c->xrb;
        for (int64_t o = o0; o < o1; o += rows) {
            const int nr = (int) (o1 - o < rows ? o1 - o : rows);
            const uint8_t *w = c->w + (size_t) o * c->wrb;
            if (t0 == 0) prefetch_ahead(w, (size_t) nr * c->wrb, o == o0);
            if (c->q8) c->q8(w, c->wrb, nr, xq, c->xrb, nt, c->n_in, r);
            else q8_tile_portable(c->wt, w, c->wrb, nr, xq, c->xrb, nt, c->n_in, r);
            for (int i = 0; i < nr; ++i)
                for (int k = 0; k < nt; ++k) c->y[(t0 + k) * c->n_out + o + i] = r[i * LX_MM_NT + k];
        }
    }
}

/* rows [o0, o1) on the float path: each tile of a W row dequantized once for all tokens */
static void rows_f32(const mm_ctx *c, int64_t o0, int64_t o1) {
    float tile[LX_MM_TILE] __attribute__((aligned(64)));
    float r[LX_MM_NT];
    for (int64_t o = o0; o < o1; ++o) {
        const uint8_t *row = c->w + (size_t) o * c->wrb;
        prefetch_ahead(row, c->wrb, o == o0);
        for (int64_t c0 = 0; c0 < c->n_in; c0 += LX_MM_TILE) {
            const int64_t len = c->n_in - c0 < LX_MM_TILE ? c->n_in - c0 : LX_MM_TILE;
            const float *wt;
            if (c->wt == LX_TYPE_F32) {
                wt = (const float *) row + c0;
            } else {
                lx_dequantize_row(c->wt, row + lx_row_bytes(c->wt, c0), tile, len);
                wt = tile;
            }
            for (int64_t t0 = 0; t0 < c->n_tok; t0 += LX_MM_NT) {
                const int nt = (int) (c->n_tok - t0 < LX_MM_NT ? c->n_tok - t0 : LX_MM_NT);
                c->f32(wt, c->x + t0 * c->n_in + c0, c->n_in, len, nt, r);
                for (int k = 0; k < nt; ++k) {
                    float *yo = &c->y[(t0 + k) * c->n_out + o];
                    *yo = c0 == 0 ? r[k] : *yo + r[k];
                }
            }
        }
    }
}

size_t lx_mm_work_size(lx_type w_type, int64_t n_tok, int64_t n_in, lx_mm_act act) {
    const lx_type dt = lx_mm_dot_type(w_type, act);
    if (dt == LX_TYPE_F32) return 0;
    const size_t planar = act_row_bytes(dt, n_in), blocks = lx_row_bytes(dt, n_in);
    return (size_t) n_tok * (planar > blocks ? planar : blocks);
}

void lx_mul_mat(const void *w, lx_type w_type, const float *x, float *y, int64_t n_tok,
                int64_t n_in, int64_t n_out, lx_mm_act act, void *work, int n_threads) {
    assert(lx_mm_supported(w_type) && n_threads >= 1);
    if (n_tok <= 0 || n_out <= 0) return;
    if (n_in == 0) {
        memset(y, 0, (size_t) (n_tok * n_out) * sizeof(float));
        return;
    }
    const int level = lx_simd_level();
    mm_ctx c = {
        .w = w, .wt = w_type, .wrb = lx_row_bytes(w_type, n_in), .x = x,
        .dt = lx_mm_dot_type(w_type, act), .xq = work, .y = y,
        .n_tok = n_tok, .n_in = n_in, .n_out = n_out, .f32 = pick_f32(level),
    };
    if (c.dt != LX_TYPE_F32) {
        c.q8 = pick_q8(w_type, level);
        c.xrb = c.q8 ? act_row_bytes(c.dt, n_in) : lx_row_bytes(c.dt, n_in);
    }
    const int64_t n_blk = (n_out + LX_MM_ROWS - 1) / LX_MM_ROWS;
    const int nth = n_threads < n_blk ? n_threads : (int) n_blk;
    (void) nth;
#ifdef _OPENMP
#pragma omp parallel num_threads(nth) if (nth > 1)
#endif
    {
        if (c.dt != LX_TYPE_F32) {
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
            for (int64_t t = 0; t < n_tok; ++t) {
                uint8_t *r = c.xq + (size_t) t * c.xrb;
                if (c.q8) quantize_planar(c.dt, x + t * n_in, r, n_in);
                else lx_quantize_row(c.dt, x + t * n_in, r, n_in);
            }
        }   /* the implied barrier: every x row is quantized before any dot */
#ifdef _OPENMP
#pragma omp for schedule(static)
#endif
        for (int64_t blk = 0; blk < n_blk; ++blk) {
            const int64_t o0 = blk * LX_MM_ROWS;
            const int64_t o1 = o0 + LX_MM_ROWS < n_out ? o0 + LX_MM_ROWS : n_out;
            if (c.dt != LX_TYPE_F32) rows_q8(&c, o0, o1);
            else rows_f32(&c, o0, o1);
        }
    }
}

/* ---- float weights, fixed-order sums (see matmul.h) ---------------------------------------- */

static float dot_f32_ordered(const float *x, const float *w, int64_t n) {
    float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    const int64_t n8 = n - n % 8;
    for (int64_t k = 0; k < n8; k += 8) {
        for (int j = 0; j < 8; ++j) acc[j] += x[k + j] * w[k + j];
    }
    float sum = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
    for (int64_t k = n8; k < n; ++k) sum += x[k] * w[k];
    return sum;
}

void lx_mul_mat_f32_ordered(const float *w, const float *x, float *y, int64_t n_tok, int64_t n_in, int64_t n_out,
                            int n_threads) {
    const int64_t n_blocks = (n_out + LX_MM_ROWS - 1) / LX_MM_ROWS;
    (void) n_threads;
#pragma omp parallel for num_threads(n_threads) schedule(static) if (n_tok * n_in * n_out >= 65536)
    for (int64_t b = 0; b < n_blocks; ++b) {
        const int64_t o1 = (b + 1) * LX_MM_ROWS < n_out ? (b + 1) * LX_MM_ROWS : n_out;
        for (int64_t t = 0; t < n_tok; ++t) {
            for (int64_t o = b * LX_MM_ROWS; o < o1; ++o) {
                y[t * n_out + o] = dot_f32_ordered(x + t * n_in, w + o * n_in, n_in);
            }
        }
    }
}

#else /* LX_MM_KERNEL_PASS ================================================================ *
 * The SIMD kernels, compiled once per pass with:
 *   SFX(f)             the pass's name for f (f_avx2, f_vnni)
 *   LX_TGT             its target attribute
 *   LX_DOT_US8(u, s)   8 int32 lanes, each the sum of 4 products u8 * s8
 *   LX_DPWSSD(a, p, q) a + pairwise int16 products p * q summed into int32 lanes
 *
 * A tile is R W rows x NT tokens (R * NT <= 4): one accumulator per (row, token), index
 * r * NT + k; the x blocks are shared by the R rows, the unpacked W blocks by the NT tokens.
 */

/* out[r * LX_MM_NT + k] = the sum of acc[r * NT + k] (+ extra[r * NT + k] if extra) */
static LX_INLINE LX_TGT void SFX(store_tile)(const __m256 *acc, const float *extra, float *out,
                                             const int R, const int NT) {
    const __m256 z = _mm256_setzero_ps();
    float s[4];
    _mm_storeu_ps(s, lx_hsum8x4_avx2(acc[0], R * NT > 1 ? acc[1] : z, R * NT > 2 ? acc[2] : z,
                                  R * NT > 3 ? acc[3] : z));
    for (int r = 0; r < R; ++r)
        for (int k = 0; k < NT; ++k) out[r * LX_MM_NT + k] = s[r * NT + k] + (extra ? extra[r * NT + k] : 0.0f);
}

/* -- q4_0, q5_0, q8_0 (signed q) against q8_0 rows: |w| . sign(y, w), scaled by d_w d_x -- */

static LX_INLINE LX_TGT void SFX(sym_block)(lx_type wt, const uint8_t *w, size_t wrb, const uint8_t *xq,
                                            size_t xs, size_t qsb, int64_t b, __m256 *acc,
                                            const int R, const int NT) {
    for (int r = 0; r < R; ++r) {
        const uint8_t *wr = w + r * wrb;
        __m256i qw;
        uint16_t dh;
        if (wt == LX_TYPE_Q4_0) {
            const lx_block_q4_0 *x = (const lx_block_q4_0 *) wr + b;
            qw = _mm256_sub_epi8(lx_nib32_avx2(x->qs), _mm256_set1_epi8(8));
            dh = x->d;
        } else if (wt == LX_TYPE_Q5_0) {
            const lx_block_q5_0 *x = (const lx_block_q5_0 *) wr + b;
            /* bit clear: nibble | 0xF0 = nibble - 16; bit set: nibble = (nibble + 16) - 16 */
            qw = _mm256_or_si256(lx_nib32_avx2(x->qs),
                                 _mm256_andnot_si256(lx_bits32_avx2(x->qh), _mm256_set1_epi8((char) 0xF0)));
            dh = x->d;
        } else {
            const lx_block_q8_0 *x = (const lx_block_q8_0 *) wr + b;
            qw = _mm256_loadu_si256((const __m256i *) x->qs);
            dh = x->d;
        }
        const __m256i aw = _mm256_sign_epi8(qw, qw);
        const __m256 dw = _mm256_set1_ps(_cvtsh_ss(dh));
        for (int k = 0; k < NT; ++k) {
            const uint8_t *y = xq + k * xs;
            const __m256i sy = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *) (y + 32 * b)), qw);
            const __m256 t = _mm256_mul_ps(_mm256_cvtepi32_ps(LX_DOT_US8(aw, sy)),
                                           _mm256_broadcast_ss((const float *) (y + qsb) + b));
            acc[r * NT + k] = _mm256_fmadd_ps(dw, t, acc[r * NT + k]);
        }
    }
}

static LX_INLINE LX_TGT void SFX(tile_sym)(lx_type wt, const uint8_t *w, size_t wrb, const uint8_t *xq,
                                           size_t xs, int64_t n, float *out, const int R, const int NT) {
    const size_t qsb = act_qs_bytes(n);
    __m256 acc[4];
    for (int i = 0; i < R * NT; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < n / LX_QK; ++b) SFX(sym_block)(wt, w, wrb, xq, xs, qsb, b, acc, R, NT);
    SFX(store_tile)(acc, NULL, out, R, NT);
}

/* -- q4_1, q5_1 (unsigned q, min m) against q8_1 rows: d_w d_x (q . y) + m_w s_x -- */

static LX_INLINE LX_TGT void SFX(min_block)(lx_type wt, const uint8_t *w, size_t wrb, const uint8_t *xq,
                                            size_t xs, size_t qsb, int64_t b, __m256 *acc, __m128 *summ,
                                            const int R, const int NT) {
    for (int r = 0; r < R; ++r) {
        const uint8_t *wr = w + r * wrb;
        __m256i qw;
        uint32_t dm_bits;                 /* the block's (d, m) halves */
        if (wt == LX_TYPE_Q4_1) {
            const lx_block_q4_1 *x = (const lx_block_q4_1 *) wr + b;
            qw = lx_nib32_avx2(x->qs);
            memcpy(&dm_bits, x, 4);
        } else {
            const lx_block_q5_1 *x = (const lx_block_q5_1 *) wr + b;
            qw = _mm256_or_si256(lx_nib32_avx2(x->qs), _mm256_and_si256(lx_bits32_avx2(x->qh), _mm256_set1_epi8(0x10)));
            memcpy(&dm_bits, x, 4);
        }
        const __m128 dm = _mm_cvtph_ps(_mm_cvtsi32_si128((int) dm_bits));   /* (d_w, m_w, 0, 0) */
        for (int k = 0; k < NT; ++k) {
            const uint8_t *y = xq + k * xs;
            const __m256i p = LX_DOT_US8(qw, _mm256_loadu_si256((const __m256i *) (y + 32 * b)));
            /* (d_w d_x, m_w s_x) */
            const __m128 prod = _mm_mul_ps(dm, _mm_castpd_ps(_mm_load_sd((const double *) (y + qsb) + b)));
            acc[r * NT + k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_broadcastss_ps(prod), acc[r * NT + k]);
            summ[r * NT + k] = _mm_add_ps(summ[r * NT + k], prod);   /* lane 1 sums m_w s_x */
        }
    }
}

static LX_INLINE LX_TGT void SFX(tile_min)(lx_type wt, const uint8_t *w, size_t wrb, const uint8_t *xq,
                                           size_t xs, int64_t n, float *out, const int R, const int NT) {
    const size_t qsb = act_qs_bytes(n);
    __m256 acc[4];
    __m128 summ[4];
    for (int i = 0; i < R * NT; ++i) acc[i] = _mm256_setzero_ps(), summ[i] = _mm_setzero_ps();
    for (int64_t b = 0; b < n / LX_QK; ++b) SFX(min_block)(wt, w, wrb, xq, xs, qsb, b, acc, summ, R, NT);
    float m[4];
    for (int i = 0; i < R * NT; ++i) m[i] = _mm_cvtss_f32(_mm_movehdup_ps(summ[i]));
    SFX(store_tile)(acc, m, out, R, NT);
}

/* -- q4_K, q5_K against q8_K rows: d_w d_x sum_j sc_j (q . y)_j - dmin_w d_x sum_j mn_j bsums_j -- */

static LX_INLINE LX_TGT void SFX(tile_k45)(lx_type wt, const uint8_t *w, size_t wrb, const uint8_t *xq,
                                           size_t xs, int64_t n, float *out, const int R, const int NT) {
    const size_t qsb = act_qs_bytes(n);
    const int64_t nb = n / LX_QK_K;
    const __m256i m4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    __m256 acc[4];
    for (int i = 0; i < R * NT; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        for (int r = 0; r < R; ++r) {
            const uint8_t *wr = w + r * wrb;
            const uint8_t *qs, *scales, *qh = NULL;
            uint16_t dh, dmh;
            if (wt == LX_TYPE_Q4_K) {
                const lx_block_q4_K *x = (const lx_block_q4_K *) wr + b;
                qs = x->qs, scales = x->scales, dh = x->d, dmh = x->dmin;
            } else {
                const lx_block_q5_K *x = (const lx_block_q5_K *) wr + b;
                qs = x->qs, scales = x->scales, qh = x->qh, dh = x->d, dmh = x->dmin;
            }
            uint8_t scmn[16];
            k4_scales(scales, scmn);
            /* (mn_0, mn_0, mn_1, mn_1, ...): one per pair of 16-groups */
            const __m128i mn8 = _mm_loadl_epi64((const __m128i *) (scmn + 8));
            const __m256i mins = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(mn8, mn8));
            const __m256i hb = qh ? _mm256_loadu_si256((const __m256i *) qh) : _mm256_setzero_si256();
            __m256i il[LX_MM_NT], ih[LX_MM_NT];
            for (int k = 0; k < NT; ++k) il[k] = ih[k] = _mm256_setzero_si256();
            for (int p = 0; p < 4; ++p) {
                const __m256i bq = _mm256_loadu_si256((const __m256i *) (qs + 32 * p));
                __m256i lo = _mm256_and_si256(bq, m4);
                __m256i hi = _mm256_and_si256(_mm256_srli_epi16(bq, 4), m4);
                if (qh) {
                    lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * p), one), 4));
                    hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2 * p + 1), one), 4));
                }
                const __m256i s_lo = _mm256_set1_epi16(scmn[2 * p]), s_hi = _mm256_set1_epi16(scmn[2 * p + 1]);
                for (int k = 0; k < NT; ++k) {
                    const int8_t *y = (const int8_t *) (xq + k * xs) + b * LX_QK_K + 64 * p;
                    il[k] = LX_DPWSSD(il[k], _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *) y)), s_lo);
                    ih[k] = LX_DPWSSD(ih[k], _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *) (y + 32))), s_hi);
                }
            }
            const __m256 dw = _mm256_set1_ps(_cvtsh_ss(dh)), dmw = _mm256_set1_ps(_cvtsh_ss(dmh));
            for (int k = 0; k < NT; ++k) {
                const float *dx = (const float *) (xq + k * xs + qsb);
                const int16_t *bs = (const int16_t *) (dx + nb) + 16 * b;
                const __m256 dy = _mm256_broadcast_ss(dx + b);
                const __m256i ms = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *) bs), mins);
                const __m256 q = _mm256_cvtepi32_ps(_mm256_add_epi32(il[k], ih[k]));
                __m256 a = _mm256_fmadd_ps(_mm256_mul_ps(dw, dy), q, acc[r * NT + k]);
                acc[r * NT + k] = _mm256_fnmadd_ps(_mm256_mul_ps(dmw, dy), _mm256_cvtepi32_ps(ms), a);
            }
        }
    }
    SFX(store_tile)(acc, NULL, out, R, NT);
}

/* -- q6_K against q8_K rows: d_w d_x (sum_g sc_g (q6 . y)_g - 32 sum_g sc_g bsums_g) -- */

static LX_INLINE LX_TGT void SFX(tile_q6_K)(const uint8_t *w, size_t wrb, const uint8_t *xq, size_t xs,
                                            int64_t n, float *out, const int R, const int NT) {
    /* byte shuffles giving {sc[2m] x 8, sc[2m+1] x 8} from the 16 scales */
    static const uint8_t shuf[8][16] = {
        {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1},
        {2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3},
        {4, 4, 4, 4, 4, 4, 4, 4, 5, 5, 5, 5, 5, 5, 5, 5},
        {6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7},
        {8, 8, 8, 8, 8, 8, 8, 8, 9, 9, 9, 9, 9, 9, 9, 9},
        {10, 10, 10, 10, 10, 10, 10, 10, 11, 11, 11, 11, 11, 11, 11, 11},
        {12, 12, 12, 12, 12, 12, 12, 12, 13, 13, 13, 13, 13, 13, 13, 13},
        {14, 14, 14, 14, 14, 14, 14, 14, 15, 15, 15, 15, 15, 15, 15, 15},
    };
    const size_t qsb = act_qs_bytes(n);
    const int64_t nb = n / LX_QK_K;
    __m256 acc[4];
    for (int i = 0; i < R * NT; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        for (int r = 0; r < R; ++r) {
            const lx_block_q6_K *x = (const lx_block_q6_K *) (w + r * wrb) + b;
            const __m128i sc8 = _mm_loadu_si128((const __m128i *) x->scales);
            __m256i i0[LX_MM_NT], i1[LX_MM_NT];
            for (int k = 0; k < NT; ++k) {
                const float *dx = (const float *) (xq + k * xs + qsb);
                const int16_t *bs = (const int16_t *) (dx + nb) + 16 * b;
                /* the offset: -32 sum_g sc_g bsums_g */
                const __m256i off = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *) bs), _mm256_cvtepi8_epi16(sc8));
                i0[k] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(off, 5));
                i1[k] = _mm256_setzero_si256();
            }
            for (int h = 0; h < 2; ++h) {
                __m256i q[4];
                lx_q6_K_half_avx2(x->ql + 64 * h, x->qh + 32 * h, q);
                for (int c = 0; c < 4; ++c) {
                    const __m256i scv = _mm256_cvtepi8_epi16(
                        _mm_shuffle_epi8(sc8, _mm_loadu_si128((const __m128i *) shuf[4 * h + c])));
                    for (int k = 0; k < NT; ++k) {
                        const int8_t *y = (const int8_t *) (xq + k * xs) + b * LX_QK_K + 128 * h + 32 * c;
                        const __m256i p = _mm256_maddubs_epi16(q[c], _mm256_loadu_si256((const __m256i *) y));
                        if (c & 1) i1[k] = LX_DPWSSD(i1[k], p, scv);
                        else i0[k] = LX_DPWSSD(i0[k], p, scv);
                    }
                }
            }
            const __m256 dw = _mm256_set1_ps(_cvtsh_ss(x->d));
            for (int k = 0; k < NT; ++k) {
                const float *dx = (const float *) (xq + k * xs + qsb);
                const __m256 q = _mm256_cvtepi32_ps(_mm256_add_epi32(i0[k], i1[k]));
                acc[r * NT + k] = _mm256_fmadd_ps(_mm256_mul_ps(dw, _mm256_broadcast_ss(dx + b)), q, acc[r * NT + k]);
            }
        }
    }
    SFX(store_tile)(acc, NULL, out, R, NT);
}

/* -- float path: tile . 4 x rows -- */

static LX_INLINE LX_TGT void SFX(f32_dots_impl)(const float *w, const float *x, int64_t xs, int64_t len,
                                                float *out, const int NT) {
    __m256 a0[LX_MM_NT], a1[LX_MM_NT];
    for (int k = 0; k < NT; ++k) a0[k] = _mm256_setzero_ps(), a1[k] = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= len; i += 16) {
        const __m256 w0 = _mm256_loadu_ps(w + i), w1 = _mm256_loadu_ps(w + i + 8);
        for (int k = 0; k < NT; ++k) {
            a0[k] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + k * xs + i), a0[k]);
            a1[k] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + k * xs + i + 8), a1[k]);
        }
    }
    for (; i + 8 <= len; i += 8) {
        const __m256 w0 = _mm256_loadu_ps(w + i);
        for (int k = 0; k < NT; ++k) a0[k] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + k * xs + i), a0[k]);
    }
    for (int k = 0; k < NT; ++k) {
        float s = lx_hsum8_avx2(_mm256_add_ps(a0[k], a1[k]));
        for (int64_t j = i; j < len; ++j) s += w[j] * x[k * xs + j];
        out[k] = s;
    }
}

/* -- entry points (the AVX2 pass; LX_SIMD_VNNI512 has its 512-bit ones): one instantiation per tile
 * shape, so that R and NT are constants -- */
#if LX_MM_KERNEL_PASS == 1

#define LX_MM_ENTRY(name, call)                                                                    \
    static LX_TGT void SFX(name)(const uint8_t *w, size_t wrb, int nr, const uint8_t *xq, size_t xs, \
                                 int nt, int64_t n, float *out) {                                  \
        LX_MM_TILE_SWITCH(call)                                                                    \
    }
#define LX_C_Q4_0(R, NT) SFX(tile_sym)(LX_TYPE_Q4_0, w, wrb, xq, xs, n, out, R, NT)
#define LX_C_Q5_0(R, NT) SFX(tile_sym)(LX_TYPE_Q5_0, w, wrb, xq, xs, n, out, R, NT)
#define LX_C_Q8_0(R, NT) SFX(tile_sym)(LX_TYPE_Q8_0, w, wrb, xq, xs, n, out, R, NT)
#define LX_C_Q4_1(R, NT) SFX(tile_min)(LX_TYPE_Q4_1, w, wrb, xq, xs, n, out, R, NT)
#define LX_C_Q5_1(R, NT) SFX(tile_min)(LX_TYPE_Q5_1, w, wrb, xq, xs, n, out, R, NT)
#define LX_C_Q4_K(R, NT) SFX(tile_k45)(LX_TYPE_Q4_K, w, wrb, xq, xs, n, out, R, NT)
#define LX_C_Q5_K(R, NT) SFX(tile_k45)(LX_TYPE_Q5_K, w, wrb, xq, xs, n, out, R, NT)
#define LX_C_Q6_K(R, NT) SFX(tile_q6_K)(w, wrb, xq, xs, n, out, R, NT)

LX_MM_ENTRY(q4_0, LX_C_Q4_0)
LX_MM_ENTRY(q5_0, LX_C_Q5_0)
LX_MM_ENTRY(q8_0, LX_C_Q8_0)
LX_MM_ENTRY(q4_1, LX_C_Q4_1)
LX_MM_ENTRY(q5_1, LX_C_Q5_1)
LX_MM_ENTRY(q4_K, LX_C_Q4_K)
LX_MM_ENTRY(q5_K, LX_C_Q5_K)
LX_MM_ENTRY(q6_K, LX_C_Q6_K)
#endif

#define LX_MM_NT_SWITCH(call)   \
    switch (nt) {               \
    case 1: call(1); break;     \
    case 2: call(2); break;     \
    case 3: call(3); break;     \
    default: call(4); break;    \
    }
#define LX_C_F32(NT) SFX(f32_dots_impl)(w, x, xs, len, out, NT)
static LX_TGT void SFX(f32_dots)(const float *w, const float *x, int64_t xs, int64_t len, int nt, float *out) {
    LX_MM_NT_SWITCH(LX_C_F32)
}

#undef LX_MM_NT_SWITCH
#undef LX_MM_ENTRY
#undef LX_C_Q4_0
#undef LX_C_Q5_0
#undef LX_C_Q8_0
#undef LX_C_Q4_1
#undef LX_C_Q5_1
#undef LX_C_Q4_K
#undef LX_C_Q5_K
#undef LX_C_Q6_K
#undef LX_C_F32

#endif /* LX_MM_KERNEL_PASS */

