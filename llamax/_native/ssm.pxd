# ssm.pxd: mirrors csrc/ssm.h (declarations only).
from libc.stdint cimport int32_t, int64_t


cdef extern from "ssm.h" nogil:
    int LX_SSM_MAX_CONV

    # state [n_cells][d][d_conv - 1]; x rows of stride ldx; w [d][d_conv]; b [d] or NULL; out [n_seqs * n_t][d];
    # hist [n_cells][n_hist][d][d_conv - 1] or NULL, a ring from row hist_row[s] ([n_seqs] or NULL: 0)
    void lx_ssm_conv(float *state, const int32_t *cells, int64_t n_seqs, int64_t n_t, int64_t d, int d_conv,
                     const float *x, int64_t ldx, const float *w, const float *b, float *out, float *hist,
                     int64_t n_hist, const int32_t *hist_row, int n_threads)
    # state [n_cells][d][d_state]; x, dt, y [n_seqs * n_t][d]; B, C rows of stride ldbc; z rows of stride ldz;
    # hist [n_cells][n_hist][d][d_state] or NULL, likewise; undo [k][d][d_state] or NULL with undo_slot [n_seqs]
    # (ssm.h's Undo: -1 again where copied)
    void lx_ssm_scan(float *state, const int32_t *cells, int64_t n_seqs, int64_t n_t, int64_t d, int64_t d_state,
                     const float *x, const float *dt, const float *A, const float *B, const float *C, int64_t ldbc,
                     const float *D, const float *z, int64_t ldz, float *y, float *hist, int64_t n_hist,
                     const int32_t *hist_row, float *undo, int32_t *undo_slot, int n_threads)


# the undo arguments of a scan, checked (recurrent_checks.undo): undo's data or NULL, *slot undo_slot's or NULL
cdef float *undo_rows(object undo, object undo_slot, object state, Py_ssize_t n_seqs, int32_t **slot) except? NULL
