# hadamard.pxd: mirrors csrc/hadamard.h (declarations only).
from libc.stdint cimport int64_t


cdef extern from "hadamard.h" nogil:
    int LX_HADAMARD_MIN_ROT
    int LX_HADAMARD_MAX_BLOCK

    int lx_hadamard_block_k(int64_t head_dim)
    int lx_hadamard_block_v(int64_t head_dim)
    int lx_hadamard_block_ok(int64_t n)
    float lx_hadamard_scale(int n)
    # h [n][n]
    void lx_hadamard_matrix(int n, float *h)
    float LX_HADAMARD_MAX_ERR(int log2n)

    # x [n_rows][n_per_row], in place
    void lx_hadamard_rows(float *x, int64_t n_rows, int64_t n_per_row, int block, int n_threads)
    void lx_hadamard_rows_ref(float *x, int64_t n_rows, int64_t n_per_row, int block)
    # x [n], in place, on the caller's thread
    void lx_hadamard_row(float *x, int64_t n, int block)
