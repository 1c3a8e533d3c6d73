/* ssd.h: the selective scan of a Mamba-2 layer (llama.cpp's ggml_ssm_scan, its Mamba-2 branch: heads,
 * a scalar A and D per head, B and C shared by the heads of a group), reading and writing the
 * per-sequence states of a recurrent memory.
 *
 * A Mamba-2 layer's ssm state, one row per cell of the recurrent memory (llamax/memory/recurrent.py):
 *
 *   ssm state   [n_cells][n_head][head_dim][d_state]     (ggml's s_l {d_state, head_dim, n_head}, the same bytes)
 *
 * Its conv state is a Mamba-1 one over the d_inner + 2 * n_group * d_state channels of x, B and C
 * (ssm.h's lx_ssm_conv runs it). A ubatch is n_seqs sequences of n_t tokens each (llama.cpp's
 * split_equal): token j of sequence s at row s * n_t + j, its state in cell cells[s]; the scan reads
 * that state, runs the sequence's tokens through it in order and leaves the state after the last one.
 *
 * Heads and groups (repeat_interleave, as ggml): head h reads group g = h / (n_head / n_group) of B
 * and C:
 *
 *   B, C rows   [ group 0: d_state | group 1: d_state | ... ]      n_group * d_state values
 *   x, z, y rows [ head 0: head_dim | head 1: head_dim | ... ]     n_head * head_dim = d_inner values
 *
 * History (speculative decoding's rollback), exactly as ssm.h's kernels write it: a ring of n_hist
 * rows per cell laid out like the state,
 *
 *   ssm hist    [n_cells][n_hist][n_head][head_dim][d_state]
 *
 * m = min(n_t, n_hist) rows of cell cells[s] written from row r0 = hist_row[s] (0 when hist_row is
 * NULL) on, wrapping around: row (r0 + j) % n_hist = the state after token n_t - m + j. The rows are
 * copies of the state (no other arithmetic), so restoring one gives, bit for bit, the state a ubatch
 * ending at that token would have left. hist NULL (or n_hist 0): no history.
 *
 * Determinism: every (sequence, head) pair is computed by one thread, its tokens in order, with the
 * same float operations whatever the thread count and the SIMD level (the AVX2 step and its scalar
 * twin give the same bits), so the results are bit-identical for any n_threads and any split of a
 * sequence into ubatches.
 */
#ifndef LX_SSD_H
#define LX_SSD_H

#include <stdint.h>

#include "common.h"

/* The selective scan of one Mamba-2 layer with its skip and gate (ggml_ssm_scan, then y + x * D and
 * swiglu_split(z, y), as llama.cpp's build_mamba2_layer): for each sequence s, token t, head h of group
 * g, channel i < head_dim of the head (c = h * head_dim + i):
 *
 *   dt' = softplus(dt[t][h])                  (log1pf(expf(v)), v itself above 20, as ggml)
 *   dA  = expf(dt' * A[h])
 *   S[h][i][n] <- S[h][i][n] * dA + B[t][g][n] * (x[t][c] * dt')        n < d_state (one fused multiply-add)
 *   y[t][c] = (sum_n S[h][i][n] * C[t][g][n] + x[t][c] * D[h]) * silu(z[t][c])     (silu: vexp.h's lx_silu_mul)
 *
 * with S = state[cells[s]], left after the sequence's last token. x rows of stride ldx, dt rows of
 * stride lddt ([n_head] each), B and C rows of stride ldbc ([n_group * d_state] each), z rows of stride
 * ldz; A, D [n_head]; y [n_seqs * n_t][n_head * head_dim]. The sum over n runs in 8 lanes (n mod 8,
 * fused), added as lx_hsum8_avx2 adds them, then the last d_state % 8 terms in order. hist
 * [n_cells][n_hist][n_head][head_dim][d_state] or NULL: S after each of the last min(n_t, n_hist) tokens,
 * from row hist_row[s] (hist_row [n_seqs] or NULL: row 0; see above). undo [k][n_head][head_dim][d_state]
 * or NULL, undo_slot [n_seqs]: the states before the call, as ssm.h's Undo says (each head's copied
 * as its thread first reads it).
 * note: cells distinct; n_group >= 1 divides n_head; n_hist >= 0; 0 <= hist_row[s] < n_hist; -1 <= undo_slot[s]
 * < k, the rows >= 0 distinct; n_threads >= 1. */
void lx_ssd_scan(float *state, const int32_t *cells, int64_t n_seqs, int64_t n_t, int64_t n_head, int64_t head_dim,
                 int64_t d_state, int64_t n_group, const float *x, int64_t ldx, const float *dt, int64_t lddt,
                 const float *A, const float *B, const float *C, int64_t ldbc, const float *D, const float *z,
                 int64_t ldz, float *y, float *hist, int64_t n_hist, const int32_t *hist_row, float *undo,
                 int32_t *undo_slot, int n_threads);

#endif /* LX_SSD_H */
