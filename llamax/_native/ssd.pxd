# ssd.pxd: mirrors csrc/ssd.h (declarations only).
from libc.stdint cimport int32_t, int64_t


cdef extern from "ssd.h" nogil:
    # state [n_cells][n_head][head_dim][d_state]; x, z rows of stride ldx / ldz ([n_head * head_dim]);
    # dt rows of stride lddt ([n_head]); A, D [n_head]; B, C rows of stride ldbc ([n_group * d_state]);
    # y [n_seqs * n_t][n_head * head_dim]; hist [n_cells][n_hist][n_head][head_dim][d_state] or NULL, a ring
    # from row hist_row[s] ([n_seqs] or NULL: 0)
    void lx_ssd_scan(float *state, const int32_t *cells, int64_t n_seqs, int64_t n_t, int64_t n_head,
                     int64_t head_dim, int64_t d_state, int64_t n_group, const float *x, int64_t ldx,
                     const float *dt, int64_t lddt, const float *A, const float *B, const float *C, int64_t ldbc,
                     const float *D, const float *z, int64_t ldz, float *y, float *hist, int64_t n_hist,
                     const int32_t *hist_row, float *undo, int32_t *undo_slot, int n_threads)
