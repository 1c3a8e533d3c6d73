# buffers.pxd: mirrors csrc/buffers.h (declarations only).
from libc.stdint cimport int64_t, uint8_t, uint64_t


cdef extern from "buffers.h" nogil:
    ctypedef struct lx_move:
        uint8_t *dst          # [rows, dst_stride]
        const uint8_t *src    # [rows, src_stride]
        size_t n              # bytes per row
        size_t rows
        size_t dst_stride
        size_t src_stride
        size_t at             # offset of row 0 in the checksummed stream

    uint64_t lx_move_xor(const lx_move *moves, int64_t n_moves, int n_threads)
    uint64_t lx_move_xor_ref(const lx_move *moves, int64_t n_moves)
    # p [n]
    uint64_t lx_xor64(const uint8_t *p, size_t n, int n_threads)
    uint64_t lx_xor64_ref(const uint8_t *p, size_t n)
