# delta_net.pxd: mirrors csrc/delta_net.h (declarations only).
from libc.stdint cimport int32_t, int64_t


cdef extern from "delta_net.h" nogil:
    # state [n_cells][n_head][d][d]; q, k rows of stride ldqk (n_head_k heads of d); v rows of stride ldv;
    # g, beta [n_seqs * n_t][n_head]; out [n_seqs * n_t][n_head][d];
    # hist [n_cells][n_hist][n_head][d][d] or NULL, a ring from row hist_row[s] ([n_seqs] or NULL: 0)
    void lx_delta_net(float *state, const int32_t *cells, int64_t n_seqs, int64_t n_t, int64_t n_head,
                      int64_t n_head_k, int64_t d, const float *q, const float *k, int64_t ldqk, const float *v,
                      int64_t ldv, const float *g, const float *beta, float *out, float *hist, int64_t n_hist,
                      const int32_t *hist_row, float *undo, int32_t *undo_slot, int n_threads)
