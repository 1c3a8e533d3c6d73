/* delta_net.h: the gated delta rule of a Qwen3.5 / Qwen3-Next linear-attention layer (llama.cpp's
 * ggml_gated_delta_net: its CPU kernel's steps, the sums in an order of our own, below), reading and
 * writing the per-sequence states of a recurrent memory.
 *
 * The state of one sequence is a d x d matrix per value head, stored as llama.cpp stores it
 * (transposed: row j holds S[:, j], the key dimension i fastest):
 *
 *   state [n_cells][n_head][d][d]      state[c][h][j][i] = S_h[i][j]
 *
 * A ubatch is split equally as for csrc/ssm.h: n_seqs sequences of n_t tokens, token t of sequence s
 * at row s * n_t + t, cells[s] the cell holding sequence s's state. Per token and value head h (key head
 * h % n_head_k, ggml_repeat's broadcast), with g the log decay and beta the write strength:
 *
 *   S_h <- S_h * exp(g[h])
 *   delta[j] = (v[j] - sum_i S_h[i][j] k[i]) * beta[h]
 *   S_h[i][j] += k[i] * delta[j]
 *   out[j] = (sum_i S_h[i][j] q[i]) / sqrt(d)
 *
 * History (rollback): as csrc/ssm.h's kernels, the state after each of the last m = min(n_t, n_hist)
 * tokens of sequence s is copied into row (hist_row[s] + j) % n_hist of hist [n_cells][n_hist][n_head]
 * [d][d] (row hist_row[s] for token n_t - m; hist_row NULL: row 0), the other rows left as they were.
 * The rows are copies (no other arithmetic): restoring one gives, bit for bit, the state a ubatch
 * ending at that token would have left.
 *
 * Determinism: each (sequence, head) pair runs its tokens in order on one thread; the sums over i run
 * in 8 lanes (i mod 8, each product fused) reduced in one fixed tree, the d % 8 last terms after them
 * in order. The AVX2 path and its scalar twin give the same bits, so the results do not depend on the
 * thread count, the SIMD level or how a sequence is split into ubatches.
 */
#ifndef LX_DELTA_NET_H
#define LX_DELTA_NET_H

#include <stdint.h>

#include "common.h"

/* q, k: rows of stride ldqk, n_head_k heads of d each (row s * n_t + t); v: rows of stride ldv, n_head
 * heads of d; g, beta: [n_seqs * n_t][n_head]; out: [n_seqs * n_t][n_head][d]; state and hist as above;
 * undo [k][n_head][d][d] or NULL, undo_slot [n_seqs]: the states before the call, as ssm.h's Undo says.
 * note: cells distinct; n_head a multiple of n_head_k; n_hist >= 0; 0 <= hist_row[s] < n_hist;
 * -1 <= undo_slot[s] < k, the rows >= 0 distinct; n_threads >= 1. */
void lx_delta_net(float *state, const int32_t *cells, int64_t n_seqs, int64_t n_t, int64_t n_head,
                  int64_t n_head_k, int64_t d, const float *q, const float *k, int64_t ldqk, const float *v,
                  int64_t ldv, const float *g, const float *beta, float *out, float *hist, int64_t n_hist,
                  const int32_t *hist_row, float *undo, int32_t *undo_slot, int n_threads);

#endif /* LX_DELTA_NET_H */
