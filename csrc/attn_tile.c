/* attn_tile.c: the kernels of attn_tile.h, each under its scalar twin.
 *
 * dots: the cells are in the lanes (kt's columns), so a head's partial sums p_l (8 or 16: the lanes
 * argument) are vectors over W cells, each an fma chain over its e = l + lanes i; register tile:
 * TILE_ROWS query rows (6 for ymm, 8 for zmm) x 2 W cells, one broadcast of q per row and step, one
 * load of kt per W cells and step. The fold and the tree then add whole vectors: no horizontal sums.
 * vacc: VACC_ROWS rows (3 for ymm, 6 for zmm) x 4 W output lanes over 64 cells at a time, the lanes
 * outside the rows, so that block of V (64 cells x 4 W floats, 16 KB for zmm) stays in L1 for every
 * row (with the rows outside, a head of 256 values read its 64 KB block from L2 for each group of
 * rows: 45 against 80 GMAC/s on one Sapphire Rapids core, 128 rows); the chains carried through acc
 * from one block of cells to the next (a store and a load change no value). Both are written once
 * over W-lane vectors (the pass at the end of this file) and compiled
 * for ymm (AVX2, W 8) and zmm (AVX-512, W 16: cells and lanes in blocks of 16, so kt's ld and dv
 * must be multiples of 16, else the ymm pass runs); a cell's or lane's arithmetic is the same in both.
 */
#ifndef LX_TILE_PASS

#include "attn_tile.h"

#include <math.h>
#include <string.h>

#include "cpu.h"
#include "quants.h"
#include "simd.h"

/* the cache lines of a row of row_bytes at element offset off (elements of es bytes) into L1 */
static inline void prefetch_row(const void *base, int64_t off, size_t es, size_t row_bytes) {
    const char *r = (const char *) base + (size_t) off * es;
    for (size_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(r + b);
}

static float elt(const void *base, int f16, int64_t i) {
    return f16 ? lx_fp16_to_fp32(((const uint16_t *) base)[i]) : ((const float *) base)[i];
}

/* ---- K transposed ------------------------------------------------------------------------- */

void lx_attn_tile_kt_ref(const void *base, int f16, const int64_t *off, int n, int64_t d, float *kt, int64_t ld) {
    for (int64_t e = 0; e < d; ++e)
        for (int64_t j = 0; j < ld; ++j) kt[e * ld + j] = j < n ? elt(base, f16, off[j] + e) : 0.0f;
}

#ifdef LX_SIMD_AVX2_FN
LX_SIMD_AVX2_FN __m256 row8(const void *base, int f16, int64_t at) {
    return f16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *) ((const uint16_t *) base + at)))
               : _mm256_loadu_ps((const float *) base + at);
}

__attribute__((target("avx2,fma,f16c"))) static void kt_avx2(const void *base, int f16, const int64_t *off, int n,
                                                             int64_t d, float *kt, int64_t ld) {
    const size_t es = f16 ? 2 : 4, row_bytes = (size_t) d * es;
    for (int64_t j0 = 0; j0 < ld; j0 += 8) {
        for (int64_t x = j0 + 16; x < j0 + 24 && x < n; ++x) prefetch_row(base, off[x], es, row_bytes);   /* 2 blocks ahead */
        for (int64_t e0 = 0; e0 < d; e0 += 8) {
            __m256 r[8];
            for (int x = 0; x < 8; ++x)
                r[x] = j0 + x < n ? row8(base, f16, off[j0 + x] + e0) : _mm256_setzero_ps();
            const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
            const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
            const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
            const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
            const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
            const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
            const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
            const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
            float *o = kt + e0 * ld + j0;
            _mm256_storeu_ps(o + 0 * ld, _mm256_permute2f128_ps(u0, u4, 0x20));
            _mm256_storeu_ps(o + 1 * ld, _mm256_permute2f128_ps(u1, u5, 0x20));
            _mm256_storeu_ps(o + 2 * ld, _mm256_permute2f128_ps(u2, u6, 0x20));
            _mm256_storeu_ps(o + 3 * ld, _mm256_permute2f128_ps(u3, u7, 0x20));
            _mm256_storeu_ps(o + 4 * ld, _mm256_permute2f128_ps(u0, u4, 0x31));
            _mm256_storeu_ps(o + 5 * ld, _mm256_permute2f128_ps(u1, u5, 0x31));
            _mm256_storeu_ps(o + 6 * ld, _mm256_permute2f128_ps(u2, u6, 0x31));
            _mm256_storeu_ps(o + 7 * ld, _mm256_permute2f128_ps(u3, u7, 0x31));
        }
    }
}
#endif

void lx_attn_tile_kt(const void *base, int f16, const int64_t *off, int n, int64_t d, float *kt, int64_t ld) {
#ifdef LX_SIMD_AVX2_FN
    if (lx_simd_level() >= LX_SIMD_AVX2) {
        kt_avx2(base, f16, off, n, d, kt, ld);
        return;
    }
#endif
    lx_attn_tile_kt_ref(base, f16, off, n, d, kt, ld);
}

/* ---- V rows ------------------------------------------------------------------------------- */

void lx_attn_tile_vf(const void *base, int f16, const int64_t *off, int n, int64_t dv, float *vf) {
    const size_t es = f16 ? 2 : 4, row_bytes = (size_t) dv * es;
    for (int j = 0; j < n; ++j) {
        if (j + 8 < n) prefetch_row(base, off[j + 8], es, row_bytes);   /* the row eight ahead */
        if (f16) lx_fp16_to_fp32_row((const uint16_t *) base + off[j], vf + (int64_t) j * dv, dv);
        else memcpy(vf + (int64_t) j * dv, (const float *) base + off[j], (size_t) dv * sizeof(float));
    }
}

/* ---- scores ------------------------------------------------------------------------------- */

void lx_attn_tile_dots_ref(const float *kt, int64_t ld, int n, int64_t d, const float *const *q, float *const *S,
                           int nq, int lanes) {
    for (int i = 0; i < nq; ++i)
        for (int j = 0; j < n; ++j) {
            float p[16] = {0};
            for (int l = 0; l < lanes; ++l) {
                float a = 0.0f;
                for (int64_t e = l; e < d; e += lanes) a = fmaf(kt[e * ld + j], q[i][e], a);
                p[l] = a;
            }
            if (lanes == 16)
                for (int l = 0; l < 8; ++l) p[l] = p[l] + p[l + 8];
            S[i][j] = ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
        }
}

/* ---- V accumulation ----------------------------------------------------------------------- */

void lx_attn_tile_vacc_ref(const float *vf, int n, int64_t dv, const float *const *P, float *const *acc, int nq) {
    for (int i = 0; i < nq; ++i)
        for (int64_t e = 0; e < dv; ++e) {
            float a = 0.0f;
            for (int j = 0; j < n; ++j) a = fmaf(P[i][j], vf[(int64_t) j * dv + e], a);
            acc[i][e] = a;
        }
}

#define TILE_MAX_ROWS 8  /* the most query rows of a score tile (a pass's TILE_ROWS; dots' switch has its cases) */
#define VACC_MAX_ROWS 6  /* the most query rows per pass of the V sums (a pass's VACC_ROWS; vacc's switch has its cases) */
#define VACC_CELLS 64    /* cells per pass: their 4 W lanes of vf stay in L1 for every row of P */

#ifdef LX_SIMD_AVX2_FN
#define LX_TILE_PASS 1
#define SFX(f) f##_avx2
#define TGT __attribute__((target("avx2,fma,f16c")))
#define W 8
#define VACC_ROWS 3      /* query rows per pass of the V sums (16 ymm registers) */
#define TILE_ROWS 6      /* query rows of a score tile */
#define VF __m256
#define VZERO() _mm256_setzero_ps()
#define VSET1(p) _mm256_broadcast_ss(p)
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSTORE(p, v) _mm256_storeu_ps(p, v)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VADD(a, b) _mm256_add_ps(a, b)
#include "attn_tile.c"
#endif

#ifdef LX_SIMD_AVX512_FN
#define LX_TILE_PASS 2
#define SFX(f) f##_avx512
#define TGT __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")))
#define W 16
#define VACC_ROWS 6      /* query rows per pass of the V sums (32 zmm registers) */
#define TILE_ROWS 8      /* query rows of a score tile */
#define VF __m512
#define VZERO() _mm512_setzero_ps()
#define VSET1(p) _mm512_set1_ps(*(p))
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSTORE(p, v) _mm512_storeu_ps(p, v)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VADD(a, b) _mm512_add_ps(a, b)
#include "attn_tile.c"
#endif

/* ---- dispatch ---------------------------------------------------------------------------- */

void lx_attn_tile_dots(const float *kt, int64_t ld, int n, int64_t d, const float *const *q, float *const *S,
                       int nq, int lanes) {
#ifdef LX_SIMD_AVX512_FN
    if (lx_simd_level() >= LX_SIMD_AVX512 && ld % 16 == 0) {
        dots_avx512(kt, ld, n, d, q, S, nq, lanes);
        return;
    }
#endif
#ifdef LX_SIMD_AVX2_FN
    if (lx_simd_level() >= LX_SIMD_AVX2) {
        dots_avx2(kt, ld, n, d, q, S, nq, lanes);
        return;
    }
#endif
    lx_attn_tile_dots_ref(kt, ld, n, d, q, S, nq, lanes);
}

void lx_attn_tile_vacc(const float *vf, int n, int64_t dv, const float *const *P, float *const *acc, int nq) {
#ifdef LX_SIMD_AVX512_FN
    if (lx_simd_level() >= LX_SIMD_AVX512 && dv % 16 == 0) {
        vacc_avx512(vf, n, dv, P, acc, nq);
        return;
    }
#endif
#ifdef LX_SIMD_AVX2_FN
    if (lx_simd_level() >= LX_SIMD_AVX2) {
        vacc_avx2(vf, n, dv, P, acc, nq);
        return;
    }
#endif
    lx_attn_tile_vacc_ref(vf, n, dv, P, acc, nq);
}

#else /* LX_TILE_PASS ===================================================================== *
 *
 * The W-lane kernels (SFX names the pass's), included once per vector width above. */

_Static_assert(TILE_ROWS <= TILE_MAX_ROWS && VACC_ROWS <= VACC_MAX_ROWS,
               "a pass's rows fit the kernels' arrays and the switches' cases");

/* rows q[0..H) x cells [j0, j0 + W C), NL chains a score (8 or 16: lx_attn_tile_dots' lanes) */
static inline __attribute__((always_inline)) TGT void SFX(dots_block)(const float *kt, int64_t ld, int64_t d,
                                                                     int64_t j0, const float *const *q,
                                                                     float *const *S, const int H, const int C,
                                                                     const int NL) {
    VF part[16][TILE_MAX_ROWS][2];
    for (int l = 0; l < NL; ++l) {
        VF acc[TILE_MAX_ROWS][2];
        for (int h = 0; h < H; ++h)
            for (int c = 0; c < C; ++c) acc[h][c] = VZERO();
        for (int64_t e = l; e < d; e += NL) {
            const float *kr = kt + e * ld + j0;
            const VF k0 = VLOAD(kr), k1 = C > 1 ? VLOAD(kr + W) : k0;
            for (int h = 0; h < H; ++h) {
                const VF b = VSET1(q[h] + e);
                acc[h][0] = VFMA(k0, b, acc[h][0]);
                if (C > 1) acc[h][1] = VFMA(k1, b, acc[h][1]);
            }
        }
        for (int h = 0; h < H; ++h)
            for (int c = 0; c < C; ++c) part[l][h][c] = acc[h][c];
    }
    for (int h = 0; h < H; ++h)
        for (int c = 0; c < C; ++c) {
            if (NL == 16)   /* lx_fold16_avx512: lane l + lane l + 8 */
                for (int l = 0; l < 8; ++l) part[l][h][c] = VADD(part[l][h][c], part[l + 8][h][c]);
            const VF a = VADD(VADD(part[0][h][c], part[1][h][c]), VADD(part[2][h][c], part[3][h][c]));
            const VF b = VADD(VADD(part[4][h][c], part[5][h][c]), VADD(part[6][h][c], part[7][h][c]));
            VSTORE(S[h] + j0 + W * c, VADD(a, b));
        }
}

#define DOTS_H(H)                                                                              \
    case H:                                                                                    \
        if (H > TILE_ROWS) break;                                                              \
        if (C == 2 && NL == 16) SFX(dots_block)(kt, ld, d, j0, q + i, S + i, H, 2, 16);        \
        else if (C == 2) SFX(dots_block)(kt, ld, d, j0, q + i, S + i, H, 2, 8);                \
        else if (NL == 16) SFX(dots_block)(kt, ld, d, j0, q + i, S + i, H, 1, 16);             \
        else SFX(dots_block)(kt, ld, d, j0, q + i, S + i, H, 1, 8);                            \
        break;

/* cells in blocks of 2 W (W at the end): stores reach n rounded up to W (kt's ld and S's rows hold them) */
static TGT void SFX(dots)(const float *kt, int64_t ld, int n, int64_t d, const float *const *q, float *const *S,
                          int nq, int NL) {
    for (int64_t j0 = 0; j0 < n; j0 += 2 * W) {
        const int C = n - j0 > W ? 2 : 1;
        for (int i = 0; i < nq; i += TILE_ROWS) {
            switch (nq - i < TILE_ROWS ? nq - i : TILE_ROWS) {
                DOTS_H(1) DOTS_H(2) DOTS_H(3) DOTS_H(4) DOTS_H(5) DOTS_H(6) DOTS_H(7) default: DOTS_H(8)
            }
        }
    }
}
#undef DOTS_H

/* rows [0, H) of P / acc, lanes [e0, e0 + W NV), cells [j0, j1): the chains go on from acc (from +0 at
 * j0 == 0) */
static inline __attribute__((always_inline)) TGT void SFX(vacc_block)(const float *vf, int64_t dv,
                                                                     const float *const *P, float *const *acc,
                                                                     int j0, int j1, int64_t e0, const int H,
                                                                     const int NV) {
    VF a[VACC_MAX_ROWS][4];
    for (int h = 0; h < H; ++h)
        for (int r = 0; r < NV; ++r) a[h][r] = j0 == 0 ? VZERO() : VLOAD(acc[h] + e0 + W * r);
    for (int j = j0; j < j1; ++j) {
        VF p[VACC_MAX_ROWS];
        for (int h = 0; h < H; ++h) p[h] = VSET1(P[h] + j);
        const float *row = vf + (int64_t) j * dv + e0;
        for (int r = 0; r < NV; ++r) {
            const VF v = VLOAD(row + W * r);
            for (int h = 0; h < H; ++h) a[h][r] = VFMA(p[h], v, a[h][r]);
        }
    }
    for (int h = 0; h < H; ++h)
        for (int r = 0; r < NV; ++r) VSTORE(acc[h] + e0 + W * r, a[h][r]);
}

#define VACC_NV(H, NV) case NV: SFX(vacc_block)(vf, dv, P + i, acc + i, j0, j1, e0, H, NV); break;
#define VACC_H(H)                                                                           \
    case H:                                                                                 \
        if (H > VACC_ROWS) break;                                                           \
        switch (nv) { VACC_NV(H, 1) VACC_NV(H, 2) VACC_NV(H, 3) default: VACC_NV(H, 4) }    \
        break;

/* dv a multiple of W */
static TGT void SFX(vacc)(const float *vf, int n, int64_t dv, const float *const *P, float *const *acc, int nq) {
    for (int j0 = 0; j0 < n; j0 += VACC_CELLS) {
        const int j1 = n - j0 < VACC_CELLS ? n : j0 + VACC_CELLS;
        for (int64_t e0 = 0; e0 < dv; e0 += 4 * W) {   /* vf's block of cells x 4 W lanes: in L1 for every row */
            const int nv = (dv - e0) / W < 4 ? (int) ((dv - e0) / W) : 4;
            for (int i = 0; i < nq; i += VACC_ROWS)
                switch (nq - i < VACC_ROWS ? nq - i : VACC_ROWS) {
                    VACC_H(1) VACC_H(2) VACC_H(3) VACC_H(4) VACC_H(5) default: VACC_H(6)
                }
        }
    }
}
#undef VACC_H
#undef VACC_NV

#undef LX_TILE_PASS
#undef VACC_ROWS
#undef TILE_ROWS
#undef SFX
#undef TGT
#undef W
#undef VF
#undef VZERO
#undef VSET1
#undef VLOAD
#undef VSTORE
#undef VFMA
#undef VADD

#endif /* LX_TILE_PASS */
