/* attn_tile.h: the attention kernels of a tile of query tokens that share a chunk (attention.c).
 *
 * In a prefill at depth every query token reads the same cached cells: all its chunks but the
 * last hold the same visible cells with the same mask values for the tokens of a tile. attention.c
 * then converts the chunk's K and V once and runs the dots and the V accumulation of every query
 * head of the tile against them, instead of once per token (where each K row's f16 conversion and
 * horizontal sums served only one token's GQA group). The arithmetic of every head is exactly that
 * of the per-token AVX2 kernels (attention.c's dots_cells / vacc_tile), so a token's result has the
 * same bits whether it ran in a tile, alone, or in decode:
 *
 *   score(h, j) = ((p0 + p1) + (p2 + p3)) + ((p4 + p5) + (p6 + p7)),
 *                 p_l = fma chain over e = l, l + 8, ..., d - 8 + l of k_j[e] * q_h[e], from +0
 *                 (the 8 lanes of the per-token kernel, then lx_hsum8x4_avx2's tree)
 *   acc(h, e)   = fma chain over the chunk's cells j in order of P[h][j] * v_j[e], from +0
 *
 * Layouts: the chunk's K transposed, kt [d][ld] floats (column j = cell j's row, cells padded with
 * zeros to a multiple of 8 <= ld); its V as rows, vf [n][d_v] floats. d and d_v must be multiples
 * of 8. The _ref functions are the scalar twins (the same operations in C, fmaf for the FMA), the
 * tests' oracle; the AVX2 ones need lx_simd_level() >= LX_SIMD_AVX2.
 */
#ifndef LX_ATTN_TILE_H
#define LX_ATTN_TILE_H

#include <stdint.h>

/* kt [d][ld] <- the n rows (f16 bits when f16, else float) at base + off[j] elements, transposed,
 * columns n .. ld-1 zero; ld >= n rounded up to 8 */
void lx_attn_tile_kt(const void *base, int f16, const int64_t *off, int n, int64_t d, float *kt, int64_t ld);
void lx_attn_tile_kt_ref(const void *base, int f16, const int64_t *off, int n, int64_t d, float *kt, int64_t ld);

/* vf [n][dv] <- the n rows at base + off[j] elements as floats */
void lx_attn_tile_vf(const void *base, int f16, const int64_t *off, int n, int64_t dv, float *vf);

/* S[i][j] = score of query row q[i] (d floats) and column j of kt, j < n, for the nq rows, in the order of
 * the per-token kernels of `lanes` (8: AVX2, as above; 16: AVX-512's, 16 chains over e = l, l + 16, ...,
 * lane l + lane l + 8 folded (lx_fold16_avx512), then the tree of 8) */
void lx_attn_tile_dots(const float *kt, int64_t ld, int n, int64_t d, const float *const *q, float *const *S,
                       int nq, int lanes);
void lx_attn_tile_dots_ref(const float *kt, int64_t ld, int n, int64_t d, const float *const *q,
                           float *const *S, int nq, int lanes);

/* acc[i][e] = sum over j < n of P[i][j] * vf[j][e], e < dv (one fma chain per e, from +0), for the
 * nq rows */
void lx_attn_tile_vacc(const float *vf, int n, int64_t dv, const float *const *P, float *const *acc, int nq);
void lx_attn_tile_vacc_ref(const float *vf, int n, int64_t dv, const float *const *P, float *const *acc, int nq);

#endif
