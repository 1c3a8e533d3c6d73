# quants.pxd: mirrors csrc/quants.h (declarations only).
from libc.stdint cimport int64_t, uint16_t


cdef extern from "quants.h" nogil:
    ctypedef enum lx_type:
        LX_TYPE_F32
        LX_TYPE_F16

    float lx_fp16_to_fp32(uint16_t h)
    uint16_t lx_fp32_to_fp16(float f)

    void lx_fp32_to_fp16_row(const float *x, uint16_t *y, int64_t n)
    void lx_fp32_to_fp16_row_ref(const float *x, uint16_t *y, int64_t n)
    void lx_fp16_to_fp32_row(const uint16_t *x, float *y, int64_t n)
    void lx_fp16_to_fp32_row_ref(const uint16_t *x, float *y, int64_t n)

    int lx_quants_have_f16c()
