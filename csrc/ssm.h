/* ssm.h: the two recurrent steps of a Mamba layer (llama.cpp's ggml_ssm_conv and ggml_ssm_scan,
 * Mamba-1), reading and writing the per-sequence states of a recurrent memory.
 *
 * A recurrent memory keeps, per layer, one state row per cell (llamax/memory/recurrent.py):
 *
 *   conv state  [n_cells][d][d_conv - 1]   the last d_conv - 1 inputs of each channel
 *   ssm state   [n_cells][d][d_state]      the selective scan's hidden state
 *
 * (ggml's r_l / s_l rows, ne0 fastest: the same bytes.) A ubatch of a recurrent memory is split
 * equally (llama.cpp's split_equal): n_seqs sequences of n_t tokens each, token j of sequence s at
 * row s * n_t + j, and cells[s] is the cell holding sequence s's state. Both kernels read that
 * state, run the ubatch's tokens through it in order and leave the state after the last token in
 * the same cell.
 *
 * History (speculative decoding's rollback): both kernels can also copy the state after each of the
 * last tokens of every sequence into a history buffer, a ring of n_hist rows per cell laid out like
 * the state itself:
 *
 *   conv hist   [n_cells][n_hist][d][d_conv - 1]
 *   ssm hist    [n_cells][n_hist][d][d_state]
 *
 *   m = min(n_t, n_hist) rows of cell cells[s] are written, from row r0 = hist_row[s] on (0 when
 *   hist_row is NULL), wrapping around; the others are left as they were:
 *
 *     tokens of s:   0  1  ...  n_t-m     n_t-m+1  ...  n_t-1
 *                                 |          |            |
 *     hist rows:                 r0     (r0+1) % n_hist ... (r0+m-1) % n_hist
 *
 *   row (r0 + j) % n_hist = the state after token n_t - m + j
 *
 * so the last row written equals the state left in the cell, and a caller that starts each ubatch's
 * rows where the previous one's ended keeps the states of a sequence's last n_hist tokens across
 * ubatches. The rows are copies of the state at that token (no other arithmetic): restoring one gives,
 * bit for bit, the state a ubatch ending at that token would have left. hist NULL (or n_hist 0): no
 * history, the kernels as without it.
 *
 * Undo (a failed batch's way back, llamax/memory/recurrent.py): a scan (this one, ssd.h's and
 * delta_net.h's) can also copy each sequence's state, as it first reads it, into an undo buffer of k rows
 * laid out like the state (undo [k][...one state...]): undo_slot[s] >= 0 is sequence s's row there, -1
 * none. When the call returns, every undo_slot[s] it copied for is -1 again, so that a caller can tell
 * the rows written from those that were not (a call either runs whole or writes nothing). Made as the
 * state is first read, the copy costs one stream of writes (buffers.h's lx_stream_copy), not another
 * pass over the state. undo NULL: no copies, undo_slot not read.
 *
 * Determinism: every channel c is computed by one thread, in token order, with the same float
 * operations whatever the thread count, so the results are bit-identical for any n_threads and
 * any split of a sequence into ubatches.
 */
#ifndef LX_SSM_H
#define LX_SSM_H

#include <stdint.h>

#include "common.h"

#define LX_SSM_MAX_CONV 64   /* the widest convolution lx_ssm_conv takes (Mamba's is 4) */

/* The causal depthwise convolution of one Mamba layer, its bias and SiLU
 * (llm_build_mamba: ggml_ssm_conv, + ssm_conv1d.bias, ggml_silu):
 *
 *   w_c = state[cells[s]][c] ++ x[s*n_t + 0 .. n_t - 1][c]          (d_conv - 1 + n_t values)
 *   out[s*n_t + t][c] = silu(sum_{k < d_conv} w_c[t + k] * w[c][k] + b[c])
 *   state[cells[s]][c] <- the last d_conv - 1 values of w_c
 *
 * x [n_seqs * n_t] rows of stride ldx (the x half of the in-projection); w [d][d_conv]; b [d] or
 * NULL; out [n_seqs * n_t][d]. The sum runs k = 0, 1, ... in float, as ggml's; silu(v) = v / (1 + e^-v)
 * with vexp.h's exp (lx_silu_mul: AVX2 lanes or the scalar twin, the same bits). hist [n_cells][n_hist][d]
 * [d_conv - 1] or NULL: the window after each of the last min(n_t, n_hist) tokens, from row hist_row[s]
 * (hist_row [n_seqs] or NULL: row 0; see above).
 * note: cells distinct, each < the state's rows; 1 <= d_conv <= LX_SSM_MAX_CONV; n_hist >= 0;
 * 0 <= hist_row[s] < n_hist; n_threads >= 1. */
void lx_ssm_conv(float *state, const int32_t *cells, int64_t n_seqs, int64_t n_t, int64_t d, int d_conv,
                 const float *x, int64_t ldx, const float *w, const float *b, float *out, float *hist,
                 int64_t n_hist, const int32_t *hist_row, int n_threads);

/* The selective scan of one Mamba-1 layer with its skip and gate (ggml_ssm_scan, then
 * y + x * D and silu(z) * y, as llm_build_mamba): for each sequence s, token t, channel c:
 *
 *   dt' = softplus(dt[t][c])                  (log1pf(expf(v)), v itself above 20, as ggml)
 *   h[c][n] <- h[c][n] * exp(dt' * A[c][n]) + B[t][n] * (x[t][c] * dt')       n < d_state
 *   y[t][c] = (sum_n h[c][n] * C[t][n] + x[t][c] * D[c]) * silu(z[t][c])     (silu: vexp.h's lx_silu_ref)
 *
 * with h = state[cells[s]], left after the sequence's last token. x, dt, y [n_seqs * n_t][d]
 * (x and dt contiguous rows); B and C rows of stride ldbc; z rows of stride ldz; A [d][d_state];
 * D [d]. exp is vexp.h's (within 2 ulp of expf); the update is one fused multiply-add; the sum over
 * n runs in 8 lanes (n mod 8, fused), added as lx_hsum8_avx2 adds them, then the last d_state % 8
 * terms in order: AVX2 and its scalar twin give the same bits. hist [n_cells][n_hist][d][d_state] or
 * NULL: h after each of the last min(n_t, n_hist) tokens, from row hist_row[s] (hist_row [n_seqs] or
 * NULL: row 0; see above). undo [k][d][d_state] or NULL, undo_slot [n_seqs]: the states before the call
 * (see above).
 * note: cells distinct; n_hist >= 0; 0 <= hist_row[s] < n_hist; -1 <= undo_slot[s] < k, the rows >= 0
 * distinct; n_threads >= 1. */
void lx_ssm_scan(float *state, const int32_t *cells, int64_t n_seqs, int64_t n_t, int64_t d, int64_t d_state,
                 const float *x, const float *dt, const float *A, const float *B, const float *C, int64_t ldbc,
                 const float *D, const float *z, int64_t ldz, float *y, float *hist, int64_t n_hist,
                 const int32_t *hist_row, float *undo, int32_t *undo_slot, int n_threads);

/* the end of a scan that copied undo rows: every undo_slot[s] >= 0 set to -1 (ssm.h's Undo) */
void lx_undo_done(int32_t *undo_slot, int64_t n_seqs);

#endif /* LX_SSM_H */
