# attn_tile.pxd: mirrors csrc/attn_tile.h (declarations only).
from libc.stdint cimport int64_t


cdef extern from "attn_tile.h" nogil:
    void lx_attn_tile_kt(const void *base, int f16, const int64_t *off, int n, int64_t d, float *kt, int64_t ld)
    void lx_attn_tile_kt_ref(const void *base, int f16, const int64_t *off, int n, int64_t d, float *kt, int64_t ld)
    void lx_attn_tile_vf(const void *base, int f16, const int64_t *off, int n, int64_t dv, float *vf)
    void lx_attn_tile_dots(const float *kt, int64_t ld, int n, int64_t d, const float *const *q, float *const *S,
                           int nq, int lanes)
    void lx_attn_tile_dots_ref(const float *kt, int64_t ld, int n, int64_t d, const float *const *q,
                               float *const *S, int nq, int lanes)
    void lx_attn_tile_vacc(const float *vf, int n, int64_t dv, const float *const *P, float *const *acc, int nq)
    void lx_attn_tile_vacc_ref(const float *vf, int n, int64_t dv, const float *const *P, float *const *acc,
                               int nq)
