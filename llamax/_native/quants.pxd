# quants.pxd: mirrors csrc/quants.h (declarations only).
from libc.stdint cimport int8_t, int16_t, int32_t, int64_t, uint8_t, uint16_t, uint32_t

from llamax._native.kv_cells cimport lx_status


cdef extern from "quants.h" nogil:
    ctypedef enum lx_type:
        LX_TYPE_F32
        LX_TYPE_F16
        LX_TYPE_Q4_0
        LX_TYPE_Q4_1
        LX_TYPE_Q5_0
        LX_TYPE_Q5_1
        LX_TYPE_Q8_0
        LX_TYPE_Q8_1
        LX_TYPE_Q2_K
        LX_TYPE_Q3_K
        LX_TYPE_Q4_K
        LX_TYPE_Q5_K
        LX_TYPE_Q6_K
        LX_TYPE_Q8_K
        LX_TYPE_BF16

    float lx_fp16_to_fp32(uint16_t h)
    uint16_t lx_fp32_to_fp16(float f)

    void lx_fp32_to_fp16_row(const float *x, uint16_t *y, int64_t n)
    void lx_fp32_to_fp16_row_ref(const float *x, uint16_t *y, int64_t n)
    void lx_fp16_to_fp32_row(const uint16_t *x, float *y, int64_t n)
    void lx_fp16_to_fp32_row_ref(const uint16_t *x, float *y, int64_t n)


    # ---- ggml blocks
    int LX_QK
    int LX_QK_K

    ctypedef struct lx_block_q4_0:
        uint16_t d
        uint8_t qs[16]
    ctypedef struct lx_block_q4_1:
        uint16_t d
        uint16_t m
        uint8_t qs[16]
    ctypedef struct lx_block_q5_0:
        uint16_t d
        uint8_t qh[4]
        uint8_t qs[16]
    ctypedef struct lx_block_q5_1:
        uint16_t d
        uint16_t m
        uint8_t qh[4]
        uint8_t qs[16]
    ctypedef struct lx_block_q8_0:
        uint16_t d
        int8_t qs[32]
    ctypedef struct lx_block_q8_1:
        uint16_t d
        uint16_t s
        int8_t qs[32]
    ctypedef struct lx_block_q2_K:
        uint8_t scales[16]
        uint8_t qs[64]
        uint16_t d
        uint16_t dmin
    ctypedef struct lx_block_q3_K:
        uint8_t hmask[32]
        uint8_t qs[64]
        uint8_t scales[12]
        uint16_t d
    ctypedef struct lx_block_q4_K:
        uint16_t d
        uint16_t dmin
        uint8_t scales[12]
        uint8_t qs[128]
    ctypedef struct lx_block_q5_K:
        uint16_t d
        uint16_t dmin
        uint8_t scales[12]
        uint8_t qh[32]
        uint8_t qs[128]
    ctypedef struct lx_block_q6_K:
        uint8_t ql[128]
        uint8_t qh[64]
        int8_t scales[16]
        uint16_t d
    ctypedef struct lx_block_q8_K:
        float d
        int8_t qs[256]
        int16_t bsums[16]

    int64_t lx_type_block_size(lx_type t)
    size_t lx_type_block_bytes(lx_type t)
    size_t lx_row_bytes(lx_type t, int64_t n)
    int lx_type_can_dequantize(lx_type t)
    void lx_k_scale_min(int j, const uint8_t *scales, uint8_t *sc, uint8_t *mn)

    # x: lx_row_bytes(t, n) bytes, y: [n]
    void lx_dequantize_row(lx_type t, const void *x, float *y, int64_t n)
    void lx_dequantize_row_ref(lx_type t, const void *x, float *y, int64_t n)
    # x: [n_rows] rows of lx_row_bytes(t, n_cols) bytes, y: [n_rows][n_cols]
    void lx_dequantize_rows(lx_type t, const void *x, float *y, int64_t n_rows, int64_t n_cols,
                            int n_threads)

    void lx_dequantize_row_q4_0_ref(const lx_block_q4_0 *x, float *y, int64_t n)
    void lx_dequantize_row_q4_1_ref(const lx_block_q4_1 *x, float *y, int64_t n)
    void lx_dequantize_row_q5_0_ref(const lx_block_q5_0 *x, float *y, int64_t n)
    void lx_dequantize_row_q5_1_ref(const lx_block_q5_1 *x, float *y, int64_t n)
    void lx_dequantize_row_q8_0_ref(const lx_block_q8_0 *x, float *y, int64_t n)
    void lx_dequantize_row_q2_K_ref(const lx_block_q2_K *x, float *y, int64_t n)
    void lx_dequantize_row_q3_K_ref(const lx_block_q3_K *x, float *y, int64_t n)
    void lx_dequantize_row_q4_K_ref(const lx_block_q4_K *x, float *y, int64_t n)
    void lx_dequantize_row_q5_K_ref(const lx_block_q5_K *x, float *y, int64_t n)
    void lx_dequantize_row_q6_K_ref(const lx_block_q6_K *x, float *y, int64_t n)
    void lx_bf16_to_fp32_row(const uint16_t *x, float *y, int64_t n)

    # x: [n] float32, y: the row's blocks
    void lx_quantize_row_q8_0(const float *x, lx_block_q8_0 *y, int64_t n)
    void lx_quantize_row_q8_0_ref(const float *x, lx_block_q8_0 *y, int64_t n)
    void lx_quantize_row_q8_1(const float *x, lx_block_q8_1 *y, int64_t n)
    void lx_quantize_row_q8_1_ref(const float *x, lx_block_q8_1 *y, int64_t n)
    void lx_quantize_row_q8_split(lx_type dt, const float *x, int8_t *qs, float *d, float *s, int32_t *sum,
                                  int64_t n)
    void lx_quantize_row_q8_split_ref(lx_type dt, const float *x, int8_t *qs, float *d, float *s, int32_t *sum,
                                      int64_t n)
    void lx_quantize_row_q8_K(const float *x, lx_block_q8_K *y, int64_t n)
    void lx_quantize_row_q8_K_ref(const float *x, lx_block_q8_K *y, int64_t n)
    void lx_quantize_row_q4_0(const float *x, lx_block_q4_0 *y, int64_t n)
    void lx_quantize_row_q4_0_ref(const float *x, lx_block_q4_0 *y, int64_t n)
    # x: [n] float32, y: lx_row_bytes(t, n) bytes
    lx_status lx_quantize_row(lx_type t, const float *x, void *y, int64_t n)
    lx_status lx_quantize_row_ref(lx_type t, const float *x, void *y, int64_t n)

    int lx_type_is_cache(lx_type t)
    # src [n][n_per_row] float32, dst [n_dst_rows] rows of lx_row_bytes(t, n_per_row) bytes, idxs [n]
    lx_status lx_set_rows(lx_type t, const float *src, void *dst, const uint32_t *idxs, int64_t n,
                          int64_t n_per_row, int n_threads)
    lx_status lx_set_rows_ref(lx_type t, const float *src, void *dst, const uint32_t *idxs, int64_t n,
                              int64_t n_per_row)

